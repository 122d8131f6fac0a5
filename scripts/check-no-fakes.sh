#!/usr/bin/env bash
# Checks that no shipped binary carries the test fakes of sysfs-pci (its
# `testing` module: FakeNode, FakeKernel, FaultKernel), which only a
# dev-dependency may turn on.
#
#   scripts/check-no-fakes.sh BINARY... -- CONTROL
#
# Each BINARY must hold no symbol of `sysfs_pci::testing`; CONTROL, a test
# binary that uses the fakes, must hold some (so the check can fail: a stripped
# or renamed symbol table would otherwise pass silently).
set -euo pipefail
bins=()
while (($#)) && [[ "$1" != -- ]]; do bins+=("$1"); shift; done
[[ "${1:-}" == -- && -n "${2:-}" ]] || { echo "usage: $0 BINARY... -- CONTROL" >&2; exit 2; }
control="$2"
# Legacy and v0 manglings both spell the path as length-prefixed names.
pattern='9sysfs_pci7testing'
count() { nm -- "$1" 2>/dev/null | grep -c "$pattern" || true; }
n="$(count "$control")"
if ((n == 0)); then
    echo "check-no-fakes: error: the control $control has no $pattern symbols; the check would prove nothing" >&2
    exit 1
fi
echo "control $(basename "$control"): $n fake symbols"
status=0
for b in "${bins[@]}"; do
    if ! nm -- "$b" >/dev/null 2>&1; then
        echo "check-no-fakes: error: $b has no symbol table to check" >&2
        status=1
        continue
    fi
    n="$(count "$b")"
    echo "$(basename "$b"): $n fake symbols"
    ((n == 0)) || status=1
done
exit "$status"
