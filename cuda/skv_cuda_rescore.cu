/*
 * skv_cuda_rescore.cu - the rescoring of a decode step's candidates (docs/DESIGN.md 4.5.1;
 * config.select_candidates, shape W > 0): skv_cuda_rescore_step runs the whole selection of a
 * sparse layer's step in place of skv_cuda_select_step:
 *   1. skv_cuda_select_candidates (skv_cuda_select.cu): steps 1-3 with the fixed rule and cap W,
 *      the W landmark-best candidates of each (sequence, KV head) in increasing order into
 *      ws->cand_idx / cand_ids / cand_cnt (ref: score_select with cap W);
 *   2. skv_cuda_canon_rescore_keys (skv_cuda_canon_rebuild.cu): the canonical keys of their tokens
 *      (docs/DESIGN.md 10.2) into ws->cand_k, in every mode (ref: rebuild_keys_canonical);
 *   3. rescore_kernel: per (sequence, KV head) the chunk masses (lib/skv_numerics.h
 *      skv_rescore_masses) and the mode's rule among the candidates (skv_select_head), mapped back
 *      to candidate indices, then select_finish (skv_cuda_select.cuh): the step's selection, the
 *      counts, their publication and, for a host slot, the chunk cache's plan, exactly as step 3
 *      writes them, so the attention and the fetch take them unchanged.
 * On the decision path: built with --fmad=false (CU_EXACT), every float operation an SKV_* macro
 * (an explicitly rounded intrinsic) or a function of lib/skv_numerics.h; each dot chain, each
 * canonical lane and each chunk's sum is run by one thread in ref's order. The launcher only
 * enqueues work (all per-step state is read from the device, so the step can be captured); it
 * never allocates or synchronizes.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_cuda_exact.cuh"
#include "skv_cuda_select.cuh"
#include "skv_cuda_topk.cuh"
#include "skv_numerics.h"

namespace {

constexpr int kRsNT = 512; /* threads per (sequence, KV head); >= the 256 canonical lanes */
constexpr int kRsGC = 4;   /* query heads per pass of the score chains */
static_assert(kRsNT % SKV_CANON_LANES == 0 && kMsBatch % kRsNT == 0, "whole lanes, whole walk batches");

struct RescoreArgs {
    SelectArgs s;              /* the step's selection outputs, the chunk caches, step_bad (select_finish) */
    const skv_cuda_io *io;     /* the step's q [B, Hq, D], published by step 1 */
    const int32_t *cand_idx;   /* [B, Hk, W] the first stage's candidates, increasing */
    const int32_t *cand_cnt;   /* [B, Hk] their number */
    const uint16_t *cand_k;    /* [B, Hk, W c, D] their tokens' canonical keys */
    float *cand_s;             /* [B, Hq, W c] scores, then e */
    float *cand_b;             /* [B, Hk, W] chunk masses */
};

/* Dynamic shared memory: q of the group [G][D] floats, then (SKV_SELECT_MASS) the walk's batch. */
__host__ __device__ inline size_t rs_q_bytes(int32_t G, int32_t D) { return align_up((size_t)G * D * sizeof(float), 16); }

/*
 * grid (1, Hk, B), block (h, b), W' = cand_cnt of (b, h) (min(W, n_cand)), T = W' c tokens:
 *  1. s_gm = SKV_MUL(skv_dot_bf16's chain of q_g and key m, scale) for every query head g of the
 *     group and token m (a thread per token, kRsGC chains at a time);
 *  2. per query head g, in order: M = s_g0 if it is NaN (ref's first-wins scan starts there), else
 *     the max of the non-NaN scores (a block reduction: the sign of a zero max changes no e);
 *     e_m = skv_expf(s_m - M) in place; Z = the canonical sum (lane k < 256 adds e_k, e_k+256, ..
 *     in order, canon_tree); per chunk i (a thread each) mu = the sum from 0 of SKV_DIV(e, Z) over
 *     its c tokens in order, and b_i = mu if g == 0 or mu > b_i (the group max);
 *  3. the rule over the W' masses as skv_select_head: keys order_desc(skv_select_key(b_i)), the
 *     count of select_count (cap = min(S, W'), in the mass mode A = the canonical sum of
 *     skv_mass_weight over the W' keys, target, the ordered walk, the floor), the block top-k of
 *     the strict order (ties to the lower i), winner i written as cand_idx[i] (increasing), then
 *     select_finish.
 */
