//! The real `vfio-manager` binary on fake sysfs trees: exit codes, messages, dry run.
//! (Binding itself needs a kernel; tests/vm runs it on one.)
//!
//! One file on purpose: every test runs the binary on the
//! same fake node and resource list defined once at the top.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output};

mod common;

use sysfs_pci::testing::{FakeDevice, FakeNode};

const LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;

fn node(dir: &Path) -> FakeNode {
    let node = FakeNode::new(dir);
    node.add_driver("vfio-pci");
    node.add_module("vfio");
    node.add_module("vfio_iommu_type1");
    node.add_device(
        &FakeDevice::new("0000:01:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("e1000e")
            .group(4),
    );
    node.add_device(
        &FakeDevice::new("0000:01:00.1", 0x8086, 0x10d3, 0x02_0000)
            .driver("e1000e")
            .group(4),
    );
    node.add_device(
        &FakeDevice::new("0000:02:00.0", 0x8086, 0x2922, 0x01_0601)
            .driver("ahci")
            .group(5),
    );
    std::fs::write(dir.join("list.json"), LIST).unwrap();
    node
}

fn run(dir: &Path, args: &[&str]) -> Output {
    common::command(dir).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Every file under the fake tree with its contents, to prove nothing changed.
fn snapshot(dir: &Path) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = walk(dir);
    out.sort();
    out
}

fn walk(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let meta = std::fs::symlink_metadata(&p).unwrap();
        if meta.file_type().is_symlink() {
            out.push((
                p.display().to_string(),
                format!("-> {}", std::fs::read_link(&p).unwrap().display()),
            ));
        } else if meta.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push((
                p.display().to_string(),
                std::fs::read_to_string(&p).unwrap_or_default(),
            ));
        }
    }
    out
}

#[test]
fn status_shows_selected_and_companion_with_group_viability() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let out = run(dir.path(), &["status"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("0000:01:00.0  8086:10d3  example.com/NIC_PT"),
        "{t}"
    );
    assert!(t.contains("e1000e (want vfio-pci)"), "{t}");
    assert!(!t.contains("0000:02:00.0"), "unselected device listed: {t}");
    let out = run(dir.path(), &["status", "--output", "json"]);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["devices"][1]["bdf"], "0000:01:00.1");
    assert_eq!(doc["devices"][0]["resource"], "example.com/NIC_PT");
    assert_eq!(doc["devices"][0]["group_viable"], false);
    assert_eq!(doc["groups"][0]["blockers"][0]["driver"], "e1000e");
}

