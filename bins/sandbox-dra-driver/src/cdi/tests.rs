use super::*;

#[test]
fn names_follow_their_kubernetes_grammar() {
    // The grammar is claim_label::names' (tested there); the refusal names
    // what was checked and why.
    let e = check_subdomain("claim name", "Vm.1", 253).expect_err("uppercase");
    assert_eq!(
        e.to_string(),
        "invalid claim name \"Vm.1\": only a-z, 0-9, '-' and '.' are allowed"
    );
    assert!(check_label("request name", "a-").is_err());
    assert!(check_uid("0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a").is_ok());
    assert!(check_uid("A1").is_ok());
    assert_eq!(base_request("gpu/big").ok(), Some("gpu"));
    assert!(check_iommufd_node("vfio12").is_ok());
    assert!(check_iommufd_node("vfio12345678901").is_err());
}

#[test]
fn errors_show_long_values_cut() {
    let e = invalid("claim UID", &"x".repeat(300), "too long");
    let text = e.to_string();
    assert!(text.starts_with("invalid claim UID \"xxxx"), "{text}");
    assert!(text.ends_with("… (300 bytes): too long"), "{text}");
    assert!(text.len() < 120, "{text}");
}
