//! The two programs that move a node's devices, as each names the other: a node
//! runs one of them, never both (see [`passthrough::owner`]).

use passthrough::owner::Program;

/// vfio-manager: the whole node in VM mode.
pub static VFIO_MANAGER: Program = Program {
    name: "vfio-manager",
    release_hint: "take the node out of vfio-manager's DaemonSet (it restores the devices on \
                   SIGTERM), or run `vfio-manager unbind --all` where no `vfio-manager run` is active",
    lock_hint: " (is `vfio-manager run` active on this node? it restores on SIGTERM)",
};

/// sandbox-dra-driver: devices moved per ResourceClaim.
pub static DRA_DRIVER: Program = Program {
    name: "sandbox-dra-driver",
    release_hint: "delete the ResourceClaims prepared on this node (their devices go back) and \
                   uninstall sandbox-dra-driver from it (take the node out of its DaemonSet)",
    lock_hint: " on this node",
};

/// vfio-manager's default state file.
pub const VFIO_MANAGER_STATE_FILE: &str = "/run/vfio-manager/state.json";

/// sandbox-dra-driver's default state file.
pub const DRA_DRIVER_STATE_FILE: &str = "/run/sandbox-dra-driver/state.json";
