/*
 * skv_cuda_workspace.cu - what a cache's decode is sized and shaped by: the decode workspace's
 * layout (skv_cuda_dws_layout, skv_cuda_dws_clear; the op-level score_select carves one too), the
 * cache's shapes (a sparse layer's, a dense layer's) and their attention items, and the reproducible
 * mode's score row length. Host code only; skv_cuda_cache.cu (cache_bytes, cache_open, a decode
 * step) and skv_cuda_ops.cu use it.
 */
#include <string.h>

#include "skv_cuda.h"
#include "skv_internal.h"
#include "skv_plan.h"

/* ---- the decode workspace ----------------------------------------------------------------- */

/*
 * The decode workspace, carved from one allocation: its bytes (base NULL) or its pointers.
 * it: the attention items; host: whether any slot keeps its values on the host (the chunk
 * cache's lists and the deferred weights exist only then). Counters that the kernels expect
 * zero (macc, cnt_e, cnt_sel, step_bad, cnt_done, vc_counts) come zeroed from
 * skv_cuda_dws_clear.
 */
size_t skv_cuda_dws_layout(skv_cuda_dws *ws, char *base, int32_t B, int32_t Hq, int32_t Hk, int32_t D, int32_t S,
                           int32_t c, int32_t cand_max, skv_cuda_items it, int host, int64_t canon_tmax, int mass,
                           int32_t W)
{
    size_t off = 0;
    const size_t bq = (size_t)B * Hq, bk = (size_t)B * Hk;
    const int32_t pool_cap = skv_cuda_pool_cap(cand_max, W > S ? W : S); /* the rescoring's first stage selects W */
#define SKV_REGION(field, type, count)                                                                 \
    do {                                                                                               \
        if (base) ws->field = (type *)(base + off);                                                    \
        off += ((size_t)(count) * sizeof(type) + 255) & ~(size_t)255;                                  \
    } while (0)
    SKV_REGION(scores, float, bq * cand_max);
    SKV_REGION(macc, unsigned, bq);
    SKV_REGION(s0, float, bq);
    SKV_REGION(Z, float, bq);
    SKV_REGION(cnt_e, unsigned, bq);
    SKV_REGION(cnt_sel, unsigned, bk);
    SKV_REGION(pool, unsigned long long, bk * pool_cap);
    SKV_REGION(sel_idx, int32_t, bk * S);
    SKV_REGION(sel_ids, int32_t, bk * S);
    SKV_REGION(sel_cnt, int32_t, bk);
    SKV_REGION(part_acc, float, bq * it.n_items * D);
    SKV_REGION(part_ml, float2, bq * it.n_items);
    SKV_REGION(step_bad, int32_t, 1);
    SKV_REGION(cnt_done, unsigned, 1);
    SKV_REGION(first_bad, unsigned long long, 1);
    SKV_REGION(vc_counts, unsigned long long, 2);
    SKV_REGION(mcount, int32_t, bk);
    SKV_REGION(io, skv_cuda_io, 1);
    if (host) {
        SKV_REGION(vsrc, int32_t, bk * S);
        SKV_REGION(mlist, int32_t, bk * S);
        SKV_REGION(pbuf, float, bq * S * c);
    }
    if (canon_tmax > 0) /* the reproducible mode: the attention's scores and weights (W's fixed point is per slot) */
        SKV_REGION(canon_e, float, bq * (size_t)canon_tmax);
    if (mass) /* SKV_SELECT_MASS: the candidates' masses for the split selection's A */
        SKV_REGION(mkey, float, bk * cand_max);
    if (W > 0) { /* the rescoring (docs/DESIGN.md 4.5.1) */
        SKV_REGION(cand_idx, int32_t, bk * W);
        SKV_REGION(cand_ids, int32_t, bk * W);
        SKV_REGION(cand_cnt, int32_t, bk);
        SKV_REGION(cand_k, skv_bf16, bk * W * (size_t)c * D);
        SKV_REGION(cand_s, float, bq * W * (size_t)c);
        SKV_REGION(cand_b, float, bk * W);
    }
#undef SKV_REGION
    if (base) {
        ws->pool_cap = pool_cap;
        ws->it = it;
        if (!host) ws->vsrc = ws->mlist = NULL, ws->pbuf = NULL;
        ws->canon_tmax = canon_tmax;
        if (canon_tmax <= 0) ws->canon_e = NULL;
        if (!mass) ws->mkey = NULL;
        if (W <= 0) ws->cand_idx = ws->cand_ids = ws->cand_cnt = NULL, ws->cand_k = NULL, ws->cand_s = ws->cand_b = NULL;
        ws->lstats = NULL;
    }
    return off;
}

