# No host network needed for uevents: vfio-manager and the device plugin, each in
# a network namespace of its own (unshare -n), still get the kernel's PCI uevents
# and react within seconds, with a 1 h resync so only a uevent can explain it.
# Control: a network namespace owned by a separate user namespace (unshare -r -n)
# gets no kernel uevents, so an agent there misses what the others see.
# vm: needs=vfio-manager,sandbox-device-plugin,kubelet-peer
# vm: timeout=300
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
READY=/run/vfio-manager/ready
D=/var/lib/kubelet/device-plugins
EP=
mkdir -p "$D"

host_net=$(readlink /proc/1/ns/net)
host_user=$(readlink /proc/1/ns/user)
expect_ne "PID 1's network namespace is readable" "$host_net" ""

# in_own_netns NAME PID EXE -- PID runs EXE (unshare exec'd it, no fork) in a
# network namespace other than PID 1's, under PID 1's user namespace.
in_own_netns() {
    expect_eq "$1 is the process we started" "$(basename "$(readlink "/proc/$2/exe")")" "$3"
    expect_ne "$1 is in another network namespace ($(readlink "/proc/$2/ns/net") vs $host_net)" \
        "$(readlink "/proc/$2/ns/net")" "$host_net"
    expect_eq "$1 shares PID 1's user namespace" "$(readlink "/proc/$2/ns/user")" "$host_user"
    run_logged cat "/proc/$2/net/dev"
}

# on_vfio BDF -- true when BDF exists and is bound to vfio-pci.
on_vfio() {
    [ "$(driver_of "$1")" = vfio-pci ]
}

note "vfio-manager run in its own network namespace"
unshare -n vfio-manager run --resync-interval 1h >/tmp/run.log 2>&1 &
manager=$!
wait_for "run writes the ready file" 30 -- test -e "$READY"
in_own_netns "vfio-manager" "$manager" vfio-manager
expect_driver "SOLO_NIC on vfio-pci" "$SOLO_NIC" vfio-pci
expect_driver "CARD_FN1 on vfio-pci" "$CARD_FN1" vfio-pci

# The card is left alone here: a function removed and rescanned may come back in
# an IOMMU group of its own, and the plugin part below needs CARD_FN1 to share
# CARD_FN0's group.
note "remove SOLO_NIC and rescan, four times: run rebinds it each time"
for round in 1 2 3 4; do
    step "round $round: remove SOLO_NIC" -- sysfs_write "/sys/bus/pci/devices/$SOLO_NIC/remove" 1
    step "round $round: PCI rescan" -- sysfs_write /sys/bus/pci/rescan 1
    wait_for "round $round: SOLO_NIC rebound to vfio-pci within 5 s (uevent; resync is 1h)" 5 -- \
        on_vfio "$SOLO_NIC"
done
step "run is still alive" -- kill -0 "$manager"
expect_not_contains "run opened its uevent socket (no fallback warning)" /tmp/run.log "no kernel uevents"
run_logged tail -n 8 /tmp/run.log

kill -TERM "$manager"
wait "$manager"
expect_eq "run exits 0 after SIGTERM" "$?" 0
expect_driver "SOLO_NIC restored" "$SOLO_NIC" e1000e

note "the device plugin in its own network namespace"
step "vfio-manager bind --all" -- vfio-manager bind --all
kubelet-peer --dir "$D" serve >/tmp/regs.log 2>&1 &
peer=$!
unshare -n sandbox-device-plugin --resync-interval 1h --metrics-address 127.0.0.1:9403 >/tmp/plugin.log 2>&1 &
plugin=$!
wait_for "plugin registers example.com/NIC_PT" 10 -- grep -q "registered example.com/NIC_PT" /tmp/regs.log
in_own_netns "sandbox-device-plugin" "$plugin" sandbox-device-plugin
expect_contains "plugin opened the uevent socket, resync 1h" /tmp/plugin.log "uevents=true"
EP=$(awk '$2 == "example.com/NIC_PT" { e = $3 } END { print e }' /tmp/regs.log)
expect_eq "CARD_FN1 shares CARD_FN0's IOMMU group $CARD_GROUP" "$(group_of "$CARD_FN1")" "$(group_of "$CARD_FN0")"
step "CARD_FN1 listed Healthy" -- kubelet-peer --dir "$D" list --endpoint "$EP"
expect_contains "CARD_FN1 Healthy" "$TB_OUT" "$CARD_FN1 Healthy"
# Unbinding one function of the card leaves /dev/vfio/<group> in place, so inotify
# on /dev/vfio cannot see it: only the kernel's uevent can tell.
for round in 1 2; do
    step "round $round: unbinding CARD_FN1: Unhealthy within 1 s" -- kubelet-peer --dir "$D" watch --endpoint "$EP" \
        --after "echo $CARD_FN1 > /sys/bus/pci/devices/$CARD_FN1/driver/unbind" \
        --expect "$CARD_FN1=Unhealthy" --within-ms 1000
    run_logged cat "$TB_OUT"
    step "round $round: binding it back: Healthy within 1 s" -- kubelet-peer --dir "$D" watch --endpoint "$EP" \
        --after "echo $CARD_FN1 > /sys/bus/pci/drivers_probe" \
        --expect "$CARD_FN1=Healthy" --within-ms 1000
    run_logged cat "$TB_OUT"
done
step "/dev/vfio/$CARD_GROUP stayed throughout" -- test -c "/dev/vfio/$CARD_GROUP"

