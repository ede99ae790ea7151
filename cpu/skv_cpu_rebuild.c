/*
 * rebuild_keys: K = U_sel W per KV head, then RoPE.
 */
#include <omp.h>
#include <cblas.h>

#include "skv_cpu_simd.h"

/* ---- rebuild keys --------------------------------------------------------------------- */

/*
 * The decode hot spot: per KV head, X = U_sel W_h (M = S*c rows, K = r,
 * N = D), float accumulation (tolerance-checked, docs/DESIGN.md section 6), then
 * RoPE. Fused per work item of 48 rows: gather the rows' U (bf16 -> float,
 * packed), the 6x16 kernel against W_h packed once per call, RoPE, store; the
 * float X never leaves the thread's cache.
 */
skv_status skv_cpu_rebuild_keys(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r,
                                       int32_t c, int32_t S, int64_t n, const skv_bf16 *u,
                                       const skv_bf16 *w, const int32_t *chunk_ids,
                                       const float *cos_tab, const float *sin_tab, skv_bf16 *k_out,
                                       skv_ws *ws)
{
    (void)n;
    int32_t R = rope->rotary_dim ? rope->rotary_dim : D, h2 = R / 2;
    int64_t M = (int64_t)S * c, width = (int64_t)Hk * D;
#if SKV_CPU_SIMD
    enum { RB = SKV_CPU_RB };
    int32_t ns = (D + 15) / 16, Dp = ns * 16;
    int64_t nrb = (M + RB - 1) / RB, items = (int64_t)Hk * nrb;
    int nt = omp_get_max_threads();
    size_t per_thread = (size_t)RB * r + (size_t)RB * Dp;
    float *wb = skv_ws_alloc(ws, (size_t)Hk * ns * r * 16 * sizeof *wb); /* [h][sliver][k][16] */
    float *buf = skv_ws_alloc(ws, (size_t)nt * per_thread * sizeof *buf);
    if (!wb || !buf) return SKV_ERR_OUT_OF_MEMORY;
#pragma omp parallel num_threads(nt)
    {
        float *ap = buf + (size_t)omp_get_thread_num() * per_thread, *x = ap + (size_t)RB * r;
#pragma omp for schedule(static)
        for (int64_t hk = 0; hk < (int64_t)Hk * r; hk++) {
            int64_t h = hk / r, k = hk % r;
            const skv_bf16 *wr = w + (size_t)k * width + h * D;
            for (int32_t j = 0; j < Dp; j++)
                wb[(((size_t)h * ns + j / 16) * r + k) * 16 + j % 16] = j < D ? skv_bf16_to_f32(wr[j]) : 0.0f;
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            int64_t h = it / nrb, m0 = it % nrb * RB;
            int32_t rows = (int32_t)(M - m0 < RB ? M - m0 : RB), nsl = (rows + 5) / 6;
            for (int32_t i = 0; i < nsl * 6; i++) { /* ap[sliver][k][6] */
                float *dst = ap + (size_t)(i / 6) * 6 * r + i % 6;
                if (i < rows) {
                    int64_t m = m0 + i, t = (int64_t)chunk_ids[h * S + m / c] * c + m % c;
                    const skv_bf16 *ur = u + (size_t)t * r;
                    for (int32_t k = 0; k < r; k++) dst[(size_t)k * 6] = skv_bf16_to_f32(ur[k]);
                } else {
                    for (int32_t k = 0; k < r; k++) dst[(size_t)k * 6] = 0.0f;
                }
            }
            for (int32_t q = 0; q < nsl; q++)
                for (int32_t js = 0; js < ns; js++)
                    skv_cpu_skern(r, ap + (size_t)q * 6 * r, wb + ((size_t)h * ns + js) * r * 16,
                                  x + (size_t)q * 6 * Dp + js * 16, Dp);
            for (int32_t i = 0; i < rows; i++) {
                int64_t m = m0 + i, t = (int64_t)chunk_ids[h * S + m / c] * c + m % c;
                skv_cpu_rope_row(x + (size_t)i * Dp, D, R, rope->interleaved, cos_tab + t * h2, sin_tab + t * h2,
                                 k_out + ((size_t)h * M + m) * D);
            }
        }
    }
#else
    /* portable build: gather U rows as float, one sgemm per head (W_h in place, ldb = Hk*D), RoPE */
    int64_t rows = (int64_t)Hk * M;
    float *wf = skv_ws_alloc(ws, (size_t)r * width * sizeof *wf);
    float *uf = skv_ws_alloc(ws, (size_t)rows * r * sizeof *uf);
    float *x = skv_ws_alloc(ws, (size_t)rows * D * sizeof *x);
    if (!wf || !uf || !x) return SKV_ERR_OUT_OF_MEMORY;
    skv_cpu_to_f32(w, wf, (int64_t)r * width);
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < rows; row++) { /* row = (h*S + s)*c + i */
        int64_t t = (int64_t)chunk_ids[row / c] * c + row % c;
        skv_cpu_to_f32(u + (size_t)t * r, uf + (size_t)row * r, r);
    }
    for (int32_t h = 0; h < Hk; h++)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, D, r, 1.0f, uf + (size_t)h * M * r, r,
                    wf + (size_t)h * D, (int)width, 0.0f, x + (size_t)h * M * D, D);
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < rows; row++) {
        int64_t t = (int64_t)chunk_ids[row / c] * c + row % c;
        skv_cpu_rope_row(x + (size_t)row * D, D, R, rope->interleaved, cos_tab + t * h2, sin_tab + t * h2,
                         k_out + (size_t)row * D);
    }
#endif
    return SKV_OK;
}

