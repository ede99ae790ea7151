/*
 * skv_backend.h - THE dispatch table (private to the library).
 *
 * Every backend fills one `struct skv_backend_ops`. ref fills every slot;
 * other backends start from ref's table (skv_ref_ops) and override the slots
 * they implement. A NULL slot is reported as SKV_ERR_UNSUPPORTED by lib/,
 * never called. Arguments reaching a slot have been validated by lib/
 * (shapes, ranges, NULLs, finiteness), so slots only compute.
 */
#ifndef SKV_BACKEND_H
#define SKV_BACKEND_H

#include "shadowkv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where a buffer lives. */
typedef enum skv_mem_kind {
    SKV_MEM_DEVICE = 0, /* device-resident part of the cache (host memory for ref/cpu) */
    SKV_MEM_HOST = 1    /* host value store (pinned for cuda) */
} skv_mem_kind;

/*
 * Scratch for the decode-path slots: a bump arena the cache allocates at
 * create (sized by decode_ws_bytes), so a decode step allocates nothing. A
 * request that does not fit is malloc'ed instead and counted (n_spills), so
 * tests can prove the decode path never allocates. Op-level calls pass an
 * empty arena: everything spills, which is fine outside the cache.
 */
typedef struct skv_ws {
    char *base;      /* arena, or NULL */
    size_t cap, used;
    void *spill;     /* list of malloc'ed blocks (header: next pointer) */
    int64_t n_spills;/* blocks malloc'ed since the last skv_ws_reset */
} skv_ws;

/* bytes from the arena, 64-byte aligned; NULL only if the fallback malloc fails. */
void *skv_ws_alloc(skv_ws *ws, size_t bytes);
/* Returns everything to the arena, frees spilled blocks; returns their count. */
int64_t skv_ws_reset(skv_ws *ws);
/* Worst-case arena bytes for n allocations totalling bytes (alignment slack). */
#define SKV_WS_BYTES(bytes, n) ((bytes) + (size_t)(n) * 64)

/*
 * Byte offsets of one (layer, sequence) slot inside the device and host arenas,
 * and of the shared regions. Computed once from a validated config; the memory
 * query and create use the same function, so they cannot disagree.
 *
 * Slot i = layer * B + seq (B = batch_size) indexes the states; where its bytes
 * are depends on whether its layer is dense (config.dense_layers):
 *  - a sparse slot is the j-th of the sparse slots, j = skv_layout_sparse_index
 *    (the slots of sparse layers in slot order), at byte j * slot_device of the
 *    device arena (regions u .. sel_cnt below);
 *  - a dense slot is the j-th of the dense slots, j = skv_layout_dense_index, at
 *    byte dense_base + j * slot_dense (regions dn_k .. dn_gen_v below).
 * skv_layout_slot_offset gives either. Device arena: n_sparse_slots sparse slots,
 * the n_dense_slots dense slots (from dense_base), the shared regions, then the
 * value region: n_dev_slots whole value stores (slot_values bytes each), then one
 * chunk cache (slot_vcache bytes each) per host-placed sparse slot. Host arena:
 * one value store per host-placed sparse slot (slot_host bytes each). Value stores
 * belong to sparse slots only: sparse slot j keeps its values on the device iff
 * j < n_dev_slots (a dense slot keeps its values in its own regions).
 */
