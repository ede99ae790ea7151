/*
 * skv_cuda_attn.cu - the sparse path of the cuda backend: rebuild selected
 * keys from the factorization, gather selected values from the host store,
 * split-K decode/span attention, the per-step append, input checks and small
 * copies (interface: skv_cuda.h).
 *
 * Nothing here is on the exact-selection path (DESIGN.md section 5): tensor
 * cores and any summation order are allowed, within the tolerances of
 * section 6 (rebuilt keys 1e-2 max relative row error, attention 2e-3
 * relative L2 per head, both against double).
 *
 * Every launcher only enqueues on its stream: no allocation, no
 * synchronization. Per-sequence values of the batched kernels (lengths,
 * pointers) are read from the device descriptors, never from the host, so a
 * decode step is a fixed launch sequence. Pointers that come from those
 * descriptors (or from callers) may have any alignment a bf16 pointer can
 * have, so every vectorized access checks alignment and has an element-wise
 * fallback that writes the same result.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <mma.h>
#include <stdint.h>

#include "skv_cuda.h"
#include "skv_numerics.h"

/* All dynamic shared memory of this file; every kernel carves it itself. */
extern __shared__ __align__(128) unsigned char skv_attn_smem[];

namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr size_t kSmemDefaultMax = 48 * 1024; /* above this a kernel must opt in */

/* ---- small helpers -------------------------------------------------------------------------- */

__host__ __device__ inline int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Grid size of a grid-stride kernel: enough blocks for the work, at most cap. */
inline unsigned grid_for(int64_t units, int64_t per_block, int64_t cap)
{
    int64_t g = ceil_div64(units, per_block);
    if (g < 1) g = 1;
    if (g > cap) g = cap;
    return (unsigned)g;
}

/* Kernels that need more than 48 KiB of dynamic shared memory must say so first
   (a function attribute: no allocation, no synchronization). */
template <class K>
cudaError_t allow_smem(K kernel, size_t bytes)
{
    if (bytes <= kSmemDefaultMax) return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

__device__ __forceinline__ float warp_max(float x)
{
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x)
{
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
    return x;
}

__device__ __forceinline__ unsigned long long warp_min_u64(unsigned long long x)
{
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long y = __shfl_xor_sync(kFullMask, x, o);
        x = y < x ? y : x;
    }
    return x;
}

__device__ __forceinline__ int warp_sum_int(int x)
{
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
    return x;
}

/* Block-wide max or sum; tmp holds one float per warp. All threads get the result. */
template <bool kMax>
__device__ float block_reduce(float x, float *tmp)
{
    x = kMax ? warp_max(x) : warp_sum(x);
    if ((threadIdx.x & 31) == 0) tmp[threadIdx.x >> 5] = x;
    __syncthreads();
    float r = tmp[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); i++) r = kMax ? fmaxf(r, tmp[i]) : r + tmp[i];
    __syncthreads(); /* tmp may be reused */
    return r;
}

/* 8 packed bf16 (little-endian: element 2i is the low half of word i) -> 8 floats. */
__device__ __forceinline__ void bf16x8_to_f32(const uint4 v, float f[8])
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

/* 16-byte global -> shared copy that does not occupy registers (Ampere+ cp.async). */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ void store_zero16(void *smem) { *reinterpret_cast<uint4 *>(smem) = make_uint4(0, 0, 0, 0); }

/* The element-wise fallback of cp_async16: 8 bf16 from src (any alignment), of which
   only the first n are read (the rest are 0), into 16-byte aligned shared memory. */
__device__ __forceinline__ void load8_slow(skv_bf16 *dst, const skv_bf16 *src, int n)
{
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const uint32_t lo = 2 * j < n ? src[2 * j] : 0u;
        const uint32_t hi = 2 * j + 1 < n ? src[2 * j + 1] : 0u;
        w[j] = lo | (hi << 16);
    }
    *reinterpret_cast<uint4 *>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

/* 8 packed bf16 to global memory of any (2-byte) alignment. */
__device__ __forceinline__ void store8(skv_bf16 *dst, const uint32_t w[4])
{
    if (((uintptr_t)dst & 15) == 0) {
        *reinterpret_cast<uint4 *>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            dst[2 * j] = (skv_bf16)(w[j] & 0xffffu);
            dst[2 * j + 1] = (skv_bf16)(w[j] >> 16);
        }
    }
}

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
 * Rebuild keys: k_sel[b][h][s*c + i] = RoPE(U[t] W_h) at t = sel_ids[b][h][s]*c + i.
 *
 * Per (b, h) this is a [S*c, r] x [r, D] GEMM whose A rows are gathered (chunks of c
 * consecutive U rows). Tensor path (r % 16 == 0, D % 16 == 0, D <= 256): a CTA computes
 * 64 rows x all D columns with WMMA bf16 (float accumulate), streaming r in slices of 32
 * through a 2-stage cp.async pipeline; the accumulator goes through shared memory so
 * RoPE can pair dims across warps. Memory-bound at B = 8 (U rows ~42 MB gathered,
 * k_sel 34 MB written); W_h (r*D*2 bytes) is re-read per CTA from L2.
 * ============================================================================================= */

constexpr int kRbM = 64;   /* rows per CTA */
constexpr int kRbKT = 32;  /* r slice per pipeline stage */
constexpr int kRbNT = 256; /* 8 warps: 2 (rows of 32) x 4 (columns of DT/4) */

struct RebuildLayout {
    int ldw, ldu, ldx;  /* leading dims: W slice (bf16), U slice (bf16), accumulator (float) */
    size_t stage_bytes; /* one stage: W slice [kRbKT][ldw] then U slice [kRbM][ldu] */
    size_t off_tok, bytes;
};

/* Padding by 8 bf16 / 4 floats keeps WMMA loads/stores bank-conflict-light and every
   fragment pointer 32-byte aligned (all row offsets below are multiples of 32 bytes). */
__host__ __device__ inline RebuildLayout rebuild_layout(int DT)
{
    RebuildLayout L;
    L.ldw = DT + 8;
    L.ldu = kRbKT + 8;
    L.ldx = DT + 4;
    L.stage_bytes = (size_t)kRbKT * L.ldw * 2 + (size_t)kRbM * L.ldu * 2;
    size_t region = 2 * L.stage_bytes;
    const size_t acc = (size_t)kRbM * L.ldx * 4; /* aliases the stages once the GEMM is done */
    if (acc > region) region = acc;
    L.off_tok = align_up(region, 128);
    L.bytes = L.off_tok + (size_t)kRbM * sizeof(int64_t);
    return L;
}

/* One pipeline stage: W rows k0..k0+kRbKT-1 (head h's D columns) and the CTA's U rows at
   columns k0..k0+kRbKT-1. Out-of-range parts are zero so they add nothing to the GEMM. */
template <int DT>
__device__ void rebuild_load_stage(unsigned char *stage, const RebuildLayout &L, const skv_bf16 *U,
                                   const skv_bf16 *Wh, int64_t ldW, int r, int D, int k0, const int64_t *tok_s,
                                   bool aligned)
{
    skv_bf16 *Ws = reinterpret_cast<skv_bf16 *>(stage);
    skv_bf16 *Us = Ws + kRbKT * L.ldw;
    constexpr int WC = DT / 8; /* 16-byte pieces per W row */
    for (int idx = threadIdx.x; idx < kRbKT * WC; idx += kRbNT) {
        const int kr = idx / WC, cc = idx - kr * WC, k = k0 + kr;
        skv_bf16 *dst = Ws + kr * L.ldw + cc * 8;
        if (k < r && cc * 8 < D) { /* r, D multiples of 16: the piece is whole */
            const skv_bf16 *src = Wh + (int64_t)k * ldW + cc * 8;
            if (aligned)
                cp_async16(dst, src);
            else
                load8_slow(dst, src, 8);
        } else {
            store_zero16(dst);
        }
    }
    for (int idx = threadIdx.x; idx < kRbM * (kRbKT / 8); idx += kRbNT) {
        const int row = idx / (kRbKT / 8), cc = idx - row * (kRbKT / 8), k = k0 + cc * 8;
        const int64_t t = tok_s[row];
        skv_bf16 *dst = Us + row * L.ldu + cc * 8;
        if (t >= 0 && k < r) {
            const skv_bf16 *src = U + t * r + k;
            if (aligned)
                cp_async16(dst, src);
            else
                load8_slow(dst, src, 8);
        } else {
            store_zero16(dst);
        }
    }
}

