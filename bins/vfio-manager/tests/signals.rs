//! The real `vfio-manager` binary and the things a node does to it besides commands:
//! a hang-up, and a dry run beside a VM that is starting.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Stdio;

mod common;
use common::command;
use std::time::{Duration, Instant};

use sysfs_pci::testing::{FakeDevice, FakeNode};

fn node(dir: &Path) -> FakeNode {
    common::nic_node(dir, &[("0000:01:00.0", "vfio-pci", 4)])
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sighup_stops_run_like_sigterm() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let ready = dir.path().join("run/ready");
    let mut child = command(dir.path())
        .args(["run", "--ready-file", &ready.to_string_lossy()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_until("the ready file", || ready.exists());
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "run ignored SIGHUP"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "killed by a signal instead of stopping: {status:?}\n{err}"
    );
    assert!(err.contains("SIGHUP"), "{err}");
    assert!(!ready.exists(), "the ready file must go with the process");
}

#[test]
fn a_dry_run_unbind_never_opens_the_group_node() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    let state = r#"{"version":1,"devices":{"0000:01:00.0":{"original_driver":"e1000e","original_override":null,"driver":"vfio-pci","role":"selected","group":4}},"unloaded_modules":[]}"#;
    std::fs::create_dir_all(dir.path().join("run")).unwrap();
    std::fs::write(dir.path().join("run/state.json"), state).unwrap();
    let group_node = node.host.vfio_group_node(4);
    assert!(group_node.exists());
    let mut watch = inotify::Inotify::init().unwrap();
    watch
        .watches()
        .add(&group_node, inotify::WatchMask::OPEN)
        .unwrap();
    let out = command(dir.path())
        .args(["unbind", "--all", "--dry-run"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("would write"), "{text}");
    let mut buf = [0u8; 1024];
    let opened = match watch.read_events(&mut buf) {
        Ok(events) => events.count(),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(opened, 0, "the dry run opened {}", group_node.display());
    // The real unbind does open it (to test for a holder): the watch can see opens.
    let out = command(dir.path())
        .args(["unbind", "--all"])
        .output()
        .unwrap();
    let _ = out;
    let seen = match watch.read_events(&mut buf) {
        Ok(events) => events.count(),
        Err(_) => 0,
    };
    assert!(
        seen > 0,
        "the watch saw no open at all, so it proves nothing"
    );
}

#[test]
fn run_logs_an_unreadable_device_once_and_keeps_the_rest() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    node.add_device(&FakeDevice::new("0000:03:00.0", 0x8086, 0x10d3, 0x02_0000).group(7));
    let bad = node.host.device_dir(&"0000:03:00.0".parse().unwrap());
    std::fs::write(bad.join("class"), "garbage\n").unwrap();
    let ready = dir.path().join("run/ready");
    let child = command(dir.path())
        .args([
            "run",
            "--resync-interval",
            "50ms",
            "--ready-file",
            &ready.to_string_lossy(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_until("the ready file", || ready.exists());
    std::thread::sleep(Duration::from_millis(500)); // about ten resyncs
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("device left out").count(), 1, "{err}");
    assert!(
        err.contains("0000:03:00.0") && err.contains("class"),
        "{err}"
    );
}

/// Follows a child's stderr into lines another thread can read.
fn follow(stderr: std::process::ChildStderr) -> std::sync::Arc<std::sync::Mutex<String>> {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let out = seen.clone();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let mut s = out.lock().unwrap();
            s.push_str(&line);
            s.push('\n');
        }
    });
    seen
}

#[test]
fn an_unbind_that_never_returns_is_named_and_run_goes_on() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    node.add_device(
        &FakeDevice::new("0000:02:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("e1000e")
            .group(5),
    );
    // e1000e's unbind file is a FIFO: opening it for writing blocks in the kernel
    // until someone reads, as a remove that never returns blocks the writer.
    let unbind = node.host.driver_dir("e1000e").join("unbind");
    std::fs::remove_file(&unbind).unwrap();
    nix::unistd::mkfifo(
        &unbind,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .unwrap();
    let ready = dir.path().join("run/ready");
    let stuck = dir.path().join("run/stuck.json");
    let mut child = command(dir.path())
        .args(["run", "--ready-file", &ready.to_string_lossy()])
        .args(["--write-timeout", "1s", "--resync-interval", "1s"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = follow(child.stderr.take().unwrap());
    wait_until("the stuck write in the log", || {
        log.lock()
            .unwrap()
            .contains("a sysfs write has not returned")
    });
    wait_until("the stuck file", || stuck.exists());
    let listed = std::fs::read_to_string(&stuck).unwrap();
    assert!(
        listed.contains("0000:02:00.0")
            && listed.contains("driver e1000e")
            && listed.contains("unbind"),
        "{listed}"
    );
    // The probe says why the node is not ready.
    let out = command(dir.path())
        .args(["ready", "--ready-file", &ready.to_string_lossy()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("stuck: 0000:02:00.0"), "{text}");
    // run is not frozen: its passes go on, and never write to the device again.
    let passes = |s: &str| s.matches("bind failed; will retry").count();
    let before = passes(&log.lock().unwrap());
    wait_until("two more passes", || {
        passes(&log.lock().unwrap()) >= before + 2
    });
    assert!(!ready.exists());
    // The remove returns: exactly one write reached the file, and the mark goes.
    let mut held = std::fs::File::open(&unbind).unwrap();
    let mut written = String::new();
    std::io::Read::read_to_string(&mut held, &mut written).unwrap();
    assert_eq!(written, "0000:02:00.0", "one write, whole");
    wait_until("the stuck file to go", || !stuck.exists());
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "run ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = log.lock().unwrap();
    assert!(log.contains("a stuck sysfs write returned"), "{log}");
}
