#!/usr/bin/env bash
# Assemble the base initramfs of the VM test bed.
#
# Usage: scripts/vm/initramfs.sh OUTPUT.cpio [BINARY...]
#
# Needs KERNEL_VERSION and KERNEL_MODULES in the environment (as printed by
# scripts/fetch-kernel.sh; fetched here when unset). For a kernel of another
# architecture (arm64 on an amd64 host) also KERNEL_BUSYBOX, KERNEL_KMOD and
# KERNEL_USERLAND: the guest then gets that architecture's busybox, kmod and
# shared libraries instead of the host's. The archive holds:
#   /bin/busybox + applet links      static busybox (busybox-static; the links
#                                    are those of the host's busybox, which
#                                    cannot run a foreign busybox to ask it)
#   /bin/kmod + modprobe, insmod...  kmod with its shared libraries (the
#                                    host's, or every shared library of the
#                                    foreign userland: libkmod dlopens the
#                                    compression libraries)
#                                    (busybox modprobe ignores softdeps such as
#                                    vfio -> vfio_iommu_type1)
#   /lib/modules/<ver>/...           the modules listed in VM_MODULES and all
#                                    their dependencies (as shipped: .ko, .ko.xz
#                                    or .ko.zst), depmod'ed for the guest
#   /bin/<binary>                    each BINARY given (the static project
#                                    binaries)
#   /lib/testbed.sh                  tests/vm/testbed.sh
#   /init                            scripts/vm/guest-init.sh
# The archive is an uncompressed newc cpio; the per-scenario archive is
# appended to it by run.sh (the kernel unpacks concatenated archives).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd "$here/../.." && pwd)"
# shellcheck source=scripts/vm/common.sh
. "$here/common.sh"

