//! What a resource list selects and names: the presets, explicit entries and
//! address lists.

use super::*;

#[test]
fn rebellions_table() {
    let list = ResourceList::builtin_default();
    for (device, name) in [
        (0x1120, "rebellions.ai/ATOM_CA12_PT"),
        (0x1220, "rebellions.ai/ATOM_CA22_PT"),
        (0x1250, "rebellions.ai/ATOM_CA25_PT"),
        (0x2030, "rebellions.ai/REBEL_CR03_PT"),
        (0x1121, "rebellions.ai/ATOM_CA12_VF_PT"),
        (0x1221, "rebellions.ai/ATOM_CA22_VF_PT"),
        (0x1251, "rebellions.ai/ATOM_CA25_VF_PT"),
        (0x2031, "rebellions.ai/REBEL_CR03_VF_PT"),
        (0x1020, "rebellions.ai/RBLN_1020_PT"),
        (0x1211, "rebellions.ai/RBLN_1211_PT"),
        (0x00ab, "rebellions.ai/RBLN_00ab_PT"),
    ] {
        let selection = list
            .select(&somewhere(), &ids(0x1eff, device, 0x120000))
            .unwrap();
        assert_eq!(selection.resource.as_str(), name);
        assert_eq!(selection.driver, "vfio-pci");
    }
    // Any 12xxxx class matches; other classes and vendors do not.
    assert!(list
        .select(&somewhere(), &ids(0x1eff, 0x1220, 0x128001))
        .is_some());
    assert_eq!(
        list.select(&somewhere(), &ids(0x1eff, 0x1220, 0x0b4000)),
        None
    );
    assert_eq!(
        list.select(&somewhere(), &ids(0x10de, 0x1220, 0x120000)),
        None
    );
    assert_eq!(list.vendors(), [0x1eff]);
    assert_eq!(list.drivers(), ["vfio-pci"]);
}

