/*
 * factorize: the route of lib/skv_factor.h, the canonical route
 * (skv_cpu_canon.c), and the EXACT route (double Gram,
 * LAPACK dsyevr, U = A V_r in double). OpenBLAS and LAPACK run from the
 * calling thread, on it alone (skv_cpu_blas_begin): the team's parallel loops
 * run between those calls, and no thread waits for work by polling meanwhile.
 */
#include <stdlib.h>

#include <cblas.h>
#include <lapacke.h>

#include "skv_cpu_kernels.h"
#include "skv_cpu_ops.h"

/* bf16 rows [rows, d] -> double (BLAS paths; serial: they run between BLAS calls). */
static void skv_cpu_rows_f64(const skv_bf16 *a, int64_t rows, int32_t d, double *out)
{
    for (int64_t i = 0; i < rows * d; i++) out[i] = (double)skv_bf16_to_f32(a[i]);
}

/*
 * Top-r eigenvectors of the symmetric m x m matrix g (upper triangle, row
 * major), descending by eigenvalue, into v [m, r] (column q = q-th largest).
 */
static skv_status skv_cpu_top_eigvecs(double *g, int32_t m, int32_t r, double *v)
{
    double *evals = malloc((size_t)m * sizeof *evals), *z = malloc((size_t)m * r * sizeof *z);
    lapack_int *isuppz = malloc((size_t)2 * m * sizeof *isuppz), found = 0, info = 0;
    skv_status st = SKV_OK;
    if (!evals || !z || !isuppz) {
        st = SKV_ERR_OUT_OF_MEMORY;
        goto done;
    }
    info = LAPACKE_dsyevr(LAPACK_ROW_MAJOR, 'V', 'I', 'U', m, g, m, 0.0, 0.0, m - r + 1, m, 0.0, &found,
                          evals, z, r, isuppz);
    if (info == LAPACK_WORK_MEMORY_ERROR || info == LAPACK_TRANSPOSE_MEMORY_ERROR) {
        st = SKV_ERR_OUT_OF_MEMORY;
        goto done;
    }
    if (info != 0 || found != r) {
        st = SKV_ERR_NUMERICAL;
        goto done;
    }
    for (int32_t i = 0; i < m; i++)
        for (int32_t q = 0; q < r; q++) v[(size_t)i * r + q] = z[(size_t)i * r + (r - 1 - q)];
done:
    free(evals);
    free(z);
    free(isuppz);
    return st;
}

/* n < d: the smaller Gram A A^T gives U = its top eigenvectors, W = U^T A (BLAS; prompts are
   longer than Hk*D in practice). */
static skv_status skv_cpu_factorize_wide(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u, float *w)
{
    skv_status st = SKV_OK;
    int32_t m = (int32_t)n;
    double *ad = malloc((size_t)n * d * sizeof *ad), *g = calloc((size_t)m * m, sizeof *g);
    double *v = malloc((size_t)m * r * sizeof *v), *wd = malloc((size_t)r * d * sizeof *wd);
    if (!ad || !g || !v || !wd) st = SKV_ERR_OUT_OF_MEMORY;
    if (!st) {
        skv_cpu_rows_f64(a, n, d, ad);
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, m, d, 1.0, ad, d, 0.0, g, m);
        st = skv_cpu_top_eigvecs(g, m, r, v);
    }
    if (!st) {
        cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r, d, m, 1.0, v, r, ad, d, 0.0, wd, d);
        for (size_t i = 0; i < (size_t)m * r; i++) u[i] = (float)v[i];
        for (size_t i = 0; i < (size_t)r * d; i++) w[i] = (float)wd[i];
    }
    free(ad);
    free(g);
    free(v);
    free(wd);
    return st;
}

#if SKV_CPU_X86
/* Rows [t0, t0 + 6) of u = A V (double accumulate, rounded once), ap: [d][6] scratch. */
SKV_CPU_AVX2 static void skv_cpu_project_rows(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, const double *vb,
                                              int64_t t0, double *ap, float *u)
{
    int32_t nr = (r + 7) / 8, rows = (int32_t)(n - t0 < 6 ? n - t0 : 6);
    for (int32_t i = 0; i < 6; i++)
        for (int32_t k = 0; k < d; k++)
            ap[(size_t)k * 6 + i] = i < rows ? skv_bf16_to_f32(a[(size_t)(t0 + i) * d + k]) : 0.0;
    for (int32_t js = 0; js < nr; js++) {
        double t[48];
        skv_cpu_dkern(d, ap, vb + (size_t)js * d * 8, t);
        for (int32_t i = 0; i < rows; i++)
            for (int32_t j = 0; j < skv_cpu_min(8, r - js * 8); j++)
                u[(size_t)(t0 + i) * r + js * 8 + j] = (float)t[i * 8 + j];
    }
}

typedef struct {
    int64_t n;
    int32_t d, r;
    const skv_bf16 *a;
    const double *vb;
    double *ap; /* [threads][d][6] */
    float *u;
} skv_cpu_proj;

#define SKV_CPU_PROJ_ROWS 48 /* rows of u per work item, 8 slivers of 6 */

