#![allow(clippy::unwrap_used)]

use std::path::Path;

use super::*;

/// A scratch node whose `/dev` holds a `vfio` directory when `vfio` is true.
fn node(vfio: bool) -> (tempfile::TempDir, Host) {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let host = Host::new(
        dir.path().join("sys"),
        dir.path().join("dev"),
        dir.path().join("modules"),
    );
    std::fs::create_dir_all(&host.dev).unwrap();
    if vfio {
        std::fs::create_dir_all(host.vfio_dir()).unwrap();
    }
    (dir, host)
}

/// No uevents (the host's own bus is not ours to watch in a test), no resync.
const QUIET: Options = Options {
    resync: Some(Duration::from_secs(3600)),
    uevents: false,
    owner_lock: None,
};

fn touch(path: &Path) {
    std::fs::write(path, b"").unwrap();
}

/// Runs `f` on a current-thread runtime, bounded so a missed event fails the test
/// instead of hanging it.
fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), f)
            .await
            .expect("the watcher never woke")
    })
}

#[test]
fn a_group_node_coming_and_going_names_its_group() {
    let (_dir, host) = node(true);
    within(async {
        let mut w = AsyncNodeWatch::open(&host, QUIET);
        touch(&host.vfio_group_node(7));
        let c = w.next().await;
        assert_eq!(c.groups, BTreeSet::from([7]), "{c:?}");
        assert!(!c.full, "{c:?}");
        std::fs::remove_file(host.vfio_group_node(7)).unwrap();
        let c = w.next().await;
        assert_eq!(c.groups, BTreeSet::from([7]), "{c:?}");
        // The container node is not a group.
        touch(&host.vfio_container_node());
        touch(&host.vfio_group_node(3));
        let c = w.next().await;
        assert_eq!(c.groups, BTreeSet::from([3]), "{c:?}");
    });
}

#[test]
fn a_burst_already_queued_is_one_batch() {
    let (_dir, host) = node(true);
    within(async {
        let mut w = AsyncNodeWatch::open(&host, QUIET);
        for g in 0..20 {
            touch(&host.vfio_group_node(g));
        }
        let c = w.next().await;
        assert_eq!(c.groups, (0..20).collect::<BTreeSet<u32>>(), "{c:?}");
        assert!(!c.full);
    });
}

#[test]
fn a_burst_larger_than_a_partial_read_asks_for_everything() {
    let (_dir, host) = node(true);
    within(async {
        let mut w = AsyncNodeWatch::open(&host, QUIET);
        for g in 0..=MAX_PARTIAL as u32 {
            touch(&host.vfio_group_node(g));
        }
        let c = w.next().await;
        assert!(c.full, "{} groups in one batch", c.groups.len());
    });
}

#[test]
fn vfio_appearing_after_start_asks_for_everything() {
    let (_dir, host) = node(false);
    within(async {
        let mut w = AsyncNodeWatch::open(&host, QUIET);
        std::fs::create_dir_all(host.vfio_dir()).unwrap();
        let c = w.next().await;
        assert!(c.full, "{c:?}");
        // From then on, the new watch names groups.
        touch(&host.vfio_group_node(4));
        let c = w.next().await;
        assert_eq!(c.groups, BTreeSet::from([4]), "{c:?}");
        assert!(!c.full);
    });
}

#[test]
fn vfio_going_away_and_back_asks_for_everything_each_time() {
    let (_dir, host) = node(true);
    within(async {
        let mut w = AsyncNodeWatch::open(&host, QUIET);
        std::fs::remove_dir(host.vfio_dir()).unwrap();
        let c = w.next().await;
        assert!(c.full, "the watch ended: {c:?}");
        std::fs::create_dir_all(host.vfio_dir()).unwrap();
        let c = w.next().await;
        assert!(c.full, "a new watch: {c:?}");
        touch(&host.vfio_group_node(9));
        assert_eq!(w.next().await.groups, BTreeSet::from([9]));
    });
}

#[test]
fn the_resync_reads_everything() {
    let (_dir, host) = node(true);
    within(async {
        let options = Options {
            resync: Some(Duration::from_millis(50)),
            ..QUIET
        };
        let mut w = AsyncNodeWatch::open(&host, options);
        assert_eq!(w.resync(), Duration::from_millis(50));
        for _ in 0..3 {
            let c = w.next().await;
            assert!(c.full, "{c:?}");
        }
    });
}

