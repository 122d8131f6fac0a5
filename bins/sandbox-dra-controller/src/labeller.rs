//! The claim labeller: one leader per cluster watches every ResourceClaim and
//! labels each claim allocated to the driver's devices with their binding
//! condition with the node they are on ([`claim_label`]), so each node's driver
//! watches only its own claims and a claim change reaches one node instead of
//! all of them.
//!
//! It runs as a Deployment of two replicas. Only the holder of a
//! `coordination.k8s.io/v1` Lease acts ([`crate::election`]); the other waits and
//! takes over within the Lease's duration (15 s) after the leader stops renewing,
//! or at its next try (2 s) after a leader that stopped on SIGTERM released it.
//! A leader that cannot renew for 10 s stops acting and exits, before any
//! standby may take the Lease, so its pod restarts as a standby.
//!
//! Each label is written with a merge patch conditional on the claim's
//! resourceVersion the decision was made from: a claim that changed meanwhile
//! (allocated again, to another node, or deallocated) refuses the patch with a
//! conflict, and the newer version's event decides again. Claims allocated
//! before the leader started are labelled from its first list; a label whose
//! allocation went while no leader ran is removed then too. The nodes never
//! depend on it for prepare (kubelet hands them the claim), and with
//! `--claim-watch=auto` (their default) they watch every claim while no
//! labeller holds the Lease.
//!
//! The loop is kube-rs's `Controller`: one claim is never reconciled twice at
//! once, a failed patch is tried again after [`RETRY`], and the decision itself
//! ([`crate::labels::label_change`]) is a pure function.

use std::sync::Arc;
use std::time::{Duration, Instant};

use claim_label::label_key;
use claim_label::lease::Timing;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{self, Action, Controller};
use kube::Api;
use support::error_chain;
use tokio_stream::StreamExt;

use crate::election::Elector;
use crate::labels::{label_change, label_patch, LabelChange};
use crate::metrics::LabellerMetrics;

/// The field manager of the labeller's patches.
pub const FIELD_MANAGER: &str = "sandbox-dra-controller";
/// How long after a failed patch a claim is looked at again.
pub const RETRY: Duration = Duration::from_secs(5);
/// Claims labelled at once (a burst of allocations is labelled in parallel).
const CONCURRENCY: u16 = 16;
/// How long a stopping leader waits for its patches in flight, and then for
/// the release of the Lease: together well within the pod's grace of 30 s.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// What the labeller needs.
#[derive(Clone)]
pub struct Labeller {
    /// The API server, for requests.
    pub client: kube::Client,
    /// The same server, for the watch (reads wait past the watch's timeout).
    pub watch_client: kube::Client,
    /// The DRA driver name: the claims' results of this driver, the label key.
    pub driver: String,
    /// The Lease's namespace.
    pub namespace: String,
    /// The Lease's name.
    pub lease: String,
    /// This replica's name in the Lease (its pod name).
    pub identity: String,
    /// Lease timing.
    pub timing: Timing,
    pub metrics: Arc<LabellerMetrics>,
    /// What its readiness check reads.
    pub health: Arc<Health>,
}

/// What a replica knows of its own standing, for its readiness check: when a
/// request about the Lease last succeeded, and whether it leads.
#[derive(Debug, Default)]
pub struct Health {
    inner: std::sync::Mutex<HealthState>,
}

#[derive(Debug, Default)]
struct HealthState {
    leading: bool,
    holder: String,
    last_ok: Option<Instant>,
    last_error: Option<String>,
}

impl Health {
    /// A read, take or renewal of the Lease succeeded: `leading`, or standing by
    /// behind `holder`.
    fn lease_ok(&self, leading: bool, holder: &str) {
        let mut s = support::lock(&self.inner);
        s.leading = leading;
        holder.clone_into(&mut s.holder);
        s.last_ok = Some(Instant::now());
        s.last_error = None;
    }

    /// A request about the Lease failed.
    fn lease_failed(&self, error: String) {
        support::lock(&self.inner).last_error = Some(error);
    }

