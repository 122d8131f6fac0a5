//! The real `sandbox-dra-controller` binary where no API server is needed: its
//! help, its usage errors (exit 2) and a cluster it cannot reach (exit 1), each
//! saying what is wrong. Leading and labelling run against the real
//! kube-apiserver in tests/k8s (`labelled`).

#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

/// The binary with no cluster to find: no kubeconfig, no in-cluster account.
fn controller(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let home = tempfile::tempdir().unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_sandbox-dra-controller"));
    c.args(args)
        .env_clear()
        .env("HOME", home.path())
        .env("KUBECONFIG", home.path().join("no-kubeconfig"));
    for (k, v) in envs {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn help_says_what_it_labels_and_how_it_is_run() {
    let o = controller(&["--help"], &[]);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    for words in [
        "<driver>/node=<node>",
        "Deployment of two replicas",
        "--lease",
        "--metrics-address",
        "Exit codes",
    ] {
        assert!(out.contains(words), "--help lacks {words:?}:\n{out}");
    }
}

#[test]
fn an_empty_pod_name_or_namespace_is_bad_usage() {
    for (envs, flag) in [
        (
            [("POD_NAMESPACE", ""), ("POD_NAME", "labeller-0")],
            "--pod-namespace (POD_NAMESPACE) is empty",
        ),
        (
            [("POD_NAMESPACE", "vfio-sandbox"), ("POD_NAME", " ")],
            "--pod-name (POD_NAME) is empty",
        ),
    ] {
        let o = controller(&[], &envs);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(
            stderr(&o).contains(&format!("sandbox-dra-controller: error: {flag}")),
            "{}",
            stderr(&o)
        );
    }
    // Missing altogether: clap's own usage error.
    let o = controller(&[], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--pod-namespace"), "{}", stderr(&o));
}

/// A driver name that cannot prefix the label key and the binding conditions
/// is bad usage at start, rather than a labeller whose every patch the API
/// server refuses.
#[test]
fn a_driver_name_that_cannot_prefix_the_label_is_bad_usage() {
    let pod = [
        ("POD_NAMESPACE", "vfio-sandbox"),
        ("POD_NAME", "labeller-0"),
    ];
    let long = "a".repeat(64);
    for (name, reason) in [
        ("Vfio.example", "only a-z, 0-9, '-' and '.' are allowed"),
        ("vfio..example", "an empty part between dots"),
        (long.as_str(), "too long"),
    ] {
        let o = controller(&["--driver-name", name], &pod);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        for words in ["--driver-name", name, reason, "lowercase DNS subdomain"] {
            assert!(stderr(&o).contains(words), "{words:?}: {}", stderr(&o));
        }
    }
}

#[test]
fn a_bad_metrics_address_is_bad_usage() {
    let o = controller(
        &["--metrics-address", "nowhere"],
        &[
            ("POD_NAMESPACE", "vfio-sandbox"),
            ("POD_NAME", "labeller-0"),
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("nowhere"), "{}", stderr(&o));
}

#[test]
fn no_cluster_to_reach_is_said_and_exits_1() {
    let o = controller(
        &["--metrics-address", "127.0.0.1:0"],
        &[
            ("POD_NAMESPACE", "vfio-sandbox"),
            ("POD_NAME", "labeller-0"),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("sandbox-dra-controller: error: cannot set up the API server client"),
        "{}",
        stderr(&o)
    );
}
