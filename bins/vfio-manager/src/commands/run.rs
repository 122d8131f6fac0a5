//! `vfio-manager run`: the DaemonSet main.
//!
//! Load the vfio modules, optionally unload native driver modules, bind everything
//! selected, write the ready file, then keep the node converged — a device that
//! appears later (hot-plug, PCI rescan, VFs enabled) is bound too — until SIGTERM,
//! SIGINT or SIGHUP. Then, unless `--keep-bound-on-exit`, it asks the API server
//! whether the node stays in VM mode (a rollout: leave the devices bound for the next
//! pod) or leaves it (restore like `unbind --all`); see `node_agent::cluster`.
//!
//! With API access and a restore label (`--restore-label`, on by default) it does
//! not wait for the stop to find out: it labels its Node while it may have devices
//! to restore, and asks every resync period whether the node is still in VM mode.
//! The shipped DaemonSet selects nodes with that label too, so when the node leaves
//! VM mode the pod is not stopped: it restores while it runs, with no grace period
//! to beat, and only then removes the label (the DaemonSet controller then removes
//! the pod). A pod killed mid-restore is recreated by the label, finds the records
//! and the node out of VM mode, and finishes the restore without binding anything.
//!
//! The loop sleeps in `poll(2)` on a signalfd, the node watcher's descriptors
//! (kernel uevents, `/dev/vfio`) and the API thread's answers, so an idle node
//! costs nothing; the watcher's periodic resync covers what events cannot see.

use std::collections::BTreeSet;
use std::os::fd::AsFd;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use node_agent::cli::parse_duration;
use node_agent::cluster::{Identity, Verdict};
use node_agent::watch::{NodeWatch, Options};
use passthrough::inventory::{Inventory, SkipLog};
use passthrough::Passthrough;
use support::error_chain;
use support::io::{remove_if_present, write_atomic};
use sysfs_pci::deadline::StuckWrite;
use sysfs_pci::module::kernel_release;
use sysfs_pci::PciAddress;

use crate::api_thread::{ApiThread, NodeEvent};
use crate::metrics::Metrics;
use crate::{report, Context};

/// Flags of `run`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Native driver module to unload after the devices' overrides are set (repeatable,
    /// e.g. rebellions); reloaded on restore. A module in use is reported, not forced.
    #[arg(long = "unload-module", value_name = "NAME")]
    unload_modules: Vec<String>,
    /// On SIGTERM/SIGINT/SIGHUP leave the devices on vfio (default: restore like `unbind --all`).
    #[arg(long, env = "VFIO_MANAGER_KEEP_BOUND_ON_EXIT")]
    keep_bound_on_exit: bool,
    /// This node's name (downward API `spec.nodeName`). With API access (in-cluster
    /// service account or KUBECONFIG) a stop keeps the devices bound while the
    /// DaemonSet still selects this node; without, a stop always restores.
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    node_name: Option<String>,
    /// This pod's name (downward API `metadata.name`), to find its DaemonSet.
    #[arg(long, env = "POD_NAME", value_name = "NAME")]
    pod_name: Option<String>,
    /// This pod's namespace (downward API `metadata.namespace`).
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE")]
    pod_namespace: Option<String>,
    /// Serve Prometheus metrics (OpenMetrics text) at http://ADDR/metrics: devices
    /// bound, not bound and held by a VM; binds, restores and stops with their
    /// outcome. ADDR is HOST:PORT, [IPV6]:PORT or :PORT (all addresses). Off by default.
    #[arg(long, env = "VFIO_SANDBOX_METRICS_ADDRESS", value_name = "ADDR", value_parser = node_agent::metrics::parse_address)]
    metrics_address: Option<node_agent::metrics::ListenAddress>,
    /// Full rescan period, besides reacting to kernel uevents (90s, 5m, 500ms, seconds);
    /// with a restore label, also how often the API server is asked whether the node
    /// is still in VM mode.
    #[arg(long, env = "VFIO_MANAGER_RESYNC_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    resync_interval: Duration,
    /// Node label (KEY, set to "true") kept on this node while vfio-manager may have
    /// devices to restore, and removed once everything is back. Its DaemonSet must
    /// select nodes with this label as well as VM-mode nodes (the shipped one does, in
    /// a second required node-affinity term): then leaving VM mode restores while the
    /// pod runs, and a pod killed mid-restore comes back to finish it. Whether the
    /// node is in VM mode is judged without this label. Needs NODE_NAME, POD_NAME,
    /// POD_NAMESPACE and `patch` on nodes. Empty: no label (restore on SIGTERM only).
    #[arg(
        long,
        env = "VFIO_MANAGER_RESTORE_LABEL",
        default_value = DEFAULT_RESTORE_LABEL,
        value_name = "KEY",
        value_parser = parse_label_key
    )]
    restore_label: String,
}

