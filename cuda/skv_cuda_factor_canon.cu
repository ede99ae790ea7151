/*
 * skv_cuda_factor_canon.cu - the canonical factorization (route SKV_FACTORIZE_CANONICAL,
 * lib/skv_factor_canon.h, docs/DESIGN.md 10.1; the reproducible mode's prefill and the op-level
 * factorize slot with that route, through skv_cuda_factorize) on the cuda backend, bit for bit
 * ref's: skv_cf_canonical, and skv_cf_canonical_smem (its kernels' shared memory, at create).
 * It uses the factor's workspace and check macros (skv_cuda_factor.cuh). No host synchronization, no allocation. Everything runs
 * on the factor's stream f->st except the memory-bound writers of the token
 * blocks (the int8 digit planes of step 2, the fixed-point rows of step 4),
 * which run on the factor's second stream f->cc_side into two buffers while
 * the GEMMs of the previous block run on f->st (cuBLAS only ever on f->st);
 * events order each buffer's writer after the last GEMM that read it and
 * each block's GEMMs after its writer, and the call is ordered on f->st at
 * entry and exit (skv_cc_fork, skv_cc_join). Every value is exact integer
 * arithmetic or computed in a fixed order on one stream, so the schedule
 * does not change a bit:
 *   1. column scales: atomicMax of the bf16 magnitude bits per column (any order),
 *      e_i on the device;
 *   2. the exact S = X^T X on int8 tensor cores (skv_cuda_canon_i8.h: X split into
 *      s <= 4 signed 7-bit digits per token block, on the second stream into the
 *      plane buffer; s int8 GEMMs into int32 products, a combine kernel per
 *      chunk into S in double, both on f->st in block order, all exact); where the
 *      int8 plan does not fit the scratch, or cuBLAS refuses the int8 GEMM, per
 *      token block (f->canon_rows rows) the fixed-point block in double
 *      (skv_canon_fix), then cuBLAS DSYRK accumulating S (beta = 1: exact, every
 *      partial sum an integer below 2^53), all on f->st, one buffer;
 *      G = S scaled, both triangles;
 *   3. the subspace iteration with the project's own fixed-order kernels: G X and
 *      Y^T Y (its lower triangle) on the fp64 tensor cores where K % 4 == 0
 *      (skv_cc_mm_tc: mma.sync m8n8k4 k-steps in order, each output the fma chain in
 *      order of k, dev/cuda/dmma_order_probe.cu), else by a register-tiled
 *      fp64 SIMT GEMM with a cp.async stage ring and register prefetch (skv_cc_mm;
 *      both in skv_cuda_canon_mm.cuh; G X reads G's rows as its columns, G being
 *      symmetric bit for bit), the equilibration, trace, shift, floor and
 *      Cholesky in one thread block, the solve X = Y L^-T a warp per row
 *      (skv_cc_fchol, skv_cc_fsolve in skv_cuda_canon_chol.cuh: a one-column
 *      lookahead, one barrier a column, quotients by skv_cc_div);
 *      above r = 160 the Cholesky and the solve fall back to skv_cc_chol (packed
 *      triangle in shared or global memory) and skv_cc_solve (L from global);
 *   4. W = (float) Q^T; the fixed-point Q (per column f_j, y_ij) and, per token
 *      block (f->canon_urows rows), T = X Y by cuBLAS DGEMM (exact), U = (float)
 *      (T 2^(f_j - Gb)); the blocks' fixed-point X on the second stream into
 *      f->canon_ubufs buffers, the first ones as soon as the Gram is done, beside
 *      step 3 (they need only A and e).
 * The default cuBLAS math mode is kept (no fp64 emulation), so DSYRK/DGEMM are
 * IEEE fp64 (fma) products: exact here.
 */
#include "skv_cuda_factor.cuh"
#include "skv_factor_canon.h"
#include "skv_cuda_canon_i8.cuh"
#include "skv_cuda_canon_chol.cuh"
#include "skv_cuda_canon_mm.cuh"
#include "skv_cuda_canon_fix.cuh"

/* ---- step 1 and 2 -------------------------------------------------------------------- */

/* colmax[i] = max over rows of a's magnitude bits in column i (colmax zeroed before). */
static __global__ void skv_cc_colmax(const skv_bf16 *__restrict__ a, int64_t n, int32_t d, unsigned *__restrict__ colmax)
{
    /* a block walks row chunks of one column range: threads over columns, rows strided over blocks */
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x) {
        unsigned mx = 0;
        for (int64_t t = blockIdx.y; t < n; t += gridDim.y) {
            unsigned v = a[t * d + i] & 0x7fffu;
            mx = v > mx ? v : mx;
        }
        atomicMax(colmax + i, mx);
    }
}

/* The same with 16-byte loads (d % 8 == 0, a 16-byte aligned): thread (x, y) of a 32 x 8 block owns
   the 8 columns 8 (32 blockIdx.x + x) .. + 7 over the rows blockIdx.y 8 + y + k 8 gridDim.y; the 8
   row lanes reduced in shared memory, then one atomicMax per column and block. */
