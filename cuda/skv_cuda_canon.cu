/*
 * skv_cuda_canon.cu - the reproducible mode's canonical key rebuild and
 * canonical attention (docs/DESIGN.md 10.2, 10.3) on the device, for the
 * cache's decode step and for the op-level slots. Built with --fmad=false; every
 * float operation is an SKV_* macro of lib/skv_numerics.h (an explicitly rounded
 * __f*_rn intrinsic), so the results are those of ref, bit for bit.
 *
 *  - rebuild (canon_wprep_kernel, then canon_rebuild_tc_kernel): W_h's columns
 *    in fixed point once per step; then one block per (tile of 128 selected
 *    tokens, KV head, sequence). W_h's columns and the tile's U rows are in
 *    13-bit fixed point (skv_canon_rebuild_ex/fix), each integer split as 128 hi
 *    + lo with hi in [-64, 64], lo in [-64, 63], and the exact sum
 *    P = 2^14 (hu.hw) + 2^7 (hu.lw + lu.hw) + lu.lw is taken on int8 tensor
 *    cores (wmma 16x16x16, int32 accumulators: every partial sum is exact), then
 *    skv_canon_rebuild_key, RoPE (skv_rope_rotate, the pairs of
 *    skv_rope_pair_index) and bf16 into k_out [B, Hk, S c, D]. Shapes whose
 *    shared memory would not fit take canon_rebuild_scalar_kernel (int64 sums,
 *    the same values).
 *  - attention (canon_attend_kernel): blocks of 2 x 256 threads per (KV head,
 *    sequence), 1 to 4 of them sharing out the P V units (each computes the
 *    weights itself, into its own rows of the workspace): thread (part p, lane
 *    l) owns canonical lane l. Scores: lane l
 *    computes s_j for its tokens j = l, l + 256, ... (each the fmaf chain of
 *    skv_dot_bf16) for the query heads g = p, p + 2, ... of the group; M by a
 *    block max; e_j = skv_expf(s_j - M) stored in the workspace; Z by the lane
 *    sums in j order and the fixed tree in shared memory. P V: a work unit is
 *    (4 query heads, 16 dims); lane l adds fma(e_j, v_jd, .) over its tokens in
 *    j order for those 64 (head, dim) pairs, then the same tree, then N_d / Z.
 *    The 4 query heads of a unit share every V load, the group's heads share
 *    the block's K loads through L1.
 * The decode step's spans are read from the device (skv_cuda_seq, the step's
 * selection, the chunk cache's entries), so the launches can be captured in the
 * layer's graph. Launchers only enqueue: no allocation, no synchronization.
 */
#include <cuda_runtime.h>
#include <mma.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_numerics.h"
#include "skv_plan.h"

extern __shared__ __align__(128) unsigned char skv_canon_smem[];

