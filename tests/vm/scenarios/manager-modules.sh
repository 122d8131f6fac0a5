# vfio-manager scenario 5: run loads the vfio modules itself (no modprobe), and
# keeps the node converged when a device comes back after a PCI remove + rescan.
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/tmp/list.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"
READY=/run/vfio-manager/ready

for m in vfio vfio_pci vfio_iommu_type1; do
    expect_fail "$m not loaded before run" 1 -- module_loaded "$m"
done
# Make sure no modprobe can be what loads them.
rm -f /sbin/modprobe /bin/modprobe /sbin/insmod /bin/insmod

vfio-manager run --resync-interval 1h >/tmp/run.log 2>&1 &
pid=$!
wait_for "run writes the ready file" 30 -- test -e "$READY"
run_logged cat /tmp/run.log
for m in vfio vfio_pci vfio_iommu_type1; do
    step "$m loaded by run" -- module_loaded "$m"
done
expect_contains "run logged the module loads" /tmp/run.log "loaded module"
# Loaded from the files modules.dep names, as the kernel package ships them:
# .ko on Debian 12's 6.1, .ko.xz on Debian 13's 6.12 (finit_module with
# MODULE_INIT_COMPRESSED_FILE; the kernel decompresses).
vfio_file=$(sed -n 's#^\([^:]*/vfio\.ko[^:]*\):.*#\1#p' "/lib/modules/$(uname -r)/modules.dep")
expect_ne "modules.dep lists vfio" "$vfio_file" ""
expect_contains "run loaded vfio from $vfio_file as shipped" /tmp/run.log "file=/lib/modules/$(uname -r)/$vfio_file"
case "$vfio_file" in
    *.ko) pass "this kernel ships its modules uncompressed" ;;
    *) expect_eq "the kernel decompresses ${vfio_file##*.} modules itself" \
        "$(cat /sys/module/compression 2>/dev/null)" "${vfio_file##*.}" ;;
esac
expect_driver "CARD_FN0 on vfio-pci" "$CARD_FN0" vfio-pci
expect_driver "SOLO_NIC on vfio-pci" "$SOLO_NIC" vfio-pci

note "remove SOLO_NIC and rescan, three times: run rebinds it each time"
# Each removal fires uevents while sysfs still lists the dying device; a resync
# that meets it half-gone must skip it, not stop the daemon.
for round in 1 2 3; do
    step "round $round: remove SOLO_NIC" -- sysfs_write "/sys/bus/pci/devices/$SOLO_NIC/remove" 1
    step "round $round: PCI rescan" -- sysfs_write /sys/bus/pci/rescan 1
    wait_for "round $round: SOLO_NIC rebound to vfio-pci by run (uevent; resync is 1h)" 5 -- \
        sh -c "[ \"\$(basename \$(readlink /sys/bus/pci/devices/$SOLO_NIC/driver))\" = vfio-pci ]"
done
step "run is still alive" -- kill -0 "$pid"
run_logged tail -n 5 /tmp/run.log

kill -TERM "$pid"
wait "$pid"
expect_eq "run exits 0 after SIGTERM" "$?" 0
expect_driver "SOLO_NIC restored" "$SOLO_NIC" e1000e
expect_driver "CARD_FN0 restored" "$CARD_FN0" e1000e
