//! `dra-bench`: the same null DRA driver on two libraries, side by side on the
//! real kube-apiserver, scheduler, controller manager and kubelet of one
//! release ([`real_k8s::control`], [`real_k8s::node`]): `lib/kubelet-plugin`'s
//! `examples/cdi_driver.rs` and `tests/dra-reference`, the same work on Go's
//! `k8s.io/dynamic-resource-allocation` (`kubeletplugin.Helper` and its
//! ResourceSlice controller). Both publish `dev-0…` in the node's pool and
//! prepare a claim by writing one CDI spec for it. With `--our-bins`, also
//! `sandbox-dra-driver` and `sandbox-device-plugin` on the fake PCI tree of the
//! real-k8s scenarios ([`real_k8s::drivers`]: two NPUs, the moves done by the
//! FUSE PCI core), asked for the same devices by the same pods.
//!
//! Per run, each in turn (the two null drivers' order alternates between runs,
//! so neither always meets a warmer server; then the two passthrough ones), it
//! measures:
//!
//! - **publish** (null drivers): from the driver's start to all N devices in
//!   ResourceSlices (a watch of the driver's slices), for each N of `--sizes`,
//!   from no slices, under a driver name of its own (`publish.example.com`) so
//!   that the scheduler's pool of the pod phase never churns; and the driver's
//!   CPU time to that point;
//! - **pods**: after one warm-up pod, pod creation to its container running
//!   (the pod watch's first `Running`), each pod with its own claim from a
//!   template that the scheduler allocates (the device plugin's: one device in
//!   its limits): `--pods` one after another, then each batch of `--together`
//!   at once (passthrough: the batches the two NPUs hold); kubelet's own
//!   `dra_operations_duration_seconds` and `dra_grpc_operations_duration_seconds`
//!   over each phase (mean from `_sum`/`_count`: a null driver's calls sit in
//!   the first bucket, 0.1 s), and how long the runtime took to start the pods'
//!   sandboxes and containers as kubelet waited for it ([`KUBELET_MEANS`]);
//! - **prepares** (DRA drivers): `--prepares` claims (made once, allocated by
//!   this harness to the driver's devices in turn for this phase only) each
//!   prepared and then unprepared straight on the driver's socket, each call
//!   timed (p50, p99), with two floors: the same unprepare again (nothing left
//!   to do) and this harness's own read of the claim from the API server (each
//!   prepare reads it); and, null drivers, the largest batch of them prepared
//!   in as many calls at once, then unprepared, then unprepared again (the
//!   floor), with the CPU time the driver and this harness spent in each of
//!   those bursts. The NPUs start on vfio-pci, so
//!   those calls move nothing; sandbox-dra-driver then does the first
//!   [`MOVING_PAIRS`] again with the NPUs on their own driver (`moving_…`):
//!   each prepare moves its NPU to vfio-pci and each unprepare moves it back;
//! - **memory and CPU**: the RSS and CPU time idle (published, after a settle)
//!   and after the pods and prepares (and of that, sandbox-dra-driver's claims
//!   thread's);
//! - **restart** (DRA drivers): after a `kill -9`, from the new process's start
//!   to kubelet connected to it again (its log's
//!   `Connection changed … connected=true`) with all its devices in its slices.
//!
//! Both null drivers talk to the API server as the admin and keep their
//! libraries' defaults; the passthrough ones run as the chart runs them (their
//! ServiceAccount, the shipped resource list, and sandbox-dra-driver with the
//! claim labeller and its shipped settings, [`SHIPPED`]); what a node keeps
//! under `/run` is on a tmpfs ([`run_on_tmpfs`]). Prints one line per
//! subject and run, then medians; asserts nothing.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};
use kubelet_peer::dra::{ClaimRef, Dra, Version};
use real_k8s::api::{client, create, delete, get, median, merge_patch, open_watch, percentile};
use real_k8s::control::{ControlPlane, Gates, Release};
use real_k8s::drivers::{self, Host, CA22, CA22_CLASS, NPUS};
use real_k8s::node::{Node, BUSYBOX};
use real_k8s::proc::{cpu_time, rss_kib, run_time, thread_run_time, Proc};
use serde_json::{json, Value};

/// The null drivers' name in the pod phase (one DeviceClass and one template
/// serve both).
const NULL_DRIVER: &str = "cdi.example.com";
/// Their name in the publish phase.
const PUBLISH_DRIVER: &str = "publish.example.com";
/// The DeviceClass of the null drivers' devices.
const CLASS: &str = "cdi-example";
/// Where the pods and their claims live.
const NS: &str = "dra-bench";
/// Where the claims prepared straight on a socket live.
const DIRECT_NS: &str = "dra-bench-direct";
/// Devices the null drivers publish for the pod and prepare phases.
const POD_DEVICES: usize = 128;
/// sandbox-dra-driver's settings as the chart ships them (the scenarios run it
/// with debug logs and a 1 s resync): its claims watched through the
/// labeller's label (POD_NAMESPACE, the labeller running), the default resync,
/// info logs.
const SHIPPED: &[(&str, &str)] = &[
    ("POD_NAMESPACE", drivers::DRIVER_NS),
    ("VFIO_SANDBOX_RESYNC_INTERVAL", "5m"),
    ("VFIO_SANDBOX_LOG_LEVEL", "info"),
];
/// Pods measured at least in each batch size of --together (see there).
const SMALL_BATCH_PODS: usize = 8;
/// sandbox-dra-driver's prepares and unprepares that move an NPU (the fake PCI
/// core's moves are slower than the calls; enough for a p50 and a p99).
const MOVING_PAIRS: usize = 200;
/// How long any one wait may take before the run fails.
const TIMEOUT: Duration = Duration::from_secs(180);
/// How long the warm-up pod may take before it is made again.
const WARM_UP: Duration = Duration::from_secs(20);
/// How often a condition is looked at.
const POLL: Duration = Duration::from_millis(5);

