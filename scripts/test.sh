#!/usr/bin/env bash
# The whole test suite, from a fresh machine: formatting, lints, unit and CLI tests,
# then the drivers against the real Kubernetes (v1.34 and v1.37 control plane and
# kubelet with containerd, built from their Go modules by scripts/build-k8s.sh),
# then the real-kernel scenarios in QEMU (which install qemu-system-x86,
# busybox-static, kmod and the Debian kernel package themselves), then the
# container image built from the same static binaries (which installs buildah).
# Debian packages are installed only when missing, without recommended ones and
# never at the price of a removal (scripts/lib/packages.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/packages.sh
source scripts/lib/packages.sh
# Each step prints how long the one before it took, in seconds of the clock and
# of CPU (user and system time of every process it started and waited for: what
# the step costs a machine whose cores are busy with other work); the last line
# is the verdict:
#   ==== suite PASSED in N s (CPU N s)
#   ==== suite FAILED (exit code X) in step "<step>" after N s (CPU N s)
clock_ticks="$(getconf CLK_TCK)"
# cpu_ticks: this shell's and its reaped children's CPU time so far, in clock
# ticks (/proc/<pid>/stat fields 14 to 17, counted after the command name).
cpu_ticks() {
    local stat
    stat="$(</proc/$$/stat)"
    read -r -a stat <<<"${stat##*) }"
    echo $((stat[11] + stat[12] + stat[13] + stat[14]))
}
step_start=""
step_cpu=""
step_name=""
step_took() {
    echo "---- $((SECONDS - step_start)) s (CPU $((($(cpu_ticks) - step_cpu) / clock_ticks)) s)"
}
step() {
    [[ -z "$step_start" ]] || step_took
    step_start=$SECONDS
    step_cpu="$(cpu_ticks)"
    step_name="$*"
    echo "==== $*"
}
lifetime_pid=""
guest_node_pid=""
manifests_pid=""
finish() {
    local rc=$?
    progress_stop
    # The background watch test of a run that stopped early has nothing to report.
    [[ -z "$lifetime_pid" ]] || kill "$lifetime_pid" 2>/dev/null || true
    [[ -z "$guest_node_pid" ]] || kill "$guest_node_pid" 2>/dev/null || true
    [[ -z "$manifests_pid" ]] || kill "$manifests_pid" 2>/dev/null || true
    [[ -z "$step_start" ]] || step_took
    local total="$SECONDS s (CPU $(($(cpu_ticks) / clock_ticks)) s)"
    if ((rc == 0)); then
        echo "==== suite PASSED in $total"
    else
        echo "==== suite FAILED (exit code $rc) in step \"${step_name:-before the first step}\" after $total"
    fi
    exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
step "cargo fmt --check, no line rustfmt gives up on (long code or a long one-line string), and the import graph: no module imports one that imports it back, no crate depends on one above it in docs/layout.md"
cargo fmt --all -- --check
python3 scripts/check-code-width.py
python3 scripts/import-graph.py
# The debug builds of the workspace, linted as they compile: clippy-driver is the
# compiler of the workspace's own crates (what `cargo clippy` runs, here with code
# generation) and warnings are errors, so this one build gives what `cargo clippy
# --workspace --all-targets -- -D warnings` gives and the tests' binaries, without
# a second compile of every dependency. Incremental compilation only costs time in
# a build from scratch. Every debug cargo command below uses it, so none of them
# compiles again.
clippy_driver="$(command -v clippy-driver)" ||
    { echo "test.sh: clippy-driver not found (rustup component add clippy)" >&2; exit 1; }
lint_cargo() {
    RUSTC_WORKSPACE_WRAPPER="$clippy_driver" RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-D warnings" \
        CARGO_INCREMENTAL=0 cargo "$@"
}
# Cargo's intermediate artifacts (every compiled dependency of the debug, x86
# and arm64 builds) are kept outside the checkout, one cache per checkout path,
# so a warm machine compiles only the workspace's own crates: a fresh clone's
# files are newer than anything cached, so they compile again, and nothing of
# another checkout is taken for them. The binaries still land in target/.
# Caches of checkouts that no longer exist are removed.
if [[ -z "${CARGO_BUILD_BUILD_DIR:-}" ]]; then
    cargo_caches="${XDG_CACHE_HOME:-$HOME/.cache}/vfio-sandbox/cargo"
    checkout="$(pwd -P)"
    CARGO_BUILD_BUILD_DIR="$cargo_caches/$(printf '%s' "$checkout" | sha256sum | cut -c1-16)"
    export CARGO_BUILD_BUILD_DIR
    for cache in "$cargo_caches"/*/; do
        [[ -f "$cache/checkout" && "$cache" != "$CARGO_BUILD_BUILD_DIR/" ]] || continue
        [[ -d "$(cat "$cache/checkout")" ]] || rm -rf "$cache"
    done
    mkdir -p "$CARGO_BUILD_BUILD_DIR"
    printf '%s\n' "$checkout" >"$CARGO_BUILD_BUILD_DIR/checkout"
fi
echo "cargo's build cache: $CARGO_BUILD_BUILD_DIR ($(du -sh "$CARGO_BUILD_BUILD_DIR" | cut -f1))"
step "cargo clippy (warnings denied) and the test build, in one compile"
# The targets of the plain `cargo test` below (libraries, binaries, tests, examples;
# the workspace has no benches), so that step compiles nothing again: with
# --all-targets it compiled three crates again. Cargo's messages name every
# test binary it made, for the steps that run one directly.
test_build=target/test-build.json
mkdir -p target
pkg_ensure test.sh jq:jq
lint_cargo test --workspace --locked --no-run --message-format=json-render-diagnostics >"$test_build"
# test_binary <target name> [lib]: the test binary the build above made for that
# test target (or, with lib, for that package's unit tests).
test_binary() {
    jq -r --arg name "$1" --arg kind "${2:-test}" 'select(.reason == "compiler-artifact"
        and .target.name == $name and .profile.test and any(.target.kind[]; . == $kind)
        and .executable != null) | .executable' "$test_build" | tail -n1
}
# The dra driver's tests start vfio-manager: this build's, not one built again
# with that package's own features (bins/sandbox-dra-driver/tests/common).
export VFIO_MANAGER_BINARY="$PWD/target/debug/vfio-manager"
[[ -x "$VFIO_MANAGER_BINARY" ]] || { echo "no target/debug/vfio-manager from the test build" >&2; exit 1; }
step "the kubelet-plugin crate and the two it depends on, packaged as for crates.io (cargo publish --dry-run, without the verifying build: the test build above compiled the same sources)"
cargo publish --dry-run --no-verify --allow-dirty --locked -p support -p kubelet-api -p kubelet-plugin \
    >target/publish-dry-run.log 2>&1 || { cat target/publish-dry-run.log; exit 1; }
grep -E "^ *Packaged" target/publish-dry-run.log
step "cargo test: unit, CLI and integration tests, beside the manifest checks (render, validate against Kubernetes and KubeVirt, coexistence, shellcheck, yamllint, hadolint; their output follows)"
# The tests mostly wait on timers (2 minutes, a quarter of it CPU) and the
# manifest checks run no cargo: side by side they take the longer one's time.
scripts/check-manifests.sh >target/check-manifests.log 2>&1 &
manifests_pid=$!
# The two fault walks run once, in the next step, where their tallies are printed.
lint_cargo test --workspace --locked -- --skip every_fault_and_crash_point --skip every_step_of_a_claims_life --skip every_step_of_an_early_move
manifests_rc=0
wait "$manifests_pid" || manifests_rc=$?
manifests_pid=""
cat target/check-manifests.log
((manifests_rc == 0)) || { echo "the manifest checks failed (exit $manifests_rc): target/check-manifests.log" >&2; exit 1; }
step "a quiet watch lives its server timeout: started now, in the background (five idle minutes), its result read after the real-kernel scenarios"
# The test binary the test build made (asking cargo for it again cost a minute
# of fingerprint checks and rebuilds).
lifetime="$(test_binary watch_lifetime)"
[[ -x "$lifetime" ]] || { echo "no watch_lifetime test binary in the workspace's test build" >&2; exit 1; }
"$lifetime" --ignored --nocapture >target/watch-lifetime.log 2>&1 &
lifetime_pid=$!
step "fault injection: fail and crash at every kernel write, module syscall and state save (a node's VM-mode life; two DRA claims' life, at prepare and moved early)"
# --workspace, like the step above: the same features, so nothing is compiled again.
lint_cargo test --workspace --test faults --test claims --locked -- --nocapture
step "gRPC interop: a grpc-core client (Python grpcio from PyPI) against the device plugin and the DRA driver (registration, DRA v1 and v1beta1, the health stream)"
# Its venv is the machine's (a fresh clone spent most of this step installing it
# again; scripts/lib/packages.sh).
grpc_venv="${VFIO_SANDBOX_CACHE:-$HOME/.cache/vfio-sandbox}/grpc-venv"
venv_ensure test.sh "$grpc_venv" tests/grpc-interop/requirements.txt
# The binaries the test build built for its integration tests (each package
# used here has some); a build of only these packages would resolve other
# features and compile much of the workspace again.
for b in sandbox-device-plugin sandbox-dra-driver kubelet-peer fake-apiserver fake-node real-k8s guest-node; do
    [[ -x "target/debug/$b" ]] || { echo "no target/debug/$b from the test build" >&2; exit 1; }
done
"$grpc_venv/bin/python" tests/grpc-interop/grpc_core_client.py \
    --plugin target/debug/sandbox-device-plugin --peer target/debug/kubelet-peer \
    --fake-node target/debug/fake-node
"$grpc_venv/bin/python" tests/grpc-interop/grpc_core_dra_client.py \
    --driver target/debug/sandbox-dra-driver --apiserver target/debug/fake-apiserver \
    --fake-node target/debug/fake-node
step "CDI runtime: Debian's podman (runc) runs a container with a prepared claim's CDI devices and sees the PCI_RESOURCE_<NAME> variables, the VFIO nodes and the metadata files"
pkg_ensure test.sh podman:podman runc:runc busybox-static:/bin/busybox
lint_cargo test --workspace --test cdi_runtime --locked -- --ignored --nocapture
step "the real Kubernetes, from its Go modules: kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl and etcd of v1.34 and v1.37, containerd 2 and helm (scripts/build-k8s.sh; cached per module and flags, so a warm machine builds nothing)"
pkg_ensure test.sh runc:runc busybox-static:/bin/busybox containernetworking-plugins:/usr/lib/cni/loopback \
    openssl:openssl util-linux:nsenter
mapfile -t k8s_built < <(scripts/build-k8s.sh v1.34 v1.37 containerd helm)
((${#k8s_built[@]} == 4)) || { echo "scripts/build-k8s.sh did not give four build directories" >&2; exit 1; }
step "the drivers against the real Kubernetes (tests/k8s, real-k8s): v1.34 with the DRA gates on and with its defaults, v1.37 with its defaults; the chart installed with helm (its RBAC and DeviceClasses), real kubelet and containerd running busybox pods"
# The three runs are independent (their own ports, scratch, cgroups and mount
# namespaces) and mostly wait on the components: side by side. Each line they
# print names its run.
k8s_runs=()
for run in "v1.34 features ${k8s_built[0]}" "v1.34 defaults ${k8s_built[0]}" "v1.37 defaults ${k8s_built[1]}"; do
    read -r release gates bins <<<"$run"
    target/debug/real-k8s --release "$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "tests/k8s/$release/go.mod")" \
        --gates "$gates" --k8s-bins "$bins" --containerd-bins "${k8s_built[2]}" --helm "${k8s_built[3]}/helm" --our-bins target/debug &
    k8s_runs+=($!)
done
k8s_failed=0
for pid in "${k8s_runs[@]}"; do
    wait "$pid" || k8s_failed=1
done
((k8s_failed == 0)) || { echo "real-k8s: a run failed: its FAIL lines above name the scenario and its logs" >&2; exit 1; }
step "the DRA benchmark kept from rotting: one small run of scripts/bench-dra.sh --smoke, lib/kubelet-plugin's example beside the Go kubeletplugin reference (tests/dra-reference, built once and cached), sandbox-dra-driver and the device plugin, on the real v1.37 kubelet; the figures come from full runs (docs/testbed.md)"
pkg_ensure test.sh curl:curl
cdi_example=$(jq -r 'select(.reason == "compiler-artifact" and .target.name == "cdi_driver"
    and any(.target.kind[]; . == "example") and .executable != null) | .executable' "$test_build" | tail -n1)
[[ -x "$cdi_example" && -x target/debug/dra-bench ]] ||
    { echo "no cdi_driver example or target/debug/dra-bench from the test build" >&2; exit 1; }
scripts/bench-dra.sh --smoke --rust "$cdi_example" --bench target/debug/dra-bench --our-bins target/debug
step "VM harness self-test (stall watchdog, fake QEMU)"
tests/vm/harness-selftest.sh
step "real-kernel scenarios (QEMU) on Debian 12 and 13 kernels, and the demo so it cannot rot"
scripts/vm/run.sh --kernel bookworm,trixie tests/vm/scenarios/*.sh scripts/demo/node-lifecycle.sh
step "a quiet watch lives its server timeout: the result of the run started before the scenarios"
progress_start "test.sh: still waiting for the quiet watch (its server timeout is 290 s)"
lifetime_rc=0
wait "$lifetime_pid" || lifetime_rc=$?
lifetime_pid=""
progress_stop
if ((lifetime_rc != 0)); then
    cat target/watch-lifetime.log
    exit 1
fi
grep -E "lived|test result" target/watch-lifetime.log
step "the test bed's own kernel: Debian's 6.12 source with IOMMUFD, VFIO_DEVICE_CDEV and virtio_vfio_pci (scripts/build-kernel.sh; cached by its config, rebuilt only when that changes)"
scripts/build-kernel.sh >/dev/null
step "the iommufd and VFIO cdev scenario on it, QEMU taking the devices through iommufd (on Debian's kernels it ran above: nothing iommufd offered, nothing fails)"
scripts/vm/run.sh --no-build --kernel iommufd iommufd-cdev
step "no test fakes in the shipped binaries (symbols of the test bed's x86 static build; the sysfs-pci unit tests as the control)"
# The control is sysfs-pci's own unit-test binary, from the test build.
control="$(test_binary sysfs_pci lib)"
[[ -x "$control" ]] || { echo "no unit-test binary of sysfs-pci in the test build" >&2; exit 1; }
shipped=()
for b in vfio-manager sandbox-validator sandbox-device-plugin sandbox-dra-driver sandbox-dra-controller; do
    shipped+=("target/x86_64-unknown-linux-gnu/testbed/$b")
done
scripts/check-no-fakes.sh "${shipped[@]}" -- "$control"
step "the amd64 image (buildah, vfs, chroot) from the test bed's static binaries, archived for the guest node; each binary's --version inside it"
scripts/image.sh --profile testbed --arch amd64 --archive target/image/vfio-sandbox-testbed.tar --remove
step "the chart as a user installs it, on the real kernel, started in the background beside the multi-arch image and the arm64 scenarios (the guest has two TCG vCPUs, each arm64 scenario one): kubelet, kube-proxy, containerd and runc of v1.37 in the test bed's guest, joined to a control plane on the host; helm install, the label, vfio-manager binding from its pod, the validator holding the plugin back, registration, a VM pod's QEMU taking its device; helm upgrade (new tag and resource list) under it; the node leaving VM mode under it, vfio-manager killed mid-restore; helm uninstall and its pre-delete hook; the DRA driver, its claim labeller and the owner lock; bad values refused; the privileges each step needs, with the real runc (tests/k8s, guest-node; its output in target/guest-node.log)"
target/debug/guest-node --release "$(awk '$1 == "k8s.io/kubernetes" { print $2 }' tests/k8s/v1.37/go.mod)" \
    --k8s-bins "${k8s_built[1]}" --containerd-bins "${k8s_built[2]}" --helm "${k8s_built[3]}/helm" \
    --image-archive target/image/vfio-sandbox-testbed.tar --vmm target/x86_64-unknown-linux-gnu/testbed/kubelet-peer \
    >target/guest-node.log 2>&1 &
guest_node_pid=$!
step "the multi-arch image from the test bed's amd64 and arm64 static binaries (the arm64 ones cross-built here, for the arm64 scenarios too), beside the guest node: one manifest list, each binary's --version inside the amd64 image and under qemu-user from the arm64 one, size per architecture"
scripts/image.sh --profile testbed --remove
step "the same real-kernel scenarios on Debian 13's arm64 kernel (qemu-system-aarch64, SMMUv3) with cross-built aarch64 binaries, beside the guest node"
scripts/vm/run.sh --kernel trixie-arm64 tests/vm/scenarios/*.sh scripts/demo/node-lifecycle.sh
step "the guest node's result (started three steps above)"
progress_start "test.sh: still waiting for guest-node (target/guest-node.log)"
guest_node_rc=0
wait "$guest_node_pid" || guest_node_rc=$?
guest_node_pid=""
progress_stop
cat target/guest-node.log
((guest_node_rc == 0)) || { echo "guest-node failed: its FAIL line above names the step, its logs the directory" >&2; exit 1; }
