#!/usr/bin/env bash
# Every benchmark figure in one run: the device plugin on fake nodes of 8, 256 and
# 1024 GPUs (scripts/bench-device-plugin.sh), vfio-manager's node entry and the DRA
# driver's prepare for 1 and 8 devices (scripts/bench-node-entry.sh), the DRA
# driver's health stream at 8/256/1024 GPUs (scripts/bench-dra-health.sh), medians
# of 3 runs each, and the cost of
# "driver": "auto" (scripts/bench-alias.sh). Prints numbers,
# asserts nothing; the machine's load average is printed with them, since timings
# are only comparable within one run.
#
#   scripts/bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== sandbox-device-plugin"
scripts/bench-device-plugin.sh
echo "== vfio-manager node entry, sandbox-dra-driver prepare"
scripts/bench-node-entry.sh
echo "== sandbox-dra-driver health stream"
scripts/bench-dra-health.sh
echo "== driver auto: modules.alias"
scripts/bench-alias.sh
echo "load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
