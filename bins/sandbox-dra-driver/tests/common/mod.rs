//! The scene the host tests of the real `sandbox-dra-driver` binary play in: a fake
//! node tree, the stand-in API server, the binary itself with every path in a
//! scratch directory, and the kubelet-like peer's DRA client.

#![allow(dead_code)] // not every test uses every helper

pub mod driver;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use fake_apiserver::objects::{self, DeviceResult};
use fake_apiserver::{paths, FakeApiServer};
use kubelet_peer::dra::ClaimRef;
use kubelet_peer::dra::{self, Dra, Version};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use sysfs_pci::testing::{FakeDevice, FakeNode};

/// The driver name (the default).
pub const DRIVER: &str = "vfio-sandbox.rebellions.ai";
/// The condition the driver sets once a claim's devices are on vfio.
pub const READY: &str = "vfio-sandbox.rebellions.ai/VfioReady";
/// The condition the driver sets when it could not move them.
pub const FAILED: &str = "vfio-sandbox.rebellions.ai/VfioFailed";
/// An allocation's binding conditions: the driver's two, as its slices publish
/// them for a device it moves early.
pub const WAITS: fake_apiserver::objects::Waits<'static> = fake_apiserver::objects::Waits {
    ready: READY,
    failed: FAILED,
};
/// The node, and so the pool.
pub const NODE: &str = "node-a";
/// The namespace of the test claims.
pub const NS: &str = "vms";
/// The driver's own namespace, DaemonSet and pod.
pub const DRIVER_NS: &str = "vfio-sandbox";
/// The driver's DaemonSet.
pub const DS: &str = "sandbox-dra-driver";
/// The driver's pod.
pub const POD: &str = "sandbox-dra-driver-x7k2p";
/// The node label the DaemonSet selects.
pub const LABEL: (&str, &str) = ("vfio-sandbox.rebellions.ai/dra", "true");
/// The CDI kind.
pub const KIND: &str = "vfio-sandbox.rebellions.ai/vfio";
/// How long anything may take to show up.
pub const WAIT: Duration = Duration::from_secs(10);

/// A fake node and the paths the driver gets, all under one scratch directory.
pub struct Scene {
    pub dir: tempfile::TempDir,
    pub node: FakeNode,
}

impl Scene {
    /// The node of `sysfs_pci::testing::nic_node` (the two-function NIC in group 5, a
    /// NIC in group 6, an nvme in group 7, all on vfio-pci), plus a companion in
    /// group 5 (an audio function the list does not select, already on vfio-pci)
    /// and a device of no resource on its own driver in group 8; the vfio modules
    /// show as loaded.
    pub fn new() -> Self {
        let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
        let node = sysfs_pci::testing::nic_node(dir.path()).unwrap();
        node.add_device(
            &FakeDevice::new("0000:01:00.2", 0x8086, 0x293e, 0x04_0300)
                .driver("vfio-pci")
                .group(5)
                .numa(0)
                .parent("0000:00:01.0"),
        );
        node.add_device(
            &FakeDevice::new("0000:04:00.0", 0x10ec, 0x8168, 0x02_0000)
                .driver("r8169")
                .group(8),
        );
        for m in ["vfio", "vfio_iommu_type1", "vfio_pci"] {
            node.add_module(m);
        }
        Self { dir, node }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    /// The root as text, for expected file contents.
    pub fn root_str(&self) -> String {
        self.root().to_str().unwrap().to_owned()
    }

    pub fn registry_dir(&self) -> PathBuf {
        self.root().join("plugins_registry")
    }

    pub fn plugins_dir(&self) -> PathBuf {
        self.root().join("plugins")
    }

    pub fn cdi_dir(&self) -> PathBuf {
        self.root().join("cdi")
    }

    pub fn metadata_dir(&self) -> PathBuf {
        self.root().join("metadata")
    }

    pub fn state_file(&self) -> PathBuf {
        self.root().join("run/dra/state.json")
    }

    pub fn ready_file(&self) -> PathBuf {
        self.root().join("run/dra/ready")
    }

    /// The node-wide owner lock this scene's driver (and vfio-manager) share.
    pub fn owner_lock(&self) -> PathBuf {
        self.root().join("run/owner/owner.lock")
    }

    /// vfio-manager's state file on this node.
    pub fn manager_state_file(&self) -> PathBuf {
        self.root().join("run/vfio-manager/state.json")
    }

    /// The owner lock's record, parsed (null when absent or empty).
    pub fn owner(&self) -> Value {
        std::fs::read_to_string(self.owner_lock())
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null)
    }

