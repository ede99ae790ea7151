/*
 * test_rank.c - a rank per (layer, sequence): config.rank = 0 with rank_max and
 * rank_error_target (docs/DESIGN.md 3.1), and the rank checks of validation and prefill.
 *
 *  - The rule: keys of known spectrum (exact rank-k keys plus noise at several levels, a
 *    geometric spectrum, noise too strong for rank_max) are prefilled on ref, cpu and (where
 *    it is available) cuda. From the factors the cache stored (read from its snapshot) the
 *    test recomputes in double the relative error ||A - U_r W_r||_F / ||A||_F: it meets the
 *    target at the chosen r, and dropping the last kept column misses it (the smallest rank),
 *    or r = rank_max when nothing meets it; columns r.. of U and rows r.. of W are zero (the
 *    rebuild at rank_max is the rank-r truncation), the kept columns' energies do not
 *    increase, and seq_info.rank is r.
 *  - Across backends: in the reproducible mode the ranks and the whole snapshot (U, W and
 *    every other tensor) are bitwise equal to ref's, and so are decode outputs; in the
 *    default mode the ranks equal ref's on these well-separated spectra and the outputs are
 *    within 1e-1 relative (the flat-noise slot keeps noise directions of the route's choosing).
 *  - Snapshots: a loaded cache reports the same ranks and saves back to the same bytes.
 *  - Errors: rank_max and rank_error_target out of range (messages name the field), rank
 *    against n_kv_heads * head_dim; a 4096-token prompt at rank 192 with budget 128 is
 *    accepted (the rank is no longer held against the shortest valid prompt), a prompt
 *    shorter than the rank is SKV_ERR_PROMPT_TOO_SHORT naming rank and n.
 *  - The routes' own column order (ref, cpu's routes, cuda's): printed for information; the
 *    cache sorts in every case.
 * Seeds are printed; SKV_SEED=N replays a run.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static uint64_t g_seed;

static uint32_t rd32(const unsigned char *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t rd64(const unsigned char *p) { return rd32(p) | (uint64_t)rd32(p + 4) << 32; }

enum { L = 2, B = 2, HK = 2, D = 32, DW = HK * D, NTOK = 256, RMAX = 24, STEPS = 3 };

static skv_config base_cfg(skv_backend be, int repro)
{
    skv_config c = skv_config_default();
    c.backend = be;
    c.n_layers = L;
    c.batch_size = B;
    c.n_q_heads = 2 * HK;
    c.n_kv_heads = HK;
    c.head_dim = D;
    c.chunk_size = 8;
    c.budget = 32;
    c.n_outlier_chunks = 2;
    c.n_local_chunks = 2;
    c.max_prompt_len = 512;
    c.gen_capacity = 8;
    c.rope.theta = 10000.0f;
    c.rank = 0;
    c.rank_max = RMAX;
    c.rank_error_target = 0.1f;
    c.reproducible = repro;
    return c;
}

/* The spectra of the L * B slots: rank 6 + noise 0 (bf16 rounding only), rank 6 + 2%,
   geometric 0.7^i, rank 6 + 5% (needs more than rank_max). */
static void spectrum(int slot, double *sigma)
{
    for (int i = 0; i < DW; i++) {
        switch (slot) {
        case 0: sigma[i] = i < 6 ? 1.0 : 0.0; break;
        case 1: sigma[i] = i < 6 ? 1.0 : 0.02; break;
        case 2: sigma[i] = pow(0.7, i); break;
        default: sigma[i] = i < 6 ? 1.0 : 0.05; break;
        }
    }
}

typedef struct {
    skv_bf16 *k[L * B], *v[L * B];
    skv_bf16 *q[STEPS][L], *kn[STEPS][L], *vn[STEPS][L];
} inputs;

static void make_inputs(inputs *in, uint64_t seed)
{
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    double sigma[DW];
    for (int s = 0; s < L * B; s++) {
        spectrum(s, sigma);
        in->k[s] = skvt_spectrum_bf16(&r, NTOK, DW, sigma);
        in->v[s] = skvt_xmalloc((size_t)NTOK * DW * 2);
        skvt_fill_bf16_normal(&r, in->v[s], (size_t)NTOK * DW, 1.0);
    }
    for (int t = 0; t < STEPS; t++)
        for (int l = 0; l < L; l++) {
            in->q[t][l] = skvt_xmalloc((size_t)B * 2 * HK * D * 2);
            in->kn[t][l] = skvt_xmalloc((size_t)B * DW * 2);
            in->vn[t][l] = skvt_xmalloc((size_t)B * DW * 2);
            skvt_fill_bf16_normal(&r, in->q[t][l], (size_t)B * 2 * HK * D, 1.0);
            skvt_fill_bf16_normal(&r, in->kn[t][l], (size_t)B * DW, 1.0);
            skvt_fill_bf16_normal(&r, in->vn[t][l], (size_t)B * DW, 1.0);
        }
}

