#!/usr/bin/env python3
"""Lines of Rust code that rustfmt left longer than its width: where it gave up.

Usage: scripts/check-code-width.py

rustfmt does not break string literals or comments, and where an expression
cannot be brought within `max_width` (100) — a macro call it cannot parse, an
attribute's arguments, a `proptest!` body — it leaves the whole expression as
written while `cargo fmt --check` still passes. This reads every .rs file of
the workspace with string and character literals collapsed to `""` and `''`
and comments removed, and names each line whose code alone is still over 100
characters; it exits 1 if there is any. (rustfmt's own `error_on_line_overflow`
would say the same, but only a nightly rustfmt has it.)
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = 100
RAW_START = re.compile(r'b?r(#*)"')
CHAR = re.compile(r"'(\\.[^']*|[^'\\])'")


def code_only(text):
    """`text` with literals collapsed and comments removed, lines kept."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
            continue
        starts_word = i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")
        m = RAW_START.match(text, i) if c in "rb" and starts_word else None
        if m:
            close = '"' + m.group(1)
            j = text.find(close, m.end())
            j = n if j < 0 else j + len(close)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
            continue
        if c == "'":
            m = CHAR.match(text, i)
            if m:
                out.append("''")
                i = m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


def main():
    over = []
    for top in ("lib", "bins", "tests", "proto"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x != "target"]
            for f in sorted(files):
                if not f.endswith(".rs"):
                    continue
                path = os.path.join(d, f)
                with open(path) as fh:
                    text = fh.read()
                for k, line in enumerate(code_only(text).split("\n"), 1):
                    if len(line.rstrip()) > WIDTH:
                        over.append(f"{os.path.relpath(path, ROOT)}:{k}")
    for o in over:
        print(f"{o}: code over {WIDTH} characters (rustfmt gave up here; break it by hand)")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
