/*
 * skv_cuda_factor.cuh - what the factorization files of cuda/ share: the factor's workspace
 * (struct skv_cuda_factor), its constants, the status mapping and check macros, and the routes'
 * entry points. The rank-r factorization of the cuda backend (cuBLAS + cuSOLVER + a few kernels):
 *   skv_cuda_factor.cu        the workspace (create, destroy, sizes), skv_cuda_factorize (the
 *                             factorize slot of the dispatch table and the cache's prefill: it
 *                             picks the route) and the failure counters
 *   skv_cuda_factor_gram.cu   step 1 of FAST and EXACT: the blocked bf16 Gram summed in double
 *   skv_cuda_factor_fast.cu   the FAST route (steps 2-4 below; skv_cuda_chol.cuh: its Cholesky)
 *   skv_cuda_factor_exact.cu  the EXACT route
 *   skv_cuda_factor_canon.cu  the CANONICAL route (the reproducible mode)
 * Routes as in lib/skv_factor.h, the same math as the cpu backend's FAST route:
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
 * skv_cuda_factor_canon.cu, bit for bit ref's; no host synchronization. Its buffers
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
#ifndef SKV_CUDA_FACTOR_CUH
#define SKV_CUDA_FACTOR_CUH

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
/* The canonical route's Cholesky (skv_cuda_factor_canon.cu) keeps the packed lower triangle in shared
   memory up to this rank (~103 KiB at 160), in global memory (f->cc_lp) above. */
#define SKV_CC_CHOL_SMEM_R 160

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
    /* the canonical route (skv_cuda_factor_canon.cu): G (gd itself when m_max = d), the iterate (x, y
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

/* ---- status mapping --------------------------------------------------------------- */

static inline skv_status skv_cf_fail(char *msg, size_t cap, skv_status st, const char *what, const char *detail)
{
    if (msg && cap) snprintf(msg, cap, "cuda factorize: %s: %s", what, detail);
    return st;
}

static inline skv_status skv_cf_cuda(cudaError_t e, const char *what, char *msg, size_t cap)
{
    if (e == cudaSuccess) return SKV_OK;
    return skv_cf_fail(msg, cap, e == cudaErrorMemoryAllocation ? SKV_ERR_OUT_OF_MEMORY : SKV_ERR_DEVICE, what,
                       cudaGetErrorString(e));
}

static inline skv_status skv_cf_blas(cublasStatus_t e, const char *what, char *msg, size_t cap)
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

static inline skv_status skv_cf_solver(cusolverStatus_t e, const char *what, char *msg, size_t cap)
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

static inline unsigned skv_cf_blocks(int64_t count) { return grid_for(count, SKV_CF_THREADS, SKV_CF_MAX_BLOCKS); }

/* ---- the routes (each in its own file) ---------------------------------------------------- */

/* Step 1 of FAST and EXACT (skv_cuda_factor_gram.cu): G (m x m, double, in f->gd) = A^T A (n >= d) or
   A A^T (n < d). */
skv_status skv_cf_gram(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, char *msg, size_t cap);
/* The EXACT route (skv_cuda_factor_exact.cu); the solver's info goes to f->info[0]. */
skv_status skv_cf_exact(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, float *u, float *w, char *msg, size_t cap);
/* The FAST route (skv_cuda_factor_fast.cu); the Cholesky infos go to f->info. */
skv_status skv_cf_fast(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, float *u, float *w, skv_factorize_route mode,
                       char *msg, size_t cap);
/* Bytes of f->lt for rank r: the tiled Cholesky factor, ||L||_F^2, D and the check's per-warp sums
   (skv_cuda_factor_fast.cu; at create). */
size_t skv_cf_fast_lt_bytes(int32_t r);
/* The opt-in shared memory of the FAST route's kernels for rank r (skv_cuda_factor_fast.cu; at create). */
cudaError_t skv_cf_fast_smem(int32_t r);
/* The CANONICAL route (skv_cuda_factor_canon.cu). */
skv_status skv_cf_canonical(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, float *u, float *w, char *msg,
                            size_t cap);
/* The opt-in shared memory of the CANONICAL route's Cholesky (rank r) and fast solve (every rank; at create),
   with the message of the call that failed. */
skv_status skv_cf_canonical_smem(int32_t r, char *msg, size_t cap);

#endif /* SKV_CUDA_FACTOR_CUH */
