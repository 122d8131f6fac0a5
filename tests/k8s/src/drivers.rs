//! Our binaries on the node: a fake sysfs holding the devices (their real moves
//! are the real-kernel scenarios' job), the shipped manifests applied (RBAC,
//! DeviceClasses), the DRA driver authenticated with its ServiceAccount's token,
//! the device plugin on kubelet's device-plugin socket.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use sysfs_pci::testing::{FakeDevice, FakeKernel, FakeNode};

use crate::control::{path_str, ControlPlane};
use crate::node::Node;
use crate::pcicore::PciCore;
use crate::pki::kubeconfig;
use crate::proc::{wait_for, Proc};

/// The DRA driver's name (the shipped default).
pub const DRIVER: &str = "vfio-sandbox.rebellions.ai";
/// The namespace the scenarios install the chart's DRA values in.
pub const DRIVER_NS: &str = "vfio-sandbox-dra";
/// The DRA driver's ServiceAccount there.
pub const DRIVER_SA: &str = "sandbox-dra-driver";
/// The resource the `rebellions` preset names Rebellions ATOM CA22 (0x1eff:0x1220).
pub const CA22: &str = "rebellions.ai/ATOM_CA22_PT";
/// The DeviceClass the chart makes of that resource.
pub const CA22_CLASS: &str = "atom-ca22-pt.vfio-sandbox.rebellions.ai";

/// The repository's root (manifests, binaries).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The fake host: two ATOM CA22 NPUs, each alone in its IOMMU group and on
/// vfio-pci, and two functions of a NIC that share one ([`PAIR`]), with their
/// group nodes as character devices (a runtime creates a container's device
/// nodes only from real ones), the NPUs' own driver
/// (`rebellions`) registered, and a PCI core that moves them when a driver
/// writes the sysfs attributes ([`PciCore`]).
pub struct Host {
    /// Where its `sys`, `dev` and `lib/modules` are.
    pub dir: PathBuf,
    /// The fake tree.
    pub fake: FakeNode,
    /// The mounted attributes that act when written.
    pub core: PciCore,
}

/// The NPUs' own kernel driver.
pub const NATIVE: &str = "rebellions";

/// The NPUs: address and IOMMU group.
pub const NPUS: &[(&str, u32)] = &[("0000:41:00.0", 21), ("0000:42:00.0", 22)];

/// Two functions of one NIC (Intel I350, `8086:1521`) that share IOMMU group
/// [`PAIR_GROUP`], as behind a switch without ACS; on vfio-pci like the NPUs,
/// and selected by no shipped resource list (only `dra-group-unsplittable`
/// selects them).
pub const PAIR: [&str; 2] = ["0000:43:00.0", "0000:43:00.1"];
/// Their IOMMU group.
pub const PAIR_GROUP: u32 = 23;

impl Host {
    /// Makes the fake tree in `dir` and mounts its PCI core.
    pub fn create(dir: &Path) -> Result<Self> {
        let fake = FakeNode::new(dir);
        fake.add_driver("vfio-pci");
        fake.add_driver(NATIVE);
        for m in ["vfio", "vfio_iommu_type1", "vfio_pci"] {
            fake.add_module(m);
        }
        for (address, group) in NPUS {
            fake.add_device(
                &FakeDevice::new(address, 0x1eff, 0x1220, 0x12_0000)
                    .driver("vfio-pci")
                    .group(*group)
                    .numa(0),
            );
        }
        for address in PAIR {
            fake.add_device(
                &FakeDevice::new(address, 0x8086, 0x1521, 0x02_0000)
                    .driver("vfio-pci")
                    .group(PAIR_GROUP)
                    .numa(0),
            );
        }
        char_devices(dir)?;
        let nodes = dir.to_owned();
        let core = PciCore::mount(
            Arc::new(FakeKernel::new(&fake)),
            Arc::new(move || {
                if let Err(e) = char_devices(&nodes) {
                    eprintln!("real-k8s: the fake PCI core: {e:#}");
                }
            }),
        )?;
        let host = Self {
            dir: dir.to_owned(),
            fake,
            core,
        };
        for (address, _) in NPUS {
            host.set_fatal_errors(address, 0)?;
        }
        Ok(host)
    }

    /// Takes the NPU at `address` off vfio-pci (as a hand-made unbind does), or
    /// puts it back; its group node goes and comes with it.
    pub fn set_on_vfio(&self, address: &str, on: bool) -> Result<()> {
        self.set_driver(address, on.then_some("vfio-pci"))
    }

