//! Whether the node isolates device interrupts (MSIs), without which no VM can be
//! given a device.
//!
//! # What the kernel decides, and where we read it
//!
//! A device given to a VM can write any address, and an MSI is a write. Unless the
//! interrupt controller checks who wrote it, the guest can raise any interrupt on
//! the host. So when a VMM attaches a group, `vfio_iommu_type1`
//! (`vfio_iommu_type1_attach_group`) and iommufd (`iommufd_group_setup_msi`) ask
//! `iommu_group_has_isolated_msi()` (`drivers/iommu/iommu.c`), which holds when
//! every device's MSI irq domain, or one of its parents, carries
//! `IRQ_DOMAIN_FLAG_ISOLATED_MSI` (`msi_device_has_isolated_msi()`,
//! `kernel/irq/msi.c`). If not, the attach fails with `EPERM` ("No interrupt
//! remapping support. Use the module param "allow_unsafe_interrupts" to enable
//! VFIO IOMMU support on this platform") unless that module parameter is set.
//!
//! The flag is set by the domains that check the writer:
//! - x86, Intel VT-d and AMD-Vi **interrupt remapping** (`intel/irq_remapping.c`,
//!   `amd/iommu.c`); with it on, every interrupt chip below it is named `IR-…`:
//!   `IR-IO-APIC`, `IR-PCI-MSI…`, `IR-HPET`. With it off (`intremap=off`, firmware
//!   without it) they are `IO-APIC`, `PCI-MSI…`;
//! - arm64, the **GICv3 ITS** (`irq-gic-v3-its.c`, `msi_domain_flags`); its MSI
//!   domains are named `ITS-…` (`ITS-MSI`, `ITS-PCI-MSIX-…`). A GICv2m frame
//!   (`GICv2m-…`) does not isolate.
//!
//! Userspace sees no flag, but it sees those domains by their chips' names:
//! `/sys/kernel/irq/<n>/chip_name`, the same column `/proc/interrupts` shows, under
//! the sysfs root we are given (so fake trees and containers read it alike). The
//! module parameters are `/sys/module/{vfio_iommu_type1,iommufd}/parameters/
//! allow_unsafe_interrupts`. On Intel, `/sys/class/iommu/dmar*/intel-iommu/ecap`
//! (bit 3, IR) says whether the hardware could remap, which tells "turned off"
//! from "not there" in the advice.

use std::collections::BTreeSet;
use std::fmt;

use crate::Host;

/// The modules whose `allow_unsafe_interrupts` lets a VMM attach a device anyway.
pub const UNSAFE_INTERRUPT_MODULES: [&str; 2] = ["vfio_iommu_type1", "iommufd"];

/// What isolates device interrupts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolator {
    /// x86 interrupt remapping (Intel VT-d, AMD-Vi): `IR-` chips.
    InterruptRemapping,
    /// The arm64 GICv3 ITS: `ITS-` chips.
    GicIts,
}

impl fmt::Display for Isolator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::InterruptRemapping => "interrupt remapping",
            Self::GicIts => "the GICv3 ITS",
        })
    }
}

/// What the node shows of its interrupt isolation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InterruptIsolation {
    /// The distinct interrupt chip names under `/sys/kernel/irq` (a per-device
    /// domain's `-<bdf>` suffix dropped).
    pub chips: BTreeSet<String>,
    /// The modules loaded with `allow_unsafe_interrupts` on.
    pub unsafe_allowed: Vec<&'static str>,
    /// Whether an Intel VT-d unit can remap interrupts (`ecap` bit 3); `None`
    /// without VT-d units.
    pub vtd_can_remap: Option<bool>,
}

/// The verdict on a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// MSIs are isolated: a VMM can take the devices.
    Isolated(Isolator),
    /// Not isolated, but a module lets VMMs take devices anyway.
    UnsafeAllowed,
    /// Not isolated: every VMM is refused the devices.
    Missing,
}

