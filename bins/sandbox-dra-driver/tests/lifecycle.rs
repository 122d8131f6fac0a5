//! The real `sandbox-dra-driver` binary across its life: a restart after a kill,
//! a node owned by vfio-manager, the command line, a rollout and an uninstall,
//! bounded calls, a read-only CDI directory and a state file from another node.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::time::Instant;

use common::driver::*;
use common::*;
use fake_apiserver::paths;
use kubelet_peer::dra::Version;
use serde_json::json;

#[tokio::test]
async fn a_claim_prepared_before_a_kill_stays_prepared_after_the_restart() {
    let scene = Scene::new();
    let server = cluster();
    let c1 = put_v1_claim(&server);
    let driver = scene.start(&server).await;
    let mut v1 = scene.client(Version::V1).await;
    let before = prepare(&mut v1, std::slice::from_ref(&c1)).await;
    assert_eq!(before[U1], v1_answer());
    driver.kill();
    assert_eq!(state_claims(&scene)[U1]["phase"], "prepared");

    let driver = scene.start(&server).await;
    assert!(
        driver
            .log()
            .contains("claims prepared before this start are kept"),
        "{}",
        driver.log()
    );
    assert_eq!(state_claims(&scene)[U1]["phase"], "prepared");
    assert_v1_files(&scene);
    let mut v1beta1 = scene.client(Version::V1beta1).await;
    assert_eq!(
        prepare(&mut v1beta1, std::slice::from_ref(&c1)).await,
        before
    );
    assert_v1_files(&scene);
    assert_eq!(
        unprepare(&mut v1beta1, std::slice::from_ref(&c1)).await,
        BTreeMap::from([(U1.to_string(), String::new())])
    );
    assert_no_files(&scene, U1);
    assert!(state_claims(&scene).is_empty(), "{}", scene.state());
    assert!(state_devices(&scene).is_empty(), "{}", scene.state());
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}

// ---------------------------------------------------------------- 6. coexistence

#[tokio::test]
async fn a_node_run_by_vfio_manager_is_refused_and_left_alone() {
    let scene = Scene::new();
    let server = cluster();
    // vfio-manager exited with a device still on vfio-pci: the node stays its own.
    let lock = scene.owner_lock();
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    let record =
        r#"{"owner":"vfio-manager","pid":4242,"since":"2025-01-31T12:00:00Z","devices":1}"#;
    std::fs::write(&lock, record).unwrap();
    let c1 = put_v1_claim(&server);
    let driver = scene.start(&server).await;
    let refusal = format!(
        "vfio-manager (pid 4242, since 2025-01-31T12:00:00Z; exited with 1 device(s) still \
         moved) owns the devices of this node (lock {}); sandbox-dra-driver moves nothing \
         while it does: a node runs either sandbox-dra-driver or vfio-manager, not both; \
         take the node out of vfio-manager's DaemonSet",
        lock.display()
    );
    let mut v1 = scene.client(Version::V1).await;
    let answers = prepare(&mut v1, std::slice::from_ref(&c1)).await;
    assert_contains(&error_of(&answers, U1), &["not prepared: ", &refusal]);
    // Never prepared here: done already.
    assert_eq!(
        unprepare(&mut v1, std::slice::from_ref(&c1)).await,
        BTreeMap::from([(U1.to_string(), String::new())])
    );
    assert_contains(&driver.log(), &[&refusal]);
    assert_no_files(&scene, U1);
    assert!(
        !scene.state_file().exists(),
        "nothing recovered or recorded"
    );
    assert_eq!(std::fs::read_to_string(&lock).unwrap(), record);
    assert!(slices(&server).is_empty(), "no slice published");
    assert!(
        server.requests().is_empty(),
        "the API server is not even asked: {:?}",
        server.requests()
    );
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(!scene.registration_socket().exists(), "{log}");
}

// ---------------------------------------------------------------- 7. CLI

