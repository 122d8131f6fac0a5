//! Kubernetes' own rules for whether a DaemonSet's pod keeps running on a node,
//! transcribed: the template's node name, node selector and required node
//! affinity against the Node's labels, and its tolerations (with the ones the
//! DaemonSet controller adds) against the Node's `NoExecute` taints.
//!
//! Upstream: `NodeShouldRunDaemonPod`'s `shouldContinueRunning`
//! (kubernetes `pkg/controller/daemon/daemon_controller.go`), the scheduler's
//! node affinity (`component-helpers/scheduling/corev1/nodeaffinity`), and
//! `Toleration.ToleratesTaint` (`staging/src/k8s.io/api/core/v1/toleration.go`).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, Pod, PodSpec, Taint, Toleration};

/// Whether `spec` (a pod template) would be scheduled onto `node` by its node
/// selector and required node affinity; `Err` names the first requirement the
/// node's labels do not meet.
pub fn node_selected(spec: &PodSpec, node: &Node) -> Result<(), String> {
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let name = node.metadata.name.as_deref().unwrap_or("");
    // A template naming a node runs only there (`NodeShouldRunDaemonPod`).
    if let Some(wanted) = spec.node_name.as_deref().filter(|n| !n.is_empty()) {
        if wanted != name {
            return Err(format!("the pod template names node {wanted}"));
        }
    }
    for (k, v) in spec.node_selector.iter().flatten() {
        match labels.get(k) {
            Some(have) if have == v => {}
            Some(have) => return Err(format!("label {k}={have}, the node selector wants {k}={v}")),
            None => {
                return Err(format!(
                    "label {k} is gone, the node selector wants {k}={v}"
                ))
            }
        }
    }
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    let Some(required) = required else {
        return Ok(());
    };
    // Terms are ORed; within a term every expression and field must hold. A term
    // with neither matches nothing (as in the scheduler).
    let mut why = Vec::new();
    for term in &required.node_selector_terms {
        let exprs = term.match_expressions.as_deref().unwrap_or(&[]);
        let fields = term.match_fields.as_deref().unwrap_or(&[]);
        if exprs.is_empty() && fields.is_empty() {
            why.push("an empty node selector term".to_owned());
            continue;
        }
        let failed = exprs
            .iter()
            .find_map(|r| requirement_holds(r, labels.get(&r.key).map(String::as_str)).err())
            .or_else(|| {
                fields.iter().find_map(|r| {
                    let value = (r.key == "metadata.name").then_some(name);
                    requirement_holds(r, value).err()
                })
            });
        match failed {
            None => return Ok(()),
            Some(w) => why.push(w),
        }
    }
    Err(format!(
        "no required node affinity term matches ({})",
        why.join("; ")
    ))
}

/// The tolerations the DaemonSet controller adds to every pod it makes, besides the
/// template's own (`AddOrUpdateDaemonPodTolerations`, kubernetes
/// `pkg/controller/daemon/util/daemonset_util.go`). Only the `NoExecute` ones matter
/// to a running pod: `node.kubernetes.io/not-ready` and `node.kubernetes.io/unreachable`,
/// key `Exists`, any value, no time limit.
const DAEMON_POD_NO_EXECUTE_TOLERATIONS: [&str; 2] = [
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
];

/// Whether a pod of `spec` may keep running on `node` as far as taints go: every
/// `NoExecute` taint of the node is tolerated by the template or by the DaemonSet
/// controller's own tolerations (`NodeShouldRunDaemonPod`: `NoSchedule` taints stop new
/// pods only). `Err` names the first taint that would evict the pod.
pub fn tolerates_no_execute(spec: &PodSpec, node: &Node) -> Result<(), String> {
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or(&[]);
    let tolerations = spec.tolerations.as_deref().unwrap_or(&[]);
    let evicting = taints.iter().filter(|t| t.effect == "NoExecute").find(|t| {
        !DAEMON_POD_NO_EXECUTE_TOLERATIONS.contains(&t.key.as_str())
            && !tolerations.iter().any(|tol| tolerates(tol, t))
    });
    match evicting {
        None => Ok(()),
        Some(t) => Err(format!(
            "taint {}{}:NoExecute is not tolerated, so the DaemonSet controller evicts its pod",
            t.key,
            t.value
                .as_deref()
                .map(|v| format!("={v}"))
                .unwrap_or_default()
        )),
    }
}

/// `Toleration.ToleratesTaint` (kubernetes `staging/src/k8s.io/api/core/v1/toleration.go`):
/// an empty effect or key matches any; operator `Exists` matches any value, `Equal`
/// (or empty) the same value; any other operator matches nothing.
fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    let effect = tol.effect.as_deref().unwrap_or("");
    let key = tol.key.as_deref().unwrap_or("");
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match tol.operator.as_deref().unwrap_or("") {
        "" | "Equal" => tol.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
        "Exists" => true,
        _ => false,
    }
}

fn requirement_holds(r: &NodeSelectorRequirement, value: Option<&str>) -> Result<(), String> {
    let values = r.values.as_deref().unwrap_or(&[]);
    let number = |s: &str| s.trim().parse::<i64>().ok();
    let holds = match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| values.iter().all(|x| x != v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => match (
            value.and_then(number),
            values.first().and_then(|x| number(x)),
        ) {
            (Some(have), Some(bound)) if r.operator == "Gt" => have > bound,
            (Some(have), Some(bound)) => have < bound,
            _ => false,
        },
        _ => false,
    };
    if holds {
        Ok(())
    } else {
        Err(format!(
            "{} {} {:?} is not met by {}",
            r.key,
            r.operator,
            values,
            value.map_or_else(|| "its absence".to_owned(), |v| format!("{v:?}"))
        ))
    }
}

/// The name of the DaemonSet that controls `pod`.
pub fn daemonset_owner(pod: &Pod) -> Option<String> {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| {
            o.controller == Some(true)
                && o.kind == "DaemonSet"
                && o.api_version.starts_with("apps/")
        })
        .map(|o| o.name.clone())
}

#[cfg(test)]
pub(crate) mod tests;
