#!/usr/bin/env bash
# Builds the real Kubernetes of each release the suite tests against, from
# their Go modules: kube-apiserver, kube-scheduler, kube-controller-manager,
# kubelet, kube-proxy (v1.37, for the guest node) and kubectl from k8s.io/kubernetes, and etcd from
# go.etcd.io/etcd/server/v3 at the version that release pins; and the container
# runtime kubelet runs pods with: containerd, its runc shim and ctr, from
# github.com/containerd/containerd/v2; and helm (helm.sh/helm/v3), which
# installs the chart. Each is a Go module under
# tests/k8s/<name>/ holding only go.mod and go.sum: the commands are its `tool`
# directives, and (for a release) each k8s.io staging module is replaced by its
# tagged version (k8s.io/kubernetes requires them at v0.0.0).
#
# Usage: scripts/build-k8s.sh [NAME...]   (v1.34, v1.37, containerd, helm; default: all)
#
# Prints, per module, the directory holding its binaries. They are cached
# under $HOME/.cache/vfio-sandbox/k8s/<release>/<hash of go.mod and go.sum>/, so
# a warm machine (or a fresh clone on it) builds nothing; Go's own build cache
# (~/.cache/go-build) makes a rebuild after a change cheaper too.
#
# Needs Go at /usr/local/go (1.26 here; the modules ask for go 1.24 and 1.26).
# Should a module ever need a newer toolchain than the one installed (Go 1.27,
# say), its go.mod's `go` line says so and the go command fetches that
# toolchain from the module proxy (GOTOOLCHAIN=auto; export
# GOTOOLCHAIN=go1.27.3 to pin it).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/progress.sh
source scripts/lib/progress.sh
trap progress_stop EXIT
export PATH="/usr/local/go/bin:$PATH"
export GOTOOLCHAIN="${GOTOOLCHAIN:-auto}"
command -v go >/dev/null || { echo "build-k8s: no Go toolchain at /usr/local/go" >&2; exit 1; }

releases=("$@")
if ((${#releases[@]} == 0)); then
    for dir in tests/k8s/*/; do
        [[ -f "$dir/go.mod" ]] && releases+=("$(basename "$dir")")
    done
fi

for release in "${releases[@]}"; do
    module="tests/k8s/$release"
    [[ -f "$module/go.mod" ]] || { echo "build-k8s: no module $module/go.mod" >&2; exit 1; }
    env=()
    flags=()
    if [[ "$release" == containerd ]]; then
        # Static, and without the snapshotters that need C libraries or kernel
        # features the node does not use (it runs the native snapshotter).
        env=(CGO_ENABLED=0)
        flags=(-tags "no_btrfs no_devmapper no_zfs")
    fi
    # Stripped: a fifth of the size, and a faster link.
    flags+=(-trimpath "-ldflags=-s -w")
    # The cache key: the module's requirements, its build flags and the toolchain.
    hash="$( (cat "$module/go.mod" "$module/go.sum"; echo "${env[*]} ${flags[*]}"; go version) |
        sha256sum | cut -c1-16)"
    out="$HOME/.cache/vfio-sandbox/k8s/$release/$hash"
    if [[ -f "$out/.complete" ]]; then
        echo "build-k8s: $release cached in $out" >&2
        echo "$out"
        continue
    fi
    started=$SECONDS
    # What the module builds: the last element of each tool's package path
    # (etcd's server is its module's root package, which go names `server`).
    mapfile -t tools < <(sed -n '/^tool (/,/^)/{/^\t/p}' "$module/go.mod" | awk -F/ '{print $NF}' |
        sed 's/^v3$/server/')
    echo "build-k8s: building $release (${tools[*]}) into $out" >&2
    rm -rf "$out.partial"
    mkdir -p "$out.partial"
    # A line every 30 s while the build is silent (scripts/lib/progress.sh).
    if ! (cd "$module" && progress_run "build-k8s: $release still building" -- \
        env "${env[@]}" go build "${flags[@]}" -o "$out.partial/" tool); then
        echo "build-k8s: $release failed" >&2
        exit 1
    fi
    for b in "${tools[@]}"; do
        [[ -x "$out.partial/$b" ]] || { echo "build-k8s: $release: $b was not built" >&2; exit 1; }
    done
    if [[ -x "$out.partial/server" ]]; then
        mv "$out.partial/server" "$out.partial/etcd"
    fi
    touch "$out.partial/.complete"
    # Older builds of this module are of no more use.
    find "$HOME/.cache/vfio-sandbox/k8s/$release" -mindepth 1 -maxdepth 1 \
        ! -name "$hash" ! -name "$hash.partial" -exec rm -rf {} +
    rm -rf "$out"
    mv "$out.partial" "$out"
    echo "build-k8s: $release built in $((SECONDS - started)) s" >&2
    echo "$out"
done
