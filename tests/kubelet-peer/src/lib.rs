//! A kubelet-like peer for device-plugin tests.
//!
//! It plays kubelet's side of the device-plugin protocol over real Unix sockets:
//! it serves `Registration` on `<dir>/kubelet.sock`, and during each `Register` it
//! dials the plugin's socket back and asks for its options, as kubelet 1.25+ does,
//! refusing the registration when that fails. Tests then use [`Kubelet::plugin`] to
//! call `ListAndWatch`, `Allocate` and `GetPreferredAllocation` as kubelet would.

use std::path::{Path, PathBuf};
use std::time::Duration;

use deviceplugin::v1beta1::device_plugin_client::DevicePluginClient;
use deviceplugin::v1beta1::registration_server::{Registration, RegistrationServer};
use deviceplugin::v1beta1::{Empty, RegisterRequest};
use tokio::sync::{mpsc, oneshot, Mutex};
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};

/// A registration kubelet accepted, with the options it read back from the plugin.
#[derive(Debug, Clone)]
pub struct Registered {
    /// The request as sent.
    pub request: RegisterRequest,
    /// What `GetDevicePluginOptions` answered on the dial-back.
    pub options: deviceplugin::v1beta1::DevicePluginOptions,
}

struct RegistrationService {
    dir: PathBuf,
    tx: mpsc::UnboundedSender<Registered>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let req = request.into_inner();
        if req.version != deviceplugin::VERSION {
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
        let mut client = connect(&path).await.map_err(|e| {
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
        let _ = self.tx.send(Registered {
            request: req,
            options,
        });
        Ok(Response::new(Empty {}))
    }
}

/// A gRPC channel over a Unix socket.
pub async fn channel(path: &Path) -> anyhow::Result<Channel> {
    Ok(deviceplugin::unix_channel(path).await?)
}

/// The plugin binary `bin` pointed at a fake node under `root` (`sys/`, `dev/`,
/// `kubelet/`), with the variables of the environment that would override it cleared.
pub fn plugin_command(bin: &Path, root: &Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(bin);
    cmd.arg("--sysfs-root")
        .arg(root.join("sys"))
        .arg("--dev-root")
        .arg(root.join("dev"))
        .arg("--kubelet-dir")
        .arg(root.join("kubelet"))
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
    stop: Option<oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl Kubelet {
    /// Serves Registration on `<dir>/kubelet.sock` (creating `dir`).
    pub async fn start(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let socket = dir.join(deviceplugin::KUBELET_SOCKET);
        let _ = std::fs::remove_file(&socket);
        let listener = tokio::net::UnixListener::bind(&socket)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let service = RegistrationService {
            dir: dir.to_owned(),
            tx,
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
            stop: Some(stop),
            server: Some(server),
        })
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

    /// Stops serving and removes kubelet.sock, as a kubelet going down does.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.server.take() {
            let _ = h.await;
        }
        let _ = std::fs::remove_file(self.dir.join(deviceplugin::KUBELET_SOCKET));
    }

    /// What a restarting kubelet does to the directory: every socket but its own is deleted.
    pub fn wipe_plugin_sockets(dir: &Path) -> std::io::Result<usize> {
        let mut n = 0;
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            if e.file_name() != deviceplugin::KUBELET_SOCKET {
                std::fs::remove_file(e.path())?;
                n += 1;
            }
        }
        Ok(n)
    }
}
