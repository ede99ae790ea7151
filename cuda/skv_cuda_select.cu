/*
 * skv_cuda_select.cu - the decision path of the cuda backend: RoPE, landmarks
 * and outlier scores at prefill; at decode the candidate scores, the selection
 * softmax, the top-S per KV head and the chunk cache's plan (skv_cuda.h lists
 * the steps).
 *
 * Every value a decision depends on is computed with the functions of
 * lib/skv_numerics.h or with the exact sequence of IEEE-rounded operations
 * they perform (SKV_* map to __f*_rn intrinsics here, and the file is built
 * with --fmad=false), so outlier sets, candidate lists, landmarks and selected
 * sets are bit-identical to ref (docs/DESIGN.md section 5). Parallelism never
 * splits an ordered chain: a dot product, a landmark sum or a canonical
 * partial sum is always run by one thread in ref's order; only independent
 * chains, and order-insensitive combinations (max, min with explicit
 * tie-breaks, counts), run in parallel.
 *
 * Launchers only enqueue work; they never allocate or synchronize.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_cuda_topk.cuh"
#include "skv_numerics.h"

namespace {

/* Cap on 1D grids of grid-stride kernels (each block then loops). */
constexpr int64_t kMaxGridX = 1 << 20;

unsigned grid_for(int64_t items, int64_t per_block) { return grid_for(items, per_block, kMaxGridX); }

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

/* ---- decode selection: step 1, scores ------------------------------------------------------ */

constexpr int kScNT = 128;          /* threads per block */
constexpr int kScRows = kScNT;      /* candidates per tile: one row per thread */
constexpr int kScMaxGp = 64;        /* query heads per KV head this kernel takes */

struct ScoreArgs {
    skv_cuda_shape sh;
    const skv_cuda_seq *seqs;
    skv_cuda_io io;                 /* the step's q, k, v, out (k, v NULL: no input check) */
    skv_cuda_io *io_dev;            /* where the later steps read io (NULL: op-level) */
    float *scores;
    unsigned *macc;
    float *s0;
    int32_t *step_bad;
    unsigned long long *first_bad;
    int32_t layer;
    int32_t ntiles;                 /* tiles per (b, h): ceil(cand_max / kScRows) */
    int64_t total, per;             /* B*Hk*ntiles tiles; each block takes per consecutive ones */
};

/* Dynamic shared memory of score_kernel: two tiles of landmark rows (DT != 0), then q as [D][Gp]. */
__host__ __device__ inline size_t score_tile_bytes(int32_t D) { return (size_t)kScRows * D * 2; }
inline size_t score_smem_bytes(int DT, int32_t D, int32_t Gp)
{
    return (DT ? 2 * score_tile_bytes(D) : 0) + (size_t)D * Gp * sizeof(float);
}

/* acc[g] = fmaf chain of q_g . row over the 8 elements of piece d0 (skv_dot_bf16's order:
   fma(q, l, acc)); qT is [D][Gp] from head g0; GPC != 0: Gp known at compile time (the
   loads then take immediate offsets). */
template <int GC, int GPC>
__device__ __forceinline__ void score_fma8(const float x[8], const float *qT, int32_t Gp_rt, int32_t d0, float (&acc)[GC])
{
    const int32_t Gp = GPC ? GPC : Gp_rt;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float *qd = qT + (d0 + i) * Gp;
        if constexpr (GC == 4) {
            const float4 qv = *reinterpret_cast<const float4 *>(qd);
            acc[0] = SKV_FMA(qv.x, x[i], acc[0]);
            acc[1] = SKV_FMA(qv.y, x[i], acc[1]);
            acc[2] = SKV_FMA(qv.z, x[i], acc[2]);
            acc[3] = SKV_FMA(qv.w, x[i], acc[3]);
        } else {
#pragma unroll
            for (int g = 0; g < GC; g++) acc[g] = SKV_FMA(qd[g], x[i], acc[g]);
        }
    }
}

/*
 * Block i scores the tiles [i*per, (i+1)*per) of the flat (b, h, tile) order: one thread per
 * candidate j of a tile computes the dot chains of the G query heads of KV head h, GC at a
 * time (q of the group in shared memory as [D][Gp] floats, Gp = G rounded up to GC; heads
 * past G are zero and not written). DT != 0 (D == DT, landmark rows 16-byte aligned): tiles
 * are staged with cp.async into a two-stage ring, 16-byte piece k of row r at k ^ (r % NC)
 * (conflict-free row reads), the next tile loading while this one is scored, and the chain
 * loop is unrolled. DT = 0: rows are read straight from global memory. s_j = SKV_MUL(dot,
 * scale) -> scores[b][qh][j]; the max over the non-NaN scores of each query head goes to macc
 * (atomicMax of its order image) when a block leaves a (b, h); s_0 to s0. The block holding
 * the first tile of (b, h) checks q of the group and k, v of head h; block 0 publishes io.
 */
