//! Which drivers are vfio drivers: `vfio-pci` and its variant drivers.
//!
//! A variant driver is a PCI driver built on `vfio-pci-core` for one family of
//! devices (live migration, device memory). Linux names each after its module with
//! underscores and a `_vfio_pci` suffix, e.g. `nvgrace_gpu_vfio_pci` (module file
//! `nvgrace-gpu-vfio-pci.ko`), and that name is what `driver_override` must hold.
//! Anything else (`ahci`, `nvme`) would hand the device to a host driver: refused.
//!
//! ```
//! use sysfs_pci::vfio_driver::is_vfio_driver;
//! assert!(is_vfio_driver("vfio-pci"));
//! assert!(is_vfio_driver("mlx5_vfio_pci"));
//! assert!(!is_vfio_driver("ahci"));
//! assert!(!is_vfio_driver("vfio_pci"), "the driver is vfio-pci; vfio_pci is its module");
//! ```

/// The kernel's own VFIO PCI driver, and the default of every resource-list entry.
pub const VFIO_PCI: &str = "vfio-pci";

/// The suffix every vfio-pci variant driver's name ends with.
pub const VARIANT_SUFFIX: &str = "_vfio_pci";

/// The variant drivers Linux ships (`drivers/vfio/pci/*`), for messages; the rule in
/// [`is_vfio_driver`] also admits newer ones.
pub const KNOWN_VARIANTS: &[&str] = &[
    "hisi_acc_vfio_pci",
    "mlx5_vfio_pci",
    "nvgrace_gpu_vfio_pci",
    "pds_vfio_pci",
    "qat_vfio_pci",
    "virtio_vfio_pci",
    "xe_vfio_pci",
];

/// True for `vfio-pci` and for variant driver names: a prefix of ASCII letters,
/// digits and `_`, then `_vfio_pci`.
pub fn is_vfio_driver(name: &str) -> bool {
    if name == VFIO_PCI {
        return true;
    }
    name.strip_suffix(VARIANT_SUFFIX).is_some_and(|prefix| {
        !prefix.is_empty()
            && prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_')
    })
}

/// `Ok` for a driver an entry may name, else why not, listing what is allowed.
pub fn check_vfio_driver(name: &str) -> Result<(), String> {
    if is_vfio_driver(name) {
        return Ok(());
    }
    let allowed = format!(
        "allowed: {VFIO_PCI} or a vfio-pci variant driver named <name>{VARIANT_SUFFIX} \
         (Linux ships {})",
        KNOWN_VARIANTS.join(", ")
    );
    // Module names and driver names differ in '-' and '_'; say which one is meant.
    let underscored = name.replace('-', "_");
    let hint = if name == "vfio_pci" {
        " (the driver is vfio-pci; vfio_pci is its module)".to_owned()
    } else if underscored != name && is_vfio_driver(&underscored) {
        format!(" (the driver is {underscored}; {name} is its module file)")
    } else {
        String::new()
    };
    Err(format!("{name:?} is not a vfio driver{hint}; {allowed}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vfio_pci_and_every_variant_linux_ships_are_allowed() {
        assert!(is_vfio_driver("vfio-pci"));
        for v in KNOWN_VARIANTS {
            assert!(is_vfio_driver(v), "{v}");
            assert_eq!(check_vfio_driver(v), Ok(()));
        }
        assert!(is_vfio_driver("ism_vfio_pci"), "a newer variant");
    }

    #[test]
    fn host_drivers_and_near_misses_are_refused_with_the_allowed_list() {
        for (name, hint) in [
            ("ahci", ""),
            ("nvme", ""),
            ("pci-stub", ""),
            ("", ""),
            ("vfio", ""),
            ("vfio_pci", "the driver is vfio-pci"),
            ("VFIO-PCI", ""),
            ("_vfio_pci", ""),
            ("mlx5-vfio-pci", "the driver is mlx5_vfio_pci"),
            ("../x_vfio_pci", ""),
            ("x y_vfio_pci", ""),
            ("vfio-platform", ""),
        ] {
            assert!(!is_vfio_driver(name), "{name}");
            let msg = check_vfio_driver(name).unwrap_err();
            assert!(msg.contains("is not a vfio driver"), "{msg}");
            assert!(msg.contains(hint), "{name}: {msg}");
            assert!(
                msg.contains(
                    "allowed: vfio-pci or a vfio-pci variant driver named <name>_vfio_pci"
                ) && msg.contains("nvgrace_gpu_vfio_pci"),
                "{msg}"
            );
        }
    }
}
