//! guest-node: the chart as a user installs it, on a real kubelet on the real
//! kernel. A control plane of one release runs on the host; the node is the
//! real-kernel test bed's guest running kubelet, containerd and runc
//! ([`real_k8s::guest`]), with our image in its containerd. The steps run in
//! order, each on what the one before left, and the run stops at the first
//! failure:
//!
//! - `install`: `helm install` with the standalone values and a resource list
//!   of the bed's stand-ins (the e1000e card of two functions in one IOMMU
//!   group, and a lone e1000e): nothing starts on the unlabelled node; the
//!   workload label puts vfio-manager's pod there, which binds every device
//!   with its group companion on the real `vfio-pci`; the device plugin's pod
//!   waits in its validator init container until the node is ready, then
//!   registers from its pod; the node's allocatable shows the resource; a pod
//!   asking for one gets its `/dev/vfio` nodes and `PCI_RESOURCE_*`.
//! - `uninstall`: `helm uninstall` while the devices are bound: every device
//!   back on its native driver, no file of ours left in the node's `/run`,
//!   `/var/run/cdi` or kubelet's plugin directories.
//! - `bad-input`: a typo'd key fails at `helm install` (the schema), and a
//!   resource list whose entries overlap (which no schema sees) fails
//!   vfio-manager's pod with exit 2 naming both entries, nothing moved.
//! - `privileges`: what the shipped security contexts need, measured with the
//!   real runc: vfio-manager's work in containers given less than `privileged`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use real_k8s::control::{path_str, ControlPlane, Gates, Release};
use real_k8s::guest::{self, Guest, BUSYBOX};
use real_k8s::proc::wait_for;

#[derive(Parser, Debug)]
#[command(
    name = "guest-node",
    about = "Installs the chart on a real kubelet in the real-kernel test bed and walks a node through VM mode"
)]
struct Cli {
    /// The release's binaries (scripts/build-k8s.sh v1.37).
    #[arg(long, value_name = "DIR")]
    k8s_bins: PathBuf,
    /// containerd, containerd-shim-runc-v2 and ctr (scripts/build-k8s.sh containerd).
    #[arg(long, value_name = "DIR")]
    containerd_bins: PathBuf,
    /// helm (scripts/build-k8s.sh helm).
    #[arg(long, value_name = "FILE")]
    helm: PathBuf,
    /// Our image, an OCI archive of `localhost/vfio-sandbox:<version>`
    /// (scripts/image.sh --archive).
    #[arg(long, value_name = "FILE")]
    image_archive: PathBuf,
    /// The release, v1.<minor>[.<patch>].
    #[arg(long)]
    release: String,
    /// Scratch directory (default: a new one under /dev/shm).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Keep the scratch directory (logs) even when every step passes.
    #[arg(long)]
    keep: bool,
}

/// The stand-ins the resource list selects (scripts/vm/devices.sh).
const CARD_FN0: &str = "0000:01:00.0";
const CARD_FN1: &str = "0000:01:00.1";
const SOLO_NIC: &str = "0000:02:00.0";
const DEVICES: [&str; 3] = [CARD_FN0, CARD_FN1, SOLO_NIC];
const RESOURCE: &str = "example.com/NIC_PT";
const NS: &str = "vfio-sandbox";
const RELEASE: &str = "vfio-sandbox";
const NODE: &str = "node-vm";
const WORKLOAD: &str = "rebellions.ai/npu.workload.config";

/// The values beside the chart's `examples/standalone.yaml`: the bed's
/// stand-ins instead of the Rebellions preset, and the validator looking every
/// second (the default 5 s only slows the run).
const VALUES: &str = r#"config:
  preset: []
sandboxDevicePlugin:
  resourceList:
    - name: example.com/NIC_PT
      vendor: "8086"
      devices: ["10d3"]
  validator:
    interval: 1s
"#;

struct Run {
    /// Our image's repository and tag, as imported on the node.
    image: (String, String),
    plane: ControlPlane,
    guest: Guest,
    repo: PathBuf,
    dir: PathBuf,
}