template <int GC, int DT, bool MULTI, int GPC>
__global__ void __launch_bounds__(kScNT) score_kernel(const ScoreArgs a)
{
    extern __shared__ __align__(16) unsigned char sc_smem[];
    __shared__ float wmax[kScNT / 32][kScMaxGp];
    const skv_cuda_shape &sh = a.sh;
    const int32_t D = DT ? DT : sh.D, G = sh.Hq / sh.Hk, Gp = (G + GC - 1) / GC * GC;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float *qT = reinterpret_cast<float *>(sc_smem + (DT ? 2 * score_tile_bytes(D) : 0));
    const int64_t t_begin = (int64_t)blockIdx.x * a.per, t_end = min(a.total, t_begin + a.per);
    if (a.io_dev && blockIdx.x == 0 && tid == 0) *a.io_dev = a.io;
    const uint16_t *q = (const uint16_t *)a.io.q;
    constexpr int NC = DT / 8;

    auto load_tile = [&](int stage, int64_t t) {
        if constexpr (DT != 0) {
            const int64_t pair = t / a.ntiles;
            const int32_t b = (int32_t)(pair / sh.Hk), h = (int32_t)(pair - (int64_t)b * sh.Hk);
            const int32_t n = a.seqs[b].n_cand, j0 = (int32_t)(t - pair * a.ntiles) * kScRows;
            const int32_t rows = min(kScRows, n - j0);
            unsigned char *tile = sc_smem + stage * score_tile_bytes(D);
            /* thread tid copies piece k = tid % NC of rows tid / NC, + RPP, ...: addresses by
               increments (index arithmetic per piece would be a fifth of the kernel's instructions) */
            constexpr int RPP = kScNT / NC;
            const int k = tid % NC;
            const uint16_t *src = a.seqs[b].landmarks + ((int64_t)h * n + j0 + tid / NC) * D + k * 8;
            for (int r = tid / NC; r < rows; r += RPP, src += RPP * DT)
                cp_async16(tile + r * (2 * DT) + ((k ^ (r & (NC - 1))) << 4), src);
        }
    };

    int64_t cur = -1; /* the (b, h) whose max is being gathered */
    /* running max per query head: with one pass over the heads (G <= GC) in registers */
    constexpr int NPASS = MULTI ? kScMaxGp / GC : 1;
    float mx[NPASS][GC];
    /* the block's max of each query head of pair p -> macc (block-wide) */
    auto flush_max = [&](int64_t p) {
        const int32_t pb = (int32_t)(p / sh.Hk), ph = (int32_t)(p - (int64_t)pb * sh.Hk);
#pragma unroll
        for (int pi = 0; pi < NPASS; pi++) {
            if (pi * GC >= Gp) break;
#pragma unroll
            for (int g = 0; g < GC; g++) {
                const float m = warp_max(mx[pi][g]);
                if (lane == 0) wmax[warp][pi * GC + g] = m;
            }
        }
        __syncthreads();
        if (tid < G) {
            float m = wmax[0][tid];
            for (int w = 1; w < kScNT / 32; w++) m = fmaxf(m, wmax[w][tid]);
            if (m != -INFINITY) atomicMax(&a.macc[(int64_t)pb * sh.Hq + (int64_t)ph * G + tid], order_desc(m));
        }
    };
    int stage = 0;
    if (t_begin < t_end) load_tile(0, t_begin);
    cp_async_commit();
    for (int64_t t = t_begin; t < t_end; t++) {
        const int64_t pair = t / a.ntiles;
        const int32_t b = (int32_t)(pair / sh.Hk), h = (int32_t)(pair - (int64_t)b * sh.Hk);
        if (pair != cur) {
            if (cur >= 0) flush_max(cur); /* leave the previous (b, h) */
            __syncthreads(); /* qT and wmax are free */
            const uint16_t *qg = q + ((int64_t)b * sh.Hq + (int64_t)h * G) * D;
            for (int32_t e = tid; e < Gp * D; e += kScNT) {
                const int32_t d = e / Gp, g = e - d * Gp;
                qT[e] = g < G ? skv_bf16_to_f32(qg[(int64_t)g * D + d]) : 0.0f;
            }
#pragma unroll
            for (int pi = 0; pi < NPASS; pi++)
#pragma unroll
                for (int g = 0; g < GC; g++) mx[pi][g] = -INFINITY;
            if (a.io.k && t == pair * a.ntiles) { /* the step's inputs of this (b, h) are finite */
                const int64_t nq = (int64_t)G * D, nk = D, qoff = ((int64_t)b * sh.Hq + (int64_t)h * G) * D,
                              koff = ((int64_t)b * sh.Hk + h) * D;
                const uint16_t *kn = (const uint16_t *)a.io.k, *vn = (const uint16_t *)a.io.v;
                int count = 0;
                unsigned long long first = ~0ull;
                for (int64_t i = tid; i < nq + 2 * nk; i += kScNT) {
                    const int tensor = i < nq ? 0 : i < nq + nk ? 1 : 2;
                    const int64_t j = tensor == 0 ? qoff + i : koff + (i - nq - (tensor == 2 ? nk : 0));
                    const uint16_t x = tensor == 0 ? q[j] : tensor == 1 ? kn[j] : vn[j];
                    if (!skv_bf16_isfinite(x)) {
                        count++;
                        const unsigned long long key = ((unsigned long long)a.layer << 48) |
                                                       ((unsigned long long)tensor << 40) | (unsigned long long)j;
                        first = key < first ? key : first;
                    }
                }
                count = warp_sum_int(count);
                first = warp_min_u64(first);
                if (lane == 0) {
                    if (count) atomicAdd(a.step_bad, count);
                    if (first != ~0ull) atomicMin(a.first_bad, first);
                }
            }
            cur = pair;
        }
        if (t + 1 < t_end) load_tile(stage ^ 1, t + 1);
        cp_async_commit();
        cp_async_wait_group<1>(); /* tile t landed (this thread's pieces) */
        __syncthreads();          /* ... and everyone's, and qT */
        const int32_t n = a.seqs[b].n_cand, jt = (int32_t)(t - pair * a.ntiles) * kScRows;
        const int32_t j = jt + tid; /* one row per thread */
        if (j < n) {
            const uint16_t *L = a.seqs[b].landmarks + ((int64_t)h * n + j) * D;
            const unsigned char *row = sc_smem + stage * score_tile_bytes(D) + (size_t)tid * 2 * D;
            const int sw4 = (tid & (NC - 1)) << 4; /* piece k of this row sits at k ^ (row % NC) */
#pragma unroll
            for (int pi = 0; pi < NPASS; pi++) {
                const int32_t g0 = pi * GC;
                if (g0 >= Gp) break;
                float acc[GC];
#pragma unroll
                for (int g = 0; g < GC; g++) acc[g] = 0.0f;
                if constexpr (DT != 0) { /* piece k of a staged row sits at k ^ (row % NC) */
                    constexpr int UNR = NC > 16 ? 8 : NC; /* D = 256: bounded, no spills */
#pragma unroll UNR
                    for (int32_t k = 0; k < NC; k++) {
                        float x[8];
                        bf16x8_to_f32(*reinterpret_cast<const uint4 *>(row + ((k << 4) ^ sw4)), x);
                        score_fma8<GC, GPC>(x, qT + g0, Gp, k * 8, acc);
                    }
                } else {
                    const int v = row_vec(L, D);
                    for (int32_t d = 0; d < D; d += 2) {
                        float x[2];
                        if (v >= 2) load_bf16<2>(L + d, x);
                        else x[0] = skv_bf16_to_f32(L[d]), x[1] = skv_bf16_to_f32(L[d + 1]);
#pragma unroll
                        for (int i = 0; i < 2; i++)
#pragma unroll
                            for (int g = 0; g < GC; g++) acc[g] = SKV_FMA(qT[(d + i) * Gp + g0 + g], x[i], acc[g]);
                    }
                }
#pragma unroll
                for (int g = 0; g < GC; g++) {
                    if (g0 + g >= G) break;
                    const float sc = SKV_MUL(acc[g], sh.scale);
                    const int64_t row_i = (int64_t)b * sh.Hq + (int64_t)h * G + g0 + g;
                    a.scores[row_i * sh.cand_max + j] = sc;
                    mx[pi][g] = fmaxf(mx[pi][g], sc); /* NaN never wins */
                    if (j == 0) a.s0[row_i] = sc;
                }
            }
        }
        __syncthreads(); /* stage is refilled at the next iteration but one */
        stage ^= 1;
    }
    if (cur >= 0) flush_max(cur);
    pdl_trigger();
}

