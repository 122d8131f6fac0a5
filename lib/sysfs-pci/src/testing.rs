//! A fake node for tests: a sysfs/dev/modules tree in a directory, and a
//! [`FakeKernel`] that applies writes the way the kernel's PCI core does.
//!
//! This is for unit tests of edge cases; the decisive tests run on a real kernel.
//!
//! ```
//! use sysfs_pci::testing::{FakeDevice, FakeNode};
//! let dir = std::env::temp_dir().join(format!("fake-doc-{}", std::process::id()));
//! let node = FakeNode::new(&dir);
//! node.add_device(&FakeDevice::new("0000:01:00.0", 0x1eff, 0x1220, 0x120000).driver("rebellions").group(3));
//! let dev = sysfs_pci::PciDevice::read(&node.host, &"0000:01:00.0".parse().unwrap()).unwrap();
//! assert_eq!(dev.driver.as_deref(), Some("rebellions"));
//! # std::fs::remove_dir_all(&dir).unwrap();
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::num::NonZeroUsize;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::kernel::{Kernel, SyscallError, Write};
use crate::vfio_driver::is_vfio_driver;
use crate::{Host, PciAddress};
use support::io::{Action, IoError};
use support::lock;

mod faults;

pub use faults::{Crashed, Fault, FaultKernel, Point};

/// Where to build fake trees: `/dev/shm` when it is a directory (tmpfs), else the
/// system temporary directory. A fake node is thousands of small files and links;
/// on ext4 creating them dominates a test's time.
pub fn scratch_root() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_owned()
    } else {
        std::env::temp_dir()
    }
}

/// A device to create in the fake tree.
#[derive(Debug, Clone)]
pub struct FakeDevice {
    pub address: PciAddress,
    pub vendor: u16,
    pub device: u16,
    pub class: u32,
    pub driver: Option<String>,
    pub group: Option<u32>,
    pub numa_node: i32,
    pub parent: Option<PciAddress>,
    pub sriov: Option<(u32, u32)>,
    pub physfn: Option<PciAddress>,
}

impl FakeDevice {
    pub fn new(address: &str, vendor: u16, device: u16, class: u32) -> Self {
        Self {
            address: address.parse().expect("test address"),
            vendor,
            device,
            class,
            driver: None,
            group: None,
            numa_node: -1,
            parent: None,
            sriov: None,
            physfn: None,
        }
    }
    pub fn driver(mut self, d: &str) -> Self {
        self.driver = Some(d.into());
        self
    }
    pub fn group(mut self, g: u32) -> Self {
        self.group = Some(g);
        self
    }
    pub fn numa(mut self, n: i32) -> Self {
        self.numa_node = n;
        self
    }
    pub fn parent(mut self, p: &str) -> Self {
        self.parent = Some(p.parse().expect("test address"));
        self
    }
    pub fn sriov(mut self, total: u32, num: u32) -> Self {
        self.sriov = Some((total, num));
        self
    }
    pub fn physfn(mut self, pf: &str) -> Self {
        self.physfn = Some(pf.parse().expect("test address"));
        self
    }
}

/// The file under a fake node's root that says its kernel makes device cdevs.
const CDEV_MARK: &str = ".vfio-cdev";

/// A fake node rooted in a directory.
#[derive(Debug, Clone)]
pub struct FakeNode {
    pub root: PathBuf,
    pub host: Host,
}

impl FakeNode {
    /// Creates the skeleton under `root` (`sys/`, `dev/`, `lib/modules/`).
    pub fn new(root: &Path) -> Self {
        let host = Host::new(root.join("sys"), root.join("dev"), root.join("lib/modules"));
        for d in [
            host.pci_devices_dir(),
            host.drivers_dir(),
            host.iommu_groups_dir(),
            host.sysfs.join("module"),
            host.sysfs.join("devices"),
            host.vfio_dir(),
            host.modules.clone(),
        ] {
            fs::create_dir_all(d).unwrap();
        }
        fs::write(host.drivers_probe(), "").unwrap();
        let node = Self {
            root: root.to_owned(),
            host,
        };
        // Interrupt remapping on, as on a node that can run VMs.
        node.set_interrupt_chips(&["IR-IO-APIC", "IR-PCI-MSIX-0000:00:01.0"]);
        node
    }

