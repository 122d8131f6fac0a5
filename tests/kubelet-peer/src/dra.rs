//! kubelet's side of DRA plugin registration and of the `DRAPlugin` service.
//!
//! As kubelet does:
//! - its plugin watcher scans the registry directory for sockets (here: files named
//!   `*-reg.sock`), calls `GetInfo` on each, checks the answer (type `DRAPlugin`, a
//!   name, a service version it knows, picking the first listed that it knows) and
//!   reports the verdict with `NotifyRegistrationStatus` ([`register`]);
//! - its DRA manager then calls `NodePrepareResources` / `NodeUnprepareResources`
//!   on the endpoint from `PluginInfo`, in the chosen version, and treats an answer
//!   for a claim it did not ask about, a claim left out, or a non-empty `error` as a
//!   failure ([`Dra`], [`PrepareResult::problems`]).
//!
//! Results serialize to stable JSON (maps sorted by claim uid) for shell scenarios.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kubelet_api::dra::{v1, v1beta1};
use kubelet_api::pluginregistration::registration_client::RegistrationClient;
use kubelet_api::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus};
use tonic::transport::Channel;

/// A claim as kubelet names it in `NodePrepareResources`: kubelet's `claimInfo`
/// keeps the same three (`pkg/kubelet/cm/dra/state`, `ClaimInfoState`: `ClaimUID`,
/// `ClaimName`, `Namespace`). The peer has its own type, as kubelet does: it shares
/// nothing with the driver under test but the wire.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct ClaimRef {
    /// The claim's UID.
    pub uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

/// One device a driver prepared, as kubelet keeps it (`pkg/kubelet/cm/dra/state`,
/// `Device`: `PoolName`, `DeviceName`, `RequestNames`, `CDIDeviceIDs`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PreparedDevice {
    /// The request(s) it satisfies.
    pub request_names: Vec<String>,
    /// Its pool.
    pub pool_name: String,
    /// Its name in the ResourceSlice.
    pub device_name: String,
    /// The fully qualified CDI device ids the container runtime applies.
    pub cdi_device_ids: Vec<String>,
}

/// A DRA service version kubelet speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Version {
    /// `k8s.io.kubelet.pkg.apis.dra.v1` (kubelet 1.34 and later).
    V1,
    /// `k8s.io.kubelet.pkg.apis.dra.v1beta1` (kubelet 1.32 and later).
    V1beta1,
}

impl Version {
    /// Both, in kubelet's order of preference.
    pub const ALL: [Version; 2] = [Version::V1, Version::V1beta1];

    /// The name a plugin lists in `PluginInfo.supported_versions`.
    pub fn service(self) -> &'static str {
        match self {
            Version::V1 => kubelet_api::DRA_V1_SERVICE,
            Version::V1beta1 => kubelet_api::DRA_V1BETA1_SERVICE,
        }
    }
}

impl std::str::FromStr for Version {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "v1" | "v1.DRAPlugin" => Ok(Version::V1),
            "v1beta1" | "v1beta1.DRAPlugin" => Ok(Version::V1beta1),
            _ => Err(format!("unknown DRA version {s:?} (v1 or v1beta1)")),
        }
    }
}

/// A plugin kubelet accepted.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Registered {
    /// The registration socket it was found at.
    pub socket: PathBuf,
    /// `PluginInfo.type`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `PluginInfo.name`.
    pub name: String,
    /// `PluginInfo.endpoint`.
    pub endpoint: String,
    /// `PluginInfo.supported_versions`, as listed.
    pub supported_versions: Vec<String>,
    /// The version kubelet would use: the first listed that it knows.
    pub chosen: Version,
}

impl Registered {
    /// The service socket: the endpoint, or the registration socket when empty.
    pub fn endpoint_path(&self) -> PathBuf {
        if self.endpoint.is_empty() {
            self.socket.clone()
        } else {
            PathBuf::from(&self.endpoint)
        }
    }
}

