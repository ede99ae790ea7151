/*
 * skv_cuda_ops.cu - the op-level slots of the cuda backend (skv_op_* of the public
 * API): each runs the cache's kernels with B = 1 on the legacy default stream,
 * allocates the scratch it needs, and synchronizes before returning.
 *
 *   factorize, op_release       skv_cuda_factorize (skv_cuda_factor.cu), one workspace
 *                               kept for the process
 *   rope                        skv_cuda_rope (skv_cuda_rope.cu)
 *   landmarks_outliers          skv_cuda_landmarks_outliers (skv_cuda_landmarks.cu)
 *   score_select                skv_cuda_select_step (skv_cuda_select.cu; step 1 in
 *                               skv_cuda_score.cu) in a decode workspace of its own
 *                               (skv_cuda_dws_layout, skv_cuda_cache.cu)
 *   rebuild_keys                skv_cuda_rebuild
 *   rebuild_keys_canonical      skv_cuda_canon_wprep, skv_cuda_canon_rebuild
 *   gather_values               skv_cuda_gather (skv_cuda_copy.cu)
 *   sparse_attention,           skv_cuda_span_attention (its partials, then
 *   full_attention              skv_cuda_combine of skv_cuda_combine.cu)
 *   sparse_attention_canonical  skv_cuda_canon_span_attention
 * (skv_cuda.h says which file holds each launcher.)
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_internal.h"

/* Device scratch for one op-level call; freed by skv_cuda_op_end. */
typedef struct {
    void *p[6];
    int n;
} skv_cuda_op;

static void *skv_cuda_op_alloc(skv_cuda_op *op, size_t bytes)
{
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    op->p[op->n++] = p;
    return p;
}

/* Waits for the launches, frees the scratch, maps errors (launch error e first). */
static skv_status skv_cuda_op_end(skv_cuda_op *op, cudaError_t e, const char *what)
{
    char *msg = NULL;
    size_t cap = 0;
    cudaError_t s = cudaDeviceSynchronize();
    for (int i = 0; i < op->n; i++) cudaFree(op->p[i]);
    op->n = 0;
    if (e != cudaSuccess) return skv_cuda_err(e, what, msg, cap);
    if (s != cudaSuccess) return skv_cuda_err(s, what, msg, cap);
    return SKV_OK;
}

static skv_status skv_cuda_op_oom(skv_cuda_op *op, const char *what, size_t bytes)
{
    skv_cuda_op_end(op, cudaSuccess, what);
    skv_cuda_note("%s: cudaMalloc of %zu bytes failed", what, bytes);
    return SKV_ERR_OUT_OF_MEMORY;
}

/* A B = 1 descriptor in device memory. */
static skv_cuda_seq *skv_cuda_op_seq(skv_cuda_op *op, const skv_cuda_seq *h)
{
    skv_cuda_seq *d = (skv_cuda_seq *)skv_cuda_op_alloc(op, sizeof *d);
    if (d && cudaMemcpy(d, h, sizeof *d, cudaMemcpyHostToDevice) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return d;
}

/*
 * Op-level factorization. One workspace (handles + buffers, skv_cuda_factor) is kept for
 * the process and reused while (d, r) match and n fits, so repeated calls run warm; it is
 * rebuilt for a larger n or another shape, and freed by skv_op_release (the library
 * registers no exit handler). A call that finds it busy (another thread), or made on
 * another device than the one it lives on, builds and frees a private one.
 */
static pthread_mutex_t skv_cuda_fop_lock = PTHREAD_MUTEX_INITIALIZER;
static skv_cuda_factor *skv_cuda_fop;
static int64_t skv_cuda_fop_n;
static int32_t skv_cuda_fop_d, skv_cuda_fop_r;
static int skv_cuda_fop_dev; /* the device it lives on (a call on another device builds a private one) */

void skv_cuda_op_release(void)
{
    pthread_mutex_lock(&skv_cuda_fop_lock);
    skv_cuda_factor_destroy(skv_cuda_fop);
    skv_cuda_fop = NULL;
    pthread_mutex_unlock(&skv_cuda_fop_lock);
}

skv_status skv_cuda_factorize_op(skv_factorize_route route, int64_t n, int32_t d, int32_t r, const skv_bf16 *a,
                                 float *u, float *w)
{
    char msg[SKV_ERRMSG_CAP];
    skv_status st = SKV_OK;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) (void)cudaGetLastError();
    int locked = pthread_mutex_trylock(&skv_cuda_fop_lock) == 0;
    if (locked && skv_cuda_fop && skv_cuda_fop_dev != dev) { /* kept for its own device */
        pthread_mutex_unlock(&skv_cuda_fop_lock);
        locked = 0;
    }
    if (locked) {
        if (skv_cuda_fop && (skv_cuda_fop_d != d || skv_cuda_fop_r != r || skv_cuda_fop_n < n)) {
            skv_cuda_factor_destroy(skv_cuda_fop);
            skv_cuda_fop = NULL;
        }
        if (!skv_cuda_fop) {
            st = skv_cuda_factor_create(&skv_cuda_fop, n, d, r, 0, NULL, msg, sizeof msg);
            skv_cuda_fop_n = n, skv_cuda_fop_d = d, skv_cuda_fop_r = r, skv_cuda_fop_dev = dev;
        }
        if (st == SKV_OK) st = skv_cuda_factorize(skv_cuda_fop, route, n, a, u, w, 0, 1, msg, sizeof msg);
        pthread_mutex_unlock(&skv_cuda_fop_lock);
    } else {
        skv_cuda_factor *f = NULL;
        st = skv_cuda_factor_create(&f, n, d, r, 0, NULL, msg, sizeof msg);
        if (st == SKV_OK) st = skv_cuda_factorize(f, route, n, a, u, w, 0, 1, msg, sizeof msg);
        skv_cuda_factor_destroy(f);
    }
    if (st) skv_cuda_note("%s", msg);
    return st;
}

