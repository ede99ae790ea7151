/*
 * skv_cuda_backend.cu - the cuda backend's dispatch table and its infrastructure slots.
 *
 * skv_cuda_fill_ops names the function behind every slot of struct skv_backend_ops:
 * the infrastructure slots here (probe; mem_alloc, mem_free: device memory, or pinned
 * and mapped host memory; copy2d; the input checks check_finite and check_range, whose
 * kernels are in skv_cuda_check.cu), the op-level slots of skv_cuda_ops.cu and the
 * cache's slots (cache_*) of skv_cuda_cache.cu. Also the error mapping the backend's
 * host files share (skv_cuda_err, and CK in skv_cuda.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_internal.h"

/* ---- errors ------------------------------------------------------------------------------ */

skv_status skv_cuda_err(cudaError_t e, const char *what, char *msg, size_t cap)
{
    if (msg && cap) snprintf(msg, cap, "%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
    skv_cuda_note("%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
    (void)cudaGetLastError(); /* a failed call must not surface as a later launch's error */
    return e == cudaErrorMemoryAllocation ? SKV_ERR_OUT_OF_MEMORY : SKV_ERR_DEVICE;
}

/* ---- infrastructure slots ------------------------------------------------------------------ */

static skv_status skv_cuda_probe(char *msg, size_t cap)
{
    int n = 0, dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        snprintf(msg, cap, "no usable CUDA device: %s",
                 e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found none");
        (void)cudaGetLastError();
        return SKV_ERR_NO_DEVICE;
    }
    cudaDeviceProp p;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&p, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(msg, cap, "no usable CUDA device: cannot read the properties of the current device");
        return SKV_ERR_NO_DEVICE;
    }
    if (p.major < 9) {
        snprintf(msg, cap,
                 "CUDA device %d (%s) has compute capability %d.%d; this build runs on 9.0 (Hopper) and newer",
                 dev, p.name, p.major, p.minor);
        return SKV_ERR_NO_DEVICE;
    }
    return SKV_OK;
}

static void *skv_cuda_mem_alloc(size_t bytes, skv_mem_kind kind)
{
    void *p = NULL;
    if (!bytes) bytes = 1;
    if (kind == SKV_MEM_HOST) {
        /* pinned and mapped: kernels read the value store straight over PCIe */
        if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
            (void)cudaGetLastError();
            return NULL;
        }
        memset(p, 0, bytes);
        return p;
    }
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    /* cudaMemset is asynchronous on the legacy stream, which a non-blocking cache stream does
       not wait for: finish it before anyone writes into the buffer */
    if (cudaMemset(p, 0, bytes) != cudaSuccess || cudaStreamSynchronize(0) != cudaSuccess) {
        (void)cudaGetLastError();
        cudaFree(p);
        return NULL;
    }
    return p;
}

static void skv_cuda_mem_free(void *p, skv_mem_kind kind)
{
    if (!p) return;
    if (kind == SKV_MEM_HOST) cudaFreeHost(p);
    else cudaFree(p);
}

static skv_status skv_cuda_copy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                                  size_t height)
{
    char *msg = NULL;
    size_t cap = 0;
    if (!width || !height) return SKV_OK;
    if (height == 1) CK(cudaMemcpy(dst, src, width, cudaMemcpyDefault));
    else CK(cudaMemcpy2D(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault));
    /* cudaMemcpy from pageable memory may return before the DMA has landed; the
       copy is on the legacy stream, which a non-blocking cache stream does not
       wait for, so finish it here: the copy is synchronous as documented */
    CK(cudaStreamSynchronize(0));
    return SKV_OK;
}

/* A small device buffer for op-level results: a flag word and its host copy. */
static skv_status skv_cuda_flag_run(unsigned long long *result, int (*enqueue)(unsigned long long *, const void *),
                                    const void *arg)
{
    char *msg = NULL;
    size_t cap = 0;
    unsigned long long *d = NULL;
    CK(cudaMalloc(&d, sizeof *d));
    cudaError_t e = cudaMemset(d, 0xff, sizeof *d);
    if (e == cudaSuccess) e = (cudaError_t)enqueue(d, arg);
    if (e == cudaSuccess) e = cudaMemcpy(result, d, sizeof *d, cudaMemcpyDeviceToHost);
    cudaFree(d);
    if (e != cudaSuccess) return skv_cuda_err(e, "flag check", msg, cap);
    return SKV_OK;
}

typedef struct {
    const skv_bf16 *x;
    int64_t n_a, s_a, n_b, s_b, len;
} skv_cuda_finite_args;

static int skv_cuda_enqueue_finite(unsigned long long *d, const void *arg)
{
    const skv_cuda_finite_args *a = (const skv_cuda_finite_args *)arg;
    return (int)skv_cuda_find_nonfinite(0, a->x, a->n_a, a->s_a, a->n_b, a->s_b, a->len, d);
}

