/*
 * skv_cuda_factor_gram.cu - step 1 of the FAST and EXACT factorization routes (skv_cf_gram, called by
 * skv_cf_fast and skv_cf_exact; skv_cuda_factor.cuh): G = A^T A (or A A^T) in double, A in blocks of
 * SKV_CF_GRAM_ROWS rows (columns), each block's Gram one bf16 tensor-core GEMM with fp32 accumulation
 * (a batch of blocks per strided batched GEMM), the block Grams summed in double in a fixed order
 * (skv_cf_gram_sum, skv_cf_gram_add).
 */
#include "skv_cuda_factor.cuh"

/* gd[i] = (first ? 0 : gd[i]) + sum over b < nb of (double)g[b * count + i], in order. */
static __global__ void skv_cf_gram_sum(double *__restrict__ gd, const float *__restrict__ g, int64_t count, int nb,
                                       int first)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x) {
        double v = first ? 0.0 : gd[i];
        for (int b = 0; b < nb; b++) v += (double)g[(size_t)b * count + i];
        gd[i] = v;
    }
}

/* gd[i] = (first ? 0 : gd[i]) + (double)g[i]: one block Gram into the double accumulator. */
static __global__ void skv_cf_gram_add(double *__restrict__ gd, const float *__restrict__ g, int64_t count, int first)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x)
        gd[i] = first ? (double)g[i] : gd[i] + (double)g[i];
}

/*
 * G (m x m, double, in f->gd) = A^T A (n >= d, m = d) or A A^T (n < d, m = n),
 * summed in double over fp32 block Grams of SKV_CF_GRAM_ROWS rows (resp. columns) of A.
 */
skv_status skv_cf_gram(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, char *msg, size_t cap)
{
    const int64_t d = f->d, m = n < d ? n : d, len = n < d ? d : n; /* len: the summed dimension */
    const float one = 1.0f, zero = 0.0f;
    if (n >= d) {
        /* groups of gram_batch blocks: one strided batched GEMM (rows k0 + b*R .. of A, column-major
           Mb [d, R], G_b = Mb Mb^T) for the full blocks, one GEMM for a short last block, one sum */
        const int64_t R = SKV_CF_GRAM_ROWS, nblk = (n + R - 1) / R;
        for (int64_t b0 = 0; b0 < nblk; b0 += f->gram_batch) {
            int64_t nb = nblk - b0 < f->gram_batch ? nblk - b0 : f->gram_batch;
            int64_t last_rows = n - (b0 + nb - 1) * R, nfull = last_rows == R ? nb : nb - 1;
            const skv_bf16 *mb = a + (size_t)b0 * R * d;
            if (nfull > 0)
                SKV_CF_CHECK_BLAS(cublasGemmStridedBatchedEx_64(f->blas, CUBLAS_OP_N, CUBLAS_OP_T, d, d, R, &one, mb,
                                                                CUDA_R_16BF, d, R * d, mb, CUDA_R_16BF, d, R * d, &zero,
                                                                f->scratch, CUDA_R_32F, d, d * d, nfull,
                                                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                                  "cublasGemmStridedBatchedEx (bf16 Gram blocks A^T A)");
            if (nfull < nb) {
                const skv_bf16 *ml = mb + (size_t)nfull * R * d;
                SKV_CF_CHECK_BLAS(cublasGemmEx_64(f->blas, CUBLAS_OP_N, CUBLAS_OP_T, d, d, last_rows, &one, ml,
                                                  CUDA_R_16BF, d, ml, CUDA_R_16BF, d, &zero, f->scratch + (size_t)nfull * d * d,
                                                  CUDA_R_32F, d, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                                  "cublasGemmEx (bf16 Gram block A^T A)");
            }
            skv_cf_gram_sum<<<skv_cf_blocks(d * d), SKV_CF_THREADS, 0, f->st>>>(f->gd, f->scratch, d * d, (int)nb,
                                                                                 b0 == 0);
            SKV_CF_CHECK_CUDA(cudaGetLastError(), "Gram sum kernel");
        }
        return SKV_OK;
    }
    for (int64_t k0 = 0; k0 < len; k0 += SKV_CF_GRAM_ROWS) {
        int64_t kb = len - k0 < SKV_CF_GRAM_ROWS ? len - k0 : SKV_CF_GRAM_ROWS;
        /* columns k0..k0+kb of A: column-major Mb [kb, n] (ld d); G += Mb^T Mb */
        const skv_bf16 *mb = a + k0;
        SKV_CF_CHECK_BLAS(cublasGemmEx_64(f->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, n, kb, &one, mb, CUDA_R_16BF, d, mb,
                                          CUDA_R_16BF, d, &zero, f->scratch, CUDA_R_32F, n, CUBLAS_COMPUTE_32F,
                                          CUBLAS_GEMM_DEFAULT),
                          "cublasGemmEx (bf16 Gram block A A^T)");
        skv_cf_gram_add<<<skv_cf_blocks(m * m), SKV_CF_THREADS, 0, f->st>>>(f->gd, f->scratch, m * m, k0 == 0);
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "Gram accumulation kernel");
    }
    return SKV_OK;
}
