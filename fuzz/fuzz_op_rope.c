/*
 * fuzz_op_rope.c - skv_rope_table_len, skv_rope_table_build and skv_op_rope.
 *
 * Carves a rope config (sometimes invalid: theta <= 1 or non-finite, odd /
 * negative / too large rotary_dim, interleaved or llama3_scaling not 0/1, bad
 * Llama-3 factors), head_dim in [2, 128] even (sometimes odd, 0, negative,
 * > 1024), n_tokens <= 32, n_heads <= 4, pos0 <= 2048, and sometimes a NULL,
 * a negative size, or NaN/Inf in the input. Asserts:
 *  - table_len is n_positions * R/2 on valid input, 0 on invalid input;
 *    table_build fails exactly when table_len says invalid (or a NULL), leaves
 *    the tables untouched then, and otherwise writes cos/sin with
 *    cos^2 + sin^2 ~= 1, cos = 1 and sin = 0 at position 0;
 *  - skv_op_rope: the status the planted error calls for; on error out holds
 *    its poison; on success out fully written (no NaN when |in| <= 1e5), dims
 *    >= R equal to the input, token at position 0 equal to the input, each
 *    rotated pair's norm kept (to bf16 rounding), the same bits on a second
 *    call and with in == out; in and the tables unchanged; canaries intact.
 */
#include <stdio.h>

#include "fuzz_op_util.h"

static const char OP[] = "skv_op_rope";

enum { BAD_NONE, BAD_D, BAD_NTOK, BAD_NHEADS, BAD_POS0, BAD_NULL_ROPE, BAD_NULL_COS, BAD_NULL_SIN,
       BAD_NULL_IN, BAD_NULL_OUT, BAD_COUNT };