typedef struct skv_layout {
    int32_t S;          /* selected chunks per KV head: budget / c, or cand_max for SKV_BUDGET_ALL
                           (the stride of every per-head selection row) */
    int32_t cand_max;   /* N_max - O */
    int32_t W;          /* candidates rescored per KV head (4.5.1): min(select_candidates, cand_max);
                           0 when select_candidates = 0 */
    int32_t min_cand;   /* N - O a sparse layer's prompt needs: S (fixed), max(1, select_min_chunks)
                           (SKV_SELECT_MASS), 1 (SKV_BUDGET_ALL) */
    int32_t local_max;  /* (Lc + 1) * c - 1 */
    int32_t vc_chunks;  /* chunk-cache entries per KV head of a host slot (resolved) */
    int32_t batch;      /* B = batch_size */
    int32_t n_dense_layers; /* layers with their bit set in dense_layers */
    uint64_t dense_layers;  /* config.dense_layers */
    int64_t n_positions;/* RoPE table rows: max_prompt_len + gen_capacity */
    int64_t n_slots;    /* L * B (states) */
    int64_t n_sparse_slots; /* (L - n_dense_layers) * B */
    int64_t n_dense_slots;  /* n_dense_layers * B */
    int64_t n_dev_slots;/* sparse slots whose values live on the device (the first ones) */
    /* per-slot device offsets of a sparse slot; sel_cnt [Hk] int32: each head's count k at the
       last step (S in the fixed mode; the rest of its sel_idx / sel_ids rows hold -1) */
    size_t u, w, landmarks, cand_ids, out_ids, out_k, out_v, loc_k, loc_v, gen_k, gen_v, sel_idx,
        sel_ids, sel_cnt, slot_device;
    /* per-slot device offsets of a dense slot: the prompt's exact post-RoPE keys and its values
       [Hk, max_prompt_len, D] bf16 (head stride n * D for a prompt of n tokens, like loc_k), the
       generated tokens [Hk, gen_capacity, D]; slot_dense bytes each, from dense_base */
    size_t dn_k, dn_v, dn_gen_k, dn_gen_v, slot_dense, dense_base;
    /* value stores [Hk, cand_max] chunk records of vrec bytes each (skv_value_chunk_bytes of
       value_dtype: bf16 [c, D], or fp8 codes [c, D] and exponents [c]): device ones from dev_values,
       host ones from 0 of the host arena */
    int32_t value_dtype;
    size_t vrec, slot_values, slot_host;
    /* chunk cache of a host slot: data [Hk, vc_chunks] chunk records (vrec bytes), slot_of [Hk, cand_max],
       owner [Hk, vc_chunks], stamp [Hk, vc_chunks] int32 (metadata contiguous from vc_slot_of) */
    size_t vc_data, vc_slot_of, vc_owner, vc_stamp, vc_meta_bytes, slot_vcache;
    /* shared device regions (after the slots); ws_sel_cnt [B, Hk] int32: the step's counts */
    size_t rope_cos, rope_sin, ws_k, ws_v, ws_sel_idx, ws_sel_ids, ws_sel_cnt;
    /* the rescoring's (4.5.1; sizes 0 when W = 0): ws_cand_idx / ws_cand_ids [B, Hk, W] int32 (the
       first stage's candidates), ws_cand_k [Hk, W c, D] bf16 (their canonical keys, one sequence) */
    size_t ws_cand_idx, ws_cand_ids, ws_cand_k;
    size_t dev_values, dev_vcache;
    /* the pool mode (config.pool_device_bytes > 0; include/shadowkv.h "Memory pools"): the sparse
       slot regions u, landmarks, cand_ids and the dense slot regions dn_k, dn_v have size 0 in the
       fixed slot layout (their offsets are meaningless) and come from the pools at prefill
       (skv_slot_mem); n_dev_slots is 0 (no value store in the fixed layout) and every sparse slot
       has a chunk cache when values_host. Device pool: pool_dev_pages pages of page_bytes at
       dev_pool in the device arena; host pool: pool_host_pages pages from byte 0 of the host
       arena. */
    int32_t pooled, values_host;
    size_t page_bytes, dev_pool;
    int64_t pool_dev_pages, pool_host_pages;
    size_t device_total, host_total;
} skv_layout;

/*
 * Where the regions of one (layer, sequence) that grow with its prompt are (its fixed regions
 * stay at skv_layout_slot_offset). Outside the pool mode they are the slot's own regions of the
 * fixed layout (and its value store); in the pool mode, places in the pool pages the prefill took
 * (lib/skv_pool.c lays them out with skv_slot_regions). All NULL for a free slot.
 *  sparse slot: u [n, r] bf16, landmarks [n_cand, Hk D] bf16 (head h's rows at h * n_cand * D),
 *               cand_ids [Hk, n_cand] int32, vstore [Hk, n_cand] chunk records of lay.vrec bytes
 *               (host memory when vstore_host, pinned for cuda);
 *  dense slot:  dn_k, dn_v [Hk, n, D] bf16.
 */
