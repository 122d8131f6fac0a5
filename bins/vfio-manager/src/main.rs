//! `vfio-manager`: moves the selected PCI devices (and their IOMMU-group companions)
//! from their native driver to vfio-pci, keeps them there, and puts them back.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use node_agent::cli::{CommonArgs, WriteArgs, EXIT_NOT_READY, EXIT_USAGE};
use node_agent::ready::DEFAULT_STATUS_DIR;
use passthrough::owner::{Contender, Owner, OwnerError, DEFAULT_OWNER_LOCK};
use passthrough::state::StateFile;
use passthrough::DEFAULT_BIND_JOBS;
use programs::{DRA_DRIVER, DRA_DRIVER_STATE_FILE, READY_FILE, STATE_FILE, VFIO_MANAGER};
use sysfs_pci::host::DEFAULT_MODULES_ROOT;
use sysfs_pci::Host;

mod api_thread;
mod commands;
mod metrics;
mod programs;
mod report;
mod restore_label;

const LONG_ABOUT: &str = "\
Moves the PCI devices selected by the resource list (and every other member of their
IOMMU groups) from their native driver to vfio-pci, so whole devices can be handed to
virtual machines, and puts them back when the node leaves VM mode.

Every change is recorded in the state file before it is made, so `unbind` restores the
original drivers even after a crash. Devices a running VM holds are never unbound.

A node runs either vfio-manager (the whole node in VM mode) or sandbox-dra-driver
(devices moved per ResourceClaim), not both: `bind`, `unbind` and `run` take the
node-wide owner lock (--owner-lock) before they move a device and hold it while they
work (`run`: for its life). They refuse (exit 2), naming the owner, while the DRA driver
holds it or still holds devices it moved.

In a cluster, `run` keeps the devices bound across a rollout: on SIGTERM it asks the API
server (NODE_NAME, POD_NAME, POD_NAMESPACE and the pod's service account) whether its
DaemonSet still selects this node, and restores only when it does not (label removed or
flipped, DaemonSet deleted) or when that cannot be shown. `ready` is its readiness probe.

Exit codes: 0 the node is in the asked state, 1 it is not (see the messages),
2 bad usage or bad configuration (nothing was touched).";

/// Command line.
#[derive(Debug, Parser)]
#[command(name = "vfio-manager", version, about = "Bind selected PCI devices to \
    vfio-pci for VM passthrough, and restore them", long_about = LONG_ABOUT)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    manager: ManagerArgs,
    #[command(subcommand)]
    command: Command,
}

/// Flags of vfio-manager itself.
#[derive(Debug, Clone, clap::Args)]
struct ManagerArgs {
    /// Kernel modules tree holding <release>/modules.dep (modules are loaded without modprobe).
    #[arg(long, env = "VFIO_MANAGER_MODULES_ROOT", global = true, default_value = DEFAULT_MODULES_ROOT, value_name = "DIR")]
    modules_root: PathBuf,
    /// Where vfio-manager records what it changed (keep it on /run: it must vanish on reboot).
    #[arg(long, env = "VFIO_MANAGER_STATE_FILE", global = true, default_value = STATE_FILE, value_name = "FILE")]
    state_file: PathBuf,
    /// `run`'s ready file: written (JSON) once every selected device is bound, removed
    /// otherwise and on exit; `ready` checks it.
    #[arg(long, env = "VFIO_MANAGER_READY_FILE", global = true, default_value = READY_FILE, value_name = "FILE")]
    ready_file: PathBuf,
    /// The validator's status directory: its ready file (vfio-pci-ready) is removed
    /// before devices are restored, since the node is no longer ready for VMs.
    #[arg(long, env = "VFIO_SANDBOX_STATUS_DIR", global = true, default_value = DEFAULT_STATUS_DIR, value_name = "DIR")]
    validator_status_dir: PathBuf,
    /// The node-wide owner lock, shared with sandbox-dra-driver: `bind`, `unbind` and
    /// `run` take it before they move a device (a node runs vfio-manager or
    /// sandbox-dra-driver, not both). It records the owner and how many devices it
    /// holds; created with its directory if absent.
    #[arg(long, env = "VFIO_SANDBOX_OWNER_LOCK", global = true, default_value = DEFAULT_OWNER_LOCK, value_name = "FILE")]
    owner_lock: PathBuf,
    /// sandbox-dra-driver's state file, read (never written) when the owner lock is
    /// taken: while it records a device moved for a claim, or cannot be read, the
    /// node is not vfio-manager's, whatever the lock's record says (a deleted or
    /// garbled record does not free a node). Mount its directory read-only.
    #[arg(long, env = "VFIO_SANDBOX_DRA_STATE_FILE", global = true, default_value = DRA_DRIVER_STATE_FILE, value_name = "FILE")]
    dra_state_file: PathBuf,
    /// How many IOMMU groups `bind`, `unbind` and `run` move at once, to vfio and back.
    /// A native driver's unbind and vfio-pci's probe can each take a second on a GPU,
    /// so with several jobs entering and leaving VM mode take about the slowest
    /// group's time, not the sum. Each group stays all-or-nothing, every device is
    /// recorded before it is touched and its record dropped only once it is back.
    /// 1 moves one group after another; a dry run always does.
    #[arg(long, env = "VFIO_MANAGER_BIND_JOBS", global = true, default_value_t = DEFAULT_BIND_JOBS, value_name = "N")]
    bind_jobs: NonZeroUsize,
    #[command(flatten)]
    write: WriteArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show selected devices and their group companions: ids, resource, driver, group viability.
    Status(commands::status::Args),
    /// Bind selected devices and their group companions to their vfio driver.
    Bind(commands::ChangeArgs),
    /// Restore what the state file records: original drivers back, overrides cleared.
    Unbind(commands::ChangeArgs),
    /// DaemonSet main: load modules, bind all, keep the node converged, restore on SIGTERM.
    Run(commands::run::Args),
    /// Readiness probe: exit 0 only when `run` has bound every selected device and they
    /// are still bound (checks the ready file and the devices it lists).
    Ready,
    /// Pre-delete hook: delete vfio-manager's DaemonSet in the foreground and wait until
    /// its pods have restored their nodes and are gone (while their account still works).
    Uninstall(commands::uninstall::Args),
}

