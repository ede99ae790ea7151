/*
 * The cache: create/free, prefill, decode, introspection.
 *
 * All memory is allocated at create (two arenas: device-resident part and host
 * value store, laid out by skv_layout_compute). Prefill allocates scratch for
 * the factorization; decode allocates nothing. Every call checks all of its
 * arguments and the cache state before it changes anything, and publishes its
 * results last, so a failing call leaves the cache as it was.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "skv_internal.h"
#include "skv_numerics.h"
#include "skv_plan.h"

#include "skv_cache_impl.h"

/* Most tokens one decode attention call sees (the decode plan). */
static int64_t skv_max_attn_tokens(const skv_config *c, const skv_layout *lay)
{
    const int64_t sparse = skv_plan_max_tokens(c->n_outlier_chunks, c->chunk_size, lay->S, lay->local_max,
                                               c->gen_capacity);
    const int64_t dense = lay->n_dense_layers ? c->max_prompt_len + c->gen_capacity : 0; /* the whole prompt */
    return sparse > dense ? sparse : dense;
}

/* Value store [Hk, cand_max, c, D] of sparse slot j (skv_layout_sparse_index): device arena for the
   first n_dev_slots, else host. */
skv_bf16 *skv_value_store(const skv_cache *c, size_t j)
{
    if ((int64_t)j < c->lay.n_dev_slots) return (skv_bf16 *)(c->dev + c->lay.dev_values + j * c->lay.slot_values);
    return (skv_bf16 *)(c->host + (j - (size_t)c->lay.n_dev_slots) * c->lay.slot_host);
}

/* Chunk cache of host-placed sparse slot j (its base; regions at lay.vc_*), or NULL for a device slot. */
char *skv_value_cache(const skv_cache *c, size_t j)
{
    if ((int64_t)j < c->lay.n_dev_slots) return NULL;
    return c->dev + c->lay.dev_vcache + (j - (size_t)c->lay.n_dev_slots) * c->lay.slot_vcache;
}


/*
 * What create builds from *cfg: the config with the environment's backend
 * applied when the config asks for auto (an explicit backend wins), the layout, the backend table and the decode workspace size. With
 * probe = 0 an explicit backend is not probed (the memory query of a cuda
 * config works on a machine without a GPU); auto is always resolved.
 */
static skv_status skv_cache_plan(const skv_config *cfg, int probe, skv_config *c, skv_layout *lay,
                                 const struct skv_backend_ops **ops, size_t *ws_bytes)
{
    skv_status st = skv_config_import(NULL, cfg, c);
    if (st) return st;
    const char *env = c->backend == SKV_BACKEND_AUTO ? getenv("SKV_BACKEND") : NULL;
    if (env && *env && skv_backend_parse(env, &c->backend) != SKV_OK)
        return skv_fail(NULL, SKV_ERR_INVALID_CONFIG,
                        "environment SKV_BACKEND = \"%.64s\": expected auto, ref, cpu or cuda", env);
    st = skv_layout_compute(NULL, c, lay);
    if (st) return st;
    /* validated: AUTO or CANONICAL; the rescoring's keys come from the factors, which must then be
       the same bits on every backend (DESIGN 4.5.1) */
    if (c->reproducible || c->select_candidates) c->factorize = SKV_FACTORIZE_CANONICAL;
    if (probe || c->backend == SKV_BACKEND_AUTO) {
        st = skv_backend_resolve(NULL, c->backend, &c->backend, ops);
        if (st) return st;
    } else {
        *ops = skv_backend_ops_get(c->backend);
    }
    *ws_bytes = (*ops)->decode_ws_bytes
                    ? (*ops)->decode_ws_bytes(c, lay->cand_max, skv_max_attn_tokens(c, lay))
                    : 0;
    if (!(*ops)->cache_decode && skv_rescore_ws_bytes(lay->W, c->chunk_size, lay->S) > *ws_bytes)
        *ws_bytes = skv_rescore_ws_bytes(lay->W, c->chunk_size, lay->S);
    return SKV_OK;
}

SKV_API skv_status skv_cache_memory_info_sized(const skv_config *cfg, skv_memory_info *out, size_t out_size)
{
    if (!cfg) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_memory_info: cfg is NULL");
    if (!out) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_memory_info: info is NULL");
    if (out_size < SKV_MEMORY_INFO_MIN_SIZE)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT,
                        "skv_cache_memory_info: info_size = %zu, below the first skv_memory_info's %zu", out_size,
                        (size_t)SKV_MEMORY_INFO_MIN_SIZE);
    skv_memory_info info_, *info = &info_;
    skv_config c;
    skv_layout lay;
    const struct skv_backend_ops *ops;
    size_t ws, dev;
    skv_status st = skv_cache_plan(cfg, 0, &c, &lay, &ops, &ws);
    if (st) return st;
    if (ops->cache_bytes && !skv_add_size(ws, ops->cache_bytes(&c, &lay), &ws))
        return skv_fail(NULL, SKV_ERR_SIZE_OVERFLOW, "skv_cache_memory: device bytes overflow size_t");
    if (!skv_add_size(lay.device_total, ws, &dev))
        return skv_fail(NULL, SKV_ERR_SIZE_OVERFLOW, "skv_cache_memory: device bytes overflow size_t");
    memset(info, 0, sizeof *info);
    info->device_bytes = dev;
    info->host_bytes = lay.host_total;
    info->value_store_bytes = lay.slot_values;
    info->value_cache_bytes = lay.slot_vcache;
    info->device_value_slots = lay.n_dev_slots;
    info->host_value_slots = lay.n_sparse_slots - lay.n_dev_slots; /* dense slots hold no value store */
    info->value_cache_chunks = lay.vc_chunks;
    skv_copy_sized(out, out_size, info, sizeof *info);
    return SKV_OK;
}

SKV_API skv_status skv_cache_memory(const skv_config *cfg, size_t *device_bytes, size_t *host_bytes)
{
    if (!cfg) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_memory: cfg is NULL");
    skv_memory_info info;
    skv_status st = skv_cache_memory_info(cfg, &info);
    if (st) return st;
    if (device_bytes) *device_bytes = info.device_bytes;
    if (host_bytes) *host_bytes = info.host_bytes;
    return SKV_OK;
}