#[derive(Parser, Debug)]
#[command(
    name = "dra-bench",
    about = "The same null DRA driver on lib/kubelet-plugin and on Go's kubeletplugin, \
             and our passthrough drivers, side by side on the real control plane and kubelet"
)]
struct Cli {
    /// The release's binaries (scripts/build-k8s.sh prints the directory).
    #[arg(long, value_name = "DIR")]
    k8s_bins: PathBuf,
    /// containerd, its shim and ctr (scripts/build-k8s.sh containerd).
    #[arg(long, value_name = "DIR")]
    containerd_bins: PathBuf,
    /// The release, v1.<minor>[.<patch>].
    #[arg(long)]
    release: String,
    /// The driver on lib/kubelet-plugin (its example `cdi_driver`).
    #[arg(long, value_name = "FILE")]
    rust: PathBuf,
    /// The driver on Go's kubeletplugin (tests/dra-reference).
    #[arg(long, value_name = "FILE")]
    go: PathBuf,
    /// sandbox-dra-driver and sandbox-device-plugin, measured too when given.
    #[arg(long, value_name = "DIR", requires = "helm")]
    our_bins: Option<PathBuf>,
    /// helm, which installs the chart's RBAC and DeviceClasses (with --our-bins).
    #[arg(long, value_name = "FILE")]
    helm: Option<PathBuf>,
    /// Device counts of the publish figure.
    #[arg(long, value_delimiter = ',', default_value = "8,256,1024,4096")]
    sizes: Vec<usize>,
    /// Runs (each runs every subject).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Pods made one after another.
    #[arg(long, default_value_t = 50)]
    pods: usize,
    /// Batches of pods made at once. A batch smaller than 8 (or --pods) is
    /// made again until that many pods are measured: kubelet sees a container
    /// start at its next relist, once a second, so one small batch's time is
    /// mostly where it fell between two.
    #[arg(long, value_delimiter = ',', default_value = "2,16,64")]
    together: Vec<usize>,
    /// Claims prepared and unprepared straight on a DRA driver's socket.
    #[arg(long, default_value_t = 1000)]
    prepares: usize,
    /// How long a driver is left idle before its idle RSS and CPU are read.
    #[arg(long, default_value_t = 2000, value_name = "MS")]
    settle_ms: u64,
    /// Measure only these subjects (default: all; the passthrough ones need
    /// --our-bins). For profiling one of them; the tables compare what ran.
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Subject>,
    /// Scratch directory (default: a new one under the temp dir, removed after).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

/// What is measured.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Subject {
    /// The null driver on lib/kubelet-plugin.
    Rust,
    /// The null driver on Go's kubeletplugin.
    Go,
    /// sandbox-dra-driver on the fake tree.
    #[value(name = "sandbox-dra-driver")]
    Sandbox,
    /// sandbox-device-plugin on the fake tree.
    #[value(name = "device-plugin")]
    Plugin,
}

impl Subject {
    fn name(self) -> &'static str {
        match self {
            Subject::Rust => "rust",
            Subject::Go => "go",
            Subject::Sandbox => "sandbox-dra-driver",
            Subject::Plugin => "device-plugin",
        }
    }
}

/// One subject's figures of one run, in the order printed.
struct Row {
    subject: Subject,
    figures: Vec<(String, f64)>,
}

impl Row {
    fn new(subject: Subject) -> Self {
        Self {
            subject,
            figures: Vec::new(),
        }
    }

    fn add(&mut self, name: impl Into<String>, value: f64) {
        self.figures.push((name.into(), value));
    }
}

/// A driver when idle: its process, its CPU time, and that of
/// sandbox-dra-driver's claims thread ([`WORKER_THREAD`]; none in the others).
struct Idle {
    pid: u32,
    cpu: Duration,
    worker: Option<Duration>,
}

/// The thread on which sandbox-dra-driver does a claim's passthrough work
/// (its `worker.rs`): its CPU time is a figure of its own.
const WORKER_THREAD: &str = "claims";

/// One batch of calls at once: its time, the CPU time the driver and this
/// harness spent in it (ms), and the driver's context switches.
#[derive(Clone, Copy, Default)]
struct Burst {
    took: f64,
    driver_cpu: f64,
    bench_cpu: f64,
    driver_switches: f64,
}

