/*
 * skv_cuda_landmarks.cu - landmarks and outliers at prefill (skv_cuda_landmarks_outliers):
 * every chunk's mean key (its landmark) and outlier score, the O outlier chunks of each KV
 * head, the candidates in increasing chunk order and their landmarks, bit-identical to
 * ref's landmarks_outliers.
 *
 * Reached from the op-level slot landmarks_outliers (skv_cuda_landmarks_op,
 * skv_cuda_ops.cu) and from the cache's prefill (skv_cuda_cache_prefill,
 * skv_cuda_cache.cu). On the decision path: built with --fmad=false; the mean and
 * the cos chains run lib/skv_numerics.h's operations in ref's order (one thread per
 * chain), the outliers are the exact block top-k of skv_cuda_topk.cuh.
 *
 * Launchers only enqueue work; they never allocate or synchronize.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_cuda_exact.cuh"
#include "skv_cuda_topk.cuh"
#include "skv_numerics.h"

namespace {

/* ---- landmarks and outlier scores ------------------------------------------------------- */

constexpr int kLmWarps = 8; /* (chunk, head) items per block, one per warp */

/* The token an ordered "first NaN, else first minimum" scan ends on (ref's
   skv_chunk_landmark_score), as a strict order on (score, token); t < 0 marks no token. */
__device__ __forceinline__ bool lm_better(float va, int32_t ta, float vb, int32_t tb)
{
    if (ta < 0) return false;
    if (tb < 0) return true;
    bool na = va != va, nb = vb != vb;
    if (na || nb) return na && (!nb || ta < tb);
    if (va != vb) return va < vb; /* -0 == +0: falls through to the token order */
    return ta < tb;
}

/*
 * One warp per (chunk j, head h). The mean is summed per dim in token order by one lane
 * (lanes own dim pairs), kept in shared memory as float, and stored rounded to bf16 into
 * lm_all [Hk, N, D]. Then lane t computes the cos chain of token t (ab, aa, bb in d order,
 * exactly skv_cos_bf16_f32) and the warp combines the per-token scores with lm_better,
 * which picks the same token as ref's scan. keys[h*N + j] = skv_outlier_key(score).
 */
template <int V>
__global__ void __launch_bounds__(kLmWarps * 32)
    skv_landmark_kernel(int32_t N, int32_t c, int32_t Hk, int32_t D, const uint16_t *k_post, float *keys,
                        uint16_t *lm_all)
{
    extern __shared__ float lm_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float *mean = lm_smem + warp * D;
    const int64_t items = (int64_t)N * Hk, tstride = (int64_t)Hk * D;
    const float cf = (float)c;

    for (int64_t item = (int64_t)blockIdx.x * kLmWarps + warp; item < items;
         item += (int64_t)gridDim.x * kLmWarps) {
        const int32_t j = (int32_t)(item / Hk), h = (int32_t)(item % Hk);
        const uint16_t *k0 = k_post + ((int64_t)j * c * Hk + h) * D;
        uint16_t *lm = lm_all + ((int64_t)h * N + j) * D;

        for (int32_t d = 2 * lane; d < D; d += 64) {
            float s0 = 0.0f, s1 = 0.0f;
#pragma unroll 8
            for (int32_t t = 0; t < c; t++) {
                const uint16_t *p = k0 + t * tstride + d;
                float x[2];
                if constexpr (V >= 2) {
                    load_bf16<2>(p, x);
                } else {
                    x[0] = skv_bf16_to_f32(p[0]);
                    x[1] = skv_bf16_to_f32(p[1]);
                }
                s0 = SKV_ADD(s0, x[0]);
                s1 = SKV_ADD(s1, x[1]);
            }
            float m0 = SKV_DIV(s0, cf), m1 = SKV_DIV(s1, cf);
            mean[d] = m0;
            mean[d + 1] = m1;
            /* scratch is 4-byte aligned and d, D are even */
            *reinterpret_cast<uint32_t *>(lm + d) =
                (uint32_t)skv_f32_to_bf16(m0) | ((uint32_t)skv_f32_to_bf16(m1) << 16);
        }
        __syncwarp();

        float best = 0.0f;
        int32_t bt = -1;
        for (int32_t t = lane; t < c; t += 32) {
            const uint16_t *row = k0 + t * tstride;
            float ab = 0.0f, aa = 0.0f, bb = 0.0f;
#pragma unroll 2
            for (int32_t d = 0; d < D; d += V) {
                float x[V];
                load_bf16<V>(row + d, x);
#pragma unroll
                for (int i = 0; i < V; i++) {
                    float m = mean[d + i];
                    ab = SKV_FMA(x[i], m, ab);
                    aa = SKV_FMA(x[i], x[i], aa);
                    bb = SKV_FMA(m, m, bb);
                }
            }
            float s = SKV_DIV(ab, fmaxf(SKV_MUL(SKV_SQRT(aa), SKV_SQRT(bb)), 1e-8f));
            if (lm_better(s, t, best, bt)) best = s, bt = t;
        }
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) {
            float ob = __shfl_xor_sync(kFullMask, best, o);
            int32_t ot = __shfl_xor_sync(kFullMask, bt, o);
            if (lm_better(ob, ot, best, bt)) best = ob, bt = ot;
        }
        if (lane == 0) keys[(int64_t)h * N + j] = skv_outlier_key(best);
        __syncwarp(); /* everyone is done with mean before the next item overwrites it */
    }
}

constexpr int kTopkBlock = 1024;

/* Per head (one block): the O lowest keys are the outliers, the rest the candidates,
   both in increasing chunk order. */
