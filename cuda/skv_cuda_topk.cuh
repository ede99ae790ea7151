/*
 * skv_cuda_topk.cuh - the exact block-wide top-k of the decision path
 * (outliers at prefill, the selection and the chunk cache's victims at decode).
 * Included by skv_cuda_select.cu only (built with --fmad=false).
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
 * The k best of n items under the strict total order "larger key(i) first, then lower i"
 * (key(i) a uint32 order image), called by all BLOCK threads. on_win(pos, i) is called
 * for each winner with pos = its rank among the winners in increasing i (0..k-1); if
 * LOSERS, on_lose(pos, i) for each other item likewise (0..n-k-1). Requires
 * 0 <= k <= n < 2^31. key() must be deterministic (it is evaluated several times).
 *
 * 1. Radix select, four 8-bit passes from the top (items strided over the threads, so
 *    reads coalesce): each pass histograms the digit of the items that match the
 *    threshold prefix found so far and picks the bucket holding the need-th best. After
 *    the last pass the prefix is the k-th best key T itself, and need is how many items
 *    equal to T are winners (the order breaks ties by lower index).
 * 2. Ordered compaction with contiguous ownership: thread t owns items
 *    [t*per, (t+1)*per), counts its items > T and == T, one block scan gives every
 *    thread the counts before its run, and the thread emits its items in order:
 *    winners before i = gt_before(i) + min(eq_before(i), need).
 */
template <int BLOCK, bool LOSERS, class KeyFn, class WinFn, class LoseFn>
__device__ void block_topk(int32_t n, int32_t k, KeyFn key, WinFn on_win, LoseFn on_lose, TopkSmem<BLOCK> &sm)
{
    static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "whole warps");
    const int tid = threadIdx.x, lane = tid & 31;

    uint32_t prefix = 0, mask = 0, need = (uint32_t)k;
    if (k <= 0) {
        /* nothing wins: no key is > 0xffffffff and min(eq_before, 0) = 0 */
        prefix = 0xffffffffu;
        need = 0;
    } else {
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += BLOCK) sm.hist[b] = 0;
            __syncthreads();
            for (int32_t base = 0; base < n; base += BLOCK) { /* uniform trip count: warp ops below */
                const int32_t i = base + tid;
                uint32_t u = 0;
                bool hit = false;
                if (i < n) {
                    u = key(i);
                    hit = (u & mask) == prefix;
                }
                const uint32_t digit = (u >> shift) & 0xffu;
                const uint32_t hits = __ballot_sync(kFullMask, hit);
                if (hit) { /* one atomic per distinct digit per warp: keys cluster heavily */
                    const uint32_t peers = __match_any_sync(hits, digit);
                    if (lane == __ffs(peers) - 1) atomicAdd(&sm.hist[digit], (uint32_t)__popc(peers));
                }
            }
            __syncthreads();
            if (tid < 32) {
                /* lane l owns buckets 255-8l .. 248-8l (best first); a warp scan finds the
                   lane whose buckets hold the need-th best, that lane finds the bucket */
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
    }

    const uint32_t T = prefix;
    const int32_t per = (int32_t)ceil_div64(n, BLOCK);
    const int32_t lo = min(n, tid * per), hi = min(n, lo + per);
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

} /* namespace */

#endif /* SKV_CUDA_TOPK_CUH */
