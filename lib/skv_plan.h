/*
 * skv_plan.h - the decode plan, in one place for lib/ and every backend
 * (static inline; compiles as C99 and as CUDA host/device code).
 *
 *  - The span layout of a decode step: the tokens one query head attends to
 *    are five spans, in this order: the exact outlier chunks, the local
 *    window, the selected chunks (rebuilt keys), the generated tokens and the
 *    new token. skv_plan_spans gives each span's token count and the element
 *    stride between KV heads inside its buffer; skv_plan_max_tokens bounds
 *    their sum for a config (workspaces are sized from it).
 *  - The chunk cache of a host-placed (layer, sequence): which selected
 *    chunks hit, which cache entries the misses replace. The rule is defined
 *    here by skv_vcache_step (host code, ref and cpu run it); the cuda backend
 *    runs the same rule in parallel and test_placement pins its hit and miss
 *    counts to this function's.
 */
#ifndef SKV_PLAN_H
#define SKV_PLAN_H

#include <stdint.h>

#if defined(__CUDACC__)
#define SKV_PLAN_HD __host__ __device__ __forceinline__
#else
#define SKV_PLAN_HD static inline
#endif

/* ---- spans of a decode step ----------------------------------------------------- */

enum {
    SKV_SPAN_OUTLIERS = 0, /* [Hk, O*c, D] */
    SKV_SPAN_LOCAL = 1,    /* [Hk, n_local, D] */
    SKV_SPAN_SELECTED = 2, /* [Hk, S*c, D] rebuilt keys, gathered values */
    SKV_SPAN_GENERATED = 3,/* [Hk, gen_capacity, D], the first n_gen rows */
    SKV_SPAN_NEW = 4,      /* [Hk, D] the step's own token */
    SKV_N_SPANS = 5
};

/* Token count and head stride (elements) of one span; tokens are D elements apart. */
typedef struct skv_span_shape {
    int64_t n_tokens;
    int64_t head_stride;
} skv_span_shape;

/* The five spans of a step of one sequence with n_local local and n_gen generated tokens. */
SKV_PLAN_HD void skv_plan_spans(int32_t O, int32_t c, int32_t S, int32_t D, int32_t n_local, int32_t n_gen,
                                int32_t gen_capacity, skv_span_shape sp[SKV_N_SPANS])
{
    const int64_t oc = (int64_t)O * c, sc = (int64_t)S * c;
    sp[SKV_SPAN_OUTLIERS].n_tokens = oc;
    sp[SKV_SPAN_OUTLIERS].head_stride = oc * D;
    sp[SKV_SPAN_LOCAL].n_tokens = n_local;
    sp[SKV_SPAN_LOCAL].head_stride = (int64_t)n_local * D;
    sp[SKV_SPAN_SELECTED].n_tokens = sc;
    sp[SKV_SPAN_SELECTED].head_stride = sc * D;
    sp[SKV_SPAN_GENERATED].n_tokens = n_gen;
    sp[SKV_SPAN_GENERATED].head_stride = (int64_t)gen_capacity * D;
    sp[SKV_SPAN_NEW].n_tokens = 1;
    sp[SKV_SPAN_NEW].head_stride = D;
}

/* Tokens of every span but the selected one (the "resident" tokens, read as stored). */
SKV_PLAN_HD int64_t skv_plan_resident_tokens(int32_t O, int32_t c, int32_t n_local, int32_t n_gen)
{
    return (int64_t)O * c + n_local + n_gen + 1;
}

/* Most resident tokens of a step: n_local <= local_max, n_gen <= gen_capacity - 1. */
SKV_PLAN_HD int64_t skv_plan_max_resident(int32_t O, int32_t c, int32_t local_max, int32_t gen_capacity)
{
    return (int64_t)O * c + local_max + gen_capacity;
}

/* Most tokens one query head attends to in a step. */
SKV_PLAN_HD int64_t skv_plan_max_tokens(int32_t O, int32_t c, int32_t S, int32_t local_max, int32_t gen_capacity)
{
    return (int64_t)S * c + skv_plan_max_resident(O, c, local_max, gen_capacity);
}

/* ---- the chunk cache of a host-placed slot -------------------------------------------- */

/*
 * State per KV head: slot_of[m] is the entry holding candidate m (-1: none),
 * owner[e] the candidate entry e holds (-1: empty), stamp[e] the step that
 * last used entry e (-1: never). A step has a number (the slot's generated
 * count before the step) and S selected candidates sel[0..S) in increasing
 * order. The rule:
 *  1. sel[s] hits when slot_of[sel[s]] >= 0; its entry is stamped with the step
 *     (pinned: it cannot be replaced in this step);
 *  2. the misses replace the n_miss entries that are least recently used:
 *     not pinned, smallest (stamp, entry index) first;
 *  3. the i-th miss in increasing s takes the i-th of those entries in
 *     increasing entry index, which is stamped and now holds the candidate.
 * n_entries >= S guarantees enough unpinned entries.
 */

/* Order key of entry e for step `step` (smaller is replaced first; pinned entries last). */
SKV_PLAN_HD float skv_vcache_age_key(int32_t stamp, int32_t step)
{
    return stamp == step ? 33554432.0f /* 2^25: after any stamp (steps < 2^24) */ : (float)stamp;
}

#if !defined(__CUDA_ARCH__)
/* skv_topk_indices (lib/skv_util.c), declared here so this header needs no other. */
void skv_topk_indices(const float *keys, int32_t n, int32_t k, int ascending, int32_t *scratch, int32_t *out);

/*
 * One step of one KV head's chunk cache (host code). entry_out[s] receives the
 * entry of sel[s]; miss_out[s] 1 for a miss. scratch: 3 * n_entries floats/int32.
 * Returns the number of hits.
 */
static inline int32_t skv_vcache_step(int32_t *slot_of, int32_t *owner, int32_t *stamp, int32_t n_entries,
                                      const int32_t *sel, int32_t S, int32_t step, int32_t *entry_out,
                                      int32_t *miss_out, void *scratch)
{
    float *key = (float *)scratch;
    int32_t *idx = (int32_t *)scratch + n_entries, *victims = idx + n_entries;
    int32_t hits = 0;
    for (int32_t s = 0; s < S; s++) {
        const int32_t e = slot_of[sel[s]];
        miss_out[s] = e < 0;
        entry_out[s] = e;
        if (e >= 0) {
            stamp[e] = step;
            hits++;
        }
    }
    const int32_t n_miss = S - hits;
    if (n_miss == 0) return hits;
    for (int32_t e = 0; e < n_entries; e++) key[e] = skv_vcache_age_key(stamp[e], step);
    skv_topk_indices(key, n_entries, n_miss, 1, idx, victims);
    for (int32_t s = 0, i = 0; s < S; s++) {
        if (!miss_out[s]) continue;
        const int32_t e = victims[i++];
        if (owner[e] >= 0) slot_of[owner[e]] = -1;
        owner[e] = sel[s];
        slot_of[sel[s]] = e;
        stamp[e] = step;
        entry_out[s] = e;
    }
    return hits;
}
#endif

#endif /* SKV_PLAN_H */
