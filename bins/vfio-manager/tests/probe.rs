//! `vfio-manager ready` (the readiness probe) and output to a closed pipe.

#![allow(clippy::unwrap_used)]

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};

mod common;
use common::command;
use sysfs_pci::testing::FakeNode;

fn node(dir: &Path, driver: &str) -> FakeNode {
    let node = common::nic_node(dir, &[("0000:01:00.0", driver, 4)]);
    std::fs::create_dir_all(dir.join("run")).unwrap();
    node
}

fn ready(dir: &Path) -> (Option<i32>, String) {
    let out = command(dir)
        .args([
            "--ready-file",
            &dir.join("run/ready").to_string_lossy(),
            "ready",
        ])
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn ready_needs_the_ready_file_and_the_devices_still_bound() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path(), "vfio-pci");
    let (code, out) = ready(dir.path());
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("run/ready does not exist"), "{out}");

    std::fs::write(
        dir.path().join("run/ready"),
        r#"{"devices":["0000:01:00.0"],"groups":[4],"time":1}"#,
    )
    .unwrap();
    let (code, out) = ready(dir.path());
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("ready: 1 device(s) bound"), "{out}");

    for junk in [
        "",
        "not json",
        "{}",
        r#"{"devices":[1]}"#,
        r#"{"devices":["zz:zz"]}"#,
    ] {
        std::fs::write(dir.path().join("run/ready"), junk).unwrap();
        let (code, out) = ready(dir.path());
        assert_eq!(code, Some(1), "{junk:?}: {out}");
        assert!(out.contains("is not a ready file"), "{junk:?}: {out}");
    }
    std::fs::remove_file(dir.path().join("run/ready")).unwrap();
    std::fs::create_dir(dir.path().join("run/ready")).unwrap();
    let (code, out) = ready(dir.path());
    assert_eq!(code, Some(1), "a directory is not a ready file: {out}");
    assert!(
        out.contains("it is a directory, not a regular file"),
        "{out}"
    );
    // A FIFO with no writer would block an open(2) for reading forever: the probe
    // must refuse it without opening it (the test hangs, and its harness times
    // out, if it does not).
    std::fs::remove_dir(dir.path().join("run/ready")).unwrap();
    nix::unistd::mkfifo(&dir.path().join("run/ready"), nix::sys::stat::Mode::S_IRWXU).unwrap();
    let (code, out) = ready(dir.path());
    assert_eq!(code, Some(1), "a FIFO is not a ready file: {out}");
    assert!(out.contains("it is a FIFO, not a regular file"), "{out}");
    // Nor is a file far bigger than any ready file.
    std::fs::remove_file(dir.path().join("run/ready")).unwrap();
    std::fs::write(dir.path().join("run/ready"), vec![b' '; 2 << 20]).unwrap();
    let (code, out) = ready(dir.path());
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("it is larger than 1048576 bytes"), "{out}");
}

#[test]
fn ready_fails_when_a_listed_device_left_vfio() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path(), "e1000e");
    std::fs::write(
        dir.path().join("run/ready"),
        r#"{"devices":["0000:01:00.0"],"groups":[4],"time":1}"#,
    )
    .unwrap();
    let (code, out) = ready(dir.path());
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("0000:01:00.0 is on e1000e, not vfio-pci"),
        "{out}"
    );

    std::fs::write(
        dir.path().join("run/ready"),
        r#"{"devices":["0000:09:00.0"],"groups":[],"time":1}"#,
    )
    .unwrap();
    let (code, out) = ready(dir.path());
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("0000:09:00.0 (listed in"), "{out}");
}

/// Runs `cmd` with stdout a pipe nobody reads (`| head` after head exited).
fn with_closed_stdout(mut cmd: Command) -> std::process::ExitStatus {
    let (read, write) = nix::unistd::pipe().unwrap();
    drop(read);
    cmd.stdout(Stdio::from(write))
        .stderr(Stdio::null())
        .status()
        .unwrap()
}

#[test]
fn a_closed_stdout_never_kills_a_command() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path(), "e1000e");
    let cases: [(&[&str], i32); 7] = [
        (&["--help"], 0),
        (&["--version"], 0),
        (&["status"], 0),
        (&["status", "--output", "json"], 0),
        (&["bind", "--all", "--dry-run"], 0),
        (&["unbind", "--all", "--dry-run"], 0),
        (&["ready"], 1),
    ];
    for (args, want) in cases {
        let mut c = command(dir.path());
        c.args(args);
        let status = with_closed_stdout(c);
        assert_eq!(
            status.signal(),
            None,
            "vfio-manager {args:?} was killed by a signal: {status:?}"
        );
        assert_eq!(
            status.code(),
            Some(want),
            "vfio-manager {args:?}: {status:?}"
        );
    }
}

#[test]
fn a_closed_stderr_never_kills_run() {
    // `vfio-manager run 2>&1 | head -1`: logs go to a pipe that closed.
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path(), "vfio-pci");
    let ready_file = dir.path().join("run/ready");
    let (read, write) = nix::unistd::pipe().unwrap();
    drop(read);
    let mut child = command(dir.path())
        .args([
            "--ready-file",
            &ready_file.to_string_lossy(),
            "run",
            "--log-level",
            "debug",
        ])
        .env_remove("NODE_NAME")
        .stdout(Stdio::null())
        .stderr(Stdio::from(write))
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while !ready_file.exists() {
        if let Some(s) = child.try_wait().unwrap() {
            panic!("run died with its stderr closed: {s:?}");
        }
        assert!(start.elapsed() < std::time::Duration::from_secs(10));
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), None, "{status:?}");
    assert_eq!(status.code(), Some(0), "{status:?}");
}
