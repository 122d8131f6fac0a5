//! The one thread that changes the node: it owns the state file (and its lock) and
//! runs each prepare and unprepare to the end, one at a time, on a fresh scan.
//!
//! RPC handlers hand it jobs and wait for the answers until the call's deadline. An
//! unbind that blocks in a native driver holds this thread, not the RPC: the caller
//! times out with a message naming what the thread is doing, and kubelet's retry
//! finds the claim prepared (or gets the error) once the step ends.
//!
//! A prepare takes a [`Ticket`] when its RPC arrives, before its claim is read from
//! the API server. An unprepare that answers OK marks the claim; a prepare whose
//! ticket is older than that mark is refused when its turn comes. So a claim whose
//! unprepare kubelet saw succeed never becomes prepared by a prepare that was
//! already in flight (its claim read slow, its RPC given up by kubelet).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::claims::{Allocation, ClaimRef, Claims, Failure, Files, PreparedDevice};
use passthrough::config::ResourceList;
use passthrough::inventory::Inventory;
use passthrough::state::StateFile;
use passthrough::Passthrough;
use sysfs_pci::deadline::Bounded;
use sysfs_pci::kernel::SysKernel;
use sysfs_pci::{error_chain, Host, PciAddress};
use tokio::sync::oneshot;

use crate::metrics::Metrics;

/// Why a claim was not prepared or unprepared: the message kubelet gets, and the
/// reason in one word for metrics and Events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failed {
    /// Why, in one word.
    pub failure: Failure,
    /// What kubelet gets.
    pub message: String,
}

impl Failed {
    /// A failure for `failure`, said as `message`.
    pub fn new(failure: Failure, message: String) -> Self {
        Self { failure, message }
    }
}

impl From<crate::claims::ClaimError> for Failed {
    fn from(e: crate::claims::ClaimError) -> Self {
        Self::new(e.failure(), error_chain(&e))
    }
}

enum Job {
    Prepare {
        claim: ClaimRef,
        ticket: Ticket,
        pod_claim_name: Option<String>,
        allocations: Vec<Allocation>,
        reply: oneshot::Sender<Result<Vec<PreparedDevice>, Failed>>,
    },
    Unprepare {
        claim: ClaimRef,
        reply: oneshot::Sender<Result<(), Failed>>,
    },
    MoveEarly {
        claim: ClaimRef,
        allocations: Vec<Allocation>,
        reply: oneshot::Sender<Result<(), Failed>>,
    },
    Release {
        uid: String,
        reply: oneshot::Sender<Result<Option<ClaimRef>, Failed>>,
    },
    MovedEarly {
        reply: oneshot::Sender<Result<Vec<ClaimRef>, Failed>>,
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
    /// IOMMU groups moved at once.
    pub jobs: std::num::NonZeroUsize,
    /// Told the devices of prepared claims after every job.
    pub health: Option<Arc<crate::health::HealthBoard>>,
    /// Device gauges, set after every job.
    pub metrics: Arc<Metrics>,
    /// The kernel door, with its deadline on every sysfs write (and the devices
    /// stuck behind one).
    pub kernel: Bounded<SysKernel>,
    /// Told the driver each recorded device had before it moved, after every job
    /// (which devices need a rebind, for their binding conditions).
    pub homes: Option<Arc<crate::binding::Homes>>,
}

/// When a prepare's RPC arrived, in the order of [`Worker`]'s events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ticket(u64);

/// Unprepares that answered OK, by claim uid: the event count at the time.
#[derive(Default)]
struct Unprepared {
    clock: AtomicU64,
    marks: Mutex<(HashMap<String, u64>, BTreeMap<u64, String>)>,
}

/// Marks kept; older ones are forgotten. Unprepares run on the claims thread, so
/// this many cannot pass while one prepare waits there.
const MARKS: usize = 4096;

impl Unprepared {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst)
    }

    fn mark(&self, uid: &str) {
        let now = self.tick();
        let mut m = sysfs_pci::kernel::lock(&self.marks);
        let (by_uid, by_time) = &mut *m;
        if let Some(old) = by_uid.insert(uid.to_owned(), now) {
            by_time.remove(&old);
        }
        by_time.insert(now, uid.to_owned());
        while by_time.len() > MARKS {
            if let Some((_, uid)) = by_time.pop_first() {
                by_uid.remove(&uid);
            }
        }
    }

    /// True when `uid` was unprepared after `ticket` was taken.
    fn since(&self, uid: &str, ticket: Ticket) -> bool {
        let m = sysfs_pci::kernel::lock(&self.marks);
        m.0.get(uid).is_some_and(|t| *t > ticket.0)
    }
}