/// What the commands share.
pub struct Context {
    /// The node's roots.
    pub host: Host,
    /// Common flags.
    pub common: CommonArgs,
    /// The state file path.
    pub state_file: PathBuf,
    /// `run`'s ready file.
    pub ready_file: PathBuf,
    /// The validator's status directory.
    pub validator_status_dir: PathBuf,
    /// The node-wide owner lock.
    pub owner_lock: PathBuf,
    /// sandbox-dra-driver's state file (read when taking the lock).
    pub dra_state_file: PathBuf,
    /// IOMMU groups bound at once.
    pub bind_jobs: NonZeroUsize,
    /// The deadline of each sysfs write.
    pub write: WriteArgs,
}

impl Context {
    /// Opens the state file; a dry run keeps changes in memory.
    pub fn state(&self, persist: bool) -> anyhow::Result<StateFile> {
        Ok(StateFile::load(&self.state_file, persist, &VFIO_MANAGER)?)
    }

    /// Takes the node's owner lock, or says who owns the node.
    pub fn take_owner(&self) -> Result<Owner, OwnerError> {
        Owner::take(&self.owner_lock, &self.contender())
    }

    /// vfio-manager asking for the node, with sandbox-dra-driver as its rival.
    pub fn contender(&self) -> Contender {
        Contender::new(&VFIO_MANAGER, &DRA_DRIVER, self.dra_state_file.clone())
    }

    /// The state file locked, with the node's owner lock taken first and kept
    /// (with its device count current) until the state is dropped.
    pub fn owned_state(&self, owner: Owner) -> anyhow::Result<StateFile> {
        let mut state = self.state(true)?;
        state.attach_owner(owner)?;
        Ok(state)
    }
}

/// Bad usage or bad configuration: exit 2, nothing touched.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

fn main() -> ExitCode {
    // Test variant only: stop at the steps named in FAILPOINTS (support::failpoint).
    #[cfg(feature = "failpoints")]
    let _failpoints = {
        let scenario = fail::FailScenario::setup();
        support::failpoint::install(|step| {
            fail::fail_point!(step, |_| true);
            false
        });
        scenario
    };
    let cli = Cli::parse();
    cli.common.init_logging();
    let mut host = cli.common.host();
    host.modules = cli.manager.modules_root.clone();
    let ctx = Context {
        host,
        common: cli.common,
        state_file: cli.manager.state_file,
        ready_file: cli.manager.ready_file,
        validator_status_dir: cli.manager.validator_status_dir,
        owner_lock: cli.manager.owner_lock,
        dra_state_file: cli.manager.dra_state_file,
        bind_jobs: cli.manager.bind_jobs,
        write: cli.manager.write,
    };
    let result = match cli.command {
        Command::Status(args) => commands::status::run(&ctx, &args),
        Command::Bind(args) => commands::bind::run(&ctx, &args),
        Command::Unbind(args) => commands::unbind::run(&ctx, &args),
        Command::Run(args) => commands::run::run(&ctx, &args),
        Command::Ready => commands::ready::run(&ctx),
        Command::Uninstall(args) => commands::uninstall::run(&ctx, &args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            let usage = err.downcast_ref::<UsageError>().is_some()
                || err
                    .downcast_ref::<OwnerError>()
                    .is_some_and(OwnerError::by_other_program)
                || err
                    .downcast_ref::<passthrough::config::ConfigError>()
                    .is_some();
            let code = if usage { EXIT_USAGE } else { EXIT_NOT_READY };
            node_agent::cli::fail("vfio-manager", err.as_ref(), code)
        }
    }
}
