//! One PCI function as sysfs shows it, read into a snapshot.
//!
//! Parsers take the text of a sysfs attribute and are tested on captured contents;
//! [`PciDevice::read`] adds the paths.
//!
//! ```no_run
//! use sysfs_pci::{Host, PciDevice};
//! let host = Host::default();
//! let dev = PciDevice::read(&host, &"0000:3b:00.0".parse().unwrap()).unwrap();
//! println!("{} {:04x}:{:04x} on {:?}", dev.address, dev.vendor, dev.device, dev.driver);
//! ```

use std::path::{Path, PathBuf};

use crate::attribute::{read_attribute, read_optional_attribute};
use crate::{Host, PciAddress};
use support::io::{Action, IoError, WrapIo};

/// A malformed sysfs attribute.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The device directory does not exist.
    #[error("no PCI device {address} ({path} does not exist)")]
    NotFound {
        /// The address asked for.
        address: PciAddress,
        /// The directory looked for.
        path: PathBuf,
    },
    /// A file could not be read.
    #[error(transparent)]
    Io(#[from] IoError),
    /// A file held something we cannot parse.
    #[error("unexpected contents {contents:?} in {path}: {expected}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What it held.
        contents: String,
        /// What was expected.
        expected: &'static str,
    },
}

/// SR-IOV capability of a physical function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Sriov {
    /// `sriov_totalvfs`: how many VFs the PF supports.
    pub total_vfs: u32,
    /// `sriov_numvfs`: how many VFs are enabled now.
    pub num_vfs: u32,
}

/// A snapshot of one PCI function.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PciDevice {
    /// The function's address.
    pub address: PciAddress,
    /// `vendor`.
    pub vendor: u16,
    /// `device`.
    pub device: u16,
    /// `class`, 24 bits (base, sub, prog-if).
    pub class: u32,
    /// `subsystem_vendor`, when present.
    pub subsystem_vendor: Option<u16>,
    /// `subsystem_device`, when present.
    pub subsystem_device: Option<u16>,
    /// The bound driver's name (`driver` link), if any.
    pub driver: Option<String>,
    /// `driver_override`, `None` when unset (`(null)`) or absent.
    pub driver_override: Option<String>,
    /// The IOMMU group (`iommu_group` link); `None` when the IOMMU is off.
    pub iommu_group: Option<u32>,
    /// `numa_node`; `None` for `-1` or absent.
    pub numa_node: Option<u32>,
    /// SR-IOV state when this is a PF.
    pub sriov: Option<Sriov>,
    /// The PF of this VF (`physfn` link).
    pub physfn: Option<PciAddress>,
    /// Header type (low 7 bits of config byte 0x0e) of a bridge-class (06xx) function,
    /// when its config space is readable; not read for other classes.
    pub header_type: Option<u8>,
    /// PCI functions above this one, nearest first (from the canonical sysfs path).
    pub upstream: Vec<PciAddress>,
}

impl DeviceError {
    /// True when the device vanished (hot-unplug, `remove`) while being read.
    pub fn is_gone(&self) -> bool {
        match self {
            DeviceError::NotFound { .. } => true,
            DeviceError::Io(e) => e.is_gone(),
            DeviceError::Parse { .. } => false,
        }
    }
}

/// How much of a device [`PciDevice::read_with`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detail {
    /// Every attribute: what binding and restoring need.
    Full,
    /// What selecting a device and judging its health need: ids, class, driver, IOMMU
    /// group, NUMA node and the upstream chain. `subsystem_vendor`,
    /// `subsystem_device`, `driver_override`, `sriov` and `physfn` are not read and
    /// stay `None`.
    Brief,
}

impl PciDevice {
    /// Reads the device at `address` under `host`, every attribute.
    pub fn read(host: &Host, address: &PciAddress) -> Result<Self, DeviceError> {
        Self::read_with(host, address, Detail::Full)
    }

    /// Reads the device at `address` under `host`, as much as `detail` says.
    pub fn read_with(
        host: &Host,
        address: &PciAddress,
        detail: Detail,
    ) -> Result<Self, DeviceError> {
        Self::read_known(host, address, detail, None)
    }

