//! The kubelet-facing gRPC side: plugin registration and the `DRAPlugin` service.
//!
//! Two sockets, both ours for the life of the process:
//! - `<registry-dir>/<driver>-reg.sock` serves `pluginregistration.Registration`.
//!   kubelet's plugin watcher finds it (on start, and whenever it appears), calls
//!   `GetInfo` and answers with `NotifyRegistrationStatus`;
//! - `<plugins-dir>/<driver>/dra.sock` serves `DRAPlugin` in both versions kubelet
//!   speaks (`k8s.io.kubelet.pkg.apis.dra.v1` and `.v1beta1`), mapped onto one
//!   [`Driver`].
//!
//! A kubelet restart needs nothing from us: its watcher rediscovers the sockets in
//! the registry directory. What does need us is a socket file that disappears (an
//! operator or a cleanup empties the directory): inotify on both directories tells
//! us at once, a slow resync catches what inotify cannot see, and a missing socket
//! is bound again, which makes kubelet register the driver anew.
//!
//! ```no_run
//! # use sandbox_dra_driver::grpc::{serve, Driver, GrpcConfig};
//! # async fn example(driver: std::sync::Arc<dyn Driver>) -> anyhow::Result<()> {
//! let cfg = GrpcConfig::new("vfio-sandbox.rebellions.ai", "/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins");
//! serve(cfg, driver, async { let _ = tokio::signal::ctrl_c().await; }).await
//! # }
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::claims::{ClaimRef, PreparedDevice};
use kubelet_api::dra::{v1, v1beta1};
use kubelet_api::pluginregistration::registration_server::{Registration, RegistrationServer};
use kubelet_api::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use kubelet_api::serve::{SocketFile, SocketState};
use node_agent::watch::{DirEvents, WatchMask};
use tokio::net::UnixListener;
use tokio::sync::oneshot;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

/// What the gRPC side asks of the driver. Both calls are idempotent (kubelet
/// retries) and answer for every claim they are given.
#[tonic::async_trait]
pub trait Driver: Send + Sync + 'static {
    /// Prepares each claim; one entry per claim uid: the devices, or an error message.
    async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> BTreeMap<String, Result<Vec<PreparedDevice>, String>>;
    /// Unprepares each claim; one entry per claim uid.
    async fn unprepare(&self, claims: Vec<ClaimRef>) -> BTreeMap<String, Result<(), String>>;
    /// kubelet's verdict on a registration (`NotifyRegistrationStatus`). kubelet's
    /// wipe of the driver's ResourceSlices (at its start, and 30 s after the
    /// driver's last registration went away) can land just before or after a
    /// registration, so a driver republishes them on `true`.
    fn registration_status(&self, _registered: bool) {}
    /// The device health board whose reports `DRAResourceHealth` streams to
    /// kubelet; `None` serves no health service and advertises none.
    fn health(&self) -> Option<Arc<crate::health::HealthBoard>> {
        None
    }
}

/// Where to serve, and under which driver name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcConfig {
    /// The DRA driver name (`PluginInfo.name`, and part of both socket paths).
    pub driver_name: String,
    /// kubelet's plugin registry directory (`/var/lib/kubelet/plugins_registry`).
    pub registry_dir: PathBuf,
    /// kubelet's plugins directory (`/var/lib/kubelet/plugins`).
    pub plugins_dir: PathBuf,
}