typedef struct skv_slot_mem {
    char *u, *landmarks, *cand_ids, *vstore;
    char *dn_k, *dn_v;
    int32_t vstore_host;
} skv_slot_mem;

/* The candidates (N - O) a sparse layer's prompt must have, for S chunks per head. */
static inline int64_t skv_min_candidates(const skv_config *cfg, int64_t S)
{
    if (cfg->select_mode == SKV_SELECT_MASS) return cfg->select_min_chunks > 1 ? cfg->select_min_chunks : 1;
    return cfg->budget == SKV_BUDGET_ALL ? 1 : S;
}

/* 1 if layer is dense (bit layer of config.dense_layers). */
static inline int skv_layout_dense(const skv_layout *lay, int32_t layer)
{
    return layer >= 0 && layer < 64 && ((lay->dense_layers >> layer) & 1u);
}
/* Dense layers below layer. */
static inline int32_t skv_layout_dense_below(const skv_layout *lay, int32_t layer)
{
    uint64_t m = layer >= 64 ? lay->dense_layers : (lay->dense_layers & (((uint64_t)1 << layer) - 1u));
    int32_t n = 0;
    for (; m; m &= m - 1) n++;
    return n;
}
/* Index of (layer, seq) among the sparse slots (its value store's index); -1 for a dense layer. */
static inline int64_t skv_layout_sparse_index(const skv_layout *lay, int32_t layer, int32_t seq)
{
    if (skv_layout_dense(lay, layer)) return -1;
    return (int64_t)(layer - skv_layout_dense_below(lay, layer)) * lay->batch + seq;
}
/* Index of (layer, seq) among the dense slots; -1 for a sparse layer. */
static inline int64_t skv_layout_dense_index(const skv_layout *lay, int32_t layer, int32_t seq)
{
    if (!skv_layout_dense(lay, layer)) return -1;
    return (int64_t)skv_layout_dense_below(lay, layer) * lay->batch + seq;
}
/* Byte offset of slot (layer, seq) in the device arena (add lay->u etc. for a sparse slot,
   lay->dn_k etc. for a dense one). */
static inline size_t skv_layout_slot_offset(const skv_layout *lay, int32_t layer, int32_t seq)
{
    if (skv_layout_dense(lay, layer))
        return lay->dense_base + (size_t)skv_layout_dense_index(lay, layer, seq) * lay->slot_dense;
    return (size_t)skv_layout_sparse_index(lay, layer, seq) * lay->slot_device;
}
/* The rank a cache's factors are sized for: config.rank, or rank_max when rank == 0 (a rank
   per slot, chosen at prefill; docs/DESIGN.md 3.1). */
static inline int32_t skv_cfg_rank(const skv_config *cfg) { return cfg->rank ? cfg->rank : cfg->rank_max; }

/* Host-side bookkeeping of one (layer, sequence) of a cache. */
typedef struct skv_seq_state {
    int32_t prefilled;
    int32_t has_selection;
    int64_t n;
    int32_t n_chunks, n_cand, n_local, n_gen;
    int32_t dense; /* 1: a dense layer's slot (set at create, kept by load): n_chunks = n_cand = 0,
                      n_local = n once prefilled */
    int32_t rank;  /* the slot's factorization rank once prefilled (config.rank; chosen per slot
                      when config.rank == 0); 0 before prefill and for a dense slot; cuda
                      refreshes it at cache_sync, since its prefill chooses on the device */
} skv_seq_state;

/*
 * How a score_select call picks each KV head's count k (docs/DESIGN.md section 4.5).
 * lib/ fills it per sequence: cap = min(S, n_cand), stride = S (lay.S),
 * floor = min(select_min_chunks, cap). SKV_BUDGET_ALL: S = cand_max, so cap = n_cand (every
 * candidate in the fixed mode; the mass rule up to them in the mass mode).
 */
typedef struct skv_select_params {
    int32_t mode;   /* SKV_SELECT_FIXED: k = cap; SKV_SELECT_MASS: the mass rule (skv_select_head) */
    int32_t cap;    /* 1 <= cap <= n_cand */
    int32_t stride; /* entries per KV head in sel_idx / sel_ids, >= cap; entries [k, stride) are -1 */
    int32_t floor;  /* SKV_SELECT_MASS: 0 <= floor <= cap */
    float mass;     /* SKV_SELECT_MASS: the target p in (0, 1] */
} skv_select_params;

