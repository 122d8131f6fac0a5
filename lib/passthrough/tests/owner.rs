//! The node-wide owner lock: one owner at a time, a refusal naming the other, an
//! ownership that outlives its process while devices stay moved, and a device
//! count kept current by the state file.
//!
//! `flock` locks belong to an open file description, so two `Owner::take` calls in
//! one process contend exactly as two processes do.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use passthrough::owner::{Owner, OwnerError, OwnerRecord, Program};
use passthrough::state::{ClaimDevice, ClaimPhase, ClaimRecord, Record, RecordedRole, StateFile};
use sysfs_pci::error_chain;
use sysfs_pci::kernel::SysKernel;

fn scratch() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let lock = dir.path().join("run/owner/owner.lock");
    (dir, lock)
}

fn record_of(lock: &Path) -> OwnerRecord {
    OwnerRecord::parse(&std::fs::read_to_string(lock).unwrap())
        .unwrap()
        .unwrap()
}

/// A record left by a process that is gone.
fn left_behind(lock: &Path, owner: &str, devices: usize) -> String {
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    let text = format!(
        r#"{{"owner":"{owner}","pid":4242,"since":"2025-01-31T12:00:00Z","devices":{devices}}}"#
    );
    std::fs::write(lock, &text).unwrap();
    text
}

#[test]
fn the_second_taker_is_refused_while_the_first_holds_the_lock() {
    let (_dir, lock) = scratch();
    let manager = Owner::take(&lock, Program::VfioManager).unwrap();
    let me = std::process::id();
    assert_eq!(
        record_of(&lock),
        OwnerRecord {
            owner: Program::VfioManager,
            pid: me,
            since: manager.record().since.clone(),
            devices: 0,
        }
    );
    let err = Owner::take(&lock, Program::DraDriver).unwrap_err();
    let msg = error_chain(&err);
    for part in [
        &format!("vfio-manager (pid {me}, since "),
        &format!(
            "owns the devices of this node (lock {}); sandbox-dra-driver moves nothing",
            lock.display()
        ),
        "take the node out of vfio-manager's DaemonSet",
    ] {
        assert!(msg.contains(part), "{part:?} in {msg}");
    }
    assert!(err.by_other_program());
    // Another vfio-manager is refused too, told it is one of its own.
    let err = Owner::take(&lock, Program::VfioManager).unwrap_err();
    assert!(!err.by_other_program());
    assert!(
        err.to_string().contains("another vfio-manager is at work"),
        "{err}"
    );
    // The refusals wrote nothing.
    assert_eq!(record_of(&lock).pid, me);
    // Nothing moved: once the holder is gone, the other program may take the node.
    drop(manager);
    let driver = Owner::take(&lock, Program::DraDriver).unwrap();
    assert_eq!(record_of(&lock).owner, Program::DraDriver);
    let msg = Owner::take(&lock, Program::VfioManager)
        .unwrap_err()
        .to_string();
    assert!(msg.starts_with("sandbox-dra-driver (pid "), "{msg}");
    assert!(msg.contains("delete the ResourceClaims"), "{msg}");
    drop(driver);
}

#[test]
fn devices_left_moved_by_an_exited_owner_keep_the_other_program_out() {
    let (_dir, lock) = scratch();
    let text = left_behind(&lock, "vfio-manager", 2);
    let err = Owner::take(&lock, Program::DraDriver).unwrap_err();
    assert!(matches!(err, OwnerError::Owned { .. }));
    let msg = err.to_string();
    assert!(
        msg.starts_with(
            "vfio-manager (pid 4242, since 2025-01-31T12:00:00Z; exited with 2 device(s) still moved) owns the devices of this node"
        ),
        "{msg}"
    );
    assert_eq!(std::fs::read_to_string(&lock).unwrap(), text, "untouched");
    assert!(
        Owner::check(&lock, Program::DraDriver).is_err(),
        "a dry run sees it too"
    );
    // Its own program takes over, keeping the count until it knows better.
    let manager = Owner::take(&lock, Program::VfioManager).unwrap();
    let now = record_of(&lock);
    assert_eq!((now.pid, now.devices), (std::process::id(), 2));
    drop(manager);
    // With no device left, the record of the other program keeps nobody out.
    left_behind(&lock, "vfio-manager", 0);
    Owner::take(&lock, Program::DraDriver).unwrap();
    assert_eq!(record_of(&lock).owner, Program::DraDriver);
}

