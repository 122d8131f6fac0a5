//! One module per subcommand.

pub mod bind;
pub mod ready;
pub mod run;
pub mod status;
pub mod unbind;

use std::path::Path;

use vfio_sandbox::inventory::{Inventory, Role};
use vfio_sandbox::kernel::{DryRun, Kernel, SysKernel};
use vfio_sandbox::module::kernel_release;
use vfio_sandbox::passthrough::Passthrough;
use vfio_sandbox::state::StateFile;
use vfio_sandbox::{PciAddress, PciDevice};

use crate::{Context, UsageError};

/// Device selection shared by `bind` and `unbind`.
#[derive(Debug, Clone, clap::Args)]
#[group(required = true, multiple = false)]
pub struct Which {
    /// Every selected device.
    #[arg(long)]
    pub all: bool,
    /// Only these devices (repeatable; dddd:bb:ss.f).
    #[arg(long = "device", value_name = "BDF")]
    pub devices: Vec<PciAddress>,
}

/// Flags of the commands that change the node (`bind`, `unbind`).
#[derive(Debug, Clone, clap::Args)]
pub struct ChangeArgs {
    #[command(flatten)]
    pub which: Which,
    /// Print every sysfs write and module load it would make; change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// Runs `f` on the real kernel with the state file locked, or on a dry run that
/// prints each change and keeps the state in memory.
pub fn with_passthrough<T>(
    ctx: &Context,
    dry_run: bool,
    f: impl FnOnce(&mut Passthrough<'_>) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let dry = DryRun::new();
    let kernel: &dyn Kernel = if dry_run { &dry } else { &SysKernel };
    let mut state = ctx.state(!dry_run)?;
    f(&mut Passthrough {
        host: &ctx.host,
        kernel,
        state: &mut state,
        release: kernel_release(),
    })
}

/// The IOMMU groups holding the asked devices; empty means all. Unknown or unselected
/// addresses are usage errors naming the device.
pub fn groups_for(ctx: &Context, inv: &Inventory, which: &Which) -> anyhow::Result<Vec<u32>> {
    let mut groups = Vec::new();
    for addr in &which.devices {
        if let Some(skipped) = inv.skipped(addr) {
            anyhow::bail!("--device {addr} cannot be bound: {skipped}");
        }
        let Some(entry) = inv.get(addr) else {
            let dev = PciDevice::read(&ctx.host, addr).map_err(|e| {
                UsageError(format!(
                    "--device {addr}: {}",
                    vfio_sandbox::error_chain(&e)
                ))
            })?;
            return Err(UsageError(format!(
                "--device {addr} ({:04x}:{:04x}) is not selected by the resource list ({}); \
                 `vfio-manager status` lists what is",
                dev.vendor,
                dev.device,
                config_source(ctx)
            ))
            .into());
        };
        if matches!(entry.role, Role::Bridge) {
            return Err(UsageError(format!(
                "--device {addr} is a PCI bridge; bridges are never rebound"
            ))
            .into());
        }
        // A device without a group: the IOMMU is off; say so (exit 1, nothing touched).
        vfio_sandbox::driver::check_bindable(&ctx.host, &entry.device)?;
        groups.extend(entry.device.iommu_group);
    }
    groups.sort_unstable();
    groups.dedup();
    Ok(groups)
}

/// Refuses to move devices while sandbox-dra-driver holds any on this node.
///
/// The two must not share a node: each moves devices on its own and restores what
/// its own state file records, so one would take devices from under the other's
/// claims or VMs. sandbox-dra-driver checks vfio-manager's state file the same way
/// when it starts. A DRA state file listing claims or devices is a usage error
/// (exit 2); one that cannot be read fails too, since it cannot be shown to be free.
pub fn check_no_dra_driver(path: &Path) -> anyhow::Result<()> {
    let state = StateFile::load(path, false).map_err(|e| {
        anyhow::anyhow!(
            "cannot tell whether sandbox-dra-driver holds devices on this node: {}; not binding",
            vfio_sandbox::error_chain(&e)
        )
    })?;
    let state = state.state();
    if state.claims.is_empty() && state.devices.is_empty() {
        return Ok(());
    }
    let mut held = Vec::new();
    if !state.claims.is_empty() {
        let claims: Vec<String> = state
            .claims
            .iter()
            .map(|(uid, c)| format!("{}/{} ({uid})", c.namespace, c.name))
            .collect();
        held.push(format!("{} claim(s): {}", claims.len(), first_ten(&claims)));
    }
    if !state.devices.is_empty() {
        let devices: Vec<String> = state.devices.keys().map(ToString::to_string).collect();
        held.push(format!(
            "{} device(s): {}",
            devices.len(),
            first_ten(&devices)
        ));
    }
    Err(UsageError(format!(
        "sandbox-dra-driver holds {} on this node (per {}): a node runs either vfio-manager \
         (the whole node in VM mode) or sandbox-dra-driver (devices per claim), not both; \
         not binding. Take the node out of sandbox-dra-driver's DaemonSet and let it give \
         the devices back (its claims released) before running vfio-manager here",
        held.join(" and "),
        path.display()
    ))
    .into())
}

/// Up to ten items, then a count.
fn first_ten(items: &[String]) -> String {
    match items.len() {
        0..=10 => items.join(", "),
        n => format!("{}, and {} more", items[..10].join(", "), n - 10),
    }
}

/// Where the resource list came from, for messages.
pub fn config_source(ctx: &Context) -> String {
    match &ctx.common.config {
        Some(p) => p.display().to_string(),
        None => "built-in rebellions preset".into(),
    }
}
