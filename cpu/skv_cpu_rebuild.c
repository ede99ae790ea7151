/*
 * rebuild_keys: K = U_sel W_h per KV head (M = S*c rows, K = r, N = D), float
 * accumulation (tolerance-checked, DESIGN.md section 6), then RoPE. The decode
 * hot spot.
 */
#include <string.h>

#include <cblas.h>

#include "skv_cpu_kernels.h"
#include "skv_cpu_ops.h"
#include "skv_cpu_simd.h"

#if SKV_CPU_X86
/*
 * Rows [m0, m0 + rows) of head h, fused: gather the rows' U (bf16 -> float,
 * packed as 6-row slivers ap [sliver][k][6]), the 6 x nw kernel (nw = 16:
 * AVX2, 32: AVX-512F; the same values) against W_h (wb: [sliver][k][nw])
 * into x [rows][Dp] (float accumulation, tolerance-checked, docs/DESIGN.md section 6), RoPE, store; the float X never leaves the thread's cache.
 */
SKV_CPU_AVX2 static void skv_cpu_rebuild_rows(const skv_rope_config *rope, int32_t D, int32_t r, int32_t c,
                                              int32_t S, int32_t nw, int64_t h, int64_t m0, int32_t rows,
                                              const skv_bf16 *u, const float *wb, const int32_t *chunk_ids,
                                              const float *cos_tab, const float *sin_tab, float *ap, float *x,
                                              skv_bf16 *k_out)
{
    int32_t R = rope->rotary_dim ? rope->rotary_dim : D, h2 = R / 2, ns = (D + nw - 1) / nw, Dp = ns * nw;
    int32_t nsl = (rows + 5) / 6;
    int64_t M = (int64_t)S * c;
    for (int32_t i = 0; i < nsl * 6; i++) {
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
        for (int32_t js = 0; js < ns; js++) {
            const float *a = ap + (size_t)q * 6 * r, *b = wb + (size_t)js * r * nw;
            float *xt = x + (size_t)q * 6 * Dp + js * nw;
            if (nw == 32) skv_cpu_zkern(r, a, b, xt, Dp);
            else skv_cpu_skern(r, a, b, xt, Dp);
        }
    for (int32_t i = 0; i < rows; i++) {
        int64_t m = m0 + i, t = (int64_t)chunk_ids[h * S + m / c] * c + m % c;
        skv_cpu_rope_row(x + (size_t)i * Dp, D, R, rope->interleaved, cos_tab + t * h2, sin_tab + t * h2,
                         k_out + ((size_t)h * M + m) * D);
    }
}

/* W_h packed as nw-column slivers, wb [sliver][k][nw], zero past D. */
static void skv_cpu_pack_w(int32_t D, int32_t Hk, int32_t r, int32_t nw, int64_t h, const skv_bf16 *w, float *wb)
{
    int32_t Dp = (D + nw - 1) / nw * nw;
    for (int32_t k = 0; k < r; k++) {
        const skv_bf16 *wr = w + (size_t)k * Hk * D + h * D;
        for (int32_t j = 0; j < Dp; j++) wb[((size_t)(j / nw) * r + k) * nw + j % nw] = j < D ? skv_bf16_to_f32(wr[j]) : 0.0f;
    }
}

/* Sliver width of rebuild's kernel: 32 (AVX-512F) unless that pads D more than 16 does. */
static int32_t skv_cpu_rebuild_nw(int32_t D)
{
    return skv_cpu_simd() >= SKV_CPU_LEVEL_AVX512 && (D + 31) / 32 * 32 == (D + 15) / 16 * 16 ? 32 : 16;
}

typedef struct {
    const skv_rope_config *rope;
    int32_t D, Hk, r, c, S, nw, Dp;
    int64_t M, nrb;
    const skv_bf16 *u, *w;
    const int32_t *chunk_ids, *counts;
    const float *cos_tab, *sin_tab;
    skv_bf16 *k_out;
    float *wb;         /* every head's W, packed: [Hk][Dp * r] */
    int32_t *ready;    /* [Hk]: 1 once that head's W is in wb */
    float *buf;        /* per thread: ap, x, a private W */
    size_t per_thread;
    int64_t *packed;   /* per thread: the head whose W is in its private buffer, or -1 */
} skv_cpu_reb;

/*
 * Items 0 .. Hk-1 pack one head's W each into the shared wb; the others are
 * SKV_CPU_RB rows of one head. A row item whose head is not packed yet (its
 * packing item still running, on a thread the scheduler may have
 * descheduled) packs a private copy rather than wait.
 */
static void skv_cpu_reb_item(void *ctx, int64_t it, int t)
{
    const skv_cpu_reb *c = ctx;
    size_t wsz = (size_t)c->Dp * c->r;
    if (it < c->Hk) {
        skv_cpu_pack_w(c->D, c->Hk, c->r, c->nw, it, c->w, c->wb + (size_t)it * wsz);
        __atomic_store_n(&c->ready[it], 1, __ATOMIC_RELEASE);
        return;
    }
    it -= c->Hk;
    int64_t h = it / c->nrb, m0 = it % c->nrb * SKV_CPU_RB;
    const int64_t lim = c->counts ? (int64_t)c->counts[h] * c->c : c->M; /* the head's rows */
    if (m0 >= lim) return;
    float *ap = c->buf + (size_t)t * c->per_thread, *x = ap + (size_t)SKV_CPU_RB * c->r, *wb = x + (size_t)SKV_CPU_RB * c->Dp;
    if (__atomic_load_n(&c->ready[h], __ATOMIC_ACQUIRE)) wb = c->wb + (size_t)h * wsz;
    else if (c->packed[t] != h) skv_cpu_pack_w(c->D, c->Hk, c->r, c->nw, h, c->w, wb), c->packed[t] = h;
    skv_cpu_rebuild_rows(c->rope, c->D, c->r, c->c, c->S, c->nw, h, m0, (int32_t)(lim - m0 < SKV_CPU_RB ? lim - m0 : SKV_CPU_RB),
                         c->u, wb, c->chunk_ids, c->cos_tab, c->sin_tab, ap, x, c->k_out);
}

/* One job (skv_cpu_run): the W packing items, then the row items. */
static skv_status skv_cpu_rebuild_simd(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r, int32_t c,
                                       int32_t S, const skv_bf16 *u, const skv_bf16 *w, const int32_t *chunk_ids,
                                       const int32_t *counts, const float *cos_tab, const float *sin_tab,
                                       skv_bf16 *k_out, skv_ws *ws)
{
    int32_t nw = skv_cpu_rebuild_nw(D), Dp = (D + nw - 1) / nw * nw;
    int64_t M = (int64_t)S * c, nrb = (M + SKV_CPU_RB - 1) / SKV_CPU_RB, items = Hk + (int64_t)Hk * nrb;
    int nt = skv_cpu_team(items);
    skv_cpu_reb job = {rope, D, Hk, r, c, S, nw, Dp, M, nrb, u, w, chunk_ids, counts, cos_tab, sin_tab, k_out, NULL, NULL, NULL,
                       (size_t)SKV_CPU_RB * r + (size_t)SKV_CPU_RB * Dp + (size_t)Dp * r, NULL};
    job.wb = skv_ws_alloc(ws, (size_t)Hk * Dp * r * sizeof *job.wb);
    job.ready = skv_ws_alloc(ws, (size_t)Hk * sizeof *job.ready);
    job.buf = skv_ws_alloc(ws, (size_t)nt * job.per_thread * sizeof *job.buf);
    job.packed = skv_ws_alloc(ws, (size_t)nt * sizeof *job.packed);
    if (!job.wb || !job.ready || !job.buf || !job.packed) return SKV_ERR_OUT_OF_MEMORY;
    memset(job.ready, 0, (size_t)Hk * sizeof *job.ready);
    for (int t = 0; t < nt; t++) job.packed[t] = -1;
    skv_cpu_run(nt, items, skv_cpu_reb_item, &job);
    return SKV_OK;
}
#endif

/* The portable code's three jobs: U rows gathered as float; one OpenBLAS sgemm per head (an item
   each, on its thread alone: W_h in place, ldb = Hk*D); RoPE. */
typedef struct {
    const skv_rope_config *rope;
    int32_t D, Hk, r, c, R;
    int64_t M, rows;
    const skv_bf16 *u;
    const int32_t *chunk_ids, *counts;
    const float *cos_tab, *sin_tab;
    float *wf, *uf, *x;
    skv_bf16 *k_out;
} skv_cpu_reb_blas;

#define SKV_CPU_RB_ROWS 64 /* rows per item of the gather and RoPE jobs */

static void skv_cpu_reb_gather_item(void *ctx, int64_t it, int t)
{
    const skv_cpu_reb_blas *B = ctx;
    (void)t;
    for (int64_t row = it * SKV_CPU_RB_ROWS; row < (it + 1) * SKV_CPU_RB_ROWS && row < B->rows; row++) {
        if (B->counts && row % B->M >= (int64_t)B->counts[row / B->M] * B->c) { /* past the head's count */
            memset(B->uf + (size_t)row * B->r, 0, (size_t)B->r * sizeof *B->uf);
            continue;
        }
        int64_t tok = (int64_t)B->chunk_ids[row / B->c] * B->c + row % B->c; /* row = (h*S + s)*c + i */
        skv_cpu_to_f32(B->u + (size_t)tok * B->r, B->uf + (size_t)row * B->r, B->r);
    }
}

static void skv_cpu_reb_gemm_item(void *ctx, int64_t h, int t)
{
    const skv_cpu_reb_blas *B = ctx;
    (void)t;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)B->M, B->D, B->r, 1.0f, B->uf + (size_t)h * B->M * B->r,
                B->r, B->wf + (size_t)h * B->D, (int)((int64_t)B->Hk * B->D), 0.0f, B->x + (size_t)h * B->M * B->D, B->D);
}

