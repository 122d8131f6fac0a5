#!/usr/bin/env bash
# Run VM test bed scenarios on a real kernel under QEMU (TCG).
#
# Usage: scripts/vm/run.sh [--no-build] [--keep-logs] [-j N] [--timeout S]
#                          [--kernel LIST] [--stall-timeout S] [SCENARIO...]
#
#   SCENARIO     a name in tests/vm/scenarios/ (with or without .sh) or a
#                path to a scenario file; default: every
#                tests/vm/scenarios/*.sh
#   --no-build   do not build the static binaries; use those listed by the
#                last build (target/<arch>-unknown-linux-gnu/<VM_PROFILE>/
#                static-bins.list), which may be stale
#   --keep-logs  keep console logs of earlier runs in target/vm-logs/ (by
#                default the directory of each kernel run, target/vm-logs/
#                <kernel>/, is emptied first; other kernels' logs, e.g.
#                of an earlier run on x86 kernels, stay) and keep the
#                assembled initramfs images in target/vm-work/
#   -j N         boot up to N VMs at once (default: VM_JOBS or 2)
#   --timeout S  hard per-scenario timeout in seconds (default: VM_TIMEOUT or
#                240; a scenario header may set its own)
#   --kernel LIST  Debian kernels to run every scenario on, comma-separated
#                suites: bookworm (6.1), trixie (6.12), or "all" for both
#                (default: VM_KERNEL or bookworm). A suite with "-arm64"
#                (trixie-arm64) boots that suite's arm64 kernel in
#                qemu-system-aarch64 (virt machine, emulated SMMUv3) with
#                aarch64 binaries (cross-built) and an arm64 userland; its
#                timeouts are VM_ARM64_TIMEOUT_FACTOR (default 2) times the
#                x86 ones. "iommufd" is the bed's own x86 kernel, built
#                from Debian's trixie source by scripts/build-kernel.sh
#                (cached) with IOMMUFD, VFIO_DEVICE_CDEV and the
#                virtio_vfio_pci variant driver, which Debian's kernels
#                lack; its guests also get a modern virtio-net device
#                (VIRTIO_NIC) that the variant driver matches
#   --stall-timeout S  a guest whose console shows no new output for S
#                seconds before its scenario started is killed and booted
#                again, once (default: VM_STALL_TIMEOUT or 90); a second
#                stall, or any stall after the scenario started, fails
#
# Every timeout is also multiplied by a load factor, measured before the first
# boot (1 on an idle machine, 3 on two cores beside two busy processes; see
# measure_load_factor) or set by VM_LOAD_FACTOR.
#
# VM_LOG_DIR moves the console logs elsewhere (default target/vm-logs).
#
# Each scenario's serial console goes to target/vm-logs/<kernel>/<scenario>.log.
# Per kernel a line "vm[<kernel>]: N passed, N failed" sums its steps; the
# last line of output is "vm: N passed, N failed" over all kernels. The exit
# status is non-zero when any step failed, a scenario timed out, stalled twice
# or ended without its end marker, or no step ran at all.
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
kernel_list="${VM_KERNEL:-bookworm}"
stall_timeout="${VM_STALL_TIMEOUT:-90}"
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
        --kernel) kernel_list="${2:?--kernel needs a list}"; shift ;;
        --kernel=*) kernel_list="${1#--kernel=}" ;;
        --stall-timeout) stall_timeout="${2:?--stall-timeout needs seconds}"; shift ;;
        --stall-timeout=*) stall_timeout="${1#--stall-timeout=}" ;;
        -h | --help) usage; exit 0 ;;
        --) shift; scenario_args+=("$@"); break ;;
        -*) vm_die "unknown option $1 (see --help)" ;;
        *) scenario_args+=("$1") ;;
    esac
    shift
done
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || vm_die "-j wants a positive number, got '$jobs'"
[[ "$default_timeout" =~ ^[1-9][0-9]*$ ]] || vm_die "--timeout wants seconds, got '$default_timeout'"
[[ "$stall_timeout" =~ ^[1-9][0-9]*$ ]] || vm_die "--stall-timeout wants seconds, got '$stall_timeout'"
[[ "$kernel_list" == all ]] && kernel_list=bookworm,trixie
arm64_factor="${VM_ARM64_TIMEOUT_FACTOR:-2}"
[[ "$arm64_factor" =~ ^[1-9][0-9]*$ ]] || vm_die "VM_ARM64_TIMEOUT_FACTOR wants a positive number, got '$arm64_factor'"
[[ -z "${VM_LOAD_FACTOR:-}" || "$VM_LOAD_FACTOR" =~ ^[1-9][0-9]*$ ]] ||
    vm_die "VM_LOAD_FACTOR wants a positive number, got '$VM_LOAD_FACTOR'"
