//! The passthrough driver as [`kubelet_plugin`] serves it: each claim's job runs on
//! the claims thread; the devices are the node's selected functions, marked by
//! their health and binding conditions; every answer is counted, and a failed
//! prepare is posted as a Warning Event on its ResourceClaim.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kubelet_plugin::{
    Answers, Call, CallKind, Claim, ClaimError, ClaimRef, HealthReports, KeptFields, Offer,
    PreparedDevice, PublishError, Published, Republish,
};
use node_agent::cluster::Cluster;
use node_agent::watch::{AsyncNodeWatch, Options};
use passthrough::config::ResourceList;
use passthrough::inventory::Inventory;
use support::error_chain;
use sysfs_pci::Host;
use tokio::sync::watch;

use crate::binding::{Mode, OriginalDrivers};
use crate::claims::{DriverError, Failure};
use crate::devices::{marked_devices, BindingMarks};
use crate::health::HealthBoard;
use crate::metrics::{Metrics, Operation};
use crate::worker::{OwnerLost, Worker};

/// How often device health looks at the writes stuck in the kernel.
const STUCK_CHECK: Duration = Duration::from_secs(5);

/// VFIO passthrough per claim, on this node.
#[allow(missing_docs)]
pub struct VfioDriver {
    /// For Events on claims.
    pub cluster: Cluster,
    pub driver_name: String,
    pub host: Host,
    pub list: ResourceList,
    pub worker: Worker,
    /// Calls, claims and slice writes, counted.
    pub metrics: Arc<Metrics>,
    /// Device health.
    pub health: Option<Arc<HealthBoard>>,
    /// Which devices carry binding conditions, and the drivers devices are on
    /// between claims; `None` publishes none.
    pub binding: Option<(Mode, Arc<OriginalDrivers>)>,
    /// Why the node's owner lock is not ours now (the claims thread keeps it):
    /// every device is withdrawn meanwhile.
    pub owner_lost: OwnerLost,
}

#[tonic::async_trait]
impl kubelet_plugin::Driver for VfioDriver {
    type Error = DriverError;

    /// Each claim's job is queued at once on the claims thread ([`Worker::prepare`]).
    async fn prepare(
        &self,
        claims: Vec<Claim>,
        deadline: tokio::time::Instant,
    ) -> Answers<Vec<PreparedDevice>, DriverError> {
        self.worker.prepare(claims, deadline).await
    }

    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
        deadline: tokio::time::Instant,
    ) -> Answers<(), DriverError> {
        self.worker.unprepare(claims, deadline).await
    }

    /// One device per selected function, and one per IOMMU group of several, held
    /// whole through counter sets where the API server keeps them
    /// ([`marked_devices`]); one that should get no new claim (its health, or
    /// unpreparable) carries a taint, or is left out where the API server drops
    /// taints; one whose group leaves a native driver carries the binding
    /// conditions, where kept.
    fn devices(&self, fields: KeptFields) -> Result<Offer, DriverError> {
        if let Some(why) = support::lock(&self.owner_lost).clone() {
            return Ok(Offer::withdrawn(why));
        }
        let inv = Inventory::scan(&self.host, &self.list).map_err(DriverError::NodeScan)?;
        let unhealthy = self
            .health
            .as_ref()
            .map(|h| h.unhealthy())
            .unwrap_or_default();
        let marked = match &self.binding {
            Some((mode, original_drivers)) if fields.binding_conditions => {
                original_drivers.marked(&inv, *mode)
            }
            _ => Default::default(),
        };
        let binding = (!marked.is_empty()).then_some(BindingMarks {
            driver: &self.driver_name,
            devices: &marked,
        });
        let taints = fields.taints.then_some(self.driver_name.as_str());
        Ok(marked_devices(
            &inv,
            &self.list,
            &unhealthy,
            taints,
            binding,
            fields.counters,
        ))
    }

    fn health(&self) -> Option<watch::Receiver<HealthReports>> {
        self.health.as_ref().map(|h| h.subscribe())
    }

    /// Counts each answer and posts a Warning Event on each claim whose prepare
    /// failed (in the background: kubelet's answer does not wait for it).
    fn answered(&self, call: &Call<'_, DriverError>) {
        let op = match call.kind {
            CallKind::Prepare => Operation::Prepare,
            CallKind::Unprepare => Operation::Unprepare,
        };
        self.metrics.call(op, call.took.as_secs_f64());
        for (claim, error) in &call.claims {
            self.metrics.claim(op, error.map(failure));
            if let (Some(e), Operation::Prepare) = (error, op) {
                crate::events::post_warning(
                    &self.cluster,
                    claim,
                    failure(e),
                    "PrepareResources",
                    error_chain(*e),
                );
            }
        }
    }

    fn published(&self, outcome: Result<&Published, &PublishError<DriverError>>) {
        match outcome {
            Ok(p) => self.metrics.published(p.devices, &p.report),
            Err(_) => self.metrics.publish_failed(),
        }
    }
}

/// Why a claim failed, in one word.
fn failure(e: &ClaimError<DriverError>) -> Failure {
    match e {
        ClaimError::Request(_) => Failure::Refused,
        ClaimError::Read(r) if r.is_api_server() => Failure::ApiServer,
        ClaimError::Read(kubelet_plugin::ReadError::Deadline { .. }) => Failure::Timeout,
        ClaimError::Read(_) => Failure::NotOurs,
        ClaimError::Driver(e) => e.failure(),
        // NoAnswer, and whatever a newer plugin adds.
        _ => Failure::Failed,
    }
}

/// Follows the node (PCI uevents, `/dev/vfio`, and a resync every `resync`): on
/// every batch, reads device health again (when kept) and asks for a publication;
/// a health change asks for one too (it changes a taint). With `owner`, the owner
/// lock at its path is watched too, and a change of it has the claims thread
/// check at once whether the node is ours ([`Worker::owner_changed`]: a driver
/// that lost the node withdraws its devices within moments, not at the thread's
/// next idle check, and takes it back as soon as its owner leaves).
pub async fn follow_node(
    host: Host,
    resync: Duration,
    health: Option<Arc<HealthBoard>>,
    republish: Republish,
    owner: Option<(PathBuf, Worker)>,
) {
    let mut node = AsyncNodeWatch::open(
        &host,
        Options {
            resync: Some(resync),
            owner_lock: owner.as_ref().map(|(lock, _)| lock.clone()),
            ..Options::default()
        },
    );
    if let Some(h) = &health {
        let h = h.clone();
        let _ = tokio::task::spawn_blocking(move || h.refresh()).await;
    }
    let mut reports = health.as_ref().map(|h| h.subscribe());
    // A stuck write ends without any event: look at them every few seconds.
    let mut stuck_check = tokio::time::interval(STUCK_CHECK);
    stuck_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            changes = node.next() => {
                if let (true, Some((_, worker))) = (changes.owner, &owner) {
                    worker.owner_changed(changes.owner_file);
                }
                // The owner record is rewritten by every save that changes the
                // devices held: the check above republishes if the lock changed
                // hands, and the devices themselves did not change.
                if !changes.devices() {
                    continue;
                }
                if let Some(h) = &health {
                    h.refresh_changes(&changes);
                }
                republish.now();
            }
            _ = stuck_check.tick() => {
                if let Some(h) = &health {
                    h.check_stuck();
                }
            }
            () = health_changed(reports.as_mut()) => republish.now(),
        }
    }
}

/// Resolves when the health reports change; never without a board.
async fn health_changed(rx: Option<&mut watch::Receiver<HealthReports>>) {
    match rx {
        Some(rx) => {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}
