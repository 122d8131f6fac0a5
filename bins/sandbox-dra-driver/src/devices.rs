//! The devices this node offers: one per selected PCI function, and one per IOMMU
//! group of several selected functions (held whole through a counter set, or alone
//! where the API server keeps no counters), with the standard and our own
//! attributes (and Rebellions' own, [`rebellions`], for the devices the
//! `rebellions` preset names under `"naming": "pci-ids"`); devices prepare could
//! never hand over are withdrawn.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCounterConsumption, DeviceTaint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kubelet_plugin::Offer;
use kubelet_plugin::{PCIE_ROOT, PCI_BUS_ID};
use passthrough::config::{DeviceIds, ResourceList};
use passthrough::inventory::{Entry, Inventory};
use sysfs_pci::{PciAddress, PciDevice};

use crate::model::{device_name, group_device_name, reason};

mod rebellions;

/// The root bus of `dev`'s PCIe hierarchy as sysfs names it (`pciDDDD:BB`): the
/// bus of the topmost function on its canonical path (the root port, or the
/// device itself when it sits on the root bus). This is the `pciDDDD:BB`
/// directory under `/sys/devices` that the path starts from.
pub fn pcie_root(dev: &PciDevice) -> String {
    let top = dev.upstream.last().copied().unwrap_or(dev.address);
    format!("pci{:04x}:{:02x}", top.domain(), top.bus())
}

/// A selected device that is not offered, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct Withdrawn {
    pub address: PciAddress,
    /// Why prepare could not hand it over.
    pub reason: String,
}

/// Why `entry` cannot be offered, if it cannot.
///
/// The viability of [`sysfs_pci::group::judge`] is not the test here: between claims
/// the devices and their companions are on their native drivers, which is exactly
/// what prepare changes. What prepare cannot change withdraws a device: no IOMMU
/// group (the IOMMU is off), or a member of its group that would have to move but
/// has SR-IOV VFs enabled (vfio-pci refuses it; [`sysfs_pci::bind::check_bindable`]).
/// A group with a member that cannot be read is not in the inventory at all
/// ([`passthrough::inventory::SkipReason`]), nor is a device that is gone.
fn withdraw_reason(inv: &Inventory, entry: &Entry) -> Option<String> {
    let Some(group) = entry.device.iommu_group else {
        return Some("it has no IOMMU group (the IOMMU is off)".into());
    };
    if !inv.groups.contains_key(&group) {
        return Some(format!("its IOMMU group {group} was not read"));
    }
    inv.in_group(group)
        .find(|m| !m.is_bound() && m.device.has_vfs_enabled())
        .map(|m| {
            let vfs = m.device.sriov.map_or(0, |s| s.num_vfs);
            format!(
                "{} in its IOMMU group {group} has {vfs} SR-IOV VFs enabled, so \
                    vfio-pci cannot take it",
                m.device.address
            )
        })
}

/// The selected devices [`slice_devices`] leaves out, and why.
pub fn withdrawn(inv: &Inventory) -> Vec<Withdrawn> {
    inv.selected()
        .filter_map(|e| {
            withdraw_reason(inv, e).map(|reason| Withdrawn {
                address: e.device.address,
                reason,
            })
        })
        .collect()
}

fn string(s: String) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s),
        ..DeviceAttribute::default()
    }
}

fn int(i: u32) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i64::from(i)),
        ..DeviceAttribute::default()
    }
}

/// The ResourceSlice device for one selected function; `list` says whether it
/// also speaks Rebellions' vocabulary.
fn slice_device(entry: &Entry, list: &ResourceList) -> Option<Device> {
    let resource = entry.resource()?;
    let d = &entry.device;
    let mut attributes = BTreeMap::from([
        (PCI_BUS_ID.to_owned(), string(d.address.to_string())),
        (PCIE_ROOT.to_owned(), string(pcie_root(d))),
        ("vendorID".to_owned(), string(format!("0x{:04x}", d.vendor))),
        ("deviceID".to_owned(), string(format!("0x{:04x}", d.device))),
        ("resourceName".to_owned(), string(resource.to_string())),
    ]);
    if let Some(numa) = d.numa_node {
        attributes.insert("numaNode".into(), int(numa));
    }
    if let Some(group) = d.iommu_group {
        attributes.insert("iommuGroup".into(), int(group));
    }
    let ids = DeviceIds {
        vendor: d.vendor,
        device: d.device,
        class: d.class,
    };
    if let Some(product) = list.rebellions_product(&d.address, &ids) {
        attributes.extend(rebellions::attributes(d, &product));
    }
    Some(Device {
        name: device_name(&d.address),
        attributes: Some(attributes),
        ..Device::default()
    })
}

