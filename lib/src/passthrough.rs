//! Whole-group binding and restoring, with the state file kept true at every step.
//!
//! A bind works one IOMMU group at a time: check every member first, record each in
//! the state file before touching it, move it, and on any failure put the members
//! moved so far back, so a group is never left half-done. A restore skips a group
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
//! `lib/tests/faults.rs` fails and crashes the process at every kernel write, module
//! syscall and state save of a node's whole life in turn and checks these hold.

use std::collections::BTreeSet;

use crate::driver::{self, BindOutcome, DriverError};
use crate::group::{is_vfio_driver, STUB_DRIVER};
use crate::inventory::{Entry, Inventory, Role, COMPANION_DRIVER};
use crate::kernel::Kernel;
use crate::module::{self, ModuleError};
use crate::state::{self, Record, StateError, StateFile};
use crate::{error_chain, Host, PciAddress, PciDevice};

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
    Group {
        /// The group.
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
        "IOMMU group {group} is half-bound{}; could not put back {}; their records are kept so \
         `vfio-manager unbind` can retry",
        put_back_note(put_back),
        stuck_note(stuck)
    )]
    RollbackFailed {
        /// The group.
        group: u32,
        /// Members put back.
        put_back: Vec<PciAddress>,
        /// Members that could not be put back, with why.
        stuck: Vec<(PciAddress, String)>,
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
    /// Restoring a device failed.
    #[error("cannot restore {address}")]
    Restore {
        /// The device.
        address: PciAddress,
        /// Why.
        #[source]
        source: DriverError,
    },
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
pub struct Passthrough<'a> {
    /// The node's roots.
    pub host: &'a Host,
    /// Where changes go.
    pub kernel: &'a dyn Kernel,
    /// The record of changes.
    pub state: &'a mut StateFile,
    /// The running kernel's release, for `modules.dep`.
    pub release: String,
}

/// One member of a group that has to move.
struct Move<'e> {
    entry: &'e Entry,
    driver: String,
}

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

