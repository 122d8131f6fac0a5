//! `examples/cdi_driver.rs` as a program: started with its settings in the
//! environment against a stand-in API server, it publishes its devices, and the
//! kubelet-like peer registers it, prepares a claim (one CDI spec written, its
//! ids answered) and unprepares it (the spec gone); SIGTERM stops it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use fake_apiserver::objects::{self, DeviceResult};
use fake_apiserver::{paths, FakeApiServer};
use kubelet_peer::dra::{self, ClaimRef, Dra};

const DRIVER: &str = "cdi.example.com";
const NODE: &str = "node-a";
const WAIT: Duration = Duration::from_secs(20);

/// The example's binary, which `cargo test` builds beside the test binaries:
/// `examples/cdi_driver` in the target directory, or, when a separate build
/// directory holds the test binaries, the newest `examples/cdi_driver-<hash>`
/// there.
fn example() -> PathBuf {
    let test = std::env::current_exe().unwrap();
    let examples = test.parent().unwrap().parent().unwrap().join("examples");
    let plain = examples.join("cdi_driver");
    if plain.is_file() {
        return plain;
    }
    let hashed = std::fs::read_dir(&examples)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("cdi_driver-") && p.extension().is_none()
        })
        .max_by_key(|p| p.metadata().unwrap().modified().unwrap());
    hashed.unwrap_or_else(|| panic!("no cdi_driver example in {}", examples.display()))
}

/// Kills the example when the test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < WAIT, "{what}: not within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn spec_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

#[test]
fn the_cdi_example_publishes_prepares_with_a_spec_and_unprepares() {
    let dir = tempfile::tempdir().unwrap();
    let server = FakeApiServer::start().unwrap();
    server.put(&paths::node(NODE), objects::node(NODE, &[]));
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, fake_apiserver::kubeconfig(&server.url())).unwrap();
    let (kubelet, cdi) = (dir.path().join("kubelet"), dir.path().join("cdi"));
    let mut running = Running(
        Command::new(example())
            .env("NODE_NAME", NODE)
            .env("DEVICES", "4")
            .env("CDI_DIR", &cdi)
            .env("KUBELET_DIR", &kubelet)
            .env("KUBECONFIG", &kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .spawn()
            .unwrap(),
    );

    wait_until("four devices published", || {
        let slices = server.list(&paths::resourceslices());
        let names: Vec<&str> = slices
            .iter()
            .flat_map(|s| s["spec"]["devices"].as_array().into_iter().flatten())
            .filter_map(|d| d["name"].as_str())
            .collect();
        names == ["dev-0", "dev-1", "dev-2", "dev-3"]
    });

    let claim = ClaimRef {
        uid: "0b0e6d5c-3c52-4bd1-9a43-2c1d0a7d2f10".into(),
        namespace: "vms".into(),
        name: "gpu".into(),
    };
    let results = [
        DeviceResult::new("gpu", DRIVER, NODE, "dev-1"),
        DeviceResult::new("gpu", DRIVER, NODE, "dev-3"),
    ];
    server.put(
        &paths::resourceclaim(&claim.namespace, &claim.name),
        objects::resource_claim(&claim.namespace, &claim.name, &claim.uid, Some(&results)),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let registry = kubelet.join("plugins_registry");
    let (prepared, unprepared, spec_text) = rt.block_on(async {
        let registered = dra::register(&registry, WAIT).await.unwrap();
        let mut client = Dra::connect(&registered.endpoint_path(), registered.chosen)
            .await
            .unwrap();
        let prepared = client.prepare(std::slice::from_ref(&claim)).await.unwrap();
        let spec_text = spec_files(&cdi)
            .iter()
            .map(|f| std::fs::read_to_string(f).unwrap())
            .collect::<Vec<_>>();
        let unprepared = client
            .unprepare(std::slice::from_ref(&claim))
            .await
            .unwrap();
        (prepared, unprepared, spec_text)
    });

    let answer = &prepared.claims[&claim.uid];
    assert_eq!(answer.error, "");
    let ids: Vec<&str> = answer
        .devices
        .iter()
        .flat_map(|d| d.cdi_device_ids.iter().map(String::as_str))
        .collect();
    let kind = format!("{DRIVER}/device");
    assert_eq!(
        ids,
        [
            format!("{kind}=dev-1-{}", claim.uid),
            format!("{kind}=dev-3-{}", claim.uid)
        ]
    );
    assert_eq!(spec_text.len(), 1, "one spec for the claim: {spec_text:?}");
    let spec: serde_json::Value = serde_json::from_str(&spec_text[0]).unwrap();
    assert_eq!(spec["kind"], kind.as_str());
    // A name that starts with a digit (a uid may) needs cdiVersion 0.5.0, and
    // containerd refuses the whole spec otherwise (specs-go version.go,
    // requiresV050).
    assert_eq!(spec["cdiVersion"], "0.3.0");
    for d in spec["devices"].as_array().unwrap() {
        let name = d["name"].as_str().unwrap();
        assert!(
            name.starts_with(|c: char| c.is_ascii_alphabetic()),
            "{name}"
        );
    }
    assert_eq!(
        spec["devices"][1]["containerEdits"]["env"][0],
        "DEVICE_DEV_3=dev-3"
    );
    assert_eq!(unprepared.claims[&claim.uid].error, "");
    assert!(
        spec_files(&cdi).is_empty(),
        "the spec is removed at unprepare"
    );

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(running.0.id()).unwrap()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = running.0.try_wait().unwrap() {
            break status;
        }
        assert!(start.elapsed() < WAIT, "SIGTERM did not stop the example");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "the example exits 0 on SIGTERM: {status}");
}
