#!/usr/bin/env bash
# Benchmark of DRA at kubelet speed: the same null driver on lib/kubelet-plugin
# (its examples/cdi_driver.rs) and on Go's k8s.io/dynamic-resource-allocation
# kubeletplugin (tests/dra-reference), side by side on the real kube-apiserver,
# scheduler, controller manager, kubelet and containerd of v1.37; and beside
# them sandbox-dra-driver (with its claim labeller, as the chart runs them) and
# sandbox-device-plugin on the fake PCI tree, asked for the same devices by the
# same pods (tests/k8s/src/bin/dra-bench.rs says
# what each figure is). Release builds; prints one line per subject and run and
# tables of medians with the ratios; asserts nothing.
#
#   scripts/bench-dra.sh [--smoke] [--rust FILE] [--bench FILE] [--our-bins DIR] [dra-bench options]
#       dra-bench options: --runs N (5) --sizes 8,256,1024,4096 --pods N (50)
#                          --together 2,16,64 --prepares N (1000)
#
# --smoke: one run of the smallest everything with the debug builds, so the
# benchmark cannot rot (the suite runs it; about a minute once built). --rust,
# --bench and --our-bins take given builds of the example, of dra-bench and of
# sandbox-dra-driver, sandbox-dra-controller and sandbox-device-plugin instead
# of building them (the suite passes its test build's).
#
# Builds (or takes from the cache) v1.37, containerd and helm with
# scripts/build-k8s.sh, and the Go reference with Go at /usr/local/go, cached
# under $HOME/.cache/vfio-sandbox/dra-reference/<hash of its sources>/. Its
# go.mod asks for go 1.26; should it ever ask for a newer toolchain, the go
# command fetches it from the module proxy (GOTOOLCHAIN=auto; export
# GOTOOLCHAIN=go1.27.3 to pin one). Needs root (kubelet, containerd, runc),
# Debian's runc, busybox-static, containernetworking-plugins and curl.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"
export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}"
smoke=false
rust=""
bench=""
ours=""
args=()
while (($#)); do
    case "$1" in
        --smoke) smoke=true ;;
        --rust) rust="$2"; shift ;;
        --bench) bench="$2"; shift ;;
        --our-bins) ours="$2"; shift ;;
        *) args+=("$1") ;;
    esac
    shift
done
mapfile -t built < <(scripts/build-k8s.sh v1.37 containerd helm)
((${#built[@]} == 3)) || { echo "$0: scripts/build-k8s.sh did not give three build directories" >&2; exit 1; }
version=$(awk '$1 == "k8s.io/kubernetes" { print $2 }' tests/k8s/v1.37/go.mod)

sources=(tests/dra-reference/go.mod tests/dra-reference/go.sum tests/dra-reference/*.go)
hash=$(cat "${sources[@]}" | sha256sum | cut -c1-16)
reference="${XDG_CACHE_HOME:-$HOME/.cache}/vfio-sandbox/dra-reference/$hash/dra-reference"
if [[ ! -x "$reference" ]]; then
    mkdir -p "$(dirname "$reference")"
    (cd tests/dra-reference && go build -trimpath -o "$reference.tmp" .)
    mv "$reference.tmp" "$reference"
fi

target="${CARGO_TARGET_DIR:-target}"
if $smoke; then
    profile=debug
    set -- --sizes 8 --runs 1 --pods 1 --together 2 --prepares 10 --settle-ms 200
else
    profile=release
    set --
fi
flags=()
[[ $profile == release ]] && flags=(--release)
if [[ -z "$bench" ]]; then
    cargo build -q "${flags[@]}" -p real-k8s --bin dra-bench
    bench="$target/$profile/dra-bench"
fi
if [[ -z "$ours" ]]; then
    cargo build -q "${flags[@]}" -p sandbox-dra-driver -p sandbox-dra-controller -p sandbox-device-plugin
    ours="$target/$profile"
fi
if [[ -z "$rust" ]]; then
    cargo build -q "${flags[@]}" -p kubelet-plugin --example cdi_driver
    rust="$target/$profile/examples/cdi_driver"
fi
"$bench" --release "$version" --k8s-bins "${built[0]}" --containerd-bins "${built[1]}" \
    --helm "${built[2]}/helm" --our-bins "$ours" --rust "$rust" --go "$reference" "$@" "${args[@]}"
