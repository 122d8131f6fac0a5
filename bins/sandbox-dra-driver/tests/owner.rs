//! One owner per node, with the real binaries: `vfio-manager` and
//! `sandbox-dra-driver` started at the same moment on one fake node, and a claim
//! sent to the driver while vfio-manager owns the node.
//!
//! The fake tree has no PCI core behind it, so "moving devices" is seen as doing
//! the work that moves them: vfio-manager's `run` writing its ready file (every
//! selected device checked and bound), the driver publishing its ResourceSlice and
//! preparing claims. The loser must stop before any of it and name the winner.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Child;
use std::time::{Duration, Instant};

use common::driver::put_v1_claim;
use common::*;
use kubelet_peer::dra::{ClaimRef, Version};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const RUNS: usize = 50;

/// What one side of a race did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Owned,
    /// Refused, naming the other by its pid.
    Refused,
}

fn stop(child: &mut Child) {
    if let Ok(None) = child.try_wait() {
        let pid = Pid::from_raw(i32::try_from(child.id()).unwrap());
        let _ = kill(pid, Signal::SIGKILL);
    }
    let _ = child.wait();
}

#[tokio::test]
async fn started_together_exactly_one_owns_the_node_fifty_times_out_of_fifty() {
    let (mut manager_won, mut driver_won) = (0, 0);
    let started = Instant::now();
    for run in 0..RUNS {
        let scene = Scene::new();
        let server = cluster();
        let mut driver = scene.command("driver.log");
        driver
            .env("KUBECONFIG", server.write_kubeconfig(scene.root()).unwrap())
            .env("NODE_NAME", NODE)
            // The loser keeps refusing for the whole run.
            .env("VFIO_SANDBOX_OWNER_RETRY_INTERVAL", "1h");
        let mut manager = scene.manager("manager.log");
        manager.args(["run", "--resync-interval", "1h"]);
        let mut manager = manager.spawn().unwrap();
        let mut driver = driver.spawn().unwrap();
        let (manager_pid, driver_pid) = (manager.id(), driver.id());
        let ready = scene.root().join("run/vfio-manager/ready");
        let log = |name: &str| std::fs::read_to_string(scene.root().join(name)).unwrap_or_default();
        let names = |log: &str, who: &str, pid: u32| {
            log.contains(&format!("{who} (pid {pid}, since "))
                && log.contains("owns the devices of this node")
        };
        let deadline = Instant::now() + WAIT;
        let (m, d) = loop {
            let m = if ready.exists() {
                Some(Side::Owned)
            } else if manager.try_wait().unwrap().is_some() {
                Some(Side::Refused)
            } else {
                None
            };
            let d = if !slices(&server).is_empty() {
                Some(Side::Owned)
            } else if names(&log("driver.log"), "vfio-manager", manager_pid) {
                Some(Side::Refused)
            } else {
                None
            };
            if let (Some(m), Some(d)) = (m, d) {
                break (m, d);
            }
            assert!(
                Instant::now() < deadline,
                "run {run}: no outcome: manager {m:?}, driver {d:?}\nmanager:\n{}\ndriver:\n{}",
                log("manager.log"),
                log("driver.log")
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let (manager_log, driver_log) = (log("manager.log"), log("driver.log"));
        let context = format!("run {run}:\nmanager:\n{manager_log}\ndriver:\n{driver_log}");
        match (m, d) {
            (Side::Owned, Side::Refused) => {
                manager_won += 1;
                assert!(slices(&server).is_empty(), "{context}");
                assert!(!scene.state_file().exists(), "{context}");
                assert_eq!(scene.owner()["owner"], "vfio-manager", "{context}");
            }
            (Side::Refused, Side::Owned) => {
                driver_won += 1;
                let status = manager.wait().unwrap();
                assert_eq!(status.code(), Some(2), "{context}");
                assert!(
                    names(&manager_log, "sandbox-dra-driver", driver_pid),
                    "{context}"
                );
                assert!(!ready.exists(), "{context}");
                assert_eq!(scene.owner()["owner"], "sandbox-dra-driver", "{context}");
            }
            other => panic!("{other:?}: both or neither owned the node; {context}"),
        }
        stop(&mut manager);
        stop(&mut driver);
    }
    println!(
        "both owned: 0/{RUNS}, neither: 0/{RUNS}, vfio-manager owned: {manager_won}/{RUNS}, \
         sandbox-dra-driver owned: {driver_won}/{RUNS} ({:.1?})",
        started.elapsed()
    );
}

/// vfio-manager's record of one device it moved from e1000e.
const MANAGER_STATE: &str = r#"{"version": 1, "devices": {"0000:02:00.0": {
  "original_driver": "e1000e", "original_override": null, "driver": "vfio-pci",
  "role": "selected", "resource": "example.com/NIC_PT", "group": 6}}}"#;

