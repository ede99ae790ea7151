/*
 * The memory that grows with a prompt (include/shadowkv.h "Memory pools", docs/DESIGN.md 12.2):
 * where each (layer, sequence) keeps its factor U, landmarks, candidate ids, value store (sparse)
 * or prompt keys and values (dense). Outside the pool mode these are the slot's own regions of the
 * fixed layout, set once at create. In the pool mode a prefill takes one run of contiguous pages
 * from the device pool (and one from the host pool for a host value store), lays the regions out
 * in it for its own n (skv_slot_regions_of; the run is the best fit among the free runs), and
 * release gives the pages back. The pools' page maps
 * are host memory; nothing is allocated after create.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skv_cache_impl.h"
#include "skv_numerics.h"

/* Offsets of a slot's growing regions in its runs for a prompt of n tokens (256-byte aligned),
   and the bytes each run needs. */
typedef struct skv_slot_regions {
    size_t u, landmarks, cand_ids, vstore, dn_k, dn_v; /* device run (vstore: host run when values_host) */
    size_t dev_bytes, host_bytes;
} skv_slot_regions;

static size_t skv_align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* n is a valid prompt of a layer of that kind (checked by the prefill), so nothing overflows:
   every product is below the fixed layout's, which was checked at create. */
static void skv_slot_regions_of(const skv_cache *c, int64_t n, int dense, skv_slot_regions *r)
{
    const skv_config *g = &c->cfg;
    const size_t HkD = (size_t)g->n_kv_heads * g->head_dim;
    memset(r, 0, sizeof *r);
    size_t cur = 0;
    if (dense) {
        r->dn_k = cur;
        cur = skv_align256(cur + (size_t)n * HkD * B2);
        r->dn_v = cur;
        cur = skv_align256(cur + (size_t)n * HkD * B2);
        r->dev_bytes = cur;
        return;
    }
    const int64_t N = n / g->chunk_size - g->n_local_chunks;
    const size_t n_cand = N > g->n_outlier_chunks ? (size_t)(N - g->n_outlier_chunks) : 0;
    const size_t store = n_cand * (size_t)g->n_kv_heads * c->lay.vrec;
    r->u = cur;
    cur = skv_align256(cur + (size_t)n * (size_t)skv_cfg_rank(g) * B2);
    r->landmarks = cur;
    cur = skv_align256(cur + n_cand * HkD * B2);
    r->cand_ids = cur;
    cur = skv_align256(cur + (size_t)g->n_kv_heads * n_cand * sizeof(int32_t));
    if (c->lay.values_host) {
        r->vstore = 0;
        r->host_bytes = skv_align256(store);
    } else {
        r->vstore = cur;
        cur = skv_align256(cur + store);
    }
    r->dev_bytes = cur;
}

int64_t skv_pool_pages(const skv_cache *c, size_t bytes)
{
    return (int64_t)((bytes + c->lay.page_bytes - 1) / c->lay.page_bytes);
}

/* Best fit: the smallest run of free pages that holds count (the lowest such run on a tie), so
   large runs stay whole for long prompts. */
skv_run skv_pool_alloc(skv_pool *p, int64_t count)
{
    skv_run r = {-1, 0};
    if (count <= 0) return (skv_run){0, 0};
    int64_t best = -1, best_len = 0;
    for (int64_t i = 0; i < p->n_pages;) {
        if (p->used[i]) {
            i++;
            continue;
        }
        int64_t j = i;
        while (j < p->n_pages && !p->used[j]) j++;
        if (j - i >= count && (best < 0 || j - i < best_len)) best = i, best_len = j - i;
        i = j;
    }
    if (best < 0) return r;
    r.start = best;
    r.count = count;
    memset(p->used + best, 1, (size_t)count);
    p->n_used += count;
    return r;
}

void skv_pool_free(skv_pool *p, skv_run *run)
{
    if (run->count > 0) {
        memset(p->used + run->start, 0, (size_t)run->count);
        p->n_used -= run->count;
    }
    run->start = run->count = 0;
}

int64_t skv_pool_largest_free(const skv_pool *p)
{
    int64_t best = 0;
    for (int64_t i = 0, run = 0; i < p->n_pages; i++) {
        run = p->used[i] ? 0 : run + 1;
        if (run > best) best = run;
    }
    return best;
}

