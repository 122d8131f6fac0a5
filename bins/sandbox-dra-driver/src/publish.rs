//! Keeps this node's ResourceSlices equal to what the resource list selects: on
//! start, on every change the node watcher reports (a device added or removed, a
//! group node come or gone), every resync interval,
//! after every registration kubelet accepts, and within moments of anyone else
//! deleting or changing them.
//!
//! kubelet deletes the slices of its node when it starts, and a driver's slices
//! 30 s after that driver's last registration went away unless it registers again
//! first (1.32: `pkg/kubelet/cm/dra/plugin/registration.go`, `wipeResourceSlices`;
//! 1.34: `dra_plugin_manager.go`, where a dropped connection counts too). A
//! re-registration itself wipes nothing. A wipe at kubelet's start can still land
//! after our first registration (it runs in the background).
//! Upstream's ResourceSlice controller answers that by watching the driver's own
//! slices and publishing again at once; so does this module: a kube-rs watcher on
//! ResourceSlices of this driver and node wakes the loop on every event that is not
//! our own write.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::slices::{self, SliceError};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use node_agent::cluster::Cluster;
use node_agent::watch::{AsyncNodeWatch, Options};
use passthrough::config::ResourceList;
use passthrough::inventory::Inventory;
use sysfs_pci::{error_chain, Host};
use tokio::sync::Notify;
use tokio_stream::StreamExt;

use crate::health::HealthBoard;
use crate::metrics::Metrics;
use crate::ready::Readiness;

/// How often device health looks at the writes stuck in the kernel.
const STUCK_CHECK: Duration = Duration::from_secs(5);
/// Waits after a failed API write before trying again, doubling up to the resync.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The shortest time between two publication passes (each reads the Node and our
/// slices, and writes them if anything changed). Changes that come faster — a
/// device whose health flaps, a storm of uevents — are coalesced: the next pass
/// publishes the state as it is then, so the last one is always written, within
/// this long of it.
pub const PASS_SPACING: Duration = Duration::from_millis(500);

/// Publishes the slices.
#[derive(Clone)]
pub struct Publisher {
    slices: Arc<tokio::sync::Mutex<slices::Slices>>,
    /// For the slice watch: waits past the watch's server timeout.
    watch_client: kube::Client,
    host: Host,
    list: ResourceList,
    resync: Duration,
    /// `(name, resourceVersion)` of our slices as last written or seen unchanged.
    ours: Arc<Mutex<BTreeSet<(String, String)>>>,
    /// Wakes the loop: a foreign change seen by the watcher, or a registration.
    wake: Arc<Notify>,
    readiness: Arc<Readiness>,
    metrics: Arc<Metrics>,
    health: Option<Arc<HealthBoard>>,
    /// Whether the API server keeps device taints (until a write shows it drops them).
    taints: Arc<std::sync::atomic::AtomicBool>,
    /// Which devices get binding conditions, and the drivers they are on between
    /// claims.
    binding: Option<(crate::binding::Mode, Arc<crate::binding::Homes>)>,
    /// Whether the API server keeps binding conditions (until a write shows it
    /// drops them).
    binding_kept: Arc<std::sync::atomic::AtomicBool>,
}

/// Where the publisher reports each pass.
pub struct Reports {
    /// Told the slices of each pass, or that it failed.
    pub readiness: Arc<Readiness>,
    /// Slice writes and published devices.
    pub metrics: Arc<Metrics>,
    /// Device health: read again on every node change, before the slices are
    /// written (it does not wait for the API server).
    pub health: Option<Arc<HealthBoard>>,
    /// Binding conditions (`--binding-conditions`) and the drivers devices are on
    /// between claims; `None` publishes none.
    pub binding: Option<(crate::binding::Mode, Arc<crate::binding::Homes>)>,
}

