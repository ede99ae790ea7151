/*
 * Decode steps (docs/DESIGN.md 4, 12.1): skv_decode (every sequence), skv_decode_active (a host
 * list) and skv_decode_active_device (a device list, cuda). A step checks everything before it
 * changes anything, runs each listed sequence's step exactly as it runs alone (so its outputs and
 * selections do not depend on the others listed), and publishes last.
 */
#include <stdlib.h>
#include <string.h>

#include "skv_cache_impl.h"
#include "skv_numerics.h"
#include "skv_plan.h"

/* ---- decode ---------------------------------------------------------------------------- */

/*
 * The chunk cache of host-placed sparse slot j after a good step with selection sel [Hk, S]
 * (candidate indices; head h's first cnt[h]): hits and misses by the rule of skv_vcache_step.
 * ref and cpu read every value from the store (both sides are host memory), so only the index
 * is kept; the cuda backend runs the same rule on the device.
 */
static void skv_vcache_account(skv_cache *c, size_t j, const int32_t *sel, const int32_t *cnt, int32_t step)
{
    char *vc = skv_value_cache(c, j);
    if (!vc) return;
    const int32_t Hk = c->cfg.n_kv_heads, S = c->lay.S, E = c->lay.vc_chunks, cm = c->lay.cand_max;
    int32_t *entry = c->vc_scratch + 3 * (size_t)E, *miss = entry + S;
    for (int32_t h = 0; h < Hk; h++) {
        int32_t hits = skv_vcache_step((int32_t *)(vc + c->lay.vc_slot_of) + (size_t)h * cm,
                                       (int32_t *)(vc + c->lay.vc_owner) + (size_t)h * E,
                                       (int32_t *)(vc + c->lay.vc_stamp) + (size_t)h * E, E, sel + (size_t)h * S,
                                       cnt[h], step, entry, miss, c->vc_scratch);
        c->stats.value_cache_hits += hits;
        c->stats.value_cache_misses += cnt[h] - hits;
    }
}

/* Adds one step of (layer, sequence sl) to the layer's counters (cnt: each head's k; NULL dense). */
static void skv_count_step(skv_cache *c, int32_t layer, const skv_slot *sl, const int32_t *cnt)
{
    skv_layer_stats *ls = &c->layer_stats[layer];
    const int32_t Hk = c->cfg.n_kv_heads, cs = c->cfg.chunk_size;
    const int64_t ctx = sl->n + sl->n_gen + 1;
    for (int32_t h = 0; h < Hk; h++) {
        const int64_t k = cnt ? cnt[h] : 0;
        ls->head_steps++;
        ls->context_tokens += ctx;
        ls->selected_chunks += k;
        ls->attended_tokens += cnt ? skv_plan_resident_tokens(c->cfg.n_outlier_chunks, cs, sl->n_local, sl->n_gen) + k * cs
                                   : ctx;
    }
}

/* The spans of a step of (layer, b) into spans[] (its new token: row `row` of k, v); head_tokens of the step
   into *ht (NULL: the spans' own). */
