//! vfio-manager's restore label: a Node label it keeps while it may have devices
//! to restore, which its DaemonSet's node affinity selects on beside VM mode. So
//! a pod killed in the middle of a restore is made again on the node by the
//! DaemonSet controller and finishes the restore, and the label comes off once
//! nothing is left to restore.
//!
//! Whether the node stays in VM mode is judged without it ([`judge`]): it keeps
//! the pod scheduled and says nothing about VM mode.

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use node_agent::cluster::{
    bounded, decide, Cluster, ClusterError, Identity, StopObjects, Verdict, EVENT_TIMEOUT,
};

/// The label's value while it stands.
pub const VALUE: &str = "true";

/// What a look at the cluster found: the verdict, and whether the Node carries
/// the restore label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// Keep or restore.
    pub verdict: Verdict,
    /// `<restore label>=true` is on the Node.
    pub labelled: bool,
}

/// The cluster as vfio-manager sees it: the agents' [`Cluster`] and the restore
/// label's key, if it keeps one.
#[derive(Clone)]
pub struct ManagerCluster {
    /// The agents' view.
    pub cluster: Cluster,
    /// The restore label's key (`--restore-label`), when it is kept.
    pub label: Option<String>,
}

impl ManagerCluster {
    /// Keep or restore, and whether the label stands, as the API server tells it
    /// now; `Err` says why it could not tell.
    pub async fn check(&self) -> Result<Check, String> {
        let objects = self.cluster.stop_objects().await?;
        Ok(judge(
            self.cluster.identity(),
            self.label.as_deref(),
            objects,
        ))
    }

    /// Keep or restore; what cannot be told restores.
    pub async fn stop_verdict(&self) -> Verdict {
        match self.check().await {
            Ok(c) => c.verdict,
            Err(why) => Verdict::Restore(why),
        }
    }

    /// Puts the label (`<key>=true`) on the Node, or takes it off, with a JSON
    /// merge patch of the Node's labels (`kubectl label` does the same). Nothing
    /// to do without a key.
    pub async fn set_label(&self, on: bool) -> Result<(), ClusterError> {
        let Some(key) = self.label.as_deref() else {
            return Ok(());
        };
        let node = &self.cluster.identity().node;
        let value = if on {
            serde_json::Value::from(VALUE)
        } else {
            serde_json::Value::Null
        };
        let patch = serde_json::json!({"metadata": {"labels": {key: value}}});
        let api: Api<Node> = Api::all(self.cluster.kube_client());
        let what = if on {
            format!("label Node {node} {key}={VALUE}")
        } else {
            format!("remove label {key} from Node {node}")
        };
        let params = PatchParams::default();
        bounded(
            &what,
            EVENT_TIMEOUT,
            api.patch(node, &params, &Patch::Merge(&patch)),
        )
        .await
        .map(|_| ())
    }
}

/// The stop's verdict with label `key` left out of the Node, and whether the
/// label stood (`<key>=true`).
pub fn judge(identity: &Identity, key: Option<&str>, mut objects: StopObjects) -> Check {
    let mut removed = None;
    if let (Some(key), Some(node)) = (key, objects.node.as_mut()) {
        if let Some(labels) = node.metadata.labels.as_mut() {
            removed = labels.remove(key).map(|value| (key, value));
        }
    }
    let verdict = match (decide(identity, &objects), &removed) {
        (Verdict::Restore(why), Some((key, _))) => Verdict::Restore(format!(
            "{why} (judged without {key}, the label that keeps vfio-manager's pod on the \
             node until its devices are back)"
        )),
        (verdict, _) => verdict,
    };
    Check {
        verdict,
        labelled: removed.is_some_and(|(_, value)| value == VALUE),
    }
}

#[cfg(test)]
mod tests;