/// The devices this node offers, sorted by address: one per selected function
/// that is not [`withdrawn`], and one per IOMMU group of several selected
/// functions ([`marked_devices`] with every field kept); `list` is the resource
/// list `inv` was scanned with.
pub fn slice_devices(inv: &Inventory, list: &ResourceList) -> Vec<Device> {
    marked_devices(inv, list, &BTreeMap::new(), None, None, true).devices
}

/// Which devices carry binding conditions, and whose conditions they are.
#[derive(Debug, Clone, Copy)]
pub struct BindingMarks<'a> {
    /// The driver (the conditions' prefix).
    pub driver: &'a str,
    /// The devices that get them ([`crate::binding::OriginalDrivers::marked`]).
    pub devices: &'a std::collections::BTreeSet<PciAddress>,
}

/// The key of the taint a device that should not get new claims carries:
/// `<driver>/unhealthy` (KEP-5055 device taints, effect `NoSchedule`).
pub fn taint_key(driver: &str) -> String {
    format!("{driver}/unhealthy")
}

/// The counter set of IOMMU group `group` when it holds several selected
/// functions: `iommu-group-<group>`.
pub fn counter_set_name(group: u32) -> String {
    format!("iommu-group-{group}")
}

/// The one counter of a group's set: each of its function devices and its group
/// device takes it whole, so one allocation at a time holds the group.
pub const GROUP_COUNTER: &str = "held";

fn one() -> BTreeMap<String, Counter> {
    BTreeMap::from([(
        GROUP_COUNTER.to_owned(),
        Counter {
            value: Quantity("1".into()),
        },
    )])
}

/// The selected functions of each IOMMU group that holds several, by group, each
/// list ascending.
fn shared_groups(inv: &Inventory) -> BTreeMap<u32, Vec<PciAddress>> {
    let mut groups: BTreeMap<u32, Vec<PciAddress>> = BTreeMap::new();
    for e in inv.selected() {
        if let Some(g) = e.device.iommu_group {
            groups.entry(g).or_default().push(e.device.address);
        }
    }
    groups.retain(|_, members| members.len() > 1);
    for members in groups.values_mut() {
        members.sort_unstable();
    }
    groups
}

/// The device for a whole group: the attributes of its lowest function (so its
/// `pciBusID` is that function, the one a VM is handed when it takes one address
/// per request), and `functions` (every address, comma-separated) and
/// `functionCount`.
fn group_device(lowest: Device, members: &[PciAddress]) -> Device {
    let mut attributes = lowest.attributes.unwrap_or_default();
    let list: Vec<String> = members.iter().map(ToString::to_string).collect();
    attributes.insert("functions".into(), string(list.join(",")));
    attributes.insert(
        "functionCount".into(),
        int(u32::try_from(members.len()).unwrap_or(u32::MAX)),
    );
    Device {
        name: group_device_name(&members[0]),
        attributes: Some(attributes),
        ..Device::default()
    }
}