/// The restore label the chart sets by default (a release with a `nameSuffix` has its own).
pub const DEFAULT_RESTORE_LABEL: &str = "vfio-sandbox.rebellions.ai/vfio-manager.restore-pending";

/// How long the start waits for the restore label before it binds anything.
const LABEL_WAIT: Duration = Duration::from_secs(5);

/// A label key as the API server accepts it: an optional DNS-subdomain prefix and
/// `/`, then a name of at most 63 characters of `[A-Za-z0-9._-]` that starts and
/// ends with a letter or digit. Empty turns the label off.
fn parse_label_key(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Ok(String::new());
    }
    let (prefix, name) = match s.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    let alnum_ends = |x: &str| {
        x.starts_with(|c: char| c.is_ascii_alphanumeric())
            && x.ends_with(|c: char| c.is_ascii_alphanumeric())
    };
    if name.len() > 63
        || !alnum_ends(name)
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(format!(
            "{s:?}: the name part must be 1-63 characters of \
                [A-Za-z0-9._-], starting and ending with a letter or digit"
        ));
    }
    if let Some(p) = prefix {
        let ok = !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && alnum_ends(l)
                    && l.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            });
        if !ok {
            return Err(format!(
                "{s:?}: the prefix must be a DNS subdomain (lower case, dots)"
            ));
        }
    }
    Ok(s.to_owned())
}

/// Delay between the first node event of a batch and the pass it triggers. The
/// node watcher drains each burst; this is vfio-manager's own pause before it acts,
/// so a device that left its vfio driver is seen gone (the device plugin reports it
/// Unhealthy) before it is bound again, and the rest of a burst joins the pass.
const SETTLE: Duration = Duration::from_millis(200);
/// Delay before retrying a resync that failed.
const RETRY: Duration = Duration::from_secs(1);

