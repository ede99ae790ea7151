/*
 * skv_numerics.h - the shared numerics of the exact-selection contract
 * (docs/DESIGN.md section 5). static inline, compiles as C99 on the host and
 * as CUDA device code.
 *
 * Every decision (landmarks, outlier scores, candidate lists, selection)
 * is defined by these functions, with IEEE-rounded operations in a fixed
 * order. Host files are built with -ffp-contract=off; on the device the
 * SKV_ADD/SKV_MUL/... macros map to explicitly rounded __f*_rn intrinsics so
 * nvcc cannot contract them.
 *
 * ref calls these functions as they are. cpu and cuda re-implement some of
 * them for speed, lane by lane, each lane running the same operations in the
 * same order as the function here (docs/DESIGN.md 5.5):
 *  - cpu/skv_cpu.c: bf16 conversion (skv_cpu_ld8/st8), the rotate-half RoPE
 *    row (skv_cpu_rope_row), the chunk landmark score (skv_cpu_chunk_score)
 *    and the dot chains of the scores (skv_cpu_dot8x4) in AVX2 lanes; the
 *    softmax, skv_expf and the canonical sum are called from here.
 *  - cuda/ (the decision path's files, skv_cuda_exact.cuh): the landmark
 *    kernel (skv_cuda_landmarks.cu: mean and cos chains, the ordered min as a
 *    warp reduction), the score kernel's dot chains and max (skv_cuda_score.cu),
 *    the canonical sum's lanes and tree (expsum_kernel, selz_kernel,
 *    canon_tree) and the group max and top-S (select_kernel, selz_kernel), both
 *    in skv_cuda_select.cu; the rescoring's chunk masses (skv_rescore_masses) and
 *    its rule (rescore_kernel, skv_cuda_rescore.cu).
 * (cpu's attention exp, skv_cpu_exp8, follows skv_expf's method but is not on
 * the decision path: it is held to tolerances, not to these bits.)
 * The reproducible mode's rules (docs/DESIGN.md 10.2, 10.3) are here too:
 * skv_canon_rebuild_ex/fix/key (the canonical key rebuild's fixed point and
 * rounding) and skv_canonical_attend (the canonical attention); ref calls them,
 * cpu (cpu/skv_cpu_decode_canon.c) and cuda (cuda/skv_cuda_canon_*.cu) run the
 * same operations in other schedules, pinned by tests/test_canonical_decode.c.
 * Pinned by tests/test_numerics.c (these functions against independent
 * versions), tests/backend_ops.c (cpu and cuda ops vs ref, decisions and amax
 * bitwise) and tests/test_contract.c (cache-level decisions vs ref, bitwise).
 */
#ifndef SKV_NUMERICS_H
#define SKV_NUMERICS_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__CUDACC__)
#define SKV_HD __host__ __device__ __forceinline__
#else
#define SKV_HD static inline
#endif

#if defined(__CUDA_ARCH__)
#define SKV_ADD(a, b) __fadd_rn((a), (b))
#define SKV_SUB(a, b) __fsub_rn((a), (b))
#define SKV_MUL(a, b) __fmul_rn((a), (b))
#define SKV_DIV(a, b) __fdiv_rn((a), (b))
#define SKV_SQRT(a) __fsqrt_rn(a)
#define SKV_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#else
#define SKV_ADD(a, b) ((a) + (b))
#define SKV_SUB(a, b) ((a) - (b))
#define SKV_MUL(a, b) ((a) * (b))
#define SKV_DIV(a, b) ((a) / (b))
#define SKV_SQRT(a) sqrtf(a)
#define SKV_FMA(a, b, c) fmaf((a), (b), (c))
#endif

/* ---- bf16 <-> fp32 ------------------------------------------------------ */

SKV_HD float skv_f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

