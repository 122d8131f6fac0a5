//! The kubelet-facing sockets: plugin registration and the `DRAPlugin` service.
//!
//! Two sockets, both the plugin's for the life of its serving:
//! - `<registry-dir>/<driver>-reg.sock` serves `pluginregistration.Registration`.
//!   kubelet's plugin watcher finds it (on start, and whenever it appears), calls
//!   `GetInfo` and answers with `NotifyRegistrationStatus`;
//! - `<plugins-dir>/<driver>/dra.sock` serves `DRAPlugin` in both versions kubelet
//!   speaks (`k8s.io.kubelet.pkg.apis.dra.v1` and `.v1beta1`), and
//!   `DRAResourceHealth` when the driver reports health.
//!
//! A kubelet restart needs nothing from us: its watcher rediscovers the sockets in
//! the registry directory. What does need us is a socket file that disappears (an
//! operator or a cleanup empties the directory): inotify on both directories tells
//! us at once, a slow resync catches what inotify cannot see, and a missing socket
//! is bound again, which makes kubelet register the driver anew.

use std::ffi::OsString;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::claim::ClaimRef;
use crate::config::Config;
use crate::driver::PreparedDevice;
use crate::health::HealthReports;
use kubelet_api::dra::{v1, v1beta1};
use kubelet_api::pluginregistration::registration_server::{Registration, RegistrationServer};
use kubelet_api::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use kubelet_api::serve::{DirEvents, WatchMask};
use kubelet_api::serve::{ListenError, SocketFile, SocketState};
use tokio::net::UnixListener;
use tokio::sync::{oneshot, watch};
use tonic::transport::Server;
use tonic::{Request, Response, Status};

/// kubelet's answers, by claim uid: devices, or the error kubelet is told.
pub(crate) type WireAnswers<T> = std::collections::BTreeMap<String, Result<T, String>>;

/// What the sockets serve: kubelet's calls, answered for every claim they name.
#[tonic::async_trait]
pub(crate) trait Calls: Send + Sync + 'static {
    /// `NodePrepareResources`.
    async fn prepare(&self, claims: Vec<ClaimRef>) -> WireAnswers<Vec<PreparedDevice>>;
    /// `NodeUnprepareResources`.
    async fn unprepare(&self, claims: Vec<ClaimRef>) -> WireAnswers<()>;
    /// kubelet's verdict on a registration (`NotifyRegistrationStatus`).
    fn registration_status(&self, registered: bool);
    /// The health reports `DRAResourceHealth` streams; `None` serves none.
    fn health(&self) -> Option<watch::Receiver<HealthReports>>;
}

/// Events that arrive together are handled as one check.
const SETTLE: Duration = Duration::from_millis(20);
/// Resync for what inotify cannot see.
const RESYNC_WITH_EVENTS: Duration = Duration::from_secs(5);
/// The polling period without inotify.
const RESYNC_POLLING: Duration = Duration::from_millis(500);

/// Serves registration and both DRA versions until `shutdown` completes, then
/// removes our sockets (registration first, so kubelet stops using the driver
/// before its endpoint goes).
///
/// Errors when a socket cannot be bound at start (a directory that cannot be made,
/// a file that is not a socket at a socket path); later failures to bind again are
/// logged and retried.
pub(crate) async fn serve(
    cfg: Arc<Config>,
    driver: Arc<dyn Calls>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ListenError> {
    let dirs = [
        cfg.registry_dir.clone(),
        cfg.plugins_dir.join(&cfg.driver_name),
    ];
    // The endpoint first: kubelet may call it as soon as it sees the registration.
    let mut service = Socket::new(cfg.service_socket(), Kind::Dra(driver.clone()));
    let mut registration = Socket::new(cfg.registration_socket(), Kind::Registration(cfg, driver));
    service.bind()?;
    if let Err(e) = registration.bind() {
        service.close();
        return Err(e);
    }
    let mut events = dir_events(&dirs);
    tokio::pin!(shutdown);
    loop {
        let resync = if events.is_some() {
            RESYNC_WITH_EVENTS
        } else {
            RESYNC_POLLING
        };
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(resync) => {}
            ev = next_event(&mut events) => {
                if ev.is_none() {
                    events = None; // a directory went away: watch anew below
                }
                tokio::time::sleep(SETTLE).await;
            }
        }
        let rebound = service.repair() | registration.repair();
        if rebound || events.is_none() {
            events = dir_events(&dirs);
            // A deletion between the check and the new watch is caught here.
            if service.repair() | registration.repair() {
                events = dir_events(&dirs);
            }
        }
    }
    registration.close();
    service.close();
    Ok(())
}

