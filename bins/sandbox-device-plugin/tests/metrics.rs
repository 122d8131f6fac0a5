//! The real `sandbox-device-plugin` binary with `--metrics-address`, against the
//! kubelet-like peer on a fake sysfs tree: Allocate calls (answered and refused), a
//! health change, then a scrape of `/metrics` over real HTTP whose text is parsed
//! and checked value by value.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kubelet_api::v1beta1::{AllocateRequest, ContainerAllocateRequest, Empty};
use kubelet_peer::{scenario, Kubelet, Registered};

/// The longest one scenario may take.
const DEADLINE: Duration = Duration::from_secs(30);
use sysfs_pci::testing::FakeNode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_stream::StreamExt;

const NIC: &str = "example.com/NIC_PT";
const NVME: &str = "example.com/NVME_PT";
const STEP: Duration = Duration::from_secs(5);
const BIN: &str = env!("CARGO_BIN_EXE_sandbox-device-plugin");

struct Bed {
    dir: tempfile::TempDir,
    node: FakeNode,
    plugin: Child,
}

impl Bed {
    /// The fake node of `sysfs_pci::testing::nic_node` and the plugin on it, with `args`.
    fn start(args: &[&str]) -> Self {
        let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
        let node = sysfs_pci::testing::nic_node(dir.path()).unwrap();
        let log = std::fs::File::create(dir.path().join("plugin.log")).unwrap();
        let plugin = kubelet_peer::plugin_command(Path::new(BIN), dir.path())
            .arg("--config")
            .arg(dir.path().join("list.json"))
            .args(["--resync-interval", "200ms"])
            .args(args)
            .env_remove("VFIO_SANDBOX_METRICS_ADDRESS")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Bed { dir, node, plugin }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("plugin.log")).unwrap_or_default()
    }

    /// The metrics address the plugin logged (it was asked for port 0).
    async fn metrics_address(&self) -> String {
        let deadline = Instant::now() + STEP;
        loop {
            let log = self.log();
            if let Some(rest) = log
                .lines()
                .find(|l| l.contains("serving metrics"))
                .and_then(|l| l.split("address=").nth(1))
            {
                return rest.split_whitespace().next().unwrap().to_string();
            }
            assert!(
                Instant::now() < deadline,
                "no metrics address logged:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        let _ = self.plugin.kill();
        let _ = self.plugin.wait();
    }
}

/// Sends `request` on a fresh connection, returns the whole response.
async fn http(addr: &str, request: &str) -> String {
    tokio::time::timeout(STEP, async {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        String::from_utf8(out).unwrap()
    })
    .await
    .expect("scrape deadline")
}

/// A scrape: the headers and the samples (`name{labels}` → value).
async fn scrape(addr: &str) -> (String, BTreeMap<String, f64>) {
    let response = http(
        addr,
        "GET /metrics HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n",
    )
    .await;
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert!(body.ends_with("# EOF\n"), "{body}");
    let samples = body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').unwrap();
            (series.to_string(), value.parse::<f64>().unwrap())
        })
        .collect();
    (format!("{head}\r\n\r\n{body}"), samples)
}

fn value(samples: &BTreeMap<String, f64>, series: &str) -> f64 {
    *samples
        .get(series)
        .unwrap_or_else(|| panic!("no {series} in {samples:#?}"))
}

async fn allocate(
    client: &mut kubelet_api::v1beta1::device_plugin_client::DevicePluginClient<
        tonic::transport::Channel,
    >,
    ids: &[&str],
) -> bool {
    client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: ids.iter().map(|s| s.to_string()).collect(),
            }],
        })
        .await
        .is_ok()
}

