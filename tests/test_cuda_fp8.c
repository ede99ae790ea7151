/*
 * test_cuda_fp8.c - fp8 value stores (config.value_dtype = SKV_VALUE_FP8, docs/DESIGN.md section 13)
 * on the cuda backend, against ref and cpu and against cuda's own bf16 stores.
 *
 * Without a usable GPU (or without the CUDA plugin) only the memory query (f) runs and the rest is
 * skipped. With a GPU, every decode's output buffer is poisoned (NaN bytes) before the step and
 * every output must come back finite, and:
 *  a. the decode of every code: prompts whose values are code 2^k exactly, for all 254 finite
 *     e4m3 codes in every dimension band (dimension d holds codes of exponent field d mod 16, so
 *     that no term of an output dimension is lost under a larger one) and every k in
 *     [SKV_FP8_EXP_MIN, 23] (one k per (layer, sequence, KV head), several rounds; 448 2^24 is past
 *     SKV_MAX_INPUT_MAGNITUDE, so no prompt holds a larger k); the prompt's encoding is checked on
 *     the host to give exactly those codes (and every finite code). Then the reproducible mode's
 *     outputs and selections on cuda (values on the device, and on the host) equal ref's bitwise,
 *     and the default mode's outputs of the fp8 cache equal those of a bf16 cache fed the same
 *     (exactly representable) values: every attention kernel's decode is skv_fp8_decode, bit for
 *     bit (D = 128 with rank 32 takes the fragment kernel, D = 64 and D = 128 with rank 24 the
 *     general one; the host placement's first step misses every chunk (the missed pass), the later
 *     ones hit the chunk cache);
 *  b. the reproducible mode on random prompts (Llama-3-8B-like Hq 32 / Hk 8 / D 128; GQA 9 / 3,
 *     D 64; chunk 8; prompts of a few thousand tokens; 3 steps): cuda fp8 outputs and selections
 *     equal ref's and cpu's bitwise;
 *  c. the selection does not see the value dtype: cuda fp8 and bf16 caches (default mode) select
 *     the same chunks at every step, and their outputs differ by fp8's rounding only;
 *  d. pre-rounded values v' = decode(encode(v)) (per token row, lib/skv_numerics.h): a cuda fp8
 *     cache and a cuda bf16 cache fed v' give bitwise equal outputs in the reproducible mode, and
 *     within 1e-6 relative per head in the default mode (bitwise is expected: printed);
 *  e. placements: values on the host (value_device_bytes of exactly the chunk caches: every store
 *     on the host, fp8 records over PCIe into the chunk cache), the pool mode with device values
 *     and with host values (value_device_bytes = 0, pool_host_bytes), and a split (slot 0's store
 *     on the device, the other's on the host): outputs equal the device-placed fp8 cache's,
 *     bitwise in the reproducible mode; in the default mode
 *     the pools bitwise against the fixed layout of the same placement, the host placement and
 *     the split within 1e-6 relative per head of the device's (a missed chunk's P V is added later)
 *     with the same selections;
 *  f. skv_cache_memory_info: value_store_bytes of an fp8 config = Hk cand_max vrec rounded up to
 *     256 (vrec = c D + c rounded up to 16), less than the bf16 one.
 * The seed is printed; SKV_SEED=N replays a run.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "skv_numerics.h"
#include "testutil.h"

enum { MAXB = 2 };
/* the largest k of a code prompt: 448 2^23 < SKV_MAX_INPUT_MAGNITUDE = 2^32 < 448 2^24 (a prompt with
   larger values is refused) */
enum { KMAX = 23 };
enum { V_NORMAL = 0, V_CODES = 1, V_ROUNDED = 2 };                       /* the values of a world */
enum { P_DEVICE = 0, P_HOST = 1, P_POOL_DEVICE = 2, P_POOL_HOST = 3, P_MIXED = 4, N_PLACES = 5 }; /* value placements */
static const char *const place_names[N_PLACES] = {"the device", "the host", "a device pool", "a host pool",
                                                  "the device for slot 0, the host for the rest"};

