/*
 * skv_cuda_factor.cu - the rank-r factorization of the cuda backend
 * (cuBLAS + cuSOLVER). The plain, correct GPU route: same math as ref and cpu
 * (Gram matrix, eigensolver in double, one projection), no iteration.
 *
 * a [n, d] bf16 row-major (device). m = min(n, d).
 *
 * n >= d (every real prompt):
 *   1. G = A^T A (d x d). A is streamed in blocks of SKV_CF_GRAM_ROWS rows; each
 *      block's Gram is one bf16 tensor-core GEMM with fp32 accumulation and
 *      output (bf16 products are exact in fp32), and the block Grams are added
 *      into a double accumulator. Blocking keeps the fp32 error bounded by the
 *      block length instead of growing with n: tensor cores accumulate with
 *      truncation once per MMA step, so an fp32 sum over 1M rows would lose
 *      ~n/16 ulps where a 16k-row block loses at most ~2^10 ulps (~1e-4
 *      relative, and mostly a common scaling of G that leaves its eigenvectors
 *      alone); the double sum over blocks adds nothing measurable.
 *   2. cusolverDnXsyevd (double) on G: all eigenpairs, ascending. V_r = the
 *      eigenvectors of the r largest eigenvalues, column q = q-th largest.
 *   3. W = V_r^T rounded to float. Row-major W [r, d] is exactly V_r in
 *      column-major order, so w doubles as the float V_r of step 4.
 *   4. U = A V_r in true fp32 (no TF32, no rounding of V_r to bf16): A is
 *      converted to float in blocks of SKV_CF_PROJ_ELEMS elements, one GEMM
 *      per block with CUBLAS_COMPUTE_32F_PEDANTIC.
 * n < d (short prompts, as cpu does): the smaller Gram A A^T (n x n), blocked
 *   over columns the same way; U = its top-r eigenvectors (orthonormal, float),
 *   W = U^T A in fp32, accumulated over row blocks of A.
 * Either way U W ~ A V_r V_r^T (resp. U_r U_r^T A), the best rank-r
 * approximation up to the fp32 Gram error (DESIGN.md section 6).
 *
 * cuBLAS column-major view: row-major X [p, q] is column-major X^T [q, p] with
 * leading dimension q. So A is column-major M = A^T [d, n] (ld d), U is
 * column-major U^T [r, n] (ld r), W is column-major W^T = V_r [d, r] (ld d).
 *
 * Workspace (all allocated at create for n_max rows; nothing grows with n
 * beyond min(n_max, d), since both passes over A are blocked):
 *   gd      double [m_max^2]   Gram accumulator, then the eigenvectors
 *   evals   double [m_max]     eigenvalues
 *   scratch float  [max(m_max^2, proj_rows * d)]
 *                              a block's fp32 Gram, later a block of A in float
 *   info    int                cuSOLVER's info
 *   blas_ws 32 MiB             cuBLAS workspace (set with cublasSetWorkspace,
 *                              so factorize never allocates)
 *   solver  queried            cusolverDnXsyevd device (+ host) workspace for
 *                              the largest eigenproblem, m_max = min(n_max, d)
 *
 * Supported maximum: n <= SKV_CUDA_FACTOR_MAX_N = 2^31 - 1 rows. Every cuBLAS
 * and cuSOLVER call uses the 64-bit API and every GEMM sees at most one block
 * of rows, so nothing here overflows below INT64 sizes; the limit keeps row
 * indices inside int32 like the rest of the backend (and room for a later
 * route that hands n to a 32-bit interface). At d >= 1 such an A is >= 4 GiB,
 * at d = 1024 it is 4 TiB: no practical restriction.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "skv_cuda.h"
#include "skv_internal.h"
#include "skv_numerics.h"

#define SKV_CUDA_FACTOR_MAX_N ((int64_t)INT32_MAX)
/* Rows (n >= d) or columns (n < d) per fp32 Gram block. */
#define SKV_CF_GRAM_ROWS ((int64_t)16384)
/* Elements of A converted to float per projection block (64 MiB of floats). */
#define SKV_CF_PROJ_ELEMS ((int64_t)1 << 24)
/* cuBLAS workspace (NVIDIA's recommendation for Hopper). */
#define SKV_CF_BLAS_WS ((size_t)32 << 20)