/// The kubelet release the peer plays: what differs between them on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum KubeletVersion {
    /// kubelet 1.32: `RegistrationHandler` (`pkg/kubelet/cm/dra/plugin/registration.go`),
    /// DRA service `v1beta1` (or the `v1alpha4` fallback), `grpc.Dial(endpoint)`,
    /// `resource.k8s.io/v1beta1`.
    #[serde(rename = "1.32")]
    V1_32,
    /// kubelet 1.34: `DRAPluginManager`
    /// (`pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`), DRA services `v1` and
    /// `v1beta1`, `grpc.NewClient("unix:" + endpoint)`, `resource.k8s.io/v1`.
    #[default]
    #[serde(rename = "1.34")]
    V1_34,
}

impl std::str::FromStr for KubeletVersion {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim_start_matches('v') {
            "1.32" => Ok(Self::V1_32),
            "1.34" => Ok(Self::V1_34),
            _ => Err(format!("unknown kubelet {s:?} (1.32 or 1.34)")),
        }
    }
}

/// What kubelet 1.32 falls back to when a plugin lists no service it knows:
/// `drapbv1alpha4.NodeService` (`registration.go`, `validateSupportedServices`).
pub const V1ALPHA4_NODE_SERVICE: &str = "v1alpha3.Node";

/// The service version a kubelet chose for a plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chosen {
    /// One this peer speaks.
    Speaks(Version),
    /// kubelet 1.32's silent fallback to the alpha service, which this peer does
    /// not speak (the plugin is registered all the same, as 1.32 does).
    V1alpha4,
}

impl KubeletVersion {
    /// The version check of `ValidatePlugin` / `RegisterPlugin`
    /// (`validateSupportedServices`):
    /// - 1.32 (`registration.go`) walks its own list, most recent first
    ///   (`v1beta1.DRAPlugin`, then the alpha `v1alpha3.Node`), and falls back to
    ///   the alpha service when the plugin lists neither; only an empty list fails;
    /// - 1.34 (`dra_plugin_manager.go`) walks the plugin's list in the plugin's
    ///   order and takes the first that it supports (`v1.DRAPlugin`,
    ///   `v1beta1.DRAPlugin`), failing when none is.
    ///
    /// Errors are worded as that kubelet words them.
    pub fn choose(self, name: &str, endpoint: &str, services: &[String]) -> Result<Chosen, String> {
        const EMPTY: &str = "empty list of supported gRPC services (aka supported versions)";
        match self {
            Self::V1_32 => {
                if services.is_empty() {
                    return Err(format!("invalid versions of plugin {name}: {EMPTY}"));
                }
                if services.iter().any(|s| s == Version::V1beta1.service()) {
                    Ok(Chosen::Speaks(Version::V1beta1))
                } else {
                    Ok(Chosen::V1alpha4)
                }
            }
            Self::V1_34 => {
                let wrap = |e: String| {
                    format!(
                        "invalid supported gRPC versions of DRA driver plugin {name} at endpoint {endpoint}: {e}"
                    )
                };
                if services.is_empty() {
                    return Err(wrap(EMPTY.into()));
                }
                services
                    .iter()
                    .find_map(|s| Version::ALL.into_iter().find(|v| v.service() == s))
                    .map(Chosen::Speaks)
                    .ok_or_else(|| {
                        wrap(format!(
                            "none of services supported by the plugin ({services:?}) are supported by the kubelet ({:?})",
                            Version::ALL.map(Version::service)
                        ))
                    })
            }
        }
    }

    /// The `:authority` this kubelet's DRA client sends to `endpoint`: 1.32 dials
    /// the bare path (`plugin.go`, `grpc.Dial(p.endpoint, …)`), so grpc-go's
    /// passthrough resolver makes it the percent-encoded path; 1.34 dials
    /// `"unix:" + endpoint` (`dra_plugin_manager.go`, `add`), whose resolver
    /// answers `localhost` ([`crate::grpcgo`]).
    pub fn dra_authority(self, endpoint: &Path) -> String {
        match self {
            Self::V1_32 => crate::grpcgo::path_authority(endpoint),
            Self::V1_34 => crate::grpcgo::dial_authority(&format!("unix:{}", endpoint.display()))
                .unwrap_or_else(|_| crate::grpcgo::LOCALHOST.to_owned()),
        }
    }

