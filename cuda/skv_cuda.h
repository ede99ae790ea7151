/*
 * skv_cuda.h - internal interface of the cuda backend (private to cuda/).
 *
 * The backend is split in four files:
 *   skv_cuda_backend.cu  the dispatch table, memory, the cache's stream, device
 *                        state, prefill/decode orchestration, op-level slots
 *   skv_cuda_select.cu   the decision path: RoPE, landmarks/outliers, scores,
 *                        selection softmax, top-k (built with --fmad=false and
 *                        the shared numerics of lib/skv_numerics.h)
 *   skv_cuda_attn.cu     rebuild keys, gather values, attention, append,
 *                        input checks, small copies
 *   skv_cuda_factor.cu   the rank-r factorization (cuBLAS, cuSOLVER for the EXACT route, and
 *                        skv_cuda_chol.cuh for the r x r Cholesky and solve)
 *
 * Every launcher below only enqueues work on the given stream: it never
 * allocates, never synchronizes, and returns cudaGetLastError() of its launches
 * (cudaSuccess when there was nothing to do). All sizes are validated by lib/
 * before they get here; launchers need not re-check them. Index arithmetic
 * on token counts is 64-bit.
 *
 * Batched decode kernels take B per-sequence descriptors (skv_cuda_seq) in
 * device memory; their variable fields (n_gen, has_sel) are advanced on the
 * device by skv_cuda_append, so a decode step is a fixed launch sequence that
 * reads all per-step state from the device (and can be captured in a graph).
 * The op-level slots use the same kernels with B = 1.
 */
#ifndef SKV_CUDA_H
#define SKV_CUDA_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "skv_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One (layer, sequence) of a cache, as the decode kernels see it. */
typedef struct skv_cuda_seq {
    /* fixed at prefill */
    const skv_bf16 *landmarks; /* [Hk, n_cand, D] candidate landmarks */
    const int32_t *cand_ids;   /* [Hk, n_cand] chunk id of each candidate (NULL: no ids) */
    const skv_bf16 *u;         /* [n, r] */
    const skv_bf16 *w;         /* [r, Hk*D] */
    const skv_bf16 *vstore;    /* [Hk, n_cand, c, D] value store (device alias of pinned host memory) */
    const skv_bf16 *out_k, *out_v; /* [Hk, O*c, D] exact outlier chunks */
    const skv_bf16 *loc_k, *loc_v; /* [Hk, n_local, D] local window */
    skv_bf16 *gen_k, *gen_v;       /* [Hk, gen_cap, D] generated tokens */
    int32_t *pub_sel_idx, *pub_sel_ids; /* [Hk, S] selection published by the last good step */
    skv_bf16 *vkeep;           /* [2, Hk, S*c, D]: values gathered at the steps with even / odd n_gen
                                  (NULL: no reuse, op-level calls) */
    int64_t n;                 /* prompt length */
    int32_t n_cand;            /* N - O */
    int32_t n_local;
    /* advanced by skv_cuda_append */
    int32_t n_gen;
    int32_t has_sel;
} skv_cuda_seq;

/* Shape constants shared by the batched kernels (passed by value). */
typedef struct skv_cuda_shape {
    int32_t B, Hq, Hk, D;
    int32_t c, S, r, O;
    int32_t gen_cap;     /* row count of gen_k/gen_v per head */
    int32_t cand_max;    /* row stride (elements) of the scores/amax scratch */
    int32_t rotary_dim;  /* resolved (never 0) */
    int32_t interleaved;
    float scale;         /* resolved softmax scale */
    const float *cos_tab, *sin_tab; /* device RoPE tables, rotary_dim/2 floats per position */
} skv_cuda_shape;

/* ---- decision path (skv_cuda_select.cu, --fmad=false) ------------------------------------ */

/* out = RoPE(in) for [n_tokens, n_heads, head_dim] at positions pos0.. (skv_rope_row_f32).
   in == out allowed. */
cudaError_t skv_cuda_rope(cudaStream_t st, int32_t head_dim, int32_t rotary_dim, int32_t interleaved,
                          int64_t n_tokens, int32_t n_heads, int64_t pos0, const float *cos_tab,
                          const float *sin_tab, const skv_bf16 *in, skv_bf16 *out);

