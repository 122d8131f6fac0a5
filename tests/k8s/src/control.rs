//! A one-node control plane on loopback: etcd, kube-apiserver (RBAC and Node
//! authorization, ServiceAccount tokens), kube-controller-manager (each
//! controller with its own ServiceAccount, as kubeadm runs it) and
//! kube-scheduler, from one release's binaries.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::pki::{kubeconfig, Pki};
use crate::proc::{free_port, run, wait_for, Proc};

/// Which feature gates the cluster runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gates {
    /// The release's defaults.
    Defaults,
    /// The DRA gates this project's features need turned on, where the release
    /// has them off by default (1.34: binding conditions, device taints,
    /// extended resources on DRA, device health in pod status, partitionable
    /// devices).
    Features,
}

/// A release, as `v1.<minor>`.
#[derive(Clone, Copy, Debug)]
pub struct Release {
    /// The minor version.
    pub minor: u32,
}

impl Release {
    /// `v1.<minor>[.<patch>]`.
    pub fn parse(text: &str) -> Result<Self> {
        let minor = text
            .strip_prefix("v1.")
            .and_then(|m| m.split('.').next())
            .and_then(|m| m.parse().ok())
            .with_context(|| format!("release {text:?}: expected v1.<minor>"))?;
        Ok(Self { minor })
    }
}

/// The gates turned on for `gates` on `release`, for the control plane's
/// components (`control`) or kubelet.
pub fn feature_gates(release: Release, gates: Gates, kubelet: bool) -> Vec<&'static str> {
    if gates == Gates::Defaults || release.minor >= 36 {
        return Vec::new();
    }
    if kubelet {
        vec!["DRAExtendedResource", "ResourceHealthStatus"]
    } else {
        vec![
            "DRADeviceBindingConditions",
            "DRADeviceTaints",
            "DRAExtendedResource",
            "DRAPartitionableDevices",
            "ResourceHealthStatus",
        ]
    }
}

fn gate_flag(names: &[&str]) -> Vec<String> {
    if names.is_empty() {
        return Vec::new();
    }
    let list: Vec<String> = names.iter().map(|n| format!("{n}=true")).collect();
    vec![format!("--feature-gates={}", list.join(","))]
}

/// A guest node's address of the host's loopback (QEMU's user network).
pub const HOST_FROM_GUEST: &str = "10.0.2.2";

/// The static tokens: the harness's admin, the controller manager, the
/// scheduler, the node's kubelet and kube-proxy.
pub const ADMIN_TOKEN: &str = "admin-token-for-tests";
const KCM_TOKEN: &str = "kcm-token-for-tests";
const SCHEDULER_TOKEN: &str = "scheduler-token-for-tests";
/// The node's kubelet's static token (`system:node:<node>` in `system:nodes`).
pub const KUBELET_TOKEN: &str = "kubelet-token-for-tests";
/// kube-proxy's, as `system:kube-proxy` (bound to `system:node-proxier` by the
/// server's bootstrap policy).
pub const KUBE_PROXY_TOKEN: &str = "kube-proxy-token-for-tests";

/// The release's binaries the run needs, in `--k8s-bins`.
pub const BINARIES: [&str; 6] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kubectl",
];

/// etcd, kube-apiserver, kube-controller-manager and kube-scheduler, running;
/// each stopped when this is dropped.
#[allow(missing_docs)]
pub struct ControlPlane {
    /// The release's binaries.
    pub bins: PathBuf,
    /// Its scratch directory (data, keys, logs).
    pub dir: PathBuf,
    /// `https://127.0.0.1:<port>`.
    pub server: String,
    /// Its keys.
    pub pki: Pki,
    /// The admin's kubeconfig (`system:masters`).
    pub admin: PathBuf,
    pub release: Release,
    /// The gates it runs with.
    pub gates: Gates,
    /// The node whose kubelet has a token.
    pub node: String,
    /// helm (scripts/build-k8s.sh helm), for the chart.
    pub helm: Option<PathBuf>,
    // Stopped in reverse order of start (fields drop in declaration order).
    scheduler: Option<Proc>,
    kcm: Option<Proc>,
    apiserver: Proc,
    etcd: Proc,
}