static void skv_step_spans(skv_cache *c, int32_t layer, int32_t b, int32_t row, const skv_bf16 *k, const skv_bf16 *v,
                           const int32_t *cnt, int32_t cap, skv_kv_span spans[SKV_N_SPANS], const int64_t **ht)
{
    const skv_config *g = &c->cfg;
    const skv_slot *sl = &c->slots[SLOT_INDEX(c, layer, b)];
    const int32_t Hk = g->n_kv_heads, D = g->head_dim, cs = g->chunk_size;
    const int dense = sl->dense;
    skv_span_shape sh[SKV_N_SPANS];
    skv_plan_spans(dense ? 0 : g->n_outlier_chunks, cs, dense ? 0 : c->lay.S, D, sl->n_local, sl->n_gen,
                   g->gen_capacity, sh);
    if (!dense) sh[SKV_SPAN_SELECTED].n_tokens = (int64_t)cap * cs; /* the stride stays S * c */
    const skv_bf16 *sk[SKV_N_SPANS] = {NULL, NULL, SHARED(c, ws_k, skv_bf16), NULL, k + (size_t)row * Hk * D};
    const skv_bf16 *sv[SKV_N_SPANS] = {NULL, NULL, SHARED(c, ws_v, skv_bf16), NULL, v + (size_t)row * Hk * D};
    if (dense) {
        sk[SKV_SPAN_LOCAL] = (const skv_bf16 *)MEM(c, layer, b)->dn_k;
        sv[SKV_SPAN_LOCAL] = (const skv_bf16 *)MEM(c, layer, b)->dn_v;
        sk[SKV_SPAN_GENERATED] = DEV(c, layer, b, dn_gen_k, skv_bf16);
        sv[SKV_SPAN_GENERATED] = DEV(c, layer, b, dn_gen_v, skv_bf16);
    } else {
        sk[SKV_SPAN_OUTLIERS] = DEV(c, layer, b, out_k, skv_bf16), sv[SKV_SPAN_OUTLIERS] = DEV(c, layer, b, out_v, skv_bf16);
        sk[SKV_SPAN_LOCAL] = DEV(c, layer, b, loc_k, skv_bf16), sv[SKV_SPAN_LOCAL] = DEV(c, layer, b, loc_v, skv_bf16);
        sk[SKV_SPAN_GENERATED] = DEV(c, layer, b, gen_k, skv_bf16);
        sv[SKV_SPAN_GENERATED] = DEV(c, layer, b, gen_v, skv_bf16);
    }
    for (int i = 0; i < SKV_N_SPANS; i++) {
        spans[i].k = sk[i], spans[i].v = sv[i];
        spans[i].n_tokens = sh[i].n_tokens, spans[i].head_stride = sh[i].head_stride, spans[i].token_stride = D;
    }
    *ht = NULL;
    if (dense || (g->select_mode != SKV_SELECT_MASS && !c->lay.W)) return;
    /* the mass mode, or the rescoring (whose count is at most W < cap in either mode, 4.5.1): head h's
       selected span has cnt[h] chunks (the rows past them hold nothing of this step) */
    for (int i = 0; i < SKV_N_SPANS; i++)
        for (int32_t h = 0; h < Hk; h++)
            c->head_tokens[(size_t)i * Hk + h] = i == SKV_SPAN_SELECTED ? (int64_t)cnt[h] * cs : spans[i].n_tokens;
    *ht = c->head_tokens;
}

/*
 * The selection of sequence b's step with rescoring (docs/DESIGN.md 4.5.1), on backends that
 * run the op slots (host memory): the first stage's W best candidates per head (score_select
 * in the fixed mode with cap W), their canonical keys (rebuild_keys_canonical), then
 * skv_rescore_head per head into the step's sel_idx / sel_ids / counts. A failing slot's
 * message is set here.
 */
