/*
 * test_values_fp8: fp8 value stores (config.value_dtype = SKV_VALUE_FP8, docs/DESIGN.md
 * section 13) on every available backend.
 *
 *  - memory: a value store is Hk x (N_max - O) chunk records of c D codes and c exponents
 *    (padded to 16 bytes), against 2 c D bytes for bf16; skv_cache_memory and
 *    skv_cache_memory_info report it, and host placement moves those bytes;
 *  - decisions do not read values: an fp8 cache and a bf16 cache fed the same prompt and steps
 *    select the same chunks at every step, head and layer, bitwise;
 *  - what the attention reads: with values already on the fp8 grid (v' = decode(encode(v)) per
 *    token and head), an fp8 cache and a bf16 cache give bitwise equal outputs (ref and cpu in
 *    both modes, cuda in the reproducible mode; cuda's default mode within 1e-5 relative), so
 *    the fp8 path attends to exactly the decoded values; values on the device, in the host
 *    store (value_device_bytes = 0) and in the pool mode;
 *  - the reproducible mode: fp8 outputs bitwise equal across ref, cpu and cuda on raw values;
 *  - raw values: the fp8 output stays within the fp8 step of the bf16 output;
 *  - structured values: a needle per row, all-zero rows, tiny (2^-100) and huge (2^24) rows;
 *  - bad input: NaN in v is refused like bf16 and changes nothing; snapshots refuse fp8.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skv_numerics.h"
#include "testutil.h"

enum { L = 2, B = 2, STEPS = 3 };

typedef struct shape {
    int Hq, Hk, D, c;
    int64_t n;
} shape;

static skv_config make_cfg(skv_backend be, const shape *s, int dtype, int rep, int place)
{
    skv_config g = skv_config_default();
    g.backend = be;
    g.n_layers = L;
    g.n_q_heads = s->Hq, g.n_kv_heads = s->Hk, g.head_dim = s->D;
    g.rank = 32;
    g.chunk_size = s->c;
    g.budget = 8 * s->c;
    g.n_outlier_chunks = 4;
    g.n_local_chunks = 2;
    g.batch_size = B;
    g.max_prompt_len = s->n;
    g.gen_capacity = 16;
    g.reproducible = rep;
    g.value_dtype = (skv_value_dtype)dtype;
    skv_memory_info mi;
    if (place == 1 && skv_cache_memory_info(&g, &mi) == SKV_OK) /* every value store in host memory */
        g.value_device_bytes = (int64_t)(L * B) * (int64_t)mi.value_cache_bytes;
    if (place == 2 && skv_cache_memory_info(&g, &mi) == SKV_OK) { /* the pool mode, values in the host pool */
        g.pool_device_bytes = (int64_t)mi.device_bytes;
        g.pool_host_bytes = (int64_t)(L * B) * (int64_t)mi.value_store_bytes + (1 << 22);
        g.value_device_bytes = 0;
    }
    return g;
}

/* values of token t, head h at v[(t * Hk + h) * D]: v' = decode(encode(v)) row by row */
static void round_to_fp8(const shape *s, int64_t n, skv_bf16 *v)
{
    uint8_t *rec = skvt_xmalloc(skv_value_chunk_bytes(SKV_VALUE_FP8, 1, s->D));
    for (int64_t t = 0; t < n; t++)
        for (int h = 0; h < s->Hk; h++) {
            skv_bf16 *row = v + ((size_t)t * s->Hk + h) * s->D;
            skv_fp8_encode_chunk(row, s->D, 1, s->D, rec);
            skv_fp8_decode_chunk(rec, 1, s->D, row);
        }
    free(rec);
}

/* structured rows: kind 1 a needle per row, 2 every 5th row zero, 3 tiny, 4 huge */
static void structure(skvt_rng *r, const shape *s, int64_t n, skv_bf16 *v, int kind)
{
    for (int64_t t = 0; t < n; t++)
        for (int h = 0; h < s->Hk; h++) {
            skv_bf16 *row = v + ((size_t)t * s->Hk + h) * s->D;
            if (kind == 1) row[skvt_rng_range(r, 0, s->D - 1)] = skv_bf16_from_float(300.0f);
            if (kind == 2 && t % 5 == 0) memset(row, 0, (size_t)s->D * 2);
            for (int d = 0; d < s->D && (kind == 3 || kind == 4); d++)
                row[d] = skv_bf16_from_float(ldexpf(skv_bf16_to_float(row[d]), kind == 3 ? -100 : 24));
        }
}

