//! `sandbox-dra-driver`: VFIO passthrough per ResourceClaim through Dynamic Resource
//! Allocation. Publishes the node's selected PCI functions as a ResourceSlice, moves
//! a claim's devices — whole IOMMU groups — to vfio-pci when kubelet prepares it, and
//! gives them back when kubelet unprepares it, with the engine vfio-manager uses.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use claim_label::lease::LEASE_NAME;
use clap::{Parser, Subcommand};
use kubelet_plugin::{Clients, Plugin, KUBELET_CALL_TIMEOUT};
use node_agent::cli::{
    fail, fail_usage, parse_duration, CommonArgs, WriteArgs, EXIT_NOT_READY, EXIT_USAGE,
};
use node_agent::cluster::{Cluster, Identity, Verdict};
use node_agent::metrics::{self as endpoint, ListenAddress};
use passthrough::owner::DEFAULT_OWNER_LOCK;
use passthrough::Passthrough;
use sandbox_dra_driver::cdi::{DriverName, DEFAULT_CDI_DIR, DEFAULT_METADATA_DIR};
use sandbox_dra_driver::programs::{DRA_DRIVER, STATE_FILE, VFIO_MANAGER_STATE_FILE};
use sandbox_dra_driver::{
    owner, prepared_claims, ClaimWatch, Claims, Files, HealthBoard, LeaseRef, Metrics, Mode,
    OriginalDrivers, StateFile, VfioDriver, Worker, DEFAULT_DRIVER_NAME,
};
use support::error_chain;
use sysfs_pci::host::DEFAULT_MODULES_ROOT;
use sysfs_pci::module;
use tokio::signal::unix::{signal, SignalKind};

const PROGRAM: &str = "sandbox-dra-driver";

const DEFAULT_READY_FILE: &str = "/run/sandbox-dra-driver/ready";

const LONG_ABOUT: &str = "\
A Dynamic Resource Allocation (DRA) driver for VFIO passthrough, one claim at a time.

It publishes one ResourceSlice for this node (pool = node name) with one device per PCI
function the resource list selects (companions are not offered: they travel with their
IOMMU group), registers with kubelet's plugin watcher (<registry-dir>/<driver>-reg.sock)
and serves the DRA kubelet API v1 and v1beta1 on <plugins-dir>/<driver>/dra.sock.

NodePrepareResources reads each ResourceClaim from the API server, moves every IOMMU
group of its devices to vfio-pci (each member recorded in the state file before it is
touched; a failed group is put back), and writes a CDI spec and the device metadata file
KubeVirt reads. With binding conditions (--binding-conditions) the move happens earlier:
the driver watches ResourceClaims, moves a claim's groups as soon as the scheduler
allocates it, and sets <driver>/VfioReady (or <driver>/VfioFailed) in the claim's
status.devices; the scheduler binds the pod only then, and prepare only writes files.
A claim moved early that loses its allocation gets its devices back. NodeUnprepareResources gives every device back to the driver it had, and
refuses while a VM holds /dev/vfio/<group> (kubelet retries). After a crash the next start
rolls a half-prepared claim back and finishes a half-unprepared one.

Which claims it watches for the early move is --claim-watch: only those the claim
labeller (`sandbox-dra-controller`, one Deployment per cluster) labels
<driver>/node=<node>, so a claim change reaches one node instead of every node; by
default (auto) those while a labeller holds its Lease (--labeller-lease, in
POD_NAMESPACE), every claim while none does.

A node runs either vfio-manager or this driver: before it moves any device it takes the
node-wide owner lock (--owner-lock), shared with vfio-manager, and holds it for its life.
While vfio-manager holds it, or still holds devices it moved, the driver recovers
nothing and publishes no ResourceSlice, refuses every claim with an error naming the
owner, and tries again every --owner-retry-interval. SIGTERM/SIGINT stop serving;
devices of prepared claims stay with their VMs. If the DaemonSet no longer selects this node (an uninstall), the
ResourceSlice is deleted too.

While kubelet has accepted its registration and this node's ResourceSlices are
published, it keeps a ready file (--ready-file); `sandbox-dra-driver ready` is its
readiness probe. A failed prepare is posted as a Warning Event on its ResourceClaim.
With --metrics-address, Prometheus metrics are served at http://ADDR/metrics.