/// Runs the daemon until a signal.
pub fn run(ctx: &Context, args: &Args) -> anyhow::Result<ExitCode> {
    let signals = block_signals()?;
    let list = ctx.common.resource_list()?;
    // The node's owner lock, held for the life of `run`: while sandbox-dra-driver
    // owns the node, exit 2 before touching it; once held, it cannot come in.
    let owner = ctx.take_owner()?;
    // A ready file left by a killed predecessor must not vouch for this process,
    // nor its list of stuck writes speak for it.
    remove_if_present(&ctx.ready_file)?;
    remove_if_present(&stuck_file(&ctx.ready_file))?;
    // After block_signals: the API thread inherits the blocked mask, so the
    // signalfd sees every stop signal.
    let mut registry = node_agent::metrics::registry();
    let metrics = Metrics::new(&mut registry);
    let (identity, restore_label) = identity(args).unzip();
    let api = ApiThread::start(
        identity,
        restore_label.flatten(),
        args.metrics_address.map(|a| (a, registry)),
        args.resync_interval,
    )?;
    let mut state = ctx.owned_state(owner)?;
    let kernel = ctx.write.kernel();
    let mut pt = Passthrough {
        host: &ctx.host,
        kernel: &kernel,
        state: &mut state,
        release: kernel_release(),
    };
    let validator_ready = node_agent::ready::validator_ready_file(&ctx.validator_status_dir);
    let mut pass = RunState {
        ready_file: &ctx.ready_file,
        validator_ready: &validator_ready,
        api: &api,
        metrics: &metrics,
        converged: false,
        bind_jobs: ctx.bind_jobs,
        skipped: SkipLog::default(),
        last_failure: None,
        stuck: BTreeSet::new(),
        owner_lost: None,
    };
    // Out of VM mode already (a pod the restore label brought back after a kill
    // mid-restore): finish the restore, bind nothing.
    let mut leaving = match api.check_now() {
        Some(Ok(check)) => match check.verdict {
            Verdict::Restore(reason) => Some(reason),
            Verdict::Keep(_) => None,
        },
        Some(Err(why)) => {
            tracing::warn!(%why, "binding as usual");
            None
        }
        None => None,
    };
    let mut leave = LeaveLog::default();
    match &leaving {
        Some(reason) => {
            tracing::info!(%reason, devices = pt.state.state().devices.len(),
                "the node is not in VM mode: finishing the restore, binding nothing");
            pass.leave(ctx, &mut pt, &mut leave);
        }
        None => {
            // The label first: from now on a kill mid-restore is finished by the next pod.
            api.restore_label(true);
            if !api.label_settled(LABEL_WAIT) {
                tracing::warn!(label = %args.restore_label, "the restore label is not \
                    on the Node yet (still trying): until it is, a kill during a \
                    restore leaves devices for a person");
            }
            let inv = Inventory::scan(&ctx.host, &list)?;
            pt.enter_vm_mode(&inv, &args.unload_modules)?;
            pass.converge(&mut pt, &list)?;
        }
    }
    // The node watcher: every batch of PCI uevents and /dev/vfio changes, a change
    // of the owner lock file, and the resync, leads to one more pass SETTLE later
    // (a pass is whole-node and changes nothing that is already right, so our own
    // binds' events cost one idle pass). A lock deleted or replaced under us is
    // so seen at once: taken again, or the node is not ours and we say so.
    let mut node = NodeWatch::open(
        &ctx.host,
        Options {
            resync: Some(args.resync_interval),
            owner_lock: Some(ctx.owner_lock.clone()),
            ..Options::default()
        },
    );
    // One pass as soon as the watch is open: what changed after the first pass
    // and before the watch (a uevent, the owner lock deleted or replaced) is seen
    // now, not at the resync.
    let mut pending: Option<Instant> = Some(Instant::now());
    loop {
        let timeout = match pending {
            Some(at) => node
                .timeout()
                .min(at.saturating_duration_since(Instant::now())),
            None => node.timeout(),
        };
        if let Some(sig) = wait(&signals, &node, api.wake_fd(), timeout)? {
            tracing::info!(signal = ?sig, "stopping");
            break;
        }
        if let Some(check) = api.checked() {
            match (check.verdict, &leaving) {
                (Verdict::Restore(reason), None) => {
                    tracing::info!(%reason, "the node leaves VM mode; restoring while \
                        this pod runs");
                    leaving = Some(reason);
                    pending = Some(Instant::now());
                }
                (Verdict::Keep(reason), Some(_)) => {
                    tracing::info!(%reason, "the node is back in VM mode; binding again");
                    leaving = None;
                    leave = LeaveLog::default();
                    api.restore_label(true);
                    pending = Some(Instant::now());
                }
                _ => {}
            }
        }
        if !node.collect().is_empty() && pending.is_none() {
            pending = Some(Instant::now() + SETTLE);
        }
        if pending.is_none_or(|at| Instant::now() < at) {
            continue;
        }
        pending = None;
        if leaving.is_some() {
            pass.leave(ctx, &mut pt, &mut leave);
            continue;
        }
        // A device vanishing mid-scan, a module that fails to load: log it and
        // try again soon. The daemon only stops on a signal.
        if let Err(e) = pass.converge(&mut pt, &list) {
            tracing::error!(error = %error_chain(e.as_ref()), "resync failed; retrying");
            node.retry_in(RETRY);
        }
    }
    remove_if_present(&ctx.ready_file)?;
    remove_if_present(&stuck_file(&ctx.ready_file))?;
    let recorded = pt.state.state().devices.len();
    if args.keep_bound_on_exit {
        tracing::info!("leaving devices bound (--keep-bound-on-exit)");
        metrics.stop("keep");
        api.finish();
        return Ok(ExitCode::SUCCESS);
    }
    match api.stop_verdict() {
        Some(Verdict::Keep(reason)) => {
            tracing::info!(%reason, devices = recorded, "the node stays in VM mode; \
                leaving the devices bound for the next vfio-manager");
            api.event(NodeEvent {
                warning: false,
                reason: "DevicesKept",
                action: "Keep",
                note: format!(
                    "kept {recorded} device(s) on vfio for the next \
                        vfio-manager: {reason}"
                ),
            });
            metrics.stop("keep");
            api.finish();
            return Ok(ExitCode::SUCCESS);
        }
        Some(Verdict::Restore(reason)) => {
            tracing::info!(%reason, "the node leaves VM mode; restoring");
        }
        None => tracing::info!(
            "no API access; restoring (set NODE_NAME and give the \
                pod API access to keep devices bound across rollouts)"
        ),
    }
    metrics.stop("restore");
    let ok = restore_all(ctx, &mut pt, &api, &metrics, &mut leave);
    let state = pt.state.state();
    if state.devices.is_empty() && state.unloaded_modules.is_empty() {
        api.restore_label(false);
    }
    api.finish();
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The cluster identity from the downward API; `None` (said at start) without a
/// node name.
/// Who this agent is in the cluster, and the restore label's key where it keeps
/// one.
fn identity(args: &Args) -> Option<(Identity, Option<String>)> {
    let Some(node) = args.node_name.clone().filter(|n| !n.is_empty()) else {
        tracing::warn!(
            "NODE_NAME is not set, so the API server is not asked: a stop \
                restores every device, and each rollout bounces idle devices"
        );
        return None;
    };
    let pod = match (&args.pod_namespace, &args.pod_name) {
        (Some(ns), Some(name)) if !ns.is_empty() && !name.is_empty() => {
            Some((ns.clone(), name.clone()))
        }
        _ => None,
    };
    // The label is kept only where it can work: the pod must be known to judge VM
    // mode while it runs, and with --keep-bound-on-exit nothing restores.
    let restore_label = (!args.restore_label.is_empty() && !args.keep_bound_on_exit)
        .then(|| args.restore_label.clone());
    if restore_label.is_some() && pod.is_none() {
        tracing::warn!(
            "POD_NAME/POD_NAMESPACE are not set: no restore label, a stop alone restores"
        );
    }
    let restore_label = restore_label.filter(|_| pod.is_some());
    let identity = Identity {
        node,
        pod,
        controller: "vfio-manager".into(),
    };
    Some((identity, restore_label))
}

/// What the restores of a node leaving VM mode said already, so a retry every
/// resync does not repeat its Events.
#[derive(Debug, Default)]
pub struct LeaveLog {
    held: Vec<u32>,
    failure: Option<String>,
}

/// Restores every recorded device (the node leaves VM mode): the validator's ready
/// file goes first, then the devices; Events say what happened, unless `log` shows
/// they were said already. True when all went back.
pub fn restore_all(
    ctx: &Context,
    pt: &mut Passthrough<'_>,
    api: &ApiThread,
    metrics: &Metrics,
    log: &mut LeaveLog,
) -> bool {
    clear_validator_ready_file(ctx);
    let report = pt.restore_concurrent(&[], ctx.bind_jobs);
    metrics.restore(&report);
    if !report.restored.is_empty() {
        api.event(NodeEvent {
            warning: false,
            reason: "DevicesRestored",
            action: "Restore",
            note: format!(
                "restored {} device(s) to their native drivers: {}",
                report.restored.len(),
                listing(report.restored.iter().map(|(a, _)| a))
            ),
        });
    }
    let mut held: Vec<u32> = report.in_use.iter().map(|(_, g)| *g).collect();
    held.dedup();
    let again = if api.watches() {
        "it is restored once the VM has stopped"
    } else {
        "run `vfio-manager unbind --all` once the VM has stopped"
    };
    for &g in held.iter().filter(|g| !log.held.contains(g)) {
        let devices = report
            .in_use
            .iter()
            .filter(|(_, x)| *x == g)
            .map(|(a, _)| a);
        api.event(NodeEvent {
            warning: true,
            reason: "GroupHeld",
            action: "Restore",
            note: format!(
                "IOMMU group {g} ({}) is held by a VM (/dev/vfio/{g} is open): left on \
                    vfio, record kept; {again}",
                listing(devices)
            ),
        });
    }
    let said = std::mem::replace(&mut log.held, held);
    let held = report::Held { again, said: &said };
    let failure = report.failed.first().map(|e| error_chain(e));
    if failure.is_some() && failure == log.failure {
        return report::print_restore(&report, false, &held);
    }
    log.failure = failure;
    if let Some(e) = report.failed.first() {
        api.event(NodeEvent {
            warning: true,
            reason: "RestoreFailed",
            action: "Restore",
            note: format!(
                "{} device(s) not restored: {}",
                report.failed.len(),
                error_chain(e)
            ),
        });
    }
    report::print_restore(&report, false, &held)
}

/// Removes the validator's ready file: it vouches for a node in VM mode.
pub fn clear_validator_ready_file(ctx: &Context) {
    let path = node_agent::ready::validator_ready_file(&ctx.validator_status_dir);
    match remove_if_present(&path) {
        Ok(()) => tracing::debug!(file = %path.display(), "removed the validator's ready file"),
        Err(e) => tracing::warn!(error = %error_chain(&e), "the validator's ready file stays"),
    }
}

/// Up to ten addresses, then a count.
fn listing<'a>(addrs: impl Iterator<Item = &'a sysfs_pci::PciAddress>) -> String {
    let all: Vec<String> = addrs.map(ToString::to_string).collect();
    match all.len() {
        0..=10 => all.join(", "),
        n => format!("{}, and {} more", all[..10].join(", "), n - 10),
    }
}

