#!/usr/bin/env bash
# Benchmark of vfio-manager's node entry and exit: how long `run` takes to put 1 and
# 8 devices on vfio-pci, and its stop to put them back; then the same for
# sandbox-dra-driver: one claim of 1 and 8 devices prepared and unprepared. Both on a
# fake node whose every unbind and probe takes the given latency (default 1000 ms, as
# a GPU driver's remove or probe can). Prints numbers, asserts nothing about time.
#
#   scripts/bench-node-entry.sh [--latency-ms MS] [--runs N] [--jobs N]
#
# Per size, N runs (default 3); each line is one run, and a median line follows:
#   jobs=1 entry_ms leave_ms   one IOMMU group after another (--bind-jobs 1)
#   jobs=J entry_ms leave_ms   J groups at once (default: vfio-manager's --bind-jobs
#                              default), entering and leaving
#   jobs=1|J prepare_ms unprepare_ms   the same for one claim of the DRA driver,
#            early_move_ms early_prepare_ms  and for the claim moved as soon as it is
#                              allocated (binding conditions), then prepared
set -euo pipefail
cd "$(dirname "$0")/.."
latency=1000
runs=3
jobs=()
while (($#)); do
    case "$1" in
        --latency-ms) latency="$2"; shift ;;
        --runs) runs="$2"; shift ;;
        --jobs) jobs=(--jobs "$2"); shift ;;
        *) echo "usage: $0 [--latency-ms MS] [--runs N] [--jobs N]" >&2; exit 2 ;;
    esac
    shift
done
cargo build -q --release -p passthrough --example node_entry
cargo build -q --release -p sandbox-dra-driver --example prepare
for bench in node_entry prepare; do
    for n in 1 8; do
        out=$(for _ in $(seq "$runs"); do
            target/release/examples/$bench --devices "$n" --latency-ms "$latency" "${jobs[@]}"
        done)
        echo "$out"
        echo "$out" | awk -f scripts/lib/median.awk
    done
done