/* Tensor-core rebuild for r % 16 == 0 and D % 16 == 0, D <= DT (DT = 64, 128, 256). */
template <int DT>
__global__ void __launch_bounds__(kRbNT) rebuild_wmma_kernel(const skv_cuda_shape sh, const skv_cuda_seq *seqs,
                                                             const int32_t *sel_ids, skv_bf16 *k_sel)
{
    using namespace nvcuda;
    constexpr int NF = DT / 64; /* 16-column tiles per warp */
    const RebuildLayout L = rebuild_layout(DT);
    int64_t *tok_s = reinterpret_cast<int64_t *>(skv_attn_smem + L.off_tok);
    float *x_s = reinterpret_cast<float *>(skv_attn_smem);

    const int tid = threadIdx.x, warp = tid >> 5;
    const int b = blockIdx.z, h = blockIdx.y;
    const int D = sh.D, r = sh.r, c = sh.c, S = sh.S, Hk = sh.Hk;
    const int64_t SC = (int64_t)S * c, m0 = (int64_t)blockIdx.x * kRbM;
    const skv_bf16 *U = seqs[b].u;
    const skv_bf16 *W = seqs[b].w;
    const skv_bf16 *Wh = W + (int64_t)h * D;
    const int64_t ldW = (int64_t)Hk * D;
    /* with r, D multiples of 16 every piece offset is a multiple of 16 bytes */
    const bool aligned = (((uintptr_t)U | (uintptr_t)W) & 15) == 0;

    /* token of each row; -1 past the end of the selection (last CTA of a head) */
    for (int i = tid; i < kRbM; i += kRbNT) {
        const int64_t j = m0 + i;
        tok_s[i] = j < SC ? (int64_t)sel_ids[((int64_t)b * Hk + h) * S + j / c] * c + j % c : -1;
    }
    __syncthreads();

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][NF];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NF; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    const int wr = warp & 1, wc = warp >> 1; /* rows 32*wr.., columns wc*DT/4.. */

    const int nk = (r + kRbKT - 1) / kRbKT;
    rebuild_load_stage<DT>(skv_attn_smem, L, U, Wh, ldW, r, D, 0, tok_s, aligned);
    cp_async_commit();
    for (int kt = 0; kt < nk; kt++) {
        cp_async_wait_all();
        __syncthreads(); /* stage kt landed; everyone is done with stage kt-1 */
        if (kt + 1 < nk) {
            rebuild_load_stage<DT>(skv_attn_smem + ((kt + 1) & 1) * L.stage_bytes, L, U, Wh, ldW, r, D,
                                   (kt + 1) * kRbKT, tok_s, aligned);
            cp_async_commit();
        }
        const unsigned char *stage = skv_attn_smem + (kt & 1) * L.stage_bytes;
        const __nv_bfloat16 *Ws = reinterpret_cast<const __nv_bfloat16 *>(stage);
        const __nv_bfloat16 *Us = Ws + kRbKT * L.ldw;
#pragma unroll
        for (int kk = 0; kk < kRbKT; kk += 16) {
            if (kt * kRbKT + kk >= r) break; /* zero padding of the last slice: skip the work */
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
#pragma unroll
            for (int i = 0; i < 2; i++) wmma::load_matrix_sync(fa[i], Us + (32 * wr + 16 * i) * L.ldu + kk, L.ldu);
#pragma unroll
            for (int j = 0; j < NF; j++) {
                const int col = wc * (DT / 4) + 16 * j;
                if (col >= D) continue;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
                wmma::load_matrix_sync(fb, Ws + kk * L.ldw + col, L.ldw);
#pragma unroll
                for (int i = 0; i < 2; i++) wmma::mma_sync(acc[i][j], fa[i], fb, acc[i][j]);
            }
        }
    }
    __syncthreads(); /* the accumulator tile overwrites the stages */
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NF; j++) {
            const int col = wc * (DT / 4) + 16 * j;
            if (col < D)
                wmma::store_matrix_sync(x_s + (32 * wr + 16 * i) * L.ldx + col, acc[i][j], L.ldx,
                                        wmma::mem_row_major);
        }
    __syncthreads();

    /* RoPE at each row's position, 8 dims per thread, 16-byte stores */
    const int R = sh.rotary_dim, h2 = R / 2, inter = sh.interleaved, DC = D / 8;
    for (int idx = tid; idx < kRbM * DC; idx += kRbNT) {
        const int row = idx / DC, d0 = (idx - row * DC) * 8;
        const int64_t t = tok_s[row];
        if (t < 0) continue;
        const float *x = x_s + row * L.ldx;
        const float *cs = sh.cos_tab + t * h2, *sn = sh.sin_tab + t * h2;
        uint32_t w[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t lo = skv_f32_to_bf16(rope_elem(x, d0 + 2 * j, R, inter, cs, sn));
            const uint32_t hi = skv_f32_to_bf16(rope_elem(x, d0 + 2 * j + 1, R, inter, cs, sn));
            w[j] = lo | (hi << 16);
        }
        store8(k_sel + (((int64_t)b * Hk + h) * SC + m0 + row) * D + d0, w);
    }
}

/* CUDA-core rebuild for every other shape (r 1..1024, D even up to 1024): a CTA computes
   kRbsRows rows, each thread some columns for all rows (W read once per CTA, coalesced). */
constexpr int kRbsRows = 8;
constexpr int kRbsNT = 128;

inline size_t rebuild_simple_smem(int r, int D)
{
    return (size_t)kRbsRows * (r + D) * sizeof(float) + kRbsRows * sizeof(int64_t);
}

__global__ void __launch_bounds__(kRbsNT) rebuild_simple_kernel(const skv_cuda_shape sh, const skv_cuda_seq *seqs,
                                                                const int32_t *sel_ids, skv_bf16 *k_sel)
{
    const int tid = threadIdx.x;
    const int b = blockIdx.z, h = blockIdx.y;
    const int D = sh.D, r = sh.r, c = sh.c, S = sh.S, Hk = sh.Hk;
    const int64_t SC = (int64_t)S * c, m0 = (int64_t)blockIdx.x * kRbsRows;
    float *u_s = reinterpret_cast<float *>(skv_attn_smem);   /* [rows][r] */
    float *x_s = u_s + kRbsRows * r;                          /* [rows][D] */
    int64_t *tok_s = reinterpret_cast<int64_t *>(x_s + kRbsRows * D); /* 8-aligned: 32*(r+D) bytes */
    const skv_bf16 *U = seqs[b].u;
    const skv_bf16 *Wh = seqs[b].w + (int64_t)h * D;
    const int64_t ldW = (int64_t)Hk * D;

    for (int i = tid; i < kRbsRows; i += kRbsNT) {
        const int64_t j = m0 + i;
        tok_s[i] = j < SC ? (int64_t)sel_ids[((int64_t)b * Hk + h) * S + j / c] * c + j % c : -1;
    }
    __syncthreads();
    for (int i = tid; i < kRbsRows * r; i += kRbsNT) {
        const int row = i / r, k = i - row * r;
        const int64_t t = tok_s[row];
        u_s[i] = t >= 0 ? skv_bf16_to_f32(U[t * r + k]) : 0.0f;
    }
    __syncthreads();
    for (int d = tid; d < D; d += kRbsNT) {
        float acc[kRbsRows];
#pragma unroll
        for (int row = 0; row < kRbsRows; row++) acc[row] = 0.0f;
        for (int k = 0; k < r; k++) {
            const float w = skv_bf16_to_f32(Wh[(int64_t)k * ldW + d]);
#pragma unroll
            for (int row = 0; row < kRbsRows; row++) acc[row] = fmaf(u_s[row * r + k], w, acc[row]);
        }
#pragma unroll
        for (int row = 0; row < kRbsRows; row++) x_s[row * D + d] = acc[row];
    }
    __syncthreads();
    const int R = sh.rotary_dim, h2 = R / 2, inter = sh.interleaved;
    for (int i = tid; i < kRbsRows * D; i += kRbsNT) {
        const int row = i / D, d = i - row * D;
        const int64_t t = tok_s[row];
        if (t < 0) continue;
        const float v = rope_elem(x_s + row * D, d, R, inter, sh.cos_tab + t * h2, sh.sin_tab + t * h2);
        k_sel[(((int64_t)b * Hk + h) * SC + m0 + row) * D + d] = skv_f32_to_bf16(v);
    }
}

