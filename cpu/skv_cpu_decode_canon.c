/*
 * The canonical rebuild and attention of the reproducible mode (docs/DESIGN.md
 * 10.2, 10.3) on the cpu: the same values as ref, bit for bit, in other
 * schedules.
 *
 *  - rebuild: the fixed-point integers of U rows and W_h columns as doubles, and
 *    their sums by double FMA (AVX2: 4 rows x 16 dims of accumulators): every
 *    product is an integer below 2^26 and every partial sum one below r 2^26 <
 *    2^53, so each FMA is exact and the order does not matter; then
 *    skv_canon_rebuild_key, RoPE (skv_cpu_rope_row, skv_rope_row_f32's bits) and bf16.
 *    Without SIMD: int64 sums.
 *  - attention: one work item per query head; the scores 8 tokens at a time
 *    (lane = token, each lane the fmaf chain over d of skv_dot_bf16), M by the
 *    first-wins scan, e_j by skv_expf, Z by skv_canonical_sum, and the 256
 *    lane sums of P V with the dims as SIMD lanes (every dim is an independent
 *    chain: lane l, dim d gets fma(e_j, v_jd, .) for j = l, l + 256, ... in
 *    order), then the fixed tree, dims again as SIMD lanes. Without SIMD:
 *    skv_canonical_attend itself.
 * Scratch comes from the skv_ws arena (skv_cpu_canon_ws_bytes sizes it), so
 * the decode path allocates nothing; items are independent, so the result does
 * not depend on the thread count.
 */
#include <string.h>

#include "skv_cpu_simd.h"

#define SKV_CPU_CRB 16 /* rebuild: token rows per work item */

/* ---- rebuild ------------------------------------------------------------------------------- */

typedef struct {
    const skv_rope_config *rope;
    int32_t D, Hk, r, c, S, Dp;
    int64_t M, nrb;
    const skv_bf16 *u, *w;
    const int32_t *chunk_ids;
    const float *cos_tab, *sin_tab;
    skv_bf16 *k_out;
    double *wd;        /* [Hk][r][Dp] fixed-point W_h columns (zero past D) */
    int32_t *ew;       /* [Hk][Dp] their exponents */
    double *buf;       /* per thread: xu [CRB][r], P [CRB][Dp] */
    size_t per_thread; /* doubles */
} skv_cpu_canon_reb;

static int32_t skv_cpu_canon_dp(int32_t D) { return (D + 15) / 16 * 16; }

/* Item h of the first job: W_h's columns in fixed point. */
static void skv_cpu_canon_pack(void *ctx, int64_t h, int t)
{
    (void)t;
    const skv_cpu_canon_reb *c = ctx;
    const int32_t D = c->D, r = c->r, Dp = c->Dp;
    const size_t width = (size_t)c->Hk * D;
    double *wd = c->wd + (size_t)h * r * Dp;
    int32_t *ew = c->ew + (size_t)h * Dp;
    for (int32_t d = 0; d < Dp; d++) {
        if (d >= D) {
            ew[d] = 0;
            for (int32_t q = 0; q < r; q++) wd[(size_t)q * Dp + d] = 0.0;
            continue;
        }
        const skv_bf16 *col = c->w + (size_t)h * D + d;
        uint16_t mx = 0;
        for (int32_t q = 0; q < r; q++)
            if ((col[(size_t)q * width] & 0x7fffu) > mx) mx = col[(size_t)q * width] & 0x7fffu;
        ew[d] = skv_canon_rebuild_ex(mx);
        for (int32_t q = 0; q < r; q++) wd[(size_t)q * Dp + d] = (double)skv_canon_rebuild_fix(col[(size_t)q * width], ew[d]);
    }
}

