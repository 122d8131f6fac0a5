//! The API thread: a small tokio runtime for what talks to the network (the API
//! server), so the main loop stays a `poll(2)` loop that no slow server can hold up.
//!
//! The main thread sends it Events to post (fire and forget) and asks it, on a stop,
//! whether the node stays in VM mode. With a restore label it also keeps that label
//! on the Node as the main thread wants it, and asks the same question every resync
//! period while the pod runs: the answers come back through a channel and a socket
//! the main loop polls ([`ApiThread::wake_fd`]). Without API access ([`ApiThread::start`] with
//! no identity, or a client that cannot be built) every question answers "restore"
//! and Events go nowhere, which is how vfio-manager behaved before it could ask.

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Duration;

use node_agent::cluster::{Cluster, Identity, Verdict, STOP_LOOKUP_TIMEOUT};
use node_agent::metrics::{self as endpoint, ListenAddress, Registry};
use support::error_chain;
use tokio::sync::mpsc;

use crate::restore_label::{Check, ManagerCluster};

/// An Event about the Node.
#[derive(Debug, Clone)]
pub struct NodeEvent {
    /// Warning (else Normal).
    pub warning: bool,
    /// Why, in CamelCase (`DevicesBound`).
    pub reason: &'static str,
    /// What was done (`Bind`, `Restore`, `Keep`).
    pub action: &'static str,
    /// For people.
    pub note: String,
}

/// How long a stop waits for its last Events to be posted. They are said in the
/// log too; the devices are already back by then, so this only delays the exit.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

enum Msg {
    Event(NodeEvent),
    Verdict(std_mpsc::Sender<Verdict>),
    Check(std_mpsc::Sender<Result<Check, String>>),
    Label(bool),
    LabelSettled(std_mpsc::Sender<()>),
    Flush(std_mpsc::Sender<()>),
}

/// The periodic checks' way back to the main loop: each definite answer, and a
/// byte on a socket to wake its `poll(2)`.
struct Checks {
    wake: UnixStream,
    answers: std_mpsc::Receiver<Check>,
}

/// Handle of the API thread.
pub struct ApiThread {
    /// Whether an identity was given (else only metrics are served).
    asks: bool,
    tx: Option<mpsc::UnboundedSender<Msg>>,
    thread: Option<std::thread::JoinHandle<()>>,
    checks: Option<Checks>,
}

