/* Config defaults and validation, the cache memory layout, RoPE tables,
   the backend registry. */
#include <pthread.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "skv_internal.h"
#include "skv_numerics.h"

static skv_config skv_defaults(void)
{
    skv_config c;
    memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    c.n_layers = 32;
    c.n_q_heads = 32;
    c.n_kv_heads = 8;
    c.head_dim = 128;
    c.rank = 160;
    c.chunk_size = 8;
    c.budget = 2048;
    c.n_outlier_chunks = 48;
    c.n_local_chunks = 4;
    c.rope.theta = 500000.0f;
    c.rope.rotary_dim = 0;
    c.rope.interleaved = 0;
    c.rope.llama3_scaling = 0;
    c.rope.scaling_factor = 8.0f;
    c.rope.low_freq_factor = 1.0f;
    c.rope.high_freq_factor = 4.0f;
    c.rope.original_max_position = 8192;
    c.attn_scale = 0.0f;
    c.batch_size = 1;
    c.max_prompt_len = 32768;
    c.gen_capacity = 1024;
    c.backend = SKV_BACKEND_AUTO;
    c.n_threads = 0;
    c.cuda_stream = NULL;
    c.value_device_bytes = SKV_VALUES_ALL_DEVICE;
    c.value_cache_chunks = 0;
    c.factorize = SKV_FACTORIZE_AUTO;
    c.reproducible = 0;
    c.select_mode = SKV_SELECT_FIXED;
    c.select_mass = 0.95f;
    c.select_min_chunks = 0;
    c.rank_max = 0;
    c.rank_error_target = 0.1f;
    c.dense_layers = 0;
    c.select_candidates = 0;
    c.pool_device_bytes = 0;
    c.pool_host_bytes = 0;
    c.pool_page_bytes = 0;
    c.cuda_prefill_sms = 0;
    c.value_dtype = SKV_VALUE_BF16;
    c.model_kv_heads = 0;
    c.kv_head_begin = 0;
    c.cuda_device = -1;
    return c;
}

SKV_API unsigned skv_version_number(void) { return SKV_VERSION_NUMBER; }

#define SKV_STR_(x) #x
#define SKV_STR(x) SKV_STR_(x)
SKV_API const char *skv_version_string(void)
{
    return SKV_STR(SKV_VERSION_MAJOR) "." SKV_STR(SKV_VERSION_MINOR) "." SKV_STR(SKV_VERSION_PATCH);
}

/* A size some published skv_config had: 0.1 ended at factorize, 0.2 added reproducible,
   0.3 the selection mode, ranks per slot and dense layers, 0.4 select_candidates, 0.5 the pools and
   cuda_prefill_sms, 0.6 value_dtype, 0.7 the head shard and cuda_device. */
static int skv_config_size_ok(size_t size)
{
    return size == SKV_CONFIG_MIN_SIZE || size == SKV_CONFIG_V02_SIZE || size == SKV_CONFIG_V03_SIZE ||
           size == SKV_CONFIG_V04_SIZE || size == SKV_CONFIG_V05_SIZE || size == SKV_CONFIG_V06_SIZE ||
           size == sizeof(skv_config);
}

SKV_API skv_status skv_config_init(skv_config *cfg, size_t struct_size)
{
    if (!cfg) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_config_init: cfg is NULL");
    if (!skv_config_size_ok(struct_size))
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT,
                        "skv_config_init: struct_size = %zu; this library (%s) knows skv_config sizes %zu..%zu",
                        struct_size, skv_version_string(), (size_t)SKV_CONFIG_MIN_SIZE, sizeof(skv_config));
    skv_config d = skv_defaults();
    d.struct_size = struct_size;
    memcpy(cfg, &d, struct_size);
    return SKV_OK;
}

skv_status skv_config_import(char *errbuf, const skv_config *cfg, skv_config *out)
{
    if (!skv_config_size_ok(cfg->struct_size))
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "struct_size = %zu: not a skv_config size this library (%s) knows (%zu..%zu); "
                        "start from skv_config_default()",
                        cfg->struct_size, skv_version_string(), (size_t)SKV_CONFIG_MIN_SIZE, sizeof(skv_config));
    *out = skv_defaults();
    memcpy(out, cfg, cfg->struct_size);
    out->struct_size = sizeof *out;
    return SKV_OK;
}

/* Largest head_dim / chunk etc. accepted: keeps every index within int32 and
   per-row scratch small. */
#define SKV_MAX_HEAD_DIM 1024
#define SKV_MAX_PROMPT ((int64_t)1 << 30)

