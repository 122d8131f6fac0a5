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

/// Where events go.
pub type Events = mpsc::UnboundedSender<Event>;

/// The DRA manager's `ClaimInfo` (`pkg/kubelet/cm/dra/claiminfo.go`): the
/// checkpointed `ClaimInfoState` and the in-memory `prepared` flag, which a
/// restart resets (`newClaimInfoFromState`).
#[derive(Debug, Clone)]
struct ClaimInfo {
    uid: String,
    name: String,
    namespace: String,
    pod_uids: BTreeSet<String>,
    drivers: BTreeMap<String, Vec<PreparedDevice>>,
    prepared: bool,
}

impl ClaimInfo {
    fn claim_ref(&self) -> ClaimRef {
        ClaimRef {
            uid: self.uid.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }
}

/// crc32 (IEEE), what `hash/crc32.ChecksumIEEE` computes over the checkpoint's
/// `Data`.
pub fn crc32_ieee(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// `state.Device` (`pkg/kubelet/cm/dra/state/state.go`), fields in Go's order.
#[derive(Serialize)]
struct CheckpointDevice<'a> {
    #[serde(rename = "PoolName")]
    pool_name: &'a str,
    #[serde(rename = "DeviceName")]
    device_name: &'a str,
    #[serde(rename = "RequestNames")]
    request_names: Value,
    #[serde(rename = "CDIDeviceIDs")]
    cdi_device_ids: Value,
}

/// The checkpoint as kubelet writes it (`pkg/kubelet/cm/dra/state/checkpoint.go`):
/// `{"Data": <JSON of {kind: DRACheckpoint, apiVersion:
/// checkpoint.dra.kubelet.k8s.io/v1, ClaimInfoStateList: [...]}>, "Checksum":
/// crc32(Data)}`; each entry a `ClaimInfoState` (`state.go`) with Go's field
/// names, `PodUIDs` a set (`{"uid":{}}`), nil slices `null`.
fn checkpoint_json(claims: &BTreeMap<(String, String), ClaimInfo>) -> String {
    let nil_or = |v: &Vec<String>| if v.is_empty() { Value::Null } else { json!(v) };
    let list: Vec<String> = claims
        .values()
        .map(|c| {
            let pods: serde_json::Map<String, Value> =
                c.pod_uids.iter().map(|p| (p.clone(), json!({}))).collect();
            let drivers: Vec<String> = c
                .drivers
                .iter()
                .map(|(d, devs)| {
                    let devices: Vec<String> = devs
                        .iter()
                        .map(|x| {
                            serde_json::to_string(&CheckpointDevice {
                                pool_name: &x.pool_name,
                                device_name: &x.device_name,
                                request_names: nil_or(&x.request_names),
                                cdi_device_ids: nil_or(&x.cdi_device_ids),
                            })
                            .unwrap_or_default()
                        })
                        .collect();
                    let devices = if devices.is_empty() {
                        "null".to_owned()
                    } else {
                        format!("[{}]", devices.join(","))
                    };
                    format!("{}:{{\"Devices\":{devices}}}", json!(d))
                })
                .collect();
            // Go marshals struct fields in declaration order; serde_json's Map
            // sorts keys, so the entry is spelled out in order.
            format!(
                "{{\"ClaimUID\":{},\"ClaimName\":{},\"Namespace\":{},\"PodUIDs\":{},\"DriverState\":{{{}}}}}",
                json!(c.uid),
                json!(c.name),
                json!(c.namespace),
                Value::Object(pods),
                drivers.join(",")
            )
        })
        .collect();
    let data = format!(
        "{{\"kind\":\"DRACheckpoint\",\"apiVersion\":\"checkpoint.dra.kubelet.k8s.io/v1\",\"ClaimInfoStateList\":{}}}",
        if list.is_empty() { "null".to_owned() } else { format!("[{}]", list.join(",")) }
    );
    let sum = crc32_ieee(data.as_bytes());
    format!("{{\"Data\":{},\"Checksum\":{sum}}}", json!(data))
}

/// Reads a checkpoint; a checksum mismatch is an error, as kubelet refuses to
/// start on a corrupt checkpoint (`checkpointmanager`, `ErrCorruptCheckpoint`).
fn read_checkpoint(text: &str) -> anyhow::Result<BTreeMap<(String, String), ClaimInfo>> {
    let outer: Value = serde_json::from_str(text)?;
    let data = outer["Data"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("checkpoint has no Data"))?;
    let sum = outer["Checksum"].as_u64();
    anyhow::ensure!(
        sum == Some(u64::from(crc32_ieee(data.as_bytes()))),
        "checkpoint is corrupted"
    );
    let data: Value = serde_json::from_str(data)?;
    // Later releases name the list `Entries`.
    let list = data
        .get("ClaimInfoStateList")
        .or_else(|| data.get("Entries"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = BTreeMap::new();
    for e in list {
        let s = |k: &str| e[k].as_str().unwrap_or_default().to_owned();
        let pod_uids = e["PodUIDs"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        let mut drivers = BTreeMap::new();
        if let Some(m) = e["DriverState"].as_object() {
            for (d, st) in m {
                let devices = st["Devices"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|x| PreparedDevice {
                                request_names: strings(&x["RequestNames"]),
                                pool_name: x["PoolName"].as_str().unwrap_or_default().into(),
                                device_name: x["DeviceName"].as_str().unwrap_or_default().into(),
                                cdi_device_ids: strings(&x["CDIDeviceIDs"]),
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                drivers.insert(d.clone(), devices);
            }
        }
        let info = ClaimInfo {
            uid: s("ClaimUID"),
            name: s("ClaimName"),
            namespace: s("Namespace"),
            pod_uids,
            drivers,
            prepared: false,
        };
        out.insert((info.namespace.clone(), info.name.clone()), info);
    }
    Ok(out)
}

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

    /// `wipeResourceSlices` (1.32 `registration.go`, 1.34 `dra_plugin_manager.go`):
    /// get the Node (not there yet: retry), then `DeleteCollection` of
    /// ResourceSlices with field selector `spec.nodeName=<node>` plus
    /// `spec.driver=<driver>` for one driver (`fields.Set.String()`: keys sorted),
    /// retried with backoff from 1 s, factor 2, capped at 5 min, 100 steps.
    async fn wipe(&self, reason: &str, driver: Option<&str>) {
        let mut selector = BTreeMap::new();
        selector.insert("spec.nodeName", self.cfg.node.clone());
        if let Some(d) = driver {
            selector.insert("spec.driver", d.to_owned());
        }
        let selector: Vec<String> = selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let selector = selector.join(",");
        let path = format!(
            "/apis/{}/resourceslices?fieldSelector={}",
            self.cfg.kubelet.resource_api(),
            percent_encode_query(&selector)
        );
        let mut delay = Duration::from_secs(1);
        for _ in 0..100 {
            let node = self
                .api
                .get(&format!(
                    "/api/v1/nodes/{}",
                    percent_encode_query(&self.cfg.node)
                ))
                .await;
            if matches!(node, Ok((200, _))) {
                // client-go sends the (empty) DeleteOptions as the body.
                let body =
                    json!({"kind": "DeleteOptions", "apiVersion": self.cfg.kubelet.resource_api()});
                match self.api.call("DELETE", &path, Some(&body)).await {
                    Ok((200, list)) => {
                        let deleted = list["items"]
                            .as_array()
                            .map(|a| {
                                a.iter()
                                    .filter_map(|o| {
                                        o["metadata"]["name"].as_str().map(str::to_owned)
                                    })
                                    .collect()
                            })
                            .unwrap_or_default();
                        self.emit(Event::Wiped {
                            reason: reason.into(),
                            field_selector: selector,
                            deleted,
                        });
                        return;
                    }
                    // 1.34 takes NotFound as nothing to delete.
                    Ok((404, _)) if self.cfg.kubelet == KubeletVersion::V1_34 => {
                        self.emit(Event::Wiped {
                            reason: reason.into(),
                            field_selector: selector,
                            deleted: vec![],
                        });
                        return;
                    }
                    _ => {}
                }
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(300));
        }
    }

    /// The plugin watcher and its reconciler: register new sockets, deregister
    /// gone ones (`pkg/kubelet/pluginmanager/reconciler/reconciler.go`,
    /// `operationexecutor/operation_generator.go`).
    async fn watch_plugins(self: &Arc<Self>) {
        use std::os::unix::fs::MetadataExt;
        let now: BTreeMap<PathBuf, u64> = dra::registration_sockets(&self.cfg.registry)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|p| std::fs::symlink_metadata(&p).ok().map(|m| (p, m.ino())))
            .collect();
        let known: Vec<(PathBuf, Known)> = lock(&self.state)
            .known
            .iter()
            .map(|(p, k)| (p.clone(), k.clone()))
            .collect();
        for (socket, k) in known {
            if now.get(&socket) != Some(&k.ino) {
                self.deregister(&socket, k.driver.as_deref());
            }
        }
        for (socket, ino) in now {
            let (is_known, retry_at) = {
                let st = lock(&self.state);
                (
                    st.known.contains_key(&socket),
                    st.retry_registration.get(&socket).copied(),
                )
            };
            if is_known || retry_at.is_some_and(|t| Instant::now() < t) {
                continue;
            }
            self.register(&socket, ino).await;
        }
    }

    async fn register(self: &Arc<Self>, socket: &Path, ino: u64) {
        let kubelet = self.cfg.kubelet;
        // `RegisterPlugin` → `add` (1.34, `dra_plugin_manager.go`): one plugin
        // instance cannot take over the endpoint of another of the same driver.
        let accept = |info: &kubelet_api::pluginregistration::PluginInfo| {
            let st = lock(&self.state);
            let taken = st
                .plugins
                .get(&info.name)
                .is_some_and(|ps| ps.iter().any(|p| p.endpoint == Path::new(&info.endpoint)));
            if kubelet == KubeletVersion::V1_34 && taken {
                return Err(format!(
                    "endpoint {} already registered for DRA driver plugin {}",
                    info.endpoint, info.name
                ));
            }
            Ok(())
        };
        match dra::register_as(socket, kubelet, accept).await {
            Ok(verdict) => {
                let (driver, endpoint, chosen) = match verdict {
                    Verdict::Registered(r) => (r.name.clone(), r.endpoint_path(), Some(r.chosen)),
                    Verdict::RegisteredAlpha(info) => {
                        (info.name.clone(), PathBuf::from(&info.endpoint), None)
                    }
                };
                {
                    let mut st = lock(&self.state);
                    st.retry_registration.remove(socket);
                    st.known.insert(
                        socket.to_owned(),
                        Known {
                            ino,
                            driver: Some(driver.clone()),
                        },
                    );
                    let plugins = st.plugins.entry(driver.clone()).or_default();
                    // 1.32's store keeps one plugin per driver name
                    // (`plugins_store.go`); 1.34 a list, newest last.
                    if kubelet == KubeletVersion::V1_32 {
                        plugins.clear();
                    }
                    plugins.push(Plugin {
                        socket: socket.to_owned(),
                        endpoint: endpoint.clone(),
                        chosen,
                        connected: false,
                        client: None,
                    });
                }
                self.emit(Event::Registered {
                    socket: socket.to_owned(),
                    driver: driver.clone(),
                    endpoint: endpoint.display().to_string(),
                    chosen,
                });
                match kubelet {
                    // 1.32 `RegisterPlugin`: cancel a pending wipe of this driver.
                    KubeletVersion::V1_32 => self.cancel_wipe(&driver),
                    // 1.34 `add` → `sync`: the new plugin is not connected yet.
                    KubeletVersion::V1_34 => self.sync(&driver),
                }
            }
            Err(e) => {
                // The reconciler tries again (every second here).
                lock(&self.state)
                    .retry_registration
                    .insert(socket.to_owned(), Instant::now() + Duration::from_secs(1));
                self.emit(Event::Refused {
                    socket: socket.to_owned(),
                    error: format!("{e:#}"),
                });
            }
        }
    }

    /// `DeRegisterPlugin`: the socket is gone (or was re-created).
    fn deregister(self: &Arc<Self>, socket: &Path, driver: Option<&str>) {
        let last = {
            let mut st = lock(&self.state);
            st.known.remove(socket);
            let Some(driver) = driver else { return };
            let Some(plugins) = st.plugins.get_mut(driver) else {
                return;
            };
            let before = plugins.len();
            plugins.retain(|p| p.socket != socket);
            if plugins.len() == before {
                return;
            }
            let last = plugins.is_empty();
            if last {
                st.plugins.remove(driver);
            }
            last
        };
        let Some(driver) = driver else { return };
        self.emit(Event::Deregistered {
            socket: socket.to_owned(),
            driver: driver.to_owned(),
            last,
        });
        match self.cfg.kubelet {
            // 1.32 `DeRegisterPlugin` (`registration.go`): after the last
            // instance, wipe after the delay (replacing a pending wipe).
            KubeletVersion::V1_32 => {
                if last {
                    self.cancel_wipe(driver);
                    self.schedule_wipe(driver);
                }
            }
            // 1.34 `remove` → `sync`.
            KubeletVersion::V1_34 => self.sync(driver),
        }
    }

    /// 1.34 `sync` (`dra_plugin_manager.go`): a driver with a connected plugin
    /// cancels its pending wipe; one without gets a wipe queued, unless one is.
    fn sync(self: &Arc<Self>, driver: &str) {
        let (usable, pending) = {
            let st = lock(&self.state);
            let usable = st
                .plugins
                .get(driver)
                .is_some_and(|ps| ps.iter().any(|p| p.connected));
            let pending = st
                .pending_wipes
                .get(driver)
                .is_some_and(|h| !h.is_finished());
            (usable, pending)
        };
        if usable {
            self.cancel_wipe(driver);
        } else if !pending {
            self.schedule_wipe(driver);
        }
    }

    fn schedule_wipe(self: &Arc<Self>, driver: &str) {
        let delay = self.cfg.wiping_delay;
        let peer = self.clone();
        let d = driver.to_owned();
        let handle = tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            peer.wipe("driver-cleanup", Some(&d)).await;
        });
        lock(&self.state)
            .pending_wipes
            .insert(driver.to_owned(), handle);
        self.emit(Event::WipeScheduled {
            driver: driver.to_owned(),
            delay_ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
        });
    }

    fn cancel_wipe(&self, driver: &str) {
        let handle = lock(&self.state).pending_wipes.remove(driver);
        if let Some(h) = handle {
            if !h.is_finished() {
                h.abort();
                self.emit(Event::WipeCancelled {
                    driver: driver.to_owned(),
                });
            }
        }
    }

    /// 1.34's connection tracking (`monitoredPlugin.HandleConn`): a change of a
    /// plugin's connection state → `sync` of its driver.
    fn probe_connections(self: &Arc<Self>) {
        let mut changed = Vec::new();
        {
            let mut st = lock(&self.state);
            for (driver, plugins) in st.plugins.iter_mut() {
                for p in plugins.iter_mut() {
                    let up = std::os::unix::net::UnixStream::connect(&p.endpoint).is_ok();
                    if up != p.connected {
                        p.connected = up;
                        if !up {
                            p.client = None;
                        }
                        changed.push((driver.clone(), p.endpoint.display().to_string(), up));
                    }
                }
            }
        }
        for (driver, endpoint, connected) in changed {
            self.emit(Event::Connection {
                driver: driver.clone(),
                endpoint,
                connected,
            });
            self.sync(&driver);
        }
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

    /// The pods now; prepare the new ones, unprepare the gone ones' claims.
    async fn sync_pods(self: &Arc<Self>) {
        let pods: Vec<Pod> = match std::fs::read(&self.cfg.pods) {
            Ok(b) => match serde_json::from_slice(&b) {
                Ok(p) => p,
                Err(_) => return,
            },
            Err(_) => vec![],
        };
        let active: BTreeSet<String> = pods.iter().map(|p| p.uid.clone()).collect();
        // Pod workers run side by side: prepare every pod that needs it at once.
        let mut work = tokio::task::JoinSet::new();
        for pod in pods {
            let due = {
                let st = lock(&self.state);
                !st.ready.contains(&pod.uid)
                    && st
                        .retry_pod
                        .get(&pod.uid)
                        .is_none_or(|t| Instant::now() >= *t)
            };
            if due {
                let peer = self.clone();
                work.spawn(async move { peer.prepare_pod(pod).await });
            }
        }
        while work.join_next().await.is_some() {}
        // The reconcile loop (`manager.go`, `reconcileLoop`): claims of pods no
        // longer active, grouped by pod.
        let inactive: BTreeMap<String, (String, Vec<String>)> = {
            let st = lock(&self.state);
            let mut m: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
            for c in st.claims.values() {
                for p in c.pod_uids.iter().filter(|p| !active.contains(*p)) {
                    m.entry(p.clone())
                        .or_insert_with(|| (c.namespace.clone(), vec![]))
                        .1
                        .push(c.name.clone());
                }
            }
            m
        };
        for (pod, (ns, names)) in inactive {
            match self.unprepare(&pod, &ns, &names).await {
                Ok(()) => {
                    lock(&self.state).ready.remove(&pod);
                    self.emit(Event::PodGone { pod });
                }
                Err(error) => self.emit(Event::UnprepareFailed { pod, error }),
            }
        }
        let mut st = lock(&self.state);
        st.ready.retain(|p| active.contains(p));
    }

    async fn prepare_pod(self: Arc<Self>, pod: Pod) {
        match self.prepare(&pod).await {
            Ok(()) => {
                let mut st = lock(&self.state);
                st.ready.insert(pod.uid.clone());
                st.retry_pod.remove(&pod.uid);
                drop(st);
                self.emit(Event::PodReady { pod: pod.uid });
            }
            Err(error) => {
                lock(&self.state)
                    .retry_pod
                    .insert(pod.uid.clone(), Instant::now() + Duration::from_secs(1));
                self.emit(Event::PrepareFailed {
                    pod: pod.uid,
                    error: format!("prepare dynamic resources: {error}"),
                });
            }
        }
    }

    /// `prepareResources` (`pkg/kubelet/cm/dra/manager.go`).
    async fn prepare(&self, pod: &Pod) -> Result<(), String> {
        // The validation pass: fetch each claim, check it is reserved for the pod
        // and allocated, and find its drivers' plugins — the cache untouched.
        struct Info {
            claim: ClaimInfo,
        }
        let mut infos = Vec::new();
        for name in &pod.claims {
            let path = format!(
                "/apis/{}/namespaces/{}/resourceclaims/{}",
                self.cfg.kubelet.resource_api(),
                pod.namespace,
                name
            );
            let claim = match self.api.get(&path).await {
                Ok((200, c)) => c,
                Ok((_, status)) => {
                    return Err(format!(
                        "fetch ResourceClaim {name}: {}",
                        status["message"].as_str().unwrap_or("error")
                    ))
                }
                Err(e) => return Err(format!("fetch ResourceClaim {name}: {e}")),
            };
            let uid = claim["metadata"]["uid"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            // `resourceclaim.IsReservedForPod`: a reservedFor entry with the pod's uid.
            let reserved = claim["status"]["reservedFor"]
                .as_array()
                .is_some_and(|r| r.iter().any(|e| e["uid"] == json!(pod.uid)));
            if !reserved {
                return Err(format!(
                    "pod {} ({}) is not allowed to use ResourceClaim {name} ({uid})",
                    pod.name, pod.uid
                ));
            }
            // `newClaimInfoFromClaim` (`claiminfo.go`).
            let Some(results) = claim["status"]["allocation"]["devices"]["results"]
                .as_array()
                .filter(|_| !claim["status"]["allocation"].is_null())
            else {
                return Err(format!("ResourceClaim {name}: not allocated"));
            };
            let drivers = results
                .iter()
                .filter_map(|r| r["driver"].as_str().map(|d| (d.to_owned(), vec![])))
                .collect::<BTreeMap<_, _>>();
            for d in drivers.keys() {
                self.client(d).await?;
            }
            infos.push(Info {
                claim: ClaimInfo {
                    uid,
                    name: name.clone(),
                    namespace: pod.namespace.clone(),
                    pod_uids: BTreeSet::new(),
                    drivers,
                    prepared: false,
                },
            });
        }
        // Now the cache: add the pod's reference, checkpoint, and batch what is
        // not prepared yet. An already prepared claim ends the pass — upstream's
        // callback returns there, so later claims of this pod are not batched.
        let mut batches: BTreeMap<String, Vec<ClaimRef>> = BTreeMap::new();
        let mut to_mark: Vec<(String, String)> = Vec::new();
        {
            let mut st = lock(&self.state);
            for info in &infos {
                let key = (info.claim.namespace.clone(), info.claim.name.clone());
                let entry = st
                    .claims
                    .entry(key.clone())
                    .or_insert_with(|| info.claim.clone());
                if entry.uid != info.claim.uid {
                    return Err(format!(
                        "old ResourceClaim with same name {} and different UID {} still exists (previous pod force-deleted?!)",
                        info.claim.name, entry.uid
                    ));
                }
                entry.pod_uids.insert(pod.uid.clone());
                let prepared = entry.prepared;
                let claim = entry.claim_ref();
                let drivers: Vec<String> = entry.drivers.keys().cloned().collect();
                self.checkpoint(&st)?;
                if prepared {
                    break;
                }
                to_mark.push(key);
                for d in drivers {
                    batches.entry(d).or_default().push(claim.clone());
                }
            }
        }
        for (driver, claims) in batches {
            let (mut client, version) = self.client(&driver).await?;
            let answer = tokio::time::timeout(CLIENT_CALL_TIMEOUT, client.prepare(&claims))
                .await
                .map_err(|_| "NodePrepareResources: context deadline exceeded".to_owned())?;
            let answer = match answer {
                Ok(a) => a,
                Err(status) => {
                    self.drop_client(&driver);
                    return Err(format!("NodePrepareResources: {status}"));
                }
            };
            self.emit(Event::Prepared {
                pod: pod.uid.clone(),
                driver: driver.clone(),
                version,
                claims: claims.clone(),
                answer: answer.clone(),
            });
            for (uid, result) in &answer.claims {
                let Some(req) = claims.iter().find(|c| &c.uid == uid) else {
                    return Err(format!(
                        "NodePrepareResources returned result for unknown claim UID {uid}"
                    ));
                };
                if !result.error.is_empty() {
                    return Err(format!(
                        "NodePrepareResources failed for ResourceClaim {}: {}",
                        req.name, result.error
                    ));
                }
                let mut st = lock(&self.state);
                let info = st
                    .claims
                    .get_mut(&(req.namespace.clone(), req.name.clone()))
                    .ok_or_else(|| {
                        format!(
                            "internal error: unable to get claim info for ResourceClaim {}",
                            req.name
                        )
                    })?;
                info.drivers
                    .entry(driver.clone())
                    .or_default()
                    .extend(result.devices.iter().cloned());
            }
            // Counted against the request as sent: a claim listed twice is
            // answered once, and kubelet counts the second as skipped.
            let unfinished = claims.len().saturating_sub(answer.claims.len());
            if unfinished != 0 {
                return Err(format!(
                    "NodePrepareResources skipped {unfinished} ResourceClaims"
                ));
            }
        }
        let mut st = lock(&self.state);
        for key in &to_mark {
            if let Some(info) = st.claims.get_mut(key) {
                info.prepared = true;
            }
        }
        self.checkpoint(&st)
    }

    /// `unprepareResources` (`pkg/kubelet/cm/dra/manager.go`).
    async fn unprepare(&self, pod: &str, namespace: &str, names: &[String]) -> Result<(), String> {
        let mut batches: BTreeMap<String, Vec<ClaimRef>> = BTreeMap::new();
        let mut done: Vec<(String, String)> = Vec::new();
        {
            let mut st = lock(&self.state);
            for name in names {
                let key = (namespace.to_owned(), name.clone());
                let Some(info) = st.claims.get_mut(&key) else {
                    continue;
                };
                // Other pods still use it: drop this pod's reference only (the
                // checkpoint follows with the next write).
                if info.pod_uids.len() > 1 {
                    info.pod_uids.remove(pod);
                    continue;
                }
                done.push(key);
                for d in info.drivers.keys() {
                    batches.entry(d.clone()).or_default().push(info.claim_ref());
                }
            }
        }
        for (driver, claims) in batches {
            let (mut client, version) = self.client(&driver).await?;
            let answer = tokio::time::timeout(CLIENT_CALL_TIMEOUT, client.unprepare(&claims))
                .await
                .map_err(|_| "NodeUnprepareResources: context deadline exceeded".to_owned())?;
            let answer = match answer {
                Ok(a) => a,
                Err(status) => {
                    self.drop_client(&driver);
                    return Err(format!("NodeUnprepareResources: {status}"));
                }
            };
            self.emit(Event::Unprepared {
                pod: pod.to_owned(),
                driver: driver.clone(),
                version,
                claims: claims.clone(),
                answer: answer.clone(),
            });
            for (uid, result) in &answer.claims {
                let Some(req) = claims.iter().find(|c| &c.uid == uid) else {
                    return Err(format!(
                        "NodeUnprepareResources returned result for unknown claim UID {uid}"
                    ));
                };
                if !result.error.is_empty() {
                    return Err(format!(
                        "NodeUnprepareResources failed for ResourceClaim {}: {}",
                        req.name, result.error
                    ));
                }
            }
            let unfinished = claims.len().saturating_sub(answer.claims.len());
            if unfinished != 0 {
                return Err(format!(
                    "NodeUnprepareResources skipped {unfinished} ResourceClaims"
                ));
            }
        }
        let mut st = lock(&self.state);
        for key in &done {
            st.claims.remove(key);
        }
        self.checkpoint(&st)
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
mod tests {
    use super::*;

    #[test]
    fn the_checkpoint_is_kubelets_format_and_checksum() {
        // The Data and Checksum of upstream's own test checkpoint
        // (`pkg/kubelet/cm/dra/state/state_checkpoint_test.go`).
        let data = r#"{"kind":"DRACheckpoint","apiVersion":"checkpoint.dra.kubelet.k8s.io/v1","ClaimInfoStateList":[{"ClaimUID":"067798be-454e-4be4-9047-1aa06aea63f7","ClaimName":"example","Namespace":"default","PodUIDs":{"139cdb46-f989-4f17-9561-ca10cfb509a6":{}},"DriverState":{"test-driver.cdi.k8s.io":{"Devices":[{"PoolName":"worker-1","DeviceName":"dev-1","RequestNames":["test request"],"CDIDeviceIDs":["example.com/example=cdi-example"]}]}}}]}"#;
        assert_eq!(crc32_ieee(data.as_bytes()), 1_656_016_162);
        let text = format!("{{\"Data\":{},\"Checksum\":1656016162}}", json!(data));
        let claims = read_checkpoint(&text).unwrap();
        let c = &claims[&("default".to_owned(), "example".to_owned())];
        assert!(!c.prepared, "a restart forgets what was prepared");
        assert_eq!(checkpoint_json(&claims), text, "written back byte for byte");
        assert!(read_checkpoint(&text.replace("1656016162", "1")).is_err());
    }

    #[test]
    fn query_values_are_escaped_as_go_does() {
        assert_eq!(
            percent_encode_query("spec.driver=d.example.com,spec.nodeName=n 1"),
            "spec.driver%3Dd.example.com%2Cspec.nodeName%3Dn+1"
        );
    }
}