/* ops->device_enter(device) (none: *saved = -1); a failure's message into errbuf, after fn. */
static skv_status skv_ops_device_enter(const struct skv_backend_ops *ops, int32_t device, int32_t *saved,
                                       char *errbuf, const char *fn)
{
    *saved = -1;
    if (!ops || !ops->device_enter) return SKV_OK;
    char msg[SKV_ERRMSG_CAP] = "";
    skv_status st = ops->device_enter(device, saved, msg, sizeof msg);
    return st ? skv_fail(errbuf, st, "%s: %s", fn, msg) : SKV_OK;
}

skv_status skv_cache_device_enter(skv_cache *cache, int32_t *saved)
{
    *saved = -1;
    return cache ? skv_ops_device_enter(cache->ops, cache->cfg.cuda_device, saved, cache->err, "the cache's device")
                 : SKV_OK;
}

void skv_cache_device_leave(skv_cache *cache, int32_t saved)
{
    if (cache && cache->ops && cache->ops->device_leave) cache->ops->device_leave(saved);
}

static skv_status skv_cache_build(skv_config c, const skv_layout *lay_, const struct skv_backend_ops *ops,
                                  size_t ws_bytes, skv_cache **out);

SKV_API skv_status skv_cache_create(const skv_config *cfg, skv_cache **out)
{
    if (out) *out = NULL;
    if (!cfg) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_create: cfg is NULL");
    if (!out) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_create: out is NULL");
    skv_config c;
    skv_layout lay;
    const struct skv_backend_ops *ops;
    size_t ws_bytes;
    skv_status st = skv_cache_plan(cfg, 1, &c, &lay, &ops, &ws_bytes);
    if (st) return st;
    /* everything the cache allocates and opens lives on its device */
    int32_t saved;
    if ((st = skv_ops_device_enter(ops, c.cuda_device, &saved, NULL, "skv_cache_create"))) return st;
    if (ops->device_enter && c.cuda_device < 0) c.cuda_device = saved;
    st = skv_cache_build(c, &lay, ops, ws_bytes, out);
    if (ops->device_leave) ops->device_leave(saved);
    return st;
}

/* skv_cache_create once the config is planned, on the cache's device. */
static skv_status skv_cache_build(skv_config c, const skv_layout *lay_, const struct skv_backend_ops *ops,
                                  size_t ws_bytes, skv_cache **out)
{
    const skv_layout lay = *lay_;
    skv_status st;
    if (ops->set_threads && c.n_threads > 1 && (st = skv_probe_threads(c.n_threads))) return st;
    if (c.reproducible && !ops->cache_decode && (!ops->rebuild_keys_canonical || !ops->sparse_attention_canonical))
        return skv_fail(NULL, SKV_ERR_UNSUPPORTED,
                        "skv_cache_create: backend %s has no canonical rebuild and attention: "
                        "reproducible = 1 is not available on it",
                        ops->name);

    skv_cache *k = calloc(1, sizeof *k);
    if (!k) return skv_fail(NULL, SKV_ERR_OUT_OF_MEMORY, "skv_cache_create: out of host memory");
    k->cfg = c;
    k->lay = lay;
    k->ops = ops;
    size_t n_slots = (size_t)c.n_layers * (size_t)c.batch_size;
    k->slots = calloc(n_slots, sizeof *k->slots);
    k->mem = calloc(n_slots, sizeof *k->mem);
    k->dev_runs = calloc(n_slots, sizeof *k->dev_runs);
    k->host_runs = calloc(n_slots, sizeof *k->host_runs);
    k->staging = calloc(n_slots, sizeof *k->staging);
    k->all_seqs = malloc((size_t)c.batch_size * sizeof *k->all_seqs);
    k->mark = calloc((size_t)c.batch_size, 1);
    k->dev = ops->mem_alloc(lay.device_total, SKV_MEM_DEVICE);
    k->host = ops->mem_alloc(lay.host_total, SKV_MEM_HOST);
    k->ws.cap = ws_bytes;
    k->ws.base = ws_bytes ? ops->mem_alloc(ws_bytes, SKV_MEM_DEVICE) : NULL;
    k->vc_scratch = malloc(((size_t)3 * lay.vc_chunks + (size_t)2 * lay.S) * sizeof *k->vc_scratch);
    k->head_tokens = malloc((size_t)SKV_N_SPANS * c.n_kv_heads * sizeof *k->head_tokens);
    k->layer_stats = calloc((size_t)c.n_layers, sizeof *k->layer_stats);
    size_t tab = skv_rope_table_len(&c.rope, c.head_dim, lay.n_positions);
    float *cs = malloc(tab * sizeof *cs), *sn = malloc(tab * sizeof *sn);
    if (!k->slots || !k->mem || !k->dev_runs || !k->host_runs || !k->staging || !k->all_seqs || !k->mark ||
        !k->dev || !k->host || (ws_bytes && !k->ws.base) || !k->vc_scratch || !k->head_tokens ||
        !k->layer_stats || !cs || !sn) {
        free(cs);
        free(sn);
        skv_cache_free(k);
        return skv_fail(NULL, SKV_ERR_OUT_OF_MEMORY,
                        "skv_cache_create: out of memory (device arena %zu bytes, host arena %zu bytes, "
                        "workspace %zu bytes)",
                        lay.device_total, lay.host_total, ws_bytes);
    }
    for (size_t i = 0; i < n_slots; i++) k->slots[i].dense = skv_layout_dense(&lay, (int32_t)(i / c.batch_size));
    for (int32_t b = 0; b < c.batch_size; b++) k->all_seqs[b] = b;
    if ((st = skv_pool_open(k))) {
        skv_cache_free(k);
        return skv_fail(NULL, st, "skv_cache_create: out of host memory for the pool maps");
    }
    skv_rope_table_build(&c.rope, c.head_dim, lay.n_positions, cs, sn);
    st = ops->copy2d(SHARED(k, rope_cos, void), 0, cs, 0, tab * sizeof *cs, 1);
    if (!st) st = ops->copy2d(SHARED(k, rope_sin, void), 0, sn, 0, tab * sizeof *sn, 1);
    free(cs);
    free(sn);
    if (st) {
        skv_cache_free(k);
        return skv_fail(NULL, st, "skv_cache_create: copying the RoPE tables failed");
    }
    if (ops->cache_open && (st = ops->cache_open(&k->bctx, &k->cfg, &k->lay, k->dev, k->host, k->err,
                                                 sizeof k->err))) {
        char msg[SKV_ERRMSG_CAP];
        memcpy(msg, k->err, sizeof msg);
        skv_cache_free(k);
        return skv_fail(NULL, st, "skv_cache_create: %s", msg);
    }
    *out = k;
    return SKV_OK;
}

