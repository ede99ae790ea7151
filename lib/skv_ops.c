/*
 * Op-level API: argument checks, then one dispatch-table slot. Every check
 * happens before any output is written.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "skv_internal.h"
#include "skv_numerics.h"

/* Resolves the backend (into got_) and the slot; a NULL slot is SKV_ERR_UNSUPPORTED. */
#define SKV_GET_SLOT(fn, slot)                                                                     \
    const struct skv_backend_ops *ops;                                                             \
    skv_backend got_;                                                                              \
    do {                                                                                           \
        skv_status st_ = skv_backend_resolve(NULL, backend, &got_, &ops);                          \
        if (st_) return st_;                                                                       \
        if (!ops->slot)                                                                            \
            return skv_fail(NULL, SKV_ERR_UNSUPPORTED, "%s: backend %s does not implement %s", \
                            fn, ops->name, #slot);                                                          \
    } while (0)

#define SKV_NONNULL(fn, p) \
    if (!(p)) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: %s is NULL", fn, #p)

#define SKV_RANGE(fn, x, lo, hi)                                                                   \
    if ((int64_t)(x) < (int64_t)(lo) || (int64_t)(x) > (int64_t)(hi))                              \
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: %s = %lld, must be in [%lld, %lld]", fn, \
                        #x, (long long)(x), (long long)(lo), (long long)(hi))

/* Rejects NaN/Inf; the message names the tensor and the flat index. */
static skv_status skv_finite(const struct skv_backend_ops *ops, const char *fn, const char *what,
                             const skv_bf16 *x, int64_t n)
{
    int64_t bad = -1;
    if (ops->check_finite(x, 1, 0, 1, 0, n, &bad) != SKV_OK)
        return skv_fail(NULL, SKV_ERR_NONFINITE, "%s: %s[%lld] is NaN or Inf", fn, what, (long long)bad);
    return SKV_OK;
}

#define SKV_FINITE(fn, x, n)                                                                       \
    do {                                                                                           \
        skv_status stf_ = skv_finite(ops, fn, #x, x, (int64_t)(n));                                \
        if (stf_) return stf_;                                                                     \
    } while (0)

/*
 * The input bound of skv_prefill and skv_decode, for the ops that take the same data
 * (factorize, sparse and full attention): on the host backends (ref, cpu) the strided
 * [n_a, n_b, len] tensor x (element (i, j, l) at x[i*s_a + j*s_b + l]) may hold no NaN, Inf
 * or |x| > SKV_MAX_INPUT_MAGNITUDE (larger finite values overflow the float scores, sums and
 * factors to Inf or NaN). The message names the argument, the element (flat index of a
 * contiguous tensor; token, head and element of a span, whose i is the head and j the
 * token) and, for a finite element, its value. cuda (device memory): the backend's NaN/Inf
 * check only.
 */
static skv_status skv_bounded(const struct skv_backend_ops *ops, skv_backend got, const char *fn, const char *what,
                              const skv_bf16 *x, int64_t n_a, int64_t s_a, int64_t n_b, int64_t s_b, int64_t len)
{
    int64_t i = 0, j = 0, l = -1;
    if (got == SKV_BACKEND_CUDA) {
        int64_t bad = -1;
        if (ops->check_finite(x, n_a, s_a, n_b, s_b, len, &bad) == SKV_OK) return SKV_OK;
        i = bad / len / n_b, j = bad / len % n_b, l = bad % len;
    } else {
        for (i = 0; i < n_a && l < 0; i++) {
            for (j = 0; j < n_b; j++)
                if ((l = skv_first_bad(x + i * s_a + j * s_b, len)) >= 0) break;
            if (l >= 0) break;
        }
        if (l < 0) return SKV_OK;
    }
    char at[96];
    if (n_a == 1 && n_b == 1) snprintf(at, sizeof at, "%s[%lld]", what, (long long)l);
    else snprintf(at, sizeof at, "%s: token %lld head %lld element %lld", what, (long long)j, (long long)i, (long long)l);
    const skv_bf16 e = got == SKV_BACKEND_CUDA ? 0x7f80 : x[i * s_a + j * s_b + l]; /* cuda: device memory */
    if (!skv_bf16_isfinite(e)) return skv_fail(NULL, SKV_ERR_NONFINITE, "%s: %s is NaN or Inf", fn, at);
    return skv_fail(NULL, SKV_ERR_NONFINITE,
                    "%s: %s = %g is beyond the accepted magnitude SKV_MAX_INPUT_MAGNITUDE = 2^32 (larger values "
                    "overflow float arithmetic)",
                    fn, at, (double)skv_bf16_to_f32(e));
}

/* skv_bounded of a contiguous tensor of n elements named x. */
#define SKV_BOUNDED(fn, x, n)                                                                      \
    do {                                                                                           \
        skv_status stb_ = skv_bounded(ops, got_, fn, #x, x, 1, 0, 1, 0, (int64_t)(n));             \
        if (stb_) return stb_;                                                                     \
    } while (0)

/* Gives a failing slot's status a message. */
static skv_status skv_slot_result(const char *fn, const struct skv_backend_ops *ops, skv_status st)
{
    const char *detail = skv_backend_detail();
    if (st != SKV_OK)
        return skv_fail(NULL, st, "%s: backend %s failed: %s%s%s", fn, ops->name, skv_status_string(st),
                        *detail ? ": " : "", detail);
    return SKV_OK;
}

#define SKV_MAX_D 1024

SKV_API void skv_op_release(void)
{
    static const skv_backend all[] = {SKV_BACKEND_REF, SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        const struct skv_backend_ops *ops = skv_backend_ops_get(all[i]);
        if (ops && ops->op_release) ops->op_release();
    }
}

SKV_API skv_status skv_op_factorize(skv_backend backend, int64_t n, int32_t d, int32_t r,
                                    const skv_bf16 *a, float *u, float *w)
{
    return skv_op_factorize_route(backend, SKV_FACTORIZE_AUTO, n, d, r, a, u, w);
}

SKV_API skv_status skv_op_factorize_route(skv_backend backend, skv_factorize_route route, int64_t n, int32_t d,
                                          int32_t r, const skv_bf16 *a, float *u, float *w)
{
    static const char fn[] = "skv_op_factorize";
    if ((int)route < SKV_FACTORIZE_AUTO || (int)route > SKV_FACTORIZE_CANONICAL)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: route = %d: not a skv_factorize_route value", fn,
                        (int)route);
    SKV_NONNULL(fn, a);
    SKV_NONNULL(fn, u);
    SKV_NONNULL(fn, w);
    SKV_RANGE(fn, n, 1, (int64_t)1 << 31);
    SKV_RANGE(fn, d, 1, 65536);
    SKV_RANGE(fn, r, 1, n < d ? n : d);
    SKV_GET_SLOT(fn, factorize);
    SKV_BOUNDED(fn, a, n * d);
    return skv_slot_result(fn, ops, ops->factorize(route, n, d, r, a, u, w));
}

static skv_status skv_rope_args(const char *fn, const skv_rope_config *rope, int32_t head_dim)
{
    if (!rope) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: rope is NULL", fn);
    if (head_dim < 2 || head_dim % 2 || head_dim > SKV_MAX_D)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: head_dim = %d must be even in [2, %d]", fn,
                        head_dim, SKV_MAX_D);
    char why[SKV_ERRMSG_CAP];
    if (skv_rope_validate(why, rope, head_dim))
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: %s", fn, why);
    return SKV_OK;
}

SKV_API skv_status skv_op_rope(skv_backend backend, const skv_rope_config *rope, int32_t head_dim,
                               int64_t n_tokens, int32_t n_heads, int64_t pos0, const float *cos_tab,
                               const float *sin_tab, const skv_bf16 *in, skv_bf16 *out)
{
    static const char fn[] = "skv_op_rope";
    skv_status st = skv_rope_args(fn, rope, head_dim);
    if (st) return st;
    SKV_NONNULL(fn, cos_tab);
    SKV_NONNULL(fn, sin_tab);
    SKV_NONNULL(fn, in);
    SKV_NONNULL(fn, out);
    SKV_RANGE(fn, n_tokens, 0, (int64_t)1 << 31);
    SKV_RANGE(fn, n_heads, 1, 65536);
    SKV_RANGE(fn, pos0, 0, (int64_t)1 << 31);
    SKV_GET_SLOT(fn, rope);
    SKV_FINITE(fn, in, n_tokens * n_heads * head_dim);
    return skv_slot_result(fn, ops, ops->rope(rope, head_dim, n_tokens, n_heads, pos0, cos_tab, sin_tab, in, out));
}

SKV_API skv_status skv_op_landmarks_outliers(skv_backend backend, int32_t n_chunks, int32_t chunk,
                                             int32_t n_kv_heads, int32_t head_dim, int32_t n_outliers,
                                             const skv_bf16 *k_post, int32_t *outlier_ids,
                                             int32_t *candidate_ids, skv_bf16 *landmarks)
{
    static const char fn[] = "skv_op_landmarks_outliers";
    SKV_NONNULL(fn, k_post);
    SKV_NONNULL(fn, candidate_ids);
    SKV_NONNULL(fn, landmarks);
    if (n_outliers > 0) SKV_NONNULL(fn, outlier_ids);
    SKV_RANGE(fn, n_chunks, 1, INT32_MAX / 1024);
    SKV_RANGE(fn, chunk, 1, 4096);
    SKV_RANGE(fn, n_kv_heads, 1, 65536);
    SKV_RANGE(fn, head_dim, 1, SKV_MAX_D);
    SKV_RANGE(fn, n_outliers, 0, n_chunks - 1);
    SKV_GET_SLOT(fn, landmarks_outliers);
    SKV_FINITE(fn, k_post, (int64_t)n_chunks * chunk * n_kv_heads * head_dim);
    return skv_slot_result(fn, ops, ops->landmarks_outliers(n_chunks, chunk, n_kv_heads, head_dim, n_outliers, k_post,
                                   outlier_ids, candidate_ids, landmarks));
}

/* skv_op_score_select (mass = 0: the fixed count) and skv_op_score_select_mass: the same checks. */
static skv_status skv_score_select_op(const char *fn, int mass_mode, skv_backend backend, int32_t n_q_heads,
                                      int32_t n_kv_heads, int32_t head_dim, int32_t n_cand, int32_t n_select,
                                      float select_mass, int32_t select_min_chunks, float scale, const skv_bf16 *q,
                                      const skv_bf16 *landmarks, const int32_t *candidate_ids, int32_t *sel_idx,
                                      int32_t *sel_ids, float *amax, int32_t *counts)
{
    SKV_NONNULL(fn, q);
    SKV_NONNULL(fn, landmarks);
    SKV_NONNULL(fn, sel_idx);
    if (sel_ids) SKV_NONNULL(fn, candidate_ids);
    SKV_RANGE(fn, n_kv_heads, 1, 65536);
    SKV_RANGE(fn, n_q_heads, n_kv_heads, 65536);
    if (n_q_heads % n_kv_heads)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: n_q_heads = %d is not a multiple of n_kv_heads = %d",
                        fn, n_q_heads, n_kv_heads);
    SKV_RANGE(fn, head_dim, 1, SKV_MAX_D);
    SKV_RANGE(fn, n_cand, 1, INT32_MAX / 1024);
    if (mass_mode) {
        SKV_NONNULL(fn, counts);
        SKV_RANGE(fn, n_select, 1, INT32_MAX / 1024);
        if (!(select_mass > 0.0f && select_mass <= 1.0f))
            return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: select_mass = %g must be in (0, 1]", fn,
                            (double)select_mass);
        SKV_RANGE(fn, select_min_chunks, 0, n_select);
    } else {
        SKV_RANGE(fn, n_select, 1, n_cand);
    }
    if (!isfinite(scale) || scale < 0.0f)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: scale = %g must be finite and >= 0", fn, (double)scale);
    SKV_GET_SLOT(fn, score_select);
    SKV_FINITE(fn, q, (int64_t)n_q_heads * head_dim);
    SKV_FINITE(fn, landmarks, (int64_t)n_kv_heads * n_cand * head_dim);
    int64_t bad_i;
    int32_t bad_v;
    if (candidate_ids &&
        ops->check_range(candidate_ids, (int64_t)n_kv_heads * n_cand, 0, (int64_t)INT32_MAX + 1, &bad_i, &bad_v) != SKV_OK)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: candidate_ids[%lld] = %d < 0", fn, (long long)bad_i,
                        bad_v);
    skv_select_params sp;
    sp.mode = mass_mode ? SKV_SELECT_MASS : SKV_SELECT_FIXED;
    sp.cap = n_select < n_cand ? n_select : n_cand;
    sp.stride = n_select;
    sp.floor = select_min_chunks < sp.cap ? select_min_chunks : sp.cap;
    sp.mass = select_mass;
    skv_ws ws = {0};
    skv_status st = ops->score_select(n_q_heads, n_kv_heads, head_dim, n_cand, &sp, skv_resolve_scale(scale, head_dim),
                                      q, landmarks, candidate_ids, sel_idx, sel_ids, amax, counts, &ws);
    skv_ws_reset(&ws);
    return skv_slot_result(fn, ops, st);
}

