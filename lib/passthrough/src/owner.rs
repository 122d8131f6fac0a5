//! The one owner of a node's devices among two programs that move them, never
//! both at once. Each describes itself ([`Program`]) and names its rival
//! ([`Contender`]); this module knows neither. In this workspace they are
//! vfio-manager (the whole node in VM mode) and sandbox-dra-driver (devices per
//! claim), and the text below uses them as the example.
//!
//! Both take one node-wide lock before they move any device and hold it across the
//! check and the move: an exclusive, non-blocking `flock` on [`DEFAULT_OWNER_LOCK`]
//! (`--owner-lock`). vfio-manager holds it for a command (`run`: for its life), the
//! DRA driver for its life. The file holds a JSON record of its owner, written under
//! the lock and kept current as devices move:
//!
//! ```text
//! {"owner":"vfio-manager","pid":4242,"since":"2025-01-31T12:00:00Z","devices":3}
//! ```
//!
//! Ownership outlives the process: `vfio-manager bind` exits leaving its devices on
//! vfio-pci, and its record still names it with `devices` above zero. So taking the
//! lock is refused when the `flock` is held (whoever holds it), or when it is free
//! but the record names the *other* program with devices still moved.
//!
//! A record can be lost (the lock file deleted with its directory, garbled by hand),
//! so it is not the last word: what the other program's state file records as moved
//! (or its own records hold, read as [`Foreign`]) is. Taking the lock is refused
//! while that file records a device, and when it cannot be read (in doubt),
//! naming it.
//!
//! A lock file deleted or replaced while held no longer keeps anyone out: the next
//! taker locks a new file. So the holder checks, before each save that holds more
//! devices ([`crate::state::StateFile`]) and on its resyncs ([`Owner::ensure`]),
//! that the path still names the file it locked; if not, it takes the path again
//! or, when it cannot, moves nothing and says why.
//!
//! The record is written and read under a second, brief lock on `<lock>.gate`, so a
//! refused taker reads the record of the holder that beat it, never the one left by
//! an earlier owner nor a half-written one.
//!
//! ```
//! use passthrough::owner::{Contender, Owner, Program};
//! static WHOLE: Program = Program::named("whole-node");
//! static PER_CLAIM: Program = Program::named("per-claim");
//! let dir = tempfile::tempdir().unwrap();
//! let lock = dir.path().join("owner/owner.lock");
//! let (whole_state, per_claim_state) = (dir.path().join("w.json"), dir.path().join("c.json"));
//! let a = Contender::new(&WHOLE, &PER_CLAIM, per_claim_state);
//! let b = Contender::new(&PER_CLAIM, &WHOLE, whole_state);
//! let mine = Owner::take(&lock, &a).unwrap();
//! let err = Owner::take(&lock, &b).unwrap_err();
//! assert!(err.to_string().starts_with("whole-node (pid "), "{err}");
//! drop(mine);
//! assert!(Owner::take(&lock, &b).is_ok(), "nothing moved: free");
//! ```

use std::fmt;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use support::io::{Action, IoError, WrapIo};

/// Default node-wide owner lock (a hostPath shared by both DaemonSets).
pub const DEFAULT_OWNER_LOCK: &str = "/run/vfio-sandbox/owner/owner.lock";

/// The longest record read; a real one is under 200 bytes.
const RECORD_LIMIT: u64 = 4096;

/// A program that moves devices, as the owner record and the refusals name it.
/// The programs describe themselves; this module knows none of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Program {
    /// Its binary's name, written in the owner record.
    pub name: &'static str,
    /// What an operator does so that it lets the node go.
    pub release_hint: &'static str,
    /// Said after "`<its state file>.lock` is locked by another `<name>`".
    pub lock_hint: &'static str,
}

