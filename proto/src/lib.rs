//! The kubelet device-plugin API, version `v1beta1`, generated from our transcription
//! in `api.proto`: messages, the `Registration` service kubelet serves, and the
//! `DevicePlugin` service a plugin serves.

#![allow(missing_docs, clippy::all)]

/// Package `v1beta1`.
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

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

/// A gRPC channel over the Unix socket at `path`, the transport of both services.
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
