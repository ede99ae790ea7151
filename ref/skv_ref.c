/*
 * ref backend: the oracle. Plain C99 loops, one thread, LAPACKE for the
 * eigensolver. Written to be read; every other backend is checked against it.
 * Decisions use skv_numerics.h only (docs/DESIGN.md section 5).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <lapacke.h>

#include "skv_backend.h"
#include "skv_factor_canon.h"
#include "skv_numerics.h"

/* ---- infrastructure ----------------------------------------------------------- */

static skv_status skv_ref_probe(char *msg, size_t cap)
{
    (void)msg;
    (void)cap;
    return SKV_OK;
}

static void *skv_ref_mem_alloc(size_t bytes, skv_mem_kind kind)
{
    (void)kind;
    return calloc(1, bytes ? bytes : 1);
}

static void skv_ref_mem_free(void *p, skv_mem_kind kind)
{
    (void)kind;
    free(p);
}

static skv_status skv_ref_copy2d(void *dst, size_t dpitch, const void *src, size_t spitch,
                                 size_t width, size_t height)
{
    for (size_t i = 0; i < height; i++)
        memcpy((char *)dst + i * dpitch, (const char *)src + i * spitch, width);
    return SKV_OK;
}

static skv_status skv_ref_check_finite(const skv_bf16 *x, int64_t n_a, int64_t s_a, int64_t n_b,
                                       int64_t s_b, int64_t len, int64_t *first_bad)
{
    for (int64_t i = 0; i < n_a; i++)
        for (int64_t j = 0; j < n_b; j++) {
            const skv_bf16 *row = x + i * s_a + j * s_b;
            for (int64_t l = 0; l < len; l++)
                if (!skv_bf16_isfinite(row[l])) {
                    *first_bad = (i * n_b + j) * len + l;
                    return SKV_ERR_NONFINITE;
                }
        }
    return SKV_OK;
}

static skv_status skv_ref_check_range(const int32_t *x, int64_t n, int64_t lo, int64_t hi, int64_t *first_bad,
                                      int32_t *value)
{
    for (int64_t i = 0; i < n; i++)
        if (x[i] < lo || x[i] >= hi) {
            *first_bad = i;
            *value = x[i];
            return SKV_ERR_INVALID_ARGUMENT;
        }
    return SKV_OK;
}

/* ---- factorize: Gram matrix in double + LAPACK eigensolver -------------------- */

/*
 * The canonical route (lib/skv_factor_canon.h, docs/DESIGN.md 10.1) as written:
 * fixed point, the exact Gram by plain loops, the reference subspace iteration,
 * U exactly.
 */