fn main() {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(true) => std::process::exit(0),
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("guest-node: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run(cli: &Cli) -> Result<bool> {
    let release = Release::parse(&cli.release)?;
    for (path, what) in [
        (cli.k8s_bins.join("kubelet"), "--k8s-bins"),
        (cli.containerd_bins.join("containerd"), "--containerd-bins"),
        (cli.helm.clone(), "--helm"),
    ] {
        let ok = std::fs::metadata(&path).is_ok_and(|m| m.permissions().mode() & 0o111 != 0);
        ensure!(ok, "no executable {} ({what})", path.display());
    }
    ensure!(
        cli.image_archive.is_file(),
        "no image archive {} (--image-archive)",
        cli.image_archive.display()
    );
    let dir = match &cli.dir {
        Some(d) => d.clone(),
        None => PathBuf::from(format!("/dev/shm/guest-node-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir)?;
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    println!(
        "guest-node {}: scratch and logs in {}",
        cli.release,
        dir.display()
    );
    let start = Instant::now();
    let t = Instant::now();
    let built = guest::build(
        &repo,
        &dir.join("build"),
        &cli.k8s_bins,
        &cli.containerd_bins,
        &cli.image_archive,
    )?;
    println!(
        "guest-node: node assembled in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let mut plane = ControlPlane::start(
        &cli.k8s_bins,
        &dir.join("cluster"),
        release,
        Gates::Defaults,
        NODE,
    )
    .context("starting the control plane")?;
    plane.helm = Some(cli.helm.clone());
    println!(
        "guest-node: control plane up in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let guest = Guest::boot(&plane, &dir.join("guest"), &built)?;
    let mut run = Run {
        image: guest::image_ref(&cli.image_archive)?,
        plane,
        guest,
        repo,
        dir: dir.clone(),
    };
    type Step = fn(&mut Run) -> Result<String>;
    let steps: [(&str, Step); 4] = [
        ("install", install),
        ("uninstall", uninstall),
        ("bad-input", bad_input),
        ("privileges", privileges),
    ];
    let mut ok = true;
    for (name, step) in steps {
        let t = Instant::now();
        let result = step(&mut run).and_then(|note| {
            run.guest.check()?;
            Ok(note)
        });
        let secs = t.elapsed().as_secs_f64();
        match result {
            Ok(note) => println!("PASS {name} ({secs:.1} s)\n     {note}"),
            Err(e) => {
                println!("FAIL {name} ({secs:.1} s): {e:#}");
                diagnose(&run);
                ok = false;
                break;
            }
        }
    }
    println!(
        "guest-node: {} in {:.1} s{}",
        if ok { "passed" } else { "FAILED" },
        start.elapsed().as_secs_f64(),
        if ok {
            String::new()
        } else {
            format!(
                "; logs in {} (the guest's console: guest-console.log)",
                dir.join("cluster/logs").display()
            )
        }
    );
    drop(run);
    if ok && !cli.keep && cli.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(ok)
}

/// What a failed step leaves to read: the pods and their last events, the
/// node's images and kubelet's last words.
fn diagnose(run: &Run) {
    let show = |what: &str, out: Result<String>| {
        let text = out.unwrap_or_else(|e| format!("({e:#})"));
        println!("---- {what}\n{}", text.trim_end());
    };
    show("pods", run.kubectl(&["get", "pods", "-A", "-o", "wide"]));
    show(
        "events",
        run.kubectl(&["get", "events", "-A", "--sort-by=.lastTimestamp"])
            .map(|e| {
                e.lines()
                    .rev()
                    .take(25)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n")
            }),
    );
    show(
        "the node's images and kubelet's log",
        run.guest
            .sh(
                "ctr --address=/run/containerd/containerd.sock -n k8s.io images ls -q; \
             grep -E '^E' /data/state/kubelet.log | tail -n 15",
            )
            .map(|(_, out)| out),
    );
}

impl Run {
    fn chart(&self) -> PathBuf {
        self.repo.join("charts/vfio-sandbox")
    }

    /// `helm install` of the chart with the standalone values, then `values`,
    /// and the image imported on the node.
    fn install(&self, values: &Path) -> Result<String> {
        let chart = self.chart();
        self.plane.helm(&[
            "install",
            RELEASE,
            path_str(&chart),
            "--namespace",
            NS,
            "--create-namespace",
            "-f",
            path_str(&chart.join("examples/standalone.yaml")),
            "-f",
            path_str(values),
            "--set",
            &format!("image.repository={}", self.image.0),
            "--set",
            &format!("image.tag={}", self.image.1),
        ])
    }

    fn kubectl(&self, args: &[&str]) -> Result<String> {
        self.plane.kubectl(args)
    }

    /// The names of the pods of `app` (app.kubernetes.io/name) in the namespace.
    fn pods(&self, app: &str) -> Result<Vec<String>> {
        let out = self.kubectl(&[
            "get",
            "pods",
            "-n",
            NS,
            "-l",
            &format!("app.kubernetes.io/name={app}"),
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ])?;
        Ok(out.split_whitespace().map(str::to_owned).collect())
    }

    fn pod_field(&self, pod: &str, path: &str) -> Result<String> {
        self.kubectl(&[
            "get",
            "pod",
            pod,
            "-n",
            NS,
            "-o",
            &format!("jsonpath={path}"),
        ])
    }

    /// Waits for one pod of `app` whose Ready condition is True; gives its name.
    fn ready_pod(&self, app: &str, limit: Duration) -> Result<String> {
        wait_for(&format!("a Ready pod of {app}"), limit, || {
            for pod in self.pods(app)? {
                let ready = self
                    .pod_field(&pod, "{.status.conditions[?(@.type==\"Ready\")].status}")
                    .unwrap_or_default();
                if ready == "True" {
                    return Ok(Some(pod));
                }
            }
            Ok(None)
        })
    }

    /// The log of `container` of `pod` in namespace `ns`, read on the node
    /// (kubelet's /var/log/pods/<ns>_<pod>_<uid>/<container>/).
    fn log(&self, ns: &str, pod: &str, container: &str) -> Result<String> {
        self.guest.check_sh(&format!(
            "cat /var/log/pods/{ns}_{pod}_*/{container}/*.log 2>/dev/null | cut -d' ' -f4-"
        ))
    }

    fn allocatable(&self) -> Result<String> {
        self.kubectl(&[
            "get",
            "node",
            NODE,
            "-o",
            &format!(
                "jsonpath={{.status.allocatable.{}}}",
                RESOURCE.replace('.', "\\.")
            ),
        ])
    }

    fn drivers(&self) -> Result<Vec<String>> {
        DEVICES.iter().map(|d| self.guest.driver(d)).collect()
    }

    fn wait_drivers(&self, want: &str, limit: Duration) -> Result<()> {
        wait_for(&format!("every device on {want}"), limit, || {
            let got = self.drivers()?;
            Ok(got.iter().all(|d| d == want).then_some(()))
        })
        .with_context(|| format!("drivers of {DEVICES:?}: {:?}", self.drivers().ok()))
    }
}

fn install(run: &mut Run) -> Result<String> {
    let values = run.dir.join("guest-values.yaml");
    std::fs::write(&values, VALUES)?;
    let t = Instant::now();
    run.install(&values).context("helm install")?;
    let helm_secs = t.elapsed().as_secs_f64();
    // Nothing lands on the unlabelled node: the DaemonSet controller has
    // seen the Node long before, and schedules nothing.
    std::thread::sleep(Duration::from_secs(5));
    let desired = run.kubectl(&[
        "get",
        "daemonsets",
        "-n",
        NS,
        "-o",
        "jsonpath={.items[*].status.desiredNumberScheduled}",
    ])?;
    ensure!(
        desired.split_whitespace().all(|n| n == "0") && run.pods("vfio-manager")?.is_empty(),
        "the DaemonSets schedule pods on the unlabelled node (desired: {desired})"
    );
    ensure!(
        run.drivers()?.iter().all(|d| d == "e1000e"),
        "a device moved before the node was labelled: {:?}",
        run.drivers()?
    );

    let t = Instant::now();
    run.kubectl(&[
        "label",
        "node",
        NODE,
        &format!("{WORKLOAD}=vm-passthrough"),
        "--overwrite",
    ])?;
    let manager = run.ready_pod("vfio-manager", Duration::from_secs(180))?;
    let bound_secs = t.elapsed().as_secs_f64();
    let drivers = run.drivers()?;
    ensure!(
        drivers.iter().all(|d| d == "vfio-pci"),
        "vfio-manager's pod is Ready but the devices are on {drivers:?}"
    );
    let plugin = run.ready_pod("sandbox-device-plugin", Duration::from_secs(180))?;
    let plugin_secs = t.elapsed().as_secs_f64();
    // The validator ran before the plugin, and said why it waited.
    let validator = run.log(NS, &plugin, "sandbox-validator")?;
    ensure!(
        validator.contains("ready"),
        "the validator's log says nothing of readiness:\n{validator}"
    );
    let waited = validator.lines().count();
    let file = run
        .guest
        .check_sh("cat /run/vfio-sandbox/validations/vfio-pci-ready")?;
    ensure!(
        !file.trim().is_empty(),
        "the validator's ready file is empty"
    );
    wait_for(
        &format!("the plugin's log to name {RESOURCE}"),
        Duration::from_secs(60),
        || {
            Ok(run
                .log(NS, &plugin, "sandbox-device-plugin")?
                .contains(RESOURCE)
                .then_some(()))
        },
    )?;
    wait_for(
        &format!("allocatable {RESOURCE} = 3"),
        Duration::from_secs(120),
        || Ok((run.allocatable()? == "3").then_some(())),
    )?;

    // A pod asking for one device, as virt-launcher would: it gets the group
    // node and KubeVirt's variable, and holds the group open as a VMM does.
    let pod = format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: vm\n  namespace: default\nspec:\n  \
         nodeName: {NODE}\n  terminationGracePeriodSeconds: 1\n  restartPolicy: Never\n  \
         containers:\n  - name: vmm\n    image: {BUSYBOX}\n    imagePullPolicy: Never\n    \
         command: ['/bin/sh', '-c', 'ls /dev/vfio; env | grep PCI_RESOURCE; \
         for g in /dev/vfio/[0-9]*; do exec 3<>$g; echo holding $g; done; exec sleep 1000000']\n    \
         resources:\n      limits:\n        {RESOURCE}: 1\n"
    );
    run.plane.apply(&pod)?;
    wait_for("the VM pod's group held", Duration::from_secs(120), || {
        let log = run.log("default", "vm", "vmm")?;
        Ok(log.contains("holding").then_some(log))
    })?;
    let log = run.log("default", "vm", "vmm")?;
    let var = log
        .lines()
        .find_map(|l| l.strip_prefix("PCI_RESOURCE_EXAMPLE_COM_NIC_PT="))
        .with_context(|| format!("no PCI_RESOURCE_EXAMPLE_COM_NIC_PT in the pod:\n{log}"))?
        .trim()
        .to_owned();
    ensure!(
        DEVICES.contains(&var.as_str()),
        "the pod was given {var}, not a stand-in"
    );
    let group = run.guest.check_sh(&format!(
        "basename $(readlink /sys/bus/pci/devices/{var}/iommu_group)"
    ))?;
    ensure!(
        log.lines().any(|l| l.trim() == group.trim()),
        "the pod's /dev/vfio lacks group {} of {var}:\n{log}",
        group.trim()
    );
    Ok(format!(
        "helm install {helm_secs:.1} s; label to vfio-manager Ready (3 devices on vfio-pci) \
         {bound_secs:.1} s, to the device plugin Ready {plugin_secs:.1} s (its validator printed \
         {waited} lines before passing); allocatable {RESOURCE} 3; the pod was given {var} and \
         /dev/vfio/{}; pods {manager}, {plugin}",
        group.trim()
    ))
}

fn uninstall(run: &mut Run) -> Result<String> {
    // The VM's pod first: with it running, its group stays bound (and the
    // pod's own restore is the leave step's to prove).
    run.kubectl(&["delete", "pod", "vm", "-n", "default", "--wait=true"])?;
    let t = Instant::now();
    run.plane
        .helm(&[
            "uninstall",
            RELEASE,
            "--namespace",
            NS,
            "--wait",
            "--timeout",
            "5m",
        ])
        .context("helm uninstall")?;
    run.wait_drivers("e1000e", Duration::from_secs(180))?;
    let secs = t.elapsed().as_secs_f64();
    wait_for("the agents' pods gone", Duration::from_secs(180), || {
        Ok(
            (run.pods("vfio-manager")?.is_empty() && run.pods("sandbox-device-plugin")?.is_empty())
                .then_some(()),
        )
    })?;
    // What stays: the directories kubelet made for the host paths
    // (DirectoryOrCreate, kept as for every DaemonSet), the two lock files and
    // vfio-manager's state file, which after a full restore records nothing.
    // No socket, no CDI spec, no ready file, no device in a record.
    let left = run.guest.check_sh(
        "find /run/vfio-manager /run/vfio-sandbox /run/sandbox-dra-driver /var/run/cdi \\
         /var/lib/kubelet/plugins /var/lib/kubelet/plugins_registry \\
         /var/lib/kubelet/device-plugins \\( -type f -o -type s \\) 2>/dev/null | sort",
    )?;
    let mut kept = Vec::new();
    for file in left.lines().map(str::trim).filter(|f| !f.is_empty()) {
        let name = file.rsplit('/').next().unwrap_or(file);
        match name {
            // kubelet's own.
            "kubelet.sock" | "kubelet_internal_checkpoint" => continue,
            "state.json.lock" | "owner.lock" | "owner.lock.gate" => kept.push(file.to_owned()),
            "state.json" => {
                let text = run.guest.check_sh(&format!("cat {file}"))?;
                ensure!(
                    !text.contains("0000:"),
                    "{file} still records devices after helm uninstall:\n{text}"
                );
                kept.push(format!("{file} (no device)"));
            }
            _ => bail!("{file} left on the node after helm uninstall"),
        }
    }
    Ok(format!(
        "helm uninstall to every device back on e1000e: {secs:.1} s; left on the node: {}",
        if kept.is_empty() {
            "nothing".to_owned()
        } else {
            kept.join(", ")
        }
    ))
}

fn bad_input(run: &mut Run) -> Result<String> {
    let chart = run.chart();
    let standalone = chart.join("examples/standalone.yaml");
    // The schema: refused before anything is created.
    let refused = run
        .plane
        .helm(&[
            "install",
            RELEASE,
            path_str(&chart),
            "--namespace",
            NS,
            "-f",
            path_str(&standalone),
            "--set",
            "vfioManger.enabled=false",
        ])
        .err()
        .context("helm install with the key vfioManger was accepted")?;
    let refused = format!("{refused:#}");
    ensure!(
        refused.contains("additional properties 'vfioManger' not allowed"),
        "helm's refusal does not name the key: {refused}"
    );
    ensure!(
        run.plane
            .helm(&["status", RELEASE, "--namespace", NS])
            .is_err(),
        "a release exists after the refused install"
    );
    // Two entries that select the same device: only the binaries see it.
    let values = run.dir.join("overlapping.yaml");
    std::fs::write(
        &values,
        "config:\n  preset: []\nsandboxDevicePlugin:\n  resourceList:\n    \
         - {name: example.com/NIC_PT, vendor: \"8086\", devices: [\"10d3\"]}\n    \
         - {name: example.com/ANY_INTEL, vendor: \"8086\"}\n",
    )?;
    run.install(&values)
        .context("helm install with overlapping entries")?;
    let (pod, code) = wait_for(
        "vfio-manager's container to exit",
        Duration::from_secs(180),
        || {
            for pod in run.pods("vfio-manager")? {
                let code = run.pod_field(
                    &pod,
                    "{.status.containerStatuses[0].lastState.terminated.exitCode}\
                     {.status.containerStatuses[0].state.terminated.exitCode}",
                )?;
                if !code.trim().is_empty() {
                    return Ok(Some((pod, code.trim().to_owned())));
                }
            }
            Ok(None)
        },
    )?;
    ensure!(code.starts_with('2'), "vfio-manager exited {code}, not 2");
    let log = run.log(NS, &pod, "vfio-manager")?;
    let line = log
        .lines()
        .find(|l| l.contains("overlaps"))
        .with_context(|| format!("vfio-manager's log names no overlap:\n{log}"))?
        .trim()
        .to_owned();
    ensure!(
        line.contains("example.com/ANY_INTEL") && line.contains("example.com/NIC_PT"),
        "the refusal does not name both entries: {line}"
    );
    ensure!(
        run.drivers()?.iter().all(|d| d == "e1000e"),
        "a device moved: {:?}",
        run.drivers()?
    );
    run.plane
        .helm(&[
            "uninstall",
            RELEASE,
            "--namespace",
            NS,
            "--wait",
            "--timeout",
            "3m",
        ])
        .context("helm uninstall")?;
    Ok(format!(
        "helm install refused vfioManger; overlapping entries: vfio-manager exits {code}: {line}; \
         nothing moved"
    ))
}

/// A pod of our image running `vfio-manager ARGS` with vfio-manager's mounts
/// and the security context `context` (YAML under `securityContext:`); waits
/// for it to end and gives its exit code and log.
fn manager_pod(run: &Run, name: &str, args: &str, context: &str) -> Result<(i32, String)> {
    let image = format!("{}:{}", run.image.0, run.image.1);
    let pod = format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  \
         nodeName: {NODE}\n  restartPolicy: Never\n  automountServiceAccountToken: false\n  \
         containers:\n  - name: manager\n    image: {image}\n    imagePullPolicy: Never\n    \
         command: ['/usr/bin/vfio-manager']\n    args: [{args}]\n    env:\n    \
         - {{name: VFIO_SANDBOX_CONFIG, value: /config/list.json}}\n    securityContext:\n{context}    \
         volumeMounts:\n    - {{name: sys, mountPath: /sys}}\n    - {{name: dev, mountPath: /dev}}\n    \
         - {{name: modules, mountPath: /lib/modules, readOnly: true}}\n    \
         - {{name: state, mountPath: /run/vfio-manager}}\n    \
         - {{name: owner, mountPath: /run/vfio-sandbox/owner}}\n    \
         - {{name: config, mountPath: /config, readOnly: true}}\n  volumes:\n  \
         - {{name: sys, hostPath: {{path: /sys}}}}\n  - {{name: dev, hostPath: {{path: /dev}}}}\n  \
         - {{name: modules, hostPath: {{path: /lib/modules}}}}\n  \
         - {{name: state, hostPath: {{path: /run/privileges-test/state, type: DirectoryOrCreate}}}}\n  \
         - {{name: owner, hostPath: {{path: /run/privileges-test/owner, type: DirectoryOrCreate}}}}\n  \
         - {{name: config, hostPath: {{path: /run/privileges-test/config, type: Directory}}}}\n"
    );
    run.plane.apply(&pod)?;
    let phase = wait_for(
        &format!("pod {name} to end"),
        Duration::from_secs(180),
        || {
            let phase = run.kubectl(&[
                "get",
                "pod",
                name,
                "-n",
                "default",
                "-o",
                "jsonpath={.status.phase}",
            ])?;
            Ok(matches!(phase.as_str(), "Succeeded" | "Failed").then_some(phase))
        },
    )?;
    let code: i32 = run
        .kubectl(&[
            "get",
            "pod",
            name,
            "-n",
            "default",
            "-o",
            "jsonpath={.status.containerStatuses[0].state.terminated.exitCode}",
        ])?
        .trim()
        .parse()
        .with_context(|| format!("pod {name} ({phase}) has no exit code"))?;
    let log = run.log("default", name, "manager")?;
    run.kubectl(&["delete", "pod", name, "-n", "default", "--wait=true"])?;
    Ok((code, log))
}

/// What vfio-manager's work needs, with the real runc: each step in a
/// container given less than the shipped `privileged`.
fn privileges(run: &mut Run) -> Result<String> {
    run.guest.check_sh(
        "mkdir -p /run/privileges-test/config && \
         echo '{\"resources\":[{\"name\":\"example.com/NIC_PT\",\"vendor\":\"8086\",\"devices\":[\"10d3\"]}]}' \
         >/run/privileges-test/config/list.json && \
         for m in vfio_pci vfio_pci_core vfio_iommu_type1 vfio; do rmmod $m 2>/dev/null; done; \
         ! grep -q '^vfio ' /proc/modules",
    )?;
    let base = "      runAsUser: 0\n      allowPrivilegeEscalation: false\n      \
                readOnlyRootFilesystem: true\n      seccompProfile: {type: RuntimeDefault}\n";
    let no_caps = format!("{base}      capabilities: {{drop: [ALL]}}\n");
    let sys_module = format!("{base}      capabilities: {{drop: [ALL], add: [SYS_MODULE]}}\n");
    let mut notes = Vec::new();

    // 1. No capability: loading vfio is refused, nothing moves.
    let (code, log) = manager_pod(run, "bind-no-caps", "bind, --all", &no_caps)?;
    ensure!(
        code != 0,
        "bind --all without CAP_SYS_MODULE succeeded:\n{log}"
    );
    ensure!(
        log.contains("finit_module") && log.contains("EPERM"),
        "without CAP_SYS_MODULE the refusal does not name finit_module and EPERM:\n{log}"
    );
    ensure!(
        run.drivers()?.iter().all(|d| d == "e1000e"),
        "a device moved"
    );
    notes.push(format!(
        "no capability: bind exits {code}, finit_module EPERM, nothing moved"
    ));

    // 2. CAP_SYS_MODULE alone: the modules load and every sysfs write of the
    //    bind (driver_override, unbind, drivers_probe) goes through.
    let (code, log) = manager_pod(run, "bind-sys-module", "bind, --all", &sys_module)?;
    ensure!(
        code == 0,
        "bind --all with CAP_SYS_MODULE exited {code}:\n{log}"
    );
    run.wait_drivers("vfio-pci", Duration::from_secs(30))?;
    notes.push("CAP_SYS_MODULE: bind exits 0, the modules load, 3 devices on vfio-pci".to_owned());

    // 3. The restore opens /dev/vfio/<group> to see whether a VM holds it: the
    //    device cgroup of an unprivileged container refuses the open.
    let (code, log) = manager_pod(run, "unbind-sys-module", "unbind, --all", &sys_module)?;
    ensure!(
        code != 0,
        "unbind --all without privileged succeeded:\n{log}"
    );
    ensure!(
        log.contains("/dev/vfio/") && (log.contains("EPERM") || log.contains("not permitted")),
        "the unprivileged restore's refusal names no /dev/vfio node and EPERM:\n{log}"
    );
    ensure!(
        run.drivers()?.iter().all(|d| d == "vfio-pci"),
        "a device moved while its group could not be checked"
    );
    let line = log
        .lines()
        .find(|l| l.contains("/dev/vfio/"))
        .unwrap_or_default()
        .trim()
        .to_owned();
    notes.push(format!("CAP_SYS_MODULE: unbind exits {code}: {line}"));

    // 4. The shipped context (privileged) restores.
    let (code, log) = manager_pod(
        run,
        "unbind-privileged",
        "unbind, --all",
        "      privileged: true\n      runAsUser: 0\n      readOnlyRootFilesystem: true\n",
    )?;
    ensure!(code == 0, "unbind --all privileged exited {code}:\n{log}");
    run.wait_drivers("e1000e", Duration::from_secs(30))?;
    notes.push("privileged: unbind exits 0, every device back on e1000e".to_owned());
    if notes.is_empty() {
        bail!("no step ran");
    }
    Ok(notes.join("; "))
}