namespace {

/* ---- rebuild ----------------------------------------------------------------------------------- */

constexpr int kRbTok = 128;           /* tokens per block */
constexpr int kRbNT = 256;            /* 8 warps, 16 tokens each */
constexpr size_t kRbSmemMax = 200 * 1024;

struct RebuildArgs {
    int32_t Hk, D, Dp, r, Kp, c, S, R, interleaved;
    int64_t M;                 /* S c tokens per (sequence, KV head) */
    signed char *wq;           /* [B, Hk] x (hi, lo) [Kp/16][Dp][16]: W_h in fixed point (canon_wprep_kernel) */
    int *wex;                  /* [B, Hk, Dp] the columns' exponents */
    const skv_cuda_seq *seqs;  /* [B]: u, w */
    const int32_t *ids;        /* [B, Hk, S] chunk ids */
    const float *cos_tab, *sin_tab;
    skv_bf16 *k_out;           /* [B, Hk, M, D] */
};

/* Shared memory of the tensor-core rebuild for a shape. */
__host__ __device__ inline size_t rb_smem(int32_t Kp, int32_t Dp)
{
    return (size_t)2 * Kp * Dp                      /* W hi, lo: [Kp/16][Dp][16] int8 */
           + (size_t)2 * Kp * kRbTok                /* U hi, lo: [Kp/16][128][16] int8 */
           + sizeof(int) * ((size_t)Dp + kRbTok)    /* ew, eu */
           + sizeof(int) * 3 * 256 * (kRbNT / 32)   /* per warp: the three int32 tiles */
           + sizeof(float) * (size_t)kRbTok * Dp;   /* per token: the float key before RoPE */
}

/* 128 hi + lo = x, hi in [-64, 64], lo in [-64, 63]. */
__device__ __forceinline__ void split13(int32_t x, signed char *hi, signed char *lo)
{
    const int32_t l = ((x + 64) & 127) - 64;
    *lo = (signed char)l;
    *hi = (signed char)((x - l) >> 7);
}

/* Column maxima of W_h -> ew[d] (d < Dp; 0 past D). */
__device__ void rb_col_exps(const RebuildArgs &a, const uint16_t *w, int h, int *ew)
{
    const int64_t width = (int64_t)a.Hk * a.D;
    for (int d = threadIdx.x; d < a.Dp; d += blockDim.x) {
        unsigned mx = 0;
        if (d < a.D)
            for (int q = 0; q < a.r; q++) mx = max(mx, (unsigned)(w[(int64_t)q * width + (int64_t)h * a.D + d] & 0x7fffu));
        ew[d] = skv_canon_rebuild_ex((uint16_t)mx);
    }
}

/* RoPE of one float key row x[0..D) at position t -> out (bf16), lanes of a warp over the pairs. */
__device__ void rb_rope_row(const RebuildArgs &a, const float *x, int64_t t, uint16_t *out, int lane)
{
    const int h2 = a.R / 2;
    const float *cs = a.cos_tab + t * h2, *sn = a.sin_tab + t * h2;
    for (int d = a.R + lane; d < a.D; d += 32) out[d] = skv_f32_to_bf16(x[d]);
    for (int i = lane; i < h2; i += 32) {
        int pa, pb;
        float xo, yo;
        skv_rope_pair_index(i, a.R, a.interleaved, &pa, &pb);
        skv_rope_rotate(x[pa], x[pb], cs[i], sn[i], &xo, &yo);
        out[pa] = skv_f32_to_bf16(xo);
        out[pb] = skv_f32_to_bf16(yo);
    }
}

/* grid (Dp / 16, Hk, B), 256 threads: 16 columns of W_h of one (sequence, KV head) in fixed point,
   split into int8 halves, in the layout the tensor-core rebuild loads (once per step instead of once
   per token tile). Thread t owns column d0 + t % 16 and the rows q = t / 16 + 16 k. */
__global__ void __launch_bounds__(kRbNT) canon_wprep_kernel(const RebuildArgs a)
{
    static_assert(kRbNT == 256, "16 columns x 16 row groups");
    const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, col = tid & 15, rg = tid >> 4;
    const int d = blockIdx.x * 16 + col;
    const uint16_t *w = (const uint16_t *)a.seqs[b].w + (int64_t)h * a.D + d;
    const int64_t width = (int64_t)a.Hk * a.D;
    __shared__ unsigned mx_s[256];
    __shared__ int e_s[16];
    unsigned mx = 0;
    if (d < a.D) {
#pragma unroll 4
        for (int q = rg; q < a.r; q += 16) mx = max(mx, (unsigned)(w[(int64_t)q * width] & 0x7fffu));
    }
    mx_s[tid] = mx;
    __syncthreads();
    if (tid < 16) {
        unsigned m = mx_s[tid];
        for (int g = 1; g < 16; g++) m = max(m, mx_s[tid + 16 * g]);
        e_s[tid] = skv_canon_rebuild_ex((uint16_t)m);
        a.wex[((int64_t)b * a.Hk + h) * a.Dp + blockIdx.x * 16 + tid] = e_s[tid];
    }
    __syncthreads();
    const int e = e_s[col];
    signed char *Wh = a.wq + ((int64_t)b * a.Hk + h) * 2 * a.Kp * a.Dp, *Wl = Wh + (size_t)a.Kp * a.Dp;
#pragma unroll 4
    for (int q = rg; q < a.Kp; q += 16) {
        const int32_t x = q < a.r && d < a.D ? skv_canon_rebuild_fix(w[(int64_t)q * width], e) : 0;
        const size_t o = ((size_t)(q >> 4) * a.Dp + d) * 16 + (q & 15);
        split13(x, Wh + o, Wl + o);
    }
}

/* grid (tiles, Hk, B), 256 threads. */
__global__ void __launch_bounds__(kRbNT) canon_rebuild_tc_kernel(const RebuildArgs a)
{
    using namespace nvcuda;
    const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int64_t m0 = (int64_t)blockIdx.x * kRbTok;
    const uint16_t *u = (const uint16_t *)a.seqs[b].u;
    const int32_t *ids = a.ids + ((int64_t)b * a.Hk + h) * a.S;
    signed char *Wh = (signed char *)skv_canon_smem, *Wl = Wh + (size_t)a.Kp * a.Dp;
    signed char *Uh = Wl + (size_t)a.Kp * a.Dp, *Ul = Uh + (size_t)a.Kp * kRbTok;
    int *ew = (int *)(Ul + (size_t)a.Kp * kRbTok), *eu = ew + a.Dp;
    int *tiles = eu + kRbTok;                                      /* [8 warps][3][256] */
    float *xs = (float *)(tiles + 3 * 256 * (kRbNT / 32));         /* [128][Dp] */
    /* W_h in fixed point from canon_wprep_kernel (col-major 16 x 16 blocks: element (q, d) at
       [(q/16) Dp + d] 16 + q%16, hi then lo), 16 bytes at a time */
    {
        const uint4 *src = reinterpret_cast<const uint4 *>(a.wq + ((int64_t)b * a.Hk + h) * 2 * a.Kp * a.Dp);
        uint4 *dst = reinterpret_cast<uint4 *>(Wh);
        for (int i = tid; i < 2 * a.Kp * a.Dp / 16; i += kRbNT) dst[i] = src[i];
        const int *ex = a.wex + ((int64_t)b * a.Hk + h) * a.Dp;
        for (int d = tid; d < a.Dp; d += kRbNT) ew[d] = ex[d];
    }
    /* the tile's U rows, a warp per row: [(q/16) 128 + row] 16 + q%16 */
    for (int row = warp; row < kRbTok; row += kRbNT / 32) {
        const int64_t m = m0 + row;
        const bool live = m < a.M;
        const uint16_t *ur = live ? u + ((int64_t)ids[m / a.c] * a.c + m % a.c) * a.r : u;
        unsigned mx = 0;
        if (live)
            for (int q = lane; q < a.r; q += 32) mx = max(mx, (unsigned)(ur[q] & 0x7fffu));
        mx = __reduce_max_sync(kFullMask, mx);
        const int e = skv_canon_rebuild_ex((uint16_t)mx);
        if (lane == 0) eu[row] = e;
        for (int q = lane; q < a.Kp; q += 32) {
            const int32_t x = live && q < a.r ? skv_canon_rebuild_fix(ur[q], e) : 0;
            const size_t o = ((size_t)(q >> 4) * kRbTok + row) * 16 + (q & 15);
            split13(x, Uh + o, Ul + o);
        }
    }
    __syncthreads();
    /* warp: tokens 16 warp .. +15, every 16-dim tile: the three exact int32 sums */
    int *t1 = tiles + warp * 3 * 256, *t2 = t1 + 256, *t3 = t2 + 256;
    for (int nt = 0; nt < a.Dp / 16; nt++) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, int> c1, c2, c3;
        wmma::fill_fragment(c1, 0);
        wmma::fill_fragment(c2, 0);
        wmma::fill_fragment(c3, 0);
        for (int kb = 0; kb < a.Kp / 16; kb++) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, signed char, wmma::row_major> ah, al;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, signed char, wmma::col_major> bh, bl;
            const size_t ao = ((size_t)kb * kRbTok + warp * 16) * 16, bo = ((size_t)kb * a.Dp + nt * 16) * 16;
            wmma::load_matrix_sync(ah, Uh + ao, 16);
            wmma::load_matrix_sync(al, Ul + ao, 16);
            wmma::load_matrix_sync(bh, Wh + bo, 16);
            wmma::load_matrix_sync(bl, Wl + bo, 16);
            wmma::mma_sync(c1, ah, bh, c1);
            wmma::mma_sync(c2, ah, bl, c2);
            wmma::mma_sync(c2, al, bh, c2);
            wmma::mma_sync(c3, al, bl, c3);
        }
        wmma::store_matrix_sync(t1, c1, 16, wmma::mem_row_major);
        wmma::store_matrix_sync(t2, c2, 16, wmma::mem_row_major);
        wmma::store_matrix_sync(t3, c3, 16, wmma::mem_row_major);
        __syncwarp();
        for (int e = lane; e < 256; e += 32) {
            const int row = e >> 4, d = nt * 16 + (e & 15);
            const int64_t P = ((int64_t)t1[e] << 14) + ((int64_t)t2[e] << 7) + (int64_t)t3[e];
            xs[(size_t)(warp * 16 + row) * a.Dp + d] = skv_canon_rebuild_key(P, eu[warp * 16 + row] + ew[d] - 24);
        }
        __syncwarp();
    }
    /* RoPE and bf16, a warp per token */
    for (int row = 0; row < 16; row++) {
        const int64_t m = m0 + warp * 16 + row;
        if (m >= a.M) break;
        const int64_t t = (int64_t)ids[m / a.c] * a.c + m % a.c;
        rb_rope_row(a, xs + (size_t)(warp * 16 + row) * a.Dp, t,
                    (uint16_t *)a.k_out + (((int64_t)b * a.Hk + h) * a.M + m) * a.D, lane);
    }
}

