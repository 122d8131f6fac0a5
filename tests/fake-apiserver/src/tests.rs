use super::*;

#[test]
fn merge_patch_follows_rfc_7386() {
    let mut v = json!({"a": {"b": 1, "c": 2}, "d": [1]});
    merge_patch(&mut v, &json!({"a": {"b": null, "e": 3}, "d": [2]}));
    assert_eq!(v, json!({"a": {"c": 2, "e": 3}, "d": [2]}));
}
