//! The one thread that changes the node: it owns the state file (and its lock) and
//! runs each job — a prepare, an unprepare, an early move, a give-back — to the
//! end, one at a time, on a fresh scan.
//!
//! Callers hand it jobs and wait for the answers until the call's deadline. An
//! unbind that blocks in a native driver holds this thread, not the RPC: the caller
//! times out with a message naming what the thread is doing, and kubelet's retry
//! finds the claim prepared (or gets the error) once the step ends.
//!
//! A prepare carries the [`Ticket`] of its call's arrival, taken before its claim
//! was read from the API server. An unprepare that answers OK marks the claim; a
//! prepare whose ticket is older than that mark is refused when its turn comes. So
//! a claim whose unprepare kubelet saw succeed never becomes prepared by a prepare
//! that was already in flight (its claim read slow, its RPC given up by kubelet).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::model::{ClaimDevice, ClaimPhase, StateFile};
use kubelet_plugin::{
    AllocatedDevice, Answers, Claim, ClaimRef, OpaqueConfig, PreparedDevice, Republish, Ticket,
};
use passthrough::config::ResourceList;
use passthrough::Passthrough;
use support::error_chain;
use sysfs_pci::deadline::Bounded;
use sysfs_pci::kernel::SysKernel;
use sysfs_pci::{Host, PciAddress};
use tokio::sync::oneshot;

use crate::claims::{Claims, DriverError, Files};
use crate::metrics::Metrics;

/// What the thread needs.
#[allow(missing_docs)]
pub struct WorkerConfig {
    pub host: Host,
    pub list: ResourceList,
    /// The locked state file, already recovered.
    pub state: StateFile,
    pub release: String,
    pub pool: String,
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
    pub original_drivers: Option<Arc<crate::binding::OriginalDrivers>>,
    /// Why the node's owner lock is not ours now, kept by the claims thread for
    /// the driver's offer (which withdraws every device meanwhile).
    pub owner_lost: OwnerLost,
    /// Told when the node becomes ours, or stops being ours.
    pub republish: Option<Republish>,
}

/// Why the node's owner lock is not ours now; `None` while it is.
pub type OwnerLost = Arc<Mutex<Option<String>>>;

/// Unprepares that answered OK, by claim uid: the ticket of the time.
#[derive(Default)]
struct Unprepared(Mutex<(HashMap<String, Ticket>, BTreeMap<Ticket, String>)>);

/// Marks kept; older ones are forgotten. Unprepares run on the claims thread, so
/// this many cannot pass while one prepare waits there.
const MARKS: usize = 4096;

impl Unprepared {
    fn mark(&self, uid: &str) {
        let now = Ticket::now();
        let mut m = support::lock(&self.0);
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
        support::lock(&self.0)
            .0
            .get(uid)
            .is_some_and(|t| *t > ticket)
    }
}

/// What a job works on: the thread's setup and the unprepare marks.
struct WorkerState {
    setup: WorkerConfig,
    unprepared: Unprepared,
}

impl WorkerState {
    /// The claims, on the engine and the state file.
    fn claims(&mut self) -> Claims<'_> {
        let s = &mut self.setup;
        Claims {
            engine: Passthrough {
                host: &s.host,
                kernel: &s.kernel,
                state: &mut s.state,
                release: s.release.clone(),
            },
            list: &s.list,
            pool: &s.pool,
            files: &s.files,
            jobs: s.jobs,
        }
    }

    /// The phase claim `uid` is recorded in.
    fn phase(&self, uid: &str) -> Option<ClaimPhase> {
        self.setup.state.records().get(uid).map(|c| c.phase)
    }
}

/// One job: what it is, for people, and the work, which answers its caller.
struct Job {
    what: String,
    work: Box<dyn FnOnce(&mut WorkerState) + Send>,
}

/// Handle of the worker thread.
#[derive(Clone)]
pub struct Worker {
    tx: std_mpsc::Sender<Job>,
    busy: Arc<Mutex<Option<(String, Instant)>>>,
    timeout: Duration,
    owner_lost: OwnerLost,
}

