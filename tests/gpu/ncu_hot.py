#!/usr/bin/env python3
"""The hottest SASS instructions of one kernel, from `ncu --page source --csv --print-source sass`:
the rows with the most warp-stall samples, with every sampled stall column that is large in them.

    python3 tests/gpu/ncu_hot.py source.csv [top]
"""
import csv
import sys


def num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def main():
    rows = list(csv.reader(open(sys.argv[1], newline="")))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    hi = next((i for i, r in enumerate(rows) if any("Source" in c for c in r) and len(r) > 3), None)
    if hi is None:
        print("no source table in", sys.argv[1])
        print("\n".join(",".join(r)[:200] for r in rows[:20]))
        return
    head, body = rows[hi], [r for r in rows[hi + 1:] if len(r) == len(rows[hi])]
    src = next(i for i, c in enumerate(head) if c.strip() == "Source" or "Source" in c)
    addr = next((i for i, c in enumerate(head) if "Address" in c), None)
    allc = next((i for i, c in enumerate(head) if "Warp Stall Sampling (All" in c), None)
    if allc is None:
        allc = next(i for i, c in enumerate(head) if "Sampling" in c)
    total = sum(num(r[allc]) for r in body) or 1.0
    stall_cols = [i for i, c in enumerate(head) if c.startswith("stall_") or "Stall" in c and i != allc]
    print(f"{len(body)} instructions, {total:.0f} samples; columns: {head[allc]}")
    body.sort(key=lambda r: -num(r[allc]))
    for r in body[:top]:
        s = num(r[allc])
        reasons = sorted(((num(r[i]), head[i]) for i in stall_cols if num(r[i]) > 0.15 * s), reverse=True)[:3]
        why = " ".join(f"{n.replace('stall_', '')}={v:.0f}" for v, n in reasons)
        a = r[addr] if addr is not None else ""
        print(f"{100 * s / total:5.1f}% {a:>8} {r[src].strip()[:70]:70} {why}")


if __name__ == "__main__":
    main()