struct skv_cuda_factor {
    cudaStream_t st;
    cublasHandle_t blas;
    cusolverDnHandle_t solver;
    cusolverDnParams_t params;
    int64_t n_max, m_max, proj_rows;
    int32_t d, r;
    double *gd;     /* [m_max^2] */
    double *evals;  /* [m_max] */
    float *scratch; /* [scratch_floats] */
    size_t scratch_floats;
    int *info;
    void *blas_ws;
    void *solver_ws; /* device */
    size_t solver_ws_bytes;
    void *solver_host; /* host, NULL if cuSOLVER wants none */
    size_t solver_host_bytes;
};

/* ---- sizes ---------------------------------------------------------------------- */

typedef struct skv_cf_sizes {
    int64_t m_max, proj_rows;
    size_t gd_bytes, evals_bytes, scratch_floats, scratch_bytes, total;
} skv_cf_sizes;

/* 0 on invalid arguments or size_t overflow. */
static int skv_cf_sizes_of(int64_t n_max, int32_t d, skv_cf_sizes *s)
{
    if (n_max < 1 || d < 1) return 0;
    s->m_max = n_max < d ? n_max : d;
    s->proj_rows = SKV_CF_PROJ_ELEMS / d;
    if (s->proj_rows < 1) s->proj_rows = 1;
    if (s->proj_rows > n_max) s->proj_rows = n_max;
    size_t mm, pr, t;
    if (!skv_mul_size((size_t)s->m_max, (size_t)s->m_max, &mm)) return 0;
    if (!skv_mul_size((size_t)s->proj_rows, (size_t)d, &pr)) return 0;
    s->scratch_floats = mm > pr ? mm : pr;
    if (!skv_mul_size(mm, sizeof(double), &s->gd_bytes)) return 0;
    if (!skv_mul_size((size_t)s->m_max, sizeof(double), &s->evals_bytes)) return 0;
    if (!skv_mul_size(s->scratch_floats, sizeof(float), &s->scratch_bytes)) return 0;
    if (!skv_add_size(s->gd_bytes, s->evals_bytes, &t)) return 0;
    if (!skv_add_size(t, s->scratch_bytes, &t)) return 0;
    if (!skv_add_size(t, sizeof(int), &t)) return 0;
    if (!skv_add_size(t, SKV_CF_BLAS_WS, &t)) return 0;
    s->total = t;
    return 1;
}

extern "C" size_t skv_cuda_factor_bytes(int64_t n_max, int32_t d, int32_t r)
{
    (void)r; /* the outputs are the caller's; the workspace does not depend on r */
    skv_cf_sizes s;
    return skv_cf_sizes_of(n_max, d, &s) ? s.total : SIZE_MAX;
}

/* ---- status mapping --------------------------------------------------------------- */

static skv_status skv_cf_fail(char *msg, size_t cap, skv_status st, const char *what, const char *detail)
{
    if (msg && cap) snprintf(msg, cap, "cuda factorize: %s: %s", what, detail);
    return st;
}

static skv_status skv_cf_cuda(cudaError_t e, const char *what, char *msg, size_t cap)
{
    if (e == cudaSuccess) return SKV_OK;
    return skv_cf_fail(msg, cap, e == cudaErrorMemoryAllocation ? SKV_ERR_OUT_OF_MEMORY : SKV_ERR_NO_DEVICE, what,
                       cudaGetErrorString(e));
}

static skv_status skv_cf_blas(cublasStatus_t e, const char *what, char *msg, size_t cap)
{
    if (e == CUBLAS_STATUS_SUCCESS) return SKV_OK;
    skv_status st = SKV_ERR_NO_DEVICE; /* not initialized, execution failed, internal, arch mismatch ... */
    if (e == CUBLAS_STATUS_ALLOC_FAILED) st = SKV_ERR_OUT_OF_MEMORY;
    else if (e == CUBLAS_STATUS_INVALID_VALUE) st = SKV_ERR_INVALID_ARGUMENT;
    else if (e == CUBLAS_STATUS_NOT_SUPPORTED) st = SKV_ERR_UNSUPPORTED;
    if (msg && cap)
        snprintf(msg, cap, "cuda factorize: %s: %s (%s)", what, cublasGetStatusName(e), cublasGetStatusString(e));
    return st;
}

