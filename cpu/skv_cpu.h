/*
 * skv_cpu.h - private header of the cpu backend (AVX2/FMA chosen at run time,
 * OpenMP for prefill, its own helper threads for decode, LAPACKE, OpenBLAS).
 * cpu/skv_cpu.c fills the dispatch table from ref's and overrides every op
 * slot with the functions declared here.
 *
 * Decisions (landmarks, outliers, candidates, selection) must be bit-identical
 * to ref (docs/DESIGN.md section 5), with or without SIMD. They are computed from skv_numerics.h; where a
 * loop is vectorized, it is vectorized ACROSS independent chains (candidates,
 * tokens, dims), so every lane runs exactly the fmaf/add/div sequence of the
 * shared scalar function, in the same order. Only IEEE-rounded AVX ops are
 * used there (vfmadd, vadd, vmul, vdiv, vsqrt, vmax with fmaxf's NaN rule).
 *
 * Results do not depend on the thread count (fixed blocking, fixed merge
 * order). Scratch: the decode slots take theirs from the cache's workspace
 * (skv_ws, sized by the *_ws_bytes functions below at create), so a decode
 * step allocates nothing; prefill slots malloc per call.
 */
#ifndef SKV_CPU_H
#define SKV_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "skv_backend.h"
#include "skv_factor.h"
#include "skv_numerics.h"

/*
 * Instruction sets. The library is built for baseline x86-64 (no -mavx2 or
 * -mfma); the AVX2+FMA code is compiled per function (SKV_CPU_AVX2) and runs
 * only when skv_cpu_simd() says so: the CPU has AVX2 and FMA (cpuid, with
 * the OS's YMM state) and the environment variable SKV_CPU_SIMD is not "0"
 * (read once, at the first call). The AVX-512F kernel (SKV_CPU_AVX512) runs
 * also when the CPU has AVX-512F and SKV_CPU_SIMD is not "avx2". Otherwise, and on other architectures, the
 * portable code runs: decisions bit for bit the same, factorize by the EXACT
 * route for every shape and rebuild_keys by OpenBLAS sgemm.
 * Functions marked SKV_CPU_AVX2 may only be called when skv_cpu_simd() is 1,
 * and no OpenMP region may hold vector types itself (clang does not give the
 * outlined region its function's target): region bodies call such functions.
 */
#ifndef SKV_CPU_X86
#if defined(__x86_64__) || defined(__i386__)
#define SKV_CPU_X86 1
#else
#define SKV_CPU_X86 0
#endif
#endif
#if SKV_CPU_X86
#define SKV_CPU_AVX2 __attribute__((target("avx2,fma")))
#define SKV_CPU_AVX512 __attribute__((target("avx512f,avx2,fma")))
#endif

/* The SIMD code that runs, constant for the process: 0 the portable code, SKV_CPU_LEVEL_AVX2 the
   AVX2+FMA functions, SKV_CPU_LEVEL_AVX512 those and the AVX-512F ones (rebuild_keys' kernel). */
enum { SKV_CPU_LEVEL_AVX2 = 1, SKV_CPU_LEVEL_AVX512 = 2 };
int skv_cpu_simd(void);

/* Threads of the calling thread's next parallel region: config.n_threads of the
   cache call in progress on this thread (set_threads), else omp_get_max_threads(). */
int skv_cpu_threads(void);

/* The decode slots' team (skv_cpu_pool.c): fn(ctx, i, t) for every item i in [0, n), on the calling
   thread (t = 0) and up to nt - 1 helper threads (t = 1 .. nt - 1; per-thread scratch by t), items
   handed out one at a time in order; returns when every item is done. */
typedef void (*skv_cpu_item_fn)(void *ctx, int64_t item, int t);
void skv_cpu_run(int nt, int64_t n, skv_cpu_item_fn fn, void *ctx);

/* skv_cpu_threads(), but no more than items (at least 1): no thread without work. */
static inline int skv_cpu_team(int64_t items)
{
    int nt = skv_cpu_threads();
    return items < nt ? (items > 1 ? (int)items : 1) : nt;
}

/* Counts one more of total completions at *cnt; 1 for the caller that completes the last one,
   which then sees every other completer's writes (acquire-release). */
static inline int skv_cpu_last(int32_t *cnt, int32_t total)
{
    return __atomic_add_fetch(cnt, 1, __ATOMIC_ACQ_REL) == total;
}

#define SKV_CPU_MAX_D 1024 /* lib/ rejects head_dim > 1024 */
#define SKV_CPU_RB 48      /* rebuild: rows per work item, 8 slivers of 6 */
#define SKV_CPU_BT 256     /* attention: tokens per work item */

static inline int skv_cpu_min(int a, int b) { return a < b ? a : b; }

