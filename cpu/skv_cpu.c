/*
 * cpu backend: OpenMP + AVX2/FMA (+ LAPACKE, OpenBLAS). Starts from ref's
 * table and overrides every op slot.
 *
 * Decisions (landmarks, outliers, candidates, selection) must be bit-identical
 * to ref (docs/DESIGN.md section 5). They are computed from skv_numerics.h; where a
 * loop is vectorized, it is vectorized ACROSS independent chains (candidates,
 * tokens, dims), so every lane runs exactly the fmaf/add/div sequence of the
 * shared scalar function, in the same order. Only IEEE-rounded AVX ops are
 * used there (vfmadd, vadd, vmul, vdiv, vsqrt, vmax with fmaxf's NaN rule).
 *
 * Tolerance-checked products (factorize, rebuild) use the small GEMM
 * micro-kernels below rather than OpenBLAS: see the note there. OpenBLAS is
 * used through LAPACK's eigensolver (the EXACT factorization route: n < d,
 * 2r > d, SKV_FACTORIZE=exact, and every shape in the portable no-AVX2 build),
 * always from the calling thread, never inside an OpenMP region (a pthreads
 * OpenBLAS would nest its own pool under ours). The FAST factorization route
 * (lib/skv_factor.h) uses no BLAS at all: its r x r Cholesky factorizations
 * are small serial loops here, so OpenBLAS threads never compete with ours.
 *
 * Results do not depend on the thread count (fixed blocking, fixed merge
 * order). Scratch: the decode slots take theirs from the cache's workspace
 * (skv_ws, sized by skv_cpu_decode_ws_bytes at create), so a decode step
 * allocates nothing; prefill slots malloc per call. No global or thread-local
 * state, so separate caches can run concurrently on separate threads.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <lapacke.h>
#include <omp.h>

#include "skv_backend.h"
#include "skv_factor.h"
#include "skv_numerics.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SKV_CPU_SIMD 1
#else
#define SKV_CPU_SIMD 0
#endif

#define SKV_CPU_MAX_D 1024 /* lib/ rejects head_dim > 1024 */
#define SKV_CPU_RB 48      /* rebuild: rows per work item, 8 slivers of 6 */
#define SKV_CPU_BT 256     /* attention: tokens per work item */

static int skv_cpu_min(int a, int b) { return a < b ? a : b; }

/* ---- SIMD helpers -------------------------------------------------------------- */

#if SKV_CPU_SIMD
/* 8 bf16 -> 8 float, exact (bf16 is the upper half of a float). */
static inline __m256 skv_cpu_ld8(const skv_bf16 *p)
{
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 8 float -> 8 bf16 with skv_f32_to_bf16's rounding and NaN rule, bit for bit. */
static inline void skv_cpu_st8(skv_bf16 *p, __m256 x)
{
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rn = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    __m256i qn = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    __m256i r = _mm256_blendv_epi8(rn, qn, nan);
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi)); /* values <= 0xffff: no saturation */
}

