//! Whole-group binding and restoring, with the state file kept true at every step.
//!
//! A bind works group by group: check every member first, record each in the state
//! file before touching it, move it, and on any failure put the members moved so far
//! back, so a group is never left half-done. Independent groups can be bound on
//! several threads at once ([`Passthrough::bind_concurrent`]), sharing the state file
//! under a lock (`engine/binder.rs`). A restore skips a group
//! whose `/dev/vfio/<group>` a VM holds open (unbinding would block in the kernel
//! until the VM lets go) and keeps its records for later.
//!
//! The invariants, enforced here and in [`crate::state::StateFile`]:
//! - *A record that existed before an operation is never replaced by a later snapshot
//!   and never forgotten except after a confirmed restore.* Rollback restores a device
//!   to its **record** (the driver it had before vfio-manager first touched it), never
//!   to the snapshot taken at the start of the failed operation, which may already be
//!   our own doing (a pinned override, a native module we unloaded, a crash half-way).
//! - *Memory never claims more than the disk holds* (see `StateFile`).
//! - *Every partially-applied group operation is rolled back*, a failed state save
//!   included, and the error names the devices put back and any that could not be.
//!
//! `lib/passthrough/tests/faults.rs` fails and crashes the process at every kernel write, module
//! syscall and state save of a node's whole life in turn and checks these hold, with
//! groups bound one at a time and several at once.

use std::collections::BTreeSet;
use std::num::NonZeroUsize;
use std::sync::Mutex;

mod binder;

use binder::Binder;

use crate::inventory::{Entry, Inventory, Role, COMPANION_DRIVER};
use crate::state::{NoRecords, Record, Records, StateError, StateFile};
use support::error_chain;
use sysfs_pci::bind::{self, DriverError};
use sysfs_pci::group::STUB_DRIVER;
use sysfs_pci::kernel::Kernel;
use sysfs_pci::module::{self, ModuleError};
use sysfs_pci::vfio_driver::is_vfio_driver;
use sysfs_pci::{Host, PciAddress};

/// The modules a node needs for passthrough besides the drivers' own.
pub const VFIO_MODULES: [&str; 3] = ["vfio", "vfio_iommu_type1", "vfio_pci"];

/// The step of a group operation that failed first.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// Moving a device failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// Recording it in the state file failed.
    #[error(transparent)]
    State(#[from] StateError),
}

/// A failure of one group (or one module), with what was done about it.
#[derive(Debug, thiserror::Error)]
pub enum PassthroughError {
    /// A group could not be bound; every member moved was put back.
    #[error("IOMMU group {group} not bound{}", put_back_note(put_back))]
    #[allow(missing_docs)]
    Group {
        group: u32,
        /// Members put back to their recorded driver.
        put_back: Vec<PciAddress>,
        /// The first failure.
        #[source]
        source: Box<StepError>,
    },
    /// A selected device has no IOMMU group.
    #[error(transparent)]
    NoGroup(DriverError),
    /// A group could not be bound and putting some members back failed too.
    #[error(
        "IOMMU group {group} is half-bound{}; could not put back {}; their records are kept for \
         the next restore",
        put_back_note(put_back),
        stuck_note(stuck)
    )]
    #[allow(missing_docs)]
    RollbackFailed {
        group: u32,
        /// Members put back.
        put_back: Vec<PciAddress>,
        /// Members that could not be put back, with why.
        stuck: Vec<(PciAddress, String)>,
        /// The original failure.
        #[source]
        source: Box<StepError>,
    },
    /// A group could not be bound; every member moved is back on its driver, but
    /// the records of some could not be dropped (the state file could not be
    /// saved). They are kept; the next restore finds them on their drivers and
    /// drops them.
    #[error(
        "IOMMU group {group} not bound{}; every member is back on its driver, but the state \
         file still records {} (kept until the next restore drops them)",
        put_back_note(put_back),
        stuck_note(kept)
    )]
    #[allow(missing_docs)]
    RecordsKept {
        group: u32,
        /// Members put back (all of them).
        put_back: Vec<PciAddress>,
        /// Members whose record could not be dropped, with why.
        kept: Vec<(PciAddress, String)>,
        /// The original failure.
        #[source]
        source: Box<StepError>,
    },
    /// A module could not be loaded or unloaded.
    #[error(transparent)]
    Module(#[from] ModuleError),
    /// The state file could not be written: stop before touching more.
    #[error(transparent)]
    State(#[from] StateError),
    /// Whether a VM holds a group could not be told (its node could not be
    /// opened for a reason other than `EBUSY`): its members stay on their vfio
    /// driver, recorded, as if a VM held it.
    #[error(
        "IOMMU group {group} not restored: cannot tell whether a VM holds it, so {} stay on \
         their vfio driver",
        members.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    )]
    #[allow(missing_docs)]
    GroupUnprobed {
        group: u32,
        /// Its recorded members.
        members: Vec<PciAddress>,
        /// Why its node could not be probed.
        #[source]
        source: support::io::IoError,
    },
    /// Restoring a device failed.
    #[error("cannot restore {address}")]
    #[allow(missing_docs)]
    Restore {
        /// The device.
        address: PciAddress,
        #[source]
        source: DriverError,
    },
}