/* Scratch bytes skv_cuda_landmarks_outliers needs for N chunks. */
size_t skv_cuda_landmarks_scratch_bytes(int32_t n_chunks, int32_t n_kv_heads, int32_t head_dim);

/* As ref's landmarks_outliers (same layouts as skv_op_landmarks_outliers), bit-identical. */
cudaError_t skv_cuda_landmarks_outliers(cudaStream_t st, int32_t n_chunks, int32_t chunk, int32_t n_kv_heads,
                                        int32_t head_dim, int32_t n_outliers, const skv_bf16 *k_post,
                                        int32_t *outlier_ids, int32_t *candidate_ids, skv_bf16 *landmarks,
                                        void *scratch);

/* scores[b][qh][j] (row stride cand_max) = SKV_MUL(skv_dot_bf16(q[b][qh], landmarks_b[qh/G][j]), scale)
   for j < seqs[b].n_cand. q [B, Hq, D]. */
cudaError_t skv_cuda_score(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                           const skv_bf16 *q, float *scores);

/* Per (b, kv head): selection softmax of each query head of the group, group max a_j (ref's
   order), top-S by (skv_select_key desc, index asc), in increasing index order:
   sel_idx [B, Hk, S]; sel_ids [B, Hk, S] = cand_ids[sel_idx] (skipped when NULL or
   seqs[b].cand_ids is NULL). amax [B, Hk, cand_max] is required: it is the top-k key store
   and holds a_j on return (NULL gives cudaErrorInvalidValue). scores is scratch: it comes
   back holding the probabilities p_j (the softmax runs in place, one block per query head). */
cudaError_t skv_cuda_select(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                            float *scores, float *amax, int32_t *sel_idx, int32_t *sel_ids);

/* ---- sparse path (skv_cuda_attn.cu) ------------------------------------------------------- */

/* k_sel [B, Hk, S*c, D]: row (h, s*c + i) = RoPE(U[t] W_h) at t = sel_ids[b][h][s]*c + i. */
cudaError_t skv_cuda_rebuild(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                             const int32_t *sel_ids, skv_bf16 *k_sel);

/* v_sel [B, Hk, S*c, D]: chunk s of head h = vstore[h][sel_idx[b][h][s]] (c*D values).
   With seqs[b].vkeep: a chunk that the published selection (pub_sel_idx, when has_sel) also
   holds is copied from vkeep[(n_gen & 1) ^ 1] on the device instead of read over PCIe, and
   every chunk is also written to vkeep[n_gen & 1] for the next step. Same values either way. */
cudaError_t skv_cuda_gather(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                            const int32_t *sel_idx, skv_bf16 *v_sel);

/* Workspace bytes of the attention launchers for calls of at most max_tokens tokens. */
size_t skv_cuda_attention_ws_bytes(int32_t B, int32_t Hq, int32_t Hk, int32_t D, int64_t max_tokens);

/* Decode attention of q [B, Hq, D] per sequence over: outliers (O*c tokens), local window
   (n_local), selected (k_sel/v_sel, S*c), generated (n_gen), the new token (k_new/v_new
   [B, Hk, D]). out [B, Hq, D] float. */
cudaError_t skv_cuda_decode_attention(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                      const skv_bf16 *q, const skv_bf16 *k_sel, const skv_bf16 *v_sel,
                                      const skv_bf16 *k_new, const skv_bf16 *v_new, float *out, void *ws,
                                      size_t ws_bytes);

/* Op-level attention over caller spans (device pointers; spans passed by value). */
cudaError_t skv_cuda_span_attention(cudaStream_t st, int32_t Hq, int32_t Hk, int32_t D, float scale,
                                    const skv_bf16 *q, int32_t n_spans, const skv_kv_span *spans, float *out,
                                    void *ws, size_t ws_bytes);

/* Counts non-finite values of q [B,Hq,D], k, v [B,Hk,D] into *step_bad (zeroed by the caller
   with cudaMemsetAsync) and records the first one in *first_bad (atomicMin of
   ((uint64)layer << 48) | ((uint64)tensor << 40) | flat index, tensor 0 q, 1 k, 2 v). */
cudaError_t skv_cuda_check_step(cudaStream_t st, int32_t B, int32_t Hq, int32_t Hk, int32_t D, int32_t layer,
                                const skv_bf16 *q, const skv_bf16 *k, const skv_bf16 *v, int32_t *step_bad,
                                unsigned long long *first_bad);

