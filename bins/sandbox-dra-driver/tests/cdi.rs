//! The files prepare writes for a claim, byte for byte, and what a CDI reader makes
//! of them.
//!
//! One file on purpose: every test derives its claim and devices
//! from the helpers at the top, and the expected files are written out in full.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kubelet_plugin::ClaimRef;
use sandbox_dra_driver::cdi::{
    cdi_spec_path, claim_files, metadata_claim_dir, AttributeValue, CdiError, ClaimFiles,
    DriverName, SpecDevice,
};
use sandbox_dra_driver::device_name;
use serde::Deserialize;

const DRIVER: &str = "vfio-sandbox.rebellions.ai";

fn driver() -> DriverName {
    DriverName::new(DRIVER).expect("the tests' driver name")
}
const UID: &str = "0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a";

fn claim() -> ClaimRef {
    ClaimRef {
        uid: UID.into(),
        namespace: "vms".into(),
        name: "vm1-card".into(),
    }
}

/// A function as the slice publishes it (the standard attributes and ours).
fn device(bdf: &str, group: u32, requests: &[&str], numa: Option<i64>) -> SpecDevice {
    let address = bdf.parse().expect("address");
    let mut attributes = BTreeMap::from([
        (
            "resource.kubernetes.io/pciBusID".to_string(),
            AttributeValue::String(bdf.into()),
        ),
        (
            "resource.kubernetes.io/pcieRoot".to_string(),
            AttributeValue::String("pci0000:00".into()),
        ),
        (
            "vendorID".to_string(),
            AttributeValue::String("0x8086".into()),
        ),
        (
            "deviceID".to_string(),
            AttributeValue::String("0x10d3".into()),
        ),
        (
            "resourceName".to_string(),
            AttributeValue::String("rebellions.ai/ATOM_CA22_PT".into()),
        ),
        ("iommuGroup".to_string(), AttributeValue::Int(group.into())),
    ]);
    if let Some(n) = numa {
        attributes.insert("numaNode".into(), AttributeValue::Int(n));
    }
    SpecDevice {
        device_name: device_name(&address),
        pool: "node-a".into(),
        request_names: requests.iter().map(|r| r.to_string()).collect(),
        address,
        group,
        attributes,
        group_nodes: true,
        iommufd_nodes: Vec::new(),
        functions: Vec::new(),
        resource: "rebellions.ai/ATOM_CA22_PT".parse().ok(),
    }
}

/// The card's first function (group 5; its companion 01:00.1 is not allocated, so
/// it appears nowhere) for request `card`, and a device in group 7 for `nic`.
fn two_devices() -> Vec<SpecDevice> {
    vec![
        device("0000:02:00.0", 7, &["nic"], None),
        device("0000:01:00.0", 5, &["card"], Some(0)),
    ]
}

fn files(devices: &[SpecDevice]) -> ClaimFiles {
    claim_files(
        &driver(),
        Path::new("/var/run/cdi"),
        Path::new("/var/run/kubernetes.io/dra-device-attributes"),
        Path::new("/dev"),
        &claim(),
        None,
        devices,
    )
    .expect("claim files")
}

