/*
 * skv_cuda_canon_wprep.cu - the reproducible mode's preparation of W (skv_cuda_canon_wprep; the
 * cache runs it when it writes a slot's W: prefill and snapshot load, in skv_cuda_backend.cu; the
 * rebuild_keys_canonical slot of the dispatch table runs it per call before
 * skv_cuda_canon_rebuild): canon_wprep_kernel, W_h's columns in the rebuild's fixed point (a block
 * reads its 16 columns once into shared memory), split as 128 hi + lo (hi in [-64, 64], lo in
 * [-64, 63]) and stored as the B fragments of mma m16n8k32 (16 bytes per lane), plus the columns'
 * exponents: the prepared form skv_cuda_canon_rebuild.cu's tensor-core kernel reads. Also its
 * size (skv_cuda_canon_wq_bytes). Built with --fmad=false (CU_EXACT).
 */
#include <cuda_runtime.h>
#include <mma.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_cuda_canon_attn.cuh"
#include "skv_numerics.h"
#include "skv_plan.h"

namespace {

/* One sequence's (slot's) W and where its prepared form goes (a region of wq_bytes). */
struct WprepArgs {
    int32_t Hk, D, Dp, r, Kp;
    const uint16_t *w; /* [r, Hk D] bf16 */
    signed char *wq;
};

/* grid (Dp / 16, Hk), 256 threads: 16 columns (two n8 tiles) of W_h of one (sequence, KV head) in
   fixed point, split into int8 halves, as the B fragments of mma m16n8k32 (col): lane (g, t) of tile nt
   holds column 8 nt + g, rows k = 4 t + j (register 0) and 16 + 4 t + j (register 1), byte j. Written
   once per W (the cache: when a slot's W is written; op level: per call), 16 bytes per (k step, tile,
   lane): hi b0, hi b1, lo b0, lo b1, and the columns' exponents (see wq_ex_off). The block reads its
   columns once (every load in flight) into shared memory, 0 past r and D. */
__global__ void __launch_bounds__(kRbNT) canon_wprep_kernel(const WprepArgs a)
{
    static_assert(kRbNT == 256, "16 columns x 16 row groups");
    const int h = blockIdx.y, tid = threadIdx.x, col = tid & 15, rg = tid >> 4;
    const int d = blockIdx.x * 16 + col;
    const uint16_t *w0 = a.w + (int64_t)h * a.D;
    const int64_t width = (int64_t)a.Hk * a.D;
    __shared__ uint16_t wt[kRbKsMax * 32][16];
    __shared__ unsigned mx_s[256];
    __shared__ int e_s[16];
    unsigned mx = 0;
#pragma unroll
    for (int i = 0; i < kRbKsMax * 2; i++) {
        const int q = rg + 16 * i;
        if (q >= a.Kp) break;
        const uint16_t v = q < a.r && d < a.D ? w0[(int64_t)q * width + d] : (uint16_t)0;
        wt[q][col] = v;
        mx = max(mx, (unsigned)(v & 0x7fffu));
    }
    mx_s[tid] = mx;
    __syncthreads();
    if (tid < 16) {
        unsigned m = mx_s[tid];
        for (int g = 1; g < 16; g++) m = max(m, mx_s[tid + 16 * g]);
        e_s[tid] = skv_canon_rebuild_ex((uint16_t)m);
        int *wex = reinterpret_cast<int *>(a.wq + wq_ex_off(a.Hk, a.Kp, a.Dp));
        wex[(int64_t)h * a.Dp + blockIdx.x * 16 + tid] = e_s[tid];
    }
    __syncthreads();
    const int NT = a.Dp / 8, KS = a.Kp / 32;
    uint4 *dst = reinterpret_cast<uint4 *>(a.wq + (int64_t)h * 2 * a.Kp * a.Dp);
    for (int it = tid; it < KS * 64; it += kRbNT) {
        const int ks = it >> 6, ntl = (it >> 5) & 1, ln = it & 31, g = ln >> 2, t = ln & 3;
        const int cl = ntl * 8 + g, e = e_s[cl];
        uint32_t hw[2] = {0, 0}, lw[2] = {0, 0};
#pragma unroll
        for (int reg = 0; reg < 2; reg++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int32_t x = skv_canon_rebuild_fix(wt[32 * ks + 16 * reg + 4 * t + j][cl], e);
                hw[reg] |= rb_hi8(x + 64) << (8 * j);
                lw[reg] |= rb_lo8(x + 64) << (8 * j);
            }
        dst[((size_t)ks * NT + blockIdx.x * 2 + ntl) * 32 + ln] = make_uint4(hw[0], hw[1], lw[0], lw[1]);
    }
}

} /* namespace */

size_t skv_cuda_canon_wq_bytes(int32_t Hk, int32_t D, int32_t r)
{
    return wq_bytes(Hk, (r + 31) / 32 * 32, (D + 15) / 16 * 16);
}

cudaError_t skv_cuda_canon_wprep(cudaStream_t st, int32_t Hk, int32_t D, int32_t r, const skv_bf16 *w, void *wq)
{
    WprepArgs a;
    memset(&a, 0, sizeof a);
    a.Hk = Hk, a.D = D, a.Dp = (D + 15) / 16 * 16, a.r = r, a.Kp = (r + 31) / 32 * 32;
    a.w = (const uint16_t *)w, a.wq = (signed char *)wq;
    if (a.Kp / 32 > kRbKsMax || Hk > kMaxGridYZ || !w || !wq) return cudaErrorInvalidValue;
    return launch(canon_wprep_kernel, dim3((unsigned)(a.Dp / 16), (unsigned)Hk), dim3(kRbNT), 0, st, false, a);
}
