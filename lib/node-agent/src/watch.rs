//! The node watcher every daemon uses: what changed on the node's PCI bus and in
//! `/dev/vfio`, in batches.
//!
//! Three sources, one behaviour:
//! - kernel uevents for the PCI bus (a function added, removed, bound, unbound),
//!   which name the function;
//! - inotify on `/dev/vfio` (group nodes come and go with binding), which names the
//!   group; the directory appears with the first vfio driver, so its watch is made
//!   again on every wake-up until it exists, and a new watch reads everything (what
//!   happened before it is unknown);
//! - with [`Options::owner_lock`], inotify on the node's owner lock directory
//!   (`passthrough::owner`), which says when the lock file was created, deleted,
//!   replaced or rewritten, so an owner that lost the node hears of it at once;
//!   made again on every wake-up until the directory exists, like `/dev/vfio`;
//! - a periodic resync underneath, for whatever the events cannot see (1 s when
//!   there are no uevents: outside the host's network namespace, polling must carry
//!   health; 30 s otherwise, unless the daemon says).
//!
//! Each wake-up takes every event already queued, from both sources, so a burst
//! (vfio-manager binding eight groups, a driver reload) is one batch: [`Changes`].
//! A batch that names more than [`MAX_PARTIAL`] functions and groups, lost events
//! (a uevent buffer overflow, an inotify queue overflow), a new `/dev/vfio` watch or
//! a resync tick ask for everything to be read again (`full`).
//!
//! Two front doors over the same [`Sources`]: [`NodeWatch`] for a `poll(2)` loop
//! (vfio-manager, which also waits on a signalfd) and [`AsyncNodeWatch`] for tokio
//! (the device plugin and the DRA driver).

use std::collections::BTreeSet;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use inotify::Inotify;
use inotify::{EventMask, WatchMask};
use sysfs_pci::{uevent, Host, PciAddress};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// Default resync with uevents: the events carry the changes.
pub const DEFAULT_RESYNC_WITH_EVENTS: Duration = Duration::from_secs(30);
/// Default resync without uevents: polling must see every change.
pub const DEFAULT_RESYNC_POLLING: Duration = Duration::from_secs(1);

/// More functions and groups than this in one batch read as a whole-node rescan.
pub const MAX_PARTIAL: usize = 64;

/// What one batch of events asks to read again.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    /// Everything: a resync tick, lost events, a new `/dev/vfio` watch, a large burst.
    pub full: bool,
    /// Functions named by uevents.
    pub addresses: BTreeSet<PciAddress>,
    /// Groups whose `/dev/vfio/<group>` node came, went or changed.
    pub groups: BTreeSet<u32>,
    /// The owner lock file was created, deleted, replaced or rewritten (or its
    /// directory watched anew).
    pub owner: bool,
    /// Of those, the file itself was created, deleted or replaced (or its
    /// directory watched anew): all its holder needs to hear, since the holder
    /// rewrites the file itself at every save, and a rewrite by another (an
    /// owner leaving) matters only to those that wait for the lock.
    pub owner_file: bool,
}

impl Changes {
    /// True when nothing asks to be read again.
    pub fn is_empty(&self) -> bool {
        !self.full && !self.owner && self.addresses.is_empty() && self.groups.is_empty()
    }

    /// True when devices are to be read again (anything but the owner lock).
    pub fn devices(&self) -> bool {
        self.full || !self.addresses.is_empty() || !self.groups.is_empty()
    }

    /// A large burst is read as a whole-node rescan.
    fn full_if_large(mut self) -> Self {
        if self.addresses.len() + self.groups.len() > MAX_PARTIAL {
            self.full = true;
        }
        self
    }
}

/// How to watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// The resync period; `None`: [`DEFAULT_RESYNC_WITH_EVENTS`] or [`DEFAULT_RESYNC_POLLING`].
    pub resync: Option<Duration>,
    /// Open the kernel uevent socket (tests of fake trees turn it off).
    pub uevents: bool,
    /// Watch this owner lock file ([`Changes::owner`]).
    pub owner_lock: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            resync: None,
            uevents: true,
            owner_lock: None,
        }
    }
}