/// What a socket serves.
enum Kind {
    /// Both DRAPlugin versions.
    Dra(Arc<dyn Calls>),
    /// Registration, answering with this configuration's PluginInfo and telling
    /// the plugin kubelet's verdict.
    Registration(Arc<Config>, Arc<dyn Calls>),
}

/// One socket we serve, and the server behind it.
struct Socket {
    path: PathBuf,
    kind: Kind,
    /// The file we bound, to tell ours from a replacement.
    bound: Option<SocketFile>,
    stop: Option<oneshot::Sender<()>>,
    /// Logged that the path is not ours any more (only once).
    warned: bool,
}

impl Socket {
    fn new(path: PathBuf, kind: Kind) -> Self {
        Self {
            path,
            kind,
            bound: None,
            stop: None,
            warned: false,
        }
    }

    fn what(&self) -> &'static str {
        match self.kind {
            Kind::Dra(_) => "DRA service",
            Kind::Registration(..) => "registration",
        }
    }

    /// Binds a fresh socket at the path and serves it; the previous server (if any)
    /// finishes its calls in flight and stops.
    fn bind(&mut self) -> Result<(), ListenError> {
        let (listener, file) = kubelet_api::serve::listen(&self.path)?;
        self.bound = Some(file);
        self.warned = false;
        let stop = match &self.kind {
            Kind::Dra(driver) => spawn_dra(listener, driver.clone()),
            Kind::Registration(cfg, driver) => spawn_registration(
                listener,
                cfg.plugin_info(driver.health().is_some()),
                driver.clone(),
            ),
        };
        if let Some(old) = self.stop.replace(stop) {
            let _ = old.send(());
        }
        tracing::info!(socket = %self.path.display(), "serving {}", self.what());
        Ok(())
    }

    /// Binds again when our socket file is gone. Returns whether it did.
    ///
    /// A socket someone else put at the path (a second instance of the driver) is
    /// left alone: taking it back would start a tug of war.
    fn repair(&mut self) -> bool {
        let now = match &self.bound {
            Some(file) => file.state(),
            None => Ok(SocketState::Gone),
        };
        match now {
            Ok(SocketState::Ours) => false,
            Ok(SocketState::Replaced) => {
                if !self.warned {
                    tracing::warn!(socket = %self.path.display(),
                        "our {} socket was replaced by another file; leaving it", self.what());
                    self.warned = true;
                }
                false
            }
            Ok(SocketState::Gone) => {
                tracing::warn!(socket = %self.path.display(), "our {} socket was \
                    deleted; serving it again", self.what());
                match self.bind() {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::error!(
                            socket = %self.path.display(),
                            error = %support::error_chain(&e),
                            "cannot serve {} again; retrying",
                            self.what()
                        );
                        false
                    }
                }
            }
            Err(e) => {
                tracing::warn!(socket = %self.path.display(), error = %e,
                    "cannot check our {} socket", self.what());
                false
            }
        }
    }

    /// Stops serving and removes the socket file, if it is still ours.
    fn close(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(file) = self.bound.take() {
            if let Err(e) = file.remove_if_ours() {
                tracing::warn!(socket = %self.path.display(), error = %e,
                    "cannot remove our socket");
            }
        }
        tracing::info!(socket = %self.path.display(), "stopped serving {}", self.what());
    }
}

fn spawn_dra(listener: UnixListener, driver: Arc<dyn Calls>) -> oneshot::Sender<()> {
    use kubelet_api::dra_health;
    let health = driver.health().map(crate::health::HealthService);
    let service = DraService { driver };
    let router =
        Server::builder()
            .add_service(v1::dra_plugin_server::DraPluginServer::new(service.clone()))
            .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(service))
            .add_optional_service(
                health
                    .clone()
                    .map(dra_health::v1::dra_resource_health_server::DraResourceHealthServer::new),
            )
            .add_optional_service(health.map(
                dra_health::v1alpha1::dra_resource_health_server::DraResourceHealthServer::new,
            ));
    kubelet_api::serve::spawn(listener, router, "DRA service")
}