skv_status skv_rope_validate(char *errbuf, const skv_rope_config *rope, int32_t head_dim)
{
    if (!(rope->theta > 1.0f) || !isfinite(rope->theta))
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "rope.theta = %g: must be finite and > 1",
                        (double)rope->theta);
    if (rope->rotary_dim < 0 || rope->rotary_dim > head_dim || rope->rotary_dim % 2)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "rope.rotary_dim = %d: must be even and in [0, head_dim = %d] (0 = head_dim)",
                        rope->rotary_dim, head_dim);
    if (rope->interleaved != 0 && rope->interleaved != 1)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "rope.interleaved = %d: must be 0 or 1",
                        rope->interleaved);
    if (rope->llama3_scaling != 0 && rope->llama3_scaling != 1)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "rope.llama3_scaling = %d: must be 0 or 1",
                        rope->llama3_scaling);
    if (rope->llama3_scaling) {
        if (!(rope->scaling_factor >= 1.0f) || !isfinite(rope->scaling_factor))
            return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "rope.scaling_factor = %g: must be >= 1",
                            (double)rope->scaling_factor);
        if (!(rope->low_freq_factor > 0.0f) || !(rope->high_freq_factor > rope->low_freq_factor) ||
            !isfinite(rope->high_freq_factor))
            return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                            "rope.low_freq_factor = %g, rope.high_freq_factor = %g: need 0 < low < high",
                            (double)rope->low_freq_factor, (double)rope->high_freq_factor);
        if (rope->original_max_position < 1)
            return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "rope.original_max_position = %d: must be >= 1",
                            rope->original_max_position);
    }
    return SKV_OK;
}

#define POSITIVE(field)                                                                        \
    if (cfg->field < 1)                                                                        \
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, #field " = %lld: must be >= 1",        \
                        (long long)cfg->field);

