//! The real `vfio-manager run` asking a stand-in API server, over HTTP, whether a
//! stop is a rollout (keep the devices bound) or the node leaving VM mode (restore),
//! and telling the cluster what it did with Node events. The fake sysfs tree does
//! not rebind anything, so a restore shows as its first sysfs write (the override
//! cleared) and a kept device as no write at all; the real kernel restores in the
//! test bed's demo.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;
use common::command;
use fake_apiserver::{objects, paths, FakeApiServer};
use serde_json::json;
use sysfs_pci::testing::FakeNode;

const NS: &str = "vfio-sandbox";
const DS: &str = "vfio-manager";
const POD: &str = "vfio-manager-abcde";
const NODE: &str = "node-a";
const LABEL: &str = "rebellions.ai/npu.workload.config";
const BDF: &str = "0000:01:00.0";

/// A node where a previous `run` moved one NIC from e1000e to vfio-pci.
fn node(dir: &Path) -> FakeNode {
    let node = common::nic_node(dir, &[(BDF, "vfio-pci", 4)]);
    std::fs::write(
        node.host
            .device_dir(&BDF.parse().unwrap())
            .join("driver_override"),
        "vfio-pci\n",
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("run/validations")).unwrap();
    let state = json!({"version": 1, "devices": {BDF: {
        "original_driver": "e1000e", "original_override": null, "driver": "vfio-pci",
        "role": "selected", "resource": "example.com/NIC_PT", "group": 4}}});
    std::fs::write(dir.join("run/state.json"), state.to_string()).unwrap();
    std::fs::write(dir.join("run/validations/vfio-pci-ready"), "{}").unwrap();
    node
}

fn cluster() -> FakeApiServer {
    let s = FakeApiServer::start().unwrap();
    s.put(
        &paths::node(NODE),
        objects::node(NODE, &[(LABEL, "vm-passthrough")]),
    );
    s.put(
        &paths::daemonset(NS, DS),
        objects::daemonset(NS, DS, &[(LABEL, "vm-passthrough")]),
    );
    s.put(&paths::pod(NS, POD), objects::pod(NS, POD, NODE, DS));
    s
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `run` against `server` (or with no API access) and waits for its ready file.
fn start(dir: &Path, server: Option<&FakeApiServer>) -> Child {
    let mut c = command(dir);
    c.args(["--ready-file", &dir.join("run/ready").to_string_lossy()])
        .args([
            "--validator-status-dir",
            &dir.join("run/validations").to_string_lossy(),
        ])
        .args(["run", "--resync-interval", "1h"])
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("NODE_NAME")
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE")
        .env("HOME", dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(s) = server {
        c.env("KUBECONFIG", s.write_kubeconfig(dir).unwrap())
            .env("NODE_NAME", NODE)
            .env("POD_NAME", POD)
            .env("POD_NAMESPACE", NS);
    } else {
        c.env("KUBECONFIG", dir.join("no-such-kubeconfig"));
    }
    let mut child = c.spawn().unwrap();
    let ready = dir.join("run/ready");
    wait_until("the ready file", || {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("run exited early: {status:?}\n{}", output(&mut child).1);
        }
        ready.exists()
    });
    child
}

/// What the child wrote (a stream already taken by the test reads as empty).
fn output(child: &mut Child) -> (String, String) {
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut o) = child.stdout.take() {
        std::io::Read::read_to_string(&mut o, &mut out).unwrap();
    }
    if let Some(mut e) = child.stderr.take() {
        std::io::Read::read_to_string(&mut e, &mut err).unwrap();
    }
    (out, err)
}

/// SIGTERM, wait, and return (exit code, stdout, stderr).
fn stop(mut child: Child) -> (Option<i32>, String, String) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "run ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = output(&mut child);
    (status.code(), out, err)
}

fn override_of(node: &FakeNode) -> String {
    std::fs::read_to_string(
        node.host
            .device_dir(&BDF.parse().unwrap())
            .join("driver_override"),
    )
    .unwrap()
}

fn event_reasons(s: &FakeApiServer) -> Vec<String> {
    s.list(&paths::events("default"))
        .iter()
        .map(|e| e["reason"].as_str().unwrap_or("").to_owned())
        .collect()
}