const SPEC: &str = r#"{
  "cdiVersion": "0.3.0",
  "kind": "vfio-sandbox.rebellions.ai/vfio",
  "devices": [
    {
      "name": "pci-0000-01-00-0-0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a",
      "containerEdits": {
        "deviceNodes": [
          {
            "path": "/dev/vfio/vfio",
            "permissions": "mrw"
          },
          {
            "path": "/dev/vfio/5",
            "permissions": "mrw"
          }
        ]
      }
    },
    {
      "name": "pci-0000-02-00-0-0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a",
      "containerEdits": {
        "deviceNodes": [
          {
            "path": "/dev/vfio/vfio",
            "permissions": "mrw"
          },
          {
            "path": "/dev/vfio/7",
            "permissions": "mrw"
          }
        ]
      }
    },
    {
      "name": "metadata-card-0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a",
      "containerEdits": {
        "env": [
          "PCI_RESOURCE_REBELLIONS_AI_ATOM_CA22_PT=0000:01:00.0"
        ],
        "mounts": [
          {
            "hostPath": "/var/run/kubernetes.io/dra-device-attributes/vfio-sandbox.rebellions.ai/0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a/card/metadata.json",
            "containerPath": "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm1-card/card/vfio-sandbox.rebellions.ai-metadata.json",
            "options": [
              "ro",
              "bind"
            ]
          },
          {
            "hostPath": "/var/run/kubernetes.io/dra-device-attributes/vfio-sandbox.rebellions.ai/0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a/card/metadata.json",
            "containerPath": "/var/run/dra-device-attributes/vm1-card/card/vfio-sandbox.rebellions.ai-metadata.json",
            "options": [
              "ro",
              "bind"
            ]
          }
        ]
      }
    },
    {
      "name": "metadata-nic-0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a",
      "containerEdits": {
        "env": [
          "PCI_RESOURCE_REBELLIONS_AI_ATOM_CA22_PT=0000:02:00.0"
        ],
        "mounts": [
          {
            "hostPath": "/var/run/kubernetes.io/dra-device-attributes/vfio-sandbox.rebellions.ai/0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a/nic/metadata.json",
            "containerPath": "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm1-card/nic/vfio-sandbox.rebellions.ai-metadata.json",
            "options": [
              "ro",
              "bind"
            ]
          },
          {
            "hostPath": "/var/run/kubernetes.io/dra-device-attributes/vfio-sandbox.rebellions.ai/0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a/nic/metadata.json",
            "containerPath": "/var/run/dra-device-attributes/vm1-card/nic/vfio-sandbox.rebellions.ai-metadata.json",
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

const CARD_METADATA: &str = r#"{
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
            "deviceID": {
              "string": "0x10d3"
            },
            "iommuGroup": {
              "int": 5
            },
            "numaNode": {
              "int": 0
            },
            "resource.kubernetes.io/pciBusID": {
              "string": "0000:01:00.0"
            },
            "resource.kubernetes.io/pcieRoot": {
              "string": "pci0000:00"
            },
            "resourceName": {
              "string": "rebellions.ai/ATOM_CA22_PT"
            },
            "vendorID": {
              "string": "0x8086"
            }
          }
        }
      ]
    }
  ]
}
"#;

#[test]
fn two_devices_give_the_exact_cdi_spec_and_ids() {
    let f = files(&two_devices());
    assert_eq!(
        f.cdi.0,
        PathBuf::from(
            "/var/run/cdi/vfio-sandbox.rebellions.ai-vfio_0d6f7c2a-5b1e-4c3d-9a8b-7e6f5d4c3b2a.json"
        )
    );
    assert_eq!(f.cdi.1, SPEC);
    let k = "vfio-sandbox.rebellions.ai/vfio";
    assert_eq!(
        f.device_ids,
        BTreeMap::from([
            (
                "pci-0000-01-00-0".to_string(),
                vec![
                    format!("{k}=pci-0000-01-00-0-{UID}"),
                    format!("{k}=metadata-card-{UID}"),
                ]
            ),
            (
                "pci-0000-02-00-0".to_string(),
                vec![
                    format!("{k}=pci-0000-02-00-0-{UID}"),
                    format!("{k}=metadata-nic-{UID}"),
                ]
            ),
        ])
    );
    assert!(!f.cdi.1.contains("01:00.1") && !f.cdi.1.contains("01-00-1"));
}

