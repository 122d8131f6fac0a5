//! A Kubernetes node in the real-kernel test bed: Debian 12's kernel under
//! QEMU with the bed's emulated IOMMU and stand-in devices, running kubelet,
//! containerd and runc (`scripts/vm/node.sh` assembles it, `scripts/vm/
//! node-init.sh` is its `/init`), joined to a control plane on the host over
//! QEMU's user network: the guest reaches the host's loopback as 10.0.2.2, so
//! the API server's certificate names that address too ([`crate::pki`]),
//! and the API server advertises it as the `kubernetes` Service's endpoint:
//! the node's kube-proxy (nftables) sends a pod's in-cluster requests there.
//!
//! What the node runs is what a user's node runs: pods from images in its
//! containerd, `/sys`, `/dev` and `/lib/modules` the kernel's own. The harness
//! reads the node through a shell the guest serves on a forwarded port, as an
//! operator would through ssh (kubelet's own port is not reachable from the
//! API server here, so `kubectl logs` and `exec` are not used).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::control::{ControlPlane, HOST_FROM_GUEST, KUBELET_TOKEN, KUBE_PROXY_TOKEN};
use crate::image::{busybox_archive, busybox_archive_with};
use crate::pki::kubeconfig;
use crate::proc::{free_port, run, wait_for, Proc};

pub use crate::image::{BUSYBOX, PAUSE};

/// The VM pods' image: busybox, QEMU and `kubelet-peer`.
pub const VMM: &str = "localhost/vmm:vfio-sandbox-test";
/// QEMU in that image: scripts/vm/fetch-qemu.sh's wrapper, which runs the
/// tree under `/opt/qemu`.
pub const VMM_QEMU: &str = "/usr/bin/qemu-system-x86_64";
/// Where the node keeps that tree (`/opt/qemu` of the VM pods: a hostPath).
pub const VMM_QEMU_DIR: &str = "/data/vmm/opt/qemu";

/// The pods' addresses (the CNI bridge's range; kube-proxy's cluster CIDR).
const POD_SUBNET: &str = "10.244.0.0/24";

/// What `scripts/vm/node.sh` built.
pub struct Artifacts {
    /// The initramfs, without the node's credentials.
    pub initrd: PathBuf,
    /// QEMU's command: the program, the machine and its devices.
    pub qemu_args: Vec<String>,
}

/// Builds the node's kernel, initramfs and disk into `dir`: our image from
/// `image_archive`, kubelet from `k8s_bins`, containerd from `containerd_bins`,
/// and the VM image ([`VMM`]) around the static `kubelet-peer` at `vmm`.
pub fn build(
    repo: &Path,
    dir: &Path,
    k8s_bins: &Path,
    containerd_bins: &Path,
    image_archive: &Path,
    vmm: &Path,
) -> Result<Artifacts> {
    let images = dir.join("images");
    std::fs::create_dir_all(&images)?;
    let work = dir.join("image-work");
    for (name, file, entrypoint) in [
        (BUSYBOX, "busybox.tar", vec!["/bin/sh"]),
        (PAUSE, "pause.tar", vec!["/bin/sleep", "2147483647"]),
    ] {
        let archive = busybox_archive(&work, name, &entrypoint)?;
        std::fs::rename(&archive, images.join(file))?;
    }
    // The VM's image: QEMU as the bed's guests run it (scripts/vm/fetch-qemu.sh,
    // cached) and kubelet-peer's `vmm`, which starts it on the pod's devices
    // and checks them through QMP (the real-kernel scenarios' check).
    let qemu = run(&mut Command::new(repo.join("scripts/vm/fetch-qemu.sh")))
        .context("scripts/vm/fetch-qemu.sh")?;
    let cpio = qemu
        .lines()
        .find_map(|l| l.strip_prefix("GUEST_QEMU_CPIO="))
        .map(|v| v.trim_matches('\'').to_owned())
        .context("scripts/vm/fetch-qemu.sh printed no GUEST_QEMU_CPIO")?;
    // QEMU itself (65 MB) is on the node's disk, mounted into the VM's pod
    // (VMM_QEMU_DIR): in the image, importing it costs the guest a minute.
    let archive = busybox_archive_with(&work, VMM, &["/bin/kubelet-peer"], |root| {
        std::fs::copy(vmm, root.join("bin/kubelet-peer"))
            .with_context(|| format!("copying {}", vmm.display()))?;
        run(Command::new("sh").arg("-c").arg(format!(
            "cd '{}' && cpio -idm --quiet usr/bin/qemu-system-x86_64 < '{cpio}'",
            root.display()
        )))?;
        Ok(())
    })?;
    std::fs::rename(&archive, images.join("vmm.tar"))?;
    let out = dir.join("node");
    let env = run(Command::new(repo.join("scripts/vm/node.sh"))
        .arg(&out)
        .env("K8S_BINS", k8s_bins)
        .env("CONTAINERD_BINS", containerd_bins)
        .env("IMAGE_ARCHIVE", image_archive)
        .env("NODE_IMAGES", &images)
        .env("NODE_QEMU_CPIO", &cpio))
    .context("scripts/vm/node.sh")?;
    let value = |key: &str| -> Result<String> {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .map(|v| v.trim_matches('\'').to_owned())
            .with_context(|| format!("scripts/vm/node.sh printed no {key}"))
    };
    let args = std::fs::read_to_string(value("NODE_QEMU_ARGS")?)?;
    Ok(Artifacts {
        initrd: PathBuf::from(value("NODE_INITRD")?),
        qemu_args: args.lines().map(str::to_owned).collect(),
    })
}

