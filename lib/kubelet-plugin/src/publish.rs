//! Keeps this node's ResourceSlices equal to the driver's devices: on start,
//! whenever the driver says they changed ([`Republish`]), after every registration
//! kubelet accepts, and within moments of anyone else deleting or changing them.
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
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use support::error_chain;
use tokio::sync::Notify;
use tokio_stream::StreamExt;

use crate::driver::{Driver, KeptFields, Offer, PublishError, Published};
use crate::ready::Readiness;
use crate::slices::Slices;

/// Waits after a failed API write before trying again, doubling up to the
/// plugin's longest retry.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The shortest time between two publication passes (each reads the Node and our
/// slices, and writes them if anything changed). Changes that come faster — a
/// device whose health flaps, a storm of uevents — are coalesced: the next pass
/// publishes the state as it is then, so the last one is always written, within
/// this long of it.
pub(crate) const PASS_SPACING: Duration = Duration::from_millis(500);

/// Tells the publisher that the driver's devices changed: the next pass comes
/// within half a second (passes are spaced so, and faster changes coalesced).
#[derive(Debug, Clone, Default)]
pub struct Republish(Arc<Notify>);

impl Republish {
    /// Asks for a publication pass.
    pub fn now(&self) {
        self.0.notify_one();
    }

    async fn wanted(&self) {
        self.0.notified().await;
    }
}

/// The publisher's state, shared with the slice watch.
pub(crate) struct Publisher<D: Driver> {
    pub driver: Arc<D>,
    pub slices: tokio::sync::Mutex<Slices>,
    /// For the slice watch: waits past the watch's server timeout.
    pub watch_client: kube::Client,
    /// The slice watch's settings (its server timeout).
    pub watch_config: watcher::Config,
    /// The longest wait between retries of a failed pass.
    pub max_backoff: Duration,
    pub readiness: Arc<Readiness>,
    /// Wakes the loop: the driver's devices changed.
    pub republish: Republish,
    /// Wakes the loop: kubelet accepted a registration.
    pub registered: Arc<Notify>,
    /// What the publisher has seen.
    pub seen: Observed,
}

/// What the publisher has seen of the API server.
#[derive(Default)]
pub(crate) struct Observed {
    /// `(name, resourceVersion)` of our slices as last written or seen unchanged.
    ours: Mutex<BTreeSet<(String, String)>>,
    /// Wakes the loop: a foreign change seen by the watcher.
    foreign: Notify,
    /// A write came back without the device taints it carried.
    taints_dropped: AtomicBool,
    /// A write came back without the binding conditions it carried.
    binding_dropped: AtomicBool,
    /// The server drops counter sets (asked, or seen in a write).
    counters_dropped: AtomicBool,
    /// The server was asked whether it keeps counter sets.
    counters_asked: AtomicBool,
    /// Why the driver withdrew its offer, as last said.
    withdrawn: Mutex<Option<String>>,
}

impl<D: Driver> Publisher<D> {
    /// Publishes now and after every change, until aborted.
    pub(crate) async fn run(self: Arc<Self>) {
        let watching = tokio::spawn(self.clone().watch());
        let _stop_watching = AbortOnDrop(watching);
        let mut backoff = FIRST_BACKOFF;
        let mut last_pass: Option<tokio::time::Instant> = None;
        loop {
            if let Some(last) = last_pass {
                tokio::time::sleep_until(last + PASS_SPACING).await;
            }
            last_pass = Some(tokio::time::Instant::now());
            let retry = match self.pass().await {
                Ok(published) => {
                    self.readiness.withdrawn(published.withdrawn.clone());
                    self.readiness
                        .published(Some(published.report.names.clone()));
                    self.driver.published(Ok(&published));
                    backoff = FIRST_BACKOFF;
                    None
                }
                Err(e) => {
                    self.readiness.published(None);
                    self.driver.published(Err(&e));
                    tracing::warn!(error = %error_chain(&e), retry_in = ?backoff,
                        "cannot publish this node's ResourceSlices");
                    let wait = backoff;
                    backoff = (backoff * 2).min(self.max_backoff);
                    Some(wait)
                }
            };
            tokio::select! {
                () = sleep_for(retry) => {}
                _ = self.seen.foreign.notified() => tracing::debug!(
                    "our ResourceSlices changed elsewhere; publishing again"),
                _ = self.registered.notified() => tracing::debug!(
                    "registered with kubelet; publishing again"),
                () = self.republish.wanted() => {}
            }
        }
    }

