/*
 * GEMM micro-kernels (BLIS style, AVX2+FMA) for the tolerance-checked
 * products (factorize, rebuild_keys). Why not OpenBLAS there: the Debian
 * OpenBLAS 0.3.21 DYNAMIC_ARCH build detects this VM's Xeon as "Prescott" and
 * runs SSE3 kernels at ~1/5 of AVX2 speed (dsyrk 12 GFLOP/s on 2 cores); and
 * BLAS threads interleaved with the backend's own fight over the cores.
 * Every output element is one fma chain over k in order.
 */
#include "skv_cpu_simd.h"
#include "skv_cpu_kernels.h"

#if SKV_CPU_X86

/* Packed panels: a[p*6 + i], b[p*NR + j] for p < k; 12 accumulators. */
#define SKV_CPU_FMA2(ci0, ci1, i)                          \
    x = _mm256_broadcast_ss(a + (i));                      \
    ci0 = _mm256_fmadd_ps(x, b0, ci0);                     \
    ci1 = _mm256_fmadd_ps(x, b1, ci1)

/* float 6x16 tile, written to c (row stride ldc). */
SKV_CPU_AVX2 void skv_cpu_skern(int k, const float *a, const float *b, float *c, int64_t ldc)
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
SKV_CPU_AVX2 void skv_cpu_dkern(int64_t k, const double *a, const double *b, double *t)
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

/* float 6x16 tile c[6 * 16] = sum_p ar[i][p] * b[p * 16 + j]: six rows of a row-major operand
   (contiguous in p) against a packed 16-column sliver. */
SKV_CPU_AVX2 void skv_cpu_skern_rows(int64_t k, const float *const ar[6], const float *b, float *c)
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
SKV_CPU_AVX2 void skv_cpu_dkern_rows(int64_t k, const double *const ar[6], const double *b, double *t)
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

#define SKV_CPU_ZFMA2(ci0, ci1, i)                         \
    x = _mm512_set1_ps(a[i]);                              \
    ci0 = _mm512_fmadd_ps(x, b0, ci0);                     \
    ci1 = _mm512_fmadd_ps(x, b1, ci1)

/* float 6x32 tile (AVX-512F), written to c (row stride ldc): skv_cpu_skern twice as wide, the same
   fma chain over k per element, so the same values bit for bit. */
SKV_CPU_AVX512 void skv_cpu_zkern(int k, const float *a, const float *b, float *c, int64_t ldc)
{
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m512 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, x;
    for (int p = 0; p < k; p++, a += 6, b += 32) {
        __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
        SKV_CPU_ZFMA2(c00, c01, 0);
        SKV_CPU_ZFMA2(c10, c11, 1);
        SKV_CPU_ZFMA2(c20, c21, 2);
        SKV_CPU_ZFMA2(c30, c31, 3);
        SKV_CPU_ZFMA2(c40, c41, 4);
        SKV_CPU_ZFMA2(c50, c51, 5);
    }
    __m512 cc[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    for (int i = 0; i < 6; i++) {
        _mm512_storeu_ps(c + i * ldc, cc[2 * i]);
        _mm512_storeu_ps(c + i * ldc + 16, cc[2 * i + 1]);
    }
}
#endif
