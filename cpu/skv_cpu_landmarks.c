/*
 * landmarks_outliers: chunk means and their cosine scores, top-O outliers.
 */
#include <stdlib.h>
#include <string.h>

#include "skv_cpu_ops.h"
#include "skv_cpu_simd.h"

#if SKV_CPU_X86
/*
 * skv_chunk_landmark_score, vectorized across the chunk's tokens: lane i is
 * token i's cos chain (ab, aa, bb: fmaf over d in order, from 0), so each lane
 * reproduces the scalar function's value exactly; the min over tokens is then
 * taken in token order with the same NaN rule. The mean is vectorized over d
 * (each d is its own in-order token sum).
 */
SKV_CPU_AVX2 static float skv_cpu_chunk_score_avx2(const skv_bf16 *k, int64_t ts, int c, int D, float *mean)
{
    int d = 0;
    __m256 cv = _mm256_set1_ps((float)c);
    for (; d + 8 <= D; d += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int t = 0; t < c; t++) acc = _mm256_add_ps(acc, skv_cpu_ld8(k + t * ts + d));
        _mm256_storeu_ps(mean + d, _mm256_div_ps(acc, cv));
    }
    for (; d < D; d++) {
        float acc = 0.0f;
        for (int t = 0; t < c; t++) acc = SKV_ADD(acc, skv_bf16_to_f32(k[t * ts + d]));
        mean[d] = SKV_DIV(acc, (float)c);
    }
    float best = 0.0f;
    for (int t0 = 0; t0 < c; t0 += 8) {
        int nt = skv_cpu_min(8, c - t0);
        const skv_bf16 *p[8];
        for (int i = 0; i < 8; i++) p[i] = k + (t0 + skv_cpu_min(i, nt - 1)) * ts; /* pad: repeat a row */
        __m256 ab = _mm256_setzero_ps(), aa = ab, bb = ab;
        for (d = 0; d + 8 <= D; d += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = skv_cpu_ld8(p[i] + d);
            skv_cpu_transpose8(r);
            for (int e = 0; e < 8; e++) {
                __m256 m = _mm256_broadcast_ss(mean + d + e);
                ab = _mm256_fmadd_ps(r[e], m, ab);
                aa = _mm256_fmadd_ps(r[e], r[e], aa);
                bb = _mm256_fmadd_ps(m, m, bb);
            }
        }
        for (; d < D; d++) {
            __m256 x = skv_cpu_col8(p, d), m = _mm256_broadcast_ss(mean + d);
            ab = _mm256_fmadd_ps(x, m, ab);
            aa = _mm256_fmadd_ps(x, x, aa);
            bb = _mm256_fmadd_ps(m, m, bb);
        }
        /* vmaxps(x, 1e-8) returns 1e-8 when x is NaN, as fmaxf does */
        __m256 den = _mm256_max_ps(_mm256_mul_ps(_mm256_sqrt_ps(aa), _mm256_sqrt_ps(bb)), _mm256_set1_ps(1e-8f));
        float sv[8];
        _mm256_storeu_ps(sv, _mm256_div_ps(ab, den));
        for (int i = 0; i < nt; i++) {
            float s = sv[i];
            if (t0 + i == 0 || s < best || s != s) best = s;
            if (best != best) return best;
        }
    }
    return best;
}
#endif

static float skv_cpu_chunk_score(const skv_bf16 *k, int64_t ts, int c, int D, float *mean)
{
#if SKV_CPU_X86
    if (skv_cpu_simd()) return skv_cpu_chunk_score_avx2(k, ts, c, D, mean);
#endif
    return skv_chunk_landmark_score(k, ts, c, D, mean);
}

typedef struct {
    int32_t N, c, Hk, D, O, n_cand;
    const skv_bf16 *k_post;
    int32_t *outlier_ids, *candidate_ids;
    skv_bf16 *landmarks;
    skv_bf16 *lm; /* every chunk's landmark, [Hk, N, D] */
    float *key;
    int32_t *scratch;
    char *is_out;
} skv_cpu_lmo;

