/*
 * fuzz_op_full_attention.c - skv_op_full_attention on ref or cpu.
 *
 * Carves Hk <= 4, G <= 4, D <= 64 (any), a scale (0 = default, ordinary,
 * tiny, huge) and n_tokens in [1, 600] keys/values [n, Hk, D]; about half the
 * inputs plant one bad argument (GQA, sizes, scale < 0 / NaN / Inf, n_tokens
 * <= 0 or > 2^31, a NULL) and some NaN/Inf in q, k or v. Asserts:
 *  - the status the planted error calls for (NONFINITE when q, k or v holds NaN, Inf or
 *    |x| > SKV_MAX_INPUT_MAGNITUDE); on error out holds its poison;
 *  - on success out is fully written: with scores that cannot overflow
 *    (the inputs it accepts are <= 2^32), finite, inside the convex hull of the values, within
 *    tolerance of a double-precision softmax attention when the scores are
 *    modest, and equal (to 1e-5 of max |v|) to skv_op_sparse_attention over
 *    the same tokens as one span on the same backend;
 *  - q, k, v unchanged, canaries intact.
 */
#include <stdio.h>

#include "fuzz_op_util.h"

static const char OP[] = "skv_op_full_attention";

/* BAD_GQA .. BAD_SCALE equal SKVF_ATTN_BAD_* (fuzz_op_util.h) */
enum { BAD_NONE, BAD_GQA, BAD_HQ_LOW, BAD_HK, BAD_D, BAD_SCALE, BAD_N, BAD_NULL_Q, BAD_NULL_K, BAD_NULL_V,
       BAD_NULL_OUT, BAD_COUNT };

