use super::*;

fn claim(uid: &str, ns: &str, name: &str) -> ClaimRef {
    ClaimRef {
        uid: uid.into(),
        namespace: ns.into(),
        name: name.into(),
    }
}

#[test]
fn a_batch_has_each_uid_once_and_refuses_empty_and_conflicting_ones() {
    let b = batch([
        claim("a", "ns", "one"),
        claim("", "ns", "nouid"),
        claim("a", "ns", "one"),
        claim("b", "ns", "two"),
        claim("c", "ns", "three"),
        claim("c", "other", "three"),
    ]);
    assert_eq!(
        b.claims,
        vec![claim("a", "ns", "one"), claim("b", "ns", "two")]
    );
    assert_eq!(b.refused.len(), 2);
    assert_eq!(b.refused[""], "claim ns/nouid has no uid");
    assert!(
        b.refused["c"].contains("ns/three and other/three"),
        "{}",
        b.refused["c"]
    );
}

#[tokio::test]
async fn answers_cover_every_uid_asked_and_nothing_else() {
    let b = batch([
        claim("a", "ns", "x"),
        claim("b", "ns", "y"),
        claim("", "ns", "z"),
    ]);
    let answers = answer(b, |claims| async move {
        assert_eq!(claims.len(), 2);
        let mut m: Answers<()> = BTreeMap::new();
        m.insert("a".into(), Ok(()));
        m.insert("stranger".into(), Ok(()));
        m
    })
    .await;
    let keys: Vec<_> = answers.keys().cloned().collect();
    assert_eq!(keys, ["", "a", "b"]);
    assert_eq!(answers["a"], Ok(()));
    assert_eq!(
        answers["b"],
        Err("the driver gave no answer for this claim".into())
    );
}

#[tokio::test]
async fn a_panicking_driver_gives_errors_not_a_crash() {
    let answers: Answers<()> = answer(batch([claim("a", "ns", "x")]), |_| async move {
        panic!("driver bug");
    })
    .await;
    assert!(answers["a"].is_err());
}

#[test]
fn driver_names_must_be_one_path_component() {
    for bad in ["", ".", "..", "a/b", "x\0"] {
        assert!(GrpcConfig::new(bad, "/r", "/p").check().is_err(), "{bad:?}");
    }
    let cfg = GrpcConfig::new("vfio-sandbox.rebellions.ai", "/r", "/p");
    cfg.check().expect("valid name");
    assert_eq!(
        cfg.registration_socket(),
        std::path::Path::new("/r/vfio-sandbox.rebellions.ai-reg.sock")
    );
    assert_eq!(
        cfg.service_socket(),
        std::path::Path::new("/p/vfio-sandbox.rebellions.ai/dra.sock")
    );
}
