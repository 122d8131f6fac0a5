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
//! Each life is walked twice: moving one group at a time (`--bind-jobs 1`, where the
//! points come in one fixed order), and binding and restoring up to 4 groups at once
//! (the SIGTERM restore and `unbind --all` too), where the
//! same points interleave as the threads run: a fail or crash at index *n* then hits
//! whichever step came *n*th, and a crash stops every thread at its next step.
//!
//! The node: 8 selected devices in 6 IOMMU groups — a two-function card behind a
//! bridge, a device whose group holds an unselected companion on another driver
//! (snd_hda_intel), one with an original `driver_override`, one with no driver —
//! on a fake kernel that applies writes as the PCI core does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::fs;
use std::num::NonZeroUsize;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Duration;

use passthrough::config::ResourceList;
use passthrough::inventory::Inventory;
use passthrough::state::StateFile;
use passthrough::{target_drivers, Passthrough};
use support::error_chain;
use sysfs_pci::kernel::Kernel;
use sysfs_pci::testing::{Crashed, FakeDevice, FakeKernel, FakeNode, Fault, FaultKernel, Point};
use sysfs_pci::PciAddress;

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
    /// `run --unload-module e1000e` (records made while pinning) or plain `run`
    /// (records made group by group while binding).
    unload: bool,
    /// Groups bound at once.
    jobs: NonZeroUsize,
    _dir: tempfile::TempDir,
    node: FakeNode,
    kernel: FakeKernel,
    state_path: PathBuf,
    list: ResourceList,
}

fn nic(addr: &str, group: u32) -> FakeDevice {
    FakeDevice::new(addr, 0x8086, 0x10d3, 0x02_0000).group(group)
}

fn node(unload: bool, jobs: NonZeroUsize) -> Node {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
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
    // With threads, a short modelled driver latency keeps the groups' probes in
    // flight together, so the walk meets interleaved points, not just sequential ones.
    let latency = if jobs.get() > 1 {
        Duration::from_micros(500)
    } else {
        Duration::ZERO
    };
    let kernel = FakeKernel::new(&node).with_latency(latency);
    kernel.learn_native_drivers();
    for (module, driver) in [("vfio_pci", "vfio-pci"), ("e1000e", "e1000e")] {
        kernel
            .module_drivers
            .lock()
            .unwrap()
            .insert(module.into(), driver.into());
    }
    Node {
        unload,
        jobs,
        state_path: dir.path().join("run/vfio-manager/state.json"),
        _dir: dir,
        node,
        kernel,
        list: ResourceList::parse(LIST).unwrap(),
    }
}

impl Node {
    fn snapshot(&self) -> Snapshot {
        self.node.drivers_and_overrides()
    }

    /// One vfio-manager process: the state file locked for its lifetime.
    fn process<T>(
        &self,
        kernel: &dyn Kernel,
        f: impl FnOnce(&mut Passthrough<'_>) -> T,
    ) -> Result<T, String> {
        let mut state = StateFile::load(
            &self.state_path,
            true,
            &const { passthrough::owner::Program::named("vfio-manager") },
        )
        .map_err(|e| error_chain(&e))?;
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
        let unload: Vec<String> = self.unload.then(|| UNLOAD.into()).into_iter().collect();
        pt.enter_vm_mode(&inv, &unload)
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
            .bind_concurrent(&inv, &[], self.jobs)
            .failed
            .iter()
            .map(|e| error_chain(e))
            .collect())
    }

    /// The whole life of one `run` process: start (exit if it fails), one resync,
    /// then SIGTERM (restore) or SIGKILL. Returns the moments a group was seen
    /// half-bound (some members on vfio-pci, others not).
    fn life(&self, kernel: &dyn Kernel, end: End) -> Vec<String> {
        let mut half = Vec::new();
        let _ = self.process(kernel, |pt| {
            let started = self.run_start(pt);
            half.extend(
                self.half_bound()
                    .into_iter()
                    .map(|g| format!("after start: {g}")),
            );
            if started.is_ok() {
                let _ = self.converge(pt);
                half.extend(
                    self.half_bound()
                        .into_iter()
                        .map(|g| format!("after resync: {g}")),
                );
                if end == End::Sigterm {
                    pt.restore_concurrent(&[], self.jobs);
                }
            }
        });
        half
    }

