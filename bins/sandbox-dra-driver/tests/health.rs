//! Device health to kubelet (KEP-4680): the real `sandbox-dra-driver` on a fake node,
//! its `DRAResourceHealth` stream read by the kubelet-like peer as kubelet reads it
//! (the service picked from PluginInfo, the DRA endpoint's connection, the reports
//! merged into kubelet's cache).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::driver::*;
use common::*;
use kubelet_peer::dra::health::{pick_service, HealthCache, HealthStream, HealthVersion};
use kubelet_peer::dra::KubeletVersion;

/// Reads the stream until `f` holds for kubelet's cache; the cache then.
async fn until(
    stream: &mut HealthStream,
    cache: &mut HealthCache,
    what: &str,
    f: impl Fn(&HealthCache) -> bool,
) {
    let deadline = Instant::now() + WAIT;
    while !f(cache) {
        let left = deadline.saturating_duration_since(Instant::now());
        let next = tokio::time::timeout(left, stream.next())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}: {cache:?}"));
        let devices = next.expect("the stream stays open").expect("a response");
        cache.update(&devices, Instant::now());
    }
}

#[tokio::test]
async fn kubelet_sees_each_device_healthy_and_a_prepared_one_turn_unhealthy_with_why() {
    let scene = Scene::new();
    let server = cluster();
    let driver = scene.start(&server).await;
    let reg = register(&scene).await;
    assert_eq!(
        pick_service(&reg.supported_versions),
        Some(HealthVersion::V1)
    );
    for version in [HealthVersion::V1alpha1, HealthVersion::V1] {
        let mut stream = HealthStream::open(&reg.endpoint_path(), version, KubeletVersion::V1_34)
            .await
            .unwrap();
        let mut cache = HealthCache::default();
        until(&mut stream, &mut cache, "every device", |c| {
            c.devices.len() == 5
        })
        .await;
        // The card's two functions share IOMMU group 5: its group device too.
        let group = &cache.devices["node-a/group-0000-01-00-0"];
        assert_eq!(group.health, "Healthy", "{group:?}");
        assert_eq!(group.message, "all 2 functions healthy");
        for (key, d) in cache.devices.iter().filter(|(k, _)| !k.contains("group-")) {
            assert!(key.starts_with("node-a/pci-0000-0"), "{key}");
            assert_eq!(d.health, "Healthy", "{key}: {d:?}");
            assert_eq!(d.timeout_seconds, 60, "{key}");
            assert!(d.message.contains("ready to be prepared"), "{d:?}");
        }
    }
    // A prepared claim: its devices are on vfio-pci for a VM.
    let claim = put_v1_claim(&server);
    let mut client = scene.client(kubelet_peer::dra::Version::V1).await;
    let answers = prepare(&mut client, std::slice::from_ref(&claim)).await;
    assert_eq!(answers[&claim.uid], v1_answer());
    let mut stream = HealthStream::open(
        &reg.endpoint_path(),
        HealthVersion::V1,
        KubeletVersion::V1_34,
    )
    .await
    .unwrap();
    let mut cache = HealthCache::default();
    let card = "node-a/pci-0000-01-00-0";
    until(&mut stream, &mut cache, "the prepared card", |c| {
        c.devices
            .get(card)
            .is_some_and(|d| d.message.contains("for a VM"))
    })
    .await;
    // Its group node goes: Unhealthy at once (a /dev/vfio event), saying why.
    let node = scene.root().join("dev/vfio/5");
    let started = Instant::now();
    std::fs::remove_file(&node).unwrap();
    until(&mut stream, &mut cache, "the card unhealthy", |c| {
        c.health(card) == Some("Unhealthy")
    })
    .await;
    let took = started.elapsed();
    let d = &cache.devices[card];
    assert!(d.message.contains("/dev/vfio/5 is missing"), "{d:?}");
    assert!(d.message.contains("prepared for a VM"), "{d:?}");
    assert_eq!(cache.health("node-a/pci-0000-02-00-0"), Some("Healthy"));
    // The whole group is unhealthy with it, and says which function and why.
    let group = "node-a/group-0000-01-00-0";
    assert_eq!(cache.health(group), Some("Unhealthy"));
    let g = &cache.devices[group];
    assert!(g.message.contains("0000:01:00.0: "), "{g:?}");
    assert!(g.message.contains("/dev/vfio/5 is missing"), "{g:?}");
    // And back.
    std::fs::write(&node, "").unwrap();
    until(&mut stream, &mut cache, "the card healthy again", |c| {
        c.health(card) == Some("Healthy")
    })
    .await;
    assert!(took < Duration::from_secs(5), "{took:?}");
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(log.contains("device unhealthy"), "{log}");
}

