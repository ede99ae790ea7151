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

void skvf_clamp_magnitude(skv_bf16 *x, size_t n)
{
    for (size_t i = 0; x && i < n; i++)
        if ((x[i] & 0x7F80) != 0x7F80 && (x[i] & 0x7FFF) > 0x4F80) x[i] = (skv_bf16)((x[i] & 0x8000) | 0x4F80);
}

skv_backend skvf_backend(skvf_data *d) { return skvf_bool(d) ? SKV_BACKEND_CPU : SKV_BACKEND_REF; }

/* ---- output checks --------------------------------------------------------------------- */

long skvf_checked[2];

void skvf_note_checked(skv_backend be) { skvf_checked[be == SKV_BACKEND_CPU]++; }

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
                                 /* S may exceed N - O in the mass mode and with SKV_BUDGET_ALL */
                                 (cfg->select_mode == SKV_SELECT_FIXED && cfg->budget != SKV_BUDGET_ALL &&
                                  in.n_selected > in.n_candidates)))
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
                int32_t k = -1;
                st = skv_cache_selected_count(cache, l, b, h, &k);
                skvf_check_status(st, "fingerprint: skv_cache_selected_count");
                fnv_ids(&f, st, &k, 1);
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

/* ---- decode oracle ---------------------------------------------------------------------- */

static void *ocalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) skvf_fail("decode oracle: out of memory");
    return p;
}

static skv_bf16 *odup(const skv_bf16 *x, size_t n)
{
    if (!x) return NULL;
    skv_bf16 *y = ocalloc(n, sizeof *y);
    memcpy(y, x, n * sizeof *y);
    return y;
}

void skvf_slot_free(skvf_slot *s)
{
    free(s->k_pre);
    free(s->v);
    free(s->k_post);
    free(s->u);
    free(s->w);
    free(s->gen_k);
    free(s->gen_v);
    memset(s, 0, sizeof *s);
}

void skvf_slot_prefilled(skvf_slot *s, const skv_config *cfg, skv_backend be, int64_t n, const skv_bf16 *k_pre,
                         const skv_bf16 *v, const skv_bf16 *k_post)
{
    skvf_slot_free(s);
    const size_t P = (size_t)cfg->n_kv_heads * (size_t)cfg->head_dim, e = (size_t)n * P, r = (size_t)cfg->rank;
    s->n = n;
    s->k_pre = odup(k_pre, e);
    s->v = odup(v, e);
    s->k_post = odup(k_post, e);
    s->cap = cfg->gen_capacity;
    s->gen_k = ocalloc((size_t)s->cap * P, sizeof(skv_bf16));
    s->gen_v = ocalloc((size_t)s->cap * P, sizeof(skv_bf16));
    /* the cache's factorization: the same backend slot on the same input (deterministic) */
    float *uf = ocalloc((size_t)n * r, sizeof(float)), *wf = ocalloc(r * P, sizeof(float));
    const skv_factorize_route route = cfg->reproducible ? SKV_FACTORIZE_CANONICAL : cfg->factorize;
    if (skv_op_factorize_route(be, route, n, (int32_t)P, (int32_t)r, k_pre, uf, wf) == SKV_OK) {
        s->u = ocalloc((size_t)n * r, sizeof(skv_bf16));
        s->w = ocalloc(r * P, sizeof(skv_bf16));
        for (size_t i = 0; i < (size_t)n * r; i++) s->u[i] = skv_bf16_from_float(uf[i]);
        for (size_t i = 0; i < r * P; i++) s->w[i] = skv_bf16_from_float(wf[i]);
    }
    free(uf);
    free(wf);
}

void skvf_slot_append(skvf_slot *s, const skv_config *cfg, const skv_bf16 *k, const skv_bf16 *v)
{
    const size_t P = (size_t)cfg->n_kv_heads * (size_t)cfg->head_dim;
    if (!s->n) skvf_fail("decode oracle: append to a slot that was not prefilled");
    if (s->n_gen >= s->cap) skvf_fail("decode oracle: more than gen_capacity = %d tokens appended", s->cap);
    memcpy(s->gen_k + (size_t)s->n_gen * P, k, P * sizeof *k);
    memcpy(s->gen_v + (size_t)s->n_gen * P, v, P * sizeof *v);
    s->n_gen++;
}

#define OU 0x1p-24 /* float unit roundoff */

/* SKVF_ORACLE_STATS=1: at exit, how often the oracle checked and how close it came to its bound. */
static struct {
    long selections, outputs, skipped_vacuous, skipped_nofactor;
    double worst_ratio, sum_rel_bound;
} ostats;

