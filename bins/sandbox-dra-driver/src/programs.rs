//! The programs the DRA driver names: itself, and the one other program that
//! moves a node's devices, vfio-manager (a node runs one of them, never both; see
//! `passthrough::owner`). The hints are the driver's advice to its reader.

use passthrough::owner::Program;

/// The DRA driver, as its state-lock refusal names it.
pub static DRA_DRIVER: Program = Program {
    name: "sandbox-dra-driver",
    release_hint: "",
    lock_hint: " on this node",
};

/// vfio-manager, and what the operator does so that it lets the node go.
pub static VFIO_MANAGER: Program = Program {
    name: "vfio-manager",
    release_hint: "take the node out of vfio-manager's DaemonSet (it restores the devices on \
                   SIGTERM), or run `vfio-manager unbind --all` where no `vfio-manager run` is active",
    lock_hint: "",
};

/// The driver's state file.
pub const STATE_FILE: &str = "/run/sandbox-dra-driver/state.json";
/// vfio-manager's state file (its default), read for the devices it holds.
pub const VFIO_MANAGER_STATE_FILE: &str = "/run/vfio-manager/state.json";