static void free_inputs(inputs *in)
{
    for (int s = 0; s < L * B; s++) free(in->k[s]), free(in->v[s]);
    for (int t = 0; t < STEPS; t++)
        for (int l = 0; l < L; l++) free(in->q[t][l]), free(in->kn[t][l]), free(in->vn[t][l]);
}

typedef struct {
    int ok;
    int32_t rank[L * B];
    unsigned char *snap; /* after prefill */
    size_t snap_len;
    float *out; /* [STEPS][L][B * Hq * D] */
} run_result;

static size_t out_len(void) { return (size_t)STEPS * L * B * 2 * HK * D; }

/* A device copy of host data on cuda (skvt_dbuf allocates only), the host pointer itself elsewhere. */
static void *dcopy(skv_backend be, void *host, size_t bytes)
{
    void *d = skvt_dbuf(be, host, bytes);
    skvt_dput(be, d, host, bytes);
    return d;
}

static skv_cache *prefill_cache(skv_backend be, int repro, const inputs *in)
{
    skv_config c = base_cfg(be, repro);
    skv_cache *cache = NULL;
    skv_status st = skv_cache_create(&c, &cache);
    if (st == SKV_ERR_UNSUPPORTED) {
        skvt_skip("backend refused the configuration");
        return NULL;
    }
    if (!SKVT_CHECK_STATUS(st, SKV_OK, "create")) return NULL;
    for (int s = 0; s < L * B; s++) {
        const size_t bytes = (size_t)NTOK * DW * 2;
        void *dk = dcopy(be, in->k[s], bytes), *dv = dcopy(be, in->v[s], bytes);
        st = skv_prefill(cache, s / B, s % B, NTOK, dk, dv, NULL);
        SKVT_CHECK(st == SKV_OK, "%s: prefill of slot %d: %s", skv_backend_name(be), s, skv_cache_last_error(cache));
        skvt_dfree(be, dk, in->k[s]);
        skvt_dfree(be, dv, in->v[s]);
    }
    return cache;
}

static void run(skv_backend be, int repro, const inputs *in, run_result *res)
{
    memset(res, 0, sizeof *res);
    skv_cache *cache = prefill_cache(be, repro, in);
    if (!cache) return;
    for (int s = 0; s < L * B; s++) {
        skv_seq_info info;
        SKVT_CHECK_STATUS(skv_cache_seq_info(cache, s / B, s % B, &info), SKV_OK, "seq_info");
        res->rank[s] = info.rank;
    }
    SKVT_CHECK_STATUS(skv_cache_save_buffer(cache, NULL, 0, &res->snap_len), SKV_OK, "save size");
    res->snap = skvt_xmalloc(res->snap_len);
    SKVT_CHECK_STATUS(skv_cache_save_buffer(cache, res->snap, res->snap_len, &res->snap_len), SKV_OK, "save");
    /* a loaded cache: the same ranks, the same bytes */
    skv_cache *back = NULL;
    skv_config lc = base_cfg(be, repro);
    skv_status lst = skv_cache_load_buffer(res->snap, res->snap_len, &lc, &back);
    if (lst == SKV_ERR_FORMAT && strstr(skv_last_error(), "CONF") && strstr(skv_last_error(), "rank_max = 0")) {
        /* a library whose snapshot CONF does not carry the 0.3 fields yet */
        skvt_skip("the snapshot's CONF section does not carry rank_max: load with rank = 0 untested");
    } else if (SKVT_CHECK(lst == SKV_OK, "%s: load: %s", skv_backend_name(be), skv_last_error())) {
        for (int s = 0; s < L * B; s++) {
            skv_seq_info info;
            skv_cache_seq_info(back, s / B, s % B, &info);
            SKVT_CHECK(info.rank == res->rank[s], "%s: slot %d: rank %d after load, %d before",
                       skv_backend_name(be), s, info.rank, res->rank[s]);
        }
        size_t len2 = 0;
        skv_cache_save_buffer(back, NULL, 0, &len2);
        unsigned char *again = skvt_xmalloc(len2);
        skv_cache_save_buffer(back, again, len2, &len2);
        SKVT_CHECK(len2 == res->snap_len && !memcmp(again, res->snap, len2),
                   "%s: a loaded cache saves other bytes", skv_backend_name(be));
        free(again);
        skv_cache_free(back);
    }
    /* decode */
    const size_t qn = (size_t)B * 2 * HK * D;
    res->out = skvt_xmalloc(out_len() * sizeof(float));
    for (int t = 0; t < STEPS; t++)
        for (int l = 0; l < L; l++) {
            void *dq = dcopy(be, in->q[t][l], qn * 2), *dk = dcopy(be, in->kn[t][l], (size_t)B * DW * 2);
            void *dv = dcopy(be, in->vn[t][l], (size_t)B * DW * 2);
            float *host = res->out + ((size_t)t * L + l) * qn;
            float *dout = skvt_dbuf(be, host, qn * 4);
            skv_status st = skv_decode(cache, l, dq, dk, dv, dout);
            SKVT_CHECK(st == SKV_OK, "%s: decode: %s", skv_backend_name(be), skv_cache_last_error(cache));
            skv_cache_sync(cache);
            skvt_dget(be, host, dout, qn * 4);
            skvt_dfree(be, dq, in->q[t][l]);
            skvt_dfree(be, dk, in->kn[t][l]);
            skvt_dfree(be, dv, in->vn[t][l]);
            skvt_dfree(be, dout, host);
        }
    skv_cache_free(cache);
    res->ok = 1;
}

