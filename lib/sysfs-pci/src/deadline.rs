//! Kernel writes that may never return, bounded by a deadline.
//!
//! A native driver's `remove` (run by a write to `driver/unbind`) or a probe (run by
//! `drivers_probe`) can block in the kernel for good: NVIDIA's open kernel modules
//! have done so on unbind (open-gpu-kernel-modules #1119, #1374). A process that
//! makes such a write on its main thread freezes with it, silently, and nothing on
//! the node converges any more.
//!
//! [`Bounded`] wraps a [`Kernel`] and makes every sysfs write on a worker thread of
//! its own, waiting at most the deadline for it. Past the deadline it answers with a
//! `TimedOut` error that names the device, the file and the driver, leaves the
//! worker blocked in the kernel (nothing can cancel it), and marks the device
//! **stuck**: every later write to that device is refused at once, so no second
//! write is ever started on a device whose first has not returned. When the stuck
//! write finally returns, the mark goes and the device is handled again like any
//! other. Module syscalls, state saves and group probes pass straight through.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use sysfs_pci::deadline::Bounded;
//! use sysfs_pci::kernel::SysKernel;
//! let kernel = Bounded::new(Arc::new(SysKernel), Duration::from_secs(60));
//! assert!(kernel.stuck().is_empty());
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::kernel::{Kernel, SyscallError};
use crate::PciAddress;
use support::io::{Action, IoError};
use support::lock;

pub use crate::kernel::StuckWrite;

/// The devices whose write has not returned, as a [`Bounded`] kernel keeps them,
/// readable from anywhere.
#[derive(Debug, Clone, Default)]
pub struct StuckList(Arc<Mutex<BTreeMap<PciAddress, StuckWrite>>>);

impl StuckList {
    /// The stuck write of each device, by address.
    pub fn get(&self) -> BTreeMap<PciAddress, StuckWrite> {
        lock(&self.0).clone()
    }
}

/// A [`Kernel`] whose sysfs writes each get at most a deadline (see the module docs).
pub struct Bounded<K> {
    inner: Arc<K>,
    timeout: Duration,
    stuck: Arc<Mutex<BTreeMap<PciAddress, StuckWrite>>>,
}

impl<K> std::fmt::Debug for Bounded<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounded")
            .field("timeout", &self.timeout)
            .field("stuck", &*lock(&self.stuck))
            .finish_non_exhaustive()
    }
}

/// The outcome of one write, handed from its worker to the waiting caller.
#[derive(Default)]
struct Slot {
    result: Option<Result<(), IoError>>,
    /// The caller stopped waiting: the worker reports to the stuck list instead.
    abandoned: bool,
}

impl<K: Kernel + Send + Sync + 'static> Bounded<K> {
    /// Wraps `inner`; each write may take up to `timeout`.
    pub fn new(inner: Arc<K>, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            stuck: Arc::default(),
        }
    }

    /// The writes that have not returned, oldest device first.
    pub fn stuck(&self) -> Vec<StuckWrite> {
        lock(&self.stuck).values().cloned().collect()
    }

    /// A handle on [`Self::stuck`] for another thread (a health check).
    pub fn stuck_list(&self) -> StuckList {
        StuckList(self.stuck.clone())
    }

    /// The deadline of each write.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn bounded_write(&self, address: PciAddress, path: &Path, data: &str) -> Result<(), IoError> {
        if let Some(s) = lock(&self.stuck).get(&address) {
            return Err(refused(path, data, s));
        }
        let started = StuckWrite {
            address,
            path: path.to_owned(),
            data: data.to_owned(),
            driver: driver_behind(path, &address),
            since: Instant::now(),
        };
        let slot = Arc::new((Mutex::new(Slot::default()), Condvar::new()));
        let worker = {
            let (inner, slot, stuck) = (self.inner.clone(), slot.clone(), self.stuck.clone());
            let (path, data) = (path.to_owned(), data.to_owned());
            move || {
                let result = inner.write(&path, &data);
                let mut s = lock(&slot.0);
                if s.abandoned {
                    // Under the slot's lock, as the caller marks it: never both.
                    if let Some(was) = lock(&stuck).remove(&address) {
                        tracing::warn!(
                            bdf = %address,
                            file = %path.display(),
                            seconds = was.since.elapsed().as_secs(),
                            ok = result.is_ok(),
                            "a stuck sysfs write returned; the device is handled again"
                        );
                    }
                } else {
                    s.result = Some(result);
                    slot.1.notify_all();
                }
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name(format!("write-{address}"))
            .spawn(worker)
        {
            return Err(IoError::new(Action::Write(data.to_owned()), path, e));
        }
        let (guard, _) = slot
            .1
            .wait_timeout_while(lock(&slot.0), self.timeout, |s| s.result.is_none())
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut s = guard;
        if let Some(result) = s.result.take() {
            return result;
        }
        s.abandoned = true;
        tracing::error!(bdf = %address, driver = started.driver.as_deref().unwrap_or("unknown"),
            file = %path.display(), timeout_s = self.timeout.as_secs(),
            "a sysfs write has not returned: the driver is stuck in the kernel; no \
                other write goes to this device until it returns");
        let err = timed_out(path, data, &started, self.timeout);
        lock(&self.stuck).insert(address, started);
        Err(err)
    }
}

