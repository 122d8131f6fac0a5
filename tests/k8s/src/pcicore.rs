//! The PCI core of the fake host: its write-only attributes answer the way the
//! kernel's do, synchronously, so a driver that moves a device on the fake tree
//! sees it moved when its `write(2)` returns, as on a real node.
//!
//! Each attribute a move writes is a one-file FUSE mount over the fake tree's
//! file: `bus/pci/drivers_probe`, `bind` and `unbind` of every driver, and
//! `driver_override` of every device. A write is applied by
//! `sysfs_pci::testing::FakeKernel` (the unit tests' model of the PCI core:
//! `drivers/pci/pci-driver.c`, `drivers/base/bus.c`) before it is answered; a
//! refusal comes back as the kernel's errno. `driver_override` keeps its value
//! here and reads back as `drivers/pci/pci-sysfs.c` prints it (`(null)` when
//! unset). After each change the group nodes are made character devices again,
//! as containers need.
//!
//! The mounts live in the harness's own mount namespace (`main` unshares one),
//! so they go with it whatever way it ends.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    INodeNo, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyOpen, ReplyWrite,
    Request, WriteFlags,
};
use sysfs_pci::kernel::Kernel;
use sysfs_pci::testing::FakeKernel;

/// What one mounted attribute is.
enum Attr {
    /// Written to act (`bind`, `unbind`, `drivers_probe`); reads back empty.
    Action,
    /// `driver_override`: the value written, `None` when cleared.
    Override(Mutex<Option<String>>),
}

/// One attribute file.
struct AttrFs {
    /// The file in the fake tree this mount covers.
    path: PathBuf,
    attr: Attr,
    kernel: Arc<FakeKernel>,
    /// Called after every change the kernel made (the group nodes).
    after: Arc<dyn Fn() + Send + Sync>,
}

impl AttrFs {
    fn file_attr(&self) -> FileAttr {
        FileAttr {
            ino: INodeNo::ROOT,
            size: self.text().len() as u64,
            blocks: 0,
            atime: SystemTime::UNIX_EPOCH,
            mtime: SystemTime::UNIX_EPOCH,
            ctime: SystemTime::UNIX_EPOCH,
            crtime: SystemTime::UNIX_EPOCH,
            kind: FileType::RegularFile,
            perm: match self.attr {
                Attr::Action => 0o200,
                Attr::Override(_) => 0o644,
            },
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            flags: 0,
            blksize: 4096,
        }
    }

    fn text(&self) -> String {
        match &self.attr {
            Attr::Action => String::new(),
            Attr::Override(v) => match &*support::lock(v) {
                Some(d) => format!("{d}\n"),
                None => "(null)\n".into(),
            },
        }
    }
}

/// No caching: every read and write reaches the handler.
const TTL: Duration = Duration::ZERO;

impl Filesystem for AttrFs {
    fn getattr(&self, _req: &Request, _ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        reply.attr(&TTL, &self.file_attr());
    }

    // `O_TRUNC` (a shell's `>`) arrives as a size change: sysfs ignores it.
    fn setattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        reply.attr(&TTL, &self.file_attr());
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO);
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let text = self.text().into_bytes();
        let start = (offset as usize).min(text.len());
        let end = (start + size as usize).min(text.len());
        reply.data(&text[start..end]);
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Ok(text) = std::str::from_utf8(data) else {
            return reply.error(Errno::EINVAL);
        };
        match &self.attr {
            Attr::Override(v) => {
                // drivers/pci/pci-sysfs.c driver_override_store: the value up
                // to the first newline; an empty one clears the override.
                let value = text.split('\n').next().unwrap_or_default();
                *support::lock(v) = (!value.is_empty()).then(|| value.to_owned());
            }
            Attr::Action => {
                if let Err(e) = self.kernel.write(&self.path, text) {
                    return reply.error(Errno::from_i32(
                        e.errno().unwrap_or(nix::errno::Errno::EIO as i32),
                    ));
                }
                (self.after)();
            }
        }
        reply.written(data.len() as u32);
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: fuser::ReplyEmpty,
    ) {
        reply.ok();
    }
}

/// The mounted attributes; dropping it unmounts them.
pub struct PciCore {
    /// The fake kernel the writes go to.
    pub kernel: Arc<FakeKernel>,
    _mounts: Vec<BackgroundSession>,
}

impl PciCore {
    /// Mounts the attributes of every driver and device now in the tree. The
    /// drivers the devices are on now are their native ones (what a probe
    /// without an override binds).
    pub fn mount(kernel: Arc<FakeKernel>, after: Arc<dyn Fn() + Send + Sync>) -> Result<Self> {
        kernel.learn_native_drivers();
        let host = &kernel.node.host;
        let mut files = vec![(host.drivers_probe(), false)];
        for entry in std::fs::read_dir(host.drivers_dir())? {
            let dir = entry?.path();
            files.extend(["bind", "unbind"].map(|f| (dir.join(f), false)));
        }
        for address in sysfs_pci::device::list_addresses(host)? {
            files.push((host.device_dir(&address).join("driver_override"), true));
        }
        let mut mounts = Vec::new();
        for (path, is_override) in files {
            let attr = if is_override {
                let now = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                Attr::Override(Mutex::new(sysfs_pci::device::parse_driver_override(&now)))
            } else {
                Attr::Action
            };
            let fs = AttrFs {
                path: path.clone(),
                attr,
                kernel: kernel.clone(),
                after: after.clone(),
            };
            let mut config = Config::default();
            config.mount_options = vec![
                MountOption::FSName("fake-sysfs".into()),
                MountOption::NoExec,
                MountOption::NoSuid,
            ];
            let session = fuser::spawn_mount(fs, &path, &config)
                .with_context(|| format!("mounting the fake PCI core over {}", path.display()))?;
            mounts.push(session);
        }
        Ok(Self {
            kernel,
            _mounts: mounts,
        })
    }

    /// The device's native driver: what a probe with no override binds.
    pub fn set_native(&self, address: &str, driver: &str) -> Result<()> {
        let a = address.parse().context("a PCI address")?;
        support::lock(&self.kernel.native).insert(a, driver.to_owned());
        Ok(())
    }

    /// The next write whose path ends with `suffix` fails with `errno`, as a
    /// driver's probe that fails does.
    pub fn fail_next(&self, suffix: &str, errno: nix::errno::Errno) {
        *support::lock(&self.kernel.fail_on) = Some((suffix.to_owned(), errno as i32));
    }
}