static __global__ void __launch_bounds__(256)
    skv_cc_colmax8(const skv_bf16 *__restrict__ a, int64_t n, int32_t d, unsigned *__restrict__ colmax)
{
    __shared__ unsigned red[8][32 * 8 + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int32_t g = blockIdx.x * 32 + tx, ng = d / 8;
    unsigned mx[8];
#pragma unroll
    for (int c = 0; c < 8; c++) mx[c] = 0;
    if (g < ng) {
        const uint4 *p = (const uint4 *)a + g;
        const int64_t step = (int64_t)gridDim.y * 8;
#pragma unroll 4
        for (int64_t t = (int64_t)blockIdx.y * 8 + ty; t < n; t += step) {
            uint4 v = __ldg(p + t * ng);
            unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                unsigned lo = w[k] & 0x7fffu, hi = (w[k] >> 16) & 0x7fffu;
                mx[2 * k] = lo > mx[2 * k] ? lo : mx[2 * k];
                mx[2 * k + 1] = hi > mx[2 * k + 1] ? hi : mx[2 * k + 1];
            }
        }
    }
#pragma unroll
    for (int c = 0; c < 8; c++) red[ty][tx * 8 + c] = mx[c];
    __syncthreads();
    const int tid = ty * 32 + tx; /* 256 threads: one column each of the block's 256 */
    unsigned m = 0;
#pragma unroll
    for (int y = 0; y < 8; y++) m = red[y][tid] > m ? red[y][tid] : m;
    const int32_t col = blockIdx.x * 256 + tid;
    if (col < d) atomicMax(colmax + col, m);
}

/* e[i] = ex of column i's max magnitude. */
static __global__ void skv_cc_scales(const unsigned *__restrict__ colmax, int32_t d, int32_t *__restrict__ e)
{
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x)
        e[i] = skv_canon_ex_bf16((uint16_t)colmax[i]);
}

/* blk [rows, d] = the fixed-point rows of a. (An 8-columns-a-thread variant measured slower on the
   H200: 47.8 against 27.3 us for 7084 x 1024, dev/cuda/canon_gemm_probe.cu.) */
static void skv_cc_fix_launch(const skv_bf16 *a, int64_t rows, int32_t d, const int32_t *e, int32_t F, double *blk,
                              cudaStream_t st)
{
    skv_cc_fix<<<skv_cf_blocks(rows * d), SKV_CF_THREADS, 0, st>>>(a, rows, d, e, F, blk);
}

/* Step 2 by fixed-point doubles and cuBLAS DSYRK (where the int8 Gram does not fit or is refused), token
   blocks of f->canon_rows rows in blk: S's upper triangle into g (column major). */
static skv_status skv_cc_gram_f64(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, int32_t F, double *g, double *blk,
                                  char *msg, size_t cap)
{
    const int32_t d = f->d;
    const double one = 1.0, zero = 0.0;
    for (int64_t t0 = 0; t0 < n; t0 += f->canon_rows) {
        int64_t rows = n - t0 < f->canon_rows ? n - t0 : f->canon_rows;
        skv_cc_fix_launch(a + (size_t)t0 * d, rows, d, f->cc_e, F, blk, f->st);
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical fixed-point kernel");
        SKV_CF_CHECK_BLAS(cublasDsyrk(f->blas, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_N, d, (int)rows, &one, blk, d,
                                      t0 ? &one : &zero, g, d),
                          "cublasDsyrk (canonical exact Gram)");
    }
    return SKV_OK;
}

/* The side stream (f->cc_side) after everything enqueued so far on f->st. */
static skv_status skv_cc_fork(skv_cuda_factor *f, char *msg, size_t cap)
{
    SKV_CF_CHECK_CUDA(cudaEventRecord(f->cc_ev_fork, f->st), "cudaEventRecord (canonical fork)");
    SKV_CF_CHECK_CUDA(cudaStreamWaitEvent(f->cc_side, f->cc_ev_fork, 0), "cudaStreamWaitEvent (canonical fork)");
    return SKV_OK;
}

/* f->st after everything enqueued so far on the side stream. */
static skv_status skv_cc_join(skv_cuda_factor *f, char *msg, size_t cap)
{
    SKV_CF_CHECK_CUDA(cudaEventRecord(f->cc_ev_join, f->cc_side), "cudaEventRecord (canonical join)");
    SKV_CF_CHECK_CUDA(cudaStreamWaitEvent(f->st, f->cc_ev_join, 0), "cudaStreamWaitEvent (canonical join)");
    return SKV_OK;
}

/* The double-buffered token blocks of steps 2 and 4: block j's input (digit planes, fixed-point
   rows) is written on the side stream into buffer j mod nbuf, its GEMMs read it on f->st. The
   writer of block j first waits (nbuf <= j) on the event recorded on f->st after block j - nbuf's
   GEMMs, the last readers of that buffer (skv_cc_blk_free), and records ready[j mod 2] on the
   side stream after it (skv_cc_blk_ready); f->st waits on that before block j's GEMMs
   (skv_cc_blk_wait). Events by parity: ready[j mod 2] is recorded again only for block j + 2, which
   is enqueued after f->st's wait for block j; free[j mod 2] is waited on right after its record. */