#[test]
fn dry_run_prints_every_write_and_touches_nothing() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = node(dir.path());
    // vfio_iommu_type1 is not loaded: the dry run must say it would load it.
    std::fs::remove_dir(node.host.module_dir("vfio_iommu_type1")).unwrap();
    let release = sysfs_pci::module::kernel_release();
    node.add_modules_dep(
        &release,
        "kernel/vfio_iommu_type1.ko: kernel/vfio.ko\nkernel/vfio.ko:\n",
    );
    let before = snapshot(dir.path());
    let out = run(dir.path(), &["bind", "--all", "--dry-run"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let sys = dir.path().join("sys").display().to_string();
    let modules = dir
        .path()
        .join("lib/modules")
        .join(&release)
        .display()
        .to_string();
    let expect = [
        format!("would load module vfio_iommu_type1 from {modules}/kernel/vfio_iommu_type1.ko"),
        format!("would write vfio-pci to {sys}/bus/pci/devices/0000:01:00.0/driver_override"),
        format!("would write 0000:01:00.0 to {sys}/bus/pci/devices/0000:01:00.0/driver/unbind"),
        format!("would write 0000:01:00.0 to {sys}/bus/pci/drivers_probe"),
        format!("would write vfio-pci to {sys}/bus/pci/devices/0000:01:00.1/driver_override"),
    ];
    for line in &expect {
        assert!(t.contains(line.as_str()), "missing {line:?} in\n{t}");
    }
    assert_eq!(
        t.matches("would load module vfio_iommu_type1").count(),
        1,
        "{t}"
    );
    assert!(t.contains("would bind 0000:01:00.1 (now on e1000e)"), "{t}");
    assert!(!t.contains("INFO"), "a dry run logs nothing as done: {t}");
    assert_eq!(before, snapshot(dir.path()), "dry run changed the tree");
    assert!(!dir.path().join("run/state.json").exists());
}

#[test]
fn bad_config_exits_2_naming_the_entry_and_touches_nothing() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    std::fs::write(
        dir.path().join("list.json"),
        r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"80z6"}]}"#,
    )
    .unwrap();
    let before = snapshot(dir.path());
    let out = run(dir.path(), &["bind", "--all"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(
        t.contains("list.json") && t.contains("resources[0]") && t.contains("80z6"),
        "{t}"
    );
    assert_eq!(before, snapshot(dir.path()));
}

#[test]
fn unknown_and_unselected_devices_exit_2() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let out = run(dir.path(), &["bind", "--device", "0000:09:00.0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("no PCI device 0000:09:00.0"),
        "{}",
        text(&out)
    );
    let out = run(dir.path(), &["bind", "--device", "0000:02:00.0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("0000:02:00.0 (8086:2922) is not selected"),
        "{}",
        text(&out)
    );
    let out = run(dir.path(), &["bind", "--device", "0000:01:00.0x"]);
    assert_eq!(out.status.code(), Some(2));
    let out = run(dir.path(), &["bind"]);
    assert_eq!(out.status.code(), Some(2), "--all or --device is required");
}

#[test]
fn iommu_off_exits_1_with_a_hint() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let node = FakeNode::new(dir.path());
    node.add_driver("vfio-pci");
    node.add_device(&FakeDevice::new("0000:01:00.0", 0x8086, 0x10d3, 0x02_0000).driver("e1000e"));
    std::fs::write(dir.path().join("list.json"), LIST).unwrap();
    let out = run(dir.path(), &["bind", "--device", "0000:01:00.0"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains("IOMMU is off") && t.contains("intel_iommu=on"),
        "{t}"
    );
    let out = run(dir.path(), &["bind", "--all"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
}

#[test]
fn unbind_with_nothing_recorded_is_a_no_op() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    std::fs::write(dir.path().join("list.json"), "not json").unwrap();
    let out = run(dir.path(), &["unbind", "--all"]);
    let t = text(&out);
    assert!(
        out.status.success(),
        "unbind must not need a valid config: {t}"
    );
    assert!(t.contains("nothing recorded"), "{t}");
}

#[test]
fn help_explains_the_interface() {
    let out = Command::new(env!("CARGO_BIN_EXE_vfio-manager"))
        .arg("--help")
        .output()
        .unwrap();
    let t = text(&out);
    for word in [
        "status",
        "bind",
        "unbind",
        "run",
        "--config",
        "--sysfs-root",
        "--state-file",
        "--owner-lock",
        "VFIO_SANDBOX_OWNER_LOCK",
        "--dra-state-file",
        "VFIO_SANDBOX_DRA_STATE_FILE",
        "Exit codes",
    ] {
        assert!(t.contains(word), "--help lacks {word}: {t}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_vfio-manager"))
        .args(["run", "--help"])
        .output()
        .unwrap();
    let t = text(&out);
    for word in [
        "--unload-module",
        "--keep-bound-on-exit",
        "--ready-file",
        "--resync-interval",
        "VFIO_MANAGER_READY_FILE",
    ] {
        assert!(t.contains(word), "run --help lacks {word}: {t}");
    }
}

/// `--bind-jobs` (env twin `VFIO_MANAGER_BIND_JOBS`) is documented, refuses 0 and
/// garbage before touching anything, and a dry run plans the same writes in the same
/// order whatever its value (a dry run binds one group at a time).
#[test]
fn bind_jobs_is_documented_validated_and_keeps_a_dry_run_in_order() {
    let out = Command::new(env!("CARGO_BIN_EXE_vfio-manager"))
        .args(["bind", "--help"])
        .output()
        .unwrap();
    let t = text(&out);
    for word in ["--bind-jobs", "VFIO_MANAGER_BIND_JOBS", "[default: 8]"] {
        assert!(t.contains(word), "bind --help lacks {word}: {t}");
    }
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let before = snapshot(dir.path());
    for bad in ["0", "-1", "many", ""] {
        let out = run(
            dir.path(),
            &["bind", "--all", &format!("--bind-jobs={bad}")],
        );
        let t = text(&out);
        assert_eq!(out.status.code(), Some(2), "--bind-jobs={bad}: {t}");
        assert!(t.contains("--bind-jobs"), "{t}");
    }
    let out = common::command(dir.path())
        .env("VFIO_MANAGER_BIND_JOBS", "0")
        .args(["bind", "--all"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert_eq!(
        before,
        snapshot(dir.path()),
        "a bad --bind-jobs touched the node"
    );
    let plan = |jobs: &str| {
        let out = run(
            dir.path(),
            &["bind", "--all", "--dry-run", "--bind-jobs", jobs],
        );
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let one = plan("1");
    assert!(one.contains("would write"), "{one}");
    assert_eq!(one, plan("4"));
}

#[test]
fn hostile_resync_intervals_exit_2_before_touching_anything() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let before = snapshot(dir.path());
    let ready = dir.path().join("run/ready");
    for (value, why) in [
        ("0", "at least 1ms"),
        ("0ms", "at least 1ms"),
        ("18446744073709551615s", "at most 8760h"),
        ("-1s", "not a duration"),
        ("1e9h", "unknown unit"),
        ("", "not a duration"),
        ("soon", "not a duration"),
    ] {
        let out = run(
            dir.path(),
            &[
                "run",
                "--ready-file",
                &ready.to_string_lossy(),
                &format!("--resync-interval={value}"),
            ],
        );
        let t = text(&out);
        assert_eq!(out.status.code(), Some(2), "--resync-interval={value}: {t}");
        assert!(t.contains("--resync-interval") && t.contains(why), "{t}");
        assert_eq!(before, snapshot(dir.path()), "{value} touched the node");
    }
}

/// Runs `vfio-manager` with `config` as `--config`, killing it if it is still running
/// after ten seconds (a config read that blocks must fail the test, not hang it).
fn run_with_config(dir: &Path, config: &Path, args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_vfio-manager"))
        .args(["--sysfs-root", &dir.join("sys").to_string_lossy()])
        .args([
            "--owner-lock",
            &dir.join(common::OWNER_LOCK).to_string_lossy(),
        ])
        .args([
            "--dra-state-file",
            &dir.join(common::DRA_STATE_FILE).to_string_lossy(),
        ])
        .args(["--dev-root", &dir.join("dev").to_string_lossy()])
        .args(["--modules-root", &dir.join("lib/modules").to_string_lossy()])
        .args([
            "--state-file",
            &dir.join("run/state.json").to_string_lossy(),
        ])
        .arg("--config")
        .arg(config)
        .args(args)
        .env_remove("VFIO_SANDBOX_CONFIG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("vfio-manager {args:?} with --config {config:?} did not finish");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn config_that_is_not_a_regular_file_or_too_big_exits_2() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    // Outside the tree `snapshot` reads (reading a FIFO would block the test).
    let other = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let fifo = other.path().join("fifo.json");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let big = dir.path().join("big.json");
    std::fs::write(&big, " ".repeat(1024 * 1024 + 1)).unwrap();
    let before = snapshot(dir.path());
    for (config, why) in [
        (fifo.as_path(), "is a FIFO, not a regular file"),
        (
            Path::new("/dev/zero"),
            "is a character device, not a regular file",
        ),
        (dir.path(), "is a directory, not a regular file"),
        (big.as_path(), "is larger than the limit of 1048576 bytes"),
    ] {
        for args in [&["status"][..], &["bind", "--all"]] {
            let out = run_with_config(dir.path(), config, args);
            let t = text(&out);
            assert_eq!(out.status.code(), Some(2), "{config:?} {args:?}: {t}");
            assert!(
                t.contains(&format!("resource list {} {why}", config.display())),
                "{t}"
            );
        }
    }
    assert_eq!(before, snapshot(dir.path()));
}

#[test]
fn config_naming_a_host_driver_exits_2_listing_what_is_allowed() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    std::fs::write(
        dir.path().join("list.json"),
        r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"],"driver":"ahci"}]}"#,
    )
    .unwrap();
    let before = snapshot(dir.path());
    let out = run(dir.path(), &["bind", "--all"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(
        t.contains("resources[0] (example.com/NIC_PT): driver: \"ahci\" is not a vfio driver")
            && t.contains("allowed: vfio-pci or a vfio-pci variant driver named <name>_vfio_pci")
            && t.contains("mlx5_vfio_pci"),
        "{t}"
    );
    assert_eq!(before, snapshot(dir.path()));
}

/// Garbage a device directory can hold, each with the file its error must name.
const GARBAGE: &[(&str, &[u8], &str)] = &[
    ("device", b"garbage\n", "device"),
    ("class", b"0xzz\n", "class"),
    ("subsystem_vendor", b"nope\n", "subsystem_vendor"),
    ("numa_node", b"abc\n", "numa_node"),
    ("numa_node", b"-2\n", "numa_node"),
    ("driver_override", b"vfio\xff\n", "driver_override"),
    ("iommu_group", b"not a number", "iommu_group"),
    ("iommu_group", b"loop", "iommu_group"),
    ("class", b"a directory", "class"),
];

/// Puts `contents` in `name` of the device at `bdf` (a link for `iommu_group`, a
/// directory when the contents say so).
fn spoil(node: &FakeNode, bdf: &str, name: &str, contents: &[u8]) {
    let path = node.canonical_dir(&bdf.parse().unwrap()).join(name);
    std::fs::remove_file(&path).unwrap_or_default();
    match (name, contents) {
        ("iommu_group", b"loop") => std::os::unix::fs::symlink("iommu_group", &path).unwrap(),
        ("iommu_group", _) => {
            std::os::unix::fs::symlink("../../kernel/iommu_groups/x", &path).unwrap()
        }
        (_, b"a directory") => std::fs::create_dir(&path).unwrap(),
        _ => std::fs::write(&path, contents).unwrap(),
    }
}

#[test]
fn a_malformed_device_is_shown_by_status_and_left_out_of_bind() {
    for (name, contents, file) in GARBAGE {
        let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
        let node = node(dir.path());
        node.add_device(
            &FakeDevice::new("0000:03:00.0", 0x8086, 0x10d3, 0x02_0000)
                .driver("e1000e")
                .group(6),
        );
        spoil(&node, "0000:01:00.1", name, contents);
        let case = format!("{name} = {:?}", String::from_utf8_lossy(contents));

        let out = run(dir.path(), &["status"]);
        let t = text(&out);
        assert_eq!(out.status.code(), Some(1), "{case}: {t}");
        assert!(
            t.contains("0000:03:00.0  8086:10d3  example.com/NIC_PT"),
            "{case}: {t}"
        );
        assert!(
            t.contains("0000:01:00.0  8086:10d3  example.com/NIC_PT  e1000e (skipped)"),
            "{case}: the held-back device is shown as read: {t}"
        );
        assert!(
            t.contains("skipped 0000:01:00.1: ") && t.contains(&format!("0000:01:00.1/{file}")),
            "{case}: {t}"
        );
        assert!(
            t.contains(
                "skipped 0000:01:00.0: IOMMU group 4 has a member that could \
                    not be read (0000:01:00.1)"
            ),
            "{case}: {t}"
        );

        let out = run(dir.path(), &["status", "--output", "json"]);
        assert_eq!(out.status.code(), Some(1), "{case}");
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            doc["devices"].as_array().unwrap().len(),
            1,
            "{case}: {doc:#}"
        );
        assert_eq!(doc["skipped"][0]["bdf"], "0000:01:00.0");
        assert_eq!(doc["skipped"][0]["kind"], "group_member_unreadable");
        assert_eq!(doc["skipped"][0]["member"], "0000:01:00.1");
        assert_eq!(doc["skipped"][0]["resource"], "example.com/NIC_PT");
        assert_eq!(doc["skipped"][1]["bdf"], "0000:01:00.1");
        assert_eq!(doc["skipped"][1]["kind"], "unreadable");
        assert!(
            doc["skipped"][1]["error"]
                .as_str()
                .unwrap()
                .contains(&format!("0000:01:00.1/{file}")),
            "{case}: {doc:#}"
        );

        let before = snapshot(dir.path());
        let out = run(dir.path(), &["bind", "--all", "--dry-run"]);
        let t = text(&out);
        assert_eq!(out.status.code(), Some(1), "{case}: {t}");
        assert!(
            t.contains("would bind 0000:03:00.0 (now on e1000e)"),
            "{case}: {t}"
        );
        assert!(
            !t.contains("0000:01:00.0/driver_override"),
            "{case}: group 4 touched: {t}"
        );
        assert!(
            t.contains("error: not binding 0000:01:00.1: "),
            "{case}: {t}"
        );
        assert_eq!(before, snapshot(dir.path()));

        let out = run(
            dir.path(),
            &["bind", "--device", "0000:01:00.0", "--dry-run"],
        );
        let t = text(&out);
        assert_eq!(out.status.code(), Some(1), "{case}: {t}");
        assert!(
            t.contains(
                "--device 0000:01:00.0 cannot be bound: 0000:01:00.0: IOMMU group 4 has a member"
            ),
            "{case}: {t}"
        );
    }
}

/// The owner record sandbox-dra-driver leaves with `devices` still moved (0: none).
fn driver_record(devices: usize) -> String {
    format!(
        r#"{{"owner":"sandbox-dra-driver","pid":4242,"since":"2025-01-31T12:00:00Z","devices":{devices}}}"#
    )
}

#[test]
fn bind_unbind_and_run_refuse_a_node_of_sandbox_dra_driver() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let lock = dir.path().join(common::OWNER_LOCK);
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    let ready = dir.path().join("run/ready");
    let ready_arg = ready.to_string_lossy().into_owned();
    let refusal = format!(
        "sandbox-dra-driver (pid 4242, since 2025-01-31T12:00:00Z; exited with 2 device(s) \
         still moved) owns the devices of this node (lock {}); vfio-manager moves nothing \
         while it does: a node runs either vfio-manager or sandbox-dra-driver, not both; \
         delete the ResourceClaims prepared on this node",
        lock.display()
    );
    // The driver is gone but its devices are still on vfio: the node stays its own.
    // (It left the lock file and the gate beside it that record writes take.)
    std::fs::write(&lock, driver_record(2)).unwrap();
    std::fs::write(format!("{}.gate", lock.display()), "").unwrap();
    let before = snapshot(dir.path());
    for args in [
        &["bind", "--all"][..],
        &["bind", "--device", "0000:01:00.0", "--dry-run"][..],
        &["unbind", "--all"][..],
        &["run", "--ready-file", &ready_arg, "--resync-interval", "1s"][..],
    ] {
        let out = run(dir.path(), args);
        let t = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {t}");
        assert!(t.contains(&refusal), "{args:?}: {t}");
        assert_eq!(before, snapshot(dir.path()), "{args:?} touched the node");
    }
    // What does not move devices still works.
    let out = run(dir.path(), &["status"]);
    assert!(out.status.success(), "status: {}", text(&out));
    let out = run(dir.path(), &["ready", "--ready-file", &ready_arg]);
    assert_eq!(out.status.code(), Some(1), "ready: {}", text(&out));
    assert!(!text(&out).contains("sandbox-dra-driver"), "{}", text(&out));
    // Its devices given back, the driver's record keeps nobody out; neither does a
    // garbled one. A real bind takes the node and says so in the record.
    for record in [driver_record(0), "{not json".to_owned()] {
        std::fs::write(&lock, &record).unwrap();
        let out = run(dir.path(), &["bind", "--all", "--dry-run"]);
        assert!(out.status.success(), "{record}: {}", text(&out));
        assert_eq!(std::fs::read_to_string(&lock).unwrap(), record, "dry run");
    }
    let out = run(dir.path(), &["unbind", "--all"]);
    assert!(out.status.success(), "{}", text(&out));
    let now: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&lock).unwrap()).unwrap();
    assert_eq!(now["owner"], "vfio-manager", "{now}");
    assert_eq!(now["devices"], 0, "{now}");
}

/// A lock file planted as a symlink is refused, its target left alone.
#[test]
fn a_symlinked_owner_lock_is_refused_not_followed() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let lock = dir.path().join(common::OWNER_LOCK);
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "keep").unwrap();
    std::os::unix::fs::symlink(&victim, &lock).unwrap();
    let out = run(dir.path(), &["unbind", "--all"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains("must be a regular file, not a symlink")
            && t.contains(&lock.display().to_string()),
        "{t}"
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
}

/// A lock directory on a read-only file system (a hostPath mounted read-only, say)
/// is reported as such, not as a symlink. Runs vfio-manager in a private mount
/// namespace (`unshare -m`, as root) over a read-only tmpfs.
#[test]
fn a_read_only_lock_directory_is_reported_as_read_only() {
    assert!(
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0")),
        "this test mounts a read-only tmpfs in a private mount namespace: run it as root"
    );
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let lock = dir.path().join(common::OWNER_LOCK);
    let lock_dir = lock.parent().unwrap();
    std::fs::create_dir_all(lock_dir).unwrap();
    let before = snapshot(dir.path());
    let vfio_manager = common::command(dir.path());
    let mut argv = vec![vfio_manager.get_program().to_owned()];
    argv.extend(vfio_manager.get_args().map(ToOwned::to_owned));
    argv.extend(["bind".into(), "--all".into()]);
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount -t tmpfs -o ro tmpfs "$0" && exec "$@""#)
        .arg(lock_dir)
        .args(&argv)
        .output()
        .unwrap();
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    // The gate beside the lock is the first file it creates.
    assert!(
        t.contains(&format!(
            "cannot create the owner lock {}.gate: its file system is read-only (EROFS)",
            lock.display()
        )),
        "{t}"
    );
    assert!(!t.contains("symlink"), "{t}");
    assert_eq!(snapshot(dir.path()), before, "nothing touched");
}

/// `bind` or `unbind` waiting on the owner lock's gate (held only while a record
/// is read or written; here by a process that sits on it) says whom it waits for,
/// and goes on once it is let go.
#[test]
fn waiting_on_the_owner_gate_names_its_holder() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let lock = dir.path().join(common::OWNER_LOCK);
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    let gate = lock.with_extension("lock.gate");
    std::fs::write(&gate, "").unwrap();
    let mut holder = Command::new("flock")
        .arg(&gate)
        .args(["sleep", "2"])
        .spawn()
        .unwrap();
    // flock(1) has taken it once its child runs.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !std::fs::read_to_string("/proc/locks")
        .unwrap()
        .lines()
        .any(|l| l.contains("FLOCK") && l.contains(&format!(":{} ", inode(&gate))))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "flock(1) never took the gate"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let started = std::time::Instant::now();
    let out = run(dir.path(), &["unbind", "--all"]);
    let waited = started.elapsed();
    holder.wait().unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        waited >= std::time::Duration::from_millis(500),
        "{waited:?}"
    );
    assert!(
        t.contains(&format!(
            "waiting for the owner lock's gate, held by pid {} (flock)",
            holder.id()
        )) && t.contains(&gate.display().to_string()),
        "{t}"
    );
}

fn inode(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().ino()
}
