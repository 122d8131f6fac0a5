//! Event sources: the node (for health) and kubelet's directory (for restarts).
//!
//! Health is event-driven: inotify on `/dev/vfio` (group nodes come and go with
//! binding) and kernel uevents for the PCI bus (bind, unbind, add, remove), with a
//! periodic full resync underneath for whatever the events cannot see.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use inotify::{EventMask, Inotify, WatchMask};
use passthrough::config::{ResourceList, ResourceName};
use sysfs_pci::{error_chain, uevent, Host, PciAddress};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;

use crate::devices::{Snapshot, Tracker};
use crate::kubelet::Sockets;

/// Default resync with uevents (events carry health) and without (polling must).
const RESYNC: (Duration, Duration) = (Duration::from_secs(30), Duration::from_secs(1));
/// More touched groups than this in one batch are read as a whole-node rescan.
const MAX_PARTIAL_GROUPS: usize = 64;

/// What a batch of events asks to read again.
#[derive(Debug, Default)]
struct Work {
    /// Everything (a resync tick, lost events, the watch (re)made).
    full: bool,
    /// Functions named by uevents.
    addresses: BTreeSet<PciAddress>,
    /// Groups whose `/dev/vfio/<group>` changed.
    groups: BTreeSet<u32>,
}

impl Work {
    fn is_empty(&self) -> bool {
        !self.full && self.addresses.is_empty() && self.groups.is_empty()
    }
}

/// Follows the node and publishes each change of health.
///
/// Each wake-up drains every event already queued (uevents and inotify alike), so a
/// burst is handled as one batch, and reads again only the devices and groups the
/// batch names; a resync tick, lost events or a large burst read the whole node.
pub async fn watch_node(
    host: Host,
    list: ResourceList,
    mut tracker: Tracker,
    publish: watch::Sender<Arc<Snapshot>>,
    resync: Option<Duration>,
) {
    let uevents = match node_agent::watch::async_socket() {
        Ok(u) => Some(u),
        Err(e) => {
            tracing::warn!(error = %e, "no kernel uevents (needs the host network namespace); health follows the periodic resync");
            None
        }
    };
    let resync = resync.unwrap_or(if uevents.is_some() {
        RESYNC.0
    } else {
        RESYNC.1
    });
    tracing::info!(?resync, uevents = uevents.is_some(), "watching the node");
    let mut vfio = vfio_events(&host.vfio_dir());
    // main scanned just now: the first tick is one period away.
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + resync, resync);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut work = Work::default();
        if vfio.is_none() {
            // /dev/vfio appears with the first vfio driver; what happened before the
            // watch is unknown, so a new watch reads everything.
            vfio = vfio_events(&host.vfio_dir());
            work.full = vfio.is_some();
        }
        if work.is_empty() {
            tokio::select! {
                _ = tick.tick() => work.full = true,
                ev = next_event(&mut vfio) => {
                    let alive = match (&ev, vfio.as_mut()) {
                        (Some(ev), Some(events)) => note_vfio(ev, &mut work) && drain_vfio(events, &mut work),
                        _ => false,
                    };
                    if !alive {
                        vfio = None;
                        work.full = true;
                    }
                }
                ready = readable(uevents.as_ref()) => {
                    if let Some(mut guard) = ready {
                        drain_uevents(guard.get_inner().as_fd(), &mut work);
                        guard.clear_ready();
                    }
                }
            }
        }
        // Whatever else is queued joins this batch.
        if let Some(u) = &uevents {
            drain_uevents(u.get_ref().as_fd(), &mut work);
        }
        if work.is_empty() {
            continue;
        }
        if work.groups.len() + work.addresses.len() > MAX_PARTIAL_GROUPS {
            work.full = true;
        }
        let (h, l) = (host.clone(), list.clone());
        let result = tokio::task::spawn_blocking(move || {
            let r = if work.full {
                tracker.rescan(&h, &l)
            } else {
                tracker.refresh(&h, &l, &work.addresses, &work.groups)
            };
            (tracker, r)
        })
        .await;
        let Ok((back, result)) = result else {
            tracing::error!("rescan task panicked");
            return;
        };
        tracker = back;
        match result {
            Ok(snapshot) => {
                publish.send_if_modified(|cur| {
                    let changed = **cur != snapshot;
                    if changed {
                        log_changes(cur, &snapshot);
                        *cur = Arc::new(snapshot);
                    }
                    changed
                });
            }
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "rescan failed; keeping the last state")
            }
        }
    }
}

/// Reads every queued uevent into `work`.
fn drain_uevents(fd: std::os::fd::BorrowedFd<'_>, work: &mut Work) {
    let events = uevent::drain_pci(fd);
    work.full |= events.lost;
    work.addresses.extend(events.addresses);
}