static skv_status skv_cc_blk_before(skv_cuda_factor *f, int64_t j, int nbuf, char *msg, size_t cap)
{
    if (j >= nbuf)
        SKV_CF_CHECK_CUDA(cudaStreamWaitEvent(f->cc_side, f->cc_ev_free[(j - nbuf) & 1], 0),
                          "cudaStreamWaitEvent (canonical block buffer free)");
    return SKV_OK;
}

static skv_status skv_cc_blk_ready(skv_cuda_factor *f, int64_t j, char *msg, size_t cap)
{
    SKV_CF_CHECK_CUDA(cudaEventRecord(f->cc_ev_ready[j & 1], f->cc_side), "cudaEventRecord (canonical block ready)");
    return SKV_OK;
}

static skv_status skv_cc_blk_wait(skv_cuda_factor *f, int64_t j, char *msg, size_t cap)
{
    SKV_CF_CHECK_CUDA(cudaStreamWaitEvent(f->st, f->cc_ev_ready[j & 1], 0), "cudaStreamWaitEvent (canonical block ready)");
    return SKV_OK;
}

static skv_status skv_cc_blk_free(skv_cuda_factor *f, int64_t j, char *msg, size_t cap)
{
    SKV_CF_CHECK_CUDA(cudaEventRecord(f->cc_ev_free[j & 1], f->st), "cudaEventRecord (canonical block buffer free)");
    return SKV_OK;
}

/* Block j of the int8 Gram's digit planes (rows [j p.rows, + p.rows) of a), on the side stream
   into buffer j mod p.nbuf, between skv_cc_blk_before and skv_cc_blk_ready. */
static skv_status skv_cc_slice_blk(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, int32_t F, const skv_cc_i8_plan *p,
                                   int8_t *planes, int64_t j, char *msg, size_t cap)
{
    const int32_t d = f->d;
    const int64_t t0 = j * p->rows, rows = n - t0 < p->rows ? n - t0 : p->rows;
    skv_status s;
    if ((s = skv_cc_blk_before(f, j, p->nbuf, msg, cap)) != SKV_OK) return s;
    dim3 gr((unsigned)((p->d4 + SKV_CC_SL_I - 1) / SKV_CC_SL_I), (unsigned)((rows + SKV_CC_SL_T - 1) / SKV_CC_SL_T));
    skv_cc_slice<<<gr, 256, 0, f->cc_side>>>(a + (size_t)t0 * d, rows, d, p->d4, f->cc_e, F, p->s, p->rows,
                                             p->plane_bytes, planes + (size_t)(j % p->nbuf) * p->buf_bytes);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical int8 digit kernel");
    return skv_cc_blk_ready(f, j, msg, cap);
}

/* Step 2: S's upper triangle into g (column major, g[i + j d], i <= j), exact. By int8 tensor
   cores (skv_cuda_canon_i8.h) where the plan fits the scratch (always at d <= 1024 or so, see
   SKV_CC_I8_GROW_CAP) and cuBLAS runs the int8 GEMM, else by skv_cc_gram_f64. Per token block of
   p.rows rows: the digit planes (one kernel, on the side stream), s int8 GEMMs [X_0 .. X_b]^T X_b
   into the int32 products (on f->st, beta = 1 within a chunk of p.chunk_rows rows); per chunk: the
   combine into g (f->st, in block order). One buffer of planes, so the planes of block j + 1 wait
   for block j's GEMMs (skv_cc_blk_*): at n = 64k on the H200 (dev/cuda/canon_i8_probe.cu) two
   buffers of half the rows, the planes of block j + 1 written while block j's GEMMs ran, took
   1.005 ms against 0.941 ms for one (the GEMMs on half the rows lose more than the overlap
   gains). Starts with a fork (the side stream after the scales e); returns with f->st after every
   slice (each is waited on before its GEMMs). */