SKV_API skv_status skv_op_score_select(skv_backend backend, int32_t n_q_heads, int32_t n_kv_heads,
                                       int32_t head_dim, int32_t n_cand, int32_t n_select, float scale,
                                       const skv_bf16 *q, const skv_bf16 *landmarks,
                                       const int32_t *candidate_ids, int32_t *sel_idx, int32_t *sel_ids,
                                       float *amax)
{
    return skv_score_select_op("skv_op_score_select", 0, backend, n_q_heads, n_kv_heads, head_dim, n_cand, n_select,
                               0.0f, 0, scale, q, landmarks, candidate_ids, sel_idx, sel_ids, amax, NULL);
}

SKV_API skv_status skv_op_score_select_mass(skv_backend backend, int32_t n_q_heads, int32_t n_kv_heads,
                                            int32_t head_dim, int32_t n_cand, int32_t n_select, float select_mass,
                                            int32_t select_min_chunks, float scale, const skv_bf16 *q,
                                            const skv_bf16 *landmarks, const int32_t *candidate_ids,
                                            int32_t *sel_idx, int32_t *sel_ids, float *amax, int32_t *counts)
{
    return skv_score_select_op("skv_op_score_select_mass", 1, backend, n_q_heads, n_kv_heads, head_dim, n_cand,
                               n_select, select_mass, select_min_chunks, scale, q, landmarks, candidate_ids, sel_idx,
                               sel_ids, amax, counts);
}

