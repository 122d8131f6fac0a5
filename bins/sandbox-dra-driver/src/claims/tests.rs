use super::*;

#[test]
fn device_names_round_trip_and_reject_other_spellings() {
    let a: PciAddress = "0000:01:00.1".parse().expect("address");
    assert_eq!(device_name(&a), "pci-0000-01-00-1");
    assert_eq!(parse_device_name("pci-0000-01-00-1"), Some(a));
    for bad in [
        "",
        "pci-",
        "pci-01-00-1",
        "gpu-0000-01-00-1",
        "pci-0000-01-00-1-2",
        "pci-0000-0A-00-1",
        "pci-0000-01-00-9",
    ] {
        assert_eq!(parse_device_name(bad), None, "{bad}");
    }
}
