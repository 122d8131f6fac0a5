//! Device health for kubelet (KEP-4680, the DRA part): the board that judges each
//! device, whose reports [`kubelet_plugin`] streams to kubelet (`DRAResourceHealth`)
//! and whose reasons taint the devices in the slice.
//!
//! kubelet shows the result in
//! `pod.status.containerStatuses[].allocatedResourcesStatus[].resources[]`
//! (`resourceID` = the device's first CDI id, `health`, `message`); what it does
//! with the stream is in `lib/kubelet-plugin/src/health.rs`.
//!
//! Which verdict a device gets, and when, is in docs/sandbox-dra-driver.md
//! ("Device health to kubelet"): [`assess`] gives one function's, and
//! [`group_reports`] a whole group's from its members'. Each message names the
//! device and the cause, at most 1024 characters as kubelet wants them.
//!
//! The board is fed by the one node watcher of the driver (every PCI uevent and
//! `/dev/vfio` change, and its resync) and by the worker after every prepare and
//! unprepare; a change reaches every open stream without waiting for the API
//! server.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use kubelet_plugin::{DeviceHealth, Health, HealthReports};
use node_agent::watch::Changes;
use passthrough::config::ResourceList;
use passthrough::inventory::Inventory;
use sysfs_pci::deadline::StuckList;
use sysfs_pci::interrupts::{InterruptIsolation, Verdict};
use sysfs_pci::{Host, PciAddress};
use tokio::sync::watch;

use crate::model::{device_name, group_device_name, reason};

/// One device's report, and why it should get no new claim (the value of its
/// taint in the slice), if so.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Known {
    report: DeviceHealth,
    reason: Option<&'static str>,
}

/// Keeps each device's health and hands it to every open stream.
pub struct HealthBoard {
    pool: String,
    host: Host,
    list: ResourceList,
    stuck: StuckList,
    inner: Mutex<Inner>,
    tx: watch::Sender<HealthReports>,
}

#[derive(Default)]
struct Inner {
    /// Every device seen selected, with its last report.
    known: BTreeMap<PciAddress, Known>,
    /// The IOMMU group each known device was last seen in.
    groups: BTreeMap<PciAddress, Option<u32>>,
    /// Devices of prepared claims.
    prepared: BTreeSet<PciAddress>,
    /// Devices that joined or left `prepared` and have not been read again since.
    unread: BTreeSet<PciAddress>,
    /// `aer_dev_fatal` totals when first seen.
    fatal_baseline: BTreeMap<PciAddress, u64>,
    /// Devices with a sysfs write that has not returned, as last seen.
    stuck: BTreeSet<PciAddress>,
    /// The node's interrupt isolation as last read, once read.
    interrupts: Option<InterruptIsolation>,
}