/*
 * The fixed pairwise tree of the canonical sum over the 256 lane partials in part[] (k: this
 * thread's lane; every thread of the block calls it, after writing its partial): lanes k < w
 * add part[k + w] for w = 128, 64, 32 in shared memory, then the first warp (k < 32, whole)
 * by shuffles. The sum is in lane k = 0: skv_canonical_sum's order, the same bits.
 */
__device__ __forceinline__ float canon_tree(float *part, int k)
{
    __syncthreads();
    for (int w = SKV_CANON_LANES / 2; w >= 32; w >>= 1) {
        if (k < w) part[k] = SKV_ADD(part[k], part[k + w]);
        __syncthreads();
    }
    float v = 0.0f;
    if (k < 32) {
        v = part[k];
#pragma unroll
        for (int w = 16; w >= 1; w >>= 1) {
            const float o = __shfl_down_sync(kFullMask, v, w);
            v = SKV_ADD(v, o); /* lanes k < w: P[k] + P[k+w] */
        }
    }
    return v;
}

/* ---- decode selection: step 2, e_j and their canonical sum ----------------------------------- */

constexpr int kExNT = 256;                 /* = SKV_CANON_LANES: one lane per canonical partial */
constexpr int kExPer = 8;                  /* e_j per thread */
constexpr int kExTile = kExNT * kExPer;    /* candidates per block */
static_assert(kExNT == SKV_CANON_LANES, "the canonical sum has 256 lanes");

/*
 * grid (X, Hq, B). M = s_0 if it is NaN (ref's scan starts there and NaN never compares
 * greater), else the max of the non-NaN scores (the sign of a zero max changes no e_j).
 * Each block turns its tile of scores into e_j = skv_expf(s_j - M) in place. The last block
 * of (b, qh) (a counter after a fence) computes Z = canonical sum of e: lane k adds
 * e_k, e_{k+256}, ... in order (loads from L2, 8 in flight), then the fixed pairwise tree.
 */
__global__ void __launch_bounds__(kExNT)
    expsum_kernel(const skv_cuda_shape sh, const skv_cuda_seq *seqs, float *scores, const unsigned *macc,
                  const float *s0, float *Z, unsigned *cnt)
{
    __shared__ float part[kExNT];
    __shared__ int last;
    pdl_wait();
    const int tid = threadIdx.x;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t qh = blockIdx.y; qh < sh.Hq; qh += gridDim.y) {
            const int32_t n = seqs[b].n_cand, nblk = (int32_t)ceil_div64(n, kExTile);
            if ((int32_t)blockIdx.x >= nblk) continue; /* block-uniform */
            const int64_t row = (int64_t)b * sh.Hq + qh;
            float *s = scores + row * sh.cand_max;
            const float first = s0[row];
            const float M = first != first ? first : order_desc_inv(macc[row]);
            const int32_t j0 = blockIdx.x * kExTile;
            float x[kExPer];
#pragma unroll
            for (int u = 0; u < kExPer; u++) {
                const int32_t j = j0 + u * kExNT + tid;
                x[u] = j < n ? s[j] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < kExPer; u++) {
                const int32_t j = j0 + u * kExNT + tid;
                if (j < n) s[j] = skv_expf(SKV_SUB(x[u], M));
            }
            __threadfence();
            __syncthreads();
            if (tid == 0) last = atomicAdd(&cnt[row], 1u) == (unsigned)nblk - 1;
            __syncthreads();
            if (!last) continue; /* block-uniform */
            __threadfence();
            /* lane tid's chain: 16 loads in flight, the next batch loaded before this one is added
               (adding the zeros past n changes no sum: e >= 0) */
            constexpr int PF = 16;
            float P = 0.0f, cur[PF], nxt[PF];
#pragma unroll
            for (int u = 0; u < PF; u++) {
                const int32_t j = tid + u * kExNT;
                cur[u] = j < n ? __ldcg(s + j) : 0.0f;
            }
            for (int32_t j0 = tid; j0 < n; j0 += PF * kExNT) {
#pragma unroll
                for (int u = 0; u < PF; u++) {
                    const int32_t j = j0 + (PF + u) * kExNT;
                    nxt[u] = j < n ? __ldcg(s + j) : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < PF; u++) P = SKV_ADD(P, cur[u]);
#pragma unroll
                for (int u = 0; u < PF; u++) cur[u] = nxt[u];
            }
            part[tid] = P;
            const float v = canon_tree(part, tid);
            if (tid == 0) {
                Z[row] = v;
                cnt[row] = 0;
            }
            __syncthreads(); /* part and last are reused by the next (b, qh) */
        }
    pdl_trigger();
}

