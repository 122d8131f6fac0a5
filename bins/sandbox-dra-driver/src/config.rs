//! What a claim, or its DeviceClass, can ask of this driver's devices: an opaque
//! configuration (`spec.devices.config[].opaque` of the claim, `spec.config[].opaque`
//! of the class, both copied by the scheduler into the allocation) whose parameters
//! are a `VfioConfig` (`apiVersion: <driver>/v1alpha1`, `iommu: legacy | iommufd |
//! both`); what each value hands a container, and why, is in
//! docs/sandbox-dra-driver.md ("The IOMMU interface, per claim").
//!
//! Every configuration of this driver in the allocation is checked, whether or not
//! a later one overrides it: an unknown field, an unknown value, another
//! `apiVersion` or `kind` refuses the claim before anything moves, with an error
//! naming the field. For each device the last configuration that applies to its
//! request wins, those of the class before those of the claim
//! ([`kubelet_plugin::opaque_configs`]).

use kubelet_plugin::{ConfigSource, OpaqueConfig};

/// The `kind` of our parameters.
pub const KIND: &str = "VfioConfig";
/// The version of our parameters' API, after the driver's name.
pub const VERSION: &str = "v1alpha1";

/// The kernel interface a container is handed for a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Iommu {
    /// The VFIO container and group nodes.
    Legacy,
    /// The device cdev and `/dev/iommu`.
    Iommufd,
    /// Both.
    Both,
}

impl Iommu {
    /// Hands out the group nodes.
    pub fn legacy(self) -> bool {
        matches!(self, Self::Legacy | Self::Both)
    }

    /// Hands out the device cdev and `/dev/iommu`.
    pub fn iommufd(self) -> bool {
        matches!(self, Self::Iommufd | Self::Both)
    }

    /// Its value in a `VfioConfig`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Legacy => "legacy",
            Self::Iommufd => "iommufd",
            Self::Both => "both",
        }
    }
}

/// The parameters, field by field; anything else is refused.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct VfioConfig {
    api_version: String,
    kind: String,
    #[serde(default)]
    iommu: Option<Iommu>,
}

/// A configuration of this driver that is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} (from {from}{}): {reason}", requests_note(requests))]
pub struct ConfigError {
    /// The field holding it.
    pub field: String,
    /// Where it came from.
    pub from: ConfigSource,
    /// The requests it applies to (empty: all).
    pub requests: Vec<String>,
    /// What is wrong with it.
    pub reason: String,
}

fn requests_note(requests: &[String]) -> String {
    if requests.is_empty() {
        String::new()
    } else {
        format!(", for request(s) {}", requests.join(", "))
    }
}

/// What one configuration asks for, checked.
fn parse(driver: &str, config: &OpaqueConfig) -> Result<Option<Iommu>, ConfigError> {
    let refuse = |reason: String| ConfigError {
        field: config.field(),
        from: config.source,
        requests: config.requests.clone(),
        reason,
    };
    let parsed: VfioConfig =
        serde_json::from_value(config.parameters.clone()).map_err(|e| refuse(e.to_string()))?;
    let want = format!("{driver}/{VERSION}");
    if parsed.api_version != want {
        return Err(refuse(format!(
            "apiVersion is {:?}; this driver reads {want:?}",
            parsed.api_version
        )));
    }
    if parsed.kind != KIND {
        return Err(refuse(format!(
            "kind is {:?}; this driver reads {KIND:?}",
            parsed.kind
        )));
    }
    Ok(parsed.iommu)
}

