//! The DRA kubelet service behind both API versions: each claim's allocation is read
//! from the API server, then the claims thread prepares or unprepares it. Every
//! answer is counted (metrics), and a failed prepare is posted as a Warning Event on
//! its ResourceClaim.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use crate::claims::{ClaimRef, Failure, PreparedDevice};
use crate::slices;
use node_agent::cluster::Cluster;
use sysfs_pci::error_chain;
use tokio::sync::{Notify, Semaphore};

use crate::metrics::{Metrics, Operation};
use crate::ready::Readiness;
use crate::worker::{Failed, Worker};

/// At most this many ResourceClaims are read from the API server at once.
const PARALLEL_READS: usize = 8;

/// Prepares and unprepares claims for kubelet.
pub struct Service {
    cluster: Cluster,
    driver: String,
    pool: String,
    worker: Worker,
    reads: Arc<Semaphore>,
    registered: Arc<Notify>,
    readiness: Arc<Readiness>,
    metrics: Arc<Metrics>,
    health: Option<Arc<crate::health::HealthBoard>>,
}

/// What the service reports to besides kubelet.
pub struct Reporting {
    /// Notified each time kubelet accepts our registration (the publisher
    /// publishes again).
    pub registered: Arc<Notify>,
    /// The ready file.
    pub readiness: Arc<Readiness>,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// Device health, streamed to kubelet.
    pub health: Option<Arc<crate::health::HealthBoard>>,
}

impl Service {
    /// A service for `driver` on the node whose pool is `pool`.
    pub fn new(
        cluster: Cluster,
        driver: String,
        pool: String,
        worker: Worker,
        reporting: Reporting,
    ) -> Self {
        Self {
            cluster,
            driver,
            pool,
            worker,
            reads: Arc::new(Semaphore::new(PARALLEL_READS)),
            registered: reporting.registered,
            readiness: reporting.readiness,
            metrics: reporting.metrics,
            health: reporting.health,
        }
    }

    /// Counts each answer, posts a Warning Event on each claim whose prepare failed
    /// (in the background: kubelet's answer does not wait for it), and gives the
    /// answers as kubelet gets them.
    fn report<T>(
        &self,
        op: Operation,
        started: Instant,
        asked: Vec<ClaimRef>,
        out: BTreeMap<String, Result<T, Failed>>,
    ) -> BTreeMap<String, Result<T, String>> {
        self.metrics.call(op, started.elapsed().as_secs_f64());
        for claim in asked {
            let failed = match out.get(&claim.uid) {
                Some(answer) => answer.as_ref().err(),
                None => continue,
            };
            self.metrics.claim(op, failed.map(|f| f.failure));
            let (Some(failed), Operation::Prepare) = (failed, op) else {
                continue;
            };
            let cluster = self.cluster.clone();
            let reason = failed.failure.event_reason();
            let note = failed.message.clone();
            tokio::spawn(async move {
                let (reference, what) = claim.event_target(reason);
                if let Err(e) = cluster
                    .event(&reference, &what, true, reason, "PrepareResources", &note)
                    .await
                {
                    tracing::debug!(claim = %claim, error = %error_chain(&e), "cannot post an Event on the claim");
                }
            });
        }
        out.into_iter()
            .map(|(uid, a)| (uid, a.map_err(|f| f.message)))
            .collect()
    }
}

/// One answer per distinct uid, in the order kubelet asked.
fn distinct(claims: Vec<ClaimRef>) -> Vec<ClaimRef> {
    let mut seen = std::collections::BTreeSet::new();
    claims
        .into_iter()
        .filter(|c| seen.insert(c.uid.clone()))
        .collect()
}

#[tonic::async_trait]
impl crate::grpc::Driver for Service {
    /// One deadline for the whole call (`--prepare-timeout`, below kubelet's 45 s
    /// call limit): claim reads and the claims thread's work alike. Each claim's
    /// job is queued as soon as its read is done, so work left at the deadline
    /// goes on and kubelet's retry gets its result.
    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, Result<Vec<PreparedDevice>, String>> {
        let started = Instant::now();
        let deadline = self.worker.deadline();
        let mut reads = tokio::task::JoinSet::new();
        let mut out = BTreeMap::new();
        let asked = distinct(claims);
        for claim in asked.iter().cloned() {
            // Taken on arrival: an unprepare that answers after this wins.
            let ticket = self.worker.ticket();
            if claim.uid.is_empty() {
                out.insert(
                    claim.uid.clone(),
                    Err(Failed::new(
                        Failure::Refused,
                        format!("claim {claim}: kubelet sent no uid"),
                    )),
                );
                continue;
            }
            let cluster = self.cluster.clone();
            let driver = self.driver.clone();
            let pool = self.pool.clone();
            let permits = self.reads.clone();
            reads.spawn(async move {
                let _permit = permits.acquire().await;
                let allocation =
                    slices::claim_allocation(&cluster.kube_client(), &claim, &driver, &pool)
                        .await
                        .map_err(|e| Failed::new(e.failure(), error_chain(&e)));
                (claim, ticket, allocation)
            });
        }
        let mut pending = Vec::new();
        loop {
            let done = match tokio::time::timeout_at(deadline, reads.join_next()).await {
                Ok(Some(done)) => done,
                Ok(None) => break,
                Err(_) => break, // reads still running are answered below
            };
            let Ok((claim, ticket, allocation)) = done else {
                continue;
            };
            match allocation {
                Ok(read) => pending.push((
                    claim.clone(),
                    self.worker
                        .prepare(claim, ticket, read.pod_claim_name, read.allocations),
                )),
                Err(e) => {
                    tracing::warn!(claim = %claim, error = %e.message, "cannot prepare");
                    out.insert(claim.uid, Err(e));
                }
            }
        }
        reads.abort_all();
        for (claim, job) in pending {
            out.insert(claim.uid, self.worker.answer(job, deadline).await);
        }
        for claim in &asked {
            if let std::collections::btree_map::Entry::Vacant(e) = out.entry(claim.uid.clone()) {
                let why = format!(
                    "claim {claim}: reading it from the API server took too long; {}",
                    self.worker.late()
                );
                tracing::warn!(claim = %claim, "{why}");
                e.insert(Err(Failed::new(Failure::Timeout, why)));
            }
        }
        self.report(Operation::Prepare, started, asked, out)
    }

    fn registration_status(&self, registered: bool) {
        self.readiness.registered(registered);
        if registered {
            self.registered.notify_one();
        }
    }

    fn health(&self) -> Option<Arc<crate::health::HealthBoard>> {
        self.health.clone()
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, Result<(), String>> {
        let started = Instant::now();
        let deadline = self.worker.deadline();
        let mut out = BTreeMap::new();
        let mut pending = Vec::new();
        let asked = distinct(claims);
        for claim in asked.iter().cloned() {
            if claim.uid.is_empty() {
                out.insert(
                    claim.uid.clone(),
                    Err(Failed::new(
                        Failure::Refused,
                        format!("claim {claim}: kubelet sent no uid"),
                    )),
                );
            } else {
                pending.push((claim.uid.clone(), self.worker.unprepare(claim)));
            }
        }
        for (uid, job) in pending {
            out.insert(uid, self.worker.answer(job, deadline).await);
        }
        self.report(Operation::Unprepare, started, asked, out)
    }
}
