//! The plugin's API-server side against a stand-in API server, over real HTTP,
//! through the real kube-rs client: the node's ResourceSlice is created, updated
//! (alone at its generation, or the whole pool at a new one), left alone when
//! nothing changed, rewritten after a
//! conflict, cleaned of strays and deleted on uninstall; a ResourceClaim's
//! allocation is read and checked.
//!
//! One file on purpose: every test plays against the one
//! stand-in API server and node defined at the top.

use std::collections::BTreeMap;

use crate::claim::read_claim;
use crate::slices::{slice_names, Slices};
use crate::{Action, AllocatedDevice, ClaimRef, ReadError, SliceError, Ticket};
use fake_apiserver::objects::{self, DeviceResult};
use fake_apiserver::{paths, FakeApiServer};
use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCounterConsumption,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{json, Value};

const NODE: &str = "node-a";
const DRIVER: &str = "vfio-sandbox.rebellions.ai";
const SLICE: &str = "node-a-vfio-sandbox-rebellions-ai";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A client on `rt` (its connection worker runs on that runtime).
fn client(rt: &tokio::runtime::Runtime, s: &FakeApiServer) -> kube::Client {
    let _in = rt.enter();
    kube::Client::try_from(kube::Config::new(s.url().parse().unwrap())).unwrap()
}

fn server() -> FakeApiServer {
    let s = FakeApiServer::start().unwrap();
    s.put(&paths::node(NODE), objects::node(NODE, &[]));
    s
}

fn string(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.into()),
        ..DeviceAttribute::default()
    }
}

fn int(i: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i),
        ..DeviceAttribute::default()
    }
}

/// A NIC as a passthrough driver offers it, and one more.
fn devices(with_second: bool) -> Vec<Device> {
    let nic = |name: &str, bdf: &str, group: i64| Device {
        name: name.into(),
        attributes: Some(BTreeMap::from([
            ("deviceID".into(), string("0x10d3")),
            ("iommuGroup".into(), int(group)),
            ("resource.kubernetes.io/pciBusID".into(), string(bdf)),
            (
                "resource.kubernetes.io/pcieRoot".into(),
                string("pci0000:00"),
            ),
            ("resourceName".into(), string("example.com/NIC_PT")),
            ("vendorID".into(), string("0x8086")),
        ])),
        ..Device::default()
    };
    let mut first = nic("pci-0000-01-00-0", "0000:01:00.0", 6);
    if let Some(a) = first.attributes.as_mut() {
        a.insert("numaNode".into(), int(0));
    }
    let mut all = vec![first];
    if with_second {
        all.push(nic("pci-0000-02-00-0", "0000:02:00.0", 7));
    }
    all
}

fn ours(s: &FakeApiServer) -> Vec<Value> {
    s.list(&paths::resourceslices())
        .into_iter()
        .filter(|o| o["spec"]["driver"] == DRIVER && o["spec"]["nodeName"] == NODE)
        .collect()
}

fn writes(s: &FakeApiServer) -> Vec<String> {
    s.requests()
        .into_iter()
        .filter(|(m, _)| m != "GET")
        .map(|(m, p)| format!("{m} {}", p.trim_end_matches('?')))
        .collect()
}

