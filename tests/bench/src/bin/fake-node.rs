//! `fake-node --root R`: lays out, under R, the fake node of
//! `sysfs_pci::testing::nic_node` for `sandbox-device-plugin --sysfs-root R/sys
//! --dev-root R/dev --kubelet-dir R/kubelet --config R/list.json` (and the DRA
//! driver with the same roots): a two-function NIC (group 5, NUMA 0, behind bridge
//! 00:01.0), a lone NIC (group 6, NUMA 1) as example.com/NIC_PT, an nvme (group 7,
//! no NUMA) as example.com/NVME_PT, all on vfio-pci. The gRPC interop clients
//! (`tests/grpc-interop`) run it.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Command line.
#[derive(Debug, Parser)]
#[command(
    name = "fake-node",
    about = "Lay out a small fake PCI node for the plugins' tests"
)]
struct Cli {
    /// Where the node's sys, dev and kubelet directories and list.json go.
    #[arg(long)]
    root: PathBuf,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The fake tree's builder panics on a root it cannot write; say why instead.
    let made = std::fs::create_dir_all(&cli.root).and_then(|()| {
        let probe = cli.root.join(".fake-node");
        std::fs::write(&probe, "").and_then(|()| std::fs::remove_file(&probe))
    });
    match made.and_then(|()| sysfs_pci::testing::nic_node(&cli.root)) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fake-node: cannot lay out {}: {e}", cli.root.display());
            ExitCode::FAILURE
        }
    }
}
