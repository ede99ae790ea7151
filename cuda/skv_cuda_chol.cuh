/*
 * skv_cuda_chol.cuh - the r x r steps of the cuda factorization's FAST route (lib/skv_factor.h)
 * on the fp64 tensor cores: the shifted, floored Cholesky of C = Y^T Y (one thread block) and
 * the solve Y R^-1 = Y L^-T (a warp per 8 rows). Included by cuda/skv_cuda_factor_fast.cu and by
 * the timing probe dev/cuda/chol_probe.cu.
 *
 * Both work on 8 x 8 tiles, p <= SKV_FACTOR_FAST_MAX_R padded to nt = ceil(p / 8) tiles:
 * the lower triangle of L in tiles (I, J), I >= J, tile t = I (I + 1) / 2 + J, row-major
 * within a tile with swizzled columns (skv_cf_at), then the inverses of the nt diagonal
 * tiles (lower, same layout): SKV_CF_LT_DOUBLES(nt) doubles, in shared memory and in a
 * global copy for the solve.
 *
 * mma.sync m8n8k4 f64 fragments (a warp): A 8 x 4 row-major, lane l holds A[l / 4][l % 4];
 * B 4 x 8 column-major, lane l holds B[l % 4][l / 4]; C and D 8 x 8, lane l holds
 * D[l / 4][2 (l % 4) + {0, 1}]. An 8 x 8 x 8 product is two of them (k = 0..3, 4..7).
 */
#ifndef SKV_CUDA_CHOL_CUH
#define SKV_CUDA_CHOL_CUH

#include <limits.h>

#include "skv_cuda_common.cuh"
#include "skv_factor.h"

#define SKV_CF_MAXT ((SKV_FACTOR_FAST_MAX_R + 7) / 8)
#define SKV_CF_TILES(nt) ((nt) * ((nt) + 1) / 2)
#define SKV_CF_LT_DOUBLES(nt) ((size_t)(SKV_CF_TILES(nt) + (nt)) * 64)
#define SKV_CF_CHOL_THREADS 512
#define SKV_CF_SOLVE_WARPS 8

/* d (2 values of an 8 x 8 fragment) += a b, one m8n8k4 step */
__device__ __forceinline__ void skv_cf_dmma(double &d0, double &d1, double a, double b)
{
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                 : "+d"(d0), "+d"(d1)
                 : "d"(a), "d"(b));
}

__device__ __forceinline__ int skv_cf_tile(int I, int J) { return I * (I + 1) / 2 + J; }

/* Element (i, j) of a tile: row-major with columns XOR-swizzled by 4 in rows 2, 3, 6, 7, so that
   a fragment's 8 rows x 4 columns fall on distinct bank pairs but for pairs of rows (2 wavefronts,
   the least for 32 doubles) instead of 4 rows. */
__host__ __device__ __forceinline__ int skv_cf_at(int i, int j) { return i * 8 + (j ^ ((i << 1) & 4)); }

/*
 * d += sgn * X Z^T for 8 x 8 row-major tiles X, Z (shared memory): D[r][n] += sgn sum_k
 * X[r][k] Z[n][k]. A = X (lane: X[l/4][l%4 + 4h]), B[k][n] = Z[n][k] (lane: Z[l/4][l%4 + 4h]).
 */
__device__ __forceinline__ void skv_cf_mma_xzt(double &d0, double &d1, const double *x, const double *z, int lane,
                                               double sgn)
{
    const int r = lane >> 2, k = lane & 3;
    skv_cf_dmma(d0, d1, sgn * x[skv_cf_at(r, k)], z[skv_cf_at(r, k)]);
    skv_cf_dmma(d0, d1, sgn * x[skv_cf_at(r, k + 4)], z[skv_cf_at(r, k + 4)]);
}

