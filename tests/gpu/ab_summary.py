"""Builds compared in one run (tests/gpu/run.sh ab): per build, the median over rounds of each decode
step (every shape, both modes) and of each factorization route and size; each build's ratio to the
first build; and whether every build wrote the same decode digest (outputs and selections, bitwise)
and the same factorization error for each row.

    python3 tests/gpu/ab_summary.py DIR BUILD1 BUILD2 ...

DIR holds dec_<build>_<round>.json (skv-bench decode --json) and fac_<build>_<round>.json
(skv-bench factorize --json). Prints JSON; exits 1 when a digest or an error differs.
"""
import glob
import json
import os
import statistics
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        return None


def main(d, builds):
    dec, fac, digests, errs, failed = {}, {}, {}, {}, []
    for b in builds:
        for p in sorted(glob.glob(os.path.join(d, f"dec_{b}_*.json"))):
            rows = load(p)
            if rows is None:
                failed.append(p)
                continue
            for r in rows:
                key = f"decode {r['ctx']}x{r['batch']} {r['placement']} {r['workload']} {r['mode']}"
                dec.setdefault(key, {}).setdefault(b, []).append(r["step_ms"])
                digests.setdefault(key, {}).setdefault(b, set()).add(r.get("digest"))
        for p in sorted(glob.glob(os.path.join(d, f"fac_{b}_*.json"))):
            rows = load(p)
            if rows is None:
                failed.append(p)
                continue
            for r in rows:
                if r.get("ms") is None:
                    continue
                key = f"factorize {r['route']} n={r['n']}"
                fac.setdefault(key, {}).setdefault(b, []).append(r["ms"])
                errs.setdefault(key, {}).setdefault(b, set()).add(r.get("err"))
    out = {"builds": builds, "rows": [], "failed_runs": failed}
    same = True
    for table, checks in ((dec, digests), (fac, errs)):
        for key in sorted(table):
            row = {"what": key}
            base = None
            for b in builds:
                t = table[key].get(b, [])
                if not t:
                    continue
                m = statistics.median(t)
                row[b] = {"median_ms": round(m, 4), "runs_ms": [round(x, 4) for x in t]}
                if base is None:
                    base = m
                else:
                    row[b]["ratio_to_first"] = round(m / base, 4)
            vals = [checks[key].get(b, set()) for b in builds if checks[key].get(b)]
            ident = all(len(v) == 1 for v in vals) and len({next(iter(v)) for v in vals}) == 1
            row["bitwise_same" if table is dec else "same_error"] = ident
            same = same and ident
            out["rows"].append(row)
    out["all_same"] = same
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0 if same and not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