/* The stored U [NTOK, RMAX] and W [RMAX, DW] of slot s, from a snapshot taken right after
   prefill (no decode: no generated rows, no selection). The SLOT state's size is what the
   payload leaves after the tensors, so the test does not depend on it. */
static int stored_factors(const unsigned char *snap, size_t len, int slot, int32_t n_cand, int32_t n_local,
                          const unsigned char **u, const unsigned char **w)
{
    size_t pos = 16;
    int seen = -1;
    while (pos + 16 <= len) {
        const uint32_t tag = rd32(snap + pos);
        const uint64_t plen = rd64(snap + pos + 8);
        if (tag == 0x544f4c53u /* "SLOT" */ && ++seen == slot) {
            const size_t O = 2, c = 8;
            size_t tensors = (size_t)NTOK * RMAX * 2 + (size_t)RMAX * DW * 2 + (size_t)HK * n_cand * D * 2 +
                             (size_t)HK * n_cand * 4 + (size_t)HK * O * 4 + 2 * (size_t)HK * O * c * D * 2 +
                             2 * (size_t)HK * n_local * D * 2 + (size_t)HK * n_cand * c * D * 2;
            if (plen < tensors) return 0;
            const unsigned char *p = snap + pos + 16 + (plen - tensors);
            *u = p;
            *w = p + (size_t)NTOK * RMAX * 2;
            return 1;
        }
        pos += 16 + plen + 4;
    }
    return 0;
}

static double bf(const unsigned char *p, size_t i) { return (double)skv_bf16_to_float((skv_bf16)(p[2 * i] | p[2 * i + 1] << 8)); }

/* ||A - U_k W_k||_F / ||A||_F in double with the first k stored columns. */
static double trunc_err(const skv_bf16 *a, const unsigned char *u, const unsigned char *w, int k)
{
    double num = 0, den = 0;
    for (int t = 0; t < NTOK; t++)
        for (int d = 0; d < DW; d++) {
            double x = (double)skv_bf16_to_float(a[(size_t)t * DW + d]), y = 0;
            for (int p = 0; p < k; p++) y += bf(u, (size_t)t * RMAX + p) * bf(w, (size_t)p * DW + d);
            num += (x - y) * (x - y);
            den += x * x;
        }
    return sqrt(num / den);
}

