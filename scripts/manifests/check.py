#!/usr/bin/env python3
"""Checks of rendered manifests, run by scripts/check-manifests.sh.

  check.py k8s VERSION[,VERSION...] FILE...
      Validate every object of every rendered FILE against the Kubernetes
      API schemas that kubernetes-validate bundles, strictly (an unknown
      field is an error). "latest" is the newest version it bundles. An
      object whose kind has no schema is an error too: nothing ships
      unchecked. An API version younger than a Kubernetes version asked
      for (resource.k8s.io/v1 is served from 1.34 on) is skipped at that
      version, and said so; an object skipped at every version asked for
      is an error.
  check.py coexist A.yaml B.yaml
      Two renders meant to run in one cluster: no two objects share
      kind/namespace/name, and no host directory is mounted by both unless
      it is one every node agent shares by design (kernel and kubelet
      interfaces, the owner lock vfio-manager and the DRA driver take), or
      one of the two only reads it (every mount read-only).
  check.py kubevirt SCHEMA.json FILE...
      Validate KubeVirt objects against KubeVirt's API schema (built by
      kubevirt_schema.py). A file without apiVersion/kind is a partial
      KubeVirt CR: it is merged (RFC 7386) into a minimal KubeVirt object
      first, as `kubectl patch --type merge` would.
  check.py examples SCHEMA.json VERSION[,VERSION...] FILE...
      Example files that mix KubeVirt and Kubernetes objects: kubevirt.io
      objects and partial KubeVirt CRs as `kubevirt` does, every other
      object as `k8s` does.
  check.py restore-label FILE...
      Every DaemonSet that runs vfio-manager names its restore label
      (VFIO_MANAGER_RESTORE_LABEL, or the binary's default), and one term of
      its required node affinity selects that label's "true" alone (besides
      the platform labels), so the label keeps the pod scheduled until the
      restore is done. `coexist` also fails two renders sharing a label.
  check.py dra DRA.yaml OTHER.yaml...
      The chart's render with the DRA values deploys the DRA driver and nothing of VM
      mode: no container runs vfio-manager, the device plugin or the
      validator; exactly one DaemonSet runs sandbox-dra-driver; every term
      of its required node affinity excludes each node label that
      schedules a vfio-manager of the OTHER renders; it mounts a host
      directory holding their vfio-manager state only read-only; and every
      DeviceClass selects on the driver's name.
"""
import json
import sys

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils

# Host paths two instances may both mount: sysfs, devfs, the kernel's
# module tree, and kubelet's device-plugin directory (each plugin serves
# its own sockets in it).
SHARED_HOST_PATHS = {
    "/sys",
    "/dev",
    "/lib/modules",
    "/var/lib/kubelet/device-plugins",
    "/var/lib/k0s/kubelet/device-plugins",
    "/var/snap/microk8s/common/var/lib/kubelet/device-plugins",
}

# The node-wide owner lock's directory: vfio-manager and sandbox-dra-driver
# must share it (it is how they keep each other off a node's devices), and the
# device plugin beside vfio-manager reads it (never takes it); two
# vfio-managers must not (the second would never get the lock).
OWNER_LOCK_DIR = "/run/vfio-sandbox/owner"


def owner_lock_shared_by_design(path, users_a, users_b):
    """True for the owner lock directory shared by the DRA driver and vfio-manager
    (with the device plugin reading it beside vfio-manager)."""
    def kind(n):
        return n.split("/")[-1]

    def dra(users):
        return users and all(kind(n).startswith("sandbox-dra-driver") for n, _, _ in users)

    def vm_mode(users):
        takers = [n for n, _, _ in users if kind(n).startswith("vfio-manager")]
        readers = [n for n, _, ro in users
                   if kind(n).startswith("sandbox-device-plugin") and ro]
        return len(takers) == 1 and len(takers) + len(readers) == len(users)
    return path == OWNER_LOCK_DIR and (
        (dra(users_a) and vm_mode(users_b)) or (vm_mode(users_a) and dra(users_b)))


# API versions that a Kubernetes release before the one named does not
# serve: an object of one is validated only against releases that do.
MIN_VERSION = {
    "resource.k8s.io/v1": "1.34",
}

# The DRA driver's default name (sandbox-dra-driver --driver-name).
DRA_DRIVER_NAME = "vfio-sandbox.rebellions.ai"