impl PassthroughError {
    /// This failure left devices off their driver with their records kept (a
    /// rollback that failed): the caller says when its next restore comes.
    pub fn left_half_bound(&self) -> bool {
        matches!(self, Self::RollbackFailed { .. })
    }
}

fn put_back_note(put_back: &[PciAddress]) -> String {
    if put_back.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = put_back.iter().map(|a| a.to_string()).collect();
        format!(" (put back {})", list.join(", "))
    }
}

fn stuck_note(stuck: &[(PciAddress, String)]) -> String {
    let list: Vec<String> = stuck
        .iter()
        .map(|(a, why)| format!("{a} ({why})"))
        .collect();
    list.join(", ")
}

/// The outcome of a bind.
#[derive(Debug, Default)]
pub struct BindReport {
    /// Devices moved, with the driver they left.
    pub bound: Vec<(PciAddress, Option<String>)>,
    /// Devices that were already where they belong.
    pub already: Vec<PciAddress>,
    /// Failures; their groups were put back to their records.
    pub failed: Vec<PassthroughError>,
}

/// The outcome of a restore.
#[derive(Debug, Default)]
pub struct RestoreReport {
    /// Devices put back, with the driver they are on now.
    pub restored: Vec<(PciAddress, Option<String>)>,
    /// Devices skipped because a VM holds their group, with the group.
    pub in_use: Vec<(PciAddress, u32)>,
    /// Devices in the record that no longer exist (record dropped).
    pub gone: Vec<PciAddress>,
    /// Modules reloaded.
    pub reloaded: Vec<String>,
    /// Failures (their records are kept).
    pub failed: Vec<PassthroughError>,
}

/// Binds and restores devices on one node.
pub struct Passthrough<'a, O: Records = NoRecords> {
    /// The node's roots.
    pub host: &'a Host,
    /// Where changes go.
    pub kernel: &'a dyn Kernel,
    /// The record of changes.
    pub state: &'a mut StateFile<O>,
    /// The running kernel's release, for `modules.dep`.
    pub release: String,
}

/// One member of a group that has to move.
struct Move<'e> {
    entry: &'e Entry,
    driver: String,
}

/// How many IOMMU groups `vfio-manager` moves at once unless told otherwise.
///
/// A group's time is almost all waiting: the native driver's remove and vfio-pci's
/// probe sleep on the device (a GPU's take up to a second each), so threads cost next
/// to no CPU. Eight covers the common accelerator server (8 GPUs or NPUs) in one
/// device's time, while a node with hundreds of groups (SR-IOV VFs) still runs a
/// handful of threads and resets at most eight devices on the PCIe fabric at once.
pub const DEFAULT_BIND_JOBS: NonZeroUsize = match NonZeroUsize::new(8) {
    Some(n) => n,
    None => NonZeroUsize::MIN,
};

