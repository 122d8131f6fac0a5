//! The node agent's view of the cluster: is this node still meant to be in VM mode?
//!
//! A DaemonSet pod is stopped for two very different reasons. In a rollout (new
//! image, new resource list) or a pod restart the node stays in VM mode and a new pod
//! follows at once: restoring would bounce every idle device to its native driver and
//! back, and the device plugin would report them Unhealthy meanwhile. When the node
//! leaves VM mode (its label removed or set to `container`, the DaemonSet deleted) the
//! devices must go back. Only the API server knows which one it is, so on a stop the
//! agent asks it:
//!
//! 1. its own Pod (`POD_NAMESPACE`/`POD_NAME`) names the DaemonSet that controls it;
//! 2. that DaemonSet must still exist and not be being deleted;
//! 3. its pod template's node name, node selector and required node affinity must
//!    still match the agent's Node (`NODE_NAME`), and the Node must carry no
//!    `NoExecute` taint the pod does not tolerate — the test the DaemonSet controller
//!    makes to decide whether a running pod stays on the node ([`crate::daemonset`]).
//!
//! Only when all three hold is the stop a rollout ([`Verdict::Keep`]). Anything else
//! — an object missing, the API server unreachable or slow, a pod without a
//! DaemonSet — restores ([`Verdict::Restore`]): restoring is always safe (it never
//! touches a device a VM holds), keeping is only an optimisation.
//!
//! The decision itself ([`decide`]) is a pure function of the three objects
//! ([`StopObjects`]), so it is tested case by case; [`Cluster`] fetches them with
//! kube-rs and posts Events about the Node.

use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use kube::api::Api;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::Client;

use crate::daemonset::{daemonset_owner, node_selected, tolerates_no_execute};

/// Upper bound for answering "keep or restore?" on a stop: three reads of a server
/// that answers in milliseconds when it is well. The grace period (120 s in our
/// manifests) must still hold the restore after it, and a server that cannot answer
/// in this time restores anyway.
pub const STOP_LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// Upper bound for posting one Event.
pub const EVENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Who this agent is in the cluster (from the downward API).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// `spec.nodeName` of the pod: the Node to read.
    pub node: String,
    /// `metadata.namespace` and `metadata.name` of the pod, when given.
    pub pod: Option<(String, String)>,
    /// The reporting controller's name in Events (the program's name).
    pub controller: String,
}

/// What a stop should do, and why (said in the log and in an Event).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The node stays in VM mode: leave the devices bound for the next pod.
    Keep(String),
    /// The node leaves VM mode (or that cannot be shown): restore.
    Restore(String),
}

/// What the API server holds about an agent's stop; `None` where it answered 404
/// (the DaemonSet also where the pod names none).
#[derive(Debug, Clone, Default)]
pub struct StopObjects {
    /// The agent's own Pod.
    pub pod: Option<Pod>,
    /// The DaemonSet that controls it.
    pub daemonset: Option<DaemonSet>,
    /// The agent's Node.
    pub node: Option<Node>,
}

