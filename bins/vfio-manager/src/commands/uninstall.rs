//! `vfio-manager uninstall`: the chart's pre-delete hook. `helm uninstall` deletes
//! every object of a release at once, vfio-manager's ServiceAccount and RBAC with its
//! DaemonSet, so a pod restoring its node on SIGTERM could no longer take its restore
//! label off the Node. Run first, this deletes the DaemonSet in the foreground and
//! waits until every pod of it has finished its restore and is gone, while its
//! account still works.

use std::process::ExitCode;
use std::time::Duration;

use node_agent::cli::parse_duration;
use node_agent::cluster::{client, delete_daemonset_and_wait, infer_config};

use crate::{Context, UsageError};

/// Flags of `uninstall`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The vfio-manager DaemonSet, as NAMESPACE/NAME.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub daemonset: String,
    /// How long its pods may take: their termination grace period and some room.
    #[arg(long, default_value = "4m", value_parser = parse_duration)]
    pub timeout: Duration,
}

/// Runs `uninstall`.
pub fn run(_ctx: &Context, args: &Args) -> anyhow::Result<ExitCode> {
    let (namespace, name) = match args.daemonset.split_once('/') {
        Some((ns, n)) if !ns.is_empty() && !n.is_empty() && !n.contains('/') => (ns, n),
        _ => {
            return Err(UsageError(format!(
                "--daemonset {:?}: expected NAMESPACE/NAME",
                args.daemonset
            ))
            .into())
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let took = rt.block_on(async {
        let client = client(infer_config().await?)?;
        delete_daemonset_and_wait(client, namespace, name, args.timeout).await
    })?;
    match took {
        Some(t) => support::outln!(
            "DaemonSet {namespace}/{name} deleted; its pods finished in {:.1} s",
            t.as_secs_f64()
        ),
        None => support::outln!("DaemonSet {namespace}/{name} does not exist: nothing to wait for"),
    }
    Ok(ExitCode::SUCCESS)
}
