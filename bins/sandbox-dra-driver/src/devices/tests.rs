#![allow(clippy::unwrap_used)]

use super::*;
use passthrough::config::ResourceList;
use sysfs_pci::testing::{FakeDevice, FakeNode};

const LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;

fn attr<'d>(d: &'d Device, key: &str) -> &'d DeviceAttribute {
    d.attributes.as_ref().unwrap().get(key).unwrap()
}

fn list() -> ResourceList {
    ResourceList::parse(LIST).unwrap()
}

fn scan(node: &FakeNode) -> Inventory {
    Inventory::scan(&node.host, &list()).unwrap()
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
    let devices = slice_devices(&inv, &list());
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
        serde_json::to_string(&slice_devices(&inv, &list())).unwrap()
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
    let names: Vec<String> = slice_devices(&inv, &list())
        .into_iter()
        .map(|d| d.name)
        .collect();
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
    let names: Vec<String> = slice_devices(&scan(&node), &list())
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
        let list = ResourceList::parse(json).unwrap();
        let inv = Inventory::scan(&node.host, &list).unwrap();
        slice_devices(&inv, &list)
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
    let original_drivers = OriginalDrivers::default();
    // 0002:00:04.0 is on vfio-pci for a claim; it came from e1000e.
    original_drivers.set(BTreeMap::from([(
        "0002:00:04.0".parse().unwrap(),
        Some("e1000e".to_owned()),
    )]));
    let marked: Vec<String> = original_drivers
        .marked(&inv, Mode::Auto)
        .iter()
        .map(ToString::to_string)
        .collect();
    // 01:00.0 is on e1000e, 80:02.0 on no driver; 0001:00:03.0 is on vfio-pci
    // of its own.
    assert_eq!(marked, ["0000:01:00.0", "0000:80:02.0", "0002:00:04.0"]);
    assert_eq!(original_drivers.marked(&inv, Mode::Always).len(), 4);
    assert!(original_drivers.marked(&inv, Mode::Off).is_empty());
    let set = original_drivers.marked(&inv, Mode::Auto);
    let devices = marked_devices(
        &inv,
        &list(),
        &BTreeMap::new(),
        None,
        Some(BindingMarks {
            driver: "d.example.com",
            devices: &set,
        }),
        true,
    )
    .devices;
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

/// A Rebellions CA25 PF (NUMA node 1), a CA22 VF, a device no list names, all
/// of the `rebellions` preset, and a NIC of an explicit entry.
fn rebellions_node(dir: &std::path::Path) -> FakeNode {
    let node = FakeNode::new(dir);
    node.add_device(
        &FakeDevice::new("0000:3b:00.0", 0x1eff, 0x1250, 0x12_0000)
            .group(3)
            .numa(1),
    );
    node.add_device(&FakeDevice::new("0000:5e:00.0", 0x1eff, 0x1220, 0x12_0000).group(4));
    node.add_device(
        &FakeDevice::new("0000:5e:00.1", 0x1eff, 0x1221, 0x12_0000)
            .physfn("0000:5e:00.0")
            .group(5),
    );
    node.add_device(&FakeDevice::new("0000:6f:00.0", 0x1eff, 0x00ab, 0x12_0000).group(6));
    node.add_device(&FakeDevice::new("0000:80:00.0", 0x8086, 0x10d3, 0x02_0000).group(7));
    node
}

const BOTH: &str = r#"{"preset": "rebellions", "naming": "pci-ids",
    "resources": [{"name": "example.com/NIC_PT", "vendor": "8086"}]}"#;

fn keys(d: &Device) -> Vec<&str> {
    d.attributes
        .as_ref()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect()
}

