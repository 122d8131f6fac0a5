//! `fake-node` lays out the node its help describes.

#![allow(clippy::unwrap_used)]

use std::process::Command;

#[test]
fn the_fake_node_has_its_three_devices_and_the_resource_list() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("node");
    let status = Command::new(env!("CARGO_BIN_EXE_fake-node"))
        .arg("--root")
        .arg(&root)
        .status()
        .unwrap();
    assert!(status.success());
    let devices = root.join("sys/bus/pci/devices");
    for bdf in [
        "0000:01:00.0",
        "0000:01:00.1",
        "0000:02:00.0",
        "0000:03:00.0",
    ] {
        assert!(devices.join(bdf).exists(), "{bdf}");
    }
    let list = std::fs::read_to_string(root.join("list.json")).unwrap();
    assert_eq!(list, sysfs_pci::testing::NIC_NODE_LIST);
    assert!(root.join("kubelet").is_dir());
    let out = Command::new(env!("CARGO_BIN_EXE_fake-node"))
        .args(["--root", "/proc/no-such-dir/x"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("cannot lay out /proc/no-such-dir/x"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
