//! A kubelet-like peer for device-plugin tests.
//!
//! Registration, the DRA manager and the device manager of the real kubelet are
//! proven in `tests/k8s` (real-k8s, kubelet 1.34 and 1.37). This peer is kept
//! for what a real kubelet cannot do for a test: restart at a chosen instant or
//! hang in `Register`, break a stream, dial a DRA driver wrongly on purpose (a
//! bare path as `:authority`, as grpc-go does for kubelet 1.32), read health
//! streams for benchmarks, and play kubelet inside the real-kernel test VM and
//! for the grpc-core interop checks, where no kubelet runs.
//!
//! It plays kubelet's side of the device-plugin protocol over real Unix sockets, as
//! kubelet 1.25+ does:
//! - on start it deletes every file of the device-plugins directory except
//!   directories and its checkpoint (stale plugin sockets and an old `kubelet.sock`),
//!   then serves `Registration` on a new `<dir>/kubelet.sock`;
//! - during each `Register` it dials the plugin's socket back, retrying for up to
//!   10 s while the socket is missing (grpc-go's blocking dial), asks for the
//!   plugin's options, and refuses the registration when that fails;
//! - optionally ([`Kubelet::start_watching`]) it opens `ListAndWatch` right after
//!   accepting a registration and keeps the stream until it stops. Then, as
//!   kubelet, it holds an endpoint per socket path until that stream ends
//!   (`plugin/v1beta1/handler.go`, `runClient` → `PluginDisconnected`) and refuses
//!   a `Register` naming a path it holds ("device plugin already connected:
//!   <path>", `pkg/kubelet/cm/devicemanager/manager.go`, `PluginConnected`), still
//!   holding it: the refusal makes kubelet forget its client for the path
//!   (`connectClient`), so that endpoint is never disconnected. Without its own
//!   streams (tests open them) the peer cannot tell when kubelet would let a path
//!   go, and holds none.
//!
//! Every `Register` call is recorded, accepted or not ([`Kubelet::calls`]). Tests
//! use [`Kubelet::plugin`] to call `ListAndWatch`, `Allocate` and
//! `GetPreferredAllocation` as kubelet would.
//!
//! The [`dra`] module plays kubelet's side of DRA plugin registration and of the
//! `DRAPlugin` service, dialing as grpc-go does ([`grpcgo`]: the percent-encoded
//! socket path as `:authority` where kubelet dials a bare path).

pub mod container;
pub mod dra;
pub mod grpcgo;
pub mod vmm;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kubelet_api::v1beta1::device_plugin_client::DevicePluginClient;
use kubelet_api::v1beta1::registration_server::{Registration, RegistrationServer};
use kubelet_api::v1beta1::{Empty, RegisterRequest};
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

/// kubelet's own file in the directory, which its cleanup keeps.
pub const CHECKPOINT: &str = "kubelet_internal_checkpoint";
/// How long kubelet's dial-back keeps trying a plugin socket that is not there.
pub const DIAL_BACK_TIMEOUT: Duration = Duration::from_secs(10);

/// A registration kubelet accepted, with the options it read back from the plugin.
#[derive(Debug, Clone)]
pub struct Registered {
    /// The request as sent.
    pub request: RegisterRequest,
    /// What `GetDevicePluginOptions` answered on the dial-back.
    pub options: kubelet_api::v1beta1::DevicePluginOptions,
    /// When the `Register` call arrived.
    pub at: Instant,
}

impl Registered {
    /// The registration of `resource` among `regs`; panics (a test failure) when
    /// there is none.
    pub fn of<'a>(regs: &'a [Registered], resource: &str) -> &'a Registered {
        match regs.iter().find(|r| r.request.resource_name == resource) {
            Some(r) => r,
            None => panic!("no registration of {resource}"),
        }
    }
}

/// Runs a test scenario on a fresh single-threaded runtime with an overall
/// deadline of `limit`; panics (a test failure) when it is missed.
pub fn scenario<F: std::future::Future<Output = ()>>(limit: Duration, f: F) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => panic!("cannot build a runtime: {e}"),
    };
    rt.block_on(async {
        if tokio::time::timeout(limit, f).await.is_err() {
            panic!("scenario deadline of {limit:?} missed");
        }
    });
}

/// One `Register` call as it arrived, whatever became of it.
#[derive(Debug, Clone)]
pub struct Call {
    /// The request as sent.
    pub request: RegisterRequest,
    /// When it arrived.
    pub at: Instant,
}

