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

use common::*;
use fake_apiserver::paths;
use kubelet_peer::dra::{ClaimRef, PreparedDevice};
use kubelet_peer::dra::{Dra, Prepared, Version};
use serde_json::{json, Value};

const U1: &str = "0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a";
const U2: &str = "5e1c9a40-2b7d-4f8e-a6c3-91d0e2f4b6a8";

// ---------------------------------------------------------------- expected files

/// The CDI spec of claim `vms/vm1-card` (U1): both functions of group 5 for request
/// `card`, a claim the pod names directly. `{R}` is the scene's root: a device root
/// other than /dev writes host paths, hence CDI 0.5.0.
const V1_SPEC: &str = r#"{
  "cdiVersion": "0.5.0",
  "kind": "vfio-sandbox.rebellions.ai/vfio",
  "devices": [
    {
      "name": "pci-0000-01-00-0-0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a",
      "containerEdits": {
        "deviceNodes": [
          {
            "path": "/dev/vfio/vfio",
            "hostPath": "{R}/dev/vfio/vfio",
            "permissions": "mrw"
          },
          {
            "path": "/dev/vfio/5",
            "hostPath": "{R}/dev/vfio/5",
            "permissions": "mrw"
          }
        ]
      }
    },
    {
      "name": "pci-0000-01-00-1-0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a",
      "containerEdits": {
        "deviceNodes": [
          {
            "path": "/dev/vfio/vfio",
            "hostPath": "{R}/dev/vfio/vfio",
            "permissions": "mrw"
          },
          {
            "path": "/dev/vfio/5",
            "hostPath": "{R}/dev/vfio/5",
            "permissions": "mrw"
          }
        ]
      }
    },
    {
      "name": "metadata-card-0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a",
      "containerEdits": {
        "mounts": [
          {
            "hostPath": "{R}/metadata/vfio-sandbox.rebellions.ai/0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a/card/metadata.json",
            "containerPath": "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm1-card/card/vfio-sandbox.rebellions.ai-metadata.json",
            "options": [
              "ro",
              "bind"
            ]
          },
          {
            "hostPath": "{R}/metadata/vfio-sandbox.rebellions.ai/0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a/card/metadata.json",
            "containerPath": "/var/run/dra-device-attributes/vm1-card/card/vfio-sandbox.rebellions.ai-metadata.json",
            "options": [
              "ro",
              "bind"
            ]
          }
        ]
      }
    }
  ]
}
"#;

const V1_CARD_METADATA: &str = r#"{
  "kind": "DeviceMetadata",
  "apiVersion": "metadata.resource.k8s.io/v1alpha1",
  "metadata": {
    "name": "vm1-card",
    "namespace": "vms",
    "uid": "0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a",
    "generation": 1
  },
  "requests": [
    {
      "name": "card",
      "devices": [
        {
          "driver": "vfio-sandbox.rebellions.ai",
          "pool": "node-a",
          "name": "pci-0000-01-00-0",
          "attributes": {
            "resource.kubernetes.io/pciBusID": {
              "string": "0000:01:00.0"
            },
            "resourceName": {
              "string": "example.com/NIC_PT"
            }
          }
        },
        {
          "driver": "vfio-sandbox.rebellions.ai",
          "pool": "node-a",
          "name": "pci-0000-01-00-1",
          "attributes": {
            "resource.kubernetes.io/pciBusID": {
              "string": "0000:01:00.1"
            },
            "resourceName": {
              "string": "example.com/NIC_PT"
            }
          }
        }
      ]
    }
  ]
}
"#;

