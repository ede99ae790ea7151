/*
 * fuzz_common.c - the data producer, invariants and cache fingerprint shared
 * by the harnesses (see fuzz_common.h).
 */
#include "fuzz_common.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- data producer ------------------------------------------------------------------ */

void skvf_init(skvf_data *d, const uint8_t *data, size_t size)
{
    /* A backend forced from the environment would turn ref-vs-cpu comparisons into
       self-comparisons and make runs depend on the shell: every harness ignores it. */
    static int env_cleared;
    if (!env_cleared) {
        unsetenv("SKV_BACKEND");
        env_cleared = 1;
    }
    d->p = size ? data : NULL;
    d->n = size;
}

/* Up to 8 bytes, little-endian; missing bytes read as 0. */
static uint64_t take(skvf_data *d, size_t bytes)
{
    uint64_t v = 0;
    size_t k = bytes < d->n ? bytes : d->n;
    if (k == 0) return 0; /* d->p may be NULL: no pointer arithmetic on it */
    for (size_t i = 0; i < k; i++) v |= (uint64_t)d->p[i] << (8 * i);
    d->p += k;
    d->n -= k;
    return v;
}

uint64_t skvf_u64(skvf_data *d) { return take(d, 8); }
uint32_t skvf_u32(skvf_data *d) { return (uint32_t)take(d, 4); }
uint8_t skvf_u8(skvf_data *d) { return (uint8_t)take(d, 1); }
int skvf_bool(skvf_data *d) { return (int)(take(d, 1) & 1); }

int64_t skvf_range(skvf_data *d, int64_t lo, int64_t hi)
{
    if (hi <= lo) return lo;
    uint64_t span = (uint64_t)hi - (uint64_t)lo; /* hi - lo, no signed overflow */
    /* read only as many bytes as the span needs, so structure stays dense */
    size_t bytes = span < 0x100u ? 1 : span < 0x10000u ? 2 : span < 0x100000000u ? 4 : 8;
    uint64_t v = take(d, bytes);
    if (span != UINT64_MAX) v %= span + 1;
    return (int64_t)((uint64_t)lo + v);
}

int64_t skvf_pick(skvf_data *d, const int64_t *list, int n)
{
    if (n <= 0) return 0;
    return list[skvf_range(d, 0, n - 1)];
}

int32_t skvf_wild_i32(skvf_data *d)
{
    static const int64_t special[] = {0,         1,         -1,         2,          -2,
                                      3,         7,         8,          16,         64,
                                      128,       1024,      1025,       4096,       4097,
                                      65536,     65537,     1 << 24,    (1 << 24) + 1,
                                      INT32_MAX, INT32_MIN, INT32_MAX - 1, INT32_MIN + 1,
                                      1 << 30,   -(1 << 30)};
    switch (skvf_u8(d) & 3) {
    case 0:
    case 1: return (int32_t)skvf_pick(d, special, (int)(sizeof special / sizeof special[0]));
    case 2: return (int32_t)skvf_range(d, -16, 300);
    default: return (int32_t)skvf_u32(d);
    }
}

