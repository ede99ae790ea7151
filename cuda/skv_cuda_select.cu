/*
 * skv_cuda_select.cu - steps 2 and 3 of a decode's selection and the entry that runs
 * steps 1-3 (skv_cuda_select_step; skv_cuda.h lists the steps): e_j = exp(s_j - M)
 * and their canonical sum Z per query head (expsum_kernel), a_j, the top-S per tile of
 * candidates and the merge of the tiles' winners (select_kernel), or both steps in
 * one CTA per (sequence, KV head) (selz_kernel); then the published selection and, for
 * a host-placed slot, the chunk cache's plan (select_finish: hits, misses, the entries
 * they replace, lib/skv_plan.h). Step 1 is skv_cuda_score (skv_cuda_score.cu).
 *
 * Reached from the op-level slot score_select (skv_cuda_score_select_op,
 * skv_cuda_ops.cu) and from every decode step of the cache (skv_cuda_enqueue_step,
 * skv_cuda_cache.cu). On the decision path: built with --fmad=false; the canonical sum
 * runs skv_canonical_sum's lanes and tree, the top-S is the exact block top-k of
 * skv_cuda_topk.cuh.
 *
 * Launchers only enqueue work; they never allocate or synchronize.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

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

/* ---- decode selection: step 2, e_j and their canonical sum ----------------------------------- */

constexpr int kExNT = 256;                 /* = SKV_CANON_LANES: one lane per canonical partial */
constexpr int kExPer = 8;                  /* e_j per thread */
constexpr int kExTile = kExNT * kExPer;    /* candidates per block */
static_assert(kExNT == SKV_CANON_LANES, "the canonical sum has 256 lanes");

/*
 * grid (X, Hq, B). M = s_0 if it is NaN (ref's scan starts there and NaN never compares
 * greater), else the max of the non-NaN scores (the sign of a zero max changes no e_j).
 * Each block turns its tile of scores into e_j = skv_expf(s_j - M) in place. The last block
 * of (b, qh) (a counter after a fence) computes Z = canonical sum of e: lane k adds
 * e_k, e_{k+256}, ... in order (loads from L2, 8 in flight), then the fixed pairwise tree.
 */
__global__ void __launch_bounds__(kExNT)
    expsum_kernel(const skv_cuda_shape sh, const skv_cuda_seq *seqs, float *scores, const unsigned *macc,
                  const float *s0, float *Z, unsigned *cnt)
{
    __shared__ float part[kExNT];
    __shared__ int last;
    pdl_wait();
    const int tid = threadIdx.x;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t qh = blockIdx.y; qh < sh.Hq; qh += gridDim.y) {
            const int32_t n = seqs[b].n_cand, nblk = (int32_t)ceil_div64(n, kExTile);
            if ((int32_t)blockIdx.x >= nblk) continue; /* block-uniform */
            const int64_t row = (int64_t)b * sh.Hq + qh;
            float *s = scores + row * sh.cand_max;
            const float first = s0[row];
            const float M = first != first ? first : order_desc_inv(macc[row]);
            const int32_t j0 = blockIdx.x * kExTile;
            float x[kExPer];
#pragma unroll
            for (int u = 0; u < kExPer; u++) {
                const int32_t j = j0 + u * kExNT + tid;
                x[u] = j < n ? s[j] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < kExPer; u++) {
                const int32_t j = j0 + u * kExNT + tid;
                if (j < n) s[j] = skv_expf(SKV_SUB(x[u], M));
            }
            __threadfence();
            __syncthreads();
            if (tid == 0) last = atomicAdd(&cnt[row], 1u) == (unsigned)nblk - 1;
            __syncthreads();
            if (!last) continue; /* block-uniform */
            __threadfence();
            /* lane tid's chain: 16 loads in flight, the next batch loaded before this one is added
               (adding the zeros past n changes no sum: e >= 0) */
            constexpr int PF = 16;
            float P = 0.0f, cur[PF], nxt[PF];
#pragma unroll
            for (int u = 0; u < PF; u++) {
                const int32_t j = tid + u * kExNT;
                cur[u] = j < n ? __ldcg(s + j) : 0.0f;
            }
            for (int32_t j0 = tid; j0 < n; j0 += PF * kExNT) {
#pragma unroll
                for (int u = 0; u < PF; u++) {
                    const int32_t j = j0 + (PF + u) * kExNT;
                    nxt[u] = j < n ? __ldcg(s + j) : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < PF; u++) P = SKV_ADD(P, cur[u]);
#pragma unroll
                for (int u = 0; u < PF; u++) cur[u] = nxt[u];
            }
            part[tid] = P;
            const float v = canon_tree(part, tid);
            if (tid == 0) {
                Z[row] = v;
                cnt[row] = 0;
            }
            __syncthreads(); /* part and last are reused by the next (b, qh) */
        }
    pdl_trigger();
}

