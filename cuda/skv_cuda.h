/*
 * skv_cuda.h - internal interface of the cuda backend (private to cuda/).
 *
 *   skv_cuda_backend.cu    the dispatch table (skv_cuda_fill_ops) and the
 *                          infrastructure slots: probe, memory, copy2d, the input
 *                          checks' wrappers; skv_cuda_err
 *   skv_cuda_ops.cu        the op-level slots (B = 1, legacy stream, synchronous):
 *                          wrappers of the launchers below
 *   skv_cuda_cache.cu      the cache pipeline: open, close, a decode step's launch
 *                          sequence, its graph capture and replay, sync (the layers'
 *                          counters), set_states
 *   skv_cuda_prefill.cu    a cache's prefill (a dense layer's too), on its own
 *                          stream beside the decode's
 *   skv_cuda_serve.cu      the serving slots: a step's active list (host or device),
 *                          release, seq_ready, the deferred bad-list error
 *   skv_cuda_cache.h       the cache's state those three files share
 *   skv_cuda_green.cu      the prefill's partition (config.cuda_prefill_sms): a green
 *                          context over part of the SMs, its streams and events
 *   skv_cuda_active.cu     a step's rows from its list (and the device list's
 *                          check), the descriptors' writes at prefill and release
 *   skv_cuda_workspace.cu  the decode workspace's layout, the cache's shapes (a
 *                          sparse and a dense layer's) and their attention items
 *   the decision path, built with --fmad=false and the shared numerics of
 *   lib/skv_numerics.h (skv_cuda_exact.cuh states the rule):
 *   skv_cuda_rope.cu       RoPE of prefill keys
 *   skv_cuda_landmarks.cu  landmarks and outliers at prefill
 *   skv_cuda_score.cu      decode step 1: landmark scores, their max, the step's
 *                          input check
 *   skv_cuda_select.cu     decode steps 2 and 3 (split or fused): e_j and Z, top-S,
 *                          the chunk cache's plan; skv_cuda_select_step runs 1-3
 *                          (skv_cuda_select_candidates: the rescoring's first stage)
 *   skv_cuda_select.cuh    what the selection kernels share (the mass rule's count,
 *                          select_finish)
 *   skv_cuda_rescore.cu    the rescoring (docs/DESIGN.md 4.5.1): the chunk masses of
 *                          the candidates' canonical keys, the rule among them
 *                          (skv_cuda_rescore_step runs the whole selection)
 *   skv_cuda_exact.cuh     what those files share (grid cap, bf16 row loads,
 *                          the group limit)
 *   skv_cuda_topk.cuh      the exact block top-k (outliers, selection, victims)
 *   the attention:
 *   skv_cuda_attn.cuh      what the attention files share: work items, the
 *                          shared-memory layout, the key rebuild of one tile,
 *                          AttendArgs and the resident spans
 *   skv_cuda_attend.cu     step 4 (attend_kernel; the common shape, D 128, G <= 8,
 *                          r % 16 == 0, rotate-half RoPE: attend_mma_kernel),
 *                          the op-level span attention and key rebuild
 *                          (rebuild_kernel), the item plans
 *   skv_cuda_attend_missed.cu  the pass for chunks fetched late (host slots)
 *   skv_cuda_fp8.cuh       fp8 value records on the device (config.value_dtype): the
 *                          exact decode of codes to bf16 the attention kernels use
 *   skv_cuda_combine.cu  the combine of the partials and the append (step 5)
 *   skv_cuda_copy.cu     the fetch of missed chunks, the op-level gather, the
 *                        prefill's value offload, f32 -> bf16
 *   skv_cuda_check.cu    input checks: non-finite values, out-of-range ids
 *   skv_cuda_canon_attn.cuh  what the reproducible mode's rebuild and attention
 *                        files share (arguments, spans, fixed point, scoring)
 *   skv_cuda_canon_wprep.cu  W's prepared form (fixed-point mma fragments)
 *   skv_cuda_canon_rebuild.cu  the canonical key rebuild (op level; decode:
 *                        with the selected keys' scores) and its split test hook
 *   skv_cuda_canon_resident.cu  the canonical scores of the resident tokens
 *   skv_cuda_canon_attend.cu  the canonical attention (weights, P V; op level:
 *                        also the scores); the canon files build with --fmad=false
 *   skv_cuda_factor.cuh  the factorization's workspace, shared by its files:
 *   skv_cuda_factor.cu   create / destroy, skv_cuda_factorize (picks the route)
 *   skv_cuda_factor_gram.cu  the blocked Gram of FAST and EXACT
 *   skv_cuda_factor_fast.cu  the FAST route (skv_cuda_chol.cuh: its r x r
 *                        Cholesky and solve)
 *   skv_cuda_factor_exact.cu  the EXACT route (cuSOLVER Xsyevd)
 *   skv_cuda_factor_rank.cu  config.rank == 0: the slot's rank from the factors at
 *                        rank_max, their columns ordered by energy (on the device)
 *   skv_cuda_factor_canon.cu  the CANONICAL route; its kernels and plans:
 *     skv_cuda_canon_i8.h, skv_cuda_canon_i8.cuh  the exact int8 Gram
 *     skv_cuda_canon_mm.cuh    the fixed-order fp64 GEMMs (G X, Y^T Y)
 *     skv_cuda_canon_chol.cuh  the fast Cholesky and solve
 *     skv_cuda_canon_fix.cuh   the fixed point of A and U's scaling
 *   skv_cuda_common.cuh  small device and launch helpers every .cu file shares
 *   skv_cuda_plugin.c    the plugin's entry point (skv_cuda_plugin_init) and its
 *                        test hook (skv_cuda_test_rebuild_split): these
 *                        files build libshadowkv-cuda.so.0, which the library
 *                        opens at run time (lib/skv_cuda_loader.c)
 *
 * A decode step is a fixed launch sequence that reads all per-step state from
 * the device (so it can be captured in a graph):
 *   0 rows     the step's rows from its active list (skv_cuda_act_rows): row i
 *              is the i-th listed sequence's descriptor (the whole batch: the
 *              list 0..B-1), the rows past the count idle; a device list is
 *              read and checked here. Every later kernel takes the whole batch's
 *              grid and skips idle rows (skv_cuda_seq.idle); io rows and the
 *              per-step workspace are indexed by row, the per-slot state through
 *              the row's descriptor
 *   1 score    landmark scores of every candidate, their max per query head,
 *              the step's input check
 *   2 expsum   e_j = skv_expf(s_j - M) in place; the last block of each query
 *              head adds them canonically (Z)
 *   3 select   a_j, the top-S per tile of candidates; the last tile of each
 *              (sequence, KV head) merges the tiles' winners, takes the head's
 *              count k (cap = min(S, n_cand): the fixed mode's, or SKV_SELECT_MASS's
 *              mass rule: A by the canonical sum, the best candidates walked in
 *              order in batches of 2048 ranks, one thread adding their masses),
 *              publishes the selection (-1 past k) and the count and, for a
 *              host-placed slot, runs the chunk cache's rule (skv_plan.h) on the
 *              k chunks: hits, misses, the entries they replace
 *   (2+3 fused: with at most 32768 candidates and enough (sequence, KV head)
 *    pairs to fill the GPU, one CTA per pair does both, with the same
 *    arithmetic: 4 kernels per step)
 *   4 attend   per (sequence, KV head) work items: a tile of selected tokens
 *              (keys rebuilt from U W and roped on chip, never written back)
 *              or a range of the resident spans; each writes a partial
 *              softmax (max, sum, unnormalized P V). The common shape (D 128,
 *              G <= 8, r % 16 == 0, rotate-half RoPE) runs a kernel that keeps
 *              W_h in shared memory and every product in mma fragments
 *   5 combine  the partials of each query head in item order -> out; the new
 *              token is appended, the sequence marked as having a selection, and
 *              the layer's counters (skv_layer_stats) advanced on the device
 * With the rescoring (config.select_candidates, shape W > 0; skv_cuda_rescore_step)
 * steps 1-3 select the W landmark-best candidates instead (the fixed rule, cap
 * W, nothing published), then
 *   3a keys    the canonical rebuild of their tokens' keys (docs/DESIGN.md 10.2)
 *   3b rescore per (sequence, KV head): the candidates' chunk masses under the
 *              group's softmax over their tokens, the mode's rule among them, and
 *              the selection, the counts and the chunk cache's plan as step 3's
 * Step 4's selected items past a head's k c tokens are empty partials (the
 * reproducible mode's rebuild and attention likewise take k c tokens per head;
 * its score rows keep room for S c, the tokens after a head's selected ones
 * sitting (S - k) c further on). A dense layer (config.dense_layers) runs step 1
 * with no candidates (the input check and the publication of the step's tensors),
 * no steps 2-3, and step 4 over its resident spans, the prompt being its local
 * window (skv_cuda_cache.cu's dense shape and items).
 * Host-placed slots add, on a side stream, the fetch of the missed chunks into
 * the chunk cache (it runs while step 4 attends everything else) and a short
 * pass that adds the missed chunks' P V once they arrived. Steps 2-5 use
 * programmatic dependent launch.
 *
 * Every launcher only enqueues work on the given stream: it never allocates,
 * never synchronizes, and returns the status of its launches. Sizes are
 * validated by lib/ before they get here. Index arithmetic on token counts is
 * 64-bit.
 */