/*
 * One 8 x 8 diagonal block, by one warp: a (row-major, lower triangle read) <- L with
 * a = L L^T, pivots floored at flr, and z <- L^-1 (lower, row-major). Every lane factors the
 * block in registers (the same instructions, so no lane waits on another); lane j < 8 also
 * runs the forward substitution L z_j = e_j alongside, one step behind each pivot, and
 * stores column j of L and of L^-1. The dependent chain is one reciprocal square root, one
 * product and one fma per pivot. Returns (in every lane) 0, or the index (1-based, within
 * the block) of the first pivot that was not finite.
 */
__device__ __forceinline__ int skv_cf_chol8(double *a, double *z, double flr, int lane)
{
    const int j = lane & 7;
    int bad = 0;
    double l[8][8], w[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
#pragma unroll
        for (int c = 0; c <= i; c++) l[i][c] = a[skv_cf_at(i, c)];
        w[i] = i == j ? 1.0 : 0.0;
    }
    __syncwarp(); /* every lane has read a before any lane writes it */
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const double raw = l[k][k];
        if (!bad && !isfinite(raw)) bad = k + 1;
        const double piv = raw >= flr ? raw : flr;
        const double inv = rsqrt(piv);
#pragma unroll
        for (int i = k + 1; i < 8; i++) l[i][k] *= inv;
        /* the next pivot first: it is the chain */
        if (k + 1 < 8) l[k + 1][k + 1] = fma(-l[k + 1][k], l[k + 1][k], l[k + 1][k + 1]);
#pragma unroll
        for (int c = k + 1; c < 8; c++)
#pragma unroll
            for (int i = c; i < 8; i++)
                if (!(i == k + 1 && c == k + 1)) l[i][c] = fma(-l[i][k], l[c][k], l[i][c]);
        l[k][k] = piv * inv;
        w[k] *= inv; /* z_j[k] (0 for k < j: w[k] stays 0) */
#pragma unroll
        for (int i = k + 1; i < 8; i++) w[i] = fma(-l[i][k], w[k], w[i]);
    }
    if (lane < 8) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            double v = 0.0; /* l[i][j] without a dynamic register index */
#pragma unroll
            for (int c = 0; c <= i; c++) v = c == j ? l[i][c] : v;
            a[skv_cf_at(i, j)] = v;
            z[skv_cf_at(i, j)] = i < j ? 0.0 : w[i];
        }
    }
    __syncwarp();
    return bad;
}

/*
 * Shifted, floored Cholesky of one p x p block (p <= SKV_FACTOR_FAST_MAX_R), one block of
 * SKV_CF_CHOL_THREADS threads, SKV_CF_LT_DOUBLES(SKV_CF_MAXT) doubles of dynamic shared memory:
 *   c    the symmetric matrix C (column-major; the lower triangle is read);
 *   scaled  1: equilibrate first (lib/skv_factor.h orth_e): C <- D C D, D = diag(C)^-1/2
 *        (1 where C_jj = 0), then the shift and the floor of that matrix;
 *   lt   out: L (C + s I = L L^T) and the inverses of its diagonal tiles, tiled (see the
 *        top of the file), then ||L||_F^2 (check = 1; else 0), then D (p doubles, 1 when
 *        not scaled):
 *        SKV_CF_LT_DOUBLES(nt) + 1 + p doubles;
 *   s    check = 0: skv_factor_shift(d, p, tr C) (Cholesky QR of Y^T Y);
 *        check = 1: delta + skv_factor_rq_shift(tr C + p delta), delta =
 *        SKV_FACTOR_GRAM_SHIFT32 tr(g) for the d x d Gram g (H = X^T G X at the check);
 *   info 0, or k + 1 for the first pivot that is not finite.
 * Pivots below SKV_FACTOR_PIVOT_FLOOR (tr C + p s) are raised to it (NaN too), as in the
 * cpu backend, so L always exists.
 *
 * Blocked right-looking, one tile column per step: the warps turn the tiles below the
 * diagonal into L (L_IP = A_IP L_PP^-T) and update the trailing tiles (A_IJ -= L_IP L_JP^T),
 * on the tensor cores; warp 0 updates the next diagonal tile first and factors and inverts
 * it (skv_cf_chol8) while the others finish the trailing update. Two barriers per step.
 */