note "its metrics, inside its network namespace only"
# metrics_show TEXT -- a scrape from inside the plugin's namespace contains TEXT.
metrics_show() {
    nsenter -t "$plugin" -n wget -q -O /tmp/metrics.txt http://127.0.0.1:9403/metrics &&
        grep -qF "$1" /tmp/metrics.txt
}
# A fresh network namespace has its loopback down; a pod's runtime brings it up.
step "loopback up in the plugin's namespace" -- nsenter -t "$plugin" -n ip link set lo up
wait_for "metrics: three healthy NIC_PT devices" 2 -- \
    metrics_show 'vfio_sandbox_devices{resource="example.com/NIC_PT",state="healthy"} 3'
expect_contains "metrics: none unhealthy" /tmp/metrics.txt \
    'vfio_sandbox_devices{resource="example.com/NIC_PT",state="unhealthy"} 0'
# Each ListAndWatch stream the peer closes leads to a new registration.
expect_contains "metrics: registrations counted" /tmp/metrics.txt \
    'vfio_sandbox_registrations_total{resource="example.com/NIC_PT",result="ok"} '
expect_not_contains "metrics: not zero of them" /tmp/metrics.txt \
    'vfio_sandbox_registrations_total{resource="example.com/NIC_PT",result="ok"} 0'
run_logged grep -v "^#" /tmp/metrics.txt
step "loopback up in the host's namespace" -- ip link set lo up
# (Not wget -T: Debian 12's static busybox 1.35 wget crashes with it.)
expect_fail "the metrics port is not open in the host's network namespace" nonzero -- \
    wget -q -O /tmp/host-metrics.txt http://127.0.0.1:9403/metrics
expect_contains "refused there, not unreachable" "$TB_OUT" "refused"

note "control: a network namespace owned by a separate user namespace"
# Since Linux 4.18 the kernel broadcasts uevents only into network namespaces
# owned by the initial user namespace. Two busybox uevent listeners, one in each
# kind of namespace, and a second plugin under unshare -r -n (root mapped to
# root, so it reads sysfs and serves its socket as before) watch the same unbind.
D2=/var/lib/kubelet/userns-plugins
mkdir -p "$D2"
: >/tmp/ue-netns.log
: >/tmp/ue-userns.log
# shellcheck disable=SC2016 # expanded by the listener's shell, per uevent
unshare -n uevent sh -c 'echo "$ACTION $SUBSYSTEM $DEVPATH" >>/tmp/ue-netns.log' &
ue_netns=$!
# shellcheck disable=SC2016
unshare -r -n uevent sh -c 'echo "$ACTION $SUBSYSTEM $DEVPATH" >>/tmp/ue-userns.log' &
ue_userns=$!
kubelet-peer --dir "$D2" serve >/tmp/regs2.log 2>&1 &
peer2=$!
unshare -r -n sandbox-device-plugin --kubelet-dir "$D2" --resync-interval 1h >/tmp/plugin2.log 2>&1 &
plugin2=$!
wait_for "user-namespace plugin registers" 10 -- grep -q "registered example.com/NIC_PT" /tmp/regs2.log
expect_ne "it runs under another user namespace" "$(readlink "/proc/$plugin2/ns/user")" "$host_user"
expect_ne "and another network namespace" "$(readlink "/proc/$plugin2/ns/net")" "$host_net"
expect_ne "the listener too" "$(readlink "/proc/$ue_userns/ns/user")" "$host_user"
expect_contains "its uevent socket opened all the same" /tmp/plugin2.log "uevents=true"
EP2=$(awk '$2 == "example.com/NIC_PT" { e = $3 } END { print e }' /tmp/regs2.log)
step "user-namespace plugin lists CARD_FN1 Healthy" -- kubelet-peer --dir "$D2" list --endpoint "$EP2"
expect_contains "CARD_FN1 Healthy there" "$TB_OUT" "$CARD_FN1 Healthy"
expect_eq "CARD_FN1 still shares CARD_FN0's group (inotify on /dev/vfio cannot tell)" \
    "$(group_of "$CARD_FN1")" "$(group_of "$CARD_FN0")"
sleep 1 # both listeners have bound their sockets
expect_fail "unbinding CARD_FN1: the user-namespace plugin sees no change in 3 s" 1 -- \
    kubelet-peer --dir "$D2" watch --endpoint "$EP2" \
    --after "echo $CARD_FN1 > /sys/bus/pci/devices/$CARD_FN1/driver/unbind" \
    --expect "$CARD_FN1=Unhealthy" --within-ms 3000
run_logged cat "$TB_OUT"
expect_contains "it timed out waiting" "$TB_OUT" "no message with $CARD_FN1 Unhealthy"
step "the plugin in the plain network namespace lists it Unhealthy" -- \
    kubelet-peer --dir "$D" list --endpoint "$EP"
expect_contains "CARD_FN1 Unhealthy there" "$TB_OUT" "$CARD_FN1 Unhealthy"
wait_for "listener in a plain network namespace got the unbind uevent" 5 -- \
    grep -q "^unbind pci .*$CARD_FN1" /tmp/ue-netns.log
run_logged cat /tmp/ue-netns.log
run_logged cat /tmp/ue-userns.log
expect_eq "listener under a separate user namespace got no uevent at all" \
    "$(wc -l </tmp/ue-userns.log)" 0
step "user-namespace listener still alive" -- kill -0 "$ue_userns"
run_logged tail -n 4 /tmp/plugin2.log

kill -TERM "$plugin" "$plugin2"
wait "$plugin"
expect_eq "plugin exits 0 on SIGTERM" "$?" 0
kill "$peer" "$peer2" "$ue_netns" "$ue_userns" 2>/dev/null
run_logged tail -n 10 /tmp/plugin.log
