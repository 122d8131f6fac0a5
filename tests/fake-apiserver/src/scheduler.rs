//! What kube-scheduler's DRA plugin writes into a ResourceClaim and how it waits on
//! binding conditions, for tests that play the scheduler against the stand-in.
//!
//! Upstream, transcribed:
//! - the allocator copies a device's `bindingConditions` and
//!   `bindingFailureConditions` into its result, and a device with `bindsToNode`
//!   (or a slice with `nodeName`) pins the allocation to the node with a
//!   single-term `matchFields` selector (`staging/src/k8s.io/dynamic-resource-allocation/structured/internal/experimental/allocator_experimental.go`,
//!   `createNodeSelector`);
//! - `bindClaim` stamps `allocationTimestamp` when it writes the allocation
//!   (`pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go`);
//! - PreBind then polls every 5 s, the first time at once
//!   (`wait.PollUntilContextTimeout(ctx, 5*time.Second, pl.bindingTimeout, true, …)`),
//!   with `isClaimReadyForBinding`: a result with binding conditions needs the
//!   `status.devices` entry of its driver, pool and device; a failure condition
//!   `True` there is an error; every binding condition must be `True`;
//! - the binding timeout counts from `allocationTimestamp`, 600 s by default
//!   (`DynamicResourcesBindingTimeoutDefault`);
//! - on failure or timeout, PostFilter deallocates: `reservedFor`, `allocation`
//!   and `devices` cleared in one status update.

use std::time::Duration;

use serde_json::{json, Value};

use crate::objects::DeviceResult;

/// How often PreBind looks at the claim.
pub const POLL: Duration = Duration::from_secs(5);
/// The default binding timeout.
pub const BINDING_TIMEOUT: Duration = Duration::from_secs(600);

/// The `status.allocation` the scheduler writes for `results`, allocated from
/// `slices` for a pod on `node`.
pub fn allocation(results: &[DeviceResult], slices: &[Value], node: &str) -> Value {
    let mut pinned = false;
    let mut waits = false;
    let out: Vec<Value> = results
        .iter()
        .map(|r| {
            let mut v = json!({"request": r.request, "driver": r.driver, "pool": r.pool, "device": r.device});
            let slice = slices.iter().find(|s| {
                s.pointer("/spec/driver").and_then(Value::as_str) == Some(&r.driver)
                    && s.pointer("/spec/pool/name").and_then(Value::as_str) == Some(&r.pool)
                    && device_of(s, &r.device).is_some()
            });
            if let Some(s) = slice {
                let device = device_of(s, &r.device).unwrap_or(&Value::Null);
                pinned |= s.pointer("/spec/nodeName").and_then(Value::as_str).is_some()
                    || device.get("bindsToNode").and_then(Value::as_bool) == Some(true);
                for f in ["bindingConditions", "bindingFailureConditions"] {
                    if let Some(c) = device.get(f).filter(|c| c.as_array().is_some_and(|a| !a.is_empty())) {
                        v[f] = c.clone();
                        waits = true;
                    }
                }
            }
            v
        })
        .collect();
    let mut allocation = json!({"devices": {"results": out}});
    if pinned {
        allocation["nodeSelector"] = json!({"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}
        ]}]});
    }
    if waits {
        allocation["allocationTimestamp"] = support::time::now_rfc3339().into();
    }
    allocation
}

/// Copies the claim's `spec.devices.config` into `allocation` as the
/// allocator's "Populate configs" step does
/// (k8s.io/dynamic-resource-allocation `structured/internal/stable/allocator_stable.go`):
/// each entry with `source: FromClaim` and the same requests and configuration,
/// after the classes' (this stand-in's classes carry none).
pub fn copy_claim_config(allocation: &mut Value, claim: &Value) {
    let Some(configs) = claim
        .pointer("/spec/devices/config")
        .and_then(Value::as_array)
    else {
        return;
    };
    let copied: Vec<Value> = configs
        .iter()
        .map(|c| {
            let mut c = c.clone();
            c["source"] = json!("FromClaim");
            c
        })
        .collect();
    allocation["devices"]["config"] = copied.into();
}

fn device_of<'s>(slice: &'s Value, name: &str) -> Option<&'s Value> {
    slice
        .pointer("/spec/devices")?
        .as_array()?
        .iter()
        .find(|d| d.get("name").and_then(Value::as_str) == Some(name))
}