impl InterruptIsolation {
    /// Reads what `host`'s sysfs shows.
    pub fn read(host: &Host) -> Self {
        let irq = host.sysfs.join("kernel/irq");
        let names = std::fs::read_dir(&irq)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("chip_name")).ok());
        let unsafe_allowed = Self::read_unsafe_allowed(host);
        let ecaps = std::fs::read_dir(host.sysfs.join("class/iommu"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("intel-iommu/ecap")).ok());
        Self::from_parts(names, unsafe_allowed, ecaps)
    }

    /// The modules loaded with `allow_unsafe_interrupts` on: unlike the chips,
    /// this can change while the node runs (the parameters are writable).
    pub fn read_unsafe_allowed(host: &Host) -> Vec<&'static str> {
        UNSAFE_INTERRUPT_MODULES
            .into_iter()
            .filter(|m| {
                let p = host
                    .sysfs
                    .join("module")
                    .join(m)
                    .join("parameters/allow_unsafe_interrupts");
                std::fs::read_to_string(p).is_ok_and(|v| parse_bool_param(&v))
            })
            .collect()
    }

    /// The same from the files' texts: chip names, the modules with unsafe
    /// interrupts allowed, and the VT-d units' `ecap` values (hex).
    pub fn from_parts<S: AsRef<str>>(
        chip_names: impl IntoIterator<Item = S>,
        unsafe_allowed: Vec<&'static str>,
        ecaps: impl IntoIterator<Item = S>,
    ) -> Self {
        let chips = chip_names
            .into_iter()
            .map(|n| chip_kind(n.as_ref().trim()).to_owned())
            .filter(|n| !n.is_empty())
            .collect();
        let mut vtd_can_remap = None;
        for e in ecaps {
            let text = e.as_ref().trim();
            let text = text.strip_prefix("0x").unwrap_or(text);
            if let Ok(ecap) = u64::from_str_radix(text, 16) {
                let ir = ecap & (1 << 3) != 0;
                vtd_can_remap = Some(vtd_can_remap.unwrap_or(false) || ir);
            }
        }
        Self {
            chips,
            unsafe_allowed,
            vtd_can_remap,
        }
    }

    /// What isolates MSIs here, if anything.
    pub fn isolator(&self) -> Option<Isolator> {
        if self.chips.iter().any(|c| c.starts_with("IR-")) {
            Some(Isolator::InterruptRemapping)
        } else if self.chips.iter().any(|c| c.starts_with("ITS-")) {
            Some(Isolator::GicIts)
        } else {
            None
        }
    }

    /// The verdict.
    pub fn verdict(&self) -> Verdict {
        match self.isolator() {
            Some(i) => Verdict::Isolated(i),
            None if !self.unsafe_allowed.is_empty() => Verdict::UnsafeAllowed,
            None => Verdict::Missing,
        }
    }

    /// The chips as named in messages: at most six, then how many more.
    fn chips_shown(&self) -> String {
        if self.chips.is_empty() {
            return "none listed under /sys/kernel/irq".to_owned();
        }
        let mut shown: Vec<&str> = self.chips.iter().map(String::as_str).take(6).collect();
        let more = self.chips.len().saturating_sub(shown.len());
        let more = format!("{more} more");
        if self.chips.len() > 6 {
            shown.push(&more);
        }
        shown.join(", ")
    }

    /// What was found, one line: the isolator and its chips, or the cause.
    pub fn finding(&self) -> String {
        match self.verdict() {
            Verdict::Isolated(i) => format!(
                "device interrupts are isolated by {i} (interrupt chips: {})",
                self.chips_shown()
            ),
            Verdict::UnsafeAllowed | Verdict::Missing => format!(
                "no interrupt domain isolates device MSIs (interrupt chips: {}), so \
                    vfio_iommu_type1 and iommufd refuse to attach a device's group to \
                    a VM (EPERM, \"No interrupt remapping support\")",
                self.chips_shown()
            ),
        }
    }

    /// How to fix a node without isolation.
    pub fn fix(&self) -> String {
        format!(
            "{}; as a last resort, knowing what it gives up, load vfio_iommu_type1 \
                with allow_unsafe_interrupts=1",
            self.hardware_fix()
        )
    }

    /// What makes the hardware isolate MSIs here.
    fn hardware_fix(&self) -> &'static str {
        if self.chips.iter().any(|c| c.starts_with("GIC")) {
            return "the platform needs a GICv3 with an ITS for MSIs (a GICv2m frame \
                does not isolate them): enable it in the firmware (ACPI MADT / device \
                tree)";
        }
        match self.vtd_can_remap {
            Some(true) => {
                "the VT-d unit can remap interrupts but remapping is off: \
                    remove intremap=off from the kernel command line (and keep \
                    intel_iommu=on), then reboot"
            }
            _ => {
                "turn interrupt remapping on: enable VT-d / AMD-Vi with interrupt \
                    remapping (and x2APIC) in the firmware, keep intremap=off and \
                    amd_iommu_intr=legacy off the kernel command line, then reboot"
            }
        }
    }

    /// What passing without isolation gives up, when a module allows it.
    pub fn warning(&self) -> Option<String> {
        (self.verdict() == Verdict::UnsafeAllowed).then(|| {
            let on: Vec<String> = self
                .unsafe_allowed
                .iter()
                .map(|m| format!("{m}.allow_unsafe_interrupts=1"))
                .collect();
            format!(
                "{} lets VMs take devices without interrupt isolation: a guest's \
                    device can then write any MSI and raise interrupts on the host or \
                    in other guests; {}",
                on.join(" and "),
                self.hardware_fix()
            )
        })
    }
}

