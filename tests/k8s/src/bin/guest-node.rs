//! guest-node: the chart as a user installs it, on a real kubelet on the real
//! kernel. A control plane of one release runs on the host; the node is the
//! real-kernel test bed's guest running kubelet, kube-proxy, containerd and
//! runc ([`real_k8s::guest`]), with our image in its containerd. The steps run
//! in order, each on what the one before left, and the run stops at the first
//! failure (`--steps` runs some of them):
//!
//! - `install`: `helm install` with the standalone values and a resource list
//!   of the bed's stand-ins (the e1000e card of two functions in one IOMMU
//!   group, and a lone e1000e): nothing starts on the unlabelled node; the
//!   workload label puts vfio-manager's pod there, which binds every device
//!   with its group companion on the real `vfio-pci`; the device plugin's pod
//!   waits in its validator init container until the node is ready, then
//!   registers from its pod; the node's allocatable shows the resource; a VM
//!   pod asking for one gets exactly its `/dev/vfio` nodes and
//!   `PCI_RESOURCE_*`, and QEMU in it realizes the device and holds it.
//! - `rollout`: `helm upgrade` with a new image tag and a resource list that
//!   adds a GPU-like group: new pods, no NIC leaves `vfio-pci`, the VM's group
//!   stays held, `minReadySeconds` holds the DaemonSet back, the new plugin
//!   registers both resources.
//! - `leave`: the label flipped to `container` under the VM: vfio-manager's pod
//!   stays through its restore label, puts back what is free, is SIGKILLed
//!   while it waits for the held group and restarted by kubelet; with the VM
//!   gone every device comes back, then the label goes, then the pod.
//! - `uninstall`: back in VM mode, `helm uninstall`: every device back on its
//!   native driver, no file of ours left in the node's `/run`, `/var/run/cdi`
//!   or kubelet's plugin directories.
//! - `dra`: the chart's DRA values: the driver registers and publishes from its
//!   pod, the claim labeller's two replicas share a Lease, a claim's QEMU takes
//!   its NIC, the VM-mode agents beside it are refused by the owner lock.
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
use real_k8s::guest::{self, Guest, VMM};
use real_k8s::proc::wait_for;

#[derive(Parser, Debug)]
#[command(
    name = "guest-node",
    about = "Installs the chart on a real kubelet in the real-kernel test bed and \
        walks a node through VM mode"
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
    /// A static `kubelet-peer` (scripts/build-static.sh): the VM pods run its
    /// `vmm`, QEMU taking their devices.
    #[arg(long, value_name = "FILE")]
    vmm: PathBuf,
    /// The release, v1.<minor>[.<patch>].
    #[arg(long)]
    release: String,
    /// Scratch directory (default: a new one under /dev/shm).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Keep the scratch directory (logs) even when every step passes.
    #[arg(long)]
    keep: bool,
    /// Run only these steps (comma-separated, in the run's order), on a fresh
    /// node: `dra`, `bad-input` and `privileges` start from one; the others
    /// need the steps before them.
    #[arg(long, value_delimiter = ',', value_name = "STEP")]
    steps: Vec<String>,
}

/// The stand-ins the resource list selects (scripts/vm/devices.sh).
const CARD_FN0: &str = "0000:01:00.0";
const CARD_FN1: &str = "0000:01:00.1";
const SOLO_NIC: &str = "0000:02:00.0";
const DEVICES: [&str; 3] = [CARD_FN0, CARD_FN1, SOLO_NIC];
const RESOURCE: &str = "example.com/NIC_PT";
/// The "GPU" the rollout adds to the resource list: a virtio-rng function
/// with an HD-audio companion in its group, as a GPU has.
const GPU_FN0: &str = "0000:04:00.0";
const GPU_AUDIO: &str = "0000:04:00.1";
const GPU_RESOURCE: &str = "example.com/GPU_PT";
/// Every device a step may move, each with its native driver.
const NATIVE: [(&str, &str); 5] = [
    (CARD_FN0, "e1000e"),
    (CARD_FN1, "e1000e"),
    (SOLO_NIC, "e1000e"),
    (GPU_FN0, "virtio-pci"),
    (GPU_AUDIO, "snd_hda_intel"),
];
/// The restore label the chart gives vfio-manager.
/// How long a step that starts or stops a pod in the guest may take before it
/// counts as hung: a hang guard, not a speed check (a pod's start under TCG
/// took up to 145 s beside the suite's builds; the steps' times are printed).
const POD_WAIT: Duration = Duration::from_secs(420);
const RESTORE_LABEL: &str = "vfio-sandbox.rebellions.ai/vfio-manager.restore-pending";
const NS: &str = "vfio-sandbox";
const RELEASE: &str = "vfio-sandbox";
const DRA_NS: &str = "vfio-sandbox-dra";
const DRA_RELEASE: &str = "vfio-sandbox-dra";
/// The label examples/dra.yaml puts the DRA driver on nodes with.
const DRA_LABEL: &str = "rebellions.ai/npu.deploy.sandbox-dra-driver";
/// The class of every device of the driver (files/deviceclasses/rebellions.yaml).
const DRA_CLASS: &str = "vfio-sandbox.rebellions.ai";
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
    /// The group the VM pod holds (the install step starts it).
    vm_group: Option<String>,
    /// The namespace the pod helpers look in: the VM-mode release's, or the
    /// DRA release's during the DRA step.
    ns: &'static str,
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

