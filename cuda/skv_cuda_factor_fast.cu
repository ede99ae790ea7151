/*
 * skv_cuda_factor_fast.cu - the FAST factorization route (skv_cf_fast; skv_cuda_factorize picks it for
 * n >= d, 2r <= d, r <= 160: every real prompt), steps 2-4 of skv_cuda_factor.cuh after the blocked
 * Gram (skv_cuda_factor_gram.cu): the subspace iteration (cuBLAS DGEMMs, the shifted Cholesky and
 * solve of skv_cuda_chol.cuh: skv_cf_chol, skv_cf_solve_lt), the check (skv_cf_check), the fallback
 * double Gram (skv_cf_gram64, skv_cf_gram64_sum), the start (skv_cf_init_x) and the finish
 * (skv_cf_finish, U = A Q). Also the opt-in shared memory of its Cholesky kernels (skv_cf_fast_smem,
 * at create).
 */
#include "skv_cuda_factor.cuh"
#include "skv_cuda_chol.cuh"

static_assert(SKV_CF_SOLVE_BLOCK_WARPS <= SKV_CF_SOLVE_WARPS, "the solve's launch bound");
static_assert(SKV_CF_MAXT <= 32, "skv_cf_check sums one partial per lane of one warp");

/* ---- FAST route kernels ------------------------------------------------------------------ */

/* x [d, r] column-major = the fixed start X_0. */
static __global__ void skv_cf_init_x(double *__restrict__ x, int32_t d, int32_t r)
{
    int64_t count = (int64_t)d * r;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < count; e += (int64_t)gridDim.x * blockDim.x)
        x[e] = skv_factor_start(e % d, e / d, r);
}

/* ---- the shifted Cholesky of the FAST route (cuda/skv_cuda_chol.cuh) ------------------------ */

/*
 * The check (lib/skv_factor.h step 4): fro2 = ||L||_F^2 = ||R||_F^2 from skv_cf_chol with
 * H + s_H I = R^T R; sq[0 .. nsq) the solve's per-warp sums of squares of R^-1 (nsq <= 32).
 * rho = 1 / (||R||_F^2 ||R^-1||_F^2), summed in a fixed order; sets state->fallback. One warp.
 */
static __global__ void __launch_bounds__(32) skv_cf_check(const double *__restrict__ fro2,
                                                          const double *__restrict__ sq, int nsq, int mode,
                                                          skv_cf_state *state)
{
    double b = (int)threadIdx.x < nsq ? sq[threadIdx.x] : 0.0;
    b = warp_sum(b);
    if (threadIdx.x == 0) {
        double rho = 1.0 / (*fro2 * b);
        int fb = mode == SKV_FACTORIZE_FALLBACK || (mode == SKV_FACTORIZE_AUTO && !(rho >= SKV_FACTOR_TAU));
        state->fallback = fb;
    }
}

/*
 * Fallback Gram, partial sums: part[s] (d x d column-major, upper tiles only)
 * = sum over rows [n s / S, n (s+1) / S) of a_i a_i^T, every product and sum in
 * double. Grid (upper 64 x 64 tiles, S). Returns at once unless state->fallback.
 * Thread (tx, ty) owns rows ty + 16 i and columns tx + 16 j of its tile
 * (conflict-free shared loads).
 */
