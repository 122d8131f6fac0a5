#![allow(clippy::unwrap_used)]

use super::*;
use k8s_openapi::api::core::v1::{Affinity, NodeAffinity, NodeSelector, NodeSelectorTerm};
use kube::api::ObjectMeta;

pub(crate) fn node(labels: &[(&str, &str)]) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some("node-a".into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).into(), (*v).into()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        ..Node::default()
    }
}

pub(crate) fn req(key: &str, op: &str, values: &[&str]) -> NodeSelectorRequirement {
    NodeSelectorRequirement {
        key: key.into(),
        operator: op.into(),
        values: (!values.is_empty()).then(|| values.iter().map(|v| (*v).into()).collect()),
    }
}

pub(crate) fn affinity(
    terms: Vec<(Vec<NodeSelectorRequirement>, Vec<NodeSelectorRequirement>)>,
) -> PodSpec {
    PodSpec {
        affinity: Some(Affinity {
            node_affinity: Some(NodeAffinity {
                required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                    node_selector_terms: terms
                        .into_iter()
                        .map(|(e, f)| NodeSelectorTerm {
                            match_expressions: Some(e),
                            match_fields: Some(f),
                        })
                        .collect(),
                }),
                ..NodeAffinity::default()
            }),
            ..Affinity::default()
        }),
        ..PodSpec::default()
    }
}

pub(crate) fn tainted(taints: &[(&str, Option<&str>, &str)]) -> Node {
    let mut n = node(&[("a", "1")]);
    n.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
        taints: Some(
            taints
                .iter()
                .map(|(key, value, effect)| Taint {
                    key: (*key).into(),
                    value: value.map(Into::into),
                    effect: (*effect).into(),
                    time_added: None,
                })
                .collect(),
        ),
        ..Default::default()
    });
    n
}

pub(crate) fn toleration(key: &str, op: &str, value: Option<&str>, effect: &str) -> Toleration {
    Toleration {
        key: (!key.is_empty()).then(|| key.into()),
        operator: (!op.is_empty()).then(|| op.into()),
        value: value.map(Into::into),
        effect: (!effect.is_empty()).then(|| effect.into()),
        toleration_seconds: None,
    }
}

#[test]
fn node_selector_needs_every_label_with_its_value() {
    let spec = PodSpec {
        node_selector: Some(
            [
                ("a".to_owned(), "1".to_owned()),
                ("b".to_owned(), "2".to_owned()),
            ]
            .into(),
        ),
        ..PodSpec::default()
    };
    assert!(node_selected(&spec, &node(&[("a", "1"), ("b", "2"), ("c", "3")])).is_ok());
    let why = node_selected(&spec, &node(&[("a", "1"), ("b", "container")])).unwrap_err();
    assert!(
        why.contains("b=container") && why.contains("wants b=2"),
        "{why}"
    );
    let why = node_selected(&spec, &node(&[("b", "2")])).unwrap_err();
    assert!(why.contains("label a is gone"), "{why}");
    assert!(
        node_selected(&PodSpec::default(), &node(&[])).is_ok(),
        "no selector selects every node"
    );
}

#[test]
fn required_affinity_ors_terms_and_ands_expressions() {
    let spec = affinity(vec![
        (
            vec![
                req("mode", "In", &["vm", "vm-passthrough"]),
                req("gpu", "Exists", &[]),
            ],
            vec![],
        ),
        (vec![req("override", "In", &["yes"])], vec![]),
    ]);
    assert!(node_selected(&spec, &node(&[("mode", "vm"), ("gpu", "")])).is_ok());
    assert!(node_selected(&spec, &node(&[("override", "yes")])).is_ok());
    assert!(node_selected(&spec, &node(&[("mode", "vm")])).is_err());
    let why = node_selected(&spec, &node(&[("mode", "container"), ("gpu", "x")])).unwrap_err();
    assert!(why.contains("mode In"), "{why}");
}

#[test]
fn every_operator_and_match_fields() {
    let n = node(&[("count", "8"), ("zone", "a")]);
    let ok = |r| node_selected(&affinity(vec![(vec![r], vec![])]), &n).is_ok();
    assert!(ok(req("zone", "NotIn", &["b"])));
    assert!(!ok(req("zone", "NotIn", &["a"])));
    assert!(ok(req("missing", "NotIn", &["a"])));
    assert!(ok(req("missing", "DoesNotExist", &[])));
    assert!(!ok(req("zone", "DoesNotExist", &[])));
    assert!(ok(req("count", "Gt", &["7"])));
    assert!(!ok(req("count", "Gt", &["8"])));
    assert!(ok(req("count", "Lt", &["9"])));
    assert!(
        !ok(req("zone", "Lt", &["9"])),
        "a non-number never compares"
    );
    assert!(
        !ok(req("zone", "Bogus", &["a"])),
        "an unknown operator never matches"
    );
    let by_name = |v: &str| {
        node_selected(
            &affinity(vec![(vec![], vec![req("metadata.name", "In", &[v])])]),
            &n,
        )
        .is_ok()
    };
    assert!(by_name("node-a"));
    assert!(!by_name("node-b"));
    assert!(
        node_selected(&affinity(vec![(vec![], vec![])]), &n).is_err(),
        "an empty term matches nothing"
    );
}

#[test]
fn an_untolerated_no_execute_taint_evicts_and_no_schedule_does_not() {
    let bare = PodSpec::default();
    // NoSchedule only keeps new pods away; a running one stays.
    assert!(tolerates_no_execute(&bare, &tainted(&[("gpu", Some("x"), "NoSchedule")])).is_ok());
    let why =
        tolerates_no_execute(&bare, &tainted(&[("maint", Some("now"), "NoExecute")])).unwrap_err();
    assert!(why.contains("maint=now:NoExecute"), "{why}");
    // The DaemonSet controller's own tolerations: not-ready and unreachable.
    assert!(tolerates_no_execute(
        &bare,
        &tainted(&[
            ("node.kubernetes.io/not-ready", None, "NoExecute"),
            ("node.kubernetes.io/unreachable", None, "NoExecute"),
        ])
    )
    .is_ok());
    // But not the other conditions' taints with NoExecute.
    assert!(tolerates_no_execute(
        &bare,
        &tainted(&[(
            "node.kubernetes.io/out-of-service",
            Some("nodeshutdown"),
            "NoExecute"
        )])
    )
    .is_err());
}

#[test]
fn tolerations_match_as_the_api_does() {
    let taint = tainted(&[("maint", Some("now"), "NoExecute")]);
    let with = |tols: Vec<Toleration>| PodSpec {
        tolerations: Some(tols),
        ..PodSpec::default()
    };
    let ok = |tols| tolerates_no_execute(&with(tols), &taint).is_ok();
    assert!(
        ok(vec![toleration("", "Exists", None, "")]),
        "tolerate everything"
    );
    assert!(ok(vec![toleration("maint", "Exists", None, "")]));
    assert!(ok(vec![toleration(
        "maint",
        "Equal",
        Some("now"),
        "NoExecute"
    )]));
    assert!(
        ok(vec![toleration("maint", "", Some("now"), "")]),
        "empty operator is Equal"
    );
    assert!(!ok(vec![toleration("maint", "Equal", Some("later"), "")]));
    assert!(!ok(vec![toleration("maint", "Exists", None, "NoSchedule")]));
    assert!(!ok(vec![toleration("other", "Exists", None, "")]));
    assert!(!ok(vec![toleration("maint", "Lt", Some("now"), "")]));
}
