/*
 * The canonical rebuild and attention of the reproducible mode (docs/DESIGN.md
 * 10.2, 10.3) on the cpu: the same values as ref, bit for bit, in other
 * schedules.
 *
 *  - rebuild: the fixed-point integers of U rows and W_h columns as int16 (W_h
 *    packed once per call, q-paired), their exact sums by integer SIMD
 *    (AVX-512 VNNI vpdpwssd, 4 rows x 64 dims; AVX2 vpmaddwd, 4 rows x 16
 *    dims) in int32 blocks of 32 values of q, the blocks added in double (every
 *    sum an integer below r 2^26 < 2^53, so exact and the order does not
 *    matter); then skv_canon_rebuild_key, RoPE (skv_cpu_rope_row,
 *    skv_rope_row_f32's bits) and bf16. The U rows' fixed point and the keys'
 *    scaling are SIMD too (the same integers and roundings). Without SIMD:
 *    scalar, int64 sums.
 *  - attention: one work item per query head; the scores 8 tokens at a time
 *    (lane = token, each lane the fmaf chain over d of skv_dot_bf16), M by the
 *    first-wins scan, e_j by skv_expf, Z by skv_canonical_sum, and the 256
 *    lane sums of P V with the dims as SIMD lanes (every dim is an independent
 *    chain: lane l, dim d gets fma(e_j, v_jd, .) for j = l, l + 256, ... in
 *    order), then the fixed tree, dims again as SIMD lanes. Without SIMD:
 *    skv_canonical_attend itself.
 * Scratch comes from the skv_ws arena (skv_cpu_canon_ws_bytes sizes it), so
 * the decode path allocates nothing; items are independent, so the result does
 * not depend on the thread count.
 */
#include <string.h>

#include "skv_cpu_kernels.h"
#include "skv_cpu_ops.h"
#include "skv_cpu_simd.h"

#define SKV_CPU_CRB 16 /* rebuild: token rows per work item */

/* ---- rebuild ------------------------------------------------------------------------------- */

/*
 * The integers: xu (U rows) and xw (W_h columns) are 13-bit fixed point,
 * |x| <= 255 * 2^5 = 8160 < 2^13, so int16; a product is below 8160^2 < 2^26
 * and 32 of them sum below 32 * 8160^2 = 2130739200 < 2^31: int32 sums of up
 * to SKV_CPU_CQB values of q are exact, and the blocks' sums go on in double
 * (every partial sum an integer below r 2^26 < 2^53: exact). The order does
 * not matter, the sums being exact.
 * Layouts (rp = r rounded up to even, zeros past r and past D):
 *   wp [Hk][rp / 2][Dp][2] int16: W_h's q-pairs, dim-major inside a pair row,
 *                             so one SIMD load is the pairs of 8 (16) dims;
 *   xu [CRB][rp] int16 per thread: the rows' fixed point;
 *   P  [CRB][Dp] double per thread: the exact sums.
 */
#define SKV_CPU_CQB 16 /* q-pairs per int32 block (32 values of q) */

typedef struct {
    const skv_rope_config *rope;
    int32_t D, Hk, r, c, S, Dp, rp;
    int64_t M, nrb;
    const skv_bf16 *u, *w;
    const int32_t *chunk_ids, *counts;
    const float *cos_tab, *sin_tab;
    skv_bf16 *k_out;
    int16_t *wp;       /* [Hk][rp / 2][Dp][2] fixed-point W_h columns, q-paired */
    int32_t *ew;       /* [Hk][Dp] their exponents */
    char *buf;         /* per thread: xu [CRB][rp] int16, then P [CRB][Dp] double (64-byte aligned) */
    size_t per_thread; /* bytes */
    int kern;          /* 0 portable, 1 AVX2 madd, 2 AVX-512 VNNI */
} skv_cpu_canon_reb;

static int32_t skv_cpu_canon_dp(int32_t D) { return (D + 15) / 16 * 16; }
static int32_t skv_cpu_canon_rp(int32_t r) { return (r + 1) / 2 * 2; }
/* Bytes of one thread's xu and P (each part a multiple of 64). */
static size_t skv_cpu_canon_xu_bytes(int32_t r) { return ((size_t)SKV_CPU_CRB * skv_cpu_canon_rp(r) * 2 + 63) / 64 * 64; }
static size_t skv_cpu_canon_thread_bytes(int32_t r, int32_t D)
{
    return skv_cpu_canon_xu_bytes(r) + (size_t)SKV_CPU_CRB * skv_cpu_canon_dp(D) * sizeof(double);
}

