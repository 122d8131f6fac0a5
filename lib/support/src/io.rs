//! One I/O error type for every filesystem access, naming the action and the path.
//!
//! Call sites stay short through [`WrapIo`]:
//!
//! ```
//! use std::path::Path;
//! use support::io::WrapIo;
//! let path = Path::new("/nonexistent/driver_override");
//! let err = std::fs::write(path, "vfio-pci").wrap_write(path, "vfio-pci").unwrap_err();
//! assert_eq!(
//!     support::error_chain(&err),
//!     "failed to write vfio-pci to /nonexistent/driver_override: No such file or directory (os error 2)"
//! );
//! ```

use std::fmt;
use std::path::{Path, PathBuf};

/// What we were doing when an I/O call failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Reading a file.
    Read,
    /// Writing the given data to a file.
    Write(String),
    /// Listing a directory.
    List,
    /// Resolving a symlink.
    ReadLink,
    /// Opening a file or device node.
    Open,
    /// Creating a file or directory.
    Create,
    /// Renaming a file into place.
    Rename,
    /// Removing a file.
    Remove,
}

/// A failed filesystem call: the action, the path and the OS error.
#[derive(Debug, thiserror::Error)]
pub struct IoError {
    /// What was attempted.
    pub action: Action,
    /// The file or directory it was attempted on.
    pub path: PathBuf,
    /// The underlying OS error.
    #[source]
    pub source: std::io::Error,
}

impl IoError {
    /// Builds an error from its parts.
    pub fn new(action: Action, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self {
            action,
            path: path.into(),
            source,
        }
    }

    /// The raw OS error number, if any (`EBUSY`, `ENODEV`, ...).
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }

    /// True when the path did not exist.
    pub fn is_not_found(&self) -> bool {
        self.source.kind() == std::io::ErrorKind::NotFound
    }

    /// True when the object behind the path is going away: the file is gone, or sysfs
    /// answers `ENODEV` because the device is being removed.
    pub fn is_gone(&self) -> bool {
        self.is_not_found() || self.errno() == Some(nix::libc::ENODEV)
    }
}

impl fmt::Display for IoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = self.path.display();
        // The OS error is the source, printed after this by `error_chain`.
        match &self.action {
            Action::Read => write!(f, "failed to read {path}"),
            Action::Write(data) => write!(f, "failed to write {} to {path}", data.trim_end()),
            Action::List => write!(f, "failed to list {path}"),
            Action::ReadLink => write!(f, "failed to resolve link {path}"),
            Action::Open => write!(f, "failed to open {path}"),
            Action::Create => write!(f, "failed to create {path}"),
            Action::Rename => write!(f, "failed to rename into {path}"),
            Action::Remove => write!(f, "failed to remove {path}"),
        }
    }
}

/// Adds the action and the path to a `std::io::Result`.
pub trait WrapIo<T> {
    /// The result of reading `path`.
    fn wrap_read(self, path: &Path) -> Result<T, IoError>;
    /// The result of writing `data` to `path`.
    fn wrap_write(self, path: &Path, data: &str) -> Result<T, IoError>;
    /// The result of any other action on `path`.
    fn wrap(self, action: Action, path: &Path) -> Result<T, IoError>;
}

impl<T> WrapIo<T> for std::io::Result<T> {
    fn wrap_read(self, path: &Path) -> Result<T, IoError> {
        self.wrap(Action::Read, path)
    }

    fn wrap_write(self, path: &Path, data: &str) -> Result<T, IoError> {
        self.wrap(Action::Write(data.to_owned()), path)
    }

    fn wrap(self, action: Action, path: &Path) -> Result<T, IoError> {
        self.map_err(|source| IoError::new(action, path, source))
    }
}

/// Reads a small text file, trimming the trailing newline sysfs adds.
pub fn read_trimmed(path: &Path) -> Result<String, IoError> {
    std::fs::read_to_string(path)
        .wrap_read(path)
        .map(|s| s.trim_end().to_owned())
}

/// Reads a small text file, `None` when it does not exist.
pub fn read_optional(path: &Path) -> Result<Option<String>, IoError> {
    absent_is_none(read_trimmed(path))
}