/* The body of skv_cf_chol. SKIP (dev/cuda/chol_probe.cu's timing breakdown only; the library's kernel
   is SKIP = 0, where every test folds away): 1 skips the diagonal factorizations, 2 the trailing
   updates, 3 both. */
template <int SKIP>
static __device__ __forceinline__ void skv_cf_chol_body(double *__restrict__ c, int32_t p, int32_t d, int check,
                                                        int scaled, const double *__restrict__ g,
                                                        double *__restrict__ lt, int *__restrict__ info)
{
    extern __shared__ double sm[];
    __shared__ double red[SKV_CF_CHOL_THREADS / 32];
    __shared__ int first_bad;
    __shared__ unsigned char tile_i[SKV_CF_TILES(SKV_CF_MAXT)], tile_j[SKV_CF_TILES(SKV_CF_MAXT)];
    __shared__ double dsc[SKV_CF_MAXT * 8]; /* equilibration D (1 when not scaled) */
    constexpr int NT = SKV_CF_CHOL_THREADS, NW = NT / 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nt = (p + 7) / 8, ntiles = SKV_CF_TILES(nt);
    double *tl = sm, *dinv = sm + (size_t)ntiles * 64;

    /* D, the shift and the floor (fixed-order sums: every thread gets the same values) */
    double tc = 0.0, tg = 0.0, s;
    for (int32_t j = tid; j < p; j += NT) {
        const double cjj = c[(size_t)j * p + j], dj = scaled && cjj > 0.0 ? 1.0 / sqrt(cjj) : 1.0;
        dsc[j] = dj;
        tc += cjj * dj * dj;
    }
    tc = warp_sum(tc);
    if (lane == 0) red[warp] = tc;
    __syncthreads();
    tc = 0.0;
    for (int w = 0; w < NW; w++) tc += red[w];
    __syncthreads();
    if (check) {
        for (int32_t i = tid; i < d; i += NT) tg += g[(size_t)i * d + i];
        tg = warp_sum(tg);
        if (lane == 0) red[warp] = tg;
        __syncthreads();
        tg = 0.0;
        for (int w = 0; w < NW; w++) tg += red[w];
        const double delta = SKV_FACTOR_GRAM_SHIFT32 * tg;
        s = delta + skv_factor_rq_shift(tc + p * delta);
    } else {
        s = skv_factor_shift(d, p, tc);
    }
    const double flr = SKV_FACTOR_PIVOT_FLOOR * (tc + p * s);
    if (tid == 0) first_bad = INT_MAX;

    /* tile coordinates */
    for (int t = tid; t < ntiles; t += NT) {
        int I = 0;
        while ((I + 1) * (I + 2) / 2 <= t) I++;
        tile_i[t] = (unsigned char)I;
        tile_j[t] = (unsigned char)(t - I * (I + 1) / 2);
    }
    __syncthreads();
    /* the lower triangle of D C D + s I into the tiles (padding: the identity), a warp per tile:
       lane l takes rows (l % 8) of columns l / 8 and l / 8 + 4 of the tile; every load of a warp
       issued before its stores */
    const int lr = lane & 7, lc = lane >> 3;
    {
        constexpr int PER = (SKV_CF_TILES(SKV_CF_MAXT) + NW - 1) / NW;
        double x[PER][2];
#pragma unroll
        for (int u = 0; u < PER; u++) {
            const int t = warp + u * NW;
            const int I = t < ntiles ? tile_i[t] : 0, J = t < ntiles ? tile_j[t] : 0, i = I * 8 + lr;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int j = J * 8 + lc + 4 * h;
                x[u][h] = t < ntiles && i >= j && i < p && j < p ? c[(size_t)j * p + i] : 0.0;
            }
        }
#pragma unroll
        for (int u = 0; u < PER; u++) {
            const int t = warp + u * NW;
            if (t < ntiles) {
                const int I = tile_i[t], J = tile_j[t], i = I * 8 + lr;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int jj = lc + 4 * h, j = J * 8 + jj;
                    double v = i == j ? 1.0 : 0.0;
                    if (i >= j && i < p && j < p) v = x[u][h] * dsc[i] * dsc[j] + (i == j ? s : 0.0);
                    tl[(size_t)t * 64 + skv_cf_at(lr, jj)] = i >= j ? v : 0.0;
                }
            }
        }
    }
    __syncthreads();

    const int r = lane >> 2, q2 = 2 * (lane & 3);
    if (warp == 0 && !(SKIP & 1)) {
        const int bad = skv_cf_chol8(tl, dinv, flr, lane);
        if (bad && lane == 0) first_bad = bad;
    }
    __syncthreads();
    for (int P = 0; P < nt; P++) {
        const double *zpp = dinv + (size_t)P * 64;
        /* the tiles below: L_IP = A_IP L_PP^-T, i.e. D[r][n] = sum_k A_IP[r][k] Z[n][k] */
        for (int I = P + 1 + warp; I < nt; I += NW) {
            double *aip = tl + (size_t)skv_cf_tile(I, P) * 64;
            double d0 = 0.0, d1 = 0.0;
            skv_cf_mma_xzt(d0, d1, aip, zpp, lane, 1.0);
            __syncwarp();
            aip[skv_cf_at(r, q2)] = d0;
            aip[skv_cf_at(r, q2 + 1)] = d1;
        }
        __syncthreads();
        /* the trailing tiles: A_IJ -= L_IP L_JP^T, P < J <= I. Warp 0 takes the next diagonal
           tile and factors it at once (lookahead); warps 1.. take every (NW - 1)-th of the rest */
        if (warp == 0) {
            if (P + 1 < nt) {
                const int Q = P + 1;
                double *aqq = tl + (size_t)skv_cf_tile(Q, Q) * 64;
                const double *lqp = tl + (size_t)skv_cf_tile(Q, P) * 64;
                double d0 = aqq[skv_cf_at(r, q2)], d1 = aqq[skv_cf_at(r, q2 + 1)];
                if (!(SKIP & 2)) skv_cf_mma_xzt(d0, d1, lqp, lqp, lane, -1.0);
                aqq[skv_cf_at(r, q2)] = d0;
                aqq[skv_cf_at(r, q2 + 1)] = d1;
                __syncwarp();
                if (!(SKIP & 1)) {
                    const int bad = skv_cf_chol8(aqq, dinv + (size_t)Q * 64, flr, lane);
                    if (bad && lane == 0 && first_bad == INT_MAX) first_bad = Q * 8 + bad;
                }
            }
        } else if (!(SKIP & 2)) {
            /* flattened order of the trailing tiles, column by column; index 0 is (P+1, P+1) */
            int J = P + 1, I = J + warp; /* index warp = 1 + (warp - 1) */
            while (J < nt && I >= nt) I += J + 1 - nt, J++;
            while (J < nt) {
                double *aij = tl + (size_t)skv_cf_tile(I, J) * 64;
                double d0 = aij[skv_cf_at(r, q2)], d1 = aij[skv_cf_at(r, q2 + 1)];
                skv_cf_mma_xzt(d0, d1, tl + (size_t)skv_cf_tile(I, P) * 64, tl + (size_t)skv_cf_tile(J, P) * 64, lane,
                               -1.0);
                aij[skv_cf_at(r, q2)] = d0;
                aij[skv_cf_at(r, q2 + 1)] = d1;
                I += NW - 1;
                while (J < nt && I >= nt) I += J + 1 - nt, J++;
            }
        }
        __syncthreads();
    }

    /* the tiles and inverses into lt; ||L||_F^2 after them (the check's rho; 0 otherwise) */
    for (size_t e = tid; e < SKV_CF_LT_DOUBLES(nt); e += NT) lt[e] = sm[e];
    if (!check) {
        if (tid == 0) lt[SKV_CF_LT_DOUBLES(nt)] = 0.0;
        for (int j = tid; j < p; j += NT) lt[SKV_CF_LT_DOUBLES(nt) + 1 + j] = dsc[j];
    } else {
        double f = 0.0;
        for (int e = tid; e < ntiles * 64; e += NT) { /* the p x p part only (not the padding) */
            const int t = e >> 6, i = tile_i[t] * 8 + ((e & 63) >> 3);
            const int j = tile_j[t] * 8 + ((e & 7) ^ (((e & 63) >> 2) & 4)); /* skv_cf_at inverted */
            if (i < p && j < p) f += tl[e] * tl[e];
        }
        f = warp_sum(f);
        if (lane == 0) red[warp] = f;
        __syncthreads();
        if (tid == 0) {
            double t = 0.0;
            for (int w = 0; w < NW; w++) t += red[w];
            lt[SKV_CF_LT_DOUBLES(nt)] = t;
        }
        for (int j = tid; j < p; j += NT) lt[SKV_CF_LT_DOUBLES(nt) + 1 + j] = dsc[j];
    }
    if (tid == 0) *info = first_bad == INT_MAX ? 0 : first_bad;
}

