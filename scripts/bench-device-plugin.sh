#!/usr/bin/env bash
# Benchmark of sandbox-device-plugin against the kubelet-like peer on fake nodes of
# 8, 256 and 1024 NVIDIA GPUs bound to vfio-pci. Prints numbers, asserts nothing.
#
#   scripts/bench-device-plugin.sh [--sizes "8 256 1024"] [--runs N]
#                                  [--idle-seconds S] [--health-only]
#                                  [--plugin PATH [--plugin PATH2]]
#
# The plugin measured is the one the image ships: a static release build
# (RUSTFLAGS=-C target-feature=+crt-static, as scripts/build-static.sh), unless
# --plugin names another binary. Given twice, --plugin measures two binaries
# alternately, run by run under the same load, and prints a median line for each
# (tagged plugin=1 and plugin=2) and the health ratios 2/1. --health-only skips
# most of the Allocate calls and the idle period (their figures then mean little).
# Per size, N runs (default 3); each line is one run, and a median line follows:
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
plugins=()
extra=()
while (($#)); do
    case "$1" in
        --idle-seconds) idle="$2"; shift ;;
        --runs) runs="$2"; shift ;;
        --sizes) sizes="$2"; shift ;;
        --plugin) plugins+=("$2"); shift ;;
        --health-only) extra=(--allocs 10); idle=0 ;;
        *) echo "usage: $0 [--sizes \"8 256 1024\"] [--runs N] [--idle-seconds S] [--health-only] [--plugin PATH [--plugin PATH2]]" >&2; exit 2 ;;
    esac
    shift
done
cargo build -q --release -p bench --bin plugin-bench
if ((${#plugins[@]} == 0)); then
    target="$(uname -m)-unknown-linux-gnu"
    RUSTFLAGS="-C target-feature=+crt-static" \
        cargo build -q --release --target "$target" -p sandbox-device-plugin
    plugins=("target/$target/release/sandbox-device-plugin")
fi
for i in "${!plugins[@]}"; do
    echo "plugin=$((i + 1)): ${plugins[i]} ($(stat -c %s "${plugins[i]}") bytes)"
done
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
for n in $sizes; do
    out=$(for _ in $(seq "$runs"); do
        for i in "${!plugins[@]}"; do
            echo "plugin=$((i + 1)) $(target/release/plugin-bench --plugin "${plugins[i]}" \
                --devices "$n" --idle-seconds "$idle" "${extra[@]}")"
        done
    done)
    echo "$out"
    medians=$(for i in "${!plugins[@]}"; do
        echo "$out" | grep "^plugin=$((i + 1)) " | awk -f scripts/lib/median.awk
    done)
    echo "$medians"
    if ((${#plugins[@]} == 2)); then
        # Health medians of plugin 2 over plugin 1.
        echo "$medians" | awk '{ for (i = 2; i <= NF; i++) { split($i, kv, "="); v[NR, kv[1]] = kv[2] } }
            END { line = "ratio 2/1 devices=" v[1, "devices"]
                  split("health_node_median_ms health_uevent_median_ms", k, " ")
                  for (j = 1; j <= 2; j++) line = line sprintf(" %s=%.2f", k[j], v[1, k[j]] > 0 ? v[2, k[j]] / v[1, k[j]] : -1)
                  print line }'
    fi
done
