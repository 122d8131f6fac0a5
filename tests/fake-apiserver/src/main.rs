//! `fake-apiserver`: the stand-in API server as a process, for the real-kernel demo.
//!
//! `serve` answers until killed; `request` is a one-shot HTTP client so a shell
//! script without curl can change objects (relabel a node, delete a DaemonSet);
//! `claim` creates a ResourceClaim and writes the allocation it is given (a
//! create, then a status update) and prints its uid; `wait` waits until the
//! driver set a condition on every allocated device of a claim. Neither chooses
//! a device or plays kube-scheduler: scenarios that need its allocations and its
//! waits run against the real one (tests/k8s).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use fake_apiserver::{objects, paths, FakeApiServer};

/// Command line.
#[derive(Debug, Parser)]
#[command(
    name = "fake-apiserver",
    version,
    about = "A stand-in Kubernetes API server for tests and the demo"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve until killed.
    Serve {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:6443")]
        listen: SocketAddr,
        /// Write a kubeconfig pointing at this server here.
        #[arg(long, value_name = "FILE")]
        kubeconfig: Option<std::path::PathBuf>,
        /// A Node to serve (NAME).
        #[arg(long)]
        node: Option<String>,
        /// A label of that Node (KEY=VALUE, repeatable).
        #[arg(long = "label", value_name = "KEY=VALUE")]
        labels: Vec<String>,
        /// A DaemonSet (NAMESPACE/NAME) selecting nodes by the --selector labels.
        #[arg(long, value_name = "NAMESPACE/NAME")]
        daemonset: Option<String>,
        /// The DaemonSet's node selector (KEY=VALUE, repeatable).
        #[arg(long = "selector", value_name = "KEY=VALUE")]
        selectors: Vec<String>,
        /// A Pod (NAMESPACE/NAME) on the Node, owned by the DaemonSet.
        #[arg(long, value_name = "NAMESPACE/NAME")]
        pod: Option<String>,
        /// Shape the DaemonSet like the shipped vfio-manager's: the --selector labels
        /// or KEY=true, as two ORed required node-affinity terms.
        #[arg(long, value_name = "KEY")]
        restore_label: Option<String>,
    },
    /// Send one request and print the response body; exit 1 unless it is a 2xx.
    Request {
        /// The server, http://HOST:PORT.
        #[arg(long, default_value = "http://127.0.0.1:6443")]
        server: String,
        /// GET, POST, PATCH, PUT or DELETE.
        method: String,
        /// The path, e.g. /api/v1/nodes/node-a.
        path: String,
        /// JSON body (a merge patch for PATCH).
        body: Option<String>,
    },
    /// Create a ResourceClaim and write the allocation given here; print its uid
    /// (what kubelet names it by).
    Claim(ClaimArgs),
    /// Wait until condition CONDITION is True on every allocated device of the
    /// claim (exit 0), FAILURE is True on one (exit 1, printing its reason and
    /// message) or the timeout passes (exit 3).
    Wait {
        /// The server, http://HOST:PORT.
        #[arg(long, default_value = "http://127.0.0.1:6443")]
        server: String,
        /// The claim, NAMESPACE/NAME.
        #[arg(value_name = "NAMESPACE/NAME")]
        claim: String,
        /// The condition to wait for.
        #[arg(long)]
        condition: String,
        /// The condition that ends the wait as a failure.
        #[arg(long)]
        failure_condition: Option<String>,
        /// Milliseconds between looks.
        #[arg(long, default_value_t = 100)]
        poll_ms: u64,
        /// Seconds until the wait gives up.
        #[arg(long, default_value_t = 60)]
        timeout: u64,
    },
}

/// `fake-apiserver claim`.
#[derive(Debug, clap::Args)]
struct ClaimArgs {
    /// The server, http://HOST:PORT.
    #[arg(long, default_value = "http://127.0.0.1:6443")]
    server: String,
    /// The claim, NAMESPACE/NAME.
    #[arg(value_name = "NAMESPACE/NAME")]
    claim: String,
    /// The DeviceClass its requests name.
    #[arg(long, default_value = "vfio-sandbox")]
    class: String,
    /// An allocated device, REQUEST:DRIVER:POOL:DEVICE (repeatable; none leaves
    /// the claim unallocated).
    #[arg(long = "result", value_name = "REQUEST:DRIVER:POOL:DEVICE")]
    results: Vec<String>,
    /// The node the allocation is pinned to (default: the first result's pool).
    #[arg(long)]
    node: Option<String>,
    /// The condition each result waits on (`bindingConditions`, KEP-5007).
    #[arg(long, requires = "binding_failure_condition")]
    binding_condition: Option<String>,
    /// The condition each result fails on (`bindingFailureConditions`).
    #[arg(long, requires = "binding_condition")]
    binding_failure_condition: Option<String>,
    /// An opaque configuration of the claim, DRIVER=PARAMETERS (JSON) for all
    /// its requests (repeatable); the allocation gets a copy, as
    /// kube-scheduler's allocator writes it.
    #[arg(long = "config", value_name = "DRIVER=JSON")]
    configs: Vec<String>,
    /// Allocate the existing claim again instead of creating it (reading it
    /// again after a 409).
    #[arg(long)]
    again: bool,
    /// With --again: write the claim unallocated first, so a watcher may see
    /// it unallocated in between.
    #[arg(long, requires = "again")]
    deallocate_first: bool,
}

