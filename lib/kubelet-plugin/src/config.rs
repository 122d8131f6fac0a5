//! Where and how the plugin serves: kubelet's directories, the driver and node
//! names, the sockets they give, and the limits of a call.

use std::path::PathBuf;
use std::time::Duration;

use kubelet_api::pluginregistration::PluginInfo;

/// kubelet's plugin registry directory.
pub(crate) const DEFAULT_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// kubelet's plugins directory.
pub(crate) const DEFAULT_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// How long kubelet waits for a DRA call (`defaultClientCallTimeout`,
/// `pkg/kubelet/cm/dra/plugin`).
pub const KUBELET_CALL_TIMEOUT: Duration = Duration::from_secs(45);

/// Where and how the plugin serves: [`Config::new`], then change the fields that
/// differ.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// The DRA driver name (a DNS subdomain): `PluginInfo.name`, the ResourceSlices'
    /// driver, and part of both socket paths.
    pub driver_name: String,
    /// This node's name: its pool, and its ResourceSlices' node.
    pub node_name: String,
    /// kubelet's plugin registry directory (`/var/lib/kubelet/plugins_registry`).
    pub registry_dir: PathBuf,
    /// kubelet's plugins directory (`/var/lib/kubelet/plugins`).
    pub plugins_dir: PathBuf,
    /// Kept (JSON) while kubelet has accepted the registration and the
    /// ResourceSlices are published ([`crate::probe`] reads it); `None` keeps none.
    pub ready_file: Option<PathBuf>,
    /// The longest a prepare or unprepare call takes, claim reads included: keep it
    /// below [`KUBELET_CALL_TIMEOUT`], so kubelet gets the answer.
    pub call_timeout: Duration,
    /// The longest wait between two tries of a publication that failed.
    pub max_retry: Duration,
}

impl Config {
    /// A configuration for `driver_name` on `node_name`, with kubelet's
    /// directories, no ready file, a 40 s call limit and retries at most 5 min apart.
    pub fn new(driver_name: impl Into<String>, node_name: impl Into<String>) -> Self {
        Self {
            driver_name: driver_name.into(),
            node_name: node_name.into(),
            registry_dir: DEFAULT_REGISTRY_DIR.into(),
            plugins_dir: DEFAULT_PLUGINS_DIR.into(),
            ready_file: None,
            call_timeout: Duration::from_secs(40),
            max_retry: Duration::from_secs(300),
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
    pub(crate) fn sockets(&self) -> Vec<PathBuf> {
        vec![self.registration_socket(), self.service_socket()]
    }

    /// What `GetInfo` answers: type `DRAPlugin`, the driver name, the service
    /// socket, and both versions, v1 first (kubelet picks the first it knows);
    /// with `health`, both versions of `DRAResourceHealth` after them (kubelet 1.34
    /// skips names it does not know, 1.32 looks for `v1beta1.DRAPlugin` alone, and
    /// newer kubelets open the health stream only when it is listed).
    pub(crate) fn plugin_info(&self, health: bool) -> PluginInfo {
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

    /// Refuses what cannot be served: a driver name that is not one path component
    /// (it names a socket and a directory), a socket path too long for a Unix
    /// socket, an empty node name, a zero call limit.
    pub fn check(&self) -> Result<(), ConfigError> {
        let n = &self.driver_name;
        if n.is_empty() || n == "." || n == ".." || n.contains(['/', '\0']) {
            return Err(ConfigError(format!(
                "driver name {n:?} cannot name a socket: it must be one path component"
            )));
        }
        for (what, path) in [
            ("registration socket", self.registration_socket()),
            ("DRA service socket", self.service_socket()),
        ] {
            kubelet_api::serve::check_socket_path(&path)
                .map_err(|e| ConfigError(format!("the {what}: {e}")))?;
        }
        if self.node_name.trim().is_empty() {
            return Err(ConfigError("the node name is empty".into()));
        }
        if self.call_timeout.is_zero() || self.max_retry.is_zero() {
            return Err(ConfigError(
                "the call limit and the longest retry wait must be above zero".into(),
            ));
        }
        Ok(())
    }
}

/// A configuration that cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(String);
