//! The programs vfio-manager names: itself, and the one other program that moves
//! a node's devices, the DRA driver (a node runs one of them, never both; see
//! `passthrough::owner`). The hints are vfio-manager's advice to its reader.

use passthrough::owner::Program;

/// vfio-manager, as its state-lock refusal names it.
pub static VFIO_MANAGER: Program = Program {
    name: "vfio-manager",
    release_hint: "",
    lock_hint: " (is `vfio-manager run` active on this node? it restores on SIGTERM)",
};

/// The DRA driver, and what the operator does so that it lets the node go.
pub static DRA_DRIVER: Program = Program {
    name: "sandbox-dra-driver",
    release_hint: "delete the ResourceClaims prepared on this node (their devices go back) and \
                   uninstall sandbox-dra-driver from it (take the node out of its DaemonSet)",
    lock_hint: "",
};

/// vfio-manager's state file.
pub const STATE_FILE: &str = "/run/vfio-manager/state.json";
/// `vfio-manager run`'s ready file.
pub const READY_FILE: &str = "/run/vfio-manager/ready";
/// The DRA driver's state file (its default), read for the devices it holds.
pub const DRA_DRIVER_STATE_FILE: &str = "/run/sandbox-dra-driver/state.json";