impl<K: Kernel + Send + Sync + 'static> Kernel for Bounded<K> {
    fn write(&self, path: &Path, data: &str) -> Result<(), IoError> {
        match device_of(path, data) {
            Some(address) => self.bounded_write(address, path, data),
            // Not about one device (none of ours today): no stuck mark to keep.
            None => self.inner.write(path, data),
        }
    }

    fn load_module(&self, name: &str, file: &Path) -> Result<(), SyscallError> {
        self.inner.load_module(name, file)
    }

    fn unload_module(&self, name: &str) -> Result<(), SyscallError> {
        self.inner.unload_module(name)
    }

    fn replace_file(&self, path: &Path, data: &[u8]) -> Result<(), IoError> {
        self.inner.replace_file(path, data)
    }

    fn group_in_use(&self, node: &Path) -> Result<bool, IoError> {
        self.inner.group_in_use(node)
    }

    fn is_dry_run(&self) -> bool {
        self.inner.is_dry_run()
    }

    fn stuck_writes(&self) -> Vec<StuckWrite> {
        self.stuck()
    }
}

/// The device a write is about: the address written (`unbind`, `bind`,
/// `drivers_probe`), else the device directory in the path (`driver_override`).
pub fn device_of(path: &Path, data: &str) -> Option<PciAddress> {
    data.trim().parse().ok().or_else(|| {
        path.components()
            .rev()
            .find_map(|c| c.as_os_str().to_str()?.parse().ok())
    })
}

/// The driver a write runs: the one behind `<device>/driver/unbind` or
/// `drivers/<name>/{bind,unbind}`, or the override `drivers_probe` will use.
fn driver_behind(path: &Path, address: &PciAddress) -> Option<String> {
    let parent = path.parent()?;
    let name = path.file_name()?.to_str()?;
    match name {
        "unbind" if parent.file_name()? == "driver" => {
            crate::device::link_name(parent).ok().flatten()
        }
        "unbind" | "bind" => Some(parent.file_name()?.to_str()?.to_owned()),
        "drivers_probe" => {
            let file = parent
                .join("devices")
                .join(address.to_string())
                .join("driver_override");
            crate::device::parse_driver_override(&std::fs::read_to_string(file).ok()?)
        }
        _ => None,
    }
}

fn timed_out(path: &Path, data: &str, w: &StuckWrite, timeout: Duration) -> IoError {
    IoError::new(
        Action::Write(data.to_owned()),
        path,
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "did not return within {} s: {} is stuck in the kernel; {} is left \
                    alone until the write returns",
                timeout.as_secs_f32(),
                w.who(),
                w.address
            ),
        ),
    )
}

fn refused(path: &Path, data: &str, s: &StuckWrite) -> IoError {
    IoError::new(
        Action::Write(data.to_owned()),
        path,
        std::io::Error::new(
            std::io::ErrorKind::WouldBlock,
            format!(
                "not written: an earlier write to {} (writing {} to {}) has not \
                    returned; {} is stuck in the kernel",
                s.address,
                s.data.trim_end(),
                s.path.display(),
                s.who(),
            ),
        ),
    )
}

#[cfg(test)]
mod tests;