impl std::fmt::Debug for HealthBoard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthBoard")
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl HealthBoard {
    /// A board for this node's pool; nothing known yet. `stuck` is the kernel
    /// door's list of writes that have not returned.
    pub fn new(pool: &str, host: Host, list: ResourceList, stuck: StuckList) -> Self {
        Self {
            pool: pool.to_owned(),
            host,
            list,
            stuck,
            inner: Mutex::default(),
            tx: watch::Sender::new(Arc::new(Vec::new())),
        }
    }

    /// The pool every report names.
    pub fn pool(&self) -> &str {
        &self.pool
    }

    /// The devices that should get no new claim now, with their reasons.
    pub fn unhealthy(&self) -> BTreeMap<PciAddress, &'static str> {
        support::lock(&self.inner)
            .known
            .iter()
            .filter_map(|(a, k)| k.reason.map(|why| (*a, why)))
            .collect()
    }

    /// Every report now, and each change after.
    pub fn subscribe(&self) -> watch::Receiver<HealthReports> {
        self.tx.subscribe()
    }

    /// Reads the whole node again and tells every stream what changed. A scan that
    /// fails changes nothing (the next event or resync tries again).
    pub fn refresh(&self) {
        self.read_interrupts();
        match Inventory::scan(&self.host, &self.list) {
            Ok(inv) => self.update(&inv, None),
            Err(e) => {
                tracing::warn!(error = %support::error_chain(&e),
                    "cannot read the node for device health; keeping the last reports")
            }
        }
    }

    /// Reads the node's interrupt isolation ([`sysfs_pci::interrupts`]): without
    /// it no VMM can take a device, so every device is unhealthy, and so tainted
    /// (or withdrawn where the API server drops taints) — the scheduler then
    /// allocates none of them. Said when the verdict changes (a module parameter
    /// can change at run time; the hardware's state only at a reboot).
    fn read_interrupts(&self) {
        self.judge_interrupts(InterruptIsolation::read(&self.host));
    }

    /// Takes `found` as the node's interrupt isolation; whether the verdict changed.
    fn judge_interrupts(&self, found: InterruptIsolation) -> bool {
        let verdict = found.verdict();
        let mut inner = support::lock(&self.inner);
        if inner.interrupts.as_ref().map(InterruptIsolation::verdict) == Some(verdict) {
            return false;
        }
        match verdict {
            Verdict::Isolated(_) => tracing::info!("{}", found.finding()),
            Verdict::UnsafeAllowed => {
                tracing::warn!(
                    "{}; {}",
                    found.finding(),
                    found.warning().unwrap_or_default()
                )
            }
            Verdict::Missing => tracing::error!(
                fix = %found.fix(),
                "{}: no VM can be given a device on this node, so every device is \
                    unhealthy and tainted (withdrawn from the ResourceSlice where the \
                    API server drops taints)",
                found.finding()
            ),
        }
        inner.interrupts = Some(found);
        true
    }

    /// On a node without isolation, reads the modules' `allow_unsafe_interrupts`
    /// again (they can change while the node runs; the chips cannot), and every
    /// device when that changes the verdict.
    fn recheck_unsafe_interrupts(&self) {
        let mut found = match &support::lock(&self.inner).interrupts {
            Some(f) if f.isolator().is_none() => f.clone(),
            _ => return,
        };
        found.unsafe_allowed = InterruptIsolation::read_unsafe_allowed(&self.host);
        if self.judge_interrupts(found) {
            self.refresh();
        }
    }

    /// Reads again only what a batch of node events touches: the devices named and
    /// every member of the groups named or theirs (before and now), so the work
    /// follows the change, not the size of the node. A full batch reads everything.
    pub fn refresh_changes(&self, changes: &Changes) {
        if changes.full {
            return self.refresh();
        }
        let mut groups = changes.groups.clone();
        {
            let inner = support::lock(&self.inner);
            for a in &changes.addresses {
                groups.extend(inner.groups.get(a).copied().flatten());
            }
        }
        for a in &changes.addresses {
            if let Ok(Some(g)) = sysfs_pci::device::iommu_group_of(&self.host, a) {
                groups.insert(g);
            }
        }
        self.refresh_scope(changes.addresses.clone(), &groups);
    }

    /// [`Self::refresh_changes`] for `addresses` and the members of `groups`.
    fn refresh_scope(&self, mut scope: BTreeSet<PciAddress>, groups: &BTreeSet<u32>) {
        for &g in groups {
            match sysfs_pci::group::members(&self.host, g) {
                Ok(m) => scope.extend(m),
                Err(_) => return self.refresh(),
            }
        }
        {
            let inner = support::lock(&self.inner);
            scope.extend(
                inner
                    .groups
                    .iter()
                    .filter(|(_, g)| g.is_some_and(|g| groups.contains(&g)))
                    .map(|(a, _)| *a),
            );
        }
        let addresses: Vec<PciAddress> = scope.iter().copied().collect();
        let inv = Inventory::scan_addresses(
            &self.host,
            &self.list,
            &addresses,
            sysfs_pci::device::Detail::Brief,
        );
        self.update(&inv, Some(&scope));
    }

    /// Looks at the stuck writes again (they end without any event); reads again the
    /// devices that became stuck or came free. On a node without interrupt
    /// isolation, looks at the modules' `allow_unsafe_interrupts` too.
    pub fn check_stuck(&self) {
        self.recheck_unsafe_interrupts();
        let now: BTreeSet<PciAddress> = self.stuck.get().into_keys().collect();
        let moved: BTreeSet<PciAddress> = {
            let inner = support::lock(&self.inner);
            inner.stuck.symmetric_difference(&now).copied().collect()
        };
        if !moved.is_empty() {
            self.refresh_scope(moved, &BTreeSet::new());
        }
    }

    /// The devices of prepared claims are now `prepared`; reads again those that
    /// joined or left, with their groups (and those [`Self::expect_prepared`] left
    /// unread).
    pub fn set_prepared(&self, prepared: BTreeSet<PciAddress>) {
        self.expect_prepared(prepared);
        let (moved, groups) = {
            let mut inner = support::lock(&self.inner);
            let moved = std::mem::take(&mut inner.unread);
            let groups: BTreeSet<u32> = moved
                .iter()
                .filter_map(|a| inner.groups.get(a).copied().flatten())
                .collect();
            (moved, groups)
        };
        if !moved.is_empty() {
            self.refresh_scope(moved, &groups);
        }
    }

    /// The devices of prepared claims are now `prepared`, and are judged so from
    /// now on; those that joined or left are read again at the next
    /// [`Self::set_prepared`] (a claim's give-back sets this before its moves and
    /// reads the devices after them, once kubelet has its answer).
    pub fn expect_prepared(&self, prepared: BTreeSet<PciAddress>) {
        let mut inner = support::lock(&self.inner);
        let moved: Vec<PciAddress> = inner
            .prepared
            .symmetric_difference(&prepared)
            .copied()
            .collect();
        inner.unread.extend(moved);
        inner.prepared = prepared;
    }

    /// Takes a scan of the devices in `scope` (every device when `None`) into the
    /// reports; sends them when one changed.
    pub fn update(&self, inv: &Inventory, scope: Option<&BTreeSet<PciAddress>>) {
        let now = support::time::unix_now();
        let mut inner = support::lock(&self.inner);
        let withdrawn: BTreeMap<PciAddress, String> = crate::devices::withdrawn(inv)
            .into_iter()
            .map(|w| (w.address, w.reason))
            .collect();
        let mut addresses: BTreeSet<PciAddress> =
            inv.selected().map(|e| e.device.address).collect();
        addresses.extend(
            inner
                .known
                .keys()
                .filter(|a| scope.is_none_or(|s| s.contains(a)))
                .copied(),
        );
        let stuck = self.stuck.get();
        inner.stuck = stuck.keys().copied().collect();
        // Why no VM can take a device here, when the node isolates no interrupts.
        let no_isolation = inner
            .interrupts
            .as_ref()
            .filter(|f| f.verdict() == Verdict::Missing)
            .map(|f| format!("{}; {}", f.finding(), f.fix()));
        let mut changed = false;
        for address in addresses {
            if let Some(e) = inv.get(&address) {
                inner.groups.insert(address, e.device.iommu_group);
            }
            let fatal = sysfs_pci::device::aer_fatal_total(&self.host, &address);
            let baseline = match fatal {
                Some(n) => *inner.fatal_baseline.entry(address).or_insert(n),
                None => 0,
            };
            let (health, reason, message) = match (stuck.get(&address), &no_isolation) {
                (Some(w), _) => (Health::Unhealthy, Some(reason::STUCK), w.to_string()),
                (None, Some(why)) if inv.get(&address).is_some() => (
                    Health::Unhealthy,
                    Some(reason::NO_INTERRUPT_ISOLATION),
                    format!("{address} cannot be given to a VM: {why}"),
                ),
                (None, _) => assess(
                    &self.host,
                    inv,
                    &address,
                    inner.prepared.contains(&address),
                    withdrawn.get(&address),
                    fatal.map(|n| n.saturating_sub(baseline)),
                ),
            };
            let old = inner.known.get(&address).map(|k| &k.report);
            if old.is_some_and(|old| old.health == health && old.message == message) {
                continue;
            }
            let was = old.map(|old| old.health);
            let report = DeviceHealth {
                pool: self.pool.clone(),
                device: device_name(&address),
                health,
                message,
                since: now,
            };
            match (was, health) {
                (Some(was), Health::Healthy) if was != Health::Healthy => {
                    tracing::info!(bdf = %address, "device healthy again")
                }
                (w, Health::Unhealthy) if w != Some(Health::Unhealthy) => {
                    tracing::warn!(bdf = %address, why = %report.message, "device unhealthy")
                }
                _ => {}
            }
            inner.known.insert(address, Known { report, reason });
            changed = true;
        }
        if changed {
            let mut all: Vec<DeviceHealth> =
                inner.known.values().map(|k| k.report.clone()).collect();
            all.extend(group_reports(&inner.known, &inner.groups));
            self.tx.send_replace(Arc::new(all));
        }
    }
}

