/*
 * The FAST factorization route (lib/skv_factor.h): fp32 block Gram, subspace
 * iteration with shifted Cholesky QR, fp32 projection. No BLAS. AVX2 only
 * (the portable build factors every shape by the EXACT route).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "skv_cpu_kernels.h"
#include "skv_cpu_ops.h"
#include "skv_cpu_simd.h"

#if SKV_CPU_X86

/* State of one FAST factorization: X^T is kept as z [r, d] (rows = basis vectors), so every product
   runs over contiguous rows of d. */
typedef struct {
    int32_t d, r;
    double *g;   /* [d, d] the Gram matrix (symmetric, full) */
    float *gf;   /* [ceil(d/16)][d][16] G in float, packed (the fp32 G X) */
    double *gd;  /* [ceil(d/8)][d][8] G in double, packed (G X in double) */
    double *z;   /* [r, d] X^T */
    float *zf;   /* [r, d] X^T in float */
    double *y;   /* [r, d] (G X)^T, then the next z in place */
    double *yp;  /* [ceil(r/8)][d][8] the right operand of an r x r product, packed */
    double *c;   /* [r, r] an r x r Gram (Y^T Y or X^T G X), then its Cholesky factor R (upper) */
    double *ci;  /* [r, r] R^-1 (the check) */
    double *ct;  /* [r, r] R^T (the solve) */
    double *sb;  /* [nt][r][SKV_CPU_SOLVE_W] the solve's per-thread buffers */
    int nt;      /* threads of the jobs (skv_cpu_threads(); a job's team is at most that) */
    double *dsc; /* column scales of an equilibrated pass, or NULL */
} skv_cpu_fx;

/* y = (G X)^T = z G: fp32 (zf against gf) or double (z against gd); an item per strip of G. */
typedef struct {
    skv_cpu_fx *f;
    int dbl;
    const double *uu, *vv; /* skv_cpu_fx_chol's operands */
    double *v;             /* skv_cpu_fx_solve's */
} skv_cpu_fx_job;

static void skv_cpu_fx_apply_item(void *ctx, int64_t item, int t)
{
    const skv_cpu_fx_job *j = ctx;
    skv_cpu_fx *f = j->f;
    const int32_t d = f->d, r = f->r, ng = (r + 5) / 6, is = (int32_t)item;
    (void)t;
    for (int32_t ig = 0; ig < ng; ig++) {
        int32_t j0 = ig * 6, nj = skv_cpu_min(6, r - j0);
        if (j->dbl) {
            const double *ar[6];
            double tt[48];
            int32_t i0 = is * 8, ni = skv_cpu_min(8, d - i0);
            for (int q = 0; q < 6; q++) ar[q] = f->z + (size_t)(j0 + skv_cpu_min(q, nj - 1)) * d;
            skv_cpu_dkern_rows(d, ar, f->gd + (size_t)is * d * 8, tt);
            for (int32_t q = 0; q < nj; q++)
                for (int32_t i = 0; i < ni; i++) f->y[(size_t)(j0 + q) * d + i0 + i] = tt[q * 8 + i];
        } else {
            const float *ar[6];
            float tt[96];
            int32_t i0 = is * 16, ni = skv_cpu_min(16, d - i0);
            for (int q = 0; q < 6; q++) ar[q] = f->zf + (size_t)(j0 + skv_cpu_min(q, nj - 1)) * d;
            skv_cpu_skern_rows(d, ar, f->gf + (size_t)is * d * 16, tt);
            for (int32_t q = 0; q < nj; q++)
                for (int32_t i = 0; i < ni; i++) f->y[(size_t)(j0 + q) * d + i0 + i] = tt[q * 16 + i];
        }
    }
}

static void skv_cpu_fx_apply(skv_cpu_fx *f, int dbl)
{
    const int32_t ns = dbl ? (f->d + 7) / 8 : (f->d + 15) / 16;
    skv_cpu_fx_job j = {f, dbl, NULL, NULL, NULL};
    skv_cpu_run(skv_cpu_team(ns), ns, skv_cpu_fx_apply_item, &j);
}

