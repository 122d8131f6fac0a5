//! How long sandbox-dra-driver takes to prepare one claim of `--devices` devices, and
//! to unprepare it, on the node-entry benchmark's fake node: NICs (8086:10d3) on
//! e1000e, each alone in its IOMMU group, every unbind and every probe taking
//! `--latency-ms` (a GPU driver's remove or probe can take a second; NVIDIA's DRA
//! driver also polls once a second per GPU for open handles).
//!
//! Each run makes the calls the driver's worker makes for NodePrepareResources and
//! NodeUnprepareResources (bins/sandbox-dra-driver/src/worker.rs): lock and load the
//! state file, scan, `Claims::prepare` (save the claim, load the vfio modules, move
//! its groups, write the CDI spec and metadata files, save it prepared), then
//! `Claims::unprepare`; then the same claim moved early, as the claim watcher has
//! it moved when the scheduler waits on binding conditions (`Claims::move_early`,
//! between allocation and binding), and the prepare that follows (the files only)
//! — once moving one group at a time and once with `--jobs` groups at once
//! (default: the driver's `--bind-jobs` default), each on a fresh node. Prints one
//! line:
//!
//! ```text
//! devices=8 latency_ms=1000 jobs=1 prepare_ms=16030 unprepare_ms=16020 early_move_ms=16010 early_prepare_ms=1 jobs=8 ...
//! ```
//!
//! It checks that every device was on vfio-pci after the prepare and back on e1000e
//! after the unprepare (exit 1 otherwise) and asserts nothing about time.
//! `scripts/bench-node-entry.sh` runs it and takes medians.

use std::num::NonZeroUsize;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kubelet_plugin::{AllocatedDevice, ClaimRef};
use passthrough::config::ResourceList;
use passthrough::inventory::Inventory;
use passthrough::{Passthrough, DEFAULT_BIND_JOBS};
use sandbox_dra_driver::cdi::DriverName;
use sandbox_dra_driver::StateFile;
use sandbox_dra_driver::{device_name, Claims, Files};
use support::error_chain;
use sysfs_pci::testing::{BenchArgs, FakeKernel};
use sysfs_pci::PciAddress;

const LIST: &str =
    r#"{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}"#;
const RELEASE: &str = "6.1.0-bench";
const POOL: &str = "bench-node";
const USAGE: &str = "usage: prepare [--devices N] [--latency-ms MS] [--jobs N]";

fn addresses(devices: u8) -> Result<Vec<PciAddress>, String> {
    (1..=devices)
        .map(|i| {
            format!("0000:{i:02x}:00.0")
                .parse()
                .map_err(|e| format!("{e}"))
        })
        .collect()
}

/// Every bench device is on `want`.
fn all_on(kernel: &FakeKernel, devices: &[PciAddress], want: &str) -> Result<(), String> {
    for a in devices {
        let driver = kernel.node.driver_of(a);
        if driver.as_deref() != Some(want) {
            return Err(format!("{a} ended on {driver:?}, not {want}"));
        }
    }
    Ok(())
}

/// Prepares and unprepares one claim of every bench device, then moves it early
/// and prepares it; the time each took.
fn prepare_and_unprepare(
    root: &std::path::Path,
    args: &BenchArgs,
    jobs: NonZeroUsize,
) -> Result<Vec<Duration>, String> {
    let kernel = FakeKernel::slow_nics(root, args.devices, args.latency, RELEASE);
    let host = &kernel.node.host;
    let list = ResourceList::parse(LIST).map_err(|e| error_chain(&e))?;
    let devices = addresses(args.devices)?;
    let files = Files {
        driver: DriverName::new("vfio-sandbox.example.com").map_err(|e| error_chain(&e))?,
        cdi_dir: root.join("var/run/cdi"),
        metadata_dir: root.join("var/run/dra-device-attributes"),
        iommufd: false,
    };
    let claim = ClaimRef {
        uid: "uid-bench".into(),
        namespace: "vms".into(),
        name: "bench".into(),
    };
    let allocations: Vec<AllocatedDevice> = devices
        .iter()
        .map(|a| AllocatedDevice {
            request_names: vec!["npu".into()],
            pool: POOL.into(),
            device: device_name(a),
            admin_access: false,
        })
        .collect();
    let mut state = StateFile::load(
        &root.join("run/state.json"),
        true,
        &sandbox_dra_driver::programs::DRA_DRIVER,
    )
    .map_err(|e| error_chain(&e))?;
    let mut claims = Claims {
        engine: Passthrough {
            host,
            kernel: &kernel,
            state: &mut state,
            release: RELEASE.into(),
        },
        list: &list,
        pool: POOL,
        files: &files,
        jobs,
    };
    let started = Instant::now();
    let inv = Inventory::scan(host, &list).map_err(|e| error_chain(&e))?;
    claims
        .prepare_on(&claim, None, &allocations, &[], &inv)
        .map_err(|e| error_chain(&e))?;
    let prepare = started.elapsed();
    all_on(&kernel, &devices, "vfio-pci")?;
    let started = Instant::now();
    claims.unprepare(&claim).map_err(|e| error_chain(&e))?;
    let unprepare = started.elapsed();
    all_on(&kernel, &devices, "e1000e")?;
    let started = Instant::now();
    let inv = Inventory::scan(host, &list).map_err(|e| error_chain(&e))?;
    claims
        .move_early_on(&claim, &allocations, &[], &inv)
        .map_err(|e| error_chain(&e))?;
    let early_move = started.elapsed();
    all_on(&kernel, &devices, "vfio-pci")?;
    let started = Instant::now();
    let inv = Inventory::scan(host, &list).map_err(|e| error_chain(&e))?;
    claims
        .prepare_on(&claim, None, &allocations, &[], &inv)
        .map_err(|e| error_chain(&e))?;
    let early_prepare = started.elapsed();
    claims.unprepare(&claim).map_err(|e| error_chain(&e))?;
    all_on(&kernel, &devices, "e1000e")?;
    Ok(vec![prepare, unprepare, early_move, early_prepare])
}

fn main() -> ExitCode {
    FakeKernel::bench_main(
        "prepare",
        USAGE,
        DEFAULT_BIND_JOBS,
        &["prepare", "unprepare", "early_move", "early_prepare"],
        prepare_and_unprepare,
    )
}