/// The node's CPU so far, for the log (a failure to read it is said, not fatal).
fn cpu(run: &Run) -> String {
    match run.guest.cpu() {
        Ok(cpu) => format!("CPU so far: {cpu}"),
        Err(e) => format!("CPU so far: cannot tell ({e:#})"),
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
        &cli.vmm,
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
        vm_group: None,
        ns: NS,
        plane,
        guest,
        repo,
        dir: dir.clone(),
    };
    type Step = fn(&mut Run) -> Result<String>;
    let steps: [(&str, Step); 7] = [
        ("install", install),
        ("rollout", rollout),
        ("leave", leave),
        ("uninstall", uninstall),
        ("dra", dra),
        ("bad-input", bad_input),
        ("privileges", privileges),
    ];
    for name in &cli.steps {
        ensure!(
            steps.iter().any(|(n, _)| n == name),
            "--steps: no step {name} (the steps: {})",
            steps.map(|(n, _)| n).join(", ")
        );
    }
    let mut ok = true;
    for (name, step) in steps {
        if !cli.steps.is_empty() && !cli.steps.iter().any(|s| s == name) {
            continue;
        }
        let t = Instant::now();
        let result = step(&mut run).and_then(|note| {
            run.guest.check()?;
            Ok(note)
        });
        let secs = t.elapsed().as_secs_f64();
        match result {
            Ok(note) => println!("PASS {name} ({secs:.1} s)\n     {note}\n     {}", cpu(&run)),
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
    // The node's own logs, beside the control plane's.
    for (command, name) in [
        ("cat /data/state/kubelet.log", "guest-kubelet.log"),
        ("cat /data/state/containerd.log", "guest-containerd.log"),
        ("cat /data/state/kube-proxy.log", "guest-kube-proxy.log"),
        ("tail -n +1 /var/log/pods/*/*/*.log", "guest-pods.log"),
    ] {
        if let Ok((_, text)) = run.guest.sh(command) {
            let _ = std::fs::write(run.plane.logs_dir().join(name), text);
        }
    }
    show(
        "the node's images and kubelet's log",
        run.guest
            .sh(
                "ctr --address=/run/containerd/containerd.sock -n k8s.io images ls -q; \
             grep -E '^E' /data/state/kubelet.log | tail -n 15",
            )
            .map(|(_, out)| out),
    );
    // What kubelet's device manager made of each plugin (--v=2).
    show(
        "kubelet's device-plugin registrations",
        run.guest
            .sh(
                "grep -E 'devicemanager|device plugin|Device plugin|Deregister' \
                 /data/state/kubelet.log | tail -n 30",
            )
            .map(|(_, out)| out),
    );
}

/// What a VM pod's QEMU holds, read from its log.
struct Holding {
    /// The device of its `PCI_RESOURCE_*` variable.
    bdf: String,
    /// That device's IOMMU group.
    group: String,
    /// QEMU's line for the device it realized.
    realized: String,
}

impl Run {
    /// Waits until the QEMU of VM pod `name` (see [`vm_pod`]) holds its device and
    /// checks what the pod was given: the device of its variable named starting
    /// with `var` (`PCI_RESOURCE_*`), exactly that device's group node and
    /// `/dev/vfio/vfio`, and QEMU's realization of the device.
    fn vm_holding(&self, name: &str, var: &str) -> Result<Holding> {
        let log = wait_for(
            &format!("the QEMU of pod {name} to hold its device"),
            // The pod's start, then QEMU's (under TCG twice; it gives up after 360 s).
            2 * POD_WAIT,
            || {
                let log = self.log("default", name, "vmm")?;
                ensure!(
                    !log.contains("QEMU refused") && !log.contains("error:"),
                    "the QEMU of pod {name} failed:\n{log}"
                );
                Ok(log.contains("holding").then_some(log))
            },
        )?;
        let env = log
            .lines()
            .find_map(|l| l.strip_prefix("container: nodes "))
            .with_context(|| format!("pod {name}'s log lists no device nodes:\n{log}"))?;
        let (nodes, env) = env.split_once("; env ").unwrap_or((env, ""));
        let bdf = env
            .split_whitespace()
            .find(|v| v.starts_with(var))
            .and_then(|v| v.split_once('='))
            .map(|(_, v)| v.to_owned())
            .with_context(|| format!("no {var}* variable in pod {name}:\n{log}"))?;
        let group = self.guest.check_sh(&format!(
            "basename $(readlink /sys/bus/pci/devices/{bdf}/iommu_group)"
        ))?;
        let group = group.trim().to_owned();
        ensure!(
            nodes.trim() == format!("/dev/vfio/{group} /dev/vfio/vfio"),
            "pod {name}'s /dev/vfio holds {nodes}, not exactly group {group} of {bdf} and the \
             container node"
        );
        let realized = log
            .lines()
            .find(|l| l.starts_with(&format!("realized {bdf} ")))
            .with_context(|| format!("the QEMU of pod {name} did not realize {bdf}:\n{log}"))?
            .to_owned();
        Ok(Holding {
            bdf,
            group,
            realized,
        })
    }

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
            self.ns,
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
            self.ns,
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

    /// The driver of each device of [`NATIVE`], in its order.
    fn all_drivers(&self) -> Result<Vec<String>> {
        NATIVE.iter().map(|(d, _)| self.guest.driver(d)).collect()
    }

    /// Waits until every device of [`NATIVE`] is on its native driver.
    fn wait_native(&self, limit: Duration) -> Result<()> {
        let native: Vec<&str> = NATIVE.iter().map(|(_, n)| *n).collect();
        wait_for("every device on its native driver", limit, || {
            Ok((self.all_drivers()? == native).then_some(()))
        })
        .with_context(|| {
            format!(
                "drivers of {:?}: {:?}",
                NATIVE.map(|(d, _)| d),
                self.all_drivers().ok()
            )
        })
    }

    /// The node's label `key`, if it has one.
    fn node_label(&self, key: &str) -> Result<Option<String>> {
        let labels = self.kubectl(&["get", "node", NODE, "-o", "jsonpath={.metadata.labels}"])?;
        let labels: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&labels).context("the node's labels")?;
        Ok(labels.get(key).and_then(|v| v.as_str()).map(str::to_owned))
    }

    fn set_workload(&self, value: &str) -> Result<()> {
        self.kubectl(&[
            "label",
            "node",
            NODE,
            &format!("{WORKLOAD}={value}"),
            "--overwrite",
        ])
        .map(drop)
    }

    /// Whether the group of `/dev/vfio/<group>` is open elsewhere: the kernel
    /// answers EBUSY to a second open of a group.
    fn group_busy(&self, group: &str) -> Result<bool> {
        // In a child shell: a failed `exec` redirection ends the shell it runs in.
        let (rc, out) = self
            .guest
            .sh(&format!("sh -c 'exec 3<>/dev/vfio/{group}'"))?;
        if rc == 0 {
            return Ok(false);
        }
        ensure!(
            out.contains("busy"),
            "opening /dev/vfio/{group} failed otherwise: {}",
            out.trim()
        );
        Ok(true)
    }

    fn wait_drivers(&self, want: &str, limit: Duration) -> Result<()> {
        wait_for(&format!("every device on {want}"), limit, || {
            let got = self.drivers()?;
            Ok(got.iter().all(|d| d == want).then_some(()))
        })
        .with_context(|| format!("drivers of {DEVICES:?}: {:?}", self.drivers().ok()))
    }
}

/// A pod named `name` in `default` whose QEMU takes the devices it is given
/// (`kubelet-peer vmm --in-pod`, holding them until the pod is deleted):
/// `resources` is the container's resources block below `resources:`, and
/// `claims` the pod's resourceClaims block (or nothing). QEMU pins the VM's
/// RAM for DMA, which needs IPC_LOCK or a memlock limit that covers it
/// (KubeVirt's virt-handler raises virt-launcher's limit; a pod has the cap).
/// QEMU's tree comes from the node's disk (virt-launcher's image carries its
/// own; importing one that size costs the guest a minute).
fn vm_pod(name: &str, resources: &str, claims: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  \
         terminationGracePeriodSeconds: 30\n  restartPolicy: Never\n{claims}  \
         containers:\n  - name: vmm\n    image: {VMM}\n    imagePullPolicy: Never\n    \
         args: ['vmm', '--in-pod', '--hold', '--memory', '32M', '--timeout', '360s', '--qemu', '{qemu}']\n    \
         securityContext:\n      capabilities:\n        add: [IPC_LOCK]\n    \
         volumeMounts:\n    - {{name: qemu, mountPath: /opt/qemu, readOnly: true}}\n    \
         resources:\n      {resources}\n  \
         volumes:\n  - {{name: qemu, hostPath: {{path: {dir}, type: Directory}}}}\n",
        qemu = guest::VMM_QEMU,
        dir = guest::VMM_QEMU_DIR,
    )
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
    let manager = run.ready_pod("vfio-manager", POD_WAIT)?;
    let bound_secs = t.elapsed().as_secs_f64();
    let drivers = run.drivers()?;
    ensure!(
        drivers.iter().all(|d| d == "vfio-pci"),
        "vfio-manager's pod is Ready but the devices are on {drivers:?}"
    );
    let plugin = run.ready_pod("sandbox-device-plugin", POD_WAIT)?;
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

    // A pod asking for one device, as virt-launcher's would: QEMU in it takes
    // the device of its PCI_RESOURCE_* variable through the group node it was
    // given, and holds it until the pod is deleted.
    run.plane.apply(&vm_pod(
        "vm",
        &format!("limits:\n        {RESOURCE}: 1"),
        "",
    ))?;
    let vm = run.vm_holding("vm", "PCI_RESOURCE_EXAMPLE_COM_NIC_PT")?;
    ensure!(
        DEVICES.contains(&vm.bdf.as_str()),
        "the pod was given {}, not a stand-in",
        vm.bdf
    );
    run.vm_group = Some(vm.group.clone());
    Ok(format!(
        "helm install {helm_secs:.1} s; label to vfio-manager Ready (3 devices on vfio-pci) \
         {bound_secs:.1} s, to the device plugin Ready {plugin_secs:.1} s (its validator printed \
         {waited} lines before passing); allocatable {RESOURCE} 3; the VM pod was given {} \
         and /dev/vfio/{} /dev/vfio/vfio, its QEMU: {}; pods {manager}, {plugin}",
        vm.bdf, vm.group, vm.realized
    ))
}