/// The interface each of a claim's devices asks for, one per entry of `requests`
/// (a device's request names): `None` where no configuration of this driver
/// sets `iommu` for it (the node's default). Checks every configuration first.
pub fn iommu_per_device<'a>(
    driver: &str,
    configs: &[OpaqueConfig],
    requests: impl IntoIterator<Item = &'a [String]>,
) -> Result<Vec<Option<Iommu>>, ConfigError> {
    let parsed: Vec<(&OpaqueConfig, Option<Iommu>)> = configs
        .iter()
        .map(|c| parse(driver, c).map(|iommu| (c, iommu)))
        .collect::<Result<_, _>>()?;
    Ok(requests
        .into_iter()
        .map(|names| {
            parsed
                .iter()
                .rev()
                .filter(|(c, _)| names.iter().any(|n| c.applies_to(n)))
                .find_map(|(_, iommu)| *iommu)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const DRIVER: &str = "vfio-sandbox.rebellions.ai";

    fn config(
        index: usize,
        source: ConfigSource,
        requests: &[&str],
        p: serde_json::Value,
    ) -> OpaqueConfig {
        OpaqueConfig {
            index,
            source,
            requests: requests.iter().map(|r| r.to_string()).collect(),
            parameters: p,
        }
    }

    fn vfio(iommu: &str) -> serde_json::Value {
        json!({"apiVersion": "vfio-sandbox.rebellions.ai/v1alpha1", "kind": "VfioConfig", "iommu": iommu})
    }

    fn names(r: &[&str]) -> Vec<String> {
        r.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_last_config_that_applies_wins_and_the_rest_keep_the_default() {
        let configs = [
            config(0, ConfigSource::Class, &[], vfio("both")),
            config(1, ConfigSource::Claim, &["vm"], vfio("iommufd")),
            config(2, ConfigSource::Claim, &["kata/fast"], vfio("legacy")),
        ];
        let requests = [names(&["vm"]), names(&["kata/fast"]), names(&["kata/slow"])];
        let got = iommu_per_device(DRIVER, &configs, requests.iter().map(Vec::as_slice)).unwrap();
        assert_eq!(
            got,
            [Some(Iommu::Iommufd), Some(Iommu::Legacy), Some(Iommu::Both)]
        );
        let none = iommu_per_device(DRIVER, &[], requests.iter().map(Vec::as_slice)).unwrap();
        assert_eq!(none, [None, None, None]);
        // A config without `iommu` sets nothing: an earlier one still applies.
        let plain =
            json!({"apiVersion": "vfio-sandbox.rebellions.ai/v1alpha1", "kind": "VfioConfig"});
        let configs = [
            config(0, ConfigSource::Claim, &["vm"], vfio("legacy")),
            config(1, ConfigSource::Claim, &[], plain),
        ];
        let got = iommu_per_device(DRIVER, &configs, [names(&["vm"]).as_slice()]).unwrap();
        assert_eq!(got, [Some(Iommu::Legacy)]);
    }

    #[test]
    fn every_config_is_checked_and_the_error_names_the_field() {
        let cases = [
            (
                json!({"apiVersion": "vfio-sandbox.rebellions.ai/v1alpha1", "kind": "VfioConfig", "iomu": "legacy"}),
                "unknown field `iomu`",
            ),
            (
                vfio("iommu-fd"),
                "unknown variant `iommu-fd`, expected one of `legacy`, \
                    `iommufd`, `both`",
            ),
            (
                json!({"apiVersion": "gpu.nvidia.com/v1beta1", "kind": "VfioConfig"}),
                "apiVersion is \"gpu.nvidia.com/v1beta1\"; this driver \
                    reads \"vfio-sandbox.rebellions.ai/v1alpha1\"",
            ),
            (
                json!({"apiVersion": "vfio-sandbox.rebellions.ai/v1alpha1", "kind": "GpuConfig"}),
                "kind is \"GpuConfig\"",
            ),
            (json!({"kind": "VfioConfig"}), "missing field `apiVersion`"),
            (json!("legacy"), "invalid type: string \"legacy\""),
            (
                json!({"apiVersion": "vfio-sandbox.rebellions.ai/v1alpha1", "kind": "VfioConfig", "iommu": 1}),
                "invalid type: integer `1`",
            ),
        ];
        for (bad, want) in cases {
            // Shadowed by a later, valid config: still refused.
            let configs = [
                config(3, ConfigSource::Claim, &["vm"], bad.clone()),
                config(4, ConfigSource::Claim, &["vm"], vfio("legacy")),
            ];
            let err = iommu_per_device(DRIVER, &configs, [names(&["vm"]).as_slice()]).unwrap_err();
            let text = err.to_string();
            assert!(
                text.starts_with("status.allocation.devices.config[3].opaque.parameters (from the claim, for request(s) vm): "),
                "{text}"
            );
            assert!(text.contains(want), "{bad}: {text}");
        }
    }
}
