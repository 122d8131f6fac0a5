//! The ready files the agents publish on the host, and who clears them.
//!
//! - `vfio-manager run` writes its ready file (default [`MANAGER_READY_FILE`]) once
//!   every selected device is bound, and removes it when one is not or it stops.
//! - `sandbox-validator` writes `<status-dir>/`[`VALIDATOR_READY_FILE`] when the node
//!   passes every check. It runs once (an init container), so when the node leaves VM
//!   mode nobody would remove it: vfio-manager does, before it restores.

use std::path::{Path, PathBuf};

/// `vfio-manager run`'s ready file.
pub const MANAGER_READY_FILE: &str = "/run/vfio-manager/ready";
/// The validator's status directory.
pub const DEFAULT_STATUS_DIR: &str = "/run/vfio-sandbox/validations";
/// The validator's ready file in its status directory.
pub const VALIDATOR_READY_FILE: &str = "vfio-pci-ready";

/// `<status_dir>/vfio-pci-ready`.
pub fn validator_ready_file(status_dir: &Path) -> PathBuf {
    status_dir.join(VALIDATOR_READY_FILE)
}
