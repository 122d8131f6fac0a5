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
//!   once the API server shows it drops them ([`KeptFields`]);
//! - **health**: the driver's reports streamed to kubelet (`DRAResourceHealth` v1
//!   and v1alpha1), resent before kubelet would time them out;
//! - **readiness**: a ready file kept while kubelet has accepted the registration
//!   and the slices are published, and [`probe`] for a readiness probe.
//!
//! It is the Rust counterpart of Go's
//! `k8s.io/dynamic-resource-allocation/kubeletplugin` (`Helper`) and
//! `resourceslice` (its ResourceSlice controller).
//!
//! # Where it differs from Go's `kubeletplugin.Helper`, and why
//!
//! - **Calls run concurrently.** `Helper` serializes every prepare and unprepare
//!   (its `Serialize` option, on by default: one mutex, or a lock file with
//!   rolling updates), so a driver may keep its state in one file it reads and
//!   writes per call. Here kubelet's calls reach [`Driver::prepare`] and
//!   [`Driver::unprepare`] as they come, several at once: a driver whose prepare
//!   takes seconds (moving a PCI device to another kernel driver, say) would
//!   otherwise hold every other pod of the node behind it, including pods whose
//!   claims touch other devices. The driver orders what must be ordered itself
//!   (per device, per claim); [`Claim::arrived`] tells it which call came first.
//!   Claim reads happen before the driver is called, eight at a time, as `Helper`
//!   also reads them before it takes its lock.
//! - **Publication is pulled, not pushed.** With `Helper` the driver calls
//!   `PublishResources` with its whole device list, and the controller keeps that
//!   copy. Here the plugin asks [`Driver::devices`] at every publication pass:
//!   after [`Republish::now`], after each registration kubelet accepts, and when
//!   someone else changed or deleted the slices (kubelet wipes them when it starts).
//!   So what is published is what the driver says now, never a copy older than
//!   the device it describes, and the newer device fields the API server drops
//!   are left out at the source ([`KeptFields`]) instead of being written and lost.
//! - **Readiness and health are part of it.** `Helper` leaves readiness to the
//!   driver; here a ready file follows registration and publication ([`probe`]),
//!   and [`Driver::health`] is streamed to kubelet without more code.
//!
//! # Example
//!
//! A driver with two devices that need nothing done to them: prepare answers with
//! one CDI device per allocated device, unprepare has nothing to undo. Besides
//! this crate it uses `k8s-openapi` (a version feature, `v1_34` or newer), `kube`, `tokio`,
//! `tonic` (for `#[tonic::async_trait]`) and `thiserror`. Calls come concurrently:
//! the driver is `Send + Sync` and guards its own state. `examples/cdi_driver.rs`
//! is a whole driver that writes a CDI spec per claim with [`cdi`].
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use k8s_openapi::api::resource::v1::Device;
//! use kubelet_plugin::{
//!     Answers, Claim, ClaimRef, Clients, Config, Driver, KeptFields, Offer, Plugin, PreparedDevice,
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
//!     fn devices(&self, _fields: KeptFields) -> Result<Offer, Unknown> {
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

mod api;
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod apiserver_tests;
mod batch;
pub mod cdi;
mod claim;
mod config;
mod driver;
mod grpc;
mod health;
pub mod metadata;
mod plugin;
mod publish;
mod ready;
mod slices;
pub mod status;

pub use api::RESOURCE_API;
pub use claim::{
    allocated_devices, allocation_results, opaque_configs, AllocatedDevice, Claim, ClaimRef,
    ConfigSource, OpaqueConfig, ReadError, Ticket, POD_CLAIM_NAME_ANNOTATION,
};
pub use config::{Config, ConfigError, KUBELET_CALL_TIMEOUT};
pub use driver::{
    Answers, Call, CallKind, ClaimError, Driver, KeptFields, Offer, PreparedDevice, PublishError,
    Published,
};
pub use health::{DeviceHealth, Health, HealthReports};
pub use plugin::{Clients, Plugin, ServeError};
pub use publish::Republish;
pub use ready::probe;
pub use slices::{Action, Report, SliceError, PCIE_ROOT, PCI_BUS_ID};
