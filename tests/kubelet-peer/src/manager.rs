//! kubelet's DRA side as a long-running process: the plugin watcher for DRA
//! plugins, the DRA plugin manager (registration, ResourceSlice wiping) and the DRA
//! manager (prepare / unprepare for the pods of the node, with its checkpoint).
//!
//! Each behaviour follows the kubelet release chosen ([`KubeletVersion`]) and names
//! the upstream file it comes from. What differs from kubelet on purpose:
//! - the plugin watcher polls the registry directory every [`Config::poll`]
//!   (kubelet uses fsnotify, `pkg/kubelet/pluginmanager/pluginwatcher/plugin_watcher.go`,
//!   and its reconciler runs every second), and registers inline;
//! - the pods running on the node are read from a JSON file ([`Pod`]), as kubelet
//!   reads static pod manifests from a directory; a pod that leaves the file is
//!   unprepared at the next poll (kubelet: when its pod worker terminates it, or in
//!   the DRA manager's reconcile loop every 60 s);
//! - the wiping delay is configurable (kubelet: `defaultWipingDelay`, 30 s,
//!   `pkg/kubelet/cm/dra/manager.go`), for tests;
//! - kubelet 1.34 tracks whether a plugin's gRPC connection is up through grpc-go's
//!   stats handler (`dra_plugin_manager.go`, `HandleConn`); here a connect to the
//!   endpoint every poll stands for it.
//!
//! Every step is reported as one [`Event`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::dra::{ClaimRef, PreparedDevice};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::api::Api;
use crate::dra::{self, Dra, KubeletVersion, PrepareResult, UnprepareResult, Verdict, Version};

/// kubelet's `defaultWipingDelay` (`pkg/kubelet/cm/dra/manager.go`).
pub const DEFAULT_WIPING_DELAY: Duration = Duration::from_secs(30);
/// kubelet's `defaultClientCallTimeout` for every DRA call
/// (`pkg/kubelet/cm/dra/plugin/registration.go`, `dra_plugin.go`).
pub const CLIENT_CALL_TIMEOUT: Duration = Duration::from_secs(45);
/// The DRA manager's checkpoint file in kubelet's root directory
/// (`draManagerStateFileName`, `pkg/kubelet/cm/dra/manager.go`).
pub const CHECKPOINT_FILE: &str = "dra_manager_state";

/// What the process is told.
#[derive(Debug, Clone)]
pub struct Config {
    /// The plugin registry directory kubelet's plugin watcher scans.
    pub registry: PathBuf,
    /// The API server, `http://host:port`.
    pub api: String,
    /// This node's name.
    pub node: String,
    /// kubelet's root directory: where the checkpoint lives.
    pub state_dir: PathBuf,
    /// The JSON file listing the pods running on the node.
    pub pods: PathBuf,
    /// The kubelet release played.
    pub kubelet: KubeletVersion,
    /// How long after a driver became unusable its slices are wiped.
    pub wiping_delay: Duration,
    /// How often the registry, the connections and the pods are looked at.
    pub poll: Duration,
}

/// A pod running on the node, with the ResourceClaims its `spec.resourceClaims`
/// resolve to (`resourceclaim.Name`), in order; a claim may be listed twice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pod {
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// The ResourceClaim names, in `spec.resourceClaims` order.
    pub claims: Vec<String>,
}

/// Writes the pods file as one atomic replace.
pub fn write_pods(path: &Path, pods: &[Pod]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(pods)?)?;
    std::fs::rename(tmp, path)
}

