//! The scenarios, in the order they run. Each starts what it needs, checks what
//! the real components did, and leaves the node as it found it.

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use crate::control::{ControlPlane, Gates};
use crate::drivers::{self, CA22, CA22_CLASS, DRIVER, NPUS};
use crate::node::BUSYBOX;
use crate::proc::wait_for;
use crate::Ctx;

mod groups;
mod owner;
mod rebellions;

pub enum Outcome {
    Passed,
    /// The scenario cannot apply to this release or gate setting, and why.
    NotApplicable(String),
}

type Scenario = fn(&mut Ctx) -> Result<Outcome>;

mod labelled;

pub const ALL: &[(&str, Scenario)] = &[
    ("dra-registers-and-publishes", dra_registers_and_publishes),
    ("dra-pod-with-claim-template", dra_pod_with_claim_template),
    ("dra-extended-resource", dra_extended_resource),
    ("dra-health", dra_health),
    ("dra-binding-conditions", dra_binding_conditions),
    ("dra-early-move-labelled", labelled::dra_early_move_labelled),
    ("dra-restarts", dra_restarts),
    ("dra-node-recreated", dra_node_recreated),
    ("dra-owner-lost", owner::dra_owner_lost),
    (
        "dra-rebellions-vocabulary",
        rebellions::dra_rebellions_vocabulary,
    ),
    ("dra-group-unsplittable", groups::dra_group_unsplittable),
    ("device-plugin-pod", device_plugin_pod),
    (
        "device-plugin-health-and-restarts",
        device_plugin_health_and_restarts,
    ),
];

/// The namespace of the test pods and claims.
const NS: &str = "vms";

/// Fails naming each request of our drivers' ServiceAccounts that the API
/// server refused (403): the verb and resource the shipped RBAC lacks.
pub fn no_forbidden(plane: &ControlPlane) -> Result<()> {
    let text = std::fs::read_to_string(plane.audit_log()).unwrap_or_default();
    let mut refused = std::collections::BTreeMap::<String, usize>::new();
    for line in text.lines() {
        let Ok(event) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        // A 403, or an authorization refused inside validation (a 422 such as
        // "changing status.devices requires resource=... permission").
        let status = &event["responseStatus"];
        let message = status["message"].as_str().unwrap_or_default();
        let refused_inside = status["code"] == 422 && message.contains(" is forbidden: User ");
        if status["code"] != 403 && !refused_inside {
            continue;
        }
        let o = &event["objectRef"];
        let mut resource = o["resource"].as_str().unwrap_or_default().to_owned();
        if let Some(sub) = o["subresource"].as_str() {
            resource = format!("{resource}/{sub}");
        }
        if let Some(group) = o["apiGroup"].as_str().filter(|g| !g.is_empty()) {
            resource = format!("{resource}.{group}");
        }
        if refused_inside {
            // The check that failed: "cannot <verb> resource \"<r>\"".
            if let Some(at) = message.find("cannot ") {
                let what = message[at..]
                    .split(" in API group")
                    .next()
                    .unwrap_or_default();
                resource = format!("{resource} ({})", what.replace('"', ""));
            }
        }
        let key = format!(
            "{} {resource}{}{} (as {})",
            event["verb"].as_str().unwrap_or_default(),
            o["name"]
                .as_str()
                .map(|n| format!(" {n}"))
                .unwrap_or_default(),
            o["namespace"]
                .as_str()
                .map(|n| format!(" in {n}"))
                .unwrap_or_default(),
            event["user"]["username"].as_str().unwrap_or_default(),
        );
        *refused.entry(key).or_default() += 1;
    }
    if refused.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = refused.iter().map(|(k, n)| format!("{k} ×{n}")).collect();
    bail!(
        "the API server refused requests the shipped RBAC does not allow: {}",
        list.join("; ")
    )
}

/// The running DRA driver, started on first use.
fn dra(ctx: &mut Ctx) -> Result<&mut drivers::DraDriver> {
    if ctx.dra.as_mut().is_some_and(|d| !d.proc.alive()) {
        let mut dead = ctx.dra.take();
        if let Some(d) = dead.as_mut() {
            d.proc.check()?;
        }
    }
    if ctx.dra.is_none() {
        ctx.dra = Some(drivers::start_dra(
            &ctx.plane,
            &ctx.node,
            &ctx.host,
            &ctx.dra_binary(),
            &[],
        )?);
    }
    Ok(ctx.dra.as_mut().expect("started above"))
}

/// Stops the DRA driver and starts it again with the resource list `list`
/// (JSON), written as `file` in its directory; the next [`dra`] after the
/// scenario stops it starts the shipped one.
fn restart_dra_with_list(ctx: &mut Ctx, file: &str, list: &str) -> Result<()> {
    if let Some(mut d) = ctx.dra.take() {
        d.proc.stop();
    }
    let dir = drivers::dra_dir(&ctx.node);
    std::fs::create_dir_all(&dir)?;
    let config = dir.join(file);
    std::fs::write(&config, list)?;
    ctx.dra = Some(drivers::start_dra_with(
        &ctx.plane,
        &ctx.node,
        &ctx.host,
        &ctx.dra_binary(),
        &[],
        &config,
    )?);
    Ok(())
}

fn ensure_ns(plane: &ControlPlane, ns: &str) -> Result<()> {
    plane.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {ns}\n"
    ))?;
    wait_for(
        &format!("the default ServiceAccount of {ns}"),
        Duration::from_secs(30),
        || {
            Ok(plane
                .kubectl(&["get", "serviceaccount", "default", "-n", ns])
                .ok())
        },
    )?;
    Ok(())
}