static skv_status skv_config_check(char *errbuf, const skv_config *cfg)
{
    if (!cfg) return skv_fail(errbuf, SKV_ERR_NULL_POINTER, "cfg is NULL");
    POSITIVE(n_layers)
    POSITIVE(n_q_heads)
    POSITIVE(n_kv_heads)
    POSITIVE(head_dim)
    if (cfg->rank < 0)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "rank = %d: must be >= 1, or 0 (a rank per slot, up to rank_max)", cfg->rank);
    POSITIVE(chunk_size)
    if (cfg->budget < 1 && cfg->budget != SKV_BUDGET_ALL)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "budget = %d: must be >= 1 (a multiple of chunk_size), or SKV_BUDGET_ALL (-1)", cfg->budget);
    POSITIVE(batch_size)
    POSITIVE(max_prompt_len)
    POSITIVE(gen_capacity)
    if (cfg->n_q_heads > 65536 || cfg->n_kv_heads > 65536)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "n_q_heads = %d, n_kv_heads = %d: must be <= 65536",
                        cfg->n_q_heads, cfg->n_kv_heads);
    if (cfg->chunk_size > 4096)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "chunk_size = %d: must be <= 4096", cfg->chunk_size);
    if (cfg->n_q_heads % cfg->n_kv_heads)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "n_q_heads = %d is not a multiple of n_kv_heads = %d", cfg->n_q_heads,
                        cfg->n_kv_heads);
    if (cfg->head_dim % 2 || cfg->head_dim > SKV_MAX_HEAD_DIM)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "head_dim = %d: must be even and <= %d",
                        cfg->head_dim, SKV_MAX_HEAD_DIM);
    if (cfg->budget != SKV_BUDGET_ALL && cfg->budget % cfg->chunk_size)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "budget = %d is not a multiple of chunk_size = %d", cfg->budget,
                        cfg->chunk_size);
    if (cfg->n_outlier_chunks < 0)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "n_outlier_chunks = %d: must be >= 0",
                        cfg->n_outlier_chunks);
    if (cfg->n_local_chunks < 0)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "n_local_chunks = %d: must be >= 0",
                        cfg->n_local_chunks);
    if (!isfinite(cfg->attn_scale) || cfg->attn_scale < 0.0f)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "attn_scale = %g: must be finite and >= 0 (0 = 1/sqrt(head_dim))",
                        (double)cfg->attn_scale);
    if ((int)cfg->backend < SKV_BACKEND_AUTO || (int)cfg->backend > SKV_BACKEND_CUDA)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "backend = %d: not a skv_backend value",
                        (int)cfg->backend);
    if (cfg->n_threads < 0 || cfg->n_threads > SKV_MAX_THREADS)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "n_threads = %d: must be in [0, %d] (0 = default)",
                        cfg->n_threads, SKV_MAX_THREADS);
    if (cfg->value_device_bytes < SKV_VALUES_ALL_DEVICE)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "value_device_bytes = %lld: must be >= 0, or SKV_VALUES_ALL_DEVICE (-1)",
                        (long long)cfg->value_device_bytes);
    if (cfg->pool_device_bytes < 0 || cfg->pool_host_bytes < 0)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "pool_%s_bytes = %lld: must be >= 0",
                        cfg->pool_device_bytes < 0 ? "device" : "host",
                        (long long)(cfg->pool_device_bytes < 0 ? cfg->pool_device_bytes : cfg->pool_host_bytes));
    if (cfg->pool_page_bytes != 0 && (cfg->pool_page_bytes < 4096 || cfg->pool_page_bytes > (1 << 30) ||
                                      (cfg->pool_page_bytes & (cfg->pool_page_bytes - 1))))
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "pool_page_bytes = %d: must be 0 (256 KiB) or a power of two in [4096, 2^30]",
                        cfg->pool_page_bytes);
    if (cfg->cuda_prefill_sms < 0)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "cuda_prefill_sms = %d: must be >= 0 (0 = all the device's streaming multiprocessors)",
                        cfg->cuda_prefill_sms);
    if (cfg->value_dtype != SKV_VALUE_BF16 && cfg->value_dtype != SKV_VALUE_FP8)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "value_dtype = %d: must be SKV_VALUE_BF16 (0) or SKV_VALUE_FP8 (1)", (int)cfg->value_dtype);
    if (cfg->model_kv_heads < 0)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "model_kv_heads = %d: must be >= 0 (0 = the cache holds all the model's KV heads)",
                        cfg->model_kv_heads);
    if (cfg->model_kv_heads == 0 && cfg->kv_head_begin != 0)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "kv_head_begin = %d without model_kv_heads: a head shard names the model's KV heads "
                        "(model_kv_heads > 0)", cfg->kv_head_begin);
    if (cfg->model_kv_heads > 0 &&
        (cfg->n_kv_heads > cfg->model_kv_heads || cfg->kv_head_begin < 0 ||
         cfg->kv_head_begin > cfg->model_kv_heads - cfg->n_kv_heads))
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "head shard: KV heads [%d, %d) of model_kv_heads = %d (kv_head_begin = %d, n_kv_heads = %d): "
                        "the shard must lie within the model's KV heads",
                        cfg->kv_head_begin, cfg->kv_head_begin + cfg->n_kv_heads, cfg->model_kv_heads,
                        cfg->kv_head_begin, cfg->n_kv_heads);
    if (cfg->cuda_device < -1)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "cuda_device = %d: must be a device number >= 0, or -1 (the current device)",
                        cfg->cuda_device);
    if (cfg->pool_device_bytes == 0 && (cfg->pool_host_bytes || cfg->pool_page_bytes))
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "pool_%s = %lld without pool_device_bytes: the pools are on only with pool_device_bytes > 0",
                        cfg->pool_host_bytes ? "host_bytes" : "page_bytes",
                        (long long)(cfg->pool_host_bytes ? cfg->pool_host_bytes : cfg->pool_page_bytes));
    if (cfg->pool_device_bytes > 0 && cfg->value_device_bytes != SKV_VALUES_ALL_DEVICE && cfg->value_device_bytes != 0)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "value_device_bytes = %lld with pools: must be SKV_VALUES_ALL_DEVICE (values in the device "
                        "pool) or 0 (values in the host pool)",
                        (long long)cfg->value_device_bytes);
    if (cfg->pool_device_bytes > 0 && (cfg->value_device_bytes == 0) != (cfg->pool_host_bytes > 0))
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "pool_host_bytes = %lld with value_device_bytes = %lld: the host pool holds the values when "
                        "value_device_bytes = 0 and must then be > 0; otherwise it must be 0",
                        (long long)cfg->pool_host_bytes, (long long)cfg->value_device_bytes);
    if ((int)cfg->factorize < SKV_FACTORIZE_AUTO || (int)cfg->factorize > SKV_FACTORIZE_CANONICAL)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "factorize = %d: not a skv_factorize_route value",
                        (int)cfg->factorize);
    if (cfg->reproducible != 0 && cfg->reproducible != 1)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "reproducible = %d: must be 0 or 1", cfg->reproducible);
    if (cfg->reproducible && cfg->factorize != SKV_FACTORIZE_AUTO && cfg->factorize != SKV_FACTORIZE_CANONICAL)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "factorize = %d with reproducible = 1: the reproducible mode takes the canonical "
                        "route; leave factorize AUTO (or CANONICAL)",
                        (int)cfg->factorize);
    if (cfg->select_candidates > 0 && cfg->factorize != SKV_FACTORIZE_AUTO && cfg->factorize != SKV_FACTORIZE_CANONICAL)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "factorize = %d with select_candidates = %d: the rescoring ranks chunks by keys rebuilt from "
                        "the factors, so they must be the canonical route's (the same bits on every backend); "
                        "leave factorize AUTO (or CANONICAL)",
                        (int)cfg->factorize, cfg->select_candidates);
    if (cfg->value_cache_chunks < 0)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "value_cache_chunks = %d: must be >= 0 (0 = default)",
                        cfg->value_cache_chunks);
    skv_status st = skv_rope_validate(errbuf, &cfg->rope, cfg->head_dim);
    if (st) return st;
    if (cfg->max_prompt_len > SKV_MAX_PROMPT)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "max_prompt_len = %lld: must be <= %lld",
                        (long long)cfg->max_prompt_len, (long long)SKV_MAX_PROMPT);
    if (cfg->gen_capacity > (1 << 24))
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "gen_capacity = %d: must be <= %d",
                        cfg->gen_capacity, 1 << 24);
    if ((int)cfg->select_mode != SKV_SELECT_FIXED && (int)cfg->select_mode != SKV_SELECT_MASS)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "select_mode = %d: not a skv_select_mode value (SKV_SELECT_FIXED 0, SKV_SELECT_MASS 1)",
                        (int)cfg->select_mode);
    if (cfg->select_mode == SKV_SELECT_MASS && !(cfg->select_mass > 0.0f && cfg->select_mass <= 1.0f))
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG, "select_mass = %g: must be in (0, 1] with SKV_SELECT_MASS",
                        (double)cfg->select_mass);
    if (cfg->n_layers < 64 && (cfg->dense_layers >> cfg->n_layers))
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "dense_layers = 0x%llx: bit %d or above is set, but n_layers = %d",
                        (unsigned long long)cfg->dense_layers, cfg->n_layers, cfg->n_layers);
    /* S: budget / c, or every candidate of the longest prompt (SKV_BUDGET_ALL); computed in 64 bits */
    const int64_t cand_max = cfg->max_prompt_len / cfg->chunk_size - cfg->n_local_chunks - cfg->n_outlier_chunks;
    const int64_t S = cfg->budget == SKV_BUDGET_ALL ? cand_max : cfg->budget / cfg->chunk_size;
    if (cfg->budget == SKV_BUDGET_ALL && cand_max < 1)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "budget = SKV_BUDGET_ALL with max_prompt_len = %lld: (O + 1 + Lc) * c = %lld tokens are needed "
                        "for one candidate chunk",
                        (long long)cfg->max_prompt_len,
                        (long long)(((int64_t)cfg->n_outlier_chunks + 1 + cfg->n_local_chunks) * cfg->chunk_size));
    if (cfg->select_mode == SKV_SELECT_MASS && (cfg->select_min_chunks < 0 || cfg->select_min_chunks > S))
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "select_min_chunks = %d: must be in [0, S = %lld] (S = budget / chunk_size, or N_max - O for "
                        "SKV_BUDGET_ALL)",
                        cfg->select_min_chunks, (long long)S);
    if (cfg->select_candidates < 0 || (cfg->select_candidates > 0 && cfg->budget != SKV_BUDGET_ALL &&
                                        cfg->select_candidates < S))
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "select_candidates = %d: must be 0 (no rescoring) or at least S = budget / chunk_size = %lld "
                        "(the candidates the selection rescores, docs/DESIGN.md section 4.5.1)",
                        cfg->select_candidates, (long long)S);
    /* smallest valid prompt of a sparse layer: O + (candidates it must have) + Lc chunks */
    const int64_t need = skv_min_candidates(cfg, S);
    int64_t min_chunks = (int64_t)cfg->n_outlier_chunks + need + cfg->n_local_chunks;
    int64_t min_prompt = min_chunks * cfg->chunk_size;
    if (min_prompt > cfg->max_prompt_len)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "max_prompt_len = %lld < (O + %s + Lc) * c = %lld: no prompt could be prefilled",
                        (long long)cfg->max_prompt_len,
                        cfg->select_mode == SKV_SELECT_MASS ? "max(1, select_min_chunks)"
                        : cfg->budget == SKV_BUDGET_ALL     ? "1"
                                                            : "S",
                        (long long)min_prompt);
    /* the rank against the key width only; against the prompt at prefill (SKV_ERR_PROMPT_TOO_SHORT) */
    int64_t width = (int64_t)cfg->n_kv_heads * cfg->head_dim;
    if (cfg->rank > width)
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "rank = %d: must be <= n_kv_heads * head_dim = %lld (a prompt shorter than the rank "
                        "is refused at prefill)",
                        cfg->rank, (long long)width);
    if (cfg->rank == 0) {
        if (cfg->rank_max < 1 || cfg->rank_max > width)
            return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                            "rank_max = %d: with rank = 0 it must be in [1, n_kv_heads * head_dim = %lld]",
                            cfg->rank_max, (long long)width);
        if (!(cfg->rank_error_target > 0.0f && cfg->rank_error_target < 1.0f))
            return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                            "rank_error_target = %g: with rank = 0 it must be in (0, 1)",
                            (double)cfg->rank_error_target);
    }
    return SKV_OK;
}