/*
 * Small dense kernels of the FAST route, serial and without BLAS (between
 * the team's jobs; OpenBLAS would start its own threads for r = 160).
 * skv_cpu_chol: c (row-major, the upper triangle of a symmetric r x r matrix)
 * <- R (upper) with C = R^T R, right-looking, every pivot at least `floor`
 * (lib/skv_factor.h: SKV_FACTOR_PIVOT_FLOOR tr C), so it never fails.
 * skv_cpu_trinv: ri <- R^-1 (upper), row by row from the bottom.
 */
SKV_CPU_AVX2 static void skv_cpu_chol(double *c, int32_t r, double floor)
{
    for (int32_t k = 0; k < r; k++) {
        double *ck = c + (size_t)k * r, p = ck[k];
        p = sqrt(p >= floor ? p : floor); /* pivots raised to the floor (NaN too): R always exists */
        ck[k] = p;
        for (int32_t j = k + 1; j < r; j++) ck[j] /= p;
        for (int32_t i = k + 1; i < r; i++) {
            double *ci = c + (size_t)i * r;
            __m256d f = _mm256_set1_pd(ck[i]);
            int32_t j = i;
            for (; j + 4 <= r; j += 4)
                _mm256_storeu_pd(ci + j, _mm256_fnmadd_pd(f, _mm256_loadu_pd(ck + j), _mm256_loadu_pd(ci + j)));
            for (; j < r; j++) ci[j] = fma(-ck[i], ck[j], ci[j]);
        }
    }
}

SKV_CPU_AVX2 static void skv_cpu_trinv(const double *c, int32_t r, double *ri)
{
    memset(ri, 0, (size_t)r * r * sizeof *ri);
    for (int32_t i = r - 1; i >= 0; i--) {
        double *ti = ri + (size_t)i * r;
        const double *ci = c + (size_t)i * r;
        ti[i] = 1.0;
        for (int32_t m = i + 1; m < r; m++) { /* ti -= R[i][m] Rinv[m][:] (row m is zero before m) */
            const double *tm = ri + (size_t)m * r;
            __m256d f = _mm256_set1_pd(ci[m]);
            int32_t j = m;
            for (; j + 4 <= r; j += 4)
                _mm256_storeu_pd(ti + j, _mm256_fnmadd_pd(f, _mm256_loadu_pd(tm + j), _mm256_loadu_pd(ti + j)));
            for (; j < r; j++) ti[j] = fma(-ci[m], tm[j], ti[j]);
        }
        for (int32_t j = i; j < r; j++) ti[j] /= ci[i];
    }
}

/*
 * c (upper triangle, row-major r x r) = u v^T for u, v [r, d] in double, i.e.
 * U^T V for the d x r matrices U = u^T, V = v^T; then the shift s of its
 * trace (lib/skv_factor.h: skv_factor_shift for Cholesky QR, else
 * skv_factor_rq_shift for H = X^T G X at the check), c += s I,
 * and its Cholesky factor in place: c = R (row-major upper), C + s I = R^T R.
 */
enum { SKV_CPU_SHIFT_QR, SKV_CPU_SHIFT_RQ };

/* the right operand vv packed as 8-column slivers, one item per sliver */
static void skv_cpu_fx_chol_pack(void *ctx, int64_t js, int t)
{
    const skv_cpu_fx_job *j = ctx;
    const int32_t d = j->f->d, r = j->f->r;
    (void)t;
    for (int32_t jj = 0; jj < 8; jj++) {
        int32_t col = (int32_t)js * 8 + jj;
        double *dst = j->f->yp + (size_t)js * d * 8 + jj;
        if (col < r)
            for (int32_t p = 0; p < d; p++) dst[(size_t)p * 8] = j->vv[(size_t)col * d + p];
        else
            for (int32_t p = 0; p < d; p++) dst[(size_t)p * 8] = 0.0;
    }
}

/* one 6 x 8 tile of c on or above the diagonal */
static void skv_cpu_fx_chol_tile(void *ctx, int64_t it, int t)
{
    const skv_cpu_fx_job *j = ctx;
    const int32_t d = j->f->d, r = j->f->r, n8 = (r + 7) / 8;
    int32_t i0 = (int32_t)it / n8 * 6, j0 = (int32_t)it % n8 * 8, ni = skv_cpu_min(6, r - i0), nj = skv_cpu_min(8, r - j0);
    double *c = j->f->c;
    (void)t;
    if (j0 + nj <= i0) return; /* strictly below the diagonal */
    const double *ar[6];
    double tt[48];
    for (int i = 0; i < 6; i++) ar[i] = j->uu + (size_t)(i0 + skv_cpu_min(i, ni - 1)) * d;
    skv_cpu_dkern_rows(d, ar, j->f->yp + (size_t)(j0 / 8) * d * 8, tt);
    for (int32_t i = 0; i < ni; i++)
        for (int32_t q = 0; q < nj; q++) c[(size_t)(i0 + i) * r + j0 + q] = tt[i * 8 + q];
}