#[test]
fn reconcile_creates_the_node_slice_with_pool_owner_and_attributes() {
    let s = server();
    let rt = rt();
    let report = rt
        .block_on(Slices::new(client(&rt, &s), DRIVER, NODE).reconcile(&devices(false)))
        .unwrap();
    assert_eq!((report.action, report.generation), (Action::Created, 1));
    assert_eq!(report.names, [SLICE]);
    let slice = s.get(&paths::resourceslice(SLICE)).unwrap();
    assert_eq!(slice["apiVersion"], "resource.k8s.io/v1");
    assert_eq!(slice["kind"], "ResourceSlice");
    assert_eq!(slice["spec"]["driver"], DRIVER);
    assert_eq!(slice["spec"]["nodeName"], NODE);
    assert_eq!(
        slice["spec"]["pool"],
        json!({"name": NODE, "generation": 1, "resourceSliceCount": 1})
    );
    assert_eq!(
        slice["metadata"]["ownerReferences"],
        json!([{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "uid-node-node-a", "controller": true}])
    );
    assert_eq!(
        slice["spec"]["devices"],
        json!([{
            "name": "pci-0000-01-00-0",
            "attributes": {
                "deviceID": {"string": "0x10d3"},
                "iommuGroup": {"int": 6},
                "numaNode": {"int": 0},
                "resource.kubernetes.io/pciBusID": {"string": "0000:01:00.0"},
                "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
                "resourceName": {"string": "example.com/NIC_PT"},
                "vendorID": {"string": "0x8086"},
            },
        }]),
        "the devices as given"
    );
    let listed: Vec<String> = s
        .requests()
        .into_iter()
        .filter(|(m, p)| m == "GET" && p.starts_with(&paths::resourceslices()))
        .map(|(_, p)| p)
        .collect();
    assert_eq!(
        listed,
        [format!(
            "{}?&fieldSelector=spec.nodeName%3D{NODE}%2Cspec.driver%3D{DRIVER}",
            paths::resourceslices()
        )]
    );
}

/// A pool of one slice is one write whatever changes: it is rewritten at its
/// generation (the Go ResourceSlice controller's "at most one update API call is
/// necessary"), so no consumer ever sees two generations of it.
#[test]
fn a_change_to_one_slice_is_written_in_place_and_no_change_writes_nothing() {
    let s = server();
    let rt = rt();
    let mut slices = Slices::new(client(&rt, &s), DRIVER, NODE);
    rt.block_on(slices.reconcile(&devices(false))).unwrap();
    let uid = s.get(&paths::resourceslice(SLICE)).unwrap()["metadata"]["uid"].clone();

    s.clear_requests();
    let r = rt.block_on(slices.reconcile(&devices(true))).unwrap();
    assert_eq!((r.action, r.generation, r.updated), (Action::Updated, 1, 1));
    assert_eq!(writes(&s), [format!("PUT {}", paths::resourceslice(SLICE))]);
    let slice = s.get(&paths::resourceslice(SLICE)).unwrap();
    assert_eq!(slice["metadata"]["uid"], uid, "updated in place");
    assert_eq!(slice["spec"]["pool"]["generation"], 1);
    assert_eq!(slice["spec"]["devices"].as_array().unwrap().len(), 2);

    s.clear_requests();
    let r = rt.block_on(slices.reconcile(&devices(true))).unwrap();
    assert_eq!((r.action, r.generation), (Action::Unchanged, 1));
    assert!(writes(&s).is_empty(), "{:?}", writes(&s));
    assert_eq!(
        s.requests().len(),
        2,
        "the Node (its uid may have changed) and one list"
    );

    // Devices withdrawn: the slice stays, empty.
    let r = rt.block_on(slices.reconcile(&[])).unwrap();
    assert_eq!((r.action, r.generation), (Action::Updated, 1));
    let slice = s.get(&paths::resourceslice(SLICE)).unwrap();
    assert_eq!(slice["spec"]["devices"], json!([]));
}

