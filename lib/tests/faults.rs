//! Nothing is ever lost: a node's whole VM-mode life — `vfio-manager run
//! --unload-module e1000e` entering, converging, and restoring on SIGTERM — is
//! replayed once per injection point (every sysfs write, module syscall and state
//! save), failing that one step in a first pass and "crashing" the process right
//! before it in a second. After each, fresh processes do what an operator or the
//! DaemonSet would: in the crash pass a new `run` (which must converge the node) and
//! then `unbind --all`; in the fail pass `unbind --all`. Every device must end on its
//! original driver with its original `driver_override`, every module we unloaded must
//! be loaded again, and the state file must be empty.
//!
//! The node: 8 selected devices in 6 IOMMU groups — a two-function card behind a
//! bridge, a device whose group holds an unselected companion on another driver
//! (snd_hda_intel), one with an original `driver_override`, one with no driver —
//! on a fake kernel that applies writes as the PCI core does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use vfio_sandbox::config::ResourceList;
use vfio_sandbox::fake::{Crashed, FakeDevice, FakeKernel, FakeNode, Fault, FaultKernel, Point};
use vfio_sandbox::inventory::Inventory;
use vfio_sandbox::kernel::Kernel;
use vfio_sandbox::passthrough::{target_drivers, Passthrough};
use vfio_sandbox::state::StateFile;
use vfio_sandbox::{error_chain, PciAddress};

const LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;
const RELEASE: &str = "6.1.0-faults";
const UNLOAD: &str = "e1000e";
const SELECTED: [&str; 8] = [
    "0000:01:00.0",
    "0000:01:00.1",
    "0000:02:00.0",
    "0000:03:00.0",
    "0000:04:00.0",
    "0000:05:00.0",
    "0000:05:00.1",
    "0000:06:00.0",
];

/// What every device must look like at the end: (driver, driver_override).
type Snapshot = BTreeMap<String, (Option<String>, String)>;

struct Node {
    _dir: tempfile::TempDir,
    node: FakeNode,
    kernel: FakeKernel,
    state_path: PathBuf,
    list: ResourceList,
}

fn nic(addr: &str, group: u32) -> FakeDevice {
    FakeDevice::new(addr, 0x8086, 0x10d3, 0x02_0000).group(group)
}

fn node() -> Node {
    // Hundreds of small trees: on tmpfs when there is one (ext4 inode creation is slow).
    let shm = Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::tempdir_in(shm)
    } else {
        tempfile::tempdir()
    }
    .unwrap();
    let node = FakeNode::new(dir.path());
    node.add_device(
        &FakeDevice::new("0000:00:1c.0", 0x8086, 0x2922, 0x06_0400)
            .driver("pcieport")
            .group(1),
    );
    node.add_device(
        &nic("0000:01:00.0", 1)
            .driver("e1000e")
            .parent("0000:00:1c.0"),
    );
    node.add_device(
        &nic("0000:01:00.1", 1)
            .driver("e1000e")
            .parent("0000:00:1c.0"),
    );
    node.add_device(&nic("0000:02:00.0", 2).driver("e1000e"));
    node.add_device(
        &FakeDevice::new("0000:02:00.1", 0x8086, 0x293e, 0x04_0300)
            .driver("snd_hda_intel")
            .group(2),
    );
    node.add_device(&nic("0000:03:00.0", 3).driver("e1000e"));
    node.add_device(&nic("0000:04:00.0", 4));
    node.add_device(&nic("0000:05:00.0", 5).driver("e1000e"));
    node.add_device(&nic("0000:05:00.1", 5).driver("e1000e"));
    node.add_device(&nic("0000:06:00.0", 6).driver("e1000e"));
    // An operator pinned this one to its native driver long ago.
    let pinned = node.host.device_dir(&"0000:03:00.0".parse().unwrap());
    fs::write(pinned.join("driver_override"), "e1000e\n").unwrap();
    // The modules tree: vfio_pci and its dependencies, and e1000e to reload.
    let files = [
        (
            "kernel/drivers/vfio/pci/vfio-pci.ko",
            "kernel/drivers/vfio/vfio_iommu_type1.ko kernel/drivers/vfio/vfio.ko",
        ),
        (
            "kernel/drivers/vfio/vfio_iommu_type1.ko",
            "kernel/drivers/vfio/vfio.ko",
        ),
        ("kernel/drivers/vfio/vfio.ko", ""),
        ("kernel/drivers/net/ethernet/intel/e1000e/e1000e.ko", ""),
    ];
    let dep: String = files.iter().map(|(f, d)| format!("{f}: {d}\n")).collect();
    node.add_modules_dep(RELEASE, &dep);
    for (f, _) in files {
        let path = node.host.modules_release_dir(RELEASE).join(f);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, "").unwrap();
    }
    let kernel = FakeKernel::new(&node);
    kernel.learn_native_drivers();
    for (module, driver) in [("vfio_pci", "vfio-pci"), ("e1000e", "e1000e")] {
        kernel
            .module_drivers
            .borrow_mut()
            .insert(module.into(), driver.into());
    }
    Node {
        state_path: dir.path().join("run/vfio-manager/state.json"),
        _dir: dir,
        node,
        kernel,
        list: ResourceList::parse(LIST).unwrap(),
    }
}

