/*
 * skv_cpu_canon.c - the canonical factorization (route SKV_FACTORIZE_CANONICAL,
 * lib/skv_factor_canon.h, docs/DESIGN.md 10.1) on the cpu, bit for bit ref's:
 *   - the exact products (S = X^T X and T = X Y) by OpenBLAS dsyrk/dgemm over
 *     token blocks of the fixed-point A (every partial sum is an exact
 *     integer, so OpenBLAS's order and the split do not matter): the team's
 *     items (tiles of S, rows of T) each make one BLAS call on their thread;
 *   - the ordered chains (G X, Y^T Y, the solve) by AVX2 kernels that put
 *     independent outputs in SIMD lanes and items, each output still one
 *     chain of fmas in order of k (vfmadd is the same single rounding as
 *     fma()); the r x r Cholesky by the header's element rule, compiled with
 *     hardware fma. Without AVX2+FMA the header's reference loops run.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "skv_cpu_ops.h"
#include "skv_factor_canon.h"

#if SKV_CPU_X86
#include <immintrin.h>

/* One 4 x 8 output tile of a chained product: out row i, columns 0..7 = the chain over k = 0..K-1
   of fma(b_i[k * sb], x[k * sx + 0..7], acc), in order from 0 (lanes across the 8 columns; each
   output keeps its own chain). Writes rows 0..rows-1 of the tile, rows ld apart. */
SKV_CPU_AVX2 static inline void skv_cc_tile4x8(const double *const b[4], size_t sb, const double *x, size_t sx,
                                               int32_t K, int rows, double *out, size_t ld)
{
    __m256d a[4][2];
    for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = _mm256_setzero_pd();
    for (int32_t k = 0; k < K; k++) {
        const double *xk = x + (size_t)k * sx;
        __m256d x0 = _mm256_loadu_pd(xk), x1 = _mm256_loadu_pd(xk + 4);
        for (int i = 0; i < 4; i++) {
            __m256d bi = _mm256_broadcast_sd(b[i] + (size_t)k * sb);
            a[i][0] = _mm256_fmadd_pd(bi, x0, a[i][0]);
            a[i][1] = _mm256_fmadd_pd(bi, x1, a[i][1]);
        }
    }
    for (int i = 0; i < rows; i++) {
        _mm256_storeu_pd(out + (size_t)i * ld, a[i][0]);
        _mm256_storeu_pd(out + (size_t)i * ld + 4, a[i][1]);
    }
}

/* The state of one of the jobs below (each a loop over independent outputs). */
typedef struct {
    int32_t d, m, p, nj; /* nj: 8-column tiles */
    const double *g, *x, *l, *y;
    double *out, *buf;
} skv_cc_job;

/* Y [d, p] = G X (lib/skv_factor_canon.h's skv_canon_ref_gx): 4 rows x 8 columns per tile (an item),
   lanes across columns j, the chain over k in order. */
SKV_CPU_AVX2 static void skv_cc_gx_item(void *ctx, int64_t it, int t)
{
    const skv_cc_job *c = ctx;
    int32_t d = c->d, p = c->p, nj = c->nj;
    const double *g = c->g, *x = c->x;
    double *y = c->out;
    (void)t;
    int32_t i0 = (int32_t)(it / nj) * 4, j0 = (int32_t)(it % nj) * 8;
    int32_t rows = d - i0 < 4 ? d - i0 : 4;
    if (j0 + 8 <= p) {
        const double *b[4];
        for (int i = 0; i < 4; i++) b[i] = g + (size_t)(i0 + (i < rows ? i : 0)) * d;
        skv_cc_tile4x8(b, 1, x + j0, (size_t)p, d, rows, y + (size_t)i0 * p + j0, (size_t)p);
    } else
        for (int i = 0; i < rows; i++)
            for (int32_t j = j0; j < p; j++) {
                double acc = 0.0;
                for (int32_t k = 0; k < d; k++) acc = fma(g[(size_t)(i0 + i) * d + k], x[(size_t)k * p + j], acc);
                y[(size_t)(i0 + i) * p + j] = acc;
            }
}