/* The inputs of a run: the config's shape and modes, prompt lengths, steps, the kind of values. */
typedef struct world {
    skv_config cfg;
    int64_t n[MAXB];
    int steps;
    int vals;
    int kbase; /* V_CODES: (layer l, sequence b, KV head h) has k = min(kbase + (l B + b) Hk + h, KMAX) */
    uint64_t seed;
    const char *name;
} world;

static size_t out_count(const world *w) { return (size_t)w->steps * w->cfg.n_layers * w->cfg.batch_size * w->cfg.n_q_heads * w->cfg.head_dim; }
static int32_t cand_max(const skv_config *c) { return c->max_prompt_len / c->chunk_size - c->n_local_chunks - c->n_outlier_chunks; }
static size_t sel_count(const world *w) { return (size_t)w->steps * w->cfg.n_layers * w->cfg.batch_size * w->cfg.n_kv_heads * cand_max(&w->cfg); }

static int code_k(const world *w, int l, int b, int h)
{
    const int k = w->kbase + (l * w->cfg.batch_size + b) * w->cfg.n_kv_heads + h;
    return k > KMAX ? KMAX : k;
}

/* The code of dimension d of token t (V_CODES): exponent field d mod 16, the mantissa and sign
   cycling with t (every finite code of the band within 16 tokens); dimension 15 is +-448, so the
   row's k is the head's; every 97th token a zero row (k = SKV_FP8_EXP_MIN). */
static uint8_t code_of(int64_t t, int d, int h)
{
    if (t % 97 == 5) return 0;
    const int ee = d % 16;
    if (d == 15) return t & 1 ? 0xfe : 0x7e;
    const int mm = (int)((t + d / 16 + h) % (ee == 15 ? 7 : 8));
    const int sg = (int)((t / 8 + d / 16 + d) & 1);
    return (uint8_t)((sg << 7) | (ee << 3) | mm);
}

/* One token's values of KV head h (row of D) as the world's kind says (t: the token, -1 - step for
   a decode step's new token). */
static void make_row(const world *w, int l, int b, int h, int64_t t, skv_bf16 *row)
{
    const int D = w->cfg.head_dim;
    if (w->vals == V_CODES) {
        const int k = code_k(w, l, b, h);
        const int64_t tt = t < 0 ? 1000003 - t : t;
        for (int d = 0; d < D; d++) row[d] = skv_fp8_decode(code_of(tt, d, h), k);
    } else if (w->vals == V_ROUNDED) { /* decode(encode(v)), one token row as a chunk of one */
        uint8_t rec[1024 + 16];
        skv_fp8_encode_chunk(row, D, 1, D, rec);
        skv_fp8_decode_chunk(rec, 1, D, row);
    }
}

/* The prompt of (l, b): keys of low rank, values as the world says (v [n, Hk D]). */
static void make_prompt(const world *w, skvt_rng *r, int l, int b, skv_bf16 *k, skv_bf16 *v)
{
    const int Hk = w->cfg.n_kv_heads, D = w->cfg.head_dim;
    skvt_lowrank_prompt(r, (size_t)Hk * D, w->n[b], k, v);
    for (int64_t t = 0; t < w->n[b]; t++)
        for (int h = 0; h < Hk; h++) make_row(w, l, b, h, t, v + ((size_t)t * Hk + h) * D);
}

