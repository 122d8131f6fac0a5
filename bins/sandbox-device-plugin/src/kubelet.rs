//! Serving one resource to kubelet: serve on a fresh socket first, then `Register`
//! (kubelet dials back during the call), and start over when kubelet restarts.
//!
//! Each resource has one task running [`serve_resource`], driven by [`Command`]s from
//! the kubelet-directory watcher and from its own ListAndWatch streams.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kubelet_api::serve::SocketFile;
use kubelet_api::v1beta1::device_plugin_server::DevicePluginServer;
use kubelet_api::v1beta1::registration_client::RegistrationClient;
use kubelet_api::v1beta1::RegisterRequest;
use kubelet_api::{KUBELET_SOCKET, VERSION};
use passthrough::config::ResourceName;
use tokio::sync::{mpsc, oneshot, watch};
use tonic::transport::Server;

use crate::devices::Snapshot;
use crate::metrics::{Metrics, ResourceMetrics};
use crate::service::{options, PluginService, Streams};

/// What a resource task is told to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Something changed in the directory (our socket deleted, `kubelet.sock`
    /// created): the task checks what it means and, when needed, serves a new socket
    /// and registers again.
    Restart,
    /// Stop serving and remove the socket.
    Stop,
}

/// The first wait between registration attempts.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
/// The longest wait between registration attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// How long a broken ListAndWatch stream may stay without a successor before we
/// register again (kubelet opens the new stream right after Register).
const STREAM_GRACE: Duration = Duration::from_millis(500);
/// Deadline for one Register call.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);

/// Which socket file serves which resource, for the directory watcher.
pub type Sockets = Arc<Mutex<HashMap<String, ResourceName>>>;

/// Everything a resource task needs.
#[derive(Clone)]
pub struct Settings {
    /// The device-plugins directory.
    pub dir: PathBuf,
    /// The node's devices.
    pub snapshot: watch::Receiver<Arc<Snapshot>>,
    /// Add iommufd nodes to Allocate answers.
    pub iommufd: bool,
    /// Our live sockets.
    pub sockets: Sockets,
    /// The plugin's metrics.
    pub metrics: Arc<Metrics>,
}

/// A socket name unique to this process, resource and start: the resource's short
/// name (at most 24 characters), a hash of the full name (two domains may share a
/// short name), this process's [`instance`] token and a serial. Short enough that
/// the path in the default directory stays well under `sun_path`'s 108 bytes.
pub fn socket_name(resource: &ResourceName, serial: u64) -> String {
    let full = resource.as_str();
    let short: String = full
        .rsplit('/')
        .next()
        .unwrap_or(full)
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .take(24)
        .collect();
    // FNV-1a: stable across runs and platforms.
    let hash = full.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    format!(
        "vfio-sandbox-{short}-{hash:08x}-{}-{serial}.sock",
        instance()
    )
}

/// This process's part of its socket names: eight hex digits of its pid and its
/// start time. The pid alone repeats in every pod (each plugin is PID 1 of its
/// container), and kubelet refuses a registration on a socket path it still
/// holds an endpoint for (pkg/kubelet/cm/devicemanager/manager.go,
/// `PluginConnected`: "device plugin already connected"), then forgets the
/// client of that path (plugin/v1beta1/handler.go, `deregisterClient`), so the
/// predecessor's endpoint is never cleaned up and the path stays refused: a
/// rolled-out pod reusing its predecessor's name could never register.
fn instance() -> &'static str {
    static INSTANCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    INSTANCE.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        // FNV-1a over both, so the low bits of each count.
        let token = [u128::from(std::process::id()), nanos]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .fold(0x811c_9dc5_u32, |h, b| {
                (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
            });
        format!("{token:08x}")
    })
}

/// How many starts of one resource's server the socket path check allows for: a
/// serial past it makes the name one digit longer than checked.
const CHECKED_SERIAL: u64 = 999_999;

/// Refuses a device-plugin directory whose socket paths cannot be Unix socket
/// addresses: kubelet's `kubelet.sock`, which we dial, and the socket of each of
/// `resources` up to its millionth start. (A resource whose first device comes
/// later is refused then, when its socket is made, naming the path.)
pub fn check_socket_paths<'a>(
    dir: &Path,
    resources: impl IntoIterator<Item = &'a ResourceName>,
) -> Result<(), kubelet_api::serve::SocketPathTooLong> {
    kubelet_api::serve::check_socket_path(&dir.join(KUBELET_SOCKET))?;
    for r in resources {
        kubelet_api::serve::check_socket_path(&dir.join(socket_name(r, CHECKED_SERIAL)))?;
    }
    Ok(())
}

