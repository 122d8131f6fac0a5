# iommufd and the VFIO device cdev on a real kernel. On the bed's own kernel
# (--kernel iommufd: IOMMUFD, VFIO_DEVICE_CDEV, virtio_vfio_pci) every device
# bound to a vfio driver gets /dev/vfio/devices/vfioN and /dev/iommu exists;
# the DRA driver's CDI spec and the device plugin's Allocate hand them out with
# --iommufd, next to the group nodes, which still work; the validator checks
# them; the modern virtio-net device, with "driver": "auto", binds to the
# virtio_vfio_pci variant driver that its alias in modules.alias picks. On Debian's kernels (no cdev: the
# kernel still lists vfio-dev/vfioN in sysfs, without a dev attribute or node)
# the same flags offer nothing iommufd and nothing fails. QEMU, in a container
# given each claim's CDI devices or the Allocate answer, takes the devices with
# the backend they are for (legacy, and iommufd where the kernel has it) and
# refuses the other one.
# vm: needs=vfio-manager,sandbox-validator,sandbox-device-plugin,sandbox-dra-driver,kubelet-peer,fake-apiserver,qemu
# vm: timeout=300
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
NIC='{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}'
if [ -n "${VIRTIO_NIC:-}" ]; then
    # The variant driver chosen by the kernel's own vfio_pci aliases.
    VNET='{"name":"example.com/VNET_PT","vendor":"1af4","devices":["1041"],"driver":"auto"}'
    echo "{\"resources\":[$NIC,$VNET]}" >"$VFIO_SANDBOX_CONFIG"
else
    echo "{\"resources\":[$NIC]}" >"$VFIO_SANDBOX_CONFIG"
fi
run_logged cat "$VFIO_SANDBOX_CONFIG"
# The one kernel of the bed built with the device cdev.
want_cdev=no
[ "$TESTBED_KERNEL" = iommufd ] && want_cdev=yes
note "kernel $TESTBED_KERNEL ($(uname -r)): device cdev expected: $want_cdev"

# cdev_of BDF -- the vfioN name of BDF's device cdev (vfio-dev/vfioN with a
# dev attribute), or nothing.
cdev_of() {
    for d in /sys/bus/pci/devices/"$1"/vfio-dev/vfio*; do
        [ -e "$d/dev" ] && basename "$d" && return 0
    done
    return 1
}
# has_cdev -- yes when some vfio device of the kernel has a dev attribute.
has_cdev() {
    for d in /sys/class/vfio-dev/vfio*; do
        [ -e "$d/dev" ] && echo yes && return 0
    done
    echo no
}

note "DRA driver with --iommufd, before anything is bound"
DRIVER=vfio-sandbox.rebellions.ai
REG=/var/lib/kubelet/plugins_registry
NODE=dra-node
CDI=/var/run/cdi
LABEL=rebellions.ai/npu.deploy.sandbox-dra-driver
ifconfig lo 127.0.0.1 up 2>/dev/null || ip link set lo up
fake-apiserver serve --listen 127.0.0.1:6443 --kubeconfig /tmp/kubeconfig \
    --node "$NODE" --label "$LABEL=true" \
    --daemonset "vfio-sandbox-dra/sandbox-dra-driver" --selector "$LABEL=true" \
    --pod "vfio-sandbox-dra/dra-pod1" >/tmp/apiserver.log 2>&1 &
apiserver=$!
wait_for "the stand-in API server serves" 10 -- test -s /tmp/kubeconfig
export KUBECONFIG=/tmp/kubeconfig NODE_NAME=$NODE POD_NAMESPACE=vfio-sandbox-dra POD_NAME=dra-pod1
sandbox-dra-driver --prepare-timeout 5s --iommufd >/tmp/dra.log 2>&1 &
driver=$!
wait_for "sandbox-dra-driver --iommufd serves" 20 -- grep -q "serving registration" /tmp/dra.log
step "the peer registers the driver" -- kubelet-peer dra register --registry "$REG"
wait_for "the ResourceSlice is published" 10 -- sh -c \
    'fake-apiserver request GET /apis/resource.k8s.io/v1/resourceslices | grep -q pci-0000'