impl Worker {
    /// Starts the thread. A call waits at most `timeout` for its answers.
    pub fn start(setup: WorkerConfig, timeout: Duration) -> std::io::Result<Self> {
        let (tx, rx) = std_mpsc::channel();
        let busy = Arc::new(Mutex::new(None));
        let shown = busy.clone();
        let owner_lost = setup.owner_lost.clone();
        let node = WorkerState {
            setup,
            unprepared: Unprepared::default(),
        };
        std::thread::Builder::new()
            .name("claims".into())
            .spawn(move || work(node, rx, &shown))?;
        Ok(Self {
            tx,
            busy,
            timeout,
            owner_lost,
        })
    }

    /// The owner lock changed: its file was created, deleted or replaced
    /// (`replaced`), or only written. The thread checks the lock at once, without
    /// the caller waiting (a change of owner is said, and republished, by the
    /// thread), unless the node is ours and the file was only written: every save
    /// rewrites it, and only a file replaced takes the node from its holder. A
    /// write while the node is not ours is how a leaving owner says so.
    pub fn owner_changed(&self, replaced: bool) {
        if !replaced && support::lock(&self.owner_lost).is_none() {
            return;
        }
        drop(
            self.submit("checking the node's owner lock".into(), |node| {
                check_owner(&mut node.setup);
                Ok(())
            }),
        );
    }

