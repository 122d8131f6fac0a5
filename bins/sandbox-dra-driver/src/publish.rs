//! Keeps this node's ResourceSlice equal to what the resource list selects: on start,
//! on every PCI uevent (a device added or removed), and every resync interval.

use std::os::fd::AsFd;
use std::time::Duration;

use tokio::sync::Mutex;
use vfio_sandbox::cluster::Cluster;
use vfio_sandbox::config::ResourceList;
use vfio_sandbox::inventory::Inventory;
use vfio_sandbox::{dra, error_chain, uevent, Host};

/// Waits after a failed API write before trying again, doubling up to the resync.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);

/// Publishes the slice.
#[derive(Clone)]
pub struct Publisher {
    slices: std::sync::Arc<Mutex<dra::Slices>>,
    host: Host,
    list: ResourceList,
    resync: Duration,
}

impl Publisher {
    /// A publisher for `driver` on `node`.
    pub fn new(
        cluster: Cluster,
        driver: String,
        node: String,
        host: Host,
        list: ResourceList,
        resync: Duration,
    ) -> Self {
        Self {
            slices: std::sync::Arc::new(Mutex::new(dra::Slices::new(
                cluster.kube_client(),
                &driver,
                &node,
            ))),
            host,
            list,
            resync,
        }
    }

    /// Reconciles now and after every change, until aborted.
    pub async fn run(self) {
        let events = match uevent::async_socket() {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch PCI uevents; rescanning every resync interval only");
                None
            }
        };
        let mut backoff = FIRST_BACKOFF;
        loop {
            let wait = match self.reconcile().await {
                Ok(()) => {
                    backoff = FIRST_BACKOFF;
                    self.resync
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?backoff, "cannot publish this node's ResourceSlice");
                    let wait = backoff;
                    backoff = (backoff * 2).min(self.resync);
                    wait
                }
            };
            match &events {
                Some(fd) => {
                    let changed = tokio::time::timeout(wait, async {
                        loop {
                            let Ok(mut ready) = fd.readable().await else {
                                std::future::pending::<()>().await;
                                return;
                            };
                            let pci = uevent::drain(fd.get_ref().as_fd());
                            ready.clear_ready();
                            if pci {
                                return;
                            }
                        }
                    });
                    let _ = changed.await;
                }
                None => tokio::time::sleep(wait).await,
            }
        }
    }

    async fn reconcile(&self) -> Result<(), String> {
        let host = self.host.clone();
        let list = self.list.clone();
        let inv = tokio::task::spawn_blocking(move || Inventory::scan(&host, &list))
            .await
            .map_err(|e| format!("the scan stopped: {e}"))?
            .map_err(|e| format!("cannot scan the node's PCI devices: {}", error_chain(&e)))?;
        let devices = dra::slice_devices(&inv);
        self.slices
            .lock()
            .await
            .reconcile(&devices)
            .await
            .map(|report| tracing::debug!(?report, "ResourceSlice reconciled"))
            .map_err(|e| error_chain(&e))
    }

    /// Deletes this node's slices (an uninstall).
    pub async fn delete_all(&self) -> Result<(), String> {
        self.slices
            .lock()
            .await
            .delete_all()
            .await
            .map(|_| ())
            .map_err(|e| error_chain(&e))
    }
}