skv_status skv_cuda_rope_op(const skv_rope_config *rope, int32_t D, int64_t n_tokens, int32_t n_heads,
                            int64_t pos0, const float *cos_tab, const float *sin_tab, const skv_bf16 *in,
                            skv_bf16 *out)
{
    skv_cuda_op op = {{0}, 0};
    cudaError_t e = skv_cuda_rope(0, D, skv_rotary_dim(rope, D), rope->interleaved, n_tokens, n_heads, pos0,
                                  cos_tab, sin_tab, in, out);
    return skv_cuda_op_end(&op, e, "rope");
}

skv_status skv_cuda_landmarks_op(int32_t N, int32_t c, int32_t Hk, int32_t D, int32_t O,
                                 const skv_bf16 *k_post, int32_t *outlier_ids, int32_t *candidate_ids,
                                 skv_bf16 *landmarks)
{
    skv_cuda_op op = {{0}, 0};
    size_t bytes = skv_cuda_landmarks_scratch_bytes(N, Hk, D);
    void *scratch = skv_cuda_op_alloc(&op, bytes);
    if (!scratch) return skv_cuda_op_oom(&op, "landmarks_outliers", bytes);
    cudaError_t e = skv_cuda_landmarks_outliers(0, N, c, Hk, D, O, k_post, outlier_ids, candidate_ids, landmarks,
                                                scratch);
    return skv_cuda_op_end(&op, e, "landmarks_outliers");
}

