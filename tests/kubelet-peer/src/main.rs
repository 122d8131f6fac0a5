//! `kubelet-peer`: the kubelet-like peer as a command, for scripts (the real-kernel
//! scenarios run it inside the test VM).
//!
//! ```text
//! kubelet-peer serve    --dir D                       # print one line per accepted Register
//! kubelet-peer list     --dir D --endpoint E          # the first ListAndWatch message
//! kubelet-peer allocate --dir D --endpoint E ID...    # env and device specs
//! kubelet-peer watch    --dir D --endpoint E --after CMD --expect ID=Health --within 1s
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

use clap::{Parser, Subcommand};
use kubelet_api::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, Empty, ListAndWatchResponse,
};
use kubelet_peer::dra::ClaimRef;
use kubelet_peer::dra::{self, Dra, KubeletVersion, Version};
use kubelet_peer::{connect, Kubelet};
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
}

#[derive(Debug, clap::Args)]
struct Registry {
    /// kubelet's plugin registry directory, scanned for `*-reg.sock`.
    #[arg(long, default_value = kubelet_api::DEFAULT_REGISTRY_DIR)]
    registry: PathBuf,
    /// How long to wait for a registration socket to appear.
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
    let socket = dra::find_registration_socket(&r.registry, r.timeout).await?;
    dra::register_socket_as(&socket, r.kubelet).await
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

fn main() -> ExitCode {
    let cli = Cli::parse();
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
