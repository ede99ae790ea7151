/*
 * skv_cuda_canon_i8.cuh - the kernels of the canonical route's int8 exact Gram
 * (skv_cuda_canon_i8.h has the plan, the digits and the proofs): the digit planes of a token
 * block and the combine of the int32 products into S. No dependence on the factor's state:
 * skv_cuda_canon.cuh launches them (skv_cc_gram), tests/gpu/probes/canon_i8_probe.cu too.
 */
#ifndef SKV_CUDA_CANON_I8_CUH
#define SKV_CUDA_CANON_I8_CUH

#include "skv_cuda_canon_i8.h"

/* The int8 digit planes of a token block (skv_cuda_canon_i8.h): rows [0, rows) of a (row major
   [rows, d]), plane k at out + k plane_bytes, column i of plane k at i ld (ld = the plan's rows).
   A block of 256 threads per tile of 128 rows x 64 columns: coalesced bf16 reads along the row,
   the packed digits transposed through shared memory, 4-byte writes along the column. Rows
   [rows, the tile's end) and columns [d, d4) get zeros. */
#define SKV_CC_SL_T 128
#define SKV_CC_SL_I 64
static __global__ void __launch_bounds__(256)
    skv_cc_slice(const skv_bf16 *__restrict__ a, int64_t rows, int32_t d, int32_t d4, const int32_t *__restrict__ e,
                 int32_t F, int s, int64_t ld, size_t plane_bytes, int8_t *__restrict__ out)
{
    __shared__ uint32_t sm[SKV_CC_SL_I][SKV_CC_SL_T + 1];
    const int tid = threadIdx.x;
    const int64_t t0 = (int64_t)blockIdx.y * SKV_CC_SL_T;
    const int32_t i0 = blockIdx.x * SKV_CC_SL_I;
    for (int idx = tid; idx < SKV_CC_SL_T * SKV_CC_SL_I; idx += 256) {
        int tt = idx / SKV_CC_SL_I, ii = idx % SKV_CC_SL_I;
        int64_t t = t0 + tt;
        int32_t i = i0 + ii;
        uint32_t p = 0;
        if (t < rows && i < d) p = skv_cc_i8_pack((int32_t)skv_canon_fix(a[t * d + i], F, e[i]), s);
        sm[ii][tt] = p;
    }
    __syncthreads();
    for (int k = 0; k < s; k++) {
        int8_t *pk = out + (size_t)k * plane_bytes;
        for (int idx = tid; idx < SKV_CC_SL_I * (SKV_CC_SL_T / 4); idx += 256) {
            int ii = idx / (SKV_CC_SL_T / 4), q = idx % (SKV_CC_SL_T / 4);
            int32_t i = i0 + ii;
            if (i >= d4) continue;
            const int sh = 8 * k;
            char4 v;
            v.x = (signed char)(sm[ii][4 * q + 0] >> sh);
            v.y = (signed char)(sm[ii][4 * q + 1] >> sh);
            v.z = (signed char)(sm[ii][4 * q + 2] >> sh);
            v.w = (signed char)(sm[ii][4 * q + 3] >> sh);
            *(char4 *)(pk + (int64_t)i * ld + t0 + 4 * q) = v;
        }
    }
}

/* g [d, d] (column major, upper triangle i <= j at g[i + j d]) = (first ? 0 : g) + S_chunk from the
   int32 products (skv_cuda_canon_i8.h): S_ij = sum_(a<=b) 2^(7(a+b)) (P_ab[i][j] + (a < b) P_ab[j][i])
   in int64, exact, then one exact double (addition). 32 x 8 threads per 32 x 32 tile of the upper
   triangle; P_ab[j][i] through shared memory (coalesced both ways). */
#define SKV_CC_CB 32
static __global__ void __launch_bounds__(256)
    skv_cc_combine(const int32_t *__restrict__ acc, skv_cc_i8_plan p, int32_t d, int first, double *__restrict__ g)
{
    __shared__ int32_t tt[SKV_CC_CB][SKV_CC_CB + 1];
    const int32_t I0 = blockIdx.y * SKV_CC_CB, J0 = blockIdx.x * SKV_CC_CB;
    if (I0 > J0) return; /* whole block: no __syncthreads skipped by part of it */
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int32_t d4 = p.d4;
    long long sum[SKV_CC_CB / 8];
#pragma unroll
    for (int q = 0; q < SKV_CC_CB / 8; q++) sum[q] = 0;
    for (int b = 0; b < p.s; b++) {
        const int64_t ldb = (int64_t)(b + 1) * d4;
        for (int a_ = 0; a_ <= b; a_++) {
            const int32_t *pab = acc + p.acc_off[b] + (int64_t)a_ * d4; /* P_ab[i][j] = pab[i + j ldb] */
            const long long w = 1LL << (7 * (a_ + b));
            if (a_ < b) {
                __syncthreads();
#pragma unroll
                for (int q = 0; q < SKV_CC_CB / 8; q++) { /* tt[i][j] = P_ab[j][i], j = J0 + tx along memory */
                    int32_t i = I0 + ty + 8 * q, j = J0 + tx;
                    tt[ty + 8 * q][tx] = i < d4 && j < d4 ? pab[j + (int64_t)i * ldb] : 0;
                }
                __syncthreads();
            }
#pragma unroll
            for (int q = 0; q < SKV_CC_CB / 8; q++) { /* thread (tx, ty): i = I0 + tx, j = J0 + ty + 8 q */
                int32_t i = I0 + tx, j = J0 + ty + 8 * q;
                long long v = i < d4 && j < d4 ? (long long)pab[i + (int64_t)j * ldb] : 0;
                if (a_ < b) v += tt[tx][ty + 8 * q];
                sum[q] += v * w;
            }
        }
    }
#pragma unroll
    for (int q = 0; q < SKV_CC_CB / 8; q++) {
        int32_t i = I0 + tx, j = J0 + ty + 8 * q;
        if (i < d && j < d && i <= j) {
            double v = (double)sum[q]; /* |S_chunk| <= 2^53: exact */
            int64_t k = i + (int64_t)j * d;
            g[k] = first ? v : __dadd_rn(g[k], v);
        }
    }
}

#endif
