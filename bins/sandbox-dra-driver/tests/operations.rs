//! Operating the real `sandbox-dra-driver` binary as the other agents are operated:
//! its readiness probe, its metrics endpoint, and the Events it posts on the
//! ResourceClaims it cannot prepare; on a fake node, with the kubelet-like peer
//! and the stand-in API server.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::driver::{metrics_address, scrape, value};
use common::*;
use fake_apiserver::objects::DeviceResult;
use fake_apiserver::paths;
use kubelet_peer::dra::{self, Version};
use serde_json::Value;

const U1: &str = "0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a";
const U3: &str = "7a3b5c1d-9e2f-4a6b-8c0d-2e4f6a8b0c1d";
const U4: &str = "3c5e7a9b-1d2f-4b6c-8e0a-4c6e8a0b2d3f";
const U5: &str = "9b1d3f5a-7c2e-4d6f-8a0b-6d8f0a2c4e5b";

/// `sandbox-dra-driver ready` for the scene: exit code and output.
fn probe(scene: &Scene) -> (Option<i32>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandbox-dra-driver"))
        .env_clear()
        .arg("ready")
        .arg("--ready-file")
        .arg(scene.ready_file())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text)
}

fn assert_contains(text: &str, parts: &[&str]) {
    for p in parts {
        assert!(text.contains(p), "{p:?} missing from: {text}");
    }
}

/// Ready once kubelet accepted the registration and the slice is published; not
/// ready while either is missing, when kubelet refuses the registration, while a
/// publish fails, or after the driver stopped.
#[tokio::test]
async fn ready_means_registered_and_published() {
    let scene = Scene::new();
    let server = cluster();
    // A ready file a killed predecessor left, naming the sockets this one serves.
    let stale = scene.ready_file();
    std::fs::create_dir_all(stale.parent().unwrap()).unwrap();
    std::fs::write(
        &stale,
        serde_json::json!({
            "registered": true, "slices": ["old"],
            "sockets": [scene.registration_socket(), scene.service_socket()],
        })
        .to_string(),
    )
    .unwrap();
    let mut driver = scene.start(&server).await;
    driver
        .wait_until("the slice", || !slices(&server).is_empty())
        .await;
    let (code, out) = probe(&scene);
    assert_eq!(code, Some(1), "published, not registered: {out}");
    assert_contains(&out, &["not ready:", "does not exist"]);

    register(&scene).await;
    let file = scene.ready_file();
    driver.wait_until("the ready file", || file.exists()).await;
    let (code, out) = probe(&scene);
    assert_eq!(code, Some(0), "{out}");
    assert_contains(
        &out,
        &[
            "ready: registered with kubelet; 2 ResourceSlice(s) published \
                (node-a-vfio-sandbox-rebellions-ai, node-a-vfio-sandbox-rebellions-ai-1)",
        ],
    );

    // kubelet refuses a registration (NotifyRegistrationStatus false): not ready
    // until it accepts one again.
    dra::notify(
        &scene.registration_socket(),
        kubelet_api::pluginregistration::RegistrationStatus {
            plugin_registered: false,
            error: "no supported version".into(),
        },
    )
    .await
    .unwrap();
    driver
        .wait_until("the ready file to go", || !file.exists())
        .await;
    assert_eq!(probe(&scene).0, Some(1));
    register(&scene).await;
    driver
        .wait_until("the ready file again", || file.exists())
        .await;

    // A publish that fails (kubelet wiped the slice, the API server refuses the
    // write): not ready until a publish succeeds.
    server.fail_next_on("POST", 3, 500);
    server.remove(&paths::resourceslice("node-a-vfio-sandbox-rebellions-ai"));
    driver
        .wait_until("not ready while the slice cannot be written", || {
            !file.exists()
        })
        .await;
    driver
        .wait_until("ready once the slice is back", || {
            file.exists() && !slices(&server).is_empty()
        })
        .await;
    assert_eq!(probe(&scene).0, Some(0));

    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(!file.exists(), "the ready file goes at stop");
    let (code, out) = probe(&scene);
    assert_eq!(code, Some(1));
    assert_contains(&out, &["not ready:"]);
}

