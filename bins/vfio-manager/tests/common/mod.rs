//! What the vfio-manager test binaries share.

use std::path::Path;
use std::process::Command;

/// The real binary pointed at the fake node under `dir` (`sys/`, `dev/`,
/// `lib/modules/`, `run/state.json`, `list.json`).
pub fn command(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vfio-manager"));
    c.args(["--sysfs-root", &dir.join("sys").to_string_lossy()])
        .args(["--dev-root", &dir.join("dev").to_string_lossy()])
        .args(["--modules-root", &dir.join("lib/modules").to_string_lossy()])
        .args([
            "--state-file",
            &dir.join("run/state.json").to_string_lossy(),
        ])
        .args(["--config", &dir.join("list.json").to_string_lossy()])
        .env_remove("VFIO_SANDBOX_CONFIG");
    c
}
