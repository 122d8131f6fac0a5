//! `"driver": "auto"` through the real binary on a fake node with a fake
//! `modules.alias`: `status` and `bind --dry-run` show each device's chosen driver
//! with the alias line that chose it, the variant's module is loaded from
//! `modules.dep`, and misplaced or misspelt `auto` is a config error (exit 2, nothing
//! touched).

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Output;

mod common;

use sysfs_pci::module::kernel_release;
use sysfs_pci::testing::{FakeDevice, FakeNode};

const LIST: &str = r#"{"resources": [
    {"name": "nvidia.com/GPU", "vendor": "10de", "driver": "auto"},
    {"name": "example.com/NIC_PT", "vendor": "8086", "devices": ["10d3"], "driver": "auto"}
]}"#;

/// Two matches for the Grace GPU (its own alias beats vfio-pci's catch-all); none for
/// the NIC (no catch-all in this file).
const ALIASES: &str = "\
alias pci:v000010DEd00002342sv*sd*bc03sc*i* nvidia
alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci
alias vfio_pci:v000010DEd*sv*sd*bc*sc*i* nvidia_any_vfio_pci
";

fn node(dir: &Path) -> FakeNode {
    let node = FakeNode::new(dir);
    node.add_driver("vfio-pci");
    node.add_module("vfio");
    node.add_module("vfio_iommu_type1");
    node.add_module("vfio_pci");
    node.add_module("vfio_pci_core");
    node.add_device(
        &FakeDevice::new("0000:01:00.0", 0x10de, 0x2342, 0x03_0200)
            .driver("nvidia")
            .group(4),
    );
    node.add_device(
        &FakeDevice::new("0000:02:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("e1000e")
            .group(5),
    );
    let release = kernel_release();
    node.add_modules_alias(&release, ALIASES);
    node.add_modules_dep(
        &release,
        "kernel/drivers/vfio/pci/nvgrace-gpu/nvgrace-gpu-vfio-pci.ko.xz: kernel/drivers/vfio/pci/vfio-pci-core.ko.xz\n\
         kernel/drivers/vfio/pci/vfio-pci-core.ko.xz:\n",
    );
    std::fs::write(dir.join("list.json"), LIST).unwrap();
    node
}

fn run(dir: &Path, args: &[&str]) -> Output {
    common::command(dir).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn alias_file(dir: &Path) -> String {
    dir.join("lib/modules")
        .join(kernel_release())
        .join("modules.alias")
        .display()
        .to_string()
}

#[test]
fn status_shows_each_choice_and_the_alias_line_behind_it() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let out = run(dir.path(), &["status"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("nvidia (want nvgrace_gpu_vfio_pci)"), "{t}");
    assert!(
        t.contains(&format!(
            "driver for 0000:01:00.0: nvgrace_gpu_vfio_pci (auto: {} line 2: \
             alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci)",
            alias_file(dir.path())
        )),
        "{t}"
    );
    assert!(
        t.contains("driver for 0000:02:00.0: vfio-pci (auto: no vfio_pci alias matched, fallback)"),
        "{t}"
    );

    let out = run(dir.path(), &["status", "--output", "json"]);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let gpu = &doc["devices"][0];
    assert_eq!(gpu["target_driver"], "nvgrace_gpu_vfio_pci");
    assert_eq!(gpu["driver_choice"]["alias"]["line"], 2);
    assert_eq!(
        gpu["driver_choice"]["alias"]["module"],
        "nvgrace_gpu_vfio_pci"
    );
    assert_eq!(
        gpu["driver_choice"]["modalias"],
        "pci:v000010DEd00002342sv000010DEsd00000000bc03sc02i00"
    );
    let nic = &doc["devices"][1];
    assert_eq!(nic["target_driver"], "vfio-pci");
    assert_eq!(
        nic["driver_choice"]["fallback"],
        "no vfio_pci alias matched, fallback"
    );
}

#[test]
fn a_dry_run_shows_the_choice_and_loads_the_variant_module() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let out = run(dir.path(), &["bind", "--all", "--dry-run"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let sys = dir.path().join("sys").display().to_string();
    let modules = dir.path().join("lib/modules").join(kernel_release());
    for line in [
        "driver for 0000:01:00.0: nvgrace_gpu_vfio_pci (auto: ".to_owned(),
        "driver for 0000:02:00.0: vfio-pci (auto: no vfio_pci alias matched, fallback)".to_owned(),
        format!(
            "would load module nvgrace_gpu_vfio_pci from {}",
            modules
                .join("kernel/drivers/vfio/pci/nvgrace-gpu/nvgrace-gpu-vfio-pci.ko.xz")
                .display()
        ),
        format!(
            "would write nvgrace_gpu_vfio_pci to \
                {sys}/bus/pci/devices/0000:01:00.0/driver_override"
        ),
        format!("would write vfio-pci to {sys}/bus/pci/devices/0000:02:00.0/driver_override"),
    ] {
        assert!(t.contains(&line), "missing {line:?} in\n{t}");
    }
}

#[test]
fn misplaced_or_misspelt_auto_exits_2_and_touches_nothing() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    for (list, why) in [
        (
            r#"{"preset": "rebellions", "driver": "auto"}"#,
            "unknown key \"driver\": a driver (\"auto\" included) belongs in an entry",
        ),
        (
            r#"{"resources": [{"name": "nvidia.com/GPU", "vendor": "10de", "driver": "Auto"}]}"#,
            "resources[0] (nvidia.com/GPU): driver: \"Auto\" is not a vfio driver",
        ),
        (
            r#"{"preset": "rebellions", "naming": "pci_ids"}"#,
            "naming: unknown naming \"pci_ids\" (expected \"seed\" or \"pci-ids\")",
        ),
    ] {
        std::fs::write(dir.path().join("list.json"), list).unwrap();
        for args in [&["status"][..], &["bind", "--all"]] {
            let out = run(dir.path(), args);
            let t = text(&out);
            assert_eq!(out.status.code(), Some(2), "{list} {args:?}: {t}");
            assert!(t.contains(why), "{t}");
        }
    }
    assert!(!dir.path().join("run/state.json").exists());
    assert_eq!(
        std::fs::read_to_string(
            dir.path()
                .join("sys/bus/pci/devices/0000:01:00.0/driver_override")
        )
        .unwrap(),
        "(null)\n"
    );
}
