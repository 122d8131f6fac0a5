//! What the real server's ResourceSlice and ResourceClaim strategies and
//! validation do to the DRA fields a driver writes: device taints, binding
//! conditions and claim device status, each dropped as a server with its feature
//! gate off drops it.
//!
//! Upstream: `pkg/registry/resource/resourceslice/strategy.go`
//! (`dropDisabledFields`: taints without `DRADeviceTaints`;
//! `dropDisabledDRADeviceBindingConditionsFields`: `bindsToNode`,
//! `bindingConditions` and `bindingFailureConditions` unless both
//! `DRADeviceBindingConditions` and `DRAResourceClaimDeviceStatus` are on),
//! `pkg/registry/resource/resourceclaim/strategy.go`
//! (`dropDisabledDRAResourceClaimDeviceStatusFields`, `dropDeallocatedStatusDevices`)
//! and `pkg/apis/resource/validation/validation.go` (`validateDeviceStatus`,
//! `validateDeviceBindingParameters`).

use std::collections::BTreeSet;

use serde_json::Value;

/// Which DRA feature gates the server has off.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct DraGates {
    /// `DRADeviceTaints` off: slice device taints are dropped.
    pub no_device_taints: bool,
    /// `DRADeviceBindingConditions` off: slice binding fields are dropped.
    pub no_binding_conditions: bool,
    /// `DRAResourceClaimDeviceStatus` off: claim `status.devices` is dropped (and,
    /// as it is a precondition, slice binding fields too).
    pub no_claim_device_status: bool,
}

/// The ResourceSlice strategy on create and update.
pub(crate) fn slice_for_write(gates: DraGates, obj: &mut Value) {
    let Some(devices) = obj
        .pointer_mut("/spec/devices")
        .and_then(Value::as_array_mut)
    else {
        return;
    };
    for d in devices.iter_mut().filter_map(Value::as_object_mut) {
        if gates.no_binding_conditions || gates.no_claim_device_status {
            for f in [
                "bindsToNode",
                "bindingConditions",
                "bindingFailureConditions",
            ] {
                d.remove(f);
            }
        }
        if gates.no_device_taints {
            d.remove("taints");
            continue;
        }
        for t in d
            .get_mut("taints")
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
            .filter_map(Value::as_object_mut)
        {
            t.entry("timeAdded")
                .or_insert_with(|| crate::now_rfc3339().into());
        }
    }
}

/// `(driver, pool, device)` of each allocated device.
fn allocated(claim: &Value) -> BTreeSet<(String, String, String)> {
    claim
        .pointer("/status/allocation/devices/results")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|r| (text(r, "driver"), text(r, "pool"), text(r, "device")))
        .collect()
}

fn text(v: &Value, key: &str) -> String {
    v.get(key).and_then(Value::as_str).unwrap_or("").to_owned()
}

/// The ResourceClaim strategy and validation of `status.devices` on an update:
/// the field dropped with its gate off (unless the old claim used it), entries of
/// devices the update deallocated dropped, and what is left validated. `Err` is
/// the field error of a 422.
pub(crate) fn claim_for_write(gates: DraGates, old: &Value, new: &mut Value) -> Result<(), String> {
    let used = old
        .pointer("/status/devices")
        .and_then(Value::as_array)
        .is_some_and(|d| !d.is_empty());
    let Some(status) = new.get_mut("status").and_then(Value::as_object_mut) else {
        return Ok(());
    };
    if gates.no_claim_device_status && !used {
        status.remove("devices");
        return Ok(());
    }
    let before = allocated(old);
    let mut claim_now = Value::Null;
    claim_now["status"] = Value::Object(status.clone());
    let now = allocated(&claim_now);
    let Some(devices) = status.get_mut("devices").and_then(Value::as_array_mut) else {
        return Ok(());
    };
    // dropDeallocatedStatusDevices: what the old claim had allocated and this one
    // does not is gone with its allocation.
    devices.retain(|d| {
        let key = (text(d, "driver"), text(d, "pool"), text(d, "device"));
        !before.contains(&key) || now.contains(&key)
    });
    if devices.is_empty() {
        status.remove("devices");
        return Ok(());
    }
    let mut seen = BTreeSet::new();
    for (i, d) in devices.iter().enumerate() {
        let at = format!("status.devices[{i}]");
        let key = (text(d, "driver"), text(d, "pool"), text(d, "device"));
        let share = text(d, "shareID");
        if !now.contains(&key) {
            return Err(format!(
                "{at}: Invalid value: \"{}/{}/{}\": must be an allocated device in the claim",
                key.0, key.1, key.2
            ));
        }
        if !seen.insert((key.clone(), share)) {
            return Err(format!(
                "{at}: Duplicate value: \"{}/{}/{}\"",
                key.0, key.1, key.2
            ));
        }
        let conditions = d.get("conditions").and_then(Value::as_array);
        let conditions = conditions.map_or(&[][..], Vec::as_slice);
        if conditions.len() > 8 {
            return Err(format!(
                "{at}.conditions: Too many: {}: must have at most 8 items",
                conditions.len()
            ));
        }
        for (j, c) in conditions.iter().enumerate() {
            condition(c).map_err(|e| format!("{at}.conditions[{j}].{e}"))?;
        }
    }
    Ok(())
}