static void skv_cc_gx(int32_t d, int32_t p, const double *g, const double *x, double *y)
{
    skv_cc_job c = {d, 0, p, (p + 7) / 8, g, x, NULL, NULL, y, NULL};
    int64_t items = (int64_t)((d + 3) / 4) * c.nj;
    skv_cpu_run(skv_cpu_team(items), items, skv_cc_gx_item, &c);
}

/* C [p, p] = Y^T Y for Y [m, p] (skv_canon_ref_cross): tiles of 4 x 8 (items) on and above the
   diagonal, lanes across j, the chain over t in order; the lower part mirrored (fma(a, b, c) =
   fma(b, a, c)). */
SKV_CPU_AVX2 static void skv_cc_cross_item(void *ctx, int64_t it, int t)
{
    const skv_cc_job *cj = ctx;
    int32_t m = cj->m, p = cj->p, nj = cj->nj;
    const double *y = cj->y;
    double *c = cj->out;
    (void)t;
    int32_t i0 = (int32_t)(it / nj) * 4, j0 = (int32_t)(it % nj) * 8;
    int32_t rows = p - i0 < 4 ? p - i0 : 4;
    if (j0 + 8 <= i0) return; /* strictly below the diagonal */
    if (j0 + 8 <= p) {
        const double *b[4];
        for (int i = 0; i < 4; i++) b[i] = y + (i0 + (i < rows ? i : 0));
        skv_cc_tile4x8(b, (size_t)p, y + j0, (size_t)p, m, rows, c + (size_t)i0 * p + j0, (size_t)p);
    } else
        for (int i = 0; i < rows; i++)
            for (int32_t j = j0; j < p; j++) {
                double acc = 0.0;
                for (int32_t q = 0; q < m; q++) acc = fma(y[(size_t)q * p + i0 + i], y[(size_t)q * p + j], acc);
                c[(size_t)(i0 + i) * p + j] = acc;
            }
}

static void skv_cc_cross(int32_t m, int32_t p, const double *y, double *c)
{
    skv_cc_job cj = {0, m, p, (p + 7) / 8, NULL, NULL, NULL, y, c, NULL};
    int64_t items = (int64_t)((p + 3) / 4) * cj.nj;
    skv_cpu_run(skv_cpu_team(items), items, skv_cc_cross_item, &cj);
    for (int32_t i = 0; i < p; i++) /* each tile wrote C_ij for all its j >= j0; i > j there is mirrored over */
        for (int32_t j = i + 1; j < p; j++) c[(size_t)j * p + i] = c[(size_t)i * p + j];
}

/* skv_canon_ref_chol with hardware fma (the same element rule). */
SKV_CPU_AVX2 static void skv_cc_chol(int32_t p, const double *c, double s, double fl, double *l)
{
    for (int32_t j = 0; j < p; j++) {
        const double *lj = l + (size_t)j * p;
        double acc = c[(size_t)j * p + j] + s;
        for (int32_t k = 0; k < j; k++) acc = fma(-lj[k], lj[k], acc);
        double ljj = skv_canon_pivot(acc, fl);
        l[(size_t)j * p + j] = ljj;
        for (int32_t i = j + 1; i < p; i++) {
            const double *li = l + (size_t)i * p;
            acc = c[(size_t)i * p + j];
            for (int32_t k = 0; k < j; k++) acc = fma(-li[k], lj[k], acc);
            l[(size_t)i * p + j] = acc / ljj;
        }
    }
}

/* X = Y L^-T (skv_canon_ref_solve, x may alias y): 8 rows at a time (an item), lanes across rows,
   each element's chain over k in order. buf: per thread [p][8]. */