/* ================================================================================================
 * Gather values: v_sel[b][h][s*c..][:] = vstore_b[h][sel_idx[b][h][s]] (c*D contiguous bf16).
 *
 * vstore is mapped pinned host memory read over PCIe, so throughput is set by the bytes in
 * flight: every thread issues kGatherUnroll independent 16-byte loads before its stores, and
 * the grid covers the whole copy at once (B = 8, typical shape: 33.5 MB, 1024 CTAs of 256).
 * Consecutive threads read consecutive 16-byte pieces of a chunk (full 128-byte lines).
 * ============================================================================================= */

constexpr int kGatherNT = 256;
constexpr int kGatherUnroll = 8;

/* Copies total units (T: 16 bytes, or one bf16 when unaligned) of selected chunks of n_units
   units each; chunk q = h*S + s of dst comes from chunk h*n_cand + idx[q] of src. Three
   passes over the thread's units: the addresses, then every load, then the stores, so all
   kGatherUnroll host reads of a thread are in flight together.
   Reuse (pub != NULL): a chunk that the previous step's published selection pub [Hk, S]
   (increasing) also holds, at position p, is read from prev [Hk, S, units] in device memory
   instead of over PCIe. keep (or NULL) receives a copy of dst for the next step. */
template <class T>
__device__ __forceinline__ void gather_units(const T *src, T *dst, const int32_t *idx, int64_t n_units, int32_t S,
                                             int32_t n_cand, int64_t total, const T *prev, const int32_t *pub,
                                             T *keep)
{
    const int64_t per_block = (int64_t)kGatherNT * kGatherUnroll;
    for (int64_t base = (int64_t)blockIdx.x * per_block + threadIdx.x; base < total;
         base += (int64_t)gridDim.x * per_block) {
        const T *from[kGatherUnroll];
#pragma unroll
        for (int k = 0; k < kGatherUnroll; k++) {
            const int64_t g = base + (int64_t)k * kGatherNT;
            from[k] = nullptr;
            if (g < total) {
                const int64_t q = g / n_units, e = g - q * n_units, h = q / S;
                const int32_t m = idx[q];
                from[k] = src + (h * n_cand + m) * n_units + e;
                if (pub) { /* binary search of m in the previous selection of head h */
                    const int32_t *row = pub + h * S;
                    int lo = 0, hi = S - 1;
                    while (lo <= hi) {
                        const int mid = (lo + hi) >> 1;
                        const int32_t x = row[mid];
                        if (x == m) {
                            from[k] = prev + (h * S + mid) * n_units + e;
                            break;
                        }
                        if (x < m) lo = mid + 1;
                        else hi = mid - 1;
                    }
                }
            }
        }
        T v[kGatherUnroll];
#pragma unroll
        for (int k = 0; k < kGatherUnroll; k++)
            if (from[k]) v[k] = *from[k];
#pragma unroll
        for (int k = 0; k < kGatherUnroll; k++)
            if (from[k]) {
                const int64_t g = base + (int64_t)k * kGatherNT;
                dst[g] = v[k];
                if (keep) keep[g] = v[k];
            }
    }
}

/* grid (blocks, B). vec_ok: the launcher found c*D % 8 == 0 and v_sel 16-byte aligned;
   the store's alignment is only known here. */
__global__ void __launch_bounds__(kGatherNT) gather_kernel(const skv_cuda_seq *seqs, int32_t Hk, int32_t S,
                                                           int32_t cD, const int32_t *sel_idx, skv_bf16 *v_sel,
                                                           int vec_ok)
{
    const int b = blockIdx.y;
    const skv_cuda_seq &sq = seqs[b];
    const skv_bf16 *src = sq.vstore;
    const int32_t n_cand = sq.n_cand;
    const int32_t *idx = sel_idx + (int64_t)b * Hk * S;
    skv_bf16 *dst = v_sel + (int64_t)b * Hk * S * cD;
    const int64_t half = (int64_t)Hk * S * cD;
    skv_bf16 *keep = nullptr;
    const skv_bf16 *prev = nullptr;
    const int32_t *pub = nullptr;
    if (sq.vkeep) {
        const int cur = sq.n_gen & 1;
        keep = sq.vkeep + cur * half;
        if (sq.has_sel) {
            prev = sq.vkeep + (cur ^ 1) * half;
            pub = sq.pub_sel_idx;
        }
    }
    if (vec_ok && ((uintptr_t)src & 15) == 0 && ((uintptr_t)sq.vkeep & 15) == 0) {
        const int64_t nu = cD / 8;
        gather_units<uint4>(reinterpret_cast<const uint4 *>(src), reinterpret_cast<uint4 *>(dst), idx, nu, S, n_cand,
                            (int64_t)Hk * S * nu, reinterpret_cast<const uint4 *>(prev), pub,
                            reinterpret_cast<uint4 *>(keep));
    } else {
        gather_units<uint16_t>(src, dst, idx, cD, S, n_cand, (int64_t)Hk * S * cD, prev, pub, keep);
    }
}

/* Prefill offload: dst [Hk, m, c, D] chunk (h, i) = rows ids[h*m + i]*c + j of head h of
   src [n, Hk, D]. Du units (16 bytes or one bf16) per row. dst may be mapped host memory. */
template <class T>
__global__ void __launch_bounds__(kGatherNT) gather_chunks_kernel(const T *src, int32_t Hk, int64_t Du, int32_t c,
                                                                  const int32_t *ids, int32_t m, T *dst,
                                                                  int64_t total)
{
    const int64_t per_block = (int64_t)kGatherNT * kGatherUnroll;
    for (int64_t base = (int64_t)blockIdx.x * per_block + threadIdx.x; base < total;
         base += (int64_t)gridDim.x * per_block) {
        int64_t off[kGatherUnroll];
#pragma unroll
        for (int k = 0; k < kGatherUnroll; k++) {
            const int64_t g = base + (int64_t)k * kGatherNT;
            off[k] = -1;
            if (g < total) {
                const int64_t row = g / Du, e = g - row * Du; /* row = (h*m + i)*c + j */
                const int64_t hm = row / c, j = row - hm * c, hh = hm / m;
                off[k] = (((int64_t)ids[hm] * c + j) * Hk + hh) * Du + e;
            }
        }
        T v[kGatherUnroll];
#pragma unroll
        for (int k = 0; k < kGatherUnroll; k++)
            if (off[k] >= 0) v[k] = src[off[k]];
#pragma unroll
        for (int k = 0; k < kGatherUnroll; k++)
            if (off[k] >= 0) dst[base + (int64_t)k * kGatherNT] = v[k];
    }
}