    /// Ready while a request about the Lease succeeded within `within` (the
    /// renew deadline): a leader renewing, or a standby that can read who
    /// leads. A replica that cannot reach the API server is not ready, and a
    /// rollout waits for it.
    pub fn readiness(&self, within: Duration) -> Result<String, String> {
        let s = support::lock(&self.inner);
        let Some(at) = s.last_ok else {
            return Err(match &s.last_error {
                Some(e) => format!("the Lease was never read: {e}"),
                None => "the Lease was not read yet".to_owned(),
            });
        };
        let ago = at.elapsed();
        if ago > within {
            return Err(format!(
                "no read or renewal of the Lease succeeded for {:.0?} (last error: {})",
                ago,
                s.last_error.as_deref().unwrap_or("none")
            ));
        }
        Ok(if s.leading {
            format!("leading, the Lease renewed {ago:.1?} ago")
        } else {
            format!(
                "standing by, the Lease (held by {:?}) read {ago:.1?} ago",
                s.holder
            )
        })
    }
}

/// Why the labeller stopped.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// The leader could not renew its Lease in time; it stopped acting.
    #[error("lost the Lease {lease}: no renewal succeeded for {deadline:?} (last error: {last})")]
    LostLease {
        /// `namespace/name`.
        lease: String,
        /// The renew deadline.
        deadline: Duration,
        /// The last failure.
        last: String,
    },
}

/// A patch that failed for a reason other than a newer version of the claim.
#[derive(Debug, thiserror::Error)]
#[error("cannot {action} on ResourceClaim {claim}")]
pub struct PatchError {
    action: String,
    claim: String,
    #[source]
    source: kube::Error,
}

impl Labeller {
    fn lease_ref(&self) -> String {
        format!("{}/{}", self.namespace, self.lease)
    }

