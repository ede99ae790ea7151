/*
 * skv_cuda_attn.cuh - what the attention files of cuda/ share (skv_cuda_attend.cu,
 * skv_cuda_attend_missed.cu): the work items and the shared-memory layout of step 4, the key
 * rebuild of one tile (U W_h on tensor or CUDA cores, then RoPE), the kernels' arguments
 * (AttendArgs) and the resident spans a range walks, and the fragment kernel's shape test, layout
 * and row copies (bf16 rows, and fp8 codes decoded in place: skv_cuda_fp8.cuh). Header-only, in an anonymous namespace (each
 * file has its own copy), included once per file after skv_cuda_common.cuh.
 *
 * Nothing here is on the exact-selection path (docs/DESIGN.md section 5): tensor
 * cores and any summation order are allowed, within the tolerances of
 * section 6 (rebuilt keys 1e-2 max relative row error, attention 2e-3
 * relative L2 per head, both against double). The order is fixed, though:
 * the same inputs give the same bits, whatever the placement of the values
 * and whichever items run first.
 *
 * Every launcher only enqueues on its stream: no allocation, no
 * synchronization. Per-sequence values (lengths, pointers) are read from the
 * device descriptors. Pointers from descriptors or callers may have any
 * alignment a bf16 pointer can have, so every vectorized access checks
 * alignment and has an element-wise fallback that writes the same result.
 */
#ifndef SKV_CUDA_ATTN_CUH
#define SKV_CUDA_ATTN_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <mma.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_cuda_fp8.cuh"
#include "skv_numerics.h"
#include "skv_plan.h"


/* All dynamic shared memory of this file; every kernel carves it itself. */
extern __shared__ __align__(128) unsigned char skv_attn_smem[];