/* If *step_bad == 0: per b, appends k_new/v_new [B, Hk, D] at gen row n_gen, copies the step's
   selection (sel_idx/sel_ids [B, Hk, S]) to pub_sel_idx/pub_sel_ids, then n_gen++, has_sel = 1.
   Otherwise changes nothing. One block per sequence. */
cudaError_t skv_cuda_append(cudaStream_t st, const skv_cuda_shape *sh, skv_cuda_seq *seqs,
                            const skv_bf16 *k_new, const skv_bf16 *v_new, const int32_t *sel_idx,
                            const int32_t *sel_ids, const int32_t *step_bad);

/* *first_bad = min(*first_bad, logical index of the first non-finite element) of a strided
   [n_a, n_b, len] bf16 tensor: element (i, j, l) at x[i*s_a + j*s_b + l], logical index
   (i*n_b + j)*len + l. The caller initializes *first_bad to ~0ull. */
cudaError_t skv_cuda_find_nonfinite(cudaStream_t st, const skv_bf16 *x, int64_t n_a, int64_t s_a, int64_t n_b,
                                    int64_t s_b, int64_t len, unsigned long long *first_bad);

/* *first_bad = min(*first_bad, first i with x[i] < lo or x[i] >= hi), x [n] int32. */
cudaError_t skv_cuda_find_out_of_range(cudaStream_t st, const int32_t *x, int64_t n, int64_t lo, int64_t hi,
                                       unsigned long long *first_bad);

/* y[i] = skv_f32_to_bf16(x[i]). */
cudaError_t skv_cuda_f32_to_bf16(cudaStream_t st, const float *x, skv_bf16 *y, int64_t n);

/* Prefill offload: dst [Hk, m, c, D], chunk (h, i) = tokens ids[h*m + i]*c .. +c-1 of head h of
   src [n, Hk, D] (token-major). dst may be mapped pinned host memory. At most max_blocks
   blocks (<= 0: as many as the work needs, up to 65535). */
cudaError_t skv_cuda_gather_chunks(cudaStream_t st, const skv_bf16 *src, int32_t Hk, int32_t D, int32_t c,
                                   const int32_t *ids, int32_t m, skv_bf16 *dst, int32_t max_blocks);

/* ---- factorization (skv_cuda_factor.cu) --------------------------------------------------- */

typedef struct skv_cuda_factor skv_cuda_factor;

/* Device bytes of a factorization workspace for up to n_max rows (excluding the cuSOLVER
   workspace, which is queried at create). */
size_t skv_cuda_factor_bytes(int64_t n_max, int32_t d, int32_t r);

/* Handles and workspace for up to n_max rows of width d, rank r, bound to stream st.
   SKV_ERR_OUT_OF_MEMORY / SKV_ERR_NO_DEVICE with a message. */
skv_status skv_cuda_factor_create(skv_cuda_factor **f, int64_t n_max, int32_t d, int32_t r, cudaStream_t st,
                                  char *msg, size_t cap);
void skv_cuda_factor_destroy(skv_cuda_factor *f);

/*
 * a [n, d] bf16 (device) -> u [n, r], w [r, d] float (device), U W ~ the best rank-r
 * approximation (DESIGN.md section 6; the routes of lib/skv_factor.h), on the factor's
 * stream. 1 <= r <= min(n, d), n <= n_max. sync = 0: asynchronous on the FAST route (no
 * host synchronization, no allocation; the EXACT route's Xsyevd synchronizes with the
 * host); a failed solver call is counted on the device under
 * tag (see skv_cuda_factor_counts). sync = 1: synchronizes the stream and returns
 * SKV_ERR_NUMERICAL with a message if a solver call failed. a must stay unchanged until
 * the stream has run the call.
 */
skv_status skv_cuda_factorize(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, float *u, float *w,
                              unsigned long long tag, int sync, char *msg, size_t cap);

/* Synchronizes the factor's stream and reads its counters since create: calls with a
   failed solver step, and the tag of the first such call (~0 if none). */
skv_status skv_cuda_factor_counts(skv_cuda_factor *f, unsigned long long *failures,
                                  unsigned long long *first_failure_tag, char *msg, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* SKV_CUDA_H */