const UID: &str = "5d1f0c4e-8a2b-4c3d-9e7f-0a1b2c3d4e5f";

/// A claim for the card on the server, and vfio-manager's `bind` exited leaving
/// one device of its state file on vfio: the node is vfio-manager's.
fn manager_holds_one_device(scene: &Scene, server: &fake_apiserver::FakeApiServer) -> ClaimRef {
    let claim = put_claim(
        server,
        "vm1-card",
        UID,
        Some(&[ours("card", "pci-0000-01-00-0")]),
        None,
    );
    std::fs::create_dir_all(scene.manager_state_file().parent().unwrap()).unwrap();
    std::fs::write(scene.manager_state_file(), MANAGER_STATE).unwrap();
    let status = scene
        .manager("bind.log")
        .args(["bind", "--all"])
        .status()
        .unwrap();
    let bind_log = std::fs::read_to_string(scene.root().join("bind.log")).unwrap();
    assert!(status.success(), "{bind_log}");
    claim
}

#[tokio::test]
async fn a_claim_is_refused_while_vfio_manager_owns_the_node_and_prepared_once_it_lets_go() {
    let scene = Scene::new();
    let server = cluster();
    let claim = manager_holds_one_device(&scene, &server);
    let record = scene.owner();
    assert_eq!(record["owner"], "vfio-manager", "{record}");
    assert_eq!(record["devices"], 1, "{record}");

    // vfio-manager has exited; its device is still on vfio: the driver waits.
    let mut driver = scene
        .start_with(&server, &[("VFIO_SANDBOX_OWNER_RETRY_INTERVAL", "100ms")])
        .await;
    let mut client = scene.client(Version::V1).await;
    let answers = client
        .prepare(std::slice::from_ref(&claim))
        .await
        .unwrap()
        .claims;
    let error = &answers[UID].error;
    for part in [
        &format!("claim {NS}/vm1-card"),
        &format!("vfio-manager (pid {}, since ", record["pid"]),
        "exited with 1 device(s) still moved) owns the devices of this node",
        &format!("(lock {})", scene.owner_lock().display()),
        "take the node out of vfio-manager's DaemonSet",
    ] {
        assert!(error.contains(part), "{part:?} in {error}");
    }
    assert!(answers[UID].devices.is_empty());
    assert!(!scene.state_file().exists() && !scene.cdi_dir().exists());
    assert!(slices(&server).is_empty());
    assert_eq!(scene.owner(), record, "the refusal writes nothing");

    // vfio-manager gives its device back (the fake tree has no PCI core to re-probe
    // e1000e: play it), and its record says none is left.
    let reg = inode(&scene.registration_socket());
    scene
        .node
        .attach(&"0000:02:00.0".parse().unwrap(), "e1000e");
    let status = scene
        .manager("unbind.log")
        .args(["unbind", "--all"])
        .status()
        .unwrap();
    let unbind_log = std::fs::read_to_string(scene.root().join("unbind.log")).unwrap();
    assert!(status.success(), "{unbind_log}");

    // The driver takes the node at its next try and serves anew.
    driver
        .wait_until("the driver to own the node", || {
            scene.owner()["owner"] == "sandbox-dra-driver"
        })
        .await;
    driver
        .wait_until("a new registration socket", || {
            inode(&scene.registration_socket()).is_some_and(|i| Some(i) != reg)
        })
        .await;
    driver
        .wait_until("the ResourceSlice", || !slices(&server).is_empty())
        .await;
    let mut client = scene.client(Version::V1).await;
    let answers = client
        .prepare(std::slice::from_ref(&claim))
        .await
        .unwrap()
        .claims;
    assert_eq!(answers[UID].error, "", "{}", driver.log());
    assert_eq!(answers[UID].devices.len(), 1);
    assert_eq!(scene.owner()["devices"], 1, "the claim's device is counted");

    // Now vfio-manager is the one refused, naming the driver.
    let status = scene
        .manager("refused.log")
        .args(["bind", "--all"])
        .status()
        .unwrap();
    let refused = std::fs::read_to_string(scene.root().join("refused.log")).unwrap();
    assert_eq!(status.code(), Some(2), "{refused}");
    assert!(
        refused.contains(&format!(
            "sandbox-dra-driver (pid {}, since ",
            driver.child.id()
        )),
        "{refused}"
    );
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}

