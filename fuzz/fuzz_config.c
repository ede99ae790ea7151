/*
 * fuzz_config.c - skv_config_validate, skv_cache_memory, skv_cache_create/free
 * on carved configs (a small valid one with any fields replaced by wild
 * values), plus skv_backend_parse/available/name and skv_status_string on
 * wild inputs.
 *
 * Asserts: every status is defined (with a message on failure); validate,
 * memory and create agree on the status of an invalid config; memory leaves
 * its outputs untouched on error, create leaves *out NULL; a config that
 * validates and needs <= 64 MB is created on ref/cpu, reports back its config
 * (backend resolved), answers introspection with defined statuses, and frees.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

#define CREATE_LIMIT ((size_t)64 << 20)

static int same_float(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

/* Replaces one carved field of *c with a wild value. */
static void mutate(skvf_data *d, skv_config *c)
{
    switch (skvf_range(d, 0, 23)) {
    case 0: c->n_layers = skvf_wild_i32(d); break;
    case 1: c->n_q_heads = skvf_wild_i32(d); break;
    case 2: c->n_kv_heads = skvf_wild_i32(d); break;
    case 3: c->head_dim = skvf_wild_i32(d); break;
    case 4: c->rank = skvf_wild_i32(d); break;
    case 5: c->chunk_size = skvf_wild_i32(d); break;
    case 6: c->budget = skvf_wild_i32(d); break;
    case 7: c->n_outlier_chunks = skvf_wild_i32(d); break;
    case 8: c->n_local_chunks = skvf_wild_i32(d); break;
    case 9: c->rope.theta = skvf_float(d); break;
    case 10: c->rope.rotary_dim = skvf_wild_i32(d); break;
    case 11: c->rope.interleaved = skvf_wild_i32(d); break;
    case 12: c->rope.llama3_scaling = skvf_wild_i32(d); break;
    case 13: c->rope.scaling_factor = skvf_float(d); break;
    case 14: c->rope.low_freq_factor = skvf_float(d); break;
    case 15: c->rope.high_freq_factor = skvf_float(d); break;
    case 16: c->rope.original_max_position = skvf_wild_i32(d); break;
    case 17: c->attn_scale = skvf_float(d); break;
    case 18: c->batch_size = skvf_wild_i32(d); break;
    case 19:
        switch (skvf_u8(d) & 3) {
        case 0: c->max_prompt_len = skvf_wild_i32(d); break;
        case 1: c->max_prompt_len = (int64_t)skvf_u64(d); break;
        case 2: c->max_prompt_len = ((int64_t)1 << 30) + skvf_range(d, -2, 2); break;
        default: c->max_prompt_len = INT64_MAX - skvf_range(d, 0, 2); break;
        }
        break;
    case 20: c->gen_capacity = skvf_wild_i32(d); break;
    case 21: c->backend = (skv_backend)skvf_wild_i32(d); break;
    case 22: c->n_threads = skvf_wild_i32(d); break;
    default: /* a large but plausible shape: exercises the size checks and the memory limit */
        c->n_layers = (int32_t)skvf_range(d, 1, 128);
        c->n_kv_heads = (int32_t)skvf_range(d, 1, 64);
        c->n_q_heads = c->n_kv_heads * (int32_t)skvf_range(d, 1, 8);
        c->batch_size = (int32_t)skvf_range(d, 1, 64);
        c->max_prompt_len = skvf_range(d, 1, (int64_t)1 << 30);
        c->gen_capacity = (int32_t)skvf_range(d, 1, 1 << 24);
        break;
    }
}

