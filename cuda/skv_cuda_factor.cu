/*
 * skv_cuda_factor.cu - the rank-r factorization of the cuda backend (cuBLAS +
 * cuSOLVER + a few kernels). Routes as in lib/skv_factor.h, the same math as
 * the cpu backend's FAST route:
 *
 * FAST (n >= d, 2r <= d, r <= 160: every real prompt), all on the factor's
 * stream with no host synchronization (cusolverDnXsyevd is avoided: its
 * divide and conquer synchronizes with the host, which put the whole
 * eigensolve on the caller's thread):
 *   1. G = A^T A in double: A in blocks of SKV_CF_GRAM_ROWS rows, each block's
 *      Gram one bf16 tensor-core GEMM with fp32 accumulation and output (bf16
 *      products are exact in fp32), a batch of blocks per strided batched
 *      GEMM, the block Grams summed in double in a fixed order.
 *   2. X_0 = skv_factor_start; SKV_FACTOR_ITERS times X <- orth(orth(G X))
 *      (orth_e(G X), one equilibrated pass, after SKV_FACTOR_TWO_PASS_ITERS):
 *      DGEMMs (G X, Y^T Y), then the project's own kernels for the r x r
 *      Cholesky and solve (cuSOLVER's potrf was latency-bound at ~175 us per
 *      call, most of the route's time): skv_cf_chol (shift, floored Cholesky,
 *      one block) and skv_cf_solve_lt (Y R^-1), on the fp64 tensor cores
 *      (cuda/skv_cuda_chol.cuh).
 *   3. After iteration SKV_FACTOR_CHECK_AT (X orthonormal): H = X^T (G + delta I)
 *      X + s_H I = R^T R, R^-1 (the solve on I, which also sums its squares per
 *      warp), and skv_cf_check decides on the device
 *      whether the double Gram is needed. The fallback kernels always launch
 *      and return at once unless the flag is set: the fallback Gram sums every
 *      product in double (SKV_CF_SPLITS row ranges per 64 x 64 tile, added in
 *      a fixed order, so results stay deterministic) and overwrites G.
 *   4. Q = orth(orth(X)); W = Q^T in float (row-major W [r, d] is column-major
 *      Q [d, r], the same memory); U = A Q as SKV_CF_QTERMS bf16 GEMMs against
 *      the bf16 split of Q (hi + mid represents each element to ~2^-17), fp32
 *      accumulation. U's error dU adds in quadrature to the factorization's:
 *      A - A Q Q^T is orthogonal to dU Q^T (its product with Q vanishes), so
 *      at the benchmark keys' 0.9% error a ~2^-17 dU changes it by ~4e-7 of
 *      itself (a third term, Q to ~2^-24, cost one more pass over A: 52 us
 *      at 64k rows on the H200).
 *   The floored Cholesky cannot fail; a pivot that is not finite (an
 *   overflow) is counted on the device with the caller's tag (the check's
 *   own Cholesky excepted: floored pivots there mean an indefinite H, and
 *   send the call to the double Gram).
 *
 * EXACT (n < d, 2r > d, r > 160, or the exact route chosen): the same blocked
 * Gram (A A^T when n < d), cusolverDnXsyevd in double (all eigenpairs),
 * W = V_r^T, U = A V_r in true fp32 (PEDANTIC) over row blocks converted to
 * float; n < d: U = the top eigenvectors, W = U^T A. This route synchronizes
 * with the host inside Xsyevd.
 *
 * CANONICAL (the reproducible mode's route, lib/skv_factor_canon.h): in
 * skv_cuda_canon.cuh, bit for bit ref's; no host synchronization. Its buffers
 * (cc_*, below the FAST ones in the struct) are allocated at create for every
 * shape, its token blocks (int8 digit planes of A and their int32 products for
 * the exact Gram, skv_cuda_canon_i8.h; fixed-point A and T for U) live in scratch.
 * The planes and the fixed-point A are double-buffered within the scratch's
 * size (which this does not change): two plane buffers of half the rows one
 * would hold (one buffer where two of 128 rows do not fit); two U blocks of
 * canon_rows rows where they fit beside T (at d = 1024, r = 160: n_max <= 2048
 * or >= 32768, where the FAST route's batched Grams make the scratch 128 MiB),
 * else of fewer (3799 rows between). The memory-bound kernel writing block
 * k + 1 runs on the factor's second stream (cc_side, non-blocking, created
 * here with its events) while block k's GEMMs run on st, with event fork /
 * join and no host synchronization; the call is ordered on st at entry and
 * exit.
 *
 * cuBLAS column-major view: row-major X [p, q] is column-major X^T [q, p] with
 * leading dimension q. So A is column-major M = A^T [d, n] (ld d), U is
 * column-major U^T [r, n] (ld r), W is column-major W^T = V_r [d, r] (ld d).
 *
 * Workspace (all allocated at create for n_max rows; nothing grows with n
 * beyond min(n_max, d), since both passes over A are blocked):
 *   gd      double [m_max^2]   Gram accumulator (EXACT: then the eigenvectors)
 *   evals   double [m_max]     eigenvalues (EXACT)
 *   scratch                    a block's fp32 Gram; EXACT: a block of A in
 *                              float; FAST: the fallback's partial sums;
 *                              CANONICAL: the int8 Gram's products and (two
 *                              buffers of) digit planes, then two fixed-point
 *                              A blocks and a T block
 *   x, y    double [d, r]      the iterate and G X (FAST)
 *   c       double [r, r]      Y^T Y (FAST)
 *   lt      double [~r^2 / 2]  its Cholesky factor in 8 x 8 tiles (FAST)
 *   qs      bf16 [2, d, r]     the split of Q (FAST)
 *   infos   int [SKV_CF_NINFO] solver / Cholesky infos of one call; state: the check
 *   blas_ws 32 MiB             cuBLAS workspace (set with cublasSetWorkspace,
 *                              so factorize never allocates)
 *   solver  queried            cusolverDnXsyevd device (+ host)
 *                              workspaces
 *
 * Supported maximum: n <= SKV_CUDA_FACTOR_MAX_N = 2^31 - 1 rows (the public
 * op refuses more). Every cuBLAS and cuSOLVER call uses the 64-bit API or
 * sees at most one block of rows, and kernels index with int64, so nothing
 * overflows below INT64 sizes; the limit keeps row indices inside int32 like
 * the rest of the backend. At d = 1024 such an A is 4 TiB: in practice the
 * device memory for the prompt is the limit.
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_internal.h"
#include "skv_numerics.h"

#include "skv_factor.h"
#include "skv_cuda_canon_i8.h"
#include "skv_cuda_chol.cuh"

#define SKV_CUDA_FACTOR_MAX_N ((int64_t)INT32_MAX)
/* Rows (n >= d) or columns (n < d) per fp32 Gram block: each block's Gram is exact products
   summed in fp32 over at most this many rows (64 tensor-core k-steps), then summed in double. */