static __global__ void __launch_bounds__(256) skv_cf_gram64(const skv_bf16 *__restrict__ a, int64_t n, int32_t d,
                                                             double *__restrict__ part,
                                                             const skv_cf_state *__restrict__ state)
{
    if (!state->fallback) return;
    const int nt = (d + SKV_CF_TILE - 1) / SKV_CF_TILE;
    int t = blockIdx.x, ti = 0;
    while (t >= nt - ti) t -= nt - ti, ti++;
    const int tj = ti + t;
    const int64_t r0 = n * blockIdx.y / SKV_CF_SPLITS, r1 = n * (blockIdx.y + 1) / SKV_CF_SPLITS;
    __shared__ double sa[16][SKV_CF_TILE], sb[16][SKV_CF_TILE];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    double acc[4][4] = {};
    for (int64_t k0 = r0; k0 < r1; k0 += 16) {
        for (int e = threadIdx.x; e < 16 * SKV_CF_TILE; e += 256) {
            int kr = e / SKV_CF_TILE, cc = e % SKV_CF_TILE, ca = ti * SKV_CF_TILE + cc, cb = tj * SKV_CF_TILE + cc;
            int64_t row = k0 + kr;
            const skv_bf16 *ar = a + (size_t)row * d;
            sa[kr][cc] = row < r1 && ca < d ? (double)skv_bf16_to_f32(ar[ca]) : 0.0;
            sb[kr][cc] = row < r1 && cb < d ? (double)skv_bf16_to_f32(ar[cb]) : 0.0;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 16; k++) {
            double av[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; i++) av[i] = sa[k][ty + 16 * i], bv[i] = sb[k][tx + 16 * i];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fma(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
    double *p = part + (size_t)blockIdx.y * d * d;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            int row = ti * SKV_CF_TILE + ty + 16 * i, col = tj * SKV_CF_TILE + tx + 16 * j;
            if (row < d && col < d) p[(size_t)col * d + row] = acc[i][j];
        }
}

/* g (d x d, both triangles) = sum of the S partials in order. Returns at once unless state->fallback. */
static __global__ void skv_cf_gram64_sum(double *__restrict__ g, const double *__restrict__ part, int32_t d,
                                         const skv_cf_state *__restrict__ state)
{
    if (!state->fallback) return;
    int64_t count = (int64_t)d * d;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < count; e += (int64_t)gridDim.x * blockDim.x) {
        int64_t i = e % d, j = e / d;
        if (i > j) continue;
        double v = 0.0;
        for (int s = 0; s < SKV_CF_SPLITS; s++) v += part[(size_t)s * count + e];
        g[e] = v;
        g[i * d + j] = v;
    }
}

/* w = (float)q; qs = the SKV_CF_QTERMS-term bf16 split of q (planes of d*r: hi, mid). */
static __global__ void skv_cf_finish(const double *__restrict__ q, float *__restrict__ w, skv_bf16 *__restrict__ qs,
                                     int64_t count)
{
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < count; e += (int64_t)gridDim.x * blockDim.x) {
        double v = q[e];
        w[e] = (float)v;
#pragma unroll
        for (int k = 0; k < SKV_CF_QTERMS; k++) {
            const skv_bf16 t = skv_f32_to_bf16((float)v);
            qs[(size_t)k * count + e] = t;
            v -= (double)skv_bf16_to_f32(t);
        }
    }
}

size_t skv_cf_fast_lt_bytes(int32_t r)
{
    return (SKV_CF_LT_DOUBLES((r + 7) / 8) + 1 + (size_t)r + (size_t)(r + 7) / 8) * sizeof(double);
}

cudaError_t skv_cf_fast_smem(int32_t r)
{
    /* both kernels keep the tiled factor in shared memory (~115 KiB at r = 160) */
    cudaError_t e = cudaFuncSetAttribute(skv_cf_chol, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)skv_cf_chol_smem(r));
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(skv_cf_solve_lt, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)skv_cf_solve_smem(r));
    return e;
}

/* f->lt <- L (tiled) with c + s I = L L^T, the shift as skv_cf_chol documents (check: H's). */
static skv_status skv_cf_factor(skv_cuda_factor *f, int check, int scaled, int *info, char *msg, size_t cap)
{
    skv_cf_chol<<<1, SKV_CF_CHOL_THREADS, skv_cf_chol_smem(f->r), f->st>>>(f->c, f->r, f->d, check, scaled, f->gd,
                                                                           f->lt, info);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "Cholesky kernel");
    return SKV_OK;
}