impl Program {
    /// A program with no hints to give (tools and tests).
    pub const fn named(name: &'static str) -> Self {
        Self {
            name,
            release_hint: "",
            lock_hint: "",
        }
    }
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// Who asks for the node: a program, and its rival, the other program that must
/// never own the node's devices at the same time, with the state file that says
/// what the rival moved.
#[derive(Debug, Clone)]
pub struct Contender {
    /// The program taking the node.
    pub program: &'static Program,
    /// The other program.
    pub rival: &'static Program,
    /// The rival's state file.
    pub rival_state: PathBuf,
    /// How many devices a state file records; an absent file records none.
    /// [`Contender::new`] reads this crate's state files
    /// (`crate::state::held_in`), so this module need not know their shape.
    pub held_in: HeldIn,
}

/// Reads how many devices the state file at a path, of the program given,
/// records; an error when it cannot tell.
pub type HeldIn =
    fn(&Path, &'static Program) -> Result<usize, Box<dyn std::error::Error + Send + Sync>>;

/// The record in the lock file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OwnerRecord {
    /// The program that owns the node ([`Program::name`]).
    pub owner: String,
    /// Its process id when it took the lock.
    pub pid: u32,
    /// When it took the lock (RFC 3339, UTC).
    pub since: String,
    /// How many devices it has moved, or holds for a claim, now.
    pub devices: usize,
}

impl OwnerRecord {
    /// Parses a lock file's text; `None` when it is empty (a lock never written).
    /// Only the first JSON value counts: a rewrite cut short between its write and
    /// its truncation leaves the new record first and old bytes after it.
    pub fn parse(text: &str) -> Result<Option<Self>, serde_json::Error> {
        if text.trim().is_empty() {
            return Ok(None);
        }
        let mut values = serde_json::Deserializer::from_str(text).into_iter::<Self>();
        match values.next() {
            Some(record) => record.map(Some),
            None => Ok(None),
        }
    }
}

/// Who holds a node, as said in a refusal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Its record (`None`: not readable, e.g. not written yet).
    pub record: Option<OwnerRecord>,
    /// Whether a live process holds the `flock` (else: its devices are still moved).
    pub running: bool,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.record {
            Some(r) if self.running => write!(f, "{} (pid {}, since {})", r.owner, r.pid, r.since),
            Some(r) => write!(
                f,
                "{} (pid {}, since {}; exited with {} device(s) still moved)",
                r.owner, r.pid, r.since, r.devices
            ),
            None => f.write_str("another program (its record is not readable)"),
        }
    }
}