It needs Kubernetes 1.34 or newer (the resource.k8s.io/v1 API; it exits saying so
otherwise) and kubelet 1.32 or newer (DRA kubelet API v1beta1; v1 from 1.34).

Exit codes: 0 stopped by a signal (ready: ready), 1 the node or the API server could
not be used (ready: not ready), 2 bad usage or config (nothing touched).";

#[derive(Debug, Parser)]
#[command(name = PROGRAM, version, about = "DRA driver: VFIO passthrough of whole \
    IOMMU groups per ResourceClaim", long_about = LONG_ABOUT)]
#[command(subcommand_negates_reqs = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    write: WriteArgs,
    /// This node's name (downward API spec.nodeName): the pool and the slice's node.
    #[arg(long, env = "NODE_NAME", value_name = "NAME", required = true)]
    node_name: Option<String>,
    /// This pod's name (downward API), to find its DaemonSet at stop.
    #[arg(long, env = "POD_NAME", value_name = "NAME")]
    pod_name: Option<String>,
    /// This pod's namespace (downward API).
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE")]
    pod_namespace: Option<String>,
    /// The DRA driver name in ResourceSlices, DeviceClasses, CDI and the claims'
    /// binding conditions and labels: a lowercase DNS subdomain of at most 63
    /// characters that starts with a letter.
    #[arg(long, env = "VFIO_SANDBOX_DRIVER_NAME", default_value = DEFAULT_DRIVER_NAME, value_name = "NAME")]
    driver_name: String,
    /// kubelet's plugin registration directory (the watcher finds <driver>-reg.sock here).
    #[arg(
        long,
        env = "VFIO_SANDBOX_REGISTRY_DIR",
        default_value = "/var/lib/kubelet/plugins_registry",
        value_name = "DIR"
    )]
    registry_dir: PathBuf,
    /// kubelet's plugins directory (the service socket is <dir>/<driver>/dra.sock).
    #[arg(
        long,
        env = "VFIO_SANDBOX_PLUGINS_DIR",
        default_value = "/var/lib/kubelet/plugins",
        value_name = "DIR"
    )]
    plugins_dir: PathBuf,
    /// Where CDI spec files go (one per prepared claim).
    #[arg(long, env = "VFIO_SANDBOX_CDI_DIR", default_value = DEFAULT_CDI_DIR, value_name = "DIR")]
    cdi_dir: PathBuf,
    /// Where the device metadata files KubeVirt reads go.
    #[arg(long, env = "VFIO_SANDBOX_METADATA_DIR", default_value = DEFAULT_METADATA_DIR, value_name = "DIR")]
    metadata_dir: PathBuf,
    /// The record of prepared claims and of every device moved (keep it on /run).
    #[arg(long, env = "VFIO_SANDBOX_STATE_FILE", default_value = STATE_FILE, value_name = "FILE")]
    state_file: PathBuf,
    /// The node-wide owner lock, shared with vfio-manager: taken before any device
    /// moves and held for the driver's life. It records the owner and how many
    /// devices it holds; created with its directory if absent.
    #[arg(long, env = "VFIO_SANDBOX_OWNER_LOCK", default_value = DEFAULT_OWNER_LOCK, value_name = "FILE")]
    owner_lock: PathBuf,
    /// vfio-manager's state file, read (never written) when the owner lock is taken:
    /// while it records a device moved, or cannot be read, the node is not the
    /// driver's, whatever the lock's record says (a deleted or garbled record does
    /// not free a node). Mount its directory read-only.
    #[arg(long, env = "VFIO_MANAGER_STATE_FILE", default_value = VFIO_MANAGER_STATE_FILE, value_name = "FILE")]
    manager_state_file: PathBuf,
    /// While vfio-manager owns the node, how often to try the owner lock again
    /// (90s, 5m, 500ms, seconds).
    #[arg(long, env = "VFIO_SANDBOX_OWNER_RETRY_INTERVAL", default_value = "5s", value_parser = parse_duration)]
    owner_retry_interval: Duration,
    /// Kernel modules tree holding <release>/modules.dep (vfio-pci is loaded from it).
    #[arg(long, env = "VFIO_SANDBOX_MODULES_ROOT", default_value = DEFAULT_MODULES_ROOT, value_name = "DIR")]
    modules_root: PathBuf,
    /// Longest a NodePrepareResources or NodeUnprepareResources call takes, claim
    /// reads included (90s, 5m, 500ms, seconds); keep it below kubelet's 45 s call
    /// limit, so kubelet gets our answer rather than DeadlineExceeded. Work left
    /// at the deadline goes on; kubelet's retry gets its result.
    #[arg(long, env = "VFIO_SANDBOX_PREPARE_TIMEOUT", default_value = "40s", value_parser = parse_duration)]
    prepare_timeout: Duration,
    /// IOMMU groups a prepare moves at once (and an unprepare gives back): a native
    /// driver's remove and probe can each take a second on a GPU, so a claim of
    /// several devices then takes about the slowest group's time, not the sum. Each
    /// group stays all-or-nothing, with the same records and rollback. 1 moves one
    /// group after another.
    #[arg(long, env = "VFIO_SANDBOX_BIND_JOBS", default_value_t = passthrough::DEFAULT_BIND_JOBS, value_name = "N")]
    bind_jobs: std::num::NonZeroUsize,
    /// Full rescan period for the ResourceSlice beneath PCI uevents.
    #[arg(long, env = "VFIO_SANDBOX_RESYNC_INTERVAL", default_value = "5m", value_parser = parse_duration)]
    resync_interval: Duration,
    /// Which devices are published with binding conditions (KEP-5007), so the
    /// scheduler binds a pod only once the driver has moved its claim's groups to
    /// vfio (the driver watches ResourceClaims and moves them as soon as they are
    /// allocated; prepare then only writes files). auto: devices whose group
    /// leaves a native driver; always: every device; off: none, every move at
    /// prepare. Where the API server drops the fields (gates
    /// DRADeviceBindingConditions and DRAResourceClaimDeviceStatus off) the driver
    /// publishes without them and says so once.
    #[arg(
        long,
        env = "VFIO_SANDBOX_BINDING_CONDITIONS",
        value_enum,
        default_value = "auto",
        value_name = "MODE"
    )]
    binding_conditions: Mode,
    /// Which ResourceClaims to watch for the early move. labelled: only those the
    /// claim labeller (`sandbox-dra-controller`) labels <driver>/node=<this
    /// node>, so a claim change reaches this node only when it concerns it; early
    /// moves wait while no labeller runs. all: every claim of the cluster, each
    /// change sent to every node. auto: labelled while a labeller holds and renews
    /// its Lease (watched), all otherwise (not installed, released, or not
    /// renewed for the Lease's 15 s), after 5 s for a standby to take it.
    #[arg(
        long,
        env = "VFIO_SANDBOX_CLAIM_WATCH",
        value_enum,
        default_value = "auto",
        value_name = "MODE"
    )]
    claim_watch: ClaimWatch,
    /// The claim labeller's Lease, in this pod's namespace (POD_NAMESPACE), which
    /// --claim-watch=auto reads.
    #[arg(long, env = "VFIO_SANDBOX_LABELLER_LEASE", default_value = LEASE_NAME, value_name = "NAME")]
    labeller_lease: String,
    /// Also give containers /dev/iommu and /dev/vfio/devices/vfioN (iommufd),
    /// where the kernel makes the device cdev: the default for claims whose
    /// configuration does not choose (an opaque VfioConfig with `iommu: legacy |
    /// iommufd | both` in the claim or its DeviceClass chooses per claim).
    #[arg(long, env = "VFIO_SANDBOX_IOMMUFD")]
    iommufd: bool,
    /// Written (JSON) while kubelet has accepted the registration and this node's
    /// ResourceSlices are published; removed otherwise and at stop. `ready` checks it.
    #[arg(long, env = "VFIO_SANDBOX_READY_FILE", default_value = DEFAULT_READY_FILE, value_name = "FILE", global = true)]
    ready_file: PathBuf,
    /// Serve Prometheus metrics (OpenMetrics text) at http://ADDR/metrics: claims
    /// prepared and unprepared, call latency, failures by reason, devices per state,
    /// ResourceSlice writes. ADDR is IP:PORT (0.0.0.0:9404, [::]:9404,
    /// 127.0.0.1:9404) or :PORT for every address. Default: off, no port opened.
    #[arg(long, env = "VFIO_SANDBOX_METRICS_ADDRESS", value_name = "ADDR", value_parser = endpoint::parse_address)]
    metrics_address: Option<ListenAddress>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The readiness probe: exit 0 when the ready file says kubelet accepted the
    /// registration and the ResourceSlices are published, and the sockets kubelet
    /// dials are there; 1 otherwise, saying why.
    Ready,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Ready) = cli.command {
        return match kubelet_plugin::probe(&cli.ready_file) {
            Ok(what) => {
                support::outln!("ready: {what}");
                ExitCode::SUCCESS
            }
            Err(why) => {
                support::outln!("not ready: {why}");
                ExitCode::from(EXIT_NOT_READY)
            }
        };
    }
    cli.common.init_logging();
    // Test variant only: stop at the steps named in FAILPOINTS (support::failpoint).
    #[cfg(feature = "failpoints")]
    let _failpoints = {
        let scenario = fail::FailScenario::setup();
        support::failpoint::install(|step| {
            fail::fail_point!(step, |_| true);
            false
        });
        scenario
    };
    let node_name = cli.node_name.clone().unwrap_or_default();
    if node_name.trim().is_empty() {
        return fail_usage(PROGRAM, "--node-name (NODE_NAME) is empty");
    }
    if cli.prepare_timeout.is_zero() || cli.resync_interval.is_zero() {
        return fail_usage(
            PROGRAM,
            "--prepare-timeout and --resync-interval must be above zero",
        );
    }
    if cli.prepare_timeout >= KUBELET_CALL_TIMEOUT {
        tracing::warn!(
            prepare_timeout = ?cli.prepare_timeout,
            "--prepare-timeout is not below kubelet's {KUBELET_CALL_TIMEOUT:?} call \
                limit: kubelet may give up before our answer"
        );
    }
    // The driver's name, and the sockets' paths and names, judged before the API
    // server is asked or anything on the node is touched.
    let driver = match DriverName::new(&cli.driver_name) {
        Ok(d) => d,
        Err(e) => {
            let rule = "the ResourceSlices' driver, the CDI vendor and the prefix of \
                its conditions and labels: a lowercase DNS subdomain of at most 63 \
                characters that starts with a letter";
            return fail_usage(PROGRAM, &format!("--driver-name: {e} ({rule})"));
        }
    };
    if let Err(e) = plugin_config(&cli, &node_name).check() {
        let dirs = format!(
            "--plugins-dir {}, --registry-dir {}",
            cli.plugins_dir.display(),
            cli.registry_dir.display()
        );
        return fail_usage(PROGRAM, &format!("{e} ({dirs})"));
    }
    let list = match cli.common.resource_list() {
        Ok(l) => l,
        Err(e) => return fail(PROGRAM, &e, EXIT_USAGE),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return fail(PROGRAM, &e, EXIT_NOT_READY),
    };
    runtime.block_on(start(cli, node_name, driver, list))
}