#[test]
fn a_scrape_counts_registrations_allocations_updates_and_devices() {
    let bed = Bed::start(&["--metrics-address", "127.0.0.1:0"]);
    scenario(DEADLINE, async {
        let addr = bed.metrics_address().await;
        let kubelet = Kubelet::start(&bed.dir.path().join("kubelet"))
            .await
            .unwrap();
        let regs = kubelet.registrations_for(&[NIC, NVME], STEP).await.unwrap();
        let mut nic = kubelet.plugin(Registered::of(&regs, NIC)).await.unwrap();
        let mut stream = nic.list_and_watch(Empty {}).await.unwrap().into_inner();
        tokio::time::timeout(STEP, stream.next()).await.unwrap();

        assert!(allocate(&mut nic, &["0000:02:00.0", "0000:01:00.1"]).await);
        assert!(allocate(&mut nic, &["0000:01:00.0"]).await);
        assert!(!allocate(&mut nic, &["0000:09:00.0"]).await, "unknown ID");
        bed.node.attach(&"0000:02:00.0".parse().unwrap(), "e1000e");
        tokio::time::timeout(STEP, stream.next()).await.unwrap();

        // The device gauges follow the same change on the main task: poll briefly.
        let unhealthy = format!("vfio_sandbox_devices{{resource=\"{NIC}\",state=\"unhealthy\"}}");
        let deadline = Instant::now() + STEP;
        let (text, samples) = loop {
            let (text, samples) = scrape(&addr).await;
            if samples.get(&unhealthy) == Some(&1.0) || Instant::now() > deadline {
                break (text, samples);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };

        assert!(
            text.contains(
                "\r\ncontent-type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\n"
            ),
            "{text}"
        );
        let s =
            |name: &str, labels: &str| value(&samples, &format!("vfio_sandbox_{name}{{{labels}}}"));
        let nic = format!("resource=\"{NIC}\"");
        let nvme = format!("resource=\"{NVME}\"");
        assert_eq!(s("devices", &format!("{nic},state=\"healthy\"")), 2.0);
        assert_eq!(s("devices", &format!("{nic},state=\"unhealthy\"")), 1.0);
        assert_eq!(s("devices", &format!("{nvme},state=\"healthy\"")), 1.0);
        assert_eq!(s("devices", &format!("{nvme},state=\"unhealthy\"")), 0.0);
        assert_eq!(
            s("registrations_total", &format!("{nic},result=\"ok\"")),
            1.0
        );
        assert_eq!(
            s("registrations_total", &format!("{nvme},result=\"ok\"")),
            1.0
        );
        // Attempts before the peer served kubelet.sock failed; how many is timing.
        s("registrations_total", &format!("{nic},result=\"error\""));
        assert_eq!(
            s("allocate_calls_total", &format!("{nic},result=\"ok\"")),
            2.0
        );
        assert_eq!(
            s("allocate_calls_total", &format!("{nic},result=\"error\"")),
            1.0
        );
        assert_eq!(
            s("allocate_calls_total", &format!("{nvme},result=\"ok\"")),
            0.0
        );
        assert_eq!(
            s("allocate_calls_total", &format!("{nvme},result=\"error\"")),
            0.0
        );
        assert_eq!(s("allocate_duration_seconds_count", &nic), 3.0);
        assert_eq!(
            s(
                "allocate_duration_seconds_bucket",
                &format!("le=\"+Inf\",{nic}")
            ),
            3.0
        );
        assert_eq!(
            s(
                "allocate_duration_seconds_bucket",
                &format!("le=\"1.0\",{nic}")
            ),
            3.0
        );
        s(
            "allocate_duration_seconds_bucket",
            &format!("le=\"0.0001\",{nic}"),
        );
        let sum = s("allocate_duration_seconds_sum", &nic);
        assert!(sum > 0.0 && sum < 1.0, "{sum}");
        assert_eq!(s("allocate_duration_seconds_count", &nvme), 0.0);
        // The first message and the change; nobody watched the nvme resource.
        assert_eq!(s("list_and_watch_updates_total", &nic), 2.0);
        assert_eq!(s("list_and_watch_updates_total", &nvme), 0.0);
        // Labels are resource names, never device IDs.
        assert!(!text.contains("0000:"), "{text}");
        for series in samples.keys() {
            assert!(series.starts_with("vfio_sandbox_"), "{series}");
        }
    });
}

/// Inodes of the TCP sockets (any state) the process `pid` holds.
fn tcp_sockets_of(pid: u32) -> Vec<String> {
    let held: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    ["tcp", "tcp6"]
        .iter()
        .flat_map(|t| {
            std::fs::read_to_string(format!("/proc/{pid}/net/{t}"))
                .unwrap_or_default()
                .lines()
                .skip(1)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter_map(|l| l.split_whitespace().nth(9).map(str::to_string))
        .filter(|inode| held.contains(inode))
        .collect()
}

#[test]
fn without_the_flag_no_port_is_opened() {
    let bed = Bed::start(&[]);
    scenario(DEADLINE, async {
        let kubelet = Kubelet::start(&bed.dir.path().join("kubelet"))
            .await
            .unwrap();
        kubelet.registrations_for(&[NIC, NVME], STEP).await.unwrap();
        assert_eq!(tcp_sockets_of(bed.plugin.id()), Vec::<String>::new());
        assert!(!bed.log().contains("serving metrics"), "{}", bed.log());
    });
    // And the check sees a listener when there is one.
    let on = Bed::start(&["--metrics-address", "127.0.0.1:0"]);
    scenario(DEADLINE, async {
        on.metrics_address().await;
        assert_eq!(tcp_sockets_of(on.plugin.id()).len(), 1);
    });
}

#[test]
fn the_env_twin_sets_the_address() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    sysfs_pci::testing::nic_node(dir.path()).unwrap();
    let log = std::fs::File::create(dir.path().join("plugin.log")).unwrap();
    let mut plugin = kubelet_peer::plugin_command(Path::new(BIN), dir.path())
        .arg("--config")
        .arg(dir.path().join("list.json"))
        .env("VFIO_SANDBOX_METRICS_ADDRESS", "127.0.0.1:0")
        .stderr(log)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + STEP;
    let found = loop {
        let log = std::fs::read_to_string(dir.path().join("plugin.log")).unwrap_or_default();
        if log.contains("serving metrics") || Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = plugin.kill();
    let _ = plugin.wait();
    assert!(
        found.contains("serving metrics at /metrics address=127.0.0.1:"),
        "{found}"
    );
}

#[test]
fn bad_addresses_exit_2_naming_the_flag_and_a_taken_port_exits_1() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    sysfs_pci::testing::nic_node(dir.path()).unwrap();
    let run = |args: &[&str], env: Option<&str>| {
        let mut cmd = kubelet_peer::plugin_command(Path::new(BIN), dir.path());
        cmd.arg("--config")
            .arg(dir.path().join("list.json"))
            .args(args);
        match env {
            Some(v) => cmd.env("VFIO_SANDBOX_METRICS_ADDRESS", v),
            None => cmd.env_remove("VFIO_SANDBOX_METRICS_ADDRESS"),
        };
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for value in ["", "9403", "localhost:9403", ":99999", "::1:9403", "[::1]"] {
        let (code, err) = run(&["--metrics-address", value], None);
        assert_eq!(code, Some(2), "{value:?}: {err}");
        assert!(err.contains("--metrics-address"), "{value:?}: {err}");
        if !value.is_empty() {
            let (code, err) = run(&[], Some(value));
            assert_eq!(code, Some(2), "env {value:?}: {err}");
            assert!(err.contains("--metrics-address"), "env {value:?}: {err}");
        }
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (code, err) = run(&["--metrics-address", &addr], None);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&addr) && err.contains("--metrics-address"),
        "{err}"
    );
}

#[test]
fn help_explains_the_flag() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for text in [
        "--metrics-address <ADDR>",
        "VFIO_SANDBOX_METRICS_ADDRESS",
        "/metrics",
        ":PORT",
        "Default: off",
    ] {
        assert!(help.contains(text), "{text:?} not in:\n{help}");
    }
}

#[test]
fn hostile_clients_do_not_stop_the_plugin_serving_metrics() {
    let bed = Bed::start(&["--metrics-address", "127.0.0.1:0"]);
    scenario(DEADLINE, async {
        let addr = bed.metrics_address().await;
        // Garbage, a 1 MiB header, and 200 clients that send half a request and
        // stall (slowloris: more than the 64 connections the endpoint keeps open).
        let mut stalled = Vec::new();
        for _ in 0..200 {
            let mut s = TcpStream::connect(&addr).await.unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHo").await.unwrap();
            stalled.push(s);
        }
        let r = http(&addr, "\u{1}\u{2}garbage\r\n\r\n").await;
        assert!(r.starts_with("HTTP/1.1 400"), "{r}");
        let mut big = TcpStream::connect(&addr).await.unwrap();
        let mut request = b"GET /metrics HTTP/1.1\r\nX-Big: ".to_vec();
        request.resize(request.len() + (1 << 20), b'b');
        let _ = big.write_all(&request).await;
        let start = Instant::now();
        let (_, samples) = scrape(&addr).await;
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
        assert!(samples
            .keys()
            .any(|k| k.starts_with("vfio_sandbox_devices{")));
        let r = http(
            &addr,
            "GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        let r = http(
            &addr,
            "POST /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(r.starts_with("HTTP/1.1 405"), "{r}");
        drop((stalled, big));
    });
    assert!(bed.log().contains("serving metrics"));
}
