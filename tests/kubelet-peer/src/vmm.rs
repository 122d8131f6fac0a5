//! A virtual machine monitor handed what a container gets: QEMU, started the
//! way KubeVirt's virt-launcher has libvirt start it, with one `vfio-pci`
//! device per address of the container's `PCI_RESOURCE_*` variables, inside
//! the container's view of the node ([`crate::container`]).
//!
//! QEMU starts paused (`-S`) with a QMP socket. Realizing a `vfio-pci` device
//! is the whole chain a VM needs: the group's container and IOMMU set (legacy)
//! or the device cdev bound to an IOAS (`-object iommufd`), the device file
//! descriptor, its config space read, its BARs' regions set up for `mmap`, the
//! device reset, and all of guest RAM mapped for DMA; QEMU exits at start when
//! any of it fails, with the kernel's or its own reason. Through QMP the check
//! then reads:
//! - `query-pci`: each device is there, by its `qdev_id`, with the vendor and
//!   device ids the host's sysfs gives;
//! - after a short run of the firmware (SeaBIOS assigns the BARs, as at any
//!   boot), `query-pci` again: every memory BAR has a guest address (x86
//!   only: see [`Options::firmware`]);
//! - `info mtree -f`: the BARs are backed by the device's own mapped regions
//!   (`<address> BAR <n> mmaps[<i>]`), so the guest reaches the device directly.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use crate::container::Edits;

/// How QEMU is started.
#[derive(Debug, Clone)]
pub struct Options {
    /// The QEMU program.
    pub qemu: String,
    /// `-object iommufd` and `iommufd=` on each device, instead of the group's
    /// container.
    pub iommufd: bool,
    /// Guest RAM (`-m`), all of it mapped for DMA at start.
    pub memory: String,
    /// Give up on QEMU after this long.
    pub timeout: Duration,
    /// Let the firmware run until it has assigned the BARs (x86: SeaBIOS). The
    /// aarch64 `virt` machine has none without UEFI, which takes far too long
    /// to start under nested emulation: its BARs stay unassigned.
    pub firmware: bool,
    /// Start QEMU in a container made from the edits (`kubelet-peer
    /// container`); false: QEMU starts in this process's own container, a
    /// pod's.
    pub contained: bool,
}

/// Whether this architecture's machine has a firmware that assigns BARs here.
pub fn has_firmware() -> bool {
    std::env::consts::ARCH == "x86_64"
}

/// The default QEMU program of this architecture.
pub fn default_qemu() -> String {
    format!("qemu-system-{}", std::env::consts::ARCH)
}

/// The PCI addresses of a container's `PCI_RESOURCE_*` variables, as KubeVirt's
/// virt-launcher reads them (`pkg/virt-launcher/virtwrap/device/hostdevice`),
/// in order, each once.
pub fn addresses(edits: &Edits) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (k, v) in edits.env_pairs() {
        if !k.starts_with("PCI_RESOURCE_") {
            continue;
        }
        for a in v.split(',').map(str::trim).filter(|a| !a.is_empty()) {
            if !out.iter().any(|o| o == a) {
                out.push(a.to_string());
            }
        }
    }
    out
}

/// QEMU's arguments: paused, no defaults, a QMP socket, one `vfio-pci` device
/// per address (`hostdev<i>`, its option ROM off, as KubeVirt leaves it unless
/// asked), and `memory` of RAM, all of which is mapped for DMA.
pub fn qemu_args(addresses: &[String], iommufd: bool, memory: &str, qmp: &Path) -> Vec<String> {
    let machine = if std::env::consts::ARCH == "aarch64" {
        "virt,accel=tcg"
    } else {
        "q35,accel=tcg"
    };
    let mut args: Vec<String> = [
        "-S",
        "-machine",
        machine,
        "-m",
        memory,
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-qmp",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(format!("unix:{},server=on,wait=off", qmp.display()));
    if iommufd {
        args.extend(["-object".into(), "iommufd,id=iommufd0".into()]);
    }
    for (i, a) in addresses.iter().enumerate() {
        let backend = if iommufd { ",iommufd=iommufd0" } else { "" };
        args.push("-device".into());
        args.push(format!("vfio-pci,host={a},id=hostdev{i},rombar=0{backend}"));
    }
    args
}

/// One device as QEMU realized it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Realized {
    /// Host address.
    pub address: String,
    /// `vvvv:dddd` as QEMU reads it from the device.
    pub ids: String,
    /// Memory BARs: (bar, size, guest address once assigned).
    pub bars: Vec<(u64, u64, Option<u64>)>,
    /// BARs backed by the device's mapped regions (`info mtree`).
    pub mapped: Vec<u64>,
}

