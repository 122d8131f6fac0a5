//! Watches on the stand-in, read two ways: byte by byte over a raw HTTP/1.1
//! connection where the wire format matters, and through `kube::runtime::watcher`
//! exactly as the DRA driver runs it. Every wait has a timeout; none sleeps.
//!
//! One file on purpose: the raw-wire reader at the top is what every test uses.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use fake_apiserver::{objects, paths, FakeApiServer};
use serde_json::{json, Value};

const DRIVER: &str = "d.example.com";
const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
/// How long a test waits for anything before failing.
const PATIENCE: Duration = Duration::from_secs(10);

fn slice(name: &str, node: &str) -> Value {
    objects::resource_slice(name, DRIVER, node, node, 1, &["gpu-0"])
}

/// A raw HTTP/1.1 response being read: status, headers, then the body's chunks
/// split into lines.
struct Raw {
    reader: BufReader<TcpStream>,
    status: u16,
    headers: Vec<(String, String)>,
    pending: Vec<u8>,
    ended: bool,
}

impl Raw {
    fn send(server: &FakeApiServer, method: &str, path_and_query: &str) -> Self {
        let mut stream = TcpStream::connect(server.addr()).unwrap();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        write!(
            stream,
            "{method} {path_and_query} HTTP/1.1\r\nHost: {}\r\nAccept: application/json\r\n\r\n",
            server.addr()
        )
        .unwrap();
        let mut reader = BufReader::new(stream);
        let mut status_line = String::new();
        reader.read_line(&mut status_line).unwrap();
        let status = status_line
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            reader.read_line(&mut h).unwrap();
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let (k, v) = h.split_once(':').unwrap();
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
        }
        Self {
            reader,
            status,
            headers,
            pending: Vec::new(),
            ended: false,
        }
    }

    fn watch(server: &FakeApiServer, query: &str) -> Self {
        Self::send(server, "GET", &format!("{SLICES}?watch=true&{query}"))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Reads one chunk; false at the chunked terminator.
    fn chunk(&mut self) -> bool {
        let mut size = String::new();
        self.reader.read_line(&mut size).unwrap();
        let size = usize::from_str_radix(size.trim(), 16).unwrap();
        let mut data = vec![0; size + 2];
        self.reader.read_exact(&mut data).unwrap();
        assert!(data.ends_with(b"\r\n"));
        data.truncate(size);
        self.pending.extend(data);
        size > 0
    }

    /// The next line of a chunked body as JSON; `None` once the body ended.
    fn event(&mut self) -> Option<Value> {
        loop {
            if let Some(i) = self.pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=i).collect();
                return Some(serde_json::from_slice(&line).unwrap());
            }
            if self.ended {
                assert!(self.pending.is_empty(), "a partial line at the end");
                return None;
            }
            self.ended = !self.chunk();
        }
    }

    /// The whole (non-chunked) body as JSON.
    fn body(mut self) -> Value {
        let len: usize = self.header("content-length").unwrap().parse().unwrap();
        let mut body = vec![0; len];
        self.reader.read_exact(&mut body).unwrap();
        serde_json::from_slice(&body).unwrap()
    }
}

fn kind_and_name(event: &Value) -> (String, String) {
    (
        event["type"].as_str().unwrap().to_owned(),
        event["object"]["metadata"]["name"]
            .as_str()
            .unwrap_or("")
            .to_owned(),
    )
}

