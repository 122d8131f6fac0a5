//! Device selectors: which PCI functions one entry of the list matches, and whether
//! two entries could match the same function.

use std::fmt;

use super::DeviceIds;
use sysfs_pci::address::PciAddress;

/// A class-code prefix of 2, 4 or 6 hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ClassPrefix {
    pub(super) value: u32,
    pub(super) digits: u32,
}

impl ClassPrefix {
    pub(super) fn matches(self, class: u32) -> bool {
        (class & 0xff_ffff) >> (4 * (6 - self.digits)) == self.value
    }

    /// Whether some class code starts with both prefixes; returns the longer one.
    pub(super) fn meet(self, other: Self) -> Option<Self> {
        let (short, long) = if self.digits <= other.digits {
            (self, other)
        } else {
            (other, self)
        };
        (long.value >> (4 * (long.digits - short.digits)) == short.value).then_some(long)
    }
}

impl fmt::Display for ClassPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self.digits as usize;
        write!(f, "{:0width$x}", self.value)?;
        for _ in self.digits..6 {
            f.write_str("x")?;
        }
        Ok(())
    }
}

/// Which devices an entry selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Selector {
    pub(super) vendor: u16,
    /// `None`: any device of the vendor.
    pub(super) devices: Option<Vec<u16>>,
    /// `None`: any class.
    pub(super) classes: Option<Vec<ClassPrefix>>,
    /// `None`: any address.
    pub(super) addresses: Option<Vec<PciAddress>>,
}

impl Selector {
    /// Whether the function at `address` with `ids` is selected: every key given
    /// must match.
    pub(super) fn matches(&self, address: &PciAddress, ids: &DeviceIds) -> bool {
        ids.vendor == self.vendor
            && self
                .devices
                .as_ref()
                .is_none_or(|devices| devices.contains(&ids.device))
            && self
                .classes
                .as_ref()
                .is_none_or(|classes| classes.iter().any(|c| c.matches(ids.class)))
            && self
                .addresses
                .as_ref()
                .is_none_or(|addresses| addresses.contains(address))
    }

    /// When both selectors could match one device, describes such a device.
    ///
    /// Each key narrows independently, so two selectors overlap exactly when every key
    /// leaves a common value: the same vendor, a common device id, a class code both
    /// prefixes allow, and a common address. An absent key allows anything, so an
    /// entry with `addresses` still overlaps one without them that matches the same
    /// model; only lists of addresses with nothing in common keep them apart.
    pub(super) fn overlap(&self, other: &Self) -> Option<String> {
        if self.vendor != other.vendor {
            return None;
        }
        let device = match (&self.devices, &other.devices) {
            (None, None) => None,
            (Some(ids), None) | (None, Some(ids)) => ids.first().copied(),
            (Some(a), Some(b)) => Some(*a.iter().find(|id| b.contains(id))?),
        };
        let class = match (&self.classes, &other.classes) {
            (None, None) => None,
            (Some(prefixes), None) | (None, Some(prefixes)) => prefixes.first().copied(),
            (Some(a), Some(b)) => Some(a.iter().find_map(|x| b.iter().find_map(|y| x.meet(*y)))?),
        };
        let address = match (&self.addresses, &other.addresses) {
            (None, None) => None,
            (Some(list), None) | (None, Some(list)) => list.first().copied(),
            (Some(a), Some(b)) => Some(*a.iter().find(|x| b.contains(x))?),
        };
        let device = device.map_or_else(|| "any device".to_owned(), |d| format!("device {d:04x}"));
        let class = class.map_or_else(|| "any class".to_owned(), |c| format!("class {c}"));
        let address = address.map_or_else(String::new, |a| format!(", address {a}"));
        Some(format!(
            "vendor {:04x}, {device}, {class}{address}",
            self.vendor
        ))
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "vendor {:04x}, ", self.vendor)?;
        match self.devices.as_deref() {
            None => f.write_str("any device")?,
            Some([one]) => write!(f, "device {one:04x}")?,
            Some(ids) => {
                let ids: Vec<String> = ids.iter().map(|id| format!("{id:04x}")).collect();
                write!(f, "devices {}", ids.join(" "))?;
            }
        }
        match self.classes.as_deref() {
            None => f.write_str(", any class")?,
            Some([one]) => write!(f, ", class {one}")?,
            Some(prefixes) => {
                let prefixes: Vec<String> = prefixes.iter().map(ToString::to_string).collect();
                write!(f, ", classes {}", prefixes.join(" "))?;
            }
        }
        match self.addresses.as_deref() {
            None => Ok(()),
            Some([one]) => write!(f, ", address {one}"),
            Some(addresses) => {
                let addresses: Vec<String> = addresses.iter().map(ToString::to_string).collect();
                write!(f, ", addresses {}", addresses.join(" "))
            }
        }
    }
}