#ifndef SKV_CUDA_H
#define SKV_CUDA_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "skv_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records a failure detail for the library's message (skv_cuda_plugin.c forwards it
   to the library's skv_backend_note through the loader's services). */
void skv_cuda_note(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
/* Fills the cuda dispatch table (skv_cuda_backend.cu). */
void skv_cuda_fill_ops(struct skv_backend_ops *ops);

/* ---- the backend's host files (skv_cuda_backend.cu, skv_cuda_ops.cu, skv_cuda_cache.cu) ---- */

/* A failed CUDA call as a status: SKV_ERR_OUT_OF_MEMORY or SKV_ERR_DEVICE, with a message in
   msg (NULL: none) and for the library (skv_cuda_note); the error is cleared
   (skv_cuda_backend.cu). */
skv_status skv_cuda_err(cudaError_t e, const char *what, char *msg, size_t cap);

/* Returns from the enclosing function with a status when a CUDA call fails (msg and cap in scope). */
#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) return skv_cuda_err(e_, #call, msg, cap);                           \
    } while (0)

/* The op-level slots (skv_cuda_ops.cu), as struct skv_backend_ops declares them. */
void skv_cuda_op_release(void);
skv_status skv_cuda_factorize_op(skv_factorize_route route, int64_t n, int32_t d, int32_t r, const skv_bf16 *a,
                                 float *u, float *w);
skv_status skv_cuda_rope_op(const skv_rope_config *rope, int32_t D, int64_t n_tokens, int32_t n_heads,
                            int64_t pos0, const float *cos_tab, const float *sin_tab, const skv_bf16 *in,
                            skv_bf16 *out);
skv_status skv_cuda_landmarks_op(int32_t N, int32_t c, int32_t Hk, int32_t D, int32_t O,
                                 const skv_bf16 *k_post, int32_t *outlier_ids, int32_t *candidate_ids,
                                 skv_bf16 *landmarks);
skv_status skv_cuda_score_select_op(int32_t Hq, int32_t Hk, int32_t D, int32_t n_cand, const skv_select_params *sp,
                                    float scale, const skv_bf16 *q, const skv_bf16 *landmarks,
                                    const int32_t *candidate_ids, int32_t *sel_idx, int32_t *sel_ids,
                                    float *amax, int32_t *counts, skv_ws *ws);
/* counts / head_tokens non-NULL (lib/'s per-sequence decode, which a cuda cache never takes):
   SKV_ERR_UNSUPPORTED with a note. */
skv_status skv_cuda_rebuild_op(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r, int32_t c,
                               int32_t S, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                               const int32_t *chunk_ids, const int32_t *counts, const float *cos_tab,
                               const float *sin_tab, skv_bf16 *k_out, skv_ws *ws);