#if SKV_CPU_X86
/* P[4][16] (row stride ldp) = xu[4][r] (row stride r) . wd[r][16] (row stride Dp): exact double FMAs. */
SKV_CPU_AVX2 static void skv_cpu_canon_k4x16(int32_t r, const double *xu, const double *wd, int32_t Dp, double *P,
                                             int32_t ldp)
{
    __m256d a[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_pd();
    for (int32_t q = 0; q < r; q++) {
        const double *wr = wd + (size_t)q * Dp;
        __m256d w0 = _mm256_loadu_pd(wr), w1 = _mm256_loadu_pd(wr + 4), w2 = _mm256_loadu_pd(wr + 8),
                w3 = _mm256_loadu_pd(wr + 12);
        for (int i = 0; i < 4; i++) {
            __m256d x = _mm256_broadcast_sd(xu + (size_t)i * r + q);
            a[i][0] = _mm256_fmadd_pd(x, w0, a[i][0]);
            a[i][1] = _mm256_fmadd_pd(x, w1, a[i][1]);
            a[i][2] = _mm256_fmadd_pd(x, w2, a[i][2]);
            a[i][3] = _mm256_fmadd_pd(x, w3, a[i][3]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) _mm256_storeu_pd(P + (size_t)i * ldp + 4 * j, a[i][j]);
}

/* P = xu . W_h for rows4 (a multiple of 4) rows, by the 4 x 16 kernel. */
SKV_CPU_AVX2 static void skv_cpu_canon_gemm_avx2(int32_t rows4, int32_t r, int32_t Dp, const double *xu,
                                                 const double *wd, double *P)
{
    for (int32_t i = 0; i < rows4; i += 4)
        for (int32_t d = 0; d < Dp; d += 16)
            skv_cpu_canon_k4x16(r, xu + (size_t)i * r, wd + d, Dp, P + (size_t)i * Dp + d, Dp);
}
#endif

/* Item of the second job: SKV_CPU_CRB token rows of one head. */
static void skv_cpu_canon_rows(void *ctx, int64_t it, int t)
{
    const skv_cpu_canon_reb *c = ctx;
    const int32_t D = c->D, r = c->r, Dp = c->Dp, R = c->rope->rotary_dim ? c->rope->rotary_dim : D, h2 = R / 2;
    const int64_t h = it / c->nrb, m0 = it % c->nrb * SKV_CPU_CRB;
    const int32_t rows = (int32_t)(c->M - m0 < SKV_CPU_CRB ? c->M - m0 : SKV_CPU_CRB), rows4 = (rows + 3) / 4 * 4;
    double *xu = c->buf + (size_t)t * c->per_thread, *P = xu + (size_t)SKV_CPU_CRB * r;
    float x[SKV_CPU_MAX_D];
    int eu[SKV_CPU_CRB];
    for (int32_t i = 0; i < rows4; i++) {
        double *xr = xu + (size_t)i * r;
        if (i >= rows) {
            memset(xr, 0, (size_t)r * sizeof *xr);
            eu[i] = 0;
            continue;
        }
        const int64_t m = m0 + i, tk = (int64_t)c->chunk_ids[h * c->S + m / c->c] * c->c + m % c->c;
        const skv_bf16 *ur = c->u + (size_t)tk * r;
        uint16_t mx = 0;
        for (int32_t q = 0; q < r; q++)
            if ((ur[q] & 0x7fffu) > mx) mx = ur[q] & 0x7fffu;
        eu[i] = skv_canon_rebuild_ex(mx);
        for (int32_t q = 0; q < r; q++) xr[q] = (double)skv_canon_rebuild_fix(ur[q], eu[i]);
    }
    const double *wd = c->wd + (size_t)h * r * Dp;
    const int32_t *ew = c->ew + (size_t)h * Dp;
#if SKV_CPU_X86
    if (skv_cpu_simd()) skv_cpu_canon_gemm_avx2(rows4, r, Dp, xu, wd, P);
    else
#endif
        for (int32_t i = 0; i < rows; i++)
            for (int32_t d = 0; d < D; d++) {
                int64_t s = 0;
                for (int32_t q = 0; q < r; q++) s += (int64_t)xu[(size_t)i * r + q] * (int64_t)wd[(size_t)q * Dp + d];
                P[(size_t)i * Dp + d] = (double)s;
            }
    for (int32_t i = 0; i < rows; i++) {
        const int64_t m = m0 + i, tk = (int64_t)c->chunk_ids[h * c->S + m / c->c] * c->c + m % c->c;
        for (int32_t d = 0; d < D; d++) x[d] = skv_canon_rebuild_key((int64_t)P[(size_t)i * Dp + d], eu[i] + ew[d] - 24);
        skv_cpu_rope_row(x, D, R, c->rope->interleaved, c->cos_tab + tk * h2, c->sin_tab + tk * h2,
                         c->k_out + ((size_t)h * c->M + m) * D);
    }
}

skv_status skv_cpu_rebuild_keys_canonical(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r, int32_t c,
                                          int32_t S, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                                          const int32_t *chunk_ids, const float *cos_tab, const float *sin_tab,
                                          skv_bf16 *k_out, skv_ws *ws)
{
    (void)n;
    const int32_t Dp = skv_cpu_canon_dp(D);
    const int64_t M = (int64_t)S * c, nrb = (M + SKV_CPU_CRB - 1) / SKV_CPU_CRB;
    skv_cpu_canon_reb job = {rope, D, Hk, r, c, S, Dp, M, nrb, u, w, chunk_ids, cos_tab, sin_tab, k_out,
                             NULL, NULL, NULL, (size_t)SKV_CPU_CRB * ((size_t)r + Dp)};
    const int nt = skv_cpu_team((int64_t)Hk * nrb);
    job.wd = skv_ws_alloc(ws, (size_t)Hk * r * Dp * sizeof *job.wd);
    job.ew = skv_ws_alloc(ws, (size_t)Hk * Dp * sizeof *job.ew);
    job.buf = skv_ws_alloc(ws, (size_t)nt * job.per_thread * sizeof *job.buf);
    if (!job.wd || !job.ew || !job.buf) return SKV_ERR_OUT_OF_MEMORY;
    skv_cpu_run(skv_cpu_team(Hk), Hk, skv_cpu_canon_pack, &job);
    skv_cpu_run(nt, (int64_t)Hk * nrb, skv_cpu_canon_rows, &job);
    return SKV_OK;
}

/* ---- attention ----------------------------------------------------------------------------- */

typedef struct {
    int32_t G, D, Dp, n_spans;
    float scale;
    const skv_bf16 *q;
    const skv_kv_span *spans;
    int64_t T;
    float *out;
    float *buf;        /* per thread: e [T], lanes [256][Dp] */
    size_t per_thread; /* floats */
} skv_cpu_canon_att;

static int32_t skv_cpu_canon_adp(int32_t D) { return (D + 7) / 8 * 8; }

#if SKV_CPU_X86
/* s[i] = skv_dot_bf16(q, p[i], D) for 8 rows, lane i the fmaf chain over d in order. */
SKV_CPU_AVX2 static __m256 skv_cpu_canon_dot8(const float *qf, int32_t D, const skv_bf16 *const p[8])
{
    __m256 a = _mm256_setzero_ps();
    int32_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 rr[8];
        for (int i = 0; i < 8; i++) rr[i] = skv_cpu_ld8(p[i] + d);
        skv_cpu_transpose8(rr);
        for (int e = 0; e < 8; e++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + d + e), rr[e], a);
    }
    for (; d < D; d++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(qf + d), skv_cpu_col8(p, d), a);
    return a;
}

/* One query head (item i): DESIGN 10.3 with SIMD lanes across tokens (scores) and dims (lane sums). */
SKV_CPU_AVX2 __attribute__((flatten)) static void skv_cpu_canon_head_avx2(const skv_cpu_canon_att *c, int64_t i,
                                                                          float *e, float *N)
{
    const int32_t D = c->D, Dp = c->Dp;
    const int64_t h = i / c->G;
    float qf[SKV_CPU_MAX_D];
    for (int32_t d = 0; d < D; d++) qf[d] = skv_bf16_to_f32(c->q[(size_t)i * D + d]);
    /* scores, 8 tokens at a time across span boundaries */
    const skv_bf16 *p[8];
    int64_t j = 0, j0 = 0;
    int np = 0;
    for (int32_t sp = 0; sp < c->n_spans; sp++) {
        const skv_kv_span *s = &c->spans[sp];
        for (int64_t t = 0; t < s->n_tokens; t++) {
            p[np++] = s->k + h * s->head_stride + t * s->token_stride;
            j++;
            if (np == 8) {
                _mm256_storeu_ps(e + j0, _mm256_mul_ps(skv_cpu_canon_dot8(qf, D, p), _mm256_set1_ps(c->scale)));
                j0 = j, np = 0;
            }
        }
    }
    for (int k = 0; k < np; k++) e[j0 + k] = SKV_MUL(skv_dot_f32_bf16(qf, p[k], D), c->scale);
    const int64_t T = c->T;
    float M = e[0];
    for (int64_t t = 1; t < T; t++)
        if (e[t] > M) M = e[t];
    for (int64_t t = 0; t < T; t++) e[t] = skv_expf(SKV_SUB(e[t], M));
    const float Z = skv_canonical_sum(e, T);
    /* the 256 lanes of every dim */
    memset(N, 0, sizeof(float) * SKV_CANON_LANES * (size_t)Dp);
    const int32_t D8 = D / 8 * 8;
    j = 0;
    for (int32_t sp = 0; sp < c->n_spans; sp++) {
        const skv_kv_span *s = &c->spans[sp];
        const skv_bf16 *vh = s->v + h * s->head_stride;
        for (int64_t t = 0; t < s->n_tokens; t++, j++) {
            const skv_bf16 *v = vh + t * s->token_stride;
            float *Nl = N + (size_t)(j & (SKV_CANON_LANES - 1)) * Dp;
            const __m256 x = _mm256_set1_ps(e[j]);
            int32_t d = 0;
            for (; d < D8; d += 8) _mm256_storeu_ps(Nl + d, _mm256_fmadd_ps(x, skv_cpu_ld8(v + d), _mm256_loadu_ps(Nl + d)));
            for (; d < D; d++) Nl[d] = SKV_FMA(e[j], skv_bf16_to_f32(v[d]), Nl[d]);
        }
    }
    for (int w = SKV_CANON_LANES / 2; w >= 1; w /= 2)
        for (int k = 0; k < w; k++) {
            float *a = N + (size_t)k * Dp;
            const float *b = N + (size_t)(k + w) * Dp;
            for (int32_t d = 0; d < Dp; d += 8) _mm256_storeu_ps(a + d, _mm256_add_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d)));
        }
    float *o = c->out + (size_t)i * D;
    const __m256 z = _mm256_set1_ps(Z);
    int32_t d = 0;
    for (; d < D8; d += 8) _mm256_storeu_ps(o + d, _mm256_div_ps(_mm256_loadu_ps(N + d), z));
    for (; d < D; d++) o[d] = SKV_DIV(N[d], Z);
}
#endif