/// kubelet's cache, as `healthinfo.go` keeps it: merged device by device, a device
/// not reported within its timeout turns Unknown with its message cleared.
#[test]
fn kubelets_cache_merges_and_times_out_as_kubelet_does() {
    use kubelet_peer::dra::health::WireDevice;
    let dev = |name: &str, health: i32, timeout: i64| WireDevice {
        pool: "node-a".into(),
        device: name.into(),
        health,
        last_updated_time: 1,
        timeout_seconds: timeout,
        message: "m".repeat(2000),
    };
    let t0 = Instant::now();
    let mut cache = HealthCache::default();
    let changed = cache.update(&[dev("a", 1, 0), dev("b", 2, 5)], t0);
    assert_eq!(changed, ["node-a/a", "node-a/b"]);
    assert_eq!(
        cache.devices["node-a/a"].timeout_seconds, 30,
        "kubelet's default"
    );
    assert_eq!(cache.devices["node-a/b"].message.chars().count(), 1024);
    assert!(cache.devices["node-a/b"].message.ends_with("..."));
    // Only `a` is reported again, 6 s later: `b` timed out.
    let changed = cache.update(&[dev("a", 1, 0)], t0 + Duration::from_secs(6));
    assert_eq!(changed, ["node-a/b"]);
    assert_eq!(cache.health("node-a/b"), Some("Unknown"));
    assert!(cache.devices["node-a/b"].message.is_empty());
    // An unknown enum value reads Unknown.
    cache.update(&[dev("a", 7, 0)], t0 + Duration::from_secs(7));
    assert_eq!(cache.health("node-a/a"), Some("Unknown"));
}

/// The taints of `device` in this node's slices (KEP-5055).
fn taints_of(server: &fake_apiserver::FakeApiServer, device: &str) -> Option<serde_json::Value> {
    slices(server).iter().find_map(|s| {
        s["spec"]["devices"]
            .as_array()?
            .iter()
            .find(|d| d["name"] == device)
            .map(|d| d["taints"].clone())
    })
}

#[tokio::test]
async fn a_flapping_device_costs_the_api_server_a_few_writes_a_second() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start(&server).await;
    let _reg = register(&scene).await;
    driver
        .wait_until("the slice", || {
            taints_of(&server, "pci-0000-01-00-0").is_some()
        })
        .await;
    let claim = put_v1_claim(&server);
    let mut client = scene.client(kubelet_peer::dra::Version::V1).await;
    prepare(&mut client, std::slice::from_ref(&claim)).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let node = scene.root().join("dev/vfio/5");
    server.clear_requests();
    const FLAP: Duration = Duration::from_secs(4);
    let started = Instant::now();
    let mut flips = 0;
    while started.elapsed() < FLAP {
        if flips % 2 == 0 {
            std::fs::remove_file(&node).unwrap();
        } else {
            std::fs::write(&node, "").unwrap();
        }
        flips += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Settled unhealthy: the node stays gone.
    if node.exists() {
        std::fs::remove_file(&node).unwrap();
    }
    let settled = Instant::now();
    driver
        .wait_until("the card published tainted", || {
            taints_of(&server, "pci-0000-01-00-0").is_some_and(|t| t.is_array())
        })
        .await;
    let took = settled.elapsed();
    let flapped = started.elapsed().as_secs_f64();
    let requests = server.requests();
    let count = |method: &str, what: &str| {
        requests
            .iter()
            .filter(|(m, p)| m == method && p.contains(what))
            .count()
    };
    let writes = count("PUT", "/resourceslices/") + count("POST", "/resourceslices");
    let node_reads = count("GET", "/api/v1/nodes/");
    println!(
        "{flips} health changes in {flapped:.1} s: {writes} slice writes, {node_reads} Node reads \
         ({:.1} and {:.1} a second); published settled {took:?} after the last change",
        writes as f64 / flapped,
        node_reads as f64 / flapped
    );
    assert!(
        flips > 150,
        "the flapping was too slow to prove anything: {flips}"
    );
    assert!(
        writes as f64 <= 3.0 * flapped + 1.0,
        "{writes} slice writes"
    );
    assert!(
        node_reads as f64 <= 3.0 * flapped + 1.0,
        "{node_reads} Node reads"
    );
    assert!(
        took < Duration::from_secs(1),
        "published settled after {took:?}"
    );
    // And settled healthy: the same.
    std::fs::write(&node, "").unwrap();
    let settled = Instant::now();
    driver
        .wait_until("the card untainted", || {
            taints_of(&server, "pci-0000-01-00-0") == Some(serde_json::Value::Null)
        })
        .await;
    assert!(
        settled.elapsed() < Duration::from_secs(1),
        "{:?}",
        settled.elapsed()
    );
}