static skv_status skv_rescore_step(skv_cache *c, int32_t layer, int32_t b, float scale, const skv_bf16 *qb,
                                   const skv_select_params *sp0)
{
    static const char fn[] = "skv_decode";
    const skv_config *g = &c->cfg;
    const struct skv_backend_ops *ops = c->ops;
    const skv_slot *sl = &c->slots[SLOT_INDEX(c, layer, b)];
    const int32_t Hq = g->n_q_heads, Hk = g->n_kv_heads, D = g->head_dim, cs = g->chunk_size, G = Hq / Hk;
    const int32_t S = c->lay.S, Wst = c->lay.W, W = Wst < sl->n_cand ? Wst : sl->n_cand;
    int32_t *sidx = SHARED(c, ws_sel_idx, int32_t) + (size_t)b * Hk * S;
    int32_t *sids = SHARED(c, ws_sel_ids, int32_t) + (size_t)b * Hk * S;
    int32_t *cnt = SHARED(c, ws_sel_cnt, int32_t) + (size_t)b * Hk;
    int32_t *cidx = SHARED(c, ws_cand_idx, int32_t) + (size_t)b * Hk * Wst;
    int32_t *cids = SHARED(c, ws_cand_ids, int32_t) + (size_t)b * Hk * Wst;
    skv_bf16 *ck = SHARED(c, ws_cand_k, skv_bf16);
    const int32_t *cand_ids = (const int32_t *)MEM(c, layer, b)->cand_ids;
    /* stage 1: the W best by landmark, in increasing candidate index */
    skv_select_params s1 = {SKV_SELECT_FIXED, W, Wst, 0, 0.0f};
    skv_status st = ops->score_select(Hq, Hk, D, sl->n_cand, &s1, scale, qb,
                                      (const skv_bf16 *)MEM(c, layer, b)->landmarks, cand_ids, cidx, cids, NULL, NULL, &c->ws);
    c->stats.decode_allocations += skv_ws_reset(&c->ws);
    if (st) return skv_slot_failed(c, fn, "score_select", st);
    /* their canonical keys, [Hk, Wst c, D] */
    for (int32_t h = 0; h < Hk; h++) cnt[h] = W;
    st = ops->rebuild_keys_canonical(&g->rope, D, Hk, skv_cfg_rank(g), cs, Wst, sl->n, (const skv_bf16 *)MEM(c, layer, b)->u,
                                     DEV(c, layer, b, w, skv_bf16), cids, cnt, SHARED(c, rope_cos, float),
                                     SHARED(c, rope_sin, float), ck, &c->ws);
    c->stats.decode_allocations += skv_ws_reset(&c->ws);
    if (st) return skv_slot_failed(c, fn, "rebuild_keys_canonical", st);
    /* stage 2: the rule among them */
    skv_select_params sp = *sp0;
    if (sp.cap > W) sp.cap = W;
    if (sp.floor > sp.cap) sp.floor = sp.cap;
    float *sc = skv_ws_alloc(&c->ws, sizeof(float) * (size_t)W * cs);
    float *bm = skv_ws_alloc(&c->ws, sizeof(float) * (size_t)W);
    int32_t *scratch = skv_ws_alloc(&c->ws, sizeof(int32_t) * (size_t)2 * W);
    int32_t *local = skv_ws_alloc(&c->ws, sizeof(int32_t) * (size_t)S);
    if (!sc || !bm || !scratch || !local)
        return skv_fail(c->err, SKV_ERR_OUT_OF_MEMORY, "%s: out of memory for the rescoring's scratch", fn);
    for (int32_t h = 0; h < Hk; h++)
        cnt[h] = skv_rescore_head(G, D, cs, W, scale, qb + (size_t)h * G * D, ck + (size_t)h * Wst * cs * D, &sp,
                                  cidx + (size_t)h * Wst, cand_ids + (size_t)h * sl->n_cand, sc, bm, scratch, local,
                                  sidx + (size_t)h * S, sids + (size_t)h * S);
    return SKV_OK;
}

/* The checks of a host-list step (nothing changes on an error): the list, and every listed
   sequence prefilled, below capacity and in step. */
static skv_status skv_check_list(skv_cache *c, const char *fn, int32_t layer, int32_t n_act, const int32_t *seqs)
{
    const skv_config *g = &c->cfg;
    const int32_t B = g->batch_size, cap = g->gen_capacity;
    if (n_act < 0 || n_act > B)
        return skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT, "%s: n_active = %d, must be in [0, batch_size = %d]", fn,
                        n_act, B);
    if (n_act && !seqs) return skv_fail(c->err, SKV_ERR_NULL_POINTER, "%s: seqs is NULL", fn);
    skv_status st = SKV_OK;
    int32_t i = 0;
    for (; i < n_act && !st; i++) {
        const int32_t b = seqs[i];
        if (b < 0 || b >= B)
            st = skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT, "%s: seqs[%d] = %d, must be in [0, batch_size = %d)", fn,
                          i, b, B);
        else if (c->mark[b])
            st = skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT, "%s: seqs[%d] = %d is listed twice", fn, i, b);
        else
            c->mark[b] = 1;
    }
    for (int32_t j = 0; j < i; j++)
        if (seqs[j] >= 0 && seqs[j] < B) c->mark[seqs[j]] = 0;
    for (i = 0; i < n_act && !st; i++) {
        const int32_t b = seqs[i];
        const skv_slot *mine = &c->slots[SLOT_INDEX(c, layer, b)];
        for (int32_t l = 0; l < g->n_layers && !st; l++) {
            const skv_slot *o = &c->slots[SLOT_INDEX(c, l, b)];
            if (!o->prefilled)
                st = skv_fail(c->err, SKV_ERR_NOT_PREFILLED,
                              "%s: layer %d of sequence %d is not prefilled (every layer of a sequence must be "
                              "prefilled before its decode%s)",
                              fn, l, b, c->staging[SLOT_INDEX(c, l, b)].n_total ? "; its prompt is still arriving in pieces" : "");
            else if (o->n_gen < mine->n_gen)
                st = skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT,
                              "%s: layer = %d is a step ahead for sequence %d: it has taken %d decode steps and layer "
                              "%d only %d; every layer takes a token's step before any layer takes the next one",
                              fn, layer, b, mine->n_gen, l, o->n_gen);
        }
        if (!st && mine->n_gen >= cap)
            st = skv_fail(c->err, SKV_ERR_CAPACITY,
                          "%s: sequence %d, layer %d already holds gen_capacity = %d generated tokens", fn, b, layer,
                          cap);
    }
    return st;
}

