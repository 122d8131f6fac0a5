//! One module per subcommand.

pub mod bind;
pub mod ready;
pub mod run;
pub mod status;
pub mod unbind;
pub mod uninstall;

use passthrough::inventory::{Inventory, Role};
use passthrough::owner::Owner;
use passthrough::Passthrough;
use sysfs_pci::kernel::{DryRun, Kernel};
use sysfs_pci::module::kernel_release;
use sysfs_pci::{PciAddress, PciDevice};

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

/// Runs `f` on the real kernel holding the node's owner lock and the state file's,
/// or on a dry run that prints each change and keeps the state in memory. Either
/// way it is refused first while sandbox-dra-driver owns the node: a dry run shows
/// what a run would do, and this run would do nothing.
pub fn with_passthrough<T>(
    ctx: &Context,
    dry_run: bool,
    f: impl FnOnce(&mut Passthrough<'_>) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let dry = DryRun::new();
    let real = ctx.write.kernel();
    let kernel: &dyn Kernel = if dry_run { &dry } else { &real };
    let mut state = if dry_run {
        Owner::check(&ctx.owner_lock, &ctx.contender())?;
        ctx.state(false)?
    } else {
        ctx.owned_state(ctx.take_owner()?)?
    };
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
                UsageError(format!("--device {addr}: {}", support::error_chain(&e)))
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
        sysfs_pci::bind::check_bindable(&ctx.host, &entry.device)?;
        groups.extend(entry.device.iommu_group);
    }
    groups.sort_unstable();
    groups.dedup();
    Ok(groups)
}

/// Where the resource list came from, for messages.
pub fn config_source(ctx: &Context) -> String {
    match &ctx.common.config {
        Some(p) => p.display().to_string(),
        None => "built-in rebellions preset".into(),
    }
}
