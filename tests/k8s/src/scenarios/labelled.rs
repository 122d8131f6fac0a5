//! The early move through the claim labeller: the driver watches only the
//! claims labelled for its node while a labeller leads, the standby takes over
//! when the leader is killed, and the driver watches every claim again once no
//! labeller runs.

use std::time::Duration;

use anyhow::{ensure, Context, Result};

use super::{
    check_output, claim_pod_from, delete_pod, device_condition, ensure_ns, gate_on,
    generated_claim, pod_output, published, template_for, wait_driver, Outcome, NS,
};
use crate::control::ControlPlane;
use crate::drivers::{self, DRIVER, DRIVER_NS, LABELLER, NPUS};
use crate::proc::wait_for;
use crate::Ctx;

/// The labeller's label on claims of node-a's devices.
fn label_key() -> String {
    format!("{DRIVER}/node")
}

/// The labeller's Lease's holder, once it is `holder`.
fn wait_holder(plane: &ControlPlane, holder: &str, why: &str, timeout: Duration) -> Result<()> {
    wait_for(
        &format!("Lease {DRIVER_NS}/{LABELLER} to be held by {holder:?} ({why})"),
        timeout,
        || {
            let lease = plane.get_json(&["get", "lease", LABELLER, "-n", DRIVER_NS])?;
            let now = lease["spec"]["holderIdentity"].as_str().unwrap_or_default();
            Ok((now == holder).then_some(()))
        },
    )
}

/// The DRA driver's log, and how long it is now.
fn driver_log(ctx: &Ctx) -> Result<(std::path::PathBuf, usize)> {
    let log = ctx
        .dra
        .as_ref()
        .context("the DRA driver is not running")?
        .proc
        .log
        .clone();
    let len = std::fs::read(&log).map(|b| b.len()).unwrap_or(0);
    Ok((log, len))
}

/// Waits for the DRA driver's log to say `line` past `since` (a length of
/// [`driver_log`]: the log is one file for every driver of the run).
fn wait_log(log: &(std::path::PathBuf, usize), line: &str, timeout: Duration) -> Result<()> {
    wait_for(&format!("the DRA driver to log {line:?}"), timeout, || {
        let text = std::fs::read(&log.0)?;
        let new = String::from_utf8_lossy(text.get(log.1..).unwrap_or_default());
        Ok(new.contains(line).then_some(()))
    })
}

/// The driver's log lines for each scope of its claim watch.
const LABELLED_SCOPE: &str =
    "the claim labeller holds its Lease: watching only the ResourceClaims labelled for this node";
const ALL_SCOPE: &str =
    "no claim labeller holds and renews its Lease: watching every ResourceClaim";

/// Waits until the driver's last word on its scope, past `since`, is `line`
/// (one of the two above): it logs a scope only when it changes. It watches the
/// Lease and gives a standby 5 s past the Lease's end before it watches every
/// claim, so a failover (the standby takes over within 17 s of the last
/// renewal) normally leaves it on its label.
fn wait_scope(log: &(std::path::PathBuf, usize), line: &str, timeout: Duration) -> Result<()> {
    wait_for(
        &format!("the DRA driver's claim watch: {line:?}"),
        timeout,
        || {
            let text = std::fs::read(&log.0)?;
            let new = String::from_utf8_lossy(text.get(log.1..).unwrap_or_default());
            let last = |l: &str| new.rfind(l);
            let other = if line == LABELLED_SCOPE {
                ALL_SCOPE
            } else {
                LABELLED_SCOPE
            };
            Ok(match (last(line), last(other)) {
                (Some(a), Some(b)) => (a > b).then_some(()),
                (Some(_), None) => Some(()),
                _ => None,
            })
        },
    )
}

/// A pod with a claim of NPU `a` runs once the driver moved it early: the claim
/// waited on `VfioReady`, which is `True`. Gives the claim.
fn early_move(ctx: &Ctx, pod: &str, a: &str) -> Result<serde_json::Value> {
    let plane = &ctx.plane;
    plane.apply(&claim_pod_from(pod, "npu-lb"))?;
    let out = pod_output(ctx, pod, Duration::from_secs(90))?;
    check_output(&out, &[a.to_owned()], 2)?;
    let name = generated_claim(plane, pod)?;
    let claim = plane.get_json(&["get", "resourceclaim", &name, "-n", NS])?;
    let result = &claim["status"]["allocation"]["devices"]["results"][0];
    let ready = format!("{DRIVER}/VfioReady");
    ensure!(
        result["bindingConditions"] == serde_json::json!([ready]),
        "the allocation of claim {name} does not wait on {ready}: {result}"
    );
    let device = result["device"].as_str().unwrap_or_default();
    let cond = device_condition(&claim, device, &ready)
        .with_context(|| format!("claim {name} has no {ready}: {}", claim["status"]))?;
    ensure!(
        cond["status"] == "True",
        "{ready} of claim {name} is not True: {cond}"
    );
    Ok(claim)
}

