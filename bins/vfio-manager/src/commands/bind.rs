//! `vfio-manager bind`: move selected devices and their companions to vfio.

use std::process::ExitCode;

use vfio_sandbox::inventory::Inventory;
use vfio_sandbox::kernel::{DryRun, Kernel, SysKernel};
use vfio_sandbox::module::kernel_release;
use vfio_sandbox::passthrough::Passthrough;

use super::{groups_for, Which};
use crate::{report, Context};

/// Flags of `bind`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    which: Which,
    /// Print every sysfs write and module load it would make; change nothing.
    #[arg(long)]
    dry_run: bool,
}

/// Runs `bind`.
pub fn run(ctx: &Context, args: &Args) -> anyhow::Result<ExitCode> {
    let list = ctx.common.resource_list()?;
    let inv = Inventory::scan(&ctx.host, &list)?;
    let groups = groups_for(ctx, &inv, &args.which)?;
    if inv.entries.is_empty() {
        tracing::warn!(config = %super::config_source(ctx), "no devices selected by the resource list; nothing to bind");
        return Ok(ExitCode::SUCCESS);
    }
    let dry = DryRun::new();
    let kernel: &dyn Kernel = if args.dry_run { &dry } else { &SysKernel };
    let mut state = ctx.state(!args.dry_run)?;
    let mut pt = Passthrough {
        host: &ctx.host,
        kernel,
        state: &mut state,
        release: kernel_release(),
    };
    let drivers = target_drivers(&inv, &groups);
    pt.load_modules(&drivers)?;
    let ok = report::print_bind(&pt.bind(&inv, &groups), args.dry_run);
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The drivers the asked groups will be moved to.
pub fn target_drivers(inv: &Inventory, groups: &[u32]) -> Vec<String> {
    let mut drivers: Vec<String> = inv
        .entries
        .iter()
        .filter(|e| groups.is_empty() || e.device.iommu_group.is_some_and(|g| groups.contains(&g)))
        .map(|e| e.target_driver.clone())
        .filter(|d| vfio_sandbox::group::is_vfio_driver(d))
        .collect();
    drivers.sort();
    drivers.dedup();
    drivers
}