static skv_status skv_cuda_check_finite(const skv_bf16 *x, int64_t n_a, int64_t s_a, int64_t n_b, int64_t s_b,
                                        int64_t len, int64_t *first_bad)
{
    if (n_a <= 0 || n_b <= 0 || len <= 0) return SKV_OK;
    skv_cuda_finite_args a = {x, n_a, s_a, n_b, s_b, len};
    unsigned long long r = ~0ull;
    skv_status st = skv_cuda_flag_run(&r, skv_cuda_enqueue_finite, &a);
    if (st) return st;
    if (r == ~0ull) return SKV_OK;
    *first_bad = (int64_t)r;
    return SKV_ERR_NONFINITE;
}

typedef struct {
    const int32_t *x;
    int64_t n, lo, hi;
} skv_cuda_range_args;

static int skv_cuda_enqueue_range(unsigned long long *d, const void *arg)
{
    const skv_cuda_range_args *a = (const skv_cuda_range_args *)arg;
    return (int)skv_cuda_find_out_of_range(0, a->x, a->n, a->lo, a->hi, d);
}

static skv_status skv_cuda_check_range(const int32_t *x, int64_t n, int64_t lo, int64_t hi, int64_t *first_bad,
                                       int32_t *value)
{
    char *msg = NULL;
    size_t cap = 0;
    if (n <= 0) return SKV_OK;
    skv_cuda_range_args a = {x, n, lo, hi};
    unsigned long long r = ~0ull;
    skv_status st = skv_cuda_flag_run(&r, skv_cuda_enqueue_range, &a);
    if (st) return st;
    if (r == ~0ull) return SKV_OK;
    *first_bad = (int64_t)r;
    CK(cudaMemcpy(value, x + r, sizeof *value, cudaMemcpyDeviceToHost));
    return SKV_ERR_INVALID_ARGUMENT;
}

/* ---- the cache's device --------------------------------------------------------------------- */

static skv_status skv_cuda_device_enter(int32_t device, int32_t *saved, char *msg, size_t cap)
{
    int cur = 0, n = 0;
    CK(cudaGetDevice(&cur));
    *saved = cur;
    if (device < 0 || device == cur) return SKV_OK;
    CK(cudaGetDeviceCount(&n));
    if (device >= n) {
        snprintf(msg, cap, "cuda_device = %d: this machine has %d CUDA device%s (0 to %d)", (int)device, n,
                 n == 1 ? "" : "s", n - 1);
        return SKV_ERR_NO_DEVICE;
    }
    int major = 0;
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    if (major < 9) {
        snprintf(msg, cap, "cuda_device = %d has compute capability %d.x; this build runs on 9.0 (Hopper) and newer",
                 (int)device, major);
        return SKV_ERR_NO_DEVICE;
    }
    CK(cudaSetDevice(device));
    return SKV_OK;
}

static void skv_cuda_device_leave(int32_t saved)
{
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != saved) (void)cudaSetDevice(saved);
    (void)cudaGetLastError();
}

/* ---- registration --------------------------------------------------------------------------- */

void skv_cuda_fill_ops(struct skv_backend_ops *ops)
{
    memset(ops, 0, sizeof *ops);
    ops->name = "cuda";
    ops->probe = skv_cuda_probe;
    ops->mem_alloc = skv_cuda_mem_alloc;
    ops->mem_free = skv_cuda_mem_free;
    ops->copy2d = skv_cuda_copy2d;
    ops->check_finite = skv_cuda_check_finite;
    ops->check_range = skv_cuda_check_range;
    ops->set_threads = NULL;
    ops->device_enter = skv_cuda_device_enter;
    ops->device_leave = skv_cuda_device_leave;
    ops->decode_ws_bytes = NULL; /* the cache's workspace comes from cache_open */
    ops->factorize = skv_cuda_factorize_op;
    ops->op_release = skv_cuda_op_release;
    ops->rope = skv_cuda_rope_op;
    ops->landmarks_outliers = skv_cuda_landmarks_op;
    ops->score_select = skv_cuda_score_select_op;
    ops->rebuild_keys = skv_cuda_rebuild_op;
    ops->gather_values = skv_cuda_gather_op;
    ops->sparse_attention = skv_cuda_sparse_attention_op;
    ops->rebuild_keys_canonical = skv_cuda_rebuild_canonical_op;
    ops->sparse_attention_canonical = skv_cuda_sparse_attention_canonical_op;
    ops->full_attention = skv_cuda_full_attention_op;
    ops->cache_bytes = skv_cuda_cache_bytes;
    ops->cache_open = skv_cuda_cache_open;
    ops->cache_close = skv_cuda_cache_close;
    ops->cache_prefill = skv_cuda_cache_prefill;
    ops->cache_decode = skv_cuda_cache_decode;
    ops->cache_release = skv_cuda_cache_release;
    ops->cache_copy = skv_cuda_cache_copy;
    ops->cache_seq_ready = skv_cuda_cache_seq_ready;
    ops->cache_sync = skv_cuda_cache_sync;
    ops->cache_set_states = skv_cuda_cache_set_states;
}
