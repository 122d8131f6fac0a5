//! Passthrough per claim: prepare and unprepare on a fake kernel, and the checkpoint
//! proved by failing, then "crashing", every step of a claim's whole life in turn.
//!
//! The node: a two-function card (group 1: a selected NIC plus an audio companion on
//! snd_hda_intel), a NIC pinned to its native driver by `driver_override` (group 2)
//! and a NIC with no driver (group 3). Claim A takes the card, claim B the other two.
//! After every fault a fresh process does what the restarted driver and kubelet do:
//! recover, prepare both claims again (kubelet retries), check them, unprepare both.
//! Every device must end on its original driver with its original override, with no
//! record, claim or file left.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use kubelet_plugin::{AllocatedDevice, ClaimRef, ConfigSource, OpaqueConfig};
use passthrough::config::ResourceList;
use passthrough::inventory::Inventory;
use passthrough::Passthrough;
use sandbox_dra_driver::cdi::DriverName;
use sandbox_dra_driver::{device_name, ClaimError, Claims, Files};
use sandbox_dra_driver::{ClaimPhase, StateFile};
use support::error_chain;
use sysfs_pci::kernel::Kernel;
use sysfs_pci::testing::{Crashed, FakeDevice, FakeKernel, FakeNode, Fault, FaultKernel, Point};
use sysfs_pci::PciAddress;

const LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;
const RELEASE: &str = "6.1.0-claims";
const POOL: &str = "node-a";

type Snapshot = BTreeMap<String, (Option<String>, String)>;

struct Node {
    dir: tempfile::TempDir,
    node: FakeNode,
    kernel: FakeKernel,
    state_path: PathBuf,
    list: ResourceList,
    files: Files,
}

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

fn node() -> Node {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = FakeNode::new(dir.path());
    let nic = |a: &str, g: u32| FakeDevice::new(a, 0x8086, 0x10d3, 0x02_0000).group(g);
    node.add_device(&nic("0000:01:00.0", 1).driver("e1000e"));
    node.add_device(
        &FakeDevice::new("0000:01:00.1", 0x8086, 0x293e, 0x04_0300)
            .driver("snd_hda_intel")
            .group(1),
    );
    node.add_device(&nic("0000:02:00.0", 2).driver("e1000e"));
    node.add_device(&nic("0000:03:00.0", 3));
    let pinned = node.host.device_dir(&addr("0000:02:00.0"));
    fs::write(pinned.join("driver_override"), "e1000e\n").unwrap();
    let dep = "kernel/drivers/vfio/pci/vfio-pci.ko: kernel/drivers/vfio/vfio_iommu_type1.ko kernel/drivers/vfio/vfio.ko
kernel/drivers/vfio/vfio_iommu_type1.ko: kernel/drivers/vfio/vfio.ko
kernel/drivers/vfio/vfio.ko:
";
    node.add_modules_dep(RELEASE, dep);
    let kernel = FakeKernel::new(&node);
    kernel.learn_native_drivers();
    kernel
        .module_drivers
        .lock()
        .unwrap()
        .insert("vfio_pci".into(), "vfio-pci".into());
    Node {
        state_path: dir.path().join("run/sandbox-dra-driver/state.json"),
        files: Files {
            driver: DriverName::new("vfio-sandbox.example.com").expect("the tests' driver name"),
            cdi_dir: dir.path().join("var/run/cdi"),
            metadata_dir: dir.path().join("var/run/dra-device-attributes"),
            iommufd: false,
        },
        dir,
        node,
        kernel,
        list: ResourceList::parse(LIST).unwrap(),
    }
}

fn claim(name: &str) -> ClaimRef {
    ClaimRef {
        uid: format!("uid-{name}"),
        namespace: "vms".into(),
        name: name.into(),
    }
}

fn alloc(bdfs: &[&str]) -> Vec<AllocatedDevice> {
    bdfs.iter()
        .map(|b| AllocatedDevice {
            request_names: vec!["npu".into()],
            pool: POOL.into(),
            device: device_name(&addr(b)),
            admin_access: false,
        })
        .collect()
}

const A: [&str; 1] = ["0000:01:00.0"];
const B: [&str; 2] = ["0000:02:00.0", "0000:03:00.0"];

impl Node {
    fn snapshot(&self) -> Snapshot {
        self.node.drivers_and_overrides()
    }