/// The node's ResourceSlices of our driver.
fn our_slices(plane: &ControlPlane) -> Result<Vec<Value>> {
    let list = plane.get_json(&[
        "get",
        "resourceslices",
        &format!("--field-selector=spec.driver={DRIVER}"),
    ])?;
    Ok(list["items"].as_array().cloned().unwrap_or_default())
}

fn dra_registers_and_publishes(ctx: &mut Ctx) -> Result<Outcome> {
    // The ready file is written once kubelet's plugin watcher has called
    // GetInfo and NotifyRegistrationStatus(registered) on the registration socket.
    dra(ctx)?;
    let plane = &ctx.plane;
    let node = plane.get_json(&["get", "node", &ctx.node.name])?;
    let node_uid = node["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let slices = wait_for("our ResourceSlice", Duration::from_secs(30), || {
        let s = our_slices(plane)?;
        Ok((!s.is_empty()).then_some(s))
    })?;
    ensure!(
        slices.len() == 1,
        "expected one slice, got {}",
        slices.len()
    );
    let slice = &slices[0];
    ensure!(
        slice["spec"]["nodeName"] == ctx.node.name.as_str(),
        "slice's spec.nodeName is {}",
        slice["spec"]["nodeName"]
    );
    ensure!(
        slice["spec"]["pool"]["name"] == ctx.node.name.as_str(),
        "slice's pool is {}",
        slice["spec"]["pool"]
    );
    let owner = &slice["metadata"]["ownerReferences"][0];
    ensure!(
        owner["kind"] == "Node"
            && owner["name"] == ctx.node.name.as_str()
            && owner["uid"] == node_uid.as_str(),
        "slice's owner is {owner}, not Node {} ({node_uid})",
        ctx.node.name
    );
    let devices = slice["spec"]["devices"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(
        devices.len() == NPUS.len(),
        "slice has {} devices, expected {}: {}",
        devices.len(),
        NPUS.len(),
        slice["spec"]["devices"]
    );
    for d in &devices {
        let name = &d["attributes"]["resourceName"]["string"];
        ensure!(name == CA22, "device {} has resourceName {name}", d["name"]);
    }
    // kubelet's DRA manager knows the driver: its log says so at registration.
    let log = ctx.node.kubelet_log(plane);
    ensure!(log.contains(DRIVER), "kubelet's log never names {DRIVER}");
    Ok(Outcome::Passed)
}

/// A pod manifest: busybox running `script` once, with `extra` spliced into
/// the container (resources) and the pod spec (`pod_extra`).
fn pod(name: &str, script: &str, container_extra: &str, pod_extra: &str) -> String {
    let script = format!("{script}; echo {END}; exec sleep 3600").replace('\'', "''");
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {NS}\nspec:\n  \
         restartPolicy: Never\n  terminationGracePeriodSeconds: 1\n  hostNetwork: true\n{pod_extra}  containers:\n  \
         - name: c\n    image: {BUSYBOX}\n    imagePullPolicy: Never\n    \
         command: ['/bin/sh', '-c', '{script}']\n{container_extra}"
    )
}

/// A pod whose container holds a claim made from the example template.
fn claim_pod(name: &str) -> String {
    claim_pod_from(name, "one-atom-ca22")
}

/// A pod whose container holds a claim made from `template`.
fn claim_pod_from(name: &str, template: &str) -> String {
    pod(
        name,
        SHOW,
        "    resources:\n      claims:\n        - name: npus\n",
        &format!(
            "  resourceClaims:\n    - name: npus\n      resourceClaimTemplateName: {template}\n"
        ),
    )
}

/// A pod whose container asks for one `rebellions.ai/ATOM_CA22_PT`.
fn npu_limit_pod(name: &str) -> String {
    pod(
        name,
        SHOW,
        &format!("    resources:\n      limits:\n        {CA22}: 1\n"),
        "",
    )
}

/// What the test container prints: the KubeVirt variables, the VFIO nodes it
/// sees and the metadata files of our driver mounted into it.
const SHOW: &str = "env | grep ^PCI_RESOURCE | sort; echo nodes: $(ls /dev/vfio | sort); \
                    for f in $(find / -xdev -name \"*-metadata.json\" 2>/dev/null | sort); do echo file: $f; done";

/// The line the test container prints when it has shown everything; it then
/// stays, so its claim stays allocated while the harness looks.
const END: &str = "==shown==";

/// Waits for a pod's container to print [`END`] and returns what it printed
/// before; fails if the pod ends or the time runs out, with its status and
/// events.
fn pod_output(ctx: &Ctx, name: &str, timeout: Duration) -> Result<String> {
    let plane = &ctx.plane;
    wait_for(
        &format!("pod {NS}/{name} to show its devices"),
        timeout,
        || {
            let p = plane.get_json(&["get", "pod", name, "-n", NS])?;
            let phase = p["status"]["phase"].as_str().unwrap_or_default().to_owned();
            let out = ctx.node.container_output(NS, name, "c").unwrap_or_default();
            if matches!(phase.as_str(), "Succeeded" | "Failed") {
                return Ok(Some(Err(anyhow::anyhow!(
                    "pod {name} ended ({phase}); output:\n{out}"
                ))));
            }
            Ok(out.contains(END).then_some(Ok(out)))
        },
    )
    .and_then(|r| r)
    .with_context(|| describe(plane, name))
}