static void check_rule(skv_backend be, const inputs *in, const run_result *res)
{
    const double target = 0.1, slack = 4e-3;
    for (int s = 0; s < L * B; s++) {
        const int r = res->rank[s];
        const int32_t N = NTOK / 8 - 2, n_cand = N - 2, n_local = NTOK - N * 8;
        const unsigned char *u = NULL, *w = NULL;
        if (!SKVT_CHECK(stored_factors(res->snap, res->snap_len, s, n_cand, n_local, &u, &w),
                        "%s: slot %d: no factors in the snapshot", skv_backend_name(be), s))
            continue;
        if (!SKVT_CHECK(r >= 1 && r <= RMAX, "%s: slot %d: rank %d outside [1, %d]", skv_backend_name(be), s, r, RMAX))
            continue;
        int zero = 1;
        for (int t = 0; t < NTOK; t++)
            for (int p = r; p < RMAX; p++) zero &= bf(u, (size_t)t * RMAX + p) == 0.0;
        for (int p = r; p < RMAX; p++)
            for (int d = 0; d < DW; d++) zero &= bf(w, (size_t)p * DW + d) == 0.0;
        SKVT_CHECK(zero, "%s: slot %d: columns %d.. of U / rows of W not zero", skv_backend_name(be), s, r);
        double prev = INFINITY;
        int sorted = 1;
        for (int p = 0; p < r; p++) {
            double e = 0;
            for (int t = 0; t < NTOK; t++) e += bf(u, (size_t)t * RMAX + p) * bf(u, (size_t)t * RMAX + p);
            sorted &= e <= prev * (1 + 1e-2);
            prev = e;
        }
        SKVT_CHECK(sorted, "%s: slot %d: the kept columns' energies increase", skv_backend_name(be), s);
        const double er = trunc_err(in->k[s], u, w, r);
        if (r < RMAX || er <= target)
            SKVT_CHECK(er <= target + slack, "%s: slot %d: rank %d has error %.5f > target %.2f", skv_backend_name(be),
                       s, r, er, target);
        if (r > 1) {
            const double e1 = trunc_err(in->k[s], u, w, r - 1);
            SKVT_CHECK(e1 > target - slack, "%s: slot %d: rank %d - 1 already meets the target (%.5f): not the smallest",
                       skv_backend_name(be), s, r, e1);
        }
        printf("  %s slot %d: rank %d, error %.4f\n", skv_backend_name(be), s, r, er);
    }
    /* the spectra's ranks: 6 (exact rank 6), 6 (2%% noise), 7 (0.7^i), rank_max (5%% noise) */
    static const int want[L * B] = {6, 6, 7, RMAX};
    for (int s = 0; s < L * B; s++)
        SKVT_CHECK(res->rank[s] == want[s], "%s: slot %d: rank %d, the spectrum gives %d", skv_backend_name(be), s,
                   res->rank[s], want[s]);
}