#[tokio::test]
async fn the_command_line_explains_itself_and_refuses_bad_starts() {
    let scene = Scene::new();
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_sandbox-dra-driver"))
        .arg("--help")
        .output()
        .unwrap();
    assert_eq!(help.status.code(), Some(0));
    let text = String::from_utf8(help.stdout).unwrap();
    assert_contains(
        &text,
        &[
            "<registry-dir>/<driver>-reg.sock",
            "<plugins-dir>/<driver>/dra.sock",
            "vfio-manager",
            "--node-name",
            "[env: NODE_NAME=]",
            "--owner-lock",
            "--owner-retry-interval",
            "--manager-state-file",
            "[env: VFIO_MANAGER_STATE_FILE=]",
            "Exit codes",
        ],
    );

    let status = scene.command("no-node.log").status().unwrap();
    let err = read(&scene.root().join("no-node.log"));
    assert_eq!(status.code(), Some(2), "{err}");
    assert_contains(&err, &["--node-name <NAME>"]);

    let status = scene
        .command("empty-node.log")
        .args(["--node-name", ""])
        .status()
        .unwrap();
    let err = read(&scene.root().join("empty-node.log"));
    assert_eq!(status.code(), Some(2), "{err}");
    assert_contains(
        &err,
        &["sandbox-dra-driver: error: --node-name (NODE_NAME) is empty"],
    );
    assert!(!scene.registry_dir().exists() && !scene.state_file().exists());

    // A second instance on the same state file: refused before it binds anything.
    let server = cluster();
    let first = scene.start(&server).await;
    let reg = inode(&scene.registration_socket());
    let mut second = scene.command("second.log");
    second
        .env("KUBECONFIG", server.write_kubeconfig(scene.root()).unwrap())
        .env("NODE_NAME", NODE);
    let status = second.status().unwrap();
    let err = read(&scene.root().join("second.log"));
    assert_eq!(status.code(), Some(1), "{err}");
    assert_contains(
        &err,
        &[
            &format!("sandbox-dra-driver (pid {}, since ", first.child.id()),
            &format!(
                "owns the devices of this node (lock {})",
                scene.owner_lock().display()
            ),
            "another sandbox-dra-driver is at work on this node",
        ],
    );
    assert_eq!(
        inode(&scene.registration_socket()),
        reg,
        "the first keeps its socket"
    );
    let registered = register(&scene).await;
    assert_eq!(registered.name, DRIVER);
    let (status, log) = first.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}

// ---------------------------------------------------------------- 8. uninstall vs rollout

#[tokio::test]
async fn a_rollout_keeps_the_slice_and_an_uninstall_deletes_it() {
    let scene = Scene::new();
    let server = cluster_with_daemonset();
    let pod_env = [("POD_NAME", POD), ("POD_NAMESPACE", DRIVER_NS)];

    let mut driver = scene.start_with(&server, &pod_env).await;
    driver
        .wait_until("both ResourceSlices", || slices(&server).len() == 2)
        .await;
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert_contains(
        &log,
        &[
            "keeping this node's ResourceSlice for the next driver pod",
            "still selected by DaemonSet vfio-sandbox/sandbox-dra-driver",
        ],
    );
    assert_eq!(slices(&server).len(), 2, "a rollout keeps the slices");

    let mut driver = scene.start_with(&server, &pod_env).await;
    let published = slices(&server)[0]["metadata"]["resourceVersion"].clone();
    driver
        .wait_until("the next pod to check the slice", || {
            server
                .requests()
                .iter()
                .filter(|(m, p)| m == "GET" && p.starts_with(&paths::resourceslices()))
                .count()
                >= 2
        })
        .await;
    assert!(server.remove(&paths::daemonset(DRIVER_NS, DS)));
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert_contains(
        &log,
        &[
            "DaemonSet vfio-sandbox/sandbox-dra-driver was deleted",
            "the driver leaves this node; deleting its ResourceSlice",
        ],
    );
    assert!(
        slices(&server).is_empty(),
        "an uninstall deletes the slice: {published}"
    );
    assert!(
        server.requests().iter().any(|(m, p)| m == "DELETE"
            && p.starts_with(&paths::resourceslice("node-a-vfio-sandbox-rebellions-ai"))),
        "{:?}",
        server.requests()
    );
}