impl Publisher {
    /// A publisher for `driver` on `node`.
    pub fn new(
        cluster: Cluster,
        driver: String,
        node: String,
        host: Host,
        list: ResourceList,
        resync: Duration,
        reports: Reports,
    ) -> Self {
        Self {
            watch_client: cluster.watch_client(),
            slices: Arc::new(tokio::sync::Mutex::new(slices::Slices::new(
                cluster.kube_client(),
                &driver,
                &node,
            ))),
            host,
            list,
            resync,
            ours: Arc::default(),
            wake: Arc::default(),
            readiness: reports.readiness,
            metrics: reports.metrics,
            health: reports.health,
            taints: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            binding: reports.binding,
            binding_kept: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        }
    }

    /// Reconciles now and after every change, until aborted. `registered` is
    /// notified when kubelet accepts a registration.
    pub async fn run(self, registered: Arc<Notify>) {
        // The node watcher: device health first, at once; then this loop.
        let node_changed = Arc::new(Notify::new());
        let following = tokio::spawn(follow_node(
            self.host.clone(),
            self.resync,
            self.health.clone(),
            node_changed.clone(),
        ));
        let _stop_following = AbortOnDrop(following);
        let watching = tokio::spawn(self.clone().watch());
        let _stop_watching = AbortOnDrop(watching);
        // A device's health changes its taint (a prepare or unprepare too).
        let mut health = self.health.as_ref().map(|h| h.subscribe());
        let mut backoff = FIRST_BACKOFF;
        let mut last_pass: Option<tokio::time::Instant> = None;
        loop {
            if let Some(last) = last_pass {
                tokio::time::sleep_until(last + PASS_SPACING).await;
            }
            last_pass = Some(tokio::time::Instant::now());
            // After a success the node watcher's resync is the next pass.
            let retry = match self.reconcile().await {
                Ok(names) => {
                    self.readiness.published(Some(names));
                    backoff = FIRST_BACKOFF;
                    None
                }
                Err(e) => {
                    self.readiness.published(None);
                    self.metrics.publish_failed();
                    tracing::warn!(error = %error_chain(&e), retry_in = ?backoff, "cannot publish this node's ResourceSlices");
                    let wait = backoff;
                    backoff = (backoff * 2).min(self.resync);
                    Some(wait)
                }
            };
            tokio::select! {
                () = sleep_for(retry) => {}
                _ = self.wake.notified() => tracing::debug!("our ResourceSlices changed elsewhere; publishing again"),
                _ = registered.notified() => tracing::debug!("registered with kubelet; publishing again"),
                _ = node_changed.notified() => {}
                () = health_changed(health.as_mut()) => {}
            }
        }
    }

