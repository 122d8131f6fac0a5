//! A write that never returns, on the fake kernel: the deadline, the stuck mark, the
//! refusal of a second write, the other devices going on, and the release.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::bind;
use crate::testing::{scratch_root, FakeDevice, FakeKernel, FakeNode, Gate};
use crate::PciDevice;

struct Node {
    _dir: tempfile::TempDir,
    node: FakeNode,
    fake: Arc<FakeKernel>,
    gate: Arc<Gate>,
}

/// Two devices on the native driver `nvidia`, each its own group; every unbind of
/// `0000:01:00.0` hangs until the gate opens.
fn node() -> Node {
    let dir = tempfile::tempdir_in(scratch_root()).unwrap();
    let node = FakeNode::new(dir.path());
    node.add_driver("vfio-pci");
    node.add_driver("nvidia");
    node.add_device(
        &FakeDevice::new("0000:01:00.0", 0x10de, 0x2330, 0x30200)
            .driver("nvidia")
            .group(1),
    );
    node.add_device(
        &FakeDevice::new("0000:02:00.0", 0x10de, 0x2330, 0x30200)
            .driver("nvidia")
            .group(2),
    );
    let fake = FakeKernel::new(&node);
    fake.learn_native_drivers();
    let gate = Gate::new();
    *fake.hang_on.lock().unwrap() = Some(("0000:01:00.0/driver/unbind".into(), gate.clone()));
    Node {
        _dir: dir,
        node,
        fake: Arc::new(fake),
        gate,
    }
}

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

fn bind_to_vfio(n: &Node, k: &dyn Kernel, a: &str) -> Result<bind::BindOutcome, bind::DriverError> {
    let dev = PciDevice::read(&n.node.host, &addr(a)).unwrap();
    bind::bind(&n.node.host, k, &dev, "vfio-pci")
}

/// Waits (bounded) until `done` holds; the event, not a guess of its timing.
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
fn a_write_that_never_returns_names_device_file_and_driver_and_marks_it_stuck() {
    let n = node();
    let k = Bounded::new(n.fake.clone(), Duration::from_millis(200));
    let err = bind_to_vfio(&n, &k, "0000:01:00.0").unwrap_err();
    let text = support::error_chain(&err);
    for part in [
        "0000:01:00.0",
        "driver/unbind",
        "driver nvidia is stuck",
        "0.2 s",
    ] {
        assert!(text.contains(part), "{part} missing from: {text}");
    }
    let stuck = k.stuck();
    assert_eq!(stuck.len(), 1);
    assert_eq!(stuck[0].address, addr("0000:01:00.0"));
    assert_eq!(stuck[0].driver.as_deref(), Some("nvidia"));
    assert!(stuck[0].path.ends_with("0000:01:00.0/driver/unbind"));
    assert_eq!(k.stuck_writes(), stuck, "the Kernel trait reports the same");
}

#[test]
fn no_second_write_starts_on_a_stuck_device_and_others_go_on() {
    let n = node();
    let k = Bounded::new(n.fake.clone(), Duration::from_millis(200));
    bind_to_vfio(&n, &k, "0000:01:00.0").unwrap_err();
    let writes_before = n.fake.write_log().len();
    // Another bind of the stuck device is refused before anything reaches the kernel.
    let err = bind_to_vfio(&n, &k, "0000:01:00.0").unwrap_err();
    let text = support::error_chain(&err);
    assert!(text.contains("an earlier write to 0000:01:00.0"), "{text}");
    assert_eq!(
        n.fake.write_log().len(),
        writes_before,
        "nothing more was written"
    );
    assert_eq!(
        n.gate.reached.load(Ordering::SeqCst),
        1,
        "one write hangs, never two"
    );
    // So is a restore's first write (its override), a different file of that device.
    let dev = PciDevice::read(&n.node.host, &addr("0000:01:00.0")).unwrap();
    bind::restore(&n.node.host, &k, &dev, Some("nvidia"), None).unwrap_err();
    assert_eq!(n.fake.write_log().len(), writes_before);
    // The other device binds meanwhile.
    bind_to_vfio(&n, &k, "0000:02:00.0").unwrap();
    assert_eq!(
        n.node.driver_of(&addr("0000:02:00.0")).as_deref(),
        Some("vfio-pci")
    );
}

#[test]
fn a_stuck_write_that_returns_frees_its_device() {
    let n = node();
    let k = Bounded::new(n.fake.clone(), Duration::from_millis(200));
    bind_to_vfio(&n, &k, "0000:01:00.0").unwrap_err();
    n.gate.open();
    wait_for("the stuck mark to go", || k.stuck().is_empty());
    // The late unbind took effect; the device is on no driver, and binds now.
    assert_eq!(n.node.driver_of(&addr("0000:01:00.0")), None);
    bind_to_vfio(&n, &k, "0000:01:00.0").unwrap();
    assert_eq!(
        n.node.driver_of(&addr("0000:01:00.0")).as_deref(),
        Some("vfio-pci")
    );
}

#[test]
fn a_write_within_the_deadline_keeps_its_own_result() {
    let n = node();
    *n.fake.hang_on.lock().unwrap() = None;
    *n.fake.fail_on.lock().unwrap() = Some(("drivers_probe".into(), 22));
    let k = Bounded::new(n.fake.clone(), Duration::from_secs(30));
    let err = bind_to_vfio(&n, &k, "0000:02:00.0").unwrap_err();
    let text = support::error_chain(&err);
    assert!(
        text.contains("drivers_probe") && text.contains("Invalid argument"),
        "{text}"
    );
    assert!(k.stuck().is_empty());
    bind_to_vfio(&n, &k, "0000:01:00.0").unwrap();
}

#[test]
fn the_device_of_a_write_is_the_address_written_or_the_directory() {
    let p = Path::new("/sys/bus/pci/devices/0000:3b:00.0/driver_override");
    assert_eq!(device_of(p, "vfio-pci"), Some(addr("0000:3b:00.0")));
    assert_eq!(
        device_of(Path::new("/sys/bus/pci/drivers_probe"), "0000:3b:00.1\n"),
        Some(addr("0000:3b:00.1"))
    );
    assert_eq!(
        device_of(Path::new("/sys/module/x/parameters/y"), "1"),
        None
    );
}

impl Drop for Node {
    /// Lets a write still held go, so no test leaves a thread blocked behind it.
    fn drop(&mut self) {
        self.gate.open();
    }
}
