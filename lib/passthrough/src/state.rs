//! The record of what an agent changed on the node, so it can be put back: the
//! devices it moved, the modules it unloaded, and its own [`Records`] (the DRA
//! driver keeps its claims there).
//!
//! Written atomically (temporary file + rename) after every change, and *before* each
//! device is touched: a `kill -9` at any point leaves a file that names every device we
//! may have moved and the driver it came from. It lives under `/run`, so it vanishes on
//! reboot together with the bindings it describes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::owner::{Contender, Owner, OwnerError, Program};
use support::io::{read_optional, IoError};
use sysfs_pci::kernel::Kernel;
use sysfs_pci::PciAddress;

/// The file's own top-level keys, in the order written (the fields of `OnDisk`);
/// every other key belongs to the program's [`Records`].
const OWN_KEYS: [&str; 3] = ["version", "devices", "unloaded_modules"];

/// The format version this build reads and writes.
pub const VERSION: u32 = 1;

/// Why the state file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Reading or writing failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// Another process of the same program holds the lock.
    #[error("{lock} is locked by another {program}{}; not touching the node", program.lock_hint)]
    Locked {
        /// The lock file.
        lock: PathBuf,
        /// The program that owns the file.
        program: &'static Program,
    },
    /// The lock file is not a plain file we may open (a symlink, say).
    #[error(
        "cannot open lock file {lock} (it must be a regular file, not a symlink); \
            not touching the node"
    )]
    #[allow(missing_docs)]
    LockFile {
        /// The lock file.
        lock: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The node-wide owner record could not be kept current.
    #[error(transparent)]
    Owner(Box<OwnerError>),
    /// The file is not a state file we understand.
    #[error(
        "state file {path} is corrupt (move it aside only after checking which \
            devices are on vfio-pci)"
    )]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The state could not be turned into JSON; nothing was written.
    #[error(
        "cannot serialise the state for {path}; nothing written, the file keeps \
            its previous contents"
    )]
    #[allow(missing_docs)]
    Serialize {
        /// The file.
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The file was written by a newer (or unknown) format.
    #[error(
        "state file {path} has format version {version}, this {program} \
            understands only version {VERSION}; not touching the node (use the {program} \
            that wrote it)"
    )]
    Version {
        /// The file.
        path: PathBuf,
        /// The version found.
        version: u64,
        /// The program that owns the file.
        program: &'static Program,
    },
    /// Two keys name the same device with different records.
    #[error(
        "state file {path} records {address} twice ({first} and {second}) with \
            different contents; not touching the node (check which driver {address} came \
            from and keep one record)"
    )]
    Duplicate {
        /// The file.
        path: PathBuf,
        /// The device.
        address: PciAddress,
        /// One spelling.
        first: String,
        /// The other.
        second: String,
    },
}

impl From<OwnerError> for StateError {
    fn from(e: OwnerError) -> Self {
        Self::Owner(Box::new(e))
    }
}

/// Why a device is in the record: its [`crate::inventory::Role`] when it was moved,
/// without the details (bridges are never moved, so never recorded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecordedRole {
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
    pub role: RecordedRole,
    /// The resource it is advertised as (selected devices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// Its IOMMU group.
    pub group: u32,
}

/// What the file's program keeps beside the devices it moved (the DRA driver: its
/// claims), saved under its own key. This crate reads none of it but the devices
/// it holds.
pub trait Records:
    Clone + Default + PartialEq + fmt::Debug + Send + serde::Serialize + serde::de::DeserializeOwned
{
    /// The file's top-level key they are saved under; left out while empty, and an
    /// absent key reads as empty.
    const KEY: &'static str;
    /// Whether there is nothing to save.
    fn is_empty(&self) -> bool;
    /// The devices they hold, moved or not: the owner record counts them.
    fn devices(&self) -> Vec<PciAddress>;
    /// Takes them out of the file's top-level object: by default the value of
    /// [`Self::KEY`]; every key left over is refused as unknown.
    fn take(file: &mut serde_json::Map<String, serde_json::Value>) -> serde_json::Result<Self> {
        file.remove(Self::KEY)
            .map_or_else(|| Ok(Self::default()), Self::deserialize)
    }
}

/// No records beside the moved devices (vfio-manager's file).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoRecords {}

impl Records for NoRecords {
    const KEY: &'static str = "records";
    fn is_empty(&self) -> bool {
        true
    }
    fn devices(&self) -> Vec<PciAddress> {
        Vec::new()
    }
}