/*
 * What the 0.3 features (docs/DESIGN.md sections 4.5, 4.7, 8, 9) ask of a backend.
 *
 * Selection count (config.select_mode, config.budget = SKV_BUDGET_ALL): lay.S is the
 * stride of every per-head selection row (budget / c, or cand_max for SKV_BUDGET_ALL).
 * At a step of sequence b, head h of a sparse layer takes k_bh chunks:
 *   cap = min(S, n_cand); FIXED: k = cap; MASS: the mass rule of skv_select_head with
 *   floor = min(select_min_chunks, cap) and mass = select_mass.
 * k and the set are decisions: bit for bit those of skv_select_head on every backend and
 * in both modes. The step's selected span of head h has k_bh * c tokens (the rebuilt keys
 * of its k chunks and their values); the other spans as before. Stored per slot: sel_idx /
 * sel_ids rows [h*S, h*S + k) the selection in increasing order, [k, S) -1; sel_cnt[h] = k.
 * The chunk cache of a host-placed slot runs skv_vcache_step on the k selected chunks of
 * the head (hits + misses = k).
 *
 * Dense layers (config.dense_layers; skv_layout_dense): their slots are laid out apart
 * (skv_layout_slot_offset; dn_* regions). Prefill (n_chunks = 0 from lib/, any
 * 1 <= n <= max_prompt_len): the exact post-RoPE keys (k_post, or RoPE of k_pre) and the
 * values of all n tokens into dn_k / dn_v with head stride n * D; nothing else. Decode:
 * no scoring or selection; the attention over outliers 0, local window dn_k/dn_v (n
 * tokens), selected 0, generated dn_gen_k/dn_gen_v (n_gen), the new token (appended to
 * dn_gen_* after a good step); the reproducible mode's canonical attention as for any
 * other spans. A dense slot has no value store and no chunk cache.
 *
 * Per-layer counters (skv_layer_stats): for each (step, sequence, KV head) of a layer:
 * head_steps += 1; attended_tokens += O*c + n_local + k*c + n_gen + 1 (dense: n + n_gen + 1);
 * context_tokens += n + n_gen + 1; selected_chunks += k (dense: 0); n_gen counted before the
 * step's own token. Backends with cache_decode keep them (on the device, no extra
 * synchronization) and hand them over in cache_sync; otherwise lib/ counts.
 *
 * Snapshots: sel_cnt is part of a sparse slot's saved state; a dense slot saves dn_k, dn_v
 * (n tokens per head) and dn_gen_k, dn_gen_v (n_gen per head). cache_set_states gets
 * states with dense set and rank filled; sel_cnt has been written into the arena.
 */
struct skv_backend_ops {
    const char *name;

