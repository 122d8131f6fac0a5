#!/usr/bin/env python3
"""A grpc-core client (Python grpcio) against the real sandbox-dra-driver.

kubelet's plugin watcher dials a DRA driver's registration socket, and kubelet
1.32 its dra.sock, with the bare socket path, so grpc-go sends the path,
percent-encoded, as the HTTP/2 :authority of every call ("%2Fvar%2Flib%2F...").
grpc-core clients (grpcio >= 1.57) send the path of a "unix:" + path channel
percent-encoded too, less its leading "/" ("var%2Flib%2F..."): not kubelet's bytes
(the Rust peer sends those), but an authority h2 refuses just the same. This script starts
the stand-in API server (holding the Node and the ResourceClaims) and the driver
on a fake node, then with grpc.insecure_channel("unix:" + socket) calls
Registration.GetInfo and NotifyRegistrationStatus on the registration socket,
and NodePrepareResources / NodeUnprepareResources on dra.sock in both DRA
versions (v1 and v1beta1), and opens the device health stream
(DRAResourceHealth.NodeWatchResources, v1 and v1alpha1) there, checking each answer
and that the driver rewrote the percent-encoded authority. It prints one line per check, then
"N passed, N failed", and exits 1 when any check failed.

    grpc_core_dra_client.py --driver target/debug/sandbox-dra-driver \
        --apiserver target/debug/fake-apiserver --fake-node target/debug/fake-node
"""

import argparse
import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_tools import protoc

from grpc_core_client import Checks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = "vfio-sandbox.rebellions.ai"
NODE = "node-a"
NS = "vms"
DEADLINE = 10  # seconds, for every wait and call
PROTOS = ["pluginregistration/v1/api.proto", "dra/v1/api.proto", "dra/v1beta1/api.proto"]
# The health protos live under proto/dra-health/, a name Python cannot import:
# compiled from a copy under dra_health/ (the wire names come from the packages).
HEALTH = ["dra_health/v1/api.proto", "dra_health/v1alpha1/api.proto"]


def stubs(out_dir):
    """Generates and imports the registration and both DRA versions' stubs."""
    os.makedirs(out_dir)
    proto_dir = os.path.join(REPO, "proto")
    copies = os.path.join(out_dir, "src")
    for h in HEALTH:
        os.makedirs(os.path.join(copies, os.path.dirname(h)))
        with open(os.path.join(proto_dir, h.replace("dra_health", "dra-health"))) as f:
            text = f.read()
        with open(os.path.join(copies, h), "w") as f:
            f.write(text)
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    rc = protoc.main(["grpc_tools.protoc", f"-I{proto_dir}", f"-I{copies}", f"-I{include}",
                      f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
                      *PROTOS, *HEALTH])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTOS + HEALTH} ({rc})")
    sys.path.insert(0, out_dir)
    mods = {}
    for p in PROTOS + HEALTH:
        name = p[:-len(".proto")].replace("/", ".")
        mods[p.split("/api.proto")[0]] = (importlib.import_module(name + "_pb2"),
                                          importlib.import_module(name + "_pb2_grpc"))
    return mods


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, ok):
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        if ok():
            return
        time.sleep(0.05)
    raise RuntimeError(f"no {what} within {DEADLINE} s")