#define SKV_CF_GRAM_ROWS ((int64_t)1024)
/* Bytes of fp32 block Grams computed by one batched GEMM (then reduced in double). */
#define SKV_CF_GRAM_BATCH_BYTES ((size_t)128 << 20)
/* Elements of A converted to float per EXACT projection block (64 MiB of floats). */
#define SKV_CF_PROJ_ELEMS ((int64_t)1 << 24)
/* cuBLAS workspace (NVIDIA's recommendation for Hopper). */
#define SKV_CF_BLAS_WS ((size_t)32 << 20)
/* Fallback Gram: row ranges per tile, partial sums added in a fixed order. */
#define SKV_CF_SPLITS 8
/* bf16 terms of Q in the projection U = A Q */
#define SKV_CF_QTERMS 2
#define SKV_CF_TILE 64
/* Cholesky factorizations of one FAST call, at most: two per iteration, the check's H (last), the final two. */
#define SKV_CF_NINFO (2 * SKV_FACTOR_ITERS + 4)
/* Warps (8 rows each) per block of the solve Y R^-1 (<= SKV_CF_SOLVE_WARPS): fewer warps per
   SM spread the fp64 mma work of the 1024 rows over more SMs. */
#define SKV_CF_SOLVE_BLOCK_WARPS 4
static_assert(SKV_CF_SOLVE_BLOCK_WARPS <= SKV_CF_SOLVE_WARPS, "the solve's launch bound");
static_assert(SKV_CF_MAXT <= 32, "skv_cf_check sums one partial per lane of one warp");

