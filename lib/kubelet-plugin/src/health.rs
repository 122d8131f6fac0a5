//! Device health for kubelet (KEP-4680, the DRA part): the `DRAResourceHealth`
//! stream kubelet reads from the driver's endpoint socket.
//!
//! (kubernetes `pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`, `manager.go`,
//! `healthinfo.go`; proto `staging/src/k8s.io/kubelet/pkg/apis/dra-health/{v1alpha1,v1}`.)
//! With the `ResourceHealthStatus` gate on, kubelet opens `NodeWatchResources` on
//! the connection it already has to the endpoint, right after the driver
//! registers, and keeps it open (no deadline). Newer kubelets only do so when the
//! driver lists `v1.DRAResourceHealth` or `v1alpha1.DRAResourceHealth` in its
//! supported versions (v1 preferred); 1.36 re-dials every 5 s whatever the outcome.
//! Each response is merged device by device (`pool/device`): kubelet stamps it with
//! its own clock, and a device no later response mentions turns `Unknown` after its
//! `health_check_timeout_seconds` (default 30 s). When the stream ends, every device
//! of the driver reads `Unknown`. Kubelet shows the result in
//! `pod.status.containerStatuses[].allocatedResourcesStatus[].resources[]`.
//!
//! The plugin sends the driver's whole list at once when a stream opens, again on
//! every change of it, and at least every [`RESEND`] (well inside [`TIMEOUT`]).

use std::pin::Pin;
use std::time::Duration;

use kubelet_api::dra_health::{v1, v1alpha1};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// How long kubelet keeps one of our reports (`health_check_timeout_seconds`).
const TIMEOUT: Duration = Duration::from_secs(60);
/// The whole list is sent again at least this often, so no report times out.
const RESEND: Duration = Duration::from_secs(20);
/// The longest message kubelet keeps whole.
const HEALTH_MESSAGE_MAX: usize = 1024;

/// A device's health, as the proto's `HealthStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Health {
    /// Usable.
    Healthy,
    /// Not usable; the message says why.
    Unhealthy,
    /// Not known.
    Unknown,
}

/// Device health as the driver reports it, every device at once.
pub type HealthReports = std::sync::Arc<Vec<DeviceHealth>>;

/// One device's health.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[allow(missing_docs)]
pub struct DeviceHealth {
    pub pool: String,
    /// Its name in the pool.
    pub device: String,
    /// Healthy or not.
    pub health: Health,
    /// Why not, or what it is, for people; kubelet keeps 1024 characters, and the
    /// plugin cuts a longer one to 1021 and `...`, as kubelet would.
    pub message: String,
    /// Unix seconds of the last change of `health` or `message`.
    pub since: i64,
}

/// At most [`HEALTH_MESSAGE_MAX`] characters: 1021 and `...`, as kubelet cuts them.
pub(crate) fn truncate(message: String) -> String {
    if message.chars().count() <= HEALTH_MESSAGE_MAX {
        return message;
    }
    let mut cut: String = message.chars().take(HEALTH_MESSAGE_MAX - 3).collect();
    cut.push_str("...");
    cut
}

/// The v1 response for `reports`.
pub(crate) fn v1_response(reports: &[DeviceHealth]) -> v1::NodeWatchResourcesResponse {
    v1::NodeWatchResourcesResponse {
        devices: reports
            .iter()
            .map(|r| v1::DeviceHealth {
                device: Some(v1::DeviceIdentifier {
                    pool_name: r.pool.clone(),
                    device_name: r.device.clone(),
                }),
                health: match r.health {
                    Health::Healthy => v1::HealthStatus::Healthy,
                    Health::Unhealthy => v1::HealthStatus::Unhealthy,
                    Health::Unknown => v1::HealthStatus::Unknown,
                } as i32,
                last_updated_time: r.since,
                health_check_timeout_seconds: i64::try_from(TIMEOUT.as_secs()).unwrap_or(60),
                message: truncate(r.message.clone()),
            })
            .collect(),
    }
}

/// The same response in v1alpha1 (field for field the same message).
fn v1alpha1_response(r: v1::NodeWatchResourcesResponse) -> v1alpha1::NodeWatchResourcesResponse {
    v1alpha1::NodeWatchResourcesResponse {
        devices: r
            .devices
            .into_iter()
            .map(|d| v1alpha1::DeviceHealth {
                device: d.device.map(|i| v1alpha1::DeviceIdentifier {
                    pool_name: i.pool_name,
                    device_name: i.device_name,
                }),
                health: d.health,
                last_updated_time: d.last_updated_time,
                health_check_timeout_seconds: d.health_check_timeout_seconds,
                message: d.message,
            })
            .collect(),
    }
}

/// A stream of responses: the whole list now, after every change, and at least
/// every [`RESEND`]; it ends when kubelet goes away.
fn watch_stream<T: Send + 'static>(
    mut rx: watch::Receiver<HealthReports>,
    convert: fn(v1::NodeWatchResourcesResponse) -> T,
) -> ReceiverStream<Result<T, Status>> {
    let (tx, out) = mpsc::channel(4);
    tokio::spawn(async move {
        loop {
            let reports = rx.borrow_and_update().clone();
            if tx.send(Ok(convert(v1_response(&reports)))).await.is_err() {
                return;
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                () = tokio::time::sleep(RESEND) => {}
                () = tx.closed() => return,
            }
        }
    });
    ReceiverStream::new(out)
}

/// `DRAResourceHealth` in both versions, on the DRA endpoint.
#[derive(Clone)]
pub(crate) struct HealthService(pub watch::Receiver<HealthReports>);

type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl v1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = Boxed<v1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _: Request<v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        tracing::debug!("kubelet watches device health (v1)");
        Ok(Response::new(Box::pin(watch_stream(self.0.clone(), |r| r))))
    }
}

#[tonic::async_trait]
impl v1alpha1::dra_resource_health_server::DraResourceHealth for HealthService {
    type NodeWatchResourcesStream = Boxed<v1alpha1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _: Request<v1alpha1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        tracing::debug!("kubelet watches device health (v1alpha1)");
        Ok(Response::new(Box::pin(watch_stream(
            self.0.clone(),
            v1alpha1_response,
        ))))
    }
}
