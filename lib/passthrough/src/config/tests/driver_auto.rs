//! `"driver": "auto"` in the resource list: where it is allowed and what it selects.

use super::*;

#[test]
fn an_entry_may_let_the_kernel_choose() {
    let list = ResourceList::parse(
        r#"{"preset": "rebellions", "resources": [
            {"name": "nvidia.com/GPU", "vendor": "10de", "driver": "auto"},
            {"name": "example.com/NIC_PT", "vendor": "8086", "driver": "mlx5_vfio_pci"}]}"#,
    )
    .unwrap();
    let gpu = list
        .select(&somewhere(), &ids(0x10de, 0x2342, 0x030200))
        .unwrap();
    assert_eq!(gpu.driver, DriverRule::Auto);
    assert_eq!(gpu.driver, "auto");
    assert_eq!(
        list.drivers(),
        ["vfio-pci", "mlx5_vfio_pci"],
        "auto names no driver"
    );
    assert!(list.has_auto_driver());
    assert!(!ResourceList::builtin_default().has_auto_driver());
    let lines = list.describe();
    assert_eq!(
        lines[1],
        "nvidia.com/GPU: vendor 10de, any device, any class, driver auto"
    );
}

#[test]
fn auto_is_only_for_entries() {
    for doc in [
        r#"{"preset": "rebellions", "driver": "auto"}"#,
        r#"{"resources": [{"name": "a.com/B", "vendor": "8086"}], "driver": "vfio-pci"}"#,
    ] {
        let msg = err(doc);
        assert!(
            msg.contains(
                "unknown key \"driver\": a driver (\"auto\" included) belongs in an entry"
            ),
            "{doc}: {msg}"
        );
    }
}

#[test]
fn near_misses_of_auto_are_errors_that_mention_it() {
    for driver in ["AUTO", "Auto", " auto", "auto_vfio", ""] {
        let msg = entry_err(&format!(
            r#"{{"name": "nvidia.com/GPU", "vendor": "10de", "driver": {driver:?}}}"#
        ));
        assert!(
            msg.starts_with("resource list: resources[0] (nvidia.com/GPU): driver: ")
                && msg.contains("or \"auto\" to let the kernel's vfio_pci aliases choose"),
            "{driver:?}: {msg}"
        );
    }
}