    /// Binds the NPU at `address` to `driver` (or to none) behind every
    /// driver's back, as a hand-made bind does.
    pub fn set_driver(&self, address: &str, driver: Option<&str>) -> Result<()> {
        let a = address.parse().context("an NPU address")?;
        match driver {
            Some(d) => self.fake.attach(&a, d),
            None => self.fake.detach(&a),
        }
        char_devices(&self.dir)
    }

    /// The driver the NPU at `address` is on.
    pub fn driver_of(&self, address: &str) -> Result<Option<String>> {
        Ok(self
            .fake
            .driver_of(&address.parse().context("an NPU address")?))
    }

    /// Gives the NPU at `address` the PCI device id `device` (`0x1250` makes it
    /// an ATOM CA25), as another card in that slot would have.
    pub fn set_device_id(&self, address: &str, device: u16) -> Result<()> {
        let a = address.parse().context("an NPU address")?;
        let dir = self.fake.canonical_dir(&a);
        std::fs::write(dir.join("device"), format!("0x{device:04x}\n"))?;
        // pci:v<vendor, 8 hex digits>d<device, 8 hex digits>sv…
        let alias = std::fs::read_to_string(dir.join("modalias"))?;
        if let (Some(head), Some(tail)) = (alias.get(..14), alias.get(22..)) {
            std::fs::write(dir.join("modalias"), format!("{head}{device:08X}{tail}"))?;
        }
        Ok(())
    }

    /// Sets the NPU's count of fatal PCIe errors since boot, as the kernel's
    /// AER driver reports it (`aer_dev_fatal`, drivers/pci/pcie/aer.c).
    pub fn set_fatal_errors(&self, address: &str, n: u64) -> Result<()> {
        let a = address.parse().context("an NPU address")?;
        let text = format!(
            "Undefined 0\nDLP {n}\nSDES 0\nTLP 0\nFCP 0\nCmpltTO 0\nCmpltAbrt 0\n\
             UnxCmplt 0\nRxOF 0\nMalfTLP 0\nECRC 0\nUnsupReq 0\nACSViol 0\n\
             UncorrIntErr 0\nBlockedTLP 0\nAtomicOpBlocked 0\nTLPBlockedErr 0\n\
             PoisonTLPBlocked 0\nTOTAL_ERR_FATAL {n}\n"
        );
        std::fs::write(self.fake.canonical_dir(&a).join("aer_dev_fatal"), text)?;
        Ok(())
    }

    fn common_args(&self, cmd: &mut Command, config: &Path) {
        cmd.arg(format!("--sysfs-root={}", self.dir.join("sys").display()))
            .arg(format!("--dev-root={}", self.dir.join("dev").display()))
            .arg(format!("--config={}", config.display()));
    }
}

/// `/dev/vfio/vfio` and the node of each group with a member on vfio-pci as
/// 1:3 (as `/dev/null`); the fake kernel makes them plain files.
fn char_devices(dir: &Path) -> Result<()> {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    use std::os::unix::fs::FileTypeExt;
    let vfio = dir.join("dev/vfio");
    std::fs::create_dir_all(&vfio)?;
    let mut nodes = vec![vfio.join("vfio")];
    nodes.extend(NPUS.iter().map(|(_, g)| vfio.join(g.to_string())));
    nodes.push(vfio.join(PAIR_GROUP.to_string()));
    for path in nodes {
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_char_device() => continue,
            Ok(_) => std::fs::remove_file(&path)?,
            // Only the control node is made where the kernel made none.
            Err(_) if path.ends_with("vfio") => {}
            Err(_) => continue,
        }
        mknod(
            &path,
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(1, 3),
        )
        .with_context(|| format!("mknod {}", path.display()))?;
    }
    Ok(())
}

/// The chart (`charts/vfio-sandbox`).
pub fn chart() -> PathBuf {
    repo().join("charts/vfio-sandbox")
}

/// The release of the chart with its DRA values (`examples/dra.yaml`).
pub const DRA_RELEASE: &str = "vfio-sandbox-dra";

/// `helm install` of the chart with its DRA values, as a user installs it (the
/// DaemonSet lands on no node: ours does not carry its label).
pub fn install_dra_manifests(plane: &ControlPlane) -> Result<()> {
    let chart = chart();
    plane
        .helm(&[
            "install",
            DRA_RELEASE,
            path_str(&chart),
            "--namespace",
            DRIVER_NS,
            "--create-namespace",
            "-f",
            path_str(&chart.join("examples/dra.yaml")),
        ])
        .context("helm install of the chart with examples/dra.yaml")?;
    // The claim labeller's Deployment would pull an image the node does not
    // have; the scenarios that need the labeller run its binary on the host.
    plane
        .kubectl(&[
            "scale",
            "deployment/sandbox-dra-controller",
            "-n",
            DRIVER_NS,
            "--replicas=0",
        ])
        .context("scaling the claim labeller's Deployment to 0")?;
    Ok(())
}