/* ---- decode selection: step 3, top-S per tile, merge, chunk-cache plan ------------------------ */

constexpr int kSeNT = 512;               /* threads per tile block */
constexpr int kSePer = 8;                /* candidates per thread */
constexpr int kSeTile = kSeNT * kSePer;  /* candidates per tile */

struct SelectArgs {
    skv_cuda_shape sh;
    const skv_cuda_seq *seqs;
    const float *e, *Z;                 /* [B, Hq, cand_max], [B, Hq] */
    float *amax;                        /* [B, Hk, cand_max] or NULL */
    unsigned long long *pool;           /* [B, Hk, pool_cap] */
    int32_t pool_cap;
    unsigned *cnt;                      /* [B, Hk] */
    int32_t *sel_idx, *sel_ids;         /* [B, Hk, S] */
    int32_t *vsrc, *mlist, *mcount;     /* host slots */
    const int32_t *step_bad;            /* NULL: op-level (no chunk caches) */
    unsigned long long *vc_counts;
    /* the fused kernel: scores turned into e in place, the max accumulators */
    float *s;
    const unsigned *macc;
    const float *s0;
};

template <int NT>
struct SelectSmemT {
    TopkSmem<NT> tk;
    uint32_t *keys; /* the keys of a tile, dynamic shared memory */
    int32_t hits[NT / 32];
    int last;
};
using SelectSmem = SelectSmemT<kSeNT>;
/* Keys in shared memory at key_slot(i): one pad word per 32 keys, so that both the strided
   reads of the radix passes and the contiguous runs of the ordered compaction are free of
   bank conflicts. */
__device__ __forceinline__ int32_t key_slot(int32_t i) { return i + (i >> 5); }
constexpr size_t kSeKeyBytes = (size_t)(kSeTile + kSeTile / 32) * sizeof(uint32_t);

/*
 * Final selection of (b, h) is in a.sel_idx: its chunk ids, and for a host slot the chunk
 * cache's rule (lib/skv_plan.h): hits stamp their entries; the n_miss least recently used
 * unpinned entries (block top-k: key ~(stamp + 1), pinned 0; ties to the lower entry) are
 * taken by the misses in increasing position order. On a bad step nothing of the cache
 * changes (the step's values are never read back). The state update touches disjoint words:
 * an evicted candidate is cached, a missed one is not.
 */
template <int NT>
__device__ void select_finish(const SelectArgs &a, int32_t b, int32_t h, SelectSmemT<NT> &sm)
{
    const skv_cuda_shape &sh = a.sh;
    const int32_t S = sh.S, n = a.seqs[b].n_cand;
    const int64_t bh = (int64_t)b * sh.Hk + h;
    int32_t *sel = a.sel_idx + bh * S;
    const int32_t *cids = a.seqs[b].cand_ids;
    if (a.sel_ids && cids)
        for (int32_t s = threadIdx.x; s < S; s += NT) a.sel_ids[bh * S + s] = cids[(int64_t)h * n + sel[s]];
    const skv_cuda_seq &sq = a.seqs[b];
    if (!a.step_bad) return; /* op-level: no cache state */
    const int bad = *a.step_bad != 0;
    if (!bad) /* a good step publishes its selection (a bad one keeps the last) */
        for (int32_t s = threadIdx.x; s < S; s += NT) {
            sq.pub_sel_idx[(int64_t)h * S + s] = sel[s];
            if (a.sel_ids && cids) sq.pub_sel_ids[(int64_t)h * S + s] = a.sel_ids[bh * S + s];
        }
    if (!sq.vc_data) return; /* block-uniform */
    const int32_t E = sh.vc_chunks, step = sq.n_gen;
    int32_t *slot_of = sq.vc_slot_of + (int64_t)h * sh.cand_max;
    int32_t *owner = sq.vc_owner + (int64_t)h * E, *stamp = sq.vc_stamp + (int64_t)h * E;
    int32_t *vsrc = a.vsrc + bh * S, *mlist = a.mlist + bh * S;
    /* hits: stamped now (pinned); misses marked */
    int nh = 0;
    for (int32_t s = threadIdx.x; s < S; s += NT) {
        const int32_t e = slot_of[sel[s]];
        if (e >= 0) {
            nh++;
            vsrc[s] = e;
            if (!bad) stamp[e] = step;
        } else {
            vsrc[s] = (int32_t)0x80000000;
        }
    }
    nh = warp_sum_int(nh);
    if ((threadIdx.x & 31) == 0) sm.hits[threadIdx.x >> 5] = nh;
    __syncthreads(); /* stamps and vsrc visible */
    int32_t hits = 0;
    for (int w = 0; w < NT / 32; w++) hits += sm.hits[w];
    const int32_t n_miss = S - hits;
    /* victims into mlist[0..n_miss) in increasing entry order (scratch: positions come next) */
    block_topk<NT, false>(
        E, n_miss,
        [=](int32_t e) { return stamp[e] == step && !bad ? 0u : ~(uint32_t)(stamp[e] + 1); },
        [=](int32_t pos, int32_t e) { mlist[pos] = e; }, [](int32_t, int32_t) {}, sm.tk);
    /* miss ranks: the misses' positions in increasing s, by the same ordered compaction */
    block_topk<NT, false>(
        S, n_miss, [=](int32_t s) { return vsrc[s] < 0 ? 1u : 0u; },
        [=](int32_t pos, int32_t s) {
            const int32_t e = mlist[pos]; /* this thread's own victim: read before it is replaced */
            vsrc[s] = (int32_t)(0x80000000u | (uint32_t)e);
        },
        [](int32_t, int32_t) {}, sm.tk);
    __syncthreads(); /* every victim read */
    for (int32_t s = threadIdx.x; s < S; s += NT) {
        const int32_t v = vsrc[s];
        if (v >= 0) continue;
        const int32_t e = v & 0x7fffffff, m = sel[s];
        if (!bad) {
            const int32_t old = owner[e];
            if (old >= 0) slot_of[old] = -1;
            owner[e] = m;
            slot_of[m] = e;
            stamp[e] = step;
        }
    }
    __syncthreads();
    /* the fetch list: missed positions in increasing order */
    block_topk<NT, false>(
        S, n_miss, [=](int32_t s) { return vsrc[s] < 0 ? 1u : 0u; }, [=](int32_t pos, int32_t s) { mlist[pos] = s; },
        [](int32_t, int32_t) {}, sm.tk);
    if (threadIdx.x == 0) {
        a.mcount[bh] = bad ? 0 : n_miss;
        if (!bad) {
            atomicAdd(&a.vc_counts[0], (unsigned long long)hits);
            atomicAdd(&a.vc_counts[1], (unsigned long long)n_miss);
        }
    }
}

