//! This node's ResourceSlices: one pool per node (pool = node name), in as many
//! ResourceSlices of at most 64 devices as it needs, `spec.nodeName` set, owned by
//! the Node so they die with it, written only when something changed and retrying
//! conflicts ([`Slices`]). Counter sets (partitionable devices, KEP-4815) go where
//! the API server's version wants them ([`CounterLayout`]).

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    CounterSet, Device, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams, Preconditions};
use kube::Client;

use crate::api::{ATTEMPTS, REQUEST_TIMEOUT, RESOURCE_API};

/// Standard attribute: the PCI address of a device (`0000:01:00.0`).
pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
/// Standard attribute: the PCIe root complex above a device (`pci0000:00`).
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// The most devices one ResourceSlice of ours holds; a larger pool is published as
/// several slices. The API server allows 128, but only 64 once a device of the
/// slice has taints or consumes counters (1.35 on,
/// `ResourceSliceMaxDevicesWithAdvancedFeatures` in `pkg/apis/resource/types.go`),
/// and ours may have both.
pub(crate) const MAX_DEVICES_PER_SLICE: usize = 64;
/// The most counter sets one slice holds beside no devices (1.35 on,
/// `ResourceSliceMaxCounterSets`).
pub(crate) const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// The most counters, in all its sets, one slice holds beside its devices (1.33 and
/// 1.34, `ResourceSliceMaxSharedCounters`).
pub(crate) const MAX_COUNTERS_BESIDE_DEVICES: usize = 32;
/// What [`RESOURCE_API`] must list for the driver to work.
const RESOURCES: [&str; 2] = ["resourceslices", "resourceclaims"];

/// Whether the API server serves [`RESOURCE_API`] with ResourceSlices and
/// ResourceClaims (its discovery document, `GET /apis/resource.k8s.io/v1`):
/// `Ok(false)` when it answers 404 or lists neither (a server before 1.34, or
/// one with the group version turned off), an error when it could not be asked.
pub(crate) async fn resource_api_served(client: &Client) -> Result<bool, SliceError> {
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
#[non_exhaustive]
pub enum SliceError {
    /// The Node that owns the slices does not exist.
    #[error("Node {node} is not found, and a node-local ResourceSlice needs it as owner")]
    #[allow(missing_docs)]
    NodeMissing { node: String },
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
    #[error(
        "ResourceSlices of driver {driver} on node {node} kept changing under us \
            ({attempts} attempts)"
    )]
    #[allow(missing_docs)]
    Conflicts {
        driver: String,
        node: String,
        /// Attempts made.
        attempts: u32,
    },
}

/// What a publication pass did to the pool ([`crate::Published::report`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// None of its slices existed; all were created.
    Created,
    /// It was out of date: the one slice that differed was rewritten at the
    /// pool's generation, or, when more differed, every slice at a new one.
    Updated,
    /// It was up to date: nothing was written.
    Unchanged,
}

/// The result of one reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// What happened to the pool.
    pub action: Action,
    /// Its slices' names, in order: `<node>-<driver>`, then `-1`, `-2`, … appended
    /// for the second slice on, the driver's dots as dashes.
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
    /// The server dropped the counter sets or the consumed counters this reconcile
    /// wrote (its `DRAPartitionableDevices` gate is off).
    pub counters_dropped: bool,
}

/// Where a pool's counter sets go, which the API server's version decides
/// (`validateResourceSliceSpec` in `pkg/apis/resource/validation/validation.go`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CounterLayout {
    /// 1.33 and 1.34: a device's counter sets in its own slice, at most
    /// [`MAX_COUNTERS_BESIDE_DEVICES`] counters per slice.
    BesideDevices,
    /// 1.35 on: counter sets in slices of their own, at most
    /// [`MAX_COUNTER_SETS_PER_SLICE`] each, and never beside devices.
    Apart,
}

impl CounterLayout {
    /// The layout a server of version `major.minor` validates; a version that
    /// cannot be read is taken as the newer kind (`minor` may carry a `+`).
    pub(crate) fn for_version(major: &str, minor: &str) -> Self {
        let digits = |s: &str| {
            s.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse::<u32>()
                .ok()
        };
        match (digits(major), digits(minor)) {
            (Some(1), Some(minor)) if minor <= 34 => Self::BesideDevices,
            _ => Self::Apart,
        }
    }
}

/// What one slice of the pool holds.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Chunk {
    /// Its devices (`None` in a slice of counter sets alone).
    pub devices: Option<Vec<Device>>,
    /// Its counter sets.
    pub counters: Option<Vec<CounterSet>>,
}

