//! The node-wide owner lock: one owner at a time, a refusal naming the other, an
//! ownership that outlives its process while devices stay moved, and a device
//! count kept current by the state file.
//!
//! `flock` locks belong to an open file description, so two `Owner::take` calls in
//! one process contend exactly as two processes do.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use passthrough::owner::{Contender, Owner, OwnerError, OwnerRecord, Program};
use passthrough::state::{Record, RecordedRole, Records, StateFile};
use support::error_chain;
use sysfs_pci::kernel::SysKernel;
use sysfs_pci::PciAddress;

fn scratch() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let lock = dir.path().join("run/owner/owner.lock");
    (dir, lock)
}

const MANAGER: &Program = &Program {
    name: "vfio-manager",
    release_hint: "take the node out of vfio-manager's DaemonSet",
    lock_hint: "",
};
const DRIVER: &Program = &Program {
    name: "sandbox-dra-driver",
    release_hint: "delete the ResourceClaims prepared on this node",
    lock_hint: "",
};

/// The other program's state file, beside the lock's directory.
fn other_state(lock: &Path, program: &'static Program) -> PathBuf {
    let other = if program == MANAGER { DRIVER } else { MANAGER };
    lock.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join(other.name)
        .join("state.json")
}

fn contender(lock: &Path, program: &'static Program) -> Contender {
    let rival = if program == MANAGER { DRIVER } else { MANAGER };
    Contender::new(program, rival, other_state(lock, program))
}

fn take(lock: &Path, program: &'static Program) -> Result<Owner, OwnerError> {
    Owner::take(lock, &contender(lock, program))
}

fn check(lock: &Path, program: &'static Program) -> Result<(), OwnerError> {
    Owner::check(lock, &contender(lock, program))
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
    let manager = take(&lock, MANAGER).unwrap();
    let me = std::process::id();
    assert_eq!(
        record_of(&lock),
        OwnerRecord {
            owner: MANAGER.name.into(),
            pid: me,
            since: manager.record().since.clone(),
            devices: 0,
        }
    );
    let err = take(&lock, DRIVER).unwrap_err();
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
    let err = take(&lock, MANAGER).unwrap_err();
    assert!(!err.by_other_program());
    assert!(
        err.to_string().contains("another vfio-manager is at work"),
        "{err}"
    );
    // The refusals wrote nothing.
    assert_eq!(record_of(&lock).pid, me);
    // Nothing moved: once the holder is gone, the other program may take the node.
    drop(manager);
    let driver = take(&lock, DRIVER).unwrap();
    assert_eq!(record_of(&lock).owner, DRIVER.name);
    let msg = take(&lock, MANAGER).unwrap_err().to_string();
    assert!(msg.starts_with("sandbox-dra-driver (pid "), "{msg}");
    assert!(msg.contains("delete the ResourceClaims"), "{msg}");
    drop(driver);
}

#[test]
fn devices_left_moved_by_an_exited_owner_keep_the_other_program_out() {
    let (_dir, lock) = scratch();
    let text = left_behind(&lock, "vfio-manager", 2);
    let err = take(&lock, DRIVER).unwrap_err();
    assert!(matches!(err, OwnerError::Owned { .. }));
    let msg = err.to_string();
    assert!(
        msg.starts_with(
            "vfio-manager (pid 4242, since 2025-01-31T12:00:00Z; exited with 2 \
                device(s) still moved) owns the devices of this node"
        ),
        "{msg}"
    );
    assert_eq!(std::fs::read_to_string(&lock).unwrap(), text, "untouched");
    assert!(check(&lock, DRIVER).is_err(), "a dry run sees it too");
    // Its own program takes over, keeping the count until it knows better.
    let manager = take(&lock, MANAGER).unwrap();
    let now = record_of(&lock);
    assert_eq!((now.pid, now.devices), (std::process::id(), 2));
    drop(manager);
    // With no device left, the record of the other program keeps nobody out.
    left_behind(&lock, "vfio-manager", 0);
    take(&lock, DRIVER).unwrap();
    assert_eq!(record_of(&lock).owner, DRIVER.name);
}

