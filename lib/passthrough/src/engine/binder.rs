//! Applying one IOMMU group's moves and recording them, alone or beside other groups.
//!
//! A [`Binder`] is what a bind shares between its threads: the node's roots, the
//! kernel, and the state file behind a lock. Each group is all-or-nothing with its
//! own rollback; groups share nothing but the state file, whose every save is made
//! under the lock, so saves are serialised and each one holds every record made
//! before it (*memory never claims more than the disk holds* holds across threads).
//!
//! [`for_each_bounded`] runs the groups on up to `jobs` threads and hands the
//! results back in the groups' order, so reports never depend on thread timing.
//!
//! Its failpoint ([`support::failpoint`]): `bind-after-record`, once a device's
//! record is on disk and before it is touched.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use super::{Move, PassthroughError, RestoreReport, StepError};
use crate::inventory::Role;
use crate::state::{self, Record, Records, StateError, StateFile};
use support::error_chain;
use support::lock;
use sysfs_pci::bind::{self, BindOutcome, DriverError};
use sysfs_pci::device::DeviceError;
use sysfs_pci::kernel::Kernel;
use sysfs_pci::module;
use sysfs_pci::{Host, PciAddress, PciDevice};

/// A group's members now on their vfio driver, each with the driver it left.
pub(super) type Bound = Vec<(PciAddress, Option<String>)>;

/// Moves groups to their vfio drivers, recording each member first.
pub(super) struct Binder<'b, 's, O: Records> {
    host: &'b Host,
    kernel: &'b dyn Kernel,
    /// Locked only for a state change (its save included), never across a device
    /// move, so slow probes of different groups overlap. A lock poisoned by a
    /// panicking thread is used as it is: a state change is applied in memory only
    /// after its save, so a panic cannot leave the state half-changed.
    state: &'b Mutex<&'s mut StateFile<O>>,
}

impl<'b, 's, O: Records> Binder<'b, 's, O> {
    pub(super) fn new(
        host: &'b Host,
        kernel: &'b dyn Kernel,
        state: &'b Mutex<&'s mut StateFile<O>>,
    ) -> Self {
        Self {
            host,
            kernel,
            state,
        }
    }

    /// Records `mv` unless a record exists (the existing one is the true original).
    pub(super) fn record(&self, mv: &Move<'_>, group: u32) -> Result<(), StateError> {
        let d = &mv.entry.device;
        lock(self.state).record(
            self.kernel,
            d.address,
            Record {
                original_driver: d.driver.clone(),
                original_override: d.driver_override.clone(),
                driver: mv.driver.clone(),
                role: match mv.entry.role {
                    Role::Selected { .. } => state::RecordedRole::Selected,
                    _ => state::RecordedRole::Companion,
                },
                resource: mv.entry.resource().map(|r| r.to_string()),
                group,
            },
        )?;
        support::failpoint::step("bind-after-record");
        Ok(())
    }

