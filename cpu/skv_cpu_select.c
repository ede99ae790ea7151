/*
 * score_select: landmark scores, softmax, group max, top-S per KV head.
 */
#include <string.h>

#include "skv_cpu_kernels.h"
#include "skv_cpu_ops.h"
#include "skv_cpu_simd.h"

#if SKV_CPU_X86
/*
 * dot(q_g, L_j) for 8 candidates j (rows L, L+D, ...) and 4 queries qf[4][D]:
 * lanes are candidates, each lane is skv_dot_bf16's fmaf chain over d = 0..D-1
 * from 0, so the values are bit-identical to it. out[g*ld + lane].
 */
SKV_CPU_AVX2 static void skv_cpu_dot8x4(const float *qf, int D, const skv_bf16 *L, float *out, int64_t ld)
{
    const skv_bf16 *p[8];
    for (int i = 0; i < 8; i++) p[i] = L + (size_t)i * D;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) r[i] = skv_cpu_ld8(p[i] + d);
        skv_cpu_transpose8(r);
        for (int e = 0; e < 8; e++) {
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + d + e), r[e], a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + D + d + e), r[e], a1);
            a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + 2 * D + d + e), r[e], a2);
            a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + 3 * D + d + e), r[e], a3);
        }
    }
    for (; d < D; d++) {
        __m256 x = skv_cpu_col8(p, d);
        a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + d), x, a0);
        a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + D + d), x, a1);
        a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + 2 * D + d), x, a2);
        a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + 3 * D + d), x, a3);
    }
    _mm256_storeu_ps(out, a0);
    _mm256_storeu_ps(out + ld, a1);
    _mm256_storeu_ps(out + 2 * ld, a2);
    _mm256_storeu_ps(out + 3 * ld, a3);
}

/* sg[g * ld + j] = dot(q_g, L_j) for the candidates [j0, j1) of 4 queries: 8 at a time, then the rest by
   skv_dot_f32_bf16 (flatten: inlined here, so its fmaf is one instruction, not a libm call). */
SKV_CPU_AVX2 __attribute__((flatten)) static void skv_cpu_dots_avx2(const float *qg, int D, const skv_bf16 *L,
                                                                    int32_t j0, int32_t j1, float *sg, int64_t ld)
{
    int32_t j = j0;
    for (; j + 8 <= j1; j += 8) skv_cpu_dot8x4(qg, D, L + (size_t)j * D, sg + j, ld);
    for (; j < j1; j++)
        for (int g = 0; g < 4; g++) sg[g * ld + j] = skv_dot_f32_bf16(qg + g * D, L + (size_t)j * D, D);
}

/* skv_softmax_inplace with FMA instructions: the same IEEE results, no libm fmaf calls. */
SKV_CPU_AVX2 __attribute__((flatten)) static void skv_cpu_softmax_fma(float *s, int64_t n)
{
    skv_softmax_inplace(s, n);
}
#endif

/*
 * One job of items (head, group of 4 queries, block of SKV_CPU_SEL_JB
 * candidates), no barrier inside (skv_cpu_run). The item that completes the
 * last block of a (head, group) row runs that row's softmax; the one that
 * completes the last row of a head takes the group max and the head's top-S.
 * Every value is computed by the same function in the same order whichever
 * thread runs it, so the result does not depend on the thread count.
 */
#define SKV_CPU_SEL_JB 64 /* candidates per work item */

typedef struct {
    int32_t G, G4, NG, D, n_cand, nblk, simd;
    const skv_select_params *sp;
    float scale;
    const skv_bf16 *landmarks;
    const int32_t *candidate_ids;
    int32_t *sel_idx, *sel_ids, *counts;
    float *amax, *s, *qf, *a;
    int32_t *scratch, *done;
} skv_cpu_sel;