/* skv_op_rebuild_keys and skv_op_rebuild_keys_canonical: the same checks, then one of two slots. */
static skv_status skv_rebuild_op(const char *fn, int canonical, skv_backend backend, const skv_rope_config *rope,
                                 int32_t head_dim, int32_t n_kv_heads, int32_t rank, int32_t chunk, int32_t n_select,
                                 int64_t n, const skv_bf16 *u, const skv_bf16 *w, const int32_t *chunk_ids,
                                 const float *cos_tab, const float *sin_tab, skv_bf16 *k_out)
{
    skv_status st = skv_rope_args(fn, rope, head_dim);
    if (st) return st;
    SKV_NONNULL(fn, u);
    SKV_NONNULL(fn, w);
    SKV_NONNULL(fn, chunk_ids);
    SKV_NONNULL(fn, cos_tab);
    SKV_NONNULL(fn, sin_tab);
    SKV_NONNULL(fn, k_out);
    SKV_RANGE(fn, n_kv_heads, 1, 65536);
    SKV_RANGE(fn, chunk, 1, 4096);
    SKV_RANGE(fn, n_select, 1, INT32_MAX / 4096);
    SKV_RANGE(fn, n, chunk, (int64_t)1 << 31);
    SKV_RANGE(fn, rank, 1, (int64_t)n_kv_heads * head_dim);
    const struct skv_backend_ops *ops;
    {
        skv_backend got;
        st = skv_backend_resolve(NULL, backend, &got, &ops);
        if (st) return st;
    }
    skv_status (*slot)(const skv_rope_config *, int32_t, int32_t, int32_t, int32_t, int32_t, int64_t,
                       const skv_bf16 *, const skv_bf16 *, const int32_t *, const int32_t *, const float *,
                       const float *, skv_bf16 *, skv_ws *) = canonical ? ops->rebuild_keys_canonical : ops->rebuild_keys;
    if (!slot)
        return skv_fail(NULL, SKV_ERR_UNSUPPORTED, "%s: backend %s does not implement %s", fn, ops->name,
                        canonical ? "rebuild_keys_canonical" : "rebuild_keys");
    int64_t bad_i;
    int32_t bad_v;
    /* chunk j holds tokens j*c .. j*c + c-1, all below n: 0 <= j < floor(n/c) */
    if (ops->check_range(chunk_ids, (int64_t)n_kv_heads * n_select, 0, n / chunk, &bad_i, &bad_v) != SKV_OK)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: chunk_ids[%lld] = %d: its tokens exceed n = %lld",
                        fn, (long long)bad_i, bad_v, (long long)n);
    SKV_FINITE(fn, u, n * rank);
    SKV_FINITE(fn, w, (int64_t)rank * n_kv_heads * head_dim);
    skv_ws ws = {0};
    st = slot(rope, head_dim, n_kv_heads, rank, chunk, n_select, n, u, w, chunk_ids, NULL, cos_tab, sin_tab, k_out, &ws);
    skv_ws_reset(&ws);
    return skv_slot_result(fn, ops, st);
}

