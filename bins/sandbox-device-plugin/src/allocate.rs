//! What `Allocate` and `GetPreferredAllocation` answer, as pure functions of the
//! resource's current devices.
//!
//! IDs from kubelet are parsed as PCI addresses, so `10:00.0` and `0000:10:00.0` name
//! the same device; answers carry the canonical form (`0000:10:00.0`).

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap, HashSet};

use kubelet_api::v1beta1::{ContainerAllocateResponse, DeviceSpec};
use passthrough::config::ResourceName;
use sysfs_pci::PciAddress;

use crate::devices::DeviceState;

/// Device nodes get read, write and mknod, as VFIO needs.
const PERMISSIONS: &str = "mrw";
/// An error message names at most this many IDs, then says how many more there are.
const SHOWN_IDS: usize = 10;
/// A hostile ID is cut to this many characters in messages.
const SHOWN_ID_CHARS: usize = 64;

/// Why a container's request cannot be served; becomes a gRPC error.
#[derive(Debug, PartialEq, Eq)]
pub enum AllocateError {
    /// IDs this resource does not have (as sent).
    Unknown(Vec<String>),
    /// Devices asked for more than once, in canonical form.
    Duplicate(Vec<String>),
    /// IDs whose device is not usable now, with the reason.
    Unhealthy(Vec<(String, String)>),
    /// iommufd was asked for but a device has no `vfio-dev/vfioN`.
    NoCdev(Vec<String>),
}

/// `a, b, c` for the first [`SHOWN_IDS`] of `total` items, then `and N more`: an
/// error about 100k IDs stays a one-line message.
fn capped(total: usize, items: impl Iterator<Item = String>) -> String {
    let mut out: Vec<String> = items.take(SHOWN_IDS).collect();
    if total > SHOWN_IDS {
        out.push(format!("and {} more", total - SHOWN_IDS));
    }
    out.join(", ")
}

/// An ID as sent, for a message: as is when it reads as a PCI address, else quoted
/// and cut to [`SHOWN_ID_CHARS`] characters.
fn shown(id: &str) -> String {
    match id.char_indices().nth(SHOWN_ID_CHARS) {
        Some((cut, _)) => format!("{:?}...", &id[..cut]),
        None if id.parse::<PciAddress>().is_ok() => id.to_owned(),
        None => format!("{id:?}"),
    }
}

impl std::fmt::Display for AllocateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AllocateError::Unknown(ids) => write!(
                f,
                "unknown device IDs: {}",
                capped(ids.len(), ids.iter().map(|i| shown(i)))
            ),
            AllocateError::Duplicate(ids) => write!(
                f,
                "device IDs requested twice: {}",
                capped(ids.len(), ids.iter().cloned())
            ),
            AllocateError::Unhealthy(ids) => write!(
                f,
                "unhealthy devices: {}",
                capped(ids.len(), ids.iter().map(|(i, why)| format!("{i} ({why})")))
            ),
            AllocateError::NoCdev(ids) => write!(
                f,
                "no iommufd device (vfio-dev/vfioN) for: {}; the kernel needs \
                    CONFIG_VFIO_DEVICE_CDEV",
                capped(ids.len(), ids.iter().cloned())
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

/// The device an ID names, if this resource has it (`devices` is sorted by address).
fn find<'a>(devices: &'a [DeviceState], id: &str) -> Option<&'a DeviceState> {
    let a: PciAddress = id.parse().ok()?;
    devices
        .binary_search_by_key(&a, |d| d.address)
        .ok()
        .and_then(|i| devices.get(i))
}

/// The answer for one container: the KubeVirt env var with the canonical BDFs in
/// request order, `/dev/vfio/vfio` and each distinct `/dev/vfio/<group>`, plus
/// `/dev/iommu` and `/dev/vfio/devices/vfioN` when `iommufd` is set and the kernel has
/// the VFIO device cdev (on a kernel without it the group nodes alone are handed out,
/// so one flag serves a mixed fleet; a device missing its cdev on a kernel that has it
/// is refused). Two IDs naming
/// one device (`10:00.0` and `0000:10:00.0`) are a duplicate.
pub fn allocate(
    resource: &ResourceName,
    devices: &[DeviceState],
    ids: &[String],
    iommufd: bool,
) -> Result<ContainerAllocateResponse, AllocateError> {
    let found: Vec<Option<&DeviceState>> = ids.iter().map(|i| find(devices, i)).collect();
    let unknown: Vec<String> = ids
        .iter()
        .zip(&found)
        .filter(|(_, f)| f.is_none())
        .map(|(i, _)| i.clone())
        .collect();
    if !unknown.is_empty() {
        return Err(AllocateError::Unknown(unknown));
    }
    let chosen: Vec<&DeviceState> = found.into_iter().flatten().collect();
    let mut seen = HashSet::new();
    let dup: BTreeSet<PciAddress> = chosen
        .iter()
        .map(|d| d.address)
        .filter(|a| !seen.insert(*a))
        .collect();
    if !dup.is_empty() {
        return Err(AllocateError::Duplicate(
            dup.iter().map(PciAddress::to_string).collect(),
        ));
    }
    let sick: Vec<(String, String)> = chosen
        .iter()
        .filter_map(|d| Some((d.id(), d.problem.clone()?)))
        .collect();
    if !sick.is_empty() {
        return Err(AllocateError::Unhealthy(sick));
    }
    if iommufd {
        let missing: Vec<String> = chosen
            .iter()
            .filter(|d| d.cdev.is_none() && !d.no_cdev_kernel)
            .map(|d| d.id())
            .collect();
        if !missing.is_empty() {
            return Err(AllocateError::NoCdev(missing));
        }
    }
    let cdevs = chosen
        .iter()
        .filter(|_| iommufd)
        .filter_map(|d| d.cdev.as_deref());
    let specs = sysfs_pci::vmm::device_nodes(chosen.iter().filter_map(|d| d.group), cdevs)
        .into_iter()
        .map(|node| spec(format!("/dev/{node}")))
        .collect();
    let (var, value) = resource.kubevirt_env(chosen.iter().map(|d| d.id()));
    Ok(ContainerAllocateResponse {
        envs: [(var, value)].into(),
        devices: specs,
        ..Default::default()
    })
}