/* a * b * c into *out; 0 on overflow. */
static int skv_mul3(size_t a, size_t b, size_t c, size_t *out)
{
    size_t t;
    return skv_mul_size(a, b, &t) && skv_mul_size(t, c, out);
}

/* Appends a region of count elements of elem bytes, 256-byte aligned. */
static int skv_region(size_t *cursor, size_t count, size_t elem, size_t *offset)
{
    size_t bytes, start;
    if (!skv_mul_size(count, elem, &bytes)) return 0;
    if (!skv_add_size(*cursor, 255, &start)) return 0;
    start &= ~(size_t)255;
    *offset = start;
    return skv_add_size(start, bytes, cursor);
}

/*
 * Slots on the device for a value budget: the largest k in [0, n] with
 * k * store + (n - k) * cache <= budget (the cost is linear in k). -1 when even
 * k = 0 does not fit.
 */
static int64_t skv_dev_slots(int64_t budget, int64_t n, size_t store, size_t cache)
{
    if (budget == SKV_VALUES_ALL_DEVICE) return n;
    long double B = (long double)budget, V = (long double)store, C = (long double)cache;
    if (V >= C) {
        if ((long double)n * C > B) return -1;
        if (V == C) return n;
        long double k = floorl((B - (long double)n * C) / (V - C));
        return k > (long double)n ? n : (int64_t)k;
    }
    /* a chunk cache costs more than a whole store (tiny prompts): all on the device if they fit */
    return (long double)n * V <= B ? n : ((long double)n * C <= B ? 0 : -1);
}

