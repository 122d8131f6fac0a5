//! `sandbox-device-plugin`: serves kubelet's device-plugin API (v1beta1) for every
//! resource of the resource list, advertising the VFIO-bound devices so KubeVirt VMs
//! can request them.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use node_agent::cli::{fail, parse_duration, CommonArgs, EXIT_NOT_READY, EXIT_USAGE};
use node_agent::metrics::{self as endpoint, ListenAddress};
use passthrough::config::ResourceName;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{mpsc, watch};

mod allocate;
mod devices;
mod kubelet;
mod metrics;
mod service;
mod watchers;

use kubelet::{Command, Settings};

const PROGRAM: &str = "sandbox-device-plugin";

const LONG_ABOUT: &str = "\
Serves kubelet's device-plugin API (v1beta1) for every resource of the resource list: one
gRPC server per resource on its own socket in the kubelet directory, registered with
kubelet after it starts serving. Each VFIO-bound device is advertised with its BDF as ID
and its NUMA node; health follows the node within a second (kernel uevents, inotify on
/dev/vfio, and a periodic resync). Allocate returns KubeVirt's PCI_RESOURCE_<NAME> env var
and the /dev/vfio nodes. A kubelet restart is noticed and answered by serving on a new
socket and registering again. With --metrics-address, Prometheus metrics are served at
http://ADDR/metrics. SIGTERM, SIGINT and SIGHUP stop serving and remove the
sockets.

Exit codes: 0 stopped by a signal, 1 the node could not be read, 2 bad usage or config.";

/// Command line.
#[derive(Debug, Parser)]
#[command(name = "sandbox-device-plugin", version, about = "kubelet device plugin for \
    VFIO-bound PCI devices", long_about = LONG_ABOUT)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    /// kubelet's device-plugin directory (holds kubelet.sock and our sockets).
    #[arg(long, env = "VFIO_SANDBOX_KUBELET_DIR", default_value = kubelet_api::DEFAULT_KUBELET_DIR, value_name = "DIR")]
    kubelet_dir: PathBuf,
    /// Full rescan period beneath the event-driven health updates (90s, 5m, 500ms,
    /// seconds). Default: 30s when kernel uevents reach us (host network namespace),
    /// else 1s so health still follows the node within a second.
    #[arg(long, env = "VFIO_SANDBOX_RESYNC_INTERVAL", value_parser = parse_duration)]
    resync_interval: Option<Duration>,
    /// The node-wide owner lock of vfio-manager and sandbox-dra-driver, read (never
    /// taken): while another program than vfio-manager owns the node's devices,
    /// every device is Unhealthy. Watched, so that turns within a second.
    #[arg(long, env = "VFIO_SANDBOX_OWNER_LOCK", default_value = passthrough::owner::DEFAULT_OWNER_LOCK, value_name = "FILE")]
    owner_lock: PathBuf,
    /// Also hand out /dev/iommu and /dev/vfio/devices/vfioN (iommufd) in Allocate.
    #[arg(long, env = "VFIO_SANDBOX_IOMMUFD")]
    iommufd: bool,
    /// Serve Prometheus metrics (OpenMetrics text) at http://ADDR/metrics: devices
    /// per resource and health, registrations, Allocate calls and latency,
    /// ListAndWatch updates. ADDR is IP:PORT (0.0.0.0:9403, [::]:9403,
    /// 127.0.0.1:9403) or :PORT for every address. Default: off, no port opened.
    #[arg(long, env = "VFIO_SANDBOX_METRICS_ADDRESS", value_name = "ADDR", value_parser = endpoint::parse_address)]
    metrics_address: Option<ListenAddress>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli.common.init_logging();
    let list = match cli.common.resource_list() {
        Ok(l) => l,
        Err(e) => return fail(PROGRAM, &e, EXIT_USAGE),
    };
    // The node read once before anything is made: the first snapshot's resources
    // name the sockets, whose paths must fit in a Unix socket address.
    let host = cli.common.host();
    let mut tracker = devices::Tracker::new(cli.iommufd);
    tracker.set_not_ours(devices::owner_problem(&cli.owner_lock));
    let first = match tracker.rescan(&host, &list) {
        Ok(f) => f,
        Err(e) => return fail(PROGRAM, &e, EXIT_NOT_READY),
    };
    if let Err(e) = kubelet::check_socket_paths(&cli.kubelet_dir, first.keys()) {
        let e = anyhow::anyhow!("{e} (--kubelet-dir {})", cli.kubelet_dir.display());
        return fail(PROGRAM, e.as_ref(), EXIT_USAGE);
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return fail(PROGRAM, &e, EXIT_NOT_READY),
    };
    match runtime.block_on(run(cli, list, tracker, first)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(PROGRAM, e.as_ref(), EXIT_NOT_READY),
    }
}