/// Why the node could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum OwnerError {
    /// Another program, or another instance of this one, owns the node.
    #[error("{holder} owns the devices of this node (lock {}); {program} moves nothing \
        while it does: {}", lock.display(), hint(program, rival, holder))]
    #[allow(missing_docs)]
    Owned {
        /// The program refused.
        program: &'static Program,
        rival: &'static Program,
        /// Who holds the node.
        holder: Holder,
        /// The lock file.
        lock: PathBuf,
    },
    /// The other program's state file records devices it moved.
    #[error("{rival}'s state file {} records {devices} device(s) moved on this node; \
        {program} moves nothing while it does: a node runs either {program} or \
        {rival}, not both; {}", state.display(), rival.release_hint)]
    Recorded {
        /// The program refused.
        program: &'static Program,
        /// The program whose state file it is.
        rival: &'static Program,
        /// Its state file.
        state: PathBuf,
        /// How many devices it records.
        devices: usize,
    },
    /// The other program's state file cannot be read: it may record moved devices.
    #[error("cannot tell whether {rival} has devices moved on this node: its state \
        file {} cannot be read; {program} moves nothing while in doubt (repair the \
        file, or remove it once no device of {rival} is on vfio-pci)", state.display())]
    InDoubt {
        /// The program refused.
        program: &'static Program,
        /// The program whose state file it is.
        rival: &'static Program,
        /// Its state file.
        state: PathBuf,
        /// Why it cannot be read.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The lock path no longer names the file this process locked, and it could
    /// not be taken again.
    #[error("the owner lock {} was {what} while this {program} held it (a cleanup of \
        its directory?), and it cannot be taken again; moving no device until it can", lock.display())]
    Lost {
        /// The program that held it.
        program: &'static Program,
        /// The lock file.
        lock: PathBuf,
        /// `deleted` or `replaced by another file`.
        what: &'static str,
        /// Why it could not be taken again.
        #[source]
        source: Box<OwnerError>,
    },
    /// The lock's directory is on a read-only file system.
    #[error(
        "cannot create the owner lock {lock}: its file system is read-only \
            (EROFS); mount a writable directory there (a hostPath under /run); not \
            touching the node"
    )]
    ReadOnly {
        /// The lock file.
        lock: PathBuf,
    },
    /// The lock file is not a plain file we may open (a symlink, say).
    #[error(
        "cannot open the owner lock {lock} (it must be a regular file, not a \
            symlink); not touching the node"
    )]
    #[allow(missing_docs)]
    Open {
        /// The lock file.
        lock: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Creating its directory, locking, reading or writing it failed.
    #[error(transparent)]
    Io(#[from] IoError),
}

impl OwnerError {
    /// True when the other program owns the node (a usage problem: the node is
    /// given to the other one); false for another instance of the same program
    /// or an I/O failure.
    pub fn by_other_program(&self) -> bool {
        match self {
            Self::Owned {
                program, holder, ..
            } => holder
                .record
                .as_ref()
                .is_none_or(|r| r.owner != program.name),
            Self::Recorded { .. } | Self::InDoubt { .. } => true,
            Self::Lost { source, .. } => source.by_other_program(),
            _ => false,
        }
    }
}

/// What to do about a holder, in a refusal.
fn hint(program: &Program, rival: &Program, holder: &Holder) -> String {
    match &holder.record {
        Some(r) if r.owner == program.name => format!(
            "another {program} is at work on this node (is `{program}` already running here?); \
             wait for it or stop it"
        ),
        Some(r) if r.owner == rival.name => format!(
            "a node runs either {program} or {rival}, not both; {}",
            rival.release_hint
        ),
        Some(r) => format!(
            "a node's devices have one owner; stop {} on this node",
            r.owner
        ),
        None => "retry in a moment".to_owned(),
    }
}

/// The node, taken: the `flock` is held until this value is dropped, and the record
/// names us. Keep its device count current with [`Self::set_devices`] (a
/// [`crate::state::StateFile`] does it on each save once given the owner).
#[derive(Debug)]
pub struct Owner {
    file: Flock<File>,
    lock: PathBuf,
    record: OwnerRecord,
    /// Who took it; the rival's state file is read at every take.
    contender: Contender,
}

impl Owner {
    /// Takes the node for `who`, or says who owns it. Creates the lock's
    /// directory (0755) and file; a symlink or other non-regular file is refused.
    /// A previous record of the program hands over its device count (the caller
    /// then sets the true one); the rival's record with no device left is free,
    /// unless the rival's state file records a device moved, or cannot be read.
    pub fn take(lock: &Path, who: &Contender) -> Result<Self, OwnerError> {
        let program = who.program;
        if let Some(dir) = lock.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(|e| {
                    read_only(lock, e)
                        .unwrap_or_else(|e| IoError::new(Action::Create, dir, e).into())
                })?;
        }
        let _gate = gate(lock, FlockArg::LockExclusive, true)?;
        let file = open(lock, true)?;
        let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(f) => f,
            Err((file, errno)) => return Err(busy(lock, who, &file, errno)),
        };
        let previous = read_record(&file, lock)?;
        if let Some(r) = previous
            .as_ref()
            .filter(|r| r.owner != program.name && r.devices > 0)
        {
            return Err(OwnerError::Owned {
                program,
                rival: who.rival,
                holder: Holder {
                    record: Some(r.clone()),
                    running: false,
                },
                lock: lock.to_owned(),
            });
        }
        recorded_by_rival(who)?;
        let devices = previous
            .filter(|r| r.owner == program.name)
            .map_or(0, |r| r.devices);
        let owner = Self {
            file,
            lock: lock.to_owned(),
            record: OwnerRecord {
                owner: program.name.to_owned(),
                pid: std::process::id(),
                since: support::time::now_rfc3339(),
                devices,
            },
            contender: who.clone(),
        };
        owner.write_record()?;
        tracing::info!(lock = %lock.display(), devices, "took ownership of this node's devices");
        Ok(owner)
    }

    /// Checks that the lock path still names the file we locked. If it was
    /// deleted or replaced (so another taker could lock a new file there), takes
    /// the path again as [`Self::take`] does, keeping our device count; when that
    /// is refused, says so: the caller moves nothing until a later call succeeds.
    pub fn ensure(&mut self) -> Result<(), OwnerError> {
        let Some(what) = self.lost() else {
            return Ok(());
        };
        let program = self.contender.program;
        match Self::take(&self.lock, &self.contender) {
            Ok(mut again) => {
                tracing::warn!(lock = %self.lock.display(), "the owner lock was {what} \
                    while held; took it again");
                again.record.devices = self.record.devices;
                again.write_record()?;
                *self = again;
                Ok(())
            }
            Err(e) => Err(OwnerError::Lost {
                program,
                lock: self.lock.clone(),
                what,
                source: Box::new(e),
            }),
        }
    }

    /// How the lock path no longer names our file, if it does not.
    fn lost(&self) -> Option<&'static str> {
        let ours = match self.file.metadata() {
            Ok(m) => (m.dev(), m.ino()),
            Err(_) => return Some("made unreadable"),
        };
        match std::fs::symlink_metadata(&self.lock) {
            Ok(m) if (m.dev(), m.ino()) == ours => None,
            Ok(_) => Some("replaced by another file"),
            Err(_) => Some("deleted"),
        }
    }

    /// Says whether [`Self::take`] would succeed now, changing nothing (dry runs):
    /// no file is created, and another instance of the program at work is no
    /// obstacle.
    pub fn check(lock: &Path, who: &Contender) -> Result<(), OwnerError> {
        let program = who.program;
        match std::fs::symlink_metadata(lock) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return recorded_by_rival(who),
            _ => {}
        }
        let _gate = gate(lock, FlockArg::LockShared, false)?;
        let file = open(lock, false)?;
        let (record, running) = match Flock::lock(file, FlockArg::LockSharedNonblock) {
            Ok(file) => (read_record(&file, lock)?, false),
            Err((file, errno)) => match busy(lock, who, &file, errno) {
                OwnerError::Owned { holder, .. } => (holder.record, true),
                other => return Err(other),
            },
        };
        let refused = match &record {
            Some(r) if r.owner == program.name => false,
            Some(r) => running || r.devices > 0,
            None => running,
        };
        if refused {
            return Err(OwnerError::Owned {
                program,
                rival: who.rival,
                holder: Holder { record, running },
                lock: lock.to_owned(),
            });
        }
        if running {
            // Another instance of the program holds it: the rival's file is its business.
            return Ok(());
        }
        recorded_by_rival(who)
    }

    /// Who holds the node now, read without taking any lock, for a program that
    /// only follows the owner and never moves a device (so it can never make a
    /// taker wait or fail): the record, and whether a live process holds the
    /// `flock` (`/proc/locks`, which lists only the locks of processes in the
    /// reader's pid namespace: from another container's, a holder is not seen).
    /// `None` when there is no lock file.
    pub fn holder(lock: &Path) -> Result<Option<Holder>, OwnerError> {
        match std::fs::symlink_metadata(lock) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(IoError::new(Action::Read, lock, e).into()),
            Ok(_) => {}
        }
        let file = open(lock, false)?;
        let record = read_record(&file, lock)?;
        let ino = file.metadata().wrap_read(lock)?.ino();
        let running = std::fs::read_to_string("/proc/locks")
            .ok()
            .and_then(|locks| flock_holder(&locks, ino))
            .is_some();
        Ok(Some(Holder { record, running }))
    }

    /// The lock file.
    pub fn lock(&self) -> &Path {
        &self.lock
    }

    /// Our record as written.
    pub fn record(&self) -> &OwnerRecord {
        &self.record
    }

    /// Records how many devices we have moved or hold now.
    pub fn set_devices(&mut self, devices: usize) -> Result<(), OwnerError> {
        if self.record.devices == devices {
            return Ok(());
        }
        let before = self.record.devices;
        self.record.devices = devices;
        let written =
            gate(&self.lock, FlockArg::LockExclusive, true).and_then(|_gate| self.write_record());
        if let Err(e) = written {
            self.record.devices = before;
            return Err(e);
        }
        Ok(())
    }

    /// Rewrites the record in place: the `flock` belongs to this file, so it is
    /// never replaced by a rename. The new text goes first, then the file is cut
    /// to its length (see [`OwnerRecord::parse`]).
    fn write_record(&self) -> Result<(), OwnerError> {
        let mut json = serde_json::to_vec(&self.record).unwrap_or_default();
        json.push(b'\n');
        let shown = String::from_utf8_lossy(&json).into_owned();
        self.file
            .write_all_at(&json, 0)
            .and_then(|()| self.file.set_len(json.len() as u64))
            .wrap_write(&self.lock, &shown)?;
        Ok(())
    }
}