/// The devices this node offers, sorted by address, with the ones that should not
/// get new claims marked: `unhealthy` maps such a device to its reason (the health
/// board's), and an unpreparable one ([`withdrawn`]) has reason `Unpreparable`.
/// With `taint_driver` (the API server keeps device taints) every selected function
/// is offered and each marked one carries a `NoSchedule` taint `<driver>/unhealthy`
/// whose value is the reason: the scheduler leaves it alone, claims already on it
/// keep it, and `kubectl get resourceslice -o yaml` says why. Without, the marked
/// ones are left out, as before taints existed. With `binding`, each of its devices
/// carries the binding conditions of the `binding` module and `bindsToNode`.
/// `list` is the resource list `inv` was scanned with.
///
/// An IOMMU group with several selected functions cannot be split between claims
/// (all of it moves to vfio-pci for any one of them). With `counters` (the API
/// server keeps counter sets) it is a counter set of capacity one, which each of
/// its function devices and one more device for the whole group
/// (`group-<lowest address>`) consume whole: the scheduler gives one function or
/// the whole group to one claim, and nothing more of it to anyone until that claim
/// lets go. Without, only the group device is offered. A group device is marked
/// when any of its functions is (the first reason found), and carries binding
/// conditions when any of them does.
pub fn marked_devices(
    inv: &Inventory,
    list: &ResourceList,
    unhealthy: &BTreeMap<PciAddress, &str>,
    taint_driver: Option<&str>,
    binding: Option<BindingMarks<'_>>,
    counters: bool,
) -> Offer {
    let reason_of = |e: &Entry| {
        unhealthy
            .get(&e.device.address)
            .copied()
            .or_else(|| withdraw_reason(inv, e).map(|_| reason::UNPREPARABLE))
    };
    let mark = |d: &mut Device, reason: Option<&str>, bind: bool| {
        if let (Some(driver), Some(reason)) = (taint_driver, reason) {
            d.taints = Some(vec![DeviceTaint {
                key: taint_key(driver),
                value: Some(reason.to_owned()),
                effect: "NoSchedule".into(),
                time_added: None,
            }]);
        }
        if let Some(b) = binding.filter(|_| bind) {
            d.binding_conditions = Some(vec![crate::binding::ready_condition(b.driver)]);
            d.binding_failure_conditions = Some(vec![crate::binding::failed_condition(b.driver)]);
            d.binds_to_node = Some(true);
        }
    };
    let marked = |a: &PciAddress| binding.is_some_and(|b| b.devices.contains(a));
    let offered = |reason: Option<&str>| taint_driver.is_some() || reason.is_none();
    let shared = shared_groups(inv);
    let mut entries: Vec<&Entry> = inv.selected().collect();
    entries.sort_by_key(|e| e.device.address);
    let mut offer = Offer::default();
    for e in entries {
        let address = e.device.address;
        let Some(mut d) = slice_device(e, list) else {
            continue;
        };
        let group = e.device.iommu_group.and_then(|g| shared.get_key_value(&g));
        let Some((&g, members)) = group else {
            let reason = reason_of(e);
            if offered(reason) {
                mark(&mut d, reason, marked(&address));
                offer.devices.push(d);
            }
            continue;
        };
        let consumes = || {
            Some(vec![DeviceCounterConsumption {
                counter_set: counter_set_name(g),
                counters: one(),
            }])
        };
        let reason = reason_of(e);
        if counters && offered(reason) {
            mark(&mut d, reason, marked(&address));
            d.consumes_counters = consumes();
            offer.devices.push(d);
        }
        if members.last() != Some(&address) {
            continue;
        }
        // The group's last function: the group device after it, named after and
        // described as its lowest function.
        let lowest = inv.get(&members[0]).and_then(|l| slice_device(l, list));
        let Some(lowest) = lowest else {
            continue;
        };
        let reason = members
            .iter()
            .filter_map(|m| inv.get(m))
            .find_map(&reason_of);
        if offered(reason) {
            let mut whole = group_device(lowest, members);
            mark(&mut whole, reason, members.iter().any(marked));
            if counters {
                whole.consumes_counters = consumes();
            }
            offer.devices.push(whole);
        }
    }
    // One set per group any offered device draws on.
    for d in &offer.devices {
        for c in d.consumes_counters.iter().flatten() {
            if !offer.counter_sets.iter().any(|s| s.name == c.counter_set) {
                offer.counter_sets.push(CounterSet {
                    name: c.counter_set.clone(),
                    counters: one(),
                });
            }
        }
    }
    offer
}

#[cfg(test)]
mod tests;