SKV_API skv_status skv_op_rebuild_keys(skv_backend backend, const skv_rope_config *rope,
                                       int32_t head_dim, int32_t n_kv_heads, int32_t rank, int32_t chunk,
                                       int32_t n_select, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                                       const int32_t *chunk_ids, const float *cos_tab,
                                       const float *sin_tab, skv_bf16 *k_out)
{
    return skv_rebuild_op("skv_op_rebuild_keys", 0, backend, rope, head_dim, n_kv_heads, rank, chunk, n_select, n,
                          u, w, chunk_ids, cos_tab, sin_tab, k_out);
}

SKV_API skv_status skv_op_rebuild_keys_canonical(skv_backend backend, const skv_rope_config *rope,
                                                 int32_t head_dim, int32_t n_kv_heads, int32_t rank, int32_t chunk,
                                                 int32_t n_select, int64_t n, const skv_bf16 *u, const skv_bf16 *w,
                                                 const int32_t *chunk_ids, const float *cos_tab,
                                                 const float *sin_tab, skv_bf16 *k_out)
{
    return skv_rebuild_op("skv_op_rebuild_keys_canonical", 1, backend, rope, head_dim, n_kv_heads, rank, chunk,
                          n_select, n, u, w, chunk_ids, cos_tab, sin_tab, k_out);
}

