//! `sandbox-device-plugin --help | head`: a closed stdout never kills it.

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
