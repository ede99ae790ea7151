#!/usr/bin/env python3
"""Keeps the signposts true (run by `make check` as `make docs-check`).

1. Every repository path the documents name in backticks (`cuda/skv_cuda_score.cu`,
   `bench/results/...`, `tests/check_docs.py`) exists; a path with * must match a file.
2. docs/DESIGN.md section 9.9, the op-by-backend table: every cell of the form
   `dir/file`: `name` names a file that exists and holds that identifier.
3. The file maps: cuda/skv_cuda.h names every file of cuda/, cpu/skv_cpu_ops.h every file of cpu/.
4. No library source file (include/, lib/, ref/, cpu/, cuda/) is over 1,000 lines.

Ends with "N passed, N failed" and exits non-zero on a failure.
"""
import glob
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DOCS = ["README.md", "docs/DESIGN.md", "docs/usage.md", "docs/serving-engines.md", "bench/results/README.md",
        "dev/README.md", "fuzz/README.md"]
TOP = ("include/", "lib/", "ref/", "cpu/", "cuda/", "tests/", "fuzz/", "bench/", "examples/", "docs/",
       "python/", "dev/", ".ci/")
LIB_DIRS = ("include", "lib", "ref", "cpu", "cuda")
MAX_LINES = 1000

passed = failed = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print("FAIL: " + what)


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def exists(path):
    if "*" in path or "?" in path:
        return bool(glob.glob(os.path.join(ROOT, path)))
    return os.path.exists(os.path.join(ROOT, path.rstrip("/")))


# 1. paths in backticks
path_re = re.compile(r"`([A-Za-z0-9_.*/-]+)`")
for doc in DOCS:
    if not os.path.exists(os.path.join(ROOT, doc)):
        continue
    base = os.path.dirname(doc)
    for m in path_re.finditer(read(doc)):
        p = m.group(1)
        if p.startswith(TOP) and not p.endswith("/*"):
            check(exists(p), f"{doc}: `{p}` does not exist")
        elif doc.startswith("bench/results/") and re.match(r"^(h200|cpu|h100)[A-Za-z0-9_.-]*\.(json|txt)$", p):
            check(exists(os.path.join(base, p)), f"{doc}: `{p}` does not exist in {base}/")

# 2. the op-by-backend table (section 9.9)
design = read("docs/DESIGN.md")
sec = re.search(r"^### 9\.9 .*?$(.*?)(?=^##)", design, re.S | re.M)
check(sec is not None, "docs/DESIGN.md has no section 9.9 (the op-by-backend table)")
cells = 0
if sec:
    for m in re.finditer(r"`([a-z]+/[A-Za-z0-9_.-]+)`: `([A-Za-z_][A-Za-z0-9_]*)`", sec.group(1)):
        f, name = m.group(1), m.group(2)
        cells += 1
        if not os.path.exists(os.path.join(ROOT, f)):
            check(False, f"DESIGN 9.9: {f} does not exist")
            continue
        check(re.search(r"\b" + re.escape(name) + r"\b", read(f)) is not None,
              f"DESIGN 9.9: {name} is not in {f}")
    check(cells >= 30, f"DESIGN 9.9 names only {cells} file: function cells")

# 3. file maps
for d, hdr in (("cuda", "cuda/skv_cuda.h"), ("cpu", "cpu/skv_cpu_ops.h")):
    text = read(hdr)
    head = text[: text.find("*/")] if "*/" in text else text
    for f in sorted(os.listdir(os.path.join(ROOT, d))):
        if f.endswith((".c", ".h", ".cu", ".cuh")) and f"{d}/{f}" != hdr:
            check(f in head, f"{hdr}'s file map does not name {f}")

# 4. library files' length
for d in LIB_DIRS:
    for f in sorted(os.listdir(os.path.join(ROOT, d))):
        if f.endswith((".c", ".h", ".cu", ".cuh")):
            n = read(f"{d}/{f}").count("\n")
            check(n <= MAX_LINES, f"{d}/{f} has {n} lines (at most {MAX_LINES})")

print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
