/*
 * The stable ABI (shadowkv.h): the version query agrees with the header, a config
 * carries the size its caller was compiled with (struct_size), sizes no skv_config
 * ever had are refused with nothing written, and the output structs are written up
 * to the caller's size only (a larger caller struct is zero-filled past ours, a
 * byte past the caller's size is never touched). Also: the cuda table is there on
 * every build and answers with SKV_OK or SKV_ERR_NO_DEVICE and a reason.
 */
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

#include "testutil.h"

static skv_config small_config(void)
{
    skv_config c = skv_config_default();
    c.n_layers = 1;
    c.n_q_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 32;
    c.rank = 8;
    c.budget = 32;
    c.n_outlier_chunks = 2;
    c.n_local_chunks = 1;
    c.max_prompt_len = 256;
    c.gen_capacity = 4;
    c.backend = SKV_BACKEND_REF;
    return c;
}

/* A cache created (on ref) from a config of an older, smaller struct_size, with garbage past the
   caller's struct: validation and create must read only `size` bytes. NULL (a failed check) if not. */
static skv_cache *older_caller(size_t size, const char *version)
{
    skv_config b = small_config();
    b.backend = SKV_BACKEND_REF;
    b.struct_size = size;
    memset((char *)&b + size, 0x5A, sizeof b - size);
    skv_cache *k = NULL;
    char what[64];
    snprintf(what, sizeof what, "validate(%s size, garbage past it)", version);
    SKVT_CHECK_STATUS(skv_config_validate(&b), SKV_OK, what);
    snprintf(what, sizeof what, "create(%s size)", version);
    if (!SKVT_CHECK_STATUS(skv_cache_create(&b, &k), SKV_OK, what)) return NULL;
    return k;
}