/*
 * grid (X, Hk, B), block (x, h, b): tile x of kSeTile candidates of (b, h).
 *  1. a_j = p of query head 0, then a = p if p > a for g = 1.. in order (ref's loop, NaN
 *     included), p = SKV_DIV(e_j, Z); keys order_desc(skv_select_key(a_j)) in shared memory;
 *  2. the tile's top min(S, count) (block_topk): with one tile they are the selection; else
 *     they go to the pool (key << 32 | j, increasing j within the tile, tiles in order: the pool
 *     is in increasing j) and the last tile block of (b, h) selects the top S of the pool.
 */
__global__ void __launch_bounds__(kSeNT) select_kernel(const SelectArgs a)
{
    __shared__ SelectSmem sm;
    extern __shared__ __align__(16) uint32_t se_keys[];
    if (threadIdx.x == 0) sm.keys = se_keys;
    pdl_wait();
    pdl_trigger(); /* the attention's resident items need nothing of this kernel */
    __syncthreads();
    const skv_cuda_shape &sh = a.sh;
    const int tid = threadIdx.x;
    const int32_t G = sh.Hq / sh.Hk, S = sh.S;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t h = blockIdx.y; h < sh.Hk; h += gridDim.y) {
            const int32_t n = a.seqs[b].n_cand, ntl = (int32_t)ceil_div64(n, kSeTile);
            if ((int32_t)blockIdx.x >= ntl) continue; /* block-uniform */
            const int64_t bh = (int64_t)b * sh.Hk + h, cm = sh.cand_max;
            const int32_t j0 = blockIdx.x * kSeTile, cnt = min(kSeTile, n - j0);
            const float *e0 = a.e + ((int64_t)b * sh.Hq + (int64_t)h * G) * cm;
            const float *Zr = a.Z + (int64_t)b * sh.Hq + (int64_t)h * G;
            /* keys of the tile into shared memory, strided over the threads (coalesced loads, four
               items' worth in flight per thread) */
            float zr[8];
#pragma unroll
            for (int g = 0; g < 8; g++) zr[g] = g < G ? Zr[g] : 1.0f;
#pragma unroll
            for (int it = 0; it < kSePer; it++) {
                const int32_t i = it * kSeNT + tid, j = j0 + i;
                if (i < cnt) {
                    float ev[8];
#pragma unroll
                    for (int g = 0; g < 8; g++) ev[g] = g < G ? e0[g * cm + j] : 0.0f;
                    float av = SKV_DIV(ev[0], zr[0]);
#pragma unroll
                    for (int g = 1; g < 8; g++) {
                        if (g >= G) break;
                        const float p = SKV_DIV(ev[g], zr[g]);
                        if (p > av) av = p;
                    }
                    for (int32_t g = 8; g < G; g++) { /* groups above 8 query heads */
                        const float p = SKV_DIV(e0[g * cm + j], Zr[g]);
                        if (p > av) av = p;
                    }
                    sm.keys[key_slot(i)] = order_desc(skv_select_key(av));
                    if (a.amax) a.amax[bh * cm + j] = av;
                }
            }
            __syncthreads();
            int32_t *sel = a.sel_idx + bh * S;
            unsigned long long *pool = a.pool + bh * a.pool_cap + (int64_t)blockIdx.x * S;
            const int32_t kt = min(S, cnt);
            if (ntl == 1) {
                const uint32_t *keys = sm.keys;
                block_topk<kSeNT, false>(
                    cnt, kt, [=](int32_t i) { return keys[key_slot(i)]; }, [=](int32_t pos, int32_t i) { sel[pos] = j0 + i; },
                    [](int32_t, int32_t) {}, sm.tk);
                __syncthreads(); /* sel complete */
                select_finish(a, b, h, sm);
                continue;
            }
            const uint32_t *keys = sm.keys;
            block_topk<kSeNT, false>(
                cnt, kt, [=](int32_t i) { return keys[key_slot(i)]; },
                [=](int32_t pos, int32_t i) {
                    pool[pos] = ((unsigned long long)keys[key_slot(i)] << 32) | (uint32_t)(j0 + i);
                },
                [](int32_t, int32_t) {}, sm.tk);
            __threadfence();
            __syncthreads();
            if (tid == 0) sm.last = atomicAdd(&a.cnt[bh], 1u) == (unsigned)ntl - 1;
            __syncthreads();
            if (!sm.last) continue; /* block-uniform */
            __threadfence();
            /* the pool: full tiles gave S each (a tile holds at least S... or all its items) */
            const int32_t per_tile = min(S, kSeTile), last_cnt = n - (ntl - 1) * kSeTile;
            const int32_t np = (ntl - 1) * per_tile + min(S, last_cnt);
            const unsigned long long *pl = a.pool + bh * a.pool_cap;
            /* pool index -> entry: tile t's winners start at t * S */
            auto at = [=](int32_t i) {
                const int32_t t = i / per_tile;
                return __ldcg(pl + (int64_t)t * S + (i - t * per_tile));
            };
            if (np <= kSeTile) { /* the pool's keys fit in shared memory (always, up to 2M-token prompts) */
                uint32_t *keys = sm.keys;
                for (int32_t i = tid; i < np; i += kSeNT) keys[key_slot(i)] = (uint32_t)(at(i) >> 32);
                __syncthreads();
                block_topk<kSeNT, false>(
                    np, S, [=](int32_t i) { return keys[key_slot(i)]; },
                    [=](int32_t pos, int32_t i) { sel[pos] = (int32_t)(at(i) & 0xffffffffu); }, [](int32_t, int32_t) {},
                    sm.tk);
            } else {
                block_topk<kSeNT, false>(
                    np, S, [=](int32_t i) { return (uint32_t)(at(i) >> 32); },
                    [=](int32_t pos, int32_t i) { sel[pos] = (int32_t)(at(i) & 0xffffffffu); }, [](int32_t, int32_t) {},
                    sm.tk);
            }
            __syncthreads();
            select_finish(a, b, h, sm);
            if (tid == 0) a.cnt[bh] = 0;
        }
}


