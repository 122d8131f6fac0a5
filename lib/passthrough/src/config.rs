//! The resource list: which PCI functions are moved to vfio, and under which
//! Kubernetes extended resource name each one is advertised.
//!
//! One JSON document is read by every binary, so what is selected, what is validated
//! and what is advertised never disagree. In the cluster it is a ConfigMap; on the
//! command line it is `--config FILE` or the [`CONFIG_ENV`] variable. Without a file,
//! the built-in `rebellions` preset applies ([`ResourceList::builtin_default`]).
//!
//! # Format
//!
//! ```json
//! {
//!   "preset": ["rebellions", "nvidia"],
//!   "resources": [
//!     { "name": "example.com/NIC_PT", "vendor": "8086", "devices": ["10d3"], "classes": ["0200"] },
//!     { "name": "example.com/FPGA_PT", "vendor": "10ee", "devices": ["903f"],
//!       "addresses": ["0000:3b:00.0", "5e:00.0"] },
//!     { "name": "nvidia.com/GRACE_GPU", "vendor": "0x10de", "devices": ["2342"], "classes": ["0380"],
//!       "driver": "nvgrace_gpu_vfio_pci" }
//!   ]
//! }
//! ```
//!
//! Top-level keys, all optional (but together they must select something):
//!
//! - `preset`: a preset name or a list of names, from [`PRESETS`]. When a file is given
//!   and `preset` is absent, no preset applies.
//! - `naming`: how the `rebellions` preset names devices, from [`NAMINGS`]: `"seed"`
//!   (the default, `rebellions.ai/ATOM_CA22_PT`) or `"pci-ids"` (the names of
//!   Rebellions' current sandbox device plugin, `rebellions.ai/RBLN-CA22_PF`). Only
//!   allowed when `preset` lists `rebellions`: explicit entries name themselves and
//!   the nvidia presets always use the PCI ID database.
//! - `resources`: explicit entries, each mapping a device selector to a resource name:
//!   - `name` (required): the extended resource name, `domain/name`, checked the way the
//!     kubelet checks extended resource names (see [`ResourceName`]).
//!   - `vendor` (required): the PCI vendor id, up to 4 hex digits, `0x` optional
//!     (`"1eff"`, `"0x1EFF"`).
//!   - `devices`: device ids in the same form. Absent means every device of the vendor
//!     (that also matches `classes`); an empty list is an error.
//!   - `classes`: class-code prefixes in hex: 2 digits match the base class (`"12"`
//!     matches `0x12xxxx`), 4 digits base class and subclass (`"0300"`), 6 digits the
//!     full class code. Absent means any class; an empty list is an error.
//!   - `addresses`: PCI addresses (`"0000:3b:00.0"`, or `"3b:00.0"` for domain 0000);
//!     the entry then selects only the functions at these addresses (that also match
//!     `vendor`, `devices` and `classes`), so some devices of a model can be passed
//!     through while the others stay with their usual driver. Absent means any
//!     address; an empty list or an address listed twice is an error. A function
//!     missing from the node is not an error: it is simply not selected.
//!   - `driver`: the vfio driver to bind, default [`DEFAULT_DRIVER`]; a vfio-pci variant
//!     driver such as `nvgrace_gpu_vfio_pci` is allowed, any other driver is an error
//!     listing what is allowed (see [`is_vfio_driver`]). `"auto"` ([`AUTO_DRIVER`])
//!     chooses per device from the running kernel's `vfio_pci:` aliases, falling back
//!     to `vfio-pci` ([`DriverRule::Auto`]). Presets always bind `vfio-pci`; a
//!     top-level `driver` is an error.
//!
//! Unknown or repeated keys, `null` values, malformed ids or addresses, duplicate names
//! and overlapping selectors (among the entries and the presets together) are errors
//! that name the entry, e.g.
//! `resources[2] (example.com/NIC_PT): devices[1]: "10g3" is not a hex PCI id`.
//! Two selectors overlap when one function could match both: entries of the same
//! model are kept apart only by `addresses` lists with no address in common, so an
//! entry with `addresses` cannot sit next to a preset or entry without them that
//! takes the same model.
//!
//! # Presets
//!
//! - `rebellions` (the default): vendor `1eff`, class `12xxxx`. In the `seed` naming
//!   `1120`, `1220`, `1250` and `2030` are `rebellions.ai/ATOM_CA12_PT`,
//!   `ATOM_CA22_PT`, `ATOM_CA25_PT` and `REBEL_CR03_PT`; their SR-IOV VFs (`1121`,
//!   `1221`, `1251`, `2031`) get `_VF_PT` instead of `_PT`; any other device is
//!   `rebellions.ai/RBLN_<device>_PT`. In the `pci-ids` naming each device is named
//!   from the PCI ID database as Rebellions' plugin does (`RBLN-CA25 (PF)` becomes
//!   `rebellions.ai/RBLN-CA25_PF`), an unnamed one `rebellions.ai/RBLN-<device>_PF`
//!   (even id) or `_VF` (odd id); [`rebellions_names`] lists them.
//! - `nvidia`: vendor `10de`, classes `0300xx` and `0302xx`, named from the PCI ID
//!   database the way NVIDIA's KubeVirt GPU device plugin names them
//!   (`GH100 [H100 SXM5 80GB]` becomes `nvidia.com/GH100_H100_SXM5_80GB`), falling
//!   back to `nvidia.com/<device>`.
//! - `nvidia-nvswitch`: vendor `10de`, class `0680xx` (NVSwitch), named like `nvidia`.
//!
//! # Example
//!
//! ```
//! use passthrough::config::{DeviceIds, ResourceList};
//! use sysfs_pci::PciAddress;
//!
//! let list = ResourceList::parse(r#"{
//!     "preset": "rebellions",
//!     "resources": [
//!         { "name": "example.com/NIC_PT", "vendor": "8086", "devices": ["10d3"], "classes": ["0200"],
//!           "addresses": ["3b:00.0"] }
//!     ]
//! }"#)?;
//!
//! let nic = DeviceIds { vendor: 0x8086, device: 0x10d3, class: 0x020000 };
//! let at: PciAddress = "0000:3b:00.0".parse().expect("an address");
//! let selection = list.select(&at, &nic).expect("the NIC is listed");
//! assert_eq!(selection.resource.as_str(), "example.com/NIC_PT");
//! assert_eq!(selection.driver, "vfio-pci");
//! let elsewhere: PciAddress = "0000:3c:00.0".parse().expect("an address");
//! assert!(list.select(&elsewhere, &nic).is_none(), "same model, address not listed");
//!
//! let npu = DeviceIds { vendor: 0x1eff, device: 0x1220, class: 0x120000 };
//! let selection = list.select(&elsewhere, &npu).expect("the preset covers it");
//! assert_eq!(selection.resource.kubevirt_env_var(), "PCI_RESOURCE_REBELLIONS_AI_ATOM_CA22_PT");
//! # Ok::<(), passthrough::config::ConfigError>(())
//! ```

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use sysfs_pci::address::PciAddress;

