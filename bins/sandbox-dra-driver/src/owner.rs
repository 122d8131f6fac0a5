//! Taking the node before any device moves: the node-wide owner lock
//! (`passthrough::owner`), shared with vfio-manager.
//!
//! While vfio-manager owns the node the driver recovers nothing and publishes no
//! ResourceSlice, but it serves kubelet, so a claim sent here gets an answer that
//! names the owner instead of a dial error: every prepare is refused with it. It
//! tries the lock again every `--owner-retry-interval`; once taken, the caller
//! recovers and starts as usual.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::programs::{DRA_DRIVER, VFIO_MANAGER};
use kubelet_plugin::{Answers, Claim, ClaimRef, KeptFields, Offer, Plugin, PreparedDevice};
use passthrough::owner::{Contender, Owner, OwnerError};
use support::error_chain;
use tokio::signal::unix::{signal, SignalKind};

use crate::claims::DriverError;
use crate::model::StateFile;

/// Takes the node's owner lock at `lock`. While vfio-manager owns the node, serves
/// kubelet through `plugin` with every prepare refused (see the module doc) and
/// tries again every `retry`. `None`: a stop signal came first. Another
/// sandbox-dra-driver holding the lock, or a lock that cannot be used, is an error.
pub async fn take_or_wait(
    lock: &Path,
    retry: Duration,
    plugin: &Plugin,
    state_file: &Path,
    manager_state: &Path,
) -> anyhow::Result<Option<Owner>> {
    let contender = Contender::new(&DRA_DRIVER, &VFIO_MANAGER, manager_state.to_owned());
    let refusal = match Owner::take(lock, &contender) {
        Ok(owner) => return Ok(Some(owner)),
        Err(e) if e.by_other_program() => error_chain(&e),
        Err(e) => return Err(e.into()),
    };
    tracing::error!(error = %refusal, retry = ?retry, "not moving any device, not \
        publishing ResourceSlices: every claim prepared here is refused until the node \
        is free");
    let refusing = Arc::new(Refusing {
        refusal: Mutex::new(refusal),
        state_file: state_file.to_owned(),
    });
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sighup = signal(SignalKind::hangup())?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = plugin.serve(refusing.clone(), async move {
        let _ = stop_rx.await;
    });
    tokio::pin!(serving);
    // `served` says the serving future completed: it is never polled again.
    let (result, served) = loop {
        tokio::select! {
            _ = sigterm.recv() => break (Ok(None), false),
            _ = sigint.recv() => break (Ok(None), false),
            _ = sighup.recv() => break (Ok(None), false),
            r = &mut serving => break (Err(match r {
                Ok(()) => anyhow::anyhow!("the kubelet API server stopped"),
                Err(e) => e.into(),
            }), true),
            _ = tokio::time::sleep(retry) => match Owner::take(lock, &contender) {
                Ok(owner) => break (Ok(Some(owner)), false),
                Err(e) => refusing.still_refused(&e),
            },
        }
    };
    if matches!(result, Ok(None)) {
        tracing::info!("stopping; the node was never ours");
    }
    let _ = stop_tx.send(());
    if !served {
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut serving).await;
    }
    result
}

/// The kubelet service while the node is not ours.
struct Refusing {
    /// Why, as said to kubelet: the owner's refusal, current.
    refusal: Mutex<String>,
    /// Our state file, read (never locked) to tell a claim we hold from one we don't.
    state_file: PathBuf,
}

impl Refusing {
    fn refusal(&self) -> String {
        support::lock(&self.refusal).clone()
    }

    /// A retry failed: says so when the reason changed.
    fn still_refused(&self, e: &OwnerError) {
        let now = error_chain(e);
        let mut refusal = support::lock(&self.refusal);
        if *refusal != now {
            tracing::error!(error = %now, "the node is still not ours");
            *refusal = now;
        }
    }
}

#[tonic::async_trait]
impl kubelet_plugin::Driver for Refusing {
    type Error = DriverError;

    /// Every claim is refused before it is read: the API server is not asked.
    fn admit(&self, claim: &ClaimRef) -> Result<(), DriverError> {
        tracing::warn!(claim = %claim, "prepare refused: the node is not ours");
        Err(DriverError::NotOwner {
            claim: claim.to_string(),
            action: "prepared",
            owner: self.refusal(),
        })
    }

    /// Never asked: every claim is refused at [`Self::admit`].
    async fn prepare(
        &self,
        claims: Vec<Claim>,
        _deadline: tokio::time::Instant,
    ) -> Answers<Vec<PreparedDevice>, DriverError> {
        claims
            .into_iter()
            .map(|c| {
                let e = self.admit(&c.reference).err();
                (c.reference.uid, e.map_or(Ok(Vec::new()), Err))
            })
            .collect()
    }

    /// A claim this driver never prepared is done already (kubelet's unprepare is
    /// idempotent); one our state file records waits for the node.
    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
        _deadline: tokio::time::Instant,
    ) -> Answers<(), DriverError> {
        let recorded = StateFile::load(&self.state_file, false, &DRA_DRIVER)
            .map(|s| s.records().keys().cloned().collect::<Vec<_>>());
        claims
            .into_iter()
            .map(|c| {
                let owner = match &recorded {
                    Ok(uids) if !uids.contains(&c.uid) => return (c.uid, Ok(())),
                    Ok(_) => self.refusal(),
                    Err(e) => error_chain(e),
                };
                let e = DriverError::NotOwner {
                    claim: c.to_string(),
                    action: "unprepared",
                    owner,
                };
                (c.uid, Err(e))
            })
            .collect()
    }

    /// Never asked: nothing is published while the node is not ours.
    fn devices(&self, _fields: KeptFields) -> Result<Offer, DriverError> {
        Ok(Offer::default())
    }
}
