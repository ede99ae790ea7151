#!/usr/bin/env bash
# GPU test and benchmark driver, run on the device machine from the repo root:
#
#   bash tests/gpu/run.sh [quick|decode|full|prefill|sanitize|repro|ab|modes|serve|pack]
#
#   quick     build; the GPU tests with short settings (test_snapshot's cuda round trips among
#             them; the Python tests on cuda too:
#             tests/gpu/test_python_cuda.py); a short decode benchmark (and
#             the ncu profile when NCU_CONFIGS is set, the per-instruction hot spots
#             of the kernels NCU_HOT names)
#   decode    build; test_cuda, test_cuda_serve, test_cuda_fp8, test_serve and test_placement; the decode benchmark over every
#             placement, workload, context and batch (skv-bench decode) with the dense
#             SDPA baseline of the same run, joined into decode.json; the per-kernel
#             device times and DRAM bytes of decode steps (ncu)
#   full      build; every GPU test; compute-sanitizer memcheck of test_cuda,
#             test_cuda_serve and test_placement; the decode benchmark and table as in `decode`
#   prefill   build; the factorization benchmark (16k..1M, with the GPU baselines) and
#             the demo at 32 layers (one 128k sequence, 8 x 32k, one 64k)
#   sanitize  build; compute-sanitizer memcheck of the GPU tests
#   repro     build; the reproducible mode on cuda: the fp64 mma's element order
#             (dev/cuda/dmma_order_probe.cu), the canonical-route tests (factorization,
#             rebuild and attention, snapshots, test_contract's reproducible configurations, the
#             fuzz_diff corpus with its cuda leg), then its cost against the default mode in one
#             run: the factorization at 16k/64k/128k (factorize_repro.json) and the decode step
#             at 128k x 8 and 32k x 1 (decode_repro.json), then REPRO_RUNS (5) more runs at 128k x 8
#             with their ratios' median (decode_repro_runs.json, tests/gpu/repro_ratio.py); REPRO_PY=1
#             adds the Python tests on cuda
#   ab        no build: several builds alternated in one run, AB_DIRS="dirA dirB .." (each a pack
#             of some commit, build/dev renamed; the first is the baseline), AB_ROUNDS (3) rounds;
#             per round and build the decode step in both modes at AB_SHAPES ("131072x8 131072x1",
#             ctx x batch) and, unless AB_FACTOR=0, the factorization's default and canonical routes
#             at AB_FACTOR_N (16384,65536,131072). ab.json (tests/gpu/ab_summary.py): per build the
#             medians, their ratio to the baseline, and whether every build wrote the same decode
#             digest (outputs and selections) and the same factorization error; exits 1 if not
#   modes     build; the selection modes on cuda against ref (SKV_SELECT_MASS, SKV_BUDGET_ALL, the rescoring,
#             dense layers: test_contract 40, backend_ops -b cuda, test_placement,
#             test_canonical_decode, test_e2e, test_snapshot), then their decode step against the
#             fixed budget's in one run (bench_select.json: skv-bench decode --select
#             ${SELECT_VARIANTS:-fixed,mass,dense} at SELECT_CTX x SELECT_BATCH, default
#             32768,131072 x 1,8, device placement, fresh and drift queries, --select-mass
#             SELECT_MASS (0.95); SELECT_REPRO=1 adds the reproducible mode)
#   serve     build; the serving tests on cuda (test_cuda_serve, test_serve and its large load:
#             SKV_SERVE_LOAD=large, 64 requests of 4k..32k tokens, 8..200 steps, 8 slots, bitwise
#             against solo runs; memcheck of test_cuda_serve), then the serving benchmark
#             (serving.json: skv-bench serve, 32 layers, 64 requests of 4k..32k, 8 slots, continuous
#             batching against static batches, on a high-priority stream; SERVE_ARGS adds options)
#             and the prefill beside the decode (beside.json: skv-bench serve --beside, default and
#             high-priority streams, SERVE_ROUNDS (2) rounds each, for each prefill partition of
#             SERVE_SMS: "0 16 32" runs --prefill-sms 0, 16 and 32 (default "0": all SMs))
#   tp        build; tensor parallelism (docs/tensor-parallel.md): test_tp_shard (shard caches in one
#             process against their own processes, one GPU each where there are several), the tests
#             the device guard touches (test_cuda, test_cuda_serve, test_cuda_fp8, test_values_fp8,
#             test_snapshot); examples/tp_decode.py under torchrun: NCCL over every GPU of the
#             machine (Llama-3-8B shape, TP_CTX (16384) tokens, 32 layers), and two ranks on GPU 0
#             through gloo; e2e_throughput --smoke with its collectives over an NCCL group of one;
#             then bench/e2e_throughput.py at TP_E2E_CTX (131072) for --tp 1 and --tp 2, on one GPU
#             (one rank's compute, no all-reduce) and, with 2+ GPUs, under torchrun with NCCL (the
#             all-reduce's share measured): tp.json. TP_E2E_ARGS adds options, TP_LIST ("1 2") the
#             TP degrees, TP_ROUNDS (1) repeats, TP_E2E=0 skips them; TP_TESTS=0 skips the tests,
#             tp_decode.py and the smoke
#   pack      (on a build machine with nvcc, no GPU needed) build the binaries the
#             decode modes run (and backend_ops, test_contract, test_accuracy, test_e2e, test_snapshot) into
#             build/dev: one stripped libshadowkv.so.0 (and the cuda plugin
#             libshadowkv-cuda.so.0 it opens from its directory) that
#             the tests and skv-bench link to (small enough to carry to the device
#             machine with .deps); then PREBUILT=build/dev bash tests/gpu/run.sh decode
#             there skips the build (minutes of nvcc on a fresh machine)
#
# Writes under $OUT (default build/gpu-out), at most 9 files: log.txt (this script's
# output), tests_log.txt (every test's full output), tests.json (per-binary result
# lines), decode.json (the decode table), bench_decode.json, bench_select.json, ncu.txt, factorize.json,
# demo.json, hot.txt. Extra environment: BENCH_ARGS replaces the decode benchmark's grid,
# NCU_CONFIGS the profiled "ctx batch" pairs (comma-separated; none: no profile),
# NCU_HOT "kernel-regex ctx batch" triples for hot.txt (quick mode),
# PREBUILT (see pack).
# Needs no network: when the system lacks LAPACKE/OpenBLAS it builds with the
# extracted Debian packages in .deps (make SKV_DEPS=.deps).
set -uo pipefail
MODE=${1:-quick}
case "$MODE" in
  quick|decode|full|prefill|sanitize|repro|ab|modes|serve|tp|pack) ;;
  *) echo "unknown mode $MODE (quick|decode|full|prefill|sanitize|repro|ab|modes|serve|tp|pack)"; exit 2 ;;
