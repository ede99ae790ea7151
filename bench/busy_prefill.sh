#!/usr/bin/env bash
# bench/busy_prefill.sh - the cpu backend's prefill on a busy machine and
# beside another OpenMP runtime in the same process; no OpenMP or OpenBLAS
# environment variable is set.
#
#   bench/busy_prefill.sh [--rounds 3] [--busy 2] [--setsid] [--demo PATH] [--beside PATH]
#                         [--floor PATH] [-- DEMO_ARGS...]
#
# 1. bench/busy_decode.sh --measure prefill: the demo's prefill (every layer's
#    skv_prefill, summed) idle and with --busy loops, alternated --rounds
#    times. DEMO_ARGS default to a SmolLM2-135M-like shape: 30 layers, 9 query
#    heads, 3 KV heads, head dim 64, one 8192-token prompt (--share-layers:
#    one workload, every layer prefilled with it).
# 2. build/beside_omp (make build/beside_omp; --beside another build of it):
#    the same shape's prefill alone and with a parallel region of a private
#    copy of the OpenMP runtime before each layer (as a framework with its own
#    runtime in the process would run), --rounds times. Skipped with a message
#    when the program is missing.
# 3. build/fixed_work (make build/fixed_work; --floor another path): the
#    machine's floor for the ratio of 1: fixed CPU work on 1 thread and on 2
#    threads, idle and with the same number of busy loops (in its session:
#    --setsid does not apply), --rounds times. A prefill mixes serial and
#    parallel work; with as many loops as CPUs a fair scheduler keeps its
#    ratio above about the lower of those two ratios (about 1.5 and 2 on 2
#    CPUs with 2 loops), whatever the library does. Skipped with a message
#    when the program is missing.
# 4. bench/beside_torch.py: the prefill at 2048 tokens in a Python process with
#    torch, alone and with a torch matrix product between layers (PYTHON picks
#    the interpreter; skipped when it has no torch).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3 busy=2 beside=build/beside_omp floor=build/fixed_work
pass=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; pass+=("$1" "$2"); shift 2 ;;
    --busy) busy=$2; pass+=("$1" "$2"); shift 2 ;;
    --demo) pass+=("$1" "$2"); shift 2 ;;
    --setsid) pass+=("$1"); shift ;;
    --beside) beside=$2; shift 2 ;;
    --floor) floor=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "busy_prefill.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
shape=(--layers 30 --hq 9 --hk 3 --dim 64 --ctx 8192 --share-layers)
[ $# -gt 0 ] && shape=("$@")
bench/busy_decode.sh --measure prefill --steps 1 "${pass[@]}" -- "${shape[@]}"
if [ -x "$beside" ]; then
  # beside_omp takes the shape options it knows (not --share-layers: it has one workload anyway)
  b=()
  set -- "${shape[@]}"
  while [ $# -gt 0 ]; do
    case "$1" in
      --layers|--hq|--hk|--dim|--ctx|--rank|--budget) b+=("$1" "$2"); shift 2 ;;
      *) shift ;;
    esac
  done
  echo "beside another OpenMP runtime (loadavg $(cut -d' ' -f1-3 /proc/loadavg)):"
  "$beside" --rounds "$rounds" "${b[@]}"
else
  echo "busy_prefill.sh: $beside missing (make build/beside_omp): the case beside another OpenMP runtime is skipped"
fi
if [ -x "$floor" ]; then
  echo "the floor: fixed CPU work beside $busy busy loops (loadavg $(cut -d' ' -f1-3 /proc/loadavg)):"
  "$floor" --busy "$busy" --rounds "$rounds"
else
  echo "busy_prefill.sh: $floor missing (make build/fixed_work): the floor is skipped"
fi
# 4. beside torch in one Python process (bench/beside_torch.py), when $PYTHON (python3) has torch
PY=${PYTHON:-python3}
if "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "beside torch in one process (loadavg $(cut -d' ' -f1-3 /proc/loadavg)):"
  SHADOWKV_LIBRARY=${SHADOWKV_LIBRARY:-$PWD/build/libshadowkv.so} "$PY" bench/beside_torch.py --rounds "$rounds"
else
  echo "busy_prefill.sh: $PY has no torch: the case beside torch is skipped (PYTHON=.venv/bin/python after make check SKV_PYTORCH=1)"
fi
