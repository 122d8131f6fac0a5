# Helper library for VM test bed scenarios (busybox ash compatible).
# shellcheck shell=sh
#
# Installed as /lib/testbed.sh in the guest and sourced by /init before it
# sources /scenario.sh, so every function below is available to scenarios.
#
# Result protocol (parsed by scripts/vm/run.sh on the host):
#   TESTBED STEP PASS <scenario>: <step name>
#   TESTBED STEP FAIL <scenario>: <step name>: <reason>
# followed, for failures, by indented context lines ("    | ...").
# A scenario that prints no step counts as failed.
#
# Environment provided by /init: SCENARIO, CARD_FN0, CARD_FN1, CARD_GROUP,
# SOLO_NIC, NVME_PF, NVME_VF0, NVME_VF1, TESTBED_IOMMU (1 or 0).

TB_PASSED=0
TB_FAILED=0
TB_SCENARIO=${SCENARIO:-unknown}
TB_OUT=/tmp/testbed.out
# Number of output lines shown under a failed step.
TB_CONTEXT_LINES=${TB_CONTEXT_LINES:-20}

# tb_begin SCENARIO -- called by /init; prints the step summary on exit.
tb_begin() {
    TB_SCENARIO=$1
    TB_PASSED=0
    TB_FAILED=0
    trap 'tb_summary' EXIT
}

tb_summary() {
    echo "TESTBED SUMMARY $TB_SCENARIO: passed=$TB_PASSED failed=$TB_FAILED"
}

# busybox ash runs its own applets (modprobe, lsmod, ...) before it searches
# PATH. The guest has the real kmod tools in /sbin; these functions make
# scenarios use them. In a child shell (sh -c '...') write /sbin/modprobe.
modprobe() { /sbin/modprobe "$@"; }
insmod() { /sbin/insmod "$@"; }
rmmod() { /sbin/rmmod "$@"; }
lsmod() { /sbin/lsmod "$@"; }
modinfo() { /sbin/modinfo "$@"; }
depmod() { /sbin/depmod "$@"; }

# ---- primitives -------------------------------------------------------------

# pass NAME -- record a passed step.
pass() {
    TB_PASSED=$((TB_PASSED + 1))
    echo "TESTBED STEP PASS $TB_SCENARIO: $1"
    return 0
}

# fail NAME REASON [CONTEXT_FILE] -- record a failed step; the last lines of
# CONTEXT_FILE (if given and not empty) are shown indented below it.
fail() {
    TB_FAILED=$((TB_FAILED + 1))
    echo "TESTBED STEP FAIL $TB_SCENARIO: $1: $2"
    if [ -n "${3:-}" ] && [ -s "$3" ]; then
        tail -n "$TB_CONTEXT_LINES" "$3" | sed 's/^/    | /'
    fi
    return 1
}

# note TEXT... -- a readable separator line in the log (not a step).
note() {
    echo "---- $* ----"
}

# ---- steps ------------------------------------------------------------------

# step NAME -- CMD [ARGS...]
# Runs CMD (a program or shell function); PASS when it exits 0, otherwise
# FAIL with the exit code and the last lines of its output. Returns CMD's
# status, so `step ... || return` works.
step() {
    _tb_name=$1
    shift
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || { fail "$_tb_name" "step: no command given"; return 1; }
    "$@" >"$TB_OUT" 2>&1
    _tb_rc=$?
    if [ "$_tb_rc" -eq 0 ]; then
        pass "$_tb_name"
    else
        fail "$_tb_name" "exit $_tb_rc from: $*" "$TB_OUT"
    fi
    return "$_tb_rc"
}

# expect_fail NAME CODE -- CMD [ARGS...]
# PASS when CMD exits with exactly CODE; CODE may be "nonzero" for any
# failure. A command that succeeds is a FAIL.
expect_fail() {
    _tb_name=$1
    _tb_want=$2
    shift 2
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || { fail "$_tb_name" "expect_fail: no command given"; return 1; }
    "$@" >"$TB_OUT" 2>&1
    _tb_rc=$?
    if [ "$_tb_want" = nonzero ] && [ "$_tb_rc" -ne 0 ]; then
        pass "$_tb_name"
    elif [ "$_tb_rc" = "$_tb_want" ]; then
        pass "$_tb_name"
    else
        fail "$_tb_name" "expected exit $_tb_want, got $_tb_rc from: $*" "$TB_OUT"
    fi
}

