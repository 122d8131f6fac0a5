//! The REST semantics of the API server for the resources a node agent touches:
//! which paths exist, what each verb does to the store, and the `Status` answers
//! the real server gives (404 `NotFound`, 409 `AlreadyExists` / `Conflict`, 400
//! `BadRequest`, 405, 422 `Invalid`).

use std::collections::BTreeMap;

use hyper::{Method, StatusCode};
use serde_json::{json, Map, Value};

use crate::query::{self, Requirement};
use crate::watch::History;

/// A resource the stand-in serves.
#[derive(Debug)]
pub(crate) struct Kind {
    /// `v1`, `apps/v1`, `resource.k8s.io/v1`.
    pub group_version: &'static str,
    /// The plural in paths.
    pub plural: &'static str,
    /// The `kind` of its objects.
    pub kind: &'static str,
    /// Whether objects live in a namespace.
    pub namespaced: bool,
    /// Whether it has a `status` subresource: writes to the object then leave
    /// `status` alone (and a create drops it), writes to `/status` change only it.
    pub status: bool,
    /// The field labels its lists can be selected by.
    pub fields: &'static [&'static str],
}

impl Kind {
    fn group(&self) -> &'static str {
        self.group_version
            .rsplit_once('/')
            .map_or("", |(group, _)| group)
    }

    /// `resourceslices.resource.k8s.io`, as the server's messages name a resource.
    fn qualified(&self) -> String {
        match self.group() {
            "" => self.plural.to_owned(),
            g => format!("{}.{g}", self.plural),
        }
    }

    fn prefix(&self) -> String {
        match self.group() {
            "" => format!("/api/{}", self.group_version),
            _ => format!("/apis/{}", self.group_version),
        }
    }
}

/// Every resource served. Anything else is a 404, as an unknown resource is on a
/// real server.
pub(crate) const KINDS: &[Kind] = &[
    Kind {
        group_version: "v1",
        plural: "nodes",
        kind: "Node",
        namespaced: false,
        // The node strategy takes status on create and update alike.
        status: false,
        fields: &["metadata.name", "spec.unschedulable"],
    },
    Kind {
        group_version: "v1",
        plural: "pods",
        kind: "Pod",
        namespaced: true,
        status: true,
        fields: &[
            "metadata.name",
            "metadata.namespace",
            "spec.nodeName",
            "spec.serviceAccountName",
            "status.phase",
        ],
    },
    Kind {
        group_version: "apps/v1",
        plural: "daemonsets",
        kind: "DaemonSet",
        namespaced: true,
        status: true,
        fields: &["metadata.name", "metadata.namespace"],
    },
    Kind {
        group_version: "events.k8s.io/v1",
        plural: "events",
        kind: "Event",
        namespaced: true,
        status: false,
        fields: &["metadata.name", "metadata.namespace", "reason", "type"],
    },
    Kind {
        group_version: "resource.k8s.io/v1",
        plural: "resourceslices",
        kind: "ResourceSlice",
        namespaced: false,
        status: false,
        // There is no field selector on the pool name upstream.
        fields: &["metadata.name", "spec.nodeName", "spec.driver"],
    },
    Kind {
        group_version: "resource.k8s.io/v1",
        plural: "resourceclaims",
        kind: "ResourceClaim",
        namespaced: true,
        status: true,
        fields: &["metadata.name", "metadata.namespace"],
    },
    Kind {
        group_version: "resource.k8s.io/v1",
        plural: "deviceclasses",
        kind: "DeviceClass",
        namespaced: false,
        status: false,
        fields: &["metadata.name"],
    },
];

/// The `APIResourceList` kube-apiserver answers at a group version's root
/// (`/api/v1`, `/apis/resource.k8s.io/v1`; `discovery/v1` of
/// staging/src/k8s.io/apiserver/pkg/endpoints/discovery/version.go): each
/// resource it serves there, with its kind, scope and verbs, and each status
/// subresource. `None` for any other path.
fn discovery(path: &str) -> Option<Value> {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let group_version = match segs.as_slice() {
        ["api", v] => (*v).to_owned(),
        ["apis", g, v] => format!("{g}/{v}"),
        _ => return None,
    };
    let verbs = json!([
        "create",
        "delete",
        "deletecollection",
        "get",
        "list",
        "patch",
        "update",
        "watch"
    ]);
    let mut resources = Vec::new();
    for k in KINDS.iter().filter(|k| k.group_version == group_version) {
        resources.push(json!({
            "name": k.plural, "singularName": k.kind.to_lowercase(), "namespaced": k.namespaced,
            "kind": k.kind, "verbs": verbs,
        }));
        if k.status {
            resources.push(json!({
                "name": format!("{}/status", k.plural), "singularName": "",
                "namespaced": k.namespaced, "kind": k.kind, "verbs": ["get", "patch", "update"],
            }));
        }
    }
    if resources.is_empty() {
        return None;
    }
    Some(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources,
    }))
}