/* a: the stored codes are the intended ones (the host encoding of the prompt's chunks). */
static void check_codes(const world *w)
{
    const int Hk = w->cfg.n_kv_heads, D = w->cfg.head_dim, c = w->cfg.chunk_size;
    const size_t vrec = skv_value_chunk_bytes(SKV_VALUE_FP8, c, D);
    uint8_t *rec = skvt_xmalloc(vrec);
    skv_bf16 *v = skvt_xmalloc((size_t)c * Hk * D * 2);
    long bad = 0, seen[256] = {0};
    for (int l = 0; l < w->cfg.n_layers; l++)
        for (int b = 0; b < w->cfg.batch_size; b++)
            for (int64_t t0 = 0; t0 + c <= w->n[b]; t0 += c) {
                for (int i = 0; i < c; i++)
                    for (int h = 0; h < Hk; h++) make_row(w, l, b, h, t0 + i, v + ((size_t)i * Hk + h) * D);
                for (int h = 0; h < Hk; h++) {
                    skv_fp8_encode_chunk(v + (size_t)h * D, (int64_t)Hk * D, c, D, rec);
                    for (int i = 0; i < c; i++) {
                        const int zero = (t0 + i) % 97 == 5;
                        bad += ((const int8_t *)(rec + (size_t)c * D))[i] != (zero ? SKV_FP8_EXP_MIN : code_k(w, l, b, h));
                        for (int d = 0; d < D; d++) {
                            const uint8_t want = code_of(t0 + i, d, h), got = rec[(size_t)i * D + d];
                            bad += got != want && !(zero && got == 0);
                            seen[got]++;
                        }
                    }
                }
            }
    int missing = 0;
    for (int x = 0; x < 256; x++) missing += x != 0x7f && x != 0xff && !seen[x];
    SKVT_CHECK(bad == 0 && missing == 0, "%s: the host encoding of the code prompts: %ld codes or exponents not the "
               "intended ones, %d finite codes never stored", w->name, bad, missing);
    free(rec), free(v);
}

/* Runs the world on backend be with value dtype vd and placement pl: outs [steps][L][B Hq D],
   sels [steps][L][B][Hk][cand_max] (-2 past each head's S). 1: done, 0: skipped, -1: failed. */
