//! Event sources: the node (for health) and kubelet's directory (for restarts).
//!
//! Health is event-driven: inotify on `/dev/vfio` (group nodes come and go with
//! binding) and kernel uevents for the PCI bus (bind, unbind, add, remove), with a
//! periodic full resync underneath for whatever the events cannot see.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use node_agent::watch::{AsyncNodeWatch, DirEvents, EventMask, Options, WatchMask};
use passthrough::config::{ResourceList, ResourceName};
use sysfs_pci::{error_chain, Host};
use tokio::sync::{mpsc, watch};

use crate::devices::{Snapshot, Tracker};
use crate::kubelet::Sockets;

/// Follows the node and publishes each change of health.
///
/// The node watcher ([`node_agent::watch`]) hands over each burst as one batch;
/// only the devices and groups it names are read again, unless it asks for all.
pub async fn watch_node(
    host: Host,
    list: ResourceList,
    mut tracker: Tracker,
    publish: watch::Sender<Arc<Snapshot>>,
    resync: Option<Duration>,
) {
    let mut node = AsyncNodeWatch::open(
        &host,
        Options {
            resync,
            ..Options::default()
        },
    );
    loop {
        let work = node.next().await;
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

/// Watches the device-plugins directory: `kubelet.sock` created means kubelet
/// restarted (restart every resource: `None`); one of our sockets deleted means that
/// resource must serve again (`Some`).
pub async fn watch_kubelet_dir(
    dir: PathBuf,
    sockets: Sockets,
    restart: mpsc::UnboundedSender<Option<ResourceName>>,
) {
    loop {
        let mut events = match DirEvents::open(
            std::slice::from_ref(&dir),
            WatchMask::CREATE | WatchMask::DELETE | WatchMask::MOVED_TO,
        ) {
            Ok(events) => events,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot watch the kubelet directory; retrying in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        while let Some(ev) = events.next().await {
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
