#!/usr/bin/env bash
# Benchmark of sandbox-device-plugin against the kubelet-like peer on fake nodes of
# 8, 256 and 1024 NVIDIA GPUs bound to vfio-pci. Prints numbers, asserts nothing.
#
#   scripts/bench-device-plugin.sh [--sizes "8 256 1024"] [--runs N]
#                                  [--idle-seconds S] [--plugin PATH]
#
# The plugin measured is the one the image ships: a static release build
# (RUSTFLAGS=-C target-feature=+crt-static, as scripts/build-static.sh), unless
# --plugin names another binary. Per size, N runs (default 3); each line is one
# run, and a median line follows:
#   start_to_first_ms        process start -> first ListAndWatch message (includes
#                            Register and kubelet's dial-back)
#   alloc_*_us               Allocate round trip over the Unix socket, 1000 calls
#   pref_all_median_us       GetPreferredAllocation over every device
#   alloc_racing_pref_max_us an Allocate sent while that runs, on another connection
#   rss_after_allocs_mib     resident memory right after the 1000 Allocate calls
#   rss_idle_mib             resident memory after the idle period
#   idle_cpu_pct             CPU used while idle (default 10 s)
#   health_node_*_ms         device unbound and its /dev/vfio/<group> removed ->
#                            Unhealthy message (and back to Healthy)
#   health_uevent_*_ms       driver unbound with the group node kept, announced by a
#                            uevent -> Unhealthy (and back); -1 without the
#                            privilege to make a network namespace
set -euo pipefail
cd "$(dirname "$0")/.."
idle=10
runs=3
sizes="8 256 1024"
plugin=""
while (($#)); do
    case "$1" in
        --idle-seconds) idle="$2"; shift ;;
        --runs) runs="$2"; shift ;;
        --sizes) sizes="$2"; shift ;;
        --plugin) plugin="$2"; shift ;;
        *) echo "usage: $0 [--sizes \"8 256 1024\"] [--runs N] [--idle-seconds S] [--plugin PATH]" >&2; exit 2 ;;
    esac
    shift
done
cargo build -q --release -p kubelet-peer --bin plugin-bench
if [[ -z "$plugin" ]]; then
    target="$(uname -m)-unknown-linux-gnu"
    RUSTFLAGS="-C target-feature=+crt-static" \
        cargo build -q --release --target "$target" -p sandbox-device-plugin
    plugin="target/$target/release/sandbox-device-plugin"
fi
echo "plugin: $plugin ($(stat -c %s "$plugin") bytes); load: $(cut -d' ' -f1-3 /proc/loadavg)"
for n in $sizes; do
    out=$(for _ in $(seq "$runs"); do
        target/release/plugin-bench --plugin "$plugin" --devices "$n" --idle-seconds "$idle"
    done)
    echo "$out"
    echo "$out" | awk -f scripts/lib/median.awk
done