static int run(const world *w, skv_backend be, int vd, int pl, float *outs, int32_t *sels)
{
    skv_config c = w->cfg;
    c.backend = be;
    c.value_dtype = (skv_value_dtype)vd;
    if (pl == P_HOST || pl == P_POOL_HOST || pl == P_MIXED) {
        /* a budget of exactly the chunk caches: every store on the host; one store more: slot 0's on the device */
        skv_memory_info mi;
        if (!SKVT_CHECK_STATUS(skv_cache_memory_info(&c, &mi), SKV_OK, "memory info")) return -1;
        const int64_t slots = mi.device_value_slots + mi.host_value_slots;
        c.value_device_bytes = pl == P_POOL_HOST ? 0 : (int64_t)mi.value_cache_bytes * slots;
        if (pl == P_MIXED) {
            c.value_device_bytes = (int64_t)mi.value_store_bytes + (int64_t)mi.value_cache_bytes * (slots - 1);
            if (!SKVT_CHECK_STATUS(skv_cache_memory_info(&c, &mi), SKV_OK, "memory info (mixed)") ||
                !SKVT_CHECK(mi.device_value_slots == 1 && mi.host_value_slots == slots - 1,
                            "%s: a budget of one store and %lld chunk caches places %lld slots on the device, %lld on "
                            "the host", w->name, (long long)(slots - 1), (long long)mi.device_value_slots,
                            (long long)mi.host_value_slots))
                return -1;
        }
    }
    if (pl == P_POOL_DEVICE || pl == P_POOL_HOST) c.pool_device_bytes = 256ll << 20;
    if (pl == P_POOL_HOST) c.pool_host_bytes = 128ll << 20;
    skv_cache *cache = NULL;
    skv_status st = skv_cache_create(&c, &cache);
    if (!SKVT_CHECK_STATUS(st, SKV_OK, "create")) {
        printf("  %s: %s, %s values on %s, %s: %s\n", w->name, skv_backend_name(be), vd ? "fp8" : "bf16",
               place_names[pl], c.reproducible ? "reproducible mode" : "default mode", skv_last_error());
        return -1;
    }
    skvt_rng r;
    skvt_rng_seed(&r, w->seed);
    const int L = c.n_layers, B = c.batch_size, Hk = c.n_kv_heads, D = c.head_dim, cm = cand_max(&c);
    const size_t row = (size_t)Hk * D, pb = (size_t)c.max_prompt_len * row * 2;
    skv_bf16 *k = skvt_xmalloc(pb), *v = skvt_xmalloc(pb);
    skv_bf16 *dk = skvt_dbuf(be, k, pb), *dv = skvt_dbuf(be, v, pb);
    int ret = 1;
    for (int l = 0; l < L && ret == 1; l++)
        for (int b = 0; b < B && ret == 1; b++) {
            make_prompt(w, &r, l, b, k, v);
            skvt_dput(be, dk, k, (size_t)w->n[b] * row * 2);
            skvt_dput(be, dv, v, (size_t)w->n[b] * row * 2);
            st = skv_prefill(cache, l, b, w->n[b], dk, dv, NULL);
            if (!SKVT_CHECK_STATUS(st, SKV_OK, "prefill")) printf("  %s: %s\n", w->name, skv_cache_last_error(cache)), ret = -1;
        }
    const size_t qn = (size_t)B * c.n_q_heads * D, kn = (size_t)B * row;
    skv_bf16 *q = skvt_xmalloc(qn * 2), *kk = skvt_xmalloc(kn * 2), *vv = skvt_xmalloc(kn * 2);
    float *out = skvt_xmalloc(qn * 4);
    int32_t *ids = skvt_xmalloc((size_t)cm * 4);
    skv_bf16 *dq = skvt_dbuf(be, q, qn * 2), *dkk = skvt_dbuf(be, kk, kn * 2), *dvv = skvt_dbuf(be, vv, kn * 2);
    float *dout = skvt_dbuf(be, out, qn * 4);
    for (int s = 0; s < w->steps && ret == 1; s++)
        for (int l = 0; l < L && ret == 1; l++) {
            skvt_fill_bf16_normal(&r, q, qn, s % 2 ? 0.5 : 2.0);
            skvt_fill_bf16_normal(&r, kk, kn, 1.0);
            skvt_fill_bf16_normal(&r, vv, kn, 1.0);
            for (int b = 0; b < B; b++)
                for (int h = 0; h < Hk; h++) make_row(w, l, b, h, -1 - s, vv + ((size_t)b * Hk + h) * D);
            skvt_dput(be, dq, q, qn * 2), skvt_dput(be, dkk, kk, kn * 2), skvt_dput(be, dvv, vv, kn * 2);
            memset(out, 0xff, qn * 4); /* NaN: an output the step does not write stays NaN */
            skvt_dput(be, dout, out, qn * 4);
            st = skv_decode(cache, l, dq, dkk, dvv, dout);
            if (st == SKV_OK) st = skv_cache_sync(cache);
            if (!SKVT_CHECK_STATUS(st, SKV_OK, "decode")) {
                printf("  %s: %s\n", w->name, skv_cache_last_error(cache));
                ret = -1;
                break;
            }
            skvt_dget(be, out, dout, qn * 4);
            size_t nf = 0;
            for (size_t i = 0; i < qn; i++) nf += !isfinite(out[i]);
            if (!SKVT_CHECK(nf == 0, "%s: %s, %s values on %s: step %d layer %d: %zu outputs not finite (unwritten?)",
                            w->name, skv_backend_name(be), vd ? "fp8" : "bf16", place_names[pl], s, l, nf))
                ret = -1;
            memcpy(outs + ((size_t)s * L + l) * qn, out, qn * 4);
            for (int b = 0; b < B; b++) {
                skv_seq_info info;
                skv_cache_seq_info(cache, l, b, &info);
                for (int h = 0; h < Hk; h++) {
                    int32_t *dst = sels + ((((size_t)s * L + l) * B + b) * Hk + h) * cm;
                    for (int i = 0; i < cm; i++) dst[i] = -2;
                    if (!SKVT_CHECK_STATUS(skv_cache_selected(cache, l, b, h, ids), SKV_OK, "selected")) ret = -1;
                    else memcpy(dst, ids, (size_t)info.n_selected * 4);
                }
            }
        }
    skvt_dfree(be, dk, k), skvt_dfree(be, dv, v), skvt_dfree(be, dq, q), skvt_dfree(be, dkk, kk);
    skvt_dfree(be, dvv, vv), skvt_dfree(be, dout, out);
    free(k), free(v), free(q), free(kk), free(vv), free(out), free(ids);
    skv_cache_free(cache);
    return ret;
}

