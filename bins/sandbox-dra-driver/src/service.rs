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
    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, Result<Vec<PreparedDevice>, String>> {
        let mut reads = tokio::task::JoinSet::new();
        for claim in distinct(claims) {
            let cluster = self.cluster.clone();
            let driver = self.driver.clone();
            let pool = self.pool.clone();
            let permits = self.reads.clone();
            reads.spawn(async move {
                let allocation = if claim.uid.is_empty() {
                    Err(format!("claim {claim}: kubelet sent no uid"))
                } else {
                    let _permit = permits.acquire().await;
                    dra::claim_allocation(&cluster.kube_client(), &claim, &driver, &pool)
                        .await
                        .map_err(|e| error_chain(&e))
                };
                (claim, allocation)
            });
        }
        let mut read = Vec::new();
        while let Some(done) = reads.join_next().await {
            if let Ok(pair) = done {
                read.push(pair);
            }
        }
        let mut out = BTreeMap::new();
        for (claim, allocation) in read {
            let answer = match allocation {
                Ok(read) => {
                    self.worker
                        .prepare(claim.clone(), read.pod_claim_name, read.allocations)
                        .await
                }
                Err(e) => {
                    tracing::warn!(claim = %claim, error = %e, "cannot prepare");
                    Err(e)
                }
            };
            out.insert(claim.uid, answer);
        }
        out
    }

    fn registration_status(&self, registered: bool) {
        if registered {
            self.registered.notify_one();
        }
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, Result<(), String>> {
        let mut out = BTreeMap::new();
        for claim in distinct(claims) {
            let answer = if claim.uid.is_empty() {
                Err(format!("claim {claim}: kubelet sent no uid"))
            } else {
                self.worker.unprepare(claim.clone()).await
            };
            out.insert(claim.uid, answer);
        }
        out
    }
}
