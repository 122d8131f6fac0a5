//! The checks that decide whether a VM can start with the node's selected devices,
//! each named, with a reason and a hint to fix it.

use std::collections::BTreeSet;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use passthrough::config::ResourceList;
use passthrough::inventory::{Inventory, Role};
use passthrough::VFIO_MODULES;
use support::error_chain;
use sysfs_pci::cdev::{kernel_has_vfio_cdev, vfio_cdev_name};
use sysfs_pci::group::iommu_enabled;
use sysfs_pci::interrupts::{InterruptIsolation, Verdict};
use sysfs_pci::module::is_loaded;
use sysfs_pci::Host;

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Check {
    /// Stable name (`iommu`, `vfio-modules`, ...).
    pub name: &'static str,
    /// True when it passed.
    pub passed: bool,
    /// What was found.
    pub reason: String,
    /// How to fix it, for failures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// What a pass gives up, when it does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

/// A selected device as validated.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Device {
    /// Its address.
    pub bdf: String,
    /// Its resource name.
    pub resource: String,
    /// The driver it is on.
    pub driver: Option<String>,
    /// Its IOMMU group.
    pub group: Option<u32>,
}

/// Everything one validation pass found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Report {
    /// Every check, in a fixed order.
    pub checks: Vec<Check>,
    /// The selected devices.
    pub devices: Vec<Device>,
    /// The IOMMU groups of the selected devices.
    pub groups: Vec<u32>,
}

impl Report {
    /// True when every check passed.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }
}

fn pass(name: &'static str, reason: impl Into<String>) -> Check {
    Check {
        name,
        passed: true,
        reason: reason.into(),
        hint: None,
        warning: None,
    }
}

fn fail(name: &'static str, reason: impl Into<String>, hint: impl Into<String>) -> Check {
    Check {
        name,
        passed: false,
        reason: reason.into(),
        hint: Some(hint.into()),
        warning: None,
    }
}

fn is_char_device(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_char_device())
}

/// Runs every check against `host`.
pub fn validate(host: &Host, list: &ResourceList, allow_empty: bool) -> Report {
    let mut checks = vec![
        check_iommu(host),
        check_modules(host),
        check_interrupts(host),
        check_container(host),
    ];
    let inv = match Inventory::scan(host, list) {
        Ok(inv) => inv,
        Err(e) => {
            checks.push(fail(
                "devices-found",
                format!("cannot read the PCI devices: {}", error_chain(&e)),
                "check that sysfs is mounted (--sysfs-root)",
            ));
            return Report {
                checks,
                devices: Vec::new(),
                groups: Vec::new(),
            };
        }
    };
    let selected: Vec<_> = inv.selected().collect();
    let devices: Vec<Device> = selected
        .iter()
        .map(|e| Device {
            bdf: e.device.address.to_string(),
            resource: e.resource().map(|r| r.to_string()).unwrap_or_default(),
            driver: e.device.driver.clone(),
            group: e.device.iommu_group,
        })
        .collect();
    let groups: Vec<u32> = selected
        .iter()
        .filter_map(|e| e.device.iommu_group)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();

    checks.push(check_found(&inv, selected.len(), allow_empty));

    let unbound: Vec<String> = selected
        .iter()
        .filter(|e| !e.is_bound())
        .map(|e| {
            format!(
                "{} on {} (want {})",
                e.device.address,
                e.device.driver.as_deref().unwrap_or("no driver"),
                e.target_driver
            )
        })
        .collect();
    checks.push(if unbound.is_empty() {
        pass(
            "devices-bound",
            format!("{} on their vfio driver", selected.len()),
        )
    } else {
        fail(
            "devices-bound",
            format!("not bound: {}", unbound.join(", ")),
            "run vfio-manager (the DaemonSet, or `vfio-manager bind --all`) on this node",
        )
    });

    checks.push(check_groups(&inv, &selected));

    let missing: Vec<String> = groups
        .iter()
        .map(|g| host.vfio_group_node(*g))
        .filter(|p| !is_char_device(p))
        .map(|p| p.display().to_string())
        .collect();
    checks.push(if missing.is_empty() {
        pass(
            "group-nodes",
            format!("{} group node(s) present", groups.len()),
        )
    } else {
        fail(
            "group-nodes",
            format!("missing or not a char device: {}", missing.join(", ")),
            "a group node appears once every member is bound to vfio-pci; is the \
                host's /dev mounted (--dev-root)?",
        )
    });
    checks.push(check_cdev(host, &selected));
    Report {
        checks,
        devices,
        groups,
    }
}