static void skv_cache_free_body(skv_cache *cache);

SKV_API void skv_cache_free(skv_cache *cache)
{
    if (!cache) return;
    const struct skv_backend_ops *ops = cache->ops; /* the cache is gone when its device is restored */
    int32_t saved;
    const int entered = skv_cache_device_enter(cache, &saved) == SKV_OK; /* else: on the current device */
    skv_cache_free_body(cache);
    if (entered && ops && ops->device_leave) ops->device_leave(saved);
}

static void skv_cache_free_body(skv_cache *cache)
{
    if (cache->ops && cache->ops->cache_close) cache->ops->cache_close(cache->bctx);
    if (cache->ops && cache->staging) skv_pool_close(cache);
    if (cache->ops) {
        cache->ops->mem_free(cache->dev, SKV_MEM_DEVICE);
        cache->ops->mem_free(cache->host, SKV_MEM_HOST);
        cache->ops->mem_free(cache->ws.base, SKV_MEM_DEVICE);
    }
    free(cache->slots);
    free(cache->mem);
    free(cache->dev_runs);
    free(cache->host_runs);
    free(cache->staging);
    free(cache->all_seqs);
    free(cache->mark);
    free(cache->vc_scratch);
    free(cache->head_tokens);
    free(cache->layer_stats);
    free(cache);
}

SKV_API skv_backend skv_cache_backend(const skv_cache *cache)
{
    return cache ? cache->cfg.backend : (skv_backend)-1; /* no backend; never AUTO (shadowkv.h) */
}

SKV_API const skv_config *skv_cache_config(const skv_cache *cache) { return cache ? &cache->cfg : NULL; }

SKV_API const char *skv_cache_last_error(const skv_cache *cache) { return cache ? cache->err : ""; }

/* ---- shared checks ----------------------------------------------------------------- */

skv_status skv_check_index(skv_cache *c, const char *fn, int32_t layer, int32_t seq)
{
    if (layer < 0 || layer >= c->cfg.n_layers)
        return skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT, "%s: layer = %d, must be in [0, %d)", fn, layer,
                        c->cfg.n_layers);
    if (seq < 0 || seq >= c->cfg.batch_size)
        return skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT, "%s: seq = %d, must be in [0, %d)", fn, seq,
                        c->cfg.batch_size);
    return SKV_OK;
}

/* NaN/Inf and magnitude check of a [tokens, heads, D] host tensor (ref, cpu); the message
   names the first bad element and, for a finite one, its value. */
skv_status skv_check_tensor(skv_cache *c, const char *fn, const char *what, const skv_bf16 *x,
                                   int64_t tokens, int32_t heads)
{
    const int64_t D = c->cfg.head_dim, bad = skv_first_bad(x, tokens * heads * D);
    if (bad < 0) return SKV_OK;
    const long long t = (long long)(bad / (heads * D)), h = (long long)(bad / D % heads), d = (long long)(bad % D);
    if (!skv_bf16_isfinite(x[bad]))
        return skv_fail(c->err, SKV_ERR_NONFINITE, "%s: %s[%lld][%lld][%lld] is NaN or Inf", fn, what, t, h, d);
    return skv_fail(c->err, SKV_ERR_NONFINITE,
                    "%s: %s[%lld][%lld][%lld] = %g is beyond the accepted magnitude SKV_MAX_INPUT_MAGNITUDE = 2^32 "
                    "(larger values overflow float arithmetic)",
                    fn, what, t, h, d, (double)skv_bf16_to_f32(x[bad]));
}

skv_status skv_slot_failed(skv_cache *c, const char *fn, const char *what, skv_status st)
{
    const char *detail = skv_backend_detail();
    return skv_fail(c->err, st, "%s: %s failed on backend %s: %s%s%s", fn, what, c->ops->name,
                    skv_status_string(st), *detail ? ": " : "", detail);
}

/* ---- prefill -------------------------------------------------------------------------- */

/* The last act of a successful prefill: the slot's shape and the phase times. */
static void skv_publish_prefill(skv_cache *c, skv_slot *sl, int64_t n, int32_t N, int32_t n_cand, int32_t n_local,
                                const skv_stats *t)
{
    sl->rank = sl->dense ? 0 : c->cfg.rank;
    sl->n = n;
    sl->n_chunks = N;
    sl->n_cand = n_cand;
    sl->n_local = n_local;
    sl->n_gen = 0;
    sl->has_selection = 0;
    sl->prefilled = 1;
    c->stats.prefill_rope_ms += t->prefill_rope_ms;
    c->stats.prefill_factorize_ms += t->prefill_factorize_ms;
    c->stats.prefill_landmarks_ms += t->prefill_landmarks_ms;
    c->stats.prefill_offload_ms += t->prefill_offload_ms;
    c->stats.prefill_critical_ms += t->prefill_critical_ms;
    c->stats.n_prefill_calls++;
}

/*
 * Prefill of a dense layer's slot (n >= 1 checked here): the exact post-RoPE keys (k_post, or
 * the RoPE of k_pre) and the values of all n tokens into dn_k / dn_v, head stride n * D.
 */
