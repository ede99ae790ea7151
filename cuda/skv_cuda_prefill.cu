/*
 * skv_cuda_prefill.cu - a cache's prefill (the slot cache_prefill; a dense layer's too), on its
 * own stream beside the decode's (registered by skv_cuda_fill_ops; the cache's state is in
 * skv_cuda_cache.h).
 *
 * A prefill of (layer, seq) runs on the prefill stream pst, ordered after the work enqueued on
 * the cache's stream st so far (an event: the caller's writes of its tensors, and any step still
 * reading the memory the slot's regions take, a released sequence's pool pages among them); the
 * decode steps enqueued on st meanwhile neither wait for it nor queue behind it. On pst: the
 * NaN/Inf check (the host waits for it: bad input is refused before any work), copies of k_pre
 * and v into the staging buffers (after the previous prefill's side work is done with them),
 * RoPE, landmarks and outliers, the exact chunks and the local window, an empty chunk cache.
 * Then beside it, from the staged copies: the factorization on fst and the candidates' values on
 * ost (into the device store, or over PCIe into the host store). Once both are done the slot's
 * descriptor is written (so a descriptor with a prompt is always one whose regions are complete)
 * and the slot's done_ev recorded: a host-list decode step that reads the slot makes st wait for
 * it, cache_seq_ready queries it. The call returns once pst is done, so k_pre, v and k_post are
 * free for the caller.
 *
 * The launchers: skv_cuda_find_nonfinite, skv_cuda_rope (no k_post given),
 * skv_cuda_landmarks_outliers, skv_cuda_gather_chunks (the outlier chunks), skv_cuda_store_chunks
 * (the candidates' value records on ost, fp8 ones encoded there), skv_cuda_factorize and
 * skv_cuda_f32_to_bf16 or skv_cuda_rank_store on fst (and skv_cuda_canon_wprep, reproducible mode
 * or the rescoring), skv_cuda_set_seq.
 */
#include <stdio.h>
#include <string.h>

#include "skv_cuda_cache.h"

void skv_cuda_take_prefill(skv_cuda_cache *k, skv_cuda_pset *p)
{
    cudaEvent_t *e = p->e;
    k->pending.prefill_rope_ms += skv_cuda_elapsed(e[SKV_PE_M0], e[SKV_PE_M1]);
    k->pending.prefill_landmarks_ms += skv_cuda_elapsed(e[SKV_PE_M1], e[SKV_PE_M2]);
    k->pending.prefill_offload_ms +=
        skv_cuda_elapsed(e[SKV_PE_M2], e[SKV_PE_M3]) + skv_cuda_elapsed(e[SKV_PE_O0], e[SKV_PE_O1]);
    k->pending.prefill_factorize_ms += skv_cuda_elapsed(e[SKV_PE_F0], e[SKV_PE_F1]);
    const double wait = skv_cuda_elapsed(e[SKV_PE_WA], e[SKV_PE_WB]);
    k->pending.prefill_critical_ms += skv_cuda_elapsed(e[SKV_PE_M0], e[SKV_PE_M3]) - wait;
    k->pending.prefill_wait_ms += wait;
    p->used = 0;
}

/* pst after the work on st so far (the caller's writes of the prompt, the steps reading the slot's
   memory). */
static skv_status skv_cuda_prefill_order(skv_cuda_cache *k, char *msg, size_t cap)
{
    CK(cudaEventRecord(k->pre_ev, k->st));
    CK(cudaStreamWaitEvent(k->pst, k->pre_ev, 0));
    return SKV_OK;
}

/* Prefill's input check on pst (ordered after st: skv_cuda_prefill_order): NaN or Inf in k_pre, v
   or k_post is SKV_ERR_NONFINITE naming the first element. The host waits for pst. */
static skv_status skv_cuda_prefill_finite(skv_cuda_cache *k, int64_t n, const skv_bf16 *k_pre, const skv_bf16 *v,
                                          const skv_bf16 *k_post, char *msg, size_t cap)
{
    cudaStream_t ps = k->pst;
    const int32_t Hk = k->cfg.n_kv_heads, D = k->cfg.head_dim;
    const int64_t HkD = (int64_t)Hk * D;
    const skv_bf16 *in[3] = {k_pre, v, k_post};
    static const char *const names[3] = {"k_pre", "v", "k_post"};
    CK(cudaMemsetAsync(k->flags, 0xff, 3 * sizeof *k->flags, ps));
    for (int t = 0; t < 3; t++)
        if (in[t]) CK(skv_cuda_find_nonfinite(ps, in[t], 1, 0, 1, 0, n * HkD, k->flags + t));
    CK(cudaMemcpyAsync(k->h_flags, k->flags, 3 * sizeof *k->flags, cudaMemcpyDeviceToHost, ps));
    CK(cudaStreamSynchronize(ps));
    for (int t = 0; t < 3; t++)
        if (k->h_flags[t] != ~0ull) {
            long long b = (long long)k->h_flags[t];
            snprintf(msg, cap, "skv_prefill: %s[%lld][%lld][%lld] is NaN or Inf", names[t], b / HkD, b / D % Hk,
                     b % D);
            return SKV_ERR_NONFINITE;
        }
    return SKV_OK;
}