/// `devices-found`: at least one selected device (unless allowed), naming every device
/// the scan had to skip so that a malformed one is seen without hiding the others.
fn check_found(inv: &Inventory, selected: usize, allow_empty: bool) -> Check {
    let skipped = if inv.skipped.is_empty() {
        String::new()
    } else {
        let names: Vec<String> = inv.skipped.iter().map(ToString::to_string).collect();
        format!(
            "; skipped {} device(s) that cannot be used: {}",
            inv.skipped.len(),
            names.join("; ")
        )
    };
    if selected > 0 {
        pass(
            "devices-found",
            format!("{selected} selected device(s){skipped}"),
        )
    } else if allow_empty {
        pass(
            "devices-found",
            format!("no selected device (allowed by --allow-empty){skipped}"),
        )
    } else if skipped.is_empty() {
        fail(
            "devices-found",
            "no PCI device matches the resource list",
            "check the resource list (--config) against `lspci -nn`, or pass --allow-empty",
        )
    } else {
        fail(
            "devices-found",
            format!("no usable PCI device matches the resource list{skipped}"),
            "the skipped devices' sysfs attributes are malformed: check the device and \
                its driver (dmesg)",
        )
    }
}

fn check_iommu(host: &Host) -> Check {
    let dir = host.iommu_groups_dir();
    match std::fs::read_dir(&dir).map(|d| d.count()) {
        Ok(n) if n > 0 && iommu_enabled(host) => pass("iommu", format!("{n} IOMMU groups")),
        _ => fail(
            "iommu",
            format!("{} is empty or missing: the IOMMU is off", dir.display()),
            "enable VT-d / AMD-Vi in the firmware and add intel_iommu=on (Intel) or amd_iommu=on (AMD) \
             to the kernel command line (iommu=pt keeps host DMA fast), then reboot",
        ),
    }
}

fn check_modules(host: &Host) -> Check {
    // vfio_pci can be built in: then its driver is registered without a module entry.
    let missing: Vec<&str> = VFIO_MODULES
        .iter()
        .copied()
        .filter(|m| {
            !(is_loaded(host, m)
                || (*m == "vfio_pci" && Host::exists(&host.driver_dir("vfio-pci"))))
        })
        .collect();
    if missing.is_empty() {
        pass("vfio-modules", VFIO_MODULES.join(", ") + " loaded")
    } else {
        fail(
            "vfio-modules",
            format!("not loaded: {}", missing.join(", ")),
            "vfio-manager loads them; by hand: modprobe vfio-pci vfio_iommu_type1",
        )
    }
}

/// `interrupt-isolation`: device MSIs are isolated (interrupt remapping, a GICv3
/// ITS), without which vfio refuses every VMM the devices
/// ([`sysfs_pci::interrupts`] says what is read and why); a module's
/// `allow_unsafe_interrupts` passes with a warning.
fn check_interrupts(host: &Host) -> Check {
    let found = InterruptIsolation::read(host);
    match found.verdict() {
        Verdict::Isolated(_) => pass(NAME_INTERRUPTS, found.finding()),
        Verdict::UnsafeAllowed => Check {
            warning: found.warning(),
            ..pass(NAME_INTERRUPTS, found.finding())
        },
        Verdict::Missing => fail(NAME_INTERRUPTS, found.finding(), found.fix()),
    }
}

/// The interrupt check's name (also the longest, which the table lines up on).
pub const NAME_INTERRUPTS: &str = "interrupt-isolation";

fn check_container(host: &Host) -> Check {
    let node = host.vfio_container_node();
    if is_char_device(&node) {
        pass("vfio-container", format!("{} present", node.display()))
    } else {
        fail(
            "vfio-container",
            format!("{} is missing or not a char device", node.display()),
            "it appears when the vfio module loads; is the host's /dev mounted (--dev-root)?",
        )
    }
}