/// Another program's records, read without knowing their shape (the owner lock
/// reads the other program's file so): every key beside the moved devices is
/// theirs, and every PCI address anywhere in it counts as held, so what is not
/// understood keeps the node from being taken rather than letting it go. Never
/// saved.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Foreign(serde_json::Map<String, serde_json::Value>);

impl Records for Foreign {
    const KEY: &'static str = "foreign";
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    fn devices(&self) -> Vec<PciAddress> {
        fn walk(value: &serde_json::Value, out: &mut Vec<PciAddress>) {
            match value {
                serde_json::Value::String(s) => out.extend(s.parse::<PciAddress>().ok()),
                serde_json::Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
                serde_json::Value::Object(map) => map.values().for_each(|v| walk(v, out)),
                _ => {}
            }
        }
        let mut out = Vec::new();
        self.0.values().for_each(|v| walk(v, &mut out));
        out
    }
    fn take(file: &mut serde_json::Map<String, serde_json::Value>) -> serde_json::Result<Self> {
        let theirs: Vec<String> = file
            .keys()
            .filter(|k| !OWN_KEYS.contains(&k.as_str()))
            .cloned()
            .collect();
        Ok(Self(
            theirs
                .into_iter()
                .filter_map(|k| file.remove_entry(&k))
                .collect(),
        ))
    }
}

/// Everything the file's program changed on this node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State<R = NoRecords> {
    /// Format version ([`VERSION`]).
    pub version: u32,
    /// Devices moved, by address.
    pub devices: BTreeMap<PciAddress, Record>,
    /// Native driver modules we unloaded, to reload on restore.
    pub unloaded_modules: Vec<String>,
    /// The program's own records, under [`Records::KEY`].
    pub records: R,
}

impl<R: Records> serde::Serialize for State<R> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let [version, devices, unloaded_modules] = OWN_KEYS;
        let mut map = s.serialize_map(None)?;
        map.serialize_entry(version, &self.version)?;
        map.serialize_entry(devices, &self.devices)?;
        map.serialize_entry(unloaded_modules, &self.unloaded_modules)?;
        if !self.records.is_empty() {
            map.serialize_entry(R::KEY, &self.records)?;
        }
        map.end()
    }
}

/// The file as written, before its addresses are made canonical.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct OnDisk {
    version: u64,
    devices: BTreeMap<String, Record>,
    #[serde(default)]
    unloaded_modules: Vec<String>,
}

impl<R: Records> State<R> {
    /// How many distinct devices this state holds: moved (recorded) or held by the
    /// program's records. The node's owner record carries this number.
    pub fn held_devices(&self) -> usize {
        let mut held: BTreeSet<PciAddress> = self.devices.keys().copied().collect();
        held.extend(self.records.devices());
        held.len()
    }

    fn empty() -> Self {
        Self {
            version: VERSION,
            ..Self::default()
        }
    }

    /// Parses a state file's text. Addresses are made canonical (`01:00.0` and
    /// `0000:01:00.0` are one device); two spellings of one device with different
    /// records, an unknown version or a malformed document are errors, so nothing
    /// is ever dropped silently.
    pub fn parse(path: &Path, text: &str, program: &'static Program) -> Result<Self, StateError> {
        if text.trim().is_empty() {
            return Ok(Self::empty());
        }
        let corrupt = |source| StateError::Corrupt {
            path: path.to_owned(),
            source,
        };
        let mut value: serde_json::Value = serde_json::from_str(text).map_err(corrupt)?;
        // The version alone first, so a newer format gets the version error.
        match value.get("version").and_then(serde_json::Value::as_u64) {
            Some(v) if v == u64::from(VERSION) => {}
            Some(version) => {
                return Err(StateError::Version {
                    path: path.to_owned(),
                    version,
                    program,
                })
            }
            None => {}
        }
        let records = match value.as_object_mut() {
            Some(file) => R::take(file).map_err(corrupt)?,
            None => R::default(),
        };
        let disk: OnDisk = serde_json::from_value(value).map_err(corrupt)?;
        if disk.version != u64::from(VERSION) {
            return Err(StateError::Version {
                path: path.to_owned(),
                version: disk.version,
                program,
            });
        }
        let mut devices = BTreeMap::new();
        let mut spelled: BTreeMap<PciAddress, String> = BTreeMap::new();
        for (key, record) in disk.devices {
            let address: PciAddress = key.parse().map_err(|e| StateError::Corrupt {
                path: path.to_owned(),
                source: serde::de::Error::custom(e),
            })?;
            if let Some(previous) = devices.insert(address, record.clone()) {
                if previous != record {
                    return Err(StateError::Duplicate {
                        path: path.to_owned(),
                        address,
                        first: spelled.remove(&address).unwrap_or_default(),
                        second: key,
                    });
                }
            }
            spelled.insert(address, key);
        }
        let mut unloaded_modules: Vec<String> = Vec::new();
        for m in disk.unloaded_modules {
            if !unloaded_modules.contains(&m) {
                unloaded_modules.push(m);
            }
        }
        Ok(Self {
            version: VERSION,
            devices,
            unloaded_modules,
            records,
        })
    }
}

