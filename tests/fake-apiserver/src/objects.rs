//! Objects shaped like the ones a cluster serves.

use serde_json::{json, Map, Value};

fn string_map(pairs: &[(&str, &str)]) -> Value {
    Value::Object(
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Value::String((*v).to_owned())))
            .collect::<Map<_, _>>(),
    )
}

/// A Node with these labels.
pub fn node(name: &str, labels: &[(&str, &str)]) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "uid": format!("uid-node-{name}"), "labels": string_map(labels)},
        "spec": {},
    })
}

/// A DaemonSet whose pod template selects nodes by `node_selector`.
pub fn daemonset(ns: &str, name: &str, node_selector: &[(&str, &str)]) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": ns, "uid": format!("uid-ds-{name}")},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": name}},
                "spec": {
                    "nodeSelector": string_map(node_selector),
                    "containers": [{"name": name, "image": "localhost/vfio-sandbox:0.1.0"}],
                },
            },
        },
    })
}

/// A DaemonSet shaped like the shipped vfio-manager's (the chart's templates/vfio-manager.yaml):
/// no node selector, and a required node affinity of two ORed terms, the `selector`
/// labels (VM mode) or `restore_label=true` (a restore to finish).
pub fn daemonset_with_restore_label(
    ns: &str,
    name: &str,
    selector: &[(&str, &str)],
    restore_label: &str,
) -> Value {
    let mut ds = daemonset(ns, name, &[]);
    let term = |pairs: &[(&str, &str)]| {
        let exprs: Vec<Value> = pairs
            .iter()
            .map(|(k, v)| json!({"key": k, "operator": "In", "values": [v]}))
            .collect();
        json!({ "matchExpressions": exprs })
    };
    let spec = &mut ds["spec"]["template"]["spec"];
    if let Some(o) = spec.as_object_mut() {
        o.remove("nodeSelector");
    }
    spec["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term(selector), term(&[(restore_label, "true")])],
    }}});
    ds
}

/// One allocated device of a ResourceClaim (`status.allocation.devices.results[]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceResult {
    /// The claim's request it satisfies.
    pub request: String,
    /// The DRA driver.
    pub driver: String,
    /// The pool (a node-local driver's pool is the node's name).
    pub pool: String,
    /// The device's name in the pool.
    pub device: String,
}

impl DeviceResult {
    /// A result for `request` of `driver`'s device `pool`/`device`.
    pub fn new(request: &str, driver: &str, pool: &str, device: &str) -> Self {
        Self {
            request: request.into(),
            driver: driver.into(),
            pool: pool.into(),
            device: device.into(),
        }
    }

    /// Parses `REQUEST:DRIVER:POOL:DEVICE`.
    pub fn parse(text: &str) -> Option<Self> {
        let mut it = text.splitn(4, ':');
        Some(Self::new(it.next()?, it.next()?, it.next()?, it.next()?))
    }
}

/// A ResourceClaim as the user writes it: one `exactly` request per distinct
/// request name of `results`, from DeviceClass `class`.
pub fn resource_claim_spec(ns: &str, name: &str, class: &str, results: &[DeviceResult]) -> Value {
    let mut requests: Vec<&str> = results.iter().map(|r| r.request.as_str()).collect();
    requests.dedup();
    let requests: Vec<Value> = requests
        .iter()
        .map(|r| json!({"name": r, "exactly": {"deviceClassName": class, "allocationMode": "ExactCount", "count": 1}}))
        .collect();
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"devices": {"requests": requests}},
    })
}

/// The `status` of a claim the scheduler allocated `results` to, reserved for
/// no one yet.
pub fn allocation_status(results: &[DeviceResult]) -> Value {
    let results: Vec<Value> = results
        .iter()
        .map(|r| json!({"request": r.request, "driver": r.driver, "pool": r.pool, "device": r.device}))
        .collect();
    json!({"allocation": {"devices": {"results": results}}})
}

/// A stored ResourceClaim with uid `uid`: allocated `results` (unallocated when
/// `results` is `None`).
pub fn resource_claim(ns: &str, name: &str, uid: &str, results: Option<&[DeviceResult]>) -> Value {
    let mut claim = resource_claim_spec(ns, name, "vfio-sandbox", results.unwrap_or(&[]));
    claim["metadata"]["uid"] = json!(uid);
    if let Some(results) = results {
        claim["status"] = allocation_status(results);
    }
    claim
}

/// A ResourceSlice of `driver` for `node`, pool `pool` at `generation`, with
/// devices named `devices` (no attributes).
pub fn resource_slice(
    name: &str,
    driver: &str,
    node: &str,
    pool: &str,
    generation: i64,
    devices: &[&str],
) -> Value {
    let devices: Vec<Value> = devices.iter().map(|d| json!({"name": d})).collect();
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver, "nodeName": node,
            "pool": {"name": pool, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    })
}

/// A Pod on `node` owned by the DaemonSet `ds`.
pub fn pod(ns: &str, name: &str, node: &str, ds: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": ns, "uid": format!("uid-pod-{name}"),
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "DaemonSet", "name": ds,
                "uid": format!("uid-ds-{ds}"), "controller": true, "blockOwnerDeletion": true,
            }],
        },
        "spec": {"nodeName": node, "containers": [{"name": ds, "image": "localhost/vfio-sandbox:0.1.0"}]},
    })
}