/// A stop lookup the API server refuses (or does not answer in time) leaves the
/// rollout/uninstall question open, as a missing POD_NAME does, and the driver
/// keeps the slice then: deleting it on every such restart leaves the node's
/// devices unschedulable for a moment, and the next start reconciles it anyway.
#[tokio::test]
async fn a_failed_stop_lookup_keeps_the_slice() {
    let scene = Scene::new();
    let server = cluster_with_daemonset();
    let pod_env = [("POD_NAME", POD), ("POD_NAMESPACE", DRIVER_NS)];
    let mut driver = scene.start_with(&server, &pod_env).await;
    driver
        .wait_until("both ResourceSlices", || slices(&server).len() == 2)
        .await;
    // The Pod lookup at stop is forbidden (its namespaced Role is missing, say).
    server.fail_next_on("GET", 1, 403);
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert_eq!(slices(&server).len(), 2, "the slices are kept:\n{log}");
}

// ------------------------------------------- 8. claims that outlive their unprepare

/// kubelet gives up on a prepare whose claim read is slow and unprepares the
/// claim; the unprepare answers OK (nothing recorded yet). The prepare, still on
/// its way, must not make the claim prepared afterwards.
#[tokio::test]
async fn an_unprepare_that_answered_ok_wins_over_a_prepare_still_on_its_way() {
    let scene = Scene::new();
    let server = cluster();
    let c1 = put_v1_claim(&server);
    let driver = scene.start(&server).await;
    server.set_latency(Some((
        "GET",
        &paths::resourceclaim(NS, "vm1-card"),
        std::time::Duration::from_millis(1500),
    )));
    let mut v1 = scene.client(Version::V1).await;
    let slow = {
        let mut client = scene.client(Version::V1).await;
        let c1 = c1.clone();
        tokio::spawn(async move { prepare(&mut client, &[c1]).await })
    };
    // The prepare's read is under way when kubelet's unprepare comes.
    while !server
        .requests()
        .iter()
        .any(|(m, p)| m == "GET" && p.starts_with(&paths::resourceclaim(NS, "vm1-card")))
    {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(
        unprepare(&mut v1, std::slice::from_ref(&c1)).await,
        BTreeMap::from([(U1.to_string(), String::new())])
    );
    let answers = slow.await.unwrap();
    assert_contains(
        &error_of(&answers, U1),
        &["unprepared it while this prepare was on its way"],
    );
    assert!(state_claims(&scene).is_empty(), "{}", scene.state());
    assert_no_files(&scene, U1);
    // A prepare that starts after the unprepare is served as usual.
    server.set_latency(None);
    assert_eq!(
        prepare(&mut v1, std::slice::from_ref(&c1)).await[U1],
        v1_answer()
    );
    drop(driver);
}

/// `--prepare-timeout` bounds the whole call, claim reads included: two claims
/// whose reads take longer than it are both answered by then, with a reason.
#[tokio::test]
async fn the_whole_call_is_bounded_claim_reads_included() {
    let scene = Scene::new();
    let server = cluster();
    let c1 = put_v1_claim(&server);
    let c2 = put_claim(
        &server,
        "vm2-nic",
        U2,
        Some(&[ours("nic", "pci-0000-02-00-0")]),
        None,
    );
    let driver = scene
        .start_with(&server, &[("VFIO_SANDBOX_PREPARE_TIMEOUT", "1s")])
        .await;
    server.set_latency(Some((
        "GET",
        &paths::resourceclaims(NS),
        std::time::Duration::from_secs(3),
    )));
    let mut v1 = scene.client(Version::V1).await;
    let start = Instant::now();
    let answers = prepare(&mut v1, &[c1, c2]).await;
    let took = start.elapsed();
    println!("two claims with 3 s reads, --prepare-timeout 1s: answered in {took:?}");
    for uid in [U1, U2] {
        assert_contains(
            &error_of(&answers, uid),
            &["took too long", "not done within 1s"],
        );
    }
    assert!(
        took < std::time::Duration::from_millis(2500),
        "the call took {took:?}, not about 1 s"
    );
    drop(driver);
}

#[tokio::test]
async fn the_default_bound_is_below_kubelets_45_second_call_limit() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandbox-dra-driver"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("[default: 40s]"), "{help}");
    assert!(help.contains("kubelet's 45 s call"), "{help}");
}