/// With `"naming": "pci-ids"` a device of the `rebellions` preset also carries
/// what Rebellions' DRA driver publishes, under its domain (so its CEL reads
/// `device.attributes["npu.rebellions.ai"].productName`), and the standard NUMA
/// attributes; a device of an explicit entry does not.
#[test]
fn pci_ids_devices_also_speak_rebellions_vocabulary() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = rebellions_node(dir.path());
    let list = ResourceList::parse(BOTH).unwrap();
    let devices = slice_devices(&Inventory::scan(&node.host, &list).unwrap(), &list);
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "pci-0000-3b-00-0",
            "pci-0000-5e-00-0",
            "pci-0000-5e-00-1",
            "pci-0000-6f-00-0",
            "pci-0000-80-00-0"
        ],
        "the devices keep our names"
    );
    let ca25 = &devices[0];
    let s = |d: &Device, k: &str| attr(d, k).string.clone().unwrap();
    assert_eq!(s(ca25, "npu.rebellions.ai/type"), "vfio");
    assert_eq!(s(ca25, "npu.rebellions.ai/pciDeviceID"), "1250");
    assert_eq!(s(ca25, "npu.rebellions.ai/productName"), "RBLN-CA25");
    assert_eq!(attr(ca25, "npu.rebellions.ai/vf").bool, Some(false));
    assert_eq!(attr(ca25, "npu.rebellions.ai/iommuGroup").int, Some(3));
    assert_eq!(attr(ca25, "resource.kubernetes.io/numaNode").int, Some(1));
    assert_eq!(attr(ca25, "dra.net/numaNode").int, Some(1));
    assert_eq!(s(ca25, PCI_BUS_ID), "0000:3b:00.0");
    assert_eq!(s(ca25, PCIE_ROOT), "pci0000:3b");
    assert_eq!(s(ca25, "resourceName"), "rebellions.ai/RBLN-CA25_PF");
    assert_eq!(
        ca25.attributes.as_ref().unwrap().len(),
        14,
        "{:?}",
        keys(ca25)
    );
    // The PF and its VF: one product; the VF says so. No NUMA node: none of
    // the three NUMA attributes.
    assert_eq!(s(&devices[1], "npu.rebellions.ai/productName"), "RBLN-CA22");
    assert_eq!(attr(&devices[1], "npu.rebellions.ai/vf").bool, Some(false));
    let vf = &devices[2];
    assert_eq!(s(vf, "npu.rebellions.ai/productName"), "RBLN-CA22");
    assert_eq!(s(vf, "npu.rebellions.ai/pciDeviceID"), "1221");
    assert_eq!(attr(vf, "npu.rebellions.ai/vf").bool, Some(true));
    assert!(
        keys(vf).iter().all(|k| !k.contains("numaNode")),
        "{:?}",
        keys(vf)
    );
    // Rebellions names only the CA22 and CA25; the resource's rule names all.
    assert_eq!(s(&devices[3], "npu.rebellions.ai/productName"), "RBLN-00ab");
    assert_eq!(s(&devices[3], "npu.rebellions.ai/pciDeviceID"), "00ab");
    let nic = &devices[4];
    assert_eq!(
        keys(nic),
        [
            "deviceID",
            "iommuGroup",
            "resource.kubernetes.io/pciBusID",
            "resource.kubernetes.io/pcieRoot",
            "resourceName",
            "vendorID"
        ],
        "an explicit entry's device is not an NPU of Rebellions"
    );
    // The API's limit: 32 attributes and capacities per device.
    assert!(devices
        .iter()
        .all(|d| d.attributes.as_ref().unwrap().len() <= 32));
}

/// The `seed` naming publishes what it did before Rebellions' vocabulary.
#[test]
fn seed_devices_carry_only_our_attributes() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = rebellions_node(dir.path());
    let list = ResourceList::parse(r#"{"preset": "rebellions"}"#).unwrap();
    let devices = slice_devices(&Inventory::scan(&node.host, &list).unwrap(), &list);
    assert_eq!(devices.len(), 4);
    assert_eq!(
        keys(&devices[0]),
        [
            "deviceID",
            "iommuGroup",
            "numaNode",
            "resource.kubernetes.io/pciBusID",
            "resource.kubernetes.io/pcieRoot",
            "resourceName",
            "vendorID"
        ]
    );
    assert_eq!(
        attr(&devices[0], "resourceName").string.as_deref(),
        Some("rebellions.ai/ATOM_CA25_PT")
    );
    for d in &devices[1..] {
        assert_eq!(keys(d).len(), 6, "{:?}", keys(d));
        assert!(keys(d).iter().all(|k| !k.starts_with("npu.rebellions.ai/")));
    }
}

/// Every attribute of Rebellions' domain that the chart's opt-in classes
/// (`draDriver.rebellionsClasses`) read is published for a
/// `pci-ids` device, with the value they compare it to.
#[test]
fn rebellions_class_names_select_what_we_publish() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../charts/vfio-sandbox/files/deviceclasses/rebellions-dra-vocabulary.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = rebellions_node(dir.path());
    let list = ResourceList::parse(BOTH).unwrap();
    let ca25 = slice_devices(&Inventory::scan(&node.host, &list).unwrap(), &list).remove(0);
    let domain = rebellions::DOMAIN;
    let read = format!("device.attributes[\"{domain}\"].");
    let mut checked = 0;
    for rest in text.split(&read).skip(1) {
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect();
        let value = attr(&ca25, &format!("{domain}/{name}"));
        if let Some(want) = rest
            .strip_prefix(&format!("{name} == \""))
            .and_then(|r| r.split('"').next())
        {
            assert_eq!(value.string.as_deref(), Some(want), "{name}");
        }
        checked += 1;
    }
    for rest in text.split(&format!(" in device.attributes[\"{domain}\"]")) {
        if let Some(name) = rest.rsplit('"').nth(1).filter(|n| !n.contains(' ')) {
            attr(&ca25, &format!("{domain}/{name}"));
            checked += 1;
        }
    }
    // The KubeVirt example's selector, in the classes' comment, counts too.
    assert!(checked >= 4, "{checked}");
    assert_eq!(
        attr(&ca25, &format!("{domain}/type")).string.as_deref(),
        Some(rebellions::TYPE_VFIO)
    );
}

