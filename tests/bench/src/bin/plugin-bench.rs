//! Measures sandbox-device-plugin against the kubelet-like peer on a fake node with N
//! NVIDIA GPUs bound to vfio-pci (the `nvidia` preset), and prints numbers (no
//! pass/fail): start to first ListAndWatch message, Allocate latency,
//! GetPreferredAllocation over all devices (and how long an Allocate sent at the
//! same moment on another connection takes), RSS after the Allocate calls, idle CPU,
//! and health latency two ways: a device unbound with its group node removed
//! (inotify on /dev/vfio), and a driver unbind that keeps the group node, announced
//! by a uevent (sent into a private network namespace, so the host sees none; needs
//! root, else reported as -1).
//!
//! `plugin-bench --plugin target/release/sandbox-device-plugin --devices 64`

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use kubelet_api::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty,
    PreferredAllocationRequest,
};
use kubelet_peer::Kubelet;
use sysfs_pci::testing::{gpu_address as addr, gpu_node as node};
use sysfs_pci::PciAddress;
use tokio_stream::StreamExt;

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
            .args(["--log-level", "warn", "--config"])
            .arg(root.join("config.json"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the plugin"),
    )
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Our own network namespace: uevents sent here reach the plugin and nothing else.
    let uevents = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
        .ok()
        .and_then(|()| uevent_sender().ok());
    let dir = tempfile::tempdir()?;
    let node = node(dir.path(), args.devices);
    std::fs::write(dir.path().join("config.json"), r#"{"preset": "nvidia"}"#)?;
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
    let pid = child.0.id();
    let rss_after_allocs = rss_kib(pid);

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

    tokio::time::sleep(Duration::from_secs(2)).await; // let start-up work settle
    let (c0, w0) = (cpu_ticks(pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
    let ticks = cpu_ticks(pid) - c0;
    let idle_cpu = ticks as f64 / 100.0 / w0.elapsed().as_secs_f64() * 100.0;
    let rss = rss_kib(pid);

    let target = addr(args.devices - 1);
    let health = time_changes(&mut stream, &target, args.health_changes, |unhealthy| {
        node.attach(&target, if unhealthy { "e1000e" } else { "vfio-pci" })
    })
    .await?;
    // A driver unbind that leaves the group node: only the uevent tells.
    let health_uevent = match &uevents {
        Some(sender) => {
            let dir = node.canonical_dir(&target);
            let path = dir
                .strip_prefix(&node.host.sysfs)
                .unwrap_or(&dir)
                .to_owned();
            time_changes(&mut stream, &target, args.health_changes, |unhealthy| {
                let (action, driver) = if unhealthy {
                    ("unbind", "e1000e")
                } else {
                    ("bind", "vfio-pci")
                };
                let link = dir.join("driver");
                let _ = std::fs::remove_file(&link);
                let _ = std::os::unix::fs::symlink(node.host.driver_dir(driver), &link);
                send_uevent(sender, action, &path, &target);
            })
            .await?
        }
        None => Vec::new(),
    };
    drop(child);

    let ms = |d: Option<&Duration>| d.map_or(-1.0, |d| d.as_secs_f64() * 1e3);
    println!(
        "devices={:<5} start_to_first_ms={:<7.1} alloc_median_us={:<6} \
            alloc_p99_us={:<6} pref_all_median_us={:<6} alloc_racing_pref_max_us={:<6} \
            rss_after_allocs_mib={:<5.2} rss_idle_mib={:<5.2} idle_cpu_pct={:<6.3} \
            health_node_median_ms={:<6.2} health_node_max_ms={:<6.2} \
            health_uevent_median_ms={:<6.2} health_uevent_max_ms={:.2}",
        args.devices,
        to_first.as_secs_f64() * 1e3,
        pct(&lat, 0.5).as_micros(),
        pct(&lat, 0.99).as_micros(),
        pct(&pref, 0.5).as_micros(),
        raced.last().map(|d| d.as_micros()).unwrap_or(0),
        rss_after_allocs as f64 / 1024.0,
        rss as f64 / 1024.0,
        idle_cpu,
        ms(health.get(health.len() / 2)),
        ms(health.last()),
        ms(health_uevent.get(health_uevent.len() / 2)),
        ms(health_uevent.last()),
    );
    Ok(())
}

/// Makes `change(unhealthy)` alternately (Unhealthy first) and times each until the
/// stream reports the target that way; sorted.
async fn time_changes(
    stream: &mut tonic::Streaming<kubelet_api::v1beta1::ListAndWatchResponse>,
    target: &PciAddress,
    changes: usize,
    change: impl Fn(bool),
) -> anyhow::Result<Vec<Duration>> {
    let id = target.to_string();
    let mut times = Vec::with_capacity(changes);
    for i in 0..changes {
        let unhealthy = i % 2 == 0;
        let want = if unhealthy { "Unhealthy" } else { "Healthy" };
        let t = Instant::now();
        change(unhealthy);
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(10), stream.next())
                .await
                .map_err(|_| anyhow::anyhow!("{id} not reported {want} within 10 s"))?
                .ok_or_else(|| anyhow::anyhow!("stream ended"))??;
            if msg.devices.iter().any(|d| d.id == id && d.health == want) {
                break;
            }
        }
        times.push(t.elapsed());
    }
    times.sort();
    Ok(times)
}

/// A netlink socket to send uevents on, as the kernel does.
fn uevent_sender() -> nix::Result<std::os::fd::OwnedFd> {
    use nix::sys::socket::{socket, AddressFamily, SockFlag, SockProtocol, SockType};
    socket(
        AddressFamily::Netlink,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkKObjectUEvent,
    )
}

/// Sends `action` for the device at `devpath` (relative to sysfs) to the uevent group.
fn send_uevent(fd: &std::os::fd::OwnedFd, action: &str, devpath: &Path, target: &PciAddress) {
    use nix::sys::socket::{sendto, MsgFlags, NetlinkAddr};
    use std::os::fd::AsRawFd;
    let devpath = format!("/{}", devpath.display());
    let msg = format!(
        "{action}@{devpath}\0ACTION={action}\0DEVPATH={devpath}\0SUBSYSTEM=pci\0PCI_SLOT_NAME={target}\0"
    );
    let _ = sendto(
        fd.as_raw_fd(),
        msg.as_bytes(),
        &NetlinkAddr::new(0, 1),
        MsgFlags::empty(),
    );
}
