//! What `Allocate` and `GetPreferredAllocation` answer, as pure functions of the
//! resource's current devices.

use std::collections::{BTreeMap, BTreeSet};

use deviceplugin::v1beta1::{ContainerAllocateResponse, DeviceSpec};
use vfio_sandbox::config::ResourceName;
use vfio_sandbox::PciAddress;

use crate::devices::DeviceState;

/// Device nodes get read, write and mknod, as VFIO needs.
const PERMISSIONS: &str = "mrw";

/// Why a container's request cannot be served; becomes a gRPC error.
#[derive(Debug, PartialEq, Eq)]
pub enum AllocateError {
    /// IDs this resource does not have.
    Unknown(Vec<String>),
    /// IDs asked for twice.
    Duplicate(Vec<String>),
    /// IDs whose device is not usable now, with the reason.
    Unhealthy(Vec<(String, String)>),
    /// iommufd was asked for but a device has no `vfio-dev/vfioN`.
    NoCdev(Vec<String>),
}

impl std::fmt::Display for AllocateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AllocateError::Unknown(ids) => write!(f, "unknown device IDs: {}", ids.join(", ")),
            AllocateError::Duplicate(ids) => write!(f, "device IDs requested twice: {}", ids.join(", ")),
            AllocateError::Unhealthy(ids) => {
                let parts: Vec<String> = ids.iter().map(|(i, why)| format!("{i} ({why})")).collect();
                write!(f, "unhealthy devices: {}", parts.join(", "))
            }
            AllocateError::NoCdev(ids) => write!(
                f,
                "no iommufd device (vfio-dev/vfioN) for: {}; the kernel needs CONFIG_VFIO_DEVICE_CDEV",
                ids.join(", ")
            ),
        }
    }
}

fn spec(path: String) -> DeviceSpec {
    DeviceSpec {
        container_path: path.clone(),
        host_path: path,
        permissions: PERMISSIONS.into(),
    }
}

/// The answer for one container: the KubeVirt env var with the BDFs in request
/// order, `/dev/vfio/vfio` and each distinct `/dev/vfio/<group>`, plus `/dev/iommu`
/// and `/dev/vfio/devices/vfioN` when `iommufd` is set.
pub fn allocate(
    resource: &ResourceName,
    devices: &[DeviceState],
    ids: &[String],
    iommufd: bool,
) -> Result<ContainerAllocateResponse, AllocateError> {
    // `devices` is sorted by address: look up only what was asked for.
    let find = |id: &String| {
        let a: PciAddress = id.parse().ok()?;
        devices
            .binary_search_by_key(&a, |d| d.address)
            .ok()
            .map(|i| &devices[i])
    };
    let found: Vec<Option<&DeviceState>> = ids.iter().map(find).collect();
    let unknown: Vec<String> = ids
        .iter()
        .zip(&found)
        .filter(|(_, f)| f.is_none())
        .map(|(i, _)| i.clone())
        .collect();
    if !unknown.is_empty() {
        return Err(AllocateError::Unknown(unknown));
    }
    let mut seen = BTreeSet::new();
    let dup: BTreeSet<String> = ids.iter().filter(|i| !seen.insert(*i)).cloned().collect();
    if !dup.is_empty() {
        return Err(AllocateError::Duplicate(dup.into_iter().collect()));
    }
    let chosen: Vec<&DeviceState> = found.into_iter().flatten().collect();
    let sick: Vec<(String, String)> = chosen
        .iter()
        .filter_map(|d| Some((d.id(), d.problem.clone()?)))
        .collect();
    if !sick.is_empty() {
        return Err(AllocateError::Unhealthy(sick));
    }
    let mut specs = vec![spec("/dev/vfio/vfio".into())];
    let mut groups = BTreeSet::new();
    for d in &chosen {
        if let Some(g) = d.group.filter(|g| groups.insert(*g)) {
            specs.push(spec(format!("/dev/vfio/{g}")));
        }
    }
    if iommufd {
        let missing: Vec<String> = chosen
            .iter()
            .filter(|d| d.cdev.is_none())
            .map(|d| d.id())
            .collect();
        if !missing.is_empty() {
            return Err(AllocateError::NoCdev(missing));
        }
        specs.push(spec("/dev/iommu".into()));
        specs.extend(
            chosen
                .iter()
                .filter_map(|d| Some(spec(format!("/dev/vfio/devices/{}", d.cdev.as_ref()?)))),
        );
    }
    Ok(ContainerAllocateResponse {
        envs: [(resource.kubevirt_env_var(), ids.join(","))].into(),
        devices: specs,
        ..Default::default()
    })
}