#[test]
fn a_rollout_leaves_the_devices_bound_and_says_so() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    let server = cluster();
    let child = start(dir.path(), Some(&server));
    let (code, _, err) = stop(child);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("the node stays in VM mode"), "{err}");
    assert!(
        err.contains("still selected by DaemonSet vfio-sandbox/vfio-manager"),
        "{err}"
    );
    assert_eq!(
        override_of(&node),
        "vfio-pci\n",
        "a kept device is not touched"
    );
    let state = std::fs::read_to_string(dir.path().join("run/state.json")).unwrap();
    assert!(
        state.contains(BDF),
        "the record stays for the next pod: {state}"
    );
    assert!(
        dir.path().join("run/validations/vfio-pci-ready").exists(),
        "the node is still ready for VMs"
    );
    assert!(
        !dir.path().join("run/ready").exists(),
        "run's own ready file goes with the process"
    );
    assert_eq!(event_reasons(&server), ["DevicesKept"]);
    let kept = &server.list(&paths::events("default"))[0];
    assert_eq!(kept["regarding"]["name"], NODE);
    assert!(
        kept["note"]
            .as_str()
            .unwrap()
            .starts_with("kept 1 device(s) on vfio"),
        "{kept}"
    );
}

/// The node leaving VM mode in each way the cluster can say it.
fn assert_leaving_restores(change: impl FnOnce(&FakeApiServer), why: &str) {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    let server = cluster();
    let child = start(dir.path(), Some(&server));
    change(&server);
    let (_, _, err) = stop(child);
    assert!(err.contains("the node leaves VM mode; restoring"), "{err}");
    assert!(err.contains(why), "expected {why:?} in:\n{err}");
    assert_ne!(
        override_of(&node),
        "vfio-pci\n",
        "restore starts by clearing the override:\n{err}"
    );
    assert!(
        !dir.path().join("run/validations/vfio-pci-ready").exists(),
        "the validator's ready file must go when the node leaves VM mode"
    );
}

#[test]
fn the_label_removed_restores() {
    assert_leaving_restores(
        |s| {
            let mut n = s.get(&paths::node(NODE)).unwrap();
            fake_apiserver::merge_patch(&mut n, &json!({"metadata": {"labels": {LABEL: null}}}));
            s.put(&paths::node(NODE), n);
        },
        "label rebellions.ai/npu.workload.config is gone",
    );
}

#[test]
fn the_label_set_to_container_restores() {
    assert_leaving_restores(
        |s| {
            let mut n = s.get(&paths::node(NODE)).unwrap();
            fake_apiserver::merge_patch(
                &mut n,
                &json!({"metadata": {"labels": {LABEL: "container"}}}),
            );
            s.put(&paths::node(NODE), n);
        },
        "label rebellions.ai/npu.workload.config=container",
    );
}

#[test]
fn the_daemonset_deleted_restores() {
    assert_leaving_restores(
        |s| assert!(s.remove(&paths::daemonset(NS, DS))),
        "DaemonSet vfio-sandbox/vfio-manager was deleted",
    );
}

#[test]
fn an_api_server_that_fails_on_the_stop_restores() {
    // 500 is not retried by the client (503 and 429 are, within the 10 s bound).
    assert_leaving_restores(|s| s.fail_next(100, 500), "the API server could not tell");
}

#[test]
fn without_api_access_it_says_so_at_start_and_restores() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    let child = start(dir.path(), None);
    let (_, _, err) = stop(child);
    assert!(err.contains("NODE_NAME is not set"), "{err}");
    assert!(err.contains("no API access; restoring"), "{err}");
    assert_ne!(override_of(&node), "vfio-pci\n");
    assert!(!dir.path().join("run/validations/vfio-pci-ready").exists());
}