fn describe(plane: &ControlPlane, name: &str) -> String {
    let status = plane
        .get_json(&["get", "pod", name, "-n", NS])
        .map(|p| p["status"].to_string())
        .unwrap_or_default();
    let events = plane
        .kubectl(&[
            "get",
            "events",
            "-n",
            NS,
            "--field-selector",
            &format!("involvedObject.name={name}"),
        ])
        .unwrap_or_default();
    format!("status: {status}\nevents:\n{events}")
}

fn delete_pod(plane: &ControlPlane, name: &str) -> Result<()> {
    plane.kubectl(&[
        "delete",
        "pod",
        name,
        "-n",
        NS,
        "--wait=true",
        "--timeout=60s",
    ])?;
    Ok(())
}

/// The ResourceClaimTemplate of manifests/examples/dra/vm-npu-dra.yaml.
fn example_template() -> Result<String> {
    let path = drivers::repo().join("manifests/examples/dra/vm-npu-dra.yaml");
    let text = std::fs::read_to_string(&path)?;
    text.split("\n---\n")
        .find(|doc| doc.contains("kind: ResourceClaimTemplate"))
        .map(str::to_owned)
        .with_context(|| format!("no ResourceClaimTemplate in {}", path.display()))
}

/// The group of the NPU at `address`.
fn group_of(address: &str) -> Option<u32> {
    NPUS.iter().find(|(a, _)| *a == address).map(|(_, g)| *g)
}

/// Checks a container's output: the variable names exactly `addresses`, it saw
/// exactly their groups' nodes (and the container node), and the metadata
/// files (`metadata` of them).
fn check_output(out: &str, addresses: &[String], metadata: usize) -> Result<()> {
    let var = CA22.to_uppercase().replace(['/', '.'], "_");
    let want = format!("PCI_RESOURCE_{var}={}", addresses.join(","));
    ensure!(
        out.contains(&want),
        "the container did not get {want}:\n{out}"
    );
    let mut nodes: Vec<String> = addresses
        .iter()
        .filter_map(|a| group_of(a))
        .map(|g| g.to_string())
        .collect();
    nodes.push("vfio".into());
    nodes.sort();
    let want = format!("nodes: {}", nodes.join(" "));
    ensure!(
        out.contains(&want),
        "the container's /dev/vfio is not exactly [{}]:\n{out}",
        nodes.join(" ")
    );
    let files = out.lines().filter(|l| l.starts_with("file: ")).count();
    ensure!(
        files == metadata,
        "the container has {files} metadata files, expected {metadata}:\n{out}"
    );
    Ok(())
}

