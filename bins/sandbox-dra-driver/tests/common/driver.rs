//! What the end-to-end tests of the driver share: the claims they put, the exact
//! files prepare must write for them, and the calls and checks around them.

#![allow(dead_code)] // not every test uses every helper

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::Duration;

use super::*;
use kubelet_peer::dra::{ClaimRef, PreparedDevice};
use kubelet_peer::dra::{Dra, Prepared};
use serde_json::Value;

pub const U1: &str = "0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a";
pub const U2: &str = "5e1c9a40-2b7d-4f8e-a6c3-91d0e2f4b6a8";

// ---------------------------------------------------------------- expected files

/// The CDI spec of claim `vms/vm1-card` (U1): both functions of group 5 for request
/// `card`, a claim the pod names directly. `{R}` is the scene's root: a device root
/// other than /dev writes host paths, hence CDI 0.5.0.
pub const V1_SPEC: &str = r#"{
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
        "env": [
          "PCI_RESOURCE_EXAMPLE_COM_NIC_PT=0000:01:00.0,0000:01:00.1"
        ],
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

pub const V1_CARD_METADATA: &str = r#"{
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
pub const V1BETA1_SPEC: &str = r#"{
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
        "env": [
          "PCI_RESOURCE_EXAMPLE_COM_NVME_PT=0000:03:00.0"
        ],
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
        "env": [
          "PCI_RESOURCE_EXAMPLE_COM_NIC_PT=0000:02:00.0"
        ],
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

pub const V1BETA1_NIC_METADATA: &str = r#"{
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

pub const V1BETA1_DISK_METADATA: &str = r#"{
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
pub fn read(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The expected text with the scene's root in place of `{R}`.
pub fn expected(scene: &Scene, template: &str) -> String {
    template.replace("{R}", &scene.root_str())
}

pub fn device(request: &str, name: &str, uid: &str, metadata: &str) -> PreparedDevice {
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

pub fn ok(devices: Vec<PreparedDevice>) -> Prepared {
    Prepared {
        devices,
        error: String::new(),
    }
}

/// Claim `vms/vm1-card` (U1), for both functions of the card (group 5).
pub fn put_v1_claim(server: &fake_apiserver::FakeApiServer) -> ClaimRef {
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

pub fn v1_answer() -> Prepared {
    ok(vec![
        device("card", "pci-0000-01-00-0", U1, "card"),
        device("card", "pci-0000-01-00-1", U1, "card"),
    ])
}

/// Claim `vms/vm2-passthrough-7xk2q` (U2) from a template: the NIC and the nvme.
pub fn put_v1beta1_claim(server: &fake_apiserver::FakeApiServer) -> ClaimRef {
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

pub fn v1beta1_answer() -> Prepared {
    ok(vec![
        device("nic", "pci-0000-02-00-0", U2, "nic"),
        device("disk", "pci-0000-03-00-0", U2, "disk"),
    ])
}

/// Prepares `claims` and returns the answers by uid; the call itself must succeed.
pub async fn prepare(client: &mut Dra, claims: &[ClaimRef]) -> BTreeMap<String, Prepared> {
    client.prepare(claims).await.unwrap().claims
}

/// Unprepares `claims` and returns each error (empty on success) by uid.
pub async fn unprepare(client: &mut Dra, claims: &[ClaimRef]) -> BTreeMap<String, String> {
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
pub fn error_of(answers: &BTreeMap<String, Prepared>, uid: &str) -> String {
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

pub fn assert_contains(text: &str, parts: &[&str]) {
    for p in parts {
        assert!(text.contains(p), "{p:?} missing from: {text}");
    }
}

/// The claims the state file records, by uid.
pub fn state_claims(scene: &Scene) -> serde_json::Map<String, Value> {
    scene.state()["claims"]
        .as_object()
        .cloned()
        .unwrap_or_default()
}

pub fn state_devices(scene: &Scene) -> Vec<String> {
    scene.state()["devices"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// Checks the files of the v1 claim byte for byte.
pub fn assert_v1_files(scene: &Scene) {
    assert_eq!(read(&scene.cdi_spec(U1)), expected(scene, V1_SPEC));
    assert_eq!(
        read(&scene.metadata_file(U1, "card")),
        V1_CARD_METADATA,
        "metadata of vm1-card"
    );
}

pub fn assert_v1beta1_files(scene: &Scene) {
    assert_eq!(read(&scene.cdi_spec(U2)), expected(scene, V1BETA1_SPEC));
    assert_eq!(read(&scene.metadata_file(U2, "nic")), V1BETA1_NIC_METADATA);
    assert_eq!(
        read(&scene.metadata_file(U2, "disk")),
        V1BETA1_DISK_METADATA
    );
}

/// Everything the driver wrote for `uid` is gone.
pub fn assert_no_files(scene: &Scene, uid: &str) {
    assert!(!scene.cdi_spec(uid).exists(), "CDI spec of {uid} left");
    let dir = scene.metadata_dir().join(DRIVER).join(uid);
    assert!(!dir.exists(), "{} left", dir.display());
}

// ---------------------------------------------------------------- 1. registration

/// The address the driver's log says it serves metrics on.
pub fn metrics_address(driver: &Driver) -> Option<String> {
    driver.log().lines().find_map(|l| {
        if !l.contains("serving metrics at /metrics") {
            return None;
        }
        let at = l.find("address=")? + "address=".len();
        Some(l[at..].split_whitespace().next()?.to_owned())
    })
}

pub fn scrape(address: &str) -> String {
    let mut s = std::net::TcpStream::connect(address).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

/// The value of one series (`name{labels}`).
pub fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
}
