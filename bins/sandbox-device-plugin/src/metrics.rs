//! The plugin's metrics, served with `--metrics-address` (see
//! [`node_agent::metrics`]).
//!
//! Labels carry resource names only, never device IDs, so the number of series stays
//! the number of resources however many devices a node has. The hot paths (Allocate,
//! ListAndWatch) hold ready handles per resource ([`ResourceMetrics`]): recording is
//! an atomic add, with no label lookup or allocation.

use passthrough::config::ResourceName;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::devices::Snapshot;

/// Allocate latency buckets, in seconds: 100 µs to 1 s.
const ALLOCATE_BUCKETS: [f64; 13] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabel {
    resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    resource: String,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    resource: String,
    result: &'static str,
}

fn allocate_histogram() -> Histogram {
    Histogram::new(ALLOCATE_BUCKETS)
}

/// Every metric of the plugin.
#[derive(Debug)]
pub struct Metrics {
    devices: Family<StateLabels, Gauge>,
    registrations: Family<ResultLabels, Counter>,
    allocations: Family<ResultLabels, Counter>,
    allocate_seconds: Family<ResourceLabel, Histogram, fn() -> Histogram>,
    updates: Family<ResourceLabel, Counter>,
}

/// One resource's handles for the hot paths.
#[derive(Clone, Debug)]
pub struct ResourceMetrics {
    /// Register calls that kubelet accepted.
    pub registered: Counter,
    /// Register calls that failed or timed out.
    pub register_failed: Counter,
    /// Allocate calls answered.
    pub allocated: Counter,
    /// Allocate calls refused.
    pub allocate_failed: Counter,
    /// Allocate latency, seconds.
    pub allocate_seconds: Histogram,
    /// ListAndWatch messages sent.
    pub updates: Counter,
}

impl Metrics {
    /// The metrics, registered in `registry`.
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self {
            devices: Family::default(),
            registrations: Family::default(),
            allocations: Family::default(),
            allocate_seconds: Family::new_with_constructor(allocate_histogram),
            updates: Family::default(),
        };
        registry.register(
            "devices",
            "Devices advertised, by resource and health (healthy, unhealthy)",
            m.devices.clone(),
        );
        registry.register(
            "registrations",
            "Register calls to kubelet, by resource and result (ok, error)",
            m.registrations.clone(),
        );
        registry.register(
            "allocate_calls",
            "Allocate calls, by resource and result (ok, error)",
            m.allocations.clone(),
        );
        registry.register_with_unit(
            "allocate_duration",
            "Time to answer an Allocate call, by resource",
            Unit::Seconds,
            m.allocate_seconds.clone(),
        );
        registry.register(
            "list_and_watch_updates",
            "ListAndWatch messages sent to kubelet, by resource",
            m.updates.clone(),
        );
        m
    }

    /// The handles for `resource` (created at zero, so they show before first use).
    pub fn resource(&self, resource: &ResourceName) -> ResourceMetrics {
        let name = resource.to_string();
        let result = |family: &Family<ResultLabels, Counter>, result| {
            family
                .get_or_create(&ResultLabels {
                    resource: name.clone(),
                    result,
                })
                .clone()
        };
        let label = ResourceLabel {
            resource: name.clone(),
        };
        ResourceMetrics {
            registered: result(&self.registrations, "ok"),
            register_failed: result(&self.registrations, "error"),
            allocated: result(&self.allocations, "ok"),
            allocate_failed: result(&self.allocations, "error"),
            allocate_seconds: self.allocate_seconds.get_or_create(&label).clone(),
            updates: self.updates.get_or_create(&label).clone(),
        }
    }

    /// Sets the device gauges from a new snapshot. Runs once per change of the node,
    /// not per call.
    pub fn set_devices(&self, snapshot: &Snapshot) {
        for (resource, devices) in snapshot {
            let healthy = devices.iter().filter(|d| d.healthy()).count();
            for (state, n) in [("healthy", healthy), ("unhealthy", devices.len() - healthy)] {
                self.devices
                    .get_or_create(&StateLabels {
                        resource: resource.to_string(),
                        state,
                    })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    }
}
