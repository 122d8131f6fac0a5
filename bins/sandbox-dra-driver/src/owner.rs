//! Taking the node before any device moves: the node-wide owner lock
//! (`passthrough::owner`), shared with vfio-manager.
//!
//! While vfio-manager owns the node the driver recovers nothing and publishes no
//! ResourceSlice, but it serves kubelet, so a claim sent here gets an answer that
//! names the owner instead of a dial error: every prepare is refused with it. It
//! tries the lock again every `--owner-retry-interval`; once taken, the caller
//! recovers and starts as usual.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::claims::{ClaimRef, PreparedDevice};
use passthrough::owner::{Owner, OwnerError, Program};
use passthrough::state::StateFile;
use sysfs_pci::error_chain;
use tokio::signal::unix::{signal, SignalKind};

use crate::grpc::{self, GrpcConfig};

/// Takes the node's owner lock at `lock`. While vfio-manager owns the node, serves
/// kubelet with every prepare refused (see the module doc) and tries again every
/// `retry`. `None`: a stop signal came first. Another sandbox-dra-driver holding the
/// lock, or a lock that cannot be used, is an error.
pub fn take_or_wait(
    lock: &Path,
    retry: Duration,
    grpc: GrpcConfig,
    state_file: &Path,
    manager_state: &Path,
) -> anyhow::Result<Option<Owner>> {
    let refusal = match Owner::take(lock, Program::DraDriver, manager_state) {
        Ok(owner) => return Ok(Some(owner)),
        Err(e) if e.by_other_program() => error_chain(&e),
        Err(e) => return Err(e.into()),
    };
    tracing::error!(error = %refusal, retry = ?retry, "not moving any device, not publishing ResourceSlices: every claim prepared here is refused until the node is free");
    let refusing = Arc::new(Refusing {
        refusal: Mutex::new(refusal),
        state_file: state_file.to_owned(),
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(wait(lock, manager_state, retry, grpc, refusing))
}

async fn wait(
    lock: &Path,
    manager_state: &Path,
    retry: Duration,
    grpc: GrpcConfig,
    refusing: Arc<Refusing>,
) -> anyhow::Result<Option<Owner>> {
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sighup = signal(SignalKind::hangup())?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(grpc::serve(grpc, refusing.clone(), async move {
        let _ = stop_rx.await;
    }));
    tokio::pin!(serving);
    let result = loop {
        tokio::select! {
            _ = sigterm.recv() => break Ok(None),
            _ = sigint.recv() => break Ok(None),
            _ = sighup.recv() => break Ok(None),
            r = &mut serving => break Err(match r {
                Ok(Ok(())) => anyhow::anyhow!("the kubelet API server stopped"),
                Ok(Err(e)) => e,
                Err(e) => anyhow::anyhow!("the kubelet API server task failed: {e}"),
            }),
            _ = tokio::time::sleep(retry) => match Owner::take(lock, Program::DraDriver, manager_state) {
                Ok(owner) => break Ok(Some(owner)),
                Err(e) => refusing.still_refused(&e),
            },
        }
    };
    if matches!(result, Ok(None)) {
        tracing::info!("stopping; the node was never ours");
    }
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), &mut serving).await;
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
        sysfs_pci::kernel::lock(&self.refusal).clone()
    }

    /// A retry failed: says so when the reason changed.
    fn still_refused(&self, e: &OwnerError) {
        let now = error_chain(e);
        let mut refusal = sysfs_pci::kernel::lock(&self.refusal);
        if *refusal != now {
            tracing::error!(error = %now, "the node is still not ours");
            *refusal = now;
        }
    }
}

#[tonic::async_trait]
impl grpc::Driver for Refusing {
    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, Result<Vec<PreparedDevice>, String>> {
        let refusal = self.refusal();
        claims
            .into_iter()
            .map(|c| {
                tracing::warn!(claim = %c, "prepare refused: the node is not ours");
                let why = format!("claim {c}: not prepared: {refusal}");
                (c.uid, Err(why))
            })
            .collect()
    }

    /// A claim this driver never prepared is done already (kubelet's unprepare is
    /// idempotent); one our state file records waits for the node.
    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, Result<(), String>> {
        let recorded = StateFile::load(
            &self.state_file,
            false,
            passthrough::owner::Program::DraDriver,
        )
        .map(|s| s.state().claims.keys().cloned().collect::<Vec<_>>());
        claims
            .into_iter()
            .map(|c| {
                let answer = match &recorded {
                    Ok(uids) if !uids.contains(&c.uid) => Ok(()),
                    Ok(_) => Err(format!("claim {c}: not unprepared: {}", self.refusal())),
                    Err(e) => Err(format!("claim {c}: not unprepared: {}", error_chain(e))),
                };
                (c.uid, answer)
            })
            .collect()
    }
}