fn pairs(list: &[String]) -> anyhow::Result<Vec<(&str, &str)>> {
    list.iter()
        .map(|p| {
            p.split_once('=')
                .ok_or_else(|| anyhow::anyhow!("{p:?} is not KEY=VALUE"))
        })
        .collect()
}

fn split_ref(r: &str) -> anyhow::Result<(&str, &str)> {
    r.split_once('/')
        .ok_or_else(|| anyhow::anyhow!("{r:?} is not NAMESPACE/NAME"))
}

fn serve(cmd: &Command) -> anyhow::Result<()> {
    let Command::Serve {
        listen,
        kubeconfig,
        node,
        labels,
        daemonset,
        selectors,
        pod,
        restore_label,
    } = cmd
    else {
        unreachable!("serve is only called for Serve");
    };
    let server = FakeApiServer::start_on(*listen)?;
    if let Some(node) = node {
        server.put(&paths::node(node), objects::node(node, &pairs(labels)?));
    }
    if let Some(ds) = daemonset {
        let (ns, name) = split_ref(ds)?;
        let object = match restore_label {
            Some(key) => objects::daemonset_with_restore_label(ns, name, &pairs(selectors)?, key),
            None => objects::daemonset(ns, name, &pairs(selectors)?),
        };
        server.put(&paths::daemonset(ns, name), object);
        if let (Some(pod), Some(node)) = (pod, node) {
            let (pns, pname) = split_ref(pod)?;
            server.put(
                &paths::pod(pns, pname),
                objects::pod(pns, pname, node, name),
            );
        }
    }
    if let Some(path) = kubeconfig {
        std::fs::write(path, fake_apiserver::kubeconfig(&server.url()))?;
    }
    eprintln!("fake-apiserver: serving {}", server.url());
    loop {
        std::thread::park();
    }
}

fn request(server: &str, method: &str, path: &str, body: Option<&str>) -> anyhow::Result<bool> {
    let (ok, payload) = exchange(server, method, path, body)?;
    println!("{payload}");
    Ok(ok)
}