/* One step of layer for the sequences seqs[0..n_act) (host list), row i of q, k, v, out for seqs[i]. */
static skv_status skv_decode_run(skv_cache *c, const char *fn, int32_t layer, int32_t n_act, const int32_t *seqs,
                                 const skv_bf16 *q, const skv_bf16 *k, const skv_bf16 *v, float *out)
{
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: cache is NULL", fn);
    if (n_act > 0 && (!q || !k || !v || !out))
        return skv_fail(c->err, SKV_ERR_NULL_POINTER, "%s: %s is NULL", fn,
                        !q ? "q" : !k ? "k" : !v ? "v" : "out");
    skv_status st = skv_check_index(c, fn, layer, 0);
    if (st) return st;
    /* after device-list steps the host's view of n_gen is refreshed first */
    if (c->list_steps && (st = skv_cache_sync(c))) return st;
    if ((st = skv_check_list(c, fn, layer, n_act, seqs))) return st;
    if (!n_act) return SKV_OK;
    const skv_config *g = &c->cfg;
    const struct skv_backend_ops *ops = c->ops;
    const int32_t Hq = g->n_q_heads, Hk = g->n_kv_heads, D = g->head_dim;
    const int32_t cs = g->chunk_size, S = c->lay.S, cap = g->gen_capacity;
    if (ops->cache_decode) {
        /* NaN/Inf in q, k, v is found on the device and reported by skv_cache_sync */
        st = ops->cache_decode(c->bctx, layer, n_act, seqs, NULL, NULL, q, k, v, out, c->err, sizeof c->err);
        if (st) return skv_fail(c->err, st, "%s: %s", fn, skv_cache_last_error(c));
        for (int32_t i = 0; i < n_act; i++) {
            skv_slot *sl = &c->slots[SLOT_INDEX(c, layer, seqs[i])];
            sl->n_gen++;
            sl->has_selection = 1;
        }
        c->stats.n_decode_calls++;
        return SKV_OK;
    }
    const double t_call = skv_now_ms();
    if ((st = skv_check_tensor(c, fn, "q", q, n_act, Hq))) return st;
    if ((st = skv_check_tensor(c, fn, "k", k, n_act, Hk))) return st;
    if ((st = skv_check_tensor(c, fn, "v", v, n_act, Hk))) return st;

    const float scale = skv_resolve_scale(g->attn_scale, D);
    const float *cos_t = SHARED(c, rope_cos, float), *sin_t = SHARED(c, rope_sin, float);
    skv_bf16 *ks = SHARED(c, ws_k, skv_bf16), *vsel = SHARED(c, ws_v, skv_bf16);
    double t_sel = 0, t_reb = 0, t_fet = 0, t_att = 0, t;
    for (int32_t i = 0; i < n_act; i++) {
        const int32_t b = seqs[i];
        const skv_slot *sl = &c->slots[SLOT_INDEX(c, layer, b)];
        int32_t *sidx = SHARED(c, ws_sel_idx, int32_t) + (size_t)b * Hk * S;
        int32_t *sids = SHARED(c, ws_sel_ids, int32_t) + (size_t)b * Hk * S;
        int32_t *cnt = SHARED(c, ws_sel_cnt, int32_t) + (size_t)b * Hk;
        const skv_bf16 *qb = q + (size_t)i * Hq * D;
        skv_select_params sp = {g->select_mode, sl->n_cand < S ? sl->n_cand : S, S, 0, g->select_mass};
        sp.floor = g->select_min_chunks < sp.cap ? g->select_min_chunks : sp.cap;
        if (!sl->dense) {
            t = skv_now_ms();
            if (c->lay.W)
                st = skv_rescore_step(c, layer, b, scale, qb, &sp);
            else
                st = ops->score_select(Hq, Hk, D, sl->n_cand, &sp, scale, qb,
                                       (const skv_bf16 *)MEM(c, layer, b)->landmarks,
                                       (const int32_t *)MEM(c, layer, b)->cand_ids, sidx, sids, NULL, cnt, &c->ws);
            c->stats.decode_allocations += skv_ws_reset(&c->ws);
            if (st) return st;
            t_sel += skv_now_ms() - t;
            t = skv_now_ms();
            st = (g->reproducible ? ops->rebuild_keys_canonical : ops->rebuild_keys)(
                &g->rope, D, Hk, skv_cfg_rank(g), cs, S, sl->n, (const skv_bf16 *)MEM(c, layer, b)->u, DEV(c, layer, b, w, skv_bf16),
                sids, cnt, cos_t, sin_t, ks, &c->ws);
            c->stats.decode_allocations += skv_ws_reset(&c->ws);
            if (st) return skv_slot_failed(c, fn, "rebuild_keys", st);
            t_reb += skv_now_ms() - t;
            t = skv_now_ms();
            st = ops->gather_values(Hk, D, cs, sl->n_cand, S, c->lay.value_dtype, MEM(c, layer, b)->vstore, sidx, cnt,
                                   vsel);
            if (st) return skv_slot_failed(c, fn, "gather_values", st);
            t_fet += skv_now_ms() - t;
        }
        t = skv_now_ms();
        skv_kv_span spans[SKV_N_SPANS]; /* the new token is appended only when the whole step succeeded */
        const int64_t *ht;
        skv_step_spans(c, layer, b, i, k, v, cnt, sp.cap, spans, &ht);
        st = (g->reproducible ? ops->sparse_attention_canonical : ops->sparse_attention)(
            Hq, Hk, D, scale, qb, SKV_N_SPANS, spans, ht, out + (size_t)i * Hq * D, &c->ws);
        c->stats.decode_allocations += skv_ws_reset(&c->ws);
        if (st) return skv_slot_failed(c, fn, "sparse_attention", st);
        t_att += skv_now_ms() - t;
    }
    /* publish: append k, v and keep the selection */
    t = skv_now_ms();
    for (int32_t i = 0; i < n_act && !st; i++) {
        const int32_t b = seqs[i];
        skv_slot *sl = &c->slots[SLOT_INDEX(c, layer, b)];
        const int32_t *cnt = SHARED(c, ws_sel_cnt, int32_t) + (size_t)b * Hk;
        size_t row = (size_t)D * B2, hs = (size_t)cap * D * B2;
        skv_bf16 *gk = sl->dense ? DEV(c, layer, b, dn_gen_k, skv_bf16) : DEV(c, layer, b, gen_k, skv_bf16);
        skv_bf16 *gv = sl->dense ? DEV(c, layer, b, dn_gen_v, skv_bf16) : DEV(c, layer, b, gen_v, skv_bf16);
        st = ops->copy2d(gk + (size_t)sl->n_gen * D, hs, k + (size_t)i * Hk * D, row, row, (size_t)Hk);
        if (!st) st = ops->copy2d(gv + (size_t)sl->n_gen * D, hs, v + (size_t)i * Hk * D, row, row, (size_t)Hk);
        size_t sel_bytes = (size_t)Hk * S * sizeof(int32_t);
        if (!st && !sl->dense)
            st = ops->copy2d(DEV(c, layer, b, sel_idx, int32_t), 0,
                             SHARED(c, ws_sel_idx, int32_t) + (size_t)b * Hk * S, 0, sel_bytes, 1);
        if (!st && !sl->dense)
            st = ops->copy2d(DEV(c, layer, b, sel_ids, int32_t), 0,
                             SHARED(c, ws_sel_ids, int32_t) + (size_t)b * Hk * S, 0, sel_bytes, 1);
        if (!st && !sl->dense)
            st = ops->copy2d(DEV(c, layer, b, sel_cnt, int32_t), 0, cnt, 0, (size_t)Hk * sizeof(int32_t), 1);
        if (st) return skv_slot_failed(c, fn, "append copy", st);
        if (!sl->dense)
            skv_vcache_account(c, VSLOT(c, layer, b), SHARED(c, ws_sel_idx, int32_t) + (size_t)b * Hk * S, cnt,
                               sl->n_gen);
        skv_count_step(c, layer, sl, sl->dense ? NULL : cnt);
        sl->n_gen++;
        sl->has_selection = 1;
    }
    t_sel += skv_now_ms() - t;
    c->stats.decode_select_ms += t_sel;
    c->stats.decode_rebuild_ms += t_reb;
    c->stats.decode_fetch_ms += t_fet;
    c->stats.decode_attention_ms += t_att;
    c->stats.decode_step_ms += skv_now_ms() - t_call;
    c->stats.n_decode_calls++;
    return SKV_OK;
}