skv_status skv_cuda_rebuild_canonical_op(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r,
                                         int32_t c, int32_t S, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                                         const int32_t *chunk_ids, const int32_t *counts, const float *cos_tab,
                                         const float *sin_tab, skv_bf16 *k_out, skv_ws *ws);
skv_status skv_cuda_sparse_attention_canonical_op(int32_t Hq, int32_t Hk, int32_t D, float scale,
                                                  const skv_bf16 *q, int32_t n_spans, const skv_kv_span *spans,
                                                  const int64_t *head_tokens, float *out, skv_ws *ws);
skv_status skv_cuda_gather_op(int32_t Hk, int32_t D, int32_t c, int32_t n_store, int32_t S, int32_t value_dtype,
                              const void *store, const int32_t *idx, const int32_t *counts, skv_bf16 *v_out);
skv_status skv_cuda_sparse_attention_op(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                        int32_t n_spans, const skv_kv_span *spans, const int64_t *head_tokens,
                                        float *out, skv_ws *ws);
skv_status skv_cuda_full_attention_op(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                      int64_t n_tokens, const skv_bf16 *k, const skv_bf16 *v, float *out);

/* The cache's slots (skv_cuda_cache.cu), as struct skv_backend_ops declares them. */
size_t skv_cuda_cache_bytes(const skv_config *cfg, const skv_layout *lay);
void skv_cuda_cache_close(void *bctx);
skv_status skv_cuda_cache_open(void **bctx, const skv_config *cfg, const skv_layout *lay, char *dev,
                               char *host, char *msg, size_t cap);
skv_status skv_cuda_cache_prefill(void *bctx, int32_t layer, int32_t seq, int64_t n, int32_t N,
                                  const skv_slot_mem *mem, const skv_bf16 *k_pre, const skv_bf16 *v,
                                  const skv_bf16 *k_post, skv_stats *stats, char *msg, size_t cap);
skv_status skv_cuda_cache_decode(void *bctx, int32_t layer, int32_t n_active, const int32_t *seqs,
                                 const int32_t *dev_count, const int32_t *dev_seqs, const skv_bf16 *q,
                                 const skv_bf16 *kn, const skv_bf16 *vn, float *out, char *msg, size_t cap);
skv_status skv_cuda_cache_sync(void *bctx, skv_seq_state *states, skv_stats *stats, skv_layer_stats *layer_stats,
                               char *msg, size_t cap);
skv_status skv_cuda_cache_set_states(void *bctx, const skv_seq_state *states, char *msg, size_t cap);
/* The serving slots (skv_cuda_serve.cu). */
skv_status skv_cuda_cache_release(void *bctx, int32_t seq, char *msg, size_t cap);
skv_status skv_cuda_cache_copy(void *bctx, void *dst, const void *src, size_t bytes, char *msg, size_t cap);
skv_status skv_cuda_cache_seq_ready(void *bctx, int32_t layer, int32_t seq, int32_t *ready, char *msg, size_t cap);

/* One (layer, sequence) of a cache, as the decode kernels see it. */
typedef struct skv_cuda_seq {
    /* fixed at prefill */
    const skv_bf16 *landmarks; /* [Hk, n_cand, D] candidate landmarks */
    const int32_t *cand_ids;   /* [Hk, n_cand] chunk id of each candidate (NULL: no ids) */
    const skv_bf16 *u;         /* [n, r] */
    const skv_bf16 *w;         /* [r, Hk*D] */
    const signed char *wq;     /* reproducible mode or the rescoring: W in the canonical rebuild's fixed
                                  point (skv_cuda_canon_wprep, skv_cuda_canon_wq_bytes), prepared whenever
                                  w is written (prefill, snapshot load); NULL when no decode rebuild reads
                                  it (default mode without rescoring, or skv_cuda_canon_uses_wq(sh, 1) == 0) */
    const unsigned char *vstore; /* [Hk, n_cand] chunk records of sh.vrec bytes (bf16 [c, D], or fp8
                                  codes [c, D] and exponents [c]: skv_cuda_fp8.cuh): device memory, or
                                  the device alias of the pinned host store (host slot) */
    const skv_bf16 *out_k, *out_v; /* [Hk, O*c, D] exact outlier chunks */
    const skv_bf16 *loc_k, *loc_v; /* [Hk, n_local, D] local window */
    skv_bf16 *gen_k, *gen_v;       /* [Hk, gen_cap, D] generated tokens */
    int32_t *pub_sel_idx, *pub_sel_ids; /* [Hk, S] selection published by the last good step
                                           (entries [k, S) of a head's row -1) */
    int32_t *pub_sel_cnt;      /* [Hk] each head's count k at that step (NULL: a dense slot) */
    /* chunk cache of a host slot; vc_data NULL for a device slot */
    unsigned char *vc_data;    /* [Hk, E] chunk records of sh.vrec bytes */
    int32_t *vc_slot_of;       /* [Hk, cand_max] entry of each candidate (-1) */
    int32_t *vc_owner, *vc_stamp; /* [Hk, E] candidate held (-1), last step used (-1) */
    int64_t n;                 /* prompt length */
    int32_t n_cand;            /* N - O */
    int32_t n_local;           /* a dense slot: n (loc_k, loc_v are its whole prompt) */
    int32_t dense;             /* 1: a dense layer's slot (no landmarks, factors, selection) */
    /* advanced on the device by the combine kernel */
    int32_t n_gen;
    int32_t has_sel; /* (adjacent to n_gen: cache_sync reads both back in one strided copy) */
    /* a decode step's rows (skv_cuda_act_rows): row i is a copy of the i-th listed sequence's
       descriptor, home pointing back at it (the combine advances both); the rows past the count
       are idle (every other field zero), and every decode kernel skips an idle row: it reads
       nothing of the step's tensors there and writes nothing. 0 and NULL in the cache's own
       descriptors and at op level. */
    int32_t idle;
    struct skv_cuda_seq *home;
} skv_cuda_seq;