int main(void)
{
    /* version: header and library agree, and the string spells the number */
    SKVT_CHECK(skv_version_number() == SKV_VERSION_NUMBER, "skv_version_number %u, header %d", skv_version_number(),
               SKV_VERSION_NUMBER);
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", SKV_VERSION_MAJOR, SKV_VERSION_MINOR, SKV_VERSION_PATCH);
    SKVT_CHECK(strcmp(skv_version_string(), want) == 0, "skv_version_string \"%s\", header %s",
               skv_version_string(), want);

    /* struct_size: set by the defaults, checked by every entry point */
    skv_config c = skv_config_default();
    SKVT_CHECK(c.struct_size == sizeof c, "skv_config_default().struct_size = %zu", c.struct_size);
    SKVT_CHECK(c.factorize == SKV_FACTORIZE_AUTO, "default factorize = %d", (int)c.factorize);
    c = small_config();
    SKVT_CHECK_STATUS(skv_config_validate(&c), SKV_OK, "validate(small)");
    /* a caller built against 0.1 passes the size of its skv_config, which ended at factorize:
       accepted, and the field it does not know (reproducible) takes its default */
    {
        const size_t old_size = offsetof(skv_config, reproducible);
        unsigned char raw[sizeof(skv_config) + 16];
        memset(raw, 0xA5, sizeof raw);
        SKVT_CHECK_STATUS(skv_config_init((skv_config *)raw, old_size), SKV_OK, "skv_config_init(0.1 size)");
        int untouched = 1;
        for (size_t j = old_size; j < sizeof raw; j++) untouched &= raw[j] == 0xA5;
        SKVT_CHECK(untouched, "skv_config_init(0.1 size) wrote past the caller's %zu bytes", old_size);
        skv_config b = small_config();
        b.struct_size = old_size;
        b.reproducible = 77; /* past the caller's struct: never read */
        SKVT_CHECK_STATUS(skv_config_validate(&b), SKV_OK, "validate(0.1 size, garbage past it)");
        b.struct_size = sizeof b;
        SKVT_CHECK_STATUS(skv_config_validate(&b), SKV_ERR_INVALID_CONFIG, "validate(reproducible = 77)");
        SKVT_CHECK(strstr(skv_last_error(), "reproducible") != NULL, "message names reproducible: %s",
                   skv_last_error());
        b.reproducible = 1;
        b.factorize = SKV_FACTORIZE_FAST;
        SKVT_CHECK_STATUS(skv_config_validate(&b), SKV_ERR_INVALID_CONFIG, "validate(reproducible with FAST)");
        b.factorize = SKV_FACTORIZE_CANONICAL;
        SKVT_CHECK_STATUS(skv_config_validate(&b), SKV_OK, "validate(reproducible with CANONICAL)");
    }
    /* a caller built against 0.2: its skv_config ended at reproducible (padded to the struct's
       alignment); accepted, and the 0.3 fields it does not know take their defaults */
    {
        const size_t al = _Alignof(skv_config);
        const size_t v02 = (offsetof(skv_config, select_mode) + al - 1) / al * al;
        unsigned char raw[sizeof(skv_config) + 16];
        memset(raw, 0xA5, sizeof raw);
        SKVT_CHECK_STATUS(skv_config_init((skv_config *)raw, v02), SKV_OK, "skv_config_init(0.2 size)");
        int untouched = 1;
        for (size_t j = v02; j < sizeof raw; j++) untouched &= raw[j] == 0xA5;
        SKVT_CHECK(untouched, "skv_config_init(0.2 size) wrote past the caller's %zu bytes", v02);
        skv_config b = small_config();
        b.struct_size = v02;
        memset((char *)&b + v02, 0xA5, sizeof b - v02); /* past the caller's struct: never read */
        SKVT_CHECK_STATUS(skv_config_validate(&b), SKV_OK, "validate(0.2 size, garbage past it)");
        skv_cache *k = NULL;
        b.backend = SKV_BACKEND_REF;
        SKVT_CHECK_STATUS(skv_cache_create(&b, &k), SKV_OK, "create(0.2 size)");
        if (k) {
            const skv_config *got = skv_cache_config(k);
            SKVT_CHECK(got->select_mode == SKV_SELECT_FIXED && got->select_mass == 0.95f &&
                           got->select_min_chunks == 0 && got->dense_layers == 0 && got->rank_max == 0 &&
                           got->rank_error_target == 0.1f,
                       "0.2 caller: the 0.3 fields take their defaults");
            skv_cache_free(k);
        }
        SKVT_CHECK_STATUS(skv_config_init((skv_config *)raw, v02 + 4), SKV_ERR_INVALID_ARGUMENT,
                          "skv_config_init(0.2 size + 4: no published skv_config)");
    }
    const size_t bad_sizes[] = {0, 1, offsetof(skv_config, reproducible) - 1, sizeof c - 1, sizeof c + 8,
                                (size_t)-1};
    for (size_t i = 0; i < sizeof bad_sizes / sizeof bad_sizes[0]; i++) {
        skv_config b = small_config();
        b.struct_size = bad_sizes[i];
        size_t dev = 7, host = 7;
        skv_cache *cache = (skv_cache *)&b;
        SKVT_CHECK_STATUS(skv_config_validate(&b), SKV_ERR_INVALID_CONFIG, "validate(struct_size bad)");
        SKVT_CHECK(strstr(skv_last_error(), "struct_size") != NULL, "message names struct_size: %s",
                   skv_last_error());
        SKVT_CHECK_STATUS(skv_cache_memory(&b, &dev, &host), SKV_ERR_INVALID_CONFIG, "memory(struct_size bad)");
        SKVT_CHECK(dev == 7 && host == 7, "memory wrote outputs on error");
        SKVT_CHECK_STATUS(skv_cache_create(&b, &cache), SKV_ERR_INVALID_CONFIG, "create(struct_size bad)");
        SKVT_CHECK(cache == NULL, "create left *out set on error");
        /* skv_config_init refuses the size and writes nothing */
        unsigned char raw[sizeof(skv_config) + 16];
        memset(raw, 0xA5, sizeof raw);
        if (bad_sizes[i] <= sizeof raw) {
            SKVT_CHECK_STATUS(skv_config_init((skv_config *)raw, bad_sizes[i]), SKV_ERR_INVALID_ARGUMENT,
                              "skv_config_init(bad size)");
            int untouched = 1;
            for (size_t j = 0; j < sizeof raw; j++) untouched &= raw[j] == 0xA5;
            SKVT_CHECK(untouched, "skv_config_init wrote on a refused size %zu", bad_sizes[i]);
        }
    }
    SKVT_CHECK_STATUS(skv_config_init(NULL, sizeof c), SKV_ERR_NULL_POINTER, "skv_config_init(NULL)");
    /* cuda_prefill_sms (0.5, appended in the padding after pool_page_bytes): 0 by default, >= 0 */
    {
        skv_config g = small_config();
        SKVT_CHECK(skv_config_default().cuda_prefill_sms == 0, "default cuda_prefill_sms = %d",
                   skv_config_default().cuda_prefill_sms);
        g.cuda_prefill_sms = 16;
        SKVT_CHECK_STATUS(skv_config_validate(&g), SKV_OK, "validate(cuda_prefill_sms = 16)");
        g.cuda_prefill_sms = -1;
        SKVT_CHECK_STATUS(skv_config_validate(&g), SKV_ERR_INVALID_CONFIG, "validate(cuda_prefill_sms = -1)");
        SKVT_CHECK(strstr(skv_last_error(), "cuda_prefill_sms") != NULL, "message names cuda_prefill_sms: %s",
                   skv_last_error());
    }
    /* value_dtype (0.6): bf16 by default; a 0.5 caller (its struct ended at cuda_prefill_sms) gets bf16
       values whatever lies past its struct; an unknown dtype is refused, the message naming the field */
    {
        const size_t al = _Alignof(skv_config);
        const size_t v05 = (offsetof(skv_config, value_dtype) + al - 1) / al * al;
        SKVT_CHECK(skv_config_default().value_dtype == SKV_VALUE_BF16, "default value_dtype = %d",
                   (int)skv_config_default().value_dtype);
        skv_cache *k = older_caller(v05, "0.5");
        if (k) {
            SKVT_CHECK(skv_cache_config(k)->value_dtype == SKV_VALUE_BF16, "0.5 caller: value_dtype %d",
                       (int)skv_cache_config(k)->value_dtype);
            skv_cache_free(k);
        }
        skv_config g = small_config();
        g.value_dtype = SKV_VALUE_FP8;
        SKVT_CHECK_STATUS(skv_config_validate(&g), SKV_OK, "validate(value_dtype = FP8)");
        for (int bad = -1; bad <= 2; bad += 3) {
            g.value_dtype = (skv_value_dtype)bad;
            SKVT_CHECK_STATUS(skv_config_validate(&g), SKV_ERR_INVALID_CONFIG, bad < 0 ? "validate(value_dtype = -1)"
                                                                                       : "validate(value_dtype = 2)");
            SKVT_CHECK(strstr(skv_last_error(), "value_dtype") != NULL, "message names value_dtype: %s",
                       skv_last_error());
        }
    }
    /* the head shard and cuda_device (0.7): a 0.6 caller (its struct ended at value_dtype) gets no shard
       and the current device whatever lies past its struct; a shard outside the model's KV heads, a begin
       without model_kv_heads and a device below -1 are refused, the message naming the field */
    {
        const size_t al = _Alignof(skv_config);
        const size_t v06 = (offsetof(skv_config, model_kv_heads) + al - 1) / al * al;
        const skv_config d = skv_config_default();
        SKVT_CHECK(d.model_kv_heads == 0 && d.kv_head_begin == 0 && d.cuda_device == -1,
                   "defaults: model_kv_heads %d, kv_head_begin %d, cuda_device %d", d.model_kv_heads, d.kv_head_begin,
                   d.cuda_device);
        skv_cache *k = older_caller(v06, "0.6");
        if (k) {
            const skv_config *kc = skv_cache_config(k);
            SKVT_CHECK(kc->model_kv_heads == 0 && kc->kv_head_begin == 0 && kc->cuda_device == -1,
                       "0.6 caller on ref: model_kv_heads %d, kv_head_begin %d, cuda_device %d", kc->model_kv_heads,
                       kc->kv_head_begin, kc->cuda_device);
            skv_cache_free(k);
        }
        const skv_config s0 = small_config();
        struct { int32_t model, begin, dev; skv_status want; const char *field; } cases[] = {
            {s0.n_kv_heads, 0, -1, SKV_OK, NULL},
            {4 * s0.n_kv_heads, 3 * s0.n_kv_heads, 0, SKV_OK, NULL},
            {4 * s0.n_kv_heads, 1, 7, SKV_OK, NULL},
            {0, 1, -1, SKV_ERR_INVALID_CONFIG, "kv_head_begin"},
            {-1, 0, -1, SKV_ERR_INVALID_CONFIG, "model_kv_heads"},
            {s0.n_kv_heads - 1, 0, -1, SKV_ERR_INVALID_CONFIG, "head shard"},
            {4 * s0.n_kv_heads, 3 * s0.n_kv_heads + 1, -1, SKV_ERR_INVALID_CONFIG, "head shard"},
            {4 * s0.n_kv_heads, -1, -1, SKV_ERR_INVALID_CONFIG, "head shard"},
            {0, 0, -2, SKV_ERR_INVALID_CONFIG, "cuda_device"},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            skv_config g = small_config();
            g.model_kv_heads = cases[i].model, g.kv_head_begin = cases[i].begin, g.cuda_device = cases[i].dev;
            char what[96];
            snprintf(what, sizeof what, "validate(model_kv_heads %d, kv_head_begin %d, cuda_device %d)",
                     cases[i].model, cases[i].begin, cases[i].dev);
            SKVT_CHECK_STATUS(skv_config_validate(&g), cases[i].want, what);
            if (cases[i].field)
                SKVT_CHECK(strstr(skv_last_error(), cases[i].field) != NULL, "%s: message names %s: %s", what,
                           cases[i].field, skv_last_error());
        }
    }
    /* a refused factorize route */
    skv_config f = small_config();
    f.factorize = (skv_factorize_route)7;
    SKVT_CHECK_STATUS(skv_config_validate(&f), SKV_ERR_INVALID_CONFIG, "validate(factorize = 7)");

    /* output structs: written up to the caller's size */
    skv_cache *cache = NULL;
    c = small_config();
    if (SKVT_CHECK_STATUS(skv_cache_create(&c, &cache), SKV_OK, "create")) {
        unsigned char buf[sizeof(skv_stats) + 32];
        memset(buf, 0xA5, sizeof buf);
        SKVT_CHECK_STATUS(skv_cache_stats_sized(cache, (skv_stats *)buf, sizeof(skv_stats) + 16), SKV_OK,
                          "stats_sized(larger)");
        int ok = 1;
        for (size_t j = sizeof(skv_stats); j < sizeof(skv_stats) + 16; j++) ok &= buf[j] == 0;
        for (size_t j = sizeof(skv_stats) + 16; j < sizeof buf; j++) ok &= buf[j] == 0xA5;
        SKVT_CHECK(ok, "stats_sized: the caller's tail is zeroed and nothing past it written");
        SKVT_CHECK_STATUS(skv_cache_stats_sized(cache, (skv_stats *)buf, sizeof(skv_stats) - 8),
                          SKV_ERR_INVALID_ARGUMENT, "stats_sized(smaller than the first skv_stats)");
        unsigned char ib[sizeof(skv_seq_info) + 8];
        memset(ib, 0xA5, sizeof ib);
        SKVT_CHECK_STATUS(skv_cache_seq_info_sized(cache, 0, 0, (skv_seq_info *)ib, sizeof(skv_seq_info)), SKV_OK,
                          "seq_info_sized");
        ok = 1;
        for (size_t j = sizeof(skv_seq_info); j < sizeof ib; j++) ok &= ib[j] == 0xA5;
        SKVT_CHECK(ok, "seq_info_sized wrote past the caller's size");
        /* a caller built against 0.2: its skv_seq_info ended at values_on_device */
        const size_t al = _Alignof(skv_seq_info), v02 = (offsetof(skv_seq_info, rank) + al - 1) / al * al;
        memset(ib, 0xA5, sizeof ib);
        SKVT_CHECK_STATUS(skv_cache_seq_info_sized(cache, 0, 0, (skv_seq_info *)ib, v02), SKV_OK, "seq_info_sized(0.2)");
        ok = 1;
        for (size_t j = v02; j < sizeof ib; j++) ok &= ib[j] == 0xA5;
        SKVT_CHECK(ok, "seq_info_sized(0.2 size) wrote past the caller's size");
        SKVT_CHECK_STATUS(skv_cache_seq_info_sized(cache, 0, 0, (skv_seq_info *)ib, v02 - 4), SKV_ERR_INVALID_ARGUMENT,
                          "seq_info_sized(below the first skv_seq_info)");
        skv_layer_stats ls;
        SKVT_CHECK_STATUS(skv_cache_layer_stats(cache, 0, &ls), SKV_OK, "layer_stats");
        SKVT_CHECK_STATUS(skv_cache_layer_stats_sized(cache, 0, &ls, sizeof ls - 8), SKV_ERR_INVALID_ARGUMENT,
                          "layer_stats_sized(smaller)");
        SKVT_CHECK_STATUS(skv_cache_layer_stats(cache, c.n_layers, &ls), SKV_ERR_INVALID_ARGUMENT, "layer_stats(layer)");
        SKVT_CHECK_STATUS(skv_cache_layer_stats(cache, 0, NULL), SKV_ERR_NULL_POINTER, "layer_stats(NULL)");
        skv_cache_free(cache);
    }
    unsigned char mb[sizeof(skv_memory_info) + 8];
    memset(mb, 0xA5, sizeof mb);
    SKVT_CHECK_STATUS(skv_cache_memory_info_sized(&c, (skv_memory_info *)mb, sizeof(skv_memory_info) + 8), SKV_OK,
                      "memory_info_sized(larger)");
    SKVT_CHECK(mb[sizeof(skv_memory_info)] == 0 && mb[sizeof mb - 1] == 0, "memory_info_sized: tail not zeroed");
    SKVT_CHECK_STATUS(skv_cache_memory_info_sized(&c, (skv_memory_info *)mb, 4), SKV_ERR_INVALID_ARGUMENT,
                      "memory_info_sized(4 bytes)");

    /* the route choice: refused outside the enum; every route prefills a cpu cache */
    {
        skv_bf16 a8[64];
        float u8[16], w8[16];
        for (int i = 0; i < 64; i++) a8[i] = skv_bf16_from_float((float)((i * 37) % 11) - 5.0f);
        SKVT_CHECK_STATUS(skv_op_factorize_route(SKV_BACKEND_CPU, (skv_factorize_route)5, 8, 8, 2, a8, u8, w8),
                          SKV_ERR_INVALID_ARGUMENT, "skv_op_factorize_route(route 5)");
        skvt_rng rng;
        uint64_t seed = skvt_base_seed("test_abi");
        skvt_rng_seed(&rng, seed);
        const int64_t n = 200;
        skv_config rc = small_config();
        rc.backend = SKV_BACKEND_CPU;
        const size_t row = (size_t)rc.n_kv_heads * rc.head_dim;
        skv_bf16 *k = malloc(sizeof *k * n * row), *v = malloc(sizeof *v * n * row);
        skvt_lowrank_prompt(&rng, row, n, k, v);
        for (int route = SKV_FACTORIZE_AUTO; route <= SKV_FACTORIZE_EXACT; route++) {
            rc.factorize = (skv_factorize_route)route;
            skv_cache *rcache = NULL;
            if (!SKVT_CHECK_STATUS(skv_cache_create(&rc, &rcache), SKV_OK, "create(route)")) continue;
            SKVT_CHECK_STATUS(skv_prefill(rcache, 0, 0, n, k, v, NULL), SKV_OK, "prefill(route)");
            SKVT_CHECK(skv_cache_config(rcache)->factorize == (skv_factorize_route)route, "config keeps the route");
            skv_cache_free(rcache);
        }
        free(k);
        free(v);
    }

    /* the cpu SIMD level: an explicit choice wins over SKV_CPU_SIMD, and every level makes the
       same selections bit for bit */
    {
        const int32_t dflt = skv_cpu_simd_level();
        SKVT_CHECK_STATUS(skv_cpu_set_simd(3), SKV_ERR_INVALID_ARGUMENT, "skv_cpu_set_simd(3)");
        SKVT_CHECK(skv_cpu_simd_level() == dflt, "a refused level changed the SIMD level");
        SKVT_CHECK_STATUS(skv_cpu_set_simd(0), SKV_OK, "skv_cpu_set_simd(0)");
        SKVT_CHECK(skv_cpu_simd_level() == 0, "level after skv_cpu_set_simd(0): %d", (int)skv_cpu_simd_level());
        enum { HQ = 8, HK = 2, DD = 64, NC = 700, SS = 40 };
        skvt_rng rng;
        skvt_rng_seed(&rng, skvt_base_seed("test_abi simd"));
        skv_bf16 *q = malloc(sizeof *q * HQ * DD), *lm = malloc(sizeof *lm * HK * NC * DD);
        int32_t *sel[2] = {malloc(sizeof(int32_t) * HK * SS), malloc(sizeof(int32_t) * HK * SS)};
        float *amax[2] = {malloc(sizeof(float) * HK * NC), malloc(sizeof(float) * HK * NC)};
        skvt_fill_bf16_normal(&rng, q, HQ * DD, 1.0);
        skvt_fill_bf16_normal(&rng, lm, (size_t)HK * NC * DD, 1.0);
        for (int pass = 0; pass < 2; pass++) {
            if (pass) {
                SKVT_CHECK_STATUS(skv_cpu_set_simd(2), SKV_OK, "skv_cpu_set_simd(2)");
                SKVT_CHECK(skv_cpu_simd_level() >= dflt, "explicit level 2 gives %d, below the default %d",
                           (int)skv_cpu_simd_level(), (int)dflt);
            }
            SKVT_CHECK_STATUS(skv_op_score_select(SKV_BACKEND_CPU, HQ, HK, DD, NC, SS, 0.0f, q, lm, NULL, sel[pass],
                                                  NULL, amax[pass]),
                              SKV_OK, "score_select(cpu)");
        }
        printf("cpu SIMD: default level %d, explicit 2 gives %d\n", (int)dflt, (int)skv_cpu_simd_level());
        SKVT_CHECK(!memcmp(sel[0], sel[1], sizeof(int32_t) * HK * SS) && !memcmp(amax[0], amax[1], sizeof(float) * HK * NC),
                   "selections differ between the portable code and the SIMD code");
        SKVT_CHECK_STATUS(skv_cpu_set_simd(-1), SKV_OK, "skv_cpu_set_simd(-1)");
        SKVT_CHECK(skv_cpu_simd_level() == dflt, "level after skv_cpu_set_simd(-1): %d, default %d",
                   (int)skv_cpu_simd_level(), (int)dflt);
        free(q), free(lm), free(sel[0]), free(sel[1]), free(amax[0]), free(amax[1]);
    }

    /* the cuda table exists on every build: usable, or unusable with a reason */
    skv_status a = skv_backend_available(SKV_BACKEND_CUDA);
    SKVT_CHECK(a == SKV_OK || a == SKV_ERR_NO_DEVICE, "skv_backend_available(cuda) = %d", (int)a);
    if (a != SKV_OK) SKVT_CHECK(strlen(skv_last_error()) > 20, "cuda unavailable without a reason");
    printf("cuda: %s%s%s\n", skv_status_string(a), a ? " - " : "", a ? skv_last_error() : "");
    return skvt_finish();
}