/* The same values without tensor cores (shapes whose shared memory does not fit): grid (tiles of
   32 tokens, Hk, B), 256 threads; smem ew [D], xs [32][D] float. */
__global__ void __launch_bounds__(kRbNT) canon_rebuild_scalar_kernel(const RebuildArgs a)
{
    const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int64_t m0 = (int64_t)blockIdx.x * 32;
    const skv_cuda_seq &sq = a.seqs[b];
    const uint16_t *w = (const uint16_t *)sq.w, *u = (const uint16_t *)sq.u;
    const int32_t *ids = a.ids + ((int64_t)b * a.Hk + h) * a.S;
    int *ew = (int *)skv_canon_smem, *eu = ew + a.Dp;
    float *xs = (float *)(eu + 32);
    rb_col_exps(a, w, h, ew);
    for (int row = warp; row < 32; row += kRbNT / 32) {
        const int64_t m = m0 + row;
        unsigned mx = 0;
        if (m < a.M) {
            const uint16_t *ur = u + ((int64_t)ids[m / a.c] * a.c + m % a.c) * a.r;
            for (int q = lane; q < a.r; q += 32) mx = max(mx, (unsigned)(ur[q] & 0x7fffu));
        }
        mx = __reduce_max_sync(kFullMask, mx);
        if (lane == 0) eu[row] = skv_canon_rebuild_ex((uint16_t)mx);
    }
    __syncthreads();
    const int64_t width = (int64_t)a.Hk * a.D;
    for (int idx = tid; idx < 32 * a.D; idx += kRbNT) {
        const int row = idx / a.D, d = idx - row * a.D;
        const int64_t m = m0 + row;
        if (m >= a.M) continue;
        const uint16_t *ur = u + ((int64_t)ids[m / a.c] * a.c + m % a.c) * a.r;
        int64_t P = 0;
        for (int q = 0; q < a.r; q++)
            P += (int64_t)skv_canon_rebuild_fix(ur[q], eu[row]) *
                 skv_canon_rebuild_fix(w[(int64_t)q * width + (int64_t)h * a.D + d], ew[d]);
        xs[(size_t)row * a.D + d] = skv_canon_rebuild_key(P, eu[row] + ew[d] - 24);
    }
    __syncthreads();
    for (int row = warp; row < 32; row += kRbNT / 32) {
        const int64_t m = m0 + row;
        if (m >= a.M) continue;
        const int64_t t = (int64_t)ids[m / a.c] * a.c + m % a.c;
        rb_rope_row(a, xs + (size_t)row * a.D, t, (uint16_t *)a.k_out + (((int64_t)b * a.Hk + h) * a.M + m) * a.D, lane);
    }
}

