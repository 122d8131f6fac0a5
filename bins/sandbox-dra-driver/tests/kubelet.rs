//! The real driver binary against the kubelet-like peer playing kubelet's DRA side
//! as a process of its own (`kubelet_peer::manager`): registration over the
//! percent-encoded socket path, prepare and unprepare driven by pods on both DRA
//! versions, the peer's restart re-sending prepare, its slice wipes, and
//! de-registration when the driver stops.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kubelet_peer::dra::{KubeletVersion, Version};
use kubelet_peer::manager::{self, Event, Pod};
use serde_json::json;
use tokio::sync::mpsc;

const CARD: &str = "0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a";
const POD_A: &str = "a1a1a1a1-0000-4000-8000-00000000000a";
const POD_B: &str = "b2b2b2b2-0000-4000-8000-00000000000b";

/// The peer as a task: its events, and a restart that keeps its state directory.
struct Peer {
    config: manager::Config,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    events: mpsc::UnboundedReceiver<Event>,
    seen: Vec<Event>,
}

impl Peer {
    fn start(
        scene: &Scene,
        server: &fake_apiserver::FakeApiServer,
        kubelet: KubeletVersion,
        wiping_delay: Duration,
    ) -> Self {
        let config = manager::Config {
            registry: scene.registry_dir(),
            api: server.url(),
            node: NODE.into(),
            state_dir: scene.root().join("kubelet"),
            pods: scene.root().join("pods.json"),
            kubelet,
            wiping_delay,
            poll: Duration::from_millis(20),
        };
        let (tx, events) = mpsc::unbounded_channel();
        let task = tokio::spawn(manager::run(config.clone(), tx));
        Self {
            config,
            task,
            events,
            seen: vec![],
        }
    }

    /// Kills it and starts it again on the same state directory.
    fn restart(&mut self) {
        self.task.abort();
        let (tx, events) = mpsc::unbounded_channel();
        self.events = events;
        self.task = tokio::spawn(manager::run(self.config.clone(), tx));
    }

    fn pods(&self, pods: &[Pod]) {
        manager::write_pods(&self.config.pods, pods).unwrap();
    }

    /// An event `f` picks among those already seen, else the next one.
    async fn seen_or_wait(&mut self, what: &str, mut f: impl FnMut(&Event) -> bool) -> Event {
        match self.seen.iter().find(|e| f(e)) {
            Some(e) => e.clone(),
            None => self.wait(what, f).await,
        }
    }

    /// The startup wipe (which races with the first registration, as upstream's
    /// background wipe does), then the driver's slice back.
    async fn startup_wiped(&mut self, server: &fake_apiserver::FakeApiServer) {
        self.seen_or_wait(
            "the startup wipe",
            |e| matches!(e, Event::Wiped { reason, .. } if reason == "startup"),
        )
        .await;
        let start = Instant::now();
        while slices(server).len() != 1 {
            assert!(start.elapsed() < WAIT, "no slice after the startup wipe");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The next event `f` picks, within [`WAIT`].
    async fn wait(&mut self, what: &str, mut f: impl FnMut(&Event) -> bool) -> Event {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.events.recv()).await {
                Ok(Some(e)) => {
                    self.seen.push(e.clone());
                    if f(&e) {
                        return e;
                    }
                }
                _ => panic!("no {what} within {WAIT:?}; events: {:#?}", self.seen),
            }
        }
    }
}

fn pod(uid: &str, name: &str, claims: &[&str]) -> Pod {
    Pod {
        uid: uid.into(),
        namespace: NS.into(),
        name: name.into(),
        claims: claims.iter().map(|c| c.to_string()).collect(),
    }
}

/// A claim allocated to our driver and reserved for `pods`.
fn put_reserved(
    server: &fake_apiserver::FakeApiServer,
    name: &str,
    uid: &str,
    results: &[fake_apiserver::objects::DeviceResult],
    pods: &[(&str, &str)],
) {
    put_claim(server, name, uid, Some(results), None);
    let path = fake_apiserver::paths::resourceclaim(NS, name);
    let mut claim = server.get(&path).unwrap();
    claim["status"]["reservedFor"] = pods
        .iter()
        .map(|(n, u)| json!({"resource": "pods", "name": n, "uid": u}))
        .collect();
    server.put(&path, claim);
}

