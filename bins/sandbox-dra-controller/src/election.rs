//! Leader election through the labeller's Lease, the way client-go's
//! `leaderelection` package does it.
//!
//! The API server's optimistic concurrency makes the election safe: a replica
//! takes or renews the Lease with an update conditional on the resourceVersion
//! it read, so of two replicas acting on one version only one succeeds. Whether
//! another holder's Lease has expired is judged by the time since this replica
//! last saw the Lease's record change ([`claim_label::lease::Observer`]). A
//! leader that cannot renew within [`Timing::renew_deadline`] (shorter than the
//! Lease's duration) stops acting before any other replica may take it.
//!
//! The decision ([`step`]) is a pure function of what was read and when;
//! [`Elector`] does the requests.
//!
//! Upstream: client-go `tools/leaderelection/leaderelection.go`
//! (`tryAcquireOrRenew`, `release`).

use std::time::{Duration, Instant};

use claim_label::lease::{Observer, Record, Timing};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::Api;

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
        self.observer.holder()
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

#[cfg(test)]
mod tests;
