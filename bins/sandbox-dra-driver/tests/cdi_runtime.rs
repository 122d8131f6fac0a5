//! A real container runtime applies a prepared claim's CDI spec: Debian's podman
//! (4.3, with runc) runs a busybox container with the claim's CDI device ids, and
//! the container sees what KubeVirt's virt-launcher needs: the
//! `PCI_RESOURCE_<NAME>` variables the device plugin's Allocate would set, the VFIO
//! device nodes, and the device metadata file at the path KubeVirt reads; and
//! each container sees the variables of exactly the devices it was given, with
//! the CDI ids kubelet hands it per request.
//!
//! It needs root, podman, runc and busybox-static, and writes into
//! `/var/run/cdi`, the directory podman 4.3 reads specs from (it has no flag for
//! another): the CI step "CDI runtime" installs them and runs it with `--ignored`.
//! The podman flags fit the CI machine, not CDI: runc and cgroupfs (crun refuses
//! the machine's hybrid cgroups), vfs storage, no network, and rlimits below the
//! machine's (it may not raise them).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::process::Command;

use common::driver::*;
use common::*;
use kubelet_peer::dra::Version;
use serde_json::Value;

const RUNTIME_CDI_DIR: &str = "/var/run/cdi";

/// Makes the fake node's VFIO nodes (the container node and each group's)
/// character devices (1:3, as `/dev/null`): a runtime creates device nodes only
/// from real ones.
fn char_devices(dev: &Path) {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    let vfio = dev.join("vfio");
    let mut nodes: Vec<_> = std::fs::read_dir(&vfio)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    nodes.push(vfio.join("vfio"));
    for path in nodes {
        let _ = std::fs::remove_file(&path);
        let mode = Mode::from_bits_truncate(0o666);
        mknod(&path, SFlag::S_IFCHR, mode, makedev(1, 3)).unwrap();
    }
}