    /// Lists `chips` as the node's interrupt chips (`/sys/kernel/irq/<n>/chip_name`),
    /// replacing those listed before.
    pub fn set_interrupt_chips(&self, chips: &[&str]) {
        let dir = self.host.sysfs.join("kernel/irq");
        let _ = fs::remove_dir_all(&dir);
        for (n, chip) in chips.iter().enumerate() {
            let d = dir.join(n.to_string());
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("chip_name"), format!("{chip}\n")).unwrap();
        }
    }

    /// Sets a module's `allow_unsafe_interrupts` parameter (`Y` or `N`).
    pub fn set_allow_unsafe_interrupts(&self, module: &str, on: bool) {
        let d = self.host.module_dir(module).join("parameters");
        fs::create_dir_all(&d).unwrap();
        fs::write(
            d.join("allow_unsafe_interrupts"),
            if on { "Y\n" } else { "N\n" },
        )
        .unwrap();
    }

    /// Registers a PCI driver (and its module) in the fake tree.
    pub fn add_driver(&self, name: &str) {
        let dir = self.host.driver_dir(name);
        fs::create_dir_all(&dir).unwrap();
        for f in ["bind", "unbind", "new_id"] {
            fs::write(dir.join(f), "").unwrap();
        }
        fs::create_dir_all(self.host.module_dir(name)).unwrap();
    }

    /// Marks a module as loaded without registering a driver.
    pub fn add_module(&self, name: &str) {
        fs::create_dir_all(self.host.module_dir(name)).unwrap();
    }

    /// The canonical directory of a device.
    pub fn canonical_dir(&self, addr: &PciAddress) -> PathBuf {
        let link = self.host.device_dir(addr);
        fs::canonicalize(link).unwrap()
    }

    /// Creates a device with its attributes, links, group and driver.
    pub fn add_device(&self, d: &FakeDevice) {
        let parent_dir = match d.parent {
            Some(p) => self.canonical_dir(&p),
            None => self.host.sysfs.join(format!(
                "devices/pci{:04x}:{:02x}",
                d.address.domain(),
                d.address.bus()
            )),
        };
        let dir = parent_dir.join(d.address.to_string());
        fs::create_dir_all(&dir).unwrap();
        let w = |name: &str, v: String| fs::write(dir.join(name), v + "\n").unwrap();
        w("vendor", format!("0x{:04x}", d.vendor));
        w("device", format!("0x{:04x}", d.device));
        w("class", format!("0x{:06x}", d.class));
        w("subsystem_vendor", format!("0x{:04x}", d.vendor));
        w("subsystem_device", "0x0000".into());
        // As drivers/pci/pci-sysfs.c (modalias_show) prints it.
        w(
            "modalias",
            format!(
                "pci:v{:08X}d{:08X}sv{:08X}sd{:08X}bc{:02X}sc{:02X}i{:02X}",
                d.vendor,
                d.device,
                d.vendor,
                0,
                (d.class >> 16) & 0xff,
                (d.class >> 8) & 0xff,
                d.class & 0xff
            ),
        );
        w("numa_node", d.numa_node.to_string());
        w("driver_override", "(null)".into());
        if let Some((total, num)) = d.sriov {
            w("sriov_totalvfs", total.to_string());
            w("sriov_numvfs", num.to_string());
        }
        symlink(&dir, self.host.device_dir(&d.address)).unwrap();
        if let Some(pf) = d.physfn {
            symlink(self.canonical_dir(&pf), dir.join("physfn")).unwrap();
        }
        if let Some(g) = d.group {
            let gdir = self.host.iommu_group_devices_dir(g);
            fs::create_dir_all(&gdir).unwrap();
            symlink(&dir, gdir.join(d.address.to_string())).unwrap();
            symlink(gdir.parent().unwrap(), dir.join("iommu_group")).unwrap();
        }
        if let Some(drv) = &d.driver {
            self.add_driver(drv);
            symlink(self.host.driver_dir(drv), dir.join("driver")).unwrap();
            // A new vfio-bound member creates its group's node; nothing else changes
            // (a full sync per device would make big nodes quadratic to build).
            if let (true, Some(g)) = (is_vfio_driver(drv), d.group) {
                fs::write(self.host.vfio_group_node(g), "").unwrap();
            }
        }
    }

    /// Removes a device (hot-unplug).
    pub fn remove_device(&self, addr: &PciAddress) {
        let dir = self.canonical_dir(addr);
        fs::remove_file(self.host.device_dir(addr)).unwrap();
        let group = fs::read_link(dir.join("iommu_group")).ok();
        if let Some(g) = &group {
            let _ = fs::remove_file(g.join("devices").join(addr.to_string()));
        }
        fs::remove_dir_all(dir).unwrap();
        if let Some(g) = group.as_deref().and_then(Path::file_name) {
            self.sync_group_node(&g.to_string_lossy());
        }
    }

    /// Binds `addr` to `driver` directly, as if the kernel probed it.
    pub fn attach(&self, addr: &PciAddress, driver: &str) {
        let dir = self.canonical_dir(addr);
        let _ = fs::remove_file(dir.join("driver"));
        symlink(self.host.driver_dir(driver), dir.join("driver")).unwrap();
        self.sync_group_node_of(&dir);
        self.sync_vfio_cdev(addr, is_vfio_driver(driver));
    }

    /// Unbinds `addr` directly.
    pub fn detach(&self, addr: &PciAddress) {
        let dir = self.canonical_dir(addr);
        let _ = fs::remove_file(dir.join("driver"));
        self.sync_group_node_of(&dir);
        self.sync_vfio_cdev(addr, false);
    }

    /// Makes the fake kernel one with `CONFIG_VFIO_DEVICE_CDEV`: `/dev/iommu`
    /// exists, and from now on a function bound to a vfio driver gets
    /// `vfio-dev/vfioN` with a `dev` attribute, its `vfio-dev` class link and
    /// `/dev/vfio/devices/vfioN` (N = its bus, device and function as one number),
    /// which go when it unbinds.
    pub fn enable_vfio_cdev(&self) {
        fs::write(self.host.dev.join("iommu"), "").unwrap();
        fs::create_dir_all(self.host.vfio_dev_class_dir()).unwrap();
        fs::write(self.root.join(CDEV_MARK), "").unwrap();
    }

    /// The device cdev name the fake kernel gives `addr`.
    pub fn vfio_cdev_of(addr: &PciAddress) -> String {
        let n = (u32::from(addr.bus()) << 8) | u32::from(addr.slot() << 3 | addr.function());
        format!("vfio{n}")
    }

    fn sync_vfio_cdev(&self, addr: &PciAddress, bound: bool) {
        if !self.root.join(CDEV_MARK).exists() {
            return;
        }
        let name = Self::vfio_cdev_of(addr);
        let dir = self.canonical_dir(addr).join("vfio-dev").join(&name);
        let class = self.host.vfio_dev_class_dir().join(&name);
        let node = self.host.vfio_dir().join("devices").join(&name);
        if bound {
            fs::create_dir_all(&dir).unwrap();
            fs::write(dir.join("dev"), "511:0\n").unwrap();
            let _ = symlink(&dir, &class);
            fs::create_dir_all(node.parent().unwrap()).unwrap();
            fs::write(node, "").unwrap();
        } else {
            let _ = fs::remove_dir_all(self.canonical_dir(addr).join("vfio-dev"));
            let _ = fs::remove_file(class);
            let _ = fs::remove_file(node);
        }
    }

    /// Creates or removes the node of the group of the device in `dir`, as the
    /// kernel does when a member binds or unbinds: only that group is looked at.
    fn sync_group_node_of(&self, dir: &Path) {
        if let Ok(Some(group)) = crate::device::link_name(&dir.join("iommu_group")) {
            self.sync_group_node(&group);
        }
    }

    /// Creates or removes `/dev/vfio/<group>` as its members' drivers say.
    fn sync_group_node(&self, group: &str) {
        let members = self.host.iommu_groups_dir().join(group).join("devices");
        let vfio_bound = fs::read_dir(members).unwrap().any(|m| {
            let driver = m.unwrap().path().join("driver");
            crate::device::link_name(&driver)
                .unwrap()
                .is_some_and(|d| is_vfio_driver(&d))
        });
        let node = self.host.vfio_dir().join(group);
        match (vfio_bound, node.exists()) {
            (true, false) => fs::write(node, "").unwrap(),
            (false, true) => fs::remove_file(node).unwrap(),
            _ => {}
        }
    }

    /// Every device's driver and `driver_override` text, by address: what a test
    /// compares before and after an operation.
    pub fn drivers_and_overrides(&self) -> BTreeMap<String, (Option<String>, String)> {
        crate::device::list_addresses(&self.host)
            .unwrap()
            .into_iter()
            .map(|a| {
                let over = fs::read_to_string(self.host.device_dir(&a).join("driver_override"));
                (a.to_string(), (self.driver_of(&a), over.unwrap()))
            })
            .collect()
    }

    /// Current driver of `addr`.
    pub fn driver_of(&self, addr: &PciAddress) -> Option<String> {
        crate::device::link_name(&self.canonical_dir(addr).join("driver")).unwrap()
    }

    /// Creates `/dev/vfio/<g>` for every group with a vfio-bound member, removes the rest;
    /// `/dev/vfio/vfio` exists once any vfio driver is registered.
    pub fn sync_group_nodes(&self) {
        let mut wanted = BTreeSet::new();
        for addr in crate::device::list_addresses(&self.host).unwrap() {
            let dir = self.host.device_dir(&addr);
            let drv = crate::device::link_name(&dir.join("driver")).unwrap();
            let grp = crate::device::link_name(&dir.join("iommu_group")).unwrap();
            if let (Some(d), Some(g)) = (drv, grp) {
                if is_vfio_driver(&d) {
                    wanted.insert(g);
                }
            }
        }
        for entry in fs::read_dir(self.host.vfio_dir()).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            if name != "vfio" && !wanted.contains(&name) {
                fs::remove_file(self.host.vfio_dir().join(name)).unwrap();
            }
        }
        for g in wanted {
            fs::write(self.host.vfio_dir().join(g), "").unwrap();
        }
    }

    /// Writes `text` as the `modules.alias` of `release`.
    pub fn add_modules_alias(&self, release: &str, text: &str) {
        let dir = self.host.modules_release_dir(release);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("modules.alias"), text).unwrap();
    }

    /// Writes a `modules.dep` for `release` and creates the module files it names.
    pub fn add_modules_dep(&self, release: &str, text: &str) {
        let dir = self.host.modules_release_dir(release);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("modules.dep"), text).unwrap();
        for line in text.lines() {
            let Some((module, _)) = line.split_once(':') else {
                continue;
            };
            let file = dir.join(module.trim());
            fs::create_dir_all(file.parent().unwrap()).unwrap();
            fs::write(file, "").unwrap();
        }
    }
}

