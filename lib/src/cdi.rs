//! The files prepare writes for a claim: the CDI spec and the device metadata.
//! (Placeholder interface; the formats are filled in separately.)

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::claims::ClaimRef;
use crate::PciAddress;

/// Default CDI spec directory.
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";
/// Default device metadata directory.
pub const DEFAULT_METADATA_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";

/// A typed device attribute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttributeValue {
    /// A string.
    String(String),
    /// An integer.
    Int(i64),
}

/// One allocated device of a claim.
#[derive(Debug, Clone)]
pub struct ClaimDevice {
    /// Slice device name.
    pub device_name: String,
    /// Requests.
    pub request_names: Vec<String>,
    /// Address.
    pub address: PciAddress,
    /// IOMMU group.
    pub group: u32,
    /// Attributes.
    pub attributes: BTreeMap<String, AttributeValue>,
    /// iommufd node name.
    pub iommufd_node: Option<String>,
}

/// The files of a claim.
#[derive(Debug, Clone)]
pub struct ClaimFiles {
    /// CDI spec path and text.
    pub cdi: (PathBuf, String),
    /// Metadata files.
    pub metadata: Vec<(PathBuf, String)>,
    /// CDI ids per device name.
    pub device_ids: BTreeMap<String, Vec<String>>,
}

/// A name that cannot be used in a path.
#[derive(Debug, thiserror::Error)]
#[error("{what} {value:?} cannot be used in a file name")]
pub struct CdiError {
    /// What.
    pub what: &'static str,
    /// The value.
    pub value: String,
}

/// The files for `claim`.
pub fn claim_files(
    driver: &str,
    cdi_dir: &Path,
    metadata_dir: &Path,
    _dev_root: &Path,
    claim: &ClaimRef,
    devices: &[ClaimDevice],
) -> Result<ClaimFiles, CdiError> {
    if claim.uid.is_empty() || claim.uid.contains('/') || claim.uid.contains("..") {
        return Err(CdiError {
            what: "claim uid",
            value: claim.uid.clone(),
        });
    }
    let kind = format!("{driver}/vfio");
    let mut device_ids = BTreeMap::new();
    for d in devices {
        device_ids.insert(
            d.device_name.clone(),
            vec![format!("{kind}={}-{}", claim.uid, d.device_name)],
        );
    }
    Ok(ClaimFiles {
        cdi: (
            cdi_dir.join(format!("{driver}-vfio_{}.json", claim.uid)),
            "{}\n".into(),
        ),
        metadata: vec![(
            metadata_dir.join(&claim.uid).join("metadata.json"),
            "{}\n".into(),
        )],
        device_ids,
    })
}
