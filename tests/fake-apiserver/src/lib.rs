//! A stand-in for the Kubernetes API server, over real HTTP/1.1 on loopback.
//!
//! What the real kube-apiserver, kube-scheduler and kubelet show is proven
//! against them (`tests/k8s`, real-k8s): strategies, validation, authorization,
//! the scheduler's allocation and binding conditions. This stand-in is kept for
//! what they cannot do for a test: fail or race the next requests on demand
//! (409 storms, 5xx, hangs, latency), count every request and write, steer
//! watches (bookmark beat, history, ends), hide an API version, and answer
//! inside the real-kernel test VM, where no control plane runs. It plays no
//! scheduler: a test that needs an allocated claim writes the allocation itself
//! ([`objects::allocation`]); the real scheduler's allocations and waits are
//! checked against it in tests/k8s and in the guest node. It applies no strategy
//! and no validation of the DRA fields: it stores what a driver writes.
//!
//! It stores JSON objects under their REST paths (`/api/v1/nodes/node-a`,
//! `/apis/resource.k8s.io/v1/resourceslices/s`) and answers the verbs a node agent
//! uses as the real server does for the resources it serves (Node, Pod, DaemonSet,
//! Event, Lease, ResourceSlice, ResourceClaim, DeviceClass):
//!
//! - `GET` of an object, or of a collection with `fieldSelector` (only the field
//!   labels the real server supports for that resource; others are a 400) and
//!   equality-based `labelSelector`;
//! - `POST` to a collection, named by `metadata.name` or `metadata.generateName`
//!   (409 `AlreadyExists` when taken); the server sets uid, creationTimestamp and
//!   resourceVersion, and drops `status` where a status subresource owns it;
//! - `PUT` of an object with optimistic concurrency: a stale `resourceVersion` is a
//!   409 `Conflict`; `PUT .../status` writes only the status;
//! - `PATCH` (a JSON merge patch, RFC 7386);
//! - `DELETE` of an object (404 when absent, 409 when its preconditions fail) or of
//!   a collection by selector (one change per object, as the registry deletes
//!   them one by one);
//! - `GET` of a collection with `watch=true`: a chunked `200` of one JSON watch
//!   event per line (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`, `ERROR`), sent
//!   as the store changes. `resourceVersion` absent or `0` replays the current
//!   state as `ADDED` first; `N` resumes after `N` from a bounded history of
//!   changes, or gets one `ERROR` 410 `Expired` event when `N` is older than it;
//!   the selectors filter as in a list, judged before and after each change (an
//!   object leaving the selection is `DELETED`, one entering it `ADDED`);
//!   `allowWatchBookmarks`, `timeoutSeconds` and `sendInitialEvents` behave as
//!   upstream. See the `watch` module for the upstream files it follows.
//!
//! Every request is checked: an unknown path is a 404 `Status`, a verb the path
//! does not take a 405, a body of the wrong `apiVersion`/`kind` or namespace a 400.
//! Tests can make the next requests fail (`fail_next`), have another writer change
//! an object just before a request (`race_next`), read back every request, and
//! steer watches: shorten the bookmark beat (`set_bookmark_period`), shrink the
//! history (`set_watch_history`) and end every open watch (`end_watches`).
//!
//! ```no_run
//! use fake_apiserver::{objects, paths, FakeApiServer};
//!
//! let server = FakeApiServer::start()?;
//! server.put(
//!     &paths::resourceslice("node-a-gpu"),
//!     objects::resource_slice("node-a-gpu", "d.example.com", "node-a", "node-a", 1, &["gpu-0"]),
//! );
//! // GET {url}/apis/resource.k8s.io/v1/resourceslices?watch=true now streams an
//! // ADDED event for it, then every later change.
//! # Ok::<(), anyhow::Error>(())
//! ```
//!
//! kube-rs builds the paths, so a client that asks for the wrong object finds
//! nothing here, just as it would in a cluster.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};

mod history;
mod query;
mod rest;
mod watch;