static skv_status skv_ref_factorize_canonical(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u,
                                              float *w)
{
    int32_t F = skv_canon_frac_bits(n), Gb = skv_canon_u_bits(n, d);
    int32_t *e = malloc((size_t)d * sizeof *e), *f = malloc((size_t)r * sizeof *f);
    double *s = calloc((size_t)d * d, sizeof *s), *xrow = malloc((size_t)d * sizeof *xrow);
    double *q = malloc((size_t)d * r * sizeof *q), *y = malloc((size_t)d * r * sizeof *y);
    double *ws = malloc(((size_t)2 * r * r + r) * sizeof *ws);
    skv_status st = SKV_OK;
    if (!e || !f || !s || !xrow || !q || !y || !ws) {
        st = SKV_ERR_OUT_OF_MEMORY;
        goto done;
    }
    /* 1. column scales */
    for (int32_t i = 0; i < d; i++) {
        uint16_t mx = 0;
        for (int64_t t = 0; t < n; t++) {
            uint16_t m = (uint16_t)(a[t * d + i] & 0x7fff);
            mx = m > mx ? m : mx;
        }
        e[i] = skv_canon_ex_bf16(mx);
    }
    /* 2. S = X^T X (upper triangle; exact in any order), then G = S scaled, both triangles */
    for (int64_t t = 0; t < n; t++) {
        for (int32_t i = 0; i < d; i++) xrow[i] = skv_canon_fix(a[t * d + i], F, e[i]);
        for (int32_t i = 0; i < d; i++)
            for (int32_t j = i; j < d; j++) s[(size_t)i * d + j] += xrow[i] * xrow[j];
    }
    for (int32_t i = 0; i < d; i++)
        for (int32_t j = i; j < d; j++) {
            double g = s[(size_t)i * d + j] * skv_canon_pow2(e[i] + e[j] - 2 * F);
            s[(size_t)i * d + j] = g;
            s[(size_t)j * d + i] = g;
        }
    /* 3. Q */
    skv_canon_ref_subspace(d, r, s, q, y, ws);
    /* 4. W = Q^T; U = X Y exactly, scaled once */
    for (int32_t j = 0; j < r; j++)
        for (int32_t i = 0; i < d; i++) w[(size_t)j * d + i] = (float)q[(size_t)i * r + j];
    skv_canon_ref_qfix(d, r, q, e, F, Gb, y, f);
    for (int64_t t = 0; t < n; t++) {
        for (int32_t i = 0; i < d; i++) xrow[i] = skv_canon_fix(a[t * d + i], F, e[i]);
        for (int32_t j = 0; j < r; j++) {
            double acc = 0.0;
            for (int32_t i = 0; i < d; i++) acc += xrow[i] * y[(size_t)i * r + j];
            u[t * r + j] = (float)skv_canon_scale(acc, f[j] - Gb);
        }
    }
done:
    free(e);
    free(f);
    free(s);
    free(xrow);
    free(q);
    free(y);
    free(ws);
    return st;
}

/*
 * A = K viewed as [n, d]. G = A^T A (double). Its top-r eigenvectors V_r are
 * the top right singular vectors of A; W = V_r^T, U = A V_r. Exact arithmetic
 * would give the best rank-r approximation; double keeps it there.
 */
static skv_status skv_ref_factorize(skv_factorize_route route, int64_t n, int32_t d, int32_t r, const skv_bf16 *a, float *u,
                                    float *w)
{
    if (route == SKV_FACTORIZE_CANONICAL) return skv_ref_factorize_canonical(n, d, r, a, u, w);
    double *g = malloc((size_t)d * d * sizeof *g);
    double *row = malloc((size_t)d * sizeof *row);
    double *evals = malloc((size_t)d * sizeof *evals);
    double *z = malloc((size_t)d * r * sizeof *z);
    lapack_int *isuppz = malloc((size_t)2 * r * sizeof *isuppz);
    skv_status st = SKV_OK;
    if (!g || !row || !evals || !z || !isuppz) {
        st = SKV_ERR_OUT_OF_MEMORY;
        goto done;
    }
    memset(g, 0, (size_t)d * d * sizeof *g);
    for (int64_t t = 0; t < n; t++) {
        for (int32_t i = 0; i < d; i++) row[i] = skv_bf16_to_f32(a[t * d + i]);
        for (int32_t i = 0; i < d; i++) /* upper triangle */
            for (int32_t j = i; j < d; j++) g[(size_t)i * d + j] += row[i] * row[j];
    }
    /* eigenvalues in ascending order; ask for the r largest */
    lapack_int m = 0;
    lapack_int info = LAPACKE_dsyevr(LAPACK_ROW_MAJOR, 'V', 'I', 'U', d, g, d, 0.0, 0.0, d - r + 1, d,
                                     0.0, &m, evals, z, r, isuppz);
    if (info != 0 || m != r) {
        st = SKV_ERR_NUMERICAL;
        goto done;
    }
    /* column k of z (ascending); output rank index q = r-1-k (descending) */
    for (int32_t q = 0; q < r; q++)
        for (int32_t i = 0; i < d; i++) w[(size_t)q * d + i] = (float)z[(size_t)i * r + (r - 1 - q)];
    for (int64_t t = 0; t < n; t++)
        for (int32_t q = 0; q < r; q++) {
            double acc = 0.0;
            for (int32_t i = 0; i < d; i++)
                acc += (double)skv_bf16_to_f32(a[t * d + i]) * z[(size_t)i * r + (r - 1 - q)];
            u[t * r + q] = (float)acc;
        }
done:
    free(g);
    free(row);
    free(evals);
    free(z);
    free(isuppz);
    return st;
}

