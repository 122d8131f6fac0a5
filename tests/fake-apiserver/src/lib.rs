//! A stand-in for the Kubernetes API server, over real HTTP/1.1 on loopback.
//!
//! It stores JSON objects under their REST paths (`/api/v1/nodes/node-a`,
//! `/apis/apps/v1/namespaces/ns/daemonsets/ds`) and answers the verbs a node agent
//! uses: `GET` of an object or a collection, `POST` to a collection (the name comes
//! from `metadata.name`), `PATCH` (a JSON merge patch, RFC 7386), `PUT` and `DELETE`.
//! Unknown paths get a `404` with a `Status` body, as the real server sends. Tests can
//! make the next requests fail (`fail_next`) and read back every request made.
//!
//! It is generic on purpose: kube-rs builds the paths, so a client that asks for the
//! wrong object finds nothing here, just as it would in a cluster.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};

/// Objects by path, requests seen, failures armed.
#[derive(Debug, Default)]
struct Store {
    objects: BTreeMap<String, Value>,
    requests: Vec<(String, String)>,
    fail: Option<(u32, u16)>,
    resource_version: u64,
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

    /// Stores `object` at `path` (replacing what was there).
    pub fn put(&self, path: &str, object: Value) {
        let mut s = lock(&self.store);
        s.resource_version += 1;
        let rv = s.resource_version.to_string();
        s.objects
            .insert(path.to_owned(), with_resource_version(object, &rv));
    }

    /// The object at `path`.
    pub fn get(&self, path: &str) -> Option<Value> {
        lock(&self.store).objects.get(path).cloned()
    }

    /// Removes the object at `path`; whether there was one.
    pub fn remove(&self, path: &str) -> bool {
        lock(&self.store).objects.remove(path).is_some()
    }

    /// Every object stored under the collection `path`.
    pub fn list(&self, path: &str) -> Vec<Value> {
        children(&lock(&self.store).objects, path)
    }

    /// Every request so far: method and path (with query).
    pub fn requests(&self) -> Vec<(String, String)> {
        lock(&self.store).requests.clone()
    }

