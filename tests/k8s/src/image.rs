//! Container images made here, so nothing is pulled: one layer holding Debian's
//! static busybox (`/bin/busybox` and a link per applet), in an OCI image
//! layout archive (image-spec: image-layout.md, manifest.md, config.md) that
//! `ctr images import` takes.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::json;

use crate::proc::run;

const BUSYBOX_BINARY: &str = "/bin/busybox";

/// The image pods run, and the sandbox image containerd is told to use.
pub const BUSYBOX: &str = "docker.io/library/busybox:vfio-sandbox-test";
/// The sandbox ("pause") image: busybox sleeping.
pub const PAUSE: &str = "registry.k8s.io/pause:vfio-sandbox-test";

/// Writes the archive of an image named `name` running `entrypoint`, and
/// returns its path.
pub fn busybox_archive(dir: &Path, name: &str, entrypoint: &[&str]) -> Result<PathBuf> {
    busybox_archive_with(dir, name, entrypoint, |_| Ok(()))
}

/// As [`busybox_archive`], with more files: `fill` gets the root file system's
/// directory, busybox already in it, and adds what the image needs.
pub fn busybox_archive_with(
    dir: &Path,
    name: &str,
    entrypoint: &[&str],
    fill: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let safe: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let work = dir.join(&safe);
    let _ = std::fs::remove_dir_all(&work);
    let rootfs = work.join("rootfs");
    let layout = work.join("layout");
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(rootfs.join("bin"))?;
    std::fs::create_dir_all(&blobs)?;
    for d in ["etc", "proc", "sys", "dev", "tmp", "var/run"] {
        std::fs::create_dir_all(rootfs.join(d))?;
    }
    std::fs::copy(BUSYBOX_BINARY, rootfs.join("bin/busybox"))
        .with_context(|| format!("copying {BUSYBOX_BINARY} (Debian's busybox-static)"))?;
    let applets = run(Command::new(BUSYBOX_BINARY).arg("--list"))?;
    for applet in applets
        .lines()
        .map(str::trim)
        .filter(|a| !a.is_empty() && *a != "busybox")
    {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet))?;
    }
    fill(&rootfs)?;

    let layer = work.join("layer.tar");
    tar(&rootfs, &layer)?;
    let layer_digest = blob(&blobs, &std::fs::read(&layer)?)?;
    let layer_size = std::fs::metadata(&layer)?.len();

    let config = json!({
        "architecture": go_arch(),
        "os": "linux",
        "config": {
            "Entrypoint": entrypoint,
            "Env": ["PATH=/bin"],
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_digest}")]},
    });
    let config_bytes = serde_json::to_vec(&config)?;
    let config_digest = blob(&blobs, &config_bytes)?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": format!("sha256:{config_digest}"),
            "size": config_bytes.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": format!("sha256:{layer_digest}"),
            "size": layer_size,
        }],
    });
    let manifest_bytes = serde_json::to_vec(&manifest)?;
    let manifest_digest = blob(&blobs, &manifest_bytes)?;
    let index = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{manifest_digest}"),
            "size": manifest_bytes.len(),
            "platform": {"architecture": go_arch(), "os": "linux"},
            "annotations": {
                "io.containerd.image.name": name,
                "org.opencontainers.image.ref.name": name.rsplit(':').next().unwrap_or(name),
            },
        }],
    });
    std::fs::write(layout.join("index.json"), serde_json::to_vec(&index)?)?;
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion": "1.0.0"}"#,
    )?;
    let archive = work.join("image.tar");
    tar(&layout, &archive)?;
    Ok(archive)
}

/// Packs the tree under `dir` into the tar file `out`, every entry owned by root.
fn tar(dir: &Path, out: &Path) -> Result<()> {
    run(Command::new("tar")
        .args(["--numeric-owner", "--owner=0", "--group=0", "-C"])
        .arg(dir)
        .arg("-cf")
        .arg(out)
        .arg("."))?;
    Ok(())
}

/// Stores `bytes` as a blob named by its SHA-256 (hex), which it returns.
fn blob(blobs: &Path, bytes: &[u8]) -> Result<String> {
    let tmp = blobs.join("incoming");
    std::fs::write(&tmp, bytes)?;
    let out = run(Command::new("sha256sum").arg(&tmp))?;
    let digest = out.split_whitespace().next().unwrap_or_default().to_owned();
    std::fs::rename(&tmp, blobs.join(&digest))?;
    Ok(digest)
}

/// The machine's architecture as Go and OCI name it.
fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}
