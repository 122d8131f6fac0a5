//! What a driver implements, and what it is told.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::resource::v1::{CounterSet, Device};
use tokio::sync::watch;

use crate::claim::{Claim, ClaimRef, ReadError};
use crate::health::HealthReports;
use crate::slices::{Report, SliceError};

/// One answer per claim uid.
pub type Answers<T, E> = BTreeMap<String, Result<T, E>>;

/// What a prepared claim gives kubelet for one of its devices.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PreparedDevice {
    /// The request(s) of the claim it satisfies.
    pub request_names: Vec<String>,
    /// Its pool.
    pub pool_name: String,
    /// Its name in the pool.
    pub device_name: String,
    /// The fully qualified CDI device ids the container runtime applies.
    pub cdi_device_ids: Vec<String>,
}

/// Which of the newer ResourceSlice device fields the API server keeps, as far as
/// the plugin has seen: on until a write comes back without them (a gate off, or a
/// server that predates them), then off for the life of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeptFields {
    /// `taints` (gate `DRADeviceTaints`).
    pub taints: bool,
    /// `bindingConditions`, `bindingFailureConditions` and `bindsToNode` (gates
    /// `DRADeviceBindingConditions` and `DRAResourceClaimDeviceStatus`).
    pub binding_conditions: bool,
    /// `sharedCounters` and `consumesCounters` (gate `DRAPartitionableDevices`):
    /// known before the first counter set is published (a dry-run create).
    pub counters: bool,
}

impl Default for KeptFields {
    fn default() -> Self {
        Self {
            taints: true,
            binding_conditions: true,
            counters: true,
        }
    }
}

/// What a driver offers on its node: its devices, and the counter sets they draw
/// on (`consumesCounters`), which the plugin publishes in the same pool.
#[derive(Debug, Clone, Default, PartialEq)]
#[allow(missing_docs)]
pub struct Offer {
    pub devices: Vec<Device>,
    /// The counter sets, each named once.
    pub counter_sets: Vec<CounterSet>,
    /// Why the driver offers nothing for now, when it cannot serve any claim on
    /// this node (another program owns its devices, say): the pool is published
    /// empty, and the plugin is not ready (its ready file goes) until an offer
    /// comes without it. `devices` and `counter_sets` are then not published.
    pub withdrawn: Option<String>,
}

impl Offer {
    /// Nothing offered, and not ready, for `why`.
    pub fn withdrawn(why: impl Into<String>) -> Self {
        Self {
            withdrawn: Some(why.into()),
            ..Self::default()
        }
    }
}

impl From<Vec<Device>> for Offer {
    fn from(devices: Vec<Device>) -> Self {
        Self {
            devices,
            ..Self::default()
        }
    }
}

/// A Dynamic Resource Allocation driver, as [`crate::Plugin`] serves it to kubelet
/// and publishes its devices.
///
/// The plugin checks each call's claim uids (none empty, none named twice with
/// other names) and reads every claim to prepare from the API server before the
/// driver sees it; the driver answers for each claim it is given. Both calls must be
/// idempotent: kubelet retries, and may call again after a restart of either side.
///
/// Calls are not serialized (Go's `kubeletplugin.Helper` serializes them by
/// default): a prepare and an unprepare, or two prepares, may run at once, for
/// different claims or for the same one after a kubelet retry. The driver
/// guards its own state.
#[tonic::async_trait]
pub trait Driver: Send + Sync + 'static {
    /// Why a claim could not be prepared or unprepared; kubelet gets its
    /// [`support::error_chain`].
    type Error: std::error::Error + Send + Sync + 'static;

    /// Prepares each claim; one answer per claim uid, by `deadline` (the call's
    /// time limit: work left then may go on, for kubelet's retry to find).
    async fn prepare(
        &self,
        claims: Vec<Claim>,
        deadline: tokio::time::Instant,
    ) -> Answers<Vec<PreparedDevice>, Self::Error>;

    /// Unprepares each claim; one answer per claim uid, by `deadline`. A claim the
    /// driver does not know is unprepared already.
    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
        deadline: tokio::time::Instant,
    ) -> Answers<(), Self::Error>;

    /// Checked for each claim to prepare before it is read: a driver that cannot
    /// prepare anything now (its node not its own yet, draining) refuses here, and
    /// the API server is not asked.
    fn admit(&self, _claim: &ClaimRef) -> Result<(), Self::Error> {
        Ok(())
    }

    /// This node's devices (and the counter sets they draw on), to publish, with
    /// only the `fields` the API server keeps. Called on a blocking thread at every
    /// publication pass: the plugin pulls the list (Go's `Helper` is pushed one by
    /// `PublishResources` and keeps it), so it is never older than the pass.
    fn devices(&self, fields: KeptFields) -> Result<Offer, Self::Error>;

    /// Device health, streamed to kubelet (`DRAResourceHealth`); `None` serves no
    /// health service and advertises none.
    fn health(&self) -> Option<watch::Receiver<HealthReports>> {
        None
    }

    /// Told the outcome of every prepare and unprepare call (metrics, Events).
    fn answered(&self, _call: &Call<'_, Self::Error>) {}

    /// Told the outcome of every publication pass (metrics).
    fn published(&self, _outcome: Result<&Published, &PublishError<Self::Error>>) {}
}

/// Which call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// `NodePrepareResources`.
    Prepare,
    /// `NodeUnprepareResources`.
    Unprepare,
}

/// Why a claim was not prepared or unprepared.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimError<E: std::error::Error + 'static> {
    /// kubelet's request named it wrongly (no uid, or one uid for two claims).
    #[error("{0}")]
    Request(String),
    /// It could not be read, or is not this node's.
    #[error(transparent)]
    Read(ReadError),
    /// The driver's own answer.
    #[error(transparent)]
    Driver(E),
    /// The driver answered for other claims but not this one, or failed.
    #[error("the driver gave no answer for this claim")]
    NoAnswer,
}

/// One prepare or unprepare call, answered.
#[derive(Debug)]
#[non_exhaustive]
#[allow(missing_docs)]
pub struct Call<'a, E: std::error::Error + 'static> {
    pub kind: CallKind,
    /// How long it took, claim reads included.
    pub took: Duration,
    /// Each claim asked about, and its error if it failed.
    pub claims: Vec<(&'a ClaimRef, Option<&'a ClaimError<E>>)>,
}

/// A publication pass that wrote (or found up to date) this node's ResourceSlices.
#[derive(Debug)]
#[non_exhaustive]
pub struct Published {
    /// The devices published.
    pub devices: usize,
    /// What the write did.
    pub report: Report,
    /// Why the driver withdrew its devices, when it did ([`Offer::withdrawn`]).
    pub withdrawn: Option<String>,
}

/// Why a publication pass failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError<E: std::error::Error + 'static> {
    /// The driver could not say what its devices are.
    #[error("cannot list this node's devices")]
    Devices(#[source] E),
    /// The driver's device listing stopped before it finished.
    #[error("listing this node's devices stopped")]
    DevicesStopped(#[source] tokio::task::JoinError),
    /// The ResourceSlices could not be written.
    #[error(transparent)]
    Slices(#[from] SliceError),
}
