#![allow(clippy::unwrap_used)]

use fake_apiserver::{objects, paths, FakeApiServer};
use serde_json::json;

use super::*;

const NS: &str = "vfio-sandbox";
const DS: &str = "vfio-manager";
const POD: &str = "vfio-manager-x7k2p";
const NODE: &str = "node-a";
const LABEL: &str = "rebellions.ai/npu.workload.config";
const PENDING: &str = "vfio-sandbox.rebellions.ai/vfio-manager.restore-pending";

fn identity() -> Identity {
    Identity {
        node: NODE.into(),
        pod: Some((NS.into(), POD.into())),
        controller: "vfio-manager".into(),
    }
}

/// The objects of a stop: the shipped DaemonSet's shape (VM mode, or a restore
/// to finish) and a Node with `labels`.
fn objects(labels: &[(&str, &str)]) -> StopObjects {
    StopObjects {
        pod: Some(serde_json::from_value(objects::pod(NS, POD, NODE, DS)).unwrap()),
        daemonset: Some(
            serde_json::from_value(objects::daemonset_with_restore_label(
                NS,
                DS,
                &[(LABEL, "vm-passthrough")],
                PENDING,
            ))
            .unwrap(),
        ),
        node: Some(serde_json::from_value(objects::node(NODE, labels)).unwrap()),
    }
}

#[test]
fn the_restore_label_keeps_the_pod_scheduled_but_not_the_node_in_vm_mode() {
    let both = objects(&[(LABEL, "vm-passthrough"), (PENDING, "true")]);
    let pending = objects(&[(PENDING, "true")]);
    // The DaemonSet controller keeps the pod on both nodes ...
    let ds = both.daemonset.as_ref().unwrap();
    let spec = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    for o in [&both, &pending] {
        assert!(node_agent::daemonset::node_selected(spec, o.node.as_ref().unwrap()).is_ok());
    }
    // ... but only the first is in VM mode.
    let check = judge(&identity(), Some(PENDING), both);
    assert!(matches!(check.verdict, Verdict::Keep(_)), "{check:?}");
    assert!(check.labelled);
    let check = judge(&identity(), Some(PENDING), pending.clone());
    match &check.verdict {
        Verdict::Restore(why) => {
            assert!(why.contains(LABEL), "{why}");
            assert!(why.contains(&format!("judged without {PENDING}")), "{why}");
        }
        v => panic!("{v:?}"),
    }
    assert!(check.labelled);
    // Without the label's key the label is taken for VM mode.
    let check = judge(&identity(), None, pending);
    assert!(matches!(check.verdict, Verdict::Keep(_)), "{check:?}");
    assert!(!check.labelled);
}

/// A stand-in API server holding the node in VM mode with the shipped DaemonSet.
fn cluster_in_vm_mode() -> FakeApiServer {
    let s = FakeApiServer::start().unwrap();
    s.put(
        &paths::node(NODE),
        objects::node(NODE, &[(LABEL, "vm-passthrough")]),
    );
    s.put(&paths::pod(NS, POD), objects::pod(NS, POD, NODE, DS));
    s
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
fn the_restore_label_is_put_and_taken_by_merge_patch_and_judged_without() {
    let s = cluster_in_vm_mode();
    s.put(
        &paths::daemonset(NS, DS),
        objects::daemonset_with_restore_label(NS, DS, &[(LABEL, "vm-passthrough")], PENDING),
    );
    let id = identity();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cluster = rt.block_on(async {
        ManagerCluster {
            cluster: Cluster::with_config(id, kube::Config::new(s.url().parse().unwrap())).unwrap(),
            label: Some(PENDING.into()),
        }
    });
    let labels = || s.get(&paths::node(NODE)).unwrap()["metadata"]["labels"].clone();
    rt.block_on(cluster.set_label(true)).unwrap();
    assert_eq!(labels()[PENDING], "true");
    assert_eq!(labels()[LABEL], "vm-passthrough", "other labels stay");
    let check = rt.block_on(cluster.check()).unwrap();
    assert!(check.labelled);
    assert!(matches!(check.verdict, Verdict::Keep(_)), "{check:?}");
    // Out of VM mode: the label alone still schedules the pod, but the verdict is
    // restore.
    relabel(&s, None);
    let check = rt.block_on(cluster.check()).unwrap();
    assert_restore(&check.verdict, "no required node affinity term matches");
    rt.block_on(cluster.set_label(false)).unwrap();
    assert!(labels().get(PENDING).is_none(), "{}", labels());
    assert!(!rt.block_on(cluster.check()).unwrap().labelled);
    // A failing server is an error, said with what was asked.
    s.fail_next(1, 403);
    let e = rt
        .block_on(cluster.set_label(true))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("label Node {NODE} {PENDING}=true")),
        "{e}"
    );
}
