#![allow(clippy::unwrap_used)]

use super::*;
use passthrough::config::ResourceList;
use sysfs_pci::testing::{FakeDevice, FakeNode};

const LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;

fn attr<'d>(d: &'d Device, key: &str) -> &'d DeviceAttribute {
    d.attributes.as_ref().unwrap().get(key).unwrap()
}

fn scan(node: &FakeNode) -> Inventory {
    Inventory::scan(&node.host, &ResourceList::parse(LIST).unwrap()).unwrap()
}

/// A root port at 00:01.0 with the two-function card behind it (group 6, the
/// second function a companion of another vendor), a device on the root bus of
/// a second host bridge (group 7, NUMA node 1), and one on another domain.
fn node(dir: &std::path::Path) -> FakeNode {
    let node = FakeNode::new(dir);
    node.add_device(&FakeDevice::new("0000:00:01.0", 0x8086, 0x7c10, 0x06_0400).group(5));
    node.add_device(
        &FakeDevice::new("0000:01:00.0", 0x8086, 0x10d3, 0x02_0000)
            .parent("0000:00:01.0")
            .driver("e1000e")
            .group(6),
    );
    node.add_device(
        &FakeDevice::new("0000:01:00.1", 0x10ec, 0x0887, 0x04_0300)
            .parent("0000:00:01.0")
            .driver("snd_hda_intel")
            .group(6),
    );
    node.add_device(
        &FakeDevice::new("0000:80:02.0", 0x8086, 0x10d3, 0x02_0000)
            .group(7)
            .numa(1),
    );
    node.add_device(&FakeDevice::new("0001:00:03.0", 0x8086, 0x10d3, 0x02_0000).group(8));
    node
}

#[test]
fn one_device_per_selected_function_with_the_fixed_attributes() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let inv = scan(&node(dir.path()));
    let devices = slice_devices(&inv);
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        ["pci-0000-01-00-0", "pci-0000-80-02-0", "pci-0001-00-03-0"]
    );
    let card = &devices[0];
    assert_eq!(
        attr(card, PCI_BUS_ID).string.as_deref(),
        Some("0000:01:00.0")
    );
    assert_eq!(attr(card, PCIE_ROOT).string.as_deref(), Some("pci0000:00"));
    assert_eq!(attr(card, "vendorID").string.as_deref(), Some("0x8086"));
    assert_eq!(attr(card, "deviceID").string.as_deref(), Some("0x10d3"));
    assert_eq!(
        attr(card, "resourceName").string.as_deref(),
        Some("example.com/NIC_PT")
    );
    assert_eq!(attr(card, "iommuGroup").int, Some(6));
    assert!(
        !card.attributes.as_ref().unwrap().contains_key("numaNode"),
        "-1 is left out"
    );
    assert_eq!(card.attributes.as_ref().unwrap().len(), 6);
    assert_eq!(
        attr(&devices[1], PCIE_ROOT).string.as_deref(),
        Some("pci0000:80")
    );
    assert_eq!(attr(&devices[1], "numaNode").int, Some(1));
    assert_eq!(
        attr(&devices[2], PCIE_ROOT).string.as_deref(),
        Some("pci0001:00")
    );
    assert!(withdrawn(&inv).is_empty());
    // The same tree gives the same list, byte for byte.
    assert_eq!(
        serde_json::to_string(&devices).unwrap(),
        serde_json::to_string(&slice_devices(&inv)).unwrap()
    );
}

#[test]
fn devices_prepare_could_never_hand_over_are_withdrawn() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    // No IOMMU group, and a group whose other member has VFs enabled.
    node.add_device(&FakeDevice::new("0000:02:00.0", 0x8086, 0x10d3, 0x02_0000));
    node.add_device(&FakeDevice::new("0000:03:00.0", 0x8086, 0x10d3, 0x02_0000).group(9));
    node.add_device(
        &FakeDevice::new("0000:03:00.1", 0x15b3, 0x1017, 0x02_0000)
            .driver("mlx5_core")
            .sriov(8, 4)
            .group(9),
    );
    let inv = scan(&node);
    let names: Vec<String> = slice_devices(&inv).into_iter().map(|d| d.name).collect();
    assert_eq!(
        names,
        ["pci-0000-01-00-0", "pci-0000-80-02-0", "pci-0001-00-03-0"]
    );
    let w = withdrawn(&inv);
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(w[0].reason.contains("no IOMMU group"), "{w:?}");
    assert!(
        w[1].reason.contains("0000:03:00.1") && w[1].reason.contains("4 SR-IOV VFs"),
        "{w:?}"
    );
}

