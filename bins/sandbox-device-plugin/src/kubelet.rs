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

use deviceplugin::v1beta1::device_plugin_server::DevicePluginServer;
use deviceplugin::v1beta1::registration_client::RegistrationClient;
use deviceplugin::v1beta1::RegisterRequest;
use deviceplugin::{KUBELET_SOCKET, VERSION};
use tokio::sync::{mpsc, oneshot, watch};
use tonic::transport::Server;
use vfio_sandbox::config::ResourceName;

use crate::devices::Snapshot;
use crate::service::{options, PluginService, Streams};

/// What a resource task is told to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Serve on a new socket and register again (kubelet restarted, or our socket was deleted).
    Restart,
    /// Stop serving and remove the socket.
    Stop,
}

/// First and longest wait between registration attempts.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(10));
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
}

/// A socket name unique to this process, resource and start: the resource's short
/// name (at most 24 characters), a hash of the full name (two domains may share a
/// short name), the pid and a serial. Short enough that the path in the default
/// directory stays well under `sun_path`'s 108 bytes.
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
        std::process::id()
    )
}

enum Flow {
    /// Registered with the kubelet whose socket has this identity.
    Registered(KubeletId),
    Restart,
    Stop,
}

/// Which kubelet we registered with: the (device, inode) of its `kubelet.sock`. A new
/// kubelet process creates a new socket file, so a different identity means a restart.
type KubeletId = Option<(u64, u64)>;

fn kubelet_id(dir: &Path) -> KubeletId {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(dir.join(KUBELET_SOCKET)).ok()?;
    Some((m.dev(), m.ino()))
}

/// True when a restart request changes nothing: our socket is still there and the
/// kubelet we registered with is still the one serving. (Deleting our socket and
/// recreating kubelet.sock both signal a restart; acting on both would register twice.)
fn still_registered(dir: &Path, socket: &Path, with: KubeletId) -> bool {
    with.is_some() && socket.exists() && kubelet_id(dir) == with
}

/// Serves `resource` until told to stop; returns after removing its socket.
pub async fn serve_resource(
    resource: ResourceName,
    settings: Settings,
    mut commands: mpsc::UnboundedReceiver<Command>,
) {
    let mut serial = 0;
    loop {
        serial += 1;
        let name = socket_name(&resource, serial);
        let path = settings.dir.join(&name);
        let (ended_tx, mut ended) = mpsc::unbounded_channel();
        let streams = Arc::new(Streams::new(ended_tx));
        let Some(stop_server) = start_server(&resource, &settings, &path, streams.clone()) else {
            // Could not bind (directory missing?): try again shortly.
            match wait_or_command(&mut commands, BACKOFF.1).await {
                Some(Command::Stop) => return,
                _ => continue,
            }
        };
        settings
            .sockets
            .lock()
            .map(|mut m| m.insert(name.clone(), resource.clone()))
            .ok();
        let mut flow = register(&resource, &settings.dir, &name, &streams, &mut commands).await;
        while let Flow::Registered(with) = flow {
            flow = tokio::select! {
                cmd = commands.recv() => match cmd {
                    Some(Command::Restart) if still_registered(&settings.dir, &path, with) => {
                        tracing::debug!(resource = %resource, "still registered with the same kubelet; nothing to restart");
                        Flow::Registered(with)
                    }
                    Some(Command::Restart) => Flow::Restart,
                    Some(Command::Stop) | None => Flow::Stop,
                },
                Some(generation) = ended.recv() => {
                    if broken(&streams, generation).await {
                        tracing::warn!(resource = %resource, "ListAndWatch stream broke; registering again");
                        register(&resource, &settings.dir, &name, &streams, &mut commands).await
                    } else {
                        Flow::Registered(with)
                    }
                }
            };
        }
        settings.sockets.lock().map(|mut m| m.remove(&name)).ok();
        let _ = stop_server.send(());
        let _ = std::fs::remove_file(&path);
        if let Flow::Stop = flow {
            tracing::info!(resource = %resource, socket = %path.display(), "stopped serving");
            return;
        }
        // Coalesce a burst of restarts (kubelet deletes every socket, then creates kubelet.sock).
        while let Ok(cmd) = commands.try_recv() {
            if cmd == Command::Stop {
                return;
            }
        }
        tracing::info!(resource = %resource, "restarting on a new socket");
    }
}

