//! Reading a resource list: the file, its JSON entries (`resources`, `presets`),
//! each key checked with a message naming the entry, and the checks across entries
//! (duplicate names, overlapping selectors).

use std::collections::HashMap;
use std::path::Path;

use sysfs_pci::address::PciAddress;

use super::json::Json;
use super::preset::Naming;
use super::selector::{ClassPrefix, Selector};
use super::*;

/// Reads a resource list file, refusing anything but a regular file of at most
/// [`MAX_FILE_BYTES`] before reading a byte of it.
pub(super) fn read_file(path: &Path) -> Result<String, ConfigError> {
    use support::io::{read_small_file, SmallFileError};
    read_small_file(path, MAX_FILE_BYTES).map_err(|e| match e {
        SmallFileError::Io(source) => ConfigError::ReadFile {
            path: path.to_owned(),
            source,
        },
        SmallFileError::NotAFile(kind) => ConfigError::NotAFile {
            path: path.to_owned(),
            kind,
        },
        SmallFileError::TooLarge(limit) => ConfigError::TooLarge {
            path: path.to_owned(),
            limit,
        },
    })
}

/// A JSON syntax error with its position, without the position repeated in the text.
pub(super) fn json_error(err: &serde_json::Error) -> ConfigError {
    let (line, column) = (err.line(), err.column());
    let text = err.to_string();
    let suffix = format!(" at line {line} column {column}");
    let message = text.strip_suffix(&suffix).unwrap_or(&text).to_owned();
    ConfigError::Json {
        file: None,
        line,
        column,
        message,
    }
}

/// One selector with its naming rule and driver.
#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub(super) source: EntrySource,
    pub(super) selector: Selector,
    pub(super) naming: Naming,
    pub(super) driver: DriverRule,
}

impl Entry {
    /// True for the entry of the `rebellions` preset.
    pub(super) fn is_rebellions(&self) -> bool {
        matches!(self.naming, Naming::Rebellions | Naming::RebellionsPciIds)
    }

    pub(super) fn describe(&self) -> String {
        let selector = &self.selector;
        match (&self.source, &self.naming) {
            (EntrySource::Resource { name, .. }, _) => {
                format!("{name}: {selector}, driver {}", self.driver)
            }
            (EntrySource::Preset(preset), naming) => {
                format!(
                    "preset {preset}: {selector}, driver {} -> {}",
                    self.driver,
                    naming.describe()
                )
            }
        }
    }
}

/// Where an entry came from, as named in error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum EntrySource {
    /// A built-in preset.
    Preset(&'static str),
    /// `resources[index]`, with its name when it has one.
    Resource { index: usize, name: String },
}

impl fmt::Display for EntrySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Preset(name) => write!(f, "preset {name:?}"),
            Self::Resource { index, name } => write!(f, "resources[{index}] ({name})"),
        }
    }
}

/// The top-level `naming` value: `"seed"` (false) or `"pci-ids"` (true).
pub(super) fn parse_naming(value: &Json) -> Result<bool, ConfigError> {
    match value {
        Json::String(naming) if naming == "seed" => Ok(false),
        Json::String(naming) if naming == "pci-ids" => Ok(true),
        Json::String(other) => Err(ConfigError::document(format!(
            "naming: unknown naming {other:?} (expected {})",
            quoted(preset::NAMINGS)
        ))),
        other => Err(ConfigError::document(format!(
            "naming: expected {}, found {}",
            quoted(preset::NAMINGS),
            other.kind()
        ))),
    }
}

fn quoted(values: &[&str]) -> String {
    let quoted: Vec<String> = values.iter().map(|v| format!("{v:?}")).collect();
    quoted.join(" or ")
}

/// The `preset` value: a name or a list of names; `pci_ids` is the `naming`.
pub(super) fn parse_presets(value: &Json, pci_ids: bool) -> Result<Vec<Entry>, ConfigError> {
    let names: Vec<&str> = match value {
        Json::String(name) => vec![name.as_str()],
        Json::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Json::String(name) => Ok(name.as_str()),
                other => Err(ConfigError::document(format!(
                    "preset[{i}]: expected a preset name, found {}",
                    other.kind()
                ))),
            })
            .collect::<Result<_, _>>()?,
        other => {
            return Err(ConfigError::document(format!(
                "preset: expected a preset name or a list of names, found {}",
                other.kind()
            )))
        }
    };
    let mut entries = Vec::new();
    for (i, name) in names.iter().enumerate() {
        if names[..i].contains(name) {
            return Err(ConfigError::document(format!(
                "preset[{i}]: {name:?} is listed twice"
            )));
        }
        entries.extend(preset::entries(name, pci_ids).ok_or_else(|| {
            ConfigError::UnknownPreset {
                file: None,
                name: (*name).to_owned(),
            }
        })?);
    }
    Ok(entries)
}

