#!/usr/bin/env python3
"""A grpc-core client (Python grpcio) against the real sandbox-device-plugin.

grpc-core clients (grpcio >= 1.57, C++) send the percent-encoded socket path as the
HTTP/2 :authority of every call on a Unix socket. This script starts the plugin on a
fake node (tests/bench's fake-node) with the kubelet-like peer, connects with
grpc.insecure_channel("unix:" + socket), and calls GetDevicePluginOptions,
ListAndWatch, Allocate and GetPreferredAllocation, checking each answer. It prints
one line per check, then "N passed, N failed", and exits 1 when any check failed.

    grpc_core_client.py --plugin target/debug/sandbox-device-plugin \
                        --peer target/debug/kubelet-peer --fake-node target/debug/fake-node
"""

import argparse
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
from grpc_tools import protoc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NIC = "example.com/NIC_PT"
DEADLINE = 10  # seconds, for every wait and call


class Checks:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def check(self, name, ok, detail=""):
        if ok:
            self.passed += 1
            print(f"PASS {name}")
        else:
            self.failed += 1
            print(f"FAIL {name}: {detail}")

    def call(self, name, fn):
        """Runs one RPC; a gRPC error is a failed check and returns None."""
        try:
            return fn()
        except grpc.RpcError as e:
            self.check(name, False, f"{e.code()}: {e.details()}")
            return None


def stubs(out_dir):
    """Generates api_pb2 and api_pb2_grpc from proto/api.proto and imports them."""
    os.makedirs(out_dir)
    proto_dir = os.path.join(REPO, "proto")
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{proto_dir}", f"-I{include}",
        f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", "api.proto",
    ])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {proto_dir}/api.proto ({rc})")
    sys.path.insert(0, out_dir)
    import api_pb2
    import api_pb2_grpc
    return api_pb2, api_pb2_grpc


def wait_registration(peer, resource):
    """The endpoint the plugin registered `resource` with, from the peer's output."""
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in peer.stdout], daemon=True).start()
    end = time.monotonic() + DEADLINE
    while (left := end - time.monotonic()) > 0:
        try:
            parts = lines.get(timeout=left).split()
        except queue.Empty:
            break
        if parts[:2] == ["registered", resource]:
            return parts[2]
    raise RuntimeError(f"no registration of {resource} within {DEADLINE} s")


def run(args, checks, root):
    pb, rpc = stubs(os.path.join(root, "gen"))
    subprocess.run([args.fake_node, "--root", root], check=True)
    kubelet = os.path.join(root, "kubelet")
    log = open(os.path.join(root, "plugin.log"), "w")
    peer = subprocess.Popen([args.peer, "--dir", kubelet, "serve"],
                            stdout=subprocess.PIPE, text=True)
    plugin = subprocess.Popen(
        [args.plugin, "--sysfs-root", os.path.join(root, "sys"),
         "--dev-root", os.path.join(root, "dev"), "--kubelet-dir", kubelet,
         "--config", os.path.join(root, "list.json"),
         # the authority rewrite logs each change at trace level
         "--log-level", "debug,kubelet_api=trace"],
        stdout=subprocess.DEVNULL, stderr=log,
        env={k: v for k, v in os.environ.items() if not k.startswith("VFIO_SANDBOX_")})
    try:
        endpoint = wait_registration(peer, NIC)
        socket = os.path.join(kubelet, endpoint)
        with grpc.insecure_channel("unix:" + socket) as channel:
            grpc.channel_ready_future(channel).result(timeout=DEADLINE)
            client = rpc.DevicePluginStub(channel)
            calls(client, pb, checks)
        with open(os.path.join(root, "plugin.log")) as f:
            text = f.read()
        checks.check("the client's :authority was a socket path, rewritten by the plugin",
                     any("rewrote :authority" in l and "%2F" in l for l in text.splitlines()),
                     "no rewrite of a percent-encoded path in the plugin log")
    finally:
        plugin.send_signal(signal.SIGTERM)
        try:
            code = plugin.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            plugin.kill()
            code = None
        peer.kill()
        peer.wait()
        log.close()
    checks.check("plugin exits 0 on SIGTERM", code == 0, f"exit {code}")


