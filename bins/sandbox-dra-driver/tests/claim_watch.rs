//! Which claims the driver watches for the early move (`--claim-watch`): the
//! real `sandbox-dra-driver` on a fake node against the stand-in API server,
//! which filters watches by label selector as the real one does (a claim that
//! leaves the selection is sent as a deletion). The tests play the claim
//! labeller by writing its label.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::driver::*;
use common::*;
use fake_apiserver::{paths, FakeApiServer};
use kubelet_peer::dra::ClaimRef;
use serde_json::{json, Value};

const ALWAYS: (&str, &str) = ("VFIO_SANDBOX_BINDING_CONDITIONS", "always");
const LABELLED: (&str, &str) = ("VFIO_SANDBOX_CLAIM_WATCH", "labelled");
const KEY: &str = "vfio-sandbox.rebellions.ai/node";

/// Creates claim `NS/name` allocated to the NIC as kube-scheduler does, with
/// the labeller's label for `label` if given.
fn allocate(server: &FakeApiServer, name: &str, label: Option<&str>) -> ClaimRef {
    let mut claim = fake_apiserver::objects::resource_claim(NS, name, &format!("uid-{name}"), None);
    claim["status"] = json!({
        "allocation": fake_apiserver::objects::allocation(&[ours("nic", "pci-0000-02-00-0")], NODE, Some(WAITS)),
    });
    if let Some(node) = label {
        claim["metadata"]["labels"] = json!({ KEY: node });
    }
    server.put(&paths::resourceclaim(NS, name), claim);
    claim_ref(name, &format!("uid-{name}"))
}

fn claim(server: &FakeApiServer, name: &str) -> Value {
    server.get(&paths::resourceclaim(NS, name)).unwrap()
}

/// Sets (`Some`) or removes the labeller's label.
fn label(server: &FakeApiServer, name: &str, node: Option<&str>) {
    let mut c = claim(server, name);
    match node {
        Some(n) => c["metadata"]["labels"] = json!({ KEY: n }),
        None => c["metadata"]["labels"] = json!({}),
    }
    server.put(&paths::resourceclaim(NS, name), c);
}

fn phase(scene: &Scene, uid: &str) -> Option<String> {
    state_claims(scene)
        .get(uid)
        .map(|c| c["phase"].as_str().unwrap().to_owned())
}

async fn wait_binding_conditions(driver: &mut Driver, server: &FakeApiServer) {
    driver
        .wait_until("binding conditions in the slice", || {
            slices(server)
                .iter()
                .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
                .any(|d| d["name"] == "pci-0000-02-00-0" && d["bindingConditions"][0] == READY)
        })
        .await;
}

#[tokio::test]
async fn a_labelled_watch_moves_only_claims_labelled_for_its_node() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start_with(&server, &[ALWAYS, LABELLED]).await;
    let _reg = register(&scene).await;
    wait_binding_conditions(&mut driver, &server).await;
    let watches: Vec<String> = server
        .requests()
        .into_iter()
        .filter(|(m, p)| m == "GET" && p.contains("/resourceclaims?") && p.contains("watch=true"))
        .map(|(_, p)| p)
        .collect();
    assert!(
        !watches.is_empty()
            && watches
                .iter()
                .all(|p| p.contains("labelSelector=vfio-sandbox.rebellions.ai%2Fnode%3Dnode-a")),
        "{watches:?}"
    );

    // Allocated, not labelled yet: not this node's to see.
    let a = allocate(&server, "vm-a", None);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(phase(&scene, &a.uid), None, "{}", driver.log());
    // Labelled for another node: still not.
    label(&server, "vm-a", Some("node-b"));
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(phase(&scene, &a.uid), None, "{}", driver.log());
    // Labelled for this node: moved, and ready for binding.
    label(&server, "vm-a", Some(NODE));
    driver
        .wait_until("claim a ready for binding", || {
            fake_apiserver::objects::condition_true_on_all(&claim(&server, "vm-a"), READY)
        })
        .await;
    assert_eq!(phase(&scene, &a.uid).as_deref(), Some("moved"));

    // Deallocated: the labeller removes the label, and the claim leaves the
    // selection (a deletion on this node's watch): given back.
    let mut c = claim(&server, "vm-a");
    fake_apiserver::objects::deallocate(&mut c);
    server.put(&paths::resourceclaim(NS, "vm-a"), c);
    label(&server, "vm-a", None);
    driver
        .wait_until("claim a given back", || phase(&scene, &a.uid).is_none())
        .await;
    assert!(state_devices(&scene).is_empty());
    assert!(!driver.log().contains("panicked"), "{}", driver.log());
}

#[tokio::test]
async fn a_claim_moved_early_that_a_labelled_list_misses_is_read_before_it_is_given_back() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start_with(&server, &[ALWAYS, LABELLED]).await;
    let _reg = register(&scene).await;
    wait_binding_conditions(&mut driver, &server).await;
    let a = allocate(&server, "vm-a", Some(NODE));
    driver
        .wait_until("claim a moved", || {
            phase(&scene, &a.uid).as_deref() == Some("moved")
        })
        .await;

    // While the driver is down the label goes (a labeller between two
    // leaders, say) but the claim stays allocated here: the restart's list
    // does not show it, the driver reads it and keeps its devices.
    driver.kill();
    label(&server, "vm-a", None);
    let mut driver = scene.start_with(&server, &[ALWAYS, LABELLED]).await;
    driver
        .wait_until("the claim read", || {
            server
                .requests()
                .iter()
                .any(|(m, p)| m == "GET" && p.ends_with("/namespaces/vms/resourceclaims/vm-a"))
        })
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        phase(&scene, &a.uid).as_deref(),
        Some("moved"),
        "{}",
        driver.log()
    );

    // Deleted while the driver is down: the read finds it gone, given back.
    driver.kill();
    server.remove(&paths::resourceclaim(NS, "vm-a"));
    let mut driver = scene.start_with(&server, &[ALWAYS, LABELLED]).await;
    driver
        .wait_until("claim a given back after the restart", || {
            phase(&scene, &a.uid).is_none()
        })
        .await;
    assert!(
        driver.log().contains("no longer allocated here"),
        "{}",
        driver.log()
    );
    assert!(state_devices(&scene).is_empty());
}

#[tokio::test]
async fn auto_without_a_labeller_lease_watches_every_claim() {
    let scene = Scene::new();
    let server = cluster();
    // As the DaemonSet runs it: POD_NAMESPACE set, --claim-watch at its
    // default. The stand-in server has no Lease: no labeller.
    let mut driver = scene
        .start_with(&server, &[ALWAYS, ("POD_NAMESPACE", DRIVER_NS)])
        .await;
    let _reg = register(&scene).await;
    wait_binding_conditions(&mut driver, &server).await;
    let a = allocate(&server, "vm-a", None);
    driver
        .wait_until("claim a moved with no label", || {
            phase(&scene, &a.uid).as_deref() == Some("moved")
        })
        .await;
    assert!(
        driver
            .log()
            .contains("no claim labeller holds and renews its Lease: watching every ResourceClaim"),
        "{}",
        driver.log()
    );
    assert!(server.requests().iter().any(|(m, p)| m == "GET"
        && p.contains(
            "/apis/coordination.k8s.io/v1/namespaces/vfio-sandbox/leases/sandbox-dra-controller"
        )));
}
