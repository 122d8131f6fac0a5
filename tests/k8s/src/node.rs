//! The node: the release's kubelet with containerd 2 (built from its module)
//! and Debian's runc, in a private mount namespace so that nothing they write
//! reaches the machine's own `/var/lib`, `/var/log`, `/run` or kernel settings.
//!
//! The namespace is held by a `sleep` started with `unshare --mount`; containerd
//! and kubelet join it with `nsenter`, so either can be restarted or killed
//! alone. In it:
//! - `/run`, `/var/lib` and `/var/log` are fresh tmpfs mounts;
//! - `/var/lib/kubelet` is the scratch directory `<dir>/kubelet` (kubelet's
//!   device manager listens at the fixed `/var/lib/kubelet/device-plugins/
//!   kubelet.sock`, so the device plugin outside finds it at
//!   `<dir>/kubelet/device-plugins/kubelet.sock`);
//! - `/var/log/pods` is `<dir>/pod-logs`, where the harness reads containers' output;
//! - `/dev/vfio` is the fake host's (the device plugin hands out `/dev/vfio/...`);
//! - the kernel settings kubelet would change (`vm.overcommit_memory`,
//!   `kernel.panic`, …) are files holding the values it wants, so it leaves the
//!   machine's alone.
//!
//! Pods run in the cgroup `/<cgroup_root>` of every hierarchy, which the
//! teardown empties (killing what is left) and removes. Images are built here
//! (a static busybox, as the pod image and as the sandbox "pause" image) and
//! imported into containerd: nothing is pulled.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::control::{feature_gates, ControlPlane, KUBELET_TOKEN};
use crate::pki::kubeconfig;
use crate::proc::{free_port, run, wait_for, Proc};

pub use crate::image::{BUSYBOX, PAUSE};

/// containerd's binaries the run needs, in `--containerd-bins` (containerd finds
/// its shim there, on PATH).
pub const CONTAINERD_BINARIES: [&str; 3] = ["containerd", "containerd-shim-runc-v2", "ctr"];

