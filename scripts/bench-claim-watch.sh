#!/usr/bin/env bash
# Benchmark of the DRA driver's claim watch at cluster scale: what the real
# kube-apiserver sends per ResourceClaim change when N nodes watch claims, with
# every node watching every claim (sandbox-dra-driver --claim-watch=all) and
# with the claim labeller (sandbox-dra-controller) running and each node
# watching only its label (--claim-watch=labelled), at 10 and 1,000 simulated
# nodes (N watch connections, tests/k8s/src/bin/claim-watch-bench.rs). Per
# claim change: the watch events and bytes the API server counts itself
# (every watcher), those the simulated nodes received, kube-apiserver's CPU
# time, and the latency from the allocation's write to the device's node seeing
# the claim. Release builds; prints one line per run and a table of medians;
# asserts nothing.
#
#   scripts/bench-claim-watch.sh [--runs N] [--claims N] [--nodes 10,1000]
#                                [--release v1.34|v1.37]
#
# Builds (or takes from the cache) that release with scripts/build-k8s.sh.
# 1.34 runs with the DRA gates on (binding conditions are off by default
# there); 1.37 with its defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3
claims=25
nodes=10,1000
release=v1.37
while (($#)); do
    case "$1" in
        --runs) runs="$2"; shift ;;
        --claims) claims="$2"; shift ;;
        --nodes) nodes="$2"; shift ;;
        --release) release="$2"; shift ;;
        *) echo "usage: $0 [--runs N] [--claims N] [--nodes LIST] [--release v1.34|v1.37]" >&2; exit 2 ;;
    esac
    shift
done
case "$release" in
    v1.34) gates=features ;;
    v1.37) gates=defaults ;;
    *) echo "$0: --release is v1.34 or v1.37" >&2; exit 2 ;;
esac
bins=$(scripts/build-k8s.sh "$release")
version=$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "tests/k8s/$release/go.mod")
cargo build -q --release -p sandbox-dra-controller
cargo build -q --release -p real-k8s --bin claim-watch-bench
target="${CARGO_TARGET_DIR:-target}"
"$target/release/claim-watch-bench" --k8s-bins "$bins" --release "$version" --gates "$gates" \
    --labeller "$target/release/sandbox-dra-controller" --nodes "$nodes" --runs "$runs" --claims "$claims"
