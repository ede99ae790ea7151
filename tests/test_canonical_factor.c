/*
 * test_canonical_factor.c - the canonical factorization (route
 * SKV_FACTORIZE_CANONICAL, docs/DESIGN.md 10.1, lib/skv_factor_canon.h):
 *
 *  bitwise   U and W of cpu (and cuda where skv_backend_available says so,
 *            else one counted skip per case) equal ref's bit for bit, on
 *            random and structured inputs: normal, low-rank keys, a spike
 *            spectrum, a flat spectrum, zero columns, a column with one huge
 *            value (2^32) over tiny others, subnormal-range values, n < d,
 *            r = d, r = 1, r > 160, n not a power of two, odd d, n = 1;
 *  accuracy  err = ||A - U W||_F (float U, W) against opt, the best rank-r
 *            error of the bf16 A (LAPACK dsyevd on its double Gram): excess
 *            err / opt - 1 <= 5e-3 on the spectra of test_accuracy (1/i,
 *            exp-to-bf16-floor, clustered) and the spike matrix; for exactly
 *            low-rank inputs err <= 1e-4 ||A||;
 *  repeat    a second cpu call gives the same bits (no state, no thread
 *            dependence);
 *  portable  the cpu backend with its SIMD kernels off (skv_cpu_set_simd(0):
 *            the header's reference loops) equals ref too;
 *  cache     a cache with factorize = SKV_FACTORIZE_CANONICAL (reproducible =
 *            0: the canonical decode slots are not this test's) prefills on
 *            ref, cpu (and cuda) and keeps the route.
 *
 * Seeds: skvt_base_seed (SKV_SEED), printed; every case draws from it.
 */
#include <cblas.h>
#include <lapacke.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "skv_numerics.h"
#include "testutil.h"

static skvt_rng rng;
static int have_cuda;

static double *dalloc(size_t n) { return skvt_xmalloc(n * sizeof(double)); }
static skv_bf16 bf(double x) { return skv_bf16_from_float((float)x); }





/* best rank-r error ||A - A_r||_F of the bf16 matrix (double Gram, dsyevd) and ||A||_F */
static double best_rank_error(const skv_bf16 *a, int n, int d, int r, double *norm)
{
    double *ad = dalloc((size_t)n * d), *g = dalloc((size_t)d * d), *ev = dalloc((size_t)d);
    skvt_bf16_to_double(a, ad, (size_t)n * d);
    cblas_dsyrk(CblasColMajor, CblasUpper, CblasNoTrans, d, n, 1.0, ad, d, 0.0, g, d);
    int info = LAPACKE_dsyevd(LAPACK_COL_MAJOR, 'N', 'U', d, g, d, ev);
    SKVT_CHECK(info == 0, "oracle dsyevd info %d", info);
    double tail = 0, all = 0;
    for (int i = 0; i < d; i++) {
        double l = ev[i] > 0 ? ev[i] : 0;
        all += l;
        if (i < d - r) tail += l;
    }
    free(ad);
    free(g);
    free(ev);
    *norm = sqrt(all);
    return sqrt(tail);
}

/* ||A - U W||_F in double (float factors) */
static double factor_error(const skv_bf16 *a, const float *u, const float *w, int n, int d, int r)
{
    double *e = dalloc((size_t)n * d), *ud = dalloc((size_t)n * r), *wd = dalloc((size_t)r * d);
    skvt_bf16_to_double(a, e, (size_t)n * d);
    for (size_t i = 0; i < (size_t)n * r; i++) ud[i] = u[i];
    for (size_t i = 0; i < (size_t)r * d; i++) wd[i] = w[i];
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, r, -1.0, ud, r, wd, d, 1.0, e, d);
    double ne = 0;
    for (size_t i = 0; i < (size_t)n * d; i++) ne += e[i] * e[i];
    free(e);
    free(ud);
    free(wd);
    return sqrt(ne);
}

/* The spike matrix of test_accuracy: 1/i spectrum with ~1/4 of the rows an exactly rank-1
   attention-sink direction 2^9 larger. */