skv_status skv_layout_compute(char *errbuf, const skv_config *cfg, skv_layout *lay)
{
    skv_status st = skv_config_check(errbuf, cfg);
    if (st) return st;
    memset(lay, 0, sizeof *lay);
    size_t c = (size_t)cfg->chunk_size, D = (size_t)cfg->head_dim, Hk = (size_t)cfg->n_kv_heads;
    size_t r = (size_t)skv_cfg_rank(cfg), O = (size_t)cfg->n_outlier_chunks;
    size_t nmax = (size_t)cfg->max_prompt_len, cap = (size_t)cfg->gen_capacity;
    lay->cand_max = (int32_t)(cfg->max_prompt_len / cfg->chunk_size - cfg->n_local_chunks -
                              cfg->n_outlier_chunks);
    lay->S = cfg->budget == SKV_BUDGET_ALL ? lay->cand_max : cfg->budget / cfg->chunk_size;
    lay->W = cfg->select_candidates < lay->cand_max ? cfg->select_candidates : lay->cand_max;
    lay->min_cand = (int32_t)skv_min_candidates(cfg, lay->S);
    lay->batch = cfg->batch_size;
    lay->dense_layers = cfg->dense_layers;
    lay->n_dense_layers = skv_layout_dense_below(lay, cfg->n_layers);
    lay->local_max = (cfg->n_local_chunks + 1) * cfg->chunk_size - 1;
    lay->n_positions = cfg->max_prompt_len + cfg->gen_capacity;
    if (cfg->value_cache_chunks && (cfg->value_cache_chunks < lay->S || cfg->value_cache_chunks > lay->cand_max))
        return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                        "value_cache_chunks = %d: must be 0 (default) or in [S = budget / chunk_size = %d, "
                        "N_max - O = %d]",
                        cfg->value_cache_chunks, lay->S, lay->cand_max);
    lay->vc_chunks = cfg->value_cache_chunks ? cfg->value_cache_chunks
                                             : ((int64_t)4 * lay->S < lay->cand_max ? 4 * lay->S : lay->cand_max);
    size_t S = (size_t)lay->S, cm = (size_t)lay->cand_max, lm = (size_t)lay->local_max, vc = (size_t)lay->vc_chunks;
    size_t HkD = 0, b2 = sizeof(skv_bf16), i4 = sizeof(int32_t), t, oc = 0;
    size_t dev = 0, host = 0, vcache = 0, slots = 0, R2 = (size_t)skv_rotary_dim(&cfg->rope, cfg->head_dim) / 2;
    int ok = skv_mul_size(Hk, D, &HkD) && skv_mul_size(O, c, &oc);