/// A read whose file did not exist as `None`.
pub fn absent_is_none(read: Result<String, IoError>) -> Result<Option<String>, IoError> {
    match read {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

/// Removes the file at `path`; one that is already gone is fine.
pub fn remove_if_present(path: &Path) -> Result<(), IoError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        // unlink(2) checks that the file system is writable before it looks the
        // name up, so an absent file on a read-only mount gives EROFS: only a file
        // that is still there is a failure.
        Err(e) => match std::fs::symlink_metadata(path) {
            Err(gone) if gone.kind() == std::io::ErrorKind::NotFound => Ok(()),
            _ => Err(IoError::new(Action::Remove, path, e)),
        },
    }
}

/// Why [`read_small_file`] read nothing.
#[derive(Debug, thiserror::Error)]
pub enum SmallFileError {
    /// Opening or reading failed (`NotFound` when it does not exist).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The path names something else than a regular file.
    #[error("it is {0}, not a regular file")]
    NotAFile(&'static str),
    /// The file holds more than the limit.
    #[error("it is larger than {0} bytes")]
    TooLarge(u64),
}

/// Reads a small UTF-8 regular file of at most `limit` bytes, refusing anything
/// else before reading a byte of it: a device node is never opened, a FIFO swapped
/// in meanwhile is opened without blocking and refused, and a huge file is not
/// read past the limit.
pub fn read_small_file(path: &Path, limit: u64) -> Result<String, SmallFileError> {
    String::from_utf8(read_small_bytes(path, limit)?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e).into())
}

/// [`read_small_file`] without the UTF-8 check, for files whose lines are judged
/// one by one (such as `modules.alias`).
pub fn read_small_bytes(path: &Path, limit: u64) -> Result<Vec<u8>, SmallFileError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // Look before opening: opening a device node can have effects of its own.
    if let Some(kind) = not_regular(&std::fs::metadata(path)?.file_type()) {
        return Err(SmallFileError::NotAFile(kind));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path)?;
    if let Some(kind) = not_regular(&file.metadata()?.file_type()) {
        return Err(SmallFileError::NotAFile(kind));
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(SmallFileError::TooLarge(limit));
    }
    Ok(bytes)
}

/// What a file type is, in words, when it is not a regular file.
fn not_regular(file_type: &std::fs::FileType) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    Some(if file_type.is_file() {
        return None;
    } else if file_type.is_dir() {
        "a directory"
    } else if file_type.is_fifo() {
        "a FIFO"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "not a file"
    })
}

/// Writes `data` to `path` atomically: a temporary file in the same directory, fsync,
/// then rename over the target. Creates the parent directory if needed.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<(), IoError> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).wrap(Action::Create, dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp).wrap(Action::Create, &tmp)?;
        file.write_all(data)
            .wrap(Action::Write(format!("{} bytes", data.len())), &tmp)?;
        file.sync_all().wrap(Action::Write("fsync".into()), &tmp)?;
        std::fs::rename(&tmp, path).wrap(Action::Rename, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_names_action_path_and_os_error() {
        let err = IoError::new(
            Action::Write("vfio-pci\n".into()),
            "/sys/bus/pci/devices/0000:3b:00.0/driver_override",
            std::io::Error::from_raw_os_error(16),
        );
        assert_eq!(
            crate::error_chain(&err),
            "failed to write vfio-pci to /sys/bus/pci/devices/0000:3b:00.0/driver_override: \
             Device or resource busy (os error 16)"
        );
        assert_eq!(err.errno(), Some(16));
    }

    #[test]
    fn read_optional_distinguishes_missing_from_present() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("numa_node");
        assert_eq!(read_optional(&file).unwrap(), None);
        std::fs::write(&file, "-1\n").unwrap();
        assert_eq!(read_optional(&file).unwrap().as_deref(), Some("-1"));
    }

    #[test]
    fn write_atomic_replaces_and_creates_parent() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a/b/state.json");
        write_atomic(&file, b"one").unwrap();
        write_atomic(&file, b"two").unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "two");
        let leftovers: Vec<_> = std::fs::read_dir(file.parent().unwrap()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file left behind");
    }
}
