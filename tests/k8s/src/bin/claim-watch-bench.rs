//! `claim-watch-bench`: what the real kube-apiserver sends per ResourceClaim
//! change when N nodes watch claims, with every node watching every claim
//! (`sandbox-dra-driver --claim-watch=all`) and with the claim labeller
//! (`sandbox-dra-controller`) running and each node watching only its
//! label (`--claim-watch=labelled`).
//!
//! It starts the control plane the real-k8s scenarios start ([`real_k8s::control`]),
//! and for each node count, run and watch simulates N nodes as N watch clients
//! (one connection each, as N driver pods have), the labelled ones with the
//! selector `<driver>/node=node-<i>`. Then, one claim at a time, it makes the
//! changes a VM's claim goes through: created, allocated to one node's device
//! with the driver's binding condition (a status write, as the scheduler's),
//! deallocated, deleted. It measures:
//!
//! - the watch events and bytes the API server sent for ResourceClaims
//!   (its own `apiserver_watch_events_total` and `apiserver_watch_events_sizes`,
//!   every watcher counted: the nodes, the labeller, the scheduler, the
//!   controller manager), per claim change;
//! - the events and bytes the simulated nodes received, per claim change;
//! - kube-apiserver's CPU time (user and system, `/proc/<pid>/stat`) per change;
//! - the latency from the allocation's write to the node of the device seeing
//!   the allocated claim in its watch (with the labeller: once it is labelled).
//!
//! The labeller's own label patches are changes it makes, not changes counted:
//! their events are in the figures per change. Prints one line per run and a
//! table of medians; asserts nothing.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use real_k8s::api::{client, create, delete, get, median, merge_patch, open_watch};
use real_k8s::control::{ControlPlane, Gates, Release};
use real_k8s::proc::Proc;
use serde::Deserialize;
use serde_json::{json, Value};

/// The driver whose claims are made and labelled.
const DRIVER: &str = "vfio-sandbox.rebellions.ai";
/// The labeller's Lease (its default name).
const LEASE: &str = "sandbox-dra-controller";
/// How long a node may take to see a claim before the run fails.
const SEE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Parser, Debug)]
#[command(
    name = "claim-watch-bench",
    about = "Watch events and bytes the real API server sends per ResourceClaim change \
        to N simulated nodes, without and with the claim labeller"
)]
struct Cli {
    /// The release's binaries (scripts/build-k8s.sh prints the directory).
    #[arg(long, value_name = "DIR")]
    k8s_bins: PathBuf,
    /// The release, v1.<minor>[.<patch>].
    #[arg(long)]
    release: String,
    /// `features`: the DRA gates on where the release has them off (1.34, 1.35:
    /// binding conditions, which the labeller keys on); `defaults`.
    #[arg(long, default_value = "features", value_parser = ["features", "defaults"])]
    gates: String,
    /// `sandbox-dra-controller`, the claim labeller.
    #[arg(long, value_name = "FILE")]
    labeller: PathBuf,
    /// Node counts to simulate.
    #[arg(long, value_delimiter = ',', default_value = "10,1000")]
    nodes: Vec<usize>,
    /// Runs per node count and watch.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Claims per run (each makes four changes).
    #[arg(long, default_value_t = 25)]
    claims: usize,
    /// Scratch directory (default: a new one under the temp dir, removed after).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

/// How the simulated nodes watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watch {
    /// Every claim, as `--claim-watch=all`.
    All,
    /// Only their label, with the labeller running.
    Labelled,
}

impl Watch {
    fn name(self) -> &'static str {
        match self {
            Self::All => "all",
            Self::Labelled => "labelled",
        }
    }
}

