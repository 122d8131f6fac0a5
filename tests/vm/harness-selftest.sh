#!/usr/bin/env bash
# Self-test of the VM harness's no-progress watchdog (scripts/vm/run.sh).
#
# Puts a fake qemu-system-x86_64 first on PATH and runs four scenarios
# through the real run.sh (real kernel fetch and initramfs, --stall-timeout 3)
# whose "guest" behaves as named:
#   slow-boot          prints a line every second for 6 s, then passes:
#                      slow but alive, so it must not be retried
#   stall-once         prints nothing after its first line on the first boot,
#                      passes on the second: retried exactly once, said so
#   stall-always       stalls on every boot: retried once, then fails
#   stall-after-start  stalls after "TESTBED START": never retried, fails on
#                      its hard timeout (a retry could hide a real bug)
# Checks each report, how often the fake was booted per scenario, the loud
# retry messages and the totals. Then runs stall-once and stall-after-start
# once more on the arm64 kernel (trixie-arm64, fake qemu-system-aarch64),
# whose timeouts run.sh doubles: the stall bound becomes 6 s, the hard
# timeout 16 s. Then stall-once with VM_LOAD_FACTOR=2 (the load factor
# multiplies the bounds like the arm64 one: 6 s) and a refused VM_LOAD_FACTOR=0.
# The other runs set the load factor to 1: a fake guest needs no CPU time.
# Takes about 40 s.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/vm-selftest.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin" "$tmp/state" "$tmp/scenarios" "$tmp/logs"

cat >"$tmp/bin/qemu-system-x86_64" <<'FAKE'
#!/usr/bin/env bash
# Fake QEMU: the scenario name comes from the -initrd path (<name>.initrd).
set -u
name=""
while (($#)); do
    [[ "$1" == -initrd ]] && { name="$(basename "$2" .initrd)"; shift; }
    shift
done
count_file="$FAKE_QEMU_STATE/$name.count"
n=$(($(cat "$count_file" 2>/dev/null || echo 0) + 1))
echo "$n" >"$count_file"
protocol() {
    echo "TESTBED BOOT $name: uptime=1.0 kernel=fake"
    echo "TESTBED READY $name: uptime=1.5 CARD_FN0=fake"
    echo "TESTBED START $name: uptime=1.6"
    echo "TESTBED STEP PASS $name: fake step"
    [[ "$1" == stall ]] && exec sleep 600
    echo "TESTBED SUMMARY $name: passed=1 failed=0"
    echo "TESTBED END $name: uptime=2.0"
}
echo "fake qemu boot $n of $name"
case "$name" in
    slow-boot)
        for i in 1 2 3 4 5 6; do echo "early boot, second $i"; sleep 1; done
        protocol end ;;
    stall-once) ((n == 1)) && exec sleep 600; protocol end ;;
    stall-always) exec sleep 600 ;;
    stall-after-start) protocol stall ;;
    *) echo "fake qemu: unknown scenario '$name'" ;;
esac
FAKE
chmod +x "$tmp/bin/qemu-system-x86_64"
ln -s qemu-system-x86_64 "$tmp/bin/qemu-system-aarch64"

for s in slow-boot stall-once stall-always stall-after-start; do
    printf '# Harness self-test scenario; the fake QEMU plays the guest.\n' >"$tmp/scenarios/$s.sh"
done
printf '# vm: timeout=8\n' >>"$tmp/scenarios/stall-after-start.sh"

failures=0
check() { # check NAME CONDITION-STATUS
    if [[ "$2" == 0 ]]; then
        echo "selftest: PASS $1"
    else
        echo "selftest: FAIL $1"
        failures=$((failures + 1))
    fi
}
has() { grep -qF -- "$2" <<<"$1" && echo 0 || echo 1; }
lacks() { grep -qF -- "$2" <<<"$1" && echo 1 || echo 0; }
# section NAME [KERNEL [OUT]] -- the report of one scenario in a run's output.
section() {
    awk -v h="vm[${2:-bookworm}]: scenario $1" '$0 == h { on = 1; next } /^vm[:[]/ { on = 0 } on' "${3:-$tmp/out}"
}
boots() { cat "${2:-$tmp/state}/$1.count" 2>/dev/null || echo 0; }