/// The owner record is not the last word: with vfio-manager's device still
/// recorded in its state file, neither a deleted lock (an `rm -rf` of its
/// directory) nor a garbled record lets the driver in; it names the state file.
#[tokio::test]
async fn a_deleted_or_garbled_lock_does_not_let_the_driver_take_a_node_vfio_manager_holds() {
    for tamper in ["deleted", "garbled"] {
        let scene = Scene::new();
        let server = cluster();
        let claim = manager_holds_one_device(&scene, &server);
        match tamper {
            "deleted" => std::fs::remove_dir_all(scene.owner_lock().parent().unwrap()).unwrap(),
            _ => std::fs::write(scene.owner_lock(), "{\"owner\":\"vfio-ma").unwrap(),
        }
        let driver = scene.start(&server).await;
        let mut client = scene.client(Version::V1).await;
        let answers = client
            .prepare(std::slice::from_ref(&claim))
            .await
            .unwrap()
            .claims;
        let error = &answers[UID].error;
        let said = format!(
            "vfio-manager's state file {} records 1 device(s) moved on this node; \
                sandbox-dra-driver moves nothing while it does",
            scene.manager_state_file().display()
        );
        assert!(error.contains(&said), "{tamper}: {error}");
        assert!(answers[UID].devices.is_empty());
        assert!(!scene.state_file().exists() && !scene.cdi_dir().exists());
        assert!(slices(&server).is_empty(), "{tamper}: published");
        assert!(driver.log().contains(&said), "{}", driver.log());
    }
}

/// Replaces the owner lock file with one held by this process under `program`'s
/// name (what a rival that took a lock path left free does): a new file, its
/// record written, `flock`ed, then renamed over the lock. The lock is held until
/// the returned file drops.
fn replace_lock_held_by(lock: &std::path::Path, program: &str) -> nix::fcntl::Flock<std::fs::File> {
    let new = lock.with_file_name("owner.lock.replacement");
    let record = format!(
        "{{\"owner\":\"{program}\",\"pid\":{},\"since\":\"2026-01-01T00:00:00Z\",\"devices\":0}}\n",
        std::process::id()
    );
    std::fs::write(&new, record).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&new)
        .unwrap();
    let held = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|(_, e)| e)
        .unwrap();
    std::fs::rename(&new, lock).unwrap();
    held
}