    /// One driver process: the state file locked for its lifetime.
    fn process<T>(
        &self,
        kernel: &dyn Kernel,
        f: impl FnOnce(&mut Claims<'_>, &Inventory) -> T,
    ) -> T {
        let mut state = StateFile::load(
            &self.state_path,
            true,
            &sandbox_dra_driver::programs::DRA_DRIVER,
        )
        .unwrap();
        let inv = Inventory::scan(&self.node.host, &self.list).unwrap();
        let mut claims = Claims {
            engine: Passthrough {
                host: &self.node.host,
                kernel,
                state: &mut state,
                release: RELEASE.into(),
            },
            list: &self.list,
            pool: POOL,
            files: &self.files,
            jobs: passthrough::DEFAULT_BIND_JOBS,
        };
        f(&mut claims, &inv)
    }

    fn prepare(
        &self,
        kernel: &dyn Kernel,
        c: &ClaimRef,
        bdfs: &[&str],
    ) -> Result<Vec<String>, String> {
        self.prepare_with(kernel, c, bdfs, &[])
    }

    fn prepare_with(
        &self,
        kernel: &dyn Kernel,
        c: &ClaimRef,
        bdfs: &[&str],
        configs: &[OpaqueConfig],
    ) -> Result<Vec<String>, String> {
        self.process(kernel, |cl, inv| {
            cl.prepare_on(c, None, &alloc(bdfs), configs, inv)
                .map(|devs| devs.into_iter().flat_map(|d| d.cdi_device_ids).collect())
                .map_err(|e| error_chain(&e))
        })
    }

    fn unprepare(&self, kernel: &dyn Kernel, c: &ClaimRef) -> Result<(), ClaimError> {
        self.process(kernel, |cl, _| cl.unprepare(c))
    }

    fn files(&self) -> Vec<String> {
        let mut out = Vec::new();
        for root in [&self.files.cdi_dir, &self.files.metadata_dir] {
            for e in walk(root) {
                out.push(
                    e.strip_prefix(self.dir.path())
                        .unwrap()
                        .display()
                        .to_string(),
                );
            }
        }
        out
    }

    fn on_vfio(&self, bdfs: &[&str]) -> bool {
        bdfs.iter()
            .all(|b| self.node.driver_of(&addr(b)).as_deref() == Some("vfio-pci"))
    }

    /// What is not as it was: devices, records, claims, files.
    fn lost(&self, before: &Snapshot) -> Vec<String> {
        let after = self.snapshot();
        let mut lost: Vec<String> = before
            .iter()
            .filter(|(a, was)| after.get(*a) != Some(was))
            .map(|(a, was)| format!("{a}: was {was:?}, now {:?}", after.get(a)))
            .collect();
        let state = StateFile::load(
            &self.state_path,
            false,
            &sandbox_dra_driver::programs::DRA_DRIVER,
        )
        .unwrap();
        if !state.state().devices.is_empty() || !state.records().is_empty() {
            lost.push(format!("state not empty: {:?}", state.state()));
        }
        lost.extend(self.files().into_iter().map(|f| format!("file left: {f}")));
        lost
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

#[test]
fn a_claim_moves_its_whole_group_and_gives_it_back() {
    let n = node();
    let before = n.snapshot();
    let ids = n.prepare(&n.kernel, &claim("a"), &A).unwrap();
    assert_eq!(
        ids,
        [
            "vfio-sandbox.example.com/vfio=pci-0000-01-00-0-uid-a",
            "vfio-sandbox.example.com/vfio=metadata-npu-uid-a"
        ]
    );
    assert!(
        n.on_vfio(&["0000:01:00.0", "0000:01:00.1"]),
        "the companion moves too"
    );
    assert!(n.node.host.vfio_group_node(1).exists());
    assert!(!n.files().is_empty(), "the claim's files are written");
    let state = StateFile::load(
        &n.state_path,
        false,
        &sandbox_dra_driver::programs::DRA_DRIVER,
    )
    .unwrap();
    let record = &state.records()["uid-a"];
    assert_eq!(record.phase, ClaimPhase::Prepared);
    assert_eq!(record.groups(), vec![1]);
    // Prepared again (kubelet retries): the same answer, not one write.
    let writes = n.kernel.write_log().len();
    assert_eq!(n.prepare(&n.kernel, &claim("a"), &A).unwrap(), ids);
    assert_eq!(n.kernel.write_log().len(), writes);
    n.unprepare(&n.kernel, &claim("a")).unwrap();
    assert_eq!(n.lost(&before), Vec::<String>::new());
    // A claim already gone is done.
    n.unprepare(&n.kernel, &claim("a")).unwrap();
    n.unprepare(&n.kernel, &claim("never-seen")).unwrap();
}

#[test]
fn a_group_belongs_to_one_claim_and_an_allocation_cannot_change() {
    let n = node();
    n.prepare(&n.kernel, &claim("a"), &A).unwrap();
    let writes = n.kernel.write_log().len();
    let err = n.prepare(&n.kernel, &claim("other"), &A).unwrap_err();
    assert!(
        err.contains("IOMMU group 1, which is prepared for claim vms/a (uid uid-a)"),
        "{err}"
    );
    let err = n.prepare(&n.kernel, &claim("a"), &B).unwrap_err();
    assert!(err.contains("unprepare it first"), "{err}");
    let renamed = ClaimRef {
        name: "imposter".into(),
        ..claim("a")
    };
    let err = n.prepare(&n.kernel, &renamed, &A).unwrap_err();
    assert!(err.contains("its uid is prepared for vms/a"), "{err}");
    assert_eq!(
        n.kernel.write_log().len(),
        writes,
        "a refusal touches nothing"
    );
    // Two claims at once, on different groups.
    n.prepare(&n.kernel, &claim("b"), &B).unwrap();
    assert!(n.on_vfio(&[
        "0000:01:00.0",
        "0000:01:00.1",
        "0000:02:00.0",
        "0000:03:00.0"
    ]));
}

#[test]
fn a_held_group_is_not_given_back_until_the_vm_lets_go() {
    let n = node();
    let before = n.snapshot();
    n.prepare(&n.kernel, &claim("a"), &A).unwrap();
    let node1 = n.node.host.vfio_group_node(1);
    n.kernel.busy_groups.lock().unwrap().insert(node1.clone());
    let writes = n.kernel.write_log().len();
    let err = n.unprepare(&n.kernel, &claim("a")).unwrap_err();
    assert!(
        matches!(err, ClaimError::InUse { ref groups, .. } if groups == &[1]),
        "{err}"
    );
    assert!(
        error_chain(&err).contains("/dev/vfio/1 still open"),
        "{}",
        error_chain(&err)
    );
    assert_eq!(n.kernel.write_log().len(), writes);
    assert!(n.on_vfio(&["0000:01:00.0", "0000:01:00.1"]));
    n.kernel.busy_groups.lock().unwrap().remove(&node1);
    n.unprepare(&n.kernel, &claim("a")).unwrap();
    assert_eq!(n.lost(&before), Vec::<String>::new());
}

#[test]
fn hostile_claims_are_refused_without_touching_the_node() {
    let n = node();
    let before = n.snapshot();
    let bad = |c: ClaimRef, allocs: Vec<AllocatedDevice>| {
        n.process(&n.kernel, |cl, inv| {
            cl.prepare_on(&c, None, &allocs, &[], inv)
        })
        .map(|_| ())
        .map_err(|e| error_chain(&e))
        .unwrap_err()
    };
    let dev = |d: &str, pool: &str| AllocatedDevice {
        request_names: vec!["r".into()],
        pool: pool.into(),
        device: d.into(),
        admin_access: false,
    };
    let cases = [
        (claim("x"), vec![], "no device of this driver"),
        (
            claim("x"),
            vec![dev("pci-0000-01-00-0", "node-b")],
            "not this node's pool",
        ),
        (
            claim("x"),
            vec![dev("gpu-0", POOL)],
            "not a device this driver publishes",
        ),
        (
            claim("x"),
            vec![dev("pci-0000-09-00-0", POOL)],
            "does not select it",
        ),
        (
            claim("x"),
            vec![AllocatedDevice {
                admin_access: true,
                ..alloc(&A)[0].clone()
            }],
            "allocated with admin access, which this driver does not give",
        ),
        (
            claim("x"),
            vec![dev("pci-0000-01-00-1", POOL)],
            "does not select it",
        ),
        (
            ClaimRef {
                uid: String::new(),
                ..claim("x")
            },
            alloc(&A),
            "no uid",
        ),
        (
            ClaimRef {
                uid: "../../etc".into(),
                ..claim("x")
            },
            alloc(&A),
            "invalid claim UID",
        ),
    ];
    for (c, allocs, want) in cases {
        let err = bad(c, allocs);
        assert!(err.contains(want), "{err} (wanted {want})");
    }
    // A thousand allocations, none of them ours.
    let many: Vec<AllocatedDevice> = (0..1000)
        .map(|i| dev(&format!("pci-ffff-{i:02x}-00-0"), POOL))
        .collect();
    assert!(bad(claim("x"), many).contains("does not select it"));
    assert!(n.kernel.write_log().is_empty());
    assert_eq!(n.lost(&before), Vec::<String>::new());
}

/// Runs `f`, turning a simulated crash into `true`; any other panic propagates.
fn crashes(f: impl FnOnce()) -> bool {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(()) => false,
        Err(payload) if payload.is::<Crashed>() => true,
        Err(payload) => std::panic::resume_unwind(payload),
    }
}

/// A whole life: prepare A and B, unprepare both. Errors are what kubelet sees.
fn life(n: &Node, kernel: &dyn Kernel) -> Vec<String> {
    let mut errors = Vec::new();
    errors.extend(n.prepare(kernel, &claim("a"), &A).err());
    errors.extend(n.prepare(kernel, &claim("b"), &B).err());
    for c in ["a", "b"] {
        errors.extend(
            n.unprepare(kernel, &claim(c))
                .err()
                .map(|e| error_chain(&e)),
        );
    }
    errors
}

/// What the restarted driver and kubelet do after a fault; the claims must come up
/// and go away cleanly.
fn aftermath(n: &Node) -> Vec<String> {
    let mut problems = Vec::new();
    let recovery = n.process(&n.kernel, |cl, _| cl.recover());
    problems.extend(recovery.failed.iter().map(|f| format!("recover: {f}")));
    for (c, bdfs) in [("a", &A[..]), ("b", &B[..])] {
        if let Err(e) = n.prepare(&n.kernel, &claim(c), bdfs) {
            problems.push(format!("retry prepare {c}: {e}"));
        }
    }
    if !n.on_vfio(&[
        "0000:01:00.0",
        "0000:01:00.1",
        "0000:02:00.0",
        "0000:03:00.0",
    ]) {
        problems.push("retried claims are not on vfio-pci".into());
    }
    for c in ["a", "b"] {
        if let Err(e) = n.unprepare(&n.kernel, &claim(c)) {
            problems.push(format!("unprepare {c}: {}", error_chain(&e)));
        }
    }
    problems
}

#[test]
fn every_step_of_a_claims_life_fails_or_crashes_and_nothing_is_lost() {
    walk_every_fault("claims", life, aftermath);
}

/// Runs `life` once to count its injection points (every sysfs write, module
/// call and state save), then again for each point with a failure there and with
/// a crash there (a `kill -9`): after each, `aftermath` (the restart and the
/// retries) must find nothing wrong and no device may be lost. `name` heads the
/// printed count.
fn walk_every_fault(
    name: &str,
    life: fn(&Node, &dyn Kernel) -> Vec<String>,
    aftermath: fn(&Node) -> Vec<String>,
) {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !info.payload().is::<Crashed>() {
            default(info);
        }
    }));
    let points = {
        let n = node();
        let before = n.snapshot();
        let counting = FaultKernel::new(&n.kernel, None);
        assert_eq!(
            life(&n, &counting),
            Vec::<String>::new(),
            "a clean life has no errors"
        );
        assert_eq!(n.lost(&before), Vec::<String>::new());
        counting.points()
    };
    let count = |k: Point| points.iter().filter(|(p, _)| *p == k).count();
    assert!(
        count(Point::Write) >= 16 && count(Point::Save) >= 10,
        "{points:?}"
    );
    let mut lost = Vec::new();
    let mut crashed = 0;
    for fault in [Fault::Fail, Fault::Crash] {
        for (i, (_, what)) in points.iter().enumerate() {
            let n = node();
            let before = n.snapshot();
            let faulty = FaultKernel::new(&n.kernel, Some((i, fault)));
            let mut errors = Vec::new();
            if crashes(|| errors = life(&n, &faulty)) {
                crashed += 1;
            } else if fault == Fault::Fail && errors.is_empty() {
                lost.push(format!(
                    "{fault:?} at {i} ({what}): the failure was not reported"
                ));
            }
            for p in aftermath(&n).into_iter().chain(n.lost(&before)) {
                lost.push(format!("{fault:?} at {i} ({what}): {p}"));
            }
        }
    }
    println!(
        "{name}: {} injection points ({} writes, {} module calls, {} saves) x fail and \
            crash; crashes {crashed}; lost: {}",
        points.len(),
        count(Point::Write),
        count(Point::Module),
        count(Point::Save),
        lost.len()
    );
    assert_eq!(crashed, points.len(), "every crash point is reached");
    assert!(lost.is_empty(), "{}", lost.join("\n"));
}

