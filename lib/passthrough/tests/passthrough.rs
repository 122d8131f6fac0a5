//! Whole-group bind and restore on a fake node whose kernel emulation follows the PCI
//! core's sysfs rules. The real-kernel scenarios in tests/vm cover the same paths on
//! Linux itself.
//!
//! One file on purpose: every test starts from the node built by
//! `bed()` (a card with a companion behind a bridge, a lone NIC) or `wide()`, and
//! checks one rule of the engine on it.

#![allow(clippy::unwrap_used)]

use passthrough::config::ResourceList;
use passthrough::inventory::Inventory;
use passthrough::state::StateFile;
use passthrough::Passthrough;
use support::error_chain;
use sysfs_pci::testing::{FakeDevice, FakeKernel, FakeNode, Fault, FaultKernel, Point};
use sysfs_pci::PciAddress;

const LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;

struct Bed {
    _dir: tempfile::TempDir,
    node: FakeNode,
    kernel: FakeKernel,
    state: StateFile,
    list: ResourceList,
}

fn a(s: &str) -> PciAddress {
    s.parse().unwrap()
}

/// A two-function card in group 4 (fn0 selected, fn1 an audio-like companion of
/// another id), a bridge in the same group, and a lone NIC in group 5.
fn bed() -> Bed {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = FakeNode::new(dir.path());
    node.add_driver("vfio-pci");
    node.add_device(
        &FakeDevice::new("0000:00:1c.0", 0x8086, 0x2922, 0x06_0400)
            .driver("pcieport")
            .group(4),
    );
    node.add_device(
        &FakeDevice::new("0000:01:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("e1000e")
            .group(4)
            .parent("0000:00:1c.0")
            .numa(0),
    );
    node.add_device(
        &FakeDevice::new("0000:01:00.1", 0x8086, 0x1234, 0x04_0300)
            .driver("snd_hda_intel")
            .group(4)
            .parent("0000:00:1c.0"),
    );
    node.add_device(
        &FakeDevice::new("0000:02:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("e1000e")
            .group(5),
    );
    let kernel = FakeKernel::new(&node);
    kernel.learn_native_drivers();
    let state = StateFile::load(
        &dir.path().join("run/state.json"),
        true,
        &const { passthrough::owner::Program::named("vfio-manager") },
    )
    .unwrap();
    Bed {
        list: ResourceList::parse(LIST).unwrap(),
        _dir: dir,
        node,
        kernel,
        state,
    }
}

impl Bed {
    fn pt(&mut self) -> Passthrough<'_> {
        Passthrough {
            host: &self.node.host,
            kernel: &self.kernel,
            state: &mut self.state,
            release: "6.1.0-test".into(),
        }
    }
    fn inv(&self) -> Inventory {
        Inventory::scan(&self.node.host, &self.list).unwrap()
    }
    fn driver(&self, s: &str) -> Option<String> {
        self.node.driver_of(&a(s))
    }
    /// e1000e as a loadable module that registers the e1000e driver.
    fn e1000e_module(&self) {
        self.node
            .add_modules_dep("6.1.0-test", "kernel/e1000e.ko:\n");
        self.kernel
            .module_drivers
            .lock()
            .unwrap()
            .insert("e1000e".into(), "e1000e".into());
    }
}

#[test]
fn inventory_finds_selected_companions_and_bridges() {
    let b = bed();
    let inv = b.inv();
    let roles: Vec<String> = inv
        .entries
        .iter()
        .map(|e| {
            format!(
                "{} {}",
                e.device.address,
                serde_json::to_value(&e.role).unwrap()["kind"]
            )
        })
        .collect();
    assert_eq!(
        roles,
        [
            "0000:00:1c.0 \"bridge\"",
            "0000:01:00.0 \"selected\"",
            "0000:01:00.1 \"companion\"",
            "0000:02:00.0 \"selected\"",
        ]
    );
    assert!(!inv.groups[&4].is_viable());
    assert_eq!(
        inv.get(&a("0000:01:00.0")).unwrap().device.upstream,
        [a("0000:00:1c.0")]
    );
}

#[test]
fn bind_moves_the_whole_group_but_not_the_bridge() {
    let mut b = bed();
    let inv = b.inv();
    let report = b.pt().bind(&inv, &[]);
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(b.driver("0000:01:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(b.driver("0000:01:00.1").as_deref(), Some("vfio-pci"));
    assert_eq!(b.driver("0000:02:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(b.driver("0000:00:1c.0").as_deref(), Some("pcieport"));
    assert!(b.inv().groups.values().all(|v| v.is_viable()));
    let rec = &b.state.state().devices;
    assert_eq!(rec.len(), 3);
    assert_eq!(
        rec[&a("0000:01:00.1")].original_driver.as_deref(),
        Some("snd_hda_intel")
    );
    // Idempotent: a second bind writes nothing.
    b.kernel.writes.lock().unwrap().clear();
    let inv = b.inv();
    let again = b.pt().bind(&inv, &[]);
    assert!(again.bound.is_empty() && again.failed.is_empty());
    assert_eq!(again.already.len(), 3);
    assert!(
        b.kernel.write_log().is_empty(),
        "{:?}",
        b.kernel.write_log()
    );
}

#[test]
fn failure_in_a_group_puts_every_member_back() {
    let mut b = bed();
    // The companion's unbind fails after the selected function already moved.
    *b.kernel.fail_on.lock().unwrap() = Some(("0000:01:00.1/driver/unbind".into(), 16));
    let inv = b.inv();
    let report = b.pt().bind(&inv, &[]);
    assert_eq!(report.failed.len(), 1);
    let msg = error_chain(&report.failed[0]);
    assert!(
        msg.contains("IOMMU group 4") && msg.contains("0000:01:00.1"),
        "{msg}"
    );
    assert!(msg.contains("Device or resource busy"), "{msg}");
    assert_eq!(
        b.driver("0000:01:00.0").as_deref(),
        Some("e1000e"),
        "rolled back"
    );
    assert_eq!(
        b.driver("0000:01:00.1").as_deref(),
        Some("snd_hda_intel"),
        "rolled back"
    );
    // The other group is unaffected and bound.
    assert_eq!(b.driver("0000:02:00.0").as_deref(), Some("vfio-pci"));
    let recorded: Vec<_> = b
        .state
        .state()
        .devices
        .keys()
        .map(|k| k.to_string())
        .collect();
    assert_eq!(recorded, ["0000:02:00.0"]);
}

#[test]
fn a_pf_with_vfs_enabled_is_refused_before_any_write() {
    let mut b = bed();
    b.node.add_device(
        &FakeDevice::new("0000:03:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("e1000e")
            .group(6)
            .sriov(4, 2),
    );
    let inv = b.inv();
    let report = b.pt().bind(&inv, &[6]);
    let msg = error_chain(&report.failed[0]);
    assert!(
        msg.contains("0000:03:00.0") && msg.contains("2 VFs enabled"),
        "{msg}"
    );
    assert!(b.kernel.write_log().is_empty());
    assert!(b.state.state().devices.is_empty());
}

#[test]
fn restore_puts_back_original_drivers_and_empties_the_record() {
    let mut b = bed();
    let inv = b.inv();
    b.pt().bind(&inv, &[]);
    let report = b.pt().restore(&[]);
    assert!(
        report.failed.is_empty() && report.in_use.is_empty(),
        "{report:?}"
    );
    assert_eq!(report.restored.len(), 3);
    assert_eq!(b.driver("0000:01:00.0").as_deref(), Some("e1000e"));
    assert_eq!(b.driver("0000:01:00.1").as_deref(), Some("snd_hda_intel"));
    assert!(b.state.state().devices.is_empty());
    let on_disk: StateFile = StateFile::load(
        b.state.path(),
        false,
        &const { passthrough::owner::Program::named("vfio-manager") },
    )
    .unwrap();
    assert!(on_disk.state().devices.is_empty());
}

#[test]
fn restore_skips_a_group_a_vm_holds_and_keeps_its_records() {
    let mut b = bed();
    let inv = b.inv();
    b.pt().bind(&inv, &[]);
    let node4 = b.node.host.vfio_group_node(4);
    b.kernel.busy_groups.lock().unwrap().insert(node4);
    b.kernel.writes.lock().unwrap().clear();
    let report = b.pt().restore(&[]);
    let skipped: Vec<_> = report
        .in_use
        .iter()
        .map(|(a, g)| format!("{a}@{g}"))
        .collect();
    assert_eq!(skipped, ["0000:01:00.0@4", "0000:01:00.1@4"]);
    assert_eq!(
        b.driver("0000:01:00.0").as_deref(),
        Some("vfio-pci"),
        "not touched"
    );
    assert!(
        b.kernel
            .write_log()
            .iter()
            .all(|w| !w.contains("0000:01:00.")),
        "{:?}",
        b.kernel.write_log()
    );
    assert_eq!(b.driver("0000:02:00.0").as_deref(), Some("e1000e"));
    assert_eq!(b.state.state().devices.len(), 2);
    // Once the VM lets go, a second restore finishes the job.
    b.kernel.busy_groups.lock().unwrap().clear();
    let report = b.pt().restore(&[]);
    assert_eq!(report.restored.len(), 2);
    assert!(b.state.state().devices.is_empty());
}

/// A group whose node cannot be opened (a device cgroup refuses it: EPERM) may be
/// a VM's: it is not restored, its records stay, and the failure names the
/// group, its members and the cause.
#[test]
fn restore_keeps_a_group_it_cannot_probe() {
    let mut b = bed();
    let inv = b.inv();
    b.pt().bind(&inv, &[]);
    let node4 = b.node.host.vfio_group_node(4);
    b.kernel.unprobeable_groups.lock().unwrap().insert(node4);
    let report = b.pt().restore(&[]);
    assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
    let text = support::error_chain(&report.failed[0]);
    assert!(
        text.contains("IOMMU group 4 not restored: cannot tell whether a VM holds it")
            && text.contains("0000:01:00.0, 0000:01:00.1 stay on their vfio driver")
            && text.contains("/dev/vfio/4")
            && text.contains("Operation not permitted"),
        "{text}"
    );
    assert_eq!(b.driver("0000:01:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(b.driver("0000:01:00.1").as_deref(), Some("vfio-pci"));
    assert_eq!(b.driver("0000:02:00.0").as_deref(), Some("e1000e"));
    assert_eq!(b.state.state().devices.len(), 2);
    b.kernel.unprobeable_groups.lock().unwrap().clear();
    let report = b.pt().restore(&[]);
    assert_eq!(report.restored.len(), 2);
    assert!(b.state.state().devices.is_empty());
}

#[test]
fn a_crash_between_unbind_and_probe_still_converges_and_restores() {
    let mut b = bed();
    let nic = a("0000:02:00.0");
    let path = b.state.path().to_owned();
    // What a kill -9 right after `driver/unbind` leaves: the record (written first),
    // the override, and a device on no driver.
    b.state
        .record(
            &b.kernel,
            nic,
            passthrough::state::Record {
                original_driver: Some("e1000e".into()),
                original_override: None,
                driver: "vfio-pci".into(),
                role: passthrough::state::RecordedRole::Selected,
                resource: Some("example.com/NIC_PT".into()),
                group: 5,
            },
        )
        .unwrap();
    let dir = b.node.host.device_dir(&nic);
    std::fs::write(dir.join("driver_override"), "vfio-pci\n").unwrap();
    b.node.detach(&nic);
    // The dead process's lock is gone with it; a new one loads the file.
    b.state = StateFile::load(
        &path,
        false,
        &const { passthrough::owner::Program::named("vfio-manager") },
    )
    .unwrap();
    b.state = StateFile::load(
        &path,
        true,
        &const { passthrough::owner::Program::named("vfio-manager") },
    )
    .unwrap();
    let inv = b.inv();
    let report = b.pt().bind(&inv, &[5]);
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(b.driver("0000:02:00.0").as_deref(), Some("vfio-pci"));
    let rec = &b.state.state().devices[&nic];
    assert_eq!(
        rec.original_driver.as_deref(),
        Some("e1000e"),
        "first record kept"
    );
    let report = b.pt().restore(&[]);
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(b.driver("0000:02:00.0").as_deref(), Some("e1000e"));
}

#[test]
fn unloaded_native_module_is_reloaded_on_restore() {
    let mut b = bed();
    b.e1000e_module();
    let inv = b.inv();
    b.pt().pin_overrides(&inv, &[5]).unwrap();
    let unloaded = b.pt().unload_modules(&["e1000e".into()]).unwrap();
    assert_eq!(unloaded, ["e1000e"]);
    assert_eq!(
        b.driver("0000:02:00.0"),
        None,
        "override kept it from re-probing"
    );
    let report = b.pt().bind(&inv, &[5]);
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(b.driver("0000:02:00.0").as_deref(), Some("vfio-pci"));
    assert_eq!(b.state.state().unloaded_modules, ["e1000e"]);
    let report = b.pt().restore(&[]);
    assert_eq!(report.reloaded, ["e1000e"]);
    assert_eq!(b.driver("0000:02:00.0").as_deref(), Some("e1000e"));
    assert!(b.state.state().unloaded_modules.is_empty());
}

#[test]
fn a_module_that_was_not_loaded_is_not_recorded_for_reload() {
    let mut b = bed();
    let unloaded = b.pt().unload_modules(&["rebellions".into()]).unwrap();
    assert!(unloaded.is_empty());
    assert!(b.state.state().unloaded_modules.is_empty());
}

#[test]
fn vfio_modules_load_dependencies_first() {
    let mut b = bed();
    std::fs::remove_dir_all(b.node.host.driver_dir("vfio-pci")).unwrap();
    std::fs::remove_dir_all(b.node.host.module_dir("vfio_pci")).unwrap();
    b.node.add_modules_dep(
        "6.1.0-test",
        "kernel/vfio-pci.ko: kernel/vfio-pci-core.ko \
            kernel/vfio.ko\nkernel/vfio-pci-core.ko: \
            kernel/vfio.ko\nkernel/vfio.ko:\nkernel/vfio_iommu_type1.ko: \
            kernel/vfio.ko\n",
    );
    b.kernel
        .module_drivers
        .lock()
        .unwrap()
        .insert("vfio_pci".into(), "vfio-pci".into());
    let loaded = b.pt().load_modules(&["vfio-pci".into()]).unwrap();
    assert_eq!(
        loaded,
        ["vfio", "vfio_iommu_type1", "vfio_pci_core", "vfio_pci"]
    );
    assert!(
        b.pt()
            .load_modules(&["vfio-pci".into()])
            .unwrap()
            .is_empty(),
        "idempotent"
    );
}

/// Invariant: rollback restores to the record, not to a snapshot. After
/// `--unload-module e1000e` a device is driverless with a pinned override; a probe
/// that fails once must not teach the record "no driver".
#[test]
fn rollback_restores_to_the_record_not_the_snapshot() {
    let mut b = bed();
    b.e1000e_module();
    let inv = b.inv();
    b.pt().pin_overrides(&inv, &[5]).unwrap();
    b.pt().unload_modules(&["e1000e".into()]).unwrap();
    *b.kernel.fail_on.lock().unwrap() = Some(("drivers_probe".into(), 22));
    let inv = b.inv();
    let report = b.pt().bind(&inv, &[5]);
    assert_eq!(report.failed.len(), 1);
    let rec = &b.state.state().devices[&a("0000:02:00.0")];
    assert_eq!(
        rec.original_driver.as_deref(),
        Some("e1000e"),
        "record kept"
    );
    // The retry binds; SIGTERM brings it home, not to "no driver".
    let inv = b.inv();
    let report = b.pt().bind(&inv, &[5]);
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    let report = b.pt().restore(&[]);
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(b.driver("0000:02:00.0").as_deref(), Some("e1000e"));
}

/// Invariant: every partially-applied group operation is rolled back, and the error
/// names the devices put back. Here the state save for the group's second member
/// fails (a full /run) after the first member moved.
#[test]
fn a_failed_save_mid_group_puts_the_group_back_and_says_so() {
    let mut b = bed();
    let inv = b.inv();
    let kernel = FaultKernel::at_nth(&b.kernel, Point::Save, 1, Fault::Fail);
    let report = Passthrough {
        host: &b.node.host,
        kernel: &kernel,
        state: &mut b.state,
        release: "6.1.0-test".into(),
    }
    .bind(&inv, &[4]);
    let msg = error_chain(&report.failed[0]);
    assert!(
        msg.contains("IOMMU group 4 not bound (put back 0000:01:00.0)"),
        "{msg}"
    );
    assert!(msg.contains("No space left on device"), "{msg}");
    assert_eq!(b.driver("0000:01:00.0").as_deref(), Some("e1000e"));
    assert_eq!(b.driver("0000:01:00.1").as_deref(), Some("snd_hda_intel"));
    assert!(b.state.state().devices.is_empty());
}

/// Six NICs on e1000e, each alone in its IOMMU group (11..=16), and a two-function
/// card in group 20 (a selected NIC and an audio companion), on a fake kernel whose
/// every unbind and probe takes `latency`.
fn wide(latency: std::time::Duration) -> Bed {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = FakeNode::new(dir.path());
    node.add_driver("vfio-pci");
    for (i, group) in (11..=16).enumerate() {
        node.add_device(
            &FakeDevice::new(&format!("0000:0{}:00.0", i + 1), 0x8086, 0x10d3, 0x02_0000)
                .driver("e1000e")
                .group(group),
        );
    }
    node.add_device(
        &FakeDevice::new("0000:07:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("e1000e")
            .group(20),
    );
    node.add_device(
        &FakeDevice::new("0000:07:00.1", 0x8086, 0x1234, 0x04_0300)
            .driver("snd_hda_intel")
            .group(20),
    );
    let kernel = FakeKernel::new(&node).with_latency(latency);
    kernel.learn_native_drivers();
    let state = StateFile::load(
        &dir.path().join("run/state.json"),
        true,
        &const { passthrough::owner::Program::named("vfio-manager") },
    )
    .unwrap();
    Bed {
        list: ResourceList::parse(LIST).unwrap(),
        _dir: dir,
        node,
        kernel,
        state,
    }
}

const WIDE: [&str; 8] = [
    "0000:01:00.0",
    "0000:02:00.0",
    "0000:03:00.0",
    "0000:04:00.0",
    "0000:05:00.0",
    "0000:06:00.0",
    "0000:07:00.0",
    "0000:07:00.1",
];

fn jobs(n: usize) -> std::num::NonZeroUsize {
    std::num::NonZeroUsize::new(n).unwrap()
}

impl Bed {
    /// The records on disk, which must equal those in memory.
    fn records_on_disk(&self) -> Vec<PciAddress> {
        let disk = StateFile::load(
            self.state.path(),
            false,
            &const { passthrough::owner::Program::named("vfio-manager") },
        )
        .unwrap();
        assert_eq!(
            disk.state(),
            self.state.state(),
            "memory never claims more (or less) than the disk holds"
        );
        disk.state().devices.keys().copied().collect()
    }
}

/// With several jobs the groups' probes overlap, and the outcome — report, node,
/// records, the writes each device saw — is the one-at-a-time outcome.
#[test]
fn binding_groups_concurrently_overlaps_their_probes_and_reports_as_one_at_a_time() {
    let latency = std::time::Duration::from_millis(50);
    let mut outcomes = Vec::new();
    for n in [1, 4] {
        let mut b = wide(latency);
        let inv = b.inv();
        let report = b.pt().bind_concurrent(&inv, &[], jobs(n));
        assert!(report.failed.is_empty(), "{:?}", report.failed);
        for d in WIDE {
            assert_eq!(b.driver(d).as_deref(), Some("vfio-pci"), "{d}");
        }
        let overlap = b.kernel.max_concurrent_probes();
        if n == 1 {
            assert_eq!(overlap, 1, "one at a time");
        } else {
            assert!(overlap >= 2, "the groups' probes never overlapped");
        }
        let mut writes = b.kernel.write_log();
        writes.sort();
        outcomes.push((
            format!("{:?} {:?}", report.bound, report.already),
            b.records_on_disk(),
            writes,
        ));
    }
    assert_eq!(outcomes[0], outcomes[1]);
    // Members of a group still move in order: the selected NIC before its companion.
    let b = {
        let mut b = wide(std::time::Duration::ZERO);
        let inv = b.inv();
        b.pt().bind_concurrent(&inv, &[20], jobs(4));
        b
    };
    let log = b.kernel.write_log();
    let first = |d: &str| log.iter().position(|w| w.contains(d)).unwrap();
    assert!(first("0000:07:00.0") < first("0000:07:00.1"), "{log:?}");
}

/// A failed state save stops and rolls back only its own group; the other groups,
/// in flight or waiting, finish, and every save still holds every record before it.
#[test]
fn a_failed_save_while_binding_concurrently_stops_only_its_group() {
    // 8 records made, one save each: fail each in turn.
    for n in 0..8 {
        let mut b = wide(std::time::Duration::from_millis(2));
        let inv = b.inv();
        let kernel = FaultKernel::at_nth(&b.kernel, Point::Save, n, Fault::Fail);
        let report = Passthrough {
            host: &b.node.host,
            kernel: &kernel,
            state: &mut b.state,
            release: "6.1.0-test".into(),
        }
        .bind_concurrent(&inv, &[], jobs(4));
        assert_eq!(report.failed.len(), 1, "save #{n}: {:?}", report.failed);
        let msg = error_chain(&report.failed[0]);
        assert!(msg.contains("No space left on device"), "{msg}");
        let on_vfio: Vec<PciAddress> = WIDE
            .iter()
            .map(|d| a(d))
            .filter(|d| b.node.driver_of(d).as_deref() == Some("vfio-pci"))
            .collect();
        // Six groups bound, one not: 7 or 6 devices moved (group 20 has two).
        assert!(matches!(on_vfio.len(), 6 | 7), "save #{n}: {on_vfio:?}");
        assert_eq!(b.records_on_disk(), on_vfio, "save #{n}");
    }
}

/// A crash on one thread stops every thread at its next step and reaches the caller
/// as the crash; every device moved is recorded on disk, and a restore puts all back.
#[test]
fn a_crash_while_binding_concurrently_reaches_the_caller_and_loses_nothing() {
    use sysfs_pci::testing::Crashed;
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !info.payload().is::<Crashed>() {
            default(info);
        }
    }));
    let points = {
        let mut b = wide(std::time::Duration::ZERO);
        let inv = b.inv();
        let counting = FaultKernel::new(&b.kernel, None);
        Passthrough {
            host: &b.node.host,
            kernel: &counting,
            state: &mut b.state,
            release: "6.1.0-test".into(),
        }
        .bind_concurrent(&inv, &[], jobs(4));
        counting.points().len()
    };
    assert!(points >= 8 * 4, "{points} points");
    for at in 0..points {
        let mut b = wide(std::time::Duration::from_millis(1));
        let inv = b.inv();
        let kernel = FaultKernel::new(&b.kernel, Some((at, Fault::Crash)));
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Passthrough {
                host: &b.node.host,
                kernel: &kernel,
                state: &mut b.state,
                release: "6.1.0-test".into(),
            }
            .bind_concurrent(&inv, &[], jobs(4))
        }));
        assert!(caught.unwrap_err().is::<Crashed>(), "point #{at}");
        let on_disk: StateFile = StateFile::load(
            b.state.path(),
            false,
            &const { passthrough::owner::Program::named("vfio-manager") },
        )
        .unwrap();
        for d in WIDE {
            let dir = b.node.host.device_dir(&a(d));
            let over = std::fs::read_to_string(dir.join("driver_override")).unwrap();
            let touched = b.driver(d).as_deref()
                != b.kernel
                    .native
                    .lock()
                    .unwrap()
                    .get(&a(d))
                    .map(String::as_str)
                || over.trim() != "(null)";
            assert!(
                !touched || on_disk.get(&a(d)).is_some(),
                "point #{at}: {d} was changed but not recorded"
            );
        }
        // The next process restores from the file alone.
        drop(b.state);
        b.state = StateFile::load(
            on_disk.path(),
            true,
            &const { passthrough::owner::Program::named("vfio-manager") },
        )
        .unwrap();
        let report = b.pt().restore(&[]);
        assert!(report.failed.is_empty(), "point #{at}: {:?}", report.failed);
        for d in WIDE {
            let native = b.kernel.native.lock().unwrap().get(&a(d)).cloned();
            assert_eq!(b.driver(d), native, "point #{at}: {d}");
        }
        assert!(b.records_on_disk().is_empty(), "point #{at}");
    }
}

/// A group whose bind failed is put back whole, but the save that drops one
/// member's record fails: every member is on its driver again, the record stays,
/// and the error says exactly that (not "half-bound").
#[test]
fn a_group_put_back_whose_record_cannot_be_dropped_says_what_is_true() {
    let mut b = bed();
    let inv = b.inv();
    // The companion's unbind fails, so the group is put back, newest first: the
    // companion's record is dropped by the third save (after the two records).
    *b.kernel.fail_on.lock().unwrap() = Some(("0000:01:00.1/driver/unbind".into(), 5));
    let kernel = FaultKernel::at_nth(&b.kernel, Point::Save, 2, Fault::Fail);
    let report = Passthrough {
        host: &b.node.host,
        kernel: &kernel,
        state: &mut b.state,
        release: "6.1.0-test".into(),
    }
    .bind(&inv, &[4]);
    let msg = error_chain(&report.failed[0]);
    assert!(
        matches!(
            &report.failed[0],
            passthrough::PassthroughError::RecordsKept { kept, .. }
                if kept.len() == 1 && kept[0].0.to_string() == "0000:01:00.1"
        ),
        "{msg}"
    );
    assert!(
        msg.starts_with(
            "IOMMU group 4 not bound (put back 0000:01:00.1, 0000:01:00.0); every member is \
             back on its driver, but the state file still records 0000:01:00.1"
        ),
        "{msg}"
    );
    assert!(!msg.contains("half"), "{msg}");
    assert_eq!(b.driver("0000:01:00.0").as_deref(), Some("e1000e"));
    assert_eq!(b.driver("0000:01:00.1").as_deref(), Some("snd_hda_intel"));
    let kept: Vec<String> = b
        .state
        .state()
        .devices
        .keys()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        kept,
        ["0000:01:00.1"],
        "the record stays for the next restore"
    );
    // The next restore finds it on its driver and drops the record.
    let restored = Passthrough {
        host: &b.node.host,
        kernel: &b.kernel,
        state: &mut b.state,
        release: "6.1.0-test".into(),
    }
    .restore(&[]);
    assert!(restored.failed.is_empty(), "{:?}", restored.failed);
    assert!(b.state.state().devices.is_empty());
    assert_eq!(b.driver("0000:01:00.1").as_deref(), Some("snd_hda_intel"));
}
