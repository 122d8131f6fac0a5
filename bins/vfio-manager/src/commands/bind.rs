//! `vfio-manager bind`: move selected devices and their companions to vfio.

use std::process::ExitCode;

use passthrough::inventory::Inventory;

use super::{groups_for, with_passthrough, ChangeArgs};
use crate::{report, Context};

/// Runs `bind`.
pub fn run(ctx: &Context, args: &ChangeArgs) -> anyhow::Result<ExitCode> {
    let list = ctx.common.resource_list()?;
    let inv = Inventory::scan(&ctx.host, &list)?;
    let groups = groups_for(ctx, &inv, &args.which)?;
    // With --all, a device the scan had to skip (and its group) is not bound: say so,
    // bind the rest, exit 1. An asked device that was skipped failed in groups_for.
    let skipped_ok = !args.which.all || inv.skipped.is_empty();
    if args.which.all {
        for s in &inv.skipped {
            support::errln!("vfio-manager: error: not binding {s}");
        }
    }
    if inv.entries.is_empty() {
        tracing::warn!(config = %super::config_source(ctx), "no devices selected by \
            the resource list; nothing to bind");
        return Ok(exit_code(skipped_ok));
    }
    print_driver_choices(&inv, &groups, args.dry_run);
    let ok = with_passthrough(ctx, args.dry_run, |pt| {
        let report = pt.move_to_vfio(&inv, &groups, ctx.bind_jobs)?;
        Ok(report::print_bind(&report, args.dry_run))
    })?;
    Ok(exit_code(ok && skipped_ok))
}

/// Says which driver `"driver": "auto"` chose for each device that will move, and
/// why: on stdout for a dry run, in the log otherwise.
fn print_driver_choices(inv: &Inventory, groups: &[u32], dry_run: bool) {
    let moving = inv
        .entries
        .iter()
        .filter(|e| groups.is_empty() || e.device.iommu_group.is_some_and(|g| groups.contains(&g)));
    for entry in moving {
        let Some(choice) = &entry.driver_choice else {
            continue;
        };
        if dry_run {
            support::outln!("driver for {}: {choice}", entry.device.address);
        } else {
            tracing::info!(bdf = %entry.device.address, choice = %choice, "driver auto");
        }
    }
}

fn exit_code(ok: bool) -> ExitCode {
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