mod json;
mod name;
mod parse;
mod preset;
mod rebellions;
mod selector;

pub use sysfs_pci::device::DeviceIds;
pub use sysfs_pci::vfio_driver::{
    check_vfio_driver, is_vfio_driver, KNOWN_VARIANTS, VARIANT_SUFFIX,
};

pub use name::{ResourceName, ResourceNameError};
pub use preset::{NAMINGS, PRESETS};

use json::Json;
use parse::{
    check_names, check_overlaps, json_error, parse_naming, parse_presets, parse_resources,
    read_file, Entry, EntrySource,
};
use selector::{ClassPrefix, Selector};

/// The environment variable naming the resource-list file.
pub const CONFIG_ENV: &str = "VFIO_SANDBOX_CONFIG";

/// The largest resource list file read: 1 MiB, far above any real list.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// The driver an entry binds when it names none.
pub const DEFAULT_DRIVER: &str = sysfs_pci::vfio_driver::VFIO_PCI;

/// The `driver` value that lets the running kernel's aliases choose per device.
pub const AUTO_DRIVER: &str = "auto";

/// Which vfio driver an entry binds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverRule {
    /// This driver (`vfio-pci` or a variant driver).
    Named(String),
    /// `"auto"`: per device, the most specific `vfio_pci:` alias of the running
    /// kernel's `modules.alias`, else `vfio-pci`
    /// ([`DriverChoice`](crate::inventory::DriverChoice) says which and why).
    Auto,
}