/// The name an OCI archive of `scripts/image.sh` gives its image
/// (`org.opencontainers.image.ref.name` of its index), as (repository, tag).
pub fn image_ref(archive: &Path) -> Result<(String, String)> {
    let index = run(Command::new("tar")
        .arg("-xOf")
        .arg(archive)
        .arg("index.json"))?;
    let index: serde_json::Value = serde_json::from_str(&index)
        .with_context(|| format!("the index of {}", archive.display()))?;
    let name = index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"]
        .as_str()
        .with_context(|| format!("{} names no image", archive.display()))?;
    let (repo, tag) = name
        .rsplit_once(':')
        .with_context(|| format!("{name}: no tag"))?;
    Ok((repo.to_owned(), tag.to_owned()))
}

/// The running guest.
pub struct Guest {
    /// Its name, the Node's.
    pub name: String,
    /// The serial console's file.
    pub console: PathBuf,
    shell_port: u16,
    qemu: Proc,
}

impl Guest {
    /// Boots the node for `plane` and waits until its Node is Ready.
    pub fn boot(plane: &ControlPlane, dir: &Path, built: &Artifacts) -> Result<Self> {
        let config = dir.join("config/node-config");
        std::fs::create_dir_all(&config)?;
        let port = plane
            .server
            .rsplit(':')
            .next()
            .context("the API server's address has no port")?;
        std::fs::copy(&plane.pki.ca, config.join("ca.crt"))?;
        let server = format!("https://{HOST_FROM_GUEST}:{port}");
        for (name, token) in [("kubelet", KUBELET_TOKEN), ("kube-proxy", KUBE_PROXY_TOKEN)] {
            kubeconfig(
                &config.join(format!("{name}.kubeconfig")),
                &server,
                Path::new("/node-config/ca.crt"),
                token,
            )?;
        }
        std::fs::write(config.join("kube-proxy.yaml"), kube_proxy_config())?;
        std::fs::write(
            config.join("node.env"),
            format!("NODE_NAME={}\n", plane.node),
        )?;
        std::fs::write(
            config.join("kubelet.yaml"),
            crate::kubelet::config("0.0.0.0", 10250, "unix:///run/containerd/containerd.sock")
                .to_string(),
        )?;
        // containerd as on the host's node, its state on the data disk; it may
        // set any OOM score here.
        let containerd = crate::containerd::config(
            &crate::containerd::Paths {
                root: Path::new("/data/state/containerd/root"),
                state: Path::new("/run/containerd"),
                socket: Path::new("/run/containerd/containerd.sock"),
                cdi: Path::new("/var/run/cdi"),
                cni: Path::new("/etc/cni/net.d"),
                snapshotter: "overlayfs",
            },
            false,
        );
        std::fs::write(config.join("containerd.toml"), containerd)?;
        // The pods' network: a bridge with addresses from host-local, as a
        // plain CNI install has it (Debian's containernetworking-plugins).
        std::fs::write(
            config.join("10-pods.conflist"),
            serde_json::json!({"cniVersion": "1.0.0", "name": "pods", "plugins": [{
                "type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                         "routes": [{"dst": "0.0.0.0/0"}]}}]})
            .to_string(),
        )?;
        let cpio = dir.join("config.cpio");
        run(Command::new("sh").arg("-c").arg(format!(
            "cd '{}' && find node-config | cpio -o -H newc -R 0:0 --quiet > '{}'",
            dir.join("config").display(),
            cpio.display()
        )))?;
        let initrd = dir.join("initrd");
        let mut bytes = std::fs::read(&built.initrd)?;
        bytes.extend(std::fs::read(&cpio)?);
        std::fs::write(&initrd, bytes)?;

        let shell_port = free_port()?;
        let console = plane.logs_dir().join("guest-console.log");
        let mut args = built.qemu_args.iter();
        let program = args.next().context("node.sh gave no QEMU command")?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .arg("-netdev")
            .arg(format!(
                "user,id=node_net,hostfwd=tcp:127.0.0.1:{shell_port}-:2323"
            ))
            .arg("-initrd")
            .arg(&initrd)
            .arg("-append")
            // As the bed boots (scripts/vm/run.sh): no_timer_check against the
            // early timer check that stalls under a loaded host.
            .arg(
                "console=ttyS0 panic=-1 quiet cryptomgr.notests no_timer_check \
                    intel_iommu=on iommu=pt",
            )
            .arg("-serial")
            .arg(format!("file:{}", console.display()));
        let qemu = Proc::spawn("qemu", cmd, &plane.logs_dir())?;
        let mut guest = Self {
            name: plane.node.clone(),
            console,
            shell_port,
            qemu,
        };
        let start = Instant::now();
        wait_for(
            "the guest's Node to be Ready",
            Duration::from_secs(420),
            || {
                guest.qemu.check()?;
                let console = std::fs::read_to_string(&guest.console).unwrap_or_default();
                if let Some(line) = console.lines().find(|l| l.contains("NODE FAIL")) {
                    bail!("the node did not come up: {line}");
                }
                let ready = plane
                    .kubectl(&[
                        "get",
                        "node",
                        &guest.name,
                        "-o",
                        "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
                    ])
                    .unwrap_or_default();
                Ok((ready == "True").then_some(()))
            },
        )
        .with_context(|| guest.console_tail())?;
        println!(
            "guest-node: {} Ready {:.1} s after QEMU started ({})",
            guest.name,
            start.elapsed().as_secs_f64(),
            guest.boot_events()
        );
        Ok(guest)
    }

    /// The console's `NODE <event> uptime=<s>` lines, as `event s, ...`.
    pub fn boot_events(&self) -> String {
        std::fs::read_to_string(&self.console)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let rest = l.trim_start_matches('\r').strip_prefix("NODE ")?;
                let (event, up) = rest.split_once(" uptime=")?;
                Some(format!("{event} {}", up.trim()))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn console_tail(&self) -> String {
        format!(
            "the guest's console ({}):\n{}",
            self.console.display(),
            crate::proc::tail(&self.console, 30)
        )
    }

    /// Runs `script` in the guest's shell; gives its exit status and output
    /// (stdout and stderr).
    pub fn sh(&self, script: &str) -> Result<(i32, String)> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.shell_port))
            .context("connecting to the guest's shell")?;
        stream.set_read_timeout(Some(Duration::from_secs(180)))?;
        stream.write_all(format!("{{ {script}\n}} 2>&1\necho \"__rc=$?\"\nexit\n").as_bytes())?;
        stream.shutdown(std::net::Shutdown::Write)?;
        let mut out = String::new();
        stream
            .read_to_string(&mut out)
            .context("reading the guest's shell")?;
        let (body, rc) = out
            .rsplit_once("__rc=")
            .with_context(|| format!("the guest's shell ended early: {out}"))?;
        let rc = rc.trim().parse().unwrap_or(-1);
        Ok((rc, body.to_owned()))
    }

    /// Runs `script` in the guest and gives its output; fails on a non-zero status.
    pub fn check_sh(&self, script: &str) -> Result<String> {
        let (rc, out) = self.sh(script)?;
        if rc != 0 {
            bail!("in the guest, `{script}` exited {rc}: {}", out.trim());
        }
        Ok(out)
    }

    /// The driver `bdf` is bound to in the guest (`none` for none).
    pub fn driver(&self, bdf: &str) -> Result<String> {
        let out = self.check_sh(&format!(
            "d=/sys/bus/pci/devices/{bdf}/driver; if [ -e $d ]; then basename \
                $(readlink $d); else echo none; fi"
        ))?;
        Ok(out.trim().to_owned())
    }

    /// Where the node's CPU went: QEMU's CPU seconds on the host (every vCPU
    /// thread and the device emulation), the guest's own busy seconds
    /// (`/proc/stat`), and its processes with the most (each with its reaped
    /// children), summed by name, so far.
    pub fn cpu(&self) -> Result<String> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.qemu.pid()))?;
        let fields: Vec<&str> = stat
            .rsplit_once(") ")
            .map_or(Vec::new(), |(_, rest)| rest.split(' ').collect());
        let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
        let qemu = (11..=14).map(ticks).sum::<Option<f64>>().unwrap_or(0.0) / clock_ticks();
        // Fields after the command name: utime is the 12th, then stime, cutime
        // and cstime (proc(5)); the command name may hold spaces.
        let guest = self.check_sh(
            "awk '/^cpu /{printf \"%.0f\", ($2+$3+$4+$7+$8)/100}' /proc/stat; echo; \
             cat /proc/[0-9]*/stat 2>/dev/null | awk '{ o = index($0, \"(\"); c = index($0, \") \"); \
               split(substr($0, c + 2), f, \" \"); t[substr($0, o + 1, c - o - 1)] += f[12] + f[13] + f[14] + f[15] } \
               END { for (n in t) if (t[n] >= 100) printf \"%.0f %s\\n\", t[n] / 100, n }' | sort -rn | head -8",
        )?;
        let mut lines = guest.lines();
        let busy = lines.next().unwrap_or("?").trim().to_owned();
        let top: Vec<String> = lines
            .filter_map(|l| l.trim().split_once(' '))
            .map(|(secs, name)| format!("{name} {secs}"))
            .collect();
        Ok(format!(
            "QEMU {qemu:.0} s of host CPU; the guest busy {busy} s; by process (s): {}",
            top.join(", ")
        ))
    }

    /// Fails if QEMU has exited.
    pub fn check(&mut self) -> Result<()> {
        self.qemu.check()
    }
}

/// kube-proxy's configuration: nftables (the guest has `nft`, not iptables),
/// and every packet to a Service masqueraded, since the only endpoint is the
/// host's API server behind QEMU's user network, which answers the guest's
/// own address and no pod's. Conntrack limits stay as the kernel has them.
fn kube_proxy_config() -> String {
    serde_json::json!({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": "/node-config/kube-proxy.kubeconfig"},
        "mode": "nftables",
        "clusterCIDR": POD_SUBNET,
        "nftables": {"masqueradeAll": true},
        "conntrack": {"maxPerCore": 0, "min": 0,
                      "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "metricsBindAddress": "127.0.0.1:10249",
        "healthzBindAddress": "127.0.0.1:10256",
    })
    .to_string()
}

/// The kernel's clock ticks per second (`CLK_TCK`), in which `/proc` counts CPU time.
fn clock_ticks() -> f64 {
    let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK);
    ticks.ok().flatten().map_or(100.0, |t| t as f64)
}
