//! The record of what vfio-manager changed, so it can be put back.
//!
//! Written atomically (temporary file + rename) after every change, and *before* each
//! device is touched: a `kill -9` at any point leaves a file that names every device we
//! may have moved and the driver it came from. It lives under `/run`, so it vanishes on
//! reboot together with the bindings it describes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::io::{read_optional, write_atomic, IoError};
use crate::PciAddress;

/// Default state file.
pub const DEFAULT_STATE_FILE: &str = "/run/vfio-manager/state.json";

/// Why the state file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Reading or writing failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// Another vfio-manager holds the lock.
    #[error("{lock} is locked by another vfio-manager (is `vfio-manager run` active on this node? it restores on SIGTERM); not touching the node")]
    Locked {
        /// The lock file.
        lock: PathBuf,
    },
    /// The file is not a state file we understand.
    #[error("state file {path} is corrupt (move it aside only after checking which devices are on vfio-pci)")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
}

/// Why a device is in the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Selected by the resource list.
    Selected,
    /// Another member of a selected device's IOMMU group.
    Companion,
}

/// One device we changed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// The driver it was on before (`None`: no driver).
    pub original_driver: Option<String>,
    /// Its `driver_override` before (`None`: unset).
    #[serde(default)]
    pub original_override: Option<String>,
    /// The driver we moved it to.
    pub driver: String,
    /// Why we moved it.
    pub role: Role,
    /// The resource it is advertised as (selected devices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// Its IOMMU group.
    pub group: u32,
}

/// Everything vfio-manager changed on this node.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    /// Format version (1).
    pub version: u32,
    /// Devices moved, by address.
    pub devices: BTreeMap<PciAddress, Record>,
    /// Native driver modules we unloaded, to reload on restore.
    #[serde(default)]
    pub unloaded_modules: Vec<String>,
}

/// The state file and its current contents.
///
/// A persisting `StateFile` holds an exclusive `flock` on `<state file>.lock` for its
/// lifetime, so two vfio-manager processes (the DaemonSet's `run` and a hand-typed
/// `unbind`) can never interleave changes to the node.
#[derive(Debug)]
pub struct StateFile {
    path: PathBuf,
    state: State,
    persist: bool,
    _lock: Option<nix::fcntl::Flock<std::fs::File>>,
}

/// Takes the exclusive lock beside `path` without waiting.
fn lock(path: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, StateError> {
    use crate::io::{Action, WrapIo};
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    let lock_path = PathBuf::from(name);
    if let Some(dir) = lock_path.parent() {
        std::fs::create_dir_all(dir).wrap(Action::Create, dir)?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .wrap(Action::Open, &lock_path)?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|_| StateError::Locked { lock: lock_path })
}

impl StateFile {
    /// Loads `path` (an absent file is an empty state). With `persist` false (dry run,
    /// status), changes stay in memory and no lock is taken; otherwise the lock is
    /// taken first, and held until this value is dropped.
    pub fn load(path: &Path, persist: bool) -> Result<Self, StateError> {
        let lock = if persist { Some(lock(path)?) } else { None };
        let state = match read_optional(path)? {
            None => State {
                version: 1,
                ..State::default()
            },
            Some(text) if text.trim().is_empty() => State {
                version: 1,
                ..State::default()
            },
            Some(text) => serde_json::from_str(&text).map_err(|source| StateError::Corrupt {
                path: path.to_owned(),
                source,
            })?,
        };
        Ok(Self {
            path: path.to_owned(),
            state,
            persist,
            _lock: lock,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The current contents.
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Records a device before it is touched. An existing record wins: the first
    /// original we saw is the true one.
    pub fn record(&mut self, address: PciAddress, record: Record) -> Result<(), StateError> {
        if self.state.devices.contains_key(&address) {
            return Ok(());
        }
        self.state.devices.insert(address, record);
        self.save()
    }

    /// Drops a device's record once it is restored (or rolled back).
    pub fn forget(&mut self, address: &PciAddress) -> Result<(), StateError> {
        if self.state.devices.remove(address).is_some() {
            self.save()?;
        }
        Ok(())
    }

    /// Notes a module we unloaded.
    pub fn note_unloaded(&mut self, module: &str) -> Result<(), StateError> {
        if !self.state.unloaded_modules.iter().any(|m| m == module) {
            self.state.unloaded_modules.push(module.to_owned());
            self.save()?;
        }
        Ok(())
    }

    /// Forgets unloaded modules once reloaded.
    pub fn clear_unloaded(&mut self) -> Result<(), StateError> {
        if !self.state.unloaded_modules.is_empty() {
            self.state.unloaded_modules.clear();
            self.save()?;
        }
        Ok(())
    }

    fn save(&self) -> Result<(), StateError> {
        if !self.persist {
            return Ok(());
        }
        let mut json = serde_json::to_vec_pretty(&self.state).unwrap_or_default();
        json.push(b'\n');
        Ok(write_atomic(&self.path, &json)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> Record {
        Record {
            original_driver: Some("e1000e".into()),
            original_override: None,
            driver: "vfio-pci".into(),
            role: Role::Selected,
            resource: Some("example.com/NIC_PT".into()),
            group: 3,
        }
    }

    #[test]
    fn round_trips_and_first_record_wins() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/state.json");
        let a: PciAddress = "0000:01:00.0".parse().unwrap();
        let mut f = StateFile::load(&path, true).unwrap();
        f.record(a, rec()).unwrap();
        let mut later = rec();
        later.original_driver = Some("vfio-pci".into());
        f.record(a, later).unwrap();
        let back = StateFile::load(&path, false).unwrap();
        assert_eq!(back.state().devices[&a], rec());
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("\"0000:01:00.0\""), "{text}");
    }

    #[test]
    fn forget_empties_the_record() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let a: PciAddress = "0000:01:00.0".parse().unwrap();
        let mut f = StateFile::load(&path, true).unwrap();
        f.record(a, rec()).unwrap();
        f.forget(&a).unwrap();
        assert!(StateFile::load(&path, false)
            .unwrap()
            .state()
            .devices
            .is_empty());
    }

    #[test]
    fn dry_run_never_writes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let mut f = StateFile::load(&path, false).unwrap();
        f.record("0000:01:00.0".parse().unwrap(), rec()).unwrap();
        assert!(!path.exists());
    }

    #[test]
    fn a_second_writer_is_refused_while_the_first_holds_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let first = StateFile::load(&path, true).unwrap();
        let msg = StateFile::load(&path, true).unwrap_err().to_string();
        assert!(
            msg.contains("state.json.lock is locked by another vfio-manager"),
            "{msg}"
        );
        assert!(
            StateFile::load(&path, false).is_ok(),
            "readers need no lock"
        );
        drop(first);
        assert!(StateFile::load(&path, true).is_ok());
    }

    #[test]
    fn corrupt_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        std::fs::write(&path, "{\"version\":1,\"devices\":{\"nope\":{}}}").unwrap();
        let msg = StateFile::load(&path, true).unwrap_err().to_string();
        assert!(msg.contains("state.json is corrupt"), "{msg}");
    }
}
