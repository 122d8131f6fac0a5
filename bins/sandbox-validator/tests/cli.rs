//! The real `sandbox-validator` binary on fake sysfs trees: exit codes, the ready
//! file, and `--wait` printing only what changed.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use sysfs_pci::testing::{FakeDevice, FakeNode};

const LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;

fn node(dir: &Path) -> FakeNode {
    let node = FakeNode::new(dir);
    node.add_driver("vfio-pci");
    node.add_driver("e1000e");
    for m in ["vfio", "vfio_pci", "vfio_iommu_type1"] {
        node.add_module(m);
    }
    node.add_device(
        &FakeDevice::new("0000:01:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("e1000e")
            .group(5),
    );
    std::os::unix::fs::symlink("/dev/null", node.host.vfio_container_node()).unwrap();
    std::fs::write(dir.join("list.json"), LIST).unwrap();
    node
}

fn cmd(dir: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sandbox-validator"));
    c.arg("--sysfs-root")
        .arg(dir.join("sys"))
        .arg("--dev-root")
        .arg(dir.join("dev"))
        .arg("--config")
        .arg(dir.join("list.json"))
        .arg("--status-dir")
        .arg(dir.join("status"))
        .args(args)
        .env_remove("VFIO_SANDBOX_CONFIG");
    c
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// What the kernel does when the device binds: driver link, group node (a char device).
fn bind(node: &FakeNode) {
    node.attach(&"0000:01:00.0".parse().unwrap(), "vfio-pci");
    let g = node.host.vfio_group_node(5);
    std::fs::remove_file(&g).unwrap();
    std::os::unix::fs::symlink("/dev/null", g).unwrap();
}

#[test]
fn one_shot_fails_then_passes_and_keeps_the_ready_file_true() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    let ready = dir.path().join("status/vfio-pci-ready");
    std::fs::create_dir_all(ready.parent().unwrap()).unwrap();
    std::fs::write(&ready, "stale").unwrap();
    let out = cmd(dir.path(), &[]).output().unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains(
            "devices-bound        FAIL    not bound: 0000:01:00.0 on e1000e (want vfio-pci)"
        ),
        "{t}"
    );
    assert!(t.contains("hint: run vfio-manager"), "{t}");
    assert!(!ready.exists(), "a failing node has no ready file");
    bind(&node);
    let out = cmd(dir.path(), &["--output", "json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["ready"], true);
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&ready).unwrap()).unwrap();
    assert_eq!(file["devices"][0]["bdf"], "0000:01:00.0");
    assert_eq!(file["groups"], serde_json::json!([5]));
    assert_eq!(file["checks"].as_array().unwrap().len(), 9);
    assert!(file["time"].as_u64().unwrap() > 0);
}

#[test]
fn bad_config_exits_2() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    std::fs::write(
        dir.path().join("list.json"),
        r#"{"resources":[{"name":"bad"}]}"#,
    )
    .unwrap();
    let out = cmd(dir.path(), &[]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

#[test]
fn wait_prints_only_changes_and_passes_at_the_next_round() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    let mut child = cmd(
        dir.path(),
        &[
            "--wait",
            "--interval",
            "200ms",
            "--timeout",
            "20s",
            "--log-level",
            "debug",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Each round says `round=N passed=...` on stderr: wait for five failing rounds
    // (the same failure must not be printed again), then bind.
    let (rounds_tx, rounds) = std::sync::mpsc::channel::<(u64, bool)>();
    let stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if let Some(r) = round_of(&line) {
                let _ = rounds_tx.send(r);
            }
        }
    });
    let next = || rounds.recv_timeout(Duration::from_secs(20)).unwrap();
    let mut last = next();
    while last.0 < 5 {
        assert!(!last.1, "passed before the devices were bound");
        last = next();
    }
    bind(&node);
    let bound_during = last.0;
    let out = child.wait_with_output().unwrap();
    reader.join().unwrap();
    let passed: Vec<(u64, bool)> = rounds.try_iter().filter(|r| r.1).collect();
    let s = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{s}");
    // The round running while we bound may have read the node before or after;
    // the one after it must pass.
    assert!(
        passed.len() == 1 && passed[0].0 <= bound_during + 2,
        "bound during round {bound_during}, passed: {passed:?}"
    );
    assert_eq!(
        s.matches("devices-bound        FAIL").count(),
        1,
        "the same failure printed again:\n{s}"
    );
    assert_eq!(
        s.matches("-- changed after").count(),
        1,
        "one change, one update:\n{s}"
    );
    assert!(s.contains("devices-bound        ok"), "{s}");
    assert!(
        s.contains("node is ready for VFIO passthrough (1 device(s))"),
        "{s}"
    );
    assert!(dir.path().join("status/vfio-pci-ready").exists());
}

