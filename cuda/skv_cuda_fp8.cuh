/*
 * skv_cuda_fp8.cuh - fp8 value records on the device (config.value_dtype = SKV_VALUE_FP8; the
 * format is lib/skv_numerics.h's: a chunk record of c tokens is the codes [c][D] (e4m3), then the
 * exponents [c] (int8), padded to 16 bytes; value d of token i is code * 2^k).
 *
 * The attention kernels decode with the hardware's e4m3 -> f16 conversion (exact: every e4m3 value
 * is a normal f16 or zero), the exact product with 2^k in float (k >= SKV_FP8_EXP_MIN keeps it a
 * normal float) and the exact conversion to bf16 (4 significant bits): the bits of skv_fp8_decode,
 * so the tile the kernels read in shared memory is the one a bf16 store of the decoded values
 * would give.
 */
#ifndef SKV_CUDA_FP8_CUH
#define SKV_CUDA_FP8_CUH

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <string.h>

namespace {

/* 2^k as a float (SKV_FP8_EXP_MIN <= k <= 127). */
__device__ __forceinline__ float fp8_scale(int32_t k) { return __uint_as_float((uint32_t)(k + 127) << 23); }

/* Two codes (the low byte first) times s, as floats: exact. */
__device__ __forceinline__ float2 fp8x2_to_f32(uint32_t two, float s)
{
    const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xffffu), __NV_E4M3);
    __half2 h;
    memcpy(&h, &hr, sizeof h);
    const float2 f = __half22float2(h);
    return make_float2(f.x * s, f.y * s);
}

/* Two floats (exact in bf16) packed as bf16, lo in the low half. */
__device__ __forceinline__ uint32_t fp8_pack_bf16(float lo, float hi)
{
    uint32_t d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

/* 4 codes (a word, the low byte first) times s -> 4 packed bf16 (two words). */
__device__ __forceinline__ uint2 fp8x4_to_bf16(uint32_t w, float s)
{
    const float2 a = fp8x2_to_f32(w, s), b = fp8x2_to_f32(w >> 16, s);
    return make_uint2(fp8_pack_bf16(a.x, a.y), fp8_pack_bf16(b.x, b.y));
}

/* 8 codes times 2^k -> 8 packed bf16 (skv_fp8_decode's bits). */
__device__ __forceinline__ uint4 fp8x8_to_bf16(uint2 c, int32_t k)
{
    const float s = fp8_scale(k);
    const uint2 a = fp8x4_to_bf16(c.x, s), b = fp8x4_to_bf16(c.y, s);
    return make_uint4(a.x, a.y, b.x, b.y);
}

/* 16 codes times 2^k -> 16 floats (the decoded bf16 values, exactly). */
__device__ __forceinline__ void fp8x16_to_f32(uint4 c, int32_t k, float f[16])
{
    const float s = fp8_scale(k);
    const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 a = fp8x2_to_f32(w[i], s), b = fp8x2_to_f32(w[i] >> 16, s);
        f[4 * i] = a.x, f[4 * i + 1] = a.y, f[4 * i + 2] = b.x, f[4 * i + 3] = b.y;
    }
}

/* 8 codes from src (any alignment), of which only the first n are read (the rest are code 0). */
__device__ __forceinline__ uint2 fp8_load8_slow(const uint8_t *src, int n)
{
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j < n) w[j >> 2] |= (uint32_t)src[j] << (8 * (j & 3));
    return make_uint2(w[0], w[1]);
}

/* 8 codes of a value row from src (8-byte aligned when n == 8 and the address is), the first n
   read, decoded with exponent k into 16-byte aligned shared memory. */
__device__ __forceinline__ void fp8_load8_bf16(uint16_t *dst, const uint8_t *src, int n, int32_t k)
{
    const uint2 c = n >= 8 && ((uintptr_t)src & 7) == 0 ? *reinterpret_cast<const uint2 *>(src) : fp8_load8_slow(src, n);
    *reinterpret_cast<uint4 *>(dst) = fp8x8_to_bf16(c, k);
}

/* Token i's codes and exponent in the chunk record rec of c tokens of D values. */
__device__ __forceinline__ const uint8_t *fp8_row(const uint8_t *rec, int32_t i, int32_t D) { return rec + (int64_t)i * D; }
__device__ __forceinline__ int32_t fp8_exp(const uint8_t *rec, int32_t i, int32_t c, int32_t D)
{
    return (int32_t)reinterpret_cast<const int8_t *>(rec + (int64_t)c * D)[i];
}

} /* namespace */

#endif /* SKV_CUDA_FP8_CUH */
