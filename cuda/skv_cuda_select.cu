/*
 * skv_cuda_select.cu - the decision path of the cuda backend: RoPE, landmarks
 * and outlier scores, candidate scores, the selection softmax and top-k.
 *
 * Every value a decision depends on is computed with the functions of
 * lib/skv_numerics.h or with the exact sequence of IEEE-rounded operations
 * they perform (SKV_* map to __f*_rn intrinsics here, and the file is built
 * with --fmad=false), so outlier sets, candidate lists, landmarks and selected
 * sets are bit-identical to ref (DESIGN.md section 5). Parallelism never
 * splits an ordered chain: a dot product, a landmark sum or a canonical
 * partial sum is always run by one thread in ref's order; only independent
 * chains, and order-insensitive combinations (max, min with explicit
 * tie-breaks, counts), run in parallel.
 *
 * Launchers only enqueue work; they never allocate or synchronize.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include <cub/block/block_scan.cuh>

#include "skv_cuda.h"
#include "skv_numerics.h"

namespace {

constexpr unsigned kFullMask = 0xffffffffu;

/* Grid dimensions y and z are limited to 65535: kernels that put heads or
   sequences there loop over them with this stride. */
constexpr int32_t kMaxGridYZ = 65535;

/* Cap on 1D grids of grid-stride kernels (each block then loops). */
constexpr int64_t kMaxGridX = 1 << 20;

int32_t clamp_yz(int32_t n) { return n < kMaxGridYZ ? n : kMaxGridYZ; }

unsigned grid_for(int64_t items, int64_t per_block)
{
    int64_t g = (items + per_block - 1) / per_block;
    return (unsigned)(g < kMaxGridX ? g : kMaxGridX);
}

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

/* ---- order keys ------------------------------------------------------------------------ */

/*
 * 32-bit order-preserving image of a (non-NaN) float key: larger key -> larger value.
 * -0 and +0 compare equal in ref's order, so -0 is made +0 first; NaN never reaches
 * here (skv_select_key / skv_outlier_key map it to -1 / -3).
 */
