#!/usr/bin/env bash
# Run VM test bed scenarios on a real kernel under QEMU (TCG).
#
# Usage: scripts/vm/run.sh [--no-build] [--keep-logs] [-j N] [--timeout S]
#                          [SCENARIO...]
#
#   SCENARIO     a name in tests/vm/scenarios/ (with or without .sh) or a
#                path to a scenario file; default: every
#                tests/vm/scenarios/*.sh
#   --no-build   do not build the static binaries; use those listed by the
#                last build (target/x86_64-unknown-linux-gnu/release/
#                static-bins.list), which may be stale
#   --keep-logs  keep console logs of earlier runs in target/vm-logs/ (by
#                default the directory is emptied first) and keep the
#                assembled initramfs images in target/vm-work/
#   -j N         boot up to N VMs at once (default: VM_JOBS or 2)
#   --timeout S  hard per-scenario timeout in seconds (default: VM_TIMEOUT or
#                240; a scenario header may set its own)
#
# Each scenario's serial console goes to target/vm-logs/<scenario>.log. The
# last line of output is "vm: N passed, N failed" (steps); the exit status is
# non-zero when any step failed, a scenario timed out or ended without its
# end marker, or no step ran at all.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "$here/../.." && pwd)"
# shellcheck source=scripts/vm/common.sh
. "$here/common.sh"
# shellcheck source=scripts/vm/devices.sh
. "$here/devices.sh"

build=1
keep_logs=0
jobs="${VM_JOBS:-2}"
default_timeout="${VM_TIMEOUT:-240}"
scenario_args=()

usage() { sed -n '2,/^set -euo/{/^#/!d;s/^# \{0,1\}//;p}' "$0"; }

while (($#)); do
    case "$1" in
        --no-build) build=0 ;;
        --keep-logs) keep_logs=1 ;;
        -j) jobs="${2:?-j needs a number}"; shift ;;
        -j*) jobs="${1#-j}" ;;
        --jobs=*) jobs="${1#--jobs=}" ;;
        --timeout) default_timeout="${2:?--timeout needs seconds}"; shift ;;
        --timeout=*) default_timeout="${1#--timeout=}" ;;
        -h | --help) usage; exit 0 ;;
        --) shift; scenario_args+=("$@"); break ;;
        -*) vm_die "unknown option $1 (see --help)" ;;
        *) scenario_args+=("$1") ;;
    esac
    shift
done
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || vm_die "-j wants a positive number, got '$jobs'"
[[ "$default_timeout" =~ ^[1-9][0-9]*$ ]] || vm_die "--timeout wants seconds, got '$default_timeout'"

scenario_dir="$repo_root/tests/vm/scenarios"
log_dir="$repo_root/target/vm-logs"
work_dir="$repo_root/target/vm-work"