impl Chunk {
    fn devices(&self) -> &[Device] {
        self.devices.as_deref().unwrap_or(&[])
    }
}

fn counters_in(sets: &[CounterSet]) -> usize {
    sets.iter().map(|s| s.counters.len()).sum()
}

/// The counter sets `d` draws on.
fn consumed_sets(d: &Device) -> impl Iterator<Item = &str> {
    d.consumes_counters
        .iter()
        .flatten()
        .map(|c| c.counter_set.as_str())
}

/// The pool cut into slices: `devices` in order, [`MAX_DEVICES_PER_SLICE`] a slice,
/// and `sets` as `layout` wants them: after the devices in slices of their own, or
/// each in the slice of the devices that consume it, those devices kept together
/// (a device that draws on several sets joins them all into one unit). At least
/// one slice, empty when there is nothing.
pub(crate) fn chunks(devices: &[Device], sets: &[CounterSet], layout: CounterLayout) -> Vec<Chunk> {
    let mut out: Vec<Chunk> = Vec::new();
    if sets.is_empty() || layout == CounterLayout::Apart {
        out.extend(devices.chunks(MAX_DEVICES_PER_SLICE).map(|c| Chunk {
            devices: Some(c.to_vec()),
            counters: None,
        }));
        out.extend(sets.chunks(MAX_COUNTER_SETS_PER_SLICE).map(|c| Chunk {
            devices: None,
            counters: Some(c.to_vec()),
        }));
    } else {
        // Units: the devices that share a set travel together with it.
        let mut units: Vec<(Vec<Device>, Vec<String>)> = Vec::new();
        for d in devices {
            let names: Vec<String> = consumed_sets(d).map(str::to_owned).collect();
            let joined: Vec<usize> = (0..units.len())
                .filter(|&i| units[i].1.iter().any(|n| names.contains(n)))
                .collect();
            let mut unit = (vec![d.clone()], names);
            for &i in joined.iter().rev() {
                let (ds, ns) = units.remove(i);
                unit.0.splice(0..0, ds);
                unit.1.extend(ns);
            }
            let at = joined.first().copied().unwrap_or(units.len());
            units.insert(at, unit);
        }
        let set = |n: &String| sets.iter().find(|s| &s.name == n).cloned();
        let mut orphans: Vec<CounterSet> = sets
            .iter()
            .filter(|s| !units.iter().any(|u| u.1.contains(&s.name)))
            .cloned()
            .collect();
        let mut current = Chunk::default();
        for (ds, mut names) in units {
            names.sort();
            names.dedup();
            let mine: Vec<CounterSet> = names.iter().filter_map(set).collect();
            let have = current.counters.as_deref().unwrap_or(&[]);
            let full = current.devices().len() + ds.len() > MAX_DEVICES_PER_SLICE
                || counters_in(have) + counters_in(&mine) > MAX_COUNTERS_BESIDE_DEVICES;
            if full && current.devices.is_some() {
                out.push(std::mem::take(&mut current));
            }
            current.devices.get_or_insert_with(Vec::new).extend(ds);
            if !mine.is_empty() {
                current.counters.get_or_insert_with(Vec::new).extend(mine);
            }
        }
        if current.devices.is_some() {
            out.push(current);
        }
        // Sets no device draws on: a slice of their own (valid on every server).
        while !orphans.is_empty() {
            let rest = orphans.split_off(orphans.len().min(MAX_COUNTER_SETS_PER_SLICE));
            out.push(Chunk {
                devices: None,
                counters: Some(std::mem::replace(&mut orphans, rest)),
            });
        }
    }
    if out.is_empty() {
        out.push(Chunk {
            devices: Some(Vec::new()),
            counters: None,
        });
    }
    out
}

/// What a write that may race another writer came to.
enum Write<T> {
    Done(T),
    /// 409 or 404: re-read and try again.
    Raced,
}

/// The name of `driver`'s first slice on `node`: `<node>-<driver with dots as
/// dashes>`, cut to the 253 characters of a DNS subdomain.
pub(crate) fn slice_name(node: &str, driver: &str) -> String {
    cut(&format!("{node}-{}", driver.replace('.', "-")), 253)
}

fn cut(name: &str, max: usize) -> String {
    let name: String = name.chars().take(max).collect();
    name.trim_end_matches(['-', '.']).to_owned()
}

