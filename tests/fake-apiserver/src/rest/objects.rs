//! What each verb does to the store: get, list, create, replace, patch, delete
//! and the `/status` writes, with the real server's checks and answers.

use super::*;

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
                .or_insert_with(|| support::time::now_rfc3339().into());
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
                route.kind.resource(),
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
        if path == "/version" {
            // version.Info (`staging/src/k8s.io/apimachinery/pkg/version/types.go`).
            let (major, minor) = self
                .version
                .clone()
                .unwrap_or_else(|| ("1".into(), "37".into()));
            let v = json!({
                "major": major, "minor": minor, "gitVersion": format!("v{major}.{minor}.0"),
                "gitCommit": "", "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z",
                "goVersion": "go1.26.8", "compiler": "gc", "platform": "linux/amd64",
            });
            return match method {
                &Method::GET => (StatusCode::OK, v),
                _ => method_not_allowed(method, path),
            };
        }
        if let Some(list) = discovery(path) {
            return match method {
                &Method::GET => (StatusCode::OK, list),
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
        // dryRun=All on a create: checked like one, answered, never stored
        // (`staging/src/k8s.io/apiserver/pkg/registry/generic/registry/dryrun.go`,
        // `DryRunnableStorage.Create`); on other verbs it is not served here.
        let dry_run = params
            .iter()
            .find(|(k, _)| k == "dryRun")
            .map(|(_, v)| v.as_str());
        match (dry_run, method) {
            (None, _) => {}
            (Some("All"), &Method::POST) => {}
            (Some("All"), _) => {
                return bad_request("dryRun is served by this stand-in on create only")
            }
            (Some(v), _) => {
                return bad_request(&format!(
                    "Invalid dryRun value: {v:?}; the only supported value is \"All\""
                ))
            }
        }
        let dry_run = dry_run.is_some();
        match (method, &route.name, body) {
            (&Method::GET, None, _) => self.get_list(&route, &params),
            (&Method::GET, Some(name), _) => match self.map.get(&route.object_path(name)) {
                Some(o) => (StatusCode::OK, o.clone()),
                None => not_found(route.kind, name),
            },
            (&Method::POST, None, Some(obj))
                if route.namespace.is_some() || !route.kind.namespaced =>
            {
                self.create(&route, obj, dry_run)
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
                    "the namespace of the provided object does not match the namespace \
                        sent on the request",
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

    fn create(&mut self, route: &Route, mut obj: Value, dry_run: bool) -> Answer {
        if let Err(a) = Self::check_body(route, &obj, false) {
            return a;
        }
        self.drop_disabled_fields(route, &mut obj);
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
                    &format!(
                        "{} is invalid: metadata.name: Required value: name or \
                            generateName is required",
                        route.kind.kind
                    ),
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
        // A dry run's object gets a uid too, from a range of its own so that the
        // stored objects' uids stay as they would be without it.
        let uid = if dry_run {
            format!("6b1f7c2e-0000-4000-9000-{:012x}", self.uids)
        } else {
            self.next_uid()
        };
        if let Some(m) = meta_mut(&mut obj) {
            m.insert("name".into(), name.clone().into());
            if let Some(ns) = &route.namespace {
                m.insert("namespace".into(), ns.clone().into());
            }
            // The server owns these, whatever the client sent.
            m.insert("uid".into(), uid.into());
            m.insert(
                "creationTimestamp".into(),
                support::time::now_rfc3339().into(),
            );
            m.remove("deletionTimestamp");
        }
        if route.kind.status {
            if let Some(o) = obj.as_object_mut() {
                o.remove("status");
            }
        }
        if dry_run {
            return (StatusCode::CREATED, obj);
        }
        (StatusCode::CREATED, self.store(&path, obj))
    }

    /// What a gate that is off takes from a write: with `DRAPartitionableDevices`
    /// off, a ResourceSlice's `sharedCounters` and each device's
    /// `consumesCounters` (`dropDisabledDRAPartitionableDevicesFields`,
    /// `pkg/registry/resource/resourceslice/strategy.go`; the stored object never
    /// used them, as ours never do while the gate is off).
    fn drop_disabled_fields(&self, route: &Route, obj: &mut Value) {
        if !self.partitionable_off || route.kind.plural != "resourceslices" {
            return;
        }
        if let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) {
            spec.remove("sharedCounters");
            spec.remove("perDeviceNodeSelection");
            for d in spec
                .get_mut("devices")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
            {
                if let Some(d) = d.as_object_mut() {
                    for f in ["consumesCounters", "nodeName", "nodeSelector", "allNodes"] {
                        d.remove(f);
                    }
                }
            }
        }
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
                    &format!(
                        "Precondition failed: UID in precondition: {uid}, UID in \
                            object meta: {have}"
                    ),
                ));
            }
        }
        if let Some(rv) = rv.filter(|r| !r.is_empty()) {
            if rv != meta(stored, "resourceVersion").unwrap_or("") {
                return Err(conflict(
                    kind,
                    name,
                    "the object has been modified; please apply your changes to the \
                        latest version and try again",
                ));
            }
        }
        Ok(())
    }

    fn update(&mut self, route: &Route, name: &str, mut obj: Value) -> Answer {
        if let Err(a) = Self::check_body(route, &obj, false) {
            return a;
        }
        self.drop_disabled_fields(route, &mut obj);
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
                        "the kind in the data ({}) does not match the expected kind \
                            (DeleteOptions)",
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