/* ---- attention ---------------------------------------------------------------------------------- */

constexpr int kAtLanes = SKV_CANON_LANES; /* 256 */
constexpr int kAtParts = 2;
constexpr int kAtNT = kAtLanes * kAtParts;
constexpr int kAtDC = 16; /* dims per unit */
constexpr int kAtGC = 4;  /* query heads per unit */
constexpr int kAtMaxSpans = SKV_MAX_SPANS;

/* A span of one (sequence, KV head). kind 0: v like k; 1: the selected span of a device slot (values
   in the store by candidate index); 2: that of a host slot (values in the chunk cache). */
struct CSpan {
    const uint16_t *k, *v;
    int64_t n, ts;
    int kind;
};

struct AttendArgs {
    int32_t Hq, Hk, G, D;
    float scale;
    int64_t Tmax;           /* row length of e */
    float *e;               /* [B, Hq, Tmax] scores, then weights */
    /* op level (seqs == NULL) */
    const uint16_t *q;      /* [Hq, D] */
    float *out;             /* [Hq, D] */
    int32_t n_spans;
    skv_kv_span spans[kAtMaxSpans];
    /* decode */
    const skv_cuda_seq *seqs;
    const skv_cuda_io *io;
    const uint16_t *ksel;   /* [B, Hk, S c, D] rebuilt keys */
    const int32_t *sel_idx, *vsrc; /* [B, Hk, S] */
    int32_t O, c, S, gen_cap, vc_chunks;
};