/// How a front door holds a descriptor: as it is ([`Plain`], for `poll(2)`) or
/// registered with tokio ([`AsyncFd`]), which then owns it, so a descriptor is
/// never closed while registered.
pub trait Holder<T>: Sized {
    /// Takes `t`; `None` when it cannot be held (tokio refused the registration).
    fn hold(t: T) -> Option<Self>;
    /// The descriptor.
    fn inner(&self) -> &T;
    /// The descriptor, to read from.
    fn inner_mut(&mut self) -> &mut T;
}

/// A descriptor held as it is.
pub struct Plain<T>(T);

impl<T> Holder<T> for Plain<T> {
    fn hold(t: T) -> Option<Self> {
        Some(Self(t))
    }
    fn inner(&self) -> &T {
        &self.0
    }
    fn inner_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// A descriptor that closes when its owner drops ([`OwnedFd`], [`Inotify`]).
pub trait OwnsFd: AsRawFd {}
impl OwnsFd for OwnedFd {}
impl OwnsFd for Inotify {}

impl<T: OwnsFd> Holder<T> for AsyncFd<T> {
    fn hold(t: T) -> Option<Self> {
        // SAFETY: `t` owns its descriptor (OwnsFd) and is moved into the AsyncFd,
        // which owns it from here on: the descriptor stays open, and as_raw_fd
        // returns the same one, until the AsyncFd (and with it the registration)
        // drops.
        #[allow(unsafe_code)]
        let held = unsafe { AsyncFd::register_with_interest(t, Interest::READABLE) };
        held.ok()
    }
    fn inner(&self) -> &T {
        self.get_ref()
    }
    fn inner_mut(&mut self) -> &mut T {
        self.get_mut()
    }
}

/// The event sources: the uevent socket, the `/dev/vfio` watch and the owner
/// lock's directory watch.
pub struct Sources<U: Holder<OwnedFd>, V: Holder<Inotify>> {
    vfio_dir: PathBuf,
    uevents: Option<U>,
    vfio: Option<V>,
    /// The owner lock file, when watched.
    owner_lock: Option<PathBuf>,
    owner: Option<V>,
}

impl<U: Holder<OwnedFd>, V: Holder<Inotify>> Sources<U, V> {
    fn open(host: &Host, uevents: bool, owner_lock: Option<PathBuf>) -> Self {
        let uevents = if uevents {
            match uevent::socket_nonblocking() {
                Ok(fd) => U::hold(fd),
                Err(e) => {
                    tracing::warn!(error = %e, "no kernel uevents (needs the host \
                        network namespace); relying on the periodic resync");
                    None
                }
            }
        } else {
            None
        };
        let mut sources = Self {
            vfio_dir: host.vfio_dir(),
            uevents,
            vfio: None,
            owner_lock,
            owner: None,
        };
        // The caller reads the node once at start: the first watch needs no rescan.
        sources.ensure_vfio_watch();
        sources.ensure_owner_watch();
        sources
    }

    /// Makes the owner lock directory's watch if one is wanted and missing; true
    /// when it made one.
    fn ensure_owner_watch(&mut self) -> bool {
        let Some(dir) = self.owner_lock.as_ref().and_then(|l| l.parent()) else {
            return false;
        };
        if self.owner.is_some() {
            return false;
        }
        let mask = WatchMask::CREATE
            | WatchMask::DELETE
            | WatchMask::MOVED_FROM
            | WatchMask::MOVED_TO
            | WatchMask::CLOSE_WRITE
            | WatchMask::MODIFY
            | WatchMask::DELETE_SELF
            | WatchMask::MOVE_SELF;
        let Ok(inotify) = Inotify::init() else {
            return false;
        };
        if inotify.watches().add(dir, mask).is_err() {
            return false;
        }
        self.owner = V::hold(inotify);
        self.owner.is_some()
    }

    /// True when an owner lock is to be watched and its directory is not yet.
    fn owner_missing(&self) -> bool {
        self.owner_lock.is_some() && self.owner.is_none()
    }

    /// Makes the `/dev/vfio` watch if it is missing; true when it made one.
    fn ensure_vfio_watch(&mut self) -> bool {
        if self.vfio.is_some() {
            return false;
        }
        let mask =
            WatchMask::CREATE | WatchMask::DELETE | WatchMask::ATTRIB | WatchMask::DELETE_SELF;
        let Ok(inotify) = Inotify::init() else {
            return false;
        };
        if inotify.watches().add(&self.vfio_dir, mask).is_err() {
            return false;
        }
        self.vfio = V::hold(inotify);
        self.vfio.is_some()
    }