/* In-register 8x8 transpose: r[i] lane j  ->  r[j] lane i. */
static inline void skv_cpu_transpose8(__m256 r[8])
{
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* Column d of 8 bf16 rows (row i at p[i]) as one vector, lane i = row i. */
static inline __m256 skv_cpu_col8(const skv_bf16 *const p[8], int d)
{
    return _mm256_setr_ps(skv_bf16_to_f32(p[0][d]), skv_bf16_to_f32(p[1][d]), skv_bf16_to_f32(p[2][d]),
                          skv_bf16_to_f32(p[3][d]), skv_bf16_to_f32(p[4][d]), skv_bf16_to_f32(p[5][d]),
                          skv_bf16_to_f32(p[6][d]), skv_bf16_to_f32(p[7][d]));
}

static inline float skv_cpu_hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/*
 * GEMM micro-kernels (BLIS style) for the tolerance-checked products
 * (factorize, rebuild). Why not OpenBLAS here: the Debian OpenBLAS 0.3.21
 * DYNAMIC_ARCH build detects this VM's Xeon as "Prescott" and runs SSE3
 * kernels at ~1/5 of AVX2 speed (dsyrk 12 GFLOP/s on 2 cores); and BLAS
 * threads interleaved with OpenMP regions fight over the cores.
 * Packed panels: a[p*6 + i], b[p*NR + j] for p < k; 12 accumulators.
 */
#define SKV_CPU_FMA2(ci0, ci1, i)                          \
    x = _mm256_broadcast_ss(a + (i));                      \
    ci0 = _mm256_fmadd_ps(x, b0, ci0);                     \
    ci1 = _mm256_fmadd_ps(x, b1, ci1)

/* float 6x16 tile, written to c (row stride ldc). */
static void skv_cpu_skern(int k, const float *a, const float *b, float *c, int64_t ldc)
{
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, x;
    for (int p = 0; p < k; p++, a += 6, b += 16) {
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        SKV_CPU_FMA2(c00, c01, 0);
        SKV_CPU_FMA2(c10, c11, 1);
        SKV_CPU_FMA2(c20, c21, 2);
        SKV_CPU_FMA2(c30, c31, 3);
        SKV_CPU_FMA2(c40, c41, 4);
        SKV_CPU_FMA2(c50, c51, 5);
    }
    __m256 cc[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    for (int i = 0; i < 6; i++) {
        _mm256_storeu_ps(c + i * ldc, cc[2 * i]);
        _mm256_storeu_ps(c + i * ldc + 8, cc[2 * i + 1]);
    }
}

#define SKV_CPU_DFMA2(ci0, ci1, i)                         \
    x = _mm256_broadcast_sd(a + (i));                      \
    ci0 = _mm256_fmadd_pd(x, b0, ci0);                     \
    ci1 = _mm256_fmadd_pd(x, b1, ci1)

/* double 6x8 tile, written to t[6*8]. */
static void skv_cpu_dkern(int64_t k, const double *a, const double *b, double *t)
{
    __m256d c00 = _mm256_setzero_pd(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256d c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, x;
    for (int64_t p = 0; p < k; p++, a += 6, b += 8) {
        __m256d b0 = _mm256_loadu_pd(b), b1 = _mm256_loadu_pd(b + 4);
        SKV_CPU_DFMA2(c00, c01, 0);
        SKV_CPU_DFMA2(c10, c11, 1);
        SKV_CPU_DFMA2(c20, c21, 2);
        SKV_CPU_DFMA2(c30, c31, 3);
        SKV_CPU_DFMA2(c40, c41, 4);
        SKV_CPU_DFMA2(c50, c51, 5);
    }
    __m256d cc[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    for (int i = 0; i < 12; i++) _mm256_storeu_pd(t + 4 * i, cc[i]);
}

/* 64-byte aligned scratch (no 32-byte loads split across cache lines); free(). */
static void *skv_cpu_alloc(size_t bytes)
{
    void *p = NULL;
    return posix_memalign(&p, 64, bytes ? bytes : 64) ? NULL : p;
}
#endif

/* bf16 -> float of n contiguous values. */
static void skv_cpu_to_f32(const skv_bf16 *in, float *out, int64_t n)
{
    int64_t i = 0;
#if SKV_CPU_SIMD
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, skv_cpu_ld8(in + i));
#endif
    for (; i < n; i++) out[i] = skv_bf16_to_f32(in[i]);
}

/*
 * skv_rope_row_f32, vectorized over pairs for the rotate-half layout: the same
 * fmaf/mul per element and the same bf16 rounding, so the output is identical
 * (tests compare rope bit for bit against ref). Interleaved pairs and the
 * rotary tail go through the shared scalar function.
 */
static void skv_cpu_rope_row(const float *x, int D, int R, int interleaved, const float *cs,
                             const float *sn, skv_bf16 *out)
{
#if SKV_CPU_SIMD
    int h2 = R / 2;
    if (!interleaved && h2 >= 8) {
        int i = 0;
        for (; i + 8 <= h2; i += 8) {
            __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + h2);
            __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(sn + i);
            __m256 nbs = _mm256_xor_ps(_mm256_mul_ps(b, s), _mm256_set1_ps(-0.0f)); /* -(y*s) */
            skv_cpu_st8(out + i, _mm256_fmadd_ps(a, c, nbs));
            skv_cpu_st8(out + i + h2, _mm256_fmadd_ps(b, c, _mm256_mul_ps(a, s)));
        }
        for (; i < h2; i++) {
            float xo, yo;
            skv_rope_rotate(x[i], x[i + h2], cs[i], sn[i], &xo, &yo);
            out[i] = skv_f32_to_bf16(xo);
            out[i + h2] = skv_f32_to_bf16(yo);
        }
        for (int d = R; d < D; d++) out[d] = skv_f32_to_bf16(x[d]);
        return;
    }
#endif
    skv_rope_row_f32(x, D, R, interleaved, cs, sn, out);
}

/* ---- infrastructure -------------------------------------------------------------- */

static void skv_cpu_set_threads(int32_t n)
{
    /* Sets the calling thread's OpenMP default (lib/ calls this at cache create). */
    if (n > 0) omp_set_num_threads(n);
}

/* First non-finite index of a contiguous tensor; blocks in parallel, min of the first hits. */
static skv_status skv_cpu_check_contiguous(const skv_bf16 *x, int64_t n, int64_t *first_bad)
{
    const int64_t B = 1 << 16;
    int64_t nb = (n + B - 1) / B, first = n;
    if (n <= 4 * B) { /* lib/ also checks single rows: no OpenMP overhead for those */
        for (int64_t i = 0; i < n; i++)
            if (!skv_bf16_isfinite(x[i])) {
                *first_bad = i;
                return SKV_ERR_NONFINITE;
            }
        return SKV_OK;
    }
#pragma omp parallel for schedule(static) reduction(min : first)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * B, hi = lo + B < n ? lo + B : n;
        unsigned bad = 0;
        for (int64_t i = lo; i < hi; i++) bad |= (x[i] & 0x7f80u) == 0x7f80u; /* vectorizes */
        if (!bad) continue;
        for (int64_t i = lo; i < hi; i++)
            if (!skv_bf16_isfinite(x[i])) {
                if (i < first) first = i;
                break;
            }
    }
    if (first == n) return SKV_OK;
    *first_bad = first;
    return SKV_ERR_NONFINITE;
}

/* Strided tensors row by row (rows are what lib/ passes for spans). */
static skv_status skv_cpu_check_finite(const skv_bf16 *x, int64_t n_a, int64_t s_a, int64_t n_b, int64_t s_b,
                                       int64_t len, int64_t *first_bad)
{
    if (n_a == 1 && n_b == 1) return skv_cpu_check_contiguous(x, len, first_bad);
    for (int64_t i = 0; i < n_a; i++)
        for (int64_t j = 0; j < n_b; j++)
            if (skv_cpu_check_contiguous(x + i * s_a + j * s_b, len, first_bad) != SKV_OK) {
                *first_bad += (i * n_b + j) * len;
                return SKV_ERR_NONFINITE;
            }
    return SKV_OK;
}

/* ---- factorize ------------------------------------------------------------------ */

/* bf16 rows [rows, d] -> double (BLAS paths; serial: they run between BLAS calls). */
static void skv_cpu_rows_f64(const skv_bf16 *a, int64_t rows, int32_t d, double *out)
{
    for (int64_t i = 0; i < rows * d; i++) out[i] = (double)skv_bf16_to_f32(a[i]);
}

/*
 * Top-r eigenvectors of the symmetric m x m matrix g (upper triangle, row
 * major), descending by eigenvalue, into v [m, r] (column q = q-th largest).
 */
static skv_status skv_cpu_top_eigvecs(double *g, int32_t m, int32_t r, double *v)
{
    double *evals = malloc((size_t)m * sizeof *evals), *z = malloc((size_t)m * r * sizeof *z);
    lapack_int *isuppz = malloc((size_t)2 * m * sizeof *isuppz), found = 0, info = 0;
    skv_status st = SKV_OK;
    if (!evals || !z || !isuppz) {
        st = SKV_ERR_OUT_OF_MEMORY;
        goto done;
    }
    info = LAPACKE_dsyevr(LAPACK_ROW_MAJOR, 'V', 'I', 'U', m, g, m, 0.0, 0.0, m - r + 1, m, 0.0, &found,
                          evals, z, r, isuppz);
    if (info == LAPACK_WORK_MEMORY_ERROR || info == LAPACK_TRANSPOSE_MEMORY_ERROR) {
        st = SKV_ERR_OUT_OF_MEMORY;
        goto done;
    }
    if (info != 0 || found != r) {
        st = SKV_ERR_NUMERICAL;
        goto done;
    }
    for (int32_t i = 0; i < m; i++)
        for (int32_t q = 0; q < r; q++) v[(size_t)i * r + q] = z[(size_t)i * r + (r - 1 - q)];
done:
    free(evals);
    free(z);
    free(isuppz);
    return st;
}

#if SKV_CPU_SIMD
/*
 * Slice s of S of the packing (bf16 -> double) of a kc-row block at row t0:
 * 6-column slivers xa [kc][6] (the kernel's "a"; stride kc * 6 + 8, each row
 * stored as 8 values, the 2 extra overwritten by the next row or left in the
 * padding) and 8-column slivers xb [kc][8] (its "b"), zero padded past d. A
 * slice is a range of slivers: sequential writes, and the rows read stay in L1.
 */
#define SKV_CPU_KC 256
#define SKV_CPU_PACK_SLICES 8
#define SKV_CPU_XA_STRIDE(kc) ((size_t)(kc) * 6 + 8)

static void skv_cpu_gram_pack(const skv_bf16 *a, int32_t d, int64_t t0, int64_t kc, int s, int S, double *xa,
                              double *xb)
{
    const int32_t na = (d + 5) / 6, nb = (d + 7) / 8;
    const skv_bf16 *blk = a + (size_t)t0 * d;
    for (int32_t is = na * s / S; is < na * (s + 1) / S; is++) {
        double *dst = xa + (size_t)is * SKV_CPU_XA_STRIDE(kc);
        int32_t i0 = is * 6;
        if (i0 + 8 <= d) {
            for (int64_t q = 0; q < kc; q++) {
                __m256 x = skv_cpu_ld8(blk + (size_t)q * d + i0);
                _mm256_storeu_pd(dst + q * 6, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
                _mm256_storeu_pd(dst + q * 6 + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
            }
        } else {
            for (int64_t q = 0; q < kc; q++)
                for (int32_t i = 0; i < 6; i++)
                    dst[q * 6 + i] = i0 + i < d ? skv_bf16_to_f32(blk[(size_t)q * d + i0 + i]) : 0.0;
        }
    }
    for (int32_t js = nb * s / S; js < nb * (s + 1) / S; js++) {
        double *dst = xb + (size_t)js * kc * 8;
        int32_t j0 = js * 8;
        if (j0 + 8 <= d) {
            for (int64_t q = 0; q < kc; q++) {
                __m256 x = skv_cpu_ld8(blk + (size_t)q * d + j0);
                _mm256_storeu_pd(dst + q * 8, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
                _mm256_storeu_pd(dst + q * 8 + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
            }
        } else {
            for (int64_t q = 0; q < kc; q++)
                for (int32_t j = 0; j < 8; j++)
                    dst[q * 8 + j] = j0 + j < d ? skv_bf16_to_f32(blk[(size_t)q * d + j0 + j]) : 0.0;
        }
    }
}

/*
 * G += A^T A (upper triangle, double, row-major d x d) with the 6x8 kernel,
 * A streamed in blocks of KC rows. Each 8-column strip of G is owned by one
 * work item per block and accumulated in block order, so the result does not
 * depend on the thread count; the accumulator is strip-major ([strip][row][8],
 * a tile's rows adjacent in memory) and is added into g at the end. Packing is
 * double-buffered: the items of block b are its strips (longest first) plus
 * slices packing block b+1 for threads that finish early, so there is one
 * barrier per block.
 */
static skv_status skv_cpu_gram(int64_t n, int32_t d, const skv_bf16 *a, double *g)
{
    int32_t na = (d + 5) / 6, nb = (d + 7) / 8;
    int64_t nblk = (n + SKV_CPU_KC - 1) / SKV_CPU_KC;
    size_t half = (size_t)na * SKV_CPU_XA_STRIDE(SKV_CPU_KC) + (size_t)nb * 8 * SKV_CPU_KC; /* one xa + xb */
    double *buf = skv_cpu_alloc(2 * half * sizeof *buf);
    double *gs = calloc((size_t)nb * 8 * d, sizeof *gs); /* [strip][row][8] */
    if (!buf || !gs) {
        free(buf);
        free(gs);
        return SKV_ERR_OUT_OF_MEMORY;
    }
#pragma omp parallel
    {
        int64_t kc0 = n < SKV_CPU_KC ? n : SKV_CPU_KC;
#pragma omp for schedule(static)
        for (int s = 0; s < SKV_CPU_PACK_SLICES; s++)
            skv_cpu_gram_pack(a, d, 0, kc0, s, SKV_CPU_PACK_SLICES, buf, buf + (size_t)na * SKV_CPU_XA_STRIDE(kc0));
        for (int64_t blk = 0; blk < nblk; blk++) {
            int64_t t0 = blk * SKV_CPU_KC, kc = n - t0 < SKV_CPU_KC ? n - t0 : SKV_CPU_KC;
            int64_t t1 = t0 + kc, kc1 = n - t1 < SKV_CPU_KC ? n - t1 : SKV_CPU_KC;
            double *xa = buf + (size_t)(blk & 1) * half, *xb = xa + (size_t)na * SKV_CPU_XA_STRIDE(kc);
            double *ya = buf + (size_t)(~blk & 1) * half, *yb = ya + (size_t)na * SKV_CPU_XA_STRIDE(kc1);
            int npack = blk + 1 < nblk ? SKV_CPU_PACK_SLICES : 0;
#pragma omp for schedule(dynamic, 1)
            for (int32_t it = 0; it < nb + npack; it++) {
                if (it >= nb) { /* pack a slice of the next block */
                    skv_cpu_gram_pack(a, d, t1, kc1, it - nb, SKV_CPU_PACK_SLICES, ya, yb);
                    continue;
                }
                int32_t js = nb - 1 - it, j0 = js * 8, nj = skv_cpu_min(8, d - j0);
                double *strip = gs + (size_t)js * d * 8;
                for (int32_t i0 = 0; i0 < j0 + nj; i0 += 6) { /* tiles touching the upper triangle */
                    double t[48];
                    skv_cpu_dkern(kc, xa + (size_t)(i0 / 6) * SKV_CPU_XA_STRIDE(kc), xb + (size_t)js * kc * 8, t);
                    for (int32_t i = 0; i < skv_cpu_min(6, d - i0); i++) {
                        double *gr = strip + (size_t)(i0 + i) * 8;
                        _mm256_storeu_pd(gr, _mm256_add_pd(_mm256_loadu_pd(gr), _mm256_loadu_pd(t + i * 8)));
                        _mm256_storeu_pd(gr + 4, _mm256_add_pd(_mm256_loadu_pd(gr + 4), _mm256_loadu_pd(t + i * 8 + 4)));
                    }
                }
            }
        }
        /* g += the accumulator: row i of the strips js >= i / 8 (the upper triangle) */
#pragma omp for schedule(static)
        for (int32_t i = 0; i < d; i++)
            for (int32_t js = i / 8; js < nb; js++) {
                int32_t j0 = js * 8, nj = skv_cpu_min(8, d - j0);
                const double *src = gs + ((size_t)js * d + i) * 8;
                for (int32_t j = 0; j < nj; j++) g[(size_t)i * d + j0 + j] += src[j];
            }
    }
    free(buf);
    free(gs);
    return SKV_OK;
}

/* u [n, r] = A V (double accumulate, rounded once), V packed as 8-column slivers vb. */
static void skv_cpu_project(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, const double *vb, float *u,
                            double *ap_all)
{
    int32_t nr = (r + 7) / 8;
#pragma omp parallel
    {
        double *ap = ap_all + (size_t)omp_get_thread_num() * 6 * d;
#pragma omp for schedule(static)
        for (int64_t t0 = 0; t0 < n; t0 += 6) {
            int32_t rows = (int32_t)(n - t0 < 6 ? n - t0 : 6);
            for (int32_t i = 0; i < 6; i++)
                for (int32_t k = 0; k < d; k++)
                    ap[(size_t)k * 6 + i] = i < rows ? skv_bf16_to_f32(a[(size_t)(t0 + i) * d + k]) : 0.0;
            for (int32_t js = 0; js < nr; js++) {
                double t[48];
                skv_cpu_dkern(d, ap, vb + (size_t)js * d * 8, t);
                for (int32_t i = 0; i < rows; i++)
                    for (int32_t j = 0; j < skv_cpu_min(8, r - js * 8); j++)
                        u[(size_t)(t0 + i) * r + js * 8 + j] = (float)t[i * 8 + j];
            }
        }
    }
}

/* ---- FAST route (lib/skv_factor.h): fp32 block Gram, subspace iteration, fp32 projection ---- */
/* (the EXACT route's double Gram skv_cpu_gram above is also its FALLBACK Gram) */

/* float 6x16 tile c[6 * 16] = sum_p ar[i][p] * b[p * 16 + j]: six rows of a row-major operand
   (contiguous in p) against a packed 16-column sliver. */
static void skv_cpu_skern_rows(int64_t k, const float *const ar[6], const float *b, float *c)
{
    const float *a0 = ar[0], *a1 = ar[1], *a2 = ar[2], *a3 = ar[3], *a4 = ar[4], *a5 = ar[5];
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, x;
    for (int64_t p = 0; p < k; p++, b += 16) {
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        x = _mm256_broadcast_ss(a0 + p);
        c00 = _mm256_fmadd_ps(x, b0, c00), c01 = _mm256_fmadd_ps(x, b1, c01);
        x = _mm256_broadcast_ss(a1 + p);
        c10 = _mm256_fmadd_ps(x, b0, c10), c11 = _mm256_fmadd_ps(x, b1, c11);
        x = _mm256_broadcast_ss(a2 + p);
        c20 = _mm256_fmadd_ps(x, b0, c20), c21 = _mm256_fmadd_ps(x, b1, c21);
        x = _mm256_broadcast_ss(a3 + p);
        c30 = _mm256_fmadd_ps(x, b0, c30), c31 = _mm256_fmadd_ps(x, b1, c31);
        x = _mm256_broadcast_ss(a4 + p);
        c40 = _mm256_fmadd_ps(x, b0, c40), c41 = _mm256_fmadd_ps(x, b1, c41);
        x = _mm256_broadcast_ss(a5 + p);
        c50 = _mm256_fmadd_ps(x, b0, c50), c51 = _mm256_fmadd_ps(x, b1, c51);
    }
    __m256 cc[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    for (int i = 0; i < 12; i++) _mm256_storeu_ps(c + 8 * i, cc[i]);
}

/* double 6x8 tile t[6 * 8] = sum_p ar[i][p] * b[p * 8 + j] (as skv_cpu_skern_rows). */
static void skv_cpu_dkern_rows(int64_t k, const double *const ar[6], const double *b, double *t)
{
    const double *a0 = ar[0], *a1 = ar[1], *a2 = ar[2], *a3 = ar[3], *a4 = ar[4], *a5 = ar[5];
    __m256d c00 = _mm256_setzero_pd(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256d c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, x;
    for (int64_t p = 0; p < k; p++, b += 8) {
        __m256d b0 = _mm256_loadu_pd(b), b1 = _mm256_loadu_pd(b + 4);
        x = _mm256_broadcast_sd(a0 + p);
        c00 = _mm256_fmadd_pd(x, b0, c00), c01 = _mm256_fmadd_pd(x, b1, c01);
        x = _mm256_broadcast_sd(a1 + p);
        c10 = _mm256_fmadd_pd(x, b0, c10), c11 = _mm256_fmadd_pd(x, b1, c11);
        x = _mm256_broadcast_sd(a2 + p);
        c20 = _mm256_fmadd_pd(x, b0, c20), c21 = _mm256_fmadd_pd(x, b1, c21);
        x = _mm256_broadcast_sd(a3 + p);
        c30 = _mm256_fmadd_pd(x, b0, c30), c31 = _mm256_fmadd_pd(x, b1, c31);
        x = _mm256_broadcast_sd(a4 + p);
        c40 = _mm256_fmadd_pd(x, b0, c40), c41 = _mm256_fmadd_pd(x, b1, c41);
        x = _mm256_broadcast_sd(a5 + p);
        c50 = _mm256_fmadd_pd(x, b0, c50), c51 = _mm256_fmadd_pd(x, b1, c51);
    }
    __m256d cc[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    for (int i = 0; i < 12; i++) _mm256_storeu_pd(t + 4 * i, cc[i]);
}

/*
 * The power-of-two scale of the fp32 products: A * 2^(128 - e), e the biased
 * exponent of max |a| (at least 1), puts max |a| in [2, 4). Scaling by a power
 * of two is exact, so it changes nothing but the range: no fp32 product or sum
 * overflows (|a| up to 3.4e38) and small inputs stay normal.
 */
static int skv_cpu_amax_exp(const skv_bf16 *a, int64_t count)
{
    const int64_t B = 1 << 16;
    int64_t nb = (count + B - 1) / B;
    unsigned m = 0;
#pragma omp parallel for schedule(static) reduction(max : m)
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * B, hi = lo + B < count ? lo + B : count, i = lo;
        __m256i v = _mm256_setzero_si256(), mask = _mm256_set1_epi16(0x7fff);
        for (; i + 16 <= hi; i += 16)
            v = _mm256_max_epu16(v, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(a + i)), mask));
        uint16_t lanes[16];
        _mm256_storeu_si256((__m256i *)lanes, v);
        unsigned mb = 0;
        for (int l = 0; l < 16; l++) mb = lanes[l] > mb ? lanes[l] : mb;
        for (; i < hi; i++) mb = (a[i] & 0x7fffu) > mb ? (a[i] & 0x7fffu) : mb;
        m = mb > m ? mb : m;
    }
    int e = (int)(m >> 7) & 0xff;
    return e < 1 ? 1 : e;
}

/*
 * Slice s of S of the packing of a kc-row block at row t0, scaled to float:
 * 6-column slivers xa [kc][6] (stride kc * 6 + 8: each row is stored as 8
 * floats, the 2 extra overwritten by the next row or left in the padding) and
 * 16-column slivers xb [kc][16], zero padded past d. The slice is a range of
 * slivers, so every thread writes sequentially and the rows it reads stay in L1.
 */
static void skv_cpu_fgram_pack(const skv_bf16 *a, int32_t d, int64_t t0, int64_t kc, int s, int S, float scale,
                               float *xa, float *xb)
{
    const int32_t na = (d + 5) / 6, nb = (d + 15) / 16;
    const __m256 sc = _mm256_set1_ps(scale);
    const skv_bf16 *blk = a + (size_t)t0 * d;
    for (int32_t is = na * s / S; is < na * (s + 1) / S; is++) {
        float *dst = xa + (size_t)is * SKV_CPU_XA_STRIDE(kc);
        int32_t i0 = is * 6;
        if (i0 + 8 <= d) {
            for (int64_t q = 0; q < kc; q++)
                _mm256_storeu_ps(dst + q * 6, _mm256_mul_ps(skv_cpu_ld8(blk + (size_t)q * d + i0), sc));
        } else {
            for (int64_t q = 0; q < kc; q++)
                for (int32_t i = 0; i < 6; i++)
                    dst[q * 6 + i] = i0 + i < d ? skv_bf16_to_f32(blk[(size_t)q * d + i0 + i]) * scale : 0.0f;
        }
    }
    for (int32_t js = nb * s / S; js < nb * (s + 1) / S; js++) {
        float *dst = xb + (size_t)js * kc * 16;
        int32_t j0 = js * 16;
        if (j0 + 16 <= d) {
            for (int64_t q = 0; q < kc; q++) {
                const skv_bf16 *row = blk + (size_t)q * d + j0;
                _mm256_storeu_ps(dst + q * 16, _mm256_mul_ps(skv_cpu_ld8(row), sc));
                _mm256_storeu_ps(dst + q * 16 + 8, _mm256_mul_ps(skv_cpu_ld8(row + 8), sc));
            }
        } else {
            for (int64_t q = 0; q < kc; q++)
                for (int32_t j = 0; j < 16; j++)
                    dst[q * 16 + j] = j0 + j < d ? skv_bf16_to_f32(blk[(size_t)q * d + j0 + j]) * scale : 0.0f;
        }
    }
}

/*
 * g [d, d] (row-major, full) = (scale A)^T (scale A) as a sum of fp32 block
 * Grams of SKV_CPU_FKC rows: each 6x16 tile of a block is one fp32 kernel call
 * (bf16 products are exact in fp32; the fp32 sum runs over one block), added
 * into a double accumulator in block order. The accumulator is strip-major
 * (16-column strips of the upper triangle, rows contiguous), so a tile's rows
 * are adjacent in memory; each strip is owned by one work item per block, so
 * the result does not depend on the thread count. Packing is double-buffered
 * as in skv_cpu_gram. Finally g = the accumulator, both triangles.
 */
#define SKV_CPU_FKC 256 /* rows of one fp32 block Gram */

static skv_status skv_cpu_fgram(int64_t n, int32_t d, const skv_bf16 *a, float scale, double *g)
{
    int32_t na = (d + 5) / 6, nb = (d + 15) / 16;
    int64_t nblk = (n + SKV_CPU_FKC - 1) / SKV_CPU_FKC;
    size_t half = (size_t)na * SKV_CPU_XA_STRIDE(SKV_CPU_FKC) + (size_t)nb * 16 * SKV_CPU_FKC; /* one xa + xb */
    float *buf = skv_cpu_alloc(2 * half * sizeof *buf);
    double *gs = calloc((size_t)nb * 16 * d, sizeof *gs); /* [strip][row][16] */
    if (!buf || !gs) {
        free(buf);
        free(gs);
        return SKV_ERR_OUT_OF_MEMORY;
    }
#pragma omp parallel
    {
        int64_t kc0 = n < SKV_CPU_FKC ? n : SKV_CPU_FKC;
#pragma omp for schedule(static)
        for (int s = 0; s < SKV_CPU_PACK_SLICES; s++)
            skv_cpu_fgram_pack(a, d, 0, kc0, s, SKV_CPU_PACK_SLICES, scale, buf,
                               buf + (size_t)na * SKV_CPU_XA_STRIDE(kc0));
        for (int64_t blk = 0; blk < nblk; blk++) {
            int64_t t0 = blk * SKV_CPU_FKC, kc = n - t0 < SKV_CPU_FKC ? n - t0 : SKV_CPU_FKC;
            int64_t t1 = t0 + kc, kc1 = n - t1 < SKV_CPU_FKC ? n - t1 : SKV_CPU_FKC;
            float *xa = buf + (size_t)(blk & 1) * half, *xb = xa + (size_t)na * SKV_CPU_XA_STRIDE(kc);
            float *ya = buf + (size_t)(~blk & 1) * half, *yb = ya + (size_t)na * SKV_CPU_XA_STRIDE(kc1);
            int npack = blk + 1 < nblk ? SKV_CPU_PACK_SLICES : 0;
#pragma omp for schedule(dynamic, 1)
            for (int32_t it = 0; it < nb + npack; it++) {
                if (it >= nb) { /* pack a slice of the next block */
                    skv_cpu_fgram_pack(a, d, t1, kc1, it - nb, SKV_CPU_PACK_SLICES, scale, ya, yb);
                    continue;
                }
                int32_t js = nb - 1 - it, j0 = js * 16, nj = skv_cpu_min(16, d - j0);
                double *strip = gs + (size_t)js * d * 16;
                for (int32_t i0 = 0; i0 < j0 + nj; i0 += 6) { /* tiles touching the upper triangle */
                    float t[96];
                    int32_t ni = skv_cpu_min(6, d - i0);
                    skv_cpu_skern((int)kc, xa + (size_t)(i0 / 6) * SKV_CPU_XA_STRIDE(kc), xb + (size_t)js * kc * 16, t, 16);
                    for (int32_t i = 0; i < ni; i++) {
                        double *gr = strip + (size_t)(i0 + i) * 16;
                        for (int q = 0; q < 4; q++)
                            _mm256_storeu_pd(gr + 4 * q, _mm256_add_pd(_mm256_loadu_pd(gr + 4 * q),
                                                                       _mm256_cvtps_pd(_mm_loadu_ps(t + i * 16 + 4 * q))));
                    }
                }
            }
        }
        /* g: 16 x 16 blocks (ib <= jb) of the upper triangle and their mirror images */
#pragma omp for schedule(dynamic, 4)
        for (int32_t bb = 0; bb < nb * nb; bb++) {
            int32_t ib = bb / nb, jb = bb % nb;
            if (ib > jb) continue;
            for (int32_t i = ib * 16; i < skv_cpu_min(ib * 16 + 16, d); i++)
                for (int32_t j = jb * 16; j < skv_cpu_min(jb * 16 + 16, d); j++) {
                    double x = j >= i ? gs[((size_t)jb * d + i) * 16 + j % 16] : gs[((size_t)ib * d + j) * 16 + i % 16];
                    g[(size_t)i * d + j] = x;
                    g[(size_t)j * d + i] = x;
                }
        }
    }
    free(buf);
    free(gs);
    return SKV_OK;
}

/* Upper triangle -> lower (row-major symmetric d x d). */
static void skv_cpu_mirror(double *g, int32_t d)
{
#pragma omp parallel for schedule(dynamic, 1)
    for (int32_t i0 = 0; i0 < d; i0 += 16) {
        int32_t i1 = skv_cpu_min(i0 + 16, d);
        for (int32_t j = 0; j < i1; j++)
            for (int32_t i = i0 > j + 1 ? i0 : j + 1; i < i1; i++) g[(size_t)i * d + j] = g[(size_t)j * d + i];
    }
}

/* State of one FAST factorization: X^T is kept as z [r, d] (rows = basis vectors), so every product
   runs over contiguous rows of d. */
typedef struct {
    int32_t d, r;
    double *g;   /* [d, d] the Gram matrix (symmetric, full) */
    float *gf;   /* [ceil(d/16)][d][16] G in float, packed (the fp32 G X) */
    double *gd;  /* [ceil(d/8)][d][8] G in double, packed (G X in double) */
    double *z;   /* [r, d] X^T */
    float *zf;   /* [r, d] X^T in float */
    double *y;   /* [r, d] (G X)^T, then the next z in place */
    double *yp;  /* [ceil(r/8)][d][8] the right operand of an r x r product, packed */
    double *c;   /* [r, r] an r x r Gram (Y^T Y or X^T G X), then its Cholesky factor R (upper) */
    double *ci;  /* [r, r] R^-1 (the check) */
    double *ct;  /* [r, r] R^T (the solve) */
    double *sb;  /* [nt][r][SKV_CPU_SOLVE_W] the solve's per-thread buffers */
    int nt;      /* threads of the parallel regions that use per-thread buffers */
    double *dsc; /* column scales of an equilibrated pass, or NULL */
} skv_cpu_fx;

/* y = (G X)^T = z G: fp32 (zf against gf) or double (z against gd). */
static void skv_cpu_fx_apply(skv_cpu_fx *f, int dbl)
{
    const int32_t d = f->d, r = f->r, ng = (r + 5) / 6, ns = dbl ? (d + 7) / 8 : (d + 15) / 16;
#pragma omp parallel for schedule(dynamic, 1)
    for (int32_t is = 0; is < ns; is++)
        for (int32_t ig = 0; ig < ng; ig++) {
            int32_t j0 = ig * 6, nj = skv_cpu_min(6, r - j0);
            if (dbl) {
                const double *ar[6];
                double t[48];
                int32_t i0 = is * 8, ni = skv_cpu_min(8, d - i0);
                for (int j = 0; j < 6; j++) ar[j] = f->z + (size_t)(j0 + skv_cpu_min(j, nj - 1)) * d;
                skv_cpu_dkern_rows(d, ar, f->gd + (size_t)is * d * 8, t);
                for (int32_t j = 0; j < nj; j++)
                    for (int32_t i = 0; i < ni; i++) f->y[(size_t)(j0 + j) * d + i0 + i] = t[j * 8 + i];
            } else {
                const float *ar[6];
                float t[96];
                int32_t i0 = is * 16, ni = skv_cpu_min(16, d - i0);
                for (int j = 0; j < 6; j++) ar[j] = f->zf + (size_t)(j0 + skv_cpu_min(j, nj - 1)) * d;
                skv_cpu_skern_rows(d, ar, f->gf + (size_t)is * d * 16, t);
                for (int32_t j = 0; j < nj; j++)
                    for (int32_t i = 0; i < ni; i++) f->y[(size_t)(j0 + j) * d + i0 + i] = t[j * 16 + i];
            }
        }
}

/*
 * Small dense kernels of the FAST route, serial and without BLAS (between
 * OpenMP regions; OpenBLAS would start its own threads for r = 160).
 * skv_cpu_chol: c (row-major, the upper triangle of a symmetric r x r matrix)
 * <- R (upper) with C = R^T R, right-looking, every pivot at least `floor`
 * (lib/skv_factor.h: SKV_FACTOR_PIVOT_FLOOR tr C), so it never fails.
 * skv_cpu_trinv: ri <- R^-1 (upper), row by row from the bottom.
 */
static void skv_cpu_chol(double *c, int32_t r, double floor)
{
    for (int32_t k = 0; k < r; k++) {
        double *ck = c + (size_t)k * r, p = ck[k];
        p = sqrt(p >= floor ? p : floor); /* pivots raised to the floor (NaN too): R always exists */
        ck[k] = p;
        for (int32_t j = k + 1; j < r; j++) ck[j] /= p;
        for (int32_t i = k + 1; i < r; i++) {
            double *ci = c + (size_t)i * r;
            __m256d f = _mm256_set1_pd(ck[i]);
            int32_t j = i;
            for (; j + 4 <= r; j += 4)
                _mm256_storeu_pd(ci + j, _mm256_fnmadd_pd(f, _mm256_loadu_pd(ck + j), _mm256_loadu_pd(ci + j)));
            for (; j < r; j++) ci[j] = fma(-ck[i], ck[j], ci[j]);
        }
    }
}

static void skv_cpu_trinv(const double *c, int32_t r, double *ri)
{
    memset(ri, 0, (size_t)r * r * sizeof *ri);
    for (int32_t i = r - 1; i >= 0; i--) {
        double *ti = ri + (size_t)i * r;
        const double *ci = c + (size_t)i * r;
        ti[i] = 1.0;
        for (int32_t m = i + 1; m < r; m++) { /* ti -= R[i][m] Rinv[m][:] (row m is zero before m) */
            const double *tm = ri + (size_t)m * r;
            __m256d f = _mm256_set1_pd(ci[m]);
            int32_t j = m;
            for (; j + 4 <= r; j += 4)
                _mm256_storeu_pd(ti + j, _mm256_fnmadd_pd(f, _mm256_loadu_pd(tm + j), _mm256_loadu_pd(ti + j)));
            for (; j < r; j++) ti[j] = fma(-ci[m], tm[j], ti[j]);
        }
        for (int32_t j = i; j < r; j++) ti[j] /= ci[i];
    }
}

/*
 * c (upper triangle, row-major r x r) = u v^T for u, v [r, d] in double, i.e.
 * U^T V for the d x r matrices U = u^T, V = v^T; then the shift s of its
 * trace (lib/skv_factor.h: skv_factor_shift for Cholesky QR, else
 * skv_factor_rq_shift for H = X^T G X at the check), c += s I,
 * and its Cholesky factor in place: c = R (row-major upper), C + s I = R^T R.
 */
enum { SKV_CPU_SHIFT_QR, SKV_CPU_SHIFT_RQ };

static void skv_cpu_fx_chol(skv_cpu_fx *f, const double *uu, const double *vv, double diag, int shift)
{
    const int32_t d = f->d, r = f->r, ng = (r + 5) / 6, n8 = (r + 7) / 8;
    double *c = f->c, *yp = f->yp;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int32_t js = 0; js < n8; js++)
            for (int32_t jj = 0; jj < 8; jj++) {
                int32_t j = js * 8 + jj;
                double *dst = yp + (size_t)js * d * 8 + jj;
                if (j < r)
                    for (int32_t p = 0; p < d; p++) dst[(size_t)p * 8] = vv[(size_t)j * d + p];
                else
                    for (int32_t p = 0; p < d; p++) dst[(size_t)p * 8] = 0.0;
            }
#pragma omp for schedule(dynamic, 1)
        for (int32_t it = 0; it < ng * n8; it++) {
            int32_t i0 = it / n8 * 6, j0 = it % n8 * 8, ni = skv_cpu_min(6, r - i0), nj = skv_cpu_min(8, r - j0);
            if (j0 + nj <= i0) continue; /* strictly below the diagonal */
            const double *ar[6];
            double t[48];
            for (int i = 0; i < 6; i++) ar[i] = uu + (size_t)(i0 + skv_cpu_min(i, ni - 1)) * d;
            skv_cpu_dkern_rows(d, ar, yp + (size_t)(j0 / 8) * d * 8, t);
            for (int32_t i = 0; i < ni; i++)
                for (int32_t j = 0; j < nj; j++) c[(size_t)(i0 + i) * r + j0 + j] = t[i * 8 + j];
        }
    }
    double tr = 0.0;
    if (f->dsc) { /* column equilibration: C <- D C D, D = diag(C)^-1/2 */
        for (int32_t i = 0; i < r; i++) {
            double cii = c[(size_t)i * r + i];
            f->dsc[i] = cii > 0.0 ? 1.0 / sqrt(cii) : 1.0;
        }
        for (int32_t i = 0; i < r; i++)
            for (int32_t j = i; j < r; j++) c[(size_t)i * r + j] *= f->dsc[i] * f->dsc[j];
    }
    for (int32_t i = 0; i < r; i++) tr += c[(size_t)i * r + i] += diag;
    double s = shift == SKV_CPU_SHIFT_QR ? skv_factor_shift(d, r, tr)
                                         : skv_factor_rq_shift(tr);
    for (int32_t i = 0; i < r; i++) c[(size_t)i * r + i] += s;
    skv_cpu_chol(c, r, SKV_FACTOR_PIVOT_FLOOR * (tr + r * s));
}

/*
 * v [r, d] <- R^-T v in place (X <- X R^-1 for X = v^T), R = f->c (upper, from
 * skv_cpu_fx_chol), and f->zf = v in float: forward substitution
 * v_k <- (v_k - sum_{m<k} R[m][k] v_m) / R[k][k], every sum in the order of m.
 * Columns are independent: chunks of SKV_CPU_SOLVE_W columns in parallel, each
 * copied into a contiguous per-thread buffer [r][W], two rows k at a time.
 */
#define SKV_CPU_SOLVE_W 16

static void skv_cpu_fx_solve(skv_cpu_fx *f, double *v)
{
    const int32_t d = f->d, r = f->r, nch = (d + SKV_CPU_SOLVE_W - 1) / SKV_CPU_SOLVE_W;
    double *ct = f->ct;
    for (int32_t k = 0; k < r; k++) /* ct [k][m] = R[m][k], m <= k: row k of R^T, contiguous */
        for (int32_t m = 0; m <= k; m++) ct[(size_t)k * r + m] = f->c[(size_t)m * r + k];
#pragma omp parallel num_threads(f->nt)
    {
        double *buf = f->sb + (size_t)omp_get_thread_num() * r * SKV_CPU_SOLVE_W;
#pragma omp for schedule(static)
        for (int32_t ch = 0; ch < nch; ch++) {
            int32_t i0 = ch * SKV_CPU_SOLVE_W, w = skv_cpu_min(SKV_CPU_SOLVE_W, d - i0);
            for (int32_t k = 0; k < r; k++)
                for (int32_t i = 0; i < SKV_CPU_SOLVE_W; i++)
                    buf[(size_t)k * SKV_CPU_SOLVE_W + i] = i < w ? v[(size_t)k * d + i0 + i] : 0.0;
            for (int32_t k = 0; k < r; k += 2) {
                const double *c0 = ct + (size_t)k * r, *c1 = c0 + r;
                double *b0 = buf + (size_t)k * SKV_CPU_SOLVE_W, *b1 = b0 + SKV_CPU_SOLVE_W;
                __m256d a0 = _mm256_loadu_pd(b0), a1 = _mm256_loadu_pd(b0 + 4);
                __m256d a2 = _mm256_loadu_pd(b0 + 8), a3 = _mm256_loadu_pd(b0 + 12);
                if (k + 1 < r) {
                    __m256d e0 = _mm256_loadu_pd(b1), e1 = _mm256_loadu_pd(b1 + 4);
                    __m256d e2 = _mm256_loadu_pd(b1 + 8), e3 = _mm256_loadu_pd(b1 + 12);
                    for (int32_t m = 0; m < k; m++) {
                        const double *bm = buf + (size_t)m * SKV_CPU_SOLVE_W;
                        __m256d x0 = _mm256_loadu_pd(bm), x1 = _mm256_loadu_pd(bm + 4);
                        __m256d x2 = _mm256_loadu_pd(bm + 8), x3 = _mm256_loadu_pd(bm + 12);
                        __m256d r0 = _mm256_broadcast_sd(c0 + m), r1 = _mm256_broadcast_sd(c1 + m);
                        a0 = _mm256_fnmadd_pd(r0, x0, a0), a1 = _mm256_fnmadd_pd(r0, x1, a1);
                        a2 = _mm256_fnmadd_pd(r0, x2, a2), a3 = _mm256_fnmadd_pd(r0, x3, a3);
                        e0 = _mm256_fnmadd_pd(r1, x0, e0), e1 = _mm256_fnmadd_pd(r1, x1, e1);
                        e2 = _mm256_fnmadd_pd(r1, x2, e2), e3 = _mm256_fnmadd_pd(r1, x3, e3);
                    }
                    __m256d rk = _mm256_broadcast_sd(c0 + k);
                    a0 = _mm256_div_pd(a0, rk), a1 = _mm256_div_pd(a1, rk);
                    a2 = _mm256_div_pd(a2, rk), a3 = _mm256_div_pd(a3, rk);
                    __m256d r1 = _mm256_broadcast_sd(c1 + k), rk1 = _mm256_broadcast_sd(c1 + k + 1);
                    e0 = _mm256_div_pd(_mm256_fnmadd_pd(r1, a0, e0), rk1);
                    e1 = _mm256_div_pd(_mm256_fnmadd_pd(r1, a1, e1), rk1);
                    e2 = _mm256_div_pd(_mm256_fnmadd_pd(r1, a2, e2), rk1);
                    e3 = _mm256_div_pd(_mm256_fnmadd_pd(r1, a3, e3), rk1);
                    _mm256_storeu_pd(b1, e0), _mm256_storeu_pd(b1 + 4, e1);
                    _mm256_storeu_pd(b1 + 8, e2), _mm256_storeu_pd(b1 + 12, e3);
                } else {
                    for (int32_t m = 0; m < k; m++) {
                        const double *bm = buf + (size_t)m * SKV_CPU_SOLVE_W;
                        __m256d r0 = _mm256_broadcast_sd(c0 + m);
                        a0 = _mm256_fnmadd_pd(r0, _mm256_loadu_pd(bm), a0);
                        a1 = _mm256_fnmadd_pd(r0, _mm256_loadu_pd(bm + 4), a1);
                        a2 = _mm256_fnmadd_pd(r0, _mm256_loadu_pd(bm + 8), a2);
                        a3 = _mm256_fnmadd_pd(r0, _mm256_loadu_pd(bm + 12), a3);
                    }
                    __m256d rk = _mm256_broadcast_sd(c0 + k);
                    a0 = _mm256_div_pd(a0, rk), a1 = _mm256_div_pd(a1, rk);
                    a2 = _mm256_div_pd(a2, rk), a3 = _mm256_div_pd(a3, rk);
                }
                _mm256_storeu_pd(b0, a0), _mm256_storeu_pd(b0 + 4, a1);
                _mm256_storeu_pd(b0 + 8, a2), _mm256_storeu_pd(b0 + 12, a3);
            }
            for (int32_t k = 0; k < r; k++) {
                const double *bk = buf + (size_t)k * SKV_CPU_SOLVE_W;
                double *vk = v + (size_t)k * d + i0;
                float *zk = f->zf + (size_t)k * d + i0;
                if (w == SKV_CPU_SOLVE_W) {
                    for (int q = 0; q < 4; q++) {
                        __m256d x = _mm256_loadu_pd(bk + 4 * q);
                        _mm256_storeu_pd(vk + 4 * q, x);
                        _mm_storeu_ps(zk + 4 * q, _mm256_cvtpd_ps(x));
                    }
                } else {
                    for (int32_t i = 0; i < w; i++) vk[i] = bk[i], zk[i] = (float)bk[i];
                }
            }
        }
    }
}

/* v [r, d] <- orth(v^T)^T in place (shifted Cholesky QR, lib/skv_factor.h), f->zf = v in float. */
static void skv_cpu_fx_orth(skv_cpu_fx *f, double *v)
{
    skv_cpu_fx_chol(f, v, v, 0.0, SKV_CPU_SHIFT_QR);
    skv_cpu_fx_solve(f, v);
}

/* v [r, d] <- orth_e(v^T)^T in place (lib/skv_factor.h: one equilibrated pass, v^T D R^-1). */
static void skv_cpu_fx_orth_scaled(skv_cpu_fx *f, double *v, double *dsc)
{
    f->dsc = dsc;
    skv_cpu_fx_chol(f, v, v, 0.0, SKV_CPU_SHIFT_QR);
    f->dsc = NULL;
    for (int32_t k = 0; k < f->r; k++)
        for (int32_t i = 0; i < f->d; i++) v[(size_t)k * f->d + i] *= dsc[k];
    skv_cpu_fx_solve(f, v);
}

/* One iteration: z <- orth(orth(G X))^T, or orth_e(G X)^T when single (reuse: y = (G X)^T
   already, from the check). */
static void skv_cpu_fx_step(skv_cpu_fx *f, int dbl, int reuse, int single)
{
    if (!reuse) skv_cpu_fx_apply(f, dbl);
    if (single) {
        double dsc[SKV_FACTOR_FAST_MAX_R];
        skv_cpu_fx_orth_scaled(f, f->y, dsc);
    } else {
        skv_cpu_fx_orth(f, f->y);
        skv_cpu_fx_orth(f, f->y);
    }
    double *t = f->z;
    f->z = f->y, f->y = t;
}

/* gf (dbl = 0) or gd (dbl = 1) from the full double G. */
static void skv_cpu_fx_pack_g(skv_cpu_fx *f, int dbl)
{
    const int32_t d = f->d, w = dbl ? 8 : 16, ns = (d + w - 1) / w;
#pragma omp parallel for schedule(static)
    for (int32_t p = 0; p < d; p++)
        for (int32_t is = 0; is < ns; is++)
            for (int32_t j = 0; j < w; j++) {
                int32_t i = is * w + j;
                double x = i < d ? f->g[(size_t)p * d + i] : 0.0;
                if (dbl) f->gd[((size_t)is * d + p) * 8 + j] = x;
                else f->gf[((size_t)is * d + p) * 16 + j] = (float)x;
            }
}

#define SKV_CPU_URB 48 /* projection: rows per work item, 8 slivers of 6 */

/* u [n, r] = A Q in float: A rows scaled by `scale` (the fp32 Gram's power of two) and the result by
   `unscale`, Q^T = zf [r, d]; parallel over blocks of rows. */
static skv_status skv_cpu_fx_project(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, const float *zf,
                                     float scale, float unscale, float *u)
{
    const int32_t n16 = (r + 15) / 16;
    const int nt = omp_get_max_threads();
    const int64_t nrb = (n + SKV_CPU_URB - 1) / SKV_CPU_URB;
    float *qb = skv_cpu_alloc((size_t)n16 * d * 16 * sizeof *qb);
    float *abuf = skv_cpu_alloc((size_t)nt * SKV_CPU_URB * d * sizeof *abuf);
    if (!qb || !abuf) {
        free(qb);
        free(abuf);
        return SKV_ERR_OUT_OF_MEMORY;
    }
#pragma omp parallel num_threads(nt)
    {
        float *ab = abuf + (size_t)omp_get_thread_num() * SKV_CPU_URB * d;
        const __m256 sc = _mm256_set1_ps(scale), us = _mm256_set1_ps(unscale);
#pragma omp for schedule(static)
        for (int32_t js = 0; js < n16; js++)
            for (int32_t jj = 0; jj < 16; jj++) {
                int32_t j = js * 16 + jj;
                float *dst = qb + (size_t)js * d * 16 + jj;
                for (int32_t p = 0; p < d; p++) dst[(size_t)p * 16] = j < r ? zf[(size_t)j * d + p] : 0.0f;
            }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < nrb; b++) {
            int64_t t0 = b * SKV_CPU_URB;
            int32_t rows = (int32_t)(n - t0 < SKV_CPU_URB ? n - t0 : SKV_CPU_URB);
            for (int32_t i = 0; i < rows; i++) {
                const skv_bf16 *src = a + (size_t)(t0 + i) * d;
                float *dst = ab + (size_t)i * d;
                int32_t p = 0;
                for (; p + 8 <= d; p += 8) _mm256_storeu_ps(dst + p, _mm256_mul_ps(skv_cpu_ld8(src + p), sc));
                for (; p < d; p++) dst[p] = skv_bf16_to_f32(src[p]) * scale;
            }
            for (int32_t js = 0; js < n16; js++) {
                int32_t j0 = js * 16, nj = skv_cpu_min(16, r - j0);
                for (int32_t i0 = 0; i0 < rows; i0 += 6) {
                    int32_t ni = skv_cpu_min(6, rows - i0);
                    const float *ar[6];
                    float t[96];
                    for (int i = 0; i < 6; i++) ar[i] = ab + (size_t)(i0 + skv_cpu_min(i, ni - 1)) * d;
                    skv_cpu_skern_rows(d, ar, qb + (size_t)js * d * 16, t);
                    for (int32_t i = 0; i < ni; i++) {
                        float *ur = u + (size_t)(t0 + i0 + i) * r + j0;
                        if (nj == 16) {
                            _mm256_storeu_ps(ur, _mm256_mul_ps(_mm256_loadu_ps(t + i * 16), us));
                            _mm256_storeu_ps(ur + 8, _mm256_mul_ps(_mm256_loadu_ps(t + i * 16 + 8), us));
                        } else {
                            for (int32_t j = 0; j < nj; j++) ur[j] = t[i * 16 + j] * unscale;
                        }
                    }
                }
            }
        }
    }
    free(qb);
    free(abuf);
    return SKV_OK;
}

/*
 * The FAST route of lib/skv_factor.h (n >= d, 2r <= d, r <= SKV_FACTOR_FAST_MAX_R),
 * with X^T kept as z:
 *  1. G: fp32 block Grams of (2^k A) summed in double (skv_cpu_fgram); the
 *     power of two only keeps fp32 in range (skv_cpu_amax_exp).
 *  2. z = X_0^T = skv_factor_start.
 *  3. SKV_FACTOR_ITERS times X <- orth(orth(G X)) (after iteration
 *     SKV_FACTOR_TWO_PASS_ITERS: X <- orth_e(G X), one equilibrated pass): G X
 *     in fp32 (G rounded to float once, X per product, fp32 sums over d), each
 *     orth a shifted Cholesky QR in double (pivots floored at
 *     SKV_FACTOR_PIVOT_FLOOR tr C).
 *     NOTE, two departures from the header, both measured on the bench's
 *     realistic keys (lambda_r / lambda_1 ~ 5e-7, a flat noise floor around r):
 *     - the header's Rayleigh-quotient step X <- G X (X^T G X + s_H I)^-1 with
 *       s_H = 2^-18 tr H on the fp32 Gram damps every direction below s_H in
 *       each step (err / opt - 1 = 2.4e-2), and a single plain Cholesky QR per
 *       step compounds the same damping (7.9e-2). Two passes keep X orthonormal
 *       to rounding; span(X) is that of subspace iteration either way; 2.5e-3.
 *       One equilibrated pass (orth_e) per step after the first three does not
 *       damp (2.5e-3 again; the header says why).
 *     - G + SKV_FACTOR_GRAM_SHIFT32 tr(G) I is only needed for a Cholesky of
 *       X^T G X, and it slows the iteration over the noise floor (4.3e-3).
 *       Cholesky QR factors Y^T Y, definite whatever G, so the iteration runs
 *       on G and the shift enters the check only, where X is orthonormal and
 *       X^T (G + delta I) X = X^T G X + delta I: the same rho.
 *  4. After iteration SKV_FACTOR_CHECK_AT (X orthonormal): Y = G X (kept for the
 *     next step), and in AUTO mode H = X^T G X + delta I + s_H I = R^T R with
 *     the double-Gram Rayleigh shift (as cuda computed it), rho = 1 / (|R|_F^2
 *     |R^-1|_F^2) (0 if not finite: pivots floored because the fp32 G left H
 *     indefinite); rho < SKV_FACTOR_TAU or FALLBACK mode: G <- the double Gram
 *     (skv_cpu_gram), G X in double from then on.
 *  5. Q = orth(orth(X)); W = Q^T; U = A Q in fp32 (skv_cpu_fx_project).
 * Every phase is blocked with fixed tiles and merge orders: the result does
 * not depend on the thread count. No BLAS: nothing here starts OpenBLAS threads.
 */
static skv_status skv_cpu_factorize_fast(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u, float *w,
                                         skv_factor_mode mode)
{
    skv_status st = SKV_OK;
    skv_cpu_fx f = {d, r, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, omp_get_max_threads(), NULL};
    const size_t rd = (size_t)r * d;
    f.g = skv_cpu_alloc((size_t)d * d * sizeof *f.g);
    f.gf = skv_cpu_alloc((size_t)((d + 15) / 16) * 16 * d * sizeof *f.gf);
    f.z = skv_cpu_alloc(rd * sizeof *f.z);
    f.zf = skv_cpu_alloc(rd * sizeof *f.zf);
    f.y = skv_cpu_alloc(rd * sizeof *f.y);
    f.yp = skv_cpu_alloc((size_t)((r + 7) / 8) * 8 * d * sizeof *f.yp);
    f.c = skv_cpu_alloc((size_t)r * r * sizeof *f.c);
    f.ci = skv_cpu_alloc((size_t)r * r * sizeof *f.ci);
    f.ct = skv_cpu_alloc((size_t)r * r * sizeof *f.ct);
    f.sb = skv_cpu_alloc((size_t)f.nt * r * SKV_CPU_SOLVE_W * sizeof *f.sb);
    if (!f.g || !f.gf || !f.z || !f.zf || !f.y || !f.yp || !f.c || !f.ci || !f.ct || !f.sb) st = SKV_ERR_OUT_OF_MEMORY;
    int e = 0, dbl = 0, reuse = 0;
    if (!st) {
        e = skv_cpu_amax_exp(a, n * d);
        st = skv_cpu_fgram(n, d, a, ldexpf(1.0f, 128 - e), f.g);
    }
    double delta = 0.0; /* SKV_FACTOR_GRAM_SHIFT32 tr(G), applied at the check (see above) */
    if (!st) {
        for (int32_t i = 0; i < d; i++) delta += f.g[(size_t)i * d + i];
        delta *= SKV_FACTOR_GRAM_SHIFT32;
        skv_cpu_fx_pack_g(&f, 0);
#pragma omp parallel for schedule(static)
        for (int32_t j = 0; j < r; j++) /* z = X_0^T */
            for (int32_t i = 0; i < d; i++) {
                double x = skv_factor_start(i, j, r);
                f.z[(size_t)j * d + i] = x;
                f.zf[(size_t)j * d + i] = (float)x;
            }
    }
    for (int it = 1; !st && it <= SKV_FACTOR_ITERS; it++) {
        skv_cpu_fx_step(&f, dbl, reuse, it > SKV_FACTOR_TWO_PASS_ITERS);
        reuse = 0;
        if (it != SKV_FACTOR_CHECK_AT) continue;
        /* the check (step 4; X is orthonormal after a two-pass iteration): y = (G X)^T (the next
           step's), and in AUTO mode H = X^T (G + delta I) X + s_H I = R^T R (X^T G X + delta I),
           s_H the double-Gram Rayleigh shift, pivots floored; rho = 1 / (|R|_F^2 |R^-1|_F^2) */
        if (mode != SKV_FACTOR_FALLBACK) skv_cpu_fx_apply(&f, dbl);
        double rho = 0.0;
        if (mode == SKV_FACTOR_AUTO) {
            skv_cpu_fx_chol(&f, f.z, f.y, delta, SKV_CPU_SHIFT_RQ);
            skv_cpu_trinv(f.c, r, f.ci);
            double fr = 0.0, fi = 0.0;
            for (int32_t i = 0; i < r; i++)
                for (int32_t j = i; j < r; j++) {
                    fr += f.c[(size_t)i * r + j] * f.c[(size_t)i * r + j];
                    fi += f.ci[(size_t)i * r + j] * f.ci[(size_t)i * r + j];
                }
            double q = fr * fi; /* not finite when G's rounding left H indefinite: the fallback */
            rho = q > 0.0 && q < INFINITY ? 1.0 / q : 0.0;
        }
        if (mode == SKV_FACTOR_FALLBACK || (mode == SKV_FACTOR_AUTO && !(rho >= SKV_FACTOR_TAU))) {
            f.gd = skv_cpu_alloc((size_t)((d + 7) / 8) * 8 * d * sizeof *f.gd);
            if (!f.gd) {
                st = SKV_ERR_OUT_OF_MEMORY;
                break;
            }
            memset(f.g, 0, (size_t)d * d * sizeof *f.g);
            if ((st = skv_cpu_gram(n, d, a, f.g))) break;
            skv_cpu_mirror(f.g, d);
            skv_cpu_fx_pack_g(&f, 1);
            dbl = 1;
        } else {
            reuse = 1; /* y = (G X)^T for the next step */
        }
    }
    if (!st) {
        skv_cpu_fx_orth(&f, f.z);
        skv_cpu_fx_orth(&f, f.z);
    }
    if (!st) st = skv_cpu_fx_project(n, d, r, a, f.zf, ldexpf(1.0f, 128 - e), ldexpf(1.0f, e - 128), u);
    if (!st) memcpy(w, f.zf, rd * sizeof *w);
    free(f.g);
    free(f.gf);
    free(f.gd);
    free(f.z);
    free(f.zf);
    free(f.y);
    free(f.yp);
    free(f.c);
    free(f.ci);
    free(f.ct);
    free(f.sb);
    return st;
}
#endif

/*
 * Same math as ref (Gram matrix in double, LAPACK dsyevr, U = A V_r in double),
 * parallel and blocked; A is streamed, so memory stays O(d^2 + block), not
 * O(n d) doubles. n < d: the smaller Gram A A^T gives U = top eigenvectors,
 * W = U^T A (BLAS; prompts are longer than Hk*D in practice).
 */
static skv_status skv_cpu_factorize_exact(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u,
                                          float *w)
{
    skv_status st = SKV_OK;
    if (n < d) {
        int32_t m = (int32_t)n;
        double *ad = malloc((size_t)n * d * sizeof *ad), *g = calloc((size_t)m * m, sizeof *g);
        double *v = malloc((size_t)m * r * sizeof *v), *wd = malloc((size_t)r * d * sizeof *wd);
        if (!ad || !g || !v || !wd) st = SKV_ERR_OUT_OF_MEMORY;
        if (!st) {
            skv_cpu_rows_f64(a, n, d, ad);
            cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, m, d, 1.0, ad, d, 0.0, g, m);
            st = skv_cpu_top_eigvecs(g, m, r, v);
        }
        if (!st) {
            cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r, d, m, 1.0, v, r, ad, d, 0.0, wd, d);
            for (size_t i = 0; i < (size_t)m * r; i++) u[i] = (float)v[i];
            for (size_t i = 0; i < (size_t)r * d; i++) w[i] = (float)wd[i];
        }
        free(ad);
        free(g);
        free(v);
        free(wd);
        return st;
    }
    double *g = calloc((size_t)d * d, sizeof *g), *v = malloc((size_t)d * r * sizeof *v);
#if SKV_CPU_SIMD
    int32_t nr = (r + 7) / 8;
    double *vb = skv_cpu_alloc((size_t)nr * 8 * d * sizeof *vb);
    double *ap = skv_cpu_alloc((size_t)omp_get_max_threads() * 6 * d * sizeof *ap);
    if (!g || !v || !vb || !ap) st = SKV_ERR_OUT_OF_MEMORY;
    if (!st) st = skv_cpu_gram(n, d, a, g);
    if (!st) st = skv_cpu_top_eigvecs(g, d, r, v);
    if (!st) {
        for (int32_t js = 0; js < nr; js++)
            for (int32_t k = 0; k < d; k++)
                for (int32_t j = 0; j < 8; j++)
                    vb[((size_t)js * d + k) * 8 + j] = js * 8 + j < r ? v[(size_t)k * r + js * 8 + j] : 0.0;
        skv_cpu_project(n, d, r, a, vb, u, ap);
    }
    free(vb);
    free(ap);
#else
    /* portable build: BLAS-3 on row blocks of ~8 MB of doubles */
    int64_t nb = ((int64_t)1 << 20) / d;
    if (nb < 64) nb = 64;
    if (nb > n) nb = n;
    double *blk = malloc((size_t)nb * d * sizeof *blk), *ub = malloc((size_t)nb * r * sizeof *ub);
    if (!g || !v || !blk || !ub) st = SKV_ERR_OUT_OF_MEMORY;
    for (int64_t t = 0; !st && t < n; t += nb) {
        int64_t rows = n - t < nb ? n - t : nb;
        skv_cpu_rows_f64(a + (size_t)t * d, rows, d, blk);
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d, (int)rows, 1.0, blk, d, 1.0, g, d);
    }
    if (!st) st = skv_cpu_top_eigvecs(g, d, r, v);
    for (int64_t t = 0; !st && t < n; t += nb) {
        int64_t rows = n - t < nb ? n - t : nb;
        skv_cpu_rows_f64(a + (size_t)t * d, rows, d, blk);
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, r, d, 1.0, blk, d, v, r, 0.0, ub, r);
        for (size_t i = 0; i < (size_t)rows * r; i++) u[(size_t)t * r + i] = (float)ub[i];
    }
    free(blk);
    free(ub);