/* Device-side state of the FAST route. */
typedef struct {
    int fallback;                              /* this call uses the double Gram */
    unsigned long long n_failures;             /* calls with a failed solver step, since create */
    unsigned long long first_failure_tag;      /* ~0 until a failure */
} skv_cf_state;

struct skv_cuda_factor {
    cudaStream_t st;
    cublasHandle_t blas;
    cusolverDnHandle_t solver;
    cusolverDnParams_t params;
    int64_t n_max, m_max, proj_rows, gram_batch;
    int32_t d, r;
    int fast_ok;    /* FAST workspace allocated (skv_factor_route_for) */
    double *gd;     /* [m_max^2] */
    double *evals;  /* [m_max] */
    float *scratch; /* [scratch_bytes] */
    size_t scratch_bytes;
    int *info;      /* [SKV_CF_NINFO] */
    double *x, *y, *c;
    double *lt; /* the tiled Cholesky factor, ||L||_F^2, D (skv_cuda_chol.cuh), then ceil(r / 8) per-warp
                   sums of squares of the check's R^-1 */
    skv_bf16 *qs;
    skv_cf_state *state;
    void *blas_ws;
    void *solver_ws; /* device */
    size_t solver_ws_bytes;
    void *solver_host; /* host, NULL if cuSOLVER wants none */
    size_t solver_host_bytes;
    /* the canonical route (skv_cuda_canon.cuh): G (gd itself when m_max = d), the iterate (x, y
       themselves when the FAST workspace exists), C, L, the packed Cholesky scratch above
       SKV_CC_CHOL_SMEM_R, D, the column scales e, f and the column maxima; in scratch the token
       blocks of the DSYRK Gram (canon_rows rows of fixed-point A) and of U (canon_ubufs buffers
       of canon_urows rows of fixed-point A, then T); a second stream (non-blocking) for the
       memory-bound kernels beside the GEMMs, and its events: fork (recorded on st), join
       (recorded on cc_side), a block's input ready (cc_side) and its buffer free (st), by the
       block's parity */
    double *cc_g, *cc_x, *cc_y, *cc_c, *cc_l, *cc_lp, *cc_dsc;
    int32_t *cc_e, *cc_f;
    unsigned *cc_colmax;
    int cc_own_g, cc_own_xy;
    int64_t canon_rows, canon_urows;
    int canon_ubufs;
    cudaStream_t cc_side;
    cudaEvent_t cc_ev_fork, cc_ev_join, cc_ev_ready[2], cc_ev_free[2];
};

/* ---- sizes ---------------------------------------------------------------------- */

typedef struct skv_cf_sizes {
    int64_t m_max, proj_rows, gram_batch, canon_rows, canon_urows;
    size_t canon_bytes; /* the canonical route's buffers beyond those it shares */
    int fast_ok, canon_ubufs;
    size_t gd_bytes, evals_bytes, scratch_bytes, xy_bytes, c_bytes, lt_bytes, qs_bytes, total;
} skv_cf_sizes;

