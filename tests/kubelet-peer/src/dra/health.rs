//! The DRA device health stream as kubelet reads it (KEP-4680, gate
//! `ResourceHealthStatus`).
//!
//! As kubelet does:
//! - which service: the newest kubelets open the stream only for a plugin that
//!   lists a health service in `PluginInfo.supported_versions`, preferring
//!   `v1.DRAResourceHealth` over `v1alpha1.DRAResourceHealth` (`pickHealthService`,
//!   `pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`) — [`pick_service`];
//! - where: `NodeWatchResources` on the same connection as the DRAPlugin service
//!   (`dra_plugin_manager.go`, `add`: one `grpc.ClientConn` per plugin), so with
//!   the same `:authority` ([`crate::dra::KubeletVersion::dra_authority`]), with no
//!   deadline;
//! - what it keeps: each response merged device by device under `pool/device`,
//!   stamped with kubelet's own clock; `HEALTHY`/`UNHEALTHY` as `Healthy`/
//!   `Unhealthy`, anything else `Unknown`; the timeout is
//!   `health_check_timeout_seconds` when above 0, else 30 s
//!   (`DefaultHealthTimeout`); a device not reported within its timeout turns
//!   `Unknown` with its message cleared (`healthinfo.go`, `updateHealthInfo`) —
//!   [`HealthCache`];
//! - a message is cut to 1024 characters (1021 and `...`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use kubelet_api::dra_health::{v1, v1alpha1};
use tokio_stream::StreamExt;

use super::KubeletVersion;

/// kubelet's timeout for a device report without its own (`DefaultHealthTimeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// A health service version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthVersion {
    /// `v1.DRAResourceHealth`.
    V1,
    /// `v1alpha1.DRAResourceHealth`.
    V1alpha1,
}

/// The health service the newest kubelet picks from a plugin's list: v1, else
/// v1alpha1, else none (no stream is opened).
pub fn pick_service(supported: &[String]) -> Option<HealthVersion> {
    let has = |s: &str| supported.iter().any(|x| x == s);
    if has(kubelet_api::DRA_HEALTH_V1_SERVICE) {
        Some(HealthVersion::V1)
    } else if has(kubelet_api::DRA_HEALTH_V1ALPHA1_SERVICE) {
        Some(HealthVersion::V1alpha1)
    } else {
        None
    }
}

/// One device as kubelet's health cache keeps it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceHealth {
    /// `Healthy`, `Unhealthy` or `Unknown`.
    pub health: String,
    /// The driver's message (cut as kubelet cuts it).
    pub message: String,
    /// The timeout kubelet applies to it, in seconds.
    pub timeout_seconds: u64,
    /// The driver's `last_updated_time` (kubelet itself stamps its own clock).
    pub driver_time: i64,
    #[serde(skip)]
    seen: Option<Instant>,
}

/// kubelet's health cache of one driver: devices by `pool/device`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[allow(missing_docs)]
pub struct HealthCache {
    pub devices: BTreeMap<String, DeviceHealth>,
}

/// One response as the wire carries it, whichever version.
#[derive(Debug, Clone)]
pub struct WireDevice {
    /// Pool name.
    pub pool: String,
    /// Device name.
    pub device: String,
    /// The enum value.
    pub health: i32,
    /// `last_updated_time`.
    pub last_updated_time: i64,
    /// `health_check_timeout_seconds`.
    pub timeout_seconds: i64,
    /// `message`.
    pub message: String,
}

impl HealthCache {
    /// Merges one response at `now`; the keys whose health, message or timeout
    /// changed (kubelet then updates the pods using them).
    pub fn update(&mut self, devices: &[WireDevice], now: Instant) -> Vec<String> {
        let mut changed = Vec::new();
        for d in devices {
            let key = format!("{}/{}", d.pool, d.device);
            let health = match d.health {
                1 => "Healthy",
                2 => "Unhealthy",
                _ => "Unknown",
            };
            let timeout = if d.timeout_seconds > 0 {
                u64::try_from(d.timeout_seconds).unwrap_or(u64::MAX)
            } else {
                DEFAULT_TIMEOUT.as_secs()
            };
            let entry = DeviceHealth {
                health: health.into(),
                message: cut(&d.message),
                timeout_seconds: timeout,
                driver_time: d.last_updated_time,
                seen: Some(now),
            };
            let differs = self.devices.get(&key).is_none_or(|old| {
                old.health != entry.health
                    || old.message != entry.message
                    || old.timeout_seconds != entry.timeout_seconds
            });
            if differs {
                changed.push(key.clone());
            }
            self.devices.insert(key, entry);
        }
        // Devices not reported within their timeout turn Unknown.
        for (key, d) in &mut self.devices {
            let stale = d
                .seen
                .is_some_and(|s| now.duration_since(s) > Duration::from_secs(d.timeout_seconds));
            if stale && d.health != "Unknown" {
                d.health = "Unknown".into();
                d.message.clear();
                changed.push(key.clone());
            }
        }
        changed
    }

    /// The health of `key` now, or `None`.
    pub fn health(&self, key: &str) -> Option<&str> {
        self.devices.get(key).map(|d| d.health.as_str())
    }
}

/// kubelet's message cut: at most 1024 characters, else 1021 and `...`.
fn cut(message: &str) -> String {
    if message.chars().count() <= 1024 {
        return message.to_owned();
    }
    let mut s: String = message.chars().take(1021).collect();
    s.push_str("...");
    s
}

/// An open `NodeWatchResources` stream.
pub enum HealthStream {
    /// v1.
    V1(tonic::Streaming<v1::NodeWatchResourcesResponse>),
    /// v1alpha1.
    V1alpha1(tonic::Streaming<v1alpha1::NodeWatchResourcesResponse>),
}

impl HealthStream {
    /// Opens the stream on `endpoint` as `kubelet` dials it.
    pub async fn open(
        endpoint: &Path,
        version: HealthVersion,
        kubelet: KubeletVersion,
    ) -> anyhow::Result<Self> {
        let authority = kubelet.dra_authority(endpoint);
        let channel = kubelet_api::unix_channel_with_authority(endpoint, &authority)
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to {}: {e}", endpoint.display()))?;
        Ok(match version {
            HealthVersion::V1 => Self::V1(
                v1::dra_resource_health_client::DraResourceHealthClient::new(channel)
                    .node_watch_resources(v1::NodeWatchResourcesRequest {})
                    .await?
                    .into_inner(),
            ),
            HealthVersion::V1alpha1 => Self::V1alpha1(
                v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(channel)
                    .node_watch_resources(v1alpha1::NodeWatchResourcesRequest {})
                    .await?
                    .into_inner(),
            ),
        })
    }

    /// The next response; `None` when the stream ended.
    pub async fn next(&mut self) -> Option<Result<Vec<WireDevice>, tonic::Status>> {
        macro_rules! wire {
            ($r:expr) => {
                $r.map(|r| {
                    r.devices
                        .into_iter()
                        .map(|d| {
                            let id = d.device.unwrap_or_default();
                            WireDevice {
                                pool: id.pool_name,
                                device: id.device_name,
                                health: d.health,
                                last_updated_time: d.last_updated_time,
                                timeout_seconds: d.health_check_timeout_seconds,
                                message: d.message,
                            }
                        })
                        .collect()
                })
            };
        }
        match self {
            Self::V1(s) => s.next().await.map(|r| wire!(r)),
            Self::V1alpha1(s) => s.next().await.map(|r| wire!(r)),
        }
    }
}