/* ---- RoPE --------------------------------------------------------------------- */

static skv_status skv_ref_rope(const skv_rope_config *rope, int32_t head_dim, int64_t n_tokens,
                               int32_t n_heads, int64_t pos0, const float *cos_tab,
                               const float *sin_tab, const skv_bf16 *in, skv_bf16 *out)
{
    int32_t R = rope->rotary_dim ? rope->rotary_dim : head_dim, h2 = R / 2;
    float x[1024];
    for (int64_t t = 0; t < n_tokens; t++)
        for (int32_t h = 0; h < n_heads; h++) {
            size_t off = ((size_t)t * n_heads + h) * head_dim;
            for (int32_t d = 0; d < head_dim; d++) x[d] = skv_bf16_to_f32(in[off + d]);
            skv_rope_row_f32(x, head_dim, R, rope->interleaved, cos_tab + (pos0 + t) * h2,
                             sin_tab + (pos0 + t) * h2, out + off);
        }
    return SKV_OK;
}

/* ---- landmarks and outliers --------------------------------------------------- */

static skv_status skv_ref_landmarks_outliers(int32_t N, int32_t c, int32_t Hk, int32_t D, int32_t O,
                                             const skv_bf16 *k_post, int32_t *outlier_ids,
                                             int32_t *candidate_ids, skv_bf16 *landmarks)
{
    if (N <= 0 || O < 0 || O >= N) return SKV_ERR_INVALID_ARGUMENT; /* lib/ checked; keeps sizes positive */
    float *mean = malloc((size_t)N * D * sizeof *mean);
    float *score = malloc((size_t)N * sizeof *score);
    int32_t *scratch = malloc((size_t)N * sizeof *scratch);
    char *is_out = malloc((size_t)N);
    skv_status st = SKV_OK;
    if (!mean || !score || !scratch || !is_out) {
        st = SKV_ERR_OUT_OF_MEMORY;
        goto done;
    }
    for (int32_t h = 0; h < Hk; h++) {
        for (int32_t j = 0; j < N; j++) {
            const skv_bf16 *k = k_post + ((size_t)j * c * Hk + h) * D;
            score[j] = skv_outlier_key(skv_chunk_landmark_score(k, (int64_t)Hk * D, c, D, mean + (size_t)j * D));
        }
        int32_t *oid = O > 0 ? outlier_ids + (size_t)h * O : NULL; /* outlier_ids may be NULL when O == 0 */
        skv_topk_indices(score, N, O, 1, scratch, oid);
        memset(is_out, 0, (size_t)N);
        for (int32_t o = 0; o < O; o++) is_out[oid[o]] = 1;
        int32_t m = 0, n_cand = N - O;
        for (int32_t j = 0; j < N; j++) {
            if (is_out[j]) continue;
            candidate_ids[(size_t)h * n_cand + m] = j;
            skv_bf16 *l = landmarks + ((size_t)h * n_cand + m) * D;
            for (int32_t d = 0; d < D; d++) l[d] = skv_f32_to_bf16(mean[(size_t)j * D + d]);
            m++;
        }
    }
done:
    free(mean);
    free(score);
    free(scratch);
    free(is_out);
    return st;
}

/* ---- score and select --------------------------------------------------------- */

