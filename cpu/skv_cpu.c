/*
 * cpu backend: the dispatch table, and the slots that only move or check
 * memory (check_finite, gather_values). The top layer (skv_cpu_ops.h has the
 * map of the layers).
 */
#include <string.h>

#include "skv_cpu_kernels.h"
#include "skv_cpu_ops.h"

/* ---- check_finite, gather_values ------------------------------------------------------- */

/* First non-finite index of a contiguous tensor; blocks in parallel (one job), min of the first hits. */
typedef struct {
    const skv_bf16 *x;
    int64_t n;
    int64_t first; /* atomic: the least first hit so far, n if none */
} skv_cpu_check;

#define SKV_CPU_CHECK_B ((int64_t)1 << 16) /* values per work item */

static void skv_cpu_check_item(void *ctx, int64_t b, int t)
{
    skv_cpu_check *c = ctx;
    (void)t;
    int64_t lo = b * SKV_CPU_CHECK_B, hi = lo + SKV_CPU_CHECK_B < c->n ? lo + SKV_CPU_CHECK_B : c->n;
    unsigned bad = 0;
    for (int64_t i = lo; i < hi; i++) bad |= (c->x[i] & 0x7f80u) == 0x7f80u; /* vectorizes */
    if (!bad) return;
    for (int64_t i = lo; i < hi; i++)
        if (!skv_bf16_isfinite(c->x[i])) {
            int64_t cur = __atomic_load_n(&c->first, __ATOMIC_RELAXED);
            while (i < cur && !__atomic_compare_exchange_n(&c->first, &cur, i, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            }
            return;
        }
}

static skv_status skv_cpu_check_contiguous(const skv_bf16 *x, int64_t n, int64_t *first_bad)
{
    if (n <= 4 * SKV_CPU_CHECK_B) { /* lib/ also checks single rows: no job for those */
        for (int64_t i = 0; i < n; i++)
            if (!skv_bf16_isfinite(x[i])) {
                *first_bad = i;
                return SKV_ERR_NONFINITE;
            }
        return SKV_OK;
    }
    skv_cpu_check c = {x, n, n};
    int64_t nb = (n + SKV_CPU_CHECK_B - 1) / SKV_CPU_CHECK_B;
    skv_cpu_run(skv_cpu_team(nb), nb, skv_cpu_check_item, &c);
    if (c.first == n) return SKV_OK;
    *first_bad = c.first;
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
    size_t block, rec; /* values per chunk (c * D); bytes per chunk record */
    int32_t S, n_store, c, D, value_dtype;
    const uint8_t *store;
    const int32_t *idx, *counts;
    skv_bf16 *v_out;
    float e4m3[256]; /* fp8: each code's value (skv_fp8_decode(code, 0), exact in float) */
} skv_cpu_gather;

/* One fp8 record into bf16: code * 2^k in float is exact (a normal float of 4 significant bits, k >=
   SKV_FP8_EXP_MIN), so its upper half is skv_fp8_decode's bf16 bit for bit (test_values_fp8 checks
   cpu against ref). */
static void skv_cpu_fp8_decode_chunk(const skv_cpu_gather *g, const uint8_t *rec, skv_bf16 *out)
{
    const int8_t *ex = (const int8_t *)(rec + (size_t)g->c * g->D);
    for (int32_t i = 0; i < g->c; i++) {
        const float s = skv_f32_from_bits((uint32_t)(ex[i] + 127) << 23);
        const uint8_t *code = rec + (size_t)i * g->D;
        skv_bf16 *o = out + (size_t)i * g->D;
        for (int32_t d = 0; d < g->D; d++) o[d] = (skv_bf16)(skv_bits_from_f32(g->e4m3[code[d]] * s) >> 16);
    }
}

#define SKV_CPU_GATHER_ITEM 64 /* chunks per work item */

/* Chunk hs (head hs / S, entry hs % S) of the selection, unless past its head's count (not read). */
static void skv_cpu_gather_one(const skv_cpu_gather *g, int64_t hs)
{
    if (g->counts && hs % g->S >= g->counts[hs / g->S]) return;
    const uint8_t *src = g->store + ((size_t)(hs / g->S) * g->n_store + g->idx[hs]) * g->rec;
    if (g->value_dtype == SKV_VALUE_FP8) skv_cpu_fp8_decode_chunk(g, src, g->v_out + hs * g->block);
    else memcpy(g->v_out + hs * g->block, src, g->rec);
}

static void skv_cpu_gather_item(void *ctx, int64_t it, int t)
{
    (void)t;
    for (int64_t hs = it * SKV_CPU_GATHER_ITEM; hs < (it + 1) * SKV_CPU_GATHER_ITEM; hs++)
        skv_cpu_gather_one((const skv_cpu_gather *)ctx, hs);
}

static skv_status skv_cpu_gather_values(int32_t Hk, int32_t D, int32_t c, int32_t n_store, int32_t S,
                                        int32_t value_dtype, const void *store, const int32_t *idx,
                                        const int32_t *counts, skv_bf16 *v_out)
{
    skv_cpu_gather g = {(size_t)c * D, skv_value_chunk_bytes(value_dtype, c, D), S, n_store, c, D, value_dtype,
                        (const uint8_t *)store, idx, counts, v_out, {0}};
    if (value_dtype == SKV_VALUE_FP8)
        for (int x = 0; x < 256; x++) g.e4m3[x] = skv_bf16_to_f32(skv_fp8_decode((uint8_t)x, 0));
    int64_t n = (int64_t)Hk * S, full = n / SKV_CPU_GATHER_ITEM;
    /* A decode step copies ~4 MB: one thread does that at memory speed; larger copies (and any
       fp8 decoding) in parallel. */
    if ((size_t)n * g.block * sizeof *v_out > ((size_t)(value_dtype ? 1 : 8) << 20))
        skv_cpu_run(skv_cpu_team(full), full, skv_cpu_gather_item, &g);
    else full = 0;
    for (int64_t hs = full * SKV_CPU_GATHER_ITEM; hs < n; hs++) skv_cpu_gather_one(&g, hs);
    return SKV_OK;
}

/*
 * The arena of one decode step (one sequence): the largest of the three slots'
 * skv_ws_alloc totals, for the thread count decode will run with.
 * test_contract checks that no decode ever spills past it.
 */
static size_t skv_cpu_decode_ws_bytes(const skv_config *cfg, int32_t cand_max, int64_t max_attn_tokens)
{
    int nt = cfg->n_threads > 0 ? cfg->n_threads : skv_cpu_threads(); /* at create: no call in progress */
    const int32_t S = cfg->budget == SKV_BUDGET_ALL ? cand_max : cfg->budget / cfg->chunk_size;
    size_t sel = skv_cpu_select_ws_bytes(cfg, cand_max), reb = skv_cpu_rebuild_ws_bytes(cfg, S, nt);
    size_t att = skv_cpu_attn_ws_bytes(cfg, max_attn_tokens, nt);
    size_t m = sel > reb ? sel : reb;
    if (cfg->reproducible || cfg->select_candidates) { /* the canonical rebuild also serves the rescoring (4.5.1) */
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