static void test_backends(void)
{
    inputs in;
    make_inputs(&in, g_seed);
    static const skv_backend all[] = {SKV_BACKEND_REF, SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
    for (int repro = 0; repro < 2; repro++) {
        run_result ref;
        run(SKV_BACKEND_REF, repro, &in, &ref);
        if (!ref.ok) continue;
        check_rule(SKV_BACKEND_REF, &in, &ref);
        for (size_t o = 1; o < sizeof all / sizeof all[0]; o++) {
            if (skv_backend_available(all[o]) != SKV_OK) {
                if (!repro) skvt_skip("cuda backend not available on this machine");
                continue;
            }
            run_result oth;
            run(all[o], repro, &in, &oth);
            if (!oth.ok) continue;
            const char *name = skv_backend_name(all[o]);
            check_rule(all[o], &in, &oth);
            for (int s = 0; s < L * B; s++)
                SKVT_CHECK(oth.rank[s] == ref.rank[s], "%s%s: slot %d: rank %d, ref %d", name,
                           repro ? " (reproducible)" : "", s, oth.rank[s], ref.rank[s]);
            if (repro) {
                SKVT_CHECK(oth.snap_len == ref.snap_len && !memcmp(oth.snap, ref.snap, ref.snap_len),
                           "%s (reproducible): the snapshot after prefill differs from ref's", name);
                SKVT_CHECK(!memcmp(oth.out, ref.out, out_len() * sizeof(float)),
                           "%s (reproducible): decode outputs differ from ref's", name);
            } else {
                double num = 0, den = 0;
                for (size_t i = 0; i < out_len(); i++) {
                    const double d = (double)oth.out[i] - (double)ref.out[i];
                    num += d * d;
                    den += (double)ref.out[i] * ref.out[i];
                }
                const double rel = sqrt(num / (den > 0 ? den : 1));
                /* the slot of flat 5% noise keeps 18 of its 58 equal noise directions: which ones is
                   the route's choice, so the rebuilt keys differ there by about the noise */
                SKVT_CHECK(rel <= 1e-1, "%s: decode outputs %.3g relative from ref's", name, rel);
                printf("  %s: decode outputs %.2e relative from ref's\n", name, rel);
            }
            free(oth.snap);
            free(oth.out);
        }
        free(ref.snap);
        free(ref.out);
    }
    free_inputs(&in);
}

static int msg_has(const char *a, const char *b) { return strstr(skv_last_error(), a) && (!b || strstr(skv_last_error(), b)); }

static void test_errors(void)
{
    skv_config c = base_cfg(SKV_BACKEND_REF, 0);
    SKVT_CHECK_STATUS(skv_config_validate(&c), SKV_OK, "rank 0, rank_max 24");
    c.rank_max = 0;
    SKVT_CHECK(skv_config_validate(&c) == SKV_ERR_INVALID_CONFIG && msg_has("rank_max", NULL),
               "rank_max 0 with rank 0: %s", skv_last_error());
    c.rank_max = DW + 1;
    SKVT_CHECK(skv_config_validate(&c) == SKV_ERR_INVALID_CONFIG && msg_has("rank_max", NULL),
               "rank_max > Hk*D: %s", skv_last_error());
    c.rank_max = DW;
    SKVT_CHECK_STATUS(skv_config_validate(&c), SKV_OK, "rank_max = Hk*D");
    const float bad_t[] = {0.0f, 1.0f, -0.1f, 1.5f, NAN, INFINITY};
    for (size_t i = 0; i < sizeof bad_t / sizeof bad_t[0]; i++) {
        c.rank_error_target = bad_t[i];
        SKVT_CHECK(skv_config_validate(&c) == SKV_ERR_INVALID_CONFIG && msg_has("rank_error_target", NULL),
                   "rank_error_target %g: %s", (double)bad_t[i], skv_last_error());
    }
    c = base_cfg(SKV_BACKEND_REF, 0);
    c.rank = -1;
    SKVT_CHECK(skv_config_validate(&c) == SKV_ERR_INVALID_CONFIG && msg_has("rank", NULL), "rank -1: %s",
               skv_last_error());
    c.rank = DW + 1;
    SKVT_CHECK(skv_config_validate(&c) == SKV_ERR_INVALID_CONFIG && msg_has("rank", NULL), "rank > Hk*D: %s",
               skv_last_error());
    c.rank = 16, c.rank_max = -5, c.rank_error_target = 7.0f; /* ignored with rank > 0 */
    SKVT_CHECK_STATUS(skv_config_validate(&c), SKV_OK, "rank_max and rank_error_target ignored with rank > 0");
    skv_config d = skv_config_default();
    SKVT_CHECK(d.rank_max == 0 && d.rank_error_target == 0.1f, "defaults rank_max %d, rank_error_target %g",
               d.rank_max, (double)d.rank_error_target);
    /* the 0.2 struct (ending at reproducible, padding included) is still accepted */
    struct al { char x; skv_config y; };
    const size_t a = offsetof(struct al, y), s02 = (offsetof(skv_config, reproducible) + 4 + a - 1) / a * a;
    skv_config e;
    SKVT_CHECK_STATUS(skv_config_init(&e, s02), SKV_OK, "skv_config_init with the 0.2 size");
    SKVT_CHECK_STATUS(skv_config_init(&e, offsetof(skv_config, reproducible)), SKV_OK, "the 0.1 size");
    SKVT_CHECK_STATUS(skv_config_init(&e, s02 + 4), SKV_ERR_INVALID_ARGUMENT, "a size no skv_config had");

    /* rank 192, budget 128 at a 4096-token prompt (the shortest valid prompt is 160 tokens) */
    skv_backend bes[] = {SKV_BACKEND_REF, SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
    skvt_rng r;
    skvt_rng_seed(&r, g_seed + 1);
    const int64_t n = 4096, w = 2 * 128;
    skv_bf16 *k = skvt_xmalloc((size_t)n * w * 2), *v = skvt_xmalloc((size_t)n * w * 2);
    skvt_lowrank_prompt(&r, (size_t)w, n, k, v);
    for (int rank0 = 0; rank0 < 2; rank0++)
        for (size_t b = 0; b < 3; b++) {
            if (skv_backend_available(bes[b]) != SKV_OK) continue;
            skv_config g = skv_config_default();
            g.backend = bes[b];
            g.n_layers = 1, g.n_q_heads = 4, g.n_kv_heads = 2, g.head_dim = 128;
            g.chunk_size = 8, g.budget = 128, g.n_outlier_chunks = 2, g.n_local_chunks = 2;
            g.max_prompt_len = 4096, g.gen_capacity = 4;
            g.rank = rank0 ? 0 : 192;
            g.rank_max = 192;
            skv_cache *cache = NULL;
            if (!SKVT_CHECK(skv_cache_create(&g, &cache) == SKV_OK, "%s: rank 192, budget 128: %s",
                            skv_backend_name(bes[b]), skv_last_error()))
                continue;
            void *dk = dcopy(bes[b], k, (size_t)n * w * 2), *dv = dcopy(bes[b], v, (size_t)n * w * 2);
            skv_status st = skv_prefill(cache, 0, 0, 184, dk, dv, NULL);
            const char *m = skv_cache_last_error(cache);
            SKVT_CHECK(st == SKV_ERR_PROMPT_TOO_SHORT && strstr(m, "n = 184") &&
                           strstr(m, rank0 ? "rank_max" : "rank") && strstr(m, "192"),
                       "%s: a 184-token prompt at rank %s 192: %s (%s)", skv_backend_name(bes[b]),
                       rank0 ? "max" : "", skv_status_string(st), m);
            st = skv_prefill(cache, 0, 0, n, dk, dv, NULL);
            SKVT_CHECK(st == SKV_OK, "%s: the 4096-token prompt at rank 192: %s", skv_backend_name(bes[b]),
                       skv_cache_last_error(cache));
            skv_seq_info info;
            skv_cache_seq_info(cache, 0, 0, &info);
            SKVT_CHECK(rank0 ? (info.rank >= 1 && info.rank <= 192) : info.rank == 192, "%s: seq_info.rank %d",
                       skv_backend_name(bes[b]), info.rank);
            if (rank0) printf("  %s: the low-rank 4096-token prompt takes rank %d\n", skv_backend_name(bes[b]), info.rank);
            skvt_dfree(bes[b], dk, k);
            skvt_dfree(bes[b], dv, v);
            skv_cache_free(cache);
        }
    free(k);
    free(v);
}

/* For information: whether each route's own U columns come in non-increasing energy. */
static void report_routes(void)
{
    skvt_rng r;
    skvt_rng_seed(&r, g_seed + 2);
    const int n = 512, d = 128, rk = 24;
    double sigma[128];
    for (int i = 0; i < d; i++) sigma[i] = pow(0.9, i) * (1.0 + 0.3 * skvt_rng_uniform(&r));
    skv_bf16 *a = skvt_spectrum_bf16(&r, n, d, sigma);
    float *u = skvt_xmalloc((size_t)n * rk * 4), *w = skvt_xmalloc((size_t)rk * d * 4);
    static const skv_backend bes[] = {SKV_BACKEND_REF, SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
    static const skv_factorize_route routes[] = {SKV_FACTORIZE_AUTO, SKV_FACTORIZE_FAST, SKV_FACTORIZE_FALLBACK,
                                                 SKV_FACTORIZE_EXACT, SKV_FACTORIZE_CANONICAL};
    static const char *const rn[] = {"auto", "fast", "fallback", "exact", "canonical"};
    for (size_t b = 0; b < 3; b++) {
        if (skv_backend_available(bes[b]) != SKV_OK) continue;
        for (size_t q = 0; q < 5; q++) {
            void *da = dcopy(bes[b], a, (size_t)n * d * 2);
            float *du = skvt_dbuf(bes[b], u, (size_t)n * rk * 4), *dw = skvt_dbuf(bes[b], w, (size_t)rk * d * 4);
            skv_status st = skv_op_factorize_route(bes[b], routes[q], n, d, rk, da, du, dw);
            skvt_dget(bes[b], u, du, (size_t)n * rk * 4);
            skvt_dfree(bes[b], da, a);
            skvt_dfree(bes[b], du, u);
            skvt_dfree(bes[b], dw, w);
            if (st != SKV_OK) {
                printf("  route %s on %s: %s\n", rn[q], skv_backend_name(bes[b]), skv_status_string(st));
                continue;
            }
            int inc = 0;
            double prev = INFINITY;
            for (int p = 0; p < rk; p++) {
                double e = 0;
                for (int t = 0; t < n; t++) e += (double)u[(size_t)t * rk + p] * u[(size_t)t * rk + p];
                inc += e > prev;
                prev = e;
            }
            printf("  route %s on %s: U's columns %s (%d increases)\n", rn[q], skv_backend_name(bes[b]),
                   inc ? "not ordered by energy" : "ordered by non-increasing energy", inc);
        }
    }
    skv_op_release();
    free(a), free(u), free(w);
}

int main(void)
{
    g_seed = skvt_base_seed("test_rank");
    test_errors();
    test_backends();
    report_routes();
    return skvt_finish();
}