/* A run's results. */
typedef struct res {
    float *out;
    int32_t *sel;
    int ok;
    char what[160];
} res;

static res get(const world *w, skv_backend be, int vd, int pl)
{
    res x;
    x.out = skvt_xmalloc(out_count(w) * 4);
    x.sel = skvt_xmalloc(sel_count(w) * 4);
    snprintf(x.what, sizeof x.what, "%s (%s values on %s, %s)", skv_backend_name(be), vd ? "fp8" : "bf16",
             place_names[pl], w->cfg.reproducible ? "reproducible mode" : "default mode");
    x.ok = run(w, be, vd, pl, x.out, x.sel) == 1;
    return x;
}

static void drop(res *x) { free(x->out), free(x->sel); }

/* Where (step, layer, sequence, query head, dim) output i is. */
static void where(const world *w, size_t i, char *buf, size_t cap)
{
    const skv_config *c = &w->cfg;
    const size_t D = (size_t)c->head_dim, hq = (size_t)c->n_q_heads, qn = (size_t)c->batch_size * hq * D;
    snprintf(buf, cap, "step %zu layer %zu seq %zu query head %zu dim %zu", i / qn / c->n_layers, i / qn % c->n_layers,
             i % qn / (hq * D), i % (hq * D) / D, i % D);
}

/* Outputs of a and b bitwise equal (and the selections, with sel). */
static void same_bits(const world *w, const res *a, const res *b, int sel)
{
    if (!a->ok || !b->ok) return;
    const size_t n = out_count(w);
    size_t bad = n;
    for (size_t i = 0; i < n && bad == n; i++)
        if (memcmp(&a->out[i], &b->out[i], 4)) bad = i;
    char at[160] = "";
    if (bad < n) where(w, bad, at, sizeof at);
    SKVT_CHECK(bad == n, "%s: %s vs %s: outputs differ first at %s: %.9g vs %.9g", w->name, a->what, b->what, at,
               bad < n ? a->out[bad] : 0.0, bad < n ? b->out[bad] : 0.0);
    if (sel) SKVT_CHECK(!memcmp(a->sel, b->sel, sel_count(w) * 4), "%s: %s vs %s: selections differ", w->name, a->what, b->what);
}

/* The largest relative L2 error over the (step, layer, sequence, query head) rows of a against b. */
static double worst_rel(const world *w, const res *a, const res *b, size_t *at)
{
    const size_t D = (size_t)w->cfg.head_dim, rows = out_count(w) / D;
    double worst = 0.0;
    *at = 0;
    for (size_t r = 0; r < rows; r++) {
        double e = 0.0, m = 0.0;
        for (size_t d = 0; d < D; d++) {
            const double x = a->out[r * D + d], y = b->out[r * D + d];
            e += (x - y) * (x - y), m += y * y;
        }
        const double rel = m > 0.0 ? sqrt(e / m) : sqrt(e);
        if (rel > worst || rel != rel) worst = rel, *at = r * D;
    }
    return worst;
}