static void skv_cpu_fx_chol(skv_cpu_fx *f, const double *uu, const double *vv, double diag, int shift)
{
    const int32_t d = f->d, r = f->r, ng = (r + 5) / 6, n8 = (r + 7) / 8;
    double *c = f->c;
    skv_cpu_fx_job job = {f, 0, uu, vv, NULL};
    skv_cpu_run(skv_cpu_team(n8), n8, skv_cpu_fx_chol_pack, &job);
    skv_cpu_run(skv_cpu_team((int64_t)ng * n8), (int64_t)ng * n8, skv_cpu_fx_chol_tile, &job);
    double tr = 0.0;
    if (f->dsc) { /* column equilibration: C <- D C D, D = diag(C)^-1/2 */
        for (int32_t i = 0; i < r; i++) {
            double cii = c[(size_t)i * r + i];
            f->dsc[i] = cii > 0.0 ? 1.0 / sqrt(cii) : 1.0;
        }
        for (int32_t i = 0; i < r; i++)
            for (int32_t j = i; j < r; j++) c[(size_t)i * r + j] *= f->dsc[i] * f->dsc[j];
    }
    for (int32_t i = 0; i < r; i++) tr += c[(size_t)i * r + i] += diag;
    double s = shift == SKV_CPU_SHIFT_QR ? skv_factor_shift(d, r, tr)
                                         : skv_factor_rq_shift(tr);
    for (int32_t i = 0; i < r; i++) c[(size_t)i * r + i] += s;
    skv_cpu_chol(c, r, SKV_FACTOR_PIVOT_FLOOR * (tr + r * s));
}

/*
 * v [r, d] <- R^-T v in place (X <- X R^-1 for X = v^T), R = f->c (upper, from
 * skv_cpu_fx_chol), and f->zf = v in float: forward substitution
 * v_k <- (v_k - sum_{m<k} R[m][k] v_m) / R[k][k], every sum in the order of m.
 * Columns are independent: chunks of SKV_CPU_SOLVE_W columns in parallel, each
 * copied into a contiguous per-thread buffer [r][W], two rows k at a time.
 */
#define SKV_CPU_SOLVE_W 16