fn rv(event: &Value) -> u64 {
    event["object"]["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn a_watch_replays_the_state_then_streams_each_change() {
    let s = FakeApiServer::start().unwrap();
    s.put(&paths::resourceslice("a"), slice("a", "node-a"));
    let mut w = Raw::watch(&s, "allowWatchBookmarks=true&timeoutSeconds=60");
    assert_eq!(w.status, 200);
    assert_eq!(w.header("content-type"), Some("application/json"));
    assert_eq!(w.header("transfer-encoding"), Some("chunked"));
    let added = w.event().unwrap();
    assert_eq!(kind_and_name(&added), ("ADDED".into(), "a".into()));
    assert_eq!(added["object"]["kind"], "ResourceSlice");
    assert_eq!(added["object"]["apiVersion"], "resource.k8s.io/v1");

    s.put(&paths::resourceslice("b"), slice("b", "node-a"));
    let e = w.event().unwrap();
    assert_eq!(kind_and_name(&e), ("ADDED".into(), "b".into()));
    assert_eq!(rv(&e), s.resource_version());

    let mut changed = s.get(&paths::resourceslice("a")).unwrap();
    changed["spec"]["pool"]["generation"] = json!(2);
    s.put(&paths::resourceslice("a"), changed);
    let e = w.event().unwrap();
    assert_eq!(kind_and_name(&e), ("MODIFIED".into(), "a".into()));
    assert_eq!(e["object"]["spec"]["pool"]["generation"], 2);

    let before = rv(&e);
    assert!(s.remove(&paths::resourceslice("a")));
    let e = w.event().unwrap();
    assert_eq!(kind_and_name(&e), ("DELETED".into(), "a".into()));
    assert_eq!(
        e["object"]["spec"]["pool"]["generation"], 2,
        "the object as it was"
    );
    assert!(
        rv(&e) > before,
        "a deletion has a resourceVersion of its own"
    );
    assert_eq!(rv(&e), s.resource_version());

    // Other resources do not show up in this watch.
    s.put(&paths::node("node-a"), objects::node("node-a", &[]));
    s.put(&paths::resourceslice("c"), slice("c", "node-b"));
    assert_eq!(
        kind_and_name(&w.event().unwrap()),
        ("ADDED".into(), "c".into())
    );
}

#[test]
fn every_served_collection_is_watched_in_its_scope() {
    let s = FakeApiServer::start().unwrap();
    s.put(&paths::node("node-a"), objects::node("node-a", &[]));
    s.put(
        &paths::pod("ns1", "p1"),
        objects::pod("ns1", "p1", "node-a", "ds"),
    );
    s.put(
        &paths::pod("ns2", "p2"),
        objects::pod("ns2", "p2", "node-b", "ds"),
    );
    s.put(
        &paths::pod("ns3", "p3"),
        objects::pod("ns3", "p3", "node-a", "ds"),
    );
    s.put(
        &paths::resourceclaim("vms", "c1"),
        objects::resource_claim("vms", "c1", "uid-c1", None),
    );
    s.put(
        &paths::resourceclaim("other", "c2"),
        objects::resource_claim("other", "c2", "uid-c2", None),
    );
    let names = |path: &str, query: &str, n: usize| -> Vec<String> {
        let mut w = Raw::send(&s, "GET", &format!("{path}?watch=1&{query}"));
        assert_eq!(w.status, 200, "{path}");
        (0..n)
            .map(|_| kind_and_name(&w.event().unwrap()).1)
            .collect()
    };
    assert_eq!(names("/api/v1/nodes", "", 1), ["node-a"]);
    assert_eq!(
        names("/api/v1/pods", "fieldSelector=spec.nodeName%3Dnode-a", 2),
        ["p1", "p3"],
        "pods of a node across namespaces"
    );
    let mut claims = Raw::send(
        &s,
        "GET",
        &format!("{}?watch=true", paths::resourceclaims("vms")),
    );
    assert_eq!(
        kind_and_name(&claims.event().unwrap()),
        ("ADDED".into(), "c1".into())
    );
    s.put(
        &paths::resourceclaim("other", "c3"),
        objects::resource_claim("other", "c3", "uid-c3", None),
    );
    s.put(
        &paths::resourceclaim("vms", "c4"),
        objects::resource_claim("vms", "c4", "uid-c4", None),
    );
    assert_eq!(
        kind_and_name(&claims.event().unwrap()),
        ("ADDED".into(), "c4".into()),
        "only its namespace"
    );
    let mut events = Raw::send(&s, "GET", &format!("{}?watch=true", paths::events("ns1")));
    assert_eq!(events.status, 200);
    let event = json!({
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": "e1", "namespace": "ns1"}, "reason": "Bound", "type": "Normal",
    });
    s.put(&format!("{}/e1", paths::events("ns1")), event);
    assert_eq!(
        kind_and_name(&events.event().unwrap()),
        ("ADDED".into(), "e1".into())
    );
}

#[test]
fn a_watch_resumes_after_a_resource_version_and_filters_by_fields() {
    let s = FakeApiServer::start().unwrap();
    s.put(&paths::resourceslice("a"), slice("a", "node-a"));
    let from = s.resource_version();
    s.put(&paths::resourceslice("b"), slice("b", "node-b"));
    s.put(&paths::resourceslice("c"), slice("c", "node-a"));
    let q = format!(
        "resourceVersion={from}&fieldSelector=spec.nodeName%3Dnode-a%2Cspec.driver%3D{DRIVER}"
    );
    let mut w = Raw::watch(&s, &q);
    assert_eq!(
        kind_and_name(&w.event().unwrap()),
        ("ADDED".into(), "c".into()),
        "only what changed after {from}, and only on node-a"
    );
}

#[test]
fn an_object_leaving_the_selection_is_deleted_and_one_entering_is_added() {
    let s = FakeApiServer::start().unwrap();
    s.put(&paths::resourceslice("a"), slice("a", "node-a"));
    let mut w = Raw::watch(&s, "fieldSelector=spec.nodeName%3Dnode-a");
    assert_eq!(w.event().unwrap()["type"], "ADDED");

    s.put(&paths::resourceslice("a"), slice("a", "node-b"));
    let left = w.event().unwrap();
    assert_eq!(kind_and_name(&left), ("DELETED".into(), "a".into()));
    // cache_watcher.go sends the object as it was before the change, at the
    // change's resourceVersion.
    assert_eq!(left["object"]["spec"]["nodeName"], "node-a");
    assert_eq!(rv(&left), s.resource_version());

    s.put(&paths::resourceslice("a"), slice("a", "node-a"));
    let back = w.event().unwrap();
    assert_eq!(kind_and_name(&back), ("ADDED".into(), "a".into()));
    assert_eq!(back["object"]["spec"]["nodeName"], "node-a");
}

#[test]
fn kubelet_wiping_a_node_sends_one_deleted_per_slice() {
    let s = FakeApiServer::start().unwrap();
    for (name, node) in [("a1", "node-a"), ("a2", "node-a"), ("b1", "node-b")] {
        s.put(&paths::resourceslice(name), slice(name, node));
    }
    let mut w = Raw::watch(&s, "");
    for _ in 0..3 {
        assert_eq!(w.event().unwrap()["type"], "ADDED");
    }
    // wipeResourceSlices in pkg/kubelet/cm/dra/plugin/registration.go: on
    // start for every driver of the node, on deregistration for one driver.
    let wipe = Raw::send(
        &s,
        "DELETE",
        &format!("{SLICES}?fieldSelector=spec.nodeName%3Dnode-a"),
    );
    assert_eq!(wipe.status, 200);
    let mut deleted = Vec::new();
    for _ in 0..2 {
        let e = w.event().unwrap();
        deleted.push((kind_and_name(&e), rv(&e)));
    }
    assert_eq!(deleted[0].0, ("DELETED".into(), "a1".into()));
    assert_eq!(deleted[1].0, ("DELETED".into(), "a2".into()));
    assert!(
        deleted[0].1 < deleted[1].1,
        "each deletion is its own change"
    );
    assert_eq!(s.list(SLICES).len(), 1);

    // By driver, as after a deregistration.
    s.put(&paths::resourceslice("a3"), slice("a3", "node-a"));
    assert_eq!(w.event().unwrap()["type"], "ADDED");
    let wipe = Raw::send(
        &s,
        "DELETE",
        &format!("{SLICES}?fieldSelector=spec.driver%3D{DRIVER}%2Cspec.nodeName%3Dnode-a"),
    );
    assert_eq!(wipe.status, 200);
    assert_eq!(
        kind_and_name(&w.event().unwrap()),
        ("DELETED".into(), "a3".into())
    );
}

#[test]
fn a_resource_version_older_than_the_history_is_one_expired_event() {
    let s = FakeApiServer::start().unwrap();
    s.set_watch_history(2);
    for i in 0..5 {
        s.put(
            &paths::resourceslice(&format!("s{i}")),
            slice("x", "node-a"),
        );
    }
    // History holds the changes at 4 and 5: 3 is still fine, 2 is too old.
    let mut ok = Raw::watch(&s, "resourceVersion=3");
    assert_eq!(ok.status, 200);
    assert_eq!(rv(&ok.event().unwrap()), 4);
    let mut gone = Raw::watch(&s, "resourceVersion=2");
    assert_eq!(gone.status, 200, "the error comes as an event");
    let e = gone.event().unwrap();
    assert_eq!(e["type"], "ERROR");
    assert_eq!(
        e["object"],
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "too old resource version: 2 (3)", "reason": "Expired", "code": 410,
        })
    );
    assert!(gone.event().is_none(), "then the stream ends");
}