impl ApiThread {
    /// Starts the thread when there is something for it to do. With `identity` it
    /// connects to the API server (in-cluster service account, or KUBECONFIG) and
    /// reads the Node once to say at start whether a rollout will keep the devices
    /// bound. With `metrics` it serves the registry there; a listener that cannot be
    /// bound is an error now, not a silent gap later.
    ///
    /// With an identity that names the pod and a restore label (its key), it also
    /// keeps that label and looks every `check_every` whether the node still is in
    /// VM mode ([`ApiThread::checked`]).
    pub fn start(
        identity: Option<Identity>,
        restore_label: Option<String>,
        metrics: Option<(ListenAddress, Registry)>,
        check_every: Duration,
    ) -> anyhow::Result<Self> {
        if identity.is_none() && metrics.is_none() {
            return Ok(Self {
                asks: false,
                tx: None,
                thread: None,
                checks: None,
            });
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let endpoint = match metrics {
            Some((address, registry)) => {
                let listener = rt.block_on(endpoint::bind(&address))?;
                tracing::info!(address = %listener.local_addr()?, "serving metrics at /metrics");
                Some((listener, Arc::new(registry)))
            }
            None => None,
        };
        let asks = identity.is_some();
        let watches = identity
            .as_ref()
            .is_some_and(|i| i.pod.is_some() && restore_label.is_some());
        let (checks, back) = if watches {
            let (wake, waker) = UnixStream::pair()?;
            wake.set_nonblocking(true)?;
            waker.set_nonblocking(true)?;
            let (tx, answers) = std_mpsc::channel();
            (
                Some(Checks { wake, answers }),
                Some((waker, tx, check_every)),
            )
        } else {
            (None, None)
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let thread = std::thread::Builder::new()
            .name("vfio-manager-api".into())
            .spawn(move || {
                rt.block_on(async move {
                    if let Some((listener, registry)) = endpoint {
                        tokio::spawn(endpoint::serve(listener, registry));
                    }
                    serve(identity, restore_label, rx, back).await;
                });
            })?;
        Ok(Self {
            asks,
            tx: Some(tx),
            thread: Some(thread),
            checks,
        })
    }

    /// Whether the API thread keeps a restore label and looks every resync period
    /// whether the node is still in VM mode.
    pub fn watches(&self) -> bool {
        self.checks.is_some()
    }

    /// Readable when a periodic check has answered; for the main loop's `poll(2)`.
    pub fn wake_fd(&self) -> Option<BorrowedFd<'_>> {
        self.checks.as_ref().map(|c| c.wake.as_fd())
    }

    /// The latest definite answer of the periodic checks since the last call.
    pub fn checked(&self) -> Option<Check> {
        let c = self.checks.as_ref()?;
        let mut buf = [0u8; 64];
        while matches!((&c.wake).read(&mut buf), Ok(n) if n > 0) {}
        c.answers.try_iter().last()
    }

    /// Asks now (bounded like a stop's question); `None` when the API thread does
    /// not watch.
    pub fn check_now(&self) -> Option<Result<Check, String>> {
        self.checks.as_ref()?;
        let (reply, answer) = std_mpsc::channel();
        self.tx.as_ref()?.send(Msg::Check(reply)).ok()?;
        Some(
            answer
                .recv_timeout(STOP_LOOKUP_TIMEOUT + Duration::from_secs(1))
                .unwrap_or_else(|_| Err("the API client did not answer in time".into())),
        )
    }

    /// Wants the restore label on the Node (`true`) or off it; the API thread
    /// patches the Node when that differs from what it last put there, retrying
    /// until it succeeds or is told otherwise. Never waits.
    pub fn restore_label(&self, on: bool) {
        if let (Some(tx), Some(_)) = (&self.tx, &self.checks) {
            let _ = tx.send(Msg::Label(on));
        }
    }

    /// Waits at most `limit` until the Node carries the restore label as last
    /// wanted; false if it did not get there in time.
    pub fn label_settled(&self, limit: Duration) -> bool {
        let (Some(tx), Some(_)) = (&self.tx, &self.checks) else {
            return true;
        };
        let (reply, done) = std_mpsc::channel();
        tx.send(Msg::LabelSettled(reply)).is_ok() && done.recv_timeout(limit).is_ok()
    }

    /// Posts an Event about the Node, if the API server is reachable; never waits.
    pub fn event(&self, event: NodeEvent) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Msg::Event(event));
        }
    }

    /// Keep or restore? `None` without API access.
    pub fn stop_verdict(&self) -> Option<Verdict> {
        let tx = self.tx.as_ref()?;
        if !self.asks {
            return None;
        }
        let (reply, answer) = std_mpsc::channel();
        if tx.send(Msg::Verdict(reply)).is_err() {
            return Some(Verdict::Restore("the API client stopped".into()));
        }
        // The API thread bounds its lookup by STOP_LOOKUP_TIMEOUT; this bound holds
        // whatever the API thread is doing (a connect still in progress, a post).
        Some(
            answer
                .recv_timeout(STOP_LOOKUP_TIMEOUT + Duration::from_secs(1))
                .unwrap_or_else(|_| {
                    Verdict::Restore("the API client did not answer in time".into())
                }),
        )
    }

    /// Waits (at most [`FLUSH_TIMEOUT`]) until the Events sent so far are posted and
    /// the restore label is as last wanted, then stops the thread.
    pub fn finish(mut self) {
        if let Some(tx) = self.tx.take() {
            let (reply, done) = std_mpsc::channel();
            if tx.send(Msg::Flush(reply)).is_ok() {
                let _ = done.recv_timeout(FLUSH_TIMEOUT);
            }
        }
        // The thread ends once its channel is closed (dropped above); do not wait
        // on a server that hangs past the flush bound.
        if let Some(t) = self.thread.take() {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// The API thread's end of the periodic checks.
type CheckBack = (UnixStream, std_mpsc::Sender<Check>, Duration);

async fn serve(
    identity: Option<Identity>,
    restore_label: Option<String>,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    back: Option<CheckBack>,
) {
    let node = identity
        .as_ref()
        .map(|i| i.node.clone())
        .unwrap_or_default();
    let connected = match identity {
        Some(identity) => Some(Cluster::connect(identity).await),
        None => None,
    };
    let cluster = match connected {
        None => None,
        Some(Ok(cluster)) => Some(ManagerCluster {
            cluster,
            label: restore_label,
        }),
        Some(Err(e)) => {
            tracing::warn!(error = %error_chain(&e), "no API access: a stop restores \
                every device, so each rollout of this DaemonSet bounces idle devices");
            None
        }
    };
    let mut posting = tokio::task::JoinSet::new();
    // Checked beside the message loop, so a slow server never delays a stop.
    if let Some(c) = cluster.clone() {
        posting.spawn(async move {
            match c.cluster.node().await {
                Ok(_) => tracing::info!(node = %node, "API access: on a stop, devices \
                    stay bound while the DaemonSet still selects this node"),
                Err(e) => tracing::warn!(node = %node, error = %error_chain(&e),
                    "cannot read this Node now; a stop restores unless the API server \
                        answers then"),
            }
        });
    }
    // The restore label: wanted (set by the main thread) and put (by `keep_label`).
    let (want_tx, want_rx) = tokio::sync::watch::channel(None::<bool>);
    let (put_tx, put_rx) = tokio::sync::watch::channel(None::<bool>);
    let put_tx = Arc::new(put_tx);
    let labels_kept = match (cluster.clone(), back) {
        (Some(c), Some((waker, answers, every))) => {
            tokio::spawn(keep_label(c.clone(), want_rx, put_tx.clone()));
            tokio::spawn(check_periodically(
                c,
                every,
                waker,
                answers,
                put_tx,
                want_tx.subscribe(),
            ));
            true
        }
        _ => false,
    };
    // Resolves once the label is as wanted now (at once when nothing keeps it).
    let settled = |want: Option<bool>| {
        let mut put = put_rx.clone();
        async move {
            if labels_kept && want.is_some() {
                let _ = put.wait_for(|p| *p == want).await;
            }
        }
    };
    while let Some(msg) = rx.recv().await {
        match msg {
            Msg::Event(ev) => {
                if let Some(c) = cluster.clone() {
                    posting.spawn(async move {
                        let (warning, reason, action) = (ev.warning, ev.reason, ev.action);
                        let posted = c.cluster.node_event(warning, reason, action, &ev.note);
                        if let Err(e) = posted.await {
                            let error = error_chain(&e);
                            tracing::warn!(reason, %error, "could not post a Node event");
                        }
                    });
                }
            }
            Msg::Verdict(reply) => {
                let v = match &cluster {
                    Some(c) => c.stop_verdict().await,
                    None => Verdict::Restore("no API access".into()),
                };
                let _ = reply.send(v);
            }
            Msg::Check(reply) => {
                let v = match &cluster {
                    Some(c) => c.check().await,
                    None => Err("no API access".into()),
                };
                let _ = reply.send(v);
            }
            Msg::Label(on) => {
                want_tx.send_if_modified(|w| {
                    let changed = *w != Some(on);
                    *w = Some(on);
                    changed
                });
            }
            Msg::LabelSettled(reply) => {
                let wait = settled(*want_tx.borrow());
                tokio::spawn(async move {
                    wait.await;
                    let _ = reply.send(());
                });
            }
            Msg::Flush(reply) => {
                while posting.join_next().await.is_some() {}
                settled(*want_tx.borrow()).await;
                let _ = reply.send(());
            }
        }
        // Reap finished posts so the set does not grow.
        while posting.try_join_next().is_some() {}
    }
}

/// Delay before a failed label patch is tried again.
const LABEL_RETRY: Duration = Duration::from_secs(2);

/// Keeps the restore label on the Node as wanted: patches when the wish differs
/// from what was last put there (or from what a check saw on the Node, which
/// resets `put`), retrying a failed patch.
async fn keep_label(
    c: ManagerCluster,
    mut want: tokio::sync::watch::Receiver<Option<bool>>,
    put: Arc<tokio::sync::watch::Sender<Option<bool>>>,
) {
    let mut put_seen = put.subscribe();
    let mut last_error = None;
    loop {
        let wanted = *want.borrow_and_update();
        let current = *put_seen.borrow_and_update();
        if let Some(on) = wanted.filter(|on| current != Some(*on)) {
            match c.set_label(on).await {
                Ok(()) => {
                    tracing::info!(
                        on,
                        "restore label {}",
                        if on {
                            "set on the Node: a pod killed mid-restore comes back to finish it"
                        } else {
                            "removed from the Node: nothing left to restore"
                        }
                    );
                    last_error = None;
                    put.send_replace(Some(on));
                    continue;
                }
                Err(e) => {
                    let e = error_chain(&e);
                    if last_error.as_ref() != Some(&e) {
                        tracing::warn!(error = %e, "cannot change the restore label; retrying");
                    }
                    last_error = Some(e);
                    tokio::select! {
                        () = tokio::time::sleep(LABEL_RETRY) => continue,
                        r = want.changed() => if r.is_err() { return },
                    }
                    continue;
                }
            }
        }
        tokio::select! {
            r = want.changed() => if r.is_err() { return },
            r = put_seen.changed() => if r.is_err() { return },
        }
    }
}

/// Every `every`, asks whether the node is still in VM mode; hands each definite
/// answer to the main loop and wakes it. A Node found without the label that was
/// put there (someone removed it) has it put again.
async fn check_periodically(
    c: ManagerCluster,
    every: Duration,
    waker: UnixStream,
    answers: std_mpsc::Sender<Check>,
    put: Arc<tokio::sync::watch::Sender<Option<bool>>>,
    want: tokio::sync::watch::Receiver<Option<bool>>,
) {
    // The start asked already (`ApiThread::check_now`): the first look is one period on.
    let every = every.max(Duration::from_millis(100));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_error = None;
    loop {
        tick.tick().await;
        match c.check().await {
            Ok(check) => {
                last_error = None;
                if *want.borrow() == Some(true) && !check.labelled && *put.borrow() == Some(true) {
                    tracing::warn!("the restore label is gone from the Node; putting it back");
                    put.send_replace(None);
                }
                if answers.send(check).is_err() {
                    return;
                }
                let _ = (&waker).write(&[1]);
            }
            Err(e) => {
                if last_error.as_ref() != Some(&e) {
                    tracing::warn!(error = %e, "cannot tell now whether the node stays \
                        in VM mode; asking again next resync");
                }
                last_error = Some(e);
            }
        }
    }
}