namespace {

/*
 * Element d of RoPE(x) at the position whose table rows are cs, sn. Built from
 * the same primitives as skv_rope_row_f32, so each element is bit-identical to
 * that function's; computing per element lets a row be written by many threads
 * (each pair is rotated twice, once per member: a few flops for coalesced stores).
 */
__device__ __forceinline__ float rope_elem(const float *x, int d, int R, int interleaved, const float *cs,
                                           const float *sn)
{
    if (d >= R) return x[d];
    const int i = interleaved ? d / 2 : (d < R / 2 ? d : d - R / 2);
    int a, b;
    float xo, yo;
    skv_rope_pair_index(i, R, interleaved, &a, &b);
    skv_rope_rotate(x[a], x[b], cs[i], sn[i], &xo, &yo);
    return d == a ? xo : yo;
}

/* ================================================================================================
 * Work items and the shared-memory layout of the attention kernel.
 *
 * One CTA (256 threads) per item: (item, KV head h x query-head chunk, sequence b). Items
 * [0, n_sel) are tiles of tt selected tokens: their keys are rebuilt from U W_h into shared
 * memory (tensor cores for r % 16 == 0 and D in {64, 128, 256}, CUDA cores otherwise), roped,
 * rounded to bf16 and attended with the tile's values; items [n_sel, n_items) are ranges of
 * the resident spans (outliers, local window, generated tokens, the new token), attended tile
 * by tile with an online softmax. Each item writes a partial (max, sum, unnormalized P V) per
 * query head; the combine kernel adds the partials in item order.
 * ============================================================================================= */

constexpr int kAtNT = 256;
constexpr int kMaxSplits = 512;
constexpr int kRbKT = 32; /* r slice per pipeline stage of the tensor-core rebuild */
constexpr int kRbSimpleK = 64; /* r slice of the CUDA-core rebuild */

/* Compiled head dims: 64, 128, 256; 0 is the general kernel (even D up to 1024). */
__host__ __device__ constexpr int att_dt(int D) { return D == 64 || D == 128 || D == 256 ? D : 0; }
/* Tokens per tile for a compiled head dim. */
__host__ __device__ constexpr int att_tt(int DT) { return DT == 0 ? 16 : (DT <= 128 ? 64 : 32); }

struct AttLayout {
    int tt, dc, lds, dp, nparts, nsub; /* dc: 8-element pieces per row; dp = 8*dc */
    int whole;          /* tensor-core rebuild with all of W_h and the tile's U rows loaded at once */
    size_t off_uw;      /* whole: U rows [tt][r + 8] after W_h [r][ldw] in the work region */
    size_t off_k, off_v, off_q, off_spart, off_p, off_alpha, off_ml, off_tok, off_miss, off_work, bytes;
    size_t stage_bytes; /* tensor-core rebuild: one stage (W slice, then U slice) */
    int ldw, ldu, ldx;  /* leading dims: W slice, U slice (bf16), x tile (float) */
};

/* Largest work region of the whole-load rebuild (above it the r slices stream through two stages). */
constexpr size_t kWholeMax = 72 * 1024;

__host__ __device__ inline AttLayout att_layout(int D, int DT, int gc, int r)
{
    AttLayout L;
    L.tt = att_tt(DT);
    L.dc = (D + 7) / 8;
    L.lds = (L.dc | 1) * 8; /* odd number of 16-byte pieces per row: conflict-free column reads */
    L.dp = L.dc * 8;
    L.nparts = kAtNT / L.tt;
    L.nsub = kAtNT / L.dc;
    L.ldw = (DT ? DT : D) + 8;
    L.ldu = kRbKT + 8;
    L.ldx = D + 4;
    L.stage_bytes = (size_t)kRbKT * L.ldw * 2 + (size_t)L.tt * L.ldu * 2;
    size_t off = 0;
    L.off_k = off;
    off = align_up(off + (size_t)L.tt * L.lds * 2, 128);
    L.off_v = off;
    off = align_up(off + (size_t)L.tt * L.lds * 2, 128);
    L.off_q = off;
    off = align_up(off + (size_t)gc * L.dp * 4, 128);
    L.off_spart = off;
    off = align_up(off + (size_t)L.nparts * gc * L.tt * 4, 128);
    L.off_p = off;
    off = align_up(off + (size_t)L.tt * gc * 4, 128);
    L.off_alpha = off;
    off = align_up(off + (size_t)gc * 4, 16);
    L.off_ml = off;
    off = align_up(off + (size_t)gc * 8, 16);
    L.off_tok = off;
    off = align_up(off + (size_t)L.tt * 8, 16);
    L.off_miss = off;
    off = align_up(off + (size_t)L.tt * 4, 128);
    L.off_work = off;
    size_t work = 2 * L.stage_bytes;                                          /* rebuild stages */
    const size_t simple = (size_t)L.tt * kRbSimpleK * 4;                      /* CUDA-core rebuild slice */
    const size_t xs = (size_t)L.tt * L.ldx * 4;                               /* rebuilt rows (float) */
    const size_t red = (size_t)L.nsub * gc * L.dp * 4;                        /* end-of-item reduction */
    const size_t whole = (size_t)r * L.ldw * 2 + (size_t)L.tt * (r + 8) * 2;
    L.whole = DT != 0 && D == DT && r % 16 == 0 && whole <= kWholeMax;
    L.off_uw = (size_t)r * L.ldw * 2;
    if (L.whole && whole > work) work = whole;
    if (simple > work) work = simple;
    if (xs > work) work = xs;
    if (red > work) work = red;
    L.bytes = L.off_work + align_up(work, 128);
    return L;
}

/* ---- the key rebuild of one tile ------------------------------------------------------------ */

/* One pipeline stage: W rows k0..k0+kRbKT-1 (head h's D columns) and the tile's U rows at
   columns k0..k0+kRbKT-1. Out-of-range parts are zero so they add nothing to the GEMM. */
template <int DT, int TT>
__device__ void rebuild_load_stage(unsigned char *stage, const AttLayout &L, const uint16_t *U, const uint16_t *Wh,
                                   int64_t ldW, int r, int D, int k0, const int64_t *tok_s, bool aligned)
{
    uint16_t *Ws = reinterpret_cast<uint16_t *>(stage);
    uint16_t *Us = Ws + kRbKT * L.ldw;
    constexpr int WC = DT / 8; /* 16-byte pieces per W row */
    for (int idx = threadIdx.x; idx < kRbKT * WC; idx += kAtNT) {
        const int kr = idx / WC, cc = idx - kr * WC, k = k0 + kr;
        uint16_t *dst = Ws + kr * L.ldw + cc * 8;
        if (k < r && cc * 8 < D) { /* r, D multiples of 16: the piece is whole */
            const uint16_t *src = Wh + (int64_t)k * ldW + cc * 8;
            if (aligned) cp_async16(dst, src);
            else load8_slow(dst, src, 8);
        } else {
            store_zero16(dst);
        }
    }
    for (int idx = threadIdx.x; idx < TT * (kRbKT / 8); idx += kAtNT) {
        const int row = idx / (kRbKT / 8), cc = idx - row * (kRbKT / 8), k = k0 + cc * 8;
        const int64_t t = tok_s[row];
        uint16_t *dst = Us + row * L.ldu + cc * 8;
        if (t >= 0 && k < r) {
            const uint16_t *src = U + t * r + k;
            if (aligned) cp_async16(dst, src);
            else load8_slow(dst, src, 8);
        } else {
            store_zero16(dst);
        }
    }
}

/* One 16-deep step of the rebuild GEMM: acc += U[rows of this warp][kk..kk+16) W[kk..kk+16)[its
   columns] (U rows ldu apart, W rows ldw apart; 8 warps as 2 row halves x 4 column quarters). */
template <int DT, int TT>
__device__ __forceinline__ void mma_kstep(
    nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> (&acc)[TT / 32][DT / 64],
    const __nv_bfloat16 *Us, int ldu, const __nv_bfloat16 *Ws, int ldw, int kk)
{
    using namespace nvcuda;
    const int warp = threadIdx.x >> 5, wr = warp & 1, wc = warp >> 1;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[TT / 32];
#pragma unroll
    for (int i = 0; i < TT / 32; i++) wmma::load_matrix_sync(fa[i], Us + (wr * (TT / 2) + 16 * i) * ldu + kk, ldu);
#pragma unroll
    for (int j = 0; j < DT / 64; j++) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
        wmma::load_matrix_sync(fb, Ws + kk * ldw + wc * (DT / 4) + 16 * j, ldw);
#pragma unroll
        for (int i = 0; i < TT / 32; i++) wmma::mma_sync(acc[i][j], fa[i], fb, acc[i][j]);
    }
}

