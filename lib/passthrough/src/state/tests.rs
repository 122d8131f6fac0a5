use super::*;
use sysfs_pci::kernel::SysKernel;

static VM: crate::owner::Program = crate::owner::Program::named("vfio-manager");

/// The state file at `path`, with no records of its own.
fn load(path: &Path, persist: bool) -> Result<StateFile, StateError> {
    StateFile::load(path, persist, &VM)
}
const K: &SysKernel = &SysKernel;

fn rec() -> Record {
    Record {
        original_driver: Some("e1000e".into()),
        original_override: None,
        driver: "vfio-pci".into(),
        role: RecordedRole::Selected,
        resource: Some("example.com/NIC_PT".into()),
        group: 3,
    }
}

#[test]
fn round_trips_and_first_record_wins() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let path = dir.path().join("run/state.json");
    let a: PciAddress = "0000:01:00.0".parse().unwrap();
    let mut f = load(&path, true).unwrap();
    f.record(K, a, rec()).unwrap();
    let mut later = rec();
    later.original_driver = Some("vfio-pci".into());
    f.record(K, a, later).unwrap();
    let back = load(&path, false).unwrap();
    assert_eq!(back.state().devices[&a], rec());
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("\"0000:01:00.0\""), "{text}");
}

#[test]
fn forget_empties_the_record() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let path = dir.path().join("state.json");
    let a: PciAddress = "0000:01:00.0".parse().unwrap();
    let mut f = load(&path, true).unwrap();
    f.record(K, a, rec()).unwrap();
    f.forget(K, &a).unwrap();
    assert!(load(&path, false).unwrap().state().devices.is_empty());
}

#[test]
fn dry_run_never_writes() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let path = dir.path().join("state.json");
    let mut f = load(&path, false).unwrap();
    f.record(K, "0000:01:00.0".parse().unwrap(), rec()).unwrap();
    assert!(!path.exists());
}

#[test]
fn a_second_writer_is_refused_while_the_first_holds_the_lock() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let path = dir.path().join("state.json");
    let first = load(&path, true).unwrap();
    let msg = load(&path, true).unwrap_err().to_string();
    assert!(
        msg.contains("state.json.lock is locked by another vfio-manager"),
        "{msg}"
    );
    assert!(load(&path, false).is_ok(), "readers need no lock");
    drop(first);
    assert!(load(&path, true).is_ok());
}

#[test]
fn corrupt_file_is_named() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let path = dir.path().join("state.json");
    std::fs::write(&path, "{\"version\":1,\"devices\":{\"nope\":{}}}").unwrap();
    let msg = load(&path, true).unwrap_err().to_string();
    assert!(msg.contains("state.json is corrupt"), "{msg}");
}

/// A kernel whose state saves fail, like a read-only or full /run.
struct FullDisk;
impl Kernel for FullDisk {
    fn write(&self, _: &Path, _: &str) -> Result<(), IoError> {
        Ok(())
    }
    fn load_module(&self, _: &str, _: &Path) -> Result<(), sysfs_pci::kernel::SyscallError> {
        Ok(())
    }
    fn unload_module(&self, _: &str) -> Result<(), sysfs_pci::kernel::SyscallError> {
        Ok(())
    }
    fn replace_file(&self, path: &Path, _: &[u8]) -> Result<(), IoError> {
        Err(IoError::new(
            support::io::Action::Rename,
            path,
            std::io::Error::from_raw_os_error(nix::libc::ENOSPC),
        ))
    }
    fn group_in_use(&self, _: &Path) -> Result<bool, IoError> {
        Ok(false)
    }
}

#[test]
fn a_failed_save_leaves_memory_as_it_was() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let path = dir.path().join("state.json");
    let a: PciAddress = "0000:01:00.0".parse().unwrap();
    let mut f = load(&path, true).unwrap();
    assert!(f.record(&FullDisk, a, rec()).is_err());
    assert!(
        f.get(&a).is_none(),
        "memory must not claim an unsaved record"
    );
    assert!(f.note_unloaded(&FullDisk, "e1000e").is_err());
    assert!(f.state().unloaded_modules.is_empty());
    // The next attempt writes again.
    f.record(K, a, rec()).unwrap();
    f.note_unloaded(K, "e1000e").unwrap();
    let back = StateFile::<NoRecords>::load(
        &dir.path().join("state.json"),
        false,
        &const { crate::owner::Program::named("vfio-manager") },
    )
    .unwrap();
    assert_eq!(back.state().devices[&a], rec());
    assert_eq!(back.state().unloaded_modules, ["e1000e"]);
    // A failed forget keeps the record on disk and in memory alike.
    assert!(f.forget(&FullDisk, &a).is_err());
    assert!(f.get(&a).is_some());
    assert!(f.clear_unloaded(&FullDisk).is_err());
    assert_eq!(f.state().unloaded_modules, ["e1000e"]);
}

