#!/usr/bin/env bash
# The cost of "driver": "auto": parsing a modules.alias of a distribution kernel's
# size and choosing one device's driver from it (lib/sysfs-pci/examples/alias_bench.rs,
# release build, medians of 15 runs). Prints numbers, asserts nothing.
#
#   scripts/bench-alias.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --locked --quiet --release -p sysfs-pci --example alias_bench
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