/// Picks `size` IDs from `available` (returned exactly as kubelet sent them): the
/// `must_include` IDs that are in `available` first, in their order, then devices on
/// the NUMA nodes already chosen, then under the PCIe bridges already chosen; with
/// nothing chosen, the NUMA node and then the bridge with the most available devices
/// go first. Ties break by address, so the answer is deterministic. IDs naming the
/// same device count once; available IDs this resource does not list come last.
///
/// The answer has exactly `min(size, distinct available devices)` IDs, all from
/// `available`. One sort: O(n log n) in the number of IDs.
pub fn preferred(
    devices: &[DeviceState],
    available: &[String],
    must_include: &[String],
    size: usize,
) -> Vec<String> {
    // Canonical key of an ID: its address, or its text when it is not one.
    fn key(id: &str) -> Result<PciAddress, &str> {
        id.parse().map_err(|_| id)
    }
    // The available devices, each once, under the first spelling kubelet used.
    let mut index: HashMap<Result<PciAddress, &str>, usize> = HashMap::new();
    let mut pool: Vec<&str> = Vec::new();
    for id in available {
        index.entry(key(id)).or_insert_with(|| {
            pool.push(id);
            pool.len() - 1
        });
    }
    let size = size.min(pool.len());
    let mut taken = vec![false; pool.len()];
    let mut chosen: Vec<usize> = Vec::with_capacity(size);
    for id in must_include {
        if chosen.len() == size {
            break;
        }
        if let Some(&i) = index.get(&key(id)) {
            if let Some(t) = taken.get_mut(i).filter(|t| !**t) {
                *t = true;
                chosen.push(i);
            }
        }
    }
    let state: Vec<Option<&DeviceState>> = pool.iter().map(|id| find(devices, id)).collect();
    let picked = |i: &usize| state.get(*i).copied().flatten();
    let numas: HashSet<Option<u32>> = chosen
        .iter()
        .filter_map(picked)
        .map(|d| d.numa_node)
        .collect();
    let bridges: HashSet<Option<PciAddress>> =
        chosen.iter().filter_map(picked).map(|d| d.bridge).collect();
    let mut rest: Vec<usize> = (0..pool.len()).filter(|i| !taken[*i]).collect();
    let mut per_numa: HashMap<Option<u32>, usize> = HashMap::new();
    let mut per_bridge: HashMap<Option<PciAddress>, usize> = HashMap::new();
    for d in rest.iter().filter_map(picked) {
        *per_numa.entry(d.numa_node).or_default() += 1;
        *per_bridge.entry(d.bridge).or_default() += 1;
    }
    rest.sort_by_cached_key(|i| match picked(i) {
        Some(d) => (
            false,
            !numas.contains(&d.numa_node),
            !bridges.contains(&d.bridge),
            Reverse(per_numa.get(&d.numa_node).copied().unwrap_or(0)),
            d.numa_node,
            Reverse(per_bridge.get(&d.bridge).copied().unwrap_or(0)),
            d.bridge,
            Ok(d.address),
        ),
        None => (
            true,
            true,
            true,
            Reverse(0),
            None,
            Reverse(0),
            None,
            key(pool[*i]),
        ),
    });
    chosen.extend(rest.into_iter().take(size - chosen.len()));
    chosen.into_iter().map(|i| pool[i].to_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn dev(bdf: &str, group: u32, numa: Option<u32>, bridge: &str) -> DeviceState {
        DeviceState {
            address: bdf.parse().unwrap(),
            group: Some(group),
            numa_node: numa,
            bridge: Some(bridge.parse().unwrap()),
            cdev: None,
            no_cdev_kernel: false,
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
        // A kernel without the cdev at all (Debian's): the group nodes alone.
        d.no_cdev_kernel = true;
        let r = allocate(
            &name(),
            std::slice::from_ref(&d),
            &ids(&["0000:01:00.0"]),
            true,
        )
        .unwrap();
        let paths: Vec<&str> = r.devices.iter().map(|d| d.host_path.as_str()).collect();
        assert_eq!(paths, ["/dev/vfio/vfio", "/dev/vfio/5"]);
        d.no_cdev_kernel = false;
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

    #[test]
    fn allocate_canonicalises_ids_and_finds_duplicates_across_spellings() {
        let devs = [
            dev("0000:10:00.0", 5, None, "0000:00:01.0"),
            dev("0000:11:00.0", 6, None, "0000:00:02.0"),
        ];
        let r = allocate(&name(), &devs, &ids(&["11:00.0", "0000:10:00.0"]), false).unwrap();
        assert_eq!(
            r.envs["PCI_RESOURCE_REBELLIONS_AI_ATOM_CA22_PT"],
            "0000:11:00.0,0000:10:00.0"
        );
        let e = allocate(&name(), &devs, &ids(&["10:00.0", "0000:10:00.0"]), false).unwrap_err();
        assert_eq!(e, AllocateError::Duplicate(ids(&["0000:10:00.0"])));
        assert_eq!(e.to_string(), "device IDs requested twice: 0000:10:00.0");
    }

    #[test]
    fn allocate_error_messages_name_ten_ids_and_count_the_rest() {
        let devs = [dev("0000:10:00.0", 5, None, "0000:00:01.0")];
        let many: Vec<String> = (0..100_000)
            .map(|i| format!("0001:{:02x}:{:02x}.{}", i / 256 % 256, i % 32, i % 8))
            .collect();
        let e = allocate(&name(), &devs, &many, false)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("unknown device IDs: 0001:00:00.0, 0001:00:01.1, "),
            "{e}"
        );
        assert!(e.ends_with(", and 99990 more"), "{e}");
        assert!(e.len() < 300, "{} bytes", e.len());
        // A hostile ID is quoted and cut, never echoed whole.
        let e = allocate(&name(), &devs, &["x".repeat(1 << 20)], false)
            .unwrap_err()
            .to_string();
        assert_eq!(e, format!("unknown device IDs: \"{}\"...", "x".repeat(64)));
        let e = allocate(&name(), &devs, &ids(&["10:00.0\n"]), false)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "unknown device IDs: \"10:00.0\\n\"");
    }

    fn numbered(n: usize) -> Vec<DeviceState> {
        (0..n)
            .map(|i| {
                let bdf = format!("0000:{:02x}:{:02x}.{}", 0x10 + i / 32, (i / 4) % 8, i % 4);
                let bridge = format!("0000:00:{:02x}.0", i % 8 + 1);
                dev(&bdf, i as u32, Some((i % 2) as u32), &bridge)
            })
            .collect()
    }

    #[test]
    fn preferred_answers_exactly_size_ids_all_from_available() {
        let devs = numbered(64);
        let all: Vec<String> = devs.iter().map(|d| d.id()).collect();
        let some: Vec<String> = all.iter().step_by(3).cloned().collect();
        for size in [0, 1, 5, some.len(), some.len() + 7] {
            let must = ids(&["0000:99:00.0", &all[1], &some[4], &some[4], "garbage"]);
            let got = preferred(&devs, &some, &must, size);
            assert_eq!(got.len(), size.min(some.len()), "size {size}");
            assert!(got.iter().all(|g| some.contains(g)), "{got:?}");
            let distinct: HashSet<&String> = got.iter().collect();
            assert_eq!(distinct.len(), got.len(), "no ID twice: {got:?}");
            if size > 0 {
                // all[1] is not available: only some[4] of must_include counts.
                assert_eq!(got[0], some[4]);
            }
        }
    }

    #[test]
    fn preferred_counts_spellings_of_one_device_once_and_answers_in_kubelets_spelling() {
        let devs = numbered(4);
        let available = ids(&["10:00.1", "0000:10:00.1", "0000:10:00.0", "10:00.0"]);
        let got = preferred(&devs, &available, &ids(&["0000:10:00.1"]), 4);
        assert_eq!(got, ids(&["10:00.1", "0000:10:00.0"]));
    }

    #[test]
    fn preferred_puts_ids_it_does_not_list_last() {
        let devs = numbered(2);
        let available = ids(&["0000:77:00.0", "0000:10:00.1", "bogus", "0000:10:00.0"]);
        let got = preferred(&devs, &available, &[], 3);
        assert_eq!(got, ids(&["0000:10:00.0", "0000:10:00.1", "0000:77:00.0"]));
    }

    #[test]
    fn preferred_must_include_beyond_size_is_cut_to_size() {
        let devs = numbered(8);
        let all: Vec<String> = devs.iter().map(|d| d.id()).collect();
        let must: Vec<String> = all.iter().rev().cloned().collect();
        assert_eq!(preferred(&devs, &all, &must, 3), must[..3].to_vec());
    }
}