#[test]
fn an_unknown_version_is_refused_and_the_file_is_left_alone() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let path = dir.path().join("state.json");
    let text = r#"{"version":2,"devices":{},"unloaded_modules":[],"future":true}"#;
    std::fs::write(&path, text).unwrap();
    let msg = support::error_chain(&load(&path, true).unwrap_err());
    assert!(msg.contains("format version 2"), "{msg}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
}

#[test]
fn two_spellings_of_one_address_are_one_record_or_an_error() {
    let p = Path::new("state.json");
    let r = serde_json::to_string(&rec()).unwrap();
    let same = format!(r#"{{"version":1,"devices":{{"01:00.0":{r},"0000:01:00.0":{r}}}}}"#);
    let state = State::<NoRecords>::parse(p, &same, &VM).unwrap();
    assert_eq!(state.devices.len(), 1);
    let mut other = rec();
    other.original_driver = None;
    let o = serde_json::to_string(&other).unwrap();
    let clash = format!(r#"{{"version":1,"devices":{{"0000:01:00.0":{r},"01:00.0":{o}}}}}"#);
    let msg = State::<NoRecords>::parse(p, &clash, &VM)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("records 0000:01:00.0 twice"), "{msg}");
    let upper = format!(r#"{{"version":1,"devices":{{"0000:0A:00.0":{r}}}}}"#);
    let text = serde_json::to_string(&State::<NoRecords>::parse(p, &upper, &VM).unwrap()).unwrap();
    assert!(text.contains("0000:0a:00.0"), "{text}");
}

#[test]
fn a_symlinked_lock_file_is_refused_not_followed() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let path = dir.path().join("state.json");
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "keep").unwrap();
    std::os::unix::fs::symlink(&victim, lock_path(&path)).unwrap();
    let msg = support::error_chain(&load(&path, true).unwrap_err());
    assert!(msg.contains("must be a regular file"), "{msg}");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
}

#[test]
fn hostile_state_files_are_errors_not_panics() {
    let p = Path::new("state.json");
    for text in [
        "[]",
        "null",
        "{",
        r#"{"version":"1"}"#,
        r#"{"version":-1,"devices":{}}"#,
        r#"{"version":1,"devices":{"zz:zz.z":{}}}"#,
        r#"{"version":1,"devices":[]}"#,
        r#"{"version":1,"devices":{},"unloaded_modules":[1]}"#,
        r#"{"version":99999999999999999999,"devices":{}}"#,
    ] {
        assert!(State::<NoRecords>::parse(p, text, &VM).is_err(), "{text}");
    }
    assert!(State::<NoRecords>::parse(p, " \n", &VM)
        .unwrap()
        .devices
        .is_empty());
}

#[test]
fn a_rivals_records_are_read_without_their_shape_and_their_addresses_count() {
    let p = Path::new("/run/x/state.json");
    let text = r#"{"version":1,"devices":{"0000:01:00.0":{"original_driver":"e1000e",
        "driver":"vfio-pci","role":"selected","group":1}},"unloaded_modules":[],
        "claims":{"uid-1":{"name":"vm1","devices":[{"address":"0000:01:00.0","pool":"n"},
        {"address":"0000:03:00.0","device":"pci-0000-03-00-0"}]}},"other":["0000:04:00.0", 7]}"#;
    let foreign = State::<Foreign>::parse(p, text, &VM).unwrap();
    assert_eq!(foreign.devices.len(), 1);
    assert_eq!(
        foreign.held_devices(),
        3,
        "01:00.0 once, 03:00.0 and 04:00.0 from the records"
    );
    // A program with no records of its own refuses keys it does not know.
    let err = State::<NoRecords>::parse(p, text, &VM).unwrap_err();
    assert!(matches!(err, StateError::Corrupt { .. }), "{err}");
    assert!(
        support::error_chain(&err).contains("unknown field `claims`"),
        "{}",
        support::error_chain(&err)
    );
}
