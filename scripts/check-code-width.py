#!/usr/bin/env python3
"""Lines of Rust rustfmt cannot bring within its width: where it gives up.

Usage: scripts/check-code-width.py [--fix]

Where an expression cannot be brought within `max_width` (100), rustfmt leaves
the whole expression as written while `cargo fmt --check` still passes. Two
causes are named, each line by file and number, and the script exits 1 if there
is any:

- code that is still over 100 characters with string and character literals
  collapsed to `""` and `''` and comments removed: a macro call rustfmt cannot
  parse, an attribute's arguments, a `proptest!` body; break it by hand. (This
  is what rustfmt's own `error_on_line_overflow` reports, but only a nightly
  rustfmt has it.)
- a string literal written on one line that takes its line over 100 characters
  and has a space to break at: rustfmt does not break strings, so the
  expression around it stays unformatted (a `format!` in a `return Err(..)`,
  a chain, a `match` arm). `--fix` breaks each such literal after spaces with
  `\\` line continuations, first moving it to a line of its own where it starts
  too far right (inside a `tracing` macro, which rustfmt cannot parse, that
  line stays); the literal's value is unchanged (checked before any file is
  written). Run `cargo fmt` after it.

Literals that span lines already, raw strings and strings without a space to
break at are left alone, as comments are: rustfmt formats around them.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = 100
# Room kept after a broken literal's first line: rustfmt may move it right when
# it formats the expression around it.
MARGIN = 12
# The shortest first piece of a broken literal.
PIECE = 24
RAW_START = re.compile(r'b?r(#*)"')
CHAR = re.compile(r"'(\\.[^']*|[^'\\])'")


def spans(text):
    """(start, end, kind) of each comment, string, raw string and character
    literal of `text`; kind is "comment", "str", "raw" or "char"."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append((i, j, "comment"))
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i)
            j = n if j < 0 else j + 2
            out.append((i, j, "comment"))
            i = j
            continue
        starts_word = i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")
        m = RAW_START.match(text, i) if c in "rb" and starts_word else None
        if m:
            close = '"' + m.group(1)
            j = text.find(close, m.end())
            j = n if j < 0 else j + len(close)
            out.append((i, j, "raw"))
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append((i, j + 1, "str"))
            i = j + 1
            continue
        if c == "'":
            m = CHAR.match(text, i)
            if m:
                out.append((i, m.end(), "char"))
                i = m.end()
                continue
        i += 1
    return out


def code_only(text):
    """`text` with literals collapsed and comments removed, lines kept."""
    out, last = [], 0
    for s, e, kind in spans(text):
        out.append(text[last:s])
        keep = {"comment": "", "char": "''"}.get(kind, '""')
        out.append(keep + "\n" * text.count("\n", s, e))
        last = e
    out.append(text[last:])
    return "".join(out)


def literal_value(src):
    """A string literal's source with its line continuations taken out (a `\\`
    before a newline drops both and the whitespace after), other escapes kept."""
    out, i = [], 0
    while i < len(src):
        if src[i] == "\\" and i + 1 < len(src):
            if src[i + 1] == "\n":
                i += 2
                while i < len(src) and src[i] in " \t\n\r":
                    i += 1
                continue
            out.append(src[i : i + 2])
            i += 2
            continue
        out.append(src[i])
        i += 1
    return "".join(out)


def breaks(text):
    """Where to break the one-line string literals that take their line over
    the width: (start, end, replacement) edits, in order. A literal that starts
    too far right to give its first piece `PIECE` characters moves to a line of
    its own first (whitespace between tokens: rustfmt formats it as it likes,
    and leaves it so inside a macro it cannot parse, such as `tracing`'s); then
    it is broken after spaces, greedily, each piece leaving `MARGIN` columns."""
    out = []
    limit = WIDTH - MARGIN
    for s, e, kind in spans(text):
        if kind != "str" or "\n" in text[s:e]:
            continue
        start = text.rfind("\n", 0, s) + 1
        end = text.find("\n", e)
        line = text[start : len(text) if end < 0 else end]
        # Over the width, and the literal itself runs past the limit with a
        # space in it: else the code around it is what is too long.
        if len(line) <= WIDTH or e - start <= limit or " " not in text[s:e].strip('"'):
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        continued = "\\\n" + indent
        offset = start  # the column of text[q] is q - offset
        token = s
        while token > start and text[token - 1].isalpha():
            token -= 1  # a b"" or c"" prefix goes along
        if s - start > limit - PIECE and text[start:token].strip():
            gap = len(text[start:token]) - len(text[start:token].rstrip())
            out.append((token - gap, token, "\n" + indent))
            offset = token - len(indent)
        depth = 0
        best = None
        piece = s + 1
        for q in range(s + 1, e - 1):
            ch = text[q]
            depth = depth + 1 if ch == "{" else max(0, depth - 1) if ch == "}" else depth
            # After a space followed by a non-space, outside a `{}` placeholder,
            # with something before it: the continuation drops only the
            # indentation it adds.
            if (
                ch == " "
                and not depth
                and text[q + 1] not in ' \t"\\'
                and text[piece:q].strip()
                and q - offset + 2 <= limit
            ):
                best = q
            if q - offset + 1 > limit and best is not None:
                out.append((best + 1, best + 1, continued))
                offset = best + 1 - (len(continued) - 2)
                piece = best + 1
                best = None
                if e - offset <= limit:
                    break
    return out


def rust_files():
    for top in ("lib", "bins", "tests", "proto"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(x for x in dirs if x != "target")
            for f in sorted(files):
                if f.endswith(".rs"):
                    yield os.path.join(d, f)


def main():
    fix = sys.argv[1:] == ["--fix"]
    if sys.argv[1:] and not fix:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    found = 0
    for path in rust_files():
        with open(path) as fh:
            text = fh.read()
        shown = os.path.relpath(path, ROOT)
        for k, line in enumerate(code_only(text).split("\n"), 1):
            if len(line.rstrip()) > WIDTH:
                print(f"{shown}:{k}: code over {WIDTH} characters (rustfmt gave up here; break it by hand)")
                found += 1
        cuts = breaks(text)
        if not cuts:
            continue
        lines = sorted({text.count("\n", 0, begin) + 1 for begin, _, _ in cuts})
        if not fix:
            for k in lines:
                print(f"{shown}:{k}: a string takes its line over {WIDTH} characters (rustfmt gives up around it; --fix breaks it)")
            found += len(lines)
            continue
        new = text
        for begin, finish, inserted in reversed(cuts):
            new = new[:begin] + inserted + new[finish:]
        values = [literal_value(text[s:e]) for s, e, kind in spans(text) if kind == "str"]
        if values != [literal_value(new[s:e]) for s, e, kind in spans(new) if kind == "str"]:
            print(f"{shown}: breaking its strings would change one; left as it is", file=sys.stderr)
            found += 1
            continue
        with open(path, "w") as fh:
            fh.write(new)
        print(f"{shown}: {len(lines)} line(s) broken")
    if fix and not found:
        print("now run: cargo fmt --all", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