/// Handle of the worker thread.
#[derive(Clone)]
pub struct Worker {
    tx: std_mpsc::Sender<Job>,
    busy: Arc<Mutex<Option<(String, Instant)>>>,
    timeout: Duration,
    unprepared: Arc<Unprepared>,
}

impl Worker {
    /// Starts the thread. A call waits at most `timeout` for all its answers.
    pub fn start(setup: Setup, timeout: Duration) -> anyhow::Result<Self> {
        let (tx, rx) = std_mpsc::channel();
        let busy = Arc::new(Mutex::new(None));
        let shown = busy.clone();
        let unprepared = Arc::new(Unprepared::default());
        let marks = unprepared.clone();
        std::thread::Builder::new()
            .name("claims".into())
            .spawn(move || work(setup, rx, shown, &marks))?;
        Ok(Self {
            tx,
            busy,
            timeout,
            unprepared,
        })
    }

    /// The deadline of a call that starts now: the whole call, claim reads
    /// included, answers by then.
    pub fn deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.timeout
    }

    /// A ticket for a prepare whose RPC arrives now; take it before reading the claim.
    pub fn ticket(&self) -> Ticket {
        Ticket(self.unprepared.tick())
    }

    /// Queues the preparation of one claim; [`Self::answer`] waits for it.
    pub fn prepare(
        &self,
        claim: ClaimRef,
        ticket: Ticket,
        pod_claim_name: Option<String>,
        allocations: Vec<Allocation>,
    ) -> Pending<Vec<PreparedDevice>> {
        let (reply, rx) = oneshot::channel();
        self.send(
            Job::Prepare {
                claim,
                ticket,
                pod_claim_name,
                allocations,
                reply,
            },
            rx,
        )
    }

    /// Queues the unpreparation of one claim; [`Self::answer`] waits for it.
    pub fn unprepare(&self, claim: ClaimRef) -> Pending<()> {
        let (reply, rx) = oneshot::channel();
        self.send(Job::Unprepare { claim, reply }, rx)
    }

    /// Queues the early move of one claim's groups (its pod not yet bound).
    pub fn move_early(&self, claim: ClaimRef, allocations: Vec<Allocation>) -> Pending<()> {
        let (reply, rx) = oneshot::channel();
        self.send(
            Job::MoveEarly {
                claim,
                allocations,
                reply,
            },
            rx,
        )
    }

    /// Queues giving back the devices of claim `uid` if they were moved early and
    /// never prepared; the claim, if they were.
    pub fn release(&self, uid: String) -> Pending<Option<ClaimRef>> {
        let (reply, rx) = oneshot::channel();
        self.send(Job::Release { uid, reply }, rx)
    }

    /// Asks which claims are moved early and not prepared.
    pub fn moved_early(&self) -> Pending<Vec<ClaimRef>> {
        let (reply, rx) = oneshot::channel();
        self.send(Job::MovedEarly { reply }, rx)
    }

    fn send<T>(&self, job: Job, rx: oneshot::Receiver<Result<T, Failed>>) -> Pending<T> {
        match self.tx.send(job) {
            Ok(()) => Pending(Some(rx)),
            Err(_) => Pending(None),
        }
    }

    /// The answer of a queued job, or why there is none by `deadline`.
    pub async fn answer<T>(
        &self,
        pending: Pending<T>,
        deadline: tokio::time::Instant,
    ) -> Result<T, Failed> {
        let stopped = |what: &str| Failed::new(Failure::Failed, what.to_owned());
        let rx = pending
            .0
            .ok_or_else(|| stopped("the claims thread has stopped"))?;
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(stopped("the claims thread stopped before answering")),
            Err(_) => Err(Failed::new(Failure::Timeout, self.late())),
        }
    }

    /// Why a call ran out of time, naming what the thread is doing.
    pub fn late(&self) -> String {
        format!(
            "not done within {:?} ({}); the work goes on and a retry gets its result",
            self.timeout,
            self.doing()
        )
    }

    /// What the thread is doing now, for people.
    fn doing(&self) -> String {
        match self.busy.lock().ok().and_then(|b| b.clone()) {
            Some((what, since)) => format!("{what} for {:.1?} so far", since.elapsed()),
            None => "the claim is still queued".into(),
        }
    }
}