/// One run's figures.
#[derive(Debug, Clone)]
struct Row {
    watch: Watch,
    nodes: usize,
    changes: usize,
    server_events: f64,
    server_bytes: f64,
    node_events: f64,
    node_bytes: f64,
    cpu_ms: f64,
    latency_ms: Vec<f64>,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(&cli) {
        eprintln!("claim-watch-bench: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: &Cli) -> Result<()> {
    raise_open_files()?;
    let release = Release::parse(&cli.release)?;
    let gates = if cli.gates == "features" {
        Gates::Features
    } else {
        Gates::Defaults
    };
    let dir = match &cli.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("claim-watch-bench-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir)?;
    let plane = ControlPlane::start(
        &cli.k8s_bins,
        &dir.join("cluster"),
        release,
        gates,
        "node-a",
    )
    .context("starting the control plane")?;
    println!(
        "claim-watch-bench: kube-apiserver {} ({}), {} claims per run (4 changes each), load {}",
        cli.release,
        cli.gates,
        cli.claims,
        load()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut rows = Vec::new();
    for &nodes in &cli.nodes {
        for run in 0..cli.runs {
            // Alternate the order, so neither watch always runs on a warmer server.
            let order = if run % 2 == 0 {
                [Watch::All, Watch::Labelled]
            } else {
                [Watch::Labelled, Watch::All]
            };
            for watch in order {
                let row = runtime.block_on(bench(&plane, cli, watch, nodes, run))?;
                print_row(&row);
                rows.push(row);
            }
        }
    }
    print_table(&rows, &cli.nodes);
    println!("load at the end: {}", load());
    drop(plane);
    if cli.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

/// 1000 watch connections need more than the usual 1024 descriptors, here and
/// in kube-apiserver (which inherits the limit and raises it to the hard one).
fn raise_open_files() -> Result<()> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    Ok(())
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// What the simulated nodes saw, shared by their tasks.
#[derive(Default)]
struct Seen {
    events: AtomicU64,
    bytes: AtomicU64,
    /// Claim uid → the node of its device and when it first saw it allocated.
    allocated: Mutex<HashMap<String, (String, Instant)>>,
    /// Claim uid → when that node saw it no longer allocated (or gone).
    released: Mutex<HashMap<String, Instant>>,
}

/// The parts of a watch event the bench reads.
#[derive(Deserialize)]
struct WatchEvent {
    #[serde(rename = "type")]
    kind: String,
    object: EventObject,
}

#[derive(Deserialize)]
struct EventObject {
    metadata: Meta,
    #[serde(default)]
    status: Option<ClaimStatus>,
}

#[derive(Deserialize)]
struct Meta {
    #[serde(default)]
    uid: String,
}

#[derive(Deserialize)]
struct ClaimStatus {
    #[serde(default)]
    allocation: Option<Allocation>,
}

#[derive(Deserialize)]
struct Allocation {
    devices: AllocatedDevices,
}

#[derive(Deserialize)]
struct AllocatedDevices {
    #[serde(default)]
    results: Vec<AllocationResult>,
}

#[derive(Deserialize)]
struct AllocationResult {
    pool: String,
}

async fn bench(
    plane: &ControlPlane,
    cli: &Cli,
    watch: Watch,
    nodes: usize,
    run: usize,
) -> Result<Row> {
    let admin = client(&plane.admin).await?;
    let ns = format!("bench-{}-{nodes}-{run}", watch.name());
    create(
        &admin,
        "/api/v1/namespaces",
        &json!({"metadata": {"name": ns}}),
    )
    .await?;
    let _labeller = match watch {
        Watch::Labelled => Some(start_labeller(plane, cli, &admin, &ns).await?),
        Watch::All => None,
    };
    let list: Value = get(&admin, "/apis/resource.k8s.io/v1/resourceclaims?limit=1").await?;
    let version = list["metadata"]["resourceVersion"]
        .as_str()
        .context("the claim list has no resourceVersion")?
        .to_owned();
    let seen = Arc::new(Seen::default());
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel::<Result<()>>(nodes);
    let mut watchers = Vec::new();
    for i in 0..nodes {
        let node = format!("node-{i}");
        let mut path = format!(
            "/apis/resource.k8s.io/v1/resourceclaims?watch=true&resourceVersion={version}&timeoutSeconds=3600"
        );
        if watch == Watch::Labelled {
            path.push_str(&format!("&labelSelector={DRIVER}%2Fnode%3D{node}"));
        }
        let client = client(&plane.admin).await?;
        let (seen, ready) = (seen.clone(), ready_tx.clone());
        watchers.push(tokio::spawn(async move {
            match open_watch(&client, &path).await {
                Ok(body) => {
                    let _ = ready.send(Ok(())).await;
                    follow(body, &node, &seen).await;
                }
                Err(e) => {
                    let _ = ready.send(Err(e)).await;
                }
            }
        }));
    }
    for _ in 0..nodes {
        ready_rx
            .recv()
            .await
            .context("a watcher ended before connecting")?
            .context("opening a watch")?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = (
        server_watch_figures(&admin).await?,
        apiserver_cpu(plane)?,
        seen.events.load(Ordering::Relaxed),
        seen.bytes.load(Ordering::Relaxed),
    );
    let mut latency_ms = Vec::new();
    for c in 0..cli.claims {
        let node = format!("node-{}", (c * 37) % nodes);
        latency_ms.push(claim_life(&admin, &ns, &format!("vm-{c}"), &node, &seen).await?);
    }
    // The labeller's last patch, and its events, are on their way.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = (
        server_watch_figures(&admin).await?,
        apiserver_cpu(plane)?,
        seen.events.load(Ordering::Relaxed),
        seen.bytes.load(Ordering::Relaxed),
    );
    for w in &watchers {
        w.abort();
    }
    let _ = delete(&admin, &format!("/api/v1/namespaces/{ns}")).await;
    let changes = cli.claims * 4;
    let per = |x: f64| x / changes as f64;
    Ok(Row {
        watch,
        nodes,
        changes,
        server_events: per(after.0 .0 - before.0 .0),
        server_bytes: per(after.0 .1 - before.0 .1),
        node_events: per((after.2 - before.2) as f64),
        node_bytes: per((after.3 - before.3) as f64),
        cpu_ms: per((after.1 - before.1).as_secs_f64() * 1000.0),
        latency_ms,
    })
}

/// One simulated node: reads its watch, counting every event and byte of the
/// body, and notes when a claim allocated to its own pool shows up and when it
/// goes.
async fn follow(mut body: kube::client::Body, node: &str, seen: &Seen) {
    use http_body_util::BodyExt;
    let mut buffer: Vec<u8> = Vec::new();
    while let Some(Ok(frame)) = body.frame().await {
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let now = Instant::now();
        seen.bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
        buffer.extend_from_slice(&data);
        while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=end).collect();
            seen.events.fetch_add(1, Ordering::Relaxed);
            note(&line, node, seen, now);
        }
    }
}

/// Notes what one watch event says about the node's own claims.
fn note(line: &[u8], node: &str, seen: &Seen, now: Instant) {
    let Ok(event) = serde_json::from_slice::<WatchEvent>(line) else {
        return;
    };
    let uid = event.object.metadata.uid;
    let mine = event
        .object
        .status
        .and_then(|s| s.allocation)
        .is_some_and(|a| a.devices.results.iter().any(|r| r.pool == node));
    if event.kind != "DELETED" && mine {
        support::lock(&seen.allocated)
            .entry(uid)
            .or_insert_with(|| (node.to_owned(), now));
    } else if support::lock(&seen.allocated)
        .get(&uid)
        .is_some_and(|(n, _)| n == node)
    {
        support::lock(&seen.released).entry(uid).or_insert(now);
    }
}

/// A claim's life: created, allocated to `node` (timed until that node sees
/// it), deallocated (until that node sees it go), deleted. Gives the latency in
/// milliseconds.
async fn claim_life(
    admin: &kube::Client,
    ns: &str,
    name: &str,
    node: &str,
    seen: &Seen,
) -> Result<f64> {
    let claims = format!("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims");
    let claim = json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"devices": {"requests": [
            {"name": "npu", "exactly": {"deviceClassName": "rebellions-atom-ca22-pt"}}
        ]}},
    });
    let made = create(admin, &claims, &claim).await?;
    let uid = made["metadata"]["uid"]
        .as_str()
        .context("no uid")?
        .to_owned();
    let allocation = json!({"status": {"allocation": {
        "devices": {"results": [{
            "request": "npu", "driver": DRIVER, "pool": node, "device": "pci-0000-41-00-0",
            "bindingConditions": [format!("{DRIVER}/VfioReady")],
            "bindingFailureConditions": [format!("{DRIVER}/VfioFailed")],
        }]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}
        ]}]},
    }}});
    let status = format!("{claims}/{name}/status");
    let written = Instant::now();
    let patched = merge_patch(admin, &status, &allocation).await?;
    if patched["status"]["allocation"]["devices"]["results"][0]["bindingConditions"].is_null() {
        bail!(
            "the API server dropped bindingConditions (its \
                DRADeviceBindingConditions gate is off): run with --gates features"
        );
    }
    let at = wait_seen(&seen.allocated, &uid, "allocated", node, |(_, at)| *at).await?;
    merge_patch(admin, &status, &json!({"status": {"allocation": null}})).await?;
    wait_seen(&seen.released, &uid, "deallocated", node, |at| *at).await?;
    delete(admin, &format!("{claims}/{name}")).await?;
    Ok(at.duration_since(written).as_secs_f64() * 1000.0)
}