static skv_status skv_cc_gram(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, int32_t F, double *g, double *blk,
                              char *msg, size_t cap)
{
    const int32_t d = f->d;
    const int sl = skv_cc_i8_slices(F);
    skv_cc_i8_plan p;
    if (!skv_cc_i8_plan_bufs(d, sl, n, f->scratch_bytes, 1, &p)) return skv_cc_gram_f64(f, n, a, F, g, blk, msg, cap);
    int32_t *acc = (int32_t *)f->scratch;
    int8_t *planes = (int8_t *)f->scratch + p.planes_off;
    const int32_t one = 1, zero = 0;
    const int64_t ld = p.rows, nb = (n + p.rows - 1) / p.rows;
    skv_status s;
    if ((s = skv_cc_fork(f, msg, cap)) != SKV_OK) return s;
    for (int64_t j = 0; j < nb && j < p.nbuf; j++)
        if ((s = skv_cc_slice_blk(f, n, a, F, &p, planes, j, msg, cap)) != SKV_OK) return s;
    for (int64_t j = 0; j < nb; j++) {
        const int64_t t0 = j * p.rows, rows = n - t0 < p.rows ? n - t0 : p.rows;
        const int64_t kp = (rows + 15) / 16 * 16; /* the GEMMs' k: zero rows past the block's end */
        const int8_t *pl = planes + (size_t)(j % p.nbuf) * p.buf_bytes;
        if ((s = skv_cc_blk_wait(f, j, msg, cap)) != SKV_OK) return s;
        const int chunk_first = t0 % p.chunk_rows == 0;
        for (int b = 0; b < p.s; b++) {
            /* column major: C [(b+1) d4, d4] = A^T B, A = the planes 0..b ([kp, (b+1) d4], ld), B = plane b */
            cublasStatus_t e = cublasGemmEx(f->blas, CUBLAS_OP_T, CUBLAS_OP_N, (b + 1) * p.d4, p.d4, (int)kp, &one, pl,
                                            CUDA_R_8I, (int)ld, pl + (size_t)b * p.plane_bytes, CUDA_R_8I, (int)ld,
                                            chunk_first ? &zero : &one, acc + p.acc_off[b], CUDA_R_32I, (b + 1) * p.d4,
                                            CUBLAS_COMPUTE_32I, CUBLAS_GEMM_DEFAULT);
            /* a cuBLAS without this int8 GEMM (or shape) refuses it; before the first combine g is untouched:
               the DSYRK path then, from the start (the same S; its kernels in a profile show it), once the
               slices in flight are done (its fixed-point blocks overwrite the planes) */
            if (t0 < p.chunk_rows && (e == CUBLAS_STATUS_NOT_SUPPORTED || e == CUBLAS_STATUS_ARCH_MISMATCH)) {
                if ((s = skv_cc_join(f, msg, cap)) != SKV_OK) return s;
                return skv_cc_gram_f64(f, n, a, F, g, blk, msg, cap);
            }
            SKV_CF_CHECK_BLAS(e, "cublasGemmEx (canonical exact Gram, int8 digits)");
        }
        if ((s = skv_cc_blk_free(f, j, msg, cap)) != SKV_OK) return s;
        if (t0 + rows >= n || (t0 + rows) % p.chunk_rows == 0) {
            dim3 th(SKV_CC_CB, 8), gr((unsigned)((d + SKV_CC_CB - 1) / SKV_CC_CB), (unsigned)((d + SKV_CC_CB - 1) / SKV_CC_CB));
            skv_cc_combine<<<gr, th, 0, f->st>>>(acc, p, d, t0 < p.chunk_rows, g);
            SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical int8 Gram combine kernel");
        }
        if (j + p.nbuf < nb && (s = skv_cc_slice_blk(f, n, a, F, &p, planes, j + p.nbuf, msg, cap)) != SKV_OK) return s;
    }
    return SKV_OK;
}

/* g [d, d]: the cuBLAS upper triangle (column major: row i <= column j at g[i + j d]) of S, into G,
   both triangles (G is symmetric: row- and column-major alike). */
static __global__ void skv_cc_gscale(double *__restrict__ g, int32_t d, const int32_t *__restrict__ e, int32_t F)
{
    int64_t count = (int64_t)d * d;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < count; k += (int64_t)gridDim.x * blockDim.x) {
        int32_t i = (int32_t)(k % d), j = (int32_t)(k / d);
        if (i > j) continue;
        double v = __dmul_rn(g[k], skv_canon_pow2(e[i] + e[j] - 2 * F));
        g[k] = v;
        g[(int64_t)i * d + j] = v;
    }
}

/* X_0 [d, r] row major. */
static __global__ void skv_cc_start(double *__restrict__ x, int32_t d, int32_t r)
{
    int64_t count = (int64_t)d * r;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < count; k += (int64_t)gridDim.x * blockDim.x)
        x[k] = skv_factor_start(k / r, k % r, r);
}

/* ---- step 3 ----------------------------------------------------------------------------- */

#define SKV_CC_CHOL_THREADS 1024

static size_t skv_cc_chol_smem(int32_t p)
{
    return p <= SKV_CC_CHOL_SMEM_R ? (size_t)p * (p + 1) / 2 * sizeof(double) : 0;
}

/*
 * One pass's small part, one thread block: C [p, p] (full, row major) from Y^T Y; eq: D into
 * dsc, C <- C (D_i D_j); trace, s, floor; L [p, p] (row major, lower) = chol(C + s I), right-
 * looking over k in the packed triangle (shared memory, or global scratch lp for large p);
 * written out transposed, l[j p + i] = L_ij, so the solve's lanes read L_jk (j across lanes)
 * contiguously.
 */