/// What PreBind makes of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Binding {
    /// Every binding condition is `True` (or there are none).
    Ready,
    /// A failure condition is `True`: the error PreBind returns.
    Failed(String),
    /// Not yet.
    Waiting,
}

/// `isClaimReadyForBinding`.
pub fn binding(claim: &Value) -> Binding {
    let Some(results) = claim
        .pointer("/status/allocation/devices/results")
        .and_then(Value::as_array)
    else {
        return Binding::Waiting;
    };
    let name = claim
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    let strings = |v: &Value, f: &str| -> Vec<String> {
        v.get(f)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    for r in results {
        let conditions = strings(r, "bindingConditions");
        if conditions.is_empty() {
            continue;
        }
        // getAllocatedDeviceStatus: driver, pool and device (not shareID).
        let status = claim
            .pointer("/status/devices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find(|d| {
                ["driver", "pool", "device"]
                    .iter()
                    .all(|k| d.get(*k) == r.get(*k))
            });
        let Some(status) = status else {
            return Binding::Waiting;
        };
        let find = |kind: &str| {
            status
                .get("conditions")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .find(|c| c.get("type").and_then(Value::as_str) == Some(kind))
                .cloned()
        };
        for f in strings(r, "bindingFailureConditions") {
            if let Some(c) = find(&f).filter(|c| c["status"] == "True") {
                return Binding::Failed(format!(
                    "claim {name} binding failed: reason={}, message={:?}",
                    c["reason"].as_str().unwrap_or(""),
                    c["message"].as_str().unwrap_or("")
                ));
            }
        }
        if !conditions
            .iter()
            .all(|c| find(c).is_some_and(|c| c["status"] == "True"))
        {
            return Binding::Waiting;
        }
    }
    Binding::Ready
}

/// The claim as PostFilter leaves it after a failed binding: no reservation, no
/// allocation, no device status.
pub fn deallocate(claim: &mut Value) {
    if let Some(status) = claim.get_mut("status").and_then(Value::as_object_mut) {
        for f in ["reservedFor", "allocation", "devices"] {
            status.remove(f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(bind: bool) -> Value {
        let mut d = json!({"name": "gpu-0"});
        if bind {
            d["bindingConditions"] = json!(["d/Ready"]);
            d["bindingFailureConditions"] = json!(["d/Failed"]);
            d["bindsToNode"] = json!(true);
        }
        json!({"spec": {"driver": "d", "nodeName": "n", "pool": {"name": "n"}, "devices": [d]}})
    }

    fn claimed(bind: bool, devices: Value) -> Value {
        let r = [DeviceResult::new("r", "d", "n", "gpu-0")];
        json!({"metadata": {"name": "c"}, "status": {"allocation": allocation(&r, &[slice(bind)], "n"), "devices": devices}})
    }

    fn cond(kind: &str, status: &str) -> Value {
        json!([{"driver": "d", "pool": "n", "device": "gpu-0", "conditions": [
            {"type": kind, "status": status, "reason": "Why", "message": "said"}]}])
    }

    #[test]
    fn a_claim_without_binding_conditions_is_ready_at_once() {
        let c = claimed(false, Value::Null);
        assert!(c
            .pointer("/status/allocation/allocationTimestamp")
            .is_none());
        assert_eq!(binding(&c), Binding::Ready);
    }

    #[test]
    fn binding_waits_for_the_condition_and_fails_on_the_failure_one() {
        let c = claimed(true, Value::Null);
        assert!(c
            .pointer("/status/allocation/allocationTimestamp")
            .is_some());
        assert_eq!(
            c.pointer("/status/allocation/devices/results/0/bindingConditions"),
            Some(&json!(["d/Ready"]))
        );
        assert_eq!(binding(&c), Binding::Waiting);
        assert_eq!(
            binding(&claimed(true, cond("d/Ready", "False"))),
            Binding::Waiting
        );
        assert_eq!(
            binding(&claimed(true, cond("d/Ready", "True"))),
            Binding::Ready
        );
        let Binding::Failed(why) = binding(&claimed(true, cond("d/Failed", "True"))) else {
            panic!("not failed");
        };
        assert_eq!(why, "claim c binding failed: reason=Why, message=\"said\"");
        let mut c = claimed(true, cond("d/Failed", "True"));
        deallocate(&mut c);
        assert_eq!(c["status"], json!({}));
    }
}