async fn wait_seen<T>(
    map: &Mutex<HashMap<String, T>>,
    uid: &str,
    what: &str,
    node: &str,
    when: impl Fn(&T) -> Instant,
) -> Result<Instant> {
    let start = Instant::now();
    loop {
        if let Some(at) = support::lock(map).get(uid) {
            return Ok(when(at));
        }
        if start.elapsed() > SEE_TIMEOUT {
            bail!("{node} did not see claim {uid} {what} within {SEE_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Starts `sandbox-dra-controller` as the admin (the shipped RBAC is the
/// real-k8s scenarios' business) and waits until it holds its Lease.
async fn start_labeller(
    plane: &ControlPlane,
    cli: &Cli,
    admin: &kube::Client,
    ns: &str,
) -> Result<Proc> {
    let mut cmd = Command::new(&cli.labeller);
    cmd.env("KUBECONFIG", &plane.admin)
        .env("POD_NAMESPACE", ns)
        .env("POD_NAME", "labeller-0")
        .env("VFIO_SANDBOX_LOG_LEVEL", "info")
        .arg("--metrics-address=127.0.0.1:0");
    let labeller = Proc::spawn(&format!("labeller-{ns}"), cmd, &plane.logs_dir())?;
    let lease = format!("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{LEASE}");
    let start = Instant::now();
    loop {
        if let Ok(l) = get(admin, &lease).await {
            if l["spec"]["holderIdentity"].as_str() == Some("labeller-0") {
                return Ok(labeller);
            }
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!(
                "the labeller did not take its Lease within 30 s:\n{}",
                labeller.tail(20)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The API server's own count of watch events and bytes it sent for
/// ResourceClaims, all watchers together.
async fn server_watch_figures(admin: &kube::Client) -> Result<(f64, f64)> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = admin.request_text(request).await?;
    let sum = |prefix: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(prefix) && l.contains("resource=\"resourceclaims\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    Ok((
        sum("apiserver_watch_events_total{"),
        sum("apiserver_watch_events_sizes_sum{"),
    ))
}

/// kube-apiserver's user and system CPU time so far.
fn apiserver_cpu(plane: &ControlPlane) -> Result<Duration> {
    real_k8s::proc::cpu_time(plane.apiserver_pid())
}

fn print_row(r: &Row) {
    let mut lat = r.latency_ms.clone();
    let max = lat.iter().copied().fold(0.0, f64::max);
    println!(
        "run: watch={} nodes={} changes={} server_events/change={:.1} \
            server_bytes/change={:.0} node_events/change={:.1} node_bytes/change={:.0} \
            apiserver_cpu_ms/change={:.2} latency_ms median={:.1} max={:.1}",
        r.watch.name(),
        r.nodes,
        r.changes,
        r.server_events,
        r.server_bytes,
        r.node_events,
        r.node_bytes,
        r.cpu_ms,
        median(&mut lat),
        max
    );
}

fn print_table(rows: &[Row], nodes: &[usize]) {
    println!();
    println!("medians of the runs, per claim change (create, allocate, deallocate, delete):");
    println!(
        "{:>6} {:>9} {:>14} {:>14} {:>12} {:>12} {:>11} {:>15}",
        "nodes",
        "watch",
        "server events",
        "server bytes",
        "node events",
        "node bytes",
        "cpu ms",
        "latency ms p50"
    );
    for &n in nodes {
        for watch in [Watch::All, Watch::Labelled] {
            let of: Vec<&Row> = rows
                .iter()
                .filter(|r| r.nodes == n && r.watch == watch)
                .collect();
            if of.is_empty() {
                continue;
            }
            let pick =
                |f: fn(&Row) -> f64| median(&mut of.iter().map(|r| f(r)).collect::<Vec<_>>());
            let mut lat: Vec<f64> = of
                .iter()
                .flat_map(|r| r.latency_ms.iter().copied())
                .collect();
            println!(
                "{:>6} {:>9} {:>14.1} {:>14.0} {:>12.1} {:>12.0} {:>11.2} {:>15.1}",
                n,
                watch.name(),
                pick(|r| r.server_events),
                pick(|r| r.server_bytes),
                pick(|r| r.node_events),
                pick(|r| r.node_bytes),
                pick(|r| r.cpu_ms),
                median(&mut lat)
            );
        }
    }
}
