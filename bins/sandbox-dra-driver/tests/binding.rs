//! Devices ready before the pod binds (KEP-5007 binding conditions, KEP-4817 claim
//! device status): the real `sandbox-dra-driver` on a fake node against the
//! stand-in API server. The tests write each claim's allocation with the
//! driver's binding conditions (`fake_apiserver::objects::allocation`), take it
//! back where the scheduler would, read the conditions the driver sets in the
//! claim's `status.devices`, and prepare through the kubelet-like peer; the real
//! kube-scheduler's part (copying the conditions, PreBind's wait, giving the
//! allocation up) is checked against it in tests/k8s (`dra-binding-conditions`).
//!
//! The fake node's devices are on vfio-pci already, so these runs use
//! `--binding-conditions=always`; the real-kernel scenario moves NICs off e1000e
//! under `auto`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::driver::*;
use common::*;
use fake_apiserver::objects::DeviceResult;
use fake_apiserver::{paths, FakeApiServer};
use kubelet_peer::dra::{ClaimRef, Version};
use serde_json::Value;

const ALWAYS: (&str, &str) = ("VFIO_SANDBOX_BINDING_CONDITIONS", "always");

/// Creates claim `NS/name` allocated `results`, each waiting on the driver's
/// binding conditions.
fn allocate(server: &FakeApiServer, name: &str, results: &[DeviceResult]) -> ClaimRef {
    let mut claim = fake_apiserver::objects::resource_claim(NS, name, &format!("uid-{name}"), None);
    claim["status"] = serde_json::json!({
        "allocation": fake_apiserver::objects::allocation(results, NODE, Some(WAITS)),
    });
    server.put(&paths::resourceclaim(NS, name), claim);
    claim_ref(name, &format!("uid-{name}"))
}

fn claim(server: &FakeApiServer, name: &str) -> Option<Value> {
    server.get(&paths::resourceclaim(NS, name))
}

/// The claim's phase in the driver's state file.
fn phase(scene: &Scene, uid: &str) -> Option<String> {
    state_claims(scene)
        .get(uid)
        .map(|c| c["phase"].as_str().unwrap().to_owned())
}

/// Whether the driver set VfioReady on every device of the claim.
fn ready(server: &FakeApiServer, name: &str) -> bool {
    claim(server, name).is_some_and(|c| fake_apiserver::objects::condition_true_on_all(&c, READY))
}

/// The claim's VfioFailed, if the driver set it: `reason=R, message="M"`.
fn failure(server: &FakeApiServer, name: &str) -> Option<String> {
    claim(server, name).and_then(|c| fake_apiserver::objects::condition_true_on_any(&c, FAILED))
}

/// The device's binding fields in the slice.
fn published(server: &FakeApiServer, device: &str) -> Value {
    slices(server)
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .find(|d| d["name"] == device)
        .unwrap_or(Value::Null)
}

#[tokio::test]
async fn a_claim_is_moved_before_binding_and_prepare_only_writes_its_files() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start_with(&server, &[ALWAYS]).await;
    let _reg = register(&scene).await;
    driver
        .wait_until("binding conditions in the slice", || {
            published(&server, "pci-0000-02-00-0")["bindingConditions"][0] == READY
        })
        .await;
    let d = published(&server, "pci-0000-02-00-0");
    assert_eq!(d["bindingFailureConditions"][0], FAILED);
    assert_eq!(d["bindsToNode"], true);

    let c = allocate(&server, "vm-a", &[ours("nic", "pci-0000-02-00-0")]);
    driver
        .wait_until("the claim ready for binding", || ready(&server, "vm-a"))
        .await;
    let status = &claim(&server, "vm-a").unwrap()["status"]["devices"][0];
    assert_eq!(status["driver"], DRIVER);
    assert_eq!(status["pool"], NODE);
    assert_eq!(status["conditions"][0]["type"], READY);
    assert_eq!(status["conditions"][0]["reason"], "MovedToVfio");
    assert_eq!(phase(&scene, &c.uid).as_deref(), Some("moved"));
    assert!(!scene.cdi_spec(&c.uid).exists(), "no file before prepare");

    // The pod binds; kubelet prepares: the files, and the claim prepared.
    let mut client = scene.client(Version::V1).await;
    let answers = prepare(&mut client, std::slice::from_ref(&c)).await;
    assert!(answers[&c.uid].error.is_empty(), "{answers:?}");
    assert!(scene.cdi_spec(&c.uid).exists());
    assert_eq!(phase(&scene, &c.uid).as_deref(), Some("prepared"));
    // A watch event of the claim later changes nothing.
    let rv = claim(&server, "vm-a").unwrap()["metadata"]["resourceVersion"].clone();
    let mut touched = claim(&server, "vm-a").unwrap();
    touched["metadata"]["labels"] = serde_json::json!({"touched": "yes"});
    server.put(&paths::resourceclaim(NS, "vm-a"), touched);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(phase(&scene, &c.uid).as_deref(), Some("prepared"));
    assert_ne!(
        claim(&server, "vm-a").unwrap()["metadata"]["resourceVersion"],
        rv
    );
    unprepare(&mut client, std::slice::from_ref(&c)).await;
    assert_eq!(phase(&scene, &c.uid), None);
    assert!(!driver.log().contains("panicked"), "{}", driver.log());
}

