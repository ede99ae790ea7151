"""Assembles the outputs of tests/gpu/run.sh into one JSON object (stdout).

    python3 tests/gpu/collect.py OUT_DIR GPU_TXT [AUX_DIR]

(AUX_DIR: where run.sh keeps dense.json, default OUT_DIR.)

Pass/fail counts per test binary, the per-layer decode benchmark next to the
dense baseline measured in the same run (ratio = dense / ours), the
cross-checker's PERF lines, and the demos.
"""
import datetime
import json
import os
import re
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"missing": "%s: %s" % (os.path.basename(path), e)}


def main():
    out, gpu_txt = sys.argv[1], sys.argv[2]
    try:
        gpu = open(gpu_txt).read().strip()
    except OSError:
        gpu = "unknown"
    res = {"gpu": gpu, "date": datetime.date.today().isoformat(),
           "command": "bash tests/gpu/run.sh (OUT=...)", "tests": load(os.path.join(out, "tests.json"))}
    passed = failed = skipped = 0
    for name, t in res["tests"].items() if isinstance(res["tests"], dict) else []:
        m = re.match(r"(\d+) passed, (\d+) failed(?:, (\d+) skipped)?", t.get("result", ""))
        if m:
            passed += int(m.group(1)); failed += int(m.group(2)); skipped += int(m.group(3) or 0)
        elif "missing" not in res["tests"]:
            failed += 1
    res["totals"] = {"passed": passed, "failed": failed, "skipped": skipped}
    dec = load(os.path.join(out, "bench_decode.json"))
    aux = sys.argv[3] if len(sys.argv) > 3 else out
    dense = load(os.path.join(aux, "dense.json"))
    res["factorize_bench"] = load(os.path.join(out, "factorize.json"))
    res["decode_bench"] = dec
    res["dense_baseline"] = dense
    cmp_rows = []
    for r in dec.get("rows", []):
        for d in dense.get("rows", []):
            if d["ctx"] == r["ctx"] and d["batch"] == r["batch"]:
                row = {"ctx": r["ctx"], "batch": r["batch"], "shadowkv_step_ms": r["step_ms"],
                       "dense_flash_ms": d["ms"], "dense_over_shadowkv": d["ms"] / r["step_ms"]}
                if r.get("device_step_ms"):
                    row["shadowkv_device_step_ms"] = r["device_step_ms"]
                    row["dense_over_shadowkv_device"] = d["ms"] / r["device_step_ms"]
                cmp_rows.append(row)
    res["decode_vs_dense"] = cmp_rows
    perf = []
    try:
        for line in open(os.path.join(out, "perf.txt")):
            if line.startswith("PERF"):
                perf.append(line.strip())
    except OSError:
        pass
    res["perf_lines"] = perf
    res["demo"] = load(os.path.join(out, "demo.json"))
    json.dump(res, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
