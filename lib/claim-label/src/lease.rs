//! The claim labeller's `coordination.k8s.io/v1` Lease: its name, its timing,
//! and how whoever reads it judges whether its holder is alive.
//!
//! The labeller's replicas elect a leader through it the way client-go's
//! `leaderelection` package does; the nodes read it to learn whether a labeller
//! runs (`--claim-watch=auto`). Both judge a holder by the local monotonic clock:
//! the time since this reader last saw the Lease's record change ([`Observer`]),
//! never the holder's own `renewTime` against the local wall clock, so a clock
//! skew between machines can neither hand a live leader's Lease to a second
//! replica nor make a node give up on a live labeller. Only a first look, with no
//! history yet, reads `renewTime` ([`holder_expiry`]).
//!
//! Upstream: client-go `tools/leaderelection/leaderelection.go`
//! (`tryAcquireOrRenew`, `release`; defaults 15 s / 10 s / 2 s).

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;

/// The Lease's name unless told otherwise, in the labeller's namespace (the
/// labeller's `--lease`, the node driver's `--labeller-lease`).
pub const LEASE_NAME: &str = "sandbox-dra-controller";

/// How long a Lease holds, how long a leader tries to renew before it stops
/// acting, and how often it renews (and a standby tries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// `leaseDurationSeconds`: how long after its last renewal a Lease is the
    /// holder's.
    pub duration: Duration,
    /// A leader whose renewals failed this long stops acting (below `duration`).
    pub renew_deadline: Duration,
    /// The pause between two tries.
    pub retry: Duration,
}

/// client-go's defaults, which kube-controller-manager and kube-scheduler use.
pub const TIMING: Timing = Timing {
    duration: Duration::from_secs(15),
    renew_deadline: Duration::from_secs(10),
    retry: Duration::from_secs(2),
};

/// The parts of a Lease's spec that say who holds it: a change in any of them
/// is a sign of the holder's life.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Record {
    /// `holderIdentity` (empty: released).
    pub holder: String,
    /// `leaseDurationSeconds`.
    pub duration_seconds: i32,
    /// `acquireTime`.
    pub acquire_time: Option<MicroTime>,
    /// `renewTime`.
    pub renew_time: Option<MicroTime>,
    /// `leaseTransitions`.
    pub transitions: i32,
}

impl Record {
    /// The record of `lease` (an empty one for a Lease without a spec).
    pub fn of(lease: &Lease) -> Self {
        let spec = lease.spec.clone().unwrap_or_default();
        Self {
            holder: spec.holder_identity.unwrap_or_default(),
            duration_seconds: spec.lease_duration_seconds.unwrap_or_default(),
            acquire_time: spec.acquire_time,
            renew_time: spec.renew_time,
            transitions: spec.lease_transitions.unwrap_or_default(),
        }
    }

    /// The Lease spec that writes this record.
    pub fn spec(&self) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.holder.clone()),
            lease_duration_seconds: Some(self.duration_seconds),
            acquire_time: self.acquire_time.clone(),
            renew_time: self.renew_time.clone(),
            lease_transitions: Some(self.transitions),
            ..LeaseSpec::default()
        }
    }
}

/// When this replica last saw a Lease's record change, by its own monotonic clock.
#[derive(Debug, Default)]
pub struct Observer {
    last: Option<(Record, Instant)>,
}

/// What one look at a Lease told an [`Observer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// When the record was last seen to change (now, if it just did).
    pub changed_at: Instant,
    /// This was the first look (so `changed_at` says nothing about the holder).
    pub first: bool,
}

impl Observer {
    /// Notes `record` as read at `now`.
    pub fn observe(&mut self, record: &Record, now: Instant) -> Seen {
        match &self.last {
            Some((last, at)) if last == record => Seen {
                changed_at: *at,
                first: false,
            },
            previous => {
                let first = previous.is_none();
                self.last = Some((record.clone(), now));
                Seen {
                    changed_at: now,
                    first,
                }
            }
        }
    }

    /// The holder of the record last seen (empty: released), if any was.
    pub fn holder(&self) -> Option<&str> {
        self.last.as_ref().map(|(r, _)| r.holder.as_str())
    }

    /// Forgets what was seen (the Lease is gone).
    pub fn forget(&mut self) {
        self.last = None;
    }
}

/// Whether the record says a holder is alive, as a node sees it: someone holds
/// it, and it changed within its duration. On the first look there is no
/// history, so the holder's `renewTime` is compared with the local wall clock
/// `wall` instead; a skewed clock can only delay the right answer by one
/// duration, since later looks judge by the record's changes.
pub fn holder_live(record: Option<&Record>, seen: Seen, now: Instant, wall: Timestamp) -> bool {
    holder_expiry(record, seen, now, wall).is_some()
}

/// When a live holder's time runs out unless the record changes again (by the
/// local monotonic clock), as [`holder_live`] judges it; `None` when it is not
/// live.
pub fn holder_expiry(
    record: Option<&Record>,
    seen: Seen,
    now: Instant,
    wall: Timestamp,
) -> Option<Instant> {
    let record = record.filter(|r| !r.holder.is_empty())?;
    let lasts = Duration::from_secs(u64::try_from(record.duration_seconds).unwrap_or(0));
    let ends = if seen.first {
        let renewed = record.renew_time.as_ref()?;
        let lasts_ms = i64::try_from(lasts.as_millis()).unwrap_or(i64::MAX);
        let left_ms = renewed
            .0
            .as_millisecond()
            .saturating_add(lasts_ms)
            .saturating_sub(wall.as_millisecond());
        now + Duration::from_millis(u64::try_from(left_ms).ok().filter(|ms| *ms > 0)?)
    } else {
        seen.changed_at + lasts
    };
    (ends > now).then_some(ends)
}

#[cfg(test)]
mod tests;