    /// The real `vfio-manager` on this scene's node and owner lock, its output
    /// discarded and its stderr in `log`.
    pub fn manager(&self, log: &str) -> Command {
        let mut c = Command::new(vfio_manager_binary());
        let arg = |p: PathBuf| p.to_string_lossy().into_owned();
        c.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .args(["--sysfs-root", &arg(self.root().join("sys"))])
            .args(["--dev-root", &arg(self.root().join("dev"))])
            .args(["--modules-root", &arg(self.root().join("lib/modules"))])
            .args(["--config", &arg(self.root().join("list.json"))])
            .args(["--state-file", &arg(self.manager_state_file())])
            .args(["--dra-state-file", &arg(self.state_file())])
            .args(["--owner-lock", &arg(self.owner_lock())])
            .args([
                "--ready-file",
                &arg(self.root().join("run/vfio-manager/ready")),
            ])
            .args([
                "--validator-status-dir",
                &arg(self.root().join("run/validations")),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        c.stderr(std::fs::File::create(self.root().join(log)).unwrap());
        c
    }

    pub fn registration_socket(&self) -> PathBuf {
        self.registry_dir().join(format!("{DRIVER}-reg.sock"))
    }

    pub fn service_socket(&self) -> PathBuf {
        self.plugins_dir().join(DRIVER).join("dra.sock")
    }

    /// The claim's CDI spec file.
    pub fn cdi_spec(&self, uid: &str) -> PathBuf {
        self.cdi_dir().join(format!("{DRIVER}-vfio_{uid}.json"))
    }

    /// The claim's metadata file for `request`.
    pub fn metadata_file(&self, uid: &str, request: &str) -> PathBuf {
        self.metadata_dir()
            .join(DRIVER)
            .join(uid)
            .join(request)
            .join("metadata.json")
    }

    /// The driver's state file, parsed (null when absent).
    pub fn state(&self) -> Value {
        match std::fs::read_to_string(self.state_file()) {
            Ok(text) => serde_json::from_str(&text).unwrap(),
            Err(_) => Value::Null,
        }
    }

    /// The binary with every path flag pointed into the scene, its environment
    /// cleared of anything that could point elsewhere, and its log in `log`.
    pub fn command(&self, log: &str) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_sandbox-dra-driver"));
        let arg = |p: PathBuf| p.to_string_lossy().into_owned();
        c.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("HOME", self.root())
            .env("KUBECONFIG", self.root().join("no-such-kubeconfig"))
            .args(["--sysfs-root", &arg(self.root().join("sys"))])
            .args(["--dev-root", &arg(self.root().join("dev"))])
            .args(["--modules-root", &arg(self.root().join("lib/modules"))])
            .args(["--config", &arg(self.root().join("list.json"))])
            .args(["--registry-dir", &arg(self.registry_dir())])
            .args(["--plugins-dir", &arg(self.plugins_dir())])
            .args(["--cdi-dir", &arg(self.cdi_dir())])
            .args(["--metadata-dir", &arg(self.metadata_dir())])
            .args(["--state-file", &arg(self.state_file())])
            .args(["--ready-file", &arg(self.ready_file())])
            .args(["--owner-lock", &arg(self.owner_lock())])
            .args(["--manager-state-file", &arg(self.manager_state_file())])
            .args(["--resync-interval", "1h"])
            .env("VFIO_SANDBOX_PREPARE_TIMEOUT", "10s")
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        // A file, not a pipe: a thousand refused claims log more than a pipe holds.
        let file = std::fs::File::create(self.root().join(log)).unwrap();
        c.stderr(file);
        c
    }

    /// A driver for node [`NODE`] talking to `server`, started and serving.
    pub async fn start(&self, server: &FakeApiServer) -> Driver {
        self.start_with(server, &[]).await
    }

    /// [`Self::start`] with more environment.
    pub async fn start_with(&self, server: &FakeApiServer, env: &[(&str, &str)]) -> Driver {
        let log = format!("driver-{}.log", next_id());
        let mut c = self.command(&log);
        c.env("KUBECONFIG", server.write_kubeconfig(self.root()).unwrap())
            .env("NODE_NAME", NODE);
        for (k, v) in env {
            c.env(k, v);
        }
        // A driver killed before leaves its socket files: wait for a fresh one.
        let reg = self.registration_socket();
        let old = inode(&reg);
        let mut driver = Driver {
            child: c.spawn().unwrap(),
            log: self.root().join(log),
        };
        driver
            .wait_until("the registration socket", || {
                inode(&reg).is_some_and(|i| Some(i) != old)
            })
            .await;
        driver
    }

    /// The kubelet-like peer's client on the service socket.
    pub async fn client(&self, version: Version) -> Dra {
        Dra::connect(&self.service_socket(), version).await.unwrap()
    }
}

/// The `vfio-manager` binary beside ours, built once per test binary: Cargo
/// builds only this package's binaries for its tests. `VFIO_MANAGER_BINARY`
/// names one already built instead: scripts/test.sh passes the one its
/// workspace build made, since `cargo build -p vfio-manager` resolves that
/// package's own features and compiles two dozen crates again.
pub fn vfio_manager_binary() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            if let Some(given) = std::env::var_os("VFIO_MANAGER_BINARY") {
                let path = PathBuf::from(given);
                assert!(
                    path.is_file(),
                    "VFIO_MANAGER_BINARY={} is not a file",
                    path.display()
                );
                return path;
            }
            let ours = Path::new(env!("CARGO_BIN_EXE_sandbox-dra-driver"));
            let dir = ours.parent().unwrap();
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut build = Command::new(cargo);
            build
                .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
                .args(["build", "--locked", "--quiet", "-p", "vfio-manager"])
                .args(["--bin", "vfio-manager"]);
            if dir.file_name().is_some_and(|n| n == "release") {
                build.arg("--release");
            }
            let status = build.status().unwrap();
            assert!(status.success(), "building vfio-manager failed: {status}");
            let path = dir.join("vfio-manager");
            assert!(path.is_file(), "{} was not built", path.display());
            path
        })
        .clone()
}

