//! Event sources: the node (for health) and kubelet's directory (for restarts).
//!
//! Health is event-driven: inotify on `/dev/vfio` (group nodes come and go with
//! binding) and kernel uevents for the PCI bus (bind, unbind, add, remove), with a
//! periodic full resync underneath for whatever the events cannot see.

use std::ffi::OsString;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use inotify::{EventMask, Inotify, WatchMask};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use vfio_sandbox::config::{ResourceList, ResourceName};
use vfio_sandbox::{error_chain, uevent, Host};

use crate::devices::{Snapshot, Tracker};
use crate::kubelet::Sockets;

/// Events that arrive together are handled as one rescan.
const SETTLE: Duration = Duration::from_millis(20);
/// Default resync with uevents (events carry health) and without (polling must).
const RESYNC: (Duration, Duration) = (Duration::from_secs(30), Duration::from_secs(1));

/// Rescans the node on every event or resync tick and publishes each change.
pub async fn watch_node(
    host: Host,
    list: ResourceList,
    mut tracker: Tracker,
    publish: watch::Sender<Arc<Snapshot>>,
    resync: Option<Duration>,
) {
    let uevents = match uevent::async_socket() {
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
    let mut vfio_events = None;
    // main scanned just now: the first tick is one period away.
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + resync, resync);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if vfio_events.is_none() {
            vfio_events = dir_events(
                host.vfio_dir(),
                WatchMask::CREATE | WatchMask::DELETE | WatchMask::ATTRIB,
            );
        }
        tokio::select! {
            _ = tick.tick() => {}
            ev = next_event(&mut vfio_events) => if ev.is_none() { vfio_events = None },
            ready = readable(uevents.as_ref()) => {
                if let Some(mut guard) = ready {
                    let pci = uevent::drain(guard.get_inner().as_fd());
                    guard.clear_ready();
                    if !pci { continue; }
                }
            }
        }
        tokio::time::sleep(SETTLE).await;
        let (h, l) = (host.clone(), list.clone());
        let result = tokio::task::spawn_blocking(move || {
            let r = tracker.rescan(&h, &l);
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

async fn readable(
    fd: Option<&AsyncFd<OwnedFd>>,
) -> Option<tokio::io::unix::AsyncFdReadyGuard<'_, OwnedFd>> {
    match fd {
        Some(fd) => fd.readable().await.ok(),
        None => std::future::pending().await,
    }
}

type Events = std::pin::Pin<
    Box<dyn tokio_stream::Stream<Item = std::io::Result<inotify::Event<OsString>>> + Send>,
>;

/// An inotify stream on `dir`, `None` when the directory is not there (yet).
fn dir_events(dir: PathBuf, mask: WatchMask) -> Option<Events> {
    let inotify = Inotify::init().ok()?;
    inotify.watches().add(&dir, mask).ok()?;
    inotify
        .into_event_stream(vec![0u8; 4096])
        .ok()
        .map(|s| Box::pin(s) as Events)
}

/// The next event; `None` when the stream ended (the directory went away).
async fn next_event(events: &mut Option<Events>) -> Option<inotify::Event<OsString>> {
    match events {
        Some(s) => match s.next().await {
            Some(Ok(ev)) if !ev.mask.contains(EventMask::IGNORED) => Some(ev),
            _ => None,
        },
        None => std::future::pending().await,
    }
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
            if name == deviceplugin::KUBELET_SOCKET && !ev.mask.contains(EventMask::DELETE) {
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