/* The spans of (b, h) into sp[] (thread 0); returns their count. */
__device__ int at_spans(const AttendArgs &a, int b, int h, CSpan *sp)
{
    if (!a.seqs) {
        for (int i = 0; i < a.n_spans; i++) {
            const skv_kv_span &s = a.spans[i];
            sp[i].n = s.n_tokens;
            sp[i].ts = s.token_stride;
            sp[i].k = s.n_tokens ? (const uint16_t *)s.k + h * s.head_stride : nullptr;
            sp[i].v = s.n_tokens ? (const uint16_t *)s.v + h * s.head_stride : nullptr;
            sp[i].kind = 0;
        }
        return a.n_spans;
    }
    const skv_cuda_seq &sq = a.seqs[b];
    skv_span_shape sh[SKV_N_SPANS];
    skv_plan_spans(a.O, a.c, a.S, a.D, sq.n_local, sq.n_gen, a.gen_cap, sh);
    const uint16_t *k[SKV_N_SPANS] = {(const uint16_t *)sq.out_k, (const uint16_t *)sq.loc_k,
                                      a.ksel + (int64_t)b * a.Hk * sh[SKV_SPAN_SELECTED].head_stride,
                                      (const uint16_t *)sq.gen_k, (const uint16_t *)a.io->k + (int64_t)b * a.Hk * a.D};
    const uint16_t *v[SKV_N_SPANS] = {(const uint16_t *)sq.out_v, (const uint16_t *)sq.loc_v, nullptr,
                                      (const uint16_t *)sq.gen_v, (const uint16_t *)a.io->v + (int64_t)b * a.Hk * a.D};
    for (int i = 0; i < SKV_N_SPANS; i++) {
        sp[i].n = sh[i].n_tokens;
        sp[i].ts = a.D;
        sp[i].k = k[i] + h * sh[i].head_stride;
        sp[i].v = v[i] ? v[i] + h * sh[i].head_stride : nullptr;
        sp[i].kind = i == SKV_SPAN_SELECTED ? (sq.vc_data ? 2 : 1) : 0;
    }
    return SKV_N_SPANS;
}

/* Token t of span s: its value row. */
__device__ __forceinline__ const uint16_t *at_vrow(const AttendArgs &a, const CSpan &s, int b, int h, int64_t t)
{
    if (s.kind == 0) return s.v + t * s.ts;
    const skv_cuda_seq &sq = a.seqs[b];
    const int64_t bh = (int64_t)b * a.Hk + h, sel = t / a.c, i = t - sel * a.c;
    if (s.kind == 1)
        return (const uint16_t *)sq.vstore + (((int64_t)h * sq.n_cand + a.sel_idx[bh * a.S + sel]) * a.c + i) * a.D;
    int32_t e = a.vsrc[bh * a.S + sel] & 0x7fffffff;
    if (e >= a.vc_chunks) e = 0; /* never after a good selection step; keeps a bad step's reads in bounds */
    return (const uint16_t *)sq.vc_data + (((int64_t)h * a.vc_chunks + e) * a.c + i) * a.D;
}

/* The canonical tree over P[256][ncol] (shared), all threads of the block taking part (256 per
   part; part p's array at P + p * stride). After it, P[0][col] holds the sum. */
__device__ __forceinline__ void at_tree(float *P, int ncol, int lane)
{
    for (int w = kAtLanes / 2; w >= 1; w >>= 1) {
        __syncthreads();
        for (int idx = lane; idx < w * ncol; idx += kAtLanes) {
            const int k = idx / ncol, col = idx - k * ncol;
            P[k * ncol + col] = SKV_ADD(P[k * ncol + col], P[(k + w) * ncol + col]);
        }
    }
    __syncthreads();
}

/* grid (Hk, B), kAtNT threads. smem: q [G][D] float, Zl [parts][256], Zf [G], red [parts][8],
   P [parts][256][16], spans. */