/* One run: prefill every (layer, seq), STEPS decode steps; outputs [STEPS][L][B Hq D] and
   selections [STEPS][L][B][Hk][S] into out / sel. */
typedef struct run_out {
    float *out;
    int32_t *sel;
    int S;
} run_out;

static int run(const skv_config *g, const shape *s, const skv_bf16 *k, const skv_bf16 *v, uint64_t seed, run_out *o)
{
    skv_cache *c = NULL;
    skv_status st = skv_cache_create(g, &c);
    if (!SKVT_CHECK_STATUS(st, SKV_OK, "create")) {
        printf("  %s\n", skv_last_error());
        return 0;
    }
    const skv_backend be = g->backend;
    const size_t row = (size_t)s->Hk * s->D, hd = (size_t)s->Hq * s->D, np = (size_t)s->n * row;
    skv_bf16 *hq = skvt_xmalloc((size_t)B * hd * 2), *hk = skvt_xmalloc((size_t)B * row * 2);
    skv_bf16 *hv = skvt_xmalloc((size_t)B * row * 2);
    float *hout = skvt_xmalloc((size_t)B * hd * 4);
    skv_bf16 *kp = skvt_xmalloc(np * 2), *vp = skvt_xmalloc(np * 2); /* the prompt of one (layer, seq) */
    void *dkp = skvt_dbuf(be, kp, np * 2), *dvp = skvt_dbuf(be, vp, np * 2);
    void *dq = skvt_dbuf(be, hq, (size_t)B * hd * 2), *dk = skvt_dbuf(be, hk, (size_t)B * row * 2);
    void *dv = skvt_dbuf(be, hv, (size_t)B * row * 2), *dout = skvt_dbuf(be, hout, (size_t)B * hd * 4);
    int ok = 1;
    for (int l = 0; l < L && ok; l++)
        for (int b = 0; b < B && ok; b++) { /* sequence b, layer l: the prompt shifted by (l, b) tokens */
            const size_t off = (size_t)(l * 3 + b) * row;
            memcpy(kp, k + off, (np - off) * 2), memcpy(vp, v + off, (np - off) * 2);
            skvt_dput(be, dkp, kp, (np - off) * 2);
            skvt_dput(be, dvp, vp, (np - off) * 2);
            st = skv_prefill(c, l, b, s->n - l * 3 - b, dkp, dvp, NULL);
            ok = SKVT_CHECK_STATUS(st, SKV_OK, "prefill");
            if (!ok) printf("  %s\n", skv_cache_last_error(c));
        }
    skv_seq_info si;
    if (ok) ok = SKVT_CHECK_STATUS(skv_cache_seq_info(c, 0, 0, &si), SKV_OK, "seq_info");
    o->S = ok ? si.n_selected : 0;
    for (int t = 0; t < STEPS && ok; t++)
        for (int l = 0; l < L && ok; l++) {
            skvt_rng r;
            skvt_rng_seed(&r, seed * 7919u + (uint64_t)t * 104729u + (uint64_t)l);
            skvt_fill_bf16_normal(&r, hq, (size_t)B * hd, 1.0);
            skvt_fill_bf16_normal(&r, hk, (size_t)B * row, 1.0);
            skvt_fill_bf16_normal(&r, hv, (size_t)B * row, 1.0);
            skvt_dput(be, dq, hq, (size_t)B * hd * 2), skvt_dput(be, dk, hk, (size_t)B * row * 2);
            skvt_dput(be, dv, hv, (size_t)B * row * 2);
            memset(hout, 0xff, (size_t)B * hd * 4); /* poison: NaN */
            skvt_dput(be, dout, hout, (size_t)B * hd * 4);
            st = skv_decode(c, l, dq, dk, dv, dout);
            if (!st) st = skv_cache_sync(c);
            ok = SKVT_CHECK_STATUS(st, SKV_OK, "decode");
            if (!ok) {
                printf("  %s\n", skv_cache_last_error(c));
                break;
            }
            skvt_dget(be, o->out + ((size_t)t * L + l) * B * hd, dout, (size_t)B * hd * 4);
            for (int b = 0; b < B && ok; b++)
                for (int h = 0; h < s->Hk && ok; h++)
                    ok = SKVT_CHECK_STATUS(
                        skv_cache_selected(c, l, b, h, o->sel + ((((size_t)t * L + l) * B + b) * s->Hk + h) * o->S),
                        SKV_OK, "selected");
        }
    skvt_dfree(be, dkp, kp), skvt_dfree(be, dvp, vp), skvt_dfree(be, dq, hq), skvt_dfree(be, dk, hk);
    free(kp), free(vp);
    skvt_dfree(be, dv, hv), skvt_dfree(be, dout, hout);
    free(hq), free(hk), free(hv), free(hout);
    skv_cache_free(c);
    return ok;
}

