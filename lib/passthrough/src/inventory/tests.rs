use super::*;
use std::os::unix::fs::symlink;
use std::path::Path;
use sysfs_pci::testing::{FakeDevice, FakeNode};

const LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;

/// Good selected A (group 4); selected B alone in group 5; selected C with a
/// companion D (an audio function of another vendor) in group 6.
fn node(dir: &Path) -> FakeNode {
    let node = FakeNode::new(dir);
    for (bdf, device, class, group) in [
        ("0000:01:00.0", 0x10d3, 0x02_0000, 4),
        ("0000:02:00.0", 0x10d3, 0x02_0000, 5),
        ("0000:03:00.0", 0x10d3, 0x02_0000, 6),
    ] {
        node.add_device(&FakeDevice::new(bdf, 0x8086, device, class).group(group));
    }
    node.add_device(
        &FakeDevice::new("0000:03:00.1", 0x10ec, 0x0887, 0x04_0300)
            .driver("snd_hda_intel")
            .group(6),
    );
    node
}

/// One kind of garbage: what to do to the device directory, and the words the
/// error must contain.
type Garbage = (&'static str, fn(&Path), &'static str);

fn write(name: &'static str, contents: &'static [u8]) -> impl Fn(&Path) {
    move |dir: &Path| std::fs::write(dir.join(name), contents).unwrap()
}

fn garbage() -> Vec<Garbage> {
    vec![
        ("device", |d| write("device", b"garbage\n")(d), "device"),
        ("class", |d| write("class", b"0xzz\n")(d), "class"),
        (
            "subsystem_vendor",
            |d| write("subsystem_vendor", b"nope\n")(d),
            "subsystem_vendor",
        ),
        (
            "numa_node abc",
            |d| write("numa_node", b"abc\n")(d),
            "numa_node",
        ),
        (
            "numa_node -2",
            |d| write("numa_node", b"-2\n")(d),
            "\"-2\" in",
        ),
        (
            "sriov_numvfs",
            |d| write("sriov_numvfs", b"many\n")(d),
            "sriov_numvfs",
        ),
        (
            "iommu_group not a number",
            |d| {
                std::fs::remove_file(d.join("iommu_group")).unwrap();
                symlink("../../../kernel/iommu_groups/abc", d.join("iommu_group")).unwrap();
            },
            "iommu_group",
        ),
        (
            "iommu_group looping",
            |d| {
                std::fs::remove_file(d.join("iommu_group")).unwrap();
                symlink("iommu_group", d.join("iommu_group")).unwrap();
            },
            "iommu_group",
        ),
        (
            "driver_override not UTF-8",
            |d| write("driver_override", b"vfio\xff\xfe\n")(d),
            "driver_override",
        ),
        (
            "class is a directory",
            |d| {
                std::fs::remove_file(d.join("class")).unwrap();
                std::fs::create_dir(d.join("class")).unwrap();
            },
            "class",
        ),
        (
            "vendor is a directory",
            |d| {
                std::fs::remove_file(d.join("vendor")).unwrap();
                std::fs::create_dir(d.join("vendor")).unwrap();
            },
            "vendor",
        ),
    ]
}

fn addresses<'a>(it: impl Iterator<Item = &'a PciAddress>) -> Vec<String> {
    it.map(ToString::to_string).collect()
}

#[test]
fn a_malformed_selected_device_is_skipped_and_the_rest_scanned() {
    let list = ResourceList::parse(LIST).unwrap();
    for (what, spoil, words) in garbage() {
        let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
        let node = node(dir.path());
        let b: PciAddress = "0000:02:00.0".parse().unwrap();
        spoil(&node.canonical_dir(&b));
        let inv = Inventory::scan(&node.host, &list).unwrap();
        assert_eq!(
            addresses(inv.entries.iter().map(|e| &e.device.address)),
            ["0000:01:00.0", "0000:03:00.0", "0000:03:00.1"],
            "{what}"
        );
        assert_eq!(
            inv.groups.keys().copied().collect::<Vec<_>>(),
            [4, 6],
            "{what}"
        );
        assert_eq!(inv.skipped.len(), 1, "{what}: {:?}", inv.skipped);
        let s = &inv.skipped[0];
        assert_eq!(s.address, b, "{what}");
        let SkipReason::Unreadable { error } = &s.reason else {
            panic!("{what}: {s:?}");
        };
        let file = format!("0000:02:00.0/{}", words.split(' ').next().unwrap_or(words));
        assert!(
            error.contains(words) && (error.contains(&file) || words.starts_with('"')),
            "{what}: {error}"
        );
        assert!(inv.skipped(&b).is_some());
    }
}