/* Columns [ch W, ch W + W) of the solve, through buf [r][W]. */
SKV_CPU_AVX2 static void skv_cpu_fx_solve_chunk(skv_cpu_fx *f, double *v, const double *ct, int32_t ch, double *buf)
{
    const int32_t d = f->d, r = f->r;
    int32_t i0 = ch * SKV_CPU_SOLVE_W, w = skv_cpu_min(SKV_CPU_SOLVE_W, d - i0);
    for (int32_t k = 0; k < r; k++)
        for (int32_t i = 0; i < SKV_CPU_SOLVE_W; i++)
            buf[(size_t)k * SKV_CPU_SOLVE_W + i] = i < w ? v[(size_t)k * d + i0 + i] : 0.0;
    for (int32_t k = 0; k < r; k += 2) {
        const double *c0 = ct + (size_t)k * r, *c1 = c0 + r;
        double *b0 = buf + (size_t)k * SKV_CPU_SOLVE_W, *b1 = b0 + SKV_CPU_SOLVE_W;
        __m256d a0 = _mm256_loadu_pd(b0), a1 = _mm256_loadu_pd(b0 + 4);
        __m256d a2 = _mm256_loadu_pd(b0 + 8), a3 = _mm256_loadu_pd(b0 + 12);
        if (k + 1 < r) {
            __m256d e0 = _mm256_loadu_pd(b1), e1 = _mm256_loadu_pd(b1 + 4);
            __m256d e2 = _mm256_loadu_pd(b1 + 8), e3 = _mm256_loadu_pd(b1 + 12);
            for (int32_t m = 0; m < k; m++) {
                const double *bm = buf + (size_t)m * SKV_CPU_SOLVE_W;
                __m256d x0 = _mm256_loadu_pd(bm), x1 = _mm256_loadu_pd(bm + 4);
                __m256d x2 = _mm256_loadu_pd(bm + 8), x3 = _mm256_loadu_pd(bm + 12);
                __m256d r0 = _mm256_broadcast_sd(c0 + m), r1 = _mm256_broadcast_sd(c1 + m);
                a0 = _mm256_fnmadd_pd(r0, x0, a0), a1 = _mm256_fnmadd_pd(r0, x1, a1);
                a2 = _mm256_fnmadd_pd(r0, x2, a2), a3 = _mm256_fnmadd_pd(r0, x3, a3);
                e0 = _mm256_fnmadd_pd(r1, x0, e0), e1 = _mm256_fnmadd_pd(r1, x1, e1);
                e2 = _mm256_fnmadd_pd(r1, x2, e2), e3 = _mm256_fnmadd_pd(r1, x3, e3);
            }
            __m256d rk = _mm256_broadcast_sd(c0 + k);
            a0 = _mm256_div_pd(a0, rk), a1 = _mm256_div_pd(a1, rk);
            a2 = _mm256_div_pd(a2, rk), a3 = _mm256_div_pd(a3, rk);
            __m256d r1 = _mm256_broadcast_sd(c1 + k), rk1 = _mm256_broadcast_sd(c1 + k + 1);
            e0 = _mm256_div_pd(_mm256_fnmadd_pd(r1, a0, e0), rk1);
            e1 = _mm256_div_pd(_mm256_fnmadd_pd(r1, a1, e1), rk1);
            e2 = _mm256_div_pd(_mm256_fnmadd_pd(r1, a2, e2), rk1);
            e3 = _mm256_div_pd(_mm256_fnmadd_pd(r1, a3, e3), rk1);
            _mm256_storeu_pd(b1, e0), _mm256_storeu_pd(b1 + 4, e1);
            _mm256_storeu_pd(b1 + 8, e2), _mm256_storeu_pd(b1 + 12, e3);
        } else {
            for (int32_t m = 0; m < k; m++) {
                const double *bm = buf + (size_t)m * SKV_CPU_SOLVE_W;
                __m256d r0 = _mm256_broadcast_sd(c0 + m);
                a0 = _mm256_fnmadd_pd(r0, _mm256_loadu_pd(bm), a0);
                a1 = _mm256_fnmadd_pd(r0, _mm256_loadu_pd(bm + 4), a1);
                a2 = _mm256_fnmadd_pd(r0, _mm256_loadu_pd(bm + 8), a2);
                a3 = _mm256_fnmadd_pd(r0, _mm256_loadu_pd(bm + 12), a3);
            }
            __m256d rk = _mm256_broadcast_sd(c0 + k);
            a0 = _mm256_div_pd(a0, rk), a1 = _mm256_div_pd(a1, rk);
            a2 = _mm256_div_pd(a2, rk), a3 = _mm256_div_pd(a3, rk);
        }
        _mm256_storeu_pd(b0, a0), _mm256_storeu_pd(b0 + 4, a1);
        _mm256_storeu_pd(b0 + 8, a2), _mm256_storeu_pd(b0 + 12, a3);
    }
    for (int32_t k = 0; k < r; k++) {
        const double *bk = buf + (size_t)k * SKV_CPU_SOLVE_W;
        double *vk = v + (size_t)k * d + i0;
        float *zk = f->zf + (size_t)k * d + i0;
        if (w == SKV_CPU_SOLVE_W) {
            for (int q = 0; q < 4; q++) {
                __m256d x = _mm256_loadu_pd(bk + 4 * q);
                _mm256_storeu_pd(vk + 4 * q, x);
                _mm_storeu_ps(zk + 4 * q, _mm256_cvtpd_ps(x));
            }
        } else {
            for (int32_t i = 0; i < w; i++) vk[i] = bk[i], zk[i] = (float)bk[i];
        }
    }
}

static void skv_cpu_fx_solve_item(void *ctx, int64_t ch, int t)
{
    const skv_cpu_fx_job *j = ctx;
    skv_cpu_fx *f = j->f;
    skv_cpu_fx_solve_chunk(f, j->v, f->ct, (int32_t)ch, f->sb + (size_t)t * f->r * SKV_CPU_SOLVE_W);
}

