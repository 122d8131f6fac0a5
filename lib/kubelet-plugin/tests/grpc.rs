//! The kubelet-facing side over real Unix sockets: the kubelet-like peer registers
//! the plugin and calls both DRA versions; the claims are read from a stand-in API
//! server; the driver behind the plugin is a recording double.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fake_apiserver::objects::{self, DeviceResult};
use fake_apiserver::{paths, FakeApiServer};
use kubelet_peer::dra::{self, ClaimRef, Dra, PreparedDevice, Version};
use kubelet_plugin::{Answers, Claim, Clients, Config, KeptFields, Offer, Plugin, ServeError};
use tokio::sync::oneshot;

const DRIVER: &str = "vfio-sandbox.rebellions.ai";
const NODE: &str = "node-a";
const WAIT: Duration = Duration::from_secs(5);

/// Prepares a claim into one device named after it; a claim whose name starts with
/// `fail` fails. Records every call's claims.
#[derive(Default)]
struct Recorder {
    prepared: Mutex<Vec<Vec<ClaimRef>>>,
    unprepared: Mutex<Vec<Vec<ClaimRef>>>,
}

/// The recorder's refusal, said as is.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Refusal(String);

fn device(c: &ClaimRef) -> PreparedDevice {
    PreparedDevice {
        request_names: vec!["vm".into()],
        pool_name: NODE.into(),
        device_name: format!("pci-0000-01-00-{}", c.name.len() % 8),
        cdi_device_ids: vec![
            format!("rebellions.ai/vfio={}", c.uid),
            format!("k8s.{DRIVER}/claim={}", c.uid),
        ],
    }
}

/// The claim as the peer (kubelet) names it, from the plugin's own type.
fn as_sent(c: &kubelet_plugin::ClaimRef) -> ClaimRef {
    ClaimRef {
        uid: c.uid.clone(),
        namespace: c.namespace.clone(),
        name: c.name.clone(),
    }
}

#[tonic::async_trait]
impl kubelet_plugin::Driver for Recorder {
    type Error = Refusal;

    async fn prepare(
        &self,
        claims: Vec<Claim>,
        _deadline: tokio::time::Instant,
    ) -> Answers<Vec<kubelet_plugin::PreparedDevice>, Refusal> {
        self.prepared
            .lock()
            .unwrap()
            .push(claims.iter().map(|c| as_sent(&c.reference)).collect());
        claims
            .iter()
            .map(|c| {
                let c = &c.reference;
                let r = if c.name.starts_with("fail") {
                    Err(Refusal(format!(
                        "cannot prepare {}/{}",
                        c.namespace, c.name
                    )))
                } else {
                    let d = device(&as_sent(c));
                    Ok(vec![kubelet_plugin::PreparedDevice {
                        request_names: d.request_names,
                        pool_name: d.pool_name,
                        device_name: d.device_name,
                        cdi_device_ids: d.cdi_device_ids,
                    }])
                };
                (c.uid.clone(), r)
            })
            .collect()
    }

    async fn unprepare(
        &self,
        claims: Vec<kubelet_plugin::ClaimRef>,
        _deadline: tokio::time::Instant,
    ) -> Answers<(), Refusal> {
        self.unprepared
            .lock()
            .unwrap()
            .push(claims.iter().map(as_sent).collect());
        claims
            .iter()
            .map(|c| {
                let r = if c.name.starts_with("fail") {
                    Err(Refusal(format!("/dev/vfio/5 of {} is still open", c.name)))
                } else {
                    Ok(())
                };
                (c.uid.clone(), r)
            })
            .collect()
    }

    fn devices(&self, _fields: KeptFields) -> Result<Offer, Refusal> {
        Ok(Offer::default())
    }
}

/// Stores each claim on the server, allocated one device of ours on this node.
fn put(server: &FakeApiServer, claims: &[ClaimRef]) {
    for c in claims.iter().filter(|c| !c.uid.is_empty()) {
        let results = [DeviceResult::new("vm", DRIVER, NODE, "pci-0000-01-00-0")];
        server.put(
            &paths::resourceclaim(&c.namespace, &c.name),
            objects::resource_claim(&c.namespace, &c.name, &c.uid, Some(&results)),
        );
    }
}

/// The plugin's settings in `dir`.
fn config(dir: &Path) -> Config {
    config_with(|c| {
        c.registry_dir = dir.join("plugins_registry");
        c.plugins_dir = dir.join("plugins");
    })
}

