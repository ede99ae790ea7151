/*
 * Serving (docs/DESIGN.md 12): sequences released and reused, prompts that arrive in pieces, and
 * whether a sequence's prefill is done. Decode of a list of sequences is in skv_decode.c, the pools
 * in skv_pool.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skv_cache_impl.h"

/* Returns the staging of (layer, seq), if any. */
static void skv_staging_drop(skv_cache *c, size_t i)
{
    skv_staging *sg = &c->staging[i];
    if (!sg->n_total) return;
    if (c->lay.pooled)
        skv_pool_free(&c->dev_pool, &sg->run);
    else
        c->ops->mem_free(sg->buf, SKV_MEM_DEVICE);
    c->staging_bytes -= sg->bytes;
    memset(sg, 0, sizeof *sg);
}

static skv_status skv_seq_release_body(skv_cache *c, int32_t seq)
{
    static const char fn[] = "skv_seq_release";
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: cache is NULL", fn);
    skv_status st = skv_check_index(c, fn, 0, seq);
    if (st) return st;
    int in_use = 0;
    for (int32_t l = 0; l < c->cfg.n_layers; l++)
        in_use |= c->slots[SLOT_INDEX(c, l, seq)].prefilled || c->staging[SLOT_INDEX(c, l, seq)].n_total;
    if (!in_use)
        return skv_fail(c->err, SKV_ERR_SEQ_STATE,
                        "%s: sequence %d is free already (no layer prefilled, no prompt arriving in pieces)", fn, seq);
    /* the host's view first, when device-list steps ran since the last sync */
    if (c->list_steps && (st = skv_cache_sync(c))) return st;
    if (c->ops->cache_release && (st = c->ops->cache_release(c->bctx, seq, c->err, sizeof c->err)))
        return skv_fail(c->err, st, "%s: %s", fn, skv_cache_last_error(c));
    for (int32_t l = 0; l < c->cfg.n_layers; l++) {
        const size_t i = SLOT_INDEX(c, l, seq);
        skv_staging_drop(c, i);
        skv_pool_give(c, l, seq);
        const int32_t dense = c->slots[i].dense;
        memset(&c->slots[i], 0, sizeof c->slots[i]);
        c->slots[i].dense = dense;
    }
    return SKV_OK;
}

SKV_API skv_status skv_seq_release(skv_cache *c, int32_t seq)
{
    SKV_ON_DEVICE(c, skv_seq_release_body(c, seq));
}

static skv_status skv_seq_ready_body(skv_cache *c, int32_t seq, int32_t *ready)
{
    static const char fn[] = "skv_seq_ready";
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: cache is NULL", fn);
    if (!ready) return skv_fail(c->err, SKV_ERR_NULL_POINTER, "%s: ready is NULL", fn);
    skv_status st = skv_check_index(c, fn, 0, seq);
    if (st) return st;
    *ready = 0;
    for (int32_t l = 0; l < c->cfg.n_layers; l++)
        if (!c->slots[SLOT_INDEX(c, l, seq)].prefilled) return SKV_OK;
    for (int32_t l = 0; l < c->cfg.n_layers && c->ops->cache_seq_ready; l++) {
        int32_t r = 0;
        if ((st = c->ops->cache_seq_ready(c->bctx, l, seq, &r, c->err, sizeof c->err)))
            return skv_fail(c->err, st, "%s: %s", fn, skv_cache_last_error(c));
        if (!r) return SKV_OK;
    }
    *ready = 1;
    return SKV_OK;
}

SKV_API skv_status skv_seq_ready(skv_cache *c, int32_t seq, int32_t *ready)
{
    SKV_ON_DEVICE(c, skv_seq_ready_body(c, seq, ready));
}

/* A piece into its staging, after the work on the cache's stream (its pages may have been a released
   sequence's; cuda), or at once. */
static skv_status skv_staging_copy(skv_cache *c, char *dst, const skv_bf16 *src, size_t bytes)
{
    if (c->ops->cache_copy) return c->ops->cache_copy(c->bctx, dst, src, bytes, c->err, sizeof c->err);
    return c->ops->copy2d(dst, 0, src, 0, bytes, 1);
}

/* The first piece of a prompt: its staging (nothing changes on an error). */
static skv_status skv_staging_open(skv_cache *c, const char *fn, int32_t layer, int32_t seq, int64_t n_total,
                                   int has_kpost)
{
    skv_staging *sg = &c->staging[SLOT_INDEX(c, layer, seq)];
    const size_t tensor = (size_t)n_total * c->cfg.n_kv_heads * c->cfg.head_dim * B2;
    const size_t bytes = tensor * (has_kpost ? 3u : 2u);
    skv_staging s = {n_total, 0, has_kpost, {0, 0}, NULL, bytes};
    if (c->lay.pooled) {
        s.run = skv_pool_alloc(&c->dev_pool, skv_pool_pages(c, bytes));
        if (s.run.start < 0) {
            char what[112];
            snprintf(what, sizeof what, "the staging of a prompt of %lld tokens (layer %d, sequence %d)",
                     (long long)n_total, layer, seq);
            return skv_pool_refuse(c, fn, 1, bytes, what);
        }
        s.buf = c->dev_pool.base + (size_t)s.run.start * c->lay.page_bytes;
        s.bytes = (size_t)s.run.count * c->lay.page_bytes;
    } else if (!(s.buf = c->ops->mem_alloc(bytes, SKV_MEM_DEVICE))) {
        return skv_fail(c->err, SKV_ERR_OUT_OF_MEMORY,
                        "%s: out of memory for the staging of a prompt of %lld tokens (%zu bytes; layer %d, sequence "
                        "%d)",
                        fn, (long long)n_total, bytes, layer, seq);
    }
    *sg = s;
    c->staging_bytes += s.bytes;
    return SKV_OK;
}

