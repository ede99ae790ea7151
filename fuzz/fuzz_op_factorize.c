/*
 * fuzz_op_factorize.c - skv_op_factorize on ref or cpu.
 *
 * Carves n <= 256, d <= 128 (n*d <= 16384), 1 <= r <= min(n, d, 16); about
 * half the inputs plant one bad argument (n, d or r out of range, a NULL) and
 * some plant NaN/Inf in a (the fill's raw bytes also reach 3.4e38). Asserts:
 *  - the status is defined, has a message, and is the one the planted error
 *    calls for (valid input: SKV_OK, or SKV_ERR_NUMERICAL from LAPACK; NaN, Inf
 *    or |a| > SKV_MAX_INPUT_MAGNITUDE: SKV_ERR_NONFINITE, as skv_prefill);
 *  - on error u and w hold their poison, bytes unchanged;
 *  - on success u and w are fully written and finite (the inputs it accepts
 *    cannot overflow), and, when |a| <= 1e5, U W is a rank-r approximation:
 *    ||A - UW|| <= ||A||, and ~= A when r = min(n, d);
 *  - a second call gives the same bits (determinism);
 *  - a unchanged, canaries intact.
 */
#include <stdio.h>

#include "fuzz_op_util.h"

static const char OP[] = "skv_op_factorize";

enum { BAD_NONE, BAD_N, BAD_D, BAD_R_LOW, BAD_R_HIGH, BAD_NULL_A, BAD_NULL_U, BAD_NULL_W, BAD_COUNT };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    skv_backend be = skvf_backend(&d);
    int64_t n = skvf_range(&d, 1, 256);
    int32_t dim = (int32_t)skvf_range(&d, 1, 128);
    if (n * dim > 16384) n = 16384 / dim;
    int32_t rmax = (int32_t)(n < dim ? n : dim);
    if (rmax > 16) rmax = 16;
    int32_t r = (int32_t)skvf_range(&d, 1, rmax);
    int bad = (int)skvf_range(&d, 0, 2 * BAD_COUNT);
    if (bad >= BAD_COUNT) bad = BAD_NONE;
    int allow_nan = skvf_range(&d, 0, 5) == 0;

    skvf_buf a, u, w, u2, w2;
    skvf_buf_in(&a, "a", (size_t)n * dim * sizeof(skv_bf16));
    skvf_buf_out(&u, "u", (size_t)n * r * sizeof(float));
    skvf_buf_out(&w, "w", (size_t)r * dim * sizeof(float));
    skvf_fill_bf16(&d, a.p, (size_t)n * dim, allow_nan);
    if (allow_nan && skvf_bool(&d)) skvf_plant_bad(&d, a.p, (size_t)n * dim);
    skvf_buf_snap(&a);

    /* what the call gets */
    int64_t cn = n;
    int32_t cd = dim, cr = r;
    const skv_bf16 *pa = a.p;
    float *pu = u.p, *pw = w.p;
    unsigned must_fail = 0;
    switch (bad) {
    case BAD_N: {
        static const int64_t ns[] = {0, -1, INT64_MIN, INT64_MAX, (int64_t)1 << 40};
        cn = skvf_pick(&d, ns, 5);
        break;
    }
    case BAD_D: {
        static const int64_t ds[] = {0, -1, INT32_MIN, INT32_MAX, 65537};
        cd = (int32_t)skvf_pick(&d, ds, 5);
        break;
    }
    case BAD_R_LOW: cr = (int32_t)skvf_range(&d, INT32_MIN, 0); break;
    case BAD_R_HIGH: cr = (int32_t)(n < dim ? n : dim) + (int32_t)skvf_range(&d, 1, 1000); break;
    case BAD_NULL_A: pa = NULL; break;
    case BAD_NULL_U: pu = NULL; break;
    case BAD_NULL_W: pw = NULL; break;
    default: break;
    }
    if (bad >= BAD_N && bad <= BAD_R_HIGH) must_fail |= SKVF_BIT(SKV_ERR_INVALID_ARGUMENT) | SKVF_BIT(SKV_ERR_SIZE_OVERFLOW);
    if (bad >= BAD_NULL_A) must_fail |= SKVF_BIT(SKV_ERR_NULL_POINTER);
    size_t n_bad = skvf_bf16_count_refused(a.p, (size_t)n * dim);
    if (n_bad) must_fail |= SKVF_BIT(SKV_ERR_NONFINITE);

    char params[160];
    snprintf(params, sizeof params, "backend %s n %lld d %d r %d bad %d nonfinite %zu", skv_backend_name(be),
             (long long)cn, cd, cr, bad, n_bad);
    skv_status st = skv_op_factorize(be, cn, cd, cr, pa, pu, pw);
    skvf_expect(st, must_fail, SKVF_BIT(SKV_ERR_NUMERICAL), OP, params);
    skvf_buf_unchanged(&a, OP, "(input)");

    if (st != SKV_OK) {
        skvf_buf_unchanged(&u, OP, "on error");
        skvf_buf_unchanged(&w, OP, "on error");
    } else {
        skvf_guarded_check(u.p, "u");
        skvf_guarded_check(w.p, "w");
        const float *U = u.p, *W = w.p;
        const skv_bf16 *A = a.p;
        int bounded = skvf_bf16_maxabs(A, (size_t)n * dim) <= SKVF_BOUND;
        for (size_t i = 0; i < (size_t)n * r; i++)
            if (!isfinite(U[i]))
                skvf_fail("%s: u[%zu] = %g (%s)", OP, i, (double)U[i], params);
        for (size_t i = 0; i < (size_t)r * dim; i++)
            if (!isfinite(W[i]))
                skvf_fail("%s: w[%zu] = %g (%s)", OP, i, (double)W[i], params);
        if (bounded) {
            double na = 0.0, ne = 0.0;
            for (int64_t t = 0; t < n; t++)
                for (int32_t j = 0; j < dim; j++) {
                    double x = (double)skvf_bf16_f(A[t * dim + j]), y = 0.0;
                    for (int32_t q = 0; q < r; q++) y += (double)U[t * r + q] * (double)W[(size_t)q * dim + j];
                    na += x * x;
                    ne += (x - y) * (x - y);
                }
            /* the best rank-r approximation is never worse than 0; float U, W add ~1e-6 relative */
            if (ne > na * (1.0 + 1e-4) + 1e-30)
                skvf_fail("%s: ||A - UW||^2 = %g > ||A||^2 = %g (%s)", OP, ne, na, params);
            if (r == (n < dim ? n : dim) && ne > na * 1e-8 + 1e-30)
                skvf_fail("%s: full rank but ||A - UW||^2 = %g, ||A||^2 = %g (%s)", OP, ne, na, params);
            skvf_note_checked(be);
        }
        /* determinism: the same call again gives the same bits */
        skvf_buf_out(&u2, "u2", u.bytes);
        skvf_buf_out(&w2, "w2", w.bytes);
        st = skv_op_factorize(be, cn, cd, cr, pa, u2.p, w2.p);
        skvf_check_status(st, OP);
        if (st != SKV_OK) skvf_fail("%s: second identical call returned %s (%s)", OP, skv_status_string(st), params);
        if (memcmp(u.p, u2.p, u.bytes) || memcmp(w.p, w2.p, w.bytes))
            skvf_fail("%s: two identical calls gave different factors (%s)", OP, params);
        skvf_buf_free(&u2);
        skvf_buf_free(&w2);
    }
    skvf_buf_free(&a);
    skvf_buf_free(&u);
    skvf_buf_free(&w);
    return 0;
}