static skv_status skv_prefill_dense(skv_cache *c, const char *fn, int32_t layer, int32_t seq, int64_t n,
                                    const skv_bf16 *k_pre, const skv_bf16 *v, const skv_bf16 *k_post)
{
    const skv_config *g = &c->cfg;
    const struct skv_backend_ops *ops = c->ops;
    const int32_t Hk = g->n_kv_heads, D = g->head_dim;
    skv_slot *sl = &c->slots[SLOT_INDEX(c, layer, seq)];
    skv_status st;
    if (n < 1)
        return skv_fail(c->err, SKV_ERR_PROMPT_TOO_SHORT,
                        "%s: n = %lld: layer %d is dense (config.dense_layers) and needs a prompt of at least 1 token",
                        fn, (long long)n, layer);
    if (!ops->cache_prefill) {
        if ((st = skv_check_tensor(c, fn, "k_pre", k_pre, n, Hk))) return st;
        if ((st = skv_check_tensor(c, fn, "v", v, n, Hk))) return st;
        if (k_post && (st = skv_check_tensor(c, fn, "k_post", k_post, n, Hk))) return st;
    }
    if ((st = skv_pool_take(c, fn, layer, seq, n))) return st;
    skv_stats t = {0};
    if (ops->cache_prefill) {
        st = ops->cache_prefill(c->bctx, layer, seq, n, 0, MEM(c, layer, seq), k_pre, v, k_post, &t, c->err,
                                sizeof c->err);
        if (st) {
            skv_pool_give(c, layer, seq);
            return skv_fail(c->err, st, "%s: %s", fn, skv_cache_last_error(c));
        }
        skv_publish_prefill(c, sl, n, 0, 0, (int32_t)n, &t);
        return SKV_OK;
    }
    const double t0 = skv_now_ms();
    const size_t row = (size_t)D * B2, tok = (size_t)Hk * D * B2;
    skv_bf16 *kp_tmp = NULL;
    if (!k_post) {
        kp_tmp = ops->mem_alloc((size_t)n * Hk * D * B2, SKV_MEM_DEVICE);
        if (!kp_tmp) {
            skv_pool_give(c, layer, seq);
            return skv_fail(c->err, SKV_ERR_OUT_OF_MEMORY, "%s: out of memory for prefill scratch (n = %lld)", fn,
                            (long long)n);
        }
        st = ops->rope(&g->rope, D, n, Hk, 0, SHARED(c, rope_cos, float), SHARED(c, rope_sin, float), k_pre, kp_tmp);
        if (st) {
            ops->mem_free(kp_tmp, SKV_MEM_DEVICE);
            skv_pool_give(c, layer, seq);
            return skv_slot_failed(c, fn, "rope", st);
        }
        k_post = kp_tmp;
    }
    t.prefill_rope_ms = skv_now_ms() - t0;
    skv_bf16 *dk = (skv_bf16 *)MEM(c, layer, seq)->dn_k, *dv = (skv_bf16 *)MEM(c, layer, seq)->dn_v;
    st = SKV_OK;
    for (int32_t h = 0; h < Hk && !st; h++) {
        st = ops->copy2d(dk + (size_t)h * n * D, row, k_post + (size_t)h * D, tok, row, (size_t)n);
        if (!st) st = ops->copy2d(dv + (size_t)h * n * D, row, v + (size_t)h * D, tok, row, (size_t)n);
    }
    ops->mem_free(kp_tmp, SKV_MEM_DEVICE);
    if (st) {
        skv_pool_give(c, layer, seq);
        return skv_slot_failed(c, fn, "dense copy", st);
    }
    t.prefill_critical_ms = skv_now_ms() - t0;
    skv_publish_prefill(c, sl, n, 0, 0, (int32_t)n, &t);
    return SKV_OK;
}

/* The prompt length checks of a prefill of layer with n tokens (skv_prefill, skv_prefill_piece). */
skv_status skv_prompt_check(skv_cache *c, const char *fn, int32_t layer, int64_t n)
{
    const skv_config *g = &c->cfg;
    if (n > g->max_prompt_len)
        return skv_fail(c->err, SKV_ERR_PROMPT_TOO_LONG, "%s: n = %lld > max_prompt_len = %lld", fn,
                        (long long)n, (long long)g->max_prompt_len);
    if (n < 0)
        return skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT, "%s: n = %lld: a prompt length must be >= 0", fn,
                        (long long)n);
    const int32_t cs = g->chunk_size, O = g->n_outlier_chunks;
    const int32_t r = skv_cfg_rank(g); /* the factors' size: rank, or rank_max */
    if (skv_layout_dense(&c->lay, layer)) {
        if (n < 1)
            return skv_fail(c->err, SKV_ERR_PROMPT_TOO_SHORT,
                            "%s: n = %lld: layer %d is dense (config.dense_layers) and needs a prompt of at least 1 "
                            "token",
                            fn, (long long)n, layer);
        return SKV_OK;
    }
    const int32_t need = c->lay.min_cand; /* S (fixed), max(1, floor) (mass), 1 (every candidate) */
    const int64_t N = n / cs - g->n_local_chunks; /* 0 <= n <= max_prompt_len here */
    if (N < (int64_t)O + need)
        return skv_fail(c->err, SKV_ERR_PROMPT_TOO_SHORT,
                        "%s: n = %lld tokens are %lld whole chunks of c = %d; after the Lc = %d local chunks "
                        "that leaves %lld context chunks, need O + %s = %d (at least %lld tokens)",
                        fn, (long long)n, (long long)(n / cs), cs, g->n_local_chunks, (long long)(N > 0 ? N : 0),
                        g->select_mode == SKV_SELECT_MASS ? "max(1, select_min_chunks)"
                        : g->budget == SKV_BUDGET_ALL     ? "1"
                                                          : "S",
                        O + need, (long long)(O + need + g->n_local_chunks) * cs);
    if (n < r)
        return skv_fail(c->err, SKV_ERR_PROMPT_TOO_SHORT,
                        "%s: n = %lld tokens are fewer than the %s = %d of the key factorization (it needs "
                        "n >= %s)",
                        fn, (long long)n, g->rank ? "rank" : "rank_max (rank = 0)", r, g->rank ? "rank" : "rank_max");
    return SKV_OK;
}