static skv_status skv_cf_solver(cusolverStatus_t e, const char *what, char *msg, size_t cap)
{
    if (e == CUSOLVER_STATUS_SUCCESS) return SKV_OK;
    skv_status st = SKV_ERR_NO_DEVICE;
    const char *name = "cuSOLVER error";
    switch (e) {
    case CUSOLVER_STATUS_NOT_INITIALIZED: name = "CUSOLVER_STATUS_NOT_INITIALIZED"; break;
    case CUSOLVER_STATUS_ALLOC_FAILED: name = "CUSOLVER_STATUS_ALLOC_FAILED"; st = SKV_ERR_OUT_OF_MEMORY; break;
    case CUSOLVER_STATUS_INVALID_VALUE: name = "CUSOLVER_STATUS_INVALID_VALUE"; st = SKV_ERR_INVALID_ARGUMENT; break;
    case CUSOLVER_STATUS_ARCH_MISMATCH: name = "CUSOLVER_STATUS_ARCH_MISMATCH"; break;
    case CUSOLVER_STATUS_EXECUTION_FAILED: name = "CUSOLVER_STATUS_EXECUTION_FAILED"; break;
    case CUSOLVER_STATUS_INTERNAL_ERROR: name = "CUSOLVER_STATUS_INTERNAL_ERROR"; break;
    case CUSOLVER_STATUS_NOT_SUPPORTED: name = "CUSOLVER_STATUS_NOT_SUPPORTED"; st = SKV_ERR_UNSUPPORTED; break;
    case CUSOLVER_STATUS_INVALID_WORKSPACE: name = "CUSOLVER_STATUS_INVALID_WORKSPACE"; break;
    default: break;
    }
    if (msg && cap) snprintf(msg, cap, "cuda factorize: %s: %s (%d)", what, name, (int)e);
    return st;
}

/* Early-return checks for factorize (nothing to free there). */
#define SKV_CF_CHECK_CUDA(call, what)                                    \
    do {                                                                 \
        skv_status s_ = skv_cf_cuda((call), (what), msg, cap);           \
        if (s_ != SKV_OK) return s_;                                     \
    } while (0)
#define SKV_CF_CHECK_BLAS(call, what)                                    \
    do {                                                                 \
        skv_status s_ = skv_cf_blas((call), (what), msg, cap);           \
        if (s_ != SKV_OK) return s_;                                     \
    } while (0)
#define SKV_CF_CHECK_SOLVER(call, what)                                  \
    do {                                                                 \
        skv_status s_ = skv_cf_solver((call), (what), msg, cap);         \
        if (s_ != SKV_OK) return s_;                                     \
    } while (0)

/* ---- helper kernels (grid-stride, 64-bit indices) ------------------------------------ */

#define SKV_CF_THREADS 256
#define SKV_CF_MAX_BLOCKS 8192

static unsigned skv_cf_blocks(int64_t count)
{
    int64_t b = (count + SKV_CF_THREADS - 1) / SKV_CF_THREADS;
    return (unsigned)(b < SKV_CF_MAX_BLOCKS ? b : SKV_CF_MAX_BLOCKS);
}

/* y[i] = (float)x[i] (exact). */
static __global__ void skv_cf_bf16_to_f32(const skv_bf16 *__restrict__ x, float *__restrict__ y, int64_t count)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = skv_bf16_to_f32(x[i]);
}

/* gd[i] = (first ? 0 : gd[i]) + (double)g[i]: one block Gram into the double accumulator. */
static __global__ void skv_cf_gram_add(double *__restrict__ gd, const float *__restrict__ g, int64_t count, int first)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x)
        gd[i] = first ? (double)g[i] : gd[i] + (double)g[i];
}