pub(super) fn dra_early_move_labelled(ctx: &mut Ctx) -> Result<Outcome> {
    let outcome = through_the_labeller(ctx);
    // The next scenario starts the driver as the others do.
    ctx.dra = None;
    outcome
}

fn through_the_labeller(ctx: &mut Ctx) -> Result<Outcome> {
    if !gate_on(&ctx.plane, 36) {
        return Ok(Outcome::NotApplicable(format!(
            "DRADeviceBindingConditions is off on v1.{}: no early move, so no claim to label",
            ctx.plane.release.minor
        )));
    }
    let (a, _) = NPUS[0];
    ctx.host.core.set_native(a, drivers::NATIVE)?;
    ctx.host.set_driver(a, Some(drivers::NATIVE))?;
    // The labeller with its own account: the shipped RBAC is all it may do
    // (the audit check after the scenario names any refusal).
    // Two replicas, as the Deployment runs them: the first leads.
    let (mut leader, leader_port) =
        drivers::start_labeller(&ctx.plane, &ctx.labeller_binary(), "labeller-0")?;
    let secs = Duration::from_secs;
    wait_holder(&ctx.plane, "labeller-0", "the first leads", secs(30))?;
    let (mut standby, standby_port) =
        drivers::start_labeller(&ctx.plane, &ctx.labeller_binary(), "labeller-1")?;
    // Both replicas ready (the leader renewing, the standby reading), and the
    // leader says so in its metrics.
    wait_ready(leader_port, "leading", secs(30))?;
    wait_ready(standby_port, "standing by", secs(30))?;
    let (_, metrics) = drivers::http_get(leader_port, "/metrics")?;
    ensure!(
        metrics.contains("vfio_sandbox_labeller_leading 1"),
        "the leader's metrics do not say it leads:\n{metrics}"
    );
    // The driver as its DaemonSet runs it: POD_NAMESPACE set, --claim-watch
    // at its default (auto), so it reads the Lease and watches its label.
    ctx.dra = None;
    let before = ctx.plane.logs_dir().join("sandbox-dra-driver.log");
    let since = (
        before.clone(),
        std::fs::read(&before).map(|b| b.len()).unwrap_or(0),
    );
    ctx.dra = Some(drivers::start_dra(
        &ctx.plane,
        &ctx.node,
        &ctx.host,
        &ctx.dra_binary(),
        &[("POD_NAMESPACE", DRIVER_NS)],
    )?);
    wait_log(&since, LABELLED_SCOPE, Duration::from_secs(30))?;
    wait_for(
        &format!("the slice to publish {a} with binding conditions"),
        Duration::from_secs(30),
        || Ok(published(&ctx.plane, a)?.filter(|d| !d["bindingConditions"].is_null())),
    )?;
    ensure_ns(&ctx.plane, NS)?;
    ctx.plane.apply(&template_for("npu-lb", a))?;

    // The real scheduler allocates `a` and waits; the labeller labels the
    // claim for node-a; the driver, which sees only that label, moves it.
    let claim = early_move(ctx, "lb-ready", a)?;
    let key = label_key();
    ensure!(
        claim["metadata"]["labels"][&key] == ctx.node.name.as_str(),
        "claim {} is not labelled {key}={}: {}",
        claim["metadata"]["name"],
        ctx.node.name,
        claim["metadata"]
    );
    delete_pod(&ctx.plane, "lb-ready")?;
    wait_driver(ctx, a, drivers::NATIVE, "given back after its pod")?;

    // The leader is killed (no release): the standby takes the Lease once it
    // has seen it unrenewed for its 15 s, and labels the next claim.
    let failover = driver_log(ctx)?;
    leader.kill9();
    wait_holder(&ctx.plane, "labeller-1", "the standby took over", secs(45))?;
    let claim = early_move(ctx, "lb-failover", a)?;
    ensure!(
        claim["metadata"]["labels"][&key] == ctx.node.name.as_str(),
        "claim {} is not labelled by the new leader: {}",
        claim["metadata"]["name"],
        claim["metadata"]
    );
    delete_pod(&ctx.plane, "lb-failover")?;
    wait_driver(ctx, a, drivers::NATIVE, "given back after its pod")?;

    // The driver watches labelled claims (a failover slower than the grace
    // would have sent it to every claim for a moment: said, not failed, as the
    // margin is a few seconds on a loaded machine).
    wait_scope(&since, LABELLED_SCOPE, Duration::from_secs(40))?;
    let during = std::fs::read(&failover.0)?;
    let relisted =
        String::from_utf8_lossy(during.get(failover.1..).unwrap_or_default()).contains(ALL_SCOPE);
    println!(
        "     (failover: the driver {} its label)",
        if relisted {
            "left, and came back to,"
        } else {
            "stayed on"
        }
    );
    let (_, metrics) = drivers::http_get(standby_port, "/metrics")?;
    ensure!(
        metrics.contains("vfio_sandbox_labeller_leading 1")
            && metrics
                .contains("vfio_sandbox_labeller_labels_total{change=\"set\",result=\"ok\"} "),
        "the new leader's metrics do not say it leads and labels:\n{metrics}"
    );

    // The only labeller killed (no release, no standby): the driver watches
    // every claim again once the Lease has gone unrenewed for its 15 s and a
    // standby had 5 s (FALLBACK_GRACE) to take it, that is within 22 s of the
    // kill (the last renewal was at most 2 s before it).
    let stopping = driver_log(ctx)?;
    let killed = std::time::Instant::now();
    standby.kill9();
    wait_log(&stopping, ALL_SCOPE, Duration::from_secs(40))?;
    let fell_back = killed.elapsed();
    ensure!(
        fell_back <= secs(23),
        "the driver watched every claim {fell_back:?} after the labeller died"
    );
    println!(
        "     (labeller killed: the driver watched every claim {} ms later)",
        fell_back.as_millis()
    );
    drop(leader);
    drop(standby);

    // A labeller back: the nodes watch their label again. Its SIGTERM releases
    // the Lease, and the driver watches every claim again within the grace;
    // the early move goes on without labels.
    let (again, again_port) =
        drivers::start_labeller(&ctx.plane, &ctx.labeller_binary(), "labeller-2")?;
    wait_holder(&ctx.plane, "labeller-2", "a new labeller leads", secs(45))?;
    wait_ready(again_port, "leading", secs(30))?;
    wait_scope(&stopping, LABELLED_SCOPE, Duration::from_secs(30))?;
    let stopping = driver_log(ctx)?;
    // As kubelet stops the chart's Deployment: SIGTERM, SIGKILL only after its
    // terminationGracePeriodSeconds (30 s; the harness's default is 10 s,
    // which a labeller stopped a moment after it took the Lease outlasted
    // beside two CPU hogs).
    let mut again = again;
    again.stop_with(nix::sys::signal::Signal::SIGTERM, secs(30));
    drop(again);
    wait_holder(&ctx.plane, "", "released on SIGTERM", secs(30))?;
    let released = std::time::Instant::now();
    wait_log(&stopping, ALL_SCOPE, Duration::from_secs(40))?;
    println!(
        "     (labeller released its Lease: the driver watched every claim {} ms later)",
        released.elapsed().as_millis()
    );
    let claim = early_move(ctx, "lb-alone", a)?;
    ensure!(
        claim["metadata"]["labels"][&key].is_null(),
        "claim {} was labelled with no labeller running: {}",
        claim["metadata"]["name"],
        claim["metadata"]
    );
    delete_pod(&ctx.plane, "lb-alone")?;
    wait_driver(ctx, a, drivers::NATIVE, "given back after its pod")?;
    Ok(Outcome::Passed)
}

/// Waits until the labeller on `port` answers `/readyz` with 200 and a body
/// that says `what` (`leading`, `standing by`).
fn wait_ready(port: u16, what: &str, timeout: Duration) -> Result<()> {
    wait_for(
        &format!("the labeller on port {port} ready, {what}"),
        timeout,
        || {
            let (code, body) = drivers::http_get(port, "/readyz")?;
            Ok((code == 200 && body.contains(what)).then_some(()))
        },
    )
}