/* table_len / table_build on carved, possibly invalid arguments. */
static void fuzz_tables(skvf_data *d)
{
    static const char FN[] = "skv_rope_table_build";
    int32_t D = 2 * (int32_t)skvf_range(d, 1, 64);
    if (skvf_range(d, 0, 5) == 0) D = skvf_wild_i32(d);
    int dvalid = D >= 2 && D % 2 == 0 && D <= 1024;
    skv_rope_config r = skvf_rope(d, dvalid ? D : 64, 1);
    int64_t np = skvf_range(d, 0, 64);
    if (skvf_range(d, 0, 7) == 0) np = -skvf_range(d, 1, 1000);
    int valid = dvalid && np >= 0 && skvf_rope_valid(&r, D);
    size_t len = skv_rope_table_len(&r, D, np);
    size_t want = valid ? (size_t)np * (size_t)(skvf_rotary(&r, D) / 2) : 0;
    if (len != want)
        skvf_fail("skv_rope_table_len(D=%d, R=%d, theta=%g, n=%lld) = %zu, expected %zu", D, r.rotary_dim,
                  (double)r.theta, (long long)np, len, want);
    if (skv_rope_table_len(NULL, D, np) != 0) skvf_fail("skv_rope_table_len(NULL rope) != 0");

    /* tables sized for the valid case (or one float when invalid) */
    size_t cap = valid ? len : 1;
    skvf_buf cs, sn;
    skvf_buf_out(&cs, "cos_tab", cap * sizeof(float));
    skvf_buf_out(&sn, "sin_tab", cap * sizeof(float));
    int which_null = (int)skvf_range(d, 0, 15); /* 1..3: rope, cos, sin */
    const skv_rope_config *pr = which_null == 1 ? NULL : &r;
    float *pc = which_null == 2 ? NULL : cs.p, *ps = which_null == 3 ? NULL : sn.p;
    unsigned must_fail = 0;
    if (which_null >= 1 && which_null <= 3) must_fail |= SKVF_BIT(SKV_ERR_NULL_POINTER);
    if (!valid) must_fail |= SKVF_BIT(SKV_ERR_INVALID_ARGUMENT);
    char params[160];
    snprintf(params, sizeof params, "D %d R %d theta %g n %lld null %d", D, r.rotary_dim, (double)r.theta,
             (long long)np, which_null);
    skv_rope_config r0 = r;
    skv_status st = skv_rope_table_build(pr, D, np, pc, ps);
    skvf_expect(st, must_fail, 0, FN, params);
    if (memcmp(&r0, &r, sizeof r)) skvf_fail("%s: changed *rope", FN);
    if (st != SKV_OK) {
        skvf_buf_unchanged(&cs, FN, "on error");
        skvf_buf_unchanged(&sn, FN, "on error");
    } else {
        skvf_guarded_check(cs.p, "cos_tab");
        skvf_guarded_check(sn.p, "sin_tab");
        const float *c = cs.p, *s = sn.p;
        int32_t h2 = skvf_rotary(&r, D) / 2;
        for (size_t i = 0; i < len; i++) {
            double cc = c[i], ss = s[i];
            if (!(fabs(cc * cc + ss * ss - 1.0) <= 1e-6))
                skvf_fail("%s: cos^2 + sin^2 = %.9g at %zu (%s)", FN, cc * cc + ss * ss, i, params);
            if (i < (size_t)h2 && (c[i] != 1.0f || s[i] != 0.0f))
                skvf_fail("%s: position 0 pair %zu: cos %g sin %g (%s)", FN, i, cc, ss, params);
        }
    }
    skvf_buf_free(&cs);
    skvf_buf_free(&sn);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    if (skvf_range(&d, 0, 3) == 0) {
        fuzz_tables(&d);
        return 0;
    }
    skv_backend be = skvf_backend(&d);
    int32_t D = 2 * (int32_t)skvf_range(&d, 1, 64);
    int64_t nt = skvf_range(&d, 0, 32);
    int32_t H = (int32_t)skvf_range(&d, 1, 4);
    int64_t pos0 = skvf_range(&d, 0, 3) == 0 ? skvf_range(&d, 0, 2048) : skvf_range(&d, 0, 8);
    skv_rope_config rope = skvf_rope(&d, D, 1);
    int rope_ok = skvf_rope_valid(&rope, D);
    int bad = (int)skvf_range(&d, 0, 2 * BAD_COUNT);
    if (bad >= BAD_COUNT) bad = BAD_NONE;
    int allow_nan = skvf_range(&d, 0, 5) == 0;
    int32_t R = skvf_rotary(&rope, D);
    if (!rope_ok) R = D; /* tables below are built for a valid stand-in */

    size_t nel = (size_t)nt * H * D;
    skvf_buf in, out, cs, sn;
    skvf_buf_in(&in, "in", nel * sizeof(skv_bf16));
    skvf_buf_out(&out, "out", nel * sizeof(skv_bf16));
    skvf_fill_bf16(&d, in.p, nel, allow_nan);
    if (allow_nan && nel && skvf_bool(&d)) skvf_plant_bad(&d, in.p, nel);
    skvf_buf_snap(&in);
    skv_rope_config tab_rope = rope;
    if (!rope_ok) {
        memset(&tab_rope, 0, sizeof tab_rope);
        tab_rope.theta = 10000.0f;
    }
    skvf_rope_tables(&tab_rope, D, pos0 + nt + 1, &cs, &sn);

    int32_t cD = D, cH = H;
    int64_t cnt = nt, cpos = pos0;
    const skv_rope_config *pr = &rope;
    const float *pc = cs.p, *ps = sn.p;
    const skv_bf16 *pin = in.p;
    skv_bf16 *pout = out.p;
    unsigned must_fail = 0;
    switch (bad) {
    case BAD_D: {
        static const int64_t ds[] = {0, -2, 1, 3, 1026, INT32_MAX, INT32_MIN};
        cD = (int32_t)skvf_pick(&d, ds, 7);
        if (skvf_bool(&d)) cD = D + 1; /* odd */
        break;
    }
    case BAD_NTOK: cnt = skvf_bool(&d) ? -skvf_range(&d, 1, 1000) : INT64_MIN; break;
    case BAD_NHEADS: cH = (int32_t)skvf_range(&d, INT32_MIN, 0); break;
    case BAD_POS0: cpos = skvf_bool(&d) ? -skvf_range(&d, 1, 1000) : INT64_MIN; break;
    case BAD_NULL_ROPE: pr = NULL; break;
    case BAD_NULL_COS: pc = NULL; break;
    case BAD_NULL_SIN: ps = NULL; break;
    case BAD_NULL_IN: pin = NULL; break;
    case BAD_NULL_OUT: pout = NULL; break;
    default: break;
    }
    if (bad >= BAD_D && bad <= BAD_POS0) must_fail |= SKVF_BIT(SKV_ERR_INVALID_ARGUMENT);
    if (bad >= BAD_NULL_ROPE) must_fail |= SKVF_BIT(SKV_ERR_NULL_POINTER);
    if (!rope_ok && bad != BAD_NULL_ROPE) must_fail |= SKVF_BIT(SKV_ERR_INVALID_ARGUMENT);
    size_t n_bad = skvf_bf16_count_bad(in.p, nel);
    if (n_bad) must_fail |= SKVF_BIT(SKV_ERR_NONFINITE);

    char params[200];
    snprintf(params, sizeof params, "backend %s D %d R %d il %d n_tokens %lld heads %d pos0 %lld bad %d rope_ok %d nonfinite %zu",
             skv_backend_name(be), cD, rope.rotary_dim, rope.interleaved, (long long)cnt, cH, (long long)cpos, bad,
             rope_ok, n_bad);
    skv_rope_config rope0 = rope;
    skv_status st = skv_op_rope(be, pr, cD, cnt, cH, cpos, pc, ps, pin, pout);
    skvf_expect(st, must_fail, 0, OP, params);
    if (memcmp(&rope0, &rope, sizeof rope)) skvf_fail("%s: changed *rope", OP);
    skvf_buf_unchanged(&in, OP, "(input)");
    skvf_buf_unchanged(&cs, OP, "(input)");
    skvf_buf_unchanged(&sn, OP, "(input)");
    if (st != SKV_OK) {
        skvf_buf_unchanged(&out, OP, "on error");
    } else {
        skvf_guarded_check(out.p, "out");
        const skv_bf16 *X = in.p, *Y = out.p;
        const float *C = cs.p, *S = sn.p;
        int bounded = skvf_bf16_maxabs(X, nel) <= SKVF_BOUND;
        for (int64_t t = 0; t < nt; t++)
            for (int32_t h = 0; h < H; h++) {
                const skv_bf16 *x = X + ((size_t)t * H + h) * D, *y = Y + ((size_t)t * H + h) * D;
                for (int32_t j = 0; j < D; j++)
                    if (skvf_bf16_isnan(y[j]) || (bounded && !skvf_bf16_finite(y[j])))
                        skvf_fail("%s: out[t %lld, h %d, %d] = 0x%04x (%s)", OP, (long long)t, h, j, y[j], params);
                for (int32_t j = R; j < D; j++)
                    if (y[j] != x[j]) skvf_fail("%s: pass-through dim %d changed (%s)", OP, j, params);
                for (int32_t j = 0; pos0 + t == 0 && j < D; j++) /* by value: -0 + +0 is +0 */
                    if (skvf_bf16_f(x[j]) != skvf_bf16_f(y[j]))
                        skvf_fail("%s: position 0 is not the identity at dim %d (%s)", OP, j, params);
                if (!bounded) continue;
                for (int32_t i = 0; i < R / 2; i++) {
                    int32_t ia = rope.interleaved ? 2 * i : i, ib = rope.interleaved ? 2 * i + 1 : i + R / 2;
                    double xa = skvf_bf16_f(x[ia]), xb = skvf_bf16_f(x[ib]);
                    double ya = skvf_bf16_f(y[ia]), yb = skvf_bf16_f(y[ib]);
                    double c = C[(pos0 + t) * (R / 2) + i], s = S[(pos0 + t) * (R / 2) + i];
                    double ea = xa * c - xb * s, eb = xb * c + xa * s, mag = fabs(xa) + fabs(xb);
                    /* one bf16 rounding (2^-9 relative) plus float work */
                    if (fabs(ya - ea) > fabs(ea) * 0x1p-8 + mag * 1e-6 + 1e-37 ||
                        fabs(yb - eb) > fabs(eb) * 0x1p-8 + mag * 1e-6 + 1e-37)
                        skvf_fail("%s: pair %d of (t %lld, h %d): got (%g, %g), expected (%g, %g) (%s)", OP, i,
                                  (long long)t, h, ya, yb, ea, eb, params);
                }
            }
        if (bounded && nel && R) skvf_note_checked(be);
        /* determinism, and in == out gives the same bits */
        skvf_buf out2, io;
        skvf_buf_out(&out2, "out2", out.bytes);
        st = skv_op_rope(be, &rope, D, nt, H, pos0, cs.p, sn.p, in.p, out2.p);
        if (st != SKV_OK) skvf_fail("%s: second identical call returned %s (%s)", OP, skv_status_string(st), params);
        if (memcmp(out.p, out2.p, out.bytes)) skvf_fail("%s: two identical calls differ (%s)", OP, params);
        skvf_buf_in(&io, "in==out", in.bytes);
        memcpy(io.p, in.p, in.bytes);
        st = skv_op_rope(be, &rope, D, nt, H, pos0, cs.p, sn.p, io.p, io.p);
        if (st != SKV_OK) skvf_fail("%s: in == out returned %s (%s)", OP, skv_status_string(st), params);
        if (memcmp(out.p, io.p, out.bytes)) skvf_fail("%s: in == out differs from out of place (%s)", OP, params);
        skvf_buf_free(&out2);
        skvf_buf_free(&io);
    }
    skvf_buf_free(&in);
    skvf_buf_free(&out);
    skvf_buf_free(&cs);
    skvf_buf_free(&sn);
    return 0;
}
