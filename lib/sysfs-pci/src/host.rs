//! Where the node's kernel interfaces live: the sysfs, dev and modules roots.
//!
//! ```
//! use sysfs_pci::Host;
//! let host = Host::new("/tmp/fake/sys", "/tmp/fake/dev", "/tmp/fake/lib/modules");
//! assert_eq!(host.vfio_group_node(7).to_str(), Some("/tmp/fake/dev/vfio/7"));
//! ```

use std::path::{Path, PathBuf};

use crate::PciAddress;

/// Default sysfs root.
pub const DEFAULT_SYSFS_ROOT: &str = "/sys";
/// Default dev root.
pub const DEFAULT_DEV_ROOT: &str = "/dev";
/// Default kernel modules root (holds `<release>/modules.dep`).
pub const DEFAULT_MODULES_ROOT: &str = "/lib/modules";

/// The roots every node operation works under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// The sysfs mount, `/sys` on a real node.
    pub sysfs: PathBuf,
    /// The devtmpfs mount, `/dev` on a real node.
    pub dev: PathBuf,
    /// The modules tree, `/lib/modules` on a real node.
    pub modules: PathBuf,
}

impl Default for Host {
    fn default() -> Self {
        Self::new(DEFAULT_SYSFS_ROOT, DEFAULT_DEV_ROOT, DEFAULT_MODULES_ROOT)
    }
}

impl Host {
    /// A host with the given roots.
    pub fn new(
        sysfs: impl Into<PathBuf>,
        dev: impl Into<PathBuf>,
        modules: impl Into<PathBuf>,
    ) -> Self {
        Self {
            sysfs: sysfs.into(),
            dev: dev.into(),
            modules: modules.into(),
        }
    }

    /// `/sys/bus/pci/devices`.
    pub fn pci_devices_dir(&self) -> PathBuf {
        self.sysfs.join("bus/pci/devices")
    }

    /// `/sys/bus/pci/devices/<addr>`.
    pub fn device_dir(&self, addr: &PciAddress) -> PathBuf {
        self.pci_devices_dir().join(addr.to_string())
    }

    /// `/sys/bus/pci/drivers`.
    pub fn drivers_dir(&self) -> PathBuf {
        self.sysfs.join("bus/pci/drivers")
    }

    /// `/sys/bus/pci/drivers/<name>`.
    pub fn driver_dir(&self, name: &str) -> PathBuf {
        self.drivers_dir().join(name)
    }

    /// `/sys/bus/pci/drivers_probe`.
    pub fn drivers_probe(&self) -> PathBuf {
        self.sysfs.join("bus/pci/drivers_probe")
    }

    /// `/sys/bus/pci/rescan`.
    pub fn pci_rescan(&self) -> PathBuf {
        self.sysfs.join("bus/pci/rescan")
    }

    /// `/sys/kernel/iommu_groups`.
    pub fn iommu_groups_dir(&self) -> PathBuf {
        self.sysfs.join("kernel/iommu_groups")
    }

    /// `/sys/kernel/iommu_groups/<group>/devices`.
    pub fn iommu_group_devices_dir(&self, group: u32) -> PathBuf {
        self.iommu_groups_dir()
            .join(group.to_string())
            .join("devices")
    }

    /// `/sys/module/<name>` (module names use `_`, never `-`).
    pub fn module_dir(&self, name: &str) -> PathBuf {
        self.sysfs.join("module").join(name.replace('-', "_"))
    }

    /// `/dev/vfio`.
    pub fn vfio_dir(&self) -> PathBuf {
        self.dev.join("vfio")
    }

    /// `/dev/vfio/vfio`, the container node.
    pub fn vfio_container_node(&self) -> PathBuf {
        self.vfio_dir().join("vfio")
    }

    /// `/dev/vfio/<group>`.
    pub fn vfio_group_node(&self, group: u32) -> PathBuf {
        self.vfio_dir().join(group.to_string())
    }

    /// `/dev/vfio/devices/<name>`, a VFIO device cdev (`name` is `vfioN`).
    pub fn vfio_cdev_node(&self, name: &str) -> PathBuf {
        self.vfio_dir().join("devices").join(name)
    }

    /// `/dev/iommu`, the iommufd node.
    pub fn iommufd_node(&self) -> PathBuf {
        self.dev.join("iommu")
    }

    /// `/sys/class/vfio-dev`, every vfio device's `vfioN` entry.
    pub fn vfio_dev_class_dir(&self) -> PathBuf {
        self.sysfs.join("class/vfio-dev")
    }

    /// `<modules>/<release>`.
    pub fn modules_release_dir(&self, release: &str) -> PathBuf {
        self.modules.join(release)
    }

    /// True when `path` exists under this host (for messages and checks).
    pub fn exists(path: &Path) -> bool {
        path.symlink_metadata().is_ok()
    }
}