kernels=()
# Per kernel name: Debian suite, Debian architecture, rust arch, timeout factor.
declare -A k_suite=() k_arch=() k_factor=() arch_bins=()
IFS=, read -r -a kernel_args <<<"$kernel_list"
for k in "${kernel_args[@]}"; do
    [[ "$k" =~ ^[a-z][a-z0-9-]*$ ]] || vm_die "--kernel wants Debian suite names such as bookworm,trixie,trixie-arm64; got '$k'"
    for m in "${kernels[@]}"; do
        [[ "$m" != "$k" ]] || vm_die "kernel $k given twice"
    done
    kernels+=("$k")
    case "$k" in
        *-arm64) k_suite[$k]="${k%-arm64}" k_arch[$k]=aarch64 k_factor[$k]=$arm64_factor ;;
        *-amd64) k_suite[$k]="${k%-amd64}" k_arch[$k]=x86_64 k_factor[$k]=1 ;;
        iommufd) k_suite[$k]=iommufd k_arch[$k]=x86_64 k_factor[$k]=1 ;;
        *) k_suite[$k]="$k" k_arch[$k]=x86_64 k_factor[$k]=1 ;;
    esac
    arch_bins[${k_arch[$k]}]=""
done
((${#kernels[@]})) || vm_die "--kernel names no kernel"

scenario_dir="$repo_root/tests/vm/scenarios"
log_dir="${VM_LOG_DIR:-$repo_root/target/vm-logs}"
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
[[ -v "arch_bins[aarch64]" ]] && vm_ensure_packages "${VM_HOST_PACKAGES_ARM64[@]}"

# ---- static binaries ----------------------------------------------------------
# One static build per architecture in use; arch_bins[ARCH] holds the binary
# paths separated by newlines. Cargo profile `testbed` (VM_PROFILE): release
# settings at opt-level 1 without LTO, so a cold build takes minutes less;
# `release` tests the image's exact binaries; `demo` is unoptimised. VM_PACKAGES
# (space-separated) builds only those packages' binaries.
profile="${VM_PROFILE:-testbed}"
for arch in x86_64 aarch64; do
    [[ -v "arch_bins[$arch]" ]] || continue
    bin_list="$repo_root/target/$arch-unknown-linux-gnu/$profile/static-bins.list"
    if ((build)); then
        if [[ "$arch" == x86_64 ]]; then
            vm_log "building static binaries"
        else
            vm_log "building static binaries for $arch"
        fi
        if ! "$repo_root/scripts/build-static.sh" --arch "$arch" --profile "$profile" \
            --packages "${VM_PACKAGES:-}" >/dev/null; then
            vm_log "warning: the static build failed; only the binaries it did build go into the guest"
        fi
    fi
    names=()
    if [[ -f "$bin_list" ]]; then
        while read -r b; do
            if [[ -n "$b" && -f "$b" ]]; then
                arch_bins[$arch]+="$b"$'\n'
                names+=("$(basename "$b")")
            fi
        done <"$bin_list"
    fi
    if [[ "$arch" == x86_64 ]]; then
        vm_log "project binaries in the guest: ${names[*]:-(none)}"
    else
        vm_log "project binaries in the $arch guest: ${names[*]:-(none)}"
    fi
done

# ---- kernels and base initramfs images --------------------------------------------
mkdir -p "$work_dir" "$log_dir"
if ((keep_logs == 0)); then
    for k in "${kernels[@]}"; do rm -rf "${log_dir:?}/$k"; done
fi
run_dir="$(mktemp -d "$work_dir/run.XXXXXX")"
cleanup() {
    local p f
    # Stop the VMs still running (each "timeout" passes the signal to QEMU).
    for f in "$run_dir"/*/*.pid; do
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

# ---- the guest's programs -----------------------------------------------------
# Every guest's base initramfs carries the shipped binaries and the two stand-ins
# the scenarios drive, without their symbols: the guest needs none, and under TCG
# each megabyte of initramfs is copied and unpacked again at every boot (the whole
# build, host tools and failpoints variants with their symbols, was 114 MB, and
# the kernel's move of that RAM disk alone took 0.6 s). A failpoints variant goes only
# into the archive of a scenario that names it (`# vm: needs=`); the build's host
# tools (benchmarks, real-k8s) stay out. guest_dir[ARCH] holds the stripped
# programs, base_bins[ARCH] those of the base image, separated by newlines.
guest_programs=" vfio-manager sandbox-validator sandbox-device-plugin sandbox-dra-driver kubelet-peer fake-apiserver "
declare -A guest_dir=() base_bins=()
for arch in "${!arch_bins[@]}"; do
    strip_tool="strip"
    [[ "$arch" == x86_64 ]] || strip_tool="$arch-linux-gnu-strip"
    guest_dir[$arch]="$run_dir/bin-$arch"
    base_bins[$arch]=""
    mkdir -p "${guest_dir[$arch]}"
    while read -r b; do
        [[ -n "$b" ]] || continue
        n="$(basename "$b")"
        [[ "$guest_programs" == *" ${n%-failpoints} "* ]] || continue
        if ! "$strip_tool" -o "${guest_dir[$arch]}/$n" "$b" 2>/dev/null; then
            vm_log "warning: $strip_tool could not strip $n; the guest gets it with its symbols"
            cp "$b" "${guest_dir[$arch]}/$n"
        fi
        [[ "$n" == *-failpoints ]] || base_bins[$arch]+="${guest_dir[$arch]}/$n"$'\n'
    done <<<"${arch_bins[$arch]}"
done

declare -A k_version=() k_boot=() k_base=()
# prepare_kernel NAME -- fetch the kernel NAME (suite, architecture) and
# assemble its base initramfs (fetch-kernel.sh's assignments stay local to
# this function).
prepare_kernel() {
    local k="$1" t0 env_text deb_arch=amd64 binaries=()
    # shellcheck disable=SC2034  # assigned by the eval below; only some are used
    local KERNEL_PKG KERNEL_PKG_VERSION KERNEL_VERSION KERNEL_IMAGE KERNEL_VMLINUX \
        KERNEL_PVH KERNEL_MODULES KERNEL_CONFIG KERNEL_SUITE KERNEL_ARCH \
        KERNEL_BUSYBOX KERNEL_KMOD KERNEL_USERLAND
    [[ "${k_arch[$k]}" == aarch64 ]] && deb_arch=arm64
    if [[ "$k" == iommufd ]]; then
        env_text="$("$repo_root/scripts/build-kernel.sh")" || vm_die "cannot build the $k kernel"
    else
        env_text="$(KERNEL_SUITE="${k_suite[$k]}" KERNEL_ARCH="$deb_arch" "$repo_root/scripts/fetch-kernel.sh")" ||
            vm_die "cannot fetch the $k kernel"
    fi
    eval "$env_text"
    k_version[$k]="$KERNEL_VERSION"
    # Boot the uncompressed vmlinux through its PVH entry when possible: the
    # bzImage would decompress itself (XZ) under TCG, which costs seconds.
    k_boot[$k]="$KERNEL_IMAGE"
    if [[ "${VM_KERNEL_BOOT:-auto}" != bzimage && "$KERNEL_PVH" == 1 && -n "$KERNEL_VMLINUX" ]]; then
        k_boot[$k]="$KERNEL_VMLINUX"
    fi
    mkdir -p "$run_dir/$k" "$log_dir/$k"
    k_base[$k]="$run_dir/$k/base.cpio"
    t0=$(date +%s.%N)
    mapfile -t binaries < <(printf '%s' "${base_bins[${k_arch[$k]}]}")
    VM_MODULES_EXTRA="$(vm_extra_modules "$k")" KERNEL_VERSION="$KERNEL_VERSION" KERNEL_MODULES="$KERNEL_MODULES" \
        KERNEL_BUSYBOX="$KERNEL_BUSYBOX" KERNEL_KMOD="$KERNEL_KMOD" KERNEL_USERLAND="$KERNEL_USERLAND" \
        "$here/initramfs.sh" "${k_base[$k]}" "${binaries[@]}"
    vm_log "[$k] kernel $KERNEL_VERSION, booting $(basename "${k_boot[$k]}"), base initramfs in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
}
for k in "${kernels[@]}"; do
    prepare_kernel "$k"
done

# The guest's QEMU (scripts/vm/fetch-qemu.sh), per architecture, only when a
# scenario asks for it (`# vm: needs=qemu`): the archive is appended to that
# scenario's initramfs alone. guest_qemu[ARCH] is its path.
declare -A guest_qemu=()
if grep -lqE '^#[[:space:]]*vm:.*needs=([^ ]*,)?qemu(,|[[:space:]]|$)' "${scenarios[@]}"; then
    for arch in "${!arch_bins[@]}"; do
        deb_arch=amd64
        [[ "$arch" == aarch64 ]] && deb_arch=arm64
        if env_text="$("$here/fetch-qemu.sh" --arch "$deb_arch")"; then
            eval "$env_text"
            guest_qemu[$arch]="$GUEST_QEMU_CPIO"
            vm_log "guest QEMU for $arch: $GUEST_QEMU_VERSION, $(du -h "$GUEST_QEMU_CPIO" | cut -f1) archive"
        else
            vm_log "warning: no guest QEMU for $arch; scenarios that need it fail"
        fi
    done
fi

# ---- per-scenario run ---------------------------------------------------------------

# has_binary ARCH NAME -- true when NAME is one of the guest's programs that the
# static build for ARCH produced.
has_binary() {
    [[ -f "${guest_dir[$1]}/$2" ]]
}

# boot_vm TIMEOUT LOG NAME PIDFILE QEMU... -- run QEMU under the hard
# TIMEOUT with the serial console appended to LOG. Until the guest prints
# "TESTBED START <NAME>:" (its scenario begins), the log must grow at least
# every $stall_timeout seconds; otherwise QEMU is killed. Sets boot_rc (the
# exit status of timeout/QEMU) and boot_stalled (1 when killed for no
# progress).
boot_vm() {
    local limit="$1" log="$2" name="$3" pidfile="$4" size last=-1 quiet_since tpid
    shift 4
    boot_rc=0
    boot_stalled=0
    timeout --kill-after=10 "$limit" "$@" </dev/null >>"$log" 2>&1 &
    tpid=$!
    echo "$tpid" >"$pidfile"
    quiet_since=$SECONDS
    # bash reaps the child when it exits, so kill -0 fails from then on.
    while kill -0 "$tpid" 2>/dev/null; do
        grep -q "TESTBED START $name:" "$log" && break
        size=$(stat -c %s "$log")
        if ((size != last)); then
            last=$size
            quiet_since=$SECONDS
        elif ((SECONDS - quiet_since >= stall_timeout)); then
            boot_stalled=1
            kill "$tpid" 2>/dev/null || true
            break
        fi
        sleep 1
    done
    wait "$tpid" || boot_rc=$?
    rm -f "$pidfile"
}

# run_scenario KERNEL FILE -- boot one VM with KERNEL; writes
# $run_dir/<kernel>/<name>.report (text for the console) and
# $run_dir/<kernel>/<name>.counts ("PASSED FAILED WALL_SECONDS").
run_scenario() {
    local kernel="$1" file="$2" name opt iommu=1 timeout="$default_timeout" mem=1G
    local extra_cmdline=() needs=() errors=()
    name="$(basename "$file" .sh)"
    local kdir="$run_dir/$kernel"
    local report="$kdir/$name.report" log="$log_dir/$kernel/$name.log"
    local sdir="$kdir/$name.d"

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
    local b qemu_cpio=""
    for b in "${needs[@]}"; do
        if [[ "$b" == qemu ]]; then
            qemu_cpio="${guest_qemu[${k_arch[$kernel]}]:-}"
            [[ -n "$qemu_cpio" ]] || errors+=("needs the guest's QEMU, which scripts/vm/fetch-qemu.sh did not provide")
            continue
        fi
        has_binary "${k_arch[$kernel]}" "$b" ||
            errors+=("needs project binary '$b', which was not built or is not one of the guest's programs")
    done
    if ((${#errors[@]})); then
        printf 'scenario not started: %s\n' "${errors[@]}" >"$log"
        {
            printf '  FAIL  %s\n' "${errors[@]/#/setup: }"
            printf '  scenario not started\n'
        } >"$report"
        echo "0 ${#errors[@]} 0" >"$kdir/$name.counts"
        return 0
    fi

    # An emulated aarch64 guest runs slower under TCG, and every guest on a
    # loaded machine: scale its timeouts. The local stall_timeout is the one
    # boot_vm and the report below see.
    local factor=$((k_factor[$kernel] * load_factor))
    local stall_timeout=$((stall_timeout * factor))
    [[ "$timeout" =~ ^[1-9][0-9]*$ ]] && timeout=$((timeout * factor))

    # Per-scenario archive: /scenario.sh and /testbed.env.
    local guest_timeout=$((timeout > 40 ? timeout - 20 : timeout / 2))
    mkdir -p "$sdir"
    cp "$file" "$sdir/scenario.sh"
    {
        printf 'SCENARIO=%s\n' "$name"
        printf 'CARD_FN0=%s\nCARD_FN1=%s\nSOLO_NIC=%s\n' "$VM_CARD_FN0" "$VM_CARD_FN1" "$VM_SOLO_NIC"
        printf 'NVME_PF=%s\nNVME_VF0=%s\nNVME_VF1=%s\n' "$VM_NVME_PF" "$VM_NVME_VF0" "$VM_NVME_VF1"
        printf 'GPU_FN0=%s\nGPU_AUDIO=%s\n' "$VM_GPU_FN0" "$VM_GPU_AUDIO"
        # The variant-driver device exists on the iommufd kernel only.
        [[ "$kernel" == iommufd ]] && printf 'VIRTIO_NIC=%s\n' "$VM_VIRTIO_NIC"
        printf 'TESTBED_KERNEL=%s\n' "$kernel"
        printf 'TESTBED_IOMMU=%s\nTESTBED_GUEST_TIMEOUT=%s\n' "$iommu" "$guest_timeout"
    } >"$sdir/testbed.env"
    # The failpoints variants it names, which the base image leaves out.
    local files=(scenario.sh testbed.env)
    for b in "${needs[@]}"; do
        [[ "$b" == *-failpoints ]] || continue
        mkdir -p "$sdir/bin"
        cp "${guest_dir[${k_arch[$kernel]}]}/$b" "$sdir/bin/$b"
        files+=("bin/$b")
    done
    (cd "$sdir" && printf '%s\n' "${files[@]}" |
        cpio -o -H newc -R 0:0 --quiet) >"$kdir/$name.cpio"
    cat "${k_base[$kernel]}" ${qemu_cpio:+"$qemu_cpio"} "$kdir/$name.cpio" >"$kdir/$name.initrd"

    local cmdline qemu=()
    if [[ "${k_arch[$kernel]}" == aarch64 ]]; then
        # The virt machine's PL011 is the console. Its SMMUv3 (iommu=smmuv3
        # in -machine) is built into Debian's arm64 kernel, so it is up
        # before the PCI devices probe; iommu.passthrough=1 is the
        # counterpart of iommu=pt: identity domains for the native drivers,
        # translated ones for vfio.
        # pci=config_acs: Linux enables ACS on a port only when an IOMMU
        # driver asked for it (pci_request_acs) before the port was
        # enumerated. ACPI's IORT (real arm64 servers) asks early; with a
        # devicetree SMMU (virt with -kernel) the request comes with the
        # first driver probe, after the root ports were set up, so their ACS
        # stays off and every device behind them shares one group with its
        # port. config_acs (Linux 6.11+) sets Source Validation, Request and
        # Completion Redirect and Upstream Forwarding on QEMU's root ports
        # (1b36:000c), as the kernel would, giving the x86 grouping.
        cmdline="console=ttyAMA0 panic=-1 quiet cryptomgr.notests"
        ((iommu)) && cmdline+=" iommu.passthrough=1 pci=config_acs=111x1@pci:1b36:000c"
        mapfile -t qemu < <(vm_machine_args_arm64 "$iommu" "$mem")
    else
        # no_timer_check: under TCG on a loaded host the kernel's early check that
        # the 8254 timer reaches the IO-APIC can stall the boot ("MP-BIOS bug:
        # 8254 timer not connected to IO-APIC").
        cmdline="console=ttyS0 panic=-1 quiet cryptomgr.notests no_timer_check"
        if ((iommu)); then
            cmdline+=" intel_iommu=on iommu=pt"
        fi
        # shellcheck disable=SC2054  # commas belong to QEMU option values
        qemu=(
            qemu-system-x86_64
            -machine q35,accel=tcg -cpu max -m "$mem" -smp 1
            -nodefaults -no-user-config -display none -serial stdio -no-reboot
        )
    fi
    ((${#extra_cmdline[@]})) && cmdline+=" ${extra_cmdline[*]}"
    mapfile -t -O "${#qemu[@]}" qemu < <(vm_device_args "$iommu" "${k_arch[$kernel]}" "$kernel")
    qemu+=(-kernel "${k_boot[$kernel]}" -initrd "$kdir/$name.initrd" -append "$cmdline")
    local a
    for a in "${qemu[@]}"; do
        # Quote only what needs it, so the line can be pasted into a shell.
        if [[ "$a" =~ ^[A-Za-z0-9_./:=,@+-]+$ ]]; then printf '%s ' "$a"; else printf '%q ' "$a"; fi
    done >"$kdir/$name.cmd"

    local start end retry_note="" stalled_log="${log%.log}.stalled.log"
    start=$(date +%s.%N)
    printf '# %s\n' "$(cat "$kdir/$name.cmd")" >"$log"
    boot_vm "$timeout" "$log" "$name" "$kdir/$name.pid" "${qemu[@]}"
    if ((boot_stalled)); then
        # A stall before the scenario started is the boot, not the code under
        # test: boot once more, and say so. Never a third time.
        mv "$log" "$stalled_log"
        retry_note="no progress for $stall_timeout s before the scenario started; booted again once (console of the stalled boot: $stalled_log)"
        printf 'vm[%s]: %s: no progress for %s s before the scenario started; retrying once\n' \
            "$kernel" "$name" "$stall_timeout" >&2
        echo "$kernel/$name" >"$kdir/$name.retried"
        printf '# %s\n' "$(cat "$kdir/$name.cmd")" >"$log"
        boot_vm "$timeout" "$log" "$name" "$kdir/$name.pid" "${qemu[@]}"
    fi
    end=$(date +%s.%N)

    # Parse the console log. Lines may carry \r from the serial console.
    tr -d '\r' <"$log" | awk -v name="$name" -v rc="$boot_rc" -v timeout="$timeout" \
        -v stalled="$boot_stalled" -v stall_timeout="$stall_timeout" -v retry_note="$retry_note" \
        -v wall="$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')" \
        -v counts="$kdir/$name.counts" '
        function upt(line,   m) {
            if (match(line, /uptime=[0-9.]+/)) return substr(line, RSTART + 7, RLENGTH - 7)
            return ""
        }
        BEGIN { if (retry_note != "") out = sprintf("  RETRY %s\n", retry_note) }
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
            if (stalled) {
                extra++
                out = out sprintf("  FAIL  stalled: no progress for %s s before the scenario started, %s; QEMU killed\n", \
                    stall_timeout, retry_note != "" ? "again after one retry" : "no retry left")
            } else if (rc == 124 || rc == 137) {
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
            printf "%d %d %s\n", passed, failed + extra, wall > counts
        }' >"$report"
}

# ---- schedule -----------------------------------------------------------------------
total_passed=0
total_failed=0
declare -A pid_job=() k_passed=() k_failed=() k_wall=() k_count=()
for k in "${kernels[@]}"; do
    k_passed[$k]=0 k_failed[$k]=0 k_wall[$k]=0 k_count[$k]=0
done

# finish_one KERNEL NAME -- print the report of one scenario run and count it.
finish_one() {
    local k="$1" name="$2" p=0 f=1 w=0 log="$log_dir/$1/$2.log"
    echo "vm[$k]: scenario $name"
    if [[ -f "$run_dir/$k/$name.report" && -f "$run_dir/$k/$name.counts" ]]; then
        cat "$run_dir/$k/$name.report"
        read -r p f w <"$run_dir/$k/$name.counts"
    else
        echo "  FAIL  harness: the scenario run produced no report"
    fi
    total_passed=$((total_passed + p))
    total_failed=$((total_failed + f))
    k_passed[$k]=$((k_passed[$k] + p))
    k_failed[$k]=$((k_failed[$k] + f))
    k_wall[$k]=$(awk -v a="${k_wall[$k]}" -v b="${w:-0}" 'BEGIN { printf "%.1f", a + b }')
    k_count[$k]=$((k_count[$k] + 1))
    if ((f)); then
        echo "  log: $log (last lines below)"
        if [[ -f "$log" ]]; then
            tr -d '\r' <"$log" | grep -v '^# qemu-system' | tail -n 25 | sed 's/^/  | /'
        fi
    else
        echo "  log: $log"
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

# ---- load --------------------------------------------------------------------
# A guest under TCG takes as long as the CPU time it gets, so beside other busy
# processes every timeout must grow as much, or a slow guest is reported as a
# hung one. $jobs busy loops (one per VM at a time) run side by side for a
# second; the load factor is that second over the CPU time the slowest of them
# got, times 0.9, rounded up, at most 4: 1 on an idle machine with a core per
# VM, 3 on two cores beside two busy processes. VM_LOAD_FACTOR sets it.
measure_load_factor() {
    local dir i ticks min=""
    dir="$(mktemp -d)"
    for ((i = 0; i < jobs; i++)); do
        # shellcheck disable=SC2016 # expanded by the busy loop's own shell
        bash -c 'end=$((${EPOCHREALTIME/./} + 1000000))
            while ((${EPOCHREALTIME/./} < end)); do :; done
            read -r -a s </proc/self/stat
            echo $((s[13] + s[14]))' >"$dir/$i" &
    done
    wait
    for ((i = 0; i < jobs; i++)); do
        ticks="$(cat "$dir/$i")"
        if [[ -z "$min" ]] || ((ticks < min)); then min="$ticks"; fi
    done
    rm -rf "$dir"
    local hz
    hz="$(getconf CLK_TCK)"
    if ((min <= 0)); then
        echo 4
    else
        i=$(((9 * hz + 10 * min - 1) / (10 * min)))
        echo $((i < 1 ? 1 : i > 4 ? 4 : i))
    fi
}
if [[ -n "${VM_LOAD_FACTOR:-}" ]]; then
    load_factor="$VM_LOAD_FACTOR"
    load_note="VM_LOAD_FACTOR"
else
    load_factor="$(measure_load_factor)"
    load_note="measured: $jobs busy loops side by side"
fi

kernel_desc=()
for k in "${kernels[@]}"; do kernel_desc+=("$k (${k_version[$k]})"); done
vm_log "running ${#scenarios[@]} scenario(s) on ${#kernels[@]} kernel(s), up to $jobs at a time: ${kernel_desc[*]}"
vm_log "timeouts times $load_factor for the machine's load ($load_note)"
run_t0=$(date +%s.%N)
# reap_while_more_than N -- collect finished scenarios until at most N run.
reap_while_more_than() {
    local done_pid
    while ((${#pid_job[@]} > $1)); do
        done_pid=""
        wait -n -p done_pid "${!pid_job[@]}" || true
        [[ -n "$done_pid" ]] || continue
        # "<kernel> <name>": two words by construction.
        # shellcheck disable=SC2086
        finish_one ${pid_job[$done_pid]}
        unset "pid_job[$done_pid]"
    done
}
for k in "${kernels[@]}"; do
    for f in "${scenarios[@]}"; do
        reap_while_more_than $((jobs - 1))
        name="$(basename "$f" .sh)"
        vm_log "[$k] starting $name"
        run_scenario "$k" "$f" &
        pid_job[$!]="$k $name"
    done
done
reap_while_more_than 0

vm_log "all scenarios done in $(awk -v a="$run_t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
retried=()
for k in "${kernels[@]}"; do
    for f in "$run_dir/$k"/*.retried; do
        [[ -f "$f" ]] && retried+=("$(cat "$f")")
    done
    echo "vm[$k]: ${k_passed[$k]} passed, ${k_failed[$k]} failed (kernel ${k_version[$k]}, ${k_count[$k]} scenarios, ${k_wall[$k]} s of VM wall time)"
done
if ((${#retried[@]})); then
    echo "vm: RETRIED ${#retried[@]} boot(s) that stalled before the scenario started: ${retried[*]}"
fi
if ((total_passed + total_failed == 0)); then
    total_failed=1
    echo "vm: no step ran"
fi
echo "vm: $total_passed passed, $total_failed failed"
((total_failed == 0))