impl DriverRule {
    /// The driver's name, or `auto`.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Named(name) => name,
            Self::Auto => AUTO_DRIVER,
        }
    }
}

impl fmt::Display for DriverRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for DriverRule {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// What a device is selected as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// The extended resource it is advertised as.
    pub resource: ResourceName,
    /// The vfio driver it is bound to (`vfio-pci`, a variant driver, or `auto`).
    pub driver: DriverRule,
}

/// The parsed, validated resource list.
///
/// No two entries overlap, so a device is selected by at most one entry.
#[derive(Debug, Clone)]
pub struct ResourceList {
    entries: Vec<Entry>,
}

/// A failure to read or validate a resource list.
///
/// Every message names the file (when the list came from one) and the entry.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("failed to read resource list {path}")]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The path is not a regular file (a FIFO would block, `/dev/zero` never ends).
    #[error("resource list {path} is {kind}, not a regular file")]
    #[allow(missing_docs)]
    NotAFile {
        path: PathBuf,
        /// What it is instead, e.g. `a FIFO`.
        kind: &'static str,
    },
    /// The file is larger than [`MAX_FILE_BYTES`].
    #[error("resource list {path} is larger than the limit of {limit} bytes")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The limit, [`MAX_FILE_BYTES`].
        limit: u64,
    },
    /// The document is not JSON.
    #[error("{}: invalid JSON at line {line} column {column}: {message}", Origin(.file))]
    Json {
        /// The file, when the list came from one.
        file: Option<PathBuf>,
        /// 1-based line of the error.
        line: usize,
        /// Column of the error, 1-based (0 when the input ended before the line had any).
        column: usize,
        /// What the JSON parser found wrong.
        message: String,
    },
    /// The document as a whole is wrong: not an object, an unknown or repeated
    /// top-level key, a malformed `preset`, or nothing selected.
    #[error("{}: {problem}", Origin(.file))]
    Document {
        /// The file, when the list came from one.
        file: Option<PathBuf>,
        /// What is wrong.
        problem: String,
    },
    /// One entry of `resources` is wrong.
    #[error("{}: {entry}: {problem}", Origin(.file))]
    Entry {
        /// The file, when the list came from one.
        file: Option<PathBuf>,
        /// The entry, e.g. `resources[2] (example.com/NIC_PT)`.
        entry: String,
        /// What is wrong with it, e.g. `devices[1]: "10g3" is not a hex PCI id`.
        problem: String,
    },
    /// Two entries advertise the same resource name.
    #[error("{}: {entry}: name is already used by {other}", Origin(.file))]
    DuplicateName {
        /// The file, when the list came from one.
        file: Option<PathBuf>,
        /// The later entry.
        entry: String,
        /// The earlier entry or the preset that gives the same name.
        other: String,
    },
    /// Two names map to one KubeVirt variable.
    #[error("{}: {entry} and {other} both map to KubeVirt's variable {variable} \
        (KubeVirt upper-cases a resource name and turns `/` and `.` into `_`), which \
        would be set for both; rename one", Origin(.file))]
    VariableClash {
        /// The file, when the list came from one.
        file: Option<PathBuf>,
        /// The later entry.
        entry: String,
        /// The earlier entry or the preset.
        other: String,
        /// The variable, `PCI_RESOURCE_<NAME>`.
        variable: String,
    },
    /// Two selectors could match the same device.
    #[error("{}: {entry} overlaps {other}: both would select {example}", Origin(.file))]
    Overlap {
        /// The file, when the list came from one.
        file: Option<PathBuf>,
        /// The later entry.
        entry: String,
        /// The earlier entry or preset.
        other: String,
        /// The devices both select, e.g. `vendor 1eff, device 1220, class 12xxxx`.
        example: String,
    },
    /// `preset` names a preset that does not exist.
    #[error("{}: unknown preset {name:?} (known presets: {})", Origin(.file), PRESETS.join(", "))]
    UnknownPreset {
        /// The file, when the list came from one.
        file: Option<PathBuf>,
        /// The unknown name.
        name: String,
    },
}

