/*
 * skv_cuda_rope.cu - RoPE of prefill keys (skv_cuda_rope): k_post = RoPE(k_pre) row
 * by row with the shared rotation of lib/skv_numerics.h, bit-identical to ref.
 *
 * Reached from the op-level slot rope (skv_cuda_rope_op, skv_cuda_ops.cu) and from
 * the cache's prefill when the caller gives no k_post (skv_cuda_cache_prefill,
 * skv_cuda_cache.cu). On the decision path (the landmarks are computed from its
 * output): built with --fmad=false.
 *
 * The launcher only enqueues work; it never allocates or synchronizes.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_cuda_exact.cuh"
#include "skv_numerics.h"

namespace {

/* ---- RoPE ------------------------------------------------------------------------------ */

/*
 * One row = one (token, head) vector of D values; thread x of a row owns work item
 * i < D/2: pair i when i < R/2 (both members), else the pass-through dims
 * R + 2(i - R/2) and the next one. Items are disjoint and each thread reads its
 * values before writing them, so in == out is safe.
 */
__global__ void __launch_bounds__(256)
    skv_rope_kernel(int32_t D, int32_t R, int32_t interleaved, int64_t n_rows, int32_t n_heads, int64_t pos0,
                    const float *cos_tab, const float *sin_tab, const uint16_t *in, uint16_t *out)
{
    const int32_t half = D / 2, h2 = R / 2;
    for (int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; row < n_rows;
         row += (int64_t)gridDim.x * blockDim.y) {
        const int64_t p = pos0 + row / n_heads;
        const float *cs = cos_tab + p * h2, *sn = sin_tab + p * h2;
        const uint16_t *x = in + row * D;
        uint16_t *y = out + row * D;
        for (int32_t i = threadIdx.x; i < half; i += blockDim.x) {
            if (i < h2) {
                int a, b;
                float xo, yo;
                skv_rope_pair_index(i, R, interleaved, &a, &b);
                skv_rope_rotate(skv_bf16_to_f32(x[a]), skv_bf16_to_f32(x[b]), cs[i], sn[i], &xo, &yo);
                y[a] = skv_f32_to_bf16(xo);
                y[b] = skv_f32_to_bf16(yo);
            } else {
                /* ref rounds pass-through dims too (it quiets a signalling NaN) */
                int32_t d = R + 2 * (i - h2);
                float v0 = skv_bf16_to_f32(x[d]), v1 = skv_bf16_to_f32(x[d + 1]);
                y[d] = skv_f32_to_bf16(v0);
                y[d + 1] = skv_f32_to_bf16(v1);
            }
        }
    }
}

} /* namespace */

/* ---- launcher -------------------------------------------------------------------------- */

cudaError_t skv_cuda_rope(cudaStream_t st, int32_t head_dim, int32_t rotary_dim, int32_t interleaved,
                          int64_t n_tokens, int32_t n_heads, int64_t pos0, const float *cos_tab,
                          const float *sin_tab, const skv_bf16 *in, skv_bf16 *out)
{
    const int64_t rows = n_tokens * n_heads;
    if (rows <= 0) return cudaSuccess;
    const int32_t R = rotary_dim ? rotary_dim : head_dim, half = head_dim / 2;
    const int bx = half >= 128 ? 128 : (half + 31) / 32 * 32;
    const dim3 block(bx, 256 / bx);
    skv_rope_kernel<<<grid_for(rows, block.y), block, 0, st>>>(head_dim, R, interleaved, rows, n_heads, pos0,
                                                             cos_tab, sin_tab, in, out);
    return cudaGetLastError();
}