esac
if [ "$MODE" = pack ]; then
  set -e
  DEPS=$PWD/.deps
  make -j"$(nproc)" SKV_DEPS=$DEPS lib build/obj/examples/synth.o build/obj/tests/common/testutil.o >/dev/null
  rm -rf build/dev && mkdir -p build/dev
  strip -o build/dev/libshadowkv.so.0 build/libshadowkv.so
  strip -o build/dev/libshadowkv-cuda.so.0 build/libshadowkv-cuda.so.0 # opened at run time, from $ORIGIN
  L=$DEPS/usr/lib/x86_64-linux-gnu
  CFL="-std=c99 -D_POSIX_C_SOURCE=200809L -O2 -fopenmp -DSKV_HAVE_CUDA -Iinclude -Ilib -I$DEPS/usr/include
       -I$DEPS/usr/include/x86_64-linux-gnu/openblas-pthread -I/usr/local/cuda/include -Itests/common -Iexamples"
  LNK="build/dev/libshadowkv.so.0 -Wl,-rpath,\$ORIGIN -L$L -L$L/openblas-pthread -llapacke -lopenblas -lm -lpthread
       -L/usr/local/cuda/lib64 -lcusolver -lcublas -lcudart -lstdc++"
  COMMON="build/obj/examples/synth.o build/obj/tests/common/testutil.o"
  for t in test_cuda test_cuda_serve test_cuda_fp8 test_values_fp8 test_tp_shard test_serve test_placement backend_ops test_accuracy test_e2e test_canonical_factor test_snapshot test_rank \
    test_canonical_decode; do cc $CFL tests/$t.c $COMMON $LNK -o build/dev/$t; done
  # test_contract calls internal functions (skv_rescore_head): the static library, the plugin next to it
  cc $CFL tests/test_contract.c $COMMON build/libshadowkv.a ${LNK#build/dev/libshadowkv.so.0} -ldl -o build/dev/test_contract
  cc $CFL bench/*.c $COMMON $LNK -o build/dev/skv-bench
  cc $CFL -Ifuzz fuzz/replay.c fuzz/fuzz_diff.c fuzz/fuzz_common.c $LNK -o build/dev/replay_fuzz_diff
  nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 dev/cuda/dmma_order_probe.cu -o build/dev/dmma_order_probe
  du -sh build/dev
  exit 0
fi
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

stamp "mode $MODE on $(hostname)"
TMP=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$TMP/gpu.txt"
nvcc --version | tail -1
nproc

MAKEVARS=""
if ! printf '#include <lapacke.h>\n#include <cblas.h>\nint main(void){return 0;}\n' | gcc -x c - -o /tmp/skv_probe -llapacke -lopenblas >/dev/null 2>&1; then
  if [ -d .deps ]; then
    MAKEVARS="SKV_DEPS=$PWD/.deps"
    export LD_LIBRARY_PATH="$PWD/.deps/usr/lib/x86_64-linux-gnu:$PWD/.deps/usr/lib/x86_64-linux-gnu/openblas-pthread:${LD_LIBRARY_PATH:-}"
    echo "using the carried dependency tree .deps"
  else
    echo "no LAPACKE/OpenBLAS on this machine and no .deps tree"; exit 1
  fi
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}

if [ "$MODE" = ab ]; then
  [ -n "${AB_DIRS:-}" ] || { echo "ab: set AB_DIRS to the prebuilt directories to compare"; exit 2; }
  names=()
  for d in $AB_DIRS; do names+=("$(basename "$d")"); done
  for round in $(seq "${AB_ROUNDS:-3}"); do
    for d in $AB_DIRS; do
      b=$(basename "$d")
      stamp "round $round, $b: decode ${AB_SHAPES:-131072x8 131072x1}"
      # every shape in one process: one json per build and round
      for shape in ${AB_SHAPES:-131072x8 131072x1}; do
        timeout 150 "$d/skv-bench" decode --backend cuda --ctx "${shape%x*}" --batch "${shape#*x}" --placement device \
          --workload fresh --steps "${AB_STEPS:-20}" --warmup 5 --reproducible --json \
          > "$TMP/dec1_${b}_${shape}_$round.json" 2>/dev/null || echo "  $shape failed"
      done
      python3 -c "import json,sys; print(json.dumps({'rows': [r for p in sys.argv[1:] for r in json.load(open(p))['rows']]}))" \
        "$TMP"/dec1_"${b}"_*_"$round".json > "$TMP/dec_${b}_$round.json" || echo "  decode rows of $b failed"
      if [ "${AB_FACTOR:-1}" = 1 ]; then
        stamp "round $round, $b: factorization (default and canonical) at ${AB_FACTOR_N:-16384,65536,131072}"
        timeout 200 "$d/skv-bench" factorize --backends cuda --route canonical --n "${AB_FACTOR_N:-16384,65536,131072}" \
          --no-baseline --reps 5 --json > "$TMP/fac_${b}_$round.json" 2>/dev/null || echo "  failed"
      fi
    done
  done
  python3 tests/gpu/ab_summary.py "$TMP" "${names[@]}" > "$OUT/ab.json"; rc=$?
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
for r in d['rows']:
    cells = ['%s %.4f%s' % (b, r[b]['median_ms'], ' (x%.3f)' % r[b]['ratio_to_first'] if 'ratio_to_first' in r[b] else '')
             for b in d['builds'] if b in r]
    print('%-48s %s  %s' % (r['what'], '  '.join(cells), 'same' if r.get('bitwise_same', r.get('same_error')) else 'DIFFERS'))
print('all outputs the same across builds:', d['all_same'], ' failed runs:', d['failed_runs'])" "$OUT/ab.json"
  exit $rc
fi

TBIN=build/tests BIN=build
if [ -n "${PREBUILT:-}" ]; then
  TBIN=$PREBUILT BIN=$PREBUILT
  stamp "prebuilt binaries in $PREBUILT (no build)"
else
stamp "build"
TESTS="test_cuda test_cuda_serve test_cuda_fp8 test_values_fp8 test_tp_shard test_serve test_placement backend_ops test_contract test_accuracy test_e2e test_numerics test_bad_input test_threads test_canonical_factor test_snapshot test_canonical_decode test_rank"
make -j"$(nproc)" $MAKEVARS lib $BIN/skv-bench $BIN/demo $(for t in $TESTS; do echo $TBIN/$t; done) \
  >"$TMP/build.txt" 2>&1
rc=$?
tail -3 "$TMP/build.txt"
[ $rc -eq 0 ] || { grep -E "error|warning" "$TMP/build.txt" | head -60; echo "BUILD FAILED"; exit 1; }
fi

# runs one test binary; records its closing line in tests.json
echo "{" > "$TMP/tests.tmp"
run_test() {
  local name=$1; shift
  stamp "test $name: $*"
  local t=$(date +%s)
  timeout ${TEST_TIMEOUT:-400} "$@" > "$TMP/t_$name.txt" 2>&1
  local rc=$?
  { echo "===== $name: $* (rc $rc)"; cat "$TMP/t_$name.txt"; } >> "$OUT/tests_log.txt"
  grep -E "FAIL|SKIP|mismatch|rror" "$TMP/t_$name.txt" | head -30
  tail -3 "$TMP/t_$name.txt"
  local line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$TMP/t_$name.txt" | tail -1)
  echo "  \"$name\": {\"cmd\": \"$*\", \"rc\": $rc, \"result\": \"$line\", \"s\": $(( $(date +%s) - t ))}," >> "$TMP/tests.tmp"
}
# the Python tests on cuda (tests/gpu/test_python_cuda.py: python/tests' backend tests and a
# decode step captured into a CUDA graph through torch); needs python3 with torch and pytest
# (transformers for the Hugging Face cache's tests)
python_cuda() {
  local lib=$PWD/$BIN/libshadowkv.so
  [ -e "$lib" ] || lib=$PWD/$BIN/libshadowkv.so.0
  if ! python3 -c "import torch, pytest" >/dev/null 2>&1; then stamp "python_cuda skipped: python3 has no torch or pytest"; return; fi
  run_test python_cuda env SHADOWKV_LIBRARY="$lib" PYTHON=python3 bash python/tests/run.sh -q -rfEsx -p no:cacheprovider \
    tests/gpu/test_python_cuda.py
}
memcheck() {
  TEST_TIMEOUT=300 run_test "memcheck_$1" compute-sanitizer --tool memcheck --leak-check full --error-exitcode 99 \
    $TBIN/$1 "${@:2}"
  grep -h "ERROR SUMMARY" "$TMP/t_memcheck_$1.txt"
}

case "$MODE" in
  quick)
    run_test test_cuda $TBIN/test_cuda
    run_test test_cuda_serve $TBIN/test_cuda_serve
    run_test test_cuda_fp8 $TBIN/test_cuda_fp8
    run_test test_serve $TBIN/test_serve
    run_test test_placement $TBIN/test_placement
    run_test backend_ops_cuda $TBIN/backend_ops -b cuda
    run_test test_contract $TBIN/test_contract 20
    run_test test_canonical_decode $TBIN/test_canonical_decode
    run_test test_e2e $TBIN/test_e2e
    run_test test_canonical_factor $TBIN/test_canonical_factor
    run_test test_snapshot $TBIN/test_snapshot
    python_cuda ;;
  decode)
    run_test test_cuda $TBIN/test_cuda
    run_test test_cuda_serve $TBIN/test_cuda_serve
    run_test test_cuda_fp8 $TBIN/test_cuda_fp8
    run_test test_serve $TBIN/test_serve
    run_test test_placement $TBIN/test_placement ;;
  full)
    run_test test_cuda $TBIN/test_cuda
    run_test test_cuda_serve $TBIN/test_cuda_serve
    run_test test_cuda_fp8 $TBIN/test_cuda_fp8
    run_test test_serve $TBIN/test_serve
    run_test test_placement $TBIN/test_placement
    run_test backend_ops_cuda $TBIN/backend_ops -b cuda
    run_test test_contract $TBIN/test_contract 100
    run_test test_canonical_decode $TBIN/test_canonical_decode
    run_test test_accuracy $TBIN/test_accuracy
    run_test test_e2e $TBIN/test_e2e
    run_test test_numerics $TBIN/test_numerics
    run_test test_bad_input $TBIN/test_bad_input
    run_test test_threads $TBIN/test_threads
    run_test test_canonical_factor $TBIN/test_canonical_factor
    run_test test_snapshot $TBIN/test_snapshot
    python_cuda
    memcheck test_cuda
    memcheck test_cuda_serve
    memcheck test_placement ;;
  repro)
    # the fp64 mma's element order, which the canonical G X and Y^T Y rely on (skv_cc_mm_tc)
    DMMA=$BIN/dmma_order_probe
    [ -x "$DMMA" ] || { DMMA=$TMP/dmma_order_probe; nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 \
      dev/cuda/dmma_order_probe.cu -o "$DMMA" >/dev/null 2>&1 || DMMA=; }
    [ -n "$DMMA" ] && run_test dmma_order_probe "$DMMA" 40000
    run_test test_canonical_factor $TBIN/test_canonical_factor
    run_test test_canonical_decode $TBIN/test_canonical_decode
    # the decode rebuild's two forms, each forced where the shape allows it (automatic above)
    run_test test_canonical_decode_split1 $TBIN/test_canonical_decode --split=1
    run_test test_canonical_decode_split0 $TBIN/test_canonical_decode --split=0
    run_test test_snapshot $TBIN/test_snapshot
    run_test test_contract $TBIN/test_contract 40
    run_test backend_ops_cuda $TBIN/backend_ops -b cuda
    [ -x $TBIN/replay_fuzz_diff ] || make $MAKEVARS $TBIN/replay_fuzz_diff >/dev/null 2>&1
    run_test replay_fuzz_diff $TBIN/replay_fuzz_diff fuzz/corpus/fuzz_diff $(ls -d fuzz/regressions/fuzz_diff 2>/dev/null)
    [ -n "${REPRO_PY:-}" ] && python_cuda ;;
  sanitize)
    memcheck test_cuda
    memcheck test_cuda_serve
    memcheck test_placement
    memcheck backend_ops -b cuda ;;
  serve)
    run_test test_cuda_serve $TBIN/test_cuda_serve
    run_test test_serve $TBIN/test_serve
    TEST_TIMEOUT=600 run_test test_serve_large env SKV_SERVE_LOAD=large $TBIN/test_serve
    memcheck test_cuda_serve
    stamp "serving benchmark"
    timeout 600 $BIN/skv-bench serve --backend cuda --layers 32 --slots 8 --requests 64 --ctx-min 4096 \
      --ctx-max 32768 --steps-min 8 --steps-max 200 --arrival-s 2 --stream high ${SERVE_ARGS:-} --json \
      > "$OUT/serving.json" 2> "$TMP/serving.err"; tail -3 "$TMP/serving.err"
    echo "[" > "$OUT/beside.json"
    for r in $(seq ${SERVE_ROUNDS:-2}); do for s in default high; do for p in ${SERVE_SMS:-0}; do
      timeout 300 $BIN/skv-bench serve --beside --backend cuda --layers 4 --slots 8 --ctx-max 32768 --requests 8 \
        --steps-max 200 --stream $s --prefill-sms $p ${SERVE_ARGS:-} --json 2>/dev/null | sed 's/$/,/' >> "$OUT/beside.json"
    done; done; done
    sed -i '$ s/,$//' "$OUT/beside.json"; echo "]" >> "$OUT/beside.json"; cat "$OUT/beside.json" ;;
  tp)
    NGPU=$(nvidia-smi -L | grep -c '^GPU')
    lib=$PWD/$BIN/libshadowkv.so; [ -e "$lib" ] || lib=$PWD/$BIN/libshadowkv.so.0
    PYENV="env SHADOWKV_LIBRARY=$lib PYTHONPATH=$PWD/python NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}"
    TR="python3 -m torch.distributed.run --standalone"
    if [ "${TP_TESTS:-1}" = 1 ]; then
      run_test test_tp_shard $TBIN/test_tp_shard
      run_test test_cuda $TBIN/test_cuda
      run_test test_cuda_serve $TBIN/test_cuda_serve
      run_test test_cuda_fp8 $TBIN/test_cuda_fp8
      run_test test_values_fp8 $TBIN/test_values_fp8
      run_test test_snapshot $TBIN/test_snapshot
      run_test tp_decode_nccl_$NGPU $PYENV $TR --nproc_per_node "$NGPU" examples/tp_decode.py --ctx "${TP_CTX:-16384}"
      run_test tp_decode_gloo_same_gpu $PYENV $TR --nproc_per_node 2 examples/tp_decode.py --same-gpu --dist-backend gloo \
        --ctx "${TP_CTX:-16384}"
      # the collectives captured in the CUDA graphs, over a group of one (runs on any machine)
      run_test e2e_smoke_nccl_group_of_one $PYENV SKV_TP_COLLECTIVES=1 $TR --nproc_per_node 1 bench/e2e_throughput.py \
        --smoke --tp 1
    fi
    echo "[" > "$OUT/tp.json"
    [ "${TP_E2E:-1}" = 1 ] && for tp in ${TP_LIST:-1 2}; do for r in $(seq ${TP_ROUNDS:-1}); do
      stamp "e2e --tp $tp on one GPU, round $r"
      timeout 580 $PYENV python3 bench/e2e_throughput.py --ctx "${TP_E2E_CTX:-131072}" --tp $tp ${TP_E2E_ARGS:-} \
        --json "$TMP/e2e_tp$tp.json" > "$TMP/e2e_tp$tp.txt" 2>&1; echo "  rc $?"; tail -4 "$TMP/e2e_tp$tp.txt"
      [ -s "$TMP/e2e_tp$tp.json" ] && { cat "$TMP/e2e_tp$tp.json"; echo ","; } >> "$OUT/tp.json"
    done; done
    if [ "$NGPU" -ge 2 ] && [ "${TP_E2E:-1}" = 1 ]; then
      stamp "e2e --tp 2 under torchrun, NCCL, 2 GPUs"
      timeout 580 $PYENV $TR --nproc_per_node 2 bench/e2e_throughput.py --ctx "${TP_E2E_CTX:-131072}" --tp 2 \
        ${TP_E2E_ARGS:-} --json "$TMP/e2e_tp2_dist.json" > "$TMP/e2e_tp2_dist.txt" 2>&1; echo "  rc $?"
      tail -4 "$TMP/e2e_tp2_dist.txt"
      [ -s "$TMP/e2e_tp2_dist.json" ] && { cat "$TMP/e2e_tp2_dist.json"; echo ","; } >> "$OUT/tp.json"
    fi
    sed -i '$ s/,$//' "$OUT/tp.json"; echo "]" >> "$OUT/tp.json" ;;
  modes)
    run_test test_cuda $TBIN/test_cuda
    run_test test_contract $TBIN/test_contract 40
    run_test backend_ops_cuda $TBIN/backend_ops -b cuda
    run_test test_placement $TBIN/test_placement
    run_test test_canonical_decode $TBIN/test_canonical_decode
    run_test test_e2e $TBIN/test_e2e
    run_test test_snapshot $TBIN/test_snapshot
    run_test test_rank $TBIN/test_rank ;;
esac

decode_bench() {
  local args=$1
  stamp "dense baseline (torch sdpa flash)"
  timeout 240 python3 tests/gpu/dense_decode.py $DENSE_ARGS > "$TMP/dense.json"
  stamp "skv-bench decode $args"
  timeout 480 $BIN/skv-bench decode --backend cuda $args --json > "$OUT/bench_decode.json"
  stamp "decode table"
  python3 tests/gpu/decode_table.py "$OUT/bench_decode.json" "$TMP/dense.json" "$TMP/gpu.txt" > "$OUT/decode.json"
}
# device time, DRAM throughput, occupancy and the main stall reasons of each decode kernel,
# one step per configuration (ncu serializes kernels)
ncu_decode() {
  local M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum
  M=$M,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum
  for r in barrier long_scoreboard short_scoreboard wait mio_throttle lg_throttle math_pipe_throttle membar no_instruction; do
    M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
  done
  local IFS_SAVE=$IFS
  IFS=,
  for cfgs in ${NCU_CONFIGS:-131072 8,131072 1,32768 8,1048576 1}; do
    IFS=$IFS_SAVE
    set -- $cfgs
    stamp "ncu: decode kernels at $1 tokens, batch $2, device values, fresh queries"
    echo "== ctx $1 batch $2" >> "$OUT/ncu.txt"
    timeout 200 ncu --clock-control none -k regex:"score_kernel|expsum|select_kernel|selz|attend|combine" \
      --launch-skip 5 --launch-count 5 --metrics $M $BIN/skv-bench decode --backend cuda --ctx $1 --batch $2 \
      --placement device --workload fresh --steps 2 --warmup 1 2>/dev/null |
      grep -E "void|_kernel|duration|pct|inst_exec|stalled|bytes" |
      sed -e 's/smsp__average_warps_issue_stalled_//' -e 's/_per_issue_active.ratio//' -e 's/  */ /g' | cut -c1-100 |
      tee -a "$OUT/ncu.txt"
    IFS=,
  done
  IFS=$IFS_SAVE
}

