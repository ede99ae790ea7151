/*
 * skv_cuda_factor_rank.cu - config.rank == 0 on the cuda cache (docs/DESIGN.md 3.1): after the
 * factorization at m = rank_max, on the factorization's stream and without a host
 * synchronization, the slot's rank and its factors in bf16 with the columns of U (rows of W) in
 * the stable order of non-increasing energy and places r.. zero. The rank stays in device memory
 * (the cache's per-slot array), read by the host at the next synchronization (skv_cuda_cache_sync).
 *
 * e_i: one block of 256 threads per column, thread k the canonical lane k (tokens t = k, k + 256,
 * ... in order, each square one rounding), then skv_canonical_sum's tree: the bits of
 * lib/skv_rank.h's skv_rank_col_energies. T in the reproducible mode: the same 256 lanes over A's
 * n * Hk * D elements in one block (skv_rank_total_energy's bits); in the default mode a sum in
 * double over a fixed partition (deterministic, not the canonical bits: the default mode's ranks
 * are held to the rule, not to ref's bits, since its factors differ anyway). The order and the
 * stopping rule: skv_rank_position and skv_rank_pick of lib/skv_rank.h. Built with --fmad=false.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_rank.h"

namespace {

constexpr int kLanes = SKV_CANON_LANES; /* 256: one thread per canonical lane */
constexpr int kTotalBlocks = 1024;      /* the default mode's partition of A */

/* P[0..256) in shared memory -> P[0]: skv_canonical_sum's tree (w = 128 .. 1). */
__device__ void canon_tree(float *P)
{
    for (int w = kLanes / 2; w >= 1; w /= 2) {
        __syncthreads();
        if ((int)threadIdx.x < w) P[threadIdx.x] = SKV_ADD(P[threadIdx.x], P[threadIdx.x + w]);
    }
    __syncthreads();
}

__global__ void __launch_bounds__(kLanes) rank_colsq_kernel(const float *__restrict__ u, int64_t n, int32_t m,
                                                           float *__restrict__ e)
{
    __shared__ float P[kLanes];
    const int32_t i = blockIdx.x;
    float acc = 0.0f;
    for (int64_t t = threadIdx.x; t < n; t += kLanes) {
        const float x = u[t * m + i];
        acc = SKV_ADD(acc, SKV_MUL(x, x));
    }
    P[threadIdx.x] = acc;
    canon_tree(P);
    if (threadIdx.x == 0) e[i] = P[0];
}

/* The reproducible mode's T: lane k over j = k, k + 256, ... (8 loads in flight, adds in order). */
__global__ void __launch_bounds__(kLanes) rank_total_canon_kernel(const uint16_t *__restrict__ a, int64_t count,
                                                                 float *__restrict__ T)
{
    __shared__ float P[kLanes];
    float acc = 0.0f;
    int64_t j = threadIdx.x;
    for (; j + 7 * kLanes < count; j += 8 * kLanes) {
        float x[8];
#pragma unroll
        for (int q = 0; q < 8; q++) x[q] = skv_bf16_to_f32(a[j + q * kLanes]);
#pragma unroll
        for (int q = 0; q < 8; q++) acc = SKV_ADD(acc, SKV_MUL(x[q], x[q]));
    }
    for (; j < count; j += kLanes) {
        const float x = skv_bf16_to_f32(a[j]);
        acc = SKV_ADD(acc, SKV_MUL(x, x));
    }
    P[threadIdx.x] = acc;
    canon_tree(P);
    if (threadIdx.x == 0) *T = P[0];
}

/* The default mode's T, first pass: block b sums its contiguous part of A in double. */
__global__ void __launch_bounds__(kLanes) rank_total_part_kernel(const uint16_t *__restrict__ a, int64_t count,
                                                                double *__restrict__ part)
{
    __shared__ double P[kLanes];
    const int64_t per = (count + gridDim.x - 1) / gridDim.x;
    const int64_t lo = per * blockIdx.x, hi = lo + per < count ? lo + per : count;
    double acc = 0.0;
    for (int64_t j = lo + threadIdx.x; j < hi; j += kLanes) {
        const double x = (double)skv_bf16_to_f32(a[j]);
        acc = __fma_rn(x, x, acc);
    }
    P[threadIdx.x] = acc;
    for (int w = kLanes / 2; w >= 1; w /= 2) {
        __syncthreads();
        if ((int)threadIdx.x < w) P[threadIdx.x] = __dadd_rn(P[threadIdx.x], P[threadIdx.x + w]);
    }
    if (threadIdx.x == 0) part[blockIdx.x] = P[0];
}

