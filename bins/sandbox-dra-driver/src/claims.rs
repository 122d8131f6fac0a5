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
//! Unprepare refuses a claim whose `/dev/vfio/<group>` is open, saves it as
//! `unpreparing`, removes its files, restores every recorded member of its groups and
//! only then forgets the claim. After a `kill -9` anywhere, [`Claims::recover`] rolls a
//! `preparing` claim back and finishes an `unpreparing` one, so a later unprepare still
//! restores the original drivers. A group belongs to at most one claim.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use crate::cdi::{self, AttributeValue, PCI_BUS_ID};
use passthrough::inventory::{Inventory, Role};
use passthrough::state::StateError;
use passthrough::state::{ClaimDevice, ClaimPhase, ClaimRecord};
use passthrough::{target_drivers, Passthrough, PassthroughError};
use sysfs_pci::io::IoError;
use sysfs_pci::module::ModuleError;
use sysfs_pci::{error_chain, Host, PciAddress};

/// A claim as kubelet names it in `NodePrepareResources`.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct ClaimRef {
    /// The claim's UID.
    pub uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl ClaimRef {
    /// Where an Event about this claim goes (its namespace, where `kubectl describe
    /// resourceclaim` and the pod's owner look), and how an error names the post.
    pub fn event_target(
        &self,
        reason: &str,
    ) -> (k8s_openapi::api::core::v1::ObjectReference, String) {
        let reference = k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("resource.k8s.io/v1".into()),
            kind: Some("ResourceClaim".into()),
            name: Some(self.name.clone()),
            namespace: Some(self.namespace.clone()),
            uid: Some(self.uid.clone()),
            ..Default::default()
        };
        let what = format!(
            "post Event {reason} on ResourceClaim {}/{}",
            self.namespace, self.name
        );
        (reference, what)
    }
}

/// One device the scheduler allocated to a claim, for this driver on this node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Allocation {
    /// The request(s) of the claim this device satisfies.
    pub request_names: Vec<String>,
    /// The pool (the node's name).
    pub pool: String,
    /// The device's name in the ResourceSlice ([`device_name`]).
    pub device: String,
}

/// What prepare gives back for one device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PreparedDevice {
    /// The request(s) it satisfies.
    pub request_names: Vec<String>,
    /// Its pool.
    pub pool_name: String,
    /// Its name in the ResourceSlice.
    pub device_name: String,
    /// The fully qualified CDI device ids the container runtime applies.
    pub cdi_device_ids: Vec<String>,
}

/// The ResourceSlice device name of a PCI function: a DNS label derived from its
/// address, `0000:01:00.0` → `pci-0000-01-00-0`.
pub fn device_name(address: &PciAddress) -> String {
    let s = address.to_string().replace([':', '.'], "-");
    format!("pci-{s}")
}

/// The PCI address a [`device_name`] stands for, if it is one.
pub fn parse_device_name(name: &str) -> Option<PciAddress> {
    let rest = name.strip_prefix("pci-")?;
    let parts: Vec<&str> = rest.split('-').collect();
    let [domain, bus, dev, func] = parts.as_slice() else {
        return None;
    };
    let text = format!("{domain}:{bus}:{dev}.{func}");
    let address: PciAddress = text.parse().ok()?;
    (device_name(&address) == name).then_some(address)
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

/// Why a claim could not be prepared or unprepared. Each names the claim.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The request cannot be served as asked; nothing was touched.
    #[error("claim {claim}: {reason}")]
    Refused {
        /// The claim.
        claim: String,
        /// Why.
        reason: String,
    },
    /// The claim's names make no valid CDI spec or metadata file; nothing was
    /// touched.
    #[error("claim {claim}: no valid CDI spec or metadata file can be made of it")]
    Unnamable {
        /// The claim.
        claim: String,
        /// Which name, and why.
        #[source]
        source: cdi::CdiError,
    },
    /// A device of the claim is not this node's to give: another pool, a name this
    /// driver does not publish, a function the resource list does not select.
    #[error("claim {claim}: {reason}")]
    NotOurs {
        /// The claim.
        claim: String,
        /// Why.
        reason: String,
    },
    /// A group of the claim is prepared for another claim; nothing was touched.
    #[error("claim {claim}: {reason}")]
    Held {
        /// The claim.
        claim: String,
        /// Which group, and the claim holding it.
        reason: String,
    },
    /// A VM still holds a group of the claim; nothing was touched; retry later.
    #[error(
        "claim {claim}: {} still open (a VM holds it); not giving the devices back yet",
        group_nodes(groups)
    )]
    InUse {
        /// The claim.
        claim: String,
        /// The held groups.
        groups: Vec<u32>,
    },
    /// A step failed. What was moved is put back where possible; the claim's record
    /// stays while anything of it is still on vfio, so a retry or a restart goes on.
    #[error("claim {claim}: {step}{}", after_note(after))]
    Failed {
        /// The claim.
        claim: String,
        /// The step.
        step: &'static str,
        /// What was done about it (the rollback of a prepare), if anything.
        after: Option<String>,
        /// What failed.
        #[source]
        source: Box<StepError>,
    },
}

