//! Devices ready before the pod binds (KEP-5007 device binding conditions, with
//! KEP-4817 claim device status).
//!
//! A device whose IOMMU group has to leave a native driver is published with
//! `bindingConditions: [<driver>/VfioReady]`, `bindingFailureConditions:
//! [<driver>/VfioFailed]` and `bindsToNode: true`; [`watch_claims`] has the
//! claims thread move a claim's groups as soon as it is allocated
//! (`Claims::move_early`) and writes the condition, so kubelet's prepare only
//! writes files. The whole protocol, as a user sees it: docs/sandbox-dra-driver.md
//! ("Ready before the pod binds").
//!
//! Upstream: `staging/src/k8s.io/api/resource/v1/types.go` (the fields, at most 4
//! conditions each), `pkg/apis/resource/validation/validation.go`
//! (`validateDeviceBindingParameters`: both lists or neither, qualified names, no
//! overlap), and `pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go`
//! (`isClaimReadyForBinding`: the status entry is matched by driver, pool and
//! device).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use passthrough::inventory::{Entry, Inventory, Role};
use sysfs_pci::PciAddress;

pub use claim_label::{failed_condition, ready_condition};

/// Which devices are published with binding conditions (`--binding-conditions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Devices whose IOMMU group has a member off its vfio driver between claims:
    /// the ones a move takes time for.
    Auto,
    /// Every device: the scheduler also waits while a group already on vfio-pci is
    /// checked whole.
    Always,
    /// None: every move happens at prepare, as without the feature.
    Off,
}

/// The driver each recorded device had before the driver moved it (its home
/// between claims), as the claims thread last saw the state file.
#[derive(Debug, Default)]
pub struct OriginalDrivers(Mutex<BTreeMap<PciAddress, Option<String>>>);

impl OriginalDrivers {
    /// Replaces what is known.
    pub fn set(&self, original_drivers: BTreeMap<PciAddress, Option<String>>) {
        *support::lock(&self.0) = original_drivers;
    }

    /// The driver `entry` is on between claims: the recorded one, else its own.
    fn home<'e>(
        &self,
        entry: &'e Entry,
        original_drivers: &'e BTreeMap<PciAddress, Option<String>>,
    ) -> Option<&'e str> {
        match original_drivers.get(&entry.device.address) {
            Some(recorded) => recorded.as_deref(),
            None => entry.device.driver.as_deref(),
        }
    }

    /// The selected devices that get binding conditions under `mode`.
    pub fn marked(&self, inv: &Inventory, mode: Mode) -> BTreeSet<PciAddress> {
        let original_drivers = support::lock(&self.0);
        inv.selected()
            .filter(|e| match mode {
                Mode::Off => false,
                Mode::Always => true,
                Mode::Auto => e.device.iommu_group.is_none_or(|g| {
                    inv.in_group(g).any(|m| {
                        !matches!(m.role, Role::Bridge)
                            && self.home(m, &original_drivers) != Some(m.target_driver.as_str())
                    })
                }),
            })
            .map(|e| e.device.address)
            .collect()
    }
}
