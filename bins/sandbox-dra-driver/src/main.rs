//! `sandbox-dra-driver`: VFIO passthrough per ResourceClaim through Dynamic Resource
//! Allocation.

fn main() {}
