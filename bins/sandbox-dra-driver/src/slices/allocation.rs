//! Reading a ResourceClaim kubelet asks to prepare: the devices allocated to this
//! driver in this node's pool, and why a claim cannot be served.

use super::*;

/// Why a claim's allocation cannot be used on this node.
#[derive(Debug, thiserror::Error)]
pub enum AllocationError {
    /// The claim does not exist.
    #[error("ResourceClaim {claim} is not found")]
    NotFound {
        /// `namespace/name`.
        claim: String,
    },
    /// The claim under that name is another one than kubelet asked for.
    #[error("ResourceClaim {claim} has uid {have}, kubelet asked for {want} (the claim was deleted and made again)")]
    UidMismatch {
        /// `namespace/name`.
        claim: String,
        /// The uid the server has.
        have: String,
        /// The uid kubelet gave.
        want: String,
    },
    /// The scheduler has not allocated it.
    #[error("ResourceClaim {claim} is not allocated")]
    NotAllocated {
        /// `namespace/name`.
        claim: String,
    },
    /// Devices of this driver were allocated from other pools (other nodes).
    #[error("ResourceClaim {claim} has devices of driver {driver} from other pools than {pool}, so not on this node: {others}")]
    OtherPool {
        /// `namespace/name`.
        claim: String,
        /// Our driver.
        driver: String,
        /// Our pool.
        pool: String,
        /// `pool/device`, the first few.
        others: String,
    },
    /// Nothing of this driver in this pool.
    #[error("ResourceClaim {claim} has no device of driver {driver} in pool {pool}")]
    NoDevices {
        /// `namespace/name`.
        claim: String,
        /// Our driver.
        driver: String,
        /// Our pool.
        pool: String,
    },
    /// A result asks for admin access, which shares a device with its user.
    #[error("ResourceClaim {claim}: device {device} of request {request} is allocated with admin access, which this driver does not give (moving it to vfio-pci would take it from its user)")]
    AdminAccess {
        /// `namespace/name`.
        claim: String,
        /// The device.
        device: String,
        /// The request.
        request: String,
    },
    /// The read failed.
    #[error("failed to get ResourceClaim {claim}")]
    Request {
        /// `namespace/name`.
        claim: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// The read took too long.
    #[error("get ResourceClaim {claim} timed out after {after:?}")]
    Timeout {
        /// `namespace/name`.
        claim: String,
        /// The limit.
        after: Duration,
    },
}

impl AllocationError {
    /// Why, in one word: the claim is not this node's to prepare, or the API
    /// server did not answer.
    pub fn failure(&self) -> crate::claims::Failure {
        use crate::claims::Failure;
        match self {
            Self::Request { .. } | Self::Timeout { .. } => Failure::ApiServer,
            Self::NotFound { .. }
            | Self::UidMismatch { .. }
            | Self::NotAllocated { .. }
            | Self::OtherPool { .. }
            | Self::NoDevices { .. } => Failure::NotOurs,
            Self::AdminAccess { .. } => Failure::Refused,
        }
    }

    /// True when asking again may give another answer (the API server was not
    /// reached, or the claim may yet be written); kubelet retries every error, so
    /// this only tunes what is logged.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Self::Request { .. }
                | Self::Timeout { .. }
                | Self::NotFound { .. }
                | Self::NotAllocated { .. }
        )
    }
}

/// At most five names, then how many more.
fn first_few(names: &[String]) -> String {
    let mut s = names.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
    if names.len() > 5 {
        s.push_str(&format!(" and {} more", names.len() - 5));
    }
    s
}

/// What prepare needs of a ResourceClaim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimAllocation {
    /// Its devices of this driver in this pool, in result order.
    pub allocations: Vec<Allocation>,
    /// Its `resource.kubernetes.io/pod-claim-name` annotation: set when the claim was
    /// made from a template, and part of the path the pod reads its metadata at.
    pub pod_claim_name: Option<String>,
}

/// The devices of ResourceClaim `claim` allocated to `driver` in `pool`, read from
/// the API server now.
///
/// The claim must be the one kubelet named (same uid) and allocated; results of
/// other drivers are left to them. Like upstream's kubelet plugin helper this does
/// not look at `status.reservedFor`: kubelet checked that the pod is a consumer
/// before asking, and the list may change under a running pod. Device names are
/// not checked here: the engine refuses devices it does not know.
pub async fn claim_allocation(
    client: &Client,
    claim: &ClaimRef,
    driver: &str,
    pool: &str,
) -> Result<ClaimAllocation, AllocationError> {
    let id = format!("{}/{}", claim.namespace, claim.name);
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &claim.namespace);
    let found = tokio::time::timeout(REQUEST_TIMEOUT, api.get_opt(&claim.name))
        .await
        .map_err(|_| AllocationError::Timeout {
            claim: id.clone(),
            after: REQUEST_TIMEOUT,
        })?
        .map_err(|source| AllocationError::Request {
            claim: id.clone(),
            source,
        })?
        .ok_or_else(|| AllocationError::NotFound { claim: id.clone() })?;
    Ok(ClaimAllocation {
        allocations: allocation_of(&found, claim, driver, pool)?,
        pod_claim_name: found
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::cdi::POD_CLAIM_NAME_ANNOTATION))
            .cloned(),
    })
}

/// [`claim_allocation`] on a claim already read.
pub fn allocation_of(
    found: &ResourceClaim,
    claim: &ClaimRef,
    driver: &str,
    pool: &str,
) -> Result<Vec<Allocation>, AllocationError> {
    let id = format!("{}/{}", claim.namespace, claim.name);
    let have = found.metadata.uid.clone().unwrap_or_default();
    if have != claim.uid {
        return Err(AllocationError::UidMismatch {
            claim: id,
            have,
            want: claim.uid.clone(),
        });
    }
    let Some(allocation) = found.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return Err(AllocationError::NotAllocated { claim: id });
    };
    let results = allocation
        .devices
        .as_ref()
        .and_then(|d| d.results.as_deref())
        .unwrap_or(&[]);
    let ours: Vec<_> = results.iter().filter(|r| r.driver == driver).collect();
    let others: Vec<String> = ours
        .iter()
        .filter(|r| r.pool != pool)
        .map(|r| format!("{}/{}", r.pool, r.device))
        .collect();
    if !others.is_empty() {
        return Err(AllocationError::OtherPool {
            claim: id,
            driver: driver.to_owned(),
            pool: pool.to_owned(),
            others: first_few(&others),
        });
    }
    if let Some(r) = ours.iter().find(|r| r.admin_access == Some(true)) {
        return Err(AllocationError::AdminAccess {
            claim: id,
            device: r.device.clone(),
            request: r.request.clone(),
        });
    }
    if ours.is_empty() {
        return Err(AllocationError::NoDevices {
            claim: id,
            driver: driver.to_owned(),
            pool: pool.to_owned(),
        });
    }
    Ok(ours
        .into_iter()
        .map(|r| Allocation {
            request_names: vec![r.request.clone()],
            pool: r.pool.clone(),
            device: r.device.clone(),
        })
        .collect())
}