    /// Groups with some but not all non-bridge members on vfio-pci.
    fn half_bound(&self) -> Vec<String> {
        let mut groups: BTreeMap<String, Vec<bool>> = BTreeMap::new();
        for a in sysfs_pci::device::list_addresses(&self.node.host).unwrap() {
            let dir = self.node.host.device_dir(&a);
            let (Ok(group), Ok(class)) = (
                fs::read_link(dir.join("iommu_group")),
                fs::read_to_string(dir.join("class")),
            ) else {
                continue;
            };
            if class.starts_with("0x0604") {
                continue;
            }
            let on_vfio = self.node.driver_of(&a).as_deref() == Some("vfio-pci");
            groups
                .entry(group.display().to_string())
                .or_default()
                .push(on_vfio);
        }
        groups
            .into_iter()
            .filter(|(_, m)| m.iter().any(|v| *v) && !m.iter().all(|v| *v))
            .map(|(g, _)| g)
            .collect()
    }

    fn unbind_all(&self) {
        let report = self
            .process(&self.kernel, |pt| pt.restore_concurrent(&[], self.jobs))
            .unwrap();
        assert!(report.in_use.is_empty());
    }

    fn all_selected_off_vfio(&self) -> Vec<String> {
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
        let state: StateFile = StateFile::load(
            &self.state_path,
            false,
            &const { passthrough::owner::Program::named("vfio-manager") },
        )
        .unwrap();
        if !state.state().devices.is_empty() || !state.state().unloaded_modules.is_empty() {
            lost.push(format!("state file not empty: {:?}", state.state()));
        }
        lost
    }
}

/// How a `run` process ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// SIGTERM: it restores.
    Sigterm,
    /// SIGKILL: it just stops.
    Kill,
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
fn clean_points(unload: bool, jobs: NonZeroUsize) -> Vec<(Point, String)> {
    let n = node(unload, jobs);
    let before = n.snapshot();
    let counting = FaultKernel::new(&n.kernel, None);
    assert!(n.life(&counting, End::Sigterm).is_empty());
    assert_eq!(
        n.lost(&before),
        Vec::<String>::new(),
        "a clean life loses nothing"
    );
    counting.points()
}

/// Tallies of one mode.
#[derive(Default)]
struct Tally {
    points: usize,
    writes: usize,
    modules: usize,
    saves: usize,
    crashes: usize,
    /// Lives in which two or more probes or unbinds were under way at once.
    overlapped: usize,
    lives: usize,
    lost: Vec<String>,
}

/// What the `at`th point of a faulted life was (with threads, not always the clean
/// life's `at`th).
fn faulted_at(kernel: &FaultKernel<'_>, at: usize) -> String {
    kernel
        .points()
        .get(at)
        .map(|(_, what)| what.clone())
        .unwrap_or_else(|| "not reached".into())
}