static skv_status skv_decode_body(skv_cache *c, int32_t layer, const skv_bf16 *q, const skv_bf16 *k,
                                  const skv_bf16 *v, float *out)
{
    if (c && c->ops->set_threads) c->ops->set_threads(c->cfg.n_threads);
    skv_status st = skv_decode_run(c, "skv_decode", layer, c ? c->cfg.batch_size : 0, c ? c->all_seqs : NULL, q, k, v,
                                   out);
    if (c && c->ops->set_threads) c->ops->set_threads(0);
    return st;
}

SKV_API skv_status skv_decode(skv_cache *c, int32_t layer, const skv_bf16 *q, const skv_bf16 *k,
                              const skv_bf16 *v, float *out)
{
    SKV_ON_DEVICE(c, skv_decode_body(c, layer, q, k, v, out));
}

static skv_status skv_decode_active_body(skv_cache *c, int32_t layer, int32_t n_active, const int32_t *seqs,
                                         const skv_bf16 *q, const skv_bf16 *k, const skv_bf16 *v, float *out)
{
    if (c && c->ops->set_threads) c->ops->set_threads(c->cfg.n_threads);
    skv_status st = skv_decode_run(c, "skv_decode_active", layer, n_active, seqs, q, k, v, out);
    if (c && c->ops->set_threads) c->ops->set_threads(0);
    return st;
}