impl ConfigError {
    /// The file the list came from, if any.
    pub fn file(&self) -> Option<&Path> {
        match self {
            Self::ReadFile { path, .. }
            | Self::NotAFile { path, .. }
            | Self::TooLarge { path, .. } => Some(path),
            Self::Json { file, .. }
            | Self::Document { file, .. }
            | Self::Entry { file, .. }
            | Self::DuplicateName { file, .. }
            | Self::VariableClash { file, .. }
            | Self::Overlap { file, .. }
            | Self::UnknownPreset { file, .. } => file.as_deref(),
        }
    }

    fn in_file(mut self, path: &Path) -> Self {
        match &mut self {
            Self::ReadFile { .. } | Self::NotAFile { .. } | Self::TooLarge { .. } => {}
            Self::Json { file, .. }
            | Self::Document { file, .. }
            | Self::Entry { file, .. }
            | Self::DuplicateName { file, .. }
            | Self::VariableClash { file, .. }
            | Self::Overlap { file, .. }
            | Self::UnknownPreset { file, .. } => *file = Some(path.to_owned()),
        }
        self
    }

    fn document(problem: impl Into<String>) -> Self {
        Self::Document {
            file: None,
            problem: problem.into(),
        }
    }
}

/// Where a list came from, as the start of an error message.
struct Origin<'a>(&'a Option<PathBuf>);

impl fmt::Display for Origin<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(path) => write!(f, "resource list {}", path.display()),
            None => f.write_str("resource list"),
        }
    }
}

impl ResourceList {
    /// The list used when no file is given: the rebellions preset.
    pub fn builtin_default() -> Self {
        Self {
            entries: preset::entries("rebellions", false).unwrap_or_default(),
        }
    }

    /// Parses and validates a JSON document (see the [module docs](self) for the format).
    pub fn parse(json: &str) -> Result<Self, ConfigError> {
        let doc: Json = serde_json::from_str(json).map_err(|err| json_error(&err))?;
        let Json::Object(fields) = doc else {
            return Err(ConfigError::document(format!(
                "expected a JSON object at the top level, found {}",
                doc.kind()
            )));
        };
        json::check_unique_keys(&fields).map_err(ConfigError::document)?;

        let naming = fields.iter().find(|(key, _)| key == "naming");
        let pci_ids = naming.map(|(_, v)| parse_naming(v)).transpose()?;
        let mut entries = Vec::new();
        let mut explicit = Vec::new();
        for (key, value) in &fields {
            match key.as_str() {
                "preset" => entries.extend(parse_presets(value, pci_ids.unwrap_or(false))?),
                "resources" => explicit = parse_resources(value)?,
                "naming" => {}
                "driver" => {
                    return Err(ConfigError::document(
                        "unknown key \"driver\": a driver (\"auto\" included) belongs in an \
                         entry of \"resources\"; presets bind vfio-pci",
                    ))
                }
                other => {
                    return Err(ConfigError::document(format!(
                        "unknown key {other:?} (expected \"preset\", \"naming\" or \"resources\")"
                    )))
                }
            }
        }
        if let (Some(pci_ids), false) = (pci_ids, entries.iter().any(Entry::is_rebellions)) {
            return Err(ConfigError::document(format!(
                "naming: {:?} only chooses the names of the rebellions preset, and \"preset\" \
                 does not list it (entries in \"resources\" name themselves; the nvidia presets \
                 always take their names from the PCI ID database)",
                if pci_ids { "pci-ids" } else { "seed" }
            )));
        }
        check_names(&entries, &explicit)?;
        entries.extend(explicit);
        if entries.is_empty() {
            return Err(ConfigError::document(
                "selects no devices: give a \"preset\" or at least one entry in \"resources\"",
            ));
        }
        check_overlaps(&entries)?;
        Ok(Self { entries })
    }