#[test]
fn two_devices_give_one_exact_metadata_file_per_request() {
    let f = files(&two_devices());
    let dir = format!("/var/run/kubernetes.io/dra-device-attributes/{DRIVER}/{UID}");
    let paths: Vec<&PathBuf> = f.metadata.iter().map(|(p, _)| p).collect();
    assert_eq!(
        paths,
        [
            &PathBuf::from(format!("{dir}/card/metadata.json")),
            &PathBuf::from(format!("{dir}/nic/metadata.json")),
        ]
    );
    assert_eq!(f.metadata[0].1, CARD_METADATA);
    let nic: serde_json::Value = serde_json::from_str(&f.metadata[1].1).expect("json");
    assert_eq!(nic["requests"][0]["name"], "nic");
    assert_eq!(
        nic["requests"][0]["devices"][0]["attributes"]["resource.kubernetes.io/pciBusID"],
        serde_json::json!({"string": "0000:02:00.0"})
    );
    assert!(nic["requests"][0]["devices"][0]["attributes"]["numaNode"].is_null());
}

#[test]
fn the_same_claim_gives_the_same_bytes_whatever_the_device_order() {
    let mut reversed = two_devices();
    reversed.reverse();
    assert_eq!(files(&two_devices()), files(&reversed));
}

#[test]
fn a_template_claim_mounts_under_its_pod_claim_name_and_says_so() {
    let mut devs = two_devices();
    devs.truncate(1);
    devs[0].request_names = vec!["nic/fast".into()];
    let f = claim_files(
        &driver(),
        Path::new("/var/run/cdi"),
        Path::new("/m"),
        Path::new("/dev"),
        &claim(),
        Some("card"),
        &devs,
    )
    .expect("claim files");
    assert!(f.cdi.1.contains(&format!(
        "\"containerPath\": \"/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/card/nic/{DRIVER}-metadata.json\""
    )));
    assert!(f.cdi.1.contains(&format!(
        "\"hostPath\": \"/m/{DRIVER}/{UID}/nic/metadata.json\""
    )));
    // KubeVirt 1.8.0–1.8.2 glob `/var/run/dra-device-attributes/*/<request>/` and
    // match podClaimName: the legacy mount is under the claim's own name.
    assert!(f.cdi.1.contains(&format!(
        "\"containerPath\": \"/var/run/dra-device-attributes/vm1-card/nic/{DRIVER}-metadata.json\""
    )));
    assert_eq!(
        f.metadata[0].0,
        PathBuf::from(format!("/m/{DRIVER}/{UID}/nic/metadata.json"))
    );
    let m = &f.metadata[0].1;
    assert!(
        m.contains("    \"generation\": 1\n  },\n  \"podClaimName\": \"card\",\n  \"requests\"")
    );
    assert!(m.contains("\"name\": \"nic/fast\""), "{m}");
}

#[test]
fn iommufd_adds_the_iommu_and_device_nodes_after_the_group() {
    let mut devs = two_devices();
    devs[1].iommufd_nodes = vec!["vfio3".into()];
    let f = files(&devs);
    let spec: CdiSpec = serde_json::from_str(&f.cdi.1).expect("spec");
    let card = &spec.devices[0];
    assert_eq!(card.name, format!("pci-0000-01-00-0-{UID}"));
    let paths: Vec<&str> = card
        .container_edits
        .device_nodes
        .iter()
        .map(|n| n.path.as_str())
        .collect();
    assert_eq!(
        paths,
        [
            "/dev/vfio/vfio",
            "/dev/vfio/5",
            "/dev/iommu",
            "/dev/vfio/devices/vfio3"
        ]
    );
    assert!(f.cdi.1.contains(
        "          {\n            \"path\": \"/dev/iommu\",\n            \"permissions\": \"mrw\"\n          },\n          {\n            \"path\": \"/dev/vfio/devices/vfio3\",\n            \"permissions\": \"mrw\"\n          }\n        ]"
    ));
    // The device without an iommufd node gets none.
    assert_eq!(spec.devices[1].container_edits.device_nodes.len(), 2);
}

#[test]
fn another_dev_root_writes_host_paths_and_cdi_0_5_0() {
    let f = claim_files(
        &driver(),
        Path::new("/var/run/cdi"),
        Path::new("/m"),
        Path::new("/host/dev/"),
        &claim(),
        None,
        &two_devices()[1..],
    )
    .expect("claim files");
    let spec: CdiSpec = serde_json::from_str(&f.cdi.1).expect("spec");
    assert_eq!(spec.cdi_version, "0.5.0");
    let node = &spec.devices[0].container_edits.device_nodes[1];
    assert_eq!(node.path, "/dev/vfio/5");
    assert_eq!(node.host_path.as_deref(), Some("/host/dev/vfio/5"));
}

