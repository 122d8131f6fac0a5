//! The labeller's metrics, served at `/metrics` beside its readiness at `/readyz`
//! (see [`node_agent::metrics`]).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// A label patch's series: `set` or `remove`, and how it ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Label {
    change: &'static str,
    result: &'static str,
}

/// The claim labeller's metrics.
#[derive(Debug)]
pub struct LabellerMetrics {
    leading: Gauge,
    labels: Family<Label, Counter>,
    lease_failures: Counter,
}

impl LabellerMetrics {
    /// The metrics, registered in `registry`, every series present at zero.
    pub fn new(registry: &mut Registry) -> Self {
        let m = Self {
            leading: Gauge::default(),
            labels: Family::default(),
            lease_failures: Counter::default(),
        };
        for change in ["set", "remove"] {
            for result in ["ok", "conflict", "error"] {
                let _ = m.labels.get_or_create(&Label { change, result });
            }
        }
        registry.register(
            "labeller_leading",
            "1 while this replica holds the claim labeller's Lease and labels claims, \
                0 while it stands by",
            m.leading.clone(),
        );
        registry.register(
            "labeller_labels",
            "Label patches of ResourceClaims, by change (set: the claim's node, \
                remove) and result (ok, conflict: the claim changed meanwhile and is \
                decided again, error: tried again later)",
            m.labels.clone(),
        );
        registry.register(
            "labeller_lease_failures",
            "Reads, takes and renewals of the Lease that failed (the API server did \
                not answer or refused)",
            m.lease_failures.clone(),
        );
        m
    }

    /// This replica leads (or stopped leading).
    pub fn leading(&self, leading: bool) {
        self.leading.set(i64::from(leading));
    }

    /// A label patch: `set` or `remove`, and `ok`, `conflict` or `error`.
    pub fn label(&self, set: bool, result: &'static str) {
        let change = if set { "set" } else { "remove" };
        self.labels.get_or_create(&Label { change, result }).inc();
    }

    /// A request about the Lease failed.
    pub fn lease_failed(&self) {
        self.lease_failures.inc();
    }
}