/* ================================================================================================
 * Attention: split-K flash decoding shared by the decode and the span launchers.
 *
 * grid (splits, Hk * n_qchunks, B); a CTA takes GC query heads of one KV head (K/V are read
 * once for the group) over one token range of the concatenated spans, and writes a partial
 * (max, sum, unnormalized acc[D]) per head, or the final output when splits == 1. The token
 * range of a split is derived on the device from the device-side token count, so the host
 * only chooses the number of splits; CTAs whose range is empty write neutral partials.
 *
 * Per tile of TILE tokens (K and V staged in shared memory by a 2-stage cp.async pipeline):
 *   phase 1  scores: thread = (token, slice of D); partial dots over the slice, no shuffles
 *   softmax  warp per query head, lane per token: online max/sum in the log2 domain
 *   phase 2  P V: thread = (8 dims, subset of tokens), GC*8 float accumulators in registers
 * CUDA cores throughout: at G = 4 the math takes about half the time the K/V bytes take.
 * ============================================================================================= */

constexpr int kAttNT = 128;
constexpr int kAttWarps = kAttNT / 32;
constexpr int kAttMaxSplits = 512;
constexpr int64_t kAttTargetCtas = 3 * 132;    /* ~3 resident CTAs per SM of an H200 */
constexpr int64_t kAttMinSplitTokens = 64;     /* below this a split is mostly prologue */
constexpr int64_t kAttMaxSplitTokens = 4096;   /* bounds the length of each float running sum */

/* Tokens per tile for a compiled head dim DT (0: runtime D up to 1024). */
__host__ __device__ constexpr int attn_tile(int DT) { return DT == 0 ? 8 : (DT <= 128 ? 32 : 16); }

/* One non-empty span as the kernel walks it: tokens [start, end) of the concatenation. */
struct AttnSpan {
    const skv_bf16 *k, *v; /* head h's first token */
    int64_t start, end, stride;
    int aligned; /* k, v 16-byte aligned and stride % 8 == 0: rows can be copied in 16-byte pieces */
};

struct AttnArgs {
    int32_t Hq, Hk, D, G, nqc, splits, final_out;
    float scale_log2; /* scale * log2(e): scores live in the log2 domain */
    const skv_bf16 *q; /* [B, Hq, D] */
    float *out;        /* [B, Hq, D] */
    float *part_acc;   /* [B*Hq, splits, D] */
    float2 *part_ml;   /* [B*Hq, splits] (max, sum) */
    /* decode source (seqs != NULL) */
    const skv_cuda_seq *seqs;
    const skv_bf16 *k_sel, *v_sel, *k_new, *v_new;
    int32_t S, c, O, gen_cap;
    /* span source */
    int32_t n_spans;
    skv_kv_span spans[SKV_MAX_SPANS];
};

/* Shared memory of one attention CTA; host and device compute it with the same code. */
struct AttnLayout {
    int tile, dc, lds, dp, npart, nsub; /* dc: 8-element pieces per row; dp = 8*dc */
    size_t stage_elems;                 /* one K (or V) tile: tile * lds bf16 */
    size_t off_q, off_spart, off_p, off_alpha, off_ml, off_span, off_nsp, bytes;
};

__host__ __device__ inline AttnLayout attn_layout(int D, int tile, int gc)
{
    AttnLayout L;
    L.tile = tile;
    L.dc = (D + 7) / 8;
    L.lds = (L.dc | 1) * 8; /* odd number of 16-byte pieces per row: conflict-free column reads */
    L.dp = L.dc * 8;
    L.npart = kAttNT / tile;
    L.nsub = kAttNT / L.dc;
    L.stage_elems = (size_t)tile * L.lds;
    const size_t kv = 2 /* stages */ * 2 /* K, V */ * L.stage_elems * sizeof(skv_bf16);
    const size_t red = (size_t)L.nsub * gc * L.dp * sizeof(float); /* end-of-CTA reduction, aliases kv */
    size_t off = align_up(kv > red ? kv : red, 16);
    L.off_q = off;
    off = align_up(off + (size_t)gc * L.dp * sizeof(float), 16);
    L.off_spart = off;
    off = align_up(off + (size_t)L.npart * gc * tile * sizeof(float), 16);
    L.off_p = off;
    off = align_up(off + (size_t)tile * gc * sizeof(float), 16);
    L.off_alpha = off;
    off = align_up(off + (size_t)gc * sizeof(float), 16);
    L.off_ml = off;
    off = align_up(off + (size_t)gc * sizeof(float2), 16);
    L.off_span = off;
    off = align_up(off + (size_t)SKV_MAX_SPANS * sizeof(AttnSpan), 16);
    L.off_nsp = off;
    L.bytes = off + 16;
    return L;
}

__device__ int attn_add_span(AttnSpan *sp, int n, int64_t *pos, const skv_bf16 *k, const skv_bf16 *v,
                             int64_t n_tokens, int64_t head_off, int64_t stride)
{
    if (n_tokens <= 0) return n; /* empty spans are dropped (their pointers may be NULL) */
    AttnSpan &s = sp[n];
    s.k = k + head_off;
    s.v = v + head_off;
    s.start = *pos;
    s.end = *pos + n_tokens;
    s.stride = stride;
    s.aligned = (((uintptr_t)s.k | (uintptr_t)s.v) & 15) == 0 && stride % 8 == 0;
    *pos = s.end;
    return n + 1;
}

/* The spans of KV head h of sequence b, in the order of the concatenation. */
__device__ int attn_build_spans(const AttnArgs &a, int b, int h, AttnSpan *sp)
{
    int n = 0;
    int64_t pos = 0;
    const int64_t D = a.D;
    if (a.seqs) {
        const skv_cuda_seq &s = a.seqs[b];
        const int64_t oc = (int64_t)a.O * a.c, sc = (int64_t)a.S * a.c, nl = s.n_local;
        n = attn_add_span(sp, n, &pos, s.out_k, s.out_v, oc, h * oc * D, D);
        n = attn_add_span(sp, n, &pos, s.loc_k, s.loc_v, nl, h * nl * D, D);
        n = attn_add_span(sp, n, &pos, a.k_sel, a.v_sel, sc, ((int64_t)b * a.Hk + h) * sc * D, D);
        n = attn_add_span(sp, n, &pos, s.gen_k, s.gen_v, s.n_gen, (int64_t)h * a.gen_cap * D, D);
        n = attn_add_span(sp, n, &pos, a.k_new, a.v_new, 1, ((int64_t)b * a.Hk + h) * D, D);
    } else {
        for (int i = 0; i < a.n_spans; i++)
            n = attn_add_span(sp, n, &pos, a.spans[i].k, a.spans[i].v, a.spans[i].n_tokens,
                              h * a.spans[i].head_stride, a.spans[i].token_stride);
    }
    return n;
}

/* Stage tokens [tile0, tile0 + tile) of K and V (rows past t1 are zero: their p is 0 and
   0 * garbage could be NaN). cur: this thread's span cursor; the rows a thread loads only
   increase, so the span lookup is amortized to a compare. */
__device__ __forceinline__ void attn_load_tile(skv_bf16 *Ks, skv_bf16 *Vs, const AttnLayout &L, int D,
                                               const AttnSpan *sp, int &cur, int64_t tile0, int64_t t1)
{
    for (int idx = threadIdx.x; idx < L.tile * L.dc; idx += kAttNT) {
        const int row = idx / L.dc, cc = idx - row * L.dc;
        const int64_t t = tile0 + row;
        skv_bf16 *dk = Ks + row * L.lds + cc * 8, *dv = Vs + row * L.lds + cc * 8;
        if (t >= t1) {
            store_zero16(dk);
            store_zero16(dv);
            continue;
        }
        while (t >= sp[cur].end) cur++;
        const AttnSpan &s = sp[cur];
        const int64_t off = (t - s.start) * s.stride + cc * 8;
        const int left = D - cc * 8; /* valid dims in this piece (the last piece may be short) */
        if (s.aligned && left >= 8) {
            cp_async16(dk, s.k + off);
            cp_async16(dv, s.v + off);
        } else {
            load8_slow(dk, s.k + off, left);
            load8_slow(dv, s.v + off, left);
        }
    }
}