__global__ void __launch_bounds__(kRsNT) rescore_kernel(const RescoreArgs r)
{
    __shared__ SelectSmemT<kRsNT> sm;
    __shared__ float part[SKV_CANON_LANES];
    __shared__ float wred[kRsNT / 32];
    __shared__ float bcast;
    extern __shared__ __align__(16) unsigned char rs_smem[];
    const SelectArgs &a = r.s;
    const skv_cuda_shape &sh = a.sh;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int32_t G = sh.Hq / sh.Hk, D = sh.D, c = sh.c, Wm = sh.W, S = sh.S;
    const int64_t Tm = (int64_t)Wm * c; /* the row stride of the candidates' tokens */
    float *qs = reinterpret_cast<float *>(rs_smem);
    unsigned long long *bat = reinterpret_cast<unsigned long long *>(rs_smem + rs_q_bytes(G, D));
    const uint16_t *q = (const uint16_t *)r.io->q;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t h = blockIdx.y; h < sh.Hk; h += gridDim.y) {
            if (a.seqs[b].idle) continue; /* an idle row (block-uniform): its candidates are stale, unread */
            const int64_t bh = (int64_t)b * sh.Hk + h, row0 = (int64_t)b * sh.Hq + (int64_t)h * G;
            const int32_t W = r.cand_cnt[bh];
            const int64_t T = (int64_t)W * c;
            float *bb = r.cand_b + bh * Wm;
            for (int32_t e = tid; e < G * D; e += kRsNT) qs[e] = skv_bf16_to_f32(q[row0 * D + e]);
            __syncthreads();
            /* 1. the scores of the group's query heads, a thread per token */
            const uint16_t *K = r.cand_k + bh * Tm * D;
            float *s = r.cand_s + row0 * Tm; /* [G][Tm] */
            for (int64_t m = tid; m < T; m += kRsNT) {
                const uint16_t *kr = K + m * D;
                for (int32_t g0 = 0; g0 < G; g0 += kRsGC) {
                    float acc[kRsGC];
#pragma unroll
                    for (int u = 0; u < kRsGC; u++) acc[u] = 0.0f;
                    if (D % 8 == 0) { /* rows 16-byte aligned (the region is, D % 8 == 0): 8 elements a load */
                        for (int32_t d0 = 0; d0 < D; d0 += 8) {
                            float x[8];
                            load_bf16<8>(kr + d0, x);
#pragma unroll
                            for (int j = 0; j < 8; j++)
#pragma unroll
                                for (int u = 0; u < kRsGC; u++)
                                    if (g0 + u < G) acc[u] = SKV_FMA(qs[(g0 + u) * D + d0 + j], x[j], acc[u]);
                        }
                    } else {
                        for (int32_t d = 0; d < D; d++) {
                            const float x = skv_bf16_to_f32(kr[d]);
#pragma unroll
                            for (int u = 0; u < kRsGC; u++)
                                if (g0 + u < G) acc[u] = SKV_FMA(qs[(g0 + u) * D + d], x, acc[u]);
                        }
                    }
#pragma unroll
                    for (int u = 0; u < kRsGC; u++)
                        if (g0 + u < G) s[(g0 + u) * Tm + m] = SKV_MUL(acc[u], sh.scale);
                }
            }
            __syncthreads();
            /* 2. per query head: the softmax over the T tokens, the chunk sums, the group max */
            for (int32_t g = 0; g < G && W > 0; g++) {
                float *sg = s + (int64_t)g * Tm;
                float mx = -INFINITY;
                for (int64_t m = tid; m < T; m += kRsNT) mx = fmaxf(mx, sg[m]); /* NaN never wins */
                mx = warp_max(mx);
                if (lane == 0) wred[warp] = mx;
                __syncthreads();
                if (tid == 0) {
                    float v = wred[0];
                    for (int w = 1; w < kRsNT / 32; w++) v = fmaxf(v, wred[w]);
                    const float first = sg[0];
                    bcast = first != first ? first : v;
                }
                __syncthreads();
                const float M = bcast;
                for (int64_t m = tid; m < T; m += kRsNT) sg[m] = skv_expf(SKV_SUB(sg[m], M));
                __syncthreads(); /* every e written (and bcast read) */
                if (tid < SKV_CANON_LANES) {
                    float P = 0.0f;
                    for (int64_t m = tid; m < T; m += SKV_CANON_LANES) P = SKV_ADD(P, sg[m]);
                    part[tid] = P;
                }
                const float z = canon_tree(part, tid < SKV_CANON_LANES ? tid : SKV_CANON_LANES);
                if (tid == 0) bcast = z;
                __syncthreads();
                const float Z = bcast;
                for (int32_t i = tid; i < W; i += kRsNT) {
                    const float *ei = sg + (int64_t)i * c;
                    float mu = 0.0f;
                    for (int32_t t = 0; t < c; t++) mu = SKV_ADD(mu, SKV_DIV(ei[t], Z));
                    if (g == 0 || mu > bb[i]) bb[i] = mu;
                }
                __syncthreads(); /* bcast, wred and part are reused by the next head */
            }
            /* 3. the rule among the W candidates (local index i; ties to the lower i, which is the
               lower candidate index: cand_idx is increasing) */
            const int32_t *ci = r.cand_idx + bh * Wm;
            int32_t *sel = a.sel_idx + bh * S;
            auto key = [=](int32_t i) { return order_desc(skv_select_key(bb[i])); };
            const int32_t k = select_count<kRsNT>(
                a, W, key, [](int32_t i) { return i; },
                [=](int32_t j) { return skv_mass_weight(skv_select_key(bb[j])); }, bat, sm);
            block_topk<kRsNT, false>(
                W, k, key, [=](int32_t pos, int32_t i) { sel[pos] = ci[i]; }, [](int32_t, int32_t) {}, sm.tk);
            __syncthreads(); /* sel complete */
            select_finish(a, b, h, k, sm);
            __syncthreads(); /* shared memory is reused by the next (b, h) */
        }
}

} /* namespace */

