//! `dra-group-unsplittable`: the real scheduler never gives two claims parts of
//! one IOMMU group. The driver selects the two functions of the host's NIC that
//! share group [`PAIR_GROUP`]; where the API server keeps counter sets
//! (`DRAPartitionableDevices`) each function and the whole group draw the
//! group's one counter, elsewhere only the whole group is offered. Pods race
//! for the group round after round: exactly one runs, the other stays
//! unschedulable until the first is gone; a pod asking for the whole group sees
//! both functions.

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use super::{
    delete_pod, describe, ensure_ns, gate_on, our_slices, pod, pod_output, restart_dra_with_list,
    Outcome, NS, SHOW,
};
use crate::drivers::{DRIVER, PAIR, PAIR_GROUP};
use crate::proc::wait_for;
use crate::Ctx;

/// The resource the scenario's resource list names the NIC's functions.
const RESOURCE: &str = "example.com/DUAL_PT";
/// Its KubeVirt variable.
const VARIABLE: &str = "PCI_RESOURCE_EXAMPLE_COM_DUAL_PT";
/// A DeviceClass for them, and the claim templates of the scenario.
const CLASS: &str = "dual-pt.vfio-sandbox.example.com";
const ANY: &str = "one-dual";
const WHOLE: &str = "whole-dual";
/// Rounds of two pods racing for the group.
const ROUNDS: usize = 3;

fn group_device() -> String {
    format!("group-{}", PAIR[0].replace([':', '.'], "-"))
}

fn function_device(address: &str) -> String {
    format!("pci-{}", address.replace([':', '.'], "-"))
}

fn manifests() -> String {
    let attrs = format!("device.attributes[\"{DRIVER}\"]");
    let template = |name: &str, selector: &str| {
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata:\n  \
             name: {name}\n  namespace: {NS}\nspec:\n  spec:\n    devices:\n      requests:\n      \
             - name: nic\n        exactly:\n          deviceClassName: {CLASS}\n{selector}"
        )
    };
    [
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata:\n  name: {CLASS}\nspec:\n  \
             selectors:\n  - cel:\n      expression: 'device.driver == \"{DRIVER}\" && \
             {attrs}.resourceName == \"{RESOURCE}\"'\n"
        ),
        template(ANY, ""),
        template(
            WHOLE,
            &format!(
                "          selectors:\n          - cel:\n              expression: \
                 '\"functionCount\" in {attrs} && {attrs}.functionCount == 2'\n"
            ),
        ),
    ]
    .join("---\n")
}

fn claim_pod(name: &str, template: &str) -> String {
    pod(
        name,
        SHOW,
        "    resources:\n      claims:\n        - name: nic\n",
        &format!(
            "  resourceClaims:\n    - name: nic\n      resourceClaimTemplateName: {template}\n"
        ),
    )
}

