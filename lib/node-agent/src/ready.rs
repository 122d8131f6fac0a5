//! The validator's ready file on the host: `<status-dir>/`[`VALIDATOR_READY_FILE`],
//! written when the node passes every check. The validator runs once (an init
//! container), so whoever restores the node removes it first.

use std::path::{Path, PathBuf};

/// The validator's status directory.
pub const DEFAULT_STATUS_DIR: &str = "/run/vfio-sandbox/validations";
/// The validator's ready file in its status directory.
pub const VALIDATOR_READY_FILE: &str = "vfio-pci-ready";

/// `<status_dir>/vfio-pci-ready`.
pub fn validator_ready_file(status_dir: &Path) -> PathBuf {
    status_dir.join(VALIDATOR_READY_FILE)
}
