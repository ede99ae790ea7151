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
 *  - cuda/skv_cuda_select.cu: the landmark kernel (mean and cos chains, the
 *    ordered min as a warp reduction), the score kernel's dot chains and max,
 *    the canonical sum's lanes and tree (expsum_kernel, selz_kernel,
 *    canon_tree), the group max and top-S (select_kernel, selz_kernel).
 * (cpu's attention exp, skv_cpu_exp8, follows skv_expf's method but is not on
 * the decision path: it is held to tolerances, not to these bits.)
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
SKV_HD float skv_canonical_sum(const float *x, int64_t m)
{
    float P[SKV_CANON_LANES];
    for (int k = 0; k < SKV_CANON_LANES; k++) P[k] = 0.0f;
    for (int64_t j = 0; j < m; j++) P[j & (SKV_CANON_LANES - 1)] = SKV_ADD(P[j & (SKV_CANON_LANES - 1)], x[j]);
    for (int w = SKV_CANON_LANES / 2; w >= 1; w /= 2)
        for (int k = 0; k < w; k++) P[k] = SKV_ADD(P[k], P[k + w]);
    return P[0];
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

/* Ordering key for outliers: lower score is more outlying; NaN is most outlying. */
SKV_HD float skv_outlier_key(float s) { return s != s ? -3.0f : s; }

#endif /* SKV_NUMERICS_H */