impl Node {
    fn snapshot(&self) -> Snapshot {
        vfio_sandbox::device::list_addresses(&self.node.host)
            .unwrap()
            .into_iter()
            .map(|a| {
                let over =
                    fs::read_to_string(self.node.host.device_dir(&a).join("driver_override"));
                (a.to_string(), (self.node.driver_of(&a), over.unwrap()))
            })
            .collect()
    }

    /// One vfio-manager process: the state file locked for its lifetime.
    fn process<T>(
        &self,
        kernel: &dyn Kernel,
        f: impl FnOnce(&mut Passthrough<'_>) -> T,
    ) -> Result<T, String> {
        let mut state = StateFile::load(&self.state_path, true).map_err(|e| error_chain(&e))?;
        Ok(f(&mut Passthrough {
            host: &self.node.host,
            kernel,
            state: &mut state,
            release: RELEASE.into(),
        }))
    }

    /// `vfio-manager run --unload-module e1000e` up to its first converged pass, as
    /// the binary does it: scan, prepare, then scan and bind. `Err` when the binary
    /// would exit (its start-up failed); otherwise the bind failures it logs and
    /// retries.
    fn run_start(&self, pt: &mut Passthrough<'_>) -> Result<Vec<String>, String> {
        let inv = Inventory::scan(pt.host, &self.list).map_err(|e| error_chain(&e))?;
        pt.prepare(&inv, &[UNLOAD.into()])
            .map_err(|e| error_chain(&e))?;
        self.converge(pt)
    }

    /// One resync pass of `run`.
    fn converge(&self, pt: &mut Passthrough<'_>) -> Result<Vec<String>, String> {
        let inv = Inventory::scan(pt.host, &self.list).map_err(|e| error_chain(&e))?;
        if inv.entries.iter().all(|e| e.is_bound()) {
            return Ok(Vec::new());
        }
        pt.load_modules(&target_drivers(&inv, &[]))
            .map_err(|e| error_chain(&e))?;
        Ok(pt
            .bind(&inv, &[])
            .failed
            .iter()
            .map(|e| error_chain(e))
            .collect())
    }

    /// The whole life of one `run` process: start (exit if it fails), one resync,
    /// SIGTERM restore.
    fn life(&self, kernel: &dyn Kernel) {
        let _ = self.process(kernel, |pt| {
            if self.run_start(pt).is_ok() {
                let _ = self.converge(pt);
                pt.restore(&[]);
            }
        });
    }

    fn unbind_all(&self) {
        let report = self.process(&self.kernel, |pt| pt.restore(&[])).unwrap();
        assert!(report.in_use.is_empty());
    }

    fn all_selected_on_vfio(&self) -> Vec<String> {
        SELECTED
            .iter()
            .filter(|a| {
                self.node
                    .driver_of(&a.parse::<PciAddress>().unwrap())
                    .as_deref()
                    != Some("vfio-pci")
            })
            .map(|a| a.to_string())
            .collect()
    }

    /// Devices not back as they were, plus any leftover record or module note.
    fn lost(&self, before: &Snapshot) -> Vec<String> {
        let after = self.snapshot();
        let mut lost: Vec<String> = before
            .iter()
            .filter(|(a, was)| after.get(*a) != Some(was))
            .map(|(a, was)| format!("{a}: was {was:?}, now {:?}", after.get(a)))
            .collect();
        if !Path::new(&self.node.host.module_dir(UNLOAD)).exists() {
            lost.push(format!("module {UNLOAD} not reloaded"));
        }
        let state = StateFile::load(&self.state_path, false).unwrap();
        if !state.state().devices.is_empty() || !state.state().unloaded_modules.is_empty() {
            lost.push(format!("state file not empty: {:?}", state.state()));
        }
        lost
    }
}

/// Runs `f`, turning a simulated crash into `true`; any other panic propagates.
fn crashes(f: impl FnOnce()) -> bool {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(()) => false,
        Err(payload) if payload.is::<Crashed>() => true,
        Err(payload) => std::panic::resume_unwind(payload),
    }
}

