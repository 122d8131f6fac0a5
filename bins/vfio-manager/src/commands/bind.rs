//! `vfio-manager bind`: move selected devices and their companions to vfio.

use std::process::ExitCode;

use vfio_sandbox::inventory::Inventory;
use vfio_sandbox::passthrough::target_drivers;

use super::{groups_for, with_passthrough, ChangeArgs};
use crate::{report, Context};

/// Runs `bind`.
pub fn run(ctx: &Context, args: &ChangeArgs) -> anyhow::Result<ExitCode> {
    let list = ctx.common.resource_list()?;
    let inv = Inventory::scan(&ctx.host, &list)?;
    let groups = groups_for(ctx, &inv, &args.which)?;
    if inv.entries.is_empty() {
        tracing::warn!(config = %super::config_source(ctx), "no devices selected by the resource list; nothing to bind");
        return Ok(ExitCode::SUCCESS);
    }
    let ok = with_passthrough(ctx, args.dry_run, |pt| {
        pt.load_modules(&target_drivers(&inv, &groups))?;
        Ok(report::print_bind(&pt.bind(&inv, &groups), args.dry_run))
    })?;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