/* The rebuild's accumulators (8 warps as 2 row halves x 4 column quarters) into x_s [TT][ldx],
   then a barrier: x_s is complete for every thread. */
template <int DT, int TT>
__device__ __forceinline__ void store_acc_tile(
    nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> (&acc)[TT / 32][DT / 64],
    const AttLayout &L, float *x_s)
{
    const int warp = threadIdx.x >> 5, wr = warp & 1, wc = warp >> 1;
#pragma unroll
    for (int i = 0; i < TT / 32; i++)
#pragma unroll
        for (int j = 0; j < DT / 64; j++)
            nvcuda::wmma::store_matrix_sync(x_s + (wr * (TT / 2) + 16 * i) * L.ldx + wc * (DT / 4) + 16 * j, acc[i][j],
                                            L.ldx, nvcuda::wmma::mem_row_major);
    __syncthreads();
}

/*
 * x_s[row][0..D) = U[tok_s[row]] W_h for TT rows (float accumulate), tensor cores: 8 warps as
 * 2 (row halves of TT/2) x 4 (column quarters of DT/4), WMMA 16x16x16 bf16, r streamed in
 * slices of kRbKT through a 2-stage cp.async pipeline. Requires r % 16 == 0, D == DT.
 */
template <int DT, int TT>
__device__ void rebuild_mma(unsigned char *work, const AttLayout &L, const uint16_t *U, const uint16_t *W, int h,
                            int Hk, int r, int D, const int64_t *tok_s, float *x_s)
{
    using namespace nvcuda;
    constexpr int FR = TT / 32, NF = DT / 64;
    const uint16_t *Wh = W + (int64_t)h * D;
    const int64_t ldW = (int64_t)Hk * D;
    const bool aligned = (((uintptr_t)U | (uintptr_t)W) & 15) == 0; /* then every piece is */
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FR][NF];
#pragma unroll
    for (int i = 0; i < FR; i++)
#pragma unroll
        for (int j = 0; j < NF; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    const int nk = (r + kRbKT - 1) / kRbKT;
    rebuild_load_stage<DT, TT>(work, L, U, Wh, ldW, r, D, 0, tok_s, aligned);
    cp_async_commit();
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait_all();
        __syncthreads(); /* stage kt landed; everyone is done with stage kt-1 */
        if (kt + 1 < nk) {
            rebuild_load_stage<DT, TT>(work + ((kt + 1) & 1) * L.stage_bytes, L, U, Wh, ldW, r, D, (kt + 1) * kRbKT,
                                       tok_s, aligned);
            cp_async_commit();
        }
        const unsigned char *stage = work + (kt & 1) * L.stage_bytes;
        const __nv_bfloat16 *Ws = reinterpret_cast<const __nv_bfloat16 *>(stage);
        const __nv_bfloat16 *Us = Ws + kRbKT * L.ldw;
#pragma unroll
        for (int kk = 0; kk < kRbKT; kk += 16) {
            if (kt * kRbKT + kk >= r) break; /* zero padding of the last slice: skip the work */
            mma_kstep<DT, TT>(acc, Us, L.ldu, Ws, L.ldw, kk);
        }
    }
    __syncthreads(); /* x_s overwrites the stages */
    store_acc_tile<DT, TT>(acc, L, x_s);
}

/* The same on CUDA cores for every shape (r any, D even up to NG * 256): U in slices of
   kRbSimpleK columns in shared memory (float), W_h read from global memory (coalesced over d). */
