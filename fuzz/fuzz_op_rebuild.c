/*
 * fuzz_op_rebuild.c - skv_op_rebuild_keys on ref or cpu.
 *
 * Carves a rope config, D in [2, 64] even, Hk <= 4, rank <= min(16, Hk*D),
 * chunk c <= 8, S <= 8, n in [c, 256] tokens, chunk ids in [0, floor(n/c));
 * about half the inputs plant one bad argument (an invalid rope config or
 * head_dim, a size out of range, n < c, rank > Hk*D, a chunk id out of range,
 * a NULL) and some NaN/Inf in u or w. Asserts:
 *  - the status the planted error calls for; on error k_out holds its poison;
 *  - on success with |u|, |w| <= 1e5: k_out fully written and finite, and each
 *    element within tolerance of RoPE(U[t] W_h) computed in double (float
 *    accumulation and one bf16 rounding allowed); dims >= R are U W itself;
 *  - a second call gives the same bits;
 *  - u, w, chunk_ids and the tables unchanged, canaries intact.
 */
#include <stdio.h>

#include "fuzz_op_util.h"

static const char OP[] = "skv_op_rebuild_keys";

enum { BAD_NONE, BAD_ROPE, BAD_D, BAD_HK, BAD_C, BAD_S, BAD_N, BAD_RANK, BAD_ID, BAD_NULL_ROPE, BAD_NULL_U,
       BAD_NULL_W, BAD_NULL_IDS, BAD_NULL_COS, BAD_NULL_SIN, BAD_NULL_OUT, BAD_COUNT };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    skv_backend be = skvf_backend(&d);
    int32_t D = 2 * (int32_t)skvf_range(&d, 1, 32);
    int32_t Hk = (int32_t)skvf_range(&d, 1, 4);
    int32_t rmax = Hk * D < 16 ? Hk * D : 16;
    int32_t r = (int32_t)skvf_range(&d, 1, rmax);
    int32_t c = (int32_t)skvf_range(&d, 1, 8);
    int32_t S = (int32_t)skvf_range(&d, 1, 8);
    int64_t n = skvf_range(&d, c, 256);
    int bad = (int)skvf_range(&d, 0, 2 * BAD_COUNT);
    if (bad >= BAD_COUNT) bad = BAD_NONE;
    skv_rope_config rope = skvf_rope(&d, D, 1);
    if (bad == BAD_ROPE && skvf_rope_valid(&rope, D)) bad = BAD_NONE;
    int allow_nan = skvf_range(&d, 0, 5) == 0;
    int32_t R = skvf_rope_valid(&rope, D) ? skvf_rotary(&rope, D) : D;

    size_t nu = (size_t)n * r, nw = (size_t)r * Hk * D, nid = (size_t)Hk * S, nout = (size_t)Hk * S * c * D;
    skvf_buf u, w, ids, cs, sn, out;
    skvf_buf_in(&u, "u", nu * sizeof(skv_bf16));
    skvf_buf_in(&w, "w", nw * sizeof(skv_bf16));
    skvf_buf_in(&ids, "chunk_ids", nid * sizeof(int32_t));
    skvf_buf_out(&out, "k_out", nout * sizeof(skv_bf16));
    skvf_fill_bf16(&d, u.p, nu, allow_nan);
    skvf_fill_bf16(&d, w.p, nw, allow_nan);
    if (allow_nan && skvf_bool(&d)) {
        if (skvf_bool(&d)) skvf_plant_bad(&d, u.p, nu);
        else skvf_plant_bad(&d, w.p, nw);
    }
    int32_t *I = ids.p, n_chunks = (int32_t)(n / c);
    for (size_t i = 0; i < nid; i++) I[i] = (int32_t)skvf_range(&d, 0, n_chunks - 1);
    if (bad == BAD_ID) {
        static const int64_t off[] = {0, 1, 1000000, INT32_MAX};
        int64_t v = n_chunks + skvf_pick(&d, off, 4); /* floor(n/c) is the first bad id */
        if (v > INT32_MAX) v = INT32_MAX;
        if (skvf_bool(&d)) v = skvf_range(&d, INT32_MIN, -1);
        I[skvf_range(&d, 0, (int64_t)nid - 1)] = (int32_t)v;
    }
    skvf_buf_snap(&u);
    skvf_buf_snap(&w);
    skvf_buf_snap(&ids);
    skv_rope_config tab_rope = rope;
    if (!skvf_rope_valid(&rope, D)) {
        memset(&tab_rope, 0, sizeof tab_rope);
        tab_rope.theta = 10000.0f;
    }
    skvf_rope_tables(&tab_rope, D, n, &cs, &sn);

    const skv_rope_config *pr = &rope;
    int32_t cD = D, cHk = Hk, cr = r, cc = c, cS = S;
    int64_t cn = n;
    const skv_bf16 *pu = u.p, *pw = w.p;
    const int32_t *pi = ids.p;
    const float *pc = cs.p, *ps = sn.p;
    skv_bf16 *po = out.p;
    switch (bad) {
    case BAD_D: {
        static const int64_t ds[] = {0, -2, 1, 1026, INT32_MAX, INT32_MIN};
        cD = skvf_bool(&d) ? D + 1 : (int32_t)skvf_pick(&d, ds, 6);
        break;
    }
    case BAD_HK: cHk = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, 65537, INT32_MAX); break;
    case BAD_C: cc = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, 4097, INT32_MAX); break;
    case BAD_S: cS = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, INT32_MAX / 4096 + 1, INT32_MAX); break;
    case BAD_N: cn = skvf_bool(&d) ? skvf_range(&d, INT64_MIN, c - 1) : skvf_range(&d, ((int64_t)1 << 31) + 1, INT64_MAX); break;
    case BAD_RANK: cr = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : Hk * D + (int32_t)skvf_range(&d, 1, 1000); break;
    case BAD_NULL_ROPE: pr = NULL; break;
    case BAD_NULL_U: pu = NULL; break;
    case BAD_NULL_W: pw = NULL; break;
    case BAD_NULL_IDS: pi = NULL; break;
    case BAD_NULL_COS: pc = NULL; break;
    case BAD_NULL_SIN: ps = NULL; break;
    case BAD_NULL_OUT: po = NULL; break;
    default: break;
    }
    unsigned must_fail = 0;
    if (bad >= BAD_ROPE && bad <= BAD_ID) must_fail |= SKVF_BIT(SKV_ERR_INVALID_ARGUMENT) | SKVF_BIT(SKV_ERR_SIZE_OVERFLOW);
    if (bad >= BAD_NULL_ROPE) must_fail |= SKVF_BIT(SKV_ERR_NULL_POINTER);
    if (bad != BAD_NULL_ROPE && !skvf_rope_valid(&rope, D)) must_fail |= SKVF_BIT(SKV_ERR_INVALID_ARGUMENT);
    size_t n_bad = skvf_bf16_count_bad(u.p, nu) + skvf_bf16_count_bad(w.p, nw);
    if (n_bad) must_fail |= SKVF_BIT(SKV_ERR_NONFINITE);

    char params[240];
    snprintf(params, sizeof params, "backend %s D %d R %d il %d Hk %d rank %d c %d S %d n %lld bad %d nonfinite %zu",
             skv_backend_name(be), cD, rope.rotary_dim, rope.interleaved, cHk, cr, cc, cS, (long long)cn, bad, n_bad);
    skv_status st = skv_op_rebuild_keys(be, pr, cD, cHk, cr, cc, cS, cn, pu, pw, pi, pc, ps, po);
    skvf_expect(st, must_fail, 0, OP, params);
    skvf_buf_unchanged(&u, OP, "(input)");
    skvf_buf_unchanged(&w, OP, "(input)");
    skvf_buf_unchanged(&ids, OP, "(input)");
    skvf_buf_unchanged(&cs, OP, "(input)");
    skvf_buf_unchanged(&sn, OP, "(input)");
    if (st != SKV_OK) {
        skvf_buf_unchanged(&out, OP, "on error");
    } else {
        skvf_guarded_check(out.p, "k_out");
        const skv_bf16 *U = u.p, *W = w.p, *K = out.p;
        const float *C = cs.p, *SN = sn.p;
        int bounded = skvf_bf16_maxabs(U, nu) <= SKVF_BOUND && skvf_bf16_maxabs(W, nw) <= SKVF_BOUND;
        double x[64], b[64];
        for (int32_t h = 0; bounded && h < Hk; h++)
            for (int32_t s = 0; s < S; s++)
                for (int32_t i = 0; i < c; i++) {
                    int64_t t = (int64_t)I[(size_t)h * S + s] * c + i;
                    const skv_bf16 *y = K + (((size_t)h * S + s) * c + i) * D;
                    for (int32_t e = 0; e < D; e++) {
                        x[e] = b[e] = 0.0;
                        for (int32_t k = 0; k < r; k++) {
                            double p = (double)skvf_bf16_f(U[(size_t)t * r + k]) *
                                       (double)skvf_bf16_f(W[(size_t)k * Hk * D + (size_t)h * D + e]);
                            x[e] += p;
                            b[e] += fabs(p);
                        }
                        if (!skvf_bf16_finite(y[e]))
                            skvf_fail("%s: k_out[h %d, s %d, i %d, %d] = 0x%04x (%s)", OP, h, s, i, e, y[e], params);
                    }
                    for (int32_t e = R; e < D; e++)
                        if (fabs(skvf_bf16_f(y[e]) - x[e]) > fabs(x[e]) * 0x1p-8 + b[e] * 1e-5 + 1e-37)
                            skvf_fail("%s: pass-through k_out[h %d, s %d, i %d, %d] = %g, expected %g (%s)", OP, h, s, i,
                                      e, (double)skvf_bf16_f(y[e]), x[e], params);
                    for (int32_t p = 0; p < R / 2; p++) {
                        int32_t ia = rope.interleaved ? 2 * p : p, ib = rope.interleaved ? 2 * p + 1 : p + R / 2;
                        double cc2 = C[t * (R / 2) + p], ss = SN[t * (R / 2) + p];
                        double ea = x[ia] * cc2 - x[ib] * ss, eb = x[ib] * cc2 + x[ia] * ss;
                        double tol = (b[ia] + b[ib]) * 1e-5 + 1e-37;
                        if (fabs(skvf_bf16_f(y[ia]) - ea) > fabs(ea) * 0x1p-8 + tol ||
                            fabs(skvf_bf16_f(y[ib]) - eb) > fabs(eb) * 0x1p-8 + tol)
                            skvf_fail("%s: pair %d of (h %d, s %d, i %d, token %lld): got (%g, %g), expected (%g, %g) (%s)",
                                      OP, p, h, s, i, (long long)t, (double)skvf_bf16_f(y[ia]),
                                      (double)skvf_bf16_f(y[ib]), ea, eb, params);
                    }
                }
        if (bounded) skvf_note_checked(be);
        skvf_buf out2;
        skvf_buf_out(&out2, "k_out2", out.bytes);
        st = skv_op_rebuild_keys(be, &rope, D, Hk, r, c, S, n, u.p, w.p, ids.p, cs.p, sn.p, out2.p);
        if (st != SKV_OK) skvf_fail("%s: second identical call returned %s (%s)", OP, skv_status_string(st), params);
        if (memcmp(out.p, out2.p, out.bytes)) skvf_fail("%s: two identical calls differ (%s)", OP, params);
        skvf_buf_free(&out2);
    }
    skvf_buf_free(&u);
    skvf_buf_free(&w);
    skvf_buf_free(&ids);
    skvf_buf_free(&cs);
    skvf_buf_free(&sn);
    skvf_buf_free(&out);
    return 0;
}
