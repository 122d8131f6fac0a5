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

/// The binding conditions (KEP-5007) a test gives an allocation's results: the
/// one kube-scheduler waits on and the one it gives the allocation up on.
#[derive(Debug, Clone, Copy)]
pub struct Waits<'a> {
    /// `bindingConditions`.
    pub ready: &'a str,
    /// `bindingFailureConditions`.
    pub failed: &'a str,
}

/// `status.allocation` giving `results` to a pod on `node`, as a test writes it:
/// pinned to `node` with the single `matchFields` term kube-scheduler writes for
/// a node-local device; with `waits`, each result carries those binding
/// conditions and the allocation an `allocationTimestamp`. Nothing here chooses
/// devices or waits: the real kube-scheduler's allocations, waits and
/// deallocations are checked in tests/k8s (`dra-binding-conditions`).
pub fn allocation(results: &[DeviceResult], node: &str, waits: Option<Waits<'_>>) -> Value {
    let results: Vec<Value> = results
        .iter()
        .map(|r| {
            let mut v = json!({"request": r.request, "driver": r.driver, "pool": r.pool, "device": r.device});
            if let Some(w) = waits {
                v["bindingConditions"] = json!([w.ready]);
                v["bindingFailureConditions"] = json!([w.failed]);
            }
            v
        })
        .collect();
    let mut allocation = json!({
        "devices": {"results": results},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}
        ]}]},
    });
    if waits.is_some() {
        allocation["allocationTimestamp"] = support::time::now_rfc3339().into();
    }
    allocation
}

/// `claim`'s `spec.devices.config` as an allocation carries it (each entry with
/// `source: FromClaim`), or `None` when the claim has none.
pub fn allocated_config(claim: &Value) -> Option<Value> {
    let configs = claim.pointer("/spec/devices/config")?.as_array()?;
    let copied: Vec<Value> = configs
        .iter()
        .map(|c| {
            let mut c = c.clone();
            c["source"] = json!("FromClaim");
            c
        })
        .collect();
    Some(copied.into())
}

/// For each allocated device of `claim`, its condition of type `kind` in
/// `status.devices` (the entry matched by driver, pool and device), or `None`
/// where the entry or the condition is missing.
pub fn device_conditions<'c>(claim: &'c Value, kind: &str) -> Vec<Option<&'c Value>> {
    let results = claim
        .pointer("/status/allocation/devices/results")
        .and_then(Value::as_array);
    let entries = claim.pointer("/status/devices").and_then(Value::as_array);
    results
        .into_iter()
        .flatten()
        .map(|r| {
            entries
                .into_iter()
                .flatten()
                .find(|d| {
                    ["driver", "pool", "device"]
                        .iter()
                        .all(|k| d.get(*k) == r.get(*k))
                })?
                .get("conditions")?
                .as_array()?
                .iter()
                .find(|c| c.get("type").and_then(Value::as_str) == Some(kind))
        })
        .collect()
}

/// Whether condition `kind` is `True` for every allocated device of `claim`
/// (false for a claim with no allocation).
pub fn condition_true_on_all(claim: &Value, kind: &str) -> bool {
    let all = device_conditions(claim, kind);
    !all.is_empty() && all.iter().all(|c| c.is_some_and(|c| c["status"] == "True"))
}

/// The first allocated device's condition `kind` of `claim` that is `True`, as
/// `reason=R, message="M"`.
pub fn condition_true_on_any(claim: &Value, kind: &str) -> Option<String> {
    device_conditions(claim, kind)
        .into_iter()
        .flatten()
        .find(|c| c["status"] == "True")
        .map(|c| {
            format!(
                "reason={}, message={:?}",
                c["reason"].as_str().unwrap_or(""),
                c["message"].as_str().unwrap_or("")
            )
        })
}

/// `claim` with its allocation taken back in one status write: no
/// `reservedFor`, `allocation` or `devices` (what kube-scheduler writes when it
/// gives an allocation up).
pub fn deallocate(claim: &mut Value) {
    if let Some(status) = claim.get_mut("status").and_then(Value::as_object_mut) {
        for f in ["reservedFor", "allocation", "devices"] {
            status.remove(f);
        }
    }
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