template <int DT, int GC>
__global__ void __launch_bounds__(kAttNT) attn_kernel(const AttnArgs a)
{
    constexpr int TILE = attn_tile(DT);
    constexpr int HPW = (GC + kAttWarps - 1) / kAttWarps; /* softmax heads per warp */
    const int D = DT ? DT : a.D;
    const AttnLayout L = attn_layout(D, TILE, GC);
    skv_bf16 *kv = reinterpret_cast<skv_bf16 *>(skv_attn_smem);
    float *red = reinterpret_cast<float *>(skv_attn_smem);
    float *q_s = reinterpret_cast<float *>(skv_attn_smem + L.off_q);         /* [GC][dp] */
    float *spart = reinterpret_cast<float *>(skv_attn_smem + L.off_spart);   /* [npart][GC][TILE] */
    float *p_s = reinterpret_cast<float *>(skv_attn_smem + L.off_p);         /* [TILE][GC] */
    float *alpha_s = reinterpret_cast<float *>(skv_attn_smem + L.off_alpha); /* [GC] */
    float2 *ml_s = reinterpret_cast<float2 *>(skv_attn_smem + L.off_ml);     /* [GC] */
    AttnSpan *sp_s = reinterpret_cast<AttnSpan *>(skv_attn_smem + L.off_span);
    int *nsp_s = reinterpret_cast<int *>(skv_attn_smem + L.off_nsp);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int split = blockIdx.x, b = blockIdx.z;
    const int h = blockIdx.y / a.nqc;
    const int qh0 = h * a.G + (blockIdx.y - h * a.nqc) * GC; /* first query head of this CTA */

    if (tid == 0) *nsp_s = attn_build_spans(a, b, h, sp_s);
    for (int i = tid; i < GC * L.dp; i += kAttNT) {
        const int g = i / L.dp, d = i - g * L.dp;
        q_s[i] = d < D ? skv_bf16_to_f32(a.q[((int64_t)b * a.Hq + qh0 + g) * D + d]) : 0.0f;
    }
    __syncthreads();

    const int nsp = *nsp_s;
    const int64_t T = nsp ? sp_s[nsp - 1].end : 0;
    const int64_t per = ceil_div64(ceil_div64(T, a.splits), TILE) * TILE;
    const int64_t t0 = (int64_t)split * per;
    const int64_t t1 = t0 + per < T ? t0 + per : T;
    const int64_t head0 = (int64_t)b * a.Hq + qh0;

    if (t0 >= t1) { /* nothing here: a neutral partial (or zeros, for an empty call) */
        for (int i = tid; i < GC * D; i += kAttNT) {
            const int g = i / D, d = i - g * D;
            if (a.final_out)
                a.out[(head0 + g) * D + d] = 0.0f;
            else
                a.part_acc[((head0 + g) * a.splits + split) * D + d] = 0.0f;
        }
        if (!a.final_out && tid < GC) a.part_ml[(head0 + tid) * a.splits + split] = make_float2(-INFINITY, 0.0f);
        return;
    }

    float acc[GC][8];
#pragma unroll
    for (int g = 0; g < GC; g++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[g][j] = 0.0f;
    float m_run[HPW], l_run[HPW];
#pragma unroll
    for (int j = 0; j < HPW; j++) {
        m_run[j] = -INFINITY;
        l_run[j] = 0.0f;
    }

    const int ntiles = (int)ceil_div64(t1 - t0, TILE);
    int cur = 0;
    attn_load_tile(kv, kv + L.stage_elems, L, D, sp_s, cur, t0, t1);
    cp_async_commit();
    for (int it = 0; it < ntiles; it++) {
        const int64_t tile0 = t0 + (int64_t)it * TILE;
        const int nvalid = (int)(t1 - tile0 < TILE ? t1 - tile0 : TILE);
        cp_async_wait_all();
        __syncthreads(); /* tile it landed; everyone is done with tile it-1 (the other stage) */
        if (it + 1 < ntiles) {
            skv_bf16 *nk = kv + ((it + 1) & 1) * 2 * L.stage_elems;
            attn_load_tile(nk, nk + L.stage_elems, L, D, sp_s, cur, tile0 + TILE, t1);
            cp_async_commit();
        }
        const skv_bf16 *Ks = kv + (it & 1) * 2 * L.stage_elems;
        const skv_bf16 *Vs = Ks + L.stage_elems;

        /* phase 1: partial scores of (token, slice of D) */
        {
            const int tok = tid % TILE, part = tid / TILE;
            const skv_bf16 *kr = Ks + tok * L.lds;
            float s[GC];
#pragma unroll
            for (int g = 0; g < GC; g++) s[g] = 0.0f;
#pragma unroll 4
            for (int cc = part; cc < L.dc; cc += L.npart) {
                float kf[8];
                bf16x8_to_f32(*reinterpret_cast<const uint4 *>(kr + cc * 8), kf);
#pragma unroll
                for (int g = 0; g < GC; g++) {
                    const float4 qa = *reinterpret_cast<const float4 *>(q_s + g * L.dp + cc * 8);
                    const float4 qb = *reinterpret_cast<const float4 *>(q_s + g * L.dp + cc * 8 + 4);
                    float x = s[g];
                    x = fmaf(kf[0], qa.x, x);
                    x = fmaf(kf[1], qa.y, x);
                    x = fmaf(kf[2], qa.z, x);
                    x = fmaf(kf[3], qa.w, x);
                    x = fmaf(kf[4], qb.x, x);
                    x = fmaf(kf[5], qb.y, x);
                    x = fmaf(kf[6], qb.z, x);
                    x = fmaf(kf[7], qb.w, x);
                    s[g] = x;
                }
            }
#pragma unroll
            for (int g = 0; g < GC; g++) spart[(part * GC + g) * TILE + tok] = s[g];
        }
        __syncthreads();

        /* online softmax: warp per query head, lane per token */
#pragma unroll
        for (int j = 0; j < HPW; j++) {
            const int g = warp + j * kAttWarps;
            if (g >= GC) break;
            float sc = -INFINITY;
            if (lane < nvalid) {
                float x = 0.0f;
                for (int pt = 0; pt < L.npart; pt++) x += spart[(pt * GC + g) * TILE + lane];
                sc = x * a.scale_log2;
            }
            const float mn = fmaxf(m_run[j], warp_max(sc));
            float alpha = 1.0f, p = 0.0f;
            if (mn != -INFINITY) { /* only -inf scores so far: keep everything at 0 */
                alpha = exp2f(m_run[j] - mn);
                p = exp2f(sc - mn);
            }
            l_run[j] = l_run[j] * alpha + warp_sum(p);
            m_run[j] = mn;
            if (lane < TILE) p_s[lane * GC + g] = p;
            if (lane == 0) alpha_s[g] = alpha;
        }
        __syncthreads();

        /* phase 2: acc = alpha * acc + sum_t p_t v_t over this thread's tokens and dims */
        if (tid < L.nsub * L.dc) {
            const int cc = tid % L.dc, sub = tid / L.dc;
#pragma unroll
            for (int g = 0; g < GC; g++) {
                const float al = alpha_s[g];
#pragma unroll
                for (int j = 0; j < 8; j++) acc[g][j] *= al;
            }
#pragma unroll 4
            for (int t = sub; t < nvalid; t += L.nsub) {
                float vf[8];
                bf16x8_to_f32(*reinterpret_cast<const uint4 *>(Vs + t * L.lds + cc * 8), vf);
#pragma unroll
                for (int g = 0; g < GC; g++) {
                    const float p = p_s[t * GC + g];
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[g][j] = fmaf(p, vf[j], acc[g][j]);
                }
            }
        }
    }

    /* end of the range: reduce the token subsets, then write (max, sum, acc) or out */
#pragma unroll
    for (int j = 0; j < HPW; j++) {
        const int g = warp + j * kAttWarps;
        if (g < GC && lane == 0) ml_s[g] = make_float2(m_run[j], l_run[j]);
    }
    __syncthreads(); /* every read of the stages is done: red may overwrite them */
    if (tid < L.nsub * L.dc) {
        const int cc = tid % L.dc, sub = tid / L.dc;
#pragma unroll
        for (int g = 0; g < GC; g++)
#pragma unroll
            for (int j = 0; j < 8; j++) red[(sub * GC + g) * L.dp + cc * 8 + j] = acc[g][j];
    }
    __syncthreads();
    for (int i = tid; i < GC * D; i += kAttNT) {
        const int g = i / D, d = i - g * D;
        float v = 0.0f;
        for (int sub = 0; sub < L.nsub; sub++) v += red[(sub * GC + g) * L.dp + d];
        if (a.final_out)
            a.out[(head0 + g) * D + d] = v / ml_s[g].y;
        else
            a.part_acc[((head0 + g) * a.splits + split) * D + d] = v;
    }
    if (!a.final_out && tid < GC) a.part_ml[(head0 + tid) * a.splits + split] = ml_s[tid];
}

/* out[bh] = sum_s w_s acc_s / sum_s w_s l_s with w_s = 2^(m_s - max m): one CTA per (b, qh). */
constexpr int kCombNT = 128;

__global__ void __launch_bounds__(kCombNT) attn_combine_kernel(int32_t D, int32_t splits, const float *part_acc,
                                                               const float2 *part_ml, float *out)
{
    __shared__ float w_s[kAttMaxSplits];
    __shared__ float tmp[kCombNT / 32];
    const int64_t bh = blockIdx.x;
    const float2 *ml = part_ml + bh * splits;
    float m = -INFINITY;
    for (int s = threadIdx.x; s < splits; s += kCombNT) m = fmaxf(m, ml[s].x);
    m = block_reduce<true>(m, tmp);
    float l = 0.0f;
    for (int s = threadIdx.x; s < splits; s += kCombNT) {
        const float2 x = ml[s];
        const float w = x.x == -INFINITY ? 0.0f : exp2f(x.x - m); /* empty splits weigh nothing */
        w_s[s] = w;
        l += w * x.y;
    }
    l = block_reduce<false>(l, tmp); /* its barrier also publishes w_s */
    const float inv = 1.0f / l;
    const float *acc = part_acc + bh * splits * D;
    for (int d = threadIdx.x; d < D; d += kCombNT) {
        float v = 0.0f;
        for (int s = 0; s < splits; s++) v = fmaf(w_s[s], acc[(int64_t)s * D + d], v);
        out[bh * D + d] = v * inv;
    }
}

/* Query heads per CTA: the largest of 8, 4, 2, 1 dividing G (no partial groups). */
inline int attn_gc(int G) { return G % 8 == 0 ? 8 : G % 4 == 0 ? 4 : G % 2 == 0 ? 2 : 1; }

/* Splits for a call of B sequences of at most `tokens` tokens: enough CTAs to fill the GPU,
   not so many that a split is mostly prologue, and never more than kAttMaxSplitTokens
   tokens per split (long running float sums lose small weights). */
inline int attn_splits(int B, int Hq, int Hk, int64_t tokens)
{
    const int G = Hq / Hk;
    const int64_t ctas = (int64_t)B * Hk * (G / attn_gc(G));
    int64_t s = ceil_div64(kAttTargetCtas, ctas);
    const int64_t by_min = tokens / kAttMinSplitTokens;
    if (s > by_min) s = by_min;
    const int64_t by_max = ceil_div64(tokens, kAttMaxSplitTokens);
    if (s < by_max) s = by_max;
    if (s < 1) s = 1;
    if (s > kAttMaxSplits) s = kAttMaxSplits;
    return (int)s;
}

inline size_t attn_ws_per_split(int B, int Hq, int D) { return (size_t)B * Hq * ((size_t)D + 2) * sizeof(float); }

typedef void (*AttnKernel)(const AttnArgs);

template <int DT>
AttnKernel attn_pick_gc(int gc)
{
    switch (gc) {
    case 8: return attn_kernel<DT, 8>;
    case 4: return attn_kernel<DT, 4>;
    case 2: return attn_kernel<DT, 2>;
    default: return attn_kernel<DT, 1>;
    }
}

/* Fast paths for D = 64, 128, 256; everything else (even D up to 1024) runs the general one. */
inline int attn_dt(int D) { return D == 64 || D == 128 || D == 256 ? D : 0; }

AttnKernel attn_pick(int DT, int gc)
{
    switch (DT) {
    case 64: return attn_pick_gc<64>(gc);
    case 128: return attn_pick_gc<128>(gc);
    case 256: return attn_pick_gc<256>(gc);
    default: return attn_pick_gc<0>(gc);
    }
}

/* Plans splits (capped by the workspace: no workspace means one split writing out directly),
   launches the attention kernel and, with several splits, the combine. */
cudaError_t attn_run(cudaStream_t st, AttnArgs &a, int B, int64_t tokens_hint, void *ws, size_t ws_bytes)
{
    if (a.D <= 0 || a.D > 1024) return cudaErrorInvalidValue; /* phase 2 needs D/8 <= kAttNT pieces */
    a.G = a.Hq / a.Hk;
    const int gc = attn_gc(a.G);
    a.nqc = a.G / gc;
    int64_t splits = attn_splits(B, a.Hq, a.Hk, tokens_hint);
    const int64_t fit = ws ? (int64_t)(ws_bytes / attn_ws_per_split(B, a.Hq, a.D)) : 0;
    if (splits > fit) splits = fit > 1 ? fit : 1;
    a.splits = (int32_t)splits;
    a.final_out = splits == 1;
    a.part_acc = splits > 1 ? static_cast<float *>(ws) : NULL;
    a.part_ml = splits > 1 ? reinterpret_cast<float2 *>(a.part_acc + (size_t)B * a.Hq * splits * a.D) : NULL;

    const int DT = attn_dt(a.D);
    const AttnKernel k = attn_pick(DT, gc);
    const size_t smem = attn_layout(a.D, attn_tile(DT), gc).bytes;
    cudaError_t e = allow_smem(k, smem);
    if (e != cudaSuccess) return e;
    k<<<dim3((unsigned)splits, (unsigned)(a.Hk * a.nqc), (unsigned)B), kAttNT, smem, st>>>(a);
    if (splits > 1)
        attn_combine_kernel<<<(unsigned)(B * a.Hq), kCombNT, 0, st>>>(a.D, a.splits, a.part_acc, a.part_ml, a.out);
    return cudaGetLastError();
}

/* ================================================================================================
 * Step checks, append, finders, conversion.
 * ============================================================================================= */

constexpr int kSmallNT = 256;
constexpr int64_t kMaxGrid = 4096;

__global__ void __launch_bounds__(kSmallNT) check_step_kernel(int64_t nq, int64_t nk, int32_t layer,
                                                              const skv_bf16 *q, const skv_bf16 *k,
                                                              const skv_bf16 *v, int32_t *step_bad,
                                                              unsigned long long *first_bad)
{
    const int64_t total = nq + 2 * nk;
    int count = 0;
    unsigned long long first = ~0ull;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        unsigned long long tensor;
        int64_t j;
        skv_bf16 x;
        if (i < nq) {
            tensor = 0, j = i, x = q[j];
        } else if (i < nq + nk) {
            tensor = 1, j = i - nq, x = k[j];
        } else {
            tensor = 2, j = i - nq - nk, x = v[j];
        }
        if (!skv_bf16_isfinite(x)) {
            count++;
            const unsigned long long key = ((unsigned long long)layer << 48) | (tensor << 40) | (unsigned long long)j;
            first = key < first ? key : first;
        }
    }
    count = warp_sum_int(count);
    first = warp_min_u64(first);
    if ((threadIdx.x & 31) == 0) {
        if (count) atomicAdd(step_bad, count);
        if (first != ~0ull) atomicMin(first_bad, first);
    }
}