    /// Watches our slices and wakes the loop on every event that is not our own
    /// write: a deletion (kubelet's wipe, a person), a change by another writer, a
    /// stray slice, or a fresh list after the watch was re-established.
    async fn watch(self: Arc<Self>) {
        let selector = self.slices.lock().await.selector();
        let api: Api<ResourceSlice> = Api::all(self.watch_client.clone());
        let config = self.watch_config.clone().fields(&selector);
        let stream = watcher::watcher(api, config).default_backoff();
        tokio::pin!(stream);
        let mut failing = false;
        while let Some(event) = stream.next().await {
            let foreign = match event {
                Ok(Event::Apply(s) | Event::InitApply(s)) => !self.is_our_write(&s),
                Ok(Event::Delete(_) | Event::InitDone) => true,
                Ok(Event::Init) => false,
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %error_chain(&e),
                            "cannot watch this node's ResourceSlices; retrying");
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
                self.seen.foreign.notify_one();
            }
        }
    }

    fn is_our_write(&self, s: &ResourceSlice) -> bool {
        let key = (
            s.metadata.name.clone().unwrap_or_default(),
            s.metadata.resource_version.clone().unwrap_or_default(),
        );
        support::lock(&self.seen.ours).contains(&key)
    }

    fn fields(&self) -> KeptFields {
        KeptFields {
            taints: !self.seen.taints_dropped.load(SeqCst),
            binding_conditions: !self.seen.binding_dropped.load(SeqCst),
            counters: !self.seen.counters_dropped.load(SeqCst),
        }
    }

    /// Before the first counter set is published, asks the server once whether it
    /// keeps them, so that no device is ever published without the counters that
    /// keep its group whole; true when it does not (the offer must be made again
    /// without them). A server that cannot be asked (a webhook that refuses dry
    /// runs) is judged by the first write instead.
    async fn counters_dropped_on_asking(&self, slices: &Slices) -> bool {
        if self.seen.counters_asked.swap(true, SeqCst) {
            return false;
        }
        match slices.counters_kept().await {
            Ok(true) => false,
            Ok(false) => {
                self.seen.counters_dropped.store(true, SeqCst);
                tracing::warn!(
                    "the API server drops the counter sets of \
                        ResourceSlices (its DRAPartitionableDevices gate is off, or it \
                        predates them); publishing without them, as the driver offers its \
                        devices then"
                );
                true
            }
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "cannot ask the API server \
                    whether it keeps counter sets; the first write will tell");
                false
            }
        }
    }

    /// The driver's devices for the fields the server keeps.
    async fn devices(&self) -> Result<Offer, PublishError<D::Error>> {
        let driver = self.driver.clone();
        let fields = self.fields();
        tokio::task::spawn_blocking(move || driver.devices(fields))
            .await
            .map_err(PublishError::DevicesStopped)?
            .map_err(PublishError::Devices)
    }

    /// The driver's offer; an empty one when it withdrew, said once per reason.
    async fn offer(&self) -> Result<Offer, PublishError<D::Error>> {
        let offer = self.devices().await?;
        let mut said = support::lock(&self.seen.withdrawn);
        if *said != offer.withdrawn {
            match &offer.withdrawn {
                Some(why) => {
                    tracing::warn!(reason = %why, "the driver withdrew its devices: \
                        publishing an empty pool, not ready")
                }
                None if said.is_some() => tracing::info!("the driver offers its devices again"),
                None => {}
            }
            said.clone_from(&offer.withdrawn);
        }
        Ok(match offer.withdrawn {
            Some(why) => Offer::withdrawn(why),
            None => offer,
        })
    }

    /// One publication pass.
    async fn pass(&self) -> Result<Published, PublishError<D::Error>> {
        let mut offer = self.offer().await?;
        let mut slices = self.slices.lock().await;
        if !offer.counter_sets.is_empty() && self.counters_dropped_on_asking(&slices).await {
            drop(slices);
            offer = self.offer().await?;
            slices = self.slices.lock().await;
        }
        let mut report = slices
            .reconcile_pool(&offer.devices, &offer.counter_sets)
            .await?;
        let taints_lost = report.taints_dropped && !self.seen.taints_dropped.swap(true, SeqCst);
        if taints_lost {
            tracing::warn!(
                "the API server drops the taints of ResourceSlice devices \
                    (its DRADeviceTaints gate is off, or it predates device taints); \
                    publishing without them"
            );
        }
        let binding_lost = report.binding_dropped && !self.seen.binding_dropped.swap(true, SeqCst);
        if binding_lost {
            tracing::warn!(
                "the API server drops the binding conditions of \
                    ResourceSlice devices (its DRADeviceBindingConditions or \
                    DRAResourceClaimDeviceStatus gate is off, or it predates them); \
                    publishing without them"
            );
        }
        let counters_lost =
            report.counters_dropped && !self.seen.counters_dropped.swap(true, SeqCst);
        if counters_lost {
            tracing::warn!(
                "the API server dropped the counter sets of ResourceSlices \
                    (its DRAPartitionableDevices gate is off, or it predates them); \
                    publishing without them, as the driver offers its devices then"
            );
        }
        if taints_lost || binding_lost || counters_lost {
            drop(slices);
            offer = self.offer().await?;
            slices = self.slices.lock().await;
            report = slices
                .reconcile_pool(&offer.devices, &offer.counter_sets)
                .await?;
        }
        drop(slices);
        tracing::debug!(?report, "ResourceSlices reconciled");
        *support::lock(&self.seen.ours) = report.versions.iter().cloned().collect();
        Ok(Published {
            devices: offer.devices.len(),
            report,
            withdrawn: offer.withdrawn,
        })
    }
}

/// Sleeps for `wait`; never without one.
async fn sleep_for(wait: Option<Duration>) {
    match wait {
        Some(wait) => tokio::time::sleep(wait).await,
        None => std::future::pending().await,
    }
}

/// Aborts the task when dropped.
pub(crate) struct AbortOnDrop(pub tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
