/*
 * skv_cuda_factor_exact.cu - the EXACT factorization route (skv_cf_exact; skv_cuda_factorize picks it for
 * n < d, 2r > d, r > 160 or the exact route asked for): the blocked Gram (skv_cuda_factor_gram.cu),
 * cusolverDnXsyevd in double (all eigenpairs), the top vectors (skv_cf_top_vectors), U = A V_r in true
 * fp32 over row blocks converted to float (skv_cf_bf16_to_f32); n < d: U = the top eigenvectors,
 * W = U^T A. Synchronizes with the host inside Xsyevd.
 */
#include "skv_cuda_factor.cuh"

/* y[i] = (float)x[i] (exact). */
static __global__ void skv_cf_bf16_to_f32(const skv_bf16 *__restrict__ x, float *__restrict__ y, int64_t count)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = skv_bf16_to_f32(x[i]);
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

static cudaError_t skv_cf_convert(cudaStream_t st, const skv_bf16 *x, float *y, int64_t count)
{
    skv_cf_bf16_to_f32<<<skv_cf_blocks(count), SKV_CF_THREADS, 0, st>>>(x, y, count);
    return cudaGetLastError();
}

/* The EXACT route (see skv_cuda_factor.cuh); the solver's info goes to f->info[0]. */
skv_status skv_cf_exact(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, float *u, float *w, char *msg,
                               size_t cap)
{
    const int64_t d = f->d, r = f->r, m = n < d ? n : d;
    const float one = 1.0f, zero = 0.0f;
    skv_status s;
    if ((s = skv_cf_gram(f, n, a, msg, cap)) != SKV_OK) return s;
    /* all eigenpairs of the m x m Gram (ascending); gd is overwritten by the eigenvectors */
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
        /* W = V_r^T (float); as column-major [d, r] (ld d) it is V_r for the projection */
        skv_cf_top_vectors<<<skv_cf_blocks(m * r), SKV_CF_THREADS, 0, f->st>>>(f->gd, m, (int32_t)r, 1, w);
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "top eigenvector kernel (W)");
        /* U = A V_r in fp32, per row block: U_b^T [r, rows] = V_r^T [r, d] * A_b^T [d, rows] */
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
        /* U = U_r (float), the top eigenvectors of A A^T */
        skv_cf_top_vectors<<<skv_cf_blocks(m * r), SKV_CF_THREADS, 0, f->st>>>(f->gd, m, (int32_t)r, 0, u);
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "top eigenvector kernel (U)");
        /* W = U^T A in fp32, summed over row blocks: W^T [d, r] += A_b^T [d, rows] * U_b [rows, r] */
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
    return SKV_OK;
}