/// `vfio-cdev`: on a kernel with the VFIO device cdev, every selected device on its
/// vfio driver has `/dev/vfio/devices/vfioN` and `/dev/iommu` is there, so iommufd
/// users (KubeVirt with iommufd, the plugins' `--iommufd`) can open them. Skipped,
/// with the reason, on kernels without it (the group nodes are then the only way).
fn check_cdev(host: &Host, selected: &[&passthrough::inventory::Entry]) -> Check {
    match kernel_has_vfio_cdev(host) {
        None => {
            return pass(
                "vfio-cdev",
                "skipped: no vfio device in /sys/class/vfio-dev tells whether the \
                    kernel has the VFIO device cdev",
            )
        }
        Some(false) => {
            return pass(
                "vfio-cdev",
                "skipped: the kernel has no VFIO device cdev (CONFIG_VFIO_DEVICE_CDEV \
                    unset); iommufd cannot be used, the group nodes can",
            )
        }
        Some(true) => {}
    }
    let mut missing = Vec::new();
    let mut nodes = 0;
    for e in selected.iter().filter(|e| e.is_bound()) {
        match vfio_cdev_name(host, &e.device.address) {
            None => missing.push(format!("{} has no vfio-dev/vfioN", e.device.address)),
            Some(name) => {
                let node = host.vfio_cdev_node(&name);
                if is_char_device(&node) {
                    nodes += 1;
                } else {
                    missing.push(format!(
                        "{}: {} is missing or not a char device",
                        e.device.address,
                        node.display()
                    ));
                }
            }
        }
    }
    let iommu = host.iommufd_node();
    if !is_char_device(&iommu) {
        missing.push(format!(
            "{} is missing or not a char device",
            iommu.display()
        ));
    }
    if missing.is_empty() {
        pass(
            "vfio-cdev",
            format!("{nodes} device cdev(s) under /dev/vfio/devices and /dev/iommu present"),
        )
    } else {
        fail(
            "vfio-cdev",
            missing.join("; "),
            "the nodes appear when the device binds to vfio-pci (/dev/iommu when the iommufd module loads); \
             is the host's /dev mounted (--dev-root)?",
        )
    }
}

