/*
 * skv_cuda_serve.cu - the serving side of a cuda cache (skv_cuda_cache.h): a decode step's
 * active list, the slots cache_release and cache_seq_ready, and the report of a bad device list
 * (cache_sync's), and cache_copy (the staging of a prompt in pieces, ordered after the stream).
 *
 * A step's list becomes its rows on the device (skv_cuda_act_rows, the step's first kernel):
 * the whole batch and any 0..n-1 list travel as the count alone; another host list is copied
 * from a small pinned ring (SKV_CUDA_LRING entries, reused once the stream has read them: the
 * host waits only when it is that many such lists ahead) to the device; a device list is read
 * (and checked) there. A host list's step waits for the prefills still running beside the
 * cache's stream of the slots it reads, and for no other; a device list's does not wait (the
 * check finds a slot whose prefill is not done not prefilled: its descriptor is written last).
 *
 * Nothing here allocates; the decode's part never waits on the host but for a full ring.
 */
#include <stdio.h>
#include <string.h>

#include "skv_cuda_cache.h"

skv_status skv_cuda_list_prepare(skv_cuda_cache *k, int32_t layer, int32_t n_active, const int32_t *seqs,
                                 const int32_t *dev_count, const int32_t *dev_seqs, unsigned flags, skv_cuda_act *act,
                                 char *msg, size_t cap)
{
    const int32_t B = k->cfg.batch_size;
    const int capturing = flags != 0;
    memset(act, 0, sizeof *act);
    act->base = k->d_seqs;
    act->rows = k->rows;
    act->mark = k->d_mark;
    act->err = k->d_list_err;
    act->layer = layer;
    act->L = k->cfg.n_layers;
    act->B = B;
    act->gen_cap = k->cfg.gen_capacity;
    if (dev_seqs) { /* read and checked by the step's first kernel */
        act->mode = SKV_CUDA_ACT_DEVICE;
        act->list = dev_seqs;
        act->count = dev_count;
        k->dev_lists = 1; /* from now on every sync refreshes the host's n_gen and has_sel */
        return SKV_OK;
    }
    if (n_active < 0) n_active = 0;
    int prefix = 1;
    for (int32_t i = 0; i < n_active; i++) {
        const int32_t s = seqs[i];
        const size_t slot = (size_t)layer * B + s;
        prefix &= s == i;
        if (k->pend[slot]) { /* its prefill's side work may still run */
            CK(cudaStreamWaitEvent(k->st, k->done_ev[slot], flags));
            k->pend[slot] = 0;
        }
    }
    act->n = n_active;
    if (prefix) {
        act->mode = SKV_CUDA_ACT_PREFIX;
        return SKV_OK;
    }
    const int e = k->lring_head;
    k->lring_head = (e + 1) % SKV_CUDA_LRING;
    if (k->lring_used[e]) { /* the copy from this entry must have been read */
        const cudaError_t r = cudaEventQuery(k->lring_ev[e]);
        if (r == cudaErrorNotReady) {
            (void)cudaGetLastError();
            CK(cudaEventSynchronize(k->lring_ev[e]));
        } else if (r != cudaSuccess) {
            return skv_cuda_err(r, "cudaEventQuery(host list)", msg, cap);
        }
        k->lring_used[e] = 0;
    }
    int32_t *h = k->h_ring + (size_t)e * B;
    memcpy(h, seqs, (size_t)n_active * sizeof *h);
    CK(cudaMemcpyAsync(k->d_list, h, (size_t)n_active * sizeof *h, cudaMemcpyHostToDevice, k->st));
    if (!capturing) { /* inside the caller's capture the entry is read when its graph runs (no event) */
        CK(cudaEventRecord(k->lring_ev[e], k->st));
        k->lring_used[e] = 1;
    }
    act->mode = SKV_CUDA_ACT_HOST;
    act->list = k->d_list;
    return SKV_OK;
}