/* Shape constants shared by the batched kernels (passed by value). */
typedef struct skv_cuda_shape {
    int32_t B, Hq, Hk, D;
    int32_t c, S, r, O;
    int32_t gen_cap;     /* row count of gen_k/gen_v per head */
    int32_t cand_max;    /* row stride of the scores and of vc_slot_of */
    int32_t vc_chunks;   /* E: chunk-cache entries per KV head */
    int32_t rotary_dim;  /* resolved (never 0) */
    int32_t interleaved;
    float scale;         /* resolved softmax scale */
    const float *cos_tab, *sin_tab; /* device RoPE tables, rotary_dim/2 floats per position */
    /* the selection count of each (sequence, KV head) (docs/DESIGN.md 4.5): cap = min(sel_cap,
       n_cand); sel_mode SKV_SELECT_FIXED: k = cap; SKV_SELECT_MASS: the mass rule with sel_mass
       and the floor min(sel_min, cap). sel_cap <= S (S is the stride of the selection rows). */
    int32_t sel_mode, sel_cap, sel_min;
    float sel_mass;
    /* the rescoring (docs/DESIGN.md 4.5.1): W candidates per (sequence, KV head) rescored by their
       canonical keys (config.select_candidates, at most cand_max); 0: none */
    int32_t W;
    /* the value records (lay.value_dtype, lay.vrec): SKV_VALUE_BF16 or SKV_VALUE_FP8, bytes per chunk record */
    int32_t value_dtype;
    int64_t vrec;
} skv_cuda_shape;

/* How a decode (or span) attention splits into work items per (sequence, query head). */
typedef struct skv_cuda_items {
    int32_t tt;          /* tokens per tile */
    int32_t n_sel;       /* items over the selected span: ceil(S*c / tt) (a head with k < S chunks
                            leaves its items past k*c tokens empty) */
    int32_t n_res;       /* items over the resident spans (or the caller's spans) */
    int32_t n_items;     /* n_sel + n_res */
    int32_t frag;        /* every item is one tile and the shape has the fragment kernel */
} skv_cuda_items;

/* The tensors of one decode step (device pointers). k, v NULL: an op-level selection. */
typedef struct skv_cuda_io {
    const skv_bf16 *q, *k, *v; /* [B, Hq, D], [B, Hk, D], [B, Hk, D] */
    float *out;                /* [B, Hq, D] */
} skv_cuda_io;

/* The score kernel's node of a captured decode step: the parameters a replay is updated with
   (skv_cuda_score_node_set_io), kept by the caller. */
typedef struct skv_cuda_score_node {
    cudaKernelNodeParams params; /* filled by skv_cuda_select_step while it is captured */
    void *args[1];               /* args[0] = argbuf */
    union {
        unsigned char bytes[768];
        long double align;
    } argbuf;
} skv_cuda_score_node;

/* Points the node's parameters at another step's tensors (params stay valid for
   cudaGraphExecKernelNodeSetParams). */
void skv_cuda_score_node_set_io(skv_cuda_score_node *node, const skv_cuda_io *io);

/* ---- a decode step's rows, the descriptors' writes (skv_cuda_active.cu) ---------------------- */

/* Where a step's list comes from: 0..n-1 (the whole batch is 0..B-1), a host list's device copy,
   or the caller's device list (count and list read and checked when the stream gets there). */
enum { SKV_CUDA_ACT_PREFIX = 0, SKV_CUDA_ACT_HOST = 1, SKV_CUDA_ACT_DEVICE = 2 };
/* What was wrong with a device list: the kind in bits 56.. of the deferred error, the layer in bits
   40..55, the count or the sequence in bits 0..31 (skv_cuda_act.err; atomicMin keeps the first kind). */
enum {
    SKV_CUDA_LIST_COUNT = 1, /* the count is outside [0, B] */
    SKV_CUDA_LIST_RANGE,     /* a sequence outside [0, B) */
    SKV_CUDA_LIST_TWICE,     /* a sequence listed twice */
    SKV_CUDA_LIST_FREE,      /* a sequence not prefilled in that layer */
    SKV_CUDA_LIST_FULL,      /* a sequence at gen_capacity in the step's layer */
    SKV_CUDA_LIST_AHEAD      /* the step's layer would go a step ahead of another layer of the sequence */
};

/* A decode step's list (passed by value). */
typedef struct skv_cuda_act {
    skv_cuda_seq *base;        /* the cache's L B descriptors (layer l, sequence s at l B + s) */
    skv_cuda_seq *rows;        /* [B] the step's rows (skv_cuda_seq.idle, home) */
    int32_t *mark;             /* [B] zero between steps (a device list's duplicates) */
    unsigned long long *err;   /* the deferred device-list error (~0: none; sticky: a device list is
                                  refused while it is set) */
    const int32_t *list;       /* HOST: the list's device copy; DEVICE: the caller's list; PREFIX: NULL */
    const int32_t *count;      /* DEVICE: the caller's count; else NULL */
    int32_t mode, n;           /* SKV_CUDA_ACT_*; n: the count of PREFIX and HOST */
    int32_t layer, L, B, gen_cap;
} skv_cuda_act;

/* The step's rows from its list: one block on st, the step's first kernel (before a layer's graph).
   A DEVICE list is checked first (count in [0, B], each sequence in range, once, prefilled in every
   layer, below gen_cap in this layer and not ahead of its other layers); a bad one, or a DEVICE list
   while *err is set, takes no row, and the first fault goes to *err. */
cudaError_t skv_cuda_act_rows(cudaStream_t st, const skv_cuda_act *a);
/* *dst = *val on st (one thread; the value travels as the kernel's parameter, so nothing on the
   host must stay alive). */
cudaError_t skv_cuda_set_seq(cudaStream_t st, skv_cuda_seq *dst, const skv_cuda_seq *val);
/* Sequence seq of all L layers back to free on st: no prompt, n_gen 0, no selection (published counts
   0, rows -1), chunk caches empty (their vc_meta_bytes of index from vc_slot_of -1); pointers kept. */
