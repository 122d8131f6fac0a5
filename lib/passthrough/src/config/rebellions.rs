//! How the `rebellions` preset names devices, in its two namings (the top-level
//! `"naming"` of the resource list):
//!
//! - `seed` (the default): the names of Rebellions' original operator docs,
//!   `rebellions.ai/ATOM_CA22_PT`, `…_VF_PT` for SR-IOV VFs, `RBLN_<device>_PT` else.
//! - `pci-ids`: the names Rebellions' current sandbox device plugin advertises, one
//!   per product and function, from the PCI ID database: `RBLN-CA25 (PF)` becomes
//!   `rebellions.ai/RBLN-CA25_PF`.
//!
//! The `pci-ids` rule, as Rebellions' code has it: the operator injects an empty
//! `RBLN_PT_ALIAS` into the plugin, which then runs in "per-model mode
//! (`rebellions.ai/RBLN-<MODEL>_<PF|VF>`)" (rebellions-sw/rbln-npu-operator: the
//! comment on `sandboxResourceAlias` in its sandbox device plugin patcher, package
//! `components`; its e2e test expects `rebellions.ai/RBLN-CA22_PF`); the plugin's own
//! source is not among the sources we could read. The model is the database name up
//! to its first space (`productLabelFromPCIIDsName` in
//! rebellions-sw/rbln-npu-feature-discovery, whose
//! `internal/pciids` is "ported from sandbox-device-plugin's pciids.go"), and the
//! function is the database's `(PF)` / `(VF)`.

use super::{ResourceName, ResourceNameError};

/// The PCI vendor id of Rebellions.
pub(super) const VENDOR: u16 = 0x1eff;

/// `seed` naming: devices with fixed names, device id and resource name.
pub(super) const SEED_NAMES: &[(u16, &str)] = &[
    (0x1120, "rebellions.ai/ATOM_CA12_PT"),
    (0x1121, "rebellions.ai/ATOM_CA12_VF_PT"),
    (0x1220, "rebellions.ai/ATOM_CA22_PT"),
    (0x1221, "rebellions.ai/ATOM_CA22_VF_PT"),
    (0x1250, "rebellions.ai/ATOM_CA25_PT"),
    (0x1251, "rebellions.ai/ATOM_CA25_VF_PT"),
    (0x2030, "rebellions.ai/REBEL_CR03_PT"),
    (0x2031, "rebellions.ai/REBEL_CR03_VF_PT"),
];

// REBELLIONS_DB: the database's Rebellions devices, written by build.rs.
include!(concat!(env!("OUT_DIR"), "/rebellions_names.rs"));

/// Devices the `pci-ids` crate's database (0.2.6) does not list but the `pci.ids`
/// Rebellions bundles into its images does (`deps/rebellions-pci.ids`, as the tests
/// of rebellions-sw/rbln-npu-feature-discovery `internal/pciids` read it back); only
/// used while the database lacks the id, so a newer database wins.
const BUNDLED_ONLY: &[(u16, &str)] = &[
    (0x1150, "RBLN-CA15 (PF)"),
    (0x2030, "RBLN-CR03 (PF)"),
    (0x2130, "RBLN-CR13 (PF)"),
    (0x2131, "RBLN-CR13 (VF)"),
];

/// The `seed` name of a Rebellions device.
pub(super) fn seed_name(device: u16) -> ResourceName {
    let name = SEED_NAMES.iter().find(|(id, _)| *id == device).map_or_else(
        || format!("rebellions.ai/RBLN_{device:04x}_PT"),
        |(_, name)| (*name).to_owned(),
    );
    ResourceName::from_trusted(name)
}

/// Whether some device gets `name` under `seed` naming.
pub(super) fn seed_can_give(name: &ResourceName) -> bool {
    SEED_NAMES.iter().any(|(_, n)| *n == name.as_str())
        || name
            .as_str()
            .strip_prefix("rebellions.ai/RBLN_")
            .and_then(|rest| rest.strip_suffix("_PT"))
            .is_some_and(is_lower_hex_id)
}

