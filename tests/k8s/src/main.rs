//! `real-k8s`: our drivers against the real Kubernetes of one release.
//!
//! Starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and a
//! kubelet with containerd (scripts/build-k8s.sh builds them from their Go
//! modules) on loopback, installs the shipped DRA manifests, and runs the
//! scenarios in order against it, each printing PASS or FAIL with its time.
//! Exits 1 if any failed. scripts/test.sh runs it for each tested release, with
//! the gates our features need and with the release's defaults.
//!
//! Needs root (kubelet, containerd and runc), Debian's runc, busybox-static and
//! containernetworking-plugins, and openssl.

mod scenarios;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use real_k8s::{control, drivers, node, proc};

use control::{ControlPlane, Gates, Release};

#[derive(Parser, Debug)]
#[command(
    name = "real-k8s",
    about = "Runs the drivers against one release of the real Kubernetes control plane and kubelet"
)]
struct Cli {
    /// The release's binaries: kube-apiserver, kube-controller-manager,
    /// kube-scheduler, kubelet, kubectl and etcd (scripts/build-k8s.sh prints it).
    #[arg(long, value_name = "DIR")]
    k8s_bins: PathBuf,
    /// containerd, containerd-shim-runc-v2 and ctr (scripts/build-k8s.sh containerd).
    #[arg(long, value_name = "DIR")]
    containerd_bins: PathBuf,
    /// The release, v1.<minor>[.<patch>] (which gates exist and are on by default).
    #[arg(long)]
    release: String,
    /// `features`: the gates our features need turned on; `defaults`: the
    /// release's defaults, so the fallbacks are exercised.
    #[arg(long, value_parser = ["features", "defaults"])]
    gates: String,
    /// Our binaries (sandbox-dra-driver, sandbox-dra-controller,
    /// sandbox-device-plugin).
    #[arg(long, value_name = "DIR")]
    our_bins: PathBuf,
    /// helm (scripts/build-k8s.sh helm), which installs the chart.
    #[arg(long, value_name = "FILE")]
    helm: PathBuf,
    /// Scratch directory (default: a new one under /dev/shm or the temp dir).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Keep the scratch directory (logs) even when every scenario passes.
    #[arg(long)]
    keep: bool,
    /// Run only the scenarios whose names contain one of these.
    scenarios: Vec<String>,
}

/// What a scenario gets.
/// Fields drop in order: the driver, then the node, then the control plane.
pub struct Ctx {
    /// The DRA driver, while it runs.
    pub dra: Option<drivers::DraDriver>,
    /// kubelet and containerd.
    pub node: node::Node,
    /// The fake sysfs the drivers read.
    pub host: drivers::Host,
    /// etcd, kube-apiserver, kube-controller-manager, kube-scheduler.
    pub plane: ControlPlane,
    /// Where our binaries are.
    pub our_bins: PathBuf,
}

impl Ctx {
    /// `sandbox-dra-driver`.
    pub fn dra_binary(&self) -> PathBuf {
        self.our_bins.join("sandbox-dra-driver")
    }
    /// `sandbox-dra-controller`, the claim labeller.
    pub fn labeller_binary(&self) -> PathBuf {
        self.our_bins.join("sandbox-dra-controller")
    }
    /// `sandbox-device-plugin`.
    pub fn plugin_binary(&self) -> PathBuf {
        self.our_bins.join("sandbox-device-plugin")
    }
}

fn main() {
    let cli = Cli::parse();
    let release = match check_inputs(&cli) {
        Ok(release) => release,
        Err(e) => {
            eprintln!("real-k8s: {e:#}");
            std::process::exit(2);
        }
    };
    // A mount namespace of our own before any thread starts: the fake PCI
    // core's mounts end with the harness, whatever way it ends.
    if let Err(e) = proc::own_mount_namespace() {
        eprintln!("real-k8s: {e:#}");
        std::process::exit(1);
    }
    match run(&cli, release) {
        Ok(true) => std::process::exit(0),
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("real-k8s: {e:#}");
            std::process::exit(1);
        }
    }
}

