//! The files prepare writes for a claim: the CDI spec and the device metadata.
//!
//! Pure functions: [`claim_files`] turns a prepared claim into the exact bytes of
//! every file and the CDI device ids kubelet gets back; the DRA engine writes the
//! files atomically and removes [`cdi_spec_path`] and [`metadata_claim_dir`] at
//! unprepare. Every name that reaches a path or a CDI id comes from outside
//! (kubelet, the API server), so each is checked against the grammar Kubernetes
//! gives it; anything else is an error, never a path outside the two directories.
//!
//! # The CDI spec ([`kubelet_plugin::cdi`], which says what upstream requires)
//!
//! One spec per claim, `<cdi dir>/<driver>-vfio_<claim uid>.json`, of kind
//! `<driver>/vfio` (a driver name that starts with a letter is a valid vendor).
//! Each device node is written with `permissions: "mrw"`, as the device plugin's
//! `Allocate` does, and with a `hostPath` only when `--dev-root` is not `/dev`.
//! Device names carry the claim UID after a name that starts with a letter:
//! `<slice device name>-<claim uid>` (e.g. `pci-0000-01-00-0-<uid>`) for a
//! function's device nodes, `metadata-<request>-<claim uid>` for a request's
//! metadata mount and variables.
//!
//! KubeVirt's `PCI_RESOURCE_<NAME>=<bdf>[,<bdf>...]`, as the device plugin's
//! `Allocate` sets it, so a VM written for the device plugin also runs on a
//! claim made for its extended resource (KEP-5004), is set on the request's own
//! CDI device, with the addresses of that request's devices of each resource
//! name. kubelet hands a container the CDI ids of the requests it was given
//! (`resources.claims[].request`), so a container sees exactly its own devices;
//! set in the spec's own edits, the variable would reach every container given
//! any device of the claim. A variable set twice keeps its last value, so a
//! container given two requests with devices of one resource name sees one
//! request's addresses: give such a VM one request per name.
//!
//! Every function device is self-sufficient: its edits give `/dev/vfio/vfio` and its
//! `/dev/vfio/<group>` (two functions of one group repeat the group node, which
//! the runtime then creates once) and, when iommufd is asked for, also
//! `/dev/iommu` and its `/dev/vfio/devices/vfioN`, in the device plugin's order.
//!
//! # The device metadata (KEP-5304, [`kubelet_plugin::metadata`])
//!
//! One file per request, rendered by the library (`generation` 1: we never rewrite
//! a prepared claim's file). Every device carries `resource.kubernetes.io/pciBusID`,
//! which KubeVirt takes for the `<hostdev>` address (after `mdevUUID`, which we
//! never set).
//!
//! - Exposure: a read-only bind mount through CDI (`options: ["ro", "bind"]`). The
//!   upstream helper writes it as a separate spec of kind `<driver>/metadata`; we keep
//!   one spec file per claim, so the mount is a device of our own kind, one per
//!   request, and its id is returned for every function device of that request.
//! - Host path: the protocol leaves it to the driver. Upstream uses
//!   `<kubelet>/plugins/<driver>/dra-device-metadata/<namespace>_<claim>/<request>/metadata.json`;
//!   ours is `<metadata dir>/<driver>/<claim uid>/<request>/metadata.json`. The driver
//!   segment keeps drivers apart if the directory is shared, and the UID (unlike
//!   `<namespace>_<name>`) cannot be reused by a recreated claim before the old one is
//!   unprepared.
//! - Second container path, for KubeVirt 1.8.0–1.8.2: those releases read the
//!   earlier KEP draft's layout,
//!   `/var/run/dra-device-attributes/<claim name>/<request>/*-metadata.json`, and for
//!   a template claim glob `/var/run/dra-device-attributes/*/<request>/` and match
//!   the file's `podClaimName`; the `kubernetes.io` layout arrived in KubeVirt 1.8.3.
//!   The same file is mounted there too ([`LEGACY_CONTAINER_METADATA_DIR`]), always
//!   under the claim's own name, so every KubeVirt from 1.8.0 finds it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::model::DeviceName;
use kubelet_plugin::cdi::{self as spec, ContainerEdits, Device, DeviceNode, Mount, Spec};
use kubelet_plugin::metadata::{self, MetadataDevice};
pub use kubelet_plugin::metadata::{AttributeValue, CONTAINER_METADATA_DIR};
use kubelet_plugin::ClaimRef;
use kubelet_plugin::PCI_BUS_ID;
use passthrough::config::ResourceName;
use sysfs_pci::PciAddress;

mod names;

use names::*;