/// The resource list after the rollout: the NICs as before, and the "GPU".
const ROLLOUT_VALUES: &str = r#"sandboxDevicePlugin:
  resourceList:
    - name: example.com/NIC_PT
      vendor: "8086"
      devices: ["10d3"]
    - name: example.com/GPU_PT
      vendor: "1af4"
      devices: ["1044"]
"#;

fn rollout(run: &mut Run) -> Result<String> {
    let group = run
        .vm_group
        .clone()
        .context("the install step started no VM pod")?;
    // The new release of the image: the same content under a new tag, as a
    // registry would serve it (the node has no registry to pull from).
    let (repo, tag) = run.image.clone();
    let next = format!("{tag}-next");
    run.guest.check_sh(&format!(
        "ctr --address=/run/containerd/containerd.sock -n k8s.io images tag \
            {repo}:{tag} {repo}:{next}"
    ))?;
    let old_manager = run.pods("vfio-manager")?;
    let old_plugin = run.pods("sandbox-device-plugin")?;
    let values = run.dir.join("rollout-values.yaml");
    std::fs::write(&values, ROLLOUT_VALUES)?;
    let t = Instant::now();
    run.plane
        .helm(&[
            "upgrade",
            RELEASE,
            path_str(&run.chart()),
            "--namespace",
            NS,
            "--reuse-values",
            "-f",
            path_str(&values),
            "--set",
            &format!("image.tag={next}"),
        ])
        .context("helm upgrade")?;
    // Until both DaemonSets report the new pods available, every NIC stays on
    // vfio-pci (sampled as fast as the guest's shell answers) and the VM
    // pod's group stays open.
    let mut samples = 0;
    let mut manager_ready = None;
    let mut available = None;
    // When the look before the one that first saw the new pod Ready began: it
    // was not Ready then, so it became Ready after this (each look takes
    // seconds on a loaded guest, so the look that saw it is no bound).
    let mut last_look = t.elapsed();
    let image = format!("{repo}:{next}");
    wait_for("the rollout of both DaemonSets", 2 * POD_WAIT, || {
        let look = t.elapsed();
        let drivers = run.drivers()?;
        samples += 1;
        ensure!(
            drivers.iter().all(|d| d == "vfio-pci"),
            "during the rollout a NIC left vfio-pci: {drivers:?} ({DEVICES:?})"
        );
        let status = run.kubectl(&[
            "get",
            "daemonsets",
            "-n",
            NS,
            "-o",
            "jsonpath={range .items[*]}{.metadata.name}={.status.updatedNumberScheduled}/\
             {.status.numberAvailable}/{.status.desiredNumberScheduled} {end}",
        ])?;
        if manager_ready.is_none() {
            for pod in run.pods("vfio-manager")? {
                let (ready, img) = (
                    run.pod_field(&pod, "{.status.conditions[?(@.type==\"Ready\")].status}")?,
                    run.pod_field(&pod, "{.spec.containers[0].image}")?,
                );
                if ready == "True" && img == image {
                    manager_ready = Some(last_look);
                }
            }
        }
        last_look = look;
        let vfio_manager_done = status
            .split_whitespace()
            .any(|s| s.starts_with("vfio-manager=") && s.ends_with("=1/1/1"));
        if vfio_manager_done && available.is_none() {
            available = Some(t.elapsed());
        }
        let all_done = status.split_whitespace().all(|s| s.ends_with("=1/1/1"));
        Ok(all_done.then_some(()))
    })?;
    let rolled = t.elapsed().as_secs_f64();
    let new_manager = run.pods("vfio-manager")?;
    let new_plugin = run.pods("sandbox-device-plugin")?;
    ensure!(
        new_manager.iter().all(|p| !old_manager.contains(p))
            && new_plugin.iter().all(|p| !old_plugin.contains(p)),
        "the rollout kept an old pod: vfio-manager {old_manager:?} -> {new_manager:?}, \
         plugin {old_plugin:?} -> {new_plugin:?}"
    );
    for pod in new_manager.iter().chain(&new_plugin) {
        let img = run.pod_field(pod, "{.spec.containers[0].image}")?;
        ensure!(img == image, "pod {pod} runs {img}, not {image}");
    }
    let (ready, available) = (
        manager_ready.context("vfio-manager's new pod was never seen Ready")?,
        available.context("vfio-manager's DaemonSet was never seen available")?,
    );
    // minReadySeconds (10 s in the chart's values): the DaemonSet counts the new
    // pod available only that long after it is Ready. Both ends are bounds from
    // looks: it was Ready after `ready` and counted available before
    // `available`, so a DaemonSet that held it back shows at least 10 s here;
    // one that did not, about two looks. A second is left for the kubelet's
    // Ready time, which the DaemonSet controller reads, coming from the guest's
    // clock.
    let held_back = available.saturating_sub(ready).as_secs_f64();
    ensure!(
        held_back >= 9.0,
        "vfio-manager's DaemonSet counted its new pod available at most {held_back:.1} s after \
         Ready (minReadySeconds is 10)"
    );
    // The VM pod: still running, still holding its group.
    let phase = run.kubectl(&[
        "get",
        "pod",
        "vm",
        "-n",
        "default",
        "-o",
        "jsonpath={.status.phase}/{.status.containerStatuses[0].restartCount}",
    ])?;
    ensure!(
        phase == "Running/0",
        "the VM pod is {phase} after the rollout"
    );
    ensure!(
        run.group_busy(&group)?,
        "the VM pod's group {group} is no longer held after the rollout"
    );
    // The new list: the "GPU" and its audio companion bound, both resources
    // registered by the new plugin.
    for (bdf, what) in [(GPU_FN0, "the GPU"), (GPU_AUDIO, "its audio companion")] {
        let driver = run.guest.driver(bdf)?;
        ensure!(
            driver == "vfio-pci",
            "{what} {bdf} is on {driver} after the rollout"
        );
    }
    wait_for(
        &format!("allocatable {RESOURCE} = 3 and {GPU_RESOURCE} = 1"),
        Duration::from_secs(120),
        || {
            let gpu = run.kubectl(&[
                "get",
                "node",
                NODE,
                "-o",
                &format!(
                    "jsonpath={{.status.allocatable.{}}}",
                    GPU_RESOURCE.replace('.', "\\.")
                ),
            ])?;
            Ok((run.allocatable()? == "3" && gpu == "1").then_some(()))
        },
    )?;
    Ok(format!(
        "helm upgrade (tag {next}, {GPU_RESOURCE} added) to both DaemonSets rolled: {rolled:.1} s; \
         vfio-manager's new pod Ready after {:.1} s, counted available at most {held_back:.1} s \
         later; \
         the NICs on vfio-pci in all {samples} samples; the VM pod's group {group} held throughout; \
         {GPU_FN0} and {GPU_AUDIO} on vfio-pci; pods {} and {}",
        ready.as_secs_f64(),
        new_manager.join(","),
        new_plugin.join(","),
    ))
}