/// The decision of a stop, from what the API server said.
pub fn decide(identity: &Identity, objects: &StopObjects) -> Verdict {
    let Some((ns, name)) = &identity.pod else {
        return Verdict::Restore(
            "POD_NAME/POD_NAMESPACE are not set, so the DaemonSet cannot be found".into(),
        );
    };
    let pod_name = format!("{ns}/{name}");
    let Some(pod) = &objects.pod else {
        return Verdict::Restore(format!("Pod {pod_name} is not found"));
    };
    let Some(owner) = daemonset_owner(pod) else {
        return Verdict::Restore(format!("Pod {pod_name} is not managed by a DaemonSet"));
    };
    let ns = pod.metadata.namespace.as_deref().unwrap_or("");
    let ds_name = format!("{ns}/{owner}");
    let Some(ds) = &objects.daemonset else {
        return Verdict::Restore(format!("DaemonSet {ds_name} was deleted"));
    };
    if ds.metadata.deletion_timestamp.is_some() {
        return Verdict::Restore(format!("DaemonSet {ds_name} is being deleted"));
    }
    let node_name = &identity.node;
    let Some(node) = &objects.node else {
        return Verdict::Restore(format!("Node {node_name} is not found"));
    };
    if node.metadata.deletion_timestamp.is_some() {
        return Verdict::Restore(format!("Node {node_name} is being deleted"));
    }
    let Some(spec) = ds.spec.as_ref().and_then(|s| s.template.spec.as_ref()) else {
        return Verdict::Restore(format!("DaemonSet {ds_name} has no pod template"));
    };
    match node_selected(spec, node).and_then(|()| tolerates_no_execute(spec, node)) {
        Ok(()) => Verdict::Keep(format!(
            "Node {node_name} is still selected by DaemonSet {ds_name} (a rollout or a pod restart)"
        )),
        Err(why) => Verdict::Restore(format!(
            "Node {node_name} is no longer selected by DaemonSet {ds_name}: {why}"
        )),
    }
}