fn card(server: &fake_apiserver::FakeApiServer, pods: &[(&str, &str)]) {
    put_reserved(
        server,
        "vm-card",
        CARD,
        &[
            ours("card", "pci-0000-01-00-0"),
            ours("card", "pci-0000-01-00-1"),
        ],
        pods,
    );
}

async fn slices_back(
    driver: &mut Driver,
    server: &fake_apiserver::FakeApiServer,
    within: Duration,
) {
    let start = Instant::now();
    driver
        .wait_until("the ResourceSlice", || slices(server).len() == 1)
        .await;
    assert!(
        start.elapsed() < within,
        "slices back after {:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn the_peer_wipes_the_nodes_slices_at_start_and_the_driver_restores_them() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene
        .start_with(
            &server,
            &[("VFIO_SANDBOX_LOG_LEVEL", "debug,kubelet_api=trace")],
        )
        .await;
    driver
        .wait_until("the ResourceSlice", || slices(&server).len() == 1)
        .await;
    let mut peer = Peer::start(
        &scene,
        &server,
        KubeletVersion::V1_34,
        manager::DEFAULT_WIPING_DELAY,
    );
    let wiped = peer
        .wait(
            "the startup wipe",
            |e| matches!(e, Event::Wiped { reason, .. } if reason == "startup"),
        )
        .await;
    let Event::Wiped {
        field_selector,
        deleted,
        ..
    } = wiped
    else {
        unreachable!()
    };
    assert_eq!(field_selector, format!("spec.nodeName={NODE}"));
    assert_eq!(deleted.len(), 1, "the driver's slice was deleted");
    slices_back(&mut driver, &server, Duration::from_secs(1)).await;
    let reg = peer
        .seen_or_wait("the registration", |e| {
            matches!(e, Event::Registered { .. })
        })
        .await;
    assert_eq!(
        reg,
        Event::Registered {
            socket: scene.registration_socket(),
            driver: DRIVER.into(),
            endpoint: scene.service_socket().display().to_string(),
            chosen: Some(Version::V1),
        }
    );
    // kubelet's plugin watcher sent the socket path, percent-encoded.
    let encoded = kubelet_peer::grpcgo::path_authority(&scene.registration_socket());
    assert!(encoded.starts_with("%2F"), "{encoded}");
    driver
        .wait_until("the rewritten :authority in the log", || {
            let log = driver_log(&scene);
            log.contains("rewrote :authority") && log.contains(&encoded)
        })
        .await;
    // The request went where kubelet sends it.
    let wipes: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|(m, p)| m == "DELETE" && p.contains("resourceslices"))
        .collect();
    assert!(
        wipes.iter().any(|(_, p)| p
            == &format!(
                "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{NODE}"
            )),
        "{wipes:?}"
    );
}

/// The driver logs of this scene, all of them.
fn driver_log(scene: &Scene) -> String {
    let mut out = String::new();
    for e in std::fs::read_dir(scene.root()).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("driver-") && name.ends_with(".log") {
            out.push_str(&std::fs::read_to_string(e.path()).unwrap_or_default());
        }
    }
    out
}