SKV_CPU_AVX2 static void skv_cc_solve_item(void *ctx, int64_t blk, int t)
{
    const skv_cc_job *c = ctx;
    int32_t m = c->m, p = c->p;
    const double *l = c->l, *y = c->y;
    double *x = c->out, *b = c->buf + (size_t)t * p * 8;
    int32_t t0 = (int32_t)blk * 8, rows = m - t0 < 8 ? m - t0 : 8;
    for (int32_t j = 0; j < p; j++)
        for (int i = 0; i < 8; i++) b[(size_t)j * 8 + i] = i < rows ? y[(size_t)(t0 + i) * p + j] : 0.0;
    for (int32_t j = 0; j < p; j++) {
        const double *lj = l + (size_t)j * p;
        __m256d a0 = _mm256_loadu_pd(b + (size_t)j * 8), a1 = _mm256_loadu_pd(b + (size_t)j * 8 + 4);
        for (int32_t k = 0; k < j; k++) {
            __m256d nl = _mm256_broadcast_sd(lj + k);
            a0 = _mm256_fnmadd_pd(_mm256_loadu_pd(b + (size_t)k * 8), nl, a0);
            a1 = _mm256_fnmadd_pd(_mm256_loadu_pd(b + (size_t)k * 8 + 4), nl, a1);
        }
        __m256d dj = _mm256_broadcast_sd(lj + j);
        _mm256_storeu_pd(b + (size_t)j * 8, _mm256_div_pd(a0, dj));
        _mm256_storeu_pd(b + (size_t)j * 8 + 4, _mm256_div_pd(a1, dj));
    }
    for (int i = 0; i < rows; i++)
        for (int32_t j = 0; j < p; j++) x[(size_t)(t0 + i) * p + j] = b[(size_t)j * 8 + i];
}

static void skv_cc_solve(int32_t m, int32_t p, const double *l, const double *y, double *x, double *buf)
{
    skv_cc_job c = {0, m, p, 0, NULL, NULL, l, y, x, buf};
    int64_t nb = (m + 7) / 8;
    skv_cpu_run(skv_cpu_team(nb), nb, skv_cc_solve_item, &c);
}

/* One pass (skv_canon_ref_pass) with the kernels above. ws: 2 p^2 + p doubles; buf: threads x
   8 p doubles. */
SKV_CPU_AVX2 static void skv_cc_pass(int32_t m, int32_t p, double *y, double *x, int eq, double *ws, double *buf)
{
    double *c = ws, *l = ws + (size_t)p * p, *dsc = l + (size_t)p * p, s, fl;
    skv_cc_cross(m, p, y, c);
    if (eq) skv_canon_ref_equilibrate(m, p, c, y, dsc);
    skv_canon_ref_shift(m, p, c, &s, &fl);
    skv_cc_chol(p, c, s, fl, l);
    skv_cc_solve(m, p, l, y, x, buf);
}

/* skv_canon_ref_subspace with the kernels above. */
SKV_CPU_AVX2 static void skv_cc_subspace(int32_t d, int32_t r, const double *g, double *q, double *y, double *ws,
                                         double *buf)
{
    for (int32_t i = 0; i < d; i++)
        for (int32_t j = 0; j < r; j++) q[(size_t)i * r + j] = skv_factor_start(i, j, r);
    for (int it = 0; it < SKV_CANON_ITERS; it++) {
        skv_cc_gx(d, r, g, q, y);
        if (it < SKV_CANON_TWO_PASS_ITERS) {
            skv_cc_pass(d, r, y, y, 0, ws, buf);
            skv_cc_pass(d, r, y, q, 0, ws, buf);
        } else
            skv_cc_pass(d, r, y, q, 1, ws, buf);
    }
    for (int k = 0; k < SKV_CANON_FINAL_PASSES; k++) skv_cc_pass(d, r, q, q, 0, ws, buf);
}
#endif

/* The state of the jobs over tokens. */
typedef struct {
    const skv_bf16 *a;
    int64_t n, t0, rows; /* all rows; the block in progress */
    int32_t d, r, F, Gb, nc; /* nc: column tiles of the Gram */
    const int32_t *e, *f;
    uint16_t *mxt; /* [threads][d] */
    double *g, *blk, *y, *tb; /* tb: [threads][SKV_CC_UROWS][r] */
    float *u;
} skv_cc_tok;

#define SKV_CC_ROWS 256 /* rows per work item of the jobs over tokens (steps 1 and 2) */
#define SKV_CC_UROWS 64 /* rows per work item of U = X Y (step 4: per-thread buffers of this many rows) */
#define SKV_CC_TILE 64  /* columns of a Gram tile */

/* At most nt threads, no more than items (at least 1). */
static int skv_cc_team(int nt, int64_t items) { return items < nt ? (items > 1 ? (int)items : 1) : nt; }

