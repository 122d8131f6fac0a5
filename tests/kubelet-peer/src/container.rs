//! What a container runtime gives a container from kubelet's answer: its device
//! nodes, its mounts and its environment, and nothing else of the node's `/dev`.
//!
//! The edits come from the device plugin's `Allocate` answer (as `kubelet-peer
//! allocate` prints it) or from CDI devices, resolved from the spec files as the
//! runtimes' CDI cache does (`tags.cncf.io/container-device-interface`,
//! `pkg/cdi/cache.go` and `container-edits.go`): the spec's own `containerEdits`
//! once per spec, then each device's, in the order the ids were given.
//!
//! [`enter`] builds the container's view in a new mount namespace, as runc
//! does for a container's rootfs (`libcontainer/rootfs_linux.go`): a fresh
//! tmpfs on `/dev` holding runc's default devices (`libcontainer/specconv/
//! spec_linux.go`, `AllowedDevices`: null, zero, full, random, urandom, tty) and
//! the listed nodes, made with the host node's type and numbers; a fresh
//! tmpfs on `/run`; then each mount bound in. The rest of the file system
//! (the programs, `/sys`, `/tmp`) stays shared, as a container image and
//! KubeVirt's read-only `/sys` would give it.

use std::collections::BTreeSet;
use std::fs;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context};
use nix::fcntl::{open, OFlag};
use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use serde::{Deserialize, Serialize};

/// A device node: where the container sees it, and the node of the host it is.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Node {
    /// Path inside the container.
    pub path: String,
    /// Path on the host (the same as `path` when the answer gives none).
    pub host_path: String,
}

/// A bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mount {
    /// Source on the host.
    pub host_path: String,
    /// Target inside the container.
    pub container_path: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// What one container is given.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Edits {
    /// `KEY=VALUE`, in order; a later value of a key wins, as in the runtimes.
    pub env: Vec<String>,
    /// Device nodes.
    pub nodes: Vec<Node>,
    /// Bind mounts, in order.
    pub mounts: Vec<Mount>,
}

