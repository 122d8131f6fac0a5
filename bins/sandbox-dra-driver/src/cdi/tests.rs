use super::*;

#[test]
fn names_follow_their_kubernetes_grammar() {
    assert!(check_label("x", "a").is_ok());
    assert!(check_label("x", &"a".repeat(63)).is_ok());
    for bad in ["", "-a", "a-", "A", "a.b", "a_b", "..", &"a".repeat(64)] {
        assert!(check_label("x", bad).is_err(), "{bad:?}");
    }
    assert!(check_subdomain("x", "vfio-sandbox.rebellions.ai", 63).is_ok());
    for bad in ["", ".", "a.", ".a", "a..b", "a/b", "A.b"] {
        assert!(check_subdomain("x", bad, 253).is_err(), "{bad:?}");
    }
    // Kubernetes bounds a subdomain's whole, not its labels (an object may be
    // named with 64 characters and no dot).
    assert!(check_subdomain("x", &"a".repeat(64), 253).is_ok());
    assert!(check_subdomain("x", &format!("{}.b", "a".repeat(200)), 253).is_ok());
    let why = |s: &str| match check_subdomain("x", s, 253) {
        Err(CdiError::InvalidName { reason, .. }) => reason,
        other => panic!("{s:?}: {other:?}"),
    };
    assert_eq!(
        why("Vfio.example"),
        "only a-z, 0-9, '-' and '.' are allowed"
    );
    assert_eq!(why("a..b"), "empty, or an empty part between dots");
    assert_eq!(
        why("a.-b"),
        "each part between dots must start and end with a-z or 0-9"
    );
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