/// A state file of `program` at `path` recording one device moved.
fn moved_one(path: &Path, program: &'static Program) -> StateFile {
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
        let owner = take(&lock, DRIVER).unwrap();
        assert_eq!(record_of(&lock).owner, DRIVER.name, "{text:?}");
        drop(owner);
    }
    let manager_state = other_state(&lock, DRIVER);
    drop(moved_one(&manager_state, MANAGER));
    for text in garbled {
        std::fs::write(&lock, text).unwrap();
        let err = take(&lock, DRIVER).unwrap_err();
        assert!(
            matches!(err, OwnerError::Recorded { devices: 1, .. }),
            "{err:?}"
        );
        assert!(err.by_other_program());
        let msg = error_chain(&err);
        assert!(
            msg.starts_with(&format!(
                "vfio-manager's state file {} records 1 device(s) moved on this node; \
                    sandbox-dra-driver moves nothing while it does",
                manager_state.display()
            )),
            "{msg}"
        );
        assert_eq!(std::fs::read_to_string(&lock).unwrap(), text, "untouched");
        assert!(check(&lock, DRIVER).is_err(), "a dry run sees it too");
    }
    // In doubt: a state file that does not parse.
    std::fs::write(&manager_state, "{half a state").unwrap();
    let err = take(&lock, DRIVER).unwrap_err();
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
    take(&lock, MANAGER).unwrap();
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
        let manager_state = other_state(&lock, DRIVER);
        let mut state = moved_one(&manager_state, MANAGER);
        state.attach_owner(take(&lock, MANAGER).unwrap()).unwrap();
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
        let err = take(&lock, DRIVER).unwrap_err();
        assert!(matches!(err, OwnerError::Recorded { .. }), "{err:?}");
        // The manager notices at its next resync, and takes the path again.
        state.ensure_owner().unwrap();
        assert_eq!(record_of(&lock).owner, MANAGER.name);
        assert_eq!(record_of(&lock).devices, 1, "its count carried over");
        assert!(take(&lock, DRIVER).is_err());

        // With nothing recorded, the newcomer gets a new file; the holder's next
        // save that would move a device is refused, and nothing is recorded.
        state
            .forget(&SysKernel, &"0000:01:00.0".parse().unwrap())
            .unwrap();
        gone(&lock);
        let driver = take(&lock, DRIVER).unwrap();
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
        assert_eq!(record_of(&lock).owner, DRIVER.name);
        // Once the driver lets go, the manager takes the node again by itself.
        drop(driver);
        state
            .record(&SysKernel, "0000:02:00.0".parse().unwrap(), rec(2))
            .unwrap();
        assert_eq!(record_of(&lock).owner, MANAGER.name);
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
    for program in [MANAGER, DRIVER] {
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
    let msg = error_chain(&take(&lock, MANAGER).unwrap_err());
    assert!(msg.contains(&lock.display().to_string()), "{msg}");
}

#[test]
fn a_dry_run_check_creates_nothing_and_sees_only_the_other_program() {
    let (dir, lock) = scratch();
    check(&lock, MANAGER).unwrap();
    assert!(!lock.exists() && !lock.parent().unwrap().exists());
    let manager = take(&lock, MANAGER).unwrap();
    check(&lock, MANAGER).unwrap();
    let msg = check(&lock, DRIVER).unwrap_err().to_string();
    assert!(msg.starts_with("vfio-manager (pid "), "{msg}");
    drop(manager);
    check(&lock, DRIVER).unwrap();
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
    let mut state: StateFile<Held> = StateFile::load(&path, true, DRIVER).unwrap();
    state.record(k, a, rec(1)).unwrap();
    // Attaching counts what the state already holds.
    state.attach_owner(take(&lock, DRIVER).unwrap()).unwrap();
    assert_eq!(record_of(&lock).devices, 1);
    state.record(k, b, rec(2)).unwrap();
    assert_eq!(record_of(&lock).devices, 2);
    // The program's own records hold devices, moved or not; one device counts once.
    let c: PciAddress = "0000:03:00.0".parse().unwrap();
    state.update_records(k, |r| r.0 = vec![b, c]).unwrap();
    assert_eq!(record_of(&lock).devices, 3);
    state.update_records(k, |r| r.0.clear()).unwrap();
    state.forget(k, &a).unwrap();
    state.forget(k, &b).unwrap();
    assert_eq!(record_of(&lock).devices, 0);
    // Dropped with nothing held: the other program may come.
    drop(state);
    take(&lock, MANAGER).unwrap();
}

/// Records that hold devices, as the DRA driver's claims do.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
struct Held(Vec<PciAddress>);

impl Records for Held {
    const KEY: &'static str = "held";
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn devices(&self) -> Vec<PciAddress> {
        self.0.clone()
    }
}