SKV_API skv_status skv_decode_active(skv_cache *c, int32_t layer, int32_t n_active, const int32_t *seqs,
                                     const skv_bf16 *q, const skv_bf16 *k, const skv_bf16 *v, float *out)
{
    SKV_ON_DEVICE(c, skv_decode_active_body(c, layer, n_active, seqs, q, k, v, out));
}

static skv_status skv_decode_active_device_body(skv_cache *c, int32_t layer, const int32_t *n_active, const int32_t *seqs,
                                                const skv_bf16 *q, const skv_bf16 *k, const skv_bf16 *v, float *out)
{
    static const char fn[] = "skv_decode_active_device";
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: cache is NULL", fn);
    if (!n_active || !seqs || !q || !k || !v || !out)
        return skv_fail(c->err, SKV_ERR_NULL_POINTER, "%s: %s is NULL", fn,
                        !n_active ? "n_active" : !seqs ? "seqs" : !q ? "q" : !k ? "k" : !v ? "v" : "out");
    skv_status st = skv_check_index(c, fn, layer, 0);
    if (st) return st;
    if (!c->ops->cache_decode)
        return skv_fail(c->err, SKV_ERR_UNSUPPORTED,
                        "%s: backend %s runs its steps on the host: give the list in host memory (skv_decode_active)",
                        fn, c->ops->name);
    st = c->ops->cache_decode(c->bctx, layer, c->cfg.batch_size, NULL, n_active, seqs, q, k, v, out, c->err,
                              sizeof c->err);
    if (st) return skv_fail(c->err, st, "%s: %s", fn, skv_cache_last_error(c));
    c->list_steps++;
    c->stats.n_decode_calls++;
    return SKV_OK;
}

SKV_API skv_status skv_decode_active_device(skv_cache *c, int32_t layer, const int32_t *n_active, const int32_t *seqs,
                                            const skv_bf16 *q, const skv_bf16 *k, const skv_bf16 *v, float *out)
{
    SKV_ON_DEVICE(c, skv_decode_active_device_body(c, layer, n_active, seqs, q, k, v, out));
}
