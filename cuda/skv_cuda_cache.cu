/*
 * skv_cuda_cache.cu - the cache pipeline of the cuda backend: the slots cache_bytes,
 * cache_open, cache_close, cache_decode, cache_sync and cache_set_states (registered by
 * skv_cuda_fill_ops; cache_prefill is in skv_cuda_prefill.cu, cache_release and
 * cache_seq_ready in skv_cuda_serve.cu). The decode workspace's layout and the cache's shapes
 * and items are in skv_cuda_workspace.cu.
 *
 * A cache runs on its stream (config.cuda_stream; NULL = the legacy default
 * stream). Everything it needs is allocated at create: the arenas (lib/), the
 * decode workspace for the whole batch, the prefill scratch for
 * max_prompt_len tokens, the factorization workspace, the per-(layer,
 * sequence) descriptors on the device, a step's rows, a ring of timing events
 * and one of host lists. Prefill runs beside the stream (skv_cuda_prefill.cu);
 * the serving slots are in skv_cuda_serve.cu.
 *
 * Decode is a fixed launch sequence on the stream (no allocation, no
 * synchronization): the step's rows from its active list, input check, scores,
 * selection, rebuild, gather, attention, append. Per-step state (n_gen, the
 * published selection) lives on the device and is advanced there, so nothing in
 * the sequence depends on the host; NaN/Inf inputs and bad device lists are
 * found on the device and reported by cache_sync.
 *
 * The launchers each part runs (skv_cuda.h says which file holds each):
 *   a decode step (skv_cuda_enqueue_step)  skv_cuda_act_rows; skv_cuda_select_step (steps 1-3; with the
 *       rescoring, config.select_candidates, skv_cuda_rescore_step instead); then
 *       skv_cuda_fetch (host slots, side stream), skv_cuda_attend,
 *       skv_cuda_attend_missed, skv_cuda_combine; or in the reproducible mode
 *       skv_cuda_canon_decode_resident (side stream), skv_cuda_fetch,
 *       skv_cuda_canon_decode_rebuild, skv_cuda_canon_decode_attend,
 *       skv_cuda_combine_append; a dense layer's step: skv_cuda_score (no candidates),
 *       skv_cuda_attend, skv_cuda_combine (reproducible: skv_cuda_canon_decode_resident,
 *       skv_cuda_canon_decode_attend, skv_cuda_combine_append)
 *   decode (skv_cuda_cache_decode)  a layer's step from step 1 on is captured into a
 *       graph at its first step (skv_cuda_capture_layer) and replayed after with the
 *       score node's tensors updated (skv_cuda_score_node_set_io), after the rows
 *       kernel launched with the step's list; one step in SKV_CUDA_PHASE_EVERY, and a
 *       step inside the caller's capture, is launched directly (rows included)
 */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_internal.h"
#include "skv_numerics.h"
#include "skv_plan.h"

/* ---- the cache ------------------------------------------------------------------------------ */

#include "skv_cuda_cache.h"


static_assert(offsetof(skv_cuda_seq, has_sel) == offsetof(skv_cuda_seq, n_gen) + sizeof(int32_t),
              "cache_sync reads n_gen and has_sel in one strided copy");

/* Workspace sizes of a cache, in one place for cache_bytes and cache_open. */
typedef struct {
    size_t dws, kp, uf, wf, lm, seqs, factor, lstats;
    size_t wq_slot, wq; /* reproducible mode or the rescoring: one slot's prepared W (skv_cuda_seq.wq), all L B
                           slots'; else 0 */
    size_t rank;        /* rank == 0: the rank choice's scratch and the slots' ranks; else 0 */
    size_t act;         /* a step's rows, the host list's copy, the marks, the deferred list error */
} skv_cuda_sizes; /* kp: also the size of each of the two staging buffers */

/* Whether any sparse slot keeps its values on the host (so has a chunk cache): in the pool mode every
   one when values_host, else none; otherwise the slots past n_dev_slots. */
static int skv_cuda_has_host(const skv_layout *lay)
{
    return lay->pooled ? lay->values_host != 0 : lay->n_dev_slots < lay->n_sparse_slots;
}

/* Device bytes of a step's rows [B], the host list's copy [B], the marks [B] and the deferred
   list error, each 256-byte aligned (carved in that order by cache_open). */
static size_t skv_cuda_act_part(size_t bytes) { return (bytes + 255) / 256 * 256; }
static size_t skv_cuda_act_bytes(int32_t B)
{
    return skv_cuda_act_part((size_t)B * sizeof(skv_cuda_seq)) + 2 * skv_cuda_act_part((size_t)B * sizeof(int32_t)) +
           skv_cuda_act_part(sizeof(unsigned long long));
}

/* The config as the cache's kernels see it: rank == 0 sizes everything for rank_max. */
static skv_config skv_cuda_sized_cfg(const skv_config *c)
{
    skv_config e = *c;
    e.rank = skv_cfg_rank(c);
    return e;
}

