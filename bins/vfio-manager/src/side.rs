//! The side thread: a small tokio runtime for what talks to the network (the API
//! server), so the main loop stays a `poll(2)` loop that no slow server can hold up.
//!
//! The main thread sends it Events to post (fire and forget) and asks it, on a stop,
//! whether the node stays in VM mode. Without API access ([`Side::start`] with no
//! identity, or a client that cannot be built) every question answers "restore" and
//! Events go nowhere, which is how vfio-manager behaved before it could ask.

use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Duration;

use node_agent::cluster::{Cluster, Identity, Verdict, STOP_LOOKUP_TIMEOUT};
use node_agent::metrics::{self as endpoint, ListenAddress, Registry};
use sysfs_pci::error_chain;
use tokio::sync::mpsc;

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
    Flush(std_mpsc::Sender<()>),
}

/// Handle of the side thread.
pub struct Side {
    /// Whether an identity was given (else only metrics are served).
    asks: bool,
    tx: Option<mpsc::UnboundedSender<Msg>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Side {
    /// Starts the thread when there is something for it to do. With `identity` it
    /// connects to the API server (in-cluster service account, or KUBECONFIG) and
    /// reads the Node once to say at start whether a rollout will keep the devices
    /// bound. With `metrics` it serves the registry there; a listener that cannot be
    /// bound is an error now, not a silent gap later.
    pub fn start(
        identity: Option<Identity>,
        metrics: Option<(ListenAddress, Registry)>,
    ) -> anyhow::Result<Self> {
        if identity.is_none() && metrics.is_none() {
            return Ok(Self {
                asks: false,
                tx: None,
                thread: None,
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
        let (tx, rx) = mpsc::unbounded_channel();
        let thread = std::thread::Builder::new()
            .name("vfio-manager-side".into())
            .spawn(move || {
                rt.block_on(async move {
                    if let Some((listener, registry)) = endpoint {
                        tokio::spawn(endpoint::serve(listener, registry));
                    }
                    serve(identity, rx).await;
                });
            })?;
        Ok(Self {
            asks,
            tx: Some(tx),
            thread: Some(thread),
        })
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
        // The side thread bounds its lookup by STOP_LOOKUP_TIMEOUT; this bound holds
        // whatever the side thread is doing (a connect still in progress, a post).
        Some(
            answer
                .recv_timeout(STOP_LOOKUP_TIMEOUT + Duration::from_secs(1))
                .unwrap_or_else(|_| {
                    Verdict::Restore("the API client did not answer in time".into())
                }),
        )
    }

    /// Waits (at most [`FLUSH_TIMEOUT`]) until the Events sent so far are posted, then
    /// stops the thread.
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

async fn serve(identity: Option<Identity>, mut rx: mpsc::UnboundedReceiver<Msg>) {
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
        Some(Ok(c)) => Some(c),
        Some(Err(e)) => {
            tracing::warn!(error = %error_chain(&e), "no API access: a stop restores every device, so each rollout of this DaemonSet bounces idle devices");
            None
        }
    };
    let mut posting = tokio::task::JoinSet::new();
    // Checked beside the message loop, so a slow server never delays a stop.
    if let Some(c) = cluster.clone() {
        posting.spawn(async move {
            match c.node().await {
                Ok(_) => tracing::info!(node = %node, "API access: on a stop, devices stay bound while the DaemonSet still selects this node"),
                Err(e) => tracing::warn!(node = %node, error = %error_chain(&e), "cannot read this Node now; a stop restores unless the API server answers then"),
            }
        });
    }
    while let Some(msg) = rx.recv().await {
        match msg {
            Msg::Event(ev) => {
                if let Some(c) = cluster.clone() {
                    posting.spawn(async move {
                        if let Err(e) = c.node_event(ev.warning, ev.reason, ev.action, &ev.note).await {
                            tracing::warn!(reason = ev.reason, error = %error_chain(&e), "could not post a Node event");
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
            Msg::Flush(reply) => {
                while posting.join_next().await.is_some() {}
                let _ = reply.send(());
            }
        }
        // Reap finished posts so the set does not grow.
        while posting.try_join_next().is_some() {}
    }
}
