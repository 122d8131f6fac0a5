#!/usr/bin/env python3
"""The import graph of the workspace's own code, and its circles.

Usage: scripts/import-graph.py [--quiet]

Nodes are the modules of each crate (one per file: src/a.rs and src/a/b.rs
are `a` and `a::b`; lib.rs and main.rs are the crate root). An edge runs from
a module to each module of the same crate it names (`crate::x::...`,
`super::...`), and from a crate to each workspace crate in its Cargo.toml's
[dependencies]. Test code is left out (files named tests.rs, tests/ and
examples/ directories, and everything after `#[cfg(test)]` in a file), as are
comments, and edges between a module and its own ancestors or descendants
(`use super::*` in a child is Rust's way of nesting, not a circle).

It prints each circle (a strongly connected set of more than one module, or
of crates) and each upward arrow (a crate depending on one listed after it in
the table of docs/layout.md, which lists the layers bottom up), and exits 1 if
there is any.
"""

import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def members():
    with open(os.path.join(ROOT, "Cargo.toml"), "rb") as f:
        ws = tomllib.load(f)["workspace"]
    out = {}
    for m in ws["members"]:
        with open(os.path.join(ROOT, m, "Cargo.toml"), "rb") as f:
            pkg = tomllib.load(f)
        out[pkg["package"]["name"]] = (m, pkg)
    return out


def module_of(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel in (["lib"], ["main"]):
        return ()
    if rel[-1] == "mod":
        rel = rel[:-1]
    return tuple(rel)


def product_text(path):
    lines = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip().startswith("#[cfg(test)]"):
                break
            code = line.split("//", 1)[0]
            lines.append(code)
    return "\n".join(lines)


PATH = re.compile(r"\b(crate|super)((?:::\w+)+)")
USE_GROUP = re.compile(r"\buse\s+(crate|super)((?:::\w+)*)::\{([^;]*)\};", re.S)


def edges_of(mod, text, modules):
    targets = set()

    def resolve(base, parts):
        start = () if base == "crate" else mod[:-1]
        # super::super::x
        while parts and parts[0] == "super":
            start = start[:-1]
            parts = parts[1:]
        full = start + tuple(parts)
        for n in range(len(full), -1, -1):
            if full[:n] in modules:
                return full[:n]
        return None

    for m in USE_GROUP.finditer(text):
        base, prefix, group = m.group(1), m.group(2), m.group(3)
        prefix_parts = [p for p in prefix.split("::") if p]
        for item in re.split(r"[,\s]+", re.sub(r"\{[^}]*\}", "", group)):
            item = item.strip()
            if not item or item == "self":
                continue
            t = resolve(base, prefix_parts + item.split("::"))
            if t is not None:
                targets.add(t)
    for m in PATH.finditer(text):
        t = resolve(m.group(1), [p for p in m.group(2).split("::") if p])
        if t is not None:
            targets.add(t)
    related = lambda a, b: a[: len(b)] == b or b[: len(a)] == a
    return {t for t in targets if not related(t, mod)}


def sccs(graph):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def layer_order():
    """Each crate directory's row in the table of docs/layout.md (bottom up)."""
    rows = {}
    with open(os.path.join(ROOT, "docs", "layout.md")) as f:
        for line in f:
            m = re.match(r"^\| `([^`]+)` \|", line)
            if m:
                rows[m.group(1)] = len(rows)
    return rows


def main():
    quiet = "--quiet" in sys.argv
    crates = members()
    rows = layer_order()
    upward = []
    circles = []
    modules_total = edges_total = 0
    crate_graph = {}
    for name, (path, pkg) in sorted(crates.items()):
        deps = set(pkg.get("dependencies", {})) & set(crates)
        crate_graph[name] = deps
        for dep in sorted(deps):
            mine, theirs = rows.get(path), rows.get(crates[dep][0])
            if mine is None or theirs is None or theirs > mine:
                upward.append((name, dep))
        src = os.path.join(ROOT, path, "src")
        files = []
        for d, dirs, fs in os.walk(src):
            dirs[:] = [x for x in dirs if x not in ("tests", "examples", "bin")]
            files += [os.path.join(d, f) for f in fs if f.endswith(".rs") and f != "tests.rs"]
        modules = {module_of(src, f): f for f in files}
        graph = {}
        for mod, f in modules.items():
            graph[mod] = edges_of(mod, product_text(f), modules)
        modules_total += len(modules)
        edges_total += sum(len(v) for v in graph.values())
        for comp in sccs(graph):
            circles.append((name, ["::".join(m) or "(root)" for m in comp]))
    for comp in sccs(crate_graph):
        circles.append(("workspace", comp))
    for crate, comp in circles:
        print(f"circle in {crate}: {' <-> '.join(comp)}")
    for crate, dep in upward:
        print(f"upward arrow: {crate} depends on {dep}, which docs/layout.md lists "
              "above it (or does not list)")
    if not quiet or circles or upward:
        print(
            f"import graph: {len(crates)} crates, {modules_total} modules, "
            f"{edges_total} edges between modules, {len(circles)} circles, "
            f"{len(upward)} upward arrows"
        )
    return 1 if circles or upward else 0


if __name__ == "__main__":
    sys.exit(main())