static skv_cuda_sizes skv_cuda_sizes_of(const skv_config *c0, const skv_layout *lay)
{
    const skv_config ce = skv_cuda_sized_cfg(c0), *c = &ce;
    skv_cuda_sizes z;
    size_t Hk = (size_t)c->n_kv_heads, D = (size_t)c->head_dim, HkD = Hk * D;
    size_t n = (size_t)c->max_prompt_len, r = (size_t)c->rank;
    int32_t N_max = (int32_t)(c->max_prompt_len / c->chunk_size - c->n_local_chunks);
    skv_cuda_dws probe;
    z.dws = skv_cuda_dws_layout(&probe, NULL, c->batch_size, c->n_q_heads, c->n_kv_heads, c->head_dim, lay->S,
                                c->chunk_size, lay->cand_max, skv_cuda_ws_items_of(c, lay),
                                skv_cuda_has_host(lay), skv_cuda_canon_tmax(c, lay),
                                skv_cuda_shape_of(c, lay).sel_mode == SKV_SELECT_MASS, lay->W);
    z.lstats = (size_t)c->n_layers * 4 * sizeof(unsigned long long);
    z.kp = n * HkD * sizeof(skv_bf16);
    z.uf = n * r * sizeof(float);
    z.wf = r * HkD * sizeof(float);
    z.lm = skv_cuda_landmarks_scratch_bytes(N_max, c->n_kv_heads, c->head_dim);
    z.seqs = (size_t)c->n_layers * (size_t)c->batch_size * sizeof(skv_cuda_seq);
    z.factor = skv_cuda_factor_bytes(c->max_prompt_len, (int32_t)HkD, c->rank);
    /* the reproducible mode's (and the rescoring's) W in fixed point, per slot: prepared when the slot's
       W is written, read by every decode step's canonical rebuild (when that takes the tensor-core kernel) */
    const skv_cuda_shape sh = skv_cuda_shape_of(c, lay);
    z.wq_slot = (c->reproducible || lay->W > 0) && skv_cuda_canon_uses_wq(&sh, 1)
                    ? skv_cuda_canon_wq_bytes(c->n_kv_heads, c->head_dim, c->rank)
                    : 0;
    z.wq = (size_t)c->n_layers * (size_t)c->batch_size * z.wq_slot;
    z.rank = c0->rank ? 0
                      : (skv_cuda_rank_scratch_bytes(c->rank) + 255) / 256 * 256 +
                            (size_t)c->n_layers * (size_t)c->batch_size * sizeof(int32_t);
    z.act = skv_cuda_act_bytes(c->batch_size);
    return z;
}

size_t skv_cuda_cache_bytes(const skv_config *cfg, const skv_layout *lay)
{
    skv_cuda_sizes z = skv_cuda_sizes_of(cfg, lay);
    return z.dws + 3 * z.kp + z.uf + z.wf + z.lm + z.seqs + z.factor + z.wq + z.lstats + z.rank + z.act +
           3 * sizeof(unsigned long long);
}

static void *skv_cuda_cache_alloc(skv_cuda_cache *k, size_t bytes)
{
    void *p = NULL;
    if (k->n_blocks >= (int)(sizeof k->blocks / sizeof k->blocks[0])) return NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    k->blocks[k->n_blocks++] = p;
    return p;
}

void skv_cuda_cache_close(void *bctx)
{
    skv_cuda_cache *k = (skv_cuda_cache *)bctx;
    if (!k) return;
    cudaStreamSynchronize(k->st);
    if (k->pst) cudaStreamSynchronize(k->pst);
    if (k->fst) cudaStreamSynchronize(k->fst);
    if (k->ost) cudaStreamSynchronize(k->ost);
    if (k->side) cudaStreamSynchronize(k->side);
    for (int i = 0; i < SKV_CUDA_RING; i++)
        for (int j = 0; j < SKV_CUDA_EV; j++)
            if (k->ring[i].e[j]) cudaEventDestroy(k->ring[i].e[j]);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < SKV_PE_N; j++)
            if (k->pset[i].e[j]) cudaEventDestroy(k->pset[i].e[j]);
    cudaEvent_t evs[6] = {k->side_ev, k->fac_ev, k->off_ev, k->fork_ev, k->join_ev, k->scored_ev};
    for (int j = 0; j < 6; j++)
        if (evs[j]) cudaEventDestroy(evs[j]);
    if (k->pre_ev) cudaEventDestroy(k->pre_ev);
    for (int i = 0; i < SKV_CUDA_LRING; i++)
        if (k->lring_ev[i]) cudaEventDestroy(k->lring_ev[i]);
    for (size_t i = 0; k->done_ev && i < (size_t)k->cfg.n_layers * (size_t)k->cfg.batch_size; i++)
        if (k->done_ev[i]) cudaEventDestroy(k->done_ev[i]);
    free(k->done_ev);
    free(k->pend);
    free(k->h_gen);
    if (k->h_ring) cudaFreeHost(k->h_ring);
    if (k->pst) cudaStreamDestroy(k->pst);
    if (k->side) cudaStreamDestroy(k->side);
    if (k->cap) cudaStreamDestroy(k->cap);
    for (int l = 0; k->graphs && l < k->cfg.n_layers; l++) {
        if (k->graphs[l].exec) cudaGraphExecDestroy(k->graphs[l].exec);
        if (k->graphs[l].graph) cudaGraphDestroy(k->graphs[l].graph);
    }
    free(k->graphs);
    skv_cuda_factor_destroy(k->fac);
    if (k->fst) cudaStreamDestroy(k->fst);
    if (k->ost) cudaStreamDestroy(k->ost);
    skv_cuda_green_destroy(k->green); /* after its streams and events */
    for (int i = 0; i < k->n_blocks; i++) cudaFree(k->blocks[i]);
    if (k->h_flags) cudaFreeHost(k->h_flags);
    free(k->h_seqs);
    free(k->layer_host);
    free(k->lstats_seen);
    free(k->h_rank);
    (void)cudaGetLastError();
    free(k);
}

