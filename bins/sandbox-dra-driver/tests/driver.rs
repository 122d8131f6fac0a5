//! The real `sandbox-dra-driver` binary on a fake node, over real protocols: the
//! kubelet-like peer registers it and calls both DRA versions over its Unix
//! sockets, and it reads claims from and publishes its ResourceSlice to the
//! stand-in API server over HTTP through kube-rs.
//!
//! The fake node's devices already sit on vfio-pci, so prepare moves nothing in
//! sysfs, but every other step runs for real: the API read, the engine's checks,
//! the checkpoint, the CDI spec and the metadata files (compared byte for byte).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::time::Instant;

use common::driver::*;
use common::*;
use fake_apiserver::paths;
use kubelet_peer::dra::{Dra, Version};
use serde_json::{json, Value};

#[tokio::test]
async fn kubelet_registers_the_driver_with_the_exact_plugin_info() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start(&server).await;
    let reg = register(&scene).await;
    assert_eq!(reg.socket, scene.registration_socket());
    assert_eq!(reg.kind, "DRAPlugin");
    assert_eq!(reg.name, DRIVER);
    assert_eq!(
        reg.endpoint,
        scene.service_socket().to_str().unwrap(),
        "endpoint = <plugins>/<driver>/dra.sock"
    );
    assert_eq!(
        reg.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth"
        ]
    );
    assert_eq!(reg.chosen, Version::V1);
    // The notification reached the driver, which took it as accepted.
    let log = driver.log.clone();
    driver
        .wait_until("the driver logs the registration", || {
            std::fs::read_to_string(&log).is_ok_and(|l| l.contains("registered with kubelet"))
        })
        .await;
    let log = driver.log();
    assert!(!log.contains("refused the registration"), "{log}");
    // Both versions answer on the endpoint kubelet was given.
    for v in Version::ALL {
        let mut c = Dra::connect(&reg.endpoint_path(), v).await.unwrap();
        assert!(unprepare(&mut c, &[]).await.is_empty(), "{v:?}");
    }
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(
        !scene.registration_socket().exists(),
        "sockets removed at stop"
    );
    assert!(!scene.service_socket().exists(), "sockets removed at stop");
}

// ---------------------------------------------------------------- 2. ResourceSlice

#[tokio::test]
async fn the_slice_offers_each_selected_function_with_its_attributes_and_no_companion() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start(&server).await;
    driver
        .wait_until("both ResourceSlices", || slices(&server).len() == 2)
        .await;
    let all = slices(&server);
    assert_eq!(
        all.len(),
        2,
        "the devices' slice and their counter sets' (1.35 on): {all:?}"
    );
    let slice = &all[0];
    assert_eq!(
        slice["metadata"]["name"],
        "node-a-vfio-sandbox-rebellions-ai"
    );
    assert_eq!(
        slice["metadata"]["ownerReferences"],
        json!([{"apiVersion": "v1", "kind": "Node", "name": NODE,
                "uid": "uid-node-node-a", "controller": true}])
    );
    let spec = &slice["spec"];
    assert_eq!(spec["driver"], DRIVER);
    assert_eq!(spec["nodeName"], NODE);
    assert_eq!(
        spec["pool"],
        json!({"name": NODE, "generation": 1, "resourceSliceCount": 2})
    );
    let nic = |bdf: &str, group: i64, numa: i64, root: &str| {
        json!({
            "name": format!("pci-{}", bdf.replace([':', '.'], "-")),
            "attributes": {
                "deviceID": s("0x10d3"),
                "iommuGroup": i(group),
                "numaNode": i(numa),
                "resource.kubernetes.io/pciBusID": s(bdf),
                "resource.kubernetes.io/pcieRoot": s(root),
                "resourceName": s("example.com/NIC_PT"),
                "vendorID": s("0x8086"),
            },
        })
    };
    // 0000:01:00.2 (the audio companion in group 5) and 0000:04:00.0 (selected by
    // no resource) are not offered; the nvme has no NUMA node, so no numaNode.
    // The card's two functions share IOMMU group 5: each, and the group whole,
    // take its one counter.
    let held = json!([{"counterSet": "iommu-group-5", "counters": {"held": {"value": "1"}}}]);
    let in_group = |mut d: Value| {
        d["consumesCounters"] = held.clone();
        d
    };
    let mut whole = in_group(nic("0000:01:00.0", 5, 0, "pci0000:00"));
    whole["name"] = json!("group-0000-01-00-0");
    whole["attributes"]["functions"] = s("0000:01:00.0,0000:01:00.1");
    whole["attributes"]["functionCount"] = i(2);
    assert_eq!(
        spec["devices"],
        json!([
            in_group(nic("0000:01:00.0", 5, 0, "pci0000:00")),
            in_group(nic("0000:01:00.1", 5, 0, "pci0000:00")),
            whole,
            nic("0000:02:00.0", 6, 1, "pci0000:02"),
            {
                "name": "pci-0000-03-00-0",
                "attributes": {
                    "deviceID": s("0x0010"),
                    "iommuGroup": i(7),
                    "resource.kubernetes.io/pciBusID": s("0000:03:00.0"),
                    "resource.kubernetes.io/pcieRoot": s("pci0000:03"),
                    "resourceName": s("example.com/NVME_PT"),
                    "vendorID": s("0x1b36"),
                },
            },
        ])
    );
    assert!(spec.get("sharedCounters").is_none());
    let counters = &all[1]["spec"];
    assert!(counters.get("devices").is_none(), "{counters}");
    assert_eq!(
        counters["sharedCounters"],
        json!([{"name": "iommu-group-5", "counters": {"held": {"value": "1"}}}])
    );
    // Without POD_NAME/POD_NAMESPACE a stop cannot be told from an uninstall: kept.
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert_eq!(slices(&server).len(), 2, "{log}");
    assert!(log.contains("keeping this node's ResourceSlice"), "{log}");
}