/* 0 on invalid arguments or size_t overflow. */
static int skv_cf_sizes_of(int64_t n_max, int32_t d, int32_t r, skv_cf_sizes *s)
{
    if (n_max < 1 || d < 1 || r < 1) return 0;
    s->m_max = n_max < d ? n_max : d;
    s->fast_ok = skv_factor_route_for(n_max, d, r, SKV_FACTORIZE_AUTO) == SKV_ROUTE_FAST;
    s->proj_rows = SKV_CF_PROJ_ELEMS / d;
    if (s->proj_rows < 1) s->proj_rows = 1;
    if (s->proj_rows > n_max) s->proj_rows = n_max;
    size_t mm, pr, t, dd = 0, dr = 0;
    if (!skv_mul_size((size_t)s->m_max, (size_t)s->m_max, &mm)) return 0;
    if (!skv_mul_size((size_t)s->proj_rows, (size_t)d, &pr)) return 0;
    if (!skv_mul_size(mm > pr ? mm : pr, sizeof(float), &s->scratch_bytes)) return 0;
    if (n_max >= d) { /* batched block Grams: as many d x d fp32 blocks as fit in SKV_CF_GRAM_BATCH_BYTES, >= 1 */
        size_t blk, nblk = (size_t)((n_max + SKV_CF_GRAM_ROWS - 1) / SKV_CF_GRAM_ROWS), fit;
        if (!skv_mul_size(mm, sizeof(float), &blk)) return 0;
        fit = SKV_CF_GRAM_BATCH_BYTES / blk;
        if (fit < 1) fit = 1;
        if (fit > nblk) fit = nblk;
        s->gram_batch = (int64_t)fit;
        if (!skv_mul_size(fit, blk, &blk)) return 0;
        if (blk > s->scratch_bytes) s->scratch_bytes = blk;
    } else {
        s->gram_batch = 1;
    }
    s->xy_bytes = s->c_bytes = s->lt_bytes = s->qs_bytes = 0;
    if (s->fast_ok) {
        size_t part;
        if (!skv_mul_size((size_t)d, (size_t)d, &dd) || !skv_mul_size(dd, SKV_CF_SPLITS * sizeof(double), &part))
            return 0;
        if (part > s->scratch_bytes) s->scratch_bytes = part;
        if (!skv_mul_size((size_t)d, (size_t)r, &dr) || !skv_mul_size(dr, sizeof(double), &s->xy_bytes)) return 0;
        s->c_bytes = (size_t)r * r * sizeof(double);
        s->lt_bytes = (SKV_CF_LT_DOUBLES((r + 7) / 8) + 1 + (size_t)r + (size_t)(r + 7) / 8) * sizeof(double);
        if (!skv_mul_size(dr, SKV_CF_QTERMS * sizeof(skv_bf16), &s->qs_bytes)) return 0;
    }
    { /* the canonical route: token blocks of canon_rows rows, [rows, d] + [rows, r] doubles, in scratch */
        int64_t cr = ((int64_t)1 << 23) / ((int64_t)d + r);
        if (cr < 1) cr = 1;
        if (cr > n_max) cr = n_max;
        s->canon_rows = cr;
        size_t need;
        if (!skv_mul_size((size_t)cr, ((size_t)d + r) * sizeof(double), &need)) return 0;
        if (need > s->scratch_bytes) s->scratch_bytes = need;
#if !SKV_CC_GRAM_DSYRK
        /* the int8 exact Gram (skv_cuda_canon_i8.h): its int32 products and digit planes, at least one
           block of any digit count; above the cap the scratch stays and the plan decides per call */
        need = skv_cc_i8_need(d);
        if (need && need <= SKV_CC_I8_GROW_CAP && need > s->scratch_bytes) s->scratch_bytes = need;
#endif
        /* U's token blocks in the scratch as sized: two buffers of fixed-point A and one T, of as
           many rows as fit, at most canon_rows (the scratch holds one buffer of canon_rows and T,
           so at least about canon_rows / 2 fit); one buffer of canon_rows if not even one row does */
        int64_t ur = (int64_t)(s->scratch_bytes / ((2 * (size_t)d + (size_t)r) * sizeof(double)));
        if (ur > cr) ur = cr;
        s->canon_ubufs = ur >= 1 ? 2 : 1;
        s->canon_urows = ur >= 1 ? ur : cr;
        size_t rr = (size_t)r * r * sizeof(double), cb = 2 * rr + (size_t)r * sizeof(double) +
                                                          (size_t)d * (sizeof(int32_t) + sizeof(unsigned)) +
                                                          (size_t)r * sizeof(int32_t);
        if (r > 160) cb += rr; /* the packed Cholesky scratch (SKV_CC_CHOL_SMEM_R) */
        if (s->m_max < d) cb += (size_t)d * d * sizeof(double);
        if (!s->fast_ok) cb += 2 * (size_t)d * r * sizeof(double);
        s->canon_bytes = cb;
    }
    if (!skv_mul_size(mm, sizeof(double), &s->gd_bytes)) return 0;
    if (!skv_mul_size((size_t)s->m_max, sizeof(double), &s->evals_bytes)) return 0;
    t = s->gd_bytes;
    if (!skv_add_size(t, s->evals_bytes, &t)) return 0;
    if (!skv_add_size(t, s->scratch_bytes, &t)) return 0;
    if (!skv_add_size(t, 2 * s->xy_bytes, &t)) return 0;
    if (!skv_add_size(t, s->c_bytes + s->lt_bytes + s->qs_bytes, &t)) return 0;
    if (!skv_add_size(t, SKV_CF_NINFO * sizeof(int) + sizeof(skv_cf_state), &t)) return 0;
    if (!skv_add_size(t, SKV_CF_BLAS_WS, &t)) return 0;
    if (!skv_add_size(t, s->canon_bytes, &t)) return 0;
    s->total = t;
    return 1;
}