/// Which kubelet: the identity of its `kubelet.sock` (device, inode and change
/// time; a new kubelet process creates a new socket file, and the change time keeps
/// a reused inode number from passing for the old file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KubeletId {
    dev: u64,
    ino: u64,
    ctime: (i64, i64),
}

/// The kubelet serving in `dir` now, if any.
fn kubelet_id(dir: &Path) -> Option<KubeletId> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(dir.join(KUBELET_SOCKET)).ok()?;
    Some(KubeletId {
        dev: m.dev(),
        ino: m.ino(),
        ctime: (m.ctime(), m.ctime_nsec()),
    })
}

/// How one socket's life ends.
enum End {
    /// Told to stop.
    Stop,
    /// Serve on a fresh socket: ours was deleted, or a new kubelet is serving.
    FreshSocket,
}

/// What a restart signal means for the socket being served.
#[derive(Debug, PartialEq, Eq)]
enum SocketChange {
    /// Start over on a fresh socket.
    FreshSocket,
    /// Another kubelet is serving than the one an attempt went to: try it now.
    RetryNow,
    /// Nothing changed that concerns us.
    Ignore,
}

/// One socket we serve: its server, its registration state and its streams.
struct Served {
    name: String,
    path: PathBuf,
    streams: Arc<Streams>,
    ended: mpsc::UnboundedReceiver<()>,
    /// The kubelet this socket registered with. A socket registers with one kubelet
    /// only: a new kubelet gets a fresh socket.
    registered_with: Option<KubeletId>,
}

impl Served {
    /// Judges a restart signal against what is on disk now. `attempt` is the kubelet
    /// an unregistered socket last tried.
    fn assess(&self, dir: &Path, attempt: Option<KubeletId>) -> SocketChange {
        let now = kubelet_id(dir);
        if !self.path.exists() {
            SocketChange::FreshSocket
        } else if let Some(with) = self.registered_with {
            if now == Some(with) {
                SocketChange::Ignore
            } else {
                SocketChange::FreshSocket
            }
        } else if now != attempt {
            SocketChange::RetryNow
        } else {
            SocketChange::Ignore
        }
    }
}

/// Serves `resource` until told to stop; returns after removing its socket.
///
/// Every wait (a Register call, the backoff between attempts, the grace for a broken
/// stream) is cut short by a command, so a kubelet restart is answered at once.
///
/// A socket's name never reaches kubelet while kubelet may still hold an endpoint
/// for it. kubelet refuses such a Register, and the refusal makes it forget the
/// client it had for that path (pkg/kubelet/cm/devicemanager/manager.go,
/// `PluginConnected`: "device plugin already connected"; plugin/v1beta1/handler.go,
/// `connectClient` and `runClient`): that endpoint would never be disconnected, and
/// the node would advertise the resource after the plugin is gone. So a Register
/// that failed or timed out after it was sent (kubelet may have accepted it) is
/// followed by a fresh socket. A broken stream is answered on the same socket:
/// kubelet's stream ends only as kubelet drops the endpoint (`runClient` calls
/// `disconnectClient` when its `ListAndWatch` ends), well within the grace we give
/// a successor stream.
pub async fn serve_resource(
    resource: ResourceName,
    settings: Settings,
    mut commands: mpsc::UnboundedReceiver<Command>,
) {
    let metrics = settings.metrics.resource(&resource);
    let mut serial = 0;
    // Kept across sockets: a kubelet refusing every Register is not hammered.
    let mut delay = BACKOFF_FIRST;
    loop {
        serial += 1;
        let name = socket_name(&resource, serial);
        let path = settings.dir.join(&name);
        let (ended_tx, ended) = mpsc::unbounded_channel();
        let streams = Arc::new(Streams::new(ended_tx));
        let Some((stop_server, socket)) =
            start_server(&resource, &settings, &path, streams.clone(), &metrics)
        else {
            // Could not bind (directory missing?): try again shortly.
            match wait_or_command(&mut commands, BACKOFF_MAX).await {
                Some(Command::Stop) => return,
                _ => continue,
            }
        };
        settings
            .sockets
            .lock()
            .map(|mut m| m.insert(name.clone(), resource.clone()))
            .ok();
        let mut served = Served {
            name: name.clone(),
            path: path.clone(),
            streams,
            ended,
            registered_with: None,
        };
        let end = run(
            &resource,
            &settings.dir,
            &mut served,
            &mut commands,
            &metrics,
            &mut delay,
        )
        .await;
        settings.sockets.lock().map(|mut m| m.remove(&name)).ok();
        let _ = stop_server.send(());
        // Only our own socket: a file someone put in its place is left alone.
        if let Err(e) = socket.remove_if_ours() {
            tracing::warn!(resource = %resource, socket = %path.display(), error = %e,
                "cannot remove our socket");
        }
        if let End::Stop = end {
            tracing::info!(resource = %resource, socket = %path.display(), "stopped serving");
            return;
        }
        // Signals queued so far are answered by the fresh socket (kubelet deletes
        // every socket, then creates kubelet.sock: two signals, one restart).
        while let Ok(cmd) = commands.try_recv() {
            if cmd == Command::Stop {
                return;
            }
        }
        tracing::info!(resource = %resource, "restarting on a new socket");
    }
}