__global__ void __launch_bounds__(kAtNT, 1) canon_attend_kernel(const AttendArgs a)
{
    const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, part = tid / kAtLanes, lane = tid % kAtLanes;
    const int zs = blockIdx.z, nz = gridDim.z; /* this block's share of the P V units; its own weights */
    const int G = a.G, D = a.D;
    float *qs = (float *)skv_canon_smem;                       /* [G][D] */
    float *Zl = qs + (size_t)G * D;                            /* [parts][256] */
    float *Zf = Zl + kAtParts * kAtLanes;                      /* [G] */
    float *red = Zf + G;                                       /* [parts][8] */
    float *Pp = red + kAtParts * 8;                            /* [parts][256][kAtDC] */
    CSpan *sp = (CSpan *)align_up((size_t)(Pp + (size_t)kAtParts * kAtLanes * kAtDC), 16);
    __shared__ int n_spans_s;
    __shared__ float Ms[kAtParts];
    if (tid == 0) n_spans_s = at_spans(a, b, h, sp);
    const uint16_t *qg = a.seqs ? (const uint16_t *)a.io->q + ((int64_t)b * a.Hq + (int64_t)h * G) * D
                                : a.q + (int64_t)h * G * D;
    for (int i = tid; i < G * D; i += kAtNT) qs[i] = skv_bf16_to_f32(qg[i]);
    __syncthreads();
    const int ns = n_spans_s;
    const int64_t bq0 = ((int64_t)b * nz + zs) * a.Hq + (int64_t)h * G; /* row of e */
    const int64_t bo0 = (int64_t)b * a.Hq + (int64_t)h * G;              /* row of out */
    /* scores, max, weights and Z: part p takes the query heads g = g0 + p */
    for (int g0 = 0; g0 < G; g0 += kAtParts) {
        const int g = g0 + part;
        const bool act = g < G;
        float *eg = a.e + (bq0 + (act ? g : 0)) * a.Tmax;
        float mx = -INFINITY;
        if (act) {
            const float *q = qs + (size_t)g * D;
            /* two tokens per pass (j and j + 256: two independent chains, both rows' loads in flight) */
            int si = 0;
            int64_t base = 0;
            for (int64_t j = lane;; j += 2 * kAtLanes) {
                while (si < ns && j - base >= sp[si].n) base += sp[si].n, si++;
                if (si >= ns) break;
                const uint16_t *k0 = sp[si].k + (j - base) * sp[si].ts, *k1 = nullptr;
                int si1 = si;
                int64_t base1 = base;
                while (si1 < ns && j + kAtLanes - base1 >= sp[si1].n) base1 += sp[si1].n, si1++;
                if (si1 < ns) k1 = sp[si1].k + (j + kAtLanes - base1) * sp[si1].ts;
                float acc0 = 0.0f, acc1 = 0.0f;
                const bool v0 = (D & 7) == 0 && ((uintptr_t)k0 & 15) == 0;
                if (v0 && k1 && ((uintptr_t)k1 & 15) == 0) {
                    for (int d = 0; d < D; d += 8) {
                        float f0[8], f1[8];
                        bf16x8_to_f32(*reinterpret_cast<const uint4 *>(k0 + d), f0);
                        bf16x8_to_f32(*reinterpret_cast<const uint4 *>(k1 + d), f1);
#pragma unroll
                        for (int x = 0; x < 8; x++) {
                            acc0 = SKV_FMA(q[d + x], f0[x], acc0);
                            acc1 = SKV_FMA(q[d + x], f1[x], acc1);
                        }
                    }
                } else {
                    for (int d = 0; d < D; d++) acc0 = SKV_FMA(q[d], skv_bf16_to_f32(k0[d]), acc0);
                    if (k1)
                        for (int d = 0; d < D; d++) acc1 = SKV_FMA(q[d], skv_bf16_to_f32(k1[d]), acc1);
                }
                const float s0 = SKV_MUL(acc0, a.scale);
                eg[j] = s0;
                mx = fmaxf(mx, s0);
                if (!k1) break;
                const float s1 = SKV_MUL(acc1, a.scale);
                eg[j + kAtLanes] = s1;
                mx = fmaxf(mx, s1);
                si = si1, base = base1;
            }
        }
        /* the max of the part's 256 lanes (finite scores: the order of fmaxf does not matter, see
           skv_canonical_attend) */
        mx = warp_max(mx);
        if ((lane & 31) == 0) red[part * 8 + (lane >> 5)] = mx;
        __syncthreads();
        if (lane == 0) {
            float m = red[part * 8];
            for (int i = 1; i < 8; i++) m = fmaxf(m, red[part * 8 + i]);
            Ms[part] = m;
        }
        __syncthreads();
        const float M = Ms[part];
        float z = 0.0f;
        if (act) {
            int64_t T = 0;
            for (int i = 0; i < ns; i++) T += sp[i].n;
            for (int64_t j = lane; j < T; j += kAtLanes) {
                const float e = skv_expf(SKV_SUB(eg[j], M));
                eg[j] = e;
                z = SKV_ADD(z, e);
            }
        }
        Zl[part * kAtLanes + lane] = z;
        at_tree(Zl + part * kAtLanes, 1, lane);
        if (act && lane == 0) Zf[g] = Zl[part * kAtLanes];
        __syncthreads();
    }
    /* P V: units (4 query heads, 16 dims), part p takes units u0 + p */
    const int ng = (G + kAtGC - 1) / kAtGC, nd = (D + kAtDC - 1) / kAtDC, U = ng * nd;
    float *P = Pp + (size_t)part * kAtLanes * kAtDC;
    for (int u0 = zs * kAtParts; u0 < U; u0 += kAtParts * nz) {
        const int un = u0 + part;
        const bool act = un < U;
        const int gq = act ? un / nd * kAtGC : 0, d0 = act ? un % nd * kAtDC : 0;
        const int gn = act ? min(kAtGC, G - gq) : 0;
        float acc[kAtGC][kAtDC];
#pragma unroll
        for (int x = 0; x < kAtGC; x++)
#pragma unroll
            for (int y = 0; y < kAtDC; y++) acc[x][y] = 0.0f;
        if (act) {
            /* two tokens per pass (j, then j + 256: the lane's order), both rows' loads in flight */
            int si = 0;
            int64_t base = 0;
            for (int64_t j = lane;; j += 2 * kAtLanes) {
                while (si < ns && j - base >= sp[si].n) base += sp[si].n, si++;
                if (si >= ns) break;
                int si1 = si;
                int64_t base1 = base;
                while (si1 < ns && j + kAtLanes - base1 >= sp[si1].n) base1 += sp[si1].n, si1++;
                const bool two = si1 < ns;
                float f[2][kAtDC], ev[2][kAtGC];
#pragma unroll
                for (int t = 0; t < 2; t++) {
                    const int64_t jt = j + t * kAtLanes;
                    if (t == 1 && !two) {
#pragma unroll
                        for (int y = 0; y < kAtDC; y++) f[t][y] = 0.0f;
#pragma unroll
                        for (int x = 0; x < kAtGC; x++) ev[t][x] = 0.0f;
                        continue;
                    }
                    const uint16_t *v = (t ? at_vrow(a, sp[si1], b, h, jt - base1) : at_vrow(a, sp[si], b, h, jt - base)) + d0;
#pragma unroll
                    for (int x = 0; x < kAtGC; x++) ev[t][x] = x < gn ? a.e[(bq0 + gq + x) * a.Tmax + jt] : 0.0f;
                    if (d0 + kAtDC <= D && ((uintptr_t)v & 15) == 0) {
                        bf16x8_to_f32(*reinterpret_cast<const uint4 *>(v), f[t]);
                        bf16x8_to_f32(*reinterpret_cast<const uint4 *>(v + 8), f[t] + 8);
                    } else {
#pragma unroll
                        for (int y = 0; y < kAtDC; y++) f[t][y] = d0 + y < D ? skv_bf16_to_f32(v[y]) : 0.0f;
                    }
                }
#pragma unroll
                for (int x = 0; x < kAtGC; x++)
#pragma unroll
                    for (int y = 0; y < kAtDC; y++) acc[x][y] = SKV_FMA(ev[0][x], f[0][y], acc[x][y]);
                if (!two) break;
#pragma unroll
                for (int x = 0; x < kAtGC; x++)
#pragma unroll
                    for (int y = 0; y < kAtDC; y++) acc[x][y] = SKV_FMA(ev[1][x], f[1][y], acc[x][y]);
                si = si1, base = base1;
            }
        }
#pragma unroll
        for (int x = 0; x < kAtGC; x++) {
#pragma unroll
            for (int y = 0; y < kAtDC; y++) P[lane * kAtDC + y] = acc[x][y];
            at_tree(P, kAtDC, lane);
            if (act && x < gn && lane < kAtDC && d0 + lane < D) {
                float *out = a.seqs ? a.io->out : a.out;
                out[(bo0 + gq + x) * D + d0 + lane] = SKV_DIV(P[lane], Zf[gq + x]);
            }
            __syncthreads(); /* P is rewritten by the next head */
        }
    }
}