/// The resource list the chart ships (its ConfigMap with the default values),
/// written to a file in the control plane's directory.
pub fn shipped_config(plane: &ControlPlane) -> Result<PathBuf> {
    let path = plane.dir.join("shipped-config.json");
    if path.exists() {
        return Ok(path);
    }
    let rendered = plane.helm(&[
        "template",
        "shipped",
        path_str(&chart()),
        "--show-only",
        "templates/config.yaml",
    ])?;
    // The template writes the value with `quote`: a double-quoted string, in
    // the syntax YAML and JSON share.
    let quoted = rendered
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("config.json: "))
        .context("the chart's ConfigMap has no config.json")?;
    let config: String = serde_json::from_str(quoted).context("reading the chart's config.json")?;
    std::fs::write(&path, config)?;
    Ok(path)
}

/// A running DRA driver.
pub struct DraDriver {
    /// Its process.
    pub proc: Proc,
    /// Its state file.
    pub state: PathBuf,
}

/// Where the DRA driver of `node` keeps its files.
pub fn dra_dir(node: &Node) -> PathBuf {
    dra_dir_in(&node.dir)
}

/// [`dra_dir`] of the node whose directory is `node_dir`, before it starts.
pub fn dra_dir_in(node_dir: &Path) -> PathBuf {
    node_dir.join("dra")
}

/// The pod the driver runs as, on `node`, made once: a DaemonSet pod's token
/// is bound to its pod, and so carries its node's name, which the API server
/// reads to authorize the driver's writes of `status.devices` on claims
/// allocated on that node (`associated-node:update` on
/// `resourceclaims/driver`, `pkg/registry/resource/utils.go`
/// `AuthorizedForDeviceStatus`). kubelet runs it as a sleeping busybox.
fn driver_pod(plane: &ControlPlane, node: &Node) -> Result<String> {
    let name = format!("{DRIVER_SA}-{}", node.name);
    plane.apply(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {DRIVER_NS}\nspec:\n  \
         nodeName: {node}\n  serviceAccountName: {DRIVER_SA}\n  hostNetwork: true\n  \
         terminationGracePeriodSeconds: 1\n  containers:\n  - name: driver\n    image: {image}\n    \
         imagePullPolicy: Never\n    command: ['/bin/sleep', '1000000']\n",
        node = node.name,
        image = crate::node::BUSYBOX,
    ))?;
    Ok(name)
}

/// Starts `sandbox-dra-driver` for the node, as its DaemonSet would: the
/// kubelet paths of the node, the shipped resource list, and a token of its
/// ServiceAccount (so the shipped ClusterRole is all it may do).
pub fn start_dra(
    plane: &ControlPlane,
    node: &Node,
    host: &Host,
    binary: &Path,
    extra_env: &[(&str, &str)],
) -> Result<DraDriver> {
    let config = shipped_config(plane)?;
    start_dra_with(plane, node, host, binary, extra_env, &config)
}

/// [`start_dra`] with the resource list `config` instead of the shipped one.
pub fn start_dra_with(
    plane: &ControlPlane,
    node: &Node,
    host: &Host,
    binary: &Path,
    extra_env: &[(&str, &str)],
    config: &Path,
) -> Result<DraDriver> {
    let dir = dra_dir(node);
    std::fs::create_dir_all(&dir)?;
    driver_kubeconfig(plane, node)?;
    spawn_dra(plane, node, host, binary, extra_env, config)
}

/// Starts `sandbox-dra-driver` again as [`start_dra`] did, with the token
/// that start made (it is good for four hours): a restart with nothing between
/// the kill and the new process, as kubelet restarts a container in place.
pub fn restart_dra(
    plane: &ControlPlane,
    node: &Node,
    host: &Host,
    binary: &Path,
    extra_env: &[(&str, &str)],
) -> Result<DraDriver> {
    let config = shipped_config(plane)?;
    spawn_dra(plane, node, host, binary, extra_env, &config)
}

/// Writes the driver's kubeconfig with a token of its ServiceAccount bound to
/// its pod.
fn driver_kubeconfig(plane: &ControlPlane, node: &Node) -> Result<()> {
    let pod = driver_pod(plane, node)?;
    let token = plane
        .kubectl(&[
            "create",
            "token",
            DRIVER_SA,
            "-n",
            DRIVER_NS,
            "--duration=4h",
            "--bound-object-kind=Pod",
            &format!("--bound-object-name={pod}"),
        ])?
        .trim()
        .to_owned();
    let kubeconfig_file = dra_dir(node).join("driver.kubeconfig");
    kubeconfig(&kubeconfig_file, &plane.server, &plane.pki.ca, &token)
}