/// Registers `served` and keeps it registered until it must give way. `delay` is
/// the wait before the next attempt after a failed one.
async fn run(
    resource: &ResourceName,
    dir: &Path,
    served: &mut Served,
    commands: &mut mpsc::UnboundedReceiver<Command>,
    metrics: &ResourceMetrics,
    delay: &mut Duration,
) -> End {
    loop {
        let target = kubelet_id(dir);
        if served.assess(dir, target) == SocketChange::FreshSocket {
            return End::FreshSocket;
        }
        let result = {
            let attempt = register_once(dir, &served.name, resource, target);
            tokio::pin!(attempt);
            loop {
                tokio::select! {
                    r = &mut attempt => break Some(r),
                    cmd = commands.recv() => match cmd {
                        Some(Command::Restart) => match served.assess(dir, target) {
                            SocketChange::FreshSocket => return End::FreshSocket,
                            SocketChange::RetryNow => break None,
                            SocketChange::Ignore => {}
                        },
                        Some(Command::Stop) | None => return End::Stop,
                    },
                }
            }
        };
        match result {
            Some(Attempt::KubeletChanged) => {
                // kubelet.sock changed hands between judging it and connecting.
                match served.assess(dir, target) {
                    SocketChange::FreshSocket => return End::FreshSocket,
                    SocketChange::RetryNow | SocketChange::Ignore => {
                        tracing::info!(resource = %resource, "another kubelet is \
                            serving; registering with it");
                        *delay = BACKOFF_FIRST;
                    }
                }
            }
            Some(Attempt::Registered) => {
                metrics.registered.inc();
                tracing::info!(resource = %resource, endpoint = %served.name,
                    "registered with kubelet");
                served.registered_with = target;
                *delay = BACKOFF_FIRST;
                match watch_registration(resource, dir, served, commands).await {
                    Some(end) => return end,
                    None => continue, // the stream broke, this kubelet still serves
                }
            }
            Some(Attempt::Failed { error, sent }) => {
                metrics.register_failed.inc();
                tracing::warn!(
                    resource = %resource,
                    error = %error,
                    retry_in = ?*delay,
                    new_socket = sent,
                    "cannot register with kubelet"
                );
                match wait_or_command(commands, *delay).await {
                    None => *delay = (*delay * 2).min(BACKOFF_MAX),
                    Some(Command::Restart) => {
                        if served.assess(dir, target) == SocketChange::FreshSocket {
                            return End::FreshSocket;
                        }
                        // kubelet.sock appeared or came back: try now.
                        *delay = BACKOFF_FIRST;
                    }
                    Some(Command::Stop) => return End::Stop,
                }
                if sent {
                    return End::FreshSocket;
                }
            }
            None => {
                // The attempt went to a kubelet that is no longer there; the new
                // one has not seen this socket's name.
                tracing::info!(resource = %resource, "another kubelet is serving; \
                    registering with it");
                *delay = BACKOFF_FIRST;
            }
        }
    }
}