/// Connects, takes the node, recovers what a killed predecessor left, and serves.
async fn start(
    cli: Cli,
    node_name: String,
    driver: DriverName,
    list: passthrough::config::ResourceList,
) -> ExitCode {
    let identity = Identity {
        node: node_name.clone(),
        pod: cli.pod_namespace.clone().zip(cli.pod_name.clone()),
        controller: PROGRAM.into(),
    };
    let cluster = match Cluster::connect(identity).await {
        Ok(c) => c,
        Err(e) => {
            let e = anyhow::anyhow!("cannot set up the API server client: {}", error_chain(&e));
            return fail(PROGRAM, e.as_ref(), EXIT_NOT_READY);
        }
    };
    // Not ready until this process is registered and has published: a ready file
    // left by a killed predecessor goes before anything else.
    let plugin = match Plugin::new(plugin_config(&cli, &node_name), clients(&cluster)) {
        Ok(p) => p,
        Err(e) => return fail(PROGRAM, &e, EXIT_USAGE),
    };
    // The node first: nothing below moves a device before it is ours.
    let owner = match owner::take_or_wait(
        &cli.owner_lock,
        cli.owner_retry_interval,
        &plugin,
        &cli.state_file,
        &cli.manager_state_file,
    )
    .await
    {
        Ok(Some(owner)) => owner,
        Ok(None) => return ExitCode::SUCCESS,
        Err(e) => return fail(PROGRAM, e.as_ref(), EXIT_NOT_READY),
    };
    let mut host = cli.common.host();
    host.modules = cli.modules_root.clone();
    let files = Files {
        driver,
        cdi_dir: cli.cdi_dir.clone(),
        metadata_dir: cli.metadata_dir.clone(),
        iommufd: cli.iommufd,
    };
    let mut state = match StateFile::load(&cli.state_file, true, &DRA_DRIVER) {
        Ok(s) => s,
        Err(e) => return fail(PROGRAM, &e, EXIT_NOT_READY),
    };
    if let Err(e) = state.attach_owner(owner) {
        return fail(PROGRAM, &e, EXIT_NOT_READY);
    }
    let release = module::kernel_release();
    // One kernel door for the driver's life: a write stuck in recovery keeps its
    // device out of every later prepare.
    let kernel = cli.write.kernel();
    // Finish what a killed predecessor left half-done before serving anything.
    let recovery = Claims {
        engine: Passthrough {
            host: &host,
            kernel: &kernel,
            state: &mut state,
            release: release.clone(),
        },
        list: &list,
        pool: &node_name,
        files: &files,
        jobs: cli.bind_jobs,
    }
    .recover();
    for c in &recovery.rolled_back {
        tracing::warn!(claim = %c, "found half-prepared after a restart; rolled back \
            (kubelet prepares it again)");
    }
    for c in &recovery.finished {
        tracing::info!(claim = %c, "found half-unprepared after a restart; finished");
    }
    for c in &recovery.foreign {
        tracing::error!(claim = %c, state_file = %cli.state_file.display(),
            "the state file held a claim of another node; forgot it and its device \
                records without touching a device");
    }
    for a in &recovery.orphans {
        tracing::warn!(bdf = %a, "restored a device no claim owned");
    }
    for f in &recovery.failed {
        tracing::error!(error = %f, "could not finish after a restart; kept for a later unprepare");
    }
    let prepared = state.records().len();
    // Which devices need a rebind is known before the first slice is published.
    let original_drivers = Arc::new(OriginalDrivers::default());
    original_drivers.set(
        state
            .state()
            .devices
            .iter()
            .map(|(a, r)| (*a, r.original_driver.clone()))
            .collect(),
    );
    let mut registry = endpoint::registry();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let health = Arc::new(HealthBoard::new(
        &node_name,
        host.clone(),
        list.clone(),
        kernel.stuck_list(),
    ));
    // Health, the node's interrupt isolation with it, is judged before the first
    // publication: a node where no VM can take a device never offers one untainted.
    health.refresh();
    let owner_lost = sandbox_dra_driver::OwnerLost::default();
    let worker = match Worker::start(
        sandbox_dra_driver::WorkerConfig {
            host: host.clone(),
            list: list.clone(),
            state,
            release,
            pool: node_name.clone(),
            files,
            jobs: cli.bind_jobs,
            health: Some(health.clone()),
            metrics: metrics.clone(),
            kernel,
            original_drivers: Some(original_drivers.clone()),
            owner_lost: owner_lost.clone(),
            republish: Some(plugin.republish()),
        },
        cli.prepare_timeout,
    ) {
        Ok(w) => w,
        Err(e) => return fail(PROGRAM, &e, EXIT_NOT_READY),
    };
    if prepared > 0 {
        tracing::info!(
            claims = prepared,
            "claims prepared before this start are kept"
        );
    }
    let driver = Arc::new(VfioDriver {
        cluster: cluster.clone(),
        driver_name: cli.driver_name.clone(),
        host,
        list,
        worker,
        metrics,
        health: Some(health),
        binding: Some((cli.binding_conditions, original_drivers)),
        owner_lost,
    });
    match run(&cli, &plugin, &cluster, driver, registry).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(PROGRAM, e.as_ref(), EXIT_NOT_READY),
    }
}