#[test]
fn a_concurrent_write_is_retried_and_a_persistent_one_reported() {
    let s = server();
    let rt = rt();
    let mut slices = Slices::new(client(&rt, &s), DRIVER, NODE);
    rt.block_on(slices.reconcile(&devices(false))).unwrap();

    s.clear_requests();
    s.race_next("PUT", 1);
    let r = rt.block_on(slices.reconcile(&devices(true))).unwrap();
    assert_eq!((r.action, r.generation), (Action::Updated, 1));
    assert_eq!(
        writes(&s),
        [
            format!("PUT {}", paths::resourceslice(SLICE)),
            format!("PUT {}", paths::resourceslice(SLICE))
        ],
        "the first PUT met a 409 Conflict, the second carried the new resourceVersion"
    );

    s.race_next("PUT", 100);
    let e = rt.block_on(slices.reconcile(&devices(false))).unwrap_err();
    assert!(
        matches!(e, SliceError::Conflicts { attempts: 5, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("node-a"), "{e}");
    s.race_next("PUT", 0);

    // Another writer raised the generation: ours keeps the highest.
    let mut slice = s.get(&paths::resourceslice(SLICE)).unwrap();
    slice["spec"]["pool"]["generation"] = json!(9);
    s.put(&paths::resourceslice(SLICE), slice);
    let r = rt.block_on(slices.reconcile(&devices(false))).unwrap();
    assert_eq!((r.action, r.generation), (Action::Updated, 9));
}

#[test]
fn strays_are_deleted_and_other_drivers_and_nodes_left_alone() {
    let s = server();
    let put = |name: &str, driver: &str, node: &str, pool: &str, generation: i64| {
        s.put(
            &paths::resourceslice(name),
            objects::resource_slice(name, driver, node, pool, generation, &["pci-0000-09-00-0"]),
        );
    };
    put(
        "node-a-vfio-sandbox-rebellions-ai-x7k2p",
        DRIVER,
        NODE,
        NODE,
        3,
    );
    put("old-pool", DRIVER, NODE, "node-a-old", 1);
    put("gpu-slice", "gpu.example.com", NODE, NODE, 4);
    put("node-b-slice", DRIVER, "node-b", "node-b", 5);
    let rt = rt();
    let r = rt
        .block_on(Slices::new(client(&rt, &s), DRIVER, NODE).reconcile(&devices(false)))
        .unwrap();
    assert_eq!(r.action, Action::Created);
    assert_eq!(r.generation, 4, "above every slice of ours seen");
    assert_eq!(
        r.deleted,
        ["node-a-vfio-sandbox-rebellions-ai-x7k2p", "old-pool"]
    );
    let left: Vec<String> = s
        .list(&paths::resourceslices())
        .iter()
        .map(|o| o["metadata"]["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(left, ["gpu-slice", SLICE, "node-b-slice"]);
}

#[test]
fn a_taken_name_is_read_again_instead_of_duplicated() {
    let s = server();
    // Our slice exists but the first list does not show it (a lost create answer).
    s.put(
        &paths::resourceslice(SLICE),
        objects::resource_slice(SLICE, DRIVER, NODE, NODE, 1, &[]),
    );
    let mut stale = s.get(&paths::resourceslice(SLICE)).unwrap();
    stale["spec"]["nodeName"] = json!("elsewhere");
    s.put(&paths::resourceslice(SLICE), stale);
    let rt = rt();
    let e = rt
        .block_on(Slices::new(client(&rt, &s), DRIVER, NODE).reconcile(&devices(false)))
        .unwrap_err();
    assert!(matches!(e, SliceError::Conflicts { .. }), "{e}");
    let posts = writes(&s).iter().filter(|w| w.starts_with("POST")).count();
    assert_eq!(posts, 5, "every create met AlreadyExists and re-read");
    assert_eq!(s.list(&paths::resourceslices()).len(), 1, "no duplicate");
}

#[test]
fn delete_all_leaves_none_of_ours_and_takes_404_as_done() {
    let s = server();
    let rt = rt();
    let mut slices = Slices::new(client(&rt, &s), DRIVER, NODE);
    rt.block_on(slices.reconcile(&devices(true))).unwrap();
    s.put(
        &paths::resourceslice("stray"),
        objects::resource_slice("stray", DRIVER, NODE, NODE, 1, &[]),
    );
    s.put(
        &paths::resourceslice("theirs"),
        objects::resource_slice("theirs", "gpu.example.com", NODE, NODE, 1, &[]),
    );
    s.race_next("DELETE", 1);
    let mut deleted = rt.block_on(slices.delete_all()).unwrap();
    deleted.sort();
    let deletes = writes(&s)
        .iter()
        .filter(|w| w.starts_with("DELETE"))
        .count();
    assert_eq!(deletes, 3, "one delete met a 409 and was made again");
    assert_eq!(
        deleted,
        [SLICE, "stray"],
        "the raced delete was read again and done"
    );
    assert!(ours(&s).is_empty());
    assert_eq!(
        s.list(&paths::resourceslices()).len(),
        1,
        "another driver's stays"
    );
    assert!(rt.block_on(slices.delete_all()).unwrap().is_empty());

    rt.block_on(slices.reconcile(&devices(true))).unwrap();
    s.fail_next_on("DELETE", 1, 404);
    assert_eq!(rt.block_on(slices.delete_all()).unwrap(), [SLICE]);
}

#[test]
fn failures_name_the_action_and_a_missing_node_is_refused() {
    let s = FakeApiServer::start().unwrap();
    let rt = rt();
    let mut slices = Slices::new(client(&rt, &s), DRIVER, NODE);
    let e = rt.block_on(slices.reconcile(&devices(false))).unwrap_err();
    assert!(matches!(e, SliceError::NodeMissing { .. }), "{e}");
    s.put(&paths::node(NODE), objects::node(NODE, &[]));
    s.fail_next_on("GET", 1, 500);
    let e = rt.block_on(slices.reconcile(&devices(false))).unwrap_err();
    assert_eq!(e.to_string(), "failed to get Node node-a");
    rt.block_on(slices.reconcile(&devices(false))).unwrap();
    s.fail_next_on("PUT", 1, 403);
    let e = rt.block_on(slices.reconcile(&devices(true))).unwrap_err();
    let chain = support::error_chain(&e);
    assert!(
        chain.starts_with(&format!("failed to update ResourceSlice {SLICE}: ")),
        "{chain}"
    );
}

/// A Node deleted and created again has a new uid: the slice must follow it, or
/// the garbage collector deletes it as an orphan at every publication.
#[test]
fn a_recreated_node_gets_the_slice_owned_by_its_new_uid() {
    let s = server();
    let rt = rt();
    let mut slices = Slices::new(client(&rt, &s), DRIVER, NODE);
    rt.block_on(slices.reconcile(&devices(false))).unwrap();
    let mut node = objects::node(NODE, &[]);
    node["metadata"]["uid"] = json!("uid-node-a-recreated");
    assert!(s.remove(&paths::node(NODE)));
    s.put(&paths::node(NODE), node);
    let r = rt.block_on(slices.reconcile(&devices(false))).unwrap();
    assert_eq!(r.action, Action::Updated);
    let slice = s.get(&paths::resourceslice(SLICE)).unwrap();
    assert_eq!(
        slice["metadata"]["ownerReferences"][0]["uid"],
        "uid-node-a-recreated"
    );
    assert_eq!(
        slice["metadata"]["ownerReferences"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

/// `n` distinct devices, named `d0`, `d1`, ….
fn many(n: usize) -> Vec<Device> {
    (0..n)
        .map(|i| Device {
            name: format!("d{i:03}"),
            ..Device::default()
        })
        .collect()
}

/// Our slices as `(name, generation, resourceSliceCount, device count)`, by name.
fn pool(s: &FakeApiServer) -> Vec<(String, i64, i64, usize)> {
    let mut p: Vec<_> = ours(s)
        .iter()
        .map(|o| {
            (
                o["metadata"]["name"].as_str().unwrap().to_owned(),
                o["spec"]["pool"]["generation"].as_i64().unwrap(),
                o["spec"]["pool"]["resourceSliceCount"].as_i64().unwrap(),
                o["spec"]["devices"].as_array().map_or(0, Vec::len),
            )
        })
        .collect();
    p.sort();
    p
}

#[test]
fn a_hundred_and_fifty_devices_are_one_pool_of_three_slices_kept_in_step() {
    let s = server();
    let rt = rt();
    let mut slices = Slices::new(client(&rt, &s), DRIVER, NODE);
    let r = rt.block_on(slices.reconcile(&many(150))).unwrap();
    assert_eq!((r.action, r.generation), (Action::Created, 1));
    let (a, b, c) = (
        SLICE.to_string(),
        format!("{SLICE}-1"),
        format!("{SLICE}-2"),
    );
    assert_eq!(r.names, [a.clone(), b.clone(), c.clone()]);
    assert_eq!(
        pool(&s),
        [
            (a.clone(), 1, 3, 64),
            (b.clone(), 1, 3, 64),
            (c.clone(), 1, 3, 22)
        ]
    );
    let all: Vec<String> = ours(&s)
        .iter()
        .flat_map(|o| o["spec"]["devices"].as_array().unwrap().clone())
        .map(|d| d["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(all.len(), 150, "every device once");

    // Nothing changed: nothing written.
    s.clear_requests();
    let r = rt.block_on(slices.reconcile(&many(150))).unwrap();
    assert_eq!((r.action, r.generation), (Action::Unchanged, 1));
    assert!(writes(&s).is_empty(), "{:?}", writes(&s));

    // One slice deleted by someone else: the whole pool moves to a new generation.
    assert!(s.remove(&paths::resourceslice(&b)));
    let r = rt.block_on(slices.reconcile(&many(150))).unwrap();
    assert_eq!((r.action, r.generation), (Action::Updated, 2));
    assert_eq!(
        pool(&s),
        [
            (a.clone(), 2, 3, 64),
            (b.clone(), 2, 3, 64),
            (c.clone(), 2, 3, 22)
        ]
    );

    // The pool shrinks to two slices: both rewritten, the third deleted after.
    s.clear_requests();
    let r = rt.block_on(slices.reconcile(&many(100))).unwrap();
    assert_eq!(
        (r.action, r.generation, r.deleted.clone()),
        (Action::Updated, 3, vec![c.clone()])
    );
    assert_eq!(pool(&s), [(a.clone(), 3, 2, 64), (b.clone(), 3, 2, 36)]);
    assert_eq!(
        writes(&s),
        [
            format!("PUT {}", paths::resourceslice(&a)),
            format!("PUT {}", paths::resourceslice(&b)),
            format!("DELETE {}", paths::resourceslice(&c)),
        ],
        "the new generation is complete before the stray goes"
    );
    assert_eq!(slice_names(NODE, DRIVER, 2), [a, b]);
    let long = slice_names(&"n".repeat(250), DRIVER, 12);
    assert!(long.iter().all(|n| n.len() <= 253), "{long:?}");
    assert_eq!(
        long.iter().collect::<std::collections::BTreeSet<_>>().len(),
        12
    );
}

const NS: &str = "vms";
const UID: &str = "0d9c6b7e-1111-4000-8000-000000000001";

fn claim_ref(name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        uid: uid.into(),
        namespace: NS.into(),
        name: name.into(),
    }
}

fn read(s: &FakeApiServer, name: &str, uid: &str) -> Result<Vec<AllocatedDevice>, ReadError> {
    let rt = rt();
    let c = client(&rt, s);
    rt.block_on(read_claim(
        &c,
        &claim_ref(name, uid),
        Ticket::now(),
        DRIVER,
        NODE,
    ))
    .map(|c| c.devices)
}

fn with_claim(name: &str, results: Option<&[DeviceResult]>) -> FakeApiServer {
    let s = FakeApiServer::start().unwrap();
    s.put(
        &paths::resourceclaim(NS, name),
        objects::resource_claim(NS, name, UID, results),
    );
    s
}

#[test]
fn claim_allocation_keeps_our_devices_in_our_pool() {
    let s = with_claim(
        "vm-a",
        Some(&[
            DeviceResult::new("nic", DRIVER, NODE, "pci-0000-01-00-0"),
            DeviceResult::new("gpu", "gpu.example.com", "node-a", "gpu-0"),
            DeviceResult::new("nic2", DRIVER, NODE, "pci-0000-02-00-0"),
        ]),
    );
    let got = read(&s, "vm-a", UID).unwrap();
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].request_names, ["nic"]);
    assert_eq!(
        (got[0].pool.as_str(), got[0].device.as_str()),
        (NODE, "pci-0000-01-00-0")
    );
    assert_eq!(got[1].request_names, ["nic2"]);
    assert_eq!(
        s.requests(),
        [("GET".to_owned(), paths::resourceclaim(NS, "vm-a"))]
    );
}

#[test]
fn a_template_claim_carries_its_pod_claim_name() {
    let s = FakeApiServer::start().unwrap();
    let mut claim = objects::resource_claim(
        NS,
        "vm-a-npu-x7k2",
        UID,
        Some(&[DeviceResult::new("npu", DRIVER, NODE, "pci-0000-01-00-0")]),
    );
    claim["metadata"]["annotations"] = json!({"resource.kubernetes.io/pod-claim-name": "npu"});
    s.put(&paths::resourceclaim(NS, "vm-a-npu-x7k2"), claim);
    let rt = rt();
    let c = client(&rt, &s);
    let got = rt
        .block_on(read_claim(
            &c,
            &claim_ref("vm-a-npu-x7k2", UID),
            Ticket::now(),
            DRIVER,
            NODE,
        ))
        .unwrap();
    assert_eq!(got.pod_claim_name(), Some("npu"));
    assert_eq!(got.devices.len(), 1);
    // A claim made by hand has none.
    let s = with_claim(
        "vm-b",
        Some(&[DeviceResult::new("npu", DRIVER, NODE, "pci-0000-01-00-0")]),
    );
    let c = client(&rt, &s);
    let got = rt
        .block_on(read_claim(
            &c,
            &claim_ref("vm-b", UID),
            Ticket::now(),
            DRIVER,
            NODE,
        ))
        .unwrap();
    assert_eq!(got.pod_claim_name(), None);
}

#[test]
fn claim_errors_name_the_claim_and_the_reason() {
    let s = with_claim("vm-a", None);
    let e = read(&s, "gone", UID).unwrap_err();
    assert!(matches!(e, ReadError::NotFound { .. }));
    assert_eq!(e.to_string(), "ResourceClaim vms/gone is not found");

    let e = read(&s, "vm-a", "other-uid").unwrap_err();
    assert!(
        e.to_string().contains(&format!(
            "vms/vm-a has uid {UID}, kubelet asked for other-uid"
        )),
        "{e}"
    );
    let e = read(&s, "vm-a", UID).unwrap_err();
    assert_eq!(e.to_string(), "ResourceClaim vms/vm-a is not allocated");

    let s = with_claim(
        "vm-b",
        Some(&[
            DeviceResult::new("nic", DRIVER, NODE, "pci-0000-01-00-0"),
            DeviceResult::new("nic", DRIVER, "node-b", "pci-0000-05-00-0"),
        ]),
    );
    let e = read(&s, "vm-b", UID).unwrap_err();
    assert!(matches!(e, ReadError::OtherPool { .. }), "{e}");
    assert!(e.to_string().contains("node-b/pci-0000-05-00-0"), "{e}");

    let s = with_claim(
        "vm-c",
        Some(&[DeviceResult::new("gpu", "gpu.example.com", NODE, "gpu-0")]),
    );
    let e = read(&s, "vm-c", UID).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("ResourceClaim vms/vm-c has no device of driver {DRIVER} in pool {NODE}")
    );

    let mut claim = objects::resource_claim(
        NS,
        "vm-d",
        UID,
        Some(&[DeviceResult::new("nic", DRIVER, NODE, "pci-0000-01-00-0")]),
    );
    claim["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = json!(true);
    s.put(&paths::resourceclaim(NS, "vm-d"), claim);
    let got = read(&s, "vm-d", UID).unwrap();
    assert!(
        got[0].admin_access,
        "the driver decides what admin access means"
    );

    let s = FakeApiServer::start().unwrap();
    s.fail_next(1, 500);
    let e = read(&s, "vm-a", UID).unwrap_err();
    assert!(e.is_transient());
    assert_eq!(e.to_string(), "failed to get ResourceClaim vms/vm-a");
}

#[test]
fn hostile_allocations_are_read_without_judging_device_names() {
    let mut results: Vec<DeviceResult> = (0..1000)
        .map(|i| DeviceResult::new(&format!("r{i}"), DRIVER, NODE, &format!("not-ours-{i}")))
        .collect();
    results.push(DeviceResult::new("", DRIVER, NODE, ""));
    let s = with_claim("many", Some(&results));
    let got = read(&s, "many", UID).unwrap();
    assert_eq!(got.len(), 1001);
    assert_eq!(got[1000].device, "");
    assert_eq!(got[1000].request_names, [""]);

    let elsewhere: Vec<DeviceResult> = (0..1000)
        .map(|i| DeviceResult::new("r", DRIVER, &format!("node-{i}"), "d"))
        .collect();
    let s = with_claim("spread", Some(&elsewhere));
    let e = read(&s, "spread", UID).unwrap_err();
    let message = e.to_string();
    assert!(message.ends_with("and 995 more"), "{message}");
    assert!(message.len() < 400, "{message}");
}

/// A device of IOMMU group `g`'s counter set, and the set.
fn counted(name: &str, set: &str) -> Device {
    Device {
        name: name.into(),
        consumes_counters: Some(vec![DeviceCounterConsumption {
            counter_set: set.into(),
            counters: BTreeMap::from([("held".to_owned(), one())]),
        }]),
        ..Device::default()
    }
}

fn one() -> Counter {
    Counter {
        value: Quantity("1".into()),
    }
}

fn counter_set(name: &str) -> CounterSet {
    CounterSet {
        name: name.into(),
        counters: BTreeMap::from([("held".to_owned(), one())]),
    }
}

/// Each slice's device names and counter set names, in slice order.
fn shapes(s: &FakeApiServer) -> Vec<(Vec<String>, Vec<String>)> {
    let names = |v: &Value, key: &str| -> Vec<String> {
        v[key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| d["name"].as_str().unwrap().to_owned())
            .collect()
    };
    ours(s)
        .iter()
        .map(|o| {
            (
                names(&o["spec"], "devices"),
                names(&o["spec"], "sharedCounters"),
            )
        })
        .collect()
}

#[test]
fn counter_sets_go_beside_their_devices_before_1_35_and_apart_from_1_35() {
    let devices = vec![
        counted("a0", "g1"),
        counted("a1", "g1"),
        Device {
            name: "b".into(),
            ..Device::default()
        },
    ];
    let sets = vec![counter_set("g1")];
    let strs = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    for (minor, want) in [
        ("34", vec![(strs(&["a0", "a1", "b"]), strs(&["g1"]))]),
        (
            "35",
            vec![(strs(&["a0", "a1", "b"]), vec![]), (vec![], strs(&["g1"]))],
        ),
        (
            "37+",
            vec![(strs(&["a0", "a1", "b"]), vec![]), (vec![], strs(&["g1"]))],
        ),
    ] {
        let s = server();
        s.set_version("1", minor);
        let rt = rt();
        let mut slices = Slices::new(client(&rt, &s), DRIVER, NODE);
        assert!(rt.block_on(slices.counters_kept()).unwrap());
        assert!(ours(&s).is_empty(), "a dry run stores nothing");
        let r = rt.block_on(slices.reconcile_pool(&devices, &sets)).unwrap();
        assert!(!r.counters_dropped, "1.{minor}");
        assert_eq!(shapes(&s), want, "1.{minor}");
        // Written once: the same pool again writes nothing.
        s.clear_requests();
        let r = rt.block_on(slices.reconcile_pool(&devices, &sets)).unwrap();
        assert_eq!(r.action, Action::Unchanged, "1.{minor}");
        assert!(writes(&s).is_empty(), "1.{minor}: {:?}", writes(&s));
    }
}

#[test]
fn a_server_with_partitionable_devices_off_is_seen_to_drop_counters() {
    let s = server();
    s.set_partitionable_devices(false);
    let rt = rt();
    let mut slices = Slices::new(client(&rt, &s), DRIVER, NODE);
    assert!(!rt.block_on(slices.counters_kept()).unwrap());
    let devices = vec![counted("a0", "g1"), counted("a1", "g1")];
    let r = rt
        .block_on(slices.reconcile_pool(&devices, &[counter_set("g1")]))
        .unwrap();
    assert!(r.counters_dropped);
    // Without counters the pool is one slice again; the counter slice goes.
    let r = rt
        .block_on(slices.reconcile(&[Device {
            name: "g".into(),
            ..Device::default()
        }]))
        .unwrap();
    assert!(!r.counters_dropped);
    assert_eq!(shapes(&s), [(vec!["g".to_owned()], vec![])]);
}

/// A device that flaps (tainted, then not, over and over) rewrites its own slice
/// each time, at the pool's generation, and never the counter slice, whose
/// counters do not change; a change of the counters writes it.
#[test]
fn a_flapping_device_never_rewrites_the_counter_slice() {
    let s = server();
    s.set_version("1", "37");
    let rt = rt();
    let mut slices = Slices::new(client(&rt, &s), DRIVER, NODE);
    let pool_of = |tainted: bool| {
        let mut a0 = counted("a0", "g1");
        if tainted {
            a0.taints = Some(vec![k8s_openapi::api::resource::v1::DeviceTaint {
                key: format!("{DRIVER}/unhealthy"),
                value: Some("Gone".into()),
                effect: "NoSchedule".into(),
                time_added: None,
            }]);
        }
        vec![a0, counted("a1", "g1")]
    };
    let sets = vec![counter_set("g1")];
    let r = rt
        .block_on(slices.reconcile_pool(&pool_of(false), &sets))
        .unwrap();
    let (devices_slice, counter_slice) = (r.names[0].clone(), r.names[1].clone());
    s.clear_requests();
    const FLAPS: usize = 20;
    for i in 0..FLAPS {
        let r = rt
            .block_on(slices.reconcile_pool(&pool_of(i % 2 == 0), &sets))
            .unwrap();
        assert_eq!(
            (r.action, r.generation, r.updated),
            (Action::Updated, 1, 1),
            "flap {i}"
        );
    }
    let w = writes(&s);
    let to = |name: &str| {
        let path = format!("PUT {}", paths::resourceslice(name));
        w.iter().filter(|x| **x == path).count()
    };
    assert_eq!(
        (to(&devices_slice), to(&counter_slice), w.len()),
        (FLAPS, 0, FLAPS),
        "{w:?}"
    );
    // New counters: the counter slice alone is written.
    s.clear_requests();
    let mut two = counter_set("g1");
    two.counters.insert("spare".into(), one());
    let r = rt
        .block_on(slices.reconcile_pool(&pool_of(false), &[two]))
        .unwrap();
    assert_eq!((r.generation, r.updated), (1, 1));
    assert_eq!(
        writes(&s),
        [format!("PUT {}", paths::resourceslice(&counter_slice))]
    );
    // Counters and a device at once: two slices, so the whole pool moves to a new
    // generation together.
    s.clear_requests();
    let r = rt
        .block_on(slices.reconcile_pool(&pool_of(true), &sets))
        .unwrap();
    assert_eq!((r.generation, r.updated), (2, 2));
    assert_eq!(writes(&s).len(), 2, "{:?}", writes(&s));
}