/* The value store's address for the kernels: a place in the pinned host arena (vstore_host) by its
   device alias (the same address under unified addressing), device memory as it is. */
static const unsigned char *skv_cuda_store_of(const skv_cuda_cache *k, const skv_slot_mem *mem)
{
    const unsigned char *v = (const unsigned char *)mem->vstore;
    if (!mem->vstore_host || !mem->vstore) return v;
    if (mem->vstore >= k->host && (size_t)(mem->vstore - k->host) < k->lay.host_total)
        return (const unsigned char *)(k->host_dev + (mem->vstore - k->host));
    return v;
}

/*
 * Prefill of a dense layer's (layer, sequence), on pst: the finiteness check, the prompt's
 * post-RoPE keys (k_post, or the RoPE of k_pre) and its values into the slot's window mem->dn_k,
 * dn_v [Hk, n, D] (head stride n D, like a local window), the descriptor (n_local = n, no
 * candidates). No factorization, landmarks, outliers or value offload: returns when it is all
 * done.
 */
static skv_status skv_cuda_prefill_dense(skv_cuda_cache *k, int32_t layer, int32_t seq, int64_t n,
                                         const skv_slot_mem *mem, const skv_bf16 *k_pre, const skv_bf16 *v,
                                         const skv_bf16 *k_post, char *msg, size_t cap)
{
    const skv_config *g = &k->cfg;
    cudaStream_t ps = k->pst;
    const int32_t Hk = g->n_kv_heads, D = g->head_dim;
    const int64_t HkD = (int64_t)Hk * D;
    const size_t i = (size_t)layer * g->batch_size + seq;
    skv_cuda_seq *hs = &k->h_seqs[i];
    {
        skv_status s = skv_cuda_prefill_order(k, msg, cap);
        if (!s) s = skv_cuda_prefill_finite(k, n, k_pre, v, k_post, msg, cap);
        if (s) return s;
    }
    if (!k_post) { /* the library's RoPE of k_pre (kp_tmp is only used on pst) */
        CK(skv_cuda_rope(ps, D, k->sh.rotary_dim, k->sh.interleaved, n, Hk, 0, k->sh.cos_tab, k->sh.sin_tab, k_pre,
                         k->kp_tmp));
        k_post = k->kp_tmp;
    }
    skv_bf16 *wk = (skv_bf16 *)mem->dn_k, *wv = (skv_bf16 *)mem->dn_v;
    const size_t row = (size_t)D * sizeof(skv_bf16), tok = (size_t)HkD * sizeof(skv_bf16);
    for (int32_t h = 0; h < Hk; h++) {
        const size_t src = (size_t)h * D, dst = (size_t)h * n * D;
        CK(cudaMemcpy2DAsync(wk + dst, row, k_post + src, tok, row, (size_t)n, cudaMemcpyDeviceToDevice, ps));
        CK(cudaMemcpy2DAsync(wv + dst, row, v + src, tok, row, (size_t)n, cudaMemcpyDeviceToDevice, ps));
    }
    hs->loc_k = wk;
    hs->loc_v = wv;
    hs->n = n;
    hs->n_cand = 0;
    hs->n_local = (int32_t)n;
    hs->n_gen = 0;
    hs->has_sel = 0;
    CK(skv_cuda_set_seq(ps, k->d_seqs + i, hs));
    CK(cudaEventRecord(k->done_ev[i], ps));
    CK(cudaStreamSynchronize(ps));
    CK(cudaGetLastError());
    k->pend[i] = 0; /* done: nothing to wait for */
    return SKV_OK;
}

/*
 * Prefill of one (layer, sequence); the file's comment says what runs where. The descriptor of
 * the slot says "no prompt" from the moment pst overwrites the slot's regions until the side
 * work is done (a device list naming it meanwhile is refused on the device). Phase times are
 * read later (skv_cuda_cache_sync).
 */
