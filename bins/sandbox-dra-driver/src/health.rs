//! Device health for kubelet (KEP-4680, the DRA part): the `DRAResourceHealth`
//! stream kubelet reads from our endpoint socket, and the board behind it.
//!
//! # What kubelet does with it
//!
//! (kubernetes `pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`, `manager.go`,
//! `healthinfo.go`; proto `staging/src/k8s.io/kubelet/pkg/apis/dra-health/{v1alpha1,v1}`.)
//! With the `ResourceHealthStatus` gate on, kubelet opens `NodeWatchResources` on
//! the connection it already has to `dra.sock`, right after the driver registers,
//! and keeps it open (no deadline). Newer kubelets only do so when the driver lists
//! `v1.DRAResourceHealth` or `v1alpha1.DRAResourceHealth` in its supported
//! versions (v1 preferred); 1.36 re-dials every 5 s whatever the outcome. Each
//! response is merged device by device (`pool/device`): kubelet stamps it with its
//! own clock, and a device no later response mentions turns `Unknown` after its
//! `health_check_timeout_seconds` (default 30 s). When the stream ends, every device
//! of the driver reads `Unknown`. Kubelet shows the result in
//! `pod.status.containerStatuses[].allocatedResourcesStatus[].resources[]`
//! (`resourceID` = the device's first CDI id, `health`, `message`).
//!
//! # What we send
//!
//! Every device the driver has seen selected on this node, by its slice name, at
//! once when the stream opens, again within moments of any change, and at least
//! every [`RESEND`] (well inside our [`TIMEOUT`]):
//! - **Unhealthy** when it is gone from the PCI bus, cannot be read, cannot be
//!   prepared (withdrawn from the slice: no IOMMU group, a group member with VFs
//!   enabled), has had a fatal PCIe error since the driver started (`aer_dev_fatal`,
//!   where sysfs has it), has a sysfs write that has not returned (its driver is
//!   stuck in the kernel, past `--write-timeout`), or is prepared for a claim but no
//!   longer usable by its VM: not on its vfio driver, its IOMMU group not viable or
//!   its group node gone;
//! - **Healthy** otherwise;
//! - each with a message a person understands (at most 1024 characters, as kubelet
//!   wants them).
//!
//! The board is fed by the one node watcher of the driver (every PCI uevent and
//! `/dev/vfio` change, and its resync) and by the worker after every prepare and
//! unprepare; a change reaches every open stream without waiting for the API
//! server.

use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kubelet_api::dra_health::{v1, v1alpha1};
use node_agent::watch::Changes;
use passthrough::config::ResourceList;
use passthrough::inventory::Inventory;
use sysfs_pci::deadline::StuckList;
use sysfs_pci::{Host, PciAddress};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::claims::device_name;

/// How long kubelet keeps one of our reports (`health_check_timeout_seconds`).
pub const TIMEOUT: Duration = Duration::from_secs(60);
/// The whole list is sent again at least this often, so no report times out.
pub const RESEND: Duration = Duration::from_secs(20);
/// The longest message kubelet keeps whole.
const MESSAGE_MAX: usize = 1024;

/// A device's health, as the proto's `HealthStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Health {
    /// Usable.
    Healthy,
    /// Not usable; the message says why.
    Unhealthy,
}

/// One device's report.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceReport {
    /// Its slice name (`pci-0000-01-00-0`).
    pub device: String,
    /// Its address.
    pub address: PciAddress,
    /// Healthy or not.
    pub health: Health,
    /// Why not, or what it is.
    pub message: String,
    /// Why not, in one word (the value of the device's taint in the slice).
    pub reason: Option<&'static str>,
    /// Unix seconds of the last change of `health` or `message`.
    pub since: i64,
}

/// The reports of every device, sorted by address.
pub type Reports = Arc<Vec<DeviceReport>>;

/// Keeps each device's health and hands it to every open stream.
pub struct HealthBoard {
    pool: String,
    host: Host,
    list: ResourceList,
    stuck: StuckList,
    inner: Mutex<Inner>,
    tx: watch::Sender<Reports>,
}

