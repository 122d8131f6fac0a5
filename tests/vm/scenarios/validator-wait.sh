# sandbox-validator scenario 1: before binding it fails naming the unbound devices;
# in --wait mode it passes within one interval after vfio-manager binds them, and
# the ready file appears.
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
READY=/run/vfio-sandbox/validations/vfio-pci-ready

note "one shot, before binding"
expect_fail "validator exits 1 before binding" 1 -- sandbox-validator
cp "$TB_OUT" /tmp/before.out
run_logged cat /tmp/before.out
expect_contains "names CARD_FN0 unbound, with its driver" /tmp/before.out "$CARD_FN0 on e1000e (want vfio-pci)"
expect_contains "names SOLO_NIC unbound" /tmp/before.out "$SOLO_NIC on e1000e (want vfio-pci)"
expect_contains "vfio modules reported missing" /tmp/before.out "vfio-modules         FAIL"
expect_contains "a hint for each failure" /tmp/before.out "hint: run vfio-manager"
expect_fail "no ready file" 1 -- test -e "$READY"

note "--wait, then vfio-manager binds"
sandbox-validator --wait --interval 1s --timeout 60s >/tmp/wait.out 2>&1 &
v=$!
wait_for "validator printed its first report" 10 -- grep -q "devices-bound" /tmp/wait.out
sleep 2.5 # a few failing rounds: they must not be printed again
step "vfio-manager bind --all" -- vfio-manager bind --all
bound_at=$(_tb_now_ms)
wait "$v"
rc=$?
took=$(($(_tb_now_ms) - bound_at))
run_logged cat /tmp/wait.out
expect_eq "validator --wait exits 0" "$rc" 0
step "passed within one interval (1000 ms) of binding: ${took} ms" -- test "$took" -le 1300
# The same failure is printed once, however many rounds it lasted (a round that
# catches vfio-manager half-way is a different failure and may be printed).
# So count the first failing line itself, whole, not lines that share its start.
first=$(grep -m1 "devices-bound        FAIL" /tmp/wait.out)
expect_eq "the first failure names CARD_FN0 on e1000e" \
    "$(printf '%s\n' "$first" | grep -c "not bound: $CARD_FN0 on e1000e")" 1
expect_eq "the first failure was printed once" "$(grep -cxF -- "$first" /tmp/wait.out)" 1
expect_contains "prints what changed" /tmp/wait.out "devices-bound        ok"
step "ready file present" -- test -s "$READY"
run_logged cat "$READY"
expect_contains "ready file lists CARD_FN0" "$READY" "\"$CARD_FN0\""
expect_contains "ready file lists the card's group" "$READY" "$CARD_GROUP"