/// A request path resolved against [`KINDS`].
#[derive(Debug, Clone)]
pub(crate) struct Route {
    pub kind: &'static Kind,
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub status: bool,
}

impl Route {
    /// Resolves `path`; `None` when no served resource lives there.
    pub fn parse(path: &str) -> Option<Self> {
        let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        let (gv, rest) = match segs.as_slice() {
            ["api", v, rest @ ..] => ((*v).to_owned(), rest),
            ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
            _ => return None,
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some((*ns).to_owned()), rest),
            _ => (None, rest),
        };
        let (plural, name, sub) = match rest {
            [p] => (*p, None, None),
            [p, n] => (*p, Some((*n).to_owned()), None),
            [p, n, s] => (*p, Some((*n).to_owned()), Some(*s)),
            _ => return None,
        };
        let kind = KINDS
            .iter()
            .find(|k| k.group_version == gv && k.plural == plural)?;
        // A namespaced resource is listed across namespaces without one, but its
        // objects only exist inside one; a cluster-scoped one has no namespace.
        if (kind.namespaced && namespace.is_none() && name.is_some())
            || (!kind.namespaced && namespace.is_some())
        {
            return None;
        }
        let status = match sub {
            None => false,
            Some("status") if kind.status => true,
            Some(_) => return None,
        };
        Some(Self {
            kind,
            namespace,
            name,
            status,
        })
    }

    /// The path of the object `name` in this route's collection.
    pub fn object_path(&self, name: &str) -> String {
        match &self.namespace {
            Some(ns) => format!(
                "{}/namespaces/{ns}/{}/{name}",
                self.kind.prefix(),
                self.kind.plural
            ),
            None => format!("{}/{}/{name}", self.kind.prefix(), self.kind.plural),
        }
    }
}

/// The store the handler works on.
#[derive(Debug, Default)]
pub(crate) struct Objects {
    pub map: BTreeMap<String, Value>,
    pub resource_version: u64,
    pub uids: u64,
    /// The recent changes watches are served from.
    pub history: History,
}

/// The field and label requirements of a list or watch.
#[derive(Debug, Clone, Default)]
pub(crate) struct Selectors {
    pub fields: Vec<Requirement>,
    pub labels: Vec<Requirement>,
}

impl Selectors {
    /// Whether `object` meets both.
    pub fn matches(&self, object: &Value) -> bool {
        query::fields_match(object, &self.fields) && query::labels_match(object, &self.labels)
    }
}

/// An answer: status code and JSON body.
pub(crate) type Answer = (StatusCode, Value);

/// A `Status` object as the API server sends with every failure.
pub(crate) fn status(code: StatusCode, reason: &str, message: &str) -> Answer {
    (
        code,
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code.as_u16(),
        }),
    )
}

fn status_about(code: StatusCode, reason: &str, message: &str, kind: &Kind, name: &str) -> Answer {
    let (code, mut body) = status(code, reason, message);
    body["details"] = json!({"name": name, "group": kind.group(), "kind": kind.plural});
    (code, body)
}

fn not_found(kind: &Kind, name: &str) -> Answer {
    status_about(
        StatusCode::NOT_FOUND,
        "NotFound",
        &format!("{} \"{name}\" not found", kind.qualified()),
        kind,
        name,
    )
}

fn conflict(kind: &Kind, name: &str, why: &str) -> Answer {
    status_about(
        StatusCode::CONFLICT,
        "Conflict",
        &format!(
            "Operation cannot be fulfilled on {} \"{name}\": {why}",
            kind.qualified()
        ),
        kind,
        name,
    )
}

fn bad_request(message: &str) -> Answer {
    status(StatusCode::BAD_REQUEST, "BadRequest", message)
}

fn method_not_allowed(method: &Method, path: &str) -> Answer {
    status(
        StatusCode::METHOD_NOT_ALLOWED,
        "MethodNotAllowed",
        &format!(
            "the server does not allow this method on the requested resource ({method} {path})"
        ),
    )
}

/// The object's `metadata.<key>` as a string.
fn meta<'v>(object: &'v Value, key: &str) -> Option<&'v str> {
    object.get("metadata")?.get(key)?.as_str()
}

fn meta_mut(object: &mut Value) -> Option<&mut Map<String, Value>> {
    object.get_mut("metadata")?.as_object_mut()
}

impl Objects {
    fn next_rv(&mut self) -> String {
        self.resource_version += 1;
        self.resource_version.to_string()
    }

    fn next_uid(&mut self) -> String {
        self.uids += 1;
        format!("6b1f7c2e-0000-4000-8000-{:012x}", self.uids)
    }