#[derive(Default)]
struct Inner {
    /// Every device seen selected, with its last report.
    known: BTreeMap<PciAddress, DeviceReport>,
    /// The IOMMU group each known device was last seen in.
    groups: BTreeMap<PciAddress, Option<u32>>,
    /// Devices of prepared claims.
    prepared: BTreeSet<PciAddress>,
    /// `aer_dev_fatal` totals when first seen.
    fatal_baseline: BTreeMap<PciAddress, u64>,
    /// Devices with a sysfs write that has not returned, as last seen.
    stuck: BTreeSet<PciAddress>,
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
        self.tx
            .borrow()
            .iter()
            .filter_map(|r| r.reason.map(|why| (r.address, why)))
            .collect()
    }

    /// Every report now, and each change after.
    pub fn subscribe(&self) -> watch::Receiver<Reports> {
        self.tx.subscribe()
    }

    /// Reads the whole node again and tells every stream what changed. A scan that
    /// fails changes nothing (the next event or resync tries again).
    pub fn refresh(&self) {
        match Inventory::scan(&self.host, &self.list) {
            Ok(inv) => self.update(&inv, None),
            Err(e) => {
                tracing::warn!(error = %sysfs_pci::error_chain(&e), "cannot read the node for device health; keeping the last reports")
            }
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
            let inner = sysfs_pci::kernel::lock(&self.inner);
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
            let inner = sysfs_pci::kernel::lock(&self.inner);
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
    /// devices that became stuck or came free.
    pub fn check_stuck(&self) {
        let now: BTreeSet<PciAddress> = self.stuck.get().into_keys().collect();
        let moved: BTreeSet<PciAddress> = {
            let inner = sysfs_pci::kernel::lock(&self.inner);
            inner.stuck.symmetric_difference(&now).copied().collect()
        };
        if !moved.is_empty() {
            self.refresh_scope(moved, &BTreeSet::new());
        }
    }

    /// The devices of prepared claims are now `prepared`; reads again those that
    /// joined or left, with their groups.
    pub fn set_prepared(&self, prepared: BTreeSet<PciAddress>) {
        let (moved, groups) = {
            let mut inner = sysfs_pci::kernel::lock(&self.inner);
            let moved: BTreeSet<PciAddress> = inner
                .prepared
                .symmetric_difference(&prepared)
                .copied()
                .collect();
            let groups: BTreeSet<u32> = moved
                .iter()
                .filter_map(|a| inner.groups.get(a).copied().flatten())
                .collect();
            inner.prepared = prepared;
            (moved, groups)
        };
        if !moved.is_empty() {
            self.refresh_scope(moved, &groups);
        }
    }

    /// Takes a scan of the devices in `scope` (every device when `None`) into the
    /// reports; sends them when one changed.
    pub fn update(&self, inv: &Inventory, scope: Option<&BTreeSet<PciAddress>>) {
        let now = unix_now();
        let mut inner = sysfs_pci::kernel::lock(&self.inner);
        let withdrawn: BTreeMap<PciAddress, String> = crate::slices::withdrawn(inv)
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
            let (health, reason, message) = match stuck.get(&address) {
                Some(w) => (Health::Unhealthy, Some(reason::STUCK), w.to_string()),
                None => assess(
                    &self.host,
                    inv,
                    &address,
                    inner.prepared.contains(&address),
                    withdrawn.get(&address),
                    fatal.map(|n| n.saturating_sub(baseline)),
                ),
            };
            let message = truncate(message);
            let report = match inner.known.get(&address) {
                Some(old) if old.health == health && old.message == message => continue,
                _ => DeviceReport {
                    device: device_name(&address),
                    address,
                    health,
                    message,
                    reason,
                    since: now,
                },
            };
            if let Some(old) = inner.known.get(&address) {
                if old.health != report.health {
                    match report.health {
                        Health::Healthy => tracing::info!(bdf = %address, "device healthy again"),
                        Health::Unhealthy => {
                            tracing::warn!(bdf = %address, why = %report.message, "device unhealthy")
                        }
                    }
                }
            } else if report.health == Health::Unhealthy {
                tracing::warn!(bdf = %address, why = %report.message, "device unhealthy");
            }
            inner.known.insert(address, report);
            changed = true;
        }
        if changed {
            let all: Vec<DeviceReport> = inner.known.values().cloned().collect();
            self.tx.send_replace(Arc::new(all));
        }
    }
}