#define REGION(cursor, a, b_, elem, off) (skv_mul3(a, b_, 1, &t) && skv_region(cursor, t, elem, off))
    /* the pool mode: the regions that grow with the prompt come from the pool (size 0 here) */
    const int pooled = cfg->pool_device_bytes > 0;
    const size_t grow = pooled ? 0 : 1;
    lay->pooled = pooled;
    lay->values_host = pooled && cfg->value_device_bytes == 0;
    ok = ok && REGION(&dev, nmax * grow, r, b2, &lay->u);
    ok = ok && REGION(&dev, r, HkD, b2, &lay->w);
    ok = ok && REGION(&dev, cm * grow, HkD, b2, &lay->landmarks);
    ok = ok && REGION(&dev, Hk, cm * grow, i4, &lay->cand_ids);
    ok = ok && REGION(&dev, Hk, O, i4, &lay->out_ids);
    ok = ok && REGION(&dev, oc, HkD, b2, &lay->out_k);
    ok = ok && REGION(&dev, oc, HkD, b2, &lay->out_v);
    ok = ok && REGION(&dev, lm, HkD, b2, &lay->loc_k);
    ok = ok && REGION(&dev, lm, HkD, b2, &lay->loc_v);
    ok = ok && REGION(&dev, cap, HkD, b2, &lay->gen_k);
    ok = ok && REGION(&dev, cap, HkD, b2, &lay->gen_v);
    ok = ok && REGION(&dev, Hk, S, i4, &lay->sel_idx);
    ok = ok && REGION(&dev, Hk, S, i4, &lay->sel_ids);
    ok = ok && REGION(&dev, Hk, 1, i4, &lay->sel_cnt);
    ok = ok && skv_add_size(dev, 255, &t) && ((lay->slot_device = t & ~(size_t)255), 1);
    /* a dense slot: the whole prompt's keys and values, and the generated tokens */
    size_t dn = 0;
    ok = ok && REGION(&dn, nmax * grow, HkD, b2, &lay->dn_k);
    ok = ok && REGION(&dn, nmax * grow, HkD, b2, &lay->dn_v);
    ok = ok && REGION(&dn, cap, HkD, b2, &lay->dn_gen_k);
    ok = ok && REGION(&dn, cap, HkD, b2, &lay->dn_gen_v);
    ok = ok && skv_add_size(dn, 255, &t) && ((lay->slot_dense = t & ~(size_t)255), 1);
    /* one value store, and one chunk cache (data, then its index: slot_of, owner, stamp) */
    lay->value_dtype = cfg->value_dtype;
    lay->vrec = skv_value_chunk_bytes(cfg->value_dtype, c, D); /* c, D are bounded: no overflow */
    ok = ok && skv_mul3(Hk, cm, lay->vrec, &t) && skv_add_size(t, 255, &t) &&
         ((lay->slot_values = lay->slot_host = t & ~(size_t)255), 1);
    ok = ok && skv_mul3(Hk, vc, lay->vrec, &t) && skv_region(&vcache, t, 1, &lay->vc_data);
    ok = ok && REGION(&vcache, Hk, cm, i4, &lay->vc_slot_of);
    ok = ok && REGION(&vcache, Hk, vc, i4, &lay->vc_owner);
    ok = ok && REGION(&vcache, Hk, vc, i4, &lay->vc_stamp);
    ok = ok && ((lay->vc_meta_bytes = vcache - lay->vc_slot_of), 1);
    ok = ok && skv_add_size(vcache, 255, &t) && ((lay->slot_vcache = t & ~(size_t)255), 1);
    /* the sparse slots, the dense slots, then shared regions, then the values */
    size_t n_sp = 0, n_dn = 0;
    ok = ok && skv_mul_size((size_t)cfg->n_layers, (size_t)cfg->batch_size, &slots);
    ok = ok && slots <= (size_t)INT64_MAX && ((lay->n_slots = (int64_t)slots), 1);
    ok = ok && skv_mul_size((size_t)lay->n_dense_layers, (size_t)cfg->batch_size, &n_dn);
    ok = ok && ((n_sp = slots - n_dn), (lay->n_sparse_slots = (int64_t)n_sp), (lay->n_dense_slots = (int64_t)n_dn), 1);
    ok = ok && skv_mul_size(n_sp, lay->slot_device, &dev);
    ok = ok && skv_add_size(dev, 255, &t) && ((lay->dense_base = t & ~(size_t)255), 1);
    ok = ok && skv_mul_size(n_dn, lay->slot_dense, &t) && skv_add_size(lay->dense_base, t, &dev);
    ok = ok && REGION(&dev, (size_t)lay->n_positions, R2, 4, &lay->rope_cos);
    ok = ok && REGION(&dev, (size_t)lay->n_positions, R2, 4, &lay->rope_sin);
    ok = ok && skv_mul3(S, c, HkD, &t) && skv_region(&dev, t, b2, &lay->ws_k);
    ok = ok && skv_mul3(S, c, HkD, &t) && skv_region(&dev, t, b2, &lay->ws_v);
    ok = ok && skv_mul3((size_t)cfg->batch_size, Hk, S, &t) && skv_region(&dev, t, i4, &lay->ws_sel_idx);
    ok = ok && skv_mul3((size_t)cfg->batch_size, Hk, S, &t) && skv_region(&dev, t, i4, &lay->ws_sel_ids);
    ok = ok && skv_mul3((size_t)cfg->batch_size, Hk, 1, &t) && skv_region(&dev, t, i4, &lay->ws_sel_cnt);
    ok = ok && skv_mul3((size_t)cfg->batch_size, Hk, (size_t)lay->W, &t) && skv_region(&dev, t, i4, &lay->ws_cand_idx);
    ok = ok && skv_mul3((size_t)cfg->batch_size, Hk, (size_t)lay->W, &t) && skv_region(&dev, t, i4, &lay->ws_cand_ids);
    ok = ok && skv_mul3((size_t)lay->W, c, HkD, &t) && skv_region(&dev, t, b2, &lay->ws_cand_k);
    if (ok && pooled) {
        /* no value store in the fixed layout; chunk caches for every sparse slot when values live on the host */
        lay->page_bytes = cfg->pool_page_bytes ? (size_t)cfg->pool_page_bytes : (size_t)262144;
        lay->pool_dev_pages = cfg->pool_device_bytes / (int64_t)lay->page_bytes;
        lay->pool_host_pages = cfg->pool_host_bytes / (int64_t)lay->page_bytes;
        if (lay->pool_dev_pages < 1 || (lay->values_host && lay->pool_host_pages < 1))
            return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                            "pool_%s_bytes = %lld: less than one page (pool_page_bytes = %zu)",
                            lay->pool_dev_pages < 1 ? "device" : "host",
                            (long long)(lay->pool_dev_pages < 1 ? cfg->pool_device_bytes : cfg->pool_host_bytes),
                            lay->page_bytes);
        lay->n_dev_slots = lay->values_host ? 0 : lay->n_sparse_slots; /* (no fixed store either way) */
        lay->slot_values = 0;
        lay->slot_host = 0;
    } else if (ok) {
        lay->n_dev_slots = skv_dev_slots(cfg->value_device_bytes, lay->n_sparse_slots, lay->slot_values,
                                         lay->slot_vcache);
        if (lay->n_dev_slots < 0)
            return skv_fail(errbuf, SKV_ERR_INVALID_CONFIG,
                            "value_device_bytes = %lld: below the chunk caches of all %lld sparse (layer, sequence) "
                            "slots (%zu bytes each, value_cache_chunks = %d); raise it or lower value_cache_chunks",
                            (long long)cfg->value_device_bytes, (long long)lay->n_sparse_slots, lay->slot_vcache,
                            lay->vc_chunks);
    }
    size_t n_dev = (size_t)lay->n_dev_slots, n_host = n_sp - n_dev;
    ok = ok && skv_add_size(dev, 255, &t) && ((lay->dev_values = t & ~(size_t)255), 1);
    ok = ok && skv_mul_size(n_dev, lay->slot_values, &t) && skv_add_size(lay->dev_values, t, &lay->dev_vcache);
    ok = ok && skv_mul_size(n_host, lay->slot_vcache, &t) && skv_add_size(lay->dev_vcache, t, &dev);
    if (pooled) { /* the device pool (256-byte aligned like every region); the host pool is the host arena */
        ok = ok && skv_add_size(dev, 255, &t) && ((lay->dev_pool = t & ~(size_t)255), 1);
        ok = ok && skv_mul_size((size_t)lay->pool_dev_pages, lay->page_bytes, &t) &&
             skv_add_size(lay->dev_pool, t, &dev);
    }
