/*
 * skv_cache_impl.h - the cache object, shared by the files of lib/ that implement it:
 * skv_cache.c (create, prefill, sync, introspection), skv_decode.c (decode steps),
 * skv_pool.c (the pools and slot memory), skv_serve.c (release, prompts in pieces, readiness).
 * Private to the library.
 */
#ifndef SKV_CACHE_IMPL_H
#define SKV_CACHE_IMPL_H

#include "skv_internal.h"

typedef skv_seq_state skv_slot;

/* A run of pages of a pool: pages [start, start + count); count 0: none. */
typedef struct skv_run {
    int64_t start, count;
} skv_run;

/* A page pool: n_pages pages of the cache's page_bytes from base; used[p] = 1 for a page in use. */
typedef struct skv_pool {
    char *base;
    int64_t n_pages, n_used;
    unsigned char *used;
} skv_pool;

/* A prompt of (layer, sequence) arriving in pieces (skv_prefill_piece). */
typedef struct skv_staging {
    int64_t n_total;   /* the prompt's length (0: no prompt arriving) */
    int64_t received;  /* tokens received so far */
    int32_t has_kpost; /* the pieces bring post-RoPE keys */
    skv_run run;       /* pool mode: its pages; otherwise buf is allocated */
    char *buf;         /* k_pre [n_total, Hk, D], v, then k_post when has_kpost */
    size_t bytes;
} skv_staging;

struct skv_cache {
    skv_config cfg; /* validated, backend resolved */
    skv_layout lay;
    const struct skv_backend_ops *ops;
    char *dev;      /* device arena */
    char *host;     /* host arena (value store, or the host pool) */
    skv_slot *slots;/* [n_layers * batch_size] */
    skv_slot_mem *mem; /* [n_layers * batch_size]: where each slot's growing regions are */
    skv_run *dev_runs, *host_runs; /* [n_layers * batch_size]: the pool mode's pages of each slot */
    skv_staging *staging; /* [n_layers * batch_size] */
    skv_pool dev_pool, host_pool; /* the pool mode */
    size_t staging_bytes;  /* staging held now (pool pages or allocations) */
    int32_t list_steps;    /* device-list steps enqueued since the last sync (cuda) */
    skv_ws ws;      /* decode-slot scratch, allocated at create */
    int32_t *vc_scratch; /* chunk-cache bookkeeping of one KV head: 3 * vc_chunks + 2 * S */
    int64_t *head_tokens; /* [SKV_N_SPANS][Hk]: the spans' token counts per KV head of a step */
    int32_t *all_seqs;    /* [batch_size]: 0 .. B-1 (skv_decode's list) */
    unsigned char *mark;  /* [batch_size]: scratch of the list checks */
    void *bctx;     /* backend's cache state (cache-level slots), or NULL */
    skv_stats stats;
    skv_layer_stats *layer_stats; /* [n_layers]: the decode counters (dense and ranks filled when read) */
    char err[SKV_ERRMSG_CAP];
};

#define SLOT_INDEX(c, l, b) ((size_t)(l) * (size_t)(c)->cfg.batch_size + (size_t)(b))
/* Typed pointer to a per-slot region of the device arena (field: a sparse slot's fixed region, or
   a dense slot's dn_gen_* region; the growing regions are at MEM(c, l, b)). */
#define DEV(c, l, b, field, type) \
    ((type *)((c)->dev + skv_layout_slot_offset(&(c)->lay, l, b) + (c)->lay.field))
/* The growing regions of (l, b) (skv_slot_mem). */
#define MEM(c, l, b) (&(c)->mem[SLOT_INDEX(c, l, b)])
#define SHARED(c, field, type) ((type *)((c)->dev + (c)->lay.field))
/* The sparse index of (layer, seq) (a sparse layer's). */
#define VSLOT(c, l, b) ((size_t)skv_layout_sparse_index(&(c)->lay, l, b))

static const size_t B2 = sizeof(skv_bf16);

/* skv_cache.c */
skv_status skv_check_index(skv_cache *c, const char *fn, int32_t layer, int32_t seq);
skv_status skv_check_tensor(skv_cache *c, const char *fn, const char *what, const skv_bf16 *x, int64_t tokens,
                            int32_t heads);
skv_status skv_slot_failed(skv_cache *c, const char *fn, const char *what, skv_status st);
/* Value store of sparse slot j in the fixed layout (not the pool mode). */
skv_bf16 *skv_value_store(const skv_cache *c, size_t j);
/* Chunk cache of sparse slot j (its base; regions at lay.vc_*), or NULL when it has none. */
char *skv_value_cache(const skv_cache *c, size_t j);
/* The prompt length checks of a prefill of layer with n tokens (message names fn). */
skv_status skv_prompt_check(skv_cache *c, const char *fn, int32_t layer, int64_t n);
/* The prefill of (layer, seq) with the whole prompt (skv_prefill; skv_prefill_piece's last piece). */
skv_status skv_prefill_run(skv_cache *c, const char *fn, int32_t layer, int32_t seq, int64_t n, const skv_bf16 *k_pre,
                           const skv_bf16 *v, const skv_bf16 *k_post);

/* skv_pool.c */
/* Sets up the pools and the slot memory of a new cache (the fixed layout's regions outside the
   pool mode); SKV_ERR_OUT_OF_MEMORY. skv_pool_close frees what it allocated. */
skv_status skv_pool_open(skv_cache *c);
void skv_pool_close(skv_cache *c);
/* The pool mode: takes the pages of (layer, seq) for a prompt of n tokens and points its slot memory
   at them (nothing changes on SKV_ERR_OUT_OF_MEMORY, whose message names fn, the bytes asked, free
   and the largest free run). Outside the pool mode: SKV_OK, nothing to take. */
skv_status skv_pool_take(skv_cache *c, const char *fn, int32_t layer, int32_t seq, int64_t n);
/* Returns the pages of (layer, seq) (the pool mode; its slot memory becomes NULL). */
void skv_pool_give(skv_cache *c, int32_t layer, int32_t seq);
/* Pages of pool p for bytes; a run of count pages from p, or start -1 (none free). */
int64_t skv_pool_pages(const skv_cache *c, size_t bytes);
skv_run skv_pool_alloc(skv_pool *p, int64_t count);
void skv_pool_free(skv_pool *p, skv_run *run);
int64_t skv_pool_largest_free(const skv_pool *p);
/* Pool mode: OUT_OF_MEMORY naming what was asked of pool (dev: 1 device, 0 host). */
skv_status skv_pool_refuse(skv_cache *c, const char *fn, int dev, size_t asked, const char *what);

#endif