solo_dev=$(echo "pci-$SOLO_NIC" | tr ':.' '--')
# The driver publishes SOLO_NIC (on e1000e) with its binding conditions; each
# claim's allocation carries them, as kube-scheduler copies them.
WAITS="--binding-condition $DRIVER/VfioReady --binding-failure-condition $DRIVER/VfioFailed"
# shellcheck disable=SC2086
uid=$(fake-apiserver claim vms/vm-solo --result "nic:$DRIVER:$NODE:$solo_dev" $WAITS)
step "NodePrepareResources for SOLO_NIC" -- kubelet-peer dra prepare --registry "$REG" --version v1 --claim "vms/vm-solo/$uid"
run_logged cat "$TB_OUT"
expect_driver "SOLO_NIC on vfio-pci" "$SOLO_NIC" vfio-pci
expect_eq "the kernel has the device cdev exactly when expected" "$(has_cdev)" "$want_cdev"
solo_group=$(group_of "$SOLO_NIC")
spec=$CDI/$DRIVER-vfio_$uid.json
run_logged cat "$spec"
expect_contains "CDI spec: /dev/vfio/vfio" "$spec" '"path": "/dev/vfio/vfio"'
expect_contains "CDI spec: the group node" "$spec" "\"path\": \"/dev/vfio/$solo_group\""
step "the group node is a char device" -- test -c "/dev/vfio/$solo_group"
if [ "$want_cdev" = yes ]; then
    solo_cdev=$(cdev_of "$SOLO_NIC")
    expect_ne "SOLO_NIC has a device cdev" "$solo_cdev" ""
    step "/dev/vfio/devices/$solo_cdev is a char device" -- test -c "/dev/vfio/devices/$solo_cdev"
    step "/dev/iommu is a char device" -- test -c /dev/iommu
    expect_contains "CDI spec: /dev/iommu" "$spec" '"path": "/dev/iommu"'
    expect_contains "CDI spec: SOLO_NIC's device cdev" "$spec" "\"path\": \"/dev/vfio/devices/$solo_cdev\""
else
    step "the kernel lists vfio-dev/vfioN without a dev attribute" -- \
        sh -c "ls -d /sys/bus/pci/devices/$SOLO_NIC/vfio-dev/vfio* && ! ls /sys/bus/pci/devices/$SOLO_NIC/vfio-dev/vfio*/dev"
    step "no /dev/vfio/devices and no /dev/iommu" -- sh -c '! test -e /dev/vfio/devices && ! test -e /dev/iommu'
    expect_not_contains "CDI spec: no /dev/iommu" "$spec" "/dev/iommu"
    expect_not_contains "CDI spec: no device cdev" "$spec" "/dev/vfio/devices/"
fi
step "NodeUnprepareResources" -- kubelet-peer dra unprepare --registry "$REG" --version v1 --claim "vms/vm-solo/$uid"
expect_driver "SOLO_NIC back on e1000e" "$SOLO_NIC" e1000e

note "the IOMMU interface per claim: an opaque VfioConfig in the claim"
# config_claim NAME IOMMU -- creates claim vms/NAME for SOLO_NIC whose
# configuration asks for IOMMU; prints its uid.
config_claim() {
    # shellcheck disable=SC2086
    fake-apiserver claim "vms/$1" --result "nic:$DRIVER:$NODE:$solo_dev" $WAITS \
        --config "$DRIVER={\"apiVersion\":\"$DRIVER/v1alpha1\",\"kind\":\"VfioConfig\",$2}"
}
uid=$(config_claim vm-legacy '"iommu":"legacy"')
step "prepare a claim asking for iommu: legacy (the driver runs with --iommufd)" -- \
    kubelet-peer dra prepare --registry "$REG" --version v1 --claim "vms/vm-legacy/$uid"
cp "$TB_OUT" /tmp/prep-legacy.json
spec=$CDI/$DRIVER-vfio_$uid.json
run_logged cat "$spec"
expect_contains "legacy: the group node" "$spec" "\"path\": \"/dev/vfio/$solo_group\""
expect_not_contains "legacy: no /dev/iommu" "$spec" "/dev/iommu"
expect_not_contains "legacy: no device cdev" "$spec" "/dev/vfio/devices/"
step "QEMU (legacy VFIO) takes vm-legacy's devices" -- kubelet-peer vmm --cdi-from /tmp/prep-legacy.json
expect_contains "SOLO_NIC realized (legacy)" "$TB_OUT" "realized $SOLO_NIC 8086:10d3 (legacy)"
expect_fail "QEMU with iommufd cannot start from vm-legacy's devices" 1 -- \
    kubelet-peer vmm --cdi-from /tmp/prep-legacy.json --iommufd