/// Two selected functions of one NIC in IOMMU group 9 (no ACS between them), and
/// one more NIC alone in group 7.
fn shared_group_node(dir: &std::path::Path) -> FakeNode {
    let node = FakeNode::new(dir);
    for f in ["0000:03:00.0", "0000:03:00.1"] {
        node.add_device(
            &FakeDevice::new(f, 0x8086, 0x10d3, 0x02_0000)
                .driver("e1000e")
                .group(9),
        );
    }
    node.add_device(&FakeDevice::new("0000:80:02.0", 0x8086, 0x10d3, 0x02_0000).group(7));
    node
}

fn consumed(d: &Device) -> Vec<String> {
    d.consumes_counters
        .iter()
        .flatten()
        .map(|c| {
            let counters: Vec<String> = c
                .counters
                .iter()
                .map(|(k, v)| format!("{k}={}", v.value.0))
                .collect();
            format!("{}:{}", c.counter_set, counters.join(","))
        })
        .collect()
}

#[test]
fn a_group_of_several_functions_is_held_whole_through_one_counter_or_offered_as_one_device() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let inv = scan(&shared_group_node(dir.path()));
    let none = BTreeMap::new();

    // Counters kept: each function and the whole group draw the group's one unit.
    let offer = marked_devices(&inv, &list(), &none, None, None, true);
    let names: Vec<&str> = offer.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "pci-0000-03-00-0",
            "pci-0000-03-00-1",
            "group-0000-03-00-0",
            "pci-0000-80-02-0"
        ]
    );
    for d in &offer.devices[..3] {
        assert_eq!(consumed(d), ["iommu-group-9:held=1"], "{}", d.name);
    }
    assert!(
        offer.devices[3].consumes_counters.is_none(),
        "a group of one"
    );
    assert_eq!(offer.counter_sets.len(), 1);
    assert_eq!(offer.counter_sets[0].name, "iommu-group-9");
    assert_eq!(offer.counter_sets[0].counters["held"].value.0, "1");
    let whole = &offer.devices[2];
    assert_eq!(
        attr(whole, PCI_BUS_ID).string.as_deref(),
        Some("0000:03:00.0")
    );
    assert_eq!(
        attr(whole, "functions").string.as_deref(),
        Some("0000:03:00.0,0000:03:00.1")
    );
    assert_eq!(attr(whole, "functionCount").int, Some(2));
    assert_eq!(attr(whole, "iommuGroup").int, Some(9));
    assert_eq!(
        attr(whole, "resourceName").string.as_deref(),
        Some("example.com/NIC_PT")
    );

    // No counters: the group is one device, and nothing else of it is offered.
    let offer = marked_devices(&inv, &list(), &none, None, None, false);
    let names: Vec<&str> = offer.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["group-0000-03-00-0", "pci-0000-80-02-0"]);
    assert!(offer.counter_sets.is_empty());
    assert!(offer.devices.iter().all(|d| d.consumes_counters.is_none()));
    assert_eq!(
        offer,
        marked_devices(&inv, &list(), &none, None, None, false)
    );
}

#[test]
fn a_group_device_is_marked_when_any_of_its_functions_is() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let inv = scan(&shared_group_node(dir.path()));
    let sick: PciAddress = "0000:03:00.1".parse().unwrap();
    let unhealthy = BTreeMap::from([(sick, reason::GONE)]);
    let taint = |d: &Device| {
        d.taints
            .iter()
            .flatten()
            .map(|t| t.value.clone().unwrap_or_default())
            .collect::<Vec<_>>()
    };
    for counters in [true, false] {
        let offer = marked_devices(
            &inv,
            &list(),
            &unhealthy,
            Some("d.example.com"),
            None,
            counters,
        );
        let whole = offer
            .devices
            .iter()
            .find(|d| d.name == "group-0000-03-00-0")
            .unwrap();
        assert_eq!(taint(whole), ["Gone"], "counters {counters}");
        if counters {
            let fns: Vec<Vec<String>> = offer.devices[..2].iter().map(taint).collect();
            assert_eq!(fns, [vec![], vec!["Gone".to_owned()]]);
        }
    }
    // Taints dropped: the sick function and the group are left out; the healthy
    // function is still offered, and still draws on the group's counter.
    let offer = marked_devices(&inv, &list(), &unhealthy, None, None, true);
    let names: Vec<&str> = offer.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["pci-0000-03-00-0", "pci-0000-80-02-0"]);
    assert_eq!(consumed(&offer.devices[0]), ["iommu-group-9:held=1"]);
    assert_eq!(offer.counter_sets.len(), 1);
    // Binding conditions: the group device carries them when a function does.
    let set = std::collections::BTreeSet::from([sick]);
    let offer = marked_devices(
        &inv,
        &list(),
        &BTreeMap::new(),
        None,
        Some(BindingMarks {
            driver: "d.example.com",
            devices: &set,
        }),
        false,
    );
    assert_eq!(offer.devices[0].name, "group-0000-03-00-0");
    assert_eq!(offer.devices[0].binds_to_node, Some(true));
    assert!(offer.devices[1].binds_to_node.is_none());
}