cudaError_t skv_cuda_release_seq(cudaStream_t st, skv_cuda_seq *base, int32_t L, int32_t B, int32_t seq, int32_t Hk,
                                 int32_t S, size_t vc_meta_bytes);

/* The decode workspace on the device (one per cache; shared by its layers). */
typedef struct skv_cuda_dws {
    float *scores;               /* [B, Hq, cand_max]: scores, then e_j */
    unsigned *macc;              /* [B, Hq] order_desc image of the max score (0: none) */
    float *s0;                   /* [B, Hq] score of candidate 0 (ref's max scan starts there) */
    float *Z;                    /* [B, Hq] canonical sum of e */
    unsigned *cnt_e;             /* [B, Hq] blocks of step 2 done (reset by the last) */
    unsigned *cnt_sel;           /* [B, Hk] tiles of step 3 done (reset by the last) */
    unsigned long long *pool;    /* [B, Hk, pool_cap] tile winners: key << 32 | candidate */
    int32_t pool_cap;
    int32_t *sel_idx, *sel_ids;  /* [B, Hk, S]: entries [k, S) of a row -1 */
    int32_t *sel_cnt;            /* [B, Hk] the step's count k of each (sequence, KV head) */
    float *mkey;                 /* [B, Hk, cand_max] SKV_SELECT_MASS, split path: the masses m_j (else NULL) */
    /* the rescoring (shape W > 0; NULL otherwise): the first stage's candidates, their keys, scores
       and chunk masses */
    int32_t *cand_idx, *cand_ids; /* [B, Hk, W] the W landmark-best candidates (increasing), their chunk ids */
    int32_t *cand_cnt;           /* [B, Hk] their number min(W, n_cand) */
    skv_bf16 *cand_k;            /* [B, Hk, W c, D] their tokens' canonical keys */
    float *cand_s;               /* [B, Hq, W c] the group's scores, then e */
    float *cand_b;               /* [B, Hk, W] the chunk masses b_i */
    int32_t *vsrc;               /* [B, Hk, S] chunk-cache entry of each selected chunk; bit 31: missed */
    int32_t *mlist, *mcount;     /* [B, Hk, S] positions of the missed chunks, [B, Hk] their count */
    float *part_acc;             /* [B, Hq, n_items, D] */
    float2 *part_ml;             /* [B, Hq, n_items] (max, sum), log2 domain */
    float *pbuf;                 /* [B, Hq, S*c] weights of the selected tokens (host slots) */
    int32_t *step_bad;           /* non-finite inputs found by step 1 (reset by step 5) */
    unsigned *cnt_done;          /* step-5 blocks done (reset by the last) */
    unsigned long long *first_bad; /* sticky first non-finite input, see skv_cuda_select_step */
    unsigned long long *vc_counts; /* [2] chunk-cache hits, misses (cumulative) */
    unsigned long long *lstats;  /* NULL, or [4] the layer's counters (head_steps, attended_tokens,
                                    context_tokens, selected_chunks; cumulative), added by step 5:
                                    the cache points a copy of its workspace at each layer's row */
    skv_cuda_io *io;             /* the step's tensors, published by step 1 for steps 4 and 5 */
    skv_cuda_items it;
    /* reproducible mode only (NULL otherwise) */
    float *canon_e;              /* [B, Hq, canon_tmax] the canonical attention's scores, then weights */
    int64_t canon_tmax;          /* most tokens a query head attends to (skv_plan_max_tokens) */
} skv_cuda_dws;

/* Items of a decode attention for this shape and config (host). */
skv_cuda_items skv_cuda_decode_items(const skv_cuda_shape *sh, int64_t max_resident);
/* Items of an op-level span attention over total tokens (host). */
skv_cuda_items skv_cuda_span_items(int32_t B, int32_t Hq, int32_t Hk, int32_t D, int64_t total);
/* Tiles of step 3 for at most n candidates; pool entries per (sequence, KV head) for selections of
   up to S chunks (the rescoring's first stage: of W). */
int32_t skv_cuda_select_tiles(int32_t n);
int32_t skv_cuda_pool_cap(int32_t cand_max, int32_t S);

/* The decode workspace carved from one allocation at base: its bytes (base NULL) or its
   pointers (skv_cuda_cache.cu; the cache's, and the op-level score_select's own). it: the
   attention items; host: whether any slot keeps its values on the host; canon_tmax: the
   reproducible mode's row length (0: default mode); mass: SKV_SELECT_MASS (the masses' region);
   W: the rescoring's candidates (skv_cuda_shape.W; 0: no rescoring regions). */
size_t skv_cuda_dws_layout(skv_cuda_dws *ws, char *base, int32_t B, int32_t Hq, int32_t Hk, int32_t D, int32_t S,
                           int32_t c, int32_t cand_max, skv_cuda_items it, int host, int64_t canon_tmax, int mass,
                           int32_t W);

/* Zeroes the counters of a carved workspace and sets first_bad to none (on stream st). */
cudaError_t skv_cuda_dws_clear(const skv_cuda_dws *ws, cudaStream_t st);

/* A cache's shapes and items (skv_cuda_workspace.cu), from a validated config and its layout. */
skv_cuda_shape skv_cuda_shape_of(const skv_config *cfg, const skv_layout *lay); /* a sparse layer's (no tables) */
/* A dense layer's shape: S = O = r = 0, no candidates (its prompt is the local window). */
skv_cuda_shape skv_cuda_dense_shape(const skv_cuda_shape *sh);
/* Most resident tokens of a dense layer's step: max_prompt_len + gen_capacity. */
int64_t skv_cuda_dense_resident(const skv_config *c);
skv_cuda_items skv_cuda_items_of(const skv_config *c, const skv_layout *lay);       /* a sparse layer's step */
skv_cuda_items skv_cuda_dense_items_of(const skv_config *c, const skv_layout *lay); /* a dense layer's step */
/* The items the workspace is carved for: the most of either kind (with dense layers). */
skv_cuda_items skv_cuda_ws_items_of(const skv_config *c, const skv_layout *lay);
/* The reproducible mode's score row length (0 in the default mode). */
int64_t skv_cuda_canon_tmax(const skv_config *c, const skv_layout *lay);

