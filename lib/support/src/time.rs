//! Wall-clock time: Unix seconds, and RFC 3339 as the API server writes it.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch now (0 for a clock set before it).
pub fn unix_now() -> i64 {
    unix_seconds(SystemTime::now())
}

/// Seconds since the Unix epoch at `t` (0 before it).
pub fn unix_seconds(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// `t` as RFC 3339 in UTC, to the second (`2025-01-31T12:00:00Z`), as the API
/// server writes timestamps.
pub fn rfc3339(t: SystemTime) -> String {
    let secs = unix_seconds(t);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's `civil_from_days`).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Now in RFC 3339 ([`rfc3339`]).
pub fn now_rfc3339() -> String {
    rfc3339(SystemTime::now())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates_are_rfc3339_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400 + 3661); // 2000-02-29
        assert_eq!(rfc3339(t), "2000-02-29T01:01:01Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_738_324_800);
        assert_eq!(rfc3339(t), "2025-01-31T12:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(4_107_542_399); // 2100-02-28T23:59:59
        assert_eq!(rfc3339(t), "2100-02-28T23:59:59Z");
        assert_eq!(unix_seconds(UNIX_EPOCH - Duration::from_secs(5)), 0);
    }
}