static __global__ void __launch_bounds__(SKV_CC_CHOL_THREADS)
    skv_cc_chol(int32_t m, int32_t p, const double *__restrict__ c, int eq, double *__restrict__ dsc,
                double *__restrict__ l, double *__restrict__ lp)
{
    extern __shared__ double sm[];
    __shared__ double sh_fl, sh_s;
    double *t = p <= SKV_CC_CHOL_SMEM_R ? sm : lp;
    const int tid = threadIdx.x, nt = blockDim.x;
    if (eq)
        for (int j = tid; j < p; j += nt) dsc[j] = skv_canon_dscale(c[(int64_t)j * p + j]);
    __syncthreads();
    /* packed lower triangle: (i, j), j <= i, at i (i + 1) / 2 + j */
    for (int64_t k = tid; k < (int64_t)p * p; k += nt) {
        int32_t i = (int32_t)(k / p), j = (int32_t)(k % p);
        if (j > i) continue;
        double v = c[k];
        if (eq) v = __dmul_rn(v, __dmul_rn(dsc[i], dsc[j]));
        t[(int64_t)i * (i + 1) / 2 + j] = v;
    }
    __syncthreads();
    if (tid == 0) {
        double tr = 0.0;
        for (int32_t j = 0; j < p; j++) tr = __dadd_rn(tr, t[(int64_t)j * (j + 1) / 2 + j]);
        double s = skv_canon_shift(m, p, tr);
        sh_s = s;
        sh_fl = skv_canon_floor(p, tr, s);
    }
    __syncthreads();
    const double s = sh_s, fl = sh_fl;
    for (int32_t j = tid; j < p; j += nt) t[(int64_t)j * (j + 1) / 2 + j] = __dadd_rn(t[(int64_t)j * (j + 1) / 2 + j], s);
    __syncthreads();
    for (int32_t j = 0; j < p; j++) {
        /* column j: every element has seen its updates k < j */
        if (tid == 0) {
            int64_t jj = (int64_t)j * (j + 1) / 2 + j;
            t[jj] = skv_canon_pivot(t[jj], fl);
        }
        __syncthreads();
        const double ljj = t[(int64_t)j * (j + 1) / 2 + j];
        for (int32_t i = j + 1 + tid; i < p; i += nt) {
            int64_t ij = (int64_t)i * (i + 1) / 2 + j;
            t[ij] = __ddiv_rn(t[ij], ljj);
        }
        __syncthreads();
        /* update k = j of the trailing triangle: (i, q), j < q <= i; a warp per row i, lanes over q */
        for (int32_t i = j + 1 + tid / 32; i < p; i += nt / 32) {
            const int64_t ib = (int64_t)i * (i + 1) / 2;
            const double lij = -t[ib + j];
            for (int32_t q = j + 1 + (tid & 31); q <= i; q += 32)
                t[ib + q] = __fma_rn(lij, t[(int64_t)q * (q + 1) / 2 + j], t[ib + q]);
        }
        __syncthreads();
    }
    for (int64_t k = tid; k < (int64_t)p * p; k += nt) { /* l[j p + i] = L_ij: L^T, row major */
        int32_t i = (int32_t)(k / p), j = (int32_t)(k % p);
        l[(int64_t)j * p + i] = j <= i ? t[(int64_t)i * (i + 1) / 2 + j] : 0.0;
    }
}

/*
 * X [m, p] = Y L^-T (x may alias y); eq: Y's columns scaled by dsc first. One warp per row t,
 * right-looking over k: lane owns j = lane + 32 q; x_tk = acc_k / L_kk is broadcast, then every
 * acc_j (j > k) gets fma(-x_tk, L_jk, acc_j): each element's chain in order of k.
 */
#define SKV_CC_SOLVE_MAXQ 32 /* p <= 32 * this */
template <int Q>
static __global__ void __launch_bounds__(128)
    skv_cc_solve(int32_t m, int32_t p, const double *y, const double *__restrict__ l, int eq,
                 const double *__restrict__ dsc, double *x)
{
    const int lane = threadIdx.x & 31;
    const int64_t t = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (t >= m) return;
    double acc[Q];
#pragma unroll
    for (int q = 0; q < Q; q++) {
        int32_t j = lane + 32 * q;
        double v = j < p ? y[t * p + j] : 0.0;
        acc[q] = eq && j < p ? __dmul_rn(v, dsc[j]) : v;
    }
    for (int32_t k = 0; k < p; k++) {
        const int owner = k & 31, qk = k >> 5;
        double mine = 0.0;
#pragma unroll
        for (int q = 0; q < Q; q++)
            if (q == qk) mine = acc[q];
        double xk = __ddiv_rn(__shfl_sync(0xffffffffu, mine, owner), l[(int64_t)k * p + k]);
        const double *lk = l + (int64_t)k * p; /* lk[j] = L_jk */
        if (lane == owner) x[t * p + k] = xk;
#pragma unroll
        for (int q = 0; q < Q; q++) {
            int32_t j = lane + 32 * q;
            if (j > k && j < p) acc[q] = __fma_rn(-xk, lk[j], acc[q]);
        }
    }
}

/* ---- step 4 ----------------------------------------------------------------------------- */

/* w [r, d] = (float) Q^T; f[j] = ex(max_i |Q_ij 2^(e_i - F)|); yq [d, r] = rne(Q' 2^(Gb - f_j)). One
   block per column j. */
static __global__ void __launch_bounds__(256)
    skv_cc_qfix(const double *__restrict__ q, int32_t d, int32_t r, const int32_t *__restrict__ e, int32_t F,
                int32_t Gb, float *__restrict__ w, int32_t *__restrict__ f, double *__restrict__ yq)
{
    __shared__ double red[256];
    const int32_t j = blockIdx.x;
    double mx = 0.0;
    for (int32_t i = threadIdx.x; i < d; i += blockDim.x) {
        double qij = q[(int64_t)i * r + j];
        w[(int64_t)j * d + i] = (float)qij;
        double v = fabs(__dmul_rn(qij, skv_canon_pow2(e[i] - F)));
        mx = v > mx ? v : mx;
    }
    red[threadIdx.x] = mx;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) { /* max: any order */
        if ((int)threadIdx.x < s) red[threadIdx.x] = red[threadIdx.x + s] > red[threadIdx.x] ? red[threadIdx.x + s] : red[threadIdx.x];
        __syncthreads();
    }
    const int32_t fj = skv_canon_ex_f64(red[0]);
    if (threadIdx.x == 0) f[j] = fj;
    for (int32_t i = threadIdx.x; i < d; i += blockDim.x)
        yq[(int64_t)i * r + j] = rint(skv_canon_scale(__dmul_rn(q[(int64_t)i * r + j], skv_canon_pow2(e[i] - F)), Gb - fj));
}

