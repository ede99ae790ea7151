#!/usr/bin/env bash
# Runs every test binary given on the command line, the fuzz replays ($FUZZ_REPLAY),
# the self-checking examples ($EXAMPLES), then the link check;
# prints each binary's closing line and, last, the summed
# "N passed, N failed, N skipped". Exits non-zero on any failure.
set -u
total_p=0 total_f=0 total_s=0 bad=0
# Each entry is a test binary, or (from $FUZZ_REPLAY) a fuzz replay binary
# build/.../replay_<harness>, run over fuzz/corpus/<harness> and fuzz/regressions/<harness>,
# or (from $CPU_PORTABLE) a test binary run again with SKV_CPU_SIMD=0: the cpu
# backend's portable code (what a CPU without AVX2+FMA runs), same decisions,
# or (from $MAKE_ENTRIES) a make target that ends with such a line (pycheck: the Python tests).
entries=("$@")
for r in ${FUZZ_REPLAY:-}; do entries+=("$r"); done
for r in ${CPU_PORTABLE:-}; do entries+=("SKV_CPU_SIMD=0:$r"); done
for m in ${MAKE_ENTRIES:-}; do entries+=("make:$m"); done
for e in "${entries[@]}"; do
  t=${e#SKV_CPU_SIMD=0:}
  envs=()
  [ "$t" != "$e" ] && envs=(SKV_CPU_SIMD=0)
  echo "== ${envs[*]:+${envs[*]} }$t"
  start=$(date +%s%N)
  log=$(mktemp)
  args=()
  case "$(basename "$t")" in
    replay_*) h=$(basename "$t"); h=${h#replay_}; args=("fuzz/corpus/$h"); [ -d "fuzz/regressions/$h" ] && args+=("fuzz/regressions/$h") ;;
  esac
  case "$t" in
    make:*) make --no-print-directory "${t#make:}" 2>&1 | tee "$log" ;;
    *) env "${envs[@]}" "./$t" "${args[@]}" 2>&1 | tee "$log" ;;
  esac
  rc=${PIPESTATUS[0]}
  line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" | tail -n 1)
  rm -f "$log"
  if [ -z "$line" ]; then echo "FAILED: ${envs[*]:+${envs[*]} }$t printed no 'N passed, N failed' line (exit $rc)"; bad=1; total_f=$((total_f + 1)); continue; fi
  p=$(echo "$line" | sed -E 's/^([0-9]+) passed.*/\1/')
  f=$(echo "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
  s=$(echo "$line" | sed -nE 's/.* ([0-9]+) skipped.*/\1/p')
  total_p=$((total_p + p)) total_f=$((total_f + f)) total_s=$((total_s + ${s:-0}))
  [ "$rc" -ne 0 ] && { echo "FAILED: ${envs[*]:+${envs[*]} }$t (exit $rc)"; bad=1; [ "$f" -eq 0 ] && total_f=$((total_f + 1)); }
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  echo "   ${envs[*]:+${envs[*]} }$t: $((ms / 1000)).$(printf '%03d' $((ms % 1000))) s"
done
# Examples that check themselves ($EXAMPLES, e.g. build/decode_loop): one pass or one failure
# each, by exit status.
for ex in ${EXAMPLES:-}; do
  echo "== $ex"
  if "./$ex"; then total_p=$((total_p + 1)); else echo "FAILED: $ex (exit $?)"; total_f=$((total_f + 1)); bad=1; fi
done
if [ -n "${SKV_NO_LINK_CHECK:-}" ]; then
  echo "== link-check skipped (SKV_NO_LINK_CHECK)"
elif make --no-print-directory link-check; then total_p=$((total_p + 1)); else total_f=$((total_f + 1)); bad=1; fi
echo "make check: $([ $bad = 0 ] && echo all passed || echo FAILURES)"
echo "$total_p passed, $total_f failed, $total_s skipped"
exit $bad