# ---- scenarios --------------------------------------------------------------
scenarios=()
if ((${#scenario_args[@]} == 0)); then
    for f in "$scenario_dir"/*.sh; do
        [[ -e "$f" ]] && scenarios+=("$f")
    done
    ((${#scenarios[@]})) || vm_die "no scenarios in $scenario_dir"
else
    for s in "${scenario_args[@]}"; do
        if [[ -f "$s" ]]; then
            scenarios+=("$(cd "$(dirname "$s")" && pwd)/$(basename "$s")")
        elif [[ -f "$scenario_dir/${s%.sh}.sh" ]]; then
            scenarios+=("$scenario_dir/${s%.sh}.sh")
        else
            vm_die "no scenario '$s' (looked in $scenario_dir)"
        fi
    done
fi

vm_ensure_packages "${VM_HOST_PACKAGES[@]}"

# ---- static binaries ----------------------------------------------------------
bin_list="$repo_root/target/x86_64-unknown-linux-gnu/release/static-bins.list"
if ((build)); then
    vm_log "building static binaries"
    if ! "$repo_root/scripts/build-static.sh" >/dev/null; then
        vm_log "warning: the static build failed; only the binaries it did build go into the guest"
    fi
fi
binaries=()
if [[ -f "$bin_list" ]]; then
    while read -r b; do
        [[ -n "$b" && -f "$b" ]] && binaries+=("$b")
    done <"$bin_list"
fi
bin_names=()
for b in "${binaries[@]}"; do bin_names+=("$(basename "$b")"); done
vm_log "project binaries in the guest: ${bin_names[*]:-(none)}"

# ---- kernel and base initramfs -----------------------------------------------------
eval "$("$repo_root/scripts/fetch-kernel.sh")"
export KERNEL_VERSION KERNEL_MODULES
# Boot the uncompressed vmlinux through its PVH entry when possible: the
# bzImage would decompress itself (XZ) under TCG, which costs seconds.
kernel="$KERNEL_IMAGE"
if [[ "${VM_KERNEL_BOOT:-auto}" != bzimage && "$KERNEL_PVH" == 1 && -n "$KERNEL_VMLINUX" ]]; then
    kernel="$KERNEL_VMLINUX"
fi
vm_log "kernel $KERNEL_VERSION, booting $(basename "$kernel")"

mkdir -p "$work_dir" "$log_dir"
if ((keep_logs == 0)); then
    rm -f "$log_dir"/*.log
fi
run_dir="$(mktemp -d "$work_dir/run.XXXXXX")"
base_cpio="$run_dir/base.cpio"
t0=$(date +%s.%N)
"$here/initramfs.sh" "$base_cpio" "${binaries[@]}"
vm_log "base initramfs assembled in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"

# ---- per-scenario run ---------------------------------------------------------------
cleanup() {
    local p f
    # Stop the VMs still running (each "timeout" passes the signal to QEMU).
    for f in "$run_dir"/*.pid; do
        [[ -f "$f" ]] || continue
        read -r p <"$f" || continue
        kill "$p" 2>/dev/null || true
    done
    # Let the scenario jobs notice and finish before their files go away.
    wait 2>/dev/null || true
    if ((keep_logs == 0)); then rm -rf "$run_dir"; fi
}
trap cleanup EXIT
trap 'vm_log "interrupted"; exit 130' INT TERM

has_binary() {
    local n
    for n in "${bin_names[@]}"; do [[ "$n" == "$1" ]] && return 0; done
    return 1
}

# run_scenario FILE -- boot one VM; writes $run_dir/<name>.report (text for
# the console) and $run_dir/<name>.counts ("PASSED FAILED").
run_scenario() {
    local file="$1" name opt iommu=1 timeout="$default_timeout" mem=1G
    local extra_cmdline=() needs=() errors=()
    name="$(basename "$file" .sh)"
    local report="$run_dir/$name.report" log="$log_dir/$name.log"
    local sdir="$run_dir/$name.d"

    # Header options: "# vm: opt opt=value ..." lines.
    while read -r opt; do
        case "$opt" in
            no-iommu) iommu=0 ;;
            timeout=*) timeout="${opt#timeout=}" ;;
            mem=*) mem="${opt#mem=}" ;;
            cmdline=*) extra_cmdline+=("${opt#cmdline=}") ;;
            needs=*) IFS=, read -r -a needs <<<"${opt#needs=}" ;;
            *) errors+=("unknown vm option '$opt'") ;;
        esac
    done < <(sed -n 's/^#[[:space:]]*vm:[[:space:]]*//p' "$file" | tr -s ' \t' '\n' | sed '/^$/d')
    [[ "$timeout" =~ ^[1-9][0-9]*$ ]] || errors+=("bad timeout '$timeout'")
    local b
    for b in "${needs[@]}"; do
        has_binary "$b" || errors+=("needs project binary '$b', which was not built")
    done
    if ((${#errors[@]})); then
        printf 'scenario not started: %s\n' "${errors[@]}" >"$log"
        {
            printf '  FAIL  %s\n' "${errors[@]/#/setup: }"
            printf '  scenario not started\n'
        } >"$report"
        echo "0 ${#errors[@]}" >"$run_dir/$name.counts"
        return 0
    fi

    # Per-scenario archive: /scenario.sh and /testbed.env.
    local guest_timeout=$((timeout > 40 ? timeout - 20 : timeout / 2))
    mkdir -p "$sdir"
    cp "$file" "$sdir/scenario.sh"
    {
        printf 'SCENARIO=%s\n' "$name"
        printf 'CARD_FN0=%s\nCARD_FN1=%s\nSOLO_NIC=%s\n' "$VM_CARD_FN0" "$VM_CARD_FN1" "$VM_SOLO_NIC"
        printf 'NVME_PF=%s\nNVME_VF0=%s\nNVME_VF1=%s\n' "$VM_NVME_PF" "$VM_NVME_VF0" "$VM_NVME_VF1"
        printf 'GPU_FN0=%s\nGPU_AUDIO=%s\n' "$VM_GPU_FN0" "$VM_GPU_AUDIO"
        printf 'TESTBED_IOMMU=%s\nTESTBED_GUEST_TIMEOUT=%s\n' "$iommu" "$guest_timeout"
    } >"$sdir/testbed.env"
    (cd "$sdir" && printf '%s\n' scenario.sh testbed.env |
        cpio -o -H newc -R 0:0 --quiet) >"$run_dir/$name.cpio"
    cat "$base_cpio" "$run_dir/$name.cpio" >"$run_dir/$name.initrd"

    local cmdline="console=ttyS0 panic=-1 quiet cryptomgr.notests"
    if ((iommu)); then
        cmdline+=" intel_iommu=on iommu=pt"
    fi
    ((${#extra_cmdline[@]})) && cmdline+=" ${extra_cmdline[*]}"

    # shellcheck disable=SC2054  # commas belong to QEMU option values
    local qemu=(
        qemu-system-x86_64
        -machine q35,accel=tcg -cpu max -m "$mem" -smp 1
        -nodefaults -no-user-config -display none -serial stdio -no-reboot
    )
    mapfile -t -O "${#qemu[@]}" qemu < <(vm_device_args "$iommu")
    qemu+=(-kernel "$kernel" -initrd "$run_dir/$name.initrd" -append "$cmdline")
    local a
    for a in "${qemu[@]}"; do
        # Quote only what needs it, so the line can be pasted into a shell.
        if [[ "$a" =~ ^[A-Za-z0-9_./:=,@+-]+$ ]]; then printf '%s ' "$a"; else printf '%q ' "$a"; fi
    done >"$run_dir/$name.cmd"

    local start end rc=0
    start=$(date +%s.%N)
    {
        printf '# %s\n' "$(cat "$run_dir/$name.cmd")"
    } >"$log"
    timeout --kill-after=10 "$timeout" "${qemu[@]}" </dev/null >>"$log" 2>&1 &
    local tpid=$!
    echo "$tpid" >"$run_dir/$name.pid"
    wait "$tpid" || rc=$?
    rm -f "$run_dir/$name.pid"
    end=$(date +%s.%N)

    # Parse the console log. Lines may carry \r from the serial console.
    tr -d '\r' <"$log" | awk -v name="$name" -v rc="$rc" -v timeout="$timeout" \
        -v wall="$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')" \
        -v counts="$run_dir/$name.counts" '
        function upt(line,   m) {
            if (match(line, /uptime=[0-9.]+/)) return substr(line, RSTART + 7, RLENGTH - 7)
            return ""
        }
        {
            line = $0
            if ((i = index(line, "TESTBED STEP PASS " name ": ")) > 0) {
                passed++; if (summary == "") gpassed++
                out = out sprintf("  PASS  %s\n", substr(line, i + length("TESTBED STEP PASS " name ": ")))
            } else if ((i = index(line, "TESTBED STEP FAIL " name ": ")) > 0) {
                failed++; if (summary == "") gfailed++
                out = out sprintf("  FAIL  %s\n", substr(line, i + length("TESTBED STEP FAIL " name ": ")))
                infail = 1; next
            } else if (index(line, "TESTBED SUMMARY " name ": ") > 0) {
                summary = line
                sp = line; sub(/.*passed=/, "", sp); sub(/ .*/, "", sp)
                sf = line; sub(/.*failed=/, "", sf); sub(/ .*/, "", sf)
            } else if (index(line, "TESTBED READY " name ": ") > 0) {
                ready = upt(line)
            } else if (index(line, "TESTBED END " name ": ") > 0) {
                ended = 1; endt = upt(line)
            } else if ((i = index(line, "TESTBED ABORT " name ": ")) > 0) {
                aborted = substr(line, i + length("TESTBED ABORT " name ": "))
            }
            # Context lines of a failed step: "    | ..."
            if (infail && line ~ /^    \| /) { out = out "        " substr(line, 7) "\n"; next }
            infail = 0
        }
        END {
            extra = 0
            if (rc == 124 || rc == 137) {
                extra++; out = out sprintf("  FAIL  timeout: no end after %s s; QEMU killed\n", timeout)
            } else if (!ended) {
                extra++
                if (aborted != "") out = out sprintf("  FAIL  aborted: %s\n", aborted)
                else out = out sprintf("  FAIL  ended without TESTBED END (QEMU exit %s)\n", rc)
            }
            if (passed + failed == 0) {
                extra++; out = out "  FAIL  no step ran\n"
            }
            # The guest counts the steps of the scenario script; a mismatch
            # means a result line was lost or mangled on the console.
            if (summary != "" && (sp + 0 != gpassed + 0 || sf + 0 != gfailed + 0)) {
                extra++
                out = out sprintf("  FAIL  console garbled: guest counted %s passed/%s failed, host parsed %d/%d\n", sp, sf, gpassed, gfailed)
            }
            if (ended && summary == "") {
                extra++; out = out "  FAIL  no TESTBED SUMMARY line\n"
            }
            timing = sprintf("  time: %s s wall", wall)
            if (ready != "" && endt != "") {
                run = endt - ready
                timing = timing sprintf(" (boot to ready %.1f s, scenario %.1f s; guest uptime at ready %.1f s)", wall - run, run, ready)
            }
            printf "%s%s\n", out, timing
            printf "%d %d\n", passed, failed + extra > counts
        }' >"$report"
}

# ---- schedule -----------------------------------------------------------------------
total_passed=0
total_failed=0
declare -A pid_name=()

finish_one() {
    local name="$1" p=0 f=1
    echo "vm: scenario $name"
    if [[ -f "$run_dir/$name.report" && -f "$run_dir/$name.counts" ]]; then
        cat "$run_dir/$name.report"
        read -r p f <"$run_dir/$name.counts"
    else
        echo "  FAIL  harness: the scenario run produced no report"
    fi
    total_passed=$((total_passed + p))
    total_failed=$((total_failed + f))
    if ((f)); then
        echo "  log: $log_dir/$name.log (last lines below)"
        if [[ -f "$log_dir/$name.log" ]]; then
            tr -d '\r' <"$log_dir/$name.log" | grep -v '^# qemu-system' | tail -n 25 | sed 's/^/  | /'
        fi
    else
        echo "  log: $log_dir/$name.log"
    fi
}

names=()
for f in "${scenarios[@]}"; do
    n="$(basename "$f" .sh)"
    for m in "${names[@]}"; do
        [[ "$m" != "$n" ]] || vm_die "two scenarios named $n"
    done
    names+=("$n")
done

vm_log "running ${#scenarios[@]} scenario(s), up to $jobs at a time, kernel $KERNEL_VERSION"
run_t0=$(date +%s.%N)
# reap_while_more_than N -- collect finished scenarios until at most N run.
reap_while_more_than() {
    local done_pid
    while ((${#pid_name[@]} > $1)); do
        done_pid=""
        wait -n -p done_pid "${!pid_name[@]}" || true
        [[ -n "$done_pid" ]] || continue
        finish_one "${pid_name[$done_pid]}"
        unset "pid_name[$done_pid]"
    done
}
for f in "${scenarios[@]}"; do
    reap_while_more_than $((jobs - 1))
    name="$(basename "$f" .sh)"
    vm_log "starting $name"
    run_scenario "$f" &
    pid_name[$!]="$name"
done
reap_while_more_than 0

vm_log "all scenarios done in $(awk -v a="$run_t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
if ((total_passed + total_failed == 0)); then
    total_failed=1
    echo "vm: no step ran"
fi
echo "vm: $total_passed passed, $total_failed failed"
((total_failed == 0))