/// A ready file whose sockets are gone, or that is not a ready file, is not ready.
#[test]
fn the_probe_checks_the_sockets_and_refuses_foreign_files() {
    let scene = Scene::new();
    let file = scene.ready_file();
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    let reg = scene.registration_socket();
    std::fs::write(
        &file,
        format!(
            r#"{{"registered":true,"slices":["s"],"sockets":["{}"]}}"#,
            reg.display()
        ),
    )
    .unwrap();
    let (code, out) = probe(&scene);
    assert_eq!(code, Some(1));
    assert_contains(&out, &["not ready:", &reg.display().to_string()]);
    std::fs::create_dir_all(reg.parent().unwrap()).unwrap();
    let _listener = std::os::unix::net::UnixListener::bind(&reg).unwrap();
    assert_eq!(probe(&scene).0, Some(0));
    for garbage in [
        "",
        "{",
        "[]",
        r#"{"registered":false,"slices":[],"sockets":[]}"#,
        r#"{"registered":true,"slices":[1],"sockets":[]}"#,
    ] {
        std::fs::write(&file, garbage).unwrap();
        let (code, out) = probe(&scene);
        assert_eq!(code, Some(1), "{garbage:?}: {out}");
        assert_contains(&out, &["not ready:", "ready file"]);
    }
}