async fn prepare_and_unprepare_as(kubelet: KubeletVersion, version: Version) {
    let scene = Scene::new();
    let server = cluster();
    let _driver = scene
        .start_with(
            &server,
            &[("VFIO_SANDBOX_LOG_LEVEL", "debug,kubelet_api=trace")],
        )
        .await;
    card(&server, &[("vm-a", POD_A)]);
    let mut peer = Peer::start(&scene, &server, kubelet, manager::DEFAULT_WIPING_DELAY);
    let reg = peer
        .wait("the registration", |e| {
            matches!(e, Event::Registered { .. })
        })
        .await;
    assert!(
        matches!(reg, Event::Registered { chosen: Some(v), .. } if v == version),
        "{reg:?}"
    );
    peer.pods(&[pod(POD_A, "vm-a", &["vm-card"])]);
    let prepared = peer
        .wait("the prepare", |e| matches!(e, Event::Prepared { .. }))
        .await;
    let Event::Prepared {
        version: used,
        claims,
        answer,
        ..
    } = prepared
    else {
        unreachable!()
    };
    assert_eq!(used, version);
    assert_eq!(claims, [claim_ref("vm-card", CARD)]);
    let got = &answer.claims[CARD];
    assert_eq!(got.error, "");
    let mut names: Vec<_> = got.devices.iter().map(|d| d.device_name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["pci-0000-01-00-0", "pci-0000-01-00-1"]);
    peer.wait("the pod ready", |e| matches!(e, Event::PodReady { .. }))
        .await;
    assert!(scene.cdi_spec(CARD).exists());
    // kubelet's checkpoint holds the claim and its devices.
    let cp: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(scene.root().join("kubelet/dra_manager_state")).unwrap(),
    )
    .unwrap();
    assert!(cp["Data"].as_str().unwrap().contains(CARD), "{cp}");

    peer.pods(&[]);
    let un = peer
        .wait("the unprepare", |e| matches!(e, Event::Unprepared { .. }))
        .await;
    let Event::Unprepared {
        version: used,
        answer,
        ..
    } = un
    else {
        unreachable!()
    };
    assert_eq!(used, version);
    assert_eq!(answer.claims[CARD].error, "");
    peer.wait("the pod gone", |e| matches!(e, Event::PodGone { .. }))
        .await;
    assert!(!scene.cdi_spec(CARD).exists());
    // Which :authority the DRA calls carried: 1.32 the percent-encoded path
    // (rewritten by the driver), 1.34 localhost.
    let svc = kubelet_peer::grpcgo::path_authority(&scene.service_socket());
    let log = driver_log(&scene);
    assert_eq!(
        log.contains(&svc),
        kubelet == KubeletVersion::V1_32,
        "dra.sock authority {svc} in the log: {log}"
    );
}

#[tokio::test]
async fn kubelet_1_34_prepares_and_unprepares_over_v1() {
    prepare_and_unprepare_as(KubeletVersion::V1_34, Version::V1).await;
}

#[tokio::test]
async fn kubelet_1_32_prepares_and_unprepares_over_v1beta1() {
    prepare_and_unprepare_as(KubeletVersion::V1_32, Version::V1beta1).await;
}

#[tokio::test]
async fn a_restarted_peer_sends_prepare_again_and_the_driver_answers_the_same() {
    let scene = Scene::new();
    let server = cluster();
    let _driver = scene.start(&server).await;
    card(&server, &[("vm-a", POD_A), ("vm-b", POD_B)]);
    let mut peer = Peer::start(
        &scene,
        &server,
        KubeletVersion::V1_34,
        manager::DEFAULT_WIPING_DELAY,
    );
    peer.pods(&[
        pod(POD_A, "vm-a", &["vm-card"]),
        pod(POD_B, "vm-b", &["vm-card"]),
    ]);
    let first = peer
        .wait("the prepare", |e| matches!(e, Event::Prepared { .. }))
        .await;
    let Event::Prepared { answer: before, .. } = first else {
        unreachable!()
    };
    for _ in 0..2 {
        peer.wait("a pod ready", |e| matches!(e, Event::PodReady { .. }))
            .await;
    }

    peer.restart();
    let started = peer
        .wait("the restart", |e| matches!(e, Event::Started { .. }))
        .await;
    assert_eq!(
        started,
        Event::Started {
            kubelet: KubeletVersion::V1_34,
            restored: vec![CARD.into()]
        },
        "the claim comes back from kubelet's checkpoint, not prepared"
    );
    let again = peer
        .wait("prepare re-sent", |e| matches!(e, Event::Prepared { .. }))
        .await;
    let Event::Prepared { claims, answer, .. } = again else {
        unreachable!()
    };
    assert_eq!(claims, [claim_ref("vm-card", CARD)]);
    assert_eq!(
        answer, before,
        "the driver answers a repeated prepare the same"
    );
    for _ in 0..2 {
        peer.wait("a pod ready", |e| matches!(e, Event::PodReady { .. }))
            .await;
    }

    // A pod naming the same claim twice: kubelet sends it twice in one request,
    // gets one answer for it, and counts the other as skipped.
    peer.pods(&[pod(POD_A, "vm-a", &["vm-card", "vm-card"])]);
    peer.restart();
    let twice = peer
        .wait(
            "prepare with the claim twice",
            |e| matches!(e, Event::Prepared { claims, .. } if claims.len() == 2),
        )
        .await;
    let Event::Prepared { claims, answer, .. } = twice else {
        unreachable!()
    };
    assert_eq!(
        claims,
        [claim_ref("vm-card", CARD), claim_ref("vm-card", CARD)]
    );
    assert_eq!(answer, before, "answered once, the same");
    let failed = peer
        .wait("kubelet's verdict", |e| {
            matches!(e, Event::PrepareFailed { .. } | Event::PodReady { .. })
        })
        .await;
    assert!(
        matches!(&failed, Event::PrepareFailed { error, .. } if error.ends_with("NodePrepareResources skipped 1 ResourceClaims")),
        "{failed:?}"
    );
}