/// The node leaves VM mode while the VM pod runs: vfio-manager's pod stays
/// through its restore label, puts back what is free, waits for the held
/// group (killed with SIGKILL while it waits, and restarted by kubelet), and
/// once the VM pod is gone puts back the rest, removes the label and only
/// then is removed by the DaemonSet controller.
fn leave(run: &mut Run) -> Result<String> {
    let group = run
        .vm_group
        .clone()
        .context("the install step started no VM pod")?;
    ensure!(
        run.node_label(RESTORE_LABEL)?.as_deref() == Some("true"),
        "vfio-manager did not label the node with {RESTORE_LABEL} while it holds devices"
    );
    let manager = run.ready_pod("vfio-manager", Duration::from_secs(10))?;
    let held: Vec<String> = run
        .guest
        .check_sh(&format!("ls /sys/kernel/iommu_groups/{group}/devices"))?
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let t = Instant::now();
    run.set_workload("container")?;
    // What is free goes back; the held group stays.
    wait_for("every free device back", Duration::from_secs(120), || {
        let drivers = run.all_drivers()?;
        let free_back = NATIVE
            .iter()
            .zip(&drivers)
            .all(|((bdf, native), got)| held.iter().any(|h| h == bdf) || got == native);
        Ok(free_back.then_some(()))
    })?;
    let free_secs = t.elapsed().as_secs_f64();
    for bdf in &held {
        let driver = run.guest.driver(bdf)?;
        ensure!(
            driver == "vfio-pci",
            "held {bdf} left vfio-pci under the VM: {driver}"
        );
    }
    ensure!(
        run.pods("vfio-manager")? == [manager.clone()],
        "vfio-manager's pod did not stay while the group is held: {:?}",
        run.pods("vfio-manager")?
    );
    wait_for(
        "the device plugin's pod gone",
        Duration::from_secs(120),
        || Ok(run.pods("sandbox-device-plugin")?.is_empty().then_some(())),
    )?;

    // SIGKILL mid-restore: kubelet restarts the container in the same pod.
    let restarts = |run: &Run| -> Result<u32> {
        Ok(run
            .pod_field(&manager, "{.status.containerStatuses[0].restartCount}")?
            .trim()
            .parse()
            .unwrap_or(0))
    };
    let before = restarts(run)?;
    run.guest.check_sh("kill -9 $(pidof vfio-manager)")?;
    wait_for(
        "kubelet to restart vfio-manager",
        Duration::from_secs(120),
        || {
            let ready = run.pod_field(&manager, "{.status.containerStatuses[0].started}")?;
            Ok((restarts(run)? > before && ready == "true").then_some(()))
        },
    )?;
    for bdf in &held {
        let driver = run.guest.driver(bdf)?;
        ensure!(
            driver == "vfio-pci",
            "held {bdf} left vfio-pci after the kill: {driver}"
        );
    }
    ensure!(
        run.group_busy(&group)?,
        "the VM pod's group {group} is no longer held"
    );

    // The VM goes; the rest comes back, then the label, then the pod.
    let t = Instant::now();
    run.kubectl(&["delete", "pod", "vm", "-n", "default", "--wait=true"])?;
    run.vm_group = None;
    let mut label_gone = None;
    wait_for("vfio-manager's pod removed", POD_WAIT, || {
        let label = run.node_label(RESTORE_LABEL)?;
        let pods = run.pods("vfio-manager")?;
        if label.is_none() && label_gone.is_none() {
            label_gone = Some(t.elapsed());
            let drivers = run.all_drivers()?;
            let native: Vec<&str> = NATIVE.iter().map(|(_, n)| *n).collect();
            ensure!(
                drivers == native,
                "the restore label went before every device was back: {drivers:?}"
            );
        }
        if pods.is_empty() {
            ensure!(
                label_gone.is_some(),
                "vfio-manager's pod went while the node still has {RESTORE_LABEL}"
            );
            return Ok(Some(()));
        }
        Ok(None)
    })?;
    let gone_secs = t.elapsed().as_secs_f64();
    run.wait_native(Duration::from_secs(5))?;
    let ready_file = run
        .guest
        .sh("ls /run/vfio-sandbox/validations/vfio-pci-ready")?;
    ensure!(
        ready_file.0 != 0,
        "the validator's ready file is still there"
    );
    wait_for(
        &format!("allocatable {RESOURCE} = 0"),
        Duration::from_secs(120),
        || {
            let a = run.allocatable()?;
            ensure!(a.is_empty() || a == "0", "allocatable {RESOURCE} is {a}");
            Ok(Some(()))
        },
    )?;
    Ok(format!(
        "label to free devices back {free_secs:.1} s; {manager} kept while group {group} \
         ({}) held, SIGKILLed mid-restore and restarted in place; VM pod deleted to every \
         device back and {RESTORE_LABEL} removed {:.1} s, to the pod removed {gone_secs:.1} s; \
         no ready file; allocatable {RESOURCE} 0",
        held.join(" "),
        label_gone.unwrap_or_default().as_secs_f64(),
    ))
}