skv_status skv_cuda_cache_open(void **bctx, const skv_config *cfg, const skv_layout *lay, char *dev,
                               char *host, char *msg, size_t cap)
{
    *bctx = NULL;
    int least = 0, greatest = 0, prio = 0; /* stream priorities (below) */
    skv_cuda_cache *k = (skv_cuda_cache *)calloc(1, sizeof *k);
    if (!k) {
        snprintf(msg, cap, "out of host memory");
        return SKV_ERR_OUT_OF_MEMORY;
    }
    const skv_config *cfg0 = cfg;
    const skv_config sized = skv_cuda_sized_cfg(cfg0);
    k->choose_rank = cfg0->rank == 0;
    k->rank_target = cfg0->rank_error_target;
    cfg = &sized; /* from here on, rank is the factors' size (rank_max when rank == 0) */
    k->cfg = *cfg;
    k->lay = *lay;
    k->offload_blocks = SKV_CUDA_OFFLOAD_BLOCKS;
    k->st = (cudaStream_t)cfg->cuda_stream;
    k->dev = dev;
    k->host = host;
    skv_status st = SKV_OK;
    skv_cuda_sizes z = skv_cuda_sizes_of(cfg0, lay);
    size_t L = (size_t)cfg->n_layers, B = (size_t)cfg->batch_size;
    const int has_host = skv_cuda_has_host(lay), pooled = lay->pooled != 0;
    char *dws_base, *wq_base = NULL, *act_base;
    k->sh = skv_cuda_shape_of(cfg, lay);
    skv_cuda_shape *sh = &k->sh;
    cudaError_t e = cudaHostGetDevicePointer((void **)&k->host_dev, host, 0);
    if (e != cudaSuccess) {
        st = skv_cuda_err(e, "cudaHostGetDevicePointer(value store)", msg, cap);
        goto fail;
    }
    if (B > 65535 || (int64_t)cfg->n_kv_heads * cfg->n_q_heads / cfg->n_kv_heads > 65535) {
        snprintf(msg, cap, "cuda: batch_size = %d and n_q_heads = %d must be <= 65535", cfg->batch_size,
                 cfg->n_q_heads);
        st = SKV_ERR_UNSUPPORTED;
        goto fail;
    }
    if ((cfg->n_q_heads / cfg->n_kv_heads + 7) / 8 * 8 > 64) {
        snprintf(msg, cap, "cuda: n_q_heads / n_kv_heads = %d: groups of at most 64 query heads per KV head",
                 cfg->n_q_heads / cfg->n_kv_heads);
        st = SKV_ERR_UNSUPPORTED;
        goto fail;
    }
    k->h_seqs = (skv_cuda_seq *)calloc(L * B, sizeof *k->h_seqs);
    k->layer_host = (unsigned char *)calloc(L, 1);
    k->graphs = (skv_cuda_layer_graph *)calloc(L, sizeof *k->graphs);
    k->d_seqs = (skv_cuda_seq *)skv_cuda_cache_alloc(k, z.seqs);
    dws_base = (char *)skv_cuda_cache_alloc(k, z.dws);
    k->kp_tmp = (skv_bf16 *)skv_cuda_cache_alloc(k, z.kp);
    k->kstage = (skv_bf16 *)skv_cuda_cache_alloc(k, z.kp);
    k->vstage = (skv_bf16 *)skv_cuda_cache_alloc(k, z.kp);
    k->uf = (float *)skv_cuda_cache_alloc(k, z.uf);
    k->wf = (float *)skv_cuda_cache_alloc(k, z.wf);
    k->lm_scratch = skv_cuda_cache_alloc(k, z.lm);
    k->flags = (unsigned long long *)skv_cuda_cache_alloc(k, 3 * sizeof(unsigned long long));
    k->lstats = (unsigned long long *)skv_cuda_cache_alloc(k, z.lstats);
    act_base = (char *)skv_cuda_cache_alloc(k, z.act);
    if (act_base) { /* as skv_cuda_act_bytes */
        k->rows = (skv_cuda_seq *)act_base;
        k->d_list = (int32_t *)(act_base + skv_cuda_act_part(B * sizeof(skv_cuda_seq)));
        k->d_mark = (int32_t *)((char *)k->d_list + skv_cuda_act_part(B * sizeof(int32_t)));
        k->d_list_err = (unsigned long long *)((char *)k->d_mark + skv_cuda_act_part(B * sizeof(int32_t)));
    }
    k->pend = (unsigned char *)calloc(L * B, 1);
    k->h_gen = (int32_t *)calloc(2 * L * B, sizeof(int32_t));
    k->done_ev = (cudaEvent_t *)calloc(L * B, sizeof *k->done_ev);
    if (cudaHostAlloc((void **)&k->h_ring, (size_t)SKV_CUDA_LRING * B * sizeof(int32_t), cudaHostAllocDefault) !=
        cudaSuccess) {
        (void)cudaGetLastError();
        k->h_ring = NULL;
    }
    k->lstats_seen = (unsigned long long *)calloc(L * 4, sizeof(unsigned long long));
    if (z.wq) wq_base = (char *)skv_cuda_cache_alloc(k, z.wq);
    if (z.rank) {
        char *rb = (char *)skv_cuda_cache_alloc(k, z.rank);
        k->rank_scratch = rb;
        k->d_rank = rb ? (int32_t *)(rb + (skv_cuda_rank_scratch_bytes(cfg->rank) + 255) / 256 * 256) : NULL;
        k->h_rank = (int32_t *)calloc(L * B, sizeof *k->h_rank);
    }
    if (cudaHostAlloc((void **)&k->h_flags, 3 * sizeof(unsigned long long), cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError();
        k->h_flags = NULL;
    }
    if (!k->h_seqs || !k->layer_host || !k->graphs || !k->d_seqs || !dws_base || !k->kp_tmp || !k->kstage || !k->vstage || !k->uf ||
        !k->wf || !k->lm_scratch || !k->flags || !k->h_flags || (z.wq && !wq_base) || !k->lstats || !k->lstats_seen ||
        (z.rank && (!k->rank_scratch || !k->h_rank)) || !act_base || !k->pend || !k->h_gen || !k->done_ev || !k->h_ring) {
        snprintf(msg, cap, "cuda: out of device memory for the cache workspace (%zu bytes)",
                 skv_cuda_cache_bytes(cfg0, lay));
        st = SKV_ERR_OUT_OF_MEMORY;
        goto fail;
    }
    skv_cuda_dws_layout(&k->ws, dws_base, cfg->batch_size, cfg->n_q_heads, cfg->n_kv_heads, cfg->head_dim, lay->S,
                        cfg->chunk_size, lay->cand_max, skv_cuda_ws_items_of(cfg, lay), has_host,
                        skv_cuda_canon_tmax(cfg, lay), sh->sel_mode == SKV_SELECT_MASS, lay->W);
    /* the regions are carved for the most items of either kind of layer; each kind keeps its own plan */
    k->ws.it = skv_cuda_items_of(cfg, lay);
    k->wsd = k->ws;
    k->wsd.it = skv_cuda_dense_items_of(cfg, lay);
    k->shd = skv_cuda_dense_shape(sh);
    if ((e = skv_cuda_dws_clear(&k->ws, 0)) != cudaSuccess ||
        (e = cudaMemset(k->lstats, 0, z.lstats)) != cudaSuccess || (e = cudaMemset(act_base, 0, z.act)) != cudaSuccess ||
        (e = cudaMemset(k->d_list_err, 0xff, sizeof *k->d_list_err)) != cudaSuccess) {
        st = skv_cuda_err(e, "cudaMemsetAsync(workspace)", msg, cap);
        goto fail;
    }
    if (k->d_rank && (e = cudaMemset(k->d_rank, 0, L * B * sizeof *k->d_rank)) != cudaSuccess) {
        st = skv_cuda_err(e, "cudaMemset(ranks)", msg, cap); /* a slot without a factorization reads 0 */
        goto fail;
    }
    /* the decode's own streams (side, cap) take the cache's stream's priority; the prefill's (pst, fst,
       ost) the least, so a decode on a high-priority stream runs ahead of a prefill beside it, and with
       cuda_prefill_sms > 0 they live in a green context over that many SMs (docs/DESIGN.md 12.5) */
    if ((e = cudaDeviceGetStreamPriorityRange(&least, &greatest)) != cudaSuccess ||
        (e = cudaStreamGetPriority(k->st, &prio)) != cudaSuccess ||
        (e = cudaStreamCreateWithPriority(&k->side, cudaStreamNonBlocking, prio)) != cudaSuccess ||
        (e = cudaStreamCreateWithPriority(&k->cap, cudaStreamNonBlocking, prio)) != cudaSuccess) {
        st = skv_cuda_err(e, "cudaStreamCreateWithPriority", msg, cap);
        goto fail;
    }
    if (cfg->cuda_prefill_sms > 0) {
        int32_t sms = 0;
        if ((st = skv_cuda_green_create(&k->green, cfg->cuda_prefill_sms, &sms, msg, cap))) goto fail;
    }
    if ((st = skv_cuda_green_stream(k->green, &k->fst, least, msg, cap)) ||
        (st = skv_cuda_green_stream(k->green, &k->ost, least, msg, cap)) ||
        (st = skv_cuda_green_stream(k->green, &k->pst, least, msg, cap)))
        goto fail;
    st = skv_cuda_factor_create(&k->fac, cfg->max_prompt_len, cfg->n_kv_heads * cfg->head_dim, cfg->rank, k->fst,
                                k->green, msg, cap);
    if (st) goto fail;
    /* the events recorded on the prefill's streams are made in their context (the timing sets, side_ev,
       fac_ev, off_ev, done_ev) */
    for (int i = 0; i < 2 && !st; i++)
        for (int j = 0; j < SKV_PE_N && !st; j++) st = skv_cuda_green_event(k->green, &k->pset[i].e[j], 0, msg, cap);
    if (!st) st = skv_cuda_green_event(k->green, &k->side_ev, cudaEventDisableTiming, msg, cap);
    if (!st) st = skv_cuda_green_event(k->green, &k->fac_ev, cudaEventDisableTiming, msg, cap);
    if (!st) st = skv_cuda_green_event(k->green, &k->off_ev, cudaEventDisableTiming, msg, cap);
    for (size_t i = 0; i < L * B && !st; i++)
        st = skv_cuda_green_event(k->green, &k->done_ev[i], cudaEventDisableTiming, msg, cap);
    if (st) goto fail;
    for (int i = 0; i < SKV_CUDA_RING && e == cudaSuccess; i++)
        for (int j = 0; j < SKV_CUDA_EV && e == cudaSuccess; j++) e = cudaEventCreate(&k->ring[i].e[j]);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&k->fork_ev, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&k->join_ev, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&k->scored_ev, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&k->pre_ev, cudaEventDisableTiming);
    for (int i = 0; i < SKV_CUDA_LRING && e == cudaSuccess; i++)
        e = cudaEventCreateWithFlags(&k->lring_ev[i], cudaEventDisableTiming);
    if (e != cudaSuccess) {
        st = skv_cuda_err(e, "cudaEventCreate", msg, cap);
        goto fail;
    }
    /* descriptors: fixed pointers now, sizes (and in the pool mode the growing regions: u, landmarks,
       cand_ids, the value store; a dense slot's window) at prefill, from its skv_slot_mem */
    for (size_t l = 0; l < L; l++)
        for (size_t b = 0; b < B; b++) {
            size_t i = l * B + b;
            char *sd = dev + skv_layout_slot_offset(lay, (int32_t)l, (int32_t)b);
            skv_cuda_seq *s = &k->h_seqs[i];
            if (skv_layout_dense(lay, (int32_t)l)) { /* the prompt's keys and values, the generated tokens */
                s->dense = 1;
                s->loc_k = pooled ? NULL : (const skv_bf16 *)(sd + lay->dn_k);
                s->loc_v = pooled ? NULL : (const skv_bf16 *)(sd + lay->dn_v);
                s->gen_k = (skv_bf16 *)(sd + lay->dn_gen_k);
                s->gen_v = (skv_bf16 *)(sd + lay->dn_gen_v);
                continue;
            }
            const int64_t j = skv_layout_sparse_index(lay, (int32_t)l, (int32_t)b); /* its value store's index */
            if (!pooled) {
                s->landmarks = (const skv_bf16 *)(sd + lay->landmarks);
                s->cand_ids = (const int32_t *)(sd + lay->cand_ids);
                s->u = (const skv_bf16 *)(sd + lay->u);
            }
            s->w = (const skv_bf16 *)(sd + lay->w);
            s->wq = wq_base ? (const signed char *)(wq_base + i * z.wq_slot) : NULL;
            s->out_k = (const skv_bf16 *)(sd + lay->out_k);
            s->out_v = (const skv_bf16 *)(sd + lay->out_v);
            s->loc_k = (const skv_bf16 *)(sd + lay->loc_k);
            s->loc_v = (const skv_bf16 *)(sd + lay->loc_v);
            s->gen_k = (skv_bf16 *)(sd + lay->gen_k);
            s->gen_v = (skv_bf16 *)(sd + lay->gen_v);
            s->pub_sel_idx = (int32_t *)(sd + lay->sel_idx);
            s->pub_sel_ids = (int32_t *)(sd + lay->sel_ids);
            s->pub_sel_cnt = (int32_t *)(sd + lay->sel_cnt);
            if (pooled ? !lay->values_host : j < lay->n_dev_slots) {
                if (!pooled) s->vstore = (const unsigned char *)(dev + lay->dev_values + (size_t)j * lay->slot_values);
            } else { /* a chunk cache (the pool mode: every sparse slot's, n_dev_slots being 0) */
                const size_t hi = (size_t)(j - lay->n_dev_slots);
                char *vc = dev + lay->dev_vcache + hi * lay->slot_vcache;
                if (!pooled) s->vstore = (const unsigned char *)(k->host_dev + hi * lay->slot_host);
                s->vc_data = (unsigned char *)(vc + lay->vc_data);
                s->vc_slot_of = (int32_t *)(vc + lay->vc_slot_of);
                s->vc_owner = (int32_t *)(vc + lay->vc_owner);
                s->vc_stamp = (int32_t *)(vc + lay->vc_stamp);
                k->layer_host[l] = 1;
            }
        }
    /* every slot's prepared W is written before a decode reads it (decode needs every slot
       prefilled or loaded); zeroed all the same, so that no byte of the cache is left undefined */
    if (wq_base && (e = cudaMemset(wq_base, 0, z.wq)) != cudaSuccess) {
        st = skv_cuda_err(e, "cudaMemset(prepared W)", msg, cap);
        goto fail;
    }
    if ((e = cudaMemcpy(k->d_seqs, k->h_seqs, z.seqs, cudaMemcpyHostToDevice)) != cudaSuccess) {
        st = skv_cuda_err(e, "cudaMemcpy(descriptors)", msg, cap);
        goto fail;
    }
    sh->cos_tab = (const float *)(dev + lay->rope_cos);
    sh->sin_tab = (const float *)(dev + lay->rope_sin);
    /* the legacy-stream memsets and copies above must land before the cache's stream runs */
    if ((e = cudaDeviceSynchronize()) != cudaSuccess) {
        st = skv_cuda_err(e, "cudaDeviceSynchronize", msg, cap);
        goto fail;
    }
    *bctx = k;
    return SKV_OK;
fail:
    skv_cuda_cache_close(k);
    return st;
}