    /// The `resource.k8s.io` version its client-go calls: 1.32 `ResourceV1beta1()`
    /// (`registration.go`, `manager.go`), 1.34 `ResourceV1()`.
    pub fn resource_api(self) -> &'static str {
        match self {
            Self::V1_32 => "resource.k8s.io/v1beta1",
            Self::V1_34 => "resource.k8s.io/v1",
        }
    }
}

/// Checks `info` as kubelet 1.34 does; the version it would use.
pub fn check_info(info: &PluginInfo) -> Result<Version, String> {
    if info.r#type != kubelet_api::DRA_PLUGIN_TYPE {
        return Err(format!(
            "no handler registered for plugin type: {}",
            info.r#type
        ));
    }
    match KubeletVersion::V1_34.choose(&info.name, &info.endpoint, &info.supported_versions)? {
        Chosen::Speaks(v) => Ok(v),
        Chosen::V1alpha4 => Err("v1alpha4 is not spoken".into()),
    }
}

/// The registration sockets (`*-reg.sock`) in `dir` now, sorted.
pub fn registration_sockets(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    use std::os::unix::fs::FileTypeExt;
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name();
        let is_reg = name.to_str().is_some_and(|n| {
            n.ends_with(kubelet_api::DRA_REGISTRATION_SUFFIX) && !n.starts_with('.')
        });
        if is_reg && e.file_type()?.is_socket() {
            found.push(e.path());
        }
    }
    found.sort();
    Ok(found)
}

