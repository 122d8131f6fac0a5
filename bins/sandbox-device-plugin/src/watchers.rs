//! Event sources: the node (for health) and kubelet's directory (for restarts).
//!
//! Health is event-driven: inotify on `/dev/vfio` (group nodes come and go with
//! binding) and kernel uevents for the PCI bus (bind, unbind, add, remove), with a
//! periodic full resync underneath for whatever the events cannot see.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kubelet_api::serve::{DirEvents, EventMask, WatchMask};
use node_agent::watch::{AsyncNodeWatch, Changes, Options};
use passthrough::config::{ResourceList, ResourceName};
use support::error_chain;
use sysfs_pci::device::DeviceError;
use sysfs_pci::Host;
use tokio::sync::{mpsc, watch};

use crate::devices::{Changed, Snapshot, Tracker};
use crate::kubelet::Sockets;

/// A batch naming at most this many functions and groups is read on the runtime
/// thread; a larger one on a blocking thread.
const READ_INLINE: usize = 8;

/// Follows the node and publishes each change of health.
///
/// The node watcher ([`node_agent::watch`]) hands over each burst as one batch;
/// only the devices and groups it names are read again, unless it asks for all.
/// A batch that names a few devices is read right here (a handful of small sysfs
/// files): handing it to a blocking thread and back would cost two thread wake-ups,
/// more than the reads. A whole-node rescan goes to a blocking thread. The snapshot
/// is built and published only when some device's state changed.
pub async fn watch_node(
    host: Host,
    list: ResourceList,
    mut tracker: Tracker,
    publish: watch::Sender<Arc<Snapshot>>,
    resync: Option<Duration>,
    owner_lock: PathBuf,
) {
    let mut node = AsyncNodeWatch::open(
        &host,
        Options {
            resync,
            owner_lock: Some(owner_lock.clone()),
            ..Options::default()
        },
    );
    loop {
        let work = node.next().await;
        let Some((back, result)) = read(tracker, &host, &list, &work).await else {
            tracing::error!("rescan task panicked");
            return;
        };
        tracker = back;
        // The owner lock changed (or a resync): whose the devices are, again.
        let owner_changed = (work.owner || work.full)
            && tracker.set_not_ours(crate::devices::owner_problem(&owner_lock));
        match result {
            Ok(changed) if changed.is_empty() && !owner_changed => {}
            Ok(changed) => {
                log_changes(&changed);
                let snapshot = Arc::new(tracker.snapshot());
                publish.send_replace(snapshot);
            }
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "rescan failed; keeping the last state")
            }
        }
    }
}

/// Reads what `work` names: everything on a blocking thread when it asks for a
/// full read (a resync, lost events) or names many devices, else those devices
/// here. Gives the tracker back with the devices whose state changed; `None` when
/// the blocking read panicked.
async fn read(
    mut tracker: Tracker,
    host: &Host,
    list: &ResourceList,
    work: &Changes,
) -> Option<(Tracker, Result<Vec<Changed>, DeviceError>)> {
    if !work.full && work.addresses.len() + work.groups.len() <= READ_INLINE {
        let r = tracker.refresh_changes(host, list, &work.addresses, &work.groups);
        return Some((tracker, r));
    }
    let (h, l, work) = (host.clone(), list.clone(), work.clone());
    tokio::task::spawn_blocking(move || {
        let r = if work.full {
            tracker.rescan_changes(&h, &l)
        } else {
            tracker.refresh_changes(&h, &l, &work.addresses, &work.groups)
        };
        (tracker, r)
    })
    .await
    .ok()
}

/// Logs each device whose health changed (or that joined).
fn log_changes(changed: &[Changed]) {
    for c in changed {
        let d = &c.after;
        if c.before.as_ref().map(|b| &b.problem) == Some(&d.problem) {
            continue;
        }
        match &d.problem {
            None => {
                tracing::info!(resource = %c.resource, bdf = %d.address, "device healthy")
            }
            Some(why) => {
                tracing::warn!(resource = %c.resource, bdf = %d.address, reason = %why,
                    "device unhealthy")
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
                tracing::warn!(dir = %dir.display(), error = %e,
                    "cannot watch the kubelet directory; retrying in 1 s");
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

#[cfg(test)]
mod tests {
    use super::*;
    use sysfs_pci::testing::{FakeDevice, FakeNode};
    use sysfs_pci::PciAddress;

    /// A batch that asks for a full read (lost events, a resync) finds a change
    /// no event named; one that names another device does not.
    #[tokio::test]
    async fn a_batch_asking_for_everything_reads_everything() {
        let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
        let node = FakeNode::new(dir.path());
        node.add_driver("vfio-pci");
        node.add_driver("e1000e");
        for (a, g) in [("0000:01:00.0", 4), ("0000:02:00.0", 5)] {
            node.add_device(
                &FakeDevice::new(a, 0x8086, 0x10d3, 0x02_0000)
                    .driver("vfio-pci")
                    .group(g),
            );
        }
        let list = ResourceList::parse(
            r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#,
        )
        .unwrap();
        let mut tracker = Tracker::default();
        tracker.rescan(&node.host, &list).unwrap();
        let silent: PciAddress = "0000:02:00.0".parse().unwrap();
        node.attach(&silent, "e1000e");
        let other = Changes {
            addresses: ["0000:01:00.0".parse().unwrap()].into(),
            ..Changes::default()
        };
        let (tracker, r) = read(tracker, &node.host, &list, &other).await.unwrap();
        assert!(r.unwrap().is_empty());
        let full = Changes {
            full: true,
            ..Changes::default()
        };
        let (_, r) = read(tracker, &node.host, &list, &full).await.unwrap();
        let changed = r.unwrap();
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert_eq!(changed[0].after.address, silent);
        assert!(!changed[0].after.healthy());
    }
}