/* ---- decode selection: step 3, top-S per tile, merge, chunk-cache plan ------------------------ */

constexpr int kSeNT = 512;               /* threads per tile block */
constexpr int kSePer = 8;                /* candidates per thread */
constexpr int kSeTile = kSeNT * kSePer;  /* candidates per tile */

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
using SelectSmem = SelectSmemT<kSeNT>;
/* Keys in shared memory at key_slot(i): one pad word per 32 keys, so that both the strided
   reads of the radix passes and the contiguous runs of the ordered compaction are free of
   bank conflicts. */
__device__ __forceinline__ int32_t key_slot(int32_t i) { return i + (i >> 5); }
constexpr int32_t kSeKeyWords = kSeTile + kSeTile / 32; /* then, SKV_SELECT_MASS: the walk's batch */
constexpr size_t kSeKeyBytes = (size_t)kSeKeyWords * sizeof(uint32_t);
static_assert(kSeKeyBytes % 16 == 0, "the batch after the keys is aligned");

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

/*
 * grid (X, Hk, B), block (x, h, b): tile x of kSeTile candidates of (b, h).
 *  1. a_j = p of query head 0, then a = p if p > a for g = 1.. in order (ref's loop, NaN
 *     included), p = SKV_DIV(e_j, Z); keys order_desc(skv_select_key(a_j)) in shared memory;
 *  2. the tile's top min(S, count) (block_topk): with one tile they are the selection; else
 *     they go to the pool (key << 32 | j, increasing j within the tile, tiles in order: the pool
 *     is in increasing j) and the last tile block of (b, h) selects the top S of the pool.
 */