/// The kubelet plugin's settings.
fn plugin_config(cli: &Cli, node_name: &str) -> kubelet_plugin::Config {
    let mut config = kubelet_plugin::Config::new(&cli.driver_name, node_name);
    config.registry_dir.clone_from(&cli.registry_dir);
    config.plugins_dir.clone_from(&cli.plugins_dir);
    config.ready_file = Some(cli.ready_file.clone());
    config.call_timeout = cli.prepare_timeout;
    config.max_retry = cli.resync_interval;
    config
}

/// The plugin's connections: the agent's client, and its watch client and settings.
fn clients(cluster: &Cluster) -> Clients {
    Clients {
        client: cluster.kube_client(),
        watch_client: cluster.watch_client(),
        watch_config: node_agent::cluster::watch_config(),
    }
}

async fn run(
    cli: &Cli,
    plugin: &Plugin,
    cluster: &Cluster,
    driver: Arc<VfioDriver>,
    registry: endpoint::Registry,
) -> anyhow::Result<()> {
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sighup = signal(SignalKind::hangup())?;
    if let Some(address) = &cli.metrics_address {
        let listener = endpoint::bind(address).await?;
        tracing::info!(address = %listener.local_addr()?, "serving metrics at /metrics");
        tokio::spawn(endpoint::serve(listener, Arc::new(registry)));
    }
    let api = kubelet_plugin::RESOURCE_API;
    match plugin.resource_api_served().await {
        Ok(true) => {}
        Ok(false) => {
            return Err(anyhow::anyhow!(
                "the API server does not serve {api} with ResourceSlices and \
                    ResourceClaims, which this driver reads and writes: it needs \
                    Kubernetes 1.34 or newer (kubelet 1.32 or newer, within the \
                    version skew policy)"
            ))
        }
        Err(e) => tracing::warn!(
            error = %error_chain(&e),
            "cannot tell whether the API server serves {api}; going on (publishing retries)"
        ),
    }
    let following_node = tokio::spawn(sandbox_dra_driver::follow_node(
        driver.host.clone(),
        cli.resync_interval,
        driver.health.clone(),
        plugin.republish(),
        Some((cli.owner_lock.clone(), driver.worker.clone())),
    ));
    let following_claims = (cli.binding_conditions != Mode::Off).then(|| {
        tokio::spawn(sandbox_dra_driver::watch_claims(
            sandbox_dra_driver::ClaimWatcher {
                cluster: cluster.clone(),
                driver: cli.driver_name.clone(),
                pool: plugin.config().node_name.clone(),
                worker: driver.worker.clone(),
                metrics: driver.metrics.clone(),
                watch: cli.claim_watch,
                labeller_lease: cli.pod_namespace.clone().map(|namespace| LeaseRef {
                    namespace,
                    name: cli.labeller_lease.clone(),
                }),
            },
        ))
    });
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = plugin.run(driver, async move {
        let _ = stop_rx.await;
    });
    tokio::pin!(serving);
    // `served` says the serving future completed: it is never polled again.
    let (result, served) = tokio::select! {
        _ = sigterm.recv() => { tracing::info!(signal = "SIGTERM", "stopping"); (Ok(()), false) }
        _ = sigint.recv() => { tracing::info!(signal = "SIGINT", "stopping"); (Ok(()), false) }
        _ = sighup.recv() => { tracing::info!(signal = "SIGHUP", "stopping"); (Ok(()), false) }
        r = &mut serving => (match r {
            Ok(()) => Err(anyhow::anyhow!("the kubelet API server stopped")),
            Err(e) => Err(e.into()),
        }, true),
    };
    let _ = stop_tx.send(());
    if !served {
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut serving).await;
    }
    following_node.abort();
    if let Some(f) = following_claims {
        f.abort();
    }
    let claims = prepared_claims(&cli.state_file);
    if !claims.is_empty() {
        tracing::info!(claims = %claims.join(", "), "prepared claims keep their \
            devices on vfio until kubelet unprepares them");
    }
    if cli.pod_name.is_none() || cli.pod_namespace.is_none() {
        tracing::info!(
            "POD_NAME/POD_NAMESPACE are not set, so an uninstall cannot be \
                told from a restart; keeping this node's ResourceSlice"
        );
        return result;
    }
    match cluster.stop_lookup().await {
        Ok(Verdict::Keep(why)) => {
            tracing::info!(reason = %why, "keeping this node's ResourceSlice for the \
                next driver pod")
        }
        Ok(Verdict::Restore(why)) => {
            tracing::info!(reason = %why, "the driver leaves this node; deleting its \
                ResourceSlice");
            if let Err(e) = plugin.delete_slices().await {
                tracing::warn!(error = %error_chain(&e), "could not delete this node's \
                    ResourceSlice");
            }
        }
        Err(why) => tracing::warn!(
            reason = %why,
            "cannot tell an uninstall from a restart; keeping this node's ResourceSlice"
        ),
    }
    result
}