fn claim_addresses(plane: &ControlPlane, claim: &str) -> Result<Vec<String>> {
    let c = plane.get_json(&["get", "resourceclaim", claim, "-n", NS])?;
    let results = c["status"]["allocation"]["devices"]["results"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let slices = our_slices(plane)?;
    let mut out = Vec::new();
    for r in results {
        let name = r["device"].as_str().unwrap_or_default();
        let address = slices
            .iter()
            .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .find(|d| d["name"] == name)
            .and_then(|d| {
                d["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
                    .as_str()
                    .map(str::to_owned)
            })
            .with_context(|| format!("device {name} of claim {claim} is in no slice of ours"))?;
        out.push(address);
    }
    Ok(out)
}

fn dra_pod_with_claim_template(ctx: &mut Ctx) -> Result<Outcome> {
    dra(ctx)?;
    let name = "dra-template";
    // The variable, the nodes and the metadata file at the standard path and
    // at the legacy one are checked by template_pod.
    let (claim, addresses) = template_pod(ctx, name)?;
    let plane = &ctx.plane;
    ensure!(
        addresses.len() == 1,
        "claim {claim} has {} devices",
        addresses.len()
    );
    let class = plane.get_json(&["get", "resourceclaim", &claim, "-n", NS])?;
    ensure!(
        class["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] == CA22_CLASS,
        "claim {claim} does not ask for {CA22_CLASS}"
    );
    delete_pod(plane, name)?;
    // The resourceclaim controller deletes the generated claim with its pod,
    // once kubelet has unprepared it.
    wait_claim_gone(plane, &claim)?;
    let state = ctx
        .dra
        .as_ref()
        .map(|d| d.state.clone())
        .unwrap_or_default();
    let text = std::fs::read_to_string(&state).unwrap_or_default();
    ensure!(
        !text.contains(&claim),
        "the driver's state still records claim {claim}: {text}"
    );
    Ok(Outcome::Passed)
}

fn dra_extended_resource(ctx: &mut Ctx) -> Result<Outcome> {
    dra(ctx)?;
    let plane = &ctx.plane;
    ensure_ns(plane, NS)?;
    let name = "dra-extended";
    plane.apply(&npu_limit_pod(name))?;
    if !gate_on(plane, 37) {
        // DRAExtendedResource is off: nothing on the node offers the name.
        let msg = wait_unschedulable(plane, name)?;
        delete_pod(plane, name)?;
        ensure!(
            msg.contains(CA22),
            "the refusal does not name {CA22}: {msg}"
        );
        return Ok(Outcome::NotApplicable(format!(
            "DRAExtendedResource is off on v1.{}: the pod stays Pending, unschedulable for {CA22}",
            plane.release.minor
        )));
    }
    let out = pod_output(ctx, name, Duration::from_secs(90))?;
    let p = plane.get_json(&["get", "pod", name, "-n", NS])?;
    let claim = p["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
        .as_str()
        .with_context(|| {
            format!(
                "pod {name} has no extendedResourceClaimStatus: {}",
                p["status"]
            )
        })?
        .to_owned();
    let addresses = claim_addresses(plane, &claim)?;
    check_output(&out, &addresses, 2)?;
    delete_pod(plane, name)?;
    Ok(Outcome::Passed)
}

fn device_plugin_pod(ctx: &mut Ctx) -> Result<Outcome> {
    // One source per node and name: the DRA driver stops first.
    if let Some(mut d) = ctx.dra.take() {
        d.proc.stop();
    }
    let mut plugin =
        drivers::start_device_plugin(&ctx.plane, &ctx.node, &ctx.host, &ctx.plugin_binary())?;
    let node = ctx.node.name.clone();
    let total = NPUS.len().to_string();
    wait_for(
        "the node to offer the device plugin's resource",
        Duration::from_secs(30),
        || {
            plugin.check()?;
            Ok((allocatable(&ctx.plane, &node)? == total).then_some(()))
        },
    )?;
    ensure_ns(&ctx.plane, NS)?;
    let name = "device-plugin";
    plugin_pod(ctx, name)?;
    let plane = &ctx.plane;
    delete_pod(plane, name)?;
    plugin.stop();
    Ok(Outcome::Passed)
}

/// Whether the release serves a gate our features need: on by default from
/// `on_from`, or turned on by the harness.
fn gate_on(plane: &ControlPlane, on_from: u32) -> bool {
    plane.release.minor >= on_from || plane.gates == Gates::Features
}

/// Starts a pod with a claim from the example template and waits for it to
/// show its devices; returns its claim's name and its devices' addresses.
fn template_pod(ctx: &Ctx, name: &str) -> Result<(String, Vec<String>)> {
    let plane = &ctx.plane;
    ensure_ns(plane, NS)?;
    let path = plane.dir.join("template.yaml");
    std::fs::write(&path, example_template()?)?;
    plane.kubectl(&["apply", "-n", NS, "-f", path.to_str().unwrap_or_default()])?;
    plane.apply(&claim_pod(name))?;
    let out = pod_output(ctx, name, Duration::from_secs(90))?;
    let p = plane.get_json(&["get", "pod", name, "-n", NS])?;
    let claim = p["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        .as_str()
        .with_context(|| format!("pod {name} has no generated claim"))?
        .to_owned();
    let addresses = claim_addresses(plane, &claim)?;
    check_output(&out, &addresses, 2)?;
    Ok((claim, addresses))
}

/// Starts a pod holding the ResourceClaim `claim`, made first (one NPU of the
/// example's class) and named in the pod as it is named itself; waits for the
/// pod to show its devices and returns their addresses.
fn named_claim_pod(ctx: &Ctx, name: &str, claim: &str) -> Result<Vec<String>> {
    let plane = &ctx.plane;
    ensure_ns(plane, NS)?;
    plane.apply(&format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: {claim}\n  \
         namespace: {NS}\nspec:\n  devices:\n    requests:\n    - name: npu\n      exactly:\n        \
         deviceClassName: {CA22_CLASS}\n"
    ))?;
    plane.apply(&pod(
        name,
        SHOW,
        &format!("    resources:\n      claims:\n        - name: {claim}\n"),
        &format!("  resourceClaims:\n    - name: {claim}\n      resourceClaimName: {claim}\n"),
    ))?;
    let out = pod_output(ctx, name, Duration::from_secs(90))?;
    let addresses = claim_addresses(plane, claim)?;
    check_output(&out, &addresses, 2)?;
    Ok(addresses)
}

/// The device of our slice at `address`, if published.
fn published(plane: &ControlPlane, address: &str) -> Result<Option<Value>> {
    Ok(our_slices(plane)?
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .find(|d| d["attributes"]["resource.kubernetes.io/pciBusID"]["string"] == address))
}

/// Waits for the pod's status to report `health` for a device
/// (`allocatedResourcesStatus`, KEP-4680).
fn wait_pod_health(plane: &ControlPlane, name: &str, health: &str) -> Result<Value> {
    wait_for(
        &format!("pod {name}'s status to report a device {health}"),
        Duration::from_secs(60),
        || {
            let p = plane.get_json(&["get", "pod", name, "-n", NS])?;
            let statuses = &p["status"]["containerStatuses"][0]["allocatedResourcesStatus"];
            let found = statuses
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|s| s["resources"].as_array().cloned().unwrap_or_default())
                .any(|r| r["health"] == health);
            Ok(found.then(|| statuses.clone()))
        },
    )
}

/// Waits for the scheduler to find no room for the pod, naming why.
fn wait_unschedulable(plane: &ControlPlane, name: &str) -> Result<String> {
    wait_for(
        &format!("the scheduler to find no device for pod {name}"),
        Duration::from_secs(60),
        || {
            let p = plane.get_json(&["get", "pod", name, "-n", NS])?;
            Ok(p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable")
                .map(|c| c["message"].as_str().unwrap_or_default().to_owned()))
        },
    )
}

/// Waits for our slice to show `address` unhealthy for `reason`: tainted
/// where the server keeps device taints, withdrawn where it drops them.
fn wait_marked(plane: &ControlPlane, address: &str, reason: &str) -> Result<()> {
    let taints = gate_on(plane, 37);
    wait_for(
        &format!("the slice to mark {address} unhealthy ({reason})"),
        Duration::from_secs(30),
        || {
            Ok(match (published(plane, address)?, taints) {
                (Some(d), true) => d["taints"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|t| {
                        t["key"] == format!("{DRIVER}/unhealthy").as_str()
                            && t["value"] == reason
                            && t["effect"] == "NoSchedule"
                    })
                    .then_some(()),
                (None, false) => Some(()),
                _ => None,
            })
        },
    )
}

/// Waits for our slice to offer `address` with no taint.
fn wait_clean(plane: &ControlPlane, address: &str) -> Result<()> {
    wait_for(
        &format!("the slice to offer {address} healthy"),
        Duration::from_secs(30),
        || {
            Ok(published(plane, address)?
                .filter(|d| d["taints"].as_array().is_none_or(Vec::is_empty))
                .map(|_| ()))
        },
    )
}

fn dra_health(ctx: &mut Ctx) -> Result<Outcome> {
    dra(ctx)?;
    // A prepared NPU unbound by hand: the driver's health stream says
    // Unhealthy (kubelet puts it in the pod's status where
    // ResourceHealthStatus is on) and the slice marks it; bound again, both
    // say healthy.
    //
    // kubelet 1.34 finds a container's claim for the pod's status only when the
    // ResourceClaim bears the name the pod gives it
    // (pkg/kubelet/cm/dra/manager.go, UpdateAllocatedResourcesStatus compares
    // the two; 1.36 maps one to the other through the pod's
    // resourceClaimStatuses): there the pod holds a claim made beforehand
    // under that name, and a generated one would show nothing.
    let pod_health = gate_on(&ctx.plane, 36);
    let named = ctx.plane.release.minor < 36;
    let held = if named {
        named_claim_pod(ctx, "health-a", "health-npu")?
    } else {
        template_pod(ctx, "health-a")?.1
    };
    let x = held[0].clone();
    ctx.host.set_on_vfio(&x, false)?;
    wait_marked(&ctx.plane, &x, "NotOnVfioDriver")?;
    if pod_health {
        wait_pod_health(&ctx.plane, "health-a", "Unhealthy")?;
    }
    ctx.host.set_on_vfio(&x, true)?;
    wait_clean(&ctx.plane, &x)?;
    if pod_health {
        wait_pod_health(&ctx.plane, "health-a", "Healthy")?;
    }
    delete_pod(&ctx.plane, "health-a")?;
    if named {
        ctx.plane.kubectl(&[
            "delete",
            "resourceclaim",
            "health-npu",
            "-n",
            NS,
            "--wait=true",
            "--timeout=60s",
        ])?;
    }
    // A free NPU with a fatal PCIe error: marked, so the real scheduler gives
    // the next claim the other NPU and none to a third, which gets it once the
    // error is gone.
    ctx.host.set_fatal_errors(&x, 1)?;
    wait_marked(&ctx.plane, &x, "FatalPCIeError")?;
    let (_, second) = template_pod(ctx, "health-b")?;
    ensure!(second[0] != x, "a new claim got the unhealthy NPU {x}");
    ctx.plane.apply(&claim_pod("health-c"))?;
    let why = wait_unschedulable(&ctx.plane, "health-c")?;
    ctx.host.set_fatal_errors(&x, 0)?;
    let out = pod_output(ctx, "health-c", Duration::from_secs(90))?;
    ensure!(
        out.contains(&x),
        "the waiting pod did not get {x} once it recovered:\n{out}"
    );
    for p in ["health-b", "health-c"] {
        delete_pod(&ctx.plane, p)?;
    }
    println!("     (the third pod waited: {why})");
    Ok(Outcome::Passed)
}

/// A template for one NPU picked by its address, in the example's class.
fn template_for(name: &str, address: &str) -> String {
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata:\n  name: {name}\n  \
         namespace: {NS}\nspec:\n  spec:\n    devices:\n      requests:\n      - name: npu\n        \
         exactly:\n          deviceClassName: {CA22_CLASS}\n          selectors:\n          - cel:\n              \
         expression: device.attributes[\"resource.kubernetes.io\"].pciBusID == \"{address}\"\n"
    )
}

/// Waits for the ResourceClaim `claim` of the test namespace to be gone.
fn wait_claim_gone(plane: &ControlPlane, claim: &str) -> Result<()> {
    wait_for(
        &format!("claim {claim} to be deleted"),
        Duration::from_secs(60),
        || {
            Ok(plane
                .kubectl(&["get", "resourceclaim", claim, "-n", NS])
                .is_err()
                .then_some(()))
        },
    )
}

/// The name of the claim generated for `pod`'s first claim, once there is one.
fn generated_claim(plane: &ControlPlane, pod: &str) -> Result<String> {
    wait_for(
        &format!("the claim of pod {pod}"),
        Duration::from_secs(30),
        || {
            let p = plane.get_json(&["get", "pod", pod, "-n", NS])?;
            Ok(p["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
                .as_str()
                .map(str::to_owned))
        },
    )
}

/// The events of the object named `name` in the test namespace.
fn events_of(plane: &ControlPlane, name: &str) -> Result<Vec<Value>> {
    let list = plane.get_json(&[
        "get",
        "events",
        "-n",
        NS,
        "--field-selector",
        &format!("involvedObject.name={name}"),
    ])?;
    Ok(list["items"].as_array().cloned().unwrap_or_default())
}

/// Waits for the NPU at `address` to be on `driver`.
fn wait_driver(ctx: &Ctx, address: &str, driver: &str, why: &str) -> Result<()> {
    wait_for(
        &format!("{address} to be on {driver} ({why})"),
        Duration::from_secs(60),
        || Ok((ctx.host.driver_of(address)?.as_deref() == Some(driver)).then_some(())),
    )
}

/// The `status.devices` condition `kind` of our device `device` in `claim`.
fn device_condition(claim: &Value, device: &str, kind: &str) -> Option<Value> {
    claim["status"]["devices"]
        .as_array()?
        .iter()
        .find(|e| e["driver"] == DRIVER && e["device"] == device)?["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
        .cloned()
}

/// A kubelet stopped with SIGSTOP until dropped: it prepares nothing meanwhile.
struct Frozen(nix::unistd::Pid);

impl Frozen {
    fn kubelet(ctx: &mut Ctx) -> Result<Self> {
        use nix::sys::signal::{kill, Signal};
        let pid = ctx.node.kubelet().context("kubelet is not running")?.pid();
        kill(pid, Signal::SIGSTOP)?;
        Ok(Self(pid))
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGCONT);
    }
}

fn dra_binding_conditions(ctx: &mut Ctx) -> Result<Outcome> {
    // NPU `a` is on its own driver between claims, as on a node that also
    // serves containers; the fake PCI core moves it when the driver writes
    // sysfs, synchronously, as the kernel does.
    let (a, group) = NPUS[0];
    ctx.host.core.set_native(a, drivers::NATIVE)?;
    ctx.host.set_driver(a, Some(drivers::NATIVE))?;
    dra(ctx)?;
    let on = gate_on(&ctx.plane, 36);
    let ready = format!("{DRIVER}/VfioReady");
    let failed = format!("{DRIVER}/VfioFailed");
    ensure_ns(&ctx.plane, NS)?;
    ctx.plane.apply(&template_for("npu-a", a))?;
    if on {
        wait_for(
            &format!("the slice to publish {a} with binding conditions"),
            Duration::from_secs(30),
            || {
                Ok(published(&ctx.plane, a)?.filter(|d| {
                    d["bindingConditions"] == serde_json::json!([ready])
                        && d["bindingFailureConditions"] == serde_json::json!([failed])
                        && d["bindsToNode"] == true
                }))
            },
        )?;
        let b = published(&ctx.plane, NPUS[1].0)?.context("the other NPU is not published")?;
        ensure!(
            b["bindingConditions"].is_null(),
            "{} is on vfio-pci already but has binding conditions: {b}",
            NPUS[1].0
        );
    }

    // The early move: the scheduler allocates `a`, waits for VfioReady, binds.
    let plane = &ctx.plane;
    plane.apply(&claim_pod_from("bc-ready", "npu-a"))?;
    let out = pod_output(ctx, "bc-ready", Duration::from_secs(90))?;
    check_output(&out, &[a.to_owned()], 2)?;
    ensure!(
        ctx.host.driver_of(a)?.as_deref() == Some("vfio-pci"),
        "{a} is not on vfio-pci while its pod runs"
    );
    let claim_name = generated_claim(plane, "bc-ready")?;
    let claim = plane.get_json(&["get", "resourceclaim", &claim_name, "-n", NS])?;
    let result = &claim["status"]["allocation"]["devices"]["results"][0];
    let device = result["device"].as_str().unwrap_or_default().to_owned();
    if on {
        ensure!(
            result["bindingConditions"] == serde_json::json!([ready]),
            "the allocation of claim {claim_name} does not wait on {ready}: {result}"
        );
        // Accepted by the API server's validation of status.devices.
        let cond = device_condition(&claim, &device, &ready).with_context(|| {
            format!(
                "claim {claim_name} has no {ready} for {device}: {}",
                claim["status"]
            )
        })?;
        ensure!(
            cond["status"] == "True",
            "{ready} of claim {claim_name} is not True: {cond}"
        );
        let p = plane.get_json(&["get", "pod", "bc-ready", "-n", NS])?;
        let scheduled = p["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "PodScheduled" && c["status"] == "True")
            .map(|c| {
                c["lastTransitionTime"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            })
            .unwrap_or_default();
        let moved = cond["lastTransitionTime"].as_str().unwrap_or_default();
        // RFC 3339 in UTC, one format: ordered as text.
        ensure!(
            moved <= scheduled.as_str(),
            "pod bc-ready was bound at {scheduled}, before {a} was ready at {moved}"
        );
    } else {
        ensure!(
            result["bindingConditions"].is_null() && claim["status"]["devices"].is_null(),
            "v1.{} with its defaults kept binding conditions: {}",
            plane.release.minor,
            claim["status"]
        );
    }
    delete_pod(plane, "bc-ready")?;
    wait_driver(
        ctx,
        a,
        drivers::NATIVE,
        "given back when its claim was unprepared",
    )?;
    if !on {
        return Ok(Outcome::NotApplicable(format!(
            "DRADeviceBindingConditions is off on v1.{}: the move happens at prepare (proven); \
             no early move, VfioFailed or give-back before prepare to test",
            plane.release.minor
        )));
    }

    // VfioFailed: the first move fails in the probe; the real scheduler sees
    // the failure condition, deallocates, allocates again, and the second
    // move succeeds.
    ctx.host
        .core
        .fail_next("drivers_probe", nix::errno::Errno::EIO);
    plane.apply(&claim_pod_from("bc-failed", "npu-a"))?;
    let out = pod_output(ctx, "bc-failed", Duration::from_secs(120))?;
    check_output(&out, &[a.to_owned()], 2)?;
    let claim_name = generated_claim(plane, "bc-failed")?;
    let ours = events_of(plane, &claim_name)?;
    ensure!(
        ours.iter().any(
            |e| e["type"] == "Warning" && e["message"].as_str().unwrap_or_default().contains(a)
        ),
        "no Warning Event on claim {claim_name} names the failed move of {a}: {ours:?}"
    );
    let theirs = events_of(plane, "bc-failed")?;
    ensure!(
        theirs.iter().any(|e| e["message"]
            .as_str()
            .unwrap_or_default()
            .contains("binding failed")),
        "the scheduler never reported the failed binding of pod bc-failed: {theirs:?}"
    );
    delete_pod(plane, "bc-failed")?;
    wait_driver(ctx, a, drivers::NATIVE, "given back after its pod")?;

    // Moved early, then deleted before kubelet prepared it: kubelet is
    // stopped, the pod bound and deleted; the claim goes and the driver gives
    // `a` back by itself.
    let frozen = Frozen::kubelet(ctx)?;
    let plane = &ctx.plane;
    plane.apply(&claim_pod_from("bc-gone", "npu-a"))?;
    wait_for("pod bc-gone to be bound", Duration::from_secs(60), || {
        let p = plane.get_json(&["get", "pod", "bc-gone", "-n", NS])?;
        Ok(p["spec"]["nodeName"].as_str().map(|_| ()))
    })?;
    ensure!(
        ctx.host.driver_of(a)?.as_deref() == Some("vfio-pci"),
        "{a} is not on vfio-pci when its pod was bound (group {group})"
    );
    let claim_name = generated_claim(plane, "bc-gone")?;
    plane.kubectl(&[
        "delete",
        "pod",
        "bc-gone",
        "-n",
        NS,
        "--grace-period=0",
        "--force",
    ])?;
    wait_claim_gone(plane, &claim_name)?;
    wait_driver(
        ctx,
        a,
        drivers::NATIVE,
        "given back with no prepare, its claim deleted",
    )?;
    drop(frozen);
    Ok(Outcome::Passed)
}

/// After each scenario, pass or fail: no test pod left, every NPU on vfio-pci.
pub fn cleanup(ctx: &Ctx) {
    let _ = ctx.plane.kubectl(&[
        "delete",
        "pods",
        "--all",
        "-n",
        NS,
        "--wait=true",
        "--timeout=60s",
    ]);
    *support::lock(&ctx.host.core.kernel.fail_on) = None;
    for (address, _) in NPUS {
        let _ = ctx.host.core.set_native(address, "vfio-pci");
        let _ = ctx.host.set_on_vfio(address, true);
        let _ = ctx.host.set_fatal_errors(address, 0);
    }
}

/// The UID of our slice (one slice per node here).
fn slice_uid(plane: &ControlPlane) -> Result<String> {
    let slices = our_slices(plane)?;
    Ok(slices
        .first()
        .and_then(|s| s["metadata"]["uid"].as_str())
        .unwrap_or_default()
        .to_owned())
}

/// Waits for our slice to be published with every NPU, owned by the Node
/// as it is now; returns the slice's UID.
fn wait_slice_owned(ctx: &Ctx) -> Result<String> {
    let plane = &ctx.plane;
    wait_for(
        "our slice, whole and owned by the Node",
        Duration::from_secs(60),
        || {
            let node = plane.get_json(&["get", "node", &ctx.node.name])?;
            let uid = node["metadata"]["uid"].clone();
            let slices = our_slices(plane)?;
            Ok(slices
                .iter()
                .find(|s| {
                    s["metadata"]["ownerReferences"][0]["uid"] == uid
                        && s["spec"]["devices"].as_array().map(Vec::len) == Some(NPUS.len())
                })
                .map(|s| s["metadata"]["uid"].as_str().unwrap_or_default().to_owned()))
        },
    )
}

fn dra_restarts(ctx: &mut Ctx) -> Result<Outcome> {
    dra(ctx)?;
    let mut notes = Vec::new();
    // kill -9 of the driver: the next one registers again (its ready file
    // waits for kubelet) and serves claims.
    if let Some(mut d) = ctx.dra.take() {
        d.proc.kill9();
    }
    dra(ctx)?;
    wait_slice_owned(ctx)?;
    template_pod(ctx, "after-driver-kill")?;
    delete_pod(&ctx.plane, "after-driver-kill")?;
    // kubelet stopped and started, then killed and started: its plugin watcher
    // finds the driver's socket again, and the slice is there (restored by the
    // driver if kubelet wiped it at start).
    for (how, hard) in [("restart", false), ("kill -9", true)] {
        let before = slice_uid(&ctx.plane)?;
        ctx.node.stop_kubelet(hard);
        ctx.node.start_kubelet(&ctx.plane)?;
        let after = wait_slice_owned(ctx)?;
        notes.push(format!(
            "kubelet {how}: slice {}",
            if after == before {
                "kept"
            } else {
                "wiped by kubelet and restored"
            }
        ));
        let name = format!("after-kubelet-{}", if hard { "kill" } else { "restart" });
        template_pod(ctx, &name)?;
        delete_pod(&ctx.plane, &name)?;
    }
    println!("     ({})", notes.join("; "));
    Ok(Outcome::Passed)
}

fn dra_node_recreated(ctx: &mut Ctx) -> Result<Outcome> {
    dra(ctx)?;
    let plane = &ctx.plane;
    let old = plane.get_json(&["get", "node", &ctx.node.name])?["metadata"]["uid"].clone();
    // The Node deleted: the garbage collector deletes the slices it owns.
    ctx.node.stop_kubelet(false);
    plane.kubectl(&[
        "delete",
        "node",
        &ctx.node.name,
        "--wait=true",
        "--timeout=60s",
    ])?;
    wait_for(
        "the garbage collector to delete the Node's slices",
        Duration::from_secs(60),
        || {
            Ok(our_slices(plane)?
                .iter()
                .all(|s| s["metadata"]["ownerReferences"][0]["uid"] != old)
                .then_some(()))
        },
    )?;
    // kubelet registers the Node again (a new UID): the driver publishes
    // again, owned by the new Node, and claims work.
    ctx.node.start_kubelet(&ctx.plane)?;
    let new = ctx.plane.get_json(&["get", "node", &ctx.node.name])?["metadata"]["uid"].clone();
    ensure!(new != old, "the Node kept its UID {old}");
    wait_slice_owned(ctx)?;
    template_pod(ctx, "after-node-recreated")?;
    delete_pod(&ctx.plane, "after-node-recreated")?;
    Ok(Outcome::Passed)
}

/// The node's allocatable count of the device plugin's resource.
fn allocatable(plane: &ControlPlane, node: &str) -> Result<String> {
    let n = plane.get_json(&["get", "node", node])?;
    Ok(n["status"]["allocatable"][CA22]
        .as_str()
        .unwrap_or("0")
        .to_owned())
}

/// The reason a pod was refused by kubelet's admission, if it was.
fn admission_refusal(plane: &ControlPlane, name: &str) -> Option<String> {
    let p = plane.get_json(&["get", "pod", name, "-n", NS]).ok()?;
    (p["status"]["reason"] == "UnexpectedAdmissionError").then(|| {
        p["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    })
}

/// Runs a pod asking one NPU of the device plugin; returns its address.
///
/// Right after kubelet restarts, its device manager still counts the devices
/// of pods deleted before as allocated (from its checkpoint) until its pod
/// sources are ready, and refuses a pod at admission (`UnexpectedAdmissionError`,
/// "Available: 0"), whatever the plugin says: such a pod is made again, at
/// most three times, and each refusal is printed.
fn plugin_pod(ctx: &Ctx, name: &str) -> Result<String> {
    let manifest = npu_limit_pod(name);
    let mut attempt = 1;
    let out = loop {
        ctx.plane.apply(&manifest)?;
        match pod_output(ctx, name, Duration::from_secs(90)) {
            Ok(out) => break out,
            Err(e) => match admission_refusal(&ctx.plane, name) {
                Some(why) if attempt < 3 => {
                    println!(
                        "     (kubelet refused pod {name} at admission, \
                            attempt {attempt}: {why})"
                    );
                    delete_pod(&ctx.plane, name)?;
                    std::thread::sleep(Duration::from_secs(2));
                    attempt += 1;
                }
                _ => return Err(e),
            },
        }
    };
    let address = out
        .lines()
        .find_map(|l| {
            l.split_once('=')
                .filter(|(k, _)| k.starts_with("PCI_RESOURCE_"))
                .map(|(_, v)| v.to_owned())
        })
        .with_context(|| format!("no PCI_RESOURCE_ variable in pod {name}:\n{out}"))?;
    ensure!(
        group_of(&address).is_some(),
        "pod {name} got {address}, not one of our NPUs"
    );
    check_output(&out, std::slice::from_ref(&address), 0)?;
    Ok(address)
}

fn device_plugin_health_and_restarts(ctx: &mut Ctx) -> Result<Outcome> {
    if let Some(mut d) = ctx.dra.take() {
        d.proc.stop();
    }
    let mut plugin =
        drivers::start_device_plugin(&ctx.plane, &ctx.node, &ctx.host, &ctx.plugin_binary())?;
    let node = ctx.node.name.clone();
    let total = NPUS.len().to_string();
    let wait_allocatable = |ctx: &Ctx, plugin: &mut crate::proc::Proc, want: &str| {
        wait_for(
            &format!("the node to offer {want} {CA22}"),
            Duration::from_secs(60),
            || {
                plugin.check()?;
                Ok((allocatable(&ctx.plane, &node)? == want).then_some(()))
            },
        )
    };
    wait_allocatable(ctx, &mut plugin, &total)?;
    ensure_ns(&ctx.plane, NS)?;
    let sick = plugin_pod(ctx, "plugin-a")?;
    // A hand-made unbind: Unhealthy to kubelet, one fewer to allocate, and the
    // pod's status says so where ResourceHealthStatus is on.
    ctx.host.set_on_vfio(&sick, false)?;
    wait_allocatable(ctx, &mut plugin, &(NPUS.len() - 1).to_string())?;
    if gate_on(&ctx.plane, 36) {
        wait_pod_health(&ctx.plane, "plugin-a", "Unhealthy")?;
    }
    ctx.host.set_on_vfio(&sick, true)?;
    wait_allocatable(ctx, &mut plugin, &total)?;
    delete_pod(&ctx.plane, "plugin-a")?;
    // kubelet restarted and killed: the plugin registers again, pods get devices.
    // The Node's allocatable count is the old kubelet's until the new one
    // reports: a pod placed before the plugin has registered again and sent
    // its devices is refused by kubelet's admission (UnexpectedAdmissionError,
    // seen here), so wait for kubelet's own word that it has them
    // (pkg/kubelet/cm/devicemanager/manager.go, genericDeviceUpdateCallback).
    let registrations = |ctx: &Ctx| {
        ctx.node
            .kubelet_log(&ctx.plane)
            .matches("Processed device updates for resource")
            .count()
    };
    for (name, hard) in [("plugin-after-restart", false), ("plugin-after-kill", true)] {
        let before = registrations(ctx);
        ctx.node.stop_kubelet(hard);
        ctx.node.start_kubelet(&ctx.plane)?;
        wait_for(
            "the new kubelet to have the device plugin's devices",
            Duration::from_secs(60),
            || {
                plugin.check()?;
                Ok((registrations(ctx) > before).then_some(()))
            },
        )?;
        wait_allocatable(ctx, &mut plugin, &total)?;
        plugin_pod(ctx, name)?;
        delete_pod(&ctx.plane, name)?;
    }
    plugin.stop();
    Ok(Outcome::Passed)
}