/// `fake-apiserver claim`: with `--again`, allocate the existing claim anew
/// (first unallocated with `--deallocate-first`), reading it again after a
/// conflict (another writer, the driver's status write, came between).
fn claim(args: &ClaimArgs) -> anyhow::Result<bool> {
    let ClaimArgs {
        server,
        claim,
        class,
        results,
        node,
        binding_condition,
        binding_failure_condition,
        configs,
        again,
        deallocate_first,
    } = args;
    let waits = binding_condition
        .as_deref()
        .zip(binding_failure_condition.as_deref())
        .map(|(ready, failed)| objects::Waits { ready, failed });
    let again = again.then_some(*deallocate_first);
    let (ns, name) = split_ref(claim)?;
    let configs = configs
        .iter()
        .map(|c| {
            let (driver, json) = c
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("{c:?} is not DRIVER=JSON"))?;
            let parameters: serde_json::Value = serde_json::from_str(json)
                .map_err(|e| anyhow::anyhow!("{c:?}: the parameters are not JSON: {e}"))?;
            Ok(serde_json::json!({"opaque": {"driver": driver, "parameters": parameters}}))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let results = results
        .iter()
        .map(|r| {
            objects::DeviceResult::parse(r)
                .ok_or_else(|| anyhow::anyhow!("{r:?} is not REQUEST:DRIVER:POOL:DEVICE"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let target = Target {
        server,
        ns,
        name,
        node: node.as_deref(),
        configs: &configs,
        waits,
    };
    let mut tries = 0;
    loop {
        tries += 1;
        match allocate(&target, class, &results, again)? {
            Allocated::Done(uid) => {
                println!("{uid}");
                return Ok(true);
            }
            Allocated::Conflict(_) if again.is_some() && tries < 10 => {}
            Allocated::Conflict(body) | Allocated::Failed(body) => {
                eprintln!("{body}");
                return Ok(false);
            }
        }
    }
}

/// The claim one `claim` command writes.
struct Target<'a> {
    server: &'a str,
    ns: &'a str,
    name: &'a str,
    node: Option<&'a str>,
    /// The claim's `spec.devices.config`.
    configs: &'a [serde_json::Value],
    /// The binding conditions of each result.
    waits: Option<objects::Waits<'a>>,
}

/// How one try of `claim` ended.
enum Allocated {
    /// The claim's uid.
    Done(String),
    /// A write met a 409: the body.
    Conflict(String),
    /// Another failure: the body.
    Failed(String),
}

fn allocate(
    t: &Target<'_>,
    class: &str,
    results: &[objects::DeviceResult],
    again: Option<bool>,
) -> anyhow::Result<Allocated> {
    let answer = |ok: bool, body: String| {
        if ok {
            None
        } else if body.contains("\"code\":409") {
            Some(Allocated::Conflict(body))
        } else {
            Some(Allocated::Failed(body))
        }
    };
    let status_path = format!("{}/status", paths::resourceclaim(t.ns, t.name));
    let (ok, created) = match again {
        None => {
            let mut body = objects::resource_claim_spec(t.ns, t.name, class, results);
            if !t.configs.is_empty() {
                body["spec"]["devices"]["config"] = t.configs.into();
            }
            let body = body.to_string();
            exchange(t.server, "POST", &paths::resourceclaims(t.ns), Some(&body))?
        }
        Some(deallocate_first) => {
            let (ok, found) = exchange(t.server, "GET", &paths::resourceclaim(t.ns, t.name), None)?;
            if !ok || !deallocate_first {
                (ok, found)
            } else {
                let mut object: serde_json::Value = serde_json::from_str(&found)?;
                objects::deallocate(&mut object);
                exchange(t.server, "PUT", &status_path, Some(&object.to_string()))?
            }
        }
    };
    if let Some(failed) = answer(ok, created.clone()) {
        return Ok(failed);
    }
    let mut object: serde_json::Value = serde_json::from_str(&created)?;
    let uid = object["metadata"]["uid"].as_str().unwrap_or("").to_owned();
    if !results.is_empty() {
        let node = t.node.unwrap_or(&results[0].pool);
        let mut allocation = objects::allocation(results, node, t.waits);
        if let Some(config) = objects::allocated_config(&object) {
            allocation["devices"]["config"] = config;
        }
        object["status"] = serde_json::json!({ "allocation": allocation });
        let (ok, updated) = exchange(t.server, "PUT", &status_path, Some(&object.to_string()))?;
        if let Some(failed) = answer(ok, updated) {
            return Ok(failed);
        }
    }
    Ok(Allocated::Done(uid))
}

/// `fake-apiserver wait`: exit 0 once `condition` is True on every allocated
/// device of `claim`, 1 once `failure` is True on one, 3 at the timeout.
fn wait(
    server: &str,
    claim: &str,
    condition: &str,
    failure: Option<&str>,
    poll: Duration,
    timeout: Duration,
) -> anyhow::Result<ExitCode> {
    let (ns, name) = split_ref(claim)?;
    let path = paths::resourceclaim(ns, name);
    let started = std::time::Instant::now();
    loop {
        let (ok, body) = exchange(server, "GET", &path, None)?;
        if !ok {
            anyhow::bail!("cannot read {claim}: {body}");
        }
        let object: serde_json::Value = serde_json::from_str(&body)?;
        if objects::condition_true_on_all(&object, condition) {
            println!("{claim}: {condition} after {:.1?}", started.elapsed());
            return Ok(ExitCode::SUCCESS);
        }
        if let Some(why) = failure.and_then(|f| objects::condition_true_on_any(&object, f)) {
            println!("{claim}: {}: {why}", failure.unwrap_or_default());
            return Ok(ExitCode::from(1));
        }
        if started.elapsed() >= timeout {
            println!("{claim}: no {condition} within {timeout:?}");
            return Ok(ExitCode::from(3));
        }
        std::thread::sleep(poll);
    }
}

/// One HTTP/1.1 exchange: whether the answer is a 2xx, and its body.
fn exchange(
    server: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> anyhow::Result<(bool, String)> {
    let host = server
        .strip_prefix("http://")
        .ok_or_else(|| anyhow::anyhow!("--server must be http://HOST:PORT, not {server:?}"))?
        .trim_end_matches('/');
    let mut stream = TcpStream::connect(host)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let body = body.unwrap_or("");
    let content_type = if method.eq_ignore_ascii_case("PATCH") {
        "application/merge-patch+json"
    } else {
        "application/json"
    };
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: \
            {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, payload) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let ok = head
        .split_whitespace()
        .nth(1)
        .is_some_and(|code| code.starts_with('2'));
    Ok((ok, payload.to_owned()))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        c @ Command::Serve { .. } => serve(c).map(|()| true),
        Command::Request {
            server,
            method,
            path,
            body,
        } => request(server, method, path, body.as_deref()),
        Command::Claim(args) => claim(args),
        Command::Wait {
            server,
            claim,
            condition,
            failure_condition,
            poll_ms,
            timeout,
        } => match wait(
            server,
            claim,
            condition,
            failure_condition.as_deref(),
            Duration::from_millis(*poll_ms),
            Duration::from_secs(*timeout),
        ) {
            Ok(code) => return code,
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("fake-apiserver: {e:#}");
            ExitCode::from(2)
        }
    }
}