/// Waits up to `timeout` for a registration socket in `dir`; the first, sorted.
pub async fn find_registration_socket(dir: &Path, timeout: Duration) -> anyhow::Result<PathBuf> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Ok(found) = registration_sockets(dir) {
            if let Some(first) = found.into_iter().next() {
                return Ok(first);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!(
                "no *{} socket in {} within {timeout:?}",
                kubelet_api::DRA_REGISTRATION_SUFFIX,
                dir.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How long the plugin watcher's blocking dial may take (`dialTimeoutDuration`),
/// how long `GetInfo` may take, and `NotifyRegistrationStatus`
/// (`notifyTimeoutDuration`), from `operation_generator.go`.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
const GET_INFO_TIMEOUT: Duration = Duration::from_secs(1);
const NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);

/// The plugin watcher's connection to a registration socket: one connection for
/// `GetInfo` and `NotifyRegistrationStatus`, dialed with the bare socket path, so
/// grpc-go sends the percent-encoded path as `:authority`
/// (`pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go`, `dial`;
/// [`crate::grpcgo`]).
async fn registration_client(socket: &Path) -> anyhow::Result<RegistrationClient<Channel>> {
    let authority = crate::grpcgo::path_authority(socket);
    let channel = tokio::time::timeout(
        DIAL_TIMEOUT,
        kubelet_api::unix_channel_with_authority(socket, &authority),
    )
    .await
    .map_err(|_| anyhow::anyhow!("failed to dial socket {}: timed out", socket.display()))?
    .map_err(|e| anyhow::anyhow!("failed to dial socket {}, err: {e}", socket.display()))?;
    Ok(RegistrationClient::new(channel))
}

/// `GetInfo` on a registration socket.
pub async fn get_info(socket: &Path) -> anyhow::Result<PluginInfo> {
    let mut client = registration_client(socket).await?;
    get_info_on(&mut client, socket).await
}

async fn get_info_on(
    client: &mut RegistrationClient<Channel>,
    socket: &Path,
) -> anyhow::Result<PluginInfo> {
    let mut req = tonic::Request::new(InfoRequest {});
    req.set_timeout(GET_INFO_TIMEOUT);
    let info = client.get_info(req).await.map_err(|e| {
        anyhow::anyhow!(
            "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket {}, err: {e}",
            socket.display()
        )
    })?;
    Ok(info.into_inner())
}

/// `NotifyRegistrationStatus` on a registration socket.
pub async fn notify(socket: &Path, status: RegistrationStatus) -> anyhow::Result<()> {
    let mut client = registration_client(socket).await?;
    notify_on(&mut client, socket, status).await
}

async fn notify_on(
    client: &mut RegistrationClient<Channel>,
    socket: &Path,
    status: RegistrationStatus,
) -> anyhow::Result<()> {
    let mut req = tonic::Request::new(status);
    req.set_timeout(NOTIFY_TIMEOUT);
    client.notify_registration_status(req).await.map_err(|e| {
        anyhow::anyhow!(
            "RegisterPlugin error -- failed to send registration status at socket {}, err: {e}",
            socket.display()
        )
    })?;
    Ok(())
}

/// The plugin watcher's verdict on a registration socket.
#[derive(Debug)]
pub enum Verdict {
    /// Validated, registered and told so.
    Registered(Registered),
    /// Registered and told so, but with kubelet 1.32's alpha fallback
    /// ([`Chosen::V1alpha4`]): this peer cannot call it.
    RegisteredAlpha(PluginInfo),
}

/// Registers the plugin at `socket` as kubelet's plugin watcher does
/// (`operation_generator.go`, `GenerateRegisterPluginFunc`), with the DRA handler
/// of `kubelet`: `GetInfo` (1 s); no handler for its type → notify `false` with
/// "no handler registered for plugin type"; an empty endpoint becomes the
/// registration socket; `ValidatePlugin` (the version check) failing → notify
/// `false` with "plugin validation failed"; `RegisterPlugin` failing (`accept`, the
/// handler's own bookkeeping) → notify `false` with "plugin registration failed";
/// else notify `true`. A refusal is the error.
pub async fn register_as(
    socket: &Path,
    kubelet: KubeletVersion,
    accept: impl FnOnce(&PluginInfo) -> Result<(), String>,
) -> anyhow::Result<Verdict> {
    let mut client = registration_client(socket).await?;
    let mut info = get_info_on(&mut client, socket).await?;
    let refuse = |error: String| RegistrationStatus {
        plugin_registered: false,
        error,
    };
    if info.r#type != kubelet_api::DRA_PLUGIN_TYPE {
        let error = format!(
            "RegisterPlugin error -- no handler registered for plugin type: {} at socket {}",
            info.r#type,
            socket.display()
        );
        notify_on(&mut client, socket, refuse(error.clone())).await?;
        anyhow::bail!(error)
    }
    if info.endpoint.is_empty() {
        info.endpoint = socket.display().to_string();
    }
    let chosen = match kubelet.choose(&info.name, &info.endpoint, &info.supported_versions) {
        Ok(c) => c,
        Err(e) => {
            let error = format!("RegisterPlugin error -- plugin validation failed with err: {e}");
            notify_on(&mut client, socket, refuse(error.clone())).await?;
            anyhow::bail!(error)
        }
    };
    if let Err(e) = accept(&info) {
        let error = format!("RegisterPlugin error -- plugin registration failed with err: {e}");
        notify_on(&mut client, socket, refuse(error.clone())).await?;
        anyhow::bail!(error)
    }
    notify_on(
        &mut client,
        socket,
        RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        },
    )
    .await?;
    Ok(match chosen {
        Chosen::Speaks(chosen) => Verdict::Registered(Registered {
            socket: socket.to_owned(),
            kind: info.r#type,
            name: info.name,
            endpoint: info.endpoint,
            supported_versions: info.supported_versions,
            chosen,
        }),
        Chosen::V1alpha4 => Verdict::RegisteredAlpha(info),
    })
}