__device__ __forceinline__ uint32_t order_desc(float key)
{
    uint32_t u = skv_bits_from_f32(key);
    if (u == 0x80000000u) u = 0;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Lower key is better (outliers): the complement turns it into "larger is better". */
__device__ __forceinline__ uint32_t order_asc(float key) { return ~order_desc(key); }

/* ---- block-wide top-k ----------------------------------------------------------------- */

template <int BLOCK>
struct TopkSmem {
    typename cub::BlockScan<uint32_t, BLOCK>::TempStorage scan;
    uint32_t hist[256];
    uint32_t bin;  /* digit chosen by the current radix pass */
    uint32_t need; /* rank still wanted inside that digit's bucket */
};

/*
 * The k best of n items under the strict total order "larger key(i) first, then lower i"
 * (key(i) a uint32 order image, see order_desc/order_asc), called by all BLOCK threads.
 * on_win(pos, i) is called for each winner with pos = its rank among the winners in
 * increasing i (0..k-1); if LOSERS, on_lose(pos, i) for each other item likewise
 * (0..n-k-1). Requires 0 <= k <= n < 2^31 - BLOCK. Keys are re-read on every pass (they
 * live in global memory; n may be 10^5 and more), so key() must be deterministic.
 *
 * 1. Radix select, four 8-bit passes from the top: each pass histograms the digit of the
 *    items that match the threshold prefix found so far and picks the bucket holding the
 *    need-th best. After the last pass the prefix is the k-th best key T itself, and need
 *    is how many items equal to T are winners.
 * 2. Ordered compaction: winners are the items with key > T plus the first `need` items
 *    with key == T (the order breaks ties by lower index). Counting both kinds with one
 *    block scan per tile gives each item's exact output position: winners before i =
 *    gt_before(i) + min(eq_before(i), need), losers before i = i - winners before i.
 */
template <int BLOCK, bool LOSERS, class KeyFn, class WinFn, class LoseFn>
__device__ void block_topk(int32_t n, int32_t k, KeyFn key, WinFn on_win, LoseFn on_lose,
                           TopkSmem<BLOCK> &sm)
{
    static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "per-tile counts are packed in 16 bits");
    const int tid = threadIdx.x, lane = tid & 31;

    uint32_t prefix = 0, mask = 0, need = (uint32_t)k;
    if (k <= 0) {
        /* nothing wins: no key is > 0xffffffff and min(eq_before, 0) = 0 */
        prefix = 0xffffffffu;
        need = 0;
    } else {
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += BLOCK) sm.hist[b] = 0;
            __syncthreads();
            for (int32_t base = 0; base < n; base += BLOCK) { /* uniform trip count: warp ops below */
                int32_t i = base + tid;
                uint32_t u = 0;
                bool hit = false;
                if (i < n) {
                    u = key(i);
                    hit = (u & mask) == prefix;
                }
                uint32_t digit = (u >> shift) & 0xffu;
                uint32_t hits = __ballot_sync(kFullMask, hit);
                if (hit) { /* one atomic per distinct digit per warp: keys cluster heavily */
                    uint32_t peers = __match_any_sync(hits, digit);
                    if (lane == __ffs(peers) - 1) atomicAdd(&sm.hist[digit], (uint32_t)__popc(peers));
                }
            }
            __syncthreads();
            if (tid < 32) {
                /* lane l owns buckets 255-8l .. 248-8l (best first); a warp scan finds the
                   lane whose buckets hold the need-th best, that lane finds the bucket */
                uint32_t cnt[8], sum = 0;
#pragma unroll
                for (int m = 0; m < 8; m++) {
                    cnt[m] = sm.hist[255 - 8 * lane - m];
                    sum += cnt[m];
                }
                uint32_t incl = sum;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    uint32_t v = __shfl_up_sync(kFullMask, incl, o);
                    if (lane >= o) incl += v;
                }
                uint32_t cum = incl - sum;
                if (cum < need && need <= incl) {
                    bool found = false;
#pragma unroll
                    for (int m = 0; m < 8; m++) {
                        if (!found && cum + cnt[m] >= need) {
                            sm.bin = (uint32_t)(255 - 8 * lane - m);
                            sm.need = need - cum;
                            found = true;
                        }
                        cum += cnt[m];
                    }
                }
            }
            __syncthreads();
            prefix |= sm.bin << shift;
            mask |= 0xffu << shift;
            need = sm.need;
            /* sm.bin/need are rewritten only after two more barriers: no race */
        }
    }

    const uint32_t T = prefix;
    using Scan = cub::BlockScan<uint32_t, BLOCK>;
    uint32_t gt_run = 0, eq_run = 0; /* items of earlier tiles with key > T, == T */
    for (int32_t base = 0; base < n; base += BLOCK) {
        int32_t i = base + tid;
        uint32_t gt = 0, eq = 0;
        if (i < n) {
            uint32_t u = key(i);
            gt = u > T;
            eq = u == T;
        }
        uint32_t excl, total;
        Scan(sm.scan).ExclusiveSum(gt | (eq << 16), excl, total);
        uint32_t gt_before = gt_run + (excl & 0xffffu), eq_before = eq_run + (excl >> 16);
        uint32_t win_before = gt_before + min(eq_before, need);
        if (i < n) {
            if (gt || (eq && eq_before < need)) on_win((int32_t)win_before, i);
            else if (LOSERS) on_lose((int32_t)((uint32_t)i - win_before), i);
        }
        gt_run += total & 0xffffu;
        eq_run += total >> 16;
        __syncthreads(); /* scan storage is reused by the next tile */
        if (!LOSERS && gt_run + min(eq_run, need) >= (uint32_t)k) break; /* uniform */
    }
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

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* ---- scores ---------------------------------------------------------------------------- */

constexpr int kScoreBlock = 128; /* threads per block = landmark rows per tile */

/* acc[g] = fmaf chain of q_g . row over d = 0..D-1 (skv_dot_bf16's order: fma(q, l, acc));
   the GC chains are independent and share each landmark load. */
template <int GC, int V>
__device__ __forceinline__ void score_chains(const uint16_t *row, const float *qs, int32_t D, float (&acc)[GC])
{
#pragma unroll 2
    for (int32_t d = 0; d < D; d += V) {
        float x[V];
        load_bf16<V>(row + d, x);
#pragma unroll
        for (int i = 0; i < V; i++)
#pragma unroll
            for (int g = 0; g < GC; g++) acc[g] = SKV_FMA(qs[g * D + d + i], x[i], acc[g]);
    }
}

