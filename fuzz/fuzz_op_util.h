/*
 * fuzz_op_util.h - helpers of the op-level harnesses (fuzz/fuzz_op_*.c), on
 * top of fuzz_common.h: buffers with a snapshot (outputs poisoned, inputs
 * filled), the status a call must return given what the harness planted, a
 * carved rope config with its predicted validity, and tensor scans.
 *
 * Poison: every output byte is 0xFF before the call. That is a NaN as float
 * and as bf16 and -1 as int32, so "fully written" is "no NaN / no -1 left"
 * wherever the op defines values that cannot be NaN or negative.
 */
#ifndef SKV_FUZZ_OP_UTIL_H
#define SKV_FUZZ_OP_UTIL_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

#define SKVF_POISON 0xFF

/* Inputs no larger than this (1e4 scale x the fill pattern's ~3 sigma) in magnitude cannot overflow any op at the
   harnesses' sizes: the "no NaN/Inf output" checks apply below it. */
#define SKVF_BOUND 1e5

typedef struct skvf_buf {
    void *p;             /* guarded memory */
    unsigned char *snap; /* its bytes before the call */
    size_t bytes;
    const char *name;
} skvf_buf;

/* An output of bytes (0 allowed), poisoned, snapshot taken. */
static inline void skvf_buf_out(skvf_buf *b, const char *name, size_t bytes)
{
    b->name = name;
    b->bytes = bytes;
    b->p = skvf_guarded_alloc(bytes ? bytes : 1);
    b->snap = malloc(bytes ? bytes : 1);
    if (!b->p || !b->snap) skvf_fail("%s: allocation of %zu bytes failed", name, bytes);
    memset(b->p, SKVF_POISON, bytes ? bytes : 1);
    memcpy(b->snap, b->p, bytes ? bytes : 1);
}

/* An input of bytes, zeroed; fill it, then skvf_buf_snap. */
static inline void skvf_buf_in(skvf_buf *b, const char *name, size_t bytes)
{
    skvf_buf_out(b, name, bytes);
    memset(b->p, 0, bytes ? bytes : 1);
}

static inline void skvf_buf_snap(skvf_buf *b) { memcpy(b->snap, b->p, b->bytes ? b->bytes : 1); }

static inline int skvf_buf_same(const skvf_buf *b) { return memcmp(b->p, b->snap, b->bytes ? b->bytes : 1) == 0; }

/* Aborts unless the buffer still holds its snapshot (and its canaries). */
static inline void skvf_buf_unchanged(const skvf_buf *b, const char *op, const char *when)
{
    skvf_guarded_check(b->p, b->name);
    if (!skvf_buf_same(b)) {
        size_t i = 0;
        const unsigned char *p = b->p;
        while (i < b->bytes && p[i] == b->snap[i]) i++;
        skvf_fail("%s: %s changed %s (first differing byte %zu of %zu: 0x%02x, was 0x%02x)", op, b->name, when, i,
                  b->bytes, p[i], b->snap[i]);
    }
}

static inline void skvf_buf_free(skvf_buf *b)
{
    if (b->p) skvf_guarded_free(b->p, b->name);
    free(b->snap);
    b->p = NULL;
    b->snap = NULL;
}

/* ---- expected status ------------------------------------------------------------------ */

#define SKVF_BIT(s) (1u << (unsigned)(s))

/*
 * must_fail: the statuses the harness's planted errors may produce (the library
 * checks in its own order; any planted error's status is acceptable). 0: every
 * argument is valid, so the call must succeed, or return one of tolerated.
 */
static inline void skvf_expect(skv_status st, unsigned must_fail, unsigned tolerated, const char *op,
                               const char *params)
{
    skvf_check_status(st, op);
    if (must_fail) {
        if (st == SKV_OK) skvf_fail("%s: returned SKV_OK on invalid input (%s)", op, params);
        if (!(SKVF_BIT(st) & must_fail))
            skvf_fail("%s: returned %s, expected one of mask 0x%x (%s); last error: %s", op, skv_status_string(st),
                      must_fail, params, skv_last_error());
    } else if (st != SKV_OK && !(SKVF_BIT(st) & tolerated)) {
        skvf_fail("%s: returned %s on valid input (%s); last error: %s", op, skv_status_string(st), params,
                  skv_last_error());
    }
}

/* ---- scans ------------------------------------------------------------------------------ */

static inline int skvf_bf16_finite(skv_bf16 h) { return (h & 0x7f80u) != 0x7f80u; }

static inline int skvf_bf16_isnan(skv_bf16 h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x007fu); }

static inline float skvf_bf16_f(skv_bf16 h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Number of non-finite values among x[0..n). */
static inline size_t skvf_bf16_count_bad(const skv_bf16 *x, size_t n)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += !skvf_bf16_finite(x[i]);
    return bad;
}

/* What the host backends refuse in the data of skv_prefill, skv_decode, skv_op_factorize and
   the attention ops: NaN, Inf or |x| > SKV_MAX_INPUT_MAGNITUDE (2^32, bf16 0x4F80). */