# expect_eq NAME ACTUAL EXPECTED
expect_eq() {
    if [ "$2" = "$3" ]; then
        pass "$1"
    else
        fail "$1" "expected '$3', got '$2'"
    fi
}

# expect_ne NAME ACTUAL UNEXPECTED
expect_ne() {
    if [ "$2" != "$3" ]; then
        pass "$1"
    else
        fail "$1" "expected anything but '$3'"
    fi
}

# expect_contains NAME FILE TEXT -- FILE contains the fixed string TEXT.
expect_contains() {
    if [ ! -r "$2" ]; then
        fail "$1" "cannot read $2"
    elif grep -qF -- "$3" "$2"; then
        pass "$1"
    else
        fail "$1" "'$3' not found in $2" "$2"
    fi
}

# expect_not_contains NAME FILE TEXT -- FILE does not contain TEXT.
expect_not_contains() {
    if [ ! -r "$2" ]; then
        fail "$1" "cannot read $2"
    elif grep -qF -- "$3" "$2"; then
        fail "$1" "'$3' found in $2" "$2"
    else
        pass "$1"
    fi
}

# expect_driver NAME BDF DRIVER -- BDF is bound to DRIVER ("none": unbound).
expect_driver() {
    expect_eq "$1" "$(driver_of "$2")" "$3"
}

# wait_for NAME TIMEOUT_S -- CMD [ARGS...]
# Polls CMD every 0.2 s until it exits 0 (PASS) or TIMEOUT_S seconds have
# passed (FAIL with the last output of CMD).
wait_for() {
    _tb_name=$1
    _tb_timeout=$2
    shift 2
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || { fail "$_tb_name" "wait_for: no command given"; return 1; }
    _tb_start=$(_tb_now_ms)
    while :; do
        if "$@" >"$TB_OUT" 2>&1; then
            pass "$_tb_name"
            return 0
        fi
        if [ $(($(_tb_now_ms) - _tb_start)) -ge $((_tb_timeout * 1000)) ]; then
            fail "$_tb_name" "still failing after ${_tb_timeout} s: $*" "$TB_OUT"
            return 1
        fi
        sleep 0.2
    done
}

# run_logged CMD [ARGS...]
# Echoes "+ CMD" and runs it with its output shown indented; returns its
# status. Not a step: use it to make the log tell what happened.
run_logged() {
    echo "+ $*"
    "$@" >"$TB_OUT.run" 2>&1
    _tb_rc=$?
    sed 's/^/  /' "$TB_OUT.run"
    [ "$_tb_rc" -eq 0 ] || echo "  (exit $_tb_rc)"
    return "$_tb_rc"
}

# ---- sysfs queries ----------------------------------------------------------

# driver_of BDF -- current driver name, or "none".
driver_of() {
    if [ -e "/sys/bus/pci/devices/$1/driver" ]; then
        basename "$(readlink "/sys/bus/pci/devices/$1/driver")"
    else
        echo none
    fi
}

# group_of BDF -- IOMMU group number, or "none".
group_of() {
    if [ -e "/sys/bus/pci/devices/$1/iommu_group" ]; then
        basename "$(readlink "/sys/bus/pci/devices/$1/iommu_group")"
    else
        echo none
    fi
}

# group_members GROUP -- BDFs in an IOMMU group, one per line.
group_members() {
    ls "/sys/kernel/iommu_groups/$1/devices" 2>/dev/null
}

# module_loaded NAME -- true when module NAME is loaded (or built in).
module_loaded() {
    [ -d "/sys/module/$(echo "$1" | tr - _)" ]
}

# pci_exists BDF -- true when the PCI device exists.
pci_exists() {
    [ -e "/sys/bus/pci/devices/$1" ]
}

# ---- kernel-contract driver changes (for setup; not the project's code) -----