/// Where CDI spec files go by default.
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";
/// The host directory the metadata files go to by default (see the module docs).
pub const DEFAULT_METADATA_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";
/// The CDI class of our kind, `<driver>/vfio`.
pub const CDI_CLASS: &str = "vfio";
/// Where KubeVirt 1.8.0–1.8.2 look for metadata files (the KEP draft's layout):
/// `<dir>/<claim name>/<request>/<driver>-metadata.json`.
pub const LEGACY_CONTAINER_METADATA_DIR: &str = "/var/run/dra-device-attributes";

/// Permissions of every device node, as in the device plugin's `Allocate`.
const PERMISSIONS: &str = "mrw";

/// One prepared device of a claim (a function, or a whole IOMMU group), as
/// prepare knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct SpecDevice {
    /// The ResourceSlice device name: `device_name(address)`, or for a whole
    /// group `group_device_name(address)` (`model.rs`).
    pub device_name: String,
    /// Its pool (the node's name).
    pub pool: String,
    /// The claim requests it satisfies (`request` or `request/subrequest`).
    pub request_names: Vec<String>,
    /// Its PCI address (a group's lowest function).
    pub address: PciAddress,
    /// A whole group's other functions, handed over with it.
    pub functions: Vec<PciAddress>,
    pub group: u32,
    /// Its ResourceSlice attributes; [`PCI_BUS_ID`] is added when missing.
    pub attributes: BTreeMap<String, AttributeValue>,
    /// Hand out its group nodes (`/dev/vfio/vfio`, `/dev/vfio/<group>`): the legacy
    /// interface.
    pub group_nodes: bool,
    /// Its iommufd node names (`vfioN` under `/dev/vfio/devices/`, one per
    /// function), when iommufd is asked for: handed out with `/dev/iommu`.
    pub iommufd_nodes: Vec<String>,
    /// Its resource name, whose KubeVirt variable (`PCI_RESOURCE_<NAME>`) names
    /// it to the VM, when it has one.
    pub resource: Option<ResourceName>,
}

/// Everything prepare writes for a claim, and what it returns to kubelet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimFiles {
    /// The CDI spec: its path and exact text.
    pub cdi: (PathBuf, String),
    /// One metadata file per request: path and exact text.
    pub metadata: Vec<(PathBuf, String)>,
    /// The fully qualified CDI device ids of each device, by slice device name.
    pub device_ids: BTreeMap<String, Vec<String>>,
}