skv_status skv_cuda_score_select_op(int32_t Hq, int32_t Hk, int32_t D, int32_t n_cand, const skv_select_params *sp,
                                    float scale, const skv_bf16 *q, const skv_bf16 *landmarks,
                                    const int32_t *candidate_ids, int32_t *sel_idx, int32_t *sel_ids,
                                    float *amax, int32_t *counts, skv_ws *ws)
{
    (void)ws;
    skv_cuda_op op = {{0}, 0};
    skv_cuda_seq h;
    memset(&h, 0, sizeof h);
    h.landmarks = landmarks;
    h.cand_ids = candidate_ids;
    h.n_cand = n_cand;
    const int32_t S = sp->stride;
    const int mass = sp->mode == SKV_SELECT_MASS;
    skv_cuda_shape sh;
    memset(&sh, 0, sizeof sh);
    sh.B = 1, sh.Hq = Hq, sh.Hk = Hk, sh.D = D, sh.S = S, sh.cand_max = n_cand, sh.scale = scale, sh.c = 1;
    sh.sel_mode = mass ? SKV_SELECT_MASS : SKV_SELECT_FIXED, sh.sel_cap = sp->cap, sh.sel_min = sp->floor;
    sh.sel_mass = sp->mass;
    skv_cuda_items it = {1, 0, 0, 0};
    skv_cuda_dws dws;
    memset(&dws, 0, sizeof dws);
    const size_t bytes = skv_cuda_dws_layout(&dws, NULL, 1, Hq, Hk, D, S, 1, n_cand, it, 0, 0, mass, 0);
    char *base = (char *)skv_cuda_op_alloc(&op, bytes);
    skv_cuda_seq *d = skv_cuda_op_seq(&op, &h);
    if (!base || !d) return skv_cuda_op_oom(&op, "score_select", bytes);
    skv_cuda_dws_layout(&dws, base, 1, Hq, Hk, D, S, 1, n_cand, it, 0, 0, mass, 0);
    cudaError_t e = skv_cuda_dws_clear(&dws, 0);
    skv_cuda_io io = {q, NULL, NULL, NULL};
    /* the staged score path needs 16-byte aligned rows */
    const int tiled = D % 8 == 0 && ((uintptr_t)landmarks & 15) == 0;
    if (e == cudaSuccess) e = skv_cuda_select_step(0, &sh, d, &dws, &io, tiled, 0, amax, NULL, NULL, NULL);
    /* the selection and the counts are in the workspace: copy them out */
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(sel_idx, dws.sel_idx, (size_t)Hk * S * sizeof(int32_t), cudaMemcpyDefault, 0);
    if (e == cudaSuccess && sel_ids && candidate_ids)
        e = cudaMemcpyAsync(sel_ids, dws.sel_ids, (size_t)Hk * S * sizeof(int32_t), cudaMemcpyDefault, 0);
    if (e == cudaSuccess && counts)
        e = cudaMemcpyAsync(counts, dws.sel_cnt, (size_t)Hk * sizeof(int32_t), cudaMemcpyDefault, 0);
    return skv_cuda_op_end(&op, e, "score_select");
}

/* The per-head forms of the op slots (counts, head_tokens) are lib/'s own decode path for backends
   without cache-level slots; the cuda backend runs them in its cache, so its op slots refuse them. */
static skv_status skv_cuda_op_per_head(const char *what)
{
    skv_cuda_note("%s: the per-head form (counts or head_tokens) is not an op-level call of the cuda backend "
                  "(its caches run it in their decode)", what);
    return SKV_ERR_UNSUPPORTED;
}

/* The op-level rebuilds' set-up: the one sequence (u, w, n) on the device and its shape (B = 1). */
static skv_cuda_seq *skv_cuda_rebuild_setup(skv_cuda_op *op, const skv_rope_config *rope, int32_t D, int32_t Hk,
                                            int32_t r, int32_t c, int32_t S, int64_t n, const skv_bf16 *u,
                                            const skv_bf16 *w, const float *cos_tab, const float *sin_tab,
                                            skv_cuda_shape *sh)
{
    skv_cuda_seq h;
    memset(&h, 0, sizeof h);
    h.u = u;
    h.w = w;
    h.n = n;
    memset(sh, 0, sizeof *sh);
    sh->B = 1, sh->Hk = Hk, sh->D = D, sh->c = c, sh->S = S, sh->r = r;
    sh->rotary_dim = skv_rotary_dim(rope, D), sh->interleaved = rope->interleaved;
    sh->cos_tab = cos_tab, sh->sin_tab = sin_tab;
    return skv_cuda_op_seq(op, &h);
}

skv_status skv_cuda_rebuild_op(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r, int32_t c,
                               int32_t S, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                               const int32_t *chunk_ids, const int32_t *counts, const float *cos_tab,
                               const float *sin_tab, skv_bf16 *k_out, skv_ws *ws)
{
    (void)ws;
    if (counts) return skv_cuda_op_per_head("rebuild_keys");
    skv_cuda_op op = {{0}, 0};
    skv_cuda_shape sh;
    skv_cuda_seq *d = skv_cuda_rebuild_setup(&op, rope, D, Hk, r, c, S, n, u, w, cos_tab, sin_tab, &sh);
    if (!d) return skv_cuda_op_oom(&op, "rebuild_keys", sizeof(skv_cuda_seq));
    return skv_cuda_op_end(&op, skv_cuda_rebuild(0, &sh, d, chunk_ids, k_out), "rebuild_keys");
}

