/*
 * skv_cuda_copy.cu - the value copies of the cuda backend and small
 * conversions: at decode, the fetch of missed chunks from a host store into
 * the chunk cache (a side stream, skv_cuda.h lists the steps); the op-level
 * gather of selected value chunks; at prefill, the offload of the candidate
 * chunks' values into their store (device or mapped host memory); and the
 * f32 -> bf16 conversion. Value stores and chunk caches hold chunk records of
 * sh.vrec bytes: bf16 [c, D], or fp8 (lib/skv_numerics.h: codes [c, D], then
 * exponents [c], padded to 16 bytes), which the offload encodes and the
 * op-level gather decodes with the numerics' own functions (the host's bits).
 *
 * Copies move bits, and the conversion rounds each element as
 * skv_f32_to_bf16 does. Pointers may have any alignment their element type
 * can have: 16-byte units are used only when every access is aligned. Every
 * launcher only enqueues on its stream: no allocation, no synchronization.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_numerics.h"

namespace {

/* ---- chunk copies: the fetch of missed chunks, the op-level gather, the prefill offload --- */

constexpr int kGatherNT = 256;
constexpr int kGatherUnroll = 8;

/* grid (X, Hk, B): the missed chunks of host slot (b, h), listed by the select step, from the
   host store (mapped pinned memory, read over PCIe) into their chunk-cache entries. All
   kGatherUnroll 16-byte reads of a thread are in flight together. */
template <class T>
__global__ void __launch_bounds__(kGatherNT) fetch_kernel(const skv_cuda_shape sh, const skv_cuda_seq *seqs,
                                                          const int32_t *sel_idx, const int32_t *vsrc,
                                                          const int32_t *mlist, const int32_t *mcount)
{
    const int64_t nu = sh.vrec / (int64_t)sizeof(T); /* units per chunk record */
    const int64_t per_block = (int64_t)kGatherNT * kGatherUnroll;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t h = blockIdx.y; h < sh.Hk; h += gridDim.y) {
            const skv_cuda_seq &sq = seqs[b];
            if (!sq.vc_data) continue;
            const int64_t bh = (int64_t)b * sh.Hk + h;
            const int64_t total = (int64_t)mcount[bh] * nu;
            const T *src = reinterpret_cast<const T *>(sq.vstore);
            T *dst = reinterpret_cast<T *>(sq.vc_data);
            for (int64_t base = (int64_t)blockIdx.x * per_block + threadIdx.x; base < total;
                 base += (int64_t)gridDim.x * per_block) {
                const T *from[kGatherUnroll];
                T *to[kGatherUnroll];
#pragma unroll
                for (int k = 0; k < kGatherUnroll; k++) {
                    const int64_t g = base + (int64_t)k * kGatherNT;
                    from[k] = nullptr;
                    if (g < total) {
                        const int64_t r = g / nu, e = g - r * nu;
                        const int32_t s = mlist[bh * sh.S + r];
                        const int32_t m = sel_idx[bh * sh.S + s], ent = vsrc[bh * sh.S + s] & 0x7fffffff;
                        from[k] = src + ((int64_t)h * sq.n_cand + m) * nu + e;
                        to[k] = dst + ((int64_t)h * sh.vc_chunks + ent) * nu + e;
                    }
                }
                T v[kGatherUnroll];
#pragma unroll
                for (int k = 0; k < kGatherUnroll; k++)
                    if (from[k]) v[k] = *from[k];
#pragma unroll
                for (int k = 0; k < kGatherUnroll; k++)
                    if (from[k]) *to[k] = v[k];
            }
        }
}

/* Op-level gather: v_out [Hk, S, cD] chunk (h, s) = store [Hk, n_store, cD] chunk (h, idx[h][s]). */
template <class T>
__global__ void __launch_bounds__(kGatherNT) gather_kernel(int32_t Hk, int32_t S, int64_t nu, int32_t n_store,
                                                           const T *store, const int32_t *idx, T *v_out)
{
    const int64_t total = (int64_t)Hk * S * nu;
    for (int64_t g = (int64_t)blockIdx.x * kGatherNT + threadIdx.x; g < total; g += (int64_t)gridDim.x * kGatherNT) {
        const int64_t q = g / nu, e = g - q * nu, h = q / S;
        v_out[g] = store[(h * n_store + idx[q]) * nu + e];
    }
}

/* Op-level gather of fp8 records: v_out [Hk, S, c, D] element (h, s, i, d) = skv_fp8_decode of
   the code and exponent of token i of record (h, idx[h][s]) of store [Hk, n_store] (vrec bytes). */