/// Holds the writes that reach it until it is opened: a driver's remove or probe
/// blocked in the kernel, and the moment it returns.
#[derive(Debug, Default)]
pub struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
    /// Writes that have reached the gate so far.
    pub reached: AtomicUsize,
}

impl Gate {
    /// A closed gate.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Lets every held write, and every later one, through.
    pub fn open(&self) {
        *lock(&self.open) = true;
        self.opened.notify_all();
    }

    fn pass(&self) {
        self.reached.fetch_add(1, Ordering::SeqCst);
        let mut open = lock(&self.open);
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
    }
}

/// Emulates the PCI core's handling of sysfs writes on a [`FakeNode`].
///
/// Safe to share between threads, as the kernel is: changes to the tree are made one
/// at a time, while the modelled driver latency ([`Self::with_latency`]) of different
/// devices overlaps, as probes of different devices do in the kernel.
#[derive(Debug)]
pub struct FakeKernel {
    pub node: FakeNode,
    /// Every write, in order.
    pub writes: Mutex<Vec<Write>>,
    /// Native driver each device re-probes to when it has no override.
    pub native: Mutex<HashMap<PciAddress, String>>,
    /// Writes whose path ends with this suffix fail with the errno (once).
    pub fail_on: Mutex<Option<(String, i32)>>,
    /// Writes whose path ends with this suffix block until the gate opens, as a
    /// driver's remove that never returns does (see [`Gate`]).
    pub hang_on: Mutex<Option<(String, Arc<Gate>)>>,
    /// Group nodes reported in use.
    pub busy_groups: Mutex<BTreeSet<PathBuf>>,
    /// Group nodes whose open fails with `EPERM`, as a device cgroup that does
    /// not allow them makes it fail in a container.
    pub unprobeable_groups: Mutex<BTreeSet<PathBuf>>,
    /// What a probe of the device does instead of attaching its override's (or its
    /// native) driver: `Some(driver)` another driver wins it, `None` no driver
    /// takes the device (the wanted driver's probe refused it).
    pub probe_outcome: Mutex<HashMap<PciAddress, Option<String>>>,
    /// Modules loaded through `load_module`, in order.
    pub loaded: Mutex<Vec<String>>,
    /// Driver registered when a module loads (module name → driver name).
    pub module_drivers: Mutex<HashMap<String, String>>,
    /// How long each unbind and each bind or probe of a device takes (a native
    /// driver's remove and probe; a GPU's can take a second). Zero by default.
    latency: Duration,
    /// Held while the tree changes, so concurrent writes apply one at a time.
    tree: Mutex<()>,
    /// Unbinds, binds and probes under way now, and the most seen at once.
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

/// What a benchmark on [`FakeKernel::slow_nics`] was asked for.
#[derive(Debug, Clone, Copy)]
pub struct BenchArgs {
    /// NICs on the node (1 to 255).
    pub devices: u8,
    /// What each unbind and probe takes.
    pub latency: Duration,
    /// Groups moved at once, besides one at a time.
    pub jobs: NonZeroUsize,
}

/// One unbind, bind or probe under way; counted until dropped.
struct InFlight<'k>(&'k FakeKernel);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl FakeKernel {
    pub fn new(node: &FakeNode) -> Self {
        Self {
            node: node.clone(),
            writes: Mutex::default(),
            native: Mutex::default(),
            fail_on: Mutex::default(),
            hang_on: Mutex::default(),
            busy_groups: Mutex::default(),
            unprobeable_groups: Mutex::default(),
            probe_outcome: Mutex::default(),
            loaded: Mutex::default(),
            module_drivers: Mutex::default(),
            latency: Duration::ZERO,
            tree: Mutex::default(),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        }
    }