/// The `resources` value: a list of entries.
pub(super) fn parse_resources(value: &Json) -> Result<Vec<Entry>, ConfigError> {
    let Json::Array(items) = value else {
        return Err(ConfigError::document(format!(
            "resources: expected a list of entries, found {}",
            value.kind()
        )));
    };
    items
        .iter()
        .enumerate()
        .map(|(index, item)| parse_entry(index, item))
        .collect()
}

const ENTRY_KEYS: [&str; 6] = [
    "name",
    "vendor",
    "devices",
    "classes",
    "addresses",
    "driver",
];

fn parse_entry(index: usize, item: &Json) -> Result<Entry, ConfigError> {
    let Json::Object(fields) = item else {
        return Err(ConfigError::Entry {
            file: None,
            entry: format!("resources[{index}]"),
            problem: format!("expected an object, found {}", item.kind()),
        });
    };
    let raw_name = fields.iter().find_map(|(key, value)| match value {
        Json::String(name) if key == "name" => Some(name.clone()),
        _ => None,
    });
    let entry = match &raw_name {
        Some(name) => format!("resources[{index}] ({name})"),
        None => format!("resources[{index}]"),
    };
    let fail = |problem: String| ConfigError::Entry {
        file: None,
        entry: entry.clone(),
        problem,
    };

    json::check_unique_keys(fields).map_err(fail)?;
    let mut values: HashMap<&str, &Json> = HashMap::new();
    for (key, value) in fields {
        if !ENTRY_KEYS.contains(&key.as_str()) {
            return Err(fail(format!(
                "unknown key {key:?} (expected {})",
                ENTRY_KEYS.join(", ")
            )));
        }
        values.insert(key.as_str(), value);
    }

    let name = match values.get("name") {
        None => return Err(fail("missing \"name\"".to_owned())),
        Some(Json::String(name)) => {
            ResourceName::from_str(name).map_err(|err| fail(format!("name: {}", err.problem)))?
        }
        Some(other) => {
            return Err(fail(format!(
                "name: expected a string, found {}",
                other.kind()
            )))
        }
    };
    let vendor = match values.get("vendor") {
        None => return Err(fail("missing \"vendor\"".to_owned())),
        Some(value) => parse_pci_id(value).map_err(|p| fail(format!("vendor: {p}")))?,
    };
    let devices = match values.get("devices") {
        None => None,
        Some(value) => Some(parse_devices(value).map_err(fail)?),
    };
    let classes = match values.get("classes") {
        None => None,
        Some(value) => Some(parse_classes(value).map_err(fail)?),
    };
    let addresses = match values.get("addresses") {
        None => None,
        Some(value) => Some(parse_addresses(value).map_err(fail)?),
    };
    let driver = match values.get("driver") {
        None => DriverRule::Named(DEFAULT_DRIVER.to_owned()),
        Some(Json::String(driver)) if driver == AUTO_DRIVER => DriverRule::Auto,
        Some(Json::String(driver)) => {
            check_vfio_driver(driver).map_err(|p| {
                fail(format!(
                    "driver: {p}; or {AUTO_DRIVER:?} to let the kernel's vfio_pci aliases choose"
                ))
            })?;
            DriverRule::Named(driver.clone())
        }
        Some(other) => {
            return Err(fail(format!(
                "driver: expected a string, found {}",
                other.kind()
            )))
        }
    };
    Ok(Entry {
        source: EntrySource::Resource {
            index,
            name: name.to_string(),
        },
        selector: Selector {
            vendor,
            devices,
            classes,
            addresses,
        },
        naming: Naming::Fixed(name),
        driver,
    })
}

/// A vendor or device id: up to 4 hex digits, `0x` optional, any case.
fn parse_pci_id(value: &Json) -> Result<u16, String> {
    let Json::String(text) = value else {
        return Err(format!(
            "expected a hex id string such as \"1eff\", found {}",
            value.kind()
        ));
    };
    let digits = strip_hex_prefix(text);
    if (1..=4).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        if let Ok(id) = u16::from_str_radix(digits, 16) {
            return Ok(id);
        }
    }
    Err(format!("{text:?} is not a hex PCI id"))
}

fn strip_hex_prefix(text: &str) -> &str {
    text.strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text)
}

fn parse_devices(value: &Json) -> Result<Vec<u16>, String> {
    let Json::Array(items) = value else {
        return Err(format!(
            "devices: expected a list of hex ids, found {} (leave the key out to match any device)",
            value.kind()
        ));
    };
    if items.is_empty() {
        return Err(
            "devices: the list is empty (leave the key out to match any device)".to_owned(),
        );
    }
    let mut devices: Vec<u16> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let id = parse_pci_id(item).map_err(|p| format!("devices[{i}]: {p}"))?;
        if devices.contains(&id) {
            return Err(format!("devices[{i}]: {id:04x} is listed twice"));
        }
        devices.push(id);
    }
    Ok(devices)
}