struct RegistrationService {
    dir: PathBuf,
    tx: mpsc::UnboundedSender<Registered>,
    calls: Arc<std::sync::Mutex<Vec<Call>>>,
    /// Open ListAndWatch after each accepted registration, as kubelet does.
    watch: Option<Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>>,
    /// Cleared when this kubelet is stopped or killed: a call still in its dial-back
    /// then fails instead of acting for a kubelet that is gone.
    alive: Arc<AtomicBool>,
    /// Never answer Register (a kubelet stuck in the call).
    hang: bool,
    /// Answer an accepted Register only after this long (a loaded node).
    answer_after: Duration,
    /// Socket paths with an endpoint, as kubelet's device manager keeps them.
    held: Arc<std::sync::Mutex<std::collections::HashSet<PathBuf>>>,
}

/// Dials the plugin like kubelet: retries a missing or refusing socket until `timeout`.
async fn dial_back(path: &Path, timeout: Duration) -> anyhow::Result<DevicePluginClient<Channel>> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match connect(path).await {
            Ok(c) => return Ok(c),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Keeps a ListAndWatch stream open and read until the plugin ends it, then lets
/// go of the endpoint's path.
async fn keep_watching(
    mut client: DevicePluginClient<Channel>,
    path: PathBuf,
    held: Arc<std::sync::Mutex<std::collections::HashSet<PathBuf>>>,
) {
    if let Ok(r) = client.list_and_watch(Empty {}).await {
        let mut stream = r.into_inner();
        while let Some(Ok(_)) = stream.next().await {}
    }
    if let Ok(mut held) = held.lock() {
        held.remove(&path);
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let req = request.into_inner();
        let at = Instant::now();
        if let Ok(mut calls) = self.calls.lock() {
            calls.push(Call {
                request: req.clone(),
                at,
            });
        }
        if self.hang {
            std::future::pending::<()>().await;
        }
        if req.version != kubelet_api::VERSION {
            return Err(Status::invalid_argument(format!(
                "unsupported version {:?}",
                req.version
            )));
        }
        if req.endpoint.contains('/') {
            return Err(Status::invalid_argument(format!(
                "endpoint {:?} must be a bare file name",
                req.endpoint
            )));
        }
        // kubelet dials the plugin during Register: a plugin must already be serving.
        let path = self.dir.join(&req.endpoint);
        let mut client = dial_back(&path, DIAL_BACK_TIMEOUT).await.map_err(|e| {
            Status::failed_precondition(format!("cannot dial {}: {e}", path.display()))
        })?;
        let options = client
            .get_device_plugin_options(Empty {})
            .await
            .map_err(|e| {
                Status::failed_precondition(format!(
                    "GetDevicePluginOptions on {}: {e}",
                    path.display()
                ))
            })?
            .into_inner();
        if !self.alive.load(Ordering::SeqCst) {
            return Err(Status::unavailable("kubelet stopped"));
        }
        let fresh = self.watch.is_none()
            || self
                .held
                .lock()
                .map_or(true, |mut h| h.insert(path.clone()));
        if !fresh {
            return Err(Status::unknown(format!(
                "device plugin already connected: {}",
                path.display()
            )));
        }
        if let Some(tasks) = &self.watch {
            let task = tokio::spawn(keep_watching(client, path, self.held.clone()));
            if let Ok(mut t) = tasks.lock() {
                t.push(task);
            }
        }
        let _ = self.tx.send(Registered {
            request: req,
            options,
            at,
        });
        tokio::time::sleep(self.answer_after).await;
        Ok(Response::new(Empty {}))
    }
}

/// A gRPC channel over a Unix socket, sending `:authority` `localhost` as kubelet's
/// device manager does (`pkg/kubelet/cm/devicemanager/plugin/v1beta1/client.go`,
/// `dial`: `grpc.WithAuthority("localhost")`).
pub async fn channel(path: &Path) -> anyhow::Result<Channel> {
    Ok(kubelet_api::unix_channel(path).await?)
}

/// The plugin binary `bin` pointed at a fake node under `root` (`sys/`, `dev/`,
/// `kubelet/`, the owner lock in `run/owner/`), with the variables of the environment that would override it cleared.
pub fn plugin_command(bin: &Path, root: &Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(bin);
    cmd.arg("--sysfs-root")
        .arg(root.join("sys"))
        .arg("--dev-root")
        .arg(root.join("dev"))
        .arg("--kubelet-dir")
        .arg(root.join("kubelet"))
        .arg("--owner-lock")
        .arg(root.join("run/owner/owner.lock"))
        .env_remove("VFIO_SANDBOX_CONFIG")
        .env_remove("VFIO_SANDBOX_RESYNC_INTERVAL");
    cmd
}

/// A DevicePlugin client on the plugin socket at `path`.
pub async fn connect(path: &Path) -> anyhow::Result<DevicePluginClient<Channel>> {
    Ok(DevicePluginClient::new(channel(path).await?))
}

/// The fake kubelet.
pub struct Kubelet {
    dir: PathBuf,
    registrations: Mutex<mpsc::UnboundedReceiver<Registered>>,
    calls: Arc<std::sync::Mutex<Vec<Call>>>,
    watching: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    alive: Arc<AtomicBool>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
    /// When kubelet.sock appeared.
    pub started: Instant,
}

impl Kubelet {
    /// Starts like kubelet (see the module docs), without opening ListAndWatch itself.
    pub async fn start(dir: &Path) -> anyhow::Result<Self> {
        Self::start_inner(dir, false, false, Duration::ZERO).await
    }

    /// Starts like kubelet but answers each Register it accepts only `after` that
    /// (the registration itself counts at once), as a loaded node may.
    pub async fn start_slow(dir: &Path, after: Duration) -> anyhow::Result<Self> {
        Self::start_inner(dir, false, false, after).await
    }

    /// Starts like kubelet and opens ListAndWatch after each accepted registration.
    pub async fn start_watching(dir: &Path) -> anyhow::Result<Self> {
        Self::start_inner(dir, true, false, Duration::ZERO).await
    }

    /// Starts like kubelet but never answers a Register call (it records it).
    pub async fn start_stuck(dir: &Path) -> anyhow::Result<Self> {
        Self::start_inner(dir, false, true, Duration::ZERO).await
    }

    async fn start_inner(
        dir: &Path,
        watch: bool,
        hang: bool,
        answer_after: Duration,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Self::clean_directory(dir)?;
        let socket = dir.join(kubelet_api::KUBELET_SOCKET);
        let listener = tokio::net::UnixListener::bind(&socket)?;
        let started = Instant::now();
        let (tx, rx) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let watching = Arc::new(std::sync::Mutex::new(Vec::new()));
        let alive = Arc::new(AtomicBool::new(true));
        let service = RegistrationService {
            dir: dir.to_owned(),
            tx,
            calls: calls.clone(),
            watch: watch.then(|| watching.clone()),
            alive: alive.clone(),
            hang,
            answer_after,
            held: Arc::default(),
        };
        let server = tokio::spawn(async move {
            let _ = Server::builder()
                .add_service(RegistrationServer::new(service))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await;
        });
        Ok(Self {
            dir: dir.to_owned(),
            registrations: Mutex::new(rx),
            calls,
            watching,
            alive,
            stop: Some(stop),
            server: Some(server),
            started,
        })
    }

    /// What kubelet's device manager does to its directory on start: delete every
    /// file but directories and its checkpoint (so stale plugin sockets and an old
    /// kubelet.sock go). Returns how many it deleted.
    pub fn clean_directory(dir: &Path) -> std::io::Result<usize> {
        let mut n = 0;
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            if e.file_name() == CHECKPOINT || e.file_type()?.is_dir() {
                continue;
            }
            match std::fs::remove_file(e.path()) {
                Ok(()) => n += 1,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => return Err(err),
            }
        }
        Ok(n)
    }

    /// Every `Register` call received so far, accepted or not.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// The device-plugins directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The next accepted registration, or an error after `timeout`.
    pub async fn next_registration(&self, timeout: Duration) -> anyhow::Result<Registered> {
        let mut rx = self.registrations.lock().await;
        match tokio::time::timeout(timeout, rx.recv()).await {
            Ok(Some(r)) => Ok(r),
            Ok(None) => anyhow::bail!("registration server stopped"),
            Err(_) => anyhow::bail!("no Register within {timeout:?}"),
        }
    }

    /// Registrations until one per name in `resources` arrived (later ones win).
    pub async fn registrations_for(
        &self,
        resources: &[&str],
        timeout: Duration,
    ) -> anyhow::Result<Vec<Registered>> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut got: Vec<Registered> = Vec::new();
        while !resources
            .iter()
            .all(|r| got.iter().any(|g| g.request.resource_name == *r))
        {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let r = self.next_registration(left).await?;
            got.retain(|g| g.request.resource_name != r.request.resource_name);
            got.push(r);
        }
        got.sort_by(|a, b| a.request.resource_name.cmp(&b.request.resource_name));
        Ok(got)
    }

    /// A client for a registered plugin.
    pub async fn plugin(
        &self,
        registered: &Registered,
    ) -> anyhow::Result<DevicePluginClient<Channel>> {
        connect(&self.dir.join(&registered.request.endpoint)).await
    }

    /// Stops serving and removes kubelet.sock, as a kubelet shutting down cleanly does.
    pub async fn stop(self) {
        let dir = self.dir.clone();
        self.kill().await;
        let _ = std::fs::remove_file(dir.join(kubelet_api::KUBELET_SOCKET));
    }

    /// Goes away like a killed kubelet: every connection drops (its ListAndWatch
    /// streams end), and a stale kubelet.sock stays behind.
    pub async fn kill(mut self) {
        self.alive.store(false, Ordering::SeqCst);
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Ok(mut tasks) = self.watching.lock() {
            tasks.drain(..).for_each(|t| t.abort());
        }
        if let Some(h) = self.server.take() {
            h.abort();
            let _ = h.await;
        }
    }
}