/* v [m, r] (ld) <- v R^-1 = v L^-T with L in f->lt (mode: skv_cf_solve_lt's; sq: its per-warp sums). */
static skv_status skv_cf_solve(skv_cuda_factor *f, double *v, int m, int ld, int mode, double *sq, char *msg,
                               size_t cap)
{
    const unsigned blocks = (unsigned)((m + 8 * SKV_CF_SOLVE_BLOCK_WARPS - 1) / (8 * SKV_CF_SOLVE_BLOCK_WARPS));
    skv_cf_solve_lt<<<blocks, 32 * SKV_CF_SOLVE_BLOCK_WARPS, skv_cf_solve_smem(f->r), f->st>>>(v, m, ld, f->r, f->lt,
                                                                                               mode, sq);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "triangular solve kernel");
    return SKV_OK;
}

/* orth(v) in place (lib/skv_factor.h): C = v^T v, R = chol(C + sI) (info -> *info), v = v R^-1;
   scaled: orth_e(v) = v D R^-1 with D C D + s I = R^T R. */
static skv_status skv_cf_orth(skv_cuda_factor *f, double *v, int scaled, int *info, char *msg, size_t cap)
{
    const int64_t d = f->d, r = f->r;
    const double one = 1.0, zero = 0.0;
    skv_status s;
    /* DGEMM, not DSYRK: cuBLAS's DSYRK of this shape takes ~50 us, the GEMM ~6 */
    SKV_CF_CHECK_BLAS(cublasDgemm(f->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)r, (int)r, (int)d, &one, v, (int)d, v, (int)d,
                                  &zero, f->c, (int)r),
                      "cublasDgemm (Y^T Y)");
    if ((s = skv_cf_factor(f, 0, scaled, info, msg, cap)) != SKV_OK) return s;
    return skv_cf_solve(f, v, (int)d, (int)d, scaled ? SKV_CF_SOLVE_SCALED : SKV_CF_SOLVE_PLAIN, NULL, msg, cap);
}

/* y = G x (d x r, double). */
static skv_status skv_cf_apply(skv_cuda_factor *f, const double *x, double *y, char *msg, size_t cap)
{
    const int d = f->d, r = f->r;
    const double one = 1.0, zero = 0.0;
    SKV_CF_CHECK_BLAS(cublasDgemm(f->blas, CUBLAS_OP_N, CUBLAS_OP_N, d, r, d, &one, f->gd, d, x, d, &zero, y, d),
                      "cublasDgemm (G X)");
    return SKV_OK;
}

/* The check of step 4: H = x^T G x + s_H I = L L^T (in c), z = R^-1 = L^-T (in y, as r x r), rho. */
static skv_status skv_cf_check_rho(skv_cuda_factor *f, const double *x, double *y, int mode, int *info, char *msg,
                                   size_t cap)
{
    const int d = f->d, r = f->r;
    const double one = 1.0, zero = 0.0;
    skv_status s;
    if ((s = skv_cf_apply(f, x, y, msg, cap)) != SKV_OK) return s;
    SKV_CF_CHECK_BLAS(cublasDgemm(f->blas, CUBLAS_OP_T, CUBLAS_OP_N, r, r, d, &one, x, d, y, d, &zero, f->c, r),
                      "cublasDgemm (X^T G X, check)");
    if ((s = skv_cf_factor(f, 1, 0, info, msg, cap)) != SKV_OK) return s;
    /* R^-1 into y (r x r) and its per-warp sums of squares after lt's D */
    const int nt = (r + 7) / 8;
    double *sq = f->lt + SKV_CF_LT_DOUBLES(nt) + 1 + r;
    if ((s = skv_cf_solve(f, y, r, r, SKV_CF_SOLVE_IDENTITY, sq, msg, cap)) != SKV_OK) return s;
    skv_cf_check<<<1, 32, 0, f->st>>>(f->lt + SKV_CF_LT_DOUBLES(nt), sq, nt, mode, f->state);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "fallback check kernel");
    return SKV_OK;
}