cp "$TB_OUT" /tmp/vmm-nofd.out
run_logged cat /tmp/vmm-nofd.out
expect_contains "QEMU says why" /tmp/vmm-nofd.out "-device vfio-pci,host=$SOLO_NIC,id=hostdev0,rombar=0,iommufd=iommufd0: vfio $SOLO_NIC: "
step "unprepare it" -- kubelet-peer dra unprepare --registry "$REG" --version v1 --claim "vms/vm-legacy/$uid"
expect_driver "SOLO_NIC back on e1000e" "$SOLO_NIC" e1000e

uid=$(config_claim vm-iommufd '"iommu":"iommufd"')
if [ "$want_cdev" = yes ]; then
    # Moved at allocation (its binding condition), as dra-early-move does it,
    # so QEMU below proves that path through iommufd too.
    step "vm-iommufd is moved at allocation: the driver sets VfioReady" -- \
        fake-apiserver wait vms/vm-iommufd --condition "$DRIVER/VfioReady" --failure-condition "$DRIVER/VfioFailed"
    expect_driver "SOLO_NIC on vfio-pci before the prepare" "$SOLO_NIC" vfio-pci
    step "prepare a claim asking for iommu: iommufd" -- \
        kubelet-peer dra prepare --registry "$REG" --version v1 --claim "vms/vm-iommufd/$uid"
    cp "$TB_OUT" /tmp/prep-fd.json
    spec=$CDI/$DRIVER-vfio_$uid.json
    run_logged cat "$spec"
    solo_cdev=$(cdev_of "$SOLO_NIC")
    expect_contains "iommufd: /dev/iommu" "$spec" '"path": "/dev/iommu"'
    expect_contains "iommufd: the device cdev" "$spec" "\"path\": \"/dev/vfio/devices/$solo_cdev\""
    expect_not_contains "iommufd: no /dev/vfio/vfio" "$spec" '"/dev/vfio/vfio"'
    expect_not_contains "iommufd: no group node" "$spec" "\"path\": \"/dev/vfio/$solo_group\""
    step "QEMU (iommufd) takes vm-iommufd's devices" -- kubelet-peer vmm --cdi-from /tmp/prep-fd.json --iommufd
    cp "$TB_OUT" /tmp/vmm-fd.out
    run_logged cat /tmp/vmm-fd.out
    expect_contains "SOLO_NIC realized through iommufd, BAR 0 mapped" /tmp/vmm-fd.out "realized $SOLO_NIC 8086:10d3 (iommufd) BAR0@"
    expect_fail "QEMU with legacy VFIO cannot start from vm-iommufd's devices" 1 -- \
        kubelet-peer vmm --cdi-from /tmp/prep-fd.json
    expect_contains "QEMU names the VFIO node it could not open" "$TB_OUT" "/dev/vfio/"
    step "unprepare it" -- kubelet-peer dra unprepare --registry "$REG" --version v1 --claim "vms/vm-iommufd/$uid"
else
    expect_fail "iommu: iommufd is refused on a kernel without the device cdev" 1 -- \
        kubelet-peer dra prepare --registry "$REG" --version v1 --claim "vms/vm-iommufd/$uid"
    # Refused before the move when the kernel is known to lack the cdev (a
    # vfio device shows it), otherwise once on vfio-pci and put back.
    cp "$TB_OUT" /tmp/refusal.out
    expect_contains "the refusal names the device" /tmp/refusal.out "$SOLO_NIC"
    expect_contains "the refusal names the configuration" /tmp/refusal.out "is configured with iommu: iommufd"
    expect_contains "the refusal names what is missing" /tmp/refusal.out "VFIO device cdev"
fi
# The claim's early move (the watcher's, on the binding condition) may still be
# putting the device back.
wait_for "SOLO_NIC back on e1000e" 20 -- sh -c "[ \"\$(basename \"\$(readlink /sys/bus/pci/devices/$SOLO_NIC/driver)\")\" = e1000e ]"