/// The health of each whole-group device ([`crate::model::group_device_name`]):
/// for every IOMMU group of several known functions, unhealthy when any of them
/// is, with their messages, changed when the last of them changed.
fn group_reports(
    known: &BTreeMap<PciAddress, Known>,
    groups: &BTreeMap<PciAddress, Option<u32>>,
) -> Vec<DeviceHealth> {
    let mut members: BTreeMap<u32, Vec<&PciAddress>> = BTreeMap::new();
    for a in known.keys() {
        if let Some(Some(g)) = groups.get(a) {
            members.entry(*g).or_default().push(a);
        }
    }
    members
        .into_values()
        .filter(|m| m.len() > 1)
        .filter_map(|m| {
            let reports: Vec<&DeviceHealth> = m.iter().map(|a| &known[*a].report).collect();
            let first = reports.first()?;
            let bad: Vec<String> = m
                .iter()
                .zip(&reports)
                .filter(|(_, r)| r.health == Health::Unhealthy)
                .map(|(a, r)| format!("{a}: {}", r.message))
                .collect();
            let (health, message) = if bad.is_empty() {
                (
                    Health::Healthy,
                    format!("all {} functions healthy", m.len()),
                )
            } else {
                (Health::Unhealthy, bad.join("; "))
            };
            Some(DeviceHealth {
                pool: first.pool.clone(),
                device: group_device_name(m[0]),
                health,
                message,
                since: reports.iter().map(|r| r.since).max().unwrap_or(first.since),
            })
        })
        .collect()
}

