use super::*;

#[test]
fn merge_patch_follows_rfc_7386() {
    let mut v = json!({"a": {"b": 1, "c": 2}, "d": [1]});
    merge_patch(&mut v, &json!({"a": {"b": null, "e": 3}, "d": [2]}));
    assert_eq!(v, json!({"a": {"c": 2, "e": 3}, "d": [2]}));
}

#[test]
fn timestamps_are_rfc3339_utc() {
    assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    assert_eq!(rfc3339(1_735_689_599), "2024-12-31T23:59:59Z");
}