    /* --- infrastructure ---------------------------------------------------- */
    /* SKV_OK if usable; otherwise SKV_ERR_NO_DEVICE and a message in msg. */
    skv_status (*probe)(char *msg, size_t cap);
    /* Zero-initialized allocation; NULL on failure. free accepts NULL. */
    void *(*mem_alloc)(size_t bytes, skv_mem_kind kind);
    void (*mem_free)(void *p, skv_mem_kind kind);
    /* 2D copy (cudaMemcpy2D semantics): height rows of width bytes. Either side
       may be host or backend memory. */
    skv_status (*copy2d)(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                         size_t height);
    /* Finiteness of a strided [n_a, n_b, len] bf16 tensor, element (i, j, l) at
       x[i*s_a + j*s_b + l]: SKV_OK, or SKV_ERR_NONFINITE and the logical index
       (i*n_b + j)*len + l of the first non-finite element in *first_bad. A
       contiguous tensor of n values is (1, 0, 1, 0, n). */
    skv_status (*check_finite)(const skv_bf16 *x, int64_t n_a, int64_t s_a, int64_t n_b, int64_t s_b,
                               int64_t len, int64_t *first_bad);
    /* SKV_OK if lo <= x[i] < hi for all i < n; otherwise SKV_ERR_INVALID_ARGUMENT,
       the first bad index in *first_bad and its value in *value. */
    skv_status (*check_range)(const int32_t *x, int64_t n, int64_t lo, int64_t hi, int64_t *first_bad,
                              int32_t *value);
    /* lib/ calls set_threads(config.n_threads) on the calling thread when a
       prefill or decode starts and set_threads(0) when it ends: the slots in
       between run with that many threads (0 = the default). Must not change
       the caller's threading state (OpenMP ICVs, BLAS). Optional. */
    void (*set_threads)(int32_t n_threads);
    /* The device of a cache (config.cuda_device): device_enter saves the calling thread's current
       device in *saved and, when device >= 0 differs from it, makes device current (-1: changes
       nothing); device_leave(saved) makes saved current again. lib/ brackets every call on a cache
       with the two, and create resolves -1 to the current device. Neither synchronizes. Optional
       (NULL: the backend has no devices). */
    skv_status (*device_enter)(int32_t device, int32_t *saved, char *msg, size_t cap);
    void (*device_leave)(int32_t saved);
    /* Frees what op-level calls keep between calls (cuda: the factorization
       workspace); skv_op_release. Optional. */
    void (*op_release)(void);
    /* Arena bytes the decode slots (score_select, rebuild_keys, sparse_attention)
       need for one sequence of a cache with this config: at most cand_max
       candidates, at most max_attn_tokens tokens per attention call. The slots
       run one after another, so this is the largest of the three. Optional
       (NULL: no arena; decode then allocates and the count shows it). */
    size_t (*decode_ws_bytes)(const skv_config *cfg, int32_t cand_max, int64_t max_attn_tokens);