/*
 * z: m x m column-major eigenvectors, ascending eigenvalues, so the q-th
 * largest is column m-1-q. Writes the top r as float:
 *   as_rows = 1: out [r, m] row-major, out[q*m + i] = z(i, m-1-q)   (W = V_r^T)
 *   as_rows = 0: out [m, r] row-major, out[i*r + q] = z(i, m-1-q)   (U = U_r)
 */
static __global__ void skv_cf_top_vectors(const double *__restrict__ z, int64_t m, int32_t r, int as_rows,
                                          float *__restrict__ out)
{
    int64_t count = m * r;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < count; e += (int64_t)gridDim.x * blockDim.x) {
        int64_t i, q;
        if (as_rows) {
            q = e / m;
            i = e - q * m;
        } else {
            i = e / r;
            q = e - i * r;
        }
        out[e] = (float)z[(m - 1 - q) * m + i];
    }
}

/* ---- create / destroy ------------------------------------------------------------------ */

extern "C" void skv_cuda_factor_destroy(skv_cuda_factor *f)
{
    if (!f) return;
    /* cudaFree synchronizes with outstanding work on the device. Errors are ignored: nothing to report to. */
    cudaFree(f->solver_ws);
    cudaFree(f->blas_ws);
    cudaFree(f->info);
    cudaFree(f->scratch);
    cudaFree(f->evals);
    cudaFree(f->gd);
    free(f->solver_host);
    if (f->params) cusolverDnDestroyParams(f->params);
    if (f->solver) cusolverDnDestroy(f->solver);
    if (f->blas) cublasDestroy(f->blas);
    free(f);
}

/* cudaMalloc into *p; a message naming the buffer on failure. */
static skv_status skv_cf_alloc(void **p, size_t bytes, const char *what, char *msg, size_t cap)
{
    cudaError_t e = cudaMalloc(p, bytes ? bytes : 1);
    if (e == cudaSuccess) return SKV_OK;
    *p = NULL;
    cudaGetLastError(); /* allocation failures are not sticky: clear the error state */
    if (msg && cap)
        snprintf(msg, cap, "cuda factorize: cudaMalloc of %zu bytes (%s): %s", bytes, what, cudaGetErrorString(e));
    return e == cudaErrorMemoryAllocation ? SKV_ERR_OUT_OF_MEMORY : SKV_ERR_NO_DEVICE;
}

/* A handle call failed at create: no usable device (or out of memory). */
static skv_status skv_cf_handle_status(skv_status st)
{
    return st == SKV_ERR_OUT_OF_MEMORY ? SKV_ERR_OUT_OF_MEMORY : SKV_ERR_NO_DEVICE;
}