size_t at_smem(int32_t G, int32_t D, int32_t n_spans)
{
    return sizeof(float) * ((size_t)G * D + kAtParts * kAtLanes + G + kAtParts * 8 + (size_t)kAtParts * kAtLanes * kAtDC) +
           sizeof(CSpan) * (size_t)(n_spans > SKV_N_SPANS ? n_spans : SKV_N_SPANS) + 16;
}

cudaError_t launch_rebuild(cudaStream_t st, const RebuildArgs &a, int32_t B)
{
    if (a.M <= 0 || B <= 0) return cudaSuccess;
    if (a.Hk > kMaxGridYZ || B > kMaxGridYZ) return cudaErrorInvalidValue;
    const size_t smem = rb_smem(a.Kp, a.Dp);
    if (smem <= kRbSmemMax && a.wq) {
        cudaError_t e = allow_smem(canon_rebuild_tc_kernel, smem);
        if (e != cudaSuccess) return e;
        e = launch(canon_wprep_kernel, dim3((unsigned)(a.Dp / 16), (unsigned)a.Hk, (unsigned)B), dim3(kRbNT), 0, st,
                   false, a);
        if (e != cudaSuccess) return e;
        return launch(canon_rebuild_tc_kernel, dim3((unsigned)ceil_div64(a.M, kRbTok), (unsigned)a.Hk, (unsigned)B),
                      dim3(kRbNT), smem, st, false, a);
    }
    const size_t s2 = sizeof(int) * ((size_t)a.Dp + 32) + sizeof(float) * 32 * (size_t)a.D;
    cudaError_t e = allow_smem(canon_rebuild_scalar_kernel, s2);
    if (e != cudaSuccess) return e;
    return launch(canon_rebuild_scalar_kernel, dim3((unsigned)ceil_div64(a.M, 32), (unsigned)a.Hk, (unsigned)B),
                  dim3(kRbNT), s2, st, false, a);
}

