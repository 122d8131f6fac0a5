//! The restore-vs-keep decision of a stopping agent, asked of a stand-in API server
//! over real HTTP by the real kube-rs client: a rollout keeps the devices, a node
//! that left VM mode (label removed, label set to `container`, DaemonSet deleted)
//! restores them, and an API server that cannot answer restores too.

#![allow(clippy::unwrap_used)]

use fake_apiserver::{objects, paths, FakeApiServer};
use node_agent::cluster::{Cluster, Identity, Verdict};
use serde_json::json;

const NS: &str = "vfio-sandbox";
const DS: &str = "vfio-manager";
const POD: &str = "vfio-manager-x7k2p";
const NODE: &str = "node-a";
const LABEL: &str = "rebellions.ai/npu.workload.config";

/// The standalone overlay's cluster: one label puts the node in VM mode.
fn cluster_in_vm_mode() -> FakeApiServer {
    let s = FakeApiServer::start().unwrap();
    s.put(
        &paths::node(NODE),
        objects::node(
            NODE,
            &[(LABEL, "vm-passthrough"), ("kubernetes.io/arch", "amd64")],
        ),
    );
    s.put(
        &paths::daemonset(NS, DS),
        objects::daemonset(NS, DS, &[(LABEL, "vm-passthrough")]),
    );
    s.put(&paths::pod(NS, POD), objects::pod(NS, POD, NODE, DS));
    s
}

fn identity() -> Identity {
    Identity {
        node: NODE.into(),
        pod: Some((NS.into(), POD.into())),
        controller: "vfio-manager".into(),
    }
}

fn verdict(s: &FakeApiServer) -> Verdict {
    verdict_as(s, identity())
}

fn verdict_as(s: &FakeApiServer, id: Identity) -> Verdict {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let config = kube::Config::new(s.url().parse().unwrap());
        Cluster::with_config(id, config)
            .unwrap()
            .stop_verdict()
            .await
    })
}

fn relabel(s: &FakeApiServer, value: Option<&str>) {
    let mut node = s.get(&paths::node(NODE)).unwrap();
    fake_apiserver::merge_patch(&mut node, &json!({"metadata": {"labels": {LABEL: value}}}));
    s.put(&paths::node(NODE), node);
}

#[track_caller]
fn assert_restore(v: &Verdict, why: &str) {
    match v {
        Verdict::Restore(reason) => assert!(
            reason.contains(why),
            "restore, but for {reason:?} (expected {why:?})"
        ),
        Verdict::Keep(reason) => panic!("kept ({reason}); expected a restore because {why}"),
    }
}

#[test]
fn a_rollout_keeps_the_devices_bound() {
    let s = cluster_in_vm_mode();
    match verdict(&s) {
        Verdict::Keep(reason) => assert!(
            reason.contains("still selected by DaemonSet vfio-sandbox/vfio-manager"),
            "{reason}"
        ),
        v => panic!("a rollout must keep the devices: {v:?}"),
    }
    // It asked for exactly its own objects.
    let asked: Vec<String> = s
        .requests()
        .into_iter()
        .map(|(m, p)| format!("{m} {p}"))
        .collect();
    assert_eq!(
        asked,
        [
            format!("GET {}", paths::pod(NS, POD)),
            format!("GET {}", paths::daemonset(NS, DS)),
            format!("GET {}", paths::node(NODE)),
        ]
    );
}

#[test]
fn the_label_removed_restores() {
    let s = cluster_in_vm_mode();
    relabel(&s, None);
    assert_restore(
        &verdict(&s),
        "label rebellions.ai/npu.workload.config is gone",
    );
}

#[test]
fn the_label_set_to_container_restores() {
    let s = cluster_in_vm_mode();
    relabel(&s, Some("container"));
    assert_restore(
        &verdict(&s),
        "label rebellions.ai/npu.workload.config=container",
    );
    // And back: the next pod's stop keeps again.
    relabel(&s, Some("vm-passthrough"));
    assert!(matches!(verdict(&s), Verdict::Keep(_)));
}

#[test]
fn the_daemonset_deleted_restores() {
    let s = cluster_in_vm_mode();
    assert!(s.remove(&paths::daemonset(NS, DS)));
    assert_restore(
        &verdict(&s),
        "DaemonSet vfio-sandbox/vfio-manager was deleted",
    );
}

