//! Moving one PCI function between drivers, following the kernel contract:
//! `driver_override` first, then `driver/unbind`, then `drivers_probe` — never `new_id`.
//!
//! Its failpoints ([`support::failpoint`]): `bind-after-override`,
//! `bind-after-unbind` and `bind-after-probe` while binding, and
//! `restore-after-override`, `restore-after-unbind` and `restore-after-probe`
//! while putting a device back.
//!
//! ```no_run
//! use sysfs_pci::{bind, kernel::SysKernel, Host, PciDevice};
//! let host = Host::default();
//! let dev = PciDevice::read(&host, &"0000:3b:00.0".parse().unwrap()).unwrap();
//! bind::check_bindable(&host, &dev).unwrap();
//! bind::bind(&host, &SysKernel, &dev, "vfio-pci").unwrap();
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::device::{DeviceError, PciDevice};
use crate::kernel::Kernel;
use crate::vfio_driver::is_vfio_driver;
use crate::{Host, PciAddress};
use support::io::IoError;

/// Why a device could not be moved.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// No `iommu_group` link: the IOMMU is off.
    #[error(
        "cannot bind {address}: {path} does not exist, so the IOMMU is off; enable it on the \
         kernel command line (intel_iommu=on for Intel, amd_iommu=on for AMD; iommu=pt keeps \
         host DMA fast) and reboot"
    )]
    IommuOff {
        /// The device.
        address: PciAddress,
        /// The missing link.
        path: PathBuf,
    },
    /// A PF with VFs enabled cannot leave its driver.
    #[error(
        "cannot bind {address}: it is an SR-IOV physical function with {num_vfs} VFs enabled \
         ({path}); the kernel refuses (EBUSY). Disable them first (echo 0 > {path}) or select \
         the VFs instead"
    )]
    VfsEnabled {
        /// The PF.
        address: PciAddress,
        /// How many VFs are enabled.
        num_vfs: u32,
        /// Its `sriov_numvfs`.
        path: PathBuf,
    },
    /// Bridges are never rebound.
    #[error("cannot bind {address}: it is a PCI bridge; bridges stay on their driver")]
    Bridge {
        /// The bridge.
        address: PciAddress,
    },
    /// The target driver is not registered.
    #[error("cannot bind {address}: driver {driver} is not registered ({path} does not exist)")]
    #[allow(missing_docs)]
    DriverMissing {
        /// The device.
        address: PciAddress,
        driver: String,
        /// The driver's directory.
        path: PathBuf,
    },
    /// A sysfs write failed.
    #[error("cannot {action} {address}")]
    Write {
        /// The device.
        address: PciAddress,
        /// `bind` or `restore`.
        action: &'static str,
        /// The write that failed.
        #[source]
        source: IoError,
    },
    /// After the writes, the device is not on the expected driver.
    #[error(
        "{address} is on {actual} after {action}, expected {expected}; see dmesg for the \
         driver's probe error"
    )]
    NotBound {
        /// The device.
        address: PciAddress,
        /// `bind` or `restore`.
        action: &'static str,
        /// The driver wanted.
        expected: String,
        /// The driver found (or `no driver`).
        actual: String,
    },
    /// The VFIO group node did not appear.
    #[error("{address} is on {driver} but {path} did not appear")]
    #[allow(missing_docs)]
    GroupNodeMissing {
        /// The device.
        address: PciAddress,
        driver: String,
        /// The node expected.
        path: PathBuf,
    },
    /// Reading the device failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// What a bind did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BindOutcome {
    /// The device was already on the driver; nothing was written.
    AlreadyBound,
    /// The device moved from `previous` (or from no driver).
    Bound {
        /// The driver it left.
        previous: Option<String>,
    },
}

/// How long to wait for `/dev/vfio/<group>` after a bind.
const GROUP_NODE_WAIT: Duration = Duration::from_secs(2);

/// Checks the preconditions of binding `dev` to a vfio driver, returning its group.
pub fn check_bindable(host: &Host, dev: &PciDevice) -> Result<u32, DriverError> {
    let dir = host.device_dir(&dev.address);
    if dev.is_bridge() {
        return Err(DriverError::Bridge {
            address: dev.address,
        });
    }
    let group = dev.iommu_group.ok_or_else(|| DriverError::IommuOff {
        address: dev.address,
        path: dir.join("iommu_group"),
    })?;
    if let Some(sriov) = dev.sriov.filter(|s| s.num_vfs > 0) {
        return Err(DriverError::VfsEnabled {
            address: dev.address,
            num_vfs: sriov.num_vfs,
            path: dir.join("sriov_numvfs"),
        });
    }
    Ok(group)
}

