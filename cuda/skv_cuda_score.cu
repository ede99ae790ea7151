/*
 * skv_cuda_score.cu - step 1 of a decode's selection (skv_cuda_score): the landmark
 * score s_j of every candidate for every query head, the max of each query head, s_0,
 * and (at decode) the step's input check and the publication of its tensors for the
 * later steps (skv_cuda.h lists the steps).
 *
 * Reached through skv_cuda_select_step (skv_cuda_select.cu), which runs steps 1-3:
 * from the op-level slot score_select (skv_cuda_score_select_op, skv_cuda_ops.cu) and
 * from every decode step of the cache (skv_cuda_enqueue_step, skv_cuda_cache.cu); a
 * captured step's score node is updated for a replay by skv_cuda_score_node_set_io
 * (skv_cuda_cache_decode). On the decision path: built with --fmad=false; each dot
 * chain is run by one thread in lib/skv_numerics.h's order.
 *
 * The launcher only enqueues work; it never allocates or synchronizes.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_cuda_exact.cuh"
#include "skv_cuda_topk.cuh"
#include "skv_numerics.h"

namespace {

/* ---- decode selection: step 1, scores ------------------------------------------------------ */

constexpr int kScNT = 128;          /* threads per block */
constexpr int kScRows = kScNT;      /* candidates per tile: one row per thread */

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
            /* an idle row (skv_cuda_seq.idle): no candidates, and nothing of its q, k, v is read */
            const bool live = !a.seqs[b].idle;
            const uint16_t *qg = q + ((int64_t)b * sh.Hq + (int64_t)h * G) * D;
            for (int32_t e = tid; e < Gp * D; e += kScNT) {
                const int32_t d = e / Gp, g = e - d * Gp;
                qT[e] = g < G && live ? skv_bf16_to_f32(qg[(int64_t)g * D + d]) : 0.0f;
            }
#pragma unroll
            for (int pi = 0; pi < NPASS; pi++)
#pragma unroll
                for (int g = 0; g < GC; g++) mx[pi][g] = -INFINITY;
            if (a.io.k && live && t == pair * a.ntiles) { /* the step's inputs of this (b, h) are finite */
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

} /* namespace */

/* ---- launchers ------------------------------------------------------------------------- */

static_assert(sizeof(ScoreArgs) <= sizeof(((skv_cuda_score_node *)0)->argbuf), "argbuf holds ScoreArgs");

void skv_cuda_score_node_set_io(skv_cuda_score_node *node, const skv_cuda_io *io)
{
    reinterpret_cast<ScoreArgs *>(node->argbuf.bytes)->io = *io;
    node->args[0] = node->argbuf.bytes;
    node->params.kernelParams = node->args;
}

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

cudaError_t skv_cuda_score(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                           const skv_cuda_dws *ws, const skv_cuda_io *io, int tiled, int32_t layer,
                           skv_cuda_score_node *graph)
{
    const int32_t G = sh->Hq / sh->Hk;
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
    return e;
}
