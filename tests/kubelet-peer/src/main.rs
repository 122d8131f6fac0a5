//! `kubelet-peer`: the kubelet-like peer as a command, for scripts (the real-kernel
//! scenarios run it inside the test VM).
//!
//! ```text
//! kubelet-peer serve    --dir D                       # print one line per accepted Register
//! kubelet-peer list     --dir D --endpoint E          # the first ListAndWatch message
//! kubelet-peer allocate --dir D --endpoint E ID...    # env and device specs
//! kubelet-peer watch    --dir D --endpoint E --after CMD --expect ID=Health --within 1s
//!
//! kubelet-peer vmm (--allocate FILE | --cdi ID... | --cdi-from FILE | --in-pod) [--iommufd] [--hold]
//!                                                     # QEMU takes the container's devices
//!
//! kubelet-peer dra register  --registry D [--timeout 10s]          # PluginInfo as JSON
//! kubelet-peer dra prepare   --registry D [--version v1|v1beta1] --claim NS/NAME/UID...
//! kubelet-peer dra unprepare --registry D [--version v1|v1beta1] --claim NS/NAME/UID...
//! ```
//!
//! `register`, `prepare` and `unprepare` take `--kubelet 1.32|1.34` (default 1.34):
//! the release whose version check, service choice and DRA `:authority` to use.
//!
//! The `dra` commands print one line of JSON (maps sorted by claim uid):
//! `{"claims":{UID:{"devices":[...],"error":""}}}` for prepare, `{"claims":{UID:
//! {"error":""}}}` for unprepare, and exit 0 when kubelet would take the answer
//! (every claim answered, none failed, nothing extra), 1 otherwise (the reasons on
//! stderr), 2 on any other error.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use kubelet_api::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, Empty, ListAndWatchResponse,
};
use kubelet_peer::container::{self, Edits};
use kubelet_peer::dra::ClaimRef;
use kubelet_peer::dra::{self, Dra, KubeletVersion, Version};
use kubelet_peer::vmm;
use kubelet_peer::{connect, Kubelet};
use std::os::unix::process::CommandExt;
use tokio_stream::StreamExt;