    /// Makes each unbind and each bind or probe of a device take `latency` before it
    /// takes effect, as a slow native driver's remove or probe does. For tests and
    /// benchmarks of how long binding a node takes.
    pub fn with_latency(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }

    /// The flags of the benchmarks on [`FakeKernel::slow_nics`]: `--devices N`
    /// (default 8), `--latency-ms MS` (default 1000) and `--jobs N` (default
    /// `default_jobs`), from the process's arguments.
    pub fn bench_args(default_jobs: NonZeroUsize) -> Result<BenchArgs, String> {
        let mut args = BenchArgs {
            devices: 8,
            latency: Duration::from_secs(1),
            jobs: default_jobs,
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
            let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
            match flag.as_str() {
                "--devices" => args.devices = value.parse().map_err(|e| bad(&e))?,
                "--latency-ms" => {
                    args.latency = Duration::from_millis(value.parse().map_err(|e| bad(&e))?)
                }
                "--jobs" => args.jobs = value.parse().map_err(|e| bad(&e))?,
                _ => return Err(format!("unknown flag {flag}")),
            }
        }
        if args.devices == 0 {
            return Err("--devices must be 1 to 255".into());
        }
        Ok(args)
    }

    /// A benchmark's main: reads [`FakeKernel::bench_args`], then times `pass` once
    /// moving one group at a time and once with `--jobs`, each in a fresh scratch
    /// directory, and prints one line: `devices=N latency_ms=MS`, then per pass
    /// `jobs=J <field>_ms=..` for each of `fields` and the duration `pass` returns
    /// for it, in order. On an error it names `name`, prints `usage` and fails.
    pub fn bench_main(
        name: &str,
        usage: &str,
        default_jobs: NonZeroUsize,
        fields: &[&str],
        pass: impl Fn(&Path, &BenchArgs, NonZeroUsize) -> Result<Vec<Duration>, String>,
    ) -> std::process::ExitCode {
        let run = |args: BenchArgs| -> Result<String, String> {
            let mut line = format!(
                "devices={} latency_ms={}",
                args.devices,
                args.latency.as_millis()
            );
            for jobs in [NonZeroUsize::MIN, args.jobs] {
                let dir = tempfile::tempdir_in(scratch_root())
                    .map_err(|e| format!("cannot create a scratch directory: {e}"))?;
                let took = pass(dir.path(), &args, jobs)?;
                if took.len() != fields.len() {
                    return Err(format!(
                        "{} durations for {} fields",
                        took.len(),
                        fields.len()
                    ));
                }
                line.push_str(&format!(" jobs={jobs}"));
                for (field, d) in fields.iter().zip(took) {
                    line.push_str(&format!(" {field}_ms={}", d.as_millis()));
                }
            }
            Ok(line)
        };
        match Self::bench_args(default_jobs)
            .map_err(|e| format!("{e}\n{usage}"))
            .and_then(run)
        {
            Ok(line) => {
                println!("{line}");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{name}: {e}");
                std::process::ExitCode::FAILURE
            }
        }
    }

