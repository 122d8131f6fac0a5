//! The pieces of `sandbox-dra-driver`, a library so its tests drive them directly:
//! the kubelet-facing gRPC servers, the service behind them, the thread that changes
//! the node, the ResourceSlice publisher, the wait for the node's owner lock, and
//! the driver's metrics and readiness.

pub mod grpc;
pub mod metrics;
pub mod owner;
pub mod publish;
pub mod ready;
pub mod service;
pub mod worker;
