//! `dra-rebellions-vocabulary`: the real scheduler allocates our devices through
//! Rebellions' own DeviceClass names (the chart's `draDriver.rebellionsClasses`)
//! and the claims written for Rebellions' DRA driver, once the driver speaks its
//! vocabulary (`"naming": "pci-ids"`).

use std::time::Duration;

use anyhow::{anyhow, ensure, Context, Result};
use serde_json::Value;

use super::{
    claim_addresses, delete_pod, dra, ensure_ns, gate_on, generated_claim, our_slices, pod,
    pod_output, restart_dra_with_list, Outcome, NS, SHOW,
};
use crate::control::{path_str, ControlPlane};
use crate::drivers::{self, DRIVER, NPUS};
use crate::proc::wait_for;
use crate::Ctx;

/// Rebellions' driver, the domain of its attributes.
const REBELLIONS: &str = "npu.rebellions.ai";
/// Rebellions' class for passthrough devices, and its class for any device.
const VFIO_CLASS: &str = "vfio-npu.rebellions.ai";
const NPU_CLASS: &str = "npu.rebellions.ai";

/// The NPU made an ATOM CA25 for the scenario (the other stays a CA22).
const CA25_AT: &str = "0000:42:00.0";
const CA22_ID: u16 = 0x1220;
const CA25_ID: u16 = 0x1250;

/// Prints the container's first environment as the runtime gave it: a shell
/// drops the variables whose names are no shell names, such as KubeVirt's
/// `PCI_RESOURCE_REBELLIONS_AI_RBLN-CA25_PF` (virt-launcher reads its own
/// environment, not a shell's).
const ENVIRON: &str = "tr '\\0' '\\n' < /proc/1/environ | grep ^PCI_RESOURCE | sort";

/// The ResourceClaims the scenario makes (each deleted once its pod is done).
const CLAIMS: [&str; 6] = [
    "seed-vfio-npu",
    "vfio-npu",
    "npu",
    "pcie-root",
    "two-roots",
    "one-numa",
];

/// The ResourceClaimTemplate of Rebellions' KubeVirt example
/// (RBLN-SW/rbln-k8s-dra-driver, `examples/kubevirt-vm-passthrough.md`), with its
/// selector that pins a model taken out of its comment.
const EXAMPLE_TEMPLATE: &str = r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: npu-passthrough
spec:
  spec:
    devices:
      requests:
      - name: npu
        exactly:
          deviceClassName: vfio-npu.rebellions.ai
          selectors:
          - cel:
              expression: 'device.attributes["npu.rebellions.ai"].productName == "RBLN-CA25"'
"#;

pub(super) fn dra_rebellions_vocabulary(ctx: &mut Ctx) -> Result<Outcome> {
    ensure_ns(&ctx.plane, NS)?;
    rebellions_classes(&ctx.plane, true)?;
    let result = with_classes(ctx);
    // The node as found: the shipped driver's naming, the CA22s, no class of
    // Rebellions' names, none of our claims.
    let plane = &ctx.plane;
    let _ = plane.kubectl(&["delete", "pods", "--all", "-n", NS, "--wait=true"]);
    let mut claims = vec!["delete", "resourceclaim", "-n", NS, "--ignore-not-found"];
    claims.extend(CLAIMS);
    let _ = plane.kubectl(&claims);
    let _ = plane.kubectl(&[
        "delete",
        "resourceclaimtemplate",
        "npu-passthrough",
        "-n",
        NS,
        "--ignore-not-found",
    ]);
    let _ = rebellions_classes(plane, false);
    if let Some(mut d) = ctx.dra.take() {
        d.proc.stop();
    }
    ctx.host.set_device_id(CA25_AT, CA22_ID)?;
    result
}

/// `helm upgrade` of the DRA release with Rebellions' class names on or off.
fn rebellions_classes(plane: &ControlPlane, on: bool) -> Result<()> {
    plane
        .helm(&[
            "upgrade",
            drivers::DRA_RELEASE,
            path_str(&drivers::chart()),
            "--namespace",
            drivers::DRIVER_NS,
            "--reuse-values",
            "--set",
            &format!("draDriver.rebellionsClasses={on}"),
        ])
        .with_context(|| format!("helm upgrade with draDriver.rebellionsClasses={on}"))?;
    Ok(())
}

