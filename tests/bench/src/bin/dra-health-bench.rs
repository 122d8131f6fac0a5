//! Measures how fast a device health change reaches kubelet from sandbox-dra-driver,
//! on a fake node with N NVIDIA GPUs on vfio-pci (the `nvidia` preset), and prints
//! numbers (no pass/fail). The driver runs against the stand-in API server; the
//! peer registers it as kubelet 1.34 does, prepares a claim for the first GPU and
//! reads the `DRAResourceHealth` stream kubelet would pick. Each change moves that
//! GPU off vfio-pci with its group node removed (seen through inotify on
//! /dev/vfio, as on a real node besides the uevent) and back, alternately, and is
//! timed until the stream reports the GPU `Unhealthy` / `Healthy`.
//!
//! `dra-health-bench --driver target/release/sandbox-dra-driver --devices 1024`

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use fake_apiserver::objects::{self, DeviceResult};
use fake_apiserver::{paths, FakeApiServer};
use kubelet_peer::dra::health::{pick_service, HealthCache, HealthStream};
use kubelet_peer::dra::{self, ClaimRef, Dra, KubeletVersion, Version};
use sysfs_pci::testing::{gpu_address as addr, gpu_node};

const DRIVER: &str = "vfio-sandbox.rebellions.ai";
const NODE: &str = "node-a";

#[derive(Debug, Parser)]
struct Args {
    /// The driver binary to measure.
    #[arg(long)]
    driver: PathBuf,
    /// Selected devices on the fake node.
    #[arg(long, default_value_t = 64)]
    devices: usize,
    /// Health changes to time.
    #[arg(long, default_value_t = 20)]
    changes: usize,
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(driver: &Path, root: &Path, kubeconfig: &Path) -> std::io::Result<Killed> {
    let p = |s: &str| root.join(s);
    let log = std::fs::File::create(p("driver.log"))?;
    Ok(Killed(
        std::process::Command::new(driver)
            .arg("--sysfs-root")
            .arg(p("sys"))
            .arg("--dev-root")
            .arg(p("dev"))
            .arg("--modules-root")
            .arg(p("lib/modules"))
            .arg("--config")
            .arg(p("config.json"))
            .arg("--registry-dir")
            .arg(p("registry"))
            .arg("--plugins-dir")
            .arg(p("plugins"))
            .arg("--cdi-dir")
            .arg(p("cdi"))
            .arg("--metadata-dir")
            .arg(p("metadata"))
            .arg("--state-file")
            .arg(p("state.json"))
            .arg("--ready-file")
            .arg(p("ready"))
            .arg("--owner-lock")
            .arg(p("owner.lock"))
            .args(["--resync-interval", "1h", "--log-level", "warn"])
            .env("KUBECONFIG", kubeconfig)
            .env("NODE_NAME", NODE)
            .env("HOME", root)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?,
    ))
}

fn ms(d: Option<&Duration>) -> String {
    d.map_or_else(
        || "-1".into(),
        |d| format!("{:.2}", d.as_secs_f64() * 1000.0),
    )
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir()?;
    let root = dir.path();
    let node = gpu_node(root, args.devices);
    for m in ["vfio", "vfio_iommu_type1", "vfio_pci"] {
        node.add_module(m);
    }
    std::fs::write(root.join("config.json"), r#"{"preset": "nvidia"}"#)?;
    let server = FakeApiServer::start()?;
    server.put(&paths::node(NODE), objects::node(NODE, &[]));
    let kubeconfig = server.write_kubeconfig(root)?;
    // kubelet makes its registry directory; the driver waits for it.
    std::fs::create_dir_all(root.join("registry"))?;
    let _driver = spawn(&args.driver, root, &kubeconfig)?;

    let socket =
        dra::find_registration_socket(&root.join("registry"), Duration::from_secs(30)).await?;
    let reg = dra::register_socket_as(&socket, KubeletVersion::V1_34).await?;
    let target = addr(0);
    let device = format!("pci-{}", target.to_string().replace([':', '.'], "-"));
    let claim = ClaimRef {
        uid: "uid-bench".into(),
        namespace: "vms".into(),
        name: "bench".into(),
    };
    let result = DeviceResult::new("gpu", DRIVER, NODE, &device);
    server.put(
        &paths::resourceclaim(&claim.namespace, &claim.name),
        objects::resource_claim(&claim.namespace, &claim.name, &claim.uid, Some(&[result])),
    );
    let mut client =
        Dra::connect_as(&reg.endpoint_path(), Version::V1, KubeletVersion::V1_34).await?;
    let answer = client.prepare(std::slice::from_ref(&claim)).await?;
    let problems = answer.problems(std::slice::from_ref(&claim));
    anyhow::ensure!(problems.is_empty(), "prepare: {problems:?}");

    let version = pick_service(&reg.supported_versions)
        .ok_or_else(|| anyhow::anyhow!("no health service in {:?}", reg.supported_versions))?;
    let mut stream =
        HealthStream::open(&reg.endpoint_path(), version, KubeletVersion::V1_34).await?;
    let key = format!("{NODE}/{device}");
    let mut cache = HealthCache::default();
    let mut times = Vec::with_capacity(args.changes);
    // The first response lists every device.
    let first = stream
        .next()
        .await
        .ok_or_else(|| anyhow::anyhow!("no response"))??;
    cache.update(&first, Instant::now());
    anyhow::ensure!(
        cache.devices.len() == args.devices,
        "reported {} of {}",
        cache.devices.len(),
        args.devices
    );
    for i in 0..=args.changes {
        // Change 0 only waits for the prepared state to be reported.
        let unhealthy = i % 2 == 1;
        let want = if unhealthy { "Unhealthy" } else { "Healthy" };
        let t = Instant::now();
        if i > 0 {
            node.attach(&target, if unhealthy { "e1000e" } else { "vfio-pci" });
        }
        while cache.health(&key) != Some(want)
            || (i == 0 && !cache.devices[&key].message.contains("for a VM"))
        {
            let devices = tokio::time::timeout(Duration::from_secs(10), stream.next())
                .await
                .map_err(|_| anyhow::anyhow!("{key} not reported {want} within 10 s"))?
                .ok_or_else(|| anyhow::anyhow!("the stream ended"))??;
            cache.update(&devices, Instant::now());
        }
        if i > 0 {
            times.push(t.elapsed());
        }
    }
    times.sort();
    println!(
        "devices={} health_median_ms={} health_max_ms={}",
        args.devices,
        ms(times.get(times.len() / 2)),
        ms(times.last()),
    );
    Ok(())
}