    /* --- ops (one public skv_op_* per slot; see shadowkv.h) ----------------- */
    /* route: the caller's choice (ref has one route for all but CANONICAL, which every
       backend implements as docs/DESIGN.md section 10 defines it, bit for bit) */
    skv_status (*factorize)(skv_factorize_route route, int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u,
                            float *w);
    skv_status (*rope)(const skv_rope_config *rope, int32_t head_dim, int64_t n_tokens,
                       int32_t n_heads, int64_t pos0, const float *cos_tab, const float *sin_tab,
                       const skv_bf16 *in, skv_bf16 *out);
    skv_status (*landmarks_outliers)(int32_t n_chunks, int32_t chunk, int32_t n_kv_heads,
                                     int32_t head_dim, int32_t n_outliers, const skv_bf16 *k_post,
                                     int32_t *outlier_ids, int32_t *candidate_ids,
                                     skv_bf16 *landmarks);
    /* Per KV head h: k_h chunks by sp (skv_select_head defines the rule; every backend must
       give the same k_h and set bit for bit), their candidate indices increasing into
       sel_idx[h*stride .. +k_h) and -1 into the rest of the row (stride = sp->stride), chunk ids
       likewise into sel_ids (when it and candidate_ids are non-NULL), k_h into counts[h] (when
       non-NULL). amax [Hk, n_cand] as before. */
    skv_status (*score_select)(int32_t n_q_heads, int32_t n_kv_heads, int32_t head_dim,
                               int32_t n_cand, const skv_select_params *sp, float scale, const skv_bf16 *q,
                               const skv_bf16 *landmarks, const int32_t *candidate_ids,
                               int32_t *sel_idx, int32_t *sel_ids, float *amax, int32_t *counts, skv_ws *ws);
    /* counts [Hk] or NULL: head h rebuilds only its first counts[h] chunks (chunk_ids rows keep
       the stride n_select; entries past counts[h] may be -1 and are not read; k_out rows of head
       h past counts[h] * chunk tokens are left as they are). NULL: n_select chunks every head. */
    skv_status (*rebuild_keys)(const skv_rope_config *rope, int32_t head_dim, int32_t n_kv_heads,
                               int32_t rank, int32_t chunk, int32_t n_select, int64_t n,
                               const skv_bf16 *u, const skv_bf16 *w, const int32_t *chunk_ids,
                               const int32_t *counts, const float *cos_tab, const float *sin_tab,
                               skv_bf16 *k_out, skv_ws *ws);
    /* counts as rebuild_keys (idx entries past counts[h] are not read). store: [Hk, n_store] chunk
       records of value_dtype (skv_value_chunk_bytes); v_out [Hk, n_select, c, D] bf16, the fp8
       records decoded (skv_fp8_decode_chunk: exact, the same bits on every backend). */
    skv_status (*gather_values)(int32_t n_kv_heads, int32_t head_dim, int32_t chunk,
                                int32_t n_store, int32_t n_select, int32_t value_dtype, const void *store,
                                const int32_t *idx, const int32_t *counts, skv_bf16 *v_out);
    /* head_tokens: NULL, or [n_spans][n_kv_heads]: span s has head_tokens[s*n_kv_heads + h]
       tokens for KV head h (<= spans[s].n_tokens), in place of spans[s].n_tokens. The
       attention of each head is then exactly the attention over its own spans (per-head
       selected spans of SKV_SELECT_MASS and of the rescoring; section 4.7). */
    skv_status (*sparse_attention)(int32_t n_q_heads, int32_t n_kv_heads, int32_t head_dim,
                                   float scale, const skv_bf16 *q, int32_t n_spans,
                                   const skv_kv_span *spans, const int64_t *head_tokens, float *out,
                                   skv_ws *ws);
    /* The canonical rules of the reproducible mode (docs/DESIGN.md section 10): same
       arguments as rebuild_keys and sparse_attention, outputs bitwise equal on every
       backend. A cache with config.reproducible runs its decode through these (or, with
       cache-level slots, through the backend's own canonical kernels). */
    skv_status (*rebuild_keys_canonical)(const skv_rope_config *rope, int32_t head_dim, int32_t n_kv_heads,
                                         int32_t rank, int32_t chunk, int32_t n_select, int64_t n,
                                         const skv_bf16 *u, const skv_bf16 *w, const int32_t *chunk_ids,
                                         const int32_t *counts, const float *cos_tab, const float *sin_tab,
                                         skv_bf16 *k_out, skv_ws *ws);
    skv_status (*sparse_attention_canonical)(int32_t n_q_heads, int32_t n_kv_heads, int32_t head_dim, float scale,
                                             const skv_bf16 *q, int32_t n_spans, const skv_kv_span *spans,
                                             const int64_t *head_tokens, float *out, skv_ws *ws);
    skv_status (*full_attention)(int32_t n_q_heads, int32_t n_kv_heads, int32_t head_dim,
                                 float scale, const skv_bf16 *q, int64_t n_tokens,
                                 const skv_bf16 *k, const skv_bf16 *v, float *out);