/// Waits while registered. Returns how the socket ends (told to stop; a fresh
/// socket when ours was deleted or kubelet changed), or `None` when the
/// registration's stream broke with no successor within the grace while the same
/// kubelet still serves: kubelet has dropped the endpoint, register again on this
/// socket.
async fn watch_registration(
    resource: &ResourceName,
    dir: &Path,
    served: &mut Served,
    commands: &mut mpsc::UnboundedReceiver<Command>,
) -> Option<End> {
    loop {
        tokio::select! {
            cmd = commands.recv() => match cmd {
                Some(Command::Restart) => match served.assess(dir, served.registered_with) {
                    SocketChange::FreshSocket => return Some(End::FreshSocket),
                    _ => {
                        tracing::debug!(resource = %resource, "still registered with \
                            the same kubelet; nothing to restart");
                        continue;
                    }
                },
                Some(Command::Stop) | None => return Some(End::Stop),
            },
            Some(()) = served.ended.recv() => {}
        }
        // kubelet opens a new stream right after a Register; give a successor the
        // grace period, unless a restart signal settles the matter first.
        let grace = tokio::time::sleep(STREAM_GRACE);
        tokio::pin!(grace);
        loop {
            tokio::select! {
                _ = &mut grace => break,
                cmd = commands.recv() => match cmd {
                    Some(Command::Restart) => {
                        if served.assess(dir, served.registered_with) == SocketChange::FreshSocket {
                            return Some(End::FreshSocket);
                        }
                    }
                    Some(Command::Stop) | None => return Some(End::Stop),
                },
            }
        }
        if served.streams.active.load(Ordering::SeqCst) == 0 {
            if kubelet_id(dir) != served.registered_with {
                tracing::warn!(resource = %resource, "ListAndWatch stream broke and \
                    kubelet is gone; waiting for it on a new socket");
                return Some(End::FreshSocket);
            }
            tracing::warn!(resource = %resource, "ListAndWatch stream broke; registering again");
            return None;
        }
    }
}

fn start_server(
    resource: &ResourceName,
    settings: &Settings,
    path: &Path,
    streams: Arc<Streams>,
    metrics: &ResourceMetrics,
) -> Option<(oneshot::Sender<()>, SocketFile)> {
    let (listener, file) = match kubelet_api::serve::listen(path) {
        Ok(served) => served,
        Err(e) => {
            tracing::error!(error = %support::error_chain(&e), "cannot serve; retrying");
            return None;
        }
    };
    let service = PluginService {
        resource: resource.clone(),
        snapshot: settings.snapshot.clone(),
        iommufd: settings.iommufd,
        streams,
        metrics: metrics.clone(),
    };
    let router = Server::builder().add_service(DevicePluginServer::new(service));
    let tx = kubelet_api::serve::spawn(listener, router, "device plugin");
    tracing::info!(resource = %resource, socket = %path.display(), "serving");
    Some((tx, file))
}

async fn wait_or_command(
    commands: &mut mpsc::UnboundedReceiver<Command>,
    d: Duration,
) -> Option<Command> {
    tokio::select! {
        _ = tokio::time::sleep(d) => None,
        cmd = commands.recv() => Some(cmd.unwrap_or(Command::Stop)),
    }
}

/// How one Register attempt ended.
#[derive(Debug)]
enum Attempt {
    /// kubelet accepted the registration.
    Registered,
    /// `kubelet.sock` was no longer the kubelet judged (`target`) when we connected:
    /// nothing was sent. A Register meant for one kubelet instance never reaches
    /// another (a new kubelet gets a fresh socket, registered once).
    KubeletChanged,
    /// No registration: `error` says why. `sent`: the request may have reached
    /// kubelet (it failed or timed out after being sent), so the name is spent.
    Failed {
        /// What went wrong, naming the socket.
        error: anyhow::Error,
        /// The request left this process.
        sent: bool,
    },
}