static void skv_cpu_reb_rope_item(void *ctx, int64_t it, int t)
{
    const skv_cpu_reb_blas *B = ctx;
    int32_t h2 = B->R / 2;
    (void)t;
    for (int64_t row = it * SKV_CPU_RB_ROWS; row < (it + 1) * SKV_CPU_RB_ROWS && row < B->rows; row++) {
        if (B->counts && row % B->M >= (int64_t)B->counts[row / B->M] * B->c) continue;
        int64_t tok = (int64_t)B->chunk_ids[row / B->c] * B->c + row % B->c;
        skv_cpu_rope_row(B->x + (size_t)row * B->D, B->D, B->R, B->rope->interleaved, B->cos_tab + tok * h2,
                         B->sin_tab + tok * h2, B->k_out + (size_t)row * B->D);
    }
}

static skv_status skv_cpu_rebuild_blas(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r, int32_t c,
                                       int32_t S, const skv_bf16 *u, const skv_bf16 *w, const int32_t *chunk_ids,
                                       const int32_t *counts, const float *cos_tab, const float *sin_tab,
                                       skv_bf16 *k_out, skv_ws *ws)
{
    int64_t M = (int64_t)S * c, width = (int64_t)Hk * D, rows = (int64_t)Hk * M;
    int64_t items = (rows + SKV_CPU_RB_ROWS - 1) / SKV_CPU_RB_ROWS;
    skv_cpu_reb_blas B = {rope, D, Hk, r, c, rope->rotary_dim ? rope->rotary_dim : D, M, rows, u, chunk_ids, counts,
                          cos_tab, sin_tab, NULL, NULL, NULL, k_out};
    B.wf = skv_ws_alloc(ws, (size_t)r * width * sizeof *B.wf);
    B.uf = skv_ws_alloc(ws, (size_t)rows * r * sizeof *B.uf);
    B.x = skv_ws_alloc(ws, (size_t)rows * D * sizeof *B.x);
    if (!B.wf || !B.uf || !B.x) return SKV_ERR_OUT_OF_MEMORY;
    skv_cpu_to_f32(w, B.wf, (int64_t)r * width);
    skv_cpu_run(skv_cpu_team(items), items, skv_cpu_reb_gather_item, &B);
    skv_cpu_blas_begin();
    skv_cpu_run(skv_cpu_team(Hk), Hk, skv_cpu_reb_gemm_item, &B);
    skv_cpu_blas_end();
    skv_cpu_run(skv_cpu_team(items), items, skv_cpu_reb_rope_item, &B);
    return SKV_OK;
}

