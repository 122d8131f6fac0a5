//! This node's ResourceSlices: one pool per node (pool = node name), in as many
//! ResourceSlices of at most 128 devices as it needs, `spec.nodeName` set, owned by
//! the Node so they die with it, written only when something changed and retrying
//! conflicts ([`Slices`]).
//!
//! ```no_run
//! # async fn f(client: kube::Client, devices: Vec<k8s_openapi::api::resource::v1::Device>) -> Result<(), Box<dyn std::error::Error>> {
//! use kubelet_plugin::slices::Slices;
//! let mut slices = Slices::new(client, "gpu.example.com", "node-a");
//! let report = slices.reconcile(&devices).await?;
//! println!("{:?} generation {}", report.action, report.generation);
//! # Ok(()) }
//! ```

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{Device, ResourcePool, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams, Preconditions};
use kube::Client;

/// Standard attribute: the PCI address of a device (`0000:01:00.0`).
pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
/// Standard attribute: the PCIe root complex above a device (`pci0000:00`).
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// The most devices one ResourceSlice may hold (API validation); a larger pool is
/// published as several slices.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Upper bound for one request to the API server.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How often [`Slices::reconcile`] re-reads and tries again after a conflict.
pub const ATTEMPTS: u32 = 5;
/// The group version of every ResourceSlice and ResourceClaim this driver reads
/// and writes, served from Kubernetes 1.34 on.
pub const RESOURCE_API: &str = "resource.k8s.io/v1";
/// What [`RESOURCE_API`] must list for the driver to work.
const RESOURCES: [&str; 2] = ["resourceslices", "resourceclaims"];

/// Whether the API server serves [`RESOURCE_API`] with ResourceSlices and
/// ResourceClaims (its discovery document, `GET /apis/resource.k8s.io/v1`):
/// `Ok(false)` when it answers 404 or lists neither (a server before 1.34, or
/// one with the group version turned off), an error when it could not be asked.
pub async fn resource_api_served(client: &Client) -> Result<bool, SliceError> {
    let action = format!("read the API server's discovery of {RESOURCE_API}");
    match bounded(&action, client.list_api_group_resources(RESOURCE_API)).await? {
        Ok(list) => Ok(RESOURCES
            .iter()
            .all(|r| list.resources.iter().any(|have| have.name == *r))),
        Err(e) if api_status(&e).is_some_and(|s| s.code == 404) => Ok(false),
        Err(e) => Err(request_error(&action, e)),
    }
}

/// Why the ResourceSlices could not be brought up to date.
#[derive(Debug, thiserror::Error)]
pub enum SliceError {
    /// The Node that owns the slices does not exist.
    #[error("Node {node} is not found, and a node-local ResourceSlice needs it as owner")]
    NodeMissing {
        /// The node.
        node: String,
    },
    /// A request failed.
    #[error("failed to {action}")]
    Request {
        /// What was asked (`update ResourceSlice node-a-...`).
        action: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// A request took too long.
    #[error("{action} timed out after {after:?}")]
    Timeout {
        /// What was asked.
        action: String,
        /// The limit.
        after: Duration,
    },
    /// Another writer kept changing the slices.
    #[error("ResourceSlices of driver {driver} on node {node} kept changing under us ({attempts} attempts)")]
    Conflicts {
        /// Our driver.
        driver: String,
        /// Our node.
        node: String,
        /// Attempts made.
        attempts: u32,
    },
}

/// What [`Slices::reconcile`] did to the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// None of its slices existed; all were created.
    Created,
    /// It was out of date; its slices were rewritten at a new generation.
    Updated,
    /// It was up to date: nothing was written.
    Unchanged,
}

/// The result of one reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// What happened to the pool.
    pub action: Action,
    /// Its slices' names, in order ([`slice_names`]).
    pub names: Vec<String>,
    /// The pool generation they carry now.
    pub generation: i64,
    /// Slices created by this reconcile.
    pub created: usize,
    /// Slices rewritten by this reconcile.
    pub updated: usize,
    /// Other slices of ours on this node that were deleted (duplicates, stale pools).
    pub deleted: Vec<String>,
    /// `(name, resourceVersion)` of each of our slices as they stand now: a watch
    /// event carrying one of these is our own write.
    pub versions: Vec<(String, String)>,
    /// The server dropped the device taints this reconcile wrote.
    pub taints_dropped: bool,
    /// The server dropped the binding conditions this reconcile wrote.
    pub binding_dropped: bool,
}

