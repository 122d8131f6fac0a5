//! What a virtual machine monitor opens to take PCI functions bound to vfio: the
//! device nodes a container that runs one must be given.

use std::collections::BTreeSet;

/// The device nodes, relative to `/dev`, a VMM needs for functions in `groups`
/// (in order; a group named twice is given once): `vfio/vfio` and each
/// `vfio/<group>`, and when `cdevs` (the functions' `vfioN` device cdevs, for the
/// iommufd backend) is not empty, `iommu` and each `vfio/devices/vfioN` too. The
/// device plugin's `Allocate` and the DRA driver's CDI specs hand out exactly these.
pub fn device_nodes<'a>(
    groups: impl IntoIterator<Item = u32>,
    cdevs: impl IntoIterator<Item = &'a str>,
) -> Vec<String> {
    let mut nodes = group_nodes(groups);
    nodes.extend(iommufd_nodes(cdevs));
    nodes
}

/// The legacy VFIO interface's nodes for `groups`: `vfio/vfio` and each
/// `vfio/<group>` once, in order.
pub fn group_nodes(groups: impl IntoIterator<Item = u32>) -> Vec<String> {
    let mut nodes = vec!["vfio/vfio".to_owned()];
    let mut seen = BTreeSet::new();
    nodes.extend(
        groups
            .into_iter()
            .filter(|g| seen.insert(*g))
            .map(|g| format!("vfio/{g}")),
    );
    nodes
}

/// The iommufd interface's nodes for the device cdevs `cdevs` (`vfioN`): `iommu`
/// and each `vfio/devices/vfioN`; nothing when `cdevs` is empty.
pub fn iommufd_nodes<'a>(cdevs: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let cdevs: Vec<String> = cdevs
        .into_iter()
        .map(|c| format!("vfio/devices/{c}"))
        .collect();
    if cdevs.is_empty() {
        return cdevs;
    }
    std::iter::once("iommu".to_owned()).chain(cdevs).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_groups_once_each_and_iommufd_nodes_only_with_cdevs() {
        assert_eq!(
            device_nodes([6, 5, 6], []),
            ["vfio/vfio", "vfio/6", "vfio/5"]
        );
        assert_eq!(
            device_nodes([5], ["vfio3"]),
            ["vfio/vfio", "vfio/5", "iommu", "vfio/devices/vfio3"]
        );
    }
}