static double round_bits(double x, int bits)
{
    int e;
    double m = frexp(x, &e);
    return ldexp(nearbyint(ldexp(m, bits)), e - bits);
}
static skv_bf16 *make_spike(int n, int d)
{
    double *sigma = dalloc((size_t)d);
    for (int i = 0; i < d; i++) sigma[i] = 1.0 / (i + 1.0);
    skv_bf16 *a = skvt_spectrum_bf16(&rng, n, d, sigma);
    double *v = dalloc((size_t)d);
    for (int j = 0; j < d; j++) v[j] = round_bits(skvt_rng_normal(&rng), 4);
    for (int t = 0; t < n; t++) {
        if (skvt_rng_uniform(&rng) >= 0.25) continue;
        double c = round_bits(0.5 + skvt_rng_uniform(&rng), 4) * (skvt_rng_u64(&rng) & 1 ? -1.0 : 1.0);
        for (int j = 0; j < d; j++) a[(size_t)t * d + j] = bf(512.0 * c * v[j]);
    }
    free(sigma);
    free(v);
    return a;
}

/* Low-rank keys: rank 8 plus 2% noise, one column 16x larger (a key outlier channel). */
static skv_bf16 *make_lowrank(int n, int d)
{
    const int k = 8;
    double *c = dalloc((size_t)n * k), *b = dalloc((size_t)k * d);
    for (size_t i = 0; i < (size_t)n * k; i++) c[i] = skvt_rng_normal(&rng);
    for (size_t i = 0; i < (size_t)k * d; i++) b[i] = skvt_rng_normal(&rng);
    skv_bf16 *a = skvt_xmalloc(sizeof(skv_bf16) * (size_t)n * d);
    for (int t = 0; t < n; t++)
        for (int j = 0; j < d; j++) {
            double s = 0;
            for (int q = 0; q < k; q++) s += c[(size_t)t * k + q] * b[(size_t)q * d + j];
            s = s / sqrt((double)k) + 0.02 * skvt_rng_normal(&rng);
            a[(size_t)t * d + j] = bf(j == d / 3 ? 16.0 * s : s);
        }
    free(c);
    free(b);
    return a;
}

enum { K_NORMAL, K_LOWRANK, K_SPIKE, K_FLAT, K_INV, K_EXP, K_CLUSTER, K_ZEROCOLS, K_HUGE, K_SUBNORMAL, K_RANK24 };
static const char *kind_names[] = {"normal", "lowrank",  "spike", "flat",      "1/i",   "exp-to-bf16-floor",
                                   "clustered", "zero-cols", "huge-col", "subnormal", "rank24"};

static skv_bf16 *make_input(int kind, int n, int d, int r)
{
    int k = n < d ? n : d;
    skv_bf16 *a = NULL;
    double *sigma = dalloc((size_t)k);
    switch (kind) {
    case K_LOWRANK: a = make_lowrank(n, d); break;
    case K_SPIKE: a = make_spike(n, d); break;
    case K_FLAT:
    case K_INV:
    case K_EXP:
    case K_CLUSTER:
        for (int i = 0; i < k; i++) {
            double x = i + 1.0;
            if (kind == K_FLAT) sigma[i] = 1.0;
            else if (kind == K_INV) sigma[i] = 1.0 / x;
            else if (kind == K_EXP) sigma[i] = fmax(pow(2.0, -8.0 * i / (0.75 * r)), 0x1p-8);
            else sigma[i] = (i >= r - 4 && i <= r + 3) ? (1.0 - 1e-4 * (i - r + 4)) / sqrt(r - 3.0) : 1.0 / sqrt(x);
        }
        a = skvt_spectrum_bf16(&rng, n, d, sigma);
        break;
    case K_RANK24: {
        int *c = skvt_xmalloc(sizeof(int) * (size_t)n * 24), *b = skvt_xmalloc(sizeof(int) * (size_t)24 * d);
        for (size_t i = 0; i < (size_t)n * 24; i++) c[i] = (int)skvt_rng_range(&rng, -1, 1);
        for (size_t i = 0; i < (size_t)24 * d; i++) b[i] = (int)skvt_rng_range(&rng, -4, 4);
        a = skvt_xmalloc(sizeof(skv_bf16) * (size_t)n * d);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < d; j++) {
                int s = 0;
                for (int t = 0; t < 24; t++) s += c[i * 24 + t] * b[t * d + j];
                a[(size_t)i * d + j] = bf((double)s);
            }
        free(c);
        free(b);
        break;
    }
    default: /* normal, and the structured variants built on it */
        a = skvt_xmalloc(sizeof(skv_bf16) * (size_t)n * d);
        skvt_fill_bf16_normal(&rng, a, (size_t)n * d, 1.0);
        if (kind == K_ZEROCOLS) /* every third column zero, and the first and last */
            for (int t = 0; t < n; t++)
                for (int j = 0; j < d; j++)
                    if (j % 3 == 1 || j == 0 || j == d - 1) a[(size_t)t * d + j] = (t & 1) ? 0x8000 : 0;
        if (kind == K_HUGE) { /* column 1: one entry 2^32, the rest ~2^-20; column 2: 2^-100 scale */
            int c1 = d > 1 ? 1 : 0, c2 = d > 2 ? 2 : 0;
            for (int t = 0; t < n; t++) {
                a[(size_t)t * d + c1] = bf(0x1p-20 * skvt_rng_normal(&rng));
                a[(size_t)t * d + c2] = bf(0x1p-100 * skvt_rng_normal(&rng));
            }
            a[(size_t)(n / 2) * d + c1] = bf(-0x1p32);
        }
        if (kind == K_SUBNORMAL) /* every entry in the bf16/float subnormal range or near it */
            for (size_t i = 0; i < (size_t)n * d; i++) {
                double x = skvt_rng_normal(&rng) * ((i % 5) ? 0x1p-128 : 0x1p-120);
                a[i] = bf(x);
            }
        break;
    }
    free(sigma);
    return a;
}

