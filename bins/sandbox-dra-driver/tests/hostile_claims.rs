//! The real `sandbox-dra-driver` binary given hostile claims over real protocols:
//! each gets an error naming what is wrong, and the driver keeps serving.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::time::Instant;

use common::driver::*;
use common::*;
use kubelet_peer::dra::Version;

/// A uid for test claim number `n`.
fn uid(n: usize) -> String {
    format!("00000000-0000-4000-8000-{n:012}")
}

#[tokio::test]
async fn hostile_claims_get_an_error_each_and_the_driver_keeps_serving() {
    let scene = Scene::new();
    let server = cluster();
    let driver = scene.start(&server).await;
    let mut v1 = scene.client(Version::V1).await;

    // Two good claims first: one holds group 5, one will see its allocation change.
    let holder = put_claim(
        &server,
        "holder",
        &uid(1),
        Some(&[ours("vm", "pci-0000-01-00-0")]),
        None,
    );
    let changing = put_claim(
        &server,
        "changing",
        &uid(2),
        Some(&[ours("vm", "pci-0000-02-00-0")]),
        None,
    );
    let first = prepare(&mut v1, &[holder.clone(), changing.clone()]).await;
    assert!(first.values().all(|a| a.error.is_empty()), "{first:?}");
    put_claim(
        &server,
        "changing",
        &uid(2),
        Some(&[ours("vm", "pci-0000-03-00-0")]),
        None,
    );

    put_claim(
        &server,
        "wrong-uid",
        &uid(10),
        Some(&[ours("vm", "pci-0000-03-00-0")]),
        None,
    );
    let wrong_uid = claim_ref("wrong-uid", &uid(11));
    let missing = claim_ref("missing", &uid(12));
    let unallocated = put_claim(&server, "unallocated", &uid(13), None, None);
    let other_pool = put_claim(
        &server,
        "other-pool",
        &uid(14),
        Some(&[fake_apiserver::objects::DeviceResult::new(
            "vm",
            DRIVER,
            "node-b",
            "pci-0000-02-00-0",
        )]),
        None,
    );
    let other_driver = put_claim(
        &server,
        "other-driver",
        &uid(15),
        Some(&[fake_apiserver::objects::DeviceResult::new(
            "vm",
            "gpu.example.com",
            NODE,
            "gpu-0",
        )]),
        None,
    );
    let not_ours = put_claim(
        &server,
        "not-ours",
        &uid(16),
        Some(&[ours("vm", "gpu-0")]),
        None,
    );
    let not_selected = put_claim(
        &server,
        "not-selected",
        &uid(17),
        Some(&[ours("vm", "pci-0000-04-00-0")]),
        None,
    );
    let companion = put_claim(
        &server,
        "companion",
        &uid(18),
        Some(&[ours("vm", "pci-0000-01-00-2")]),
        None,
    );
    let absent = put_claim(
        &server,
        "absent",
        &uid(19),
        Some(&[ours("vm", "pci-0000-09-00-0")]),
        None,
    );
    let same_group = put_claim(
        &server,
        "same-group",
        &uid(20),
        Some(&[ours("vm", "pci-0000-01-00-1")]),
        None,
    );
    let empty_uid = claim_ref("empty-uid", "");
    // Names that end up in paths, refused before anything is written.
    let path_uid = put_claim(
        &server,
        "path-uid",
        "../../../x",
        Some(&[ours("vm", "pci-0000-03-00-0")]),
        None,
    );
    let bad_request = put_claim(
        &server,
        "bad-request",
        &uid(21),
        Some(&[ours("../x", "pci-0000-03-00-0")]),
        None,
    );

    let asked = [
        wrong_uid,
        missing,
        unallocated,
        other_pool,
        other_driver,
        not_ours,
        not_selected,
        companion,
        absent,
        same_group.clone(),
        changing.clone(),
        empty_uid,
        path_uid,
        bad_request,
    ];
    let answers = prepare(&mut v1, &asked).await;
    assert_eq!(answers.len(), asked.len(), "{answers:?}");
    assert_contains(
        &error_of(&answers, &uid(11)),
        &[
            "ResourceClaim vms/wrong-uid has uid",
            &uid(10),
            &format!("kubelet asked for {}", uid(11)),
        ],
    );
    assert_contains(
        &error_of(&answers, &uid(12)),
        &["ResourceClaim vms/missing is not found"],
    );
    assert_contains(
        &error_of(&answers, &uid(13)),
        &["ResourceClaim vms/unallocated is not allocated"],
    );
    assert_contains(
        &error_of(&answers, &uid(14)),
        &[
            "vms/other-pool",
            "other pools than node-a",
            "node-b/pci-0000-02-00-0",
        ],
    );
    assert_contains(
        &error_of(&answers, &uid(15)),
        &["vms/other-driver has no device of driver vfio-sandbox.rebellions.ai in pool node-a"],
    );
    assert_contains(
        &error_of(&answers, &uid(16)),
        &[
            "vms/not-ours",
            "\"gpu-0\" is not a device this driver publishes",
        ],
    );
    for (n, name, device) in [
        (17, "not-selected", "pci-0000-04-00-0 (0000:04:00.0)"),
        (18, "companion", "pci-0000-01-00-2 (0000:01:00.2)"),
        (19, "absent", "pci-0000-09-00-0 (0000:09:00.0)"),
    ] {
        assert_contains(
            &error_of(&answers, &uid(n)),
            &[
                &format!("vms/{name}"),
                device,
                "the resource list does not select it on this node",
            ],
        );
    }
    assert_contains(
        &error_of(&answers, &uid(20)),
        &[
            "vms/same-group",
            "pci-0000-01-00-1 (0000:01:00.1) is in IOMMU group 5",
            &format!("prepared for claim vms/holder (uid {})", uid(1)),
        ],
    );
    assert_contains(
        &error_of(&answers, &uid(2)),
        &[
            "vms/changing",
            "prepared with pci-0000-02-00-0 (0000:02:00.0)",
            "now names pci-0000-03-00-0 (0000:03:00.0)",
            "unprepare it first",
        ],
    );
    assert_contains(&error_of(&answers, ""), &["vms/empty-uid has no uid"]);
    assert_contains(
        &error_of(&answers, "../../../x"),
        &["vms/path-uid", "invalid claim UID \"../../../x\""],
    );
    assert_contains(
        &error_of(&answers, &uid(21)),
        &["vms/bad-request", "invalid request name \"../x\""],
    );

    // Nothing refused was recorded or written; the two good claims are intact.
    let claims = state_claims(&scene);
    assert_eq!(claims.keys().collect::<Vec<_>>(), [&uid(1), &uid(2)]);
    assert_eq!(claims[&uid(2)]["devices"][0]["device"], "pci-0000-02-00-0");
    let mut specs: Vec<String> = std::fs::read_dir(scene.cdi_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    specs.sort();
    assert_eq!(
        specs,
        [
            format!("{DRIVER}-vfio_{}.json", uid(1)),
            format!("{DRIVER}-vfio_{}.json", uid(2))
        ]
    );
    let mut metadata: Vec<String> = std::fs::read_dir(scene.metadata_dir().join(DRIVER))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    metadata.sort();
    assert_eq!(metadata, [uid(1), uid(2)]);
    assert!(!scene.root().join("x").exists() && !scene.metadata_dir().join("x").exists());

    // A thousand claims in one call over v1beta1: every fourth missing, the others
    // unallocated, for a device not selected here, or under another uid.
    let mut bulk = Vec::new();
    for n in 1000..2000 {
        let name = format!("bulk-{n}");
        let c = match n % 4 {
            0 => claim_ref(&name, &uid(n)),
            1 => put_claim(&server, &name, &uid(n), None, None),
            2 => put_claim(
                &server,
                &name,
                &uid(n),
                Some(&[ours("vm", "pci-0000-04-00-0")]),
                None,
            ),
            _ => {
                put_claim(
                    &server,
                    &name,
                    &uid(n + 5000),
                    Some(&[ours("vm", "pci-0000-03-00-0")]),
                    None,
                );
                claim_ref(&name, &uid(n))
            }
        };
        bulk.push(c);
    }
    let mut v1beta1 = scene.client(Version::V1beta1).await;
    let started = Instant::now();
    let answers = prepare(&mut v1beta1, &bulk).await;
    println!(
        "1000 hostile claims in one NodePrepareResources: {:?}",
        started.elapsed()
    );
    assert_eq!(answers.len(), 1000);
    for c in &bulk {
        let e = error_of(&answers, &c.uid);
        assert!(e.contains(&format!("vms/{}", c.name)), "{e}");
    }
    assert_eq!(state_claims(&scene).len(), 2, "the bulk recorded nothing");

    // Still serving: the holder lets go of group 5, and the claim refused for it
    // now gets it; the changed claim is unprepared and prepared anew.
    assert_eq!(
        unprepare(&mut v1, &[holder, changing.clone()]).await,
        BTreeMap::from([(uid(1), String::new()), (uid(2), String::new())])
    );
    let again = prepare(&mut v1, &[same_group, changing]).await;
    assert_eq!(
        again,
        BTreeMap::from([
            (
                uid(2),
                ok(vec![device("vm", "pci-0000-03-00-0", &uid(2), "vm")])
            ),
            (
                uid(20),
                ok(vec![device("vm", "pci-0000-01-00-1", &uid(20), "vm")])
            ),
        ])
    );
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

// ---------------------------------------------------------------- 5. restart
