# shellcheck shell=bash
# A private apt configuration for another Debian suite than the machine's
# own (e.g. trixie on a bookworm machine): its own sources.list, package
# lists and cache under a directory of ours, passed to apt-get/apt-cache
# with -o Dir::...; the machine's apt sources are never edited. The archive
# is the one the machine's own apt sources use for its release, signed by
# the same keyring, so no archive host is named here.
#
#   source scripts/lib/private-apt.sh
#   private_apt_setup SUITE DIR [COMPONENTS [ARCH]]  # fills the array PRIVATE_APT_OPTS
#   apt-get "${PRIVATE_APT_OPTS[@]}" update
#   apt-get "${PRIVATE_APT_OPTS[@]}" download PACKAGE
#
# PRIVATE_APT_MIRROR overrides the archive URI.
#
# scripts/fetch-kernel.sh (kernels of other suites and architectures) and
# scripts/check-manifests.sh (kubectl) both use it.

# private_apt_host_archive SUITE -- print "URI KEYRING" of the first "deb"
# entry of the machine's apt sources (deb822 *.sources or one-line *.list)
# that serves SUITE; KEYRING is its signed-by file, or "-".
private_apt_host_archive() {
    local want="$1" f
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f "$f" ]] || continue
        awk -v want="$want" '
            function flush(   n, i, s, u) {
                if (!found && types ~ /(^|[ \t])deb([ \t]|$)/ && enabled != "no") {
                    n = split(suites, s, /[ \t]+/)
                    for (i = 1; i <= n; i++) {
                        if (s[i] == want) {
                            split(uris, u, /[ \t]+/)
                            print u[1], (signed ~ /^\// ? signed : "-")
                            found = 1
                            break
                        }
                    }
                }
                types = uris = suites = signed = enabled = ""
            }
            /^[ \t]*#/ { next }
            /^[ \t]*$/ { flush(); next }
            /^[A-Za-z-]+:/ {
                k = tolower(substr($0, 1, index($0, ":") - 1))
                v = substr($0, index($0, ":") + 1)
                gsub(/^[ \t]+|[ \t]+$/, "", v)
                if (k == "types") types = v
                else if (k == "uris") uris = v
                else if (k == "suites") suites = v
                else if (k == "signed-by") signed = v
                else if (k == "enabled") enabled = tolower(v)
            }
            END { flush() }
        ' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f "$f" ]] || continue
        awk -v want="$want" '
            $1 != "deb" { next }
            {
                line = $0; signed = "-"
                if (match(line, /\[[^]]*\]/)) {
                    opts = substr(line, RSTART + 1, RLENGTH - 2)
                    line = substr(line, 1, RSTART - 1) substr(line, RSTART + RLENGTH)
                    if (match(opts, /signed-by=[^ \t]+/)) signed = substr(opts, RSTART + 10, RLENGTH - 10)
                }
                split(line, w, /[ \t]+/)
                if (w[3] == want) { print w[2], signed; exit }
            }
        ' "$f"
    done
}

# private_apt_setup SUITE DIR [COMPONENTS [ARCH]] -- write DIR/sources.list
# for SUITE (default component: main; ARCH: a Debian architecture such as
# arm64, else the machine's), create DIR/lists and DIR/cache, and set
# PRIVATE_APT_OPTS. Returns 1 (with a message on stderr) when the machine's
# apt sources name no archive for its own release.
private_apt_setup() {
    local suite="$1" dir="$2" components="${3:-main}" arch="${4:-}" host_suite mirror="" keyring="" opts=""
    host_suite="$(sed -n 's/^VERSION_CODENAME=//p' /etc/os-release 2>/dev/null | tr -d '"' | head -n 1)"
    read -r mirror keyring < <(private_apt_host_archive "$host_suite" | head -n 1) || true
    mirror="${PRIVATE_APT_MIRROR:-${mirror:-}}"
    if [[ -z "$mirror" ]]; then
        printf 'private-apt: cannot find the Debian archive for %s in the machine'\''s apt sources; set PRIVATE_APT_MIRROR\n' \
            "${host_suite:-this release}" >&2
        return 1
    fi
    if [[ -z "$keyring" || "$keyring" == - ]]; then
        keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    fi
    mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
    [[ -n "$arch" ]] && opts="arch=$arch"
    [[ -f "$keyring" ]] && opts="${opts:+$opts }signed-by=$keyring"
    printf 'deb %s%s %s %s\n' "${opts:+[$opts] }" "$mirror" "$suite" "$components" >"$dir/sources.list"
    # shellcheck disable=SC2034  # read by the script that sources this
    PRIVATE_APT_OPTS=(
        -o "Dir::Etc::SourceList=$dir/sources.list"
        -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$dir/lists"
        -o "Dir::Cache=$dir/cache"
        -o Dir::Etc::Preferences=/dev/null
        -o Dir::Etc::PreferencesParts=/dev/null
    )
    if [[ -n "$arch" ]]; then
        PRIVATE_APT_OPTS+=(-o "APT::Architecture=$arch" -o "APT::Architectures=$arch")
    fi
}
