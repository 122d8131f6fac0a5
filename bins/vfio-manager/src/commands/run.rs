//! `vfio-manager run`: the DaemonSet main.
//!
//! Load the vfio modules, optionally unload native driver modules, bind everything
//! selected, write the ready file, then keep the node converged — a device that
//! appears later (hot-plug, PCI rescan, VFs enabled) is bound too — until SIGTERM,
//! SIGINT or SIGHUP, then restore like `unbind --all` unless `--keep-bound-on-exit`.
//!
//! The loop sleeps in `poll(2)` on a signalfd and a kernel uevent socket, so an idle
//! node costs nothing; a periodic resync covers a uevent socket we could not open.

use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use vfio_sandbox::cli::parse_duration;
use vfio_sandbox::error_chain;
use vfio_sandbox::inventory::{Inventory, SkipLog};
use vfio_sandbox::io::write_atomic;
use vfio_sandbox::kernel::SysKernel;
use vfio_sandbox::module::kernel_release;
use vfio_sandbox::passthrough::{target_drivers, Passthrough};

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
    /// Written (JSON) once every selected device is bound; removed on exit.
    #[arg(
        long,
        env = "VFIO_MANAGER_READY_FILE",
        default_value = "/run/vfio-manager/ready",
        value_name = "FILE"
    )]
    ready_file: PathBuf,
    /// Full rescan period, besides reacting to kernel uevents (90s, 5m, 500ms, seconds).
    #[arg(long, env = "VFIO_MANAGER_RESYNC_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    resync_interval: Duration,
}

/// Delay between the first uevent of a burst and the resync it triggers.
const SETTLE: Duration = Duration::from_millis(200);
/// Delay before retrying a resync that failed.
const RETRY: Duration = Duration::from_secs(1);

/// Runs the daemon until a signal.
pub fn run(ctx: &Context, args: &Args) -> anyhow::Result<ExitCode> {
    let signals = block_signals()?;
    let list = ctx.common.resource_list()?;
    // A ready file left by a killed predecessor must not vouch for this process.
    remove_ready_file(&args.ready_file)?;
    let uevents = match vfio_sandbox::uevent::socket_nonblocking() {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "no kernel uevents; relying on the periodic resync");
            None
        }
    };
    let mut state = ctx.state(true)?;
    let mut pt = Passthrough {
        host: &ctx.host,
        kernel: &SysKernel,
        state: &mut state,
        release: kernel_release(),
    };
    let inv = Inventory::scan(&ctx.host, &list)?;
    pt.prepare(&inv, &args.unload_modules)?;
    let mut skipped = SkipLog::default();
    let mut converged = converge(&mut pt, &list, args, false, &mut skipped)?;
    // parse_duration caps the interval (cli::MAX_DURATION), so this cannot overflow.
    let mut next_resync = Instant::now() + args.resync_interval;
    let mut pending: Option<Instant> = None;
    loop {
        let deadline = pending.unwrap_or(next_resync).min(next_resync);
        let timeout = deadline.saturating_duration_since(Instant::now());
        let (signal, uevent) = wait(&signals, uevents.as_ref(), timeout)?;
        if let Some(sig) = signal {
            tracing::info!(signal = ?sig, "stopping");
            break;
        }
        if uevent && pending.is_none() {
            pending = Some(Instant::now() + SETTLE);
        }
        let now = Instant::now();
        if pending.is_some_and(|p| now >= p) || now >= next_resync {
            pending = None;
            next_resync = now + args.resync_interval;
            match converge(&mut pt, &list, args, converged, &mut skipped) {
                Ok(c) => converged = c,
                // A device vanishing mid-scan, a module that fails to load: log it and
                // try again soon. The daemon only stops on a signal.
                Err(e) => {
                    tracing::error!(error = %error_chain(e.as_ref()), "resync failed; retrying");
                    pending = Some(now + RETRY);
                }
            }
        }
    }
    remove_ready_file(&args.ready_file)?;
    if args.keep_bound_on_exit {
        tracing::info!("leaving devices bound (--keep-bound-on-exit)");
        return Ok(ExitCode::SUCCESS);
    }
    let ok = report::print_restore(&pt.restore(&[]), false);
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn remove_ready_file(path: &std::path::Path) -> anyhow::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(anyhow::anyhow!(
            "failed to remove ready file {}: {e}",
            path.display()
        )),
    }
}

/// One pass: rescan, bind what is not bound, keep the ready file true. Returns whether
/// every readable selected device and companion is on its driver; `was` is the
/// previous answer. A device that cannot be read is left out (its group with it) and
/// logged once; the validator names it too.
fn converge(
    pt: &mut Passthrough<'_>,
    list: &vfio_sandbox::config::ResourceList,
    args: &Args,
    was: bool,
    skip_log: &mut SkipLog,
) -> anyhow::Result<bool> {
    let inv = Inventory::scan(pt.host, list)?;
    for s in skip_log.note(&inv.skipped).new {
        tracing::warn!(bdf = %s.address, reason = %s, "device left out: it cannot be read");
    }
    let needs_work = inv.entries.iter().any(|e| !e.is_bound());
    if needs_work {
        pt.load_modules(&target_drivers(&inv, &[]))?;
        let bind = pt.bind(&inv, &[]);
        for e in &bind.failed {
            tracing::error!(error = %error_chain(e), "bind failed; will retry");
        }
    }
    let inv = if needs_work {
        Inventory::scan(pt.host, list)?
    } else {
        inv
    };
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
            "time": unix_now(),
        });
        write_atomic(&args.ready_file, format!("{doc}\n").as_bytes())?;
        if !was {
            tracing::info!(file = %args.ready_file.display(), devices = devices.len(), "every selected device is bound; wrote ready file");
        }
    } else {
        remove_ready_file(&args.ready_file)?;
        if was {
            tracing::warn!(file = %args.ready_file.display(), "a selected device is not bound; removed ready file");
        }
    }
    Ok(converged)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
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

/// Waits for a signal, a PCI uevent, or the timeout.
fn wait(
    signals: &SignalFd,
    uevents: Option<&OwnedFd>,
    timeout: Duration,
) -> anyhow::Result<(Option<Signal>, bool)> {
    let mut fds = vec![PollFd::new(signals.as_fd(), PollFlags::POLLIN)];
    if let Some(u) = uevents {
        fds.push(PollFd::new(u.as_fd(), PollFlags::POLLIN));
    }
    let ms = i32::try_from(timeout.as_millis())
        .unwrap_or(i32::MAX)
        .max(1);
    match poll(
        &mut fds,
        PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
    ) {
        Ok(_) => {}
        Err(nix::errno::Errno::EINTR) => return Ok((None, false)),
        Err(e) => return Err(e.into()),
    }
    let signal = match signals.read_signal() {
        Ok(Some(info)) => Signal::try_from(info.ssi_signo as i32).ok(),
        _ => None,
    };
    let uevent = uevents.is_some_and(|u| vfio_sandbox::uevent::drain(u.as_fd()));
    Ok((signal, uevent))
}
