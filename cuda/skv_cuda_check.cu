/*
 * skv_cuda_check.cu - the input checks of the cuda backend: the first
 * non-finite element of a bf16 tensor and the first out-of-range element of an
 * int32 array, each reported as the minimum index over the grid (atomicMin of
 * every warp's first hit), so the answer does not depend on the order in which
 * blocks run. The launchers only enqueue on their stream: no allocation, no
 * synchronization.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_numerics.h"

namespace {


/* First non-finite element of a strided [n_a, n_b, len] tensor, VEC elements per load
   (8: len, s_a, s_b multiples of 8 and x 16-byte aligned). Each thread's units increase,
   so its first hit is its minimum. */
template <int VEC>
__global__ void __launch_bounds__(kSmallNT) find_nonfinite_kernel(const skv_bf16 *x, int64_t n_a, int64_t s_a,
                                                                  int64_t n_b, int64_t s_b, int64_t len,
                                                                  unsigned long long *first_bad)
{
    const int64_t lu = len / VEC, total = n_a * n_b * lu;
    unsigned long long first = ~0ull;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = u / lu, l0 = (u - row * lu) * VEC;
        const int64_t i = row / n_b, j = row - i * n_b;
        const skv_bf16 *p = x + i * s_a + j * s_b + l0;
        skv_bf16 e[VEC];
        if (VEC == 8) {
            const uint4 w = *reinterpret_cast<const uint4 *>(p);
            const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int t = 0; t < VEC; t++) e[t] = (skv_bf16)(ws[t / 2] >> (16 * (t & 1)));
        } else {
#pragma unroll
            for (int t = 0; t < VEC; t++) e[t] = p[t];
        }
        int bad = -1;
#pragma unroll
        for (int t = VEC - 1; t >= 0; t--)
            if (!skv_bf16_isfinite(e[t])) bad = t;
        if (bad >= 0) {
            first = (unsigned long long)(row * len + l0 + bad);
            break;
        }
    }
    first = warp_min_u64(first);
    if ((threadIdx.x & 31) == 0 && first != ~0ull) atomicMin(first_bad, first);
}

__global__ void __launch_bounds__(kSmallNT) find_out_of_range_kernel(const int32_t *x, int64_t n, int64_t lo,
                                                                     int64_t hi, unsigned long long *first_bad)
{
    unsigned long long first = ~0ull;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t v = x[i];
        if (v < lo || v >= hi) {
            first = (unsigned long long)i;
            break;
        }
    }
    first = warp_min_u64(first);
    if ((threadIdx.x & 31) == 0 && first != ~0ull) atomicMin(first_bad, first);
}

} /* namespace */

cudaError_t skv_cuda_find_nonfinite(cudaStream_t st, const skv_bf16 *x, int64_t n_a, int64_t s_a, int64_t n_b,
                                    int64_t s_b, int64_t len, unsigned long long *first_bad)
{
    if (n_a <= 0 || n_b <= 0 || len <= 0) return cudaSuccess;
    const bool vec = len % 8 == 0 && s_a % 8 == 0 && s_b % 8 == 0 && ((uintptr_t)x & 15) == 0;
    const int64_t units = n_a * n_b * (vec ? len / 8 : len);
    const unsigned grid = grid_for(units, kSmallNT, kSmallMaxGrid);
    if (vec)
        find_nonfinite_kernel<8><<<grid, kSmallNT, 0, st>>>(x, n_a, s_a, n_b, s_b, len, first_bad);
    else
        find_nonfinite_kernel<1><<<grid, kSmallNT, 0, st>>>(x, n_a, s_a, n_b, s_b, len, first_bad);
    return cudaGetLastError();
}

cudaError_t skv_cuda_find_out_of_range(cudaStream_t st, const int32_t *x, int64_t n, int64_t lo, int64_t hi,
                                       unsigned long long *first_bad)
{
    if (n <= 0) return cudaSuccess;
    find_out_of_range_kernel<<<grid_for(n, kSmallNT, kSmallMaxGrid), kSmallNT, 0, st>>>(x, n, lo, hi, first_bad);
    return cudaGetLastError();
}
