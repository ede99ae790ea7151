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

constexpr int kScoreBlock = 128;

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

/*
 * grid (candidate tiles, Hk, B); one thread per candidate j computes the scores of the
 * G query heads of KV head h, GC at a time (q rows of the chunk in shared memory as
 * float; rows past G are zero and their scores are not written).
 */
template <int GC>
__global__ void __launch_bounds__(kScoreBlock)
    skv_score_kernel(skv_cuda_shape sh, const skv_cuda_seq *seqs, const uint16_t *q, float *scores)
{
    extern __shared__ float qs[]; /* [GC, D] */
    const int32_t D = sh.D, G = sh.Hq / sh.Hk;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t h = blockIdx.y; h < sh.Hk; h += gridDim.y) {
            const int32_t n = seqs[b].n_cand;
            const int32_t j = blockIdx.x * kScoreBlock + threadIdx.x;
            if ((int32_t)(blockIdx.x * kScoreBlock) >= n) continue; /* block-uniform */
            const uint16_t *L = seqs[b].landmarks + (int64_t)h * n * D;
            const int vec = row_vec(L, D);
            const uint16_t *row = L + (int64_t)j * D;
            for (int32_t g0 = 0; g0 < G; g0 += GC) {
                __syncthreads(); /* previous users of qs are done */
                for (int32_t e = threadIdx.x; e < GC * D; e += kScoreBlock) {
                    int32_t g = g0 + e / D;
                    qs[e] = g < G ? skv_bf16_to_f32(q[((int64_t)b * sh.Hq + (int64_t)h * G + g) * D + e % D]) : 0.0f;
                }
                __syncthreads();
                if (j >= n) continue;
                float acc[GC];
#pragma unroll
                for (int g = 0; g < GC; g++) acc[g] = 0.0f;
                if (vec == 8) score_chains<GC, 8>(row, qs, D, acc);
                else if (vec == 2) score_chains<GC, 2>(row, qs, D, acc);
                else score_chains<GC, 1>(row, qs, D, acc);
#pragma unroll
                for (int g = 0; g < GC; g++)
                    if (g0 + g < G)
                        scores[((int64_t)b * sh.Hq + (int64_t)h * G + g0 + g) * sh.cand_max + j] =
                            SKV_MUL(acc[g], sh.scale);
            }
        }
}

/* ---- selection ------------------------------------------------------------------------- */

constexpr int kSelBlock = 1024;
constexpr int kLanes = SKV_CANON_LANES;      /* 256 */
constexpr int kSelGroups = kSelBlock / kLanes; /* query heads whose M, Z run side by side */
constexpr int kSelGChunk = 64;               /* query heads whose M, Z are held at once */
static_assert(kLanes == 256 && kSelBlock % kLanes == 0, "the canonical sum has 256 lanes");

/*
 * grid (Hk, B), one block per (b, h), for G = Hq/Hk query heads g (query head h*G + g):
 *  1. per query head, each 256-thread group computes M (ref's scan: s[0] if it is NaN,
 *     else the max of the non-NaN values; the sign of a zero max changes no e_j) and the
 *     canonical sum Z of e_j = skv_expf(s_j - M): lane k sums j = k, k+256, ... in order,
 *     then the fixed tree (shared memory for w >= 32, shuffles below: same pairs);
 *  2. all threads: a_j over g in order, p = e_j / Z with e_j recomputed (deterministic),
 *     a = p if g == 0 or p > a (ref's NaN semantics), stored in amax;
 *  3. top-S of skv_select_key(a_j) (desc, ties to lower j), increasing j.
 * amax [B, Hk, cand_max] is required: it is the key store of step 3 and holds a_j on
 * return. G larger than kSelGChunk is done in chunks of query heads, a_j carried in amax.
 */