/// Registers the plugin at `socket` as kubelet `kubelet` does ([`register_as`]);
/// kubelet 1.32's alpha fallback is an error here, after the plugin was told it
/// is registered.
pub async fn register_socket_as(
    socket: &Path,
    kubelet: KubeletVersion,
) -> anyhow::Result<Registered> {
    match register_as(socket, kubelet, |_| Ok(())).await? {
        Verdict::Registered(r) => Ok(r),
        Verdict::RegisteredAlpha(info) => anyhow::bail!(
            "kubelet {kubelet:?} registered {} but would call {V1ALPHA4_NODE_SERVICE} (it lists {:?}), which this peer does not speak",
            info.name,
            info.supported_versions
        ),
    }
}

/// Registers the plugin at `socket` as kubelet 1.34 does.
pub async fn register_socket(socket: &Path) -> anyhow::Result<Registered> {
    register_socket_as(socket, KubeletVersion::V1_34).await
}

/// Finds a registration socket in `registry` (waiting up to `timeout`) and
/// registers the plugin behind it as kubelet 1.34 does.
pub async fn register(registry: &Path, timeout: Duration) -> anyhow::Result<Registered> {
    let socket = find_registration_socket(registry, timeout).await?;
    register_socket(&socket).await
}

/// What a claim's prepare came back with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Prepared {
    /// The devices, as listed.
    pub devices: Vec<PreparedDevice>,
    /// Empty on success.
    pub error: String,
}

/// What a claim's unprepare came back with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Unprepared {
    /// Empty on success.
    pub error: String,
}

/// A response's claims by uid, sorted, with kubelet's verdict on them.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Answer<T> {
    /// The response's entries, keyed by claim uid.
    pub claims: BTreeMap<String, T>,
}

/// A prepare response.
pub type PrepareResult = Answer<Prepared>;
/// An unprepare response.
pub type UnprepareResult = Answer<Unprepared>;

/// An entry's error message, whatever the call.
pub trait ClaimError {
    /// Empty on success.
    fn error(&self) -> &str;
}

impl ClaimError for Prepared {
    fn error(&self) -> &str {
        &self.error
    }
}

impl ClaimError for Unprepared {
    fn error(&self) -> &str {
        &self.error
    }
}

impl<T: ClaimError> Answer<T> {
    /// Why kubelet would fail the call for these `asked` claims: an entry for a uid
    /// not asked about, an asked uid left out, a claim whose error is set. Empty
    /// when every claim succeeded.
    pub fn problems(&self, asked: &[ClaimRef]) -> Vec<String> {
        let mut out = Vec::new();
        for (uid, a) in &self.claims {
            if !asked.iter().any(|c| &c.uid == uid) {
                out.push(format!(
                    "answer for claim uid {uid:?} that was not asked about"
                ));
            } else if !a.error().is_empty() {
                out.push(format!("claim {uid}: {}", a.error()));
            }
        }
        let mut left_out: Vec<&str> = asked
            .iter()
            .map(|c| c.uid.as_str())
            .filter(|u| !self.claims.contains_key(*u))
            .collect();
        left_out.sort();
        left_out.dedup();
        out.extend(
            left_out
                .into_iter()
                .map(|u| format!("claim {u} left out of the answer")),
        );
        out
    }

    /// The answer as one line of JSON, maps sorted.
    pub fn to_json(&self) -> String
    where
        T: serde::Serialize,
    {
        serde_json::to_string(self)
            .unwrap_or_else(|e| format!("{{\"json_error\":{:?}}}", e.to_string()))
    }
}

/// A `DRAPlugin` client in one version.
#[derive(Debug, Clone)]
pub enum Dra {
    /// Speaks v1.
    V1(v1::dra_plugin_client::DraPluginClient<Channel>),
    /// Speaks v1beta1.
    V1beta1(v1beta1::dra_plugin_client::DraPluginClient<Channel>),
}

macro_rules! to_wire {
    ($v:ident, $claims:expr) => {
        $claims
            .iter()
            .map(|c| $v::Claim {
                namespace: c.namespace.clone(),
                uid: c.uid.clone(),
                name: c.name.clone(),
            })
            .collect()
    };
}