fn with_classes(ctx: &mut Ctx) -> Result<Outcome> {
    seed_selects_nothing(ctx)?;
    // The driver with `"naming": "pci-ids"`, one NPU now a CA25.
    if let Some(mut d) = ctx.dra.take() {
        d.proc.stop();
    }
    ctx.host.set_device_id(CA25_AT, CA25_ID)?;
    restart_dra_with_list(
        ctx,
        "pci-ids.json",
        r#"{"preset": "rebellions", "naming": "pci-ids"}"#,
    )?;
    check_published(&ctx.plane)?;
    let mut notes = vec![kubevirt_example(ctx)?];
    // Each class of Rebellions' names, one device.
    for (name, class) in [("vfio-npu", VFIO_CLASS), ("npu", NPU_CLASS)] {
        let got = claim_in_pod(ctx, name, &claim_of(name, class, None, ""))?;
        ensure!(got.len() == 1, "claim {name} through {class} got {got:?}");
        notes.push(format!("{class}: {}", got[0]));
    }
    notes.push(constraints(ctx)?);
    notes.push(extended_resource(ctx)?);
    println!("     ({})", notes.join("; "));
    Ok(Outcome::Passed)
}

/// The shipped resource list (`seed` naming) publishes none of Rebellions'
/// attributes: the classes select nothing, and a claim through them is
/// unschedulable, not a CEL error that aborts the allocation.
fn seed_selects_nothing(ctx: &mut Ctx) -> Result<()> {
    dra(ctx)?;
    let plane = &ctx.plane;
    plane.apply(&claim_of("seed-vfio-npu", VFIO_CLASS, None, ""))?;
    plane.apply(&claim_pod("seed-vfio-npu", "seed-vfio-npu"))?;
    let why = wait_refused(plane, "seed-vfio-npu")?;
    ensure!(
        !why.contains("CEL"),
        "a class of Rebellions' names fails on a device without its attributes: {why}"
    );
    delete_pod(plane, "seed-vfio-npu")?;
    delete_claim(plane, "seed-vfio-npu")
}

/// Rebellions' KubeVirt example's claim, unchanged, gets the CA25, and the
/// pod the variable KubeVirt reads.
fn kubevirt_example(ctx: &Ctx) -> Result<String> {
    let plane = &ctx.plane;
    let path = plane.dir.join("rebellions-example.yaml");
    std::fs::write(&path, EXAMPLE_TEMPLATE)?;
    plane.kubectl(&["apply", "-n", NS, "-f", path_str(&path)])?;
    plane.apply(&pod(
        "kubevirt-example",
        &format!("{ENVIRON}; {SHOW}"),
        "    resources:\n      claims:\n        - name: npu-claim\n",
        "  resourceClaims:\n    - name: npu-claim\n      resourceClaimTemplateName: \
            npu-passthrough\n",
    ))?;
    let out = wait_output(ctx, "kubevirt-example")?;
    let claim = generated_claim(plane, "kubevirt-example")?;
    let got = allocated(plane, &claim)?;
    ensure!(
        got == [CA25_AT],
        "Rebellions' example claim {claim} got {got:?}, not the CA25 at {CA25_AT}"
    );
    let var = format!("PCI_RESOURCE_REBELLIONS_AI_RBLN-CA25_PF={CA25_AT}");
    ensure!(out.contains(&var), "the VM's pod did not get {var}:\n{out}");
    delete_pod(plane, "kubevirt-example")?;
    Ok(format!("the example's claim: {CA25_AT}"))
}

/// `matchAttribute` on the standard pcieRoot (which a NIC's driver publishes
/// too) is met for one device; our two NPUs sit on different roots
/// (pci0000:41, pci0000:42), so two on one root cannot be met. Both are on NUMA
/// node 0, so Rebellions' standard numaNode aligns two.
fn constraints(ctx: &Ctx) -> Result<String> {
    let pick = format!("device.attributes[\"{REBELLIONS}\"].productName == \"RBLN-CA22\"");
    let root = "    constraints:\n    - requests: [npu]\n      \
                matchAttribute: resource.kubernetes.io/pcieRoot\n";
    let claim = claim_of("pcie-root", VFIO_CLASS, Some(&pick), root);
    let got = claim_in_pod(ctx, "pcie-root", &claim)?;
    ensure!(
        got == [NPUS[0].0],
        "the CA22 with a pcieRoot constraint: got {got:?}"
    );
    let two = |n: &str, attribute: &str| {
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: {n}\n  \
             namespace: {NS}\nspec:\n  devices:\n    requests:\n    - name: a\n      exactly:\n        \
             deviceClassName: {VFIO_CLASS}\n    - name: b\n      exactly:\n        \
             deviceClassName: {VFIO_CLASS}\n    constraints:\n    - requests: [a, b]\n      \
             matchAttribute: {attribute}\n"
        )
    };
    let plane = &ctx.plane;
    plane.apply(&two("two-roots", "resource.kubernetes.io/pcieRoot"))?;
    plane.apply(&claim_pod("two-roots", "two-roots"))?;
    let why = wait_refused(plane, "two-roots")?;
    ensure!(!why.contains("CEL"), "two NPUs on one root: {why}");
    delete_pod(plane, "two-roots")?;
    delete_claim(plane, "two-roots")?;
    let mut got = claim_in_pod(
        ctx,
        "one-numa",
        &two("one-numa", "resource.kubernetes.io/numaNode"),
    )?;
    got.sort();
    let want: Vec<&str> = NPUS.iter().map(|(a, _)| *a).collect();
    ensure!(got == want, "two NPUs on one NUMA node: got {got:?}");
    Ok("pcieRoot and numaNode constraints met as the topology allows".into())
}