/// Starts `sandbox-dra-driver` with the kubeconfig [`driver_kubeconfig`] wrote
/// and waits for its ready file.
fn spawn_dra(
    plane: &ControlPlane,
    node: &Node,
    host: &Host,
    binary: &Path,
    extra_env: &[(&str, &str)],
    config: &Path,
) -> Result<DraDriver> {
    let dir = dra_dir(node);
    let kubeconfig_file = dir.join("driver.kubeconfig");
    let kubelet = node.kubelet_dir();
    let mut cmd = Command::new(binary);
    host.common_args(&mut cmd, config);
    cmd.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("KUBECONFIG", &kubeconfig_file)
        .env("NODE_NAME", &node.name)
        .arg(format!(
            "--modules-root={}",
            host.dir.join("lib/modules").display()
        ))
        .arg(format!(
            "--registry-dir={}",
            kubelet.join("plugins_registry").display()
        ))
        .arg(format!(
            "--plugins-dir={}",
            kubelet.join("plugins").display()
        ))
        .arg(format!("--cdi-dir={}", node.cdi_dir().display()))
        .arg(format!("--metadata-dir={}", dir.join("metadata").display()))
        .arg(format!("--state-file={}", dir.join("state.json").display()))
        .arg(format!("--ready-file={}", dir.join("ready").display()))
        .arg(format!("--owner-lock={}", dir.join("owner.lock").display()))
        .arg(format!(
            "--manager-state-file={}",
            dir.join("manager-state.json").display()
        ))
        // The scenarios' settings, as environment so that `extra_env` can put
        // back the shipped ones. A fake sysfs sends no uevents: a short resync
        // notices its changes.
        .env("VFIO_SANDBOX_LOG_LEVEL", "info,sandbox_dra_driver=debug")
        .env("VFIO_SANDBOX_RESYNC_INTERVAL", "1s");
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    // A driver killed before leaves its ready file: wait for a new one.
    let _ = std::fs::remove_file(dir.join("ready"));
    let logs = plane.logs_dir();
    let mut proc = Proc::spawn("sandbox-dra-driver", cmd, &logs)?;
    let ready = dir.join("ready");
    wait_for(
        "the DRA driver's ready file",
        Duration::from_secs(30),
        || {
            proc.check()?;
            Ok(ready.exists().then_some(()))
        },
    )?;
    Ok(DraDriver {
        proc,
        state: dir.join("state.json"),
    })
}

/// The claim labeller's account and Lease (the chart's `templates/dra-controller.yaml`).
pub const LABELLER: &str = "sandbox-dra-controller";

/// Starts the claim labeller (`sandbox-dra-controller`) on the host as
/// the Deployment runs it: a token of its own account (so the shipped RBAC is
/// all it may do), `POD_NAMESPACE` and `POD_NAME` = `name`, its name in the
/// Lease. Its metrics and readiness on a port of its own, returned.
pub fn start_labeller(plane: &ControlPlane, binary: &Path, name: &str) -> Result<(Proc, u16)> {
    let token = plane
        .kubectl(&[
            "create",
            "token",
            LABELLER,
            "-n",
            DRIVER_NS,
            "--duration=4h",
        ])?
        .trim()
        .to_owned();
    let config = plane.dir.join(format!("{name}.kubeconfig"));
    kubeconfig(&config, &plane.server, &plane.pki.ca, &token)?;
    let mut cmd = Command::new(binary);
    cmd.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("KUBECONFIG", &config)
        .env("POD_NAMESPACE", DRIVER_NS)
        .env("POD_NAME", name)
        .arg("--log-level=info,sandbox_dra_controller=debug");
    let port = crate::proc::free_port()?;
    cmd.arg(format!("--metrics-address=127.0.0.1:{port}"));
    Ok((Proc::spawn(name, cmd, &plane.logs_dir())?, port))
}

/// `GET path` on a local port: the status code and the body.
pub fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("not an HTTP answer: {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    Ok((code, body))
}

/// Starts `sandbox-device-plugin` on kubelet's device-plugin directory with the
/// shipped resource list.
pub fn start_device_plugin(
    plane: &ControlPlane,
    node: &Node,
    host: &Host,
    binary: &Path,
) -> Result<Proc> {
    let mut cmd = Command::new(binary);
    host.common_args(&mut cmd, &shipped_config(plane)?);
    cmd.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .arg(format!(
            "--kubelet-dir={}",
            node.kubelet_dir().join("device-plugins").display()
        ))
        .arg(format!(
            "--owner-lock={}",
            node.dir.join("device-plugin/owner.lock").display()
        ))
        .arg("--resync-interval=1s");
    Proc::spawn("sandbox-device-plugin", cmd, &plane.logs_dir())
}
