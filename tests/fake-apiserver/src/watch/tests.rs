#![allow(clippy::unwrap_used)]

use super::*;

#[test]
fn resource_versions_parse_like_the_versioner() {
    assert_eq!(parse_resource_version(""), Ok(0));
    assert_eq!(parse_resource_version("0"), Ok(0));
    assert_eq!(parse_resource_version("42"), Ok(42));
    let e = parse_resource_version("abc").unwrap_err();
    assert!(e.contains("parsing \"abc\": invalid syntax"), "{e}");
    assert!(parse_resource_version("-1").is_err());
}

#[test]
fn bookmarks_come_each_period_and_once_before_the_deadline() {
    let now = Instant::now();
    let p = Duration::from_secs(5);
    assert_eq!(
        next_bookmark(now, p, now + Duration::from_secs(60)),
        Some(now + p)
    );
    let d = now + Duration::from_secs(4);
    assert_eq!(next_bookmark(now, p, d), Some(d - Duration::from_secs(2)));
    assert_eq!(next_bookmark(now, p, now + Duration::from_secs(1)), None);
}
