//! kubelet's gRPC APIs for node plugins, generated from our transcriptions of the
//! upstream protos:
//! - the device-plugin API, version `v1beta1` (`api.proto`): messages, the
//!   `Registration` service kubelet serves and the `DevicePlugin` service a plugin
//!   serves ([`v1beta1`]);
//! - plugin registration (`pluginregistration/v1/api.proto`): the `Registration`
//!   service every plugin of kubelet's plugin watcher serves on its registration
//!   socket ([`pluginregistration`]);
//! - Dynamic Resource Allocation (`dra/v1/api.proto`, `dra/v1beta1/api.proto`): the
//!   `DRAPlugin` service a DRA driver serves ([`dra::v1`], [`dra::v1beta1`]);
//! - DRA device health (`dra-health/v1alpha1/api.proto`, `dra-health/v1/api.proto`):
//!   the `DRAResourceHealth` stream a DRA driver serves beside it ([`dra_health`]).

pub mod authority;
pub mod serve;

/// Package `v1beta1`: the device-plugin API.
#[allow(missing_docs, clippy::all)]
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

/// Package `pluginregistration`: plugin registration with kubelet's plugin watcher.
#[allow(missing_docs, clippy::all)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

/// The Dynamic Resource Allocation API kubelet calls on a driver's endpoint.
#[allow(missing_docs, clippy::all)]
pub mod dra {
    /// Package `k8s.io.kubelet.pkg.apis.dra.v1` (kubelet 1.34 and later).
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    /// Package `k8s.io.kubelet.pkg.apis.dra.v1beta1` (kubelet 1.32 and later);
    /// field for field the same messages as [`v1`].
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
}

/// The DRA device health stream kubelet reads from a driver's endpoint (KEP-4680):
/// `DRAResourceHealth.NodeWatchResources`, field for field the same in both.
#[allow(missing_docs, clippy::all)]
pub mod dra_health {
    /// Package `v1alpha1` (kubelet 1.34 and later).
    pub mod v1alpha1 {
        tonic::include_proto!("v1alpha1");
    }
    /// Package `v1` (the newer kubelets, which prefer it).
    pub mod v1 {
        tonic::include_proto!("v1");
    }
}

/// `PluginInfo.supported_versions` entry for the [`dra_health::v1`] service.
pub const DRA_HEALTH_V1_SERVICE: &str = "v1.DRAResourceHealth";
/// `PluginInfo.supported_versions` entry for the [`dra_health::v1alpha1`] service.
pub const DRA_HEALTH_V1ALPHA1_SERVICE: &str = "v1alpha1.DRAResourceHealth";

/// The API version a plugin sends in `RegisterRequest.version`.
pub const VERSION: &str = "v1beta1";
/// The health value of a usable device.
pub const HEALTHY: &str = "Healthy";
/// The health value of an unusable device.
pub const UNHEALTHY: &str = "Unhealthy";
/// kubelet's registration socket, inside the device-plugins directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// The device-plugins directory on a node.
pub const DEFAULT_KUBELET_DIR: &str = "/var/lib/kubelet/device-plugins";

/// `PluginInfo.type` of a DRA driver's kubelet plugin.
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";
/// `PluginInfo.supported_versions` entry for the [`dra::v1`] service.
pub const DRA_V1_SERVICE: &str = "v1.DRAPlugin";
/// `PluginInfo.supported_versions` entry for the [`dra::v1beta1`] service.
pub const DRA_V1BETA1_SERVICE: &str = "v1beta1.DRAPlugin";
/// The directory kubelet's plugin watcher scans for registration sockets.
pub const DEFAULT_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// The directory under which plugins keep their service sockets
/// (`<dir>/<driver>/dra.sock` for a DRA driver).
pub const DEFAULT_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// A DRA driver's registration socket name in the registry directory:
/// `<driver>-reg.sock`.
pub const DRA_REGISTRATION_SUFFIX: &str = "-reg.sock";
/// A DRA driver's service socket name inside `<plugins dir>/<driver>/`.
pub const DRA_SERVICE_SOCKET: &str = "dra.sock";

/// A gRPC channel over the Unix socket at `path`, the transport of every service
/// here, sending `:authority` `localhost` (as kubelet's device manager does).
pub async fn unix_channel(
    path: impl Into<std::path::PathBuf>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = path.into();
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
}

/// A gRPC channel over `stream`, a connection already made (so the caller can
/// check what it connected to before sending anything), sending `:authority`
/// `localhost` like [`unix_channel`]. The channel does not reconnect: once the
/// connection is gone, calls fail.
pub async fn unix_channel_over(
    stream: tokio::net::UnixStream,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let stream = std::sync::Arc::new(std::sync::Mutex::new(Some(stream)));
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let taken = stream.lock().ok().and_then(|mut s| s.take());
            async move {
                let stream = taken.ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::NotConnected,
                        "the one connection of this channel is gone",
                    )
                })?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
}

/// A gRPC channel over the Unix socket at `path` whose every request carries
/// `authority` as its `:authority`, valid URI authority or not
/// ([`authority::SendAuthority`]): how a test peer sends what grpc-go sends.
pub async fn unix_channel_with_authority(
    path: impl Into<std::path::PathBuf>,
    authority: &str,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let path = path.into();
    let authority = authority.to_owned();
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            let authority = authority.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    authority::SendAuthority::new(stream, &authority),
                ))
            }
        }))
        .await
}