/* One backend's canonical factors (host arrays u, w); SKV_OK or the status. */
static skv_status run_backend(skv_backend be, const skv_bf16 *a, int n, int d, int r, float *u, float *w, double *secs)
{
    size_t ab = sizeof(skv_bf16) * (size_t)n * d, ub = sizeof(float) * (size_t)n * r, wb = sizeof(float) * (size_t)r * d;
    void *da = skvt_dbuf(be, (void *)a, ab), *du = skvt_dbuf(be, u, ub), *dw = skvt_dbuf(be, w, wb);
    skvt_dput(be, da, a, ab);
    double t0 = skvt_now_s();
    skv_status s = skv_op_factorize_route(be, SKV_FACTORIZE_CANONICAL, n, d, r, da, du, dw);
    *secs = skvt_now_s() - t0;
    skvt_dget(be, u, du, ub);
    skvt_dget(be, w, dw, wb);
    skvt_dfree(be, da, (void *)a);
    skvt_dfree(be, du, u);
    skvt_dfree(be, dw, w);
    return s;
}

/* Number of differing 32-bit words; *first gets the first index. */
static size_t bits_differ(const float *x, const float *y, size_t count, size_t *first)
{
    size_t nd = 0;
    *first = 0;
    for (size_t i = 0; i < count; i++)
        if (memcmp(x + i, y + i, sizeof(float))) {
            if (!nd) *first = i;
            nd++;
        }
    return nd;
}

static void compare(const char *what, const float *u0, const float *w0, const float *u1, const float *w1, int n,
                    int d, int r)
{
    size_t fu, fw, du = bits_differ(u0, u1, (size_t)n * r, &fu), dw = bits_differ(w0, w1, (size_t)r * d, &fw);
    SKVT_CHECK(du == 0, "%s: U differs from ref in %zu of %zu entries (first %zu: %a vs %a)", what, du,
               (size_t)n * r, fu, du ? (double)u1[fu] : 0.0, du ? (double)u0[fu] : 0.0);
    SKVT_CHECK(dw == 0, "%s: W differs from ref in %zu of %zu entries (first %zu: %a vs %a)", what, dw,
               (size_t)r * d, fw, dw ? (double)w1[fw] : 0.0, dw ? (double)w0[fw] : 0.0);
}