/// The CDI spec of claim `vms/vm2-passthrough-7xk2q` (U2), made from a template
/// (pod claim name `passthrough`): the NIC of group 6 for request `nic` and the nvme
/// of group 7 for request `disk`.
const V1BETA1_SPEC: &str = r#"{
  "cdiVersion": "0.5.0",
  "kind": "vfio-sandbox.rebellions.ai/vfio",
  "devices": [
    {
      "name": "pci-0000-02-00-0-5e1c9a40-2b7d-4f8e-a6c3-91d0e2f4b6a8",
      "containerEdits": {
        "deviceNodes": [
          {
            "path": "/dev/vfio/vfio",
            "hostPath": "{R}/dev/vfio/vfio",
            "permissions": "mrw"
          },
          {
            "path": "/dev/vfio/6",
            "hostPath": "{R}/dev/vfio/6",
            "permissions": "mrw"
          }
        ]
      }
    },
    {
      "name": "pci-0000-03-00-0-5e1c9a40-2b7d-4f8e-a6c3-91d0e2f4b6a8",
      "containerEdits": {
        "deviceNodes": [
          {
            "path": "/dev/vfio/vfio",
            "hostPath": "{R}/dev/vfio/vfio",
            "permissions": "mrw"
          },
          {
            "path": "/dev/vfio/7",
            "hostPath": "{R}/dev/vfio/7",
            "permissions": "mrw"
          }
        ]
      }
    },
    {
      "name": "metadata-disk-5e1c9a40-2b7d-4f8e-a6c3-91d0e2f4b6a8",
      "containerEdits": {
        "mounts": [
          {
            "hostPath": "{R}/metadata/vfio-sandbox.rebellions.ai/5e1c9a40-2b7d-4f8e-a6c3-91d0e2f4b6a8/disk/metadata.json",
            "containerPath": "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/passthrough/disk/vfio-sandbox.rebellions.ai-metadata.json",
            "options": [
              "ro",
              "bind"
            ]
          },
          {
            "hostPath": "{R}/metadata/vfio-sandbox.rebellions.ai/5e1c9a40-2b7d-4f8e-a6c3-91d0e2f4b6a8/disk/metadata.json",
            "containerPath": "/var/run/dra-device-attributes/vm2-passthrough-7xk2q/disk/vfio-sandbox.rebellions.ai-metadata.json",
            "options": [
              "ro",
              "bind"
            ]
          }
        ]
      }
    },
    {
      "name": "metadata-nic-5e1c9a40-2b7d-4f8e-a6c3-91d0e2f4b6a8",
      "containerEdits": {
        "mounts": [
          {
            "hostPath": "{R}/metadata/vfio-sandbox.rebellions.ai/5e1c9a40-2b7d-4f8e-a6c3-91d0e2f4b6a8/nic/metadata.json",
            "containerPath": "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/passthrough/nic/vfio-sandbox.rebellions.ai-metadata.json",
            "options": [
              "ro",
              "bind"
            ]
          },
          {
            "hostPath": "{R}/metadata/vfio-sandbox.rebellions.ai/5e1c9a40-2b7d-4f8e-a6c3-91d0e2f4b6a8/nic/metadata.json",
            "containerPath": "/var/run/dra-device-attributes/vm2-passthrough-7xk2q/nic/vfio-sandbox.rebellions.ai-metadata.json",
            "options": [
              "ro",
              "bind"
            ]
          }
        ]
      }
    }
  ]
}
"#;

const V1BETA1_NIC_METADATA: &str = r#"{
  "kind": "DeviceMetadata",
  "apiVersion": "metadata.resource.k8s.io/v1alpha1",
  "metadata": {
    "name": "vm2-passthrough-7xk2q",
    "namespace": "vms",
    "uid": "5e1c9a40-2b7d-4f8e-a6c3-91d0e2f4b6a8",
    "generation": 1
  },
  "podClaimName": "passthrough",
  "requests": [
    {
      "name": "nic",
      "devices": [
        {
          "driver": "vfio-sandbox.rebellions.ai",
          "pool": "node-a",
          "name": "pci-0000-02-00-0",
          "attributes": {
            "resource.kubernetes.io/pciBusID": {
              "string": "0000:02:00.0"
            },
            "resourceName": {
              "string": "example.com/NIC_PT"
            }
          }
        }
      ]
    }
  ]
}
"#;

const V1BETA1_DISK_METADATA: &str = r#"{
  "kind": "DeviceMetadata",
  "apiVersion": "metadata.resource.k8s.io/v1alpha1",
  "metadata": {
    "name": "vm2-passthrough-7xk2q",
    "namespace": "vms",
    "uid": "5e1c9a40-2b7d-4f8e-a6c3-91d0e2f4b6a8",
    "generation": 1
  },
  "podClaimName": "passthrough",
  "requests": [
    {
      "name": "disk",
      "devices": [
        {
          "driver": "vfio-sandbox.rebellions.ai",
          "pool": "node-a",
          "name": "pci-0000-03-00-0",
          "attributes": {
            "resource.kubernetes.io/pciBusID": {
              "string": "0000:03:00.0"
            },
            "resourceName": {
              "string": "example.com/NVME_PT"
            }
          }
        }
      ]
    }
  ]
}
"#;

// ---------------------------------------------------------------- helpers