/* Adds a finished step's times: the whole step, and its phases when they were recorded. */
static void skv_cuda_take_times(skv_cuda_cache *k, skv_cuda_evset *s)
{
    k->pending.decode_step_ms += skv_cuda_elapsed(s->e[SKV_EV_START], s->e[SKV_EV_END]);
    k->n_timed++;
    if (s->phases) {
        k->phase_select_ms += skv_cuda_elapsed(s->e[SKV_EV_START], s->e[SKV_EV_SELECTED]);
        if (s->rebuilt) {
            k->phase_rebuild_ms += skv_cuda_elapsed(s->e[SKV_EV_SELECTED], s->e[SKV_EV_REBUILT]);
            k->phase_attention_ms += skv_cuda_elapsed(s->e[SKV_EV_REBUILT], s->e[SKV_EV_END]);
        } else {
            k->phase_attention_ms += skv_cuda_elapsed(s->e[SKV_EV_SELECTED], s->e[SKV_EV_END]);
        }
        k->n_phased++;
        if (s->fetch) {
            k->phase_fetch_ms += skv_cuda_elapsed(s->e[SKV_EV_SELECTED], s->e[SKV_EV_FETCHED]);
            k->n_phased_fetch++;
        }
    }
    s->used = s->phases = s->fetch = s->rebuilt = 0;
}

