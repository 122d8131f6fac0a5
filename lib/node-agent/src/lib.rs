//! What every vfio-sandbox daemon shares above the passthrough engine: the
//! command-line conventions ([`cli`]), the validator's ready file ([`ready`]), the
//! metrics endpoint ([`metrics`], feature `metrics`), the kube-rs view of the
//! cluster ([`cluster`], feature `kube`) with Kubernetes' DaemonSet rules it
//! judges by ([`daemonset`]), and the one node watcher ([`watch`], feature
//! `watch`).

pub mod cli;
#[cfg(feature = "kube")]
pub mod cluster;
#[cfg(feature = "kube")]
pub mod daemonset;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod ready;
#[cfg(feature = "watch")]
pub mod watch;