/* Outputs of a within tol (relative L2 per head) of b's; bitwise equality is printed. */
static void close_to(const world *w, const res *a, const res *b, double tol)
{
    if (!a->ok || !b->ok) return;
    size_t at;
    const double e = worst_rel(w, a, b, &at);
    char pos[160];
    where(w, at, pos, sizeof pos);
    SKVT_CHECK(e <= tol, "%s: %s vs %s: relative error %.3g at %s (tolerance %.1g)", w->name, a->what, b->what, e, pos, tol);
    printf("  %s: %s vs %s: %s (worst relative error %.3g)\n", w->name, a->what, b->what,
           memcmp(a->out, b->out, out_count(w) * 4) ? "not bitwise equal" : "bitwise equal", e);
}

/* ---- the cases --------------------------------------------------------------------------------- */

/* The code worlds: D 128 with rank 32 (the fragment kernel in the default mode), D 64 and D 128 with
   rank 24 (the general kernel, its DT = 64 and DT = 128 instances). */
static world code_world(int variant, int kbase, uint64_t seed)
{
    static const char *const names[3] = {"codes D 128 (fragment kernel)", "codes D 64", "codes D 128 rank 24"};
    const int D = variant == 1 ? 64 : 128;
    world w;
    memset(&w, 0, sizeof w);
    skv_config c = skv_config_default();
    c.n_layers = 2, c.batch_size = 2, c.n_kv_heads = 8, c.n_q_heads = 16, c.head_dim = D;
    c.rank = variant == 2 ? 24 : 32, c.chunk_size = 8, c.budget = SKV_BUDGET_ALL, c.n_outlier_chunks = 2, c.n_local_chunks = 2;
    c.max_prompt_len = 640, c.gen_capacity = 8;
    w.cfg = c;
    w.n[0] = 640, w.n[1] = 589;
    w.steps = 3, w.vals = V_CODES, w.kbase = kbase, w.seed = seed;
    w.name = names[variant];
    return w;
}

/* a: every code with every k, through every attention kernel. */
static void case_codes(uint64_t seed)
{
    for (int variant = 0; variant < 3; variant++)
        for (int kb = SKV_FP8_EXP_MIN; kb <= KMAX; kb += 32) {
            world w = code_world(variant, kb, seed + (uint64_t)(kb + 1000 * variant));
            printf("a. %s, k from %d\n", w.name, kb);
            check_codes(&w);
            w.cfg.reproducible = 1;
            res rf = get(&w, SKV_BACKEND_REF, 1, P_DEVICE), cu = get(&w, SKV_BACKEND_CUDA, 1, P_DEVICE);
            res ch = get(&w, SKV_BACKEND_CUDA, 1, P_HOST);
            same_bits(&w, &cu, &rf, 1);
            same_bits(&w, &ch, &rf, 1);
            drop(&rf), drop(&cu), drop(&ch);
            w.cfg.reproducible = 0;
            res f8 = get(&w, SKV_BACKEND_CUDA, 1, P_DEVICE), b16 = get(&w, SKV_BACKEND_CUDA, 0, P_DEVICE);
            res f8h = get(&w, SKV_BACKEND_CUDA, 1, P_HOST), b16h = get(&w, SKV_BACKEND_CUDA, 0, P_HOST);
            same_bits(&w, &f8, &b16, 1);
            same_bits(&w, &f8h, &b16h, 1);
            drop(&f8), drop(&b16), drop(&f8h), drop(&b16h);
        }
}