template <int TT, int NG>
__device__ void rebuild_simple(unsigned char *work, const uint16_t *U, const uint16_t *W, int h, int Hk, int r, int D,
                               const int64_t *tok_s, float *x_s, int ldx)
{
    float *u_s = reinterpret_cast<float *>(work); /* [TT][kRbSimpleK] */
    const uint16_t *Wh = W + (int64_t)h * D;
    const int64_t ldW = (int64_t)Hk * D;
    float acc[NG][TT];
#pragma unroll
    for (int g = 0; g < NG; g++)
#pragma unroll
        for (int i = 0; i < TT; i++) acc[g][i] = 0.0f;
    for (int k0 = 0; k0 < r; k0 += kRbSimpleK) {
        const int kn = min(kRbSimpleK, r - k0);
        __syncthreads(); /* previous slice consumed */
        for (int i = threadIdx.x; i < TT * kRbSimpleK; i += kAtNT) {
            const int row = i / kRbSimpleK, k = i - row * kRbSimpleK;
            const int64_t t = tok_s[row];
            u_s[i] = t >= 0 && k < kn ? skv_bf16_to_f32(U[t * r + k0 + k]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < NG; g++) {
            const int d = threadIdx.x + g * kAtNT;
            if (d >= D) continue;
            for (int k = 0; k < kn; k++) {
                const float w = skv_bf16_to_f32(Wh[(int64_t)(k0 + k) * ldW + d]);
#pragma unroll
                for (int i = 0; i < TT; i++) acc[g][i] = fmaf(u_s[i * kRbSimpleK + k], w, acc[g][i]);
            }
        }
    }
    __syncthreads(); /* x_s may alias the slice */
#pragma unroll
    for (int g = 0; g < NG; g++) {
        const int d = threadIdx.x + g * kAtNT;
        if (d >= D) continue;
#pragma unroll
        for (int i = 0; i < TT; i++) x_s[i * ldx + d] = acc[g][i];
    }
    __syncthreads();
}

/* Rows of x_s roped at tok_s[row] and rounded to bf16 into dst (row stride ldd elements);
   rows past nrows are not written. zero_invalid (a shared-memory tile): rows whose token is
   -1 become zero, and the last 8-element piece of a row is written whole (zeros past D). */
__device__ void rope_rows(const float *x_s, int ldx, const int64_t *tok_s, int nrows, int D,
                          const skv_cuda_shape &sh, uint16_t *dst, int64_t ldd, bool zero_invalid)
{
    const int R = sh.rotary_dim, h2 = R / 2, dcc = (D + 7) / 8;
    for (int idx = threadIdx.x; idx < nrows * dcc; idx += kAtNT) {
        const int row = idx / dcc, d0 = (idx - row * dcc) * 8;
        const int64_t t = tok_s[row];
        if (t < 0 && !zero_invalid) continue;
        uint32_t w[4] = {0, 0, 0, 0};
        if (t >= 0) {
            const float *x = x_s + row * ldx;
            const float *cs = sh.cos_tab + t * h2, *sn = sh.sin_tab + t * h2;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int d = d0 + 2 * j;
                const uint32_t lo = d < D ? skv_f32_to_bf16(rope_elem(x, d, R, sh.interleaved, cs, sn)) : 0u;
                const uint32_t hi = d + 1 < D ? skv_f32_to_bf16(rope_elem(x, d + 1, R, sh.interleaved, cs, sn)) : 0u;
                w[j] = lo | (hi << 16);
            }
        }
        uint16_t *p = dst + row * ldd + d0;
        if (d0 + 8 <= D || zero_invalid) { /* shared-memory rows are padded: the piece is whole, zeros past D */
            store8(p, w);
        } else {
            for (int j = 0; j < D - d0; j++) p[j] = (uint16_t)(w[j / 2] >> (16 * (j & 1)));
        }
    }
}

/* Issues (cp.async, not committed) W_h [r][D] into the work region for rebuild_mma_whole: it
   depends on nothing a decode step writes, so an item issues it before waiting for the
   previous kernel. */
template <int DT>
__device__ void rebuild_whole_issue_w(unsigned char *work, const AttLayout &L, const uint16_t *W, int h, int Hk, int r)
{
    uint16_t *Ws = reinterpret_cast<uint16_t *>(work);
    const uint16_t *Wh = W + (int64_t)h * DT;
    const int64_t ldW = (int64_t)Hk * DT;
    const bool aligned = ((uintptr_t)W & 15) == 0;
    constexpr int WC = DT / 8;
    for (int idx = threadIdx.x; idx < r * WC; idx += kAtNT) {
        const int k = idx / WC, cc = idx - k * WC;
        uint16_t *dst = Ws + k * L.ldw + cc * 8;
        const uint16_t *src = Wh + (int64_t)k * ldW + cc * 8;
        if (aligned) cp_async16(dst, src);
        else load8_slow(dst, src, 8);
    }
}