#endif
    if (!st)
        for (int32_t q = 0; q < r; q++)
            for (int32_t i = 0; i < d; i++) w[(size_t)q * d + i] = (float)v[(size_t)i * r + q];
    free(g);
    free(v);
    return st;
}

/* The route of lib/skv_factor.h (SKV_FACTORIZE read once per call). */
static skv_status skv_cpu_factorize(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u, float *w)
{
    skv_factor_mode mode = skv_factor_mode_env();
#if SKV_CPU_SIMD
    if (skv_factor_route_for(n, d, r, mode) == SKV_ROUTE_FAST) return skv_cpu_factorize_fast(n, d, r, a, u, w, mode);
#else
    (void)mode; /* portable build: the EXACT route (BLAS) for every shape */
#endif
    return skv_cpu_factorize_exact(n, d, r, a, u, w);
}

/* ---- RoPE --------------------------------------------------------------------------- */

static skv_status skv_cpu_rope(const skv_rope_config *rope, int32_t D, int64_t n_tokens, int32_t H,
                               int64_t pos0, const float *cos_tab, const float *sin_tab,
                               const skv_bf16 *in, skv_bf16 *out)
{
    int32_t R = rope->rotary_dim ? rope->rotary_dim : D, h2 = R / 2;
    int64_t rows = n_tokens * H;
#pragma omp parallel for schedule(static) if (rows > 64)
    for (int64_t row = 0; row < rows; row++) {
        float x[SKV_CPU_MAX_D]; /* row converted first: in == out is allowed */
        int64_t t = row / H;
        skv_cpu_to_f32(in + row * D, x, D);
        skv_cpu_rope_row(x, D, R, rope->interleaved, cos_tab + (pos0 + t) * h2, sin_tab + (pos0 + t) * h2,
                         out + row * D);
    }
    return SKV_OK;
}

