//! A kubelet plugin for Dynamic Resource Allocation: what a DRA driver needs
//! around its own work, so that the driver is only its policy.
//!
//! A driver implements [`Driver`] — prepare and unprepare a batch of claims, list
//! its devices, report their health — and [`Plugin`] does the rest:
//!
//! - **registration** with kubelet's plugin watcher (`<registry-dir>/<driver>-reg.sock`),
//!   and the `DRAPlugin` service in both versions kubelet speaks (`v1`, `v1beta1`)
//!   on `<plugins-dir>/<driver>/dra.sock`; a socket file someone deletes is served
//!   again at once, so kubelet registers the driver anew;
//! - **each call checked once**: an empty uid, or one uid named twice for two
//!   claims, is refused; every uid asked gets one answer and no other uid gets one;
//! - **claim reads under one deadline**: every claim to prepare is read from the API
//!   server (its uid checked, its allocation present, its devices of this driver in
//!   this node's pool kept), eight at a time, within the call's time limit, which
//!   the driver's work shares;
//! - **ResourceSlices**: one pool per node, in slices of at most 64 devices at one
//!   generation, owned by the Node, written only when something changed, conflicts
//!   retried, restored within moments when someone else deletes or changes them
//!   (kubelet's wipes), counter sets laid out as the server's version wants them,
//!   and the newer device fields (taints, binding conditions, counters) left out
//!   once the API server shows it drops them ([`Fields`]);
//! - **health**: the driver's reports streamed to kubelet (`DRAResourceHealth` v1
//!   and v1alpha1), resent before kubelet would time them out;
//! - **readiness**: a ready file kept while kubelet has accepted the registration
//!   and the slices are published, and [`probe`] for a readiness probe.
//!
//! It is the Rust counterpart of Go's
//! `k8s.io/dynamic-resource-allocation/kubeletplugin` and `resourceslice`.
//!
//! # Example
//!
//! A driver with two devices that need nothing done to them: prepare answers with
//! one CDI device per allocated device, unprepare has nothing to undo.
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use k8s_openapi::api::resource::v1::Device;
//! use kubelet_plugin::{
//!     Answers, Claim, ClaimRef, Clients, Config, Driver, Fields, Offer, Plugin, PreparedDevice,
//! };
//!
//! const DRIVER: &str = "example.com";
//!
//! struct Example;
//!
//! #[derive(Debug, thiserror::Error)]
//! #[error("device {0} is not one of ours")]
//! struct Unknown(String);
//!
//! #[tonic::async_trait]
//! impl Driver for Example {
//!     type Error = Unknown;
//!
//!     async fn prepare(
//!         &self,
//!         claims: Vec<Claim>,
//!         _deadline: tokio::time::Instant,
//!     ) -> Answers<Vec<PreparedDevice>, Unknown> {
//!         claims
//!             .into_iter()
//!             .map(|claim| {
//!                 let devices = claim
//!                     .devices
//!                     .iter()
//!                     .map(|d| match d.device.as_str() {
//!                         "dev-0" | "dev-1" => Ok(PreparedDevice {
//!                             request_names: d.request_names.clone(),
//!                             pool_name: d.pool.clone(),
//!                             device_name: d.device.clone(),
//!                             cdi_device_ids: vec![format!("{DRIVER}/dev={}", d.device)],
//!                         }),
//!                         other => Err(Unknown(other.to_owned())),
//!                     })
//!                     .collect();
//!                 (claim.reference.uid, devices)
//!             })
//!             .collect()
//!     }
//!
//!     async fn unprepare(
//!         &self,
//!         claims: Vec<ClaimRef>,
//!         _deadline: tokio::time::Instant,
//!     ) -> Answers<(), Unknown> {
//!         claims.into_iter().map(|c| (c.uid, Ok(()))).collect()
//!     }
//!
//!     fn devices(&self, _fields: Fields) -> Result<Offer, Unknown> {
//!         let devices = ["dev-0", "dev-1"].map(|name| Device {
//!             name: name.into(),
//!             ..Device::default()
//!         });
//!         Ok(Vec::from(devices).into())
//!     }
//! }
//!
//! #[tokio::main(flavor = "current_thread")]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let client = kube::Client::try_default().await?;
//!     let node = std::env::var("NODE_NAME")?;
//!     let plugin = Plugin::new(Config::new(DRIVER, node), Clients::new(client))?;
//!     let stop = async { let _ = tokio::signal::ctrl_c().await; };
//!     plugin.run(Arc::new(Example), stop).await?;
//!     Ok(())
//! }
//! ```
//!
//! A driver whose devices change tells the plugin through [`Plugin::republish`];
//! one that reports health returns its channel from [`Driver::health`]; one that
//! counts its calls or posts Events on failed claims does it in
//! [`Driver::answered`]. A driver with binding conditions sets them on a claim's
//! devices through [`status::DeviceStatus`].

mod batch;
mod claim;
mod config;
mod driver;
mod grpc;
pub mod health;
pub mod metadata;
mod plugin;
mod publish;
mod ready;
pub mod slices;
pub mod status;

pub use claim::{
    allocated_devices, allocation_results, opaque_configs, read_claim, AllocatedDevice, Claim,
    ClaimRef, ConfigSource, OpaqueConfig, ReadError, Ticket, POD_CLAIM_NAME_ANNOTATION,
    READ_TIMEOUT,
};
pub use config::{
    Config, ConfigError, DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR, KUBELET_CALL_TIMEOUT,
};
pub use driver::{
    Answers, Call, CallKind, ClaimError, Driver, Fields, Offer, PreparedDevice, PublishError,
    Published,
};
pub use health::{DeviceHealth, Health, HealthReports};
pub use plugin::{Clients, Plugin, ServeError};
pub use publish::{Republish, PASS_SPACING};
pub use ready::probe;