static __global__ void __launch_bounds__(SKV_CF_CHOL_THREADS, 1)
    skv_cf_chol(double *__restrict__ c, int32_t p, int32_t d, int check, int scaled, const double *__restrict__ g,
                double *__restrict__ lt, int *__restrict__ info)
{
    skv_cf_chol_body<0>(c, p, d, check, scaled, g, lt, info);
}

/*
 * v <- v L^-T (= v R^-1) in place, or v D L^-T when scaled (D from lt): v column-major
 * [m, p] (ld), L from skv_cf_chol (lt, the tiled copy, staged in dynamic shared memory:
 * skv_cf_solve_smem bytes). A warp per 8 rows of v, blockDim.x / 32 warps per block
 * (at most SKV_CF_SOLVE_WARPS), right-looking over the block columns with the rows' T_k in
 * registers (mma accumulator fragments): X_j = T_j L_jj^-T, then T_k -= X_j L_kj^T for
 * every k > j (independent products, so the tensor cores overlap them). X_j changes from
 * the accumulator layout to the A-operand layout by shuffles.
 *   mode  SKV_CF_SOLVE_PLAIN, SKV_CF_SOLVE_SCALED (v D L^-T), or SKV_CF_SOLVE_IDENTITY:
 *         v is not read, the rows of the m x p identity are solved (R^-1 for m = p);
 *   sq    NULL, or out: sq[w] = the sum of squares of the output rows 8 w .. 8 w + 7
 *         (fixed order), one double per warp of the grid (the check's ||R^-1||_F^2).
 */