/// The file's text; fails naming it when missing.
fn read(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The expected text with the scene's root in place of `{R}`.
fn expected(scene: &Scene, template: &str) -> String {
    template.replace("{R}", &scene.root_str())
}

fn device(request: &str, name: &str, uid: &str, metadata: &str) -> PreparedDevice {
    PreparedDevice {
        request_names: vec![request.into()],
        pool_name: NODE.into(),
        device_name: name.into(),
        cdi_device_ids: vec![
            format!("{KIND}={name}-{uid}"),
            format!("{KIND}=metadata-{metadata}-{uid}"),
        ],
    }
}

fn ok(devices: Vec<PreparedDevice>) -> Prepared {
    Prepared {
        devices,
        error: String::new(),
    }
}

/// Claim `vms/vm1-card` (U1), for both functions of the card (group 5).
fn put_v1_claim(server: &fake_apiserver::FakeApiServer) -> ClaimRef {
    put_claim(
        server,
        "vm1-card",
        U1,
        Some(&[
            ours("card", "pci-0000-01-00-0"),
            ours("card", "pci-0000-01-00-1"),
        ]),
        None,
    )
}

fn v1_answer() -> Prepared {
    ok(vec![
        device("card", "pci-0000-01-00-0", U1, "card"),
        device("card", "pci-0000-01-00-1", U1, "card"),
    ])
}

/// Claim `vms/vm2-passthrough-7xk2q` (U2) from a template: the NIC and the nvme.
fn put_v1beta1_claim(server: &fake_apiserver::FakeApiServer) -> ClaimRef {
    put_claim(
        server,
        "vm2-passthrough-7xk2q",
        U2,
        Some(&[
            ours("nic", "pci-0000-02-00-0"),
            ours("disk", "pci-0000-03-00-0"),
        ]),
        Some("passthrough"),
    )
}

fn v1beta1_answer() -> Prepared {
    ok(vec![
        device("nic", "pci-0000-02-00-0", U2, "nic"),
        device("disk", "pci-0000-03-00-0", U2, "disk"),
    ])
}

/// Prepares `claims` and returns the answers by uid; the call itself must succeed.
async fn prepare(client: &mut Dra, claims: &[ClaimRef]) -> BTreeMap<String, Prepared> {
    client.prepare(claims).await.unwrap().claims
}

/// Unprepares `claims` and returns each error (empty on success) by uid.
async fn unprepare(client: &mut Dra, claims: &[ClaimRef]) -> BTreeMap<String, String> {
    client
        .unprepare(claims)
        .await
        .unwrap()
        .claims
        .into_iter()
        .map(|(uid, u)| (uid, u.error))
        .collect()
}

/// The error prepare gave `uid`; fails when it succeeded.
fn error_of(answers: &BTreeMap<String, Prepared>, uid: &str) -> String {
    let a = answers
        .get(uid)
        .unwrap_or_else(|| panic!("no answer for {uid:?}"));
    assert!(
        a.devices.is_empty(),
        "{uid}: devices despite an error: {a:?}"
    );
    assert!(!a.error.is_empty(), "{uid} should have failed: {a:?}");
    a.error.clone()
}

fn assert_contains(text: &str, parts: &[&str]) {
    for p in parts {
        assert!(text.contains(p), "{p:?} missing from: {text}");
    }
}

/// The claims the state file records, by uid.
fn state_claims(scene: &Scene) -> serde_json::Map<String, Value> {
    scene.state()["claims"]
        .as_object()
        .cloned()
        .unwrap_or_default()
}

fn state_devices(scene: &Scene) -> Vec<String> {
    scene.state()["devices"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// Checks the files of the v1 claim byte for byte.
fn assert_v1_files(scene: &Scene) {
    assert_eq!(read(&scene.cdi_spec(U1)), expected(scene, V1_SPEC));
    assert_eq!(
        read(&scene.metadata_file(U1, "card")),
        V1_CARD_METADATA,
        "metadata of vm1-card"
    );
}

fn assert_v1beta1_files(scene: &Scene) {
    assert_eq!(read(&scene.cdi_spec(U2)), expected(scene, V1BETA1_SPEC));
    assert_eq!(read(&scene.metadata_file(U2, "nic")), V1BETA1_NIC_METADATA);
    assert_eq!(
        read(&scene.metadata_file(U2, "disk")),
        V1BETA1_DISK_METADATA
    );
}

/// Everything the driver wrote for `uid` is gone.
fn assert_no_files(scene: &Scene, uid: &str) {
    assert!(!scene.cdi_spec(uid).exists(), "CDI spec of {uid} left");
    let dir = scene.metadata_dir().join(DRIVER).join(uid);
    assert!(!dir.exists(), "{} left", dir.display());
}

// ---------------------------------------------------------------- 1. registration

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
        ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
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
        .wait_until("the ResourceSlice", || !slices(&server).is_empty())
        .await;
    let all = slices(&server);
    assert_eq!(all.len(), 1, "one slice: {all:?}");
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
        json!({"name": NODE, "generation": 1, "resourceSliceCount": 1})
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
    assert_eq!(
        spec["devices"],
        json!([
            nic("0000:01:00.0", 5, 0, "pci0000:00"),
            nic("0000:01:00.1", 5, 0, "pci0000:00"),
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
    // Without POD_NAME/POD_NAMESPACE a stop cannot be told from an uninstall: kept.
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert_eq!(slices(&server).len(), 1, "{log}");
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
        .wait_until("the ResourceSlice", || slices(&server).len() == 1)
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
            .wait_until("the ResourceSlice back", || slices(&server).len() == 1)
            .await;
        took.push(start.elapsed());
        let slice = &slices(&server)[0];
        assert_eq!(slice["spec"]["devices"].as_array().unwrap().len(), 4);
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
                    .is_some_and(|d| d.len() == 4)
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
async fn three_hundred_functions_are_published_as_one_pool_of_three_slices() {
    let scene = Scene::new();
    for i in 0..296u32 {
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
                s["spec"]["devices"].as_array().unwrap().len(),
            )
        })
        .collect();
    pools.sort_by(|a, b| a.0.cmp(&b.0));
    let pool = json!({"name": NODE, "generation": 1, "resourceSliceCount": 3});
    assert_eq!(
        pools,
        [
            (
                "node-a-vfio-sandbox-rebellions-ai".into(),
                pool.clone(),
                128
            ),
            (
                "node-a-vfio-sandbox-rebellions-ai-1".into(),
                pool.clone(),
                128
            ),
            ("node-a-vfio-sandbox-rebellions-ai-2".into(), pool, 44),
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

/// A uid for test claim number `n`.
fn uid(n: usize) -> String {
    format!("00000000-0000-4000-8000-{n:012}")
}

#[tokio::test]
async fn hostile_claims_get_an_error_each_and_the_driver_keeps_serving() {
    let scene = Scene::new();
    let server = cluster();
    let driver = scene.start(&server).await;
    let mut v1 = scene.client(Version::V1).await;

    // Two good claims first: one holds group 5, one will see its allocation change.
    let holder = put_claim(
        &server,
        "holder",
        &uid(1),
        Some(&[ours("vm", "pci-0000-01-00-0")]),
        None,
    );
    let changing = put_claim(
        &server,
        "changing",
        &uid(2),
        Some(&[ours("vm", "pci-0000-02-00-0")]),
        None,
    );
    let first = prepare(&mut v1, &[holder.clone(), changing.clone()]).await;
    assert!(first.values().all(|a| a.error.is_empty()), "{first:?}");
    put_claim(
        &server,
        "changing",
        &uid(2),
        Some(&[ours("vm", "pci-0000-03-00-0")]),
        None,
    );

    put_claim(
        &server,
        "wrong-uid",
        &uid(10),
        Some(&[ours("vm", "pci-0000-03-00-0")]),
        None,
    );
    let wrong_uid = claim_ref("wrong-uid", &uid(11));
    let missing = claim_ref("missing", &uid(12));
    let unallocated = put_claim(&server, "unallocated", &uid(13), None, None);
    let other_pool = put_claim(
        &server,
        "other-pool",
        &uid(14),
        Some(&[fake_apiserver::objects::DeviceResult::new(
            "vm",
            DRIVER,
            "node-b",
            "pci-0000-02-00-0",
        )]),
        None,
    );
    let other_driver = put_claim(
        &server,
        "other-driver",
        &uid(15),
        Some(&[fake_apiserver::objects::DeviceResult::new(
            "vm",
            "gpu.example.com",
            NODE,
            "gpu-0",
        )]),
        None,
    );
    let not_ours = put_claim(
        &server,
        "not-ours",
        &uid(16),
        Some(&[ours("vm", "gpu-0")]),
        None,
    );
    let not_selected = put_claim(
        &server,
        "not-selected",
        &uid(17),
        Some(&[ours("vm", "pci-0000-04-00-0")]),
        None,
    );
    let companion = put_claim(
        &server,
        "companion",
        &uid(18),
        Some(&[ours("vm", "pci-0000-01-00-2")]),
        None,
    );
    let absent = put_claim(
        &server,
        "absent",
        &uid(19),
        Some(&[ours("vm", "pci-0000-09-00-0")]),
        None,
    );
    let same_group = put_claim(
        &server,
        "same-group",
        &uid(20),
        Some(&[ours("vm", "pci-0000-01-00-1")]),
        None,
    );
    let empty_uid = claim_ref("empty-uid", "");
    // Names that end up in paths, refused before anything is written.
    let path_uid = put_claim(
        &server,
        "path-uid",
        "../../../x",
        Some(&[ours("vm", "pci-0000-03-00-0")]),
        None,
    );
    let bad_request = put_claim(
        &server,
        "bad-request",
        &uid(21),
        Some(&[ours("../x", "pci-0000-03-00-0")]),
        None,
    );

    let asked = [
        wrong_uid,
        missing,
        unallocated,
        other_pool,
        other_driver,
        not_ours,
        not_selected,
        companion,
        absent,
        same_group.clone(),
        changing.clone(),
        empty_uid,
        path_uid,
        bad_request,
    ];
    let answers = prepare(&mut v1, &asked).await;
    assert_eq!(answers.len(), asked.len(), "{answers:?}");
    assert_contains(
        &error_of(&answers, &uid(11)),
        &[
            "ResourceClaim vms/wrong-uid has uid",
            &uid(10),
            &format!("kubelet asked for {}", uid(11)),
        ],
    );
    assert_contains(
        &error_of(&answers, &uid(12)),
        &["ResourceClaim vms/missing is not found"],
    );
    assert_contains(
        &error_of(&answers, &uid(13)),
        &["ResourceClaim vms/unallocated is not allocated"],
    );
    assert_contains(
        &error_of(&answers, &uid(14)),
        &[
            "vms/other-pool",
            "other pools than node-a",
            "node-b/pci-0000-02-00-0",
        ],
    );
    assert_contains(
        &error_of(&answers, &uid(15)),
        &["vms/other-driver has no device of driver vfio-sandbox.rebellions.ai in pool node-a"],
    );
    assert_contains(
        &error_of(&answers, &uid(16)),
        &[
            "vms/not-ours",
            "\"gpu-0\" is not a device this driver publishes",
        ],
    );
    for (n, name, device) in [
        (17, "not-selected", "pci-0000-04-00-0 (0000:04:00.0)"),
        (18, "companion", "pci-0000-01-00-2 (0000:01:00.2)"),
        (19, "absent", "pci-0000-09-00-0 (0000:09:00.0)"),
    ] {
        assert_contains(
            &error_of(&answers, &uid(n)),
            &[
                &format!("vms/{name}"),
                device,
                "the resource list does not select it on this node",
            ],
        );
    }
    assert_contains(
        &error_of(&answers, &uid(20)),
        &[
            "vms/same-group",
            "pci-0000-01-00-1 (0000:01:00.1) is in IOMMU group 5",
            &format!("prepared for claim vms/holder (uid {})", uid(1)),
        ],
    );
    assert_contains(
        &error_of(&answers, &uid(2)),
        &[
            "vms/changing",
            "prepared with pci-0000-02-00-0 (0000:02:00.0)",
            "now names pci-0000-03-00-0 (0000:03:00.0)",
            "unprepare it first",
        ],
    );
    assert_contains(&error_of(&answers, ""), &["vms/empty-uid has no uid"]);
    assert_contains(
        &error_of(&answers, "../../../x"),
        &["vms/path-uid", "invalid claim UID \"../../../x\""],
    );
    assert_contains(
        &error_of(&answers, &uid(21)),
        &["vms/bad-request", "invalid request name \"../x\""],
    );

    // Nothing refused was recorded or written; the two good claims are intact.
    let claims = state_claims(&scene);
    assert_eq!(claims.keys().collect::<Vec<_>>(), [&uid(1), &uid(2)]);
    assert_eq!(claims[&uid(2)]["devices"][0]["device"], "pci-0000-02-00-0");
    let mut specs: Vec<String> = std::fs::read_dir(scene.cdi_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    specs.sort();
    assert_eq!(
        specs,
        [
            format!("{DRIVER}-vfio_{}.json", uid(1)),
            format!("{DRIVER}-vfio_{}.json", uid(2))
        ]
    );
    let mut metadata: Vec<String> = std::fs::read_dir(scene.metadata_dir().join(DRIVER))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    metadata.sort();
    assert_eq!(metadata, [uid(1), uid(2)]);
    assert!(!scene.root().join("x").exists() && !scene.metadata_dir().join("x").exists());

    // A thousand claims in one call over v1beta1: every fourth missing, the others
    // unallocated, for a device not selected here, or under another uid.
    let mut bulk = Vec::new();
    for n in 1000..2000 {
        let name = format!("bulk-{n}");
        let c = match n % 4 {
            0 => claim_ref(&name, &uid(n)),
            1 => put_claim(&server, &name, &uid(n), None, None),
            2 => put_claim(
                &server,
                &name,
                &uid(n),
                Some(&[ours("vm", "pci-0000-04-00-0")]),
                None,
            ),
            _ => {
                put_claim(
                    &server,
                    &name,
                    &uid(n + 5000),
                    Some(&[ours("vm", "pci-0000-03-00-0")]),
                    None,
                );
                claim_ref(&name, &uid(n))
            }
        };
        bulk.push(c);
    }
    let mut v1beta1 = scene.client(Version::V1beta1).await;
    let started = Instant::now();
    let answers = prepare(&mut v1beta1, &bulk).await;
    println!(
        "1000 hostile claims in one NodePrepareResources: {:?}",
        started.elapsed()
    );
    assert_eq!(answers.len(), 1000);
    for c in &bulk {
        let e = error_of(&answers, &c.uid);
        assert!(e.contains(&format!("vms/{}", c.name)), "{e}");
    }
    assert_eq!(state_claims(&scene).len(), 2, "the bulk recorded nothing");

    // Still serving: the holder lets go of group 5, and the claim refused for it
    // now gets it; the changed claim is unprepared and prepared anew.
    assert_eq!(
        unprepare(&mut v1, &[holder, changing.clone()]).await,
        BTreeMap::from([(uid(1), String::new()), (uid(2), String::new())])
    );
    let again = prepare(&mut v1, &[same_group, changing]).await;
    assert_eq!(
        again,
        BTreeMap::from([
            (
                uid(2),
                ok(vec![device("vm", "pci-0000-03-00-0", &uid(2), "vm")])
            ),
            (
                uid(20),
                ok(vec![device("vm", "pci-0000-01-00-1", &uid(20), "vm")])
            ),
        ])
    );
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

// ---------------------------------------------------------------- 5. restart

#[tokio::test]
async fn a_claim_prepared_before_a_kill_stays_prepared_after_the_restart() {
    let scene = Scene::new();
    let server = cluster();
    let c1 = put_v1_claim(&server);
    let driver = scene.start(&server).await;
    let mut v1 = scene.client(Version::V1).await;
    let before = prepare(&mut v1, std::slice::from_ref(&c1)).await;
    assert_eq!(before[U1], v1_answer());
    driver.kill();
    assert_eq!(state_claims(&scene)[U1]["phase"], "prepared");

    let driver = scene.start(&server).await;
    assert!(
        driver
            .log()
            .contains("claims prepared before this start are kept"),
        "{}",
        driver.log()
    );
    assert_eq!(state_claims(&scene)[U1]["phase"], "prepared");
    assert_v1_files(&scene);
    let mut v1beta1 = scene.client(Version::V1beta1).await;
    assert_eq!(
        prepare(&mut v1beta1, std::slice::from_ref(&c1)).await,
        before
    );
    assert_v1_files(&scene);
    assert_eq!(
        unprepare(&mut v1beta1, std::slice::from_ref(&c1)).await,
        BTreeMap::from([(U1.to_string(), String::new())])
    );
    assert_no_files(&scene, U1);
    assert!(state_claims(&scene).is_empty(), "{}", scene.state());
    assert!(state_devices(&scene).is_empty(), "{}", scene.state());
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}

// ---------------------------------------------------------------- 6. coexistence

#[tokio::test]
async fn a_node_run_by_vfio_manager_is_refused_and_left_alone() {
    let scene = Scene::new();
    let server = cluster();
    // vfio-manager exited with a device still on vfio-pci: the node stays its own.
    let lock = scene.owner_lock();
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    let record =
        r#"{"owner":"vfio-manager","pid":4242,"since":"2025-01-31T12:00:00Z","devices":1}"#;
    std::fs::write(&lock, record).unwrap();
    let c1 = put_v1_claim(&server);
    let driver = scene.start(&server).await;
    let refusal = format!(
        "vfio-manager (pid 4242, since 2025-01-31T12:00:00Z; exited with 1 device(s) still \
         moved) owns the devices of this node (lock {}); sandbox-dra-driver moves nothing \
         while it does: a node runs either vfio-manager or sandbox-dra-driver, not both; \
         take the node out of vfio-manager's DaemonSet",
        lock.display()
    );
    let mut v1 = scene.client(Version::V1).await;
    let answers = prepare(&mut v1, std::slice::from_ref(&c1)).await;
    assert_contains(&error_of(&answers, U1), &["not prepared: ", &refusal]);
    // Never prepared here: done already.
    assert_eq!(
        unprepare(&mut v1, std::slice::from_ref(&c1)).await,
        BTreeMap::from([(U1.to_string(), String::new())])
    );
    assert_contains(&driver.log(), &[&refusal]);
    assert_no_files(&scene, U1);
    assert!(
        !scene.state_file().exists(),
        "nothing recovered or recorded"
    );
    assert_eq!(std::fs::read_to_string(&lock).unwrap(), record);
    assert!(slices(&server).is_empty(), "no slice published");
    assert!(
        server.requests().is_empty(),
        "the API server is not even asked: {:?}",
        server.requests()
    );
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(!scene.registration_socket().exists(), "{log}");
}

// ---------------------------------------------------------------- 7. CLI

#[tokio::test]
async fn the_command_line_explains_itself_and_refuses_bad_starts() {
    let scene = Scene::new();
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_sandbox-dra-driver"))
        .arg("--help")
        .output()
        .unwrap();
    assert_eq!(help.status.code(), Some(0));
    let text = String::from_utf8(help.stdout).unwrap();
    assert_contains(
        &text,
        &[
            "<registry-dir>/<driver>-reg.sock",
            "<plugins-dir>/<driver>/dra.sock",
            "vfio-manager",
            "--node-name",
            "[env: NODE_NAME=]",
            "--owner-lock",
            "--owner-retry-interval",
            "Exit codes",
        ],
    );

    let status = scene.command("no-node.log").status().unwrap();
    let err = read(&scene.root().join("no-node.log"));
    assert_eq!(status.code(), Some(2), "{err}");
    assert_contains(&err, &["--node-name <NAME>"]);

    let status = scene
        .command("empty-node.log")
        .args(["--node-name", ""])
        .status()
        .unwrap();
    let err = read(&scene.root().join("empty-node.log"));
    assert_eq!(status.code(), Some(2), "{err}");
    assert_contains(
        &err,
        &["sandbox-dra-driver: error: --node-name (NODE_NAME) is empty"],
    );
    assert!(!scene.registry_dir().exists() && !scene.state_file().exists());

    // A second instance on the same state file: refused before it binds anything.
    let server = cluster();
    let first = scene.start(&server).await;
    let reg = inode(&scene.registration_socket());
    let mut second = scene.command("second.log");
    second
        .env("KUBECONFIG", server.write_kubeconfig(scene.root()).unwrap())
        .env("NODE_NAME", NODE);
    let status = second.status().unwrap();
    let err = read(&scene.root().join("second.log"));
    assert_eq!(status.code(), Some(1), "{err}");
    assert_contains(
        &err,
        &[
            &format!("sandbox-dra-driver (pid {}, since ", first.child.id()),
            &format!(
                "owns the devices of this node (lock {})",
                scene.owner_lock().display()
            ),
            "another sandbox-dra-driver is at work on this node",
        ],
    );
    assert_eq!(
        inode(&scene.registration_socket()),
        reg,
        "the first keeps its socket"
    );
    let registered = register(&scene).await;
    assert_eq!(registered.name, DRIVER);
    let (status, log) = first.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}

// ---------------------------------------------------------------- 8. uninstall vs rollout

#[tokio::test]
async fn a_rollout_keeps_the_slice_and_an_uninstall_deletes_it() {
    let scene = Scene::new();
    let server = cluster_with_daemonset();
    let pod_env = [("POD_NAME", POD), ("POD_NAMESPACE", DRIVER_NS)];

    let mut driver = scene.start_with(&server, &pod_env).await;
    driver
        .wait_until("the ResourceSlice", || !slices(&server).is_empty())
        .await;
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert_contains(
        &log,
        &[
            "keeping this node's ResourceSlice for the next driver pod",
            "still selected by DaemonSet vfio-sandbox/sandbox-dra-driver",
        ],
    );
    assert_eq!(slices(&server).len(), 1, "a rollout keeps the slice");

    let mut driver = scene.start_with(&server, &pod_env).await;
    let published = slices(&server)[0]["metadata"]["resourceVersion"].clone();
    driver
        .wait_until("the next pod to check the slice", || {
            server
                .requests()
                .iter()
                .filter(|(m, p)| m == "GET" && p.starts_with(&paths::resourceslices()))
                .count()
                >= 2
        })
        .await;
    assert!(server.remove(&paths::daemonset(DRIVER_NS, DS)));
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert_contains(
        &log,
        &[
            "DaemonSet vfio-sandbox/sandbox-dra-driver was deleted",
            "the driver leaves this node; deleting its ResourceSlice",
        ],
    );
    assert!(
        slices(&server).is_empty(),
        "an uninstall deletes the slice: {published}"
    );
    assert!(
        server.requests().iter().any(|(m, p)| m == "DELETE"
            && p.starts_with(&paths::resourceslice("node-a-vfio-sandbox-rebellions-ai"))),
        "{:?}",
        server.requests()
    );
}

/// A stop lookup the API server refuses (or does not answer in time) leaves the
/// rollout/uninstall question open, as a missing POD_NAME does, and the driver
/// keeps the slice then: deleting it on every such restart leaves the node's
/// devices unschedulable for a moment, and the next start reconciles it anyway.
#[tokio::test]
async fn a_failed_stop_lookup_keeps_the_slice() {
    let scene = Scene::new();
    let server = cluster_with_daemonset();
    let pod_env = [("POD_NAME", POD), ("POD_NAMESPACE", DRIVER_NS)];
    let mut driver = scene.start_with(&server, &pod_env).await;
    driver
        .wait_until("the ResourceSlice", || !slices(&server).is_empty())
        .await;
    // The Pod lookup at stop is forbidden (its namespaced Role is missing, say).
    server.fail_next_on("GET", 1, 403);
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert_eq!(slices(&server).len(), 1, "the slice is kept:\n{log}");
}

// ------------------------------------------- 8. claims that outlive their unprepare

/// kubelet gives up on a prepare whose claim read is slow and unprepares the
/// claim; the unprepare answers OK (nothing recorded yet). The prepare, still on
/// its way, must not make the claim prepared afterwards.
#[tokio::test]
async fn an_unprepare_that_answered_ok_wins_over_a_prepare_still_on_its_way() {
    let scene = Scene::new();
    let server = cluster();
    let c1 = put_v1_claim(&server);
    let driver = scene.start(&server).await;
    server.set_latency(Some((
        "GET",
        &paths::resourceclaim(NS, "vm1-card"),
        std::time::Duration::from_millis(1500),
    )));
    let mut v1 = scene.client(Version::V1).await;
    let slow = {
        let mut client = scene.client(Version::V1).await;
        let c1 = c1.clone();
        tokio::spawn(async move { prepare(&mut client, &[c1]).await })
    };
    // The prepare's read is under way when kubelet's unprepare comes.
    while !server
        .requests()
        .iter()
        .any(|(m, p)| m == "GET" && p.starts_with(&paths::resourceclaim(NS, "vm1-card")))
    {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(
        unprepare(&mut v1, std::slice::from_ref(&c1)).await,
        BTreeMap::from([(U1.to_string(), String::new())])
    );
    let answers = slow.await.unwrap();
    assert_contains(
        &error_of(&answers, U1),
        &["unprepared it while this prepare was on its way"],
    );
    assert!(state_claims(&scene).is_empty(), "{}", scene.state());
    assert_no_files(&scene, U1);
    // A prepare that starts after the unprepare is served as usual.
    server.set_latency(None);
    assert_eq!(
        prepare(&mut v1, std::slice::from_ref(&c1)).await[U1],
        v1_answer()
    );
    drop(driver);
}

/// `--prepare-timeout` bounds the whole call, claim reads included: two claims
/// whose reads take longer than it are both answered by then, with a reason.
#[tokio::test]
async fn the_whole_call_is_bounded_claim_reads_included() {
    let scene = Scene::new();
    let server = cluster();
    let c1 = put_v1_claim(&server);
    let c2 = put_claim(
        &server,
        "vm2-nic",
        U2,
        Some(&[ours("nic", "pci-0000-02-00-0")]),
        None,
    );
    let driver = scene
        .start_with(&server, &[("VFIO_SANDBOX_PREPARE_TIMEOUT", "1s")])
        .await;
    server.set_latency(Some((
        "GET",
        &paths::resourceclaims(NS),
        std::time::Duration::from_secs(3),
    )));
    let mut v1 = scene.client(Version::V1).await;
    let start = Instant::now();
    let answers = prepare(&mut v1, &[c1, c2]).await;
    let took = start.elapsed();
    println!("two claims with 3 s reads, --prepare-timeout 1s: answered in {took:?}");
    for uid in [U1, U2] {
        assert_contains(
            &error_of(&answers, uid),
            &["took too long", "not done within 1s"],
        );
    }
    assert!(
        took < std::time::Duration::from_millis(2500),
        "the call took {took:?}, not about 1 s"
    );
    drop(driver);
}

#[tokio::test]
async fn the_default_bound_is_below_kubelets_45_second_call_limit() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sandbox-dra-driver"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("[default: 40s]"), "{help}");
    assert!(help.contains("kubelet's 45 s call"), "{help}");
}

/// A failed rollback (its CDI directory read-only, where unlink(2) of an absent
/// file gives EROFS) must not block every later prepare of the claim once the
/// directory is writable again. The driver runs in a mount namespace of its own
/// with the CDI directory bind-mounted read-only, as on a node whose /var/run/cdi
/// was mounted so.
#[tokio::test]
async fn a_read_only_cdi_directory_fails_the_prepare_but_not_its_retries() {
    let scene = Scene::new();
    let server = cluster();
    let c1 = put_v1_claim(&server);
    let cdi = scene.cdi_dir();
    std::fs::create_dir_all(&cdi).unwrap();
    let c = scene.command("ro.log");
    let program = c.get_program().to_owned();
    let args: Vec<std::ffi::OsString> = c.get_args().map(|a| a.to_owned()).collect();
    let mut wrapped = std::process::Command::new("unshare");
    wrapped
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg("mount --bind \"$0\" \"$0\" && mount -o remount,bind,ro \"$0\" && exec \"$@\"")
        .arg(&cdi)
        .arg(program)
        .args(args)
        .env("KUBECONFIG", server.write_kubeconfig(scene.root()).unwrap())
        .env("NODE_NAME", NODE)
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(scene.root().join("ro.log")).unwrap());
    let mut driver = Driver {
        child: wrapped.spawn().unwrap(),
        log: scene.root().join("ro.log"),
    };
    let reg = scene.registration_socket();
    driver
        .wait_until("the registration socket", || reg.exists())
        .await;
    let mut v1 = scene.client(Version::V1).await;
    let e = error_of(&prepare(&mut v1, std::slice::from_ref(&c1)).await, U1);
    assert_contains(&e, &["writing its files", "Read-only file system"]);
    assert_contains(&e, &["its devices were put back"]);
    assert!(state_claims(&scene).is_empty(), "{}", scene.state());
    let remount = std::process::Command::new("nsenter")
        .args([
            "-t",
            &driver.child.id().to_string(),
            "-m",
            "mount",
            "-o",
            "remount,bind,rw",
        ])
        .arg(&cdi)
        .status()
        .unwrap();
    assert!(remount.success());
    assert_eq!(
        prepare(&mut v1, std::slice::from_ref(&c1)).await[U1],
        v1_answer()
    );
    assert_eq!(state_claims(&scene)[U1]["phase"], "prepared");
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}

/// A state file brought from another node (claims of pool `node-b`, a record of a
/// device this node does not have) is not trusted: its claims and their device
/// records are forgotten, saying so, no device is touched, and the groups they
/// named can be prepared here.
#[tokio::test]
async fn a_state_file_from_another_node_is_quarantined() {
    let scene = Scene::new();
    let server = cluster();
    let c1 = put_v1_claim(&server);
    let state = json!({"version": 1,
        "devices": {
            "0000:01:00.0": {"original_driver": "e1000e", "original_override": null,
                "driver": "vfio-pci", "role": "selected", "resource": "example.com/NIC_PT", "group": 5},
            "0000:3b:00.0": {"original_driver": "nvidia", "original_override": null,
                "driver": "vfio-pci", "role": "selected", "resource": "example.com/GPU_PT", "group": 5}},
        "claims": {"uid-b": {"namespace": "vms", "name": "vm-on-b", "phase": "prepared",
            "devices": [
                {"request_names": ["card"], "pool": "node-b", "device": "pci-0000-01-00-0",
                 "address": "0000:01:00.0", "group": 5},
                {"request_names": ["gpu"], "pool": "node-b", "device": "pci-0000-3b-00-0",
                 "address": "0000:3b:00.0", "group": 5}]}}});
    std::fs::create_dir_all(scene.state_file().parent().unwrap()).unwrap();
    std::fs::write(scene.state_file(), state.to_string()).unwrap();
    let driver = scene.start(&server).await;
    let log = driver.log();
    assert_contains(
        &log,
        &[
            "a claim of another node",
            "vms/vm-on-b (uid uid-b) of pool node-b",
        ],
    );
    assert!(state_claims(&scene).is_empty(), "{}", scene.state());
    assert!(state_devices(&scene).is_empty(), "{}", scene.state());
    assert_eq!(
        std::fs::read_link(scene.root().join("sys/bus/pci/devices/0000:01:00.0/driver"))
            .unwrap()
            .file_name()
            .unwrap(),
        "vfio-pci",
        "no device touched"
    );
    let mut v1 = scene.client(Version::V1).await;
    assert_eq!(
        prepare(&mut v1, std::slice::from_ref(&c1)).await[U1],
        v1_answer()
    );
    drop(driver);
}