# where the time of one kernel goes, per SASS instruction (warp-stall samples), at one
# configuration: NCU_HOT="kernel-regex ctx batch" (several separated by commas)
ncu_hot() {
  local IFS_SAVE=$IFS
  IFS=,
  for spec in $NCU_HOT; do
    IFS=$IFS_SAVE
    set -- $spec
    stamp "ncu hot spots: $1 at $2 tokens, batch $3"
    rm -f "$TMP/hot.ncu-rep"
    timeout 200 ncu --clock-control none --set full -k regex:"$1" --launch-skip 2 --launch-count 1 -o "$TMP/hot" \
      $BIN/skv-bench decode --backend cuda --ctx $2 --batch $3 --placement device --workload fresh --steps 2 \
      --warmup 1 >/dev/null 2>&1
    ncu -i "$TMP/hot.ncu-rep" --page source --csv --print-source sass > "$TMP/hot.csv" 2>&1
    { echo "== $1 at $2 x $3"; python3 tests/gpu/ncu_hot.py "$TMP/hot.csv" 45; } | tee -a "$OUT/hot.txt"
    IFS=,
  done
  IFS=$IFS_SAVE
}

if [ "$MODE" = quick ]; then
  DENSE_ARGS="--ctx 32768,131072 --batch 1,8"
  decode_bench "${BENCH_ARGS:---ctx 32768,131072 --batch 1,8 --steps 15 --warmup 3}"
  [ -n "${NCU_CONFIGS:-}" ] && [ "${NCU_CONFIGS}" != none ] && ncu_decode
  [ -n "${NCU_HOT:-}" ] && ncu_hot