__global__ void __launch_bounds__(kSmallNT) append_kernel(skv_cuda_seq *seqs, int32_t Hk, int32_t D, int32_t S,
                                                          int32_t gen_cap, const skv_bf16 *k_new,
                                                          const skv_bf16 *v_new, const int32_t *sel_idx,
                                                          const int32_t *sel_ids, const int32_t *step_bad)
{
    if (*step_bad != 0) return; /* a bad step changes nothing */
    const int b = blockIdx.x;
    skv_cuda_seq *sq = seqs + b;
    const int32_t n_gen = sq->n_gen; /* read by all threads before thread 0 advances it */
    if (n_gen >= gen_cap) return;    /* lib rejects a full region before the step; never write past it */
    const int64_t HD = (int64_t)Hk * D, HS = (int64_t)Hk * S;
    skv_bf16 *gk = sq->gen_k, *gv = sq->gen_v;
    int32_t *pidx = sq->pub_sel_idx, *pids = sq->pub_sel_ids;
    for (int64_t i = threadIdx.x; i < HD; i += blockDim.x) {
        const int64_t hh = i / D, d = i - hh * D;
        const int64_t dst = (hh * gen_cap + n_gen) * D + d;
        gk[dst] = k_new[b * HD + i];
        gv[dst] = v_new[b * HD + i];
    }
    for (int64_t i = threadIdx.x; i < HS; i += blockDim.x) {
        if (pidx) pidx[i] = sel_idx[b * HS + i];
        if (pids && sel_ids) pids[i] = sel_ids[b * HS + i];
    }
    __syncthreads(); /* all copies are done before the sequence says they exist */
    if (threadIdx.x == 0) {
        sq->n_gen = n_gen + 1;
        sq->has_sel = 1;
    }
}