/// The defaults for this driver and node, changed by `change`.
fn config_with(change: impl FnOnce(&mut Config)) -> Config {
    let mut config = Config::new(DRIVER, NODE);
    change(&mut config);
    config
}

/// A plugin on `server`.
fn plugin(cfg: Config, server: &FakeApiServer) -> Plugin {
    let client = kube::Client::try_from(kube::Config::new(server.url().parse().unwrap())).unwrap();
    Plugin::new(cfg, Clients::new(client)).unwrap()
}

/// A served driver in a scratch directory.
struct Served {
    _dir: tempfile::TempDir,
    server: FakeApiServer,
    cfg: Config,
    driver: Arc<Recorder>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), ServeError>>,
}

impl Served {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path());
        let server = FakeApiServer::start().unwrap();
        let plugin = plugin(cfg.clone(), &server);
        let driver = Arc::new(Recorder::default());
        let (stop, stopped) = oneshot::channel::<()>();
        let serving = driver.clone();
        let task = tokio::spawn(async move {
            plugin
                .serve(serving, async {
                    let _ = stopped.await;
                })
                .await
        });
        wait_for(&cfg.registration_socket(), WAIT).await;
        Served {
            _dir: dir,
            server,
            cfg,
            driver,
            stop: Some(stop),
            task,
        }
    }

    async fn client(&self, version: Version) -> Dra {
        Dra::connect(&self.cfg.service_socket(), version)
            .await
            .unwrap()
    }

    async fn stop(mut self) -> Result<(), ServeError> {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(WAIT, &mut self.task)
            .await
            .expect("serve stops")
            .expect("serve task")
    }
}

/// Waits until `path` exists; how long that took.
async fn wait_for(path: &Path, timeout: Duration) -> Duration {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            start.elapsed() < timeout,
            "{} did not appear within {timeout:?}",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    start.elapsed()
}

fn claim(ns: &str, name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        uid: uid.into(),
        namespace: ns.into(),
        name: name.into(),
    }
}

#[tokio::test]
async fn the_peer_finds_the_registration_socket_and_gets_exact_plugin_info() {
    let s = Served::start().await;
    let r = dra::register(&s.cfg.registry_dir, WAIT).await.unwrap();
    assert_eq!(r.socket, s.cfg.registration_socket());
    assert_eq!(
        r.socket.file_name().unwrap(),
        "vfio-sandbox.rebellions.ai-reg.sock"
    );
    assert_eq!(r.kind, "DRAPlugin");
    assert_eq!(r.name, DRIVER);
    assert_eq!(
        PathBuf::from(&r.endpoint),
        s.cfg
            .plugins_dir
            .join("vfio-sandbox.rebellions.ai/dra.sock")
    );
    assert_eq!(r.supported_versions, ["v1.DRAPlugin", "v1beta1.DRAPlugin"]);
    assert_eq!(r.chosen, Version::V1, "kubelet picks the first it knows");
    // kubelet also reports refusals; the plugin accepts those notifications too.
    dra::notify(
        &r.socket,
        kubelet_api::pluginregistration::RegistrationStatus {
            plugin_registered: false,
            error: "some reason".into(),
        },
    )
    .await
    .unwrap();
    s.stop().await.unwrap();
}

/// What grpc-go puts in `:authority` for a dial target that is a socket path
/// (grpc-go's `encodeAuthority`, as the kubelet-like peer reproduces it).
fn grpc_go_authority(path: &Path) -> String {
    kubelet_peer::grpcgo::path_authority(path)
}