    /// Stores `object` at `path` as a write would: a fresh resourceVersion, and a
    /// uid and creationTimestamp when it has none.
    pub fn store(&mut self, path: &str, mut object: Value) -> Value {
        let rv = self.next_rv();
        let uid = self.next_uid();
        if let Some(m) = meta_mut(&mut object) {
            m.insert("resourceVersion".into(), rv.into());
            m.entry("uid").or_insert_with(|| uid.into());
            m.entry("creationTimestamp")
                .or_insert_with(|| crate::now_rfc3339().into());
        }
        let prev = self.map.insert(path.to_owned(), object.clone());
        self.record(path, Some(object.clone()), prev);
        object
    }

    /// Removes the object at `path` as a delete does: the removal is a change of
    /// its own, with a fresh resourceVersion, that watches see. Returns the
    /// object as it was.
    pub fn remove(&mut self, path: &str) -> Option<Value> {
        let old = self.map.remove(path)?;
        self.resource_version += 1;
        self.record(path, None, Some(old.clone()));
        Some(old)
    }

    /// Keeps the change at the current resourceVersion for the watches, when
    /// `path` is an object of a served resource.
    fn record(&mut self, path: &str, object: Option<Value>, prev: Option<Value>) {
        if let Some(route) = Route::parse(path).filter(|r| r.name.is_some() && !r.status) {
            self.history.record(
                self.resource_version,
                route.kind,
                route.namespace,
                object,
                prev,
            );
        }
    }

    fn list(&self, route: &Route) -> Vec<(String, Value)> {
        self.map
            .iter()
            .filter(|(path, _)| {
                Route::parse(path).is_some_and(|r| {
                    std::ptr::eq(r.kind, route.kind)
                        && r.name.is_some()
                        && !r.status
                        && (route.namespace.is_none() || r.namespace == route.namespace)
                })
            })
            .map(|(p, o)| (p.clone(), o.clone()))
            .collect()
    }

    /// Answers one request.
    pub fn handle(
        &mut self,
        method: &Method,
        path: &str,
        query: &str,
        body: Option<Value>,
    ) -> Answer {
        if let Some(list) = discovery(path) {
            return match method {
                &Method::GET => (StatusCode::OK, list),
                _ => method_not_allowed(method, path),
            };
        }
        if let Some(v1_path) = v1beta1_view(path) {
            return match *method {
                Method::GET | Method::DELETE => {
                    let (code, mut answer) = self.handle(method, &v1_path, query, body);
                    relabel_v1beta1(&mut answer);
                    (code, answer)
                }
                _ => method_not_allowed(method, path),
            };
        }
        let Some(route) = Route::parse(path) else {
            return status(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("the server could not find the requested resource ({method} {path})"),
            );
        };
        let params = query::parse(query);
        // A watch of a collection never gets here (see `crate::watch`); one of
        // an object, or with another verb, is not served.
        if params.iter().any(|(k, v)| k == "watch" && query::truthy(v)) {
            return method_not_allowed(method, &format!("{path}?watch"));
        }
        if params.iter().any(|(k, _)| k == "dryRun") {
            return bad_request("dryRun is not served by this stand-in");
        }
        match (method, &route.name, body) {
            (&Method::GET, None, _) => self.get_list(&route, &params),
            (&Method::GET, Some(name), _) => match self.map.get(&route.object_path(name)) {
                Some(o) => (StatusCode::OK, o.clone()),
                None => not_found(route.kind, name),
            },
            (&Method::POST, None, Some(obj))
                if route.namespace.is_some() || !route.kind.namespaced =>
            {
                self.create(&route, obj)
            }
            (&Method::PUT, Some(name), Some(obj)) => self.update(&route, name, obj),
            (&Method::PATCH, Some(name), Some(patch)) => self.patch(&route, name, &patch),
            (&Method::DELETE, Some(name), body) if !route.status => self.delete(&route, name, body),
            (&Method::DELETE, None, _) => self.delete_collection(&route, &params),
            (&Method::POST | &Method::PUT | &Method::PATCH, _, None) => {
                bad_request(&format!("{method} {path} needs a JSON body"))
            }
            (m, _, _) => method_not_allowed(m, path),
        }
    }

    /// The field and label selectors of a list or watch, checked as the API
    /// server checks them: a malformed one, or a field label the resource cannot
    /// be selected by, is a 400.
    pub fn selectors(route: &Route, params: &[(String, String)]) -> Result<Selectors, Answer> {
        let mut fields = Vec::new();
        let mut labels = Vec::new();
        for (k, v) in params {
            match k.as_str() {
                "fieldSelector" => {
                    fields = query::selector(v, false).map_err(|e| bad_request(&e))?
                }
                "labelSelector" => {
                    labels = query::selector(v, true).map_err(|e| bad_request(&e))?
                }
                _ => {}
            }
        }
        for r in &fields {
            let (Requirement::Equals(key, _) | Requirement::NotEquals(key, _)) = r else {
                continue;
            };
            if !route.kind.fields.contains(&key.as_str()) {
                return Err(bad_request(&format!(
                    "field label not supported: {key} (for {})",
                    route.kind.qualified()
                )));
            }
        }
        Ok(Selectors { fields, labels })
    }