/* Issues (cp.async, not committed) the tile's U rows [TT][r] (rows whose token is -1 are zero). */
template <int TT>
__device__ void rebuild_whole_issue_u(unsigned char *work, const AttLayout &L, const uint16_t *U, int r,
                                      const int64_t *tok_s)
{
    uint16_t *Us = reinterpret_cast<uint16_t *>(work + L.off_uw);
    const bool aligned = ((uintptr_t)U & 15) == 0;
    const int UC = r / 8, ldu = r + 8;
    for (int idx = threadIdx.x; idx < TT * UC; idx += kAtNT) {
        const int row = idx / UC, cc = idx - row * UC;
        const int64_t t = tok_s[row];
        uint16_t *dst = Us + row * ldu + cc * 8;
        if (t < 0) store_zero16(dst);
        else if (aligned) cp_async16(dst, U + t * r + cc * 8);
        else load8_slow(dst, U + t * r + cc * 8, 8);
    }
}

/* x_s = U_tile W_h from the loaded work region (the caller waited for the copies and synced). */
template <int DT, int TT>
__device__ void rebuild_mma_whole(unsigned char *work, const AttLayout &L, int r, float *x_s)
{
    using namespace nvcuda;
    constexpr int FR = TT / 32, NF = DT / 64;
    const int ldu = r + 8;
    const __nv_bfloat16 *Ws = reinterpret_cast<const __nv_bfloat16 *>(work);
    const __nv_bfloat16 *Us = reinterpret_cast<const __nv_bfloat16 *>(work + L.off_uw);
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FR][NF];
#pragma unroll
    for (int i = 0; i < FR; i++)
#pragma unroll
        for (int j = 0; j < NF; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    for (int kk = 0; kk < r; kk += 16) mma_kstep<DT, TT>(acc, Us, ldu, Ws, L.ldw, kk);
    __syncthreads(); /* x_s overwrites W_h and U */
    store_acc_tile<DT, TT>(acc, L, x_s);
}

/*
 * RoPE of a tile in the common layout (pairs (i, i + D/2), rotary dim D, D % 16 == 0) in
 * 8-dim pieces: thread-owned (row, piece) items, the table rows prefetched into registers
 * before the GEMM (rope_fast_load) and applied after it (rope_fast_apply), same operations
 * as skv_rope_rotate.
 */
constexpr int kRopeItems = 2; /* (row, piece) items per thread: TT * D/16 <= 2 * kAtNT */

struct RopeRegs {
    float4 c[kRopeItems][2], s[kRopeItems][2];
};

__device__ __forceinline__ void rope_fast_load(RopeRegs &rr, const int64_t *tok_s, int TT, int D, const skv_cuda_shape &sh)
{
    const int pieces = D / 16, h2 = D / 2;
#pragma unroll
    for (int u = 0; u < kRopeItems; u++) {
        const int idx = threadIdx.x + u * kAtNT, row = idx / pieces, p = idx - row * pieces;
        if (row < TT && tok_s[row] >= 0) {
            const float4 *cs = reinterpret_cast<const float4 *>(sh.cos_tab + tok_s[row] * h2 + p * 8);
            const float4 *sn = reinterpret_cast<const float4 *>(sh.sin_tab + tok_s[row] * h2 + p * 8);
            rr.c[u][0] = cs[0], rr.c[u][1] = cs[1], rr.s[u][0] = sn[0], rr.s[u][1] = sn[1];
        }
    }
}

__device__ __forceinline__ void rope_fast_apply(const RopeRegs &rr, const float *x_s, int ldx, const int64_t *tok_s,
                                                int TT, int D, uint16_t *Ks, int lds)
{
    const int pieces = D / 16, h2 = D / 2;
#pragma unroll
    for (int u = 0; u < kRopeItems; u++) {
        const int idx = threadIdx.x + u * kAtNT, row = idx / pieces, p = idx - row * pieces;
        if (row >= TT) continue;
        uint32_t wa[4] = {0, 0, 0, 0}, wb[4] = {0, 0, 0, 0};
        if (tok_s[row] >= 0) {
            const float *xa = x_s + row * ldx + p * 8, *xb = xa + h2;
            const float c[8] = {rr.c[u][0].x, rr.c[u][0].y, rr.c[u][0].z, rr.c[u][0].w,
                                rr.c[u][1].x, rr.c[u][1].y, rr.c[u][1].z, rr.c[u][1].w};
            const float sn[8] = {rr.s[u][0].x, rr.s[u][0].y, rr.s[u][0].z, rr.s[u][0].w,
                                 rr.s[u][1].x, rr.s[u][1].y, rr.s[u][1].z, rr.s[u][1].w};
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                float a0, b0, a1, b1;
                skv_rope_rotate(xa[j], xb[j], c[j], sn[j], &a0, &b0);
                skv_rope_rotate(xa[j + 1], xb[j + 1], c[j + 1], sn[j + 1], &a1, &b1);
                wa[j / 2] = (uint32_t)skv_f32_to_bf16(a0) | ((uint32_t)skv_f32_to_bf16(a1) << 16);
                wb[j / 2] = (uint32_t)skv_f32_to_bf16(b0) | ((uint32_t)skv_f32_to_bf16(b1) << 16);
            }
        }
        *reinterpret_cast<uint4 *>(Ks + row * lds + p * 8) = make_uint4(wa[0], wa[1], wa[2], wa[3]);
        *reinterpret_cast<uint4 *>(Ks + row * lds + h2 + p * 8) = make_uint4(wb[0], wb[1], wb[2], wb[3]);
    }
}