    /// The deadline of a job queued now (a claim watcher's; kubelet's calls bring
    /// their own).
    pub fn deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.timeout
    }

    /// kubelet's prepare of `claims`: each claim's job is queued at once, and its
    /// answer waited for until `deadline`; work left then goes on, and kubelet's
    /// retry gets its result.
    pub async fn prepare(
        &self,
        claims: Vec<Claim>,
        deadline: tokio::time::Instant,
    ) -> Answers<Vec<PreparedDevice>, DriverError> {
        let pending = claims
            .into_iter()
            .map(|c| (c.reference.uid.clone(), self.queue_prepare(c)))
            .collect();
        self.answers(pending, deadline).await
    }

    /// kubelet's unprepare of `claims`, as [`Self::prepare`].
    pub async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
        deadline: tokio::time::Instant,
    ) -> Answers<(), DriverError> {
        let pending = claims
            .into_iter()
            .map(|c| (c.uid.clone(), self.queue_unprepare(c)))
            .collect();
        self.answers(pending, deadline).await
    }

    /// The answer of each queued job, by claim uid, or why there is none by
    /// `deadline`.
    async fn answers<T>(
        &self,
        pending: Vec<(String, Pending<T>)>,
        deadline: tokio::time::Instant,
    ) -> Answers<T, DriverError> {
        let mut out = BTreeMap::new();
        for (uid, job) in pending {
            out.insert(uid, self.wait_for(job, deadline).await);
        }
        out
    }

    /// Queues the preparation of one claim.
    fn queue_prepare(&self, claim: Claim) -> Pending<Vec<PreparedDevice>> {
        let what = format!("preparing claim {}", claim.reference);
        self.submit(what, move |node| {
            let c = &claim.reference;
            let started = Instant::now();
            if node.unprepared.since(&c.uid, claim.arrived) {
                let e = DriverError::Unprepared {
                    claim: c.to_string(),
                };
                tracing::warn!(claim = %c, "{e}");
                return Err(e);
            }
            let answer = node.claims().prepare(&claim).map_err(DriverError::from);
            match &answer {
                Ok(devices) => {
                    let took = started.elapsed();
                    tracing::info!(claim = %c, devices = devices.len(), ?took, "prepared")
                }
                Err(e) => tracing::warn!(claim = %c, error = %error_chain(e), "prepare failed"),
            }
            answer
        })
    }

    /// Queues the unpreparation of one claim.
    fn queue_unprepare(&self, claim: ClaimRef) -> Pending<()> {
        let what = format!("unpreparing claim {claim}");
        self.submit(what, move |node| {
            let started = Instant::now();
            leaving(&node.setup, &claim.uid);
            let answer = node.claims().unprepare(&claim);
            match &answer {
                Ok(()) => {
                    node.unprepared.mark(&claim.uid);
                    tracing::info!(claim = %claim, took = ?started.elapsed(), "unprepared");
                }
                Err(e) => {
                    tracing::warn!(claim = %claim, error = %error_chain(e), "unprepare failed")
                }
            }
            Ok(answer?)
        })
    }

    /// Queues the early move of one claim's groups (its pod not yet bound).
    pub fn move_early(
        &self,
        claim: ClaimRef,
        devices: Vec<AllocatedDevice>,
        configs: Vec<OpaqueConfig>,
    ) -> Pending<()> {
        let what = format!("moving claim {claim} early");
        self.submit(what, move |node| {
            let started = Instant::now();
            let answer = node
                .claims()
                .move_early(&claim, &devices, &configs)
                .map_err(DriverError::from);
            match &answer {
                Ok(()) => {
                    tracing::info!(claim = %claim, took = ?started.elapsed(),
                        "moved to vfio before its pod is bound")
                }
                Err(e) => tracing::warn!(claim = %claim, error = %error_chain(e),
                    "early move failed"),
            }
            answer
        })
    }

    /// Queues giving back the devices of claim `uid` if they were moved early and
    /// never prepared; the claim, if they were.
    pub fn release(&self, uid: String) -> Pending<Option<ClaimRef>> {
        let what = format!("giving back claim uid {uid}");
        self.submit(what, move |node| {
            if node.phase(&uid).is_some_and(|p| p != ClaimPhase::Prepared) {
                leaving(&node.setup, &uid);
            }
            let shown = node
                .claims()
                .moved_early()
                .into_iter()
                .find(|c| c.uid == uid);
            let answer = node
                .claims()
                .release(&uid)
                .map(|released| released.then_some(shown).flatten());
            match &answer {
                Ok(Some(claim)) => {
                    tracing::info!(claim = %claim, "gave back the devices of a claim \
                        that lost its allocation before its pod started")
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(uid = %uid, error = %error_chain(e),
                        "cannot give back the devices of a claim moved early")
                }
            }
            Ok(answer?)
        })
    }

    /// Asks which claims are moved early and not prepared.
    pub fn moved_early(&self) -> Pending<Vec<ClaimRef>> {
        self.submit("listing claims moved early".into(), |node| {
            Ok(node.claims().moved_early())
        })
    }

    /// Queues `work`. Its answer goes to the caller after the gauges are set, so
    /// whoever reads them after the answer sees it.
    fn submit<T: Send + 'static>(
        &self,
        what: String,
        work: impl FnOnce(&mut WorkerState) -> Result<T, DriverError> + Send + 'static,
    ) -> Pending<T> {
        let (reply, rx) = oneshot::channel();
        let job = Job {
            what,
            work: Box::new(move |node| {
                let answer = work(node);
                share_state(&node.setup);
                let _ = reply.send(answer);
                // After the answer: the devices' health is read again from sysfs,
                // which kubelet's call need not wait for (the next job does).
                share_health(&node.setup);
            }),
        };
        match self.tx.send(job) {
            Ok(()) => Pending(Some(rx)),
            Err(_) => Pending(None),
        }
    }

    /// The answer of a queued job, or why there is none by `deadline`.
    pub async fn wait_for<T>(
        &self,
        pending: Pending<T>,
        deadline: tokio::time::Instant,
    ) -> Result<T, DriverError> {
        let rx = pending.0.ok_or(DriverError::Stopped("has stopped"))?;
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(DriverError::Stopped("stopped before answering")),
            Err(_) => Err(DriverError::Late {
                within: self.timeout,
                doing: self.doing(),
            }),
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

/// A job handed to the claims thread, its answer to come.
pub struct Pending<T>(Option<oneshot::Receiver<Result<T, DriverError>>>);

fn work(
    mut node: WorkerState,
    rx: std_mpsc::Receiver<Job>,
    busy: &Mutex<Option<(String, Instant)>>,
) {
    share_state(&node.setup);
    share_health(&node.setup);
    loop {
        let job = match rx.recv_timeout(OWNER_CHECK) {
            Ok(job) => job,
            Err(std_mpsc::RecvTimeoutError::Timeout) => {
                check_owner(&mut node.setup);
                continue;
            }
            Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
        };
        *support::lock(busy) = Some((job.what, Instant::now()));
        (job.work)(&mut node);
        *support::lock(busy) = None;
    }
}

/// How often the idle thread checks that the owner lock is still ours (every save
/// that records a device checks it too, and so does a change in the lock's
/// directory, at once).
const OWNER_CHECK: Duration = Duration::from_secs(10);

/// Checks that the node's owner lock still keeps every other taker out (a cleanup
/// of its directory deletes it), taking it again if it can; says so when that
/// changes, and has the devices published again (withdrawn while the node is not
/// ours, back once it is). While it is not ours, every prepare and early move is
/// refused at its first save, naming the lock.
fn check_owner(setup: &mut WorkerConfig) {
    let now = setup.state.ensure_owner().err().map(|e| error_chain(&e));
    let mut lost = support::lock(&setup.owner_lost);
    if *lost == now {
        return;
    }
    match &now {
        None => tracing::info!(
            "the node's owner lock is ours again; publishing the devices and preparing claims"
        ),
        Some(why) => {
            tracing::error!(error = %why, "the node's owner lock is no longer ours: \
                moving no device, every device withdrawn from the ResourceSlices, not \
                ready; claims prepared here are refused")
        }
    }
    lost.clone_from(&now);
    drop(lost);
    if let Some(r) = &setup.republish {
        r.now();
    }
}

/// Sets the device gauges, and the original drivers, from the state file.
fn share_state(setup: &WorkerConfig) {
    let state = setup.state.state();
    let prepared = state.records.values().map(|c| c.devices.len()).sum();
    setup.metrics.devices_held(prepared, state.devices.len());
    if let Some(original_drivers) = &setup.original_drivers {
        original_drivers.set(
            state
                .devices
                .iter()
                .map(|(a, r)| (*a, r.original_driver.clone()))
                .collect(),
        );
    }
}

/// Tells the health board the devices of prepared claims.
fn share_health(setup: &WorkerConfig) {
    if let Some(health) = &setup.health {
        health.set_prepared(held_for_vms(setup, None));
    }
}

/// The devices of claims prepared or moved early, but those of claim `leaving`.
fn held_for_vms(setup: &WorkerConfig, leaving: Option<&str>) -> BTreeSet<PciAddress> {
    setup
        .state
        .records()
        .iter()
        .filter(|(uid, c)| {
            Some(uid.as_str()) != leaving
                && matches!(c.phase, ClaimPhase::Prepared | ClaimPhase::Moved)
        })
        .flat_map(|(_, c)| c.devices.iter().flat_map(ClaimDevice::addresses))
        .collect()
}

/// Claim `uid`'s devices are about to go back to their drivers: from now on
/// their health is judged as devices ready to be prepared, so a device on its
/// way back (or back already) is not reported unhealthy for not being on vfio.
/// They are read again by [`share_health`] after the answer, which puts them back
/// if the give-back failed.
fn leaving(setup: &WorkerConfig, uid: &str) {
    if let Some(health) = &setup.health {
        health.expect_prepared(held_for_vms(setup, Some(uid)));
    }
}

/// The claims recorded in a state file, for a message at stop.
pub fn prepared_claims(path: &Path) -> Vec<String> {
    match StateFile::load(path, false, &crate::programs::DRA_DRIVER) {
        Ok(s) => s
            .records()
            .iter()
            .map(|(uid, c)| format!("{}/{} (uid {uid})", c.namespace, c.name))
            .collect(),
        Err(_) => Vec::new(),
    }
}
