//! Warning Events on ResourceClaims, for people: a failed prepare, a failed early
//! move.

use kubelet_plugin::ClaimRef;
use node_agent::cluster::Cluster;
use support::error_chain;

use crate::claims::Failure;

/// Posts a Warning Event on `claim` in its namespace (where `kubectl describe
/// resourceclaim` and the pod's owner look), in the background: `failure` gives its
/// reason, `action` says what failed (`PrepareResources`, `MoveBeforeBinding`),
/// `note` why.
pub(crate) fn post_warning(
    cluster: &Cluster,
    claim: &ClaimRef,
    failure: Failure,
    action: &'static str,
    note: String,
) {
    let cluster = cluster.clone();
    let claim = claim.clone();
    let reason = failure.event_reason();
    tokio::spawn(async move {
        let what = format!(
            "post Event {reason} on ResourceClaim {}/{}",
            claim.namespace, claim.name
        );
        let reference = claim.object_reference();
        if let Err(e) = cluster
            .event(&reference, &what, true, reason, action, &note)
            .await
        {
            tracing::debug!(claim = %claim, error = %error_chain(&e),
                "cannot post an Event on the claim");
        }
    });
}
