/*
 * sparse_attention and full_attention (tolerance-checked, not decisions).
 */
#include <math.h>
#include <string.h>

#include "skv_cpu_kernels.h"
#include "skv_cpu_ops.h"
#include "skv_cpu_simd.h"

/*
 * Split-K attention (flash-decoding): the tokens of each KV head (spans
 * concatenated) are cut into blocks of SKV_CPU_BT; each (head, block) item
 * computes, for the G query heads of the group, its block max m, sum of
 * weights l and unnormalized sum acc; the blocks are then merged in order.
 * Fixed block size, fixed merge order: the result does not depend on the
 * thread count. Reads bf16 K/V directly (no float copy).
 */

struct skv_cpu_attn {
    int32_t G, D, Dp;
    float scale;
    const float *qf;        /* [Hq, Dp], zero padded */
    const skv_kv_span *spans;
    int32_t n_spans;
    const int64_t *off;     /* per KV head h, off[h*(n_spans+2) ..]: span start offsets in its concatenated
                               token list (head_tokens), then its total, then a sentinel */
    float *part;            /* per item: [G] m, [G] l, [G][Dp] acc */
};

/* The key and value rows of tokens [t0, t0 + nt) of head h, across span boundaries. */
static void skv_cpu_attn_rows(const struct skv_cpu_attn *A, int32_t h, int64_t t0, int32_t nt, const skv_bf16 **kp,
                              const skv_bf16 **vp)
{
    int sp = 0;
    const int64_t *off = A->off + (size_t)h * (A->n_spans + 2);
    for (int32_t i = 0; i < nt; i++) {
        int64_t t = t0 + i;
        while (off[sp + 1] <= t) sp++;
        const skv_kv_span *s = &A->spans[sp];
        int64_t o = h * s->head_stride + (t - off[sp]) * s->token_stride;
        kp[i] = s->k + o;
        vp[i] = s->v + o;
    }
}

#if SKV_CPU_X86
/* dot(q, k) for attention scores: float, any order (tolerance-checked). */
SKV_CPU_AVX2 static float skv_cpu_dotq_avx2(const float *q, const skv_bf16 *k, int32_t D)
{
    int32_t d = 0;
    __m256 a = _mm256_setzero_ps();
    for (; d + 8 <= D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), skv_cpu_ld8(k + d), a);
    float dot = skv_cpu_hsum(a);
    for (; d < D; d++) dot += q[d] * skv_bf16_to_f32(k[d]);
    return dot;
}