#[test]
fn a_garbled_record_names_no_owner() {
    let (_dir, lock) = scratch();
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    for text in [
        "{not json",
        "\u{0}\u{1}",
        r#"{"owner":"someone","devices":9}"#,
    ] {
        std::fs::write(&lock, text).unwrap();
        let owner = Owner::take(&lock, Program::DraDriver).unwrap();
        assert_eq!(record_of(&lock).owner, Program::DraDriver, "{text:?}");
        drop(owner);
    }
}

#[test]
fn a_symlinked_or_odd_lock_file_is_refused_not_followed() {
    let (dir, lock) = scratch();
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "keep").unwrap();
    std::os::unix::fs::symlink(&victim, &lock).unwrap();
    for program in [Program::VfioManager, Program::DraDriver] {
        let msg = error_chain(&Owner::take(&lock, program).unwrap_err());
        assert!(
            msg.contains("must be a regular file, not a symlink"),
            "{msg}"
        );
        assert!(Owner::check(&lock, program).is_err());
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    std::fs::remove_file(&lock).unwrap();
    std::fs::create_dir(&lock).unwrap();
    let msg = error_chain(&Owner::take(&lock, Program::VfioManager).unwrap_err());
    assert!(msg.contains(&lock.display().to_string()), "{msg}");
}

#[test]
fn a_dry_run_check_creates_nothing_and_sees_only_the_other_program() {
    let (dir, lock) = scratch();
    Owner::check(&lock, Program::VfioManager).unwrap();
    assert!(!lock.exists() && !lock.parent().unwrap().exists());
    let manager = Owner::take(&lock, Program::VfioManager).unwrap();
    Owner::check(&lock, Program::VfioManager).unwrap();
    let msg = Owner::check(&lock, Program::DraDriver)
        .unwrap_err()
        .to_string();
    assert!(msg.starts_with("vfio-manager (pid "), "{msg}");
    drop(manager);
    Owner::check(&lock, Program::DraDriver).unwrap();
    drop(dir);
}

fn rec(group: u32) -> Record {
    Record {
        original_driver: Some("e1000e".into()),
        original_override: None,
        driver: "vfio-pci".into(),
        role: RecordedRole::Selected,
        resource: Some("example.com/NIC_PT".into()),
        group,
    }
}

#[test]
fn each_state_save_keeps_the_device_count_current() {
    let (dir, lock) = scratch();
    let k = &SysKernel;
    let path = dir.path().join("run/state.json");
    let (a, b) = (
        "0000:01:00.0".parse().unwrap(),
        "0000:02:00.0".parse().unwrap(),
    );
    let mut state = StateFile::load(&path, true, passthrough::owner::Program::VfioManager).unwrap();
    state.record(k, a, rec(1)).unwrap();
    // Attaching counts what the state already holds.
    state
        .attach_owner(Owner::take(&lock, Program::DraDriver).unwrap())
        .unwrap();
    assert_eq!(record_of(&lock).devices, 1);
    state.record(k, b, rec(2)).unwrap();
    assert_eq!(record_of(&lock).devices, 2);
    // A claim holds its devices, moved or not; one device counts once.
    let claim = ClaimRecord {
        namespace: "vms".into(),
        name: "vm1".into(),
        phase: ClaimPhase::Prepared,
        devices: vec![
            ClaimDevice {
                request_names: vec!["nic".into()],
                pool: "node-a".into(),
                device: "pci-0000-02-00-0".into(),
                address: b,
                group: 2,
            },
            ClaimDevice {
                request_names: vec!["nic".into()],
                pool: "node-a".into(),
                device: "pci-0000-03-00-0".into(),
                address: "0000:03:00.0".parse().unwrap(),
                group: 3,
            },
        ],
    };
    state.set_claim(k, "uid-1", claim).unwrap();
    assert_eq!(record_of(&lock).devices, 3);
    state.drop_claim(k, "uid-1").unwrap();
    state.forget(k, &a).unwrap();
    state.forget(k, &b).unwrap();
    assert_eq!(record_of(&lock).devices, 0);
    // Dropped with nothing held: the other program may come.
    drop(state);
    Owner::take(&lock, Program::VfioManager).unwrap();
}
