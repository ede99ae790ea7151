/*
 * cpu backend: the dispatch table, and the slots that only move or check
 * memory (check_finite, gather_values). See skv_cpu.h.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "skv_cpu.h"
#include "skv_internal.h"

/* ---- instruction set and threads ---------------------------------------------------------- */

static int skv_cpu_simd_hw;   /* what the CPU has */
static int skv_cpu_simd_env;  /* the cap SKV_CPU_SIMD sets (used while no explicit choice is made) */
static int skv_cpu_simd_set = -1; /* skv_cpu_set_simd's cap; -1: none (atomic accesses) */
static pthread_once_t skv_cpu_simd_once = PTHREAD_ONCE_INIT;

static void skv_cpu_simd_init(void)
{
    const char *e = getenv("SKV_CPU_SIMD");
    skv_cpu_simd_env = e && !strcmp(e, "0") ? 0 : e && !strcmp(e, "avx2") ? SKV_CPU_LEVEL_AVX2 : SKV_CPU_LEVEL_AVX512;
#if SKV_CPU_X86
    __builtin_cpu_init();
    skv_cpu_simd_hw = !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ? 0
                      : __builtin_cpu_supports("avx512f")                                 ? SKV_CPU_LEVEL_AVX512
                                                                                          : SKV_CPU_LEVEL_AVX2;
#endif
}

int skv_cpu_simd(void)
{
    pthread_once(&skv_cpu_simd_once, skv_cpu_simd_init);
    int set = __atomic_load_n(&skv_cpu_simd_set, __ATOMIC_RELAXED);
    int cap = set >= 0 ? set : skv_cpu_simd_env; /* an explicit choice wins over the environment */
    return skv_cpu_simd_hw < cap ? skv_cpu_simd_hw : cap;
}

SKV_API skv_status skv_cpu_set_simd(int32_t level)
{
    if (level < -1 || level > SKV_CPU_LEVEL_AVX512)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT,
                        "skv_cpu_set_simd: level = %d: expected -1 (default), 0, 1 (AVX2+FMA) or 2 (AVX-512)",
                        (int)level);
    __atomic_store_n(&skv_cpu_simd_set, level, __ATOMIC_RELAXED);
    return SKV_OK;
}

SKV_API int32_t skv_cpu_simd_level(void) { return skv_cpu_simd(); }

/* config.n_threads of the cache call in progress on this thread; 0 outside one. */
static __thread int32_t skv_cpu_call_threads;

/* lib/ calls this with config.n_threads when a prefill or decode starts on this thread and with 0
   when it ends: the count goes to num_threads clauses and the decode helpers (skv_cpu_run); the
   caller's OpenMP state is never touched. */
static void skv_cpu_set_threads(int32_t n) { skv_cpu_call_threads = n > 0 ? n : 0; }

int skv_cpu_threads(void) { return skv_cpu_call_threads > 0 ? skv_cpu_call_threads : omp_get_max_threads(); }

/* ---- check_finite, gather_values ------------------------------------------------------- */

/* First non-finite index of a contiguous tensor; blocks in parallel, min of the first hits. */
static skv_status skv_cpu_check_contiguous(const skv_bf16 *x, int64_t n, int64_t *first_bad)
{
    const int64_t B = 1 << 16;
    int64_t nb = (n + B - 1) / B, first = n;
    if (n <= 4 * B) { /* lib/ also checks single rows: no OpenMP overhead for those */
        for (int64_t i = 0; i < n; i++)
            if (!skv_bf16_isfinite(x[i])) {
                *first_bad = i;
                return SKV_ERR_NONFINITE;
            }
        return SKV_OK;
    }
#pragma omp parallel for num_threads(skv_cpu_threads()) schedule(static) reduction(min : first)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * B, hi = lo + B < n ? lo + B : n;
        unsigned bad = 0;
        for (int64_t i = lo; i < hi; i++) bad |= (x[i] & 0x7f80u) == 0x7f80u; /* vectorizes */
        if (!bad) continue;
        for (int64_t i = lo; i < hi; i++)
            if (!skv_bf16_isfinite(x[i])) {
                if (i < first) first = i;
                break;
            }
    }
    if (first == n) return SKV_OK;
    *first_bad = first;
    return SKV_ERR_NONFINITE;
}