/// The refusal when the rival's state file records devices moved, or cannot be
/// read. An absent file records nothing.
fn recorded_by_rival(who: &Contender) -> Result<(), OwnerError> {
    let (program, rival, state) = (who.program, who.rival, &who.rival_state);
    let held = (who.held_in)(state, rival).map_err(|source| OwnerError::InDoubt {
        program,
        rival,
        state: state.to_owned(),
        source,
    })?;
    if held > 0 {
        return Err(OwnerError::Recorded {
            program,
            rival,
            state: state.to_owned(),
            devices: held,
        });
    }
    Ok(())
}

/// The read-only refusal for `lock` when `e` is `EROFS`.
fn read_only(lock: &Path, e: std::io::Error) -> Result<OwnerError, std::io::Error> {
    if e.raw_os_error() == Some(nix::libc::EROFS) {
        Ok(OwnerError::ReadOnly {
            lock: lock.to_owned(),
        })
    } else {
        Err(e)
    }
}

/// Takes the gate beside `lock`, waiting: it is held only while a record is
/// written or read. `None` when it is absent and `create` is false.
fn gate(lock: &Path, arg: FlockArg, create: bool) -> Result<Option<Flock<File>>, OwnerError> {
    let mut path = lock.as_os_str().to_owned();
    path.push(".gate");
    let path = PathBuf::from(path);
    if !create && std::fs::symlink_metadata(&path).is_err() {
        return Ok(None);
    }
    let file = open(&path, create)?;
    let now = match arg {
        FlockArg::LockShared => FlockArg::LockSharedNonblock,
        _ => FlockArg::LockExclusiveNonblock,
    };
    let file = match Flock::lock(file, now) {
        Ok(f) => return Ok(Some(f)),
        Err((file, nix::errno::Errno::EWOULDBLOCK)) => file,
        Err((_, errno)) => {
            return Err(IoError::new(Action::Open, &path, std::io::Error::from(errno)).into())
        }
    };
    // Held only while a record is read or written: a wait is worth saying.
    let holder = file
        .metadata()
        .ok()
        .and_then(|m| flock_holder(&std::fs::read_to_string("/proc/locks").ok()?, m.ino()));
    let holder = holder.map_or_else(
        || "another process".to_owned(),
        |pid| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            format!("pid {pid} ({})", comm.trim())
        },
    );
    tracing::warn!(gate = %path.display(), holder = %holder, "waiting for the owner \
        lock's gate, held by {holder}");
    match Flock::lock(file, arg) {
        Ok(f) => Ok(Some(f)),
        Err((_, errno)) => {
            Err(IoError::new(Action::Open, &path, std::io::Error::from(errno)).into())
        }
    }
}