/* Item i: query head i. */
static void skv_cpu_canon_head(void *ctx, int64_t i, int t)
{
    const skv_cpu_canon_att *c = ctx;
    float *e = c->buf + (size_t)t * c->per_thread, *N = e + (c->T + 15) / 16 * 16;
#if SKV_CPU_X86
    if (skv_cpu_simd()) {
        skv_cpu_canon_head_avx2(c, i, e, N);
        return;
    }
#endif
    skv_canon_span cs[SKV_MAX_SPANS];
    const int64_t h = i / c->G;
    for (int32_t sp = 0; sp < c->n_spans; sp++) {
        const skv_kv_span *s = &c->spans[sp];
        cs[sp].n_tokens = s->n_tokens, cs[sp].token_stride = s->token_stride;
        cs[sp].k = s->n_tokens ? s->k + h * s->head_stride : NULL;
        cs[sp].v = s->n_tokens ? s->v + h * s->head_stride : NULL;
    }
    skv_canonical_attend(c->q + (size_t)i * c->D, c->D, c->scale, c->n_spans, cs, N, c->out + (size_t)i * c->D);
}

/* Floats of one thread's scratch for T tokens. */
static size_t skv_cpu_canon_att_floats(int64_t T, int32_t D)
{
    return (size_t)(T + 15) / 16 * 16 + (size_t)SKV_CANON_LANES * ((size_t)skv_cpu_canon_adp(D) + 1);
}

