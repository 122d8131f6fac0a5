//! The claim watcher: moves the groups of a claim allocated to this node's devices
//! with our binding condition as soon as the scheduler allocates it, and writes the
//! condition into the claim's `status.devices`.
//!
//! Which claims it watches is `--claim-watch` ([`ClaimWatch`]): every claim of the
//! cluster (no field selector picks claims by node), or only those the claim
//! labeller (`sandbox-dra-controller`) labelled for this node (the label of
//! [`claim_label`]), which the API server picks before it sends;
//! `auto` watches the labelled ones while the labeller holds and renews its Lease
//! and every claim otherwise.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use node_agent::cluster::Cluster;
use support::error_chain;
use tokio_stream::StreamExt;

use kubelet_plugin::status::{DeviceCondition, DeviceStatus, Written};
use kubelet_plugin::{
    allocated_devices, allocation_results, opaque_configs, AllocatedDevice, ClaimRef, OpaqueConfig,
};

use crate::claims::DriverError;
use crate::metrics::Operation;
use crate::worker::Worker;

mod scope;

pub use scope::{ClaimWatch, LeaseRef, LABELLER_CHECK};
use scope::{Labeller, Scope};

/// How long the watcher waits for a move: the scheduler gives a claim up 10
/// minutes after its allocation (`DynamicResourcesBindingTimeoutDefault`).
const MOVE_WAIT: Duration = Duration::from_secs(600);
/// The longest pause between two tries of a status write.
const STATUS_RETRY_MAX: Duration = Duration::from_secs(30);
/// How often a give-back that failed is tried again.
const GIVE_BACK_RETRY: Duration = Duration::from_secs(10);
/// What the watcher needs.
#[derive(Clone)]
#[allow(missing_docs)]
pub struct ClaimWatcher {
    pub cluster: Cluster,
    pub driver: String,
    pub pool: String,
    pub worker: Worker,
    /// Early moves and give-backs, counted and timed.
    pub metrics: Arc<crate::metrics::Metrics>,
    pub watch: ClaimWatch,
    /// The labeller's Lease, which `auto` reads (`None`: `auto` watches every
    /// claim).
    pub labeller_lease: Option<LeaseRef>,
}

/// The watcher's memory, shared with its move tasks.
///
/// One task at a time acts on a claim (a move with its status write, or a
/// give-back). An event that arrives meanwhile is kept in `latest`, the newer
/// replacing the older, and acted on as soon as that task ends: the claim's latest
/// state is what counts, and no event is lost.
#[derive(Default)]
struct Tracked {
    /// Claims allocated to our devices with our binding condition: the ones whose
    /// loss of allocation may have to give devices back.
    ours: HashSet<String>,
    /// Claims a task is acting on.
    busy: HashSet<String>,
    /// The latest state of a busy claim seen since its task started (`None`: it
    /// was deleted or is no longer listed).
    latest: HashMap<String, Option<ResourceClaim>>,
    /// Said once: the API server drops `status.devices`.
    status_dropped: bool,
    /// Claims moved early that a labelled list did not show, being read one by
    /// one; an event for one of them since takes it out (the event is newer).
    looking_up: HashSet<String>,
}

/// One of our devices in a claim's allocation that waits on our condition.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Waiting {
    claim: ClaimRef,
    generation: Option<i64>,
    allocations: Vec<AllocatedDevice>,
    /// The opaque configurations of ours in the allocation.
    configs: Vec<OpaqueConfig>,
    /// Our condition is already `True` (ready) or the failure one is (failed).
    settled: bool,
}

/// Watches ResourceClaims (every claim, or those labelled for this node, as
/// `--claim-watch` says) until aborted. A claim allocated to this node's devices
/// whose results carry our binding condition is moved early; one that loses its
/// allocation (or its label) before it was prepared gets its devices back. After
/// every (re)list, claims moved early that are no longer allocated here are given
/// back too.
pub async fn watch_claims(follow: ClaimWatcher) {
    let seen = Arc::new(Shared::default());
    match (follow.watch, follow.labeller_lease.clone()) {
        (ClaimWatch::All, _) => {
            follow
                .watch_in(&seen, Scope::All, std::future::pending())
                .await
        }
        (ClaimWatch::Labelled, _) => {
            tracing::info!(selector = %follow.selector(), "watching only the \
                ResourceClaims the claim labeller labels for this node");
            follow
                .watch_in(&seen, Scope::Labelled, std::future::pending())
                .await;
        }
        (ClaimWatch::Auto, None) => {
            tracing::info!(
                "--claim-watch=auto without a namespace for the labeller's \
                    Lease (POD_NAMESPACE): watching every ResourceClaim"
            );
            follow
                .watch_in(&seen, Scope::All, std::future::pending())
                .await;
        }
        (ClaimWatch::Auto, Some(lease)) => {
            let mut labeller = Labeller::new(
                follow.cluster.kube_client(),
                follow.cluster.watch_client(),
                lease,
            );
            loop {
                let scope = labeller.look().await;
                follow
                    .watch_in(&seen, scope, labeller.until_changed(scope))
                    .await;
            }
        }
    }
}