cudaError_t skv_cuda_rescore_step(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                  const skv_cuda_dws *ws, const skv_cuda_io *io, int32_t layer, int wq_seq,
                                  skv_cuda_score_node *graph, int *launches, cudaEvent_t scored)
{
    if (sh->B <= 0 || sh->Hk <= 0 || sh->cand_max <= 0) return cudaSuccess;
    if (sh->W <= 0 || !io->k || !ws->cand_k || !ws->cand_s || !ws->cand_b) return cudaErrorInvalidValue;
    cudaError_t e = skv_cuda_select_candidates(st, sh, seqs, ws, io, layer, graph, launches, scored);
    if (e != cudaSuccess) return e;
    if ((e = skv_cuda_canon_rescore_keys(st, sh, seqs, ws->cand_ids, ws->cand_cnt, ws->cand_k, wq_seq)) != cudaSuccess)
        return e;
    RescoreArgs r;
    memset(&r, 0, sizeof r);
    SelectArgs &a = r.s;
    a.sh = *sh;
    a.seqs = seqs;
    a.sel_idx = ws->sel_idx;
    a.sel_ids = ws->sel_ids;
    a.sel_cnt = ws->sel_cnt;
    a.vsrc = ws->vsrc;
    a.mlist = ws->mlist;
    a.mcount = ws->mcount;
    a.step_bad = ws->step_bad;
    a.vc_counts = ws->vc_counts;
    r.io = ws->io;
    r.cand_idx = ws->cand_idx;
    r.cand_cnt = ws->cand_cnt;
    r.cand_k = (const uint16_t *)ws->cand_k;
    r.cand_s = ws->cand_s;
    r.cand_b = ws->cand_b;
    const int32_t G = sh->Hq / sh->Hk;
    const size_t smem = rs_q_bytes(G, sh->D) + (sh->sel_mode == SKV_SELECT_MASS ? kMsBytes : 0);
    if ((e = allow_smem(rescore_kernel, smem)) != cudaSuccess) return e;
    e = launch(rescore_kernel, dim3(1, clamp_yz(sh->Hk), clamp_yz(sh->B)), dim3(kRsNT), smem, st, false, r);
    if (launches) *launches += 2;
    return e;
}