fn check_groups(inv: &Inventory, selected: &[&passthrough::inventory::Entry]) -> Check {
    let mut problems: Vec<String> = selected
        .iter()
        .filter(|e| e.device.iommu_group.is_none())
        .map(|e| format!("{} has no IOMMU group", e.device.address))
        .collect();
    for v in inv.groups.values() {
        for b in &v.blockers {
            let role = match inv.get(&b.address).map(|e| &e.role) {
                Some(Role::Selected { .. }) => "selected device",
                _ => "companion",
            };
            problems.push(format!(
                "group {}: {role} {} is on {}",
                v.group, b.address, b.driver
            ));
        }
    }
    // Selected devices held back because their group has a member we cannot read.
    problems.extend(
        inv.skipped
            .iter()
            .filter(|s| s.resource.is_some())
            .map(ToString::to_string),
    );
    let hint = if inv.skipped.iter().any(|s| s.resource.is_some()) {
        "a group is only used when every member can be read: fix or remove the member \
         whose sysfs attributes are malformed (see devices-found)"
    } else if selected.iter().any(|e| e.device.iommu_group.is_none()) {
        "devices get IOMMU groups once the IOMMU is on: see the iommu check"
    } else {
        "every non-bridge member of a group must be on vfio-pci, pci-stub or no driver: \
         `vfio-manager bind --device <bdf>` moves the whole group"
    };
    if problems.is_empty() {
        pass(
            "groups-viable",
            format!("{} group(s) viable", inv.groups.len()),
        )
    } else {
        fail("groups-viable", problems.join("; "), hint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sysfs_pci::testing::{FakeDevice, FakeNode};

    const LIST: &str =
        r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;

    /// A ready node: vfio loaded, a two-function card in group 5 on vfio-pci, char
    /// device nodes (links to /dev/null stand in for the kernel's).
    fn ready_node() -> (tempfile::TempDir, FakeNode, ResourceList) {
        let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
        let node = FakeNode::new(dir.path());
        node.add_driver("vfio-pci");
        node.add_driver("e1000e");
        for m in VFIO_MODULES {
            node.add_module(m);
        }
        node.add_device(
            &FakeDevice::new("0000:01:00.0", 0x8086, 0x10d3, 0x02_0000)
                .driver("vfio-pci")
                .group(5),
        );
        node.add_device(
            &FakeDevice::new("0000:01:00.1", 0x8086, 0x10d3, 0x02_0000)
                .driver("vfio-pci")
                .group(5),
        );
        char_node(&node, "vfio");
        char_node(&node, "5");
        (dir, node, ResourceList::parse(LIST).unwrap())
    }

    fn char_node(node: &FakeNode, name: &str) {
        let p = node.host.vfio_dir().join(name);
        let _ = std::fs::remove_file(&p);
        std::os::unix::fs::symlink("/dev/null", p).unwrap();
    }

    fn failed(r: &Report) -> Vec<(&'static str, String)> {
        r.checks
            .iter()
            .filter(|c| !c.passed)
            .map(|c| (c.name, c.reason.clone()))
            .collect()
    }

    #[test]
    fn a_ready_node_passes_every_check_in_order() {
        let (_d, node, list) = ready_node();
        let r = validate(&node.host, &list, false);
        let names: Vec<_> = r.checks.iter().map(|c| c.name).collect();
        assert_eq!(
            names,
            [
                "iommu",
                "vfio-modules",
                "interrupt-isolation",
                "vfio-container",
                "devices-found",
                "devices-bound",
                "groups-viable",
                "group-nodes",
                "vfio-cdev"
            ]
        );
        assert!(r.passed(), "{:?}", failed(&r));
        assert_eq!(r.groups, [5]);
        assert_eq!(r.devices.len(), 2);
    }

    #[test]
    fn iommu_off_fails_with_a_hint() {
        let (_d, node, list) = ready_node();
        std::fs::remove_dir_all(node.host.iommu_groups_dir()).unwrap();
        let r = validate(&node.host, &list, false);
        let c = &r.checks[0];
        assert_eq!((c.name, c.passed), ("iommu", false));
        assert!(
            c.hint.as_deref().unwrap().contains("intel_iommu=on"),
            "{c:?}"
        );
    }

    #[test]
    fn missing_modules_are_named() {
        let (_d, node, list) = ready_node();
        std::fs::remove_dir(node.host.module_dir("vfio_iommu_type1")).unwrap();
        let r = validate(&node.host, &list, false);
        assert_eq!(
            failed(&r),
            [("vfio-modules", "not loaded: vfio_iommu_type1".to_string())]
        );
    }

    #[test]
    fn container_node_must_be_a_char_device() {
        let (_d, node, list) = ready_node();
        let p = node.host.vfio_container_node();
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, "").unwrap();
        let r = validate(&node.host, &list, false);
        assert_eq!(failed(&r)[0].0, "vfio-container");
        assert!(failed(&r)[0]
            .1
            .ends_with("dev/vfio/vfio is missing or not a char device"));
    }

    #[test]
    fn no_device_fails_unless_allowed() {
        let (_d, node, _) = ready_node();
        let other =
            ResourceList::parse(r#"{"resources":[{"name":"example.com/X","vendor":"1eff"}]}"#)
                .unwrap();
        assert_eq!(
            failed(&validate(&node.host, &other, false))[0].0,
            "devices-found"
        );
        assert!(validate(&node.host, &other, true).passed());
    }

    #[test]
    fn unbound_devices_are_named_with_their_driver() {
        let (_d, node, list) = ready_node();
        node.attach(&"0000:01:00.1".parse().unwrap(), "e1000e");
        char_node(&node, "5");
        let r = validate(&node.host, &list, false);
        let f = failed(&r);
        assert_eq!(
            f[0],
            (
                "devices-bound",
                "not bound: 0000:01:00.1 on e1000e (want vfio-pci)".to_string()
            )
        );
        assert_eq!(
            f[1],
            (
                "groups-viable",
                "group 5: selected device 0000:01:00.1 is on e1000e".to_string()
            )
        );
    }

    #[test]
    fn a_companion_on_a_host_driver_breaks_its_group_and_is_named() {
        let (_d, node, list) = ready_node();
        node.add_device(
            &FakeDevice::new("0000:01:00.2", 0x8086, 0x1234, 0x04_0300)
                .driver("snd_hda_intel")
                .group(5),
        );
        char_node(&node, "5");
        let r = validate(&node.host, &list, false);
        assert_eq!(
            failed(&r),
            [(
                "groups-viable",
                "group 5: companion 0000:01:00.2 is on snd_hda_intel".to_string()
            )]
        );
    }

    #[test]
    fn a_malformed_device_is_named_and_the_others_still_pass() {
        let (_d, node, list) = ready_node();
        node.add_device(
            &FakeDevice::new("0000:02:00.0", 0x8086, 0x10d3, 0x02_0000)
                .driver("vfio-pci")
                .group(6),
        );
        let bad = node.canonical_dir(&"0000:02:00.0".parse().unwrap());
        std::fs::write(bad.join("device"), "garbage\n").unwrap();
        let r = validate(&node.host, &list, false);
        assert!(r.passed(), "{:?}", failed(&r));
        let found = &r.checks[4];
        assert_eq!(found.name, "devices-found");
        assert!(
            found.reason.starts_with(
                "2 selected device(s); skipped 1 device(s) that cannot be used: 0000:02:00.0: \
                 unexpected contents \"garbage\" in "
            ) && found.reason.contains("0000:02:00.0/device"),
            "{found:?}"
        );
        assert_eq!(r.devices.len(), 2);
    }

    #[test]
    fn a_malformed_companion_fails_its_group_by_name() {
        let (_d, node, list) = ready_node();
        node.add_device(
            &FakeDevice::new("0000:01:00.2", 0x8086, 0x1234, 0x04_0300)
                .driver("vfio-pci")
                .group(5),
        );
        let bad = node.canonical_dir(&"0000:01:00.2".parse().unwrap());
        std::fs::write(bad.join("numa_node"), "-2\n").unwrap();
        let r = validate(&node.host, &list, false);
        let f = failed(&r);
        assert_eq!(f[0].0, "devices-found", "{f:?}");
        assert!(
            f[0].1
                .starts_with("no usable PCI device matches the resource list; skipped 3 device(s)"),
            "{f:?}"
        );
        assert_eq!(f[1].0, "groups-viable", "{f:?}");
        assert_eq!(
            f[1].1,
            "0000:01:00.0: IOMMU group 5 has a member that could not be read (0000:01:00.2); \
             the group is left alone; 0000:01:00.1: IOMMU group 5 has a member that could not \
             be read (0000:01:00.2); the group is left alone"
        );
        assert!(r.devices.is_empty() && r.groups.is_empty());
    }

    #[test]
    fn missing_group_node_is_named() {
        let (_d, node, list) = ready_node();
        std::fs::remove_file(node.host.vfio_group_node(5)).unwrap();
        let r = validate(&node.host, &list, false);
        assert_eq!(failed(&r)[0].0, "group-nodes");
        assert!(failed(&r)[0].1.ends_with("dev/vfio/5"), "{:?}", failed(&r));
    }

    /// `<device>/vfio-dev/<name>` and its `/sys/class/vfio-dev` link, as the kernel
    /// makes them for a device on vfio-pci; with `cdev` (CONFIG_VFIO_DEVICE_CDEV) also
    /// the `dev` attribute and `/dev/vfio/devices/<name>`.
    fn vfio_dev(node: &FakeNode, addr: &str, name: &str, cdev: bool) {
        let a: sysfs_pci::PciAddress = addr.parse().unwrap();
        let dir = node.host.device_dir(&a).join("vfio-dev").join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let class = node.host.vfio_dev_class_dir();
        std::fs::create_dir_all(&class).unwrap();
        std::os::unix::fs::symlink(&dir, class.join(name)).unwrap();
        if cdev {
            std::fs::write(dir.join("dev"), "511:0\n").unwrap();
            let n = node.host.vfio_cdev_node(name);
            std::fs::create_dir_all(n.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink("/dev/null", n).unwrap();
        }
    }

    fn cdev_check(r: &Report) -> &Check {
        r.checks.iter().find(|c| c.name == "vfio-cdev").unwrap()
    }

    #[test]
    fn cdev_nodes_pass_on_a_cdev_kernel() {
        let (_d, node, list) = ready_node();
        vfio_dev(&node, "0000:01:00.0", "vfio0", true);
        vfio_dev(&node, "0000:01:00.1", "vfio1", true);
        std::os::unix::fs::symlink("/dev/null", node.host.iommufd_node()).unwrap();
        let r = validate(&node.host, &list, false);
        assert!(r.passed(), "{:?}", failed(&r));
        assert_eq!(
            cdev_check(&r).reason,
            "2 device cdev(s) under /dev/vfio/devices and /dev/iommu present"
        );
    }

    #[test]
    fn missing_cdev_and_iommu_nodes_are_named() {
        let (_d, node, list) = ready_node();
        vfio_dev(&node, "0000:01:00.0", "vfio0", true);
        vfio_dev(&node, "0000:01:00.1", "vfio1", true);
        std::fs::remove_file(node.host.vfio_cdev_node("vfio1")).unwrap();
        let r = validate(&node.host, &list, false);
        let f = failed(&r);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].0, "vfio-cdev");
        assert!(
            f[0].1.starts_with("0000:01:00.1: ")
                && f[0].1.contains("dev/vfio/devices/vfio1 is missing")
                && f[0]
                    .1
                    .ends_with("dev/iommu is missing or not a char device"),
            "{f:?}"
        );
    }

    #[test]
    fn cdev_is_skipped_with_the_reason_on_a_kernel_without_it() {
        let (_d, node, list) = ready_node();
        vfio_dev(&node, "0000:01:00.0", "vfio0", false);
        vfio_dev(&node, "0000:01:00.1", "vfio1", false);
        let r = validate(&node.host, &list, false);
        assert!(r.passed(), "{:?}", failed(&r));
        assert!(
            cdev_check(&r)
                .reason
                .starts_with("skipped: the kernel has no VFIO device cdev"),
            "{:?}",
            cdev_check(&r)
        );
        let (_d, node, list) = ready_node();
        let r = validate(&node.host, &list, false);
        assert!(
            cdev_check(&r).passed && cdev_check(&r).reason.starts_with("skipped: no vfio device")
        );
    }
}
