//! Device metadata (KEP-5304, "DRA device attributes downward API"): the file a
//! driver writes per request of a prepared claim and mounts into its containers,
//! where a consumer such as KubeVirt's virt-launcher reads each device's attributes.
//! The Rust counterpart of Go's `kubeletplugin/metadata.go`.
//!
//! Sources, which agree on everything below: kubernetes/kubernetes
//! `staging/src/k8s.io/dynamic-resource-allocation/api/metadata/{types.go,helpers.go,
//! v1alpha1/types.go}` and `kubeletplugin/metadata.go`, the Kubernetes
//! documentation's "device metadata protocol", and KubeVirt's reader
//! `pkg/dra/metadata/types.go` + `pkg/dra/devicemetadata/decode.go`.
//!
//! - Container path (the protocol's fixed part):
//!   `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim name>/<request>/<driver>-metadata.json`
//!   for a claim the pod names directly, and
//!   `…/resourceclaimtemplates/<pod claim name>/<request>/<driver>-metadata.json` for
//!   a claim made from a template; the pod claim name
//!   (`pod.spec.resourceClaims[].name`) is the claim's
//!   [`crate::POD_CLAIM_NAME_ANNOTATION`]. `<request>` is the top-level request: a
//!   `request/subrequest` reference loses its `/subrequest` in the path but keeps
//!   it in `requests[].name`.
//! - Content: a stream of `DeviceMetadata` objects, one per API version, newest first;
//!   readers take the first they understand. KubeVirt understands only
//!   `metadata.resource.k8s.io/v1alpha1`, so [`render`] writes exactly that one
//!   object: `kind`, `apiVersion`, `metadata{name, namespace, uid, generation}`,
//!   `podClaimName` (only for template claims), `requests[{name, devices[{driver,
//!   pool, name, attributes}]}]`, attributes as in a ResourceSlice (`{"string": …}`,
//!   `{"int": …}`, `{"bool": …}`, `{"version": …}`), two-space indented with a final
//!   newline as the upstream writer does. KubeVirt takes a device's
//!   `resource.kubernetes.io/pciBusID` for its `<hostdev>` address.
//!
//! The schema is alpha (Kubernetes 1.36); `v1beta1` exists upstream with the same
//! fields but KubeVirt does not read it yet.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ClaimRef;

/// The well-known directory inside containers where metadata files appear.
pub const CONTAINER_METADATA_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";
/// The metadata API version written (the only one KubeVirt reads).
const METADATA_API_VERSION: &str = "metadata.resource.k8s.io/v1alpha1";

/// A ResourceSlice attribute value, serialized as Kubernetes does (`{"int": 5}`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttributeValue {
    /// An integer.
    Int(i64),
    /// A boolean.
    Bool(bool),
    /// A string.
    String(String),
    /// A semantic version.
    Version(String),
}

/// One device of a request, as its metadata names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[allow(missing_docs)]
pub struct MetadataDevice<'a> {
    /// The driver name.
    pub driver: &'a str,
    pub pool: &'a str,
    /// Its ResourceSlice device name.
    pub name: &'a str,
    pub attributes: BTreeMap<&'a str, AttributeValue>,
}

#[derive(Serialize)]
struct Metadata<'a> {
    kind: &'static str,
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    metadata: ObjectMeta<'a>,
    #[serde(rename = "podClaimName", skip_serializing_if = "Option::is_none")]
    pod_claim_name: Option<&'a str>,
    requests: [Request<'a>; 1],
}

#[derive(Serialize)]
struct ObjectMeta<'a> {
    name: &'a str,
    namespace: &'a str,
    uid: &'a str,
    generation: i64,
}

#[derive(Serialize)]
struct Request<'a> {
    name: &'a str,
    devices: Vec<MetadataDevice<'a>>,
}

/// Where `claim`'s metadata appears in containers:
/// `<container dir>/resourceclaims/<claim name>`, or
/// `<container dir>/resourceclaimtemplates/<pod claim name>` for a claim made from a
/// template. The caller checks the names first: they become a path.
pub fn container_claim_dir(claim: &ClaimRef, pod_claim_name: Option<&str>) -> String {
    match pod_claim_name {
        Some(p) => format!("{CONTAINER_METADATA_DIR}/resourceclaimtemplates/{p}"),
        None => format!("{CONTAINER_METADATA_DIR}/resourceclaims/{}", claim.name),
    }
}

/// One request's metadata file: a single `v1alpha1` `DeviceMetadata` of the given
/// generation, for `request` (its full reference, `request` or
/// `request/subrequest`), with a final newline.
pub fn render(
    claim: &ClaimRef,
    pod_claim_name: Option<&str>,
    generation: i64,
    request: &str,
    devices: Vec<MetadataDevice<'_>>,
) -> serde_json::Result<String> {
    let mut text = serde_json::to_string_pretty(&Metadata {
        kind: "DeviceMetadata",
        api_version: METADATA_API_VERSION,
        metadata: ObjectMeta {
            name: &claim.name,
            namespace: &claim.namespace,
            uid: &claim.uid,
            generation,
        },
        pod_claim_name,
        requests: [Request {
            name: request,
            devices,
        }],
    })?;
    text.push('\n');
    Ok(text)
}