__global__ void __launch_bounds__(kSeNT) select_kernel(const SelectArgs a)
{
    __shared__ SelectSmem sm;
    extern __shared__ __align__(16) uint32_t se_keys[];
    if (threadIdx.x == 0) sm.keys = se_keys;
    pdl_wait();
    pdl_trigger(); /* the attention's resident items need nothing of this kernel */
    __syncthreads();
    const skv_cuda_shape &sh = a.sh;
    const int tid = threadIdx.x;
    const int32_t G = sh.Hq / sh.Hk, S = sh.S;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t h = blockIdx.y; h < sh.Hk; h += gridDim.y) {
            const int32_t n = a.seqs[b].n_cand, ntl = (int32_t)ceil_div64(n, kSeTile);
            if ((int32_t)blockIdx.x >= ntl) continue; /* block-uniform */
            const int64_t bh = (int64_t)b * sh.Hk + h, cm = sh.cand_max;
            const int32_t j0 = blockIdx.x * kSeTile, cnt = min(kSeTile, n - j0);
            const float *e0 = a.e + ((int64_t)b * sh.Hq + (int64_t)h * G) * cm;
            const float *Zr = a.Z + (int64_t)b * sh.Hq + (int64_t)h * G;
            /* keys of the tile into shared memory, strided over the threads (coalesced loads, four
               items' worth in flight per thread) */
            float zr[8];
#pragma unroll
            for (int g = 0; g < 8; g++) zr[g] = g < G ? Zr[g] : 1.0f;
#pragma unroll
            for (int it = 0; it < kSePer; it++) {
                const int32_t i = it * kSeNT + tid, j = j0 + i;
                if (i < cnt) {
                    float ev[8];
#pragma unroll
                    for (int g = 0; g < 8; g++) ev[g] = g < G ? e0[g * cm + j] : 0.0f;
                    float av = SKV_DIV(ev[0], zr[0]);
#pragma unroll
                    for (int g = 1; g < 8; g++) {
                        if (g >= G) break;
                        const float p = SKV_DIV(ev[g], zr[g]);
                        if (p > av) av = p;
                    }
                    for (int32_t g = 8; g < G; g++) { /* groups above 8 query heads */
                        const float p = SKV_DIV(e0[g * cm + j], Zr[g]);
                        if (p > av) av = p;
                    }
                    sm.keys[key_slot(i)] = order_desc(skv_select_key(av));
                    if (a.amax) a.amax[bh * cm + j] = av;
                    if (a.mkey) a.mkey[bh * cm + j] = skv_mass_weight(skv_select_key(av));
                }
            }
            __syncthreads();
            int32_t *sel = a.sel_idx + bh * S;
            unsigned long long *pool = a.pool + bh * a.pool_cap + (int64_t)blockIdx.x * S;
            const int32_t kt = min(S, cnt);
            if (ntl == 1) {
                const uint32_t *keys = sm.keys;
                const int32_t k = select_count<kSeNT>(
                    a, n, [=](int32_t i) { return keys[key_slot(i)]; }, [](int32_t i) { return i; },
                    [=](int32_t j) { return skv_mass_weight(order_desc_inv(keys[key_slot(j)])); },
                    reinterpret_cast<unsigned long long *>(se_keys + kSeKeyWords), sm);
                block_topk<kSeNT, false>(
                    cnt, k, [=](int32_t i) { return keys[key_slot(i)]; }, [=](int32_t pos, int32_t i) { sel[pos] = j0 + i; },
                    [](int32_t, int32_t) {}, sm.tk);
                __syncthreads(); /* sel complete */
                select_finish(a, b, h, k, sm);
                continue;
            }
            const uint32_t *keys = sm.keys;
            block_topk<kSeNT, false>(
                cnt, kt, [=](int32_t i) { return keys[key_slot(i)]; },
                [=](int32_t pos, int32_t i) {
                    pool[pos] = ((unsigned long long)keys[key_slot(i)] << 32) | (uint32_t)(j0 + i);
                },
                [](int32_t, int32_t) {}, sm.tk);
            __threadfence();
            __syncthreads();
            if (tid == 0) sm.last = atomicAdd(&a.cnt[bh], 1u) == (unsigned)ntl - 1;
            __syncthreads();
            if (!sm.last) continue; /* block-uniform */
            __threadfence();
            /* the pool: full tiles gave S each (a tile holds at least S... or all its items) */
            const int32_t per_tile = min(S, kSeTile), last_cnt = n - (ntl - 1) * kSeTile;
            const int32_t np = (ntl - 1) * per_tile + min(S, last_cnt);
            const unsigned long long *pl = a.pool + bh * a.pool_cap;
            /* pool index -> entry: tile t's winners start at t * S */
            auto at = [=](int32_t i) {
                const int32_t t = i / per_tile;
                return __ldcg(pl + (int64_t)t * S + (i - t * per_tile));
            };
            const float *mk = a.mkey ? a.mkey + bh * cm : nullptr;
            auto idx_of = [=](int32_t i) { return (int32_t)(at(i) & 0xffffffffu); };
            auto w_of = [=](int32_t j) { return __ldcg(mk + j); };
            int32_t k;
            if (np <= kSeTile) { /* the pool's keys fit in shared memory (always, up to 2M-token prompts) */
                uint32_t *keys = sm.keys;
                for (int32_t i = tid; i < np; i += kSeNT) keys[key_slot(i)] = (uint32_t)(at(i) >> 32);
                __syncthreads();
                auto key_of = [=](int32_t i) { return keys[key_slot(i)]; };
                k = select_count<kSeNT>(a, n, key_of, idx_of, w_of, reinterpret_cast<unsigned long long *>(se_keys + kSeKeyWords), sm, np);
                block_topk<kSeNT, false>(
                    np, k, key_of, [=](int32_t pos, int32_t i) { sel[pos] = idx_of(i); }, [](int32_t, int32_t) {}, sm.tk);
            } else {
                auto key_of = [=](int32_t i) { return (uint32_t)(at(i) >> 32); };
                k = select_count<kSeNT>(a, n, key_of, idx_of, w_of, reinterpret_cast<unsigned long long *>(se_keys + kSeKeyWords), sm, np);
                block_topk<kSeNT, false>(
                    np, k, key_of, [=](int32_t pos, int32_t i) { sel[pos] = idx_of(i); }, [](int32_t, int32_t) {}, sm.tk);
            }
            __syncthreads();
            select_finish(a, b, h, k, sm);
            if (tid == 0) a.cnt[bh] = 0;
        }
}


