//! The only door through which node state changes: sysfs writes, module syscalls, the
//! atomic replace of the state file that records them, and the in-use probe of a VFIO
//! group node. Because every change passes here, a dry run is exact and a
//! fault-injecting kernel can fail or stop the process at any one of them.
//!
//! [`SysKernel`] talks to the real kernel, [`DryRun`] prints what it would do and
//! changes nothing, and `fake::FakeKernel` emulates the kernel's sysfs rules on a fake
//! tree for unit tests.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use support::io::{Action, IoError, WrapIo};
use support::lock;

use crate::PciAddress;

/// Why a module syscall failed.
#[derive(Debug, thiserror::Error)]
pub enum SyscallError {
    /// The file could not be opened.
    #[error(transparent)]
    Open(#[from] IoError),
    /// The kernel refused.
    #[error("{call} {target}: {errno}")]
    Kernel {
        /// `finit_module` or `delete_module`.
        call: &'static str,
        /// The module name or file.
        target: String,
        /// The kernel's answer.
        errno: nix::errno::Errno,
    },
}

impl SyscallError {
    /// The errno the kernel gave, if this came from the kernel.
    pub fn errno(&self) -> Option<nix::errno::Errno> {
        match self {
            SyscallError::Kernel { errno, .. } => Some(*errno),
            SyscallError::Open(_) => None,
        }
    }
}

/// Every state-changing operation on the node.
///
/// `Sync`: a bind moves independent IOMMU groups on several threads at once
/// (`passthrough::Passthrough::bind_concurrent`), all through one kernel.
pub trait Kernel: Sync {
    /// Writes `data` to a sysfs attribute in one `write(2)`.
    fn write(&self, path: &Path, data: &str) -> Result<(), IoError>;
    /// Loads the module in `file` (`finit_module`).
    fn load_module(&self, name: &str, file: &Path) -> Result<(), SyscallError>;
    /// Unloads a module without waiting (`delete_module` with `O_NONBLOCK`).
    fn unload_module(&self, name: &str) -> Result<(), SyscallError>;
    /// Replaces `path` with `data` atomically (write a temporary file, fsync, rename).
    /// Used for the state file, so that its saves are steps like any other.
    fn replace_file(&self, path: &Path, data: &[u8]) -> Result<(), IoError> {
        support::io::write_atomic(path, data)
    }
    /// True when the VFIO group node is held open by someone (a VM): opening it gives
    /// `EBUSY`. `false` when the node does not exist.
    fn group_in_use(&self, node: &Path) -> Result<bool, IoError>;
    /// True when this kernel only prints what it would do.
    fn is_dry_run(&self) -> bool {
        false
    }
    /// Writes that have not returned within their deadline, one per device (a
    /// kernel with deadlines keeps them); none for a kernel without deadlines.
    fn stuck_writes(&self) -> Vec<StuckWrite> {
        Vec::new()
    }
}

/// The real kernel.
#[derive(Debug, Default, Clone, Copy)]
pub struct SysKernel;

impl Kernel for SysKernel {
    fn write(&self, path: &Path, data: &str) -> Result<(), IoError> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .wrap_write(path, data)?;
        // sysfs takes one write per store; write_all would retry a short write as a
        // second store, so insist on a single call.
        let n = f.write(data.as_bytes()).wrap_write(path, data)?;
        if n != data.len() {
            return Err(IoError::new(
                Action::Write(data.to_owned()),
                path,
                std::io::Error::other(format!("short write: {n} of {} bytes", data.len())),
            ));
        }
        Ok(())
    }

    fn load_module(&self, name: &str, file: &Path) -> Result<(), SyscallError> {
        let f = std::fs::File::open(file).wrap(Action::Open, file)?;
        let flags = if is_compressed(file) {
            // MODULE_INIT_COMPRESSED_FILE: the kernel decompresses (5.17+).
            nix::kmod::ModuleInitFlags::from_bits_retain(4)
        } else {
            nix::kmod::ModuleInitFlags::empty()
        };
        nix::kmod::finit_module(f.as_fd(), c"", flags).map_err(|errno| SyscallError::Kernel {
            call: "finit_module",
            target: format!("{name} ({})", file.display()),
            errno,
        })
    }

    fn unload_module(&self, name: &str) -> Result<(), SyscallError> {
        let cname = std::ffi::CString::new(name).map_err(|_| SyscallError::Kernel {
            call: "delete_module",
            target: name.to_owned(),
            errno: nix::errno::Errno::EINVAL,
        })?;
        nix::kmod::delete_module(&cname, nix::kmod::DeleteModuleFlags::O_NONBLOCK).map_err(
            |errno| SyscallError::Kernel {
                call: "delete_module",
                target: name.to_owned(),
                errno,
            },
        )
    }