#[test]
fn a_missing_pci_bus_id_is_added_and_a_wrong_one_refused() {
    let mut devs = two_devices();
    devs[1].attributes.clear();
    let f = files(&devs);
    assert!(f.metadata[0].1.contains(
        "\"attributes\": \
            {\n            \"resource.kubernetes.io/pciBusID\": {\n              \"string\": \"0000:01:00.0\"\n            }\n          }"
    ));
    devs[1].attributes.insert(
        "resource.kubernetes.io/pciBusID".into(),
        AttributeValue::String("0000:01:00.1".into()),
    );
    let e = claim_files(
        &driver(),
        Path::new("/c"),
        Path::new("/m"),
        Path::new("/dev"),
        &claim(),
        None,
        &devs,
    )
    .expect_err("mismatch");
    assert!(matches!(e, CdiError::PciBusIdMismatch { .. }), "{e}");
}

#[test]
fn hostile_claim_uids_never_make_a_path() {
    let long = "a".repeat(300);
    for uid in [
        "", "/", "../x", "..", ".", "a/b", "a b", "-a", "a-", "a\0b", "é", &long,
    ] {
        let mut c = claim();
        c.uid = uid.into();
        let e = claim_files(
            &driver(),
            Path::new("/c"),
            Path::new("/m"),
            Path::new("/dev"),
            &c,
            None,
            &two_devices(),
        )
        .expect_err(uid);
        assert!(
            matches!(
                e,
                CdiError::InvalidName {
                    what: "claim UID",
                    ..
                }
            ),
            "{uid:?}: {e}"
        );
        assert!(
            cdi_spec_path(&driver(), Path::new("/c"), uid).is_err(),
            "{uid:?}"
        );
        assert!(
            metadata_claim_dir(&driver(), Path::new("/m"), uid).is_err(),
            "{uid:?}"
        );
        assert!(e.to_string().len() < 200, "{e}");
    }
}