/// The name of `device` in the PCI ID database (or Rebellions' bundled list).
pub(super) fn db_name(device: u16) -> Option<&'static str> {
    let find = |table: &[(u16, &'static str)]| {
        table
            .iter()
            .find(|(id, _)| *id == device)
            .map(|(_, name)| *name)
    };
    find(REBELLIONS_DB).or_else(|| find(BUNDLED_ONLY))
}

/// The `pci-ids` name of a Rebellions device: `rebellions.ai/<product>_<PF|VF>` from
/// its database name; `rebellions.ai/RBLN-<device>_<PF|VF>` for a device no list
/// names, the function taken from the id (every Rebellions PF id is even, its VF the
/// next odd one).
pub(super) fn pci_ids_name(device: u16) -> ResourceName {
    db_name(device)
        .and_then(|db| name_from_db(db, device).ok())
        .unwrap_or_else(|| {
            ResourceName::from_trusted(format!(
                "rebellions.ai/RBLN-{device:04x}_{}",
                function_by_id(device)
            ))
        })
}

/// The product part of the `pci-ids` name of a Rebellions device: `RBLN-CA25` of
/// `rebellions.ai/RBLN-CA25_PF`, `RBLN-abcc` for a device no list names. Rebellions'
/// DRA driver publishes the same word as its `productName` attribute.
pub(super) fn pci_ids_product(device: u16) -> String {
    let name = pci_ids_name(device);
    let local = name
        .as_str()
        .strip_prefix("rebellions.ai/")
        .unwrap_or(name.as_str());
    local
        .rsplit_once('_')
        .map_or(local, |(product, _)| product)
        .to_owned()
}

/// `RBLN-CA25 (PF)` → `rebellions.ai/RBLN-CA25_PF`.
fn name_from_db(db: &str, device: u16) -> Result<ResourceName, ResourceNameError> {
    let mut words = db.split_whitespace();
    let product = words.next().unwrap_or_default();
    let function = match words.last() {
        Some("(PF)") => "PF",
        Some("(VF)") => "VF",
        _ => function_by_id(device),
    };
    format!("rebellions.ai/{product}_{function}").parse()
}

fn function_by_id(device: u16) -> &'static str {
    if device.is_multiple_of(2) {
        "PF"
    } else {
        "VF"
    }
}

/// Whether some device gets `name` under `pci-ids` naming.
pub(super) fn pci_ids_can_give(name: &ResourceName) -> bool {
    let fallback_id = name
        .as_str()
        .strip_prefix("rebellions.ai/RBLN-")
        .and_then(|rest| rest.get(..4).filter(|_| rest.len() == 7))
        .filter(|id| is_lower_hex_id(id))
        .and_then(|id| u16::from_str_radix(id, 16).ok());
    if fallback_id.is_some_and(|id| pci_ids_name(id) == *name) {
        return true;
    }
    named_devices().any(|id| pci_ids_name(id) == *name)
}

/// Every device id a list names (the database's and the bundled list's).
pub(super) fn named_devices() -> impl Iterator<Item = u16> {
    REBELLIONS_DB.iter().chain(BUNDLED_ONLY).map(|(id, _)| *id)
}