/// One claim each way a prepare fails on a node: a group another claim holds, a
/// device of another node, a claim read that outlasts the call. Each is counted by
/// reason and posted as a Warning Event on its ResourceClaim; the claim that works
/// and its unprepare are counted too, with the devices and the slice writes.
#[tokio::test]
async fn prepare_failures_are_counted_by_reason_and_posted_on_their_claims() {
    let scene = Scene::new();
    let server = cluster();
    let card = |device: &str| ours("card", device);
    let c1 = put_claim(
        &server,
        "vm1-card",
        U1,
        Some(&[card("pci-0000-01-00-0"), card("pci-0000-01-00-1")]),
        None,
    );
    let held = put_claim(
        &server,
        "vm3-card",
        U3,
        Some(&[card("pci-0000-01-00-1")]),
        None,
    );
    let elsewhere = put_claim(
        &server,
        "vm4-nic",
        U4,
        Some(&[DeviceResult::new(
            "nic",
            DRIVER,
            "node-b",
            "pci-0000-02-00-0",
        )]),
        None,
    );
    let slow = put_claim(
        &server,
        "vm5-disk",
        U5,
        Some(&[ours("disk", "pci-0000-03-00-0")]),
        None,
    );
    let mut driver = scene
        .start_with(
            &server,
            &[
                ("VFIO_SANDBOX_METRICS_ADDRESS", "127.0.0.1:0"),
                ("VFIO_SANDBOX_PREPARE_TIMEOUT", "1s"),
            ],
        )
        .await;
    driver
        .wait_until("both slices", || slices(&server).len() == 2)
        .await;
    let address = metrics_address(&driver).expect("no metrics address in the log");
    let mut client = scene.client(Version::V1).await;
    let answers = client
        .prepare(std::slice::from_ref(&c1))
        .await
        .unwrap()
        .claims;
    assert_eq!(answers[U1].error, "");
    let answers = client.prepare(&[held, elsewhere]).await.unwrap().claims;
    assert_contains(&answers[U3].error, &["IOMMU group 5", "vm1-card"]);
    assert_contains(&answers[U4].error, &["node-b"]);
    let text = scrape(&address);
    assert_eq!(
        value(&text, r#"vfio_sandbox_dra_devices{state="prepared"}"#),
        2.0
    );
    assert_eq!(
        value(&text, r#"vfio_sandbox_dra_devices{state="published"}"#),
        5.0
    );
    server.set_latency(Some((
        "GET",
        &paths::resourceclaim(NS, "vm5-disk"),
        Duration::from_millis(1500),
    )));
    let answers = client
        .prepare(std::slice::from_ref(&slow))
        .await
        .unwrap()
        .claims;
    assert_contains(&answers[U5].error, &["took too long"]);
    server.set_latency(None);
    let answers = client
        .unprepare(std::slice::from_ref(&c1))
        .await
        .unwrap()
        .claims;
    assert_eq!(answers[U1].error, "");

    let text = scrape(&address);
    for (series, want) in [
        (
            r#"vfio_sandbox_dra_claims_total{operation="prepare",result="ok"}"#,
            1.0,
        ),
        (
            r#"vfio_sandbox_dra_claims_total{operation="prepare",result="error"}"#,
            3.0,
        ),
        (
            r#"vfio_sandbox_dra_claims_total{operation="unprepare",result="ok"}"#,
            1.0,
        ),
        (
            r#"vfio_sandbox_dra_claims_total{operation="unprepare",result="error"}"#,
            0.0,
        ),
        (
            r#"vfio_sandbox_dra_failures_total{operation="prepare",reason="group_held"}"#,
            1.0,
        ),
        (
            r#"vfio_sandbox_dra_failures_total{operation="prepare",reason="not_ours"}"#,
            1.0,
        ),
        (
            r#"vfio_sandbox_dra_failures_total{operation="prepare",reason="timeout"}"#,
            1.0,
        ),
        (
            r#"vfio_sandbox_dra_failures_total{operation="prepare",reason="failed"}"#,
            0.0,
        ),
        (
            r#"vfio_sandbox_dra_call_seconds_count{operation="prepare"}"#,
            3.0,
        ),
        (
            r#"vfio_sandbox_dra_call_seconds_count{operation="unprepare"}"#,
            1.0,
        ),
        (r#"vfio_sandbox_dra_devices{state="prepared"}"#, 0.0),
        (r#"vfio_sandbox_dra_devices{state="published"}"#, 5.0),
        (
            r#"vfio_sandbox_dra_slice_writes_total{action="create"}"#,
            2.0,
        ),
        (
            r#"vfio_sandbox_dra_slice_writes_total{action="error"}"#,
            0.0,
        ),
    ] {
        assert_eq!(value(&text, series), want, "{series}");
    }
    // The slow call took about its 1 s bound, and no call more.
    assert!(
        value(
            &text,
            r#"vfio_sandbox_dra_call_seconds_sum{operation="prepare"}"#
        ) < 3.0
    );

    // One Warning Event per failed claim, on the claim, in its namespace.
    let events = || server.list(&paths::events(NS));
    driver
        .wait_until("three Events", || events().len() >= 3)
        .await;
    let mut seen: Vec<(String, String, String)> = events()
        .iter()
        .map(|e: &Value| {
            assert_eq!(e["type"], "Warning", "{e}");
            assert_eq!(e["action"], "PrepareResources", "{e}");
            assert_eq!(e["regarding"]["kind"], "ResourceClaim", "{e}");
            assert_eq!(e["regarding"]["apiVersion"], "resource.k8s.io/v1", "{e}");
            assert_eq!(e["regarding"]["namespace"], NS, "{e}");
            (
                e["reason"].as_str().unwrap().to_owned(),
                e["regarding"]["name"].as_str().unwrap().to_owned(),
                e["regarding"]["uid"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("IOMMUGroupHeld".into(), "vm3-card".into(), U3.into()),
            ("NotOurDevice".into(), "vm4-nic".into(), U4.into()),
            ("PrepareTimedOut".into(), "vm5-disk".into(), U5.into()),
        ]
    );
    let note = |reason: &str| {
        events()
            .into_iter()
            .find(|e| e["reason"] == reason)
            .and_then(|e| e["note"].as_str().map(str::to_owned))
            .unwrap()
    };
    assert_contains(&note("IOMMUGroupHeld"), &["IOMMU group 5", "vm1-card"]);
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}

/// `ready` needs no node name, and `--help` names the probe and the metrics.
#[test]
fn help_names_the_probe_the_ready_file_and_the_metrics() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandbox-dra-driver"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert_contains(
        &help,
        &[
            "ready",
            "--ready-file",
            "--metrics-address",
            "readiness probe",
        ],
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandbox-dra-driver"))
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "serving needs --node-name");
    assert_contains(&String::from_utf8_lossy(&out.stderr), &["--node-name"]);
}

/// A cluster whose API server does not serve `resource.k8s.io/v1` (Kubernetes
/// before 1.34) is refused at start, saying which release is needed, before any
/// socket is offered to kubelet; one that serves it is asked once, at start.
#[tokio::test]
async fn an_api_server_before_1_34_is_refused_naming_the_release_needed() {
    let scene = Scene::new();
    let server = cluster();
    server.set_unserved(&["resource.k8s.io/v1"]);
    let mut child = scene
        .command("old-server.log")
        .env("KUBECONFIG", server.write_kubeconfig(scene.root()).unwrap())
        .env("NODE_NAME", NODE)
        .spawn()
        .unwrap();
    let status = wait_exit(&mut child).await;
    let log = std::fs::read_to_string(scene.root().join("old-server.log")).unwrap();
    assert_eq!(status.code(), Some(1), "{log}");
    assert_contains(
        &log,
        &[
            "does not serve resource.k8s.io/v1",
            "Kubernetes 1.34 or newer",
        ],
    );
    assert!(
        !scene.registration_socket().exists(),
        "nothing offered to kubelet"
    );
    assert!(slices(&server).is_empty());

    server.set_unserved(&[]);
    let driver = scene.start(&server).await;
    assert!(server
        .requests()
        .iter()
        .any(|(m, p)| m == "GET" && p == "/apis/resource.k8s.io/v1"));
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}

/// A driver name that cannot name the ResourceSlices and the claims' CDI specs
/// is bad configuration: exit 2 naming the flag, the name and what is wrong with
/// it, before the API server is asked or anything on the node is made, instead
/// of a driver that starts and fails every publication and every prepare.
#[test]
fn a_driver_name_that_cannot_name_the_files_is_refused_at_start() {
    let scene = Scene::new();
    for (name, reason) in [
        ("Vfio.sandbox.io", "only a-z, 0-9, '-' and '.' are allowed"),
        ("1vfio.sandbox.io", "must start with a letter"),
        ("vfio_sandbox.io", "only a-z, 0-9, '-' and '.' are allowed"),
        (&"a".repeat(64), "too long"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandbox-dra-driver"))
            .env_clear()
            .env("KUBECONFIG", scene.root().join("kubeconfig"))
            .args(["--node-name", NODE, "--driver-name", name])
            .arg("--state-file")
            .arg(scene.state_file())
            .arg("--owner-lock")
            .arg(scene.owner_lock())
            .arg("--registry-dir")
            .arg(scene.root().join("registry"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {stderr}");
        assert_contains(&stderr, &["--driver-name", "invalid driver name", reason]);
        assert!(stderr.contains(&name[..20.min(name.len())]), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        for made in [
            scene.state_file(),
            scene.owner_lock(),
            scene.root().join("registry"),
        ] {
            assert!(!made.exists(), "{name}: {} was made", made.display());
        }
    }
}

/// A socket path too long for a Unix socket (107 bytes), in either directory
/// kubelet dials, is bad configuration: exit 2 naming the path, its length and the
/// limit, before the API server is asked or anything on the node is made; never
/// a panic.
#[test]
fn a_socket_path_too_long_is_refused_at_start() {
    let scene = Scene::new();
    let long = scene.root().join("d".repeat(100));
    for (flag, socket) in [
        ("--plugins-dir", long.join("vfio.sandbox.io/dra.sock")),
        ("--registry-dir", long.join("vfio.sandbox.io-reg.sock")),
    ] {
        let short = scene.root().join("short");
        let other = if flag == "--plugins-dir" {
            "--registry-dir"
        } else {
            "--plugins-dir"
        };
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandbox-dra-driver"))
            .env_clear()
            .env("KUBECONFIG", scene.root().join("kubeconfig"))
            .args(["--node-name", NODE, "--driver-name", "vfio.sandbox.io"])
            .args([flag, &long.to_string_lossy()])
            .args([other, &short.to_string_lossy()])
            .arg("--state-file")
            .arg(scene.state_file())
            .arg("--owner-lock")
            .arg(scene.owner_lock())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {stderr}");
        let len = socket.as_os_str().len();
        assert_contains(
            &stderr,
            &[
                &socket.display().to_string(),
                &format!("is {len} bytes long"),
                "at most 107 bytes",
                flag,
            ],
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        for made in [long.clone(), short, scene.state_file(), scene.owner_lock()] {
            assert!(!made.exists(), "{flag}: {} was made", made.display());
        }
    }
}

/// A socket that cannot be served after the start's checks (here a regular file
/// where the service socket goes, never deleted) ends the driver with exit 1
/// naming the file: the serving that failed is not waited on again (that was an
/// abort, "`async fn` resumed after completion").
#[tokio::test]
async fn a_socket_that_cannot_be_served_is_an_error_not_a_panic() {
    let scene = Scene::new();
    let server = cluster();
    let socket = scene.service_socket();
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    std::fs::write(&socket, "not a socket").unwrap();
    let mut child = scene
        .command("unservable.log")
        .env("KUBECONFIG", server.write_kubeconfig(scene.root()).unwrap())
        .env("NODE_NAME", NODE)
        .spawn()
        .unwrap();
    let status = wait_exit(&mut child).await;
    let log = std::fs::read_to_string(scene.root().join("unservable.log")).unwrap();
    assert_eq!(status.code(), Some(1), "{log}");
    assert_contains(
        &log,
        &[
            &socket.display().to_string(),
            "it is a regular file, not a socket",
        ],
    );
    assert!(!log.contains("panicked"), "{log}");
    assert_eq!(std::fs::read_to_string(&socket).unwrap(), "not a socket");
}