/* Rows [t0, t0 + rows) of the fixed-point A into blk [rows, d]. */
static void skv_cc_fix_rows(const skv_bf16 *a, int64_t t0, int64_t rows, int32_t d, const int32_t *e, int32_t F,
                            double *blk)
{
    for (int64_t t = 0; t < rows; t++)
        for (int32_t i = 0; i < d; i++)
            blk[(size_t)t * d + i] = skv_canon_fix(a[(size_t)(t0 + t) * d + i], F, e[i]);
}

/* 1. a range of rows into thread t's maxima of the magnitude bits (max: any order) */
static void skv_cc_max_item(void *ctx, int64_t it, int t)
{
    const skv_cc_tok *c = ctx;
    uint16_t *mx = c->mxt + (size_t)t * c->d;
    for (int64_t q = it * SKV_CC_ROWS; q < (it + 1) * SKV_CC_ROWS && q < c->n; q++)
        for (int32_t i = 0; i < c->d; i++) {
            uint16_t v = (uint16_t)(c->a[(size_t)q * c->d + i] & 0x7fff);
            mx[i] = v > mx[i] ? v : mx[i];
        }
}

/* 2. a range of the block's rows in fixed point */
static void skv_cc_fix_item(void *ctx, int64_t it, int t)
{
    const skv_cc_tok *c = ctx;
    int64_t q0 = it * SKV_CC_ROWS, rows = c->rows - q0 < SKV_CC_ROWS ? c->rows - q0 : SKV_CC_ROWS;
    (void)t;
    skv_cc_fix_rows(c->a, c->t0 + q0, rows, c->d, c->e, c->F, c->blk + (size_t)q0 * c->d);
}

/* 2. tile (ti, tj), ti <= tj, of S += the block's X^T X: one BLAS call on this thread (exact: any split) */
static void skv_cc_tile_item(void *ctx, int64_t it, int t)
{
    const skv_cc_tok *c = ctx;
    int32_t d = c->d, ti = 0, tj = (int32_t)it;
    (void)t;
    while (tj >= c->nc - ti) tj -= c->nc - ti, ti++; /* the it-th (ti, tj), ti <= tj, row by row */
    tj += ti;
    int32_t i0 = ti * SKV_CC_TILE, j0 = tj * SKV_CC_TILE;
    int ni = skv_cpu_min(SKV_CC_TILE, d - i0), nj = skv_cpu_min(SKV_CC_TILE, d - j0);
    if (ti == tj)
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, ni, (int)c->rows, 1.0, c->blk + i0, d, 1.0,
                    c->g + (size_t)i0 * d + i0, d);
    else
        cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, ni, nj, (int)c->rows, 1.0, c->blk + i0, d, c->blk + j0,
                    d, 1.0, c->g + (size_t)i0 * d + j0, d);
}

/* 4. a range of rows of U = X Y (exact: any split), scaled once; through thread t's buffers */
static void skv_cc_u_item(void *ctx, int64_t it, int t)
{
    const skv_cc_tok *c = ctx;
    int64_t t0 = it * SKV_CC_UROWS, rows = c->n - t0 < SKV_CC_UROWS ? c->n - t0 : SKV_CC_UROWS;
    int32_t d = c->d, r = c->r;
    double *blk = c->blk + (size_t)t * SKV_CC_UROWS * d, *tb = c->tb + (size_t)t * SKV_CC_UROWS * r;
    skv_cc_fix_rows(c->a, t0, rows, d, c->e, c->F, blk);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, r, d, 1.0, blk, d, c->y, r, 0.0, tb, r);
    for (int64_t k = 0; k < rows; k++)
        for (int32_t j = 0; j < r; j++)
            c->u[(size_t)(t0 + k) * r + j] = (float)skv_canon_scale(tb[(size_t)k * r + j], c->f[j] - c->Gb);
}

/* The canonical route: bitwise equal to ref's skv_ref_factorize_canonical. BLAS: on each thread
   alone (the caller, skv_cpu_factorize, opened skv_cpu_blas_begin). */