static skv_status skv_ref_score_select(int32_t Hq, int32_t Hk, int32_t D, int32_t n_cand,
                                       const skv_select_params *sp, float scale, const skv_bf16 *q,
                                       const skv_bf16 *landmarks, const int32_t *candidate_ids, int32_t *sel_idx,
                                       int32_t *sel_ids, float *amax, int32_t *counts, skv_ws *ws)
{
    int32_t G = Hq / Hk;
    const size_t S = (size_t)sp->stride;
    float *s = skv_ws_alloc(ws, (size_t)n_cand * sizeof *s);
    float *a = skv_ws_alloc(ws, (size_t)n_cand * sizeof *a);
    int32_t *scratch = skv_ws_alloc(ws, (size_t)2 * n_cand * sizeof *scratch);
    if (!s || !a || !scratch) return SKV_ERR_OUT_OF_MEMORY; /* the caller resets ws */
    for (int32_t h = 0; h < Hk; h++) {
        const skv_bf16 *L = landmarks + (size_t)h * n_cand * D;
        for (int32_t g = 0; g < G; g++) {
            const skv_bf16 *qi = q + (size_t)(h * G + g) * D;
            for (int32_t j = 0; j < n_cand; j++) s[j] = SKV_MUL(skv_dot_bf16(qi, L + (size_t)j * D, D), scale);
            skv_softmax_inplace(s, n_cand);
            for (int32_t j = 0; j < n_cand; j++)
                if (g == 0 || s[j] > a[j]) a[j] = s[j];
        }
        if (amax) memcpy(amax + (size_t)h * n_cand, a, (size_t)n_cand * sizeof *a);
        const int32_t k = skv_select_head(a, n_cand, sp, scratch, sel_idx + (size_t)h * S,
                                          candidate_ids ? candidate_ids + (size_t)h * n_cand : NULL,
                                          sel_ids ? sel_ids + (size_t)h * S : NULL);
        if (counts) counts[h] = k;
    }
    return SKV_OK;
}

/* Arena bytes of the canonical rebuild (xw [r][D], ew [D], xu [r] int32, x [D] float) and of
   the canonical attention (lanes [256 (D + 1)] float, spans [SKV_MAX_SPANS]). */
static size_t skv_ref_canon_rebuild_bytes(int32_t D, int32_t r)
{
    return SKV_WS_BYTES(sizeof(int32_t) * ((size_t)r * D + D + r) + sizeof(float) * D, 4);
}
static size_t skv_ref_canon_attn_bytes(int32_t D)
{
    return SKV_WS_BYTES(sizeof(float) * SKV_CANON_LANES * ((size_t)D + 1) + sizeof(skv_canon_span) * SKV_MAX_SPANS, 2);
}

/* The largest of score_select's three arrays and, in the reproducible mode, of the canonical
   rebuild's and attention's scratch; the other slots use the stack. */
static size_t skv_ref_decode_ws_bytes(const skv_config *cfg, int32_t cand_max, int64_t max_attn_tokens)
{
    (void)max_attn_tokens;
    size_t m = SKV_WS_BYTES((size_t)4 * cand_max * sizeof(float), 3);
    if (cfg->reproducible || cfg->select_candidates) { /* the canonical rebuild also serves the rescoring (4.5.1) */
        size_t a = skv_ref_canon_rebuild_bytes(cfg->head_dim, skv_cfg_rank(cfg)), b = skv_ref_canon_attn_bytes(cfg->head_dim);
        if (a > m) m = a;
        if (b > m) m = b;
    }
    return m;
}

/* ---- rebuild keys ------------------------------------------------------------- */

