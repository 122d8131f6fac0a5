//! The DRA DeviceClasses the chart installs (`charts/vfio-sandbox/files/deviceclasses`)
//! cover every name the `rebellions` preset gives a device it knows, in both namings,
//! each class named after its resource and selecting exactly that `resourceName`;
//! Rebellions' own class names are opt-in (`draDriver.rebellionsClasses`).

#![allow(clippy::unwrap_used)]

use std::path::Path;

use passthrough::config::rebellions_names;

const DRIVER: &str = "vfio-sandbox.rebellions.ai";

fn chart() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/vfio-sandbox")
}

/// The chart's template that installs the class files, and the lines of it that
/// decide whether `file` is installed.
fn installs(file: &str) -> String {
    let template =
        std::fs::read_to_string(chart().join("templates/dra-deviceclasses.yaml")).unwrap();
    let mut gate = String::new();
    for line in template.lines() {
        if line.contains("{{- if ") {
            gate = line.to_owned();
        }
        if line.contains(&format!("files/deviceclasses/{file}")) {
            return format!("{gate}\n{line}");
        }
    }
    panic!("{file} is not installed by templates/dra-deviceclasses.yaml")
}

fn manifests() -> String {
    let dir = chart().join("files/deviceclasses");
    let mut text = String::new();
    for file in ["rebellions.yaml", "rebellions-pci-ids.yaml"] {
        let gate = installs(file);
        assert!(
            gate.contains(".Values.draDriver.deviceClasses"),
            "{file} is installed under {gate}"
        );
        text.push_str(&std::fs::read_to_string(dir.join(file)).unwrap());
        text.push_str("\n---\n");
    }
    text
}

/// The DeviceClass documents, as (metadata name, the resourceName its CEL selects).
fn classes(text: &str) -> Vec<(String, Option<String>)> {
    documents(text)
        .into_iter()
        .map(|(name, selects, _)| (name, selects))
        .collect()
}

/// The DeviceClass documents, as (metadata name, the resourceName its CEL selects,
/// its `extendedResourceName`).
fn documents(text: &str) -> Vec<(String, Option<String>, Option<String>)> {
    text.split("\n---\n")
        .filter(|doc| doc.contains("kind: DeviceClass"))
        .map(|doc| {
            let name = doc
                .lines()
                .find_map(|l| l.strip_prefix("  name: "))
                .unwrap()
                .to_owned();
            let selects = doc
                .split(".resourceName ==")
                .nth(1)
                .map(|rest| rest.trim().trim_matches('"').to_owned());
            let extended = doc
                .lines()
                .find_map(|l| l.strip_prefix("  extendedResourceName: "))
                .map(str::to_owned);
            (name, selects, extended)
        })
        .collect()
}

/// KEP-5004: each class serves the extended resource of the name it selects (what
/// the device plugin advertises), and no two classes claim one name (the API
/// server then picks the newest, silently).
#[test]
fn each_named_class_serves_its_name_as_an_extended_resource() {
    let mut seen = std::collections::BTreeSet::new();
    for (class, selects, extended) in documents(&manifests()) {
        assert_eq!(extended, selects, "{class}");
        if let Some(name) = extended {
            assert!(seen.insert(name.clone()), "{name} twice");
        }
    }
    assert!(seen.len() >= 16, "{seen:?}");
}

#[test]
fn every_preset_name_of_both_namings_has_its_class() {
    let found = classes(&manifests());
    for naming in ["seed", "pci-ids"] {
        let names = rebellions_names(naming).unwrap();
        assert!(names.len() >= 8, "{naming}: {names:?}");
        for resource in names {
            let local = resource.as_str().split_once('/').unwrap().1;
            let class = format!("{}.{DRIVER}", local.to_lowercase().replace('_', "-"));
            let selects = found
                .iter()
                .find(|(name, _)| *name == class)
                .unwrap_or_else(|| panic!("no DeviceClass {class} for {resource} ({naming})"));
            assert_eq!(selects.1.as_deref(), Some(resource.as_str()), "{class}");
        }
    }
    assert_eq!(rebellions_names("other"), None);
}