skv_status skv_cpu_rebuild_keys(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r, int32_t c,
                                int32_t S, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                                const int32_t *chunk_ids, const int32_t *counts, const float *cos_tab,
                                const float *sin_tab, skv_bf16 *k_out, skv_ws *ws)
{
    (void)n;
#if SKV_CPU_X86
    if (skv_cpu_simd())
        return skv_cpu_rebuild_simd(rope, D, Hk, r, c, S, u, w, chunk_ids, counts, cos_tab, sin_tab, k_out, ws);
#endif
    return skv_cpu_rebuild_blas(rope, D, Hk, r, c, S, u, w, chunk_ids, counts, cos_tab, sin_tab, k_out, ws);
}

/* skv_ws_alloc bytes of one call for a cache's config (S chunks per head), nt threads. */
size_t skv_cpu_rebuild_ws_bytes(const skv_config *cfg, int32_t S, int nt)
{
    size_t Hk = (size_t)cfg->n_kv_heads, D = (size_t)cfg->head_dim, r = (size_t)skv_cfg_rank(cfg), f = sizeof(float);
    if (skv_cpu_simd()) {
        size_t Dpw = (D + 31) / 32 * 32; /* the padded width of either kernel */
        return SKV_WS_BYTES(f * (Hk * Dpw * r + (size_t)nt * (SKV_CPU_RB * (r + Dpw) + Dpw * r)) +
                                sizeof(int32_t) * Hk + sizeof(int64_t) * (size_t)nt, 4);
    }
    size_t M = (size_t)S * (size_t)cfg->chunk_size; /* S * c tokens per head */
    return SKV_WS_BYTES(f * (r * Hk * D + Hk * M * r + Hk * M * D), 3);
}