    /// Binds each group of `plans` ([`Self::bind_group`]), up to `jobs` groups at
    /// once ([`for_each_bounded`]); the results in the plans' order.
    pub(super) fn bind_groups(
        &self,
        plans: &[(u32, Vec<Move<'_>>)],
        jobs: NonZeroUsize,
    ) -> Vec<Result<Bound, PassthroughError>> {
        for_each_bounded(plans, jobs, |(group, moves)| self.bind_group(*group, moves))
    }

    /// Restores each group of `plans` ([`Self::restore_group`]), up to `jobs`
    /// groups at once; the reports in the plans' order.
    pub(super) fn restore_groups(
        &self,
        plans: &[(u32, Vec<(PciAddress, Record)>)],
        jobs: NonZeroUsize,
    ) -> Vec<RestoreReport> {
        for_each_bounded(plans, jobs, |(group, members)| {
            self.restore_group(*group, members)
        })
    }

    /// Binds one group's `moves` in order, each recorded before it is touched; on
    /// the first failure puts back the members touched so far.
    fn bind_group(&self, group: u32, moves: &[Move<'_>]) -> Result<Bound, PassthroughError> {
        // Every precondition of every member before the first write.
        for mv in moves {
            bind::check_bindable(self.host, &mv.entry.device).map_err(|source| {
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
                .and_then(|dev| bind::bind(self.host, self.kernel, &dev, &mv.driver));
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
    pub(super) fn roll_back(
        &self,
        group: u32,
        touched: &[PciAddress],
        source: StepError,
    ) -> PassthroughError {
        tracing::warn!(group, error = %error_chain(&source), "bind failed; putting the group back");
        let mut put_back = Vec::new();
        let mut stuck = Vec::new();
        let mut kept = Vec::new();
        for address in touched.iter().rev() {
            match self.put_back(address) {
                PutBack::Done => put_back.push(*address),
                PutBack::RecordKept(why) => {
                    put_back.push(*address);
                    kept.push((*address, why));
                }
                PutBack::Stuck(why) => stuck.push((*address, why)),
            }
        }
        let source = Box::new(source);
        if !stuck.is_empty() {
            PassthroughError::RollbackFailed {
                group,
                put_back,
                stuck,
                source,
            }
        } else if !kept.is_empty() {
            PassthroughError::RecordsKept {
                group,
                put_back,
                kept,
                source,
            }
        } else {
            PassthroughError::Group {
                group,
                put_back,
                source,
            }
        }
    }

    /// Restores one device to its record and forgets the record.
    fn put_back(&self, address: &PciAddress) -> PutBack {
        let Some(record) = lock(self.state).get(address).cloned() else {
            return PutBack::Done; // never recorded, so never touched
        };
        let result = PciDevice::read(self.host, address)
            .map_err(DriverError::from)
            .and_then(|now| {
                bind::restore(
                    self.host,
                    self.kernel,
                    &now,
                    record.original_driver.as_deref(),
                    record.original_override.as_deref(),
                )
            });
        if let Err(e) = result {
            let unloaded = record.original_driver.as_deref().is_some_and(|d| {
                lock(self.state)
                    .state()
                    .unloaded_modules
                    .contains(&module::canonical_name(d))
            });
            let hint = if unloaded {
                "; its native module was unloaded when the node was taken and is \
                    reloaded on restore"
            } else {
                ""
            };
            return PutBack::Stuck(format!("{}{hint}", error_chain(&e)));
        }
        match lock(self.state).forget(self.kernel, address) {
            Ok(()) => PutBack::Done,
            Err(e) => PutBack::RecordKept(error_chain(&e)),
        }
    }
}

impl<O: Records> Binder<'_, '_, O> {
    /// Restores one recorded group, member by member, unless a VM holds its group
    /// node; each record is dropped only once its device is confirmed back.
    fn restore_group(&self, group: u32, members: &[(PciAddress, Record)]) -> RestoreReport {
        let mut report = RestoreReport::default();
        match self.kernel.group_in_use(&self.host.vfio_group_node(group)) {
            Ok(true) => {
                for (a, _) in members {
                    // The callers say it, once per hold (vfio-manager run retries every resync).
                    tracing::debug!(bdf = %a, group, "a VM holds /dev/vfio/{group}; \
                        not restoring it now");
                    report.in_use.push((*a, group));
                }
                return report;
            }
            Ok(false) => {}
            // Unbinding a device a VM holds would take it from under the VM:
            // unknown is treated as held (the record stays for the next try).
            Err(source) => {
                report.failed.push(PassthroughError::GroupUnprobed {
                    group,
                    members: members.iter().map(|(a, _)| *a).collect(),
                    source,
                });
                return report;
            }
        }
        for (address, record) in members {
            self.restore_one(address, record, &mut report);
        }
        report
    }

    fn restore_one(&self, address: &PciAddress, record: &Record, report: &mut RestoreReport) {
        let dev = match PciDevice::read(self.host, address) {
            Ok(d) => d,
            Err(DeviceError::NotFound { .. }) => {
                tracing::warn!(bdf = %address, "recorded device is gone; dropping its record");
                report.gone.push(*address);
                if let Err(e) = lock(self.state).forget(self.kernel, address) {
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
        let result = bind::restore(
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
                if let Err(e) = lock(self.state).forget(self.kernel, address) {
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

/// How putting one device back went.
enum PutBack {
    /// Back on its recorded driver, record dropped.
    Done,
    /// Back on its recorded driver, but its record could not be dropped (why).
    RecordKept(String),
    /// Not back on its recorded driver (why); record kept.
    Stuck(String),
}

/// Calls `work` on every item on up to `jobs` threads (the calling thread alone when
/// `jobs` is 1 or there is one item) and returns the results in the items' order.
///
/// Every thread is joined before this returns. If one panicked — in the fault tests,
/// a simulated `kill -9` — the panic is resumed here with its own payload once all
/// have stopped. If no thread can be started the calling thread does the work.
fn for_each_bounded<T: Sync, R: Send>(
    items: &[T],
    jobs: NonZeroUsize,
    work: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let threads = jobs.get().min(items.len());
    if threads <= 1 {
        return items.iter().map(work).collect();
    }
    let next = AtomicUsize::new(0);
    // Each worker takes the next item until none is left; results carry their index.
    let indexed = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(i) else {
                return done;
            };
            done.push((i, work(item)));
        }
    };
    let mut results: Vec<(usize, R)> = Vec::with_capacity(items.len());
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for n in 0..threads {
            match std::thread::Builder::new()
                .name(format!("bind-{n}"))
                .spawn_scoped(scope, indexed)
            {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    tracing::warn!(error = %e, threads = n, "cannot start another bind \
                        thread; going on with fewer");
                    break;
                }
            }
        }
        if handles.is_empty() {
            results.extend(indexed());
            return;
        }
        let mut panicked = None;
        for handle in handles {
            match handle.join() {
                Ok(done) => results.extend(done),
                Err(payload) => {
                    panicked.get_or_insert(payload);
                }
            }
        }
        if let Some(payload) = panicked {
            std::panic::resume_unwind(payload);
        }
    });
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_in_item_order_whatever_the_threads() {
        let items: Vec<u32> = (0..20).collect();
        for jobs in [1, 2, 3, 8, 64] {
            let out = for_each_bounded(&items, NonZeroUsize::new(jobs).unwrap(), |i| {
                std::thread::sleep(std::time::Duration::from_millis(u64::from(20 - i)));
                i * 2
            });
            assert_eq!(out, items.iter().map(|i| i * 2).collect::<Vec<_>>());
        }
    }

    #[derive(Debug)]
    struct Stop;

    #[test]
    fn a_panicking_item_reaches_the_caller_with_its_payload() {
        let items: Vec<u32> = (0..6).collect();
        let caught = std::panic::catch_unwind(|| {
            for_each_bounded(&items, NonZeroUsize::new(3).unwrap(), |i| {
                if *i == 4 {
                    std::panic::panic_any(Stop);
                }
            })
        });
        assert!(caught.unwrap_err().is::<Stop>());
    }
}