impl ClaimWatcher {
    /// The label selector of this node's claims.
    fn selector(&self) -> String {
        claim_label::selector(&self.driver, &self.pool)
    }

    /// Watches the claims of `scope` until `until` ends (or forever).
    async fn watch_in(
        &self,
        seen: &Arc<Shared>,
        scope: Scope,
        until: impl std::future::Future<Output = ()>,
    ) {
        let api: Api<ResourceClaim> = Api::all(self.cluster.watch_client());
        let config = match scope {
            Scope::All => node_agent::cluster::watch_config(),
            Scope::Labelled => node_agent::cluster::watch_config().labels(&self.selector()),
        };
        let stream = watcher::watcher(api, config).default_backoff();
        tokio::pin!(stream);
        tokio::pin!(until);
        let mut listed: BTreeSet<String> = BTreeSet::new();
        let mut failing = false;
        loop {
            let event = tokio::select! {
                () = &mut until => return,
                event = stream.next() => match event {
                    Some(e) => e,
                    None => return,
                },
            };
            let event = match event {
                Ok(e) => e,
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %error_chain(&e),
                            "cannot watch ResourceClaims; retrying (claims wait for \
                                prepare meanwhile)");
                    }
                    failing = true;
                    continue;
                }
            };
            if failing {
                tracing::info!("watching ResourceClaims again");
                failing = false;
            }
            match event {
                Event::Init => listed.clear(),
                Event::InitApply(c) => {
                    let uid = seen.newer(&c);
                    if self.act(seen, uid.clone(), Some(c)) {
                        listed.insert(uid);
                    }
                }
                Event::InitDone => self.sweep(seen, &listed, scope).await,
                Event::Apply(c) => {
                    let uid = seen.newer(&c);
                    self.act(seen, uid, Some(c));
                }
                Event::Delete(c) => {
                    let uid = seen.newer(&c);
                    self.act(seen, uid, None);
                }
            }
        }
    }
}

/// The watcher's memory and a bell its tasks hear when a busy claim changes.
#[derive(Default)]
struct Shared {
    tracked: Mutex<Tracked>,
    changed: tokio::sync::Notify,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Tracked> {
        support::lock(&self.tracked)
    }

    /// Claim `claim` came in from the watch: newer than any read of it still on
    /// its way. Gives its uid.
    fn newer(&self, claim: &ResourceClaim) -> String {
        let uid = claim.metadata.uid.clone().unwrap_or_default();
        self.lock().looking_up.remove(&uid);
        uid
    }

    /// True when an event for busy claim `uid` came in since its task started.
    fn superseded(&self, uid: &str) -> bool {
        self.lock().latest.contains_key(uid)
    }

    /// Waits `pause`, or less if an event for `uid` comes in meanwhile; true if one did.
    async fn pause_unless_changed(&self, uid: &str, pause: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + pause;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.superseded(uid) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.superseded(uid);
            }
        }
    }
}

impl ClaimWatcher {
    /// Acts on claim `uid` as it now stands (`None`: deleted, or gone from a
    /// list): moves it if it waits on our condition, gives back what was moved for
    /// it if it no longer does. While a task acts on the claim, the state is kept
    /// for when that task ends. True when the claim is allocated to us.
    fn act(&self, seen: &Arc<Shared>, uid: String, claim: Option<ResourceClaim>) -> bool {
        let waiting = claim.as_ref().and_then(|c| self.waiting(c));
        let ours = waiting.is_some();
        let mut s = seen.lock();
        if s.busy.contains(&uid) {
            s.latest.insert(uid, claim);
            drop(s);
            seen.changed.notify_waiters();
            return ours;
        }
        let this = self.clone();
        let shared = seen.clone();
        match waiting {
            Some(waiting) => {
                s.ours.insert(uid.clone());
                if waiting.settled {
                    return true;
                }
                s.busy.insert(uid.clone());
                tokio::spawn(async move {
                    let allocations = waiting.allocations.clone();
                    let written = this.move_early(&shared, waiting).await;
                    this.done(&shared, uid, written.then_some(allocations));
                });
            }
            None => {
                // Ours until its give-back is done: a failed one is tried again.
                if !s.ours.contains(&uid) {
                    return false;
                }
                s.busy.insert(uid.clone());
                tokio::spawn(async move {
                    this.give_back(&shared, &uid).await;
                    this.done(&shared, uid, None);
                });
            }
        }
        ours
    }

