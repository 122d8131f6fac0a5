use super::*;

#[test]
fn kubelet_1_32_prefers_v1beta1_and_falls_back_to_alpha() {
    let k = KubeletVersion::V1_32;
    let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        k.choose("d", "/e", &v(&["v1.DRAPlugin", "v1beta1.DRAPlugin"])),
        Ok(Chosen::Speaks(Version::V1beta1))
    );
    assert_eq!(
        k.choose("d", "/e", &v(&["v1.DRAPlugin"])),
        Ok(Chosen::V1alpha4)
    );
    assert!(k
        .choose("d", "/e", &[])
        .unwrap_err()
        .starts_with("invalid versions of plugin d: empty list"));
    assert_eq!(
        KubeletVersion::V1_34.choose("d", "/e", &v(&["v1beta1.DRAPlugin", "v1.DRAPlugin"])),
        Ok(Chosen::Speaks(Version::V1beta1)),
        "1.34 follows the plugin's order"
    );
    assert_eq!(
        k.dra_authority(Path::new("/p/d/dra.sock")),
        "%2Fp%2Fd%2Fdra.sock"
    );
    assert_eq!(
        KubeletVersion::V1_34.dra_authority(Path::new("/p/d/dra.sock")),
        "localhost"
    );
}

#[test]
fn problems_are_what_kubelet_fails_on() {
    let asked = [
        parse_claim("ns/a/uid-a").unwrap(),
        parse_claim("ns/b/uid-b").unwrap(),
        parse_claim("ns/c/uid-c").unwrap(),
    ];
    let mut claims = BTreeMap::new();
    claims.insert(
        "uid-a".to_string(),
        Unprepared {
            error: String::new(),
        },
    );
    claims.insert(
        "uid-b".to_string(),
        Unprepared {
            error: "busy".into(),
        },
    );
    claims.insert(
        "uid-x".to_string(),
        Unprepared {
            error: String::new(),
        },
    );
    let a = Answer { claims };
    assert_eq!(
        a.problems(&asked),
        [
            "claim uid-b: busy",
            "answer for claim uid \"uid-x\" that was not asked about",
            "claim uid-c left out of the answer"
        ]
    );
    assert_eq!(
        a.to_json(),
        r#"{"claims":{"uid-a":{"error":""},"uid-b":{"error":"busy"},"uid-x":{"error":""}}}"#
    );
}

#[test]
fn claims_are_namespace_name_uid() {
    let c = parse_claim("ns/name/1234-ab").unwrap();
    assert_eq!(
        (c.namespace.as_str(), c.name.as_str(), c.uid.as_str()),
        ("ns", "name", "1234-ab")
    );
    assert!(parse_claim("ns/name").is_err());
    assert_eq!(parse_claim("ns/name/").unwrap().uid, "");
}

#[tokio::test]
async fn a_refusing_socket_is_dialed_again_and_a_missing_one_fails_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("reg.sock");
    assert!(
        registration_client(&socket).await.is_err(),
        "no socket: at once"
    );
    // A socket file nobody listens on: refused, as between bind and listen.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let path = socket.clone();
    let late = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        std::fs::remove_file(&path).unwrap();
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let _ = listener.accept().await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    });
    let started = std::time::Instant::now();
    registration_client(&socket).await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    late.abort();
}
