//! How long choosing a vfio driver from `modules.alias` takes: parse a file the size
//! of a distribution kernel's (about 20 000 aliases, 1.5 MB, 60 of them `vfio_pci:`)
//! and pick the best alias for a device, medians of 15 runs. Prints numbers and
//! asserts nothing (scripts/bench-alias.sh runs it in release mode).

use std::path::Path;
use std::time::{Duration, Instant};

use sysfs_pci::vfio_alias::AliasTable;

fn synthetic_alias_file() -> Vec<u8> {
    let mut text = String::new();
    for i in 0..20_000u32 {
        if i % 333 == 0 {
            text.push_str(&format!(
                "alias vfio_pci:v0000{:04X}d0000{:04X}sv*sd*bc*sc*i* variant{i}_vfio_pci\n",
                0x1000 + i % 4096,
                i
            ));
        } else {
            text.push_str(&format!(
                "alias pci:v0000{:04X}d0000{:04X}sv*sd*bc*sc*i* module{i}\n",
                0x1000 + i % 4096,
                i
            ));
        }
    }
    text.push_str("alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci\n");
    text.into_bytes()
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    let bytes = synthetic_alias_file();
    let path = Path::new("modules.alias");
    let modalias = "pci:v000010DEd00002342sv000010DEsd000016EBbc03sc02i00";
    let (mut parse, mut choose) = (Vec::new(), Vec::new());
    let mut aliases = 0;
    for _ in 0..15 {
        let start = Instant::now();
        let table = AliasTable::parse(path, &bytes);
        parse.push(start.elapsed());
        let start = Instant::now();
        let best = table.best_match(modalias).map(|a| a.driver());
        choose.push(start.elapsed());
        aliases = table.aliases.len();
        std::hint::black_box(best);
    }
    println!(
        "modules.alias of {} bytes, {} lines, {aliases} vfio_pci aliases",
        bytes.len(),
        bytes.iter().filter(|&&b| b == b'\n').count()
    );
    println!("parse median: {:?}", median(parse));
    println!("best match for one device median: {:?}", median(choose));
}
