#!/usr/bin/env bash
# Time to a VM on the real kernel: from the node labelled (vfio-manager run
# starts, as its DaemonSet pod would) to QEMU realizing a device the device
# plugin's Allocate gave; from kubelet's prepare of a claim to QEMU realizing
# it; and from a claim's allocation (moved early, on the binding condition) to
# QEMU realizing it. Runs the scenarios plugin-kubelet, dra-driver and
# dra-early-move N times in the VM test bed and prints their "time to a VM"
# lines, one per run and path, then a median line per path. Prints numbers,
# asserts nothing about time.
#
#   scripts/bench-time-to-vm.sh [--runs N] [--kernel K]   (default: 3, bookworm)
#
# The guest runs under TCG and QEMU inside it under TCG again, so QEMU's own
# start (qemu_realize_ms) is far slower than on a node; the other figures are
# the project's own steps on a real kernel, slowed by the one level of TCG.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3
kernel=bookworm
while (($#)); do
    case "$1" in
        --runs) runs="$2"; shift ;;
        --kernel) kernel="$2"; shift ;;
        *) echo "usage: $0 [--runs N] [--kernel K]" >&2; exit 2 ;;
    esac
    shift
done
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "--runs wants a positive number" >&2; exit 2; }
lines=""
build=()
for ((i = 1; i <= runs; i++)); do
    scripts/vm/run.sh "${build[@]}" --kernel "$kernel" plugin-kubelet dra-driver dra-early-move >/dev/null 2>&1 ||
        { echo "run $i: a scenario failed (target/vm-logs/$kernel/)" >&2; exit 1; }
    build=(--no-build)
    run_lines="$(cat target/vm-logs/"$kernel"/{plugin-kubelet,dra-driver,dra-early-move}.log |
        tr -d '\r' | sed -n 's/^---- time to a VM: \(path=.*\) ----$/\1/p')"
    echo "$run_lines"
    lines+="$run_lines"$'\n'
done
for path in vfio-manager dra-prepare dra-early-move; do
    printf '%s' "$lines" | grep "^path=$path " | cut -d' ' -f2- | awk -f scripts/lib/median.awk |
        sed "s/^median/median path=$path/"
done