uid=$(config_claim vm-typo '"iommu":"legacy","iommuMode":"x"')
expect_fail "a configuration with an unknown field refuses the claim" 1 -- \
    kubelet-peer dra prepare --registry "$REG" --version v1 --claim "vms/vm-typo/$uid"
expect_contains "the refusal names the claim and the field" "$TB_OUT" \
    "claim vms/vm-typo (uid $uid): its configuration is refused: status.allocation.devices.config[0].opaque.parameters (from the claim): unknown field \`iommuMode\`"
expect_driver "nothing moved: SOLO_NIC on e1000e" "$SOLO_NIC" e1000e
step "nothing recorded: the state file names no claim" -- \
    sh -c '! grep -q vm-typo /run/sandbox-dra-driver/state.json 2>/dev/null'
kill -TERM "$driver"
wait "$driver"
expect_eq "the DRA driver exits 0 on SIGTERM" "$?" 0
kill "$apiserver" 2>/dev/null

note "vfio-manager binds everything selected"
if [ -n "${VIRTIO_NIC:-}" ]; then
    # status exits 1 while devices are not bound yet: its report is what counts.
    vfio-manager status >/tmp/status.out 2>&1
    run_logged cat /tmp/status.out
    expect_contains "driver auto picks virtio_vfio_pci from modules.alias" /tmp/status.out \
        "driver for $VIRTIO_NIC: virtio_vfio_pci (auto: /lib/modules/$(uname -r)/modules.alias line"
fi
step "vfio-manager bind --all" -- vfio-manager bind --all
for bdf in "$CARD_FN0" "$CARD_FN1" "$SOLO_NIC"; do
    expect_driver "$bdf on vfio-pci" "$bdf" vfio-pci
done
if [ -n "${VIRTIO_NIC:-}" ]; then
    step "modules.alias lists the variant driver's vfio_pci alias" -- grep -q \
        "^alias vfio_pci:v00001AF4d00001041sv\*sd\*bc\*sc\*i\* virtio_vfio_pci$" "/lib/modules/$(uname -r)/modules.alias"
    expect_driver "VIRTIO_NIC on virtio_vfio_pci" "$VIRTIO_NIC" virtio_vfio_pci
    step "virtio_vfio_pci was loaded by vfio-manager" -- module_loaded virtio_vfio_pci
fi

note "the validator"
step "sandbox-validator passes" -- sandbox-validator
cp "$TB_OUT" /tmp/validator.out
run_logged cat /tmp/validator.out
if [ "$want_cdev" = yes ]; then
    n=3
    [ -n "${VIRTIO_NIC:-}" ] && n=4
    expect_contains "vfio-cdev checks every device's node and /dev/iommu" /tmp/validator.out \
        "vfio-cdev            ok      $n device cdev(s) under /dev/vfio/devices and /dev/iommu present"
    # A missing node fails the check by name: hide one (renamed within devtmpfs)
    # the way a /dev without it would.
    card_cdev=$(cdev_of "$CARD_FN1")
    mv "/dev/vfio/devices/$card_cdev" /dev/vfio/devices/hidden
    expect_fail "the validator fails without CARD_FN1's device cdev" 1 -- sandbox-validator
    expect_contains "vfio-cdev names it" "$TB_OUT" "$CARD_FN1: /dev/vfio/devices/$card_cdev is missing or not a char device"
    mv /dev/vfio/devices/hidden "/dev/vfio/devices/$card_cdev"
else
    expect_contains "vfio-cdev is skipped with the reason" /tmp/validator.out \
        "vfio-cdev            ok      skipped: the kernel has no VFIO device cdev (CONFIG_VFIO_DEVICE_CDEV unset)"
fi