static void skv_cpu_fx_solve(skv_cpu_fx *f, double *v)
{
    const int32_t d = f->d, r = f->r, nch = (d + SKV_CPU_SOLVE_W - 1) / SKV_CPU_SOLVE_W;
    double *ct = f->ct;
    for (int32_t k = 0; k < r; k++) /* ct [k][m] = R[m][k], m <= k: row k of R^T, contiguous */
        for (int32_t m = 0; m <= k; m++) ct[(size_t)k * r + m] = f->c[(size_t)m * r + k];
    skv_cpu_fx_job j = {f, 0, NULL, NULL, v};
    skv_cpu_run(skv_cpu_team(nch), nch, skv_cpu_fx_solve_item, &j);
}

/* v [r, d] <- orth(v^T)^T in place (shifted Cholesky QR, lib/skv_factor.h), f->zf = v in float. */
static void skv_cpu_fx_orth(skv_cpu_fx *f, double *v)
{
    skv_cpu_fx_chol(f, v, v, 0.0, SKV_CPU_SHIFT_QR);
    skv_cpu_fx_solve(f, v);
}

/* v [r, d] <- orth_e(v^T)^T in place (lib/skv_factor.h: one equilibrated pass, v^T D R^-1). */
static void skv_cpu_fx_orth_scaled(skv_cpu_fx *f, double *v, double *dsc)
{
    f->dsc = dsc;
    skv_cpu_fx_chol(f, v, v, 0.0, SKV_CPU_SHIFT_QR);
    f->dsc = NULL;
    for (int32_t k = 0; k < f->r; k++)
        for (int32_t i = 0; i < f->d; i++) v[(size_t)k * f->d + i] *= dsc[k];
    skv_cpu_fx_solve(f, v);
}

/* One iteration: z <- orth(orth(G X))^T, or orth_e(G X)^T when single (reuse: y = (G X)^T
   already, from the check). */
static void skv_cpu_fx_step(skv_cpu_fx *f, int dbl, int reuse, int single)
{
    if (!reuse) skv_cpu_fx_apply(f, dbl);
    if (single) {
        double dsc[SKV_FACTOR_FAST_MAX_R];
        skv_cpu_fx_orth_scaled(f, f->y, dsc);
    } else {
        skv_cpu_fx_orth(f, f->y);
        skv_cpu_fx_orth(f, f->y);
    }
    double *t = f->z;
    f->z = f->y, f->y = t;
}

/* gf (dbl = 0) or gd (dbl = 1) from the full double G; an item per row p of G. */
static void skv_cpu_fx_pack_g_item(void *ctx, int64_t p, int t)
{
    const skv_cpu_fx_job *j = ctx;
    skv_cpu_fx *f = j->f;
    const int32_t d = f->d, w = j->dbl ? 8 : 16, ns = (d + w - 1) / w;
    (void)t;
    for (int32_t is = 0; is < ns; is++)
        for (int32_t q = 0; q < w; q++) {
            int32_t i = is * w + q;
            double x = i < d ? f->g[(size_t)p * d + i] : 0.0;
            if (j->dbl) f->gd[((size_t)is * d + p) * 8 + q] = x;
            else f->gf[((size_t)is * d + p) * 16 + q] = (float)x;
        }
}

static void skv_cpu_fx_pack_g(skv_cpu_fx *f, int dbl)
{
    skv_cpu_fx_job j = {f, dbl, NULL, NULL, NULL};
    skv_cpu_run(skv_cpu_team(f->d), f->d, skv_cpu_fx_pack_g_item, &j);
}

/* z = X_0^T (and zf), an item per row j */
static void skv_cpu_fx_start_item(void *ctx, int64_t jr, int t)
{
    const skv_cpu_fx_job *j = ctx;
    skv_cpu_fx *f = j->f;
    (void)t;
    for (int32_t i = 0; i < f->d; i++) {
        double x = skv_factor_start(i, (int32_t)jr, f->r);
        f->z[(size_t)jr * f->d + i] = x;
        f->zf[(size_t)jr * f->d + i] = (float)x;
    }
}

#define SKV_CPU_URB 48 /* projection: rows per work item, 8 slivers of 6 */

