//! What the vfio-manager test binaries share.

use std::path::Path;
use std::process::Command;

/// The real binary pointed at the fake node under `dir` (`sys/`, `dev/`,
/// `lib/modules/`, `run/state.json`, `run/owner/owner.lock`, `list.json`).
pub fn command(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vfio-manager"));
    c.args(["--sysfs-root", &dir.join("sys").to_string_lossy()])
        .args(["--owner-lock", &dir.join(OWNER_LOCK).to_string_lossy()])
        .args(["--dev-root", &dir.join("dev").to_string_lossy()])
        .args(["--modules-root", &dir.join("lib/modules").to_string_lossy()])
        .args([
            "--state-file",
            &dir.join("run/state.json").to_string_lossy(),
        ])
        .args(["--config", &dir.join("list.json").to_string_lossy()])
        .args([
            "--dra-state-file",
            &dir.join(DRA_STATE_FILE).to_string_lossy(),
        ])
        .env_remove("VFIO_SANDBOX_CONFIG")
        .env_remove("VFIO_SANDBOX_OWNER_LOCK");
    c
}

/// sandbox-dra-driver's state file under the fake node's directory.
pub const DRA_STATE_FILE: &str = "run/dra/state.json";

/// The node-wide owner lock under the fake node's directory.
pub const OWNER_LOCK: &str = "run/owner/owner.lock";

/// The resource list of [`nic_node`]: Intel 82574L NICs stand in for NPUs.
pub const NIC_LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;

/// A fake node under `dir` with vfio-pci and e1000e registered, the vfio modules
/// loaded, `list.json` selecting 8086:10d3, and one such NIC per `(BDF, driver,
/// IOMMU group)`.
#[allow(dead_code)] // not every test binary uses every helper
pub fn nic_node(dir: &Path, nics: &[(&str, &str, u32)]) -> sysfs_pci::testing::FakeNode {
    use sysfs_pci::testing::{FakeDevice, FakeNode};
    let node = FakeNode::new(dir);
    node.add_driver("vfio-pci");
    node.add_driver("e1000e");
    node.add_module("vfio");
    node.add_module("vfio_iommu_type1");
    for (bdf, driver, group) in nics {
        node.add_device(
            &FakeDevice::new(bdf, 0x8086, 0x10d3, 0x02_0000)
                .driver(driver)
                .group(*group),
        );
    }
    std::fs::write(dir.join("list.json"), NIC_LIST).expect("write list.json");
    node
}