fn main() {
    let cli = Cli::parse();
    // Before any thread: the fake PCI core's mounts end with the harness.
    if let Err(e) = real_k8s::proc::own_mount_namespace().and_then(|()| run(&cli)) {
        eprintln!("dra-bench: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: &Cli) -> Result<()> {
    if cli.sizes.is_empty() || cli.runs == 0 {
        bail!("--sizes and --runs need at least one");
    }
    let passthrough = [Subject::Sandbox, Subject::Plugin];
    if cli.our_bins.is_none() && cli.only.iter().any(|s| passthrough.contains(s)) {
        bail!(
            "--only {:?}: the passthrough drivers need --our-bins",
            cli.only
        );
    }
    let largest = largest_batch(cli);
    if largest > POD_DEVICES {
        bail!("--together {largest}: at most {POD_DEVICES} pods at once (the devices published)");
    }
    let mut files = vec![("--rust", cli.rust.clone()), ("--go", cli.go.clone())];
    if let Some(bins) = &cli.our_bins {
        for b in [
            "sandbox-dra-driver",
            drivers::LABELLER,
            "sandbox-device-plugin",
        ] {
            files.push(("--our-bins", bins.join(b)));
        }
    }
    for (flag, file) in files {
        if !file.is_file() {
            bail!("{flag}: no file {}", file.display());
        }
    }
    let release = Release::parse(&cli.release)?;
    let dir = match &cli.dir {
        Some(d) => d.clone(),
        // Short: kubelet's directories, and the sockets in them, live below
        // it, and a socket path holds at most 107 bytes.
        None => sysfs_pci::testing::scratch_root().join(format!("drab-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir)?;
    let mut plane = ControlPlane::start(
        &cli.k8s_bins,
        &dir.join("cluster"),
        release,
        Gates::Defaults,
        "node-a",
    )
    .context("starting the control plane")?;
    plane.helm = cli.helm.clone();
    // The fake tree's /dev/vfio is the node's (the passthrough pods get its
    // group nodes).
    let host = Host::create(&dir.join("host"))?;
    run_on_tmpfs(&dir.join("node"))?;
    let node = Node::start(
        &plane,
        &cli.containerd_bins,
        &dir.join("node"),
        &host.dir.join("dev/vfio"),
    )
    .context("starting the node (containerd, kubelet)")?;
    if cli.our_bins.is_some() {
        drivers::install_dra_manifests(&plane)?;
    }
    println!(
        "dra-bench: kubelet and control plane {} on {}, {} CPUs, load {}",
        cli.release,
        node.name,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let rows = runtime.block_on(async {
        let bench = Bench {
            cli,
            plane: &plane,
            node: &node,
            host: &host,
            admin: client(&plane.admin).await?,
        };
        bench.setup().await?;
        let mut rows = Vec::new();
        for run in 0..cli.runs {
            let mut order = if run % 2 == 0 {
                vec![Subject::Rust, Subject::Go]
            } else {
                vec![Subject::Go, Subject::Rust]
            };
            if cli.our_bins.is_some() {
                order.extend([Subject::Sandbox, Subject::Plugin]);
            }
            order.retain(|s| cli.only.is_empty() || cli.only.contains(s));
            for subject in order {
                let row = match subject {
                    Subject::Rust | Subject::Go => bench.null_driver(subject, run).await,
                    Subject::Sandbox => bench.sandbox_driver(run).await,
                    Subject::Plugin => bench.device_plugin(run).await,
                }
                .with_context(|| format!("run {run}, {}", subject.name()))?;
                print_row(run, &row);
                rows.push(row);
            }
        }
        anyhow::Ok(rows)
    })?;
    print_tables(&rows);
    println!("load at the end: {}", load());
    drop(node);
    drop(host);
    drop(plane);
    if cli.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

struct Bench<'a> {
    cli: &'a Cli,
    plane: &'a ControlPlane,
    node: &'a Node,
    host: &'a Host,
    admin: kube::Client,
}

/// How a measured pod asks for its device: a pod of that name.
type MakePod<'a> = &'a dyn Fn(&str) -> Value;

impl Bench<'_> {
    /// The namespaces, the null drivers' DeviceClass, the claim templates, and
    /// the claims the null drivers prepare straight on their socket (allocated
    /// here, as the scheduler would, to the node's devices in turn).
    async fn setup(&self) -> Result<()> {
        for ns in [NS, DIRECT_NS] {
            let body = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
            create(&self.admin, "/api/v1/namespaces", &body).await?;
        }
        let class = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": CLASS},
            "spec": {"selectors": [{"cel": {"expression": format!(
                "device.driver == \"{NULL_DRIVER}\"")}}]},
        });
        create(
            &self.admin,
            "/apis/resource.k8s.io/v1/deviceclasses",
            &class,
        )
        .await?;
        let path = format!("/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates");
        for (name, class) in [("null", CLASS), ("npu", CA22_CLASS)] {
            let template = json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"spec": {"devices": {"requests": [
                    {"name": "dev", "exactly": {"deviceClassName": class}}
                ]}}},
            });
            create(&self.admin, &path, &template).await?;
        }
        self.direct_claims_make(NULL_DRIVER, CLASS).await?;
        if self.cli.our_bins.is_some() {
            self.direct_claims_make(drivers::DRIVER, CA22_CLASS).await?;
        }
        Ok(())
    }

    /// `--prepares` claims named `<driver>-<i>`, of `class`, not allocated.
    async fn direct_claims_make(&self, driver: &str, class: &str) -> Result<()> {
        let claims = claims_path(DIRECT_NS);
        for i in 0..self.cli.prepares {
            let claim = json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": format!("{driver}-{i}"), "namespace": DIRECT_NS},
                "spec": {"devices": {"requests": [
                    {"name": "dev", "exactly": {"deviceClassName": class}}
                ]}},
            });
            create(&self.admin, &claims, &claim).await?;
        }
        Ok(())
    }

    /// Allocates `driver`'s straight-on-the-socket claims to its devices in
    /// turn, as the scheduler would, or (`allocate` false) takes that back: an
    /// allocated claim holds its device, and the scheduler would find none
    /// free for the pods.
    async fn direct_allocation(&self, driver: &str, allocate: bool) -> Result<()> {
        let (pool, devices) = self.pool_of(driver).await?;
        let claims = self.direct_claims(driver).await?;
        let path = claims_path(DIRECT_NS);
        for chunk in claims.iter().enumerate().collect::<Vec<_>>().chunks(50) {
            let patches = chunk.iter().map(|(i, c)| {
                let allocation = allocate.then(|| {
                    json!({"devices": {"results": [{
                        "request": "dev", "driver": driver, "pool": pool,
                        "device": devices[i % devices.len()],
                    }]}})
                });
                let body = json!({"status": {"allocation": allocation}});
                let path = format!("{path}/{}/status", c.name);
                async move { merge_patch(&self.admin, &path, &body).await }
            });
            for patched in futures::future::join_all(patches).await {
                patched?;
            }
        }
        Ok(())
    }

    /// The claims of `driver` prepared straight on its socket.
    async fn direct_claims(&self, driver: &str) -> Result<Vec<ClaimRef>> {
        let list = get(&self.admin, &claims_path(DIRECT_NS)).await?;
        let mut claims: Vec<(usize, ClaimRef)> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| {
                let name = c["metadata"]["name"].as_str()?;
                let i = name.strip_prefix(driver)?.strip_prefix('-')?.parse().ok()?;
                let uid = c["metadata"]["uid"].as_str()?;
                let claim = ClaimRef {
                    uid: uid.to_owned(),
                    namespace: DIRECT_NS.to_owned(),
                    name: name.to_owned(),
                };
                Some((i, claim))
            })
            .collect();
        claims.sort_by_key(|(i, _)| *i);
        Ok(claims.into_iter().map(|(_, c)| c).collect())
    }

    /// A null driver's figures of one run.
    async fn null_driver(&self, subject: Subject, run: usize) -> Result<Row> {
        let mut row = Row::new(subject);
        for &n in &self.cli.sizes {
            self.clear_slices(PUBLISH_DRIVER).await?;
            let (ms, cpu_ms) = self.publish(subject, n).await?;
            row.add(format!("publish_{n}_ms"), ms);
            row.add(format!("publish_{n}_cpu_ms"), cpu_ms);
        }
        self.clear_slices(PUBLISH_DRIVER).await?;
        self.clear_slices(NULL_DRIVER).await?;
        let log_from = self.kubelet_log_len();
        let mut driver = self.start_null(subject, NULL_DRIVER, POD_DEVICES)?;
        self.wait_ready(&mut driver, NULL_DRIVER, POD_DEVICES, log_from)
            .await?;
        let make = |name: &str| claim_pod(name, "null");
        let together = self.cli.together.clone();
        let idle = self
            .idle_and_pods(&mut row, &driver, subject, run, &make, &together)
            .await?;
        self.direct_allocation(NULL_DRIVER, true).await?;
        self.prepare_pairs(&mut row, NULL_DRIVER, usize::MAX, "")
            .await?;
        let at_once = largest_batch(self.cli);
        let [prepare, unprepare, again] = self.prepares_at_once(at_once, idle.pid).await?;
        let bursts = [
            ("prepare", prepare),
            ("unprepare", unprepare),
            ("unprepare_again", again),
        ];
        for (call, burst) in bursts {
            row.add(format!("{call}_{at_once}_at_once_ms"), burst.took);
            row.add(
                format!("{call}_{at_once}_at_once_driver_cpu_ms"),
                burst.driver_cpu,
            );
            row.add(
                format!("{call}_{at_once}_at_once_bench_cpu_ms"),
                burst.bench_cpu,
            );
            row.add(
                format!("{call}_{at_once}_at_once_driver_switches"),
                burst.driver_switches,
            );
        }
        self.direct_allocation(NULL_DRIVER, false).await?;
        after(&mut row, &idle)?;

        let log_from = self.kubelet_log_len();
        driver.kill9();
        let mut driver = self.start_null(subject, NULL_DRIVER, POD_DEVICES)?;
        self.wait_ready(&mut driver, NULL_DRIVER, POD_DEVICES, log_from)
            .await?;
        row.add("restart_ms", since_start(&driver));
        driver.stop();
        Ok(row)
    }

    /// sandbox-dra-driver's figures of one run.
    async fn sandbox_driver(&self, run: usize) -> Result<Row> {
        let mut row = Row::new(Subject::Sandbox);
        let binary = self.our_binary("sandbox-dra-driver")?;
        let (mut labeller, _) = drivers::start_labeller(
            self.plane,
            &self.our_binary(drivers::LABELLER)?,
            &format!("{}-bench", drivers::LABELLER),
        )?;
        let log_from = self.kubelet_log_len();
        let mut driver = drivers::start_dra(self.plane, self.node, self.host, &binary, SHIPPED)?;
        self.wait_ready(&mut driver.proc, drivers::DRIVER, NPUS.len(), log_from)
            .await?;
        let make = |name: &str| claim_pod(name, "npu");
        let together = self.passthrough_batches();
        let idle = self
            .idle_and_pods(
                &mut row,
                &driver.proc,
                Subject::Sandbox,
                run,
                &make,
                &together,
            )
            .await?;
        self.direct_allocation(drivers::DRIVER, true).await?;
        self.prepare_pairs(&mut row, drivers::DRIVER, usize::MAX, "")
            .await?;
        after(&mut row, &idle)?;
        // The same calls with the NPUs on their own driver, as on a node
        // where nothing was moved yet: each prepare moves its NPU to vfio-pci
        // and each unprepare moves it back, through the fake PCI core.
        self.set_npus(drivers::NATIVE)?;
        let moving = self
            .prepare_pairs(&mut row, drivers::DRIVER, MOVING_PAIRS, "moving_")
            .await;
        self.set_npus("vfio-pci")?;
        moving?;
        self.direct_allocation(drivers::DRIVER, false).await?;

        let log_from = self.kubelet_log_len();
        driver.proc.kill9();
        let mut driver = drivers::restart_dra(self.plane, self.node, self.host, &binary, SHIPPED)?;
        self.wait_ready(&mut driver.proc, drivers::DRIVER, NPUS.len(), log_from)
            .await?;
        row.add("restart_ms", since_start(&driver.proc));
        driver.proc.stop();
        labeller.stop();
        Ok(row)
    }

    /// sandbox-device-plugin's figures of one run.
    async fn device_plugin(&self, run: usize) -> Result<Row> {
        let mut row = Row::new(Subject::Plugin);
        let binary = self.our_binary("sandbox-device-plugin")?;
        let mut plugin = drivers::start_device_plugin(self.plane, self.node, self.host, &binary)?;
        let t = Instant::now();
        while self.allocatable().await? != NPUS.len() {
            plugin.check()?;
            if t.elapsed() > TIMEOUT {
                bail!(
                    "the node's allocatable {CA22} not {} after {} s",
                    NPUS.len(),
                    TIMEOUT.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let make = |name: &str| limit_pod(name);
        let together = self.passthrough_batches();
        let idle = self
            .idle_and_pods(&mut row, &plugin, Subject::Plugin, run, &make, &together)
            .await?;
        after(&mut row, &idle)?;
        plugin.stop();
        Ok(row)
    }

    fn our_binary(&self, name: &str) -> Result<PathBuf> {
        Ok(self
            .cli
            .our_bins
            .as_ref()
            .context("no --our-bins")?
            .join(name))
    }

    /// The batches of `--together` that the fake tree's NPUs can hold.
    fn passthrough_batches(&self) -> Vec<usize> {
        let fits = self
            .cli
            .together
            .iter()
            .copied()
            .filter(|&k| k <= NPUS.len());
        fits.collect()
    }

    /// The node's allocatable count of the device plugin's resource.
    async fn allocatable(&self) -> Result<usize> {
        let node = get(&self.admin, &format!("/api/v1/nodes/{}", self.node.name)).await?;
        let count = node["status"]["allocatable"][CA22].as_str().unwrap_or("0");
        Ok(count.parse().unwrap_or(0))
    }

    /// The idle figures, a warm-up pod, then the pod phases; the process's id
    /// and CPU times when idle.
    async fn idle_and_pods(
        &self,
        row: &mut Row,
        process: &Proc,
        subject: Subject,
        run: usize,
        make: MakePod<'_>,
        together: &[usize],
    ) -> Result<Idle> {
        tokio::time::sleep(Duration::from_millis(self.cli.settle_ms)).await;
        let pid = process.child.id();
        row.add("idle_rss_mib", rss_kib(pid)? as f64 / 1024.0);
        let idle = Idle {
            pid,
            cpu: cpu_time(pid)?,
            worker: thread_run_time(pid, WORKER_THREAD)?,
        };
        row.add("idle_cpu_ms", idle.cpu.as_secs_f64() * 1000.0);
        let prefix = format!("{}-{run}", subject.name());
        self.warm_up(&prefix, make).await?;
        let mut batches = vec![(format!("pods_1x{}", self.cli.pods), 1, self.cli.pods)];
        for &k in together {
            let repeats = self.cli.pods.min(SMALL_BATCH_PODS).div_ceil(k).max(1);
            batches.push((format!("pods_{k}"), k, repeats));
        }
        for (name, size, count) in batches {
            let before = self.kubelet_metrics()?;
            let mut latencies = Vec::new();
            for b in 0..count {
                let prefix = format!("{prefix}-{name}-{b}").replace('_', "-");
                latencies.extend(self.pods(&prefix, size, make).await?);
                // Passthrough devices are few: a pod one after another frees
                // its device before the next.
                if size > 1 || b + 1 == count || subject != Subject::Rust && subject != Subject::Go
                {
                    self.delete_pods().await?;
                }
            }
            let after = self.kubelet_metrics()?;
            row.add(format!("{name}_p50_ms"), percentile(&mut latencies, 50.0));
            row.add(format!("{name}_p99_ms"), percentile(&mut latencies, 99.0));
            for (short, metric, label) in KUBELET_MEANS {
                let dra = short.starts_with("dra_");
                if dra && subject == Subject::Plugin {
                    continue;
                }
                row.add(
                    format!("{name}_kubelet_{short}_mean_ms"),
                    mean_ms(&before, &after, metric, label),
                );
            }
        }
        Ok(idle)
    }

    /// One pod through to running and gone, made again while the scheduler or
    /// kubelet does not take it (a scheduler that tried before it saw the
    /// driver's devices may wait minutes to try again; kubelet may refuse a pod
    /// at admission right after a device plugin registered).
    async fn warm_up(&self, prefix: &str, make: MakePod<'_>) -> Result<()> {
        for attempt in 1..=3 {
            let name = format!("{prefix}-warm-up-{attempt}");
            let ran = tokio::time::timeout(WARM_UP, self.pods(&name, 1, make)).await;
            self.delete_pods().await?;
            match ran {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => println!("dra-bench: warm-up pod {name}: {e:#}; made again"),
                Err(_) => println!(
                    "dra-bench: warm-up pod {name} not running after {} s; made again",
                    WARM_UP.as_secs()
                ),
            }
        }
        bail!("no warm-up pod ran in three attempts")
    }

    /// Starts a null driver named `driver` with `devices` devices.
    fn start_null(&self, subject: Subject, driver: &str, devices: usize) -> Result<Proc> {
        let binary = match subject {
            Subject::Go => &self.cli.go,
            _ => &self.cli.rust,
        };
        let mut cmd = Command::new(binary);
        cmd.env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("KUBECONFIG", &self.plane.admin)
            .env("NODE_NAME", &self.node.name)
            .env("DRIVER_NAME", driver)
            .env("DEVICES", devices.to_string())
            .env("CDI_DIR", self.node.cdi_dir())
            .env("KUBELET_DIR", self.node.kubelet_dir());
        Proc::spawn(
            &format!("driver-{}", subject.name()),
            cmd,
            &self.plane.logs_dir(),
        )
    }

    /// From the null driver's start to all `n` devices in its slices, and its
    /// CPU time to then, in ms. Stops it.
    async fn publish(&self, subject: Subject, n: usize) -> Result<(f64, f64)> {
        let (devices, version) = self.slice_devices(PUBLISH_DRIVER).await?;
        if devices != 0 {
            bail!("{devices} devices in ResourceSlices before the driver starts");
        }
        let path = format!(
            "{}&watch=true&allowWatchBookmarks=false&resourceVersion={version}",
            slices_path(PUBLISH_DRIVER)
        );
        let body = open_watch(&self.admin, &path).await?;
        let (tell, mut seen) = tokio::sync::watch::channel(0usize);
        let follower = tokio::spawn(async move {
            let mut per_slice = HashMap::<String, usize>::new();
            real_k8s::api::follow(body, |kind, slice| {
                let name = slice["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                if kind == "DELETED" {
                    per_slice.remove(&name);
                } else {
                    let count = slice["spec"]["devices"].as_array().map_or(0, Vec::len);
                    per_slice.insert(name, count);
                }
                let _ = tell.send(per_slice.values().sum());
            })
            .await;
        });
        let t = Instant::now();
        let mut driver = self.start_null(subject, PUBLISH_DRIVER, n)?;
        let waited = tokio::time::timeout(TIMEOUT, seen.wait_for(|&d| d >= n)).await;
        let elapsed = t.elapsed().as_secs_f64() * 1000.0;
        follower.abort();
        let cpu = cpu_time(driver.child.id())?.as_secs_f64() * 1000.0;
        if waited.is_err() {
            driver.check()?;
            bail!(
                "{n} devices not all in ResourceSlices after {} s",
                TIMEOUT.as_secs()
            );
        }
        driver.stop();
        Ok((elapsed, cpu))
    }

    /// `driver`'s slices.
    async fn slices(&self, driver: &str) -> Result<Value> {
        get(&self.admin, &slices_path(driver)).await
    }

    /// The devices in `driver`'s slices, and the list's resourceVersion.
    async fn slice_devices(&self, driver: &str) -> Result<(usize, String)> {
        let list = self.slices(driver).await?;
        let devices = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
            .sum();
        let version = list["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        Ok((devices, version))
    }

    /// `driver`'s pool and device names.
    async fn pool_of(&self, driver: &str) -> Result<(String, Vec<String>)> {
        let list = self.slices(driver).await?;
        let slices = list["items"].as_array().into_iter().flatten();
        let mut pool = String::new();
        let mut devices = Vec::new();
        for s in slices {
            pool = s["spec"]["pool"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            for d in s["spec"]["devices"].as_array().into_iter().flatten() {
                devices.extend(d["name"].as_str().map(str::to_owned));
            }
        }
        if devices.is_empty() {
            bail!("{driver} publishes no device");
        }
        Ok((pool, devices))
    }

    /// Deletes `driver`'s slices and waits until they are gone.
    async fn clear_slices(&self, driver: &str) -> Result<()> {
        delete(&self.admin, &slices_path(driver)).await?;
        let t = Instant::now();
        while self.slice_devices(driver).await?.0 != 0 {
            if t.elapsed() > TIMEOUT {
                bail!(
                    "{driver}'s ResourceSlices not gone after {} s",
                    TIMEOUT.as_secs()
                );
            }
            tokio::time::sleep(POLL).await;
        }
        Ok(())
    }

    /// Waits until kubelet's log (past `log_from`) says it connected to
    /// `driver` and `devices` devices are in its slices.
    async fn wait_ready(
        &self,
        process: &mut Proc,
        driver: &str,
        devices: usize,
        log_from: u64,
    ) -> Result<()> {
        let t = Instant::now();
        let mut connected = false;
        loop {
            connected = connected || self.kubelet_connected_since(driver, log_from);
            if connected && self.slice_devices(driver).await?.0 == devices {
                return Ok(());
            }
            process.check()?;
            if t.elapsed() > TIMEOUT {
                bail!(
                    "after {} s: kubelet connected to {driver}: {connected}; devices in slices: {}",
                    TIMEOUT.as_secs(),
                    self.slice_devices(driver).await?.0
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn kubelet_log(&self) -> PathBuf {
        self.plane.logs_dir().join("kubelet.log")
    }

    fn kubelet_log_len(&self) -> u64 {
        std::fs::metadata(self.kubelet_log()).map_or(0, |m| m.len())
    }

    /// Whether kubelet logged (past `from`) that its connection to `driver`
    /// came up (`pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`, HandleConn).
    fn kubelet_connected_since(&self, driver: &str, from: u64) -> bool {
        use std::io::{Read, Seek, SeekFrom};
        // Only what kubelet wrote since `from`: this runs every few ms, and
        // the log grows by megabytes over a run.
        let mut bytes = Vec::new();
        let read = std::fs::File::open(self.kubelet_log()).and_then(|mut f| {
            f.seek(SeekFrom::Start(from))?;
            f.read_to_end(&mut bytes)
        });
        if read.is_err() {
            return false;
        }
        String::from_utf8_lossy(&bytes).lines().any(|l| {
            l.contains("\"Connection changed\"")
                && l.contains(&format!("driverName=\"{driver}\""))
                && l.contains("connected=true")
        })
    }

    /// Makes `count` pods at once, named `<prefix>-<i>`; how long each took
    /// from the creations' start to running, in ms.
    async fn pods(&self, prefix: &str, count: usize, make: MakePod<'_>) -> Result<Vec<f64>> {
        let list = get(&self.admin, &format!("/api/v1/namespaces/{NS}/pods")).await?;
        let version = list["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default();
        let path = format!("/api/v1/namespaces/{NS}/pods?watch=true&resourceVersion={version}");
        let body = open_watch(&self.admin, &path).await?;
        let phases: Arc<Mutex<HashMap<String, (String, Instant)>>> = Arc::default();
        let seen = phases.clone();
        let follower = tokio::spawn(real_k8s::api::follow(body, move |_, pod| {
            let name = pod["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let phase = pod["status"]["phase"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let mut seen = support::lock(&seen);
            if seen.get(&name).is_none_or(|(p, _)| *p != phase) {
                seen.insert(name, (phase, Instant::now()));
            }
        }));
        let names: Vec<String> = (0..count).map(|i| format!("{prefix}-{i}")).collect();
        let path = format!("/api/v1/namespaces/{NS}/pods");
        let t = Instant::now();
        let creations = names.iter().map(|name| {
            let (admin, path, body) = (&self.admin, &path, make(name));
            async move { create(admin, path, &body).await }
        });
        for created in futures::future::join_all(creations).await {
            created?;
        }
        let outcome = loop {
            let now: Vec<(String, Instant)> = {
                let seen = support::lock(&phases);
                names.iter().filter_map(|n| seen.get(n).cloned()).collect()
            };
            if let Some((phase, _)) = now.iter().find(|(p, _)| p == "Failed" || p == "Succeeded") {
                break Err(anyhow::anyhow!(
                    "a pod {prefix}-* ended ({phase}) before it ran"
                ));
            }
            let running: Vec<f64> = now
                .iter()
                .filter(|(p, _)| p == "Running")
                .map(|(_, at)| at.duration_since(t).as_secs_f64() * 1000.0)
                .collect();
            if running.len() == count {
                break Ok(running);
            }
            if t.elapsed() > TIMEOUT {
                break Err(anyhow::anyhow!(
                    "{} of {count} pods {prefix}-* running after {} s (kubelet log: {})",
                    running.len(),
                    TIMEOUT.as_secs(),
                    self.kubelet_log().display()
                ));
            }
            tokio::time::sleep(POLL).await;
        };
        follower.abort();
        outcome
    }

    /// Deletes every pod of the namespace and waits until they, their claims
    /// and their CDI specs are gone (kubelet unprepared them).
    async fn delete_pods(&self) -> Result<()> {
        delete(&self.admin, &format!("/api/v1/namespaces/{NS}/pods")).await?;
        let t = Instant::now();
        loop {
            let pods = get(&self.admin, &format!("/api/v1/namespaces/{NS}/pods")).await?;
            let claims = get(&self.admin, &claims_path(NS)).await?;
            let left = |list: &Value| list["items"].as_array().map_or(0, Vec::len);
            let specs = self.claim_specs()?;
            if left(&pods) + left(&claims) + specs == 0 {
                return Ok(());
            }
            if t.elapsed() > TIMEOUT {
                bail!(
                    "after {} s: {} pods, {} claims, {specs} claims' CDI specs left",
                    TIMEOUT.as_secs(),
                    left(&pods),
                    left(&claims)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The CDI specs of claims in the node's CDI directory (the null drivers
    /// and sandbox-dra-driver name them after the claim's uid).
    fn claim_specs(&self) -> Result<usize> {
        let dir = std::fs::read_dir(self.node.cdi_dir())?;
        let names = dir
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned());
        Ok(names.filter(|n| looks_like_uid(n)).count())
    }

    /// Puts every NPU of the fake tree on `driver` and makes it the one a
    /// probe binds them to (the device plugin's figures want them on
    /// vfio-pci, where vfio-manager leaves them).
    fn set_npus(&self, driver: &str) -> Result<()> {
        for (address, _) in NPUS {
            self.host.core.set_native(address, driver)?;
            self.host.set_driver(address, Some(driver))?;
        }
        Ok(())
    }

    /// The first `count` of `driver`'s straight-on-the-socket claims, each
    /// prepared then unprepared, one call at a time: p50 and p99 of each
    /// call, as figures named with `prefix`.
    async fn prepare_pairs(
        &self,
        row: &mut Row,
        driver: &str,
        count: usize,
        prefix: &str,
    ) -> Result<()> {
        let mut dra = self.dra_client(driver).await?;
        let mut claims = self.direct_claims(driver).await?;
        claims.truncate(count);
        let mut prepare = Vec::with_capacity(claims.len());
        let mut unprepare = Vec::with_capacity(claims.len());
        let mut again = Vec::with_capacity(claims.len());
        let mut read = Vec::with_capacity(claims.len());
        for c in &claims {
            let asked = std::slice::from_ref(c);
            let t = Instant::now();
            let answer = dra.prepare(asked).await?;
            prepare.push(t.elapsed().as_secs_f64() * 1000.0);
            if let Some(problem) = answer.problems(asked).first() {
                bail!("preparing {c}: {problem}");
            }
            let t = Instant::now();
            let answer = dra.unprepare(asked).await?;
            unprepare.push(t.elapsed().as_secs_f64() * 1000.0);
            if let Some(problem) = answer.problems(asked).first() {
                bail!("unpreparing {c}: {problem}");
            }
            // The floors under those two: the same call with nothing left to
            // do (the gRPC round trip and the library's own step), and one
            // read of the claim from the API server, which every prepare of
            // either library makes (kubelet sends only its name and uid).
            let t = Instant::now();
            dra.unprepare(asked).await?;
            again.push(t.elapsed().as_secs_f64() * 1000.0);
            let path = format!("{}/{}", claims_path(&c.namespace), c.name);
            let t = Instant::now();
            get(&self.admin, &path).await?;
            read.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        let mut add = |name: &str, values: &mut Vec<f64>, p: f64| {
            row.add(format!("{prefix}{name}"), percentile(values, p));
        };
        add("prepare_p50_ms", &mut prepare, 50.0);
        add("prepare_p99_ms", &mut prepare, 99.0);
        add("unprepare_p50_ms", &mut unprepare, 50.0);
        add("unprepare_p99_ms", &mut unprepare, 99.0);
        add("unprepare_again_p50_ms", &mut again, 50.0);
        add("claim_get_p50_ms", &mut read, 50.0);
        Ok(())
    }

    /// A DRA client on `driver`'s socket, as kubelet has.
    async fn dra_client(&self, driver: &str) -> Result<Dra> {
        let socket = self
            .node
            .kubelet_dir()
            .join("plugins")
            .join(driver)
            .join("dra.sock");
        Dra::connect(&socket, Version::V1).await
    }

    /// Prepares the first `count` of the null drivers' straight-on-the-socket
    /// claims in `count` calls at once (as kubelet does for pods starting
    /// together), then unprepares them the same way, and then again (nothing
    /// left to do: the floor of the calls themselves): each batch's time, and
    /// the CPU time the driver (process `pid`) and this harness spent in it.
    async fn prepares_at_once(&self, count: usize, pid: u32) -> Result<[Burst; 3]> {
        let dra = self.dra_client(NULL_DRIVER).await?;
        let claims = self.direct_claims(NULL_DRIVER).await?;
        let claims = &claims[..count.min(claims.len())];
        let mut bursts = [Burst::default(); 3];
        let pid = pid.to_string();
        for (unprepare, burst) in [false, true, true].into_iter().zip(&mut bursts) {
            let (driver_before, switches_before) = run_time(&pid)?;
            let (bench_before, _) = run_time("self")?;
            let t = Instant::now();
            let calls = claims.iter().map(|c| {
                let mut dra = dra.clone();
                async move {
                    let asked = std::slice::from_ref(c);
                    let problems = if unprepare {
                        dra.unprepare(asked).await?.problems(asked)
                    } else {
                        dra.prepare(asked).await?.problems(asked)
                    };
                    match problems.first() {
                        Some(p) => bail!("{c}: {p}"),
                        None => Ok(()),
                    }
                }
            });
            for call in futures::future::join_all(calls).await {
                call?;
            }
            burst.took = t.elapsed().as_secs_f64() * 1000.0;
            let (driver_after, switches_after) = run_time(&pid)?;
            let (bench_after, _) = run_time("self")?;
            // Saturating: a thread that ended in the burst took its time along.
            burst.driver_cpu = driver_after.saturating_sub(driver_before).as_secs_f64() * 1000.0;
            burst.bench_cpu = bench_after.saturating_sub(bench_before).as_secs_f64() * 1000.0;
            burst.driver_switches = switches_after.saturating_sub(switches_before) as f64;
        }
        Ok(bursts)
    }

    /// kubelet's `/metrics` (its HTTPS port: anonymous, always allowed).
    fn kubelet_metrics(&self) -> Result<String> {
        real_k8s::proc::run(Command::new("curl").args([
            "-sSfk",
            "--max-time",
            "10",
            &format!("https://127.0.0.1:{}/metrics", self.node.kubelet_port),
        ]))
    }
}

/// Puts what a node keeps under `/run` on a tmpfs, as a node does: the CDI
/// specs (`/var/run/cdi`) and sandbox-dra-driver's state file, owner lock and
/// metadata files (the chart mounts them from `/run`). On the scratch disk
/// each of their atomic writes would wait for the disk's fsync, which no
/// node pays there. Before the node starts, so that its namespace has them.
fn run_on_tmpfs(node_dir: &std::path::Path) -> Result<()> {
    use nix::mount::{mount, MsFlags};
    for dir in [Node::cdi_dir_in(node_dir), drivers::dra_dir_in(node_dir)] {
        std::fs::create_dir_all(&dir)?;
        mount(
            Some("tmpfs"),
            &dir,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("mode=755"),
        )
        .with_context(|| format!("mounting a tmpfs on {}", dir.display()))?;
    }
    Ok(())
}

/// The ResourceClaims of namespace `ns` (a claim's path: this, `/`, its name).
fn claims_path(ns: &str) -> String {
    format!("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims")
}

/// The ResourceSlices of `driver` (a field selector on `spec.driver`).
fn slices_path(driver: &str) -> String {
    format!("/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.driver%3D{driver}")
}

/// How long ago the harness started `process`, in ms: from a restarted
/// driver's start, not from the `kill -9` (the harness makes a token for
/// sandbox-dra-driver between the two).
fn since_start(process: &Proc) -> f64 {
    process.started.elapsed().as_secs_f64() * 1000.0
}

/// The figures after the pods and prepares: RSS, and CPU time since idle.
fn after(row: &mut Row, idle: &Idle) -> Result<()> {
    row.add("after_rss_mib", rss_kib(idle.pid)? as f64 / 1024.0);
    let work = cpu_time(idle.pid)?.saturating_sub(idle.cpu);
    row.add("work_cpu_ms", work.as_secs_f64() * 1000.0);
    if let (Some(before), Some(now)) = (idle.worker, thread_run_time(idle.pid, WORKER_THREAD)?) {
        row.add(
            "work_cpu_claims_thread_ms",
            (now - before).as_secs_f64() * 1000.0,
        );
    }
    Ok(())
}

/// Whether a file name holds a uid (8-4-4-4-12 hex digits) somewhere.
fn looks_like_uid(name: &str) -> bool {
    let shape = [8, 4, 4, 4, 12];
    let hex_run = |s: &str| s.chars().all(|c| c.is_ascii_hexdigit());
    let parts: Vec<&str> = name.split(['-', '.', '_']).collect();
    parts.windows(shape.len()).any(|w| {
        w.iter()
            .zip(shape)
            .all(|(p, len)| p.len() == len && hex_run(p))
    })
}

/// The most pods made at once.
fn largest_batch(cli: &Cli) -> usize {
    cli.together.iter().copied().max().unwrap_or(1)
}

/// A pod on the host's network (the node has no CNI) that stops at once on
/// SIGTERM, with `container` merged into its container and `spec` into its spec.
fn pod(name: &str, container: Value, spec: Value) -> Value {
    let mut c = json!({
        "name": "c", "image": BUSYBOX, "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 1000000 & wait"],
    });
    merge(&mut c, container);
    let mut s = json!({
        "hostNetwork": true,
        "terminationGracePeriodSeconds": 1,
        "containers": [c],
    });
    merge(&mut s, spec);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": s,
    })
}

fn merge(into: &mut Value, from: Value) {
    if let (Some(into), Value::Object(from)) = (into.as_object_mut(), from) {
        into.extend(from);
    }
}

/// A pod with its own claim from `template`.
fn claim_pod(name: &str, template: &str) -> Value {
    pod(
        name,
        json!({"resources": {"claims": [{"name": "dev"}]}}),
        json!({"resourceClaims": [{"name": "dev", "resourceClaimTemplateName": template}]}),
    )
}

/// A pod asking for one device of the device plugin's resource.
fn limit_pod(name: &str) -> Value {
    pod(name, json!({"resources": {"limits": {CA22: 1}}}), json!({}))
}

/// kubelet's histograms whose means each pod phase takes (name in the row,
/// metric, label): its DRA step (`pkg/kubelet/cm/dra/manager.go`,
/// `DRAOperationsDuration`) and its call to the driver
/// (`pkg/kubelet/cm/dra/plugin/dra_plugin.go`, `DRAGRPCOperationsDuration`),
/// and the runtime's sandbox and container starts as kubelet waits for them
/// (`pkg/kubelet/metrics/metrics.go`, `runtime_operations_duration_seconds` by
/// `operation_type`, taken by `pkg/kubelet/kuberuntime/instrumented_services.go`).
const KUBELET_MEANS: [(&str, &str, &str); 5] = [
    (
        "dra_operations",
        "dra_operations_duration_seconds",
        "operation_name=\"PrepareResources\"",
    ),
    (
        "dra_grpc_operations",
        "dra_grpc_operations_duration_seconds",
        "method_name=\"/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources\"",
    ),
    (
        "run_podsandbox",
        "kubelet_runtime_operations_duration_seconds",
        "operation_type=\"run_podsandbox\"",
    ),
    (
        "create_container",
        "kubelet_runtime_operations_duration_seconds",
        "operation_type=\"create_container\"",
    ),
    (
        "start_container",
        "kubelet_runtime_operations_duration_seconds",
        "operation_type=\"start_container\"",
    ),
];

/// The mean, in ms, of the histogram `metric`'s observations with `label`
/// (and `is_error="false"` where it has that label) between two scrapes.
fn mean_ms(before: &str, after: &str, metric: &str, label: &str) -> f64 {
    let total = |text: &str, suffix: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(&format!("{metric}{suffix}{{")))
            .filter(|l| l.contains(label) && !l.contains("is_error=\"true\""))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    };
    let count = total(after, "_count") - total(before, "_count");
    if count == 0.0 {
        return f64::NAN;
    }
    (total(after, "_sum") - total(before, "_sum")) / count * 1000.0
}

fn print_row(run: usize, row: &Row) {
    let fields: Vec<String> = row
        .figures
        .iter()
        .map(|(name, value)| format!("{name}={value:.1}"))
        .collect();
    println!(
        "run={run} subject={} {}",
        row.subject.name(),
        fields.join(" ")
    );
}

/// The median of `subject`'s figure `name` over the runs.
fn median_of(rows: &[Row], subject: Subject, name: &str) -> f64 {
    let mut values: Vec<f64> = rows
        .iter()
        .filter(|r| r.subject == subject)
        .filter_map(|r| r.figures.iter().find(|(n, _)| n == name).map(|f| f.1))
        .collect();
    median(&mut values)
}

/// The medians: the two libraries with the ratio Rust/Go; then, if measured,
/// the passthrough drivers beside the null driver on lib/kubelet-plugin.
fn print_tables(rows: &[Row]) {
    let runs = rows.iter().map(|r| r.subject).fold(0, |most, s| {
        most.max(rows.iter().filter(|r| r.subject == s).count())
    });
    let names_of = |subject: Subject| -> Vec<String> {
        let row = rows.iter().find(|r| r.subject == subject);
        row.map(|r| r.figures.iter().map(|(n, _)| n.clone()).collect())
            .unwrap_or_default()
    };
    println!("medians of {runs} runs, the two libraries:");
    println!(
        "{:<58} {:>10} {:>10} {:>8}",
        "figure", "rust", "go", "rust/go"
    );
    for name in names_of(Subject::Rust) {
        let (rust, go) = (
            median_of(rows, Subject::Rust, &name),
            median_of(rows, Subject::Go, &name),
        );
        println!("{name:<58} {rust:>10.1} {go:>10.1} {:>8.2}", rust / go);
    }
    let mut names = names_of(Subject::Sandbox);
    for n in names_of(Subject::Plugin) {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    if names.is_empty() {
        return;
    }
    println!("medians of {runs} runs, passthrough beside the null driver (rust):");
    println!(
        "{:<58} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "figure", "null", "dra", "plugin", "dra/null", "plugin/null"
    );
    for name in names {
        let [null, dra, plugin] =
            [Subject::Rust, Subject::Sandbox, Subject::Plugin].map(|s| median_of(rows, s, &name));
        println!(
            "{name:<58} {null:>10.1} {dra:>10.1} {plugin:>10.1} {:>8.2} {:>8.2}",
            dra / null,
            plugin / null
        );
    }
}

/// The machine's load averages.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