SKV_CPU_AVX2 static void skv_cpu_proj_item(void *ctx, int64_t it, int t)
{
    const skv_cpu_proj *p = ctx;
    double *apt = p->ap + (size_t)t * 6 * p->d;
    for (int64_t t0 = it * SKV_CPU_PROJ_ROWS; t0 < (it + 1) * SKV_CPU_PROJ_ROWS && t0 < p->n; t0 += 6)
        skv_cpu_project_rows(p->n, p->d, p->r, p->a, p->vb, t0, apt, p->u);
}

/* g = A^T A (upper) by skv_cpu_gram, v its top eigenvectors, u = A v by the 6x8 kernel; A is streamed,
   so memory stays O(d^2 + block), not O(n d) doubles. */
static skv_status skv_cpu_exact_simd(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u, double *g,
                                     double *v)
{
    int32_t nr = (r + 7) / 8;
    int64_t items = (n + SKV_CPU_PROJ_ROWS - 1) / SKV_CPU_PROJ_ROWS;
    int nt = skv_cpu_team(items);
    double *vb = skv_cpu_alloc((size_t)nr * 8 * d * sizeof *vb);
    double *ap = skv_cpu_alloc((size_t)nt * 6 * d * sizeof *ap);
    skv_status st = vb && ap ? SKV_OK : SKV_ERR_OUT_OF_MEMORY;
    if (!st) st = skv_cpu_gram(n, d, a, g);
    if (!st) st = skv_cpu_top_eigvecs(g, d, r, v);
    if (!st) {
        for (int32_t js = 0; js < nr; js++)
            for (int32_t k = 0; k < d; k++)
                for (int32_t j = 0; j < 8; j++)
                    vb[((size_t)js * d + k) * 8 + j] = js * 8 + j < r ? v[(size_t)k * r + js * 8 + j] : 0.0;
        skv_cpu_proj p = {n, d, r, a, vb, ap, u};
        skv_cpu_run(nt, items, skv_cpu_proj_item, &p);
    }
    free(vb);
    free(ap);
    return st;
}
#endif

/* The same by BLAS-3 on row blocks of ~8 MB of doubles (the portable code). */
static skv_status skv_cpu_exact_blas(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u, double *g,
                                     double *v)
{
    int64_t nb = ((int64_t)1 << 20) / d;
    if (nb < 64) nb = 64;
    if (nb > n) nb = n;
    double *blk = malloc((size_t)nb * d * sizeof *blk), *ub = malloc((size_t)nb * r * sizeof *ub);
    skv_status st = blk && ub ? SKV_OK : SKV_ERR_OUT_OF_MEMORY;
    for (int64_t t = 0; !st && t < n; t += nb) {
        int64_t rows = n - t < nb ? n - t : nb;
        skv_cpu_rows_f64(a + (size_t)t * d, rows, d, blk);
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d, (int)rows, 1.0, blk, d, 1.0, g, d);
    }
    if (!st) st = skv_cpu_top_eigvecs(g, d, r, v);
    for (int64_t t = 0; !st && t < n; t += nb) {
        int64_t rows = n - t < nb ? n - t : nb;
        skv_cpu_rows_f64(a + (size_t)t * d, rows, d, blk);
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)rows, r, d, 1.0, blk, d, v, r, 0.0, ub, r);
        for (size_t i = 0; i < (size_t)rows * r; i++) u[(size_t)t * r + i] = (float)ub[i];
    }
    free(blk);
    free(ub);
    return st;
}

/* The EXACT route: the same math as ref (Gram matrix in double, LAPACK dsyevr, U = A V_r in double). */
static skv_status skv_cpu_factorize_exact(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u,
                                          float *w)
{
    if (n < d) return skv_cpu_factorize_wide(n, d, r, a, u, w);
    double *g = calloc((size_t)d * d, sizeof *g), *v = malloc((size_t)d * r * sizeof *v);
    skv_status st = g && v ? SKV_OK : SKV_ERR_OUT_OF_MEMORY;
    if (!st) {
#if SKV_CPU_X86
        if (skv_cpu_simd()) st = skv_cpu_exact_simd(n, d, r, a, u, g, v);
        else
#endif
            st = skv_cpu_exact_blas(n, d, r, a, u, g, v);
    }
    if (!st)
        for (int32_t q = 0; q < r; q++)
            for (int32_t i = 0; i < d; i++) w[(size_t)q * d + i] = (float)v[(size_t)i * r + q];
    free(g);
    free(v);
    return st;
}

/* The route of lib/skv_factor.h for the caller's choice; without SIMD the EXACT route for
   every shape. */
skv_status skv_cpu_factorize(skv_factorize_route mode, int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u,
                             float *w)
{
#if SKV_CPU_X86
    if (mode != SKV_FACTORIZE_CANONICAL && skv_cpu_simd() && skv_factor_route_for(n, d, r, mode) == SKV_ROUTE_FAST)
        return skv_cpu_factorize_fast(n, d, r, a, u, w, mode); /* no BLAS */
#endif
    skv_cpu_blas_begin();
    skv_status st = mode == SKV_FACTORIZE_CANONICAL ? skv_cpu_factorize_canonical(n, d, r, a, u, w)
                                                    : skv_cpu_factorize_exact(n, d, r, a, u, w);
    skv_cpu_blas_end();
    return st;
}