/// Why the files for a claim cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// A name from outside does not follow its grammar.
    #[error("invalid {what} {}: {reason}", shown(value))]
    #[allow(missing_docs)]
    InvalidName {
        /// Which name (driver name, claim UID, request name, …).
        what: &'static str,
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A directory that ends up in a spec is not absolute UTF-8.
    #[error("{what} {path:?} must be an absolute UTF-8 path")]
    #[allow(missing_docs)]
    InvalidDir { what: &'static str, path: PathBuf },
    /// The claim has no device of ours.
    #[error("claim {0} has no devices to prepare")]
    NoDevices(String),
    /// A device appears twice in the claim.
    #[error("device {0} appears twice in the claim")]
    DuplicateDevice(String),
    /// A device satisfies no request.
    #[error("device {0} satisfies no request")]
    NoRequest(String),
    /// A device's name is not the name of its address.
    #[error("device name {name:?} does not name {address}")]
    #[allow(missing_docs)]
    DeviceNameMismatch { name: String, address: PciAddress },
    /// A device's pciBusID attribute is not its address.
    #[error("device {device}: attribute {PCI_BUS_ID} is {value:?}, not {address}")]
    #[allow(missing_docs)]
    PciBusIdMismatch {
        device: String,
        value: AttributeValue,
        address: PciAddress,
    },
    /// Two subrequests of one request in the same claim.
    #[error("request {request} is allocated through both {first} and {second}")]
    #[allow(missing_docs)]
    SubrequestConflict {
        request: String,
        first: String,
        second: String,
    },
    /// JSON encoding failed (cannot happen with these types).
    #[error("encoding a claim file")]
    Encode(#[source] serde_json::Error),
}

/// A driver name that can name a claim's files: a DNS subdomain of at most 63
/// characters (a ResourceSlice's `spec.driver`) that starts with a letter (a CDI
/// vendor), in lowercase (Kubernetes takes `spec.driver` in any case, but it is
/// also the prefix of the binding conditions' types and the claim label's key).
/// Checked once, at start: every claim's paths and ids are made of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverName(String);

impl DriverName {
    /// `name`, checked.
    pub fn new(name: &str) -> Result<Self, CdiError> {
        check_driver(name)?;
        Ok(Self(name.to_owned()))
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for DriverName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The CDI kind of a driver's specs, `<driver>/vfio`.
pub fn cdi_kind(driver: &DriverName) -> String {
    format!("{driver}/{CDI_CLASS}")
}

/// The claim's CDI spec file, `<cdi_dir>/<driver>-vfio_<claim uid>.json`; what
/// unprepare deletes.
pub fn cdi_spec_path(
    driver: &DriverName,
    cdi_dir: &Path,
    claim_uid: &str,
) -> Result<PathBuf, CdiError> {
    check_uid(claim_uid)?;
    let name = spec::transient_spec_name(driver.as_str(), CDI_CLASS, claim_uid);
    Ok(cdi_dir.join(name))
}

/// The claim's metadata directory, `<metadata_dir>/<driver>/<claim uid>`; what
/// unprepare removes with everything in it.
pub fn metadata_claim_dir(
    driver: &DriverName,
    metadata_dir: &Path,
    claim_uid: &str,
) -> Result<PathBuf, CdiError> {
    check_uid(claim_uid)?;
    Ok(metadata_dir.join(driver.as_str()).join(claim_uid))
}

/// One function's device nodes: `/dev/vfio/vfio` and `/dev/vfio/<group>` unless
/// only iommufd is asked for, and with iommufd `/dev/iommu` and
/// `/dev/vfio/devices/vfioN`. Host paths follow `dev_root` and are written only
/// when it is not `/dev`.
fn device_nodes(dev: &SpecDevice, dev_root: Option<&str>) -> Vec<DeviceNode> {
    let legacy = if dev.group_nodes {
        sysfs_pci::vmm::group_nodes([dev.group])
    } else {
        Vec::new()
    };
    legacy
        .into_iter()
        .chain(sysfs_pci::vmm::iommufd_nodes(
            dev.iommufd_nodes.iter().map(String::as_str),
        ))
        .map(|r| DeviceNode {
            path: format!("/dev/{r}"),
            host_path: dev_root.map(|root| format!("{root}/{r}")),
            permissions: Some(PERMISSIONS.to_owned()),
        })
        .collect()
}

/// A device, checked: its name is its address's, its requests are well formed, its
/// iommufd node is `vfioN`; returns its attributes with its [`PCI_BUS_ID`].
fn checked(dev: &SpecDevice) -> Result<BTreeMap<&str, AttributeValue>, CdiError> {
    let named = match DeviceName::parse(&dev.device_name) {
        Some(DeviceName::Function(a)) => dev.functions.is_empty().then_some(a),
        Some(DeviceName::Group(a)) => Some(a),
        None => None,
    };
    if named != Some(dev.address) {
        return Err(CdiError::DeviceNameMismatch {
            name: dev.device_name.clone(),
            address: dev.address,
        });
    }
    check_subdomain("pool name", &dev.pool, SUBDOMAIN_MAX)?;
    if dev.request_names.is_empty() {
        return Err(CdiError::NoRequest(dev.device_name.clone()));
    }
    dev.request_names
        .iter()
        .try_for_each(|r| base_request(r).map(|_| ()))?;
    for node in &dev.iommufd_nodes {
        check_iommufd_node(node)?;
    }
    let bdf = AttributeValue::String(dev.address.to_string());
    match dev.attributes.get(PCI_BUS_ID) {
        Some(v) if *v != bdf => Err(CdiError::PciBusIdMismatch {
            device: dev.device_name.clone(),
            value: v.clone(),
            address: dev.address,
        }),
        _ => {
            let mut attributes: BTreeMap<&str, AttributeValue> = dev
                .attributes
                .iter()
                .map(|(k, v)| (k.as_str(), v.clone()))
                .collect();
            attributes.insert(PCI_BUS_ID, bdf);
            Ok(attributes)
        }
    }
}

/// Where a claim's metadata appears in containers, after checking the names that
/// make the path.
fn container_claim_dir(claim: &ClaimRef, pod_claim_name: Option<&str>) -> Result<String, CdiError> {
    check_label("namespace", &claim.namespace)?;
    check_subdomain("claim name", &claim.name, SUBDOMAIN_MAX)?;
    if let Some(p) = pod_claim_name {
        check_label("pod claim name", p)?;
    }
    Ok(metadata::container_claim_dir(claim, pod_claim_name))
}

/// The CDI spec, the metadata files and the CDI ids for a prepared claim.
///
/// `pod_claim_name` is the claim's [`kubelet_plugin::POD_CLAIM_NAME_ANNOTATION`] (a claim made from
/// a template), which decides the container path of the metadata. Device order does
/// not matter: devices and requests are written sorted by name, so the same claim
/// always gives the same bytes.
pub fn claim_files(
    driver: &DriverName,
    cdi_dir: &Path,
    metadata_dir: &Path,
    dev_root: &Path,
    claim: &ClaimRef,
    pod_claim_name: Option<&str>,
    devices: &[SpecDevice],
) -> Result<ClaimFiles, CdiError> {
    let mut spec = Spec {
        kind: cdi_kind(driver),
        devices: Vec::new(),
    };
    let uid = claim.uid.as_str();
    let spec_path = cdi_spec_path(driver, cdi_dir, uid)?;
    let claim_dir = metadata_claim_dir(driver, metadata_dir, uid)?;
    let claim_dir_str = utf8_dir("metadata directory", &claim_dir)?.to_string();
    let dev_root = utf8_dir("device root", dev_root)?;
    let dev_root = (dev_root != "/dev").then_some(dev_root);
    let container_claim_dir = container_claim_dir(claim, pod_claim_name)?;
    if devices.is_empty() {
        return Err(CdiError::NoDevices(uid.to_string()));
    }

    let mut sorted: Vec<&SpecDevice> = devices.iter().collect();
    sorted.sort_by(|a, b| a.device_name.cmp(&b.device_name));
    let mut device_ids = BTreeMap::new();
    // Top-level request → (full reference, its devices).
    let mut requests: BTreeMap<&str, (&str, Vec<MetadataDevice>)> = BTreeMap::new();
    // Top-level request → KubeVirt's variables: resource name → its devices.
    let mut env: BTreeMap<&str, BTreeMap<&ResourceName, Vec<PciAddress>>> = BTreeMap::new();
    for dev in &sorted {
        let attributes = checked(dev)?;
        let name = format!("{}-{uid}", dev.device_name);
        let mut ids = vec![spec.device_id(&name)];
        spec.devices.push(Device {
            name,
            container_edits: ContainerEdits {
                device_nodes: device_nodes(dev, dev_root),
                ..ContainerEdits::default()
            },
        });
        let mut bases = BTreeSet::new();
        for reference in &dev.request_names {
            let base = base_request(reference)?;
            let (first, devs) = requests.entry(base).or_insert((reference, Vec::new()));
            if first != reference {
                return Err(CdiError::SubrequestConflict {
                    request: base.to_string(),
                    first: first.to_string(),
                    second: reference.clone(),
                });
            }
            if bases.insert(base) {
                ids.push(spec.device_id(&format!("metadata-{base}-{uid}")));
                if let Some(resource) = &dev.resource {
                    let by_name = env.entry(base).or_default();
                    let addresses = by_name.entry(resource).or_default();
                    addresses.push(dev.address);
                    addresses.extend(&dev.functions);
                }
                devs.push(MetadataDevice {
                    driver: driver.as_str(),
                    pool: &dev.pool,
                    name: &dev.device_name,
                    attributes: attributes.clone(),
                });
            }
        }
        if device_ids.insert(dev.device_name.clone(), ids).is_some() {
            return Err(CdiError::DuplicateDevice(dev.device_name.clone()));
        }
    }

    let mut metadata = Vec::new();
    for (base, (reference, devs)) in requests {
        let host = format!("{claim_dir_str}/{base}/metadata.json");
        // KubeVirt's variables, one per resource name: the request's devices of
        // that name, comma-separated in address order, as the device plugin's
        // Allocate sets them.
        let variables = env
            .remove(base)
            .unwrap_or_default()
            .into_iter()
            .map(|(resource, addresses)| {
                let (var, value) = resource.kubevirt_env(addresses);
                format!("{var}={value}")
            })
            .collect();
        spec.devices.push(Device {
            name: format!("metadata-{base}-{uid}"),
            container_edits: ContainerEdits {
                env: variables,
                mounts: vec![
                    Mount {
                        host_path: host.clone(),
                        container_path: format!(
                            "{container_claim_dir}/{base}/{driver}-metadata.json"
                        ),
                        options: vec!["ro".into(), "bind".into()],
                    },
                    Mount {
                        host_path: host.clone(),
                        container_path: format!(
                            "{LEGACY_CONTAINER_METADATA_DIR}/{}/{base}/{driver}-metadata.json",
                            claim.name
                        ),
                        options: vec!["ro".into(), "bind".into()],
                    },
                ],
                ..ContainerEdits::default()
            },
        });
        let text = metadata::render(claim, pod_claim_name, 1, reference, devs)
            .map_err(CdiError::Encode)?;
        metadata.push((PathBuf::from(host), text));
    }

    Ok(ClaimFiles {
        cdi: (spec_path, spec.to_json()),
        metadata,
        device_ids,
    })
}

#[cfg(test)]
mod tests;