/* ---- decision path (--fmad=false: skv_cuda_rope.cu, skv_cuda_landmarks.cu, skv_cuda_score.cu,
   skv_cuda_select.cu, skv_cuda_rescore.cu) --------------------------------------------------------- */

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

/* Step 1 of skv_cuda_select_step (skv_cuda_score.cu; the caller has checked the shape): the
   scores into ws->scores, their max into ws->macc, s_0 into ws->s0; with io->k and io->v the
   input check and the publication of *io (skv_cuda_select_step says which). graph (or NULL):
   receives the score kernel's parameters. */
cudaError_t skv_cuda_score(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                           const skv_cuda_dws *ws, const skv_cuda_io *io, int tiled, int32_t layer,
                           skv_cuda_score_node *graph);

/*
 * Steps 1-3 for io->q [B, Hq, D]: the selection of every (sequence, KV head) into
 * ws->sel_idx / sel_ids (increasing candidate order, bit-identical to ref's score_select),
 * amax [B, Hk, cand_max] (a_j; NULL: not written). With io->k and io->v (decode), step 1 also
 * publishes *io to ws->io for steps 4 and 5, counts non-finite q, k, v values into
 * *ws->step_bad and records the first in *ws->first_bad (atomicMin of ((uint64)layer << 48) |
 * ((uint64)tensor << 40) | flat index, tensor 0 q, 1 k, 2 v), and host slots run their
 * chunk-cache plan (unless step_bad). tiled: every landmark tensor is 16-byte aligned with D %
 * 8 == 0 (the cache's are). graph (or NULL): receives the score kernel's parameters for a
 * replay. ws->macc, cnt_e, cnt_sel must be zero on entry (they are left zero). *launches +=
 * kernels launched (NULL: not counted). scored (or NULL): recorded on st after step 1, when
 * ws->io is published. Query groups above 64 heads are refused (cudaErrorInvalidValue).
 */
cudaError_t skv_cuda_select_step(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                 const skv_cuda_dws *ws, const skv_cuda_io *io, int tiled, int32_t layer, float *amax,
                                 skv_cuda_score_node *graph, int *launches, cudaEvent_t scored);

/*
 * The rescoring's first stage (docs/DESIGN.md 4.5.1; skv_cuda_select.cu): steps 1-3 of
 * skv_cuda_select_step at decode (io->k, io->v set: the input check and the publication of *io)
 * with the fixed rule and cap sh->W, into ws->cand_idx / cand_ids / cand_cnt (stride W): the
 * min(W, n_cand) landmark-best candidates of each (sequence, KV head) in increasing order. Nothing
 * is published and no chunk cache changes (skv_cuda_rescore_step's last kernel does that).
 */
cudaError_t skv_cuda_select_candidates(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                       const skv_cuda_dws *ws, const skv_cuda_io *io, int32_t layer,
                                       skv_cuda_score_node *graph, int *launches, cudaEvent_t scored);

/*
 * A decode step's selection with rescoring (sh->W > 0; docs/DESIGN.md 4.5.1; skv_cuda_rescore.cu),
 * in place of skv_cuda_select_step: skv_cuda_select_candidates, the candidates' canonical keys
 * (skv_cuda_canon_rescore_keys; wq_seq: the slots' W is prepared, seqs[b].wq) and rescore_kernel:
 * per (sequence, KV head) the chunk masses, the mode's rule among the candidates, the selection
 * into ws->sel_idx / sel_ids / sel_cnt (bit-identical to ref's skv_rescore_head), its publication
 * and the chunk cache's plan as select_finish. Arguments as skv_cuda_select_step's.
 */
cudaError_t skv_cuda_rescore_step(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                  const skv_cuda_dws *ws, const skv_cuda_io *io, int32_t layer, int wq_seq,
                                  skv_cuda_score_node *graph, int *launches, cudaEvent_t scored);

/* ---- attention (skv_cuda_attend.cu, skv_cuda_attend_missed.cu) ---------------------------- */

/*
 * Step 4 of a decode: the partials of every item (q, k_new, v_new from ws->io). Host slots
 * skip the P V of their missed chunks and record those tokens' weights for
 * skv_cuda_attend_missed.
 */
cudaError_t skv_cuda_attend(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                            const skv_cuda_dws *ws, int pdl);

/* Adds the missed chunks' P V to the partials (after skv_cuda_fetch; skv_cuda_attend_missed.cu). */
cudaError_t skv_cuda_attend_missed(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                   const skv_cuda_dws *ws);

/* Op-level attention of q [Hq, D] over caller spans (device pointers), B = 1. part_acc and
   part_ml as skv_cuda_dws for skv_cuda_span_items(1, Hq, Hk, D, total tokens). */
cudaError_t skv_cuda_span_attention(cudaStream_t st, int32_t Hq, int32_t Hk, int32_t D, float scale,
                                    const skv_bf16 *q, int32_t n_spans, const skv_kv_span *spans, float *out,
                                    const skv_cuda_dws *ws);

/* Op-level: k_out [Hk, S*c, D]: row (h, s*c + i) = RoPE(U[t] W_h) at t = chunk_ids[h][s]*c + i
   (B = 1, seqs[0].u/w). */
cudaError_t skv_cuda_rebuild(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                             const int32_t *chunk_ids, skv_bf16 *k_out);

/* ---- the reproducible mode (skv_cuda_canon_*.cu, --fmad=false) ---------------------------- */

/* k_out [B, Hk, S*c, D]: the canonical rebuild (docs/DESIGN.md 10.2) of the chunks chunk_ids
   [B, Hk, S] from seqs[b].u, seqs[b].w, bit-identical to ref. Integer tensor cores (mma.sync int8)
   where skv_cuda_canon_uses_wq(sh, 0) and wq is set, exact int64 sums otherwise. wq (or NULL): the
   B sequences' W prepared by skv_cuda_canon_wprep, skv_cuda_canon_wq_bytes apart (the op level: B = 1,
   prepared per call). */