    /// The objects of `route`'s collection its selectors pick.
    pub fn selected(
        &self,
        route: &Route,
        params: &[(String, String)],
    ) -> Result<Vec<(String, Value)>, Answer> {
        let selectors = Self::selectors(route, params)?;
        Ok(self
            .list(route)
            .into_iter()
            .filter(|(_, o)| selectors.matches(o))
            .collect())
    }

    fn list_answer(&self, route: &Route, items: Vec<Value>) -> Answer {
        (
            StatusCode::OK,
            json!({
                "kind": format!("{}List", route.kind.kind),
                "apiVersion": route.kind.group_version,
                "metadata": {"resourceVersion": self.resource_version.to_string()},
                "items": items,
            }),
        )
    }

    fn get_list(&self, route: &Route, params: &[(String, String)]) -> Answer {
        // ValidateListOptions in staging/src/k8s.io/apiserver/pkg/storage/util.go:
        // a resourceVersion that is not a number is a 400.
        if let Some((_, rv)) = params.iter().find(|(k, _)| k == "resourceVersion") {
            if let Err(e) = crate::watch::parse_resource_version(rv) {
                return bad_request(&format!("invalid resource version: {e}"));
            }
        }
        match self.selected(route, params) {
            Ok(items) => self.list_answer(route, items.into_iter().map(|(_, o)| o).collect()),
            Err(a) => a,
        }
    }