/* Rows [t0, t0 + rows) of u = A Q (ab: [SKV_CPU_URB][d] scratch, qb: Q packed as 16-column slivers). */
SKV_CPU_AVX2 static void skv_cpu_fx_project_rows(int32_t d, int32_t r, const skv_bf16 *a, int64_t t0, int32_t rows,
                                                 const float *qb, float scale, float unscale, float *ab, float *u)
{
    const int32_t n16 = (r + 15) / 16;
    const __m256 sc = _mm256_set1_ps(scale), us = _mm256_set1_ps(unscale);
    for (int32_t i = 0; i < rows; i++) {
        const skv_bf16 *src = a + (size_t)(t0 + i) * d;
        float *dst = ab + (size_t)i * d;
        int32_t p = 0;
        for (; p + 8 <= d; p += 8) _mm256_storeu_ps(dst + p, _mm256_mul_ps(skv_cpu_ld8(src + p), sc));
        for (; p < d; p++) dst[p] = skv_bf16_to_f32(src[p]) * scale;
    }
    for (int32_t js = 0; js < n16; js++) {
        int32_t j0 = js * 16, nj = skv_cpu_min(16, r - j0);
        for (int32_t i0 = 0; i0 < rows; i0 += 6) {
            int32_t ni = skv_cpu_min(6, rows - i0);
            const float *ar[6];
            float t[96];
            for (int i = 0; i < 6; i++) ar[i] = ab + (size_t)(i0 + skv_cpu_min(i, ni - 1)) * d;
            skv_cpu_skern_rows(d, ar, qb + (size_t)js * d * 16, t);
            for (int32_t i = 0; i < ni; i++) {
                float *ur = u + (size_t)(t0 + i0 + i) * r + j0;
                if (nj == 16) {
                    _mm256_storeu_ps(ur, _mm256_mul_ps(_mm256_loadu_ps(t + i * 16), us));
                    _mm256_storeu_ps(ur + 8, _mm256_mul_ps(_mm256_loadu_ps(t + i * 16 + 8), us));
                } else {
                    for (int32_t j = 0; j < nj; j++) ur[j] = t[i * 16 + j] * unscale;
                }
            }
        }
    }
}

/* The projection's two jobs: Q packed (an item per 16-column sliver), then rows of u. */
typedef struct {
    int64_t n;
    int32_t d, r;
    const skv_bf16 *a;
    const float *zf;
    float scale, unscale;
    float *qb, *abuf, *u;
} skv_cpu_fx_proj;

static void skv_cpu_fx_qpack_item(void *ctx, int64_t js, int t)
{
    const skv_cpu_fx_proj *P = ctx;
    const int32_t d = P->d, r = P->r;
    (void)t;
    for (int32_t jj = 0; jj < 16; jj++) {
        int32_t j = (int32_t)js * 16 + jj;
        float *dst = P->qb + (size_t)js * d * 16 + jj;
        for (int32_t p = 0; p < d; p++) dst[(size_t)p * 16] = j < r ? P->zf[(size_t)j * d + p] : 0.0f;
    }
}

static void skv_cpu_fx_rows_item(void *ctx, int64_t b, int t)
{
    const skv_cpu_fx_proj *P = ctx;
    int64_t t0 = b * SKV_CPU_URB;
    int32_t rows = (int32_t)(P->n - t0 < SKV_CPU_URB ? P->n - t0 : SKV_CPU_URB);
    skv_cpu_fx_project_rows(P->d, P->r, P->a, t0, rows, P->qb, P->scale, P->unscale,
                            P->abuf + (size_t)t * SKV_CPU_URB * P->d, P->u);
}

/* u [n, r] = A Q in float: A rows scaled by `scale` (the fp32 Gram's power of two) and the result by
   `unscale`, Q^T = zf [r, d]; parallel over blocks of rows. */
static skv_status skv_cpu_fx_project(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, const float *zf,
                                     float scale, float unscale, float *u, int nt)
{
    const int32_t n16 = (r + 15) / 16;
    const int64_t nrb = (n + SKV_CPU_URB - 1) / SKV_CPU_URB;
    skv_cpu_fx_proj P = {n, d, r, a, zf, scale, unscale, skv_cpu_alloc((size_t)n16 * d * 16 * sizeof *P.qb),
                         skv_cpu_alloc((size_t)nt * SKV_CPU_URB * d * sizeof *P.abuf), u};
    if (!P.qb || !P.abuf) {
        free(P.qb);
        free(P.abuf);
        return SKV_ERR_OUT_OF_MEMORY;
    }
    skv_cpu_run(skv_cpu_team(n16), n16, skv_cpu_fx_qpack_item, &P);
    skv_cpu_run(skv_cpu_team(nrb), nrb, skv_cpu_fx_rows_item, &P);
    free(P.qb);
    free(P.abuf);
    return SKV_OK;
}

