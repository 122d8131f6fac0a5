//! Leader election through a `coordination.k8s.io/v1` Lease, the way client-go's
//! `leaderelection` package does it, and the nodes' look at whether the claim
//! labeller holds its Lease.
//!
//! The API server's optimistic concurrency makes the election safe: a replica
//! takes or renews the Lease with an update conditional on the resourceVersion
//! it read, so of two replicas acting on one version only one succeeds. Whether
//! another holder's Lease has expired is judged, as client-go judges it, by the
//! local monotonic clock: the time since this replica last saw the Lease's record
//! change, never the holder's own `renewTime` against the local wall clock, so a
//! clock skew between machines cannot hand a live leader's Lease to a second
//! replica. A leader that cannot renew within [`Timing::renew_deadline`] (shorter
//! than the Lease's duration) stops acting before any other replica may take it.
//!
//! The decisions ([`Observer`], [`step`], [`holder_live`]) are pure functions of
//! what was read and when; [`Elector`] and [`LeaseReader`] do the requests.
//!
//! Upstream: client-go `tools/leaderelection/leaderelection.go`
//! (`tryAcquireOrRenew`, `release`; defaults 15 s / 10 s / 2 s).

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{GetParams, PostParams};
use kube::Api;

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

    fn spec(&self) -> LeaseSpec {
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

    /// Forgets what was seen (the Lease is gone).
    pub fn forget(&mut self) {
        self.last = None;
    }
}

/// What a replica does after reading the Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// There is no Lease: create it, held by this replica.
    Create(Record),
    /// Take it (or renew it) with this record, conditional on the version read.
    Update(Record),
    /// Another replica holds it and renewed it within its duration: wait.
    Wait,
}

/// client-go's `tryAcquireOrRenew`: what replica `me` does with the record
/// `current` (`None`: no Lease), last seen changing at `changed_at`; `now` is the
/// local monotonic clock, `wall` the time written into the record.
pub fn step(
    current: Option<&Record>,
    changed_at: Instant,
    now: Instant,
    wall: Timestamp,
    me: &str,
    timing: Timing,
) -> Step {
    let duration_seconds = i32::try_from(timing.duration.as_secs()).unwrap_or(i32::MAX);
    let Some(current) = current else {
        return Step::Create(Record {
            holder: me.to_owned(),
            duration_seconds,
            acquire_time: Some(MicroTime(wall)),
            renew_time: Some(MicroTime(wall)),
            transitions: 0,
        });
    };
    let held_by_other = !current.holder.is_empty() && current.holder != me;
    let lasts = Duration::from_secs(u64::try_from(current.duration_seconds).unwrap_or(0));
    if held_by_other && changed_at + lasts > now {
        return Step::Wait;
    }
    let mut next = Record {
        holder: me.to_owned(),
        duration_seconds,
        acquire_time: current.acquire_time.clone(),
        renew_time: Some(MicroTime(wall)),
        transitions: current.transitions,
    };
    if current.holder != me {
        next.acquire_time = Some(MicroTime(wall));
        next.transitions = current.transitions.saturating_add(1);
    }
    Step::Update(next)
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

/// A replica taking part in the election for one Lease.
pub struct Elector {
    api: Api<Lease>,
    name: String,
    me: String,
    timing: Timing,
    observer: Observer,
}

impl Elector {
    /// Replica `me` for Lease `name` of `api`'s namespace.
    pub fn new(api: Api<Lease>, name: &str, me: &str, timing: Timing) -> Self {
        Self {
            api,
            name: name.to_owned(),
            me: me.to_owned(),
            timing,
            observer: Observer::default(),
        }
    }

    /// The Lease's holder as last read (for the log).
    pub fn holder(&self) -> Option<&str> {
        self.observer.last.as_ref().map(|(r, _)| r.holder.as_str())
    }

    /// Reads the Lease and takes or renews it if [`step`] says so; true while
    /// this replica holds it. A conflict (another replica wrote first) is false.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool, kube::Error> {
        let lease = self.api.get_opt(&self.name).await?;
        let now = Instant::now();
        let record = lease.as_ref().map(Record::of);
        let changed_at = match &record {
            Some(r) => self.observer.observe(r, now).changed_at,
            None => {
                self.observer.forget();
                now
            }
        };
        let written = match step(
            record.as_ref(),
            changed_at,
            now,
            Timestamp::now(),
            &self.me,
            self.timing,
        ) {
            Step::Wait => return Ok(false),
            Step::Create(next) => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(next.spec()),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            Step::Update(next) => {
                let mut lease = lease.unwrap_or_default();
                lease.spec = Some(next.spec());
                self.api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await
            }
        };
        match written {
            Ok(lease) => {
                self.observer.observe(&Record::of(&lease), Instant::now());
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Gives the Lease up (holder emptied, duration 1 s), so a standby takes it
    /// at its next try instead of after the duration; only if this replica
    /// still holds it, conditional on the version read.
    pub async fn release(&mut self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        let record = Record::of(&lease);
        if record.holder != self.me {
            return Ok(());
        }
        let now = MicroTime(Timestamp::now());
        lease.spec = Some(
            Record {
                holder: String::new(),
                duration_seconds: 1,
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                transitions: record.transitions,
            }
            .spec(),
        );
        self.api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
            .map(|_| ())
    }
}

/// A node's look at the labeller's Lease.
pub struct LeaseReader {
    api: Api<Lease>,
    name: String,
    observer: Observer,
    /// When the holder last observed stops being live, if it is.
    expiry: Option<Instant>,
}

impl LeaseReader {
    /// Reads Lease `name` of `api`'s namespace.
    pub fn new(api: Api<Lease>, name: &str) -> Self {
        Self {
            api,
            name: name.to_owned(),
            observer: Observer::default(),
            expiry: None,
        }
    }

    /// Whether a labeller holds the Lease and renews it ([`holder_live`]). Read
    /// from the API server's cache (`resourceVersion=0`).
    pub async fn holder_live(&mut self) -> Result<bool, kube::Error> {
        let lease = match self.api.get_with(&self.name, &GetParams::any()).await {
            Ok(l) => Some(l),
            Err(kube::Error::Api(s)) if s.code == 404 => None,
            Err(e) => return Err(e),
        };
        self.observe(lease.as_ref());
        Ok(self.live())
    }

    /// Takes the Lease as read or watched now (`None`: there is none).
    pub fn observe(&mut self, lease: Option<&Lease>) {
        let now = Instant::now();
        let Some(record) = lease.map(Record::of) else {
            self.observer.forget();
            self.expiry = None;
            return;
        };
        let seen = self.observer.observe(&record, now);
        self.expiry = holder_expiry(Some(&record), seen, now, Timestamp::now());
    }

    /// Whether the holder, as last observed, is live now.
    pub fn live(&self) -> bool {
        self.expiry.is_some_and(|e| e > Instant::now())
    }

    /// When the holder's time runs out unless the Lease changes again; `None`
    /// when it is not live.
    pub fn expiry(&self) -> Option<Instant> {
        self.expiry
    }
}

#[cfg(test)]
mod tests;