/*
 * The launch sequence of one decode step on stream st (skv_cuda.h lists the steps): direct, or
 * into a capture. ev (or NULL): the step's event set, whose phase events are recorded.
 * node (or NULL): receives the score kernel's parameters (a capture).
 */
static skv_status skv_cuda_enqueue_step(skv_cuda_cache *k, cudaStream_t st, int32_t layer, const skv_cuda_io *io,
                                        const skv_cuda_act *act, skv_cuda_evset *ev, skv_cuda_score_node *node,
                                        int *launches, char *msg, size_t cap)
{
    const skv_cuda_shape *sh = &k->sh;
    /* step 0 (act; NULL: the caller launched it): the rows of the listed sequences (idle past the
       count), which every kernel below reads */
    skv_cuda_seq *seqs = k->rows;
    if (act) {
        CK(skv_cuda_act_rows(st, act));
        *launches += 1;
    }
    const int repro = k->cfg.reproducible;
    /* this layer's view of the workspace: its counters' row (and a dense layer's items) */
    skv_cuda_dws ws = skv_layout_dense(&k->lay, layer) ? k->wsd : k->ws;
    ws.lstats = k->lstats + (size_t)layer * 4;
    if (skv_layout_dense(&k->lay, layer)) {
        /* a dense layer: step 1 only checks and publishes the step's tensors (no candidates), then the
           attention over the resident spans (the prompt, the generated tokens, the new one) */
        const skv_cuda_shape *shd = &k->shd;
        CK(skv_cuda_score(st, shd, seqs, &ws, io, 1, layer, node));
        *launches += 1;
        if (ev) CK(cudaEventRecord(ev->e[SKV_EV_SELECTED], st));
        if (repro) {
            CK(skv_cuda_canon_decode_resident(st, shd, seqs, &ws));
            if (ev) CK(cudaEventRecord(ev->e[SKV_EV_REBUILT], st));
            CK(skv_cuda_canon_decode_attend(st, shd, seqs, &ws));
            CK(skv_cuda_combine_append(st, shd, seqs, &ws));
            *launches += 4;
            return SKV_OK;
        }
        CK(skv_cuda_attend(st, shd, seqs, &ws, !ev));
        CK(skv_cuda_combine(st, shd, seqs, &ws, NULL, 1));
        *launches += 2;
        return SKV_OK;
    }
    if (sh->W > 0) /* the rescoring (docs/DESIGN.md 4.5.1): the W landmark-best candidates, then their keys */
        CK(skv_cuda_rescore_step(st, sh, seqs, &ws, io, layer, k->h_seqs[(size_t)layer * sh->B].wq != NULL, node,
                                 launches, repro ? k->scored_ev : NULL));
    else
        CK(skv_cuda_select_step(st, sh, seqs, &ws, io, 1, layer, NULL, node, launches, repro ? k->scored_ev : NULL));
    if (repro) {
        /* the resident tokens' canonical scores on the side stream once step 1 has published the
           step's tensors, beside the selection (which leaves most of the device idle) */
        CK(cudaStreamWaitEvent(k->side, k->scored_ev, 0));
        CK(skv_cuda_canon_decode_resident(k->side, sh, seqs, &ws));
        *launches += 1;
    }
    if (ev) CK(cudaEventRecord(ev->e[SKV_EV_SELECTED], st));
    if (repro) {
        /* the canonical rebuild of the selected keys into the workspace, then the canonical
           attention over the five spans; a host layer's missed chunks are fetched first (the
           attention reads every selected value from the chunk cache), beside the rebuild, on the
           side stream after the resident scores */
        if (k->layer_host[layer]) {
            CK(cudaEventRecord(k->fork_ev, st));
            CK(cudaStreamWaitEvent(k->side, k->fork_ev, 0));
            CK(skv_cuda_fetch(k->side, sh, seqs, &ws));
            if (ev) CK(cudaEventRecord(ev->e[SKV_EV_FETCHED], k->side));
            *launches += 1;
        }
        CK(cudaEventRecord(k->join_ev, k->side));
        CK(skv_cuda_canon_decode_rebuild(st, sh, seqs, &ws));
        if (ev) CK(cudaEventRecord(ev->e[SKV_EV_REBUILT], st));
        CK(cudaStreamWaitEvent(st, k->join_ev, 0));
        CK(skv_cuda_canon_decode_attend(st, sh, seqs, &ws));
        CK(skv_cuda_combine_append(st, sh, seqs, &ws));
        *launches += 4;
        return SKV_OK;
    }
    if (k->layer_host[layer]) {
        /* the missed chunks come over PCIe on the side stream while everything else is attended */
        CK(cudaEventRecord(k->fork_ev, st));
        CK(cudaStreamWaitEvent(k->side, k->fork_ev, 0));
        CK(skv_cuda_fetch(k->side, sh, seqs, &ws));
        if (ev) CK(cudaEventRecord(ev->e[SKV_EV_FETCHED], k->side));
        CK(cudaEventRecord(k->join_ev, k->side));
        CK(skv_cuda_attend(st, sh, seqs, &ws, 0));
        CK(cudaStreamWaitEvent(st, k->join_ev, 0));
        CK(skv_cuda_attend_missed(st, sh, seqs, &ws));
        *launches += 3;
    } else {
        CK(skv_cuda_attend(st, sh, seqs, &ws, !ev));
        *launches += 1;
    }
    CK(skv_cuda_combine(st, sh, seqs, &ws, NULL, 1));
    *launches += 1;
    return SKV_OK;
}