/// The names of a pool of `count` slices: [`slice_name`], then `<name>-1`,
/// `<name>-2`, … (the base cut so each stays within 253 characters).
pub(crate) fn slice_names(node: &str, driver: &str, count: usize) -> Vec<String> {
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
pub(crate) struct Slices {
    client: Client,
    driver: String,
    node: String,
    /// Learnt from the server's version the first time counter sets are written.
    layout: Option<CounterLayout>,
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

/// A slice holds what `chunk` says: its devices, its counter sets, and a device
/// list only where the chunk has one (1.35 on refuses both in one slice).
fn same_content(s: &ResourceSlice, chunk: &Chunk) -> bool {
    let sets = |c: Option<&Vec<CounterSet>>| c.map_or(&[][..], Vec::as_slice).to_vec();
    same_devices(s.spec.devices.as_ref(), chunk.devices())
        && (chunk.devices.is_some() || s.spec.devices.as_ref().is_none_or(Vec::is_empty))
        && sets(s.spec.shared_counters.as_ref()) == sets(chunk.counters.as_ref())
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

/// Whether the server dropped the counter sets or consumed counters we wrote (the
/// `DRAPartitionableDevices` gate off; `dropDisabledDRAPartitionableDevicesFields`,
/// same file).
fn counters_dropped(sent: &Chunk, written: &ResourceSlice) -> bool {
    let sets_sent = sent.counters.as_ref().is_some_and(|c| !c.is_empty());
    let sets_back = written
        .spec
        .shared_counters
        .as_ref()
        .is_some_and(|c| !c.is_empty());
    (sets_sent && !sets_back)
        || dropped(sent.devices(), written, |d| {
            d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
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
    pub(crate) fn new(client: Client, driver: &str, node: &str) -> Self {
        Self {
            client,
            driver: driver.to_owned(),
            node: node.to_owned(),
            layout: None,
        }
    }

    /// Where this server wants counter sets: read once from its version
    /// (`GET /version`).
    pub(crate) async fn counter_layout(&mut self) -> Result<CounterLayout, SliceError> {
        if let Some(layout) = self.layout {
            return Ok(layout);
        }
        let action = "read the API server's version";
        let info = bounded(action, self.client.apiserver_version())
            .await?
            .map_err(|e| request_error(action, e))?;
        let layout = CounterLayout::for_version(&info.major, &info.minor);
        tracing::debug!(major = %info.major, minor = %info.minor, ?layout,
            "counter sets laid out for this API server");
        self.layout = Some(layout);
        Ok(layout)
    }

    /// Whether the server keeps counter sets in a ResourceSlice (its
    /// `DRAPartitionableDevices` gate is on), asked before any is published: a
    /// create of a slice with one counter set, as a dry run (`dryRun=All`: checked,
    /// admitted and answered, never stored), and whether the answer still has it.
    pub(crate) async fn counters_kept(&self) -> Result<bool, SliceError> {
        let name = {
            let suffix = "-counters-probe";
            format!("{}{suffix}", cut(&self.slice_name(), 253 - suffix.len()))
        };
        let action = format!("create ResourceSlice {name} as a dry run");
        let slice = ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name),
                ..ObjectMeta::default()
            },
            spec: ResourceSliceSpec {
                driver: self.driver.clone(),
                node_name: Some(self.node.clone()),
                pool: ResourcePool {
                    name: self.node.clone(),
                    generation: 0,
                    resource_slice_count: 1,
                },
                shared_counters: Some(vec![CounterSet {
                    name: "probe".into(),
                    counters: [(
                        "probe".to_owned(),
                        k8s_openapi::api::resource::v1::Counter {
                            value: k8s_openapi::apimachinery::pkg::api::resource::Quantity(
                                "1".into(),
                            ),
                        },
                    )]
                    .into(),
                }]),
                ..ResourceSliceSpec::default()
            },
        };
        let pp = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        let back = bounded(&action, self.api().create(&pp, &slice))
            .await?
            .map_err(|e| request_error(&action, e))?;
        Ok(back.spec.shared_counters.is_some_and(|c| !c.is_empty()))
    }

    /// The name our first slice gets ([`slice_name`]).
    pub(crate) fn slice_name(&self) -> String {
        slice_name(&self.node, &self.driver)
    }

    /// The field selector that picks our slices: the API server filters by node
    /// and driver (it has no field selector for the pool name). Lists and watches
    /// of our slices use it.
    pub(crate) fn selector(&self) -> String {
        format!("spec.nodeName={},spec.driver={}", self.node, self.driver)
    }

    fn api(&self) -> Api<ResourceSlice> {
        Api::all(self.client.clone())
    }

    /// True when `s` is one of ours (the selector checked again on this side: a
    /// selector is only as good as the server that applies it).
    pub(crate) fn is_ours(&self, s: &ResourceSlice) -> bool {
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

    fn spec(&self, chunk: &Chunk, generation: i64, count: usize) -> ResourceSliceSpec {
        ResourceSliceSpec {
            driver: self.driver.clone(),
            node_name: Some(self.node.clone()),
            pool: ResourcePool {
                name: self.node.clone(),
                generation,
                resource_slice_count: i64::try_from(count).unwrap_or(i64::MAX),
            },
            devices: chunk.devices.clone(),
            shared_counters: chunk.counters.clone(),
            ..ResourceSliceSpec::default()
        }
    }

    /// [`Slices::reconcile_pool`] without counter sets.
    #[cfg(test)]
    pub(crate) async fn reconcile(&mut self, devices: &[Device]) -> Result<Report, SliceError> {
        self.reconcile_pool(devices, &[]).await
    }

    /// Brings the node's pool to `devices`, in slices of at most
    /// [`MAX_DEVICES_PER_SLICE`]: when one existing slice differs and nothing
    /// else does, that slice alone is rewritten at the pool's generation (one
    /// write is atomic: no consumer sees two generations; a counter slice whose
    /// counters did not change is not written); when more differs — a second
    /// slice, a slice missing, a stray slice of ours — every slice is written
    /// (created or replaced) at a generation one above every slice seen, then the
    /// strays are deleted, as upstream's `syncPool` does; when nothing differs
    /// nothing is written. A write that meets a conflict re-reads and tries
    /// again, [`ATTEMPTS`] times. The counter `sets` the devices draw on go where
    /// the server wants them ([`chunks`], [`Slices::counter_layout`]).
    pub(crate) async fn reconcile_pool(
        &mut self,
        devices: &[Device],
        sets: &[CounterSet],
    ) -> Result<Report, SliceError> {
        let owner = self.owner().await?;
        let layout = if sets.is_empty() {
            CounterLayout::Apart
        } else {
            self.counter_layout().await?
        };
        let chunks = chunks(devices, sets, layout);
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
            let stale: Vec<usize> = current
                .iter()
                .zip(&chunks)
                .enumerate()
                .filter(|(_, (s, chunk))| {
                    !s.is_some_and(|s| self.up_to_date(s, chunk, &owner, top, chunks.len()))
                })
                .map(|(i, _)| i)
                .collect();
            if strays.is_empty() && stale.is_empty() {
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
                    counters_dropped: false,
                });
            }
            // One slice to write, and nothing else to change: it is rewritten at
            // the pool's generation, alone, and the others (the counter slice
            // among them) are left as they are. Any more, and the generation goes
            // up on every slice, so no consumer mixes old slices with new ones
            // (`syncPool` in k8s.io/dynamic-resource-allocation's
            // resourceslice/resourceslicecontroller.go: "at most one update API
            // call is necessary").
            let alone = match stale[..] {
                [i] if strays.is_empty()
                    && current[i].is_some_and(|s| {
                        s.spec.pool.generation == top
                            && usize::try_from(s.spec.pool.resource_slice_count) == Ok(chunks.len())
                    }) =>
                {
                    Some(i)
                }
                _ => None,
            };
            let generation = if alone.is_some() { top } else { top + 1 };
            let mut versions = Vec::new();
            let mut raced = false;
            let mut dropped = false;
            let mut binding_lost = false;
            let mut counters_lost = false;
            let mut written_count = 0;
            for (i, ((name, have), chunk)) in names.iter().zip(&current).zip(&chunks).enumerate() {
                if alone.is_some_and(|a| a != i) {
                    versions.extend(have.map(version));
                    continue;
                }
                written_count += 1;
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
                        dropped |= taints_dropped(chunk.devices(), &s);
                        binding_lost |= binding_dropped(chunk.devices(), &s);
                        counters_lost |= counters_dropped(chunk, &s);
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
            tracing::info!(
                slices = %names.join(","),
                written = written_count,
                ?action,
                generation,
                devices = devices.len(),
                "ResourceSlices written"
            );
            let created = current.iter().filter(|s| s.is_none()).count();
            return Ok(Report {
                action,
                created,
                updated: written_count - created,
                names,
                generation,
                deleted,
                versions,
                taints_dropped: dropped,
                binding_dropped: binding_lost,
                counters_dropped: counters_lost,
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
        chunk: &Chunk,
        owner: &OwnerReference,
        top: i64,
        count: usize,
    ) -> bool {
        let pool = &s.spec.pool;
        pool.name == self.node
            && usize::try_from(pool.resource_slice_count) == Ok(count)
            && pool.generation == top
            && same_content(s, chunk)
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
        chunk: &Chunk,
        owner: &OwnerReference,
        generation: i64,
        count: usize,
    ) -> Result<Write<ResourceSlice>, SliceError> {
        let name = current.metadata.name.clone().unwrap_or_default();
        let action = format!("update ResourceSlice {name}");
        let mut slice = current.clone();
        slice.spec = self.spec(chunk, generation, count);
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
        chunk: &Chunk,
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
            spec: self.spec(chunk, generation, count),
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
    pub(crate) async fn delete_all(&self) -> Result<Vec<String>, SliceError> {
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

    fn pair(g: usize) -> [Device; 2] {
        let d = |f: usize| Device {
            name: format!("g{g}-f{f}"),
            consumes_counters: Some(vec![
                k8s_openapi::api::resource::v1::DeviceCounterConsumption {
                    counter_set: format!("g{g}"),
                    counters: Default::default(),
                },
            ]),
            ..Device::default()
        };
        [d(0), d(1)]
    }

    fn set(g: usize) -> CounterSet {
        CounterSet {
            name: format!("g{g}"),
            counters: [(
                "held".to_owned(),
                k8s_openapi::api::resource::v1::Counter {
                    value: k8s_openapi::apimachinery::pkg::api::resource::Quantity("1".into()),
                },
            )]
            .into(),
        }
    }

    #[test]
    fn chunks_keep_the_limits_of_each_layout_and_a_group_with_its_set() {
        // 40 groups of two and 10 devices alone: 90 devices, 40 sets.
        let mut devices: Vec<Device> = (0..40).flat_map(pair).collect();
        devices.extend((0..10).map(|i| Device {
            name: format!("solo-{i}"),
            ..Device::default()
        }));
        let sets: Vec<CounterSet> = (0..40).map(set).collect();
        for layout in [CounterLayout::BesideDevices, CounterLayout::Apart] {
            let out = chunks(&devices, &sets, layout);
            let all: Vec<&Device> = out.iter().flat_map(|c| c.devices()).collect();
            assert_eq!(all.len(), 90, "{layout:?}: every device once");
            let names: Vec<&str> = out
                .iter()
                .flat_map(|c| c.counters.iter().flatten())
                .map(|s| s.name.as_str())
                .collect();
            assert_eq!(names.len(), 40, "{layout:?}: every set once");
            for c in &out {
                assert!(c.devices().len() <= MAX_DEVICES_PER_SLICE);
                let n = c.counters.as_ref().map_or(0, Vec::len);
                match layout {
                    CounterLayout::Apart => {
                        assert!(c.devices.is_none() || c.counters.is_none(), "never both");
                        assert!(n <= MAX_COUNTER_SETS_PER_SLICE);
                    }
                    CounterLayout::BesideDevices => {
                        assert!(n <= MAX_COUNTERS_BESIDE_DEVICES);
                        // Every set a device draws on is in its slice.
                        for d in c.devices() {
                            for used in consumed_sets(d) {
                                assert!(
                                    c.counters.iter().flatten().any(|s| s.name == used),
                                    "{} without {used}",
                                    d.name
                                );
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(chunks(&devices, &sets, CounterLayout::Apart).len(), 2 + 5);
        assert_eq!(
            chunks(&devices, &sets, CounterLayout::BesideDevices).len(),
            2,
            "32 sets fill the first slice"
        );
        assert_eq!(
            chunks(&[], &[], CounterLayout::BesideDevices),
            [Chunk {
                devices: Some(Vec::new()),
                counters: None
            }]
        );
    }

    #[test]
    fn versions_choose_the_layout() {
        for (major, minor, want) in [
            ("1", "34", CounterLayout::BesideDevices),
            ("1", "33+", CounterLayout::BesideDevices),
            ("1", "35", CounterLayout::Apart),
            ("1", "37", CounterLayout::Apart),
            ("2", "0", CounterLayout::Apart),
            ("", "", CounterLayout::Apart),
        ] {
            assert_eq!(
                CounterLayout::for_version(major, minor),
                want,
                "{major}.{minor}"
            );
        }
    }
}