skv_status skv_cuda_cache_prefill(void *bctx, int32_t layer, int32_t seq, int64_t n, int32_t N,
                                  const skv_slot_mem *mem, const skv_bf16 *k_pre, const skv_bf16 *v,
                                  const skv_bf16 *k_post, skv_stats *stats, char *msg, size_t cap)
{
    skv_cuda_cache *k = (skv_cuda_cache *)bctx;
    const skv_config *g = &k->cfg;
    const skv_layout *lay = &k->lay;
    cudaStream_t ps = k->pst, fs = k->fst, os = k->ost;
    const int32_t Hk = g->n_kv_heads, D = g->head_dim, cs = g->chunk_size, O = g->n_outlier_chunks;
    const int64_t HkD = (int64_t)Hk * D;
    const int32_t n_cand = N - O, n_local = (int32_t)(n - (int64_t)N * cs);
    const size_t i = (size_t)layer * g->batch_size + seq;
    char *sd = k->dev + skv_layout_slot_offset(lay, layer, seq);
    skv_cuda_seq *hs = &k->h_seqs[i];
    const int host_slot = hs->vc_data != NULL;
    (void)stats; /* times arrive at the next sync */
    if (hs->dense) return skv_cuda_prefill_dense(k, layer, seq, n, mem, k_pre, v, k_post, msg, cap);

    /* the timing set of the prefill before last: long finished (this prefill waits for its side work) */
    skv_cuda_pset *pt = &k->pset[k->pset_next];
    if (pt->used) {
        CK(cudaEventSynchronize(pt->e[SKV_PE_O1]));
        CK(cudaEventSynchronize(pt->e[SKV_PE_F1]));
        skv_cuda_take_prefill(k, pt);
    }
    {
        const skv_status s = skv_cuda_prefill_order(k, msg, cap);
        if (s) return s;
    }
    CK(cudaEventRecord(pt->e[SKV_PE_M0], ps));

    /* inputs are finite (after st's work, so the caller's writes are ordered before) */
    {
        const skv_status fs_ = skv_cuda_prefill_finite(k, n, k_pre, v, k_post, msg, cap);
        if (fs_) return fs_;
    }

    /* stage k_pre and v once the previous prefill's side work is done with the buffers */
    CK(cudaEventRecord(pt->e[SKV_PE_WA], ps));
    if (k->staged) {
        CK(cudaStreamWaitEvent(ps, k->fac_ev, 0));
        CK(cudaStreamWaitEvent(ps, k->off_ev, 0));
    }
    CK(cudaEventRecord(pt->e[SKV_PE_WB], ps));
    {   /* the slot has no prompt until its side work is done (a re-prefill overwrites its regions now) */
        skv_cuda_seq freed = *hs;
        freed.n = 0, freed.n_cand = 0, freed.n_local = 0, freed.n_gen = 0, freed.has_sel = 0;
        CK(skv_cuda_set_seq(ps, k->d_seqs + i, &freed));
    }
    const size_t bytes = (size_t)n * HkD * sizeof(skv_bf16);
    CK(cudaMemcpyAsync(k->kstage, k_pre, bytes, cudaMemcpyDeviceToDevice, ps));
    CK(cudaMemcpyAsync(k->vstage, v, bytes, cudaMemcpyDeviceToDevice, ps));

    if (!k_post) {
        CK(skv_cuda_rope(ps, D, k->sh.rotary_dim, k->sh.interleaved, n, Hk, 0, k->sh.cos_tab, k->sh.sin_tab,
                         k->kstage, k->kp_tmp));
        k_post = k->kp_tmp;
    }
    CK(cudaEventRecord(pt->e[SKV_PE_M1], ps));
    /* the growing regions where mem says (the fixed layout's, or pool pages) */
    int32_t *out_ids = (int32_t *)(sd + lay->out_ids), *cand_ids = (int32_t *)mem->cand_ids;
    CK(skv_cuda_landmarks_outliers(ps, N, cs, Hk, D, O, k_post, out_ids, cand_ids, (skv_bf16 *)mem->landmarks,
                                   k->lm_scratch));
    CK(cudaEventRecord(pt->e[SKV_PE_M2], ps));

    /* exact outliers and the local window stay on the device */
    if (O) {
        CK(skv_cuda_gather_chunks(ps, k_post, Hk, D, cs, out_ids, O, (skv_bf16 *)(sd + lay->out_k), 0));
        CK(skv_cuda_gather_chunks(ps, k->vstage, Hk, D, cs, out_ids, O, (skv_bf16 *)(sd + lay->out_v), 0));
    }
    if (n_local) {
        size_t row = (size_t)D * sizeof(skv_bf16), tok = (size_t)HkD * sizeof(skv_bf16);
        for (int32_t h = 0; h < Hk; h++) {
            size_t src = ((size_t)N * cs * Hk + h) * D, dst = (size_t)h * n_local * D;
            CK(cudaMemcpy2DAsync((skv_bf16 *)(sd + lay->loc_k) + dst, row, k_post + src, tok, row, n_local,
                                 cudaMemcpyDeviceToDevice, ps));
            CK(cudaMemcpy2DAsync((skv_bf16 *)(sd + lay->loc_v) + dst, row, k->vstage + src, tok, row, n_local,
                                 cudaMemcpyDeviceToDevice, ps));
        }
    }
    if (host_slot) /* an empty chunk cache: every index entry -1 */
        CK(cudaMemsetAsync(hs->vc_slot_of, 0xff, lay->vc_meta_bytes, ps));
    hs->landmarks = (const skv_bf16 *)mem->landmarks;
    hs->cand_ids = (const int32_t *)mem->cand_ids;
    hs->u = (const skv_bf16 *)mem->u;
    hs->vstore = skv_cuda_store_of(k, mem);
    hs->n = n;
    hs->n_cand = n_cand;
    hs->n_local = n_local;
    hs->n_gen = 0;
    hs->has_sel = 0;
    CK(cudaEventRecord(pt->e[SKV_PE_M3], ps));
    /* the side work starts once pst's own work is done, so that it never delays it: the candidate
       values on os (to the host store in a grid of at most offload_blocks blocks: a full grid would
       hold every SM for the ~2.5 ms its PCIe writes take at 64k tokens, and queue the kernels behind
       it; to the device store at full speed), and the factorization on fs */
    CK(cudaEventRecord(k->side_ev, ps));
    CK(cudaStreamWaitEvent(os, k->side_ev, 0));
    CK(cudaEventRecord(pt->e[SKV_PE_O0], os));
    CK(skv_cuda_store_chunks(os, lay->value_dtype, k->vstage, Hk, D, cs, cand_ids, n_cand, (void *)hs->vstore,
                             host_slot ? k->offload_blocks : 0));
    CK(cudaEventRecord(pt->e[SKV_PE_O1], os));
    CK(cudaEventRecord(k->off_ev, os));
    /* U and W of the slot, in bf16. Enqueued last, so pst does not idle while the host issues the
       factorization's calls */
    CK(cudaStreamWaitEvent(fs, k->side_ev, 0));
    CK(cudaEventRecord(pt->e[SKV_PE_F0], fs));
    skv_status s = skv_cuda_factorize(k->fac, g->factorize, n, k->kstage, k->uf, k->wf,
                                      ((unsigned long long)layer << 32) | (unsigned)seq, 0, msg, cap);
    if (s) return s;
    if (k->choose_rank) { /* rank == 0: the slot's rank on fs, to the host at the next sync (ref's bits where the
                             factors are: the reproducible mode and the rescoring, whose keys come from them) */
        CK(skv_cuda_rank_store(fs, g->reproducible || g->select_candidates > 0, k->rank_target, k->kstage, n, HkD,
                               g->rank, k->uf, k->wf, k->rank_scratch, k->d_rank + i, (skv_bf16 *)hs->u,
                               (skv_bf16 *)(sd + lay->w)));
    } else {
        CK(skv_cuda_f32_to_bf16(fs, k->uf, (skv_bf16 *)hs->u, n * g->rank));
        CK(skv_cuda_f32_to_bf16(fs, k->wf, (skv_bf16 *)(sd + lay->w), (int64_t)g->rank * HkD));
    }
    /* the reproducible mode and the rescoring: W's fixed point for the decode's canonical rebuild, once here */
    if (hs->wq) CK(skv_cuda_canon_wprep(fs, Hk, D, g->rank, hs->w, (void *)hs->wq));
    CK(cudaEventRecord(pt->e[SKV_PE_F1], fs));
    /* the slot is complete once both side streams are: its descriptor, then its done event (fac_ev
       after them: the next prefill, of this slot too, starts writing after this one's descriptor) */
    CK(cudaStreamWaitEvent(fs, k->off_ev, 0));
    CK(skv_cuda_set_seq(fs, k->d_seqs + i, hs));
    CK(cudaEventRecord(k->done_ev[i], fs));
    CK(cudaEventRecord(k->fac_ev, fs));

    /* the caller's buffers are free once pst is done with them (the side work reads the staged copies) */
    CK(cudaStreamSynchronize(ps));
    CK(cudaGetLastError());
    pt->used = 1;
    k->pset_next ^= 1;
    k->staged = 1;
    k->pend[i] = 1;
    return SKV_OK;
}
