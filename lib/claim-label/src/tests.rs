use super::*;

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
        selector(DEFAULT_DRIVER_NAME, "node-a"),
        "vfio-sandbox.rebellions.ai/node=node-a"
    );
}

#[test]
fn the_conditions_are_qualified_by_the_driver_name() {
    assert_eq!(
        ready_condition(DEFAULT_DRIVER_NAME),
        "vfio-sandbox.rebellions.ai/VfioReady"
    );
    assert_eq!(
        failed_condition("x.example.com"),
        "x.example.com/VfioFailed"
    );
}
