//! Reading a resource list from a file, and hostile documents.

use std::io::ErrorKind;

use super::*;

#[test]
fn load_without_a_file_is_the_default() {
    let list = ResourceList::load(None).unwrap();
    assert_eq!(list.describe(), ResourceList::builtin_default().describe());
}

#[test]
fn load_reads_a_file() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let path = dir.path().join("resources.json");
    std::fs::write(&path, format!(r#"{{"resources": [{NIC}]}}"#)).unwrap();
    let list = ResourceList::load(Some(&path)).unwrap();
    assert_eq!(
        resource(&list, ids(0x8086, 0x10d3, 0x020000)).as_deref(),
        Some("example.com/NIC_PT")
    );
}

#[test]
fn load_errors_name_the_file() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let missing = dir.path().join("missing.json");
    let error = ResourceList::load(Some(&missing)).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!("failed to read resource list {}", missing.display())
    );
    assert_eq!(error.file(), Some(missing.as_path()));
    let not_found = |e: &std::io::Error| e.kind() == ErrorKind::NotFound;
    assert!(matches!(&error, ConfigError::ReadFile { source, .. } if not_found(source)));

    let path = dir.path().join("resources.json");
    std::fs::write(
        &path,
        "{\n  \"preset\": \"rebellions\",\n  \"oops\": 1\n}\n",
    )
    .unwrap();
    let error = ResourceList::load(Some(&path)).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "resource list {}: unknown key \"oops\" (expected \"preset\", \"naming\" \
                or \"resources\")",
            path.display()
        )
    );
    assert_eq!(error.file(), Some(path.as_path()));

    std::fs::write(
        &path,
        "{\n  \"preset\": \"rebellions\"\n  \"resources\": []\n}\n",
    )
    .unwrap();
    let error = ResourceList::load(Some(&path)).unwrap_err().to_string();
    assert!(
        error.starts_with(&format!(
            "resource list {}: invalid JSON at line 3 column 3: ",
            path.display()
        )),
        "{error}"
    );

    std::fs::write(
        &path,
        r#"{"resources": [{"name": "example.com/X", "vendor": "zz"}]}"#,
    )
    .unwrap();
    let error = ResourceList::load(Some(&path)).unwrap_err().to_string();
    assert_eq!(
        error,
        format!(
            "resource list {}: resources[0] (example.com/X): vendor: \"zz\" is not a hex PCI id",
            path.display()
        )
    );
}

#[test]
fn load_refuses_what_is_not_a_regular_file_without_blocking() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let fifo = dir.path().join("fifo.json");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    for (path, kind) in [
        (fifo.as_path(), "a FIFO"),
        (Path::new("/dev/zero"), "a character device"),
        (dir.path(), "a directory"),
    ] {
        let error = ResourceList::load(Some(path)).unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "resource list {} is {kind}, not a regular file",
                path.display()
            )
        );
        assert_eq!(error.file(), Some(path));
    }
    // A mounted ConfigMap is a link to a regular file: read through it.
    let target = dir.path().join("data.json");
    std::fs::write(&target, format!(r#"{{"resources": [{NIC}]}}"#)).unwrap();
    let link = dir.path().join("config.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    assert!(ResourceList::load(Some(&link)).is_ok());
    std::os::unix::fs::symlink(&fifo, dir.path().join("to-fifo")).unwrap();
    assert!(matches!(
        ResourceList::load(Some(&dir.path().join("to-fifo"))),
        Err(ConfigError::NotAFile { kind: "a FIFO", .. })
    ));
}

#[test]
fn load_caps_the_file_size() {
    let dir = tempfile::tempdir_in(sysfs_pci::testing::scratch_root()).unwrap();
    let path = dir.path().join("big.json");
    // Valid JSON all the way: only the size is wrong.
    let doc = format!(r#"{{"resources": [{NIC}]}}"#);
    let limit = usize::try_from(MAX_FILE_BYTES).unwrap();
    std::fs::write(&path, format!("{doc}{}", " ".repeat(limit - doc.len()))).unwrap();
    assert!(
        ResourceList::load(Some(&path)).is_ok(),
        "exactly the limit is read"
    );
    std::fs::write(&path, format!("{doc}{}", " ".repeat(limit + 1 - doc.len()))).unwrap();
    let error = ResourceList::load(Some(&path)).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "resource list {} is larger than the limit of 1048576 bytes",
            path.display()
        )
    );
    std::fs::write(&path, b"{\"preset\": \"\xff\"}").unwrap();
    assert!(matches!(
        ResourceList::load(Some(&path)),
        Err(ConfigError::ReadFile { source, .. }) if source.kind() == ErrorKind::InvalidData
    ));
}

#[test]
fn parse_errors_carry_no_file() {
    assert_eq!(ResourceList::parse("{}").unwrap_err().file(), None);
}

// ---- addresses ----

mod hostile {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn any_text_is_a_list_or_an_error(text in any::<String>()) {
            let _ = ResourceList::parse(&text);
        }

        #[test]
        fn any_entry_values_are_a_list_or_an_error(
            vendor in any::<String>(),
            device in any::<String>(),
            class in any::<String>(),
            driver in any::<String>(),
            address in any::<String>(),
        ) {
            let doc = serde_json::json!({"resources": [{
                "name": "example.com/X", "vendor": vendor, "devices": [device],
                "classes": [class], "driver": driver, "addresses": [address],
            }]});
            if let Ok(list) = ResourceList::parse(&doc.to_string()) {
                prop_assert!(list.drivers().iter().all(|d| is_vfio_driver(d)));
            }
        }
    }
}