macro_rules! prepared {
    ($resp:expr) => {
        $resp
            .claims
            .into_iter()
            .map(|(uid, r)| {
                let devices = r
                    .devices
                    .into_iter()
                    .map(|d| PreparedDevice {
                        request_names: d.request_names,
                        pool_name: d.pool_name,
                        device_name: d.device_name,
                        cdi_device_ids: d.cdi_device_ids,
                    })
                    .collect();
                (
                    uid,
                    Prepared {
                        devices,
                        error: r.error,
                    },
                )
            })
            .collect()
    };
}

impl Dra {
    /// Connects to the service socket at `endpoint`, speaking `version`, sending
    /// `:authority` `localhost` (kubelet 1.33 and later).
    pub async fn connect(endpoint: &Path, version: Version) -> anyhow::Result<Self> {
        Self::connect_with_authority(endpoint, version, crate::grpcgo::LOCALHOST).await
    }

    /// Connects as kubelet `kubelet`'s DRA client does
    /// ([`KubeletVersion::dra_authority`]).
    pub async fn connect_as(
        endpoint: &Path,
        version: Version,
        kubelet: KubeletVersion,
    ) -> anyhow::Result<Self> {
        Self::connect_with_authority(endpoint, version, &kubelet.dra_authority(endpoint)).await
    }

    /// Connects to the service socket at `endpoint`, speaking `version`, with every
    /// request's `:authority` set to `authority`.
    pub async fn connect_with_authority(
        endpoint: &Path,
        version: Version,
        authority: &str,
    ) -> anyhow::Result<Self> {
        let channel = kubelet_api::unix_channel_with_authority(endpoint, authority)
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to {}: {e}", endpoint.display()))?;
        Ok(match version {
            Version::V1 => Dra::V1(v1::dra_plugin_client::DraPluginClient::new(channel)),
            Version::V1beta1 => {
                Dra::V1beta1(v1beta1::dra_plugin_client::DraPluginClient::new(channel))
            }
        })
    }

    /// The version this client speaks.
    pub fn version(&self) -> Version {
        match self {
            Dra::V1(_) => Version::V1,
            Dra::V1beta1(_) => Version::V1beta1,
        }
    }

    /// `NodePrepareResources` for `claims`, in the order given.
    pub async fn prepare(&mut self, claims: &[ClaimRef]) -> Result<PrepareResult, tonic::Status> {
        let claims = match self {
            Dra::V1(c) => {
                let r = c
                    .node_prepare_resources(v1::NodePrepareResourcesRequest {
                        claims: to_wire!(v1, claims),
                    })
                    .await?
                    .into_inner();
                prepared!(r)
            }
            Dra::V1beta1(c) => {
                let r = c
                    .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
                        claims: to_wire!(v1beta1, claims),
                    })
                    .await?
                    .into_inner();
                prepared!(r)
            }
        };
        Ok(Answer { claims })
    }

    /// `NodeUnprepareResources` for `claims`, in the order given.
    pub async fn unprepare(
        &mut self,
        claims: &[ClaimRef],
    ) -> Result<UnprepareResult, tonic::Status> {
        let claims = match self {
            Dra::V1(c) => c
                .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                    claims: to_wire!(v1, claims),
                })
                .await?
                .into_inner()
                .claims
                .into_iter()
                .map(|(uid, r)| (uid, Unprepared { error: r.error }))
                .collect(),
            Dra::V1beta1(c) => c
                .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
                    claims: to_wire!(v1beta1, claims),
                })
                .await?
                .into_inner()
                .claims
                .into_iter()
                .map(|(uid, r)| (uid, Unprepared { error: r.error }))
                .collect(),
        };
        Ok(Answer { claims })
    }
}