SKV_HD uint32_t skv_bits_from_f32(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

SKV_HD float skv_bf16_to_f32(uint16_t h) { return skv_f32_from_bits((uint32_t)h << 16); }

/* Round to nearest even; NaN stays a (quiet) NaN with its sign. */
SKV_HD uint16_t skv_f32_to_bf16(float f)
{
    uint32_t u = skv_bits_from_f32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* bf16 is finite: exponent bits not all ones. */
SKV_HD int skv_bf16_isfinite(uint16_t h) { return (h & 0x7f80u) != 0x7f80u; }

/* ---- the exact dot product ---------------------------------------------- */

/* acc = fmaf(a[d], b[d], acc) for d = 0..n-1 in order, from 0. */
SKV_HD float skv_dot_bf16(const uint16_t *a, const uint16_t *b, int n)
{
    float acc = 0.0f;
    for (int d = 0; d < n; d++) acc = SKV_FMA(skv_bf16_to_f32(a[d]), skv_bf16_to_f32(b[d]), acc);
    return acc;
}

/* Same order, one float and one bf16 operand. */
SKV_HD float skv_dot_f32_bf16(const float *a, const uint16_t *b, int n)
{
    float acc = 0.0f;
    for (int d = 0; d < n; d++) acc = SKV_FMA(a[d], skv_bf16_to_f32(b[d]), acc);
    return acc;
}

/* Same order, both float. */
SKV_HD float skv_dot_f32(const float *a, const float *b, int n)
{
    float acc = 0.0f;
    for (int d = 0; d < n; d++) acc = SKV_FMA(a[d], b[d], acc);
    return acc;
}

/* ---- skv_expf ------------------------------------------------------------ */

/*
 * exp(x) by Cody-Waite reduction x = k ln2 + r, |r| <= ln2/2, a polynomial
 * for exp(r) and exponent bits for 2^k. Built only from IEEE-rounded
 * operations, so host and device agree bit for bit. Returns exactly 0 when
 * the result would be below FLT_MIN (no subnormal is ever produced), +inf
 * above the float range, NaN for NaN.
 */
SKV_HD float skv_expf(float x)
{
    if (x != x) return x;
    if (x < -87.33654475f) return 0.0f;   /* < ln(FLT_MIN) */
    if (x > 88.72283935f) return skv_f32_from_bits(0x7f800000u);
    /* k = round-to-nearest(x / ln2) via the 1.5 * 2^23 trick */
    const float shifter = 12582912.0f;
    float kf = SKV_SUB(SKV_FMA(x, 1.44269502162933349609f, shifter), shifter);
    float r = SKV_FMA(kf, -0.693359375f, x);   /* ln2 hi (exact product) */
    r = SKV_FMA(kf, 2.12194440e-4f, r);        /* ln2 lo */
    /* exp(r) = 1 + r + r^2 P(r) (minimax coefficients, Cephes expf) */
    float p = 1.9875691500e-4f;
    p = SKV_FMA(p, r, 1.3981999507e-3f);
    p = SKV_FMA(p, r, 8.3334519073e-3f);
    p = SKV_FMA(p, r, 4.1665795894e-2f);
    p = SKV_FMA(p, r, 1.6666665459e-1f);
    p = SKV_FMA(p, r, 5.0000001201e-1f);
    float r2 = SKV_MUL(r, r);
    float e = SKV_ADD(SKV_FMA(p, r2, r), 1.0f);
    int k = (int)kf;
    /* 2^k in two factors so that k = 128 and k = -126 stay representable */
    int k1 = k / 2, k2 = k - k1;
    float s1 = skv_f32_from_bits((uint32_t)(k1 + 127) << 23);
    float s2 = skv_f32_from_bits((uint32_t)(k2 + 127) << 23);
    float y = SKV_MUL(SKV_MUL(e, s1), s2);
    if (y < 1.17549435e-38f) return 0.0f;      /* never a subnormal */
    return y;
}

/* ---- canonical sum ------------------------------------------------------- */

#define SKV_CANON_LANES 256

/*
 * 256 partial sums, partial k adds x_j for j = k, k+256, ... in order (from 0),
 * then a fixed pairwise tree: for w = 128..1: P[k] += P[k+w] for k < w.
 */
/* The fixed tree over filled partial sums P[0..256) (overwrites P); returns the sum. */
SKV_HD float skv_canonical_fold(float *P)
{
    for (int w = SKV_CANON_LANES / 2; w >= 1; w /= 2)
        for (int k = 0; k < w; k++) P[k] = SKV_ADD(P[k], P[k + w]);
    return P[0];
}

SKV_HD float skv_canonical_sum(const float *x, int64_t m)
{
    float P[SKV_CANON_LANES];
    for (int k = 0; k < SKV_CANON_LANES; k++) P[k] = 0.0f;
    for (int64_t j = 0; j < m; j++) P[j & (SKV_CANON_LANES - 1)] = SKV_ADD(P[j & (SKV_CANON_LANES - 1)], x[j]);
    return skv_canonical_fold(P);
}

/*
 * The selection softmax of one query head, in place over s[0..n), n >= 1:
 * M = max s (first-wins scan), e_j = skv_expf(s_j - M), Z = canonical sum of
 * e, p_j = e_j / Z.
 */
SKV_HD void skv_softmax_inplace(float *s, int64_t n)
{
    float M = s[0];
    for (int64_t j = 1; j < n; j++)
        if (s[j] > M) M = s[j];
    for (int64_t j = 0; j < n; j++) s[j] = skv_expf(SKV_SUB(s[j], M));
    float Z = skv_canonical_sum(s, n);
    for (int64_t j = 0; j < n; j++) s[j] = SKV_DIV(s[j], Z);
}

/*
 * The rescoring's chunk masses of one KV head (docs/DESIGN.md 4.5.1): q [G][D] the group's
 * queries; keys [W c][D] the canonical keys of the W candidates' tokens (candidate order,
 * then token order); s scratch [W c]. For each query head g (in order): s_m =
 * dot(q_g, k_m) * scale; the softmax of 4.3 over the W c scores; mu_i = the sum of chunk i's
 * c probabilities (from 0, in token order, one add each); b_i = the maximum of mu_i over g
 * (head 0's value, replaced by a strictly greater one: the group max of 4.4).
 */
SKV_HD void skv_rescore_masses(int32_t G, int32_t D, int32_t c, int32_t W, float scale, const uint16_t *q,
                               const uint16_t *keys, float *s, float *b)
{
    const int64_t T = (int64_t)W * c;
    for (int32_t g = 0; g < G; g++) {
        const uint16_t *qg = q + (size_t)g * D;
        for (int64_t m = 0; m < T; m++) s[m] = SKV_MUL(skv_dot_bf16(qg, keys + (size_t)m * D, D), scale);
        skv_softmax_inplace(s, T);
        for (int32_t i = 0; i < W; i++) {
            float mu = 0.0f;
            for (int32_t t = 0; t < c; t++) mu = SKV_ADD(mu, s[(size_t)i * c + t]);
            if (g == 0 || mu > b[i]) b[i] = mu;
        }
    }
}

/* ---- RoPE ---------------------------------------------------------------- */

/* One pair rotation: x' = fmaf(x, c, -(y*s)), y' = fmaf(y, c, x*s). */
SKV_HD void skv_rope_rotate(float x, float y, float c, float s, float *xo, float *yo)
{
    *xo = SKV_FMA(x, c, -SKV_MUL(y, s));
    *yo = SKV_FMA(y, c, SKV_MUL(x, s));
}

/* Index of the two members of pair i (i < R/2) for the two pair layouts. */
SKV_HD void skv_rope_pair_index(int i, int rotary_dim, int interleaved, int *a, int *b)
{
    if (interleaved) {
        *a = 2 * i;
        *b = 2 * i + 1;
    } else {
        *a = i;
        *b = i + rotary_dim / 2;
    }
}

/*
 * RoPE of one head vector x[0..D) (float) at the position whose table rows are
 * cs[0..R/2), sn[0..R/2); result rounded to bf16 into out. Dims >= R pass
 * through (rounded).
 */
SKV_HD void skv_rope_row_f32(const float *x, int head_dim, int rotary_dim, int interleaved,
                             const float *cs, const float *sn, uint16_t *out)
{
    for (int d = rotary_dim; d < head_dim; d++) out[d] = skv_f32_to_bf16(x[d]);
    for (int i = 0; i < rotary_dim / 2; i++) {
        int a, b;
        float xo, yo;
        skv_rope_pair_index(i, rotary_dim, interleaved, &a, &b);
        skv_rope_rotate(x[a], x[b], cs[i], sn[i], &xo, &yo);
        out[a] = skv_f32_to_bf16(xo);
        out[b] = skv_f32_to_bf16(yo);
    }
}

/* ---- decisions ------------------------------------------------------------ */

/* cos(a, b) = dot(a,b) / fmaxf(sqrtf(dot(a,a)) * sqrtf(dot(b,b)), 1e-8f) */
SKV_HD float skv_cos_bf16_f32(const uint16_t *a, const float *b, int n)
{
    float ab = 0.0f, aa = 0.0f, bb = 0.0f;
    for (int d = 0; d < n; d++) {
        float x = skv_bf16_to_f32(a[d]);
        ab = SKV_FMA(x, b[d], ab);
        aa = SKV_FMA(x, x, aa);
        bb = SKV_FMA(b[d], b[d], bb);
    }
    return SKV_DIV(ab, fmaxf(SKV_MUL(SKV_SQRT(aa), SKV_SQRT(bb)), 1e-8f));
}

/*
 * Landmark and outlier score of one chunk of one head.
 *  k: first token's head vector; tokens are token_stride elements apart
 *  mean[0..D): float mean (sum in token order, then / c)
 *  returns min over tokens of cos(k_t, mean); NaN counts as -inf-like:
 *  the result is the first NaN if any (ordered scan).
 */
SKV_HD float skv_chunk_landmark_score(const uint16_t *k, int64_t token_stride, int c,
                                      int head_dim, float *mean)
{
    for (int d = 0; d < head_dim; d++) {
        float acc = 0.0f;
        for (int t = 0; t < c; t++) acc = SKV_ADD(acc, skv_bf16_to_f32(k[t * token_stride + d]));
        mean[d] = SKV_DIV(acc, (float)c);
    }
    float best = 0.0f;
    for (int t = 0; t < c; t++) {
        float s = skv_cos_bf16_f32(k + t * token_stride, mean, head_dim);
        if (t == 0 || s < best || s != s) best = s;
        if (best != best) break;
    }
    return best;
}

/*
 * Ordering key for selection: larger is better; NaN ranks below everything
 * (probabilities are >= 0, so -1 is below any real value).
 */
SKV_HD float skv_select_key(float a) { return a != a ? -1.0f : a; }

/* The mass of a candidate in SKV_SELECT_MASS (docs/DESIGN.md 4.5): its key, a NaN's -1 as 0. */
SKV_HD float skv_mass_weight(float key) { return fmaxf(key, 0.0f); }

/*
 * Steps 6-7 of the mass rule (docs/DESIGN.md 4.5): w[0..cap) the masses of the cap best
 * candidates, best first; cum = 0; the first i (1-based) with cum + ... + w[i-1] >= target
 * (one float add each, in this order), else cap; at least floor. One thread, in order.
 */
SKV_HD int32_t skv_mass_count(const float *w, int32_t cap, float target, int32_t floor)
{
    float cum = 0.0f;
    int32_t k = cap;
    for (int32_t i = 0; i < cap; i++) {
        cum = SKV_ADD(cum, w[i]);
        if (cum >= target) {
            k = i + 1;
            break;
        }
    }
    return k < floor ? floor : k;
}

/* Ordering key for outliers: lower score is more outlying; NaN is most outlying. */
SKV_HD float skv_outlier_key(float s) { return s != s ? -3.0f : s; }

/* ---- the reproducible mode: canonical key rebuild (docs/DESIGN.md 10.2) ---- */

/*
 * ex() of the largest magnitude of a bf16 row or column, from the largest of
 * its elements' (bits & 0x7fff) (finite inputs, so that order is the order of
 * magnitudes): floor(log2) of a normal value, -126 for a subnormal one, and
 * -126 for an all-zero row (any value would do: every element is then 0).
 */
SKV_HD int skv_canon_rebuild_ex(uint16_t maxabs_bits)
{
    const int E = (maxabs_bits >> 7) & 0xff;
    return E ? E - 127 : -126;
}

/*
 * The 13-bit fixed point of one bf16 element h against the exponent e = ex of
 * its row's (or column's) largest magnitude: rne(h * 2^(12 - e)), computed in
 * integers (exact, so every backend gets the same value). |result| < 2^13.
 * h = m 2^(E - 134) with the 8-bit significand m (E = 1 for a subnormal), so
 * h 2^(12 - e) = m 2^(E - 122 - e) with E - 122 - e <= 5.
 */
SKV_HD int32_t skv_canon_rebuild_fix(uint16_t h, int e)
{
    int E = (h >> 7) & 0xff;
    int32_t m = h & 0x7f, x;
    if (E) m |= 0x80;
    else E = 1;
    const int sh = E - 122 - e;
    if (sh >= 0) {
        x = m << sh;
    } else if (sh <= -9) { /* m 2^sh < 2^(8 + sh) <= 1/2: rounds to 0 (a tie only if m = 256) */
        x = 0;
    } else {
        const int k = -sh;
        const int32_t rem = m & ((1 << k) - 1), half = 1 << (k - 1);
        x = m >> k;
        if (rem > half || (rem == half && (x & 1))) x++;
    }
    return (h & 0x8000u) ? -x : x;
}

/*
 * The pre-RoPE key from the exact integer sum P = sum_q xu_q xw_q (|P| < 2^53)
 * and e = eu + ew - 24: (float)(P 2^e), one rounding (round to nearest even,
 * to a subnormal or to inf where the value lies there). P 2^e is exact in
 * double for the e that occur (-276 <= e <= 230).
 */
SKV_HD float skv_canon_rebuild_key(int64_t P, int e)
{
    uint64_t bits = (uint64_t)(e + 1023) << 52;
    double s;
    memcpy(&s, &bits, sizeof s);
#if defined(__CUDA_ARCH__)
    return __double2float_rn(__dmul_rn((double)P, s));
#else
    return (float)((double)P * s);
#endif
}

/* ---- the reproducible mode: canonical attention (docs/DESIGN.md 10.3) ---- */

/* One span of one KV head: token j's key at k + j * token_stride, its value at v + j * token_stride. */
typedef struct skv_canon_span {
    const uint16_t *k, *v;
    int64_t n_tokens, token_stride;
} skv_canon_span;

/*
 * The canonical attention of one query head q[0..D) over the tokens of n_spans
 * spans in order (T >= 1 in all), DESIGN 10.3 as code:
 *   s_j = SKV_MUL(skv_dot_bf16(q, k_j, D), scale); M = max s_j (a scan from s_0,
 *   a strictly greater value replaces M); e_j = skv_expf(SKV_SUB(s_j, M));
 *   Z = skv_canonical_sum(e); N_d = the same 256 lanes with the lane update
 *   P = SKV_FMA(e_j, v_jd, P), the same tree; out_d = SKV_DIV(N_d, Z).
 * lanes: scratch of SKV_CANON_LANES * (D + 1) floats. s_j is computed twice
 * (for M, then for e_j), the same bits both times. (A backend's M may come from
 * any reduction order: the inputs are finite, so M's value is unique up to the
 * sign of a zero, and e_j = skv_expf(+-0) = 1 either way.)
 */
SKV_HD void skv_canonical_attend(const uint16_t *q, int D, float scale, int n_spans, const skv_canon_span *sp,
                                 float *lanes, float *out)
{
    float M = 0.0f;
    int64_t j = 0;
    for (int i = 0; i < n_spans; i++)
        for (int64_t t = 0; t < sp[i].n_tokens; t++, j++) {
            const float s = SKV_MUL(skv_dot_bf16(q, sp[i].k + t * sp[i].token_stride, D), scale);
            if (j == 0 || s > M) M = s;
        }
    float *Zl = lanes, *N = lanes + SKV_CANON_LANES; /* N[l * D + d] */
    for (int64_t i = 0; i < (int64_t)SKV_CANON_LANES * (D + 1); i++) lanes[i] = 0.0f;
    j = 0;
    for (int i = 0; i < n_spans; i++)
        for (int64_t t = 0; t < sp[i].n_tokens; t++, j++) {
            const int64_t off = t * sp[i].token_stride;
            const float e = skv_expf(SKV_SUB(SKV_MUL(skv_dot_bf16(q, sp[i].k + off, D), scale), M));
            const int l = (int)(j & (SKV_CANON_LANES - 1));
            Zl[l] = SKV_ADD(Zl[l], e);
            for (int d = 0; d < D; d++) N[l * D + d] = SKV_FMA(e, skv_bf16_to_f32(sp[i].v[off + d]), N[l * D + d]);
        }
    for (int w = SKV_CANON_LANES / 2; w >= 1; w /= 2)
        for (int k = 0; k < w; k++) {
            Zl[k] = SKV_ADD(Zl[k], Zl[k + w]);
            for (int d = 0; d < D; d++) N[k * D + d] = SKV_ADD(N[k * D + d], N[(k + w) * D + d]);
        }
    for (int d = 0; d < D; d++) out[d] = SKV_DIV(N[d], Zl[0]);
}


/* ---- fp8 values (config.value_dtype = SKV_VALUE_FP8; docs/DESIGN.md section 13) ---------- */
/*
 * A token's values of one KV head, v[0..D), are kept as D fp8 e4m3 codes (1 sign, 4 exponent
 * bits of bias 7, 3 mantissa bits; 0x7f and 0xff are NaN, largest finite 448) and one exponent
 * k (int8): value i is decode(code_i) * 2^k. k is the smallest integer with max_i |v_i| * 2^-k
 * <= 448, but not below SKV_FP8_EXP_MIN. Every step is integer arithmetic on the bits, so the
 * host and the device encode alike, and a decoded value is exactly a normal bf16 (or a zero):
 * the attention of every backend reads the same numbers whatever it loads.
 */
#define SKV_FP8_EXP_MIN (-117) /* so that the smallest code (2^-9) times 2^k stays a normal bf16 */

/* The exponent k of a row of n finite bf16 values (SKV_FP8_EXP_MIN for an all-zero row). */
SKV_HD int32_t skv_fp8_row_exp(const uint16_t *v, int32_t n)
{
    uint32_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        uint32_t a = v[i] & 0x7fffu;
        m = a > m ? a : m; /* finite bf16 magnitudes order as their bits */
    }
    const int32_t E = (int32_t)(m >> 7), f = (int32_t)(m & 0x7fu);
    if (E == 0) return SKV_FP8_EXP_MIN; /* zero or subnormal: below any k the clamp allows */
    /* max = (1 + f/128) 2^(E-127): (1 + f/128) 2^8 <= 448 iff f <= 96 */
    const int32_t k = E - 127 - (f <= 96 ? 8 : 7);
    return k < SKV_FP8_EXP_MIN ? SKV_FP8_EXP_MIN : k;
}

/* The e4m3 code of bf16 x scaled by 2^-k, rounded to nearest even (|x| 2^-k <= 448 by the
   choice of k; a larger one saturates to 448). */
SKV_HD uint8_t skv_fp8_encode(uint16_t x, int32_t k)
{
    const uint32_t sgn = (uint32_t)(x >> 8) & 0x80u, E = (x >> 7) & 0xffu, f = x & 0x7fu;
    if ((x & 0x7fffu) == 0) return (uint8_t)sgn;
    /* |x| = man 2^p exactly, man < 256 */
    const uint32_t man = E ? 128u + f : f;
    const int32_t p = (E ? (int32_t)E : 1) - 134 - k;
    int32_t L = 0; /* bit length of man */
    for (uint32_t t = man; t; t >>= 1) L++;
    const int32_t ey = L - 1 + p;              /* floor(log2 |x| 2^-k) */
    int32_t qe = ey >= -6 ? ey - 3 : -9;       /* the e4m3 quantum at that magnitude */
    uint32_t q;
    if (p >= qe) {
        q = man << (p - qe);                   /* exact (p - qe <= 3) */
    } else {
        const int32_t sh = qe - p;
        if (sh > 9) return (uint8_t)sgn;      /* below half the smallest code */
        const uint32_t rem = man & ((1u << sh) - 1u), half = 1u << (sh - 1);
        q = man >> sh;
        if (rem > half || (rem == half && (q & 1u))) q++;
    }
    if (q == 0) return (uint8_t)sgn;
    if (q >= 16) { q >>= 1; qe++; }           /* the rounding carried into the next binade */
    uint32_t code;
    if (q < 8) code = q;                       /* subnormal: q 2^-9 (qe = -9) */
    else code = ((uint32_t)(qe + 10) << 3) | (q - 8u);
    if (code > 0x7eu) code = 0x7eu;            /* saturate at 448 (never reached with the row's k) */
    return (uint8_t)(sgn | code);
}

/* The bf16 bits of code 2^k, exact (k >= SKV_FP8_EXP_MIN, |code 2^k| < 2^128); NaN codes give a
   bf16 NaN (never written by skv_fp8_encode). */
SKV_HD uint16_t skv_fp8_decode(uint8_t c, int32_t k)
{
    const uint16_t sgn = (uint16_t)((c & 0x80u) << 8);
    const uint32_t ee = (c >> 3) & 0xfu, mm = c & 7u;
    if ((c & 0x7fu) == 0x7fu) return (uint16_t)(sgn | 0x7fc0u);
    if (ee) return (uint16_t)(sgn | ((uint32_t)((int32_t)ee - 7 + k + 127) << 7) | (mm << 4));
    if (!mm) return sgn;
    const int32_t L = mm >= 4 ? 3 : (mm >= 2 ? 2 : 1); /* subnormal code: mm 2^-9 */
    return (uint16_t)(sgn | ((uint32_t)(L - 1 - 9 + k + 127) << 7) | ((mm << (8 - L)) & 0x7fu));
}

/* Bytes of one chunk of c tokens of one KV head in a value store or chunk cache: bf16 [c][D];
   fp8: the codes [c][D], then the exponents [c] (int8), padded to 16 bytes. */
SKV_HD size_t skv_value_chunk_bytes(int32_t value_dtype, int32_t c, int32_t D)
{
    return value_dtype ? (size_t)c * (size_t)D + (((size_t)c + 15u) & ~(size_t)15u) : (size_t)2 * c * D;
}

/* Encodes one chunk of c tokens (token i's D values at v + i * stride) into rec (skv_value_chunk_bytes). */
SKV_HD void skv_fp8_encode_chunk(const uint16_t *v, int64_t stride, int32_t c, int32_t D, uint8_t *rec)
{
    int8_t *ex = (int8_t *)(rec + (size_t)c * D);
    for (int32_t i = 0; i < c; i++) {
        const uint16_t *row = v + i * stride;
        const int32_t k = skv_fp8_row_exp(row, D);
        ex[i] = (int8_t)k;
        for (int32_t d = 0; d < D; d++) rec[(size_t)i * D + d] = skv_fp8_encode(row[d], k);
    }
    for (int32_t i = c; i < (int32_t)(((size_t)c + 15u) & ~(size_t)15u); i++) ex[i] = 0;
}

/* Decodes one chunk record into bf16 out [c][D]. */
SKV_HD void skv_fp8_decode_chunk(const uint8_t *rec, int32_t c, int32_t D, uint16_t *out)
{
    const int8_t *ex = (const int8_t *)(rec + (size_t)c * D);
    for (int32_t i = 0; i < c; i++)
        for (int32_t d = 0; d < D; d++) out[(size_t)i * D + d] = skv_fp8_decode(rec[(size_t)i * D + d], ex[i]);
}

#endif /* SKV_NUMERICS_H */