/// One device's health on `inv`, its reason and why.
fn assess(
    host: &Host,
    inv: &Inventory,
    address: &PciAddress,
    prepared: bool,
    withdrawn: Option<&String>,
    new_fatal: Option<u64>,
) -> (Health, Option<&'static str>, String) {
    let bad = |r: &'static str, m: String| (Health::Unhealthy, Some(r), m);
    let Some(entry) = inv.get(address) else {
        if let Some(s) = inv.skipped.iter().find(|s| &s.address == address) {
            return bad(reason::UNREADABLE, format!("{address} cannot be read: {s}"));
        }
        return bad(reason::GONE, format!("{address} is gone from the PCI bus"));
    };
    if let Some(n) = new_fatal.filter(|n| *n > 0) {
        return bad(
            reason::FATAL_PCIE_ERROR,
            format!(
                "{address} reported {n} fatal PCIe error(s) since the driver \
                    started (aer_dev_fatal)"
            ),
        );
    }
    if prepared {
        let d = &entry.device;
        if !entry.is_bound() {
            return bad(
                reason::NOT_ON_VFIO,
                format!(
                    "{address} is prepared for a VM but on {} instead of {}",
                    d.driver.as_deref().unwrap_or("no driver"),
                    entry.target_driver
                ),
            );
        }
        if let Some(p) = inv.group_problem(host, d.iommu_group) {
            return bad(
                reason::GROUP_NOT_USABLE,
                format!("{address} is prepared for a VM, but {p}"),
            );
        }
        return (
            Health::Healthy,
            None,
            format!("{address} is on {} for a VM", entry.target_driver),
        );
    }
    if let Some(why) = withdrawn {
        return bad(
            reason::UNPREPARABLE,
            format!("{address} cannot be prepared: {why}"),
        );
    }
    (
        Health::Healthy,
        None,
        format!(
            "{address} is ready to be prepared (on {})",
            entry.device.driver.as_deref().unwrap_or("no driver")
        ),
    )
}
