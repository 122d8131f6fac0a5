//! A quiet watch lives its server timeout: the real `sandbox-dra-driver` against
//! the stand-in API server sending no bookmark at all (the real one sends one
//! about once a minute, so this is the harder case). Its ResourceClaim and
//! ResourceSlice watches, opened with kube-rs's `timeoutSeconds=290`, stay open
//! through 285 silent seconds, are ended by the server at 290 s and opened again
//! at once (the claim watch from where it stopped, with no new list), and a claim
//! allocated then is marked within 3 s.
//!
//! It takes five minutes, so it is ignored by a plain `cargo test`;
//! `scripts/test.sh` runs it with `--ignored`, beside the real-kernel scenarios.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use fake_apiserver::{paths, FakeApiServer};

/// GET requests on `what` (a collection path followed by `?`), as (lists, watches).
fn requests(server: &FakeApiServer, what: &str) -> (usize, usize) {
    let r = server.requests();
    let on = r
        .iter()
        .filter(|(m, p)| m == "GET" && p.contains(what))
        .collect::<Vec<_>>();
    let watches = on.iter().filter(|(_, p)| p.contains("watch=true")).count();
    (on.len() - watches, watches)
}

#[tokio::test]
#[ignore = "takes five minutes; scripts/test.sh runs it"]
async fn a_quiet_watch_lives_its_server_timeout() {
    let scene = Scene::new();
    let server = cluster();
    server.set_bookmark_period(Duration::from_secs(3600));
    let mut driver = scene
        .start_with(&server, &[("VFIO_SANDBOX_BINDING_CONDITIONS", "always")])
        .await;
    let watches = |s: &FakeApiServer| {
        (
            requests(s, "/resourceclaims?").1,
            requests(s, "/resourceslices?").1,
        )
    };
    driver
        .wait_until("both watches open", || watches(&server) == (1, 1))
        .await;
    let opened = Instant::now();
    let claim_lists = requests(&server, "/resourceclaims?").0;
    let slice_lists = requests(&server, "/resourceslices?").0;
    tokio::time::sleep(Duration::from_secs(285)).await;
    assert_eq!(
        watches(&server),
        (1, 1),
        "a watch died before its server timeout\n{}",
        driver.log()
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while watches(&server) != (2, 2) {
        assert!(
            Instant::now() < deadline,
            "not watching again after the server's timeout: {:?}\n{}",
            watches(&server),
            driver.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let lived = opened.elapsed();
    assert_eq!(
        requests(&server, "/resourceclaims?").0,
        claim_lists,
        "the claim watch was opened again by a new list"
    );
    // The publisher lists its slices at every pass too: counted, not asserted.
    let slice_lists = requests(&server, "/resourceslices?").0 - slice_lists;
    // A claim allocated now is seen at once.
    let mut claim = fake_apiserver::objects::resource_claim(NS, "vm-late", "uid-vm-late", None);
    claim["status"] = serde_json::json!({
        "allocation": fake_apiserver::objects::allocation(&[ours("nic", "pci-0000-02-00-0")], NODE, Some(WAITS)),
    });
    let started = Instant::now();
    server.put(&paths::resourceclaim(NS, "vm-late"), claim);
    while server
        .get(&paths::resourceclaim(NS, "vm-late"))
        .is_none_or(|c| !fake_apiserver::objects::condition_true_on_all(&c, READY))
    {
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "not marked within 3 s\n{}",
            driver.log()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!(
        "the quiet watches lived {lived:.1?} (the server ends them at 290 s), the \
            claim watch was opened again without a list ({slice_lists} slice list(s) \
            meanwhile), and a claim allocated then was marked in {:?}",
        started.elapsed()
    );
}
