//! Why a claim could not be prepared or unprepared: the error each step returns,
//! what it ran into, and the one-word reason metrics and Events use.

use super::*;

/// Why a claim could not be prepared or unprepared. Each names the claim.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The request cannot be served as asked; nothing was touched.
    #[error("claim {claim}: {reason}")]
    #[allow(missing_docs)]
    Refused { claim: String, reason: String },
    /// The claim's names make no valid CDI spec or metadata file; nothing was
    /// touched.
    #[error("claim {claim}: no valid CDI spec or metadata file can be made of it")]
    #[allow(missing_docs)]
    Unnamable {
        claim: String,
        /// Which name, and why.
        #[source]
        source: cdi::CdiError,
    },
    /// A device of the claim is not this node's to give: another pool, a name this
    /// driver does not publish, a function the resource list does not select.
    #[error("claim {claim}: {reason}")]
    #[allow(missing_docs)]
    NotOurs { claim: String, reason: String },
    /// A configuration of this driver in the claim's allocation is refused;
    /// nothing was touched.
    #[error("claim {claim}: its configuration is refused: {source}")]
    #[allow(missing_docs)]
    Config {
        claim: String,
        /// Which configuration, and what is wrong with it.
        #[source]
        source: crate::config::ConfigError,
    },
    /// A group of the claim is prepared for another claim; nothing was touched.
    #[error("claim {claim}: {reason}")]
    #[allow(missing_docs)]
    Held {
        claim: String,
        /// Which group, and the claim holding it.
        reason: String,
    },
    /// A VM still holds a group of the claim; nothing was touched; retry later.
    #[error(
        "claim {claim}: {} still open (a VM holds it); not giving the devices back yet",
        group_nodes(groups)
    )]
    #[allow(missing_docs)]
    InUse { claim: String, groups: Vec<u32> },
    /// A step failed. What was moved is put back where possible; the claim's record
    /// stays while anything of it is still on vfio, so a retry or a restart goes on.
    #[error("claim {claim}: {step}{}", after_note(after))]
    #[allow(missing_docs)]
    Failed {
        claim: String,
        step: &'static str,
        /// What was done about it (the rollback of a prepare), if anything.
        after: Option<String>,
        /// What failed.
        #[source]
        source: Box<ClaimStepError>,
    },
}

pub(super) fn after_note(after: &Option<String>) -> String {
    after
        .as_ref()
        .map(|a| format!(" ({a})"))
        .unwrap_or_default()
}

/// What a step of a claim's prepare or unprepare ran into.
#[derive(Debug, thiserror::Error)]
pub enum ClaimStepError {
    /// The state file could not be saved.
    #[error(transparent)]
    State(#[from] StateError),
    /// The vfio modules could not be loaded.
    #[error(transparent)]
    Module(#[from] ModuleError),
    /// Groups could not be moved to vfio (each put back): each failure, named.
    #[error("{}", chains(.0))]
    Bind(Vec<PassthroughError>),
    /// Groups could not be given back: each failure, and the groups a VM holds.
    #[error("{}", give_back_note(failed, held))]
    GiveBack {
        /// Restores that failed.
        failed: Vec<PassthroughError>,
        /// Groups whose node a VM holds open.
        held: Vec<u32>,
    },
    /// A device is on vfio, but what iommufd needs for it is not there.
    #[error("{address} is configured with iommu: {iommu}, but {what}")]
    #[allow(missing_docs)]
    NoIommufd {
        address: PciAddress,
        /// The configured interface.
        iommu: &'static str,
        /// What is missing.
        what: String,
    },
    /// A group node is missing after the bind.
    #[error("{} is missing", .0.display())]
    NoGroupNode(PathBuf),
    /// The claim's CDI spec or metadata could not be made.
    #[error(transparent)]
    Files(#[from] cdi::CdiError),
    /// A file could not be written or removed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// A directory could not be made or removed.
    #[error("cannot {action} {}", dir.display())]
    #[allow(missing_docs)]
    Dir {
        /// `create`, `remove`.
        action: &'static str,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ClaimStepError {
    /// The step of a claim's move (modules, bind, group nodes) that this error
    /// stopped, as its failure names it.
    pub(super) fn move_step(&self) -> &'static str {
        match self {
            Self::Module(_) => "loading the vfio modules",
            Self::NoGroupNode(_) => "checking the group nodes",
            _ => "moving its IOMMU groups to vfio",
        }
    }
}

pub(super) fn boxed(e: impl Into<ClaimStepError>) -> Box<ClaimStepError> {
    Box::new(e.into())
}

/// What the driver does about devices a failed rollback left half-bound.
const HALF_BOUND_ADVICE: &str = "the driver gives them back with the rest of the claim (now, \
     at kubelet's retry or at its next start)";

/// A failure of the passthrough engine, said with the driver's own advice.
fn failure(e: &PassthroughError) -> String {
    if e.left_half_bound() {
        format!("{}; {HALF_BOUND_ADVICE}", error_chain(e))
    } else {
        error_chain(e)
    }
}

pub(super) fn chains(errors: &[PassthroughError]) -> String {
    let list: Vec<String> = errors.iter().map(failure).collect();
    list.join("; ")
}

pub(super) fn give_back_note(failed: &[PassthroughError], held: &[u32]) -> String {
    let mut parts: Vec<String> = failed.iter().map(failure).collect();
    if !held.is_empty() {
        parts.push(format!("{} is open", group_nodes(held)));
    }
    parts.join("; ")
}

impl ClaimError {
    /// Why, in one word.
    pub fn failure(&self) -> Failure {
        match self {
            Self::Refused { .. } | Self::Unnamable { .. } => Failure::Refused,
            Self::Config { .. } => Failure::InvalidConfig,
            Self::NotOurs { .. } => Failure::NotOurs,
            Self::Held { .. } | Self::InUse { .. } => Failure::GroupHeld,
            Self::Failed { .. } => Failure::Failed,
        }
    }
}

/// Why a prepare or unprepare of a claim failed, in one word: the `reason` label of
/// the driver's failure metric and the reason of the Event on the claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Failure {
    /// An IOMMU group is prepared for another claim, or a VM still holds it.
    GroupHeld,
    /// The claim's devices are not this node's to give, or it has none.
    NotOurs,
    /// The call's deadline passed first; the work goes on.
    Timeout,
    /// The claim could not be read from the API server.
    ApiServer,
    /// kubelet unprepared the claim while this prepare was on its way.
    Unprepared,
    /// The request cannot be served as asked (names, a changed allocation).
    Refused,
    /// A configuration of this driver in the claim or its class is refused.
    InvalidConfig,
    /// A step on the node failed (what was moved is put back).
    Failed,
}

impl Failure {
    /// Every failure, for series present at zero.
    pub const ALL: [Failure; 8] = [
        Failure::GroupHeld,
        Failure::NotOurs,
        Failure::Timeout,
        Failure::ApiServer,
        Failure::Unprepared,
        Failure::Refused,
        Failure::InvalidConfig,
        Failure::Failed,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::GroupHeld => "group_held",
            Self::NotOurs => "not_ours",
            Self::Timeout => "timeout",
            Self::ApiServer => "api_server",
            Self::Unprepared => "unprepared",
            Self::Refused => "refused",
            Self::InvalidConfig => "invalid_config",
            Self::Failed => "failed",
        }
    }

    /// The reason of an Event (UpperCamelCase, as Kubernetes writes them).
    pub fn event_reason(self) -> &'static str {
        match self {
            Self::GroupHeld => "IOMMUGroupHeld",
            Self::NotOurs => "NotOurDevice",
            Self::Timeout => "PrepareTimedOut",
            Self::ApiServer => "ClaimReadFailed",
            Self::Unprepared => "UnpreparedMeanwhile",
            Self::Refused => "PrepareRefused",
            Self::InvalidConfig => "InvalidClaimConfig",
            Self::Failed => "PrepareFailed",
        }
    }
}