SKV_API skv_status skv_op_gather_values(skv_backend backend, int32_t n_kv_heads, int32_t head_dim,
                                        int32_t chunk, int32_t n_store, int32_t n_select,
                                        const skv_bf16 *store, const int32_t *idx, skv_bf16 *v_out)
{
    static const char fn[] = "skv_op_gather_values";
    SKV_NONNULL(fn, store);
    SKV_NONNULL(fn, idx);
    SKV_NONNULL(fn, v_out);
    SKV_RANGE(fn, n_kv_heads, 1, 65536);
    SKV_RANGE(fn, head_dim, 1, SKV_MAX_D);
    SKV_RANGE(fn, chunk, 1, 4096);
    SKV_RANGE(fn, n_store, 1, INT32_MAX / 4096);
    SKV_RANGE(fn, n_select, 1, INT32_MAX / 4096);
    SKV_GET_SLOT(fn, gather_values);
    int64_t bad_i;
    int32_t bad_v;
    if (ops->check_range(idx, (int64_t)n_kv_heads * n_select, 0, n_store, &bad_i, &bad_v) != SKV_OK)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: idx[%lld] = %d, must be in [0, %d)", fn,
                        (long long)bad_i, bad_v, n_store);
    return skv_slot_result(fn, ops, ops->gather_values(n_kv_heads, head_dim, chunk, n_store, n_select, SKV_VALUE_BF16,
                                                       store, idx, NULL, v_out));
}