/// What a write that may race another writer came to.
enum Write<T> {
    Done(T),
    /// 409 or 404: re-read and try again.
    Raced,
}

/// The name of `driver`'s first slice on `node`: `<node>-<driver with dots as
/// dashes>`, cut to the 253 characters of a DNS subdomain.
pub fn slice_name(node: &str, driver: &str) -> String {
    cut(&format!("{node}-{}", driver.replace('.', "-")), 253)
}

fn cut(name: &str, max: usize) -> String {
    let name: String = name.chars().take(max).collect();
    name.trim_end_matches(['-', '.']).to_owned()
}

/// The names of a pool of `count` slices: [`slice_name`], then `<name>-1`,
/// `<name>-2`, … (the base cut so each stays within 253 characters).
pub fn slice_names(node: &str, driver: &str, count: usize) -> Vec<String> {
    let base = slice_name(node, driver);
    (0..count.max(1))
        .map(|i| match i {
            0 => base.clone(),
            i => {
                let suffix = format!("-{i}");
                format!("{}{suffix}", cut(&base, 253 - suffix.len()))
            }
        })
        .collect()
}

/// The ResourceSlices of one driver on one node: one pool named after the node, in
/// as many slices as its devices need ([`MAX_DEVICES_PER_SLICE`] each, at least
/// one), all at one pool generation with `resourceSliceCount` set, as upstream's
/// ResourceSlice controller publishes a pool
/// (`staging/src/k8s.io/dynamic-resource-allocation/resourceslice/resourceslicecontroller.go`).
///
/// The slices have fixed names ([`slice_names`]) rather than upstream's
/// `generateName`: a create whose answer is lost and that is retried then meets
/// `AlreadyExists` and re-reads, instead of leaving a second slice behind (upstream
/// needs a mutation cache for that). Slices of ours found under other names are
/// deleted, after the pool's new generation is written (consumers use only the
/// newest generation of a pool, so the pool is never seen incomplete).
pub struct Slices {
    client: Client,
    driver: String,
    node: String,
}

impl std::fmt::Debug for Slices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slices")
            .field("driver", &self.driver)
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