#[test]
fn without_uevents_the_default_resync_is_the_polling_one() {
    let (_dir, host) = node(true);
    within(async {
        let w = AsyncNodeWatch::open(
            &host,
            Options {
                resync: None,
                ..QUIET
            },
        );
        assert!(!w.has_uevents());
        assert_eq!(w.resync(), DEFAULT_RESYNC_POLLING);
    });
}

#[test]
fn an_abandoned_wait_loses_nothing() {
    let (_dir, host) = node(true);
    within(async {
        let mut w = AsyncNodeWatch::open(&host, QUIET);
        // A wait given up by a select! (another branch won) ...
        let gave_up = tokio::time::timeout(Duration::from_millis(20), w.next()).await;
        assert!(gave_up.is_err());
        // ... keeps what arrives afterwards for the next wait.
        touch(&host.vfio_group_node(5));
        assert_eq!(w.next().await.groups, BTreeSet::from([5]));
    });
}

#[test]
fn the_poll_front_door_sees_the_same_batches() {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let (_dir, host) = node(true);
    let mut w = NodeWatch::open(&host, QUIET);
    assert!(w.collect().is_empty(), "nothing happened yet");
    for g in [1, 2] {
        touch(&host.vfio_group_node(g));
    }
    {
        let mut fds: Vec<PollFd> = w
            .fds()
            .into_iter()
            .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
            .collect();
        assert_eq!(fds.len(), 1, "the /dev/vfio watch, no uevents");
        let n = poll(&mut fds, PollTimeout::from(5000u16)).unwrap();
        assert_eq!(n, 1, "the watch is readable");
    }
    let c = w.collect();
    assert_eq!(c.groups, BTreeSet::from([1, 2]), "{c:?}");
    assert!(w.collect().is_empty(), "the batch was taken whole");
    w.retry_in(Duration::ZERO);
    assert!(w.collect().full, "a retry asks for everything");
    assert!(
        w.timeout() > Duration::from_secs(3000),
        "then the resync is a period away"
    );
}

#[test]
fn the_poll_front_door_looks_for_vfio_every_second_until_it_exists() {
    let (_dir, host) = node(false);
    let mut w = NodeWatch::open(&host, QUIET);
    assert!(w.fds().is_empty());
    assert!(w.timeout() <= Duration::from_secs(1));
    std::fs::create_dir_all(host.vfio_dir()).unwrap();
    assert!(w.collect().full, "a new /dev/vfio watch reads everything");
    assert_eq!(w.fds().len(), 1);
    assert!(w.timeout() > Duration::from_secs(1));
}

/// The owner lock file deleted, created again, rewritten or replaced by a rename
/// wakes the watcher with `owner`, and with `owner_file` unless it was only
/// rewritten; another file of its directory does not; a directory that appears
/// after start is watched from then on, and says so.
#[test]
fn the_owner_lock_file_changing_wakes_the_watcher() {
    let (dir, host) = node(true);
    let lock = dir.path().join("run/owner/owner.lock");
    let options = Options {
        owner_lock: Some(lock.clone()),
        ..QUIET
    };
    within(async {
        let mut w = AsyncNodeWatch::open(&host, options);
        // The directory does not exist yet: looked for every second.
        std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
        let c = w.next().await;
        assert!(c.owner && c.owner_file && !c.full, "{c:?}");
        touch(&lock);
        let c = w.next().await;
        assert!(c.owner && c.owner_file, "{c:?}");
        std::fs::write(&lock, b"{\"owner\":\"x\"}").unwrap();
        let c = w.next().await;
        assert!(c.owner && !c.owner_file, "a rewrite: {c:?}");
        std::fs::remove_file(&lock).unwrap();
        let c = w.next().await;
        assert!(c.owner && c.owner_file, "{c:?}");
        let other = lock.with_file_name("owner.lock.new");
        touch(&other);
        std::fs::rename(&other, &lock).unwrap();
        let c = w.next().await;
        assert!(c.owner && c.owner_file, "{c:?}");
        // A group node still names its group, and says nothing of the owner.
        touch(&host.vfio_group_node(4));
        let c = w.next().await;
        assert_eq!((c.groups.len(), c.owner), (1, false), "{c:?}");
    });
    // The poll front door takes the same descriptor.
    let w = NodeWatch::open(
        &host,
        Options {
            owner_lock: Some(lock),
            ..QUIET
        },
    );
    assert_eq!(w.fds().len(), 2, "/dev/vfio and the owner lock's directory");
}