#undef REGION
    lay->device_total = dev;
    if (pooled)
        ok = ok && skv_mul_size((size_t)lay->pool_host_pages, lay->page_bytes, &host) && ((lay->host_total = host), 1);
    else
        ok = ok && skv_mul_size(n_host, lay->slot_host, &host) && ((lay->host_total = host), 1);
    /* ops index tokens of one head of one slot with int32 chunk ids */
    ok = ok && (uint64_t)cm * c <= (uint64_t)INT32_MAX;
    if (!ok)
        return skv_fail(errbuf, SKV_ERR_SIZE_OVERFLOW,
                        "cache size overflows size_t (n_layers = %d, batch_size = %d, max_prompt_len = "
                        "%lld, n_kv_heads = %d, head_dim = %d, rank = %d, gen_capacity = %d)",
                        cfg->n_layers, cfg->batch_size, (long long)cfg->max_prompt_len,
                        cfg->n_kv_heads, cfg->head_dim, cfg->rank, cfg->gen_capacity);
    return SKV_OK;
}

SKV_API skv_status skv_config_validate(const skv_config *cfg)
{
    if (!cfg) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_config_validate: cfg is NULL");
    skv_config c;
    skv_layout lay;
    skv_status st = skv_config_import(NULL, cfg, &c);
    return st ? st : skv_layout_compute(NULL, &c, &lay);
}

/* ---- RoPE tables ------------------------------------------------------------ */

SKV_API size_t skv_rope_table_len(const skv_rope_config *rope, int32_t head_dim, int64_t n_positions)
{
    size_t n;
    if (!rope || head_dim < 2 || head_dim % 2 || head_dim > SKV_MAX_HEAD_DIM || n_positions < 0 ||
        skv_rope_validate(NULL, rope, head_dim) != SKV_OK)
        return 0;
    if (!skv_mul_size((size_t)n_positions, (size_t)skv_rotary_dim(rope, head_dim) / 2, &n)) return 0;
    return n;
}