fn after_note(after: &Option<String>) -> String {
    after
        .as_ref()
        .map(|a| format!(" ({a})"))
        .unwrap_or_default()
}

/// What a step of a claim's prepare or unprepare ran into.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The state file could not be saved.
    #[error(transparent)]
    State(#[from] StateError),
    /// The vfio modules could not be loaded.
    #[error(transparent)]
    Module(#[from] ModuleError),
    /// Groups could not be moved to vfio (each put back): each failure, named.
    #[error("{}", chains(.0))]
    Bind(Vec<PassthroughError>),
    /// Groups could not be given back: each failure, and the groups a VM holds.
    #[error("{}", give_back_note(failed, held))]
    GiveBack {
        /// Restores that failed.
        failed: Vec<PassthroughError>,
        /// Groups whose node a VM holds open.
        held: Vec<u32>,
    },
    /// A group node is missing after the bind.
    #[error("{} is missing", .0.display())]
    NoGroupNode(PathBuf),
    /// The claim's CDI spec or metadata could not be made.
    #[error(transparent)]
    Files(#[from] cdi::CdiError),
    /// A file could not be written or removed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// A directory could not be made or removed.
    #[error("cannot {action} {}", dir.display())]
    Dir {
        /// `create`, `remove`.
        action: &'static str,
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

fn boxed(e: impl Into<StepError>) -> Box<StepError> {
    Box::new(e.into())
}

fn chains(errors: &[PassthroughError]) -> String {
    let list: Vec<String> = errors.iter().map(|e| error_chain(e)).collect();
    list.join("; ")
}

fn give_back_note(failed: &[PassthroughError], held: &[u32]) -> String {
    let mut parts: Vec<String> = failed.iter().map(|e| error_chain(e)).collect();
    if !held.is_empty() {
        parts.push(format!("{} is open", group_nodes(held)));
    }
    parts.join("; ")
}

impl ClaimError {
    /// Why, in one word.
    pub fn failure(&self) -> Failure {
        match self {
            Self::Refused { .. } | Self::Unnamable { .. } => Failure::Refused,
            Self::NotOurs { .. } => Failure::NotOurs,
            Self::Held { .. } | Self::InUse { .. } => Failure::GroupHeld,
            Self::Failed { .. } => Failure::Failed,
        }
    }
}

/// Why a prepare or unprepare of a claim failed, in one word: the `reason` label of
/// the driver's failure metric and the reason of the Event on the claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Failure {
    /// An IOMMU group is prepared for another claim, or a VM still holds it.
    GroupHeld,
    /// The claim's devices are not this node's to give, or it has none.
    NotOurs,
    /// The call's deadline passed first; the work goes on.
    Timeout,
    /// The claim could not be read from the API server.
    ApiServer,
    /// kubelet unprepared the claim while this prepare was on its way.
    Unprepared,
    /// The request cannot be served as asked (names, a changed allocation).
    Refused,
    /// A step on the node failed (what was moved is put back).
    Failed,
}

impl Failure {
    /// Every failure, for series present at zero.
    pub const ALL: [Failure; 7] = [
        Failure::GroupHeld,
        Failure::NotOurs,
        Failure::Timeout,
        Failure::ApiServer,
        Failure::Unprepared,
        Failure::Refused,
        Failure::Failed,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::GroupHeld => "group_held",
            Self::NotOurs => "not_ours",
            Self::Timeout => "timeout",
            Self::ApiServer => "api_server",
            Self::Unprepared => "unprepared",
            Self::Refused => "refused",
            Self::Failed => "failed",
        }
    }

    /// The reason of an Event (UpperCamelCase, as Kubernetes writes them).
    pub fn event_reason(self) -> &'static str {
        match self {
            Self::GroupHeld => "IOMMUGroupHeld",
            Self::NotOurs => "NotOurDevice",
            Self::Timeout => "PrepareTimedOut",
            Self::ApiServer => "ClaimReadFailed",
            Self::Unprepared => "UnpreparedMeanwhile",
            Self::Refused => "PrepareRefused",
            Self::Failed => "PrepareFailed",
        }
    }
}

fn group_nodes(groups: &[u32]) -> String {
    let nodes: Vec<String> = groups.iter().map(|g| format!("/dev/vfio/{g}")).collect();
    nodes.join(", ")
}

/// Where a claim's files go, and how devices are handed to containers.
#[derive(Debug, Clone)]
pub struct Files {
    /// The DRA driver's name (the CDI vendor).
    pub driver: String,
    /// The CDI spec directory.
    pub cdi_dir: PathBuf,
    /// The device metadata directory.
    pub metadata_dir: PathBuf,
    /// Give containers the iommufd nodes too.
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
pub struct Claims<'a> {
    /// The passthrough engine, with the driver's state file.
    pub pt: Passthrough<'a>,
    /// This node's pool name.
    pub pool: &'a str,
    /// Where the claim files go.
    pub files: &'a Files,
}

impl Claims<'_> {
    /// Prepares `claim` for the devices the scheduler allocated to it, on `inv` (a
    /// fresh scan). Idempotent: a claim already prepared with the same devices gets
    /// the same answer without touching the node.
    ///
    /// `pod_claim_name` is the claim's `resource.kubernetes.io/pod-claim-name`
    /// annotation (a claim made from a template), which places its metadata file.
    pub fn prepare(
        &mut self,
        claim: &ClaimRef,
        pod_claim_name: Option<&str>,
        allocations: &[Allocation],
        inv: &Inventory,
    ) -> Result<Vec<PreparedDevice>, ClaimError> {
        let refuse = |reason: String| ClaimError::Refused {
            claim: claim.to_string(),
            reason,
        };
        let devices = self.resolve(claim, allocations, inv)?;
        // Refuse names no file can be made of before anything is touched.
        self.files_for(claim, pod_claim_name, &devices, inv)
            .map_err(|source| ClaimError::Unnamable {
                claim: claim.to_string(),
                source,
            })?;
        if let Some(existing) = self.pt.state.state().claims.get(&claim.uid) {
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
                    device_list(&devices)
                )));
            }
            match existing.phase {
                ClaimPhase::Prepared => return self.answer(claim, pod_claim_name, &devices, inv),
                // [`Self::settle`] finishes this before a prepare's scan.
                ClaimPhase::Unpreparing => {
                    return Err(refuse(
                        "an earlier unprepare or rollback of it is unfinished".into(),
                    ))
                }
                // A failed earlier attempt left it: go through the steps again.
                ClaimPhase::Preparing => {}
            }
        }
        let record = ClaimRecord {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            phase: ClaimPhase::Preparing,
            devices,
        };
        let fail = |step: &'static str, after: Option<String>, source: Box<StepError>| {
            ClaimError::Failed {
                claim: claim.to_string(),
                step,
                after,
                source,
            }
        };
        self.pt
            .state
            .set_claim(self.pt.kernel, &claim.uid, record.clone())
            .map_err(|e| {
                fail(
                    "saving the claim before touching its devices",
                    None,
                    boxed(e),
                )
            })?;
        sysfs_pci::failpoint::step("prepare-after-save");
        let groups = record.groups();
        let result = self.move_groups(inv, &groups).and_then(|()| {
            let files = self
                .files_for(claim, pod_claim_name, &record.devices, inv)
                .map_err(|e| ("writing its files", boxed(e)))?;
            for (path, text) in std::iter::once(&files.cdi).chain(files.metadata.iter()) {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).map_err(|source| {
                        (
                            "writing its files",
                            boxed(StepError::Dir {
                                action: "create",
                                dir: dir.to_owned(),
                                source,
                            }),
                        )
                    })?;
                }
                self.pt
                    .kernel
                    .replace_file(path, text.as_bytes())
                    .map_err(|e| ("writing its files", boxed(e)))?;
            }
            Ok(files)
        });
        let files = match result {
            Ok(files) => files,
            Err((step, source)) => {
                let undo = self.undo(&claim.uid, &record);
                return Err(fail(step, Some(undo), source));
            }
        };
        let prepared = ClaimRecord {
            phase: ClaimPhase::Prepared,
            ..record.clone()
        };
        if let Err(e) = self
            .pt
            .state
            .set_claim(self.pt.kernel, &claim.uid, prepared)
        {
            let undo = self.undo(&claim.uid, &record);
            return Err(fail("saving the prepared claim", Some(undo), boxed(e)));
        }
        Ok(answer(&record.devices, &files))
    }

    /// Forgets the claims whose devices are in another pool than ours, and the
    /// device records of their groups that no claim of ours shares: they describe
    /// another node, and acting on them (restoring "orphans") could move this
    /// node's devices of the same address.
    fn quarantine_foreign(&mut self, out: &mut Recovery) {
        let claims = self.pt.state.state().claims.clone();
        let (foreign, local): (Vec<_>, Vec<_>) = claims
            .iter()
            .partition(|(_, r)| r.devices.iter().any(|d| d.pool != self.pool));
        if foreign.is_empty() {
            return;
        }
        let local_groups: BTreeSet<u32> = local.iter().flat_map(|(_, r)| r.groups()).collect();
        let foreign_groups: BTreeSet<u32> = foreign
            .iter()
            .flat_map(|(_, r)| r.groups())
            .filter(|g| !local_groups.contains(g))
            .collect();
        let records: Vec<PciAddress> = self
            .pt
            .state
            .state()
            .devices
            .iter()
            .filter(|(_, r)| foreign_groups.contains(&r.group))
            .map(|(a, _)| *a)
            .collect();
        for a in records {
            if let Err(e) = self.pt.state.forget(self.pt.kernel, &a) {
                out.failed.push(format!(
                    "cannot forget {a}, recorded by a claim of another node: {}",
                    error_chain(&e)
                ));
            }
        }
        for (uid, r) in foreign {
            let pools: BTreeSet<&str> = r.devices.iter().map(|d| d.pool.as_str()).collect();
            let pools: Vec<&str> = pools.into_iter().collect();
            let shown = format!(
                "claim {}/{} (uid {uid}) of pool {} on {} (this node's pool is {})",
                r.namespace,
                r.name,
                pools.join(", "),
                device_list(&r.devices),
                self.pool
            );
            match self.pt.state.drop_claim(self.pt.kernel, uid) {
                Ok(()) => out.foreign.push(shown),
                Err(e) => out
                    .failed
                    .push(format!("cannot forget {shown}: {}", error_chain(&e))),
            }
        }
    }

    /// Finishes what an unprepare or a rollback of `claim` left half-done (a claim
    /// in phase `unpreparing`): call it before the scan a prepare of the claim
    /// uses, so a retry after the cause went away (a read-only CDI directory made
    /// writable) prepares afresh instead of being refused for good. Nothing to do
    /// is `Ok`.
    pub fn settle(&mut self, claim: &ClaimRef) -> Result<(), ClaimError> {
        match self.pt.state.state().claims.get(&claim.uid) {
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
        let Some(record) = self.pt.state.state().claims.get(&claim.uid).cloned() else {
            return Ok(());
        };
        let shown = ClaimRef {
            uid: claim.uid.clone(),
            namespace: record.namespace.clone(),
            name: record.name.clone(),
        };
        let held: Vec<u32> = record
            .groups()
            .into_iter()
            .filter(|g| {
                self.pt
                    .kernel
                    .group_in_use(&self.pt.host.vfio_group_node(*g))
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

    /// Converges after a restart: forgets claims of another pool (a state file
    /// from another node) and the device records of their groups without touching
    /// a device, rolls back claims caught half-prepared, finishes claims caught
    /// half-unprepared, and restores device records no claim owns.
    pub fn recover(&mut self) -> Recovery {
        let mut out = Recovery::default();
        self.quarantine_foreign(&mut out);
        let claims = self.pt.state.state().claims.clone();
        for (uid, record) in &claims {
            let claim = ClaimRef {
                uid: uid.clone(),
                namespace: record.namespace.clone(),
                name: record.name.clone(),
            };
            match record.phase {
                ClaimPhase::Prepared => {}
                ClaimPhase::Preparing => {
                    let undo = self.undo(uid, record);
                    if self.pt.state.state().claims.contains_key(uid) {
                        out.failed.push(format!("claim {claim}: {undo}"));
                    } else {
                        out.rolled_back.push(claim.to_string());
                    }
                }
                ClaimPhase::Unpreparing => match self.finish_unprepare(&claim, record.clone()) {
                    Ok(()) => out.finished.push(claim.to_string()),
                    Err(e) => out.failed.push(error_chain(&e)),
                },
            }
        }
        let owned: BTreeSet<u32> = self
            .pt
            .state
            .state()
            .claims
            .values()
            .flat_map(|c| c.groups())
            .collect();
        let orphans: Vec<PciAddress> = self
            .pt
            .state
            .state()
            .devices
            .iter()
            .filter(|(_, r)| !owned.contains(&r.group))
            .map(|(a, _)| *a)
            .collect();
        if !orphans.is_empty() {
            let report = self.pt.restore(&orphans);
            out.orphans.extend(report.restored.iter().map(|(a, _)| *a));
            out.orphans.extend(report.gone);
            out.failed
                .extend(report.failed.iter().map(|e| error_chain(e)));
            for (a, g) in report.in_use {
                out.failed
                    .push(format!("{a}: /dev/vfio/{g} is open; its record is kept"));
            }
        }
        out
    }

    /// Checks the allocation against this node and the other claims; nothing touched.
    fn resolve(
        &self,
        claim: &ClaimRef,
        allocations: &[Allocation],
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
            if a.pool != self.pool {
                return Err(not_ours(format!(
                    "device {} is in pool {:?}, not this node's pool {:?}",
                    a.device, a.pool, self.pool
                )));
            }
            let Some(address) = parse_device_name(&a.device) else {
                return Err(not_ours(format!(
                    "device {:?} is not a device this driver publishes",
                    a.device
                )));
            };
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
            if let Some((uid, other)) =
                self.pt.state.state().claims.iter().find(|(uid, c)| {
                    **uid != claim.uid && c.devices.iter().any(|d| d.group == group)
                })
            {
                return Err(ClaimError::Held {
                    claim: claim.to_string(),
                    reason: format!(
                    "device {} ({address}) is in IOMMU group {group}, which is prepared for claim {}/{} (uid {uid})",
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
            });
        }
        Ok(devices)
    }

    /// Loads the drivers' modules and binds `groups` whole.
    fn move_groups(
        &mut self,
        inv: &Inventory,
        groups: &[u32],
    ) -> Result<(), (&'static str, Box<StepError>)> {
        self.pt
            .load_modules(&target_drivers(inv, groups))
            .map_err(|e| ("loading the vfio modules", boxed(e)))?;
        let report = self.pt.bind(inv, groups);
        if !report.failed.is_empty() {
            return Err((
                "moving its IOMMU groups to vfio",
                boxed(StepError::Bind(report.failed)),
            ));
        }
        for &g in groups {
            let node = self.pt.host.vfio_group_node(g);
            if !self.pt.kernel.is_dry_run() && !Host::exists(&node) {
                return Err((
                    "checking the group nodes",
                    boxed(StepError::NoGroupNode(node)),
                ));
            }
        }
        Ok(())
    }

    /// The claim's files, as prepare writes them.
    fn files_for(
        &self,
        claim: &ClaimRef,
        pod_claim_name: Option<&str>,
        devices: &[ClaimDevice],
        inv: &Inventory,
    ) -> Result<cdi::ClaimFiles, cdi::CdiError> {
        let devices: Vec<cdi::SpecDevice> = devices
            .iter()
            .map(|d| {
                let mut attributes = BTreeMap::new();
                attributes.insert(
                    PCI_BUS_ID.to_owned(),
                    AttributeValue::String(d.address.to_string()),
                );
                if let Some(r) = inv.get(&d.address).and_then(|e| e.resource()) {
                    attributes.insert(
                        "resourceName".to_owned(),
                        AttributeValue::String(r.to_string()),
                    );
                }
                cdi::SpecDevice {
                    device_name: d.device.clone(),
                    pool: d.pool.clone(),
                    request_names: d.request_names.clone(),
                    address: d.address,
                    group: d.group,
                    attributes,
                    iommufd_node: self
                        .files
                        .iommufd
                        .then(|| vfio_dev_node(self.pt.host, &d.address))
                        .flatten(),
                }
            })
            .collect();
        cdi::claim_files(
            &self.files.driver,
            &self.files.cdi_dir,
            &self.files.metadata_dir,
            &self.pt.host.dev,
            claim,
            pod_claim_name,
            &devices,
        )
    }

    /// The answer for a claim already prepared.
    fn answer(
        &self,
        claim: &ClaimRef,
        pod_claim_name: Option<&str>,
        devices: &[ClaimDevice],
        inv: &Inventory,
    ) -> Result<Vec<PreparedDevice>, ClaimError> {
        let files = self
            .files_for(claim, pod_claim_name, devices, inv)
            .map_err(|e| ClaimError::Failed {
                claim: claim.to_string(),
                step: "naming its CDI devices",
                after: None,
                source: boxed(e),
            })?;
        Ok(answer(devices, &files))
    }

    /// Puts a half-prepared claim back: its files removed, its groups restored, the
    /// claim forgotten once nothing of it is left on vfio. Says what happened.
    fn undo(&mut self, uid: &str, record: &ClaimRecord) -> String {
        let claim = ClaimRef {
            uid: uid.to_owned(),
            namespace: record.namespace.clone(),
            name: record.name.clone(),
        };
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
        let fail = |step: &'static str, source: Box<StepError>| ClaimError::Failed {
            claim: claim.to_string(),
            step,
            after: None,
            source,
        };
        if record.phase != ClaimPhase::Unpreparing {
            let next = ClaimRecord {
                phase: ClaimPhase::Unpreparing,
                ..record.clone()
            };
            self.pt
                .state
                .set_claim(self.pt.kernel, &claim.uid, next)
                .map_err(|e| fail("saving the claim before giving its devices back", boxed(e)))?;
        }
        sysfs_pci::failpoint::step("unprepare-after-save");
        self.remove_files(claim)
            .map_err(|e| fail("removing its files", boxed(e)))?;
        let groups = record.groups();
        let members: Vec<PciAddress> = self
            .pt
            .state
            .state()
            .devices
            .iter()
            .filter(|(_, r)| groups.contains(&r.group))
            .map(|(a, _)| *a)
            .collect();
        if !members.is_empty() {
            let report = self.pt.restore(&members);
            let held: BTreeSet<u32> = report.in_use.iter().map(|(_, g)| *g).collect();
            if !report.failed.is_empty() || !held.is_empty() {
                return Err(fail(
                    "giving its devices back",
                    boxed(StepError::GiveBack {
                        failed: report.failed,
                        held: held.into_iter().collect(),
                    }),
                ));
            }
        }
        self.pt
            .state
            .drop_claim(self.pt.kernel, &claim.uid)
            .map_err(|e| fail("forgetting the claim", boxed(e)))
    }

    /// Removes the files prepare may have written for the claim.
    fn remove_files(&self, claim: &ClaimRef) -> Result<(), StepError> {
        let f = &self.files;
        // A uid no file can be named after never had files.
        if let Ok(spec) = cdi::cdi_spec_path(&f.driver, &f.cdi_dir, &claim.uid) {
            sysfs_pci::io::remove_if_present(&spec)?;
        }
        if let Ok(dir) = cdi::metadata_claim_dir(&f.driver, &f.metadata_dir, &claim.uid) {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(StepError::Dir {
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

fn answer(devices: &[ClaimDevice], files: &cdi::ClaimFiles) -> Vec<PreparedDevice> {
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

fn device_list(devices: &[ClaimDevice]) -> String {
    let names: Vec<String> = devices
        .iter()
        .map(|d| format!("{} ({})", d.device, d.address))
        .collect();
    names.join(", ")
}

/// The `vfioN` character device name of a function bound to vfio-pci with iommufd
/// (`<device>/vfio-dev/vfioN`), if the kernel made one.
fn vfio_dev_node(host: &Host, address: &PciAddress) -> Option<String> {
    let dir = host.device_dir(address).join("vfio-dev");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("vfio"))
        .collect();
    names.sort();
    names.into_iter().next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_round_trip_and_reject_other_spellings() {
        let a: PciAddress = "0000:01:00.1".parse().expect("address");
        assert_eq!(device_name(&a), "pci-0000-01-00-1");
        assert_eq!(parse_device_name("pci-0000-01-00-1"), Some(a));
        for bad in [
            "",
            "pci-",
            "pci-01-00-1",
            "gpu-0000-01-00-1",
            "pci-0000-01-00-1-2",
            "pci-0000-0A-00-1",
            "pci-0000-01-00-9",
        ] {
            assert_eq!(parse_device_name(bad), None, "{bad}");
        }
    }
}
