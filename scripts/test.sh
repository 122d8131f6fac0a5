#!/usr/bin/env bash
# The whole test suite, from a fresh machine: formatting, lints, unit and CLI tests,
# then the real-kernel scenarios in QEMU (which install qemu-system-x86,
# busybox-static, kmod and the Debian kernel package themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "==== cargo fmt --check"
cargo fmt --all -- --check
echo "==== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "==== manifests: render, validate (Kubernetes, KubeVirt), coexistence, shellcheck, yamllint, hadolint"
scripts/check-manifests.sh
echo "==== cargo test"
cargo test --workspace --locked
echo "==== fault injection: fail and crash at every kernel write, module syscall and state save (a node's VM-mode life; two DRA claims' life)"
cargo test -p vfio-sandbox --test faults --test claims --locked -- --nocapture
echo "==== gRPC interop: a grpc-core client (Python grpcio from PyPI) against the device plugin"
python3 -m venv .cache/grpc-venv
.cache/grpc-venv/bin/pip install --quiet --disable-pip-version-check -r tests/grpc-interop/requirements.txt
cargo build --locked -p sandbox-device-plugin -p kubelet-peer
.cache/grpc-venv/bin/python tests/grpc-interop/grpc_core_client.py \
    --plugin target/debug/sandbox-device-plugin --peer target/debug/kubelet-peer
echo "==== VM harness self-test (stall watchdog, fake QEMU)"
tests/vm/harness-selftest.sh
echo "==== real-kernel scenarios (QEMU) on Debian 12 and 13 kernels, and the demo so it cannot rot"
scripts/vm/run.sh --kernel bookworm,trixie tests/vm/scenarios/*.sh scripts/demo/node-lifecycle.sh
echo "==== the same on Debian 13's arm64 kernel (qemu-system-aarch64, SMMUv3) with cross-built aarch64 binaries" && scripts/vm/run.sh --kernel trixie-arm64 tests/vm/scenarios/*.sh scripts/demo/node-lifecycle.sh
