"""The reproducible mode's decode cost over repeated runs: reads skv-bench decode --json files
(each run measures the default and the reproducible step of one shape) and prints, as JSON, each
run's two steps and their ratio, and the median, least and greatest ratio. The step of either mode
moves by several percent between runs and machines, so one run's ratio is not the measure.

    python3 tests/gpu/repro_ratio.py run1.json run2.json ...
"""
import json
import statistics
import sys


def main(paths):
    runs = []
    for p in paths:
        with open(p) as f:
            rows = json.load(f)["rows"]
        by = {}
        for r in rows:
            by.setdefault((r["ctx"], r["batch"], r["placement"], r["workload"]), {})[r["mode"]] = r["step_ms"]
        for key, m in sorted(by.items()):
            if "default" in m and "reproducible" in m and m["default"] > 0:
                runs.append({"ctx": key[0], "batch": key[1], "placement": key[2], "workload": key[3],
                             "default_ms": m["default"], "reproducible_ms": m["reproducible"],
                             "ratio": round(m["reproducible"] / m["default"], 4)})
    ratios = [r["ratio"] for r in runs]
    out = {"runs": runs}
    if ratios:
        out.update({"n": len(ratios), "median_ratio": round(statistics.median(ratios), 4),
                    "min_ratio": min(ratios), "max_ratio": max(ratios)})
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0 if ratios else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