/*
 * The FAST route of lib/skv_factor.h (n >= d, 2r <= d, r <= SKV_FACTOR_FAST_MAX_R),
 * with X^T kept as z:
 *  1. G: fp32 block Grams of (2^k A) summed in double (skv_cpu_fgram); the
 *     power of two only keeps fp32 in range (skv_cpu_amax_exp).
 *  2. z = X_0^T = skv_factor_start.
 *  3. SKV_FACTOR_ITERS times X <- orth(orth(G X)) (after iteration
 *     SKV_FACTOR_TWO_PASS_ITERS: X <- orth_e(G X), one equilibrated pass): G X
 *     in fp32 (G rounded to float once, X per product, fp32 sums over d), each
 *     orth a shifted Cholesky QR in double (pivots floored at
 *     SKV_FACTOR_PIVOT_FLOOR tr C).
 *     Two departures from the header, both measured on the bench's
 *     realistic keys (lambda_r / lambda_1 ~ 5e-7, a flat noise floor around r):
 *     - the header's Rayleigh-quotient step X <- G X (X^T G X + s_H I)^-1 with
 *       s_H = 2^-18 tr H on the fp32 Gram damps every direction below s_H in
 *       each step (err / opt - 1 = 2.4e-2), and a single plain Cholesky QR per
 *       step compounds the same damping (7.9e-2). Two passes keep X orthonormal
 *       to rounding; span(X) is that of subspace iteration either way; 2.5e-3.
 *       One equilibrated pass (orth_e) per step after the first three does not
 *       damp (2.5e-3 again; the header says why).
 *     - G + SKV_FACTOR_GRAM_SHIFT32 tr(G) I is only needed for a Cholesky of
 *       X^T G X, and it slows the iteration over the noise floor (4.3e-3).
 *       Cholesky QR factors Y^T Y, definite whatever G, so the iteration runs
 *       on G and the shift enters the check only, where X is orthonormal and
 *       X^T (G + delta I) X = X^T G X + delta I: the same rho.
 *  4. After iteration SKV_FACTOR_CHECK_AT (X orthonormal): Y = G X (kept for the
 *     next step), and in AUTO mode H = X^T G X + delta I + s_H I = R^T R with
 *     the double-Gram Rayleigh shift (cuda's too), rho = 1 / (|R|_F^2
 *     |R^-1|_F^2) (0 if not finite: pivots floored because the fp32 G left H
 *     indefinite); rho < SKV_FACTOR_TAU or FALLBACK mode: G <- the double Gram
 *     (skv_cpu_gram), G X in double from then on.
 *  5. Q = orth(orth(X)); W = Q^T; U = A Q in fp32 (skv_cpu_fx_project).
 * Every phase is blocked with fixed tiles and merge orders: the result does
 * not depend on the thread count. No BLAS: nothing here starts OpenBLAS threads.
 */
