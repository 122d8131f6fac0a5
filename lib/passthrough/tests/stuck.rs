//! The engine with a deadline on every sysfs write, on a fake kernel whose write can
//! block until released (a native driver's remove that never returns), and restores
//! of several groups at once.
//!
//! What must hold: a stuck device fails only its own group, keeps its record and
//! never gets a second write while the first is blocked; every other group binds or
//! restores; once the write returns, the next pass converges; a concurrent restore
//! overlaps independent groups and still drops a record only once its device is back.

#![allow(clippy::unwrap_used)]

use std::num::NonZeroUsize;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use passthrough::config::ResourceList;
use passthrough::inventory::Inventory;
use passthrough::state::StateFile;
use passthrough::Passthrough;
use support::error_chain;
use sysfs_pci::deadline::Bounded;
use sysfs_pci::kernel::Kernel;
use sysfs_pci::testing::{FakeDevice, FakeKernel, FakeNode, Gate};
use sysfs_pci::PciAddress;

const LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;
const JOBS: NonZeroUsize = match NonZeroUsize::new(4) {
    Some(n) => n,
    None => NonZeroUsize::MIN,
};

struct Bed {
    _dir: tempfile::TempDir,
    node: FakeNode,
    fake: Arc<FakeKernel>,
    state: StateFile,
    list: ResourceList,
    gate: Arc<Gate>,
}

impl Drop for Bed {
    /// Lets a write still held go, so no test leaves a thread blocked behind it.
    fn drop(&mut self) {
        self.gate.open();
    }
}

fn a(s: &str) -> PciAddress {
    s.parse().unwrap()
}

/// A two-function card in group 4 (fn0 selected, fn1 a companion) and lone NICs in
/// groups 5, 6 and 7, all on their native drivers; each unbind and probe takes
/// `latency`.
fn bed(latency: Duration) -> Bed {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = FakeNode::new(dir.path());
    node.add_driver("vfio-pci");
    node.add_device(
        &FakeDevice::new("0000:01:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("e1000e")
            .group(4),
    );
    node.add_device(
        &FakeDevice::new("0000:01:00.1", 0x8086, 0x1234, 0x04_0300)
            .driver("snd_hda_intel")
            .group(4),
    );
    for (bdf, g) in [
        ("0000:02:00.0", 5),
        ("0000:03:00.0", 6),
        ("0000:04:00.0", 7),
    ] {
        node.add_device(
            &FakeDevice::new(bdf, 0x8086, 0x10d3, 0x02_0000)
                .driver("e1000e")
                .group(g),
        );
    }
    let fake = FakeKernel::new(&node).with_latency(latency);
    fake.learn_native_drivers();
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
        fake: Arc::new(fake),
        state,
        gate: Gate::new(),
    }
}

impl Bed {
    fn hang(&self, suffix: &str) {
        *self.fake.hang_on.lock().unwrap() = Some((suffix.into(), self.gate.clone()));
    }

    fn pt<'b>(&'b mut self, kernel: &'b dyn Kernel) -> Passthrough<'b> {
        Passthrough {
            host: &self.node.host,
            kernel,
            state: &mut self.state,
            release: "6.1.0-test".into(),
        }
    }

    fn bind_all(&mut self, kernel: &dyn Kernel) -> passthrough::BindReport {
        let inv = Inventory::scan(&self.node.host, &self.list).unwrap();
        self.pt(kernel).bind_concurrent(&inv, &[], JOBS)
    }

    fn driver(&self, bdf: &str) -> Option<String> {
        self.node.driver_of(&a(bdf))
    }

    fn recorded(&self) -> Vec<PciAddress> {
        self.state.state().devices.keys().copied().collect()
    }

    fn writes_to(&self, bdf: &str) -> usize {
        self.fake
            .write_log()
            .iter()
            .filter(|w| w.contains(bdf))
            .count()
    }
}