skv_status skv_pool_refuse(skv_cache *c, const char *fn, int dev, size_t asked, const char *what)
{
    const skv_pool *p = dev ? &c->dev_pool : &c->host_pool;
    const size_t pb = c->lay.page_bytes, free_b = (size_t)(p->n_pages - p->n_used) * pb;
    const size_t largest = (size_t)skv_pool_largest_free(p) * pb;
    return skv_fail(c->err, SKV_ERR_OUT_OF_MEMORY,
                    "%s: the %s pool cannot hold %s: %zu bytes asked (%lld pages of %zu), %zu bytes free, largest "
                    "free run %zu bytes%s (skv_cache_usage; release finished sequences, or create the cache with a "
                    "larger pool_%s_bytes)",
                    fn, dev ? "device" : "host", what, asked, (long long)skv_pool_pages(c, asked), pb, free_b, largest,
                    free_b >= asked && largest < asked ? ": the free pages are scattered" : "",
                    dev ? "device" : "host");
}

/* The fixed layout's regions of (l, b) (not the pool mode). */
static void skv_mem_fixed(skv_cache *c, int32_t l, int32_t b)
{
    skv_slot_mem *m = MEM(c, l, b);
    char *sd = c->dev + skv_layout_slot_offset(&c->lay, l, b);
    memset(m, 0, sizeof *m);
    if (skv_layout_dense(&c->lay, l)) {
        m->dn_k = sd + c->lay.dn_k;
        m->dn_v = sd + c->lay.dn_v;
        return;
    }
    const size_t j = VSLOT(c, l, b);
    m->u = sd + c->lay.u;
    m->landmarks = sd + c->lay.landmarks;
    m->cand_ids = sd + c->lay.cand_ids;
    m->vstore = (char *)skv_value_store(c, j);
    m->vstore_host = (int64_t)j >= c->lay.n_dev_slots;
}

skv_status skv_pool_open(skv_cache *c)
{
    const skv_layout *lay = &c->lay;
    if (!lay->pooled) {
        for (int32_t l = 0; l < c->cfg.n_layers; l++)
            for (int32_t b = 0; b < c->cfg.batch_size; b++) skv_mem_fixed(c, l, b);
        return SKV_OK;
    }
    c->dev_pool.base = c->dev + lay->dev_pool;
    c->dev_pool.n_pages = lay->pool_dev_pages;
    c->dev_pool.used = calloc((size_t)lay->pool_dev_pages, 1);
    c->host_pool.base = c->host;
    c->host_pool.n_pages = lay->values_host ? lay->pool_host_pages : 0;
    c->host_pool.used = calloc((size_t)c->host_pool.n_pages + 1, 1);
    return c->dev_pool.used && c->host_pool.used ? SKV_OK : SKV_ERR_OUT_OF_MEMORY;
}

void skv_pool_close(skv_cache *c)
{
    const size_t n = (size_t)c->cfg.n_layers * (size_t)c->cfg.batch_size;
    for (size_t i = 0; i < n; i++)
        if (!c->lay.pooled && c->staging[i].buf) c->ops->mem_free(c->staging[i].buf, SKV_MEM_DEVICE);
    free(c->dev_pool.used);
    free(c->host_pool.used);
    c->dev_pool.used = c->host_pool.used = NULL;
}

skv_status skv_pool_take(skv_cache *c, const char *fn, int32_t layer, int32_t seq, int64_t n)
{
    if (!c->lay.pooled) return SKV_OK;
    const size_t i = SLOT_INDEX(c, layer, seq);
    skv_slot_regions r;
    skv_slot_regions_of(c, n, c->slots[i].dense, &r);
    char what[96];
    snprintf(what, sizeof what, "layer %d of sequence %d (n = %lld)", layer, seq, (long long)n);
    skv_run dr = skv_pool_alloc(&c->dev_pool, skv_pool_pages(c, r.dev_bytes));
    if (dr.start < 0) return skv_pool_refuse(c, fn, 1, r.dev_bytes, what);
    skv_run hr = skv_pool_alloc(&c->host_pool, skv_pool_pages(c, r.host_bytes));
    if (hr.start < 0) {
        skv_pool_free(&c->dev_pool, &dr);
        return skv_pool_refuse(c, fn, 0, r.host_bytes, what);
    }
    c->dev_runs[i] = dr;
    c->host_runs[i] = hr;
    char *d = c->dev_pool.base + (size_t)dr.start * c->lay.page_bytes;
    skv_slot_mem *m = &c->mem[i];
    memset(m, 0, sizeof *m);
    if (c->slots[i].dense) {
        m->dn_k = d + r.dn_k;
        m->dn_v = d + r.dn_v;
    } else {
        m->u = d + r.u;
        m->landmarks = d + r.landmarks;
        m->cand_ids = d + r.cand_ids;
        m->vstore_host = c->lay.values_host;
        m->vstore = c->lay.values_host ? c->host_pool.base + (size_t)hr.start * c->lay.page_bytes : d + r.vstore;
    }
    return SKV_OK;
}

