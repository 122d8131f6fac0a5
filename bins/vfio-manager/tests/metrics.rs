//! `vfio-manager run --metrics-address`: the real binary serving its metrics over
//! HTTP on a fake node.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::command;
use sysfs_pci::testing::FakeNode;

fn node(dir: &Path) -> FakeNode {
    // The fake tree never rebinds, so binding the second one fails every pass.
    common::nic_node(
        dir,
        &[
            ("0000:01:00.0", "vfio-pci", 4),
            ("0000:02:00.0", "e1000e", 5),
        ],
    )
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn scrape(port: u16) -> Option<String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

fn stop(mut child: Child) -> String {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let _ = child.wait();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    err
}

#[test]
fn run_serves_device_states_and_bind_outcomes() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let port = free_port();
    let child = command(dir.path())
        .args([
            "--ready-file",
            &dir.path().join("run/ready").to_string_lossy(),
        ])
        .args([
            "run",
            "--resync-interval",
            "100ms",
            "--metrics-address",
            &format!("127.0.0.1:{port}"),
        ])
        .env_remove("NODE_NAME")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let text = loop {
        // Wait for a few failed passes to be counted.
        if let Some(t) = scrape(port) {
            if value(&t, r#"vfio_sandbox_binds_total{result="error"}"#).is_some_and(|v| v >= 2.0) {
                break t;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no metrics on port {port}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    // 200 slowloris clients (half a request head, then nothing) do not keep a
    // scrape waiting.
    let stalled: Vec<std::net::TcpStream> = (0..200)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHo");
            s
        })
        .collect();
    let started = Instant::now();
    let beside = scrape(port).unwrap_or_default();
    let took = started.elapsed();
    drop(stalled);
    assert!(beside.starts_with("HTTP/1.1 200"), "{beside}");
    // A server that waited on any stalled client would take at least its 3 s
    // head timeout; a loaded machine can make a free one take a second.
    assert!(
        took < Duration::from_millis(2500),
        "a scrape beside 200 slowloris clients took {took:?}"
    );
    let err = stop(child);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("application/openmetrics-text"), "{text}");
    assert_eq!(
        value(&text, r#"vfio_sandbox_devices{state="bound"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(&text, r#"vfio_sandbox_devices{state="not_bound"}"#),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(&text, r#"vfio_sandbox_devices{state="held"}"#),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        value(&text, r#"vfio_sandbox_binds_total{result="ok"}"#),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        value(&text, r#"vfio_sandbox_stops_total{decision="keep"}"#),
        Some(0.0),
        "{text}"
    );
    assert!(
        !text.contains("0000:"),
        "no device addresses in labels: {text}"
    );
    assert!(err.contains("serving metrics at /metrics"), "{err}");
}

#[test]
fn no_listener_without_the_flag_and_a_bad_address_is_bad_usage() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    node(dir.path());
    let out = command(dir.path())
        .args(["run", "--metrics-address", "not-an-address"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--metrics-address"));
    // A port already taken: exit 1 naming the address, before anything is bound.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = command(dir.path())
        .args([
            "--ready-file",
            &dir.path().join("run/ready").to_string_lossy(),
        ])
        .args(["run", "--metrics-address", &addr])
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains(&addr));
    assert!(!dir.path().join("run/ready").exists());
}
