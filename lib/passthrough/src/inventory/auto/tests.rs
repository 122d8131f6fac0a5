//! `"driver": "auto"` on a fake node with fake `modules.alias` files: competing
//! aliases, no match, no file, junk, and the module of the choice being loaded.

use super::super::*;
use sysfs_pci::module::kernel_release;
use sysfs_pci::testing::{FakeDevice, FakeNode};

/// A Grace GPU (its own variant alias), another NVIDIA GPU (only the class alias),
/// a Rebellions NPU (only the catch-all), and an Intel NIC selected with a named
/// driver.
fn node(dir: &std::path::Path) -> FakeNode {
    let node = FakeNode::new(dir);
    node.add_device(&FakeDevice::new("0000:01:00.0", 0x10de, 0x2342, 0x03_0200).group(1));
    node.add_device(&FakeDevice::new("0000:02:00.0", 0x10de, 0x26b9, 0x03_0000).group(2));
    node.add_device(&FakeDevice::new("0000:03:00.0", 0x1eff, 0x1250, 0x12_0000).group(3));
    node.add_device(&FakeDevice::new("0000:04:00.0", 0x8086, 0x10d3, 0x02_0000).group(4));
    node
}

const LIST: &str = r#"{"resources": [
    {"name": "nvidia.com/GPU", "vendor": "10de", "driver": "auto"},
    {"name": "rebellions.ai/NPU", "vendor": "1eff", "driver": "auto"},
    {"name": "example.com/NIC_PT", "vendor": "8086", "driver": "vfio-pci"}
]}"#;

/// Competing aliases: the catch-all (7 `*`), one for any NVIDIA device (6) and two
/// device aliases for 2342 (5 each) (the first of equals wins), in the order a
/// modules.alias lists modules (alphabetically by module path).
const ALIASES: &str = "\
alias pci:v000010DEd*sv*sd*bc03sc*i* nouveau
alias vfio_pci:v000010DEd*sv*sd*bc*sc*i* nvidia_any_vfio_pci
alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci
alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* other_grace_vfio_pci
alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci
";

fn scan(node: &FakeNode) -> Inventory {
    Inventory::scan(&node.host, &ResourceList::parse(LIST).unwrap()).unwrap()
}

fn choice<'a>(inv: &'a Inventory, bdf: &str) -> (&'a str, Option<&'a DriverChoice>) {
    let e = inv.get(&bdf.parse().unwrap()).unwrap();
    (e.target_driver.as_str(), e.driver_choice.as_ref())
}

#[test]
fn each_device_gets_its_most_specific_alias() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    node.add_modules_alias(&kernel_release(), ALIASES);
    let inv = scan(&node);

    let (driver, why) = choice(&inv, "0000:01:00.0");
    assert_eq!(driver, "nvgrace_gpu_vfio_pci");
    let why = why.unwrap();
    assert_eq!(
        why.alias.as_ref().unwrap().line,
        3,
        "the first of two equal aliases"
    );
    assert_eq!(
        why.modalias.as_deref(),
        Some("pci:v000010DEd00002342sv000010DEsd00000000bc03sc02i00")
    );
    let shown = why.to_string();
    assert!(
        shown.starts_with("nvgrace_gpu_vfio_pci (auto: ")
            && shown.ends_with(
                "modules.alias line 3: alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* \
                    nvgrace_gpu_vfio_pci)"
            ),
        "{shown}"
    );

    assert_eq!(choice(&inv, "0000:02:00.0").0, "nvidia_any_vfio_pci");
    let (driver, why) = choice(&inv, "0000:03:00.0");
    assert_eq!(
        driver, "vfio-pci",
        "vfio_pci's catch-all is the driver vfio-pci"
    );
    assert_eq!(why.unwrap().alias.as_ref().unwrap().module, "vfio_pci");
    let (driver, why) = choice(&inv, "0000:04:00.0");
    assert_eq!(
        (driver, why),
        ("vfio-pci", None),
        "a named driver is not chosen"
    );
    assert_eq!(
        crate::engine::target_drivers(&inv, &[]),
        ["nvgrace_gpu_vfio_pci", "nvidia_any_vfio_pci", "vfio-pci"]
    );
}

#[test]
fn no_match_falls_back_to_vfio_pci_and_says_so() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    // No catch-all: an old or stripped modules.alias.
    node.add_modules_alias(
        &kernel_release(),
        "alias vfio_pci:v000015B3d0000101Esv*sd*bc*sc*i* mlx5_vfio_pci\n",
    );
    let inv = scan(&node);
    let (driver, why) = choice(&inv, "0000:03:00.0");
    assert_eq!(driver, "vfio-pci");
    assert_eq!(
        why.unwrap().to_string(),
        "vfio-pci (auto: no vfio_pci alias matched, fallback)"
    );
}