#[test]
fn a_group_with_an_unreadable_member_is_not_offered() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    let companion: PciAddress = "0000:01:00.1".parse().unwrap();
    std::fs::write(node.canonical_dir(&companion).join("class"), "junk").unwrap();
    let names: Vec<String> = slice_devices(&scan(&node))
        .into_iter()
        .map(|d| d.name)
        .collect();
    assert_eq!(names, ["pci-0000-80-02-0", "pci-0001-00-03-0"]);
}

#[test]
fn resource_name_follows_the_rebellions_naming() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = FakeNode::new(dir.path());
    node.add_device(&FakeDevice::new("0000:3b:00.0", 0x1eff, 0x1250, 0x12_0000).group(3));
    node.add_device(&FakeDevice::new("0000:5e:00.0", 0x1eff, 0x1221, 0x12_0000).group(4));
    let names = |json: &str| -> Vec<String> {
        let inv = Inventory::scan(&node.host, &ResourceList::parse(json).unwrap()).unwrap();
        slice_devices(&inv)
            .iter()
            .map(|d| attr(d, "resourceName").string.clone().unwrap())
            .collect()
    };
    assert_eq!(
        names(r#"{"preset": "rebellions"}"#),
        [
            "rebellions.ai/ATOM_CA25_PT",
            "rebellions.ai/ATOM_CA22_VF_PT"
        ]
    );
    assert_eq!(
        names(r#"{"preset": "rebellions", "naming": "pci-ids"}"#),
        ["rebellions.ai/RBLN-CA25_PF", "rebellions.ai/RBLN-CA22_VF"]
    );
}

/// `--binding-conditions=auto` marks the devices whose group leaves a native
/// driver between claims (the recorded driver counts, not the vfio-pci a claim
/// has it on now); marked devices carry both condition lists and `bindsToNode`.
#[test]
fn binding_conditions_go_on_the_devices_that_need_a_rebind() {
    use crate::binding::{Mode, OriginalDrivers};
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    node.detach(&"0001:00:03.0".parse().unwrap());
    node.attach(&"0001:00:03.0".parse().unwrap(), "vfio-pci");
    node.add_device(
        &FakeDevice::new("0002:00:04.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("vfio-pci")
            .group(9),
    );
    let inv = scan(&node);
    let homes = OriginalDrivers::default();
    // 0002:00:04.0 is on vfio-pci for a claim; it came from e1000e.
    homes.set(BTreeMap::from([(
        "0002:00:04.0".parse().unwrap(),
        Some("e1000e".to_owned()),
    )]));
    let marked: Vec<String> = homes
        .marked(&inv, Mode::Auto)
        .iter()
        .map(ToString::to_string)
        .collect();
    // 01:00.0 is on e1000e, 80:02.0 on no driver; 0001:00:03.0 is on vfio-pci
    // of its own.
    assert_eq!(marked, ["0000:01:00.0", "0000:80:02.0", "0002:00:04.0"]);
    assert_eq!(homes.marked(&inv, Mode::Always).len(), 4);
    assert!(homes.marked(&inv, Mode::Off).is_empty());
    let set = homes.marked(&inv, Mode::Auto);
    let devices = marked_devices(
        &inv,
        &BTreeMap::new(),
        None,
        Some(BindingMarks {
            driver: "d.example.com",
            devices: &set,
        }),
    );
    let card = &devices[0];
    assert_eq!(
        card.binding_conditions.as_deref(),
        Some(&["d.example.com/VfioReady".to_owned()][..])
    );
    assert_eq!(
        card.binding_failure_conditions.as_deref(),
        Some(&["d.example.com/VfioFailed".to_owned()][..])
    );
    assert_eq!(card.binds_to_node, Some(true));
    let own = devices
        .iter()
        .find(|d| d.name == "pci-0001-00-03-0")
        .unwrap();
    assert!(own.binding_conditions.is_none() && own.binds_to_node.is_none());
}