cudaError_t skv_cuda_canon_rebuild(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                   const int32_t *chunk_ids, skv_bf16 *k_out, const void *wq);
/* The rescoring's keys (docs/DESIGN.md 4.5.1): k_out [B, Hk, W c, D], the canonical rebuild of the
   first cand_cnt [B, Hk] chunks of cand_ids [B, Hk, W] (W = sh->W), as skv_cuda_canon_rebuild; wq_seq:
   W's prepared form at seqs[b].wq (else the exact int64 kernel, unless the shape takes neither). */
cudaError_t skv_cuda_canon_rescore_keys(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                        const int32_t *cand_ids, const int32_t *cand_cnt, skv_bf16 *k_out,
                                        int wq_seq);
/* Bytes of one sequence's (slot's) prepared W: W_h in the rebuild's fixed point as the int8 mma B
   fragments for every KV head, then the columns' exponents; a multiple of 256. */
size_t skv_cuda_canon_wq_bytes(int32_t Hk, int32_t D, int32_t r);
/* Whether the canonical rebuild of this shape takes the tensor-core kernel, the one that reads the
   prepared W: at decode (decode = 1: it also scores, so it needs more shared memory) or at op level.
   0: the exact int64 kernel, which reads W itself (r > 256, or the shared memory does not fit). */
int skv_cuda_canon_uses_wq(const skv_cuda_shape *sh, int decode);
/* W [r, Hk*D] (bf16, one sequence's) -> its prepared form wq (skv_cuda_canon_wq_bytes): one launch on
   st, nothing else. W is fixed at prefill, so the cache runs this when it writes a slot's W (prefill,
   snapshot load), not per step. r > 256: cudaErrorInvalidValue. */
cudaError_t skv_cuda_canon_wprep(cudaStream_t st, int32_t Hk, int32_t D, int32_t r, const skv_bf16 *w, void *wq);

/* The canonical scores of a decode step's resident tokens (every span but the selected one, docs/DESIGN.md
   10.3 step 1) into ws->canon_e. Needs ws->io
   published (after step 1 of skv_cuda_select_step), not the selection: the cache runs it on its side
   stream beside steps 2 and 3. */
cudaError_t skv_cuda_canon_decode_resident(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                           const skv_cuda_dws *ws);
/* The canonical rebuild of a decode step's selected keys (ws->sel_ids; W's fixed point from
   seqs[b].wq, prepared when the slot's W was written), which are not stored: the kernel scores
   them against ws->io's q on chip (the scores s_j of docs/DESIGN.md 10.3 step 1) into
   ws->canon_e at the selected span's places. */
cudaError_t skv_cuda_canon_decode_rebuild(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                          const skv_cuda_dws *ws);
/* Test hook (skv_cuda_canon_rebuild.cu; exported by skv_cuda_plugin.c as skv_cuda_test_rebuild_split for
   tests/test_canonical_decode.c --split=0|1): split 0 or 1 forces the decode rebuild's plain or split form
   wherever the shape allows the split (both give the same bits); anything else restores the automatic
   choice. Process-wide; meant to be set before a test's decode steps. */
void skv_cuda_canon_test_split(int split);
/* The canonical attention (docs/DESIGN.md 10.3) of a decode step, after skv_cuda_canon_decode_rebuild
   and skv_cuda_canon_decode_resident (the weights from their scores, then P V):
   q, k_new, v_new and out from ws->io, the selected tokens' scores from ws->canon_e, their values
   from the store or, for a host slot, from the chunk cache (so it must run after skv_cuda_fetch). */
cudaError_t skv_cuda_canon_decode_attend(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                         const skv_cuda_dws *ws);

/* Op level: the canonical attention of q [Hq, D] over caller spans (device pointers). e: scratch
   of Hq * T floats, T the spans' total token count. */
cudaError_t skv_cuda_canon_span_attention(cudaStream_t st, int32_t Hq, int32_t Hk, int32_t D, float scale,
                                          const skv_bf16 *q, int32_t n_spans, const skv_kv_span *spans, float *out,
                                          float *e, int64_t T);

/* ---- combine (skv_cuda_combine.cu) ------------------------------------------------------- */

/* Step 5: out [B, Hq, D] from the partials. Decode (seqs != NULL): out, k, v from ws->io; the
   new token's k, v go to the generated region and has_sel is set (unless step_bad), and the
   per-step accumulators are reset. Op-level (seqs NULL): out as given. */
cudaError_t skv_cuda_combine(cudaStream_t st, const skv_cuda_shape *sh, skv_cuda_seq *seqs, const skv_cuda_dws *ws,
                             float *out, int pdl);
/* Step 5 without the output (the reproducible mode's attention wrote it): the append, has_sel
   and the reset of the per-step accumulators, as skv_cuda_combine at decode. */
cudaError_t skv_cuda_combine_append(cudaStream_t st, const skv_cuda_shape *sh, skv_cuda_seq *seqs,
                                    const skv_cuda_dws *ws);

/* ---- copies and conversion (skv_cuda_copy.cu) -------------------------------------------- */

/* The missed chunks of host slots into their chunk-cache entries (side stream, after step 3). */
cudaError_t skv_cuda_fetch(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                           const skv_cuda_dws *ws);

/* Op-level: v_out [Hk, S*c, D]: chunk s of head h = store[h][idx[h][s]] (c*D values; an fp8
   record decoded, skv_fp8_decode_chunk's bits). */
cudaError_t skv_cuda_gather(cudaStream_t st, int32_t Hk, int32_t D, int32_t c, int32_t n_store, int32_t S,
                            int32_t value_dtype, const void *store, const int32_t *idx, skv_bf16 *v_out);

/* Prefill: dst [Hk, m, c, D], chunk (h, i) = tokens ids[h*m + i]*c .. +c-1 of head h of
   src [n, Hk, D] (token-major). dst may be mapped pinned host memory. At most max_blocks
   blocks (<= 0: as many as the work needs, up to 65535). */
cudaError_t skv_cuda_gather_chunks(cudaStream_t st, const skv_bf16 *src, int32_t Hk, int32_t D, int32_t c,
                                   const int32_t *ids, int32_t m, skv_bf16 *dst, int32_t max_blocks);