pub(super) fn dra_group_unsplittable(ctx: &mut Ctx) -> Result<Outcome> {
    ensure_ns(&ctx.plane, NS)?;
    restart_dra_with_list(
        ctx,
        "dual.json",
        &format!(r#"{{"resources":[{{"name":"{RESOURCE}","vendor":"8086","devices":["1521"]}}]}}"#),
    )?;
    let result = contest(ctx);
    // The node as found: the shipped resource list, no pod, class or template of ours.
    let plane = &ctx.plane;
    let _ = plane.kubectl(&["delete", "pods", "--all", "-n", NS, "--wait=true"]);
    let _ = plane.kubectl(&[
        "delete",
        "resourceclaimtemplate",
        ANY,
        WHOLE,
        "-n",
        NS,
        "--ignore-not-found",
    ]);
    let _ = plane.kubectl(&["delete", "deviceclass", CLASS, "--ignore-not-found"]);
    if let Some(mut d) = ctx.dra.take() {
        d.proc.stop();
    }
    result
}

/// Which model the slices show, checked against what the release should keep.
fn published_model(ctx: &Ctx) -> Result<bool> {
    let plane = &ctx.plane;
    let partitionable = gate_on(plane, 36);
    let group = group_device();
    let slices = wait_for(
        "our slices to offer the NIC's group",
        Duration::from_secs(30),
        || {
            let s = our_slices(plane)?;
            let has = |key: &str, name: &str| {
                s.iter().any(|sl| {
                    sl["spec"][key]
                        .as_array()
                        .is_some_and(|a| a.iter().any(|d| d["name"] == name))
                })
            };
            let ready = has("devices", &group)
                && (!partitionable || has("sharedCounters", &format!("iommu-group-{PAIR_GROUP}")));
            Ok(ready.then_some(s))
        },
    )?;
    let devices: Vec<&Value> = slices
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().into_iter().flatten())
        .collect();
    let names: Vec<&str> = devices.iter().filter_map(|d| d["name"].as_str()).collect();
    let sets: Vec<&Value> = slices
        .iter()
        .flat_map(|s| s["spec"]["sharedCounters"].as_array().into_iter().flatten())
        .collect();
    if partitionable {
        let want = [
            function_device(PAIR[0]),
            function_device(PAIR[1]),
            group.clone(),
        ];
        ensure!(
            names == want,
            "with partitionable devices on v1.{}: offered {names:?}, expected {want:?}",
            plane.release.minor
        );
        for d in &devices {
            let set = &d["consumesCounters"][0]["counterSet"];
            ensure!(
                *set == format!("iommu-group-{PAIR_GROUP}").as_str(),
                "device {} draws on {set}, not the group's counter set",
                d["name"]
            );
        }
        ensure!(sets.len() == 1, "counter sets: {sets:?}");
        // 1.34 wants a set beside its devices, 1.35 on apart from them.
        let beside = slices
            .iter()
            .any(|s| s["spec"]["sharedCounters"].is_array() && s["spec"]["devices"].is_array());
        ensure!(
            beside == (plane.release.minor < 35),
            "v1.{}: counter sets beside devices: {beside}",
            plane.release.minor
        );
    } else {
        ensure!(
            names == [group.as_str()],
            "without partitionable devices on v1.{}: offered {names:?}, expected the group alone",
            plane.release.minor
        );
        ensure!(sets.is_empty(), "counter sets kept: {sets:?}");
    }
    Ok(partitionable)
}

/// The pod's phase and whether it is unschedulable.
fn state(ctx: &Ctx, name: &str) -> Result<(String, bool)> {
    let p = ctx.plane.get_json(&["get", "pod", name, "-n", NS])?;
    let unschedulable = p["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable");
    Ok((
        p["status"]["phase"].as_str().unwrap_or_default().to_owned(),
        unschedulable,
    ))
}

/// The devices allocated to the claim of pod `pod`, if any.
fn allocated(ctx: &Ctx, pod: &str) -> Result<Vec<String>> {
    let p = ctx.plane.get_json(&["get", "pod", pod, "-n", NS])?;
    let Some(claim) = p["status"]["resourceClaimStatuses"][0]["resourceClaimName"].as_str() else {
        return Ok(Vec::new());
    };
    let c = ctx
        .plane
        .get_json(&["get", "resourceclaim", claim, "-n", NS])?;
    Ok(c["status"]["allocation"]["devices"]["results"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["device"].as_str().map(str::to_owned))
        .collect())
}