/// kubelet's plugin watcher (`pkg/kubelet/pluginmanager/operationexecutor/
/// operation_generator.go`, `dial`) and kubelet 1.32's DRA client dial with grpc-go
/// and no authority override, so every call carries the percent-encoded socket
/// path as `:authority`; without the shared [`kubelet_api::serve`] layer the
/// HTTP/2 server resets each such call with PROTOCOL_ERROR.
#[tokio::test]
async fn calls_carrying_the_socket_path_as_authority_reach_every_service() {
    use kubelet_api::dra::{v1, v1beta1};
    use kubelet_api::pluginregistration::registration_client::RegistrationClient;
    let s = Served::start().await;
    let reg = s.cfg.registration_socket();
    let channel = kubelet_api::unix_channel_with_authority(&reg, &grpc_go_authority(&reg))
        .await
        .unwrap();
    let info = RegistrationClient::new(channel)
        .get_info(kubelet_api::pluginregistration::InfoRequest {})
        .await
        .expect("GetInfo with the socket path as :authority")
        .into_inner();
    assert_eq!(info.name, DRIVER);
    let svc = s.cfg.service_socket();
    let channel = kubelet_api::unix_channel_with_authority(&svc, &grpc_go_authority(&svc))
        .await
        .unwrap();
    let c = claim("ns", "c1", "uid-1");
    put(&s.server, std::slice::from_ref(&c));
    let r = v1::dra_plugin_client::DraPluginClient::new(channel.clone())
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1::Claim {
                namespace: c.namespace.clone(),
                uid: c.uid.clone(),
                name: c.name.clone(),
            }],
        })
        .await
        .expect("v1 prepare with the socket path as :authority")
        .into_inner();
    assert!(r.claims.contains_key("uid-1"));
    let r = v1beta1::dra_plugin_client::DraPluginClient::new(channel)
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
            claims: vec![v1beta1::Claim {
                namespace: c.namespace.clone(),
                uid: c.uid.clone(),
                name: c.name.clone(),
            }],
        })
        .await
        .expect("v1beta1 unprepare with the socket path as :authority")
        .into_inner();
    assert!(r.claims.contains_key("uid-1"));
    s.stop().await.unwrap();
}

#[tokio::test]
async fn prepare_and_unprepare_come_back_intact_over_both_versions() {
    let s = Served::start().await;
    let r = dra::register(&s.cfg.registry_dir, WAIT).await.unwrap();
    for version in Version::ALL {
        let ok = claim("vms", "gpu-claim", &format!("uid-ok-{version:?}"));
        let bad = claim("vms", "fail-claim", &format!("uid-bad-{version:?}"));
        let asked = [
            ok.clone(),
            bad.clone(),
            ok.clone(),
            claim("vms", "nouid", ""),
        ];
        put(&s.server, &asked);
        let mut client = Dra::connect(&r.endpoint_path(), version).await.unwrap();
        assert_eq!(client.version(), version);

        let before = s.driver.prepared.lock().unwrap().len();
        let answer = client.prepare(&asked).await.unwrap();
        let calls = s.driver.prepared.lock().unwrap()[before..].to_vec();
        assert_eq!(
            calls,
            [vec![ok.clone(), bad.clone()]],
            "one call, each uid once, no empty uid"
        );
        assert_eq!(answer.claims.len(), 3, "{answer:?}");
        assert_eq!(answer.claims[&ok.uid].devices, [device(&ok)]);
        assert_eq!(answer.claims[&ok.uid].error, "");
        assert!(answer.claims[&bad.uid].devices.is_empty());
        assert_eq!(
            answer.claims[&bad.uid].error,
            "cannot prepare vms/fail-claim"
        );
        assert_eq!(answer.claims[""].error, "claim vms/nouid has no uid");
        assert_eq!(
            answer.problems(&asked),
            [
                "claim : claim vms/nouid has no uid".to_string(),
                format!("claim {}: cannot prepare vms/fail-claim", bad.uid),
            ]
        );
        assert_eq!(
            answer.problems(std::slice::from_ref(&ok)).len(),
            2,
            "answers for claims not asked about"
        );
        let json = answer.to_json();
        assert!(
            json.starts_with(
                r#"{"claims":{"":{"devices":[],"error":"claim vms/nouid has no uid"},"#
            ),
            "{json}"
        );

        let answer = client.unprepare(&[ok.clone(), bad.clone()]).await.unwrap();
        assert_eq!(
            s.driver.unprepared.lock().unwrap().last().unwrap(),
            &vec![ok.clone(), bad.clone()]
        );
        assert_eq!(answer.claims.len(), 2);
        assert_eq!(answer.claims[&ok.uid].error, "");
        assert_eq!(
            answer.claims[&bad.uid].error,
            "/dev/vfio/5 of fail-claim is still open"
        );
        assert_eq!(
            answer.problems(&[ok.clone(), bad.clone()]),
            [format!(
                "claim {}: /dev/vfio/5 of fail-claim is still open",
                bad.uid
            )]
        );
        let ok_only = client.unprepare(std::slice::from_ref(&ok)).await.unwrap();
        assert!(ok_only.problems(std::slice::from_ref(&ok)).is_empty());
    }
    s.stop().await.unwrap();
}