# The runs below keep run.sh's stderr for their checks, so on a fresh machine the
# kernel downloads would be silent there: fetch both kernels first, in the open
# (a no-op when they are cached).
echo "selftest: fetching the bookworm and trixie-arm64 kernels (cached after the first run)"
KERNEL_SUITE=bookworm KERNEL_ARCH=amd64 "$repo_root/scripts/fetch-kernel.sh" >/dev/null
KERNEL_SUITE=trixie KERNEL_ARCH=arm64 "$repo_root/scripts/fetch-kernel.sh" >/dev/null

echo "selftest: running scripts/vm/run.sh with a fake QEMU (stall timeout 3 s)"
rc=0
PATH="$tmp/bin:$PATH" FAKE_QEMU_STATE="$tmp/state" VM_LOG_DIR="$tmp/logs" VM_LOAD_FACTOR=1 \
    "$repo_root/scripts/vm/run.sh" --no-build --kernel bookworm --stall-timeout 3 -j 4 \
    "$tmp"/scenarios/*.sh >"$tmp/out" 2>"$tmp/err" || rc=$?
check "run.sh fails (two scenarios must fail)" "$([[ $rc != 0 ]]; echo $?)"

out="$(section slow-boot)"
check "slow-boot: booted once" "$([[ $(boots slow-boot) == 1 ]]; echo $?)"
check "slow-boot: passes" "$(has "$out" "PASS  fake step")"
check "slow-boot: no retry" "$(lacks "$out" RETRY)"
check "slow-boot: no failure" "$(lacks "$out" FAIL)"

out="$(section stall-once)"
check "stall-once: booted exactly twice" "$([[ $(boots stall-once) == 2 ]]; echo $?)"
check "stall-once: report says it was retried" \
    "$(has "$out" "RETRY no progress for 3 s before the scenario started; booted again once")"
check "stall-once: passes on the second boot" "$(has "$out" "PASS  fake step")"
check "stall-once: no failure" "$(lacks "$out" FAIL)"
check "stall-once: retry announced on stderr" \
    "$(has "$(cat "$tmp/err")" "vm[bookworm]: stall-once: no progress for 3 s before the scenario started; retrying once")"
check "stall-once: stalled boot's console kept" "$([[ -f $tmp/logs/bookworm/stall-once.stalled.log ]]; echo $?)"

out="$(section stall-always)"
check "stall-always: booted exactly twice" "$([[ $(boots stall-always) == 2 ]]; echo $?)"
check "stall-always: fails as stalled after the retry" \
    "$(has "$out" "FAIL  stalled: no progress for 3 s before the scenario started, again after one retry")"

out="$(section stall-after-start)"
check "stall-after-start: booted once" "$([[ $(boots stall-after-start) == 1 ]]; echo $?)"
check "stall-after-start: no retry" "$(lacks "$out" RETRY)"
check "stall-after-start: fails on its timeout" "$(has "$out" "FAIL  timeout: no end after 8 s")"

all="$(cat "$tmp/out")"
check "summary names the retried boots" \
    "$(has "$all" "vm: RETRIED 2 boot(s) that stalled before the scenario started: bookworm/stall-always bookworm/stall-once")"
check "per-kernel total" "$(has "$all" "vm[bookworm]: 3 passed, 3 failed")"
check "final total" "$([[ $(tail -n 1 "$tmp/out") == "vm: 3 passed, 3 failed" ]]; echo $?)"

echo "selftest: the same watchdog on the arm64 kernel (timeouts doubled: stall 6 s, hard 16 s)"
mkdir -p "$tmp/state-arm64"
rc=0
PATH="$tmp/bin:$PATH" FAKE_QEMU_STATE="$tmp/state-arm64" VM_LOG_DIR="$tmp/logs" VM_LOAD_FACTOR=1 \
    "$repo_root/scripts/vm/run.sh" --no-build --kernel trixie-arm64 --stall-timeout 3 -j 2 \
    "$tmp"/scenarios/stall-once.sh "$tmp"/scenarios/stall-after-start.sh >"$tmp/out-arm64" 2>"$tmp/err-arm64" || rc=$?
check "arm64: run.sh fails (stall-after-start must fail)" "$([[ $rc != 0 ]]; echo $?)"
out="$(section stall-once trixie-arm64 "$tmp/out-arm64")"
check "arm64 stall-once: booted exactly twice" "$([[ $(boots stall-once "$tmp/state-arm64") == 2 ]]; echo $?)"
check "arm64 stall-once: retried after the doubled stall bound" \
    "$(has "$out" "RETRY no progress for 6 s before the scenario started; booted again once")"
check "arm64 stall-once: passes on the second boot" "$(has "$out" "PASS  fake step")"
check "arm64 stall-once: no failure" "$(lacks "$out" FAIL)"
out="$(section stall-after-start trixie-arm64 "$tmp/out-arm64")"
check "arm64 stall-after-start: booted once" "$([[ $(boots stall-after-start "$tmp/state-arm64") == 1 ]]; echo $?)"
check "arm64 stall-after-start: fails on its doubled timeout" "$(has "$out" "FAIL  timeout: no end after 16 s")"
check "arm64 per-kernel total" "$(has "$(cat "$tmp/out-arm64")" "vm[trixie-arm64]: 2 passed, 1 failed")"
check "arm64: the guest is qemu-system-aarch64 with an SMMUv3" \
    "$(grep -q '^# qemu-system-aarch64 -machine virt,accel=tcg,gic-version=3,iommu=smmuv3 ' "$tmp/logs/trixie-arm64/stall-once.log"; echo $?)"

echo "selftest: the load factor multiplies the bounds too (VM_LOAD_FACTOR=2: stall 6 s); a bad one is refused"
mkdir -p "$tmp/state-load"
rc=0
PATH="$tmp/bin:$PATH" FAKE_QEMU_STATE="$tmp/state-load" VM_LOG_DIR="$tmp/logs-load" VM_LOAD_FACTOR=2 \
    "$repo_root/scripts/vm/run.sh" --no-build --kernel bookworm --stall-timeout 3 \
    "$tmp"/scenarios/stall-once.sh >"$tmp/out-load" 2>"$tmp/err-load" || rc=$?
check "load: run.sh passes" "$([[ $rc == 0 ]]; echo $?)"
check "load: the factor is announced" \
    "$(has "$(cat "$tmp/err-load")" "timeouts times 2 for the machine's load (VM_LOAD_FACTOR)")"
check "load: stall-once retried after the doubled stall bound" \
    "$(has "$(section stall-once bookworm "$tmp/out-load")" "RETRY no progress for 6 s before the scenario started; booted again once")"
rc=0
VM_LOAD_FACTOR=0 "$repo_root/scripts/vm/run.sh" --no-build --kernel bookworm "$tmp"/scenarios/stall-once.sh \
    >/dev/null 2>"$tmp/err-bad" || rc=$?
check "load: VM_LOAD_FACTOR=0 is refused, naming it" \
    "$([[ $rc != 0 ]] && grep -q "VM_LOAD_FACTOR wants a positive number, got '0'" "$tmp/err-bad"; echo $?)"

if ((failures)); then
    # The run's own output, to see what went wrong (it shows expected FAIL
    # lines too, so it is only printed when a check failed).
    echo "selftest: output of run.sh:"
    sed 's/^/  | /' "$tmp/out" "$tmp/err" "$tmp/out-arm64" "$tmp/err-arm64" "$tmp/out-load" "$tmp/err-load"
    echo "selftest: $failures check(s) failed"
    exit 1
fi
echo "selftest: all checks passed"