void skv_pool_give(skv_cache *c, int32_t layer, int32_t seq)
{
    if (!c->lay.pooled) return;
    const size_t i = SLOT_INDEX(c, layer, seq);
    skv_pool_free(&c->dev_pool, &c->dev_runs[i]);
    skv_pool_free(&c->host_pool, &c->host_runs[i]);
    memset(&c->mem[i], 0, sizeof c->mem[i]);
}

SKV_API skv_status skv_seq_bytes(const skv_cache *c, int64_t n, size_t *device_bytes, size_t *host_bytes,
                                 size_t *staging_bytes)
{
    static const char fn[] = "skv_seq_bytes";
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: cache is NULL", fn);
    const skv_config *g = &c->cfg;
    const skv_layout *lay = &c->lay;
    if (n < 1 || n > g->max_prompt_len)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: n = %lld: must be in [1, max_prompt_len = %lld]", fn,
                        (long long)n, (long long)g->max_prompt_len);
    size_t dev = 0, host = 0, stage = (size_t)2 * (size_t)n * g->n_kv_heads * g->head_dim * B2;
    if (lay->pooled) {
        for (int32_t l = 0; l < g->n_layers; l++) {
            skv_slot_regions r;
            skv_slot_regions_of(c, n, skv_layout_dense(lay, l), &r);
            dev += (size_t)skv_pool_pages(c, r.dev_bytes) * lay->page_bytes;
            host += (size_t)skv_pool_pages(c, r.host_bytes) * lay->page_bytes;
        }
        stage = (size_t)skv_pool_pages(c, stage) * lay->page_bytes;
    } else { /* what create set aside per sequence */
        const size_t B = (size_t)g->batch_size;
        dev = (size_t)(g->n_layers - lay->n_dense_layers) * lay->slot_device + (size_t)lay->n_dense_layers * lay->slot_dense +
              ((size_t)lay->n_dev_slots * lay->slot_values + (size_t)(lay->n_sparse_slots - lay->n_dev_slots) * lay->slot_vcache) / B;
        host = lay->host_total / B;
    }
    if (device_bytes) *device_bytes = dev;
    if (host_bytes) *host_bytes = host;
    if (staging_bytes) *staging_bytes = stage;
    return SKV_OK;
}

static skv_status skv_cache_usage_sized_body(skv_cache *c, skv_usage *out, size_t out_size)
{
    static const char fn[] = "skv_cache_usage";
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: cache is NULL", fn);
    if (!out) return skv_fail(c->err, SKV_ERR_NULL_POINTER, "%s: usage is NULL", fn);
    if (out_size < sizeof(skv_usage))
        return skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT, "%s: usage_size = %zu, below the first skv_usage's %zu", fn,
                        out_size, sizeof(skv_usage));
    skv_status st = skv_cache_sync(c);
    if (st) return st;
    skv_usage u;
    memset(&u, 0, sizeof u);
    const skv_layout *lay = &c->lay;
    if (lay->pooled) {
        const size_t pb = lay->page_bytes;
        u.pooled = 1;
        u.page_bytes = (int32_t)pb;
        u.device_pool_bytes = (size_t)c->dev_pool.n_pages * pb;
        u.device_used_bytes = (size_t)c->dev_pool.n_used * pb;
        u.device_largest_free = (size_t)skv_pool_largest_free(&c->dev_pool) * pb;
        u.host_pool_bytes = (size_t)c->host_pool.n_pages * pb;
        u.host_used_bytes = (size_t)c->host_pool.n_used * pb;
        u.host_largest_free = (size_t)skv_pool_largest_free(&c->host_pool) * pb;
    }
    u.staging_bytes = c->staging_bytes;
    for (int32_t b = 0; b < c->cfg.batch_size; b++) {
        int in_use = 0;
        for (int32_t l = 0; l < c->cfg.n_layers && !in_use; l++)
            in_use = c->slots[SLOT_INDEX(c, l, b)].prefilled || c->staging[SLOT_INDEX(c, l, b)].n_total;
        u.seqs_in_use += in_use;
    }
    u.seqs_free = c->cfg.batch_size - u.seqs_in_use;
    skv_copy_sized(out, out_size, &u, sizeof u);
    return SKV_OK;
}

SKV_API skv_status skv_cache_usage_sized(skv_cache *c, skv_usage *out, size_t out_size)
{
    SKV_ON_DEVICE(c, skv_cache_usage_sized_body(c, out, out_size));
}