/* Captures layer's step on the capture stream into its graph (first step of the layer). */
static skv_status skv_cuda_capture_layer(skv_cuda_cache *k, int32_t layer, const skv_cuda_io *io, char *msg, size_t cap)
{
    skv_cuda_layer_graph *g = &k->graphs[layer];
    int kernels = 0;
    CK(cudaStreamBeginCapture(k->cap, cudaStreamCaptureModeThreadLocal));
    skv_status s = skv_cuda_enqueue_step(k, k->cap, layer, io, NULL, NULL, &g->node, &kernels, msg, cap);
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(k->cap, &graph);
    if (s) {
        if (graph) cudaGraphDestroy(graph);
        return s;
    }
    if (e != cudaSuccess) return skv_cuda_err(e, "cudaStreamEndCapture(decode step)", msg, cap);
    size_t n_roots = 0;
    cudaGraphNode_t roots[4];
    e = cudaGraphGetRootNodes(graph, NULL, &n_roots);
    if (e == cudaSuccess && (n_roots != 1 || (e = cudaGraphGetRootNodes(graph, roots, &n_roots)) != cudaSuccess)) {
        if (e == cudaSuccess) e = cudaErrorInvalidValue; /* the score kernel must be the only root */
    }
    if (e == cudaSuccess) e = cudaGraphInstantiate(&g->exec, graph, 0);
    if (e != cudaSuccess) {
        cudaGraphDestroy(graph);
        g->exec = NULL;
        return skv_cuda_err(e, "cudaGraphInstantiate(decode step)", msg, cap);
    }
    g->graph = graph;
    g->score = roots[0];
    g->kernels = kernels;
    return SKV_OK;
}