extern "C" size_t skv_cuda_factor_bytes(int64_t n_max, int32_t d, int32_t r)
{
    skv_cf_sizes s;
    return skv_cf_sizes_of(n_max, d, r, &s) ? s.total : SIZE_MAX;
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
    return skv_cf_fail(msg, cap, e == cudaErrorMemoryAllocation ? SKV_ERR_OUT_OF_MEMORY : SKV_ERR_DEVICE, what,
                       cudaGetErrorString(e));
}

static skv_status skv_cf_blas(cublasStatus_t e, const char *what, char *msg, size_t cap)
{
    if (e == CUBLAS_STATUS_SUCCESS) return SKV_OK;
    skv_status st = SKV_ERR_DEVICE; /* not initialized, execution failed, internal, arch mismatch ... */
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
    skv_status st = SKV_ERR_DEVICE;
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

static unsigned skv_cf_blocks(int64_t count) { return grid_for(count, SKV_CF_THREADS, SKV_CF_MAX_BLOCKS); }

/* y[i] = (float)x[i] (exact). */
static __global__ void skv_cf_bf16_to_f32(const skv_bf16 *__restrict__ x, float *__restrict__ y, int64_t count)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = skv_bf16_to_f32(x[i]);
}

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

/* Counts a failed solver call of this factorization (info != 0) under tag. One thread. */
static __global__ void skv_cf_infos(const int *__restrict__ info, int n_info, unsigned long long tag,
                                    skv_cf_state *state)
{
    int bad = 0;
    for (int k = 0; k < n_info; k++) bad |= info[k] != 0;
    if (bad) {
        if (state->n_failures++ == 0) state->first_failure_tag = tag;
    }
}

#include "skv_cuda_canon.cuh"

/* ---- create / destroy ------------------------------------------------------------------ */

extern "C" void skv_cuda_factor_destroy(skv_cuda_factor *f)
{
    if (!f) return;
    /* cudaFree synchronizes with outstanding work on the device. Errors are ignored: nothing to report to. */
    if (f->cc_own_g) cudaFree(f->cc_g);
    if (f->cc_own_xy) {
        cudaFree(f->cc_x);
        cudaFree(f->cc_y);
    }
    cudaFree(f->cc_c);
    cudaFree(f->cc_l);
    cudaFree(f->cc_lp);
    cudaFree(f->cc_dsc);
    cudaFree(f->cc_e);
    cudaFree(f->cc_f);
    cudaFree(f->cc_colmax);
    cudaFree(f->solver_ws);
    cudaFree(f->blas_ws);
    cudaFree(f->state);
    cudaFree(f->qs);
    cudaFree(f->lt);
    cudaFree(f->c);
    cudaFree(f->y);
    cudaFree(f->x);
    cudaFree(f->info);
    cudaFree(f->scratch);
    cudaFree(f->evals);
    cudaFree(f->gd);
    free(f->solver_host);
    cudaEvent_t evs[6] = {f->cc_ev_fork, f->cc_ev_join, f->cc_ev_ready[0], f->cc_ev_ready[1], f->cc_ev_free[0],
                          f->cc_ev_free[1]};
    for (int k = 0; k < 6; k++)
        if (evs[k]) cudaEventDestroy(evs[k]);
    if (f->cc_side) cudaStreamDestroy(f->cc_side);
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
    return e == cudaErrorMemoryAllocation ? SKV_ERR_OUT_OF_MEMORY : SKV_ERR_DEVICE;
}

