use super::*;

#[test]
fn merge_patch_follows_rfc_7386() {
    let mut v = json!({"a": {"b": 1, "c": 2}, "d": [1]});
    merge_patch(&mut v, &json!({"a": {"b": null, "e": 3}, "d": [2]}));
    assert_eq!(v, json!({"a": {"c": 2, "e": 3}, "d": [2]}));
}

#[test]
fn device_conditions_match_each_result_by_driver_pool_and_device() {
    let r = [
        objects::DeviceResult::new("a", "d", "n", "gpu-0"),
        objects::DeviceResult::new("b", "d", "n", "gpu-1"),
    ];
    let waits = objects::Waits {
        ready: "d/Ready",
        failed: "d/Failed",
    };
    let allocation = objects::allocation(&r, "n", Some(waits));
    assert_eq!(
        allocation["devices"]["results"][1]["bindingConditions"],
        json!(["d/Ready"])
    );
    assert!(allocation["allocationTimestamp"].is_string());
    assert!(objects::allocation(&r, "n", None)
        .get("allocationTimestamp")
        .is_none());
    let entry = |device: &str, kind: &str, status: &str| {
        json!({"driver": "d", "pool": "n", "device": device, "conditions": [
            {"type": kind, "status": status, "reason": "Why", "message": "said"}]})
    };
    let mut claim = json!({"status": {"allocation": allocation, "devices": [entry("gpu-0", "d/Ready", "True")]}});
    assert!(
        !objects::condition_true_on_all(&claim, "d/Ready"),
        "gpu-1 has no entry"
    );
    claim["status"]["devices"] = json!([
        entry("gpu-0", "d/Ready", "True"),
        entry("gpu-1", "d/Ready", "True")
    ]);
    assert!(objects::condition_true_on_all(&claim, "d/Ready"));
    assert_eq!(objects::condition_true_on_any(&claim, "d/Failed"), None);
    claim["status"]["devices"][1] = entry("gpu-1", "d/Failed", "True");
    assert_eq!(
        objects::condition_true_on_any(&claim, "d/Failed").as_deref(),
        Some("reason=Why, message=\"said\"")
    );
    objects::deallocate(&mut claim);
    assert_eq!(claim["status"], json!({}));
    assert!(!objects::condition_true_on_all(&claim, "d/Ready"));
}