(($# >= 1)) || { echo "usage: $0 OUTPUT.cpio [BINARY...]" >&2; exit 2; }
output="$1"
shift

# Modules the bed provides (dependencies are added from modules.dep).
# VM_MODULES_EXTRA adds a kernel's own (run.sh: vm_extra_modules).
VM_MODULES="${VM_MODULES:-vfio vfio_pci vfio_pci_core vfio_iommu_type1 irqbypass e1000e nvme nvme_core virtio_pci snd_hda_intel} ${VM_MODULES_EXTRA:-}"

vm_ensure_packages "${VM_HOST_PACKAGES[@]}"

if [[ -z "${KERNEL_VERSION:-}" || -z "${KERNEL_MODULES:-}" ]]; then
    eval "$("$repo_root/scripts/fetch-kernel.sh")"
fi
[[ -f "$KERNEL_MODULES/modules.dep" ]] || vm_die "no modules.dep in $KERNEL_MODULES"

host_busybox=/bin/busybox
busybox="${KERNEL_BUSYBOX:-$host_busybox}"
if [[ ! -x "$host_busybox" ]] || ldd "$host_busybox" >/dev/null 2>&1; then
    # Missing, or the dynamically linked busybox package, which busybox-static
    # replaces: apt would remove it, so pkg_ensure refuses and says so.
    vm_ensure_packages busybox-static
    ldd "$host_busybox" >/dev/null 2>&1 && vm_die "$host_busybox is not statically linked"
fi
[[ -f "$busybox" ]] || vm_die "busybox $busybox not found"

kmod_bin="${KERNEL_KMOD:-$(command -v kmod || true)}"
[[ -n "$kmod_bin" ]] || kmod_bin=/bin/kmod
[[ -x "$kmod_bin" ]] || vm_die "kmod not found"
depmod_bin="$(command -v depmod || echo /sbin/depmod)"

stage="$(mktemp -d "${TMPDIR:-/tmp}/vm-initramfs.XXXXXX")"
trap 'rm -rf "$stage"' EXIT

mkdir -p "$stage"/{bin,sbin,usr/bin,usr/sbin,lib,lib64,etc/modprobe.d,proc,sys,dev,run,tmp,root,mnt,var}
ln -s ../run "$stage/var/run"

# ---- busybox ----------------------------------------------------------------
cp "$busybox" "$stage/bin/busybox"
while read -r applet; do
    [[ -n "$applet" && "$applet" != bin/busybox ]] || continue
    mkdir -p "$stage/$(dirname "$applet")"
    ln -sf /bin/busybox "$stage/$applet"
done < <("$host_busybox" --list-full)

# ---- kmod and the shared libraries it needs ------------------------------------
copy_with_libs() {
    local bin="$1" dest="$2" lib
    cp -L "$bin" "$stage/$dest"
    # ldd lines: "libx.so => /path (0x..)" or "/lib64/ld-linux-x86-64.so.2 (0x..)".
    while read -r lib; do
        [[ -n "$lib" && -e "$lib" ]] || continue
        mkdir -p "$stage/$(dirname "$lib")"
        [[ -e "$stage/$lib" ]] || cp -L "$lib" "$stage/$lib"
    done < <(ldd "$bin" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }')
}
if [[ -n "${KERNEL_KMOD:-}" ]]; then
    # Foreign architecture: the host's ldd cannot run the binary. Copy every
    # shared library of the unpacked userland (its multiarch directories,
    # symlinks kept; libkmod dlopens liblzma and libzstd) and the program
    # interpreter at the path the binary asks for.
    [[ -d "${KERNEL_USERLAND:-}" ]] || vm_die "KERNEL_KMOD without KERNEL_USERLAND"
    cp "$kmod_bin" "$stage/bin/kmod"
    for d in "$KERNEL_USERLAND"/lib/*-linux-gnu* "$KERNEL_USERLAND"/usr/lib/*-linux-gnu*; do
        [[ -d "$d" ]] || continue
        mkdir -p "$stage/lib/$(basename "$d")"
        find "$d" -maxdepth 1 \( -name '*.so' -o -name '*.so.*' \) -exec cp -a -t "$stage/lib/$(basename "$d")" {} +
    done
    interp="$(readelf -l "$kmod_bin" | sed -n 's/.*Requesting program interpreter: \(.*\)]$/\1/p')"
    if [[ -n "$interp" && ! -e "$stage$interp" ]]; then
        found="$(find "$stage/lib" -name "$(basename "$interp")" -print -quit)"
        [[ -n "$found" ]] || vm_die "no $(basename "$interp") in $KERNEL_USERLAND"
        mkdir -p "$stage$(dirname "$interp")"
        ln -s "${found#"$stage"}" "$stage$interp"
    fi
else
    copy_with_libs "$kmod_bin" bin/kmod
fi
for tool in modprobe insmod rmmod lsmod modinfo depmod; do
    ln -sf /bin/kmod "$stage/sbin/$tool"
done

# ---- kernel modules ---------------------------------------------------------------
kver="$KERNEL_VERSION"
moddest="$stage/lib/modules/$kver"
mkdir -p "$moddest"

# Print the modules.dep paths (relative) of the given modules and of all their
# dependencies. Names match with '-' and '_' treated alike, any .ko suffix.
resolve_modules() {
    awk -v want="$*" '
        function norm(s) { gsub(/-/, "_", s); return s }
        function base(p,   n) {
            n = p; sub(/.*\//, "", n); sub(/\.ko(\.(xz|zst|gz))?$/, "", n); return norm(n)
        }
        BEGIN { n = split(want, w, /[ \t]+/); for (i = 1; i <= n; i++) if (w[i] != "") wanted[norm(w[i])] = 1 }
        {
            mod = $1; sub(/:$/, "", mod)
            b = base(mod)
            if (b in wanted) {
                found[b] = 1
                print mod
                for (i = 2; i <= NF; i++) print $i
            }
        }
        END { for (m in wanted) if (!(m in found)) print "MISSING " m }
    ' "$KERNEL_MODULES/modules.dep" | sort -u
}

# Soft dependencies of a module set (modules.softdep "pre:" and "post:"),
# restricted to modules that exist.
softdeps_of() {
    [[ -f "$KERNEL_MODULES/modules.softdep" ]] || return 0
    awk -v want="$*" '
        function norm(s) { gsub(/-/, "_", s); return s }
        BEGIN { n = split(want, w, /[ \t]+/); for (i = 1; i <= n; i++) if (w[i] != "") wanted[norm(w[i])] = 1 }
        $1 == "softdep" && (norm($2) in wanted) {
            for (i = 3; i <= NF; i++) if ($i != "pre:" && $i != "post:") print $i
        }
    ' "$KERNEL_MODULES/modules.softdep"
}

builtin_list="$KERNEL_MODULES/modules.builtin"
# One awk over the file, no pipe: "sed | grep -q" under pipefail fails when
# grep exits at its first match while sed is still writing (SIGPIPE), which
# happened on a loaded host and dropped a built-in module into "not found".
is_builtin() {
    [[ -f "$builtin_list" ]] &&
        awk -v n="${1//-/_}" '
            { gsub(/-/, "_") }
            substr($0, length($0) - length(n) - 3) == "/" n ".ko" { found = 1; exit }
            END { exit !found }
        ' "$builtin_list"
}

wanted=()
for m in $VM_MODULES; do
    if is_builtin "$m"; then
        vm_log "module $m is built into $kver"
    else
        wanted+=("$m")
    fi
done
# Include soft dependencies that exist as modules (e.g. vfio -> vfio_iommu_type1).
for m in $(softdeps_of "${wanted[@]}"); do
    if grep -Eq "/${m//[-_]/[-_]}\.ko(\.(xz|zst|gz))?:" "$KERNEL_MODULES/modules.dep"; then
        wanted+=("$m")
    fi
done

modcount=0
while read -r rel; do
    if [[ "$rel" == MISSING\ * ]]; then
        vm_die "kernel module ${rel#MISSING } not found in $KERNEL_MODULES/modules.dep"
    fi
    mkdir -p "$moddest/$(dirname "$rel")"
    cp "$KERNEL_MODULES/$rel" "$moddest/$rel"
    modcount=$((modcount + 1))
done < <(resolve_modules "${wanted[@]}")
for f in modules.order modules.builtin modules.builtin.modinfo; do
    [[ -f "$KERNEL_MODULES/$f" ]] && cp "$KERNEL_MODULES/$f" "$moddest/$f"
done
"$depmod_bin" -b "$stage" "$kver"
[[ -s "$moddest/modules.dep" ]] || vm_die "depmod produced no modules.dep"

# ---- project binaries, helper library, init -----------------------------------------
bincount=0
for bin in "$@"; do
    [[ -f "$bin" ]] || vm_die "binary $bin not found"
    cp "$bin" "$stage/bin/$(basename "$bin")"
    bincount=$((bincount + 1))
done
cp "$repo_root/tests/vm/testbed.sh" "$stage/lib/testbed.sh"
cp "$here/guest-init.sh" "$stage/init"
chmod 0755 "$stage/init"

printf 'root:x:0:0:root:/root:/bin/sh\n' >"$stage/etc/passwd"
printf 'root:x:0:\n' >"$stage/etc/group"

mkdir -p "$(dirname "$output")"
(cd "$stage" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) >"$output.tmp"
mv "$output.tmp" "$output"
vm_log "initramfs $(basename "$output"): $modcount modules, $bincount project binaries, $(du -h "$output" | cut -f1)"