    /// [`Self::read_with`], with `vendor` already read by the caller (so each
    /// attribute is read once).
    pub fn read_known(
        host: &Host,
        address: &PciAddress,
        detail: Detail,
        vendor: Option<u16>,
    ) -> Result<Self, DeviceError> {
        let dir = host.device_dir(address);
        // The first read tells a missing device apart from a malformed one.
        let upstream = match upstream_chain(&dir) {
            Err(e) if e.is_gone() => {
                return Err(DeviceError::NotFound {
                    address: *address,
                    path: dir,
                })
            }
            other => other?,
        };
        let hex16 = |name: &str| -> Result<Option<u16>, DeviceError> {
            let path = dir.join(name);
            let Some(text) = read_optional_attribute(&path)? else {
                return Ok(None);
            };
            parse_hex(&text)
                .and_then(|v| u16::try_from(v).ok())
                .map(Some)
                .ok_or_else(|| parse_error(&path, &text, "a 16-bit hex id like 0x1eff"))
        };
        let required = |name: &str| -> Result<u16, DeviceError> {
            hex16(name)?.ok_or_else(|| {
                let path = dir.join(name);
                let source = std::io::Error::from(std::io::ErrorKind::NotFound);
                DeviceError::Io(IoError::new(Action::Read, &path, source))
            })
        };
        let vendor = match vendor {
            Some(v) => v,
            None => required("vendor")?,
        };
        let device = required("device")?;
        let class_path = dir.join("class");
        let class_text = read_attribute(&class_path)?;
        let class = parse_hex(&class_text)
            .filter(|c| *c <= 0xff_ffff)
            .ok_or_else(|| parse_error(&class_path, &class_text, "a 24-bit hex class"))?;
        let full = detail == Detail::Full;
        Ok(Self {
            address: *address,
            vendor,
            device,
            class,
            subsystem_vendor: if full {
                hex16("subsystem_vendor")?
            } else {
                None
            },
            subsystem_device: if full {
                hex16("subsystem_device")?
            } else {
                None
            },
            driver: link_name(&dir.join("driver"))?,
            driver_override: if full {
                read_optional_attribute(&dir.join("driver_override"))?
                    .and_then(|s| parse_driver_override(&s))
            } else {
                None
            },
            iommu_group: read_group(&dir)?,
            numa_node: read_numa(&dir)?,
            sriov: if full { read_sriov(&dir)? } else { None },
            physfn: if full {
                read_link_address(&dir.join("physfn"))?
            } else {
                None
            },
            // Only bridges have a header type that matters; config space is read for
            // the bridge class alone.
            header_type: if class >> 16 == 0x06 {
                read_header_type(&dir)
            } else {
                None
            },
            upstream,
        })
    }

    /// The ids the resource list selects on.
    pub fn ids(&self) -> DeviceIds {
        DeviceIds {
            vendor: self.vendor,
            device: self.device,
            class: self.class,
        }
    }

    /// True for PCI-to-PCI bridges (class 0604, or a bridge-class 06xx function with
    /// header type 1): never rebound.
    pub fn is_bridge(&self) -> bool {
        self.class >> 8 == 0x0604 || self.header_type == Some(1)
    }

    /// True when this PF has VFs enabled (it cannot be bound to vfio-pci then).
    pub fn has_vfs_enabled(&self) -> bool {
        self.sriov.is_some_and(|s| s.num_vfs > 0)
    }

    /// The nearest upstream PCI function (a bridge or root port), if any.
    pub fn parent_bridge(&self) -> Option<PciAddress> {
        self.upstream.first().copied()
    }
}

/// Lists every PCI function under `host`, sorted by address.
pub fn list_addresses(host: &Host) -> Result<Vec<PciAddress>, IoError> {
    let dir = host.pci_devices_dir();
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).wrap(Action::List, &dir)? {
        let entry = entry.wrap(Action::List, &dir)?;
        if let Some(addr) = entry.file_name().to_str().and_then(|s| s.parse().ok()) {
            out.push(addr);
        }
    }
    out.sort();
    Ok(out)
}

/// The longest stretch of a malformed attribute quoted in an error.
const QUOTE_CHARS: usize = 64;

fn parse_error(path: &Path, text: &str, expected: &'static str) -> DeviceError {
    let mut contents: String = text.chars().take(QUOTE_CHARS).collect();
    if text.chars().nth(QUOTE_CHARS).is_some() {
        contents.push_str("...");
    }
    DeviceError::Parse {
        path: path.to_owned(),
        contents,
        expected,
    }
}

/// Parses a sysfs hex value such as `0x1eff` (prefix optional).
pub fn parse_hex(text: &str) -> Option<u32> {
    let t = text.trim();
    let digits = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(digits, 16).ok()
}

/// Parses `driver_override`: `(null)` or empty means unset.
pub fn parse_driver_override(text: &str) -> Option<String> {
    let t = text.trim();
    (!t.is_empty() && t != "(null)").then(|| t.to_owned())
}

/// Parses `numa_node`: `-1` means no NUMA affinity.
pub fn parse_numa_node(text: &str) -> Option<Option<u32>> {
    let v: i64 = text.trim().parse().ok()?;
    match v {
        -1 => Some(None),
        v => u32::try_from(v).ok().map(Some),
    }
}

