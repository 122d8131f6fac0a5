//! Claims as kubelet names them, and as the API server holds them when a prepare
//! reads them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};
use kube::{Api, Client};
use tokio::sync::Semaphore;

/// The annotation the ResourceClaim controller puts on a claim made from a
/// template: the claim's name in the pod's `spec.resourceClaims`.
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";

/// Upper bound for one claim read.
pub(crate) const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// At most this many ResourceClaims are read from the API server at once.
const PARALLEL_READS: usize = 8;

/// A ResourceClaim as kubelet names it in `NodePrepareResources` and
/// `NodeUnprepareResources`.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[allow(missing_docs)]
pub struct ClaimRef {
    /// The claim's UID.
    pub uid: String,
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

impl ClaimRef {
    /// The claim as the object an Event about it is posted on (in its namespace,
    /// where `kubectl describe resourceclaim` and the pod's owner look).
    pub fn object_reference(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("resource.k8s.io/v1".into()),
            kind: Some("ResourceClaim".into()),
            name: Some(self.name.clone()),
            namespace: Some(self.namespace.clone()),
            uid: Some(self.uid.clone()),
            ..Default::default()
        }
    }
}

/// When a call reached the plugin, in the order of every call it serves: a
/// prepare's ticket is older than the ticket of any unprepare that arrives after
/// it. A driver that runs its work in order can refuse a prepare that arrived
/// before an unprepare of the same claim it already answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(u64);

static CLOCK: AtomicU64 = AtomicU64::new(0);

impl Ticket {
    /// A ticket for now, later than every ticket taken before.
    pub fn now() -> Self {
        Self(CLOCK.fetch_add(1, Ordering::SeqCst))
    }
}

/// One device of this driver in this node's pool that the scheduler allocated to
/// a claim (a result of the claim's `status.allocation.devices`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[allow(missing_docs)]
pub struct AllocatedDevice {
    /// The request(s) of the claim this device satisfies.
    pub request_names: Vec<String>,
    pub pool: String,
    /// Its name in the pool's ResourceSlices.
    pub device: String,
    /// Allocated with admin access (`adminAccess: true`): shared with its user.
    pub admin_access: bool,
}

/// A claim kubelet asked to prepare, read from the API server for this call.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Claim {
    /// The claim as kubelet named it (the uid checked against the server's).
    pub reference: ClaimRef,
    /// When kubelet's call arrived (taken before the read).
    pub arrived: Ticket,
    /// Its devices of this driver in this node's pool, in result order; never empty.
    pub devices: Vec<AllocatedDevice>,
    /// The opaque configurations of this driver in its allocation, class first
    /// ([`opaque_configs`]).
    pub configs: Vec<OpaqueConfig>,
    /// The claim as read.
    pub object: ResourceClaim,
}

impl Claim {
    /// Its [`POD_CLAIM_NAME_ANNOTATION`]: set when the claim was made from a template.
    pub fn pod_claim_name(&self) -> Option<&str> {
        self.object
            .metadata
            .annotations
            .as_ref()?
            .get(POD_CLAIM_NAME_ANNOTATION)
            .map(String::as_str)
    }
}

/// Why a claim kubelet asked to prepare could not be read, or is not this node's.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The claim does not exist.
    #[error("ResourceClaim {claim} is not found")]
    NotFound {
        /// `namespace/name`.
        claim: String,
    },
    /// The claim under that name is another one than kubelet asked for.
    #[error(
        "ResourceClaim {claim} has uid {have}, kubelet asked for {want} (the claim \
            was deleted and made again)"
    )]
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
    #[error(
        "ResourceClaim {claim} has devices of driver {driver} from other pools \
            than {pool}, so not on this node: {others}"
    )]
    #[allow(missing_docs)]
    OtherPool {
        /// `namespace/name`.
        claim: String,
        driver: String,
        pool: String,
        /// `pool/device`, the first few.
        others: String,
    },
    /// Nothing of this driver in this pool.
    #[error("ResourceClaim {claim} has no device of driver {driver} in pool {pool}")]
    #[allow(missing_docs)]
    NoDevices {
        /// `namespace/name`.
        claim: String,
        driver: String,
        pool: String,
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
    /// The read took longer than its limit (10 s).
    #[error("get ResourceClaim {claim} timed out after {after:?}")]
    Timeout {
        /// `namespace/name`.
        claim: String,
        /// The limit.
        after: Duration,
    },
    /// The call's deadline came before the read was done.
    #[error(
        "claim {claim}: reading it from the API server took too long: not done within \
            {after:?}; a retry reads it again"
    )]
    #[allow(missing_docs)]
    Deadline {
        claim: ClaimRef,
        /// The call's time limit.
        after: Duration,
    },
}