/* ---- decode selection, fused: e_j, Z and the top-S of one (b, h) in one CTA ------------------ */

constexpr int kSzNT = 1024;                 /* 4 sets of 256 canonical lanes */
constexpr int32_t kSzMax = 32768;           /* candidates whose keys fit in shared memory */
static_assert(kSzNT == 4 * SKV_CANON_LANES, "a set of threads per query head");

__host__ __device__ constexpr size_t sz_key_bytes(int32_t n) { return ((size_t)n + (size_t)n / 32 + 1) * sizeof(uint32_t); }

/*
 * grid (1, Hk, B), block (h, b) when every sequence has at most kSzMax candidates: steps 2 and 3
 * of the decode for the whole (b, h) in one CTA, with no pool and no second kernel.
 *  1. Query heads of the group four at a time, one set of 256 threads each: lane k of the set
 *     turns s_j into e_j = skv_expf(s_j - M) in place for j = k, k + 256, ... and adds them in
 *     that order (the canonical partial k), then the fixed pairwise tree gives Z (expsum's
 *     arithmetic, the same bits).
 *  2. Keys a_j over all n candidates, then the block top-S (select_kernel's single-tile path)
 *     and select_finish.
 */
__global__ void __launch_bounds__(kSzNT) selz_kernel(const SelectArgs a)
{
    __shared__ SelectSmemT<kSzNT> sm;
    __shared__ float part[4][SKV_CANON_LANES];
    __shared__ float zs[kScMaxGp];
    extern __shared__ __align__(16) uint32_t sz_keys[];
    pdl_wait();
    pdl_trigger(); /* the attention's resident items need nothing of this kernel */
    const skv_cuda_shape &sh = a.sh;
    const int tid = threadIdx.x, set = tid >> 8, k = tid & (SKV_CANON_LANES - 1);
    const int32_t G = sh.Hq / sh.Hk, S = sh.S;
    const int64_t cm = sh.cand_max;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t h = blockIdx.y; h < sh.Hk; h += gridDim.y) {
            const int32_t n = a.seqs[b].n_cand;
            const int64_t bh = (int64_t)b * sh.Hk + h, row0 = (int64_t)b * sh.Hq + (int64_t)h * G;
            for (int32_t g0 = 0; g0 < G; g0 += 4) {
                const int32_t g = g0 + set;
                float P = 0.0f;
                if (g < G) {
                    const int64_t row = row0 + g;
                    float *s = a.s + row * cm;
                    const float first = a.s0[row];
                    const float M = first != first ? first : order_desc_inv(a.macc[row]);
                    int32_t j = k;
                    constexpr int U = 16; /* loads in flight (one L2 round trip per U); the adds stay in order */
                    for (; j + (U - 1) * SKV_CANON_LANES < n; j += U * SKV_CANON_LANES) {
                        float x[U];
#pragma unroll
                        for (int u = 0; u < U; u++) x[u] = s[j + u * SKV_CANON_LANES];
#pragma unroll
                        for (int u = 0; u < U; u++) {
                            const float ev = skv_expf(SKV_SUB(x[u], M));
                            s[j + u * SKV_CANON_LANES] = ev;
                            P = SKV_ADD(P, ev);
                        }
                    }
                    for (; j < n; j += SKV_CANON_LANES) {
                        const float ev = skv_expf(SKV_SUB(s[j], M));
                        s[j] = ev;
                        P = SKV_ADD(P, ev);
                    }
                }
                part[set][k] = P;
                const float v = canon_tree(part[set], k);
                if (k == 0 && g < G) {
                    zs[g] = v;
                    const_cast<float *>(a.Z)[row0 + g] = v; /* Z is the workspace's, written here */
                }
                __syncthreads(); /* part is reused; zs complete after the last round */
            }
            /* keys a_j (select_kernel's arithmetic) into shared memory; up to 4 query heads, 8
               candidates per thread at a time (32 loads in flight) */
            const float *e0 = a.s + row0 * cm;
            int32_t jb = tid;
            if (G <= 4) {
                constexpr int V = 8;
                for (; jb + (V - 1) * kSzNT < n; jb += V * kSzNT) {
                    float ev[V][4];
#pragma unroll
                    for (int u = 0; u < V; u++)
#pragma unroll
                        for (int g = 0; g < 4; g++) ev[u][g] = g < G ? e0[g * cm + jb + u * kSzNT] : 0.0f;
#pragma unroll
                    for (int u = 0; u < V; u++) {
                        const int32_t j = jb + u * kSzNT;
                        float av = SKV_DIV(ev[u][0], zs[0]);
#pragma unroll
                        for (int g = 1; g < 4; g++) {
                            if (g >= G) break;
                            const float p = SKV_DIV(ev[u][g], zs[g]);
                            if (p > av) av = p;
                        }
                        sz_keys[key_slot(j)] = order_desc(skv_select_key(av));
                        if (a.amax) a.amax[bh * cm + j] = av;
                    }
                }
            }
            for (int32_t j = jb; j < n; j += kSzNT) {
                float av = SKV_DIV(e0[j], zs[0]);
                for (int32_t g = 1; g < G; g++) {
                    const float p = SKV_DIV(e0[g * cm + j], zs[g]);
                    if (p > av) av = p;
                }
                sz_keys[key_slot(j)] = order_desc(skv_select_key(av));
                if (a.amax) a.amax[bh * cm + j] = av;
            }
            __syncthreads();
            int32_t *sel = a.sel_idx + bh * S;
            const uint32_t *keys = sz_keys;
            block_topk<kSzNT, false>(
                n, min(S, n), [=](int32_t i) { return keys[key_slot(i)]; }, [=](int32_t pos, int32_t i) { sel[pos] = i; },
                [](int32_t, int32_t) {}, sm.tk);
            __syncthreads(); /* sel complete */
            select_finish(a, b, h, sm);
            __syncthreads(); /* shared memory is reused by the next (b, h) */
        }
}

} /* namespace */