/* skv_cpu_attn_item with 8-lane sums: 4 queries per pass share each converted key and value vector. */
SKV_CPU_AVX2 static void skv_cpu_attn_item_avx2(const struct skv_cpu_attn *A, int32_t h, int64_t t0, int64_t t1,
                                                float *sc)
{
    int32_t G = A->G, D = A->D, Dp = A->Dp, nt = (int32_t)(t1 - t0), g = 0;
    const float *qh = A->qf + (size_t)h * G * Dp;
    float *m = A->part, *l = m + G, *acc = l + G;
    const skv_bf16 *kp[SKV_CPU_BT], *vp[SKV_CPU_BT];
    skv_cpu_attn_rows(A, h, t0, nt, kp, vp);
    /* scores: 4 queries per pass share each converted key vector */
    int32_t D8 = D / 8 * 8;
    for (; g + 4 <= G; g += 4) {
        const float *q0 = qh + (size_t)g * Dp, *q1 = q0 + Dp, *q2 = q1 + Dp, *q3 = q2 + Dp;
        for (int32_t i = 0; i < nt; i++) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, kv;
            for (int32_t d = 0; d < D8; d += 8) {
                kv = skv_cpu_ld8(kp[i] + d);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), kv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + d), kv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + d), kv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + d), kv, a3);
            }
            if (D8 < D) { /* q is zero padded to Dp */
                float kt[8] = {0};
                for (int32_t d = D8; d < D; d++) kt[d - D8] = skv_bf16_to_f32(kp[i][d]);
                kv = _mm256_loadu_ps(kt);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + D8), kv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + D8), kv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + D8), kv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + D8), kv, a3);
            }
            float s4[4];
            _mm_storeu_ps(s4, _mm_mul_ps(skv_cpu_hsum4(a0, a1, a2, a3), _mm_set1_ps(A->scale)));
            for (int j = 0; j < 4; j++) sc[(size_t)(g + j) * SKV_CPU_BT + i] = s4[j];
        }
    }
    for (; g < G; g++)
        for (int32_t i = 0; i < nt; i++)
            sc[(size_t)g * SKV_CPU_BT + i] = skv_cpu_dotq_avx2(qh + (size_t)g * Dp, kp[i], D) * A->scale;
    /* block max and weights */
    for (g = 0; g < G; g++) {
        float *sg = sc + (size_t)g * SKV_CPU_BT, mx = sg[0], sum = 0.0f;
        for (int32_t i = 1; i < nt; i++) mx = sg[i] > mx ? sg[i] : mx;
        int32_t i = 0;
        __m256 vs = _mm256_setzero_ps(), vm = _mm256_set1_ps(mx);
        for (; i + 8 <= nt; i += 8) {
            __m256 e = skv_cpu_exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vm));
            _mm256_storeu_ps(sg + i, e);
            vs = _mm256_add_ps(vs, e);
        }
        sum = skv_cpu_hsum(vs);
        for (; i < nt; i++) {
            sg[i] = expf(sg[i] - mx);
            sum += sg[i];
        }
        m[g] = mx;
        l[g] = sum;
    }
    /* acc_g = sum_t w_gt v_t: dims outer, tokens inner, accumulators in registers */
    g = 0;
    int32_t d0 = 0;
    for (; g + 4 <= G; g += 4) {
        const float *w0 = sc + (size_t)g * SKV_CPU_BT, *w1 = w0 + SKV_CPU_BT, *w2 = w1 + SKV_CPU_BT,
                    *w3 = w2 + SKV_CPU_BT;
        float *o0 = acc + (size_t)g * Dp, *o1 = o0 + Dp, *o2 = o1 + Dp, *o3 = o2 + Dp;
        int32_t d = 0;
        for (; d + 16 <= D; d += 16) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int32_t i = 0; i < nt; i++) {
                __m256 v0 = skv_cpu_ld8(vp[i] + d), v1 = skv_cpu_ld8(vp[i] + d + 8), x;
                x = _mm256_broadcast_ss(w0 + i);
                a0 = _mm256_fmadd_ps(x, v0, a0);
                b0 = _mm256_fmadd_ps(x, v1, b0);
                x = _mm256_broadcast_ss(w1 + i);
                a1 = _mm256_fmadd_ps(x, v0, a1);
                b1 = _mm256_fmadd_ps(x, v1, b1);
                x = _mm256_broadcast_ss(w2 + i);
                a2 = _mm256_fmadd_ps(x, v0, a2);
                b2 = _mm256_fmadd_ps(x, v1, b2);
                x = _mm256_broadcast_ss(w3 + i);
                a3 = _mm256_fmadd_ps(x, v0, a3);
                b3 = _mm256_fmadd_ps(x, v1, b3);
            }
            _mm256_storeu_ps(o0 + d, a0);
            _mm256_storeu_ps(o0 + d + 8, b0);
            _mm256_storeu_ps(o1 + d, a1);
            _mm256_storeu_ps(o1 + d + 8, b1);
            _mm256_storeu_ps(o2 + d, a2);
            _mm256_storeu_ps(o2 + d + 8, b2);
            _mm256_storeu_ps(o3 + d, a3);
            _mm256_storeu_ps(o3 + d + 8, b3);
        }
        d0 = d;
    }
    for (int32_t gg = 0; gg < g; gg++) /* dims left over by the 16-wide loop */
        for (int32_t d = d0; d < D; d++) {
            float a = 0.0f;
            for (int32_t i = 0; i < nt; i++) a += sc[(size_t)gg * SKV_CPU_BT + i] * skv_bf16_to_f32(vp[i][d]);
            acc[(size_t)gg * Dp + d] = a;
        }
    for (; g < G; g++) {
        float *og = acc + (size_t)g * Dp;
        const float *wg = sc + (size_t)g * SKV_CPU_BT;
        memset(og, 0, (size_t)D * sizeof *og);
        for (int32_t i = 0; i < nt; i++) {
            int32_t d = 0;
            __m256 x = _mm256_broadcast_ss(wg + i);
            for (; d + 8 <= D; d += 8)
                _mm256_storeu_ps(og + d, _mm256_fmadd_ps(x, skv_cpu_ld8(vp[i] + d), _mm256_loadu_ps(og + d)));
            for (; d < D; d++) og[d] += wg[i] * skv_bf16_to_f32(vp[i][d]);
        }
    }
}
#endif

