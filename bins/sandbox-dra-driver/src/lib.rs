//! The pieces of `sandbox-dra-driver`, a library so its tests drive them directly:
//! the DRA-only model (claims and their records, CDI specs, ResourceSlices and
//! allocations), the kubelet-facing gRPC servers, the service behind them, the
//! thread that changes the node, the ResourceSlice publisher, the wait for the
//! node's owner lock, and the driver's metrics and readiness.
//!
//! Whole-group binding and restoring is not here: it is the passthrough engine's
//! (`passthrough` crate), shared with vfio-manager.

pub mod binding;
pub mod cdi;
pub mod claims;
pub mod grpc;
pub mod health;
pub mod metrics;
pub mod owner;
pub mod publish;
pub mod ready;
pub mod service;
pub mod slices;
pub mod worker;