#[test]
fn without_modules_alias_a_vfio_bound_device_keeps_its_driver() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = FakeNode::new(dir.path());
    node.add_device(
        &FakeDevice::new("0000:01:00.0", 0x10de, 0x2342, 0x03_0200)
            .driver("nvgrace_gpu_vfio_pci")
            .group(1),
    );
    node.add_device(
        &FakeDevice::new("0000:02:00.0", 0x10de, 0x26b9, 0x03_0000)
            .driver("nvidia")
            .group(2),
    );
    let inv = scan(&node);
    let (driver, why) = choice(&inv, "0000:01:00.0");
    assert_eq!(driver, "nvgrace_gpu_vfio_pci");
    let shown = why.unwrap().to_string();
    assert!(
        shown.contains("cannot read ")
            && shown.contains("modules.alias: No such file or directory")
            && shown.ends_with("keeping the vfio driver it is on)"),
        "{shown}"
    );
    assert!(inv
        .get(&"0000:01:00.0".parse().unwrap())
        .unwrap()
        .is_bound());
    let (driver, why) = choice(&inv, "0000:02:00.0");
    assert_eq!(driver, "vfio-pci");
    assert!(why.unwrap().to_string().ends_with("; fallback)"));
}

#[test]
fn a_junk_alias_file_is_no_reason_to_fail() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    let mut junk = String::from("alias vfio_pci:\u{0} \n\n\t\talias\n");
    junk.push_str(&"x".repeat(1 << 20));
    junk.push_str("\nalias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* ahci\n");
    junk.push_str("alias vfio_pci:[[[[[[ vfio_pci\n");
    node.add_modules_alias(&kernel_release(), &junk);
    let inv = scan(&node);
    for bdf in ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"] {
        let (driver, why) = choice(&inv, bdf);
        assert_eq!(driver, "vfio-pci", "{bdf}");
        assert!(why.unwrap().fallback.is_some(), "{bdf}");
    }
    assert!(inv.skipped.is_empty());
}

#[test]
fn the_chosen_variant_module_is_loaded_through_modules_dep() {
    use sysfs_pci::testing::FakeKernel;
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    let release = kernel_release();
    node.add_modules_alias(&release, ALIASES);
    node.add_modules_dep(
        &release,
        "kernel/drivers/vfio/pci/nvgrace-gpu/nvgrace-gpu-vfio-pci.ko.xz: kernel/drivers/vfio/pci/vfio-pci-core.ko.xz kernel/drivers/vfio/vfio.ko.xz\n\
         kernel/drivers/vfio/pci/vfio-pci-core.ko.xz: kernel/drivers/vfio/vfio.ko.xz\n\
         kernel/drivers/vfio/vfio.ko.xz:\n\
         kernel/drivers/vfio/vfio_iommu_type1.ko.xz: kernel/drivers/vfio/vfio.ko.xz\n\
         kernel/drivers/vfio/pci/vfio-pci.ko.xz: kernel/drivers/vfio/pci/vfio-pci-core.ko.xz kernel/drivers/vfio/vfio.ko.xz\n",
    );
    let only_grace = r#"{"resources": [{"name": "nvidia.com/GPU", "vendor": "10de", "devices": ["2342"], "driver": "auto"}]}"#;
    let inv = Inventory::scan(&node.host, &ResourceList::parse(only_grace).unwrap()).unwrap();
    let drivers = crate::engine::target_drivers(&inv, &[]);
    assert_eq!(drivers, ["nvgrace_gpu_vfio_pci"]);
    let kernel = FakeKernel::new(&node);
    kernel
        .module_drivers
        .lock()
        .unwrap()
        .insert("nvgrace_gpu_vfio_pci".into(), "nvgrace_gpu_vfio_pci".into());
    let mut state: crate::state::StateFile = crate::state::StateFile::load(
        &dir.path().join("run/state.json"),
        true,
        &const { crate::owner::Program::named("vfio-manager") },
    )
    .unwrap();
    let pt = crate::Passthrough {
        host: &node.host,
        kernel: &kernel,
        state: &mut state,
        release,
    };
    let loaded = pt.load_modules(&drivers).unwrap();
    let at = |m: &str| loaded.iter().position(|l| l == m);
    assert!(at("nvgrace_gpu_vfio_pci").is_some(), "{loaded:?}");
    assert!(
        at("vfio_pci_core") < at("nvgrace_gpu_vfio_pci"),
        "dependencies first: {loaded:?}"
    );
    assert!(node.host.driver_dir("nvgrace_gpu_vfio_pci").exists());
}
