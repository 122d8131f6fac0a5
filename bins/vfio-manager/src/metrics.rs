//! vfio-manager's metrics, served by `run --metrics-address` (see
//! [`node_agent::metrics`]). Labels are fixed words, never device addresses.

use passthrough::inventory::Inventory;
use passthrough::{BindReport, RestoreReport};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct State {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Decision {
    decision: &'static str,
}

/// Every metric of vfio-manager.
#[derive(Debug, Default)]
pub struct Metrics {
    devices: Family<State, Gauge>,
    binds: Family<Outcome, Counter>,
    restores: Family<Outcome, Counter>,
    stops: Family<Decision, Counter>,
}

impl Metrics {
    /// The metrics, registered in `registry`, every series present at zero.
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self::default();
        for state in ["bound", "not_bound", "held", "stuck"] {
            let _ = m.devices.get_or_create(&State { state });
        }
        for result in ["ok", "error"] {
            let _ = m.binds.get_or_create(&Outcome { result });
        }
        for result in ["ok", "held", "error"] {
            let _ = m.restores.get_or_create(&Outcome { result });
        }
        for decision in ["keep", "restore"] {
            let _ = m.stops.get_or_create(&Decision { decision });
        }
        registry.register(
            "devices",
            "Selected devices and their IOMMU-group companions, by state: bound (on \
                their vfio driver), not_bound, held (skipped by the last restore \
                because a VM holds the group), stuck (a sysfs write to it has not \
                returned within --write-timeout: its driver is blocked in the kernel)",
            m.devices.clone(),
        );
        registry.register(
            "binds",
            "Devices moved to their vfio driver (ok) and IOMMU groups that failed to bind (error)",
            m.binds.clone(),
        );
        registry.register(
            "restores",
            "Devices put back on their native driver (ok), skipped because a VM holds \
                their group (held), or that failed (error)",
            m.restores.clone(),
        );
        registry.register(
            "stops",
            "Stops of run, by what was done with the devices: keep (the node stays in \
                VM mode) or restore",
            m.stops.clone(),
        );
        m
    }

    /// Bound and not-bound counts after a pass.
    pub fn observe(&self, inv: &Inventory) {
        let bound = inv.entries.iter().filter(|e| e.is_bound()).count();
        self.set("bound", bound);
        self.set("not_bound", inv.entries.len() - bound);
    }

    /// Devices whose sysfs write has not returned.
    pub fn stuck(&self, n: usize) {
        self.set("stuck", n);
    }

    /// A bind's outcome.
    pub fn bind(&self, report: &BindReport) {
        self.add(&self.binds, "ok", report.bound.len());
        self.add(&self.binds, "error", report.failed.len());
    }

    /// A restore's outcome.
    pub fn restore(&self, report: &RestoreReport) {
        self.add(&self.restores, "ok", report.restored.len());
        self.add(&self.restores, "held", report.in_use.len());
        self.add(&self.restores, "error", report.failed.len());
        self.set("held", report.in_use.len());
    }

    /// What a stop did.
    pub fn stop(&self, decision: &'static str) {
        self.stops.get_or_create(&Decision { decision }).inc();
    }

    fn set(&self, state: &'static str, n: usize) {
        self.devices
            .get_or_create(&State { state })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    fn add(&self, family: &Family<Outcome, Counter>, result: &'static str, n: usize) {
        family
            .get_or_create(&Outcome { result })
            .inc_by(u64::try_from(n).unwrap_or(u64::MAX));
    }
}