pub(super) fn is_lower_hex_id(text: &str) -> bool {
    text.len() == 4
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> ResourceName {
        s.parse().unwrap()
    }

    #[test]
    fn the_database_lists_what_this_code_expects() {
        // pci-ids 0.2.6: RBLN-CA2, CA11, CA12, CA21, CA22, CA25, each PF and VF.
        let ids: Vec<u16> = REBELLIONS_DB.iter().map(|(id, _)| *id).collect();
        assert_eq!(
            ids,
            [
                0x1020, 0x1021, 0x1110, 0x1111, 0x1120, 0x1121, 0x1210, 0x1211, 0x1220, 0x1221,
                0x1250, 0x1251
            ]
        );
        for (id, _) in BUNDLED_ONLY {
            assert!(
                !ids.contains(id),
                "{id:04x} is in the database now: drop it from BUNDLED_ONLY"
            );
        }
    }

    #[test]
    fn pci_ids_names_as_rebellions_spells_them() {
        for (device, want) in [
            (0x1250, "rebellions.ai/RBLN-CA25_PF"),
            (0x1251, "rebellions.ai/RBLN-CA25_VF"),
            (0x1220, "rebellions.ai/RBLN-CA22_PF"),
            (0x1221, "rebellions.ai/RBLN-CA22_VF"),
            (0x1020, "rebellions.ai/RBLN-CA2_PF"),
            (0x2030, "rebellions.ai/RBLN-CR03_PF"),
            (0x2131, "rebellions.ai/RBLN-CR13_VF"),
            (0x2031, "rebellions.ai/RBLN-2031_VF"),
            (0xabcc, "rebellions.ai/RBLN-abcc_PF"),
        ] {
            assert_eq!(pci_ids_name(device).as_str(), want, "{device:04x}");
        }
    }

    #[test]
    fn the_product_is_the_name_without_its_function() {
        for (device, want) in [
            (0x1220, "RBLN-CA22"),
            (0x1221, "RBLN-CA22"),
            (0x1250, "RBLN-CA25"),
            (0x1251, "RBLN-CA25"),
            (0x1020, "RBLN-CA2"),
            (0x2030, "RBLN-CR03"),
            (0x2031, "RBLN-2031"),
            (0xabcc, "RBLN-abcc"),
        ] {
            assert_eq!(pci_ids_product(device), want, "{device:04x}");
        }
    }

    #[test]
    fn every_named_device_gets_a_distinct_valid_name() {
        let mut names: Vec<ResourceName> = named_devices().map(pci_ids_name).collect();
        assert_eq!(names.len(), REBELLIONS_DB.len() + BUNDLED_ONLY.len());
        assert!(
            names
                .iter()
                .all(|n| !n.as_str().contains("RBLN-1") && !n.as_str().contains("RBLN-2")),
            "{names:?}"
        );
        names.sort();
        names.dedup();
        assert_eq!(names.len(), REBELLIONS_DB.len() + BUNDLED_ONLY.len());
    }

    #[test]
    fn names_from_odd_database_entries() {
        assert_eq!(
            name_from_db("RBLN-CX9", 0x3000).unwrap().as_str(),
            "rebellions.ai/RBLN-CX9_PF"
        );
        assert_eq!(
            name_from_db("RBLN-CX9 [rev 2]", 0x3001).unwrap().as_str(),
            "rebellions.ai/RBLN-CX9_VF"
        );
        assert!(name_from_db("", 0x3000).is_err());
        assert!(name_from_db("(weird)", 0x3000).is_err());
    }

    #[test]
    fn what_each_naming_can_give() {
        assert!(pci_ids_can_give(&name("rebellions.ai/RBLN-CA25_PF")));
        assert!(pci_ids_can_give(&name("rebellions.ai/RBLN-CR03_PF")));
        assert!(pci_ids_can_give(&name("rebellions.ai/RBLN-2031_VF")));
        assert!(
            !pci_ids_can_give(&name("rebellions.ai/RBLN-2031_PF")),
            "odd ids are VFs"
        );
        assert!(
            !pci_ids_can_give(&name("rebellions.ai/RBLN-1250_PF")),
            "1250 has a database name"
        );
        assert!(!pci_ids_can_give(&name("rebellions.ai/RBLN-CA25_PT")));
        assert!(!pci_ids_can_give(&name("rebellions.ai/ATOM_CA25_PT")));
        assert!(seed_can_give(&name("rebellions.ai/ATOM_CA25_VF_PT")));
        assert!(seed_can_give(&name("rebellions.ai/RBLN_1020_PT")));
        assert!(!seed_can_give(&name("rebellions.ai/RBLN-CA25_PF")));
    }
}