#[test]
fn with_a_node_name_but_no_reachable_server_it_warns_at_start_and_restores() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let gone = FakeApiServer::start().unwrap();
    let kubeconfig = gone.write_kubeconfig(dir.path()).unwrap();
    drop(gone);
    let mut child = command(dir.path())
        .args([
            "--ready-file",
            &dir.path().join("run/ready").to_string_lossy(),
        ])
        .args([
            "--validator-status-dir",
            &dir.path().join("run/validations").to_string_lossy(),
        ])
        .args(["run", "--resync-interval", "1h", "--node-name", NODE])
        .env("KUBECONFIG", kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Follow stderr as it is written, and stop only once the failed start-up Node
    // read has been said.
    let stderr = child.stderr.take().unwrap();
    let seen = Arc::new(Mutex::new(String::new()));
    let reader = {
        let seen = seen.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut s = seen.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        })
    };
    wait_until("the failed Node read said at start", || {
        assert!(
            child.try_wait().unwrap().is_none(),
            "run exited early:\n{}",
            seen.lock().unwrap()
        );
        seen.lock().unwrap().contains("cannot read this Node now")
    });
    stop(child);
    reader.join().unwrap();
    let err = seen.lock().unwrap().clone();
    assert!(err.contains("the node leaves VM mode; restoring"), "{err}");
}

#[test]
fn node_events_say_what_was_restored() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let server = cluster();
    let child = start(dir.path(), Some(&server));
    server.remove(&paths::daemonset(NS, DS));
    let (code, _, err) = stop(child);
    // The fake tree never rebinds, so the restore fails (exit 1) and says so.
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(event_reasons(&server), ["RestoreFailed"], "{err}");
    let e = &server.list(&paths::events("default"))[0];
    assert_eq!(e["type"], "Warning");
    assert!(e["note"].as_str().unwrap().contains(BDF), "{e}");
}

const PENDING: &str = "vfio-sandbox.rebellions.ai/vfio-manager.restore-pending";

fn node_labels(s: &FakeApiServer) -> serde_json::Value {
    s.get(&paths::node(NODE)).unwrap()["metadata"]["labels"].clone()
}

/// Starts `run` against `server` with a short resync (the period of its checks)
/// and follows its stderr; does not wait for the ready file.
fn spawn_watching(dir: &Path, server: &FakeApiServer) -> (Child, Arc<Mutex<String>>) {
    let mut child = command(dir)
        .args(["--ready-file", &dir.join("run/ready").to_string_lossy()])
        .args([
            "--validator-status-dir",
            &dir.join("run/validations").to_string_lossy(),
        ])
        .args(["run", "--resync-interval", "200ms"])
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("HOME", dir)
        .env("KUBECONFIG", server.write_kubeconfig(dir).unwrap())
        .env("NODE_NAME", NODE)
        .env("POD_NAME", POD)
        .env("POD_NAMESPACE", NS)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let seen = Arc::new(Mutex::new(String::new()));
    let s = seen.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let mut s = s.lock().unwrap();
            s.push_str(&line);
            s.push('\n');
        }
    });
    (child, seen)
}

#[test]
fn the_restore_label_stands_while_run_may_have_devices_and_survives_a_rollout() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let server = cluster();
    let child = start(dir.path(), Some(&server));
    // Put before the first bind: the ready file came after it.
    assert_eq!(node_labels(&server)[PENDING], "true");
    let (code, _, err) = stop(child);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("the node stays in VM mode"), "{err}");
    assert_eq!(
        node_labels(&server)[PENDING],
        "true",
        "a rollout keeps the records, so the label stays"
    );
    assert_eq!(node_labels(&server)[LABEL], "vm-passthrough");
}