static skv_status skv_attn_args(const char *fn, int32_t n_q_heads, int32_t n_kv_heads, int32_t head_dim,
                                float scale, const skv_bf16 *q, const float *out)
{
    if (!q) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: q is NULL", fn);
    if (!out) return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: out is NULL", fn);
    SKV_RANGE(fn, n_kv_heads, 1, 65536);
    SKV_RANGE(fn, n_q_heads, n_kv_heads, 65536);
    if (n_q_heads % n_kv_heads)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: n_q_heads = %d is not a multiple of n_kv_heads = %d",
                        fn, n_q_heads, n_kv_heads);
    SKV_RANGE(fn, head_dim, 1, SKV_MAX_D);
    if (!isfinite(scale) || scale < 0.0f)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: scale = %g must be finite and >= 0", fn, (double)scale);
    return SKV_OK;
}

/* skv_op_sparse_attention and skv_op_sparse_attention_canonical: the same checks, then one of two slots. */
static skv_status skv_sparse_op(const char *fn, int canonical, skv_backend backend, int32_t n_q_heads,
                                int32_t n_kv_heads, int32_t head_dim, float scale, const skv_bf16 *q, int32_t n_spans,
                                const skv_kv_span *spans, float *out)
{
    skv_status st = skv_attn_args(fn, n_q_heads, n_kv_heads, head_dim, scale, q, out);
    if (st) return st;
    SKV_NONNULL(fn, spans);
    SKV_RANGE(fn, n_spans, 1, SKV_MAX_SPANS);
    int64_t total = 0;
    for (int32_t i = 0; i < n_spans; i++) {
        const skv_kv_span *s = &spans[i];
        if (s->n_tokens < 0 || s->n_tokens > ((int64_t)1 << 31))
            return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: spans[%d].n_tokens = %lld out of range", fn,
                            i, (long long)s->n_tokens);
        if (s->n_tokens == 0) continue;
        if (!s->k || !s->v)
            return skv_fail(NULL, SKV_ERR_NULL_POINTER, "%s: spans[%d].%s is NULL", fn, i, !s->k ? "k" : "v");
        if (s->head_stride < 0 || s->token_stride < 0)
            return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: spans[%d] has a negative stride", fn, i);
        total += s->n_tokens;
    }
    if (total < 1)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: the spans hold no token", fn);
    const struct skv_backend_ops *ops;
    skv_backend got_;
    if ((st = skv_backend_resolve(NULL, backend, &got_, &ops))) return st;
    skv_status (*slot)(int32_t, int32_t, int32_t, float, const skv_bf16 *, int32_t, const skv_kv_span *,
                       const int64_t *, float *, skv_ws *) = canonical ? ops->sparse_attention_canonical : ops->sparse_attention;
    if (!slot)
        return skv_fail(NULL, SKV_ERR_UNSUPPORTED, "%s: backend %s does not implement %s", fn, ops->name,
                        canonical ? "sparse_attention_canonical" : "sparse_attention");
    SKV_BOUNDED(fn, q, (int64_t)n_q_heads * head_dim);
    for (int32_t i = 0; i < n_spans; i++) {
        const skv_kv_span *s = &spans[i];
        char what[32];
        if (s->n_tokens == 0) continue;
        for (int which = 0; which < 2; which++) {
            snprintf(what, sizeof what, "spans[%d].%s", (int)i, which ? "v" : "k");
            if ((st = skv_bounded(ops, got_, fn, what, which ? s->v : s->k, n_kv_heads, s->head_stride, s->n_tokens,
                                  s->token_stride, head_dim)))
                return st;
        }
    }
    skv_ws ws = {0};
    st = slot(n_q_heads, n_kv_heads, head_dim, skv_resolve_scale(scale, head_dim), q, n_spans, spans, NULL, out, &ws);
    skv_ws_reset(&ws);
    return skv_slot_result(fn, ops, st);
}

