#![allow(clippy::unwrap_used)]

use super::*;
use crate::daemonset::tests::{tainted, toleration};
use k8s_openapi::api::core::v1::{PodSpec, Toleration};
use kube::api::ObjectMeta;

#[test]
fn truncate_keeps_char_boundaries() {
    assert_eq!(truncate("short", 10), "short");
    let long = "é".repeat(600);
    let t = truncate(&long, 1024);
    assert!(t.len() <= 1024 && t.ends_with("..."));
}

/// A pod in namespace `ns` controlled by DaemonSet `vm`.
fn daemon_pod() -> Pod {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
    Pod {
        metadata: ObjectMeta {
            namespace: Some("ns".into()),
            owner_references: Some(vec![OwnerReference {
                api_version: "apps/v1".into(),
                kind: "DaemonSet".into(),
                name: "vm".into(),
                controller: Some(true),
                ..OwnerReference::default()
            }]),
            ..ObjectMeta::default()
        },
        ..Pod::default()
    }
}

/// A DaemonSet whose pod template is `spec`.
fn daemonset(spec: PodSpec) -> DaemonSet {
    use k8s_openapi::api::apps::v1::DaemonSetSpec;
    use k8s_openapi::api::core::v1::PodTemplateSpec;
    DaemonSet {
        spec: Some(DaemonSetSpec {
            template: PodTemplateSpec {
                spec: Some(spec),
                ..PodTemplateSpec::default()
            },
            ..DaemonSetSpec::default()
        }),
        ..DaemonSet::default()
    }
}

#[test]
fn a_stop_restores_when_a_no_execute_taint_would_evict_the_pod() {
    let identity = Identity {
        node: "node-a".into(),
        pod: Some(("ns".into(), "vm-1".into())),
        controller: "vfio-manager".into(),
    };
    let ds = |tolerations: Option<Vec<Toleration>>| {
        daemonset(PodSpec {
            tolerations,
            ..PodSpec::default()
        })
    };
    let objects = |ds: DaemonSet| StopObjects {
        pod: Some(daemon_pod()),
        daemonset: Some(ds),
        node: Some(tainted(&[("maint", None, "NoExecute")])),
    };
    match decide(&identity, &objects(ds(None))) {
        Verdict::Restore(why) => assert!(why.contains("maint:NoExecute"), "{why}"),
        v => panic!("{v:?}"),
    }
    let all = Some(vec![toleration("", "Exists", None, "")]);
    assert!(matches!(
        decide(&identity, &objects(ds(all))),
        Verdict::Keep(_)
    ));
    // A template pinned to another node restores too.
    let mut pinned = ds(Some(vec![toleration("", "Exists", None, "")]));
    if let Some(s) = pinned.spec.as_mut().and_then(|s| s.template.spec.as_mut()) {
        s.node_name = Some("node-b".into());
    }
    assert!(matches!(
        decide(&identity, &objects(pinned)),
        Verdict::Restore(_)
    ));
}

#[test]
fn a_stop_without_the_pod_or_its_daemonset_restores() {
    let identity = Identity {
        node: "node-a".into(),
        pod: Some(("ns".into(), "vm-1".into())),
        controller: "vfio-manager".into(),
    };
    let said = |identity: &Identity, objects: &StopObjects| match decide(identity, objects) {
        Verdict::Restore(why) => why,
        v => panic!("{v:?}"),
    };
    let none = StopObjects::default();
    assert_eq!(said(&identity, &none), "Pod ns/vm-1 is not found");
    let orphan = StopObjects {
        pod: Some(Pod::default()),
        ..StopObjects::default()
    };
    assert_eq!(
        said(&identity, &orphan),
        "Pod ns/vm-1 is not managed by a DaemonSet"
    );
    let deleted = StopObjects {
        pod: Some(daemon_pod()),
        ..StopObjects::default()
    };
    assert_eq!(said(&identity, &deleted), "DaemonSet ns/vm was deleted");
    let unnamed = Identity {
        pod: None,
        ..identity.clone()
    };
    assert!(said(&unnamed, &deleted).starts_with("POD_NAME/POD_NAMESPACE are not set"));
}
