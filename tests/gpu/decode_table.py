"""Joins skv-bench decode's rows with the dense baseline of the same run into the
decode results file (stdout) and prints the table and the targets to stderr.

    python3 tests/gpu/decode_table.py BENCH_DECODE_JSON DENSE_JSON GPU_TXT

Output: {"gpu", "date", "command", "rows": [{ctx, batch, placement, workload,
step_ms, dense_ms, floor_ms, hit_rate, overlap, ...}], "targets": [...]}.
dense_ms is torch SDPA (flash) on the same context and batch; a row's
step_over_floor and dense_over_step are ratios of numbers measured in the run.
"""
import datetime
import json
import sys

# (ctx, batch, placement, workload or None, must_ms, stretch_ms) from the decode issue
TARGETS = [
    (131072, 8, "device", None, 0.15, 0.10),
    (32768, 8, "device", None, 0.07, 0.045),
    (131072, 1, "device", None, 0.04, 0.025),
    (1048576, 1, "device", None, 0.10, 0.08),
    (131072, 8, "host", "fresh", 0.75, 0.68),
    (131072, 8, "host", "drift", 0.35, 0.25),
]


def main():
    bench = json.load(open(sys.argv[1]))
    dense = json.load(open(sys.argv[2]))
    try:
        gpu = open(sys.argv[3]).read().strip()
    except OSError:
        gpu = "unknown"
    dmap = {(d["ctx"], d["batch"]): d["ms"] for d in dense.get("rows", [])}
    rows = []
    for r in bench["rows"]:
        row = dict(r)
        row["dense_ms"] = dmap.get((r["ctx"], r["batch"]))
        if row["dense_ms"]:
            row["dense_over_step"] = row["dense_ms"] / r["step_ms"]
        rows.append(row)
    targets = []
    for ctx, b, pl, wl, must, stretch in TARGETS:
        for r in rows:
            if r["ctx"] == ctx and r["batch"] == b and r["placement"] == pl and (wl is None or r["workload"] == wl):
                targets.append({"ctx": ctx, "batch": b, "placement": pl, "workload": r["workload"],
                                "step_ms": r["step_ms"], "must_ms": must, "stretch_ms": stretch,
                                "must_met": r["step_ms"] <= must, "stretch_met": r["step_ms"] <= stretch})
    for r in rows:  # every device row at batch >= 8: step <= 2x its floor (stretch 1.3x)
        if r["placement"] == "device" and r["batch"] >= 8:
            targets.append({"ctx": r["ctx"], "batch": r["batch"], "placement": "device", "workload": r["workload"],
                            "step_over_floor": r["step_over_floor"], "must": "<= 2x floor", "stretch": "<= 1.3x",
                            "must_met": r["step_over_floor"] <= 2.0, "stretch_met": r["step_over_floor"] <= 1.3})
    out = {"gpu": gpu, "date": datetime.date.today().isoformat(),
           "command": "bash tests/gpu/run.sh decode (skv-bench decode --json; tests/gpu/dense_decode.py)",
           "backend": bench.get("backend"), "shape": bench.get("shape"), "steps": bench.get("steps"),
           "warmup": bench.get("warmup"), "drift": bench.get("drift"), "hbm_gbs": bench.get("hbm_gbs"),
           "pcie_gbs": bench.get("pcie_gbs"), "note": bench.get("note"), "dense": dense.get("what"),
           "torch": dense.get("torch"), "rows": rows, "targets": targets}
    json.dump(out, sys.stdout, indent=1)
    print()
    print("%8s %5s %-6s %-5s %9s %9s %9s %6s %7s %5s %5s %4s" % ("ctx", "batch", "place", "load", "step_ms", "dense_ms",
          "floor_ms", "xfloor", "xdense", "ovl", "hit", "krn"), file=sys.stderr)
    for r in rows:
        print("%8d %5d %-6s %-5s %9.4f %9s %9.4f %6.2f %7s %5.2f %5.2f %4.1f" % (
            r["ctx"], r["batch"], r["placement"], r["workload"], r["step_ms"],
            "%.4f" % r["dense_ms"] if r["dense_ms"] else "-", r["floor_ms"], r["step_over_floor"],
            "%.2f" % r["dense_over_step"] if r.get("dense_over_step") else "-", r["overlap"], r["hit_rate"],
            r["kernels_per_step"]), file=sys.stderr)
    for t in targets:
        print("target %s" % json.dumps(t), file=sys.stderr)


if __name__ == "__main__":
    main()