    /// Reads `path` and parses it; `None` gives [`ResourceList::builtin_default`].
    ///
    /// Only a regular file (or a link to one, as a mounted ConfigMap is) of at most
    /// [`MAX_FILE_BYTES`] is read. Errors name the file.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let Some(path) = path else {
            return Ok(Self::builtin_default());
        };
        let text = read_file(path)?;
        Self::parse(&text).map_err(|err| err.in_file(path))
    }

    /// The selection for the function at `address` with `ids`, or `None` when no
    /// entry matches.
    ///
    /// This is the one place that decides whether a function is selected: every
    /// binary reaches it through [`Inventory::scan`](crate::inventory::Inventory::scan).
    pub fn select(&self, address: &PciAddress, ids: &DeviceIds) -> Option<Selection> {
        self.entries
            .iter()
            .find(|entry| entry.selector.matches(address, ids))
            .map(|entry| Selection {
                resource: entry.naming.name_for(ids),
                driver: entry.driver.clone(),
            })
    }

    /// The product Rebellions' own drivers know the function at `address` with `ids`
    /// by (`RBLN-CA22`), when the `rebellions` preset selects it under `"naming":
    /// "pci-ids"`: the product part of its resource name (`rebellions.ai/RBLN-CA22_PF`),
    /// the word Rebellions' DRA driver publishes as its `productName` attribute.
    /// `None` when another entry selects it, under the `seed` naming, or when nothing
    /// selects it.
    pub fn rebellions_product(&self, address: &PciAddress, ids: &DeviceIds) -> Option<String> {
        self.entries
            .iter()
            .find(|entry| entry.selector.matches(address, ids))
            .filter(|entry| matches!(entry.naming, preset::Naming::RebellionsPciIds))
            .map(|_| rebellions::pci_ids_product(ids.device))
    }

    /// The vendors any entry selects, sorted (lets callers skip unrelated devices
    /// cheaply).
    pub fn vendors(&self) -> Vec<u16> {
        let vendors: BTreeSet<u16> = self.entries.iter().map(|e| e.selector.vendor).collect();
        vendors.into_iter().collect()
    }

    /// Every distinct driver named by an entry (vfio-pci plus variants), in entry order;
    /// `auto` entries name none (their drivers are chosen per device by the inventory).
    pub fn drivers(&self) -> Vec<String> {
        let mut drivers: Vec<String> = Vec::new();
        for entry in &self.entries {
            if let DriverRule::Named(name) = &entry.driver {
                if !drivers.contains(name) {
                    drivers.push(name.clone());
                }
            }
        }
        drivers
    }

    /// True when some entry has `"driver": "auto"`.
    pub fn has_auto_driver(&self) -> bool {
        self.entries.iter().any(|e| e.driver == DriverRule::Auto)
    }

    /// A human-readable line per entry, for `--help` and status output, e.g.
    /// `example.com/NIC_PT: vendor 8086, device 10d3, class 0200xx, driver vfio-pci`.
    pub fn describe(&self) -> Vec<String> {
        self.entries.iter().map(Entry::describe).collect()
    }
}

/// Every name the `rebellions` preset gives a device it knows by id, under `naming`
/// (`"seed"` or `"pci-ids"`; `None` for another value): what the DeviceClasses and the
/// docs list. Devices it knows no name for get a name with their id in it.
pub fn rebellions_names(naming: &str) -> Option<Vec<ResourceName>> {
    let mut names: Vec<ResourceName> = match naming {
        "seed" => rebellions::SEED_NAMES
            .iter()
            .map(|(id, _)| rebellions::seed_name(*id))
            .collect(),
        "pci-ids" => rebellions::named_devices()
            .map(rebellions::pci_ids_name)
            .collect(),
        _ => return None,
    };
    names.sort();
    Some(names)
}

impl Default for ResourceList {
    fn default() -> Self {
        Self::builtin_default()
    }
}

#[cfg(test)]
mod tests;