static skv_status skv_ref_rebuild_keys(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r,
                                       int32_t c, int32_t S, int64_t n, const skv_bf16 *u,
                                       const skv_bf16 *w, const int32_t *chunk_ids, const int32_t *counts,
                                       const float *cos_tab, const float *sin_tab, skv_bf16 *k_out,
                                       skv_ws *ws)
{
    (void)n;
    (void)ws;
    int32_t R = rope->rotary_dim ? rope->rotary_dim : D, h2 = R / 2;
    size_t width = (size_t)Hk * D;
    float x[1024];
    for (int32_t h = 0; h < Hk; h++)
        for (int32_t s = 0; s < (counts ? counts[h] : S); s++)
            for (int32_t i = 0; i < c; i++) {
                int64_t t = (int64_t)chunk_ids[(size_t)h * S + s] * c + i;
                for (int32_t d = 0; d < D; d++) {
                    float acc = 0.0f;
                    for (int32_t k = 0; k < r; k++)
                        acc += skv_bf16_to_f32(u[(size_t)t * r + k]) *
                               skv_bf16_to_f32(w[(size_t)k * width + (size_t)h * D + d]);
                    x[d] = acc;
                }
                skv_rope_row_f32(x, D, R, rope->interleaved, cos_tab + t * h2, sin_tab + t * h2,
                                 k_out + (((size_t)h * S + s) * c + i) * D);
            }
    return SKV_OK;
}

/*
 * The canonical rebuild (docs/DESIGN.md 10.2) as written: per head, the fixed point of W_h's
 * columns; per token, the fixed point of its U row, the exact int64 sums, one rounding to
 * float (skv_canon_rebuild_key), RoPE and bf16 (skv_rope_row_f32).
 */
static skv_status skv_ref_rebuild_keys_canonical(const skv_rope_config *rope, int32_t D, int32_t Hk, int32_t r,
                                                 int32_t c, int32_t S, int64_t n, const skv_bf16 *u,
                                                 const skv_bf16 *w, const int32_t *chunk_ids, const int32_t *counts,
                                                 const float *cos_tab,
                                                 const float *sin_tab, skv_bf16 *k_out, skv_ws *ws)
{
    (void)n;
    int32_t R = rope->rotary_dim ? rope->rotary_dim : D, h2 = R / 2;
    size_t width = (size_t)Hk * D;
    int32_t *xw = skv_ws_alloc(ws, (size_t)r * D * sizeof *xw), *ew = skv_ws_alloc(ws, (size_t)D * sizeof *ew);
    int32_t *xu = skv_ws_alloc(ws, (size_t)r * sizeof *xu);
    float *x = skv_ws_alloc(ws, (size_t)D * sizeof *x);
    if (!xw || !ew || !xu || !x) return SKV_ERR_OUT_OF_MEMORY;
    for (int32_t h = 0; h < Hk; h++) {
        for (int32_t d = 0; d < D; d++) {
            uint16_t mx = 0;
            for (int32_t q = 0; q < r; q++) {
                uint16_t a = w[(size_t)q * width + (size_t)h * D + d] & 0x7fffu;
                if (a > mx) mx = a;
            }
            ew[d] = skv_canon_rebuild_ex(mx);
            for (int32_t q = 0; q < r; q++) xw[(size_t)q * D + d] = skv_canon_rebuild_fix(w[(size_t)q * width + (size_t)h * D + d], ew[d]);
        }
        for (int32_t s = 0; s < (counts ? counts[h] : S); s++)
            for (int32_t i = 0; i < c; i++) {
                int64_t t = (int64_t)chunk_ids[(size_t)h * S + s] * c + i;
                const skv_bf16 *ur = u + (size_t)t * r;
                uint16_t mx = 0;
                for (int32_t q = 0; q < r; q++)
                    if ((ur[q] & 0x7fffu) > mx) mx = ur[q] & 0x7fffu;
                const int eu = skv_canon_rebuild_ex(mx);
                for (int32_t q = 0; q < r; q++) xu[q] = skv_canon_rebuild_fix(ur[q], eu);
                for (int32_t d = 0; d < D; d++) {
                    int64_t P = 0;
                    for (int32_t q = 0; q < r; q++) P += (int64_t)xu[q] * xw[(size_t)q * D + d];
                    x[d] = skv_canon_rebuild_key(P, eu + ew[d] - 24);
                }
                skv_rope_row_f32(x, D, R, rope->interleaved, cos_tab + t * h2, sin_tab + t * h2,
                                 k_out + (((size_t)h * S + s) * c + i) * D);
            }
    }
    return SKV_OK;
}