/* ---- landmarks and outliers ----------------------------------------------------------- */

/*
 * skv_chunk_landmark_score, vectorized across the chunk's tokens: lane i is
 * token i's cos chain (ab, aa, bb: fmaf over d in order, from 0), so each lane
 * reproduces the scalar function's value exactly; the min over tokens is then
 * taken in token order with the same NaN rule. The mean is vectorized over d
 * (each d is its own in-order token sum).
 */
static float skv_cpu_chunk_score(const skv_bf16 *k, int64_t ts, int c, int D, float *mean)
{
#if SKV_CPU_SIMD
    int d = 0;
    __m256 inv_c = _mm256_set1_ps((float)c);
    for (; d + 8 <= D; d += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int t = 0; t < c; t++) acc = _mm256_add_ps(acc, skv_cpu_ld8(k + t * ts + d));
        _mm256_storeu_ps(mean + d, _mm256_div_ps(acc, inv_c));
    }
    for (; d < D; d++) {
        float acc = 0.0f;
        for (int t = 0; t < c; t++) acc = SKV_ADD(acc, skv_bf16_to_f32(k[t * ts + d]));
        mean[d] = SKV_DIV(acc, (float)c);
    }
    float best = 0.0f;
    for (int t0 = 0; t0 < c; t0 += 8) {
        int nt = skv_cpu_min(8, c - t0);
        const skv_bf16 *p[8];
        for (int i = 0; i < 8; i++) p[i] = k + (t0 + skv_cpu_min(i, nt - 1)) * ts; /* pad: repeat a row */
        __m256 ab = _mm256_setzero_ps(), aa = ab, bb = ab;
        for (d = 0; d + 8 <= D; d += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = skv_cpu_ld8(p[i] + d);
            skv_cpu_transpose8(r);
            for (int e = 0; e < 8; e++) {
                __m256 m = _mm256_broadcast_ss(mean + d + e);
                ab = _mm256_fmadd_ps(r[e], m, ab);
                aa = _mm256_fmadd_ps(r[e], r[e], aa);
                bb = _mm256_fmadd_ps(m, m, bb);
            }
        }
        for (; d < D; d++) {
            __m256 x = skv_cpu_col8(p, d), m = _mm256_broadcast_ss(mean + d);
            ab = _mm256_fmadd_ps(x, m, ab);
            aa = _mm256_fmadd_ps(x, x, aa);
            bb = _mm256_fmadd_ps(m, m, bb);
        }
        /* vmaxps(x, 1e-8) returns 1e-8 when x is NaN, as fmaxf does */
        __m256 den = _mm256_max_ps(_mm256_mul_ps(_mm256_sqrt_ps(aa), _mm256_sqrt_ps(bb)), _mm256_set1_ps(1e-8f));
        float sv[8];
        _mm256_storeu_ps(sv, _mm256_div_ps(ab, den));
        for (int i = 0; i < nt; i++) {
            float s = sv[i];
            if (t0 + i == 0 || s < best || s != s) best = s;
            if (best != best) return best;
        }
    }
    return best;
