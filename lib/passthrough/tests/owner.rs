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
use support::error_chain;
use sysfs_pci::kernel::SysKernel;

fn scratch() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let lock = dir.path().join("run/owner/owner.lock");
    (dir, lock)
}

/// The other program's state file, beside the lock's directory.
fn other_state(lock: &Path, program: Program) -> PathBuf {
    let other = match program {
        Program::VfioManager => "sandbox-dra-driver",
        Program::DraDriver => "vfio-manager",
    };
    lock.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join(other)
        .join("state.json")
}

fn take(lock: &Path, program: Program) -> Result<Owner, OwnerError> {
    Owner::take(lock, program, &other_state(lock, program))
}

fn check(lock: &Path, program: Program) -> Result<(), OwnerError> {
    Owner::check(lock, program, &other_state(lock, program))
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
    let manager = take(&lock, Program::VfioManager).unwrap();
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
    let err = take(&lock, Program::DraDriver).unwrap_err();
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
    let err = take(&lock, Program::VfioManager).unwrap_err();
    assert!(!err.by_other_program());
    assert!(
        err.to_string().contains("another vfio-manager is at work"),
        "{err}"
    );
    // The refusals wrote nothing.
    assert_eq!(record_of(&lock).pid, me);
    // Nothing moved: once the holder is gone, the other program may take the node.
    drop(manager);
    let driver = take(&lock, Program::DraDriver).unwrap();
    assert_eq!(record_of(&lock).owner, Program::DraDriver);
    let msg = take(&lock, Program::VfioManager).unwrap_err().to_string();
    assert!(msg.starts_with("sandbox-dra-driver (pid "), "{msg}");
    assert!(msg.contains("delete the ResourceClaims"), "{msg}");
    drop(driver);
}

#[test]
fn devices_left_moved_by_an_exited_owner_keep_the_other_program_out() {
    let (_dir, lock) = scratch();
    let text = left_behind(&lock, "vfio-manager", 2);
    let err = take(&lock, Program::DraDriver).unwrap_err();
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
        check(&lock, Program::DraDriver).is_err(),
        "a dry run sees it too"
    );
    // Its own program takes over, keeping the count until it knows better.
    let manager = take(&lock, Program::VfioManager).unwrap();
    let now = record_of(&lock);
    assert_eq!((now.pid, now.devices), (std::process::id(), 2));
    drop(manager);
    // With no device left, the record of the other program keeps nobody out.
    left_behind(&lock, "vfio-manager", 0);
    take(&lock, Program::DraDriver).unwrap();
    assert_eq!(record_of(&lock).owner, Program::DraDriver);
}

/// A state file of `program` at `path` recording one device moved.
fn moved_one(path: &Path, program: Program) -> StateFile {
    let mut state = StateFile::load(path, true, program).unwrap();
    state
        .record(&SysKernel, "0000:01:00.0".parse().unwrap(), rec(1))
        .unwrap();
    state
}

/// A garbled record says nothing either way: the other program's state file
/// decides. Nothing recorded there frees the node; a device recorded, or a file
/// that cannot be read, keeps it, naming that file.
#[test]
fn a_garbled_record_leaves_the_other_programs_state_file_to_decide() {
    let (_dir, lock) = scratch();
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    let garbled = [
        "{not json",
        "\u{0}\u{1}",
        r#"{"owner":"someone","devices":9}"#,
    ];
    for text in garbled {
        std::fs::write(&lock, text).unwrap();
        let owner = take(&lock, Program::DraDriver).unwrap();
        assert_eq!(record_of(&lock).owner, Program::DraDriver, "{text:?}");
        drop(owner);
    }
    let manager_state = other_state(&lock, Program::DraDriver);
    drop(moved_one(&manager_state, Program::VfioManager));
    for text in garbled {
        std::fs::write(&lock, text).unwrap();
        let err = take(&lock, Program::DraDriver).unwrap_err();
        assert!(
            matches!(err, OwnerError::Recorded { devices: 1, .. }),
            "{err:?}"
        );
        assert!(err.by_other_program());
        let msg = error_chain(&err);
        assert!(
            msg.starts_with(&format!(
                "vfio-manager's state file {} records 1 device(s) moved on this node; sandbox-dra-driver moves nothing while it does",
                manager_state.display()
            )),
            "{msg}"
        );
        assert_eq!(std::fs::read_to_string(&lock).unwrap(), text, "untouched");
        assert!(
            check(&lock, Program::DraDriver).is_err(),
            "a dry run sees it too"
        );
    }
    // In doubt: a state file that does not parse.
    std::fs::write(&manager_state, "{half a state").unwrap();
    let err = take(&lock, Program::DraDriver).unwrap_err();
    let msg = error_chain(&err);
    assert!(matches!(err, OwnerError::InDoubt { .. }), "{msg}");
    assert!(
        msg.contains(&format!(
            "its state file {} cannot be read",
            manager_state.display()
        )),
        "{msg}"
    );
    // vfio-manager itself is not kept out by its own file.
    std::fs::remove_file(&lock).unwrap();
    take(&lock, Program::VfioManager).unwrap();
}

