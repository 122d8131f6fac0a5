#![allow(clippy::unwrap_used)]

use super::*;

#[test]
fn routes_resolve_only_served_resources() {
    let r = Route::parse("/apis/resource.k8s.io/v1/resourceslices/a").unwrap();
    assert_eq!(
        (r.kind.kind, r.name.as_deref()),
        ("ResourceSlice", Some("a"))
    );
    let r = Route::parse("/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c/status").unwrap();
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