#else
    return skv_chunk_landmark_score(k, ts, c, D, mean);
#endif
}

static skv_status skv_cpu_landmarks_outliers(int32_t N, int32_t c, int32_t Hk, int32_t D, int32_t O,
                                             const skv_bf16 *k_post, int32_t *outlier_ids,
                                             int32_t *candidate_ids, skv_bf16 *landmarks)
{
    if (N <= 0 || O < 0 || O >= N) return SKV_ERR_INVALID_ARGUMENT;
    size_t nh = (size_t)Hk * N;
    skv_bf16 *lm = malloc(nh * D * sizeof *lm); /* every chunk's landmark, [Hk, N, D] */
    float *key = malloc(nh * sizeof *key);
    int32_t *scratch = malloc(nh * sizeof *scratch);
    char *is_out = calloc(nh, 1);
    if (!lm || !key || !scratch || !is_out) {
        free(lm);
        free(key);
        free(scratch);
        free(is_out);
        return SKV_ERR_OUT_OF_MEMORY;
    }
    int32_t n_cand = N - O;
#pragma omp parallel
    {
        /* token-major input: chunk j of head h is c rows of stride Hk*D */
#pragma omp for schedule(static)
        for (int64_t jh = 0; jh < (int64_t)nh; jh++) {
            int64_t j = jh / Hk, h = jh % Hk;
            float mean[SKV_CPU_MAX_D];
            float s = skv_cpu_chunk_score(k_post + ((size_t)j * c * Hk + h) * D, (int64_t)Hk * D, c, D, mean);
            key[h * N + j] = skv_outlier_key(s);
            skv_bf16 *l = lm + ((size_t)h * N + j) * D;
            for (int32_t d = 0; d < D; d++) l[d] = skv_f32_to_bf16(mean[d]);
        }
#pragma omp for schedule(static)
        for (int32_t h = 0; h < Hk; h++) {
            int32_t *oid = O > 0 ? outlier_ids + (size_t)h * O : NULL; /* may be NULL when O == 0 */
            char *mark = is_out + (size_t)h * N;
            if (O > 0) skv_topk_indices(key + (size_t)h * N, N, O, 1, scratch + (size_t)h * N, oid);
            for (int32_t o = 0; o < O; o++) mark[oid[o]] = 1;
            int32_t m = 0;
            for (int32_t j = 0; j < N; j++) {
                if (mark[j]) continue;
                candidate_ids[(size_t)h * n_cand + m] = j;
                memcpy(landmarks + ((size_t)h * n_cand + m) * D, lm + ((size_t)h * N + j) * D, (size_t)D * sizeof *lm);
                m++;
            }
        }
    }
    free(lm);
    free(key);
    free(scratch);
    free(is_out);
    return SKV_OK;
}