/// One step the peer took.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum Event {
    /// Started; the claims restored from the checkpoint (uids).
    Started {
        /// The release played.
        kubelet: KubeletVersion,
        /// Claim uids found in the checkpoint.
        restored: Vec<String>,
    },
    /// A `DeleteCollection` of ResourceSlices answered.
    Wiped {
        /// `startup` or `driver-cleanup`.
        reason: String,
        /// The field selector sent.
        field_selector: String,
        /// The names of the slices deleted.
        deleted: Vec<String>,
    },
    /// A wipe of a driver's slices is due after `delay_ms`.
    WipeScheduled {
        /// The driver.
        driver: String,
        /// Milliseconds.
        delay_ms: u64,
    },
    /// A pending wipe was cancelled.
    WipeCancelled {
        /// The driver.
        driver: String,
    },
    /// A plugin was registered.
    Registered {
        /// Its registration socket.
        socket: PathBuf,
        /// The driver name.
        driver: String,
        /// Its service endpoint.
        endpoint: String,
        /// The service version chosen (`None`: kubelet 1.32's alpha fallback).
        chosen: Option<Version>,
    },
    /// A registration was refused, or failed.
    Refused {
        /// The registration socket.
        socket: PathBuf,
        /// Why.
        error: String,
    },
    /// A plugin's registration socket went away.
    Deregistered {
        /// The registration socket.
        socket: PathBuf,
        /// The driver.
        driver: String,
        /// Whether it was the driver's last plugin.
        last: bool,
    },
    /// kubelet 1.34 saw a plugin's connection come up or go down.
    Connection {
        /// The driver.
        driver: String,
        /// Its endpoint.
        endpoint: String,
        /// Up or down.
        connected: bool,
    },
    /// A `NodePrepareResources` answered.
    Prepared {
        /// The pod's uid.
        pod: String,
        /// The driver called.
        driver: String,
        /// The service version used.
        version: Version,
        /// The claims sent, in order (duplicates kept).
        claims: Vec<ClaimRef>,
        /// The answer.
        answer: PrepareResult,
    },
    /// A `NodeUnprepareResources` answered.
    Unprepared {
        /// The pod's uid.
        pod: String,
        /// The driver called.
        driver: String,
        /// The service version used.
        version: Version,
        /// The claims sent, in order.
        claims: Vec<ClaimRef>,
        /// The answer.
        answer: UnprepareResult,
    },
    /// `PrepareResources` for a pod succeeded: it could start.
    PodReady {
        /// The pod's uid.
        pod: String,
    },
    /// `PrepareResources` for a pod failed (retried at the next poll).
    PrepareFailed {
        /// The pod's uid.
        pod: String,
        /// kubelet's error.
        error: String,
    },
    /// A gone pod's claims were unprepared (or kept for other pods).
    PodGone {
        /// The pod's uid.
        pod: String,
    },
    /// Unpreparing a gone pod's claims failed (retried at the next poll).
    UnprepareFailed {
        /// The pod's uid.
        pod: String,
        /// kubelet's error.
        error: String,
    },
}

mod checkpoint;
mod plugins;
mod pods;

pub use checkpoint::crc32_ieee;
use checkpoint::{checkpoint_json, read_checkpoint, ClaimInfo};

/// Where events go.
pub type Events = mpsc::UnboundedSender<Event>;

/// One registered plugin of a driver.
#[derive(Debug)]
struct Plugin {
    socket: PathBuf,
    endpoint: PathBuf,
    chosen: Option<Version>,
    connected: bool,
    client: Option<Dra>,
}

/// A registration socket the plugin watcher knows, and the file it saw
/// (kubelet keeps the create event's timestamp; a re-created socket is a new
/// plugin: `pkg/kubelet/pluginmanager/reconciler/reconciler.go` unregisters the
/// old one, then registers the new).
#[derive(Debug, Clone)]
struct Known {
    ino: u64,
    driver: Option<String>,
}

/// Everything the peer keeps.
struct State {
    claims: BTreeMap<(String, String), ClaimInfo>,
    plugins: BTreeMap<String, Vec<Plugin>>,
    known: BTreeMap<PathBuf, Known>,
    retry_registration: BTreeMap<PathBuf, Instant>,
    pending_wipes: BTreeMap<String, JoinHandle<()>>,
    ready: BTreeSet<String>,
    retry_pod: BTreeMap<String, Instant>,
}

/// Aborts the tasks it holds when dropped (the process stopping).
struct Tasks(Arc<Mutex<State>>, Vec<JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        self.1.iter().for_each(JoinHandle::abort);
        if let Ok(st) = self.0.lock() {
            st.pending_wipes.values().for_each(JoinHandle::abort);
        }
    }
}

