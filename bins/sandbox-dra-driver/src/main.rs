//! `sandbox-dra-driver`: VFIO passthrough per ResourceClaim through Dynamic Resource
//! Allocation.

// Not called from main yet: the command line and the engine come next.
#[allow(dead_code)]
mod grpc;

fn main() {}