/* ---- decode selection, fused: e_j, Z and the top-S of one (b, h) in one CTA ------------------ */

constexpr int kSzNT = 1024;                 /* 4 sets of 256 canonical lanes */
constexpr int32_t kSzMax = 32768;           /* candidates whose keys fit in shared memory */
static_assert(kSzNT == 4 * SKV_CANON_LANES, "a set of threads per query head");

/* Words of the fused kernel's keys for n candidates, rounded up to 16 bytes (the mass walk's batch follows). */
__host__ __device__ constexpr size_t sz_key_words(int32_t n) { return ((size_t)n + (size_t)n / 32 + 1 + 3) / 4 * 4; }
__host__ __device__ constexpr size_t sz_key_bytes(int32_t n) { return sz_key_words(n) * sizeof(uint32_t); }

/*
 * grid (1, Hk, B), block (h, b) when every sequence has at most kSzMax candidates: steps 2 and 3
 * of the decode for the whole (b, h) in one CTA, with no pool and no second kernel.
 *  1. Query heads of the group four at a time, one set of 256 threads each: lane k of the set
 *     turns s_j into e_j = skv_expf(s_j - M) in place for j = k, k + 256, ... and adds them in
 *     that order (the canonical partial k), then the fixed pairwise tree gives Z (expsum's
 *     arithmetic, the same bits).
 *  2. Keys a_j over all n candidates, then the block top-S (select_kernel's single-tile path)
 *     and select_finish.
 */
