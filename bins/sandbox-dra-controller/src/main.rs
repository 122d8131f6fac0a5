//! `sandbox-dra-controller`: the claim labeller of `sandbox-dra-driver`, one per
//! cluster. It labels each ResourceClaim allocated to the driver's devices with
//! their binding condition with the node they are on, so each node's driver
//! watches only its own claims.

mod election;
mod labeller;
mod labels;
mod metrics;

use std::process::ExitCode;
use std::sync::Arc;

use claim_label::lease::{LEASE_NAME, TIMING};
use claim_label::DEFAULT_DRIVER_NAME;
use clap::Parser;
use node_agent::cli::{fail, fail_usage, LogArgs, EXIT_NOT_READY, EXIT_USAGE};
use node_agent::cluster::{Cluster, Identity};
use node_agent::metrics::{self as endpoint, ListenAddress};
use support::error_chain;
use tokio::signal::unix::{signal, SignalKind};

use crate::labeller::{Health, Labeller};
use crate::metrics::LabellerMetrics;

const PROGRAM: &str = "sandbox-dra-controller";

const LONG_ABOUT: &str = "\
The claim labeller of sandbox-dra-driver: one per cluster, so that each node's driver
watches only its own ResourceClaims.

No field selector picks ResourceClaims by node, so a driver that watches claims for the
early move is sent every claim change of the cluster. The labeller watches them once and
labels each claim allocated to the driver's devices with their binding condition
<driver>/VfioReady with <driver>/node=<node> (the node name; a name longer than 63
characters as its first 40, `_` and a 64-bit FNV-1a hash), removing the label when the
allocation goes; a node's driver with --claim-watch labelled or auto watches with that
label selector, which the API server applies before sending. Each label is a merge patch
conditional on the claim's resourceVersion, so a claim allocated again meanwhile is
decided again from its newer version. Claims allocated before it started are labelled
from its first list.

Run it as a Deployment of two replicas: only the holder of the coordination.k8s.io Lease
<POD_NAMESPACE>/<--lease> acts (client-go's election: 15 s lease, renewed every 2 s, a
leader that cannot renew for 10 s exits). On SIGTERM it releases the Lease, so the
standby takes over within 2 s. Nodes never depend on it for prepare, and with
--claim-watch auto they watch every claim once no labeller has held the Lease for 5 s
(so at most 20 s after a dead labeller's last renewal).

It serves Prometheus metrics at http://ADDR/metrics (leading or not, label patches by
change and result, failed Lease requests) and its readiness at http://ADDR/readyz: 200
while a read or renewal of the Lease succeeded within the last 10 s (leading, or standing
by), 503 saying why otherwise.

Exit codes: 0 stopped by a signal, 1 the Lease was lost or the API server could not be
used, 2 bad usage.";

/// Command line.
#[derive(Debug, Parser)]
#[command(
    name = PROGRAM,
    version,
    about = "The claim labeller of sandbox-dra-driver: labels each ResourceClaim with \
        its node, so each node watches only its own",
    long_about = LONG_ABOUT
)]
struct Cli {
    #[command(flatten)]
    log: LogArgs,
    /// The DRA driver name whose claims are labelled (the label is <driver>/node):
    /// a lowercase DNS subdomain of at most 63 characters, the node drivers' own.
    #[arg(long, env = "VFIO_SANDBOX_DRIVER_NAME", default_value = DEFAULT_DRIVER_NAME, value_name = "NAME")]
    driver_name: String,
    /// The Lease the replicas elect a leader with (the nodes' --labeller-lease).
    #[arg(long, env = "VFIO_SANDBOX_LABELLER_LEASE", default_value = LEASE_NAME, value_name = "NAME")]
    lease: String,
    /// The Lease's namespace (downward API: the pod's own).
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE")]
    pod_namespace: String,
    /// This replica's name in the Lease (downward API: the pod's name).
    #[arg(long, env = "POD_NAME", value_name = "NAME")]
    pod_name: String,
    /// Serve metrics at http://ADDR/metrics and readiness at http://ADDR/readyz.
    /// ADDR is IP:PORT or :PORT for every address.
    #[arg(
        long,
        env = "VFIO_SANDBOX_METRICS_ADDRESS",
        value_name = "ADDR",
        default_value = ":9405",
        value_parser = endpoint::parse_address
    )]
    metrics_address: ListenAddress,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli.log.init_logging();
    for (flag, value) in [
        ("--pod-namespace (POD_NAMESPACE)", &cli.pod_namespace),
        ("--pod-name (POD_NAME)", &cli.pod_name),
    ] {
        if value.trim().is_empty() {
            return fail_usage(PROGRAM, &format!("{flag} is empty"));
        }
    }
    if let Err(reason) = claim_label::names::check_driver_name(&cli.driver_name) {
        let rule = "the prefix of the claim label's key and of the binding conditions: \
            a lowercase DNS subdomain of at most 63 characters";
        let name = &cli.driver_name;
        return fail_usage(
            PROGRAM,
            &format!("--driver-name {name:?}: {reason} ({rule})"),
        );
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return fail(PROGRAM, &e, EXIT_NOT_READY),
    };
    runtime.block_on(run(cli))
}

/// Labels claims until SIGTERM or SIGINT (or the Lease is lost).
async fn run(cli: Cli) -> ExitCode {
    let identity = Identity {
        node: String::new(),
        pod: Some((cli.pod_namespace.clone(), cli.pod_name.clone())),
        controller: PROGRAM.into(),
    };
    let cluster = match Cluster::connect(identity).await {
        Ok(c) => c,
        Err(e) => {
            let e = anyhow::anyhow!("cannot set up the API server client: {}", error_chain(&e));
            return fail(PROGRAM, e.as_ref(), EXIT_NOT_READY);
        }
    };
    let (mut sigterm, mut sigint) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        (Err(e), _) | (_, Err(e)) => return fail(PROGRAM, &e, EXIT_NOT_READY),
    };
    let mut registry = endpoint::registry();
    let metrics = Arc::new(LabellerMetrics::new(&mut registry));
    let health = Arc::new(Health::default());
    let listener = match endpoint::bind(&cli.metrics_address).await {
        Ok(l) => l,
        Err(e) => return fail(PROGRAM, &e, EXIT_USAGE),
    };
    if let Ok(address) = listener.local_addr() {
        tracing::info!(%address, "serving metrics at /metrics and readiness at /readyz");
    }
    let ready: endpoint::Readiness = {
        let health = health.clone();
        Arc::new(move || health.readiness(TIMING.renew_deadline))
    };
    tokio::spawn(endpoint::serve_with_readiness(
        listener,
        Arc::new(registry),
        ready,
    ));
    let labeller = Labeller {
        client: cluster.kube_client(),
        watch_client: cluster.watch_client(),
        driver: cli.driver_name,
        namespace: cli.pod_namespace,
        lease: cli.lease,
        identity: cli.pod_name,
        timing: TIMING,
        metrics,
        health,
    };
    let stop = async move {
        tokio::select! {
            _ = sigterm.recv() => tracing::info!(signal = "SIGTERM", "stopping"),
            _ = sigint.recv() => tracing::info!(signal = "SIGINT", "stopping"),
        }
    };
    match labeller.run(stop).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(PROGRAM, &e, EXIT_NOT_READY),
    }
}
