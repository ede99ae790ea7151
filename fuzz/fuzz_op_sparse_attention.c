/*
 * fuzz_op_sparse_attention.c - skv_op_sparse_attention on ref or cpu.
 *
 * Carves Hk <= 4, G <= 4, D <= 64 (any), a scale, 1..16 spans of 0..64 tokens
 * (<= 600 in all, so cpu's 256-token blocks split) in four layouts: token-major
 * [n, Hk, D], head-major [Hk, n, D], padded strides, and overlapping strides
 * (token_stride 0 .. 2D, head_stride 0 .. 3D: tokens and heads may alias);
 * sometimes v == k; empty spans with NULL pointers or negative strides (both
 * allowed when n_tokens = 0). NaN/Inf may sit in the gaps between strided
 * elements (never read: must not be reported) or on read elements. About half
 * the inputs plant one bad argument (GQA, sizes, scale, n_spans 0 or > 16,
 * negative or > 2^31 n_tokens, NULL k/v of a non-empty span, a negative
 * stride, no token at all, a NULL). Asserts:
 *  - the status the planted error calls for (NONFINITE exactly when a read
 *    element is NaN, Inf or |x| > SKV_MAX_INPUT_MAGNITUDE); on error out holds its poison;
 *  - on success out is fully written: with scores that cannot overflow (the
 *    inputs it accepts are <= 2^32), finite and inside the convex hull of the values; with
 *    modest scores, within tolerance of a double-precision softmax attention;
 *  - q, the spans array and every span's k and v unchanged, canaries intact.
 */
#include <stdio.h>

#include "fuzz_op_util.h"

static const char OP[] = "skv_op_sparse_attention";

/* BAD_GQA .. BAD_SCALE equal SKVF_ATTN_BAD_* (fuzz_op_util.h) */
enum { BAD_NONE, BAD_GQA, BAD_HQ_LOW, BAD_HK, BAD_D, BAD_SCALE, BAD_NSPANS, BAD_SPAN_NEG_N, BAD_SPAN_BIG_N,
       BAD_SPAN_NULL_K, BAD_SPAN_NULL_V, BAD_SPAN_NEG_STRIDE, BAD_NO_TOKENS, BAD_NULL_Q, BAD_NULL_OUT,
       BAD_NULL_SPANS, BAD_COUNT };

#define MAXT 600

typedef struct span_mem {
    skvf_buf k, v; /* v.p == NULL: v aliases k */
    int has_mem;
} span_mem;

