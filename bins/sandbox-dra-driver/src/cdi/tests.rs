use super::*;

#[test]
fn names_follow_their_kubernetes_grammar() {
    assert!(check_label("x", "a").is_ok());
    assert!(check_label("x", &"a".repeat(63)).is_ok());
    for bad in ["", "-a", "a-", "A", "a.b", "a_b", "..", &"a".repeat(64)] {
        assert!(check_label("x", bad).is_err(), "{bad:?}");
    }
    assert!(check_subdomain("x", "vfio-sandbox.rebellions.ai", 63).is_ok());
    for bad in ["", ".", "a.", ".a", "a..b", "a/b"] {
        assert!(check_subdomain("x", bad, 253).is_err(), "{bad:?}");
    }
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