/// The driver that loses the node (its lock replaced by one vfio-manager holds)
/// withdraws every device from its ResourceSlices and stops being ready within
/// 2 s, saying once who owns the node and which lock; a claim is refused
/// meanwhile. Once the lock is free it takes the node again and publishes its
/// devices again.
#[tokio::test]
async fn a_driver_that_lost_the_node_withdraws_its_devices_at_once_and_comes_back() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start(&server).await;
    let _reg = register(&scene).await;
    let devices = |server: &fake_apiserver::FakeApiServer| -> usize {
        slices(server)
            .iter()
            .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
            .sum()
    };
    driver
        .wait_until("published and ready", || {
            devices(&server) > 0 && scene.ready_file().exists()
        })
        .await;
    let published = devices(&server);

    let lost_at = Instant::now();
    let held = replace_lock_held_by(&scene.owner_lock(), "vfio-manager");
    driver
        .wait_until("every device withdrawn and not ready", || {
            devices(&server) == 0 && !scene.ready_file().exists()
        })
        .await;
    let took = lost_at.elapsed();
    println!("withdrawn {took:?} after the lock was lost ({published} devices)");
    assert!(took < Duration::from_secs(2), "withdrawn after {took:?}");
    assert!(!slices(&server).is_empty(), "the pool stays, empty");
    let said = format!(
        "vfio-manager (pid {}, since 2026-01-01T00:00:00Z) owns the devices of this node (lock {})",
        std::process::id(),
        scene.owner_lock().display()
    );
    let log = driver.log();
    assert_eq!(
        log.matches("the node's owner lock is no longer ours")
            .count(),
        1,
        "{log}"
    );
    assert!(log.contains(&said), "{log}");
    let claim = put_v1_claim(&server);
    let mut client = scene.client(Version::V1).await;
    let answers = client
        .prepare(std::slice::from_ref(&claim))
        .await
        .unwrap()
        .claims;
    assert!(
        answers[&claim.uid]
            .error
            .contains("owns the devices of this node"),
        "{:?}",
        answers[&claim.uid]
    );

    // Free again, as vfio-manager leaves a node: its record rewritten in place
    // with no device left while it still holds the lock, then the lock let go
    // and the file closed (the close wakes the driver, which takes the lock and
    // publishes everything again). Writing through a second descriptor would
    // race the driver's own record (woken by the truncation, it writes first
    // and the test's bytes land over its head).
    let record = b"{\"owner\":\"vfio-manager\",\"pid\":1,\"since\":\"x\",\"devices\":0}\n";
    std::os::unix::fs::FileExt::write_all_at(&*held, record, 0).unwrap();
    held.set_len(record.len() as u64).unwrap();
    drop(held.unlock().map_err(|(_, e)| e).unwrap());
    driver
        .wait_until("devices published again and ready", || {
            devices(&server) == published && scene.ready_file().exists()
        })
        .await;
    assert_eq!(scene.owner()["owner"], "sandbox-dra-driver");
    assert!(
        driver.log().contains("the node's owner lock is ours again"),
        "{}",
        driver.log()
    );
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}

