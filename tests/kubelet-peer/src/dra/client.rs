//! The DRA service as kubelet calls it: `NodePrepareResources` and
//! `NodeUnprepareResources` on v1 or v1beta1, and their per-claim answers.

use super::*;

/// What a claim's prepare came back with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Prepared {
    /// The devices, as listed.
    pub devices: Vec<PreparedDevice>,
    /// Empty on success.
    pub error: String,
}

/// What a claim's unprepare came back with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Unprepared {
    /// Empty on success.
    pub error: String,
}

/// A response's claims by uid, sorted, with kubelet's verdict on them.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Answer<T> {
    /// The response's entries, keyed by claim uid.
    pub claims: BTreeMap<String, T>,
}

/// A prepare response.
pub type PrepareResult = Answer<Prepared>;
/// An unprepare response.
pub type UnprepareResult = Answer<Unprepared>;

/// An entry's error message, whatever the call.
pub trait ClaimError {
    /// Empty on success.
    fn error(&self) -> &str;
}

impl ClaimError for Prepared {
    fn error(&self) -> &str {
        &self.error
    }
}

impl ClaimError for Unprepared {
    fn error(&self) -> &str {
        &self.error
    }
}

impl<T: ClaimError> Answer<T> {
    /// Why kubelet would fail the call for these `asked` claims: an entry for a uid
    /// not asked about, an asked uid left out, a claim whose error is set. Empty
    /// when every claim succeeded.
    pub fn problems(&self, asked: &[ClaimRef]) -> Vec<String> {
        let mut out = Vec::new();
        for (uid, a) in &self.claims {
            if !asked.iter().any(|c| &c.uid == uid) {
                out.push(format!(
                    "answer for claim uid {uid:?} that was not asked about"
                ));
            } else if !a.error().is_empty() {
                out.push(format!("claim {uid}: {}", a.error()));
            }
        }
        let mut left_out: Vec<&str> = asked
            .iter()
            .map(|c| c.uid.as_str())
            .filter(|u| !self.claims.contains_key(*u))
            .collect();
        left_out.sort();
        left_out.dedup();
        out.extend(
            left_out
                .into_iter()
                .map(|u| format!("claim {u} left out of the answer")),
        );
        out
    }

    /// The answer as one line of JSON, maps sorted.
    pub fn to_json(&self) -> String
    where
        T: serde::Serialize,
    {
        serde_json::to_string(self)
            .unwrap_or_else(|e| format!("{{\"json_error\":{:?}}}", e.to_string()))
    }
}

/// A `DRAPlugin` client in one version.
#[derive(Debug, Clone)]
pub enum Dra {
    /// Speaks v1.
    V1(v1::dra_plugin_client::DraPluginClient<Channel>),
    /// Speaks v1beta1.
    V1beta1(v1beta1::dra_plugin_client::DraPluginClient<Channel>),
}

macro_rules! to_wire {
    ($v:ident, $claims:expr) => {
        $claims
            .iter()
            .map(|c| $v::Claim {
                namespace: c.namespace.clone(),
                uid: c.uid.clone(),
                name: c.name.clone(),
            })
            .collect()
    };
}

macro_rules! prepared {
    ($resp:expr) => {
        $resp
            .claims
            .into_iter()
            .map(|(uid, r)| {
                let devices = r
                    .devices
                    .into_iter()
                    .map(|d| PreparedDevice {
                        request_names: d.request_names,
                        pool_name: d.pool_name,
                        device_name: d.device_name,
                        cdi_device_ids: d.cdi_device_ids,
                    })
                    .collect();
                (
                    uid,
                    Prepared {
                        devices,
                        error: r.error,
                    },
                )
            })
            .collect()
    };
}

impl Dra {
    /// Connects to the service socket at `endpoint`, speaking `version`, sending
    /// `:authority` `localhost` (kubelet 1.33 and later).
    pub async fn connect(endpoint: &Path, version: Version) -> anyhow::Result<Self> {
        Self::connect_with_authority(endpoint, version, crate::grpcgo::LOCALHOST).await
    }

    /// Connects as kubelet `kubelet`'s DRA client does
    /// ([`KubeletVersion::dra_authority`]).
    pub async fn connect_as(
        endpoint: &Path,
        version: Version,
        kubelet: KubeletVersion,
    ) -> anyhow::Result<Self> {
        Self::connect_with_authority(endpoint, version, &kubelet.dra_authority(endpoint)).await
    }

    /// Connects to the service socket at `endpoint`, speaking `version`, with every
    /// request's `:authority` set to `authority`.
    pub async fn connect_with_authority(
        endpoint: &Path,
        version: Version,
        authority: &str,
    ) -> anyhow::Result<Self> {
        let channel = kubelet_api::unix_channel_with_authority(endpoint, authority)
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to {}: {e}", endpoint.display()))?;
        Ok(match version {
            Version::V1 => Dra::V1(v1::dra_plugin_client::DraPluginClient::new(channel)),
            Version::V1beta1 => {
                Dra::V1beta1(v1beta1::dra_plugin_client::DraPluginClient::new(channel))
            }
        })
    }

    /// The version this client speaks.
    pub fn version(&self) -> Version {
        match self {
            Dra::V1(_) => Version::V1,
            Dra::V1beta1(_) => Version::V1beta1,
        }
    }

    /// `NodePrepareResources` for `claims`, in the order given.
    pub async fn prepare(&mut self, claims: &[ClaimRef]) -> Result<PrepareResult, tonic::Status> {
        let claims = match self {
            Dra::V1(c) => {
                let r = c
                    .node_prepare_resources(v1::NodePrepareResourcesRequest {
                        claims: to_wire!(v1, claims),
                    })
                    .await?
                    .into_inner();
                prepared!(r)
            }
            Dra::V1beta1(c) => {
                let r = c
                    .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
                        claims: to_wire!(v1beta1, claims),
                    })
                    .await?
                    .into_inner();
                prepared!(r)
            }
        };
        Ok(Answer { claims })
    }

    /// `NodeUnprepareResources` for `claims`, in the order given.
    pub async fn unprepare(
        &mut self,
        claims: &[ClaimRef],
    ) -> Result<UnprepareResult, tonic::Status> {
        let claims = match self {
            Dra::V1(c) => c
                .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                    claims: to_wire!(v1, claims),
                })
                .await?
                .into_inner()
                .claims
                .into_iter()
                .map(|(uid, r)| (uid, Unprepared { error: r.error }))
                .collect(),
            Dra::V1beta1(c) => c
                .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
                    claims: to_wire!(v1beta1, claims),
                })
                .await?
                .into_inner()
                .claims
                .into_iter()
                .map(|(uid, r)| (uid, Unprepared { error: r.error }))
                .collect(),
        };
        Ok(Answer { claims })
    }
}