/* One (head, block) item: block max m, weight sum l and unnormalized acc of the G queries (sc: [G][BT]). */
static void skv_cpu_attn_item(const struct skv_cpu_attn *A, int32_t h, int64_t t0, int64_t t1, float *sc)
{
    int32_t G = A->G, D = A->D, Dp = A->Dp, nt = (int32_t)(t1 - t0);
    const float *qh = A->qf + (size_t)h * G * Dp;
    float *m = A->part, *l = m + G, *acc = l + G;
    const skv_bf16 *kp[SKV_CPU_BT], *vp[SKV_CPU_BT];
    skv_cpu_attn_rows(A, h, t0, nt, kp, vp);
    for (int32_t g = 0; g < G; g++) {
        const float *qg = qh + (size_t)g * Dp;
        float *sg = sc + (size_t)g * SKV_CPU_BT, mx = -INFINITY, sum = 0.0f;
        for (int32_t i = 0; i < nt; i++) {
            float dot = 0.0f;
            for (int32_t d = 0; d < D; d++) dot += qg[d] * skv_bf16_to_f32(kp[i][d]);
            sg[i] = dot * A->scale;
            mx = sg[i] > mx || i == 0 ? sg[i] : mx;
        }
        for (int32_t i = 0; i < nt; i++) {
            sg[i] = expf(sg[i] - mx);
            sum += sg[i];
        }
        m[g] = mx;
        l[g] = sum;
        float *og = acc + (size_t)g * Dp;
        memset(og, 0, (size_t)D * sizeof *og);
        for (int32_t i = 0; i < nt; i++)
            for (int32_t d = 0; d < D; d++) og[d] += sg[i] * skv_bf16_to_f32(vp[i][d]);
    }
}

/* out of query i = h G + g: the blocks of head h merged in block order. */
static void skv_cpu_attn_merge(const float *part, size_t item_sz, int64_t nblk, int32_t G, int32_t D, int32_t Dp,
                               int32_t h, float *out)
{
    for (int32_t g = 0; g < G; g++) {
        float M = -INFINITY, L = 0.0f, *o = out + ((size_t)h * G + g) * D;
        for (int64_t b = 0; b < nblk; b++) {
            float mb = part[(size_t)(h * nblk + b) * item_sz + g];
            M = mb > M ? mb : M;
        }
        memset(o, 0, (size_t)D * sizeof *o);
        for (int64_t b = 0; b < nblk; b++) {
            const float *p = part + (size_t)(h * nblk + b) * item_sz;
            float f = expf(p[g] - M);
            const float *ab = p + 2 * G + (size_t)g * Dp;
            L += f * p[G + g];
            for (int32_t d = 0; d < D; d++) o[d] += f * ab[d];
        }
        for (int32_t d = 0; d < D; d++) o[d] /= L;
    }
}

typedef struct {
    struct skv_cpu_attn A;
    int64_t T, nblk;
    size_t item_sz;
    int simd;
    float *part, *sc, *out;
    int32_t *done;
} skv_cpu_att;

static void skv_cpu_att_item(void *ctx, int64_t it, int t)
{
    const skv_cpu_att *c = ctx;
    int32_t G = c->A.G;
    int64_t h = it / c->nblk, b = it % c->nblk, Th = c->A.off[(size_t)h * (c->A.n_spans + 2) + c->A.n_spans];
    int64_t t0 = b * SKV_CPU_BT, t1 = t0 + SKV_CPU_BT < Th ? t0 + SKV_CPU_BT : Th;
    float *sc = c->sc + (size_t)t * G * SKV_CPU_BT;
    struct skv_cpu_attn A = c->A;
    A.part = c->part + (size_t)it * c->item_sz;
    if (t0 >= Th) { /* past this head's tokens (head_tokens): an empty block, weight 0 in the merge */
        for (int32_t g = 0; g < G; g++) A.part[g] = -INFINITY, A.part[G + g] = 0.0f;
        memset(A.part + 2 * G, 0, (size_t)G * A.Dp * sizeof *A.part);
    } else
#if SKV_CPU_X86
    if (c->simd) skv_cpu_attn_item_avx2(&A, (int32_t)h, t0, t1, sc);
    else
#endif
        skv_cpu_attn_item(&A, (int32_t)h, t0, t1, sc);
    if (skv_cpu_last(&c->done[h], (int32_t)c->nblk))
        skv_cpu_attn_merge(c->part, c->item_sz, c->nblk, G, A.D, A.Dp, (int32_t)h, c->out);
}