#define SKV_CF_SOLVE_PLAIN 0
#define SKV_CF_SOLVE_SCALED 1
#define SKV_CF_SOLVE_IDENTITY 2
static __global__ void __launch_bounds__(32 * SKV_CF_SOLVE_WARPS)
    skv_cf_solve_lt(double *__restrict__ v, int64_t m, int64_t ld, int32_t p, const double *__restrict__ lt, int mode,
                    double *__restrict__ sq)
{
    extern __shared__ __align__(16) double sm[];
    __shared__ __align__(8) unsigned long long mbar;
    const int nt = (p + 7) / 8, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t nlt = SKV_CF_LT_DOUBLES(nt);
    const double *tl = sm, *dinv = sm + (size_t)SKV_CF_TILES(nt) * 64;
    /* lt into shared memory with one bulk copy (the tensor memory accelerator), completion
       counted on an mbarrier (nlt * 8 bytes: a multiple of 16, both ends 16-byte aligned) */
    const unsigned bar = (unsigned)__cvta_generic_to_shared(&mbar);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned bytes = (unsigned)(nlt * sizeof(double));
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         (unsigned)__cvta_generic_to_shared(sm)),
                     "l"(lt), "r"(bytes), "r"(bar)
                     : "memory");
    }
    asm volatile("{\n\t.reg .pred done;\n"
                 "SKV_CF_WAIT%=:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n\t"
                 "@!done bra SKV_CF_WAIT%=;\n}" ::"r"(bar)
                 : "memory");
    const int64_t row0 = ((int64_t)blockIdx.x * (blockDim.x >> 5) + warp) * 8;
    if (row0 >= m) return;
    const int r = lane >> 2, kk = lane & 3, q2 = 2 * kk;
    const int64_t row = row0 + r;
    /* A-operand sources: T[r][kk] sits in lane r*4 + kk/2, slot kk % 2; T[r][kk + 4] two lanes on */
    const int src0 = r * 4 + (kk >> 1), src1 = src0 + 2, slot = kk & 1;
    double t0[SKV_CF_MAXT], t1[SKV_CF_MAXT];
    const double *dsc = lt + nlt + 1; /* D of an equilibrated factorization */
    double ss = 0.0;                  /* this lane's sum of squares (sq) */
