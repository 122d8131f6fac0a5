//! `vfio-manager unbind`: put back what the state file records.
//!
//! The validator's ready file goes first: the node is leaving VM mode.
//! It needs no resource list: a broken ConfigMap must never stop a node from leaving
//! VM mode.

use std::process::ExitCode;

use super::{with_passthrough, ChangeArgs};
use crate::{report, Context};

/// Runs `unbind`.
pub fn run(ctx: &Context, args: &ChangeArgs) -> anyhow::Result<ExitCode> {
    let ok = with_passthrough(ctx, args.dry_run, |pt| {
        let (recorded, path) = (&pt.state.state().devices, pt.state.path().display());
        for addr in args
            .which
            .devices
            .iter()
            .filter(|a| !recorded.contains_key(a))
        {
            support::outln!("{addr} is not in {path}; nothing to restore");
        }
        if recorded.is_empty() {
            support::outln!("nothing recorded in {path}; no device to restore");
        } else if !args.dry_run {
            // Devices leave vfio: the validator's verdict on the node no longer holds.
            super::run::clear_validator_ready_file(ctx);
        }
        Ok(report::print_restore(
            &pt.restore_concurrent(&args.which.devices, ctx.bind_jobs),
            args.dry_run,
            &report::HELD_BY_UNBIND,
        ))
    })?;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