#[test]
fn malformed_watches_get_the_answers_upstream_gives() {
    let s = FakeApiServer::start().unwrap();
    let w = Raw::watch(&s, "resourceVersion=abc");
    assert_eq!(
        w.status, 500,
        "cacher.go returns the versioner's error as is"
    );
    let body = w.body();
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("parsing \"abc\": invalid syntax"),
        "{body}"
    );
    let list = Raw::send(&s, "GET", &format!("{SLICES}?resourceVersion=abc"));
    assert_eq!(list.status, 400, "a list validates it first");
    let w = Raw::watch(&s, "fieldSelector=spec.pool.name%3Dx");
    assert_eq!(w.status, 400);
    assert!(w.body()["message"]
        .as_str()
        .unwrap()
        .starts_with("field label not supported: spec.pool.name"));
    assert_eq!(Raw::watch(&s, "timeoutSeconds=soon").status, 400);
    let w = Raw::watch(&s, "resourceVersionMatch=NotOlderThan");
    assert_eq!(w.status, 422);
    assert_eq!(w.body()["reason"], "Invalid");
    // Numbers at the edges neither overflow nor hang: a watch from a version
    // the store has not reached waits 3 s for it (watch_cache.go), then says so.
    let mut far = Raw::watch(
        &s,
        "timeoutSeconds=9223372036854775807&resourceVersion=18446744073709551615",
    );
    assert_eq!(far.status, 200);
    let e = far.event().unwrap();
    assert_eq!(
        (e["type"].as_str(), e["object"]["code"].as_u64()),
        (Some("ERROR"), Some(504))
    );
    assert_eq!(
        e["object"]["details"]["causes"][0]["reason"],
        "ResourceVersionTooLarge"
    );
    assert!(far.event().is_none());
    let w = Raw::send(
        &s,
        "GET",
        &format!("{}?watch=true", paths::resourceslice("a")),
    );
    assert_eq!(w.status, 405, "only collections are watched");
}

