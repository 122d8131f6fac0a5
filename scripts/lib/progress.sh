# shellcheck shell=bash
# A progress line every 30 s for steps that are silent for long (a kernel
# build, a large download), on stderr, so it shows even where a script's
# stdout is captured or thrown away.
#
#   source scripts/lib/progress.sh
#   progress_start LABEL [PROBE...]   # start the ticker
#   ...                               # the long, silent work
#   progress_stop                     # stop it (any exit path: see below)
#
#   progress_run LABEL [PROBE...] -- COMMAND...
#                                     # the same around one command; returns
#                                     # the command's status, ticker stopped
#
# Every PROGRESS_INTERVAL seconds (default 30) the ticker prints
#   LABEL (N s)            or, with a probe,
#   LABEL (N s, <the probe's output>)
# PROBE is a command (a function of the caller too) run at each tick, e.g.
# `progress_size DIR` ("12.3 MB") or `progress_size_of BYTES DIR` ("12.3 of
# 98.1 MB") for a download into DIR; N counts from progress_start.
#
# The ticker never outlives the shell that started it: it checks every
# second that this shell is still its parent and exits otherwise, so a
# script that dies in any way (error, signal, kill -9) leaves no ticker
# behind (nor a pipe held open) for more than a second, and the ticker never
# prints after its shell is gone. A script should still stop it on its
# own exit paths: progress_stop in its EXIT trap (it does nothing when no
# ticker runs). One ticker per shell: progress_start stops the previous one.

_progress_pid=""

progress_start() {
    local label="$1" owner="$BASHPID" interval="${PROGRESS_INTERVAL:-30}"
    shift
    progress_stop
    [[ "$interval" =~ ^[1-9][0-9]*$ ]] || interval=30
    (
        set +e
        trap - EXIT
        nap=""
        trap '[[ -n "$nap" ]] && kill "$nap" 2>/dev/null; exit 0' TERM
        # True while the shell that started the ticker is its parent (a dead
        # parent's orphans are adopted by another process).
        owner_alive() {
            local stat state ppid rest
            if read -r stat 2>/dev/null <"/proc/$BASHPID/stat"; then
                read -r state ppid rest <<<"${stat##*) }"
                [[ -n "$state" && "$ppid" == "$owner" ]]
            else
                kill -0 "$owner" 2>/dev/null
            fi
        }
        t0=$SECONDS
        while :; do
            for ((i = 0; i < interval; i++)); do
                sleep 1 &
                nap=$!
                wait "$nap"
                nap=""
                owner_alive || exit 0
            done
            detail=""
            (($#)) && detail="$("$@" 2>/dev/null | head -n 1)"
            owner_alive || exit 0
            printf '%s (%s s%s)\n' "$label" "$((SECONDS - t0))" "${detail:+, $detail}"
        done
    ) </dev/null >&2 &
    _progress_pid=$!
}

progress_stop() {
    [[ -n "${_progress_pid:-}" ]] || return 0
    kill "$_progress_pid" 2>/dev/null || true
    wait "$_progress_pid" 2>/dev/null || true
    _progress_pid=""
}

progress_run() {
    local label="$1" probe=() rc=0
    shift
    while (($#)) && [[ "$1" != -- ]]; do
        probe+=("$1")
        shift
    done
    [[ "${1:-}" == -- ]] && shift
    progress_start "$label" "${probe[@]}"
    "$@" || rc=$?
    progress_stop
    return "$rc"
}

# progress_size PATH... -- the bytes of the files under PATH..., in MB.
progress_size() {
    find "$@" -type f -printf '%s\n' 2>/dev/null | awk '{ s += $1 } END { printf "%.1f MB\n", s / 1e6 }'
}

# progress_size_of TOTAL PATH... -- the same as "X of Y MB" against TOTAL
# bytes (e.g. a package's size), or as progress_size when TOTAL is empty or 0.
progress_size_of() {
    local total="$1"
    shift
    find "$@" -type f -printf '%s\n' 2>/dev/null | awk -v t="$total" '{ s += $1 } END {
        if (t + 0 > 0) printf "%.1f of %.1f MB\n", s / 1e6, t / 1e6
        else printf "%.1f MB\n", s / 1e6
    }'
}
