#!/usr/bin/env bash
# Runs pytest with the given arguments under $PYTHON (default python3), shows its output,
# then ends with the C tests' closing line "N passed, N failed, N skipped" made from
# pytest's summary (errors count as failed, xfailed as skipped), so tests/run_all.sh and tests/gpu/run.sh
# add the Python tests to their totals. Exits with pytest's status.
set -u
PY=${PYTHON:-python3}
log=$(mktemp)
"$PY" -m pytest "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# pytest's last line: "2 failed, 85 passed, 1 skipped, 1 error in 35.2s" (maybe between ='s)
summary=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected)|no tests ran' "$log" | tail -n 1)
rm -f "$log"
count() { echo "$summary" | grep -oE "[0-9]+ $1" | head -n 1 | grep -oE '^[0-9]+' || echo 0; }
p=$(count passed) f=$(count failed) e=$(count "errors?") s=$(count skipped) xf=$(count xfailed)
f=$((f + e)) s=$((s + xf)) # a known failure (xfail) counts as skipped
# a run that failed without a counted failure (no tests collected, an internal error) is one failure
[ "$rc" -ne 0 ] && [ "$f" -eq 0 ] && f=1
echo "$p passed, $f failed, $s skipped"
exit "$rc"