/* Second pass: the parts in a fixed order, T rounded once to float. */
__global__ void __launch_bounds__(kLanes) rank_total_final_kernel(const double *__restrict__ part, int32_t n_part,
                                                                 float *__restrict__ T)
{
    __shared__ double P[kLanes];
    double acc = 0.0;
    for (int32_t b = threadIdx.x; b < n_part; b += kLanes) acc = __dadd_rn(acc, part[b]);
    P[threadIdx.x] = acc;
    for (int w = kLanes / 2; w >= 1; w /= 2) {
        __syncthreads();
        if ((int)threadIdx.x < w) P[threadIdx.x] = __dadd_rn(P[threadIdx.x], P[threadIdx.x + w]);
    }
    if (threadIdx.x == 0) *T = (float)P[0];
}

/* The order (src[p] = the column at place p, es[p] its e) and the rank, into *rank and *slot_rank. */
__global__ void __launch_bounds__(1024) rank_pick_kernel(const float *__restrict__ e, int32_t m, const float *T,
                                                         float target, int32_t *__restrict__ src, float *__restrict__ es,
                                                         int32_t *rank, int32_t *slot_rank)
{
    for (int32_t i = threadIdx.x; i < m; i += blockDim.x) {
        const int32_t p = skv_rank_position(e, m, i);
        src[p] = i;
        es[p] = e[i];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int32_t r = skv_rank_pick(es, m, *T, target);
        *rank = r;
        *slot_rank = r;
    }
}

/* U [n, m] float -> bf16 with columns in the order src, places r.. zero. */
__global__ void __launch_bounds__(kSmallNT) rank_store_u_kernel(const float *__restrict__ u, int64_t n, int32_t m,
                                                              const int32_t *__restrict__ src, const int32_t *rank,
                                                              skv_bf16 *__restrict__ out)
{
    const int32_t r = *rank;
    const int64_t total = n * m, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += stride) {
        const int64_t t = x / m;
        const int32_t p = (int32_t)(x - t * m);
        out[x] = p < r ? skv_f32_to_bf16(u[t * m + src[p]]) : (skv_bf16)0;
    }
}

/* W [m, d] float -> bf16 with rows in the order src, rows r.. zero. */
__global__ void __launch_bounds__(kSmallNT) rank_store_w_kernel(const float *__restrict__ w, int32_t m, int64_t d,
                                                              const int32_t *__restrict__ src, const int32_t *rank,
                                                              skv_bf16 *__restrict__ out)
{
    const int32_t r = *rank;
    const int64_t total = (int64_t)m * d, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t x = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; x < total; x += stride) {
        const int32_t p = (int32_t)(x / d);
        const int64_t c = x - (int64_t)p * d;
        out[x] = p < r ? skv_f32_to_bf16(w[(int64_t)src[p] * d + c]) : (skv_bf16)0;
    }
}

} // namespace

size_t skv_cuda_rank_scratch_bytes(int32_t m)
{
    /* e [m], es [m], src [m], T, rank, then the default mode's parts */
    return align_up((size_t)m * 3 * 4 + 8, 16) + (size_t)kTotalBlocks * sizeof(double);
}

cudaError_t skv_cuda_rank_store(cudaStream_t st, int reproducible, float target, const skv_bf16 *a, int64_t n,
                                int64_t d, int32_t m, const float *u, const float *w, void *scratch,
                                int32_t *slot_rank, skv_bf16 *u_out, skv_bf16 *w_out)
{
    float *e = (float *)scratch, *es = e + m, *T = es + m + m;
    int32_t *src = (int32_t *)(es + m), *rank = (int32_t *)(T + 1);
    double *part = (double *)((char *)scratch + align_up((size_t)m * 3 * 4 + 8, 16));
    rank_colsq_kernel<<<(unsigned)m, kLanes, 0, st>>>(u, n, m, e);
    if (reproducible) {
        rank_total_canon_kernel<<<1, kLanes, 0, st>>>(a, n * d, T);
    } else {
        rank_total_part_kernel<<<kTotalBlocks, kLanes, 0, st>>>(a, n * d, part);
        rank_total_final_kernel<<<1, kLanes, 0, st>>>(part, kTotalBlocks, T);
    }
    rank_pick_kernel<<<1, 1024, 0, st>>>(e, m, T, target, src, es, rank, slot_rank);
    rank_store_u_kernel<<<grid_for(n * m, kSmallNT, kSmallMaxGrid), kSmallNT, 0, st>>>(u, n, m, src, rank, u_out);
    rank_store_w_kernel<<<grid_for((int64_t)m * d, kSmallNT, kSmallMaxGrid), kSmallNT, 0, st>>>(w, m, d, src, rank,
                                                                                             w_out);
    return cudaGetLastError();
}
