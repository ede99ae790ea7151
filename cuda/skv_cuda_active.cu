/*
 * skv_cuda_active.cu - a decode step's rows (skv_cuda_act_rows: the first kernel of every
 * step, the root of a layer's graph), and the small writes of the cache's descriptors that
 * run on a stream: a prefill's (skv_cuda_set_seq) and a release's (skv_cuda_release_seq).
 *
 * The rows are what the step's kernels index by their batch index i: row i is a copy of the
 * descriptor of the i-th listed sequence (home: the descriptor itself, which the combine
 * advances too), the rows past the count are idle. So the kernels of a step take the whole
 * batch's grid whatever the list, and a captured step stays valid while the list changes: the
 * count is read here, on the device, when the stream gets here. The cache launches this kernel
 * before a layer's graph (the list is its launch parameter) or, in a direct launch (and inside
 * the caller's capture), as the step's first kernel.
 *
 * The launchers only enqueue: no allocation, no synchronization.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"

namespace {

constexpr int kActNT = 256;

__device__ void act_fault(const skv_cuda_act &a, unsigned long long kind, int32_t layer, int32_t value, int *bad)
{
    atomicMin(a.err, (kind << 56) | ((unsigned long long)(uint32_t)layer << 40) | (unsigned long long)(uint32_t)value);
    atomicOr(bad, 1);
}

/* One block: the count (and a device list's check), then every row. */
__global__ void __launch_bounds__(kActNT) act_kernel(const skv_cuda_act a)
{
    __shared__ int n_s, bad_s;
    const int tid = threadIdx.x;
    if (tid == 0) {
        int32_t n = a.n;
        bad_s = 0;
        if (a.mode == SKV_CUDA_ACT_DEVICE) {
            if (*a.err != ~0ull) { /* a bad list stops the device-list steps until the error is reported */
                n = 0;
            } else {
                n = *a.count;
                if (n < 0 || n > a.B) {
                    act_fault(a, SKV_CUDA_LIST_COUNT, a.layer, n, &bad_s);
                    n = 0;
                }
            }
        }
        n_s = n;
    }
    __syncthreads();
    const int32_t n = n_s;
    if (a.mode == SKV_CUDA_ACT_DEVICE && n > 0) {
        for (int32_t i = tid; i < n; i += kActNT) {
            const int32_t s = a.list[i];
            if (s < 0 || s >= a.B) {
                act_fault(a, SKV_CUDA_LIST_RANGE, a.layer, s, &bad_s);
                continue;
            }
            if (atomicExch(&a.mark[s], 1) != 0) act_fault(a, SKV_CUDA_LIST_TWICE, a.layer, s, &bad_s);
            int32_t lo = INT32_MAX, free_layer = -1;
            for (int32_t l = 0; l < a.L; l++) {
                const skv_cuda_seq &d = a.base[(int64_t)l * a.B + s];
                if (d.n == 0) {
                    free_layer = l;
                    break;
                }
                lo = min(lo, d.n_gen);
            }
            if (free_layer >= 0) {
                act_fault(a, SKV_CUDA_LIST_FREE, free_layer, s, &bad_s);
                continue;
            }
            const int32_t g = a.base[(int64_t)a.layer * a.B + s].n_gen;
            if (g >= a.gen_cap) act_fault(a, SKV_CUDA_LIST_FULL, a.layer, s, &bad_s);
            else if (g != lo) act_fault(a, SKV_CUDA_LIST_AHEAD, a.layer, s, &bad_s);
        }
        __syncthreads(); /* every mark set (and every fault seen) */
        for (int32_t i = tid; i < n; i += kActNT) {
            const int32_t s = a.list[i];
            if (s >= 0 && s < a.B) a.mark[s] = 0;
        }
    }
    __syncthreads();
    const int32_t m = bad_s ? 0 : n;
    for (int32_t i = tid; i < a.B; i += kActNT) {
        skv_cuda_seq r;
        if (i < m) {
            const int32_t s = a.mode == SKV_CUDA_ACT_PREFIX ? i : a.list[i];
            skv_cuda_seq *home = a.base + (int64_t)a.layer * a.B + s;
            r = *home;
            r.idle = 0;
            r.home = home;
        } else {
            memset(&r, 0, sizeof r);
            r.idle = 1;
        }
        a.rows[i] = r;
    }
}

__global__ void set_seq_kernel(skv_cuda_seq *dst, const skv_cuda_seq v) { *dst = v; }

/* grid (L): block l frees (layer l, seq). */
__global__ void __launch_bounds__(kActNT) release_kernel(skv_cuda_seq *base, int32_t B, int32_t seq, int32_t Hk,
                                                          int32_t S, int64_t vc_words)
{
    skv_cuda_seq *d = base + (int64_t)blockIdx.x * B + seq;
    const int tid = threadIdx.x;
    int32_t *cnt = d->pub_sel_cnt, *idx = d->pub_sel_idx, *ids = d->pub_sel_ids;
    int32_t *meta = d->vc_data ? d->vc_slot_of : nullptr;
    if (cnt)
        for (int32_t h = tid; h < Hk; h += kActNT) cnt[h] = 0;
    for (int64_t i = tid; i < (int64_t)Hk * S; i += kActNT) {
        if (idx) idx[i] = -1;
        if (ids) ids[i] = -1;
    }
    if (meta)
        for (int64_t i = tid; i < vc_words; i += kActNT) meta[i] = -1;
    if (tid == 0) {
        d->n = 0;
        d->n_cand = 0;
        d->n_local = 0;
        d->n_gen = 0;
        d->has_sel = 0;
    }
}

} /* namespace */

cudaError_t skv_cuda_act_rows(cudaStream_t st, const skv_cuda_act *a)
{
    return launch(act_kernel, dim3(1), dim3(kActNT), 0, st, false, *a);
}

cudaError_t skv_cuda_set_seq(cudaStream_t st, skv_cuda_seq *dst, const skv_cuda_seq *val)
{
    return launch(set_seq_kernel, dim3(1), dim3(1), 0, st, false, dst, *val);
}

cudaError_t skv_cuda_release_seq(cudaStream_t st, skv_cuda_seq *base, int32_t L, int32_t B, int32_t seq, int32_t Hk,
                                 int32_t S, size_t vc_meta_bytes)
{
    if (L <= 0) return cudaSuccess;
    return launch(release_kernel, dim3((unsigned)L), dim3(kActNT), 0, st, false, base, B, seq, Hk, S,
                  (int64_t)(vc_meta_bytes / sizeof(int32_t)));
}