/// Why the cluster cannot be reached.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Neither a kubeconfig nor an in-cluster service account.
    #[error("no API server configuration (in-cluster service account or KUBECONFIG): {0}")]
    Config(String),
    /// The client could not be built.
    #[error("failed to build an API client: {0}")]
    Client(#[source] kube::Error),
    /// A request failed.
    #[error("{what}: {source}")]
    Request {
        /// What was asked.
        what: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// A request took too long.
    #[error("{0} timed out after {1:?}")]
    Timeout(String, Duration),
}

/// The configuration of the in-cluster service account, or `KUBECONFIG` /
/// `~/.kube/config` outside a cluster.
pub async fn infer_config() -> Result<kube::Config, ClusterError> {
    kube::Config::infer()
        .await
        .map_err(|e| ClusterError::Config(e.to_string()))
}

/// How long the API server keeps one of our watches open: kube-rs's default
/// `timeoutSeconds` (its `watcher::Config`), under the server's own
/// `--min-request-timeout` (1800 s).
pub const WATCH_TIMEOUT: Duration = Duration::from_secs(290);

/// How long a watch may stay silent before its connection is taken for dead. A
/// real API server sends nothing on a quiet watch but a bookmark about once a
/// minute (`bookmarkFrequency`, staging/src/k8s.io/apiserver/pkg/storage/cacher/
/// cacher.go), and ends it after [`WATCH_TIMEOUT`]: past both.
pub const WATCH_READ_TIMEOUT: Duration = Duration::from_secs(310);

/// A client for `config` with the agents' short connect, read and write timeouts
/// (a node agent never waits long on the API server).
pub fn client(config: kube::Config) -> Result<Client, ClusterError> {
    client_reading(config, Duration::from_secs(5))
}

/// A client whose reads wait `read_timeout` for the next bytes.
fn client_reading(
    mut config: kube::Config,
    read_timeout: Duration,
) -> Result<Client, ClusterError> {
    config.connect_timeout = Some(Duration::from_secs(3));
    config.read_timeout = Some(read_timeout);
    config.write_timeout = Some(Duration::from_secs(5));
    Client::try_from(config).map_err(ClusterError::Client)
}

/// The watcher configuration every agent's watch uses: the server ends it after
/// [`WATCH_TIMEOUT`], and the watcher opens the next from where it stopped.
#[must_use]
pub fn watch_config() -> kube::runtime::watcher::Config {
    kube::runtime::watcher::Config::default()
        .timeout(u32::try_from(WATCH_TIMEOUT.as_secs()).unwrap_or(u32::MAX))
}

/// A connection to the API server for one agent.
#[derive(Clone)]
pub struct Cluster {
    client: Client,
    /// The same server, for watches: a quiet watch is not a dead one.
    watch_client: Client,
    identity: Identity,
    recorder: Recorder,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// Connects with the in-cluster service account, or `KUBECONFIG` /
    /// `~/.kube/config` outside a cluster. No request is made yet.
    pub async fn connect(identity: Identity) -> Result<Self, ClusterError> {
        Self::with_config(identity, infer_config().await?)
    }

    /// Connects with `config` (tests point it at a stand-in server).
    pub fn with_config(identity: Identity, config: kube::Config) -> Result<Self, ClusterError> {
        let client = client(config.clone())?;
        let watch_client = client_reading(config, WATCH_READ_TIMEOUT)?;
        let reporter = Reporter {
            controller: identity.controller.clone(),
            instance: identity.pod.as_ref().map(|(_, n)| n.clone()),
        };
        let recorder = Recorder::new(client.clone(), reporter);
        Ok(Self {
            client,
            watch_client,
            identity,
            recorder,
        })
    }

    /// The client, for the agent's own requests.
    pub fn kube_client(&self) -> Client {
        self.client.clone()
    }

    /// The client for watches (with [`watch_config`]): its reads wait past the
    /// watch's server timeout, where [`Self::kube_client`]'s give up after 5 s.
    pub fn watch_client(&self) -> Client {
        self.watch_client.clone()
    }

    /// Who this agent is.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Reads this agent's Node (a check that the access works).
    pub async fn node(&self) -> Result<Node, ClusterError> {
        let api: Api<Node> = Api::all(self.client.clone());
        let what = format!("get Node {}", self.identity.node);
        bounded(&what, EVENT_TIMEOUT, api.get(&self.identity.node)).await
    }

    /// Keep or restore, asked of the API server now. Never fails: what cannot be
    /// read, or is not read within [`STOP_LOOKUP_TIMEOUT`], restores.
    pub async fn stop_verdict(&self) -> Verdict {
        match self.stop_lookup().await {
            Ok(v) => v,
            Err(why) => Verdict::Restore(why),
        }
    }

    /// Keep or restore as the API server tells it now; `Err` says why it could not
    /// tell (an error, or no answer within [`STOP_LOOKUP_TIMEOUT`]), for callers to
    /// whom "cannot tell" is not "restore".
    pub async fn stop_lookup(&self) -> Result<Verdict, String> {
        let objects = self.stop_objects().await?;
        Ok(decide(&self.identity, &objects))
    }

    /// The objects [`decide`] judges, read now within [`STOP_LOOKUP_TIMEOUT`];
    /// `Err` says why they could not be read.
    pub async fn stop_objects(&self) -> Result<StopObjects, String> {
        match tokio::time::timeout(STOP_LOOKUP_TIMEOUT, self.read_stop_objects()).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(format!(
                "the API server could not tell whether the node \
                    stays in VM mode: {e}"
            )),
            Err(_) => Err(format!(
                "the API server did not tell within {STOP_LOOKUP_TIMEOUT:?} whether \
                    the node stays in VM mode"
            )),
        }
    }

    async fn read_stop_objects(&self) -> Result<StopObjects, ClusterError> {
        let Some((ns, pod_name)) = self.identity.pod.clone() else {
            // Nothing to read: [`decide`] says why.
            return Ok(StopObjects::default());
        };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        let pod = get_opt(&pods, &pod_name, &format!("get Pod {ns}/{pod_name}")).await?;
        let daemonset = match pod.as_ref().and_then(daemonset_owner) {
            Some(owner) => {
                let api: Api<DaemonSet> = Api::namespaced(self.client.clone(), &ns);
                get_opt(&api, &owner, &format!("get DaemonSet {ns}/{owner}")).await?
            }
            None => None,
        };
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = get_opt(
            &nodes,
            &self.identity.node,
            &format!("get Node {}", self.identity.node),
        )
        .await?;
        Ok(StopObjects {
            pod,
            daemonset,
            node,
        })
    }

    /// Posts an Event about this agent's Node (in namespace `default`, where Events
    /// about cluster-scoped objects go). `action` is what was done, `reason` why.
    pub async fn node_event(
        &self,
        warning: bool,
        reason: &str,
        action: &str,
        note: &str,
    ) -> Result<(), ClusterError> {
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(self.identity.node.clone()),
            // kubectl describe node matches Events by name and uid; the node's uid is
            // its name for kubelet's own Events, and ours follow that convention.
            uid: Some(self.identity.node.clone()),
            ..ObjectReference::default()
        };
        let what = format!("post Event {reason} on Node {}", self.identity.node);
        self.event(&reference, &what, warning, reason, action, note)
            .await
    }

    /// Posts an Event about `reference`; `what` says in an error what was being
    /// posted where (`post Event PrepareFailed on ResourceClaim ns/name`).
    pub async fn event(
        &self,
        reference: &ObjectReference,
        what: &str,
        warning: bool,
        reason: &str,
        action: &str,
        note: &str,
    ) -> Result<(), ClusterError> {
        let event = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.into(),
            note: Some(truncate(note, 1024)),
            action: action.into(),
            secondary: None,
        };
        bounded(
            what,
            EVENT_TIMEOUT,
            self.recorder.publish(&event, reference),
        )
        .await
    }
}

