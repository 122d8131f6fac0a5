#!/usr/bin/env bash
# Benchmark of sandbox-device-plugin against the kubelet-like peer on fake nodes of
# 1, 64 and 1024 selected devices. Prints numbers, asserts nothing.
#
#   scripts/bench-device-plugin.sh [--idle-seconds S] [--runs N]
#
# Per size, N runs (default 3); each line is one run, and a median line follows:
#   start_to_first_ms  process start -> first ListAndWatch message (includes Register
#                      and kubelet's dial-back)
#   alloc_*_us         Allocate round trip over the Unix socket, 1000 calls
#   rss_mib            resident memory after the idle period
#   idle_cpu_pct       CPU used while idle (default 60 s; includes the 5 s resync)
#   health_*_ms        device moved off vfio-pci -> Unhealthy message (and back)
set -euo pipefail
cd "$(dirname "$0")/.."
idle=60
runs=3
while (($#)); do
    case "$1" in
        --idle-seconds) idle="$2"; shift ;;
        --runs) runs="$2"; shift ;;
        *) echo "usage: $0 [--idle-seconds S] [--runs N]" >&2; exit 2 ;;
    esac
    shift
done
cargo build -q --release -p sandbox-device-plugin -p kubelet-peer
for n in 1 64 1024; do
    out=$(for _ in $(seq "$runs"); do
        target/release/plugin-bench --plugin target/release/sandbox-device-plugin \
            --devices "$n" --idle-seconds "$idle"
    done)
    echo "$out"
    # Median of each numeric field across the runs.
    echo "$out" | awk '
        { for (i = 1; i <= NF; i++) { split($i, kv, "="); key[i] = kv[1]; val[i, NR] = kv[2] } nf = NF }
        END {
            line = "median"
            for (i = 1; i <= nf; i++) {
                n = 0; for (r = 1; r <= NR; r++) v[++n] = val[i, r]
                for (a = 1; a <= n; a++) for (b = a + 1; b <= n; b++) if (v[b] + 0 < v[a] + 0) { t = v[a]; v[a] = v[b]; v[b] = t }
                line = line " " key[i] "=" v[int((n + 1) / 2)]
            }
            print line
        }'
done
