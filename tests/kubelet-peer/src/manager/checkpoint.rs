//! kubelet's DRA checkpoint (`pkg/kubelet/cm/dra/state`): the `ClaimInfo` it
//! keeps per claim, and the checkpoint file's JSON and checksum, byte for byte.

use super::*;

/// The DRA manager's `ClaimInfo` (`pkg/kubelet/cm/dra/claiminfo.go`): the
/// checkpointed `ClaimInfoState` and the in-memory `prepared` flag, which a
/// restart resets (`newClaimInfoFromState`).
#[derive(Debug, Clone)]
pub(super) struct ClaimInfo {
    pub(super) uid: String,
    pub(super) name: String,
    pub(super) namespace: String,
    pub(super) pod_uids: BTreeSet<String>,
    pub(super) drivers: BTreeMap<String, Vec<PreparedDevice>>,
    pub(super) prepared: bool,
}

impl ClaimInfo {
    pub(super) fn claim_ref(&self) -> ClaimRef {
        ClaimRef {
            uid: self.uid.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }
}

/// crc32 (IEEE), what `hash/crc32.ChecksumIEEE` computes over the checkpoint's
/// `Data`.
pub fn crc32_ieee(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// `state.Device` (`pkg/kubelet/cm/dra/state/state.go`), fields in Go's order.
#[derive(Serialize)]
pub(super) struct CheckpointDevice<'a> {
    #[serde(rename = "PoolName")]
    pool_name: &'a str,
    #[serde(rename = "DeviceName")]
    device_name: &'a str,
    #[serde(rename = "RequestNames")]
    request_names: Value,
    #[serde(rename = "CDIDeviceIDs")]
    cdi_device_ids: Value,
}

/// The checkpoint as kubelet writes it (`pkg/kubelet/cm/dra/state/checkpoint.go`):
/// `{"Data": <JSON of {kind: DRACheckpoint, apiVersion:
/// checkpoint.dra.kubelet.k8s.io/v1, ClaimInfoStateList: [...]}>, "Checksum":
/// crc32(Data)}`; each entry a `ClaimInfoState` (`state.go`) with Go's field
/// names, `PodUIDs` a set (`{"uid":{}}`), nil slices `null`.
pub(super) fn checkpoint_json(claims: &BTreeMap<(String, String), ClaimInfo>) -> String {
    let nil_or = |v: &Vec<String>| if v.is_empty() { Value::Null } else { json!(v) };
    let list: Vec<String> = claims
        .values()
        .map(|c| {
            let pods: serde_json::Map<String, Value> =
                c.pod_uids.iter().map(|p| (p.clone(), json!({}))).collect();
            let drivers: Vec<String> = c
                .drivers
                .iter()
                .map(|(d, devs)| {
                    let devices: Vec<String> = devs
                        .iter()
                        .map(|x| {
                            serde_json::to_string(&CheckpointDevice {
                                pool_name: &x.pool_name,
                                device_name: &x.device_name,
                                request_names: nil_or(&x.request_names),
                                cdi_device_ids: nil_or(&x.cdi_device_ids),
                            })
                            .unwrap_or_default()
                        })
                        .collect();
                    let devices = if devices.is_empty() {
                        "null".to_owned()
                    } else {
                        format!("[{}]", devices.join(","))
                    };
                    format!("{}:{{\"Devices\":{devices}}}", json!(d))
                })
                .collect();
            // Go marshals struct fields in declaration order; serde_json's Map
            // sorts keys, so the entry is spelled out in order.
            format!(
                "{{\"ClaimUID\":{},\"ClaimName\":{},\"Namespace\":{},\"PodUIDs\":{},\"DriverState\":{{{}}}}}",
                json!(c.uid),
                json!(c.name),
                json!(c.namespace),
                Value::Object(pods),
                drivers.join(",")
            )
        })
        .collect();
    let data = format!(
        "{{\"kind\":\"DRACheckpoint\",\"apiVersion\":\"checkpoint.dra.kubelet.k8s.io/v1\",\"ClaimInfoStateList\":{}}}",
        if list.is_empty() { "null".to_owned() } else { format!("[{}]", list.join(",")) }
    );
    let sum = crc32_ieee(data.as_bytes());
    format!("{{\"Data\":{},\"Checksum\":{sum}}}", json!(data))
}

/// Reads a checkpoint; a checksum mismatch is an error, as kubelet refuses to
/// start on a corrupt checkpoint (`checkpointmanager`, `ErrCorruptCheckpoint`).
pub(super) fn read_checkpoint(text: &str) -> anyhow::Result<BTreeMap<(String, String), ClaimInfo>> {
    let outer: Value = serde_json::from_str(text)?;
    let data = outer["Data"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("checkpoint has no Data"))?;
    let sum = outer["Checksum"].as_u64();
    anyhow::ensure!(
        sum == Some(u64::from(crc32_ieee(data.as_bytes()))),
        "checkpoint is corrupted"
    );
    let data: Value = serde_json::from_str(data)?;
    // Later releases name the list `Entries`.
    let list = data
        .get("ClaimInfoStateList")
        .or_else(|| data.get("Entries"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = BTreeMap::new();
    for e in list {
        let s = |k: &str| e[k].as_str().unwrap_or_default().to_owned();
        let pod_uids = e["PodUIDs"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        let mut drivers = BTreeMap::new();
        if let Some(m) = e["DriverState"].as_object() {
            for (d, st) in m {
                let devices = st["Devices"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|x| PreparedDevice {
                                request_names: strings(&x["RequestNames"]),
                                pool_name: x["PoolName"].as_str().unwrap_or_default().into(),
                                device_name: x["DeviceName"].as_str().unwrap_or_default().into(),
                                cdi_device_ids: strings(&x["CDIDeviceIDs"]),
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                drivers.insert(d.clone(), devices);
            }
        }
        let info = ClaimInfo {
            uid: s("ClaimUID"),
            name: s("ClaimName"),
            namespace: s("Namespace"),
            pod_uids,
            drivers,
            prepared: false,
        };
        out.insert((info.namespace.clone(), info.name.clone()), info);
    }
    Ok(out)
}