/// Binds `dev` to `driver`: override, unbind, probe, then confirm.
///
/// Call [`check_bindable`] first. On a dry-run kernel the writes are printed and the
/// confirmation is skipped.
pub fn bind(
    host: &Host,
    kernel: &dyn Kernel,
    dev: &PciDevice,
    driver: &str,
) -> Result<BindOutcome, DriverError> {
    let address = dev.address;
    if dev.driver.as_deref() == Some(driver) {
        return Ok(BindOutcome::AlreadyBound);
    }
    let driver_dir = host.driver_dir(driver);
    if !kernel.is_dry_run() && !Host::exists(&driver_dir) {
        return Err(DriverError::DriverMissing {
            address,
            driver: driver.to_owned(),
            path: driver_dir,
        });
    }
    let bdf = address.to_string();
    let dir = host.device_dir(&address);
    let write = writer(kernel, address, "bind");
    write(dir.join("driver_override"), driver)?;
    support::failpoint::step("bind-after-override");
    if dev.driver.is_some() {
        write(dir.join("driver/unbind"), &bdf)?;
        support::failpoint::step("bind-after-unbind");
    }
    write(host.drivers_probe(), &bdf)?;
    support::failpoint::step("bind-after-probe");
    if !kernel.is_dry_run() {
        confirm_driver(host, &address, Some(driver), "bind")?;
        if is_vfio_driver(driver) {
            if let Some(group) = dev.iommu_group {
                wait_group_node(host, &address, driver, group)?;
            }
        }
    }
    if !kernel.is_dry_run() {
        tracing::info!(bdf = %address, driver, previous = dev.driver.as_deref().unwrap_or("none"), "bound");
    }
    Ok(BindOutcome::Bound {
        previous: dev.driver.clone(),
    })
}

/// Writes through `kernel`; a failure is a [`DriverError::Write`] of `action` on
/// `address`.
fn writer<'k>(
    kernel: &'k dyn Kernel,
    address: PciAddress,
    action: &'static str,
) -> impl Fn(PathBuf, &str) -> Result<(), DriverError> + 'k {
    move |path, data| {
        kernel
            .write(&path, data)
            .map_err(|source| DriverError::Write {
                address,
                action,
                source,
            })
    }
}

/// Puts `dev` back: restores `driver_override` to `original_override` (clears it when
/// `None`), unbinds the current driver, and re-probes so the kernel picks the native
/// driver. When `original_driver` is `None` the device is left without a driver.
pub fn restore(
    host: &Host,
    kernel: &dyn Kernel,
    dev: &PciDevice,
    original_driver: Option<&str>,
    original_override: Option<&str>,
) -> Result<(), DriverError> {
    let address = dev.address;
    let bdf = address.to_string();
    let dir = host.device_dir(&address);
    let write = writer(kernel, address, "restore");
    // A newline clears the override; an empty write is rejected by some kernels.
    write(
        dir.join("driver_override"),
        original_override.unwrap_or("\n"),
    )?;
    support::failpoint::step("restore-after-override");
    if dev.driver.is_some() && dev.driver.as_deref() != original_driver {
        write(dir.join("driver/unbind"), &bdf)?;
        support::failpoint::step("restore-after-unbind");
    }
    if original_driver.is_some() && dev.driver.as_deref() != original_driver {
        write(host.drivers_probe(), &bdf)?;
    }
    support::failpoint::step("restore-after-probe");
    if !kernel.is_dry_run() {
        confirm_driver(host, &address, original_driver, "restore")?;
    }
    if !kernel.is_dry_run() {
        tracing::info!(bdf = %address, driver = original_driver.unwrap_or("none"), "restored");
    }
    Ok(())
}

fn confirm_driver(
    host: &Host,
    address: &PciAddress,
    expected: Option<&str>,
    action: &'static str,
) -> Result<(), DriverError> {
    let actual = crate::device::link_name(&host.device_dir(address).join("driver"))
        .map_err(DeviceError::from)?;
    if actual.as_deref() == expected {
        return Ok(());
    }
    Err(DriverError::NotBound {
        address: *address,
        action,
        expected: expected.unwrap_or("no driver").to_owned(),
        actual: actual.unwrap_or_else(|| "no driver".to_owned()),
    })
}

