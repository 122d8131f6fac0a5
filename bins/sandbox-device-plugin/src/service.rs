//! The `DevicePlugin` gRPC service for one resource.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kubelet_api::v1beta1::device_plugin_server::DevicePlugin;
use kubelet_api::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, Device,
    DevicePluginOptions, Empty, ListAndWatchResponse, NumaNode, PreStartContainerRequest,
    PreStartContainerResponse, PreferredAllocationRequest, PreferredAllocationResponse,
    TopologyInfo,
};
use kubelet_api::{HEALTHY, UNHEALTHY};
use passthrough::config::ResourceName;
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::allocate::{allocate, preferred};
use crate::devices::{DeviceState, Snapshot};
use crate::metrics::ResourceMetrics;

/// The options we register with: preferred allocation is implemented, no pre-start.
pub fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// Counts one socket's ListAndWatch streams and reports the end of each, so the
/// registrar can tell when kubelet no longer watches.
#[derive(Debug)]
pub struct Streams {
    /// Streams open now.
    pub active: AtomicUsize,
    ended: mpsc::UnboundedSender<()>,
}

impl Streams {
    /// A tracker that reports each ended stream on `ended`.
    pub fn new(ended: mpsc::UnboundedSender<()>) -> Self {
        Self {
            active: AtomicUsize::new(0),
            ended,
        }
    }
}

/// One resource's service.
pub struct PluginService {
    /// The resource served.
    pub resource: ResourceName,
    /// The node's devices, updated by the watcher.
    pub snapshot: watch::Receiver<Arc<Snapshot>>,
    /// Add iommufd nodes to Allocate answers.
    pub iommufd: bool,
    /// Stream bookkeeping shared with the registrar.
    pub streams: Arc<Streams>,
    /// This resource's metrics.
    pub metrics: ResourceMetrics,
}

impl PluginService {
    /// The current snapshot (an `Arc`: no copy of the device list).
    fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.borrow().clone()
    }

    /// Allocate's answer, every container or an error naming the refused IDs.
    fn answer_allocate(&self, request: AllocateRequest) -> Result<AllocateResponse, Status> {
        let snapshot = self.snapshot();
        let devices = devices_of(&snapshot, &self.resource);
        let mut container_responses = Vec::new();
        for c in &request.container_requests {
            let r =
                allocate(&self.resource, devices, &c.devices_ids, self.iommufd).map_err(|e| {
                    tracing::warn!(resource = %self.resource, error = %e, "Allocate refused");
                    Status::invalid_argument(format!("{}: {e}", self.resource))
                })?;
            container_responses.push(r);
        }
        Ok(AllocateResponse {
            container_responses,
        })
    }
}

fn devices_of<'a>(snapshot: &'a Snapshot, resource: &ResourceName) -> &'a [DeviceState] {
    snapshot
        .get(resource)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

/// The ListAndWatch message for a resource's devices.
pub fn to_message(devices: &[DeviceState]) -> ListAndWatchResponse {
    ListAndWatchResponse {
        devices: devices
            .iter()
            .map(|d| Device {
                id: d.id(),
                health: if d.healthy() { HEALTHY } else { UNHEALTHY }.into(),
                // -1 (no NUMA affinity) means no topology at all, never an empty one.
                topology: d.numa_node.map(|n| TopologyInfo {
                    nodes: vec![NumaNode { id: i64::from(n) }],
                }),
            })
            .collect(),
    }
}

/// True when both lists give the same ListAndWatch message: the same IDs in the
/// same order, each with the same health and NUMA node.
fn same_message(a: &[DeviceState], b: &[DeviceState]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.address == y.address && x.healthy() == y.healthy() && x.numa_node == y.numa_node
        })
}

type ListStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for PluginService {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = ListStream;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let mut snapshot = self.snapshot.clone();
        let resource = self.resource.clone();
        let streams = self.streams.clone();
        let updates = self.metrics.updates.clone();
        streams.active.fetch_add(1, Ordering::SeqCst);
        tracing::info!(resource = %resource, "kubelet opened ListAndWatch");
        tokio::spawn(async move {
            let mut last: Option<Arc<Snapshot>> = None;
            loop {
                let snap = snapshot.borrow_and_update().clone();
                let devices = devices_of(&snap, &resource);
                // Each change is one full message: kubelet replaces its whole list
                // with each one (pkg/kubelet/cm/devicemanager/endpoint.go, run()).
                // A list that reads the same sends nothing; compared on what the
                // message carries, so no message is built to find out.
                if last
                    .as_ref()
                    .is_none_or(|l| !same_message(devices_of(l, &resource), devices))
                {
                    if tx.send(Ok(to_message(devices))).await.is_err() {
                        break;
                    }
                    updates.inc();
                    last = Some(snap);
                }
                tokio::select! {
                    changed = snapshot.changed() => if changed.is_err() { break },
                    _ = tx.closed() => break,
                }
            }
            streams.active.fetch_sub(1, Ordering::SeqCst);
            tracing::info!(resource = %resource, "ListAndWatch stream ended");
            let _ = streams.ended.send(());
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let snapshot = self.snapshot();
        let resource = self.resource.clone();
        let request = request.into_inner();
        // A sort over every available device: off the runtime thread, so that no
        // other call waits behind a large request.
        let answer = tokio::task::spawn_blocking(move || {
            let devices = devices_of(&snapshot, &resource);
            request
                .container_requests
                .iter()
                .map(|c| ContainerPreferredAllocationResponse {
                    device_i_ds: preferred(
                        devices,
                        &c.available_device_i_ds,
                        &c.must_include_device_i_ds,
                        usize::try_from(c.allocation_size).unwrap_or(0),
                    ),
                })
                .collect()
        })
        .await;
        let container_responses = answer.map_err(|e| {
            Status::internal(format!(
                "{}: GetPreferredAllocation failed: {e}",
                self.resource
            ))
        })?;
        Ok(Response::new(PreferredAllocationResponse {
            container_responses,
        }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let start = std::time::Instant::now();
        let answer = self.answer_allocate(request.into_inner());
        self.metrics
            .allocate_seconds
            .observe(start.elapsed().as_secs_f64());
        match &answer {
            Ok(_) => self.metrics.allocated.inc(),
            Err(_) => self.metrics.allocate_failed.inc(),
        };
        answer.map(Response::new)
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(address: &str, numa: Option<u32>, problem: Option<&str>) -> DeviceState {
        DeviceState {
            address: address.parse().unwrap(),
            group: Some(4),
            numa_node: numa,
            bridge: None,
            cdev: None,
            no_cdev_kernel: false,
            problem: problem.map(str::to_owned),
        }
    }

    /// Two lists read the same exactly when the messages built from them are equal.
    #[test]
    fn same_message_agrees_with_the_built_messages() {
        let base = vec![
            device("0000:01:00.0", Some(0), None),
            device("0000:02:00.0", Some(1), Some("device removed")),
        ];
        let mut variants = vec![base.clone()];
        let mut reason = base.clone();
        reason[1].problem = Some("on e1000e instead of vfio-pci".into());
        variants.push(reason);
        let mut group = base.clone();
        group[0].group = Some(9);
        variants.push(group);
        let mut health = base.clone();
        health[0].problem = Some("device removed".into());
        variants.push(health);
        let mut numa = base.clone();
        numa[1].numa_node = None;
        variants.push(numa);
        variants.push(base[..1].to_vec());
        let mut other = base.clone();
        other[1] = device("0000:03:00.0", Some(1), Some("device removed"));
        variants.push(other);
        for a in &variants {
            for b in &variants {
                assert_eq!(
                    same_message(a, b),
                    to_message(a) == to_message(b),
                    "{a:?} vs {b:?}"
                );
            }
        }
    }
}