/// Parses `NAMESPACE/NAME/UID` (the command line's claim spelling).
pub fn parse_claim(s: &str) -> Result<ClaimRef, String> {
    let mut parts = s.splitn(3, '/');
    match (parts.next(), parts.next(), parts.next()) {
        (Some(namespace), Some(name), Some(uid)) => Ok(ClaimRef {
            uid: uid.into(),
            namespace: namespace.into(),
            name: name.into(),
        }),
        _ => Err(format!("claim {s:?} is not NAMESPACE/NAME/UID")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(kind: &str, versions: &[&str]) -> PluginInfo {
        PluginInfo {
            r#type: kind.into(),
            name: "d".into(),
            endpoint: "/p/d/dra.sock".into(),
            supported_versions: versions.iter().map(|v| v.to_string()).collect(),
        }
    }

    #[test]
    fn kubelet_picks_the_first_version_it_knows() {
        assert_eq!(
            check_info(&info("DRAPlugin", &["v1.DRAPlugin", "v1beta1.DRAPlugin"])),
            Ok(Version::V1)
        );
        assert_eq!(
            check_info(&info(
                "DRAPlugin",
                &["v2.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAPlugin"]
            )),
            Ok(Version::V1beta1)
        );
        assert!(check_info(&info("DRAPlugin", &[])).is_err());
        assert!(check_info(&info("DRAPlugin", &["v1alpha4.DRAPlugin"])).is_err());
        assert!(check_info(&info("CSIPlugin", &["v1.DRAPlugin"])).is_err());
    }

    #[test]
    fn kubelet_1_32_prefers_v1beta1_and_falls_back_to_alpha() {
        let k = KubeletVersion::V1_32;
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            k.choose("d", "/e", &v(&["v1.DRAPlugin", "v1beta1.DRAPlugin"])),
            Ok(Chosen::Speaks(Version::V1beta1))
        );
        assert_eq!(
            k.choose("d", "/e", &v(&["v1.DRAPlugin"])),
            Ok(Chosen::V1alpha4)
        );
        assert!(k
            .choose("d", "/e", &[])
            .unwrap_err()
            .starts_with("invalid versions of plugin d: empty list"));
        assert_eq!(
            KubeletVersion::V1_34.choose("d", "/e", &v(&["v1beta1.DRAPlugin", "v1.DRAPlugin"])),
            Ok(Chosen::Speaks(Version::V1beta1)),
            "1.34 follows the plugin's order"
        );
        assert_eq!(
            k.dra_authority(Path::new("/p/d/dra.sock")),
            "%2Fp%2Fd%2Fdra.sock"
        );
        assert_eq!(
            KubeletVersion::V1_34.dra_authority(Path::new("/p/d/dra.sock")),
            "localhost"
        );
    }

    #[test]
    fn problems_are_what_kubelet_fails_on() {
        let asked = [
            parse_claim("ns/a/uid-a").unwrap(),
            parse_claim("ns/b/uid-b").unwrap(),
            parse_claim("ns/c/uid-c").unwrap(),
        ];
        let mut claims = BTreeMap::new();
        claims.insert(
            "uid-a".to_string(),
            Unprepared {
                error: String::new(),
            },
        );
        claims.insert(
            "uid-b".to_string(),
            Unprepared {
                error: "busy".into(),
            },
        );
        claims.insert(
            "uid-x".to_string(),
            Unprepared {
                error: String::new(),
            },
        );
        let a = Answer { claims };
        assert_eq!(
            a.problems(&asked),
            [
                "claim uid-b: busy",
                "answer for claim uid \"uid-x\" that was not asked about",
                "claim uid-c left out of the answer"
            ]
        );
        assert_eq!(
            a.to_json(),
            r#"{"claims":{"uid-a":{"error":""},"uid-b":{"error":"busy"},"uid-x":{"error":""}}}"#
        );
    }

    #[test]
    fn claims_are_namespace_name_uid() {
        let c = parse_claim("ns/name/1234-ab").unwrap();
        assert_eq!(
            (c.namespace.as_str(), c.name.as_str(), c.uid.as_str()),
            ("ns", "name", "1234-ab")
        );
        assert!(parse_claim("ns/name").is_err());
        assert_eq!(parse_claim("ns/name/").unwrap().uid, "");
    }
}
