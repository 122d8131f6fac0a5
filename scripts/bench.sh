#!/usr/bin/env bash
# Every benchmark figure in one run: the device plugin on fake nodes of 8, 256 and
# 1024 GPUs (scripts/bench-device-plugin.sh) and vfio-manager's node entry for 1 and
# 8 devices (scripts/bench-node-entry.sh), medians of 3 runs each, and the cost of
# "driver": "auto" (scripts/bench-alias.sh). Prints numbers,
# asserts nothing; the machine's load average is printed with them, since timings
# are only comparable within one run.
#
#   scripts/bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== sandbox-device-plugin"
scripts/bench-device-plugin.sh
echo "== vfio-manager node entry"
scripts/bench-node-entry.sh
echo "== driver auto: modules.alias"
scripts/bench-alias.sh
echo "load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