#pragma unroll
    for (int k = 0; k < SKV_CF_MAXT; k++) {
        const int c0 = k * 8 + q2;
        if (mode == SKV_CF_SOLVE_IDENTITY) {
            t0[k] = k < nt && row < m && c0 < p && row == c0 ? 1.0 : 0.0;
            t1[k] = k < nt && row < m && c0 + 1 < p && row == c0 + 1 ? 1.0 : 0.0;
        } else {
            t0[k] = k < nt && row < m && c0 < p ? v[row + c0 * ld] : 0.0;
            t1[k] = k < nt && row < m && c0 + 1 < p ? v[row + (c0 + 1) * ld] : 0.0;
        }
        if (mode == SKV_CF_SOLVE_SCALED) {
            t0[k] *= k < nt && c0 < p ? dsc[c0] : 0.0;
            t1[k] *= k < nt && c0 + 1 < p ? dsc[c0 + 1] : 0.0;
        }
    }
#pragma unroll
    for (int j = 0; j < SKV_CF_MAXT; j++) {
        if (j < nt) {
            /* X_j = T_j Z_jj^T */
            const double *z = dinv + (size_t)j * 64;
            double u0 = __shfl_sync(kFullMask, t0[j], src0), u1 = __shfl_sync(kFullMask, t1[j], src0);
            double w0 = __shfl_sync(kFullMask, t0[j], src1), w1 = __shfl_sync(kFullMask, t1[j], src1);
            double x0 = 0.0, x1 = 0.0;
            skv_cf_dmma(x0, x1, slot ? u1 : u0, z[skv_cf_at(r, kk)]);
            skv_cf_dmma(x0, x1, slot ? w1 : w0, z[skv_cf_at(r, kk + 4)]);
            const int c0 = j * 8 + q2;
            if (row < m && c0 < p) v[row + c0 * ld] = x0, ss = fma(x0, x0, ss);
            if (row < m && c0 + 1 < p) v[row + (c0 + 1) * ld] = x1, ss = fma(x1, x1, ss);
            /* -X_j as the A operand; T_k -= X_j L_kj^T */
            u0 = __shfl_sync(kFullMask, x0, src0), u1 = __shfl_sync(kFullMask, x1, src0);
            w0 = __shfl_sync(kFullMask, x0, src1), w1 = __shfl_sync(kFullMask, x1, src1);
            const double b0 = -(slot ? u1 : u0), b1 = -(slot ? w1 : w0);
#pragma unroll
            for (int k = j + 1; k < SKV_CF_MAXT; k++)
                if (k < nt) {
                    const double *lkj = tl + (size_t)skv_cf_tile(k, j) * 64;
                    skv_cf_dmma(t0[k], t1[k], b0, lkj[skv_cf_at(r, kk)]);
                    skv_cf_dmma(t0[k], t1[k], b1, lkj[skv_cf_at(r, kk + 4)]);
                }
        }
    }
    if (sq) {
        ss = warp_sum(ss);
        if (lane == 0) sq[row0 >> 3] = ss;
    }
}

static inline size_t skv_cf_solve_smem(int32_t p)
{
    const int nt = (p + 7) / 8;
    return SKV_CF_LT_DOUBLES(nt) * sizeof(double);
}

static inline size_t skv_cf_chol_smem(int32_t p)
{
    return SKV_CF_LT_DOUBLES((p + 7) / 8) * sizeof(double);
}

#endif