/* ---- the driver ------------------------------------------------------------------------- */

/* One pass on Y [m, p] (device, row major) into X (may alias Y). */
static skv_status skv_cc_pass(skv_cuda_factor *f, int32_t m, int32_t p, double *y, double *x, int eq, char *msg,
                              size_t cap)
{
    if (m % 4 == 0) { /* C = Y^T Y, its lower triangle's tiles, on the fp64 tensor cores */
        dim3 gr((p + SKV_CC_YY_TC_BN - 1) / SKV_CC_YY_TC_BN, (p + SKV_CC_YY_TC_BM - 1) / SKV_CC_YY_TC_BM);
        skv_cc_mm_tc<SKV_CC_YY_TC_CFG><<<gr, SKV_CC_YY_TC_NT, 0, f->st>>>(p, p, m, y, p, y, p, f->cc_c, p, 1);
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical Y^T Y kernel (tensor cores)");
    } else { /* the same chains by fma */
        dim3 gr((p + SKV_CC_YY_BN - 1) / SKV_CC_YY_BN, (p + SKV_CC_YY_BM - 1) / SKV_CC_YY_BM);
        skv_cc_mm<SKV_CC_YY_CFG><<<gr, SKV_CC_YY_NT, 0, f->st>>>(p, p, m, y, p, y, p, f->cc_c, p, 1);
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical Y^T Y kernel");
    }
    int qn = (p + 31) / 32;
    if (qn <= SKV_CC_FCHOL_MAXS) {
#define SKV_CC_FCHOL_CASE(S)                                                                                  \
    case S:                                                                                                   \
        skv_cc_fchol<S><<<1, SKV_CC_FCHOL_THREADS, 0, f->st>>>(m, p, f->cc_c, eq, f->cc_dsc, f->cc_l);        \
        break;
        switch (qn) {
            SKV_CC_FCHOL_CASE(1) SKV_CC_FCHOL_CASE(2) SKV_CC_FCHOL_CASE(3) SKV_CC_FCHOL_CASE(4) SKV_CC_FCHOL_CASE(5)
        }
#undef SKV_CC_FCHOL_CASE
    } else
        skv_cc_chol<<<1, SKV_CC_CHOL_THREADS, skv_cc_chol_smem(p), f->st>>>(m, p, f->cc_c, eq, f->cc_dsc, f->cc_l,
                                                                             f->cc_lp);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical Cholesky kernel");
    if (qn <= SKV_CC_FSOLVE_MAXQ) {
        unsigned fblocks = (unsigned)((m + SKV_CC_FSOLVE_WARPS - 1) / SKV_CC_FSOLVE_WARPS);
        size_t sm = skv_cc_fsolve_smem(p);
#define SKV_CC_FSOLVE_CASE(Q)                                                                                 \
    case Q:                                                                                                   \
        skv_cc_fsolve<Q><<<fblocks, 32 * SKV_CC_FSOLVE_WARPS, sm, f->st>>>(m, p, y, f->cc_l, eq, f->cc_dsc, x); \
        break;
        switch (qn) {
            SKV_CC_FSOLVE_CASE(1) SKV_CC_FSOLVE_CASE(2) SKV_CC_FSOLVE_CASE(3) SKV_CC_FSOLVE_CASE(4)
            SKV_CC_FSOLVE_CASE(5)
        }
#undef SKV_CC_FSOLVE_CASE
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical solve kernel");
        return SKV_OK;
    }
    unsigned blocks = (unsigned)((m + 3) / 4);
#define SKV_CC_SOLVE_CASE(Q)                                                                                 \
    case Q: skv_cc_solve<Q><<<blocks, 128, 0, f->st>>>(m, p, y, f->cc_l, eq, f->cc_dsc, x); break;
    switch (qn) {
        SKV_CC_SOLVE_CASE(1) SKV_CC_SOLVE_CASE(2) SKV_CC_SOLVE_CASE(3) SKV_CC_SOLVE_CASE(4) SKV_CC_SOLVE_CASE(5)
        SKV_CC_SOLVE_CASE(6) SKV_CC_SOLVE_CASE(7) SKV_CC_SOLVE_CASE(8)
    default:
        if (qn <= 16) skv_cc_solve<16><<<blocks, 128, 0, f->st>>>(m, p, y, f->cc_l, eq, f->cc_dsc, x);
        else skv_cc_solve<SKV_CC_SOLVE_MAXQ><<<blocks, 128, 0, f->st>>>(m, p, y, f->cc_l, eq, f->cc_dsc, x);
    }
#undef SKV_CC_SOLVE_CASE
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical solve kernel");
    return SKV_OK;
}