/// The state file and its current contents.
///
/// A persisting `StateFile` holds an exclusive `flock` on `<state file>.lock` for its
/// lifetime, so two vfio-manager processes (the DaemonSet's `run` and a hand-typed
/// `unbind`) can never interleave changes to the node.
///
/// Invariant — *memory never claims more than the disk holds*: every change is
/// made on a copy, the copy is saved, and only a save that succeeded replaces the
/// contents in memory. A failed save leaves the state exactly as it was, so the next
/// attempt sees the record missing and writes again (see the test
/// `a_failed_save_leaves_memory_as_it_was`).
///
/// Invariant — *a record is never replaced by a later snapshot*: [`Self::record`]
/// keeps an existing record (the first original seen is the true one), and a record
/// leaves only through [`Self::forget`], which callers use after a confirmed restore.
///
/// Invariant — *the owner record never says less than is held*: given the node's
/// [`Owner`] ([`Self::attach_owner`]), each save that holds more devices updates its
/// record before the caller may move one, or fails; a save that holds fewer updates
/// it too, and a failure there only leaves the record over-counting (logged).
#[derive(Debug)]
pub struct StateFile<R = NoRecords> {
    path: PathBuf,
    state: State<R>,
    persist: bool,
    _lock: Option<nix::fcntl::Flock<std::fs::File>>,
    owner: Option<Owner>,
}

impl Contender {
    /// `program` taking the node from `rival`, whose state file (of this crate's
    /// shape) is `rival_state`.
    pub fn new(program: &'static Program, rival: &'static Program, rival_state: PathBuf) -> Self {
        Self {
            program,
            rival,
            rival_state,
            held_in,
        }
    }
}

/// How many devices the state file at `path`, of `program`, records; an absent
/// file records none. Its records are read as [`Foreign`]: the reader does not
/// know their shape.
pub fn held_in(
    path: &Path,
    program: &'static Program,
) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
    let state = StateFile::<Foreign>::load(path, false, program)?;
    Ok(state.state().held_devices())
}

/// The lock file beside a state file.
pub fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// Takes the exclusive lock beside `path` without waiting. The lock file is opened
/// with `O_NOFOLLOW`: a symlink planted there is refused, never followed.
fn lock(
    path: &Path,
    program: &'static Program,
) -> Result<nix::fcntl::Flock<std::fs::File>, StateError> {
    use std::os::unix::fs::OpenOptionsExt;
    use support::io::{Action, WrapIo};
    let lock_path = lock_path(path);
    if let Some(dir) = lock_path.parent() {
        std::fs::create_dir_all(dir).wrap(Action::Create, dir)?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(&lock_path)
        .map_err(|source| StateError::LockFile {
            lock: lock_path.clone(),
            source,
        })?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|_| {
        StateError::Locked {
            lock: lock_path,
            program,
        }
    })
}

impl<R: Records> StateFile<R> {
    /// Loads `path` (an absent file is an empty state). With `persist` false (dry run,
    /// status), changes stay in memory and no lock is taken; otherwise the lock is
    /// taken first, and held until this value is dropped.
    pub fn load(path: &Path, persist: bool, program: &'static Program) -> Result<Self, StateError> {
        let lock = if persist {
            Some(lock(path, program)?)
        } else {
            None
        };
        let state = match read_optional(path)? {
            None => State::empty(),
            Some(text) => State::parse(path, &text, program)?,
        };
        Ok(Self {
            path: path.to_owned(),
            state,
            persist,
            _lock: lock,
            owner: None,
        })
    }

