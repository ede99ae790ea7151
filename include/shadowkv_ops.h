/*
 * shadowkv_ops.h - the op-level calls of libshadowkv: one function per dispatch slot of a backend,
 * with the backend named explicitly, for kernel developers who check their kernels against ref on
 * the same inputs. Included by shadowkv.h; include that one.
 */
#ifndef SHADOWKV_OPS_H
#define SHADOWKV_OPS_H

#include "shadowkv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Op-level API: one function per dispatch slot, explicit backend.          */
/* Kernel developers run SKV_BACKEND_REF on the same inputs as their kernel.*/
/* SKV_BACKEND_AUTO resolves as in skv_cache_create (env SKV_BACKEND is not */
/* consulted here). Outputs are fully written on SKV_OK and untouched on an */
/* argument error.                                                          */
/* ------------------------------------------------------------------------ */

/*
 * The input bound of the op-level calls. skv_op_factorize(_route),
 * skv_op_sparse_attention(_canonical) and skv_op_full_attention refuse what
 * skv_prefill and skv_decode refuse: on ref and cpu NaN, Inf and
 * |x| > SKV_MAX_INPUT_MAGNITUDE (SKV_ERR_NONFINITE; the message names the
 * argument, the element and, for a finite one, its value and the limit), on
 * cuda NaN and Inf. What they accept cannot overflow: their outputs are finite
 * (attention: for a scale with scale * head_dim * 2^64 below FLT_MAX). skv_op_rope,
 * skv_op_landmarks_outliers, skv_op_score_select and skv_op_rebuild_keys refuse
 * NaN and Inf only; beyond SKV_MAX_INPUT_MAGNITUDE they compute in float as
 * given, and their outputs may hold Inf or NaN where that overflows.
 */

/**
 * Number of floats in each of the cos and sin tables for n_positions
 * positions: n_positions * R/2, R the rotary dim. 0 on invalid input.
 */
SKV_API size_t skv_rope_table_len(const skv_rope_config *rope, int32_t head_dim, int64_t n_positions);

/**
 * Builds RoPE tables on the host, in double rounded to float:
 * cos_tab[p*R/2 + i] = cos(p * f_i), sin_tab likewise, for p < n_positions,
 * f_i = theta^(-2i/R) (Llama-3 scaled if enabled). Every backend uses these.
 */
SKV_API skv_status skv_rope_table_build(const skv_rope_config *rope, int32_t head_dim, int64_t n_positions,
                                float *cos_tab, float *sin_tab);

/**
 * Rank-r factorization of a [n, d] (bf16): U [n, r] and W [r, d] (float) with
 * U W close to the best rank-r approximation (docs/DESIGN.md section 6). Compare
 * backends on the product U W only. Requires 1 <= r <= min(n, d) and
 * n <= 2^31 (anything larger is refused with SKV_ERR_INVALID_ARGUMENT);
 * NaN, Inf or (ref, cpu) |a| > SKV_MAX_INPUT_MAGNITUDE is refused with
 * SKV_ERR_NONFINITE before any work; on SKV_OK u and w are finite. Routes (docs/usage.md, "The key
 * factorization"): ref the double Gram + dsyevr; cpu and cuda a subspace
 * iteration on the Gram matrix with an automatic double-Gram fallback, or
 * the Gram + eigensolver route for shapes it does not take (SKV_FACTORIZE_AUTO;
 * skv_op_factorize_route picks another route).
 * cuda keeps one workspace per process for these calls (rebuilt for a larger
 * n or another shape), so repeated calls run warm; skv_op_release frees it.
 * Errors: SKV_ERR_INVALID_ARGUMENT, SKV_ERR_NONFINITE, SKV_ERR_NUMERICAL,
 * SKV_ERR_OUT_OF_MEMORY.
 */
SKV_API skv_status skv_op_factorize(skv_backend backend, int64_t n, int32_t d, int32_t r,
                            const skv_bf16 *a, float *u, float *w);

/**
 * skv_op_factorize with an explicit route (skv_factorize_route; ref has one route and
 * ignores it). A route value outside the enum is SKV_ERR_INVALID_ARGUMENT.
 */
SKV_API skv_status skv_op_factorize_route(skv_backend backend, skv_factorize_route route, int64_t n, int32_t d,
                                          int32_t r, const skv_bf16 *a, float *u, float *w);

