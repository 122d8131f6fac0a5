//! Tests of the device table: who joins, who turns Unhealthy and why, and that a
//! partial read of what changed leaves it where a full rescan would.

use super::*;
use sysfs_pci::testing::{FakeDevice, FakeNode};

const LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;

fn setup() -> (tempfile::TempDir, FakeNode, ResourceList) {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = FakeNode::new(dir.path());
    node.add_driver("vfio-pci");
    node.add_driver("e1000e");
    node.add_device(
        &FakeDevice::new("0000:01:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("vfio-pci")
            .group(4)
            .numa(1),
    );
    node.add_device(
        &FakeDevice::new("0000:02:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("e1000e")
            .group(5),
    );
    (dir, node, ResourceList::parse(LIST).unwrap())
}

fn health(s: &Snapshot) -> Vec<(String, Option<String>)> {
    s.values()
        .flatten()
        .map(|d| (d.id(), d.problem.clone()))
        .collect()
}

#[test]
fn only_bound_devices_join_and_then_stay_listed() {
    let (_d, node, list) = setup();
    let mut t = Tracker::default();
    let s = t.rescan(&node.host, &list).unwrap();
    assert_eq!(health(&s), [("0000:01:00.0".into(), None)]);
    assert_eq!(s.values().next().unwrap()[0].numa_node, Some(1));
    // Unbound by hand: listed, Unhealthy, with the reason.
    node.attach(&"0000:01:00.0".parse().unwrap(), "e1000e");
    let s = t.rescan(&node.host, &list).unwrap();
    assert_eq!(
        health(&s),
        [(
            "0000:01:00.0".into(),
            Some("on e1000e instead of vfio-pci".into())
        )]
    );
    // Bound again: Healthy; a new device bound later appears.
    node.attach(&"0000:01:00.0".parse().unwrap(), "vfio-pci");
    node.attach(&"0000:02:00.0".parse().unwrap(), "vfio-pci");
    let s = t.rescan(&node.host, &list).unwrap();
    assert_eq!(
        health(&s),
        [("0000:01:00.0".into(), None), ("0000:02:00.0".into(), None)]
    );
}

#[test]
fn removed_device_and_lost_group_node_turn_unhealthy() {
    let (_d, node, list) = setup();
    let mut t = Tracker::default();
    t.rescan(&node.host, &list).unwrap();
    std::fs::remove_file(node.host.vfio_group_node(4)).unwrap();
    let s = t.rescan(&node.host, &list).unwrap();
    assert!(health(&s)[0]
        .1
        .as_deref()
        .unwrap()
        .ends_with("dev/vfio/4 is missing"));
    node.remove_device(&"0000:01:00.0".parse().unwrap());
    let s = t.rescan(&node.host, &list).unwrap();
    assert_eq!(
        health(&s),
        [("0000:01:00.0".into(), Some("device removed".into()))]
    );
}

#[test]
fn a_companion_on_a_host_driver_makes_the_group_unhealthy() {
    let (_d, node, list) = setup();
    node.add_device(
        &FakeDevice::new("0000:01:00.1", 0x8086, 0x1234, 0x04_0300)
            .driver("snd_hda_intel")
            .group(4),
    );
    let s = Tracker::default().rescan(&node.host, &list).unwrap();
    assert_eq!(
        health(&s)[0].1.as_deref(),
        Some("IOMMU group 4 is not viable: 0000:01:00.1 is on snd_hda_intel")
    );
}

#[test]
fn a_malformed_device_is_skipped_logged_once_and_the_rest_advertised() {
    let (_d, node, list) = setup();
    node.attach(&"0000:02:00.0".parse().unwrap(), "vfio-pci");
    let bad = node.canonical_dir(&"0000:02:00.0".parse().unwrap());
    std::fs::write(bad.join("numa_node"), "abc\n").unwrap();
    let mut t = Tracker::default();
    let inv = Inventory::scan(&node.host, &list).unwrap();
    assert_eq!(
        t.note_skipped(&inv.skipped, |_| true).len(),
        1,
        "first sight is logged"
    );
    assert!(
        t.note_skipped(&inv.skipped, |_| true).is_empty(),
        "not on every resync"
    );
    let s = t.rescan(&node.host, &list).unwrap();
    assert_eq!(health(&s), [("0000:01:00.0".into(), None)]);
    // Readable again: advertised, and forgotten by the log.
    std::fs::write(bad.join("numa_node"), "0\n").unwrap();
    let s = t.rescan(&node.host, &list).unwrap();
    assert_eq!(
        health(&s),
        [("0000:01:00.0".into(), None), ("0000:02:00.0".into(), None)]
    );
    assert!(t.skip_log.is_empty());
}

#[test]
fn an_advertised_device_whose_group_gains_an_unreadable_member_turns_unhealthy() {
    let (_d, node, list) = setup();
    let mut t = Tracker::default();
    t.rescan(&node.host, &list).unwrap();
    node.add_device(
        &FakeDevice::new("0000:01:00.1", 0x8086, 0x1234, 0x04_0300)
            .driver("vfio-pci")
            .group(4),
    );
    let bad = node.canonical_dir(&"0000:01:00.1".parse().unwrap());
    // An attribute the health read needs (the override, say, it does not read).
    std::fs::write(bad.join("class"), b"\xff\n").unwrap();
    let s = t.rescan(&node.host, &list).unwrap();
    assert_eq!(
        health(&s),
        [(
            "0000:01:00.0".into(),
            Some(
                "0000:01:00.0: IOMMU group 4 has a member that could not be read \
                 (0000:01:00.1); the group is left alone"
                    .into()
            )
        )]
    );
}

fn addrs(list: &[&str]) -> BTreeSet<PciAddress> {
    list.iter().map(|a| a.parse().unwrap()).collect()
}

/// After any change, a refresh of what the change touched gives the snapshot a
/// full rescan gives.
#[test]
fn a_refresh_of_what_changed_equals_a_full_rescan() {
    let (_d, node, list) = setup();
    node.add_device(
        &FakeDevice::new("0000:01:00.1", 0x8086, 0x1234, 0x04_0300)
            .driver("vfio-pci")
            .group(4),
    );
    let a: PciAddress = "0000:01:00.0".parse().unwrap();
    let b: PciAddress = "0000:02:00.0".parse().unwrap();
    let companion: PciAddress = "0000:01:00.1".parse().unwrap();
    let mut partial = Tracker::default();
    let mut full = Tracker::default();
    let first = partial.rescan(&node.host, &list).unwrap();
    assert_eq!(first, full.rescan(&node.host, &list).unwrap());
    type Change = Box<dyn Fn(&FakeNode)>;
    let steps: Vec<(&str, Change, BTreeSet<PciAddress>, BTreeSet<u32>)> = vec![
        (
            "device unbound",
            Box::new(move |n: &FakeNode| n.attach(&a, "e1000e")),
            addrs(&["0000:01:00.0"]),
            BTreeSet::new(),
        ),
        (
            "bound again",
            Box::new(move |n: &FakeNode| n.attach(&a, "vfio-pci")),
            BTreeSet::new(),
            [4].into(),
        ),
        (
            "companion taken by a host driver",
            Box::new(move |n: &FakeNode| n.attach(&companion, "snd_hda_intel")),
            addrs(&["0000:01:00.1"]),
            BTreeSet::new(),
        ),
        (
            "companion back",
            Box::new(move |n: &FakeNode| n.attach(&companion, "vfio-pci")),
            addrs(&["0000:01:00.1"]),
            BTreeSet::new(),
        ),
        (
            "second device bound",
            Box::new(move |n: &FakeNode| n.attach(&b, "vfio-pci")),
            BTreeSet::new(),
            [5].into(),
        ),
        (
            "group node removed",
            Box::new(|n: &FakeNode| std::fs::remove_file(n.host.vfio_group_node(5)).unwrap()),
            BTreeSet::new(),
            [5].into(),
        ),
        (
            "device removed",
            Box::new(move |n: &FakeNode| n.remove_device(&b)),
            addrs(&["0000:02:00.0"]),
            BTreeSet::new(),
        ),
    ];
    for (what, change, addresses, groups) in steps {
        change(&node);
        let got = partial
            .refresh(&node.host, &list, &addresses, &groups)
            .unwrap();
        let want = full.rescan(&node.host, &list).unwrap();
        assert_eq!(got, want, "after: {what}");
    }
    assert_eq!(
        health(&full.rescan(&node.host, &list).unwrap()),
        [
            ("0000:01:00.0".into(), None),
            ("0000:02:00.0".into(), Some("device removed".into()))
        ]
    );
}

/// A refresh reads the touched group only: a device elsewhere that changed
/// without an event keeps its last state until it is named or resynced.
#[test]
fn a_refresh_reads_only_what_it_is_told() {
    let (_d, node, list) = setup();
    let b: PciAddress = "0000:02:00.0".parse().unwrap();
    node.attach(&b, "vfio-pci");
    let mut t = Tracker::default();
    t.rescan(&node.host, &list).unwrap();
    node.attach(&b, "e1000e");
    let s = t
        .refresh(
            &node.host,
            &list,
            &addrs(&["0000:01:00.0"]),
            &BTreeSet::new(),
        )
        .unwrap();
    assert_eq!(
        health(&s),
        [("0000:01:00.0".into(), None), ("0000:02:00.0".into(), None)]
    );
    let s = t
        .refresh(&node.host, &list, &BTreeSet::new(), &[5].into())
        .unwrap();
    assert_eq!(
        health(&s)[1],
        (
            "0000:02:00.0".into(),
            Some("on e1000e instead of vfio-pci".into())
        )
    );
}

/// Three bound devices in three groups, read once.
fn three_bound() -> (tempfile::TempDir, FakeNode, ResourceList, Tracker) {
    let (d, node, list) = setup();
    node.attach(&"0000:02:00.0".parse().unwrap(), "vfio-pci");
    node.add_device(
        &FakeDevice::new("0000:03:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("vfio-pci")
            .group(6),
    );
    let mut t = Tracker::default();
    t.rescan(&node.host, &list).unwrap();
    (d, node, list, t)
}

/// A change to one device updates exactly that device: it is the one change
/// reported, and every other device's state is the one it had.
#[test]
fn a_change_to_one_device_updates_exactly_that_device() {
    let (_d, node, list, mut t) = three_bound();
    let before = t.snapshot();
    let b: PciAddress = "0000:02:00.0".parse().unwrap();
    node.attach(&b, "e1000e");
    let changed = t
        .refresh_changes(&node.host, &list, &addrs(&["0000:02:00.0"]), &[5].into())
        .unwrap();
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert_eq!(changed[0].after.address, b);
    assert_eq!(changed[0].before.as_ref().map(|d| &d.problem), Some(&None));
    assert_eq!(
        changed[0].after.problem.as_deref(),
        Some("on e1000e instead of vfio-pci")
    );
    let after = t.snapshot();
    let (old, new) = (
        before.values().next().unwrap(),
        after.values().next().unwrap(),
    );
    assert_eq!(old.len(), new.len());
    for (o, n) in old.iter().zip(new) {
        assert_eq!(o == n, o.address != b, "{o:?} -> {n:?}");
    }
    // Read again with nothing new: no change reported.
    let again = t
        .refresh_changes(&node.host, &list, &addrs(&["0000:02:00.0"]), &[5].into())
        .unwrap();
    assert!(again.is_empty(), "{again:?}");
}

/// A change no event named (the event was lost) is not picked up by a partial
/// read of something else, and is by the full read lost events ask for.
#[test]
fn a_change_no_event_named_is_found_by_the_full_read() {
    let (_d, node, list, mut t) = three_bound();
    let c: PciAddress = "0000:03:00.0".parse().unwrap();
    std::fs::remove_file(node.host.vfio_group_node(6)).unwrap();
    node.attach(&c, "e1000e");
    let other = t
        .refresh_changes(&node.host, &list, &addrs(&["0000:01:00.0"]), &[4].into())
        .unwrap();
    assert!(other.is_empty(), "{other:?}");
    let full = t.rescan_changes(&node.host, &list).unwrap();
    assert_eq!(full.len(), 1, "{full:?}");
    assert_eq!(full[0].after.address, c);
    assert!(!full[0].after.healthy());
    assert!(t.rescan_changes(&node.host, &list).unwrap().is_empty());
}

mod changes {
    use super::*;
    use proptest::prelude::*;

    const DEVICES: [&str; 4] = [
        "0000:01:00.0",
        "0000:01:00.1",
        "0000:02:00.0",
        "0000:03:00.0",
    ];
    const GROUPS: [u32; 4] = [4, 4, 5, 6];

    /// One change to the node, as the kernel would make it.
    #[derive(Debug, Clone)]
    enum Change {
        Attach(usize, &'static str),
        Detach(usize),
        DropNode(usize),
        Remove(usize),
    }

    fn change() -> impl Strategy<Value = Change> {
        let driver = prop::sample::select(vec!["vfio-pci", "e1000e", "snd_hda_intel"]);
        prop_oneof![
            4 => (0..DEVICES.len(), driver).prop_map(|(d, drv)| Change::Attach(d, drv)),
            1 => (0..DEVICES.len()).prop_map(Change::Detach),
            1 => (0..DEVICES.len()).prop_map(Change::DropNode),
            1 => (0..DEVICES.len()).prop_map(Change::Remove),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        /// Whatever happens to the node, reading again what the events name (the
        /// device for a uevent, the group for a /dev/vfio event) leaves the
        /// tracker where a full rescan would.
        #[test]
        fn refreshing_what_the_events_name_equals_a_rescan(
            steps in prop::collection::vec(change(), 1..12),
        ) {
            refresh_equals_rescan(steps)?;
        }
    }

    /// The ID is the address as its `Display` writes it, whatever the address.
    #[test]
    fn the_id_is_the_canonical_address() {
        for (domain, bus, slot, function) in [
            (0, 0, 0, 0),
            (0, 0x3b, 0x1f, 7),
            (0xabcd, 0xff, 0x0a, 3),
            (0xffff, 0x10, 0x01, 1),
            (0x1_0000, 0x01, 0x02, 0),
        ] {
            let address = PciAddress::new(domain, bus, slot, function).unwrap();
            let d = DeviceState {
                address,
                group: None,
                numa_node: None,
                bridge: None,
                cdev: None,
                no_cdev_kernel: false,
                problem: None,
            };
            assert_eq!(d.id(), address.to_string());
        }
    }

    /// Applies `steps` to a fake node and, after each, compares a refresh of what it
    /// names with a full rescan.
    fn refresh_equals_rescan(steps: Vec<Change>) -> Result<(), TestCaseError> {
        let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
        let node = FakeNode::new(dir.path());
        for drv in ["vfio-pci", "e1000e", "snd_hda_intel"] {
            node.add_driver(drv);
        }
        for (i, a) in DEVICES.iter().enumerate() {
            let id = if i == 1 { 0x1234 } else { 0x10d3 };
            let device = FakeDevice::new(a, 0x8086, id, 0x02_0000).driver("vfio-pci");
            node.add_device(&device.group(GROUPS[i]));
        }
        let list = ResourceList::parse(LIST).unwrap();
        let (mut partial, mut full) = (Tracker::default(), Tracker::default());
        partial.rescan(&node.host, &list).unwrap();
        full.rescan(&node.host, &list).unwrap();
        let mut gone = BTreeSet::new();
        for step in steps {
            let index = match step {
                Change::Attach(i, _)
                | Change::Detach(i)
                | Change::DropNode(i)
                | Change::Remove(i) => i,
            };
            if gone.contains(&index) {
                continue;
            }
            let address: PciAddress = DEVICES[index].parse().unwrap();
            let group = GROUPS[index];
            let (mut addresses, groups) = (BTreeSet::new(), BTreeSet::from([group]));
            match step {
                Change::Attach(_, drv) => node.attach(&address, drv),
                Change::Detach(_) => node.detach(&address),
                Change::DropNode(_) => {
                    let _ = std::fs::remove_file(node.host.vfio_group_node(group));
                }
                Change::Remove(_) => {
                    node.remove_device(&address);
                    gone.insert(index);
                }
            }
            if !matches!(step, Change::DropNode(_)) {
                addresses.insert(address);
            }
            let got = partial
                .refresh(&node.host, &list, &addresses, &groups)
                .unwrap();
            let want = full.rescan(&node.host, &list).unwrap();
            prop_assert_eq!(got, want, "after {:?}", step);
        }
        Ok(())
    }
}