/// The vfio drivers the asked groups (all when empty) will be moved to.
pub fn target_drivers(inv: &Inventory, groups: &[u32]) -> Vec<String> {
    let mut drivers: Vec<String> = inv
        .entries
        .iter()
        .filter(|e| groups.is_empty() || e.device.iommu_group.is_some_and(|g| groups.contains(&g)))
        .map(|e| e.target_driver.clone())
        .filter(|d| is_vfio_driver(d))
        .collect();
    drivers.sort();
    drivers.dedup();
    drivers
}

impl<O: Records> Passthrough<'_, O> {
    /// Loads the vfio modules and every driver module `drivers` names, skipping
    /// those already loaded or built in. Returns the modules loaded.
    pub fn load_modules(&self, drivers: &[String]) -> Result<Vec<String>, ModuleError> {
        let mut loaded = Vec::new();
        let mut wanted: Vec<String> = VFIO_MODULES.iter().map(|m| m.to_string()).collect();
        wanted.extend(drivers.iter().map(|d| module::canonical_name(d)));
        wanted.push(module::canonical_name(COMPANION_DRIVER));
        let mut seen = BTreeSet::new();
        for m in wanted {
            if !seen.insert(m.clone()) {
                continue;
            }
            // A driver can be built in: registered without a module directory.
            let builtin = Host::exists(&self.host.driver_dir(&m))
                || Host::exists(&self.host.driver_dir(&m.replace('_', "-")));
            if builtin {
                continue;
            }
            loaded.extend(module::load(self.host, self.kernel, &self.release, &m)?);
        }
        Ok(loaded)
    }

    /// The start of VM mode, as `vfio-manager run` does it: load the vfio modules and,
    /// when `unload` names native driver modules, pin every moving device's
    /// `driver_override` and unload them. Binding follows with [`Self::bind`] on a
    /// fresh scan. A module that will not unload (in use) is reported and left:
    /// its devices are then unbound one by one.
    pub fn enter_vm_mode(
        &mut self,
        inv: &Inventory,
        unload: &[String],
    ) -> Result<(), PassthroughError> {
        self.load_modules(&target_drivers(inv, &[]))?;
        if unload.is_empty() {
            return Ok(());
        }
        self.pin_overrides(inv, &[])?;
        if let Err(e) = self.unload_modules(unload) {
            tracing::warn!(error = %error_chain(&e), "native module not unloaded; \
                unbinding its devices one by one");
        }
        Ok(())
    }

    /// Writes `driver_override` for every device that will move, recording each first,
    /// so that unloading a native module cannot let anything re-probe them. On a
    /// failure the overrides written so far are put back to their records.
    pub fn pin_overrides(&mut self, inv: &Inventory, only: &[u32]) -> Result<(), PassthroughError> {
        let state = Mutex::new(&mut *self.state);
        let binder = Binder::new(self.host, self.kernel, &state);
        let mut pinned: Vec<PciAddress> = Vec::new();
        for (group, moves) in plan(inv, only) {
            for mv in moves {
                let address = mv.entry.device.address;
                let result = binder
                    .record(&mv, group)
                    .map_err(StepError::from)
                    .and_then(|()| {
                        pinned.push(address);
                        let path = self.host.device_dir(&address).join("driver_override");
                        self.kernel.write(&path, &mv.driver).map_err(|source| {
                            StepError::Driver(DriverError::Write {
                                address,
                                action: "bind",
                                source,
                            })
                        })
                    });
                if let Err(source) = result {
                    return Err(binder.roll_back(group, &pinned, source));
                }
            }
        }
        Ok(())
    }

    /// Unloads native driver modules (after [`Self::pin_overrides`]), noting each in the
    /// state file first so restore reloads it.
    pub fn unload_modules(&mut self, modules: &[String]) -> Result<Vec<String>, PassthroughError> {
        let mut unloaded = Vec::new();
        for m in modules {
            // A module that is not loaded is not ours to reload later.
            if !module::is_loaded(self.host, m) {
                continue;
            }
            // Note first: a crash right after the unload must still reload it.
            self.state
                .note_unloaded(self.kernel, &module::canonical_name(m))?;
            if module::unload(self.host, self.kernel, m)? {
                unloaded.push(module::canonical_name(m));
            }
        }
        Ok(unloaded)
    }

    /// Moves the groups `only` (all groups when empty) to vfio whole: loads the
    /// modules of the drivers they go to ([`target_drivers`], with the vfio
    /// modules) and binds them, up to `jobs` groups at once
    /// ([`Self::bind_concurrent`]). A module that cannot be loaded stops before
    /// any device moves.
    pub fn move_to_vfio(
        &mut self,
        inv: &Inventory,
        only: &[u32],
        jobs: NonZeroUsize,
    ) -> Result<BindReport, ModuleError> {
        self.load_modules(&target_drivers(inv, only))?;
        Ok(self.bind_concurrent(inv, only, jobs))
    }

    /// Binds every selected device in the groups `only` (all groups when empty)
    /// together with its companions, one group after another.
    pub fn bind(&mut self, inv: &Inventory, only: &[u32]) -> BindReport {
        self.bind_concurrent(inv, only, NonZeroUsize::MIN)
    }

    /// Binds like [`Self::bind`], moving up to `jobs` IOMMU groups at once: a slow
    /// native driver's remove and probe (a GPU's can take a second) then costs about
    /// the slowest group's time instead of the sum. With `jobs` 1, or on a dry-run
    /// kernel (whose printed plan must read in order), groups go one at a time on
    /// the calling thread.
    ///
    /// Each group is still all-or-nothing with its own rollback, its members moved
    /// in order, each recorded in the state file before it is touched; the state
    /// file is shared under a lock (see `binder`). A failure — a failed state save
    /// included — stops and rolls back only its own group: the other groups, in
    /// flight or waiting, carry on as they would one at a time, each protected by
    /// its own records. The report lists groups in ascending order whatever the
    /// threads' timing.
    pub fn bind_concurrent(
        &mut self,
        inv: &Inventory,
        only: &[u32],
        jobs: NonZeroUsize,
    ) -> BindReport {
        let mut report = BindReport::default();
        for entry in inv.selected().filter(|_| only.is_empty()) {
            if entry.device.iommu_group.is_none() {
                if let Err(e) = bind::check_bindable(self.host, &entry.device) {
                    report.failed.push(PassthroughError::NoGroup(e));
                }
            }
        }
        let plans = plan(inv, only);
        for group in inv
            .groups
            .keys()
            .filter(|g| only.is_empty() || only.contains(g))
        {
            let moving: BTreeSet<PciAddress> = plans
                .iter()
                .filter(|(g, _)| g == group)
                .flat_map(|(_, moves)| moves.iter().map(|m| m.entry.device.address))
                .collect();
            report.already.extend(
                inv.in_group(*group)
                    .filter(|e| !matches!(e.role, Role::Bridge))
                    .map(|e| e.device.address)
                    .filter(|a| !moving.contains(a)),
            );
        }
        // `plan` lists groups in ascending order; the results come back in that order.
        let state = Mutex::new(&mut *self.state);
        let binder = Binder::new(self.host, self.kernel, &state);
        let results = binder.bind_groups(&plans, jobs_for(self.kernel, jobs));
        for result in results {
            match result {
                Ok(bound) => report.bound.extend(bound),
                Err(e) => report.failed.push(e),
            }
        }
        report
    }

    /// Restores what the state file records, for the groups holding `only` (every
    /// recorded device when empty), one group after another. Modules we unloaded are
    /// reloaded first.
    pub fn restore(&mut self, only: &[PciAddress]) -> RestoreReport {
        self.restore_concurrent(only, NonZeroUsize::MIN)
    }

    /// Restores like [`Self::restore`], putting back up to `jobs` IOMMU groups at
    /// once: leaving VM mode then costs about the slowest group's time, as entering
    /// it does with [`Self::bind_concurrent`].
    ///
    /// The guarantees are those of one group at a time: a group a VM holds is
    /// skipped with its records kept; within a group the members go back in order,
    /// each record dropped only once its device is confirmed back, under the state
    /// file's lock, so a crash at any point leaves every device not yet back
    /// recorded. Modules are reloaded before any group moves (a native driver must
    /// be there to take its devices back). The report lists groups in ascending
    /// order whatever the threads' timing.
    pub fn restore_concurrent(&mut self, only: &[PciAddress], jobs: NonZeroUsize) -> RestoreReport {
        let mut report = RestoreReport::default();
        let records = self.state.state().devices.clone();
        let groups: BTreeSet<u32> = records
            .iter()
            .filter(|(a, _)| only.is_empty() || only.contains(a))
            .map(|(_, r)| r.group)
            .collect();
        // A full restore always reloads what we unloaded, even with no device left.
        if only.is_empty() || !groups.is_empty() {
            self.reload_modules(&mut report);
        }
        let plans: Vec<(u32, Vec<(PciAddress, Record)>)> = groups
            .into_iter()
            .map(|g| {
                let members = records
                    .iter()
                    .filter(|(_, r)| r.group == g)
                    .map(|(a, r)| (*a, r.clone()))
                    .collect();
                (g, members)
            })
            .collect();
        let state = Mutex::new(&mut *self.state);
        let binder = Binder::new(self.host, self.kernel, &state);
        let results = binder.restore_groups(&plans, jobs_for(self.kernel, jobs));
        for part in results {
            report.restored.extend(part.restored);
            report.in_use.extend(part.in_use);
            report.gone.extend(part.gone);
            report.failed.extend(part.failed);
        }
        report
    }

    fn reload_modules(&mut self, report: &mut RestoreReport) {
        let modules = self.state.state().unloaded_modules.clone();
        let mut ok = true;
        for m in &modules {
            match module::load(self.host, self.kernel, &self.release, m) {
                Ok(loaded) => report.reloaded.extend(loaded),
                Err(e) => {
                    ok = false;
                    report.failed.push(e.into());
                }
            }
        }
        if ok {
            if let Err(e) = self.state.clear_unloaded(self.kernel) {
                report.failed.push(e.into());
            }
        }
    }
}