    /// The benchmarks' node: `devices` NICs (8086:10d3 at `0000:NN:00.0`) on e1000e,
    /// each alone in IOMMU group NN, vfio-pci a module to load for kernel `release`,
    /// and every unbind and probe taking `latency` (a GPU driver's remove or probe can
    /// take a second).
    pub fn slow_nics(root: &Path, devices: u8, latency: Duration, release: &str) -> Self {
        let node = FakeNode::new(root);
        for i in 1..=devices {
            node.add_device(
                &FakeDevice::new(&format!("0000:{i:02x}:00.0"), 0x8086, 0x10d3, 0x02_0000)
                    .driver("e1000e")
                    .group(u32::from(i)),
            );
        }
        node.add_modules_dep(
            release,
            "kernel/drivers/vfio/pci/vfio-pci.ko: kernel/drivers/vfio/vfio_iommu_type1.ko kernel/drivers/vfio/vfio.ko\n\
             kernel/drivers/vfio/vfio_iommu_type1.ko: kernel/drivers/vfio/vfio.ko\n\
             kernel/drivers/vfio/vfio.ko:\n",
        );
        let kernel = Self::new(&node).with_latency(latency);
        kernel.learn_native_drivers();
        lock(&kernel.module_drivers).insert("vfio_pci".into(), "vfio-pci".into());
        kernel
    }