extern "C" skv_status skv_cuda_factor_create(skv_cuda_factor **out, int64_t n_max, int32_t d, int32_t r,
                                             cudaStream_t st, char *msg, size_t cap)
{
    *out = NULL;
    if (n_max < 1 || n_max > SKV_CUDA_FACTOR_MAX_N || d < 1 || r < 1 || (int64_t)r > (n_max < d ? n_max : d)) {
        if (msg && cap)
            snprintf(msg, cap, "cuda factorize: workspace for n_max = %lld, d = %d, r = %d: need 1 <= n_max <= %lld, "
                               "d >= 1, 1 <= r <= min(n_max, d)",
                     (long long)n_max, (int)d, (int)r, (long long)SKV_CUDA_FACTOR_MAX_N);
        return SKV_ERR_INVALID_ARGUMENT;
    }
    skv_cf_sizes sz;
    if (!skv_cf_sizes_of(n_max, d, &sz)) {
        if (msg && cap)
            snprintf(msg, cap, "cuda factorize: workspace for n_max = %lld, d = %d overflows size_t", (long long)n_max,
                     (int)d);
        return SKV_ERR_OUT_OF_MEMORY;
    }
    skv_cuda_factor *f = (skv_cuda_factor *)calloc(1, sizeof *f);
    if (!f) {
        if (msg && cap) snprintf(msg, cap, "cuda factorize: host allocation of the factorization state failed");
        return SKV_ERR_OUT_OF_MEMORY;
    }
    f->st = st;
    f->n_max = n_max;
    f->m_max = sz.m_max;
    f->proj_rows = sz.proj_rows;
    f->d = d;
    f->r = r;
    f->scratch_floats = sz.scratch_floats;

    skv_status s = SKV_OK;
    size_t dev_bytes = 0, host_bytes = 0;

    /* handles */
    if ((s = skv_cf_blas(cublasCreate(&f->blas), "cublasCreate", msg, cap)) != SKV_OK) {
        f->blas = NULL;
        s = skv_cf_handle_status(s);
        goto fail;
    }
    if ((s = skv_cf_blas(cublasSetStream(f->blas, st), "cublasSetStream", msg, cap)) != SKV_OK) goto fail_handle;
    if ((s = skv_cf_solver(cusolverDnCreate(&f->solver), "cusolverDnCreate", msg, cap)) != SKV_OK) {
        f->solver = NULL;
        goto fail_handle;
    }
    if ((s = skv_cf_solver(cusolverDnSetStream(f->solver, st), "cusolverDnSetStream", msg, cap)) != SKV_OK)
        goto fail_handle;
    if ((s = skv_cf_solver(cusolverDnCreateParams(&f->params), "cusolverDnCreateParams", msg, cap)) != SKV_OK) {
        f->params = NULL;
        goto fail_handle;
    }

    /* device workspace */
    if ((s = skv_cf_alloc((void **)&f->gd, sz.gd_bytes, "Gram matrix, double", msg, cap)) != SKV_OK) goto fail;
    if ((s = skv_cf_alloc((void **)&f->evals, sz.evals_bytes, "eigenvalues", msg, cap)) != SKV_OK) goto fail;
    if ((s = skv_cf_alloc((void **)&f->scratch, sz.scratch_bytes, "fp32 scratch", msg, cap)) != SKV_OK) goto fail;
    if ((s = skv_cf_alloc((void **)&f->info, sizeof(int), "solver info", msg, cap)) != SKV_OK) goto fail;
    if ((s = skv_cf_alloc(&f->blas_ws, SKV_CF_BLAS_WS, "cuBLAS workspace", msg, cap)) != SKV_OK) goto fail;
    /* after cublasSetStream, which resets the workspace to cuBLAS's own pool */
    if ((s = skv_cf_blas(cublasSetWorkspace(f->blas, f->blas_ws, SKV_CF_BLAS_WS), "cublasSetWorkspace", msg, cap)) !=
        SKV_OK)
        goto fail_handle;

    /* cuSOLVER workspace for the largest eigenproblem: m_max x m_max */
    if ((s = skv_cf_solver(cusolverDnXsyevd_bufferSize(f->solver, f->params, CUSOLVER_EIG_MODE_VECTOR,
                                                       CUBLAS_FILL_MODE_UPPER, f->m_max, CUDA_R_64F, f->gd, f->m_max,
                                                       CUDA_R_64F, f->evals, CUDA_R_64F, &dev_bytes, &host_bytes),
                           "cusolverDnXsyevd_bufferSize", msg, cap)) != SKV_OK)
        goto fail_handle;
    f->solver_ws_bytes = dev_bytes;
    f->solver_host_bytes = host_bytes;
    if ((s = skv_cf_alloc(&f->solver_ws, dev_bytes, "cuSOLVER workspace", msg, cap)) != SKV_OK) goto fail;
    if (host_bytes) {
        f->solver_host = malloc(host_bytes);
        if (!f->solver_host) {
            if (msg && cap)
                snprintf(msg, cap, "cuda factorize: host allocation of %zu bytes (cuSOLVER host workspace) failed",
                         host_bytes);
            s = SKV_ERR_OUT_OF_MEMORY;
            goto fail;
        }
    }
    *out = f;
    return SKV_OK;

fail_handle:
    s = skv_cf_handle_status(s);
fail:
    skv_cuda_factor_destroy(f);
    return s;
}

/* ---- factorize ------------------------------------------------------------------------- */

static cudaError_t skv_cf_convert(cudaStream_t st, const skv_bf16 *x, float *y, int64_t count)
{
    skv_cf_bf16_to_f32<<<skv_cf_blocks(count), SKV_CF_THREADS, 0, st>>>(x, y, count);
    return cudaGetLastError();
}

