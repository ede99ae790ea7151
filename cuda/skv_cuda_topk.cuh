/*
 * skv_cuda_topk.cuh - the exact block-wide top-k of the decision path
 * (outliers at prefill, the selection and the chunk cache's victims at decode).
 * Included by the decision path's files (skv_cuda_landmarks.cu, skv_cuda_score.cu,
 * skv_cuda_select.cu; built with --fmad=false).
 */
#ifndef SKV_CUDA_TOPK_CUH
#define SKV_CUDA_TOPK_CUH

#include <cub/block/block_scan.cuh>

#include "skv_cuda_common.cuh"
#include "skv_numerics.h"

namespace {

/*
 * 32-bit order-preserving image of a (non-NaN) float key: larger key -> larger value.
 * -0 and +0 compare equal in ref's order, so -0 is made +0 first; NaN never reaches
 * here (skv_select_key / skv_outlier_key map it to -1 / -3). 0 is below every image
 * (the image of -inf is 0x007fffff), so 0 can stand for "no value".
 */
__host__ __device__ __forceinline__ uint32_t order_desc(float key)
{
    uint32_t u = skv_bits_from_f32(key);
    if (u == 0x80000000u) u = 0;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* The float of an order_desc image (0: -inf, "no value"). */
__host__ __device__ __forceinline__ float order_desc_inv(uint32_t e)
{
    if (e == 0) return -INFINITY;
    return skv_f32_from_bits((e & 0x80000000u) ? (e & 0x7fffffffu) : ~e);
}

/* Lower key is better (outliers): the complement turns it into "larger is better". */
__device__ __forceinline__ uint32_t order_asc(float key) { return ~order_desc(key); }

template <int BLOCK>
struct TopkSmem {
    typename cub::BlockScan<unsigned long long, BLOCK>::TempStorage scan;
    uint32_t hist[256];
    uint32_t bin;  /* digit chosen by the current radix pass */
    uint32_t need; /* rank still wanted inside that digit's bucket */
};

/*
 * The k-th best key of n items under the order "larger key first, then lower index" as a
 * threshold T and the number `need` of items equal to T that win (the lowest-indexed ones):
 * radix select, four 8-bit passes from the top. hist_pass(shift, mask, prefix) must add, into
 * sm.hist, each item whose key matches prefix under mask, by digit (key >> shift) & 0xff.
 * Called by all BLOCK threads; 0 <= k <= n.
 */
template <int BLOCK, class HistFn>
__device__ void radix_threshold(int32_t k, HistFn hist_pass, TopkSmem<BLOCK> &sm, uint32_t *T_out, uint32_t *need_out)
{
    const int tid = threadIdx.x, lane = tid & 31;
    uint32_t prefix = 0, mask = 0, need = (uint32_t)k;
    if (k <= 0) {
        /* nothing wins: no key is > 0xffffffff and min(eq_before, 0) = 0 */
        *T_out = 0xffffffffu;
        *need_out = 0;
        return;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += BLOCK) sm.hist[b] = 0;
        __syncthreads();
        hist_pass(shift, mask, prefix);
        __syncthreads();
        if (tid < 32) {
            /* lane l owns buckets 255-8l .. 248-8l (best first); a warp scan finds the lane whose
               buckets hold the need-th best, that lane finds the bucket */
            uint32_t cnt[8], sum = 0;
#pragma unroll
            for (int m = 0; m < 8; m++) {
                cnt[m] = sm.hist[255 - 8 * lane - m];
                sum += cnt[m];
            }
            uint32_t incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const uint32_t v = __shfl_up_sync(kFullMask, incl, o);
                if (lane >= o) incl += v;
            }
            uint32_t cum = incl - sum;
            if (cum < need && need <= incl) {
                bool found = false;
#pragma unroll
                for (int m = 0; m < 8; m++) {
                    if (!found && cum + cnt[m] >= need) {
                        sm.bin = (uint32_t)(255 - 8 * lane - m);
                        sm.need = need - cum;
                        found = true;
                    }
                    cum += cnt[m];
                }
            }
        }
        __syncthreads();
        prefix |= sm.bin << shift;
        mask |= 0xffu << shift;
        need = sm.need;
        __syncthreads(); /* everyone read bin/need before the next pass rewrites them */
    }
    *T_out = prefix;
    *need_out = need;
}

/* One item of a histogram pass: warp-aggregated (one atomic per distinct digit per warp: keys
   cluster heavily). All lanes of the warp must call it together. */