__global__ void __launch_bounds__(kSelBlock)
    skv_select_kernel(skv_cuda_shape sh, const skv_cuda_seq *seqs, const float *scores, float *amax,
                      int32_t *sel_idx, int32_t *sel_ids)
{
    __shared__ TopkSmem<kSelBlock> sm;
    __shared__ float part[kSelBlock];
    __shared__ float wmax[kSelBlock / 32];
    __shared__ float Ms[kSelGChunk], Zs[kSelGChunk];

    const int tid = threadIdx.x, lane = tid & 31, grp = tid / kLanes, k = tid % kLanes;
    const int32_t G = sh.Hq / sh.Hk, S = sh.S;
    const int32_t h = blockIdx.x;

    for (int32_t b = blockIdx.y; b < sh.B; b += gridDim.y) {
        const int32_t n = seqs[b].n_cand;
        const float *srow = scores + ((int64_t)b * sh.Hq + (int64_t)h * G) * sh.cand_max;
        float *a = amax + ((int64_t)b * sh.Hk + h) * sh.cand_max;

        for (int32_t g0 = 0; g0 < G; g0 += kSelGChunk) {
            const int32_t gc = min(kSelGChunk, G - g0);
            for (int32_t gg = 0; gg < gc; gg += kSelGroups) {
                const int32_t gl = gg + grp;
                const bool act = gl < gc;
                const float *s = srow + (int64_t)(g0 + (act ? gl : 0)) * sh.cand_max;

                float m = -INFINITY; /* max of non-NaN values: NaN never compares greater */
                if (act)
                    for (int32_t j = k; j < n; j += kLanes) {
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
                m = wmax[grp * (kLanes / 32)];
                for (int w = 1; w < kLanes / 32; w++) {
                    float y = wmax[grp * (kLanes / 32) + w];
                    if (y > m) m = y;
                }
                const float s0 = s[0];
                const float M = s0 != s0 ? s0 : m;

                float P = 0.0f;
                if (act)
                    for (int32_t j = k; j < n; j += kLanes) P = SKV_ADD(P, skv_expf(SKV_SUB(s[j], M)));
                part[tid] = P;
                __syncthreads();
                for (int w = kLanes / 2; w >= 32; w >>= 1) {
                    if (k < w) part[tid] = SKV_ADD(part[tid], part[tid + w]);
                    __syncthreads();
                }
                if (k < 32) { /* the group's first warp, whole */
                    float v = part[tid];
#pragma unroll
                    for (int w = 16; w >= 1; w >>= 1) {
                        float o = __shfl_down_sync(kFullMask, v, w);
                        v = SKV_ADD(v, o); /* lanes k < w: P[k] + P[k+w] */
                    }
                    if (k == 0 && act) {
                        Ms[gl] = M;
                        Zs[gl] = v;
                    }
                }
                /* wmax and part are next written after the next barrier, which the
                   readers above reach only when done */
            }
            __syncthreads(); /* Ms, Zs complete */

            for (int32_t j = tid; j < n; j += kSelBlock) {
                float aj = g0 == 0 ? 0.0f : a[j];
                for (int32_t gl = 0; gl < gc; gl++) {
                    const int32_t g = g0 + gl;
                    float e = skv_expf(SKV_SUB(srow[(int64_t)g * sh.cand_max + j], Ms[gl]));
                    float p = SKV_DIV(e, Zs[gl]);
                    if (g == 0 || p > aj) aj = p;
                }
                a[j] = aj;
            }
            __syncthreads(); /* a[] visible to the block; Ms, Zs free */
        }

        int32_t *out_idx = sel_idx + ((int64_t)b * sh.Hk + h) * S;
        const int32_t *cids = seqs[b].cand_ids;
        int32_t *out_ids = (sel_ids && cids) ? sel_ids + ((int64_t)b * sh.Hk + h) * S : nullptr;
        const int32_t *ch = cids ? cids + (int64_t)h * n : nullptr;
        block_topk<kSelBlock, false>(
            n, S, [=](int32_t i) { return order_desc(skv_select_key(a[i])); },
            [=](int32_t pos, int32_t i) {
                out_idx[pos] = i;
                if (out_ids) out_ids[pos] = ch[i];
            },
            [](int32_t, int32_t) {}, sm);
        __syncthreads();
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

cudaError_t skv_cuda_score(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                           const skv_bf16 *q, float *scores)
{
    if (sh->B <= 0 || sh->Hk <= 0 || sh->cand_max <= 0) return cudaSuccess;
    const int32_t G = sh->Hq / sh->Hk;
    const dim3 grid((unsigned)((sh->cand_max + kScoreBlock - 1) / kScoreBlock), clamp_yz(sh->Hk), clamp_yz(sh->B));
    /* GC: the smallest chunk of query heads covering G (at most 8 chains per thread) */
    if (G <= 1)
        skv_score_kernel<1><<<grid, kScoreBlock, (size_t)1 * sh->D * sizeof(float), st>>>(*sh, seqs, q, scores);
    else if (G == 2)
        skv_score_kernel<2><<<grid, kScoreBlock, (size_t)2 * sh->D * sizeof(float), st>>>(*sh, seqs, q, scores);
    else if (G <= 4)
        skv_score_kernel<4><<<grid, kScoreBlock, (size_t)4 * sh->D * sizeof(float), st>>>(*sh, seqs, q, scores);
    else
        skv_score_kernel<8><<<grid, kScoreBlock, (size_t)8 * sh->D * sizeof(float), st>>>(*sh, seqs, q, scores);
    return cudaGetLastError();
}

/* amax is required (lib always passes a buffer): the top-k reads its keys from it, and it
   holds a_j on return. */
cudaError_t skv_cuda_select(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                            const float *scores, float *amax, int32_t *sel_idx, int32_t *sel_ids)
{
    if (sh->B <= 0 || sh->Hk <= 0) return cudaSuccess;
    if (!amax) return cudaErrorInvalidValue;
    const dim3 grid((unsigned)sh->Hk, clamp_yz(sh->B));
    skv_select_kernel<<<grid, kSelBlock, 0, st>>>(*sh, seqs, scores, amax, sel_idx, sel_ids);
    return cudaGetLastError();
}
