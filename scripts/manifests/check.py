#!/usr/bin/env python3
"""Checks of rendered manifests, run by scripts/check-manifests.sh.

  check.py k8s VERSION[,VERSION...] FILE...
      Validate every object of every rendered FILE against the Kubernetes
      API schemas that kubernetes-validate bundles, strictly (an unknown
      field is an error). "latest" is the newest version it bundles. An
      object whose kind has no schema is an error too: nothing ships
      unchecked.
  check.py coexist A.yaml B.yaml
      Two renders meant to run in one cluster: no two objects share
      kind/namespace/name, and no host directory is mounted by both unless
      it is one every node agent shares by design (kernel and kubelet
      interfaces).
  check.py kubevirt SCHEMA.json FILE...
      Validate KubeVirt objects against KubeVirt's API schema (built by
      kubevirt_schema.py). A file without apiVersion/kind is a partial
      KubeVirt CR: it is merged (RFC 7386) into a minimal KubeVirt object
      first, as `kubectl patch --type merge` would.
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


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def name_of(obj):
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace", "")
    return f"{obj.get('kind')}/{ns + '/' if ns else ''}{meta.get('name')}"


def cmd_k8s(versions, files):
    bundled = kv_utils.latest_version()
    wanted = [bundled if v == "latest" else v for v in versions.split(",")]
    failed = checked = 0
    for path in files:
        for obj in load(path):
            for version in wanted:
                checked += 1
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    where = ".".join(str(p) for p in e.path) or "(top)"
                    print(f"FAIL {path}: {name_of(obj)} against {version}: {where}: {e.message}")
                    failed += 1
                except kubernetes_validate.SchemaNotFoundError as e:
                    print(f"FAIL {path}: {name_of(obj)} against {version}: no schema ({e.message})")
                    failed += 1
    print(f"k8s: {checked - failed}/{checked} object validations passed "
          f"(Kubernetes {', '.join(wanted)}; kubernetes-validate {kubernetes_validate.__version__}, strict)")
    return 1 if failed else 0


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
    a_paths, b_paths = host_paths(a), host_paths(b)
    shared = 0
    for pa, users_a in sorted(a_paths.items()):
        for pb, users_b in sorted(b_paths.items()):
            if not overlaps(pa, pb):
                continue
            if pa == pb and pa in SHARED_HOST_PATHS:
                shared += 1
                continue
            who = ", ".join(f"{n} ({v}{', ro' if ro else ''})" for n, v, ro in users_a + users_b)
            print(f"FAIL host path {pa} and {pb} are used by both: {who}")
            failed += 1
    print(f"coexist: {a_path} and {b_path}: {len(a)} + {len(b)} objects, no name in common"
          if not failed else f"coexist: {failed} conflict(s)")
    if not failed:
        print(f"coexist: host paths shared by design: {shared} "
              f"({', '.join(sorted(p for p in a_paths if p in b_paths))})")
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


def cmd_kubevirt(schema_path, files):
    with open(schema_path) as f:
        defs = json.load(f)["definitions"]
    failed = checked = 0
    for path in files:
        for obj in load(path):
            if "apiVersion" not in obj and "kind" not in obj:
                base = {"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt",
                        "metadata": {"name": "kubevirt", "namespace": "kubevirt"}, "spec": {}}
                obj = merge_patch(base, obj)
                what = "merge patch into KubeVirt/kubevirt"
            else:
                what = name_of(obj)
            root = ROOTS.get((obj.get("apiVersion"), obj.get("kind")))
            checked += 1
            if root is None:
                print(f"FAIL {path}: {what}: no KubeVirt schema for {obj.get('apiVersion')} {obj.get('kind')}")
                failed += 1
                continue
            schema = {"$ref": f"#/definitions/{root}", "definitions": defs}
            errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.path))
            for e in errors:
                where = ".".join(str(p) for p in e.path) or "(top)"
                print(f"FAIL {path}: {what}: {where}: {e.message}")
            if errors:
                failed += 1
            else:
                print(f"ok   {path}: {what} ({root})")
    print(f"kubevirt: {checked - failed}/{checked} documents valid")
    return 1 if failed else 0


def main(argv):
    if len(argv) >= 3 and argv[1] == "k8s":
        return cmd_k8s(argv[2], argv[3:])
    if len(argv) == 4 and argv[1] == "coexist":
        return cmd_coexist(argv[2], argv[3])
    if len(argv) >= 4 and argv[1] == "kubevirt":
        return cmd_kubevirt(argv[2], argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
