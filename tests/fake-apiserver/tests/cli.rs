//! The `fake-apiserver` command against an in-process server: `claim` writes a
//! ResourceClaim with the allocation it is given and prints its uid; `wait`
//! waits on the conditions a driver sets in its `status.devices`.

#![allow(clippy::unwrap_used)]

use std::process::Command;

use fake_apiserver::{paths, FakeApiServer};

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fake-apiserver"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn claim_creates_then_allocates_through_the_status_subresource() {
    let s = FakeApiServer::start().unwrap();
    let url = s.url();
    let (ok, out, err) = run(&[
        "claim",
        "--server",
        &url,
        "vms/vm-a-gpu",
        "--result",
        "gpu:vfio-sandbox.rebellions.ai:node-a:pci-0000-01-00-0",
        "--result",
        "gpu2:vfio-sandbox.rebellions.ai:node-a:pci-0000-02-00-0",
    ]);
    assert!(ok, "{out}{err}");
    let uid = out.trim();
    let claim = s.get(&paths::resourceclaim("vms", "vm-a-gpu")).unwrap();
    assert_eq!(claim["metadata"]["uid"], uid);
    let results = claim["status"]["allocation"]["devices"]["results"]
        .as_array()
        .unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[1]["device"], "pci-0000-02-00-0");
    assert_eq!(claim["spec"]["devices"]["requests"][0]["name"], "gpu");
    let methods: Vec<String> = s
        .requests()
        .into_iter()
        .map(|(m, p)| format!("{m} {p}"))
        .collect();
    assert_eq!(
        methods,
        [
            "POST /apis/resource.k8s.io/v1/namespaces/vms/resourceclaims".to_owned(),
            "PUT /apis/resource.k8s.io/v1/namespaces/vms/resourceclaims/vm-a-gpu/status".to_owned(),
        ]
    );
    let (ok, _, err) = run(&["claim", "--server", &url, "vms/vm-a-gpu"]);
    assert!(!ok, "a second claim of that name already exists");
    assert!(err.contains("AlreadyExists"), "{err}");
    let (ok, _, err) = run(&["claim", "--server", &url, "vms/x", "--result", "no-colons"]);
    assert!(!ok && err.contains("REQUEST:DRIVER:POOL:DEVICE"), "{err}");
}

/// A claim allocated with binding conditions, and `wait` on them: exit 0 once
/// the condition is True, 1 once the failure condition is (naming its reason
/// and message), 3 at the timeout; it changes nothing.
#[test]
fn wait_reads_the_conditions_a_driver_sets() {
    let s = FakeApiServer::start().unwrap();
    let url = s.url();
    let set = |name: &str, kind: &str| {
        let path = paths::resourceclaim("vms", name);
        let mut claim = s.get(&path).unwrap();
        claim["status"]["devices"] = serde_json::json!([{"driver": "d.example.com", "pool": "node-a", "device": "gpu-0",
            "conditions": [{"type": kind, "status": "True", "reason": "Test", "message": "m", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}]);
        let (ok, out, err) = run(&[
            "request",
            "--server",
            &url,
            "PUT",
            &format!("{path}/status"),
            &claim.to_string(),
        ]);
        assert!(ok, "{out}{err}");
    };
    let wait = |name: &str, timeout: &str| {
        Command::new(env!("CARGO_BIN_EXE_fake-apiserver"))
            .args([
                "wait",
                "--server",
                &url,
                &format!("vms/{name}"),
                "--condition",
                "d.example.com/Ready",
                "--failure-condition",
                "d.example.com/Failed",
                "--timeout",
                timeout,
            ])
            .output()
            .unwrap()
    };
    for (name, kind, code) in [
        ("ready", "d.example.com/Ready", 0),
        ("failed", "d.example.com/Failed", 1),
    ] {
        let (ok, out, err) = run(&[
            "claim",
            "--server",
            &url,
            &format!("vms/{name}"),
            "--result",
            "gpu:d.example.com:node-a:gpu-0",
            "--binding-condition",
            "d.example.com/Ready",
            "--binding-failure-condition",
            "d.example.com/Failed",
        ]);
        assert!(ok, "{out}{err}");
        let claim = s.get(&paths::resourceclaim("vms", name)).unwrap();
        let allocation = &claim["status"]["allocation"];
        assert_eq!(
            allocation["devices"]["results"][0]["bindingConditions"][0],
            "d.example.com/Ready"
        );
        assert_eq!(
            allocation["devices"]["results"][0]["bindingFailureConditions"][0],
            "d.example.com/Failed"
        );
        assert!(
            allocation["allocationTimestamp"].is_string(),
            "{allocation}"
        );
        assert_eq!(
            allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"][0],
            "node-a"
        );
        let out = wait(name, "0");
        assert_eq!(out.status.code(), Some(3), "{out:?}");
        set(name, kind);
        let out = wait(name, "10");
        assert_eq!(out.status.code(), Some(code), "{out:?}");
        if code == 1 {
            let said = String::from_utf8_lossy(&out.stdout);
            assert!(said.contains("reason=Test, message=\"m\""), "{said}");
        }
        let after = s.get(&paths::resourceclaim("vms", name)).unwrap();
        assert!(after["status"]["allocation"].is_object(), "{after}");
    }
    let (ok, _, err) = run(&[
        "claim",
        "--server",
        &url,
        "vms/half",
        "--result",
        "gpu:d.example.com:node-a:gpu-0",
        "--binding-condition",
        "d.example.com/Ready",
    ]);
    assert!(!ok && err.contains("--binding-failure-condition"), "{err}");
}

#[test]
fn request_reports_the_real_status_codes() {
    let s = FakeApiServer::start().unwrap();
    let url = s.url();
    let (ok, out, _) = run(&[
        "request",
        "--server",
        &url,
        "GET",
        &paths::resourceslice("x"),
    ]);
    assert!(!ok);
    assert!(out.contains("\"reason\":\"NotFound\""), "{out}");
    let wrong = r#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"x"}}"#;
    let (ok, out, _) = run(&[
        "request",
        "--server",
        &url,
        "POST",
        &paths::resourceslices(),
        wrong,
    ]);
    assert!(!ok);
    assert!(out.contains("\"code\":400"), "{out}");
}

/// A group version's root answers its `APIResourceList` (what kube-rs's
/// `list_api_group_resources` reads), and a group version switched off answers
/// 404 at the root and below, as a server of an older release.
#[test]
fn discovery_lists_the_served_resources_and_an_unserved_version_is_404() {
    let s = FakeApiServer::start().unwrap();
    let url = s.url();
    let (ok, out, _) = run(&[
        "request",
        "--server",
        &url,
        "GET",
        "/apis/resource.k8s.io/v1",
    ]);
    assert!(ok, "{out}");
    let list: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(list["kind"], "APIResourceList");
    assert_eq!(list["groupVersion"], "resource.k8s.io/v1");
    let names: Vec<&str> = list["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "resourceslices",
            "resourceclaims",
            "resourceclaims/status",
            "deviceclasses"
        ]
    );
    s.set_unserved(&["resource.k8s.io/v1"]);
    for path in ["/apis/resource.k8s.io/v1", &paths::resourceslices()] {
        let (ok, out, _) = run(&["request", "--server", &url, "GET", path]);
        assert!(!ok, "{path}");
        assert!(out.contains("\"code\":404"), "{path}: {out}");
    }
}
