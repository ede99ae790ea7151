/*
 * skv_cuda_common.cuh - small device and launch helpers shared by the cuda
 * files (the .cu files of cuda/ and skv_cuda_chol.cuh). Header-only; everything is in an
 * anonymous namespace, so each file has its own copy.
 */
#ifndef SKV_CUDA_COMMON_CUH
#define SKV_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr size_t kSmemDefaultMax = 48 * 1024; /* above this a kernel must opt in */

__host__ __device__ inline int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Grid size of a grid-stride kernel: enough blocks for the work, at least 1, at most cap. */
inline unsigned grid_for(int64_t units, int64_t per_block, int64_t cap)
{
    int64_t g = ceil_div64(units, per_block);
    if (g < 1) g = 1;
    if (g > cap) g = cap;
    return (unsigned)g;
}

/* Grid dimensions y and z are limited to 65535: kernels that put heads or
   sequences there loop over them with this stride. */
constexpr int32_t kMaxGridYZ = 65535;

inline unsigned clamp_yz(int32_t n) { return (unsigned)(n < kMaxGridYZ ? n : kMaxGridYZ); }

/* Block size and grid cap of the small grid-stride kernels (input checks, conversions). */
constexpr int kSmallNT = 256;
constexpr int64_t kSmallMaxGrid = 4096;

/* Kernels whose static plus dynamic shared memory passes 48 KiB must say so first (a function
   attribute: no allocation, no synchronization). The attribute is set once the dynamic part
   passes 48 KiB less kSmemStaticMax, the most static shared memory a kernel here declares. */
constexpr size_t kSmemStaticMax = 16 * 1024;
template <class K>
cudaError_t allow_smem(K kernel, size_t bytes)
{
    if (bytes + kSmemStaticMax <= kSmemDefaultMax) return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

/* Multiprocessors of the current device (read once; 132 if it cannot be read). */
inline int num_sms()
{
    static int n = 0;
    if (!n) {
        int dev = 0, v = 0;
        if (cudaGetDevice(&dev) == cudaSuccess &&
            cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v > 0)
            n = v;
        else
            n = 132;
        (void)cudaGetLastError();
    }
    return n;
}

/*
 * Launch with programmatic dependent launch when pdl is set: the kernel may be
 * scheduled while the previous kernel of the stream finishes; it must call
 * pdl_wait() before it touches memory that kernel reads or writes.
 */
template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, bool pdl,
                   Args... args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = pdl ? at : nullptr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

/* Waits until the previous grid of the stream has completed and its memory is visible
   (a no-op when the kernel was not launched as a dependent). */
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
/* Lets the next (dependent) grid be scheduled once every block of this one got here. */
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" :::); }

/* Sends the 128-byte line at p toward L2 (no data comes back). */
__device__ __forceinline__ void prefetch_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

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

__device__ __forceinline__ double warp_sum(double x)
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

/* 16-byte global -> shared copy that does not occupy registers (cp.async, L2 only). */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void store_zero16(void *smem) { *reinterpret_cast<uint4 *>(smem) = make_uint4(0, 0, 0, 0); }

/* The element-wise fallback of cp_async16: 8 bf16 from src (any alignment), of which
   only the first n are read (the rest are 0), into 16-byte aligned shared memory. */
__device__ __forceinline__ void load8_slow(uint16_t *dst, const uint16_t *src, int n)
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
__device__ __forceinline__ void store8(uint16_t *dst, const uint32_t w[4])
{
    if (((uintptr_t)dst & 15) == 0) {
        *reinterpret_cast<uint4 *>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            dst[2 * j] = (uint16_t)(w[j] & 0xffffu);
            dst[2 * j + 1] = (uint16_t)(w[j] >> 16);
        }
    }
}

} /* namespace */

#endif /* SKV_CUDA_COMMON_CUH */
