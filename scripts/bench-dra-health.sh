#!/usr/bin/env bash
# Benchmark of sandbox-dra-driver's device health stream (KEP-4680): on fake nodes of
# 8, 256 and 1024 GPUs, how long a prepared GPU's change (off vfio-pci with its group
# node gone, and back) takes to reach kubelet-peer's `DRAResourceHealth` reader
# (tests/bench/src/bin/dra-health-bench.rs), release build. Prints numbers,
# asserts nothing.
#
#   scripts/bench-dra-health.sh [--runs N] [--changes N]
#
# Per size, N runs (default 3) of --changes changes (default 20); each line is one
# run (median and max of its changes), and a median line follows.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3
changes=20
while (($#)); do
    case "$1" in
        --runs) runs="$2"; shift ;;
        --changes) changes="$2"; shift ;;
        *) echo "usage: $0 [--runs N] [--changes N]" >&2; exit 2 ;;
    esac
    shift
done
cargo build -q --release -p sandbox-dra-driver --bin sandbox-dra-driver
cargo build -q --release -p bench --bin dra-health-bench
for n in 8 256 1024; do
    out=$(for _ in $(seq "$runs"); do
        target/release/dra-health-bench --driver target/release/sandbox-dra-driver \
            --devices "$n" --changes "$changes"
    done)
    echo "$out"
    echo "$out" | awk -f scripts/lib/median.awk
done