impl ControlPlane {
    /// Starts the control plane of the binaries in `bins` in `dir`, with a
    /// static token for kubelet on `node`, and waits until it serves.
    pub fn start(
        bins: &Path,
        dir: &Path,
        release: Release,
        gates: Gates,
        node: &str,
    ) -> Result<Self> {
        let logs = dir.join("logs");
        std::fs::create_dir_all(&logs)?;
        let pki = Pki::create(&dir.join("pki"))?;

        let (client, peer) = (free_port()?, free_port()?);
        let mut etcd = Command::new(bins.join("etcd"));
        etcd.args(["--name", "default"])
            .arg(format!("--data-dir={}", dir.join("etcd").display()))
            .arg(format!("--listen-client-urls=http://127.0.0.1:{client}"))
            .arg(format!("--advertise-client-urls=http://127.0.0.1:{client}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
            ))
            .arg(format!("--initial-cluster=default=http://127.0.0.1:{peer}"))
            .arg("--unsafe-no-fsync")
            .arg("--log-level=warn");
        let etcd = Proc::spawn("etcd", etcd, &logs)?;

        let tokens = dir.join("tokens.csv");
        std::fs::write(
            &tokens,
            format!(
                "{ADMIN_TOKEN},admin,admin,\"system:masters\"\n\
                 {KCM_TOKEN},system:kube-controller-manager,kcm\n\
                 {SCHEDULER_TOKEN},system:kube-scheduler,scheduler\n\
                 {KUBELET_TOKEN},system:node:{node},kubelet,\"system:nodes\"\n\
                 {KUBE_PROXY_TOKEN},system:kube-proxy,kube-proxy\n"
            ),
        )?;
        // Every request of the drivers' ServiceAccounts, so a refusal names the
        // verb and resource the shipped RBAC lacks; and the scheduler's pod
        // bindings, so a scenario can order a binding after a driver's write.
        let audit_policy = dir.join("audit-policy.yaml");
        std::fs::write(
            &audit_policy,
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n\
             - level: Metadata\n  userGroups: [\"system:serviceaccounts:vfio-sandbox-dra\", \"system:serviceaccounts:vfio-sandbox\"]\n\
             - level: Metadata\n  users: [\"system:kube-scheduler\"]\n  resources: [{group: \"\", resources: [\"pods/binding\"]}]\n\
             - level: None\n",
        )?;
        let port = free_port()?;
        let server = format!("https://127.0.0.1:{port}");
        let control_gates = gate_flag(&feature_gates(release, gates, false));
        let mut apiserver = Command::new(bins.join("kube-apiserver"));
        apiserver
            .arg(format!("--etcd-servers=http://127.0.0.1:{client}"))
            .arg(format!("--cert-dir={}", dir.join("apiserver").display()))
            .arg(format!("--tls-cert-file={}", pki.serving_cert.display()))
            .arg(format!(
                "--tls-private-key-file={}",
                pki.serving_key.display()
            ))
            .arg(format!("--client-ca-file={}", pki.ca.display()))
            .arg(format!("--secure-port={port}"))
            // The `kubernetes` Service's endpoint, which may not be a loopback
            // address: the one a guest node reaches the host's loopback at
            // (QEMU's user network), where its kube-proxy sends pods that use
            // their in-cluster configuration.
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--advertise-address={HOST_FROM_GUEST}"))
            .arg("--service-cluster-ip-range=10.96.0.0/24")
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg(format!(
                "--service-account-key-file={}",
                pki.sa_pub.display()
            ))
            .arg(format!(
                "--service-account-signing-key-file={}",
                pki.sa_key.display()
            ))
            .arg("--authorization-mode=Node,RBAC")
            .arg(format!("--token-auth-file={}", tokens.display()))
            .arg("--anonymous-auth=false")
            .arg("--allow-privileged=true")
            .arg(format!("--audit-policy-file={}", audit_policy.display()))
            .arg(format!(
                "--audit-log-path={}",
                dir.join("audit.log").display()
            ))
            .arg("--v=1")
            .args(&control_gates);
        if !control_gates.is_empty() {
            // DRADeviceTaints makes the scheduler and the controller manager
            // watch DeviceTaintRules, an alpha API (resource.k8s.io/v1alpha3)
            // the server serves only when asked; without it the scheduler
            // waits for that informer and schedules nothing.
            apiserver.arg("--runtime-config=resource.k8s.io/v1alpha3=true");
        }
        let apiserver = Proc::spawn("kube-apiserver", apiserver, &logs)?;

        let admin = dir.join("admin.kubeconfig");
        kubeconfig(&admin, &server, &pki.ca, ADMIN_TOKEN)?;
        let mut plane = Self {
            bins: bins.to_owned(),
            dir: dir.to_owned(),
            server,
            pki,
            admin,
            release,
            gates,
            node: node.to_owned(),
            helm: None,
            scheduler: None,
            kcm: None,
            apiserver,
            etcd,
        };
        wait_for("kube-apiserver /readyz", Duration::from_secs(90), || {
            plane.etcd.check()?;
            plane.apiserver.check()?;
            Ok(plane
                .kubectl(&["get", "--raw", "/readyz"])
                .ok()
                .filter(|out| out.trim() == "ok"))
        })?;

        let kcm_config = dir.join("kcm.kubeconfig");
        kubeconfig(&kcm_config, &plane.server, &plane.pki.ca, KCM_TOKEN)?;
        let mut kcm = Command::new(bins.join("kube-controller-manager"));
        kcm.arg(format!("--kubeconfig={}", kcm_config.display()))
            .arg(format!(
                "--authentication-kubeconfig={}",
                kcm_config.display()
            ))
            .arg(format!(
                "--authorization-kubeconfig={}",
                kcm_config.display()
            ))
            .arg("--use-service-account-credentials=true")
            .arg(format!(
                "--service-account-private-key-file={}",
                plane.pki.sa_key.display()
            ))
            .arg(format!("--root-ca-file={}", plane.pki.ca.display()))
            .args(["--bind-address=127.0.0.1", "--secure-port=0"])
            .arg("--leader-elect=false")
            .arg("--v=1")
            .args(&control_gates);
        plane.kcm = Some(Proc::spawn("kube-controller-manager", kcm, &logs)?);

        let scheduler_config = dir.join("scheduler.kubeconfig");
        kubeconfig(
            &scheduler_config,
            &plane.server,
            &plane.pki.ca,
            SCHEDULER_TOKEN,
        )?;
        let mut scheduler = Command::new(bins.join("kube-scheduler"));
        scheduler
            .arg(format!("--kubeconfig={}", scheduler_config.display()))
            .arg(format!(
                "--authentication-kubeconfig={}",
                scheduler_config.display()
            ))
            .arg(format!(
                "--authorization-kubeconfig={}",
                scheduler_config.display()
            ))
            .args(["--bind-address=127.0.0.1", "--secure-port=0"])
            .arg("--leader-elect=false")
            .arg("--v=2")
            .args(&control_gates);
        plane.scheduler = Some(Proc::spawn("kube-scheduler", scheduler, &logs)?);
        // The controller manager's ServiceAccounts (one per controller) and the
        // default namespace's show that it runs.
        wait_for(
            "kube-controller-manager to make the default ServiceAccount",
            Duration::from_secs(60),
            || {
                plane.check()?;
                Ok(plane
                    .kubectl(&["get", "serviceaccount", "default", "-n", "default"])
                    .ok())
            },
        )?;
        Ok(plane)
    }

    /// kube-apiserver's process id (its CPU time is in `/proc/<pid>/stat`).
    pub fn apiserver_pid(&self) -> u32 {
        self.apiserver.child.id()
    }

    /// Fails if any component has exited.
    pub fn check(&mut self) -> Result<()> {
        self.etcd.check()?;
        self.apiserver.check()?;
        for p in [&mut self.kcm, &mut self.scheduler].into_iter().flatten() {
            p.check()?;
        }
        Ok(())
    }

    /// The release's kubectl, as the cluster's admin.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        run(Command::new(self.bins.join("kubectl"))
            .arg(format!("--kubeconfig={}", self.admin.display()))
            .args(args))
    }

    /// helm, as the cluster's admin, with its caches and configuration in the
    /// scratch directory.
    pub fn helm(&self, args: &[&str]) -> Result<String> {
        let helm = self
            .helm
            .as_ref()
            .context("real-k8s was not given --helm")?;
        let home = self.dir.join("helm");
        run(Command::new(helm)
            .arg(format!("--kubeconfig={}", self.admin.display()))
            .args(args)
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data")))
    }

    /// `kubectl … -o json`, parsed.
    pub fn get_json(&self, args: &[&str]) -> Result<serde_json::Value> {
        let out = self.kubectl(&[args, &["-o", "json"]].concat())?;
        serde_json::from_str(&out).with_context(|| format!("parsing kubectl {args:?}"))
    }

    /// `kubectl apply` of a manifest given as text.
    pub fn apply(&self, manifest: &str) -> Result<String> {
        let path = self.dir.join(format!("apply-{}.yaml", unique()));
        std::fs::write(&path, manifest)?;
        self.kubectl(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            path_str(&path),
        ])
    }

    /// The scheduler's log (its reasons are only there).
    pub fn scheduler_log(&self) -> String {
        std::fs::read_to_string(self.logs_dir().join("kube-scheduler.log")).unwrap_or_default()
    }

    /// The API server's audit log of the drivers' requests and the scheduler's
    /// bindings.
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("audit.log")
    }

    /// Where each component's log is.
    pub fn logs_dir(&self) -> PathBuf {
        self.dir.join("logs")
    }
}

/// A number not given before in this process (for file names).
pub fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// `p` as text (empty if it is not UTF-8).
pub fn path_str(p: &Path) -> &str {
    p.to_str().unwrap_or_default()
}
