//! CDI spec files (the Container Device Interface, cncf-tags/container-device-interface):
//! what a driver writes per prepared claim so that the runtime (containerd,
//! CRI-O) gives a container its devices, and whose device ids it answers
//! kubelet with ([`crate::PreparedDevice::cdi_device_ids`]). Go drivers write
//! these with the CDI module's `specs-go` types and `pkg/cdi` helpers; this is
//! the part of them a DRA driver uses.
//!
//! - Fields, from `specs-go/config.go`: `Spec{cdiVersion, kind, devices}`,
//!   `Device{name, containerEdits}`, `ContainerEdits{env, deviceNodes, mounts}`,
//!   `DeviceNode{path, hostPath, permissions}`, `Mount{hostPath, containerPath,
//!   options}`; the others (hooks, annotations, spec-wide edits, a node's type and
//!   numbers, which the runtime reads from the node itself) are not modelled.
//! - `cdiVersion` is not chosen by the caller: [`Spec::to_json`] writes the lowest
//!   version that has what the spec uses, as `MinimumRequiredVersion` in
//!   `specs-go/version.go` computes it for these fields: `0.3.0`, its floor, or
//!   `0.5.0` once a device node has a `hostPath` or a device name starts with a
//!   digit. A runtime refuses a spec that claims less than it needs, and an older
//!   runtime one that claims more than it knows.
//! - Names (`pkg/parser/parser.go`): the kind is `<vendor>/<class>`, each starting
//!   with a letter, then letters, digits, `-`, `_`, `.`, ending in a letter or
//!   digit; a device name may also hold `:` and start with a digit. A device's id
//!   is `<kind>=<name>` ([`Spec::device_id`]). A name must be unique per kind
//!   across all spec files: the runtime's cache drops both devices of a clash
//!   (`pkg/cdi/cache.go`), so a per-claim spec names its devices with the claim's
//!   UID.
//! - File name: `<vendor>-<class>_<id>.json` for a spec whose life is tied to
//!   something else, here a claim ([`transient_spec_name`], after
//!   `GenerateTransientSpecName` in `pkg/cdi/spec.go`).
//! - Edits apply in order: a later device node or mount of the same container
//!   path replaces an earlier one, and a variable set twice keeps the last value
//!   (`pkg/cdi/container-edits.go`).

use serde::Serialize;

/// One spec file: a kind and its devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    /// `<vendor>/<class>`.
    pub kind: String,
    /// The devices, in the order written.
    pub devices: Vec<Device>,
}

/// One CDI device: a name and what a container given it gets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Device {
    /// Unique per kind on the host.
    pub name: String,
    /// What a container given this device gets.
    #[serde(rename = "containerEdits")]
    pub container_edits: ContainerEdits,
}

/// The changes a device makes to a container.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct ContainerEdits {
    /// `NAME=value` variables.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes to create in the container.
    #[serde(rename = "deviceNodes", skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    /// Bind mounts.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

/// A device node: its path in the container, and on the host when that differs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceNode {
    /// The path in the container.
    pub path: String,
    /// The host's node when it is not at `path` (needs `cdiVersion` 0.5.0).
    #[serde(rename = "hostPath", skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// cgroup access, e.g. `rw` or `mrw`; the runtime's default when `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub permissions: Option<String>,
}

/// A mount of a host path into the container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mount {
    /// The host path.
    #[serde(rename = "hostPath")]
    pub host_path: String,
    /// Where it appears in the container.
    #[serde(rename = "containerPath")]
    pub container_path: String,
    /// Mount options, e.g. `["ro", "bind"]`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

/// The file's JSON: the spec with its version first, as upstream writes it.
#[derive(Serialize)]
struct File<'a> {
    #[serde(rename = "cdiVersion")]
    cdi_version: &'static str,
    kind: &'a str,
    devices: &'a [Device],
}

impl Spec {
    /// The lowest `cdiVersion` that has what this spec uses.
    pub fn version(&self) -> &'static str {
        let digit_name = |d: &Device| d.name.starts_with(|c: char| c.is_ascii_digit());
        let host_path =
            |d: &Device| (d.container_edits.device_nodes.iter()).any(|n| n.host_path.is_some());
        if self.devices.iter().any(|d| digit_name(d) || host_path(d)) {
            "0.5.0"
        } else {
            "0.3.0"
        }
    }

    /// The file's text: pretty JSON with a final newline, `cdiVersion` from
    /// [`Spec::version`].
    pub fn to_json(&self) -> String {
        let file = File {
            cdi_version: self.version(),
            kind: &self.kind,
            devices: &self.devices,
        };
        // Strings and lists of them only: nothing here can fail to encode.
        let mut text = serde_json::to_string_pretty(&file).unwrap_or_default();
        text.push('\n');
        text
    }

    /// The fully qualified id of device `name` of this spec, `<kind>=<name>`,
    /// which kubelet hands the runtime.
    pub fn device_id(&self, name: &str) -> String {
        format!("{}={name}", self.kind)
    }
}

/// The file name of a spec whose life is tied to `id` (a claim's UID):
/// `<vendor>-<class>_<id>.json`, a `/` in `id` written as `_`.
pub fn transient_spec_name(vendor: &str, class: &str, id: &str) -> String {
    format!("{vendor}-{class}_{}.json", id.replace('/', "_"))
}