skv_status skv_prefill_run(skv_cache *c, const char *fn, int32_t layer, int32_t seq, int64_t n, const skv_bf16 *k_pre,
                           const skv_bf16 *v, const skv_bf16 *k_post)
{
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: cache is NULL", fn);
    if (!k_pre) return skv_fail(c->err, SKV_ERR_NULL_POINTER, "%s: k_pre is NULL", fn);
    if (!v) return skv_fail(c->err, SKV_ERR_NULL_POINTER, "%s: v is NULL", fn);
    skv_status st = skv_check_index(c, fn, layer, seq);
    if (st) return st;
    const skv_config *g = &c->cfg;
    const struct skv_backend_ops *ops = c->ops;
    skv_slot *sl = &c->slots[SLOT_INDEX(c, layer, seq)];
    if (sl->prefilled)
        return skv_fail(c->err, SKV_ERR_ALREADY_PREFILLED, "%s: layer %d of sequence %d is already prefilled",
                        fn, layer, seq);
    if ((st = skv_prompt_check(c, fn, layer, n))) return st;
    const int32_t cs = g->chunk_size, Hk = g->n_kv_heads, D = g->head_dim, O = g->n_outlier_chunks;
    const int32_t r = skv_cfg_rank(g); /* the factors' size: rank, or rank_max */
    if (sl->dense) return skv_prefill_dense(c, fn, layer, seq, n, k_pre, v, k_post);
    const int64_t N = n / cs - g->n_local_chunks; /* 0 <= n <= max_prompt_len here */
    if (!ops->cache_prefill) { /* a cache-level backend checks on its own stream */
        if ((st = skv_check_tensor(c, fn, "k_pre", k_pre, n, Hk))) return st;
        if ((st = skv_check_tensor(c, fn, "v", v, n, Hk))) return st;
        if (k_post && (st = skv_check_tensor(c, fn, "k_post", k_post, n, Hk))) return st;
    }

    const int32_t n_cand = (int32_t)N - O, n_local = (int32_t)(n - N * cs);
    if ((st = skv_pool_take(c, fn, layer, seq, n))) return st;
    const skv_slot_mem *mem = MEM(c, layer, seq);
    if (ops->cache_prefill) {
        skv_stats t = {0};
        st = ops->cache_prefill(c->bctx, layer, seq, n, (int32_t)N, mem, k_pre, v, k_post, &t, c->err, sizeof c->err);
        if (st) {
            skv_pool_give(c, layer, seq);
            return skv_fail(c->err, st, "%s: %s", fn, skv_cache_last_error(c));
        }
        skv_publish_prefill(c, sl, n, (int32_t)N, n_cand, n_local, &t);
        sl->rank = g->rank; /* 0: chosen on the device, refreshed by cache_sync */
        return SKV_OK;
    }
    const size_t HkD = (size_t)Hk * D, row = (size_t)D * B2, tok = HkD * B2;
    skv_bf16 *kp_tmp = NULL;
    int32_t slot_rank = r;
    float *uf = ops->mem_alloc((size_t)n * r * sizeof(float), SKV_MEM_DEVICE);
    float *wf = ops->mem_alloc((size_t)r * HkD * sizeof(float), SKV_MEM_DEVICE);
    int32_t *ids = malloc(((size_t)Hk * O + (size_t)Hk * n_cand) * sizeof *ids);
    if (!k_post) kp_tmp = ops->mem_alloc((size_t)n * HkD * B2, SKV_MEM_DEVICE);
    uint8_t *rec = c->lay.value_dtype == SKV_VALUE_FP8 ? malloc(c->lay.vrec) : NULL; /* one encoded chunk */
    if (!uf || !wf || !ids || (!k_post && !kp_tmp) || (c->lay.value_dtype == SKV_VALUE_FP8 && !rec)) {
        st = skv_fail(c->err, SKV_ERR_OUT_OF_MEMORY, "%s: out of memory for prefill scratch (n = %lld)", fn,
                      (long long)n);
        goto done;
    }
    double t0 = skv_now_ms(), t1, t2, t3, t4;
    /* 1. RoPE (unless the caller gave post-RoPE keys) */
    if (!k_post) {
        st = ops->rope(&g->rope, D, n, Hk, 0, SHARED(c, rope_cos, float), SHARED(c, rope_sin, float), k_pre,
                       kp_tmp);
        if (st) {
            st = skv_slot_failed(c, fn, "rope", st);
            goto done;
        }
        k_post = kp_tmp;
    }
    t1 = skv_now_ms();
    /* 2. factorization of k_pre as [n, Hk*D], stored in bf16 */
    st = ops->factorize(c->cfg.factorize, n, (int32_t)HkD, r, k_pre, uf, wf);
    if (st) {
        st = skv_slot_failed(c, fn, "factorize", st);
        goto done;
    }
    if (g->rank == 0) { /* the slot's rank (section 3.1), its columns ordered by energy, the rest zero */
        st = skv_rank_store(c->err, g, n, k_pre, uf, wf, (skv_bf16 *)mem->u, DEV(c, layer, seq, w, skv_bf16), &slot_rank);
        if (st) goto done;
    } else {
        skv_bf16 *u = (skv_bf16 *)mem->u, *w = DEV(c, layer, seq, w, skv_bf16);
        for (size_t i = 0; i < (size_t)n * r; i++) u[i] = skv_f32_to_bf16(uf[i]);
        for (size_t i = 0; i < (size_t)r * HkD; i++) w[i] = skv_f32_to_bf16(wf[i]);
    }
    t2 = skv_now_ms();
    /* 3. landmarks, outliers, candidates */
    int32_t *out_ids = DEV(c, layer, seq, out_ids, int32_t), *cand_ids = (int32_t *)mem->cand_ids;
    st = ops->landmarks_outliers((int32_t)N, cs, Hk, D, O, k_post, out_ids, cand_ids, (skv_bf16 *)mem->landmarks);
    if (st) {
        st = skv_slot_failed(c, fn, "landmarks_outliers", st);
        goto done;
    }
    t3 = skv_now_ms();
    /* 4. exact outliers and local window stay; candidate values go to the host store */
    int32_t *h_out = ids, *h_cand = ids + (size_t)Hk * O;
    if (O) st = ops->copy2d(h_out, 0, out_ids, 0, (size_t)Hk * O * sizeof *ids, 1);
    if (!st) st = ops->copy2d(h_cand, 0, cand_ids, 0, (size_t)Hk * n_cand * sizeof *ids, 1);
    skv_bf16 *ok_ = DEV(c, layer, seq, out_k, skv_bf16), *ov = DEV(c, layer, seq, out_v, skv_bf16);
    skv_bf16 *lk = DEV(c, layer, seq, loc_k, skv_bf16), *lv = DEV(c, layer, seq, loc_v, skv_bf16);
    char *vs = mem->vstore;
    const size_t vrec = c->lay.vrec;
    for (int32_t h = 0; h < Hk && !st; h++) {
        for (int32_t o = 0; o < O && !st; o++) {
            size_t src = ((size_t)h_out[(size_t)h * O + o] * cs * Hk + h) * D;
            size_t dst = ((size_t)h * O + o) * cs * D;
            st = ops->copy2d(ok_ + dst, row, k_post + src, tok, row, (size_t)cs);
            if (!st) st = ops->copy2d(ov + dst, row, v + src, tok, row, (size_t)cs);
        }
        size_t lsrc = ((size_t)N * cs * Hk + h) * D, ldst = (size_t)h * n_local * D;
        if (!st && n_local) st = ops->copy2d(lk + ldst, row, k_post + lsrc, tok, row, (size_t)n_local);
        if (!st && n_local) st = ops->copy2d(lv + ldst, row, v + lsrc, tok, row, (size_t)n_local);
        for (int32_t m = 0; m < n_cand && !st; m++) { /* the candidate's chunk record (bf16, or encoded) */
            size_t src = ((size_t)h_cand[(size_t)h * n_cand + m] * cs * Hk + h) * D;
            char *dst = vs + ((size_t)h * n_cand + m) * vrec;
            if (!rec) {
                st = ops->copy2d(dst, row, v + src, tok, row, (size_t)cs);
            } else {
                skv_fp8_encode_chunk(v + src, (int64_t)HkD, cs, D, rec);
                st = ops->copy2d(dst, vrec, rec, vrec, vrec, 1);
            }
        }
    }
    if (st) {
        st = skv_slot_failed(c, fn, "offload copy", st);
        goto done;
    }
    {   /* an empty chunk cache (host slots): every index entry -1 */
        char *vc = skv_value_cache(c, VSLOT(c, layer, seq));
        if (vc) memset(vc + c->lay.vc_slot_of, 0xff, c->lay.vc_meta_bytes);
    }
    t4 = skv_now_ms();
    {
        skv_stats t = {0};
        t.prefill_rope_ms = t1 - t0;
        t.prefill_factorize_ms = t2 - t1;
        t.prefill_landmarks_ms = t3 - t2;
        t.prefill_offload_ms = t4 - t3;
        t.prefill_critical_ms = t4 - t0;
        skv_publish_prefill(c, sl, n, (int32_t)N, n_cand, n_local, &t);
        sl->rank = slot_rank;
    }
done:
    if (st) skv_pool_give(c, layer, seq);
    ops->mem_free(kp_tmp, SKV_MEM_DEVICE);
    ops->mem_free(uf, SKV_MEM_DEVICE);
    ops->mem_free(wf, SKV_MEM_DEVICE);
    free(ids);
    free(rec);
    return st;
}

