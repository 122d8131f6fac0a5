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
        claim_label::selector(DRIVER, &long),
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