/* 64-byte aligned scratch (no 32-byte loads split across cache lines); free(). */
void *skv_cpu_alloc(size_t bytes);

#if SKV_CPU_X86
/* ---- GEMM micro-kernels (skv_cpu_gemm.c) ---- */
SKV_CPU_AVX2 void skv_cpu_skern(int k, const float *a, const float *b, float *c, int64_t ldc);
SKV_CPU_AVX2 void skv_cpu_dkern(int64_t k, const double *a, const double *b, double *t);
SKV_CPU_AVX2 void skv_cpu_skern_rows(int64_t k, const float *const ar[6], const float *b, float *c);
SKV_CPU_AVX2 void skv_cpu_dkern_rows(int64_t k, const double *const ar[6], const double *b, double *t);
SKV_CPU_AVX512 void skv_cpu_zkern(int k, const float *a, const float *b, float *c, int64_t ldc);

/* ---- Gram matrices (skv_cpu_gram.c) ---- */
skv_status skv_cpu_gram(int64_t n, int32_t d, const skv_bf16 *a, double *g);
skv_status skv_cpu_fgram(int64_t n, int32_t d, const skv_bf16 *a, float scale, double *g);
int skv_cpu_amax_exp(const skv_bf16 *a, int64_t count);
void skv_cpu_mirror(double *g, int32_t d);
#endif

/* ---- factorization (skv_cpu_factor.c: the route and the EXACT route; skv_cpu_fast.c: FAST) ---- */
skv_status skv_cpu_factorize(skv_factorize_route mode, int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u,
                             float *w);
#if SKV_CPU_X86
/* The canonical route (skv_cpu_canon.c, lib/skv_factor_canon.h): bit for bit ref's. */
skv_status skv_cpu_factorize_canonical(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u, float *w);
skv_status skv_cpu_factorize_fast(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u, float *w,
                                  skv_factorize_route mode);
#endif

/* ---- RoPE (skv_cpu_rope.c) ---- */
void skv_cpu_to_f32(const skv_bf16 *in, float *out, int64_t n);
void skv_cpu_rope_row(const float *x, int D, int R, int interleaved, const float *cs, const float *sn,
                      skv_bf16 *out);
skv_status skv_cpu_rope(const skv_rope_config *rope, int32_t D, int64_t n_tokens, int32_t H, int64_t pos0,
                        const float *cos_tab, const float *sin_tab, const skv_bf16 *in, skv_bf16 *out);

/* ---- the other op slots ---- */
skv_status skv_cpu_landmarks_outliers(int32_t N, int32_t c, int32_t Hk, int32_t D, int32_t O,
                                      const skv_bf16 *k_post, int32_t *outlier_ids, int32_t *candidate_ids,
                                      skv_bf16 *landmarks);
skv_status skv_cpu_score_select(int32_t Hq, int32_t Hk, int32_t D, int32_t n_cand, int32_t S, float scale,
                                const skv_bf16 *q, const skv_bf16 *landmarks, const int32_t *candidate_ids,
                                int32_t *sel_idx, int32_t *sel_ids, float *amax, skv_ws *ws);
skv_status skv_cpu_rebuild_keys(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r, int32_t c,
                                int32_t S, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                                const int32_t *chunk_ids, const float *cos_tab, const float *sin_tab,
                                skv_bf16 *k_out, skv_ws *ws);
skv_status skv_cpu_sparse_attention(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                    int32_t n_spans, const skv_kv_span *spans, float *out, skv_ws *ws);
skv_status skv_cpu_full_attention(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                  int64_t n_tokens, const skv_bf16 *k, const skv_bf16 *v, float *out);

/* skv_ws_alloc bytes of one call of the decode slots for a cache's config (nt: its thread count). */
/* The reproducible mode's canonical rebuild and attention (skv_cpu_decode_canon.c). */
skv_status skv_cpu_rebuild_keys_canonical(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r, int32_t c,
                                          int32_t S, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                                          const int32_t *chunk_ids, const float *cos_tab, const float *sin_tab,
                                          skv_bf16 *k_out, skv_ws *ws);
skv_status skv_cpu_sparse_attention_canonical(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                              int32_t n_spans, const skv_kv_span *spans, float *out, skv_ws *ws);
size_t skv_cpu_canon_ws_bytes(const skv_config *cfg, int64_t max_tokens, int nt);
size_t skv_cpu_select_ws_bytes(const skv_config *cfg, int32_t cand_max);
size_t skv_cpu_rebuild_ws_bytes(const skv_config *cfg, int nt);
size_t skv_cpu_attn_ws_bytes(const skv_config *cfg, int64_t max_tokens, int nt);

#endif /* SKV_CPU_H */