/// The groups moved at once: `jobs`, or one at a time on a dry-run kernel, whose
/// printed plan must read in order.
fn jobs_for(kernel: &dyn Kernel, jobs: NonZeroUsize) -> NonZeroUsize {
    if kernel.is_dry_run() {
        NonZeroUsize::MIN
    } else {
        jobs
    }
}

/// The members that must move, per group, selected devices first within a group.
fn plan<'e>(inv: &'e Inventory, only: &[u32]) -> Vec<(u32, Vec<Move<'e>>)> {
    let mut out: Vec<(u32, Vec<Move<'e>>)> = Vec::new();
    for &group in inv.groups.keys() {
        if !only.is_empty() && !only.contains(&group) {
            continue;
        }
        let mut moves: Vec<Move<'e>> = inv
            .in_group(group)
            .filter_map(|entry| {
                let current = entry.device.driver.as_deref();
                let moves = match &entry.role {
                    Role::Bridge => false,
                    Role::Selected { .. } => current != Some(entry.target_driver.as_str()),
                    // A companion already on a vfio driver or pci-stub keeps the group viable.
                    Role::Companion { .. } => {
                        !current.is_some_and(|d| is_vfio_driver(d) || d == STUB_DRIVER)
                    }
                };
                moves.then(|| Move {
                    entry,
                    driver: entry.target_driver.clone(),
                })
            })
            .collect();
        moves.sort_by_key(|m| !matches!(m.entry.role, Role::Selected { .. }));
        if !moves.is_empty() {
            out.push((group, moves));
        }
    }
    out
}