/* Block j of U's fixed-point rows (rows [j ur, + ur) of a), on the side stream into ub[j mod nbuf],
   between skv_cc_blk_before and skv_cc_blk_ready. */
static skv_status skv_cc_ufix_blk(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, int32_t F, int64_t ur, int nbuf,
                                  double *const *ub, int64_t j, char *msg, size_t cap)
{
    const int32_t d = f->d;
    const int64_t t0 = j * ur, rows = n - t0 < ur ? n - t0 : ur;
    skv_status s;
    if ((s = skv_cc_blk_before(f, j, nbuf, msg, cap)) != SKV_OK) return s;
    skv_cc_fix_launch(a + (size_t)t0 * d, rows, d, f->cc_e, F, ub[j % nbuf], f->cc_side);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical fixed-point kernel");
    return skv_cc_blk_ready(f, j, msg, cap);
}

/* skv_cf_canonical's steps; the side stream may still run when it returns early (an error). */
static skv_status skv_cf_canonical_steps(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, float *u, float *w,
                                         char *msg, size_t cap)
{
    const int32_t d = f->d, r = f->r, F = skv_canon_frac_bits(n), Gb = skv_canon_u_bits(n, d);
    if (r > 32 * SKV_CC_SOLVE_MAXQ) {
        if (msg && cap) snprintf(msg, cap, "cuda factorize: canonical route: r = %d > %d", (int)r, 32 * SKV_CC_SOLVE_MAXQ);
        return SKV_ERR_UNSUPPORTED;
    }
    const double one = 1.0, zero = 0.0;
    double *g = f->cc_g, *blk = (double *)f->scratch;
    /* step 4's token blocks: nbuf buffers of ur fixed-point rows, then T (the scratch as sized at create) */
    const int64_t ur = f->canon_urows, nbu = (n + ur - 1) / ur;
    const int nbuf = f->canon_ubufs;
    double *const ub[2] = {blk, nbuf > 1 ? blk + (size_t)ur * d : blk}, *tb = blk + (size_t)nbuf * ur * d;
    skv_status s;
    /* 1 */
    SKV_CF_CHECK_CUDA(cudaMemsetAsync(f->cc_colmax, 0, (size_t)d * sizeof(unsigned), f->st), "cudaMemsetAsync (column max)");
    {
        if (d % 8 == 0 && (uintptr_t)a % 16 == 0) {
            const unsigned gx = (unsigned)((d / 8 + 31) / 32);
            int64_t gy = 1024 / gx, rows8 = (n + 7) / 8;
            if (gy > rows8) gy = rows8;
            if (gy < 1) gy = 1;
            skv_cc_colmax8<<<dim3(gx, (unsigned)gy), dim3(32, 8), 0, f->st>>>(a, n, d, f->cc_colmax);
        } else {
            dim3 gr((unsigned)((d + 255) / 256), (unsigned)(n < 256 ? n : 256));
            skv_cc_colmax<<<gr, 256, 0, f->st>>>(a, n, d, f->cc_colmax);
        }
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical column max kernel");
        skv_cc_scales<<<(d + 255) / 256, 256, 0, f->st>>>(f->cc_colmax, d, f->cc_e);
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical scales kernel");
    }
    /* 2 */
    if ((s = skv_cc_gram(f, n, a, F, g, blk, msg, cap)) != SKV_OK) return s;
    /* step 4's first blocks of fixed-point rows need only A and e: on the side stream now, beside the
       iteration. The Gram is done with the scratch (its last readers, the combine or DSYRK, are on
       f->st before this fork); nothing in steps 3 and 4 before the DGEMMs uses the scratch. */
    if ((s = skv_cc_fork(f, msg, cap)) != SKV_OK) return s;
    for (int64_t j = 0; j < nbu && j < nbuf; j++)
        if ((s = skv_cc_ufix_blk(f, n, a, F, ur, nbuf, ub, j, msg, cap)) != SKV_OK) return s;
    skv_cc_gscale<<<skv_cf_blocks((int64_t)d * d), SKV_CF_THREADS, 0, f->st>>>(g, d, f->cc_e, F);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical Gram scale kernel");
    /* 3 */
    double *x = f->cc_x, *y = f->cc_y;
    skv_cc_start<<<skv_cf_blocks((int64_t)d * r), SKV_CF_THREADS, 0, f->st>>>(x, d, r);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical start kernel");
    for (int it = 0; it < SKV_CANON_ITERS; it++) {
        /* A^T = G itself: G is symmetric bit for bit (skv_cc_gscale) */
        if (d % 4 == 0) { /* on the fp64 tensor cores (skv_cc_mm_tc: the same chains) */
            dim3 gr((r + SKV_CC_GX_TC_BN - 1) / SKV_CC_GX_TC_BN, (d + SKV_CC_GX_TC_BM - 1) / SKV_CC_GX_TC_BM);
            skv_cc_mm_tc<SKV_CC_GX_TC_CFG><<<gr, SKV_CC_GX_TC_NT, 0, f->st>>>(d, r, d, g, d, x, r, y, r, 0);
        } else {
            dim3 gr((r + SKV_CC_GX_BN - 1) / SKV_CC_GX_BN, (d + SKV_CC_GX_BM - 1) / SKV_CC_GX_BM);
            skv_cc_mm<SKV_CC_GX_CFG><<<gr, SKV_CC_GX_NT, 0, f->st>>>(d, r, d, g, d, x, r, y, r, 0);
        }
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical G X kernel");
        if (it < SKV_CANON_TWO_PASS_ITERS) {
            if ((s = skv_cc_pass(f, d, r, y, y, 0, msg, cap)) != SKV_OK) return s;
            if ((s = skv_cc_pass(f, d, r, y, x, 0, msg, cap)) != SKV_OK) return s;
        } else if ((s = skv_cc_pass(f, d, r, y, x, 1, msg, cap)) != SKV_OK)
            return s;
    }
    for (int k = 0; k < SKV_CANON_FINAL_PASSES; k++)
        if ((s = skv_cc_pass(f, d, r, x, x, 0, msg, cap)) != SKV_OK) return s;
    /* 4: y <- the fixed-point Q (row major [d, r] = column major [r, d], ld r) */
    skv_cc_qfix<<<r, 256, 0, f->st>>>(x, d, r, f->cc_e, F, Gb, w, f->cc_f, y);
    SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical fixed-point Q kernel");
    /* per block: its fixed-point rows (side stream), T = X_blk Yq (f->st, after them), U; block
       j + nbuf's rows into the same buffer once block j's DGEMM is done with it (skv_cc_blk_*) */
    for (int64_t j = 0; j < nbu; j++) {
        const int64_t t0 = j * ur, rows = n - t0 < ur ? n - t0 : ur;
        if ((s = skv_cc_blk_wait(f, j, msg, cap)) != SKV_OK) return s;
        /* column major: T^T [r, rows] = Yq^T [r, d] X_blk^T [d, rows] */
        SKV_CF_CHECK_BLAS(cublasDgemm(f->blas, CUBLAS_OP_N, CUBLAS_OP_N, r, (int)rows, d, &one, y, r, ub[j % nbuf], d,
                                      &zero, tb, r),
                          "cublasDgemm (canonical exact U)");
        if ((s = skv_cc_blk_free(f, j, msg, cap)) != SKV_OK) return s;
        {
            const unsigned gx = (unsigned)((r + 31) / 32);
            int64_t gy = 2048 / gx, rows8 = (rows + 7) / 8;
            if (gy > rows8) gy = rows8;
            if (gy < 1) gy = 1;
            skv_cc_uscale<<<dim3(gx, (unsigned)gy), dim3(32, 8), 0, f->st>>>(tb, rows, r, f->cc_f, Gb, u + (size_t)t0 * r);
        }
        SKV_CF_CHECK_CUDA(cudaGetLastError(), "canonical U scale kernel");
        if (j + nbuf < nbu && (s = skv_cc_ufix_blk(f, n, a, F, ur, nbuf, ub, j + nbuf, msg, cap)) != SKV_OK) return s;
    }
    return SKV_OK;
}

