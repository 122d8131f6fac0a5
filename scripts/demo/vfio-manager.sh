# Demo, run inside the test-bed VM: vfio-manager's bind -> status -> restore cycle
# on a real kernel with an emulated IOMMU. Steps are checked too, so a broken demo
# says so.
# shellcheck shell=sh

export VFIO_SANDBOX_CONFIG=/etc/vfio-sandbox.json
echo '{"resources":[{"name":"example.com/NIC_PT","vendor":"8086","devices":["10d3"]}]}' >"$VFIO_SANDBOX_CONFIG"

note "the resource list: Intel 82574L NICs (8086:10d3) stand in for NPUs"
run_logged cat "$VFIO_SANDBOX_CONFIG"
note "before: devices on their native driver, groups not viable"
run_logged vfio-manager status
note "what bind would write (dry run)"
run_logged vfio-manager bind --all --dry-run
note "bind: loads vfio modules itself, moves whole IOMMU groups"
step "bind --all" -- run_logged vfio-manager bind --all
run_logged vfio-manager status
run_logged ls -l /dev/vfio
run_logged cat /run/vfio-manager/state.json
note "restore: original drivers back"
step "unbind --all" -- run_logged vfio-manager unbind --all
run_logged vfio-manager status
expect_driver "card back on e1000e" "$CARD_FN0" e1000e