RebuildArgs rebuild_args(const skv_cuda_shape *sh, const skv_cuda_seq *seqs, const int32_t *ids, skv_bf16 *k_out)
{
    RebuildArgs a;
    memset(&a, 0, sizeof a);
    a.Hk = sh->Hk, a.D = sh->D, a.Dp = (sh->D + 15) / 16 * 16, a.r = sh->r, a.Kp = (sh->r + 15) / 16 * 16;
    a.c = sh->c, a.S = sh->S, a.R = sh->rotary_dim, a.interleaved = sh->interleaved;
    a.M = (int64_t)sh->S * sh->c;
    a.seqs = seqs, a.ids = ids, a.cos_tab = sh->cos_tab, a.sin_tab = sh->sin_tab, a.k_out = k_out;
    return a;
}

/* Blocks per (KV head, sequence): the P V units split over up to kAtSplit blocks (each computes the
   weights itself) while (KV heads x sequences) alone would leave most multiprocessors idle. */
constexpr int kAtSplit = 4;
int at_split(int32_t Hk, int32_t B, int32_t G, int32_t D)
{
    const int units = ((G + kAtGC - 1) / kAtGC) * ((D + kAtDC - 1) / kAtDC);
    int z = 1;
    while (z < kAtSplit && (int64_t)Hk * B * z * 2 <= num_sms() && units >= 2 * z * kAtParts) z *= 2;
    return z;
}

cudaError_t launch_attend(cudaStream_t st, const AttendArgs &a, int32_t B, int nz)
{
    if (a.Hk > 65535 || B > kMaxGridYZ) return cudaErrorInvalidValue;
    const size_t smem = at_smem(a.G, a.D, a.n_spans);
    if (smem > 220 * 1024) return cudaErrorInvalidValue; /* a query group of more than ~200 heads of D 128 */
    cudaError_t e = allow_smem(canon_attend_kernel, smem);
    if (e != cudaSuccess) return e;
    return launch(canon_attend_kernel, dim3((unsigned)a.Hk, (unsigned)B, (unsigned)nz), dim3(kAtNT), smem, st, false,
                  a);
}

} /* namespace */

size_t skv_cuda_canon_wq_bytes(int32_t B, int32_t Hk, int32_t D, int32_t r)
{
    const size_t Dp = (size_t)(D + 15) / 16 * 16, Kp = (size_t)(r + 15) / 16 * 16;
    return align_up((size_t)B * Hk * 2 * Kp * Dp, 256) + (size_t)B * Hk * Dp * sizeof(int);
}

cudaError_t skv_cuda_canon_rebuild(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                   const int32_t *chunk_ids, skv_bf16 *k_out, void *wq)
{
    RebuildArgs a = rebuild_args(sh, seqs, chunk_ids, k_out);
    if (wq) {
        a.wq = (signed char *)wq;
        a.wex = (int *)((char *)wq + align_up((size_t)sh->B * sh->Hk * 2 * a.Kp * a.Dp, 256));
    }
    return launch_rebuild(st, a, sh->B);
}

cudaError_t skv_cuda_canon_decode_attend(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                         const skv_cuda_dws *ws)
{
    AttendArgs a;
    memset(&a, 0, sizeof a);
    a.Hq = sh->Hq, a.Hk = sh->Hk, a.G = sh->Hq / sh->Hk, a.D = sh->D, a.scale = sh->scale;
    a.Tmax = ws->canon_tmax, a.e = ws->canon_e;
    a.seqs = seqs, a.io = ws->io, a.ksel = (const uint16_t *)ws->canon_k;
    a.sel_idx = ws->sel_idx, a.vsrc = ws->vsrc;
    a.O = sh->O, a.c = sh->c, a.S = sh->S, a.gen_cap = sh->gen_cap, a.vc_chunks = sh->vc_chunks;
    a.n_spans = SKV_N_SPANS;
    return launch_attend(st, a, sh->B, ws->canon_split);
}

cudaError_t skv_cuda_canon_span_attention(cudaStream_t st, int32_t Hq, int32_t Hk, int32_t D, float scale,
                                          const skv_bf16 *q, int32_t n_spans, const skv_kv_span *spans, float *out,
                                          float *e, int64_t T)
{
    if (n_spans > kAtMaxSpans) return cudaErrorInvalidValue;
    AttendArgs a;
    memset(&a, 0, sizeof a);
    a.Hq = Hq, a.Hk = Hk, a.G = Hq / Hk, a.D = D, a.scale = scale, a.Tmax = T, a.e = e;
    a.q = (const uint16_t *)q, a.out = out, a.n_spans = n_spans;
    for (int i = 0; i < n_spans; i++) a.spans[i] = spans[i];
    return launch_attend(st, a, 1, 1);
}

int skv_cuda_canon_split(int32_t Hk, int32_t B, int32_t G, int32_t D) { return at_split(Hk, B, G, D); }
