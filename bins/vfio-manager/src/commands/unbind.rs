//! `vfio-manager unbind`: put back what the state file records.
//!
//! It needs no resource list: a broken ConfigMap must never stop a node from leaving
//! VM mode.

use std::process::ExitCode;

use vfio_sandbox::kernel::{DryRun, Kernel, SysKernel};
use vfio_sandbox::module::kernel_release;
use vfio_sandbox::passthrough::Passthrough;

use super::Which;
use crate::{report, Context};

/// Flags of `unbind`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    which: Which,
    /// Print every sysfs write and module load it would make; change nothing.
    #[arg(long)]
    dry_run: bool,
}

/// Runs `unbind`.
pub fn run(ctx: &Context, args: &Args) -> anyhow::Result<ExitCode> {
    let dry = DryRun::new();
    let kernel: &dyn Kernel = if args.dry_run { &dry } else { &SysKernel };
    let mut state = ctx.state(!args.dry_run)?;
    for addr in &args.which.devices {
        if !state.state().devices.contains_key(addr) {
            println!(
                "{addr} is not in {}; nothing to restore",
                state.path().display()
            );
        }
    }
    if state.state().devices.is_empty() {
        println!(
            "nothing recorded in {}; no device to restore",
            state.path().display()
        );
    }
    let mut pt = Passthrough {
        host: &ctx.host,
        kernel,
        state: &mut state,
        release: kernel_release(),
    };
    let ok = report::print_restore(&pt.restore(&args.which.devices), args.dry_run);
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