/* The rebuild of one tile into x_s, by the path this shape takes. */
template <int DT>
__device__ void rebuild_tile(unsigned char *work, const AttLayout &L, const skv_cuda_shape &sh, const uint16_t *U,
                             const uint16_t *W, int h, const int64_t *tok_s, float *x_s)
{
    constexpr int TT = att_tt(DT);
    if constexpr (DT != 0) {
        if (sh.r % 16 == 0 && sh.D == DT) {
            rebuild_mma<DT, TT>(work, L, U, W, h, sh.Hk, sh.r, sh.D, tok_s, x_s);
            return;
        }
        rebuild_simple<TT, 1>(work, U, W, h, sh.Hk, sh.r, sh.D, tok_s, x_s, L.ldx);
    } else {
        rebuild_simple<TT, 4>(work, U, W, h, sh.Hk, sh.r, sh.D, tok_s, x_s, L.ldx);
    }
}

/* ---- the attention kernel -------------------------------------------------------------------- */

struct AttendArgs {
    int32_t Hq, Hk, D, G, nqc;
    float scale_log2;                 /* scores live in the log2 domain */
    const uint16_t *q;                /* [B, Hq, D] */
    float *part_acc;                  /* [B, Hq, n_items, D] */
    float2 *part_ml;                  /* [B, Hq, n_items] */
    skv_cuda_items it;
    /* decode (seqs != NULL) */
    const skv_cuda_seq *seqs;
    skv_cuda_shape sh;
    const int32_t *sel_idx, *sel_ids, *vsrc; /* [B, Hk, S] */
    const int32_t *sel_cnt;           /* [B, Hk] the step's count k of each head (written by step 3) */
    float *pbuf;                      /* [B, Hq, S*c]: host pass only, else NULL */
    /* op-level spans (seqs == NULL) */
    int32_t n_spans;
    skv_kv_span spans[SKV_MAX_SPANS];
    const skv_cuda_io *io;            /* decode: q, k_new, v_new from here (step 1 published them) */
};

/* The selected tokens k c of (sequence b, KV head h) at this step (the step's count, read after the
   selection: the caller has waited for it). */
__device__ __forceinline__ int64_t att_sel_tokens(const AttendArgs &a, int b, int h)
{
    return (int64_t)__ldcg(a.sel_cnt + (int64_t)b * a.Hk + h) * a.sh.c;
}

/* One non-empty span as a range walks it: tokens [start, end) of the concatenation. */
struct AttSpan {
    const uint16_t *k, *v; /* head h's first token */
    int64_t start, end, stride;
    int aligned; /* k, v 16-byte aligned and stride % 8 == 0 */
};

__device__ int att_add_span(AttSpan *sp, int n, int64_t *pos, const uint16_t *k, const uint16_t *v, int64_t n_tokens,
                            int64_t head_off, int64_t stride)
{
    if (n_tokens <= 0) return n; /* empty spans are dropped (their pointers may be NULL) */
    AttSpan &s = sp[n];
    s.k = k + head_off;
    s.v = v + head_off;
    s.start = *pos;
    s.end = *pos + n_tokens;
    s.stride = stride;
    s.aligned = (((uintptr_t)s.k | (uintptr_t)s.v) & 15) == 0 && stride % 8 == 0;
    *pos = s.end;
    return n + 1;
}

/* The resident spans of KV head h of sequence b (the decode plan without the selected span),
   or the caller's spans. */