/* ---- gather values ------------------------------------------------------------ */

static skv_status skv_ref_gather_values(int32_t Hk, int32_t D, int32_t c, int32_t n_store, int32_t S,
                                        int32_t value_dtype, const void *store, const int32_t *idx,
                                        const int32_t *counts, skv_bf16 *v_out)
{
    const size_t block = (size_t)c * D, rec = skv_value_chunk_bytes(value_dtype, c, D);
    for (int32_t h = 0; h < Hk; h++)
        for (int32_t s = 0; s < (counts ? counts[h] : S); s++) {
            const uint8_t *src = (const uint8_t *)store + ((size_t)h * n_store + idx[(size_t)h * S + s]) * rec;
            skv_bf16 *dst = v_out + ((size_t)h * S + s) * block;
            if (value_dtype == SKV_VALUE_FP8) skv_fp8_decode_chunk(src, c, D, dst);
            else memcpy(dst, src, rec);
        }
    return SKV_OK;
}

/* ---- attention ---------------------------------------------------------------- */

/*
 * One query head over spans: two passes (max, then weighted sum). The sums
 * are float in two levels, per block of 256 tokens and then over blocks: one
 * running sum would drop the many tiny weights of a long context once a sink
 * token's weight ~1 is in it (131k weights of e^-17 are 0.5% of the mass).
 */
#define SKV_REF_BLOCK 256
static void skv_ref_attend_head(const skv_bf16 *qi, int32_t h, int32_t D, float scale,
                                int32_t n_spans, const skv_kv_span *spans, float *out)
{
    float m = -INFINITY, z = 0.0f, zb = 0.0f, ob[1024];
    int64_t in_block = 0;
    for (int32_t sp = 0; sp < n_spans; sp++)
        for (int64_t t = 0; t < spans[sp].n_tokens; t++) {
            const skv_bf16 *k = spans[sp].k + h * spans[sp].head_stride + t * spans[sp].token_stride;
            float s = skv_dot_bf16(qi, k, D) * scale;
            if (s > m) m = s;
        }
    for (int32_t d = 0; d < D; d++) out[d] = ob[d] = 0.0f;
    for (int32_t sp = 0; sp < n_spans; sp++)
        for (int64_t t = 0; t < spans[sp].n_tokens; t++) {
            size_t off = (size_t)(h * spans[sp].head_stride + t * spans[sp].token_stride);
            float e = expf(skv_dot_bf16(qi, spans[sp].k + off, D) * scale - m);
            zb += e;
            for (int32_t d = 0; d < D; d++) ob[d] += e * skv_bf16_to_f32(spans[sp].v[off + d]);
            if (++in_block == SKV_REF_BLOCK) { /* fold the block into the totals */
                z += zb;
                zb = 0.0f;
                for (int32_t d = 0; d < D; d++) {
                    out[d] += ob[d];
                    ob[d] = 0.0f;
                }
                in_block = 0;
            }
        }
    z += zb;
    for (int32_t d = 0; d < D; d++) out[d] = (out[d] + ob[d]) / z;
}

/* spans as KV head h sees them: head_tokens (NULL: as given) replaces their token counts. */
static void skv_ref_head_spans(int32_t Hk, int32_t h, int32_t n_spans, const skv_kv_span *spans,
                               const int64_t *head_tokens, skv_kv_span *out)
{
    for (int32_t sp = 0; sp < n_spans; sp++) {
        out[sp] = spans[sp];
        if (head_tokens) out[sp].n_tokens = head_tokens[(size_t)sp * Hk + h];
    }
}