skv_status skv_cuda_cache_decode(void *bctx, int32_t layer, int32_t n_active, const int32_t *seqs,
                                 const int32_t *dev_count, const int32_t *dev_seqs, const skv_bf16 *q,
                                 const skv_bf16 *kn, const skv_bf16 *vn, float *out, char *msg, size_t cap)
{
    skv_cuda_cache *k = (skv_cuda_cache *)bctx;
    cudaStream_t st = k->st;
    const skv_cuda_io io = {q, kn, vn, out};

    /* events, unless the stream is being captured or the ring slot is still in flight (then this
       step goes untimed: waiting for it would be a hidden synchronization) */
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    CK(cudaStreamIsCapturing(st, &cs));
    const int capturing = cs != cudaStreamCaptureStatusNone;
    skv_cuda_evset *ev = &k->ring[k->ring_head];
    if (ev->used && !capturing) { /* no event queries inside a capture */
        cudaError_t q5 = cudaEventQuery(ev->e[SKV_EV_END]);
        if (q5 == cudaSuccess) skv_cuda_take_times(k, ev);
        else if (q5 == cudaErrorNotReady) (void)cudaGetLastError();
        else return skv_cuda_err(q5, "cudaEventQuery", msg, cap);
    }
    const int timed = !capturing && !ev->used;
    /* one step in SKV_CUDA_PHASE_EVERY is launched directly with phase events; the others replay
       the layer's graph (a step inside the caller's capture is launched directly) */
    const int phases = timed && k->n_steps % SKV_CUDA_PHASE_EVERY == 0;
    /* the list (the prefills in flight that it reads are waited for here, before the step's start) */
    skv_cuda_act act;
    {
        const skv_status s = skv_cuda_list_prepare(k, layer, n_active, seqs, dev_count, dev_seqs,
                                                   capturing ? cudaEventWaitExternal : 0, &act, msg, cap);
        if (s) return s;
    }
    int launches = 0;
    if (timed) CK(cudaEventRecord(ev->e[SKV_EV_START], st));
    skv_cuda_layer_graph *g = &k->graphs[layer];
    if (capturing || phases) {
        skv_status s = skv_cuda_enqueue_step(k, st, layer, &io, &act, phases ? ev : NULL, NULL, &launches, msg, cap);
        if (s) return s;
    } else {
        /* the rows first (the list is the launch's parameter, so the graph never holds it), then the
           layer's graph with the step's tensors */
        if (!g->exec) {
            skv_status s = skv_cuda_capture_layer(k, layer, &io, msg, cap);
            if (s) return s;
        } else {
            skv_cuda_score_node_set_io(&g->node, &io);
            CK(cudaGraphExecKernelNodeSetParams(g->exec, g->score, &g->node.params));
        }
        CK(skv_cuda_act_rows(st, &act));
        CK(cudaGraphLaunch(g->exec, st));
        launches = g->kernels + 1;
    }
    if (timed) {
        CK(cudaEventRecord(ev->e[SKV_EV_END], st));
        ev->used = 1;
        ev->phases = phases;
        ev->fetch = phases && k->layer_host[layer];
        ev->rebuilt = phases && k->cfg.reproducible;
        k->ring_head = (k->ring_head + 1) % SKV_CUDA_RING;
    }
    k->launches += launches;
    k->n_steps++;
    return SKV_OK;
}