fn quiet_crashes() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !info.payload().is::<Crashed>() {
            default(info);
        }
    }));
}

/// The points of one clean life, in order.
fn clean_points() -> Vec<(Point, String)> {
    let n = node();
    let before = n.snapshot();
    let counting = FaultKernel::new(&n.kernel, None);
    n.life(&counting);
    assert_eq!(
        n.lost(&before),
        Vec::<String>::new(),
        "a clean life loses nothing"
    );
    counting.points()
}

#[test]
fn every_fault_and_crash_point_leaves_nothing_lost() {
    quiet_crashes();
    let points = clean_points();
    let count = |k: Point| points.iter().filter(|(p, _)| *p == k).count();
    // Every kind is exercised: 9 devices pinned, moved and restored, 5 module syscalls.
    assert!(count(Point::Write) >= 27 && count(Point::Module) >= 5 && count(Point::Save) >= 18);
    let mut lost: Vec<String> = Vec::new();
    let mut crashed = 0;
    for (n_point, (_, what)) in points.iter().enumerate() {
        // Pass 1: the step fails; the process carries on as `run` does, then SIGTERM;
        // then a fresh `unbind --all`.
        let n = node();
        let before = n.snapshot();
        n.life(&FaultKernel::new(&n.kernel, Some((n_point, Fault::Fail))));
        n.unbind_all();
        lost.extend(
            n.lost(&before)
                .into_iter()
                .map(|l| format!("fail at #{n_point} ({what}): {l}")),
        );

        // Pass 2: the process dies right before the step; a new `run` converges the
        // node, is killed in turn, and `unbind --all` puts everything back.
        let n = node();
        let before = n.snapshot();
        if crashes(|| n.life(&FaultKernel::new(&n.kernel, Some((n_point, Fault::Crash))))) {
            crashed += 1;
        }
        match n.process(&n.kernel, |pt| n.run_start(pt)).unwrap() {
            Ok(failed) if failed.is_empty() => {}
            Ok(failed) => lost.push(format!(
                "crash at #{n_point} ({what}): the next run failed: {failed:?}"
            )),
            Err(e) => lost.push(format!(
                "crash at #{n_point} ({what}): the next run exited: {e}"
            )),
        }
        let unbound = n.all_selected_on_vfio();
        if !unbound.is_empty() {
            lost.push(format!(
                "crash at #{n_point} ({what}): the next run left {unbound:?} off vfio-pci"
            ));
        }
        n.unbind_all();
        lost.extend(
            n.lost(&before)
                .into_iter()
                .map(|l| format!("crash at #{n_point} ({what}): {l}")),
        );
    }
    println!(
        "faults: {} injection points ({} sysfs writes, {} module syscalls, {} state saves) x 2 passes \
         (fail, crash; {crashed} crashes taken) over {} selected devices + 1 companion; devices lost: {}",
        points.len(),
        count(Point::Write),
        count(Point::Module),
        count(Point::Save),
        SELECTED.len(),
        lost.len()
    );
    assert_eq!(crashed, points.len(), "every crash point must be reached");
    assert!(lost.is_empty(), "{} lost:\n{}", lost.len(), lost.join("\n"));
}