/// True when the stream that ended was the current registration's and no successor
/// opened within the grace period.
async fn broken(streams: &Streams, generation: u64) -> bool {
    if generation != streams.generation.load(Ordering::SeqCst) {
        return false; // ended because we registered again: expected
    }
    tokio::time::sleep(STREAM_GRACE).await;
    generation == streams.generation.load(Ordering::SeqCst)
        && streams.active.load(Ordering::SeqCst) == 0
}

fn start_server(
    resource: &ResourceName,
    settings: &Settings,
    path: &Path,
    streams: Arc<Streams>,
) -> Option<oneshot::Sender<()>> {
    let _ = std::fs::remove_file(path);
    let listener = match tokio::net::UnixListener::bind(path) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(socket = %path.display(), error = %e, "cannot listen; retrying");
            return None;
        }
    };
    let service = PluginService {
        resource: resource.clone(),
        snapshot: settings.snapshot.clone(),
        iommufd: settings.iommufd,
        streams,
    };
    let (tx, rx) = oneshot::channel::<()>();
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let name = resource.clone();
    tokio::spawn(async move {
        let result = Server::builder()
            .add_service(DevicePluginServer::new(service))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = rx.await;
            })
            .await;
        if let Err(e) = result {
            tracing::error!(resource = %name, error = %e, "gRPC server failed");
        }
    });
    tracing::info!(resource = %resource, socket = %path.display(), "serving");
    Some(tx)
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

/// Registers until kubelet accepts, backing off and logging once per step.
async fn register(
    resource: &ResourceName,
    dir: &Path,
    endpoint: &str,
    streams: &Streams,
    commands: &mut mpsc::UnboundedReceiver<Command>,
) -> Flow {
    let mut delay = BACKOFF.0;
    loop {
        streams.generation.fetch_add(1, Ordering::SeqCst);
        let with = kubelet_id(dir);
        match register_once(dir, endpoint, resource).await {
            Ok(()) => {
                tracing::info!(resource = %resource, endpoint, "registered with kubelet");
                return Flow::Registered(with);
            }
            Err(e) => {
                tracing::warn!(resource = %resource, error = %e, retry_in = ?delay, "cannot register with kubelet");
            }
        }
        match wait_or_command(commands, delay).await {
            None => delay = (delay * 2).min(BACKOFF.1),
            // kubelet.sock appeared (or came back) while our socket is intact: try now.
            Some(Command::Restart) if dir.join(endpoint).exists() => delay = BACKOFF.0,
            Some(Command::Restart) => return Flow::Restart,
            Some(Command::Stop) => return Flow::Stop,
        }
    }
}

async fn register_once(dir: &Path, endpoint: &str, resource: &ResourceName) -> anyhow::Result<()> {
    let socket = dir.join(KUBELET_SOCKET);
    let call = async {
        let channel = deviceplugin::unix_channel(socket.clone()).await?;
        RegistrationClient::new(channel)
            .register(RegisterRequest {
                version: VERSION.into(),
                endpoint: endpoint.into(),
                resource_name: resource.to_string(),
                options: Some(options()),
            })
            .await?;
        anyhow::Ok(())
    };
    tokio::time::timeout(REGISTER_TIMEOUT, call)
        .await
        .map_err(|_| anyhow::anyhow!("Register on {} timed out", socket.display()))?
        .map_err(|e| {
            anyhow::anyhow!(
                "Register on {}: {}",
                socket.display(),
                vfio_sandbox::error_chain(e.as_ref())
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let path = Path::new(deviceplugin::DEFAULT_KUBELET_DIR).join(socket_name(&long, 99));
        assert!(path.as_os_str().len() < 108, "{}", path.display());
    }
}