def version_key(version):
    return tuple(int(p) for p in version.split(".")[:2])


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def name_of(obj):
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace", "")
    return f"{obj.get('kind')}/{ns + '/' if ns else ''}{meta.get('name')}"


def k8s_wanted(versions):
    bundled = kv_utils.latest_version()
    return [bundled if v == "latest" else v for v in versions.split(",")]


def validate_k8s_object(path, obj, wanted, counts):
    """Validate one object at every wanted version; counts: checked, failed, skipped."""
    since = MIN_VERSION.get(obj.get("apiVersion"))
    validated = 0
    for version in wanted:
        if since and version_key(version) < version_key(since):
            key = (obj.get("apiVersion"), version, since)
            counts["skips"][key] = counts["skips"].get(key, 0) + 1
            continue
        counts["checked"] += 1
        validated += 1
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path) or "(top)"
            print(f"FAIL {path}: {name_of(obj)} against {version}: {where}: {e.message}")
            counts["failed"] += 1
        except kubernetes_validate.SchemaNotFoundError as e:
            print(f"FAIL {path}: {name_of(obj)} against {version}: no schema ({e.message})")
            counts["failed"] += 1
    if not validated:
        print(f"FAIL {path}: {name_of(obj)}: validated against none of {', '.join(wanted)} "
              f"({obj.get('apiVersion')} needs Kubernetes {since} or newer)")
        counts["failed"] += 1


def new_counts():
    return {"checked": 0, "failed": 0, "skips": {}}


def k8s_summary(wanted, counts):
    for (api, version, since), n in sorted(counts["skips"].items()):
        print(f"skip {n} {api} object validation(s) against {version}: "
              f"{api} is served from Kubernetes {since} on")
    n_skipped = sum(counts["skips"].values())
    skipped = f", {n_skipped} skipped (API version not served yet)" if n_skipped else ""
    print(f"k8s: {counts['checked'] - counts['failed']}/{counts['checked']} object validations passed"
          f"{skipped} (Kubernetes {', '.join(wanted)}; kubernetes-validate "
          f"{kubernetes_validate.__version__}, strict)")


def cmd_k8s(versions, files):
    wanted = k8s_wanted(versions)
    counts = new_counts()
    for path in files:
        for obj in load(path):
            validate_k8s_object(path, obj, wanted, counts)
    k8s_summary(wanted, counts)
    return 1 if counts["failed"] else 0


def pod_spec(obj):
    spec = obj.get("spec") or {}
    if obj.get("kind") == "Pod":
        return spec
    return ((spec.get("template") or {}).get("spec")) or None


def host_paths(objs):
    """{path: [(object, volume, read-only in every mount)]}"""
    out = {}
    for obj in objs:
        spec = pod_spec(obj)
        if not spec:
            continue
        containers = (spec.get("containers") or []) + (spec.get("initContainers") or [])
        for vol in spec.get("volumes") or []:
            hp = vol.get("hostPath")
            if not hp:
                continue
            mounts = [m for c in containers for m in c.get("volumeMounts") or [] if m.get("name") == vol["name"]]
            ro = all(m.get("readOnly") for m in mounts)
            out.setdefault(hp["path"].rstrip("/") or "/", []).append((name_of(obj), vol["name"], ro))
    return out


def overlaps(a, b):
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def cmd_coexist(a_path, b_path):
    a, b = load(a_path), load(b_path)
    failed = 0
    a_names = {name_of(o) for o in a}
    for o in b:
        if name_of(o) in a_names:
            print(f"FAIL both renders have {name_of(o)}")
            failed += 1
    a_labels = {k for _, k in restore_labels(a) if k}
    for o, k in restore_labels(b):
        if k in a_labels:
            print(f"FAIL both renders' vfio-managers keep restore label {k} ({name_of(o)})")
            failed += 1
    a_paths, b_paths = host_paths(a), host_paths(b)
    shared = 0
    for pa, users_a in sorted(a_paths.items()):
        for pb, users_b in sorted(b_paths.items()):
            if not overlaps(pa, pb):
                continue
            if pa == pb and (pa in SHARED_HOST_PATHS
                             or owner_lock_shared_by_design(pa, users_a, users_b)):
                shared += 1
                continue
            if all(ro for _, _, ro in users_a) or all(ro for _, _, ro in users_b):
                reader = users_a if all(ro for _, _, ro in users_a) else users_b
                print(f"coexist: host path {pa} / {pb}: only read by "
                      f"{', '.join(f'{n} ({v})' for n, v, _ in reader)}")
                continue
            who = ", ".join(f"{n} ({v}{', ro' if ro else ''})" for n, v, ro in users_a + users_b)
            print(f"FAIL host path {pa} and {pb} are used by both: {who}")
            failed += 1
    print(f"coexist: {a_path} and {b_path}: {len(a)} + {len(b)} objects, no name in common"
          if not failed else f"coexist: {failed} conflict(s)")
    if not failed:
        print(f"coexist: host paths shared by design: {shared} "
              f"({', '.join(sorted(p for p in a_paths if p in b_paths and (p in SHARED_HOST_PATHS or owner_lock_shared_by_design(p, a_paths[p], b_paths[p]))))})")
    return 1 if failed else 0