/* A handle call failed at create: a device runtime failure (or out of memory). */
static skv_status skv_cf_handle_status(skv_status st)
{
    return st == SKV_ERR_OUT_OF_MEMORY ? SKV_ERR_OUT_OF_MEMORY : SKV_ERR_DEVICE;
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
    if (!skv_cf_sizes_of(n_max, d, r, &sz)) {
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
    f->gram_batch = sz.gram_batch;
    f->d = d;
    f->r = r;
    f->fast_ok = sz.fast_ok;
    f->scratch_bytes = sz.scratch_bytes;
    f->canon_rows = sz.canon_rows;
    f->canon_urows = sz.canon_urows;
    f->canon_ubufs = sz.canon_ubufs;

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
    if ((s = skv_cf_alloc((void **)&f->scratch, sz.scratch_bytes, "scratch", msg, cap)) != SKV_OK) goto fail;
    if ((s = skv_cf_alloc((void **)&f->info, SKV_CF_NINFO * sizeof(int), "solver infos", msg, cap)) != SKV_OK)
        goto fail;
    if ((s = skv_cf_alloc((void **)&f->state, sizeof(skv_cf_state), "factorization state", msg, cap)) != SKV_OK)
        goto fail;
    if (f->fast_ok) {
        if ((s = skv_cf_alloc((void **)&f->x, sz.xy_bytes, "iterate X", msg, cap)) != SKV_OK) goto fail;
        if ((s = skv_cf_alloc((void **)&f->y, sz.xy_bytes, "iterate G X", msg, cap)) != SKV_OK) goto fail;
        if ((s = skv_cf_alloc((void **)&f->c, sz.c_bytes, "Cholesky block", msg, cap)) != SKV_OK) goto fail;
        if ((s = skv_cf_alloc((void **)&f->lt, sz.lt_bytes, "Cholesky factor", msg, cap)) != SKV_OK) goto fail;
        /* both kernels keep the tiled factor in shared memory (~115 KiB at r = 160) */
        cudaError_t e = cudaFuncSetAttribute(skv_cf_chol, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)skv_cf_chol_smem(r));
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(skv_cf_solve_lt, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     (int)skv_cf_solve_smem(r));
        if ((s = skv_cf_cuda(e, "cudaFuncSetAttribute (Cholesky shared memory)", msg, cap)) != SKV_OK) goto fail;
        if ((s = skv_cf_alloc((void **)&f->qs, sz.qs_bytes, "bf16 split of Q", msg, cap)) != SKV_OK) goto fail;
    }
    /* the canonical route's buffers */
    if (f->m_max == d) f->cc_g = f->gd;
    else {
        f->cc_own_g = 1;
        if ((s = skv_cf_alloc((void **)&f->cc_g, (size_t)d * d * sizeof(double), "canonical Gram", msg, cap)) != SKV_OK)
            goto fail;
    }
    if (f->fast_ok) f->cc_x = f->x, f->cc_y = f->y;
    else {
        f->cc_own_xy = 1;
        if ((s = skv_cf_alloc((void **)&f->cc_x, (size_t)d * r * sizeof(double), "canonical iterate", msg, cap)) != SKV_OK ||
            (s = skv_cf_alloc((void **)&f->cc_y, (size_t)d * r * sizeof(double), "canonical iterate", msg, cap)) != SKV_OK)
            goto fail;
    }
    if ((s = skv_cf_alloc((void **)&f->cc_c, (size_t)r * r * sizeof(double), "canonical Y^T Y", msg, cap)) != SKV_OK ||
        (s = skv_cf_alloc((void **)&f->cc_l, ((size_t)r * r + r) * sizeof(double), "canonical Cholesky factor", msg, cap)) != SKV_OK ||
        (s = skv_cf_alloc((void **)&f->cc_lp, r > SKV_CC_CHOL_SMEM_R ? (size_t)r * r * sizeof(double) : 8,
                          "canonical Cholesky scratch", msg, cap)) != SKV_OK ||
        (s = skv_cf_alloc((void **)&f->cc_dsc, (size_t)r * sizeof(double), "canonical scales D", msg, cap)) != SKV_OK ||
        (s = skv_cf_alloc((void **)&f->cc_e, (size_t)d * sizeof(int32_t), "canonical column scales", msg, cap)) != SKV_OK ||
        (s = skv_cf_alloc((void **)&f->cc_f, (size_t)r * sizeof(int32_t), "canonical Q scales", msg, cap)) != SKV_OK ||
        (s = skv_cf_alloc((void **)&f->cc_colmax, (size_t)d * sizeof(unsigned), "canonical column maxima", msg, cap)) !=
            SKV_OK)
        goto fail;
    {
        cudaError_t e = cudaFuncSetAttribute(skv_cc_chol, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)skv_cc_chol_smem(r < SKV_CC_CHOL_SMEM_R ? r : SKV_CC_CHOL_SMEM_R));
        if ((s = skv_cf_cuda(e, "cudaFuncSetAttribute (canonical Cholesky shared memory)", msg, cap)) != SKV_OK) goto fail;
        /* the fast solve keeps L's packed lower triangle in shared memory (~101 KiB at r = 160); the
           limit is per function, shared by every factor: its largest size whatever this r */
        int fs = (int)skv_cc_fsolve_smem(32 * SKV_CC_FSOLVE_MAXQ);
        e = cudaFuncSetAttribute(skv_cc_fsolve<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, fs);
        if (e == cudaSuccess) e = cudaFuncSetAttribute(skv_cc_fsolve<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, fs);
        if (e == cudaSuccess) e = cudaFuncSetAttribute(skv_cc_fsolve<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, fs);
        if (e == cudaSuccess) e = cudaFuncSetAttribute(skv_cc_fsolve<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, fs);
        if (e == cudaSuccess) e = cudaFuncSetAttribute(skv_cc_fsolve<5>, cudaFuncAttributeMaxDynamicSharedMemorySize, fs);
        if ((s = skv_cf_cuda(e, "cudaFuncSetAttribute (canonical solve shared memory)", msg, cap)) != SKV_OK) goto fail;
    }
    { /* the canonical route's second stream and events (created once: factorize allocates nothing) */
        cudaError_t e = cudaStreamCreateWithFlags(&f->cc_side, cudaStreamNonBlocking);
        if (e != cudaSuccess) f->cc_side = NULL;
        if ((s = skv_cf_cuda(e, "cudaStreamCreateWithFlags (canonical second stream)", msg, cap)) != SKV_OK) goto fail;
        cudaEvent_t *evs[6] = {&f->cc_ev_fork, &f->cc_ev_join, &f->cc_ev_ready[0], &f->cc_ev_ready[1],
                               &f->cc_ev_free[0], &f->cc_ev_free[1]};
        for (int k = 0; k < 6 && e == cudaSuccess; k++)
            if ((e = cudaEventCreateWithFlags(evs[k], cudaEventDisableTiming)) != cudaSuccess) *evs[k] = NULL;
        if ((s = skv_cf_cuda(e, "cudaEventCreateWithFlags (canonical events)", msg, cap)) != SKV_OK) goto fail;
    }
    {
        skv_cf_state init;
        memset(&init, 0, sizeof init);
        init.first_failure_tag = ~0ull;
        cudaError_t e = cudaMemcpy(f->state, &init, sizeof init, cudaMemcpyHostToDevice);
        if ((s = skv_cf_cuda(e, "cudaMemcpy (factorization state)", msg, cap)) != SKV_OK) goto fail;
    }
    if ((s = skv_cf_alloc(&f->blas_ws, SKV_CF_BLAS_WS, "cuBLAS workspace", msg, cap)) != SKV_OK) goto fail;
    /* after cublasSetStream, which resets the workspace to cuBLAS's own pool */
    if ((s = skv_cf_blas(cublasSetWorkspace(f->blas, f->blas_ws, SKV_CF_BLAS_WS), "cublasSetWorkspace", msg, cap)) !=
        SKV_OK)
        goto fail_handle;

    /* cuSOLVER workspace: the EXACT route's eigenproblem (m_max x m_max) */
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