impl GrpcConfig {
    /// A configuration for `driver_name` with the given directories.
    pub fn new(
        driver_name: impl Into<String>,
        registry_dir: impl Into<PathBuf>,
        plugins_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            driver_name: driver_name.into(),
            registry_dir: registry_dir.into(),
            plugins_dir: plugins_dir.into(),
        }
    }

    /// `<registry-dir>/<driver>-reg.sock`.
    pub fn registration_socket(&self) -> PathBuf {
        self.registry_dir.join(format!(
            "{}{}",
            self.driver_name,
            kubelet_api::DRA_REGISTRATION_SUFFIX
        ))
    }

    /// `<plugins-dir>/<driver>/dra.sock`, the endpoint kubelet calls.
    pub fn service_socket(&self) -> PathBuf {
        self.plugins_dir
            .join(&self.driver_name)
            .join(kubelet_api::DRA_SERVICE_SOCKET)
    }

    /// Both sockets kubelet dials.
    pub fn sockets(&self) -> Vec<PathBuf> {
        vec![self.registration_socket(), self.service_socket()]
    }

    /// What `GetInfo` answers: type `DRAPlugin`, the driver name, the service
    /// socket, and both versions, v1 first (kubelet picks the first it knows);
    /// with `health`, both versions of `DRAResourceHealth` after them (kubelet 1.34
    /// skips names it does not know, 1.32 looks for `v1beta1.DRAPlugin` alone, and
    /// newer kubelets open the health stream only when it is listed).
    pub fn plugin_info(&self, health: bool) -> PluginInfo {
        let mut supported_versions = vec![
            kubelet_api::DRA_V1_SERVICE.to_owned(),
            kubelet_api::DRA_V1BETA1_SERVICE.to_owned(),
        ];
        if health {
            supported_versions.push(kubelet_api::DRA_HEALTH_V1_SERVICE.to_owned());
            supported_versions.push(kubelet_api::DRA_HEALTH_V1ALPHA1_SERVICE.to_owned());
        }
        PluginInfo {
            r#type: kubelet_api::DRA_PLUGIN_TYPE.into(),
            name: self.driver_name.clone(),
            endpoint: self.service_socket().to_string_lossy().into_owned(),
            supported_versions,
        }
    }

    /// The driver name must be one path component (it names a socket and a directory).
    fn check(&self) -> anyhow::Result<()> {
        let n = &self.driver_name;
        anyhow::ensure!(
            !n.is_empty() && n != "." && n != ".." && !n.contains(['/', '\0']),
            "driver name {n:?} cannot name a socket: it must be one path component"
        );
        Ok(())
    }
}

/// Events that arrive together are handled as one check.
const SETTLE: Duration = Duration::from_millis(20);
/// Resync for what inotify cannot see, and the polling period without inotify.
const RESYNC: (Duration, Duration) = (Duration::from_secs(5), Duration::from_millis(500));

/// Serves registration and both DRA versions until `shutdown` completes, then
/// removes our sockets (registration first, so kubelet stops using the driver
/// before its endpoint goes).
///
/// Errors when a socket cannot be bound at start (a directory that cannot be made,
/// a file that is not a socket at a socket path); later failures to bind again are
/// logged and retried.
pub async fn serve(
    cfg: GrpcConfig,
    driver: Arc<dyn Driver>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    cfg.check()?;
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
        let resync = if events.is_some() { RESYNC.0 } else { RESYNC.1 };
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
    Dra(Arc<dyn Driver>),
    /// Registration, answering with this configuration's PluginInfo and telling
    /// the driver kubelet's verdict.
    Registration(GrpcConfig, Arc<dyn Driver>),
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
    fn bind(&mut self) -> anyhow::Result<()> {
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
                    tracing::warn!(socket = %self.path.display(), "our {} socket was replaced by another file; leaving it", self.what());
                    self.warned = true;
                }
                false
            }
            Ok(SocketState::Gone) => {
                tracing::warn!(socket = %self.path.display(), "our {} socket was deleted; serving it again", self.what());
                match self.bind() {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::error!(socket = %self.path.display(), error = %format!("{e:#}"), "cannot serve {} again; retrying", self.what());
                        false
                    }
                }
            }
            Err(e) => {
                tracing::warn!(socket = %self.path.display(), error = %e, "cannot check our {} socket", self.what());
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
                tracing::warn!(socket = %self.path.display(), error = %e, "cannot remove our socket");
            }
        }
        tracing::info!(socket = %self.path.display(), "stopped serving {}", self.what());
    }
}

fn spawn_dra(listener: UnixListener, driver: Arc<dyn Driver>) -> oneshot::Sender<()> {
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
    driver: Arc<dyn Driver>,
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
    driver: Arc<dyn Driver>,
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
            tracing::error!(driver = %self.info.name, error = %status.error, "kubelet refused the registration");
        }
        self.driver.registration_status(status.plugin_registered);
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// The claims of one request, checked: each uid once for the driver, and the
/// answers already settled without it.
#[derive(Debug, Default, PartialEq, Eq)]
struct Batch {
    claims: Vec<ClaimRef>,
    refused: BTreeMap<String, String>,
}