/// A claim's groups move at once with `jobs` > 1 (the same engine as `vfio-manager
/// --bind-jobs`), one after another with 1; both give every device back.
#[test]
fn a_claim_of_several_groups_moves_them_at_once() {
    use std::num::NonZeroUsize;
    use std::time::Duration;
    for (jobs, at_once) in [(1, 1..=1), (8, 2..=4)] {
        let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
        let kernel = FakeKernel::slow_nics(dir.path(), 4, Duration::from_millis(50), RELEASE);
        let files = Files {
            driver: DriverName::new("vfio-sandbox.example.com").expect("the tests' driver name"),
            cdi_dir: dir.path().join("var/run/cdi"),
            metadata_dir: dir.path().join("var/run/dra-device-attributes"),
            iommufd: false,
        };
        let mut state = StateFile::load(
            &dir.path().join("run/state.json"),
            true,
            &sandbox_dra_driver::programs::DRA_DRIVER,
        )
        .unwrap();
        let list = ResourceList::parse(LIST).unwrap();
        let host = &kernel.node.host;
        let mut claims = Claims {
            engine: Passthrough {
                host,
                kernel: &kernel,
                state: &mut state,
                release: RELEASE.into(),
            },
            list: &list,
            pool: POOL,
            files: &files,
            jobs: NonZeroUsize::new(jobs).unwrap(),
        };
        let bdfs = [
            "0000:01:00.0",
            "0000:02:00.0",
            "0000:03:00.0",
            "0000:04:00.0",
        ];
        let inv = Inventory::scan(host, &list).unwrap();
        claims
            .prepare_on(&claim("four"), None, &alloc(&bdfs), &[], &inv)
            .unwrap();
        let entered = kernel.max_concurrent_probes();
        assert!(at_once.contains(&entered), "jobs {jobs}: {entered} at once");
        for b in bdfs {
            assert_eq!(kernel.node.driver_of(&addr(b)).as_deref(), Some("vfio-pci"));
        }
        kernel.reset_concurrency();
        claims.unprepare(&claim("four")).unwrap();
        let left = kernel.max_concurrent_probes();
        assert!(
            at_once.contains(&left),
            "jobs {jobs}: {left} at once leaving"
        );
        for b in bdfs {
            assert_eq!(kernel.node.driver_of(&addr(b)).as_deref(), Some("e1000e"));
        }
    }
}