/// A chip's name without a per-device domain's `-<domain>:<bus>:<slot>.<fn>`
/// suffix (`IR-PCI-MSIX-0000:00:02.0` → `IR-PCI-MSIX`).
fn chip_kind(name: &str) -> &str {
    match name.rsplit_once('-') {
        Some((kind, addr)) if addr.parse::<crate::PciAddress>().is_ok() => kind,
        _ => name,
    }
}

/// A boolean module parameter's text (`Y`, `N`, `1`, `0`).
fn parse_bool_param(text: &str) -> bool {
    matches!(text.trim(), "Y" | "y" | "1")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(
        chips: &[&str],
        unsafe_allowed: Vec<&'static str>,
        ecaps: &[&str],
    ) -> InterruptIsolation {
        InterruptIsolation::from_parts(chips.iter().copied(), unsafe_allowed, ecaps.iter().copied())
    }

    /// Chip names as the kernels of the test bed list them.
    #[test]
    fn x86_with_and_without_interrupt_remapping() {
        let on = node(
            &[
                "IR-IO-APIC\n",
                "IR-PCI-MSIX-0000:00:02.0\n",
                "IR-PCI-MSI-0000:01:00.0",
                "DMAR-MSI",
            ],
            vec![],
            &["f00f5e"],
        );
        assert_eq!(
            on.verdict(),
            Verdict::Isolated(Isolator::InterruptRemapping)
        );
        assert!(on.chips.contains("IR-PCI-MSIX"), "{:?}", on.chips);
        assert!(
            on.finding().contains("isolated by interrupt remapping"),
            "{}",
            on.finding()
        );
        assert_eq!(on.warning(), None);

        // intremap=off on hardware that can remap (ecap bit 3 set).
        let off = node(
            &["IO-APIC", "PCI-MSIX-0000:00:02.0", "DMAR-MSI"],
            vec![],
            &["0xf00f5e"],
        );
        assert_eq!(off.vtd_can_remap, Some(true));
        assert_eq!(off.verdict(), Verdict::Missing);
        assert!(
            off.finding().contains("IO-APIC, PCI-MSIX"),
            "{}",
            off.finding()
        );
        assert!(off.finding().contains("No interrupt remapping support"));
        assert!(off.fix().contains("remove intremap=off"), "{}", off.fix());
        assert!(off.fix().contains("allow_unsafe_interrupts=1"));

        // No remapping in the hardware: the firmware advice.
        let none = node(&["IO-APIC", "PCI-MSI"], vec![], &["f00f56"]);
        assert_eq!(none.vtd_can_remap, Some(false));
        assert!(none.fix().contains("in the firmware"), "{}", none.fix());
    }

    #[test]
    fn arm64_needs_an_its() {
        let its = node(&["GICv3", "ITS-MSI", "ITS-pMSI"], vec![], &[]);
        assert_eq!(its.verdict(), Verdict::Isolated(Isolator::GicIts));
        let v2m = node(&["GICv2", "GICv2m-PCI-MSI"], vec![], &[]);
        assert_eq!(v2m.verdict(), Verdict::Missing);
        assert!(v2m.fix().contains("GICv3 with an ITS"), "{}", v2m.fix());
    }

    #[test]
    fn allow_unsafe_interrupts_passes_with_what_it_gives_up() {
        let n = node(&["IO-APIC", "PCI-MSI"], vec!["vfio_iommu_type1"], &[]);
        assert_eq!(n.verdict(), Verdict::UnsafeAllowed);
        let w = n.warning().expect("a warning");
        assert!(
            w.contains("vfio_iommu_type1.allow_unsafe_interrupts=1"),
            "{w}"
        );
        assert!(w.contains("raise interrupts on the host"), "{w}");
        assert!(!w.contains("last resort"), "{w}");
    }

    #[test]
    fn nothing_listed_is_no_isolation() {
        let n = node(&[], vec![], &[]);
        assert_eq!(n.verdict(), Verdict::Missing);
        assert!(n.finding().contains("none listed under /sys/kernel/irq"));
        assert_eq!(n.vtd_can_remap, None);
    }

    #[test]
    fn many_chips_are_cut_and_garbage_is_not_a_panic() {
        let names: Vec<String> = (0..20).map(|i| format!("CHIP{i}")).collect();
        let n = InterruptIsolation::from_parts(names.iter(), vec![], Vec::<&String>::new());
        assert!(n.finding().contains("14 more"), "{}", n.finding());
        for bad in ["", "-", "IR-", "x-0000:00:00.0", "\u{0}", "-0000:zz"] {
            let _ = node(&[bad], vec![], &[bad, "0x", "ffffffffffffffffffff"]).finding();
        }
        assert_eq!(chip_kind("IR-"), "IR-");
        assert!(parse_bool_param("Y\n") && !parse_bool_param("N\n"));
    }

    #[test]
    fn read_takes_the_sysfs_root() {
        let dir = tempfile::tempdir().unwrap();
        let host = Host::new(dir.path().join("sys"), dir.path().join("dev"), dir.path());
        for (n, chip) in [(0, "IO-APIC"), (24, "PCI-MSI-0000:00:03.0")] {
            let d = host.sysfs.join(format!("kernel/irq/{n}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("chip_name"), format!("{chip}\n")).unwrap();
        }
        let p = host.sysfs.join("module/vfio_iommu_type1/parameters");
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("allow_unsafe_interrupts"), "N\n").unwrap();
        let ecap = host.sysfs.join("class/iommu/dmar0/intel-iommu");
        std::fs::create_dir_all(&ecap).unwrap();
        std::fs::write(ecap.join("ecap"), "f00f5e\n").unwrap();
        let n = InterruptIsolation::read(&host);
        assert_eq!(n.verdict(), Verdict::Missing);
        assert_eq!(n.vtd_can_remap, Some(true));
        std::fs::write(p.join("allow_unsafe_interrupts"), "Y\n").unwrap();
        assert_eq!(
            InterruptIsolation::read(&host).verdict(),
            Verdict::UnsafeAllowed
        );
        std::fs::write(host.sysfs.join("kernel/irq/0/chip_name"), "IR-IO-APIC\n").unwrap();
        assert_eq!(
            InterruptIsolation::read(&host).verdict(),
            Verdict::Isolated(Isolator::InterruptRemapping)
        );
    }
}