/// A lock file deleted (an `rm -rf` of its directory, a tmpfs cleanup) or replaced
/// while held: the next taker locks a new file, so the holder must notice. Either
/// way round, only one moves devices: a newcomer is refused while the holder's
/// state file records a device; a holder whose path was taken by another stops
/// recording (so moving) devices and names the lock; one whose path is free takes
/// it again.
#[test]
fn a_lock_deleted_or_replaced_while_held_cannot_make_two_owners() {
    for replace in [false, true] {
        let (_dir, lock) = scratch();
        let manager_state = other_state(&lock, Program::DraDriver);
        let mut state = moved_one(&manager_state, Program::VfioManager);
        state
            .attach_owner(take(&lock, Program::VfioManager).unwrap())
            .unwrap();
        let gone = |lock: &Path| {
            if replace {
                let fresh = lock.with_extension("new");
                std::fs::write(&fresh, "").unwrap();
                std::fs::rename(&fresh, lock).unwrap();
            } else {
                std::fs::remove_dir_all(lock.parent().unwrap()).unwrap();
            }
        };
        gone(&lock);
        // The driver comes: the manager's state file keeps it out.
        let err = take(&lock, Program::DraDriver).unwrap_err();
        assert!(matches!(err, OwnerError::Recorded { .. }), "{err:?}");
        // The manager notices at its next resync, and takes the path again.
        state.ensure_owner().unwrap();
        assert_eq!(record_of(&lock).owner, Program::VfioManager);
        assert_eq!(record_of(&lock).devices, 1, "its count carried over");
        assert!(take(&lock, Program::DraDriver).is_err());

        // With nothing recorded, the newcomer gets a new file; the holder's next
        // save that would move a device is refused, and nothing is recorded.
        state
            .forget(&SysKernel, &"0000:01:00.0".parse().unwrap())
            .unwrap();
        gone(&lock);
        let driver = take(&lock, Program::DraDriver).unwrap();
        let before = std::fs::read_to_string(&manager_state).unwrap();
        let err = state
            .record(&SysKernel, "0000:02:00.0".parse().unwrap(), rec(2))
            .unwrap_err();
        let msg = error_chain(&err);
        // Deleted first or not, the driver's take made a new file there.
        assert!(
            msg.contains(&format!(
                "the owner lock {} was replaced by another file while this vfio-manager held it",
                lock.display()
            )),
            "{msg}"
        );
        assert!(
            msg.contains("sandbox-dra-driver (pid "),
            "names the new owner: {msg}"
        );
        assert_eq!(std::fs::read_to_string(&manager_state).unwrap(), before);
        assert!(state.state().devices.is_empty());
        assert!(state.ensure_owner().is_err(), "still not ours");
        assert_eq!(record_of(&lock).owner, Program::DraDriver);
        // Once the driver lets go, the manager takes the node again by itself.
        drop(driver);
        state
            .record(&SysKernel, "0000:02:00.0".parse().unwrap(), rec(2))
            .unwrap();
        assert_eq!(record_of(&lock).owner, Program::VfioManager);
        assert_eq!(record_of(&lock).devices, 1);
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
        let msg = error_chain(&take(&lock, program).unwrap_err());
        assert!(
            msg.contains("must be a regular file, not a symlink"),
            "{msg}"
        );
        assert!(check(&lock, program).is_err());
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
    std::fs::remove_file(&lock).unwrap();
    std::fs::create_dir(&lock).unwrap();
    let msg = error_chain(&take(&lock, Program::VfioManager).unwrap_err());
    assert!(msg.contains(&lock.display().to_string()), "{msg}");
}

#[test]
fn a_dry_run_check_creates_nothing_and_sees_only_the_other_program() {
    let (dir, lock) = scratch();
    check(&lock, Program::VfioManager).unwrap();
    assert!(!lock.exists() && !lock.parent().unwrap().exists());
    let manager = take(&lock, Program::VfioManager).unwrap();
    check(&lock, Program::VfioManager).unwrap();
    let msg = check(&lock, Program::DraDriver).unwrap_err().to_string();
    assert!(msg.starts_with("vfio-manager (pid "), "{msg}");
    drop(manager);
    check(&lock, Program::DraDriver).unwrap();
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
        .attach_owner(take(&lock, Program::DraDriver).unwrap())
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
    take(&lock, Program::VfioManager).unwrap();
}