/*
 * G (m x m, double, in f->gd) = A^T A (n >= d, m = d) or A A^T (n < d, m = n),
 * summed in double over fp32 block Grams of SKV_CF_GRAM_ROWS rows (resp. columns) of A.
 */
static skv_status skv_cf_gram(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, char *msg, size_t cap)
{
    const int64_t d = f->d, m = n < d ? n : d, len = n < d ? d : n; /* len: the summed dimension */
    const float one = 1.0f, zero = 0.0f;
    for (int64_t k0 = 0; k0 < len; k0 += SKV_CF_GRAM_ROWS) {
        int64_t kb = len - k0 < SKV_CF_GRAM_ROWS ? len - k0 : SKV_CF_GRAM_ROWS;
        if (n >= d) {
            /* rows k0..k0+kb of A: column-major Mb [d, kb] (ld d); G += Mb Mb^T */
            const skv_bf16 *mb = a + (size_t)k0 * d;
            SKV_CF_CHECK_BLAS(cublasGemmEx_64(f->blas, CUBLAS_OP_N, CUBLAS_OP_T, d, d, kb, &one, mb, CUDA_R_16BF, d, mb,
                                              CUDA_R_16BF, d, &zero, f->scratch, CUDA_R_32F, d, CUBLAS_COMPUTE_32F,
                                              CUBLAS_GEMM_DEFAULT),
                              "cublasGemmEx (bf16 Gram block A^T A)");
        } else {
            /* columns k0..k0+kb of A: column-major Mb [kb, n] (ld d); G += Mb^T Mb */
            const skv_bf16 *mb = a + k0;
            SKV_CF_CHECK_BLAS(cublasGemmEx_64(f->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, n, kb, &one, mb, CUDA_R_16BF, d, mb,
                                              CUDA_R_16BF, d, &zero, f->scratch, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                                              CUBLAS_GEMM_DEFAULT),
                              "cublasGemmEx (bf16 Gram block A A^T)");
        }
        skv_cf_gram_add<<<skv_cf_blocks(m * m), SKV_CF_THREADS, 0, f->st>>>(f->gd, f->scratch, m * m, k0 == 0);
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "Gram accumulation kernel");
    }
    return SKV_OK;
}

