//! The `kubelet-peer dra` commands against a small in-process DRA plugin that
//! serves registration and the v1 service only: the JSON they print, and their exit
//! codes (0 all claims fine, 1 a claim failed, 2 any other error).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kubelet_api::dra::v1;
use kubelet_api::pluginregistration::registration_server::{Registration, RegistrationServer};
use kubelet_api::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};
use tokio::sync::mpsc;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

struct Reg {
    endpoint: PathBuf,
    notified: mpsc::UnboundedSender<RegistrationStatus>,
    /// How many `GetInfo` calls still stall past kubelet's 1 s timeout (a
    /// plugin that has bound its socket but is not answering yet).
    stalls: AtomicUsize,
}

#[tonic::async_trait]
impl Registration for Reg {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        let stall = self
            .stalls
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if stall {
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        Ok(Response::new(PluginInfo {
            r#type: "DRAPlugin".into(),
            name: "example.com".into(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: vec!["v1.DRAPlugin".into(), "v1beta1.DRAPlugin".into()],
        }))
    }

    async fn notify_registration_status(
        &self,
        r: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let _ = self.notified.send(r.into_inner());
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// Prepares a claim into one device; a claim named `fail…` fails. Unprepare always
/// succeeds but leaves out claims named `skip…`.
struct Plugin;

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        r: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let claims = r
            .into_inner()
            .claims
            .into_iter()
            .map(|c| {
                let a = if c.name.starts_with("fail") {
                    v1::NodePrepareResourceResponse {
                        devices: vec![],
                        error: format!("cannot prepare {}", c.name),
                    }
                } else {
                    v1::NodePrepareResourceResponse {
                        devices: vec![v1::Device {
                            request_names: vec!["vm".into()],
                            pool_name: "node-a".into(),
                            device_name: "pci-0000-01-00-0".into(),
                            cdi_device_ids: vec![format!("example.com/vfio={}", c.uid)],
                        }],
                        error: String::new(),
                    }
                };
                (c.uid, a)
            })
            .collect();
        Ok(Response::new(v1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        r: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        let claims = r
            .into_inner()
            .claims
            .into_iter()
            .filter(|c| !c.name.starts_with("skip"))
            .map(|c| (c.uid, v1::NodeUnprepareResourceResponse::default()))
            .collect();
        Ok(Response::new(v1::NodeUnprepareResourcesResponse { claims }))
    }
}

fn serve(dir: &Path) -> mpsc::UnboundedReceiver<RegistrationStatus> {
    serve_stalling(dir, 0)
}

/// [`serve`], its first `stalls` `GetInfo` calls answered too late.
fn serve_stalling(dir: &Path, stalls: usize) -> mpsc::UnboundedReceiver<RegistrationStatus> {
    let registry = dir.join("registry");
    let plugins = dir.join("plugins/example.com");
    std::fs::create_dir_all(&registry).unwrap();
    std::fs::create_dir_all(&plugins).unwrap();
    let endpoint = plugins.join("dra.sock");
    let (tx, rx) = mpsc::unbounded_channel();
    let reg = tokio::net::UnixListener::bind(registry.join("example.com-reg.sock")).unwrap();
    let dra = tokio::net::UnixListener::bind(&endpoint).unwrap();
    // As the real driver does (`kubelet_api::serve`): kubelet's plugin watcher
    // sends the percent-encoded socket path as :authority, which h2 alone refuses.
    std::mem::forget(kubelet_api::serve::spawn(
        reg,
        Server::builder().add_service(RegistrationServer::new(Reg {
            endpoint,
            notified: tx,
            stalls: AtomicUsize::new(stalls),
        })),
        "registration",
    ));
    std::mem::forget(kubelet_api::serve::spawn(
        dra,
        Server::builder().add_service(v1::dra_plugin_server::DraPluginServer::new(Plugin)),
        "dra",
    ));
    rx
}

async fn peer(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_kubelet-peer"))
            .args(args)
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

fn args(dir: &Path, rest: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = vec!["dra".into(), rest[0].into()];
    a.push("--registry".into());
    a.push(dir.join("registry").display().to_string());
    a.extend(rest[1..].iter().map(|s| s.to_string()));
    a
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).trim_end().to_string()
}

#[tokio::test]
async fn dra_commands_register_prepare_and_unprepare_like_kubelet() {
    let dir = tempfile::tempdir().unwrap();
    let mut notified = serve(dir.path());
    let endpoint = dir.path().join("plugins/example.com/dra.sock");

    let o = peer(args(dir.path(), &["register", "--timeout", "2s"])).await;
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    assert_eq!(
        stdout(&o),
        format!(
            r#"{{"socket":"{}","type":"DRAPlugin","name":"example.com","endpoint":"{}","supported_versions":["v1.DRAPlugin","v1beta1.DRAPlugin"],"chosen":"v1"}}"#,
            dir.path().join("registry/example.com-reg.sock").display(),
            endpoint.display()
        )
    );
    let status = notified.recv().await.unwrap();
    assert!(status.plugin_registered && status.error.is_empty());

    let o = peer(args(
        dir.path(),
        &[
            "prepare",
            "--claim",
            "ns/vm/uid-2",
            "--claim",
            "ns/vm/uid-1",
        ],
    ))
    .await;
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    assert_eq!(
        stdout(&o),
        r#"{"claims":{"uid-1":{"devices":[{"request_names":["vm"],"pool_name":"node-a","device_name":"pci-0000-01-00-0","cdi_device_ids":["example.com/vfio=uid-1"]}],"error":""},"uid-2":{"devices":[{"request_names":["vm"],"pool_name":"node-a","device_name":"pci-0000-01-00-0","cdi_device_ids":["example.com/vfio=uid-2"]}],"error":""}}}"#
    );

    let o = peer(args(
        dir.path(),
        &["prepare", "--version", "v1", "--claim", "ns/fail-me/uid-3"],
    ))
    .await;
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert_eq!(
        stdout(&o),
        r#"{"claims":{"uid-3":{"devices":[],"error":"cannot prepare fail-me"}}}"#
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("claim uid-3: cannot prepare fail-me"));

    let o = peer(args(
        dir.path(),
        &[
            "unprepare",
            "--claim",
            "ns/vm/uid-1",
            "--claim",
            "ns/skip/uid-4",
        ],
    ))
    .await;
    assert_eq!(o.status.code(), Some(1), "a claim left out fails: {o:?}");
    assert_eq!(stdout(&o), r#"{"claims":{"uid-1":{"error":""}}}"#);
    assert!(String::from_utf8_lossy(&o.stderr).contains("claim uid-4 left out of the answer"));

    // The plugin lists v1beta1 but does not serve it: a gRPC error, not a verdict.
    let o = peer(args(
        dir.path(),
        &[
            "unprepare",
            "--version",
            "v1beta1",
            "--claim",
            "ns/vm/uid-1",
        ],
    ))
    .await;
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(stdout(&o).is_empty());

    let o = peer(args(dir.path(), &["prepare", "--claim", "not-a-claim"])).await;
    assert_eq!(o.status.code(), Some(2), "{o:?}");
}

#[tokio::test]
async fn dra_register_gives_up_when_no_socket_appears() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("registry")).unwrap();
    std::fs::write(dir.path().join("registry/file-reg.sock"), "").unwrap();
    let o = peer(args(dir.path(), &["register", "--timeout", "200ms"])).await;
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no *-reg.sock socket in"),
        "{o:?}"
    );
}

/// A plugin whose first two `GetInfo` calls time out is registered at the
/// reconciler's later passes, as kubelet would (a failed registration may run
/// again after 500 ms, then 1 s, at its next pass, one a second), and is told
/// so once.
#[tokio::test]
async fn dra_register_tries_again_as_kubelets_reconciler_does() {
    let dir = tempfile::tempdir().unwrap();
    let mut notified = serve_stalling(dir.path(), 2);
    let started = std::time::Instant::now();
    let o = peer(args(dir.path(), &["register", "--timeout", "10s"])).await;
    let took = started.elapsed();
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.matches("trying again in").count(), 2, "{err}");
    assert!(
        err.contains("failed to get plugin info using RPC GetInfo"),
        "{err}"
    );
    // The first attempt times out at 1 s and may run again after 1.5 s: the
    // pass at 2 s; the second times out at 3 s and may run again after 4 s:
    // the pass at 4 s registers.
    assert!(took >= Duration::from_secs(4), "{took:?}");
    let status = notified.recv().await.unwrap();
    assert!(status.plugin_registered, "{status:?}");
    assert!(notified.try_recv().is_err(), "told once");
}

/// A plugin that never answers in time is given up on when the timeout ends,
/// with the last error and how many attempts were made.
#[tokio::test]
async fn dra_register_gives_up_on_a_plugin_that_never_answers() {
    let dir = tempfile::tempdir().unwrap();
    let _notified = serve_stalling(dir.path(), usize::MAX);
    let o = peer(args(dir.path(), &["register", "--timeout", "3s"])).await;
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("not registered within 3s (2 attempts)"),
        "{err}"
    );
    assert!(err.contains("GetInfo"), "{err}");
}