/// `ValidateCondition` of `k8s.io/apimachinery/pkg/apis/meta/v1/validation`.
fn condition(c: &Value) -> Result<(), String> {
    let kind = text(c, "type");
    qualified_name(&kind).map_err(|e| format!("type: Invalid value: \"{kind}\": {e}"))?;
    let status = text(c, "status");
    if !["True", "False", "Unknown"].contains(&status.as_str()) {
        return Err(format!(
            "status: Unsupported value: \"{status}\": supported values: \"False\", \"True\", \"Unknown\""
        ));
    }
    if c.get("lastTransitionTime")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        return Err("lastTransitionTime: Required value: must be set".into());
    }
    let reason = text(c, "reason");
    let ok = |ch: char| ch.is_ascii_alphanumeric() || "_,:".contains(ch);
    let reason_ok = reason.len() <= 1024
        && reason.starts_with(|ch: char| ch.is_ascii_alphabetic())
        && reason.chars().all(ok)
        && !reason.ends_with([',', ':']);
    if !reason_ok {
        return Err(format!(
            "reason: Invalid value: \"{reason}\": a condition reason must start with alphabetic character, optionally followed by a string of alphanumeric characters or '_,:', and must end with an alphanumeric character or '_'"
        ));
    }
    if text(c, "message").len() > 32768 {
        return Err("message: Too long: may not be more than 32768 bytes".into());
    }
    Ok(())
}

/// A qualified name (`[prefix/]name`): a DNS subdomain prefix, a name of at most
/// 63 characters of `[A-Za-z0-9_.-]` starting and ending alphanumeric.
fn qualified_name(s: &str) -> Result<(), String> {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    if let Some(p) = prefix {
        if p.is_empty() {
            return Err("prefix part must be non-empty".into());
        }
        super::dns_subdomain(p).map_err(|e| format!("prefix part {e}"))?;
    }
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    let ok = name.len() <= 63
        && alnum(name.chars().next())
        && alnum(name.chars().last())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if ok {
        Ok(())
    } else {
        Err("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character, at most 63 characters".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(results: &[&str], devices: Value) -> Value {
        let results: Vec<Value> = results
            .iter()
            .map(|d| json!({"request": "r", "driver": "d.example.com", "pool": "p", "device": d}))
            .collect();
        json!({"status": {"allocation": {"devices": {"results": results}}, "devices": devices}})
    }

    fn entry(device: &str, cond: Value) -> Value {
        json!({"driver": "d.example.com", "pool": "p", "device": device, "conditions": [cond]})
    }

    fn ready() -> Value {
        json!({"type": "d.example.com/Ready", "status": "True", "reason": "Moved", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"})
    }

    #[test]
    fn device_status_must_name_an_allocated_device() {
        let old = claim(&["a"], Value::Null);
        let mut new = claim(&["a"], json!([entry("b", ready())]));
        let e = claim_for_write(DraGates::default(), &old, &mut new).unwrap_err();
        assert!(
            e.contains("must be an allocated device in the claim"),
            "{e}"
        );
        let mut new = claim(&["a"], json!([entry("a", ready())]));
        claim_for_write(DraGates::default(), &old, &mut new).unwrap();
        assert_eq!(new["status"]["devices"][0]["device"], "a");
    }

    #[test]
    fn conditions_are_validated() {
        let old = claim(&["a"], Value::Null);
        for (bad, field) in [
            (
                json!({"type": "no/", "status": "True", "reason": "R", "lastTransitionTime": "t"}),
                "type",
            ),
            (
                json!({"type": "T", "status": "Yes", "reason": "R", "lastTransitionTime": "t"}),
                "status",
            ),
            (
                json!({"type": "T", "status": "True", "reason": "R"}),
                "lastTransitionTime",
            ),
            (
                json!({"type": "T", "status": "True", "reason": "1R", "lastTransitionTime": "t"}),
                "reason",
            ),
        ] {
            let mut new = claim(&["a"], json!([entry("a", bad)]));
            let e = claim_for_write(DraGates::default(), &old, &mut new).unwrap_err();
            assert!(e.contains(&format!("conditions[0].{field}")), "{e}");
        }
    }

    #[test]
    fn deallocation_drops_the_entries_of_its_devices() {
        let old = claim(&["a"], json!([entry("a", ready())]));
        let mut new = json!({"status": {"devices": [entry("a", ready())]}});
        claim_for_write(DraGates::default(), &old, &mut new).unwrap();
        assert!(new["status"].get("devices").is_none(), "{new}");
    }

    #[test]
    fn a_server_without_the_gate_drops_device_status_unless_in_use() {
        let gates = DraGates {
            no_claim_device_status: true,
            ..DraGates::default()
        };
        let old = claim(&["a"], Value::Null);
        let mut new = claim(&["a"], json!([entry("a", ready())]));
        claim_for_write(gates, &old, &mut new).unwrap();
        assert!(new["status"].get("devices").is_none());
        let old = claim(&["a"], json!([entry("a", ready())]));
        let mut new = claim(&["a"], json!([entry("a", ready())]));
        claim_for_write(gates, &old, &mut new).unwrap();
        assert!(new["status"].get("devices").is_some());
    }

    #[test]
    fn binding_fields_need_both_gates() {
        let slice = json!({"spec": {"devices": [{"name": "x", "bindsToNode": true,
            "bindingConditions": ["d/Ready"], "bindingFailureConditions": ["d/Failed"]}]}});
        for (gates, kept) in [
            (DraGates::default(), true),
            (
                DraGates {
                    no_binding_conditions: true,
                    ..DraGates::default()
                },
                false,
            ),
            (
                DraGates {
                    no_claim_device_status: true,
                    ..DraGates::default()
                },
                false,
            ),
        ] {
            let mut s = slice.clone();
            slice_for_write(gates, &mut s);
            assert_eq!(
                s["spec"]["devices"][0].get("bindingConditions").is_some(),
                kept
            );
            assert_eq!(s["spec"]["devices"][0].get("bindsToNode").is_some(), kept);
        }
    }
}
