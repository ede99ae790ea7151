/*
 * skv_cuda_canon_i8.cuh - the kernels of the canonical route's int8 exact Gram
 * (skv_cuda_canon_i8.h has the plan, the digits and the proofs): the digit planes of a token
 * block and the combine of the int32 products into S. No dependence on the factor's state:
 * skv_cuda_factor_canon.cu launches them (skv_cc_gram), dev/cuda/canon_i8_probe.cu too.
 */
#ifndef SKV_CUDA_CANON_I8_CUH
#define SKV_CUDA_CANON_I8_CUH

#include "skv_cuda_canon_i8.h"

/* The int8 digit planes of a token block (skv_cuda_canon_i8.h): rows [0, rows) of a (row major
   [rows, d]), plane k at out + k plane_bytes, column i of plane k at i ld (ld = the plan's rows).
   A block of 256 threads per tile of SKV_CC_SL_T = 128 rows x SKV_CC_SL_I = 64 columns. Phase 1:
   thread tid reads the 8 columns 8 g .. 8 g + 7 (g = tid % 8) of the rows tid / 8 + 32 u (u < 4):
   16-byte loads where d % 8 == 0 and a is 16-byte aligned (vec), 8 scalar loads otherwise; each
   element's digits packed (skv_cc_i8_pack of skv_cc_i8_fix_bf16: skv_canon_fix's integer) into the
   word of (column ii, row tt) at sm[ii][tt ^ 4 (ii / 8)] (the swizzle keeps a warp's stores, 4 rows
   x 8 groups, on 32 distinct banks, and moves aligned groups of 4 rows whole). Phase 2: warp w
   takes the columns w + 8 j; lane q reads the 16-byte word group of rows 4 q .. 4 q + 3 (one
   conflict-free 512-byte warp load) and writes, per plane, those rows' digits as one char4 (a warp:
   128 contiguous bytes of the column). Rows [rows, the tile's end) and columns [d, d4) get zeros. */
#define SKV_CC_SL_T 128
#define SKV_CC_SL_I 64
template <int S>
static __device__ __forceinline__ void skv_cc_slice_body(const skv_bf16 *__restrict__ a, int64_t rows, int32_t d,
                                                         int32_t d4, const int32_t *__restrict__ e, int32_t F,
                                                         int64_t ld, size_t plane_bytes, int8_t *__restrict__ out,
                                                         uint32_t (*sm)[SKV_CC_SL_T])
{
    static_assert(SKV_CC_SL_T == 128 && SKV_CC_SL_I == 64, "the thread maps below");
    const int tid = threadIdx.x, g = tid & 7;
    const int64_t t0 = (int64_t)blockIdx.y * SKV_CC_SL_T;
    const int32_t i0 = blockIdx.x * SKV_CC_SL_I, c0 = i0 + 8 * g;
    const bool vec = (d & 7) == 0 && ((uintptr_t)a & 15) == 0;
    int32_t ec[8];
#pragma unroll
    for (int c = 0; c < 8; c++) ec[c] = c0 + c < d ? e[c0 + c] : 0;
    uint16_t v[4][8];
#pragma unroll
    for (int u = 0; u < 4; u++) { /* all loads first: 4 x 16 bytes in flight per thread */
        const int64_t t = t0 + tid / 8 + 32 * u;
        if (vec) {
            uint4 w = make_uint4(0, 0, 0, 0);
            if (t < rows && c0 < d) w = __ldg((const uint4 *)(a + t * d + c0));
            const uint32_t ww[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int c = 0; c < 4; c++) {
                v[u][2 * c] = (uint16_t)(ww[c] & 0xffffu);
                v[u][2 * c + 1] = (uint16_t)(ww[c] >> 16);
            }
        } else
#pragma unroll
            for (int c = 0; c < 8; c++) v[u][c] = t < rows && c0 + c < d ? a[t * d + c0 + c] : (uint16_t)0;
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const int tt = tid / 8 + 32 * u;
#pragma unroll
        for (int c = 0; c < 8; c++) /* a zero element (or padding) packs to 0 */
            sm[8 * g + c][tt ^ (4 * g)] = skv_cc_i8_pack(skv_cc_i8_fix_bf16(v[u][c], F, ec[c]), S);
    }
    __syncthreads();
    const int w = tid / 32, q = tid & 31;
#pragma unroll 2
    for (int j = 0; j < SKV_CC_SL_I / 8; j++) {
        const int ii = w + 8 * j;
        const int32_t i = i0 + ii;
        if (i >= d4) break; /* warp-uniform, and the columns grow with j */
        const uint4 p4 = *reinterpret_cast<const uint4 *>(&sm[ii][(4 * q) ^ (4 * (ii / 8))]);
        int8_t *dst = out + (int64_t)i * ld + t0 + 4 * q;
#pragma unroll
        for (int k = 0; k < S; k++) {
            const int sh = 8 * k;
            char4 c4;
            c4.x = (signed char)(p4.x >> sh);
            c4.y = (signed char)(p4.y >> sh);
            c4.z = (signed char)(p4.z >> sh);
            c4.w = (signed char)(p4.w >> sh);
            *(char4 *)(dst + (size_t)k * plane_bytes) = c4;
        }
    }
}

/* The kernel: s digits known at compile time in the body (the packing unrolled). */
static __global__ void __launch_bounds__(256)
    skv_cc_slice(const skv_bf16 *__restrict__ a, int64_t rows, int32_t d, int32_t d4, const int32_t *__restrict__ e,
                 int32_t F, int s, int64_t ld, size_t plane_bytes, int8_t *__restrict__ out)
{
    __shared__ __align__(16) uint32_t sm[SKV_CC_SL_I][SKV_CC_SL_T];
    switch (s) {
    case 1: skv_cc_slice_body<1>(a, rows, d, d4, e, F, ld, plane_bytes, out, sm); break;
    case 2: skv_cc_slice_body<2>(a, rows, d, d4, e, F, ld, plane_bytes, out, sm); break;
    case 3: skv_cc_slice_body<3>(a, rows, d, d4, e, F, ld, plane_bytes, out, sm); break;
    default: skv_cc_slice_body<SKV_CC_I8_MAXS>(a, rows, d, d4, e, F, ld, plane_bytes, out, sm); break;
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