/// A root file system of one static busybox.
fn busybox_root(dir: &Path) -> std::path::PathBuf {
    let root = dir.join("rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    root
}

fn podman(devices: &[String], rootfs: &Path, script: &str) -> String {
    let mut c = Command::new("podman");
    c.args([
        "--runtime",
        "runc",
        "--cgroup-manager",
        "cgroupfs",
        "--storage-driver",
        "vfs",
    ])
    .args(["run", "--rm", "--network", "none"])
    .args([
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=1024:1024",
    ]);
    for d in devices {
        c.args(["--device", d]);
    }
    c.arg("--rootfs")
        .arg(rootfs)
        .args(["/bin/busybox", "sh", "-c", script]);
    let out = c.output().expect("podman runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "podman failed: {text}");
    text
}

/// A scene whose driver writes where podman reads (its CDI directory is
/// `/var/run/cdi`), with character devices for the VFIO nodes.
fn runtime_scene() -> Scene {
    let scene = Scene::new();
    char_devices(&scene.root().join("dev"));
    std::fs::create_dir_all(RUNTIME_CDI_DIR).unwrap();
    std::os::unix::fs::symlink(RUNTIME_CDI_DIR, scene.cdi_dir()).unwrap();
    scene
}

#[tokio::test]
#[ignore = "needs root, podman, runc and busybox-static, and writes /var/run/cdi: run \
    by the CI step 'CDI runtime'"]
async fn podman_applies_a_prepared_claims_cdi_spec() {
    let scene = runtime_scene();
    let server = cluster();
    let _driver = scene.start(&server).await;
    let claim = put_v1beta1_claim(&server);
    let mut client = scene.client(Version::V1).await;
    let answers = prepare(&mut client, std::slice::from_ref(&claim)).await;
    let answer = &answers[&claim.uid];
    assert!(answer.error.is_empty(), "{answers:?}");
    let ids: Vec<String> = answer
        .devices
        .iter()
        .flat_map(|d| d.cdi_device_ids.clone())
        .collect();
    let spec_path = Path::new(RUNTIME_CDI_DIR).join(format!("{DRIVER}-vfio_{}.json", claim.uid));
    let spec: Value = serde_json::from_str(&std::fs::read_to_string(&spec_path).unwrap()).unwrap();
    let mounts: Vec<String> = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| {
            d["containerEdits"]["mounts"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|m| m["containerPath"].as_str().unwrap().to_owned())
        .collect();
    assert!(!mounts.is_empty(), "{spec}");

    let rootfs = busybox_root(scene.root());
    let mut script = String::from("env | sort; ls -l /dev/vfio;");
    for m in &mounts {
        script.push_str(&format!(" echo MOUNT {m}; cat {m};"));
    }
    let out = podman(&ids, &rootfs, &script);
    println!("podman run --device {}:\n{out}", ids.join(" --device "));
    for want in [
        "PCI_RESOURCE_EXAMPLE_COM_NIC_PT=0000:02:00.0",
        "PCI_RESOURCE_EXAMPLE_COM_NVME_PT=0000:03:00.0",
    ] {
        assert!(out.lines().any(|l| l == want), "no {want} in:\n{out}");
    }
    for node in [" vfio", " 6", " 7"] {
        assert!(
            out.lines().any(|l| l.starts_with('c') && l.ends_with(node)),
            "no character device /dev/vfio/{} in:\n{out}",
            node.trim()
        );
    }
    for m in &mounts {
        let after = out.split(&format!("MOUNT {m}\n")).nth(1).unwrap_or("");
        assert!(
            after.contains("resource.kubernetes.io/pciBusID"),
            "{m} in:\n{out}"
        );
    }
    // A device of another claim is not there: only the ones asked for.
    assert!(!out.lines().any(|l| l.ends_with(" 5")), "{out}");

    let gone = unprepare(&mut client, std::slice::from_ref(&claim)).await;
    assert!(gone[&claim.uid].is_empty(), "{gone:?}");
    assert!(!spec_path.exists(), "the spec goes with the claim");
}

/// The CDI ids of `answer`'s devices of `request`, as kubelet hands them to a
/// container whose `resources.claims` entry names that request.
fn ids_of(answer: &kubelet_peer::dra::Prepared, request: &str) -> Vec<String> {
    answer
        .devices
        .iter()
        .filter(|d| d.request_names.iter().any(|r| r == request))
        .flat_map(|d| d.cdi_device_ids.clone())
        .collect()
}

/// The values of KubeVirt's variables in a container's `env` output.
fn variables(out: &str) -> Vec<&str> {
    out.lines()
        .filter(|l| l.starts_with("PCI_RESOURCE_"))
        .collect()
}

#[tokio::test]
#[ignore = "needs root, podman, runc and busybox-static, and writes /var/run/cdi: run \
    by the CI step 'CDI runtime'"]
async fn each_container_sees_the_addresses_of_exactly_its_own_devices() {
    let scene = runtime_scene();
    let server = cluster();
    let _driver = scene.start(&server).await;
    // One claim split between two containers by request (two NICs of group 5 for
    // `a`, one NIC for `b`), and a second claim (the nvme).
    let split = put_claim(
        &server,
        "vm-split",
        "7a1e0c52-3d4b-4e8f-9a6c-2b5d8f1e0a93",
        Some(&[
            ours("a", "pci-0000-01-00-0"),
            ours("a", "pci-0000-01-00-1"),
            ours("b", "pci-0000-02-00-0"),
        ]),
        None,
    );
    let disk = put_claim(
        &server,
        "vm-disk",
        "c3f8a1d2-6e5b-4a7c-8d9e-0f1a2b3c4d5e",
        Some(&[ours("d", "pci-0000-03-00-0")]),
        None,
    );
    let mut client = scene.client(Version::V1).await;
    let claims = [split.clone(), disk.clone()];
    let answers = prepare(&mut client, &claims).await;
    for c in &claims {
        assert!(answers[&c.uid].error.is_empty(), "{answers:?}");
    }
    let (split_answer, disk_answer) = (&answers[&split.uid], &answers[&disk.uid]);
    let rootfs = busybox_root(scene.root());
    let script = "env | sort; ls -l /dev/vfio";
    let run = |ids: Vec<String>| {
        let out = podman(&ids, &rootfs, script);
        println!("podman run --device {}:\n{out}", ids.join(" --device "));
        out
    };
    let groups = |out: &str| -> Vec<String> {
        out.lines()
            .filter(|l| l.starts_with('c'))
            .filter_map(|l| l.rsplit(' ').next())
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            .map(str::to_owned)
            .collect()
    };

    // Two containers splitting the claim: each its own request's addresses.
    let first = run(ids_of(split_answer, "a"));
    assert_eq!(
        variables(&first),
        ["PCI_RESOURCE_EXAMPLE_COM_NIC_PT=0000:01:00.0,0000:01:00.1"]
    );
    assert_eq!(groups(&first), ["5"]);
    let second = run(ids_of(split_answer, "b"));
    assert_eq!(
        variables(&second),
        ["PCI_RESOURCE_EXAMPLE_COM_NIC_PT=0000:02:00.0"]
    );
    assert_eq!(groups(&second), ["6"]);

    // One container with two claims: both claims' variables.
    let both = run([ids_of(split_answer, "b"), ids_of(disk_answer, "d")].concat());
    assert_eq!(
        variables(&both),
        [
            "PCI_RESOURCE_EXAMPLE_COM_NIC_PT=0000:02:00.0",
            "PCI_RESOURCE_EXAMPLE_COM_NVME_PT=0000:03:00.0",
        ]
    );
    assert_eq!(groups(&both), ["6", "7"]);

    // Two requests of one resource name in one container: the runtime keeps one
    // request's value (a variable set twice keeps the last); it never names a
    // device the container was not given.
    let whole = run([ids_of(split_answer, "a"), ids_of(split_answer, "b")].concat());
    let nic = variables(&whole);
    assert!(
        nic == ["PCI_RESOURCE_EXAMPLE_COM_NIC_PT=0000:02:00.0"]
            || nic == ["PCI_RESOURCE_EXAMPLE_COM_NIC_PT=0000:01:00.0,0000:01:00.1"],
        "{nic:?}"
    );

    let gone = unprepare(&mut client, &claims).await;
    assert!(gone.values().all(String::is_empty), "{gone:?}");
}