__device__ int att_resident_spans(const AttendArgs &a, int b, int h, AttSpan *sp)
{
    int n = 0;
    int64_t pos = 0;
    if (a.seqs) {
        const skv_cuda_seq &s = a.seqs[b];
        const skv_cuda_shape &sh = a.sh;
        skv_span_shape ss[SKV_N_SPANS];
        skv_plan_spans(sh.O, sh.c, sh.S, a.D, s.n_local, s.n_gen, sh.gen_cap, ss);
        const uint16_t *kn = (const uint16_t *)a.io->k, *vn = (const uint16_t *)a.io->v;
        const uint16_t *ks[SKV_N_SPANS] = {s.out_k, s.loc_k, nullptr, s.gen_k, kn + (int64_t)b * a.Hk * a.D};
        const uint16_t *vs[SKV_N_SPANS] = {s.out_v, s.loc_v, nullptr, s.gen_v, vn + (int64_t)b * a.Hk * a.D};
        for (int i = 0; i < SKV_N_SPANS; i++)
            if (i != SKV_SPAN_SELECTED)
                n = att_add_span(sp, n, &pos, ks[i], vs[i], ss[i].n_tokens, h * ss[i].head_stride, a.D);
    } else {
        for (int i = 0; i < a.n_spans; i++)
            n = att_add_span(sp, n, &pos, a.spans[i].k, a.spans[i].v, a.spans[i].n_tokens, h * a.spans[i].head_stride,
                             a.spans[i].token_stride);
    }
    return n;
}

/* ---- the fragment kernel's shape and shared-memory layout (attend_mma_kernel) ------------------ */
constexpr int kMmGroups = 4;
constexpr int kMmGroupNT = 128;
constexpr int kMmNT = kMmGroups * kMmGroupNT;
constexpr int kMmTT = 64;        /* tokens per item (= att_tt(128)) */
constexpr int kMmD = 128;
constexpr int kMmLdv = kMmD + 8; /* K, V and W_h rows: 272 bytes, conflict-free ldmatrix */
constexpr int kMmMaxG = 8;
constexpr int kMmMaxRes = 256;   /* resident items of one tile each: up to 16k resident tokens */
constexpr size_t kMmSmemMax = 220 * 1024; /* dynamic shared memory, below the opt-in limit of sm_90 */

static_assert(kMmMaxG * kMmD * sizeof(float) <= 16 * kMmLdv * 2, "a warp's partial fits in its 16 V rows");

/* fp8 values: the 128 codes of a row (src: NULL: zeros) into the upper half of its bf16 row dst
   (bytes 128 .. 255), 16-byte pieces half, half + 2, ..; mm_decode_row makes them bf16 in place.
   The fallback of an unaligned row (or none) of attend_mma_kernel's mm_copy_v. */