static skv_status skv_ref_sparse_attention(int32_t Hq, int32_t Hk, int32_t D, float scale,
                                           const skv_bf16 *q, int32_t n_spans,
                                           const skv_kv_span *spans, const int64_t *head_tokens, float *out,
                                           skv_ws *ws)
{
    (void)ws;
    int32_t G = Hq / Hk;
    skv_kv_span hs[SKV_MAX_SPANS];
    for (int32_t i = 0; i < Hq; i++) {
        skv_ref_head_spans(Hk, i / G, n_spans, spans, head_tokens, hs);
        skv_ref_attend_head(q + (size_t)i * D, i / G, D, scale, n_spans, hs, out + (size_t)i * D);
    }
    return SKV_OK;
}

/* The canonical attention (docs/DESIGN.md 10.3): skv_canonical_attend per query head. */
static skv_status skv_ref_sparse_attention_canonical(int32_t Hq, int32_t Hk, int32_t D, float scale,
                                                     const skv_bf16 *q, int32_t n_spans, const skv_kv_span *spans,
                                                     const int64_t *head_tokens, float *out, skv_ws *ws)
{
    int32_t G = Hq / Hk;
    float *lanes = skv_ws_alloc(ws, sizeof(float) * SKV_CANON_LANES * ((size_t)D + 1));
    skv_canon_span *cs = skv_ws_alloc(ws, sizeof *cs * SKV_MAX_SPANS);
    if (!lanes || !cs) return SKV_ERR_OUT_OF_MEMORY;
    for (int32_t i = 0; i < Hq; i++) {
        const int64_t h = i / G;
        for (int32_t sp = 0; sp < n_spans; sp++) {
            const int64_t nt = head_tokens ? head_tokens[(size_t)sp * Hk + h] : spans[sp].n_tokens;
            cs[sp].n_tokens = nt;
            cs[sp].token_stride = spans[sp].token_stride;
            cs[sp].k = nt ? spans[sp].k + h * spans[sp].head_stride : NULL;
            cs[sp].v = nt ? spans[sp].v + h * spans[sp].head_stride : NULL;
        }
        skv_canonical_attend(q + (size_t)i * D, D, scale, n_spans, cs, lanes, out + (size_t)i * D);
    }
    return SKV_OK;
}

static skv_status skv_ref_full_attention(int32_t Hq, int32_t Hk, int32_t D, float scale,
                                         const skv_bf16 *q, int64_t n_tokens, const skv_bf16 *k,
                                         const skv_bf16 *v, float *out)
{
    skv_kv_span span = {k, v, n_tokens, D, (int64_t)Hk * D};
    return skv_ref_sparse_attention(Hq, Hk, D, scale, q, 1, &span, NULL, out, NULL);
}

const struct skv_backend_ops skv_ref_ops = {
    .name = "ref",
    .probe = skv_ref_probe,
    .mem_alloc = skv_ref_mem_alloc,
    .mem_free = skv_ref_mem_free,
    .copy2d = skv_ref_copy2d,
    .check_finite = skv_ref_check_finite,
    .check_range = skv_ref_check_range,
    .set_threads = NULL,
    .decode_ws_bytes = skv_ref_decode_ws_bytes,
    .factorize = skv_ref_factorize,
    .rope = skv_ref_rope,
    .landmarks_outliers = skv_ref_landmarks_outliers,
    .score_select = skv_ref_score_select,
    .rebuild_keys = skv_ref_rebuild_keys,
    .gather_values = skv_ref_gather_values,
    .sparse_attention = skv_ref_sparse_attention,
    .rebuild_keys_canonical = skv_ref_rebuild_keys_canonical,
    .sparse_attention_canonical = skv_ref_sparse_attention_canonical,
    .full_attention = skv_ref_full_attention,
    /* cache-level slots NULL: lib/ runs the op slots per sequence */
};