/// A job handed to the claims thread, its answer to come.
pub struct Pending<T>(Option<oneshot::Receiver<Result<T, Failed>>>);

fn work(
    mut setup: Setup,
    rx: std_mpsc::Receiver<Job>,
    busy: Arc<Mutex<Option<(String, Instant)>>>,
    unprepared: &Unprepared,
) {
    held(&setup);
    let mut owner_lost: Option<String> = None;
    loop {
        let job = match rx.recv_timeout(OWNER_CHECK) {
            Ok(job) => job,
            Err(std_mpsc::RecvTimeoutError::Timeout) => {
                check_owner(&mut setup.state, &mut owner_lost);
                continue;
            }
            Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let what = match &job {
            Job::Prepare { claim, .. } => format!("preparing claim {claim}"),
            Job::Unprepare { claim, .. } => format!("unpreparing claim {claim}"),
            Job::MoveEarly { claim, .. } => format!("moving claim {claim} early"),
            Job::Release { uid, .. } => format!("giving back claim uid {uid}"),
            Job::MovedEarly { .. } => "listing claims moved early".into(),
        };
        if let Ok(mut b) = busy.lock() {
            *b = Some((what, Instant::now()));
        }
        match &job {
            Job::Unprepare { claim, .. } => leaving(&setup, &claim.uid),
            Job::Release { uid, .. }
                if setup
                    .state
                    .state()
                    .claims
                    .get(uid)
                    .is_some_and(|c| c.phase != passthrough::state::ClaimPhase::Prepared) =>
            {
                leaving(&setup, uid);
            }
            _ => {}
        }
        let mut claims = Claims {
            pt: Passthrough {
                host: &setup.host,
                kernel: &setup.kernel,
                state: &mut setup.state,
                release: setup.release.clone(),
            },
            pool: &setup.pool,
            files: &setup.files,
            jobs: setup.jobs,
        };
        match job {
            Job::Prepare {
                claim,
                ticket,
                pod_claim_name,
                allocations,
                reply,
            } => {
                let started = Instant::now();
                if unprepared.since(&claim.uid, ticket) {
                    let why = format!("claim {claim}: kubelet unprepared it while this prepare was on its way; not preparing it (a new prepare will)");
                    tracing::warn!(claim = %claim, "{why}");
                    let _ = reply.send(Err(Failed::new(Failure::Unprepared, why)));
                    continue_after(&busy);
                    continue;
                }
                let answer = claims
                    .settle(&claim)
                    .map_err(Failed::from)
                    .and_then(|()| scan(&setup.host, &setup.list, &claim))
                    .and_then(|inv| {
                        claims
                            .prepare(&claim, pod_claim_name.as_deref(), &allocations, &inv)
                            .map_err(Failed::from)
                    });
                match &answer {
                    Ok(devices) => {
                        tracing::info!(claim = %claim, devices = devices.len(), took = ?started.elapsed(), "prepared")
                    }
                    Err(e) => {
                        tracing::warn!(claim = %claim, error = %e.message, "prepare failed")
                    }
                }
                // The gauges first: whoever reads them after the answer sees it.
                held(&setup);
                let _ = reply.send(answer);
            }
            Job::Unprepare { claim, reply } => {
                let started = Instant::now();
                let answer = claims.unprepare(&claim).map_err(Failed::from);
                if answer.is_ok() {
                    unprepared.mark(&claim.uid);
                }
                match &answer {
                    Ok(()) => {
                        tracing::info!(claim = %claim, took = ?started.elapsed(), "unprepared")
                    }
                    Err(e) => {
                        tracing::warn!(claim = %claim, error = %e.message, "unprepare failed")
                    }
                }
                // The gauges first: whoever reads them after the answer sees it.
                held(&setup);
                let _ = reply.send(answer);
            }
            Job::MoveEarly {
                claim,
                allocations,
                reply,
            } => {
                let started = Instant::now();
                let answer = claims
                    .settle(&claim)
                    .map_err(Failed::from)
                    .and_then(|()| scan(&setup.host, &setup.list, &claim))
                    .and_then(|inv| {
                        claims
                            .move_early(&claim, &allocations, &inv)
                            .map_err(Failed::from)
                    });
                match &answer {
                    Ok(()) => {
                        tracing::info!(claim = %claim, took = ?started.elapsed(), "moved to vfio before its pod is bound")
                    }
                    Err(e) => {
                        tracing::warn!(claim = %claim, error = %e.message, "early move failed")
                    }
                }
                held(&setup);
                let _ = reply.send(answer);
            }
            Job::Release { uid, reply } => {
                let shown = claims.moved_early().into_iter().find(|c| c.uid == uid);
                let answer = claims
                    .release(&uid)
                    .map(|released| released.then_some(shown).flatten())
                    .map_err(Failed::from);
                match &answer {
                    Ok(Some(claim)) => {
                        tracing::info!(claim = %claim, "gave back the devices of a claim that lost its allocation before its pod started")
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(uid = %uid, error = %e.message, "cannot give back the devices of a claim moved early")
                    }
                }
                held(&setup);
                let _ = reply.send(answer);
            }
            Job::MovedEarly { reply } => {
                let _ = reply.send(Ok(claims.moved_early()));
            }
        }
        continue_after(&busy);
    }
}

/// How often the idle thread checks that the owner lock is still ours (every save
/// that records a device checks it too).
const OWNER_CHECK: Duration = Duration::from_secs(10);

/// Checks that the node's owner lock still keeps every other taker out (a cleanup
/// of its directory deletes it), taking it again if it can; says so when that
/// changes. While it is not ours, every prepare and early move is refused at its
/// first save, naming the lock.
fn check_owner(state: &mut StateFile, lost: &mut Option<String>) {
    match state.ensure_owner() {
        Ok(()) => {
            if lost.take().is_some() {
                tracing::info!("the node's owner lock is ours again; preparing claims");
            }
        }
        Err(e) => {
            let why = error_chain(&e);
            if lost.as_ref() != Some(&why) {
                tracing::error!(error = %why, "moving no device: the node's owner lock is no longer ours; claims prepared here are refused");
            }
            *lost = Some(why);
        }
    }
}

/// A fresh scan of the node for a job on `claim`.
fn scan(host: &Host, list: &ResourceList, claim: &ClaimRef) -> Result<Inventory, Failed> {
    Inventory::scan(host, list).map_err(|e| {
        Failed::new(
            Failure::Failed,
            format!(
                "claim {claim}: cannot scan the node's PCI devices: {}",
                error_chain(&e)
            ),
        )
    })
}

/// Sets the device gauges from the state file.
fn held(setup: &Setup) {
    let state = setup.state.state();
    let prepared = state.claims.values().map(|c| c.devices.len()).sum();
    setup.metrics.held(prepared, state.devices.len());
    if let Some(homes) = &setup.homes {
        homes.set(
            state
                .devices
                .iter()
                .map(|(a, r)| (*a, r.original_driver.clone()))
                .collect(),
        );
    }
    if let Some(health) = &setup.health {
        health.set_prepared(held_for_vms(setup, None));
    }
}

/// The devices of claims prepared or moved early, but those of claim `leaving`.
fn held_for_vms(setup: &Setup, leaving: Option<&str>) -> std::collections::BTreeSet<PciAddress> {
    setup
        .state
        .state()
        .claims
        .iter()
        .filter(|(uid, c)| {
            Some(uid.as_str()) != leaving
                && matches!(
                    c.phase,
                    passthrough::state::ClaimPhase::Prepared
                        | passthrough::state::ClaimPhase::Moved
                )
        })
        .flat_map(|(_, c)| c.devices.iter().map(|d| d.address))
        .collect()
}

/// Claim `uid`'s devices are about to go back to their drivers: from now on
/// their health is judged as devices ready to be prepared, so a device on its
/// way back (or back already) is not reported unhealthy for not being on vfio.
/// A give-back that fails puts them back with [`held`].
fn leaving(setup: &Setup, uid: &str) {
    if let Some(health) = &setup.health {
        health.set_prepared(held_for_vms(setup, Some(uid)));
    }
}

/// The thread is idle again.
fn continue_after(busy: &Mutex<Option<(String, Instant)>>) {
    if let Ok(mut b) = busy.lock() {
        *b = None;
    }
}

/// The claims recorded in a state file, for a message at stop.
pub fn prepared_claims(path: &Path) -> Vec<String> {
    match StateFile::load(path, false, passthrough::owner::Program::DraDriver) {
        Ok(s) => s
            .state()
            .claims
            .iter()
            .map(|(uid, c)| format!("{}/{} (uid {uid})", c.namespace, c.name))
            .collect(),
        Err(_) => Vec::new(),
    }
}