/* config.n_threads holds for the backend slots of this call only, on the calling thread (set_threads). */
static skv_status skv_prefill_body(skv_cache *c, int32_t layer, int32_t seq, int64_t n,
                                   const skv_bf16 *k_pre, const skv_bf16 *v, const skv_bf16 *k_post)
{
    if (c && c->ops->set_threads) c->ops->set_threads(c->cfg.n_threads);
    skv_status st;
    if (c && layer >= 0 && layer < c->cfg.n_layers && seq >= 0 && seq < c->cfg.batch_size &&
        c->staging[SLOT_INDEX(c, layer, seq)].n_total && !c->slots[SLOT_INDEX(c, layer, seq)].prefilled) {
        const skv_staging *sg = &c->staging[SLOT_INDEX(c, layer, seq)];
        st = skv_fail(c->err, SKV_ERR_SEQ_STATE,
                      "skv_prefill: layer %d of sequence %d has a prompt arriving in pieces (%lld of %lld tokens): "
                      "send the rest with skv_prefill_piece, or skv_seq_release the sequence",
                      layer, seq, (long long)sg->received, (long long)sg->n_total);
    } else {
        st = skv_prefill_run(c, "skv_prefill", layer, seq, n, k_pre, v, k_post);
    }
    if (c && c->ops->set_threads) c->ops->set_threads(0);
    return st;
}

SKV_API skv_status skv_prefill(skv_cache *c, int32_t layer, int32_t seq, int64_t n,
                               const skv_bf16 *k_pre, const skv_bf16 *v, const skv_bf16 *k_post)
{
    SKV_ON_DEVICE(c, skv_prefill_body(c, layer, seq, n, k_pre, v, k_post));
}

/* ---- sync -------------------------------------------------------------------------------- */

static skv_status skv_cache_sync_body(skv_cache *c)
{
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_sync: cache is NULL");
    if (!c->ops->cache_sync) return SKV_OK;
    skv_status st = c->ops->cache_sync(c->bctx, c->slots, &c->stats, c->layer_stats, c->err, sizeof c->err);
    if (st) return skv_fail(c->err, st, "%s", skv_cache_last_error(c));
    c->list_steps = 0; /* the host's n_gen is the device's again (skv_decode_run syncs only after device lists) */
    return SKV_OK;
}

SKV_API skv_status skv_cache_sync(skv_cache *c)
{
    SKV_ON_DEVICE(c, skv_cache_sync_body(c));
}

/* ---- introspection ----------------------------------------------------------------------- */

