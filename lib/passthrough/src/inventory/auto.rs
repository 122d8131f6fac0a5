//! `"driver": "auto"`: the vfio driver of each device, chosen per device from the
//! running kernel's own `vfio_pci:` aliases (see [`sysfs_pci::vfio_alias`]), so the
//! rest of the engine only ever sees a concrete driver.
//!
//! The rule, as NVIDIA's vfio-manage applies it: the most specific alias that matches
//! the device's `modalias`; `vfio-pci` when none does. When `modules.alias` cannot be
//! read (a container without the host's modules tree, such as the validator's or the
//! device plugin's), a device already on a vfio driver keeps it, since the agent that
//! can read the file chose it; any other device falls back to `vfio-pci`. Every choice
//! says why.

use std::fmt;
use std::path::PathBuf;

use support::error_chain;
use sysfs_pci::vfio_alias::{device_modalias, AliasTable, VfioAlias};
use sysfs_pci::vfio_driver::{is_vfio_driver, VFIO_PCI};
use sysfs_pci::{Host, PciDevice};

/// The driver `auto` chose for one device, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DriverChoice {
    /// The driver chosen, e.g. `nvgrace_gpu_vfio_pci` or `vfio-pci`.
    pub driver: String,
    /// The device's `modalias`, when it could be read.
    pub modalias: Option<String>,
    /// The `modules.alias` searched.
    pub file: PathBuf,
    /// The alias that chose the driver; `None` for a fallback.
    pub alias: Option<VfioAlias>,
    /// Why, when no alias chose it: e.g. `no vfio_pci alias matched, fallback`.
    pub fallback: Option<String>,
}

impl fmt::Display for DriverChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.alias, &self.fallback) {
            (Some(alias), _) => write!(
                f,
                "{} (auto: {} line {}: {alias})",
                self.driver,
                self.file.display(),
                alias.line
            ),
            (None, Some(why)) => write!(f, "{} (auto: {why})", self.driver),
            (None, None) => write!(f, "{} (auto)", self.driver),
        }
    }
}

/// Resolves `auto` for the devices of one scan, reading `modules.alias` once.
pub(super) struct AutoResolver<'a> {
    host: &'a Host,
    release: String,
    table: Option<Result<AliasTable, String>>,
}

impl<'a> AutoResolver<'a> {
    /// A resolver for the running kernel's release under `host`'s modules root.
    pub(super) fn new(host: &'a Host) -> Self {
        Self {
            host,
            release: sysfs_pci::module::kernel_release(),
            table: None,
        }
    }

    /// The driver for `device`.
    pub(super) fn choose(&mut self, device: &PciDevice) -> DriverChoice {
        let file = AliasTable::path(self.host, &self.release);
        let host = self.host;
        let release = &self.release;
        let table = self
            .table
            .get_or_insert_with(|| AliasTable::read(host, release).map_err(|e| error_chain(&e)));
        let fallback = |driver: &str, why: String| DriverChoice {
            driver: driver.to_owned(),
            modalias: None,
            file: file.clone(),
            alias: None,
            fallback: Some(why),
        };
        let table = match table {
            Ok(table) => table,
            Err(error) => {
                return match device.driver.as_deref().filter(|d| is_vfio_driver(d)) {
                    Some(bound) => {
                        fallback(bound, format!("{error}; keeping the vfio driver it is on"))
                    }
                    None => fallback(VFIO_PCI, format!("{error}; fallback")),
                }
            }
        };
        let modalias = match device_modalias(host, &device.address) {
            Ok(m) => m,
            Err(e) => return fallback(VFIO_PCI, format!("{}; fallback", error_chain(&e))),
        };
        match table.best_match(&modalias) {
            Some(alias) => DriverChoice {
                driver: alias.driver(),
                modalias: Some(modalias),
                file,
                alias: Some(alias.clone()),
                fallback: None,
            },
            None => DriverChoice {
                modalias: Some(modalias),
                ..fallback(VFIO_PCI, "no vfio_pci alias matched, fallback".to_owned())
            },
        }
    }
}

#[cfg(test)]
mod tests;