/* One job of (head, block) items (skv_cpu_run), no barrier inside: the item that completes a head's
   last block merges that head. */
skv_status skv_cpu_sparse_attention(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                    int32_t n_spans, const skv_kv_span *spans, const int64_t *head_tokens,
                                    float *out, skv_ws *ws)
{
    int32_t G = Hq / Hk, Dp = (D + 7) / 8 * 8;
    int64_t *off = skv_ws_alloc(ws, (size_t)Hk * (n_spans + 2) * sizeof *off), T = 0;
    if (!off) return SKV_ERR_OUT_OF_MEMORY;
    for (int32_t h = 0; h < Hk; h++) {
        int64_t *oh = off + (size_t)h * (n_spans + 2);
        oh[0] = 0;
        for (int32_t s = 0; s < n_spans; s++)
            oh[s + 1] = oh[s] + (head_tokens ? head_tokens[(size_t)s * Hk + h] : spans[s].n_tokens);
        if (oh[n_spans] > T) T = oh[n_spans];
        oh[n_spans + 1] = INT64_MAX; /* sentinel: span scans never run past the end */
    }
    int64_t nblk = (T + SKV_CPU_BT - 1) / SKV_CPU_BT, items = (int64_t)Hk * nblk;
    int nt = skv_cpu_team(items);
    skv_cpu_att c = {{G, D, Dp, scale, NULL, spans, n_spans, off, NULL}, T, nblk, (size_t)G * (2 + Dp),
                     skv_cpu_simd(), NULL, NULL, out, NULL};
    float *qf = skv_ws_alloc(ws, (size_t)Hq * Dp * sizeof *qf);
    c.part = skv_ws_alloc(ws, (size_t)items * c.item_sz * sizeof *c.part);
    c.sc = skv_ws_alloc(ws, (size_t)nt * G * SKV_CPU_BT * sizeof *c.sc);
    c.done = skv_ws_alloc(ws, (size_t)Hk * sizeof *c.done);
    if (!qf || !c.part || !c.sc || !c.done) return SKV_ERR_OUT_OF_MEMORY;
    memset(qf, 0, (size_t)Hq * Dp * sizeof *qf);
    memset(c.done, 0, (size_t)Hk * sizeof *c.done);
    for (int32_t i = 0; i < Hq; i++) skv_cpu_to_f32(q + (size_t)i * D, qf + (size_t)i * Dp, D);
    c.A.qf = qf;
    skv_cpu_run(nt, items, skv_cpu_att_item, &c);
    return SKV_OK;
}

skv_status skv_cpu_full_attention(int32_t Hq, int32_t Hk, int32_t D, float scale, const skv_bf16 *q,
                                  int64_t n_tokens, const skv_bf16 *k, const skv_bf16 *v, float *out)
{
    skv_kv_span span = {k, v, n_tokens, D, (int64_t)Hk * D};
    skv_ws ws = {0}; /* outside the decode path: plain allocations */
    skv_status st = skv_cpu_sparse_attention(Hq, Hk, D, scale, q, 1, &span, NULL, out, &ws);
    skv_ws_reset(&ws);
    return st;
}

/* skv_ws_alloc bytes of one sparse_attention call over at most max_tokens tokens, nt threads. */
size_t skv_cpu_attn_ws_bytes(const skv_config *cfg, int64_t max_tokens, int nt)
{
    size_t Hq = (size_t)cfg->n_q_heads, Hk = (size_t)cfg->n_kv_heads, D = (size_t)cfg->head_dim, G = Hq / Hk;
    size_t Dp = (D + 7) / 8 * 8, items = Hk * (size_t)((max_tokens + SKV_CPU_BT - 1) / SKV_CPU_BT);
    return SKV_WS_BYTES(sizeof(float) * (Hq * Dp + items * G * (2 + Dp) + (size_t)nt * G * SKV_CPU_BT) +
                            sizeof(int32_t) * Hk + sizeof(int64_t) * Hk * (SKV_MAX_SPANS + 2), 5);
}