/// kubelet's wipe of the node's slices (`pkg/kubelet/cm/dra/plugin/registration.go`,
/// `wipeResourceSlices`: a DeleteCollection with `spec.nodeName=<node>`), sent by
/// a kube-rs client as kubelet's client-go sends it.
async fn wipe_slices(server: &fake_apiserver::FakeApiServer) {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    let client = kube::Client::try_from(kube::Config::new(server.url().parse().unwrap())).unwrap();
    kube::Api::<ResourceSlice>::all(client)
        .delete_collection(
            &kube::api::DeleteParams::default(),
            &kube::api::ListParams::default().fields(&format!("spec.nodeName={NODE}")),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn a_wiped_slice_is_back_at_once_without_waiting_for_the_resync() {
    let scene = Scene::new();
    let server = cluster();
    let mut driver = scene.start(&server).await; // --resync-interval 1h
    driver
        .wait_until("both ResourceSlices", || slices(&server).len() == 2)
        .await;
    let mut took = Vec::new();
    let uid = |s: &Value| s["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
    for round in 0..5 {
        let old = uid(&slices(&server)[0]);
        wipe_slices(&server).await;
        // The driver may be back before this list: a new object, a new uid.
        let start = Instant::now();
        assert!(
            slices(&server).iter().all(|s| uid(s) != old),
            "round {round}: not wiped"
        );
        driver
            .wait_until("the ResourceSlices back", || slices(&server).len() == 2)
            .await;
        took.push(start.elapsed());
        let slice = &slices(&server)[0];
        assert_eq!(slice["spec"]["devices"].as_array().unwrap().len(), 5);
    }
    // A change by another writer is undone as well.
    let mut slice = slices(&server).remove(0);
    slice["spec"]["devices"] = json!([]);
    let name = slice["metadata"]["name"].as_str().unwrap().to_owned();
    server.put(&paths::resourceslice(&name), slice);
    let start = Instant::now();
    driver
        .wait_until("the devices back", || {
            slices(&server).first().is_some_and(|s| {
                s["spec"]["devices"]
                    .as_array()
                    .is_some_and(|d| d.len() == 5)
            })
        })
        .await;
    took.push(start.elapsed());
    took.sort();
    println!(
        "ResourceSlice back after a wipe or a foreign change: median {:?}, max {:?} (resync 1h)",
        took[took.len() / 2],
        took[took.len() - 1]
    );
    assert!(
        took[took.len() - 1] < std::time::Duration::from_secs(1),
        "{took:?}"
    );
}

#[tokio::test]
async fn a_hundred_functions_are_published_as_one_pool_of_three_slices() {
    let scene = Scene::new();
    // With the four of the scene: 100 functions and the card's group device in
    // two slices of devices, and its counter set in a third.
    for i in 0..96u32 {
        scene.node.add_device(
            &sysfs_pci::testing::FakeDevice::new(
                &format!("0000:{:02x}:{:02x}.0", 0x10 + i / 32, i % 32),
                0x8086,
                0x10d3,
                0x02_0000,
            )
            .driver("vfio-pci")
            .group(100 + i),
        );
    }
    let server = cluster();
    let mut driver = scene.start(&server).await;
    driver
        .wait_until("three ResourceSlices", || slices(&server).len() == 3)
        .await;
    let mut pools: Vec<(String, Value, usize)> = slices(&server)
        .iter()
        .map(|s| {
            (
                s["metadata"]["name"].as_str().unwrap().to_owned(),
                s["spec"]["pool"].clone(),
                s["spec"]["devices"].as_array().map_or(0, Vec::len),
            )
        })
        .collect();
    pools.sort_by(|a, b| a.0.cmp(&b.0));
    let pool = json!({"name": NODE, "generation": 1, "resourceSliceCount": 3});
    assert_eq!(
        pools,
        [
            ("node-a-vfio-sandbox-rebellions-ai".into(), pool.clone(), 64),
            (
                "node-a-vfio-sandbox-rebellions-ai-1".into(),
                pool.clone(),
                37
            ),
            ("node-a-vfio-sandbox-rebellions-ai-2".into(), pool, 0),
        ]
    );
}

// ---------------------------------------------------------------- 3. prepare / unprepare

#[tokio::test]
async fn prepare_and_unprepare_over_both_versions_write_and_remove_the_exact_files() {
    let scene = Scene::new();
    let server = cluster();
    let driver = scene.start(&server).await;
    let c1 = put_v1_claim(&server);
    let c2 = put_v1beta1_claim(&server);
    let mut v1 = scene.client(Version::V1).await;
    let mut v1beta1 = scene.client(Version::V1beta1).await;

    let a1 = prepare(&mut v1, std::slice::from_ref(&c1)).await;
    assert_eq!(a1, BTreeMap::from([(U1.to_string(), v1_answer())]));
    let a2 = prepare(&mut v1beta1, std::slice::from_ref(&c2)).await;
    assert_eq!(a2, BTreeMap::from([(U2.to_string(), v1beta1_answer())]));
    assert_v1_files(&scene);
    assert_v1beta1_files(&scene);

    // The checkpoint: both claims prepared with their devices and groups. Every
    // member was on vfio-pci already, so no device was moved and none recorded
    // (unprepare then has nothing to give back).
    let claims = state_claims(&scene);
    assert_eq!(claims.len(), 2, "{claims:?}");
    assert_eq!(
        claims[U1],
        json!({"namespace": NS, "name": "vm1-card", "phase": "prepared", "devices": [
            {"request_names": ["card"], "pool": NODE, "device": "pci-0000-01-00-0",
             "address": "0000:01:00.0", "group": 5},
            {"request_names": ["card"], "pool": NODE, "device": "pci-0000-01-00-1",
             "address": "0000:01:00.1", "group": 5},
        ]})
    );
    assert_eq!(claims[U2]["phase"], "prepared");
    assert_eq!(claims[U2]["name"], "vm2-passthrough-7xk2q");
    assert!(state_devices(&scene).is_empty(), "{}", scene.state());

    // kubelet retries: the same answer, in either version, the files unchanged.
    assert_eq!(prepare(&mut v1, std::slice::from_ref(&c1)).await, a1);
    assert_eq!(prepare(&mut v1beta1, std::slice::from_ref(&c1)).await, a1);
    assert_eq!(prepare(&mut v1, std::slice::from_ref(&c2)).await, a2);
    assert_v1_files(&scene);
    assert_v1beta1_files(&scene);

    // Unprepare one claim per version: its files go, its record goes, the other stays.
    assert_eq!(
        unprepare(&mut v1, std::slice::from_ref(&c1)).await,
        BTreeMap::from([(U1.to_string(), String::new())])
    );
    assert_no_files(&scene, U1);
    assert!(!state_claims(&scene).contains_key(U1));
    assert_v1beta1_files(&scene);
    assert_eq!(
        unprepare(&mut v1beta1, std::slice::from_ref(&c2)).await,
        BTreeMap::from([(U2.to_string(), String::new())])
    );
    assert_no_files(&scene, U2);
    assert!(state_claims(&scene).is_empty(), "{}", scene.state());
    assert!(state_devices(&scene).is_empty(), "{}", scene.state());
    // Every device is where it was: on vfio-pci, as the fake node began.
    for bdf in [
        "0000:01:00.0",
        "0000:01:00.1",
        "0000:01:00.2",
        "0000:02:00.0",
        "0000:03:00.0",
    ] {
        assert_eq!(
            scene.node.driver_of(&bdf.parse().unwrap()).as_deref(),
            Some("vfio-pci"),
            "{bdf}"
        );
    }

    // Again, and claims never prepared here: done already.
    let unknown = claim_ref("never-prepared", "9b2f6c1e-0000-4000-8000-000000000000");
    for client in [&mut v1, &mut v1beta1] {
        let answers = unprepare(client, &[c1.clone(), c2.clone(), unknown.clone()]).await;
        assert_eq!(
            answers,
            BTreeMap::from([
                (U1.to_string(), String::new()),
                (U2.to_string(), String::new()),
                (unknown.uid.clone(), String::new()),
            ])
        );
    }
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}

// ---------------------------------------------------------------- 4. hostile input
