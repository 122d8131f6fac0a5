//! The sysfs PCI model shared by `vfio-manager`, `sandbox-validator`,
//! `sandbox-device-plugin` and `sandbox-dra-driver`.
//!
//! Every function that touches the node takes its roots from a [`Host`]: the real
//! `/sys`, `/dev` and `/lib/modules` are only defaults, so the same code runs on fake
//! trees in tests and on a real kernel. Every change to the node goes through a
//! [`kernel::Kernel`], so a dry run prints exactly the writes a real run makes.

pub mod address;
pub mod cdi;
pub mod claims;
#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "kube")]
pub mod cluster;
pub mod config;
pub mod device;
#[cfg(feature = "kube")]
pub mod dra;
pub mod driver;
pub mod failpoint;
pub mod fake;
pub mod group;
pub mod host;
pub mod inventory;
pub mod io;
pub mod kernel;
#[cfg(feature = "metrics")]
pub mod metrics;
pub mod module;
pub mod out;
pub mod owner;
pub mod passthrough;
pub mod ready;
pub mod state;
pub mod uevent;

pub use address::PciAddress;

/// An error and all its sources on one line, `: `-separated. Messages never repeat
/// their source, so this is how every error reaches a person.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
pub use device::PciDevice;
pub use host::Host;