static void out_alloc(const shape *s, run_out *o)
{
    o->out = skvt_xmalloc((size_t)STEPS * L * B * s->Hq * s->D * 4);
    o->sel = skvt_xmalloc((size_t)STEPS * L * B * s->Hk * 64 * 4); /* S <= budget / c = 8 */
}

static size_t n_out(const shape *s) { return (size_t)STEPS * L * B * s->Hq * s->D; }

/* max |a - b| / max |b| */
static double rel_diff(const float *a, const float *b, size_t n)
{
    double m = 0, d = 0;
    for (size_t i = 0; i < n; i++) {
        m = fmax(m, fabs(b[i]));
        d = fmax(d, fabs((double)a[i] - b[i]));
        if (isnan(a[i]) != isnan(b[i])) return INFINITY;
    }
    return m > 0 ? d / m : d;
}

static void test_memory(void)
{
    const shape shapes[] = {{32, 8, 128, 8, 4096}, {9, 3, 64, 8, 2048}, {8, 2, 96, 16, 4096}, {4, 1, 80, 5, 1000}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const shape *s = &shapes[i];
        skv_config g = make_cfg(SKV_BACKEND_REF, s, SKV_VALUE_BF16, 0, 0);
        skv_memory_info a, b;
        if (!SKVT_CHECK_STATUS(skv_cache_memory_info(&g, &a), SKV_OK, "memory_info bf16")) continue;
        g.value_dtype = SKV_VALUE_FP8;
        if (!SKVT_CHECK_STATUS(skv_cache_memory_info(&g, &b), SKV_OK, "memory_info fp8")) continue;
        const size_t cm = (size_t)(s->n / s->c - 2 - 4), rec8 = (size_t)s->c * s->D + (((size_t)s->c + 15) & ~15u);
        const size_t want8 = ((size_t)s->Hk * cm * rec8 + 255) & ~(size_t)255;
        const size_t want16 = ((size_t)s->Hk * cm * s->c * s->D * 2 + 255) & ~(size_t)255;
        SKVT_CHECK(b.value_store_bytes == want8 && a.value_store_bytes == want16,
                   "value_store_bytes D=%d c=%d: fp8 %zu (want %zu), bf16 %zu (want %zu)", s->D, s->c,
                   b.value_store_bytes, want8, a.value_store_bytes, want16);
        SKVT_CHECK(a.device_bytes - b.device_bytes == (size_t)L * B * (a.value_store_bytes - b.value_store_bytes),
                   "device bytes shrink by the stores: bf16 %zu fp8 %zu", a.device_bytes, b.device_bytes);
        size_t dev8 = 0, host8 = 0, dev16 = 0, host16 = 0;
        g.value_device_bytes = (int64_t)(L * B) * (int64_t)b.value_cache_bytes;
        SKVT_CHECK_STATUS(skv_cache_memory(&g, &dev8, &host8), SKV_OK, "memory fp8, host values");
        g.value_dtype = SKV_VALUE_BF16;
        g.value_device_bytes = (int64_t)(L * B) * (int64_t)a.value_cache_bytes;
        SKVT_CHECK_STATUS(skv_cache_memory(&g, &dev16, &host16), SKV_OK, "memory bf16, host values");
        SKVT_CHECK(host8 == (size_t)L * B * want8 && host16 == (size_t)L * B * want16,
                   "host stores D=%d: fp8 %zu bf16 %zu", s->D, host8, host16);
        SKVT_CHECK(dev8 < dev16, "chunk caches shrink too: fp8 %zu bf16 %zu", dev8, dev16);
    }
}