static void oracle_stats_print(void)
{
    fprintf(stderr,
            "decode oracle: %ld selections checked, %ld outputs checked (%ld skipped: score bound > 10; %ld: no "
            "factorization), largest error/bound %.3g, mean bound/|ref| %.3g\n",
            ostats.selections, ostats.outputs, ostats.skipped_vacuous, ostats.skipped_nofactor, ostats.worst_ratio,
            ostats.outputs ? ostats.sum_rel_bound / (double)ostats.outputs : 0.0);
}

/* One attended token of one KV head: key (double) with its bound on |library key - key|
   per element, and the value row. */
typedef struct otok {
    double *key, *err;
    const skv_bf16 *v;
} otok;

/*
 * RoPE of pre[0..D) at position pos in double with the library's tables; ferr[e] is the
 * float error already in pre[e] (0 for exact inputs). Writes key and the bound on the
 * library's bf16 result: its float rotation error, then one bf16 rounding (2^-8 relative).
 */
static void oracle_rope(const skv_config *cfg, const float *cos_t, const float *sin_t, int64_t pos, const double *pre,
                        const double *ferr, int exact_pre, double *key, double *err)
{
    const int32_t D = cfg->head_dim, R = cfg->rope.rotary_dim ? cfg->rope.rotary_dim : D, R2 = R / 2;
    for (int32_t e = R; e < D; e++) {
        key[e] = pre[e];
        err[e] = exact_pre ? 0.0 : 1.01 * ferr[e] + 0x1p-8 * fabs(pre[e]) + 1e-39;
    }
    for (int32_t i = 0; i < R2; i++) {
        const int32_t a = cfg->rope.interleaved ? 2 * i : i, b = cfg->rope.interleaved ? 2 * i + 1 : i + R2;
        const double c = cos_t[pos * R2 + i], s = sin_t[pos * R2 + i];
        key[a] = pre[a] * c - pre[b] * s;
        key[b] = pre[b] * c + pre[a] * s;
        const double f = ferr[a] + ferr[b] + 4 * OU * (fabs(pre[a]) + fabs(pre[b]));
        err[a] = 1.01 * f + 0x1p-8 * fabs(key[a]) + 1e-39;
        err[b] = 1.01 * f + 0x1p-8 * fabs(key[b]) + 1e-39;
    }
}