/* Byte stride of a landmark row in the shared tile: D bf16 plus 16 bytes of padding, so that
   the 16-byte reads of 8 consecutive rows (one shared-memory wavefront) hit distinct banks
   when D % 16 == 0. */
__host__ __device__ __forceinline__ int32_t tile_stride(int32_t D) { return 2 * D + 16; }

/* Dynamic shared memory of skv_score_kernel<GC>: q rows as float, then the landmark tile. */
size_t score_smem_bytes(int GC, int32_t D)
{
    return (size_t)GC * D * sizeof(float) + (size_t)kScoreBlock * tile_stride(D);
}

/*
 * grid (candidate tiles, Hk, B); one thread per candidate j computes the scores of the G
 * query heads of KV head h, GC at a time (q rows of the chunk in shared memory as float;
 * rows past G are zero and their scores are not written).
 *
 * Rows that are 16-byte aligned (D % 8 == 0) are first copied tile-wide into shared memory
 * with coalesced 16-byte loads, 8 independent loads per thread in flight (a thread reading
 * its own 2D-byte row from global memory would use half of each 32-byte sector per load and
 * serialize its loads); then each thread runs its dot chains from the tile, exactly as
 * before (one thread, d in order). Other alignments read the rows directly.
 */
template <int GC>
__global__ void __launch_bounds__(kScoreBlock)
    skv_score_kernel(skv_cuda_shape sh, const skv_cuda_seq *seqs, const uint16_t *__restrict__ q,
                     float *__restrict__ scores)
{
    extern __shared__ __align__(16) float qs[]; /* [GC, D] floats, then the tile */
    const int32_t D = sh.D, G = sh.Hq / sh.Hk;
    unsigned char *tile = reinterpret_cast<unsigned char *>(qs + GC * D);
    const int32_t tstride = tile_stride(D);
    const int tid = threadIdx.x;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t h = blockIdx.y; h < sh.Hk; h += gridDim.y) {
            const int32_t n = seqs[b].n_cand;
            const int32_t j0 = blockIdx.x * kScoreBlock, j = j0 + tid;
            if (j0 >= n) continue; /* block-uniform */
            const uint16_t *L = seqs[b].landmarks + (int64_t)h * n * D;
            const int vec = row_vec(L, D);
            const int32_t rows = min(kScoreBlock, n - j0);

            __syncthreads(); /* previous users of qs and the tile are done */
            if (vec == 8) {
                const int32_t upr = D / 8, units = rows * upr; /* 16-byte units of the tile */
                const uint4 *src = reinterpret_cast<const uint4 *>(L + (int64_t)j0 * D);
                int32_t u = tid;
                for (; u + 7 * kScoreBlock < units; u += 8 * kScoreBlock) {
                    uint4 w[8];
#pragma unroll
                    for (int i = 0; i < 8; i++) w[i] = src[u + i * kScoreBlock];
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        const int32_t v = u + i * kScoreBlock;
                        *reinterpret_cast<uint4 *>(tile + (v / upr) * tstride + (v % upr) * 16) = w[i];
                    }
                }
                for (; u < units; u += kScoreBlock)
                    *reinterpret_cast<uint4 *>(tile + (u / upr) * tstride + (u % upr) * 16) = src[u];
            }
            for (int32_t g0 = 0; g0 < G; g0 += GC) {
                if (g0 > 0) __syncthreads(); /* previous users of qs are done */
                for (int32_t e = tid; e < GC * D; e += kScoreBlock) {
                    int32_t g = g0 + e / D;
                    qs[e] = g < G ? skv_bf16_to_f32(q[((int64_t)b * sh.Hq + (int64_t)h * G + g) * D + e % D]) : 0.0f;
                }
                __syncthreads(); /* qs and the tile complete */
                if (j >= n) continue;
                float acc[GC];
#pragma unroll
                for (int g = 0; g < GC; g++) acc[g] = 0.0f;
                if (vec == 8) score_chains<GC, 8>(reinterpret_cast<const uint16_t *>(tile + tid * tstride), qs, D, acc);
                else if (vec == 2) score_chains<GC, 2>(L + (int64_t)j * D, qs, D, acc);
                else score_chains<GC, 1>(L + (int64_t)j * D, qs, D, acc);
#pragma unroll
                for (int g = 0; g < GC; g++)
                    if (g0 + g < G)
                        scores[((int64_t)b * sh.Hq + (int64_t)h * G + g0 + g) * sh.cand_max + j] =
                            SKV_MUL(acc[g], sh.scale);
            }
        }
}