/* Item h of the first job: W_h's columns in fixed point, q-paired. */
static void skv_cpu_canon_pack(void *ctx, int64_t h, int t)
{
    (void)t;
    const skv_cpu_canon_reb *c = ctx;
    const int32_t D = c->D, r = c->r, Dp = c->Dp, rp = c->rp;
    const size_t width = (size_t)c->Hk * D;
    int16_t *wp = c->wp + (size_t)h * rp * Dp;
    int32_t *ew = c->ew + (size_t)h * Dp;
    for (int32_t d = 0; d < Dp; d++) {
        if (d >= D) {
            ew[d] = 0;
            for (int32_t q = 0; q < rp; q++) wp[((size_t)(q >> 1) * Dp + d) * 2 + (q & 1)] = 0;
            continue;
        }
        const skv_bf16 *col = c->w + (size_t)h * D + d;
        uint16_t mx = 0;
        for (int32_t q = 0; q < r; q++)
            if ((col[(size_t)q * width] & 0x7fffu) > mx) mx = col[(size_t)q * width] & 0x7fffu;
        ew[d] = skv_canon_rebuild_ex(mx);
        for (int32_t q = 0; q < rp; q++)
            wp[((size_t)(q >> 1) * Dp + d) * 2 + (q & 1)] =
                q < r ? (int16_t)skv_canon_rebuild_fix(col[(size_t)q * width], ew[d]) : 0;
    }
}

#if SKV_CPU_X86
#define SKV_CPU_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))

/* The AVX-512 VNNI kernel may run: level AVX512 and the CPU has AVX512BW and AVX512_VNNI. */
static int skv_cpu_canon_vnni(void)
{
    static int have = -1;
    int h = __atomic_load_n(&have, __ATOMIC_RELAXED);
    if (h < 0) {
        __builtin_cpu_init();
        h = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
        __atomic_store_n(&have, h, __ATOMIC_RELAXED);
    }
    return h && skv_cpu_simd() >= SKV_CPU_LEVEL_AVX512;
}

/* skv_canon_rebuild_fix of 8 bf16 (as int32 lanes) against exponent e: the same integers. rne(m 2^-k) for k >= 1
   is (m + 2^(k-1) - 1 + lsb) >> k, lsb = bit k of m; k is capped at 31 (m < 2^9 rounds to 0 from k = 10 on). */
static inline SKV_CPU_AVX2 __m256i skv_cpu_canon_fix8(__m256i hv, __m256i e)
{
    const __m256i one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
    __m256i E = _mm256_and_si256(_mm256_srli_epi32(hv, 7), _mm256_set1_epi32(0xff));
    __m256i m = _mm256_and_si256(hv, _mm256_set1_epi32(0x7f));
    const __m256i normal = _mm256_cmpgt_epi32(E, zero);
    m = _mm256_or_si256(m, _mm256_and_si256(normal, _mm256_set1_epi32(0x80)));
    E = _mm256_max_epi32(E, one);
    const __m256i sh = _mm256_sub_epi32(_mm256_sub_epi32(E, _mm256_set1_epi32(122)), e);
    const __m256i up = _mm256_sllv_epi32(m, _mm256_max_epi32(sh, zero));
    const __m256i k = _mm256_min_epi32(_mm256_max_epi32(_mm256_sub_epi32(zero, sh), one), _mm256_set1_epi32(31));
    const __m256i lsb = _mm256_and_si256(_mm256_srlv_epi32(m, k), one);
    const __m256i half1 = _mm256_sub_epi32(_mm256_sllv_epi32(one, _mm256_sub_epi32(k, one)), one);
    const __m256i dn = _mm256_srlv_epi32(_mm256_add_epi32(_mm256_add_epi32(m, half1), lsb), k);
    __m256i x = _mm256_blendv_epi8(dn, up, _mm256_cmpgt_epi32(sh, _mm256_set1_epi32(-1)));
    const __m256i neg = _mm256_cmpgt_epi32(_mm256_and_si256(hv, _mm256_set1_epi32(0x8000)), zero);
    return _mm256_sub_epi32(_mm256_xor_si256(x, neg), neg);
}