/* The shapes of b .. e: Llama-3-8B-like and GQA 9 / 3 with D 64. */
static world shape_world(int which, int vals, uint64_t seed)
{
    world w;
    memset(&w, 0, sizeof w);
    skv_config c = skv_config_default();
    c.n_layers = 1, c.batch_size = 2, c.chunk_size = 8, c.gen_capacity = 8;
    if (which == 0) {
        c.n_q_heads = 32, c.n_kv_heads = 8, c.head_dim = 128, c.rank = 64, c.budget = 512;
        c.n_outlier_chunks = 8, c.n_local_chunks = 4, c.max_prompt_len = 3072;
        w.n[0] = 3072, w.n[1] = 2301;
        w.name = vals == V_ROUNDED ? "Hq 32 Hk 8 D 128 (pre-rounded)" : "Hq 32 Hk 8 D 128";
    } else {
        c.n_q_heads = 9, c.n_kv_heads = 3, c.head_dim = 64, c.rank = 48, c.budget = 256;
        c.n_outlier_chunks = 4, c.n_local_chunks = 2, c.max_prompt_len = 2048;
        w.n[0] = 1999, w.n[1] = 2048;
        w.name = vals == V_ROUNDED ? "Hq 9 Hk 3 D 64 (pre-rounded)" : "Hq 9 Hk 3 D 64";
    }
    w.cfg = c;
    w.steps = 3, w.vals = vals, w.seed = seed;
    return w;
}

/* b and c: against ref and cpu (reproducible), against bf16 (default mode). */
static void case_random(uint64_t seed)
{
    for (int which = 0; which < 2; which++) {
        world w = shape_world(which, V_NORMAL, seed + 100 + (uint64_t)which);
        printf("b. %s, reproducible mode: cuda fp8 against ref and cpu\n", w.name);
        w.cfg.reproducible = 1;
        res cu = get(&w, SKV_BACKEND_CUDA, 1, P_DEVICE), rf = get(&w, SKV_BACKEND_REF, 1, P_DEVICE);
        res cp = get(&w, SKV_BACKEND_CPU, 1, P_DEVICE);
        same_bits(&w, &cu, &rf, 1);
        same_bits(&w, &cp, &rf, 1);
        drop(&cu), drop(&rf), drop(&cp);
        printf("c. %s, default mode: cuda fp8 and bf16 select alike\n", w.name);
        w.cfg.reproducible = 0;
        res f8 = get(&w, SKV_BACKEND_CUDA, 1, P_DEVICE), b16 = get(&w, SKV_BACKEND_CUDA, 0, P_DEVICE);
        if (f8.ok && b16.ok)
            SKVT_CHECK(!memcmp(f8.sel, b16.sel, sel_count(&w) * 4), "%s: fp8 and bf16 caches select differently", w.name);
        close_to(&w, &f8, &b16, 0.1); /* fp8's rounding (2^-4 relative per value), not garbage */
        drop(&f8), drop(&b16);
    }
}

/* d: pre-rounded values, fp8 against bf16. */
static void case_rounded(uint64_t seed)
{
    for (int which = 0; which < 2; which++) {
        world w = shape_world(which, V_ROUNDED, seed + 200 + (uint64_t)which);
        for (int repro = 1; repro >= 0; repro--) {
            printf("d. %s, %s: cuda fp8 against cuda bf16\n", w.name, repro ? "reproducible mode" : "default mode");
            w.cfg.reproducible = repro;
            res f8 = get(&w, SKV_BACKEND_CUDA, 1, P_DEVICE), b16 = get(&w, SKV_BACKEND_CUDA, 0, P_DEVICE);
            if (repro) same_bits(&w, &f8, &b16, 1);
            else close_to(&w, &f8, &b16, 1e-6);
            if (!repro && f8.ok && b16.ok)
                SKVT_CHECK(!memcmp(f8.sel, b16.sel, sel_count(&w) * 4), "%s: selections differ", w.name);
            drop(&f8), drop(&b16);
        }
    }
}