/// The pid holding a `flock` on inode `ino`, from the text of `/proc/locks`
/// (`1: FLOCK  ADVISORY  WRITE 4242 00:1a:1234 0 EOF`; a waiter's line has `->`).
fn flock_holder(locks: &str, ino: u64) -> Option<u32> {
    locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(1) != Some(&"FLOCK") || fields.contains(&"->") {
            return None;
        }
        let node = fields.get(5)?.rsplit(':').next()?;
        (node.parse::<u64>().ok()? == ino).then(|| fields.get(4)?.parse().ok())?
    })
}

/// Opens the lock file without following a symlink; only a regular file will do.
fn open(lock: &Path, create: bool) -> Result<File, OwnerError> {
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .write(create)
        .create(create)
        .truncate(false)
        .mode(0o644)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC | nix::libc::O_NONBLOCK)
        .open(lock)
        .and_then(|file| {
            if file.metadata()?.is_file() {
                Ok(file)
            } else {
                Err(std::io::Error::other("not a regular file"))
            }
        });
    opened.map_err(|source| {
        read_only(lock, source).unwrap_or_else(|source| OwnerError::Open {
            lock: lock.to_owned(),
            source,
        })
    })
}

/// The refusal for a `flock` we could not take.
fn busy(lock: &Path, who: &Contender, file: &File, errno: nix::errno::Errno) -> OwnerError {
    if errno != nix::errno::Errno::EWOULDBLOCK {
        return IoError::new(Action::Open, lock, std::io::Error::from(errno)).into();
    }
    let record = match read_record(file, lock) {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(error = %support::error_chain(&e), "owner record not readable");
            None
        }
    };
    OwnerError::Owned {
        program: who.program,
        rival: who.rival,
        holder: Holder {
            record,
            running: true,
        },
        lock: lock.to_owned(),
    }
}