/* ---- score and select --------------------------------------------------------------- */

/*
 * dot(q_g, L_j) for 8 candidates j (rows L, L+D, ...) and 4 queries qf[4][D]:
 * lanes are candidates, each lane is skv_dot_bf16's fmaf chain over d = 0..D-1
 * from 0, so the values are bit-identical to it. out[g*ld + lane].
 */
#if SKV_CPU_SIMD
static void skv_cpu_dot8x4(const float *qf, int D, const skv_bf16 *L, float *out, int64_t ld)
{
    const skv_bf16 *p[8];
    for (int i = 0; i < 8; i++) p[i] = L + (size_t)i * D;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = skv_cpu_ld8(p[i] + d);
        skv_cpu_transpose8(r);
        for (int e = 0; e < 8; e++) {
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + d + e), r[e], a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + D + d + e), r[e], a1);
            a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + 2 * D + d + e), r[e], a2);
            a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + 3 * D + d + e), r[e], a3);
        }
    }
    for (; d < D; d++) {
        __m256 x = skv_cpu_col8(p, d);
        a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + d), x, a0);
        a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + D + d), x, a1);
        a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + 2 * D + d), x, a2);
        a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + 3 * D + d), x, a3);
    }
    _mm256_storeu_ps(out, a0);
    _mm256_storeu_ps(out + ld, a1);
    _mm256_storeu_ps(out + 2 * ld, a2);
    _mm256_storeu_ps(out + 3 * ld, a3);
}
#endif

