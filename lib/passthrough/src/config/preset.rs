//! The built-in presets and how they name devices.

use super::rebellions::{self, is_lower_hex_id};
use super::{
    ClassPrefix, DeviceIds, DriverRule, Entry, EntrySource, ResourceName, Selector, DEFAULT_DRIVER,
};

use std::collections::HashSet;
use std::sync::OnceLock;

/// The names `preset` accepts.
pub const PRESETS: &[&str] = &["rebellions", "nvidia", "nvidia-nvswitch"];

const NVIDIA_VENDOR: u16 = 0x10de;

/// The values of the top-level `"naming"`: how the `rebellions` preset names devices.
pub const NAMINGS: &[&str] = &["seed", "pci-ids"];

/// How an entry names the devices it selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Naming {
    /// One name for every device (explicit entries).
    Fixed(ResourceName),
    /// `seed`: the Rebellions table, else `rebellions.ai/RBLN_<device>_PT`.
    Rebellions,
    /// `pci-ids`: Rebellions' current names, `rebellions.ai/RBLN-CA25_PF`.
    RebellionsPciIds,
    /// The PCI ID database name, else `nvidia.com/<device>`.
    Nvidia,
}

impl Naming {
    pub(super) fn name_for(&self, ids: &DeviceIds) -> ResourceName {
        match self {
            Self::Fixed(name) => name.clone(),
            Self::Rebellions => rebellions::seed_name(ids.device),
            Self::RebellionsPciIds => rebellions::pci_ids_name(ids.device),
            Self::Nvidia => nvidia_name(ids.vendor, ids.device),
        }
    }

    /// Whether some device this rule names could get `name`.
    pub(super) fn can_give(&self, name: &ResourceName) -> bool {
        match self {
            Self::Fixed(fixed) => fixed == name,
            Self::Rebellions => rebellions::seed_can_give(name),
            Self::RebellionsPciIds => rebellions::pci_ids_can_give(name),
            Self::Nvidia => {
                name.as_str()
                    .strip_prefix("nvidia.com/")
                    .is_some_and(is_lower_hex_id)
                    || NVIDIA_INDEX
                        .iter()
                        .any(|&(id, ..)| nvidia_name_from_db(id, nvidia_db_name(id)) == *name)
            }
        }
    }

    /// Whether some device this rule names could get a name whose KubeVirt
    /// variable ([`ResourceName::kubevirt_env_var`]) is `variable`.
    pub(super) fn can_give_variable(&self, variable: &str) -> bool {
        static SEED: OnceLock<HashSet<String>> = OnceLock::new();
        static PCI_IDS: OnceLock<HashSet<String>> = OnceLock::new();
        static NVIDIA: OnceLock<HashSet<String>> = OnceLock::new();
        let (cell, vendor) = match self {
            Self::Fixed(fixed) => return fixed.kubevirt_env_var() == variable,
            Self::Rebellions => (&SEED, rebellions::VENDOR),
            Self::RebellionsPciIds => (&PCI_IDS, rebellions::VENDOR),
            Self::Nvidia => (&NVIDIA, NVIDIA_VENDOR),
        };
        // Every name the rule can give, one per device id: 65,536 at most.
        cell.get_or_init(|| {
            (0..=u16::MAX)
                .map(|device| {
                    let ids = DeviceIds {
                        vendor,
                        device,
                        class: 0,
                    };
                    self.name_for(&ids).kubevirt_env_var()
                })
                .collect()
        })
        .contains(variable)
    }

    pub(super) fn describe(&self) -> String {
        match self {
            Self::Fixed(name) => name.to_string(),
            Self::Rebellions => {
                let table: Vec<String> = rebellions::SEED_NAMES
                    .iter()
                    .map(|(id, name)| format!("{id:04x} {name}"))
                    .collect();
                format!(
                    "{}, any other rebellions.ai/RBLN_<device>_PT",
                    table.join(", ")
                )
            }
            Self::RebellionsPciIds => {
                let table: Vec<String> = rebellions::named_devices()
                    .map(|id| format!("{id:04x} {}", rebellions::pci_ids_name(id)))
                    .collect();
                format!(
                    "{}, any other rebellions.ai/RBLN-<device>_PF (even id) or _VF (odd id)",
                    table.join(", ")
                )
            }
            Self::Nvidia => {
                "nvidia.com/<PCI ID database name>, else nvidia.com/<device>".to_owned()
            }
        }
    }
}

/// The entries of a preset, `None` for an unknown name; `pci_ids` selects the
/// `pci-ids` naming of the `rebellions` preset.
pub(super) fn entries(name: &str, pci_ids: bool) -> Option<Vec<Entry>> {
    let class = |value, digits| ClassPrefix { value, digits };
    let (source, vendor, classes, naming) = match name {
        "rebellions" => (
            "rebellions",
            rebellions::VENDOR,
            vec![class(0x12, 2)],
            if pci_ids {
                Naming::RebellionsPciIds
            } else {
                Naming::Rebellions
            },
        ),
        "nvidia" => (
            "nvidia",
            NVIDIA_VENDOR,
            vec![class(0x0300, 4), class(0x0302, 4)],
            Naming::Nvidia,
        ),
        "nvidia-nvswitch" => (
            "nvidia-nvswitch",
            NVIDIA_VENDOR,
            vec![class(0x0680, 4)],
            Naming::Nvidia,
        ),
        _ => return None,
    };
    Some(vec![Entry {
        source: EntrySource::Preset(source),
        selector: Selector {
            vendor,
            devices: None,
            classes: Some(classes),
            addresses: None,
        },
        naming,
        driver: DriverRule::Named(DEFAULT_DRIVER.to_owned()),
    }])
}

