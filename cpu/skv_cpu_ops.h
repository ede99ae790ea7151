/*
 * skv_cpu_ops.h - the op slots of the cpu backend (AVX2/FMA chosen at run
 * time, its own helper threads, LAPACKE, OpenBLAS), private. cpu/skv_cpu.c
 * fills the dispatch table from ref's and overrides every op slot with the
 * functions declared here.
 *
 * Layers: a file includes headers of its own layer or below, never above,
 * and calls only what they declare (no circle).
 *   0 base     skv_cpu_base.h: skv_cpu_base.c (SIMD level, thread count, BLAS
 *              on the calling thread, scratch), skv_cpu_pool.c (the team that
 *              runs every parallel loop); skv_cpu_simd.h: AVX2 inline helpers.
 *   1 kernels  skv_cpu_kernels.h: skv_cpu_gemm.c (micro-kernels),
 *              skv_cpu_gram.c (Gram matrices), skv_cpu_rope.c (RoPE rows and
 *              the rope slot).
 *   2 ops      this header: skv_cpu_factor.c (the route; EXACT), skv_cpu_fast.c
 *              (FAST), skv_cpu_canon.c (canonical), skv_cpu_landmarks.c,
 *              skv_cpu_select.c, skv_cpu_rebuild.c, skv_cpu_attn.c,
 *              skv_cpu_decode_canon.c. Inside the layer only skv_cpu_factor.c
 *              calls others (the FAST and canonical routes).
 *   3 table    skv_cpu.c: skv_cpu_fill_ops (lib/skv_backend.h), and the slots
 *              that only move or check memory (check_finite, gather_values).
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
#ifndef SKV_CPU_OPS_H
#define SKV_CPU_OPS_H

#include "skv_cpu_base.h"
#include "skv_factor.h"

#define SKV_CPU_RB 48      /* rebuild: rows per work item, 8 slivers of 6 */
#define SKV_CPU_BT 256     /* attention: tokens per work item */

/* ---- factorization (skv_cpu_factor.c: the route and the EXACT route; skv_cpu_fast.c: FAST) ---- */
skv_status skv_cpu_factorize(skv_factorize_route mode, int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u,
                             float *w);
/* The canonical route (skv_cpu_canon.c, lib/skv_factor_canon.h): bit for bit ref's. */
skv_status skv_cpu_factorize_canonical(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u, float *w);
#if SKV_CPU_X86
skv_status skv_cpu_factorize_fast(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u, float *w,
                                  skv_factorize_route mode);
#endif

/* ---- the other op slots ---- */
skv_status skv_cpu_landmarks_outliers(int32_t N, int32_t c, int32_t Hk, int32_t D, int32_t O,
                                      const skv_bf16 *k_post, int32_t *outlier_ids, int32_t *candidate_ids,
                                      skv_bf16 *landmarks);
skv_status skv_cpu_score_select(int32_t Hq, int32_t Hk, int32_t D, int32_t n_cand, const skv_select_params *sp,
                                float scale, const skv_bf16 *q, const skv_bf16 *landmarks,
                                const int32_t *candidate_ids, int32_t *sel_idx, int32_t *sel_ids, float *amax,
                                int32_t *counts, skv_ws *ws);
skv_status skv_cpu_rebuild_keys(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r, int32_t c,
                                int32_t S, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                                const int32_t *chunk_ids, const int32_t *counts, const float *cos_tab,
                                const float *sin_tab, skv_bf16 *k_out, skv_ws *ws);
skv_status skv_cpu_sparse_attention(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                    int32_t n_spans, const skv_kv_span *spans, const int64_t *head_tokens,
                                    float *out, skv_ws *ws);
skv_status skv_cpu_full_attention(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                  int64_t n_tokens, const skv_bf16 *k, const skv_bf16 *v, float *out);

/* The reproducible mode's canonical rebuild and attention (skv_cpu_decode_canon.c). */
skv_status skv_cpu_rebuild_keys_canonical(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r, int32_t c,
                                          int32_t S, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                                          const int32_t *chunk_ids, const int32_t *counts, const float *cos_tab,
                                          const float *sin_tab, skv_bf16 *k_out, skv_ws *ws);
skv_status skv_cpu_sparse_attention_canonical(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                              int32_t n_spans, const skv_kv_span *spans, const int64_t *head_tokens,
                                              float *out, skv_ws *ws);

/* skv_ws_alloc bytes of one call of the decode slots for a cache's config (nt: its thread count). */
size_t skv_cpu_canon_ws_bytes(const skv_config *cfg, int64_t max_tokens, int nt);
size_t skv_cpu_select_ws_bytes(const skv_config *cfg, int32_t cand_max);
size_t skv_cpu_rebuild_ws_bytes(const skv_config *cfg, int32_t S, int nt);
size_t skv_cpu_attn_ws_bytes(const skv_config *cfg, int64_t max_attn_tokens, int nt);

#endif /* SKV_CPU_OPS_H */