__device__ __forceinline__ void hist_add(uint32_t *hist, bool valid, uint32_t u, int shift, uint32_t mask,
                                         uint32_t prefix)
{
    const bool hit = valid && (u & mask) == prefix;
    const uint32_t digit = (u >> shift) & 0xffu;
    const uint32_t hits = __ballot_sync(kFullMask, hit);
    if (hit) {
        const uint32_t peers = __match_any_sync(hits, digit);
        if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[digit], (uint32_t)__popc(peers));
    }
}

/*
 * Ordered compaction with contiguous ownership: thread t owns items [t*per, (t+1)*per),
 * counts its items > T and == T, one block scan gives every thread the counts before its run,
 * and the thread emits its items in order: winners before i = gt_before(i) + min(eq_before(i),
 * need). on_win(pos, i) with pos the rank among the winners in increasing i; if LOSERS,
 * on_lose likewise.
 */
template <int BLOCK, bool LOSERS, class KeyFn, class WinFn, class LoseFn>
__device__ void ordered_compaction(int32_t n, uint32_t T, uint32_t need, KeyFn key, WinFn on_win, LoseFn on_lose,
                                   TopkSmem<BLOCK> &sm)
{
    const int32_t per = (int32_t)ceil_div64(n, BLOCK);
    const int32_t lo = min(n, (int32_t)threadIdx.x * per), hi = min(n, lo + per);
    uint32_t gt = 0, eq = 0;
    for (int32_t i = lo; i < hi; i++) {
        const uint32_t u = key(i);
        gt += u > T;
        eq += u == T;
    }
    unsigned long long excl;
    cub::BlockScan<unsigned long long, BLOCK>(sm.scan).ExclusiveSum(((unsigned long long)gt << 32) | eq, excl);
    uint32_t e = (uint32_t)(excl & 0xffffffffu);
    uint32_t w = (uint32_t)(excl >> 32) + min(e, need);
    for (int32_t i = lo; i < hi; i++) {
        const uint32_t u = key(i);
        if (u > T || (u == T && e < need)) on_win((int32_t)w++, i);
        else if (LOSERS) on_lose((int32_t)((uint32_t)i - w), i);
        if (u == T) e++;
    }
    __syncthreads(); /* the scan storage and hist may be reused by the caller */
}

/*
 * The k best of n items under the strict total order "larger key(i) first, then lower i"
 * (key(i) a uint32 order image), called by all BLOCK threads: radix_threshold over items
 * strided across the threads (coalesced reads), then ordered_compaction. Requires
 * 0 <= k <= n < 2^31; key() must be deterministic (it is evaluated several times).
 */
template <int BLOCK, bool LOSERS, class KeyFn, class WinFn, class LoseFn>
__device__ void block_topk(int32_t n, int32_t k, KeyFn key, WinFn on_win, LoseFn on_lose, TopkSmem<BLOCK> &sm)
{
    static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "whole warps");
    uint32_t T, need;
    uint32_t *hist = sm.hist;
    radix_threshold<BLOCK>(
        k,
        [=](int shift, uint32_t mask, uint32_t prefix) {
            for (int32_t base = 0; base < n; base += BLOCK) { /* uniform trip count: warp ops inside */
                const int32_t i = base + threadIdx.x;
                hist_add(hist, i < n, i < n ? key(i) : 0u, shift, mask, prefix);
            }
        },
        sm, &T, &need);
    ordered_compaction<BLOCK, LOSERS>(n, T, need, key, on_win, on_lose, sm);
}

/* block_topk with the radix passes over keys held in registers: kr[it] = key(it * BLOCK + tid)
   (items past n ignored); key(i) is read once more for the compaction. */
template <int BLOCK, int IPT, class KeyFn, class WinFn>
__device__ void block_topk_reg(int32_t n, int32_t k, const uint32_t (&kr)[IPT], KeyFn key, WinFn on_win,
                               TopkSmem<BLOCK> &sm)
{
    uint32_t T, need;
    radix_threshold<BLOCK>(
        k,
        [&](int shift, uint32_t mask, uint32_t prefix) {
#pragma unroll
            for (int it = 0; it < IPT; it++) {
                const int32_t i = it * BLOCK + threadIdx.x;
                hist_add(sm.hist, i < n, kr[it], shift, mask, prefix);
            }
        },
        sm, &T, &need);
    ordered_compaction<BLOCK, false>(n, T, need, key, on_win, [](int32_t, int32_t) {}, sm);
}

} /* namespace */

#endif /* SKV_CUDA_TOPK_CUH */