    /// The most unbinds, binds and probes that were under way at one moment.
    pub fn max_concurrent_probes(&self) -> usize {
        self.max_in_flight.load(Ordering::SeqCst)
    }

    /// Starts counting [`Self::max_concurrent_probes`] afresh.
    pub fn reset_concurrency(&self) {
        self.max_in_flight.store(0, Ordering::SeqCst);
    }

    /// Counts a slow operation as under way and waits out the modelled latency.
    fn slow_operation(&self) -> InFlight<'_> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        if !self.latency.is_zero() {
            std::thread::sleep(self.latency);
        }
        InFlight(self)
    }

    /// Remembers each current driver as the device's native one.
    pub fn learn_native_drivers(&self) {
        for addr in crate::device::list_addresses(&self.node.host).unwrap() {
            if let Some(d) = self.node.driver_of(&addr) {
                lock(&self.native).insert(addr, d);
            }
        }
    }

    /// The writes made so far, as `path <- data` lines relative to the fake root.
    pub fn write_log(&self) -> Vec<String> {
        lock(&self.writes)
            .iter()
            .map(|w| {
                let p = w.path.strip_prefix(&self.node.root).unwrap_or(&w.path);
                format!("{} <- {}", p.display(), w.data.trim_end())
            })
            .collect()
    }

    fn err(path: &Path, data: &str, errno: i32) -> IoError {
        IoError::new(
            Action::Write(data.into()),
            path,
            std::io::Error::from_raw_os_error(errno),
        )
    }

    fn override_of(&self, addr: &PciAddress) -> Option<String> {
        let p = self.node.host.device_dir(addr).join("driver_override");
        crate::device::parse_driver_override(&fs::read_to_string(p).unwrap())
    }

    fn probe(&self, addr: &PciAddress) {
        if self.node.driver_of(addr).is_some() {
            return;
        }
        if let Some(outcome) = lock(&self.probe_outcome).get(addr) {
            if let Some(d) = outcome {
                self.node.attach(addr, d);
            }
            return;
        }
        let want = self
            .override_of(addr)
            .or_else(|| lock(&self.native).get(addr).cloned());
        if let Some(d) = want {
            if self.node.host.driver_dir(&d).exists() {
                self.node.attach(addr, &d);
            }
        }
    }
}