struct Peer {
    cfg: Config,
    api: Api,
    events: Events,
    state: Arc<Mutex<State>>,
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs until dropped (abort the task to "kill kubelet"; start again with the
/// same [`Config::state_dir`] to restart it).
pub async fn run(cfg: Config, events: Events) -> anyhow::Result<()> {
    let agent = match cfg.kubelet {
        KubeletVersion::V1_32 => "kubelet/v1.32.0 (linux/amd64) kubernetes",
        KubeletVersion::V1_34 => "kubelet/v1.34.0 (linux/amd64) kubernetes",
    };
    let api = Api::new(&cfg.api, agent)?;
    std::fs::create_dir_all(&cfg.state_dir)?;
    let file = cfg.state_dir.join(CHECKPOINT_FILE);
    // `newClaimInfoCache` (`pkg/kubelet/cm/dra/claiminfo.go`): the checkpoint's
    // claims, none of them prepared in this process yet.
    let claims = match std::fs::read_to_string(&file) {
        Ok(text) => read_checkpoint(&text)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
        Err(e) => return Err(e.into()),
    };
    let _ = events.send(Event::Started {
        kubelet: cfg.kubelet,
        restored: claims.values().map(|c| c.uid.clone()).collect(),
    });
    let state = Arc::new(Mutex::new(State {
        claims,
        plugins: BTreeMap::new(),
        known: BTreeMap::new(),
        retry_registration: BTreeMap::new(),
        pending_wipes: BTreeMap::new(),
        ready: BTreeSet::new(),
        retry_pod: BTreeMap::new(),
    }));
    let peer = Arc::new(Peer {
        cfg,
        api,
        events,
        state: state.clone(),
    });
    // `NewRegistrationHandler` (1.32, `registration.go`) / `NewDRAPluginManager`
    // (1.34, `dra_plugin_manager.go`): at startup, wipe every slice of this node
    // in the background — no driver is registered yet.
    let startup = {
        let peer = peer.clone();
        tokio::spawn(async move { peer.wipe("startup", None).await })
    };
    let _tasks = Tasks(state, vec![startup]);
    loop {
        peer.watch_plugins().await;
        if peer.cfg.kubelet == KubeletVersion::V1_34 {
            peer.probe_connections();
        }
        peer.sync_pods().await;
        tokio::time::sleep(peer.cfg.poll).await;
    }
}

impl Peer {
    fn emit(&self, e: Event) {
        let _ = self.events.send(e);
    }

    /// `GetPlugin` (1.34: the newest connected plugin, else the newest) /
    /// `NewDRAPluginClient` (1.32: the one plugin of the driver), as a client.
    async fn client(&self, driver: &str) -> Result<(Dra, Version), String> {
        let found = {
            let st = lock(&self.state);
            st.plugins.get(driver).and_then(|ps| {
                let p = ps
                    .iter()
                    .rev()
                    .find(|p| p.connected)
                    .or_else(|| ps.last())?;
                Some((p.endpoint.clone(), p.chosen, p.client.clone()))
            })
        };
        let Some((endpoint, chosen, client)) = found else {
            return Err(match self.cfg.kubelet {
                KubeletVersion::V1_32 => {
                    format!("plugin name {driver} not found in the list of registered DRA plugins")
                }
                KubeletVersion::V1_34 => format!("DRA driver {driver} is not registered"),
            });
        };
        let version = chosen.ok_or_else(|| {
            format!(
                "DRA driver {driver} registered with {}, which this peer does not speak",
                dra::V1ALPHA4_NODE_SERVICE
            )
        })?;
        if let Some(c) = client {
            return Ok((c, version));
        }
        let c = Dra::connect_as(&endpoint, version, self.cfg.kubelet)
            .await
            .map_err(|e| format!("{e:#}"))?;
        let mut st = lock(&self.state);
        if let Some(p) = st
            .plugins
            .get_mut(driver)
            .and_then(|ps| ps.iter_mut().find(|p| p.endpoint == endpoint))
        {
            p.client = Some(c.clone());
        }
        Ok((c, version))
    }

    fn drop_client(&self, driver: &str) {
        if let Some(ps) = lock(&self.state).plugins.get_mut(driver) {
            ps.iter_mut().for_each(|p| p.client = None);
        }
    }

    /// `syncToCheckpoint`: the whole cache, written to a temporary file and
    /// renamed over the checkpoint (`checkpointmanager`, `utilstore.FileStore`).
    fn checkpoint(&self, st: &State) -> Result<(), String> {
        let file = self.cfg.state_dir.join(CHECKPOINT_FILE);
        let tmp = self.cfg.state_dir.join(format!(".{CHECKPOINT_FILE}.tmp"));
        std::fs::write(&tmp, checkpoint_json(&st.claims))
            .and_then(|()| std::fs::rename(&tmp, &file))
            .map_err(|e| format!("checkpoint ResourceClaim cache: {e}"))
    }
}

/// Percent-encodes a query value as Go's `url.Values.Encode` does
/// (`QueryEscape`: space as `+`, unreserved kept).
fn percent_encode_query(s: &str) -> String {
    let mut out = String::new();
    for &b in s.as_bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(char::from(b))
            }
            b' ' => out.push('+'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests;