    /// The next `n` requests get HTTP `status` (with a `Status` body).
    pub fn fail_next(&self, n: u32, status: u16) {
        lock(&self.store).fail = (n > 0).then_some((n, status));
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

async fn handle(store: &Mutex<Store>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let method = req.method().clone();
    let path = req.uri().path().trim_end_matches('/').to_owned();
    let with_query = req
        .uri()
        .path_and_query()
        .map_or_else(|| path.clone(), |p| p.as_str().to_owned());
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return status(StatusCode::BAD_REQUEST, &format!("body: {e}")),
    };
    let mut s = lock(store);
    s.requests.push((method.to_string(), with_query));
    if let Some((n, code)) = s.fail {
        s.fail = (n > 1).then_some((n - 1, code));
        let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return status(code, "failure injected by the test");
    }
    let parsed = if body.is_empty() {
        None
    } else {
        match serde_json::from_slice::<Value>(&body) {
            Ok(v) => Some(v),
            Err(e) => return status(StatusCode::BAD_REQUEST, &format!("invalid JSON: {e}")),
        }
    };
    s.resource_version += 1;
    let rv = s.resource_version.to_string();
    match (method, parsed) {
        (Method::GET, _) => match s.objects.get(&path) {
            Some(o) => ok(StatusCode::OK, o),
            None if looks_like_collection(&path) => ok(
                StatusCode::OK,
                &json!({"kind": "List", "apiVersion": "v1", "metadata": {}, "items": children(&s.objects, &path)}),
            ),
            None => not_found(&path),
        },
        (Method::POST, Some(obj)) => {
            let Some(name) = obj.pointer("/metadata/name").and_then(Value::as_str) else {
                return status(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "metadata.name is required",
                );
            };
            let at = format!("{path}/{name}");
            if s.objects.contains_key(&at) {
                return status(StatusCode::CONFLICT, &format!("{at} already exists"));
            }
            let obj = with_resource_version(obj, &rv);
            s.objects.insert(at, obj.clone());
            ok(StatusCode::CREATED, &obj)
        }
        (Method::PUT, Some(obj)) => {
            let obj = with_resource_version(obj, &rv);
            s.objects.insert(path, obj.clone());
            ok(StatusCode::OK, &obj)
        }
        (Method::PATCH, Some(patch)) => match s.objects.get_mut(&path) {
            Some(obj) => {
                merge_patch(obj, &patch);
                let merged = with_resource_version(obj.clone(), &rv);
                *obj = merged.clone();
                ok(StatusCode::OK, &merged)
            }
            None => not_found(&path),
        },
        (Method::DELETE, _) => match s.objects.remove(&path) {
            Some(o) => ok(StatusCode::OK, &o),
            None => not_found(&path),
        },
        (m, _) => status(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("{m} {path} is not served"),
        ),
    }
}

/// A collection path ends in a plural resource name: an even number of segments
/// after `/api/v1` or `/apis/<group>/<version>`.
fn looks_like_collection(path: &str) -> bool {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let rest = match segs.first() {
        Some(&"api") => segs.len().saturating_sub(2),
        Some(&"apis") => segs.len().saturating_sub(3),
        _ => return false,
    };
    rest % 2 == 1
}

fn children(objects: &BTreeMap<String, Value>, path: &str) -> Vec<Value> {
    let prefix = format!("{path}/");
    objects
        .range(prefix.clone()..)
        .take_while(|(k, _)| k.starts_with(&prefix))
        .filter(|(k, _)| !k[prefix.len()..].contains('/'))
        .map(|(_, v)| v.clone())
        .collect()
}

fn with_resource_version(mut obj: Value, rv: &str) -> Value {
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("resourceVersion".into(), Value::String(rv.to_owned()));
    }
    obj
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

fn ok(code: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    respond(code, body.to_string())
}

fn not_found(path: &str) -> Response<Full<Bytes>> {
    status(StatusCode::NOT_FOUND, &format!("{path} not found"))
}

fn status(code: StatusCode, message: &str) -> Response<Full<Bytes>> {
    let reason = match code {
        StatusCode::NOT_FOUND => "NotFound",
        StatusCode::CONFLICT => "AlreadyExists",
        StatusCode::BAD_REQUEST => "BadRequest",
        StatusCode::UNPROCESSABLE_ENTITY => "Invalid",
        StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowed",
        _ => "InternalError",
    };
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    respond(code, body.to_string())
}

fn respond(code: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

/// Paths of the objects a node agent reads.
pub mod paths {
    /// `/api/v1/nodes/<name>`.
    pub fn node(name: &str) -> String {
        format!("/api/v1/nodes/{name}")
    }
    /// `/api/v1/namespaces/<ns>/pods/<name>`.
    pub fn pod(ns: &str, name: &str) -> String {
        format!("/api/v1/namespaces/{ns}/pods/{name}")
    }
    /// `/apis/apps/v1/namespaces/<ns>/daemonsets/<name>`.
    pub fn daemonset(ns: &str, name: &str) -> String {
        format!("/apis/apps/v1/namespaces/{ns}/daemonsets/{name}")
    }
    /// `/apis/events.k8s.io/v1/namespaces/<ns>/events`.
    pub fn events(ns: &str) -> String {
        format!("/apis/events.k8s.io/v1/namespaces/{ns}/events")
    }
}

/// Objects shaped like the ones a cluster serves.
pub mod objects {
    use serde_json::{json, Map, Value};

    fn string_map(pairs: &[(&str, &str)]) -> Value {
        Value::Object(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), Value::String((*v).to_owned())))
                .collect::<Map<_, _>>(),
        )
    }

    /// A Node with these labels.
    pub fn node(name: &str, labels: &[(&str, &str)]) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "uid": format!("uid-node-{name}"), "labels": string_map(labels)},
            "spec": {},
        })
    }

    /// A DaemonSet whose pod template selects nodes by `node_selector`.
    pub fn daemonset(ns: &str, name: &str, node_selector: &[(&str, &str)]) -> Value {
        json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": name, "namespace": ns, "uid": format!("uid-ds-{name}")},
            "spec": {
                "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
                "template": {
                    "metadata": {"labels": {"app.kubernetes.io/name": name}},
                    "spec": {
                        "nodeSelector": string_map(node_selector),
                        "containers": [{"name": name, "image": "localhost/vfio-sandbox:0.1.0"}],
                    },
                },
            },
        })
    }

    /// A Pod on `node` owned by the DaemonSet `ds`.
    pub fn pod(ns: &str, name: &str, node: &str, ds: &str) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": ns, "uid": format!("uid-pod-{name}"),
                "ownerReferences": [{
                    "apiVersion": "apps/v1", "kind": "DaemonSet", "name": ds,
                    "uid": format!("uid-ds-{ds}"), "controller": true, "blockOwnerDeletion": true,
                }],
            },
            "spec": {"nodeName": node, "containers": [{"name": ds, "image": "localhost/vfio-sandbox:0.1.0"}]},
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_follows_rfc_7386() {
        let mut v = json!({"a": {"b": 1, "c": 2}, "d": [1]});
        merge_patch(&mut v, &json!({"a": {"b": null, "e": 3}, "d": [2]}));
        assert_eq!(v, json!({"a": {"c": 2, "e": 3}, "d": [2]}));
    }

    #[test]
    fn collections_are_told_from_objects() {
        assert!(looks_like_collection("/api/v1/nodes"));
        assert!(!looks_like_collection("/api/v1/nodes/a"));
        assert!(looks_like_collection(
            "/apis/apps/v1/namespaces/x/daemonsets"
        ));
        assert!(!looks_like_collection(
            "/apis/apps/v1/namespaces/x/daemonsets/y"
        ));
    }
}