/* Row ur [r] of U in fixed point: xr [r] int16 and the returned exponent (the scalar loop's values). */
SKV_CPU_AVX2 static int skv_cpu_canon_urow_avx2(const skv_bf16 *ur, int32_t r, int16_t *xr)
{
    const int32_t r16 = r / 16 * 16;
    __m256i mv = _mm256_setzero_si256();
    const __m256i abs = _mm256_set1_epi16(0x7fff);
    for (int32_t q = 0; q < r16; q += 16)
        mv = _mm256_max_epu16(mv, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(ur + q)), abs));
    __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(mv), _mm256_extracti128_si256(mv, 1));
    m8 = _mm_max_epu16(m8, _mm_srli_si128(m8, 8));
    m8 = _mm_max_epu16(m8, _mm_srli_si128(m8, 4));
    m8 = _mm_max_epu16(m8, _mm_srli_si128(m8, 2));
    uint16_t mx = (uint16_t)_mm_extract_epi16(m8, 0);
    for (int32_t q = r16; q < r; q++)
        if ((ur[q] & 0x7fffu) > mx) mx = ur[q] & 0x7fffu;
    const int e = skv_canon_rebuild_ex(mx);
    const __m256i ev = _mm256_set1_epi32(e);
    for (int32_t q = 0; q < r16; q += 16) {
        const __m256i hv = _mm256_loadu_si256((const __m256i *)(ur + q));
        const __m256i lo = skv_cpu_canon_fix8(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(hv)), ev);
        const __m256i hi = skv_cpu_canon_fix8(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(hv, 1)), ev);
        _mm256_storeu_si256((__m256i *)(xr + q), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8));
    }
    for (int32_t q = r16; q < r; q++) xr[q] = (int16_t)skv_canon_rebuild_fix(ur[q], e);
    return e;
}

/* x [D] = skv_canon_rebuild_key(P [d], eu + ew [d] - 24), 4 dims at a time (the same double product and rounding). */
SKV_CPU_AVX2 static void skv_cpu_canon_keys_avx2(const double *P, const int32_t *ew, int eu, int32_t D, float *x)
{
    const int32_t D4 = D / 4 * 4;
    const __m256i base = _mm256_set1_epi64x((int64_t)eu - 24 + 1023);
    int32_t d = 0;
    for (; d < D4; d += 4) {
        const __m256i ex = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm_loadu_si128((const __m128i *)(ew + d))), base);
        const __m256d s = _mm256_castsi256_pd(_mm256_slli_epi64(ex, 52));
        _mm_storeu_ps(x + d, _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_loadu_pd(P + d), s)));
    }
    for (; d < D; d++) x[d] = skv_canon_rebuild_key((int64_t)P[d], eu + ew[d] - 24);
}

/* P[4][8 J] (row stride Dp) = xu[4][rp] . wp (q-paired, dims [0, 8 J) of the tile): vpmaddwd in int32 blocks of
   SKV_CPU_CQB pairs, the blocks' sums added in double. */