float skvf_float(skvf_data *d)
{
    static const float special[] = {0.0f, -0.0f, 1.0f, -1.0f, 1e-40f, -1e-40f, 1e-30f,
                                    1e30f, -1e30f, 3.0e38f, 65504.0f, 0.5f, 2.0f};
    uint8_t sel = skvf_u8(d);
    if (sel < 160) return (float)(int16_t)skvf_range(d, INT16_MIN, INT16_MAX) / 256.0f;
    if (sel < 220) return special[skvf_range(d, 0, (int)(sizeof special / sizeof special[0]) - 1)];
    if (sel < 230) return INFINITY;
    if (sel < 240) return -INFINITY;
    if (sel < 250) return NAN;
    /* any bit pattern */
    uint32_t bits = skvf_u32(d);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static uint64_t mix64(uint64_t *s)
{
    /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A roughly normal value in about [-3, 3] (Irwin-Hall of 4 uniforms). */
static float rnd_normal(uint64_t *s)
{
    uint64_t z = mix64(s);
    float acc = 0.0f;
    for (int i = 0; i < 4; i++) acc += (float)((z >> (16 * i)) & 0xFFFF) / 65535.0f;
    return (acc - 2.0f) * 1.7320508f;
}

static int bf16_finite(skv_bf16 x) { return (x & 0x7F80) != 0x7F80; }

void skvf_fill_bf16(skvf_data *d, skv_bf16 *x, size_t n, int allow_bad)
{
    static const float scales[] = {1.0f, 0.01f, 100.0f, 1e-3f, 30.0f, 1e4f};
    if (!x || n == 0) return;
    uint8_t pattern = skvf_u8(d) % 6;
    float scale = scales[skvf_range(d, 0, (int)(sizeof scales / sizeof scales[0]) - 1)];
    uint64_t seed = skvf_u32(d);
    switch (pattern) {
    case 0:
    case 1: /* normal-ish noise (the common case) */
        for (size_t i = 0; i < n; i++) x[i] = skv_bf16_from_float(scale * rnd_normal(&seed));
        break;
    case 2: { /* constant: every score ties */
        skv_bf16 c = skv_bf16_from_float(scale * rnd_normal(&seed));
        for (size_t i = 0; i < n; i++) x[i] = c;
        break;
    }
    case 3: { /* ramp */
        float step = scale / (float)(n > 1 ? n : 1);
        float off = -0.5f * scale;
        for (size_t i = 0; i < n; i++) x[i] = skv_bf16_from_float(off + step * (float)i);
        break;
    }
    case 4: { /* a short period repeated: copies of earlier rows, exact ties */
        size_t period = (size_t)skvf_range(d, 1, 256);
        for (size_t i = 0; i < n; i++)
            x[i] = i < period ? skv_bf16_from_float(scale * rnd_normal(&seed)) : x[i - period];
        break;
    }
    default: /* raw bytes of the input, cycled (zero when it is used up) */
        for (size_t i = 0; i < n; i++) {
            skv_bf16 b = (skv_bf16)take(d, 2);
            x[i] = (allow_bad || bf16_finite(b)) ? b : (skv_bf16)(b & 0xBFFF);
        }
        break;
    }
    if (allow_bad) {
        /* plant up to 3 NaN/Inf at carved positions, sometimes the first/last element */
        static const skv_bf16 bad[4] = {0x7FC0, 0xFFC1, 0x7F80, 0xFF80};
        int k = skvf_u8(d) < 200 ? 0 : (int)skvf_range(d, 1, 3);
        for (int i = 0; i < k; i++) {
            size_t pos;
            switch (skvf_u8(d) & 3) {
            case 0: pos = 0; break;
            case 1: pos = n - 1; break;
            default: pos = (size_t)skvf_range(d, 0, (int64_t)n - 1); break;
            }
            x[pos] = bad[skvf_u8(d) & 3];
        }
    }
}

skv_backend skvf_backend(skvf_data *d) { return skvf_bool(d) ? SKV_BACKEND_CPU : SKV_BACKEND_REF; }

/* ---- invariants ---------------------------------------------------------------------- */

void skvf_fail(const char *fmt, ...)
{
    va_list ap;
    fputs("fuzz invariant violated: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    fflush(stderr);
    abort();
}

void skvf_check_status(skv_status st, const char *what)
{
    if ((int)st < 0 || (int)st >= SKV_STATUS_COUNT)
        skvf_fail("%s: status %d is not a defined skv_status", what, (int)st);
    const char *s = skv_status_string(st);
    if (!s || !*s) skvf_fail("%s: skv_status_string(%d) is empty", what, (int)st);
    if (st != SKV_OK) {
        const char *msg = skv_last_error();
        if (!msg || !*msg) skvf_fail("%s: failed with %s but skv_last_error() is empty", what, s);
    }
}

#define GUARD 64
#define GUARD_HDR 64 /* holds the size; keeps the user pointer 64-byte aligned */
#define GUARD_BYTE 0xA5

void *skvf_guarded_alloc(size_t bytes)
{
    if (bytes > SIZE_MAX - GUARD_HDR - 2 * GUARD) skvf_fail("guarded_alloc(%zu): too large", bytes);
    unsigned char *b = malloc(GUARD_HDR + 2 * GUARD + bytes);
    if (!b) skvf_fail("guarded_alloc(%zu): out of memory", bytes);
    memset(b, 0, GUARD_HDR);
    memcpy(b, &bytes, sizeof bytes);
    memset(b + GUARD_HDR, GUARD_BYTE, GUARD);
    memset(b + GUARD_HDR + GUARD, 0, bytes);
    memset(b + GUARD_HDR + GUARD + bytes, GUARD_BYTE, GUARD);
    return b + GUARD_HDR + GUARD;
}

void skvf_guarded_check(const void *p, const char *what)
{
    if (!p) return;
    const unsigned char *u = p, *b = u - GUARD - GUARD_HDR;
    size_t bytes;
    memcpy(&bytes, b, sizeof bytes);
    for (size_t i = 0; i < GUARD; i++) {
        if (b[GUARD_HDR + i] != GUARD_BYTE)
            skvf_fail("%s: canary before the buffer overwritten at byte -%zu", what, GUARD - i);
        if (u[bytes + i] != GUARD_BYTE)
            skvf_fail("%s: canary after the buffer (%zu bytes) overwritten at byte +%zu", what, bytes, i);
    }
}

void skvf_guarded_free(void *p, const char *what)
{
    if (!p) return;
    skvf_guarded_check(p, what);
    free((unsigned char *)p - GUARD - GUARD_HDR);
}

/* ---- cache fingerprint ----------------------------------------------------------------- */

typedef struct fnv { uint64_t h; } fnv;

static void fnv_bytes(fnv *f, const void *x, size_t n)
{
    const unsigned char *p = x;
    for (size_t i = 0; i < n; i++) {
        f->h ^= p[i];
        f->h *= 0x100000001B3ull;
    }
}

static void fnv_i64(fnv *f, int64_t v) { fnv_bytes(f, &v, sizeof v); }

static void fnv_f32(fnv *f, float v)
{
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    fnv_i64(f, b);
}

static void fnv_config(fnv *f, const skv_config *c)
{
    /* field by field: padding bytes are not observable */
    fnv_i64(f, c->n_layers);
    fnv_i64(f, c->n_q_heads);
    fnv_i64(f, c->n_kv_heads);
    fnv_i64(f, c->head_dim);
    fnv_i64(f, c->rank);
    fnv_i64(f, c->chunk_size);
    fnv_i64(f, c->budget);
    fnv_i64(f, c->n_outlier_chunks);
    fnv_i64(f, c->n_local_chunks);
    fnv_f32(f, c->rope.theta);
    fnv_i64(f, c->rope.rotary_dim);
    fnv_i64(f, c->rope.interleaved);
    fnv_i64(f, c->rope.llama3_scaling);
    fnv_f32(f, c->rope.scaling_factor);
    fnv_f32(f, c->rope.low_freq_factor);
    fnv_f32(f, c->rope.high_freq_factor);
    fnv_i64(f, c->rope.original_max_position);
    fnv_f32(f, c->attn_scale);
    fnv_i64(f, c->batch_size);
    fnv_i64(f, c->max_prompt_len);
    fnv_i64(f, c->gen_capacity);
    fnv_i64(f, (int64_t)c->backend);
    fnv_i64(f, c->n_threads);
    fnv_i64(f, (int64_t)(intptr_t)c->cuda_stream);
}

/* An introspection call's status and, on success, its count outputs. */
static void fnv_ids(fnv *f, skv_status st, const int32_t *ids, int64_t count)
{
    fnv_i64(f, st);
    if (st == SKV_OK && count > 0) fnv_bytes(f, ids, (size_t)count * sizeof *ids);
}

uint64_t skvf_fingerprint(skv_cache *cache)
{
    fnv f = {0xCBF29CE484222325ull};
    if (!cache) return f.h;
    const skv_config *cfg = skv_cache_config(cache);
    if (!cfg) skvf_fail("fingerprint: skv_cache_config returned NULL");
    fnv_config(&f, cfg);
    fnv_i64(&f, (int64_t)skv_cache_backend(cache));
    /* The largest chunk count any (layer, seq) can have, bounded so a fingerprint of a
       bigger cache than the harnesses make cannot blow up. */
    int64_t max_chunks = cfg->max_prompt_len / cfg->chunk_size + 1;
    if (max_chunks > (1 << 16)) max_chunks = 1 << 16;
    size_t nid = (size_t)max_chunks;
    size_t nlm = nid * (size_t)cfg->head_dim;
    int32_t *ids = malloc(nid * sizeof *ids);
    skv_bf16 *lm = malloc(nlm * sizeof *lm);
    if (!ids || !lm) skvf_fail("fingerprint: out of memory");
    for (int32_t l = 0; l < cfg->n_layers; l++)
        for (int32_t b = 0; b < cfg->batch_size; b++) {
            skv_seq_info in;
            memset(&in, 0, sizeof in);
            skv_status st = skv_cache_seq_info(cache, l, b, &in);
            skvf_check_status(st, "fingerprint: skv_cache_seq_info");
            if (st != SKV_OK) skvf_fail("fingerprint: seq_info(%d, %d) failed: %s", l, b, skv_last_error());
            fnv_i64(&f, in.prefilled);
            fnv_i64(&f, in.n);
            fnv_i64(&f, in.n_chunks);
            fnv_i64(&f, in.n_candidates);
            fnv_i64(&f, in.n_outliers);
            fnv_i64(&f, in.n_selected);
            fnv_i64(&f, in.n_local);
            fnv_i64(&f, in.n_generated);
            fnv_i64(&f, in.has_selection);
            if (in.prefilled && (in.n_chunks < 0 || in.n_chunks > max_chunks || in.n_candidates < 0 ||
                                 in.n_candidates > in.n_chunks || in.n_outliers < 0 ||
                                 in.n_outliers > in.n_chunks || in.n_selected < 0 ||
                                 in.n_selected > in.n_candidates))
                skvf_fail("fingerprint: seq_info(%d, %d) inconsistent: n = %lld N = %d cand = %d O = %d S = %d",
                          l, b, (long long)in.n, in.n_chunks, in.n_candidates, in.n_outliers,
                          in.n_selected);
            for (int32_t h = 0; h < cfg->n_kv_heads; h++) {
                st = skv_cache_outliers(cache, l, b, h, ids);
                skvf_check_status(st, "fingerprint: skv_cache_outliers");
                fnv_ids(&f, st, ids, in.n_outliers);
                st = skv_cache_candidates(cache, l, b, h, ids);
                skvf_check_status(st, "fingerprint: skv_cache_candidates");
                fnv_ids(&f, st, ids, in.n_candidates);
                st = skv_cache_landmarks(cache, l, b, h, lm);
                skvf_check_status(st, "fingerprint: skv_cache_landmarks");
                fnv_i64(&f, st);
                if (st == SKV_OK && in.n_candidates > 0)
                    fnv_bytes(&f, lm, (size_t)in.n_candidates * (size_t)cfg->head_dim * sizeof *lm);
                st = skv_cache_selected(cache, l, b, h, ids);
                skvf_check_status(st, "fingerprint: skv_cache_selected");
                fnv_ids(&f, st, ids, in.n_selected);
            }
        }
    free(ids);
    free(lm);
    skv_stats s;
    memset(&s, 0, sizeof s);
    skv_status st = skv_cache_stats(cache, &s);
    skvf_check_status(st, "fingerprint: skv_cache_stats");
    fnv_i64(&f, st);
    fnv_i64(&f, s.n_prefill_calls);
    fnv_i64(&f, s.n_decode_calls);
    return f.h;
}

skv_config skvf_small_config(skvf_data *d)
{
    static const int64_t dims[] = {8, 16, 32, 64};
    static const int64_t chunks[] = {1, 2, 4, 8};
    static const int64_t thetas[] = {10000, 500000, 3, 1000000};
    skv_config c = skv_config_default();
    c.n_layers = (int32_t)skvf_range(d, 1, 2);
    c.batch_size = (int32_t)skvf_range(d, 1, 2);
    c.n_kv_heads = (int32_t)skvf_range(d, 1, 2);
    c.n_q_heads = c.n_kv_heads * (int32_t)skvf_range(d, 1, 4);
    c.head_dim = (int32_t)skvf_pick(d, dims, 4);
    c.chunk_size = (int32_t)skvf_pick(d, chunks, 4);
    int32_t S = (int32_t)skvf_range(d, 1, 8);
    c.budget = S * c.chunk_size;
    c.n_outlier_chunks = (int32_t)skvf_range(d, 0, 4);
    c.n_local_chunks = (int32_t)skvf_range(d, 0, 2);
    int64_t minp = skvf_min_prompt(&c);
    int64_t maxp = minp + 128 > 512 ? 512 : minp + 128;
    c.max_prompt_len = skvf_range(d, minp, maxp);
    int64_t rmax = (int64_t)c.n_kv_heads * c.head_dim;
    if (rmax > minp) rmax = minp;
    if (rmax > 16) rmax = 16;
    c.rank = (int32_t)skvf_range(d, 1, rmax);
    c.gen_capacity = (int32_t)skvf_range(d, 1, 4);
    c.rope.theta = (float)skvf_pick(d, thetas, 4);
    c.rope.rotary_dim = 2 * (int32_t)skvf_range(d, 0, c.head_dim / 2);
    c.rope.interleaved = skvf_bool(d);
    c.rope.llama3_scaling = skvf_bool(d);
    if (c.rope.llama3_scaling) c.rope.original_max_position = (int32_t)skvf_range(d, 1, 1024);
    c.attn_scale = skvf_bool(d) ? 0.0f : (float)skvf_range(d, 1, 64) / 32.0f;
    c.n_threads = (int32_t)skvf_range(d, 0, 2);
    c.backend = skvf_backend(d);
    return c;
}

int64_t skvf_min_prompt(const skv_config *cfg)
{
    /* defined for wild configs too: 0 when a field is out of the valid range */
    if (!cfg || cfg->chunk_size < 1 || cfg->chunk_size > 4096 || cfg->budget < 0 ||
        cfg->n_outlier_chunks < 0 || cfg->n_local_chunks < 0)
        return 0;
    int64_t S = cfg->budget / cfg->chunk_size;
    return ((int64_t)cfg->n_outlier_chunks + S + cfg->n_local_chunks) * cfg->chunk_size;
}

skv_cache *skvf_small_cache(skvf_data *d, skv_config *cfg)
{
    *cfg = skvf_small_config(d);
    skv_cache *cache = NULL;
    skv_status st = skv_cache_create(cfg, &cache);
    skvf_check_status(st, "skv_cache_create");
    if (st != SKV_OK) skvf_fail("skv_cache_create of a small valid config: %s", skv_last_error());
    return cache;
}
