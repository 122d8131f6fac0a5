//! Conditions on a claim's allocated devices (`status.devices`), as a driver with
//! binding conditions writes them for the scheduler (KEP-5007): read fresh, change
//! only this driver's entries, update the status subresource, read again on a
//! conflict — what upstream's drivers and tests do
//! (`test/integration/dra/binding_conditions_test.go`: Get, change,
//! `UpdateStatus` in `RetryOnConflict`).

use std::time::Duration;

use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::PostParams;
use kube::{Api, Client};
use support::error_chain;

use crate::api::{ATTEMPTS, REQUEST_TIMEOUT};
use crate::ClaimRef;

/// A condition's message is cut to this many bytes (the API allows 32768).
const CONDITION_MESSAGE_MAX: usize = 4096;

/// A condition to set `True`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceCondition {
    /// Its type (`<driver>/VfioReady`, say).
    pub type_: String,
    /// Why, in CamelCase.
    pub reason: String,
    /// For people; cut to 4096 bytes (the API allows 32768).
    pub message: String,
}

/// How a status write ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// The server kept our entries.
    Kept,
    /// The server dropped `status.devices` (its `DRAResourceClaimDeviceStatus`
    /// gate is off).
    Dropped,
    /// The claim is gone, or no longer what the write was for.
    Gone,
}

/// The write failed every attempt.
#[derive(Debug, thiserror::Error)]
#[error("update of ResourceClaim {claim} status failed {ATTEMPTS} times: {last}")]
#[non_exhaustive]
pub struct StatusError {
    /// The claim, `namespace/name`.
    pub claim: String,
    /// The last failure.
    pub last: String,
}

/// One driver's entries in claims' `status.devices`, in one pool.
#[derive(Clone)]
pub struct DeviceStatus {
    /// The API server.
    pub client: Client,
    /// The driver name.
    pub driver: String,
    /// The pool of the devices.
    pub pool: String,
}

impl DeviceStatus {
    /// Sets `condition` on each of `devices` in `claim`'s `status.devices`, keeping
    /// every other entry and condition. `still_for` is asked of each fresh read:
    /// `false` (the allocation changed, say) writes nothing ([`Written::Gone`]).
    /// `generation` is the condition's `observedGeneration` when the claim read
    /// has none.
    pub async fn set_condition(
        &self,
        claim: &ClaimRef,
        devices: &[String],
        condition: &DeviceCondition,
        generation: Option<i64>,
        still_for: impl Fn(&ResourceClaim) -> bool,
    ) -> Result<Written, StatusError> {
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &claim.namespace);
        let mut last = String::new();
        for _ in 0..ATTEMPTS {
            let found = match tokio::time::timeout(REQUEST_TIMEOUT, api.get_opt(&claim.name)).await
            {
                Ok(Ok(Some(c))) => c,
                Ok(Ok(None)) => return Ok(Written::Gone),
                Ok(Err(e)) => {
                    last = error_chain(&e);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                Err(_) => {
                    last = format!("get timed out after {REQUEST_TIMEOUT:?}");
                    continue;
                }
            };
            if !still_for(&found) {
                return Ok(Written::Gone);
            }
            let mut fresh = found;
            let generation = fresh.metadata.generation.or(generation);
            let entries = fresh
                .status
                .get_or_insert_with(Default::default)
                .devices
                .get_or_insert_with(Vec::new);
            for device in devices {
                let entry = self.entry(entries, device);
                set_condition(
                    entry.conditions.get_or_insert_with(Vec::new),
                    condition,
                    generation,
                );
            }
            let params = PostParams::default();
            let update = api.replace_status(&claim.name, &params, &fresh);
            match tokio::time::timeout(REQUEST_TIMEOUT, update).await {
                Ok(Ok(written)) => {
                    let kept = written
                        .status
                        .as_ref()
                        .and_then(|s| s.devices.as_deref())
                        .is_some_and(|d| d.iter().any(|e| e.driver == self.driver));
                    return Ok(if kept {
                        Written::Kept
                    } else {
                        Written::Dropped
                    });
                }
                Ok(Err(kube::Error::Api(s))) if s.code == 409 => last = s.message,
                Ok(Err(kube::Error::Api(s))) if s.code == 404 => return Ok(Written::Gone),
                Ok(Err(e)) => {
                    last = error_chain(&e);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(_) => last = format!("update timed out after {REQUEST_TIMEOUT:?}"),
            }
        }
        Err(StatusError {
            claim: format!("{}/{}", claim.namespace, claim.name),
            last,
        })
    }

    /// Our entry for `device` (no share id), added when missing.
    fn entry<'e>(
        &self,
        entries: &'e mut Vec<AllocatedDeviceStatus>,
        device: &str,
    ) -> &'e mut AllocatedDeviceStatus {
        let at = entries.iter().position(|e| {
            e.driver == self.driver
                && e.pool == self.pool
                && e.device == device
                && e.share_id.is_none()
        });
        let at = at.unwrap_or_else(|| {
            entries.push(AllocatedDeviceStatus {
                driver: self.driver.clone(),
                pool: self.pool.clone(),
                device: device.to_owned(),
                ..AllocatedDeviceStatus::default()
            });
            entries.len() - 1
        });
        &mut entries[at]
    }
}

/// Sets `condition` to `True` as `meta.SetStatusCondition` does
/// (`k8s.io/apimachinery/pkg/api/meta/conditions.go`): the transition time moves
/// only when the status changes; reason, message and generation are updated.
pub(crate) fn set_condition(
    conditions: &mut Vec<Condition>,
    condition: &DeviceCondition,
    generation: Option<i64>,
) {
    let mut message = condition.message.clone();
    if message.len() > CONDITION_MESSAGE_MAX {
        let mut cut = CONDITION_MESSAGE_MAX;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
    }
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    match conditions.iter_mut().find(|c| c.type_ == condition.type_) {
        Some(c) => {
            if c.status != "True" {
                c.status = "True".into();
                c.last_transition_time = now;
            }
            c.reason.clone_from(&condition.reason);
            c.message = message;
            c.observed_generation = generation;
        }
        None => conditions.push(Condition {
            type_: condition.type_.clone(),
            status: "True".into(),
            reason: condition.reason.clone(),
            message,
            observed_generation: generation,
            last_transition_time: now,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(message: &str) -> DeviceCondition {
        DeviceCondition {
            type_: "d/VfioReady".into(),
            reason: "MovedToVfio".into(),
            message: message.into(),
        }
    }

    #[test]
    fn set_condition_keeps_the_transition_time_while_the_status_stays() {
        let mut c = Vec::new();
        set_condition(&mut c, &ready("one"), Some(1));
        let first = c[0].last_transition_time.clone();
        set_condition(&mut c, &ready("two"), Some(2));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].last_transition_time, first);
        assert_eq!(
            (c[0].message.as_str(), c[0].observed_generation),
            ("two", Some(2))
        );
        c[0].status = "False".into();
        std::thread::sleep(Duration::from_millis(2));
        set_condition(&mut c, &ready("three"), None);
        assert_eq!(c[0].status, "True");
        assert_ne!(c[0].last_transition_time, first);
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary() {
        let mut c = Vec::new();
        set_condition(&mut c, &ready(&"é".repeat(5000)), None);
        assert!(c[0].message.len() <= CONDITION_MESSAGE_MAX);
        assert!(c[0].message.chars().all(|ch| ch == 'é'));
    }
}