pub(super) fn group_nodes(groups: &[u32]) -> String {
    let nodes: Vec<String> = groups.iter().map(|g| format!("/dev/vfio/{g}")).collect();
    nodes.join(", ")
}

/// Why the driver did not prepare, unprepare, move or give back a claim: what
/// kubelet (or the claim's status) is told, up to the gRPC edge.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// A step of the claim's change, or a check before it.
    #[error(transparent)]
    Claim(#[from] ClaimError),
    /// The node's PCI devices could not be read for a publication.
    #[error("cannot scan the node's PCI devices")]
    NodeScan(#[source] sysfs_pci::device::DeviceError),
    /// kubelet unprepared the claim while this prepare was on its way.
    #[error(
        "claim {claim}: kubelet unprepared it while this prepare was on its way; \
            not preparing it (a new prepare will)"
    )]
    #[allow(missing_docs)]
    Unprepared { claim: String },
    /// The call's deadline came first; the work goes on.
    #[error("not done within {within:?} ({doing}); the work goes on and a retry gets its result")]
    Late {
        /// The call's time limit.
        within: std::time::Duration,
        /// What the claims thread is doing.
        doing: String,
    },
    /// The claims thread is gone.
    #[error("the claims thread {0}")]
    Stopped(&'static str),
    /// The node is not this driver's (vfio-manager owns it).
    #[error("claim {claim}: not {action}: {owner}")]
    #[allow(missing_docs)]
    NotOwner {
        claim: String,
        /// `prepared`, `unprepared`.
        action: &'static str,
        /// Who owns the node, and what to do (the owner lock's refusal).
        owner: String,
    },
}

impl DriverError {
    /// Why, in one word.
    pub fn failure(&self) -> Failure {
        match self {
            Self::Claim(e) => e.failure(),
            Self::NodeScan(_) | Self::Stopped(_) => Failure::Failed,
            Self::Unprepared { .. } => Failure::Unprepared,
            Self::Late { .. } => Failure::Timeout,
            Self::NotOwner { .. } => Failure::Refused,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use passthrough::StepError;
    use sysfs_pci::bind::DriverError;

    use super::*;

    fn address(text: &str) -> PciAddress {
        text.parse().expect("a PCI address")
    }

    #[test]
    fn a_failed_rollback_says_how_the_driver_puts_the_devices_back() {
        let e = PassthroughError::RollbackFailed {
            group: 7,
            put_back: vec![address("0000:01:00.1")],
            stuck: vec![(address("0000:01:00.0"), "write timed out".into())],
            source: Box::new(StepError::Driver(DriverError::IommuOff {
                address: address("0000:01:00.0"),
                path: PathBuf::from("/sys/bus/pci/devices/0000:01:00.0/iommu_group"),
            })),
        };
        let said = ClaimStepError::Bind(vec![e]).to_string();
        assert!(said.contains("IOMMU group 7 is half-bound"), "{said}");
        assert!(
            said.contains("their records are kept for the next restore"),
            "{said}"
        );
        assert!(
            said.ends_with(
                "; the driver gives them back with the rest of the claim (now, at kubelet's \
                 retry or at its next start)"
            ),
            "{said}"
        );
        assert!(!said.contains("vfio-manager"), "{said}");
    }
}