/* First non-finite element of a strided [n_a, n_b, len] tensor, VEC elements per load
   (8: len, s_a, s_b multiples of 8 and x 16-byte aligned). Each thread's units increase,
   so its first hit is its minimum. */
template <int VEC>
__global__ void __launch_bounds__(kSmallNT) find_nonfinite_kernel(const skv_bf16 *x, int64_t n_a, int64_t s_a,
                                                                  int64_t n_b, int64_t s_b, int64_t len,
                                                                  unsigned long long *first_bad)
{
    const int64_t lu = len / VEC, total = n_a * n_b * lu;
    unsigned long long first = ~0ull;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = u / lu, l0 = (u - row * lu) * VEC;
        const int64_t i = row / n_b, j = row - i * n_b;
        const skv_bf16 *p = x + i * s_a + j * s_b + l0;
        skv_bf16 e[VEC];
        if (VEC == 8) {
            const uint4 w = *reinterpret_cast<const uint4 *>(p);
            const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int t = 0; t < VEC; t++) e[t] = (skv_bf16)(ws[t / 2] >> (16 * (t & 1)));
        } else {
#pragma unroll
            for (int t = 0; t < VEC; t++) e[t] = p[t];
        }
        int bad = -1;
#pragma unroll
        for (int t = VEC - 1; t >= 0; t--)
            if (!skv_bf16_isfinite(e[t])) bad = t;
        if (bad >= 0) {
            first = (unsigned long long)(row * len + l0 + bad);
            break;
        }
    }
    first = warp_min_u64(first);
    if ((threadIdx.x & 31) == 0 && first != ~0ull) atomicMin(first_bad, first);
}

__global__ void __launch_bounds__(kSmallNT) find_out_of_range_kernel(const int32_t *x, int64_t n, int64_t lo,
                                                                     int64_t hi, unsigned long long *first_bad)
{
    unsigned long long first = ~0ull;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t v = x[i];
        if (v < lo || v >= hi) {
            first = (unsigned long long)i;
            break;
        }
    }
    first = warp_min_u64(first);
    if ((threadIdx.x & 31) == 0 && first != ~0ull) atomicMin(first_bad, first);
}

/* VEC = 4: x 16-byte and y 8-byte aligned; the n % 4 tail is done element-wise. */
template <int VEC>
__global__ void __launch_bounds__(kSmallNT) f32_to_bf16_kernel(const float *x, skv_bf16 *y, int64_t n)
{
    const int64_t stride = (int64_t)gridDim.x * blockDim.x, gtid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t nv = n / VEC;
    for (int64_t i = gtid; i < nv; i += stride) {
        if (VEC == 4) {
            const float4 f = reinterpret_cast<const float4 *>(x)[i];
            const uint32_t a = skv_f32_to_bf16(f.x) | ((uint32_t)skv_f32_to_bf16(f.y) << 16);
            const uint32_t b = skv_f32_to_bf16(f.z) | ((uint32_t)skv_f32_to_bf16(f.w) << 16);
            reinterpret_cast<uint2 *>(y)[i] = make_uint2(a, b);
        } else {
            y[i] = skv_f32_to_bf16(x[i]);
        }
    }
    if (gtid < n - nv * VEC) y[nv * VEC + gtid] = skv_f32_to_bf16(x[nv * VEC + gtid]);
}

} /* namespace */

/* ================================================================================================
 * Launchers (skv_cuda.h)
 * ============================================================================================= */

cudaError_t skv_cuda_rebuild(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                             const int32_t *sel_ids, skv_bf16 *k_sel)
{
    const int64_t SC = (int64_t)sh->S * sh->c;
    if (sh->B <= 0 || sh->Hk <= 0 || SC <= 0) return cudaSuccess;
    const int D = sh->D, r = sh->r;
    if (r % 16 == 0 && D % 16 == 0 && D <= 256) {
        const int DT = D <= 64 ? 64 : D <= 128 ? 128 : 256;
        void (*k)(const skv_cuda_shape, const skv_cuda_seq *, const int32_t *, skv_bf16 *) =
            DT == 64 ? rebuild_wmma_kernel<64> : DT == 128 ? rebuild_wmma_kernel<128> : rebuild_wmma_kernel<256>;
        const size_t smem = rebuild_layout(DT).bytes;
        cudaError_t e = allow_smem(k, smem);
        if (e != cudaSuccess) return e;
        const dim3 grid((unsigned)ceil_div64(SC, kRbM), (unsigned)sh->Hk, (unsigned)sh->B);
        k<<<grid, kRbNT, smem, st>>>(*sh, seqs, sel_ids, k_sel);
    } else {
        const size_t smem = rebuild_simple_smem(r, D);
        cudaError_t e = allow_smem(rebuild_simple_kernel, smem);
        if (e != cudaSuccess) return e;
        const dim3 grid((unsigned)ceil_div64(SC, kRbsRows), (unsigned)sh->Hk, (unsigned)sh->B);
        rebuild_simple_kernel<<<grid, kRbsNT, smem, st>>>(*sh, seqs, sel_ids, k_sel);
    }
    return cudaGetLastError();
}

cudaError_t skv_cuda_gather(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                            const int32_t *sel_idx, skv_bf16 *v_sel)
{
    const int32_t cD = sh->c * sh->D;
    const int64_t chunks = (int64_t)sh->Hk * sh->S;
    if (sh->B <= 0 || chunks <= 0 || cD <= 0) return cudaSuccess;
    const int vec_ok = cD % 8 == 0 && ((uintptr_t)v_sel & 15) == 0;
    /* sized for the 16-byte path; the per-sequence element fallback strides over the same grid.
       PCIe needs only ~100 KB in flight; about 128 CTAs in all (4 MB in flight) keep it busy
       and leave most SMs to the key rebuild, which runs beside this on the cache's stream. */
    unsigned blocks = grid_for(chunks * (cD / 8 > 0 ? cD / 8 : 1), (int64_t)kGatherNT * kGatherUnroll, 65535);
    const unsigned cap = (unsigned)(128 / sh->B > 4 ? 128 / sh->B : 4);
    if (blocks > cap) blocks = cap;
    gather_kernel<<<dim3(blocks, (unsigned)sh->B), kGatherNT, 0, st>>>(seqs, sh->Hk, sh->S, cD, sel_idx, v_sel,
                                                                       vec_ok);
    return cudaGetLastError();
}

