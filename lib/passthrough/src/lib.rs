//! The passthrough engine of vfio-sandbox: which devices a node hands to VMs and
//! the moves that hand them over, whole IOMMU group by whole IOMMU group.
//!
//! - [`config`]: the resource list (one JSON document, built-in presets) that says
//!   which PCI functions are selected and what each is advertised as;
//! - [`inventory`]: the node's selected devices, their groups and companions;
//! - [`state`]: the state file that records every device before it is touched, and
//!   the claims the DRA driver holds;
//! - [`owner`]: the node-wide owner lock (vfio-manager or the DRA driver, never both);
//! - [`engine`]: the whole-group binder, [`Passthrough`]: the one place where "bind"
//!   and "restore" of whole groups live, for vfio-manager and the DRA driver alike.
//!
//! It sits on the sysfs PCI layer (`sysfs-pci`) and knows nothing of Kubernetes.

pub mod config;
pub mod engine;
pub mod inventory;
pub mod owner;
pub mod state;

pub use engine::{
    target_drivers, BindReport, Passthrough, PassthroughError, RestoreReport, StepError,
    DEFAULT_BIND_JOBS, VFIO_MODULES,
};