impl Passthrough<'_> {
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
    pub fn prepare(&mut self, inv: &Inventory, unload: &[String]) -> Result<(), PassthroughError> {
        self.load_modules(&target_drivers(inv, &[]))?;
        if unload.is_empty() {
            return Ok(());
        }
        self.pin_overrides(inv, &[])?;
        if let Err(e) = self.unload_modules(unload) {
            tracing::warn!(error = %error_chain(&e), "native module not unloaded; unbinding its devices one by one");
        }
        Ok(())
    }

    /// Writes `driver_override` for every device that will move, recording each first,
    /// so that unloading a native module cannot let anything re-probe them. On a
    /// failure the overrides written so far are put back to their records.
    pub fn pin_overrides(&mut self, inv: &Inventory, only: &[u32]) -> Result<(), PassthroughError> {
        let mut pinned: Vec<PciAddress> = Vec::new();
        for (group, moves) in plan(inv, only) {
            for mv in moves {
                let address = mv.entry.device.address;
                let result = self
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
                    return Err(self.roll_back(group, &pinned, source));
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

    /// Binds every selected device in the groups `only` (all groups when empty)
    /// together with its companions.
    pub fn bind(&mut self, inv: &Inventory, only: &[u32]) -> BindReport {
        let mut report = BindReport::default();
        for entry in inv.selected().filter(|_| only.is_empty()) {
            if entry.device.iommu_group.is_none() {
                if let Err(e) = driver::check_bindable(self.host, &entry.device) {
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
            let moves = plans
                .iter()
                .find(|(g, _)| g == group)
                .map(|(_, m)| m.as_slice());
            let moving: BTreeSet<PciAddress> = moves
                .unwrap_or_default()
                .iter()
                .map(|m| m.entry.device.address)
                .collect();
            report.already.extend(
                inv.in_group(*group)
                    .filter(|e| !matches!(e.role, Role::Bridge))
                    .map(|e| e.device.address)
                    .filter(|a| !moving.contains(a)),
            );
            if let Some(moves) = moves {
                match self.bind_group(*group, moves) {
                    Ok(bound) => report.bound.extend(bound),
                    Err(e) => report.failed.push(e),
                }
            }
        }
        report
    }

    /// Records `mv` unless a record exists (the existing one is the true original).
    fn record(&mut self, mv: &Move<'_>, group: u32) -> Result<(), StateError> {
        let d = &mv.entry.device;
        self.state.record(
            self.kernel,
            d.address,
            Record {
                original_driver: d.driver.clone(),
                original_override: d.driver_override.clone(),
                driver: mv.driver.clone(),
                role: match mv.entry.role {
                    Role::Selected { .. } => state::Role::Selected,
                    _ => state::Role::Companion,
                },
                resource: mv.entry.resource().map(|r| r.to_string()),
                group,
            },
        )?;
        crate::failpoint::step!("bind-after-record");
        Ok(())
    }

    fn bind_group(
        &mut self,
        group: u32,
        moves: &[Move<'_>],
    ) -> Result<Vec<(PciAddress, Option<String>)>, PassthroughError> {
        // Every precondition of every member before the first write.
        for mv in moves {
            driver::check_bindable(self.host, &mv.entry.device).map_err(|source| {
                PassthroughError::Group {
                    group,
                    put_back: Vec::new(),
                    source: Box::new(source.into()),
                }
            })?;
        }
        let mut touched: Vec<PciAddress> = Vec::new();
        let mut bound = Vec::new();
        for mv in moves {
            let address = mv.entry.device.address;
            if let Err(e) = self.record(mv, group) {
                return Err(self.roll_back(group, &touched, e.into()));
            }
            touched.push(address);
            // Re-read: an earlier member's unbind can change this one (e.g. a shared driver).
            let result = PciDevice::read(self.host, &address)
                .map_err(DriverError::from)
                .and_then(|dev| driver::bind(self.host, self.kernel, &dev, &mv.driver));
            match result {
                Ok(BindOutcome::AlreadyBound) => {}
                Ok(BindOutcome::Bound { previous }) => bound.push((address, previous)),
                Err(e) => return Err(self.roll_back(group, &touched, e.into())),
            }
        }
        Ok(bound)
    }

    /// Puts the devices touched so far back to their records, newest first, and
    /// forgets each record only once its device is confirmed back.
    fn roll_back(
        &mut self,
        group: u32,
        touched: &[PciAddress],
        source: StepError,
    ) -> PassthroughError {
        tracing::warn!(group, error = %error_chain(&source), "bind failed; putting the group back");
        let mut put_back = Vec::new();
        let mut stuck = Vec::new();
        for address in touched.iter().rev() {
            match self.put_back(address) {
                Ok(()) => put_back.push(*address),
                Err(why) => stuck.push((*address, why)),
            }
        }
        let source = Box::new(source);
        if stuck.is_empty() {
            PassthroughError::Group {
                group,
                put_back,
                source,
            }
        } else {
            PassthroughError::RollbackFailed {
                group,
                put_back,
                stuck,
                source,
            }
        }
    }

    /// Restores one device to its record and forgets the record. The reason on failure.
    fn put_back(&mut self, address: &PciAddress) -> Result<(), String> {
        let Some(record) = self.state.get(address).cloned() else {
            return Ok(()); // never recorded, so never touched
        };
        let result = PciDevice::read(self.host, address)
            .map_err(DriverError::from)
            .and_then(|now| {
                driver::restore(
                    self.host,
                    self.kernel,
                    &now,
                    record.original_driver.as_deref(),
                    record.original_override.as_deref(),
                )
            });
        if let Err(e) = result {
            let unloaded = record.original_driver.as_deref().is_some_and(|d| {
                self.state
                    .state()
                    .unloaded_modules
                    .contains(&module::canonical_name(d))
            });
            let hint = if unloaded {
                "; its native module was unloaded by vfio-manager and is reloaded on restore"
            } else {
                ""
            };
            return Err(format!("{}{hint}", error_chain(&e)));
        }
        self.state
            .forget(self.kernel, address)
            .map_err(|e| format!("back on its driver, but {}", error_chain(&e)))
    }

    /// Restores what the state file records, for the groups holding `only` (every
    /// recorded device when empty). Modules we unloaded are reloaded first.
    pub fn restore(&mut self, only: &[PciAddress]) -> RestoreReport {
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
        for group in groups {
            let members: Vec<(&PciAddress, &Record)> =
                records.iter().filter(|(_, r)| r.group == group).collect();
            match self.kernel.group_in_use(&self.host.vfio_group_node(group)) {
                Ok(true) => {
                    for (a, _) in &members {
                        tracing::warn!(bdf = %a, group, "a VM holds /dev/vfio/{group}; not restoring it now");
                        report.in_use.push((**a, group));
                    }
                    continue;
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(group, error = %error_chain(&e), "cannot probe group use; restoring anyway")
                }
            }
            for (address, record) in members {
                self.restore_one(address, record, &mut report);
            }
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

    fn restore_one(&mut self, address: &PciAddress, record: &Record, report: &mut RestoreReport) {
        let dev = match PciDevice::read(self.host, address) {
            Ok(d) => d,
            Err(crate::device::DeviceError::NotFound { .. }) => {
                tracing::warn!(bdf = %address, "recorded device is gone; dropping its record");
                report.gone.push(*address);
                if let Err(e) = self.state.forget(self.kernel, address) {
                    report.failed.push(e.into());
                }
                return;
            }
            Err(e) => {
                report.failed.push(PassthroughError::Restore {
                    address: *address,
                    source: e.into(),
                });
                return;
            }
        };
        let result = driver::restore(
            self.host,
            self.kernel,
            &dev,
            record.original_driver.as_deref(),
            record.original_override.as_deref(),
        );
        match result {
            Ok(()) => {
                report
                    .restored
                    .push((*address, record.original_driver.clone()));
                if let Err(e) = self.state.forget(self.kernel, address) {
                    report.failed.push(e.into());
                }
            }
            Err(source) => report.failed.push(PassthroughError::Restore {
                address: *address,
                source,
            }),
        }
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