def calls(client, pb, checks):
    opts = checks.call("GetDevicePluginOptions",
                       lambda: client.GetDevicePluginOptions(pb.Empty(), timeout=DEADLINE))
    if opts is not None:
        checks.check("GetDevicePluginOptions",
                     opts.get_preferred_allocation_available and not opts.pre_start_required,
                     str(opts))

    stream = client.ListAndWatch(pb.Empty(), timeout=DEADLINE)
    first = checks.call("ListAndWatch", lambda: next(stream))
    stream.cancel()
    if first is not None:
        got = sorted((d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in first.devices)
        want = [("0000:01:00.0", "Healthy", [0]), ("0000:01:00.1", "Healthy", [0]),
                ("0000:02:00.0", "Healthy", [1])]
        checks.check("ListAndWatch first message", got == want, f"{got}")

    ask = pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=["0000:02:00.0", "01:00.1"])])
    r = checks.call("Allocate", lambda: client.Allocate(ask, timeout=DEADLINE))
    if r is not None:
        c = r.container_responses[0]
        checks.check("Allocate env", dict(c.envs) == {
            "PCI_RESOURCE_EXAMPLE_COM_NIC_PT": "0000:02:00.0,0000:01:00.1"}, f"{dict(c.envs)}")
        paths = [(d.host_path, d.container_path, d.permissions) for d in c.devices]
        checks.check("Allocate devices", paths == [
            ("/dev/vfio/vfio", "/dev/vfio/vfio", "mrw"), ("/dev/vfio/6", "/dev/vfio/6", "mrw"),
            ("/dev/vfio/5", "/dev/vfio/5", "mrw")], f"{paths}")

    bad = pb.AllocateRequest(container_requests=[
        pb.ContainerAllocateRequest(devices_ids=[f"0001:{i // 256 % 256:02x}:00.0" for i in range(1000)])])
    try:
        client.Allocate(bad, timeout=DEADLINE)
        checks.check("Allocate of unknown IDs fails", False, "it succeeded")
    except grpc.RpcError as e:
        checks.check("Allocate of unknown IDs is INVALID_ARGUMENT with a short message",
                     e.code() == grpc.StatusCode.INVALID_ARGUMENT and "and 990 more" in e.details()
                     and len(e.details()) < 400, f"{e.code()}: {e.details()[:200]}")

    pref = pb.PreferredAllocationRequest(container_requests=[
        pb.ContainerPreferredAllocationRequest(
            available_deviceIDs=["0000:01:00.0", "0000:01:00.1", "0000:02:00.0"],
            must_include_deviceIDs=["0000:02:00.0", "0000:09:00.0"], allocation_size=2)])
    r = checks.call("GetPreferredAllocation",
                    lambda: client.GetPreferredAllocation(pref, timeout=DEADLINE))
    if r is not None:
        ids = list(r.container_responses[0].deviceIDs)
        checks.check("GetPreferredAllocation", ids == ["0000:02:00.0", "0000:01:00.0"], f"{ids}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plugin", required=True, help="the sandbox-device-plugin binary")
    p.add_argument("--peer", required=True, help="the kubelet-peer binary")
    p.add_argument("--fake-node", required=True, help="the fake-node binary (tests/bench)")
    args = p.parse_args()
    print(f"grpcio {grpc.__version__}")
    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="grpc-interop-") as root:
        try:
            run(args, checks, root)
        except Exception as e:  # report, never skip
            checks.check("scenario ran to the end", False, repr(e))
    print(f"{checks.passed} passed, {checks.failed} failed")
    sys.exit(0 if checks.failed == 0 and checks.passed > 0 else 1)


if __name__ == "__main__":
    main()