/* The canonical route (n <= f->n_max, r <= min(n, d), checked by the caller). Ordered on f->st
   at entry and exit: the side stream's work waits on f->st (skv_cc_fork) and f->st, at the end,
   on all of it (skv_cc_join, also after an error, so that no kernel of this call still runs on
   the side stream once f->st has caught up). */
skv_status skv_cf_canonical(skv_cuda_factor *f, int64_t n, const skv_bf16 *a, float *u, float *w, char *msg,
                                   size_t cap)
{
    skv_status s = skv_cf_canonical_steps(f, n, a, u, w, msg, cap);
    skv_status j = skv_cc_join(f, s == SKV_OK ? msg : NULL, s == SKV_OK ? cap : 0);
    return s != SKV_OK ? s : j;
}

skv_status skv_cf_canonical_smem(int32_t r, char *msg, size_t cap)
{
    skv_status s;
    cudaError_t e = cudaFuncSetAttribute(skv_cc_chol, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)skv_cc_chol_smem(r < SKV_CC_CHOL_SMEM_R ? r : SKV_CC_CHOL_SMEM_R));
    if ((s = skv_cf_cuda(e, "cudaFuncSetAttribute (canonical Cholesky shared memory)", msg, cap)) != SKV_OK) return s;
    /* the fast solve keeps L's packed lower triangle in shared memory (~101 KiB at r = 160); the
       limit is per function, shared by every factor: its largest size whatever this r */
    int fs = (int)skv_cc_fsolve_smem(32 * SKV_CC_FSOLVE_MAXQ);
    e = cudaFuncSetAttribute(skv_cc_fsolve<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, fs);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(skv_cc_fsolve<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, fs);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(skv_cc_fsolve<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, fs);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(skv_cc_fsolve<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, fs);
    if (e == cudaSuccess) e = cudaFuncSetAttribute(skv_cc_fsolve<5>, cudaFuncAttributeMaxDynamicSharedMemorySize, fs);
    if ((s = skv_cf_cuda(e, "cudaFuncSetAttribute (canonical solve shared memory)", msg, cap)) != SKV_OK) return s;
    return SKV_OK;
}