__global__ void __launch_bounds__(kGatherNT) gather_fp8_kernel(int32_t Hk, int32_t S, int32_t c, int32_t D,
                                                               int32_t n_store, int64_t vrec, const uint8_t *store,
                                                               const int32_t *idx, uint16_t *v_out)
{
    const int64_t cD = (int64_t)c * D, total = (int64_t)Hk * S * cD;
    for (int64_t g = (int64_t)blockIdx.x * kGatherNT + threadIdx.x; g < total; g += (int64_t)gridDim.x * kGatherNT) {
        const int64_t q = g / cD, e = g - q * cD, h = q / S;
        const uint8_t *rec = store + (h * n_store + idx[q]) * vrec;
        const int32_t i = (int32_t)(e / D);
        v_out[g] = skv_fp8_decode(rec[e], (int32_t)reinterpret_cast<const int8_t *>(rec + cD)[i]);
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

/* Prefill offload of fp8 records: record (h, i) of dst [Hk, m] (vrec bytes) = the encoding
   (skv_fp8_encode_chunk) of rows ids[h*m + i]*c .. + c - 1 of head h of src [n, Hk, D]. One warp
   per record, its rows in turn: lane l reads dims 4l + 128j .. + 3 of a row, the row's maximum
   magnitude by a warp reduction gives k (skv_fp8_row_exp of that one value is the row's k), the
   codes go out as words (W4: D % 4 == 0, src 8-byte and dst 4-byte aligned; else bytes), the exponents
   4 rows to a word, lane l holding row 32j + l's. dst may be mapped host memory. */
template <bool W4>
__global__ void __launch_bounds__(kGatherNT) store_fp8_kernel(const uint16_t *src, int32_t Hk, int32_t D, int32_t c,
                                                              const int32_t *ids, int32_t m, uint8_t *dst, int64_t vrec)
{
    const int lane = threadIdx.x & 31;
    const int64_t n_rec = (int64_t)Hk * m, HkD = (int64_t)Hk * D;
    const int32_t c16 = (c + 15) & ~15;
    for (int64_t r = ((int64_t)blockIdx.x * kGatherNT + threadIdx.x) / 32; r < n_rec;
         r += (int64_t)gridDim.x * (kGatherNT / 32)) {
        const int64_t hh = r / m;
        uint8_t *rec = dst + r * vrec;
        int8_t *ex = reinterpret_cast<int8_t *>(rec + (int64_t)c * D);
        const uint16_t *base = src + (int64_t)ids[r] * c * HkD + hh * D;
        for (int32_t i0 = 0; i0 < c16; i0 += 32) {
            int32_t kmine = 0; /* the exponent of row i0 + lane (0 past c: the padding) */
            for (int32_t i = i0; i < c && i < i0 + 32; i++) {
                const uint16_t *row = base + (int64_t)i * HkD;
                uint32_t mx = 0;
                for (int32_t d = 4 * lane; d < D; d += 128) {
                    if (W4) { /* 8-byte aligned: D % 4 == 0 and src from an allocation */
                        const uint2 u = *reinterpret_cast<const uint2 *>(row + d);
                        mx = max(mx, max(max(u.x & 0x7fffu, (u.x >> 16) & 0x7fffu),
                                         max(u.y & 0x7fffu, (u.y >> 16) & 0x7fffu)));
                    } else {
#pragma unroll
                        for (int j = 0; j < 4; j++)
                            if (d + j < D) mx = max(mx, (uint32_t)(row[d + j] & 0x7fffu));
                    }
                }
                for (int o = 16; o > 0; o >>= 1) mx = max(mx, __shfl_xor_sync(kFullMask, mx, o));
                const uint16_t m16 = (uint16_t)mx;
                const int32_t k = skv_fp8_row_exp(&m16, 1);
                if (lane == i - i0) kmine = k;
                uint8_t *out = rec + (int64_t)i * D;
                for (int32_t d = 4 * lane; d < D; d += 128) {
                    if (W4) {
                        const uint2 u = *reinterpret_cast<const uint2 *>(row + d); /* again: from L1 */
                        const uint16_t x[4] = {(uint16_t)u.x, (uint16_t)(u.x >> 16), (uint16_t)u.y, (uint16_t)(u.y >> 16)};
                        uint32_t w = 0;
#pragma unroll
                        for (int j = 0; j < 4; j++) w |= (uint32_t)skv_fp8_encode(x[j], k) << (8 * j);
                        *reinterpret_cast<uint32_t *>(out + d) = w;
                    } else {
#pragma unroll
                        for (int j = 0; j < 4; j++)
                            if (d + j < D) out[d + j] = skv_fp8_encode(row[d + j], k);
                    }
                }
            }
            /* the exponents of rows i0 .. i0 + 31 (those below c16) */
            const uint32_t b0 = (uint32_t)kmine & 0xffu;
            const uint32_t b1 = __shfl_down_sync(kFullMask, b0, 1), b2 = __shfl_down_sync(kFullMask, b0, 2),
                           b3 = __shfl_down_sync(kFullMask, b0, 3);
            if (W4) {
                if ((lane & 3) == 0 && i0 + lane < c16)
                    *reinterpret_cast<uint32_t *>(ex + i0 + lane) = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
            } else if (i0 + lane < c16) {
                ex[i0 + lane] = (int8_t)b0;
            }
        }
    }
}

/* The offload of fp8 records in the common case (D <= 128, D % 4 == 0, src 8-byte and dst 4-byte
   aligned): as store_fp8_kernel<true>, lane l holding dims 4l .. 4l + 3, with the loads of
   kFp8Rows rows in flight together before they are encoded in turn. */
constexpr int kFp8Rows = 4;
__global__ void __launch_bounds__(kGatherNT) store_fp8_rows_kernel(const uint16_t *src, int32_t Hk, int32_t D, int32_t c,
                                                                   const int32_t *ids, int32_t m, uint8_t *dst, int64_t vrec)
{
    const int lane = threadIdx.x & 31;
    const bool mine = 4 * lane < D;
    const int64_t n_rec = (int64_t)Hk * m, HkD = (int64_t)Hk * D;
    const int32_t c16 = (c + 15) & ~15;
    for (int64_t r = ((int64_t)blockIdx.x * kGatherNT + threadIdx.x) / 32; r < n_rec;
         r += (int64_t)gridDim.x * (kGatherNT / 32)) {
        uint8_t *rec = dst + r * vrec;
        int8_t *ex = reinterpret_cast<int8_t *>(rec + (int64_t)c * D);
        const uint16_t *base = src + (int64_t)ids[r] * c * HkD + (r / m) * D + 4 * lane;
        for (int32_t i0 = 0; i0 < c16; i0 += 32) {
            int32_t kmine = 0; /* the exponent of row i0 + lane (0 past c: the padding) */
            const int32_t i1 = c < i0 + 32 ? c : i0 + 32;
            for (int32_t ib = i0; ib < i1; ib += kFp8Rows) {
                uint2 u[kFp8Rows];
#pragma unroll
                for (int j = 0; j < kFp8Rows; j++)
                    u[j] = mine && ib + j < i1 ? *reinterpret_cast<const uint2 *>(base + (int64_t)(ib + j) * HkD)
                                               : make_uint2(0u, 0u);
#pragma unroll
                for (int j = 0; j < kFp8Rows; j++) {
                    if (ib + j >= i1) break; /* warp-uniform */
                    const uint16_t x[4] = {(uint16_t)u[j].x, (uint16_t)(u[j].x >> 16), (uint16_t)u[j].y,
                                           (uint16_t)(u[j].y >> 16)};
                    uint32_t mx = max(max(x[0] & 0x7fffu, x[1] & 0x7fffu), max(x[2] & 0x7fffu, x[3] & 0x7fffu));
                    for (int o = 16; o > 0; o >>= 1) mx = max(mx, __shfl_xor_sync(kFullMask, mx, o));
                    const uint16_t m16 = (uint16_t)mx;
                    const int32_t k = skv_fp8_row_exp(&m16, 1);
                    if (lane == ib + j - i0) kmine = k;
                    if (mine) {
                        uint32_t w = 0;
#pragma unroll
                        for (int e = 0; e < 4; e++) w |= (uint32_t)skv_fp8_encode(x[e], k) << (8 * e);
                        *reinterpret_cast<uint32_t *>(rec + (int64_t)(ib + j) * D + 4 * lane) = w;
                    }
                }
            }
            const uint32_t b0 = (uint32_t)kmine & 0xffu;
            const uint32_t b1 = __shfl_down_sync(kFullMask, b0, 1), b2 = __shfl_down_sync(kFullMask, b0, 2),
                           b3 = __shfl_down_sync(kFullMask, b0, 3);
            if ((lane & 3) == 0 && i0 + lane < c16)
                *reinterpret_cast<uint32_t *>(ex + i0 + lane) = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
        }
    }
}

/* ---- conversion ------------------------------------------------------------------------- */

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

cudaError_t skv_cuda_fetch(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                           const skv_cuda_dws *ws)
{
    if (sh->B <= 0 || sh->Hk <= 0) return cudaSuccess;
    /* PCIe needs only ~100 KB in flight: about 128 CTAs of 32 KB in flight in all, the rest of
       the GPU attends the hits and the resident spans meanwhile */
    const int64_t pairs = (int64_t)sh->B * sh->Hk;
    const unsigned x = (unsigned)(128 / pairs > 1 ? 128 / pairs : 1);
    const dim3 grid(x, clamp_yz(sh->Hk), clamp_yz(sh->B));
    if (sh->vrec % 16 == 0)
        return launch(fetch_kernel<uint4>, grid, dim3(kGatherNT), 0, st, false, *sh, seqs, (const int32_t *)ws->sel_idx,
                      (const int32_t *)ws->vsrc, (const int32_t *)ws->mlist, (const int32_t *)ws->mcount);
    if (sh->vrec % 2 == 0)
        return launch(fetch_kernel<uint16_t>, grid, dim3(kGatherNT), 0, st, false, *sh, seqs, (const int32_t *)ws->sel_idx,
                      (const int32_t *)ws->vsrc, (const int32_t *)ws->mlist, (const int32_t *)ws->mcount);
    return launch(fetch_kernel<uint8_t>, grid, dim3(kGatherNT), 0, st, false, *sh, seqs, (const int32_t *)ws->sel_idx,
                  (const int32_t *)ws->vsrc, (const int32_t *)ws->mlist, (const int32_t *)ws->mcount);
}

cudaError_t skv_cuda_gather(cudaStream_t st, int32_t Hk, int32_t D, int32_t c, int32_t n_store, int32_t S,
                            int32_t value_dtype, const void *store_, const int32_t *idx, skv_bf16 *v_out)
{
    const int64_t cD = (int64_t)c * D;
    if (Hk <= 0 || S <= 0 || cD <= 0) return cudaSuccess;
    if (value_dtype == SKV_VALUE_FP8) {
        gather_fp8_kernel<<<grid_for((int64_t)Hk * S * cD, kGatherNT, 65535), kGatherNT, 0, st>>>(
            Hk, S, c, D, n_store, (int64_t)skv_value_chunk_bytes(value_dtype, c, D), (const uint8_t *)store_, idx,
            v_out);
        return cudaGetLastError();
    }
    const skv_bf16 *store = (const skv_bf16 *)store_;
    if (cD % 8 == 0 && (((uintptr_t)store | (uintptr_t)v_out) & 15) == 0) {
        const int64_t nu = cD / 8;
        gather_kernel<uint4><<<grid_for((int64_t)Hk * S * nu, kGatherNT, 65535), kGatherNT, 0, st>>>(
            Hk, S, nu, n_store, reinterpret_cast<const uint4 *>(store), idx, reinterpret_cast<uint4 *>(v_out));
    } else {
        gather_kernel<uint16_t><<<grid_for((int64_t)Hk * S * cD, kGatherNT, 65535), kGatherNT, 0, st>>>(
            Hk, S, cD, n_store, store, idx, v_out);
    }
    return cudaGetLastError();
}

cudaError_t skv_cuda_f32_to_bf16(cudaStream_t st, const float *x, skv_bf16 *y, int64_t n)
{
    if (n <= 0) return cudaSuccess;
    if ((((uintptr_t)x & 15) | ((uintptr_t)y & 7)) == 0)
        f32_to_bf16_kernel<4><<<grid_for(n / 4 + 1, kSmallNT, kSmallMaxGrid), kSmallNT, 0, st>>>(x, y, n);
    else
        f32_to_bf16_kernel<1><<<grid_for(n, kSmallNT, kSmallMaxGrid), kSmallNT, 0, st>>>(x, y, n);
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

cudaError_t skv_cuda_store_chunks(cudaStream_t st, int32_t value_dtype, const skv_bf16 *src, int32_t Hk, int32_t D,
                                  int32_t c, const int32_t *ids, int32_t m, void *dst, int32_t max_blocks)
{
    if (value_dtype != SKV_VALUE_FP8) return skv_cuda_gather_chunks(st, src, Hk, D, c, ids, m, (skv_bf16 *)dst, max_blocks);
    const int64_t n_rec = (int64_t)Hk * m;
    if (n_rec <= 0 || D <= 0 || c <= 0) return cudaSuccess;
    const int64_t vrec = (int64_t)skv_value_chunk_bytes(value_dtype, c, D);
    const int64_t cap = max_blocks > 0 && max_blocks < 65535 ? max_blocks : 65535;
    const unsigned grid = grid_for(n_rec, kGatherNT / 32, cap);
    /* words when every row and the exponents start 4-byte aligned (records are at multiples of vrec) */
    const bool w4 = D % 4 == 0 && vrec % 4 == 0 && ((uintptr_t)dst & 3) == 0 && ((uintptr_t)src & 7) == 0;
    if (w4 && D <= 128)
        store_fp8_rows_kernel<<<grid, kGatherNT, 0, st>>>((const uint16_t *)src, Hk, D, c, ids, m, (uint8_t *)dst, vrec);
    else if (w4)
        store_fp8_kernel<true><<<grid, kGatherNT, 0, st>>>((const uint16_t *)src, Hk, D, c, ids, m, (uint8_t *)dst, vrec);
    else
        store_fp8_kernel<false><<<grid, kGatherNT, 0, st>>>((const uint16_t *)src, Hk, D, c, ids, m, (uint8_t *)dst, vrec);
    return cudaGetLastError();
}