impl Node {
    fn move_early(&self, kernel: &dyn Kernel, c: &ClaimRef, bdfs: &[&str]) -> Result<(), String> {
        self.move_early_with(kernel, c, bdfs, &[])
    }

    fn move_early_with(
        &self,
        kernel: &dyn Kernel,
        c: &ClaimRef,
        bdfs: &[&str],
        configs: &[OpaqueConfig],
    ) -> Result<(), String> {
        self.process(kernel, |cl, inv| {
            cl.move_early_on(c, &alloc(bdfs), configs, inv)
                .map_err(|e| error_chain(&e))
        })
    }

    fn release(&self, kernel: &dyn Kernel, c: &ClaimRef) -> Result<bool, String> {
        self.process(kernel, |cl, _| {
            cl.release(&c.uid).map_err(|e| error_chain(&e))
        })
    }

    fn phase(&self, c: &ClaimRef) -> Option<ClaimPhase> {
        let state = StateFile::load(
            &self.state_path,
            false,
            &sandbox_dra_driver::programs::DRA_DRIVER,
        )
        .unwrap();
        state.records().get(&c.uid).map(|r| r.phase)
    }

    /// The sysfs writes so far (not the state file, not the claim files).
    fn sysfs_writes(&self) -> Vec<String> {
        self.kernel
            .write_log()
            .into_iter()
            .filter(|w| w.starts_with("sys/"))
            .collect()
    }
}

