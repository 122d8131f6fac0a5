//! The REST semantics of the API server for the resources a node agent touches:
//! which paths exist, what each verb does to the store, and the `Status` answers
//! the real server gives (404 `NotFound`, 409 `AlreadyExists` / `Conflict`, 400
//! `BadRequest`, 405, 422 `Invalid`).

use std::collections::BTreeMap;

use hyper::{Method, StatusCode};
use serde_json::{json, Map, Value};

use crate::history::{History, Resource};
use crate::query::{self, Requirement};

mod objects;

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
    /// Its key in the watch history.
    pub fn resource(&self) -> Resource {
        (self.group_version, self.plural)
    }

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
        // pkg/registry/coordination/lease/strategy.go: no status, and only
        // the generic name and namespace fields.
        group_version: "coordination.k8s.io/v1",
        plural: "leases",
        kind: "Lease",
        namespaced: true,
        status: false,
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
    /// `GET /version`'s major and minor; 1.37 unless set.
    pub version: Option<(String, String)>,
    /// The `DRAPartitionableDevices` gate is off: ResourceSlice writes lose their
    /// counters.
    pub partitionable_off: bool,
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
            "\"{name}\": a lowercase RFC 1123 subdomain must consist of lower case \
                alphanumeric characters, '-' or '.', and must start and end with an \
                alphanumeric character"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
