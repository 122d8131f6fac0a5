//! The driver's metrics, served with `--metrics-address` (see
//! [`node_agent::metrics`]). Labels are fixed words, never claim names or device
//! addresses, so the number of series is bounded.

use crate::claims::Failure;
use kubelet_plugin::Report;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// `NodePrepareResources` or `NodeUnprepareResources`, or what the claim watcher
/// does without kubelet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// A prepare.
    Prepare,
    /// An unprepare.
    Unprepare,
    /// A claim's groups moved as soon as it was allocated (binding conditions).
    MoveEarly,
    /// A claim moved early given back: it lost its allocation before its pod
    /// started.
    GiveBack,
}

impl Operation {
    const ALL: [Self; 4] = [
        Self::Prepare,
        Self::Unprepare,
        Self::MoveEarly,
        Self::GiveBack,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::Prepare => "prepare",
            Self::Unprepare => "unprepare",
            Self::MoveEarly => "move_early",
            Self::GiveBack => "give_back",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Claims {
    operation: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Op {
    operation: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    operation: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct State {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Write {
    action: &'static str,
}

/// Call durations from 5 ms to kubelet's 45 s call limit.
const BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0, 45.0,
];

/// Every metric of the driver.
#[derive(Debug)]
pub struct Metrics {
    claims: Family<Claims, Counter>,
    seconds: Family<Op, Histogram>,
    failures: Family<Reason, Counter>,
    devices: Family<State, Gauge>,
    slice_writes: Family<Write, Counter>,
}

impl Metrics {
    /// The metrics, registered in `registry`, every series present at zero.
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self {
            claims: Family::default(),
            seconds: Family::new_with_constructor(|| Histogram::new(BUCKETS)),
            failures: Family::default(),
            devices: Family::default(),
            slice_writes: Family::default(),
        };
        for op in Operation::ALL {
            let operation = op.label();
            for result in ["ok", "error"] {
                let _ = m.claims.get_or_create(&Claims { operation, result });
            }
            let _ = m.seconds.get_or_create(&Op { operation });
            for f in Failure::ALL {
                let _ = m.failures.get_or_create(&Reason {
                    operation,
                    reason: f.label(),
                });
            }
        }
        for state in ["published", "prepared", "on_vfio"] {
            let _ = m.devices.get_or_create(&State { state });
        }
        for action in ["create", "update", "delete", "error"] {
            let _ = m.slice_writes.get_or_create(&Write { action });
        }
        registry.register(
            "dra_claims",
            "Claims kubelet asked to prepare or unprepare, and claims moved early \
                (binding conditions) or given back after losing their allocation, by \
                operation (prepare, unprepare, move_early, give_back) and result (ok, \
                error)",
            m.claims.clone(),
        );
        registry.register(
            "dra_call_seconds",
            "Duration of NodePrepareResources and NodeUnprepareResources calls, claim \
                reads included, and of early moves and give-backs",
            m.seconds.clone(),
        );
        registry.register(
            "dra_failures",
            "Claims that failed, by operation and reason: group_held (another claim or \
                a VM holds an IOMMU group), not_ours (not this node's devices), \
                timeout, api_server, unprepared (unprepared while on its way), \
                refused, failed (a step on the node)",
            m.failures.clone(),
        );
        registry.register(
            "dra_devices",
            "Devices by state: published (offered in this node's ResourceSlices), \
                prepared (allocated to a prepared claim), on_vfio (every function this \
                driver moved to vfio, IOMMU-group companions included)",
            m.devices.clone(),
        );
        registry.register(
            "dra_slice_writes",
            "ResourceSlice writes of this node's pool, by action (create, update, \
                delete), and publish passes that failed (error)",
            m.slice_writes.clone(),
        );
        m
    }

    /// One claim's answer.
    pub fn claim(&self, op: Operation, failure: Option<Failure>) {
        let operation = op.label();
        let result = if failure.is_some() { "error" } else { "ok" };
        self.claims
            .get_or_create(&Claims { operation, result })
            .inc();
        if let Some(f) = failure {
            self.failures
                .get_or_create(&Reason {
                    operation,
                    reason: f.label(),
                })
                .inc();
        }
    }

    /// One call's duration.
    pub fn call(&self, op: Operation, seconds: f64) {
        self.seconds
            .get_or_create(&Op {
                operation: op.label(),
            })
            .observe(seconds);
    }

    /// The devices of prepared claims and every function on vfio, from the state.
    pub fn devices_held(&self, prepared: usize, on_vfio: usize) {
        self.set("prepared", prepared);
        self.set("on_vfio", on_vfio);
    }

    /// A publish pass that wrote (or found up to date) `published` devices.
    pub fn published(&self, published: usize, report: &Report) {
        self.set("published", published);
        self.add("create", report.created);
        self.add("update", report.updated);
        self.add("delete", report.deleted.len());
    }

    /// A publish pass that failed.
    pub fn publish_failed(&self) {
        self.add("error", 1);
    }

    fn set(&self, state: &'static str, n: usize) {
        self.devices
            .get_or_create(&State { state })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    fn add(&self, action: &'static str, n: usize) {
        self.slice_writes
            .get_or_create(&Write { action })
            .inc_by(u64::try_from(n).unwrap_or(u64::MAX));
    }
}