/// Moved as soon as the claim is allocated (binding conditions): the whole group
/// goes to vfio and is recorded as `moved`, no file yet; a restart keeps it; the
/// prepare that follows writes the files and not one sysfs file.
#[test]
fn a_claim_moved_early_is_prepared_by_writing_its_files_only() {
    let n = node();
    let before = n.snapshot();
    n.move_early(&n.kernel, &claim("a"), &A).unwrap();
    assert!(
        n.on_vfio(&["0000:01:00.0", "0000:01:00.1"]),
        "the companion moves too"
    );
    assert_eq!(n.phase(&claim("a")), Some(ClaimPhase::Moved));
    assert!(n.files().is_empty(), "no file before prepare");
    // Asked again (another watch event): nothing more is done.
    let writes = n.kernel.write_log().len();
    n.move_early(&n.kernel, &claim("a"), &A).unwrap();
    assert_eq!(n.kernel.write_log().len(), writes);
    let recovery = n.process(&n.kernel, |cl, _| cl.recover());
    assert!(
        recovery.rolled_back.is_empty() && recovery.failed.is_empty(),
        "{recovery:?}"
    );
    assert_eq!(
        n.phase(&claim("a")),
        Some(ClaimPhase::Moved),
        "a restart keeps it"
    );
    let sysfs = n.sysfs_writes().len();
    assert!(
        sysfs >= 4,
        "the move wrote to sysfs: {:?}",
        n.kernel.write_log()
    );
    let ids = n.prepare(&n.kernel, &claim("a"), &A).unwrap();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert_eq!(
        n.sysfs_writes().len(),
        sysfs,
        "prepare wrote to sysfs: {:?}",
        &n.sysfs_writes()[sysfs..]
    );
    assert!(!n.files().is_empty());
    assert_eq!(n.phase(&claim("a")), Some(ClaimPhase::Prepared));
    // A prepared claim is kubelet's: losing its allocation does not take it back.
    assert_eq!(n.release(&n.kernel, &claim("a")), Ok(false));
    assert!(n.on_vfio(&A));
    n.unprepare(&n.kernel, &claim("a")).unwrap();
    assert_eq!(n.lost(&before), Vec::<String>::new());
}

