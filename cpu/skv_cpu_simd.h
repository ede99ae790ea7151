/*
 * skv_cpu_simd.h - AVX2 helpers of the cpu backend (bf16 loads and stores,
 * transposes, horizontal sums, the attention exp), private. For SKV_CPU_AVX2
 * functions only. Layer 0 (skv_cpu_ops.h has the map).
 */
#ifndef SKV_CPU_SIMD_H
#define SKV_CPU_SIMD_H

#include "skv_cpu_base.h"

#if SKV_CPU_X86
#include <immintrin.h>

/* 8 bf16 -> 8 float, exact (bf16 is the upper half of a float). */
static inline SKV_CPU_AVX2 __m256 skv_cpu_ld8(const skv_bf16 *p)
{
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 8 float -> 8 bf16 with skv_f32_to_bf16's rounding and NaN rule, bit for bit. */
static inline SKV_CPU_AVX2 void skv_cpu_st8(skv_bf16 *p, __m256 x)
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
static inline SKV_CPU_AVX2 void skv_cpu_transpose8(__m256 r[8])
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
static inline SKV_CPU_AVX2 __m256 skv_cpu_col8(const skv_bf16 *const p[8], int d)
{
    return _mm256_setr_ps(skv_bf16_to_f32(p[0][d]), skv_bf16_to_f32(p[1][d]), skv_bf16_to_f32(p[2][d]),
                          skv_bf16_to_f32(p[3][d]), skv_bf16_to_f32(p[4][d]), skv_bf16_to_f32(p[5][d]),
                          skv_bf16_to_f32(p[6][d]), skv_bf16_to_f32(p[7][d]));
}

static inline SKV_CPU_AVX2 float skv_cpu_hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}


/* exp for attention weights (x <= 0; tolerance-checked, not a decision): skv_expf's
   Cody-Waite + Cephes polynomial, 8 lanes, clamped so that 2^k stays normal. */
static inline SKV_CPU_AVX2 __m256 skv_cpu_exp8(__m256 x)
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
static inline SKV_CPU_AVX2 __m128 skv_cpu_hsum4(__m256 a, __m256 b, __m256 c, __m256 d)
{
    __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

#endif /* SKV_CPU_X86 */
#endif /* SKV_CPU_SIMD_H */