/**
 * Frees what op-level calls keep between calls: on cuda, the factorization
 * workspace of skv_op_factorize (device buffers, cuBLAS/cuSOLVER handles).
 * The next op-level call builds it again. Call it when done with op-level
 * calls, before exit if a leak checker watches device memory; the library
 * registers no exit handler. Safe from any thread; never fails.
 */
SKV_API void skv_op_release(void);

/**
 * RoPE of n_tokens tokens at positions pos0..pos0+n_tokens-1:
 * in/out [n_tokens, n_heads, head_dim] bf16 (rotated in float, rounded once).
 * Tables from skv_rope_table_build with at least pos0 + n_tokens positions.
 * in == out is allowed.
 */
SKV_API skv_status skv_op_rope(skv_backend backend, const skv_rope_config *rope, int32_t head_dim,
                       int64_t n_tokens, int32_t n_heads, int64_t pos0, const float *cos_tab,
                       const float *sin_tab, const skv_bf16 *in, skv_bf16 *out);

/**
 * Landmarks and outliers of N context chunks of c tokens.
 *  k_post        [N*c, Hk, D]  post-RoPE keys (token-major, as prefill gets them)
 *  outlier_ids   [Hk, O]       the O lowest-scoring chunks per head, increasing
 *  candidate_ids [Hk, N-O]     the others, increasing
 *  landmarks     [Hk, N-O, D]  bf16 landmarks of the candidates, in candidate order
 * Requires 0 <= O < N.
 */
SKV_API skv_status skv_op_landmarks_outliers(skv_backend backend, int32_t n_chunks, int32_t chunk,
                                     int32_t n_kv_heads, int32_t head_dim, int32_t n_outliers,
                                     const skv_bf16 *k_post, int32_t *outlier_ids,
                                     int32_t *candidate_ids, skv_bf16 *landmarks);

/**
 * Scores candidates against one token's queries and selects S per KV head.
 *  q             [Hq, D]          post-RoPE queries
 *  landmarks     [Hk, n_cand, D]  bf16
 *  candidate_ids [Hk, n_cand]     chunk ids, or NULL
 *  sel_idx       [Hk, S]          selected candidate indices, increasing
 *  sel_ids       [Hk, S]          candidate_ids[sel_idx], or NULL (needs candidate_ids)
 *  amax          [Hk, n_cand]     max over the group of softmax probabilities, or NULL
 * Requires 1 <= S <= n_cand. scale as config.attn_scale (0 = 1/sqrt(D)).
 */
SKV_API skv_status skv_op_score_select(skv_backend backend, int32_t n_q_heads, int32_t n_kv_heads,
                               int32_t head_dim, int32_t n_cand, int32_t n_select, float scale,
                               const skv_bf16 *q, const skv_bf16 *landmarks,
                               const int32_t *candidate_ids, int32_t *sel_idx, int32_t *sel_ids,
                               float *amax);

/**
 * skv_op_score_select with the count of SKV_SELECT_MASS (docs/DESIGN.md section 4.5):
 * per KV head h, the fewest of the min(n_select, n_cand) best candidates whose
 * group-max probabilities reach select_mass of their total, at least
 * min(select_min_chunks, n_select, n_cand): k_h into counts[h], the k_h candidate
 * indices (increasing) into sel_idx[h*n_select .. +k_h) and -1 into the rest of the row;
 * sel_ids likewise. The same on every backend, bit for bit. Requires n_select >= 1,
 * select_mass in (0, 1], 0 <= select_min_chunks <= n_select; counts [Hk] non-NULL.
 */
SKV_API skv_status skv_op_score_select_mass(skv_backend backend, int32_t n_q_heads, int32_t n_kv_heads,
                                            int32_t head_dim, int32_t n_cand, int32_t n_select, float select_mass,
                                            int32_t select_min_chunks, float scale, const skv_bf16 *q,
                                            const skv_bf16 *landmarks, const int32_t *candidate_ids,
                                            int32_t *sel_idx, int32_t *sel_ids, float *amax, int32_t *counts);

/**
 * Rebuilds post-RoPE keys of selected chunks from the factorization.
 *  u        [n, r] bf16, w [r, Hk*D] bf16 (n >= (max chunk id + 1) * c)
 *  chunk_ids[Hk, S]            chunk id j: tokens j*c .. j*c+c-1 at those positions
 *  k_out    [Hk, S*c, D] bf16  k = RoPE(U[t] W_h), float accumulate, rounded once
 */
