use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use claim_label::lease::TIMING;

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