skv_status skv_cpu_factorize_fast(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u, float *w,
                                  skv_factorize_route mode)
{
    skv_status st = SKV_OK;
    skv_cpu_fx f = {d, r, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, skv_cpu_threads(), NULL};
    const size_t rd = (size_t)r * d;
    f.g = skv_cpu_alloc((size_t)d * d * sizeof *f.g);
    f.gf = skv_cpu_alloc((size_t)((d + 15) / 16) * 16 * d * sizeof *f.gf);
    f.z = skv_cpu_alloc(rd * sizeof *f.z);
    f.zf = skv_cpu_alloc(rd * sizeof *f.zf);
    f.y = skv_cpu_alloc(rd * sizeof *f.y);
    f.yp = skv_cpu_alloc((size_t)((r + 7) / 8) * 8 * d * sizeof *f.yp);
    f.c = skv_cpu_alloc((size_t)r * r * sizeof *f.c);
    f.ci = skv_cpu_alloc((size_t)r * r * sizeof *f.ci);
    f.ct = skv_cpu_alloc((size_t)r * r * sizeof *f.ct);
    f.sb = skv_cpu_alloc((size_t)f.nt * r * SKV_CPU_SOLVE_W * sizeof *f.sb);
    if (!f.g || !f.gf || !f.z || !f.zf || !f.y || !f.yp || !f.c || !f.ci || !f.ct || !f.sb) st = SKV_ERR_OUT_OF_MEMORY;
    int e = 0, dbl = 0, reuse = 0;
    if (!st) {
        e = skv_cpu_amax_exp(a, n * d);
        st = skv_cpu_fgram(n, d, a, ldexpf(1.0f, 128 - e), f.g);
    }
    double delta = 0.0; /* SKV_FACTOR_GRAM_SHIFT32 tr(G), applied at the check (see above) */
    if (!st) {
        for (int32_t i = 0; i < d; i++) delta += f.g[(size_t)i * d + i];
        delta *= SKV_FACTOR_GRAM_SHIFT32;
        skv_cpu_fx_pack_g(&f, 0);
        skv_cpu_fx_job j = {&f, 0, NULL, NULL, NULL};
        skv_cpu_run(skv_cpu_team(r), r, skv_cpu_fx_start_item, &j); /* z = X_0^T */
    }
    for (int it = 1; !st && it <= SKV_FACTOR_ITERS; it++) {
        skv_cpu_fx_step(&f, dbl, reuse, it > SKV_FACTOR_TWO_PASS_ITERS);
        reuse = 0;
        if (it != SKV_FACTOR_CHECK_AT) continue;
        /* the check (step 4; X is orthonormal after a two-pass iteration): y = (G X)^T (the next
           step's), and in AUTO mode H = X^T (G + delta I) X + s_H I = R^T R (X^T G X + delta I),
           s_H the double-Gram Rayleigh shift, pivots floored; rho = 1 / (|R|_F^2 |R^-1|_F^2) */
        if (mode != SKV_FACTORIZE_FALLBACK) skv_cpu_fx_apply(&f, dbl);
        double rho = 0.0;
        if (mode == SKV_FACTORIZE_AUTO) {
            skv_cpu_fx_chol(&f, f.z, f.y, delta, SKV_CPU_SHIFT_RQ);
            skv_cpu_trinv(f.c, r, f.ci);
            double fr = 0.0, fi = 0.0;
            for (int32_t i = 0; i < r; i++)
                for (int32_t j = i; j < r; j++) {
                    fr += f.c[(size_t)i * r + j] * f.c[(size_t)i * r + j];
                    fi += f.ci[(size_t)i * r + j] * f.ci[(size_t)i * r + j];
                }
            double q = fr * fi; /* not finite when G's rounding left H indefinite: the fallback */
            rho = q > 0.0 && q < INFINITY ? 1.0 / q : 0.0;
        }
        if (mode == SKV_FACTORIZE_FALLBACK || (mode == SKV_FACTORIZE_AUTO && !(rho >= SKV_FACTOR_TAU))) {
            f.gd = skv_cpu_alloc((size_t)((d + 7) / 8) * 8 * d * sizeof *f.gd);
            if (!f.gd) {
                st = SKV_ERR_OUT_OF_MEMORY;
                break;
            }
            memset(f.g, 0, (size_t)d * d * sizeof *f.g);
            if ((st = skv_cpu_gram(n, d, a, f.g))) break;
            skv_cpu_mirror(f.g, d);
            skv_cpu_fx_pack_g(&f, 1);
            dbl = 1;
        } else {
            reuse = 1; /* y = (G X)^T for the next step */
        }
    }
    if (!st) {
        skv_cpu_fx_orth(&f, f.z);
        skv_cpu_fx_orth(&f, f.z);
    }
    if (!st) st = skv_cpu_fx_project(n, d, r, a, f.zf, ldexpf(1.0f, 128 - e), ldexpf(1.0f, e - 128), u, f.nt);
    if (!st) memcpy(w, f.zf, rd * sizeof *w);
    free(f.g);
    free(f.gf);
    free(f.gd);
    free(f.z);
    free(f.zf);
    free(f.y);
    free(f.yp);
    free(f.c);
    free(f.ci);
    free(f.ct);
    free(f.sb);
    return st;
}
#endif