/* ---- selection ------------------------------------------------------------------------- */

constexpr int kLanes = SKV_CANON_LANES;       /* 256 */
constexpr int kSmxBlock = 1024;               /* threads per (b, query head) softmax */
constexpr int kSmxTile = 4 * kSmxBlock;       /* e_j staged per canonical-sum step */
constexpr int kSelBlock = 1024;               /* threads per (b, kv head) top-k */
constexpr int32_t kSmemKeysMax = 40 * 1024;   /* top-k keys kept in shared memory up to this n */
static_assert(kLanes == 256 && kSmxBlock % kLanes == 0 && kSmxTile % kLanes == 0,
              "the canonical sum has 256 lanes");

/*
 * Selection softmax, grid (Hq, B), one block per (b, query head), in place over the scores
 * row s[0..n) (ref's skv_softmax_inplace):
 *  1. M: ref's scan gives s[0] if it is NaN, else the max of the non-NaN values (the sign
 *     of a zero max changes no e_j), so any reduction order of "x > m" serves;
 *  2. Z = canonical sum of e_j = skv_expf(s_j - M): all threads compute e_j of a tile of
 *     kSmxTile consecutive j into shared memory, then lane k < 256 adds the tile's
 *     j = k, k+256, ... in order to its partial (the tiles start at multiples of 256, so
 *     lane k's chain is ref's partial k, in ref's order); then the fixed tree (shared
 *     memory for w >= 32, shuffles below: same pairs);
 *  3. s_j = e_j / Z with e_j recomputed (deterministic).
 * Loads are issued in batches of independent values so that their latencies overlap.
 */
__global__ void __launch_bounds__(kSmxBlock)
    skv_softmax_kernel(skv_cuda_shape sh, const skv_cuda_seq *seqs, float *scores)
{
    __shared__ float E[kSmxTile];
    __shared__ float part[kLanes];
    __shared__ float wmax[kSmxBlock / 32];
    __shared__ float Zs;
    const int tid = threadIdx.x, lane = tid & 31;

    for (int32_t b = blockIdx.y; b < sh.B; b += gridDim.y)
        for (int32_t qh = blockIdx.x; qh < sh.Hq; qh += gridDim.x) {
            const int32_t n = seqs[b].n_cand;
            if (n <= 0) continue; /* block-uniform */
            float *s = scores + ((int64_t)b * sh.Hq + qh) * sh.cand_max;

            float m = -INFINITY; /* max of non-NaN values: NaN never compares greater */
            int32_t j = tid;
            for (; j + 7 * kSmxBlock < n; j += 8 * kSmxBlock) {
                float x[8];
#pragma unroll
                for (int u = 0; u < 8; u++) x[u] = s[j + u * kSmxBlock];
#pragma unroll
                for (int u = 0; u < 8; u++)
                    if (x[u] > m) m = x[u];
            }
            for (; j < n; j += kSmxBlock) {
                float x = s[j];
                if (x > m) m = x;
            }
#pragma unroll
            for (int o = 16; o >= 1; o >>= 1) {
                float y = __shfl_xor_sync(kFullMask, m, o);
                if (y > m) m = y;
            }
            if (lane == 0) wmax[tid / 32] = m;
            __syncthreads();
            m = wmax[0];
            for (int w = 1; w < kSmxBlock / 32; w++) {
                float y = wmax[w];
                if (y > m) m = y;
            }
            const float s0 = s[0];
            const float M = s0 != s0 ? s0 : m;

            float P = 0.0f;
            for (int32_t base = 0; base < n; base += kSmxTile) {
                float x[kSmxTile / kSmxBlock];
#pragma unroll
                for (int u = 0; u < kSmxTile / kSmxBlock; u++) {
                    const int32_t jj = base + u * kSmxBlock + tid;
                    x[u] = jj < n ? s[jj] : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < kSmxTile / kSmxBlock; u++)
                    if (base + u * kSmxBlock + tid < n) E[u * kSmxBlock + tid] = skv_expf(SKV_SUB(x[u], M));
                __syncthreads();
                if (tid < kLanes) {
                    const int32_t cnt = min(kSmxTile, n - base);
#pragma unroll 4
                    for (int32_t i = tid; i < cnt; i += kLanes) P = SKV_ADD(P, E[i]);
                }
                __syncthreads(); /* E is rewritten by the next tile */
            }
            if (tid < kLanes) part[tid] = P;
            __syncthreads();
            for (int w = kLanes / 2; w >= 32; w >>= 1) {
                if (tid < w) part[tid] = SKV_ADD(part[tid], part[tid + w]);
                __syncthreads();
            }
            if (tid < 32) { /* the first warp, whole */
                float v = part[tid];
#pragma unroll
                for (int w = 16; w >= 1; w >>= 1) {
                    float o = __shfl_down_sync(kFullMask, v, w);
                    v = SKV_ADD(v, o); /* lanes k < w: P[k] + P[k+w] */
                }
                if (tid == 0) Zs = v;
            }
            __syncthreads();
            const float Z = Zs;

            j = tid;
            for (; j + 7 * kSmxBlock < n; j += 8 * kSmxBlock) {
                float x[8];
#pragma unroll
                for (int u = 0; u < 8; u++) x[u] = s[j + u * kSmxBlock];
#pragma unroll
                for (int u = 0; u < 8; u++) s[j + u * kSmxBlock] = SKV_DIV(skv_expf(SKV_SUB(x[u], M)), Z);
            }
            for (; j < n; j += kSmxBlock) s[j] = SKV_DIV(skv_expf(SKV_SUB(s[j], M)), Z);
            __syncthreads(); /* wmax, part, Zs are reused by the next (b, query head) */
        }
}