#[tokio::test]
async fn the_driver_stopping_deregisters_it_and_its_slices_go_after_the_delay() {
    let scene = Scene::new();
    let server = cluster();
    let driver = scene.start(&server).await;
    let mut peer = Peer::start(
        &scene,
        &server,
        KubeletVersion::V1_34,
        Duration::from_millis(500),
    );
    peer.seen_or_wait("the registration", |e| {
        matches!(e, Event::Registered { .. })
    })
    .await;
    peer.seen_or_wait("the connection", |e| {
        matches!(
            e,
            Event::Connection {
                connected: true,
                ..
            }
        )
    })
    .await;
    peer.startup_wiped(&server).await;

    let (status, _) = driver.terminate().await;
    assert!(status.success());
    let gone = peer
        .wait("the de-registration", |e| {
            matches!(e, Event::Deregistered { .. })
        })
        .await;
    assert_eq!(
        gone,
        Event::Deregistered {
            socket: scene.registration_socket(),
            driver: DRIVER.into(),
            last: true
        }
    );
    let wiped = peer
        .wait(
            "the driver's wipe",
            |e| matches!(e, Event::Wiped { reason, .. } if reason == "driver-cleanup"),
        )
        .await;
    let Event::Wiped {
        field_selector,
        deleted,
        ..
    } = wiped
    else {
        unreachable!()
    };
    assert_eq!(
        field_selector,
        format!("spec.driver={DRIVER},spec.nodeName={NODE}")
    );
    assert_eq!(deleted.len(), 1);
    assert!(slices(&server).is_empty());

    // Back: registered again, and it publishes again.
    let mut driver = scene.start(&server).await;
    peer.wait("the new registration", |e| {
        matches!(e, Event::Registered { .. })
    })
    .await;
    slices_back(&mut driver, &server, WAIT).await;
}

#[tokio::test]
async fn kubelet_1_32_cancels_the_wipe_when_the_driver_comes_back_in_time() {
    let scene = Scene::new();
    let server = cluster();
    let driver = scene.start(&server).await;
    let mut peer = Peer::start(
        &scene,
        &server,
        KubeletVersion::V1_32,
        Duration::from_secs(5),
    );
    peer.seen_or_wait("the registration", |e| {
        matches!(e, Event::Registered { .. })
    })
    .await;
    peer.startup_wiped(&server).await;
    driver.terminate().await;
    peer.wait("the de-registration", |e| {
        matches!(e, Event::Deregistered { last: true, .. })
    })
    .await;
    peer.wait("the wipe scheduled", |e| {
        matches!(e, Event::WipeScheduled { .. })
    })
    .await;
    let _driver = scene.start(&server).await;
    peer.wait("the new registration", |e| {
        matches!(e, Event::Registered { .. })
    })
    .await;
    let next = peer
        .wait("the cancel", |e| {
            matches!(e, Event::WipeCancelled { .. } | Event::Wiped { .. })
        })
        .await;
    assert_eq!(
        next,
        Event::WipeCancelled {
            driver: DRIVER.into()
        }
    );
    // No wipe on (re-)registration: the slice is still there.
    assert_eq!(slices(&server).len(), 1);
}