skv_status skv_cpu_sparse_attention_canonical(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                              int32_t n_spans, const skv_kv_span *spans, float *out, skv_ws *ws)
{
    int64_t T = 0;
    for (int32_t s = 0; s < n_spans; s++) T += spans[s].n_tokens;
    skv_cpu_canon_att c = {Hq / Hk, D, skv_cpu_canon_adp(D), n_spans, scale, q, spans, T, out, NULL,
                           skv_cpu_canon_att_floats(T, D)};
    const int nt = skv_cpu_team(Hq);
    c.buf = skv_ws_alloc(ws, (size_t)nt * c.per_thread * sizeof *c.buf);
    if (!c.buf) return SKV_ERR_OUT_OF_MEMORY;
    skv_cpu_run(nt, Hq, skv_cpu_canon_head, &c);
    return SKV_OK;
}

/* skv_ws_alloc bytes of the canonical rebuild and attention of a cache's config (the larger),
   nt threads, at most max_tokens tokens per attention call. */
size_t skv_cpu_canon_ws_bytes(const skv_config *cfg, int64_t max_tokens, int nt)
{
    const size_t Hk = (size_t)cfg->n_kv_heads, r = (size_t)cfg->rank, Dp = (size_t)skv_cpu_canon_dp(cfg->head_dim);
    const size_t reb = SKV_WS_BYTES(sizeof(double) * (Hk * r * Dp + (size_t)nt * SKV_CPU_CRB * (r + Dp)) +
                                        sizeof(int32_t) * Hk * Dp, 3);
    const size_t att = SKV_WS_BYTES(sizeof(float) * (size_t)nt * skv_cpu_canon_att_floats(max_tokens, cfg->head_dim), 1);
    return reb > att ? reb : att;
}
