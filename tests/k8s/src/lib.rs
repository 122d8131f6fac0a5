//! The parts of `real-k8s` other programs start a cluster with: the one-node
//! control plane of one release on loopback ([`control`]), its keys and
//! kubeconfigs ([`pki`]), its processes ([`proc`]), the node with kubelet and
//! containerd ([`node`]), and our drivers on it over a fake PCI core
//! ([`drivers`], [`pcicore`]). The claim watch benchmark
//! (`claim-watch-bench`) runs the same kube-apiserver the scenarios run.

pub mod api;
pub mod containerd;
pub mod control;
pub mod drivers;
pub mod guest;
pub mod image;
pub mod kubelet;
pub mod node;
pub mod pcicore;
pub mod pki;
pub mod proc;
