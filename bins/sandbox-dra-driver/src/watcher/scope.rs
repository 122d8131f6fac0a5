//! Which claims the watcher watches (`--claim-watch`), and `auto`'s look at the
//! claim labeller's Lease that decides it.
//!
//! `auto` reads the Lease once, then watches it (one object, by name): every
//! renewal of a live labeller is an event, so one that stopped is seen when its
//! Lease's duration has passed since its last renewal, and one that released
//! the Lease (a stop on SIGTERM) at once; a node then waits [`FALLBACK_GRACE`]
//! for a standby to take the Lease before it watches every claim. Nothing is
//! polled, and a failover sends no node to relist every claim. The bounds this
//! gives, measured: docs/sandbox-dra-driver.md ("The labeller down").

use std::time::{Duration, Instant};

use claim_label::lease::{holder_expiry, Observer, Record};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::GetParams;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use tokio_stream::StreamExt;

/// The longest a node waits for news of the labeller's Lease before reading it
/// again, should its watch be stuck; the watch is what notices changes.
pub const LABELLER_CHECK: Duration = Duration::from_secs(60);

/// Which claims a node's driver watches (`--claim-watch`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ClaimWatch {
    /// Those labelled for this node while the claim labeller holds and renews
    /// its Lease; every claim while it does not (not installed, stopped, or
    /// between two leaders for longer than the Lease's duration).
    Auto,
    /// Only those labelled for this node: each claim change reaches one node,
    /// and early moves wait while no labeller runs.
    Labelled,
    /// Every claim of the cluster: each claim change reaches every node.
    All,
}

/// Where the labeller's Lease is.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct LeaseRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for LeaseRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The claims one watch gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scope {
    /// Every claim: a list is the whole truth.
    All,
    /// Those labelled for this node: a claim missing from a list may only be
    /// unlabelled yet.
    Labelled,
}

/// `--claim-watch=auto`'s look at the labeller.
pub(super) struct Labeller {
    reader: LeaseReader,
    /// The Lease's namespace, for its watch.
    watch_api: Api<Lease>,
    lease: LeaseRef,
    /// The scope the last look chose.
    scope: Option<Scope>,
    /// The last read failed (said once until one succeeds).
    failing: bool,
}

impl Labeller {
    /// Reads `lease` with `client`, and watches it with `watch_client`.
    pub(super) fn new(client: kube::Client, watch_client: kube::Client, lease: LeaseRef) -> Self {
        let api: Api<Lease> = Api::namespaced(client, &lease.namespace);
        Self {
            reader: LeaseReader::new(api, &lease.name),
            watch_api: Api::namespaced(watch_client, &lease.namespace),
            lease,
            scope: None,
            failing: false,
        }
    }

    /// Reads the Lease and chooses the scope: labelled while a labeller holds and
    /// renews it, every claim otherwise. A read that fails keeps the scope (every
    /// claim at the first look), saying so once.
    pub(super) async fn look(&mut self) -> Scope {
        let live = match self.reader.holder_live().await {
            Ok(live) => {
                self.failing = false;
                Some(live)
            }
            Err(e) => {
                self.failed(&e);
                None
            }
        };
        self.choose(live)
    }

    /// A read or watch of the Lease failed: said once until one succeeds.
    fn failed(&mut self, e: &dyn std::error::Error) {
        if !self.failing {
            tracing::warn!(lease = %self.lease, error = %support::error_chain(e),
                "cannot read the claim labeller's Lease; keeping the claim watch as it \
                    is");
        }
        self.failing = true;
    }

    /// The scope for what is known of the labeller (`None`: nothing new), said
    /// when it changes.
    fn choose(&mut self, live: Option<bool>) -> Scope {
        let scope = match (live, self.scope) {
            (Some(true), _) => Scope::Labelled,
            (Some(false), _) | (None, None) => Scope::All,
            (None, Some(kept)) => kept,
        };
        self.set_scope(scope)
    }

    /// Takes `scope`, said when it changes.
    fn set_scope(&mut self, scope: Scope) -> Scope {
        if self.scope != Some(scope) {
            match scope {
                Scope::Labelled => {
                    tracing::info!(lease = %self.lease, "the claim labeller holds its \
                        Lease: watching only the ResourceClaims labelled for this node")
                }
                Scope::All => {
                    tracing::info!(lease = %self.lease, "no claim labeller holds and \
                        renews its Lease: watching every ResourceClaim")
                }
            }
        }
        self.scope = Some(scope);
        scope
    }