__global__ void __launch_bounds__(kSzNT) selz_kernel(const SelectArgs a)
{
    __shared__ SelectSmemT<kSzNT> sm;
    __shared__ float part[4][SKV_CANON_LANES];
    __shared__ float zs[kScMaxGp];
    extern __shared__ __align__(16) uint32_t sz_keys[];
    pdl_wait();
    pdl_trigger(); /* the attention's resident items need nothing of this kernel */
    const skv_cuda_shape &sh = a.sh;
    const int tid = threadIdx.x, set = tid >> 8, k = tid & (SKV_CANON_LANES - 1);
    const int32_t G = sh.Hq / sh.Hk, S = sh.S;
    const int64_t cm = sh.cand_max;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t h = blockIdx.y; h < sh.Hk; h += gridDim.y) {
            const int32_t n = a.seqs[b].n_cand;
            const int64_t bh = (int64_t)b * sh.Hk + h, row0 = (int64_t)b * sh.Hq + (int64_t)h * G;
            for (int32_t g0 = 0; g0 < G; g0 += 4) {
                const int32_t g = g0 + set;
                float P = 0.0f;
                if (g < G) {
                    const int64_t row = row0 + g;
                    float *s = a.s + row * cm;
                    const float first = a.s0[row];
                    const float M = first != first ? first : order_desc_inv(a.macc[row]);
                    int32_t j = k;
                    constexpr int U = 16; /* loads in flight (one L2 round trip per U); the adds stay in order */
                    for (; j + (U - 1) * SKV_CANON_LANES < n; j += U * SKV_CANON_LANES) {
                        float x[U];
#pragma unroll
                        for (int u = 0; u < U; u++) x[u] = s[j + u * SKV_CANON_LANES];
#pragma unroll
                        for (int u = 0; u < U; u++) {
                            const float ev = skv_expf(SKV_SUB(x[u], M));
                            s[j + u * SKV_CANON_LANES] = ev;
                            P = SKV_ADD(P, ev);
                        }
                    }
                    for (; j < n; j += SKV_CANON_LANES) {
                        const float ev = skv_expf(SKV_SUB(s[j], M));
                        s[j] = ev;
                        P = SKV_ADD(P, ev);
                    }
                }
                part[set][k] = P;
                const float v = canon_tree(part[set], k);
                if (k == 0 && g < G) {
                    zs[g] = v;
                    const_cast<float *>(a.Z)[row0 + g] = v; /* Z is the workspace's, written here */
                }
                __syncthreads(); /* part is reused; zs complete after the last round */
            }
            /* keys a_j (select_kernel's arithmetic) into shared memory; up to 4 query heads, 8
               candidates per thread at a time (32 loads in flight) */
            const float *e0 = a.s + row0 * cm;
            int32_t jb = tid;
            if (G <= 4) {
                constexpr int V = 8;
                for (; jb + (V - 1) * kSzNT < n; jb += V * kSzNT) {
                    float ev[V][4];
#pragma unroll
                    for (int u = 0; u < V; u++)
#pragma unroll
                        for (int g = 0; g < 4; g++) ev[u][g] = g < G ? e0[g * cm + jb + u * kSzNT] : 0.0f;
#pragma unroll
                    for (int u = 0; u < V; u++) {
                        const int32_t j = jb + u * kSzNT;
                        float av = SKV_DIV(ev[u][0], zs[0]);
#pragma unroll
                        for (int g = 1; g < 4; g++) {
                            if (g >= G) break;
                            const float p = SKV_DIV(ev[u][g], zs[g]);
                            if (p > av) av = p;
                        }
                        sz_keys[key_slot(j)] = order_desc(skv_select_key(av));
                        if (a.amax) a.amax[bh * cm + j] = av;
                    }
                }
            }
            for (int32_t j = jb; j < n; j += kSzNT) {
                float av = SKV_DIV(e0[j], zs[0]);
                for (int32_t g = 1; g < G; g++) {
                    const float p = SKV_DIV(e0[g * cm + j], zs[g]);
                    if (p > av) av = p;
                }
                sz_keys[key_slot(j)] = order_desc(skv_select_key(av));
                if (a.amax) a.amax[bh * cm + j] = av;
            }
            __syncthreads();
            int32_t *sel = a.sel_idx + bh * S;
            const uint32_t *keys = sz_keys;
            const int32_t k = select_count<kSzNT>(
                a, n, [=](int32_t i) { return keys[key_slot(i)]; }, [](int32_t i) { return i; },
                [=](int32_t j) { return skv_mass_weight(order_desc_inv(keys[key_slot(j)])); },
                reinterpret_cast<unsigned long long *>(sz_keys + sz_key_words(sh.cand_max)), sm);
            block_topk<kSzNT, false>(
                n, k, [=](int32_t i) { return keys[key_slot(i)]; }, [=](int32_t pos, int32_t i) { sel[pos] = i; },
                [](int32_t, int32_t) {}, sm.tk);
            __syncthreads(); /* sel complete */
            select_finish(a, b, h, k, sm);
            __syncthreads(); /* shared memory is reused by the next (b, h) */
        }
}

} /* namespace */

/* ---- launchers ------------------------------------------------------------------------- */