/// Why a device is unhealthy, in one word: the values of its slice taint.
pub mod reason {
    /// Gone from the PCI bus.
    pub const GONE: &str = "Gone";
    /// Its sysfs attributes cannot be read.
    pub const UNREADABLE: &str = "Unreadable";
    /// A fatal PCIe error since the driver started.
    pub const FATAL_PCIE_ERROR: &str = "FatalPCIeError";
    /// Prepared, but not on its vfio driver.
    pub const NOT_ON_VFIO: &str = "NotOnVfioDriver";
    /// Prepared, but its IOMMU group is not viable or its group node is gone.
    pub const GROUP_NOT_USABLE: &str = "GroupNotUsable";
    /// It cannot be prepared (no IOMMU group, a member with VFs enabled).
    pub const UNPREPARABLE: &str = "Unpreparable";
    /// A sysfs write to it has not returned (its driver is stuck in the kernel).
    pub const STUCK: &str = "StuckInKernel";
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
            format!("{address} reported {n} fatal PCIe error(s) since the driver started (aer_dev_fatal)"),
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

/// At most [`MESSAGE_MAX`] characters: 1021 and `...`, as kubelet cuts them.
fn truncate(message: String) -> String {
    if message.chars().count() <= MESSAGE_MAX {
        return message;
    }
    let mut cut: String = message.chars().take(MESSAGE_MAX - 3).collect();
    cut.push_str("...");
    cut
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// The v1 response for `reports` in `pool`.
pub fn v1_response(pool: &str, reports: &[DeviceReport]) -> v1::NodeWatchResourcesResponse {
    v1::NodeWatchResourcesResponse {
        devices: reports
            .iter()
            .map(|r| v1::DeviceHealth {
                device: Some(v1::DeviceIdentifier {
                    pool_name: pool.to_owned(),
                    device_name: r.device.clone(),
                }),
                health: match r.health {
                    Health::Healthy => v1::HealthStatus::Healthy,
                    Health::Unhealthy => v1::HealthStatus::Unhealthy,
                } as i32,
                last_updated_time: r.since,
                health_check_timeout_seconds: i64::try_from(TIMEOUT.as_secs()).unwrap_or(60),
                message: r.message.clone(),
            })
            .collect(),
    }
}

/// The same response in v1alpha1 (field for field the same message).
fn v1alpha1_response(r: v1::NodeWatchResourcesResponse) -> v1alpha1::NodeWatchResourcesResponse {
    v1alpha1::NodeWatchResourcesResponse {
        devices: r
            .devices
            .into_iter()
            .map(|d| v1alpha1::DeviceHealth {
                device: d.device.map(|i| v1alpha1::DeviceIdentifier {
                    pool_name: i.pool_name,
                    device_name: i.device_name,
                }),
                health: d.health,
                last_updated_time: d.last_updated_time,
                health_check_timeout_seconds: d.health_check_timeout_seconds,
                message: d.message,
            })
            .collect(),
    }
}

/// A stream of responses: the whole list now, after every change, and at least
/// every [`RESEND`]; it ends when kubelet goes away.
fn watch_stream<T: Send + 'static>(
    board: &HealthBoard,
    convert: fn(v1::NodeWatchResourcesResponse) -> T,
) -> ReceiverStream<Result<T, Status>> {
    let mut rx = board.subscribe();
    let pool = board.pool.clone();
    let (tx, out) = mpsc::channel(4);
    tokio::spawn(async move {
        loop {
            let reports = rx.borrow_and_update().clone();
            if tx
                .send(Ok(convert(v1_response(&pool, &reports))))
                .await
                .is_err()
            {
                return;
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                () = tokio::time::sleep(RESEND) => {}
                () = tx.closed() => return,
            }
        }
    });
    ReceiverStream::new(out)
}

/// `DRAResourceHealth` in both versions, on the DRA endpoint.
#[derive(Clone)]
pub struct HealthService(pub Arc<HealthBoard>);

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl v1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = Boxed<v1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _: Request<v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        tracing::debug!("kubelet watches device health (v1)");
        Ok(Response::new(Box::pin(watch_stream(&self.0, |r| r))))
    }
}

#[tonic::async_trait]
impl v1alpha1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = Boxed<v1alpha1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _: Request<v1alpha1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        tracing::debug!("kubelet watches device health (v1alpha1)");
        Ok(Response::new(Box::pin(watch_stream(
            &self.0,
            v1alpha1_response,
        ))))
    }
}