fi
if [ "$MODE" = decode ] || [ "$MODE" = full ]; then
  DENSE_ARGS="--ctx 32768,131072,1048576 --batch 1,8,32"
  decode_bench "${BENCH_ARGS:---ctx 32768,131072,1048576 --batch 1,8,32 --steps 30 --warmup 5}"
  [ "$MODE" = decode ] && [ "${NCU_CONFIGS:-}" != none ] && ncu_decode
fi
if [ "$MODE" = prefill ]; then
  stamp "skv-bench factorize --n 16384..1048576 (GPU routes and baselines; cpu up to 64k)"
  timeout 400 $BIN/skv-bench factorize --n 16384,65536,131072,524288,1048576 --json > "$OUT/factorize.json"
  stamp "demos: 32 layers; one 131072-token sequence, 8 of 32768, one of 65536"
  { echo '{"one_128k": '; timeout 200 $BIN/demo --backend cuda --layers 32 --ctx 131072 --steps 32 --share-layers --json;
    echo ', "batch8_32k": '; timeout 200 $BIN/demo --backend cuda --layers 32 --ctx 32768,32768,32768,32768,32768,32768,32768,32768 --steps 32 --share-layers --json;
    echo ', "one_64k": '; timeout 200 $BIN/demo --backend cuda --layers 32 --ctx 65536 --steps 32 --share-layers --json;
    echo '}'; } > "$OUT/demo.json"