#define SKV_CPU_LM_CHUNKS 16 /* (chunk, head) pairs per work item of the first job */

/* The first job: chunk scores and landmarks. Token-major input: chunk j of head h is c rows of stride Hk*D. */
static void skv_cpu_lmo_score(void *ctx, int64_t it, int t)
{
    const skv_cpu_lmo *L = ctx;
    int64_t nh = (int64_t)L->Hk * L->N;
    (void)t;
    for (int64_t jh = it * SKV_CPU_LM_CHUNKS; jh < (it + 1) * SKV_CPU_LM_CHUNKS && jh < nh; jh++) {
        int64_t j = jh / L->Hk, h = jh % L->Hk;
        float mean[SKV_CPU_MAX_D];
        float s = skv_cpu_chunk_score(L->k_post + ((size_t)j * L->c * L->Hk + h) * L->D, (int64_t)L->Hk * L->D, L->c,
                                      L->D, mean);
        L->key[h * L->N + j] = skv_outlier_key(s);
        skv_bf16 *l = L->lm + ((size_t)h * L->N + j) * L->D;
        for (int32_t d = 0; d < L->D; d++) l[d] = skv_f32_to_bf16(mean[d]);
    }
}

/* The second job: head h's top-O outliers, the candidates and their landmarks in chunk order. */
static void skv_cpu_lmo_head(void *ctx, int64_t h, int t)
{
    const skv_cpu_lmo *L = ctx;
    int32_t N = L->N, O = L->O, D = L->D, n_cand = L->n_cand;
    (void)t;
    int32_t *oid = O > 0 ? L->outlier_ids + (size_t)h * O : NULL; /* may be NULL when O == 0 */
    char *mark = L->is_out + (size_t)h * N;
    if (O > 0) skv_topk_indices(L->key + (size_t)h * N, N, O, 1, L->scratch + (size_t)h * N, oid);
    for (int32_t o = 0; o < O; o++) mark[oid[o]] = 1;
    int32_t m = 0;
    for (int32_t j = 0; j < N; j++) {
        if (mark[j]) continue;
        L->candidate_ids[(size_t)h * n_cand + m] = j;
        memcpy(L->landmarks + ((size_t)h * n_cand + m) * D, L->lm + ((size_t)h * N + j) * D, (size_t)D * sizeof *L->lm);
        m++;
    }
}

skv_status skv_cpu_landmarks_outliers(int32_t N, int32_t c, int32_t Hk, int32_t D, int32_t O,
                                      const skv_bf16 *k_post, int32_t *outlier_ids, int32_t *candidate_ids,
                                      skv_bf16 *landmarks)
{
    if (N <= 0 || O < 0 || O >= N) return SKV_ERR_INVALID_ARGUMENT;
    size_t nh = (size_t)Hk * N;
    skv_cpu_lmo L = {N, c, Hk, D, O, N - O, k_post, outlier_ids, candidate_ids, landmarks,
                     malloc(nh * D * sizeof *L.lm), malloc(nh * sizeof *L.key), malloc(nh * sizeof *L.scratch),
                     calloc(nh, 1)};
    if (L.lm && L.key && L.scratch && L.is_out) {
        int64_t items = ((int64_t)nh + SKV_CPU_LM_CHUNKS - 1) / SKV_CPU_LM_CHUNKS;
        skv_cpu_run(skv_cpu_team(items), items, skv_cpu_lmo_score, &L);
        skv_cpu_run(skv_cpu_team(Hk), Hk, skv_cpu_lmo_head, &L);
    }
    skv_status st = L.lm && L.key && L.scratch && L.is_out ? SKV_OK : SKV_ERR_OUT_OF_MEMORY;
    free(L.lm);
    free(L.key);
    free(L.scratch);
    free(L.is_out);
    return st;
}
