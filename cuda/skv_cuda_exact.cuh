/*
 * skv_cuda_exact.cuh - what the files of the decision path share: skv_cuda_rope.cu,
 * skv_cuda_landmarks.cu, skv_cuda_score.cu and skv_cuda_select.cu (CU_EXACT in the
 * Makefile: built with --fmad=false). Header-only; everything is in an anonymous
 * namespace, so each file has its own copy.
 *
 * The rule of those files: every value a decision depends on is computed with the
 * functions of lib/skv_numerics.h or with the exact sequence of IEEE-rounded operations
 * they perform (SKV_* map to __f*_rn intrinsics here, and the files are built with
 * --fmad=false), so outlier sets, candidate lists, landmarks and selected sets are
 * bit-identical to ref (docs/DESIGN.md section 5). Parallelism never splits an ordered
 * chain: a dot product, a landmark sum or a canonical partial sum is always run by one
 * thread in ref's order; only independent chains, and order-insensitive combinations
 * (max, min with explicit tie-breaks, counts), run in parallel.
 *
 * Here: the grid cap of their grid-stride kernels, the bf16 row loads of the landmark
 * and score kernels, and the group limit of the score and selection kernels.
 */
#ifndef SKV_CUDA_EXACT_CUH
#define SKV_CUDA_EXACT_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "skv_cuda_common.cuh"
#include "skv_numerics.h"

namespace {

/* Cap on 1D grids of grid-stride kernels (each block then loops). */
constexpr int64_t kMaxGridX = 1 << 20;

inline unsigned grid_for(int64_t items, int64_t per_block) { return grid_for(items, per_block, kMaxGridX); }

/* ---- bf16 loads ------------------------------------------------------------------------ */

/* V consecutive bf16 at p as floats (exact conversions). V = 8 needs p 16-byte aligned,
   V = 2 needs 4-byte alignment; V = 1 always works. Callers pick V from the alignment of
   their rows, so odd-aligned caller pointers take the narrow path instead of faulting. */
__device__ __forceinline__ float bf16_lo(uint32_t w) { return skv_f32_from_bits(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return skv_f32_from_bits(w & 0xffff0000u); }

template <int V>
__device__ __forceinline__ void load_bf16(const uint16_t *p, float (&x)[V])
{
    if constexpr (V == 8) {
        uint4 w = *reinterpret_cast<const uint4 *>(p);
        x[0] = bf16_lo(w.x), x[1] = bf16_hi(w.x), x[2] = bf16_lo(w.y), x[3] = bf16_hi(w.y);
        x[4] = bf16_lo(w.z), x[5] = bf16_hi(w.z), x[6] = bf16_lo(w.w), x[7] = bf16_hi(w.w);
    } else if constexpr (V == 2) {
        uint32_t w = *reinterpret_cast<const uint32_t *>(p);
        x[0] = bf16_lo(w), x[1] = bf16_hi(w);
    } else {
        static_assert(V == 1, "V is 1, 2 or 8");
        x[0] = skv_bf16_to_f32(p[0]);
    }
}

/* The widest V whose alignment every row of a tensor with row length D (elements, even)
   starting at p satisfies. */
__host__ __device__ __forceinline__ int row_vec(const void *p, int32_t D)
{
    uintptr_t a = (uintptr_t)p;
    if (D % 8 == 0 && a % 16 == 0) return 8;
    if (a % 4 == 0) return 2;
    return 1;
}

/* Query heads per KV head the score kernel (and the fused selection's per-group arrays) take. */
constexpr int kScMaxGp = 64;

} /* namespace */

#endif /* SKV_CUDA_EXACT_CUH */