#[test]
fn no_class_selects_a_name_no_naming_gives() {
    let mut known: Vec<String> = ["seed", "pci-ids"]
        .iter()
        .flat_map(|n| rebellions_names(n).unwrap())
        .map(|n| n.to_string())
        .collect();
    known.sort();
    for (class, selects) in classes(&manifests()) {
        match selects {
            Some(resource) => assert!(known.contains(&resource), "{class} selects {resource}"),
            None => assert_eq!(class, DRIVER, "only the catch-all class selects no name"),
        }
    }
}

/// Rebellions' DRA driver (`npu.rebellions.ai`) and the domain of its attributes.
const REBELLIONS: &str = "npu.rebellions.ai";

fn vocabulary() -> String {
    std::fs::read_to_string(chart().join("files/deviceclasses/rebellions-dra-vocabulary.yaml"))
        .unwrap()
}

/// The CEL expressions of a DeviceClass document, folded onto one line.
fn expressions(doc: &str) -> Vec<String> {
    doc.split("expression: >-")
        .skip(1)
        .map(|rest| {
            rest.lines()
                .skip(1)
                .take_while(|l| l.starts_with("          "))
                .map(str::trim)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// Rebellions' class names for our devices: opt-in (the names are
/// Rebellions' own, so the default set may not take them), each class pinned to
/// our driver and testing an attribute of Rebellions' domain before reading it
/// (a missing one is a CEL error that aborts the claim's allocation), as
/// Rebellions' chart has them: `vfio-npu.rebellions.ai` selects `type == "vfio"`,
/// `npu.rebellions.ai` serves `rebellions.ai/npu`.
#[test]
fn rebellions_class_names_are_opt_in_for_our_devices_only() {
    let gate = installs("rebellions-dra-vocabulary.yaml");
    assert!(
        gate.contains(".Values.draDriver.rebellionsClasses")
            && !gate.contains(".Values.draDriver.deviceClasses"),
        "{gate}"
    );
    let text = vocabulary();
    let docs: Vec<&str> = text
        .split("\n---\n")
        .filter(|d| d.contains("kind: DeviceClass"))
        .collect();
    let found = documents(&text);
    let names: Vec<&str> = found.iter().map(|(n, ..)| n.as_str()).collect();
    assert_eq!(names, ["vfio-npu.rebellions.ai", REBELLIONS]);
    let extended: Vec<Option<&str>> = found.iter().map(|(_, _, e)| e.as_deref()).collect();
    assert_eq!(extended, [None, Some("rebellions.ai/npu")]);
    let read = format!("device.attributes[\"{REBELLIONS}\"].");
    for (doc, name) in docs.iter().zip(&names) {
        let exprs = expressions(doc);
        assert_eq!(exprs.len(), 1, "{name}: {exprs:?}");
        let e = &exprs[0];
        assert!(
            e.starts_with(&format!("device.driver == \"{DRIVER}\" && ")),
            "{name} does not pin our driver first: {e}"
        );
        let guard = format!("\"type\" in device.attributes[\"{REBELLIONS}\"]");
        let guarded = e.find(&guard).unwrap_or_else(|| panic!("{name}: {e}"));
        assert!(
            e.find(&read).is_none_or(|at| at > guarded),
            "{name} reads an attribute of {REBELLIONS} before testing it is there: {e}"
        );
    }
    assert!(expressions(docs[0])[0].ends_with(&format!("{read}type == \"vfio\"")));
    // Not in the default set, which installs beside Rebellions' driver.
    for (class, _, extended) in documents(&manifests()) {
        assert!(
            class.ends_with(&format!(".{DRIVER}")) || class == DRIVER,
            "{class}"
        );
        assert_ne!(extended.as_deref(), Some("rebellions.ai/npu"), "{class}");
    }
}