    /// The task on claim `uid` has ended: acts on what came in meanwhile.
    /// `written`: the allocation whose condition the task wrote. A state that
    /// shows that same allocation without the condition came in before the write
    /// (another writer's change): the write's own event follows, so it is not
    /// moved and written again.
    fn done(&self, seen: &Arc<Shared>, uid: String, written: Option<Vec<AllocatedDevice>>) {
        let next = {
            let mut s = seen.lock();
            s.busy.remove(&uid);
            s.latest.remove(&uid)
        };
        let Some(claim) = next else {
            return;
        };
        let before_the_write = written.is_some_and(|allocations| {
            claim
                .as_ref()
                .and_then(|c| self.waiting(c))
                .is_some_and(|w| w.allocations == allocations)
        });
        if !before_the_write {
            self.act(seen, uid, claim);
        }
    }

    /// The claim's devices of ours that wait on our condition, if it has any.
    fn waiting(&self, claim: &ResourceClaim) -> Option<Waiting> {
        let cref = ClaimRef {
            uid: claim.metadata.uid.clone()?,
            namespace: claim.metadata.namespace.clone()?,
            name: claim.metadata.name.clone()?,
        };
        let allocations = allocated_devices(claim, &cref, &self.driver, &self.pool).ok()?;
        let ready = crate::binding::ready_condition(&self.driver);
        let failed = crate::binding::failed_condition(&self.driver);
        let mine: Vec<_> = allocation_results(claim)
            .iter()
            .filter(|r| r.driver == self.driver && r.pool == self.pool)
            .collect();
        if !mine.iter().any(|r| {
            r.binding_conditions
                .as_ref()
                .is_some_and(|c| c.contains(&ready))
        }) {
            // Allocated without our condition (the scheduler does not wait): the
            // move happens at prepare.
            return None;
        }
        let status = claim.status.as_ref()?;
        let entries = status.devices.as_deref().unwrap_or(&[]);
        let condition = |device: &str, kind: &str| {
            entries
                .iter()
                .find(|e| e.driver == self.driver && e.pool == self.pool && e.device == device)
                .and_then(|e| e.conditions.as_deref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == kind && c.status == "True"))
        };
        let failed_any = mine.iter().any(|r| condition(&r.device, &failed));
        let ready_all = mine.iter().all(|r| condition(&r.device, &ready));
        Some(Waiting {
            claim: cref,
            generation: claim.metadata.generation,
            allocations,
            configs: opaque_configs(claim, &self.driver),
            settled: failed_any || ready_all,
        })
    }

    /// Claim `uid` is no longer allocated to us: gives back what was moved early.
    /// A give-back that fails (a process opened the group node meanwhile) is tried
    /// again every [`GIVE_BACK_RETRY`] until it is done or the claim changes again
    /// (its next state is then acted on).
    async fn give_back(&self, seen: &Shared, uid: &str) {
        loop {
            let started = std::time::Instant::now();
            let job = self.worker.release(uid.to_owned());
            let answer = self
                .worker
                .wait_for(job, tokio::time::Instant::now() + MOVE_WAIT)
                .await;
            let op = Operation::GiveBack;
            match answer {
                Ok(released) => {
                    if released.is_some() {
                        self.metrics.call(op, started.elapsed().as_secs_f64());
                        self.metrics.claim(op, None);
                    }
                    seen.lock().ours.remove(uid);
                    return;
                }
                Err(e) => self.metrics.claim(op, Some(e.failure())),
            }
            if seen.pause_unless_changed(uid, GIVE_BACK_RETRY).await {
                return;
            }
        }
    }

    /// After a (re)list: gives back every claim moved early that the list does not
    /// show allocated to us (deleted or deallocated while we were not watching).
    /// A labelled list is not the whole truth (the labeller may not have labelled
    /// a claim yet, or be between two leaders), so each such claim is read
    /// instead and acted on as it stands.
    async fn sweep(&self, seen: &Arc<Shared>, listed: &BTreeSet<String>, scope: Scope) {
        let job = self.worker.moved_early();
        let moved = match self
            .worker
            .wait_for(job, tokio::time::Instant::now() + MOVE_WAIT)
            .await
        {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "cannot list the claims moved early");
                return;
            }
        };
        {
            let mut s = seen.lock();
            s.ours.retain(|u| listed.contains(u));
            s.ours.extend(moved.iter().map(|c| c.uid.clone()));
        }
        for c in moved.into_iter().filter(|c| !listed.contains(&c.uid)) {
            match scope {
                Scope::All => {
                    tracing::info!(claim = %c, "a claim moved early is no longer \
                        allocated here; giving its devices back");
                    self.act(seen, c.uid, None);
                }
                Scope::Labelled => {
                    seen.lock().looking_up.insert(c.uid.clone());
                    let (this, shared) = (self.clone(), seen.clone());
                    tokio::spawn(async move { this.look_up(&shared, c).await });
                }
            }
        }
    }

    /// Reads claim `c`, moved early and missing from a labelled list, and acts on
    /// it as it stands (gone, or another claim under its name: `None`), unless the
    /// watch brought a newer state meanwhile. A read that fails is tried again
    /// every [`GIVE_BACK_RETRY`].
    async fn look_up(&self, seen: &Arc<Shared>, c: ClaimRef) {
        let api: Api<ResourceClaim> = Api::namespaced(self.cluster.kube_client(), &c.namespace);
        loop {
            match api.get_opt(&c.name).await {
                Ok(found) => {
                    let found = found.filter(|f| f.metadata.uid.as_deref() == Some(c.uid.as_str()));
                    if !seen.lock().looking_up.remove(&c.uid) {
                        return;
                    }
                    if found.as_ref().and_then(|f| self.waiting(f)).is_none() {
                        tracing::info!(claim = %c, "a claim moved early is no longer \
                            allocated here; giving its devices back");
                    }
                    self.act(seen, c.uid, found);
                    return;
                }
                Err(e) => {
                    tracing::warn!(claim = %c, error = %e, retry_in = ?GIVE_BACK_RETRY,
                        "cannot read a claim moved early that the labelled list does \
                            not show");
                }
            }
            tokio::time::sleep(GIVE_BACK_RETRY).await;
            if !seen.lock().looking_up.contains(&c.uid) {
                return;
            }
        }
    }

    /// Moves the claim's groups and says how it went in the claim's status; true
    /// when that was written.
    async fn move_early(&self, seen: &Shared, w: Waiting) -> bool {
        let started = std::time::Instant::now();
        let job = self
            .worker
            .move_early(w.claim.clone(), w.allocations.clone(), w.configs.clone());
        let outcome = self
            .worker
            .wait_for(job, tokio::time::Instant::now() + MOVE_WAIT)
            .await;
        self.metrics
            .call(Operation::MoveEarly, started.elapsed().as_secs_f64());
        self.metrics.claim(
            Operation::MoveEarly,
            outcome.as_ref().err().map(DriverError::failure),
        );
        if let Err(e) = &outcome {
            crate::events::post_warning(
                &self.cluster,
                &w.claim,
                e.failure(),
                "MoveBeforeBinding",
                error_chain(e),
            );
        }
        let devices: Vec<String> = w.allocations.iter().map(|a| a.device.clone()).collect();
        let condition = match &outcome {
            Ok(()) => DeviceCondition {
                type_: crate::binding::ready_condition(&self.driver),
                reason: "MovedToVfio".into(),
                message: format!(
                    "the IOMMU group(s) of {} are on vfio on node {}",
                    devices.join(", "),
                    self.pool
                ),
            },
            Err(e) => DeviceCondition {
                type_: crate::binding::failed_condition(&self.driver),
                reason: "MoveFailed".into(),
                message: error_chain(e),
            },
        };
        let status = DeviceStatus {
            client: self.cluster.kube_client(),
            driver: self.driver.clone(),
            pool: self.pool.clone(),
        };
        // Only the allocation the move was for.
        let same = |found: &ResourceClaim| {
            self.waiting(found)
                .is_some_and(|now| now.claim == w.claim && now.allocations == w.allocations)
        };
        // The scheduler waits on this write: an API server that cannot take it
        // now is asked again, with a growing pause, until the claim changes.
        let mut pause = Duration::from_secs(1);
        loop {
            let written = status
                .set_condition(&w.claim, &devices, &condition, w.generation, same)
                .await;
            match written {
                Ok(Written::Kept) => return true,
                Ok(Written::Dropped) => {
                    let first = !std::mem::replace(&mut seen.lock().status_dropped, true);
                    if first {
                        tracing::warn!(claim = %w.claim, "the API server drops \
                            ResourceClaim status.devices (its \
                            DRAResourceClaimDeviceStatus gate is off): the scheduler \
                            cannot see that devices are ready; turn the gate on, or \
                            run with --binding-conditions=off");
                    }
                    return true;
                }
                Ok(Written::Gone) => {
                    tracing::debug!(claim = %w.claim, "the claim changed before its \
                        status was written");
                    return false;
                }
                Err(e) => {
                    tracing::warn!(claim = %w.claim, error = %e, retry_in = ?pause,
                        "cannot write the claim's device status");
                }
            }
            if seen.pause_unless_changed(&w.claim.uid, pause).await {
                return false;
            }
            pause = (pause * 2).min(STATUS_RETRY_MAX);
        }
    }
}
