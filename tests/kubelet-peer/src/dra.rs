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
#[allow(missing_docs)]
pub struct ClaimRef {
    /// The claim's UID.
    pub uid: String,
    pub namespace: String,
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

mod client;
pub mod health;

pub use client::{Answer, ClaimError, Dra, PrepareResult, Prepared, UnprepareResult, Unprepared};

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
                        "invalid supported gRPC versions of DRA driver plugin {name} \
                            at endpoint {endpoint}: {e}"
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
                            "none of services supported by the plugin ({services:?}) \
                                are supported by the kubelet ({:?})",
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
///
/// The dial blocks (`grpc.WithBlock()`) until the connection is ready or the dial
/// timeout passes, so a socket that refuses the connection (bound, not listening
/// yet, or left by a process that died) is dialed again after grpc-go's backoff
/// (first retry after 1 s, `google.golang.org/grpc/backoff`, `DefaultConfig`); a
/// socket that is not there at all fails at once.
async fn registration_client(socket: &Path) -> anyhow::Result<RegistrationClient<Channel>> {
    let authority = crate::grpcgo::path_authority(socket);
    let deadline = tokio::time::Instant::now() + DIAL_TIMEOUT;
    loop {
        let dial = kubelet_api::unix_channel_with_authority(socket, &authority);
        let e = match tokio::time::timeout_at(deadline, dial).await {
            Ok(Ok(channel)) => return Ok(RegistrationClient::new(channel)),
            Err(_) => anyhow::bail!("failed to dial socket {}: timed out", socket.display()),
            Ok(Err(e)) => e,
        };
        let refused = std::iter::successors(Some(&e as &dyn std::error::Error), |e| e.source())
            .filter_map(|e| e.downcast_ref::<std::io::Error>())
            .any(|io| io.kind() == std::io::ErrorKind::ConnectionRefused);
        let retry = tokio::time::Instant::now() + Duration::from_secs(1);
        if !refused || retry >= deadline {
            anyhow::bail!("failed to dial socket {}, err: {e}", socket.display());
        }
        tokio::time::sleep_until(retry).await;
    }
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
            "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at \
                socket {}, err: {e}",
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

/// How the plugin watcher's registration of a socket ended.
#[derive(Debug)]
pub enum RegisterOutcome {
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
) -> anyhow::Result<RegisterOutcome> {
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
        Chosen::Speaks(chosen) => RegisterOutcome::Registered(Registered {
            socket: socket.to_owned(),
            kind: info.r#type,
            name: info.name,
            endpoint: info.endpoint,
            supported_versions: info.supported_versions,
            chosen,
        }),
        Chosen::V1alpha4 => RegisterOutcome::RegisteredAlpha(info),
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
        RegisterOutcome::Registered(r) => Ok(r),
        RegisterOutcome::RegisteredAlpha(info) => anyhow::bail!(
            "kubelet {kubelet:?} registered {} but would call {V1ALPHA4_NODE_SERVICE} \
                (it lists {:?}), which this peer does not speak",
            info.name,
            info.supported_versions
        ),
    }
}

/// Finds a registration socket in `registry` (waiting up to `timeout`) and
/// registers the plugin behind it as kubelet 1.34 does ([`register_in_as`]).
pub async fn register(registry: &Path, timeout: Duration) -> anyhow::Result<Registered> {
    register_in_as(registry, KubeletVersion::V1_34, timeout).await
}

/// How often kubelet's plugin manager reconciles: every pass registers each
/// socket not registered yet (`loopSleepDuration`,
/// `pkg/kubelet/pluginmanager/plugin_manager.go`; `reconcile`,
/// `pkg/kubelet/pluginmanager/reconciler/reconciler.go`).
const RECONCILE_PERIOD: Duration = Duration::from_secs(1);
/// After a failed registration the operation is not run again for 500 ms,
/// doubled at each failure up to 2m2s (`initialDurationBeforeRetry`,
/// `maxDurationBeforeRetry`, `pkg/util/goroutinemap/exponentialbackoff`; the
/// plugin manager's operation executor backs off on error,
/// `operationexecutor/operation_executor.go`).
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(122);

/// Finds a registration socket in `registry` and registers the plugin behind it
/// as kubelet `kubelet` does, failed attempts included: a failed registration
/// (a dial or `GetInfo` that timed out, a refusal) is tried again at the first
/// reconcile pass after its backoff, as long as `timeout` (counted from the
/// call) allows; the last error is the answer.
pub async fn register_in_as(
    registry: &Path,
    kubelet: KubeletVersion,
    timeout: Duration,
) -> anyhow::Result<Registered> {
    let deadline = tokio::time::Instant::now() + timeout;
    let socket = find_registration_socket(registry, timeout).await?;
    let first_pass = tokio::time::Instant::now();
    let mut backoff = Duration::ZERO;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let e = match register_socket_as(&socket, kubelet).await {
            Ok(r) => return Ok(r),
            Err(e) => e,
        };
        backoff = if backoff.is_zero() {
            FIRST_BACKOFF
        } else {
            (backoff * 2).min(MAX_BACKOFF)
        };
        let allowed = tokio::time::Instant::now() + backoff - first_pass;
        let passes = allowed.as_nanos().div_ceil(RECONCILE_PERIOD.as_nanos());
        let next = first_pass + RECONCILE_PERIOD * u32::try_from(passes).unwrap_or(u32::MAX);
        if next >= deadline {
            let s = if attempts == 1 { "" } else { "s" };
            return Err(e.context(format!(
                "{} not registered within {timeout:?} ({attempts} attempt{s})",
                socket.display()
            )));
        }
        eprintln!(
            "kubelet-peer: {e:#}; trying again in {:?}",
            next - tokio::time::Instant::now()
        );
        tokio::time::sleep_until(next).await;
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
mod tests;