/// Refuses, before anything starts, a release that does not parse, a scenario
/// filter that matches no scenario (a run of nothing would pass) and a binary
/// the run needs that is not there, naming each. Gives the parsed release.
fn check_inputs(cli: &Cli) -> Result<Release> {
    let release = Release::parse(&cli.release)?;
    let unknown: Vec<&str> = cli
        .scenarios
        .iter()
        .filter(|f| {
            !scenarios::ALL
                .iter()
                .any(|(name, _)| name.contains(f.as_str()))
        })
        .map(String::as_str)
        .collect();
    if !unknown.is_empty() {
        let known: Vec<&str> = scenarios::ALL.iter().map(|(name, _)| *name).collect();
        bail!(
            "no scenario matches {}; the scenarios are: {}",
            unknown.join(", "),
            known.join(", ")
        );
    }
    let needed = [
        (&cli.k8s_bins, "--k8s-bins", &control::BINARIES[..]),
        (
            &cli.containerd_bins,
            "--containerd-bins",
            &node::CONTAINERD_BINARIES[..],
        ),
        (
            &cli.our_bins,
            "--our-bins",
            &[
                "sandbox-dra-driver",
                "sandbox-dra-controller",
                "sandbox-device-plugin",
            ][..],
        ),
    ];
    let mut missing = Vec::new();
    for (dir, flag, names) in needed {
        for name in names {
            let path = dir.join(name);
            let runnable = std::fs::metadata(&path)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false);
            if !runnable {
                missing.push(format!("{} ({flag})", path.display()));
            }
        }
    }
    let helm_runs = std::fs::metadata(&cli.helm)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false);
    if !helm_runs {
        missing.push(format!("{} (--helm)", cli.helm.display()));
    }
    if !missing.is_empty() {
        bail!("no executable {}", missing.join(", "));
    }
    Ok(release)
}

fn run(cli: &Cli, release: Release) -> Result<bool> {
    let gates = if cli.gates == "features" {
        Gates::Features
    } else {
        Gates::Defaults
    };
    let dir = match &cli.dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => {
            // Short: kubelet's directories, and the sockets in them, live
            // below it, and a socket path holds at most 107 bytes.
            let d = sysfs_pci::testing::scratch_root().join(format!("k8s-{}", std::process::id()));
            std::fs::create_dir_all(&d)?;
            d
        }
    };
    let label = format!("{} ({})", cli.release, cli.gates);
    println!("real-k8s {label}: scratch and logs in {}", dir.display());
    let start = Instant::now();
    let mut plane = ControlPlane::start(
        &cli.k8s_bins,
        &dir.join("cluster"),
        release,
        gates,
        "node-a",
    )
    .context("starting the control plane")?;
    plane.helm = Some(cli.helm.clone());
    println!(
        "real-k8s {label}: control plane up in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let host = drivers::Host::create(&dir.join("host"))?;
    let node = node::Node::start(
        &plane,
        &cli.containerd_bins,
        &dir.join("node"),
        &host.dir.join("dev/vfio"),
    )
    .context("starting the node (containerd, kubelet)")?;
    println!(
        "real-k8s {label}: kubelet and containerd up, Node Ready, in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    drivers::install_dra_manifests(&plane)?;
    let mut ctx = Ctx {
        plane,
        node,
        host,
        our_bins: cli.our_bins.clone(),
        dra: None,
    };

    let mut failed = Vec::new();
    let mut not_applicable = 0;
    let mut ran: usize = 0;
    for (name, scenario) in scenarios::ALL {
        if !cli.scenarios.is_empty() && !cli.scenarios.iter().any(|s| name.contains(s.as_str())) {
            continue;
        }
        ran += 1;
        let t = Instant::now();
        // A request the shipped RBAC refuses fails the scenario by its verb and
        // resource, whatever else went wrong after it.
        let result = match (scenario(&mut ctx), scenarios::no_forbidden(&ctx.plane)) {
            (Ok(outcome), Ok(())) => Ok(outcome),
            (Ok(_), Err(refused)) => Err(refused),
            (Err(e), Ok(())) => Err(e),
            (Err(e), Err(refused)) => Err(refused.context(format!("{e:#}"))),
        };
        scenarios::cleanup(&ctx);
        let secs = t.elapsed().as_secs_f64();
        match result {
            Ok(scenarios::Outcome::Passed) => println!("PASS {name} [{label}] ({secs:.1} s)"),
            Ok(scenarios::Outcome::NotApplicable(why)) => {
                not_applicable += 1;
                println!("N/A  {name} [{label}] ({secs:.1} s): {why}")
            }
            Err(e) => {
                println!("FAIL {name} [{label}] ({secs:.1} s): {e:#}");
                failed.push(*name);
            }
        }
        if let Err(e) = ctx.plane.check() {
            println!("FAIL the control plane [{label}]: {e:#}");
            failed.push("control plane");
            break;
        }
    }
    if ran == 0 {
        bail!("no scenario matches {:?}", cli.scenarios);
    }
    let ok = failed.is_empty();
    println!(
        "real-k8s {label}: of {ran} scenarios {} passed, {not_applicable} do not \
            apply, {} failed, in {:.1} s{}",
        ran.saturating_sub(failed.len() + not_applicable),
        failed.len(),
        start.elapsed().as_secs_f64(),
        if ok {
            String::new()
        } else {
            format!(
                "; failed: {}; logs in {}",
                failed.join(", "),
                dir.join("cluster/logs").display()
            )
        }
    );
    drop(ctx);
    if ok && !cli.keep && cli.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(ok)
}