/* acc: 0 none, 1 excess <= 5e-3, 2 exactly low rank: err <= 1e-4 ||A||. */
static void run_case(int kind, int n, int d, int r, int acc)
{
    char what[160];
    skv_bf16 *a = make_input(kind, n, d, r);
    float *u0 = skvt_xmalloc(sizeof(float) * (size_t)n * r), *w0 = skvt_xmalloc(sizeof(float) * (size_t)r * d);
    float *u1 = skvt_xmalloc(sizeof(float) * (size_t)n * r), *w1 = skvt_xmalloc(sizeof(float) * (size_t)r * d);
    double tref = 0, tcpu = 0, tcu = 0;
    snprintf(what, sizeof what, "%s n=%d d=%d r=%d", kind_names[kind], n, d, r);
    skv_status s = run_backend(SKV_BACKEND_REF, a, n, d, r, u0, w0, &tref);
    if (!SKVT_CHECK_STATUS(s, SKV_OK, "ref canonical factorize")) {
        printf("  %s: %s\n", what, skv_last_error());
        goto done;
    }
    long nonfinite = 0;
    for (size_t i = 0; i < (size_t)n * r; i++) nonfinite += !isfinite(u0[i]);
    for (size_t i = 0; i < (size_t)r * d; i++) nonfinite += !isfinite(w0[i]);
    SKVT_CHECK(nonfinite == 0, "%s: %ld non-finite factor entries", what, nonfinite);

    s = run_backend(SKV_BACKEND_CPU, a, n, d, r, u1, w1, &tcpu);
    if (SKVT_CHECK_STATUS(s, SKV_OK, "cpu canonical factorize")) {
        char w2[200];
        snprintf(w2, sizeof w2, "cpu %s", what);
        compare(w2, u0, w0, u1, w1, n, d, r);
        double t2;
        memset(u1, 0, sizeof(float) * (size_t)n * r);
        s = run_backend(SKV_BACKEND_CPU, a, n, d, r, u1, w1, &t2);
        snprintf(w2, sizeof w2, "cpu (again) %s", what);
        if (SKVT_CHECK_STATUS(s, SKV_OK, "cpu canonical factorize, again")) compare(w2, u0, w0, u1, w1, n, d, r);
    } else
        printf("  %s: %s\n", what, skv_last_error());
    if (have_cuda) {
        s = run_backend(SKV_BACKEND_CUDA, a, n, d, r, u1, w1, &tcu);
        char w2[200];
        snprintf(w2, sizeof w2, "cuda %s", what);
        if (SKVT_CHECK_STATUS(s, SKV_OK, "cuda canonical factorize")) compare(w2, u0, w0, u1, w1, n, d, r);
        else printf("  %s: %s\n", w2, skv_last_error());
    } else
        skvt_skip("cuda: not available");

    if (acc) {
        double norm, opt = best_rank_error(a, n, d, r, &norm), err = factor_error(a, u0, w0, n, d, r);
        if (acc == 1) {
            double excess = err / opt - 1.0;
            printf("  accuracy %-40s opt %.6g err %.6g excess %.3e\n", what, opt / norm, err / norm, excess);
            SKVT_CHECK(excess <= 5e-3, "%s: excess %.3e > 5e-3", what, excess);
        } else {
            printf("  accuracy %-40s err %.3e of ||A|| (exactly low rank)\n", what, err / norm);
            SKVT_CHECK(err <= 1e-4 * norm, "%s: err %.3e > 1e-4 ||A||", what, err / norm);
        }
    }
    printf("%-48s ref %.2f s, cpu %.3f s%s\n", what, tref, tcpu, have_cuda ? ", cuda ran" : "");
done:
    free(a);
    free(u0);
    free(w0);
    free(u1);
    free(w1);
}

/* The cpu backend with SIMD off: the portable code runs the reference loops. */
static void run_portable(int kind, int n, int d, int r)
{
    skv_bf16 *a = make_input(kind, n, d, r);
    float *u0 = skvt_xmalloc(sizeof(float) * (size_t)n * r), *w0 = skvt_xmalloc(sizeof(float) * (size_t)r * d);
    float *u1 = skvt_xmalloc(sizeof(float) * (size_t)n * r), *w1 = skvt_xmalloc(sizeof(float) * (size_t)r * d);
    double t;
    char what[160];
    snprintf(what, sizeof what, "cpu without SIMD %s n=%d d=%d r=%d", kind_names[kind], n, d, r);
    int32_t level = skv_cpu_simd_level();
    if (SKVT_CHECK_STATUS(run_backend(SKV_BACKEND_REF, a, n, d, r, u0, w0, &t), SKV_OK, "ref canonical factorize") &&
        SKVT_CHECK_STATUS(skv_cpu_set_simd(0), SKV_OK, "skv_cpu_set_simd(0)")) {
        if (SKVT_CHECK_STATUS(run_backend(SKV_BACKEND_CPU, a, n, d, r, u1, w1, &t), SKV_OK, what))
            compare(what, u0, w0, u1, w1, n, d, r);
        SKVT_CHECK_STATUS(skv_cpu_set_simd(level), SKV_OK, "skv_cpu_set_simd(restore)");
        printf("%-48s compared\n", what);
    }
    free(a);
    free(u0);
    free(w0);
    free(u1);
    free(w1);
}