__global__ void __launch_bounds__(kTopkBlock)
    skv_outlier_topk_kernel(int32_t N, int32_t Hk, int32_t O, const float *keys, int32_t *outlier_ids,
                            int32_t *candidate_ids)
{
    __shared__ TopkSmem<kTopkBlock> sm;
    const int32_t n_cand = N - O;
    for (int32_t h = blockIdx.x; h < Hk; h += gridDim.x) {
        const float *kh = keys + (int64_t)h * N;
        int32_t *oid = outlier_ids + (int64_t)h * O; /* unused when O == 0 (may be NULL) */
        int32_t *cid = candidate_ids + (int64_t)h * n_cand;
        block_topk<kTopkBlock, true>(
            N, O, [=](int32_t i) { return order_asc(kh[i]); }, [=](int32_t pos, int32_t i) { oid[pos] = i; },
            [=](int32_t pos, int32_t i) { cid[pos] = i; }, sm);
        __syncthreads();
    }
}

/* landmarks row r = (h, m) = lm_all row (h, candidate_ids[r]); one warp-row (32 lanes) per
   row, W the widest word both sides are aligned to. */
template <typename W>
__global__ void __launch_bounds__(256)
    skv_gather_landmarks_kernel(int32_t N, int32_t n_cand, int32_t Hk, int32_t D, const int32_t *candidate_ids,
                                const uint16_t *lm_all, uint16_t *landmarks)
{
    const int32_t words = (int32_t)((int64_t)D * 2 / sizeof(W));
    const int64_t rows = (int64_t)Hk * n_cand;
    for (int64_t r = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; r < rows;
         r += (int64_t)gridDim.x * blockDim.y) {
        const int64_t h = r / n_cand;
        const W *src = reinterpret_cast<const W *>(lm_all + (h * N + candidate_ids[r]) * D);
        W *dst = reinterpret_cast<W *>(landmarks + r * D);
        for (int32_t w = threadIdx.x; w < words; w += blockDim.x) dst[w] = src[w];
    }
}

} /* namespace */

/* ---- launchers ------------------------------------------------------------------------- */

/* keys float [Hk, N], then (256-byte aligned) every chunk's bf16 landmark [Hk, N, D]. */
size_t skv_cuda_landmarks_scratch_bytes(int32_t n_chunks, int32_t n_kv_heads, int32_t head_dim)
{
    const size_t nh = (size_t)n_chunks * (size_t)n_kv_heads;
    return align_up(nh * sizeof(float), 256) + nh * (size_t)head_dim * sizeof(skv_bf16);
}

/*
 * Three launches: landmarks + scores of every chunk into scratch; per head, the top-O
 * (outliers) and the rest (candidates); the candidates' landmarks gathered in candidate
 * order. scratch: skv_cuda_landmarks_scratch_bytes bytes, at least 4-byte aligned.
 */
cudaError_t skv_cuda_landmarks_outliers(cudaStream_t st, int32_t n_chunks, int32_t chunk, int32_t n_kv_heads,
                                        int32_t head_dim, int32_t n_outliers, const skv_bf16 *k_post,
                                        int32_t *outlier_ids, int32_t *candidate_ids, skv_bf16 *landmarks,
                                        void *scratch)
{
    const int32_t N = n_chunks, c = chunk, Hk = n_kv_heads, D = head_dim, O = n_outliers;
    if (N <= 0 || Hk <= 0) return cudaSuccess;
    const size_t nh = (size_t)N * Hk;
    float *keys = static_cast<float *>(scratch);
    uint16_t *lm_all = reinterpret_cast<uint16_t *>(static_cast<char *>(scratch) + align_up(nh * sizeof(float), 256));

    const unsigned lm_grid = grid_for((int64_t)nh, kLmWarps);
    const size_t lm_smem = (size_t)kLmWarps * D * sizeof(float);
    switch (row_vec(k_post, D)) {
    case 8:
        skv_landmark_kernel<8><<<lm_grid, kLmWarps * 32, lm_smem, st>>>(N, c, Hk, D, k_post, keys, lm_all);
        break;
    case 2:
        skv_landmark_kernel<2><<<lm_grid, kLmWarps * 32, lm_smem, st>>>(N, c, Hk, D, k_post, keys, lm_all);
        break;
    default:
        skv_landmark_kernel<1><<<lm_grid, kLmWarps * 32, lm_smem, st>>>(N, c, Hk, D, k_post, keys, lm_all);
        break;
    }

    skv_outlier_topk_kernel<<<(unsigned)Hk, kTopkBlock, 0, st>>>(N, Hk, O, keys, outlier_ids, candidate_ids);

    const int32_t n_cand = N - O;
    const int64_t rows = (int64_t)Hk * n_cand;
    const dim3 gblock(32, 8);
    const unsigned ggrid = grid_for(rows, gblock.y);
    const int v_out = row_vec(landmarks, D), v_in = row_vec(lm_all, D);
    const int v = v_out < v_in ? v_out : v_in;
    if (v == 8)
        skv_gather_landmarks_kernel<uint4><<<ggrid, gblock, 0, st>>>(N, n_cand, Hk, D, candidate_ids, lm_all, landmarks);
    else if (v == 2)
        skv_gather_landmarks_kernel<uint32_t><<<ggrid, gblock, 0, st>>>(N, n_cand, Hk, D, candidate_ids, lm_all,
                                                                         landmarks);
    else
        skv_gather_landmarks_kernel<uint16_t><<<ggrid, gblock, 0, st>>>(N, n_cand, Hk, D, candidate_ids, lm_all,
                                                                         landmarks);
    return cudaGetLastError();
}