/// NVIDIA's KubeVirt naming: the PCI ID database name, trimmed, upper-cased, '/' and
/// '.' turned into '_', each run of whitespace into one '_', anything else outside
/// `[A-Za-z0-9_]` dropped. Falls back to the device id when the database has no name
/// or the result is not a valid resource name.
fn nvidia_name(vendor: u16, device: u16) -> ResourceName {
    let db_name = (vendor == NVIDIA_VENDOR)
        .then(|| nvidia_db_name(device))
        .flatten();
    nvidia_name_from_db(device, db_name)
}

// NVIDIA_NAMES and NVIDIA_INDEX: the database's NVIDIA names, without pointers.
include!(concat!(env!("OUT_DIR"), "/nvidia_names.rs"));

/// The PCI ID database's name of NVIDIA device `device`.
pub(super) fn nvidia_db_name(device: u16) -> Option<&'static str> {
    let i = NVIDIA_INDEX
        .binary_search_by_key(&device, |&(id, ..)| id)
        .ok()?;
    let (_, start, len) = NVIDIA_INDEX[i];
    let start = usize::try_from(start).ok()?;
    NVIDIA_NAMES.get(start..start + usize::try_from(len).ok()?)
}

fn nvidia_name_from_db(device: u16, db_name: Option<&str>) -> ResourceName {
    db_name
        .and_then(|name| {
            format!("nvidia.com/{}", kubevirt_device_name(name))
                .parse()
                .ok()
        })
        .unwrap_or_else(|| ResourceName::from_trusted(format!("nvidia.com/{device:04x}")))
}

pub(super) fn kubevirt_device_name(db_name: &str) -> String {
    let mut out = String::with_capacity(db_name.len());
    let mut in_space = false;
    for c in db_name.trim().chars() {
        // ASCII whitespace is what Go's `\s` matches.
        if c.is_ascii_whitespace() {
            if !in_space {
                out.push('_');
            }
            in_space = true;
            continue;
        }
        in_space = false;
        match c {
            '/' | '.' => out.push('_'),
            c if c.is_ascii_alphanumeric() || c == '_' => out.push(c.to_ascii_uppercase()),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubevirt_device_names() {
        assert_eq!(
            kubevirt_device_name("GH100 [H100 SXM5 80GB]"),
            "GH100_H100_SXM5_80GB"
        );
        assert_eq!(
            kubevirt_device_name("  TU104GL [Tesla T4]\t"),
            "TU104GL_TESLA_T4"
        );
        assert_eq!(
            kubevirt_device_name("GH100 [GH200 120GB / 480GB]"),
            "GH100_GH200_120GB___480GB"
        );
        assert_eq!(
            kubevirt_device_name("GA102GL [A10 v2.0]"),
            "GA102GL_A10_V2_0"
        );
        assert_eq!(kubevirt_device_name("a \t\n b"), "A_B");
        assert_eq!(kubevirt_device_name("(x)-[y]+"), "XY");
        assert_eq!(kubevirt_device_name(""), "");
    }

    #[test]
    fn table_names_are_valid() {
        for (_, name) in rebellions::SEED_NAMES {
            name.parse::<ResourceName>().unwrap();
        }
        assert_eq!(
            rebellions::seed_name(0xabcd).as_str(),
            "rebellions.ai/RBLN_abcd_PT"
        );
        assert_eq!(nvidia_name(0x10de, 0x0000).as_str(), "nvidia.com/0000");
    }

    #[test]
    fn can_give() {
        let name = |s: &str| s.parse::<ResourceName>().unwrap();
        assert!(Naming::Rebellions.can_give(&name("rebellions.ai/ATOM_CA25_VF_PT")));
        assert!(Naming::Rebellions.can_give(&name("rebellions.ai/RBLN_1020_PT")));
        assert!(!Naming::Rebellions.can_give(&name("rebellions.ai/RBLN_1020_VF_PT")));
        assert!(!Naming::Rebellions.can_give(&name("rebellions.ai/RBLN_10200_PT")));
        assert!(!Naming::Rebellions.can_give(&name("rebellions.ai/RBLN_ABCD_PT")));
        assert!(!Naming::Rebellions.can_give(&name("rebellions.ai/ATOM_CA11_PT")));
        assert!(Naming::Nvidia.can_give(&name("nvidia.com/GH100_H100_SXM5_80GB")));
        assert!(Naming::Nvidia.can_give(&name("nvidia.com/ffff")));
        assert!(!Naming::Nvidia.can_give(&name("nvidia.com/MY_GPU")));
        assert!(!Naming::Nvidia.can_give(&name("example.com/GH100_H100_SXM5_80GB")));
    }
}