# sysfs_write FILE VALUE -- write VALUE to a sysfs file, reporting errors.
sysfs_write() {
    if ! printf '%s\n' "$2" >"$1" 2>"$TB_OUT.err"; then
        echo "write '$2' to $1 failed: $(cat "$TB_OUT.err")" >&2
        return 1
    fi
}

# bind_override BDF DRIVER -- driver_override := DRIVER, unbind the current
# driver, then drivers_probe; succeeds when BDF ends up on DRIVER.
bind_override() {
    sysfs_write "/sys/bus/pci/devices/$1/driver_override" "$2" || return 1
    if [ -e "/sys/bus/pci/devices/$1/driver" ]; then
        sysfs_write "/sys/bus/pci/devices/$1/driver/unbind" "$1" || return 1
    fi
    sysfs_write /sys/bus/pci/drivers_probe "$1" || return 1
    [ "$(driver_of "$1")" = "$2" ] || {
        echo "$1 is on $(driver_of "$1"), not $2" >&2
        return 1
    }
}

# clear_override BDF -- clear driver_override, unbind, drivers_probe; the
# device goes back to whichever driver matches it natively. Prints nothing;
# check the result with driver_of.
clear_override() {
    # A lone newline clears driver_override.
    if ! echo >"/sys/bus/pci/devices/$1/driver_override" 2>"$TB_OUT.err"; then
        echo "clearing driver_override of $1 failed: $(cat "$TB_OUT.err")" >&2
        return 1
    fi
    if [ -e "/sys/bus/pci/devices/$1/driver" ]; then
        sysfs_write "/sys/bus/pci/devices/$1/driver/unbind" "$1" || return 1
    fi
    sysfs_write /sys/bus/pci/drivers_probe "$1" || return 1
}

# ---- SR-IOV -------------------------------------------------------------------

# sriov_enable PF N [TIMEOUT_S] -- write N to PF's sriov_numvfs, then wait
# (default 10 s) until N virtfn links exist and every VF has settled: the
# nvme driver autoprobes QEMU's VFs, and since they stay offline until the PF
# gives them resources, its probe gives up after about 0.5 s ("Device not
# ready; aborting initialisation") and the VF is left without a driver. A VF
# counts as settled when it has no driver, or a driver other than nvme, or
# nvme with a live controller. Prints the VF BDFs, one per line.
sriov_enable() {
    sysfs_write "/sys/bus/pci/devices/$1/sriov_numvfs" "$2" || return 1
    _tb_deadline=$(($(_tb_now_ms) + ${3:-10} * 1000))
    while :; do
        if _tb_vfs_settled "$1" "$2"; then
            for _tb_l in "/sys/bus/pci/devices/$1"/virtfn*; do
                basename "$(readlink "$_tb_l")"
            done
            return 0
        fi
        if [ "$(_tb_now_ms)" -ge "$_tb_deadline" ]; then
            echo "VFs of $1 not settled after ${3:-10} s" >&2
            for _tb_l in "/sys/bus/pci/devices/$1"/virtfn*; do
                [ -e "$_tb_l" ] || continue
                _tb_vf=$(basename "$(readlink "$_tb_l")")
                echo "  $_tb_vf driver=$(driver_of "$_tb_vf")" >&2
            done
            return 1
        fi
        sleep 0.2
    done
}

# sriov_disable PF [TIMEOUT_S] -- write 0 to sriov_numvfs and wait until the
# VFs are gone.
sriov_disable() {
    sysfs_write "/sys/bus/pci/devices/$1/sriov_numvfs" 0 || return 1
    _tb_deadline=$(($(_tb_now_ms) + ${2:-10} * 1000))
    while ls "/sys/bus/pci/devices/$1"/virtfn* >/dev/null 2>&1; do
        if [ "$(_tb_now_ms)" -ge "$_tb_deadline" ]; then
            echo "VFs of $1 still present after ${2:-10} s" >&2
            return 1
        fi
        sleep 0.2
    done
}

