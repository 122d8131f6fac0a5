//! The real `sandbox-device-plugin` binary refusing durations it cannot use: a bad
//! `--resync-interval` is bad usage (exit 2, the flag named), never a crash.

#![allow(clippy::unwrap_used)]

use std::process::Command;

#[test]
fn hostile_resync_intervals_exit_2_naming_the_flag() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    for (value, why) in [
        ("0", "at least 1ms"),
        ("0ms", "at least 1ms"),
        ("18446744073709551615s", "at most 8760h"),
        ("-1s", "not a duration"),
        ("1e9h", "unknown unit"),
        ("", "not a duration"),
        ("soon", "not a duration"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_sandbox-device-plugin"))
            .arg("--sysfs-root")
            .arg(dir.path().join("sys"))
            .arg("--dev-root")
            .arg(dir.path().join("dev"))
            .arg("--kubelet-dir")
            .arg(dir.path().join("kubelet"))
            .arg(format!("--resync-interval={value}"))
            .env_remove("VFIO_SANDBOX_CONFIG")
            .output()
            .unwrap();
        let t = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--resync-interval={value}: {t}");
        assert!(t.contains("--resync-interval") && t.contains(why), "{t}");
    }
}