skv_status skv_cuda_list_error(skv_cuda_cache *k, char *msg, size_t cap)
{
    unsigned long long e = ~0ull;
    CK(cudaMemcpy(&e, k->d_list_err, sizeof e, cudaMemcpyDeviceToHost));
    if (e == ~0ull) return SKV_OK;
    CK(cudaMemset(k->d_list_err, 0xff, sizeof *k->d_list_err));
    const int kind = (int)(e >> 56), layer = (int)((e >> 40) & 0xffff);
    const int32_t v = (int32_t)(uint32_t)(e & 0xffffffffu);
    const char *const head = "skv_decode_active_device";
    const char *const tail = "that step (and the device-list steps after it until this report) changed nothing";
    switch (kind) {
    case SKV_CUDA_LIST_COUNT:
        snprintf(msg, cap, "%s on layer %d: n_active = %d is outside [0, batch_size = %d]; %s", head, layer, v,
                 k->cfg.batch_size, tail);
        return SKV_ERR_INVALID_ARGUMENT;
    case SKV_CUDA_LIST_RANGE:
        snprintf(msg, cap, "%s on layer %d: sequence %d is outside [0, batch_size = %d); %s", head, layer, v,
                 k->cfg.batch_size, tail);
        return SKV_ERR_INVALID_ARGUMENT;
    case SKV_CUDA_LIST_TWICE:
        snprintf(msg, cap, "%s on layer %d: sequence %d is listed twice; %s", head, layer, v, tail);
        return SKV_ERR_INVALID_ARGUMENT;
    case SKV_CUDA_LIST_FREE:
        snprintf(msg, cap, "%s: sequence %d is not prefilled in layer %d (free, or its prefill not done); %s", head, v,
                 layer, tail);
        return SKV_ERR_NOT_PREFILLED;
    case SKV_CUDA_LIST_FULL:
        snprintf(msg, cap, "%s on layer %d: sequence %d has gen_capacity = %d generated tokens; %s", head, layer, v,
                 k->cfg.gen_capacity, tail);
        return SKV_ERR_CAPACITY;
    default:
        snprintf(msg, cap, "%s on layer %d: sequence %d would go a step ahead of another of its layers; %s", head,
                 layer, v, tail);
        return SKV_ERR_INVALID_ARGUMENT;
    }
}

/*
 * Sequence seq back to free in every layer, on the cache's stream after the work enqueued so far
 * (after its prefills still in flight too, so that none writes its descriptor later): the
 * descriptors (no prompt, n_gen 0, no selection), the published selections (counts 0, rows -1)
 * and the chunk caches (empty). The host copies follow at once. No allocation, no host wait.
 */
skv_status skv_cuda_cache_release(void *bctx, int32_t seq, char *msg, size_t cap)
{
    skv_cuda_cache *k = (skv_cuda_cache *)bctx;
    const int32_t L = k->cfg.n_layers, B = k->cfg.batch_size;
    for (int32_t l = 0; l < L; l++) {
        const size_t slot = (size_t)l * B + seq;
        if (k->pend[slot]) {
            CK(cudaStreamWaitEvent(k->st, k->done_ev[slot], 0));
            k->pend[slot] = 0;
        }
    }
    CK(skv_cuda_release_seq(k->st, k->d_seqs, L, B, seq, k->cfg.n_kv_heads, k->lay.S, k->lay.vc_meta_bytes));
    for (int32_t l = 0; l < L; l++) {
        skv_cuda_seq *hs = &k->h_seqs[(size_t)l * B + seq];
        hs->n = 0, hs->n_cand = 0, hs->n_local = 0, hs->n_gen = 0, hs->has_sel = 0;
    }
    return SKV_OK;
}

/* Whether (layer, seq)'s prefill is done beside the cache's stream: its done event, queried. */
skv_status skv_cuda_cache_seq_ready(void *bctx, int32_t layer, int32_t seq, int32_t *ready, char *msg, size_t cap)
{
    skv_cuda_cache *k = (skv_cuda_cache *)bctx;
    const size_t slot = (size_t)layer * k->cfg.batch_size + seq;
    *ready = 1;
    if (!k->pend[slot]) return SKV_OK;
    const cudaError_t r = cudaEventQuery(k->done_ev[slot]);
    if (r == cudaSuccess) return SKV_OK;
    if (r == cudaErrorNotReady) {
        (void)cudaGetLastError();
        *ready = 0;
        return SKV_OK;
    }
    return skv_cuda_err(r, "cudaEventQuery(prefill)", msg, cap);
}

/* The staging of a prompt in pieces: its pool pages may have been a released sequence's, whose
   steps on the cache's stream (and, through the release's wait, its prefill's side work) must be
   done with them first. The host waits for the copy (the caller's buffer is then free). */
skv_status skv_cuda_cache_copy(void *bctx, void *dst, const void *src, size_t bytes, char *msg, size_t cap)
{
    skv_cuda_cache *k = (skv_cuda_cache *)bctx;
    CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, k->st));
    CK(cudaStreamSynchronize(k->st));
    return SKV_OK;
}