static skv_status skv_cpu_score_select(int32_t Hq, int32_t Hk, int32_t D, int32_t n_cand, int32_t S,
                                       float scale, const skv_bf16 *q, const skv_bf16 *landmarks,
                                       const int32_t *candidate_ids, int32_t *sel_idx,
                                       int32_t *sel_ids, float *amax, skv_ws *ws)
{
    int32_t G = Hq / Hk, G4 = (G + 3) / 4 * 4; /* queries padded to groups of 4 (zero rows) */
    const int32_t JB = 64;                     /* candidates per work item */
    int64_t nblk = (n_cand + JB - 1) / JB;
    float *s = skv_ws_alloc(ws, (size_t)Hk * G4 * n_cand * sizeof *s); /* scores, then probabilities */
    float *qf = skv_ws_alloc(ws, (size_t)Hk * G4 * D * sizeof *qf);
    float *a = skv_ws_alloc(ws, (size_t)Hk * n_cand * sizeof *a);
    int32_t *scratch = skv_ws_alloc(ws, (size_t)Hk * n_cand * sizeof *scratch);
    if (!s || !qf || !a || !scratch) return SKV_ERR_OUT_OF_MEMORY; /* the caller resets ws */
    memset(qf, 0, (size_t)Hk * G4 * D * sizeof *qf);
    for (int32_t i = 0; i < Hq; i++) skv_cpu_to_f32(q + (size_t)i * D, qf + ((size_t)(i / G) * G4 + i % G) * D, D);
#pragma omp parallel
    {
        /* 1. s = dot(q, L) * scale, items = (head, block of candidates, group of 4 queries) */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < (int64_t)Hk * nblk * (G4 / 4); it++) {
            int64_t g4 = it % (G4 / 4), b = it / (G4 / 4) % nblk, h = it / (G4 / 4) / nblk;
            int32_t j0 = (int32_t)b * JB, j1 = skv_cpu_min(j0 + JB, n_cand), j = j0;
            const skv_bf16 *L = landmarks + (size_t)h * n_cand * D;
            const float *qg = qf + ((size_t)h * G4 + g4 * 4) * D;
            float *sg = s + ((size_t)h * G4 + g4 * 4) * n_cand;
#if SKV_CPU_SIMD
            for (; j + 8 <= j1; j += 8) skv_cpu_dot8x4(qg, D, L + (size_t)j * D, sg + j, n_cand);
#endif
            for (; j < j1; j++)
                for (int g = 0; g < 4; g++) sg[g * n_cand + j] = skv_dot_f32_bf16(qg + g * D, L + (size_t)j * D, D);
            for (int g = 0; g < 4; g++)
                for (j = j0; j < j1; j++) sg[g * n_cand + j] = SKV_MUL(sg[g * n_cand + j], scale);
        }
        /* 2. softmax per query head, exactly as ref */
#pragma omp for schedule(static)
        for (int32_t i = 0; i < Hq; i++) {
            float *si = s + ((size_t)(i / G) * G4 + i % G) * n_cand;
            skv_softmax_inplace(si, n_cand);
        }
        /* 3. max over the group, top-S per KV head */
#pragma omp for schedule(static)
        for (int32_t h = 0; h < Hk; h++) {
            float *ah = a + (size_t)h * n_cand;
            const float *sh = s + (size_t)h * G4 * n_cand;
            memcpy(ah, sh, (size_t)n_cand * sizeof *ah);
            for (int32_t g = 1; g < G; g++)
                for (int32_t j = 0; j < n_cand; j++)
                    if (sh[(size_t)g * n_cand + j] > ah[j]) ah[j] = sh[(size_t)g * n_cand + j];
            if (amax) memcpy(amax + (size_t)h * n_cand, ah, (size_t)n_cand * sizeof *ah);
            skv_select_head(ah, n_cand, S, scratch + (size_t)h * n_cand, sel_idx + (size_t)h * S,
                            candidate_ids ? candidate_ids + (size_t)h * n_cand : NULL,
                            sel_ids ? sel_ids + (size_t)h * S : NULL);
        }
    }
    return SKV_OK;
}

/* ---- rebuild keys --------------------------------------------------------------------- */

/*
 * The decode hot spot: per KV head, X = U_sel W_h (M = S*c rows, K = r,
 * N = D), float accumulation (tolerance-checked, docs/DESIGN.md section 6), then
 * RoPE. Fused per work item of 48 rows: gather the rows' U (bf16 -> float,
 * packed), the 6x16 kernel against W_h packed once per call, RoPE, store; the
 * float X never leaves the thread's cache.
 */
static skv_status skv_cpu_rebuild_keys(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r,
                                       int32_t c, int32_t S, int64_t n, const skv_bf16 *u,
                                       const skv_bf16 *w, const int32_t *chunk_ids,
                                       const float *cos_tab, const float *sin_tab, skv_bf16 *k_out,
                                       skv_ws *ws)
{
    (void)n;
    int32_t R = rope->rotary_dim ? rope->rotary_dim : D, h2 = R / 2;
    int64_t M = (int64_t)S * c, width = (int64_t)Hk * D;
#if SKV_CPU_SIMD
    enum { RB = SKV_CPU_RB };
    int32_t ns = (D + 15) / 16, Dp = ns * 16;
    int64_t nrb = (M + RB - 1) / RB, items = (int64_t)Hk * nrb;
    int nt = omp_get_max_threads();
    size_t per_thread = (size_t)RB * r + (size_t)RB * Dp;
    float *wb = skv_ws_alloc(ws, (size_t)Hk * ns * r * 16 * sizeof *wb); /* [h][sliver][k][16] */
    float *buf = skv_ws_alloc(ws, (size_t)nt * per_thread * sizeof *buf);
    if (!wb || !buf) return SKV_ERR_OUT_OF_MEMORY;
#pragma omp parallel num_threads(nt)
    {
        float *ap = buf + (size_t)omp_get_thread_num() * per_thread, *x = ap + (size_t)RB * r;
#pragma omp for schedule(static)
        for (int64_t hk = 0; hk < (int64_t)Hk * r; hk++) {
            int64_t h = hk / r, k = hk % r;
            const skv_bf16 *wr = w + (size_t)k * width + h * D;
            for (int32_t j = 0; j < Dp; j++)
                wb[(((size_t)h * ns + j / 16) * r + k) * 16 + j % 16] = j < D ? skv_bf16_to_f32(wr[j]) : 0.0f;
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            int64_t h = it / nrb, m0 = it % nrb * RB;
            int32_t rows = (int32_t)(M - m0 < RB ? M - m0 : RB), nsl = (rows + 5) / 6;
            for (int32_t i = 0; i < nsl * 6; i++) { /* ap[sliver][k][6] */
                float *dst = ap + (size_t)(i / 6) * 6 * r + i % 6;
                if (i < rows) {
                    int64_t m = m0 + i, t = (int64_t)chunk_ids[h * S + m / c] * c + m % c;
                    const skv_bf16 *ur = u + (size_t)t * r;
                    for (int32_t k = 0; k < r; k++) dst[(size_t)k * 6] = skv_bf16_to_f32(ur[k]);
                } else {
                    for (int32_t k = 0; k < r; k++) dst[(size_t)k * 6] = 0.0f;
                }
            }
            for (int32_t q = 0; q < nsl; q++)
                for (int32_t js = 0; js < ns; js++)
                    skv_cpu_skern(r, ap + (size_t)q * 6 * r, wb + ((size_t)h * ns + js) * r * 16,
                                  x + (size_t)q * 6 * Dp + js * 16, Dp);
            for (int32_t i = 0; i < rows; i++) {
                int64_t m = m0 + i, t = (int64_t)chunk_ids[h * S + m / c] * c + m % c;
                skv_cpu_rope_row(x + (size_t)i * Dp, D, R, rope->interleaved, cos_tab + t * h2, sin_tab + t * h2,
                                 k_out + ((size_t)h * M + m) * D);
            }
        }
    }
#else
    /* portable build: gather U rows as float, one sgemm per head (W_h in place, ldb = Hk*D), RoPE */
    int64_t rows = (int64_t)Hk * M;
    float *wf = skv_ws_alloc(ws, (size_t)r * width * sizeof *wf);
    float *uf = skv_ws_alloc(ws, (size_t)rows * r * sizeof *uf);
    float *x = skv_ws_alloc(ws, (size_t)rows * D * sizeof *x);
    if (!wf || !uf || !x) return SKV_ERR_OUT_OF_MEMORY;
    skv_cpu_to_f32(w, wf, (int64_t)r * width);
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < rows; row++) { /* row = (h*S + s)*c + i */
        int64_t t = (int64_t)chunk_ids[row / c] * c + row % c;
        skv_cpu_to_f32(u + (size_t)t * r, uf + (size_t)row * r, r);
    }
    for (int32_t h = 0; h < Hk; h++)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, D, r, 1.0f, uf + (size_t)h * M * r, r,
                    wf + (size_t)h * D, (int)width, 0.0f, x + (size_t)h * M * D, D);
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        int64_t t = (int64_t)chunk_ids[row / c] * c + row % c;
        skv_cpu_rope_row(x + (size_t)row * D, D, R, rope->interleaved, cos_tab + t * h2, sin_tab + t * h2,
                         k_out + (size_t)row * D);
    }
#endif
    return SKV_OK;
}

/* ---- gather values --------------------------------------------------------------------- */

static skv_status skv_cpu_gather_values(int32_t Hk, int32_t D, int32_t c, int32_t n_store, int32_t S,
                                        const skv_bf16 *store, const int32_t *idx, skv_bf16 *v_out)
{
    size_t block = (size_t)c * D;
    /* A decode step copies ~4 MB: one thread does it at memory speed, and on a
       loaded machine a fork/join can stall for longer than the copy takes. */
#pragma omp parallel for schedule(static) if ((size_t)Hk * S * block * sizeof *store > ((size_t)8 << 20))
    for (int64_t hs = 0; hs < (int64_t)Hk * S; hs++)
        memcpy(v_out + hs * block, store + ((size_t)(hs / S) * n_store + idx[hs]) * block, block * sizeof *store);
    return SKV_OK;
}

/* ---- attention ------------------------------------------------------------------------- */

/*
 * Split-K attention (flash-decoding): the tokens of each KV head (spans
 * concatenated) are cut into blocks of SKV_CPU_BT; each (head, block) item
 * computes, for the G query heads of the group, its block max m, sum of
 * weights l and unnormalized sum acc; the blocks are then merged in order.
 * Fixed block size, fixed merge order: the result does not depend on the
 * thread count. Reads bf16 K/V directly (no float copy).
 */

struct skv_cpu_attn {
    int32_t G, D, Dp;
    float scale;
    const float *qf;        /* [Hq, Dp], zero padded */
    const skv_kv_span *spans;
    const int64_t *off;     /* span start offsets in the concatenated token list */
    float *part;            /* per item: [G] m, [G] l, [G][Dp] acc */
};

#if SKV_CPU_SIMD
/* exp for attention weights (x <= 0; tolerance-checked, not a decision): skv_expf's
   Cody-Waite + Cephes polynomial, 8 lanes, clamped so that 2^k stays normal. */
static inline __m256 skv_cpu_exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 kf = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(kf), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(e, _mm256_castsi256_ps(k));
}

/* The 4 horizontal sums of a, b, c, d as one vector. */
static inline __m128 skv_cpu_hsum4(__m256 a, __m256 b, __m256 c, __m256 d)
{
    __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}
#endif

/* dot(q, k) for attention scores: float, any order (tolerance-checked). */
static float skv_cpu_dotq(const float *q, const skv_bf16 *k, int32_t D)
{
    float dot = 0.0f;
    int32_t d = 0;
#if SKV_CPU_SIMD
    __m256 a = _mm256_setzero_ps();
    for (; d + 8 <= D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), skv_cpu_ld8(k + d), a);
    dot = skv_cpu_hsum(a);
#endif
    for (; d < D; d++) dot += q[d] * skv_bf16_to_f32(k[d]);
    return dot;
}

