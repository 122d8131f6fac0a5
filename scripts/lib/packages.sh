# shellcheck shell=bash
# Install the Debian packages a script needs from the machine's own apt
# sources: only those missing, without their recommended packages, and never
# at the price of removing one (sourced; needs scripts/lib/progress.sh next
# to it, which it sources).
#
#   source scripts/lib/packages.sh
#   pkg_missing SPEC...          # print the missing packages, one a line
#   pkg_ensure WHO SPEC...       # install them; WHO prefixes the messages
#
# SPEC is PACKAGE or PACKAGE:PROBE. PROBE is a command name (looked up with
# `command -v`) or an absolute path (a file that must exist). A package is
# present when its probe succeeds or dpkg lists it as installed, so a tool
# installed another way (a newer QEMU, a toolchain under /usr/local) is used
# as it is and no package of the same name is pulled in beside it.
#
# When something is missing, pkg_ensure runs one `apt-get update` and one
#   apt-get install --no-install-recommends --no-remove PACKAGE...
# after asking apt (a simulation, which changes nothing) whether that would
# remove anything. If it would, nothing is installed: pkg_ensure names the
# packages apt wanted to remove and returns 1. apt-get's own --no-remove
# (abort when any package is to be removed) guards the real install as well.
# Needs root; without it, pkg_ensure names what is missing and returns 1.

_packages_lib="$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=scripts/lib/progress.sh
source "$_packages_lib/progress.sh"

pkg_missing() {
    local spec pkg probe
    for spec in "$@"; do
        pkg="${spec%%:*}" probe=""
        [[ "$spec" == *:* ]] && probe="${spec#*:}"
        if [[ -n "$probe" ]]; then
            if [[ "$probe" == /* ]]; then
                [[ -e "$probe" ]] && continue
            else
                command -v "$probe" >/dev/null 2>&1 && continue
            fi
        fi
        [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" == "install ok installed" ]] && continue
        printf '%s\n' "$pkg"
    done
}

# _pkg_downloaded BASELINE DIR -- MB that apt fetched into DIR since BASELINE bytes.
_pkg_downloaded() {
    find "$2" -type f -printf '%s\n' 2>/dev/null |
        awk -v base="$1" '{ s += $1 } END { s -= base; if (s < 0) s = 0; printf "%.1f MB downloaded\n", s / 1e6 }'
}

pkg_ensure() {
    local who="$1" missing=() removals=() archives="" base rc=0
    shift
    mapfile -t missing < <(pkg_missing "$@")
    ((${#missing[@]})) || return 0
    if ! command -v apt-get >/dev/null || ! command -v dpkg-query >/dev/null; then
        printf '%s: error: missing %s, and no apt-get to install them\n' "$who" "${missing[*]}" >&2
        return 1
    fi
    if ((EUID != 0)); then
        printf '%s: error: missing %s; as root: apt-get install --no-install-recommends %s\n' \
            "$who" "${missing[*]}" "${missing[*]}" >&2
        return 1
    fi
    printf '%s: missing %s: installing with apt-get (only these, without recommended packages)\n' \
        "$who" "${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    local apt=(apt-get -o DPkg::Lock::Timeout=300)
    progress_run "$who: still updating the package lists" -- "${apt[@]}" update -qq >&2 ||
        printf '%s: warning: apt-get update failed; trying with the lists at hand\n' "$who" >&2
    # What apt would do, without doing it: refuse when it removes anything.
    mapfile -t removals < <("${apt[@]}" install -s --no-install-recommends "${missing[@]}" 2>/dev/null |
        awk '$1 == "Remv" { print $2 }')
    if ((${#removals[@]})); then
        printf '%s: error: apt-get would remove %s to install %s; nothing was installed or removed\n' \
            "$who" "${removals[*]}" "${missing[*]}" >&2
        printf '%s: install %s yourself in versions that fit the installed packages (e.g. from the suite those came from), then run again; its plan: apt-get install -s --no-install-recommends %s\n' \
            "$who" "${missing[*]}" "${missing[*]}" >&2
        return 1
    fi
    eval "$(apt-config shell archives Dir::Cache::archives/d 2>/dev/null)" || true
    archives="${archives:-/var/cache/apt/archives/}"
    base="$(find "$archives" -type f -printf '%s\n' 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')"
    progress_run "$who: still installing ${missing[*]}" _pkg_downloaded "$base" "$archives" -- \
        "${apt[@]}" install -y -qq --no-install-recommends --no-remove "${missing[@]}" >&2 || rc=$?
    if ((rc != 0)); then
        printf '%s: error: apt-get install %s failed (exit %s); if it said a package had to be removed, it stopped before changing anything (--no-remove)\n' \
            "$who" "${missing[*]}" "$rc" >&2
        return 1
    fi
}

# venv_ensure WHO DIR REQUIREMENTS -- a Python venv at DIR with the pinned
# packages of the file REQUIREMENTS installed from PyPI; installs only when
# the file differs from the one the venv was last filled from, under a lock
# (DIR.lock) so two checkouts sharing a machine-wide venv do not race. WHO
# prefixes the messages.
venv_ensure() {
    local who="$1" venv="$2" req="$3"
    mkdir -p "$(dirname "$venv")"
    (
        flock 9
        if [[ ! -x "$venv/bin/python" ]]; then
            printf '%s: creating %s\n' "$who" "$venv" >&2
            python3 -m venv "$venv"
        fi
        if ! cmp -s "$req" "$venv/.requirements" 2>/dev/null; then
            printf '%s: installing %s packages from PyPI into %s\n' "$who" "$(grep -cEv '^[[:space:]]*(#|$)' "$req")" "$venv" >&2
            progress_run "$who: still installing from PyPI" progress_size "$venv" -- \
                "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req" >&2
            cp "$req" "$venv/.requirements"
        fi
    ) 9>"$venv.lock"
}