fn spawn_registration(
    listener: UnixListener,
    info: PluginInfo,
    driver: Arc<dyn Calls>,
) -> oneshot::Sender<()> {
    let router = Server::builder().add_service(RegistrationServer::new(RegistrationService {
        info,
        driver,
    }));
    kubelet_api::serve::spawn(listener, router, "registration")
}

/// `pluginregistration.Registration`.
struct RegistrationService {
    info: PluginInfo,
    driver: Arc<dyn Calls>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        tracing::debug!("kubelet asked for our plugin info");
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = %self.info.name, "registered with kubelet");
        } else {
            tracing::error!(driver = %self.info.name, error = %status.error,
                "kubelet refused the registration");
        }
        self.driver.registration_status(status.plugin_registered);
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// `DRAPlugin`, both versions, on the plugin's calls.
#[derive(Clone)]
struct DraService {
    driver: Arc<dyn Calls>,
}

/// The same service for each generated version: the messages are field for field
/// identical, only their types differ.
macro_rules! dra_version {
    ($v:ident) => {
        #[tonic::async_trait]
        impl $v::dra_plugin_server::DraPlugin for DraService {
            async fn node_prepare_resources(
                &self,
                request: Request<$v::NodePrepareResourcesRequest>,
            ) -> Result<Response<$v::NodePrepareResourcesResponse>, Status> {
                let claims = request.into_inner().claims.into_iter().map(|c| ClaimRef {
                    uid: c.uid,
                    namespace: c.namespace,
                    name: c.name,
                });
                let answers = self.driver.prepare(claims.collect()).await;
                let claims = answers
                    .into_iter()
                    .map(|(uid, a)| {
                        let r = match a {
                            Ok(devices) => $v::NodePrepareResourceResponse {
                                devices: devices
                                    .into_iter()
                                    .map(|d| $v::Device {
                                        request_names: d.request_names,
                                        pool_name: d.pool_name,
                                        device_name: d.device_name,
                                        cdi_device_ids: d.cdi_device_ids,
                                    })
                                    .collect(),
                                error: String::new(),
                            },
                            Err(error) => $v::NodePrepareResourceResponse {
                                devices: Vec::new(),
                                error: nonempty(error),
                            },
                        };
                        (uid, r)
                    })
                    .collect();
                Ok(Response::new($v::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$v::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$v::NodeUnprepareResourcesResponse>, Status> {
                let claims = request.into_inner().claims.into_iter().map(|c| ClaimRef {
                    uid: c.uid,
                    namespace: c.namespace,
                    name: c.name,
                });
                let answers = self.driver.unprepare(claims.collect()).await;
                let claims = answers
                    .into_iter()
                    .map(|(uid, a)| {
                        let error = a.err().map(nonempty).unwrap_or_default();
                        (uid, $v::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($v::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}

dra_version!(v1);
dra_version!(v1beta1);

/// An error message kubelet will see as an error: an empty one would read as success.
fn nonempty(e: String) -> String {
    if e.is_empty() {
        "failed (no reason given)".into()
    } else {
        e
    }
}

/// Deletions and moves in our socket directories (and of the directories
/// themselves), `None` when a directory cannot be watched.
fn dir_events(dirs: &[PathBuf]) -> Option<DirEvents> {
    match DirEvents::open(dirs, WatchMask::DELETE | WatchMask::MOVED_FROM) {
        Ok(events) => Some(events),
        Err(e) => {
            tracing::warn!(dirs = ?dirs, error = %e, "cannot watch; checking our \
                sockets by polling");
            None
        }
    }
}

/// The next event; `None` when the stream ended or a watched directory went away;
/// never without a watch.
async fn next_event(events: &mut Option<DirEvents>) -> Option<kubelet_api::serve::Event<OsString>> {
    match events {
        Some(events) => events.next().await,
        None => std::future::pending().await,
    }
}