static skv_status skv_intro_check(skv_cache *c, const char *fn, int32_t layer, int32_t seq,
                                  int32_t kv_head, const void *dst, const char *dst_name,
                                  const skv_slot **sl)
{
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: cache is NULL", fn);
    skv_status sst = skv_cache_sync(c);
    if (sst) return sst;
    if (!dst) return skv_fail(c->err, SKV_ERR_NULL_POINTER, "%s: %s is NULL", fn, dst_name);
    skv_status st = skv_check_index(c, fn, layer, seq);
    if (st) return st;
    if (kv_head < 0 || kv_head >= c->cfg.n_kv_heads)
        return skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT, "%s: kv_head = %d, must be in [0, %d)", fn, kv_head,
                        c->cfg.n_kv_heads);
    *sl = &c->slots[SLOT_INDEX(c, layer, seq)];
    if (!(*sl)->prefilled)
        return skv_fail(c->err, SKV_ERR_NOT_PREFILLED, "%s: layer %d of sequence %d is not prefilled", fn,
                        layer, seq);
    return SKV_OK;
}

static skv_status skv_cache_seq_info_sized_body(skv_cache *c, int32_t layer, int32_t seq, skv_seq_info *out,
                                                size_t out_size)
{
    static const char fn[] = "skv_cache_seq_info";
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: cache is NULL", fn);
    if (!out) return skv_fail(c->err, SKV_ERR_NULL_POINTER, "%s: info is NULL", fn);
    if (out_size < SKV_SEQ_INFO_MIN_SIZE)
        return skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT, "%s: info_size = %zu, below the first skv_seq_info's %zu",
                        fn, out_size, (size_t)SKV_SEQ_INFO_MIN_SIZE);
    skv_status st = skv_check_index(c, fn, layer, seq);
    if (st) return st;
    if ((st = skv_cache_sync(c))) return st;
    const skv_slot *sl = &c->slots[SLOT_INDEX(c, layer, seq)];
    skv_seq_info info;
    memset(&info, 0, sizeof info);
    info.prefilled = sl->prefilled;
    info.dense = sl->dense;
    info.n_outliers = sl->dense ? 0 : c->cfg.n_outlier_chunks;
    info.n_selected = sl->dense ? 0 : c->lay.S;
    /* a dense slot keeps its values in device memory */
    info.values_on_device = sl->dense || skv_layout_sparse_index(&c->lay, layer, seq) < c->lay.n_dev_slots;
    if (sl->prefilled) {
        info.rank = sl->rank;
        info.n = sl->n;
        info.n_chunks = sl->n_chunks;
        info.n_candidates = sl->n_cand;
        info.n_local = sl->n_local;
        info.n_generated = sl->n_gen;
        info.has_selection = sl->has_selection;
        info.rank = sl->rank;
    }
    skv_copy_sized(out, out_size, &info, sizeof info);
    return SKV_OK;
}

SKV_API skv_status skv_cache_seq_info_sized(skv_cache *c, int32_t layer, int32_t seq, skv_seq_info *out,
                                            size_t out_size)
{
    SKV_ON_DEVICE(c, skv_cache_seq_info_sized_body(c, layer, seq, out, out_size));
}

/* Copies head kv_head's row of a per-slot region (rows of row_bytes) to the caller. */
static skv_status skv_read_head_row(const skv_cache *c, int32_t layer, int32_t seq, int32_t kv_head,
                                    size_t region, size_t row_bytes, void *dst)
{
    const char *src = c->dev + skv_layout_slot_offset(&c->lay, layer, seq) + region;
    if (!row_bytes) return SKV_OK;
    return c->ops->copy2d(dst, 0, src + (size_t)kv_head * row_bytes, 0, row_bytes, 1);
}

/* The checks of skv_cache_selected(_count): a sparse layer's slot with a selection. */
static skv_status skv_selection_check(skv_cache *c, const char *fn, int32_t layer, int32_t seq, int32_t kv_head,
                                      const void *dst, const char *dst_name)
{
    const skv_slot *sl;
    skv_status st = skv_intro_check(c, fn, layer, seq, kv_head, dst, dst_name, &sl);
    if (st) return st;
    if (sl->dense)
        return skv_fail(c->err, SKV_ERR_NO_SELECTION,
                        "%s: layer %d is dense (config.dense_layers): its steps attend to every token and select "
                        "no chunks",
                        fn, layer);
    if (!sl->has_selection)
        return skv_fail(c->err, SKV_ERR_NO_SELECTION, "%s: no decode step has run for layer %d", fn, layer);
    return SKV_OK;
}

static skv_status skv_cache_selected_body(skv_cache *c, int32_t layer, int32_t seq, int32_t kv_head,
                                          int32_t *ids)
{
    skv_status st = skv_selection_check(c, "skv_cache_selected", layer, seq, kv_head, ids, "ids");
    if (st) return st;
    return skv_read_head_row(c, layer, seq, kv_head, c->lay.sel_ids, (size_t)c->lay.S * sizeof *ids, ids);
}

SKV_API skv_status skv_cache_selected(skv_cache *c, int32_t layer, int32_t seq, int32_t kv_head,
                                      int32_t *ids)
{
    SKV_ON_DEVICE(c, skv_cache_selected_body(c, layer, seq, kv_head, ids));
}

static skv_status skv_cache_selected_count_body(skv_cache *c, int32_t layer, int32_t seq, int32_t kv_head,
                                                int32_t *count)
{
    skv_status st = skv_selection_check(c, "skv_cache_selected_count", layer, seq, kv_head, count, "count");
    if (st) return st;
    return skv_read_head_row(c, layer, seq, kv_head, c->lay.sel_cnt, sizeof *count, count);
}

SKV_API skv_status skv_cache_selected_count(skv_cache *c, int32_t layer, int32_t seq, int32_t kv_head,
                                            int32_t *count)
{
    SKV_ON_DEVICE(c, skv_cache_selected_count_body(c, layer, seq, kv_head, count));
}

static skv_status skv_cache_outliers_body(skv_cache *c, int32_t layer, int32_t seq, int32_t kv_head,
                                          int32_t *ids)
{
    const skv_slot *sl;
    skv_status st = skv_intro_check(c, "skv_cache_outliers", layer, seq, kv_head, ids, "ids", &sl);
    if (st) return st;
    return skv_read_head_row(c, layer, seq, kv_head, c->lay.out_ids,
                             (size_t)c->cfg.n_outlier_chunks * sizeof *ids, ids);
}