static inline int skvf_bf16_refused(skv_bf16 h) { return (h & 0x7fffu) > 0x4f80u; }

/* Number of refused values among x[0..n). */
static inline size_t skvf_bf16_count_refused(const skv_bf16 *x, size_t n)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += skvf_bf16_refused(x[i]);
    return bad;
}

/* max |x| over the finite values. */
static inline double skvf_bf16_maxabs(const skv_bf16 *x, size_t n)
{
    double m = 0.0;
    for (size_t i = 0; i < n; i++)
        if (skvf_bf16_finite(x[i]) && fabs((double)skvf_bf16_f(x[i])) > m) m = fabs((double)skvf_bf16_f(x[i]));
    return m;
}

/* Overwrites one element of x[0..n) with NaN or +-Inf (index and kind carved). */
static inline size_t skvf_plant_bad(skvf_data *d, skv_bf16 *x, size_t n)
{
    static const skv_bf16 bad[4] = {0x7FC0, 0xFFC1, 0x7F80, 0xFF80};
    size_t i = (size_t)skvf_range(d, 0, (int64_t)n - 1);
    x[i] = bad[skvf_range(d, 0, 3)];
    return i;
}

/* ---- rope config -------------------------------------------------------------------------- */

/* The documented rules (shadowkv.h and skv_config_validate's messages). */
static inline int skvf_rope_valid(const skv_rope_config *r, int32_t head_dim)
{
    if (!(r->theta > 1.0f) || !isfinite(r->theta)) return 0;
    if (r->rotary_dim < 0 || r->rotary_dim > head_dim || r->rotary_dim % 2) return 0;
    if (r->interleaved != 0 && r->interleaved != 1) return 0;
    if (r->llama3_scaling != 0 && r->llama3_scaling != 1) return 0;
    if (r->llama3_scaling) {
        if (!(r->scaling_factor >= 1.0f) || !isfinite(r->scaling_factor)) return 0;
        if (!(r->low_freq_factor > 0.0f) || !(r->high_freq_factor > r->low_freq_factor) ||
            !isfinite(r->high_freq_factor))
            return 0;
        if (r->original_max_position < 1) return 0;
    }
    return 1;
}

/* A rope config for head_dim (even, >= 2): valid unless allow_bad and the input says otherwise. */
static inline skv_rope_config skvf_rope(skvf_data *d, int32_t head_dim, int allow_bad)
{
    static const int64_t thetas[] = {10000, 500000, 1000000, 2, 100};
    skv_rope_config r;
    memset(&r, 0, sizeof r);
    r.theta = (float)skvf_pick(d, thetas, 5);
    int32_t h = head_dim / 2 > 0 ? head_dim / 2 : 1;
    switch (skvf_range(d, 0, 3)) {
    case 0: r.rotary_dim = 0; break;
    case 1: r.rotary_dim = head_dim; break;
    default: r.rotary_dim = 2 * (int32_t)skvf_range(d, 0, h); break;
    }
    r.interleaved = skvf_bool(d);
    r.llama3_scaling = skvf_bool(d);
    r.scaling_factor = (float)skvf_range(d, 1, 32);
    r.low_freq_factor = (float)skvf_range(d, 1, 4);
    r.high_freq_factor = r.low_freq_factor + (float)skvf_range(d, 1, 8);
    r.original_max_position = (int32_t)skvf_range(d, 1, 8192);
    if (allow_bad && skvf_range(d, 0, 7) == 0) {
        switch (skvf_range(d, 0, 8)) {
        case 0: r.theta = skvf_float(d); break;
        case 1: r.theta = (float)skvf_range(d, -2, 1); break;
        case 2: r.rotary_dim = skvf_wild_i32(d); break;
        case 3: r.rotary_dim = head_dim + 2 * (int32_t)skvf_range(d, 1, 4); break;
        case 4: r.rotary_dim = 2 * (int32_t)skvf_range(d, 0, h) - 1; break;
        case 5: r.interleaved = skvf_wild_i32(d); break;
        case 6: r.llama3_scaling = skvf_wild_i32(d); break;
        case 7:
            r.llama3_scaling = 1;
            r.scaling_factor = skvf_float(d);
            r.low_freq_factor = skvf_float(d);
            r.high_freq_factor = skvf_float(d);
            break;
        default:
            r.llama3_scaling = 1;
            r.original_max_position = skvf_wild_i32(d);
            break;
        }
    }
    return r;
}

static inline int32_t skvf_rotary(const skv_rope_config *r, int32_t head_dim)
{
    return r->rotary_dim ? r->rotary_dim : head_dim;
}

/* Tables for n_positions (>= 1) positions into guarded input buffers; aborts if the
   build fails for a valid config. */
