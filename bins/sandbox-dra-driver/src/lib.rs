//! The pieces of `sandbox-dra-driver`, a library so its tests drive them directly:
//! the kubelet-facing gRPC servers, the service behind them, the thread that changes
//! the node, and the ResourceSlice publisher.

pub mod grpc;
pub mod publish;
pub mod service;
pub mod worker;
