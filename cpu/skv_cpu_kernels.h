/*
 * skv_cpu_kernels.h - layer 1 of the cpu backend (skv_cpu_ops.h has the map):
 * the pieces several op files share. Includes only layer 0.
 *   skv_cpu_gemm.c  GEMM micro-kernels (AVX2+FMA, one AVX-512F)
 *   skv_cpu_gram.c  Gram matrices A^T A for the factorization (uses the micro-kernels)
 *   skv_cpu_rope.c  bf16 -> float rows, one RoPE row, and the rope slot
 */
#ifndef SKV_CPU_KERNELS_H
#define SKV_CPU_KERNELS_H

#include "skv_cpu_base.h"

#if SKV_CPU_X86
/* ---- GEMM micro-kernels (skv_cpu_gemm.c) ---- */
SKV_CPU_AVX2 void skv_cpu_skern(int k, const float *a, const float *b, float *c, int64_t ldc);
SKV_CPU_AVX2 void skv_cpu_dkern(int64_t k, const double *a, const double *b, double *t);
SKV_CPU_AVX2 void skv_cpu_skern_rows(int64_t k, const float *const ar[6], const float *b, float *c);
SKV_CPU_AVX2 void skv_cpu_dkern_rows(int64_t k, const double *const ar[6], const double *b, double *t);
SKV_CPU_AVX512 void skv_cpu_zkern(int k, const float *a, const float *b, float *c, int64_t ldc);

/* ---- Gram matrices (skv_cpu_gram.c; AVX2 callers only) ---- */
skv_status skv_cpu_gram(int64_t n, int32_t d, const skv_bf16 *a, double *g);
skv_status skv_cpu_fgram(int64_t n, int32_t d, const skv_bf16 *a, float scale, double *g);
int skv_cpu_amax_exp(const skv_bf16 *a, int64_t count);
void skv_cpu_mirror(double *g, int32_t d);
#endif

/* ---- RoPE (skv_cpu_rope.c) ---- */
void skv_cpu_to_f32(const skv_bf16 *in, float *out, int64_t n);
void skv_cpu_rope_row(const float *x, int D, int R, int interleaved, const float *cs, const float *sn,
                      skv_bf16 *out);
skv_status skv_cpu_rope(const skv_rope_config *rope, int32_t D, int64_t n_tokens, int32_t H, int64_t pos0,
                        const float *cos_tab, const float *sin_tab, const skv_bf16 *in, skv_bf16 *out);

#endif /* SKV_CPU_KERNELS_H */
