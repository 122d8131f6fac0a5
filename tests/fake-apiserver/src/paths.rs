//! Paths of the objects a node agent reads.

/// `/api/v1/nodes/<name>`.
pub fn node(name: &str) -> String {
    format!("/api/v1/nodes/{name}")
}
/// `/api/v1/namespaces/<ns>/pods/<name>`.
pub fn pod(ns: &str, name: &str) -> String {
    format!("/api/v1/namespaces/{ns}/pods/{name}")
}
/// `/apis/apps/v1/namespaces/<ns>/daemonsets/<name>`.
pub fn daemonset(ns: &str, name: &str) -> String {
    format!("/apis/apps/v1/namespaces/{ns}/daemonsets/{name}")
}
/// `/apis/events.k8s.io/v1/namespaces/<ns>/events`.
pub fn events(ns: &str) -> String {
    format!("/apis/events.k8s.io/v1/namespaces/{ns}/events")
}
/// `/apis/resource.k8s.io/v1/resourceslices` (cluster-scoped).
pub fn resourceslices() -> String {
    "/apis/resource.k8s.io/v1/resourceslices".to_owned()
}
/// `/apis/resource.k8s.io/v1/resourceslices/<name>`.
pub fn resourceslice(name: &str) -> String {
    format!("/apis/resource.k8s.io/v1/resourceslices/{name}")
}
/// `/apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims`.
pub fn resourceclaims(ns: &str) -> String {
    format!("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims")
}
/// `/apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims/<name>`.
pub fn resourceclaim(ns: &str, name: &str) -> String {
    format!("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}")
}