    /// Takes every queued event into `changes`, without waiting.
    fn collect(&mut self, changes: &mut Changes) {
        if let Some(fd) = &self.uevents {
            let events = uevent::drain_pci(fd.inner().as_fd());
            changes.full |= events.lost;
            changes.addresses.extend(events.addresses);
        }
        if self.ensure_vfio_watch() {
            // /dev/vfio appeared (or came back) since start: what happened before
            // the watch is unknown.
            changes.full = true;
        }
        if let Some(inotify) = &mut self.vfio {
            if !drain_vfio(inotify.inner_mut(), changes) {
                self.vfio = None;
                changes.full = true;
            }
        }
        if self.ensure_owner_watch() {
            changes.owner = true;
            changes.owner_file = true;
        }
        let name = self.owner_lock.as_ref().and_then(|l| l.file_name());
        if let (Some(inotify), Some(name)) = (&mut self.owner, name) {
            if !drain_owner(inotify.inner_mut(), name, changes) {
                self.owner = None;
                changes.owner = true;
                changes.owner_file = true;
            }
        }
    }

    /// True when the kernel's uevents are watched.
    pub fn has_uevents(&self) -> bool {
        self.uevents.is_some()
    }
}

/// Reads every queued `/dev/vfio` event; false when the watch ended (the directory
/// went away).
fn drain_vfio(inotify: &mut Inotify, changes: &mut Changes) -> bool {
    drain(inotify, |ev| {
        if ev.mask.contains(EventMask::Q_OVERFLOW) {
            changes.full = true;
        }
        // Group nodes are named by their number; `vfio` is the container.
        if let Some(g) = ev.name.and_then(|n| n.to_str()?.parse().ok()) {
            changes.groups.insert(g);
        }
    })
}

/// Reads every queued event of the owner lock's directory, noting those of the
/// lock file `name`; false when the watch ended (the directory went away).
fn drain_owner(inotify: &mut Inotify, name: &std::ffi::OsStr, changes: &mut Changes) -> bool {
    let replaced = EventMask::CREATE
        | EventMask::DELETE
        | EventMask::MOVED_FROM
        | EventMask::MOVED_TO
        | EventMask::DELETE_SELF
        | EventMask::MOVE_SELF
        | EventMask::Q_OVERFLOW;
    drain(inotify, |ev| {
        // Events without a name are the directory's own (or an overflow).
        let file = ev.mask.intersects(replaced);
        if ev.name == Some(name) || (ev.name.is_none() && file) {
            changes.owner = true;
            changes.owner_file |= file;
        }
    })
}

/// Hands every queued event of `inotify` to `each`, without waiting; false when
/// the watch ended (its directory went away, or the descriptor failed).
fn drain(inotify: &mut Inotify, mut each: impl FnMut(&inotify::Event<&std::ffi::OsStr>)) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        let events = match inotify.read_events(&mut buf) {
            Ok(events) => events,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return false,
        };
        for ev in events {
            if ev.mask.contains(EventMask::IGNORED) {
                return false;
            }
            each(&ev);
        }
    }
}

/// The resync schedule.
#[derive(Debug)]
struct Resync {
    period: Duration,
    next: Instant,
}

impl Resync {
    fn new(period: Duration) -> Self {
        // The caller read the node just now: the first resync is one period away.
        Self {
            period,
            next: Instant::now() + period,
        }
    }

    /// True (and the next one scheduled) when a resync is due.
    fn due(&mut self, now: Instant) -> bool {
        if now < self.next {
            return false;
        }
        self.next = now + self.period;
        true
    }
}

fn resync_period<U: Holder<OwnedFd>, V: Holder<Inotify>>(
    options: &Options,
    sources: &Sources<U, V>,
) -> Duration {
    options.resync.unwrap_or(if sources.has_uevents() {
        DEFAULT_RESYNC_WITH_EVENTS
    } else {
        DEFAULT_RESYNC_POLLING
    })
}

/// The node watcher for a `poll(2)` loop: poll [`Self::fds`] (beside your own) for
/// at most [`Self::timeout`], then take the batch with [`Self::collect`].
pub struct NodeWatch {
    sources: Sources<Plain<OwnedFd>, Plain<Inotify>>,
    resync: Resync,
}