fi
if [ "$MODE" = repro ]; then
  stamp "factorization, default and canonical routes in one run (16k, 64k, 128k)"
  timeout 300 $BIN/skv-bench factorize --backends cuda --route canonical --n 16384,65536,131072 --no-baseline \
    --reps 5 --json > "$OUT/factorize_repro.json"
  stamp "decode step, default and reproducible mode in one run"
  timeout 300 $BIN/skv-bench decode --backend cuda --ctx 131072,32768 --batch 8,1 --placement device \
    --workload fresh --steps 20 --warmup 5 --reproducible --json > "$OUT/decode_repro.json"
  # the ratio moves by several percent between runs: REPRO_RUNS more runs at 128k x 8, each with both
  # modes, and their median (decode_repro_runs.json)
  stamp "decode step at 128k x 8, ${REPRO_RUNS:-5} more runs of both modes"
  rr=()
  for i in $(seq "${REPRO_RUNS:-5}"); do
    timeout 120 $BIN/skv-bench decode --backend cuda --ctx 131072 --batch 8 --placement device --workload fresh \
      --steps 20 --warmup 5 --reproducible --json > "$TMP/rr_$i.json" && rr+=("$TMP/rr_$i.json")
  done
  python3 tests/gpu/repro_ratio.py "${rr[@]}" > "$OUT/decode_repro_runs.json"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('ratio median', d.get('median_ratio'), 'range', d.get('min_ratio'), '..', d.get('max_ratio'), 'over', d.get('n'), 'runs')" "$OUT/decode_repro_runs.json"
