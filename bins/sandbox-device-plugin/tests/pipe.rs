//! `sandbox-device-plugin --help | head`: a closed stdout never kills it; a
//! directory too deep for a socket is refused at start.

#![allow(clippy::unwrap_used)]

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

#[test]
fn a_closed_stdout_never_kills_the_plugin() {
    for args in [["--help"], ["--version"]] {
        let (read, write) = nix::unistd::pipe().unwrap();
        drop(read);
        let status = Command::new(env!("CARGO_BIN_EXE_sandbox-device-plugin"))
            .args(args)
            .stdout(Stdio::from(write))
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert_eq!(status.signal(), None, "{args:?}: {status:?}");
        assert_eq!(status.code(), Some(0), "{args:?}: {status:?}");
    }
}

/// A device-plugin directory whose socket paths pass the 107 bytes of a Unix
/// socket address is bad configuration: exit 2 naming the path, its length and
/// the limit, before anything is made; never a panic.
#[test]
fn a_socket_path_too_long_is_refused_at_start() {
    let root = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    sysfs_pci::testing::nic_node(root.path()).unwrap();
    // 50: kubelet.sock fits, the sockets of the node's resources do not; 120:
    // neither.
    for len in [50, 120] {
        let dir = root.path().join("d".repeat(len));
        let mut child = Command::new(env!("CARGO_BIN_EXE_sandbox-device-plugin"))
            .env_clear()
            .arg("--kubelet-dir")
            .arg(&dir)
            .args(["--sysfs-root", &root.path().join("sys").to_string_lossy()])
            .args(["--dev-root", &root.path().join("dev").to_string_lossy()])
            .args(["--config", &root.path().join("list.json").to_string_lossy()])
            .args([
                "--owner-lock",
                &root.path().join("owner.lock").to_string_lossy(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // A plugin that took the directory would serve until stopped.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                child.kill().unwrap();
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{len}: {stderr}");
        assert!(stderr.contains("at most 107 bytes"), "{stderr}");
        assert!(stderr.contains(&dir.display().to_string()), "{stderr}");
        assert!(
            stderr.contains("is ") && stderr.contains(" bytes long"),
            "{stderr}"
        );
        assert!(stderr.contains("--kubelet-dir"), "{stderr}");
        if len == 50 {
            assert!(stderr.contains("vfio-sandbox-NIC_PT-"), "{stderr}");
        }
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!dir.exists(), "{} was made", dir.display());
    }
}