    /* --- cache level (optional) ------------------------------------------------
       A backend that runs a cache's prefill and decode itself (cuda: batched
       kernels on the cache's stream, per-step state on the device) fills these;
       NULL means lib/ runs the op slots above one sequence at a time. lib/ has
       validated every argument and the cache state before calling; on an error
       the backend writes a message into msg and the cache must be unchanged. */
    /* Extra device bytes cache_open will allocate for this config (for skv_cache_memory). */
    size_t (*cache_bytes)(const skv_config *cfg, const skv_layout *lay);
    skv_status (*cache_open)(void **bctx, const skv_config *cfg, const skv_layout *lay, char *dev, char *host,
                             char *msg, size_t cap);
    void (*cache_close)(void *bctx); /* waits for the cache's work, frees; NULL accepted */
    /* Prefill of (layer, seq): N context chunks, its growing regions at *mem (the fixed layout's
       or pool pages); returns once the caller's buffers are free (work beside the cache's stream
       may go on: cache_seq_ready tells when it is done). */
    skv_status (*cache_prefill)(void *bctx, int32_t layer, int32_t seq, int64_t n, int32_t n_chunks,
                                const skv_slot_mem *mem, const skv_bf16 *k_pre, const skv_bf16 *v,
                                const skv_bf16 *k_post, skv_stats *stats, char *msg, size_t cap);
    /* Enqueues one decode step of layer for n_active sequences: host list seqs[0..n_active)
       (lib/ checked it: distinct, prefilled, in step, below capacity) when dev_seqs is NULL;
       otherwise the count *dev_count and the list dev_seqs in device memory, read and checked on
       the device (n_active = batch_size then: the row capacity of q, k, v, out; a bad list is a
       deferred error like NaN). Row i of q, k, v, out belongs to the i-th listed sequence. The
       whole-batch step is the list 0..B-1. Checks q, k, v for NaN/Inf on the device (an error
       is deferred to cache_sync). */
    skv_status (*cache_decode)(void *bctx, int32_t layer, int32_t n_active, const int32_t *seqs,
                               const int32_t *dev_count, const int32_t *dev_seqs, const skv_bf16 *q,
                               const skv_bf16 *k, const skv_bf16 *v, float *out, char *msg, size_t cap);
    /* Returns sequence seq, all its layers, to the free state, ordered on the cache's stream
       after the work enqueued so far (the descriptors: no prompt, n_gen 0, no selection; chunk
       caches emptied). No allocation; need not wait. Required with cache_decode. */
    skv_status (*cache_release)(void *bctx, int32_t seq, char *msg, size_t cap);
    /* Copies bytes from src (host or device memory) to dst (the cache's device memory) after the
       work enqueued on the cache's stream so far, and returns when the copy is done: the staging
       of a prompt in pieces, whose pool pages a released sequence's steps may still be reading.
       Optional (NULL: copy2d, for backends whose work is done when a call returns). */
    skv_status (*cache_copy)(void *bctx, void *dst, const void *src, size_t bytes, char *msg, size_t cap);
    /* *ready = 1 when the work of (layer, seq)'s prefill beside the cache's stream is done
       (cudaEventQuery; never waits). Optional (NULL: always ready after cache_prefill). */
    skv_status (*cache_seq_ready)(void *bctx, int32_t layer, int32_t seq, int32_t *ready, char *msg, size_t cap);
    /* Waits for the cache's work, adds the finished steps' phase times to *stats and
       their per-layer counters to layer_stats[0 .. n_layers) (head_steps, attended_tokens,
       context_tokens, selected_chunks only; the backend then restarts its own counters
       from zero, so each step is added once), and reports a deferred error (then refreshes
       n_gen/has_selection of every state from the device, since the failed step changed
       nothing there). */
    skv_status (*cache_sync)(void *bctx, skv_seq_state *states, skv_stats *stats, skv_layer_stats *layer_stats,
                             char *msg, size_t cap);
    /* After skv_cache_load wrote a snapshot's tensors into the arenas of a fresh cache (the
       cache's own copy2d; nothing else has run on it): makes the backend's per-slot state
       agree with states[0 .. L*B) (prompt shape, n_gen, has_selection), empties the chunk
       caches of host-placed slots, and returns once that is done. Optional (NULL: lib/
       keeps all state itself and empties the chunk caches in host memory). */
    skv_status (*cache_set_states)(void *bctx, const skv_seq_state *states, char *msg, size_t cap);
};

/* The registered tables. */
extern const struct skv_backend_ops skv_ref_ops;
/* Fills *ops from ref's table, then overrides with cpu slots. */
void skv_cpu_fill_ops(struct skv_backend_ops *ops);

/*
 * The cuda backend lives in its own shared object, libshadowkv-cuda.so.0, that
 * lib/skv_cuda_loader.c opens at run time the first time the cuda table is asked
 * for (so libshadowkv.so itself needs no CUDA library to load). A static link can
 * instead put the plugin's archive into the program (libshadowkv-cuda.a with
 * -Wl,--undefined=skv_cuda_plugin_init); the loader then uses that copy.
 *
 * The plugin exports one function, skv_cuda_plugin_init. The loader hands it the
 * services the library provides and a zeroed table; the plugin checks the ABI
 * numbers, fills the table and returns SKV_OK, or returns an error with a message.
 * SKV_PLUGIN_ABI changes whenever struct skv_backend_ops, skv_host_services or any
 * type a slot takes changes, so a plugin from another build is refused, never
 * called through a mismatched table.
 */
#define SKV_PLUGIN_ABI 7
#define SKV_CUDA_PLUGIN_SONAME "libshadowkv-cuda.so.0"
#define SKV_CUDA_PLUGIN_INIT "skv_cuda_plugin_init"

