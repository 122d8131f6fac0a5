//! The real `sandbox-dra-controller` binary stopped by SIGTERM the moment it
//! leads, against the fake API server (which can hold an answer back, as the
//! real one cannot on demand): it exits within the pod's grace and leaves the
//! Lease released, whether or not its first list of claims has answered.

#![allow(clippy::unwrap_used)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fake_apiserver::FakeApiServer;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const NAMESPACE: &str = "vfio-sandbox-dra";
const LEASE: &str =
    "/apis/coordination.k8s.io/v1/namespaces/vfio-sandbox-dra/leases/sandbox-dra-controller";

/// The replica's process, killed if a test fails before it exited.
struct Replica(Child);

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(server: &FakeApiServer, dir: &std::path::Path, pod: &str) -> Replica {
    let kubeconfig = server.write_kubeconfig(dir).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_sandbox-dra-controller"))
        .args(["--metrics-address", "127.0.0.1:0"])
        .env_clear()
        .env("HOME", dir)
        .env("KUBECONFIG", kubeconfig)
        .env("POD_NAMESPACE", NAMESPACE)
        .env("POD_NAME", pod)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    Replica(child)
}

fn holder(server: &FakeApiServer) -> Option<String> {
    let lease = server.get(LEASE)?;
    Some(
        lease["spec"]["holderIdentity"]
            .as_str()
            .unwrap_or("")
            .to_owned(),
    )
}

/// Polls until `done`, or fails after `timeout` saying `what`.
fn wait(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < timeout, "{what}: not within {timeout:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// SIGTERM to `replica` once it holds the Lease; asserts that it exits 0
/// within 15 s with the Lease released, and returns its stderr.
fn stop_when_leading(server: &FakeApiServer, replica: &mut Replica, pod: &str) -> String {
    wait(
        "the replica took the Lease",
        Duration::from_secs(20),
        || holder(server).as_deref() == Some(pod),
    );
    let child = &mut replica.0;
    let pid = Pid::from_raw(i32::try_from(child.id()).unwrap());
    kill(pid, Signal::SIGTERM).unwrap();
    let sent = Instant::now();
    let mut code = None;
    wait(
        "the replica exited after SIGTERM",
        Duration::from_secs(25),
        || {
            code = child.try_wait().unwrap();
            code.is_some()
        },
    );
    let took = sent.elapsed();
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        std::io::Read::read_to_string(&mut e, &mut err).unwrap();
    }
    let code = code.unwrap().code();
    assert_eq!(code, Some(0), "{pod}: exit status after SIGTERM:\n{err}");
    assert!(
        took < Duration::from_secs(15),
        "{pod}: took {took:?} to stop:\n{err}"
    );
    assert_eq!(
        holder(server).as_deref(),
        Some(""),
        "{pod}: Lease not released:\n{err}"
    );
    err
}

#[test]
fn a_leader_stopped_before_its_first_list_answered_still_exits_and_releases() {
    let server = FakeApiServer::start().unwrap();
    // The claim list is held back past the grace: the labelling never starts.
    server.set_latency(Some((
        "GET",
        "/apis/resource.k8s.io/v1/resourceclaims",
        Duration::from_secs(60),
    )));
    let dir = tempfile::tempdir().unwrap();
    let mut child = start(&server, dir.path(), "labeller-0");
    let err = stop_when_leading(&server, &mut child, "labeller-0");
    assert!(err.contains("released the Lease"), "{err}");
    assert!(
        err.contains("labelling did not stop within 5s; stopped it"),
        "{err}"
    );
}

#[test]
fn five_leaders_stopped_the_moment_each_leads_exit_and_release() {
    let server = FakeApiServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for round in 0..5 {
        let pod = format!("labeller-{round}");
        let mut child = start(&server, dir.path(), &pod);
        stop_when_leading(&server, &mut child, &pod);
    }
}
