//! The parts of `real-k8s` other programs start a cluster with: the one-node
//! control plane of one release on loopback ([`control`]), its keys and
//! kubeconfigs ([`pki`]) and its processes ([`proc`]). The claim watch benchmark
//! (`claim-watch-bench`) runs the same kube-apiserver the scenarios run.

pub mod containerd;
pub mod control;
pub mod guest;
pub mod image;
pub mod kubelet;
pub mod pki;
pub mod proc;