static void check_backend_calls(skvf_data *d)
{
    static const char *const names[] = {"auto", "ref", "cpu", "cuda", "", "CPU", "ref ", "cud",
                                        "cudaa", "invalid", " auto", "Ref"};
    static const char *const valid[4] = {"auto", "ref", "cpu", "cuda"};
    char buf[12];
    const char *name;
    switch (skvf_u8(d) % 3) {
    case 0: name = names[skvf_range(d, 0, (int)(sizeof names / sizeof names[0]) - 1)]; break;
    case 1: { /* raw bytes, NUL-terminated */
        size_t len = (size_t)skvf_range(d, 0, sizeof buf - 1);
        for (size_t i = 0; i < len; i++) buf[i] = (char)skvf_u8(d);
        buf[len] = '\0';
        name = buf;
        break;
    }
    default: name = NULL; break;
    }
    int null_out = skvf_u8(d) < 32;
    skv_backend out = (skv_backend)77;
    skv_status st = skv_backend_parse(name, null_out ? NULL : &out);
    skvf_check_status(st, "skv_backend_parse");
    int want = -1;
    for (int i = 0; name && i < 4; i++)
        if (strcmp(name, valid[i]) == 0) want = i;
    if (!name || null_out) {
        if (st != SKV_ERR_NULL_POINTER) skvf_fail("skv_backend_parse(NULL arg): status %d", (int)st);
    } else if (want >= 0) {
        if (st != SKV_OK || (int)out != want)
            skvf_fail("skv_backend_parse(\"%s\"): status %d, out %d", name, (int)st, (int)out);
    } else if (st != SKV_ERR_INVALID_ARGUMENT || (int)out != 77) {
        skvf_fail("skv_backend_parse(bad name): status %d, out %d (must be untouched)", (int)st, (int)out);
    }

    int32_t be = skvf_wild_i32(d);
    st = skv_backend_available((skv_backend)be);
    skvf_check_status(st, "skv_backend_available");
    if (be >= SKV_BACKEND_AUTO && be <= SKV_BACKEND_CPU) {
        if (st != SKV_OK) skvf_fail("skv_backend_available(%d) = %d, want SKV_OK", be, (int)st);
    } else if (be == SKV_BACKEND_CUDA) {
        if (st != SKV_OK && st != SKV_ERR_NO_DEVICE) skvf_fail("skv_backend_available(cuda) = %d", (int)st);
    } else if (st != SKV_ERR_INVALID_ARGUMENT) {
        skvf_fail("skv_backend_available(%d) = %d, want SKV_ERR_INVALID_ARGUMENT", be, (int)st);
    }
    const char *bn = skv_backend_name((skv_backend)be);
    if (!bn) skvf_fail("skv_backend_name(%d) is NULL", be);
    if (be >= SKV_BACKEND_AUTO && be <= SKV_BACKEND_CUDA ? strcmp(bn, valid[be]) != 0 : strcmp(bn, "invalid") != 0)
        skvf_fail("skv_backend_name(%d) = \"%s\"", be, bn);

    int32_t sv = skvf_wild_i32(d);
    const char *ss = skv_status_string((skv_status)sv);
    if (!ss || !*ss) skvf_fail("skv_status_string(%d) is NULL or empty", sv);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    check_backend_calls(&d);

    skv_config cfg = skvf_bool(&d) ? skvf_small_config(&d) : skv_config_default();
    int n_mut = (int)skvf_range(&d, 0, 4);
    for (int i = 0; i < n_mut; i++) mutate(&d, &cfg);

    skv_status sv = skv_config_validate(&cfg);
    skvf_check_status(sv, "skv_config_validate");
    if (sv != SKV_OK && sv != SKV_ERR_INVALID_CONFIG && sv != SKV_ERR_SIZE_OVERFLOW)
        skvf_fail("skv_config_validate: status %d is not one it documents", (int)sv);
    if (skv_config_validate(NULL) != SKV_ERR_NULL_POINTER) skvf_fail("skv_config_validate(NULL)");

    size_t dev = (size_t)0xDEADBEEF, host = (size_t)0xFEEDFACE;
    int null_dev = skvf_u8(&d) < 40, null_host = skvf_u8(&d) < 40;
    skv_status sm = skv_cache_memory(&cfg, null_dev ? NULL : &dev, null_host ? NULL : &host);
    skvf_check_status(sm, "skv_cache_memory");
    if (sm != sv) skvf_fail("skv_cache_memory status %d but skv_config_validate %d", (int)sm, (int)sv);
    if (sm != SKV_OK && (dev != (size_t)0xDEADBEEF || host != (size_t)0xFEEDFACE))
        skvf_fail("skv_cache_memory changed its outputs on error %d", (int)sm);
    if (skv_cache_memory(NULL, &dev, &host) != SKV_ERR_NULL_POINTER) skvf_fail("skv_cache_memory(NULL cfg)");
    if (sm == SKV_OK && (null_dev || null_host)) { /* the totals come from a full call */
        sm = skv_cache_memory(&cfg, &dev, &host);
        if (sm != SKV_OK) skvf_fail("skv_cache_memory: OK with a NULL output, %d without", (int)sm);
    }

    skv_cache *cache = (skv_cache *)&d; /* a non-NULL sentinel */
    if (sv != SKV_OK) {
        skv_status sc = skv_cache_create(&cfg, &cache);
        skvf_check_status(sc, "skv_cache_create (invalid config)");
        if (sc != sv) skvf_fail("skv_cache_create status %d but skv_config_validate %d", (int)sc, (int)sv);
        if (cache) skvf_fail("skv_cache_create failed with %d but *out is not NULL", (int)sc);
        return 0;
    }
    if (skv_cache_create(&cfg, NULL) != SKV_ERR_NULL_POINTER) skvf_fail("skv_cache_create(cfg, NULL)");
    cache = (skv_cache *)&d;
    if (skv_cache_create(NULL, &cache) != SKV_ERR_NULL_POINTER || cache)
        skvf_fail("skv_cache_create(NULL, &out): status or *out wrong");

    /* Create only what runs fast on the host: ref/cpu, small totals and shapes (AUTO and
       cuda would make the outcome depend on the machine). */
    int small = (cfg.backend == SKV_BACKEND_REF || cfg.backend == SKV_BACKEND_CPU) && dev <= CREATE_LIMIT &&
                host <= CREATE_LIMIT && dev + host <= CREATE_LIMIT && cfg.n_threads <= 2 &&
                (int64_t)cfg.n_layers * cfg.batch_size * cfg.n_kv_heads <= 64 && cfg.head_dim <= 256 &&
                cfg.max_prompt_len <= 4096;
    if (!small) return 0;
    cache = (skv_cache *)&d;
    skv_status sc = skv_cache_create(&cfg, &cache);
    skvf_check_status(sc, "skv_cache_create");
    if (sc != SKV_OK) {
        if (sc != SKV_ERR_OUT_OF_MEMORY) skvf_fail("skv_cache_create of a valid small config: %d", (int)sc);
        if (cache) skvf_fail("skv_cache_create failed but *out is not NULL");
        return 0;
    }
    if (!cache) skvf_fail("skv_cache_create: SKV_OK with *out NULL");
    if (skv_cache_backend(cache) != cfg.backend)
        skvf_fail("skv_cache_backend = %d, config asked %d", (int)skv_cache_backend(cache), (int)cfg.backend);
    const skv_config *got = skv_cache_config(cache);
    if (!got || got->n_layers != cfg.n_layers || got->n_q_heads != cfg.n_q_heads ||
        got->n_kv_heads != cfg.n_kv_heads || got->head_dim != cfg.head_dim || got->rank != cfg.rank ||
        got->chunk_size != cfg.chunk_size || got->budget != cfg.budget ||
        got->n_outlier_chunks != cfg.n_outlier_chunks || got->n_local_chunks != cfg.n_local_chunks ||
        got->batch_size != cfg.batch_size || got->max_prompt_len != cfg.max_prompt_len ||
        got->gen_capacity != cfg.gen_capacity || got->backend != cfg.backend ||
        got->rope.rotary_dim != cfg.rope.rotary_dim || got->rope.interleaved != cfg.rope.interleaved ||
        got->rope.llama3_scaling != cfg.rope.llama3_scaling || !same_float(got->rope.theta, cfg.rope.theta) ||
        !same_float(got->attn_scale, cfg.attn_scale))
        skvf_fail("skv_cache_config differs from the config the cache was created from");
    const char *le = skv_cache_last_error(cache);
    if (!le || *le) skvf_fail("skv_cache_last_error of a fresh cache is not \"\"");
    /* a fresh cache: nothing prefilled, every introspection call defined, nothing changes */
    uint64_t fp = skvf_fingerprint(cache);
    skv_seq_info in;
    int32_t l = (int32_t)skvf_range(&d, -1, cfg.n_layers), b = (int32_t)skvf_range(&d, -1, cfg.batch_size);
    skv_status si = skv_cache_seq_info(cache, l, b, &in);
    skvf_check_status(si, "skv_cache_seq_info");
    int in_range = l >= 0 && l < cfg.n_layers && b >= 0 && b < cfg.batch_size;
    if (in_range ? (si != SKV_OK || in.prefilled) : si != SKV_ERR_INVALID_ARGUMENT)
        skvf_fail("skv_cache_seq_info(%d, %d) of a fresh cache: status %d", l, b, (int)si);
    skv_stats stt;
    if (skv_cache_stats(cache, &stt) != SKV_OK || stt.n_prefill_calls || stt.n_decode_calls)
        skvf_fail("skv_cache_stats of a fresh cache");
    if (skv_cache_sync(cache) != SKV_OK) skvf_fail("skv_cache_sync of a fresh ref/cpu cache");
    if (skvf_fingerprint(cache) != fp) skvf_fail("read-only calls changed a fresh cache");
    skv_cache_free(cache);
    skv_cache_free(NULL);
    return 0;
}