fi
if [ "$MODE" = modes ]; then
  stamp "decode step: --select ${SELECT_VARIANTS:-fixed,mass,dense} (mass ${SELECT_MASS:-0.95}) at ${SELECT_CTX:-32768,131072} x ${SELECT_BATCH:-1,8}"
  timeout 500 $BIN/skv-bench decode --backend cuda --ctx "${SELECT_CTX:-32768,131072}" --batch "${SELECT_BATCH:-1,8}" \
    --placement device --workload fresh,drift --select "${SELECT_VARIANTS:-fixed,mass,dense}" \
    --select-mass "${SELECT_MASS:-0.95}" --steps 20 --warmup 5 ${SELECT_REPRO:+--reproducible} --json > "$OUT/bench_select.json"
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
base = {(r['ctx'], r['batch'], r['workload'], r['mode']): r['step_ms'] for r in d['rows'] if r['select'] == 'fixed'}
for r in d['rows']:
    b = base.get((r['ctx'], r['batch'], r['workload'], r['mode']))
    print('%8d x %-2d %-6s %-12s %-6s %7.1f chunks/head, attended %.4f: %.4f ms/step%s' % (r['ctx'], r['batch'], r['workload'],
          r['mode'], r['select'], r['chunks_per_head'], r['attended_share'], r['step_ms'], ' (x%.3f fixed)' % (r['step_ms'] / b) if b else ''))
" "$OUT/bench_select.json"
fi
sed -i '$ s/,$//' "$TMP/tests.tmp"; echo "}" >> "$TMP/tests.tmp"; mv "$TMP/tests.tmp" "$OUT/tests.json"
stamp "done"