/// What the passes of `run` carry from one to the next.
struct RunState<'a> {
    ready_file: &'a std::path::Path,
    /// The validator's ready file, which vouches for the node as ours.
    validator_ready: &'a std::path::Path,
    api: &'a ApiThread,
    metrics: &'a Metrics,
    /// Whether the last pass found every device bound.
    converged: bool,
    /// IOMMU groups bound at once (`--bind-jobs`).
    bind_jobs: std::num::NonZeroUsize,
    skipped: SkipLog,
    /// The last bind failure reported as an Event (repeats are not re-sent).
    last_failure: Option<String>,
    /// Devices with a sysfs write that has not returned, as last reported.
    stuck: BTreeSet<PciAddress>,
    /// Why the owner lock is not ours, as last said (nothing is bound meanwhile).
    owner_lost: Option<String>,
}

impl RunState<'_> {
    /// A pass while the node is out of VM mode: nothing is bound; what is recorded
    /// is restored (a group a VM holds is tried again next pass), and the restore
    /// label goes once nothing is left.
    fn leave(&mut self, ctx: &Context, pt: &mut Passthrough<'_>, log: &mut LeaveLog) {
        for file in [self.ready_file.to_path_buf(), stuck_file(self.ready_file)] {
            if let Err(e) = remove_if_present(&file) {
                tracing::warn!(error = %error_chain(&e), "cannot remove {}", file.display());
            }
        }
        self.converged = false;
        let state = pt.state.state();
        if !state.devices.is_empty() || !state.unloaded_modules.is_empty() {
            restore_all(ctx, pt, self.api, self.metrics, log);
        } else {
            clear_validator_ready_file(ctx);
        }
        let state = pt.state.state();
        if state.devices.is_empty() && state.unloaded_modules.is_empty() {
            self.api.restore_label(false);
        }
    }

    /// One pass: rescan, bind what is not bound, keep the ready file true. A device
    /// that cannot be read is left out (its group with it) and logged once; the
    /// validator names it too.
    fn converge(
        &mut self,
        pt: &mut Passthrough<'_>,
        list: &passthrough::config::ResourceList,
    ) -> anyhow::Result<()> {
        let inv = Inventory::scan(pt.host, list)?;
        for s in self.skipped.note(&inv.skipped).new {
            tracing::warn!(bdf = %s.address, reason = %s, "device left out: it cannot be read");
        }
        // `run` holds the owner lock, so sandbox-dra-driver cannot have come in
        // since, unless the lock file was deleted or replaced: then it is taken
        // again, or nothing is bound (every save that records a device checks too).
        match pt.state.ensure_owner() {
            Ok(()) => {
                if self.owner_lost.take().is_some() {
                    tracing::info!("the node's owner lock is ours again; binding");
                }
            }
            Err(e) => {
                let why = error_chain(&e);
                if self.owner_lost.as_ref() != Some(&why) {
                    tracing::error!(error = %why, "the node's owner lock is no longer \
                        ours: binding no device, not ready (the ready files are \
                        removed) until it is ours again");
                }
                self.owner_lost = Some(why);
                self.converged = false;
                // Nothing may vouch for a node that is not ours: the validator's
                // ready file goes with ours.
                for file in [
                    self.ready_file.to_path_buf(),
                    stuck_file(self.ready_file),
                    self.validator_ready.to_path_buf(),
                ] {
                    if let Err(e) = remove_if_present(&file) {
                        tracing::warn!(error = %error_chain(&e), "cannot remove {}", file.display());
                    }
                }
                return Ok(());
            }
        }
        let needs_work = inv.entries.iter().any(|e| !e.is_bound());
        if needs_work {
            let bind = pt.move_to_vfio(&inv, &[], self.bind_jobs)?;
            self.metrics.bind(&bind);
            for e in &bind.failed {
                tracing::error!(error = %report::failure(e), "bind failed; will retry");
            }
            if !bind.bound.is_empty() {
                self.api.event(NodeEvent {
                    warning: false,
                    reason: "DevicesBound",
                    action: "Bind",
                    note: format!(
                        "bound {} device(s) to vfio: {}",
                        bind.bound.len(),
                        listing(bind.bound.iter().map(|(a, _)| a))
                    ),
                });
            }
            let failure = bind.failed.first().map(report::failure);
            if failure.is_some() && failure != self.last_failure {
                self.api.event(NodeEvent {
                    warning: true,
                    reason: "BindFailed",
                    action: "Bind",
                    note: format!(
                        "{} group(s) not bound (retrying): {}",
                        bind.failed.len(),
                        failure.clone().unwrap_or_default()
                    ),
                });
            }
            self.last_failure = failure;
        }
        self.note_stuck(pt.kernel.stuck_writes())?;
        let inv = if needs_work {
            Inventory::scan(pt.host, list)?
        } else {
            inv
        };
        self.metrics.observe(&inv);
        let converged = inv.entries.iter().all(|e| e.is_bound());
        if converged {
            let devices: Vec<String> = inv
                .entries
                .iter()
                .map(|e| e.device.address.to_string())
                .collect();
            let doc = serde_json::json!({
                "devices": devices,
                "groups": inv.groups.keys().collect::<Vec<_>>(),
                "time": support::time::unix_now(),
            });
            write_atomic(self.ready_file, format!("{doc}\n").as_bytes())?;
            if !self.converged {
                tracing::info!(file = %self.ready_file.display(), devices = devices.len(),
                    "every selected device is bound; wrote ready file");
            }
        } else {
            remove_if_present(self.ready_file)?;
            if self.converged {
                tracing::warn!(file = %self.ready_file.display(),
                    "a selected device is not bound; removed ready file");
            }
        }
        self.converged = converged;
        Ok(())
    }

    /// Says which devices have a sysfs write that has not returned: a Warning Event
    /// for each newly stuck one, the `stuck` gauge, and the stuck file beside the
    /// ready file, which `vfio-manager ready` quotes (the device keeps the node not
    /// ready: it is not bound).
    fn note_stuck(&mut self, stuck: Vec<StuckWrite>) -> anyhow::Result<()> {
        self.metrics.stuck(stuck.len());
        let now: BTreeSet<PciAddress> = stuck.iter().map(|w| w.address).collect();
        for w in stuck.iter().filter(|w| !self.stuck.contains(&w.address)) {
            self.api.event(NodeEvent {
                warning: true,
                reason: "DeviceStuck",
                action: "Bind",
                note: format!(
                    "{w}; it is left alone with its record kept, the rest of the node \
                        goes on, and it is bound once the write returns"
                ),
            });
        }
        for a in self.stuck.difference(&now) {
            tracing::info!(bdf = %a, "no longer stuck");
        }
        let file = stuck_file(self.ready_file);
        if stuck.is_empty() {
            remove_if_present(&file)?;
        } else if now != self.stuck {
            let lines: Vec<String> = stuck.iter().map(ToString::to_string).collect();
            let doc = serde_json::json!({ "stuck": lines, "time": support::time::unix_now() });
            write_atomic(&file, format!("{doc}\n").as_bytes())?;
        }
        self.stuck = now;
        Ok(())
    }
}

