//! Passthrough per ResourceClaim, for the DRA driver.
//!
//! [`Claims`] prepares and unprepares claims with the same whole-group engine as
//! vfio-manager ([`Passthrough`]) and keeps the claim's life in the same state file,
//! saved before each step:
//!
//! 1. prepare saves the claim as `preparing` with its devices and groups, before any
//!    device is touched;
//! 2. binds each group (every member recorded before it moves, never `new_id`, the
//!    group node checked), then writes the claim's CDI spec and metadata files;
//! 3. saves the claim as `prepared` and answers kubelet.
//!
//! Where the scheduler waits for the claim's binding condition (KEP-5007),
//! [`Claims::move_early`] does steps 1 and 2 without the files as soon as the claim
//! is allocated, and saves it as `moved`; prepare then only writes the files.
//! [`Claims::release`] gives a moved claim's devices back if it loses its
//! allocation before its pod starts.
//!
//! Unprepare refuses a claim whose `/dev/vfio/<group>` is open, saves it as
//! `unpreparing`, removes its files, restores every recorded member of its groups and
//! only then forgets the claim. After a `kill -9` anywhere, [`Claims::recover`] rolls a
//! `preparing` claim back and finishes an `unpreparing` one, so a later unprepare still
//! restores the original drivers. A group belongs to at most one claim.
//!
//! Its failpoints ([`support::failpoint`]): `prepare-after-save`, `early-after-save`
//! and `early-after-moved`, `unprepare-after-save`.
//!
//! Prepare and unprepare, each step of which this file shows in order; the
//! errors (`claims/error.rs`) and a restart's recovery (`claims/recovery.rs`) sit
//! beside it.

use std::collections::{BTreeMap, BTreeSet};
use std::num::NonZeroUsize;
use std::path::PathBuf;

use crate::cdi::{self, AttributeValue, DriverName};
use crate::config::{self, Iommu};
use crate::model::{recorded_claim, DeviceName};
use crate::model::{ClaimDevice, ClaimPhase, ClaimRecord, ClaimRecords};
use kubelet_plugin::PCI_BUS_ID;
use kubelet_plugin::{AllocatedDevice, Claim, ClaimRef, OpaqueConfig, PreparedDevice};
use passthrough::config::ResourceList;
use passthrough::inventory::{Inventory, Role};
use passthrough::state::StateError;
use passthrough::{Passthrough, PassthroughError};
use support::error_chain;
use support::io::IoError;
use sysfs_pci::device::Detail;
use sysfs_pci::module::ModuleError;
use sysfs_pci::{Host, PciAddress};

mod error;
mod recovery;

use error::boxed;
pub use error::{ClaimError, ClaimStepError, DriverError, Failure};

/// Where a claim's files go, and how devices are handed to containers.
#[derive(Debug, Clone)]
#[allow(missing_docs)]
pub struct Files {
    /// The DRA driver's name (the CDI vendor).
    pub driver: DriverName,
    pub cdi_dir: PathBuf,
    pub metadata_dir: PathBuf,
    /// Give containers the iommufd nodes too, where the kernel makes them, unless
    /// a claim's configuration says otherwise ([`crate::config`]).
    pub iommufd: bool,
}

/// What [`Claims::recover`] did after a restart.
#[derive(Debug, Default)]
pub struct Recovery {
    /// Claims found half-prepared and rolled back.
    pub rolled_back: Vec<String>,
    /// Claims found half-unprepared and finished.
    pub finished: Vec<String>,
    /// Device records that belonged to no claim, restored.
    pub orphans: Vec<PciAddress>,
    /// Claims of another node's pool (a state file brought from elsewhere), and
    /// the device records of their groups: forgotten without touching a device.
    pub foreign: Vec<String>,
    /// What could not be done (kept for a later unprepare or restart).
    pub failed: Vec<String>,
}

/// Prepares and unprepares claims on one node.
#[allow(missing_docs)]
pub struct Claims<'a> {
    /// The passthrough engine, with the driver's state file.
    pub engine: Passthrough<'a, ClaimRecords>,
    /// The resource list, for a claim's scan.
    pub list: &'a ResourceList,
    pub pool: &'a str,
    pub files: &'a Files,
    /// IOMMU groups moved at once (`--bind-jobs`): a claim of several devices is
    /// prepared, and given back, in about the slowest group's time.
    pub jobs: NonZeroUsize,
}