fn wait_group_node(
    host: &Host,
    address: &PciAddress,
    driver: &str,
    group: u32,
) -> Result<(), DriverError> {
    let node = host.vfio_group_node(group);
    let start = Instant::now();
    while !Host::exists(&node) {
        if start.elapsed() > GROUP_NODE_WAIT {
            return Err(DriverError::GroupNodeMissing {
                address: *address,
                driver: driver.to_owned(),
                path: node,
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FakeDevice, FakeKernel, FakeNode};

    fn node() -> (tempfile::TempDir, FakeNode, FakeKernel) {
        let dir = tempfile::tempdir_in(crate::testing::scratch_root()).unwrap();
        let node = FakeNode::new(dir.path());
        node.add_driver("vfio-pci");
        node.add_device(
            &FakeDevice::new("0000:01:00.0", 0x1eff, 0x1220, 0x12_0000)
                .driver("rebellions")
                .group(5),
        );
        let kernel = FakeKernel::new(&node);
        kernel.learn_native_drivers();
        (dir, node, kernel)
    }

    fn addr(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    #[test]
    fn bind_writes_override_unbind_probe_in_that_order() {
        let (_d, node, kernel) = node();
        let dev = PciDevice::read(&node.host, &addr("0000:01:00.0")).unwrap();
        assert_eq!(check_bindable(&node.host, &dev).unwrap(), 5);
        let out = bind(&node.host, &kernel, &dev, "vfio-pci").unwrap();
        assert_eq!(
            out,
            BindOutcome::Bound {
                previous: Some("rebellions".into())
            }
        );
        assert_eq!(
            kernel.write_log(),
            [
                "sys/bus/pci/devices/0000:01:00.0/driver_override <- vfio-pci",
                "sys/bus/pci/devices/0000:01:00.0/driver/unbind <- 0000:01:00.0",
                "sys/bus/pci/drivers_probe <- 0000:01:00.0",
            ]
        );
        assert_eq!(node.driver_of(&dev.address).as_deref(), Some("vfio-pci"));
        assert!(node.host.vfio_group_node(5).exists());
    }

    #[test]
    fn bind_is_idempotent() {
        let (_d, node, kernel) = node();
        node.attach(&addr("0000:01:00.0"), "vfio-pci");
        let dev = PciDevice::read(&node.host, &addr("0000:01:00.0")).unwrap();
        assert_eq!(
            bind(&node.host, &kernel, &dev, "vfio-pci").unwrap(),
            BindOutcome::AlreadyBound
        );
        assert!(kernel.write_log().is_empty());
    }

    #[test]
    fn restore_clears_override_and_reprobes_native_driver() {
        let (_d, node, kernel) = node();
        let a = addr("0000:01:00.0");
        bind(
            &node.host,
            &kernel,
            &PciDevice::read(&node.host, &a).unwrap(),
            "vfio-pci",
        )
        .unwrap();
        kernel.writes.lock().unwrap().clear();
        let dev = PciDevice::read(&node.host, &a).unwrap();
        restore(&node.host, &kernel, &dev, Some("rebellions"), None).unwrap();
        assert_eq!(
            kernel.write_log(),
            [
                "sys/bus/pci/devices/0000:01:00.0/driver_override <- ",
                "sys/bus/pci/devices/0000:01:00.0/driver/unbind <- 0000:01:00.0",
                "sys/bus/pci/drivers_probe <- 0000:01:00.0",
            ]
        );
        assert_eq!(node.driver_of(&a).as_deref(), Some("rebellions"));
        assert!(!node.host.vfio_group_node(5).exists());
    }

    #[test]
    fn iommu_off_is_explained() {
        let (_d, node, _k) = node();
        node.add_device(&FakeDevice::new("0000:02:00.0", 0x1eff, 0x1220, 0x12_0000));
        let dev = PciDevice::read(&node.host, &addr("0000:02:00.0")).unwrap();
        let msg = check_bindable(&node.host, &dev).unwrap_err().to_string();
        assert!(msg.contains("0000:02:00.0"), "{msg}");
        assert!(msg.contains("iommu_group does not exist"), "{msg}");
        assert!(
            msg.contains("intel_iommu=on") && msg.contains("amd_iommu=on"),
            "{msg}"
        );
    }

    #[test]
    fn pf_with_vfs_enabled_is_refused() {
        let (_d, node, _k) = node();
        node.add_device(
            &FakeDevice::new("0000:03:00.0", 0x1eff, 0x1220, 0x12_0000)
                .group(7)
                .sriov(4, 2),
        );
        let dev = PciDevice::read(&node.host, &addr("0000:03:00.0")).unwrap();
        let msg = check_bindable(&node.host, &dev).unwrap_err().to_string();
        assert!(
            msg.contains("0000:03:00.0") && msg.contains("2 VFs enabled"),
            "{msg}"
        );
        assert!(msg.contains("sriov_numvfs"), "{msg}");
    }

    #[test]
    fn bridge_is_refused() {
        let (_d, node, _k) = node();
        node.add_device(&FakeDevice::new("0000:00:01.0", 0x8086, 0x1234, 0x06_0400).group(1));
        let dev = PciDevice::read(&node.host, &addr("0000:00:01.0")).unwrap();
        assert!(matches!(
            check_bindable(&node.host, &dev),
            Err(DriverError::Bridge { .. })
        ));
    }

    #[test]
    fn missing_driver_is_named() {
        let (_d, node, kernel) = node();
        let dev = PciDevice::read(&node.host, &addr("0000:01:00.0")).unwrap();
        let msg = bind(&node.host, &kernel, &dev, "nvgrace_gpu_vfio_pci")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("nvgrace_gpu_vfio_pci is not registered"),
            "{msg}"
        );
        assert!(kernel.write_log().is_empty());
    }

    #[test]
    fn kernel_error_names_device_file_and_data() {
        let (_d, node, kernel) = node();
        *kernel.fail_on.lock().unwrap() = Some(("driver/unbind".into(), 16));
        let dev = PciDevice::read(&node.host, &addr("0000:01:00.0")).unwrap();
        let err = bind(&node.host, &kernel, &dev, "vfio-pci").unwrap_err();
        let chain = support::error_chain(&err);
        assert!(
            chain.starts_with("cannot bind 0000:01:00.0: failed to write 0000:01:00.0 to "),
            "{chain}"
        );
        assert!(chain.contains("0000:01:00.0/driver/unbind"), "{chain}");
        assert!(
            chain.ends_with("Device or resource busy (os error 16)"),
            "{chain}"
        );
    }

    #[test]
    fn a_failed_probe_write_is_reported() {
        let (_d, node, kernel) = node();
        let dev = PciDevice::read(&node.host, &addr("0000:01:00.0")).unwrap();
        *kernel.fail_on.lock().unwrap() = Some(("drivers_probe".into(), 22));
        let err = bind(&node.host, &kernel, &dev, "vfio-pci").unwrap_err();
        assert!(
            matches!(err, DriverError::Write { action: "bind", .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("cannot bind 0000:01:00.0"));
        assert_eq!(
            node.driver_of(&dev.address),
            None,
            "left driverless for rollback"
        );
    }

    #[test]
    fn probe_that_picks_another_driver_is_reported() {
        let (_d, node, kernel) = node();
        node.add_driver("other");
        let dev = PciDevice::read(&node.host, &addr("0000:01:00.0")).unwrap();
        kernel
            .probe_outcome
            .lock()
            .unwrap()
            .insert(dev.address, Some("other".into()));
        let err = bind(&node.host, &kernel, &dev, "vfio-pci").unwrap_err();
        match &err {
            DriverError::NotBound {
                address,
                action,
                expected,
                actual,
            } => {
                assert_eq!(*address, dev.address);
                assert_eq!(*action, "bind");
                assert_eq!(expected, "vfio-pci");
                assert_eq!(actual, "other");
            }
            e => panic!("not NotBound: {e:?}"),
        }
        assert_eq!(
            err.to_string(),
            "0000:01:00.0 is on other after bind, expected vfio-pci; see dmesg for the \
             driver's probe error"
        );
    }

    #[test]
    fn probe_that_leaves_the_device_without_a_driver_is_reported() {
        let (_d, node, kernel) = node();
        let dev = PciDevice::read(&node.host, &addr("0000:01:00.0")).unwrap();
        kernel
            .probe_outcome
            .lock()
            .unwrap()
            .insert(dev.address, None);
        let err = bind(&node.host, &kernel, &dev, "vfio-pci").unwrap_err();
        assert!(
            matches!(&err, DriverError::NotBound { actual, .. } if actual == "no driver"),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .starts_with("0000:01:00.0 is on no driver after bind, expected vfio-pci"),
            "{err}"
        );
        // A restore whose probe finds no driver says so too.
        kernel.probe_outcome.lock().unwrap().clear();
        let dev = PciDevice::read(&node.host, &dev.address).unwrap();
        kernel
            .probe_outcome
            .lock()
            .unwrap()
            .insert(dev.address, None);
        let err = restore(&node.host, &kernel, &dev, Some("rebellions"), None).unwrap_err();
        assert!(
            matches!(&err, DriverError::NotBound { action: "restore", expected, .. } if expected == "rebellions"),
            "{err:?}"
        );
    }
}