_tb_vfs_settled() {
    _tb_n=0
    for _tb_l in "/sys/bus/pci/devices/$1"/virtfn*; do
        [ -e "$_tb_l" ] || continue
        _tb_n=$((_tb_n + 1))
        _tb_vf=$(basename "$(readlink "$_tb_l")")
        [ -e "/sys/bus/pci/devices/$_tb_vf/iommu_group" ] || [ "${TESTBED_IOMMU:-1}" != 1 ] || return 1
        [ "$(driver_of "$_tb_vf")" = nvme ] || continue
        # On nvme: settled only once its controller is live.
        _tb_live=0
        for _tb_c in "/sys/bus/pci/devices/$_tb_vf"/nvme/nvme*; do
            [ "$(cat "$_tb_c/state" 2>/dev/null)" = live ] && _tb_live=1
        done
        [ "$_tb_live" = 1 ] || return 1
    done
    [ "$_tb_n" -eq "$2" ]
}

# ---- a VMM (QEMU in the guest; scenarios with `# vm: needs=qemu`) -----------

# vm_alloc_file FILE BDF... -- write what the device plugin's Allocate gives a
# container for BDF... (as `kubelet-peer allocate` prints it): KubeVirt's
# variable, /dev/vfio/vfio and each group node; for devices that reached
# vfio-pci another way (by hand, by vfio-manager).
vm_alloc_file() {
    _tb_f=$1
    shift
    _tb_list=$(echo "$*" | tr ' ' ',')
    {
        echo "env PCI_RESOURCE_EXAMPLE_COM_NIC_PT=$_tb_list"
        echo "device /dev/vfio/vfio /dev/vfio/vfio mrw"
        for _tb_b in "$@"; do group_of "$_tb_b"; done | sort -u | while read -r _tb_g; do
            echo "device /dev/vfio/$_tb_g /dev/vfio/$_tb_g mrw"
        done
    } >"$_tb_f"
}

# vm_hold NAME LOG -- VMM-ARGS...
# Starts `kubelet-peer vmm VMM-ARGS --hold` in the background (its pid in
# VM_HOLDER, its output in LOG): PASS once QEMU holds its devices, FAIL with
# QEMU's own words when it exits first or is not up within 180 s.
vm_hold() {
    _tb_name=$1
    _tb_log=$2
    shift 2
    [ "${1:-}" = "--" ] && shift
    kubelet-peer vmm "$@" --hold >"$_tb_log" 2>&1 &
    VM_HOLDER=$!
    _tb_start=$(_tb_now_ms)
    while ! grep -qx holding "$_tb_log"; do
        if ! kill -0 "$VM_HOLDER" 2>/dev/null; then
            fail "$_tb_name" "kubelet-peer vmm ended before QEMU held the devices" "$_tb_log"
            return 1
        fi
        if [ $(($(_tb_now_ms) - _tb_start)) -ge 180000 ]; then
            fail "$_tb_name" "QEMU not holding the devices after 180 s" "$_tb_log"
            return 1
        fi
        sleep 0.2
    done
    pass "$_tb_name"
}

# vm_release NAME -- stop the VM of vm_hold: PASS when QEMU quit and the
# device files are closed (kubelet-peer waits for QEMU's exit).
vm_release() {
    kill -TERM "$VM_HOLDER" 2>/dev/null
    wait "$VM_HOLDER"
    expect_eq "$1" "$?" 0
}

# nic_works NAME BDF -- BDF's native NIC driver works: its interface comes up
# and reports a carrier within 10 s.
nic_works() {
    _tb_if=""
    for _tb_n in "/sys/bus/pci/devices/$2"/net/*; do
        [ -e "$_tb_n" ] && _tb_if=$(basename "$_tb_n")
    done
    if [ -z "$_tb_if" ]; then
        fail "$1" "$2 has no network interface (driver: $(driver_of "$2"))"
        return 1
    fi
    ip link set "$_tb_if" up 2>/dev/null || ifconfig "$_tb_if" up
    wait_for "$1 ($_tb_if)" 10 -- grep -qx 1 "/sys/class/net/$_tb_if/carrier"
}

# ---- internals --------------------------------------------------------------

# Milliseconds since boot.
_tb_now_ms() {
    awk '{ printf "%d\n", $1 * 1000 }' /proc/uptime
}