/// Two pods from `templates` at once: one runs, the other is unschedulable
/// with its claim unallocated while the first holds the group; once the first
/// is gone the second runs. Returns the device each was given and what it
/// showed, the winner first.
fn race(ctx: &Ctx, round: usize, templates: [&str; 2]) -> Result<[(String, String); 2]> {
    let plane = &ctx.plane;
    let pods = [format!("dual-{round}-a"), format!("dual-{round}-b")];
    for (p, t) in pods.iter().zip(templates) {
        plane.apply(&claim_pod(p, t))?;
    }
    let (winner, loser) = wait_for(
        &format!("round {round}: one pod running, the other unschedulable"),
        Duration::from_secs(90),
        || {
            let a = state(ctx, &pods[0])?;
            let b = state(ctx, &pods[1])?;
            if a.0 == "Running" && b.0 == "Running" {
                return Ok(Some(Err(anyhow::anyhow!("both pods run"))));
            }
            let (da, db) = (allocated(ctx, &pods[0])?, allocated(ctx, &pods[1])?);
            if !da.is_empty() && !db.is_empty() {
                return Ok(Some(Err(anyhow::anyhow!(
                    "the group split: {} got {da:?} and {} got {db:?}",
                    pods[0],
                    pods[1]
                ))));
            }
            Ok(match (a, b) {
                ((pa, _), (_, true)) if pa == "Running" => Some(Ok((0, 1))),
                ((_, true), (pb, _)) if pb == "Running" => Some(Ok((1, 0))),
                _ => None,
            })
        },
    )
    .and_then(|r| r)
    .map_err(|e| {
        eprintln!(
            "{}\n{}",
            describe(plane, &pods[0]),
            describe(plane, &pods[1])
        );
        e.context(format!("round {round}: pods {} and {}", pods[0], pods[1]))
    })?;
    let (winner, loser) = (&pods[winner], &pods[loser]);
    let out = pod_output(ctx, winner, Duration::from_secs(60))?;
    let got = allocated(ctx, winner)?;
    ensure!(got.len() == 1, "round {round}: {winner} got {got:?}");
    // The loser stays out while the winner holds the group.
    std::thread::sleep(Duration::from_secs(3));
    let held = allocated(ctx, loser)?;
    ensure!(
        held.is_empty(),
        "round {round}: the group split: {winner} got {got:?} and {loser} got {held:?}"
    );
    ensure!(
        state(ctx, loser)?.0 == "Pending",
        "round {round}: {loser} left Pending"
    );
    delete_pod(plane, winner)?;
    let after = pod_output(ctx, loser, Duration::from_secs(90))
        .with_context(|| format!("round {round}: {loser} never ran once {winner} was gone"))?;
    let next = allocated(ctx, loser)?;
    ensure!(next.len() == 1, "round {round}: {loser} got {next:?}");
    delete_pod(plane, loser)?;
    Ok([(got[0].clone(), out), (next[0].clone(), after)])
}

fn contest(ctx: &mut Ctx) -> Result<Outcome> {
    let partitionable = published_model(ctx)?;
    ctx.plane.apply(&manifests())?;
    let mut outcomes = Vec::new();
    for round in 0..ROUNDS {
        outcomes.push(race(ctx, round, [ANY, ANY])?);
    }
    // The whole group against one function (where functions are offered): a
    // race again.
    let second = if partitionable { ANY } else { WHOLE };
    outcomes.push(race(ctx, ROUNDS, [WHOLE, second])?);
    // A pod given the whole group sees both functions; one given a function
    // sees that function alone; each sees the group's node.
    let whole = format!("{VARIABLE}={},{}", PAIR[0], PAIR[1]);
    let group_node = format!("nodes: {PAIR_GROUP}");
    for (device, out) in outcomes.iter().flatten() {
        if *device == group_device() {
            ensure!(
                out.contains(&whole),
                "{device}: the pod lacks {whole}:\n{out}"
            );
        } else if !partitionable {
            bail!("without counters a pod got {device}, not the group");
        } else {
            let address = PAIR
                .iter()
                .find(|a| function_device(a) == *device)
                .with_context(|| format!("a pod got {device}, not the NIC's"))?;
            let own = format!("{VARIABLE}={address}\n");
            ensure!(out.contains(&own), "{device}: the pod lacks {own}:\n{out}");
        }
        ensure!(
            out.contains(&group_node),
            "{device}: the pod lacks /dev/vfio/{PAIR_GROUP}:\n{out}"
        );
    }
    ensure!(
        outcomes.iter().flatten().any(|(d, _)| *d == group_device()),
        "no pod was given the whole group"
    );
    let notes: Vec<String> = outcomes
        .iter()
        .map(|[(a, _), (b, _)]| format!("{a}→{b}"))
        .collect();
    println!(
        "     ({} model; devices per round, winner→loser: {})",
        if partitionable {
            "counter set"
        } else {
            "group device"
        },
        notes.join(", ")
    );
    Ok(Outcome::Passed)
}
