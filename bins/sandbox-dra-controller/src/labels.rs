//! The labeller's decision for one ResourceClaim: which node label it should
//! carry ([`wanted_label`]), the change that gives it that label
//! ([`label_change`]) and the patch that makes the change only to the version
//! it was decided from ([`label_patch`]). Pure functions of the claim; the key
//! and value are [`claim_label`]'s, which the nodes select with.

use claim_label::{label_key, label_value, ready_condition};
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};

/// The label value claim `claim` should carry: the node of its devices of
/// `driver` when at least one of them waits on the driver's binding condition
/// (the only claims a node acts on before prepare), `None` otherwise — not
/// allocated, allocated without the condition, or (never made by the scheduler:
/// node-local devices are allocated on one node) on more than one of the
/// driver's pools.
pub fn wanted_label(claim: &ResourceClaim, driver: &str) -> Option<String> {
    let ready = ready_condition(driver);
    let ours: Vec<_> = allocation_results(claim)
        .iter()
        .filter(|r| r.driver == driver)
        .collect();
    let waits = ours.iter().any(|r| {
        r.binding_conditions
            .as_ref()
            .is_some_and(|c| c.contains(&ready))
    });
    let pool = &ours.first()?.pool;
    if !waits || ours.iter().any(|r| &r.pool != pool) {
        return None;
    }
    Some(label_value(pool))
}

/// What the labeller does to one claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelChange {
    /// Set the label to this value.
    Set(String),
    /// Remove the label.
    Remove,
}

/// The change claim `claim` needs, if any: its label as [`wanted_label`] says,
/// compared with the one it has.
pub fn label_change(claim: &ResourceClaim, driver: &str) -> Option<LabelChange> {
    let key = label_key(driver);
    let have = claim
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(&key))
        .cloned();
    match (wanted_label(claim, driver), have) {
        (Some(want), Some(have)) if want == have => None,
        (Some(want), _) => Some(LabelChange::Set(want)),
        (None, Some(_)) => Some(LabelChange::Remove),
        (None, None) => None,
    }
}

/// The JSON merge patch that makes `change` to a claim seen at
/// `resource_version`: the API server applies it only to that version (a
/// newer one answers 409 Conflict), so a label is never computed from one
/// allocation and written over another.
pub fn label_patch(
    driver: &str,
    change: &LabelChange,
    resource_version: &str,
) -> serde_json::Value {
    let value = match change {
        LabelChange::Set(v) => serde_json::Value::from(v.as_str()),
        LabelChange::Remove => serde_json::Value::Null,
    };
    serde_json::json!({
        "metadata": {
            "resourceVersion": resource_version,
            "labels": { label_key(driver): value },
        }
    })
}

/// The device results of claim `claim`'s allocation (none when unallocated).
fn allocation_results(claim: &ResourceClaim) -> &[DeviceRequestAllocationResult] {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .unwrap_or(&[])
}

#[cfg(test)]
mod tests;