/// Why a CDI name is refused: what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NameError(pub &'static str);

/// Checks a vendor or class name (the two halves of a kind).
pub fn check_vendor_or_class(name: &str) -> Result<(), NameError> {
    check(
        name,
        Rule {
            first: u8::is_ascii_alphabetic,
            first_says: "must start with a letter",
            inner: b"-_.",
            inner_says: "only letters, digits, '-', '_' and '.' are allowed",
        },
    )
}

/// Checks a device name.
pub fn check_device_name(name: &str) -> Result<(), NameError> {
    check(
        name,
        Rule {
            first: u8::is_ascii_alphanumeric,
            first_says: "must start with a letter or digit",
            inner: b"-_.:",
            inner_says: "only letters, digits, '-', '_', '.' and ':' are allowed",
        },
    )
}

/// A name grammar of `pkg/parser/parser.go`: a first character, letters,
/// digits and `inner` after it, a letter or digit last.
struct Rule {
    first: fn(&u8) -> bool,
    first_says: &'static str,
    inner: &'static [u8],
    inner_says: &'static str,
}

fn check(name: &str, rule: Rule) -> Result<(), NameError> {
    let b = name.as_bytes();
    let (Some(f), Some(l)) = (b.first(), b.last()) else {
        return Err(NameError("is empty"));
    };
    if !(rule.first)(f) {
        return Err(NameError(rule.first_says));
    }
    if !b
        .iter()
        .all(|c| c.is_ascii_alphanumeric() || rule.inner.contains(c))
    {
        return Err(NameError(rule.inner_says));
    }
    if !l.is_ascii_alphanumeric() {
        return Err(NameError("must end with a letter or digit"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(name: &str, host_path: Option<&str>) -> Device {
        Device {
            name: name.into(),
            container_edits: ContainerEdits {
                env: vec!["A=1".into()],
                device_nodes: vec![DeviceNode {
                    path: "/dev/vfio/7".into(),
                    host_path: host_path.map(Into::into),
                    permissions: Some("mrw".into()),
                }],
                mounts: vec![Mount {
                    host_path: "/h".into(),
                    container_path: "/c".into(),
                    options: vec!["ro".into(), "bind".into()],
                }],
            },
        }
    }

    #[test]
    fn the_version_is_the_lowest_that_has_what_the_spec_uses() {
        let spec = |devices| Spec {
            kind: "example.com/gpu".into(),
            devices,
        };
        assert_eq!(spec(vec![]).version(), "0.3.0");
        assert_eq!(spec(vec![device("gpu-0", None)]).version(), "0.3.0");
        assert_eq!(spec(vec![device("0-gpu", None)]).version(), "0.5.0");
        let host = device("gpu-0", Some("/host/dev/vfio/7"));
        assert_eq!(spec(vec![device("gpu-1", None), host]).version(), "0.5.0");
    }

    #[test]
    fn the_file_is_written_in_upstream_field_order_with_empty_edits_left_out() {
        let mut bare = device("gpu-1", None);
        bare.container_edits = ContainerEdits::default();
        let spec = Spec {
            kind: "example.com/gpu".into(),
            devices: vec![device("gpu-0", None), bare],
        };
        let want = r#"{
  "cdiVersion": "0.3.0",
  "kind": "example.com/gpu",
  "devices": [
    {
      "name": "gpu-0",
      "containerEdits": {
        "env": [
          "A=1"
        ],
        "deviceNodes": [
          {
            "path": "/dev/vfio/7",
            "permissions": "mrw"
          }
        ],
        "mounts": [
          {
            "hostPath": "/h",
            "containerPath": "/c",
            "options": [
              "ro",
              "bind"
            ]
          }
        ]
      }
    },
    {
      "name": "gpu-1",
      "containerEdits": {}
    }
  ]
}
"#;
        assert_eq!(spec.to_json(), want);
        assert_eq!(spec.device_id("gpu-0"), "example.com/gpu=gpu-0");
    }

    #[test]
    fn a_transient_name_joins_vendor_class_and_id() {
        assert_eq!(
            transient_spec_name("example.com", "gpu", "a/b"),
            "example.com-gpu_a_b.json"
        );
    }

    #[test]
    fn names_follow_the_cdi_parser() {
        for ok in ["a", "example.com", "a_b-c.d", "vfio"] {
            assert_eq!(check_vendor_or_class(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("", "is empty"),
            ("1a", "must start with a letter"),
            ("a:b", "only letters, digits, '-', '_' and '.' are allowed"),
            ("a/b", "only letters, digits, '-', '_' and '.' are allowed"),
            ("a-", "must end with a letter or digit"),
        ] {
            assert_eq!(check_vendor_or_class(bad), Err(NameError(why)), "{bad:?}");
        }
        for ok in ["0", "1a", "pci-0000:01:00.0", "a_b"] {
            assert_eq!(check_device_name(ok), Ok(()), "{ok}");
        }
        for (bad, why) in [
            ("", "is empty"),
            ("-a", "must start with a letter or digit"),
            (
                "a=b",
                "only letters, digits, '-', '_', '.' and ':' are allowed",
            ),
            ("a.", "must end with a letter or digit"),
        ] {
            assert_eq!(check_device_name(bad), Err(NameError(why)), "{bad:?}");
        }
    }
}