    /// The type and namespace checks every body gets.
    fn check_body(route: &Route, obj: &Value, patch: bool) -> Result<(), Answer> {
        if !obj.is_object() {
            return Err(bad_request("the body is not a JSON object"));
        }
        let want = (route.kind.group_version, route.kind.kind);
        let api_version = obj.get("apiVersion").and_then(Value::as_str);
        let kind = obj.get("kind").and_then(Value::as_str);
        if !(patch && api_version.is_none()) && api_version != Some(want.0) {
            return Err(bad_request(&format!(
                "the API version in the data ({}) does not match the expected API version ({})",
                api_version.unwrap_or(""),
                want.0
            )));
        }
        if !(patch && kind.is_none()) && kind != Some(want.1) {
            return Err(bad_request(&format!(
                "the kind in the data ({}) does not match the expected kind ({})",
                kind.unwrap_or(""),
                want.1
            )));
        }
        if !patch && !obj.get("metadata").is_some_and(Value::is_object) {
            return Err(bad_request("metadata is missing or not an object"));
        }
        if let (Some(ns), Some(have)) = (&route.namespace, meta(obj, "namespace")) {
            if ns != have {
                return Err(bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
        }
        if !route.kind.namespaced && meta(obj, "namespace").is_some_and(|n| !n.is_empty()) {
            return Err(bad_request(&format!(
                "{} is cluster-scoped: metadata.namespace must be empty",
                route.kind.qualified()
            )));
        }
        Ok(())
    }

    fn create(&mut self, route: &Route, mut obj: Value) -> Answer {
        if let Err(a) = Self::check_body(route, &obj, false) {
            return a;
        }
        if meta(&obj, "resourceVersion").is_some_and(|rv| !rv.is_empty()) {
            return bad_request("resourceVersion should not be set on objects to be created");
        }
        let name = match (meta(&obj, "name"), meta(&obj, "generateName")) {
            (Some(n), _) if !n.is_empty() => n.to_owned(),
            (_, Some(g)) if !g.is_empty() => {
                let g: String = g.chars().take(253 - 5).collect();
                format!("{g}{}", suffix(self.uids + self.resource_version))
            }
            _ => {
                return status(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "Invalid",
                    &format!("{} is invalid: metadata.name: Required value: name or generateName is required", route.kind.kind),
                )
            }
        };
        if let Err(why) = dns_subdomain(&name) {
            return status_about(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                &format!(
                    "{} \"{name}\" is invalid: metadata.name: Invalid value: {why}",
                    route.kind.kind
                ),
                route.kind,
                &name,
            );
        }
        let path = route.object_path(&name);
        if self.map.contains_key(&path) {
            return status_about(
                StatusCode::CONFLICT,
                "AlreadyExists",
                &format!("{} \"{name}\" already exists", route.kind.qualified()),
                route.kind,
                &name,
            );
        }
        let uid = self.next_uid();
        if let Some(m) = meta_mut(&mut obj) {
            m.insert("name".into(), name.clone().into());
            if let Some(ns) = &route.namespace {
                m.insert("namespace".into(), ns.clone().into());
            }
            // The server owns these, whatever the client sent.
            m.insert("uid".into(), uid.into());
            m.insert("creationTimestamp".into(), crate::now_rfc3339().into());
            m.remove("deletionTimestamp");
        }
        if route.kind.status {
            if let Some(o) = obj.as_object_mut() {
                o.remove("status");
            }
        }
        (StatusCode::CREATED, self.store(&path, obj))
    }

    /// Checks an update's preconditions against the stored object.
    fn preconditions(
        kind: &Kind,
        name: &str,
        stored: &Value,
        rv: Option<&str>,
        uid: Option<&str>,
    ) -> Result<(), Answer> {
        if let Some(uid) = uid.filter(|u| !u.is_empty()) {
            let have = meta(stored, "uid").unwrap_or("");
            if uid != have {
                return Err(conflict(
                    kind,
                    name,
                    &format!("Precondition failed: UID in precondition: {uid}, UID in object meta: {have}"),
                ));
            }
        }
        if let Some(rv) = rv.filter(|r| !r.is_empty()) {
            if rv != meta(stored, "resourceVersion").unwrap_or("") {
                return Err(conflict(
                    kind,
                    name,
                    "the object has been modified; please apply your changes to the latest version and try again",
                ));
            }
        }
        Ok(())
    }

    fn update(&mut self, route: &Route, name: &str, obj: Value) -> Answer {
        if let Err(a) = Self::check_body(route, &obj, false) {
            return a;
        }
        if meta(&obj, "name") != Some(name) {
            return bad_request(&format!(
                "the name of the object ({}) does not match the name on the URL ({name})",
                meta(&obj, "name").unwrap_or("")
            ));
        }
        let path = route.object_path(name);
        let Some(old) = self.map.get(&path).cloned() else {
            return not_found(route.kind, name);
        };
        if let Err(a) = Self::preconditions(
            route.kind,
            name,
            &old,
            meta(&obj, "resourceVersion"),
            meta(&obj, "uid"),
        ) {
            return a;
        }
        let new = if route.status {
            let mut new = old.clone();
            new["status"] = obj.get("status").cloned().unwrap_or(Value::Null);
            new
        } else {
            let mut new = obj;
            keep_server_fields(&mut new, &old, route.kind.status);
            new
        };
        self.commit(&path, &old, new)
    }

    fn patch(&mut self, route: &Route, name: &str, patch: &Value) -> Answer {
        if let Err(a) = Self::check_body(route, patch, true) {
            return a;
        }
        let path = route.object_path(name);
        let Some(old) = self.map.get(&path).cloned() else {
            return not_found(route.kind, name);
        };
        if let Err(a) = Self::preconditions(
            route.kind,
            name,
            &old,
            meta(patch, "resourceVersion"),
            meta(patch, "uid"),
        ) {
            return a;
        }
        let mut new = old.clone();
        crate::merge_patch(&mut new, patch);
        if meta(&new, "name") != Some(name) {
            return bad_request("metadata.name cannot be changed by a patch");
        }
        if route.status {
            let status = new.get("status").cloned();
            new = old.clone();
            new["status"] = status.unwrap_or(Value::Null);
        } else {
            keep_server_fields(&mut new, &old, route.kind.status);
        }
        self.commit(&path, &old, new)
    }

    /// Stores `new` unless it equals `old` (a no-op write keeps the
    /// resourceVersion, as on a real server).
    fn commit(&mut self, path: &str, old: &Value, new: Value) -> Answer {
        let strip = |v: &Value| {
            let mut v = v.clone();
            if let Some(m) = meta_mut(&mut v) {
                m.remove("resourceVersion");
            }
            v
        };
        if strip(old) == strip(&new) {
            return (StatusCode::OK, old.clone());
        }
        (StatusCode::OK, self.store(path, new))
    }

    fn delete(&mut self, route: &Route, name: &str, body: Option<Value>) -> Answer {
        let options = match body {
            None => Value::Null,
            Some(o) if !o.is_object() => return bad_request("DeleteOptions must be a JSON object"),
            Some(o) => {
                let kind = o.get("kind").and_then(Value::as_str);
                if kind.is_some_and(|k| k != "DeleteOptions") {
                    return bad_request(&format!(
                        "the kind in the data ({}) does not match the expected kind (DeleteOptions)",
                        kind.unwrap_or("")
                    ));
                }
                o
            }
        };
        let path = route.object_path(name);
        let Some(old) = self.map.get(&path) else {
            return not_found(route.kind, name);
        };
        let pre = options.get("preconditions");
        let field = |k: &str| pre.and_then(|p| p.get(k)).and_then(Value::as_str);
        if let Err(a) = Self::preconditions(
            route.kind,
            name,
            old,
            field("resourceVersion"),
            field("uid"),
        ) {
            return a;
        }
        match self.remove(&path) {
            Some(o) => (StatusCode::OK, o),
            None => not_found(route.kind, name),
        }
    }

    fn delete_collection(&mut self, route: &Route, params: &[(String, String)]) -> Answer {
        if route.status {
            return method_not_allowed(&Method::DELETE, "status");
        }
        let items = match self.selected(route, params) {
            Ok(items) => items,
            Err(a) => return a,
        };
        // The registry deletes the items one by one (DeleteCollection in
        // staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go),
        // so each removal is a change of its own and a watch sees one DELETED
        // per object.
        let mut deleted = Vec::new();
        for (path, _) in items {
            if let Some(o) = self.remove(&path) {
                deleted.push(o);
            }
        }
        self.list_answer(route, deleted)
    }
}

/// The `resource.k8s.io/v1beta1` resources read and deleted through the `v1`
/// ones: kubelet 1.32 calls `ResourceV1beta1()` (`ResourceClaims().Get` in
/// `pkg/kubelet/cm/dra/manager.go`, `ResourceSlices().DeleteCollection` in
/// `pkg/kubelet/cm/dra/plugin/registration.go`), which a 1.34 API server still
/// serves from the same storage, converting each object. This stand-in does not
/// convert: the objects keep their `v1` shape under a `v1beta1` label. What kubelet
/// reads (metadata, `status.allocation.devices.results[].driver`,
/// `status.reservedFor`) and the slice field selectors are the same in both.
/// Writes in `v1beta1` are not served.
const V1BETA1_VIEWS: &[&str] = &["resourceslices", "resourceclaims"];

/// The `v1` path of a `v1beta1` view path.
fn v1beta1_view(path: &str) -> Option<String> {
    let rest = path.strip_prefix("/apis/resource.k8s.io/v1beta1/")?;
    let segs: Vec<&str> = rest.split('/').collect();
    let plural = match segs.as_slice() {
        ["namespaces", _, p, ..] => p,
        [p, ..] => p,
        [] => return None,
    };
    V1BETA1_VIEWS
        .contains(plural)
        .then(|| format!("/apis/resource.k8s.io/v1/{rest}"))
}

/// Labels a `v1` answer (an object or a list) as `v1beta1`.
fn relabel_v1beta1(answer: &mut Value) {
    fn one(o: &mut Value) {
        if o.get("apiVersion").and_then(Value::as_str) == Some("resource.k8s.io/v1") {
            o["apiVersion"] = "resource.k8s.io/v1beta1".into();
        }
    }
    one(answer);
    if let Some(items) = answer.get_mut("items").and_then(Value::as_array_mut) {
        items.iter_mut().for_each(one);
    }
}

/// Keeps what a client cannot change by writing the object: uid, creation time,
/// and the status of a resource with a status subresource.
fn keep_server_fields(new: &mut Value, old: &Value, status: bool) {
    for key in ["uid", "creationTimestamp"] {
        if let (Some(m), Some(v)) = (meta_mut(new), old.get("metadata").and_then(|m| m.get(key))) {
            m.insert(key.into(), v.clone());
        }
    }
    if status {
        if let Some(o) = new.as_object_mut() {
            match old.get("status") {
                Some(s) => o.insert("status".into(), s.clone()),
                None => o.remove("status"),
            };
        }
    }
}

/// Five characters from the alphabet the API server draws generated-name
/// suffixes from (no vowels, no look-alikes).
fn suffix(mut n: u64) -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let base = ALPHABET.len() as u64;
    // Spread consecutive numbers apart so names do not look sequential.
    n = n.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17);
    (0..5)
        .map(|_| {
            let c = ALPHABET[(n % base) as usize];
            n /= base;
            char::from(c)
        })
        .collect()
}

