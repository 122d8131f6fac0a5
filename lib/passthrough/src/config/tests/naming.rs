//! The top-level `naming`: the rebellions preset's `seed` and `pci-ids` names.

use super::*;

fn pci_ids() -> ResourceList {
    ResourceList::parse(r#"{"preset": "rebellions", "naming": "pci-ids"}"#).unwrap()
}

#[test]
fn pci_ids_gives_rebellions_current_names() {
    let list = pci_ids();
    for (device, name) in [
        (0x1250, "rebellions.ai/RBLN-CA25_PF"),
        (0x1251, "rebellions.ai/RBLN-CA25_VF"),
        (0x1220, "rebellions.ai/RBLN-CA22_PF"),
        (0x1221, "rebellions.ai/RBLN-CA22_VF"),
        (0x1120, "rebellions.ai/RBLN-CA12_PF"),
        (0x1210, "rebellions.ai/RBLN-CA21_PF"),
        (0x1111, "rebellions.ai/RBLN-CA11_VF"),
        (0x1020, "rebellions.ai/RBLN-CA2_PF"),
        (0x2030, "rebellions.ai/RBLN-CR03_PF"),
        (0x2031, "rebellions.ai/RBLN-2031_VF"),
        (0x00ab, "rebellions.ai/RBLN-00ab_VF"),
    ] {
        assert_eq!(
            resource(&list, ids(0x1eff, device, 0x120000)).as_deref(),
            Some(name),
            "{device:04x}"
        );
    }
    let selection = list
        .select(&somewhere(), &ids(0x1eff, 0x1250, 0x120000))
        .unwrap();
    assert_eq!(
        selection.resource.kubevirt_env_var(),
        "PCI_RESOURCE_REBELLIONS_AI_RBLN-CA25_PF"
    );
    assert_eq!(resource(&list, ids(0x1eff, 0x1250, 0x020000)), None);
}

#[test]
fn every_database_device_is_named_from_its_database_name() {
    use pci_ids::FromId;
    let list = pci_ids();
    let vendor = pci_ids::Vendor::from_id(0x1eff).unwrap();
    let mut count = 0;
    for dev in vendor.devices() {
        // "RBLN-CA25 (PF)": product, then the function in parentheses.
        let (product, function) = dev.name().split_once(' ').unwrap();
        let function = function.trim_matches(|c| c == '(' || c == ')');
        let want = format!("rebellions.ai/{product}_{function}");
        let got = resource(&list, ids(0x1eff, dev.id(), 0x120000)).unwrap();
        assert_eq!(got, want, "{:04x} {}", dev.id(), dev.name());
        count += 1;
    }
    assert_eq!(count, 12, "pci-ids 0.2.6 lists twelve Rebellions devices");
}

#[test]
fn seed_is_the_default_and_can_be_named() {
    let seed = ResourceList::parse(r#"{"naming": "seed", "preset": "rebellions"}"#).unwrap();
    assert_eq!(seed.describe(), ResourceList::builtin_default().describe());
    assert_eq!(
        resource(&seed, ids(0x1eff, 0x1250, 0x120000)).as_deref(),
        Some("rebellions.ai/ATOM_CA25_PT")
    );
    let line = &pci_ids().describe()[0];
    assert!(line.contains("1250 rebellions.ai/RBLN-CA25_PF"), "{line}");
    assert!(
        line.contains("any other rebellions.ai/RBLN-<device>_PF"),
        "{line}"
    );
}

#[test]
fn naming_applies_with_other_presets_and_entries() {
    let list = ResourceList::parse(
        r#"{"preset": ["nvidia", "rebellions"], "naming": "pci-ids",
            "resources": [{"name": "example.com/NIC_PT", "vendor": "8086"}]}"#,
    )
    .unwrap();
    assert_eq!(
        resource(&list, ids(0x1eff, 0x1220, 0x120000)).as_deref(),
        Some("rebellions.ai/RBLN-CA22_PF")
    );
    assert_eq!(
        resource(&list, ids(0x8086, 0x10d3, 0x020000)).as_deref(),
        Some("example.com/NIC_PT")
    );
}

#[test]
fn unknown_naming_values_are_errors() {
    assert_eq!(
        err(r#"{"preset": "rebellions", "naming": "pci_ids"}"#),
        "resource list: naming: unknown naming \"pci_ids\" (expected \"seed\" or \"pci-ids\")"
    );
    assert_eq!(
        err(r#"{"preset": "rebellions", "naming": ["pci-ids"]}"#),
        "resource list: naming: expected \"seed\" or \"pci-ids\", found a list"
    );
    assert!(err(r#"{"preset": "rebellions", "naming": null}"#).contains("found null"));
    assert!(
        err(r#"{"preset": "rebellions", "naming": "seed", "naming": "seed"}"#)
            .contains("key \"naming\" appears twice")
    );
}

#[test]
fn naming_without_the_rebellions_preset_is_an_error() {
    for doc in [
        r#"{"naming": "pci-ids"}"#,
        r#"{"naming": "seed", "preset": "nvidia"}"#,
        r#"{"naming": "pci-ids", "resources": [{"name": "example.com/NIC_PT", "vendor": "8086"}]}"#,
    ] {
        let msg = err(doc);
        assert!(
            msg.contains("only chooses the names of the rebellions preset"),
            "{doc}: {msg}"
        );
    }
    // Inside an entry it is an unknown key, like any other.
    assert!(
        entry_err(r#"{"name": "a.com/B", "vendor": "1eff", "naming": "pci-ids"}"#)
            .contains("unknown key \"naming\"")
    );
}

#[test]
fn explicit_names_may_not_take_a_pci_ids_name() {
    let msg = err(r#"{"preset": "rebellions", "naming": "pci-ids",
            "resources": [{"name": "rebellions.ai/RBLN-CA25_PF", "vendor": "8086"}]}"#);
    assert!(
        msg.contains("name is already used by preset \"rebellions\""),
        "{msg}"
    );
    // Under seed naming that name is free, and the seed names are taken.
    ResourceList::parse(
        r#"{"preset": "rebellions",
            "resources": [{"name": "rebellions.ai/RBLN-CA25_PF", "vendor": "8086"}]}"#,
    )
    .unwrap();
    let msg = err(r#"{"preset": "rebellions",
            "resources": [{"name": "rebellions.ai/ATOM_CA25_PT", "vendor": "8086"}]}"#);
    assert!(
        msg.contains("name is already used by preset \"rebellions\""),
        "{msg}"
    );
}

#[test]
fn only_the_pci_ids_naming_gives_rebellions_products() {
    let npu = ids(0x1eff, 0x1251, 0x120000);
    assert_eq!(
        pci_ids().rebellions_product(&somewhere(), &npu).as_deref(),
        Some("RBLN-CA25")
    );
    let unnamed = ids(0x1eff, 0x00ab, 0x120000);
    assert_eq!(
        pci_ids()
            .rebellions_product(&somewhere(), &unnamed)
            .as_deref(),
        Some("RBLN-00ab")
    );
    // Not selected, the seed naming, or an explicit entry (even of Rebellions): none.
    let other_class = ids(0x1eff, 0x1250, 0x020000);
    assert_eq!(
        pci_ids().rebellions_product(&somewhere(), &other_class),
        None
    );
    let seed = ResourceList::parse(r#"{"preset": "rebellions"}"#).unwrap();
    assert_eq!(seed.rebellions_product(&somewhere(), &npu), None);
    let list = ResourceList::parse(
        r#"{"preset": "rebellions", "naming": "pci-ids",
            "resources": [{"name": "example.com/NPU_PT", "vendor": "1eff", "classes": ["0200"]},
                          {"name": "example.com/NIC_PT", "vendor": "8086"}]}"#,
    )
    .unwrap();
    for explicit in [ids(0x1eff, 0x1250, 0x020000), ids(0x8086, 0x10d3, 0x020000)] {
        assert!(list.select(&somewhere(), &explicit).is_some());
        assert_eq!(list.rebellions_product(&somewhere(), &explicit), None);
    }
    assert_eq!(
        list.rebellions_product(&somewhere(), &npu).as_deref(),
        Some("RBLN-CA25")
    );
}