/* A cache whose prefill takes the canonical route, on backend be. */
static void run_cache(skv_backend be)
{
    skv_config c = skv_config_default();
    c.n_layers = 1, c.n_q_heads = 4, c.n_kv_heads = 2, c.head_dim = 32, c.rank = 8, c.budget = 32;
    c.n_outlier_chunks = 2, c.n_local_chunks = 1, c.max_prompt_len = 256, c.gen_capacity = 4;
    c.backend = be;
    c.factorize = SKV_FACTORIZE_CANONICAL;
    const int64_t n = 200;
    const size_t row = (size_t)c.n_kv_heads * c.head_dim, bytes = sizeof(skv_bf16) * n * row;
    skv_bf16 *k = skvt_xmalloc(bytes), *v = skvt_xmalloc(bytes);
    skvt_lowrank_prompt(&rng, row, n, k, v);
    void *dk = skvt_dbuf(be, k, bytes), *dv = skvt_dbuf(be, v, bytes);
    skvt_dput(be, dk, k, bytes);
    skvt_dput(be, dv, v, bytes);
    skv_cache *cache = NULL;
    char what[96];
    snprintf(what, sizeof what, "%s cache, factorize = CANONICAL", skv_backend_name(be));
    if (SKVT_CHECK_STATUS(skv_cache_create(&c, &cache), SKV_OK, what)) {
        skv_status st = skv_prefill(cache, 0, 0, n, dk, dv, NULL);
        if (st == SKV_OK) st = skv_cache_sync(cache);
        if (!SKVT_CHECK_STATUS(st, SKV_OK, what)) printf("  %s: %s\n", what, skv_last_error());
        SKVT_CHECK(skv_cache_config(cache)->factorize == SKV_FACTORIZE_CANONICAL, "%s: the route is kept", what);
        skv_cache_free(cache);
        printf("%-48s prefilled\n", what);
    }
    skvt_dfree(be, dk, k);
    skvt_dfree(be, dv, v);
    free(k);
    free(v);
}

int main(void)
{
    uint64_t seed = skvt_base_seed("test_canonical_factor");
    skvt_rng_seed(&rng, seed);
    have_cuda = skv_backend_available(SKV_BACKEND_CUDA) == SKV_OK;
    printf("cuda: %s\n", have_cuda ? "available" : "not available (its comparisons are skipped)");
    /* bitwise on small and odd shapes */
    run_case(K_NORMAL, 300, 64, 16, 0);
    run_case(K_NORMAL, 1, 48, 1, 0);        /* n = 1 */
    run_case(K_NORMAL, 37, 96, 37, 0);      /* n < d, r = n */
    run_case(K_NORMAL, 129, 33, 33, 0);     /* odd d, r = d */
    run_case(K_NORMAL, 257, 40, 1, 0);      /* r = 1 */
    run_case(K_FLAT, 500, 77, 20, 0);       /* flat spectrum, odd d */
    run_case(K_ZEROCOLS, 200, 48, 12, 0);   /* zero columns (+0 and -0) */
    run_case(K_HUGE, 333, 40, 10, 0);       /* 2^32 over tiny entries, a 2^-100 column */
    run_case(K_SUBNORMAL, 150, 32, 8, 0);   /* subnormal range */
    run_case(K_LOWRANK, 1000, 128, 24, 0);  /* keys of rank 8 + noise, one outlier channel */
    run_case(K_NORMAL, 600, 200, 170, 0);   /* r > 160 */
    run_case(K_RANK24, 1500, 256, 32, 2);   /* exactly rank 24: err at float rounding */
    run_case(K_NORMAL, 140000, 256, 16, 0); /* n > 2^17 (F = 16): cuda's int8 Gram, 2 token blocks, int32 sums ~2^28 */
    /* accuracy on test_accuracy's spectra (and bitwise) */
    run_case(K_INV, 2048, 256, 32, 1);
    run_case(K_EXP, 4096, 512, 160, 1);
    run_case(K_CLUSTER, 3072, 1024, 128, 1);
    run_case(K_SPIKE, 2048, 1024, 160, 1);
    /* the cpu's portable code; caches */
    run_portable(K_LOWRANK, 700, 96, 20);
    run_portable(K_NORMAL, 300, 180, 170);
    run_cache(SKV_BACKEND_REF);
    run_cache(SKV_BACKEND_CPU);
    if (have_cuda) run_cache(SKV_BACKEND_CUDA);
    else skvt_skip("cuda cache: not available");
    return skvt_finish();
}