fn parse_classes(value: &Json) -> Result<Vec<ClassPrefix>, String> {
    let Json::Array(items) = value else {
        return Err(format!(
            "classes: expected a list of hex class prefixes, found {} (leave the key \
                out to match any class)",
            value.kind()
        ));
    };
    if items.is_empty() {
        return Err("classes: the list is empty (leave the key out to match any class)".to_owned());
    }
    let mut classes: Vec<ClassPrefix> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let prefix = parse_class_prefix(item).map_err(|p| format!("classes[{i}]: {p}"))?;
        if let Some(earlier) = classes.iter().find(|c| c.meet(prefix).is_some()) {
            return Err(format!(
                "classes[{i}]: {prefix} overlaps {earlier} listed before it"
            ));
        }
        classes.push(prefix);
    }
    Ok(classes)
}

/// PCI addresses, `0000:3b:00.0` or short `3b:00.0` (domain 0000), each at most once.
fn parse_addresses(value: &Json) -> Result<Vec<PciAddress>, String> {
    let Json::Array(items) = value else {
        return Err(format!(
            "addresses: expected a list of PCI addresses, found {} (leave the key out \
                to match any address)",
            value.kind()
        ));
    };
    if items.is_empty() {
        return Err(
            "addresses: the list is empty (leave the key out to match any address)".to_owned(),
        );
    }
    let mut addresses: Vec<PciAddress> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let Json::String(text) = item else {
            return Err(format!(
                "addresses[{i}]: expected a PCI address such as \"0000:3b:00.0\", found {}",
                item.kind()
            ));
        };
        let address = PciAddress::from_str(text).map_err(|e| format!("addresses[{i}]: {e}"))?;
        if addresses.contains(&address) {
            return Err(format!("addresses[{i}]: {address} is listed twice"));
        }
        addresses.push(address);
    }
    Ok(addresses)
}

fn parse_class_prefix(value: &Json) -> Result<ClassPrefix, String> {
    let Json::String(text) = value else {
        return Err(format!(
            "expected a hex class prefix such as \"0300\", found {}",
            value.kind()
        ));
    };
    let digits = strip_hex_prefix(text);
    if !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("{text:?} is not a hex class prefix"));
    }
    match digits.len() {
        2 | 4 | 6 => u32::from_str_radix(digits, 16)
            .map(|value| ClassPrefix {
                value,
                digits: digits.len() as u32,
            })
            .map_err(|_| format!("{text:?} is not a hex class prefix")),
        _ => Err(format!(
            "{text:?} is not a class prefix of 2, 4 or 6 hex digits"
        )),
    }
}

/// Names must be unique among explicit entries, and an explicit entry must not take a
/// name a preset gives. Nor may two names map to one KubeVirt variable
/// (`PCI_RESOURCE_<NAME>`: upper-cased, `/` and `.` turned into `_`), which
/// Allocate and a claim's CDI spec would then both set.
pub(super) fn check_names(presets: &[Entry], explicit: &[Entry]) -> Result<(), ConfigError> {
    for (i, entry) in explicit.iter().enumerate() {
        let Naming::Fixed(name) = &entry.naming else {
            continue;
        };
        let clash = explicit[..i]
            .iter()
            .find(|earlier| matches!(&earlier.naming, Naming::Fixed(n) if n == name))
            .or_else(|| presets.iter().find(|p| p.naming.can_give(name)));
        if let Some(other) = clash {
            return Err(ConfigError::DuplicateName {
                file: None,
                entry: entry.source.to_string(),
                other: other.source.to_string(),
            });
        }
        let variable = name.kubevirt_env_var();
        let clash = explicit[..i]
            .iter()
            .chain(presets)
            .find(|other| other.naming.can_give_variable(&variable));
        if let Some(other) = clash {
            return Err(ConfigError::VariableClash {
                file: None,
                entry: entry.source.to_string(),
                other: other.source.to_string(),
                variable,
            });
        }
    }
    Ok(())
}

pub(super) fn check_overlaps(entries: &[Entry]) -> Result<(), ConfigError> {
    for (i, entry) in entries.iter().enumerate() {
        for earlier in &entries[..i] {
            if let Some(example) = earlier.selector.overlap(&entry.selector) {
                return Err(ConfigError::Overlap {
                    file: None,
                    entry: entry.source.to_string(),
                    other: earlier.source.to_string(),
                    example,
                });
            }
        }
    }
    Ok(())
}