#[tokio::test]
async fn a_thousand_claims_in_one_call_each_get_their_answer() {
    let s = Served::start().await;
    let claims: Vec<ClaimRef> = (0..1000)
        .map(|i| {
            let name = if i % 7 == 0 { "fail" } else { "vm" };
            claim("ns", &format!("{name}-{i}"), &format!("uid-{i:04}"))
        })
        .collect();
    put(&s.server, &claims);
    for version in Version::ALL {
        let mut client = s.client(version).await;
        let answer = client.prepare(&claims).await.unwrap();
        assert_eq!(answer.claims.len(), 1000);
        for c in &claims {
            let a = &answer.claims[&c.uid];
            if c.name.starts_with("fail") {
                assert_eq!(a.error, format!("cannot prepare ns/{}", c.name));
            } else {
                assert_eq!(a.devices, [device(c)], "{}", c.uid);
            }
        }
        assert_eq!(answer.problems(&claims).len(), 143);
        let answer = client.unprepare(&claims).await.unwrap();
        assert_eq!(answer.claims.len(), 1000);
    }
    let prepared = s.driver.prepared.lock().unwrap().clone();
    assert_eq!(prepared.len(), 2, "one driver call per request");
    assert!(prepared.iter().all(|c| c == &claims));
    s.stop().await.unwrap();
}

#[tokio::test]
async fn deleted_sockets_are_served_again_within_a_second() {
    let s = Served::start().await;
    let reg = s.cfg.registration_socket();
    dra::register(&s.cfg.registry_dir, WAIT).await.unwrap();

    std::fs::remove_file(&reg).unwrap();
    let took = wait_for(&reg, WAIT).await;
    assert!(
        took < Duration::from_secs(1),
        "registration socket back after {took:?}"
    );
    let r = dra::register(&s.cfg.registry_dir, WAIT).await.unwrap();
    assert_eq!(r.name, DRIVER);

    let service = s.cfg.service_socket();
    std::fs::remove_file(&service).unwrap();
    let took = wait_for(&service, WAIT).await;
    assert!(
        took < Duration::from_secs(1),
        "service socket back after {took:?}"
    );
    let c = claim("ns", "vm", "uid-1");
    put(&s.server, std::slice::from_ref(&c));
    let answer = s
        .client(Version::V1)
        .await
        .prepare(std::slice::from_ref(&c))
        .await
        .unwrap();
    assert_eq!(answer.claims[&c.uid].devices, [device(&c)]);

    // The whole plugins directory of the driver, as an operator's cleanup does.
    std::fs::remove_dir_all(service.parent().unwrap()).unwrap();
    let took = wait_for(&service, WAIT).await;
    assert!(
        took < Duration::from_secs(1),
        "service directory back after {took:?}"
    );
    // The registry directory, emptied by kubelet or an operator.
    std::fs::remove_dir_all(&s.cfg.registry_dir).unwrap();
    let took = wait_for(&reg, WAIT).await;
    assert!(
        took < Duration::from_secs(1),
        "registry directory back after {took:?}"
    );
    dra::register(&s.cfg.registry_dir, WAIT).await.unwrap();
    let answer = s
        .client(Version::V1beta1)
        .await
        .prepare(std::slice::from_ref(&c))
        .await
        .unwrap();
    assert_eq!(answer.claims[&c.uid].devices, [device(&c)]);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn shutdown_removes_our_sockets() {
    let s = Served::start().await;
    let (reg, service) = (s.cfg.registration_socket(), s.cfg.service_socket());
    assert!(service.exists());
    s.stop().await.unwrap();
    assert!(!reg.exists());
    assert!(!service.exists());
}

#[tokio::test]
async fn a_stale_socket_is_replaced_and_anything_else_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let server = FakeApiServer::start().unwrap();
    let plugin = plugin(cfg.clone(), &server);
    let driver = Arc::new(Recorder::default());

    // A socket left behind by a killed instance: replaced.
    std::fs::create_dir_all(&cfg.registry_dir).unwrap();
    drop(std::os::unix::net::UnixListener::bind(cfg.registration_socket()).unwrap());
    let (stop, stopped) = oneshot::channel::<()>();
    let serving = plugin.serve(driver.clone(), async {
        let _ = stopped.await;
    });
    let registering = async {
        let r = dra::register(&cfg.registry_dir, WAIT)
            .await
            .expect("registers over the replaced stale socket");
        stop.send(()).unwrap();
        r
    };
    let (served, r) = tokio::join!(serving, registering);
    served.unwrap();
    assert_eq!(r.name, DRIVER);

    // A regular file where a socket goes: refused, with the path, and kept.
    std::fs::write(cfg.registration_socket(), "not a socket").unwrap();
    let err = plugin.serve(driver.clone(), async {}).await.unwrap_err();
    let msg = support::error_chain(&err);
    assert!(msg.contains("not a socket"), "{msg}");
    assert!(msg.contains("a regular file"), "{msg}");
    assert!(
        msg.contains(&cfg.registration_socket().display().to_string()),
        "{msg}"
    );
    assert_eq!(
        std::fs::read_to_string(cfg.registration_socket()).unwrap(),
        "not a socket"
    );
    assert!(
        !cfg.service_socket().exists(),
        "a failed start leaves no service socket behind"
    );
    std::fs::remove_file(cfg.registration_socket()).unwrap();

    // A directory at the service socket path.
    std::fs::create_dir_all(cfg.service_socket()).unwrap();
    let err = plugin.serve(driver, async {}).await.unwrap_err();
    let msg = support::error_chain(&err);
    assert!(msg.contains("a directory, not a socket"), "{msg}");
    assert!(cfg.service_socket().is_dir());
}