/// Registers `endpoint` with the kubelet `target`, if `kubelet.sock` still is it.
///
/// The socket file is looked at after the connection is made: when it is still
/// `target`'s, the connection reached `target` (a replaced file never comes back
/// with the same device, inode and change time).
async fn register_once(
    dir: &Path,
    endpoint: &str,
    resource: &ResourceName,
    target: Option<KubeletId>,
) -> Attempt {
    let socket = dir.join(KUBELET_SOCKET);
    let sent = std::sync::atomic::AtomicBool::new(false);
    let call = async {
        let stream = tokio::net::UnixStream::connect(&socket).await?;
        if kubelet_id(dir) != target {
            return anyhow::Ok(Attempt::KubeletChanged);
        }
        let channel = kubelet_api::unix_channel_over(stream).await?;
        sent.store(true, Ordering::SeqCst);
        RegistrationClient::new(channel)
            .register(RegisterRequest {
                version: VERSION.into(),
                endpoint: endpoint.into(),
                resource_name: resource.to_string(),
                options: Some(options()),
            })
            .await?;
        anyhow::Ok(Attempt::Registered)
    };
    let error = match tokio::time::timeout(REGISTER_TIMEOUT, call).await {
        Ok(Ok(attempt)) => return attempt,
        Ok(Err(e)) => anyhow::anyhow!(
            "Register on {}: {}",
            socket.display(),
            support::error_chain(e.as_ref())
        ),
        Err(_) => anyhow::anyhow!(
            "Register on {} timed out after {:?}",
            socket.display(),
            REGISTER_TIMEOUT
        ),
    };
    Attempt::Failed {
        error,
        sent: sent.load(Ordering::SeqCst),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(dir: &Path, registered_with: Option<KubeletId>) -> Served {
        let path = dir.join("ours.sock");
        std::fs::write(&path, "").unwrap();
        let (tx, ended) = mpsc::unbounded_channel();
        Served {
            name: "ours.sock".into(),
            path,
            streams: Arc::new(Streams::new(tx)),
            ended,
            registered_with,
        }
    }

    fn new_kubelet(dir: &Path) -> Option<KubeletId> {
        let _ = std::fs::remove_file(dir.join(KUBELET_SOCKET));
        std::fs::write(dir.join(KUBELET_SOCKET), "").unwrap();
        kubelet_id(dir)
    }

    #[test]
    fn a_socket_registers_with_one_kubelet_only() {
        let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
        let first = new_kubelet(dir.path());
        let s = served(dir.path(), first);
        assert_eq!(
            s.assess(dir.path(), first),
            SocketChange::Ignore,
            "same kubelet"
        );
        // Keep the inode busy so the new file cannot reuse it by chance either way.
        let _old = std::fs::File::open(dir.path().join(KUBELET_SOCKET)).unwrap();
        let second = new_kubelet(dir.path());
        assert_ne!(first, second);
        assert_eq!(
            s.assess(dir.path(), first),
            SocketChange::FreshSocket,
            "new kubelet"
        );
        std::fs::remove_file(dir.path().join(KUBELET_SOCKET)).unwrap();
        assert_eq!(
            s.assess(dir.path(), first),
            SocketChange::FreshSocket,
            "kubelet gone"
        );
    }

    #[test]
    fn an_unregistered_socket_retries_a_new_kubelet_and_a_deleted_one_is_replaced() {
        let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
        let s = served(dir.path(), None);
        assert_eq!(
            s.assess(dir.path(), None),
            SocketChange::Ignore,
            "still no kubelet"
        );
        let k = new_kubelet(dir.path());
        assert_eq!(
            s.assess(dir.path(), None),
            SocketChange::RetryNow,
            "kubelet appeared"
        );
        assert_eq!(
            s.assess(dir.path(), k),
            SocketChange::Ignore,
            "the one we are trying"
        );
        std::fs::remove_file(&s.path).unwrap();
        assert_eq!(
            s.assess(dir.path(), k),
            SocketChange::FreshSocket,
            "ours deleted"
        );
    }

    /// The interleaving behind a double registration: the plugin judged the old
    /// kubelet, a new one replaced kubelet.sock, and the Register meant for the old
    /// one reached the new one on the old socket (the fresh socket's Register
    /// followed). The connection is checked first: nothing reaches the new kubelet.
    #[test]
    fn a_register_meant_for_a_replaced_kubelet_never_reaches_the_new_one() {
        let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let old = kubelet_peer::Kubelet::start(dir.path()).await.unwrap();
            let judged = kubelet_id(dir.path());
            old.kill().await;
            let new = kubelet_peer::Kubelet::start(dir.path()).await.unwrap();
            let r: ResourceName = "example.com/NIC_PT".parse().unwrap();
            let out = register_once(dir.path(), "old.sock", &r, judged).await;
            assert!(matches!(out, Attempt::KubeletChanged), "{out:?}");
            assert!(new.calls().is_empty(), "{:?}", new.calls());
            // Control: judged right, the call does reach it.
            let now = kubelet_id(dir.path());
            let call = register_once(dir.path(), "new.sock", &r, now);
            let _ = tokio::time::timeout(Duration::from_millis(300), call).await;
            assert_eq!(new.calls().len(), 1, "{:?}", new.calls());
        });
    }

    #[test]
    fn socket_names_are_unique_bare_and_short() {
        let r: ResourceName = "rebellions.ai/ATOM_CA22_PT".parse().unwrap();
        let a = socket_name(&r, 1);
        assert!(a.starts_with("vfio-sandbox-ATOM_CA22_PT-"), "{a}");
        let other: ResourceName = "example.com/ATOM_CA22_PT".parse().unwrap();
        assert_ne!(a, socket_name(&other, 1), "same short name, other domain");
        assert_ne!(a, socket_name(&r, 2));
        assert!(!a.contains('/'));
        let long: ResourceName = format!(
            "{0}.{0}.{0}.example.com/{1}",
            "d".repeat(60),
            "N".repeat(63)
        )
        .parse()
        .unwrap();
        let path = Path::new(kubelet_api::DEFAULT_KUBELET_DIR).join(socket_name(&long, 99));
        assert!(path.as_os_str().len() < 108, "{}", path.display());
    }
}