/// A QEMU started for a container, until [`Vm::quit`].
pub struct Vm {
    child: Child,
    qmp: Qmp,
    stderr: Arc<Mutex<String>>,
    socket: PathBuf,
}

/// A VM that came up.
pub struct Up {
    /// The running QEMU.
    pub vm: Vm,
    /// Its devices, in the order of the addresses.
    pub devices: Vec<Realized>,
    /// From the start of the container to QMP answering, every device realized.
    pub realized_after: Duration,
    /// From `cont` until the firmware had assigned every memory BAR.
    pub firmware: Duration,
}

/// Why a VM did not come up: QEMU's (or the container's) own words.
#[derive(Debug)]
pub struct Failed {
    /// What failed.
    pub what: String,
    /// QEMU's standard error.
    pub stderr: String,
}

/// Start QEMU in the container `edits` describe (through `kubelet-peer
/// container`, this program), wait until it is up, and check every device.
/// `Ok(Err(_))` is QEMU refusing; `Err(_)` a fault of the check itself.
pub fn start(edits: &Edits, opts: &Options) -> anyhow::Result<Result<Up, Failed>> {
    let addrs = addresses(edits);
    if addrs.is_empty() {
        bail!(
            "the container's environment names no PCI_RESOURCE_* device: {:?}",
            edits.env
        );
    }
    let socket = std::env::temp_dir().join(format!("kubelet-peer-vmm-{}.qmp", std::process::id()));
    let _ = std::fs::remove_file(&socket);
    let started = Instant::now();
    let mut command = if opts.contained {
        let mut c = Command::new(std::env::current_exe().context("this program's path")?);
        c.arg("container")
            .arg("--edits")
            .arg(serde_json::to_string(edits)?)
            .arg("--")
            .arg(&opts.qemu);
        c
    } else {
        Command::new(&opts.qemu)
    };
    let mut child = command
        .args(qemu_args(&addrs, opts.iommufd, &opts.memory, &socket))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| {
            if opts.contained {
                "starting the container".to_owned()
            } else {
                format!("starting {}", opts.qemu)
            }
        })?;
    let stderr = Arc::new(Mutex::new(String::new()));
    for stream in [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap_or_else(|e| e.into_inner());
                s.push_str(&line);
                s.push('\n');
            }
        });
    }
    let deadline = started + opts.timeout;
    let failed = |child: &mut Child, what: String, stderr: &Arc<Mutex<String>>| {
        let _ = child.kill();
        let _ = child.wait();
        // The readers end with the pipes.
        std::thread::sleep(Duration::from_millis(50));
        let text = stderr.lock().unwrap_or_else(|e| e.into_inner()).clone();
        Failed { what, stderr: text }
    };
    let stream = loop {
        if let Some(status) = child.try_wait()? {
            std::thread::sleep(Duration::from_millis(100));
            let text = stderr.lock().unwrap_or_else(|e| e.into_inner()).clone();
            return Ok(Err(Failed {
                what: format!("QEMU exited at start ({status})"),
                stderr: text,
            }));
        }
        if let Ok(s) = UnixStream::connect(&socket) {
            break s;
        }
        if Instant::now() > deadline {
            return Ok(Err(failed(
                &mut child,
                format!("no QMP socket within {:?}", opts.timeout),
                &stderr,
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut qmp = match Qmp::handshake(stream, deadline) {
        Ok(q) => q,
        Err(e) => {
            // QEMU closes the socket when it gives up during start.
            let _ = wait_exit(&mut child, Duration::from_secs(5));
            let mut f = failed(&mut child, format!("QEMU did not come up: {e:#}"), &stderr);
            if let Ok(Some(status)) = child.try_wait() {
                f.what = format!("QEMU exited at start ({status})");
            }
            return Ok(Err(f));
        }
    };
    let realized_after = started.elapsed();
    let mut devices = Vec::new();
    let pci = qmp.execute("query-pci", None)?;
    for (i, a) in addrs.iter().enumerate() {
        let Some(d) = find_device(&pci, &format!("hostdev{i}")) else {
            let f = failed(
                &mut child,
                format!("query-pci has no hostdev{i} ({a})"),
                &stderr,
            );
            return Ok(Err(f));
        };
        let ids = format!(
            "{:04x}:{:04x}",
            d["id"]["vendor"].as_u64().unwrap_or(0),
            d["id"]["device"].as_u64().unwrap_or(0)
        );
        devices.push(Realized {
            address: a.clone(),
            ids,
            bars: memory_bars(d),
            mapped: Vec::new(),
        });
    }
    // The firmware assigns the BARs; then the guest's view of them is read.
    let cont = Instant::now();
    if opts.firmware {
        qmp.execute("cont", None)?;
    }
    if opts.firmware {
        loop {
            let pci = qmp.execute("query-pci", None)?;
            for (i, d) in devices.iter_mut().enumerate() {
                if let Some(v) = find_device(&pci, &format!("hostdev{i}")) {
                    d.bars = memory_bars(v);
                }
            }
            let assigned = devices.iter().all(|d| d.bars.iter().all(|b| b.2.is_some()));
            if assigned || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let firmware = cont.elapsed();
    if opts.firmware {
        qmp.execute("stop", None)?;
    }
    let mtree = qmp.execute(
        "human-monitor-command",
        Some(json!({"command-line": "info mtree -f"})),
    )?;
    let mtree = mtree.as_str().unwrap_or_default();
    for d in &mut devices {
        d.mapped = mapped_bars(mtree, &d.address);
    }
    Ok(Ok(Up {
        vm: Vm {
            child,
            qmp,
            stderr,
            socket,
        },
        devices,
        realized_after,
        firmware,
    }))
}

impl Vm {
    /// QEMU's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// QEMU's output so far.
    pub fn output(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Ask QEMU to quit and wait until it is gone (killed after 10 s), so the
    /// device is let go when this returns.
    pub fn quit(mut self) -> anyhow::Result<String> {
        let _ = self.qmp.execute("quit", None);
        let status = match wait_exit(&mut self.child, Duration::from_secs(10))? {
            Some(s) => s.to_string(),
            None => {
                self.child.kill()?;
                format!("killed after 10 s ({})", self.child.wait()?)
            }
        };
        let _ = std::fs::remove_file(&self.socket);
        Ok(status)
    }
}

fn wait_exit(
    child: &mut Child,
    within: Duration,
) -> anyhow::Result<Option<std::process::ExitStatus>> {
    let end = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(Some(s));
        }
        if Instant::now() > end {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The device with `qdev_id` in a `query-pci` answer (every bus).
fn find_device<'a>(pci: &'a Value, qdev_id: &str) -> Option<&'a Value> {
    pci.as_array()?
        .iter()
        .flat_map(|bus| bus["devices"].as_array().into_iter().flatten())
        .find(|d| d["qdev_id"] == qdev_id)
}

/// A device's memory BARs from `query-pci`: (bar, size, address once assigned;
/// QEMU reports an unassigned BAR at all ones).
fn memory_bars(device: &Value) -> Vec<(u64, u64, Option<u64>)> {
    device["regions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["type"] == "memory")
        .filter_map(|r| {
            // QAPI's `int` is signed: an unassigned BAR (all ones) reads -1.
            let addr = r["address"]
                .as_u64()
                .filter(|&a| a != u64::MAX && a != u64::from(u32::MAX));
            Some((r["bar"].as_u64()?, r["size"].as_u64()?, addr))
        })
        .collect()
}

/// The BARs of the device at `address` that `info mtree -f` shows backed by
/// the device's mapped regions: lines ending `<address> BAR <n> mmaps[<i>]`.
fn mapped_bars(mtree: &str, address: &str) -> Vec<u64> {
    let needle = format!("{address} BAR ");
    let mut bars: Vec<u64> = mtree
        .lines()
        .filter(|l| l.contains("mmaps["))
        .filter_map(|l| {
            let rest = &l[l.find(&needle)? + needle.len()..];
            rest.split_whitespace().next()?.parse().ok()
        })
        .collect();
    bars.sort_unstable();
    bars.dedup();
    bars
}

/// A QMP session: one JSON object per line each way; events are skipped.
struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    fn handshake(stream: UnixStream, deadline: Instant) -> anyhow::Result<Self> {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(10));
        stream.set_read_timeout(Some(left))?;
        let writer = stream.try_clone()?;
        let mut q = Qmp {
            reader: BufReader::new(stream),
            writer,
        };
        let greeting = q.read()?;
        if greeting.get("QMP").is_none() {
            bail!("no QMP greeting: {greeting}");
        }
        q.execute("qmp_capabilities", None)?;
        Ok(q)
    }

    fn read(&mut self) -> anyhow::Result<Value> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            bail!("QEMU closed the QMP socket");
        }
        Ok(serde_json::from_str(&line)?)
    }

    fn execute(&mut self, command: &str, arguments: Option<Value>) -> anyhow::Result<Value> {
        let mut msg = json!({ "execute": command });
        if let Some(a) = arguments {
            msg["arguments"] = a;
        }
        writeln!(self.writer, "{msg}")?;
        loop {
            let v = self.read().with_context(|| format!("QMP {command}"))?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                bail!("QMP {command}: {}", e["desc"].as_str().unwrap_or("error"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_come_from_every_pci_resource_variable_in_order() {
        let e = Edits {
            env: vec![
                "PCI_RESOURCE_A=0000:02:00.0,0000:01:00.1".into(),
                "OTHER=0000:09:00.0".into(),
                "PCI_RESOURCE_B=0000:01:00.1, 0000:03:00.0".into(),
            ],
            ..Edits::default()
        };
        assert_eq!(
            addresses(&e),
            ["0000:02:00.0", "0000:01:00.1", "0000:03:00.0"]
        );
    }

    #[test]
    fn qemu_args_name_each_device_and_the_backend() {
        let a = qemu_args(
            &["0000:02:00.0".into()],
            true,
            "64M",
            Path::new("/tmp/q.sock"),
        );
        let line = a.join(" ");
        assert!(line.starts_with("-S -machine "), "{line}");
        assert!(
            line.contains("-qmp unix:/tmp/q.sock,server=on,wait=off"),
            "{line}"
        );
        assert!(
            line.contains(
                "-object iommufd,id=iommufd0 -device \
                    vfio-pci,host=0000:02:00.0,id=hostdev0,rombar=0,iommufd=iommufd0"
            ),
            "{line}"
        );
        let legacy = qemu_args(&["0000:02:00.0".into()], false, "64M", Path::new("/q")).join(" ");
        assert!(!legacy.contains("iommufd"), "{legacy}");
    }

    #[test]
    fn bars_and_mappings_are_read_from_qemus_answers() {
        let pci = json!([{"bus": 0, "devices": [
            {"qdev_id": "other", "regions": []},
            {"qdev_id": "hostdev0", "id": {"vendor": 32902, "device": 4307}, "regions": [
                {"bar": 0, "type": "memory", "address": 4273995776u64, "size": 131072},
                {"bar": 2, "type": "io", "address": 49152, "size": 32},
                {"bar": 3, "type": "memory", "address": -1, "size": 16384},
                {"bar": 4, "type": "memory", "address": u64::MAX, "size": 16384}]}]}]);
        let d = find_device(&pci, "hostdev0").unwrap();
        assert_eq!(
            memory_bars(d),
            [
                (0, 131072, Some(4273995776)),
                (3, 16384, None),
                (4, 16384, None)
            ]
        );
        assert!(find_device(&pci, "hostdev1").is_none());
        let mtree = "FlatView #1\n \
            00000000febc0000-00000000febdffff (prio 1, ramd): 0000:02:00.0 BAR 0 mmaps[0]\n \
            00000000febe0000-00000000febe2fff (prio 1, i/o): 0000:02:00.0 BAR 3\n \
            00000000febe3000-00000000febe3fff (prio 1, ramd): 0000:02:00.0 BAR 3 mmaps[1]\n \
            00000000fe000000-00000000fe000fff (prio 1, ramd): 0000:01:00.0 BAR 0 mmaps[0]\n";
        assert_eq!(mapped_bars(mtree, "0000:02:00.0"), [0, 3]);
        assert_eq!(mapped_bars(mtree, "0000:09:00.0"), Vec::<u64>::new());
    }
}