static void skv_cpu_sel_item(void *ctx, int64_t it, int t)
{
    const skv_cpu_sel *c = ctx;
    const int32_t G = c->G, G4 = c->G4, NG = c->NG, D = c->D, n_cand = c->n_cand, S = c->sp->stride, nblk = c->nblk;
    const int32_t b = (int32_t)(it % nblk), g4 = (int32_t)(it / nblk % NG), h = (int32_t)(it / nblk / NG);
    const int32_t j0 = b * SKV_CPU_SEL_JB, j1 = skv_cpu_min(j0 + SKV_CPU_SEL_JB, n_cand);
    const skv_bf16 *L = c->landmarks + (size_t)h * n_cand * D;
    const float *qg = c->qf + ((size_t)h * G4 + g4 * 4) * D;
    float *sg = c->s + ((size_t)h * G4 + g4 * 4) * n_cand;
    int32_t j = j0;
    (void)t;
    /* s = dot(q, L) * scale */
#if SKV_CPU_X86
    if (c->simd) skv_cpu_dots_avx2(qg, D, L, j0, j1, sg, n_cand), j = j1;
#endif
    for (; j < j1; j++)
        for (int g = 0; g < 4; g++) sg[g * n_cand + j] = skv_dot_f32_bf16(qg + g * D, L + (size_t)j * D, D);
    for (int g = 0; g < 4; g++)
        for (j = j0; j < j1; j++) sg[g * n_cand + j] = SKV_MUL(sg[g * n_cand + j], c->scale);
    if (!skv_cpu_last(&c->done[(size_t)h * (NG + 1) + g4], nblk)) return;
    /* the row's last block: softmax of its queries, exactly as ref */
    for (int g = 0; g < 4 && g4 * 4 + g < G; g++) {
#if SKV_CPU_X86
        if (c->simd) {
            skv_cpu_softmax_fma(sg + (size_t)g * n_cand, n_cand);
            continue;
        }
#endif
        skv_softmax_inplace(sg + (size_t)g * n_cand, n_cand);
    }
    if (!skv_cpu_last(&c->done[(size_t)h * (NG + 1) + NG], NG)) return;
    /* the head's last row: max over the group, top-S */
    float *ah = c->a + (size_t)h * n_cand;
    const float *sh = c->s + (size_t)h * G4 * n_cand;
    memcpy(ah, sh, (size_t)n_cand * sizeof *ah);
    for (int32_t g = 1; g < G; g++)
        for (j = 0; j < n_cand; j++)
            if (sh[(size_t)g * n_cand + j] > ah[j]) ah[j] = sh[(size_t)g * n_cand + j];
    if (c->amax) memcpy(c->amax + (size_t)h * n_cand, ah, (size_t)n_cand * sizeof *ah);
    const int32_t k = skv_select_head(ah, n_cand, c->sp, c->scratch + (size_t)2 * h * n_cand,
                                      c->sel_idx + (size_t)h * S,
                                      c->candidate_ids ? c->candidate_ids + (size_t)h * n_cand : NULL,
                                      c->sel_ids ? c->sel_ids + (size_t)h * S : NULL);
    if (c->counts) c->counts[h] = k;
}

skv_status skv_cpu_score_select(int32_t Hq, int32_t Hk, int32_t D, int32_t n_cand, const skv_select_params *sp,
                                float scale, const skv_bf16 *q, const skv_bf16 *landmarks,
                                const int32_t *candidate_ids, int32_t *sel_idx, int32_t *sel_ids, float *amax,
                                int32_t *counts, skv_ws *ws)
{
    skv_cpu_sel c = {Hq / Hk, 0, 0, D, n_cand, (n_cand + SKV_CPU_SEL_JB - 1) / SKV_CPU_SEL_JB, skv_cpu_simd(), sp,
                     scale, landmarks, candidate_ids, sel_idx, sel_ids, counts, amax, NULL, NULL, NULL, NULL, NULL};
    c.G4 = (c.G + 3) / 4 * 4, c.NG = c.G4 / 4; /* queries padded to groups of 4 (zero rows) */
    const int64_t items = (int64_t)Hk * c.NG * c.nblk;
    c.s = skv_ws_alloc(ws, (size_t)Hk * c.G4 * n_cand * sizeof *c.s); /* scores, then probabilities */
    c.qf = skv_ws_alloc(ws, (size_t)Hk * c.G4 * D * sizeof *c.qf);
    c.a = skv_ws_alloc(ws, (size_t)Hk * n_cand * sizeof *c.a);
    c.scratch = skv_ws_alloc(ws, (size_t)2 * Hk * n_cand * sizeof *c.scratch); /* skv_select_head's, per head */
    c.done = skv_ws_alloc(ws, (size_t)Hk * (c.NG + 1) * sizeof *c.done); /* blocks per row, rows per head */
    if (!c.s || !c.qf || !c.a || !c.scratch || !c.done) return SKV_ERR_OUT_OF_MEMORY; /* the caller resets ws */
    memset(c.qf, 0, (size_t)Hk * c.G4 * D * sizeof *c.qf);
    memset(c.done, 0, (size_t)Hk * (c.NG + 1) * sizeof *c.done);
    for (int32_t i = 0; i < Hq; i++)
        skv_cpu_to_f32(q + (size_t)i * D, c.qf + ((size_t)(i / c.G) * c.G4 + i % c.G) * D, D);
    skv_cpu_run(skv_cpu_team(items), items, skv_cpu_sel_item, &c);
    return SKV_OK;
}

/* skv_ws_alloc bytes of one call with at most cand_max candidates. */
size_t skv_cpu_select_ws_bytes(const skv_config *cfg, int32_t cand_max)
{
    size_t Hq = (size_t)cfg->n_q_heads, Hk = (size_t)cfg->n_kv_heads, D = (size_t)cfg->head_dim;
    size_t n = (size_t)cand_max, G4 = (Hq / Hk + 3) / 4 * 4;
    return SKV_WS_BYTES(sizeof(float) * (Hk * G4 * n + Hk * G4 * D + 3 * Hk * n) + sizeof(int32_t) * Hk * (G4 / 4 + 1), 5);
}