int32_t skv_cuda_select_tiles(int32_t n) { return (int32_t)ceil_div64(n > 0 ? n : 1, kSeTile); }

int32_t skv_cuda_pool_cap(int32_t cand_max, int32_t S) { return skv_cuda_select_tiles(cand_max) * S; }

cudaError_t skv_cuda_select_step(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                 const skv_cuda_dws *ws, const skv_cuda_io *io, int tiled, int32_t layer, float *amax,
                                 skv_cuda_score_node *graph, int *launches, cudaEvent_t scored)
{
    if (sh->B <= 0 || sh->Hk <= 0 || sh->cand_max <= 0) return cudaSuccess;
    const int32_t G = sh->Hq / sh->Hk;
    if ((G + 7) / 8 * 8 > kScMaxGp) return cudaErrorInvalidValue; /* the cache and the op refuse such shapes */
    cudaError_t e = skv_cuda_score(st, sh, seqs, ws, io, tiled, layer, graph); /* step 1 */
    if (e == cudaSuccess && scored) e = cudaEventRecord(scored, st);
    if (e != cudaSuccess) return e;
    SelectArgs a;
    memset(&a, 0, sizeof a);
    a.sh = *sh;
    a.seqs = seqs;
    a.e = ws->scores;
    a.Z = ws->Z;
    a.amax = amax;
    a.pool = ws->pool;
    a.pool_cap = ws->pool_cap;
    a.cnt = ws->cnt_sel;
    a.sel_idx = ws->sel_idx;
    a.sel_ids = ws->sel_ids;
    a.sel_cnt = ws->sel_cnt;
    const bool mass = sh->sel_mode == SKV_SELECT_MASS;
    a.vsrc = ws->vsrc;
    a.mlist = ws->mlist;
    a.mcount = ws->mcount;
    a.step_bad = io->k ? ws->step_bad : NULL;
    a.vc_counts = ws->vc_counts;
    a.s = ws->scores;
    a.macc = (const unsigned *)ws->macc;
    a.s0 = (const float *)ws->s0;
    /* one CTA per (b, h) computes e, Z and the selection together when there are enough pairs
       to fill a good part of the GPU, or few candidates (one select tile); a few pairs over many
       candidates leave the long chains of one CTA exposed and take the split path */
    if (sh->cand_max <= kSzMax && ((int64_t)sh->B * sh->Hk * 3 >= num_sms() || sh->cand_max <= kSeTile)) {
        const size_t smem = sz_key_bytes(sh->cand_max) + (mass ? kMsBytes : 0);
        if ((e = allow_smem(selz_kernel, smem)) != cudaSuccess) return e;
        e = launch(selz_kernel, dim3(1, clamp_yz(sh->Hk), clamp_yz(sh->B)), dim3(kSzNT), smem, st, true, a);
        if (launches) *launches += 2;
        return e;
    }
    e = launch(expsum_kernel, dim3((unsigned)ceil_div64(sh->cand_max, kExTile), clamp_yz(sh->Hq), clamp_yz(sh->B)),
               dim3(kExNT), 0, st, true, *sh, seqs, ws->scores, (const unsigned *)ws->macc, (const float *)ws->s0,
               ws->Z, ws->cnt_e);
    if (e != cudaSuccess) return e;
    /* the masses of the candidates for the last tile block's A (the fused kernel reads its keys) */
    if (mass) {
        if (!ws->mkey) return cudaErrorInvalidValue;
        a.mkey = ws->mkey;
    }
    const size_t smem = kSeKeyBytes + (mass ? kMsBytes : 0);
    if ((e = allow_smem(select_kernel, smem)) != cudaSuccess) return e;
    e = launch(select_kernel, dim3((unsigned)skv_cuda_select_tiles(sh->cand_max), clamp_yz(sh->Hk), clamp_yz(sh->B)),
               dim3(kSeNT), smem, st, true, a);
    if (launches) *launches += 3;
    return e;
}