def listening(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def claim(args, url, name, results):
    """Creates an allocated ResourceClaim; returns its uid."""
    cmd = [args.apiserver, "claim", "--server", url, f"{NS}/{name}"]
    for r in results:
        cmd += ["--result", f"{r[0]}:{DRIVER}:{NODE}:{r[1]}"]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def run(args, checks, root):
    mods = stubs(os.path.join(root, "gen"))
    subprocess.run([args.fake_node, "--root", root], check=True)
    for m in ["vfio", "vfio_iommu_type1", "vfio_pci"]:
        os.makedirs(os.path.join(root, "sys", "module", m), exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    kubeconfig = os.path.join(root, "kubeconfig")
    api = subprocess.Popen([args.apiserver, "serve", "--listen", f"127.0.0.1:{port}",
                            "--kubeconfig", kubeconfig, "--node", NODE],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    registry = os.path.join(root, "plugins_registry")
    reg_sock = os.path.join(registry, f"{DRIVER}-reg.sock")
    dra_sock = os.path.join(root, "plugins", DRIVER, "dra.sock")
    log_path = os.path.join(root, "driver.log")
    log = open(log_path, "w")
    driver = None
    code = None
    try:
        wait_for("API server", lambda: listening(port) and os.path.exists(kubeconfig))
        env = {k: v for k, v in os.environ.items() if not k.startswith("VFIO_SANDBOX_")}
        env.update({"KUBECONFIG": kubeconfig, "NODE_NAME": NODE,
                    "VFIO_SANDBOX_PREPARE_TIMEOUT": "10s"})
        driver = subprocess.Popen(
            [args.driver, "--sysfs-root", os.path.join(root, "sys"),
             "--dev-root", os.path.join(root, "dev"),
             "--modules-root", os.path.join(root, "lib", "modules"),
             "--config", os.path.join(root, "list.json"),
             "--registry-dir", registry, "--plugins-dir", os.path.join(root, "plugins"),
             "--cdi-dir", os.path.join(root, "cdi"), "--metadata-dir", os.path.join(root, "metadata"),
             "--state-file", os.path.join(root, "run", "dra", "state.json"),
             "--owner-lock", os.path.join(root, "run", "owner", "owner.lock"),
             "--ready-file", os.path.join(root, "run", "dra", "ready"),
             "--log-level", "debug,kubelet_api=trace"],
            stdout=subprocess.DEVNULL, stderr=log, env=env)
        wait_for("registration socket", lambda: os.path.exists(reg_sock) or driver.poll() is not None)
        if driver.poll() is not None:
            raise RuntimeError(f"the driver exited {driver.returncode}: {open(log_path).read()}")

        reg_pb, reg_rpc = mods["pluginregistration/v1"]
        with grpc.insecure_channel("unix:" + reg_sock) as channel:
            grpc.channel_ready_future(channel).result(timeout=DEADLINE)
            registration(reg_rpc.RegistrationStub(channel), reg_pb, checks, dra_sock)

        card = claim(args, url, "vm-card", [("card", "pci-0000-01-00-0"), ("card", "pci-0000-01-00-1")])
        nic = claim(args, url, "vm-nic", [("nic", "pci-0000-02-00-0")])
        with grpc.insecure_channel("unix:" + dra_sock) as channel:
            grpc.channel_ready_future(channel).result(timeout=DEADLINE)
            for version, (pb, rpc), name, uid, devices in [
                ("v1", mods["dra/v1"], "vm-card", card, ["pci-0000-01-00-0", "pci-0000-01-00-1"]),
                ("v1beta1", mods["dra/v1beta1"], "vm-nic", nic, ["pci-0000-02-00-0"]),
            ]:
                dra(version, rpc.DRAPluginStub(channel), pb, checks, name, uid, devices)
            for version in ["v1", "v1alpha1"]:
                pb, rpc = mods[f"dra_health/{version}"]
                health(version, rpc.DRAResourceHealthStub(channel), pb, checks)

        with open(log_path) as f:
            text = f.read()
        for what, path in [("registration socket", reg_sock), ("dra.sock", dra_sock)]:
            # grpc-core makes the authority of "unix:" + path from the path less
            # its leading "/", percent-encoded ("tmp%2F...", where grpc-go, dialing
            # the bare path, sends "%2Ftmp%2F..."): invalid for h2 all the same.
            core = path.lstrip("/").replace("/", "%2F")
            rewritten = [l for l in text.splitlines() if "rewrote :authority" in l]
            checks.check(f"the {what} calls carried the percent-encoded path, rewritten by the driver",
                         any(f"from={core} " in l for l in rewritten),
                         f"no rewrite of {core} in the driver log: this grpcio sent another "
                         f"authority; {' / '.join(rewritten)[:600]}")
    finally:
        if driver is not None:
            driver.send_signal(signal.SIGTERM)
            try:
                code = driver.wait(timeout=DEADLINE)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait()
        api.kill()
        api.wait()
        log.close()
    checks.check("driver exits 0 on SIGTERM", code == 0, f"exit {code}")


def registration(client, pb, checks, dra_sock):
    info = checks.call("GetInfo", lambda: client.GetInfo(pb.InfoRequest(), timeout=DEADLINE))
    if info is not None:
        got = (info.type, info.name, info.endpoint, list(info.supported_versions))
        want = ("DRAPlugin", DRIVER, dra_sock, ["v1.DRAPlugin", "v1beta1.DRAPlugin",
                                                "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"])
        checks.check("GetInfo", got == want, f"{got}")
    r = checks.call("NotifyRegistrationStatus", lambda: client.NotifyRegistrationStatus(
        pb.RegistrationStatus(plugin_registered=True), timeout=DEADLINE))
    checks.check("NotifyRegistrationStatus", r is not None)


def dra(version, client, pb, checks, name, uid, devices):
    claims = [pb.Claim(namespace=NS, uid=uid, name=name)]
    r = checks.call(f"{version} NodePrepareResources",
                    lambda: client.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=claims),
                                                        timeout=DEADLINE))
    if r is not None:
        got = r.claims.get(uid)
        names = sorted(d.device_name for d in got.devices) if got else None
        checks.check(f"{version} NodePrepareResources",
                     list(r.claims.keys()) == [uid] and got.error == "" and names == devices
                     and all(d.cdi_device_ids for d in got.devices), f"{r}")
    r = checks.call(f"{version} NodeUnprepareResources",
                    lambda: client.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=claims),
                                                          timeout=DEADLINE))
    if r is not None:
        checks.check(f"{version} NodeUnprepareResources",
                     list(r.claims.keys()) == [uid] and r.claims[uid].error == "", f"{r}")


