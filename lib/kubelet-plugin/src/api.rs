//! How the plugin talks to the API server: the group version it reads and
//! writes, and the bounds every request of it keeps.

use std::time::Duration;

/// The group version of every ResourceSlice and ResourceClaim the plugin reads
/// and writes, served from Kubernetes 1.34 on ([`crate::Plugin::resource_api_served`]).
pub const RESOURCE_API: &str = "resource.k8s.io/v1";
/// Upper bound for one request to the API server.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a write that met a conflict re-reads and tries again.
pub(crate) const ATTEMPTS: u32 = 5;
