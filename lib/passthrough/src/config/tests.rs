use super::*;

fn ids(vendor: u16, device: u16, class: u32) -> DeviceIds {
    DeviceIds {
        vendor,
        device,
        class,
    }
}

fn err(json: &str) -> String {
    ResourceList::parse(json).unwrap_err().to_string()
}

/// A document with one explicit entry, given as the inside of its object.
fn entry_err(entry: &str) -> String {
    err(&format!(r#"{{"resources": [{entry}]}}"#))
}

/// An address no test lists: selection there depends on the ids alone.
fn somewhere() -> PciAddress {
    at("0000:01:00.0")
}

fn at(address: &str) -> PciAddress {
    address.parse().unwrap()
}

fn resource(list: &ResourceList, ids: DeviceIds) -> Option<String> {
    resource_at(list, &somewhere(), ids)
}

fn resource_at(list: &ResourceList, address: &PciAddress, ids: DeviceIds) -> Option<String> {
    list.select(address, &ids).map(|s| s.resource.to_string())
}

const NIC: &str =
    r#"{"name": "example.com/NIC_PT", "vendor": "8086", "devices": ["10d3"], "classes": ["0200"]}"#;

// ---- document shape ----

#[test]
fn unknown_top_level_key() {
    let msg = err(r#"{"preset": "rebellions", "resource": []}"#);
    assert_eq!(
        msg,
        "resource list: unknown key \"resource\" (expected \"preset\" or \"resources\")"
    );
}

#[test]
fn repeated_top_level_key() {
    let msg = err(r#"{"preset": "rebellions", "preset": "nvidia"}"#);
    assert_eq!(msg, "resource list: key \"preset\" appears twice");
}

#[test]
fn top_level_must_be_an_object() {
    assert!(err("[]").contains("expected a JSON object at the top level, found a list"));
    assert!(err("null").contains("found null"));
}

#[test]
fn invalid_json_names_line_and_column() {
    let msg = err("{\n  \"preset\": \"rebellions\",\n  \"resources\": [,]\n}");
    assert!(
        msg.starts_with("resource list: invalid JSON at line 3 column"),
        "{msg}"
    );
    // The position is given once, not repeated from the parser's own text.
    assert_eq!(msg.matches("line 3").count(), 1, "{msg}");
    match ResourceList::parse("{\"preset\": }").unwrap_err() {
        ConfigError::Json { line, column, .. } => assert_eq!((line, column), (1, 12)),
        other => panic!("{other:?}"),
    }
    assert!(err("").contains("invalid JSON at line 1 column 0: EOF"));
}

#[test]
fn empty_documents_are_errors() {
    for doc in [
        "{}",
        r#"{"resources": []}"#,
        r#"{"preset": []}"#,
        r#"{"preset": [], "resources": []}"#,
    ] {
        let msg = err(doc);
        assert!(msg.contains("selects no devices"), "{doc}: {msg}");
    }
}

#[test]
fn nulls_are_errors() {
    assert!(err(r#"{"preset": null}"#)
        .contains("preset: expected a preset name or a list of names, found null"));
    assert!(
        err(r#"{"resources": null}"#).contains("resources: expected a list of entries, found null")
    );
    assert!(
        entry_err(r#"{"name": "a.com/b", "vendor": "1", "devices": null}"#)
            .contains("resources[0] (a.com/b): devices: expected a list of hex ids, found null")
    );
    assert!(
        entry_err(r#"{"name": "a.com/b", "vendor": "1", "classes": null}"#).contains(
            "resources[0] (a.com/b): classes: expected a list of hex class prefixes, found null"
        )
    );
    assert!(
        entry_err(r#"{"name": "a.com/b", "vendor": "1", "driver": null}"#)
            .contains("resources[0] (a.com/b): driver: expected a string, found null")
    );
}

// ---- presets ----

#[test]
fn unknown_preset_lists_known_ones() {
    let msg = err(r#"{"preset": ["rebellions", "amd"]}"#);
    assert_eq!(
        msg,
        "resource list: unknown preset \"amd\" (known presets: rebellions, nvidia, nvidia-nvswitch)"
    );
}

#[test]
fn preset_shapes() {
    assert!(err(r#"{"preset": 1}"#)
        .contains("preset: expected a preset name or a list of names, found a number"));
    assert!(err(r#"{"preset": ["nvidia", true]}"#)
        .contains("preset[1]: expected a preset name, found a boolean"));
    assert!(err(r#"{"preset": ["nvidia", "nvidia"]}"#)
        .contains("preset[1]: \"nvidia\" is listed twice"));
    let list =
        ResourceList::parse(r#"{"preset": ["rebellions", "nvidia", "nvidia-nvswitch"]}"#).unwrap();
    assert_eq!(list.vendors(), [0x10de, 0x1eff]);
    assert_eq!(list.describe().len(), 3);
}

#[test]
fn file_without_preset_has_no_preset() {
    let list = ResourceList::parse(&format!(r#"{{"resources": [{NIC}]}}"#)).unwrap();
    assert_eq!(resource(&list, ids(0x1eff, 0x1220, 0x120000)), None);
    assert_eq!(list.vendors(), [0x8086]);
}

// ---- entries ----

#[test]
fn unknown_entry_key_names_entry_and_key() {
    let msg = err(&format!(
        r#"{{"resources": [{NIC}, {{"name": "example.com/X", "vendor": "1", "device": ["2"]}}]}}"#
    ));
    assert_eq!(
        msg,
        "resource list: resources[1] (example.com/X): unknown key \"device\" (expected name, vendor, devices, classes, addresses, driver)"
    );
}

#[test]
fn repeated_entry_key() {
    let msg = entry_err(r#"{"name": "example.com/X", "vendor": "1eff", "vendor": "10de"}"#);
    assert_eq!(
        msg,
        "resource list: resources[0] (example.com/X): key \"vendor\" appears twice"
    );
}

#[test]
fn entry_must_be_an_object() {
    assert_eq!(
        entry_err(r#""example.com/X""#),
        "resource list: resources[0]: expected an object, found a string"
    );
}

#[test]
fn missing_required_keys() {
    assert_eq!(
        entry_err(r#"{"vendor": "1eff"}"#),
        "resource list: resources[0]: missing \"name\""
    );
    assert_eq!(
        entry_err(r#"{"name": "example.com/X"}"#),
        "resource list: resources[0] (example.com/X): missing \"vendor\""
    );
    assert_eq!(
        entry_err(r#"{"name": 7, "vendor": "1eff"}"#),
        "resource list: resources[0]: name: expected a string, found a number"
    );
}

#[test]
fn bad_hex_vendor() {
    for vendor in [
        r#""1efg""#,
        r#""12345""#,
        r#""""#,
        r#""0x""#,
        r#""+1ef""#,
        r#"" 1ef""#,
    ] {
        let msg = entry_err(&format!(
            r#"{{"name": "example.com/X", "vendor": {vendor}}}"#
        ));
        assert_eq!(
            msg,
            format!(
                "resource list: resources[0] (example.com/X): vendor: {vendor} is not a hex PCI id"
            )
        );
    }
    let msg = entry_err(r#"{"name": "example.com/X", "vendor": 7935}"#);
    assert!(
        msg.contains("vendor: expected a hex id string such as \"1eff\", found a number"),
        "{msg}"
    );
}

#[test]
fn hex_ids_accept_prefix_and_any_case() {
    for vendor in ["1eff", "1EFF", "0x1eff", "0X1EfF"] {
        let list = ResourceList::parse(&format!(
            r#"{{"resources": [{{"name": "example.com/X", "vendor": "{vendor}", "devices": ["0xAB", "1"]}}]}}"#
        ))
        .unwrap();
        assert_eq!(list.vendors(), [0x1eff], "{vendor}");
        assert!(list.select(&somewhere(), &ids(0x1eff, 0xab, 0)).is_some());
        assert!(list.select(&somewhere(), &ids(0x1eff, 0x1, 0)).is_some());
        assert!(list.select(&somewhere(), &ids(0x1eff, 0xac, 0)).is_none());
    }
}

#[test]
fn bad_device_id() {
    let msg = err(r#"{"resources": [
            {"name": "a.com/A", "vendor": "1", "devices": ["1"]},
            {"name": "b.com/B", "vendor": "2", "devices": ["1"]},
            {"name": "example.com/NIC_PT", "vendor": "8086", "devices": ["10d3", "10g3"]}
        ]}"#);
    assert_eq!(
        msg,
        "resource list: resources[2] (example.com/NIC_PT): devices[1]: \"10g3\" is not a hex PCI id"
    );
}

#[test]
fn empty_devices_list() {
    let msg = entry_err(r#"{"name": "example.com/X", "vendor": "8086", "devices": []}"#);
    assert_eq!(
        msg,
        "resource list: resources[0] (example.com/X): devices: the list is empty (leave the key out to match any device)"
    );
}

#[test]
fn repeated_device_id() {
    let msg =
        entry_err(r#"{"name": "example.com/X", "vendor": "8086", "devices": ["10d3", "0x10D3"]}"#);
    assert!(
        msg.ends_with("resources[0] (example.com/X): devices[1]: 10d3 is listed twice"),
        "{msg}"
    );
}

#[test]
fn odd_class_prefix() {
    let msg = entry_err(r#"{"name": "example.com/X", "vendor": "8086", "classes": ["02", "123"]}"#);
    assert_eq!(
        msg,
        "resource list: resources[0] (example.com/X): classes[1]: \"123\" is not a class prefix of 2, 4 or 6 hex digits"
    );
    for bad in ["\"\"", "\"1234567\"", "\"0x1\""] {
        let msg = entry_err(&format!(
            r#"{{"name": "example.com/X", "vendor": "8086", "classes": [{bad}]}}"#
        ));
        assert!(
            msg.contains("is not a class prefix of 2, 4 or 6 hex digits"),
            "{msg}"
        );
    }
}

#[test]
fn bad_class_prefixes() {
    let msg = entry_err(r#"{"name": "example.com/X", "vendor": "8086", "classes": ["03zz"]}"#);
    assert!(
        msg.ends_with("classes[0]: \"03zz\" is not a hex class prefix"),
        "{msg}"
    );
    let msg = entry_err(r#"{"name": "example.com/X", "vendor": "8086", "classes": []}"#);
    assert!(
        msg.ends_with("classes: the list is empty (leave the key out to match any class)"),
        "{msg}"
    );
    let msg =
        entry_err(r#"{"name": "example.com/X", "vendor": "8086", "classes": ["03", "0x0302"]}"#);
    assert!(
        msg.ends_with("classes[1]: 0302xx overlaps 03xxxx listed before it"),
        "{msg}"
    );
    let msg = entry_err(r#"{"name": "example.com/X", "vendor": "8086", "classes": [3]}"#);
    assert!(
        msg.ends_with("classes[0]: expected a hex class prefix such as \"0300\", found a number"),
        "{msg}"
    );
}

#[test]
fn bad_names() {
    let cases = [
        ("NIC_PT", "expected domain/name"),
        ("Example.com/NIC_PT", "only lowercase letters"),
        ("kubernetes.io/NIC_PT", "kubernetes.io domain is reserved"),
        (
            "nic.kubernetes.io/NIC_PT",
            "kubernetes.io domain is reserved",
        ),
        ("requests.example.com/NIC_PT", "reserved for quota"),
        (
            "example.com/-NIC_PT",
            "must start and end with a letter or digit",
        ),
        (
            "example.com/NIC_PT_",
            "must start and end with a letter or digit",
        ),
        ("example.com/NIC PT", "only letters, digits"),
    ];
    for (name, problem) in cases {
        let msg = entry_err(&format!(r#"{{"name": "{name}", "vendor": "8086"}}"#));
        let want = format!("resource list: resources[0] ({name}): name: ");
        assert!(msg.starts_with(&want), "{msg}");
        assert!(msg.contains(problem), "{msg}");
    }
    let long = format!("example.com/{}", "N".repeat(64));
    let msg = entry_err(&format!(r#"{{"name": "{long}", "vendor": "8086"}}"#));
    assert!(
        msg.contains(&format!("resources[0] ({long}): name: ")),
        "{msg}"
    );
    assert!(msg.contains("64 characters, more than 63"), "{msg}");
}

#[test]
fn bad_driver() {
    for (driver, problem) in [
        ("", "\"\" is not a vfio driver"),
        ("vfio pci", "is not a vfio driver"),
        ("../vfio-pci", "is not a vfio driver"),
        ("..", "is not a vfio driver"),
        (
            "ahci",
            "\"ahci\" is not a vfio driver; allowed: vfio-pci or a vfio-pci variant",
        ),
        ("nvgrace-gpu-vfio-pci", "the driver is nvgrace_gpu_vfio_pci"),
    ] {
        let msg = entry_err(&format!(
            r#"{{"name": "example.com/X", "vendor": "8086", "driver": "{driver}"}}"#
        ));
        assert!(
            msg.starts_with("resource list: resources[0] (example.com/X): driver: "),
            "{msg}"
        );
        assert!(msg.contains(problem), "{msg}");
    }
}

#[test]
fn duplicate_name() {
    let msg = err(r#"{"resources": [
            {"name": "example.com/X", "vendor": "8086", "devices": ["1"]},
            {"name": "example.com/Y", "vendor": "8086", "devices": ["2"]},
            {"name": "example.com/X", "vendor": "8086", "devices": ["3"]}
        ]}"#);
    assert_eq!(
        msg,
        "resource list: resources[2] (example.com/X): name is already used by resources[0] (example.com/X)"
    );
}

#[test]
fn name_given_by_a_preset() {
    // Disjoint selectors, but the preset already advertises these names.
    for name in ["rebellions.ai/ATOM_CA22_PT", "rebellions.ai/RBLN_1020_PT"] {
        let msg = err(&format!(
            r#"{{"preset": "rebellions", "resources": [{{"name": "{name}", "vendor": "1eff", "classes": ["0b40"]}}]}}"#
        ));
        assert_eq!(
            msg,
            format!("resource list: resources[0] ({name}): name is already used by preset \"rebellions\"")
        );
    }
    let msg = err(
        r#"{"preset": "nvidia", "resources": [{"name": "nvidia.com/GH100_H100_SXM5_80GB", "vendor": "10de", "devices": ["2330"], "classes": ["0380"]}]}"#,
    );
    assert!(
        msg.ends_with("name is already used by preset \"nvidia\""),
        "{msg}"
    );
    // Without the preset, the same entry is fine.
    ResourceList::parse(
        r#"{"resources": [{"name": "rebellions.ai/ATOM_CA22_PT", "vendor": "1eff", "classes": ["0b40"]}]}"#,
    )
    .unwrap();
}

#[test]
fn overlap_explicit_vs_explicit() {
    let msg = err(r#"{"resources": [
            {"name": "example.com/A", "vendor": "8086", "devices": ["10d3", "10d4"]},
            {"name": "example.com/B", "vendor": "8086", "devices": ["10d5", "10d4"], "classes": ["0200"]}
        ]}"#);
    assert_eq!(
        msg,
        "resource list: resources[1] (example.com/B) overlaps resources[0] (example.com/A): both would select vendor 8086, device 10d4, class 0200xx"
    );
    let msg = err(r#"{"resources": [
            {"name": "example.com/A", "vendor": "8086"},
            {"name": "example.com/B", "vendor": "8086"}
        ]}"#);
    assert!(
        msg.ends_with("both would select vendor 8086, any device, any class"),
        "{msg}"
    );
}

#[test]
fn overlap_explicit_vs_preset() {
    let msg = err(
        r#"{"preset": "rebellions", "resources": [{"name": "example.com/NPU", "vendor": "1eff", "devices": ["1220"]}]}"#,
    );
    assert_eq!(
        msg,
        "resource list: resources[0] (example.com/NPU) overlaps preset \"rebellions\": both would select vendor 1eff, device 1220, class 12xxxx"
    );
    let msg = err(
        r#"{"preset": ["rebellions", "nvidia"], "resources": [{"name": "example.com/GPU", "vendor": "10de", "classes": ["030200"]}]}"#,
    );
    assert!(
        msg.ends_with("resources[0] (example.com/GPU) overlaps preset \"nvidia\": both would select vendor 10de, any device, class 030200"),
        "{msg}"
    );
}

#[test]
fn class_prefixes_overlap_by_nesting() {
    for (a, b) in [
        ("03", "0302"),
        ("0300", "030001"),
        ("0300", "0300"),
        ("12", "12"),
    ] {
        let doc = format!(
            r#"{{"resources": [
                {{"name": "example.com/A", "vendor": "8086", "classes": ["{a}"]}},
                {{"name": "example.com/B", "vendor": "8086", "classes": ["0b", "{b}"]}}
            ]}}"#
        );
        assert!(err(&doc).contains("overlaps"), "{a} {b}");
    }
}

#[test]
fn close_but_disjoint_selectors() {
    // Same vendor, disjoint devices.
    let list = ResourceList::parse(
        r#"{"resources": [
            {"name": "example.com/A", "vendor": "8086", "devices": ["10d3", "10d4"]},
            {"name": "example.com/B", "vendor": "8086", "devices": ["10d5"]}
        ]}"#,
    )
    .unwrap();
    assert_eq!(
        resource(&list, ids(0x8086, 0x10d4, 0x020000)).as_deref(),
        Some("example.com/A")
    );
    assert_eq!(
        resource(&list, ids(0x8086, 0x10d5, 0x020000)).as_deref(),
        Some("example.com/B")
    );
    // Same vendor, disjoint classes, including prefixes that share leading digits.
    let list = ResourceList::parse(
        r#"{"resources": [
            {"name": "example.com/A", "vendor": "8086", "classes": ["0300", "030200"]},
            {"name": "example.com/B", "vendor": "8086", "classes": ["0301", "030201", "02"]}
        ]}"#,
    )
    .unwrap();
    assert_eq!(
        resource(&list, ids(0x8086, 1, 0x030000)).as_deref(),
        Some("example.com/A")
    );
    assert_eq!(
        resource(&list, ids(0x8086, 1, 0x030200)).as_deref(),
        Some("example.com/A")
    );
    assert_eq!(
        resource(&list, ids(0x8086, 1, 0x030201)).as_deref(),
        Some("example.com/B")
    );
    assert_eq!(
        resource(&list, ids(0x8086, 1, 0x020000)).as_deref(),
        Some("example.com/B")
    );
    assert_eq!(resource(&list, ids(0x8086, 1, 0x030202)), None);
    // The rebellions preset next to another class of the same vendor, and nvidia GPUs
    // next to NVSwitches and explicit NVIDIA audio functions.
    ResourceList::parse(
        r#"{"preset": ["rebellions", "nvidia", "nvidia-nvswitch"], "resources": [
            {"name": "example.com/RBLN_OTHER", "vendor": "1eff", "classes": ["0b40"]},
            {"name": "example.com/GPU_AUDIO", "vendor": "10de", "classes": ["0403"]}
        ]}"#,
    )
    .unwrap();
}

// ---- selection ----

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
            "nvidia.com/GRACE_GPU: vendor 10de, device 2342, any class, driver nvgrace_gpu_vfio_pci",
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
            "preset nvidia: vendor 10de, any device, classes 0300xx 0302xx, driver vfio-pci -> nvidia.com/<PCI ID database name>, else nvidia.com/<device>",
            "example.com/A: vendor 8086, devices 0001 0002, classes 02xxxx 0c0330, driver vfio-pci",
        ]
    );
}

// ---- files ----

#[test]
fn load_without_a_file_is_the_default() {
    let list = ResourceList::load(None).unwrap();
    assert_eq!(list.describe(), ResourceList::builtin_default().describe());
}

#[test]
fn load_reads_a_file() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let path = dir.path().join("resources.json");
    std::fs::write(&path, format!(r#"{{"resources": [{NIC}]}}"#)).unwrap();
    let list = ResourceList::load(Some(&path)).unwrap();
    assert_eq!(
        resource(&list, ids(0x8086, 0x10d3, 0x020000)).as_deref(),
        Some("example.com/NIC_PT")
    );
}

#[test]
fn load_errors_name_the_file() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let missing = dir.path().join("missing.json");
    let error = ResourceList::load(Some(&missing)).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!("failed to read resource list {}", missing.display())
    );
    assert_eq!(error.file(), Some(missing.as_path()));
    assert!(
        matches!(&error, ConfigError::ReadFile { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    );

    let path = dir.path().join("resources.json");
    std::fs::write(
        &path,
        "{\n  \"preset\": \"rebellions\",\n  \"oops\": 1\n}\n",
    )
    .unwrap();
    let error = ResourceList::load(Some(&path)).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "resource list {}: unknown key \"oops\" (expected \"preset\" or \"resources\")",
            path.display()
        )
    );
    assert_eq!(error.file(), Some(path.as_path()));

    std::fs::write(
        &path,
        "{\n  \"preset\": \"rebellions\"\n  \"resources\": []\n}\n",
    )
    .unwrap();
    let error = ResourceList::load(Some(&path)).unwrap_err().to_string();
    assert!(
        error.starts_with(&format!(
            "resource list {}: invalid JSON at line 3 column 3: ",
            path.display()
        )),
        "{error}"
    );

    std::fs::write(
        &path,
        r#"{"resources": [{"name": "example.com/X", "vendor": "zz"}]}"#,
    )
    .unwrap();
    let error = ResourceList::load(Some(&path)).unwrap_err().to_string();
    assert_eq!(
        error,
        format!(
            "resource list {}: resources[0] (example.com/X): vendor: \"zz\" is not a hex PCI id",
            path.display()
        )
    );
}

#[test]
fn load_refuses_what_is_not_a_regular_file_without_blocking() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let fifo = dir.path().join("fifo.json");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    for (path, kind) in [
        (fifo.as_path(), "a FIFO"),
        (Path::new("/dev/zero"), "a character device"),
        (dir.path(), "a directory"),
    ] {
        let error = ResourceList::load(Some(path)).unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "resource list {} is {kind}, not a regular file",
                path.display()
            )
        );
        assert_eq!(error.file(), Some(path));
    }
    // A mounted ConfigMap is a link to a regular file: read through it.
    let target = dir.path().join("data.json");
    std::fs::write(&target, format!(r#"{{"resources": [{NIC}]}}"#)).unwrap();
    let link = dir.path().join("config.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    assert!(ResourceList::load(Some(&link)).is_ok());
    std::os::unix::fs::symlink(&fifo, dir.path().join("to-fifo")).unwrap();
    assert!(matches!(
        ResourceList::load(Some(&dir.path().join("to-fifo"))),
        Err(ConfigError::NotAFile { kind: "a FIFO", .. })
    ));
}

#[test]
fn load_caps_the_file_size() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let path = dir.path().join("big.json");
    // Valid JSON all the way: only the size is wrong.
    let doc = format!(r#"{{"resources": [{NIC}]}}"#);
    let limit = usize::try_from(MAX_FILE_BYTES).unwrap();
    std::fs::write(&path, format!("{doc}{}", " ".repeat(limit - doc.len()))).unwrap();
    assert!(
        ResourceList::load(Some(&path)).is_ok(),
        "exactly the limit is read"
    );
    std::fs::write(&path, format!("{doc}{}", " ".repeat(limit + 1 - doc.len()))).unwrap();
    let error = ResourceList::load(Some(&path)).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "resource list {} is larger than the limit of 1048576 bytes",
            path.display()
        )
    );
    std::fs::write(&path, b"{\"preset\": \"\xff\"}").unwrap();
    assert!(matches!(
        ResourceList::load(Some(&path)),
        Err(ConfigError::ReadFile { source, .. }) if source.kind() == std::io::ErrorKind::InvalidData
    ));
}

#[test]
fn parse_errors_carry_no_file() {
    assert_eq!(ResourceList::parse("{}").unwrap_err().file(), None);
}

// ---- addresses ----

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
        format!("{entry}: addresses: expected a list of PCI addresses, found a string (leave the key out to match any address)")
    );
    assert_eq!(
        entry_err(&npu_at(r#"["3b:00.0", 7]"#)),
        format!("{entry}: addresses[1]: expected a PCI address such as \"0000:3b:00.0\", found a number")
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
        format!("{entry}: addresses: expected a list of PCI addresses, found null (leave the key out to match any address)")
    );
}

#[test]
fn addresses_listed_twice_in_either_form() {
    let msg = entry_err(&npu_at(r#"["0000:3b:00.0", "5e:00.0", "3B:00.0"]"#));
    assert_eq!(
        msg,
        "resource list: resources[0] (example.com/NPU_PT): addresses[2]: 0000:3b:00.0 is listed twice"
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
        ["example.com/NPU_PT: vendor 1eff, device 1220, any class, addresses 0000:3b:00.0 0001:5e:00.1, driver vfio-pci"]
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
        "resource list: resources[1] (example.com/B) overlaps resources[0] (example.com/A): both would select vendor 1eff, device 1220, class 12xxxx, address 0000:3c:00.0"
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
        msg.ends_with("resources[1] (example.com/B) overlaps resources[0] (example.com/A): both would select vendor 1eff, device 1220, any class, address 0000:3b:00.0"),
        "{msg}"
    );
    // Nor from a preset that takes the model.
    let msg = err(&format!(
        r#"{{"preset": "rebellions", "resources": [{}]}}"#,
        npu_at(r#"["3b:00.0"]"#)
    ));
    assert_eq!(
        msg,
        "resource list: resources[0] (example.com/NPU_PT) overlaps preset \"rebellions\": both would select vendor 1eff, device 1220, class 12xxxx, address 0000:3b:00.0"
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

mod hostile {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn any_text_is_a_list_or_an_error(text in any::<String>()) {
            let _ = ResourceList::parse(&text);
        }

        #[test]
        fn any_entry_values_are_a_list_or_an_error(
            vendor in any::<String>(),
            device in any::<String>(),
            class in any::<String>(),
            driver in any::<String>(),
            address in any::<String>(),
        ) {
            let doc = serde_json::json!({"resources": [{
                "name": "example.com/X", "vendor": vendor, "devices": [device],
                "classes": [class], "driver": driver, "addresses": [address],
            }]});
            if let Ok(list) = ResourceList::parse(&doc.to_string()) {
                prop_assert!(list.drivers().iter().all(|d| is_vfio_driver(d)));
            }
        }
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