/// A claim moved early that loses its allocation (the scheduler gave up, the
/// claim was deleted) before its pod started gets every device back; an early
/// move of a group another claim holds is refused without touching it.
#[test]
fn a_claim_moved_early_that_loses_its_allocation_is_given_back() {
    let n = node();
    let before = n.snapshot();
    n.move_early(&n.kernel, &claim("b"), &B).unwrap();
    assert!(n.on_vfio(&B));
    let writes = n.kernel.write_log().len();
    let e = n
        .move_early(&n.kernel, &claim("other"), &["0000:03:00.0"])
        .unwrap_err();
    assert!(e.contains("prepared for claim vms/b"), "{e}");
    assert_eq!(n.kernel.write_log().len(), writes);
    assert_eq!(n.release(&n.kernel, &claim("b")), Ok(true));
    assert_eq!(n.release(&n.kernel, &claim("b")), Ok(false), "done already");
    assert_eq!(n.lost(&before), Vec::<String>::new());
    // Deallocated and allocated other devices between two looks: the old group
    // goes back before the new one moves.
    n.move_early(&n.kernel, &claim("c"), &A).unwrap();
    n.move_early(&n.kernel, &claim("c"), &["0000:03:00.0"])
        .unwrap();
    assert!(n.on_vfio(&["0000:03:00.0"]));
    assert_eq!(
        n.node.driver_of(&addr("0000:01:00.0")).as_deref(),
        Some("e1000e")
    );
    assert_eq!(n.release(&n.kernel, &claim("c")), Ok(true));
    assert_eq!(n.lost(&before), Vec::<String>::new());
}

/// The early life of two claims: both moved early, `a` prepared and unprepared,
/// `b` losing its allocation. Errors are what the watcher and kubelet see.
fn early_life(n: &Node, kernel: &dyn Kernel) -> Vec<String> {
    let mut errors = Vec::new();
    errors.extend(n.move_early(kernel, &claim("a"), &A).err());
    errors.extend(n.move_early(kernel, &claim("b"), &B).err());
    errors.extend(n.prepare(kernel, &claim("a"), &A).err());
    errors.extend(n.release(kernel, &claim("b")).err());
    errors.extend(
        n.unprepare(kernel, &claim("a"))
            .err()
            .map(|e| error_chain(&e)),
    );
    errors
}