#[test]
fn hostile_names_are_refused_with_what_they_are() {
    let base = || (claim(), None::<&str>, two_devices());
    let made = |c: &ClaimRef, p: Option<&str>, d: &[SpecDevice]| {
        let (cdi, metadata, dev) = (Path::new("/c"), Path::new("/m"), Path::new("/dev"));
        claim_files(&driver(), cdi, metadata, dev, c, p, d)
    };
    let run = |c: &ClaimRef, p: Option<&str>, d: &[SpecDevice]| made(c, p, d).expect_err("refused");
    let what = |e: CdiError| match e {
        CdiError::InvalidName { what, .. } => what.to_string(),
        other => format!("{other:?}"),
    };
    let (c, p, d) = base();
    for driver in [
        "",
        "../x",
        "Vfio.example",
        "1vfio.example",
        "a..b",
        &"a".repeat(64),
    ] {
        let refused = DriverName::new(driver).expect_err(driver);
        assert_eq!(what(refused), "driver name", "{driver:?}");
    }
    for name in ["", "../x", "a/b", "A", &"a".repeat(254)] {
        let mut c = claim();
        c.name = name.into();
        assert_eq!(what(run(&c, p, &d)), "claim name", "{name:?}");
    }
    // Every name Kubernetes takes for a claim is taken: a subdomain is bounded
    // as a whole (253), not label by label.
    for name in ["a".repeat(64), format!("{}.vm", "b".repeat(249))] {
        let mut c = claim();
        c.name.clone_from(&name);
        let files = made(&c, p, &d);
        assert!(files.is_ok(), "{name:?}: {files:?}");
    }
    for ns in ["", "../x", "a.b"] {
        let mut c = claim();
        c.namespace = ns.into();
        assert_eq!(what(run(&c, p, &d)), "namespace", "{ns:?}");
    }
    for pod in ["", "..", "a/b", "a.b"] {
        assert_eq!(what(run(&c, Some(pod), &d)), "pod claim name", "{pod:?}");
    }
    for req in ["", "..", "../x", "a/b/c", "a/", "/a", "A", &"r".repeat(64)] {
        let mut d = two_devices();
        d[0].request_names = vec![req.into()];
        assert_eq!(what(run(&c, p, &d)), "request name", "{req:?}");
    }
    for node in ["", "vfio", "vfio-1", "../../etc", "vfio1/x", "iommu"] {
        let mut d = two_devices();
        d[0].iommufd_nodes = vec![node.into()];
        assert_eq!(what(run(&c, p, &d)), "iommufd node", "{node:?}");
    }
    for name in ["", "../x", "pci-0000-01-00-0", "gpu-0"] {
        let mut d = two_devices();
        d[0].device_name = name.into(); // device 0 is 0000:02:00.0
        assert!(matches!(
            run(&c, p, &d),
            CdiError::DeviceNameMismatch { .. }
        ));
    }
    let mut dup = two_devices();
    dup.push(dup[0].clone());
    assert!(matches!(run(&c, p, &dup), CdiError::DuplicateDevice(_)));
    assert!(matches!(run(&c, p, &[]), CdiError::NoDevices(_)));
    let mut none = two_devices();
    none[0].request_names.clear();
    assert!(matches!(run(&c, p, &none), CdiError::NoRequest(_)));
    let mut subs = two_devices();
    subs[0].request_names = vec!["gpu/a".into()];
    subs[1].request_names = vec!["gpu/b".into()];
    assert!(matches!(
        run(&c, p, &subs),
        CdiError::SubrequestConflict { .. }
    ));
    let e = claim_files(
        &driver(),
        Path::new("/c"),
        Path::new("m"),
        Path::new("/dev"),
        &c,
        p,
        &d,
    );
    assert!(matches!(e, Err(CdiError::InvalidDir { .. })));
    let e = claim_files(
        &driver(),
        Path::new("/c"),
        Path::new("/m"),
        Path::new("dev"),
        &c,
        p,
        &d,
    );
    assert!(matches!(e, Err(CdiError::InvalidDir { .. })));
}