#[tokio::test]
async fn a_claim_that_loses_its_allocation_before_its_pod_starts_is_given_back() {
    let scene = Scene::new();
    let server = cluster();
    let metrics = ("VFIO_SANDBOX_METRICS_ADDRESS", "127.0.0.1:0");
    let mut driver = scene.start_with(&server, &[ALWAYS, metrics]).await;
    let address = metrics_address(&driver).expect("no metrics address in the log");
    let _reg = register(&scene).await;
    driver
        .wait_until("binding conditions in the slice", || {
            published(&server, "pci-0000-02-00-0")["bindingConditions"][0] == READY
        })
        .await;
    // Deallocated (the pod went elsewhere).
    let a = allocate(&server, "vm-a", &[ours("nic", "pci-0000-02-00-0")]);
    driver
        .wait_until("claim a moved", || {
            phase(&scene, &a.uid).as_deref() == Some("moved")
        })
        .await;
    let mut c = claim(&server, "vm-a").unwrap();
    fake_apiserver::objects::deallocate(&mut c);
    server.put(&paths::resourceclaim(NS, "vm-a"), c);
    driver
        .wait_until("claim a given back", || phase(&scene, &a.uid).is_none())
        .await;
    // Deleted.
    let b = allocate(&server, "vm-b", &[ours("nvme", "pci-0000-03-00-0")]);
    driver
        .wait_until("claim b moved", || {
            phase(&scene, &b.uid).as_deref() == Some("moved")
        })
        .await;
    server.remove(&paths::resourceclaim(NS, "vm-b"));
    driver
        .wait_until("claim b given back", || phase(&scene, &b.uid).is_none())
        .await;
    // Counted once the claims thread answers the watcher.
    for op in ["move_early", "give_back"] {
        let series = format!(r#"vfio_sandbox_dra_claims_total{{operation="{op}",result="ok"}}"#);
        driver
            .wait_until(&series, || value(&scrape(&address), &series) == 2.0)
            .await;
    }
    // Deleted while the driver was down: the restart's list finds it gone.
    let c = allocate(&server, "vm-c", &[ours("nic", "pci-0000-02-00-0")]);
    driver
        .wait_until("claim c moved", || {
            phase(&scene, &c.uid).as_deref() == Some("moved")
        })
        .await;
    driver.kill();
    server.remove(&paths::resourceclaim(NS, "vm-c"));
    let mut driver = scene.start_with(&server, &[ALWAYS]).await;
    driver
        .wait_until("claim c given back after the restart", || {
            phase(&scene, &c.uid).is_none()
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
async fn a_failed_move_sets_the_failure_condition_and_the_scheduler_gives_the_claim_up() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start_with(&server, &[ALWAYS]).await;
    let _reg = register(&scene).await;
    driver
        .wait_until("binding conditions in the slice", || {
            published(&server, "pci-0000-02-00-0")["bindingConditions"][0] == READY
        })
        .await;
    // Group 6's node is gone: the move cannot be checked, so it fails.
    std::fs::remove_file(scene.root().join("dev/vfio/6")).unwrap();
    let c = allocate(&server, "vm-a", &[ours("nic", "pci-0000-02-00-0")]);
    driver
        .wait_until("the failure condition", || {
            failure(&server, "vm-a").is_some()
        })
        .await;
    let why = failure(&server, "vm-a").unwrap();
    assert!(
        why.contains("reason=MoveFailed") && why.contains("/dev/vfio/6"),
        "{why}"
    );
    assert_eq!(phase(&scene, &c.uid), None, "rolled back");
    // A Warning Event names the claim.
    let events = server.list(&paths::events(NS));
    assert!(
        events
            .iter()
            .any(|e| e["regarding"]["name"] == "vm-a" && e["type"] == "Warning"),
        "{events:?}"
    );
    // The scheduler deallocates (PostFilter); nothing is left to give back.
    let mut claimed = claim(&server, "vm-a").unwrap();
    fake_apiserver::objects::deallocate(&mut claimed);
    server.put(&paths::resourceclaim(NS, "vm-a"), claimed);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(phase(&scene, &c.uid), None);
    assert!(state_devices(&scene).is_empty());
}

/// The status write the scheduler waits on outlasts another writer (409s: it reads
/// again and keeps the other's change) and an API server failing for a while (it
/// tries again with a growing pause).
#[tokio::test]
async fn the_status_write_outlasts_conflicts_and_a_failing_api_server() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start_with(&server, &[ALWAYS]).await;
    driver
        .wait_until("binding conditions in the slice", || {
            published(&server, "pci-0000-02-00-0")["bindingConditions"][0] == READY
        })
        .await;
    server.race_next("PUT", 3);
    allocate(&server, "vm-a", &[ours("nic", "pci-0000-02-00-0")]);
    driver
        .wait_until("vm-a ready despite three conflicts", || {
            ready(&server, "vm-a")
        })
        .await;
    let conflicts = server
        .requests()
        .iter()
        .filter(|(m, p)| m == "PUT" && p.contains("/resourceclaims/vm-a/status"))
        .count();
    assert_eq!(conflicts, 4, "three conflicts, then the write");
    server.fail_next_on("PUT", 5, 500);
    allocate(&server, "vm-b", &[ours("disk", "pci-0000-03-00-0")]);
    driver
        .wait_until("vm-b ready after five failed writes", || {
            ready(&server, "vm-b")
        })
        .await;
    assert!(
        driver
            .log()
            .contains("cannot write the claim's device status"),
        "{}",
        driver.log()
    );
}

/// The race of a move and the claim's deletion, run many times with the deletion
/// at a different moment each time (as the watcher picks the claim up, during the
/// move, during the status write, after): every round ends with nothing
/// recorded. The count of rounds whose claim was already recorded when it was
/// deleted is printed (36 to 40 of 40 in eight runs here).
#[tokio::test]
async fn a_claim_deleted_at_any_moment_of_its_move_is_always_given_back() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start_with(&server, &[ALWAYS]).await;
    driver
        .wait_until("binding conditions in the slice", || {
            published(&server, "pci-0000-02-00-0")["bindingConditions"][0] == READY
        })
        .await;
    const ROUNDS: u64 = 40;
    let mut moved_before_delete = 0;
    for round in 0..ROUNDS {
        let name = format!("vm-{round}");
        let c = allocate(&server, &name, &[ours("nic", "pci-0000-02-00-0")]);
        // 0 to 19.5 ms: spread over the watcher's pick-up, the move and the write.
        tokio::time::sleep(std::time::Duration::from_micros(round * 500)).await;
        if phase(&scene, &c.uid).is_some() {
            moved_before_delete += 1;
        }
        server.remove(&paths::resourceclaim(NS, &name));
        driver
            .wait_until(&format!("round {round} given back"), || {
                state_claims(&scene).is_empty() && state_devices(&scene).is_empty()
            })
            .await;
    }
    // Let any late task land, then look again: a move that lands after its
    // claim's deletion (its job queued behind others on a loaded machine) must be
    // given back too, however late.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    driver
        .wait_until("every late move given back", || {
            state_claims(&scene).is_empty() && state_devices(&scene).is_empty()
        })
        .await;
    println!(
        "{ROUNDS} rounds, {moved_before_delete} with the claim recorded before \
            its deletion, all given back"
    );
    assert!(
        moved_before_delete > 0,
        "no deletion landed after the move started"
    );
}

/// The claim's devices of ours in the driver's state file, and its phase there.
fn recorded(scene: &Scene, uid: &str) -> Option<(String, Vec<String>)> {
    let c = state_claims(scene).get(uid)?.clone();
    let devices = c["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["device"].as_str().unwrap().to_owned())
        .collect();
    Some((c["phase"].as_str().unwrap().to_owned(), devices))
}

/// A claim re-allocated while its early move (and the status write the scheduler
/// waits on) is under way, directly or through a deallocated step, at delays from
/// 0 to 800 ms: every event is acted on, so each round ends with the claim ready
/// on its new device and only that device recorded (the fake node's devices sit
/// on vfio-pci already; the real-kernel scenario sees the old one go back to its
/// driver). The status write's read is slowed to 300 ms so that most changes land
/// while the first move is busy; the count of those is printed.
#[tokio::test]
async fn a_claim_reallocated_during_its_move_always_ends_on_its_new_device() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start_with(&server, &[ALWAYS]).await;
    driver
        .wait_until("binding conditions in the slice", || {
            published(&server, "pci-0000-03-00-0")["bindingConditions"][0] == READY
        })
        .await;
    let claims = format!("/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/");
    server.set_latency(Some((
        "GET",
        &claims,
        std::time::Duration::from_millis(300),
    )));
    let delays = [0u64, 1, 5, 20, 80, 150, 250, 400, 800];
    let (mut rounds, mut while_busy) = (0, 0);
    for deallocated_between in [false, true] {
        for delay in delays {
            let name = format!("vm-{rounds}");
            rounds += 1;
            let c = allocate(&server, &name, &[ours("nic", "pci-0000-02-00-0")]);
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
            if recorded(&scene, &c.uid).is_some_and(|(p, _)| p != "moved") || !ready(&server, &name)
            {
                while_busy += 1;
            }
            if deallocated_between {
                let mut gone = claim(&server, &name).unwrap();
                fake_apiserver::objects::deallocate(&mut gone);
                server.put(&paths::resourceclaim(NS, &name), gone);
                tokio::time::sleep(std::time::Duration::from_millis(delay / 4)).await;
            }
            allocate(&server, &name, &[ours("disk", "pci-0000-03-00-0")]);
            let context = format!("delay {delay} ms, deallocated between: {deallocated_between}");
            driver
                .wait_until(&format!("{context}: ready on the new device"), || {
                    ready(&server, &name)
                        && recorded(&scene, &c.uid)
                            == Some(("moved".into(), vec!["pci-0000-03-00-0".into()]))
                })
                .await;
            let status = claim(&server, &name).unwrap()["status"]["devices"].clone();
            let entries = status.as_array().unwrap();
            assert_eq!(entries.len(), 1, "{context}: {status}");
            assert_eq!(entries[0]["device"], "pci-0000-03-00-0", "{context}");
            server.remove(&paths::resourceclaim(NS, &name));
            driver
                .wait_until(&format!("{context}: given back"), || {
                    state_claims(&scene).is_empty() && state_devices(&scene).is_empty()
                })
                .await;
        }
    }
    server.set_latency(None);
    println!(
        "{rounds} re-allocations, {while_busy} of them while the first move was \
            under way, all ended on the new device"
    );
    assert!(
        while_busy > rounds / 2,
        "too few changes landed during a move"
    );
    assert!(!driver.log().contains("panicked"), "{}", driver.log());
}

/// The watch requests (ResourceClaims, ResourceSlices) the server has seen.
fn watches(server: &FakeApiServer) -> (usize, usize) {
    let requests = server.requests();
    let count = |what: &str| {
        requests
            .iter()
            .filter(|(m, p)| m == "GET" && p.contains(what) && p.contains("watch=true"))
            .count()
    };
    (count("/resourceclaims?"), count("/resourceslices?"))
}

/// A real API server sends nothing on a quiet watch but a bookmark about once a
/// minute: the watches must outlast that silence (they once died 5 s in, on the
/// client's read timeout, and a claim allocated in the gap waited up to 41 s).
/// Here the server's bookmarks come every 60 s, as the real one's do: 12 idle
/// seconds open no new watch, and each of 100 allocations, some after 6 s of
/// silence, is marked ready well within 3 s (the slowest is printed).
#[tokio::test]
async fn quiet_watches_stay_open_and_every_allocation_is_marked_within_three_seconds() {
    let scene = Scene::new();
    let server = cluster();
    server.set_bookmark_period(std::time::Duration::from_secs(60));
    let mut driver = scene.start_with(&server, &[ALWAYS]).await;
    driver
        .wait_until("binding conditions in the slice", || {
            published(&server, "pci-0000-02-00-0")["bindingConditions"][0] == READY
        })
        .await;
    driver
        .wait_until("both watches open", || watches(&server) == (1, 1))
        .await;
    tokio::time::sleep(std::time::Duration::from_secs(12)).await;
    assert_eq!(watches(&server), (1, 1), "{}", driver.log());
    const ALLOCATIONS: usize = 100;
    let mut slowest = std::time::Duration::ZERO;
    for round in 0..ALLOCATIONS {
        // Mostly back to back; every 25th after 6 s of silence.
        let gap = if round % 25 == 24 {
            6000
        } else {
            (round as u64 % 5) * 7
        };
        tokio::time::sleep(std::time::Duration::from_millis(gap)).await;
        let name = format!("vm-{round}");
        let started = std::time::Instant::now();
        allocate(&server, &name, &[ours("nic", "pci-0000-02-00-0")]);
        loop {
            if ready(&server, &name) {
                break;
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(3),
                "allocation {round} (after {gap} ms of silence) not marked within 3 s\n{}",
                driver.log()
            );
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        slowest = slowest.max(started.elapsed());
        server.remove(&paths::resourceclaim(NS, &name));
        driver
            .wait_until(&format!("round {round} given back"), || {
                state_claims(&scene).is_empty()
            })
            .await;
    }
    assert_eq!(watches(&server), (1, 1), "no watch re-opened");
    println!(
        "{ALLOCATIONS} allocations, all marked within 3 s, slowest {slowest:?}; \
            the watches opened once each"
    );
}