#[derive(Debug, Parser)]
#[command(
    name = "kubelet-peer",
    about = "Plays kubelet's side of the device-plugin API over Unix sockets"
)]
struct Cli {
    /// The device-plugins directory.
    #[arg(long, default_value = kubelet_api::DEFAULT_KUBELET_DIR)]
    dir: PathBuf,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Serve Registration on kubelet.sock; print `registered RESOURCE ENDPOINT VERSION` per call.
    Serve,
    /// Print the first ListAndWatch message, one `ID HEALTH numa=N|none` line per device.
    List {
        #[arg(long)]
        endpoint: String,
    },
    /// Allocate the IDs for one container; print `env K=V` and `device HOST CONTAINER PERMS` lines.
    Allocate {
        #[arg(long)]
        endpoint: String,
        ids: Vec<String>,
    },
    /// Open ListAndWatch, run CMD after the first message, and wait until a message
    /// shows ID with HEALTH; print the milliseconds from CMD's end to that message.
    Watch {
        #[arg(long)]
        endpoint: String,
        /// Shell command to run once the stream is open.
        #[arg(long)]
        after: String,
        /// ID=Healthy or ID=Unhealthy.
        #[arg(long)]
        expect: String,
        /// Give up after this many milliseconds.
        #[arg(long, default_value_t = 1000)]
        within_ms: u64,
    },
    /// Play kubelet's side of DRA: registration and the DRAPlugin service.
    #[command(subcommand)]
    Dra(DraCmd),
    /// Start QEMU, as KubeVirt's virt-launcher does, in a container given an
    /// Allocate answer or CDI devices: paused, with a vfio-pci device per address
    /// of its PCI_RESOURCE_* variables; check through QMP that every device is
    /// realized with the host's ids and its BARs mapped. Prints one `realized`
    /// line per device; exits 1, with QEMU's own message, when QEMU refuses.
    Vmm(VmmArgs),
    /// Run CMD in a container: a mount namespace whose /dev holds only runc's
    /// default devices and the given nodes, with the given mounts and
    /// environment (JSON of `kubelet_peer::container::Edits`). Used by `vmm`.
    #[command(hide = true)]
    Container {
        #[arg(long)]
        edits: String,
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
}

#[derive(Debug, clap::Args)]
struct VmmArgs {
    /// The output of `kubelet-peer allocate` (env, device and mount lines).
    #[arg(long, conflicts_with_all = ["cdi", "cdi_from"])]
    allocate: Option<PathBuf>,
    /// A CDI device id as kubelet hands it to the runtime (repeat).
    #[arg(long)]
    cdi: Vec<String>,
    /// The JSON `kubelet-peer dra prepare` printed: every CDI id in it.
    #[arg(long)]
    cdi_from: Option<PathBuf>,
    /// Where CDI specs are (repeat; default: /etc/cdi and /var/run/cdi).
    #[arg(long)]
    cdi_dir: Vec<PathBuf>,
    /// Leave this device node out of the container (repeat), to show what QEMU
    /// does without it.
    #[arg(long)]
    without_node: Vec<String>,
    /// Use the iommufd backend (`-object iommufd`, the device cdev) instead of
    /// the group's VFIO container.
    #[arg(long)]
    iommufd: bool,
    /// The VM's container is the one this process runs in (a pod's, as
    /// virt-launcher runs in its pod): the devices are the PCI_RESOURCE_*
    /// variables of this process's environment, and QEMU starts here, with
    /// no container of its own.
    #[arg(long, conflicts_with_all = ["allocate", "cdi", "cdi_from", "without_node"])]
    in_pod: bool,
    /// Keep the VM until SIGTERM or SIGINT, then quit QEMU and wait for it.
    #[arg(long)]
    hold: bool,
    /// The QEMU program (default: qemu-system-<this architecture>).
    #[arg(long)]
    qemu: Option<String>,
    /// Guest RAM, all of it mapped for DMA when QEMU starts.
    #[arg(long, default_value = "64M")]
    memory: String,
    /// Give up on QEMU after this long.
    #[arg(long, default_value = "120s", value_parser = duration)]
    timeout: Duration,
}

#[derive(Debug, clap::Args)]
struct Registry {
    /// kubelet's plugin registry directory, scanned for `*-reg.sock`.
    #[arg(long, default_value = kubelet_api::DEFAULT_REGISTRY_DIR)]
    registry: PathBuf,
    /// How long to wait for a registration socket to appear and be registered
    /// (a failed registration is tried again as kubelet's plugin manager does).
    #[arg(long, default_value = "10s", value_parser = duration)]
    timeout: Duration,
    /// The kubelet release to play: its version check and service choice, and the
    /// `:authority` its DRA client sends (1.32: the percent-encoded socket path;
    /// 1.34: `localhost`). Registration always sends the percent-encoded path.
    #[arg(long, default_value = "1.34")]
    kubelet: KubeletVersion,
}

#[derive(Debug, clap::Args)]
struct Calls {
    #[command(flatten)]
    registry: Registry,
    /// The API version to call (default: the one kubelet picks from PluginInfo).
    #[arg(long)]
    version: Option<Version>,
    /// A claim, as NAMESPACE/NAME/UID (repeat for several; order is kept).
    #[arg(long = "claim", value_parser = dra::parse_claim, required = true)]
    claims: Vec<ClaimRef>,
}

#[derive(Debug, Subcommand)]
enum DraCmd {
    /// Find the registration socket, GetInfo, check it as kubelet does, notify;
    /// print the PluginInfo (and the version kubelet picks) as JSON.
    Register(Registry),
    /// Register, then NodePrepareResources for the claims; print the answer as JSON.
    Prepare(Calls),
    /// Register, then NodeUnprepareResources for the claims; print the answer as JSON.
    Unprepare(Calls),
    /// Register, then read the device health stream as kubelet does (the service
    /// the newest kubelet picks from PluginInfo, on the DRA endpoint, merged into
    /// kubelet's cache): one line of JSON per response (the cache and what
    /// changed), until every --until holds (exit 0) or --within passes (exit 1).
    Health(HealthArgs),
}

#[derive(Debug, clap::Args)]
struct HealthArgs {
    #[command(flatten)]
    registry: Registry,
    /// POOL/DEVICE=HEALTH (Healthy, Unhealthy, Unknown) to wait for (repeat for
    /// several); none: stop after the first response.
    #[arg(long = "until", value_name = "POOL/DEVICE=HEALTH")]
    until: Vec<String>,
    /// How long to wait for them.
    #[arg(long, default_value = "10s", value_parser = duration)]
    within: Duration,
}

/// Registers and connects in the requested (or kubelet's) version.
async fn dra_client(calls: &Calls) -> anyhow::Result<Dra> {
    let r = register(&calls.registry).await?;
    let version = calls.version.unwrap_or(r.chosen);
    if !r.supported_versions.iter().any(|v| v == version.service()) {
        anyhow::bail!(
            "{} does not list {} in {:?}",
            r.name,
            version.service(),
            r.supported_versions
        );
    }
    Dra::connect_as(&r.endpoint_path(), version, calls.registry.kubelet).await
}

/// Finds the registration socket and registers as the chosen kubelet does.
async fn register(r: &Registry) -> anyhow::Result<dra::Registered> {
    dra::register_in_as(&r.registry, r.kubelet, r.timeout).await
}

/// `dra health`: the stream as kubelet reads it, until the wanted states.
async fn health(a: HealthArgs) -> anyhow::Result<bool> {
    use kubelet_peer::dra::health::{pick_service, HealthCache, HealthStream};
    let mut until = Vec::new();
    for u in &a.until {
        let (key, want) = u
            .rsplit_once('=')
            .ok_or_else(|| anyhow::anyhow!("--until {u:?} is not POOL/DEVICE=HEALTH"))?;
        until.push((key.to_owned(), want.to_owned()));
    }
    let r = register(&a.registry).await?;
    let Some(version) = pick_service(&r.supported_versions) else {
        anyhow::bail!(
            "{} lists no DRAResourceHealth service in {:?}: kubelet opens no health stream",
            r.name,
            r.supported_versions
        );
    };
    let deadline = tokio::time::Instant::now() + a.within;
    let mut stream = HealthStream::open(&r.endpoint_path(), version, a.registry.kubelet).await?;
    let mut cache = HealthCache::default();
    loop {
        let next = tokio::time::timeout_at(deadline, stream.next()).await;
        let devices = match next {
            Err(_) => {
                eprintln!(
                    "kubelet-peer: {:?} not reached within {:?}",
                    a.until, a.within
                );
                return Ok(false);
            }
            Ok(None) => anyhow::bail!("the health stream ended"),
            Ok(Some(Err(status))) => anyhow::bail!("the health stream failed: {status}"),
            Ok(Some(Ok(devices))) => devices,
        };
        let changed = cache.update(&devices, std::time::Instant::now());
        println!(
            "{}",
            serde_json::json!({"version": version, "changed": changed, "devices": cache.devices})
        );
        if until
            .iter()
            .all(|(k, w)| cache.health(k) == Some(w.as_str()))
        {
            return Ok(true);
        }
    }
}

/// Prints the answer and its problems; true when there are none.
fn report<T: serde::Serialize + dra::ClaimError>(
    answer: &dra::Answer<T>,
    asked: &[ClaimRef],
) -> bool {
    println!("{}", answer.to_json());
    let problems = answer.problems(asked);
    problems.iter().for_each(|p| eprintln!("kubelet-peer: {p}"));
    problems.is_empty()
}

async fn run_dra(cmd: DraCmd) -> anyhow::Result<bool> {
    match cmd {
        DraCmd::Register(r) => {
            let registered = register(&r).await?;
            println!("{}", serde_json::to_string(&registered)?);
            Ok(true)
        }
        DraCmd::Prepare(calls) => {
            let answer = dra_client(&calls).await?.prepare(&calls.claims).await?;
            Ok(report(&answer, &calls.claims))
        }
        DraCmd::Health(a) => health(a).await,
        DraCmd::Unprepare(calls) => {
            let answer = dra_client(&calls).await?.unprepare(&calls.claims).await?;
            Ok(report(&answer, &calls.claims))
        }
    }
}

fn lines(msg: &ListAndWatchResponse) -> Vec<String> {
    msg.devices
        .iter()
        .map(|d| {
            let numa = d
                .topology
                .as_ref()
                .map(|t| {
                    t.nodes
                        .iter()
                        .map(|n| n.id.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_else(|| "none".into());
            format!("{} {} numa={numa}", d.id, d.health)
        })
        .collect()
}

async fn run(cli: Cli) -> anyhow::Result<bool> {
    match cli.command {
        Cmd::Dra(cmd) => run_dra(cmd).await,
        Cmd::Vmm(_) | Cmd::Container { .. } => unreachable!("run without the runtime"),
        Cmd::Serve => {
            let kubelet = Kubelet::start(&cli.dir).await?;
            loop {
                let r = kubelet.next_registration(Duration::from_secs(3600)).await?;
                println!(
                    "registered {} {} {}",
                    r.request.resource_name, r.request.endpoint, r.request.version
                );
            }
        }
        Cmd::List { endpoint } => {
            let mut client = connect(&cli.dir.join(endpoint)).await?;
            let mut stream = client.list_and_watch(Empty {}).await?.into_inner();
            let msg = stream
                .next()
                .await
                .ok_or_else(|| anyhow::anyhow!("stream ended"))??;
            lines(&msg).iter().for_each(|l| println!("{l}"));
            Ok(true)
        }
        Cmd::Allocate { endpoint, ids } => {
            let mut client = connect(&cli.dir.join(endpoint)).await?;
            let r = client
                .allocate(AllocateRequest {
                    container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
                })
                .await?
                .into_inner();
            for c in r.container_responses {
                let mut envs: Vec<_> = c.envs.into_iter().collect();
                envs.sort();
                envs.iter().for_each(|(k, v)| println!("env {k}={v}"));
                c.devices.iter().for_each(|d| {
                    println!(
                        "device {} {} {}",
                        d.host_path, d.container_path, d.permissions
                    )
                });
                c.mounts.iter().for_each(|m| {
                    let mode = if m.read_only { "ro" } else { "rw" };
                    println!("mount {} {} {mode}", m.host_path, m.container_path)
                });
            }
            Ok(true)
        }
        Cmd::Watch {
            endpoint,
            after,
            expect,
            within_ms,
        } => {
            let mut client = connect(&cli.dir.join(endpoint)).await?;
            let mut stream = client.list_and_watch(Empty {}).await?.into_inner();
            let first = stream
                .next()
                .await
                .ok_or_else(|| anyhow::anyhow!("stream ended"))??;
            println!("first: {}", lines(&first).join("; "));
            let (id, health) = expect
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("--expect wants ID=HEALTH"))?;
            let status = std::process::Command::new("sh")
                .arg("-c")
                .arg(&after)
                .status()?;
            anyhow::ensure!(status.success(), "--after command failed: {status}");
            let start = Instant::now();
            let deadline = Duration::from_millis(within_ms);
            loop {
                let left = deadline.saturating_sub(start.elapsed());
                let Ok(next) = tokio::time::timeout(left, stream.next()).await else {
                    println!("no message with {id} {health} within {within_ms} ms");
                    return Ok(false);
                };
                let msg = next.ok_or_else(|| anyhow::anyhow!("stream ended"))??;
                println!(
                    "message after {} ms: {}",
                    start.elapsed().as_millis(),
                    lines(&msg).join("; ")
                );
                if msg.devices.iter().any(|d| d.id == id && d.health == health) {
                    println!("{id} {health} after {} ms", start.elapsed().as_millis());
                    return Ok(true);
                }
            }
        }
    }
}

/// The CDI ids of a `dra prepare` answer, in order.
fn cdi_ids(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("cdi_device_ids", serde_json::Value::Array(ids)) => {
                        out.extend(ids.iter().filter_map(|i| i.as_str().map(String::from)))
                    }
                    _ => cdi_ids(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| cdi_ids(v, out)),
        _ => {}
    }
}

fn vmm(a: VmmArgs) -> anyhow::Result<bool> {
    let mut edits = if a.in_pod {
        Edits::of_this_container()?
    } else if let Some(file) = &a.allocate {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        Edits::from_allocate(&text)?
    } else {
        let mut ids = a.cdi.clone();
        if let Some(file) = &a.cdi_from {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", file.display()))?;
            cdi_ids(&v, &mut ids);
        }
        anyhow::ensure!(
            !ids.is_empty(),
            "no CDI device: give --allocate, --cdi or --cdi-from"
        );
        let dirs = if a.cdi_dir.is_empty() {
            vec![PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")]
        } else {
            a.cdi_dir.clone()
        };
        println!("CDI devices: {}", ids.join(" "));
        Edits::from_cdi(&dirs, &ids)?
    };
    for n in &a.without_node {
        let before = edits.nodes.len();
        edits.nodes.retain(|x| &x.path != n);
        anyhow::ensure!(
            edits.nodes.len() < before,
            "--without-node {n}: the container has no such node"
        );
    }
    let mut nodes: Vec<&str> = edits.nodes.iter().map(|n| n.path.as_str()).collect();
    nodes.sort_unstable();
    println!(
        "container: nodes {}; env {}",
        nodes.join(" "),
        edits.env.join(" ")
    );
    let opts = vmm::Options {
        qemu: a.qemu.clone().unwrap_or_else(vmm::default_qemu),
        iommufd: a.iommufd,
        memory: a.memory.clone(),
        timeout: a.timeout,
        firmware: vmm::has_firmware(),
        contained: !a.in_pod,
    };
    let backend = if a.iommufd { "iommufd" } else { "legacy" };
    let vmm::Up {
        vm,
        devices,
        realized_after: took,
        firmware,
    } = match vmm::start(&edits, &opts)? {
        Ok(up) => up,
        Err(f) => {
            println!("QEMU refused ({backend}): {}", f.what);
            f.stderr.lines().for_each(|l| println!("qemu: {l}"));
            return Ok(false);
        }
    };
    let mut ok = true;
    for d in &devices {
        let sysfs = |attr: &str| {
            std::fs::read_to_string(format!("/sys/bus/pci/devices/{}/{attr}", d.address))
                .map(|s| s.trim().trim_start_matches("0x").to_string())
                .unwrap_or_default()
        };
        let host_ids = format!("{}:{}", sysfs("vendor"), sysfs("device"));
        let bars: Vec<String> = d
            .bars
            .iter()
            .map(|(bar, size, addr)| match addr {
                Some(a) if d.mapped.contains(bar) => format!("BAR{bar}@{a:#x}/{size}:mmap"),
                Some(a) => format!("BAR{bar}@{a:#x}/{size}:trapped"),
                None => format!("BAR{bar}@unassigned/{size}"),
            })
            .collect();
        println!(
            "realized {} {} ({backend}) {}",
            d.address,
            d.ids,
            bars.join(" ")
        );
        if d.ids != host_ids {
            println!(
                "MISMATCH {}: QEMU reads {}, the host's sysfs says {host_ids}",
                d.address, d.ids
            );
            ok = false;
        }
        if !opts.firmware {
            continue;
        }
        if d.bars.iter().any(|b| b.2.is_none()) {
            println!(
                "UNASSIGNED {}: the firmware left a memory BAR without an address",
                d.address
            );
            ok = false;
        }
        if d.mapped.is_empty() {
            println!(
                "UNMAPPED {}: no BAR is backed by the device's mapped regions",
                d.address
            );
            ok = false;
        }
    }
    let firmware = if opts.firmware {
        format!(
            "the firmware assigned their BARs in {} ms",
            firmware.as_millis()
        )
    } else {
        "no firmware runs on this machine here, so the BARs stay unassigned".to_string()
    };
    println!(
        "QEMU (pid {}) realized {} device(s) in {} ms; {firmware}",
        vm.pid(),
        devices.len(),
        took.as_millis(),
    );
    if a.hold && ok {
        use nix::sys::signal::{SigSet, Signal};
        let mut set = SigSet::empty();
        set.add(Signal::SIGTERM);
        set.add(Signal::SIGINT);
        set.thread_block()?;
        println!("holding");
        std::io::Write::flush(&mut std::io::stdout())?;
        let sig = set.wait()?;
        println!("{sig}: quitting QEMU");
    }
    let out = vm.output();
    let status = vm.quit()?;
    out.lines().for_each(|l| println!("qemu: {l}"));
    println!("QEMU exited: {status}");
    Ok(ok)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Container { edits, cmd } => {
            let err = (|| -> anyhow::Result<std::convert::Infallible> {
                let edits: Edits = serde_json::from_str(&edits).context("--edits")?;
                container::enter(&edits)?;
                let e = std::process::Command::new(&cmd[0])
                    .args(&cmd[1..])
                    .env_clear()
                    .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
                    .envs(edits.env_pairs())
                    .exec();
                Err(e).with_context(|| format!("executing {}", cmd[0]))
            })();
            let Err(e) = err;
            eprintln!("kubelet-peer container: error: {e:#}");
            return ExitCode::from(127);
        }
        Cmd::Vmm(a) => {
            return match vmm(a) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(1),
                Err(e) => {
                    eprintln!("kubelet-peer: error: {e:#}");
                    ExitCode::from(2)
                }
            };
        }
        _ => {}
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kubelet-peer: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("kubelet-peer: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// `500ms`, `10s`, `2m` or plain seconds.
fn duration(s: &str) -> Result<Duration, String> {
    let (number, scale) = match s.trim() {
        t if t.ends_with("ms") => (&t[..t.len() - 2], 0.001),
        t if t.ends_with('s') => (&t[..t.len() - 1], 1.0),
        t if t.ends_with('m') => (&t[..t.len() - 1], 60.0),
        t => (t, 1.0),
    };
    number
        .parse::<f64>()
        .ok()
        .and_then(|n| Duration::try_from_secs_f64(n * scale).ok())
        .ok_or_else(|| format!("{s:?} is not a duration (500ms, 10s, 2m)"))
}