fn walk(unload: bool, jobs: NonZeroUsize) -> Tally {
    let points = clean_points(unload, jobs);
    let count = |k: Point| points.iter().filter(|(p, _)| *p == k).count();
    let mut t = Tally {
        points: points.len(),
        writes: count(Point::Write),
        modules: count(Point::Module),
        saves: count(Point::Save),
        ..Tally::default()
    };
    let mode = format!(
        "{} (bind jobs {jobs})",
        if unload {
            "run --unload-module e1000e"
        } else {
            "run"
        }
    );
    for at in 0..points.len() {
        let tag =
            |pass: &str, what: &str, l: String| format!("{mode}: {pass} at #{at} ({what}): {l}");
        // Fail passes: the step fails once; the process carries on as `run` does,
        // then gets SIGTERM or SIGKILL; then a fresh `unbind --all`.
        for end in [End::Sigterm, End::Kill] {
            let n = node(unload, jobs);
            let before = n.snapshot();
            let faulty = FaultKernel::new(&n.kernel, Some((at, Fault::Fail)));
            let half = n.life(&faulty, end);
            let what = faulted_at(&faulty, at);
            t.lost.extend(
                half.into_iter()
                    .map(|g| tag("fail", &what, format!("group {g} half-bound"))),
            );
            n.unbind_all();
            t.lives += 1;
            t.overlapped += usize::from(n.kernel.max_concurrent_probes() >= 2);
            t.lost.extend(
                n.lost(&before)
                    .into_iter()
                    .map(|l| tag(&format!("fail+{end:?}"), &what, l)),
            );
        }
        // Crash pass: the process dies right before the step; a new `run` converges
        // the node, is killed in turn, and `unbind --all` puts everything back.
        let n = node(unload, jobs);
        let before = n.snapshot();
        let faulty = FaultKernel::new(&n.kernel, Some((at, Fault::Crash)));
        if crashes(|| {
            n.life(&faulty, End::Sigterm);
        }) {
            t.crashes += 1;
        }
        let what = faulted_at(&faulty, at);
        match n.process(&n.kernel, |pt| n.run_start(pt)).unwrap() {
            Ok(failed) if failed.is_empty() => {}
            Ok(failed) => t.lost.push(tag(
                "crash",
                &what,
                format!("the next run failed: {failed:?}"),
            )),
            Err(e) => t
                .lost
                .push(tag("crash", &what, format!("the next run exited: {e}"))),
        }
        let off = n.all_selected_off_vfio();
        if !off.is_empty() {
            t.lost.push(tag(
                "crash",
                &what,
                format!("the next run left {off:?} off vfio-pci"),
            ));
        }
        n.unbind_all();
        t.lives += 1;
        t.overlapped += usize::from(n.kernel.max_concurrent_probes() >= 2);
        t.lost
            .extend(n.lost(&before).into_iter().map(|l| tag("crash", &what, l)));
    }
    t
}

/// Walks both lives (with and without `--unload-module`) binding `jobs` groups at
/// once; returns the points covered and what was lost.
fn walk_both(jobs: NonZeroUsize) -> (usize, Vec<String>) {
    let mut lost = Vec::new();
    let mut total = 0;
    for unload in [true, false] {
        let t = walk(unload, jobs);
        // Every kind is exercised: 9 devices moved and restored, the vfio modules.
        assert!(
            t.writes >= 27 && t.modules >= 3 && t.saves >= 18,
            "{} points",
            t.points
        );
        assert_eq!(t.crashes, t.points, "every crash point must be reached");
        if jobs.get() > 1 {
            assert!(t.overlapped > 0, "the groups' binds never overlapped");
        }
        println!(
            "faults: {} (bind jobs {jobs}): {} injection points ({} sysfs writes, {} module \
             syscalls, {} state saves) x 3 passes (fail then SIGTERM, fail then SIGKILL, \
             crash); {} selected devices + 1 companion; lives with overlapping probes: {} of \
             {}; devices lost: {}",
            if unload {
                "run --unload-module e1000e"
            } else {
                "run"
            },
            t.points,
            t.writes,
            t.modules,
            t.saves,
            SELECTED.len(),
            t.overlapped,
            t.lives,
            t.lost.len()
        );
        total += t.points;
        lost.extend(t.lost);
    }
    println!(
        "faults (bind jobs {jobs}): {total} injection points in all; devices lost: {}",
        lost.len()
    );
    (total, lost)
}

#[test]
fn every_fault_and_crash_point_leaves_nothing_lost() {
    quiet_crashes();
    let (_, lost) = walk_both(NonZeroUsize::MIN);
    assert!(lost.is_empty(), "{} lost:\n{}", lost.len(), lost.join("\n"));
}

/// The same walk with up to 4 of the node's 6 groups bound at once.
#[test]
fn every_fault_and_crash_point_leaves_nothing_lost_binding_groups_concurrently() {
    quiet_crashes();
    let (_, lost) = walk_both(NonZeroUsize::new(4).unwrap());
    assert!(lost.is_empty(), "{} lost:\n{}", lost.len(), lost.join("\n"));
}