/* The same chunks as chunk records of value_dtype: bf16 as skv_cuda_gather_chunks, fp8 encoded
   (skv_fp8_encode_chunk's bytes, one warp per record) into dst [Hk, m] records of
   skv_value_chunk_bytes(value_dtype, c, D) bytes. */
cudaError_t skv_cuda_store_chunks(cudaStream_t st, int32_t value_dtype, const skv_bf16 *src, int32_t Hk, int32_t D,
                                  int32_t c, const int32_t *ids, int32_t m, void *dst, int32_t max_blocks);

/* y[i] = skv_f32_to_bf16(x[i]). */
cudaError_t skv_cuda_f32_to_bf16(cudaStream_t st, const float *x, skv_bf16 *y, int64_t n);

/* config.rank == 0 (skv_cuda_factor_rank.cu, docs/DESIGN.md 3.1). Scratch bytes for rank_max = m. */
size_t skv_cuda_rank_scratch_bytes(int32_t m);
/* From the float factors u [n, m], w [m, d] of a [n, d] (the pre-RoPE keys), on stream st: the
   slot's rank into *slot_rank (device memory) and the factors in bf16 into u_out, w_out, columns
   of U and rows of W ordered by non-increasing energy (stable), places r.. zero. Nothing waits
   on the host. */
cudaError_t skv_cuda_rank_store(cudaStream_t st, int reproducible, float target, const skv_bf16 *a, int64_t n,
                                int64_t d, int32_t m, const float *u, const float *w, void *scratch,
                                int32_t *slot_rank, skv_bf16 *u_out, skv_bf16 *w_out);

/* ---- input checks (skv_cuda_check.cu) ---------------------------------------------------- */

/* *first_bad = min(*first_bad, logical index of the first non-finite element) of a strided
   [n_a, n_b, len] bf16 tensor: element (i, j, l) at x[i*s_a + j*s_b + l], logical index
   (i*n_b + j)*len + l. The caller initializes *first_bad to ~0ull. */
cudaError_t skv_cuda_find_nonfinite(cudaStream_t st, const skv_bf16 *x, int64_t n_a, int64_t s_a, int64_t n_b,
                                    int64_t s_b, int64_t len, unsigned long long *first_bad);

/* *first_bad = min(*first_bad, first i with x[i] < lo or x[i] >= hi), x [n] int32. */
cudaError_t skv_cuda_find_out_of_range(cudaStream_t st, const int32_t *x, int64_t n, int64_t lo, int64_t hi,
                                       unsigned long long *first_bad);

/* ---- the prefill's partition (skv_cuda_green.cu) ------------------------------------------ */

typedef struct skv_cuda_green skv_cuda_green;

/* A green context over sms > 0 of the current device's streaming multiprocessors, rounded up as
   the driver requires; *g = NULL (SKV_OK) when that is the whole device. *actual: the partition's
   SMs (the device's without one). SKV_ERR_UNSUPPORTED naming cuda_prefill_sms when the driver, the
   device or this build has no green contexts. */
skv_status skv_cuda_green_create(skv_cuda_green **g, int32_t sms, int32_t *actual, char *msg, size_t cap);
/* A non-blocking stream of priority prio in g (g NULL: an ordinary one). */
skv_status skv_cuda_green_stream(skv_cuda_green *g, cudaStream_t *s, int prio, char *msg, size_t cap);
/* An event (cudaEvent* flags) to be recorded on g's streams, made in g's context (g NULL: an
   ordinary one). Any stream may wait for it. */
skv_status skv_cuda_green_event(skv_cuda_green *g, cudaEvent_t *e, unsigned flags, char *msg, size_t cap);
/* Destroys g (NULL: nothing), after every stream and event made in it. */
void skv_cuda_green_destroy(skv_cuda_green *g);

/* ---- factorization (skv_cuda_factor*.cu) ------------------------------------------------- */

typedef struct skv_cuda_factor skv_cuda_factor;

/* Device bytes of a factorization workspace for up to n_max rows (excluding the cuSOLVER
   workspace, which is queried at create). */
size_t skv_cuda_factor_bytes(int64_t n_max, int32_t d, int32_t r);

/* Handles and workspace for up to n_max rows of width d, rank r, bound to stream st; the canonical
   route's second stream (st's priority) and the events recorded on the two are made in green (NULL:
   none), which must then hold st. SKV_ERR_OUT_OF_MEMORY / SKV_ERR_NO_DEVICE with a message. */
skv_status skv_cuda_factor_create(skv_cuda_factor **f, int64_t n_max, int32_t d, int32_t r, cudaStream_t st,
                                  skv_cuda_green *green, char *msg, size_t cap);
void skv_cuda_factor_destroy(skv_cuda_factor *f);

/*
 * a [n, d] bf16 (device) -> u [n, r], w [r, d] float (device), U W ~ the best rank-r
 * approximation (docs/DESIGN.md section 6; the routes of lib/skv_factor.h), on the factor's
 * stream. 1 <= r <= min(n, d), n <= n_max. sync = 0: asynchronous on the FAST route (no
 * host synchronization, no allocation; the EXACT route's Xsyevd synchronizes with the
 * host); a failed solver call is counted on the device under
 * tag (see skv_cuda_factor_counts). sync = 1: synchronizes the stream and returns
 * SKV_ERR_NUMERICAL with a message if a solver call failed. a must stay unchanged until
 * the stream has run the call. mode: the caller's route choice.
 */
skv_status skv_cuda_factorize(skv_cuda_factor *f, skv_factorize_route mode, int64_t n, const skv_bf16 *a, float *u,
                              float *w, unsigned long long tag, int sync, char *msg, size_t cap);

/* Synchronizes the factor's stream and reads its counters since create: calls with a
   failed solver step, and the tag of the first such call (~0 if none). */
skv_status skv_cuda_factor_counts(skv_cuda_factor *f, unsigned long long *failures,
                                  unsigned long long *first_failure_tag, char *msg, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* SKV_CUDA_H */