impl Edits {
    /// The edits a runtime made to the container this process runs in, as far
    /// as a VMM needs them: its `PCI_RESOURCE_*` variables and its
    /// `/dev/vfio` nodes (already there; listed, not made).
    pub fn of_this_container() -> anyhow::Result<Self> {
        let mut e = Edits::default();
        let mut vars: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k.starts_with("PCI_RESOURCE_"))
            .collect();
        vars.sort();
        e.env = vars.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
        for dir in ["/dev/vfio", "/dev/vfio/devices"] {
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| !t.is_dir()) {
                    let path = entry.path().to_string_lossy().into_owned();
                    e.nodes.push(Node {
                        path: path.clone(),
                        host_path: path,
                    });
                }
            }
        }
        Ok(e)
    }

    /// The edits of `kubelet-peer allocate`'s output: `env K=V`, `device HOST
    /// CONTAINER PERMS` and `mount HOST CONTAINER ro|rw` lines.
    pub fn from_allocate(text: &str) -> anyhow::Result<Self> {
        let mut e = Edits::default();
        for (n, line) in text.lines().enumerate() {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                [] => {}
                ["env", kv] if kv.contains('=') => e.env.push((*kv).to_string()),
                ["device", host, container, _perms] => e.nodes.push(Node {
                    path: (*container).to_string(),
                    host_path: (*host).to_string(),
                }),
                ["mount", host, container, mode @ ("ro" | "rw")] => e.mounts.push(Mount {
                    host_path: (*host).to_string(),
                    container_path: (*container).to_string(),
                    read_only: *mode == "ro",
                }),
                _ => bail!(
                    "line {} of the Allocate answer is not env, device or mount: {line:?}",
                    n + 1
                ),
            }
        }
        Ok(e)
    }

    /// The edits of the CDI devices `ids` (`vendor/class=name`), from the spec
    /// files (`*.json`) of `dirs`. Every id must resolve, as a runtime refuses a
    /// container with an unresolvable CDI device.
    pub fn from_cdi(dirs: &[PathBuf], ids: &[String]) -> anyhow::Result<Self> {
        let mut specs = Vec::new();
        for dir in dirs {
            let Ok(entries) = fs::read_dir(dir) else {
                continue;
            };
            let mut paths: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect();
            paths.sort();
            for p in paths {
                let text =
                    fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
                let spec: Spec = serde_json::from_str(&text)
                    .with_context(|| format!("CDI spec {} does not parse", p.display()))?;
                specs.push((p, spec));
            }
        }
        let mut e = Edits::default();
        let mut spec_done = BTreeSet::new();
        for id in ids {
            let (kind, name) = id
                .split_once('=')
                .with_context(|| format!("CDI device id {id:?} is not vendor/class=name"))?;
            let found = specs.iter().enumerate().find_map(|(i, (_, s))| {
                (s.kind == kind)
                    .then(|| s.devices.iter().find(|d| d.name == name))
                    .flatten()
                    .map(|d| (i, d))
            });
            let Some((i, device)) = found else {
                bail!(
                    "unresolvable CDI device {id}: no spec in {} has it",
                    dirs.iter()
                        .map(|d| d.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            };
            if spec_done.insert(i) {
                e.apply(&specs[i].1.container_edits);
            }
            e.apply(&device.container_edits);
        }
        Ok(e)
    }

    fn apply(&mut self, c: &CdiEdits) {
        self.env.extend(c.env.iter().cloned());
        for n in &c.device_nodes {
            let node = Node {
                path: n.path.clone(),
                host_path: n.host_path.clone().unwrap_or_else(|| n.path.clone()),
            };
            if !self.nodes.contains(&node) {
                self.nodes.push(node);
            }
        }
        for m in &c.mounts {
            self.mounts.push(Mount {
                host_path: m.host_path.clone(),
                container_path: m.container_path.clone(),
                read_only: m.options.iter().any(|o| o == "ro"),
            });
        }
    }

    /// The environment as (key, value), a later value of a key replacing an
    /// earlier one in place.
    pub fn env_pairs(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for kv in &self.env {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            match out.iter_mut().find(|(key, _)| key == k) {
                Some(slot) => slot.1 = v.to_string(),
                None => out.push((k.to_string(), v.to_string())),
            }
        }
        out
    }
}

#[derive(Debug, Deserialize)]
struct Spec {
    kind: String,
    #[serde(default)]
    devices: Vec<CdiDevice>,
    #[serde(rename = "containerEdits", default)]
    container_edits: CdiEdits,
}

#[derive(Debug, Deserialize)]
struct CdiDevice {
    name: String,
    #[serde(rename = "containerEdits", default)]
    container_edits: CdiEdits,
}

#[derive(Debug, Default, Deserialize)]
struct CdiEdits {
    #[serde(default)]
    env: Vec<String>,
    #[serde(rename = "deviceNodes", default)]
    device_nodes: Vec<CdiNode>,
    #[serde(default)]
    mounts: Vec<CdiMount>,
}

#[derive(Debug, Deserialize)]
struct CdiNode {
    path: String,
    #[serde(rename = "hostPath")]
    host_path: Option<String>,
}

#[derive(Debug, Deserialize)]
struct CdiMount {
    #[serde(rename = "hostPath")]
    host_path: String,
    #[serde(rename = "containerPath")]
    container_path: String,
    #[serde(default)]
    options: Vec<String>,
}

/// runc's default devices, made in every container's `/dev`.
const DEFAULT_DEVICES: [&str; 6] = [
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
];

/// Turn this process into the container `edits` describe: a new mount
/// namespace whose `/dev` holds only runc's default devices and the listed
/// nodes, a fresh `/run`, and the mounts. The caller then executes the
/// container's program. A listed node missing on the host is an error, as it is
/// for runc.
pub fn enter(edits: &Edits) -> anyhow::Result<()> {
    // Everything of the host is read before /dev and /run are covered.
    let mut nodes = Vec::new();
    for d in DEFAULT_DEVICES {
        nodes.push((d.to_string(), host_node(Path::new(d))?));
    }
    for n in &edits.nodes {
        ensure!(
            n.path.starts_with("/dev/"),
            "device node {} is not under /dev",
            n.path
        );
        let host = host_node(Path::new(&n.host_path))
            .with_context(|| format!("device node {} (host {})", n.path, n.host_path))?;
        nodes.push((n.path.clone(), host));
    }
    let source_is_dir: Vec<bool> = edits
        .mounts
        .iter()
        .map(|m| Path::new(&m.host_path).is_dir())
        .collect();

    unshare(CloneFlags::CLONE_NEWNS).context("unshare(CLONE_NEWNS)")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .context("making / private")?;
    // The sources are opened in the new namespace (a bind mount from a mount of
    // another namespace is EINVAL), before /run is covered.
    let sources: Vec<OwnedFd> = edits
        .mounts
        .iter()
        .map(|m| {
            open(
                m.host_path.as_str(),
                OFlag::O_PATH | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .with_context(|| format!("mount source {}", m.host_path))
        })
        .collect::<anyhow::Result<_>>()?;
    for dir in ["/dev", "/run"] {
        mount(
            Some("tmpfs"),
            dir,
            Some("tmpfs"),
            MsFlags::MS_NOSUID,
            Some("mode=0755"),
        )
        .with_context(|| format!("a fresh tmpfs on {dir}"))?;
    }
    for (path, (kind, rdev, mode)) in &nodes {
        let p = Path::new(path);
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        if p.exists() {
            continue;
        }
        mknod(p, *kind, Mode::from_bits_truncate(*mode), *rdev)
            .with_context(|| format!("mknod {path}"))?;
    }
    for ((m, fd), is_dir) in edits.mounts.iter().zip(&sources).zip(source_is_dir) {
        let target = Path::new(&m.container_path);
        if let Some(parent) = target.parent() {
            fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        if is_dir {
            fs::create_dir_all(target)?;
        } else if !target.exists() {
            fs::write(target, b"").with_context(|| format!("creating {}", target.display()))?;
        }
        let source = format!("/proc/self/fd/{}", fd.as_raw_fd());
        mount(
            Some(source.as_str()),
            target,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .with_context(|| format!("binding {} on {}", m.host_path, m.container_path))?;
        if m.read_only {
            let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
            mount(None::<&str>, target, None::<&str>, flags, None::<&str>)
                .with_context(|| format!("making {} read-only", m.container_path))?;
        }
    }
    Ok(())
}

/// The type, numbers and permission bits of a device node of the host.
fn host_node(path: &Path) -> anyhow::Result<(SFlag, u64, u32)> {
    let meta = fs::metadata(path).with_context(|| format!("no {} on the host", path.display()))?;
    let kind = if meta.file_type().is_char_device() {
        SFlag::S_IFCHR
    } else if meta.file_type().is_block_device() {
        SFlag::S_IFBLK
    } else {
        bail!("{} is not a device node", path.display());
    };
    let rdev = meta.rdev();
    let (major, minor) = (nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev));
    Ok((kind, makedev(major, minor), meta.mode() & 0o777))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allocate_answer_becomes_edits() {
        let e = Edits::from_allocate(
            "env PCI_RESOURCE_X=0000:01:00.0\n\
             device /dev/vfio/vfio /dev/vfio/vfio mrw\n\
             device /dev/vfio/7 /dev/vfio/7 mrw\n\
             mount /var/lib/a /etc/a ro\n",
        )
        .unwrap();
        assert_eq!(e.env, ["PCI_RESOURCE_X=0000:01:00.0"]);
        assert_eq!(e.nodes.len(), 2);
        assert_eq!(e.nodes[1].host_path, "/dev/vfio/7");
        assert!(e.mounts[0].read_only);
        let err = Edits::from_allocate("env\n").unwrap_err().to_string();
        assert!(err.contains("line 1"), "{err}");
    }

    #[test]
    fn cdi_devices_resolve_with_their_spec_edits_once() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join("v-c_1.json"),
            r#"{"cdiVersion":"0.6.0","kind":"v.io/c",
                "containerEdits":{"env":["SPEC=1"],"deviceNodes":[{"path":"/dev/vfio/vfio"}]},
                "devices":[
                  {"name":"a","containerEdits":{"env":["A=1","K=a"],"deviceNodes":[{"path":"/dev/vfio/7","hostPath":"/h/7"}]}},
                  {"name":"b","containerEdits":{"env":["K=b"],"mounts":[{"hostPath":"/m","containerPath":"/c","options":["ro","bind"]}]}}]}"#,
        )
        .unwrap();
        fs::write(dir.path().join("ignored.yaml"), "kind: x").unwrap();
        let dirs = [dir.path().to_path_buf()];
        let e = Edits::from_cdi(&dirs, &["v.io/c=a".into(), "v.io/c=b".into()]).unwrap();
        assert_eq!(e.env, ["SPEC=1", "A=1", "K=a", "K=b"]);
        assert_eq!(
            e.env_pairs(),
            [
                ("SPEC".into(), "1".into()),
                ("A".into(), "1".into()),
                ("K".into(), "b".into())
            ]
        );
        assert_eq!(e.nodes[0].path, "/dev/vfio/vfio");
        assert_eq!(e.nodes[1].host_path, "/h/7");
        assert!(e.mounts[0].read_only);
        let err = Edits::from_cdi(&dirs, &["v.io/c=zz".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("unresolvable CDI device v.io/c=zz"), "{err}");
        let err = Edits::from_cdi(&dirs, &["nokind".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("not vendor/class=name"), "{err}");
    }
}