/// The record in the lock file; a garbled one is logged and names no owner.
fn read_record(file: &File, lock: &Path) -> Result<Option<OwnerRecord>, OwnerError> {
    let mut bytes = Vec::new();
    let mut reader = file;
    std::io::Seek::rewind(&mut reader).wrap_read(lock)?;
    reader
        .take(RECORD_LIMIT)
        .read_to_end(&mut bytes)
        .wrap_read(lock)?;
    let text = String::from_utf8_lossy(&bytes);
    match OwnerRecord::parse(&text) {
        Ok(r) => Ok(r),
        Err(e) => {
            tracing::warn!(lock = %lock.display(), error = %e, "the owner record is \
                garbled; the other program's state file decides whether the node is free");
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_holder_of_a_flock_is_read_from_proc_locks() {
        let text = "1: POSIX  ADVISORY  WRITE 10 00:1a:77 0 EOF\n\
                    2: FLOCK  ADVISORY  WRITE 4242 00:1a:1234 0 EOF\n\
                    2: -> FLOCK  ADVISORY  WRITE 99 00:1a:1234 0 EOF\n";
        assert_eq!(flock_holder(text, 1234), Some(4242));
        assert_eq!(flock_holder(text, 77), None, "a POSIX lock is not ours");
        assert_eq!(flock_holder(text, 5), None);
        assert_eq!(flock_holder("garbage\n\n1: FLOCK", 1), None);
    }

    #[test]
    fn the_holder_is_read_without_taking_any_lock() {
        static A: Program = Program::named("whole-node");
        static B: Program = Program::named("per-claim");
        let dir = tempfile::tempdir().unwrap();
        let lock = dir.path().join("owner.lock");
        assert!(
            Owner::holder(&lock).unwrap().is_none(),
            "no file, no holder"
        );
        let who = Contender::new(&A, &B, dir.path().join("b.json"));
        let owner = Owner::take(&lock, &who).unwrap();
        let h = Owner::holder(&lock).unwrap().unwrap();
        assert!(h.running, "{h}");
        assert_eq!(h.record.unwrap().owner, "whole-node");
        // Reading it never stood in a taker's way: the gate and the lock are free
        // for the next one once the owner goes.
        drop(owner);
        let h = Owner::holder(&lock).unwrap().unwrap();
        assert!(!h.running, "{h}");
        let back = Contender::new(&B, &A, dir.path().join("a.json"));
        assert!(Owner::take(&lock, &back).is_ok());
    }

    #[test]
    fn a_cut_short_rewrite_still_parses_to_the_new_record() {
        let text = "{\"owner\":\"vfio-manager\",\"pid\":7,\"since\":\"x\",\"devices\":0}\n0}\n";
        let r = OwnerRecord::parse(text).unwrap().unwrap();
        assert_eq!((r.owner.as_str(), r.devices), ("vfio-manager", 0));
        assert_eq!(OwnerRecord::parse(" \n").unwrap(), None);
        for bad in ["{", "[]", "{\"owner\":\"x\"}", "null"] {
            assert!(OwnerRecord::parse(bad).is_err(), "{bad}");
        }
    }
}
