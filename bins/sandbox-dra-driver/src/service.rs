//! The DRA kubelet service behind both API versions: each claim's allocation is read
//! from the API server, then the claims thread prepares or unprepares it.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::sync::{Notify, Semaphore};
use vfio_sandbox::claims::{ClaimRef, PreparedDevice};
use vfio_sandbox::cluster::Cluster;
use vfio_sandbox::{dra, error_chain};

use crate::worker::Worker;

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
}

impl Service {
    /// A service for `driver` on the node whose pool is `pool`; `registered` is
    /// notified each time kubelet accepts our registration.
    pub fn new(
        cluster: Cluster,
        driver: String,
        pool: String,
        worker: Worker,
        registered: Arc<Notify>,
    ) -> Self {
        Self {
            cluster,
            driver,
            pool,
            worker,
            reads: Arc::new(Semaphore::new(PARALLEL_READS)),
            registered,
        }
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
                    Err(format!("claim {claim}: kubelet sent no uid")),
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
                    dra::claim_allocation(&cluster.kube_client(), &claim, &driver, &pool)
                        .await
                        .map_err(|e| error_chain(&e));
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
                    tracing::warn!(claim = %claim, error = %e, "cannot prepare");
                    out.insert(claim.uid, Err(e));
                }
            }
        }
        reads.abort_all();
        for (claim, job) in pending {
            out.insert(claim.uid, self.worker.answer(job, deadline).await);
        }
        for claim in asked {
            if let std::collections::btree_map::Entry::Vacant(e) = out.entry(claim.uid.clone()) {
                let why = format!(
                    "claim {claim}: reading it from the API server took too long; {}",
                    self.worker.late()
                );
                tracing::warn!(claim = %claim, "{why}");
                e.insert(Err(why));
            }
        }
        out
    }

    fn registration_status(&self, registered: bool) {
        if registered {
            self.registered.notify_one();
        }
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, Result<(), String>> {
        let deadline = self.worker.deadline();
        let mut out = BTreeMap::new();
        let mut pending = Vec::new();
        for claim in distinct(claims) {
            if claim.uid.is_empty() {
                out.insert(
                    claim.uid.clone(),
                    Err(format!("claim {claim}: kubelet sent no uid")),
                );
            } else {
                pending.push((claim.uid.clone(), self.worker.unprepare(claim)));
            }
        }
        for (uid, job) in pending {
            out.insert(uid, self.worker.answer(job, deadline).await);
        }
        out
    }
}