#[test]
fn a_driver_name_must_be_one_path_component_and_a_node_named() {
    for bad in ["", ".", "..", "a/b", "x\0", "../escape"] {
        let e = Config::new(bad, NODE).check().unwrap_err();
        assert!(e.to_string().contains("one path component"), "{bad:?}: {e}");
    }
    assert!(Config::new(DRIVER, " ").check().is_err());
    let cfg = config_with(|c| {
        c.registry_dir = "/r".into();
        c.plugins_dir = "/p".into();
    });
    cfg.check().expect("valid");
    assert_eq!(
        cfg.registration_socket(),
        Path::new("/r/vfio-sandbox.rebellions.ai-reg.sock")
    );
    assert_eq!(
        cfg.service_socket(),
        Path::new("/p/vfio-sandbox.rebellions.ai/dra.sock")
    );
}

/// Either socket path past 107 bytes is refused by the configuration check, which
/// [`Plugin::new`] runs, naming the socket, the path, its length and the limit.
#[test]
fn a_socket_path_too_long_for_a_unix_socket_is_refused() {
    let deep = format!("/{}", "d".repeat(90));
    for (cfg, which) in [
        (
            config_with(|c| c.registry_dir = deep.clone().into()),
            "registration socket",
        ),
        (
            config_with(|c| c.plugins_dir = deep.clone().into()),
            "DRA service socket",
        ),
    ] {
        let path = if which.starts_with("registration") {
            cfg.registration_socket()
        } else {
            cfg.service_socket()
        };
        let e = cfg.check().unwrap_err().to_string();
        for part in [
            which,
            &path.display().to_string(),
            &format!("is {} bytes long", path.as_os_str().len()),
            "at most 107 bytes",
        ] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
    }
    // 107 bytes exactly is a socket path.
    let fits = config_with(|c| {
        let room = 107 - 1 - 1 - DRIVER.len() - "/dra.sock".len();
        c.plugins_dir = format!("/{}", "p".repeat(room)).into();
    });
    assert_eq!(fits.service_socket().as_os_str().len(), 107);
    fits.check().expect("107 bytes fit");
}

/// Not a NodePrepareResourcesRequest: field 1 holds bytes that do not decode as a
/// Claim.
#[derive(Clone, PartialEq, prost::Message)]
struct Garbage {
    #[prost(bytes = "vec", tag = "1")]
    claims: Vec<u8>,
}

#[tokio::test]
async fn a_request_that_is_not_protobuf_gets_a_grpc_error_and_the_server_lives_on() {
    let s = Served::start().await;
    let channel = kubelet_api::unix_channel(s.cfg.service_socket())
        .await
        .unwrap();
    for path in [
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
    ] {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        grpc.ready().await.unwrap();
        let codec = tonic_prost::ProstCodec::<
            Garbage,
            kubelet_api::dra::v1::NodePrepareResourcesResponse,
        >::default();
        let status = grpc
            .unary(
                tonic::Request::new(Garbage {
                    claims: vec![0xff, 0xff, 0xff, 0x0f, 0x12],
                }),
                path.parse().unwrap(),
                codec,
            )
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Internal, "{path}: {status:?}");
    }
    assert!(s.driver.prepared.lock().unwrap().is_empty());
    let c = claim("ns", "vm", "uid-after");
    put(&s.server, std::slice::from_ref(&c));
    let answer = s
        .client(Version::V1)
        .await
        .prepare(std::slice::from_ref(&c))
        .await
        .unwrap();
    assert_eq!(answer.claims[&c.uid].devices, [device(&c)]);
    s.stop().await.unwrap();
}
