//! Which claims the watcher watches (`--claim-watch`), and `auto`'s look at the
//! claim labeller's Lease that decides it.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

use crate::lease::LeaseReader;

/// How often `--claim-watch=auto` reads the labeller's Lease: a labeller that
/// stopped is noticed within its Lease's duration (15 s) and this.
pub const LABELLER_CHECK: Duration = Duration::from_secs(15);

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
pub struct LeaseRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
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
    lease: LeaseRef,
    /// The scope the last look chose.
    scope: Option<Scope>,
    /// The last read failed (said once until one succeeds).
    failing: bool,
}

impl Labeller {
    /// Reads `lease` with `client`.
    pub(super) fn new(client: kube::Client, lease: LeaseRef) -> Self {
        let api: Api<Lease> = Api::namespaced(client, &lease.namespace);
        Self {
            reader: LeaseReader::new(api, &lease.name),
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
                if !self.failing {
                    tracing::warn!(lease = %self.lease, error = %e, "cannot read the claim labeller's Lease; keeping the claim watch as it is");
                }
                self.failing = true;
                None
            }
        };
        let scope = match (live, self.scope) {
            (Some(true), _) => Scope::Labelled,
            (Some(false), _) | (None, None) => Scope::All,
            (None, Some(kept)) => kept,
        };
        if self.scope != Some(scope) {
            match scope {
                Scope::Labelled => {
                    tracing::info!(lease = %self.lease, "the claim labeller holds its Lease: watching only the ResourceClaims labelled for this node")
                }
                Scope::All => {
                    tracing::info!(lease = %self.lease, "no claim labeller holds and renews its Lease: watching every ResourceClaim")
                }
            }
        }
        self.scope = Some(scope);
        scope
    }

    /// Looks every [`LABELLER_CHECK`] until the scope is no longer `scope`.
    pub(super) async fn until_changed(&mut self, scope: Scope) {
        loop {
            tokio::time::sleep(LABELLER_CHECK).await;
            if self.look().await != scope {
                return;
            }
        }
    }
}