/// What the kernel settings kubelet checks at start should read
/// (pkg/kubelet/cm/container_manager_linux.go, setupKernelTunables).
const SYSCTLS: &[(&str, &str)] = &[
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

/// The running node: its namespace holder, containerd and kubelet, stopped and
/// cleaned up (cgroups, shims) when dropped.
pub struct Node {
    /// The Node's name (the control plane's).
    pub name: String,
    /// The scratch directory everything of the node lives in.
    pub dir: PathBuf,
    /// Where containerd, its shim and ctr are.
    pub containerd_bins: PathBuf,
    /// The cgroup (in every hierarchy) pods run under.
    pub cgroup_root: String,
    /// kubelet's HTTPS port (`/metrics`, anonymous and allowed).
    pub kubelet_port: u16,
    holder: Option<Proc>,
    containerd: Option<Proc>,
    kubelet: Option<Proc>,
}

impl Node {
    /// The node's scratch directory that kubelet sees as `/var/lib/kubelet`.
    pub fn kubelet_dir(&self) -> PathBuf {
        self.dir.join("kubelet")
    }

    /// containerd's socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.join("containerd/containerd.sock")
    }

    /// Where containerd reads CDI specs.
    pub fn cdi_dir(&self) -> PathBuf {
        Self::cdi_dir_in(&self.dir)
    }

    /// [`Self::cdi_dir`] of the node whose directory is `dir`, before it starts.
    pub fn cdi_dir_in(dir: &Path) -> PathBuf {
        dir.join("cdi")
    }

    /// Starts the namespace, containerd (with the images) and kubelet, and
    /// waits for the Node to be Ready.
    pub fn start(
        plane: &ControlPlane,
        containerd_bins: &Path,
        dir: &Path,
        vfio: &Path,
    ) -> Result<Self> {
        for d in [
            "kubelet",
            "pod-logs",
            "containerd",
            "cni",
            "cdi",
            "sysctl/vm",
            "sysctl/kernel/keys",
        ] {
            std::fs::create_dir_all(dir.join(d))?;
        }
        let cgroup_root = format!("vfio-sandbox-test-{}", std::process::id());
        let mut node = Self {
            name: plane.node.clone(),
            dir: dir.to_owned(),
            containerd_bins: containerd_bins.to_owned(),
            cgroup_root,
            kubelet_port: free_port()?,
            holder: None,
            containerd: None,
            kubelet: None,
        };
        node.make_cgroups()?;
        node.start_holder(plane, vfio)?;
        node.start_containerd(plane)?;
        node.import_images(plane)?;
        node.write_kubelet_config(plane)?;
        node.start_kubelet(plane)?;
        Ok(node)
    }

    fn logs(plane: &ControlPlane) -> PathBuf {
        plane.logs_dir()
    }

    fn start_holder(&mut self, plane: &ControlPlane, vfio: &Path) -> Result<()> {
        let mut script = String::from(
            "set -e\n\
             mount -t tmpfs -o mode=755 tmpfs /run\n\
             mount -t tmpfs -o mode=755 tmpfs /var/lib\n\
             mount -t tmpfs -o mode=755 tmpfs /var/log\n\
             mkdir -p /var/lib/kubelet /var/log/pods\n",
        );
        script += &format!(
            "mount --bind {} /var/lib/kubelet\nmount --bind {} /var/log/pods\n",
            self.dir.join("kubelet").display(),
            self.dir.join("pod-logs").display()
        );
        for (name, value) in SYSCTLS {
            let file = self.dir.join("sysctl").join(name);
            std::fs::write(&file, format!("{value}\n"))?;
            script += &format!("mount --bind {} /proc/sys/{name}\n", file.display());
        }
        // The device plugin hands out /dev/vfio/... as the node's own paths: here
        // /dev is a copy of the machine's (each entry bound back) with the fake
        // host's vfio directory as /dev/vfio.
        script += &format!(
            "mkdir /run/machine-dev\n\
             mount --rbind /dev /run/machine-dev\n\
             mount -t tmpfs -o mode=755 tmpfs /dev\n\
             for e in /run/machine-dev/* /run/machine-dev/.[!.]*; do\n\
             \x20 [ -e \"$e\" ] || [ -L \"$e\" ] || continue\n\
             \x20 n=${{e##*/}}\n\
             \x20 [ \"$n\" = vfio ] && continue\n\
             \x20 if [ -L \"$e\" ]; then cp -P \"$e\" \"/dev/$n\"\n\
             \x20 elif [ -d \"$e\" ]; then mkdir \"/dev/$n\"; mount --rbind \"$e\" \"/dev/$n\"\n\
             \x20 else touch \"/dev/$n\"; mount --bind \"$e\" \"/dev/$n\"; fi\n\
             done\n\
             mkdir /dev/vfio\n\
             mount --bind {} /dev/vfio\n\
             umount -l /run/machine-dev\n",
            vfio.display()
        );
        script += "echo namespace-ready\nexec sleep 2147483647\n";
        let mut cmd = Command::new("unshare");
        cmd.args(["--mount", "--propagation", "private", "sh", "-c", &script]);
        let mut holder = Proc::spawn("node-namespace", cmd, &Self::logs(plane))?;
        let log = holder.log.clone();
        wait_for(
            "the node's mount namespace",
            Duration::from_secs(10),
            || {
                holder.check()?;
                Ok(std::fs::read_to_string(&log)
                    .unwrap_or_default()
                    .contains("namespace-ready")
                    .then_some(()))
            },
        )?;
        self.holder = Some(holder);
        Ok(())
    }

    /// A command run inside the node's mount namespace.
    fn in_namespace(&self, program: &Path) -> Result<Command> {
        let holder = self.holder.as_ref().context("no node namespace")?;
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--mount=/proc/{}/ns/mnt", holder.child.id()))
            .arg("--")
            .arg(program);
        // containerd finds its shim on PATH; the shim finds runc there.
        cmd.env(
            "PATH",
            format!(
                "{}:/usr/sbin:/usr/bin:/sbin:/bin",
                self.containerd_bins.display()
            ),
        );
        Ok(cmd)
    }

    fn start_containerd(&mut self, plane: &ControlPlane) -> Result<()> {
        let d = self.dir.join("containerd");
        // A CNI network of loopback only is enough for the runtime to report
        // its network ready (and so the Node Ready); the test pods use the
        // host's network, which needs no CNI call. A process here may not lower
        // its OOM score.
        let config = crate::containerd::config(
            &crate::containerd::Paths {
                root: &d.join("root"),
                state: &d.join("state"),
                socket: &self.socket(),
                cdi: &self.cdi_dir(),
                cni: &self.dir.join("cni"),
                snapshotter: "native",
            },
            true,
        );
        std::fs::write(d.join("config.toml"), config)?;
        std::fs::write(
            self.dir.join("cni/10-loopback.conflist"),
            r#"{"cniVersion": "1.0.0", "name": "loopback-only", "plugins": [{"type": "loopback"}]}"#,
        )?;
        let mut cmd = self.in_namespace(&self.containerd_bins.join("containerd"))?;
        cmd.arg(format!("--config={}", d.join("config.toml").display()));
        let mut proc = Proc::spawn("containerd", cmd, &Self::logs(plane))?;
        let sock = self.socket();
        wait_for("containerd's socket", Duration::from_secs(30), || {
            proc.check()?;
            Ok(sock.exists().then_some(()))
        })?;
        self.containerd = Some(proc);
        Ok(())
    }

    fn ctr(&self, args: &[&str]) -> Result<String> {
        run(Command::new(self.containerd_bins.join("ctr"))
            .arg(format!("--address={}", self.socket().display()))
            .args(["--namespace", "k8s.io"])
            .args(args))
    }

    fn import_images(&self, plane: &ControlPlane) -> Result<()> {
        let images = plane.dir.join("images");
        for (name, entrypoint) in [
            (BUSYBOX, vec!["/bin/sh"]),
            (PAUSE, vec!["/bin/sleep", "2147483647"]),
        ] {
            let archive = crate::image::busybox_archive(&images, name, &entrypoint)?;
            self.ctr(&[
                "images",
                "import",
                // In the client: the transfer service unpacks only for the
                // snapshotters of its unpack_config (overlayfs by default).
                "--local",
                "--snapshotter",
                "native",
                archive.to_str().unwrap_or_default(),
            ])
            .with_context(|| format!("importing {name}"))?;
        }
        Ok(())
    }

    fn write_kubelet_config(&self, plane: &ControlPlane) -> Result<()> {
        kubeconfig(
            &self.dir.join("kubelet.kubeconfig"),
            &plane.server,
            &plane.pki.ca,
            KUBELET_TOKEN,
        )?;
        let gates: serde_json::Map<String, serde_json::Value> =
            feature_gates(plane.release, plane.gates, true)
                .into_iter()
                .map(|g| (g.to_owned(), true.into()))
                .collect();
        let mut config = crate::kubelet::config(
            "127.0.0.1",
            self.kubelet_port,
            &format!("unix://{}", self.socket().display()),
        );
        config["cgroupRoot"] = format!("/{}", self.cgroup_root).into();
        config["featureGates"] = gates.into();
        // kubelet 1.35+ refuses cgroup v1 unless told not to (the field is there
        // from 1.31); this machine's cgroups are v1 with the unified hierarchy
        // beside them.
        config["failCgroupV1"] = false.into();
        std::fs::write(
            self.dir.join("kubelet.json"),
            serde_json::to_vec_pretty(&config)?,
        )?;
        Ok(())
    }

    /// Starts kubelet and waits for its Node to be Ready.
    pub fn start_kubelet(&mut self, plane: &ControlPlane) -> Result<()> {
        let mut cmd = self.in_namespace(&plane.bins.join("kubelet"))?;
        cmd.arg(format!(
            "--config={}",
            self.dir.join("kubelet.json").display()
        ))
        .arg(format!(
            "--kubeconfig={}",
            self.dir.join("kubelet.kubeconfig").display()
        ))
        .arg(format!("--hostname-override={}", self.name))
        .arg("--node-ip=127.0.0.1")
        .arg("--root-dir=/var/lib/kubelet")
        .arg("--v=2");
        let mut proc = Proc::spawn("kubelet", cmd, &Self::logs(plane))?;
        let name = self.name.clone();
        wait_for("the Node to be Ready", Duration::from_secs(90), || {
            proc.check()?;
            let node = plane.get_json(&["get", "node", &name])?;
            Ok(node["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
                .then_some(()))
        })?;
        self.kubelet = Some(proc);
        Ok(())
    }

    /// kubelet's process, if running.
    pub fn kubelet(&mut self) -> Option<&mut Proc> {
        self.kubelet.as_mut()
    }

    /// Stops kubelet (SIGTERM) or kills it (`kill -9`).
    pub fn stop_kubelet(&mut self, hard: bool) {
        if let Some(mut k) = self.kubelet.take() {
            if hard {
                k.kill9();
            } else {
                k.stop();
            }
        }
    }

    /// kubelet's log so far.
    pub fn kubelet_log(&self, plane: &ControlPlane) -> String {
        std::fs::read_to_string(Self::logs(plane).join("kubelet.log")).unwrap_or_default()
    }

    /// The output of a pod's container (CRI log lines, the content only).
    pub fn container_output(&self, namespace: &str, pod: &str, container: &str) -> Result<String> {
        let prefix = format!("{namespace}_{pod}_");
        let pods = self.dir.join("pod-logs");
        for entry in std::fs::read_dir(&pods)? {
            let entry = entry?;
            if !entry.file_name().to_string_lossy().starts_with(&prefix) {
                continue;
            }
            let dir = entry.path().join(container);
            let mut text = String::new();
            let mut files: Vec<_> = std::fs::read_dir(&dir)
                .with_context(|| format!("reading {}", dir.display()))?
                .flatten()
                .map(|e| e.path())
                .collect();
            files.sort();
            for f in files {
                for line in std::fs::read_to_string(&f)?.lines() {
                    // <time> <stream> <P|F> <content>
                    let content = line.splitn(4, ' ').nth(3).unwrap_or_default();
                    text.push_str(content);
                    text.push('\n');
                }
            }
            return Ok(text);
        }
        bail!(
            "no log of {namespace}/{pod} container {container} in {}",
            pods.display()
        )
    }

    /// The cgroup hierarchies of the machine (v1 controllers and the unified one).
    fn hierarchies() -> Vec<PathBuf> {
        std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir() && !p.is_symlink())
            .collect()
    }

    /// `/<cgroup_root>` in every hierarchy, the cpuset one filled from its
    /// parent (a v1 cpuset cgroup starts with no CPUs and takes no task).
    fn make_cgroups(&self) -> Result<()> {
        for h in Self::hierarchies() {
            let dir = h.join(&self.cgroup_root);
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("creating the cgroup {}", dir.display()))?;
            for f in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(v) = std::fs::read_to_string(h.join(f)) {
                    std::fs::write(dir.join(f), v.trim())?;
                }
            }
        }
        Ok(())
    }

    /// Kills every process left in the node's cgroups and removes them.
    fn remove_cgroups(&self) {
        for _ in 0..50 {
            let mut left = 0;
            for h in Self::hierarchies() {
                for procs in walk_files(&h.join(&self.cgroup_root), "cgroup.procs") {
                    for pid in std::fs::read_to_string(&procs).unwrap_or_default().lines() {
                        if let Ok(pid) = pid.trim().parse::<i32>() {
                            left += 1;
                            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                        }
                    }
                }
            }
            if left == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        for h in Self::hierarchies() {
            let mut dirs = walk_dirs(&h.join(&self.cgroup_root));
            dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
            for d in dirs {
                let _ = std::fs::remove_dir(&d);
            }
        }
    }

    /// Kills containerd's shims of this node (they outlive containerd).
    fn kill_shims(&self) {
        let needle = self.socket().display().to_string();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            if cmdline.contains("containerd-shim") && cmdline.contains(&needle) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop_kubelet(false);
        self.remove_cgroups();
        if let Some(mut c) = self.containerd.take() {
            c.stop();
        }
        self.kill_shims();
        self.remove_cgroups();
        if let Some(mut h) = self.holder.take() {
            h.kill9();
        }
    }
}

fn walk_dirs(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if !dir.is_dir() {
        return out;
    }
    out.push(dir.to_owned());
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() && !p.is_symlink() {
            out.extend(walk_dirs(&p));
        }
    }
    out
}

fn walk_files(dir: &Path, name: &str) -> Vec<PathBuf> {
    walk_dirs(dir)
        .into_iter()
        .map(|d| d.join(name))
        .filter(|f| f.exists())
        .collect()
}
