/*
 * skv_cuda_canon_fix.cuh - the canonical route's element kernels around the exact products
 * (lib/skv_factor_canon.h steps 1 and 4): the fixed-point A in doubles (the DSYRK Gram and
 * step 4's T = X Y) and U's scaling. No dependence on the factor's state: skv_cuda_factor_canon.cu
 * launches them, dev/cuda/canon_gemm_probe.cu times them and checks them.
 */
#ifndef SKV_CUDA_CANON_FIX_CUH
#define SKV_CUDA_CANON_FIX_CUH

#include "skv_factor_canon.h"
#include "skv_cuda_canon_i8.h"

/* blk [rows, d] (row major) = the fixed-point rows of a. */
static __global__ void skv_cc_fix(const skv_bf16 *__restrict__ a, int64_t rows, int32_t d, const int32_t *__restrict__ e,
                                  int32_t F, double *__restrict__ blk)
{
    int64_t count = rows * d;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < count; k += (int64_t)gridDim.x * blockDim.x)
        blk[k] = skv_canon_fix(a[k], F, e[k % d]);
}

/* u rows [0, rows) (row major [rows, r]) = (float) (T 2^(f_j - Gb)): thread (x, y) of a 32 x 8
   block on column j = 32 blockIdx.x + x (its scale once) and the rows blockIdx.y 8 + y + k 8 gridDim.y. */
static __global__ void __launch_bounds__(256)
    skv_cc_uscale(const double *__restrict__ tb, int64_t rows, int32_t r, const int32_t *__restrict__ f, int32_t Gb,
                   float *__restrict__ u)
{
    const int32_t j = blockIdx.x * 32 + threadIdx.x;
    if (j >= r) return;
    const int32_t k = f[j] - Gb;
    for (int64_t t = (int64_t)blockIdx.y * 8 + threadIdx.y; t < rows; t += (int64_t)gridDim.y * 8)
        u[t * r + j] = (float)skv_canon_scale(tb[t * r + j], k);
}

#endif