/// Sorts a request's claims: an empty uid is refused, a uid repeated with the same
/// namespace and name counts once, a uid repeated with another namespace or name
/// is refused (which of them would the answer be for?).
fn batch(claims: impl IntoIterator<Item = ClaimRef>) -> Batch {
    let mut seen: HashMap<String, ClaimRef> = HashMap::new();
    let mut order = Vec::new();
    let mut refused = BTreeMap::new();
    for c in claims {
        if c.uid.is_empty() {
            refused.insert(
                String::new(),
                format!("claim {}/{} has no uid", c.namespace, c.name),
            );
            continue;
        }
        match seen.get(&c.uid) {
            None => {
                order.push(c.uid.clone());
                seen.insert(c.uid.clone(), c);
            }
            Some(first) if *first == c => {}
            Some(first) => {
                refused.insert(
                    c.uid.clone(),
                    format!(
                        "claim uid {} is named twice in one request, as {}/{} and {}/{}",
                        c.uid, first.namespace, first.name, c.namespace, c.name
                    ),
                );
            }
        }
    }
    let claims = order
        .into_iter()
        .filter(|uid| !refused.contains_key(uid))
        .filter_map(|uid| seen.remove(&uid))
        .collect();
    Batch { claims, refused }
}

type Answers<T> = BTreeMap<String, Result<T, String>>;

/// Runs the driver on a batch and completes its answers: one per requested uid,
/// none for a uid kubelet did not ask about (kubelet fails the whole call on
/// either). The driver runs in its own task, so a call kubelet gives up on does
/// not cut a prepare or unprepare off halfway.
async fn answer<T, F>(batch: Batch, call: impl FnOnce(Vec<ClaimRef>) -> F) -> Answers<T>
where
    T: Send + 'static,
    F: Future<Output = Answers<T>> + Send + 'static,
{
    let Batch { claims, refused } = batch;
    let asked: HashSet<String> = claims.iter().map(|c| c.uid.clone()).collect();
    let mut answers = if claims.is_empty() {
        BTreeMap::new()
    } else {
        match tokio::spawn(call(claims)).await {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(error = %e, "the driver failed on a request");
                BTreeMap::new()
            }
        }
    };
    answers.retain(|uid, _| {
        let keep = asked.contains(uid);
        if !keep {
            tracing::warn!(uid = %uid, "the driver answered for a claim not asked about; dropped");
        }
        keep
    });
    for uid in asked {
        answers
            .entry(uid)
            .or_insert_with(|| Err("the driver gave no answer for this claim".into()));
    }
    answers.extend(refused.into_iter().map(|(uid, e)| (uid, Err(e))));
    answers
}

/// `DRAPlugin`, both versions, on one [`Driver`].
#[derive(Clone)]
struct DraService {
    driver: Arc<dyn Driver>,
}

impl DraService {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> Answers<Vec<PreparedDevice>> {
        let n = claims.len();
        let driver = self.driver.clone();
        let answers = answer(
            batch(claims),
            move |c| async move { driver.prepare(c).await },
        )
        .await;
        log_answers("NodePrepareResources", n, &answers);
        answers
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> Answers<()> {
        let n = claims.len();
        let driver = self.driver.clone();
        let answers = answer(
            batch(claims),
            move |c| async move { driver.unprepare(c).await },
        )
        .await;
        log_answers("NodeUnprepareResources", n, &answers);
        answers
    }
}

fn log_answers<T>(call: &str, asked: usize, answers: &Answers<T>) {
    let failed = answers.values().filter(|a| a.is_err()).count();
    tracing::info!(claims = asked, failed, "{call}");
    for (uid, e) in answers
        .iter()
        .filter_map(|(u, a)| a.as_ref().err().map(|e| (u, e)))
    {
        tracing::warn!(uid = %uid, error = %e, "{call}: claim failed");
    }
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
                let answers = self.prepare(claims.collect()).await;
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
                let answers = self.unprepare(claims.collect()).await;
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
            tracing::warn!(dirs = ?dirs, error = %e, "cannot watch; checking our sockets by polling");
            None
        }
    }
}

/// The next event; `None` when the stream ended or a watched directory went away;
/// never without a watch.
async fn next_event(events: &mut Option<DirEvents>) -> Option<node_agent::watch::Event<OsString>> {
    match events {
        Some(events) => events.next().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