fn uninstall(run: &mut Run) -> Result<String> {
    // The node back in VM mode (the leave step took it out), every device
    // bound, no VM running.
    run.kubectl(&[
        "delete",
        "pod",
        "vm",
        "-n",
        "default",
        "--ignore-not-found",
        "--wait=true",
    ])?;
    run.set_workload("vm-passthrough")?;
    run.ready_pod("vfio-manager", POD_WAIT)?;
    // The NICs at least (the "GPU" too when the rollout step ran before).
    let drivers = run.drivers()?;
    ensure!(
        drivers.iter().all(|d| d == "vfio-pci"),
        "vfio-manager's pod is Ready but the NICs are on {drivers:?}"
    );
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
    let secs = t.elapsed().as_secs_f64();
    // The chart's pre-delete hook (`vfio-manager uninstall`) deleted the
    // DaemonSet first and waited for its pod, whose account still worked: by
    // the time helm returns, every device is back and the restore label gone.
    let drivers = run.all_drivers()?;
    let native: Vec<&str> = NATIVE.iter().map(|(_, n)| *n).collect();
    ensure!(
        drivers == native,
        "helm uninstall returned with the devices on {drivers:?}"
    );
    ensure!(
        run.node_label(RESTORE_LABEL)?.is_none(),
        "helm uninstall returned with {RESTORE_LABEL} still on the Node"
    );
    wait_for("the agents' pods gone", POD_WAIT, || {
        Ok(
            (run.pods("vfio-manager")?.is_empty() && run.pods("sandbox-device-plugin")?.is_empty())
                .then_some(()),
        )
    })?;
    let hook = run.kubectl(&[
        "get",
        "job,serviceaccount,role,rolebinding",
        "-n",
        NS,
        "-o",
        "name",
    ])?;
    ensure!(
        hook.trim().is_empty() || !hook.contains("uninstall"),
        "the pre-delete hook's objects stayed: {hook}"
    );
    let kept = leftovers(run, "helm uninstall")?;
    Ok(format!(
        "helm uninstall (its pre-delete hook waiting for vfio-manager's pod) to every device \
         back on its native driver and {RESTORE_LABEL} removed: {secs:.1} s; left on the \
         node: {kept}"
    ))
}