// A reader's view of a CDI spec: the fields of cncf-tags/container-device-interface
// `specs-go/config.go` we write; anything else in the file is an error.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CdiSpec {
    #[serde(rename = "cdiVersion")]
    cdi_version: String,
    kind: String,
    devices: Vec<CdiDevice>,
    #[serde(rename = "containerEdits")]
    container_edits: Option<CdiEdits>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CdiDevice {
    name: String,
    #[serde(rename = "containerEdits")]
    container_edits: CdiEdits,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CdiEdits {
    #[serde(default)]
    env: Vec<String>,
    #[serde(rename = "deviceNodes", default)]
    device_nodes: Vec<CdiNode>,
    #[serde(default)]
    mounts: Vec<CdiMount>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CdiNode {
    path: String,
    #[serde(rename = "hostPath")]
    host_path: Option<String>,
    permissions: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CdiMount {
    #[serde(rename = "hostPath")]
    host_path: String,
    #[serde(rename = "containerPath")]
    container_path: String,
    options: Vec<String>,
}

/// CDI's device name rule (`ValidateDeviceName`).
fn cdi_name_ok(n: &str) -> bool {
    let b = n.as_bytes();
    let an = |c: &u8| c.is_ascii_alphanumeric();
    b.first().is_some_and(an)
        && b.last().is_some_and(an)
        && b.iter().all(|c| an(c) || b"-_.:".contains(c))
}

#[test]
fn the_spec_parses_as_cdi_and_every_id_names_one_of_its_devices() {
    let f = files(&two_devices());
    let spec: CdiSpec = serde_json::from_str(&f.cdi.1).expect("spec");
    assert_eq!(spec.cdi_version, "0.3.0");
    assert_eq!(spec.kind, format!("{DRIVER}/vfio"));
    let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
    for n in &names {
        assert!(cdi_name_ok(n), "{n}");
        // A digit first would need cdiVersion 0.5.0.
        assert!(n.starts_with(|c: char| c.is_ascii_alphabetic()), "{n}");
    }
    for ids in f.device_ids.values() {
        for id in ids {
            let (kind, name) = id.split_once('=').expect("qualified");
            assert_eq!(kind, spec.kind);
            assert!(names.contains(&name), "{id}");
        }
    }
    for d in &spec.devices {
        for n in &d.container_edits.device_nodes {
            assert!(n.path.starts_with("/dev/vfio/"));
            assert_eq!(n.host_path, None);
            assert_eq!(n.permissions.as_deref(), Some("mrw"));
        }
        for m in &d.container_edits.mounts {
            assert_eq!(m.options, ["ro", "bind"]);
            assert!(f.metadata.iter().any(|(p, _)| p == Path::new(&m.host_path)));
            assert!(m
                .container_path
                .ends_with(&format!("/{DRIVER}-metadata.json")));
        }
    }
}

/// What a container sees: each mount of the claim's CDI devices applied, the host
/// file (`hostPath`, looked up in `written`) copied to `<root>/<containerPath>`.
fn container_root(f: &ClaimFiles) -> tempfile::TempDir {
    let root = tempfile::tempdir().expect("tempdir");
    let written: BTreeMap<&Path, &str> = f
        .metadata
        .iter()
        .map(|(p, t)| (p.as_path(), t.as_str()))
        .collect();
    let spec: serde_json::Value = serde_json::from_str(&f.cdi.1).expect("spec");
    for dev in spec["devices"].as_array().expect("devices") {
        for m in dev["containerEdits"]["mounts"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let host = Path::new(m["hostPath"].as_str().expect("hostPath"));
            let inside = m["containerPath"].as_str().expect("containerPath");
            let to = root.path().join(inside.trim_start_matches('/'));
            std::fs::create_dir_all(to.parent().expect("parent")).expect("mkdir");
            std::fs::write(&to, written[host]).expect("mount");
        }
    }
    root
}

/// The `resource.kubernetes.io/pciBusID` of `request`'s first device in `file`, if
/// the file's `podClaimName` is `pod_claim` (KubeVirt's match for template claims).
fn pci_bus_id(file: &Path, request: &str, pod_claim: Option<&str>) -> Option<String> {
    let m: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(file).ok()?).ok()?;
    if pod_claim.is_some() && m["podClaimName"].as_str() != pod_claim {
        return None;
    }
    let r = m["requests"]
        .as_array()?
        .iter()
        .find(|r| r["name"] == request)?;
    r["devices"][0]["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
        .as_str()
        .map(str::to_owned)
}

/// KubeVirt ≥ 1.8.3 (`pkg/dra`): `/var/run/kubernetes.io/dra-device-attributes/
/// {resourceclaims/<claim>, resourceclaimtemplates/<pod claim>}/<request>/<driver>-metadata.json`.
fn kubevirt_1_8_3(
    root: &Path,
    claim: &str,
    pod_claim: Option<&str>,
    request: &str,
) -> Option<String> {
    let dir = match pod_claim {
        Some(p) => format!("resourceclaimtemplates/{p}"),
        None => format!("resourceclaims/{claim}"),
    };
    let file = root.join(format!(
        "var/run/kubernetes.io/dra-device-attributes/{dir}/{request}/{DRIVER}-metadata.json"
    ));
    pci_bus_id(&file, request, pod_claim)
}

/// KubeVirt 1.8.0–1.8.2: `/var/run/dra-device-attributes/<claim>/<request>/*-metadata.json`;
/// for a template claim every `<base>/*/<request>/*-metadata.json`, matched by
/// `podClaimName`.
fn kubevirt_1_8_0(
    root: &Path,
    claim: &str,
    pod_claim: Option<&str>,
    request: &str,
) -> Option<String> {
    let base = root.join("var/run/dra-device-attributes");
    let claim_dirs: Vec<PathBuf> = match pod_claim {
        Some(_) => std::fs::read_dir(&base)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect(),
        None => vec![base.join(claim)],
    };
    claim_dirs.iter().find_map(|d| {
        std::fs::read_dir(d.join(request))
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.to_string_lossy().ends_with("-metadata.json"))
            .find_map(|p| pci_bus_id(&p, request, pod_claim))
    })
}

#[test]
fn every_kubevirt_from_1_8_0_finds_the_pci_address() {
    for pod_claim in [None, Some("npus")] {
        let f = claim_files(
            &driver(),
            Path::new("/var/run/cdi"),
            Path::new("/m"),
            Path::new("/dev"),
            &claim(),
            pod_claim,
            &two_devices(),
        )
        .expect("claim files");
        let root = container_root(&f);
        for (request, bdf) in [("card", "0000:01:00.0"), ("nic", "0000:02:00.0")] {
            for (reader, found) in [
                (
                    "1.8.3",
                    kubevirt_1_8_3(root.path(), "vm1-card", pod_claim, request),
                ),
                (
                    "1.8.0",
                    kubevirt_1_8_0(root.path(), "vm1-card", pod_claim, request),
                ),
            ] {
                assert_eq!(
                    found.as_deref(),
                    Some(bdf),
                    "KubeVirt {reader}, pod claim {pod_claim:?}, request {request}"
                );
            }
        }
    }
}

/// KubeVirt's `PCI_RESOURCE_<NAME>` (what the device plugin's Allocate sets) is set
/// per request, on the request's own CDI device, which every device of the request
/// returns: a container given a request sees exactly that request's devices, one
/// variable per resource name, comma-separated in address order; a device without
/// a resource name adds none, and the spec's own edits set nothing.
#[test]
fn each_request_sets_kubevirts_variable_for_its_own_devices() {
    let mut devices = vec![
        device("0000:03:00.0", 9, &["nic"], None),
        device("0000:02:00.0", 7, &["nic"], None),
        device("0000:01:00.0", 5, &["card"], None),
        device("0000:04:00.0", 11, &["nic"], None),
        device("0000:05:00.0", 13, &["card"], None),
    ];
    devices[0].resource = "example.com/NIC_PT".parse().ok();
    devices[3].resource = None;
    let made = files(&devices);
    let spec: CdiSpec = serde_json::from_str(&made.cdi.1).expect("spec");
    assert!(spec.container_edits.is_none(), "nothing spec-wide");
    let env_of = |name: &str| -> Vec<String> {
        let d = spec.devices.iter().find(|d| d.name == name).expect(name);
        d.container_edits.env.clone()
    };
    assert_eq!(
        env_of(&format!("metadata-card-{UID}")),
        ["PCI_RESOURCE_REBELLIONS_AI_ATOM_CA22_PT=0000:01:00.0,0000:05:00.0"]
    );
    assert_eq!(
        env_of(&format!("metadata-nic-{UID}")),
        [
            "PCI_RESOURCE_EXAMPLE_COM_NIC_PT=0000:03:00.0",
            "PCI_RESOURCE_REBELLIONS_AI_ATOM_CA22_PT=0000:02:00.0",
        ]
    );
    // Device nodes carry no variable; each device's ids name its request's device.
    for d in spec.devices.iter().filter(|d| d.name.starts_with("pci-")) {
        assert!(d.container_edits.env.is_empty(), "{}", d.name);
    }
    assert_eq!(
        made.device_ids["pci-0000-02-00-0"][1],
        format!("{DRIVER}/vfio=metadata-nic-{UID}")
    );
    for d in &mut devices {
        d.resource = None;
    }
    let spec: CdiSpec = serde_json::from_str(&files(&devices).cdi.1).expect("spec");
    assert!(spec
        .devices
        .iter()
        .all(|d| d.container_edits.env.is_empty()));
}