SKV_API skv_status skv_cache_outliers(skv_cache *c, int32_t layer, int32_t seq, int32_t kv_head,
                                      int32_t *ids)
{
    SKV_ON_DEVICE(c, skv_cache_outliers_body(c, layer, seq, kv_head, ids));
}

static skv_status skv_cache_candidates_body(skv_cache *c, int32_t layer, int32_t seq, int32_t kv_head,
                                            int32_t *ids)
{
    const skv_slot *sl;
    skv_status st = skv_intro_check(c, "skv_cache_candidates", layer, seq, kv_head, ids, "ids", &sl);
    if (st) return st;
    size_t row = (size_t)sl->n_cand * sizeof *ids;
    if (!row) return SKV_OK; /* a dense layer's slot has none */
    return c->ops->copy2d(ids, 0, MEM(c, layer, seq)->cand_ids + (size_t)kv_head * row, 0, row, 1);
}

SKV_API skv_status skv_cache_candidates(skv_cache *c, int32_t layer, int32_t seq, int32_t kv_head,
                                        int32_t *ids)
{
    SKV_ON_DEVICE(c, skv_cache_candidates_body(c, layer, seq, kv_head, ids));
}

static skv_status skv_cache_landmarks_body(skv_cache *c, int32_t layer, int32_t seq, int32_t kv_head,
                                           skv_bf16 *landmarks)
{
    const skv_slot *sl;
    skv_status st = skv_intro_check(c, "skv_cache_landmarks", layer, seq, kv_head, landmarks, "landmarks", &sl);
    if (st) return st;
    size_t row = (size_t)sl->n_cand * (size_t)c->cfg.head_dim * B2;
    if (!row) return SKV_OK;
    return c->ops->copy2d(landmarks, 0, MEM(c, layer, seq)->landmarks + (size_t)kv_head * row, 0, row, 1);
}

SKV_API skv_status skv_cache_landmarks(skv_cache *c, int32_t layer, int32_t seq, int32_t kv_head,
                                       skv_bf16 *landmarks)
{
    SKV_ON_DEVICE(c, skv_cache_landmarks_body(c, layer, seq, kv_head, landmarks));
}

static skv_status skv_cache_stats_sized_body(skv_cache *c, skv_stats *stats, size_t stats_size)
{
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_stats: cache is NULL");
    if (!stats) return skv_fail(c->err, SKV_ERR_NULL_POINTER, "skv_cache_stats: stats is NULL");
    if (stats_size < SKV_STATS_MIN_SIZE)
        return skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT,
                        "skv_cache_stats: stats_size = %zu, below the first skv_stats's %zu", stats_size,
                        (size_t)SKV_STATS_MIN_SIZE);
    skv_status st = skv_cache_sync(c);
    if (st) return st;
    skv_copy_sized(stats, stats_size, &c->stats, sizeof c->stats);
    return SKV_OK;
}

SKV_API skv_status skv_cache_stats_sized(skv_cache *c, skv_stats *stats, size_t stats_size)
{
    SKV_ON_DEVICE(c, skv_cache_stats_sized_body(c, stats, stats_size));
}

static skv_status skv_cache_layer_stats_sized_body(skv_cache *c, int32_t layer, skv_layer_stats *stats,
                                                   size_t stats_size)
{
    static const char fn[] = "skv_cache_layer_stats";
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: cache is NULL", fn);
    if (!stats) return skv_fail(c->err, SKV_ERR_NULL_POINTER, "%s: stats is NULL", fn);
    if (stats_size < SKV_LAYER_STATS_MIN_SIZE)
        return skv_fail(c->err, SKV_ERR_INVALID_ARGUMENT, "%s: stats_size = %zu, below the first skv_layer_stats's %zu",
                        fn, stats_size, (size_t)SKV_LAYER_STATS_MIN_SIZE);
    skv_status st = skv_check_index(c, fn, layer, 0);
    if (st) return st;
    if ((st = skv_cache_sync(c))) return st;
    skv_layer_stats ls = c->layer_stats[layer];
    ls.dense = skv_layout_dense(&c->lay, layer);
    ls.rank_min = ls.rank_max = ls.n_prefilled = 0;
    double sum = 0.0;
    for (int32_t b = 0; b < c->cfg.batch_size; b++) {
        const skv_slot *sl = &c->slots[SLOT_INDEX(c, layer, b)];
        if (!sl->prefilled) continue;
        if (!ls.n_prefilled || sl->rank < ls.rank_min) ls.rank_min = sl->rank;
        if (!ls.n_prefilled || sl->rank > ls.rank_max) ls.rank_max = sl->rank;
        ls.n_prefilled++;
        sum += sl->rank;
    }
    ls.rank_mean = ls.n_prefilled ? sum / ls.n_prefilled : 0.0;
    skv_copy_sized(stats, stats_size, &ls, sizeof ls);
    return SKV_OK;
}

SKV_API skv_status skv_cache_layer_stats_sized(skv_cache *c, int32_t layer, skv_layer_stats *stats,
                                               size_t stats_size)
{
    SKV_ON_DEVICE(c, skv_cache_layer_stats_sized_body(c, layer, stats, stats_size));
}

static skv_status skv_cache_stats_reset_body(skv_cache *c)
{
    if (!c) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_cache_stats_reset: cache is NULL");
    skv_status st = skv_cache_sync(c);
    memset(&c->stats, 0, sizeof c->stats);
    memset(c->layer_stats, 0, (size_t)c->cfg.n_layers * sizeof *c->layer_stats);
    if (st) return st;
    return SKV_OK;
}

SKV_API skv_status skv_cache_stats_reset(skv_cache *c)
{
    SKV_ON_DEVICE(c, skv_cache_stats_reset_body(c));
}

/* ---- snapshots ---------------------------------------------------------------------------- */

/* What lib/skv_snapshot.c needs of a cache (skv_internal.h). */
void skv_cache_parts_get(skv_cache *c, skv_cache_parts *p)
{
    p->cfg = &c->cfg;
    p->lay = &c->lay;
    p->ops = c->ops;
    p->dev = c->dev;
    p->host = c->host;
    p->slots = c->slots;
    p->layer_stats = c->layer_stats;
    p->bctx = c->bctx;
    p->err = c->err;
}