/// KEP-5004: a pod asking for `rebellions.ai/npu` is served through
/// `npu.rebellions.ai`, where the gate is on.
fn extended_resource(ctx: &Ctx) -> Result<String> {
    let plane = &ctx.plane;
    if !gate_on(plane, 37) {
        return Ok("rebellions.ai/npu not tried: DRAExtendedResource is off".into());
    }
    plane.apply(&pod(
        "extended",
        SHOW,
        "    resources:\n      limits:\n        rebellions.ai/npu: 1\n",
        "",
    ))?;
    wait_output(ctx, "extended")?;
    let p = plane.get_json(&["get", "pod", "extended", "-n", NS])?;
    let claim = p["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
        .as_str()
        .with_context(|| {
            format!(
                "pod extended has no extendedResourceClaimStatus: {}",
                p["status"]
            )
        })?
        .to_owned();
    let got = allocated(plane, &claim)?;
    ensure!(got.len() == 1, "rebellions.ai/npu: got {got:?}");
    delete_pod(plane, "extended")?;
    Ok(format!("rebellions.ai/npu: {}", got[0]))
}

/// Waits for our slice to carry Rebellions' vocabulary for both NPUs, as the
/// API server stored it.
fn check_published(plane: &ControlPlane) -> Result<()> {
    let devices = wait_for(
        "our slice in Rebellions' vocabulary",
        Duration::from_secs(30),
        || {
            let devices: Vec<Value> = our_slices(plane)?
                .iter()
                .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
                .collect();
            let products = devices
                .iter()
                .filter(|d| d["attributes"][format!("{REBELLIONS}/productName")].is_object())
                .count();
            Ok((devices.len() == NPUS.len() && products == NPUS.len()).then_some(devices))
        },
    )?;
    for d in &devices {
        let a = &d["attributes"];
        let address = a["resource.kubernetes.io/pciBusID"]["string"]
            .as_str()
            .unwrap_or_default();
        let (product, id, group) = if address == CA25_AT {
            ("RBLN-CA25", "1250", 22)
        } else {
            ("RBLN-CA22", "1220", 21)
        };
        let want = [
            ("type", "string", Value::from("vfio")),
            ("productName", "string", Value::from(product)),
            ("pciDeviceID", "string", Value::from(id)),
            ("vf", "bool", Value::from(false)),
            ("iommuGroup", "int", Value::from(group)),
        ];
        for (name, kind, value) in want {
            let got = &a[format!("{REBELLIONS}/{name}")][kind];
            ensure!(
                *got == value,
                "device {} has {REBELLIONS}/{name} {got}, not {kind} {value}: {a}",
                d["name"]
            );
        }
        for key in ["resource.kubernetes.io/numaNode", "dra.net/numaNode"] {
            ensure!(
                a[key]["int"] == 0,
                "device {} has {key} {}",
                d["name"],
                a[key]
            );
        }
        let root = format!("pci0000:{}", &address[5..7]);
        ensure!(
            a["resource.kubernetes.io/pcieRoot"]["string"] == root.as_str(),
            "device {} has pcieRoot {}",
            d["name"],
            a["resource.kubernetes.io/pcieRoot"]
        );
    }
    Ok(())
}

/// A ResourceClaim of one request `npu` through `class`, with an optional CEL
/// selector and `extra` spliced into `spec.devices`.
fn claim_of(name: &str, class: &str, cel: Option<&str>, extra: &str) -> String {
    let selector = cel
        .map(|e| format!("        selectors:\n        - cel:\n            expression: '{e}'\n"))
        .unwrap_or_default();
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: {name}\n  \
         namespace: {NS}\nspec:\n  devices:\n    requests:\n    - name: npu\n      exactly:\n        \
         deviceClassName: {class}\n{selector}{extra}"
    )
}

