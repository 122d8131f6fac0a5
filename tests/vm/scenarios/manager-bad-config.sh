# vfio-manager scenario 7: bad input exits 2 and writes nothing to sysfs.
# shellcheck shell=sh

snapshot() {
    for d in /sys/bus/pci/devices/*; do
        echo "$(basename "$d") $(driver_of "$(basename "$d")") $(cat "$d/driver_override")"
    done
    ls /sys/module | sort
}
snapshot >/tmp/before

echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"80z6","devices":["10d3"]}]}' >/tmp/bad-hex.json
expect_fail "malformed hex: exit 2" 2 -- vfio-manager --config /tmp/bad-hex.json bind --all
expect_contains "message names the file and entry" "$TB_OUT" "/tmp/bad-hex.json"
expect_contains "message names the bad value" "$TB_OUT" "80z6"

echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"],"colour":"red"}]}' >/tmp/unknown-key.json
expect_fail "unknown key: exit 2" 2 -- vfio-manager --config /tmp/unknown-key.json run
expect_contains "message names the key" "$TB_OUT" "colour"

echo '{"resources":[{"name":"example.com/A","vendor":"8086"},{"name":"example.com/B","vendor":"8086","devices":["10d3"]}]}' >/tmp/overlap.json
expect_fail "overlapping selectors: exit 2" 2 -- vfio-manager --config /tmp/overlap.json bind --all
expect_contains "message names both entries" "$TB_OUT" "example.com/B"

echo '{"resources":[' >/tmp/truncated.json
expect_fail "invalid JSON: exit 2" 2 -- vfio-manager --config /tmp/truncated.json bind --all

echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >/tmp/good.json
expect_fail "unknown BDF: exit 2" 2 -- vfio-manager --config /tmp/good.json bind --device 0000:3b:00.0
expect_contains "message names the device" "$TB_OUT" "0000:3b:00.0"
expect_fail "malformed BDF: exit 2" 2 -- vfio-manager --config /tmp/good.json bind --device 3b:00
expect_fail "unselected device: exit 2" 2 -- vfio-manager --config /tmp/good.json bind --device "$NVME_PF"
expect_contains "says it is not selected" "$TB_OUT" "is not selected"

# Hostile input: a config that would block or never end, a host driver, durations
# that would spin or overflow. All are refused before the node is touched.
mkfifo /tmp/fifo.json
expect_fail "FIFO config: exit 2 without blocking" 2 -- vfio-manager --config /tmp/fifo.json bind --all
expect_contains "says it is a FIFO" "$TB_OUT" "is a FIFO, not a regular file"
expect_fail "/dev/zero config: exit 2" 2 -- vfio-manager --config /dev/zero status
expect_contains "says it is a device" "$TB_OUT" "is a character device, not a regular file"
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"],"driver":"ahci"}]}' >/tmp/ahci.json
expect_fail "host driver in the list: exit 2" 2 -- vfio-manager --config /tmp/ahci.json bind --all
expect_contains "lists what is allowed" "$TB_OUT" "allowed: vfio-pci or a vfio-pci variant driver"
for interval in 0 0ms 18446744073709551615s; do
    expect_fail "run --resync-interval $interval: exit 2, no abort" 2 -- \
        vfio-manager --config /tmp/good.json run --resync-interval "$interval"
    expect_contains "names the flag" "$TB_OUT" "--resync-interval"
done
step "status reads every device of a real kernel" -- vfio-manager --config /tmp/good.json status
expect_not_contains "nothing is skipped" "$TB_OUT" "skipped"

snapshot >/tmp/after
step "no driver, override or module changed" -- cmp /tmp/before /tmp/after
expect_fail "no state file written" 1 -- test -e /run/vfio-manager/state.json