static inline void skvf_rope_tables(const skv_rope_config *r, int32_t head_dim, int64_t n_positions, skvf_buf *cs,
                                    skvf_buf *sn)
{
    size_t len = skv_rope_table_len(r, head_dim, n_positions);
    if (len != (size_t)n_positions * (size_t)(skvf_rotary(r, head_dim) / 2))
        skvf_fail("skv_rope_table_len(D=%d, R=%d, n=%lld) = %zu", head_dim, r->rotary_dim, (long long)n_positions,
                  len);
    skvf_buf_in(cs, "cos_tab", len * sizeof(float));
    skvf_buf_in(sn, "sin_tab", len * sizeof(float));
    skv_status st = skv_rope_table_build(r, head_dim, n_positions, cs->p, sn->p);
    skvf_check_status(st, "skv_rope_table_build");
    if (st) skvf_fail("skv_rope_table_build failed on a valid config: %s", skv_last_error());
    skvf_buf_snap(cs);
    skvf_buf_snap(sn);
}


/*
 * The attention output row got[0..D) of query head qv over n tokens, token t's key and
 * value being ktok[t], vtok[t] (D bf16 each, the query head's KV head). Scores are
 * recomputed in double (scratch s[n]). Unless they could overflow float (> 1e30), every
 * output element must be finite and within the range of the values it averages; when the
 * scores are modest (<= 1e3) it must also match the double-precision softmax average.
 * Returns 1 when that last comparison ran (the output was checked against the reference).
 */
static inline int skvf_check_attention_head(const char *op, const char *params, int32_t qi, const skv_bf16 *qv,
                                             const skv_bf16 *const *ktok, const skv_bf16 *const *vtok, int64_t n,
                                             int32_t D, float sc, const float *got, double *s)
{
    double sbound = 0.0, m = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
        double acc = 0.0, ab = 0.0;
        for (int32_t e = 0; e < D; e++) {
            double p = (double)skvf_bf16_f(qv[e]) * skvf_bf16_f(ktok[t][e]);
            acc += p;
            ab += fabs(p);
        }
        s[t] = acc * sc;
        if (ab * sc > sbound) sbound = ab * sc;
        if (s[t] > m) m = s[t];
    }
    if (sbound > 1e30) return 0; /* float scores may overflow: the output is not checked */
    for (int32_t e = 0; e < D; e++) {
        double lo = INFINITY, hi = -INFINITY, vmax = 0.0, num = 0.0, den = 0.0;
        for (int64_t t = 0; t < n; t++) {
            double x = skvf_bf16_f(vtok[t][e]), wt = exp(s[t] - m);
            lo = x < lo ? x : lo;
            hi = x > hi ? x : hi;
            vmax = fabs(x) > vmax ? fabs(x) : vmax;
            num += wt * x;
            den += wt;
        }
        double g = got[e], slack = vmax * 1e-4 + 1e-35;
        if (!isfinite(g) || g < lo - slack || g > hi + slack)
            skvf_fail("%s: out[%d][%d] = %g outside the values' range [%g, %g] (%s)", op, qi, e, g, lo, hi, params);
        if (sbound <= 1e3) {
            double tol = vmax * (2.0 * (D * 1.2e-7 * sbound + 1e-6) + 1e-4) + 1e-35;
            if (fabs(g - num / den) > tol)
                skvf_fail("%s: out[%d][%d] = %.9g, double reference %.9g, tol %g (%s)", op, qi, e, g, num / den, tol,
                          params);
        }
    }
    return sbound <= 1e3;
}


/*
 * Argument faults shared by the two attention harnesses (their BAD_GQA .. BAD_SCALE
 * enum values are these): plants one in the head shape or the scale. Returns 0 when
 * the fault cannot be planted for this shape (GQA mismatch with one KV head).
 */
enum { SKVF_ATTN_BAD_GQA = 1, SKVF_ATTN_BAD_HQ_LOW, SKVF_ATTN_BAD_HK, SKVF_ATTN_BAD_D, SKVF_ATTN_BAD_SCALE };
static inline int skvf_attn_bad_shape(skvf_data *d, int bad, int32_t Hq, int32_t Hk, int32_t *cHq, int32_t *cHk,
                                      int32_t *cD, float *cscale)
{
    static const float bad_scales[] = {-1.0f, -1e-30f, INFINITY, -INFINITY, NAN};
    switch (bad) {
    case SKVF_ATTN_BAD_GQA:
        if (Hk <= 1) return 0;
        *cHq = Hq + (int32_t)skvf_range(d, 1, Hk - 1);
        return 1;
    case SKVF_ATTN_BAD_HQ_LOW:
        *cHq = Hk > 1 ? (int32_t)skvf_range(d, 1, Hk - 1) : (int32_t)skvf_range(d, INT32_MIN, 0);
        return 1;
    case SKVF_ATTN_BAD_HK:
        *cHk = skvf_bool(d) ? (int32_t)skvf_range(d, INT32_MIN, 0) : (int32_t)skvf_range(d, 65537, INT32_MAX);
        return 1;
    case SKVF_ATTN_BAD_D:
        *cD = skvf_bool(d) ? (int32_t)skvf_range(d, INT32_MIN, 0) : (int32_t)skvf_range(d, 1025, INT32_MAX);
        return 1;
    case SKVF_ATTN_BAD_SCALE:
        *cscale = bad_scales[skvf_range(d, 0, 4)];
        return 1;
    }
    return 0;
}

#endif