    /// Keeps `owner` (the node's owner lock, held until this value is dropped) and
    /// its record's device count current from now on, starting with this state's.
    pub fn attach_owner(&mut self, mut owner: Owner) -> Result<(), StateError> {
        owner.set_devices(self.state.held_devices())?;
        self.owner = Some(owner);
        Ok(())
    }

    /// Checks that the attached owner lock still keeps every other taker out (see
    /// [`Owner::ensure`]); a resync calls it, so a lost lock is said even when no
    /// device moves.
    pub fn ensure_owner(&mut self) -> Result<(), StateError> {
        match &mut self.owner {
            Some(owner) => owner.ensure().map_err(Into::into),
            None => Ok(()),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The current contents (never more than the file holds).
    pub fn state(&self) -> &State<R> {
        &self.state
    }

    /// The record of `address`, if any.
    pub fn get(&self, address: &PciAddress) -> Option<&Record> {
        self.state.devices.get(address)
    }

    /// Records a device before it is touched. An existing record wins: the first
    /// original we saw is the true one, and a later snapshot never replaces it.
    pub fn record(
        &mut self,
        kernel: &dyn Kernel,
        address: PciAddress,
        record: Record,
    ) -> Result<(), StateError> {
        if self.state.devices.contains_key(&address) {
            return Ok(());
        }
        self.change(kernel, |s| {
            s.devices.insert(address, record);
        })
    }

    /// Drops a device's record; only after a confirmed restore (or a confirmed
    /// rollback to the record).
    pub fn forget(&mut self, kernel: &dyn Kernel, address: &PciAddress) -> Result<(), StateError> {
        if !self.state.devices.contains_key(address) {
            return Ok(());
        }
        self.change(kernel, |s| {
            s.devices.remove(address);
        })
    }

    /// Notes a module we are about to unload.
    pub fn note_unloaded(&mut self, kernel: &dyn Kernel, module: &str) -> Result<(), StateError> {
        if self.state.unloaded_modules.iter().any(|m| m == module) {
            return Ok(());
        }
        self.change(kernel, |s| s.unloaded_modules.push(module.to_owned()))
    }

    /// Forgets unloaded modules once reloaded.
    pub fn clear_unloaded(&mut self, kernel: &dyn Kernel) -> Result<(), StateError> {
        if self.state.unloaded_modules.is_empty() {
            return Ok(());
        }
        self.change(kernel, |s| s.unloaded_modules.clear())
    }

    /// The program's own records (never more than the file holds).
    pub fn records(&self) -> &R {
        &self.state.records
    }

    /// Applies `f` to a copy of the program's records and saves it, when it
    /// changed anything.
    pub fn update_records(
        &mut self,
        kernel: &dyn Kernel,
        f: impl FnOnce(&mut R),
    ) -> Result<(), StateError> {
        let mut next = self.state.records.clone();
        f(&mut next);
        if next == self.state.records {
            return Ok(());
        }
        self.change(kernel, |s| s.records = next)
    }

    /// Applies `f` to a copy, saves the copy, and only then keeps it.
    fn change(
        &mut self,
        kernel: &dyn Kernel,
        f: impl FnOnce(&mut State<R>),
    ) -> Result<(), StateError> {
        let mut next = self.state.clone();
        f(&mut next);
        let grows = next.held_devices() > self.state.held_devices();
        if let Some(owner) = self.owner.as_mut().filter(|_| grows) {
            // The lock path must still keep every other taker out before a device
            // that this save records can move.
            owner.ensure()?;
        }
        if self.persist {
            // Serialising these types cannot fail today (string keys, no maps with
            // other keys, no custom Serialize); were it ever to, the save fails and
            // nothing changes, rather than writing a state that drops every record.
            let mut json =
                serde_json::to_vec_pretty(&next).map_err(|source| StateError::Serialize {
                    path: self.path.clone(),
                    source,
                })?;
            json.push(b'\n');
            kernel.replace_file(&self.path, &json)?;
        }
        if let Some(owner) = &mut self.owner {
            let (before, after) = (self.state.held_devices(), next.held_devices());
            if let Err(e) = owner.set_devices(after) {
                if after > before {
                    return Err(e.into());
                }
                tracing::warn!(error = %support::error_chain(&e), devices = after,
                    "the owner record still counts more devices than are held");
            }
        }
        self.state = next;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
