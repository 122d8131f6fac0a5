//! A kernel door that fails or "crashes" at a chosen point (a write, a module
//! syscall, a state save), for the fault walks of every crate above.

use super::*;

/// What a [`FaultKernel`] does at its chosen point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The change fails without taking effect (`EIO`; `ENOSPC` for a state save);
    /// later ones succeed.
    Fail,
    /// The process stops right there, before the change: the call panics with
    /// [`Crashed`], which the test catches as a `kill -9`.
    Crash,
}

/// The panic payload of a simulated crash.
#[derive(Debug)]
pub struct Crashed;

/// The kinds of injection points.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Point {
    /// A sysfs write.
    Write,
    /// `finit_module` or `delete_module`.
    Module,
    /// An atomic replace of the state file.
    Save,
}

/// Wraps a kernel and counts every change that passes through it — sysfs writes,
/// module syscalls, state saves — failing or "crashing" at the chosen one.
///
/// Shared by threads like any kernel. A crash is a `kill -9` of the whole process:
/// once one thread has crashed, every later point on every thread crashes too
/// (nothing after it happens), each with the [`Crashed`] payload.
pub struct FaultKernel<'k> {
    inner: &'k dyn Kernel,
    /// The point to fault at: its index among the points of one kind, or of all.
    at: Option<(Option<Point>, usize, Fault)>,
    tally: Mutex<Tally>,
}

/// The points passed so far, and whether the process has "crashed".
#[derive(Default)]
struct Tally {
    seen: Vec<(Point, String)>,
    crashed: bool,
}

impl<'k> FaultKernel<'k> {
    /// Passes everything through to `inner`, faulting at point `at` (0-based) if given.
    pub fn new(inner: &'k dyn Kernel, at: Option<(usize, Fault)>) -> Self {
        Self {
            inner,
            at: at.map(|(n, fault)| (None, n, fault)),
            tally: Mutex::default(),
        }
    }

    /// Passes everything through to `inner`, faulting at the `n`th (0-based) point of
    /// kind `kind`, e.g. the second state save.
    pub fn at_nth(inner: &'k dyn Kernel, kind: Point, n: usize, fault: Fault) -> Self {
        Self {
            inner,
            at: Some((Some(kind), n, fault)),
            tally: Mutex::default(),
        }
    }

    /// Every point passed so far, in order, with what it was (the point a crash
    /// happened at included; none after it).
    pub fn points(&self) -> Vec<(Point, String)> {
        lock(&self.tally).seen.clone()
    }

    fn point(&self, kind: Point, what: String) -> Result<(), ()> {
        let mut tally = lock(&self.tally);
        if tally.crashed {
            drop(tally);
            std::panic::panic_any(Crashed);
        }
        let Some((of, at, fault)) = self.at else {
            tally.seen.push((kind, what));
            return Ok(());
        };
        let n = match of {
            None => tally.seen.len(),
            Some(k) if k == kind => tally.seen.iter().filter(|(p, _)| *p == k).count(),
            Some(_) => usize::MAX,
        };
        tally.seen.push((kind, what));
        match fault {
            _ if n != at => Ok(()),
            Fault::Fail => Err(()),
            Fault::Crash => {
                // Decided under the lock: every point after this one crashes too.
                tally.crashed = true;
                drop(tally);
                std::panic::panic_any(Crashed)
            }
        }
    }

    fn eio(path: &Path, action: Action) -> IoError {
        IoError::new(action, path, std::io::Error::from_raw_os_error(5))
    }

    /// A failed state save: `/run` is full.
    fn enospc(path: &Path) -> IoError {
        IoError::new(Action::Rename, path, std::io::Error::from_raw_os_error(28))
    }
}

impl Kernel for FaultKernel<'_> {
    fn write(&self, path: &Path, data: &str) -> Result<(), IoError> {
        self.point(
            Point::Write,
            format!("write {} to {}", data.trim_end(), path.display()),
        )
        .map_err(|()| Self::eio(path, Action::Write(data.into())))?;
        self.inner.write(path, data)
    }

    fn load_module(&self, name: &str, file: &Path) -> Result<(), SyscallError> {
        self.point(Point::Module, format!("finit_module {name}"))
            .map_err(|()| SyscallError::Kernel {
                call: "finit_module",
                target: name.into(),
                errno: nix::errno::Errno::EIO,
            })?;
        self.inner.load_module(name, file)
    }

    fn unload_module(&self, name: &str) -> Result<(), SyscallError> {
        self.point(Point::Module, format!("delete_module {name}"))
            .map_err(|()| SyscallError::Kernel {
                call: "delete_module",
                target: name.into(),
                errno: nix::errno::Errno::EIO,
            })?;
        self.inner.unload_module(name)
    }

    fn replace_file(&self, path: &Path, data: &[u8]) -> Result<(), IoError> {
        self.point(Point::Save, format!("save {}", path.display()))
            .map_err(|()| Self::enospc(path))?;
        self.inner.replace_file(path, data)
    }

    fn group_in_use(&self, node: &Path) -> Result<bool, IoError> {
        self.inner.group_in_use(node)
    }
}
