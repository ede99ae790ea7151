#!/usr/bin/env bash
# bench/busy_decode.sh - the demo's decode step (or its prefill) on the cpu
# backend with the machine idle and with N competing busy loops
# (`sh -c 'while :; do :; done'`), to show the backend is not slowed by other
# work beyond its share of the CPUs.
#
#   bench/busy_decode.sh [--rounds 3] [--busy 2] [--setsid] [--steps 32] [--measure decode|prefill]
#                        [--demo PATH] [-- DEMO_ARGS...]
#
# Runs build/demo --backend cpu --json --acc-layers 0 (plus DEMO_ARGS)
# alternately without and with the busy loops, --rounds times, and prints each
# run's median decode step (the demo's decode_ms_median: every layer of the
# whole batch), or with --measure prefill its prefill (prefill_ms: every
# layer's skv_prefill; bench/busy_prefill.sh), then the median over the rounds
# of each side and their ratio. --demo runs another build's demo (before/after).
# The busy loops start before the demo and run until it exits (its prefill
# runs under load too; only the measured part is reported). --setsid starts each
# loop in its own session: with the kernel's autogroup scheduling (Linux,
# sched_autogroup_enabled) a process of another login or service gets a share
# of the CPUs as a group, while loops started beside the demo in its session
# compete with its threads one by one. The environment is left alone (no
# OMP_WAIT_POLICY, OMP_NUM_THREADS or OPENBLAS_NUM_THREADS); run_queue is the
# median of /proc/stat procs_running sampled every 0.2 s during the run (the
# demo's threads, the loops and anything else runnable on the machine).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3 busy=2 steps=32 use_setsid=0 measure=decode demo=build/demo
demo_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --busy) busy=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --setsid) use_setsid=1; shift ;;
    --measure) measure=$2; shift 2 ;;
    --demo) demo=$2; shift 2 ;;
    --) shift; demo_args=("$@"); break ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "busy_decode.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
case "$measure" in
  decode) key=decode_ms_median unit=ms/step label="decode median" ;;
  prefill) key=prefill_ms unit=ms label=prefill ;;
  *) echo "busy_decode.sh: --measure decode or prefill, got $measure" >&2; exit 2 ;;
esac
[ -x "$demo" ] || { echo "busy_decode.sh: $demo missing (make build/demo)" >&2; exit 2; }

loops=()
stop_loops() { for p in "${loops[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; loops=(); }
trap stop_loops EXIT

# one demo run; prints "<the measured value, ms> <run queue median>"
run_demo() {
  local qf out
  qf=$(mktemp)
  ( while :; do awk '/^procs_running/ {print $2}' /proc/stat; sleep 0.2; done ) >"$qf" &
  local sampler=$!
  out=$("$demo" --backend cpu --json --acc-layers 0 --steps "$steps" "${demo_args[@]}" 2>/dev/null)
  kill "$sampler"; wait "$sampler" 2>/dev/null || true
  local med q
  med=$(printf '%s\n' "$out" | sed -n "s/.*\"$key\": \\([0-9.]*\\).*/\\1/p")
  q=$(sort -n "$qf" | awk '{a[NR]=$1} END {print NR ? a[int((NR+1)/2)] : "?"}')
  rm -f "$qf"
  echo "$med $q"
}

median() { sort -g | awk '{a[NR]=$1} END {if (NR % 2) print a[(NR+1)/2]; else printf "%.3f\n", (a[NR/2]+a[NR/2+1])/2}'; }

echo "busy_$measure: $(nproc) CPUs, $demo --backend cpu --steps $steps ${demo_args[*]}; $busy busy loops$([ $use_setsid = 1 ] && echo ', each in its own session'); $rounds rounds; loadavg $(cut -d' ' -f1-3 /proc/loadavg)"
idle_all=() busy_all=()
for r in $(seq 1 "$rounds"); do
  read -r m q < <(run_demo)
  echo "round $r idle: $label $m $unit (run_queue $q)"
  idle_all+=("$m")
  for i in $(seq 1 "$busy"); do
    if [ $use_setsid = 1 ]; then setsid sh -c 'while :; do :; done' & else sh -c 'while :; do :; done' & fi
    loops+=($!)
  done
  sleep 0.5
  read -r m q < <(run_demo)
  stop_loops
  echo "round $r busy: $label $m $unit (run_queue $q)"
  busy_all+=("$m")
done
mi=$(printf '%s\n' "${idle_all[@]}" | median)
mb=$(printf '%s\n' "${busy_all[@]}" | median)
echo "idle median $mi $unit, busy median $mb $unit, ratio $(awk -v a="$mb" -v b="$mi" 'BEGIN {printf "%.2f", a / b}')"
