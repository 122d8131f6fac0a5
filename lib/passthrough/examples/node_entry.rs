//! How long `vfio-manager run` takes to put a node in VM mode and to take it out
//! again, on a fake node whose native driver is slow: every unbind and every probe of
//! a device takes `--latency-ms` (a GPU driver's remove or probe can take a second).
//!
//! The node: `--devices` NICs (8086:10d3, e1000e-like), each alone in its IOMMU
//! group, with vfio-pci a module to load. Each run times the library calls
//! `vfio-manager run` makes to enter VM mode (see bins/vfio-manager/src/commands/
//! run.rs: `run` and `Pass::converge`): lock and load the state file, scan, prepare
//! (load the vfio modules), scan again, load the target drivers, bind — once binding
//! one group at a time and once with `--jobs` groups at once (default: vfio-manager's
//! `--bind-jobs` default), each on a fresh node; then the restore a stop makes
//! (`restore_all`: every recorded group back, with the same jobs). Prints one line:
//!
//! ```text
//! devices=8 latency_ms=1000 jobs=1 entry_ms=16021 leave_ms=16012 jobs=8 entry_ms=2010 leave_ms=2008
//! ```
//!
//! It checks that every device ended on vfio-pci after entry and back on e1000e after
//! leaving (exit 1 otherwise) and asserts nothing about time. `scripts/bench-node-entry.sh` runs it and takes medians.

use std::num::NonZeroUsize;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use passthrough::config::ResourceList;
use passthrough::inventory::Inventory;
use passthrough::state::StateFile;
use passthrough::{Passthrough, DEFAULT_BIND_JOBS};
use support::error_chain;
use sysfs_pci::testing::FakeKernel;
use sysfs_pci::PciAddress;

const LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;
const RELEASE: &str = "6.1.0-bench";
const USAGE: &str = "usage: node_entry [--devices N] [--latency-ms MS] [--jobs N]";

/// Enters VM mode as `vfio-manager run` does, checks every device is on `want`, then
/// leaves it as a stop does; the time each took.
fn enter_and_leave(
    kernel: &FakeKernel,
    state_path: &std::path::Path,
    list: &ResourceList,
    jobs: NonZeroUsize,
    devices: u8,
) -> Result<(Duration, Duration), String> {
    let host = &kernel.node.host;
    let started = Instant::now();
    let mut state: StateFile = StateFile::load(
        state_path,
        true,
        &const { passthrough::owner::Program::named("vfio-manager") },
    )
    .map_err(|e| error_chain(&e))?;
    let mut pt = Passthrough {
        host,
        kernel,
        state: &mut state,
        release: RELEASE.into(),
    };
    let inv = Inventory::scan(host, list).map_err(|e| error_chain(&e))?;
    pt.enter_vm_mode(&inv, &[]).map_err(|e| error_chain(&e))?;
    // Pass::converge: rescan, load the target drivers, bind.
    let inv = Inventory::scan(host, list).map_err(|e| error_chain(&e))?;
    let report = pt
        .move_to_vfio(&inv, &[], jobs)
        .map_err(|e| error_chain(&e))?;
    let entry = started.elapsed();
    if let Some(e) = report.failed.first() {
        return Err(error_chain(e));
    }
    all_on(kernel, devices, "vfio-pci")?;
    // run's stop when the node leaves VM mode (restore_all).
    let started = Instant::now();
    let report = pt.restore_concurrent(&[], jobs);
    let leave = started.elapsed();
    if let Some(e) = report.failed.first() {
        return Err(error_chain(e));
    }
    all_on(kernel, devices, "e1000e")?;
    Ok((entry, leave))
}

/// Every device of the bench node is on `driver`.
fn all_on(kernel: &FakeKernel, devices: u8, want: &str) -> Result<(), String> {
    for i in 1..=devices {
        let address: PciAddress = format!("0000:{i:02x}:00.0")
            .parse()
            .map_err(|e| format!("{e}"))?;
        let driver = kernel.node.driver_of(&address);
        if driver.as_deref() != Some(want) {
            return Err(format!("{address} ended on {driver:?}, not {want}"));
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let list = match ResourceList::parse(LIST) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("node_entry: {}", error_chain(&e));
            return ExitCode::FAILURE;
        }
    };
    FakeKernel::bench_main(
        "node_entry",
        USAGE,
        DEFAULT_BIND_JOBS,
        &["entry", "leave"],
        |root, args, jobs| {
            let kernel = FakeKernel::slow_nics(root, args.devices, args.latency, RELEASE);
            let state = root.join("run/state.json");
            enter_and_leave(&kernel, &state, &list, jobs, args.devices).map(|(a, b)| vec![a, b])
        },
    )
}