#[test]
fn timeout_seconds_ends_the_stream_cleanly() {
    let s = FakeApiServer::start().unwrap();
    let started = Instant::now();
    let mut w = Raw::watch(&s, "timeoutSeconds=1");
    assert!(w.event().is_none(), "nothing, then the chunked terminator");
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(1), "{took:?}");
    assert!(s.wait_open_watches(0, PATIENCE));
}

#[test]
fn bookmarks_carry_only_the_kind_and_the_current_resource_version() {
    let s = FakeApiServer::start().unwrap();
    s.set_bookmark_period(Duration::from_millis(100));
    s.put(&paths::resourceslice("a"), slice("a", "node-a"));
    let mut w = Raw::watch(&s, "allowWatchBookmarks=true&resourceVersion=1");
    let b = w.event().unwrap();
    assert_eq!(
        b,
        json!({"type": "BOOKMARK", "object": {
            "kind": "ResourceSlice", "apiVersion": "resource.k8s.io/v1",
            "metadata": {"resourceVersion": s.resource_version().to_string()},
        }})
    );
    let mut plain = Raw::watch(&s, "resourceVersion=1&timeoutSeconds=1");
    assert!(plain.event().is_none(), "no bookmarks unless allowed");
}

#[test]
fn send_initial_events_ends_the_replay_with_an_annotated_bookmark() {
    let s = FakeApiServer::start().unwrap();
    s.put(&paths::resourceslice("a"), slice("a", "node-a"));
    let mut w = Raw::watch(
        &s,
        "sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true",
    );
    assert_eq!(w.event().unwrap()["type"], "ADDED");
    let end = w.event().unwrap();
    assert_eq!(end["type"], "BOOKMARK");
    assert_eq!(
        end["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );
}

#[test]
fn a_client_that_goes_away_leaves_no_task_behind() {
    let s = FakeApiServer::start().unwrap();
    let w = Raw::watch(&s, "");
    assert!(s.wait_open_watches(1, PATIENCE));
    drop(w);
    assert!(s.wait_open_watches(0, PATIENCE), "the watch task ended");
}

#[test]
fn ending_watches_closes_the_streams() {
    let s = FakeApiServer::start().unwrap();
    let mut w = Raw::watch(&s, "");
    assert!(s.wait_open_watches(1, PATIENCE));
    s.end_watches();
    assert!(w.event().is_none());
}

mod kube_watcher {
    //! The watcher the DRA driver runs, against the stand-in.

    use super::*;
    use k8s_openapi::api::resource::v1::ResourceSlice;
    use kube::runtime::watcher::{self, Event};
    use kube::{Api, Client};
    use tokio_stream::StreamExt;

    fn client(server: &FakeApiServer) -> Client {
        let config = kube::Config::new(server.url().parse().unwrap());
        Client::try_from(config).unwrap()
    }

    fn config() -> watcher::Config {
        watcher::Config::default().fields(&format!("spec.nodeName=node-a,spec.driver={DRIVER}"))
    }

    type Item = Result<Event<ResourceSlice>, watcher::Error>;
    type Events = tokio::sync::mpsc::UnboundedReceiver<Item>;

    /// Runs the watcher in a task of its own, as the driver does, so that it
    /// keeps watching while the test waits; its events arrive on the channel.
    fn watch(server: &FakeApiServer) -> Events {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut stream = Box::pin(watcher::watcher(
            Api::<ResourceSlice>::all(client(server)),
            config(),
        ));
        tokio::spawn(async move {
            while let Some(e) = stream.next().await {
                if tx.send(e).is_err() {
                    return;
                }
            }
        });
        rx
    }

    async fn next(events: &mut Events) -> Item {
        tokio::time::timeout(PATIENCE, events.recv())
            .await
            .expect("an event in time")
            .expect("the watcher does not end")
    }

    /// Waits, off the runtime's threads, for `n` watches to be served.
    fn open_watches(server: &FakeApiServer, n: usize) -> bool {
        tokio::task::block_in_place(|| server.wait_open_watches(n, PATIENCE))
    }

    fn name(s: &ResourceSlice) -> String {
        s.metadata.name.clone().unwrap_or_default()
    }

    /// Reads the initial listing: the names it applied.
    async fn initial(events: &mut Events) -> Vec<String> {
        assert!(matches!(next(events).await.unwrap(), Event::Init));
        let mut names = Vec::new();
        loop {
            match next(events).await.unwrap() {
                Event::InitApply(s) => names.push(name(&s)),
                Event::InitDone => return names,
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sees_the_node_slices_then_their_changes() {
        let s = FakeApiServer::start().unwrap();
        s.put(&paths::resourceslice("a"), slice("a", "node-a"));
        s.put(&paths::resourceslice("other"), slice("other", "node-b"));
        let mut events = watch(&s);
        assert_eq!(initial(&mut events).await, ["a"]);

        s.put(&paths::resourceslice("b"), slice("b", "node-a"));
        assert!(matches!(next(&mut events).await.unwrap(), Event::Apply(x) if name(&x) == "b"));
        s.put(&paths::resourceslice("b"), slice("b", "node-b"));
        assert!(
            matches!(next(&mut events).await.unwrap(), Event::Delete(x) if name(&x) == "b"),
            "leaving the node is a deletion for this watcher"
        );
        let wipe = format!("{SLICES}?fieldSelector=spec.nodeName%3Dnode-a");
        let answer = tokio::task::spawn_blocking({
            let url = s.addr();
            move || {
                let mut c = TcpStream::connect(url).unwrap();
                write!(
                    c,
                    "DELETE {wipe} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                )
                .unwrap();
                let mut out = String::new();
                c.read_to_string(&mut out).unwrap();
                out
            }
        })
        .await
        .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(matches!(next(&mut events).await.unwrap(), Event::Delete(x) if name(&x) == "a"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn relists_after_the_history_moved_past_it() {
        let s = FakeApiServer::start().unwrap();
        // No bookmark may move the watcher's resourceVersion on in this test.
        s.set_bookmark_period(Duration::from_secs(3600));
        s.set_watch_history(2);
        s.put(&paths::resourceslice("a"), slice("a", "node-a"));
        let mut events = watch(&s);
        assert_eq!(initial(&mut events).await, ["a"]);
        assert!(open_watches(&s, 1));
        // Changes this watcher does not select push its resourceVersion out of
        // the history; then the server ends the watch, the watcher resumes from
        // the resourceVersion it had, gets 410 Expired, and lists again.
        for i in 0..3 {
            s.put(
                &paths::resourceslice(&format!("b{i}")),
                slice("b", "node-b"),
            );
        }
        s.put(&paths::resourceslice("c"), slice("c", "node-a"));
        // The watch sees "c" before it ends; drop it from the stream first.
        assert!(matches!(next(&mut events).await.unwrap(), Event::Apply(x) if name(&x) == "c"));
        for i in 3..6 {
            s.put(
                &paths::resourceslice(&format!("b{i}")),
                slice("b", "node-b"),
            );
        }
        s.end_watches();
        match next(&mut events).await {
            Err(watcher::Error::WatchError(status)) => {
                assert_eq!(status.code, 410);
                assert_eq!(status.reason, "Expired");
            }
            other => panic!("expected the 410, got {other:?}"),
        }
        let mut names = initial(&mut events).await;
        names.sort();
        assert_eq!(names, ["a", "c"], "the relist");
        let lists = s
            .requests()
            .iter()
            .filter(|(m, p)| m == "GET" && p.starts_with(SLICES) && !p.contains("watch=true"))
            .count();
        assert_eq!(lists, 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn measures_how_long_a_change_takes_to_reach_the_watcher() {
        let s = FakeApiServer::start().unwrap();
        let mut events = watch(&s);
        assert!(initial(&mut events).await.is_empty());
        assert!(open_watches(&s, 1));
        let mut took = Vec::new();
        for i in 0..20 {
            let name = format!("s{i}");
            let started = Instant::now();
            s.put(&paths::resourceslice(&name), slice(&name, "node-a"));
            assert!(matches!(next(&mut events).await.unwrap(),
                    Event::Apply(x) if x.metadata.name.as_deref() == Some(name.as_str())));
            took.push(started.elapsed());
        }
        took.sort();
        println!(
            "store change to kube-rs watcher event: median {:?}, max {:?} (20 changes)",
            took[took.len() / 2],
            took[took.len() - 1]
        );
    }
}