/* Strided tensors row by row (rows are what lib/ passes for spans). */
static skv_status skv_cpu_check_finite(const skv_bf16 *x, int64_t n_a, int64_t s_a, int64_t n_b, int64_t s_b,
                                       int64_t len, int64_t *first_bad)
{
    if (n_a == 1 && n_b == 1) return skv_cpu_check_contiguous(x, len, first_bad);
    for (int64_t i = 0; i < n_a; i++)
        for (int64_t j = 0; j < n_b; j++)
            if (skv_cpu_check_contiguous(x + i * s_a + j * s_b, len, first_bad) != SKV_OK) {
                *first_bad += (i * n_b + j) * len;
                return SKV_ERR_NONFINITE;
            }
    return SKV_OK;
}

typedef struct {
    size_t block; /* values per chunk: c * D */
    int32_t S, n_store;
    const skv_bf16 *store;
    const int32_t *idx;
    skv_bf16 *v_out;
} skv_cpu_gather;

#define SKV_CPU_GATHER_ITEM 64 /* chunks per work item */

static void skv_cpu_gather_item(void *ctx, int64_t it, int t)
{
    const skv_cpu_gather *g = ctx;
    (void)t;
    for (int64_t hs = it * SKV_CPU_GATHER_ITEM; hs < (it + 1) * SKV_CPU_GATHER_ITEM; hs++)
        memcpy(g->v_out + hs * g->block, g->store + ((size_t)(hs / g->S) * g->n_store + g->idx[hs]) * g->block,
               g->block * sizeof *g->store);
}

static skv_status skv_cpu_gather_values(int32_t Hk, int32_t D, int32_t c, int32_t n_store, int32_t S,
                                        const skv_bf16 *store, const int32_t *idx, skv_bf16 *v_out)
{
    skv_cpu_gather g = {(size_t)c * D, S, n_store, store, idx, v_out};
    int64_t n = (int64_t)Hk * S, full = n / SKV_CPU_GATHER_ITEM;
    /* A decode step copies ~4 MB: one thread does that at memory speed; larger copies in parallel. */
    if ((size_t)n * g.block * sizeof *store > ((size_t)8 << 20)) skv_cpu_run(skv_cpu_team(full), full, skv_cpu_gather_item, &g);
    else full = 0;
    for (int64_t hs = full * SKV_CPU_GATHER_ITEM; hs < n; hs++)
        memcpy(v_out + hs * g.block, store + ((size_t)(hs / S) * n_store + idx[hs]) * g.block, g.block * sizeof *store);
    return SKV_OK;
}

/*
 * The arena of one decode step (one sequence): the largest of the three slots'
 * skv_ws_alloc totals, for the thread count decode will run with.
 * test_contract checks that no decode ever spills past it.
 */
static size_t skv_cpu_decode_ws_bytes(const skv_config *cfg, int32_t cand_max, int64_t max_attn_tokens)
{
    int nt = cfg->n_threads > 0 ? cfg->n_threads : omp_get_max_threads();
    size_t sel = skv_cpu_select_ws_bytes(cfg, cand_max), reb = skv_cpu_rebuild_ws_bytes(cfg, nt);
    size_t att = skv_cpu_attn_ws_bytes(cfg, max_attn_tokens, nt);
    size_t m = sel > reb ? sel : reb;
    if (cfg->reproducible) {
        size_t canon = skv_cpu_canon_ws_bytes(cfg, max_attn_tokens, nt);
        if (canon > m) m = canon;
    }
    return m > att ? m : att;
}

/* ---- table ----------------------------------------------------------------------------- */

void skv_cpu_fill_ops(struct skv_backend_ops *ops)
{
    *ops = skv_ref_ops;
    ops->name = "cpu";
    ops->check_finite = skv_cpu_check_finite;
    ops->set_threads = skv_cpu_set_threads;
    ops->decode_ws_bytes = skv_cpu_decode_ws_bytes;
    ops->factorize = skv_cpu_factorize;
    ops->rope = skv_cpu_rope;
    ops->landmarks_outliers = skv_cpu_landmarks_outliers;
    ops->score_select = skv_cpu_score_select;
    ops->rebuild_keys = skv_cpu_rebuild_keys;
    ops->gather_values = skv_cpu_gather_values;
    ops->sparse_attention = skv_cpu_sparse_attention;
    ops->rebuild_keys_canonical = skv_cpu_rebuild_keys_canonical;
    ops->sparse_attention_canonical = skv_cpu_sparse_attention_canonical;
    ops->full_attention = skv_cpu_full_attention;
}

void *skv_cpu_alloc(size_t bytes)
{
    void *p = NULL;
    return posix_memalign(&p, 64, bytes ? bytes : 64) ? NULL : p;
}