/// An Event note is at most 1 KiB.
fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max.saturating_sub(3);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// Deletes DaemonSet `namespace/name` in the foreground and waits until it is
/// gone: the garbage collector deletes its pods first and removes the DaemonSet
/// only once every one of them has terminated (`propagationPolicy: Foreground`;
/// DaemonSet pods block their owner's deletion). Returns how long that took, or
/// `None` when there was no such DaemonSet. A DaemonSet of that name with another
/// UID (made again meanwhile) counts as gone.
pub async fn delete_daemonset_and_wait(
    client: Client,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> Result<Option<Duration>, ClusterError> {
    let api: Api<DaemonSet> = Api::namespaced(client, namespace);
    let what = format!("delete DaemonSet {namespace}/{name}");
    let start = tokio::time::Instant::now();
    let params = kube::api::DeleteParams::foreground();
    let uid = match bounded(&what, EVENT_TIMEOUT, api.delete(name, &params)).await {
        Ok(deleted) => deleted.either(|ds| ds.metadata.uid, |_| None),
        Err(ClusterError::Request {
            source: kube::Error::Api(e),
            ..
        }) if e.code == 404 => return Ok(None),
        Err(e) => return Err(e),
    };
    let waited = format!("{what}: its pods to terminate and the DaemonSet to go");
    loop {
        // A failed read is tried again until the deadline: the wait is what counts.
        let got = bounded(&waited, EVENT_TIMEOUT, api.get_opt(name)).await;
        match got {
            Ok(None) => return Ok(Some(start.elapsed())),
            Ok(Some(ds)) if uid.is_some() && ds.metadata.uid != uid => {
                return Ok(Some(start.elapsed()))
            }
            Ok(Some(_)) => {}
            Err(e) => tracing::warn!(error = %e, "cannot read the DaemonSet; trying again"),
        }
        if start.elapsed() >= timeout {
            return Err(ClusterError::Timeout(waited, timeout));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A request to the API server that takes at most `limit`; its error names
/// `what` was asked.
pub async fn bounded<T>(
    what: &str,
    limit: Duration,
    fut: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, ClusterError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(ClusterError::Request {
            what: what.to_owned(),
            source,
        }),
        Err(_) => Err(ClusterError::Timeout(what.to_owned(), limit)),
    }
}

async fn get_opt<K>(api: &Api<K>, name: &str, what: &str) -> Result<Option<K>, ClusterError>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.get_opt(name).await {
        Ok(found) => Ok(found),
        Err(source) => Err(ClusterError::Request {
            what: what.to_owned(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests;