    /// Watches our slices and wakes the loop on every event that is not our own
    /// write: a deletion (kubelet's wipe, a person), a change by another writer, a
    /// stray slice, or a fresh list after the watch was re-established.
    async fn watch(self) {
        let selector = self.slices.lock().await.selector();
        let api: Api<ResourceSlice> = Api::all(self.watch_client.clone());
        let stream = watcher::watcher(api, node_agent::cluster::watch_config().fields(&selector))
            .default_backoff();
        tokio::pin!(stream);
        let mut failing = false;
        while let Some(event) = stream.next().await {
            let foreign = match event {
                Ok(Event::Apply(s) | Event::InitApply(s)) => !self.is_our_write(&s),
                Ok(Event::Delete(_) | Event::InitDone) => true,
                Ok(Event::Init) => false,
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %error_chain(&e), "cannot watch this node's ResourceSlices; retrying (the resync still republishes)");
                    }
                    failing = true;
                    continue;
                }
            };
            if failing {
                tracing::info!("watching this node's ResourceSlices again");
                failing = false;
            }
            if foreign {
                self.wake.notify_one();
            }
        }
    }

    fn is_our_write(&self, s: &ResourceSlice) -> bool {
        let key = (
            s.metadata.name.clone().unwrap_or_default(),
            s.metadata.resource_version.clone().unwrap_or_default(),
        );
        sysfs_pci::kernel::lock(&self.ours).contains(&key)
    }

    /// Publishes the node's devices; the names of our slices.
    async fn reconcile(&self) -> Result<Vec<String>, PublishError> {
        let host = self.host.clone();
        let list = self.list.clone();
        let inv = tokio::task::spawn_blocking(move || Inventory::scan(&host, &list))
            .await
            .map_err(PublishError::ScanStopped)?
            .map_err(PublishError::Scan)?;
        let unhealthy = self
            .health
            .as_ref()
            .map(|h| h.unhealthy())
            .unwrap_or_default();
        let mut slices = self.slices.lock().await;
        let driver = slices.driver().to_owned();
        use std::sync::atomic::Ordering::SeqCst;
        let marked = match &self.binding {
            Some((mode, homes)) if self.binding_kept.load(SeqCst) => homes.marked(&inv, *mode),
            _ => Default::default(),
        };
        let devices_now = || {
            let binding = (!marked.is_empty() && self.binding_kept.load(SeqCst)).then_some(
                slices::BindingMarks {
                    driver: &driver,
                    devices: &marked,
                },
            );
            let taints = self.taints.load(SeqCst).then_some(driver.as_str());
            slices::marked_devices(&inv, &unhealthy, taints, binding)
        };
        let mut devices = devices_now();
        let mut report = slices.reconcile(&devices).await?;
        let taints_lost = report.taints_dropped && self.taints.swap(false, SeqCst);
        if taints_lost {
            tracing::warn!("the API server drops the taints of ResourceSlice devices (its DRADeviceTaints gate is off, or it predates device taints): unhealthy and unpreparable devices are left out of the slice instead");
        }
        let binding_lost = report.binding_dropped && self.binding_kept.swap(false, SeqCst);
        if binding_lost {
            tracing::warn!("the API server drops the binding conditions of ResourceSlice devices (its DRADeviceBindingConditions or DRAResourceClaimDeviceStatus gate is off, or it predates them): devices are published without, and move to vfio at prepare");
        }
        if taints_lost || binding_lost {
            devices = devices_now();
            report = slices.reconcile(&devices).await?;
        }
        drop(slices);
        tracing::debug!(?report, "ResourceSlices reconciled");
        self.metrics.published(devices.len(), &report);
        *sysfs_pci::kernel::lock(&self.ours) = report.versions.into_iter().collect();
        Ok(report.names)
    }

    /// Deletes this node's slices (an uninstall).
    pub async fn delete_all(&self) -> Result<(), SliceError> {
        self.slices.lock().await.delete_all().await.map(|_| ())
    }
}

/// Follows the node (PCI uevents, `/dev/vfio`, and a resync every `resync`): on
/// every batch, reads device health again (when kept) and wakes the publisher.
async fn follow_node(
    host: Host,
    resync: Duration,
    health: Option<Arc<HealthBoard>>,
    changed: Arc<Notify>,
) {
    let mut node = AsyncNodeWatch::open(
        &host,
        Options {
            resync: Some(resync),
            ..Options::default()
        },
    );
    if let Some(h) = &health {
        let h = h.clone();
        let _ = tokio::task::spawn_blocking(move || h.refresh()).await;
    }
    // A stuck write ends without any event: look at them every few seconds.
    let mut stuck_check = tokio::time::interval(STUCK_CHECK);
    stuck_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            changes = node.next() => {
                if let Some(h) = &health {
                    h.refresh_changes(&changes);
                }
                changed.notify_one();
            }
            _ = stuck_check.tick() => {
                if let Some(h) = &health {
                    h.check_stuck();
                }
            }
        }
    }
}

/// Why a publish pass failed.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The node's PCI devices could not be read.
    #[error("cannot scan the node's PCI devices")]
    Scan(#[source] sysfs_pci::device::DeviceError),
    /// The scan's thread stopped before it finished.
    #[error("the scan of the node's PCI devices stopped")]
    ScanStopped(#[source] tokio::task::JoinError),
    /// The ResourceSlices could not be written.
    #[error(transparent)]
    Slices(#[from] SliceError),
}

/// Resolves when the health reports change; never without a board.
async fn health_changed(rx: Option<&mut tokio::sync::watch::Receiver<crate::health::Reports>>) {
    match rx {
        Some(rx) => {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

/// Sleeps for `wait`; never without one.
async fn sleep_for(wait: Option<Duration>) {
    match wait {
        Some(wait) => tokio::time::sleep(wait).await,
        None => std::future::pending().await,
    }
}

/// Aborts the task when dropped (the publisher's loop is aborted at stop).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