/// The file name a symlink points at (`driver` → `e1000e`), `None` when absent.
pub fn link_name(path: &Path) -> Result<Option<String>, IoError> {
    match std::fs::read_link(path) {
        Ok(target) => Ok(target.file_name().map(|n| n.to_string_lossy().into_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(IoError::new(Action::ReadLink, path, e)),
    }
}

fn read_link_address(path: &Path) -> Result<Option<PciAddress>, DeviceError> {
    Ok(link_name(path)?.and_then(|n| n.parse().ok()))
}

fn read_group(dir: &Path) -> Result<Option<u32>, DeviceError> {
    let path = dir.join("iommu_group");
    match link_name(&path)? {
        None => Ok(None),
        Some(name) => parse_decimal(&name)
            .map(Some)
            .ok_or_else(|| parse_error(&path, &name, "a link to an IOMMU group number")),
    }
}

/// The device's fatal PCIe error count since boot, from its `aer_dev_fatal`
/// (lines `<error name> <count>`, the total on `TOTAL_ERR_FATAL`); `None` where sysfs
/// has no such file (no AER, an older kernel) or it cannot be read.
pub fn aer_fatal_total(host: &Host, address: &PciAddress) -> Option<u64> {
    let text = std::fs::read_to_string(host.device_dir(address).join("aer_dev_fatal")).ok()?;
    text.lines().find_map(|l| {
        let (name, count) = l.trim().rsplit_once(char::is_whitespace)?;
        (name.trim() == "TOTAL_ERR_FATAL")
            .then(|| count.trim().parse().ok())
            .flatten()
    })
}

/// The IOMMU group of the device at `address`, read on its own (for naming the group
/// of a device whose other attributes are malformed).
pub fn iommu_group_of(host: &Host, address: &PciAddress) -> Result<Option<u32>, DeviceError> {
    read_group(&host.device_dir(address))
}

fn read_numa(dir: &Path) -> Result<Option<u32>, DeviceError> {
    let path = dir.join("numa_node");
    match read_optional_attribute(&path)? {
        None => Ok(None),
        Some(text) => parse_numa_node(&text)
            .ok_or_else(|| parse_error(&path, &text, "-1 or a NUMA node number")),
    }
}

fn read_count(path: &Path) -> Result<Option<u32>, DeviceError> {
    match read_optional_attribute(path)? {
        None => Ok(None),
        Some(text) => parse_decimal(&text)
            .map(Some)
            .ok_or_else(|| parse_error(path, &text, "a decimal count")),
    }
}

/// Parses an unsigned decimal number, no sign, no spaces: a count such as
/// `sriov_numvfs` (`4`), or the group an `iommu_group` link names
/// (`.../iommu_groups/17` → 17).
pub fn parse_decimal(text: &str) -> Option<u32> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn read_sriov(dir: &Path) -> Result<Option<Sriov>, DeviceError> {
    let total = read_count(&dir.join("sriov_totalvfs"))?;
    let num = read_count(&dir.join("sriov_numvfs"))?;
    Ok(match (total, num) {
        (None, None) => None,
        (total, num) => Some(Sriov {
            total_vfs: total.unwrap_or(0),
            num_vfs: num.unwrap_or(0),
        }),
    })
}

/// Header type from config space byte 0x0e; `None` when config is absent or short.
fn read_header_type(dir: &Path) -> Option<u8> {
    use std::io::Read;
    let mut buf = [0u8; 0x0f];
    let mut f = std::fs::File::open(dir.join("config")).ok()?;
    f.read_exact(&mut buf).ok()?;
    Some(buf[0x0e] & 0x7f)
}

/// Parses the PCI functions above a device from its canonical sysfs path
/// (`/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0` → `[0000:00:01.0]`).
pub fn parse_upstream(canonical: &Path) -> Vec<PciAddress> {
    let mut chain: Vec<PciAddress> = canonical
        .components()
        .filter_map(|c| c.as_os_str().to_str()?.parse().ok())
        .collect();
    chain.pop(); // the device itself
    chain.reverse();
    chain
}

fn upstream_chain(dir: &Path) -> Result<Vec<PciAddress>, DeviceError> {
    // `bus/pci/devices/<addr>` is a link into `devices/`: its target names every
    // function above the device, so one readlink does what resolving the path
    // component by component would.
    match std::fs::read_link(dir) {
        Ok(target) => Ok(parse_upstream(&target)),
        // Not a link (a copied tree): resolve it.
        Err(e) if e.raw_os_error() == Some(nix::libc::EINVAL) => {
            let canonical = std::fs::canonicalize(dir).wrap(Action::ReadLink, dir)?;
            Ok(parse_upstream(&canonical))
        }
        Err(e) => Err(IoError::new(Action::ReadLink, dir, e).into()),
    }
}

/// Identity of a PCI function as the selectors see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceIds {
    /// PCI vendor id.
    pub vendor: u16,
    /// PCI device id.
    pub device: u16,
    /// 24-bit class code, e.g. `0x120000` (base class, subclass, programming interface).
    pub class: u32,
}

impl std::fmt::Display for DeviceIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:04x}:{:04x} class {:06x}",
            self.vendor,
            self.device,
            self.class & 0xff_ffff
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_values_as_sysfs_prints_them() {
        assert_eq!(parse_hex("0x1eff\n"), Some(0x1eff));
        assert_eq!(parse_hex("0x120000"), Some(0x12_0000));
        assert_eq!(parse_hex("10DE"), Some(0x10de));
        assert_eq!(parse_hex("0x"), None);
        assert_eq!(parse_hex("0xzz"), None);
        assert_eq!(parse_hex(""), None);
    }

    #[test]
    fn driver_override_null_means_unset() {
        assert_eq!(parse_driver_override("(null)\n"), None);
        assert_eq!(parse_driver_override("\n"), None);
        assert_eq!(
            parse_driver_override("vfio-pci\n").as_deref(),
            Some("vfio-pci")
        );
    }

    #[test]
    fn numa_node_minus_one_is_none() {
        assert_eq!(parse_numa_node("-1\n"), Some(None));
        assert_eq!(parse_numa_node("1"), Some(Some(1)));
        assert_eq!(parse_numa_node("-2"), None);
        assert_eq!(parse_numa_node("x"), None);
    }

    #[test]
    fn upstream_chain_nearest_first() {
        let p = Path::new(
            "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:03.0/0000:03:00.1",
        );
        let chain: Vec<String> = parse_upstream(p).iter().map(|a| a.to_string()).collect();
        assert_eq!(chain, ["0000:02:03.0", "0000:01:00.0", "0000:00:01.0"]);
        assert!(parse_upstream(Path::new("/sys/devices/pci0000:00/0000:00:02.0")).is_empty());
    }

    mod hostile {
        use super::*;
        use crate::testing::{FakeDevice, FakeNode};
        use proptest::prelude::*;

        /// Every attribute `PciDevice::read` opens.
        const ATTRIBUTES: &[&str] = &[
            "vendor",
            "device",
            "class",
            "subsystem_vendor",
            "subsystem_device",
            "driver_override",
            "numa_node",
            "sriov_totalvfs",
            "sriov_numvfs",
            "config",
        ];

        proptest! {
            #[test]
            fn attribute_parsers_never_panic(text in any::<String>()) {
                let _ = parse_hex(&text);
                let _ = parse_numa_node(&text);
                let _ = parse_driver_override(&text);
                let _ = parse_decimal(&text);
                let _ = parse_upstream(Path::new(&text));
            }

            #[test]
            fn attribute_parsers_never_panic_on_lossy_bytes(
                bytes in proptest::collection::vec(any::<u8>(), 0..64),
            ) {
                let text = String::from_utf8_lossy(&bytes);
                let _ = parse_hex(&text);
                let _ = parse_numa_node(&text);
                let _ = parse_driver_override(&text);
                let _ = parse_decimal(&text);
            }

            #[test]
            fn parsers_read_back_what_the_kernel_prints(
                v in any::<u32>(),
                n in 0..=i64::from(u32::MAX),
            ) {
                prop_assert_eq!(parse_hex(&format!("0x{v:04x}\n")), Some(v));
                prop_assert_eq!(parse_numa_node(&format!("{n}\n")), Some(u32::try_from(n).ok()));
                prop_assert_eq!(parse_decimal(&v.to_string()), Some(v));
            }

            /// Arbitrary bytes in any one attribute: the read succeeds or fails with an
            /// error naming the device's directory; it never panics.
            #[test]
            fn reading_a_device_with_arbitrary_bytes_never_panics(
                which in 0..ATTRIBUTES.len(),
                bytes in proptest::collection::vec(any::<u8>(), 0..80),
            ) {
                let dir = tempfile::tempdir_in(crate::testing::scratch_root()).unwrap();
                let node = FakeNode::new(dir.path());
                let address: PciAddress = "0000:01:00.0".parse().unwrap();
                node.add_device(&FakeDevice::new("0000:01:00.0", 0x8086, 0x10d3, 0x02_0000).group(3));
                let file = node.canonical_dir(&address).join(ATTRIBUTES[which]);
                std::fs::write(file, &bytes).unwrap();
                let path = node.host.device_dir(&address).join(ATTRIBUTES[which]);
                match PciDevice::read(&node.host, &address) {
                    Ok(d) => prop_assert_eq!(d.address, address),
                    Err(e) => {
                        let message = support::error_chain(&e);
                        prop_assert!(message.contains(&path.display().to_string()), "{}", message);
                        prop_assert!(message.len() < 1024, "{}", message);
                    }
                }
            }
        }
    }
}