async fn bounded<T>(
    action: &str,
    fut: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<Result<T, kube::Error>, SliceError> {
    tokio::time::timeout(REQUEST_TIMEOUT, fut)
        .await
        .map_err(|_| SliceError::Timeout {
            action: action.to_owned(),
            after: REQUEST_TIMEOUT,
        })
}

fn request_error(action: &str, source: kube::Error) -> SliceError {
    SliceError::Request {
        action: action.to_owned(),
        source,
    }
}

fn api_status(e: &kube::Error) -> Option<&kube::core::Status> {
    match e {
        kube::Error::Api(s) => Some(s),
        _ => None,
    }
}

fn generation(s: &ResourceSlice) -> i64 {
    s.spec.pool.generation
}

/// Devices equal, reading an absent list as an empty one (the server omits it).
/// The server stamps each taint with `timeAdded`; ours carry none.
fn same_devices(have: Option<&Vec<Device>>, want: &[Device]) -> bool {
    let have = have.map_or(&[][..], Vec::as_slice);
    have.len() == want.len()
        && have.iter().zip(want).all(|(h, w)| {
            let mut h = h.clone();
            for t in h.taints.iter_mut().flatten() {
                t.time_added = None;
            }
            &h == w
        })
}

/// Whether the server dropped a list we wrote: a device we sent with a non-empty
/// `field` came back without it.
fn dropped(sent: &[Device], written: &ResourceSlice, field: impl Fn(&Device) -> bool) -> bool {
    let back = written.spec.devices.as_deref().unwrap_or(&[]);
    sent.iter().filter(|d| field(d)).any(|d| {
        back.iter()
            .find(|b| b.name == d.name)
            .is_none_or(|b| !field(b))
    })
}

/// Whether the server dropped taints we wrote (the `DRADeviceTaints` gate off, or a
/// server before it; `dropDisabledFields` in
/// `pkg/registry/resource/resourceslice/strategy.go`).
fn taints_dropped(sent: &[Device], written: &ResourceSlice) -> bool {
    dropped(sent, written, |d| {
        d.taints.as_ref().is_some_and(|t| !t.is_empty())
    })
}

/// Whether the server dropped the binding conditions we wrote: it clears them
/// unless both `DRADeviceBindingConditions` and `DRAResourceClaimDeviceStatus` are
/// on (`dropDisabledDRADeviceBindingConditionsFields`, same file).
fn binding_dropped(sent: &[Device], written: &ResourceSlice) -> bool {
    dropped(sent, written, |d| {
        d.binding_conditions.as_ref().is_some_and(|c| !c.is_empty())
    })
}

fn version(s: &ResourceSlice) -> (String, String) {
    (
        s.metadata.name.clone().unwrap_or_default(),
        s.metadata.resource_version.clone().unwrap_or_default(),
    )
}

impl Slices {
    /// The slices of `driver` for `node` (whose pool is named after it).
    pub fn new(client: Client, driver: &str, node: &str) -> Self {
        Self {
            client,
            driver: driver.to_owned(),
            node: node.to_owned(),
        }
    }

    /// The pool: this node's name.
    pub fn pool(&self) -> &str {
        &self.node
    }

    /// The driver whose slices these are.
    pub fn driver(&self) -> &str {
        &self.driver
    }

    /// The name our first slice gets ([`slice_name`]).
    pub fn slice_name(&self) -> String {
        slice_name(&self.node, &self.driver)
    }

    /// The field selector that picks our slices: the API server filters by node
    /// and driver (it has no field selector for the pool name). Lists and watches
    /// of our slices use it.
    pub fn selector(&self) -> String {
        format!("spec.nodeName={},spec.driver={}", self.node, self.driver)
    }

    fn api(&self) -> Api<ResourceSlice> {
        Api::all(self.client.clone())
    }

    /// True when `s` is one of ours (the selector checked again on this side: a
    /// selector is only as good as the server that applies it).
    pub fn is_ours(&self, s: &ResourceSlice) -> bool {
        s.spec.driver == self.driver && s.spec.node_name.as_deref() == Some(&self.node)
    }

    /// Our slices, sorted by name.
    async fn list(&self) -> Result<Vec<ResourceSlice>, SliceError> {
        let action = format!(
            "list ResourceSlices of driver {} on node {}",
            self.driver, self.node
        );
        let lp = ListParams::default().fields(&self.selector());
        let list = bounded(&action, self.api().list(&lp))
            .await?
            .map_err(|e| request_error(&action, e))?;
        let mut ours: Vec<ResourceSlice> =
            list.items.into_iter().filter(|s| self.is_ours(s)).collect();
        ours.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        Ok(ours)
    }

    /// The owner reference to this node, read at every reconcile: a Node deleted
    /// and created again has a new uid, and a slice owned by the old one would be
    /// deleted by the garbage collector.
    async fn owner(&self) -> Result<OwnerReference, SliceError> {
        let action = format!("get Node {}", self.node);
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = bounded(&action, nodes.get_opt(&self.node))
            .await?
            .map_err(|e| request_error(&action, e))?
            .ok_or_else(|| SliceError::NodeMissing {
                node: self.node.clone(),
            })?;
        Ok(OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: self.node.clone(),
            uid: node.metadata.uid.unwrap_or_default(),
            controller: Some(true),
            block_owner_deletion: None,
        })
    }

    fn spec(&self, devices: &[Device], generation: i64, count: usize) -> ResourceSliceSpec {
        ResourceSliceSpec {
            driver: self.driver.clone(),
            node_name: Some(self.node.clone()),
            pool: ResourcePool {
                name: self.node.clone(),
                generation,
                resource_slice_count: i64::try_from(count).unwrap_or(i64::MAX),
            },
            devices: Some(devices.to_vec()),
            ..ResourceSliceSpec::default()
        }
    }

    /// Brings the node's pool to `devices`, in slices of at most
    /// [`MAX_DEVICES_PER_SLICE`]: when anything differs — a device, a slice
    /// missing, the owner, a stray slice of ours — every slice is written (created
    /// or replaced) at a generation one above every slice seen, then the strays
    /// are deleted; when nothing differs nothing is written. A write that meets a
    /// conflict re-reads and tries again, [`ATTEMPTS`] times.
    pub async fn reconcile(&mut self, devices: &[Device]) -> Result<Report, SliceError> {
        let owner = self.owner().await?;
        let chunks: Vec<&[Device]> = if devices.is_empty() {
            vec![&[]]
        } else {
            devices.chunks(MAX_DEVICES_PER_SLICE).collect()
        };
        let names = slice_names(&self.node, &self.driver, chunks.len());
        for _ in 0..ATTEMPTS {
            let slices = self.list().await?;
            let top = slices.iter().map(generation).max().unwrap_or(0);
            let current: Vec<Option<&ResourceSlice>> = names
                .iter()
                .map(|n| {
                    slices.iter().find(|s| {
                        s.metadata.name.as_deref() == Some(n) && s.spec.pool.name == self.node
                    })
                })
                .collect();
            let strays: Vec<&ResourceSlice> = slices
                .iter()
                .filter(|s| !current.iter().flatten().any(|c| std::ptr::eq(*c, *s)))
                .collect();
            let up_to_date = strays.is_empty()
                && current.iter().zip(&chunks).all(|(s, chunk)| {
                    s.is_some_and(|s| self.up_to_date(s, chunk, &owner, top, chunks.len()))
                });
            if up_to_date {
                return Ok(Report {
                    action: Action::Unchanged,
                    names,
                    generation: top,
                    created: 0,
                    updated: 0,
                    deleted: Vec::new(),
                    versions: slices.iter().map(version).collect(),
                    taints_dropped: false,
                    binding_dropped: false,
                });
            }
            let generation = top + 1;
            let mut versions = Vec::new();
            let mut raced = false;
            let mut dropped = false;
            let mut binding_lost = false;
            for ((name, have), chunk) in names.iter().zip(&current).zip(&chunks) {
                let written = match have {
                    Some(s) => {
                        self.replace(s, chunk, &owner, generation, chunks.len())
                            .await?
                    }
                    None => {
                        self.create(name, chunk, &owner, generation, chunks.len())
                            .await?
                    }
                };
                match written {
                    Write::Done(s) => {
                        dropped |= taints_dropped(chunk, &s);
                        binding_lost |= binding_dropped(chunk, &s);
                        versions.push(version(&s));
                    }
                    Write::Raced => {
                        raced = true;
                        break;
                    }
                }
            }
            if raced {
                continue;
            }
            let mut deleted = Vec::new();
            for s in &strays {
                match self.delete(s).await? {
                    Write::Done(n) => deleted.push(n),
                    Write::Raced => raced = true,
                }
            }
            if raced {
                continue;
            }
            let action = if current.iter().all(Option::is_none) {
                Action::Created
            } else {
                Action::Updated
            };
            tracing::info!(slices = %names.join(","), ?action, generation, devices = devices.len(), "ResourceSlices written");
            let created = current.iter().filter(|s| s.is_none()).count();
            return Ok(Report {
                action,
                created,
                updated: names.len() - created,
                names,
                generation,
                deleted,
                versions,
                taints_dropped: dropped,
                binding_dropped: binding_lost,
            });
        }
        Err(SliceError::Conflicts {
            driver: self.driver.clone(),
            node: self.node.clone(),
            attempts: ATTEMPTS,
        })
    }

    fn up_to_date(
        &self,
        s: &ResourceSlice,
        devices: &[Device],
        owner: &OwnerReference,
        top: i64,
        count: usize,
    ) -> bool {
        let pool = &s.spec.pool;
        pool.name == self.node
            && usize::try_from(pool.resource_slice_count) == Ok(count)
            && pool.generation == top
            && same_devices(s.spec.devices.as_ref(), devices)
            && s.spec.node_selector.is_none()
            && s.spec.all_nodes.is_none_or(|a| !a)
            && s.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.uid == owner.uid && o.kind == "Node")
    }

    async fn replace(
        &self,
        current: &ResourceSlice,
        devices: &[Device],
        owner: &OwnerReference,
        generation: i64,
        count: usize,
    ) -> Result<Write<ResourceSlice>, SliceError> {
        let name = current.metadata.name.clone().unwrap_or_default();
        let action = format!("update ResourceSlice {name}");
        let mut slice = current.clone();
        slice.spec = self.spec(devices, generation, count);
        let mut owners: Vec<OwnerReference> = slice
            .metadata
            .owner_references
            .take()
            .unwrap_or_default()
            .into_iter()
            .filter(|o| o.kind != "Node")
            .collect();
        owners.push(owner.clone());
        slice.metadata.owner_references = Some(owners);
        match bounded(
            &action,
            self.api().replace(&name, &PostParams::default(), &slice),
        )
        .await?
        {
            Ok(s) => Ok(Write::Done(s)),
            Err(e) if api_status(&e).is_some_and(|s| s.is_conflict() || s.is_not_found()) => {
                tracing::debug!(slice = %name, "ResourceSlice changed meanwhile; reading it again");
                Ok(Write::Raced)
            }
            Err(e) => Err(request_error(&action, e)),
        }
    }

    async fn create(
        &self,
        name: &str,
        devices: &[Device],
        owner: &OwnerReference,
        generation: i64,
        count: usize,
    ) -> Result<Write<ResourceSlice>, SliceError> {
        let action = format!("create ResourceSlice {name}");
        let slice = ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                owner_references: Some(vec![owner.clone()]),
                ..ObjectMeta::default()
            },
            spec: self.spec(devices, generation, count),
        };
        match bounded(&action, self.api().create(&PostParams::default(), &slice)).await? {
            Ok(s) => Ok(Write::Done(s)),
            Err(e) if api_status(&e).is_some_and(|s| s.is_already_exists() || s.is_conflict()) => {
                Ok(Write::Raced)
            }
            Err(e) => Err(request_error(&action, e)),
        }
    }

    /// Deletes `s` if it is still the version we read; gone already counts as done.
    async fn delete(&self, s: &ResourceSlice) -> Result<Write<String>, SliceError> {
        let name = s.metadata.name.clone().unwrap_or_default();
        let action = format!("delete ResourceSlice {name}");
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: s.metadata.uid.clone(),
                resource_version: s.metadata.resource_version.clone(),
            }),
            ..DeleteParams::default()
        };
        match bounded(&action, self.api().delete(&name, &dp)).await? {
            Ok(_) => {
                tracing::info!(slice = %name, "ResourceSlice deleted");
                Ok(Write::Done(name))
            }
            Err(e) if api_status(&e).is_some_and(|s| s.is_not_found()) => Ok(Write::Done(name)),
            Err(e) if api_status(&e).is_some_and(|s| s.is_conflict()) => Ok(Write::Raced),
            Err(e) => Err(request_error(&action, e)),
        }
    }

    /// Deletes every slice of this driver on this node (a clean uninstall); the
    /// names deleted.
    pub async fn delete_all(&self) -> Result<Vec<String>, SliceError> {
        let mut deleted = Vec::new();
        for _ in 0..ATTEMPTS {
            let mut raced = false;
            for s in self.list().await? {
                match self.delete(&s).await? {
                    Write::Done(n) => deleted.push(n),
                    Write::Raced => raced = true,
                }
            }
            if !raced {
                return Ok(deleted);
            }
        }
        Err(SliceError::Conflicts {
            driver: self.driver.clone(),
            node: self.node.clone(),
            attempts: ATTEMPTS,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_names_are_dns_subdomains_of_bounded_length() {
        assert_eq!(
            slice_name("node-a", "vfio-sandbox.rebellions.ai"),
            "node-a-vfio-sandbox-rebellions-ai"
        );
        let long = slice_name(&"n".repeat(252), "vfio-sandbox.rebellions.ai");
        assert_eq!(
            long.len(),
            252,
            "cut to 253, then the trailing dash dropped"
        );
        assert!(!long.ends_with('-'));
    }

    #[test]
    fn fields_the_server_drops_are_noticed() {
        let sent = vec![
            Device {
                name: "a".into(),
                binding_conditions: Some(vec!["d.example.com/VfioReady".into()]),
                binding_failure_conditions: Some(vec!["d.example.com/VfioFailed".into()]),
                binds_to_node: Some(true),
                taints: Some(vec![k8s_openapi::api::resource::v1::DeviceTaint {
                    key: "d.example.com/unhealthy".into(),
                    value: Some("Gone".into()),
                    effect: "NoSchedule".into(),
                    time_added: None,
                }]),
                ..Device::default()
            },
            Device {
                name: "b".into(),
                ..Device::default()
            },
        ];
        let mut back = ResourceSlice {
            metadata: Default::default(),
            spec: ResourceSliceSpec {
                devices: Some(sent.clone()),
                ..Default::default()
            },
        };
        assert!(!binding_dropped(&sent, &back));
        assert!(!taints_dropped(&sent, &back));
        for d in back.spec.devices.iter_mut().flatten() {
            d.binding_conditions = None;
            d.binding_failure_conditions = None;
            d.binds_to_node = None;
            d.taints = None;
        }
        assert!(binding_dropped(&sent, &back));
        assert!(taints_dropped(&sent, &back));
    }
}