impl ReadError {
    /// True when the API server did not answer (or not in time); false when it
    /// answered that the claim is not this node's to prepare.
    pub fn is_api_server(&self) -> bool {
        matches!(self, Self::Request { .. } | Self::Timeout { .. })
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
                | Self::Deadline { .. }
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

/// ResourceClaim `claim` read from the API server now, with its devices of
/// `driver` in `pool`.
///
/// The claim must be the one kubelet named (same uid) and allocated; results of
/// other drivers are left to them. Like upstream's kubelet plugin helper this does
/// not look at `status.reservedFor`: kubelet checked that the pod is a consumer
/// before asking, and the list may change under a running pod.
pub(crate) async fn read_claim(
    client: &Client,
    claim: &ClaimRef,
    arrived: Ticket,
    driver: &str,
    pool: &str,
) -> Result<Claim, ReadError> {
    let id = format!("{}/{}", claim.namespace, claim.name);
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &claim.namespace);
    let object = tokio::time::timeout(READ_TIMEOUT, api.get_opt(&claim.name))
        .await
        .map_err(|_| ReadError::Timeout {
            claim: id.clone(),
            after: READ_TIMEOUT,
        })?
        .map_err(|source| ReadError::Request {
            claim: id.clone(),
            source,
        })?
        .ok_or_else(|| ReadError::NotFound { claim: id })?;
    Ok(Claim {
        devices: allocated_devices(&object, claim, driver, pool)?,
        configs: opaque_configs(&object, driver),
        reference: claim.clone(),
        arrived,
        object,
    })
}

/// The results of claim `object`'s allocation (`status.allocation.devices.results`),
/// of every driver; none while it is not allocated.
pub fn allocation_results(object: &ResourceClaim) -> &[DeviceRequestAllocationResult] {
    object
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_deref())
        .unwrap_or(&[])
}

/// The devices of `driver` in `pool` that claim `object` (kubelet's `claim`) is
/// allocated; an error when it is another claim, not allocated, or has none of
/// them here.
pub fn allocated_devices(
    object: &ResourceClaim,
    claim: &ClaimRef,
    driver: &str,
    pool: &str,
) -> Result<Vec<AllocatedDevice>, ReadError> {
    let id = format!("{}/{}", claim.namespace, claim.name);
    let have = object.metadata.uid.clone().unwrap_or_default();
    if have != claim.uid {
        return Err(ReadError::UidMismatch {
            claim: id,
            have,
            want: claim.uid.clone(),
        });
    }
    if object
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .is_none()
    {
        return Err(ReadError::NotAllocated { claim: id });
    };
    let ours: Vec<_> = allocation_results(object)
        .iter()
        .filter(|r| r.driver == driver)
        .collect();
    let others: Vec<String> = ours
        .iter()
        .filter(|r| r.pool != pool)
        .map(|r| format!("{}/{}", r.pool, r.device))
        .collect();
    if !others.is_empty() {
        return Err(ReadError::OtherPool {
            claim: id,
            driver: driver.to_owned(),
            pool: pool.to_owned(),
            others: first_few(&others),
        });
    }
    if ours.is_empty() {
        return Err(ReadError::NoDevices {
            claim: id,
            driver: driver.to_owned(),
            pool: pool.to_owned(),
        });
    }
    Ok(ours
        .into_iter()
        .map(|r| AllocatedDevice {
            request_names: vec![r.request.clone()],
            pool: r.pool.clone(),
            device: r.device.clone(),
            admin_access: r.admin_access == Some(true),
        })
        .collect())
}

/// Where an opaque configuration of a claim's allocation came from: the
/// allocation's `config[].source`, which the scheduler sets when it copies the
/// configurations of the DeviceClasses and of the claim into the allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ConfigSource {
    /// `FromClass`: a DeviceClass's `spec.config`.
    Class,
    /// `FromClaim`: the claim's `spec.devices.config`.
    Claim,
}

impl std::fmt::Display for ConfigSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Class => "its DeviceClass",
            Self::Claim => "the claim",
        })
    }
}

/// One opaque configuration for this driver in a claim's allocation
/// (`status.allocation.devices.config[index]`): parameters the API server stores
/// without looking at them, for the driver to check.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OpaqueConfig {
    /// Its place in `status.allocation.devices.config`.
    pub index: usize,
    /// Where it came from.
    pub source: ConfigSource,
    /// The requests it applies to (`request` or `request/subrequest`); empty:
    /// all of the claim's requests.
    pub requests: Vec<String>,
    /// `opaque.parameters`, as stored.
    pub parameters: serde_json::Value,
}