impl NodeWatch {
    /// Opens the sources. The caller has just read the node.
    pub fn open(host: &Host, options: Options) -> Self {
        let sources = Sources::open(host, options.uevents, options.owner_lock.clone());
        let resync = Resync::new(resync_period(&options, &sources));
        tracing::info!(resync = ?resync.period, uevents = sources.has_uevents(),
            "watching the node");
        Self { sources, resync }
    }

    /// The descriptors to poll for readability.
    pub fn fds(&self) -> Vec<BorrowedFd<'_>> {
        let mut fds = Vec::with_capacity(2);
        if let Some(u) = &self.sources.uevents {
            fds.push(u.inner().as_fd());
        }
        if let Some(v) = &self.sources.vfio {
            fds.push(v.inner().as_fd());
        }
        if let Some(o) = &self.sources.owner {
            fds.push(o.inner().as_fd());
        }
        fds
    }

    /// How long to wait at most: until the next resync, or 1 s while `/dev/vfio`
    /// or the owner lock's directory is not watched yet (each is looked for again
    /// on every wake-up).
    pub fn timeout(&self) -> Duration {
        let until = self.resync.next.saturating_duration_since(Instant::now());
        if self.sources.vfio.is_none() || self.sources.owner_missing() {
            until.min(Duration::from_secs(1))
        } else {
            until
        }
    }

    /// Every queued event, without waiting, plus a full rescan when the resync is
    /// due. Empty when nothing happened.
    pub fn collect(&mut self) -> Changes {
        let mut changes = Changes::default();
        self.sources.collect(&mut changes);
        if self.resync.due(Instant::now()) {
            changes.full = true;
        }
        changes.full_if_large()
    }

    /// Asks for a full pass after `delay` (a pass that failed is tried again soon),
    /// unless one is due sooner.
    pub fn retry_in(&mut self, delay: Duration) {
        self.resync.next = self.resync.next.min(Instant::now() + delay);
    }

    /// True when the kernel's uevents are watched.
    pub fn has_uevents(&self) -> bool {
        self.sources.has_uevents()
    }
}

/// The node watcher for tokio: [`Self::next`] waits for the next batch.
pub struct AsyncNodeWatch {
    sources: Sources<AsyncFd<OwnedFd>, AsyncFd<Inotify>>,
    resync: Duration,
    tick: tokio::time::Interval,
}

impl AsyncNodeWatch {
    /// Opens the sources. The caller has just read the node. Needs a tokio runtime.
    pub fn open(host: &Host, options: Options) -> Self {
        let sources = Sources::open(host, options.uevents, options.owner_lock.clone());
        let resync = resync_period(&options, &sources);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + resync, resync);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(
            ?resync,
            uevents = sources.has_uevents(),
            "watching the node"
        );
        Self {
            sources,
            resync,
            tick,
        }
    }

    /// The resync period in use.
    pub fn resync(&self) -> Duration {
        self.resync
    }

    /// True when the kernel's uevents are watched.
    pub fn has_uevents(&self) -> bool {
        self.sources.has_uevents()
    }

    /// Waits until something happened, then returns every event queued by then as
    /// one batch. Cancel-safe: events are only taken from the sources right before
    /// the batch is returned.
    pub async fn next(&mut self) -> Changes {
        loop {
            let mut changes = Changes::default();
            self.sources.collect(&mut changes);
            if !changes.is_empty() {
                return changes.full_if_large();
            }
            let missing = self.sources.vfio.is_none() || self.sources.owner_missing();
            tokio::select! {
                _ = self.tick.tick() => {
                    let mut changes = Changes { full: true, ..Changes::default() };
                    self.sources.collect(&mut changes);
                    return changes;
                }
                () = readable(self.sources.uevents.as_ref()) => {}
                () = readable(self.sources.vfio.as_ref()) => {}
                () = readable(self.sources.owner.as_ref()) => {}
                // /dev/vfio and the owner lock's directory are looked for again
                // every second until they exist.
                () = tokio::time::sleep(Duration::from_secs(1)), if missing => {}
            }
        }
    }
}

/// Completes when `fd` is readable (its readiness cleared first: the caller then
/// reads until the queue is empty, and anything arriving later wakes it again);
/// never without a descriptor.
async fn readable<T: AsRawFd>(fd: Option<&AsyncFd<T>>) {
    let Some(fd) = fd else {
        return std::future::pending().await;
    };
    match fd.readable().await {
        Ok(mut guard) => guard.clear_ready(),
        Err(_) => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