/* Refused values (NaN, Inf, |x| > 2^32) among the elements attention reads from x. */
static size_t count_bad_read(const skv_bf16 *x, int32_t Hk, int64_t n, int64_t hs, int64_t ts, int32_t D)
{
    size_t bad = 0;
    for (int32_t h = 0; h < Hk; h++)
        for (int64_t t = 0; t < n; t++)
            for (int32_t e = 0; e < D; e++) bad += skvf_bf16_refused(x[h * hs + t * ts + e]);
    return bad;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    skv_backend be = skvf_backend(&d);
    int32_t Hk = (int32_t)skvf_range(&d, 1, 4), G = (int32_t)skvf_range(&d, 1, 4), Hq = Hk * G;
    int32_t D = (int32_t)skvf_range(&d, 1, 64);
    float scale;
    switch (skvf_range(&d, 0, 4)) {
    case 0: scale = 0.0f; break;
    case 1: scale = 1.0f / sqrtf((float)D); break;
    case 2: scale = (float)skvf_range(&d, 1, 1000) / 100.0f; break;
    case 3: scale = fabsf(skvf_float(&d)); if (!isfinite(scale)) scale = 1.0f; break;
    default: scale = 1e30f; break;
    }
    int32_t ns = (int32_t)skvf_range(&d, 1, SKV_MAX_SPANS);
    int bad = (int)skvf_range(&d, 0, 2 * BAD_COUNT);
    if (bad >= BAD_COUNT) bad = BAD_NONE;
    int allow_nan = skvf_range(&d, 0, 4) == 0;

    skvf_buf q, out, sp;
    size_t nq = (size_t)Hq * D;
    skvf_buf_in(&q, "q", nq * sizeof(skv_bf16));
    skvf_buf_out(&out, "out", nq * sizeof(float));
    skvf_buf_in(&sp, "spans", (size_t)ns * sizeof(skv_kv_span));
    skvf_fill_bf16(&d, q.p, nq, allow_nan);
    skvf_buf_snap(&q);
    skv_kv_span *S = sp.p;
    span_mem mem[SKV_MAX_SPANS];
    int64_t total = 0;
    size_t n_bad = skvf_bf16_count_refused(q.p, nq);
    for (int32_t i = 0; i < ns; i++) {
        int64_t n = skvf_range(&d, 0, MAXT - total < 64 ? MAXT - total : 64), hs, ts;
        if (skvf_range(&d, 0, 5) == 0) n = 0;
        switch (skvf_range(&d, 0, 3)) {
        case 0: hs = D; ts = (int64_t)Hk * D; break;
        case 1: hs = n * D; ts = D; break;
        case 2: ts = D + skvf_range(&d, 0, 8); hs = n * ts + skvf_range(&d, 0, 16); break;
        default: ts = skvf_range(&d, 0, 2 * D); hs = skvf_range(&d, 0, 3 * D); break;
        }
        total += n;
        memset(&mem[i], 0, sizeof mem[i]);
        S[i].n_tokens = n;
        S[i].head_stride = hs;
        S[i].token_stride = ts;
        if (n == 0 && skvf_bool(&d)) { /* empty: pointers and strides do not matter */
            S[i].k = S[i].v = NULL;
            if (skvf_bool(&d)) S[i].head_stride = -skvf_range(&d, 1, 100);
            continue;
        }
        size_t nel = n ? (size_t)((Hk - 1) * hs + (n - 1) * ts + D) : 1;
        mem[i].has_mem = 1;
        skvf_buf_in(&mem[i].k, "span k", nel * sizeof(skv_bf16));
        skvf_fill_bf16(&d, mem[i].k.p, nel, allow_nan);
        if (allow_nan && skvf_bool(&d)) skvf_plant_bad(&d, mem[i].k.p, nel);
        skvf_buf_snap(&mem[i].k);
        S[i].k = mem[i].k.p;
        if (skvf_range(&d, 0, 5) == 0) {
            S[i].v = S[i].k;
        } else {
            skvf_buf_in(&mem[i].v, "span v", nel * sizeof(skv_bf16));
            skvf_fill_bf16(&d, mem[i].v.p, nel, allow_nan);
            if (allow_nan && skvf_bool(&d)) skvf_plant_bad(&d, mem[i].v.p, nel);
            skvf_buf_snap(&mem[i].v);
            S[i].v = mem[i].v.p;
        }
        n_bad += count_bad_read(S[i].k, Hk, n, hs, ts, D) + count_bad_read(S[i].v, Hk, n, hs, ts, D);
    }
    skvf_buf_snap(&sp);

    /* the call's arguments: a copy of the spans with the planted error */
    skv_kv_span cs[SKV_MAX_SPANS];
    memcpy(cs, S, (size_t)ns * sizeof *cs);
    int32_t cHq = Hq, cHk = Hk, cD = D, cns = ns;
    float cscale = scale;
    const skv_bf16 *pq = q.p;
    float *po = out.p;
    const skv_kv_span *psp = sp.p;
    int32_t victim = -1; /* a non-empty span, for span errors */
    for (int32_t i = 0, k = (int32_t)skvf_range(&d, 0, ns - 1); i < ns; i++)
        if (S[(i + k) % ns].n_tokens > 0) {
            victim = (i + k) % ns;
            break;
        }
    if (bad >= BAD_SPAN_NULL_K && bad <= BAD_SPAN_NEG_STRIDE && victim < 0) bad = BAD_NONE;
    if (bad == BAD_NO_TOKENS) total = 0;
    switch (bad) {
    case BAD_GQA:
    case BAD_HQ_LOW:
    case BAD_HK:
    case BAD_D:
    case BAD_SCALE:
        if (!skvf_attn_bad_shape(&d, bad, Hq, Hk, &cHq, &cHk, &cD, &cscale)) bad = BAD_NONE;
        break;
    case BAD_NSPANS: cns = skvf_bool(&d) ? (int32_t)skvf_range(&d, INT32_MIN, 0) : (int32_t)skvf_range(&d, SKV_MAX_SPANS + 1, INT32_MAX); break;
    case BAD_SPAN_NEG_N: cs[skvf_range(&d, 0, ns - 1)].n_tokens = skvf_range(&d, INT64_MIN, -1); break;
    case BAD_SPAN_BIG_N: cs[skvf_range(&d, 0, ns - 1)].n_tokens = skvf_range(&d, ((int64_t)1 << 31) + 1, INT64_MAX); break;
    case BAD_SPAN_NULL_K: cs[victim].k = NULL; break;
    case BAD_SPAN_NULL_V: cs[victim].v = NULL; break;
    case BAD_SPAN_NEG_STRIDE:
        if (skvf_bool(&d)) cs[victim].head_stride = skvf_range(&d, INT64_MIN, -1);
        else cs[victim].token_stride = skvf_range(&d, INT64_MIN, -1);
        break;
    case BAD_NO_TOKENS:
        for (int32_t i = 0; i < ns; i++) cs[i].n_tokens = 0;
        break;
    case BAD_NULL_Q: pq = NULL; break;
    case BAD_NULL_OUT: po = NULL; break;
    case BAD_NULL_SPANS: psp = NULL; break;
    default: break;
    }
    if (bad == BAD_NONE && total == 0) bad = BAD_NO_TOKENS; /* every span came out empty */
    if (bad != BAD_NULL_SPANS && bad != BAD_NONE) psp = cs;
    /* cs is a stack copy: the input check below covers S (the caller's array); when
       the call gets cs, it must be unchanged too */
    unsigned must_fail = 0;
    if (bad >= BAD_GQA && bad <= BAD_NO_TOKENS && bad != BAD_SPAN_NULL_K && bad != BAD_SPAN_NULL_V)
        must_fail |= SKVF_BIT(SKV_ERR_INVALID_ARGUMENT) | SKVF_BIT(SKV_ERR_SIZE_OVERFLOW);
    if (bad == BAD_SPAN_NULL_K || bad == BAD_SPAN_NULL_V || bad >= BAD_NULL_Q) must_fail |= SKVF_BIT(SKV_ERR_NULL_POINTER);
    /* an earlier span's bad value is reported first; a later one's may hide behind a span error */
    if (n_bad && bad != BAD_NO_TOKENS) must_fail |= SKVF_BIT(SKV_ERR_NONFINITE);

    char params[240];
    snprintf(params, sizeof params, "backend %s Hq %d Hk %d D %d scale %g n_spans %d total %lld bad %d nonfinite %zu",
             skv_backend_name(be), cHq, cHk, cD, (double)cscale, cns, (long long)total, bad, n_bad);
    skv_kv_span cs0[SKV_MAX_SPANS];
    memcpy(cs0, cs, sizeof cs0);
    skv_status st = skv_op_sparse_attention(be, cHq, cHk, cD, cscale, pq, cns, psp, po);
    skvf_expect(st, must_fail, 0, OP, params);
    if (memcmp(cs0, cs, sizeof cs0)) skvf_fail("%s: changed the spans array (%s)", OP, params);
    skvf_buf_unchanged(&q, OP, "(input)");
    skvf_buf_unchanged(&sp, OP, "(input)");
    for (int32_t i = 0; i < ns; i++) {
        if (!mem[i].has_mem) continue;
        skvf_buf_unchanged(&mem[i].k, OP, "(input)");
        if (mem[i].v.p) skvf_buf_unchanged(&mem[i].v, OP, "(input)");
    }
    if (st != SKV_OK) {
        skvf_buf_unchanged(&out, OP, "on error");
    } else {
        skvf_guarded_check(out.p, "out");
        const float *O = out.p;
        const skv_bf16 *Q = q.p;
        float sc = scale > 0.0f ? scale : 1.0f / sqrtf((float)D);
        static double s[MAXT];
        static const skv_bf16 *kt[MAXT], *vt[MAXT];
        int checked = 0;
        for (int32_t qi = 0; qi < Hq; qi++) {
            int32_t h = qi / G;
            int64_t t = 0;
            for (int32_t i = 0; i < ns; i++)
                for (int64_t j = 0; j < S[i].n_tokens; j++, t++) {
                    kt[t] = S[i].k + h * S[i].head_stride + j * S[i].token_stride;
                    vt[t] = S[i].v + h * S[i].head_stride + j * S[i].token_stride;
                }
            checked |= skvf_check_attention_head(OP, params, qi, Q + (size_t)qi * D, kt, vt, t, D, sc,
                                                 O + (size_t)qi * D, s);
        }
        if (checked) skvf_note_checked(be);
    }
    for (int32_t i = 0; i < ns; i++) {
        if (!mem[i].has_mem) continue;
        skvf_buf_free(&mem[i].k);
        if (mem[i].v.p) skvf_buf_free(&mem[i].v);
    }
    skvf_buf_free(&q);
    skvf_buf_free(&out);
    skvf_buf_free(&sp);
    return 0;
}
