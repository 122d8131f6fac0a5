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
        "resource list: unknown key \"resource\" (expected \"preset\", \"naming\" or \"resources\")"
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
        "resource list: resources[1] (example.com/X): unknown key \"device\" (expected \
            name, vendor, devices, classes, addresses, driver)"
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
        "resource list: resources[0] (example.com/X): devices: the list is empty \
            (leave the key out to match any device)"
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
        "resource list: resources[0] (example.com/X): classes[1]: \"123\" is not a \
            class prefix of 2, 4 or 6 hex digits"
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
        "resource list: resources[2] (example.com/X): name is already used by \
            resources[0] (example.com/X)"
    );
}

/// KubeVirt reads `PCI_RESOURCE_<NAME>`, upper-casing the name and turning `/`
/// and `.` into `_`: two names that map to one variable would both set it.
#[test]
fn names_that_map_to_one_kubevirt_variable() {
    for (a, b, variable) in [
        (
            "example.com/gpu",
            "example.com/GPU",
            "PCI_RESOURCE_EXAMPLE_COM_GPU",
        ),
        (
            "example.com/a.b",
            "example.com/a_b",
            "PCI_RESOURCE_EXAMPLE_COM_A_B",
        ),
        (
            "example.com/x.y",
            "example.com.x/y",
            "PCI_RESOURCE_EXAMPLE_COM_X_Y",
        ),
        ("a.b/c-d", "a.b/C-D", "PCI_RESOURCE_A_B_C-D"),
    ] {
        let msg = err(&format!(
            r#"{{"resources": [
                {{"name": "{a}", "vendor": "8086", "devices": ["1"]}},
                {{"name": "{b}", "vendor": "8086", "devices": ["2"]}}
            ]}}"#
        ));
        assert_eq!(
            msg,
            format!(
                "resource list: resources[1] ({b}) and resources[0] ({a}) both map to KubeVirt's variable {variable} \
                 (KubeVirt upper-cases a resource name and turns `/` and `.` into `_`), which would be set for both; rename one"
            )
        );
    }
    // A hyphen is kept by KubeVirt: these are two variables.
    ResourceList::parse(
        r#"{"resources": [
            {"name": "example.com/a-b", "vendor": "8086", "devices": ["1"]},
            {"name": "example.com/a_b", "vendor": "8086", "devices": ["2"]}
        ]}"#,
    )
    .unwrap();
    // A preset's names, fixed or made from the device id or the PCI ID database.
    for (preset, name) in [
        (r#""preset": "rebellions""#, "rebellions.ai/atom_ca22_pt"),
        (r#""preset": "rebellions""#, "rebellions.ai/RBLN_ABCD_PT"),
        (
            r#""preset": "rebellions", "naming": "pci-ids""#,
            "rebellions.ai/rbln-ca25_pf",
        ),
        (r#""preset": "nvidia""#, "nvidia.com/gh100_h100_sxm5_80gb"),
        (r#""preset": "nvidia""#, "nvidia.com/FFFF"),
    ] {
        let msg = err(&format!(
            r#"{{{preset}, "resources": [{{"name": "{name}", "vendor": "8086", "devices": ["1"]}}]}}"#
        ));
        assert!(
            msg.starts_with(&format!("resource list: resources[0] ({name}) and preset ")),
            "{msg}"
        );
        assert!(
            msg.contains("both map to KubeVirt's variable PCI_RESOURCE_"),
            "{msg}"
        );
    }
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
            format!(
                "resource list: resources[0] ({name}): name is already used by \
                    preset \"rebellions\""
            )
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
        "resource list: resources[1] (example.com/B) overlaps resources[0] \
            (example.com/A): both would select vendor 8086, device 10d4, class 0200xx"
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
        "resource list: resources[0] (example.com/NPU) overlaps preset \"rebellions\": \
            both would select vendor 1eff, device 1220, class 12xxxx"
    );
    let msg = err(
        r#"{"preset": ["rebellions", "nvidia"], "resources": [{"name": "example.com/GPU", "vendor": "10de", "classes": ["030200"]}]}"#,
    );
    assert!(
        msg.ends_with(
            "resources[0] (example.com/GPU) overlaps preset \"nvidia\": both \
                would select vendor 10de, any device, class 030200"
        ),
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

mod driver_auto;
mod load;
mod naming;
mod selection;