/* e: host placement and pools against the device placement. */
static void case_placement(uint64_t seed)
{
    for (int which = 0; which < 2; which++) {
        world w = shape_world(which, V_NORMAL, seed + 300 + (uint64_t)which);
        for (int repro = 1; repro >= 0; repro--) {
            printf("e. %s, %s: fp8 values on the host and in pools\n", w.name, repro ? "reproducible mode" : "default mode");
            w.cfg.reproducible = repro;
            res x[N_PLACES];
            for (int p = 0; p < N_PLACES; p++) x[p] = get(&w, SKV_BACKEND_CUDA, 1, p);
            if (repro) {
                for (int p = 1; p < N_PLACES; p++) same_bits(&w, &x[p], &x[P_DEVICE], 1);
            } else {
                same_bits(&w, &x[P_POOL_DEVICE], &x[P_DEVICE], 1);
                same_bits(&w, &x[P_POOL_HOST], &x[P_HOST], 1);
                static const int split[2] = {P_HOST, P_MIXED}; /* placements with host slots */
                for (int j = 0; j < 2; j++) {
                    const int p = split[j];
                    close_to(&w, &x[p], &x[P_DEVICE], 1e-6);
                    if (x[p].ok && x[P_DEVICE].ok)
                        SKVT_CHECK(!memcmp(x[p].sel, x[P_DEVICE].sel, sel_count(&w) * 4),
                                   "%s: %s and %s select differently", w.name, x[p].what, x[P_DEVICE].what);
                }
            }
            for (int p = 0; p < N_PLACES; p++) drop(&x[p]);
        }
    }
}

/* f: the memory query. */
static void case_memory(void)
{
    for (int which = 0; which < 2; which++) {
        world w = shape_world(which, V_NORMAL, 0);
        skv_config c = w.cfg;
        c.backend = SKV_BACKEND_CUDA;
        skv_memory_info m8, m16;
        c.value_dtype = SKV_VALUE_BF16;
        if (!SKVT_CHECK_STATUS(skv_cache_memory_info(&c, &m16), SKV_OK, "memory info (bf16)")) continue;
        c.value_dtype = SKV_VALUE_FP8;
        if (!SKVT_CHECK_STATUS(skv_cache_memory_info(&c, &m8), SKV_OK, "memory info (fp8)")) continue;
        const size_t vrec = (size_t)c.chunk_size * c.head_dim + (((size_t)c.chunk_size + 15) & ~(size_t)15);
        const size_t want = ((size_t)c.n_kv_heads * cand_max(&c) * vrec + 255) & ~(size_t)255;
        SKVT_CHECK(vrec == skv_value_chunk_bytes(SKV_VALUE_FP8, c.chunk_size, c.head_dim), "%s: vrec %zu", w.name, vrec);
        SKVT_CHECK(m8.value_store_bytes == want, "%s: fp8 value_store_bytes %zu, want Hk cand_max vrec rounded to 256 = %zu",
                   w.name, m8.value_store_bytes, want);
        SKVT_CHECK(m8.value_store_bytes < m16.value_store_bytes && m8.device_bytes < m16.device_bytes,
                   "%s: fp8 should take less: value store %zu vs %zu, device %zu vs %zu bytes", w.name,
                   m8.value_store_bytes, m16.value_store_bytes, m8.device_bytes, m16.device_bytes);
    }
}

int main(void)
{
    const uint64_t seed = skvt_base_seed("test_cuda_fp8");
    case_memory();
    if (skv_backend_available(SKV_BACKEND_CUDA) != SKV_OK) {
        printf("cuda unavailable: %s\n", skv_last_error());
        skvt_skip("no usable CUDA device: the GPU cases of test_cuda_fp8 did not run");
        return skvt_finish();
    }
    double t = skvt_now_s();
    case_codes(seed);
    printf("(a: %.1f s)\n", skvt_now_s() - t);
    t = skvt_now_s();
    case_random(seed);
    printf("(b, c: %.1f s)\n", skvt_now_s() - t);
    t = skvt_now_s();
    case_rounded(seed);
    printf("(d: %.1f s)\n", skvt_now_s() - t);
    t = skvt_now_s();
    case_placement(seed);
    printf("(e: %.1f s)\n", skvt_now_s() - t);
    return skvt_finish();
}