/* fp8 against bf16 on one backend, one mode, one placement */
static void test_pair(skv_backend be, const shape *s, int rep, int place, int kind, uint64_t seed)
{
    const size_t np = (size_t)s->n * s->Hk * s->D;
    skv_bf16 *k = skvt_xmalloc(np * 2), *v = skvt_xmalloc(np * 2), *v8 = skvt_xmalloc(np * 2);
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    skvt_lowrank_prompt(&r, (size_t)s->Hk * s->D, s->n, k, v);
    structure(&r, s, s->n, v, kind);
    memcpy(v8, v, np * 2);
    round_to_fp8(s, s->n, v8);
    run_out a, b, a8, b8;
    out_alloc(s, &a), out_alloc(s, &b), out_alloc(s, &a8), out_alloc(s, &b8);
    skv_config g16 = make_cfg(be, s, SKV_VALUE_BF16, rep, place), g8 = make_cfg(be, s, SKV_VALUE_FP8, rep, place);
    const int cuda_default = be == SKV_BACKEND_CUDA && !rep;
    char what[160];
    snprintf(what, sizeof what, "%s %s place %d kind %d Hq %d Hk %d D %d c %d n %lld", skv_backend_name(be),
             rep ? "reproducible" : "default", place, kind, s->Hq, s->Hk, s->D, s->c, (long long)s->n);
    if (run(&g16, s, k, v, seed, &a) && run(&g8, s, k, v, seed, &b) && run(&g16, s, k, v8, seed, &a8) &&
        run(&g8, s, k, v8, seed, &b8)) {
        const size_t ns = (size_t)STEPS * L * B * s->Hk * a.S;
        SKVT_CHECK(memcmp(a.sel, b.sel, ns * 4) == 0, "%s: the fp8 cache selects other chunks than bf16", what);
        SKVT_CHECK(memcmp(a8.sel, b8.sel, ns * 4) == 0, "%s: on grid values, other selections", what);
        const double d_grid = rel_diff(b8.out, a8.out, n_out(s));
        if (cuda_default)
            SKVT_CHECK(d_grid <= 1e-5, "%s: on grid values fp8 vs bf16 outputs differ by %.3g", what, d_grid);
        else
            SKVT_CHECK(memcmp(b8.out, a8.out, n_out(s) * 4) == 0,
                       "%s: on grid values fp8 vs bf16 outputs not bitwise (%.3g)", what, d_grid);
        /* raw values: within two quantization steps (2^-4 relative per value; the output is an average) */
        const double d_raw = rel_diff(b.out, a.out, n_out(s));
        SKVT_CHECK(d_raw <= 0.125, "%s: raw values, fp8 vs bf16 outputs differ by %.3g", what, d_raw);
        if (kind == 0 && place == 0 && s->D == 128)
            printf("  %s: fp8 vs bf16 output %.2e relative (raw values), %.2e (grid values)\n", what, d_raw, d_grid);
    }
    free(k), free(v), free(v8);
    free(a.out), free(a.sel), free(b.out), free(b.sel), free(a8.out), free(a8.sel), free(b8.out), free(b8.sel);
}

/* the reproducible mode: fp8 outputs bitwise equal across the available backends */
static void test_cross(const skv_backend *bes, int n_be, const shape *s, int place, uint64_t seed)
{
    const size_t np = (size_t)s->n * s->Hk * s->D;
    skv_bf16 *k = skvt_xmalloc(np * 2), *v = skvt_xmalloc(np * 2);
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    skvt_lowrank_prompt(&r, (size_t)s->Hk * s->D, s->n, k, v);
    run_out o[3];
    int ok[3] = {0, 0, 0};
    for (int i = 0; i < n_be; i++) {
        out_alloc(s, &o[i]);
        skv_config g = make_cfg(bes[i], s, SKV_VALUE_FP8, 1, place);
        ok[i] = run(&g, s, k, v, seed, &o[i]);
    }
    for (int i = 1; i < n_be; i++)
        if (ok[0] && ok[i]) {
            SKVT_CHECK(memcmp(o[0].out, o[i].out, n_out(s) * 4) == 0,
                       "reproducible fp8 place %d D %d: %s and %s outputs differ (%.3g)", place, s->D,
                       skv_backend_name(bes[0]), skv_backend_name(bes[i]), rel_diff(o[i].out, o[0].out, n_out(s)));
            SKVT_CHECK(memcmp(o[0].sel, o[i].sel, (size_t)STEPS * L * B * s->Hk * o[0].S * 4) == 0,
                       "reproducible fp8: %s and %s selections differ", skv_backend_name(bes[0]),
                       skv_backend_name(bes[i]));
        }
    for (int i = 0; i < n_be; i++) free(o[i].out), free(o[i].sel);
    free(k), free(v);
}