impl OpaqueConfig {
    /// The field its parameters are in, for errors that name it.
    pub fn field(&self) -> String {
        format!(
            "status.allocation.devices.config[{}].opaque.parameters",
            self.index
        )
    }

    /// True when it applies to a device allocated for `request` (`request` or
    /// `request/subrequest`): it names no request, names `request`, or names the
    /// request a subrequest belongs to.
    pub fn applies_to(&self, request: &str) -> bool {
        let parent = request.split_once('/').map(|(p, _)| p);
        self.requests.is_empty()
            || self
                .requests
                .iter()
                .any(|r| r == request || Some(r.as_str()) == parent)
    }
}

/// The opaque configurations of `driver` in the allocation of claim `object`,
/// in the order their precedence rises: those from DeviceClasses first, then the
/// claim's own, each in allocation order (as upstream's example driver orders
/// them: for a device, the last one that applies to its request wins).
/// Configurations of other drivers are theirs.
pub fn opaque_configs(object: &ResourceClaim, driver: &str) -> Vec<OpaqueConfig> {
    let configs = object
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.config.as_deref())
        .unwrap_or(&[]);
    let ours = configs.iter().enumerate().filter_map(|(index, c)| {
        let opaque = c.opaque.as_ref().filter(|o| o.driver == driver)?;
        let source = match c.source.as_str() {
            "FromClass" => ConfigSource::Class,
            _ => ConfigSource::Claim,
        };
        Some(OpaqueConfig {
            index,
            source,
            requests: c.requests.clone().unwrap_or_default(),
            parameters: opaque.parameters.0.clone(),
        })
    });
    let (mut class, claim): (Vec<_>, Vec<_>) = ours.partition(|c| c.source == ConfigSource::Class);
    class.extend(claim);
    class
}

/// Reads `claims` ([`read_claim`]), [`PARALLEL_READS`] at a time, until
/// `deadline`: one result per claim, in the order given; a read still running at
/// the deadline is a [`ReadError::Deadline`].
pub(crate) async fn read_claims(
    client: &Client,
    claims: Vec<(ClaimRef, Ticket)>,
    driver: &str,
    pool: &str,
    deadline: tokio::time::Instant,
    limit: Duration,
) -> Vec<(ClaimRef, Result<Claim, ReadError>)> {
    let permits = Arc::new(Semaphore::new(PARALLEL_READS));
    let mut reads = tokio::task::JoinSet::new();
    for (i, (claim, arrived)) in claims.iter().cloned().enumerate() {
        let (client, driver, pool) = (client.clone(), driver.to_owned(), pool.to_owned());
        let permits = permits.clone();
        reads.spawn(async move {
            let _permit = permits.acquire().await;
            (
                i,
                read_claim(&client, &claim, arrived, &driver, &pool).await,
            )
        });
    }
    let mut done = BTreeMap::new();
    while let Ok(Some(joined)) = tokio::time::timeout_at(deadline, reads.join_next()).await {
        if let Ok((i, read)) = joined {
            done.insert(i, read);
        }
    }
    reads.abort_all();
    claims
        .into_iter()
        .enumerate()
        .map(|(i, (claim, _))| {
            let read = done.remove(&i).unwrap_or_else(|| {
                Err(ReadError::Deadline {
                    claim: claim.clone(),
                    after: limit,
                })
            });
            (claim, read)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_of_the_driver_come_class_first_and_apply_to_their_requests() {
        let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "namespace": "vms", "uid": "u"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [], "config": [
                {"source": "FromClaim", "requests": ["vm"],
                 "opaque": {"driver": "ours.example.com", "parameters": {"n": 0}}},
                {"source": "FromClass",
                 "opaque": {"driver": "theirs.example.com", "parameters": {"n": 1}}},
                {"source": "FromClass", "requests": ["vm/fast"],
                 "opaque": {"driver": "ours.example.com", "parameters": {"n": 2}}},
            ]}}}
        }))
        .unwrap();
        let configs = opaque_configs(&claim, "ours.example.com");
        let order: Vec<(usize, ConfigSource)> =
            configs.iter().map(|c| (c.index, c.source)).collect();
        assert_eq!(order, [(2, ConfigSource::Class), (0, ConfigSource::Claim)]);
        assert_eq!(configs[1].parameters, serde_json::json!({"n": 0}));
        assert_eq!(
            configs[1].field(),
            "status.allocation.devices.config[0].opaque.parameters"
        );
        // `vm` covers its subrequests; `vm/fast` only itself.
        assert!(configs[1].applies_to("vm") && configs[1].applies_to("vm/slow"));
        assert!(configs[0].applies_to("vm/fast") && !configs[0].applies_to("vm/slow"));
        assert!(!configs[0].applies_to("vm") && !configs[1].applies_to("vmx"));
    }
}
