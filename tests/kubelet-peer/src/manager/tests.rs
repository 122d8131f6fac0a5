use super::checkpoint::{checkpoint_json, read_checkpoint};
use super::*;

#[test]
fn the_checkpoint_is_kubelets_format_and_checksum() {
    // The Data and Checksum of upstream's own test checkpoint
    // (`pkg/kubelet/cm/dra/state/state_checkpoint_test.go`).
    let data = r#"{"kind":"DRACheckpoint","apiVersion":"checkpoint.dra.kubelet.k8s.io/v1","ClaimInfoStateList":[{"ClaimUID":"067798be-454e-4be4-9047-1aa06aea63f7","ClaimName":"example","Namespace":"default","PodUIDs":{"139cdb46-f989-4f17-9561-ca10cfb509a6":{}},"DriverState":{"test-driver.cdi.k8s.io":{"Devices":[{"PoolName":"worker-1","DeviceName":"dev-1","RequestNames":["test request"],"CDIDeviceIDs":["example.com/example=cdi-example"]}]}}}]}"#;
    assert_eq!(crc32_ieee(data.as_bytes()), 1_656_016_162);
    let text = format!("{{\"Data\":{},\"Checksum\":1656016162}}", json!(data));
    let claims = read_checkpoint(&text).unwrap();
    let c = &claims[&("default".to_owned(), "example".to_owned())];
    assert!(!c.prepared, "a restart forgets what was prepared");
    assert_eq!(checkpoint_json(&claims), text, "written back byte for byte");
    assert!(read_checkpoint(&text.replace("1656016162", "1")).is_err());
}

#[test]
fn query_values_are_escaped_as_go_does() {
    assert_eq!(
        percent_encode_query("spec.driver=d.example.com,spec.nodeName=n 1"),
        "spec.driver%3Dd.example.com%2Cspec.nodeName%3Dn+1"
    );
}
