use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;

use super::*;

const DRIVER: &str = "vfio-sandbox.rebellions.ai";

/// A claim whose allocation holds `results` (`(driver, pool, with our
/// condition)`), labelled `label` if given.
fn claim(results: &[(&str, &str, bool)], label: Option<&str>) -> ResourceClaim {
    let results: Vec<_> = results
        .iter()
        .enumerate()
        .map(|(i, (driver, pool, waits))| {
            let mut r = json!({
                "request": "npu", "driver": driver, "pool": pool, "device": format!("pci-{i}"),
            });
            if *waits {
                r["bindingConditions"] = json!([format!("{driver}/VfioReady")]);
                r["bindingFailureConditions"] = json!([format!("{driver}/VfioFailed")]);
            }
            r
        })
        .collect();
    let mut c = json!({
        "metadata": {"name": "vm", "namespace": "ns", "uid": "u1", "resourceVersion": "7"},
        "spec": {},
    });
    if !results.is_empty() {
        c["status"] = json!({"allocation": {"devices": {"results": results}}});
    }
    if let Some(l) = label {
        c["metadata"]["labels"] = json!({ label_key(DRIVER): l });
    }
    serde_json::from_value(c).expect("a claim")
}

#[test]
fn a_short_node_name_is_its_own_label_value() {
    for name in [
        "node-a",
        "a",
        "worker-17.rack-3.example.com",
        &"n".repeat(63),
    ] {
        assert_eq!(label_value(name), name);
        assert!(valid_label_value(&label_value(name)));
    }
}

#[test]
fn a_long_node_name_is_cut_and_hashed_into_a_valid_value_no_plain_name_can_equal() {
    let long = format!("{}.example.com", "gpu-node-0123456789".repeat(4));
    assert!(long.len() > 63);
    let value = label_value(&long);
    assert!(valid_label_value(&value), "{value}");
    assert!(value.len() <= 63);
    assert!(value.starts_with(&long[..39]), "{value}");
    // `_` is not allowed in a node name: no node's own name is this value.
    assert!(value.contains('_'));
    // Stable: both sides compute the same value, every time.
    assert_eq!(label_value(&long), value);
    // Names that differ only past the kept prefix differ in the hash.
    let other = format!("{long}x");
    assert_ne!(label_value(&other), value);
    assert_eq!(value, label_value(&long.clone()));
}

#[test]
fn the_prefix_of_a_hashed_value_ends_with_a_letter_or_digit() {
    // 40th character a dot: cut back to the last alphanumeric.
    let name = format!("{}.{}", "a".repeat(39), "b".repeat(40));
    let value = label_value(&name);
    assert_eq!(&value[..40], &format!("{}_", "a".repeat(39)));
    assert!(valid_label_value(&value));
}

#[test]
fn a_pool_name_with_characters_no_label_takes_is_hashed_too() {
    let value = label_value("pool/with/slashes");
    assert!(valid_label_value(&value), "{value}");
    assert!(value.starts_with("pool_"), "{value}");
    let value = label_value("/only");
    assert!(valid_label_value(&value), "{value}");
    assert_eq!(value.len(), 16);
}

#[test]
fn the_hash_is_fnv1a_64() {
    // The published test vectors of FNV-1a 64.
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
}

#[test]
fn the_selector_names_the_key_and_the_value() {
    assert_eq!(
        selector(DRIVER, "node-a"),
        "vfio-sandbox.rebellions.ai/node=node-a"
    );
}

#[test]
fn a_claim_allocated_with_our_condition_is_labelled_with_its_node() {
    let c = claim(&[(DRIVER, "node-a", true), (DRIVER, "node-a", false)], None);
    assert_eq!(wanted_label(&c, DRIVER).as_deref(), Some("node-a"));
    assert_eq!(
        label_change(&c, DRIVER),
        Some(LabelChange::Set("node-a".into()))
    );
}

#[test]
fn a_claim_already_labelled_right_needs_nothing() {
    let c = claim(&[(DRIVER, "node-a", true)], Some("node-a"));
    assert_eq!(label_change(&c, DRIVER), None);
}

#[test]
fn a_claim_reallocated_to_another_node_is_relabelled() {
    let c = claim(&[(DRIVER, "node-b", true)], Some("node-a"));
    assert_eq!(
        label_change(&c, DRIVER),
        Some(LabelChange::Set("node-b".into()))
    );
}

#[test]
fn a_claim_that_lost_its_allocation_loses_its_label() {
    let c = claim(&[], Some("node-a"));
    assert_eq!(wanted_label(&c, DRIVER), None);
    assert_eq!(label_change(&c, DRIVER), Some(LabelChange::Remove));
}

#[test]
fn claims_the_nodes_do_not_act_on_early_are_not_labelled() {
    // Not allocated.
    assert_eq!(label_change(&claim(&[], None), DRIVER), None);
    // Allocated to our devices without the condition: moved at prepare.
    assert_eq!(
        label_change(&claim(&[(DRIVER, "node-a", false)], None), DRIVER),
        None
    );
    // Another driver's devices, with that driver's own condition.
    assert_eq!(
        label_change(&claim(&[("gpu.example.com", "node-a", true)], None), DRIVER),
        None
    );
    // Ours on two pools (no scheduler makes it; no node could prepare it).
    let two = claim(&[(DRIVER, "node-a", true), (DRIVER, "node-b", true)], None);
    assert_eq!(wanted_label(&two, DRIVER), None);
    // ... and a label such a claim has goes.
    let two = claim(
        &[(DRIVER, "node-a", true), (DRIVER, "node-b", true)],
        Some("node-a"),
    );
    assert_eq!(label_change(&two, DRIVER), Some(LabelChange::Remove));
}

#[test]
fn a_claim_of_a_long_named_node_is_labelled_with_the_hashed_value() {
    let long = "n".repeat(80);
    let c = claim(&[(DRIVER, &long, true)], None);
    assert_eq!(
        label_change(&c, DRIVER),
        Some(LabelChange::Set(label_value(&long)))
    );
    assert_eq!(
        selector(DRIVER, &long),
        format!("{}={}", label_key(DRIVER), label_value(&long))
    );
}

#[test]
fn the_patch_is_conditional_on_the_version_it_was_computed_from() {
    assert_eq!(
        label_patch(DRIVER, &LabelChange::Set("node-a".into()), "42"),
        json!({"metadata": {"resourceVersion": "42",
            "labels": {"vfio-sandbox.rebellions.ai/node": "node-a"}}})
    );
    assert_eq!(
        label_patch(DRIVER, &LabelChange::Remove, "43"),
        json!({"metadata": {"resourceVersion": "43",
            "labels": {"vfio-sandbox.rebellions.ai/node": null}}})
    );
}