/// A failed rollback (its CDI directory read-only, where unlink(2) of an absent
/// file gives EROFS) must not block every later prepare of the claim once the
/// directory is writable again. The driver runs in a mount namespace of its own
/// with the CDI directory bind-mounted read-only, as on a node whose /var/run/cdi
/// was mounted so.
#[tokio::test]
async fn a_read_only_cdi_directory_fails_the_prepare_but_not_its_retries() {
    let scene = Scene::new();
    let server = cluster();
    let c1 = put_v1_claim(&server);
    let cdi = scene.cdi_dir();
    std::fs::create_dir_all(&cdi).unwrap();
    let c = scene.command("ro.log");
    let program = c.get_program().to_owned();
    let args: Vec<std::ffi::OsString> = c.get_args().map(|a| a.to_owned()).collect();
    let mut wrapped = std::process::Command::new("unshare");
    wrapped
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg("mount --bind \"$0\" \"$0\" && mount -o remount,bind,ro \"$0\" && exec \"$@\"")
        .arg(&cdi)
        .arg(program)
        .args(args)
        .env("KUBECONFIG", server.write_kubeconfig(scene.root()).unwrap())
        .env("NODE_NAME", NODE)
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(scene.root().join("ro.log")).unwrap());
    let mut driver = Driver {
        child: wrapped.spawn().unwrap(),
        log: scene.root().join("ro.log"),
    };
    let reg = scene.registration_socket();
    driver
        .wait_until("the registration socket", || reg.exists())
        .await;
    let mut v1 = scene.client(Version::V1).await;
    let e = error_of(&prepare(&mut v1, std::slice::from_ref(&c1)).await, U1);
    assert_contains(&e, &["writing its files", "Read-only file system"]);
    assert_contains(&e, &["its devices were put back"]);
    assert!(state_claims(&scene).is_empty(), "{}", scene.state());
    let remount = std::process::Command::new("nsenter")
        .args([
            "-t",
            &driver.child.id().to_string(),
            "-m",
            "mount",
            "-o",
            "remount,bind,rw",
        ])
        .arg(&cdi)
        .status()
        .unwrap();
    assert!(remount.success());
    assert_eq!(
        prepare(&mut v1, std::slice::from_ref(&c1)).await[U1],
        v1_answer()
    );
    assert_eq!(state_claims(&scene)[U1]["phase"], "prepared");
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}

/// A state file brought from another node (claims of pool `node-b`, a record of a
/// device this node does not have) is not trusted: its claims and their device
/// records are forgotten, saying so, no device is touched, and the groups they
/// named can be prepared here.
#[tokio::test]
async fn a_state_file_from_another_node_is_quarantined() {
    let scene = Scene::new();
    let server = cluster();
    let c1 = put_v1_claim(&server);
    let state = json!({"version": 1,
        "devices": {
            "0000:01:00.0": {"original_driver": "e1000e", "original_override": null,
                "driver": "vfio-pci", "role": "selected", "resource": "example.com/NIC_PT", "group": 5},
            "0000:3b:00.0": {"original_driver": "nvidia", "original_override": null,
                "driver": "vfio-pci", "role": "selected", "resource": "example.com/GPU_PT", "group": 5}},
        "claims": {"uid-b": {"namespace": "vms", "name": "vm-on-b", "phase": "prepared",
            "devices": [
                {"request_names": ["card"], "pool": "node-b", "device": "pci-0000-01-00-0",
                 "address": "0000:01:00.0", "group": 5},
                {"request_names": ["gpu"], "pool": "node-b", "device": "pci-0000-3b-00-0",
                 "address": "0000:3b:00.0", "group": 5}]}}});
    std::fs::create_dir_all(scene.state_file().parent().unwrap()).unwrap();
    std::fs::write(scene.state_file(), state.to_string()).unwrap();
    let driver = scene.start(&server).await;
    let log = driver.log();
    assert_contains(
        &log,
        &[
            "a claim of another node",
            "vms/vm-on-b (uid uid-b) of pool node-b",
        ],
    );
    assert!(state_claims(&scene).is_empty(), "{}", scene.state());
    assert!(state_devices(&scene).is_empty(), "{}", scene.state());
    assert_eq!(
        std::fs::read_link(scene.root().join("sys/bus/pci/devices/0000:01:00.0/driver"))
            .unwrap()
            .file_name()
            .unwrap(),
        "vfio-pci",
        "no device touched"
    );
    let mut v1 = scene.client(Version::V1).await;
    assert_eq!(
        prepare(&mut v1, std::slice::from_ref(&c1)).await[U1],
        v1_answer()
    );
    drop(driver);
}