__device__ __noinline__ void mm_copy_codes_slow(uint16_t *dst, const uint16_t *src, int half)
{
    unsigned char *d = reinterpret_cast<unsigned char *>(dst) + kMmD;
    const uint8_t *c = reinterpret_cast<const uint8_t *>(src);
    for (int p = half; p < kMmD / 16; p += 2) {
        const uint2 lo = c ? fp8_load8_slow(c + 16 * p, 8) : make_uint2(0u, 0u);
        const uint2 hi = c ? fp8_load8_slow(c + 16 * p + 8, 8) : make_uint2(0u, 0u);
        *reinterpret_cast<uint4 *>(d + 16 * p) = make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
}

/* The codes of a row (mm_copy_v, landed) to bf16 in place, with the row's exponent k: the thread's
   pieces half, half + 2, .. are read, then (the warp's other thread of the row reads the bytes this
   one overwrites) written as bf16 pieces 2p, 2p + 1. Every lane of the warp calls it. */
__device__ __forceinline__ void mm_decode_row(uint16_t *row, int half, int k)
{
    const unsigned char *c = reinterpret_cast<const unsigned char *>(row) + kMmD;
    uint4 codes[kMmD / 32];
#pragma unroll
    for (int j = 0; j < kMmD / 32; j++) codes[j] = *reinterpret_cast<const uint4 *>(c + 16 * (half + 2 * j));
    __syncwarp();
#pragma unroll
    for (int j = 0; j < kMmD / 32; j++) {
        const int p = half + 2 * j;
        *reinterpret_cast<uint4 *>(row + 16 * p) = fp8x8_to_bf16(make_uint2(codes[j].x, codes[j].y), k);
        *reinterpret_cast<uint4 *>(row + 16 * p + 8) = fp8x8_to_bf16(make_uint2(codes[j].z, codes[j].w), k);
    }
    __syncwarp();
}

/* mm_copy_row's rare paths (zeros, or a source that is not 16-byte aligned), out of line: inlined,
   they are if-converted into predicated loads that every copy issues. */
__device__ __noinline__ void mm_copy_row_slow(uint16_t *dst, const uint16_t *src, int n, int half)
{
    for (int p = half; p < n; p += 2) {
        if (!src) store_zero16(dst + p * 8);
        else load8_slow(dst + p * 8, src + p * 8, 8);
    }
}

/* 16-byte pieces half, half + 2, ... of a row of n pieces from src (NULL: zeros) into dst. */
__device__ __forceinline__ void mm_copy_row(uint16_t *dst, const uint16_t *src, int n, int half)
{
    if (src && ((uintptr_t)src & 15) == 0) {
        for (int p = half; p < n; p += 2) cp_async16(dst + p * 8, src + p * 8);
    } else {
        mm_copy_row_slow(dst, src, n, half);
    }
}

/* The V row of m into dst: bf16 values, or (fp8: a selected item of an fp8 cache) the codes. */
__device__ __forceinline__ void mm_copy_v(uint16_t *dst, const uint16_t *src, int half, bool fp8)
{
    if (!fp8) {
        mm_copy_row(dst, src, kMmD / 8, half);
    } else if (src && ((uintptr_t)src & 15) == 0) {
        unsigned char *d = reinterpret_cast<unsigned char *>(dst) + kMmD;
        const unsigned char *c = reinterpret_cast<const unsigned char *>(src);
        for (int p = half; p < kMmD / 16; p += 2) cp_async16(d + 16 * p, c + 16 * p);
    } else {
        mm_copy_codes_slow(dst, src, half);
    }
}

struct MmLayout {
    int ldk;                    /* U and K rows: max(r + 8, 136) elements (odd multiples of 16 bytes:
                                   conflict-free ldmatrix) */
    size_t uk_bytes, stage_bytes, off_v, off_tok, off_miss, off_groups, bytes;
};

__host__ __device__ inline MmLayout mm_layout(int r)
{
    MmLayout L;
    L.ldk = r + 8 > kMmLdv ? r + 8 : kMmLdv;
    /* U (selected item) or K (resident item), per warp a block of 16 rows */
    L.uk_bytes = align_up((size_t)kMmTT * L.ldk * 2, 128);
    L.off_v = L.uk_bytes;
    L.off_tok = L.off_v + align_up((size_t)kMmTT * kMmLdv * 2, 128);
    L.off_miss = L.off_tok + 2 * kMmTT * sizeof(int64_t); /* token and miss rows by item parity */
    L.stage_bytes = align_up(L.off_miss + 2 * kMmTT * sizeof(int32_t), 128);
    L.off_groups = align_up((size_t)r * kMmLdv * 2, 128); /* W_h first */
    L.bytes = L.off_groups + kMmGroups * L.stage_bytes;
    return L;
}

/* ---- host side --------------------------------------------------------------------------------- */

typedef void (*AttendKernel)(const AttendArgs);

/* Query heads per CTA: the largest of 8, 4, 2, 1 dividing G (no partial groups). */
inline int att_gc(int G) { return G % 8 == 0 ? 8 : G % 4 == 0 ? 4 : G % 2 == 0 ? 2 : 1; }

/* The fragment kernel's shapes: D = 128, r % 16 == 0 with its shared memory within the
   opt-in limit, G <= 8, rotate-half RoPE over all of D (r = 0: a dense layer's shape, no
   selected items). */
inline bool mm_shape_ok(const skv_cuda_shape *sh)
{
    const int G = sh->Hq / sh->Hk;
    return sh->D == kMmD && sh->r >= 0 && sh->r % 16 == 0 && mm_layout(sh->r).bytes <= kMmSmemMax && G >= 1 &&
           G <= kMmMaxG && !sh->interleaved && sh->rotary_dim == sh->D && sh->Hk <= 65535 && sh->B <= 65535;
}

/* The kernels' arguments of a decode step (steps 4 and 4b). */
inline AttendArgs attend_args(const skv_cuda_shape *sh, const skv_cuda_seq *seqs, const skv_cuda_dws *ws)
{
    AttendArgs a;
    memset(&a, 0, sizeof a);
    a.Hq = sh->Hq, a.Hk = sh->Hk, a.D = sh->D, a.G = sh->Hq / sh->Hk;
    a.nqc = a.G / att_gc(a.G);
    a.scale_log2 = sh->scale * 1.44269504088896341f;
    a.io = ws->io;
    a.part_acc = ws->part_acc;
    a.part_ml = ws->part_ml;
    a.it = ws->it;
    a.seqs = seqs;
    a.sh = *sh;
    a.sel_idx = ws->sel_idx, a.sel_ids = ws->sel_ids, a.vsrc = ws->vsrc, a.sel_cnt = ws->sel_cnt;
    a.pbuf = ws->pbuf;
    return a;
}

} /* namespace */

#endif /* SKV_CUDA_ATTN_CUH */