fn wait_for(what: &str, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{what} did not happen"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_stuck_unbind_fails_its_group_alone_keeps_its_record_and_is_never_written_twice() {
    let mut b = bed(Duration::ZERO);
    b.hang("0000:02:00.0/driver/unbind");
    let k = Bounded::new(b.fake.clone(), Duration::from_millis(300));
    let report = b.bind_all(&k);
    assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
    let why = error_chain(&report.failed[0]);
    for part in ["IOMMU group 5", "0000:02:00.0", "driver e1000e is stuck"] {
        assert!(why.contains(part), "{part} missing from: {why}");
    }
    // Every other group is on vfio; the stuck device keeps its record.
    for bdf in [
        "0000:01:00.0",
        "0000:01:00.1",
        "0000:03:00.0",
        "0000:04:00.0",
    ] {
        assert_eq!(b.driver(bdf).as_deref(), Some("vfio-pci"), "{bdf}");
    }
    assert!(b.recorded().contains(&a("0000:02:00.0")));
    // The next pass writes nothing to it: one write blocked, never a second.
    let writes = b.writes_to("0000:02:00.0");
    let again = b.bind_all(&k);
    assert_eq!(again.failed.len(), 1);
    assert_eq!(b.writes_to("0000:02:00.0"), writes);
    assert_eq!(b.gate.reached.load(Ordering::SeqCst), 1);
    assert_eq!(k.stuck().len(), 1);
    // The remove returns at last: the next pass binds it, and all restores.
    b.gate.open();
    wait_for("the stuck mark to go", || k.stuck().is_empty());
    let report = b.bind_all(&k);
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(b.driver("0000:02:00.0").as_deref(), Some("vfio-pci"));
    let restored = b.pt(&k).restore_concurrent(&[], JOBS);
    assert!(restored.failed.is_empty(), "{:?}", restored.failed);
    assert_eq!(b.driver("0000:02:00.0").as_deref(), Some("e1000e"));
    assert!(b.recorded().is_empty());
}

#[test]
fn a_stuck_restore_keeps_that_record_and_restores_the_rest() {
    let mut b = bed(Duration::ZERO);
    let k = Bounded::new(b.fake.clone(), Duration::from_millis(300));
    assert!(b.bind_all(&k).failed.is_empty());
    // vfio-pci's remove of one device blocks (as `unbind --all` would meet it).
    b.hang("0000:03:00.0/driver/unbind");
    let report = b.pt(&k).restore_concurrent(&[], JOBS);
    assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
    let why = error_chain(&report.failed[0]);
    assert!(
        why.contains("0000:03:00.0") && why.contains("driver vfio-pci is stuck"),
        "{why}"
    );
    assert_eq!(b.recorded(), vec![a("0000:03:00.0")]);
    for (bdf, native) in [
        ("0000:01:00.0", "e1000e"),
        ("0000:01:00.1", "snd_hda_intel"),
        ("0000:02:00.0", "e1000e"),
        ("0000:04:00.0", "e1000e"),
    ] {
        assert_eq!(b.driver(bdf).as_deref(), Some(native), "{bdf}");
    }
    // A later `unbind --all` finishes it once the remove has returned.
    b.gate.open();
    wait_for("the stuck mark to go", || k.stuck().is_empty());
    let report = b.pt(&k).restore_concurrent(&[], JOBS);
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    assert_eq!(b.driver("0000:03:00.0").as_deref(), Some("e1000e"));
    assert!(b.recorded().is_empty());
}

#[test]
fn a_concurrent_restore_overlaps_groups_and_reports_them_in_order() {
    let mut b = bed(Duration::from_millis(150));
    let fake = b.fake.clone();
    assert!(b.bind_all(&*fake).failed.is_empty());
    fake.reset_concurrency();
    // A VM holds group 6: skipped, record kept, while the others go back together.
    fake.busy_groups
        .lock()
        .unwrap()
        .insert(b.node.host.vfio_group_node(6));
    let report = b.pt(&*fake).restore_concurrent(&[], JOBS);
    let overlapped = fake.max_concurrent_probes();
    assert!(
        overlapped >= 2,
        "restores of different groups overlapped: {overlapped}"
    );
    assert!(report.failed.is_empty(), "{:?}", report.failed);
    let restored: Vec<String> = report.restored.iter().map(|(x, _)| x.to_string()).collect();
    assert_eq!(
        restored,
        [
            "0000:01:00.0",
            "0000:01:00.1",
            "0000:02:00.0",
            "0000:04:00.0"
        ]
    );
    assert_eq!(report.in_use, vec![(a("0000:03:00.0"), 6)]);
    assert_eq!(b.recorded(), vec![a("0000:03:00.0")]);
    assert_eq!(b.driver("0000:03:00.0").as_deref(), Some("vfio-pci"));
    // Members of one group went back in order: the card's fn0 before its companion.
    let log = fake.write_log();
    let unbind = |bdf: &str| {
        log.iter()
            .rposition(|w| w.contains(&format!("{bdf}/driver/unbind")))
            .unwrap()
    };
    assert!(unbind("0000:01:00.0") < unbind("0000:01:00.1"));
}