# vfio-manager's --restore-label default (bins/vfio-manager/src/commands/run.rs).
DEFAULT_RESTORE_LABEL = "vfio-sandbox.rebellions.ai/vfio-manager.restore-pending"


def required_terms(spec):
    return ((((spec.get("affinity") or {}).get("nodeAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
            .get("nodeSelectorTerms") or [])


def restore_labels(objs):
    """(object, label key or "") for each DaemonSet that runs vfio-manager."""
    out = []
    for obj in objs:
        for c in agent_containers(obj):
            if binary(c) != "vfio-manager":
                continue
            key = DEFAULT_RESTORE_LABEL
            for e in c.get("env") or []:
                if e.get("name") == "VFIO_MANAGER_RESTORE_LABEL":
                    key = e.get("value") or ""
            argv = (c.get("command") or []) + (c.get("args") or [])
            for i, a in enumerate(argv):
                if a.startswith("--restore-label="):
                    key = a.split("=", 1)[1]
                elif a == "--restore-label" and i + 1 < len(argv):
                    key = argv[i + 1]
            out.append((obj, key))
    return out


def cmd_restore_label(files):
    failed = 0
    for path in files:
        for obj, key in restore_labels(load(path)):
            if not key:
                print(f"FAIL {path}: {name_of(obj)} runs vfio-manager without a restore label")
                failed += 1
                continue
            spec = pod_spec(obj) or {}
            alone = False
            for term in required_terms(spec):
                exprs = term.get("matchExpressions") or []
                mine = [e for e in exprs if e.get("key") == key
                        and e.get("operator") == "In" and "true" in (e.get("values") or [])]
                rest = [e for e in exprs if e not in mine]
                if mine and all(e.get("key") in PLATFORM_LABELS for e in rest) \
                        and not term.get("matchFields"):
                    alone = True
            if spec.get("nodeSelector"):
                print(f"FAIL {path}: {name_of(obj)} has a nodeSelector, which every node must "
                      f"meet: the restore label {key} cannot keep its pod")
                failed += 1
            elif not alone:
                print(f"FAIL {path}: {name_of(obj)}: no required node-affinity term selects "
                      f"its restore label {key}=true alone")
                failed += 1
            else:
                print(f"restore-label: {path}: {name_of(obj)} stays on nodes labelled {key}=true")
    return 1 if failed else 0


def merge_patch(target, patch):
    if not isinstance(patch, dict):
        return patch
    target = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = merge_patch(target.get(k), v)
    return target


ROOTS = {("kubevirt.io/v1", "KubeVirt"): "V1KubeVirt",
         ("kubevirt.io/v1", "VirtualMachine"): "V1VirtualMachine",
         ("kubevirt.io/v1", "VirtualMachineInstance"): "V1VirtualMachineInstance"}


def is_kubevirt(obj):
    """A kubevirt.io object, or a partial KubeVirt CR (no apiVersion/kind)."""
    if "apiVersion" not in obj and "kind" not in obj:
        return True
    return str(obj.get("apiVersion", "")).split("/")[0].endswith("kubevirt.io")


def validate_kubevirt_object(path, obj, defs):
    """True when obj is valid KubeVirt API; prints one line either way."""
    if "apiVersion" not in obj and "kind" not in obj:
        base = {"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt",
                "metadata": {"name": "kubevirt", "namespace": "kubevirt"}, "spec": {}}
        obj = merge_patch(base, obj)
        what = "merge patch into KubeVirt/kubevirt"
    else:
        what = name_of(obj)
    root = ROOTS.get((obj.get("apiVersion"), obj.get("kind")))
    if root is None:
        print(f"FAIL {path}: {what}: no KubeVirt schema for {obj.get('apiVersion')} {obj.get('kind')}")
        return False
    schema = {"$ref": f"#/definitions/{root}", "definitions": defs}
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.path))
    for e in errors:
        where = ".".join(str(p) for p in e.path) or "(top)"
        print(f"FAIL {path}: {what}: {where}: {e.message}")
    if not errors:
        print(f"ok   {path}: {what} ({root})")
    return not errors


def load_kubevirt_defs(schema_path):
    with open(schema_path) as f:
        return json.load(f)["definitions"]


def cmd_kubevirt(schema_path, files):
    defs = load_kubevirt_defs(schema_path)
    failed = checked = 0
    for path in files:
        for obj in load(path):
            checked += 1
            if not validate_kubevirt_object(path, obj, defs):
                failed += 1
    print(f"kubevirt: {checked - failed}/{checked} documents valid")
    return 1 if failed else 0


def cmd_examples(schema_path, versions, files):
    defs = load_kubevirt_defs(schema_path)
    wanted = k8s_wanted(versions)
    kv_checked = kv_failed = 0
    counts = new_counts()
    for path in files:
        for obj in load(path):
            if is_kubevirt(obj):
                kv_checked += 1
                if not validate_kubevirt_object(path, obj, defs):
                    kv_failed += 1
            else:
                before = counts["failed"]
                validate_k8s_object(path, obj, wanted, counts)
                if counts["failed"] == before:
                    print(f"ok   {path}: {name_of(obj)} (Kubernetes API)")
    print(f"kubevirt: {kv_checked - kv_failed}/{kv_checked} documents valid")
    k8s_summary(wanted, counts)
    return 1 if kv_failed or counts["failed"] else 0


# Binaries of the VM-mode agents, which a DRA render must not run.
VM_MODE_BINARIES = {"vfio-manager", "sandbox-device-plugin", "sandbox-validator"}


def containers(obj):
    spec = pod_spec(obj) or {}
    return (spec.get("containers") or []) + (spec.get("initContainers") or [])


def binary(container):
    argv = (container.get("command") or []) + (container.get("args") or [])
    return argv[0].rsplit("/", 1)[-1] if argv else ""


def agent_containers(obj):
    """The containers of a node agent: a DaemonSet's. (The chart's pre-delete
    hook Job runs `vfio-manager uninstall` on any node; it is no agent.)"""
    return containers(obj) if obj.get("kind") == "DaemonSet" else []


# Labels every agent's affinity names for the platform, not for a mode.
PLATFORM_LABELS = {"kubernetes.io/os", "kubernetes.io/arch"}


def vfio_manager_selectors(objs):
    """(object, {label: value}) for each DaemonSet that runs vfio-manager: its
    nodeSelector, and each value an `In` expression of a required node-affinity
    term asks for (the deploy label, the restore label), platform labels aside."""
    out = []
    for obj in objs:
        if any(binary(c) == "vfio-manager" for c in agent_containers(obj)):
            spec = pod_spec(obj) or {}
            selector = list((spec.get("nodeSelector") or {}).items())
            for term in required_terms(spec):
                for e in term.get("matchExpressions") or []:
                    if e.get("operator") == "In" and e.get("key") not in PLATFORM_LABELS:
                        selector += [(e["key"], v) for v in e.get("values") or []]
            out.append((name_of(obj), selector))
    return out


def excludes(terms, key, value):
    """Every required node-affinity term keeps nodes with key=value out."""
    if not terms:
        return False
    for term in terms:
        ok = False
        for e in term.get("matchExpressions") or []:
            if e.get("key") != key:
                continue
            if e.get("operator") == "NotIn" and value in (e.get("values") or []):
                ok = True
            if e.get("operator") == "DoesNotExist":
                ok = True
        if not ok:
            return False
    return True


def state_dirs(objs):
    """Host directories mounted at /run/vfio-manager by vfio-manager containers."""
    dirs = set()
    for obj in objs:
        spec = pod_spec(obj) or {}
        for c in agent_containers(obj):
            if binary(c) != "vfio-manager":
                continue
            for m in c.get("volumeMounts") or []:
                if m.get("mountPath", "").rstrip("/") != "/run/vfio-manager":
                    continue
                for v in spec.get("volumes") or []:
                    if v.get("name") == m.get("name") and v.get("hostPath"):
                        dirs.add(v["hostPath"]["path"].rstrip("/"))
    return dirs


def cmd_dra(dra_path, others):
    objs = load(dra_path)
    failed = 0

    def fail(msg):
        nonlocal failed
        print(f"FAIL {dra_path}: {msg}")
        failed += 1

    for obj in objs:
        for c in containers(obj):
            if binary(c) in VM_MODE_BINARIES:
                fail(f"{name_of(obj)} container {c.get('name')} runs {binary(c)}, a VM-mode agent")
    drivers = [o for o in objs if o.get("kind") == "DaemonSet"
               and any(binary(c) == "sandbox-dra-driver" for c in containers(o))]
    if len(drivers) != 1:
        fail(f"{len(drivers)} DaemonSets run sandbox-dra-driver, expected exactly 1")
    names = set()
    for ds in drivers:
        spec = pod_spec(ds) or {}
        terms = ((((spec.get("affinity") or {}).get("nodeAffinity") or {})
                  .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
                 .get("nodeSelectorTerms") or [])
        excluded = 0
        for other in others:
            for who, selector in vfio_manager_selectors(load(other)):
                for key, value in sorted(selector):
                    if excludes(terms, key, value):
                        excluded += 1
                    else:
                        fail(f"{name_of(ds)} may run beside {who} of {other}: "
                             f"its node affinity does not exclude {key}={value}")
        read_only = {}
        for v in spec.get("volumes") or []:
            hp = v.get("hostPath")
            if not hp:
                continue
            mounts = [m for c in containers(ds) for m in c.get("volumeMounts") or [] if m.get("name") == v["name"]]
            read_only[hp["path"].rstrip("/")] = all(m.get("readOnly") for m in mounts)
        watched = set()
        for d in sorted(set().union(*(state_dirs(load(other)) for other in others))):
            if d in read_only:
                if read_only[d]:
                    watched.add(d)
                else:
                    fail(f"{name_of(ds)} mounts vfio-manager's state directory {d} writable")
        for c in containers(ds):
            for e in c.get("env") or []:
                if e.get("name") == "VFIO_SANDBOX_DRIVER_NAME" and e.get("value"):
                    names.add(e["value"])
            argv = (c.get("command") or []) + (c.get("args") or [])
            for i, a in enumerate(argv):
                if a.startswith("--driver-name="):
                    names.add(a.split("=", 1)[1])
                elif a == "--driver-name" and i + 1 < len(argv):
                    names.add(argv[i + 1])
        print(f"dra: {name_of(ds)} runs sandbox-dra-driver; its node affinity excludes "
              f"{excluded} vfio-manager node label(s) of {len(others)} render(s); "
              f"mounts no vfio-manager state directory writable"
              f"{' (reads ' + ', '.join(sorted(watched)) + ')' if watched else ''}")
    driver = names.pop() if len(names) == 1 else DRA_DRIVER_NAME
    if names:
        fail(f"more than one driver name set: {sorted(names | {driver})}")
    classes = [o for o in objs if o.get("kind") == "DeviceClass"]
    if not classes:
        fail("no DeviceClass")
    for dc in classes:
        exprs = [((sel.get("cel") or {}).get("expression") or "")
                 for sel in (dc.get("spec") or {}).get("selectors") or []]
        if not any(f'device.driver == "{driver}"' in e for e in exprs):
            fail(f"{name_of(dc)} does not select device.driver == \"{driver}\"")
    print(f"dra: {len(classes)} DeviceClass(es), each selecting driver {driver}")
    print("dra: no VM-mode agent (vfio-manager, device plugin, validator) deployed"
          if not failed else f"dra: {failed} problem(s)")
    return 1 if failed else 0


def main(argv):
    if len(argv) >= 3 and argv[1] == "k8s":
        return cmd_k8s(argv[2], argv[3:])
    if len(argv) == 4 and argv[1] == "coexist":
        return cmd_coexist(argv[2], argv[3])
    if len(argv) >= 4 and argv[1] == "kubevirt":
        return cmd_kubevirt(argv[2], argv[3:])
    if len(argv) >= 5 and argv[1] == "examples":
        return cmd_examples(argv[2], argv[3], argv[4:])
    if len(argv) >= 3 and argv[1] == "restore-label":
        return cmd_restore_label(argv[2:])
    if len(argv) >= 4 and argv[1] == "dra":
        return cmd_dra(argv[2], argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