#[test]
fn wait_gives_up_at_the_timeout() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let t = Instant::now();
    let out = cmd(
        dir.path(),
        &["--wait", "--interval", "100ms", "--timeout", "500ms"],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(
        text(&out).contains("still failing after 500ms"),
        "{}",
        text(&out)
    );
}

/// Durations no flag may accept, with the word the refusal must contain.
const HOSTILE_DURATIONS: &[(&str, &str)] = &[
    ("0", "at least 1ms"),
    ("0ms", "at least 1ms"),
    ("18446744073709551615s", "at most 8760h"),
    ("-1s", "not a duration"),
    ("1e9h", "unknown unit"),
    ("", "not a duration"),
    ("soon", "not a duration"),
];

#[test]
fn hostile_intervals_exit_2_naming_the_flag() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    for (value, why) in HOSTILE_DURATIONS {
        let out = cmd(dir.path(), &["--wait", &format!("--interval={value}")])
            .output()
            .unwrap();
        let t = text(&out);
        assert_eq!(out.status.code(), Some(2), "--interval={value}: {t}");
        assert!(t.contains("--interval") && t.contains(why), "{value}: {t}");
        // The env twin goes through the same parser.
        let out = cmd(dir.path(), &["--wait"])
            .env("VFIO_SANDBOX_VALIDATOR_INTERVAL", value)
            .output()
            .unwrap();
        if !value.is_empty() {
            assert_eq!(out.status.code(), Some(2), "env {value}: {}", text(&out));
        }
    }
}

#[test]
fn hostile_timeouts_exit_2_naming_the_flag() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    for (value, why) in HOSTILE_DURATIONS
        .iter()
        .filter(|(v, _)| !v.starts_with('0'))
    {
        let out = cmd(dir.path(), &["--wait", &format!("--timeout={value}")])
            .output()
            .unwrap();
        let t = text(&out);
        assert_eq!(out.status.code(), Some(2), "--timeout={value}: {t}");
        assert!(t.contains("--timeout") && t.contains(why), "{value}: {t}");
    }
}

#[test]
fn wait_with_timeout_zero_checks_once() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let t = Instant::now();
    let out = cmd(
        dir.path(),
        &["--wait", "--timeout", "0", "--interval", "1h"],
    )
    .output()
    .unwrap();
    let s = text(&out);
    assert_eq!(out.status.code(), Some(1), "{s}");
    assert!(t.elapsed() < Duration::from_secs(5), "{s}");
    assert_eq!(s.matches("devices-bound        FAIL").count(), 1, "{s}");
    assert!(s.contains("still failing after 0ns"), "{s}");
}

#[test]
fn config_that_is_a_fifo_exits_2_without_blocking() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let list = dir.path().join("list.json");
    std::fs::remove_file(&list).unwrap();
    nix::unistd::mkfifo(&list, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let mut child = cmd(dir.path(), &[])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("the validator blocked on a FIFO config");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(t.contains("is a FIFO, not a regular file"), "{t}");
}