def health(version, client, pb, checks):
    """The first message of the health stream: every selected device of the fake
    node and the group device of its two-function card, Healthy, in this node's
    pool, with the driver's 60 s timeout."""
    stream = client.NodeWatchResources(pb.NodeWatchResourcesRequest(), timeout=DEADLINE)
    first = checks.call(f"{version} NodeWatchResources", lambda: next(stream))
    stream.cancel()
    if first is None:
        return
    got = sorted((d.device.pool_name, d.device.device_name, d.health, d.health_check_timeout_seconds)
                 for d in first.devices)
    # The card's two functions share IOMMU group 5: its group device too.
    want = [(NODE, n, pb.HEALTHY, 60) for n in
            ["group-0000-01-00-0", "pci-0000-01-00-0", "pci-0000-01-00-1", "pci-0000-02-00-0",
             "pci-0000-03-00-0"]]
    checks.check(f"{version} NodeWatchResources: every device Healthy",
                 got == want and all(d.message for d in first.devices), f"{first}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--driver", required=True, help="the sandbox-dra-driver binary")
    p.add_argument("--apiserver", required=True, help="the fake-apiserver binary")
    p.add_argument("--fake-node", required=True, help="the fake-node binary (tests/bench)")
    args = p.parse_args()
    print(f"grpcio {grpc.__version__}")
    checks = Checks()
    with tempfile.TemporaryDirectory(prefix="grpc-interop-dra-") as root:
        try:
            run(args, checks, root)
        except Exception as e:  # report, never skip
            checks.check("scenario ran to the end", False, repr(e))
    print(f"{checks.passed} passed, {checks.failed} failed")
    sys.exit(0 if checks.failed == 0 and checks.passed > 0 else 1)


if __name__ == "__main__":
    main()