/// Takes one `/dev/vfio` event into `work`; false when the watch ended (the
/// directory went away).
fn note_vfio(ev: &inotify::Event<OsString>, work: &mut Work) -> bool {
    if ev.mask.contains(EventMask::IGNORED) {
        return false;
    }
    if ev.mask.contains(EventMask::Q_OVERFLOW) {
        work.full = true;
    }
    // Group nodes are named by their number; `vfio` is the container.
    if let Some(g) = ev.name.as_ref().and_then(|n| n.to_str()?.parse().ok()) {
        work.groups.insert(g);
    }
    true
}

/// Takes every `/dev/vfio` event already queued, without waiting; false when the
/// watch ended.
fn drain_vfio(events: &mut Events, work: &mut Work) -> bool {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        match events.as_mut().poll_next(&mut cx) {
            std::task::Poll::Ready(Some(Ok(ev))) => {
                if !note_vfio(&ev, work) {
                    return false;
                }
            }
            std::task::Poll::Ready(_) => return false,
            std::task::Poll::Pending => return true,
        }
    }
}

fn log_changes(old: &Snapshot, new: &Snapshot) {
    for (resource, devices) in new {
        for d in devices {
            let before = old
                .get(resource)
                .and_then(|v| v.iter().find(|o| o.address == d.address));
            if before.map(|b| &b.problem) != Some(&d.problem) {
                match &d.problem {
                    None => {
                        tracing::info!(resource = %resource, bdf = %d.address, "device healthy")
                    }
                    Some(why) => {
                        tracing::warn!(resource = %resource, bdf = %d.address, reason = %why, "device unhealthy")
                    }
                }
            }
        }
    }
}

async fn readable<T: std::os::fd::AsRawFd>(
    fd: Option<&AsyncFd<T>>,
) -> Option<tokio::io::unix::AsyncFdReadyGuard<'_, T>> {
    match fd {
        Some(fd) => fd.readable().await.ok(),
        None => std::future::pending().await,
    }
}

type Events = std::pin::Pin<
    Box<dyn tokio_stream::Stream<Item = std::io::Result<inotify::Event<OsString>>> + Send>,
>;

/// The events of group nodes coming and going in `dir` (`/dev/vfio`).
fn vfio_events(dir: &Path) -> Option<Events> {
    dir_events(
        dir.to_owned(),
        WatchMask::CREATE | WatchMask::DELETE | WatchMask::ATTRIB | WatchMask::DELETE_SELF,
    )
}

/// The next event, IGNORED included; `None` when the stream ended.
async fn next_event(events: &mut Option<Events>) -> Option<inotify::Event<OsString>> {
    match events {
        Some(s) => s.next().await.and_then(Result::ok),
        None => std::future::pending().await,
    }
}

/// An inotify stream on `dir`, `None` when the directory is not there (yet).
fn dir_events(dir: PathBuf, mask: WatchMask) -> Option<Events> {
    let inotify = Inotify::init().ok()?;
    inotify.watches().add(&dir, mask).ok()?;
    inotify
        .into_event_stream(vec![0u8; 4096])
        .ok()
        .map(|s| Box::pin(s) as Events)
}

/// Watches the device-plugins directory: `kubelet.sock` created means kubelet
/// restarted (restart every resource: `None`); one of our sockets deleted means that
/// resource must serve again (`Some`).
pub async fn watch_kubelet_dir(
    dir: PathBuf,
    sockets: Sockets,
    restart: mpsc::UnboundedSender<Option<ResourceName>>,
) {
    loop {
        let Some(mut events) = dir_events(
            dir.clone(),
            WatchMask::CREATE | WatchMask::DELETE | WatchMask::MOVED_TO,
        ) else {
            tracing::warn!(dir = %dir.display(), "cannot watch the kubelet directory; retrying in 1 s");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let mut events = Some(&mut events);
        while let Some(ev) = next_event_ref(&mut events).await {
            let Some(name) = ev.name.as_ref().and_then(|n| n.to_str()) else {
                continue;
            };
            if name == kubelet_api::KUBELET_SOCKET && !ev.mask.contains(EventMask::DELETE) {
                tracing::info!("kubelet.sock (re)created: kubelet restarted");
                let _ = restart.send(None);
            } else if ev.mask.contains(EventMask::DELETE) {
                let owner = sockets.lock().ok().and_then(|m| m.get(name).cloned());
                if let Some(resource) = owner {
                    tracing::info!(resource = %resource, socket = name, "our socket was deleted");
                    let _ = restart.send(Some(resource));
                }
            }
        }
    }
}

async fn next_event_ref(events: &mut Option<&mut Events>) -> Option<inotify::Event<OsString>> {
    match events {
        Some(s) => match s.next().await {
            Some(Ok(ev)) if !ev.mask.contains(EventMask::IGNORED) => Some(ev),
            _ => None,
        },
        None => None,
    }
}