#[test]
fn a_malformed_companion_holds_back_its_whole_group_only() {
    let list = ResourceList::parse(LIST).unwrap();
    for (what, spoil, words) in garbage() {
        let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
        let node = node(dir.path());
        let d: PciAddress = "0000:03:00.1".parse().unwrap();
        spoil(&node.canonical_dir(&d));
        let inv = Inventory::scan(&node.host, &list).unwrap();
        assert_eq!(
            addresses(inv.entries.iter().map(|e| &e.device.address)),
            ["0000:01:00.0", "0000:02:00.0"],
            "{what}: the group with an unknown member is not in the inventory"
        );
        assert_eq!(
            inv.groups.keys().copied().collect::<Vec<_>>(),
            [4, 5],
            "{what}"
        );
        assert_eq!(inv.in_group(6).count(), 0, "{what}");
        assert_eq!(
            addresses(inv.skipped.iter().map(|s| &s.address)),
            ["0000:03:00.0", "0000:03:00.1"],
            "{what}"
        );
        let held = &inv.skipped[0];
        assert_eq!(
            held.reason,
            SkipReason::GroupMemberUnreadable { member: d },
            "{what}"
        );
        assert_eq!(held.group, Some(6));
        assert_eq!(
            held.resource.as_ref().map(|r| r.as_str()),
            Some("example.com/NIC_PT")
        );
        assert_eq!(
            held.to_string(),
            "0000:03:00.0: IOMMU group 6 has a member that could not be read (0000:03:00.1); \
             the group is left alone"
        );
        let SkipReason::Unreadable { error } = &inv.skipped[1].reason else {
            panic!("{what}: {:?}", inv.skipped[1]);
        };
        assert!(error.contains(words), "{what}: {error}");
    }
}

#[test]
fn an_unlistable_group_holds_back_its_devices() {
    let list = ResourceList::parse(LIST).unwrap();
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    let members = node.host.iommu_group_devices_dir(6);
    std::fs::remove_dir_all(&members).unwrap();
    std::fs::write(&members, "").unwrap();
    let inv = Inventory::scan(&node.host, &list).unwrap();
    assert_eq!(inv.groups.keys().copied().collect::<Vec<_>>(), [4, 5]);
    assert_eq!(
        addresses(inv.skipped.iter().map(|s| &s.address)),
        ["0000:03:00.0"]
    );
    assert!(
        inv.skipped[0]
            .to_string()
            .contains("IOMMU group 6: failed to list"),
        "{}",
        inv.skipped[0]
    );
}

#[test]
fn addresses_select_one_of_two_devices_of_a_model() {
    let list = ResourceList::parse(
        r#"{"resources":[{"name":"example.com/NPU_PT","vendor":"1eff","devices":["1220"],
            "addresses":["3b:00.0"]}]}"#,
    )
    .unwrap();
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = FakeNode::new(dir.path());
    node.add_device(
        &FakeDevice::new("0000:3b:00.0", 0x1eff, 0x1220, 0x12_0000)
            .driver("rebellions")
            .group(10),
    );
    node.add_device(
        &FakeDevice::new("0000:5e:00.0", 0x1eff, 0x1220, 0x12_0000)
            .driver("rebellions")
            .group(11),
    );
    let inv = Inventory::scan(&node.host, &list).unwrap();
    assert_eq!(
        addresses(inv.entries.iter().map(|e| &e.device.address)),
        ["0000:3b:00.0"]
    );
    let Role::Selected { resource } = &inv.entries[0].role else {
        panic!("{:?}", inv.entries[0].role);
    };
    assert_eq!(resource.as_str(), "example.com/NPU_PT");
    assert_eq!(inv.groups.keys().copied().collect::<Vec<_>>(), [10]);
    assert!(inv.skipped.is_empty(), "{:?}", inv.skipped);
    assert_eq!(
        inv.in_group(11).count(),
        0,
        "the unlisted one is left alone"
    );
}

#[test]
fn a_malformed_device_of_an_unselected_vendor_is_not_read() {
    let list = ResourceList::parse(LIST).unwrap();
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    node.add_device(&FakeDevice::new("0000:09:00.0", 0x1b21, 0x1242, 0x0c_0330));
    let other = node.canonical_dir(&"0000:09:00.0".parse().unwrap());
    std::fs::write(other.join("numa_node"), "abc").unwrap();
    let inv = Inventory::scan(&node.host, &list).unwrap();
    assert!(inv.skipped.is_empty(), "{:?}", inv.skipped);
    assert_eq!(inv.groups.len(), 3);
}