/// The inode of the file at `path`, if there is one.
pub fn inode(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| m.ino())
}

fn next_id() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// A running driver process.
pub struct Driver {
    pub child: Child,
    pub log: PathBuf,
}

impl Driver {
    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Polls `f` until it holds; fails if the driver exits first or it takes too long.
    pub async fn wait_until(&mut self, what: &str, mut f: impl FnMut() -> bool) {
        let start = Instant::now();
        while !f() {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!(
                    "the driver exited ({status}) before {what}:\n{}",
                    self.log()
                );
            }
            assert!(
                start.elapsed() < WAIT,
                "timed out waiting for {what}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn signal(&self, sig: Signal) {
        let pid = Pid::from_raw(i32::try_from(self.child.id()).unwrap());
        kill(pid, sig).unwrap();
    }

    /// SIGKILL, and wait for it to be gone.
    pub fn kill(mut self) {
        self.signal(Signal::SIGKILL);
        self.child.wait().unwrap();
    }

    /// SIGTERM; its exit status and log.
    pub async fn terminate(mut self) -> (ExitStatus, String) {
        self.signal(Signal::SIGTERM);
        let status = wait_exit(&mut self.child).await;
        (status, self.log())
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Waits for `child` to exit, at most [`WAIT`].
pub async fn wait_exit(child: &mut Child) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(start.elapsed() < WAIT, "the driver did not exit");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A stand-in API server holding the Node (labelled for the DaemonSet).
pub fn cluster() -> FakeApiServer {
    let s = FakeApiServer::start().unwrap();
    s.put(&paths::node(NODE), objects::node(NODE, &[LABEL]));
    s
}

/// [`cluster`] plus the driver's DaemonSet selecting the node and its pod on it.
pub fn cluster_with_daemonset() -> FakeApiServer {
    let s = cluster();
    s.put(
        &paths::daemonset(DRIVER_NS, DS),
        objects::daemonset(DRIVER_NS, DS, &[LABEL]),
    );
    s.put(
        &paths::pod(DRIVER_NS, POD),
        objects::pod(DRIVER_NS, POD, NODE, DS),
    );
    s
}

/// A result of our driver in this node's pool.
pub fn ours(request: &str, device: &str) -> DeviceResult {
    DeviceResult::new(request, DRIVER, NODE, device)
}

/// Stores ResourceClaim `NS/name` with `uid`, allocated `results` (unallocated when
/// `None`), made from a template with pod claim name `pod_claim` when given.
pub fn put_claim(
    server: &FakeApiServer,
    name: &str,
    uid: &str,
    results: Option<&[DeviceResult]>,
    pod_claim: Option<&str>,
) -> ClaimRef {
    let mut claim = objects::resource_claim(NS, name, uid, results);
    if let Some(p) = pod_claim {
        claim["metadata"]["annotations"] = json!({"resource.kubernetes.io/pod-claim-name": p});
    }
    server.put(&paths::resourceclaim(NS, name), claim);
    claim_ref(name, uid)
}

/// How kubelet names claim `NS/name`.
pub fn claim_ref(name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        uid: uid.into(),
        namespace: NS.into(),
        name: name.into(),
    }
}

/// `{"string": s}`.
pub fn s(v: &str) -> Value {
    json!({ "string": v })
}

/// `{"int": i}`.
pub fn i(v: i64) -> Value {
    json!({ "int": v })
}

/// Registers as kubelet does and returns what it saw.
pub async fn register(scene: &Scene) -> dra::Registered {
    dra::register(&scene.registry_dir(), WAIT).await.unwrap()
}

/// The ResourceSlices in the server.
pub fn slices(server: &FakeApiServer) -> Vec<Value> {
    server.list(&paths::resourceslices())
}
