//! The VFIO device cdev (`/dev/vfio/devices/vfioN`) and `/dev/iommu`: how to tell
//! whether the kernel made them for a device bound to a vfio driver.
//!
//! Every kernel since 6.1 registers a `vfioN` device in the `vfio-dev` class for each
//! vfio device, so `<device>/vfio-dev/vfioN` and `/sys/class/vfio-dev/` exist with
//! or without `CONFIG_VFIO_DEVICE_CDEV`. Only with it is the device a character
//! device: it then has a `dev` attribute (`major:minor`) and a node under
//! `/dev/vfio/devices/`. In linux 6.12, drivers/vfio/vfio.h `vfio_device_add()` calls
//! `cdev_device_add()` with `CONFIG_VFIO_DEVICE_CDEV` and plain `device_add()`
//! (no devt, no `dev` attribute, no node) without it; drivers/vfio/vfio_main.c
//! creates the `vfio-dev` class unconditionally.

use crate::{Host, PciAddress};

/// The `vfioN` name of the device cdev of the function at `address`, when the kernel
/// made one: the first `vfio-dev/vfio<N>` entry with a `dev` attribute. `None` when
/// the function is not on a vfio driver or the kernel lacks `CONFIG_VFIO_DEVICE_CDEV`.
pub fn vfio_cdev_name(host: &Host, address: &PciAddress) -> Option<String> {
    let dir = host.device_dir(address).join("vfio-dev");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| is_cdev_name(n) && Host::exists(&dir.join(n).join("dev")))
        .collect();
    names.sort();
    names.into_iter().next()
}

/// True for `vfio` followed by decimal digits, as vfio_main.c names its devices.
fn is_cdev_name(name: &str) -> bool {
    name.strip_prefix("vfio")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// True when the running kernel has the VFIO device cdev: some vfio device in
/// `/sys/class/vfio-dev/` has a `dev` attribute. `None` when no vfio device exists
/// (the class is empty or missing, e.g. before vfio loads), so nothing can be told.
pub fn kernel_has_vfio_cdev(host: &Host) -> Option<bool> {
    let dir = host.vfio_dev_class_dir();
    let mut seen = false;
    for entry in std::fs::read_dir(&dir).ok()?.filter_map(Result::ok) {
        let name = entry.file_name();
        if !is_cdev_name(&name.to_string_lossy()) {
            continue;
        }
        seen = true;
        if Host::exists(&dir.join(&name).join("dev")) {
            return Some(true);
        }
    }
    seen.then_some(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FakeDevice, FakeNode};

    /// Adds `<device>/vfio-dev/<name>` and its class link, with a `dev` attribute
    /// when `cdev` (a kernel with `CONFIG_VFIO_DEVICE_CDEV`).
    fn add_vfio_dev(node: &FakeNode, addr: &str, name: &str, cdev: bool) {
        let a: PciAddress = addr.parse().unwrap();
        let dir = node.host.device_dir(&a).join("vfio-dev").join(name);
        std::fs::create_dir_all(&dir).unwrap();
        if cdev {
            std::fs::write(dir.join("dev"), "511:0\n").unwrap();
        }
        let class = node.host.vfio_dev_class_dir();
        std::fs::create_dir_all(&class).unwrap();
        std::os::unix::fs::symlink(&dir, class.join(name)).unwrap();
    }

    fn node() -> (tempfile::TempDir, FakeNode) {
        let dir = tempfile::tempdir_in(crate::testing::scratch_root()).unwrap();
        let node = FakeNode::new(dir.path());
        node.add_driver("vfio-pci");
        node.add_device(
            &FakeDevice::new("0000:01:00.0", 0x8086, 0x10d3, 0x02_0000)
                .driver("vfio-pci")
                .group(5),
        );
        (dir, node)
    }

    #[test]
    fn a_cdev_kernel_names_the_node() {
        let (_d, node) = node();
        add_vfio_dev(&node, "0000:01:00.0", "vfio3", true);
        let a = "0000:01:00.0".parse().unwrap();
        assert_eq!(vfio_cdev_name(&node.host, &a).as_deref(), Some("vfio3"));
        assert_eq!(kernel_has_vfio_cdev(&node.host), Some(true));
    }

    #[test]
    fn a_vfio_dev_entry_without_dev_is_no_cdev() {
        let (_d, node) = node();
        add_vfio_dev(&node, "0000:01:00.0", "vfio0", false);
        let a = "0000:01:00.0".parse().unwrap();
        assert_eq!(vfio_cdev_name(&node.host, &a), None);
        assert_eq!(kernel_has_vfio_cdev(&node.host), Some(false));
    }

    #[test]
    fn no_vfio_device_tells_nothing() {
        let (_d, node) = node();
        let a = "0000:01:00.0".parse().unwrap();
        assert_eq!(vfio_cdev_name(&node.host, &a), None);
        assert_eq!(kernel_has_vfio_cdev(&node.host), None);
    }

    #[test]
    fn only_vfio_and_digits_is_a_cdev_name() {
        assert!(is_cdev_name("vfio0"));
        assert!(is_cdev_name("vfio12"));
        assert!(!is_cdev_name("vfio"));
        assert!(!is_cdev_name("vfio-x"));
        assert!(!is_cdev_name("power"));
    }
}