/// What follows a fault: the driver restarts (recover), the watcher moves the
/// still-allocated claims again, kubelet prepares `a`, `b` loses its allocation,
/// kubelet unprepares `a`. Everything must come up and go away cleanly.
fn early_aftermath(n: &Node) -> Vec<String> {
    let mut problems = Vec::new();
    let recovery = n.process(&n.kernel, |cl, _| cl.recover());
    problems.extend(recovery.failed.iter().map(|f| format!("recover: {f}")));
    for (c, bdfs) in [("a", &A[..]), ("b", &B[..])] {
        // A claim already prepared is not moved again (kubelet's retry follows).
        if n.phase(&claim(c)) != Some(ClaimPhase::Prepared) {
            if let Err(e) = n.move_early(&n.kernel, &claim(c), bdfs) {
                problems.push(format!("move {c} again: {e}"));
            }
        }
    }
    if !n.on_vfio(&[
        "0000:01:00.0",
        "0000:01:00.1",
        "0000:02:00.0",
        "0000:03:00.0",
    ]) {
        problems.push("the claims moved again are not on vfio-pci".into());
    }
    if let Err(e) = n.prepare(&n.kernel, &claim("a"), &A) {
        problems.push(format!("prepare a: {e}"));
    }
    if let Err(e) = n.release(&n.kernel, &claim("b")) {
        problems.push(format!("release b: {e}"));
    }
    if let Err(e) = n.unprepare(&n.kernel, &claim("a")) {
        problems.push(format!("unprepare a: {}", error_chain(&e)));
    }
    problems
}

/// Every write, module call and state save of the early life, in turn, fails or
/// crashes the process (a `kill -9` there); after the restart and the watcher's
/// and kubelet's retries, every device is back where it was, with no record and
/// no file left.
#[test]
fn every_step_of_an_early_move_fails_or_crashes_and_nothing_is_lost() {
    walk_every_fault("early move", early_life, early_aftermath);
}

/// An opaque configuration of the test driver for `requests`, from the claim.
fn vfio_config(index: usize, requests: &[&str], parameters: serde_json::Value) -> OpaqueConfig {
    OpaqueConfig {
        index,
        source: ConfigSource::Claim,
        requests: requests.iter().map(|r| r.to_string()).collect(),
        parameters,
    }
}

fn iommu(value: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "vfio-sandbox.example.com/v1alpha1",
        "kind": "VfioConfig",
        "iommu": value,
    })
}