    /// Takes part in the election until `stop` ends; labels claims while this
    /// replica leads. `Ok` after `stop` (the Lease released if held), `Err` when
    /// the Lease was lost.
    pub async fn run(
        &self,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<(), ControllerError> {
        tokio::pin!(stop);
        let api: Api<Lease> = Api::namespaced(self.client.clone(), &self.namespace);
        let mut elector = Elector::new(api, &self.lease, &self.identity, self.timing);
        if !self.acquire(&mut elector, &mut stop).await {
            return Ok(());
        }
        tracing::info!(lease = %self.lease_ref(), identity = %self.identity,
            "leading: labelling ResourceClaims with their node");
        self.metrics.leading(true);
        let (quit_tx, quit_rx) = tokio::sync::oneshot::channel::<()>();
        let labelling = tokio::spawn(self.clone().label(async move {
            let _ = quit_rx.await;
        }));
        let outcome = self.lead(&mut elector, &mut stop).await;
        let _ = quit_tx.send(());
        self.stop_labelling(labelling).await;
        self.metrics.leading(false);
        if outcome.is_ok() {
            let released = tokio::time::timeout(STOP_WAIT, elector.release()).await;
            match released {
                Ok(Ok(())) => tracing::info!(lease = %self.lease_ref(), "released the Lease"),
                Ok(Err(e)) => {
                    tracing::warn!(lease = %self.lease_ref(), error = %e,
                        "cannot release the Lease; a standby takes it when it expires")
                }
                Err(_) => {
                    tracing::warn!(lease = %self.lease_ref(), "no answer to the \
                        release within {STOP_WAIT:?}; a standby takes the Lease when \
                        it expires")
                }
            }
        }
        outcome
    }

    /// Waits up to [`STOP_WAIT`] for the labelling task to finish the patches
    /// it has started, then drops it. kube-runtime's graceful shutdown waits
    /// for its claim cache to fill before it stops, which it never does when
    /// the stop comes before the first list answered; a dropped patch is
    /// harmless (it is conditional, and the next leader decides again).
    async fn stop_labelling(&self, mut labelling: tokio::task::JoinHandle<()>) {
        if tokio::time::timeout(STOP_WAIT, &mut labelling)
            .await
            .is_err()
        {
            labelling.abort();
            tracing::warn!(lease = %self.lease_ref(), "labelling did not stop within \
                {STOP_WAIT:?}; stopped it");
        }
    }

    /// Tries for the Lease every `retry` until it is ours (true) or `stop` ends.
    async fn acquire(
        &self,
        elector: &mut Elector,
        stop: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    ) -> bool {
        let mut said: Option<String> = None;
        loop {
            match elector.try_acquire_or_renew().await {
                Ok(true) => {
                    self.health.lease_ok(true, &self.identity);
                    return true;
                }
                Ok(false) => {
                    let holder = elector.holder().unwrap_or_default().to_owned();
                    self.health.lease_ok(false, &holder);
                    if said.as_deref() != Some(&holder) {
                        tracing::info!(lease = %self.lease_ref(), holder = %holder,
                            "standing by: another replica holds the Lease");
                        said = Some(holder);
                    }
                }
                Err(e) => {
                    tracing::warn!(lease = %self.lease_ref(), error = %e,
                        "cannot read or take the Lease; trying again");
                    self.metrics.lease_failed();
                    self.health.lease_failed(e.to_string());
                    said = None;
                }
            }
            tokio::select! {
                () = stop.as_mut() => return false,
                () = tokio::time::sleep(self.timing.retry) => {}
            }
        }
    }

    /// Renews every `retry` until `stop` ends (`Ok`) or no renewal succeeded for
    /// the renew deadline (`Err`).
    async fn lead(
        &self,
        elector: &mut Elector,
        stop: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    ) -> Result<(), ControllerError> {
        let mut renewed = Instant::now();
        loop {
            tokio::select! {
                () = stop.as_mut() => return Ok(()),
                () = tokio::time::sleep(self.timing.retry) => {}
            }
            let left = self.timing.renew_deadline.saturating_sub(renewed.elapsed());
            let last = match tokio::time::timeout(left, elector.try_acquire_or_renew()).await {
                Ok(Ok(true)) => {
                    renewed = Instant::now();
                    self.health.lease_ok(true, &self.identity);
                    continue;
                }
                Ok(Ok(false)) => "another replica holds it".to_owned(),
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {left:?}"),
            };
            self.metrics.lease_failed();
            self.health.lease_failed(last.clone());
            if renewed.elapsed() >= self.timing.renew_deadline {
                return Err(ControllerError::LostLease {
                    lease: self.lease_ref(),
                    deadline: self.timing.renew_deadline,
                    last,
                });
            }
            tracing::warn!(lease = %self.lease_ref(), error = %last,
                "cannot renew the Lease; trying again");
        }
    }

    /// Labels claims until `stop` ends.
    async fn label(self, stop: impl std::future::Future<Output = ()> + Send + Sync + 'static) {
        let api: Api<ResourceClaim> = Api::all(self.watch_client.clone());
        let context = Arc::new(self);
        let outcomes = Controller::new(api, node_agent::cluster::watch_config())
            .with_config(controller::Config::default().concurrency(CONCURRENCY))
            .graceful_shutdown_on(stop)
            .run(reconcile, retry_later, context);
        tokio::pin!(outcomes);
        while let Some(outcome) = outcomes.next().await {
            if let Err(e) = outcome {
                tracing::debug!(error = %error_chain(&e), "claim labeller");
            }
        }
    }
}

/// Gives claim `claim` the label it should have, with a patch conditional on the
/// version it was decided from. A conflict or a claim gone is no error: the
/// newer version's event decides again.
async fn reconcile(
    claim: Arc<ResourceClaim>,
    labeller: Arc<Labeller>,
) -> Result<Action, PatchError> {
    let Some(change) = label_change(&claim, &labeller.driver) else {
        return Ok(Action::await_change());
    };
    let (Some(namespace), Some(name), Some(version)) = (
        claim.metadata.namespace.as_deref(),
        claim.metadata.name.as_deref(),
        claim.metadata.resource_version.as_deref(),
    ) else {
        return Ok(Action::await_change());
    };
    let key = label_key(&labeller.driver);
    let action = match &change {
        LabelChange::Set(v) => format!("set label {key}={v}"),
        LabelChange::Remove => format!("remove label {key}"),
    };
    let api: Api<ResourceClaim> = Api::namespaced(labeller.client.clone(), namespace);
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    let patch = label_patch(&labeller.driver, &change, version);
    let set = matches!(change, LabelChange::Set(_));
    match api.patch(name, &params, &Patch::Merge(&patch)).await {
        Ok(_) => {
            tracing::debug!(claim = %format!("{namespace}/{name}"), "{action}");
            labeller.metrics.label(set, "ok");
            Ok(Action::await_change())
        }
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
            labeller.metrics.label(set, "conflict");
            Ok(Action::await_change())
        }
        Err(source) => Err(PatchError {
            action,
            claim: format!("{namespace}/{name}"),
            source,
        }),
    }
}

/// A failed patch: said, counted, and the claim looked at again after [`RETRY`].
fn retry_later(claim: Arc<ResourceClaim>, error: &PatchError, labeller: Arc<Labeller>) -> Action {
    let set = matches!(
        label_change(&claim, &labeller.driver),
        Some(LabelChange::Set(_))
    );
    labeller.metrics.label(set, "error");
    tracing::warn!(error = %error_chain(error), retry_in = ?RETRY, "cannot label a ResourceClaim");
    Action::requeue(RETRY)
}
