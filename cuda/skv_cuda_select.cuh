/*
 * skv_cuda_select.cuh - what the selection kernels share (skv_cuda_select.cu: select_kernel,
 * selz_kernel; skv_cuda_rescore.cu: the rescoring's rescore_kernel): the canonical sum's tree
 * (canon_tree), the kernels' arguments (SelectArgs) and shared state (SelectSmemT), the mass
 * rule's count (mass_total, mass_walk, select_count) and the end of a (sequence, KV head)'s
 * selection (select_finish: the published selection, the counts, the chunk cache's plan).
 * Header-only, in an anonymous namespace (each file has its own copy); included by decision-path
 * files only (built with --fmad=false).
 */
#ifndef SKV_CUDA_SELECT_CUH
#define SKV_CUDA_SELECT_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_cuda_exact.cuh"
#include "skv_cuda_topk.cuh"
#include "skv_numerics.h"

namespace {

/*
 * The fixed pairwise tree of the canonical sum over the 256 lane partials in part[] (k: this
 * thread's lane; every thread of the block calls it, after writing its partial): lanes k < w
 * add part[k + w] for w = 128, 64, 32 in shared memory, then the first warp (k < 32, whole)
 * by shuffles. The sum is in lane k = 0: skv_canonical_sum's order, the same bits.
 */
__device__ __forceinline__ float canon_tree(float *part, int k)
{
    __syncthreads();
    for (int w = SKV_CANON_LANES / 2; w >= 32; w >>= 1) {
        if (k < w) part[k] = SKV_ADD(part[k], part[k + w]);
        __syncthreads();
    }
    float v = 0.0f;
    if (k < 32) {
        v = part[k];
#pragma unroll
        for (int w = 16; w >= 1; w >>= 1) {
            const float o = __shfl_down_sync(kFullMask, v, w);
            v = SKV_ADD(v, o); /* lanes k < w: P[k] + P[k+w] */
        }
    }
    return v;
}


struct SelectArgs {
    skv_cuda_shape sh;
    const skv_cuda_seq *seqs;
    const float *e, *Z;                 /* [B, Hq, cand_max], [B, Hq] */
    float *amax;                        /* [B, Hk, cand_max] or NULL */
    unsigned long long *pool;           /* [B, Hk, pool_cap] */
    int32_t pool_cap;
    unsigned *cnt;                      /* [B, Hk] */
    int32_t *sel_idx, *sel_ids;         /* [B, Hk, S] */
    int32_t *sel_cnt;                   /* [B, Hk] the count k of each (b, h) */
    float *mkey;                        /* [B, Hk, cand_max] the masses m_j (SKV_SELECT_MASS, split path) */
    int32_t *vsrc, *mlist, *mcount;     /* host slots */
    const int32_t *step_bad;            /* NULL: op-level (no chunk caches) */
    unsigned long long *vc_counts;
    /* the fused kernel: scores turned into e in place, the max accumulators */
    float *s;
    const unsigned *macc;
    const float *s0;
};

template <int NT>
struct SelectSmemT {
    TopkSmem<NT> tk;
    uint32_t *keys; /* the keys of a tile, dynamic shared memory */
    int32_t hits[NT / 32];
    int last;
    /* SKV_SELECT_MASS: the canonical lanes of A, the walk's state */
    float part[SKV_CANON_LANES];
    float mA, mcum;
    int32_t mk, mdone;
    uint32_t mcnt;
};

/* ---- SKV_SELECT_MASS: the count k of one (b, h) (docs/DESIGN.md 4.5) -------------------------- */

constexpr int32_t kMsBatch = 2048; /* candidates per batch of the ordered walk (shared memory: 16 KB) */
constexpr size_t kMsBytes = (size_t)kMsBatch * sizeof(unsigned long long);

/* A = the canonical sum of w(j) over j < n (skv_canonical_sum: lane tid < 256 adds w(tid),
   w(tid + 256), ... in order, then the fixed tree), returned to every thread. All NT threads call. */
template <int NT, class WFn>
__device__ float mass_total(int32_t n, WFn w, SelectSmemT<NT> &sm)
{
    const int tid = threadIdx.x;
    if (tid < SKV_CANON_LANES) {
        float P = 0.0f;
        for (int32_t j = tid; j < n; j += SKV_CANON_LANES) P = SKV_ADD(P, w(j));
        sm.part[tid] = P;
    }
    const float v = canon_tree(sm.part, tid);
    if (tid == 0) sm.mA = v;
    __syncthreads();
    const float A = sm.mA;
    __syncthreads(); /* part is free again */
    return A;
}

/*
 * Steps 5-7 of the mass rule over n items (i < n: order image key(i), candidate index idx(i),
 * items in increasing candidate order, so that ties go to the lower i): the cap best items t_1 ..
 * t_cap are walked best first in batches of kMsBatch ranks: batch [lo, hi) is the set of items
 * whose rank (in the strict order of section 5.3) lies in (lo, hi], found by two radix thresholds
 * (ranks lo and hi) and one ordered count of the items equal to each; its composite keys
 * (image << 32 | ~index: larger key first, then lower index) go to bat (shared memory, kMsBatch
 * entries) and are sorted by a bitonic network; then thread 0 adds their masses
 * skv_mass_weight(key) in order, one float add each, into the running sum cum, and stops at the
 * first rank whose cum >= target (skv_mass_count's loop, carried over the batches). Returns
 * max(k, floor) to every thread; all NT threads call.
 */
template <int NT, class KeyFn, class IdxFn>
__device__ int32_t mass_walk(int32_t n, int32_t cap, float target, int32_t floor, KeyFn key, IdxFn idx,
                             unsigned long long *bat, SelectSmemT<NT> &sm)
{
    static_assert(kMsBatch % NT == 0, "whole batches per thread");
    const int tid = threadIdx.x;
    uint32_t *hist = sm.tk.hist;
    auto hist_pass = [=](int shift, uint32_t mask, uint32_t prefix) {
        for (int32_t base = 0; base < n; base += NT) { /* uniform trip count: warp ops inside */
            const int32_t i = base + tid;
            hist_add(hist, i < n, i < n ? key(i) : 0u, shift, mask, prefix);
        }
    };
    if (tid == 0) {
        sm.mk = cap;
        sm.mdone = 0;
        sm.mcum = 0.0f;
    }
    __syncthreads();
    for (int32_t lo = 0; lo < cap; lo += kMsBatch) {
        const int32_t hi = min(cap, lo + kMsBatch), nb = hi - lo;
        uint32_t T1, need1, T2, need2;
        if (tid == 0) sm.mcnt = 0; /* the thresholds' barriers order this before the appends */
        radix_threshold<NT>(lo, hist_pass, sm.tk, &T1, &need1);
        radix_threshold<NT>(hi, hist_pass, sm.tk, &T2, &need2);
        /* the members of the batch: in the top hi, not in the top lo (ordered counts of the items
           equal to each threshold, contiguous ownership as ordered_compaction) */
        const int32_t per = (int32_t)ceil_div64(n, NT);
        const int32_t i0 = min(n, tid * per), i1 = min(n, i0 + per);
        uint32_t eq1 = 0, eq2 = 0;
        for (int32_t i = i0; i < i1; i++) {
            const uint32_t u = key(i);
            eq1 += u == T1;
            eq2 += u == T2;
        }
        unsigned long long excl;
        cub::BlockScan<unsigned long long, NT>(sm.tk.scan).ExclusiveSum(((unsigned long long)eq1 << 32) | eq2, excl);
        uint32_t e1 = (uint32_t)(excl >> 32), e2 = (uint32_t)(excl & 0xffffffffu);
        for (int32_t i = i0; i < i1; i++) {
            const uint32_t u = key(i);
            const bool w1 = u > T1 || (u == T1 && e1 < need1), w2 = u > T2 || (u == T2 && e2 < need2);
            if (w2 && !w1) {
                const uint32_t slot = atomicAdd(&sm.mcnt, 1u);
                bat[slot] = ((unsigned long long)u << 32) | (uint32_t)~(uint32_t)idx(i);
            }
            e1 += u == T1;
            e2 += u == T2;
        }
        int32_t np2 = 1;
        while (np2 < nb) np2 <<= 1;
        __syncthreads(); /* the batch is complete (nb members) */
        for (int32_t i = nb + tid; i < np2; i += NT) bat[i] = 0ull; /* padding sorts last */
        __syncthreads();
        /* bitonic network, descending */
        for (int32_t kk = 2; kk <= np2; kk <<= 1)
            for (int32_t jj = kk >> 1; jj > 0; jj >>= 1) {
                for (int32_t i = tid; i < np2; i += NT) {
                    const int32_t ix = i ^ jj;
                    if (ix > i) {
                        const unsigned long long x = bat[i], y = bat[ix];
                        if ((i & kk) == 0 ? x < y : x > y) {
                            bat[i] = y;
                            bat[ix] = x;
                        }
                    }
                }
                __syncthreads();
            }
        /* the masses, best first, in place as floats */
        constexpr int PER = kMsBatch / NT;
        float wv[PER];
#pragma unroll
        for (int u = 0; u < PER; u++) {
            const int32_t i = tid + u * NT;
            wv[u] = i < nb ? skv_mass_weight(order_desc_inv((uint32_t)(bat[i] >> 32))) : 0.0f;
        }
        __syncthreads();
        float *wf = reinterpret_cast<float *>(bat);
#pragma unroll
        for (int u = 0; u < PER; u++) {
            const int32_t i = tid + u * NT;
            if (i < nb) wf[i] = wv[u];
        }
        __syncthreads();
        if (tid == 0) {
            float cum = sm.mcum;
            for (int32_t i = 0; i < nb; i++) {
                cum = SKV_ADD(cum, wf[i]);
                if (cum >= target) {
                    sm.mk = lo + i + 1;
                    sm.mdone = 1;
                    break;
                }
            }
            sm.mcum = cum;
        }
        __syncthreads();
        if (sm.mdone) break; /* block-uniform */
        __syncthreads();     /* bat and the thresholds' state are reused by the next batch */
    }
    const int32_t k = sm.mk;
    __syncthreads();
    return k < floor ? floor : k;
}

/*
 * The count k of (b, h) (n candidates): cap = min(sel_cap, n); FIXED k = cap; MASS: A over the
 * n candidates' masses w(j) (j in candidate order), target = sel_mass * A, then mass_walk over
 * the m items (i < m: key(i), idx(i); m = n, or the pool's entries, which hold the cap best).
 */
template <int NT, class KeyFn, class IdxFn, class WFn>
__device__ int32_t select_count(const SelectArgs &a, int32_t n, KeyFn key, IdxFn idx, WFn w, unsigned long long *bat,
                                SelectSmemT<NT> &sm, int32_t m = -1)
{
    const skv_cuda_shape &sh = a.sh;
    const int32_t cap = min(sh.sel_cap, n);
    if (sh.sel_mode != SKV_SELECT_MASS) return cap;
    const float A = mass_total<NT>(n, w, sm);
    const float target = SKV_MUL(sh.sel_mass, A);
    return mass_walk<NT>(m < 0 ? n : m, cap, target, min(sh.sel_min, cap), key, idx, bat, sm);
}

/*
 * Final selection of (b, h) is in a.sel_idx[0..k): entries [k, S) become -1, the count goes to
 * a.sel_cnt, the chunk ids likewise, and for a host slot the chunk cache's rule (lib/skv_plan.h)
 * runs on the k selected chunks: hits stamp their entries; the n_miss least recently used
 * unpinned entries (block top-k: key ~(stamp + 1), pinned 0; ties to the lower entry) are taken
 * by the misses in increasing position order. On a bad step nothing of the cache changes (the
 * step's values are never read back). The state update touches disjoint words: an evicted
 * candidate is cached, a missed one is not.
 */
template <int NT>
__device__ void select_finish(const SelectArgs &a, int32_t b, int32_t h, int32_t k, SelectSmemT<NT> &sm)
{
    const skv_cuda_shape &sh = a.sh;
    const int32_t S = sh.S, n = a.seqs[b].n_cand;
    const int64_t bh = (int64_t)b * sh.Hk + h;
    int32_t *sel = a.sel_idx + bh * S;
    const int32_t *cids = a.seqs[b].cand_ids;
    for (int32_t s = k + threadIdx.x; s < S; s += NT) sel[s] = -1;
    if (a.sel_ids && cids)
        for (int32_t s = threadIdx.x; s < S; s += NT) a.sel_ids[bh * S + s] = s < k ? cids[(int64_t)h * n + sel[s]] : -1;
    if (threadIdx.x == 0 && a.sel_cnt) a.sel_cnt[bh] = k;
    const skv_cuda_seq &sq = a.seqs[b];
    if (!a.step_bad) return; /* op-level: no cache state */
    const int bad = *a.step_bad != 0;
    __syncthreads(); /* sel and sel_ids complete */
    if (!bad) { /* a good step publishes its selection (a bad one keeps the last) */
        for (int32_t s = threadIdx.x; s < S; s += NT) {
            sq.pub_sel_idx[(int64_t)h * S + s] = sel[s];
            if (a.sel_ids && cids) sq.pub_sel_ids[(int64_t)h * S + s] = a.sel_ids[bh * S + s];
        }
        if (threadIdx.x == 0 && sq.pub_sel_cnt) sq.pub_sel_cnt[h] = k;
    }
    if (!sq.vc_data) return; /* block-uniform */
    const int32_t E = sh.vc_chunks, step = sq.n_gen;
    int32_t *slot_of = sq.vc_slot_of + (int64_t)h * sh.cand_max;
    int32_t *owner = sq.vc_owner + (int64_t)h * E, *stamp = sq.vc_stamp + (int64_t)h * E;
    int32_t *vsrc = a.vsrc + bh * S, *mlist = a.mlist + bh * S;
    /* hits: stamped now (pinned); misses marked; positions past k: entry 0, never read */
    int nh = 0;
    for (int32_t s = threadIdx.x; s < S; s += NT) {
        if (s >= k) {
            vsrc[s] = 0;
            continue;
        }
        const int32_t e = slot_of[sel[s]];
        if (e >= 0) {
            nh++;
            vsrc[s] = e;
            if (!bad) stamp[e] = step;
        } else {
            vsrc[s] = (int32_t)0x80000000;
        }
    }
    nh = warp_sum_int(nh);
    if ((threadIdx.x & 31) == 0) sm.hits[threadIdx.x >> 5] = nh;
    __syncthreads(); /* stamps and vsrc visible */
    int32_t hits = 0;
    for (int w = 0; w < NT / 32; w++) hits += sm.hits[w];
    const int32_t n_miss = k - hits;
    /* victims into mlist[0..n_miss) in increasing entry order (scratch: positions come next) */
    block_topk<NT, false>(
        E, n_miss,
        [=](int32_t e) { return stamp[e] == step && !bad ? 0u : ~(uint32_t)(stamp[e] + 1); },
        [=](int32_t pos, int32_t e) { mlist[pos] = e; }, [](int32_t, int32_t) {}, sm.tk);
    /* miss ranks: the misses' positions in increasing s, by the same ordered compaction */
    block_topk<NT, false>(
        k, n_miss, [=](int32_t s) { return vsrc[s] < 0 ? 1u : 0u; },
        [=](int32_t pos, int32_t s) {
            const int32_t e = mlist[pos]; /* this thread's own victim: read before it is replaced */
            vsrc[s] = (int32_t)(0x80000000u | (uint32_t)e);
        },
        [](int32_t, int32_t) {}, sm.tk);
    __syncthreads(); /* every victim read */
    for (int32_t s = threadIdx.x; s < k; s += NT) {
        const int32_t v = vsrc[s];
        if (v >= 0) continue;
        const int32_t e = v & 0x7fffffff, m = sel[s];
        if (!bad) {
            const int32_t old = owner[e];
            if (old >= 0) slot_of[old] = -1;
            owner[e] = m;
            slot_of[m] = e;
            stamp[e] = step;
        }
    }
    __syncthreads();
    /* the fetch list: missed positions in increasing order */
    block_topk<NT, false>(
        k, n_miss, [=](int32_t s) { return vsrc[s] < 0 ? 1u : 0u; }, [=](int32_t pos, int32_t s) { mlist[pos] = s; },
        [](int32_t, int32_t) {}, sm.tk);
    if (threadIdx.x == 0) {
        a.mcount[bh] = bad ? 0 : n_miss;
        if (!bad) {
            atomicAdd(&a.vc_counts[0], (unsigned long long)hits);
            atomicAdd(&a.vc_counts[1], (unsigned long long)n_miss);
        }
    }
}

} /* namespace */

#endif /* SKV_CUDA_SELECT_CUH */