note "the device plugin with --iommufd"
D=/var/lib/kubelet/device-plugins
mkdir -p "$D"
kubelet-peer --dir "$D" serve >/tmp/regs.log 2>&1 &
peer=$!
sandbox-device-plugin --iommufd >/tmp/plugin.log 2>&1 &
plugin=$!
wait_for "plugin registers example.com/NIC_PT" 10 -- grep -q "registered example.com/NIC_PT" /tmp/regs.log
EP=$(awk '$2 == "example.com/NIC_PT" { e = $3 } END { print e }' /tmp/regs.log)
step "Allocate SOLO_NIC and CARD_FN1" -- kubelet-peer --dir "$D" allocate --endpoint "$EP" "$SOLO_NIC" "$CARD_FN1"
cp "$TB_OUT" /tmp/alloc.out
run_logged cat /tmp/alloc.out
expect_contains "/dev/vfio/vfio handed out" /tmp/alloc.out "device /dev/vfio/vfio /dev/vfio/vfio mrw"
expect_contains "SOLO_NIC's group node handed out" /tmp/alloc.out "device /dev/vfio/$solo_group /dev/vfio/$solo_group mrw"
expect_contains "the card's group node handed out" /tmp/alloc.out "device /dev/vfio/$CARD_GROUP /dev/vfio/$CARD_GROUP mrw"
if [ "$want_cdev" = yes ]; then
    expect_contains "/dev/iommu handed out" /tmp/alloc.out "device /dev/iommu /dev/iommu mrw"
    for bdf in "$SOLO_NIC" "$CARD_FN1"; do
        c=$(cdev_of "$bdf")
        expect_contains "$bdf's device cdev $c handed out" /tmp/alloc.out "device /dev/vfio/devices/$c /dev/vfio/devices/$c mrw"
    done
else
    expect_not_contains "no /dev/iommu handed out" /tmp/alloc.out "/dev/iommu"
    expect_not_contains "no device cdev handed out" /tmp/alloc.out "/dev/vfio/devices/"
fi
for node in $(awk '$1 == "device" { print $2 }' /tmp/alloc.out); do
    step "$node is a char device in the guest" -- test -c "$node"
done
# The legacy path still works next to iommufd.
step "QEMU (legacy VFIO) takes the Allocate answer" -- kubelet-peer vmm --allocate /tmp/alloc.out
expect_contains "CARD_FN1 realized (legacy)" "$TB_OUT" "realized $CARD_FN1 8086:10d3 (legacy)"
if [ "$want_cdev" = yes ]; then
    step "QEMU (iommufd) takes the Allocate answer" -- kubelet-peer vmm --allocate /tmp/alloc.out --iommufd
    cp "$TB_OUT" /tmp/vmm-alloc-fd.out
    run_logged cat /tmp/vmm-alloc-fd.out
    expect_contains "SOLO_NIC realized (iommufd)" /tmp/vmm-alloc-fd.out "realized $SOLO_NIC 8086:10d3 (iommufd)"
    expect_contains "CARD_FN1 realized (iommufd)" /tmp/vmm-alloc-fd.out "realized $CARD_FN1 8086:10d3 (iommufd)"
fi
if [ -n "${VIRTIO_NIC:-}" ]; then
    wait_for "plugin registers example.com/VNET_PT" 10 -- grep -q "registered example.com/VNET_PT" /tmp/regs.log
    VEP=$(awk '$2 == "example.com/VNET_PT" { e = $3 } END { print e }' /tmp/regs.log)
    step "Allocate VIRTIO_NIC (on the variant driver)" -- kubelet-peer --dir "$D" allocate --endpoint "$VEP" "$VIRTIO_NIC"
    cp "$TB_OUT" /tmp/valloc.out
    run_logged cat /tmp/valloc.out
    c=$(cdev_of "$VIRTIO_NIC")
    expect_contains "VIRTIO_NIC's device cdev $c handed out" /tmp/valloc.out \
        "device /dev/vfio/devices/$c /dev/vfio/devices/$c mrw"
    step "/dev/vfio/devices/$c is a char device" -- test -c "/dev/vfio/devices/$c"
    step "QEMU (iommufd) takes VIRTIO_NIC on the variant driver" -- kubelet-peer vmm --allocate /tmp/valloc.out --iommufd
    cp "$TB_OUT" /tmp/vmm-vnet.out
    run_logged cat /tmp/vmm-vnet.out
    expect_contains "VIRTIO_NIC realized (iommufd)" /tmp/vmm-vnet.out "realized $VIRTIO_NIC 1af4:1041 (iommufd)"
fi
kill -TERM "$plugin"
wait "$plugin"
expect_eq "plugin exits 0 on SIGTERM" "$?" 0
run_logged tail -n 20 /tmp/plugin.log
kill "$peer" 2>/dev/null
