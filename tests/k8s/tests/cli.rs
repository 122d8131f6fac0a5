//! The harness refuses what would make a run meaningless before it starts
//! anything: a bad release, a scenario filter that matches nothing, a missing
//! binary. Each refusal names what is wrong.

#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

fn real_k8s(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_real-k8s"))
        .args(args)
        .output()
        .expect("running real-k8s")
}

/// The arguments of a run whose binaries all exist: three directories holding
/// an executable of every name the run needs.
fn dirs_with_binaries(root: &std::path::Path) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let mut args = Vec::new();
    for (flag, names) in [
        (
            "--k8s-bins",
            &[
                "etcd",
                "kube-apiserver",
                "kube-controller-manager",
                "kube-scheduler",
                "kubelet",
                "kubectl",
            ][..],
        ),
        (
            "--containerd-bins",
            &["containerd", "containerd-shim-runc-v2", "ctr"][..],
        ),
        (
            "--our-bins",
            &[
                "sandbox-dra-driver",
                "sandbox-dra-controller",
                "sandbox-device-plugin",
            ][..],
        ),
    ] {
        let dir = root.join(flag.trim_start_matches("--"));
        std::fs::create_dir_all(&dir).unwrap();
        for name in names {
            let path = dir.join(name);
            std::fs::write(&path, "#!/bin/sh\nexit 1\n").unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        args.push(flag.to_string());
        args.push(dir.display().to_string());
    }
    let helm = root.join("helm");
    std::fs::write(&helm, "#!/bin/sh\nexit 1\n").unwrap();
    std::fs::set_permissions(&helm, std::fs::Permissions::from_mode(0o755)).unwrap();
    args.push("--helm".to_owned());
    args.push(helm.display().to_string());
    args
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn help_names_every_input() {
    let out = real_k8s(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--k8s-bins",
        "--containerd-bins",
        "--release",
        "--gates",
        "--our-bins",
        "--helm",
        "--keep",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}:\n{help}");
    }
}

#[test]
fn a_missing_binary_is_named_before_anything_starts() {
    let root = tempfile::tempdir().unwrap();
    let mut args = dirs_with_binaries(root.path());
    let gone = root.path().join("k8s-bins/kubelet");
    std::fs::remove_file(&gone).unwrap();
    let not_executable = root.path().join("our-bins/sandbox-dra-driver");
    std::fs::write(&not_executable, "not a program").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&not_executable, std::fs::Permissions::from_mode(0o644)).unwrap();
    args.extend(["--release", "v1.37.2", "--gates", "defaults"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = real_k8s(&args);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains(&format!("{} (--k8s-bins)", gone.display())),
        "{err}"
    );
    assert!(
        err.contains(&format!("{} (--our-bins)", not_executable.display())),
        "{err}"
    );
    assert!(!err.contains("containerd-bins"), "{err}");
}

#[test]
fn a_filter_that_matches_no_scenario_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let mut args = dirs_with_binaries(root.path());
    args.extend(
        [
            "--release",
            "v1.34.4",
            "--gates",
            "features",
            "dra-health",
            "no-such-scenario",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = real_k8s(&args);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("no scenario matches no-such-scenario;"),
        "{err}"
    );
    assert!(
        err.contains("dra-health"),
        "the known scenarios are listed: {err}"
    );
}

#[test]
fn a_release_that_does_not_parse_is_named() {
    let root = tempfile::tempdir().unwrap();
    let mut args = dirs_with_binaries(root.path());
    args.extend(["--release", "1.34", "--gates", "defaults"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = real_k8s(&args);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("release \"1.34\": expected v1.<minor>"),
        "{}",
        stderr(&out)
    );
}