/* ---- launchers ------------------------------------------------------------------------- */

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
static_assert(sizeof(ScoreArgs) <= sizeof(((skv_cuda_score_node *)0)->argbuf), "argbuf holds ScoreArgs");

void skv_cuda_score_node_set_io(skv_cuda_score_node *node, const skv_cuda_io *io)
{
    reinterpret_cast<ScoreArgs *>(node->argbuf.bytes)->io = *io;
    node->args[0] = node->argbuf.bytes;
    node->params.kernelParams = node->args;
}

int32_t skv_cuda_select_tiles(int32_t n) { return (int32_t)ceil_div64(n > 0 ? n : 1, kSeTile); }

int32_t skv_cuda_pool_cap(int32_t cand_max, int32_t S) { return skv_cuda_select_tiles(cand_max) * S; }

template <int GC, int DT, bool MULTI, int GPC>
static cudaError_t launch_score_dt(cudaStream_t st, const ScoreArgs &a, cudaKernelNodeParams *node, void **node_args)
{
    const int32_t G = a.sh.Hq / a.sh.Hk, Gp = (G + GC - 1) / GC * GC;
    const size_t smem = score_smem_bytes(DT, a.sh.D, Gp);
    cudaError_t e = allow_smem(score_kernel<GC, DT, MULTI, GPC>, smem);
    if (e != cudaSuccess) return e;
    static int per_sm_of[kScMaxGp + 1]; /* by Gp: the occupancy query is a host call; ask once */
    int per_sm = per_sm_of[Gp];
    if (!per_sm) {
        if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, score_kernel<GC, DT, MULTI, GPC>, kScNT, smem)) != cudaSuccess)
            return e;
        if (per_sm < 1) return cudaErrorInvalidConfiguration;
        per_sm_of[Gp] = per_sm;
    }
    ScoreArgs b = a;
    const int64_t grid = min(b.total, (int64_t)num_sms() * per_sm);
    b.per = ceil_div64(b.total, grid);
    const unsigned nblk = (unsigned)ceil_div64(b.total, b.per);
    if (node) { /* a graph's kernel node: the caller keeps the arguments */
        *reinterpret_cast<ScoreArgs *>(node_args[0]) = b;
        node->func = (void *)score_kernel<GC, DT, MULTI, GPC>;
        node->gridDim = dim3(nblk);
        node->blockDim = dim3(kScNT);
        node->sharedMemBytes = (unsigned)smem;
        node->kernelParams = node_args;
        node->extra = NULL;
    }
    return launch(score_kernel<GC, DT, MULTI, GPC>, dim3(nblk), dim3(kScNT), smem, st, false, b);
}