/// Where `run` lists the devices whose sysfs write has not returned: `stuck.json`
/// beside its ready file.
pub fn stuck_file(ready_file: &std::path::Path) -> std::path::PathBuf {
    ready_file.with_file_name("stuck.json")
}

fn block_signals() -> anyhow::Result<SignalFd> {
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    // A hang-up (the terminal of a hand-started `run` closing) stops it like SIGTERM:
    // restore, remove the ready file, exit 0. The default action would kill it with
    // the devices bound and a stale ready file.
    set.add(Signal::SIGHUP);
    set.thread_block()?;
    Ok(SignalFd::with_flags(
        &set,
        SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK,
    )?)
}

/// Waits for a signal, a node event, the API thread's answer, or `timeout`; the
/// signal, if one came.
fn wait(
    signals: &SignalFd,
    node: &NodeWatch,
    api: Option<std::os::fd::BorrowedFd<'_>>,
    timeout: Duration,
) -> anyhow::Result<Option<Signal>> {
    let mut fds = vec![PollFd::new(signals.as_fd(), PollFlags::POLLIN)];
    fds.extend(api.map(|fd| PollFd::new(fd, PollFlags::POLLIN)));
    fds.extend(
        node.fds()
            .into_iter()
            .map(|fd| PollFd::new(fd, PollFlags::POLLIN)),
    );
    let ms = i32::try_from(timeout.as_millis())
        .unwrap_or(i32::MAX)
        .max(1);
    match poll(
        &mut fds,
        PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
    ) {
        Ok(_) => {}
        Err(nix::errno::Errno::EINTR) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let signal = match signals.read_signal() {
        Ok(Some(info)) => Signal::try_from(info.ssi_signo as i32).ok(),
        _ => None,
    };
    Ok(signal)
}

#[cfg(test)]
mod tests {
    use super::parse_label_key;

    #[test]
    fn label_keys_are_checked_as_the_api_server_would() {
        for ok in [
            "",
            "restore-pending",
            super::DEFAULT_RESTORE_LABEL,
            "a.b-c/x_y.z",
            "example.com/A1",
        ] {
            assert_eq!(parse_label_key(ok).as_deref(), Ok(ok), "{ok}");
        }
        let long = "x".repeat(64);
        for bad in [
            "/x",
            "Example.com/x",
            "a..b/x",
            "a/-x",
            "a/x-",
            "a/x y",
            "a/",
            long.as_str(),
            "a/b/c",
        ] {
            assert!(parse_label_key(bad).is_err(), "{bad}");
        }
    }
}