typedef struct skv_host_services {
    int32_t abi;       /* SKV_PLUGIN_ABI of the library */
    size_t ops_size;   /* sizeof(struct skv_backend_ops) of the library */
    /* A slot's failure detail (skv_backend_note of the library). */
    void (*note)(const char *detail);
} skv_host_services;

typedef skv_status (*skv_cuda_plugin_init_fn)(const skv_host_services *host, struct skv_backend_ops *ops,
                                              char *msg, size_t cap);

/* The cuda table: the plugin's, once loaded; otherwise a table whose probe says why
   the plugin is not usable (SKV_ERR_NO_DEVICE) and whose other slots are NULL. */
const struct skv_backend_ops *skv_cuda_ops(void);

/* Registry: the table of a resolved backend (REF/CPU/CUDA), or NULL. */
const struct skv_backend_ops *skv_backend_ops_get(skv_backend backend);

/* Shared helpers for backends (host code, lib/skv_util.c). */

/*
 * Top-k by key, descending, ties by lower index first; writes the k winning
 * indices in increasing index order into out. keys[0..n) are ordering keys
 * (see skv_select_key / skv_outlier_key). If ascending != 0 the k smallest
 * keys win instead. scratch: n int32 of workspace.
 */
void skv_topk_indices(const float *keys, int32_t n, int32_t k, int ascending, int32_t *scratch,
                      int32_t *out);

/*
 * The end of score_select for one KV head: a[0..n_cand) (group-max
 * probabilities, overwritten with ordering keys key_j = skv_select_key(a_j)) ->
 * the head's count k (returned) and its k winners in increasing index order in
 * sel_idx[0..k), -1 in sel_idx[k..sp->stride), and their chunk ids likewise in
 * sel_ids when both sel_ids and candidate_ids are non-NULL. The count:
 *   FIXED: k = sp->cap.
 *   MASS (docs/DESIGN.md section 4.5): m_j = fmaxf(key_j, 0); A = skv_canonical_sum(m);
 *   target = sp->mass * A; t_1..t_cap the cap best candidates in the order of section 5.3
 *   (larger key, then lower index); cum = 0, k = cap; for i = 1..cap: cum += m_{t_i};
 *   if cum >= target { k = i; stop }; k = max(k, sp->floor). (skv_mass_count in
 *   skv_numerics.h is steps 6-7, for device code.)
 * scratch: 2 * n_cand int32.
 */
int32_t skv_select_head(float *a, int32_t n_cand, const skv_select_params *sp, int32_t *scratch, int32_t *sel_idx,
                        const int32_t *candidate_ids, int32_t *sel_ids);

/*
 * The rescoring of one KV head (docs/DESIGN.md 4.5.1): the W first-stage candidates (their
 * candidate indices cand_idx[0..W), increasing; keys [W c][D] their canonical keys in that
 * order) ranked by skv_rescore_masses, then skv_select_head's rule over them with sp (cap <=
 * min(W, sp->stride)). Writes the head's winners as candidate indices in increasing order to
 * sel_idx[0..k) and -1 to sel_idx[k..sp->stride), their chunk ids (candidate_ids[sel_idx])
 * to sel_ids likewise when non-NULL; returns k. Scratch: s [W c] and b [W] float,
 * scratch [2 W] and local [sp->stride] int32.
 */
int32_t skv_rescore_head(int32_t G, int32_t D, int32_t c, int32_t W, float scale, const skv_bf16 *q,
                         const skv_bf16 *keys, const skv_select_params *sp, const int32_t *cand_idx,
                         const int32_t *candidate_ids, float *s, float *b, int32_t *scratch, int32_t *local,
                         int32_t *sel_idx, int32_t *sel_ids);

/* Decode-arena bytes of the rescoring's scratch for W candidates of c tokens and S-entry rows
   (skv_rescore_head's s, b, scratch and local); 0 when W = 0. */
size_t skv_rescore_ws_bytes(int32_t W, int32_t c, int32_t S);

/* Monotonic wall clock in milliseconds. */
double skv_now_ms(void);

#ifdef __cplusplus
}
#endif

#endif /* SKV_BACKEND_H */