void skvf_check_decode(skv_cache *c, const skv_config *cfg, int32_t layer, const skvf_slot *slots,
                       const skv_bf16 *q, const float *out, const char *who)
{
    static int stats_registered;
    if (!stats_registered && getenv("SKVF_ORACLE_STATS")) atexit(oracle_stats_print);
    stats_registered = 1;
    const int32_t B = cfg->batch_size, Hq = cfg->n_q_heads, Hk = cfg->n_kv_heads, D = cfg->head_dim;
    const int32_t G = Hq / Hk, cs = cfg->chunk_size, r = cfg->rank;
    const size_t P = (size_t)Hk * D;
    const double sc = cfg->attn_scale > 0.0f ? (double)cfg->attn_scale : (double)(1.0f / sqrtf((float)D));
    const int64_t npos = cfg->max_prompt_len + cfg->gen_capacity, nmax = cfg->max_prompt_len / cs + 1;
    const int64_t tmax = cfg->max_prompt_len + cfg->gen_capacity;
    const size_t tl = skv_rope_table_len(&cfg->rope, D, npos);
    float *cos_t = ocalloc(tl, sizeof(float)), *sin_t = ocalloc(tl, sizeof(float));
    if (skv_rope_table_build(&cfg->rope, D, npos, cos_t, sin_t) != SKV_OK)
        skvf_fail("decode oracle: skv_rope_table_build: %s", skv_last_error());
    int32_t *oid = ocalloc((size_t)nmax, sizeof(int32_t)), *cid = ocalloc((size_t)nmax, sizeof(int32_t));
    int32_t *sid = ocalloc((size_t)nmax, sizeof(int32_t)), *mark = ocalloc((size_t)nmax, sizeof(int32_t));
    skv_bf16 *lm = ocalloc((size_t)nmax * D, sizeof(skv_bf16));
    double *a = ocalloc((size_t)nmax, sizeof(double)), *sg = ocalloc((size_t)nmax, sizeof(double));
    double *keys = ocalloc((size_t)tmax * D, sizeof(double)), *errs = ocalloc((size_t)tmax * D, sizeof(double));
    double *pre = ocalloc((size_t)D, sizeof(double)), *ferr = ocalloc((size_t)D, sizeof(double));
    double *st = ocalloc((size_t)tmax, sizeof(double)), *dt = ocalloc((size_t)tmax, sizeof(double));
    double *wt = ocalloc((size_t)tmax, sizeof(double)), *o = ocalloc((size_t)D, sizeof(double));
    otok *tok = ocalloc((size_t)tmax, sizeof(otok));

    for (int32_t b = 0; b < B; b++) {
        const skvf_slot *sl = &slots[b];
        skv_seq_info in;
        if (skv_cache_seq_info(c, layer, b, &in) != SKV_OK)
            skvf_fail("%s decode oracle: seq_info(%d, %d): %s", who, layer, b, skv_last_error());
        const int32_t N = in.n_chunks, O = in.n_outliers, nc = in.n_candidates, S = in.n_selected;
        if (!in.prefilled || !in.has_selection || in.n != sl->n || in.n_generated != sl->n_gen ||
            (int64_t)N * cs + in.n_local != in.n || O + nc != N || S < 1 || S > nc || N > nmax)
            skvf_fail("%s decode oracle: seq_info(%d, %d) after a step: prefilled %d selection %d n %lld (harness "
                      "%lld) generated %d (harness %d) N %d local %d O %d candidates %d S %d",
                      who, layer, b, in.prefilled, in.has_selection, (long long)in.n, (long long)sl->n,
                      in.n_generated, sl->n_gen, N, in.n_local, O, nc, S);
        for (int32_t h = 0; h < Hk; h++) {
            if (skv_cache_outliers(c, layer, b, h, oid) != SKV_OK || skv_cache_candidates(c, layer, b, h, cid) != SKV_OK ||
                skv_cache_selected(c, layer, b, h, sid) != SKV_OK || skv_cache_landmarks(c, layer, b, h, lm) != SKV_OK)
                skvf_fail("%s decode oracle: introspection of (%d, %d, %d): %s", who, layer, b, h, skv_last_error());
            /* outliers and candidates partition the N chunks; selected are candidates (mark: cand index + 1) */
            memset(mark, 0, (size_t)N * sizeof *mark);
            for (int32_t i = 0; i < O; i++) {
                if (oid[i] < 0 || oid[i] >= N || (i && oid[i] <= oid[i - 1]))
                    skvf_fail("%s decode oracle: (%d, %d, %d) outlier ids not increasing in [0, %d)", who, layer, b, h, N);
                mark[oid[i]] = -1;
            }
            for (int32_t j = 0; j < nc; j++) {
                if (cid[j] < 0 || cid[j] >= N || (j && cid[j] <= cid[j - 1]) || mark[cid[j]])
                    skvf_fail("%s decode oracle: (%d, %d, %d) candidate %d: not increasing in [0, %d) or an outlier",
                              who, layer, b, h, cid[j], N);
                mark[cid[j]] = j + 1;
            }
            for (int32_t i = 0; i < S; i++)
                if (sid[i] < 0 || sid[i] >= N || mark[sid[i]] <= 0 || (i && sid[i] <= sid[i - 1]))
                    skvf_fail("%s decode oracle: (%d, %d, %d) selected chunk %d is not an increasing candidate", who,
                              layer, b, h, sid[i]);
            const skv_bf16 *qh = q + ((size_t)b * Hq + (size_t)h * G) * D;

            /* the selection: the top S of a_j = max_g softmax_j(sc q_g . L_j), within the
               float rounding of the library's scores (fmaf chain of D terms), skv_expf and sums */
            double ds = 0.0;
            int finite = 1;
            for (int32_t j = 0; j < nc; j++) a[j] = 0.0;
            for (int32_t g = 0; g < G; g++) {
                const skv_bf16 *qg = qh + (size_t)g * D;
                double mx = -INFINITY, z = 0.0;
                for (int32_t j = 0; j < nc; j++) {
                    double dot = 0.0, mag = 0.0;
                    for (int32_t e = 0; e < D; e++) {
                        const double x = skv_bf16_to_float(qg[e]), y = skv_bf16_to_float(lm[(size_t)j * D + e]);
                        dot += x * y;
                        mag += fabs(x * y);
                    }
                    sg[j] = sc * dot;
                    ds = fmax(ds, sc * mag * (D + 2) * OU + fabs(sg[j]) * 2 * OU);
                    mx = fmax(mx, sg[j]);
                }
                for (int32_t j = 0; j < nc; j++) z += (sg[j] = exp(sg[j] - mx));
                for (int32_t j = 0; j < nc; j++) a[j] = fmax(a[j], sg[j] / z);
                finite &= isfinite(mx) && isfinite(z);
            }
            ostats.selections += finite && S < nc;
            if (finite && S < nc) {
                const double eta = 4 * ds + (nc + 32) * 2 * OU;
                double min_sel = INFINITY, max_uns = -INFINITY;
                int32_t j_sel = -1, j_uns = -1;
                for (int32_t i = 0; i < S; i++) {
                    const int32_t j = mark[sid[i]] - 1;
                    if (a[j] < min_sel) min_sel = a[j], j_sel = j;
                    mark[sid[i]] = -2; /* selected */
                }
                for (int32_t j = 0; j < nc; j++)
                    if (mark[cid[j]] != -2 && a[j] > max_uns) max_uns = a[j], j_uns = j;
                if (min_sel * (1 + eta) + 1e-37 < max_uns * (1 - eta))
                    skvf_fail("%s decode oracle: layer %d seq %d head %d: the selection is not the top S = %d of %d: "
                              "selected chunk %d has a = %.9g < unselected chunk %d with a = %.9g (relative "
                              "tolerance %.3g)",
                              who, layer, b, h, S, nc, cid[j_sel], min_sel, cid[j_uns], max_uns, eta);
            }

            /* the output: double attention over the tokens the cache reports it used */
            if (!sl->u) {
                ostats.skipped_nofactor += G;
                continue;
            }
            int64_t T = 0;
            for (int part = 0; part < 4; part++) {
                /* 0 outlier chunks, 1 local window, 2 selected chunks (rebuilt keys), 3 generated */
                int64_t lo = 0, hi = 0;
                if (part == 1) lo = (int64_t)N * cs, hi = sl->n;
                if (part == 3) lo = 0, hi = sl->n_gen;
                const int32_t n_chunks = part == 0 ? O : part == 2 ? S : 1;
                for (int32_t k = 0; k < n_chunks; k++) {
                    if (part == 0 || part == 2) {
                        lo = (int64_t)(part == 0 ? oid[k] : sid[k]) * cs;
                        hi = lo + cs;
                    }
                    for (int64_t t = lo; t < hi; t++, T++) {
                        otok *x = &tok[T];
                        x->key = keys + (size_t)T * D;
                        x->err = errs + (size_t)T * D;
                        if (part == 3) {
                            const skv_bf16 *kr = sl->gen_k + (size_t)t * P + (size_t)h * D;
                            for (int32_t e = 0; e < D; e++) x->key[e] = skv_bf16_to_float(kr[e]), x->err[e] = 0.0;
                            x->v = sl->gen_v + (size_t)t * P + (size_t)h * D;
                            continue;
                        }
                        x->v = sl->v + (size_t)t * P + (size_t)h * D;
                        if (part != 2 && sl->k_post) { /* given post-RoPE keys are stored as they are */
                            const skv_bf16 *kr = sl->k_post + (size_t)t * P + (size_t)h * D;
                            for (int32_t e = 0; e < D; e++) x->key[e] = skv_bf16_to_float(kr[e]), x->err[e] = 0.0;
                        } else if (part != 2) { /* prefill roped k_pre (float rotation, bf16) */
                            const skv_bf16 *kr = sl->k_pre + (size_t)t * P + (size_t)h * D;
                            for (int32_t e = 0; e < D; e++) pre[e] = skv_bf16_to_float(kr[e]), ferr[e] = 0.0;
                            oracle_rope(cfg, cos_t, sin_t, t, pre, ferr, 1, x->key, x->err);
                        } else { /* rebuilt: U[t] W_h (float sum of r terms), RoPE, bf16 */
                            double mu = 0.0, su = 0.0; /* the reproducible mode's fixed point: below */
                            for (int32_t k2 = 0; k2 < r; k2++) {
                                const double uu = fabs((double)skv_bf16_to_float(sl->u[(size_t)t * r + k2]));
                                mu = fmax(mu, uu);
                                su += uu;
                            }
                            for (int32_t e = 0; e < D; e++) {
                                double acc = 0.0, mag = 0.0, mw = 0.0, sw = 0.0;
                                for (int32_t k2 = 0; k2 < r; k2++) {
                                    const double uu = skv_bf16_to_float(sl->u[(size_t)t * r + k2]);
                                    const double ww = skv_bf16_to_float(sl->w[(size_t)k2 * P + (size_t)h * D + e]);
                                    acc += uu * ww;
                                    mag += fabs(uu * ww);
                                    mw = fmax(mw, fabs(ww));
                                    sw += fabs(ww);
                                }
                                pre[e] = acc;
                                ferr[e] = (r + 2) * OU * mag;
                                /* the canonical rebuild (docs/DESIGN.md 10.2) rounds every u and w to
                                   2^-13 of its row's or column's largest, sums exactly, rounds once */
                                if (cfg->reproducible)
                                    ferr[e] = 1.01 * (0x1p-13 * (mu * sw + mw * su) + r * 0x1p-26 * mu * mw) +
                                              2 * OU * fabs(acc);
                            }
                            oracle_rope(cfg, cos_t, sin_t, t, pre, ferr, 0, x->key, x->err);
                        }
                    }
                }
            }
            for (int32_t g = 0; g < G; g++) {
                const skv_bf16 *qg = qh + (size_t)g * D;
                const float *og = out + ((size_t)b * Hq + (size_t)h * G + g) * D;
                double mx = -INFINITY, dmax = 0.0, z = 0.0;
                for (int64_t t = 0; t < T; t++) {
                    double dot = 0.0, dq = 0.0, mag = 0.0;
                    for (int32_t e = 0; e < D; e++) {
                        const double x = skv_bf16_to_float(qg[e]);
                        dot += x * tok[t].key[e];
                        dq += fabs(x) * tok[t].err[e];
                        mag += fabs(x) * (fabs(tok[t].key[e]) + tok[t].err[e]);
                    }
                    st[t] = sc * dot;
                    /* score bound: the keys' bound, the float dot product and scaling, the exp */
                    dt[t] = sc * dq + sc * mag * (D + 4) * OU + fabs(st[t]) * 2 * OU + 1e-6;
                    mx = fmax(mx, st[t]);
                    dmax = fmax(dmax, dt[t]);
                }
                if (!isfinite(mx) || dmax > 10.0) { /* the bound would say nothing */
                    ostats.skipped_vacuous++;
                    continue;
                }
                for (int64_t t = 0; t < T; t++) z += (wt[t] = exp(st[t] - mx));
                for (int32_t e = 0; e < D; e++) o[e] = 0.0;
                for (int64_t t = 0; t < T; t++) {
                    wt[t] /= z;
                    for (int32_t e = 0; e < D; e++) o[e] += wt[t] * skv_bf16_to_float(tok[t].v[e]);
                }
                /* |w'_t / w_t - 1| <= e^(dt_t + dmax) - 1, and sum_t (w'_t - w_t) (v_t - o) is the change */
                double spread = 0.0, vmag = 0.0, err2 = 0.0, ref2 = 0.0;
                int fin = 1;
                for (int64_t t = 0; t < T; t++) {
                    double dv = 0.0, vv = 0.0;
                    for (int32_t e = 0; e < D; e++) {
                        const double x = skv_bf16_to_float(tok[t].v[e]);
                        dv += (x - o[e]) * (x - o[e]);
                        vv += x * x;
                    }
                    spread += wt[t] * expm1(dt[t] + dmax) * sqrt(dv);
                    vmag += wt[t] * sqrt(vv);
                }
                for (int32_t e = 0; e < D; e++) {
                    fin &= isfinite(og[e]) != 0;
                    err2 += ((double)og[e] - o[e]) * ((double)og[e] - o[e]);
                    ref2 += o[e] * o[e];
                }
                const double bound = spread + ((double)(T + D + 64) * 2 * OU + 1e-6) * vmag + 1e-30;
                if (fin && isfinite(bound)) {
                    ostats.outputs++;
                    skvf_note_checked(skv_cache_backend(c));
                    ostats.worst_ratio = fmax(ostats.worst_ratio, sqrt(err2) / bound);
                    ostats.sum_rel_bound += ref2 > 0 ? fmin(bound / sqrt(ref2), 1e3) : 0.0;
                }
                if (fin && isfinite(bound) && sqrt(err2) > bound)
                    skvf_fail("%s decode oracle: layer %d seq %d query head %d: |out - attention over the cache's "
                              "%lld tokens (%d outlier chunks, %d local, %d selected chunks, %d generated)| = %.6g > "
                              "bound %.6g (|ref| %.6g, max score bound %.3g)",
                              who, layer, b, h * G + g, (long long)T, O, (int)(sl->n - (int64_t)N * cs), S, sl->n_gen,
                              sqrt(err2), bound, sqrt(ref2), dmax);
            }
        }
    }
    free(cos_t), free(sin_t), free(oid), free(cid), free(sid), free(mark), free(lm), free(a), free(sg);
    free(keys), free(errs), free(pre), free(ferr), free(st), free(dt), free(wt), free(o), free(tok);
}
