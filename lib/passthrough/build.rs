//! Writes the NVIDIA device names of the PCI ID database as one string and an index
//! of integer offsets (`$OUT_DIR/nvidia_names.rs`), for the `nvidia` preset's
//! resource names, and its Rebellions devices as a small table
//! (`$OUT_DIR/rebellions_names.rs`) for the `rebellions` preset's `pci-ids` naming.
//!
//! The database crate keeps its names behind pointers: in a position-independent
//! binary each one is a relocation the loader applies at start-up, so linking it
//! costs every process megabytes of memory whether a name is ever looked up or not.
//! Offsets into one string need no relocation; binaries that do not print names
//! then leave the database out.

use std::fmt::Write as _;

/// PCI vendor id of NVIDIA.
const NVIDIA: u16 = 0x10de;
/// PCI vendor id of Rebellions.
const REBELLIONS: u16 = 0x1eff;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let Some(out_dir) = std::env::var_os("OUT_DIR") else {
        panic!("cargo sets OUT_DIR for build scripts");
    };
    let mut devices: Vec<(u16, &str)> = <pci_ids::Vendor as pci_ids::FromId<u16>>::from_id(NVIDIA)
        .map(|v| v.devices().map(|d| (d.id(), d.name())).collect())
        .unwrap_or_default();
    devices.sort_by_key(|(id, _)| *id);
    devices.dedup_by_key(|(id, _)| *id);
    let mut names = String::new();
    let mut index = String::new();
    for (id, name) in devices {
        let start = names.len();
        names.push_str(name);
        let _ = writeln!(index, "    (0x{id:04x}, {start}, {}),", name.len());
    }
    let code = format!(
        "/// Every NVIDIA device name of the database, back to back.\n\
         pub(super) const NVIDIA_NAMES: &str = {names:?};\n\
         /// (device id, start, length) into [`NVIDIA_NAMES`], sorted by id.\n\
         pub(super) const NVIDIA_INDEX: &[(u16, u32, u32)] = &[\n{index}];\n"
    );
    let path = std::path::Path::new(&out_dir).join("nvidia_names.rs");
    if let Err(e) = std::fs::write(&path, code) {
        panic!("cannot write {}: {e}", path.display());
    }
    write_rebellions(&out_dir);
}

/// `$OUT_DIR/rebellions_names.rs`: the database's few Rebellions devices as a table
/// (`pci-ids` naming of the `rebellions` preset).
fn write_rebellions(out_dir: &std::ffi::OsStr) {
    let mut devices: Vec<(u16, &str)> =
        <pci_ids::Vendor as pci_ids::FromId<u16>>::from_id(REBELLIONS)
            .map(|v| v.devices().map(|d| (d.id(), d.name())).collect())
            .unwrap_or_default();
    devices.sort_by_key(|(id, _)| *id);
    devices.dedup_by_key(|(id, _)| *id);
    let mut rows = String::new();
    for (id, name) in devices {
        let _ = writeln!(rows, "    (0x{id:04x}, {name:?}),");
    }
    let code = format!(
        "/// (device id, name) of every Rebellions device the PCI ID database lists, by id.\n\
         pub(super) const REBELLIONS_DB: &[(u16, &str)] = &[\n{rows}];\n"
    );
    let path = std::path::Path::new(out_dir).join("rebellions_names.rs");
    if let Err(e) = std::fs::write(&path, code) {
        panic!("cannot write {}: {e}", path.display());
    }
}