skv_status skv_cuda_cache_sync(void *bctx, skv_seq_state *states, skv_stats *stats, skv_layer_stats *layer_stats,
                               char *msg, size_t cap)
{
    skv_cuda_cache *k = (skv_cuda_cache *)bctx;
    CK(cudaStreamSynchronize(k->st));
    CK(cudaStreamSynchronize(k->side));
    CK(cudaStreamSynchronize(k->pst));
    CK(cudaStreamSynchronize(k->fst));
    CK(cudaStreamSynchronize(k->ost));
    for (int i = 0; i < SKV_CUDA_RING; i++)
        if (k->ring[i].used) skv_cuda_take_times(k, &k->ring[i]);
    for (int i = 0; i < 2; i++)
        if (k->pset[i].used) skv_cuda_take_prefill(k, &k->pset[i]);
    /* the phases of the sampled steps, scaled to every timed step */
    if (k->n_phased) {
        const double f = (double)k->n_timed / (double)k->n_phased;
        k->pending.decode_select_ms += k->phase_select_ms * f;
        k->pending.decode_attention_ms += k->phase_attention_ms * f;
        k->pending.decode_rebuild_ms += k->phase_rebuild_ms * f;
    }
    if (k->n_phased_fetch) k->pending.decode_fetch_ms += k->phase_fetch_ms * (double)k->n_timed / (double)k->n_phased;
    k->phase_select_ms = k->phase_attention_ms = k->phase_fetch_ms = k->phase_rebuild_ms = 0;
    k->n_timed = k->n_phased = k->n_phased_fetch = 0;
    stats->prefill_rope_ms += k->pending.prefill_rope_ms;
    stats->prefill_landmarks_ms += k->pending.prefill_landmarks_ms;
    stats->prefill_offload_ms += k->pending.prefill_offload_ms;
    stats->prefill_factorize_ms += k->pending.prefill_factorize_ms;
    stats->prefill_critical_ms += k->pending.prefill_critical_ms;
    stats->prefill_wait_ms += k->pending.prefill_wait_ms;
    stats->decode_select_ms += k->pending.decode_select_ms;
    stats->decode_fetch_ms += k->pending.decode_fetch_ms;
    stats->decode_attention_ms += k->pending.decode_attention_ms;
    stats->decode_rebuild_ms += k->pending.decode_rebuild_ms;
    stats->decode_step_ms += k->pending.decode_step_ms;
    stats->decode_launches += k->launches;
    k->launches = 0;
    memset(&k->pending, 0, sizeof k->pending);
    unsigned long long vc[2];
    CK(cudaMemcpy(vc, k->ws.vc_counts, sizeof vc, cudaMemcpyDeviceToHost));
    stats->value_cache_hits += (int64_t)(vc[0] - k->vc_seen[0]);
    stats->value_cache_misses += (int64_t)(vc[1] - k->vc_seen[1]);
    k->vc_seen[0] = vc[0], k->vc_seen[1] = vc[1];
    /* the layers' counters since the last sync (the device's are cumulative) */
    if (layer_stats) {
        enum { SKV_LS_MAX = 64 * 4 }; /* chunks of the copy: no allocation here */
        unsigned long long buf[SKV_LS_MAX];
        const size_t total = (size_t)k->cfg.n_layers * 4;
        for (size_t off = 0; off < total; off += SKV_LS_MAX) {
            const size_t m = total - off < SKV_LS_MAX ? total - off : SKV_LS_MAX;
            CK(cudaMemcpy(buf, k->lstats + off, m * sizeof *buf, cudaMemcpyDeviceToHost));
            for (size_t x = 0; x < m; x++) {
                const size_t q = off + x;
                const int64_t d = (int64_t)(buf[x] - k->lstats_seen[q]);
                k->lstats_seen[q] = buf[x];
                skv_layer_stats *ls = &layer_stats[q / 4];
                switch (q % 4) {
                case 0: ls->head_steps += d; break;
                case 1: ls->attended_tokens += d; break;
                case 2: ls->context_tokens += d; break;
                default: ls->selected_chunks += d; break;
                }
            }
        }
    }
    if (k->choose_rank) { /* the ranks the prefills chose on the device (rank == 0) */
        const size_t nsl = (size_t)k->cfg.n_layers * (size_t)k->cfg.batch_size;
        CK(cudaMemcpy(k->h_rank, k->d_rank, nsl * sizeof *k->h_rank, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < nsl; i++)
            if (states[i].prefilled) states[i].rank = k->h_rank[i];
    }
    unsigned long long failures = 0, tag = ~0ull;
    skv_status fst_ = skv_cuda_factor_counts(k->fac, &failures, &tag, msg, cap);
    if (fst_) return fst_;
    if (failures > k->fac_failures_seen) {
        k->fac_failures_seen = failures;
        snprintf(msg, cap, "skv_prefill of layer %u, sequence %u: the factorization failed (a solver step "
                           "reported an error); its keys are not usable",
                 (unsigned)(tag >> 32), (unsigned)(tag & 0xffffffffu));
        return SKV_ERR_NUMERICAL;
    }
    /* a bad device list (reported first; a NaN step's error then waits for the next sync) */
    const skv_status list_st = skv_cuda_list_error(k, msg, cap);
    unsigned long long bad = ~0ull;
    CK(cudaMemcpy(&bad, k->ws.first_bad, sizeof bad, cudaMemcpyDeviceToHost));
    if (bad != ~0ull || list_st != SKV_OK || k->dev_lists) {
        /* device-list steps advanced n_gen and has_sel where the host did not see them, and a failed
           step (NaN/Inf inputs, a bad list) changed nothing there: take them from the device (the two
           adjacent words of every descriptor) */
        const size_t n = (size_t)k->cfg.n_layers * (size_t)k->cfg.batch_size;
        CK(cudaMemcpy2D(k->h_gen, 2 * sizeof(int32_t), &k->d_seqs[0].n_gen, sizeof(skv_cuda_seq), 2 * sizeof(int32_t),
                        n, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; i++) {
            states[i].n_gen = k->h_seqs[i].n_gen = k->h_gen[2 * i];
            states[i].has_selection = k->h_seqs[i].has_sel = k->h_gen[2 * i + 1];
        }
    }
    if (list_st != SKV_OK) return list_st;
    if (bad == ~0ull) return SKV_OK;
    CK(cudaMemsetAsync(k->ws.first_bad, 0xff, sizeof *k->ws.first_bad, k->st));
    CK(cudaStreamSynchronize(k->st));
    int layer = (int)(bad >> 48), tensor = (int)((bad >> 40) & 0xff);
    long long idx = (long long)(bad & ((1ull << 40) - 1));
    int heads = tensor == 0 ? k->cfg.n_q_heads : k->cfg.n_kv_heads, D = k->cfg.head_dim;
    static const char *const names[3] = {"q", "k", "v"};
    snprintf(msg, cap,
             "skv_decode on layer %d: %s[%lld][%lld][%lld] is NaN or Inf; that step was not applied (no token "
             "appended, selection kept)",
             layer, names[tensor < 3 ? tensor : 0], idx / ((long long)heads * D), idx / D % heads, idx % D);
    return SKV_ERR_NONFINITE;
}

/*
 * After skv_cache_load wrote a snapshot into the arenas of this fresh cache (lib/'s copy2d:
 * synchronous copies on the legacy stream): the descriptors take each slot's shape and step
 * state (n, n_cand, n_local, n_gen, has_sel: what the decode kernels read and advance on the
 * device), the chunk caches of host-placed slots are emptied (index entries -1, as prefill
 * leaves them), in the reproducible mode each prefilled slot's W is prepared for the decode's
 * rebuild (skv_cuda_canon_wprep, as prefill does), and the host copies follow. Nothing has
 * been enqueued on the cache yet (no prefill, no decode, no graph); returns when the device
 * holds the new state.
 */
skv_status skv_cuda_cache_set_states(void *bctx, const skv_seq_state *states, char *msg, size_t cap)
{
    skv_cuda_cache *k = (skv_cuda_cache *)bctx;
    const size_t n = (size_t)k->cfg.n_layers * (size_t)k->cfg.batch_size;
    CK(cudaStreamSynchronize(k->st));
    for (size_t i = 0; i < n; i++) {
        skv_cuda_seq *hs = &k->h_seqs[i];
        const skv_seq_state *s = &states[i];
        hs->n = s->prefilled ? s->n : 0;
        hs->n_cand = s->prefilled && !hs->dense ? s->n_cand : 0;
        hs->n_local = s->prefilled ? (hs->dense ? (int32_t)s->n : s->n_local) : 0;
        hs->n_gen = s->prefilled ? s->n_gen : 0;
        hs->has_sel = s->prefilled ? s->has_selection : 0;
        if (hs->dense) continue; /* its window and generated tokens are in the arena; nothing else to prepare */
        if (hs->vc_data) CK(cudaMemsetAsync(hs->vc_slot_of, 0xff, k->lay.vc_meta_bytes, k->st));
        /* the snapshot wrote W: its fixed point for the decode's rebuild, as a prefill prepares it */
        if (s->prefilled && hs->wq)
            CK(skv_cuda_canon_wprep(k->st, k->cfg.n_kv_heads, k->cfg.head_dim, k->cfg.rank, hs->w, (void *)hs->wq));
    }
    CK(cudaMemcpyAsync(k->d_seqs, k->h_seqs, n * sizeof *k->h_seqs, cudaMemcpyHostToDevice, k->st));
    if (k->choose_rank) { /* the loaded ranks (lib/ recounted them from W), which the next sync reads back */
        for (size_t i = 0; i < n; i++) k->h_rank[i] = states[i].prefilled ? states[i].rank : 0;
        CK(cudaMemcpyAsync(k->d_rank, k->h_rank, n * sizeof *k->h_rank, cudaMemcpyHostToDevice, k->st));
    }
    CK(cudaStreamSynchronize(k->st));
    CK(cudaGetLastError());
    return SKV_OK;
}