impl Kernel for FakeKernel {
    fn write(&self, path: &Path, data: &str) -> Result<(), IoError> {
        lock(&self.writes).push(Write {
            path: path.to_owned(),
            data: data.to_owned(),
        });
        {
            let mut failing = lock(&self.fail_on);
            if let Some((suffix, errno)) = failing.clone() {
                if path.to_string_lossy().ends_with(&suffix) {
                    *failing = None;
                    return Err(Self::err(path, data, errno));
                }
            }
        }
        let gate = lock(&self.hang_on)
            .as_ref()
            .filter(|(suffix, _)| path.to_string_lossy().ends_with(suffix.as_str()))
            .map(|(_, gate)| gate.clone());
        if let Some(gate) = gate {
            gate.pass();
        }
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        // The driver's remove or probe runs before the tree changes, outside the
        // tree lock: slow operations on different devices overlap.
        let _slow =
            matches!(name, "unbind" | "bind" | "drivers_probe").then(|| self.slow_operation());
        let _tree = lock(&self.tree);
        let parent = path.parent().unwrap();
        let bdf = || {
            data.trim()
                .parse::<PciAddress>()
                .map_err(|_| Self::err(path, data, 22))
        };
        match name {
            "driver_override" => {
                let v = data.trim();
                fs::write(
                    path,
                    if v.is_empty() {
                        "(null)\n".into()
                    } else {
                        format!("{v}\n")
                    },
                )
                .unwrap();
            }
            "unbind" => {
                let addr = bdf()?;
                // Either <device>/driver/unbind or drivers/<name>/unbind.
                let drv = if parent.file_name().is_some_and(|n| n == "driver") {
                    crate::device::link_name(parent).unwrap()
                } else {
                    parent.file_name().map(|n| n.to_string_lossy().into_owned())
                };
                match (drv, self.node.driver_of(&addr)) {
                    (Some(d), Some(cur)) if d == cur => self.node.detach(&addr),
                    _ => return Err(Self::err(path, data, 19)),
                }
            }
            "drivers_probe" => self.probe(&bdf()?),
            "bind" => {
                let addr = bdf()?;
                let drv = parent.file_name().unwrap().to_string_lossy().into_owned();
                if self.node.driver_of(&addr).is_some() {
                    return Err(Self::err(path, data, 16));
                }
                match self.override_of(&addr) {
                    Some(o) if o != drv => return Err(Self::err(path, data, 19)),
                    _ => self.node.attach(&addr, &drv),
                }
            }
            _ => fs::write(path, data)
                .map_err(|e| IoError::new(Action::Write(data.into()), path, e))?,
        }
        Ok(())
    }

    fn load_module(&self, name: &str, file: &Path) -> Result<(), SyscallError> {
        if !file.exists() {
            return Err(SyscallError::Open(IoError::new(
                Action::Open,
                file,
                std::io::Error::from_raw_os_error(2),
            )));
        }
        let _tree = lock(&self.tree);
        self.node.add_module(name);
        if let Some(drv) = lock(&self.module_drivers).get(name) {
            self.node.add_driver(drv);
        }
        lock(&self.loaded).push(name.to_owned());
        // Loading a driver probes every unbound device it matches.
        for addr in crate::device::list_addresses(&self.node.host).unwrap() {
            if self.override_of(&addr).is_none() {
                self.probe(&addr);
            }
        }
        Ok(())
    }

    fn unload_module(&self, name: &str) -> Result<(), SyscallError> {
        let _tree = lock(&self.tree);
        let drivers: Vec<String> = lock(&self.module_drivers)
            .iter()
            .filter(|(m, _)| m.as_str() == name)
            .map(|(_, d)| d.clone())
            .collect();
        for addr in crate::device::list_addresses(&self.node.host).unwrap() {
            if self
                .node
                .driver_of(&addr)
                .is_some_and(|d| drivers.contains(&d))
            {
                self.node.detach(&addr);
            }
        }
        for d in drivers {
            let _ = fs::remove_dir_all(self.node.host.driver_dir(&d));
        }
        let _ = fs::remove_dir_all(self.node.host.module_dir(name));
        Ok(())
    }