/// vfio-manager that loses the node (its lock replaced by one the DRA driver
/// holds) stops vouching for it within 2 s: its ready file and the validator's
/// go, and it says once who owns the node and which lock. Once the lock is free
/// it takes the node again and is ready again.
#[tokio::test]
async fn vfio_manager_that_lost_the_node_is_not_ready_at_once_and_comes_back() {
    let scene = Scene::new();
    let ready = scene.root().join("run/vfio-manager/ready");
    let validator_ready = scene.root().join("run/validations/vfio-pci-ready");
    let mut manager = scene.manager("manager.log");
    manager.args(["run", "--resync-interval", "1h"]);
    let mut manager = manager.spawn().unwrap();
    let log = || std::fs::read_to_string(scene.root().join("manager.log")).unwrap_or_default();
    let until = |what: &str, f: &dyn Fn() -> bool| {
        let deadline = Instant::now() + WAIT;
        while !f() {
            assert!(Instant::now() < deadline, "{what}: {}", log());
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    until("vfio-manager ready", &|| ready.exists());
    // What the validator writes once it passed.
    std::fs::create_dir_all(validator_ready.parent().unwrap()).unwrap();
    std::fs::write(&validator_ready, "{}").unwrap();

    let lost_at = Instant::now();
    let held = replace_lock_held_by(&scene.owner_lock(), "sandbox-dra-driver");
    until("no ready file", &|| {
        !ready.exists() && !validator_ready.exists()
    });
    let took = lost_at.elapsed();
    println!("vfio-manager not ready {took:?} after the lock was lost");
    assert!(took < Duration::from_secs(2), "not ready after {took:?}");
    until("said", &|| {
        log().contains("the node's owner lock is no longer ours")
    });
    let said = format!(
        "sandbox-dra-driver (pid {}, since 2026-01-01T00:00:00Z) owns the devices of \
            this node (lock {})",
        std::process::id(),
        scene.owner_lock().display()
    );
    let text = log();
    assert!(text.contains(&said), "{text}");
    assert_eq!(
        text.matches("the node's owner lock is no longer ours")
            .count(),
        1,
        "{text}"
    );

    drop(held);
    std::fs::write(
        scene.owner_lock(),
        "{\"owner\":\"sandbox-dra-driver\",\"pid\":1,\"since\":\"x\",\"devices\":0}\n",
    )
    .unwrap();
    let freed = Instant::now();
    until("ready again", &|| ready.exists());
    println!(
        "vfio-manager ready again {:?} after the lock was free",
        freed.elapsed()
    );
    assert_eq!(scene.owner()["owner"], "vfio-manager");
    assert!(
        log().contains("the node's owner lock is ours again"),
        "{}",
        log()
    );
    stop(&mut manager);
}

/// A lock file deleted under its holder (a cleanup of its directory) is taken
/// again at once, by the DRA driver and by vfio-manager alike, and neither stops
/// advertising. The driver names itself again within a second, well inside its
/// 10 s idle check. vfio-manager is held to `WAIT` against a resync of an hour,
/// so only its watch of the lock can be in time; the lock goes as soon as the
/// ready file is there, which can be before that watch is open.
#[tokio::test]
async fn a_deleted_lock_is_taken_again_at_once_by_its_holder() {
    // The driver.
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start(&server).await;
    let _reg = register(&scene).await;
    driver
        .wait_until("published and ready", || {
            !slices(&server).is_empty() && scene.ready_file().exists()
        })
        .await;
    let version = slices(&server)[0]["metadata"]["resourceVersion"].clone();
    // (A whole `rm -rf` of the directory races the driver taking it again:
    // the removal itself may then fail with ENOTEMPTY.)
    std::fs::remove_file(scene.owner_lock()).unwrap();
    let deleted = Instant::now();
    driver
        .wait_until("the lock taken again", || {
            scene.owner()["owner"] == "sandbox-dra-driver"
        })
        .await;
    let took = deleted.elapsed();
    assert!(took < Duration::from_secs(1), "taken again after {took:?}");
    // Said once the record is written again.
    let log = driver.log.clone();
    driver
        .wait_until("said", || {
            std::fs::read_to_string(&log)
                .is_ok_and(|t| t.contains("was deleted while held; took it again"))
        })
        .await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        slices(&server)[0]["metadata"]["resourceVersion"],
        version,
        "the slice was not touched"
    );
    assert!(scene.ready_file().exists());
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");

    // vfio-manager.
    let scene = Scene::new();
    let ready = scene.root().join("run/vfio-manager/ready");
    let mut manager = scene.manager("manager.log");
    manager.args(["run", "--resync-interval", "1h"]);
    let mut manager = manager.spawn().unwrap();
    let deadline = Instant::now() + WAIT;
    while !ready.exists() {
        assert!(Instant::now() < deadline, "vfio-manager not ready");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    std::fs::remove_file(scene.owner_lock()).unwrap();
    let deleted = Instant::now();
    while scene.owner()["owner"] != "vfio-manager" {
        assert!(deleted.elapsed() < WAIT, "not taken again");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(ready.exists(), "still ready");
    stop(&mut manager);
}

/// Each binary names the other's default state file (neither library does), and
/// the chart mounts them at those defaults: vfio-manager's own defaults, as its
/// `--help` says them, are the ones this driver reads and writes.
#[test]
fn the_two_binaries_agree_on_each_others_state_files() {
    use sandbox_dra_driver::programs::{STATE_FILE, VFIO_MANAGER_STATE_FILE};
    let out = std::process::Command::new(vfio_manager_binary())
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    let default_of = |flag: &str| {
        let after = &help[help.find(&format!("  {flag} <FILE>")).unwrap()..];
        let at = after.find("[default: ").unwrap() + "[default: ".len();
        after[at..].split(']').next().unwrap().to_owned()
    };
    assert_eq!(default_of("--state-file"), VFIO_MANAGER_STATE_FILE);
    assert_eq!(default_of("--dra-state-file"), STATE_FILE);
}