template <int GC, bool MULTI>
static cudaError_t launch_score_m(cudaStream_t st, const ScoreArgs &a, bool tiled, cudaKernelNodeParams *node,
                                 void **node_args)
{
    if (!tiled) return launch_score_dt<GC, 0, MULTI, 0>(st, a, node, node_args);
    const bool exact = !MULTI && a.sh.Hq / a.sh.Hk == GC; /* Gp == GC: the q offsets are constants */
    switch (a.sh.D) {
    case 64: return launch_score_dt<GC, 64, MULTI, 0>(st, a, node, node_args);
    case 128:
        if (exact) return launch_score_dt<GC, 128, MULTI, (MULTI ? 0 : GC)>(st, a, node, node_args);
        return launch_score_dt<GC, 128, MULTI, 0>(st, a, node, node_args);
    case 256: return launch_score_dt<GC, 256, MULTI, 0>(st, a, node, node_args);
    default: return launch_score_dt<GC, 0, MULTI, 0>(st, a, node, node_args);
    }
}

/* GC <= 4 covers G in one pass; GC = 8 takes groups above 8 heads in several passes */
template <int GC>
static cudaError_t launch_score(cudaStream_t st, const ScoreArgs &a, bool tiled, cudaKernelNodeParams *node,
                                void **node_args)
{
    if (GC == 8 && a.sh.Hq / a.sh.Hk > 8) return launch_score_m<8, true>(st, a, tiled, node, node_args);
    return launch_score_m<GC, false>(st, a, tiled, node, node_args);
}

cudaError_t skv_cuda_select_step(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                 const skv_cuda_dws *ws, const skv_cuda_io *io, int tiled, int32_t layer, float *amax,
                                 skv_cuda_score_node *graph, int *launches, cudaEvent_t scored)
{
    if (sh->B <= 0 || sh->Hk <= 0 || sh->cand_max <= 0) return cudaSuccess;
    const int32_t G = sh->Hq / sh->Hk;
    if ((G + 7) / 8 * 8 > kScMaxGp) return cudaErrorInvalidValue; /* the cache and the op refuse such shapes */
    ScoreArgs sa;
    memset(&sa, 0, sizeof sa);
    sa.sh = *sh;
    sa.seqs = seqs;
    sa.io = *io;
    sa.io_dev = io->k ? ws->io : NULL;
    sa.scores = ws->scores;
    sa.macc = ws->macc;
    sa.s0 = ws->s0;
    sa.step_bad = ws->step_bad;
    sa.first_bad = ws->first_bad;
    sa.layer = layer;
    sa.ntiles = (int32_t)ceil_div64(sh->cand_max, kScRows);
    sa.total = (int64_t)sh->B * sh->Hk * sa.ntiles;
    /* the tiled path needs 16-byte aligned landmark rows: the cache's always are; op-level
       callers' pointers are checked by the caller (tiled = 0 otherwise) */
    cudaKernelNodeParams *node = graph ? &graph->params : NULL;
    void **args = graph ? graph->args : NULL;
    if (graph) graph->args[0] = graph->argbuf.bytes;
    /* GC: the smallest chunk of query heads covering G (at most 8 chains per thread) */
    cudaError_t e = G <= 1 ? launch_score<1>(st, sa, tiled, node, args)
                    : G == 2 ? launch_score<2>(st, sa, tiled, node, args)
                    : G <= 4 ? launch_score<4>(st, sa, tiled, node, args)
                             : launch_score<8>(st, sa, tiled, node, args);
    if (e == cudaSuccess && scored) e = cudaEventRecord(scored, st);
    if (e != cudaSuccess) return e;
    SelectArgs a;
    memset(&a, 0, sizeof a);
    a.sh = *sh;
    a.seqs = seqs;
    a.e = ws->scores;
    a.Z = ws->Z;
    a.amax = amax;
    a.pool = ws->pool;
    a.pool_cap = ws->pool_cap;
    a.cnt = ws->cnt_sel;
    a.sel_idx = ws->sel_idx;
    a.sel_ids = ws->sel_ids;
    a.vsrc = ws->vsrc;
    a.mlist = ws->mlist;
    a.mcount = ws->mcount;
    a.step_bad = io->k ? ws->step_bad : NULL;
    a.vc_counts = ws->vc_counts;
    a.s = ws->scores;
    a.macc = (const unsigned *)ws->macc;
    a.s0 = (const float *)ws->s0;
    /* one CTA per (b, h) computes e, Z and the selection together when there are enough pairs
       to fill a good part of the GPU, or few candidates (one select tile); a few pairs over many
       candidates leave the long chains of one CTA exposed and take the split path */
    if (sh->cand_max <= kSzMax && ((int64_t)sh->B * sh->Hk * 3 >= num_sms() || sh->cand_max <= kSeTile)) {
        const size_t smem = sz_key_bytes(sh->cand_max);
        if ((e = allow_smem(selz_kernel, smem)) != cudaSuccess) return e;
        e = launch(selz_kernel, dim3(1, clamp_yz(sh->Hk), clamp_yz(sh->B)), dim3(kSzNT), smem, st, true, a);
        if (launches) *launches += 2;
        return e;
    }
    e = launch(expsum_kernel, dim3((unsigned)ceil_div64(sh->cand_max, kExTile), clamp_yz(sh->Hq), clamp_yz(sh->B)),
               dim3(kExNT), 0, st, true, *sh, seqs, ws->scores, (const unsigned *)ws->macc, (const float *)ws->s0,
               ws->Z, ws->cnt_e);
    if (e != cudaSuccess) return e;
    if ((e = allow_smem(select_kernel, kSeKeyBytes)) != cudaSuccess) return e;
    e = launch(select_kernel, dim3((unsigned)skv_cuda_select_tiles(sh->cand_max), clamp_yz(sh->Hk), clamp_yz(sh->B)),
               dim3(kSeNT), kSeKeyBytes, st, true, a);
    if (launches) *launches += 3;
    return e;
}
