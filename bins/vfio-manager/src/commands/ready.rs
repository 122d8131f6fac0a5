//! `vfio-manager ready`: the readiness probe. Exit 0 only when `run` has bound every
//! selected device (its ready file exists) and each device the file lists is still
//! on its vfio driver now.

use std::process::ExitCode;

use node_agent::cli::EXIT_NOT_READY;
use passthrough::inventory::Inventory;
use support::io::{read_small_file, SmallFileError};
use sysfs_pci::PciAddress;

use crate::Context;

/// The ready file is small JSON; anything bigger is not ours.
const MAX_READY_FILE: u64 = 1 << 20;

/// Runs `ready`.
pub fn run(ctx: &Context) -> anyhow::Result<ExitCode> {
    let path = &ctx.ready_file;
    let not_ready = |why: String| {
        support::outln!("not ready: {why}");
        Ok(ExitCode::from(EXIT_NOT_READY))
    };
    let text = match read_small_file(path, MAX_READY_FILE) {
        Ok(t) => t,
        Err(SmallFileError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            return not_ready(format!(
                "{} does not exist (vfio-manager run writes it once every selected \
                    device is bound){}",
                path.display(),
                stuck_note(path)
            ))
        }
        Err(e) => return not_ready(format!("cannot read {}: {e}", path.display())),
    };
    let listed: Vec<PciAddress> = match serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|doc| {
            doc.get("devices")?
                .as_array()?
                .iter()
                .map(|d| d.as_str()?.parse().ok())
                .collect::<Option<Vec<_>>>()
        }) {
        Some(l) => l,
        None => {
            return not_ready(format!(
                "{} is not a ready file (no devices list)",
                path.display()
            ))
        }
    };
    let list = ctx.common.resource_list()?;
    let inv = Inventory::scan(&ctx.host, &list)?;
    for addr in &listed {
        match inv.get(addr) {
            None => return not_ready(format!("{addr} (listed in {}) is gone", path.display())),
            Some(e) if !e.is_bound() => {
                return not_ready(format!(
                    "{addr} is on {}, not {}",
                    e.device.driver.as_deref().unwrap_or("no driver"),
                    e.target_driver
                ))
            }
            Some(_) => {}
        }
    }
    if let Some(e) = inv.entries.iter().find(|e| !e.is_bound()) {
        return not_ready(format!(
            "{} is on {}, not {}",
            e.device.address,
            e.device.driver.as_deref().unwrap_or("no driver"),
            e.target_driver
        ));
    }
    support::outln!(
        "ready: {} device(s) bound ({})",
        listed.len(),
        path.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// What `run` says is stuck (see `run::stuck_file`), as a sentence to add, or nothing.
fn stuck_note(ready_file: &std::path::Path) -> String {
    let file = super::run::stuck_file(ready_file);
    let lines: Vec<String> = read_small_file(&file, MAX_READY_FILE)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|doc| {
            doc.get("stuck")?
                .as_array()?
                .iter()
                .map(|l| l.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    if lines.is_empty() {
        String::new()
    } else {
        format!("; stuck: {}", lines.join("; "))
    }
}