static skv_status skv_piece_run(skv_cache *c, int32_t layer, int32_t seq, int64_t n_total, int64_t pos0, int64_t n,
                                const skv_bf16 *k_pre, const skv_bf16 *v, const skv_bf16 *k_post)
{
    static const char fn[] = "skv_prefill_piece";
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: cache is NULL", fn);
    skv_status st = skv_check_index(c, fn, layer, seq);
    if (st) return st;
    if (n > 0 && (!k_pre || !v))
        return skv_fail(c->err, SKV_ERR_NULL_POINTER, "%s: %s is NULL", fn, !k_pre ? "k_pre" : "v");
    const size_t i = SLOT_INDEX(c, layer, seq);
    skv_staging *sg = &c->staging[i];
    if (c->slots[i].prefilled)
        return skv_fail(c->err, SKV_ERR_ALREADY_PREFILLED, "%s: layer %d of sequence %d is already prefilled", fn,
                        layer, seq);
    if (sg->n_total) {
        if (n_total != sg->n_total || pos0 != sg->received || (k_post != NULL) != sg->has_kpost)
            return skv_fail(c->err, SKV_ERR_SEQ_STATE,
                            "%s: layer %d of sequence %d: a piece with n_total = %lld, pos0 = %lld%s, but the prompt "
                            "has n_total = %lld and %lld tokens arrived%s (pieces arrive in order; all or none give "
                            "k_post)",
                            fn, layer, seq, (long long)n_total, (long long)pos0, k_post ? ", k_post" : ", no k_post",
                            (long long)sg->n_total, (long long)sg->received, sg->has_kpost ? " with k_post" : "");
    } else if (pos0 != 0) {
        return skv_fail(c->err, SKV_ERR_SEQ_STATE,
                        "%s: layer %d of sequence %d: a piece at pos0 = %lld, but no piece of this prompt has arrived "
                        "(the first piece has pos0 = 0)",
                        fn, layer, seq, (long long)pos0);
    } else if ((st = skv_prompt_check(c, fn, layer, n_total))) {
        return st;
    }
    if (n < 0 || n > n_total - pos0)
        return skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT,
                        "%s: n = %lld: a piece at pos0 = %lld of a prompt of n_total = %lld tokens holds 0 .. %lld", fn,
                        (long long)n, (long long)pos0, (long long)n_total, (long long)(n_total - pos0));
    const int32_t Hk = c->cfg.n_kv_heads;
    if (!c->ops->cache_prefill) { /* ref, cpu: the values now (cuda checks the whole prompt on the device) */
        if ((st = skv_check_tensor(c, fn, "k_pre", k_pre, n, Hk))) return st;
        if ((st = skv_check_tensor(c, fn, "v", v, n, Hk))) return st;
        if (k_post && (st = skv_check_tensor(c, fn, "k_post", k_post, n, Hk))) return st;
    }
    const int opened = !sg->n_total;
    if (opened && (st = skv_staging_open(c, fn, layer, seq, n_total, k_post != NULL))) return st;
    const size_t tensor = (size_t)n_total * Hk * c->cfg.head_dim * B2, row = (size_t)Hk * c->cfg.head_dim * B2;
    const size_t off = (size_t)pos0 * row, bytes = (size_t)n * row;
    if (bytes) {
        st = skv_staging_copy(c, sg->buf + off, k_pre, bytes);
        if (!st) st = skv_staging_copy(c, sg->buf + tensor + off, v, bytes);
        if (!st && k_post) st = skv_staging_copy(c, sg->buf + 2 * tensor + off, k_post, bytes);
        if (st) {
            if (opened) skv_staging_drop(c, i);
            return skv_slot_failed(c, fn, "staging copy", st);
        }
    }
    sg->received = pos0 + n;
    if (sg->received < n_total) return SKV_OK;
    /* the last piece: the prefill of the whole prompt, then the staging goes */
    st = skv_prefill_run(c, fn, layer, seq, n_total, (const skv_bf16 *)sg->buf, (const skv_bf16 *)(sg->buf + tensor),
                         sg->has_kpost ? (const skv_bf16 *)(sg->buf + 2 * tensor) : NULL);
    if (st) {
        sg->received = pos0; /* the piece may be sent again */
        if (opened) skv_staging_drop(c, i);
        return st;
    }
    skv_staging_drop(c, i);
    return SKV_OK;
}

static skv_status skv_prefill_piece_body(skv_cache *c, int32_t layer, int32_t seq, int64_t n_total, int64_t pos0,
                                         int64_t n, const skv_bf16 *k_pre, const skv_bf16 *v, const skv_bf16 *k_post)
{
    if (c && c->ops->set_threads) c->ops->set_threads(c->cfg.n_threads);
    skv_status st = skv_piece_run(c, layer, seq, n_total, pos0, n, k_pre, v, k_post);
    if (c && c->ops->set_threads) c->ops->set_threads(0);
    return st;
}

SKV_API skv_status skv_prefill_piece(skv_cache *c, int32_t layer, int32_t seq, int64_t n_total, int64_t pos0,
                                     int64_t n, const skv_bf16 *k_pre, const skv_bf16 *v, const skv_bf16 *k_post)
{
    SKV_ON_DEVICE(c, skv_prefill_piece_body(c, layer, seq, n_total, pos0, n, k_pre, v, k_post));
}