/// A pod holding the ResourceClaim `claim`, named in the pod as it is itself.
fn claim_pod(name: &str, claim: &str) -> String {
    pod(
        name,
        SHOW,
        &format!("    resources:\n      claims:\n        - name: {claim}\n"),
        &format!("  resourceClaims:\n    - name: {claim}\n      resourceClaimName: {claim}\n"),
    )
}

/// Makes the claim `manifest` (named `name`) and a pod holding it, waits for
/// the pod to run, and gives the addresses the scheduler allocated; the pod
/// and the claim are gone again when it returns.
fn claim_in_pod(ctx: &Ctx, name: &str, manifest: &str) -> Result<Vec<String>> {
    ctx.plane.apply(manifest)?;
    ctx.plane.apply(&claim_pod(name, name))?;
    wait_output(ctx, name)?;
    let got = allocated(&ctx.plane, name)?;
    delete_pod(&ctx.plane, name)?;
    delete_claim(&ctx.plane, name)?;
    Ok(got)
}

/// A CEL error the scheduler met placing `pod` (its `PodScheduled` message), or
/// any CEL error in its log: a class or claim that reads an attribute a device
/// lacks aborts the allocation, and the scheduler retries the pod without the
/// `Unschedulable` reason.
fn cel_error(plane: &ControlPlane, pod: &Value) -> Option<String> {
    let reason = scheduled(pod)
        .and_then(|c| c["message"].as_str())
        .filter(|m| m.contains("CEL"))
        .map(str::to_owned);
    reason.or_else(|| {
        plane
            .scheduler_log()
            .lines()
            .find(|l| l.contains("CEL runtime error"))
            .map(str::to_owned)
    })
}

/// Polls pod `name` until `done` gives a value; a CEL error of the scheduler
/// fails at once, with its message.
fn wait_pod<T>(
    plane: &ControlPlane,
    name: &str,
    what: &str,
    done: impl Fn(&Value) -> Option<T>,
) -> Result<T> {
    wait_for(
        &format!("pod {NS}/{name} {what}"),
        Duration::from_secs(60),
        || {
            let p = plane.get_json(&["get", "pod", name, "-n", NS])?;
            if let Some(e) = cel_error(plane, &p) {
                return Ok(Some(Err(anyhow!("the scheduler met a CEL error: {e}"))));
            }
            Ok(done(&p).map(Ok))
        },
    )?
}

/// The `PodScheduled` condition of a pod.
fn scheduled(pod: &Value) -> Option<&Value> {
    pod["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "PodScheduled")
}

/// Waits for the scheduler to find no device for the pod, and gives its reason.
fn wait_refused(plane: &ControlPlane, name: &str) -> Result<String> {
    wait_pod(plane, name, "to be unschedulable", |p| {
        scheduled(p)
            .filter(|c| c["reason"] == "Unschedulable")
            .map(|c| c["message"].as_str().unwrap_or_default().to_owned())
    })
}

/// Waits for the pod to be scheduled and then to show its devices.
fn wait_output(ctx: &Ctx, name: &str) -> Result<String> {
    wait_pod(&ctx.plane, name, "to be scheduled", |p| {
        scheduled(p).filter(|c| c["status"] == "True").map(|_| ())
    })?;
    pod_output(ctx, name, Duration::from_secs(90))
}

/// The addresses allocated to `claim`, each checked to be a device of our
/// driver in this node's pool.
fn allocated(plane: &ControlPlane, claim: &str) -> Result<Vec<String>> {
    let c = plane.get_json(&["get", "resourceclaim", claim, "-n", NS])?;
    let results = c["status"]["allocation"]["devices"]["results"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(
        !results.is_empty(),
        "claim {claim} is not allocated: {}",
        c["status"]
    );
    for r in &results {
        ensure!(
            r["driver"] == DRIVER && r["pool"] == plane.node.as_str(),
            "claim {claim} got a device not of {DRIVER} in pool {}: {r}",
            plane.node
        );
    }
    claim_addresses(plane, claim)
}

fn delete_claim(plane: &ControlPlane, name: &str) -> Result<()> {
    plane.kubectl(&[
        "delete",
        "resourceclaim",
        name,
        "-n",
        NS,
        "--wait=true",
        "--timeout=60s",
    ])?;
    Ok(())
}