#[test]
fn a_daemonset_being_deleted_in_the_foreground_restores() {
    let s = cluster_in_vm_mode();
    let mut ds = s.get(&paths::daemonset(NS, DS)).unwrap();
    fake_apiserver::merge_patch(
        &mut ds,
        &json!({"metadata": {"deletionTimestamp": "2026-11-21T10:00:00Z", "finalizers": ["foregroundDeletion"]}}),
    );
    s.put(&paths::daemonset(NS, DS), ds);
    assert_restore(&verdict(&s), "is being deleted");
}

#[test]
fn a_template_that_no_longer_selects_the_node_restores() {
    // A rollout that changes the selector (another overlay applied): the new pods
    // would not land here, so this one gives the devices back.
    let s = cluster_in_vm_mode();
    s.put(
        &paths::daemonset(NS, DS),
        objects::daemonset(NS, DS, &[("rebellions.ai/npu.deploy.vfio-manager", "true")]),
    );
    assert_restore(&verdict(&s), "rebellions.ai/npu.deploy.vfio-manager");
}

#[test]
fn the_node_or_the_pod_gone_restores() {
    let s = cluster_in_vm_mode();
    s.remove(&paths::node(NODE));
    assert_restore(&verdict(&s), "Node node-a is not found");
    let s = cluster_in_vm_mode();
    s.remove(&paths::pod(NS, POD));
    assert_restore(
        &verdict(&s),
        "Pod vfio-sandbox/vfio-manager-x7k2p is not found",
    );
}

#[test]
fn a_pod_without_a_daemonset_restores() {
    let s = cluster_in_vm_mode();
    let mut pod = s.get(&paths::pod(NS, POD)).unwrap();
    fake_apiserver::merge_patch(&mut pod, &json!({"metadata": {"ownerReferences": null}}));
    s.put(&paths::pod(NS, POD), pod);
    assert_restore(&verdict(&s), "is not managed by a DaemonSet");
    let id = Identity {
        pod: None,
        ..identity()
    };
    assert_restore(&verdict_as(&s, id), "POD_NAME/POD_NAMESPACE are not set");
}

#[test]
fn an_api_server_that_fails_or_is_gone_restores() {
    let s = cluster_in_vm_mode();
    s.fail_next(3, 500);
    assert_restore(&verdict(&s), "the API server could not tell");
    let s = cluster_in_vm_mode();
    s.fail_next(1, 403);
    assert_restore(&verdict(&s), "the API server could not tell");
    // Nothing listening at all.
    let url = {
        let gone = FakeApiServer::start().unwrap();
        gone.url()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let v = rt.block_on(async {
        Cluster::with_config(identity(), kube::Config::new(url.parse().unwrap()))
            .unwrap()
            .stop_verdict()
            .await
    });
    assert_restore(&v, "the API server could not tell");
}

#[test]
fn node_events_reach_the_api_server() {
    let s = cluster_in_vm_mode();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c =
            Cluster::with_config(identity(), kube::Config::new(s.url().parse().unwrap())).unwrap();
        c.node_event(
            false,
            "DevicesBound",
            "Bind",
            "bound 3 devices in 2 IOMMU groups to vfio-pci",
        )
        .await
        .unwrap();
        c.node_event(
            true,
            "GroupHeld",
            "Restore",
            "IOMMU group 5 is held by a VM",
        )
        .await
        .unwrap();
    });
    let events = s.list(&paths::events("default"));
    assert_eq!(events.len(), 2, "{events:?}");
    let bound = events
        .iter()
        .find(|e| e["reason"] == "DevicesBound")
        .unwrap();
    assert_eq!(bound["type"], "Normal");
    assert_eq!(bound["regarding"]["kind"], "Node");
    assert_eq!(bound["regarding"]["name"], NODE);
    assert_eq!(bound["reportingController"], "vfio-manager");
    assert_eq!(bound["reportingInstance"], POD);
    assert_eq!(
        bound["note"],
        "bound 3 devices in 2 IOMMU groups to vfio-pci"
    );
    let held = events.iter().find(|e| e["reason"] == "GroupHeld").unwrap();
    assert_eq!(held["type"], "Warning");
}
