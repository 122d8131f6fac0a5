//! The DRA driver's view of the cluster (kube-rs): ResourceSlices and ResourceClaims.