async fn run(
    cli: Cli,
    list: passthrough::config::ResourceList,
    tracker: devices::Tracker,
    first: devices::Snapshot,
) -> anyhow::Result<()> {
    let host = cli.common.host();
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    // A DaemonSet has no terminal to hang up; SIGHUP (whose default action kills
    // us and leaves the sockets behind) is a clean stop like SIGTERM.
    let mut sighup = signal(SignalKind::hangup())?;
    if first.is_empty() {
        tracing::warn!("no selected device is bound to its vfio driver yet; waiting");
    }
    let mut registry = endpoint::registry();
    let metrics = Arc::new(metrics::Metrics::new(&mut registry));
    if let Some(address) = &cli.metrics_address {
        let listener = endpoint::bind(address).await?;
        tracing::info!(address = %listener.local_addr()?, "serving metrics at /metrics");
        tokio::spawn(endpoint::serve(listener, Arc::new(registry)));
    }
    let (publish, mut snapshot) = watch::channel(Arc::new(first));
    let settings = Settings {
        dir: cli.kubelet_dir.clone(),
        snapshot: snapshot.clone(),
        iommufd: cli.iommufd,
        sockets: Default::default(),
        metrics: metrics.clone(),
    };
    tokio::spawn(watchers::watch_node(
        host,
        list,
        tracker,
        publish,
        cli.resync_interval,
        cli.owner_lock.clone(),
    ));
    let (restart_tx, mut restart) = mpsc::unbounded_channel();
    tokio::spawn(watchers::watch_kubelet_dir(
        cli.kubelet_dir,
        settings.sockets.clone(),
        restart_tx,
    ));

    let mut tasks: BTreeMap<
        ResourceName,
        (mpsc::UnboundedSender<Command>, tokio::task::JoinHandle<()>),
    > = BTreeMap::new();
    loop {
        // A resource whose first device got bound later gets its server now.
        let resources: Vec<ResourceName> = {
            let current = snapshot.borrow_and_update();
            metrics.set_devices(&current);
            current.keys().cloned().collect()
        };
        for r in resources {
            tasks.entry(r.clone()).or_insert_with(|| {
                let (tx, rx) = mpsc::unbounded_channel();
                (
                    tx,
                    tokio::spawn(kubelet::serve_resource(r, settings.clone(), rx)),
                )
            });
        }
        tokio::select! {
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
            _ = sighup.recv() => break,
            changed = snapshot.changed() => if changed.is_err() { anyhow::bail!(
                "the node watcher stopped") },
            Some(target) = restart.recv() => {
                for (r, (tx, _)) in &tasks {
                    if target.as_ref().is_none_or(|t| t == r) {
                        let _ = tx.send(Command::Restart);
                    }
                }
            }
        }
    }
    tracing::info!("stopping: removing our sockets");
    for (tx, _) in tasks.values() {
        let _ = tx.send(Command::Stop);
    }
    for (_, (_, handle)) in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), handle).await;
    }
    Ok(())
}