/* The FAST route (see skv_cuda_factor.cuh); solver infos go to f->info[0 .. SKV_CF_NINFO). */
skv_status skv_cf_fast(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, float *u, float *w,
                              skv_factorize_route mode, char *msg, size_t cap)
{
    const int64_t d = f->d, r = f->r;
    const float one = 1.0f, zero = 0.0f;
    skv_status s;
    int ninfo = 0;
    if ((s = skv_cf_gram(f, n, a, msg, cap)) != SKV_OK) return s;
    skv_cf_init_x<<<skv_cf_blocks(d * r), SKV_CF_THREADS, 0, f->st>>>(f->x, (int32_t)d, (int32_t)r);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "start kernel");
    double *x = f->x, *y = f->y;
    for (int it = 1; it <= SKV_FACTOR_ITERS; it++) {
        if ((s = skv_cf_apply(f, x, y, msg, cap)) != SKV_OK) return s;
        if (it <= SKV_FACTOR_TWO_PASS_ITERS) {
            if ((s = skv_cf_orth(f, y, 0, f->info + ninfo++, msg, cap)) != SKV_OK) return s;
            if ((s = skv_cf_orth(f, y, 0, f->info + ninfo++, msg, cap)) != SKV_OK) return s;
        } else if ((s = skv_cf_orth(f, y, 1, f->info + ninfo++, msg, cap)) != SKV_OK) {
            return s;
        }
        double *t = x;
        x = y, y = t;
        if (it == SKV_FACTOR_CHECK_AT) { /* X is orthonormal after a two-pass iteration */
            /* its own info slot, the last, not counted as a failure: an indefinite H falls back */
            if ((s = skv_cf_check_rho(f, x, y, (int)mode, f->info + SKV_CF_NINFO - 1, msg, cap)) != SKV_OK) return s;
            /* the fallback Gram: both kernels return at once unless the check set the flag */
            int nt = (int)((d + SKV_CF_TILE - 1) / SKV_CF_TILE);
            dim3 grid((unsigned)(nt * (nt + 1) / 2), SKV_CF_SPLITS);
            skv_cf_gram64<<<grid, 256, 0, f->st>>>(a, n, (int32_t)d, (double *)f->scratch, f->state);
            SKV_CF_CHECK_CUDA(cudaGetLastError(), "fallback Gram kernel");
            skv_cf_gram64_sum<<<2 * num_sms(), SKV_CF_THREADS, 0, f->st>>>(f->gd, (const double *)f->scratch,
                                                                                   (int32_t)d, f->state);
            SKV_CF_CHECK_CUDA(cudaGetLastError(), "fallback Gram sum kernel");
        }
    }
    if ((s = skv_cf_orth(f, x, 0, f->info + ninfo++, msg, cap)) != SKV_OK) return s;
    if ((s = skv_cf_orth(f, x, 0, f->info + ninfo++, msg, cap)) != SKV_OK) return s;
    skv_cf_finish<<<skv_cf_blocks(d * r), SKV_CF_THREADS, 0, f->st>>>(x, w, f->qs, d * r);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "finish kernel");
    /* U^T [r, n] = sum over the split (smallest first) of Q_k^T [r, d] * A^T [d, n] */
    for (int k = SKV_CF_QTERMS - 1; k >= 0; k--) {
        const float beta = k == SKV_CF_QTERMS - 1 ? zero : one;
        SKV_CF_CHECK_BLAS(cublasGemmEx_64(f->blas, CUBLAS_OP_T, CUBLAS_OP_N, r, n, d, &one, f->qs + (size_t)k * d * r,
                                          CUDA_R_16BF, d, a, CUDA_R_16BF, d, &beta, u, CUDA_R_32F, r,
                                          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                          "cublasGemmEx (bf16-split projection U = A Q)");
    }
    return SKV_OK;
}
