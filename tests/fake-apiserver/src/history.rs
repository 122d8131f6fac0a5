//! The recent changes of every served resource, as kube-apiserver's watch cache
//! keeps them (the cyclic buffer of
//! staging/src/k8s.io/apiserver/pkg/storage/cacher/watch_cache.go): what the
//! store records on each write and what watches replay and follow ([`crate::watch`]).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::mpsc;

/// How many changes of one resource the history keeps unless told otherwise.
/// The real cache sizes itself between 100 and 100Ki events and grows while
/// its events are fresh, so a burst in a test should not expire a watch.
pub const DEFAULT_HISTORY: usize = 1024;

/// How often a watch that allows bookmarks gets one unless told otherwise. The
/// real server sends one about every minute (`bookmarkFrequency` in
/// staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go); a stand-in for
/// tests is better served by a shorter beat.
pub const DEFAULT_BOOKMARK_PERIOD: Duration = Duration::from_secs(5);

/// One change of an object: what it became (`None` when deleted) and what it
/// was (`None` when created), at resourceVersion `rv`.
#[derive(Debug, Clone)]
pub(crate) struct Change {
    pub rv: u64,
    pub namespace: Option<String>,
    pub object: Option<Value>,
    pub prev: Option<Value>,
}

/// The recent changes of one resource.
#[derive(Debug, Default)]
pub(crate) struct Window {
    pub changes: VecDeque<Arc<Change>>,
    /// The resourceVersion of the newest change that fell out; 0 when none has.
    pub dropped: u64,
}

/// How many watches are being served, for tests to wait on.
#[derive(Debug, Default)]
pub(crate) struct OpenWatches {
    count: Mutex<usize>,
    changed: std::sync::Condvar,
}

impl OpenWatches {
    fn add(&self, delta: isize) {
        let mut c = self.count.lock().unwrap_or_else(PoisonError::into_inner);
        *c = c.saturating_add_signed(delta);
        self.changed.notify_all();
    }

    /// Waits up to `timeout` for exactly `n` open watches; whether they are.
    pub fn wait_for(&self, n: usize, timeout: Duration) -> bool {
        let c = self.count.lock().unwrap_or_else(PoisonError::into_inner);
        let (c, _) = self
            .changed
            .wait_timeout_while(c, timeout, |c| *c != n)
            .unwrap_or_else(PoisonError::into_inner);
        *c == n
    }
}

/// Counts one watch as open while it lives.
#[derive(Debug)]
pub(crate) struct OpenWatch(Arc<OpenWatches>);

impl OpenWatch {
    pub fn new(open: &Arc<OpenWatches>) -> Self {
        open.add(1);
        Self(Arc::clone(open))
    }
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.add(-1);
    }
}

/// A resource, as its group/version and plural.
pub(crate) type Resource = (&'static str, &'static str);

/// An open watch of a resource: where its changes go.
pub(crate) type Subscriber = (Resource, mpsc::UnboundedSender<Arc<Change>>);

/// The recent changes of every resource, and what tells watches about new ones.
#[derive(Debug)]
pub(crate) struct History {
    pub windows: BTreeMap<Resource, Window>,
    capacity: usize,
    /// The bookmark beat of watches started from now on.
    pub bookmark_period: Duration,
    /// The open watches of each resource, handed every change.
    pub subscribers: Vec<Subscriber>,
    /// Carries the newest resourceVersion, for a watch from the future.
    pub notify: tokio::sync::watch::Sender<u64>,
    /// The watches being served.
    pub open: Arc<OpenWatches>,
}

impl Default for History {
    fn default() -> Self {
        Self {
            windows: BTreeMap::new(),
            capacity: DEFAULT_HISTORY,
            bookmark_period: DEFAULT_BOOKMARK_PERIOD,
            subscribers: Vec::new(),
            notify: tokio::sync::watch::Sender::default(),
            open: Arc::default(),
        }
    }
}

impl History {
    /// Keeps a change of an object of `resource` and wakes the watches.
    pub fn record(
        &mut self,
        rv: u64,
        key: Resource,
        namespace: Option<String>,
        object: Option<Value>,
        prev: Option<Value>,
    ) {
        let change = Arc::new(Change {
            rv,
            namespace,
            object,
            prev,
        });
        let window = self.windows.entry(key).or_default();
        window.changes.push_back(Arc::clone(&change));
        Self::trim(window, self.capacity);
        // A watch whose task ended has dropped its receiver: forget it.
        self.subscribers
            .retain(|(k, tx)| *k != key || tx.send(Arc::clone(&change)).is_ok());
        self.notify.send_replace(rv);
    }

    fn trim(window: &mut Window, capacity: usize) {
        while window.changes.len() > capacity {
            if let Some(c) = window.changes.pop_front() {
                window.dropped = c.rv;
            }
        }
    }

    /// Keeps at most `capacity` (at least 1) changes per resource from now on.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        for w in self.windows.values_mut() {
            Self::trim(w, self.capacity);
        }
    }

    /// Ends every open watch (cleanly, as a restarting server or a load
    /// balancer does); clients come back with the last resourceVersion they saw.
    pub fn end_watches(&mut self) {
        self.subscribers.clear();
    }
}