/* The EXACT route (see the top of the file); the solver's info goes to f->info[0]. */
static skv_status skv_cf_exact(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, float *u, float *w, char *msg,
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

/* The FAST route (see the top of the file); solver infos go to f->info[0 .. SKV_CF_NINFO). */
static skv_status skv_cf_fast(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, float *u, float *w,
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

extern "C" skv_status skv_cuda_factorize(skv_cuda_factor *f, skv_factorize_route mode, int64_t n, const skv_bf16 *a,
                                         float *u, float *w, unsigned long long tag, int sync, char *msg, size_t cap)
{
    const int64_t d = f->d, r = f->r;
    if (n < 1 || n > f->n_max || n > SKV_CUDA_FACTOR_MAX_N || r > (n < d ? n : d)) {
        if (msg && cap)
            snprintf(msg, cap, "cuda factorize: n = %lld with d = %lld, r = %lld: need r <= min(n, d) and "
                               "1 <= n <= %lld (workspace n_max; supported maximum %lld)",
                     (long long)n, (long long)d, (long long)r, (long long)f->n_max, (long long)SKV_CUDA_FACTOR_MAX_N);
        return SKV_ERR_INVALID_ARGUMENT;
    }
    if (mode == SKV_FACTORIZE_CANONICAL) { /* no solver infos: the floored Cholesky cannot fail */
        skv_status s = skv_cf_canonical(f, n, a, u, w, msg, cap);
        if (s != SKV_OK || !sync) return s;
        SKV_CF_CHECK_CUDA(cudaStreamSynchronize(f->st), "cudaStreamSynchronize");
        return SKV_OK;
    }
    int fast = f->fast_ok && skv_factor_route_for(n, (int32_t)d, (int32_t)r, mode) == SKV_ROUTE_FAST;
    int n_info = fast ? SKV_CF_NINFO - 1 : 1; /* the check's own Cholesky is not a failure */
    skv_status s;
    SKV_CF_CHECK_CUDA(cudaMemsetAsync(f->info, 0, SKV_CF_NINFO * sizeof(int), f->st), "cudaMemsetAsync (infos)");
    s = fast ? skv_cf_fast(f, n, a, u, w, mode, msg, cap) : skv_cf_exact(f, n, a, u, w, msg, cap);
    if (s != SKV_OK) return s;
    skv_cf_infos<<<1, 1, 0, f->st>>>(f->info, n_info, tag, f->state);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "solver info kernel");
    if (!sync) return SKV_OK;
    /* the solvers' verdict (and any asynchronous error of the work above) */
    int info[SKV_CF_NINFO];
    SKV_CF_CHECK_CUDA(cudaMemcpyAsync(info, f->info, sizeof info, cudaMemcpyDeviceToHost, f->st),
                      "cudaMemcpyAsync (solver infos)");
    SKV_CF_CHECK_CUDA(cudaStreamSynchronize(f->st), "cudaStreamSynchronize");
    for (int k = 0; k < n_info; k++)
        if (info[k] != 0) {
            if (msg && cap)
                if (fast)
                    snprintf(msg, cap, "cuda factorize: Cholesky QR (r = %lld): pivot %d is not finite (overflow)",
                             (long long)r, info[k] - 1);
                else
                    snprintf(msg, cap, "cuda factorize: cusolverDnXsyevd (m = %lld) returned info = %d (%s)",
                             (long long)(n < d ? n : d), info[k],
                             info[k] > 0 ? "the solver did not converge" : "invalid argument");
            return SKV_ERR_NUMERICAL;
        }
    return SKV_OK;
}

extern "C" skv_status skv_cuda_factor_counts(skv_cuda_factor *f, unsigned long long *failures,
                                             unsigned long long *first_failure_tag, char *msg, size_t cap)
{
    skv_cf_state h;
    SKV_CF_CHECK_CUDA(cudaMemcpyAsync(&h, f->state, sizeof h, cudaMemcpyDeviceToHost, f->st),
                      "cudaMemcpyAsync (factorization state)");
    SKV_CF_CHECK_CUDA(cudaStreamSynchronize(f->st), "cudaStreamSynchronize");
    if (failures) *failures = h.n_failures;
    if (first_failure_tag) *first_failure_tag = h.first_failure_tag;
    return SKV_OK;
}