/* Inverse frequency of pair i, in double, with optional Llama-3 scaling. */
static double skv_rope_inv_freq(const skv_rope_config *rope, int32_t R, int32_t i)
{
    double inv = pow((double)rope->theta, -2.0 * (double)i / (double)R);
    if (!rope->llama3_scaling) return inv;
    const double pi2 = 6.283185307179586476925;
    double wavelen = pi2 / inv, orig = (double)rope->original_max_position;
    double lo = (double)rope->low_freq_factor, hi = (double)rope->high_freq_factor;
    double factor = (double)rope->scaling_factor;
    if (wavelen < orig / hi) return inv;
    if (wavelen > orig / lo) return inv / factor;
    double smooth = (orig / wavelen - lo) / (hi - lo);
    return (1.0 - smooth) * inv / factor + smooth * inv;
}

SKV_API skv_status skv_rope_table_build(const skv_rope_config *rope, int32_t head_dim,
                                        int64_t n_positions, float *cos_tab, float *sin_tab)
{
    if (!rope || !cos_tab || !sin_tab)
        return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_rope_table_build: %s is NULL",
                        !rope ? "rope" : !cos_tab ? "cos_tab" : "sin_tab");
    if (head_dim < 2 || head_dim % 2 || head_dim > SKV_MAX_HEAD_DIM)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT,
                        "skv_rope_table_build: head_dim = %d must be even in [2, %d]", head_dim,
                        SKV_MAX_HEAD_DIM);
    if (n_positions < 0)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "skv_rope_table_build: n_positions = %lld < 0",
                        (long long)n_positions);
    char why[SKV_ERRMSG_CAP];
    if (skv_rope_validate(why, rope, head_dim))
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "skv_rope_table_build: %s", why);
    int32_t R = skv_rotary_dim(rope, head_dim), h = R / 2;
    double inv[SKV_MAX_HEAD_DIM / 2];
    for (int32_t i = 0; i < h; i++) inv[i] = skv_rope_inv_freq(rope, R, i);
    for (int64_t p = 0; p < n_positions; p++)
        for (int32_t i = 0; i < h; i++) {
            double a = (double)p * inv[i];
            cos_tab[p * h + i] = (float)cos(a);
            sin_tab[p * h + i] = (float)sin(a);
        }
    return SKV_OK;
}

/* ---- backend registry -------------------------------------------------------- */

static struct skv_backend_ops skv_cpu_table;
static pthread_once_t skv_tables_once = PTHREAD_ONCE_INIT;

static void skv_tables_init(void) { skv_cpu_fill_ops(&skv_cpu_table); }

const struct skv_backend_ops *skv_backend_ops_get(skv_backend backend)
{
    switch (backend) {
    case SKV_BACKEND_REF: return &skv_ref_ops;
    case SKV_BACKEND_CPU: pthread_once(&skv_tables_once, skv_tables_init); return &skv_cpu_table;
    case SKV_BACKEND_CUDA: return skv_cuda_ops(); /* opens the plugin on first use */
    default: return NULL;
    }
}

SKV_API const char *skv_backend_name(skv_backend backend)
{
    switch (backend) {
    case SKV_BACKEND_AUTO: return "auto";
    case SKV_BACKEND_REF: return "ref";
    case SKV_BACKEND_CPU: return "cpu";
    case SKV_BACKEND_CUDA: return "cuda";
    default: return "invalid";
    }
}

SKV_API skv_status skv_backend_parse(const char *name, skv_backend *out)
{
    if (!name || !out)
        return skv_fail(NULL, SKV_ERR_NULL_POINTER, "skv_backend_parse: %s is NULL", !name ? "name" : "out");
    static const skv_backend all[] = {SKV_BACKEND_AUTO, SKV_BACKEND_REF, SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(name, skv_backend_name(all[i])) == 0) {
            *out = all[i];
            return SKV_OK;
        }
    return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT,
                    "backend name \"%.64s\": expected auto, ref, cpu or cuda", name);
}

SKV_API skv_status skv_backend_available(skv_backend backend)
{
    skv_backend got;
    const struct skv_backend_ops *ops;
    return skv_backend_resolve(NULL, backend, &got, &ops);
}

skv_status skv_backend_resolve(char *errbuf, skv_backend want, skv_backend *got,
                               const struct skv_backend_ops **ops)
{
    char msg[256] = "";
    if (want == SKV_BACKEND_AUTO) {
        const struct skv_backend_ops *cu = skv_backend_ops_get(SKV_BACKEND_CUDA);
        want = (cu->probe && cu->probe(msg, sizeof msg) == SKV_OK) ? SKV_BACKEND_CUDA : SKV_BACKEND_CPU;
    }
    const struct skv_backend_ops *o = skv_backend_ops_get(want);
    if (!o) return skv_fail(errbuf, SKV_ERR_INVALID_ARGUMENT, "backend = %d: not a skv_backend value", (int)want);
    if (!o->probe) return skv_fail(errbuf, SKV_ERR_NO_DEVICE, "backend %s: not usable", o->name);
    if (o->probe(msg, sizeof msg) != SKV_OK)
        return skv_fail(errbuf, SKV_ERR_NO_DEVICE, "backend %s: %s", skv_backend_name(want), msg);
    *got = want;
    *ops = o;
    return SKV_OK;
}