use rest::{status, Objects, Route};

pub use history::{DEFAULT_BOOKMARK_PERIOD, DEFAULT_HISTORY};

/// The body of every answer: whole for most, a stream for a watch.
type Body = BoxBody<Bytes, std::convert::Infallible>;

/// Objects, requests seen, failures armed.
#[derive(Debug, Default)]
struct Store {
    objects: Objects,
    requests: Vec<(String, String)>,
    fail: Option<(u32, u16, Option<Method>)>,
    race: Option<(Method, u32)>,
    /// Requests whose method and path start like this wait this long first.
    latency: Option<(Method, String, std::time::Duration)>,
    /// Group versions answered with 404, as by an older server that does not
    /// serve them (`/apis/resource.k8s.io/v1` before Kubernetes 1.34).
    unserved: Vec<String>,
}

/// A running fake API server; it stops when dropped.
#[derive(Debug)]
pub struct FakeApiServer {
    addr: SocketAddr,
    store: Arc<Mutex<Store>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn lock(store: &Mutex<Store>) -> MutexGuard<'_, Store> {
    store.lock().unwrap_or_else(PoisonError::into_inner)
}

impl FakeApiServer {
    /// Serves on a free port of 127.0.0.1 from a thread of its own.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_on("127.0.0.1:0".parse()?)
    }

    /// Serves on `addr` from a thread of its own.
    pub fn start_on(addr: SocketAddr) -> anyhow::Result<Self> {
        let std_listener = std::net::TcpListener::bind(addr)
            .map_err(|e| anyhow::anyhow!("failed to listen on {addr}: {e}"))?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let store = Arc::new(Mutex::new(Store::default()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = Arc::clone(&store);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("fake-apiserver".into())
            .spawn(move || {
                rt.block_on(async move {
                    let Ok(listener) = tokio::net::TcpListener::from_std(std_listener) else {
                        return;
                    };
                    tokio::select! {
                        () = accept_loop(listener, served) => {}
                        _ = stopped => {}
                    }
                });
            })?;
        Ok(Self {
            addr,
            store,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The address served.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stores `object` at `path` (replacing what was there) with a fresh
    /// resourceVersion, and a uid and creationTimestamp when it has none. No
    /// checks: this is how a test sets the scene, or plays another writer.
    pub fn put(&self, path: &str, object: Value) {
        lock(&self.store).objects.store(path, object);
    }

    /// The object at `path`.
    pub fn get(&self, path: &str) -> Option<Value> {
        lock(&self.store).objects.map.get(path).cloned()
    }

    /// Removes the object at `path` (a change watches see, with a fresh
    /// resourceVersion); whether there was one.
    pub fn remove(&self, path: &str) -> bool {
        lock(&self.store).objects.remove(path).is_some()
    }

    /// The store's current resourceVersion (that of the latest change).
    pub fn resource_version(&self) -> u64 {
        lock(&self.store).objects.resource_version
    }

    /// Watches started from now on that allow bookmarks get one every
    /// `period` (default [`DEFAULT_BOOKMARK_PERIOD`]; the real server's is a
    /// minute).
    pub fn set_bookmark_period(&self, period: Duration) {
        lock(&self.store).objects.history.bookmark_period = period;
    }

    /// Keeps the last `changes` (at least 1) changes of each resource for
    /// watches to resume from (default [`DEFAULT_HISTORY`]); a watch from an
    /// older resourceVersion gets the 410 `Expired` error event.
    pub fn set_watch_history(&self, changes: usize) {
        lock(&self.store).objects.history.set_capacity(changes);
    }

    /// Waits up to `timeout` until exactly `n` watches are being served (a
    /// watch's task ends when its client goes away); whether they are.
    pub fn wait_open_watches(&self, n: usize, timeout: Duration) -> bool {
        let open = Arc::clone(&lock(&self.store).objects.history.open);
        open.wait_for(n, timeout)
    }

    /// Ends every open watch cleanly, as a restarting API server does; their
    /// clients come back with the last resourceVersion they saw.
    pub fn end_watches(&self) {
        lock(&self.store).objects.history.end_watches();
    }

    /// Every object stored directly under the collection `path`.
    pub fn list(&self, path: &str) -> Vec<Value> {
        let prefix = format!("{}/", path.trim_end_matches('/'));
        lock(&self.store)
            .objects
            .map
            .iter()
            .filter(|(k, _)| {
                k.strip_prefix(&prefix)
                    .is_some_and(|rest| !rest.contains('/'))
            })
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Every request so far: method and path (with query, as sent).
    pub fn requests(&self) -> Vec<(String, String)> {
        lock(&self.store).requests.clone()
    }

    /// Forgets the requests seen so far.
    pub fn clear_requests(&self) {
        lock(&self.store).requests.clear();
    }

    /// The next `n` requests get HTTP `status` (with a `Status` body).
    pub fn fail_next(&self, n: u32, status: u16) {
        lock(&self.store).fail = (n > 0).then_some((n, status, None));
    }

    /// The next `n` requests with `method` get HTTP `status`; others are served.
    pub fn fail_next_on(&self, method: &str, n: u32, status: u16) {
        let method = Method::from_bytes(method.as_bytes()).ok();
        lock(&self.store).fail = (n > 0 && method.is_some()).then_some((n, status, method));
    }

    /// The next `n` requests with `method` find their object changed by another
    /// writer just before they arrive (its resourceVersion moves on), so a write
    /// carrying the resourceVersion it read gets the real 409 `Conflict`.
    pub fn race_next(&self, method: &str, n: u32) {
        let method = Method::from_bytes(method.as_bytes()).unwrap_or(Method::PUT);
        lock(&self.store).race = (n > 0).then_some((method, n));
    }

    /// Answers every request under these group versions (`resource.k8s.io/v1`) with
    /// 404, discovery included, as a server of a release that does not serve them.
    pub fn set_unserved(&self, group_versions: &[&str]) {
        lock(&self.store).unserved = group_versions.iter().map(|s| (*s).to_owned()).collect();
    }

    /// `GET /version` answers this major and minor (1.37 unless set).
    pub fn set_version(&self, major: &str, minor: &str) {
        lock(&self.store).objects.version = Some((major.to_owned(), minor.to_owned()));
    }

    /// Turns the `DRAPartitionableDevices` gate off (or on again): ResourceSlice
    /// writes lose their counter sets and consumed counters.
    pub fn set_partitionable_devices(&self, on: bool) {
        lock(&self.store).objects.partitionable_off = !on;
    }

    /// Every later `method` request whose path starts with `prefix` waits `delay`
    /// before it is served (a slow or distant API server); `None` stops that.
    pub fn set_latency(&self, latency: Option<(&str, &str, std::time::Duration)>) {
        lock(&self.store).latency = latency
            .and_then(|(m, p, d)| Some((Method::from_bytes(m.as_bytes()).ok()?, p.to_owned(), d)));
    }

    /// Writes a kubeconfig for this server into `dir` and returns its path.
    pub fn write_kubeconfig(&self, dir: &Path) -> std::io::Result<PathBuf> {
        let path = dir.join("kubeconfig");
        std::fs::write(&path, kubeconfig(&self.url()))?;
        Ok(path)
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A kubeconfig (YAML is a superset of JSON) whose one context points at `url`
/// without credentials.
pub fn kubeconfig(url: &str) -> String {
    let doc = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": url}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        "current-context": "fake",
    });
    format!("{doc}\n")
}

async fn accept_loop(listener: tokio::net::TcpListener, store: Arc<Mutex<Store>>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        // Go's net package turns Nagle's algorithm off on every TCP connection
        // (SetNoDelay, "the default is true", net/tcpsock.go), so each watch
        // event leaves kube-apiserver at once; with Nagle on, the first event
        // after the headers waits for the client's delayed ACK (~40 ms).
        let _ = stream.set_nodelay(true);
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let store = Arc::clone(&store);
                async move { Ok::<_, std::convert::Infallible>(handle(&store, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn handle(store: &Arc<Mutex<Store>>, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().trim_end_matches('/').to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    let with_query = req
        .uri()
        .path_and_query()
        .map_or_else(|| path.clone(), |p| p.as_str().to_owned());
    let unserved = lock(store)
        .unserved
        .iter()
        .any(|gv| path == format!("/apis/{gv}") || path.starts_with(&format!("/apis/{gv}/")));
    if unserved {
        lock(store)
            .requests
            .push((method.to_string(), with_query.clone()));
        return respond(status(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource",
        ));
    }
    let delay = lock(store)
        .latency
        .clone()
        .filter(|(m, p, _)| *m == method && path.starts_with(p.as_str()));
    if let Some((_, _, d)) = &delay {
        // Seen on arrival, answered after the delay.
        lock(store)
            .requests
            .push((method.to_string(), with_query.clone()));
        tokio::time::sleep(*d).await;
    }
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return respond(status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("body: {e}"),
            ))
        }
    };
    let mut s = lock(store);
    if delay.is_none() {
        s.requests.push((method.to_string(), with_query));
    }
    if let Some((n, code, only)) = s
        .fail
        .clone()
        .filter(|(_, _, m)| m.as_ref().is_none_or(|m| *m == method))
    {
        s.fail = (n > 1).then_some((n - 1, code, only));
        let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let reason = match code {
            StatusCode::CONFLICT => "Conflict",
            StatusCode::NOT_FOUND => "NotFound",
            StatusCode::FORBIDDEN => "Forbidden",
            StatusCode::TOO_MANY_REQUESTS => "TooManyRequests",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
            _ => "InternalError",
        };
        return respond(status(code, reason, "failure injected by the test"));
    }
    if let Some((m, n)) = s.race.clone() {
        if m == method {
            s.race = (n > 1).then_some((m, n - 1));
            // A write to `.../status` races a change of its object.
            let object = path.strip_suffix("/status").unwrap_or(&path).to_owned();
            if let Some(current) = s.objects.map.get(&object).cloned() {
                s.objects.store(&object, current);
            }
        }
    }
    let parsed = if body.is_empty() {
        None
    } else {
        match serde_json::from_slice::<Value>(&body) {
            Ok(v) => Some(v),
            Err(e) => {
                return respond(status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    &format!("invalid JSON: {e}"),
                ))
            }
        }
    };
    if method == Method::GET {
        let params = query::parse(&query);
        if query::flag(&params, "watch") {
            if let Some(route) = Route::parse(&path).filter(|r| r.name.is_none()) {
                return match watch::start(&mut s.objects, &route, &params) {
                    Ok(watcher) => {
                        let open = history::OpenWatch::new(&s.objects.history.open);
                        drop(s);
                        stream(store, watcher, open)
                    }
                    Err(answer) => respond(answer),
                };
            }
        }
    }
    respond(s.objects.handle(&method, &path, &query, parsed))
}

/// A 200 whose chunked body the watch task writes, one event per line
/// (`serveWatch` in staging/src/k8s.io/apiserver/pkg/endpoints/handlers/watch.go
/// sends the headers at once, then flushes each event).
fn stream(
    store: &Arc<Mutex<Store>>,
    watcher: watch::Watcher,
    open: history::OpenWatch,
) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(watcher.run(Arc::clone(store), tx, open));
    let mut r = Response::new(watch::ChannelBody(rx).boxed());
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

/// RFC 7386: objects merge key by key, `null` deletes, anything else replaces.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(t) = target {
        for (k, v) in p {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

/// Whether `path` names a resource this server serves (a collection, an object or
/// a status subresource).
pub fn is_served(path: &str) -> bool {
    Route::parse(path).is_some()
}

fn respond((code, body): (StatusCode, Value)) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *r.status_mut() = code;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

pub mod paths;

pub mod objects;

#[cfg(test)]
mod tests;