skv_status skv_cpu_factorize_canonical(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u, float *w)
{
    int32_t F = skv_canon_frac_bits(n), Gb = skv_canon_u_bits(n, d);
    int64_t nb = ((int64_t)1 << 20) / d, nrows = (n + SKV_CC_ROWS - 1) / SKV_CC_ROWS;
    int nt = skv_cc_team(skv_cpu_threads(), nrows);
    if (nb < 64) nb = 64;
    if (nb > n) nb = n;
    int64_t nurows = (n + SKV_CC_UROWS - 1) / SKV_CC_UROWS;
    int ntu = skv_cc_team(skv_cpu_threads(), nurows); /* step 4's threads */
    size_t blk_rows = (size_t)nb > (size_t)ntu * SKV_CC_UROWS ? (size_t)nb : (size_t)ntu * SKV_CC_UROWS; /* step 4's too */
    int32_t *e = malloc((size_t)d * sizeof *e), *f = malloc((size_t)r * sizeof *f);
    uint16_t *mxt = calloc((size_t)nt * d, sizeof *mxt);
    double *g = calloc((size_t)d * d, sizeof *g), *blk = malloc(blk_rows * d * sizeof *blk);
    double *q = malloc((size_t)d * r * sizeof *q), *y = malloc((size_t)d * r * sizeof *y);
    double *ws = malloc(((size_t)2 * r * r + r) * sizeof *ws);
    double *tb = malloc((size_t)ntu * SKV_CC_UROWS * r * sizeof *tb);
    double *buf = skv_cpu_alloc((size_t)skv_cpu_threads() * 8 * r * sizeof *buf); /* the solve's */
    skv_cc_tok c = {a, n, 0, 0, d, r, F, Gb, (d + SKV_CC_TILE - 1) / SKV_CC_TILE, e, f, mxt, g, blk, y, tb, u};
    skv_status st = SKV_OK;
    if (!e || !f || !mxt || !g || !blk || !q || !y || !ws || !tb || !buf) {
        st = SKV_ERR_OUT_OF_MEMORY;
        goto done;
    }
    /* 1. column scales: per-thread maxima of the magnitude bits (max: any order) */
    skv_cpu_run(nt, nrows, skv_cc_max_item, &c);
    for (int32_t i = 0; i < d; i++) {
        uint16_t mx = 0;
        for (int th = 0; th < nt; th++) mx = mxt[(size_t)th * d + i] > mx ? mxt[(size_t)th * d + i] : mx;
        e[i] = skv_canon_ex_bf16(mx);
    }
    /* 2. S = X^T X by token blocks (exact), G = S scaled: per block, a job of its rows in fixed
       point, then a job of the upper tiles of S */
    for (int64_t t = 0; t < n; t += nb) {
        c.t0 = t, c.rows = n - t < nb ? n - t : nb;
        int64_t items = (c.rows + SKV_CC_ROWS - 1) / SKV_CC_ROWS, tiles = (int64_t)c.nc * (c.nc + 1) / 2;
        skv_cpu_run(skv_cc_team(nt, items), items, skv_cc_fix_item, &c);
        skv_cpu_run(skv_cc_team(nt, tiles), tiles, skv_cc_tile_item, &c);
    }
    for (int32_t i = 0; i < d; i++)
        for (int32_t j = i; j < d; j++) {
            double v = g[(size_t)i * d + j] * skv_canon_pow2(e[i] + e[j] - 2 * F);
            g[(size_t)i * d + j] = v;
            g[(size_t)j * d + i] = v;
        }
    /* 3. Q */
#if SKV_CPU_X86
    if (skv_cpu_simd()) skv_cc_subspace(d, r, g, q, y, ws, buf);
    else
#endif
        skv_canon_ref_subspace(d, r, g, q, y, ws);
    /* 4. W = Q^T; U = X Y exactly (one dgemm per item of rows), scaled once */
    for (int32_t j = 0; j < r; j++)
        for (int32_t i = 0; i < d; i++) w[(size_t)j * d + i] = (float)q[(size_t)i * r + j];
    skv_canon_ref_qfix(d, r, q, e, F, Gb, y, f);
    skv_cpu_run(ntu, nurows, skv_cc_u_item, &c);
done:
    free(e);
    free(f);
    free(mxt);
    free(g);
    free(blk);
    free(q);
    free(y);
    free(ws);
    free(tb);
    free(buf);
    return st;
}
