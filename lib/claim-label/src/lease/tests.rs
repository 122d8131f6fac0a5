use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::*;

fn record(holder: &str, renewed: Timestamp, transitions: i32) -> Record {
    Record {
        holder: holder.to_owned(),
        duration_seconds: 15,
        acquire_time: Some(MicroTime(renewed)),
        renew_time: Some(MicroTime(renewed)),
        transitions,
    }
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn the_observer_keeps_the_time_of_the_last_change() {
    let t0 = Instant::now();
    let mut o = Observer::default();
    let r1 = record("b", Timestamp::now(), 0);
    assert_eq!(
        o.observe(&r1, t0),
        Seen {
            changed_at: t0,
            first: true
        }
    );
    assert_eq!(
        o.observe(&r1, t0 + secs(5)),
        Seen {
            changed_at: t0,
            first: false
        }
    );
    let r2 = record("b", Timestamp::now() + SignedDuration::from_secs(2), 0);
    assert_eq!(
        o.observe(&r2, t0 + secs(7)),
        Seen {
            changed_at: t0 + secs(7),
            first: false
        }
    );
    o.forget();
    assert!(o.observe(&r2, t0 + secs(8)).first);
}

#[test]
fn a_node_sees_a_renewing_holder_live_and_a_silent_one_dead_after_its_duration() {
    let t0 = Instant::now();
    let wall = Timestamp::now();
    let r = record("controller-0", wall, 0);
    let later = Seen {
        changed_at: t0,
        first: false,
    };
    assert!(holder_live(Some(&r), later, t0 + secs(14), wall));
    assert!(!holder_live(Some(&r), later, t0 + secs(16), wall));
}

#[test]
fn a_node_judges_its_first_look_by_the_renewal_time() {
    let t0 = Instant::now();
    let wall = Timestamp::now();
    let first = Seen {
        changed_at: t0,
        first: true,
    };
    let fresh = record("c", wall - SignedDuration::from_secs(3), 0);
    assert!(holder_live(Some(&fresh), first, t0, wall));
    let stale = record("c", wall - SignedDuration::from_secs(60), 0);
    assert!(!holder_live(Some(&stale), first, t0, wall));
    let mut never = fresh.clone();
    never.renew_time = None;
    assert!(!holder_live(Some(&never), first, t0, wall));
}

#[test]
fn no_lease_or_a_released_one_is_no_live_holder() {
    let t0 = Instant::now();
    let wall = Timestamp::now();
    let seen = Seen {
        changed_at: t0,
        first: false,
    };
    assert!(!holder_live(None, seen, t0, wall));
    assert!(!holder_live(Some(&record("", wall, 1)), seen, t0, wall));
}