/* Op level: the canonical rebuild (B = 1, chunk_ids [Hk, S]). */
skv_status skv_cuda_rebuild_canonical_op(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r,
                                         int32_t c, int32_t S, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                                         const int32_t *chunk_ids, const int32_t *counts, const float *cos_tab,
                                         const float *sin_tab, skv_bf16 *k_out, skv_ws *ws)
{
    (void)ws;
    if (counts) return skv_cuda_op_per_head("rebuild_keys_canonical");
    skv_cuda_op op = {{0}, 0};
    skv_cuda_shape sh;
    skv_cuda_seq *d = skv_cuda_rebuild_setup(&op, rope, D, Hk, r, c, S, n, u, w, cos_tab, sin_tab, &sh);
    if (!d) return skv_cuda_op_oom(&op, "rebuild_keys_canonical", sizeof(skv_cuda_seq));
    /* W's fixed point for the tensor-core kernel, prepared for this call */
    void *wq = NULL;
    cudaError_t e = cudaSuccess;
    if (skv_cuda_canon_uses_wq(&sh, 0)) {
        const size_t wb = skv_cuda_canon_wq_bytes(Hk, D, r);
        if (!(wq = skv_cuda_op_alloc(&op, wb))) return skv_cuda_op_oom(&op, "rebuild_keys_canonical", wb);
        e = skv_cuda_canon_wprep(0, Hk, D, r, w, wq);
    }
    if (e == cudaSuccess) e = skv_cuda_canon_rebuild(0, &sh, d, chunk_ids, k_out, wq);
    return skv_cuda_op_end(&op, e, "rebuild_keys_canonical");
}

/* Op level: the canonical attention (scratch: the Hq x T weights). */
skv_status skv_cuda_sparse_attention_canonical_op(int32_t Hq, int32_t Hk, int32_t D, float scale,
                                                  const skv_bf16 *q, int32_t n_spans, const skv_kv_span *spans,
                                                  const int64_t *head_tokens, float *out, skv_ws *ws)
{
    (void)ws;
    if (head_tokens) return skv_cuda_op_per_head("sparse_attention_canonical");
    skv_cuda_op op = {{0}, 0};
    int64_t total = 0;
    for (int32_t i = 0; i < n_spans; i++) total += spans[i].n_tokens;
    const size_t bytes = (size_t)Hq * (size_t)total * sizeof(float);
    float *e = (float *)skv_cuda_op_alloc(&op, bytes);
    if (!e) return skv_cuda_op_oom(&op, "sparse_attention_canonical", bytes);
    return skv_cuda_op_end(&op, skv_cuda_canon_span_attention(0, Hq, Hk, D, scale, q, n_spans, spans, out, e, total),
                           "sparse_attention_canonical");
}

skv_status skv_cuda_gather_op(int32_t Hk, int32_t D, int32_t c, int32_t n_store, int32_t S, int32_t value_dtype,
                              const void *store, const int32_t *idx, const int32_t *counts, skv_bf16 *v_out)
{
    if (counts) return skv_cuda_op_per_head("gather_values");
    skv_cuda_op op = {{0}, 0};
    return skv_cuda_op_end(&op, skv_cuda_gather(0, Hk, D, c, n_store, S, value_dtype, store, idx, v_out),
                           "gather_values");
}

skv_status skv_cuda_sparse_attention_op(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                        int32_t n_spans, const skv_kv_span *spans, const int64_t *head_tokens,
                                        float *out, skv_ws *ws)
{
    (void)ws;
    if (head_tokens) return skv_cuda_op_per_head("sparse_attention");
    skv_cuda_op op = {{0}, 0};
    int64_t total = 0;
    for (int32_t i = 0; i < n_spans; i++) total += spans[i].n_tokens;
    skv_cuda_dws dws;
    memset(&dws, 0, sizeof dws);
    const skv_cuda_items it = skv_cuda_span_items(1, Hq, Hk, D, total);
    const size_t bytes = (size_t)Hq * it.n_items * ((size_t)D * sizeof(float) + sizeof(float2)) + 256;
    char *base = (char *)skv_cuda_op_alloc(&op, bytes);
    if (!base) return skv_cuda_op_oom(&op, "sparse_attention", bytes);
    dws.it = it;
    dws.part_acc = (float *)base;
    dws.part_ml = (float2 *)(base + (((size_t)Hq * it.n_items * D * sizeof(float) + 255) & ~(size_t)255));
    return skv_cuda_op_end(&op, skv_cuda_span_attention(0, Hq, Hk, D, scale, q, n_spans, spans, out, &dws),
                           "sparse_attention");
}

skv_status skv_cuda_full_attention_op(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                      int64_t n_tokens, const skv_bf16 *k, const skv_bf16 *v, float *out)
{
    skv_kv_span span = {k, v, n_tokens, D, (int64_t)Hk * D};
    return skv_cuda_sparse_attention_op(Hq, Hk, D, scale, q, 1, &span, NULL, out, NULL);
}