/// The early move of KEP-5007 with the real kube-scheduler: the device, on its
/// native driver when allocated, was published with the driver's binding
/// conditions, the scheduler copied them into the claim's allocation, the driver
/// moved the group and set `VfioReady`, and only then was the pod bound
/// (PreBind waits for it): the API server's audit log has the driver's status
/// write done before the scheduler's binding arrived.
fn early_move(run: &Run, pod: &str) -> Result<String> {
    let pod_json = run.plane.get_json(&["get", "pod", pod, "-n", "default"])?;
    let claim = pod_json["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        .as_str()
        .with_context(|| format!("pod {pod} names no ResourceClaim: {}", pod_json["status"]))?
        .to_owned();
    let claim_json = run
        .plane
        .get_json(&["get", "resourceclaim", &claim, "-n", "default"])?;
    let ready = format!("{DRA_CLASS}/VfioReady");
    let result = &claim_json["status"]["allocation"]["devices"]["results"][0];
    ensure!(
        result["bindingConditions"] == serde_json::json!([ready]),
        "claim {claim} was allocated without the binding condition {ready}: {result}"
    );
    let ready_true = claim_json["status"]["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|d| d["conditions"].as_array().into_iter().flatten())
        .any(|c| c["type"] == ready.as_str() && c["status"] == "True");
    ensure!(
        ready_true,
        "claim {claim} has no {ready} True in its status.devices: {}",
        claim_json["status"]["devices"]
    );
    // The driver's first write of the claim's status and the pod's binding,
    // as the API server's audit log has them (one clock, microseconds).
    let audit = std::fs::read_to_string(run.plane.audit_log())?;
    let events: Vec<serde_json::Value> = audit
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let ready_at = events
        .iter()
        .find(|e| {
            let o = &e["objectRef"];
            o["resource"] == "resourceclaims"
                && o["subresource"] == "status"
                && o["name"] == claim.as_str()
                && e["responseStatus"]["code"] == 200
                && e["user"]["username"]
                    .as_str()
                    .is_some_and(|u| u.ends_with(":sandbox-dra-driver"))
        })
        .and_then(|e| e["stageTimestamp"].as_str())
        .with_context(|| {
            format!("the audit log has no status write of claim {claim} by the driver")
        })?
        .to_owned();
    let bound_at = events
        .iter()
        .find(|e| {
            let o = &e["objectRef"];
            o["resource"] == "pods"
                && o["subresource"] == "binding"
                && o["name"] == pod
                && e["responseStatus"]["code"] == 201
        })
        .and_then(|e| e["requestReceivedTimestamp"].as_str())
        .with_context(|| format!("the audit log has no binding of pod {pod}"))?
        .to_owned();
    ensure!(
        ready_at < bound_at,
        "claim {claim}: the driver wrote {ready} at {ready_at}, after the scheduler \
            bound pod {pod} at {bound_at}"
    );
    Ok(format!(
        "moved before binding (claim {claim} allocated with {ready}, its status written at \
         {ready_at}, the pod bound at {bound_at})"
    ))
}

/// The DRA shape on the same node: the driver's pod registers with kubelet
/// and publishes the stand-ins; a claim's pod gets its device moved on the
/// real kernel and back when it goes; the claim labeller runs as the chart's
/// Deployment of two replicas under one Lease; the VM-mode agents installed
/// on that node too are refused by the owner lock and move nothing.
fn dra(run: &mut Run) -> Result<String> {
    run.kubectl(&["label", "node", NODE, &format!("{WORKLOAD}-")])?;
    let chart = run.chart();
    let values = run.dir.join("guest-values.yaml");
    std::fs::write(&values, VALUES)?;
    let t = Instant::now();
    run.plane
        .helm(&[
            "install",
            DRA_RELEASE,
            path_str(&chart),
            "--namespace",
            DRA_NS,
            "--create-namespace",
            "-f",
            path_str(&chart.join("examples/dra.yaml")),
            "-f",
            path_str(&values),
            "--set",
            &format!("image.repository={}", run.image.0),
            "--set",
            &format!("image.tag={}", run.image.1),
        ])
        .context("helm install of the DRA values")?;
    run.ns = DRA_NS;
    let result = dra_steps(run, t);
    run.ns = NS;
    let note = result?;
    // The claim gone, the release uninstalled: nothing of ours left.
    let t = Instant::now();
    run.plane
        .helm(&[
            "uninstall",
            DRA_RELEASE,
            "--namespace",
            DRA_NS,
            "--wait",
            "--timeout",
            "5m",
        ])
        .context("helm uninstall of the DRA release")?;
    run.kubectl(&["label", "node", NODE, &format!("{DRA_LABEL}-")])?;
    wait_for(
        "the DRA driver's pod gone",
        Duration::from_secs(120),
        || {
            let pods = run.kubectl(&["get", "pods", "-n", DRA_NS, "-o", "name"])?;
            Ok(pods.trim().is_empty().then_some(()))
        },
    )?;
    run.wait_native(Duration::from_secs(10))?;
    let kept = leftovers(run, "helm uninstall of the DRA release")?;
    Ok(format!(
        "{note}; helm uninstall to its pods gone {:.1} s, left on the node: {kept}",
        t.elapsed().as_secs_f64()
    ))
}

fn dra_steps(run: &mut Run, t: Instant) -> Result<String> {
    run.kubectl(&[
        "label",
        "node",
        NODE,
        &format!("{DRA_LABEL}=true"),
        "--overwrite",
    ])?;
    let driver = run.ready_pod("sandbox-dra-driver", POD_WAIT)?;
    let driver_secs = t.elapsed().as_secs_f64();
    // Registered from its pod: kubelet has its socket and the slices name the
    // node's stand-ins.
    let (published, device_count) = wait_for(
        "the node's ResourceSlices to list the stand-ins",
        Duration::from_secs(120),
        || {
            let slices = run.plane.get_json(&["get", "resourceslices"])?;
            let mut addresses = Vec::new();
            for slice in slices["items"].as_array().into_iter().flatten() {
                if slice["spec"]["nodeName"] != NODE {
                    continue;
                }
                for device in slice["spec"]["devices"].as_array().into_iter().flatten() {
                    if let Some(a) =
                        device["attributes"]["resource.kubernetes.io/pciBusID"]["string"].as_str()
                    {
                        addresses.push(a.to_owned());
                    }
                }
            }
            // A group of several functions is offered as its functions and as
            // one device for the whole group, named by its lowest function.
            let devices = addresses.len();
            addresses.sort();
            addresses.dedup();
            Ok((addresses == DEVICES).then_some((addresses, devices)))
        },
    )?;
    let sockets = run.guest.check_sh("ls /var/lib/kubelet/plugins_registry")?;
    ensure!(
        sockets.contains(DRA_CLASS),
        "no registration socket of {DRA_CLASS} in kubelet's plugins_registry: {sockets}"
    );
    // The labeller: two replicas of the image, one holding the Lease.
    let lease = wait_for(
        "the claim labeller's two replicas and its Lease",
        POD_WAIT,
        || {
            let ready = run.kubectl(&[
                "get",
                "deployment",
                "sandbox-dra-controller",
                "-n",
                DRA_NS,
                "-o",
                "jsonpath={.status.readyReplicas}",
            ])?;
            let holder = run
                .kubectl(&[
                    "get",
                    "lease",
                    "sandbox-dra-controller",
                    "-n",
                    DRA_NS,
                    "-o",
                    "jsonpath={.spec.holderIdentity}",
                ])
                .unwrap_or_default();
            Ok((ready == "2" && !holder.is_empty()).then_some(holder))
        },
    )?;
    let replicas = run.pods("sandbox-dra-controller")?;
    ensure!(
        replicas.len() == 2 && replicas.iter().any(|p| lease.contains(p.as_str())),
        "the Lease is held by {lease}, not one of the replicas {replicas:?}"
    );

    // A claim's pod: the lone NIC, moved for it and back after it.
    run.plane.apply(&format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata:\n  name: nic\n  \
         namespace: default\nspec:\n  spec:\n    devices:\n      requests:\n      - name: nic\n        \
         exactly:\n          deviceClassName: {DRA_CLASS}\n          selectors:\n          - cel:\n              \
         expression: device.attributes[\"resource.kubernetes.io\"].pciBusID == \"{SOLO_NIC}\"\n"
    ))?;
    let t = Instant::now();
    run.plane.apply(&vm_pod(
        "claim-vm",
        "claims:\n      - name: nic",
        "  resourceClaims:\n  - name: nic\n    resourceClaimTemplateName: nic\n",
    ))?;
    let vm = run.vm_holding("claim-vm", "PCI_RESOURCE_")?;
    let started_secs = t.elapsed().as_secs_f64();
    ensure!(
        vm.bdf == SOLO_NIC,
        "the claim's pod was given {}, not {SOLO_NIC}",
        vm.bdf
    );
    let (group, realized) = (vm.group, vm.realized);
    let early = early_move(run, "claim-vm")?;
    let drivers = run.drivers()?;
    ensure!(
        drivers == ["e1000e", "e1000e", "vfio-pci"],
        "with the claim prepared, {DEVICES:?} are on {drivers:?}"
    );

    // The VM-mode agents of another release, put on the node by their own
    // deploy label (which the DRA driver does not avoid): vfio-manager is
    // refused by the owner lock and moves nothing.
    run.plane
        .helm(&[
            "install",
            "vfio-sandbox-vm",
            path_str(&run.chart()),
            "--namespace",
            NS,
            "--create-namespace",
            "-f",
            path_str(&run.dir.join("guest-values.yaml")),
            "--set",
            "nodeSelection.by=deploy",
            "--set",
            "nodeSelection.deployLabelPrefix=example.com/vm-mode",
            "--set",
            &format!("image.repository={}", run.image.0),
            "--set",
            &format!("image.tag={}", run.image.1),
        ])
        .context("helm install of the VM-mode agents beside the DRA driver")?;
    run.kubectl(&[
        "label",
        "node",
        NODE,
        "example.com/vm-mode.vfio-manager=true",
    ])?;
    run.ns = NS;
    let refusal = wait_for("vfio-manager's refusal", POD_WAIT, || {
        for pod in run.pods("vfio-manager")? {
            let log = run.log(NS, &pod, "vfio-manager")?;
            if let Some(line) = log
                .lines()
                .find(|l| l.contains("owns the devices of this node"))
            {
                return Ok(Some(line.trim().to_owned()));
            }
        }
        Ok(None)
    });
    let refusal = refusal.and_then(|line| {
        ensure!(
            line.contains("sandbox-dra-driver"),
            "vfio-manager's refusal does not name the owner: {line}"
        );
        let drivers = run.drivers()?;
        ensure!(
            drivers == ["e1000e", "e1000e", "vfio-pci"],
            "after vfio-manager's refusal {DEVICES:?} are on {drivers:?}"
        );
        Ok(line)
    });
    run.kubectl(&["label", "node", NODE, "example.com/vm-mode.vfio-manager-"])?;
    run.plane
        .helm(&[
            "uninstall",
            "vfio-sandbox-vm",
            "--namespace",
            NS,
            "--wait",
            "--timeout",
            "5m",
        ])
        .context("helm uninstall of the refused VM-mode agents")?;
    run.ns = DRA_NS;
    let refusal = refusal?;

    let t = Instant::now();
    run.kubectl(&["delete", "pod", "claim-vm", "-n", "default", "--wait=true"])?;
    run.wait_drivers("e1000e", Duration::from_secs(120))?;
    let back_secs = t.elapsed().as_secs_f64();
    run.kubectl(&["delete", "resourceclaimtemplate", "nic", "-n", "default"])?;
    Ok(format!(
        "helm install and label to the driver's pod {driver} Ready {driver_secs:.1} s, \
         publishing {device_count} devices of {}; the labeller's 2 replicas Ready, Lease held by {lease}; a claim's pod \
         started with /dev/vfio/{group}, {SOLO_NIC} on vfio-pci and its QEMU holding it in \
         {started_secs:.1} s ({realized}); {early}, \
         back on e1000e {back_secs:.1} s after its deletion; the VM-mode agents beside it \
         refused: {refusal}",
        published.join(" ")
    ))
}

/// What an uninstall leaves on the node, as a note; fails on anything of ours
/// beyond the lock files and a state file that records no device.
fn leftovers(run: &Run, after: &str) -> Result<String> {
    // What stays: the directories kubelet made for the host paths
    // (DirectoryOrCreate, kept as for every DaemonSet), the two lock files and
    // vfio-manager's state file, which after a full restore records nothing.
    // No socket, no CDI spec, no ready file, no device in a record, and no
    // termination-message file in the node's /dev (which our containers mount).
    let left = run.guest.check_sh(
        "find /run/vfio-manager /run/vfio-sandbox /run/sandbox-dra-driver /var/run/cdi \\
         /dev/termination-log /var/lib/kubelet/plugins /var/lib/kubelet/plugins_registry \\
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
                    "{file} still records devices after {after}:\n{text}"
                );
                kept.push(format!("{file} (no device)"));
            }
            _ => bail!("{file} left on the node after {after}"),
        }
    }
    Ok(if kept.is_empty() {
        "nothing".to_owned()
    } else {
        kept.join(", ")
    })
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
    // The node in VM mode (the DRA step left it without the label).
    run.set_workload("vm-passthrough")?;
    run.install(&values)
        .context("helm install with overlapping entries")?;
    let (pod, code) = wait_for("vfio-manager's container to exit", POD_WAIT, || {
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
    })?;
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
    let phase = wait_for(&format!("pod {name} to end"), POD_WAIT, || {
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
    })?;
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