extern "C" skv_status skv_cuda_factorize(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, float *u, float *w,
                                         char *msg, size_t cap)
{
    const int64_t d = f->d, r = f->r;
    if (n < 1 || n > f->n_max || n > SKV_CUDA_FACTOR_MAX_N || r > (n < d ? n : d)) {
        if (msg && cap)
            snprintf(msg, cap, "cuda factorize: n = %lld with d = %lld, r = %lld: need r <= min(n, d) and "
                               "1 <= n <= %lld (workspace n_max; supported maximum %lld)",
                     (long long)n, (long long)d, (long long)r, (long long)f->n_max, (long long)SKV_CUDA_FACTOR_MAX_N);
        return SKV_ERR_INVALID_ARGUMENT;
    }
    const int64_t m = n < d ? n : d;
    const float one = 1.0f, zero = 0.0f;
    skv_status s;

    /* 1. Gram matrix in double */
    if ((s = skv_cf_gram(f, n, a, msg, cap)) != SKV_OK) return s;

    /* 2. all eigenpairs of the m x m Gram (ascending); gd is overwritten by the eigenvectors */
    size_t dev_bytes = 0, host_bytes = 0;
    SKV_CF_CHECK_SOLVER(cusolverDnXsyevd_bufferSize(f->solver, f->params, CUSOLVER_EIG_MODE_VECTOR,
                                                    CUBLAS_FILL_MODE_UPPER, m, CUDA_R_64F, f->gd, m, CUDA_R_64F,
                                                    f->evals, CUDA_R_64F, &dev_bytes, &host_bytes),
                        "cusolverDnXsyevd_bufferSize");
    if (dev_bytes > f->solver_ws_bytes || host_bytes > f->solver_host_bytes) {
        if (msg && cap)
            snprintf(msg, cap, "cuda factorize: cusolverDnXsyevd for m = %lld needs %zu device + %zu host bytes, "
                               "the workspace (sized for m = %lld) has %zu + %zu",
                     (long long)m, dev_bytes, host_bytes, (long long)f->m_max, f->solver_ws_bytes,
                     f->solver_host_bytes);
        return SKV_ERR_OUT_OF_MEMORY;
    }
    SKV_CF_CHECK_SOLVER(cusolverDnXsyevd(f->solver, f->params, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_UPPER, m,
                                         CUDA_R_64F, f->gd, m, CUDA_R_64F, f->evals, CUDA_R_64F, f->solver_ws,
                                         f->solver_ws_bytes, f->solver_host, f->solver_host_bytes, f->info),
                        "cusolverDnXsyevd");

    if (n >= d) {
        /* 3. W = V_r^T (float); as column-major [d, r] (ld d) it is V_r for the projection */
        skv_cf_top_vectors<<<skv_cf_blocks(m * r), SKV_CF_THREADS, 0, f->st>>>(f->gd, m, (int32_t)r, 1, w);
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "top eigenvector kernel (W)");
        /* 4. U = A V_r in fp32, per row block: U_b^T [r, rows] = V_r^T [r, d] * A_b^T [d, rows] */
        for (int64_t t0 = 0; t0 < n; t0 += f->proj_rows) {
            int64_t rows = n - t0 < f->proj_rows ? n - t0 : f->proj_rows;
            SKV_CF_CHECK_CUDA(skv_cf_convert(f->st, a + (size_t)t0 * d, f->scratch, rows * d),
                              "bf16 -> float kernel (projection block)");
            SKV_CF_CHECK_BLAS(cublasGemmEx_64(f->blas, CUBLAS_OP_T, CUBLAS_OP_N, r, rows, d, &one, w, CUDA_R_32F, d,
                                              f->scratch, CUDA_R_32F, d, &zero, u + (size_t)t0 * r, CUDA_R_32F, r,
                                              CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
                              "cublasGemmEx (fp32 projection U = A V_r)");
        }
    } else {
        /* 3. U = U_r (float), the top eigenvectors of A A^T */
        skv_cf_top_vectors<<<skv_cf_blocks(m * r), SKV_CF_THREADS, 0, f->st>>>(f->gd, m, (int32_t)r, 0, u);
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "top eigenvector kernel (U)");
        /* 4. W = U^T A in fp32, summed over row blocks: W^T [d, r] += A_b^T [d, rows] * U_b [rows, r] */
        for (int64_t t0 = 0; t0 < n; t0 += f->proj_rows) {
            int64_t rows = n - t0 < f->proj_rows ? n - t0 : f->proj_rows;
            const float beta = t0 == 0 ? zero : one;
            SKV_CF_CHECK_CUDA(skv_cf_convert(f->st, a + (size_t)t0 * d, f->scratch, rows * d),
                              "bf16 -> float kernel (projection block)");
            SKV_CF_CHECK_BLAS(cublasGemmEx_64(f->blas, CUBLAS_OP_N, CUBLAS_OP_T, d, r, rows, &one, f->scratch,
                                              CUDA_R_32F, d, u + (size_t)t0 * r, CUDA_R_32F, r, &beta, w, CUDA_R_32F, d,
                                              CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
                              "cublasGemmEx (fp32 projection W = U^T A)");
        }
    }

    /* the solver's verdict (and any asynchronous error of the work above) */
    int info = 0;
    SKV_CF_CHECK_CUDA(cudaMemcpyAsync(&info, f->info, sizeof info, cudaMemcpyDeviceToHost, f->st),
                      "cudaMemcpyAsync (solver info)");
    SKV_CF_CHECK_CUDA(cudaStreamSynchronize(f->st), "cudaStreamSynchronize");
    if (info != 0) {
        if (msg && cap)
            snprintf(msg, cap, "cuda factorize: cusolverDnXsyevd (m = %lld) returned info = %d (%s)", (long long)m, info,
                     info > 0 ? "the eigensolver did not converge" : "invalid argument");
        return SKV_ERR_NUMERICAL;
    }
    return SKV_OK;
}
