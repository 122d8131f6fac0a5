//! A whole DRA driver on this crate that does nothing to its devices: it
//! publishes `DEVICES` devices (`dev-0`, `dev-1`, …) in this node's pool, prepares
//! a claim by writing one CDI spec for it (an environment variable per device)
//! and answering its CDI ids, and unprepares it by removing that spec. It is the
//! smallest driver that a real kubelet and container runtime run pods with, and
//! the one the DRA benchmark sets against Go's `kubeletplugin` doing the same.
//!
//! ```text
//! NODE_NAME=node-a DEVICES=8 cargo run -p kubelet-plugin --example cdi_driver
//! ```
//!
//! Settings (environment): `NODE_NAME` (required), `DRIVER_NAME`
//! (`cdi.example.com`), `DEVICES` (8), `CDI_DIR` (`/var/run/cdi`, where
//! containerd and CRI-O read CDI specs), `KUBELET_DIR` (`/var/lib/kubelet`),
//! `READY_FILE` (none); the API server from `KUBECONFIG` or the pod's service
//! account. SIGINT or SIGTERM stops it; its ResourceSlices stay for the next start.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::Device;
use kubelet_plugin::{
    cdi, Answers, Claim, ClaimRef, Clients, Config, Driver, KeptFields, Offer, Plugin,
    PreparedDevice,
};
use tokio::signal::unix::{signal, SignalKind};

/// The driver: its name, its devices and where its CDI specs go. Cheap to clone,
/// so each call's file work can take it to a blocking thread.
#[derive(Clone)]
struct CdiDriver(Arc<Settings>);

struct Settings {
    name: String,
    devices: usize,
    cdi_dir: PathBuf,
}

/// Why a claim failed.
#[derive(Debug, thiserror::Error)]
enum CdiError {
    #[error("device {0} is not one of this driver's")]
    Unknown(String),
    #[error("cannot write CDI spec {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot remove CDI spec {path}")]
    Remove {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the file work stopped: {0}")]
    Stopped(String),
}

impl CdiDriver {
    /// The spec file of the claim with uid `uid`.
    fn spec_path(&self, uid: &str) -> PathBuf {
        let file = cdi::transient_spec_name(&self.0.name, "device", uid);
        self.0.cdi_dir.join(file)
    }

    /// Writes the claim's CDI spec (atomically: a runtime never reads half of it)
    /// and answers its devices with their CDI ids.
    fn prepare_one(&self, claim: &Claim) -> Result<Vec<PreparedDevice>, CdiError> {
        let uid = &claim.reference.uid;
        let mut spec = cdi::Spec {
            kind: format!("{}/device", self.0.name),
            devices: Vec::new(),
        };
        let mut answer = Vec::new();
        for d in &claim.devices {
            let ours = d
                .device
                .strip_prefix("dev-")
                .and_then(|i| i.parse::<usize>().ok())
                .is_some_and(|i| i < self.0.devices);
            if !ours {
                return Err(CdiError::Unknown(d.device.clone()));
            }
            // Unique on the host: the claim's uid after the device's own name.
            let name = format!("{}-{uid}", d.device);
            let variable = format!("DEVICE_{}", d.device.replace('-', "_").to_uppercase());
            answer.push(PreparedDevice {
                request_names: d.request_names.clone(),
                pool_name: d.pool.clone(),
                device_name: d.device.clone(),
                cdi_device_ids: vec![spec.device_id(&name)],
            });
            spec.devices.push(cdi::Device {
                name,
                container_edits: cdi::ContainerEdits {
                    env: vec![format!("{variable}={}", d.device)],
                    ..cdi::ContainerEdits::default()
                },
            });
        }
        let path = self.spec_path(uid);
        write_atomically(&path, spec.to_json().as_bytes())
            .map_err(|source| CdiError::Write { path, source })?;
        Ok(answer)
    }

    /// Removes the claim's CDI spec; one that is gone is unprepared already.
    fn unprepare_one(&self, claim: &ClaimRef) -> Result<(), CdiError> {
        let path = self.spec_path(&claim.uid);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(CdiError::Remove { path, source: e })
            }
            _ => Ok(()),
        }
    }

    /// Each of `claims` answered by `work`, on a blocking thread (file writes do
    /// not belong on the runtime's threads).
    async fn each<C: Send + 'static, T: Send + 'static>(
        &self,
        claims: Vec<C>,
        uid: fn(&C) -> &str,
        work: fn(&Self, &C) -> Result<T, CdiError>,
    ) -> Answers<T, CdiError> {
        let uids: Vec<String> = claims.iter().map(|c| uid(c).to_owned()).collect();
        let me = self.clone();
        let answers = tokio::task::spawn_blocking(move || {
            let each = claims.iter().map(|c| (uid(c).to_owned(), work(&me, c)));
            each.collect::<Answers<T, CdiError>>()
        });
        match answers.await {
            Ok(answers) => answers,
            Err(e) => uids
                .into_iter()
                .map(|u| (u, Err(CdiError::Stopped(e.to_string()))))
                .collect(),
        }
    }
}

/// `bytes` at `path`, through a temporary file renamed over it.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[tonic::async_trait]
impl Driver for CdiDriver {
    type Error = CdiError;

    async fn prepare(
        &self,
        claims: Vec<Claim>,
        _deadline: tokio::time::Instant,
    ) -> Answers<Vec<PreparedDevice>, CdiError> {
        self.each(claims, |c| &c.reference.uid, Self::prepare_one)
            .await
    }

    async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
        _deadline: tokio::time::Instant,
    ) -> Answers<(), CdiError> {
        self.each(claims, |c| &c.uid, Self::unprepare_one).await
    }

    fn devices(&self, _fields: KeptFields) -> Result<Offer, CdiError> {
        let devices = (0..self.0.devices).map(|i| Device {
            name: format!("dev-{i}"),
            ..Device::default()
        });
        Ok(devices.collect::<Vec<_>>().into())
    }
}

/// The setting `name` from the environment, or `default`.
fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let node = std::env::var("NODE_NAME").map_err(|_| "NODE_NAME is not set")?;
    let name = setting("DRIVER_NAME", "cdi.example.com");
    let devices: usize = setting("DEVICES", "8")
        .parse()
        .map_err(|e| format!("DEVICES is not a count: {e}"))?;
    let cdi_dir = PathBuf::from(setting("CDI_DIR", "/var/run/cdi"));
    std::fs::create_dir_all(&cdi_dir)
        .map_err(|e| format!("cannot create CDI directory {}: {e}", cdi_dir.display()))?;
    let kubelet_dir = PathBuf::from(setting("KUBELET_DIR", "/var/lib/kubelet"));
    let mut config = Config::new(&name, node);
    config.registry_dir = kubelet_dir.join("plugins_registry");
    config.plugins_dir = kubelet_dir.join("plugins");
    config.ready_file = std::env::var_os("READY_FILE").map(PathBuf::from);
    let client = kube::Client::try_default().await?;
    let plugin = Plugin::new(config, Clients::new(client))?;
    let driver = CdiDriver(Arc::new(Settings {
        name,
        devices,
        cdi_dir,
    }));
    let mut term = signal(SignalKind::terminate())?;
    let stop = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    plugin.run(Arc::new(driver), stop).await?;
    Ok(())
}