#[test]
fn a_malformed_device_is_named_and_does_not_hide_the_good_one() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    bind(&node);
    node.add_device(&FakeDevice::new("0000:02:00.0", 0x8086, 0x10d3, 0x02_0000).group(6));
    let bad = node.canonical_dir(&"0000:02:00.0".parse().unwrap());
    std::fs::remove_file(bad.join("class")).unwrap();
    std::fs::create_dir(bad.join("class")).unwrap();
    let out = cmd(dir.path(), &["--output", "json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["devices"][0]["bdf"], "0000:01:00.0");
    assert_eq!(doc["devices"].as_array().unwrap().len(), 1);
    let found = doc["checks"][4]["reason"].as_str().unwrap();
    assert!(
        found.contains("skipped 1 device(s) that cannot be used: 0000:02:00.0: failed to read ")
            && found.contains("0000:02:00.0/class: Is a directory"),
        "{found}"
    );
}

#[test]
fn a_closed_stdout_never_kills_the_validator() {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    // `sandbox-validator | head` after head has exited: writes get EPIPE.
    for (args, want) in [
        (&["--help"][..], 0),
        (&["--version"][..], 0),
        (&[][..], 1),
        (&["--output", "json"][..], 1),
    ] {
        let (read, write) = nix::unistd::pipe().unwrap();
        drop(read);
        let status = cmd(dir.path(), args)
            .stdout(Stdio::from(write))
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert_eq!(
            status.signal(),
            None,
            "{args:?} was killed by a signal: {status:?}"
        );
        assert_eq!(status.code(), Some(want), "{args:?}: {status:?}");
    }
}

/// `(N, passed)` of a validator debug line `... validated round=N passed=true`.
fn round_of(line: &str) -> Option<(u64, bool)> {
    if !line.contains("validated") {
        return None;
    }
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .map(str::to_owned)
    };
    let round = field("round=")?.parse().ok()?;
    let passed = field("passed=")? == "true";
    Some((round, passed))
}

/// A node whose interrupt chips show no remapping and no ITS fails
/// `interrupt-isolation`, naming the chips, the cause and the fix, with every
/// other check passing; `allow_unsafe_interrupts=Y` passes it with a warning
/// saying what it gives up; remapping on passes it plainly.
#[test]
fn a_node_without_interrupt_isolation_is_not_ready() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    bind(&node);
    let ready = dir.path().join("status/vfio-pci-ready");
    node.set_interrupt_chips(&["IO-APIC", "PCI-MSIX-0000:01:00.0", "DMAR-MSI"]);
    let out = cmd(dir.path(), &[]).output().unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    for part in [
        "interrupt-isolation  FAIL    no interrupt domain isolates device MSIs \
            (interrupt chips: DMAR-MSI, IO-APIC, PCI-MSIX)",
        "No interrupt remapping support",
        "hint: turn interrupt remapping on",
        "intremap=off",
        "allow_unsafe_interrupts=1",
        "node is NOT ready: 1 check(s) failed",
    ] {
        assert!(t.contains(part), "{part:?} missing from: {t}");
    }
    assert!(!ready.exists());

    node.set_allow_unsafe_interrupts("vfio_iommu_type1", true);
    let out = cmd(dir.path(), &[]).output().unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    for part in [
        "interrupt-isolation  WARN    no interrupt domain isolates device MSIs",
        "warning: vfio_iommu_type1.allow_unsafe_interrupts=1 lets VMs take devices \
            without interrupt isolation",
        "raise interrupts on the host",
    ] {
        assert!(t.contains(part), "{part:?} missing from: {t}");
    }
    assert!(ready.exists());
    let out = cmd(dir.path(), &["--output", "json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let check = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "interrupt-isolation")
        .unwrap()
        .clone();
    assert_eq!(check["passed"], true);
    assert!(check["warning"]
        .as_str()
        .unwrap()
        .contains("allow_unsafe_interrupts"));

    node.set_allow_unsafe_interrupts("vfio_iommu_type1", false);
    node.set_interrupt_chips(&["IR-IO-APIC", "IR-PCI-MSIX-0000:01:00.0"]);
    let out = cmd(dir.path(), &[]).output().unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(
        t.contains(
            "interrupt-isolation  ok      device interrupts are isolated by interrupt remapping"
        ),
        "{t}"
    );
    assert!(!t.contains("warning:"), "{t}");
}