#[test]
fn leaving_vm_mode_restores_while_the_pod_runs_and_drops_the_label_when_nothing_is_left() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let fake = node(dir.path());
    let server = cluster();
    let (mut child, seen) = spawn_watching(dir.path(), &server);
    wait_until("the ready file", || dir.path().join("run/ready").exists());
    assert_eq!(node_labels(&server)[PENDING], "true");
    // The workload label goes; the restore label keeps the pod (the DaemonSet
    // controller would not stop it), so `run` finds out by its own check.
    let mut n = server.get(&paths::node(NODE)).unwrap();
    fake_apiserver::merge_patch(&mut n, &json!({"metadata": {"labels": {LABEL: null}}}));
    server.put(&paths::node(NODE), n);
    wait_until("the restore while running", || {
        seen.lock()
            .unwrap()
            .contains("the node leaves VM mode; restoring while this pod runs")
    });
    wait_until("the override cleared", || {
        override_of(&fake) != "vfio-pci\n"
    });
    assert!(!dir.path().join("run/ready").exists());
    assert!(!dir.path().join("run/validations/vfio-pci-ready").exists());
    // The fake tree never rebinds, so the record stays, and so does the label;
    // repeated tries do not repeat the Event.
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(node_labels(&server)[PENDING], "true");
    assert_eq!(
        event_reasons(&server),
        ["RestoreFailed"],
        "{}",
        seen.lock().unwrap()
    );
    assert!(child.try_wait().unwrap().is_none(), "run keeps running");
    // Once the record is settled (the device is gone), the label goes.
    fake.remove_device(&BDF.parse().unwrap());
    wait_until("the label removed", || {
        node_labels(&server).get(PENDING).is_none()
    });
    let state = std::fs::read_to_string(dir.path().join("run/state.json")).unwrap();
    assert!(!state.contains(BDF), "{state}");
    // Back in VM mode: the label returns.
    let mut n = server.get(&paths::node(NODE)).unwrap();
    fake_apiserver::merge_patch(
        &mut n,
        &json!({"metadata": {"labels": {LABEL: "vm-passthrough"}}}),
    );
    server.put(&paths::node(NODE), n);
    wait_until("the label back", || node_labels(&server)[PENDING] == "true");
    assert!(seen
        .lock()
        .unwrap()
        .contains("the node is back in VM mode; binding again"));
    let (code, _, _) = stop(child);
    let err = seen.lock().unwrap().clone();
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn a_pod_brought_back_by_the_label_finishes_the_restore_and_binds_nothing() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let fake = node(dir.path());
    // The node left VM mode and a pod was killed mid-restore; the label stands.
    let server = cluster();
    let mut n = server.get(&paths::node(NODE)).unwrap();
    fake_apiserver::merge_patch(
        &mut n,
        &json!({"metadata": {"labels": {LABEL: null, PENDING: "true"}}}),
    );
    server.put(&paths::node(NODE), n);
    let (child, seen) = spawn_watching(dir.path(), &server);
    wait_until("the start in leave mode", || {
        seen.lock()
            .unwrap()
            .contains("the node is not in VM mode: finishing the restore, binding nothing")
    });
    wait_until("the override cleared", || {
        override_of(&fake) != "vfio-pci\n"
    });
    fake.remove_device(&BDF.parse().unwrap());
    wait_until("the label removed", || {
        node_labels(&server).get(PENDING).is_none()
    });
    assert!(!dir.path().join("run/ready").exists());
    let (code, out, _) = stop(child);
    let err = seen.lock().unwrap().clone();
    assert_eq!(code, Some(0), "{err}");
    assert!(!out.contains("bound "), "{out}");
    assert!(!err.contains("bound bdf"), "{err}");
}

/// `vfio-manager uninstall`, the chart's pre-delete hook: deletes the DaemonSet and
/// returns once it is gone; a missing one is nothing to wait for; a malformed name
/// is a usage error. (That the real garbage collector makes it wait for the pods
/// is proven by the guest node's uninstall step, on a real control plane.)
#[test]
fn uninstall_deletes_the_daemonset_and_waits_until_it_is_gone() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let s = cluster();
    let kubeconfig = s.write_kubeconfig(dir.path()).unwrap();
    let uninstall = |target: &str| {
        command(dir.path())
            .args(["uninstall", "--daemonset", target, "--timeout", "10s"])
            .env("KUBECONFIG", &kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .output()
            .unwrap()
    };
    let target = format!("{NS}/{DS}");
    let out = uninstall(&target);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains(&format!("DaemonSet {target} deleted")),
        "{stdout}"
    );
    assert!(s.get(&paths::daemonset(NS, DS)).is_none());
    assert!(s
        .requests()
        .iter()
        .any(|(m, p)| m == "DELETE" && p.contains(&format!("/daemonsets/{DS}"))));

    let out = uninstall(&target);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("does not exist"));

    for bad in ["vfio-manager", "/x", "ns/", "a/b/c"] {
        let out = uninstall(bad);
        assert_eq!(out.status.code(), Some(2), "{bad}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("NAMESPACE/NAME"),
            "{bad}: {out:?}"
        );
    }
}