#define MAXT 600

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    skv_backend be = skvf_backend(&d);
    int32_t Hk = (int32_t)skvf_range(&d, 1, 4), G = (int32_t)skvf_range(&d, 1, 4), Hq = Hk * G;
    int32_t D = (int32_t)skvf_range(&d, 1, 64);
    int64_t n = skvf_range(&d, 0, 3) == 0 ? skvf_range(&d, 1, MAXT) : skvf_range(&d, 1, 40);
    float scale;
    switch (skvf_range(&d, 0, 4)) {
    case 0: scale = 0.0f; break;
    case 1: scale = 1.0f / sqrtf((float)D); break;
    case 2: scale = (float)skvf_range(&d, 1, 1000) / 100.0f; break;
    case 3: scale = fabsf(skvf_float(&d)); if (!isfinite(scale)) scale = 1.0f; break;
    default: scale = 1e30f; break;
    }
    int bad = (int)skvf_range(&d, 0, 2 * BAD_COUNT);
    if (bad >= BAD_COUNT) bad = BAD_NONE;
    int allow_nan = skvf_range(&d, 0, 5) == 0;

    size_t nq = (size_t)Hq * D, nkv = (size_t)n * Hk * D;
    skvf_buf q, k, v, out;
    skvf_buf_in(&q, "q", nq * sizeof(skv_bf16));
    skvf_buf_in(&k, "k", nkv * sizeof(skv_bf16));
    skvf_buf_in(&v, "v", nkv * sizeof(skv_bf16));
    skvf_buf_out(&out, "out", nq * sizeof(float));
    skvf_fill_bf16(&d, q.p, nq, allow_nan);
    skvf_fill_bf16(&d, k.p, nkv, allow_nan);
    skvf_fill_bf16(&d, v.p, nkv, allow_nan);
    if (allow_nan && skvf_bool(&d)) {
        switch (skvf_range(&d, 0, 2)) {
        case 0: skvf_plant_bad(&d, q.p, nq); break;
        case 1: skvf_plant_bad(&d, k.p, nkv); break;
        default: skvf_plant_bad(&d, v.p, nkv); break;
        }
    }
    skvf_buf_snap(&q);
    skvf_buf_snap(&k);
    skvf_buf_snap(&v);

    int32_t cHq = Hq, cHk = Hk, cD = D;
    int64_t cn = n;
    float cscale = scale;
    const skv_bf16 *pq = q.p, *pk = k.p, *pv = v.p;
    float *po = out.p;
    switch (bad) {
    case BAD_GQA:
    case BAD_HQ_LOW:
    case BAD_HK:
    case BAD_D:
    case BAD_SCALE:
        if (!skvf_attn_bad_shape(&d, bad, Hq, Hk, &cHq, &cHk, &cD, &cscale)) bad = BAD_NONE;
        break;
    case BAD_N: cn = skvf_bool(&d) ? skvf_range(&d, INT64_MIN, 0) : skvf_range(&d, ((int64_t)1 << 31) + 1, INT64_MAX); break;
    case BAD_NULL_Q: pq = NULL; break;
    case BAD_NULL_K: pk = NULL; break;
    case BAD_NULL_V: pv = NULL; break;
    case BAD_NULL_OUT: po = NULL; break;
    default: break;
    }
    unsigned must_fail = 0;
    if (bad >= BAD_GQA && bad <= BAD_N) must_fail |= SKVF_BIT(SKV_ERR_INVALID_ARGUMENT) | SKVF_BIT(SKV_ERR_SIZE_OVERFLOW);
    if (bad >= BAD_NULL_Q) must_fail |= SKVF_BIT(SKV_ERR_NULL_POINTER);
    size_t n_bad = skvf_bf16_count_refused(q.p, nq) + skvf_bf16_count_refused(k.p, nkv) +
                   skvf_bf16_count_refused(v.p, nkv);
    if (n_bad) must_fail |= SKVF_BIT(SKV_ERR_NONFINITE);

    char params[200];
    snprintf(params, sizeof params, "backend %s Hq %d Hk %d D %d scale %g n %lld bad %d nonfinite %zu",
             skv_backend_name(be), cHq, cHk, cD, (double)cscale, (long long)cn, bad, n_bad);
    skv_status st = skv_op_full_attention(be, cHq, cHk, cD, cscale, pq, cn, pk, pv, po);
    skvf_expect(st, must_fail, 0, OP, params);
    skvf_buf_unchanged(&q, OP, "(input)");
    skvf_buf_unchanged(&k, OP, "(input)");
    skvf_buf_unchanged(&v, OP, "(input)");
    if (st != SKV_OK) {
        skvf_buf_unchanged(&out, OP, "on error");
    } else {
        skvf_guarded_check(out.p, "out");
        const float *O = out.p;
        const skv_bf16 *Q = q.p, *K = k.p, *V = v.p;
        float sc = scale > 0.0f ? scale : 1.0f / sqrtf((float)D);
        static double s[MAXT];
        /* the same tokens as one span */
        skvf_buf o2;
        skvf_buf_out(&o2, "out (sparse)", out.bytes);
        skv_kv_span span = {K, V, n, D, (int64_t)Hk * D};
        st = skv_op_sparse_attention(be, Hq, Hk, D, scale, Q, 1, &span, o2.p);
        if (st != SKV_OK) skvf_fail("%s: sparse_attention on the same input returned %s (%s)", OP, skv_status_string(st), params);
        const float *O2 = o2.p;
        static const skv_bf16 *kt[MAXT], *vt[MAXT];
        int checked = 0;
        for (int32_t qi = 0; qi < Hq; qi++) {
            int32_t h = qi / G;
            for (int64_t t = 0; t < n; t++) {
                kt[t] = K + ((size_t)t * Hk + h) * D;
                vt[t] = V + ((size_t)t * Hk + h) * D;
            }
            checked |= skvf_check_attention_head(OP, params, qi, Q + (size_t)qi * D, kt, vt, n, D, sc,
                                                 O + (size_t)qi * D, s);
            double vmax = skvf_bf16_maxabs(V, nkv);
            for (int32_t e = 0; e < D; e++)
                if (fabs((double)O[(size_t)qi * D + e] - (double)O2[(size_t)qi * D + e]) > vmax * 1e-5 + 1e-35)
                    skvf_fail("%s: out[%d][%d] = %.9g but sparse_attention over one span gives %.9g (%s)", OP, qi, e,
                              (double)O[(size_t)qi * D + e], (double)O2[(size_t)qi * D + e], params);
        }
        if (checked) skvf_note_checked(be);
        skvf_buf_free(&o2);
    }
    skvf_buf_free(&q);
    skvf_buf_free(&k);
    skvf_buf_free(&v);
    skvf_buf_free(&out);
    return 0;
}