/*
 * grid (Hk, B), one block per (b, h), after skv_softmax_kernel left p in the scores rows of
 * the G query heads g of KV head h (query head h*G + g):
 *  1. a_j = p of g = 0, then a = p if p > a for g = 1.. in order (ref's loop, NaN included),
 *     stored in amax; with SMEM, the top-k keys order_desc(skv_select_key(a_j)) are also
 *     kept in dynamic shared memory (n <= kSmemKeysMax), else the top-k re-reads amax;
 *  2. top-S of skv_select_key(a_j) (desc, ties to lower j), increasing j.
 */
template <bool SMEM>
__global__ void __launch_bounds__(kSelBlock)
    skv_select_kernel(skv_cuda_shape sh, const skv_cuda_seq *seqs, const float *__restrict__ p,
                      float *__restrict__ amax, int32_t *sel_idx, int32_t *sel_ids)
{
    __shared__ TopkSmem<kSelBlock> sm;
    extern __shared__ uint32_t keys_s[]; /* [n] with SMEM */

    const int tid = threadIdx.x;
    const int32_t G = sh.Hq / sh.Hk, S = sh.S;
    const int32_t h = blockIdx.x;
    const int64_t cm = sh.cand_max;

    for (int32_t b = blockIdx.y; b < sh.B; b += gridDim.y) {
        const int32_t n = seqs[b].n_cand;
        const float *prow = p + ((int64_t)b * sh.Hq + (int64_t)h * G) * cm;
        float *a = amax + ((int64_t)b * sh.Hk + h) * cm;

        constexpr int U = 8; /* independent loads in flight per thread and query head */
        int32_t j = tid;
        for (; j + (U - 1) * kSelBlock < n; j += U * kSelBlock) {
            float av[U];
#pragma unroll
            for (int u = 0; u < U; u++) av[u] = prow[j + u * kSelBlock];
            for (int32_t g = 1; g < G; g++) {
                float pv[U];
#pragma unroll
                for (int u = 0; u < U; u++) pv[u] = prow[g * cm + j + u * kSelBlock];
#pragma unroll
                for (int u = 0; u < U; u++)
                    if (pv[u] > av[u]) av[u] = pv[u];
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                a[j + u * kSelBlock] = av[u];
                if (SMEM) keys_s[j + u * kSelBlock] = order_desc(skv_select_key(av[u]));
            }
        }
        for (; j < n; j += kSelBlock) {
            float aj = prow[j];
            for (int32_t g = 1; g < G; g++) {
                float pv = prow[g * cm + j];
                if (pv > aj) aj = pv;
            }
            a[j] = aj;
            if (SMEM) keys_s[j] = order_desc(skv_select_key(aj));
        }
        __syncthreads(); /* a[] and keys_s visible to the block */

        int32_t *out_idx = sel_idx + ((int64_t)b * sh.Hk + h) * S;
        const int32_t *cids = seqs[b].cand_ids;
        int32_t *out_ids = (sel_ids && cids) ? sel_ids + ((int64_t)b * sh.Hk + h) * S : nullptr;
        const int32_t *ch = cids ? cids + (int64_t)h * n : nullptr;
        auto on_win = [=](int32_t pos, int32_t i) {
            out_idx[pos] = i;
            if (out_ids) out_ids[pos] = ch[i];
        };
        if (SMEM)
            block_topk<kSelBlock, false>(
                n, S, [=](int32_t i) { return keys_s[i]; }, on_win, [](int32_t, int32_t) {}, sm);
        else
            block_topk<kSelBlock, false>(
                n, S, [=](int32_t i) { return order_desc(skv_select_key(a[i])); }, on_win,
                [](int32_t, int32_t) {}, sm);
        __syncthreads();
    }
}

