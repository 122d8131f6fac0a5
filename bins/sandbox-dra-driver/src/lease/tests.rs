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
fn no_lease_is_created_held_by_this_replica() {
    let (now, wall) = (Instant::now(), Timestamp::now());
    match step(None, now, now, wall, "a", TIMING) {
        Step::Create(r) => {
            assert_eq!(r.holder, "a");
            assert_eq!(r.duration_seconds, 15);
            assert_eq!(r.transitions, 0);
            assert_eq!(r.renew_time, Some(MicroTime(wall)));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn another_holders_lease_is_waited_on_until_it_stops_changing_for_its_duration() {
    let t0 = Instant::now();
    let wall = Timestamp::now();
    let held = record("b", wall, 3);
    // Seen changing at t0: b's for 15 s of this replica's clock.
    assert_eq!(
        step(Some(&held), t0, t0 + secs(14), wall, "a", TIMING),
        Step::Wait
    );
    match step(Some(&held), t0, t0 + secs(16), wall, "a", TIMING) {
        Step::Update(r) => {
            assert_eq!(r.holder, "a");
            assert_eq!(r.transitions, 4, "a change of holder is a transition");
            assert_eq!(r.acquire_time, Some(MicroTime(wall)));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_holders_renewal_time_is_not_compared_with_the_local_clock() {
    // b renewed "an hour ago" by its clock, but this replica just saw the
    // record change: b is alive (its clock is behind), so a waits.
    let t0 = Instant::now();
    let wall = Timestamp::now();
    let old = record("b", wall - SignedDuration::from_hours(1), 0);
    assert_eq!(step(Some(&old), t0, t0, wall, "a", TIMING), Step::Wait);
}

#[test]
fn the_holder_renews_keeping_its_acquire_time_and_transitions() {
    let t0 = Instant::now();
    let acquired = Timestamp::now() - SignedDuration::from_secs(60);
    let mine = record("a", acquired, 2);
    let wall = Timestamp::now();
    match step(Some(&mine), t0, t0, wall, "a", TIMING) {
        Step::Update(r) => {
            assert_eq!(r.acquire_time, Some(MicroTime(acquired)));
            assert_eq!(r.renew_time, Some(MicroTime(wall)));
            assert_eq!(r.transitions, 2);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_released_lease_is_taken_at_once() {
    let t0 = Instant::now();
    let mut released = record("", Timestamp::now(), 5);
    released.duration_seconds = 1;
    match step(Some(&released), t0, t0, Timestamp::now(), "a", TIMING) {
        Step::Update(r) => {
            assert_eq!(r.holder, "a");
            assert_eq!(r.transitions, 6);
        }
        other => panic!("{other:?}"),
    }
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