    fn group_in_use(&self, node: &Path) -> Result<bool, IoError> {
        if lock(&self.unprobeable_groups).contains(node) {
            return Err(IoError::new(
                Action::Open,
                node,
                std::io::Error::from_raw_os_error(nix::libc::EPERM),
            ));
        }
        Ok(lock(&self.busy_groups).contains(node))
    }
}

// The nodes the tests and benchmarks of several crates share.

/// The resource list of [`nic_node`]: the NICs and the nvme.
pub const NIC_NODE_LIST: &str = r#"{"resources":[
  {"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]},
  {"name":"example.com/NVME_PT","vendor":"1b36","devices":["0010"]}]}"#;

/// A fake node under `root` with a two-function NIC (group 5, NUMA 0, behind bridge
/// 0000:00:01.0), a lone NIC (group 6, NUMA 1) and an nvme (group 7, no NUMA), all on
/// vfio-pci; `root/list.json` holds [`NIC_NODE_LIST`] and `root/kubelet` exists.
pub fn nic_node(root: &Path) -> std::io::Result<FakeNode> {
    let node = FakeNode::new(root);
    node.add_driver("vfio-pci");
    node.add_driver("e1000e");
    node.add_device(
        &FakeDevice::new("0000:00:01.0", 0x8086, 0x2922, 0x06_0400)
            .driver("pcieport")
            .group(1),
    );
    for f in ["0000:01:00.0", "0000:01:00.1"] {
        node.add_device(
            &FakeDevice::new(f, 0x8086, 0x10d3, 0x02_0000)
                .driver("vfio-pci")
                .group(5)
                .numa(0)
                .parent("0000:00:01.0"),
        );
    }
    node.add_device(
        &FakeDevice::new("0000:02:00.0", 0x8086, 0x10d3, 0x02_0000)
            .driver("vfio-pci")
            .group(6)
            .numa(1),
    );
    node.add_device(
        &FakeDevice::new("0000:03:00.0", 0x1b36, 0x0010, 0x01_0802)
            .driver("vfio-pci")
            .group(7),
    );
    std::fs::write(root.join("list.json"), NIC_NODE_LIST)?;
    std::fs::create_dir_all(root.join("kubelet"))?;
    Ok(node)
}

/// GPU `i`: 4 functions in each of 8 slots per bus, buses from 0x10 (up to 7,680 devices).
pub fn gpu_address(i: usize) -> PciAddress {
    let bus = u8::try_from(0x10 + i / 32).unwrap_or_else(|_| panic!("too many devices: {i}"));
    PciAddress::new(0, bus, ((i / 4) % 8) as u8, (i % 4) as u8)
        .unwrap_or_else(|| panic!("address {i}"))
}

/// NVIDIA's vendor id.
const NVIDIA: u16 = 0x10de;
/// H100 PCIe, as the PCI ID database names it.
const H100_PCIE: u16 = 0x2331;
/// A 3D controller's class.
const CLASS_3D: u32 = 0x03_0200;

/// IOMMU group of GPU `i`.
pub fn gpu_group(i: usize) -> u32 {
    100 + i as u32
}

/// `n` GPUs on vfio-pci, each alone in group [`gpu_group`], behind 8 bridges, NUMA 0/1.
pub fn gpu_node(root: &Path, n: usize) -> FakeNode {
    let node = FakeNode::new(root);
    node.add_driver("vfio-pci");
    node.add_driver("e1000e");
    for b in 0..8u8 {
        let bridge = format!("0000:00:{:02x}.0", b + 1);
        node.add_device(&FakeDevice::new(&bridge, 0x8086, 0x2922, 0x06_0400).driver("pcieport"));
    }
    for i in 0..n {
        let a = gpu_address(i);
        let bridge = format!("0000:00:{:02x}.0", (i % 8) + 1);
        node.add_device(
            &FakeDevice::new(&a.to_string(), NVIDIA, H100_PCIE, CLASS_3D)
                .driver("vfio-pci")
                .group(gpu_group(i))
                .numa((i % 2) as i32)
                .parent(&bridge),
        );
    }
    node
}