SKV_API skv_status skv_op_sparse_attention(skv_backend backend, int32_t n_q_heads, int32_t n_kv_heads,
                                           int32_t head_dim, float scale, const skv_bf16 *q,
                                           int32_t n_spans, const skv_kv_span *spans, float *out)
{
    return skv_sparse_op("skv_op_sparse_attention", 0, backend, n_q_heads, n_kv_heads, head_dim, scale, q, n_spans,
                         spans, out);
}

SKV_API skv_status skv_op_sparse_attention_canonical(skv_backend backend, int32_t n_q_heads, int32_t n_kv_heads,
                                                     int32_t head_dim, float scale, const skv_bf16 *q,
                                                     int32_t n_spans, const skv_kv_span *spans, float *out)
{
    return skv_sparse_op("skv_op_sparse_attention_canonical", 1, backend, n_q_heads, n_kv_heads, head_dim, scale,
                         q, n_spans, spans, out);
}

SKV_API skv_status skv_op_full_attention(skv_backend backend, int32_t n_q_heads, int32_t n_kv_heads,
                                         int32_t head_dim, float scale, const skv_bf16 *q,
                                         int64_t n_tokens, const skv_bf16 *k, const skv_bf16 *v,
                                         float *out)
{
    static const char fn[] = "skv_op_full_attention";
    skv_status st = skv_attn_args(fn, n_q_heads, n_kv_heads, head_dim, scale, q, out);
    if (st) return st;
    SKV_NONNULL(fn, k);
    SKV_NONNULL(fn, v);
    SKV_RANGE(fn, n_tokens, 1, (int64_t)1 << 31);
    SKV_GET_SLOT(fn, full_attention);
    SKV_BOUNDED(fn, q, (int64_t)n_q_heads * head_dim);
    SKV_BOUNDED(fn, k, n_tokens * n_kv_heads * head_dim);
    SKV_BOUNDED(fn, v, n_tokens * n_kv_heads * head_dim);
    return skv_slot_result(fn, ops, ops->full_attention(n_q_heads, n_kv_heads, head_dim, skv_resolve_scale(scale, head_dim), q,
                               n_tokens, k, v, out));
}

/* ---- buffers ----------------------------------------------------------------------------- */

SKV_API skv_status skv_buffer_alloc(skv_backend backend, size_t bytes, void **ptr)
{
    static const char fn[] = "skv_buffer_alloc";
    SKV_NONNULL(fn, ptr);
    *ptr = NULL;
    if (!bytes) return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT, "%s: bytes = 0", fn);
    SKV_GET_SLOT(fn, mem_alloc);
    *ptr = ops->mem_alloc(bytes, SKV_MEM_DEVICE);
    if (!*ptr)
        return skv_fail(NULL, SKV_ERR_OUT_OF_MEMORY, "%s: %zu bytes on backend %s failed", fn, bytes, ops->name);
    return SKV_OK;
}

SKV_API void skv_buffer_free(skv_backend backend, void *ptr)
{
    skv_backend got;
    const struct skv_backend_ops *ops;
    if (!ptr || skv_backend_resolve(NULL, backend, &got, &ops) != SKV_OK) return;
    ops->mem_free(ptr, SKV_MEM_DEVICE);
}

SKV_API skv_status skv_buffer_copy(skv_backend backend, void *dst, const void *src, size_t bytes)
{
    static const char fn[] = "skv_buffer_copy";
    if (!bytes) return SKV_OK;
    SKV_NONNULL(fn, dst);
    SKV_NONNULL(fn, src);
    SKV_GET_SLOT(fn, copy2d);
    skv_status st = ops->copy2d(dst, 0, src, 0, bytes, 1);
    if (st) return skv_fail(NULL, st, "%s: %zu bytes on backend %s: %s", fn, bytes, ops->name, skv_status_string(st));
    return SKV_OK;
}