/// RFC 1123 DNS subdomain: at most 253 characters of `[a-z0-9.-]`, starting and
/// ending with an alphanumeric.
pub(crate) fn dns_subdomain(name: &str) -> Result<(), String> {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if name.len() > 253 {
        return Err(format!("\"{name}\": must be no more than 253 characters"));
    }
    if !name.chars().all(ok_char) || !alnum(name.chars().next()) || !alnum(name.chars().last()) {
        return Err(format!(
            "\"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
        ));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn routes_resolve_only_served_resources() {
        let r = Route::parse("/apis/resource.k8s.io/v1/resourceslices/a").unwrap();
        assert_eq!(
            (r.kind.kind, r.name.as_deref()),
            ("ResourceSlice", Some("a"))
        );
        let r =
            Route::parse("/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c/status").unwrap();
        assert!(r.status);
        assert_eq!(r.namespace.as_deref(), Some("ns"));
        assert!(
            Route::parse("/api/v1/pods").is_some(),
            "pods across namespaces"
        );
        for bad in [
            "/apis/resource.k8s.io/v1/namespaces/ns/resourceslices",
            "/apis/resource.k8s.io/v1beta1/resourceslices",
            "/apis/resource.k8s.io/v1/resourceslices/a/status",
            "/apis/resource.k8s.io/v1/resourceclaims/c",
            "/api/v1/widgets",
            "/healthz",
            "/api/v1/nodes/a/b/c",
        ] {
            assert!(Route::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn generated_suffixes_differ_and_are_valid() {
        let a = suffix(1);
        let b = suffix(2);
        assert_ne!(a, b);
        assert_eq!(a.len(), 5);
        assert!(dns_subdomain(&format!("x-{a}")).is_ok());
        assert!(dns_subdomain("Upper").is_err());
        assert!(dns_subdomain("-a").is_err());
        assert!(dns_subdomain(&"a".repeat(254)).is_err());
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod verbs {
    use super::*;

    const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";

    fn slice(name: &str, node: &str, driver: &str) -> Value {
        json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {"driver": driver, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}},
        })
    }

    fn code(a: &Answer) -> u16 {
        a.0.as_u16()
    }

    #[test]
    fn create_sets_server_fields_and_refuses_a_taken_name() {
        let mut o = Objects::default();
        let (c, created) = o.handle(&Method::POST, SLICES, "", Some(slice("a", "n1", "d.x")));
        assert_eq!(c, StatusCode::CREATED);
        assert!(meta(&created, "uid").is_some_and(|u| !u.is_empty()));
        assert!(meta(&created, "creationTimestamp").is_some());
        assert_eq!(meta(&created, "resourceVersion"), Some("1"));
        let again = o.handle(&Method::POST, SLICES, "", Some(slice("a", "n1", "d.x")));
        assert_eq!(
            (code(&again), again.1["reason"].as_str()),
            (409, Some("AlreadyExists"))
        );
        let mut generated = slice("", "n1", "d.x");
        generated["metadata"] = json!({"generateName": "n1-d-x-"});
        let (c, g) = o.handle(&Method::POST, SLICES, "", Some(generated));
        assert_eq!(c, StatusCode::CREATED);
        let name = meta(&g, "name").unwrap();
        assert!(
            name.starts_with("n1-d-x-") && name.len() == "n1-d-x-".len() + 5,
            "{name}"
        );
    }

    #[test]
    fn wrong_kind_version_or_namespace_is_a_bad_request() {
        let mut o = Objects::default();
        let mut wrong = slice("a", "n", "d");
        wrong["apiVersion"] = json!("resource.k8s.io/v1beta1");
        let a = o.handle(&Method::POST, SLICES, "", Some(wrong));
        assert_eq!(code(&a), 400, "{}", a.1);
        let mut wrong = slice("a", "n", "d");
        wrong["kind"] = json!("ResourceClaim");
        assert_eq!(code(&o.handle(&Method::POST, SLICES, "", Some(wrong))), 400);
        let mut wrong = slice("a", "n", "d");
        wrong["metadata"]["namespace"] = json!("x");
        assert_eq!(code(&o.handle(&Method::POST, SLICES, "", Some(wrong))), 400);
        assert_eq!(
            code(&o.handle(&Method::POST, SLICES, "", Some(json!([1])))),
            400
        );
        assert_eq!(code(&o.handle(&Method::POST, SLICES, "", None)), 400);
        assert_eq!(
            code(&o.handle(
                &Method::GET,
                "/apis/resource.k8s.io/v1alpha9/resourceslices",
                "",
                None
            )),
            404
        );
        assert_eq!(
            code(&o.handle(
                &Method::POST,
                &format!("{SLICES}/a"),
                "",
                Some(slice("a", "n", "d"))
            )),
            405
        );
    }

    #[test]
    fn a_stale_update_conflicts_and_a_fresh_one_lands() {
        let mut o = Objects::default();
        let (_, created) = o.handle(&Method::POST, SLICES, "", Some(slice("a", "n", "d")));
        let path = format!("{SLICES}/a");
        let mut fresh = created.clone();
        fresh["spec"]["pool"]["generation"] = json!(2);
        let (c, updated) = o.handle(&Method::PUT, &path, "", Some(fresh.clone()));
        assert_eq!(c, StatusCode::OK);
        assert_ne!(
            meta(&updated, "resourceVersion"),
            meta(&created, "resourceVersion")
        );
        assert_eq!(meta(&updated, "uid"), meta(&created, "uid"));
        let stale = o.handle(&Method::PUT, &path, "", Some(fresh));
        assert_eq!(
            (code(&stale), stale.1["reason"].as_str()),
            (409, Some("Conflict"))
        );
        let (_, same) = o.handle(&Method::PUT, &path, "", Some(updated.clone()));
        assert_eq!(same, updated, "a no-op update keeps the resourceVersion");
        let gone = o.handle(
            &Method::PUT,
            &format!("{SLICES}/b"),
            "",
            Some(slice("b", "n", "d")),
        );
        assert_eq!(code(&gone), 404);
        let renamed = o.handle(&Method::PUT, &path, "", Some(slice("b", "n", "d")));
        assert_eq!(code(&renamed), 400);
    }

    #[test]
    fn lists_filter_by_supported_fields_only() {
        let mut o = Objects::default();
        for (n, node, driver) in [("a", "n1", "d"), ("b", "n2", "d"), ("c", "n1", "e")] {
            o.handle(&Method::POST, SLICES, "", Some(slice(n, node, driver)));
        }
        let names = |a: &Answer| -> Vec<String> {
            a.1["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| meta(i, "name").unwrap().to_owned())
                .collect()
        };
        let all = o.handle(&Method::GET, SLICES, "", None);
        assert_eq!(all.1["kind"], "ResourceSliceList");
        assert_eq!(names(&all), ["a", "b", "c"]);
        let q = "fieldSelector=spec.nodeName%3Dn1%2Cspec.driver%3Dd";
        assert_eq!(names(&o.handle(&Method::GET, SLICES, q, None)), ["a"]);
        let bad = o.handle(
            &Method::GET,
            SLICES,
            "fieldSelector=spec.pool.name%3Dn1",
            None,
        );
        assert_eq!(code(&bad), 400, "{}", bad.1);
        let deleted = o.handle(
            &Method::DELETE,
            SLICES,
            "fieldSelector=spec.driver%3Dd",
            None,
        );
        assert_eq!(names(&deleted), ["a", "b"]);
        assert_eq!(names(&o.handle(&Method::GET, SLICES, "", None)), ["c"]);
    }

    #[test]
    fn kubelet_1_32_reads_and_wipes_through_v1beta1() {
        let mut o = Objects::default();
        for (n, node, driver) in [("a", "n1", "d"), ("b", "n1", "e"), ("c", "n2", "d")] {
            o.handle(&Method::POST, SLICES, "", Some(slice(n, node, driver)));
        }
        let names = |a: &Answer| -> Vec<String> {
            a.1["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| meta(i, "name").unwrap().to_owned())
                .collect()
        };
        let wiped = o.handle(
            &Method::DELETE,
            "/apis/resource.k8s.io/v1beta1/resourceslices",
            "fieldSelector=spec.driver%3Dd%2Cspec.nodeName%3Dn1",
            Some(json!({"kind": "DeleteOptions", "apiVersion": "resource.k8s.io/v1beta1"})),
        );
        assert_eq!(code(&wiped), 200);
        assert_eq!(names(&wiped), ["a"]);
        assert_eq!(wiped.1["apiVersion"], "resource.k8s.io/v1beta1");
        assert_eq!(wiped.1["items"][0]["apiVersion"], "resource.k8s.io/v1beta1");
        let left = o.handle(
            &Method::GET,
            "/apis/resource.k8s.io/v1/resourceslices",
            "",
            None,
        );
        assert_eq!(names(&left), ["b", "c"]);
        let put = o.handle(
            &Method::POST,
            "/apis/resource.k8s.io/v1beta1/resourceslices",
            "",
            Some(slice("x", "n1", "d")),
        );
        assert_eq!(code(&put), 405);
    }

    #[test]
    fn delete_answers_404_and_checks_preconditions() {
        let mut o = Objects::default();
        let (_, created) = o.handle(&Method::POST, SLICES, "", Some(slice("a", "n", "d")));
        let path = format!("{SLICES}/a");
        let wrong = json!({"preconditions": {"uid": "other"}});
        assert_eq!(
            code(&o.handle(&Method::DELETE, &path, "", Some(wrong))),
            409
        );
        let wrong_kind = json!({"kind": "Node"});
        assert_eq!(
            code(&o.handle(&Method::DELETE, &path, "", Some(wrong_kind))),
            400
        );
        let right = json!({"preconditions": {"uid": meta(&created, "uid"), "resourceVersion": meta(&created, "resourceVersion")}});
        assert_eq!(
            code(&o.handle(&Method::DELETE, &path, "", Some(right))),
            200
        );
        let again = o.handle(&Method::DELETE, &path, "", None);
        assert_eq!(
            (code(&again), again.1["reason"].as_str()),
            (404, Some("NotFound"))
        );
        assert_eq!(again.1["details"]["name"], "a");
    }

    #[test]
    fn claim_status_is_written_through_its_subresource_only() {
        let mut o = Objects::default();
        let claims = "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims";
        let mut claim = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c"}, "spec": {"devices": {}},
            "status": {"allocation": {}},
        });
        let (_, created) = o.handle(&Method::POST, claims, "", Some(claim.clone()));
        assert!(created.get("status").is_none(), "create drops status");
        assert_eq!(meta(&created, "namespace"), Some("ns"));
        claim = created;
        claim["status"] = json!({"allocation": {"devices": {"results": []}}});
        let (_, main) = o.handle(
            &Method::PUT,
            &format!("{claims}/c"),
            "",
            Some(claim.clone()),
        );
        assert!(
            main.get("status").is_none(),
            "the main resource leaves status alone"
        );
        claim["metadata"]["resourceVersion"] = main["metadata"]["resourceVersion"].clone();
        let (c, with_status) =
            o.handle(&Method::PUT, &format!("{claims}/c/status"), "", Some(claim));
        assert_eq!(c, StatusCode::OK);
        assert_eq!(
            with_status["status"]["allocation"]["devices"]["results"],
            json!([])
        );
        let missing = o.handle(&Method::GET, &format!("{claims}/d"), "", None);
        assert_eq!(code(&missing), 404);
        assert_eq!(
            missing.1["message"],
            "resourceclaims.resource.k8s.io \"d\" not found"
        );
    }
}
