//! A whole IOMMU group as one device (`group-<lowest address>`), through the
//! driver as kubelet drives it: prepare moves every selected function of the
//! group and names them all to the container; no other claim gets a part of the
//! group meanwhile; a name that is not the group's lowest function is refused;
//! once unprepared, the group is free for a claim on one of its functions.

#![allow(clippy::unwrap_used)]

mod common;

use common::driver::*;
use common::*;
use kubelet_peer::dra::Version;
use sysfs_pci::PciAddress;

fn uid(n: usize) -> String {
    format!("7a0c1d2e-0000-4000-8000-{n:012}")
}

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

#[tokio::test]
async fn a_group_device_moves_and_names_every_function_and_holds_the_group() {
    let scene = Scene::new();
    let server = cluster();
    let driver = scene.start(&server).await;
    let mut v1 = scene.client(Version::V1).await;
    let card = ["0000:01:00.0", "0000:01:00.1"];

    let whole = put_claim(
        &server,
        "whole",
        &uid(1),
        Some(&[ours("vm", "group-0000-01-00-0")]),
        None,
    );
    let answers = prepare(&mut v1, std::slice::from_ref(&whole)).await;
    assert!(answers[&whole.uid].error.is_empty(), "{answers:?}");
    for f in card {
        assert_eq!(
            scene.node.driver_of(&addr(f)).as_deref(),
            Some("vfio-pci"),
            "{f}"
        );
    }
    let spec = std::fs::read_to_string(scene.cdi_spec(&whole.uid)).unwrap();
    assert!(
        spec.contains("PCI_RESOURCE_EXAMPLE_COM_NIC_PT=0000:01:00.0,0000:01:00.1"),
        "{spec}"
    );
    assert!(spec.contains("/dev/vfio/5"), "{spec}");
    let metadata = std::fs::read_to_string(scene.metadata_file(&whole.uid, "vm")).unwrap();
    assert!(metadata.contains("group-0000-01-00-0"), "{metadata}");
    assert!(metadata.contains("0000:01:00.0,0000:01:00.1"), "{metadata}");

    // A part of the group for another claim: refused, naming the holder.
    let part = put_claim(
        &server,
        "part",
        &uid(2),
        Some(&[ours("vm", "pci-0000-01-00-1")]),
        None,
    );
    // A group named after a function that is not its lowest: not ours.
    let misnamed = put_claim(
        &server,
        "misnamed",
        &uid(3),
        Some(&[ours("vm", "group-0000-01-00-1")]),
        None,
    );
    let answers = prepare(&mut v1, &[part.clone(), misnamed.clone()]).await;
    let held = &answers[&part.uid].error;
    assert!(
        held.contains("IOMMU group 5") && held.contains("whole"),
        "{held}"
    );
    let wrong = &answers[&misnamed.uid].error;
    assert!(wrong.contains("not the lowest function"), "{wrong}");

    // Unprepared, the group is free: the part is prepared now.
    let errors = unprepare(&mut v1, std::slice::from_ref(&whole)).await;
    assert!(errors[&whole.uid].is_empty(), "{errors:?}");
    let answers = prepare(&mut v1, std::slice::from_ref(&part)).await;
    assert!(answers[&part.uid].error.is_empty(), "{answers:?}");
    let (status, log) = driver.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}
