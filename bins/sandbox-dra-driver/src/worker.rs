//! The one thread that changes the node: it owns the state file (and its lock) and
//! runs each prepare and unprepare to the end, one at a time, on a fresh scan.
//!
//! RPC handlers hand it jobs and wait a bounded time for the answer. An unbind that
//! blocks in a native driver holds this thread, not the RPC: the caller times out
//! with a message naming what the thread is doing, and kubelet's retry finds the
//! claim prepared (or gets the error) once the step ends.

use std::path::Path;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use vfio_sandbox::claims::{Allocation, ClaimRef, Claims, Files, PreparedDevice};
use vfio_sandbox::config::ResourceList;
use vfio_sandbox::inventory::Inventory;
use vfio_sandbox::kernel::SysKernel;
use vfio_sandbox::passthrough::Passthrough;
use vfio_sandbox::state::StateFile;
use vfio_sandbox::{error_chain, Host};

enum Job {
    Prepare {
        claim: ClaimRef,
        pod_claim_name: Option<String>,
        allocations: Vec<Allocation>,
        reply: oneshot::Sender<Result<Vec<PreparedDevice>, String>>,
    },
    Unprepare {
        claim: ClaimRef,
        reply: oneshot::Sender<Result<(), String>>,
    },
}

/// What the thread needs.
pub struct Setup {
    /// The node's roots.
    pub host: Host,
    /// The resource list.
    pub list: ResourceList,
    /// The locked state file, already recovered.
    pub state: StateFile,
    /// The running kernel's release.
    pub release: String,
    /// This node's pool.
    pub pool: String,
    /// Where claim files go.
    pub files: Files,
}

/// Handle of the worker thread.
#[derive(Clone)]
pub struct Worker {
    tx: std_mpsc::Sender<Job>,
    busy: Arc<Mutex<Option<(String, Instant)>>>,
    timeout: Duration,
}

impl Worker {
    /// Starts the thread. Jobs wait at most `timeout` for their answer.
    pub fn start(setup: Setup, timeout: Duration) -> anyhow::Result<Self> {
        let (tx, rx) = std_mpsc::channel();
        let busy = Arc::new(Mutex::new(None));
        let shown = busy.clone();
        std::thread::Builder::new()
            .name("claims".into())
            .spawn(move || work(setup, rx, shown))?;
        Ok(Self { tx, busy, timeout })
    }

    /// Prepares one claim, or says why not (within the timeout).
    pub async fn prepare(
        &self,
        claim: ClaimRef,
        pod_claim_name: Option<String>,
        allocations: Vec<Allocation>,
    ) -> Result<Vec<PreparedDevice>, String> {
        let (reply, rx) = oneshot::channel();
        self.ask(
            Job::Prepare {
                claim,
                pod_claim_name,
                allocations,
                reply,
            },
            rx,
        )
        .await
    }

    /// Unprepares one claim, or says why not (within the timeout).
    pub async fn unprepare(&self, claim: ClaimRef) -> Result<(), String> {
        let (reply, rx) = oneshot::channel();
        self.ask(Job::Unprepare { claim, reply }, rx).await
    }

    async fn ask<T>(
        &self,
        job: Job,
        rx: oneshot::Receiver<Result<T, String>>,
    ) -> Result<T, String> {
        self.tx
            .send(job)
            .map_err(|_| "the claims thread has stopped".to_owned())?;
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err("the claims thread stopped before answering".into()),
            Err(_) => Err(format!(
                "not done within {:?} ({}); the work goes on and a retry gets its result",
                self.timeout,
                self.doing()
            )),
        }
    }

    /// What the thread is doing now, for people.
    fn doing(&self) -> String {
        match self.busy.lock().ok().and_then(|b| b.clone()) {
            Some((what, since)) => format!("{what} for {:.1?} so far", since.elapsed()),
            None => "the claim is still queued".into(),
        }
    }
}

fn work(
    mut setup: Setup,
    rx: std_mpsc::Receiver<Job>,
    busy: Arc<Mutex<Option<(String, Instant)>>>,
) {
    let kernel = SysKernel;
    while let Ok(job) = rx.recv() {
        let what = match &job {
            Job::Prepare { claim, .. } => format!("preparing claim {claim}"),
            Job::Unprepare { claim, .. } => format!("unpreparing claim {claim}"),
        };
        if let Ok(mut b) = busy.lock() {
            *b = Some((what, Instant::now()));
        }
        let mut claims = Claims {
            pt: Passthrough {
                host: &setup.host,
                kernel: &kernel,
                state: &mut setup.state,
                release: setup.release.clone(),
            },
            pool: &setup.pool,
            files: &setup.files,
        };
        match job {
            Job::Prepare {
                claim,
                pod_claim_name,
                allocations,
                reply,
            } => {
                let started = Instant::now();
                let answer = Inventory::scan(&setup.host, &setup.list)
                    .map_err(|e| {
                        format!(
                            "claim {claim}: cannot scan the node's PCI devices: {}",
                            error_chain(&e)
                        )
                    })
                    .and_then(|inv| {
                        claims
                            .prepare(&claim, pod_claim_name.as_deref(), &allocations, &inv)
                            .map_err(|e| error_chain(&e))
                    });
                match &answer {
                    Ok(devices) => {
                        tracing::info!(claim = %claim, devices = devices.len(), took = ?started.elapsed(), "prepared")
                    }
                    Err(e) => tracing::warn!(claim = %claim, error = %e, "prepare failed"),
                }
                let _ = reply.send(answer);
            }
            Job::Unprepare { claim, reply } => {
                let started = Instant::now();
                let answer = claims.unprepare(&claim).map_err(|e| error_chain(&e));
                match &answer {
                    Ok(()) => {
                        tracing::info!(claim = %claim, took = ?started.elapsed(), "unprepared")
                    }
                    Err(e) => tracing::warn!(claim = %claim, error = %e, "unprepare failed"),
                }
                let _ = reply.send(answer);
            }
        }
        if let Ok(mut b) = busy.lock() {
            *b = None;
        }
    }
}

/// The claims recorded in a state file, for a message at stop.
pub fn prepared_claims(path: &Path) -> Vec<String> {
    match StateFile::load(path, false) {
        Ok(s) => s
            .state()
            .claims
            .iter()
            .map(|(uid, c)| format!("{}/{} (uid {uid})", c.namespace, c.name))
            .collect(),
        Err(_) => Vec::new(),
    }
}