/* ---- launchers ------------------------------------------------------------------------- */
template <int GC>
cudaError_t launch_score(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs, const skv_bf16 *q,
                         float *scores, dim3 grid)
{
    const size_t smem = score_smem_bytes(GC, sh->D);
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(skv_score_kernel<GC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)smem);
        if (e != cudaSuccess) return e;
    }
    skv_score_kernel<GC><<<grid, kScoreBlock, smem, st>>>(*sh, seqs, q, scores);
    return cudaGetLastError();
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


cudaError_t skv_cuda_score(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                           const skv_bf16 *q, float *scores)
{
    if (sh->B <= 0 || sh->Hk <= 0 || sh->cand_max <= 0) return cudaSuccess;
    const int32_t G = sh->Hq / sh->Hk;
    const dim3 grid((unsigned)((sh->cand_max + kScoreBlock - 1) / kScoreBlock), clamp_yz(sh->Hk), clamp_yz(sh->B));
    /* GC: the smallest chunk of query heads covering G (at most 8 chains per thread) */
    if (G <= 1) return launch_score<1>(st, sh, seqs, q, scores, grid);
    if (G == 2) return launch_score<2>(st, sh, seqs, q, scores, grid);
    if (G <= 4) return launch_score<4>(st, sh, seqs, q, scores, grid);
    return launch_score<8>(st, sh, seqs, q, scores, grid);
}

/* Two launches: the selection softmax per (b, query head), in place over scores (lib never
   reads scores after select: they are scratch of score + select), then group max and top-k
   per (b, kv head). amax is required (lib always passes a buffer): it holds a_j on return,
   and is the top-k key store when cand_max > kSmemKeysMax. */
cudaError_t skv_cuda_select(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                            float *scores, float *amax, int32_t *sel_idx, int32_t *sel_ids)
{
    if (sh->B <= 0 || sh->Hk <= 0) return cudaSuccess;
    if (!amax) return cudaErrorInvalidValue;
    float *p = scores; /* scratch: overwritten with the probabilities */
    skv_softmax_kernel<<<dim3((unsigned)clamp_yz(sh->Hq), clamp_yz(sh->B)), kSmxBlock, 0, st>>>(*sh, seqs, p);
    const dim3 grid((unsigned)sh->Hk, clamp_yz(sh->B));
    if (sh->cand_max <= kSmemKeysMax) {
        const size_t smem = (size_t)sh->cand_max * sizeof(uint32_t);
        if (smem > 48 * 1024) {
            cudaError_t e = cudaFuncSetAttribute(skv_select_kernel<true>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
            if (e != cudaSuccess) return e;
        }
        skv_select_kernel<true><<<grid, kSelBlock, smem, st>>>(*sh, seqs, p, amax, sel_idx, sel_ids);
    } else {
        skv_select_kernel<false><<<grid, kSelBlock, 0, st>>>(*sh, seqs, p, amax, sel_idx, sel_ids);
    }
    return cudaGetLastError();
}