static void test_bad(skv_backend be, uint64_t seed)
{
    const shape s = {8, 2, 64, 8, 1024};
    skv_config g = make_cfg(be, &s, SKV_VALUE_FP8, 0, 0);
    skv_cache *c = NULL;
    if (!SKVT_CHECK_STATUS(skv_cache_create(&g, &c), SKV_OK, "create fp8 (bad input)")) return;
    const size_t np = (size_t)s.n * s.Hk * s.D;
    skv_bf16 *k = skvt_xmalloc(np * 2), *v = skvt_xmalloc(np * 2);
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    skvt_lowrank_prompt(&r, (size_t)s.Hk * s.D, s.n, k, v);
    v[np / 2] = 0x7fc0; /* NaN */
    void *dk = skvt_dbuf(be, k, np * 2), *dv = skvt_dbuf(be, v, np * 2); /* cuda: zeroed device buffers */
    skvt_dput(be, dk, k, np * 2), skvt_dput(be, dv, v, np * 2);
    skv_status st = skv_prefill(c, 0, 0, s.n, dk, dv, NULL);
    if (!st) st = skv_cache_sync(c);
    SKVT_CHECK_STATUS(st, SKV_ERR_NONFINITE, "prefill fp8 with a NaN value");
    skv_seq_info si;
    st = skv_cache_seq_info(c, 0, 0, &si);
    SKVT_CHECK(st == SKV_OK && !si.prefilled, "a refused prefill leaves the slot free");
    /* snapshots hold bf16 values: an fp8 cache is refused, naming the field */
    v[np / 2] = 0;
    skvt_dput(be, dv, v, np * 2);
    SKVT_CHECK_STATUS(skv_prefill(c, 0, 0, s.n, dk, dv, NULL), SKV_OK, "prefill fp8");
    size_t size = 0;
    st = skv_cache_save_buffer(c, NULL, 0, &size);
    SKVT_CHECK_STATUS(st, SKV_ERR_UNSUPPORTED, "snapshot of an fp8 cache");
    SKVT_CHECK(strstr(skv_cache_last_error(c), "value_dtype") != NULL, "message names value_dtype: %s",
               skv_cache_last_error(c));
    skvt_dfree(be, dk, k), skvt_dfree(be, dv, v);
    free(k), free(v);
    skv_cache_free(c);
}

int main(void)
{
    const uint64_t seed = skvt_base_seed("test_values_fp8");
    test_memory();
    const skv_backend all[3] = {SKV_BACKEND_REF, SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
    skv_backend bes[3];
    int n_be = 0;
    const shape shapes[] = {{32, 8, 128, 8, 1024}, {9, 3, 64, 8, 1200}};
    for (int i = 0; i < 3; i++) {
        if (skv_backend_available(all[i]) != SKV_OK) {
            skvt_skip(skv_backend_name(all[i]));
            continue;
        }
        bes[n_be++] = all[i];
        test_bad(all[i], seed + 1);
        for (int si = 0; si < 2; si++)
            for (int rep = 0; rep < 2; rep++)
                for (int place = 0; place < 3; place++)
                    test_pair(all[i], &shapes[si], rep, place, place == 0 ? 0 : (si * 2 + place) % 5,
                              seed + 100 * (uint64_t)si + 10 * (uint64_t)rep + (uint64_t)place);
        const shape sm = {8, 2, 64, 8, 800};
        for (int kind = 1; kind <= 4; kind++) test_pair(all[i], &sm, 1, 0, kind, seed + 1000 + (uint64_t)kind);
    }
    for (int place = 0; place < 3; place++) test_cross(bes, n_be, &shapes[place % 2], place, seed + 5000 + (uint64_t)place);
    return skvt_finish();
}