/* Zeroes the counters of a carved workspace and sets first_bad to none (on stream st). */
cudaError_t skv_cuda_dws_clear(const skv_cuda_dws *ws, cudaStream_t st)
{
    /* macc .. cnt_sel are the regions from macc to pool; step_bad .. vc_counts from step_bad to mcount */
    cudaError_t e = cudaMemsetAsync(ws->macc, 0, (size_t)((char *)ws->pool - (char *)ws->macc), st);
    if (e == cudaSuccess) e = cudaMemsetAsync(ws->step_bad, 0, (size_t)((char *)ws->mcount - (char *)ws->step_bad), st);
    if (e == cudaSuccess) e = cudaMemsetAsync(ws->first_bad, 0xff, sizeof *ws->first_bad, st);
    return e;
}

skv_cuda_shape skv_cuda_shape_of(const skv_config *cfg, const skv_layout *lay)
{
    skv_cuda_shape sh;
    memset(&sh, 0, sizeof sh);
    sh.B = cfg->batch_size, sh.Hq = cfg->n_q_heads, sh.Hk = cfg->n_kv_heads, sh.D = cfg->head_dim;
    sh.c = cfg->chunk_size, sh.S = lay->S, sh.r = cfg->rank, sh.O = cfg->n_outlier_chunks;
    sh.gen_cap = cfg->gen_capacity, sh.cand_max = lay->cand_max, sh.vc_chunks = lay->vc_chunks;
    sh.rotary_dim = skv_rotary_dim(&cfg->rope, cfg->head_dim), sh.interleaved = cfg->rope.interleaved;
    sh.scale = skv_resolve_scale(cfg->attn_scale, cfg->head_dim);
    /* the count of each head (docs/DESIGN.md 4.5): cap = min(S, n_cand) by the configured mode, as lib/
       runs it for ref and cpu (SKV_BUDGET_ALL: S = cand_max, so cap = n_cand; the fixed mode then takes
       every candidate, the mass mode its rule up to them) */
    sh.sel_mode = (int32_t)cfg->select_mode;
    sh.sel_cap = lay->S;
    sh.sel_min = cfg->select_min_chunks;
    sh.sel_mass = cfg->select_mass;
    sh.W = lay->W; /* the rescoring's candidates (docs/DESIGN.md 4.5.1): min(select_candidates, cand_max) */
    sh.value_dtype = lay->value_dtype;
    sh.vrec = (int64_t)lay->vrec;
    return sh;
}

/* A dense layer's shape: no outliers, no selected span, no factors (its prompt is the local window). */
skv_cuda_shape skv_cuda_dense_shape(const skv_cuda_shape *sh)
{
    skv_cuda_shape d = *sh;
    d.S = 0, d.O = 0, d.r = 0, d.cand_max = 1, d.vc_chunks = 0;
    d.sel_mode = SKV_SELECT_FIXED, d.sel_cap = 0, d.sel_min = 0, d.W = 0;
    return d;
}

/* Most resident tokens of a dense layer's step: its prompt, the generated tokens and the new one. */
int64_t skv_cuda_dense_resident(const skv_config *c) { return c->max_prompt_len + c->gen_capacity; }

skv_cuda_items skv_cuda_items_of(const skv_config *c, const skv_layout *lay)
{
    skv_cuda_shape sh = skv_cuda_shape_of(c, lay);
    return skv_cuda_decode_items(&sh, skv_plan_max_resident(c->n_outlier_chunks, c->chunk_size, lay->local_max,
                                                            c->gen_capacity));
}

/* Items of a dense layer's step (split over its prompt like any resident span). */
skv_cuda_items skv_cuda_dense_items_of(const skv_config *c, const skv_layout *lay)
{
    skv_cuda_shape sh = skv_cuda_shape_of(c, lay);
    skv_cuda_shape d = skv_cuda_dense_shape(&sh);
    return skv_cuda_decode_items(&d, skv_cuda_dense_resident(c));
}

/* The items the workspace is carved for: the most of a sparse and (with dense layers) a dense step. */
skv_cuda_items skv_cuda_ws_items_of(const skv_config *c, const skv_layout *lay)
{
    skv_cuda_items it = skv_cuda_items_of(c, lay);
    if (lay->n_dense_layers > 0) {
        const skv_cuda_items d = skv_cuda_dense_items_of(c, lay);
        if (d.n_items > it.n_items) it.n_items = d.n_items;
    }
    return it;
}

/* Row length of the canonical attention's weights: the most tokens a query head attends to in a
   step of the reproducible mode (a dense layer's: its prompt, generated and new tokens); 0 (no such
   regions) in the default mode. */
int64_t skv_cuda_canon_tmax(const skv_config *c, const skv_layout *lay)
{
    if (!c->reproducible) return 0;
    int64_t t = skv_plan_max_tokens(c->n_outlier_chunks, c->chunk_size, lay->S, lay->local_max, c->gen_capacity);
    if (lay->n_dense_layers > 0 && skv_cuda_dense_resident(c) > t) t = skv_cuda_dense_resident(c);
    return t;
}
