//! Measures sandbox-device-plugin against the kubelet-like peer on a fake node with N
//! selected devices, and prints numbers (no pass/fail): start to first ListAndWatch
//! message, Allocate latency, GetPreferredAllocation over all devices (and how long
//! an Allocate sent at the same moment on another connection takes), idle RSS and
//! CPU, and unbind-to-Unhealthy latency.
//!
//! `plugin-bench --plugin target/release/sandbox-device-plugin --devices 64`

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use deviceplugin::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty,
    PreferredAllocationRequest,
};
use kubelet_peer::Kubelet;
use tokio_stream::StreamExt;
use vfio_sandbox::fake::{FakeDevice, FakeNode};
use vfio_sandbox::PciAddress;

#[derive(Debug, Parser)]
struct Args {
    /// The plugin binary to measure.
    #[arg(long)]
    plugin: PathBuf,
    /// Selected devices on the fake node.
    #[arg(long, default_value_t = 64)]
    devices: usize,
    /// Allocate calls to time.
    #[arg(long, default_value_t = 1000)]
    allocs: usize,
    /// Seconds of idling for RSS and CPU.
    #[arg(long, default_value_t = 60)]
    idle_seconds: u64,
    /// Health changes to time.
    #[arg(long, default_value_t = 20)]
    health_changes: usize,
}

/// Device `i`: 4 functions in each of 8 slots per bus, buses from 0x10 (up to 7,680 devices).
fn addr(i: usize) -> PciAddress {
    let bus = u8::try_from(0x10 + i / 32).unwrap_or_else(|_| panic!("too many devices: {i}"));
    PciAddress::new(0, bus, ((i / 4) % 8) as u8, (i % 4) as u8)
        .unwrap_or_else(|| panic!("address {i}"))
}

fn node(root: &Path, n: usize) -> FakeNode {
    let node = FakeNode::new(root);
    node.add_driver("vfio-pci");
    node.add_driver("e1000e");
    for b in 0..8u8 {
        let bridge = format!("0000:00:{:02x}.0", b + 1);
        node.add_device(&FakeDevice::new(&bridge, 0x8086, 0x2922, 0x06_0400).driver("pcieport"));
    }
    for i in 0..n {
        let a = addr(i);
        let bridge = format!("0000:00:{:02x}.0", (i % 8) + 1);
        node.add_device(
            &FakeDevice::new(&a.to_string(), 0x1eff, 0x1220, 0x12_0000)
                .driver("vfio-pci")
                .group(100 + i as u32)
                .numa((i % 2) as i32)
                .parent(&bridge),
        );
    }
    node
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    f.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The plugin process, killed and reaped however the benchmark ends.
struct Plugin(Child);

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(plugin: &Path, root: &Path) -> Plugin {
    Plugin(
        kubelet_peer::plugin_command(plugin, root)
            .args(["--log-level", "warn"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the plugin"),
    )
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir()?;
    let node = node(dir.path(), args.devices);
    let kubelet = Kubelet::start(&dir.path().join("kubelet")).await?;

    let t0 = Instant::now();
    let child = spawn(&args.plugin, dir.path());
    let reg = kubelet.next_registration(Duration::from_secs(30)).await?;
    let mut client = kubelet.plugin(&reg).await?;
    let mut stream = client.list_and_watch(Empty {}).await?.into_inner();
    let first = stream
        .next()
        .await
        .ok_or_else(|| anyhow::anyhow!("no message"))??;
    let to_first = t0.elapsed();
    anyhow::ensure!(
        first.devices.len() == args.devices,
        "listed {} of {}",
        first.devices.len(),
        args.devices
    );

    let mut lat = Vec::with_capacity(args.allocs);
    for i in 0..args.allocs {
        let id = addr(i % args.devices).to_string();
        let t = Instant::now();
        client
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: vec![id],
                }],
            })
            .await?;
        lat.push(t.elapsed());
    }
    lat.sort();

    // GetPreferredAllocation over every device, alone and with an Allocate racing it.
    let all: Vec<String> = first.devices.iter().map(|d| d.id.clone()).collect();
    let ask = PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: all.clone(),
            must_include_device_i_ds: all.iter().rev().take(1).cloned().collect(),
            allocation_size: i32::try_from(all.len())?,
        }],
    };
    let one = AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: vec![all[0].clone()],
        }],
    };
    let mut other = kubelet.plugin(&reg).await?;
    let (mut pref, mut raced) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        let t = Instant::now();
        client.get_preferred_allocation(ask.clone()).await?;
        pref.push(t.elapsed());
        let t = Instant::now();
        let (p, a) = tokio::join!(client.get_preferred_allocation(ask.clone()), async {
            let r = other.allocate(one.clone()).await;
            (r, t.elapsed())
        });
        p?;
        a.0?;
        raced.push(a.1);
    }
    pref.sort();
    raced.sort();

    let pid = child.0.id();
    tokio::time::sleep(Duration::from_secs(2)).await; // let start-up work settle
    let (c0, w0) = (cpu_ticks(pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
    let ticks = cpu_ticks(pid) - c0;
    let idle_cpu = ticks as f64 / 100.0 / w0.elapsed().as_secs_f64() * 100.0;
    let rss = rss_kib(pid);

    let mut health = Vec::new();
    let target = addr(args.devices - 1);
    for i in 0..args.health_changes {
        let (driver, want) = if i % 2 == 0 {
            ("e1000e", "Unhealthy")
        } else {
            ("vfio-pci", "Healthy")
        };
        let t = Instant::now();
        node.attach(&target, driver);
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(10), stream.next())
                .await?
                .ok_or_else(|| anyhow::anyhow!("stream ended"))??;
            if msg
                .devices
                .iter()
                .any(|d| d.id == target.to_string() && d.health == want)
            {
                break;
            }
        }
        health.push(t.elapsed());
    }
    health.sort();
    drop(child);

    println!(
        "devices={:<5} start_to_first_ms={:<7.1} alloc_median_us={:<6} alloc_p99_us={:<6} pref_all_median_us={:<6} alloc_racing_pref_max_us={:<6} rss_mib={:<5.1} idle_cpu_pct={:<6.3} health_median_ms={:<6.1} health_max_ms={:.1}",
        args.devices,
        to_first.as_secs_f64() * 1e3,
        pct(&lat, 0.5).as_micros(),
        pct(&lat, 0.99).as_micros(),
        pct(&pref, 0.5).as_micros(),
        raced.last().map(|d| d.as_micros()).unwrap_or(0),
        rss as f64 / 1024.0,
        idle_cpu,
        pct(&health, 0.5).as_secs_f64() * 1e3,
        health.last().map(|d| d.as_secs_f64() * 1e3).unwrap_or(0.0),
    );
    Ok(())
}