/// The device node paths of the claim's CDI spec, in order.
fn spec_nodes(n: &Node, c: &ClaimRef) -> Vec<String> {
    let path = n
        .files
        .cdi_dir
        .join(format!("vfio-sandbox.example.com-vfio_{}.json", c.uid));
    let spec: serde_json::Value = serde_json::from_slice(&fs::read(path).unwrap()).unwrap();
    spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| {
            d["containerEdits"]["deviceNodes"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|node| node["path"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn a_bad_configuration_refuses_the_claim_naming_the_field_and_nothing_moves() {
    let n = node();
    let before = n.snapshot();
    let bad = [
        (
            serde_json::json!({"apiVersion": "vfio-sandbox.example.com/v1alpha1", "kind": "VfioConfig", "iommu": "legacy", "mode": "x"}),
            "unknown field `mode`",
        ),
        (iommu("iommufd2"), "unknown variant `iommufd2`"),
        (
            serde_json::json!({"apiVersion": "vfio-sandbox.example.com/v1", "kind": "VfioConfig"}),
            "apiVersion is \"vfio-sandbox.example.com/v1\"",
        ),
    ];
    for (parameters, want) in bad {
        // Shadowed by a valid one that comes later: still refused.
        let configs = [
            vfio_config(0, &[], parameters),
            vfio_config(1, &["npu"], iommu("legacy")),
        ];
        for err in [
            n.prepare_with(&n.kernel, &claim("a"), &A, &configs)
                .unwrap_err(),
            n.move_early_with(&n.kernel, &claim("a"), &A, &configs)
                .unwrap_err(),
        ] {
            assert!(
                err.starts_with(
                    "claim vms/a (uid uid-a): its configuration is \
                        refused: status.allocation.devices.config[0].opaque.parameters \
                        (from the claim): "
                ),
                "{err}"
            );
            assert!(err.contains(want), "{err}");
            assert_eq!(n.lost(&before), Vec::<String>::new(), "{err}");
            assert!(
                n.kernel.write_log().is_empty(),
                "{err}: {:?}",
                n.kernel.write_log()
            );
        }
    }
    // The claim's own configuration is judged before anything else: its group
    // held by another claim does not hide it.
    n.prepare(&n.kernel, &claim("other"), &A).unwrap();
    let configs = [vfio_config(0, &[], iommu("iommufd2"))];
    let err = n
        .prepare_with(&n.kernel, &claim("a"), &A, &configs)
        .unwrap_err();
    assert!(err.contains("its configuration is refused"), "{err}");
    n.unprepare(&n.kernel, &claim("other")).unwrap();
    assert_eq!(n.lost(&before), Vec::<String>::new());
}

#[test]
fn each_device_gets_exactly_the_nodes_its_configuration_asks_for() {
    let mut n = node();
    n.node.enable_vfio_cdev();
    let cdev = |b: &str| format!("/dev/vfio/devices/{}", FakeNode::vfio_cdev_of(&addr(b)));
    let before = n.snapshot();
    let a = claim("a");
    let groups = |g: u32| vec!["/dev/vfio/vfio".to_owned(), format!("/dev/vfio/{g}")];
    let iommufd = |b: &str| vec!["/dev/iommu".to_owned(), cdev(b)];
    let both = |g, b: &str| [groups(g), iommufd(b)].concat();
    let cases: [(bool, Option<&str>, Vec<String>); 6] = [
        // The node's default: the group nodes, and with --iommufd the cdev (read
        // once the device is on vfio).
        (false, None, groups(1)),
        (true, None, both(1, "0000:01:00.0")),
        // Asked for: exactly that, whatever the node's default.
        (true, Some("legacy"), groups(1)),
        (false, Some("iommufd"), iommufd("0000:01:00.0")),
        (true, Some("iommufd"), iommufd("0000:01:00.0")),
        (false, Some("both"), both(1, "0000:01:00.0")),
    ];
    for (node_iommufd, asked, want) in cases {
        n.files.iommufd = node_iommufd;
        let configs: Vec<OpaqueConfig> = asked
            .map(|i| vfio_config(0, &["npu"], iommu(i)))
            .into_iter()
            .collect();
        n.prepare_with(&n.kernel, &a, &A, &configs).unwrap();
        assert_eq!(
            spec_nodes(&n, &a),
            want,
            "--iommufd {node_iommufd}, iommu {asked:?}"
        );
        n.unprepare(&n.kernel, &a).unwrap();
        assert_eq!(n.lost(&before), Vec::<String>::new());
    }
    // Per request: one claim, two devices, two interfaces.
    n.files.iommufd = false;
    let b = claim("b");
    let configs = [vfio_config(0, &[], iommu("iommufd"))];
    n.prepare_with(&n.kernel, &b, &B, &configs).unwrap();
    assert_eq!(
        spec_nodes(&n, &b),
        [iommufd("0000:02:00.0"), iommufd("0000:03:00.0")].concat()
    );
    n.unprepare(&n.kernel, &b).unwrap();
    assert_eq!(n.lost(&before), Vec::<String>::new());
}

#[test]
fn iommufd_asked_of_a_kernel_without_the_cdev_is_refused_and_undone() {
    let n = node();
    let before = n.snapshot();
    let configs = [vfio_config(0, &["npu"], iommu("iommufd"))];
    // No vfio device yet: the kernel cannot be told before the move, so the
    // missing cdev is found on vfio and the move is put back.
    let err = n
        .prepare_with(&n.kernel, &claim("a"), &A, &configs)
        .unwrap_err();
    assert!(
        err.contains(
            "0000:01:00.0 is configured with iommu: iommufd, but the kernel \
                made no VFIO device cdev for it"
        ),
        "{err}"
    );
    assert!(err.contains("its devices were put back"), "{err}");
    assert_eq!(n.lost(&before), Vec::<String>::new());
    // The same for an early move: checked once on vfio, and put back.
    let err = n
        .move_early_with(&n.kernel, &claim("a"), &A, &configs)
        .unwrap_err();
    assert!(err.contains("checking the iommufd nodes"), "{err}");
    assert!(
        err.contains("the kernel made no VFIO device cdev for it"),
        "{err}"
    );
    assert!(err.contains("its devices were put back"), "{err}");
    assert_eq!(n.lost(&before), Vec::<String>::new());
    // With a vfio device whose vfio-dev entry has no dev attribute, the kernel is
    // known to lack it: refused before anything moves.
    n.prepare(&n.kernel, &claim("b"), &["0000:03:00.0"])
        .unwrap();
    let listed = n.node.host.vfio_dev_class_dir().join("vfio9");
    fs::create_dir_all(&listed).unwrap();
    let writes = n.kernel.write_log().len();
    let err = n
        .prepare_with(&n.kernel, &claim("a"), &A, &configs)
        .unwrap_err();
    assert!(
        err.contains(
            "is configured with iommu: iommufd, and this kernel makes no VFIO device cdev"
        ),
        "{err}"
    );
    assert_eq!(n.kernel.write_log().len(), writes, "nothing written");
    fs::remove_dir(&listed).unwrap();
    n.unprepare(&n.kernel, &claim("b")).unwrap();
    assert_eq!(n.lost(&before), Vec::<String>::new());
}
