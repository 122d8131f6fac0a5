//! `sandbox-dra-driver` as a library, so its tests drive the parts directly: VFIO
//! passthrough per ResourceClaim on top of [`kubelet_plugin`], which serves it to
//! kubelet and publishes its devices.
//!
//! The driver's own knowledge: claims ([`Claims`]) and their records in the state
//! file ([`ClaimRecords`]), their CDI specs and metadata files ([`cdi`]), the
//! configuration a claim can give its devices ([`config`]), the devices it offers
//! ([`slice_devices`]), the thread that changes the node ([`Worker`]), the early
//! move before a pod binds ([`ClaimWatcher`]), narrowed to the node's claims while
//! the claim labeller (`sandbox-dra-controller`) runs, device health ([`HealthBoard`]),
//! the wait for the node's owner lock ([`owner`]) and its metrics. Whole-group
//! binding and restoring is the passthrough engine's (`passthrough` crate), shared
//! with vfio-manager.

mod binding;
pub mod cdi;
mod claims;
pub mod config;
mod devices;
mod driver;
mod events;
mod health;
mod metrics;
mod model;
pub mod owner;
pub mod programs;
mod watcher;
mod worker;

pub use binding::{Mode, OriginalDrivers};
pub use claims::{ClaimError, ClaimStepError, Claims, DriverError, Failure, Files, Recovery};
pub use devices::{
    counter_set_name, marked_devices, pcie_root, slice_devices, taint_key, withdrawn, Withdrawn,
    GROUP_COUNTER,
};
pub use driver::{follow_node, VfioDriver};
pub use health::HealthBoard;
pub use metrics::Metrics;
pub use model::{
    device_name, group_device_name, parse_device_name, reason, ClaimDevice, ClaimPhase,
    ClaimRecord, ClaimRecords, DeviceName, StateFile, DEFAULT_DRIVER_NAME,
};
pub use watcher::{watch_claims, ClaimWatch, ClaimWatcher, LeaseRef, LABELLER_CHECK};
pub use worker::{prepared_claims, OwnerLost, Worker, WorkerConfig};