impl Claims<'_> {
    /// kubelet's prepare of `claim`, as the claims thread runs it: what an
    /// unprepare of the claim left half-done is finished, its devices are read
    /// fresh with their groups ([`Self::scan`]), and it is prepared
    /// ([`Self::prepare_on`]).
    pub fn prepare(&mut self, claim: &Claim) -> Result<Vec<PreparedDevice>, ClaimError> {
        let c = &claim.reference;
        self.finish_interrupted(c)?;
        let inv = self.scan(&claim.devices);
        let (allocations, configs) = (&claim.devices, &claim.configs);
        self.prepare_on(c, claim.pod_claim_name(), allocations, configs, &inv)
    }

    /// The early move of `claim`'s groups (its pod not yet bound), as the claims
    /// thread runs it: as [`Self::prepare`], up to [`Self::move_early_on`].
    pub fn move_early(
        &mut self,
        claim: &ClaimRef,
        allocations: &[AllocatedDevice],
        configs: &[OpaqueConfig],
    ) -> Result<(), ClaimError> {
        self.finish_interrupted(claim)?;
        let inv = self.scan(allocations);
        self.move_early_on(claim, allocations, configs, &inv)
    }

    /// A fresh read of the devices allocated to a claim, each with its whole IOMMU
    /// group: what the job on it needs, and no more. The rest of the node is not
    /// read (on a node of many devices a whole scan per claim costs more than the
    /// claim); a name that is not ours reads nothing and is refused by the claim's
    /// checks, as is a device that is gone.
    pub fn scan(&self, allocations: &[AllocatedDevice]) -> Inventory {
        let addresses: Vec<PciAddress> = allocations
            .iter()
            .filter_map(|d| DeviceName::parse(&d.device))
            .map(DeviceName::address)
            .collect();
        Inventory::scan_groups_of(self.engine.host, self.list, &addresses, Detail::Full)
    }

    /// Prepares `claim` for the devices the scheduler allocated to it, on `inv` (a
    /// fresh scan). Idempotent: a claim already prepared with the same devices gets
    /// the same answer without touching the node.
    ///
    /// `pod_claim_name` is the claim's `resource.kubernetes.io/pod-claim-name`
    /// annotation (a claim made from a template), which places its metadata file;
    /// `configs` are the opaque configurations of this driver in its allocation.
    pub fn prepare_on(
        &mut self,
        claim: &ClaimRef,
        pod_claim_name: Option<&str>,
        allocations: &[AllocatedDevice],
        configs: &[OpaqueConfig],
        inv: &Inventory,
    ) -> Result<Vec<PreparedDevice>, ClaimError> {
        // The claim's own configuration is judged first, whatever else is wrong.
        let iommu = self.configured_iommu(claim, allocations, configs)?;
        let devices = self.resolve(claim, allocations, inv)?;
        self.kernel_serves(claim, &devices, &iommu)?;
        // The files without the device cdevs (read once the devices are on vfio):
        // names no file can be made of are refused before anything is touched.
        let unread: Vec<Nodes> = iommu
            .iter()
            .map(|i| Nodes {
                groups: i.is_none_or(Iommu::legacy),
                cdevs: Vec::new(),
            })
            .collect();
        let named = self
            .files_for(claim, pod_claim_name, &devices, &unread, inv)
            .map_err(|source| ClaimError::Unnamable {
                claim: claim.to_string(),
                source,
            })?;
        let record = match self.recorded_phase(claim, &devices)? {
            Some(ClaimPhase::Prepared) => return Ok(prepared_devices(&devices, &named)),
            // Moved before its pod was bound: only the files are left to write, once
            // the groups are seen still whole on vfio (a member moved off behind our
            // back is put back).
            Some(ClaimPhase::Moved) => {
                let record = self.record(claim, ClaimPhase::Moved, devices);
                if let Err(source) = self.move_groups(inv, &record.groups()) {
                    let after = self.after_failed_prepare(&claim.uid, &record);
                    return Err(failed(claim, source.move_step(), Some(after), source));
                }
                record
            }
            // None, or a failed earlier attempt: every step again. (`recorded_phase`
            // refuses an unfinished unprepare.)
            Some(ClaimPhase::Preparing | ClaimPhase::Unpreparing) | None => {
                self.save_and_move(claim, devices, inv, "prepare-after-save")?
            }
        };
        // Files that name no device cdev are the ones made above (of the recorded
        // devices: `recorded_phase` refuses any other); the cdevs exist only once
        // the devices are on vfio, so files naming them are made now.
        let written = if self.wants_cdevs(&iommu) {
            self.nodes(&record.devices, &iommu).and_then(|nodes| {
                let files = self
                    .files_for(claim, pod_claim_name, &record.devices, &nodes, inv)
                    .map_err(boxed)?;
                self.write_files(&files)
            })
        } else {
            self.write_files(&named)
        };
        if let Err(source) = written {
            let after = self.after_failed_prepare(&claim.uid, &record);
            return Err(failed(claim, "writing its files", Some(after), source));
        }
        let prepared = ClaimRecord {
            phase: ClaimPhase::Prepared,
            ..record.clone()
        };
        if let Err(e) = self.save_claim(&claim.uid, prepared) {
            let after = self.after_failed_prepare(&claim.uid, &record);
            return Err(failed(
                claim,
                "saving the prepared claim",
                Some(after),
                boxed(e),
            ));
        }
        Ok(prepared_devices(&record.devices, &named))
    }

    /// Moves the groups of `claim`'s devices to vfio as soon as the scheduler has
    /// allocated it, before its pod is bound (KEP-5007: the scheduler waits on the
    /// claim's binding condition): the same steps and records as [`Self::prepare_on`]
    /// up to the files (`save_and_move`), then saved as `moved`.
    /// Idempotent: a claim already moved or prepared with the same devices is left
    /// as it is.
    pub fn move_early_on(
        &mut self,
        claim: &ClaimRef,
        allocations: &[AllocatedDevice],
        configs: &[OpaqueConfig],
        inv: &Inventory,
    ) -> Result<(), ClaimError> {
        // A configuration prepare would refuse is refused before anything moves.
        let iommu = self.configured_iommu(claim, allocations, configs)?;
        let devices = self.resolve(claim, allocations, inv)?;
        self.kernel_serves(claim, &devices, &iommu)?;
        // Moved early for an allocation it has since lost (deallocated, then
        // allocated other devices between two looks): that one goes back first.
        let stale = self
            .engine
            .state
            .records()
            .get(&claim.uid)
            .is_some_and(|r| r.phase == ClaimPhase::Moved && r.devices != devices);
        if stale {
            self.release(&claim.uid)?;
        }
        if matches!(
            self.recorded_phase(claim, &devices)?,
            Some(ClaimPhase::Moved | ClaimPhase::Prepared)
        ) {
            return Ok(());
        }
        let record = self.save_and_move(claim, devices, inv, "early-after-save")?;
        // What the configuration asks of the kernel is there now, or the move
        // goes back (prepare would refuse the claim).
        if let Err(source) = self.nodes(&record.devices, &iommu) {
            let undo = self.undo(&claim.uid, &record);
            return Err(failed(
                claim,
                "checking the iommufd nodes",
                Some(undo),
                source,
            ));
        }
        let moved = ClaimRecord {
            phase: ClaimPhase::Moved,
            ..record.clone()
        };
        if let Err(e) = self.save_claim(&claim.uid, moved) {
            let undo = self.undo(&claim.uid, &record);
            return Err(failed(
                claim,
                "saving the moved claim",
                Some(undo),
                boxed(e),
            ));
        }
        support::failpoint::step("early-after-moved");
        Ok(())
    }

    /// The first steps of every move, shared by [`Self::prepare_on`] and
    /// [`Self::move_early_on`]: saves the claim as `preparing` with its devices before
    /// any device is touched (failpoint `after_save`), then moves its groups to
    /// vfio whole. What failed is put back; the record saved.
    fn save_and_move(
        &mut self,
        claim: &ClaimRef,
        devices: Vec<ClaimDevice>,
        inv: &Inventory,
        after_save: &'static str,
    ) -> Result<ClaimRecord, ClaimError> {
        let record = self.record(claim, ClaimPhase::Preparing, devices);
        self.save_claim(&claim.uid, record.clone()).map_err(|e| {
            failed(
                claim,
                "saving the claim before touching its devices",
                None,
                boxed(e),
            )
        })?;
        support::failpoint::step(after_save);
        if let Err(source) = self.move_groups(inv, &record.groups()) {
            let undo = self.undo(&claim.uid, &record);
            return Err(failed(claim, source.move_step(), Some(undo), source));
        }
        Ok(record)
    }

    /// Saves `record` as claim `uid`'s in the state file, replacing any earlier one.
    fn save_claim(&mut self, uid: &str, record: ClaimRecord) -> Result<(), StateError> {
        self.engine.state.update_records(self.engine.kernel, |c| {
            c.0.insert(uid.to_owned(), record);
        })
    }

    /// Drops claim `uid` from the state file: only once its devices are back (or
    /// were never moved).
    fn forget_claim(&mut self, uid: &str) -> Result<(), StateError> {
        self.engine.state.update_records(self.engine.kernel, |c| {
            c.0.remove(uid);
        })
    }

    /// The record of `claim` in `phase` with `devices`.
    fn record(
        &self,
        claim: &ClaimRef,
        phase: ClaimPhase,
        devices: Vec<ClaimDevice>,
    ) -> ClaimRecord {
        ClaimRecord {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            phase,
            devices,
        }
    }

    /// Writes a claim's CDI spec and metadata files, making their directories.
    fn write_files(&self, files: &cdi::ClaimFiles) -> Result<(), Box<ClaimStepError>> {
        for (path, text) in std::iter::once(&files.cdi).chain(files.metadata.iter()) {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(|source| {
                    boxed(ClaimStepError::Dir {
                        action: "create",
                        dir: dir.to_owned(),
                        source,
                    })
                })?;
            }
            self.engine
                .kernel
                .replace_file(path, text.as_bytes())
                .map_err(boxed)?;
        }
        Ok(())
    }

    /// Gives back the devices of claim `uid` if they were moved early and the claim
    /// was never prepared (it lost its allocation, or was deleted, before its pod
    /// started). A prepared claim is kubelet's to unprepare: `Ok(false)`, as for a
    /// claim not recorded.
    pub fn release(&mut self, uid: &str) -> Result<bool, ClaimError> {
        match self.engine.state.records().get(uid) {
            Some(r) if matches!(r.phase, ClaimPhase::Moved | ClaimPhase::Unpreparing) => {
                let record = r.clone();
                let claim = recorded_claim(uid, &record);
                self.finish_unprepare(&claim, record).map(|()| true)
            }
            _ => Ok(false),
        }
    }

    /// The claims moved early and not prepared, by uid.
    pub fn moved_early(&self) -> Vec<ClaimRef> {
        self.engine
            .state
            .records()
            .iter()
            .filter(|(_, r)| r.phase == ClaimPhase::Moved)
            .map(|(uid, r)| recorded_claim(uid, r))
            .collect()
    }

    /// The phase `claim` is recorded in, refusing a record of another claim under
    /// its uid, of other devices, or with an unprepare unfinished.
    fn recorded_phase(
        &self,
        claim: &ClaimRef,
        devices: &[ClaimDevice],
    ) -> Result<Option<ClaimPhase>, ClaimError> {
        let refuse = |reason: String| ClaimError::Refused {
            claim: claim.to_string(),
            reason,
        };
        let Some(existing) = self.engine.state.records().get(&claim.uid) else {
            return Ok(None);
        };
        if existing.namespace != claim.namespace || existing.name != claim.name {
            return Err(refuse(format!(
                "its uid is prepared for {}/{}",
                existing.namespace, existing.name
            )));
        }
        if existing.devices != devices {
            return Err(refuse(format!(
                "it was prepared with {}, and its allocation now names {}; unprepare it first",
                device_list(&existing.devices),
                device_list(devices)
            )));
        }
        if existing.phase == ClaimPhase::Unpreparing {
            // [`Self::finish_interrupted`] finishes this before a prepare's scan.
            return Err(refuse(
                "an earlier unprepare or rollback of it is unfinished".into(),
            ));
        }
        Ok(Some(existing.phase))
    }

    /// What a failed prepare leaves: a claim moved early keeps its devices on vfio
    /// (its pod was bound on the strength of it; a retry writes the files, and
    /// losing the allocation gives them back); any other is put back.
    fn after_failed_prepare(&mut self, uid: &str, record: &ClaimRecord) -> String {
        if record.phase == ClaimPhase::Moved {
            return "its devices stay on vfio, moved before its pod was bound, for kubelet's retry"
                .into();
        }
        self.undo(uid, record)
    }

    /// Finishes what an unprepare or a rollback of `claim` left half-done (a claim
    /// in phase `unpreparing`): call it before the scan a prepare of the claim
    /// uses, so a retry after the cause went away (a read-only CDI directory made
    /// writable) prepares afresh instead of being refused for good. Nothing to do
    /// is `Ok`.
    pub fn finish_interrupted(&mut self, claim: &ClaimRef) -> Result<(), ClaimError> {
        match self.engine.state.records().get(&claim.uid) {
            Some(r) if r.phase == ClaimPhase::Unpreparing => {
                let record = r.clone();
                self.finish_unprepare(claim, record)
            }
            _ => Ok(()),
        }
    }

    /// Gives every device of claim `uid` back to the driver it had before prepare
    /// (the whole group, overrides restored) and removes the claim's files. A claim
    /// not prepared here is done already.
    pub fn unprepare(&mut self, claim: &ClaimRef) -> Result<(), ClaimError> {
        let Some(record) = self.engine.state.records().get(&claim.uid).cloned() else {
            return Ok(());
        };
        let shown = recorded_claim(&claim.uid, &record);
        let held: Vec<u32> = record
            .groups()
            .into_iter()
            .filter(|g| {
                // Unknown is for the restore to refuse (GroupUnprobed), with
                // its cause.
                self.engine
                    .kernel
                    .group_in_use(&self.engine.host.vfio_group_node(*g))
                    .unwrap_or(false)
            })
            .collect();
        if !held.is_empty() {
            return Err(ClaimError::InUse {
                claim: shown.to_string(),
                groups: held,
            });
        }
        self.finish_unprepare(&shown, record)
    }

    /// Checks the allocation against this node and the other claims; nothing touched.
    fn resolve(
        &self,
        claim: &ClaimRef,
        allocations: &[AllocatedDevice],
        inv: &Inventory,
    ) -> Result<Vec<ClaimDevice>, ClaimError> {
        let refuse = |reason: String| ClaimError::Refused {
            claim: claim.to_string(),
            reason,
        };
        let not_ours = |reason: String| ClaimError::NotOurs {
            claim: claim.to_string(),
            reason,
        };
        if claim.uid.is_empty() {
            return Err(refuse("kubelet sent no uid".into()));
        }
        if allocations.is_empty() {
            return Err(not_ours(
                "no device of this driver is allocated to it on this node".into(),
            ));
        }
        let mut devices = Vec::with_capacity(allocations.len());
        for a in allocations {
            if a.admin_access {
                return Err(refuse(format!(
                    "device {} of request {} is allocated with admin access, which \
                        this driver does not give (moving it to vfio-pci would take it \
                        from its user)",
                    a.device,
                    a.request_names.join(", ")
                )));
            }
            if a.pool != self.pool {
                return Err(not_ours(format!(
                    "device {} is in pool {:?}, not this node's pool {:?}",
                    a.device, a.pool, self.pool
                )));
            }
            let Some(name) = DeviceName::parse(&a.device) else {
                return Err(not_ours(format!(
                    "device {:?} is not a device this driver publishes",
                    a.device
                )));
            };
            let address = name.address();
            let entry = inv
                .get(&address)
                .filter(|e| matches!(e.role, Role::Selected { .. }));
            let Some(entry) = entry else {
                let why = match inv.skipped(&address) {
                    Some(s) => format!("it is left out ({s})"),
                    None => "the resource list does not select it on this node".into(),
                };
                return Err(not_ours(format!("device {} ({address}): {why}", a.device)));
            };
            let Some(group) = entry.device.iommu_group else {
                return Err(refuse(format!(
                    "device {} ({address}) has no IOMMU group",
                    a.device
                )));
            };
            // The whole group: its lowest selected function names it, and every
            // other selected function of it goes along.
            let functions = match name {
                DeviceName::Function(_) => Vec::new(),
                DeviceName::Group(_) => {
                    let mut members: Vec<PciAddress> = inv
                        .in_group(group)
                        .filter(|m| matches!(m.role, Role::Selected { .. }))
                        .map(|m| m.device.address)
                        .collect();
                    members.sort_unstable();
                    if members.first() != Some(&address) {
                        return Err(not_ours(format!(
                            "device {} names IOMMU group {group} after {address}, \
                                which is not the lowest function of it the resource \
                                list selects ({})",
                            a.device,
                            members
                                .iter()
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                                .join(", ")
                        )));
                    }
                    members.remove(0);
                    members
                }
            };
            if let Some((uid, other)) =
                self.engine.state.records().iter().find(|(uid, c)| {
                    **uid != claim.uid && c.devices.iter().any(|d| d.group == group)
                })
            {
                return Err(ClaimError::Held {
                    claim: claim.to_string(),
                    reason: format!(
                        "device {} ({address}) is in IOMMU group {group}, which is \
                            prepared for claim {}/{} (uid {uid})",
                        a.device, other.namespace, other.name
                    ),
                });
            }
            devices.push(ClaimDevice {
                request_names: a.request_names.clone(),
                pool: a.pool.clone(),
                device: a.device.clone(),
                address,
                group,
                functions,
            });
        }
        Ok(devices)
    }

    /// Loads the drivers' modules and binds `groups` whole.
    fn move_groups(&mut self, inv: &Inventory, groups: &[u32]) -> Result<(), Box<ClaimStepError>> {
        let report = self
            .engine
            .move_to_vfio(inv, groups, self.jobs)
            .map_err(boxed)?;
        if !report.failed.is_empty() {
            return Err(boxed(ClaimStepError::Bind(report.failed)));
        }
        for &g in groups {
            let node = self.engine.host.vfio_group_node(g);
            if !self.engine.kernel.is_dry_run() && !Host::exists(&node) {
                return Err(boxed(ClaimStepError::NoGroupNode(node)));
            }
        }
        Ok(())
    }

    /// The kernel interface each allocated device is handed: its claim's or
    /// class's `VfioConfig` ([`crate::config`]), checked, or `None` for the node's
    /// default; one per allocation, in order.
    fn configured_iommu(
        &self,
        claim: &ClaimRef,
        allocations: &[AllocatedDevice],
        configs: &[OpaqueConfig],
    ) -> Result<Vec<Option<Iommu>>, ClaimError> {
        config::iommu_per_device(
            self.files.driver.as_str(),
            configs,
            allocations.iter().map(|a| a.request_names.as_slice()),
        )
        .map_err(|source| ClaimError::Config {
            claim: claim.to_string(),
            source,
        })
    }

    /// Whether any device of a claim whose devices are configured `iommu` is
    /// handed its device cdevs (see [`Self::nodes`]).
    fn wants_cdevs(&self, iommu: &[Option<Iommu>]) -> bool {
        iommu
            .iter()
            .any(|i| i.map_or(self.files.iommufd, |i| i.iommufd()))
    }

    /// Refuses, before anything moves, iommufd asked of a kernel known to make no
    /// device cdev.
    fn kernel_serves(
        &self,
        claim: &ClaimRef,
        devices: &[ClaimDevice],
        iommu: &[Option<Iommu>],
    ) -> Result<(), ClaimError> {
        if !iommu.iter().flatten().any(|i| i.iommufd()) {
            return Ok(());
        }
        let no_cdev = sysfs_pci::cdev::kernel_has_vfio_cdev(self.engine.host) == Some(false);
        if let Some((d, i)) = devices
            .iter()
            .zip(iommu)
            .find_map(|(d, i)| i.filter(|i| no_cdev && i.iommufd()).map(|i| (d, i)))
        {
            return Err(ClaimError::Refused {
                claim: claim.to_string(),
                reason: format!(
                    "device {} ({}) is configured with iommu: {}, and this kernel \
                        makes no VFIO device cdev (CONFIG_VFIO_DEVICE_CDEV is unset); \
                        configure iommu: legacy",
                    d.device,
                    d.address,
                    i.as_str()
                ),
            });
        }
        Ok(())
    }

    /// The claim's files, as prepare writes them, each device handed `nodes`.
    fn files_for(
        &self,
        claim: &ClaimRef,
        pod_claim_name: Option<&str>,
        devices: &[ClaimDevice],
        nodes: &[Nodes],
        inv: &Inventory,
    ) -> Result<cdi::ClaimFiles, cdi::CdiError> {
        let devices: Vec<cdi::SpecDevice> = devices
            .iter()
            .zip(nodes)
            .map(|(d, nodes)| {
                let mut attributes = BTreeMap::new();
                attributes.insert(
                    PCI_BUS_ID.to_owned(),
                    AttributeValue::String(d.address.to_string()),
                );
                let resource = inv.get(&d.address).and_then(|e| e.resource());
                if let Some(r) = resource {
                    attributes.insert(
                        "resourceName".to_owned(),
                        AttributeValue::String(r.to_string()),
                    );
                }
                if !d.functions.is_empty() {
                    let all: Vec<String> = d.addresses().map(|a| a.to_string()).collect();
                    attributes.insert(
                        "functions".to_owned(),
                        AttributeValue::String(all.join(",")),
                    );
                }
                cdi::SpecDevice {
                    device_name: d.device.clone(),
                    pool: d.pool.clone(),
                    request_names: d.request_names.clone(),
                    address: d.address,
                    functions: d.functions.clone(),
                    group: d.group,
                    attributes,
                    group_nodes: nodes.groups,
                    iommufd_nodes: nodes.cdevs.clone(),
                    resource: resource.cloned(),
                }
            })
            .collect();
        cdi::claim_files(
            &self.files.driver,
            &self.files.cdi_dir,
            &self.files.metadata_dir,
            &self.engine.host.dev,
            claim,
            pod_claim_name,
            &devices,
        )
    }

    /// The nodes each of `devices` (on vfio now) is handed: as its `iommu` asks, or
    /// by default the group nodes and, with `--iommufd`, the device cdev where the
    /// kernel made one. A cdev, or `/dev/iommu`, asked for and missing is an error.
    fn nodes(
        &self,
        devices: &[ClaimDevice],
        iommu: &[Option<Iommu>],
    ) -> Result<Vec<Nodes>, Box<ClaimStepError>> {
        let host = self.engine.host;
        let iommu_node = host.dev.join("iommu");
        devices
            .iter()
            .zip(iommu)
            .map(|(d, iommu)| {
                let cdevs = || {
                    d.addresses()
                        .map(|a| (a, sysfs_pci::cdev::vfio_cdev_name(host, &a)))
                        .collect::<Vec<_>>()
                };
                let Some(iommu) = iommu else {
                    let cdevs = if self.files.iommufd {
                        cdevs().into_iter().filter_map(|(_, c)| c).collect()
                    } else {
                        Vec::new()
                    };
                    return Ok(Nodes {
                        groups: true,
                        cdevs,
                    });
                };
                let groups = iommu.legacy();
                if !iommu.iommufd() {
                    return Ok(Nodes {
                        groups,
                        cdevs: Vec::new(),
                    });
                }
                let missing = |address: PciAddress, what: String| {
                    boxed(ClaimStepError::NoIommufd {
                        address,
                        iommu: iommu.as_str(),
                        what,
                    })
                };
                let cdevs = cdevs()
                    .into_iter()
                    .map(|(a, c)| {
                        c.ok_or_else(|| {
                            missing(
                                a,
                                "the kernel made no VFIO device cdev for it (no \
                                    vfio-dev/vfioN with a dev attribute)"
                                    .into(),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if !self.engine.kernel.is_dry_run() && !Host::exists(&iommu_node) {
                    return Err(missing(
                        d.address,
                        format!("{} is missing", iommu_node.display()),
                    ));
                }
                Ok(Nodes { groups, cdevs })
            })
            .collect()
    }

    /// Puts a half-prepared claim back: its files removed, its groups restored, the
    /// claim forgotten once nothing of it is left on vfio. Says what happened.
    fn undo(&mut self, uid: &str, record: &ClaimRecord) -> String {
        let claim = recorded_claim(uid, record);
        match self.finish_unprepare(&claim, record.clone()) {
            Ok(()) => "its devices were put back".into(),
            Err(e) => format!(
                "putting it back failed too ({}); it is kept for a retry",
                error_chain(&e)
            ),
        }
    }

    /// Removes the claim's files, restores its groups and forgets it.
    fn finish_unprepare(
        &mut self,
        claim: &ClaimRef,
        record: ClaimRecord,
    ) -> Result<(), ClaimError> {
        let fail = |step, source| failed(claim, step, None, source);
        if record.phase != ClaimPhase::Unpreparing {
            let next = ClaimRecord {
                phase: ClaimPhase::Unpreparing,
                ..record.clone()
            };
            self.save_claim(&claim.uid, next)
                .map_err(|e| fail("saving the claim before giving its devices back", boxed(e)))?;
        }
        support::failpoint::step("unprepare-after-save");
        self.remove_files(claim)
            .map_err(|e| fail("removing its files", boxed(e)))?;
        let groups = record.groups();
        let members: Vec<PciAddress> = self
            .engine
            .state
            .state()
            .devices
            .iter()
            .filter(|(_, r)| groups.contains(&r.group))
            .map(|(a, _)| *a)
            .collect();
        if !members.is_empty() {
            let report = self.engine.restore_concurrent(&members, self.jobs);
            let held: BTreeSet<u32> = report.in_use.iter().map(|(_, g)| *g).collect();
            if !report.failed.is_empty() || !held.is_empty() {
                return Err(fail(
                    "giving its devices back",
                    boxed(ClaimStepError::GiveBack {
                        failed: report.failed,
                        held: held.into_iter().collect(),
                    }),
                ));
            }
        }
        self.forget_claim(&claim.uid)
            .map_err(|e| fail("forgetting the claim", boxed(e)))
    }

    /// Removes the files prepare may have written for the claim.
    fn remove_files(&self, claim: &ClaimRef) -> Result<(), ClaimStepError> {
        let f = &self.files;
        // A uid no file can be named after never had files.
        if let Ok(spec) = cdi::cdi_spec_path(&f.driver, &f.cdi_dir, &claim.uid) {
            support::io::remove_if_present(&spec)?;
        }
        if let Ok(dir) = cdi::metadata_claim_dir(&f.driver, &f.metadata_dir, &claim.uid) {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(ClaimStepError::Dir {
                        action: "remove",
                        dir,
                        source,
                    })
                }
            }
        }
        Ok(())
    }
}

/// The nodes a device is handed.
struct Nodes {
    /// The group nodes (`/dev/vfio/vfio`, `/dev/vfio/<group>`).
    groups: bool,
    /// Its functions' device cdevs (`vfioN`), with `/dev/iommu`.
    cdevs: Vec<String>,
}

fn prepared_devices(devices: &[ClaimDevice], files: &cdi::ClaimFiles) -> Vec<PreparedDevice> {
    devices
        .iter()
        .map(|d| PreparedDevice {
            request_names: d.request_names.clone(),
            pool_name: d.pool.clone(),
            device_name: d.device.clone(),
            cdi_device_ids: files.device_ids.get(&d.device).cloned().unwrap_or_default(),
        })
        .collect()
}

/// A step of `claim` failed; `after` says what was done about it.
fn failed(
    claim: &ClaimRef,
    step: &'static str,
    after: Option<String>,
    source: Box<ClaimStepError>,
) -> ClaimError {
    ClaimError::Failed {
        claim: claim.to_string(),
        step,
        after,
        source,
    }
}

fn device_list(devices: &[ClaimDevice]) -> String {
    let names: Vec<String> = devices
        .iter()
        .map(|d| format!("{} ({})", d.device, d.address))
        .collect();
    names.join(", ")
}
