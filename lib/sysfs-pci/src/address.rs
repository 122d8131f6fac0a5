//! The PCI address (`dddd:bb:ss.f`) as a typed value.
//!
//! ```
//! use sysfs_pci::PciAddress;
//! let a: PciAddress = "0000:3b:00.1".parse().unwrap();
//! assert_eq!(a.function(), 1);
//! assert_eq!(a.to_string(), "0000:3b:00.1");
//! assert!("3b:00.1".parse::<PciAddress>().is_ok(), "domain defaults to 0000");
//! assert!("0000:3b:20.0".parse::<PciAddress>().is_err(), "slot is 5 bits");
//! ```

use std::fmt;
use std::str::FromStr;

/// A PCI function address: domain, bus, slot (device) and function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress {
    domain: u32,
    bus: u8,
    slot: u8,
    function: u8,
}

/// Why a string is not a PCI address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not a PCI address (want dddd:bb:ss.f, e.g. 0000:3b:00.0): {reason}")]
pub struct ParseAddressError {
    input: String,
    reason: &'static str,
}

impl PciAddress {
    /// Builds an address; `None` when slot > 31 or function > 7.
    pub fn new(domain: u32, bus: u8, slot: u8, function: u8) -> Option<Self> {
        (slot < 32 && function < 8).then_some(Self {
            domain,
            bus,
            slot,
            function,
        })
    }

    /// PCI domain (segment).
    pub fn domain(&self) -> u32 {
        self.domain
    }

    /// Bus number.
    pub fn bus(&self) -> u8 {
        self.bus
    }

    /// Slot (device) number, 0..=31.
    pub fn slot(&self) -> u8 {
        self.slot
    }

    /// Function number, 0..=7.
    pub fn function(&self) -> u8 {
        self.function
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.slot, self.function
        )
    }
}

fn hex_field(s: &str, max_len: usize) -> Option<u32> {
    if s.is_empty() || s.len() > max_len || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

impl FromStr for PciAddress {
    type Err = ParseAddressError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseAddressError {
            input: input.to_owned(),
            reason,
        };
        let (rest, function) = input
            .rsplit_once('.')
            .ok_or_else(|| err("missing .function"))?;
        let mut parts: Vec<&str> = rest.split(':').collect();
        let domain = match parts.len() {
            3 => hex_field(parts.remove(0), 8).ok_or_else(|| err("bad domain"))?,
            2 => 0,
            _ => return Err(err("want domain:bus:slot")),
        };
        let bus = hex_field(parts[0], 2).ok_or_else(|| err("bad bus"))?;
        let slot = hex_field(parts[1], 2).ok_or_else(|| err("bad slot"))?;
        let function = hex_field(function, 1).ok_or_else(|| err("bad function"))?;
        // The field widths above bound bus to 8 bits; `new` range-checks slot and function.
        let slot = u8::try_from(slot).map_err(|_| err("slot must be 00-1f"))?;
        Self::new(domain, bus as u8, slot, function as u8)
            .ok_or_else(|| err("slot must be 00-1f and function 0-7"))
    }
}

impl serde::Serialize for PciAddress {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for PciAddress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_canonical_form() {
        for s in [
            "0000:00:00.0",
            "0000:3b:00.1",
            "10000:e1:1f.7",
            "ffff:ff:1f.7",
        ] {
            assert_eq!(s.parse::<PciAddress>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn accepts_upper_case_and_short_form() {
        let a: PciAddress = "0000:3B:00.1".parse().unwrap();
        assert_eq!(a.to_string(), "0000:3b:00.1");
        let b: PciAddress = "3b:00.1".parse().unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn rejects_malformed_input_without_panicking() {
        for s in [
            "",
            "0000:3b:00",
            "0000:3b:00.8",
            "0000:3b:20.0",
            "0000:3b:00.a",
            "0000:3bb:00.0",
            "0000:3b:0x.0",
            "x:3b:00.0",
            "0000:0000:3b:00.0",
            "0000:3b:00.0 ",
            "+000:3b:00.0",
            "000000000:3b:00.0",
        ] {
            let err = s.parse::<PciAddress>().unwrap_err();
            assert!(
                err.to_string().contains("is not a PCI address"),
                "{s}: {err}"
            );
        }
    }

    #[test]
    fn orders_by_domain_bus_slot_function() {
        let mut v: Vec<PciAddress> = ["0000:02:00.0", "0000:01:00.1", "0000:01:00.0"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        v.sort();
        assert_eq!(v[0].to_string(), "0000:01:00.0");
        assert_eq!(v[2].to_string(), "0000:02:00.0");
    }

    #[test]
    fn serializes_as_string() {
        let a: PciAddress = "0000:01:00.0".parse().unwrap();
        assert_eq!(serde_json::to_string(&a).unwrap(), "\"0000:01:00.0\"");
        let back: PciAddress = serde_json::from_str("\"0000:01:00.0\"").unwrap();
        assert_eq!(a, back);
    }

    mod hostile {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn parsing_never_panics_and_round_trips(text in any::<String>()) {
                if let Ok(a) = text.parse::<PciAddress>() {
                    prop_assert_eq!(a.to_string().parse::<PciAddress>(), Ok(a));
                }
            }

            #[test]
            fn every_address_prints_and_parses_back(
                d in any::<u16>(),
                b in any::<u8>(),
                s in 0u8..32,
                f in 0u8..8,
            ) {
                let a = PciAddress::new(u32::from(d), b, s, f).unwrap();
                prop_assert_eq!(a.to_string().parse::<PciAddress>(), Ok(a));
            }
        }
    }
}