static inline __attribute__((always_inline)) SKV_CPU_AVX2 void skv_cpu_canon_k4_avx2(int J, int32_t np, int32_t Dp,
                                                                                      const int16_t *xu, int32_t rp,
                                                                                      const int16_t *wp, double *P)
{
    for (int32_t b0 = 0; b0 < np; b0 += SKV_CPU_CQB) {
        const int32_t b1 = np - b0 < SKV_CPU_CQB ? np : b0 + SKV_CPU_CQB;
        __m256i a[4][2];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
            for (int j = 0; j < J; j++) a[i][j] = _mm256_setzero_si256();
        for (int32_t p = b0; p < b1; p++) {
            const int16_t *wr = wp + (size_t)p * Dp * 2;
            __m256i w[2];
#pragma GCC unroll 4
            for (int j = 0; j < J; j++) w[j] = _mm256_loadu_si256((const __m256i *)(wr + 16 * j));
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                int32_t pr;
                memcpy(&pr, xu + (size_t)i * rp + 2 * p, 4);
                const __m256i x = _mm256_set1_epi32(pr);
#pragma GCC unroll 4
                for (int j = 0; j < J; j++) a[i][j] = _mm256_add_epi32(a[i][j], _mm256_madd_epi16(x, w[j]));
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
            for (int j = 0; j < J; j++) {
                double *o = P + (size_t)i * Dp + 8 * j;
                __m256d lo = _mm256_cvtepi32_pd(_mm256_castsi256_si128(a[i][j]));
                __m256d hi = _mm256_cvtepi32_pd(_mm256_extracti128_si256(a[i][j], 1));
                if (b0) lo = _mm256_add_pd(lo, _mm256_loadu_pd(o)), hi = _mm256_add_pd(hi, _mm256_loadu_pd(o + 4));
                _mm256_storeu_pd(o, lo);
                _mm256_storeu_pd(o + 4, hi);
            }
    }
}

/* P = xu . W_h for rows4 (a multiple of 4) rows, 4 rows x 16 dims at a time. */
SKV_CPU_AVX2 static void skv_cpu_canon_gemm_avx2(int32_t rows4, int32_t rp, int32_t Dp, const int16_t *xu,
                                                 const int16_t *wp, double *P)
{
    for (int32_t i = 0; i < rows4; i += 4)
        for (int32_t d = 0; d < Dp; d += 16)
            skv_cpu_canon_k4_avx2(2, rp / 2, Dp, xu + (size_t)i * rp, rp, wp + (size_t)d * 2, P + (size_t)i * Dp + d);
}

/* The same with vpdpwssd: P[4][16 J], J zmm of 16 dims per row. */
static inline __attribute__((always_inline)) SKV_CPU_VNNI void skv_cpu_canon_k4_vnni(int J, int32_t np, int32_t Dp,
                                                                                     const int16_t *xu, int32_t rp,
                                                                                     const int16_t *wp, double *P)
{
    for (int32_t b0 = 0; b0 < np; b0 += SKV_CPU_CQB) {
        const int32_t b1 = np - b0 < SKV_CPU_CQB ? np : b0 + SKV_CPU_CQB;
        __m512i a[4][4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
            for (int j = 0; j < J; j++) a[i][j] = _mm512_setzero_si512();
        for (int32_t p = b0; p < b1; p++) {
            const int16_t *wr = wp + (size_t)p * Dp * 2;
            __m512i w[4];
#pragma GCC unroll 4
            for (int j = 0; j < J; j++) w[j] = _mm512_loadu_si512((const void *)(wr + 32 * j));
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                int32_t pr;
                memcpy(&pr, xu + (size_t)i * rp + 2 * p, 4);
                const __m512i x = _mm512_set1_epi32(pr);
#pragma GCC unroll 4
                for (int j = 0; j < J; j++) a[i][j] = _mm512_dpwssd_epi32(a[i][j], x, w[j]);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
            for (int j = 0; j < J; j++) {
                double *o = P + (size_t)i * Dp + 16 * j;
                __m512d lo = _mm512_cvtepi32_pd(_mm512_castsi512_si256(a[i][j]));
                __m512d hi = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(a[i][j], 1));
                if (b0) lo = _mm512_add_pd(lo, _mm512_loadu_pd(o)), hi = _mm512_add_pd(hi, _mm512_loadu_pd(o + 8));
                _mm512_storeu_pd(o, lo);
                _mm512_storeu_pd(o + 8, hi);
            }
    }
}

/* The full tile of skv_cpu_canon_k4_vnni (J = 4) with named accumulators (GCC keeps them in registers). */
#define SKV_CC_DP4(i)                                                                                          \
    do {                                                                                                       \
        int32_t pr;                                                                                            \
        memcpy(&pr, xu + (size_t)(i) * rp + 2 * p, 4);                                                         \
        const __m512i x = _mm512_set1_epi32(pr);                                                               \
        a##i##0 = _mm512_dpwssd_epi32(a##i##0, x, w0), a##i##1 = _mm512_dpwssd_epi32(a##i##1, x, w1);          \
        a##i##2 = _mm512_dpwssd_epi32(a##i##2, x, w2), a##i##3 = _mm512_dpwssd_epi32(a##i##3, x, w3);          \
    } while (0)
#define SKV_CC_OUT(i, j)                                                                                       \
    do {                                                                                                       \
        double *o = P + (size_t)(i) * Dp + 16 * (j);                                                           \
        __m512d lo = _mm512_cvtepi32_pd(_mm512_castsi512_si256(a##i##j));                                      \
        __m512d hi = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(a##i##j, 1));                                \
        if (b0) lo = _mm512_add_pd(lo, _mm512_loadu_pd(o)), hi = _mm512_add_pd(hi, _mm512_loadu_pd(o + 8));    \
        _mm512_storeu_pd(o, lo);                                                                               \
        _mm512_storeu_pd(o + 8, hi);                                                                           \
    } while (0)
SKV_CPU_VNNI static void skv_cpu_canon_k4x64_vnni(int32_t np, int32_t Dp, const int16_t *xu, int32_t rp,
                                                  const int16_t *wp, double *P)
{
    for (int32_t b0 = 0; b0 < np; b0 += SKV_CPU_CQB) {
        const int32_t b1 = np - b0 < SKV_CPU_CQB ? np : b0 + SKV_CPU_CQB;
        __m512i a00 = _mm512_setzero_si512(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
                a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
        for (int32_t p = b0; p < b1; p++) {
            const int16_t *wr = wp + (size_t)p * Dp * 2;
            const __m512i w0 = _mm512_loadu_si512((const void *)wr), w1 = _mm512_loadu_si512((const void *)(wr + 32)),
                          w2 = _mm512_loadu_si512((const void *)(wr + 64)),
                          w3 = _mm512_loadu_si512((const void *)(wr + 96));
            SKV_CC_DP4(0);
            SKV_CC_DP4(1);
            SKV_CC_DP4(2);
            SKV_CC_DP4(3);
        }
        SKV_CC_OUT(0, 0); SKV_CC_OUT(0, 1); SKV_CC_OUT(0, 2); SKV_CC_OUT(0, 3);
        SKV_CC_OUT(1, 0); SKV_CC_OUT(1, 1); SKV_CC_OUT(1, 2); SKV_CC_OUT(1, 3);
        SKV_CC_OUT(2, 0); SKV_CC_OUT(2, 1); SKV_CC_OUT(2, 2); SKV_CC_OUT(2, 3);
        SKV_CC_OUT(3, 0); SKV_CC_OUT(3, 1); SKV_CC_OUT(3, 2); SKV_CC_OUT(3, 3);
    }
}
#undef SKV_CC_DP4
#undef SKV_CC_OUT

/* P = xu . W_h for rows4 rows: 4 rows x 64 dims at a time (the last tile 16, 32 or 48). */
SKV_CPU_VNNI static void skv_cpu_canon_gemm_vnni(int32_t rows4, int32_t rp, int32_t Dp, const int16_t *xu,
                                                 const int16_t *wp, double *P)
{
    for (int32_t i = 0; i < rows4; i += 4) {
        const int16_t *x = xu + (size_t)i * rp;
        double *Pi = P + (size_t)i * Dp;
        int32_t d = 0;
        for (; d + 64 <= Dp; d += 64) skv_cpu_canon_k4x64_vnni(rp / 2, Dp, x, rp, wp + (size_t)d * 2, Pi + d);
        switch ((Dp - d) / 16) {
        case 1: skv_cpu_canon_k4_vnni(1, rp / 2, Dp, x, rp, wp + (size_t)d * 2, Pi + d); break;
        case 2: skv_cpu_canon_k4_vnni(2, rp / 2, Dp, x, rp, wp + (size_t)d * 2, Pi + d); break;
        case 3: skv_cpu_canon_k4_vnni(3, rp / 2, Dp, x, rp, wp + (size_t)d * 2, Pi + d); break;
        default: break;
        }
    }
}
#endif

/* Item of the second job: SKV_CPU_CRB token rows of one head. */
static void skv_cpu_canon_rows(void *ctx, int64_t it, int t)
{
    const skv_cpu_canon_reb *c = ctx;
    const int32_t D = c->D, r = c->r, Dp = c->Dp, rp = c->rp, R = c->rope->rotary_dim ? c->rope->rotary_dim : D,
                  h2 = R / 2;
    const int64_t h = it / c->nrb, m0 = it % c->nrb * SKV_CPU_CRB;
    const int64_t lim = c->counts ? (int64_t)c->counts[h] * c->c : c->M; /* the head's rows */
    if (m0 >= lim) return;
    const int32_t rows = (int32_t)(lim - m0 < SKV_CPU_CRB ? lim - m0 : SKV_CPU_CRB), rows4 = (rows + 3) / 4 * 4;
    int16_t *xu = (int16_t *)(c->buf + (size_t)t * c->per_thread);
    double *P = (double *)((char *)xu + skv_cpu_canon_xu_bytes(r));
    float x[SKV_CPU_MAX_D];
    int eu[SKV_CPU_CRB];
    for (int32_t i = 0; i < rows4; i++) {
        int16_t *xr = xu + (size_t)i * rp;
        if (i >= rows) {
            memset(xr, 0, (size_t)rp * sizeof *xr);
            eu[i] = 0;
            continue;
        }
        const int64_t m = m0 + i, tk = (int64_t)c->chunk_ids[h * c->S + m / c->c] * c->c + m % c->c;
        const skv_bf16 *ur = c->u + (size_t)tk * r;
        if (rp > r) xr[r] = 0;
#if SKV_CPU_X86
        if (c->kern) {
            eu[i] = skv_cpu_canon_urow_avx2(ur, r, xr);
            continue;
        }
#endif
        uint16_t mx = 0;
        for (int32_t q = 0; q < r; q++)
            if ((ur[q] & 0x7fffu) > mx) mx = ur[q] & 0x7fffu;
        eu[i] = skv_canon_rebuild_ex(mx);
        for (int32_t q = 0; q < r; q++) xr[q] = (int16_t)skv_canon_rebuild_fix(ur[q], eu[i]);
    }
    const int16_t *wp = c->wp + (size_t)h * rp * Dp;
    const int32_t *ew = c->ew + (size_t)h * Dp;
#if SKV_CPU_X86
    if (c->kern == 2) skv_cpu_canon_gemm_vnni(rows4, rp, Dp, xu, wp, P);
    else if (c->kern == 1) skv_cpu_canon_gemm_avx2(rows4, rp, Dp, xu, wp, P);
    else
#endif
        for (int32_t i = 0; i < rows; i++)
            for (int32_t d = 0; d < D; d++) {
                int64_t s = 0;
                for (int32_t q = 0; q < r; q++)
                    s += (int64_t)xu[(size_t)i * rp + q] * wp[((size_t)(q >> 1) * Dp + d) * 2 + (q & 1)];
                P[(size_t)i * Dp + d] = (double)s;
            }
    for (int32_t i = 0; i < rows; i++) {
        const int64_t m = m0 + i, tk = (int64_t)c->chunk_ids[h * c->S + m / c->c] * c->c + m % c->c;
#if SKV_CPU_X86
        if (c->kern) skv_cpu_canon_keys_avx2(P + (size_t)i * Dp, ew, eu[i], D, x);
        else
#endif
            for (int32_t d = 0; d < D; d++)
                x[d] = skv_canon_rebuild_key((int64_t)P[(size_t)i * Dp + d], eu[i] + ew[d] - 24);
        skv_cpu_rope_row(x, D, R, c->rope->interleaved, c->cos_tab + tk * h2, c->sin_tab + tk * h2,
                         c->k_out + ((size_t)h * c->M + m) * D);
    }
}

skv_status skv_cpu_rebuild_keys_canonical(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r, int32_t c,
                                          int32_t S, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                                          const int32_t *chunk_ids, const int32_t *counts, const float *cos_tab,
                                          const float *sin_tab, skv_bf16 *k_out, skv_ws *ws)
{
    (void)n;
    const int32_t Dp = skv_cpu_canon_dp(D), rp = skv_cpu_canon_rp(r);
    const int64_t M = (int64_t)S * c, nrb = (M + SKV_CPU_CRB - 1) / SKV_CPU_CRB;
    skv_cpu_canon_reb job = {rope, D, Hk, r, c, S, Dp, rp, M, nrb, u, w, chunk_ids, counts, cos_tab, sin_tab, k_out,
                             NULL, NULL, NULL, skv_cpu_canon_thread_bytes(r, D), 0};
#if SKV_CPU_X86
    job.kern = skv_cpu_canon_vnni() ? 2 : skv_cpu_simd() ? 1 : 0;
#endif
    const int nt = skv_cpu_team((int64_t)Hk * nrb);
    job.wp = skv_ws_alloc(ws, (size_t)Hk * rp * Dp * sizeof *job.wp);
    job.ew = skv_ws_alloc(ws, (size_t)Hk * Dp * sizeof *job.ew);
    job.buf = skv_ws_alloc(ws, (size_t)nt * job.per_thread);
    if (!job.wp || !job.ew || !job.buf) return SKV_ERR_OUT_OF_MEMORY;
    skv_cpu_run(skv_cpu_team(Hk), Hk, skv_cpu_canon_pack, &job);
    skv_cpu_run(nt, (int64_t)Hk * nrb, skv_cpu_canon_rows, &job);
    return SKV_OK;
}

/* ---- attention ----------------------------------------------------------------------------- */

typedef struct {
    int32_t G, D, Dp, n_spans;
    float scale;
    const skv_bf16 *q;
    const skv_kv_span *spans;
    const int64_t *head_tokens; /* NULL, or [n_spans][Hk] */
    int32_t Hk;
    int64_t T;
    float *out;
    float *buf;        /* per thread: e [T], lanes [256][Dp] */
    size_t per_thread; /* floats */
} skv_cpu_canon_att;

static int32_t skv_cpu_canon_adp(int32_t D) { return (D + 7) / 8 * 8; }

#if SKV_CPU_X86
/* s[i] = skv_dot_bf16(q, p[i], D) for 8 rows, lane i the fmaf chain over d in order. */
SKV_CPU_AVX2 static __m256 skv_cpu_canon_dot8(const float *qf, int32_t D, const skv_bf16 *const p[8])
{
    __m256 a = _mm256_setzero_ps();
    int32_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 rr[8];
        for (int i = 0; i < 8; i++) rr[i] = skv_cpu_ld8(p[i] + d);
        skv_cpu_transpose8(rr);
        for (int e = 0; e < 8; e++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + d + e), rr[e], a);
    }
    for (; d < D; d++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + d), skv_cpu_col8(p, d), a);
    return a;
}

/* One query head (item i): DESIGN 10.3 with SIMD lanes across tokens (scores) and dims (lane sums). */
SKV_CPU_AVX2 __attribute__((flatten)) static void skv_cpu_canon_head_avx2(const skv_cpu_canon_att *c, int64_t i,
                                                                          float *e, float *N)
{
    const int32_t D = c->D, Dp = c->Dp;
    const int64_t h = i / c->G;
    float qf[SKV_CPU_MAX_D];
    for (int32_t d = 0; d < D; d++) qf[d] = skv_bf16_to_f32(c->q[(size_t)i * D + d]);
    /* scores, 8 tokens at a time across span boundaries */
    const skv_bf16 *p[8];
    int64_t j = 0, j0 = 0;
    int np = 0;
    for (int32_t sp = 0; sp < c->n_spans; sp++) {
        const skv_kv_span *s = &c->spans[sp];
        for (int64_t t = 0; t < s->n_tokens; t++) {
            p[np++] = s->k + h * s->head_stride + t * s->token_stride;
            j++;
            if (np == 8) {
                _mm256_storeu_ps(e + j0, _mm256_mul_ps(skv_cpu_canon_dot8(qf, D, p), _mm256_set1_ps(c->scale)));
                j0 = j, np = 0;
            }
        }
    }
    for (int k = 0; k < np; k++) e[j0 + k] = SKV_MUL(skv_dot_f32_bf16(qf, p[k], D), c->scale);
    const int64_t T = c->T;
    float M = e[0];
    for (int64_t t = 1; t < T; t++)
        if (e[t] > M) M = e[t];
    for (int64_t t = 0; t < T; t++) e[t] = skv_expf(SKV_SUB(e[t], M));
    const float Z = skv_canonical_sum(e, T);
    /* the 256 lanes of every dim */
    memset(N, 0, sizeof(float) * SKV_CANON_LANES * (size_t)Dp);
    const int32_t D8 = D / 8 * 8;
    j = 0;
    for (int32_t sp = 0; sp < c->n_spans; sp++) {
        const skv_kv_span *s = &c->spans[sp];
        const skv_bf16 *vh = s->v + h * s->head_stride;
        for (int64_t t = 0; t < s->n_tokens; t++, j++) {
            const skv_bf16 *v = vh + t * s->token_stride;
            float *Nl = N + (size_t)(j & (SKV_CANON_LANES - 1)) * Dp;
            const __m256 x = _mm256_set1_ps(e[j]);
            int32_t d = 0;
            for (; d < D8; d += 8) _mm256_storeu_ps(Nl + d, _mm256_fmadd_ps(x, skv_cpu_ld8(v + d), _mm256_loadu_ps(Nl + d)));
            for (; d < D; d++) Nl[d] = SKV_FMA(e[j], skv_bf16_to_f32(v[d]), Nl[d]);
        }
    }
    for (int w = SKV_CANON_LANES / 2; w >= 1; w /= 2)
        for (int k = 0; k < w; k++) {
            float *a = N + (size_t)k * Dp;
            const float *b = N + (size_t)(k + w) * Dp;
            for (int32_t d = 0; d < Dp; d += 8) _mm256_storeu_ps(a + d, _mm256_add_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d)));
        }
    float *o = c->out + (size_t)i * D;
    const __m256 z = _mm256_set1_ps(Z);
    int32_t d = 0;
    for (; d < D8; d += 8) _mm256_storeu_ps(o + d, _mm256_div_ps(_mm256_loadu_ps(N + d), z));
    for (; d < D; d++) o[d] = SKV_DIV(N[d], Z);
}
#endif

/* Item i: query head i. */
static void skv_cpu_canon_head(void *ctx, int64_t i, int t)
{
    const skv_cpu_canon_att *c0 = ctx;
    float *e = c0->buf + (size_t)t * c0->per_thread, *N = e + (c0->T + 15) / 16 * 16;
    const int64_t h = i / c0->G;
    /* the spans as head h sees them (head_tokens), and their total */
    skv_kv_span hs[SKV_MAX_SPANS];
    skv_cpu_canon_att ch = *c0, *c = &ch;
    ch.T = 0;
    for (int32_t sp = 0; sp < c0->n_spans; sp++) {
        hs[sp] = c0->spans[sp];
        if (c0->head_tokens) hs[sp].n_tokens = c0->head_tokens[(size_t)sp * c0->Hk + h];
        ch.T += hs[sp].n_tokens;
    }
    ch.spans = hs;
#if SKV_CPU_X86
    if (skv_cpu_simd()) {
        skv_cpu_canon_head_avx2(c, i, e, N);
        return;
    }
#endif
    skv_canon_span cs[SKV_MAX_SPANS];
    for (int32_t sp = 0; sp < c->n_spans; sp++) {
        const skv_kv_span *s = &c->spans[sp];
        cs[sp].n_tokens = s->n_tokens, cs[sp].token_stride = s->token_stride;
        cs[sp].k = s->n_tokens ? s->k + h * s->head_stride : NULL;
        cs[sp].v = s->n_tokens ? s->v + h * s->head_stride : NULL;
    }
    skv_canonical_attend(c->q + (size_t)i * c->D, c->D, c->scale, c->n_spans, cs, N, c->out + (size_t)i * c->D);
}

/* Floats of one thread's scratch for T tokens. */
static size_t skv_cpu_canon_att_floats(int64_t T, int32_t D)
{
    return (size_t)(T + 15) / 16 * 16 + (size_t)SKV_CANON_LANES * ((size_t)skv_cpu_canon_adp(D) + 1);
}

skv_status skv_cpu_sparse_attention_canonical(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                              int32_t n_spans, const skv_kv_span *spans, const int64_t *head_tokens,
                                              float *out, skv_ws *ws)
{
    int64_t T = 0; /* the most tokens of a head: the scratch of one item */
    for (int32_t s = 0; s < n_spans; s++) T += spans[s].n_tokens;
    skv_cpu_canon_att c = {Hq / Hk, D, skv_cpu_canon_adp(D), n_spans, scale, q, spans, head_tokens, Hk, T, out, NULL,
                           skv_cpu_canon_att_floats(T, D)};
    const int nt = skv_cpu_team(Hq);
    c.buf = skv_ws_alloc(ws, (size_t)nt * c.per_thread * sizeof *c.buf);
    if (!c.buf) return SKV_ERR_OUT_OF_MEMORY;
    skv_cpu_run(nt, Hq, skv_cpu_canon_head, &c);
    return SKV_OK;
}

/* skv_ws_alloc bytes of the canonical rebuild and attention of a cache's config (the larger),
   nt threads, at most max_tokens tokens per attention call. */
size_t skv_cpu_canon_ws_bytes(const skv_config *cfg, int64_t max_tokens, int nt)
{
    const size_t Hk = (size_t)cfg->n_kv_heads, Dp = (size_t)skv_cpu_canon_dp(cfg->head_dim);
    const size_t reb = SKV_WS_BYTES(sizeof(int16_t) * Hk * (size_t)skv_cpu_canon_rp(skv_cfg_rank(cfg)) * Dp +
                                        (size_t)nt * skv_cpu_canon_thread_bytes(skv_cfg_rank(cfg), cfg->head_dim) +
                                        sizeof(int32_t) * Hk * Dp, 3);
    const size_t att = SKV_WS_BYTES(sizeof(float) * (size_t)nt * skv_cpu_canon_att_floats(max_tokens, cfg->head_dim), 1);
    return reb > att ? reb : att;
}