size_t skv_cuda_attention_ws_bytes(int32_t B, int32_t Hq, int32_t Hk, int32_t D, int64_t max_tokens)
{
    if (B <= 0 || Hq <= 0 || Hk <= 0 || D <= 0 || max_tokens <= 0) return 0;
    const int s = attn_splits(B, Hq, Hk, max_tokens);
    return s > 1 ? (size_t)s * attn_ws_per_split(B, Hq, D) : 0; /* one split writes out directly */
}

cudaError_t skv_cuda_decode_attention(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                      const skv_bf16 *q, const skv_bf16 *k_sel, const skv_bf16 *v_sel,
                                      const skv_bf16 *k_new, const skv_bf16 *v_new, float *out, void *ws,
                                      size_t ws_bytes)
{
    if (sh->B <= 0 || sh->Hq <= 0 || sh->Hk <= 0) return cudaSuccess;
    AttnArgs a = {};
    a.Hq = sh->Hq;
    a.Hk = sh->Hk;
    a.D = sh->D;
    a.scale_log2 = sh->scale * 1.44269504088896341f;
    a.q = q;
    a.out = out;
    a.seqs = seqs;
    a.k_sel = k_sel;
    a.v_sel = v_sel;
    a.k_new = k_new;
    a.v_new = v_new;
    a.S = sh->S;
    a.c = sh->c;
    a.O = sh->O;
    a.gen_cap = sh->gen_cap;
    /* n_local and n_gen live on the device; the host bound only shapes the split count */
    const int64_t tokens = ((int64_t)sh->O + sh->S) * sh->c + sh->gen_cap + 1;
    return attn_run(st, a, sh->B, tokens, ws, ws_bytes);
}

cudaError_t skv_cuda_span_attention(cudaStream_t st, int32_t Hq, int32_t Hk, int32_t D, float scale,
                                    const skv_bf16 *q, int32_t n_spans, const skv_kv_span *spans, float *out,
                                    void *ws, size_t ws_bytes)
{
    if (Hq <= 0 || Hk <= 0 || n_spans <= 0) return cudaSuccess;
    if (n_spans > SKV_MAX_SPANS) return cudaErrorInvalidValue;
    AttnArgs a = {};
    a.Hq = Hq;
    a.Hk = Hk;
    a.D = D;
    a.scale_log2 = scale * 1.44269504088896341f;
    a.q = q;
    a.out = out;
    a.n_spans = n_spans;
    int64_t tokens = 0;
    for (int i = 0; i < n_spans; i++) {
        a.spans[i] = spans[i];
        if (spans[i].n_tokens > 0) tokens += spans[i].n_tokens;
    }
    if (tokens == 0) return cudaSuccess;
    return attn_run(st, a, 1, tokens, ws, ws_bytes);
}

cudaError_t skv_cuda_check_step(cudaStream_t st, int32_t B, int32_t Hq, int32_t Hk, int32_t D, int32_t layer,
                                const skv_bf16 *q, const skv_bf16 *k, const skv_bf16 *v, int32_t *step_bad,
                                unsigned long long *first_bad)
{
    const int64_t nq = (int64_t)B * Hq * D, nk = (int64_t)B * Hk * D;
    if (nq + 2 * nk <= 0) return cudaSuccess;
    check_step_kernel<<<grid_for(nq + 2 * nk, kSmallNT, kMaxGrid), kSmallNT, 0, st>>>(nq, nk, layer, q, k, v,
                                                                                     step_bad, first_bad);
    return cudaGetLastError();
}

cudaError_t skv_cuda_append(cudaStream_t st, const skv_cuda_shape *sh, skv_cuda_seq *seqs,
                            const skv_bf16 *k_new, const skv_bf16 *v_new, const int32_t *sel_idx,
                            const int32_t *sel_ids, const int32_t *step_bad)
{
    if (sh->B <= 0) return cudaSuccess;
    append_kernel<<<(unsigned)sh->B, kSmallNT, 0, st>>>(seqs, sh->Hk, sh->D, sh->S, sh->gen_cap, k_new, v_new,
                                                        sel_idx, sel_ids, step_bad);
    return cudaGetLastError();
}

cudaError_t skv_cuda_find_nonfinite(cudaStream_t st, const skv_bf16 *x, int64_t n_a, int64_t s_a, int64_t n_b,
                                    int64_t s_b, int64_t len, unsigned long long *first_bad)
{
    if (n_a <= 0 || n_b <= 0 || len <= 0) return cudaSuccess;
    const bool vec = len % 8 == 0 && s_a % 8 == 0 && s_b % 8 == 0 && ((uintptr_t)x & 15) == 0;
    const int64_t units = n_a * n_b * (vec ? len / 8 : len);
    const unsigned grid = grid_for(units, kSmallNT, kMaxGrid);
    if (vec)
        find_nonfinite_kernel<8><<<grid, kSmallNT, 0, st>>>(x, n_a, s_a, n_b, s_b, len, first_bad);
    else
        find_nonfinite_kernel<1><<<grid, kSmallNT, 0, st>>>(x, n_a, s_a, n_b, s_b, len, first_bad);
    return cudaGetLastError();
}

cudaError_t skv_cuda_find_out_of_range(cudaStream_t st, const int32_t *x, int64_t n, int64_t lo, int64_t hi,
                                       unsigned long long *first_bad)
{
    if (n <= 0) return cudaSuccess;
    find_out_of_range_kernel<<<grid_for(n, kSmallNT, kMaxGrid), kSmallNT, 0, st>>>(x, n, lo, hi, first_bad);
    return cudaGetLastError();
}

cudaError_t skv_cuda_f32_to_bf16(cudaStream_t st, const float *x, skv_bf16 *y, int64_t n)
{
    if (n <= 0) return cudaSuccess;
    if ((((uintptr_t)x & 15) | ((uintptr_t)y & 7)) == 0)
        f32_to_bf16_kernel<4><<<grid_for(n / 4 + 1, kSmallNT, kMaxGrid), kSmallNT, 0, st>>>(x, y, n);
    else
        f32_to_bf16_kernel<1><<<grid_for(n, kSmallNT, kMaxGrid), kSmallNT, 0, st>>>(x, y, n);
    return cudaGetLastError();
}

cudaError_t skv_cuda_gather_chunks(cudaStream_t st, const skv_bf16 *src, int32_t Hk, int32_t D, int32_t c,
                                   const int32_t *ids, int32_t m, skv_bf16 *dst, int32_t max_blocks)
{
    const int64_t rows = (int64_t)Hk * m * c;
    if (rows <= 0 || D <= 0) return cudaSuccess;
    const int64_t per_block = (int64_t)kGatherNT * kGatherUnroll;
    const int64_t cap = max_blocks > 0 && max_blocks < 65535 ? max_blocks : 65535;
    if (D % 8 == 0 && (((uintptr_t)src | (uintptr_t)dst) & 15) == 0) {
        const int64_t Du = D / 8;
        gather_chunks_kernel<uint4><<<grid_for(rows * Du, per_block, cap), kGatherNT, 0, st>>>(
            reinterpret_cast<const uint4 *>(src), Hk, Du, c, ids, m, reinterpret_cast<uint4 *>(dst), rows * Du);
    } else {
        gather_chunks_kernel<uint16_t><<<grid_for(rows * D, per_block, cap), kGatherNT, 0, st>>>(
            src, Hk, D, c, ids, m, dst, rows * D);
    }
    return cudaGetLastError();
}