    /// Watches the Lease until the scope is no longer `scope`: on each change of
    /// it, and when a live holder's time runs out (see the module doc). A watch
    /// that stays silent for [`LABELLER_CHECK`] is helped by a read.
    pub(super) async fn until_changed(&mut self, scope: Scope) {
        let config = node_agent::cluster::watch_config()
            .fields(&format!("metadata.name={}", self.lease.name));
        let stream = watcher::watcher(self.watch_api.clone(), config).default_backoff();
        tokio::pin!(stream);
        // Since when no labeller has held the Lease, as this node saw it.
        let mut gone_since: Option<Instant> = None;
        loop {
            let wake_at = match gone_since {
                Some(gone) => Some(gone + FALLBACK_GRACE),
                None => self.reader.expiry(),
            };
            let wake = async {
                match wake_at {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            let read = tokio::select! {
                event = stream.next() => match event {
                    Some(Ok(Event::Apply(lease) | Event::InitApply(lease))) => {
                        self.reader.observe(Some(&lease));
                        true
                    }
                    Some(Ok(Event::Delete(_))) => {
                        self.reader.observe(None);
                        true
                    }
                    Some(Ok(Event::Init | Event::InitDone)) => continue,
                    Some(Err(e)) => {
                        self.failed(&e);
                        false
                    }
                    None => return,
                },
                () = wake => true,
                () = tokio::time::sleep(LABELLER_CHECK) => match self.reader.holder_live().await {
                    Ok(_) => true,
                    Err(e) => {
                        self.failed(&e);
                        false
                    }
                },
            };
            if !read {
                continue; // what is known stays: so does the scope
            }
            self.failing = false;
            let now = Instant::now();
            let live = self.reader.live();
            gone_since = if live {
                None
            } else {
                Some(gone_since.unwrap_or(now))
            };
            if self.set_scope(wanted(scope, live, gone_since, now)) != scope {
                return;
            }
        }
    }
}

/// How long a node that watches the labelled claims waits, once no labeller holds
/// the Lease (its time ran out, or it was released), for a standby to take it
/// before it watches every claim: a standby tries every 2 s, so a failover never
/// sends every node to relist every claim, and a labeller that is gone for good
/// is given up this long after its Lease ended.
pub const FALLBACK_GRACE: Duration = Duration::from_secs(5);

/// The scope a node wants, watching in `scope`, when the labeller is `live` or
/// has been gone since `gone_since`: labelled while one is live; every claim once
/// none has been for [`FALLBACK_GRACE`] (at once when every claim is watched
/// already).
fn wanted(scope: Scope, live: bool, gone_since: Option<Instant>, now: Instant) -> Scope {
    match (live, scope, gone_since) {
        (true, _, _) => Scope::Labelled,
        (false, Scope::Labelled, Some(gone)) if gone + FALLBACK_GRACE > now => Scope::Labelled,
        (false, _, _) => Scope::All,
    }
}

/// A node's look at the labeller's Lease.
struct LeaseReader {
    api: Api<Lease>,
    name: String,
    observer: Observer,
    /// When the holder last observed stops being live, if it is.
    expiry: Option<Instant>,
}

impl LeaseReader {
    /// Reads Lease `name` of `api`'s namespace.
    fn new(api: Api<Lease>, name: &str) -> Self {
        Self {
            api,
            name: name.to_owned(),
            observer: Observer::default(),
            expiry: None,
        }
    }

    /// Whether a labeller holds the Lease and renews it ([`holder_live`]). Read
    /// from the API server's cache (`resourceVersion=0`).
    async fn holder_live(&mut self) -> Result<bool, kube::Error> {
        let lease = match self.api.get_with(&self.name, &GetParams::any()).await {
            Ok(l) => Some(l),
            Err(kube::Error::Api(s)) if s.code == 404 => None,
            Err(e) => return Err(e),
        };
        self.observe(lease.as_ref());
        Ok(self.live())
    }

    /// Takes the Lease as read or watched now (`None`: there is none).
    fn observe(&mut self, lease: Option<&Lease>) {
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
    fn live(&self) -> bool {
        self.expiry.is_some_and(|e| e > Instant::now())
    }

    /// When the holder's time runs out unless the Lease changes again; `None`
    /// when it is not live.
    fn expiry(&self) -> Option<Instant> {
        self.expiry
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_falls_back_only_after_the_grace_and_comes_back_at_once() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert_eq!(wanted(Scope::Labelled, true, None, t0), Scope::Labelled);
        assert_eq!(wanted(Scope::All, true, None, t0), Scope::Labelled);
        // Gone: a standby may still take over within the grace.
        assert_eq!(
            wanted(Scope::Labelled, false, Some(t0), t0 + s(4)),
            Scope::Labelled
        );
        assert_eq!(
            wanted(Scope::Labelled, false, Some(t0), t0 + s(5)),
            Scope::All
        );
        assert_eq!(wanted(Scope::All, false, Some(t0), t0), Scope::All);
        assert_eq!(wanted(Scope::All, false, None, t0), Scope::All);
    }
}