/// A device whose sysfs write has not returned (its driver stuck in the kernel) is
/// Unhealthy with the stuck write named, and healthy again once it returns; the
/// write ends without any event, so the board looks again when asked.
#[test]
fn a_write_stuck_in_the_kernel_makes_the_device_unhealthy_until_it_returns() {
    use kubelet_plugin::Health;
    use passthrough::config::ResourceList;
    use sandbox_dra_driver::{reason, HealthBoard};
    use std::sync::Arc;
    use sysfs_pci::deadline::Bounded;
    use sysfs_pci::kernel::Kernel;
    use sysfs_pci::testing::{FakeDevice, FakeKernel, FakeNode, Gate};
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = FakeNode::new(dir.path());
    node.add_device(
        &FakeDevice::new("0000:01:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("e1000e")
            .group(4),
    );
    let fake = Arc::new(FakeKernel::new(&node));
    let gate = Gate::new();
    *fake.hang_on.lock().unwrap() = Some(("driver/unbind".into(), gate.clone()));
    let kernel = Bounded::new(fake, Duration::from_millis(50));
    let list = ResourceList::parse(
        r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#,
    )
    .unwrap();
    let board = HealthBoard::new("node-a", node.host.clone(), list, kernel.stuck_list());
    let reports = board.subscribe();
    board.refresh();
    assert_eq!(reports.borrow()[0].health, Health::Healthy);
    let unbind = node
        .host
        .device_dir(&"0000:01:00.0".parse().unwrap())
        .join("driver/unbind");
    let e = kernel.write(&unbind, "0000:01:00.0").unwrap_err();
    let e = support::error_chain(&e);
    assert!(e.contains("did not return within"), "{e}");
    board.check_stuck();
    let r = reports.borrow()[0].clone();
    let address = "0000:01:00.0".parse().unwrap();
    assert_eq!(
        (r.health, board.unhealthy().get(&address).copied()),
        (Health::Unhealthy, Some(reason::STUCK))
    );
    assert!(
        r.message.contains("driver e1000e is stuck in the kernel"),
        "{r:?}"
    );
    gate.open();
    let start = Instant::now();
    while !kernel.stuck().is_empty() {
        assert!(start.elapsed() < WAIT, "the write returned");
        std::thread::sleep(Duration::from_millis(10));
    }
    board.check_stuck();
    assert_eq!(reports.borrow()[0].health, Health::Healthy);
}

/// On a node that isolates no device interrupts (no `IR-` or `ITS-` interrupt
/// chip), no VM can take a device, so the driver's first slice already taints
/// every device `NoInterruptIsolation`, kubelet's health stream says why, and
/// the log says so once; `allow_unsafe_interrupts=Y` lifts the taints within
/// seconds (looked at with the stuck writes), with a warning.
#[tokio::test]
async fn a_node_without_interrupt_isolation_taints_every_device_from_the_first_slice() {
    let scene = Scene::new();
    scene
        .node
        .set_interrupt_chips(&["IO-APIC", "PCI-MSIX-0000:01:00.0"]);
    let server = cluster();
    let mut driver = scene.start(&server).await;
    let reg = register(&scene).await;
    driver
        .wait_until("the first slice", || !slices(&server).is_empty())
        .await;
    // Every write of the slice, the first included, carried the taints.
    let first = server
        .requests()
        .iter()
        .filter(|(m, p)| m == "POST" && p.contains("/resourceslices"))
        .count();
    assert!(first >= 1);
    let devices: Vec<serde_json::Value> = slices(&server)
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .collect();
    assert!(!devices.is_empty());
    for d in &devices {
        assert_eq!(
            d["taints"][0]["value"], "NoInterruptIsolation",
            "{}",
            d["name"]
        );
        assert_eq!(d["taints"][0]["effect"], "NoSchedule");
    }
    let mut stream = HealthStream::open(
        &reg.endpoint_path(),
        HealthVersion::V1,
        KubeletVersion::V1_34,
    )
    .await
    .unwrap();
    let mut cache = HealthCache::default();
    until(&mut stream, &mut cache, "every device", |c| {
        c.devices.len() == 5
    })
    .await;
    let nic = &cache.devices["node-a/pci-0000-02-00-0"];
    assert_eq!(nic.health, "Unhealthy", "{nic:?}");
    assert!(
        nic.message
            .contains("cannot be given to a VM: no interrupt domain isolates device MSIs"),
        "{nic:?}"
    );
    let log = driver.log();
    assert_eq!(
        log.matches("no VM can be given a device on this node")
            .count(),
        1,
        "{log}"
    );

    scene
        .node
        .set_allow_unsafe_interrupts("vfio_iommu_type1", true);
    driver
        .wait_until("the taints lifted", || {
            taints_of(&server, "pci-0000-02-00-0") == Some(serde_json::Value::Null)
        })
        .await;
    assert!(
        driver.log().contains(
            "vfio_iommu_type1.allow_unsafe_interrupts=1 lets VMs take \
                devices without interrupt isolation"
        ),
        "{}",
        driver.log()
    );
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}