static void skv_cpu_attn_item(const struct skv_cpu_attn *A, int32_t h, int64_t t0, int64_t t1, float *sc)
{
    int32_t G = A->G, D = A->D, Dp = A->Dp, nt = (int32_t)(t1 - t0), g = 0;
    const float *qh = A->qf + (size_t)h * G * Dp;
    float *m = A->part, *l = m + G, *acc = l + G;
    const skv_bf16 *kp[SKV_CPU_BT], *vp[SKV_CPU_BT];
    int sp = 0;
    for (int32_t i = 0; i < nt; i++) { /* token rows of this block, across span boundaries */
        int64_t t = t0 + i;
        while (A->off[sp + 1] <= t) sp++;
        const skv_kv_span *s = &A->spans[sp];
        int64_t o = h * s->head_stride + (t - A->off[sp]) * s->token_stride;
        kp[i] = s->k + o;
        vp[i] = s->v + o;
    }
    /* scores: 4 queries per pass share each converted key vector */
#if SKV_CPU_SIMD
    int32_t D8 = D / 8 * 8;
    for (; g + 4 <= G; g += 4) {
        const float *q0 = qh + (size_t)g * Dp, *q1 = q0 + Dp, *q2 = q1 + Dp, *q3 = q2 + Dp;
        for (int32_t i = 0; i < nt; i++) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, kv;
            for (int32_t d = 0; d < D8; d += 8) {
                kv = skv_cpu_ld8(kp[i] + d);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), kv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + d), kv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + d), kv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + d), kv, a3);
            }
            if (D8 < D) { /* q is zero padded to Dp */
                float kt[8] = {0};
                for (int32_t d = D8; d < D; d++) kt[d - D8] = skv_bf16_to_f32(kp[i][d]);
                kv = _mm256_loadu_ps(kt);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + D8), kv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + D8), kv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + D8), kv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + D8), kv, a3);
            }
            float s4[4];
            _mm_storeu_ps(s4, _mm_mul_ps(skv_cpu_hsum4(a0, a1, a2, a3), _mm_set1_ps(A->scale)));
            for (int j = 0; j < 4; j++) sc[(size_t)(g + j) * SKV_CPU_BT + i] = s4[j];
        }
    }
#endif
    for (; g < G; g++)
        for (int32_t i = 0; i < nt; i++)
            sc[(size_t)g * SKV_CPU_BT + i] = skv_cpu_dotq(qh + (size_t)g * Dp, kp[i], D) * A->scale;
    /* block max and weights */
    for (g = 0; g < G; g++) {
        float *sg = sc + (size_t)g * SKV_CPU_BT, mx = sg[0], sum = 0.0f;
        for (int32_t i = 1; i < nt; i++) mx = sg[i] > mx ? sg[i] : mx;
        int32_t i = 0;
#if SKV_CPU_SIMD
        __m256 vs = _mm256_setzero_ps(), vm = _mm256_set1_ps(mx);
        for (; i + 8 <= nt; i += 8) {
            __m256 e = skv_cpu_exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vm));
            _mm256_storeu_ps(sg + i, e);
            vs = _mm256_add_ps(vs, e);
        }
        sum = skv_cpu_hsum(vs);
#endif
        for (; i < nt; i++) {
            sg[i] = expf(sg[i] - mx);
            sum += sg[i];
        }
        m[g] = mx;
        l[g] = sum;
    }
    /* acc_g = sum_t w_gt v_t: dims outer, tokens inner, accumulators in registers */
    g = 0;
#if SKV_CPU_SIMD
    int32_t d0 = 0;
    for (; g + 4 <= G; g += 4) {
        const float *w0 = sc + (size_t)g * SKV_CPU_BT, *w1 = w0 + SKV_CPU_BT, *w2 = w1 + SKV_CPU_BT,
                    *w3 = w2 + SKV_CPU_BT;
        float *o0 = acc + (size_t)g * Dp, *o1 = o0 + Dp, *o2 = o1 + Dp, *o3 = o2 + Dp;
        int32_t d = 0;
        for (; d + 16 <= D; d += 16) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int32_t i = 0; i < nt; i++) {
                __m256 v0 = skv_cpu_ld8(vp[i] + d), v1 = skv_cpu_ld8(vp[i] + d + 8), x;
                x = _mm256_broadcast_ss(w0 + i);
                a0 = _mm256_fmadd_ps(x, v0, a0);
                b0 = _mm256_fmadd_ps(x, v1, b0);
                x = _mm256_broadcast_ss(w1 + i);
                a1 = _mm256_fmadd_ps(x, v0, a1);
                b1 = _mm256_fmadd_ps(x, v1, b1);
                x = _mm256_broadcast_ss(w2 + i);
                a2 = _mm256_fmadd_ps(x, v0, a2);
                b2 = _mm256_fmadd_ps(x, v1, b2);
                x = _mm256_broadcast_ss(w3 + i);
                a3 = _mm256_fmadd_ps(x, v0, a3);
                b3 = _mm256_fmadd_ps(x, v1, b3);
            }
            _mm256_storeu_ps(o0 + d, a0);
            _mm256_storeu_ps(o0 + d + 8, b0);
            _mm256_storeu_ps(o1 + d, a1);
            _mm256_storeu_ps(o1 + d + 8, b1);
            _mm256_storeu_ps(o2 + d, a2);
            _mm256_storeu_ps(o2 + d + 8, b2);
            _mm256_storeu_ps(o3 + d, a3);
            _mm256_storeu_ps(o3 + d + 8, b3);
        }
        d0 = d;
    }
    for (int32_t gg = 0; gg < g; gg++) /* dims left over by the 16-wide loop */
        for (int32_t d = d0; d < D; d++) {
            float a = 0.0f;
            for (int32_t i = 0; i < nt; i++) a += sc[(size_t)gg * SKV_CPU_BT + i] * skv_bf16_to_f32(vp[i][d]);
            acc[(size_t)gg * Dp + d] = a;
        }
#endif
    for (; g < G; g++) {
        float *og = acc + (size_t)g * Dp;
        const float *wg = sc + (size_t)g * SKV_CPU_BT;
        memset(og, 0, (size_t)D * sizeof *og);
        for (int32_t i = 0; i < nt; i++) {
            int32_t d = 0;
#if SKV_CPU_SIMD
            __m256 x = _mm256_broadcast_ss(wg + i);
            for (; d + 8 <= D; d += 8)
                _mm256_storeu_ps(og + d, _mm256_fmadd_ps(x, skv_cpu_ld8(vp[i] + d), _mm256_loadu_ps(og + d)));
#endif
            for (; d < D; d++) og[d] += wg[i] * skv_bf16_to_f32(vp[i][d]);
        }
    }
}

static skv_status skv_cpu_sparse_attention(int32_t Hq, int32_t Hk, int32_t D, float scale,
                                           const skv_bf16 *q, int32_t n_spans,
                                           const skv_kv_span *spans, float *out, skv_ws *ws)
{
    int32_t G = Hq / Hk, Dp = (D + 7) / 8 * 8;
    int64_t off[SKV_MAX_SPANS + 2];
    off[0] = 0;
    for (int32_t s = 0; s < n_spans; s++) off[s + 1] = off[s] + spans[s].n_tokens;
    off[n_spans + 1] = INT64_MAX; /* sentinel: span scans never run past the end */
    int64_t T = off[n_spans], nblk = (T + SKV_CPU_BT - 1) / SKV_CPU_BT, items = (int64_t)Hk * nblk;
    size_t item_sz = (size_t)G * (2 + Dp);
    int nt = omp_get_max_threads();
    float *qf = skv_ws_alloc(ws, (size_t)Hq * Dp * sizeof *qf);
    float *part = skv_ws_alloc(ws, (size_t)items * item_sz * sizeof *part);
    float *sc = skv_ws_alloc(ws, (size_t)nt * G * SKV_CPU_BT * sizeof *sc);
    if (!qf || !part || !sc) return SKV_ERR_OUT_OF_MEMORY;
    memset(qf, 0, (size_t)Hq * Dp * sizeof *qf);
    for (int32_t i = 0; i < Hq; i++) skv_cpu_to_f32(q + (size_t)i * D, qf + (size_t)i * Dp, D);
    struct skv_cpu_attn A = {G, D, Dp, scale, qf, spans, off, NULL};
#pragma omp parallel num_threads(nt)
    {
        float *my_sc = sc + (size_t)omp_get_thread_num() * G * SKV_CPU_BT;
        struct skv_cpu_attn Ai = A;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            int64_t h = it / nblk, b = it % nblk, t0 = b * SKV_CPU_BT;
            Ai.part = part + (size_t)it * item_sz;
            skv_cpu_attn_item(&Ai, (int32_t)h, t0, t0 + SKV_CPU_BT < T ? t0 + SKV_CPU_BT : T, my_sc);
        }
        /* merge the blocks of each (head, query) in block order */
#pragma omp for schedule(static)
        for (int32_t i = 0; i < Hq; i++) {
            int32_t h = i / G, g = i % G;
            float M = -INFINITY, L = 0.0f, *o = out + (size_t)i * D;
            for (int64_t b = 0; b < nblk; b++) {
                float mb = part[(size_t)(h * nblk + b) * item_sz + g];
                M = mb > M ? mb : M;
            }
            memset(o, 0, (size_t)D * sizeof *o);
            for (int64_t b = 0; b < nblk; b++) {
                const float *p = part + (size_t)(h * nblk + b) * item_sz;
                float f = expf(p[g] - M);
                const float *ab = p + 2 * G + (size_t)g * Dp;
                L += f * p[G + g];
                for (int32_t d = 0; d < D; d++) o[d] += f * ab[d];
            }
            for (int32_t d = 0; d < D; d++) o[d] /= L;
        }
    }

    return SKV_OK;
}

static skv_status skv_cpu_full_attention(int32_t Hq, int32_t Hk, int32_t D, float scale,
                                         const skv_bf16 *q, int64_t n_tokens, const skv_bf16 *k,
                                         const skv_bf16 *v, float *out)
{
    skv_kv_span span = {k, v, n_tokens, D, (int64_t)Hk * D};
    skv_ws ws = {0}; /* outside the decode path: plain allocations */
    skv_status st = skv_cpu_sparse_attention(Hq, Hk, D, scale, q, 1, &span, out, &ws);
    skv_ws_reset(&ws);
    return st;
}

/*
 * The arena of one decode step (one sequence): the largest of the three slots'
 * skv_ws_alloc totals above, for the thread count decode will run with.
 * test_contract checks that no decode ever spills past it.
 */
static size_t skv_cpu_decode_ws_bytes(const skv_config *cfg, int32_t cand_max, int64_t max_attn_tokens)
{
    size_t Hq = (size_t)cfg->n_q_heads, Hk = (size_t)cfg->n_kv_heads, D = (size_t)cfg->head_dim;
    size_t r = (size_t)cfg->rank, n = (size_t)cand_max, G = Hq / Hk, G4 = (G + 3) / 4 * 4;
    size_t nt = (size_t)(cfg->n_threads > 0 ? cfg->n_threads : omp_get_max_threads());
    size_t f = sizeof(float);
    size_t sel = SKV_WS_BYTES(f * (Hk * G4 * n + Hk * G4 * D + 2 * Hk * n), 4);
#if SKV_CPU_SIMD
    size_t Dp16 = (D + 15) / 16 * 16;
    size_t reb = SKV_WS_BYTES(f * (Hk * Dp16 * r + nt * SKV_CPU_RB * (r + Dp16)), 2);
#else
    size_t M = (size_t)cfg->budget; /* S * c tokens per head */
    size_t reb = SKV_WS_BYTES(f * (r * Hk * D + Hk * M * r + Hk * M * D), 3);
#endif
    size_t Dp = (D + 7) / 8 * 8, items = Hk * (size_t)((max_attn_tokens + SKV_CPU_BT - 1) / SKV_CPU_BT);
    size_t att = SKV_WS_BYTES(f * (Hq * Dp + items * G * (2 + Dp) + nt * G * SKV_CPU_BT), 3);
    size_t m = sel > reb ? sel : reb;
    return m > att ? m : att;
}

/* ---- table ----------------------------------------------------------------------------- */

void skv_cpu_fill_ops(struct skv_backend_ops *ops)
{
    *ops = skv_ref_ops;
    ops->name = "cpu";
    ops->check_finite = skv_cpu_check_finite;
    ops->set_threads = skv_cpu_set_threads;
    ops->decode_ws_bytes = skv_cpu_decode_ws_bytes;
    ops->factorize = skv_cpu_factorize;
    ops->rope = skv_cpu_rope;
    ops->landmarks_outliers = skv_cpu_landmarks_outliers;
    ops->score_select = skv_cpu_score_select;
    ops->rebuild_keys = skv_cpu_rebuild_keys;
    ops->gather_values = skv_cpu_gather_values;
    ops->sparse_attention = skv_cpu_sparse_attention;
    ops->full_attention = skv_cpu_full_attention;
}