#[test]
fn default_is_the_rebellions_preset() {
    let parsed = ResourceList::parse(r#"{"preset": "rebellions"}"#).unwrap();
    let default = ResourceList::builtin_default();
    assert_eq!(parsed.describe(), default.describe());
    assert_eq!(ResourceList::default().describe(), default.describe());
    assert_eq!(default.describe().len(), 1);
    let line = &default.describe()[0];
    assert!(
        line.starts_with(
            "preset rebellions: vendor 1eff, any device, class 12xxxx, driver vfio-pci -> "
        ),
        "{line}"
    );
    assert!(line.contains("1220 rebellions.ai/ATOM_CA22_PT"), "{line}");
}

#[test]
fn nvidia_names_from_the_pci_database() {
    // What the bundled database says, so a database update shows up here first.
    let db = |device| pci_ids::Device::from_vid_pid(0x10de, device).map(|d| d.name());
    assert_eq!(db(0x2330), Some("GH100 [H100 SXM5 80GB]"));
    assert_eq!(db(0x20b0), Some("GA100 [A100 SXM4 40GB]"));
    assert_eq!(db(0x2342), Some("GH100 [GH200 120GB / 480GB]"));
    assert_eq!(db(0x22a3), Some("GH100 [H100 NVSwitch]"));

    let list = ResourceList::parse(r#"{"preset": ["nvidia", "nvidia-nvswitch"]}"#).unwrap();
    assert_eq!(
        resource(&list, ids(0x10de, 0x2330, 0x030200)).as_deref(),
        Some("nvidia.com/GH100_H100_SXM5_80GB")
    );
    assert_eq!(
        resource(&list, ids(0x10de, 0x20b0, 0x030200)).as_deref(),
        Some("nvidia.com/GA100_A100_SXM4_40GB")
    );
    assert_eq!(
        resource(&list, ids(0x10de, 0x2342, 0x030000)).as_deref(),
        Some("nvidia.com/GH100_GH200_120GB___480GB")
    );
    assert_eq!(
        resource(&list, ids(0x10de, 0x22a3, 0x068000)).as_deref(),
        Some("nvidia.com/GH100_H100_NVSWITCH")
    );
    // Audio functions, bridges and other vendors are not selected.
    assert_eq!(resource(&list, ids(0x10de, 0x22a3, 0x040300)), None);
    assert_eq!(resource(&list, ids(0x10de, 0x2330, 0x060400)), None);
    assert_eq!(resource(&list, ids(0x1002, 0x2330, 0x030000)), None);
}

#[test]
fn nvidia_fallback_names() {
    let list = ResourceList::parse(r#"{"preset": "nvidia"}"#).unwrap();
    // Not in the database.
    assert!(pci_ids::Device::from_vid_pid(0x10de, 0x2bad).is_none());
    assert_eq!(
        resource(&list, ids(0x10de, 0x2bad, 0x030200)).as_deref(),
        Some("nvidia.com/2bad")
    );
    // In the database, but the derived name is longer than 63 characters.
    let long = pci_ids::Device::from_vid_pid(0x10de, 0x05be)
        .unwrap()
        .name();
    assert!(preset::kubevirt_device_name(long).len() > 63, "{long}");
    assert_eq!(
        resource(&list, ids(0x10de, 0x05be, 0x030000)).as_deref(),
        Some("nvidia.com/05be")
    );
    // The nvswitch preset alone does not take GPUs.
    let list = ResourceList::parse(r#"{"preset": "nvidia-nvswitch"}"#).unwrap();
    assert_eq!(resource(&list, ids(0x10de, 0x2330, 0x030200)), None);
}

#[test]
fn explicit_entries() {
    let list = ResourceList::parse(
        r#"{"preset": "rebellions", "resources": [
            {"name": "example.com/NIC_PT", "vendor": "8086", "devices": ["10d3"], "classes": ["0200"]},
            {"name": "example.com/ANY_CLASS", "vendor": "8086", "devices": ["1572"]},
            {"name": "example.com/ANY_DEVICE", "vendor": "15b3", "classes": ["0207"]},
            {"name": "example.com/ALL", "vendor": "1af4"},
            {"name": "nvidia.com/GRACE_GPU", "vendor": "10de", "devices": ["2342"], "driver": "nvgrace_gpu_vfio_pci"}
        ]}"#,
    )
    .unwrap();
    assert_eq!(
        resource(&list, ids(0x8086, 0x10d3, 0x020000)).as_deref(),
        Some("example.com/NIC_PT")
    );
    assert_eq!(resource(&list, ids(0x8086, 0x10d3, 0x028000)), None);
    assert_eq!(resource(&list, ids(0x8086, 0x10d4, 0x020000)), None);
    assert_eq!(
        resource(&list, ids(0x8086, 0x1572, 0xff0000)).as_deref(),
        Some("example.com/ANY_CLASS")
    );
    assert_eq!(
        resource(&list, ids(0x15b3, 0x1021, 0x020700)).as_deref(),
        Some("example.com/ANY_DEVICE")
    );
    assert_eq!(resource(&list, ids(0x15b3, 0x1021, 0x020000)), None);
    assert_eq!(
        resource(&list, ids(0x1af4, 0x1041, 0x010000)).as_deref(),
        Some("example.com/ALL")
    );
    assert_eq!(
        resource(&list, ids(0x1eff, 0x1220, 0x120000)).as_deref(),
        Some("rebellions.ai/ATOM_CA22_PT")
    );

    let grace = list
        .select(&somewhere(), &ids(0x10de, 0x2342, 0x030200))
        .unwrap();
    assert_eq!(grace.resource.as_str(), "nvidia.com/GRACE_GPU");
    assert_eq!(grace.driver, "nvgrace_gpu_vfio_pci");

    assert_eq!(list.vendors(), [0x10de, 0x15b3, 0x1af4, 0x1eff, 0x8086]);
    assert_eq!(list.drivers(), ["vfio-pci", "nvgrace_gpu_vfio_pci"]);
    assert_eq!(
        list.describe()[1..],
        [
            "example.com/NIC_PT: vendor 8086, device 10d3, class 0200xx, driver vfio-pci",
            "example.com/ANY_CLASS: vendor 8086, device 1572, any class, driver vfio-pci",
            "example.com/ANY_DEVICE: vendor 15b3, any device, class 0207xx, driver vfio-pci",
            "example.com/ALL: vendor 1af4, any device, any class, driver vfio-pci",
            "nvidia.com/GRACE_GPU: vendor 10de, device 2342, any class, driver \
                nvgrace_gpu_vfio_pci",
        ]
    );
}

#[test]
fn class_codes_wider_than_24_bits_are_masked() {
    let list = ResourceList::builtin_default();
    assert!(list
        .select(&somewhere(), &ids(0x1eff, 0x1220, 0x0112_0000))
        .is_some());
    assert_eq!(
        ids(0x1eff, 0x1220, 0x0112_0000).to_string(),
        "1eff:1220 class 120000"
    );
}

#[test]
fn describe_lists_classes_and_devices() {
    let list = ResourceList::parse(
        r#"{"preset": "nvidia", "resources": [{"name": "example.com/A", "vendor": "8086", "devices": ["1", "2"], "classes": ["02", "0c0330"]}]}"#,
    )
    .unwrap();
    assert_eq!(
        list.describe(),
        [
            "preset nvidia: vendor 10de, any device, classes 0300xx 0302xx, driver \
                vfio-pci -> nvidia.com/<PCI ID database name>, else nvidia.com/<device>",
            "example.com/A: vendor 8086, devices 0001 0002, classes 02xxxx 0c0330, driver vfio-pci",
        ]
    );
}

// ---- files ----

/// One entry selecting 1eff:1220 at the given `addresses` JSON value.
fn npu_at(addresses: &str) -> String {
    format!(
        r#"{{"name": "example.com/NPU_PT", "vendor": "1eff", "devices": ["1220"], "addresses": {addresses}}}"#
    )
}

#[test]
fn addresses_parse_errors_name_the_entry() {
    let entry = "resource list: resources[0] (example.com/NPU_PT)";
    assert_eq!(
        entry_err(&npu_at("[]")),
        format!("{entry}: addresses: the list is empty (leave the key out to match any address)")
    );
    assert_eq!(
        entry_err(&npu_at(r#""3b:00.0""#)),
        format!(
            "{entry}: addresses: expected a list of PCI addresses, found a string \
                (leave the key out to match any address)"
        )
    );
    assert_eq!(
        entry_err(&npu_at(r#"["3b:00.0", 7]"#)),
        format!(
            "{entry}: addresses[1]: expected a PCI address such \
                as \"0000:3b:00.0\", found a number"
        )
    );
    let msg = entry_err(&npu_at(r#"["3b:00.0", "3b:00"]"#));
    assert!(
        msg.starts_with(&format!(
            "{entry}: addresses[1]: \"3b:00\" is not a PCI address"
        )),
        "{msg}"
    );
    for bad in [
        "3b:20.0",
        "3b:00.8",
        "0000:3b:00",
        "zz:00.0",
        "",
        "0000:0000:3b:00.0",
    ] {
        let msg = entry_err(&npu_at(&format!(r#"["{bad}"]"#)));
        assert!(
            msg.starts_with(&format!(
                "{entry}: addresses[0]: {bad:?} is not a PCI address"
            )),
            "{msg}"
        );
    }
    assert_eq!(
        entry_err(&npu_at("[null]")),
        format!(
            "{entry}: addresses[0]: expected a PCI address such as \"0000:3b:00.0\", found null"
        )
    );
    assert_eq!(
        entry_err(&npu_at("null")),
        format!(
            "{entry}: addresses: expected a list of PCI addresses, found null \
                (leave the key out to match any address)"
        )
    );
}

#[test]
fn addresses_listed_twice_in_either_form() {
    let msg = entry_err(&npu_at(r#"["0000:3b:00.0", "5e:00.0", "3B:00.0"]"#));
    assert_eq!(
        msg,
        "resource list: resources[0] (example.com/NPU_PT): addresses[2]: 0000:3b:00.0 \
            is listed twice"
    );
    // Another domain is another address.
    ResourceList::parse(&format!(
        r#"{{"resources": [{}]}}"#,
        npu_at(r#"["0000:3b:00.0", "0001:3b:00.0"]"#)
    ))
    .unwrap();
}

#[test]
fn addresses_narrow_the_selection() {
    let list = ResourceList::parse(&format!(
        r#"{{"resources": [{}]}}"#,
        npu_at(r#"["3b:00.0", "0001:5e:00.1"]"#)
    ))
    .unwrap();
    let npu = ids(0x1eff, 0x1220, 0x120000);
    assert_eq!(
        resource_at(&list, &at("0000:3b:00.0"), npu).as_deref(),
        Some("example.com/NPU_PT")
    );
    assert_eq!(
        resource_at(&list, &at("0001:5e:00.1"), npu).as_deref(),
        Some("example.com/NPU_PT")
    );
    // Same model elsewhere, the same slot in another domain or function: not selected.
    for other in [
        "0000:3c:00.0",
        "0001:3b:00.0",
        "0000:3b:00.1",
        "0000:5e:00.1",
    ] {
        assert_eq!(resource_at(&list, &at(other), npu), None, "{other}");
    }
    // A listed address still has to match the ids.
    assert_eq!(
        resource_at(&list, &at("0000:3b:00.0"), ids(0x1eff, 0x1250, 0x120000)),
        None
    );
    assert_eq!(
        resource_at(&list, &at("0000:3b:00.0"), ids(0x8086, 0x1220, 0x120000)),
        None
    );
    assert_eq!(
        list.describe(),
        [
            "example.com/NPU_PT: vendor 1eff, device 1220, any class, addresses \
                0000:3b:00.0 0001:5e:00.1, driver vfio-pci"
        ]
    );
}

#[test]
fn disjoint_addresses_keep_one_model_apart() {
    let list = ResourceList::parse(
        r#"{"resources": [
            {"name": "example.com/NPU_A", "vendor": "1eff", "devices": ["1220"], "addresses": ["3b:00.0", "3c:00.0"]},
            {"name": "example.com/NPU_B", "vendor": "1eff", "devices": ["1220"], "classes": ["12"], "addresses": ["5e:00.0"]},
            {"name": "example.com/NPU_REST", "vendor": "1eff", "devices": ["1250"]}
        ]}"#,
    )
    .unwrap();
    let npu = ids(0x1eff, 0x1220, 0x120000);
    assert_eq!(
        resource_at(&list, &at("0000:3c:00.0"), npu).as_deref(),
        Some("example.com/NPU_A")
    );
    assert_eq!(
        resource_at(&list, &at("0000:5e:00.0"), npu).as_deref(),
        Some("example.com/NPU_B")
    );
    assert_eq!(resource_at(&list, &at("0000:af:00.0"), npu), None);
    assert_eq!(
        resource_at(&list, &at("0000:3b:00.0"), ids(0x1eff, 0x1250, 0x120000)).as_deref(),
        Some("example.com/NPU_REST"),
        "an entry without addresses takes its model anywhere"
    );
}

#[test]
fn addresses_in_common_overlap() {
    let msg = err(r#"{"resources": [
            {"name": "example.com/A", "vendor": "1eff", "devices": ["1220"], "addresses": ["3b:00.0", "3c:00.0"]},
            {"name": "example.com/B", "vendor": "1eff", "classes": ["12"], "addresses": ["5e:00.0", "0000:3c:00.0"]}
        ]}"#);
    assert_eq!(
        msg,
        "resource list: resources[1] (example.com/B) overlaps resources[0] \
            (example.com/A): both would select vendor 1eff, device 1220, class 12xxxx, \
            address 0000:3c:00.0"
    );
}

#[test]
fn addresses_do_not_separate_an_entry_from_one_without_them() {
    // The same model without addresses selects the listed address too.
    let msg = err(r#"{"resources": [
            {"name": "example.com/A", "vendor": "1eff", "devices": ["1220"]},
            {"name": "example.com/B", "vendor": "1eff", "devices": ["1220"], "addresses": ["3b:00.0"]}
        ]}"#);
    assert!(
        msg.ends_with(
            "resources[1] (example.com/B) overlaps resources[0] \
                (example.com/A): both would select vendor 1eff, device 1220, any class, \
                address 0000:3b:00.0"
        ),
        "{msg}"
    );
    // Nor from a preset that takes the model.
    let msg = err(&format!(
        r#"{{"preset": "rebellions", "resources": [{}]}}"#,
        npu_at(r#"["3b:00.0"]"#)
    ));
    assert_eq!(
        msg,
        "resource list: resources[0] (example.com/NPU_PT) overlaps \
            preset \"rebellions\": both would select vendor 1eff, device 1220, class \
            12xxxx, address 0000:3b:00.0"
    );
}

#[test]
fn same_addresses_apart_by_ids_do_not_overlap() {
    // Addresses in common do not make an overlap when the ids keep the entries apart.
    for other in [
        r#""vendor": "8086""#,
        r#""vendor": "1eff", "devices": ["1250"]"#,
        r#""vendor": "1eff", "classes": ["0b40"]"#,
    ] {
        let doc = format!(
            r#"{{"resources": [
                {{"name": "example.com/A", "vendor": "1eff", "devices": ["1220"], "classes": ["1200"], "addresses": ["3b:00.0"]}},
                {{"name": "example.com/B", {other}, "addresses": ["3b:00.0"]}}
            ]}}"#
        );
        ResourceList::parse(&doc).unwrap_or_else(|e| panic!("{other}: {e}"));
    }
}

/// The names written out at build time are the database's, every one of them.
#[test]
fn the_compact_nvidia_names_are_the_databases() {
    use pci_ids::FromId;
    let vendor = pci_ids::Vendor::from_id(0x10de).unwrap();
    let mut n = 0;
    for d in vendor.devices() {
        assert_eq!(
            super::preset::nvidia_db_name(d.id()),
            Some(d.name()),
            "{:04x}",
            d.id()
        );
        n += 1;
    }
    assert!(n > 1000, "only {n} NVIDIA devices in the database");
    assert_eq!(super::preset::nvidia_db_name(0x2bad), None);
}