/// Picks `size` devices from `available`: every `must_include` first, then devices
/// on the NUMA nodes already chosen, then under the PCIe bridges already chosen; a
/// first pick goes where the most available devices share a NUMA node and bridge.
/// Ties break by address, so the answer is deterministic.
pub fn preferred(
    devices: &[DeviceState],
    available: &[String],
    must_include: &[String],
    size: usize,
) -> Vec<String> {
    let by_id: BTreeMap<String, &DeviceState> = devices.iter().map(|d| (d.id(), d)).collect();
    let mut chosen: Vec<String> = Vec::new();
    for id in must_include {
        if !chosen.contains(id) {
            chosen.push(id.clone());
        }
    }
    let mut pool: Vec<&DeviceState> = available
        .iter()
        .filter(|id| !chosen.contains(id))
        .filter_map(|id| by_id.get(id).copied())
        .collect();
    pool.sort_by_key(|d| d.address);
    pool.dedup_by_key(|d| d.address);
    let numa_pool =
        |n: Option<u32>, pool: &[&DeviceState]| pool.iter().filter(|d| d.numa_node == n).count();
    let bridge_pool = |b: Option<vfio_sandbox::PciAddress>, pool: &[&DeviceState]| {
        pool.iter().filter(|d| d.bridge == b).count()
    };
    while chosen.len() < size && !pool.is_empty() {
        let numas: BTreeSet<Option<u32>> = chosen
            .iter()
            .filter_map(|i| by_id.get(i))
            .map(|d| d.numa_node)
            .collect();
        let bridges: BTreeSet<Option<vfio_sandbox::PciAddress>> = chosen
            .iter()
            .filter_map(|i| by_id.get(i))
            .map(|d| d.bridge)
            .collect();
        let best = (0..pool.len())
            .min_by_key(|&i| {
                let d = pool[i];
                (
                    !numas.contains(&d.numa_node),
                    !bridges.contains(&d.bridge),
                    std::cmp::Reverse(numa_pool(d.numa_node, &pool)),
                    std::cmp::Reverse(bridge_pool(d.bridge, &pool)),
                    d.address,
                )
            })
            .unwrap_or(0);
        chosen.push(pool.remove(best).id());
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(bdf: &str, group: u32, numa: Option<u32>, bridge: &str) -> DeviceState {
        DeviceState {
            address: bdf.parse().unwrap(),
            group: Some(group),
            numa_node: numa,
            bridge: Some(bridge.parse().unwrap()),
            cdev: None,
            problem: None,
        }
    }

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn name() -> ResourceName {
        "rebellions.ai/ATOM_CA22_PT".parse().unwrap()
    }

    #[test]
    fn allocate_env_in_request_order_and_distinct_group_nodes() {
        let devs = [
            dev("0000:01:00.0", 5, None, "0000:00:01.0"),
            dev("0000:01:00.1", 5, None, "0000:00:01.0"),
            dev("0000:02:00.0", 6, None, "0000:00:02.0"),
        ];
        let r = allocate(
            &name(),
            &devs,
            &ids(&["0000:02:00.0", "0000:01:00.1", "0000:01:00.0"]),
            false,
        )
        .unwrap();
        assert_eq!(r.envs.len(), 1);
        assert_eq!(
            r.envs["PCI_RESOURCE_REBELLIONS_AI_ATOM_CA22_PT"],
            "0000:02:00.0,0000:01:00.1,0000:01:00.0"
        );
        let paths: Vec<(&str, &str, &str)> = r
            .devices
            .iter()
            .map(|d| {
                (
                    d.container_path.as_str(),
                    d.host_path.as_str(),
                    d.permissions.as_str(),
                )
            })
            .collect();
        assert_eq!(
            paths,
            [
                ("/dev/vfio/vfio", "/dev/vfio/vfio", "mrw"),
                ("/dev/vfio/6", "/dev/vfio/6", "mrw"),
                ("/dev/vfio/5", "/dev/vfio/5", "mrw")
            ]
        );
        assert!(r.mounts.is_empty() && r.annotations.is_empty() && r.cdi_devices.is_empty());
    }

    #[test]
    fn allocate_errors_name_the_ids() {
        let mut devs = vec![
            dev("0000:01:00.0", 5, None, "0000:00:01.0"),
            dev("0000:02:00.0", 6, None, "0000:00:02.0"),
        ];
        let e = allocate(
            &name(),
            &devs,
            &ids(&["0000:09:00.0", "0000:01:00.0"]),
            false,
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "unknown device IDs: 0000:09:00.0");
        let e = allocate(
            &name(),
            &devs,
            &ids(&["0000:01:00.0", "0000:01:00.0"]),
            false,
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "device IDs requested twice: 0000:01:00.0");
        devs[1].problem = Some("device removed".into());
        let e = allocate(&name(), &devs, &ids(&["0000:02:00.0"]), false).unwrap_err();
        assert_eq!(
            e.to_string(),
            "unhealthy devices: 0000:02:00.0 (device removed)"
        );
    }

    #[test]
    fn iommufd_adds_iommu_and_device_nodes_or_says_why_not() {
        let mut d = dev("0000:01:00.0", 5, None, "0000:00:01.0");
        let e = allocate(
            &name(),
            std::slice::from_ref(&d),
            &ids(&["0000:01:00.0"]),
            true,
        )
        .unwrap_err();
        assert!(e.to_string().contains("CONFIG_VFIO_DEVICE_CDEV"));
        d.cdev = Some("vfio3".into());
        let r = allocate(&name(), &[d], &ids(&["0000:01:00.0"]), true).unwrap();
        let paths: Vec<&str> = r.devices.iter().map(|d| d.host_path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/dev/vfio/vfio",
                "/dev/vfio/5",
                "/dev/iommu",
                "/dev/vfio/devices/vfio3"
            ]
        );
    }

    #[test]
    fn preferred_honours_must_include_then_numa_then_bridge() {
        let devs = [
            dev("0000:01:00.0", 1, Some(0), "0000:00:01.0"),
            dev("0000:02:00.0", 2, Some(0), "0000:00:02.0"),
            dev("0000:41:00.0", 3, Some(1), "0000:40:01.0"),
            dev("0000:42:00.0", 4, Some(1), "0000:40:02.0"),
            dev("0000:42:00.1", 5, Some(1), "0000:40:02.0"),
        ];
        let all: Vec<String> = devs.iter().map(|d| d.id()).collect();
        // must_include on NUMA 1 under bridge 40:02.0: its bridge sibling next, then NUMA 1.
        assert_eq!(
            preferred(&devs, &all, &ids(&["0000:42:00.0"]), 3),
            ids(&["0000:42:00.0", "0000:42:00.1", "0000:41:00.0"])
        );
        // No constraint: start where most devices share NUMA and bridge (NUMA 1, 40:02.0).
        assert_eq!(
            preferred(&devs, &all, &[], 2),
            ids(&["0000:42:00.0", "0000:42:00.1"])
        );
        // Only what is available, and no more than asked.
        assert_eq!(
            preferred(&devs, &ids(&["0000:01:00.0", "0000:02:00.0"]), &[], 1),
            ids(&["0000:01:00.0"])
        );
        // Deterministic: the same question, the same answer.
        assert_eq!(
            preferred(&devs, &all, &[], 4),
            preferred(&devs, &all, &[], 4)
        );
    }
}