SKV_API skv_status skv_op_rebuild_keys(skv_backend backend, const skv_rope_config *rope,
                               int32_t head_dim, int32_t n_kv_heads, int32_t rank, int32_t chunk,
                               int32_t n_select, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                               const int32_t *chunk_ids, const float *cos_tab,
                               const float *sin_tab, skv_bf16 *k_out);

/**
 * skv_op_rebuild_keys by the canonical rule of the reproducible mode
 * (docs/DESIGN.md section 10): U rows and W_h columns rounded to 13-bit fixed
 * point against their largest element, their products summed exactly, the sum
 * rounded once to float, then RoPE as above. k_out is bitwise equal on every
 * backend. Same arguments and errors as skv_op_rebuild_keys.
 */
SKV_API skv_status skv_op_rebuild_keys_canonical(skv_backend backend, const skv_rope_config *rope,
                                                 int32_t head_dim, int32_t n_kv_heads, int32_t rank,
                                                 int32_t chunk, int32_t n_select, int64_t n, const skv_bf16 *u,
                                                 const skv_bf16 *w, const int32_t *chunk_ids,
                                                 const float *cos_tab, const float *sin_tab, skv_bf16 *k_out);

/**
 * Gathers value chunks from a store.
 *  store [Hk, n_store, c, D] bf16, idx [Hk, S] (0 <= idx < n_store),
 *  v_out [Hk, S*c, D].
 */
SKV_API skv_status skv_op_gather_values(skv_backend backend, int32_t n_kv_heads, int32_t head_dim,
                                int32_t chunk, int32_t n_store, int32_t n_select,
                                const skv_bf16 *store, const int32_t *idx, skv_bf16 *v_out);

/** A span of keys/values for skv_op_sparse_attention. */
typedef struct skv_kv_span {
    const skv_bf16 *k;     /**< key of (token t, head h) at k[h*head_stride + t*token_stride] */
    const skv_bf16 *v;     /**< value, same layout */
    int64_t n_tokens;      /**< may be 0 (then k, v may be NULL) */
    int64_t head_stride;   /**< elements between KV heads */
    int64_t token_stride;  /**< elements between tokens */
} skv_kv_span;

/** Most spans one attention call takes. */
#define SKV_MAX_SPANS 16

/**
 * Attention of one token's queries q [Hq, D] over the union of spans
 * (float accumulation, stable softmax), GQA: query head i uses KV head
 * i / (Hq/Hk). out [Hq, D] float. At least one token in total.
 * Errors: SKV_ERR_NULL_POINTER, SKV_ERR_INVALID_ARGUMENT, SKV_ERR_NONFINITE
 * (NaN, Inf or, on ref and cpu, |x| > SKV_MAX_INPUT_MAGNITUDE in q or in an
 * element a span reads; the message names q or the span, token, head and
 * element), SKV_ERR_OUT_OF_MEMORY. out is untouched on error.
 */
SKV_API skv_status skv_op_sparse_attention(skv_backend backend, int32_t n_q_heads, int32_t n_kv_heads,
                                   int32_t head_dim, float scale, const skv_bf16 *q,
                                   int32_t n_spans, const skv_kv_span *spans, float *out);

/**
 * skv_op_sparse_attention by the canonical rule of the reproducible mode
 * (docs/DESIGN.md section 10): the tokens in span order, scores by the fmaf dot
 * of the selection, skv_expf weights, and the softmax sum and every output
 * dimension's P.V sum as the 256-lane canonical sum. out is bitwise equal on
 * every backend. Same arguments and errors as skv_op_sparse_attention.
 */
SKV_API skv_status skv_op_sparse_attention_canonical(skv_backend backend, int32_t n_q_heads,
                                                     int32_t n_kv_heads, int32_t head_dim, float scale,
                                                     const skv_bf16 *q, int32_t n_spans,
                                                     const skv_kv_span *spans, float *out);

/**
 * Dense attention of q [Hq, D] over n_tokens keys/values [n_tokens, Hk, D]
 * (the prompt layout). out [Hq, D] float. The baseline sparse decode is
 * compared against. Errors as skv_op_sparse_attention (NONFINITE names q, k
 * or v and the flat index).
 */
SKV_API skv_status skv_op_full_attention(skv_backend backend, int32_t n_q_heads, int32_t n_kv_heads,
                                 int32_t head_dim, float scale, const skv_bf16 *q,
                                 int64_t n_tokens, const skv_bf16 *k, const skv_bf16 *v,
                                 float *out);

#ifdef __cplusplus
}
#endif

#endif /* SHADOWKV_OPS_H */
