//! The small sysfs PCI layer of vfio-sandbox: what Linux shows of PCI devices under
//! `/sys` and `/dev`, and the writes that move a device between drivers.
//!
//! This is the bottom layer of the workspace (`passthrough` builds the engine on it,
//! `node-agent` and the binaries sit above): it knows nothing of resource lists,
//! claims or Kubernetes, and depends only on `support`, nix, serde, thiserror and
//! tracing.
//!
//! Every function that touches the node takes its roots from a [`Host`]: the real
//! `/sys`, `/dev` and `/lib/modules` are only defaults, so the same code runs on fake
//! trees in tests and on a real kernel. Every change to the node goes through a
//! [`kernel::Kernel`], so a dry run prints exactly the writes a real run makes.

pub mod address;
pub mod attribute;
pub mod bind;
pub mod cdev;
pub mod deadline;
pub mod device;
pub mod group;
pub mod host;
pub mod interrupts;
pub mod kernel;
pub mod module;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod uevent;
pub mod vfio_alias;
pub mod vfio_driver;
pub mod vmm;

pub use address::PciAddress;
pub use device::PciDevice;
pub use host::Host;
