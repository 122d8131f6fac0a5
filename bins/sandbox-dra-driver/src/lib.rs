//! The pieces of `sandbox-dra-driver`, a library so its tests drive them directly:
//! the kubelet-facing gRPC servers, the service behind them, the thread that changes
//! the node, the ResourceSlice publisher, and the wait for the node's owner lock.

pub mod grpc;
pub mod owner;
pub mod publish;
pub mod service;
pub mod worker;
