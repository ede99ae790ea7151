/*
 * chol_skip.cuh - the timing probe's copy of skv_cf_chol (cuda/skv_cuda_chol.cuh, which documents
 * it) with parts switched off by SKIP, to time what is left: 1 skips the diagonal factorizations,
 * 2 the trailing updates, 3 both. SKIP = 0 is the library's kernel; keep the two in step when
 * the library's changes.
 */
#ifndef SKV_PROBE_CHOL_SKIP_CUH
#define SKV_PROBE_CHOL_SKIP_CUH

#include "skv_cuda_chol.cuh"

template <int SKIP> /* 0: the library's kernel; 1 skips the diagonal factorizations, 2 the trailing updates */
static __global__ void __launch_bounds__(SKV_CF_CHOL_THREADS, 1)
    probe_chol_skip(double *__restrict__ c, int32_t p, int32_t d, int check, int scaled, const double *__restrict__ g,
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

#endif
