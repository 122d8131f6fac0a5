//! What every test node's kubelet is configured with, on the host and in the guest.

/// The KubeletConfiguration every test node starts from
/// (k8s.io/kubelet/config/v1beta1/types.go): serving on `address:port` without
/// authentication, the cgroupfs driver, no swap check and no resolv.conf, the
/// runtime at `runtime`, eviction and image GC out of the way of a small disk,
/// and pod and node status synced every 5 s.
pub fn config(address: &str, port: u16, runtime: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": address,
        "port": port,
        "readOnlyPort": 0,
        "healthzPort": 0,
        "authentication": {
            "anonymous": {"enabled": true},
            "webhook": {"enabled": false},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        "failSwapOn": false,
        "resolvConf": "",
        "containerRuntimeEndpoint": runtime,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "syncFrequency": "5s",
        "nodeStatusUpdateFrequency": "5s",
    })
}