    fn group_in_use(&self, node: &Path) -> Result<bool, IoError> {
        match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(node)
        {
            Ok(_file) => Ok(false), // closed again on drop
            Err(e) if e.raw_os_error() == Some(nix::libc::EBUSY) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(IoError::new(Action::Open, node, e)),
        }
    }
}

/// True when a process under `proc` has `node` open, judged from its `fd/*` links
/// alone. Unreadable processes (gone, or not ours to inspect) are skipped.
pub fn held_by_a_process(proc: &Path, node: &Path) -> bool {
    let Ok(pids) = std::fs::read_dir(proc) else {
        return false;
    };
    pids.flatten()
        .filter(|p| {
            p.file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter_map(|p| std::fs::read_dir(p.path().join("fd")).ok())
        .flat_map(|fds| fds.flatten())
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target == node))
}

/// True for `.ko.xz`, `.ko.zst`, `.ko.gz`.
pub fn is_compressed(file: &Path) -> bool {
    matches!(
        file.extension().and_then(|e| e.to_str()),
        Some("xz" | "zst" | "gz")
    )
}

/// Prints every change it would make and makes none.
#[derive(Debug, Default)]
pub struct DryRun {
    log: Mutex<Vec<String>>,
    modules: Mutex<Vec<String>>,
}

impl DryRun {
    /// A dry run that prints each planned change to stdout as it is planned.
    pub fn new() -> Self {
        Self::default()
    }

    /// Everything planned so far, one line each.
    pub fn planned(&self) -> Vec<String> {
        lock(&self.log).clone()
    }

    fn plan(&self, line: String) {
        support::outln!("{line}");
        lock(&self.log).push(line);
    }
}

impl Kernel for DryRun {
    fn write(&self, path: &Path, data: &str) -> Result<(), IoError> {
        let shown = if data.trim().is_empty() {
            "\\n"
        } else {
            data.trim_end()
        };
        self.plan(format!("would write {shown} to {}", path.display()));
        Ok(())
    }

    fn load_module(&self, name: &str, file: &Path) -> Result<(), SyscallError> {
        // Answer a second load of the same module as the kernel would: EEXIST.
        {
            let mut modules = lock(&self.modules);
            if modules.iter().any(|m| m == name) {
                return Err(SyscallError::Kernel {
                    call: "finit_module",
                    target: name.to_owned(),
                    errno: nix::errno::Errno::EEXIST,
                });
            }
            modules.push(name.to_owned());
        }
        self.plan(format!("would load module {name} from {}", file.display()));
        Ok(())
    }

    fn unload_module(&self, name: &str) -> Result<(), SyscallError> {
        self.plan(format!("would unload module {name}"));
        Ok(())
    }

    fn replace_file(&self, path: &Path, _data: &[u8]) -> Result<(), IoError> {
        self.plan(format!("would update {}", path.display()));
        Ok(())
    }

    /// Never opens the node: opening `/dev/vfio/<group>` takes the group for as long
    /// as it is open, which can make a VM that is starting right then fail. Instead it
    /// looks for a process holding the node among `/proc/*/fd` (read-only links).
    fn group_in_use(&self, node: &Path) -> Result<bool, IoError> {
        Ok(held_by_a_process(Path::new("/proc"), node))
    }

    fn is_dry_run(&self) -> bool {
        true
    }
}

/// A recorded change, for tests and reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// The attribute written.
    pub path: PathBuf,
    /// What was written.
    pub data: String,
}

/// A write that has not returned within the deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StuckWrite {
    /// The device the write is about.
    pub address: PciAddress,
    /// The attribute written.
    pub path: PathBuf,
    /// What was written.
    pub data: String,
    /// The driver whose remove or probe runs it, when it could be read.
    pub driver: Option<String>,
    /// When the write started.
    pub since: Instant,
}

impl std::fmt::Display for StuckWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: writing {} to {} has not returned for {} s ({} is stuck in the kernel)",
            self.address,
            self.data.trim_end(),
            self.path.display(),
            self.since.elapsed().as_secs(),
            self.who(),
        )
    }
}

impl StuckWrite {
    /// The driver that is stuck, as a sentence names it (`driver nvidia`, or `its
    /// driver` when it could not be read).
    pub(crate) fn who(&self) -> String {
        self.driver
            .as_deref()
            .map_or_else(|| "its driver".to_owned(), |d| format!("driver {d}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_is_found_in_proc_without_opening_the_node() {
        let dir = tempfile::tempdir_in(crate::testing::scratch_root()).unwrap();
        let node = dir.path().join("7");
        std::fs::write(&node, "").unwrap();
        let proc = Path::new("/proc");
        assert!(!held_by_a_process(proc, &node));
        let held = std::fs::File::open(&node).unwrap();
        assert!(held_by_a_process(proc, &node));
        drop(held);
        assert!(!held_by_a_process(proc, &node));
        assert!(!held_by_a_process(&dir.path().join("no-proc"), &node));
    }
}
