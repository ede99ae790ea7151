/*
 * fuzz_diff.c - differential harness: the ref backend (the oracle) against
 * cpu on identical carved inputs.
 *
 *  - Cache level: a small config (skvf_small_config) created once with
 *    backend ref and once with cpu; identical prefill data and decode steps.
 *    Statuses must be equal call by call; the decisions (outliers,
 *    candidates, bf16 landmarks after prefill; selected chunks after every
 *    step) bitwise equal for every (layer, seq, kv head) (the exact-selection
 *    contract); decode outputs finite on both or on neither. Their values are
 *    not compared with each other: each backend factorizes with its own
 *    summation order, so U and W differ by rounding (by much more where the
 *    spectrum is nearly degenerate at rank r, which random data often is),
 *    their bf16 roundings differ, and a sharp softmax can amplify that. (A fuzz
 *    run found 3e-3 on noise data.) Instead each backend's step goes through
 *    the oracle of skvf_check_decode: its selection is the top S of the scores
 *    recomputed from q and its landmarks, and its output a double-precision
 *    attention over the tokens it reports it used (with its own
 *    factorization's rebuilt keys). Decode steps mostly follow the layers in
 *    step (a layer ahead of another is refused by both alike).
 *    Inputs whose selector byte is 4 (mod 5) run the caches in the reproducible
 *    mode (config.reproducible = 1), where the decode outputs must be bitwise
 *    equal as well (docs/DESIGN.md section 10); where cuda runs, a third cache
 *    on cuda is held to ref's statuses, decisions and output bits too.
 *  - Op level: skv_op_landmarks_outliers and skv_op_score_select on carved
 *    shapes and data (ties, NaN/Inf, bad sizes): statuses equal, outputs
 *    bitwise equal on success and untouched on error. skv_op_sparse_attention
 *    on identical spans: outputs within relative L2 4e-3 (each backend is
 *    within 2e-3 of the double-precision result, docs/DESIGN.md section 6);
 *    skv_op_sparse_attention_canonical on the same spans: bitwise equal.
 * A failing status additionally satisfies skvf_check_status.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

#define ATTN_REL_TOL 4e-3

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) skvf_fail("out of memory");
    return p;
}

/* ---- op level -------------------------------------------------------------------------- */

static void *poisoned(size_t bytes)
{
    void *p = skvf_guarded_alloc(bytes);
    memset(p, 0xAB, bytes);
    return p;
}

static int is_poison(const void *p, size_t bytes)
{
    const unsigned char *u = p;
    for (size_t i = 0; i < bytes; i++)
        if (u[i] != 0xAB) return 0;
    return 1;
}

/* Compares an output pair: bitwise on OK, both untouched on an error that is not numerical. */
static void cmp_out(skv_status st, const void *a, const void *b, size_t bytes, const char *what)
{
    skvf_guarded_check(a, what);
    skvf_guarded_check(b, what);
    if (!a) return;
    if (st == SKV_OK) {
        if (memcmp(a, b, bytes) != 0) skvf_fail("%s: ref and cpu differ (bitwise)", what);
    } else if (st != SKV_ERR_NUMERICAL && st != SKV_ERR_OUT_OF_MEMORY) {
        if (!is_poison(a, bytes) || !is_poison(b, bytes)) skvf_fail("%s written although the call failed (%d)", what, (int)st);
    }
}

static void diff_landmarks_outliers(skvf_data *d)
{
    static const int64_t dims[] = {2, 8, 16, 32, 64};
    static const int64_t chunks[] = {1, 2, 4, 8};
    int32_t N = (int32_t)skvf_range(d, 1, 64);
    int32_t c = (int32_t)skvf_pick(d, chunks, 4);
    int32_t Hk = (int32_t)skvf_range(d, 1, 2);
    int32_t D = (int32_t)skvf_pick(d, dims, 5);
    int32_t O = (int32_t)skvf_range(d, 0, N - 1);
    /* sometimes a bad size (both must reject it the same way) or an odd head_dim (allowed) */
    switch (skvf_u8(d) & 15) {
    case 0: O = N; break;
    case 1: O = -1; break;
    case 2: D = skvf_bool(d) ? 0 : 3; break;
    default: break;
    }
    const size_t ek = (size_t)N * c * Hk * (D > 0 ? D : 1);
    skv_bf16 *k = xmalloc(ek * sizeof *k);
    skvf_fill_bf16(d, k, ek, skvf_u8(d) < 48);
    const int32_t Oc = O < 0 ? 0 : O > N ? N : O, nc = N - Oc;
    const int32_t Dc = D < 0 ? 0 : D;
    const size_t bo = (size_t)Hk * Oc * sizeof(int32_t), bc = (size_t)Hk * nc * sizeof(int32_t);
    const size_t bl = (size_t)Hk * nc * Dc * sizeof(skv_bf16);
    void *o[2], *ca[2], *lm[2];
    skv_status st[2];
    for (int i = 0; i < 2; i++) {
        o[i] = poisoned(bo);
        ca[i] = poisoned(bc);
        lm[i] = poisoned(bl);
        st[i] = skv_op_landmarks_outliers(i ? SKV_BACKEND_CPU : SKV_BACKEND_REF, N, c, Hk, D, O, k, o[i], ca[i], lm[i]);
        skvf_check_status(st[i], i ? "skv_op_landmarks_outliers (cpu)" : "skv_op_landmarks_outliers (ref)");
    }
    if (st[0] != st[1]) skvf_fail("skv_op_landmarks_outliers: ref status %d, cpu %d (N %d c %d Hk %d D %d O %d)",
                                  (int)st[0], (int)st[1], N, c, Hk, D, O);
    if (st[0] == SKV_OK && (O < 0 || O >= N || D < 1))
        skvf_fail("skv_op_landmarks_outliers accepted O = %d, N = %d, D = %d", O, N, D);
    cmp_out(st[0], o[0], o[1], bo, "landmarks_outliers outlier_ids");
    cmp_out(st[0], ca[0], ca[1], bc, "landmarks_outliers candidate_ids");
    cmp_out(st[0], lm[0], lm[1], bl, "landmarks_outliers landmarks");
    for (int i = 0; i < 2; i++) {
        skvf_guarded_free(o[i], "outlier_ids");
        skvf_guarded_free(ca[i], "candidate_ids");
        skvf_guarded_free(lm[i], "landmarks");
    }
    free(k);
}

static void diff_score_select(skvf_data *d)
{
    static const int64_t dims[] = {2, 8, 16, 32, 64};
    int32_t Hk = (int32_t)skvf_range(d, 1, 2);
    int32_t Hq = Hk * (int32_t)skvf_range(d, 1, 4);
    int32_t D = (int32_t)skvf_pick(d, dims, 5);
    int32_t nc = (int32_t)skvf_range(d, 1, 64);
    int32_t S = (int32_t)skvf_range(d, 1, nc);
    float scale = skvf_bool(d) ? 0.0f : skvf_bool(d) ? (float)skvf_range(d, 1, 255) / 64.0f : skvf_float(d);
    const size_t eq = (size_t)Hq * D, el = (size_t)Hk * nc * D;
    skv_bf16 *q = xmalloc(eq * sizeof *q), *lmk = xmalloc(el * sizeof *lmk);
    const int bad = skvf_u8(d) < 48;
    skvf_fill_bf16(d, q, eq, bad);
    skvf_fill_bf16(d, lmk, el, bad);
    int32_t *cids = NULL;
    if (skvf_bool(d)) { /* increasing chunk ids per head */
        cids = xmalloc((size_t)Hk * nc * sizeof *cids);
        for (int32_t h = 0; h < Hk; h++) {
            int32_t id = (int32_t)skvf_range(d, 0, 4);
            for (int32_t j = 0; j < nc; j++) cids[(size_t)h * nc + j] = id, id += 1 + (int32_t)skvf_range(d, 0, 3);
        }
    }
    const int want_ids = cids && skvf_bool(d), want_amax = skvf_bool(d);
    switch (skvf_u8(d) & 15) { /* sometimes a bad size */
    case 0: S = nc + 1; break;
    case 1: S = 0; break;
    default: break;
    }
    const int32_t Sc = S < 0 ? 0 : S;
    const size_t bs = (size_t)Hk * Sc * sizeof(int32_t), ba = (size_t)Hk * nc * sizeof(float);
    void *si[2], *sd[2] = {NULL, NULL}, *am[2] = {NULL, NULL};
    skv_status st[2];
    for (int i = 0; i < 2; i++) {
        si[i] = poisoned(bs);
        if (want_ids) sd[i] = poisoned(bs);
        if (want_amax) am[i] = poisoned(ba);
        st[i] = skv_op_score_select(i ? SKV_BACKEND_CPU : SKV_BACKEND_REF, Hq, Hk, D, nc, S, scale, q, lmk, cids,
                                    si[i], sd[i], am[i]);
        skvf_check_status(st[i], i ? "skv_op_score_select (cpu)" : "skv_op_score_select (ref)");
    }
    if (st[0] != st[1]) skvf_fail("skv_op_score_select: ref status %d, cpu %d (Hq %d Hk %d D %d n_cand %d S %d)",
                                  (int)st[0], (int)st[1], Hq, Hk, D, nc, S);
    if (st[0] == SKV_OK && (S < 1 || S > nc)) skvf_fail("skv_op_score_select accepted S = %d of %d", S, nc);
    cmp_out(st[0], si[0], si[1], bs, "score_select sel_idx");
    cmp_out(st[0], sd[0], sd[1], bs, "score_select sel_ids");
    cmp_out(st[0], am[0], am[1], ba, "score_select amax");
    if (st[0] == SKV_OK) {
        const int32_t *sel = si[0];
        for (int32_t h = 0; h < Hk; h++)
            for (int32_t j = 0; j < S; j++) {
                int32_t x = sel[(size_t)h * S + j];
                if (x < 0 || x >= nc || (j && x <= sel[(size_t)h * S + j - 1]))
                    skvf_fail("score_select: sel_idx[%d][%d] = %d not increasing in [0, %d)", h, j, x, nc);
                if (want_ids && ((const int32_t *)sd[0])[(size_t)h * S + j] != cids[(size_t)h * nc + x])
                    skvf_fail("score_select: sel_ids[%d][%d] != candidate_ids[sel_idx]", h, j);
            }
    }
    for (int i = 0; i < 2; i++) {
        skvf_guarded_free(si[i], "sel_idx");
        skvf_guarded_free(sd[i], "sel_ids");
        skvf_guarded_free(am[i], "amax");
    }
    free(q);
    free(lmk);
    free(cids);
}

/* ---- cache level ----------------------------------------------------------------------- */

/* Generic noise in [-1, 1) from a seed (distinct eigenvalues almost surely). */
static void fill_noise(uint64_t seed, skv_bf16 *x, size_t n)
{
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        x[i] = skv_bf16_from_float((float)(int32_t)(s >> 32) / 2147483648.0f);
    }
}

static void same_decisions(skv_cache *const c[2], const skv_config *cfg, int after_step, int32_t only_layer,
                           const char *other)
{
    int64_t max_chunks = cfg->max_prompt_len / cfg->chunk_size + 1;
    int32_t *ids[2];
    skv_bf16 *lm[2];
    for (int i = 0; i < 2; i++) {
        ids[i] = xmalloc((size_t)max_chunks * sizeof(int32_t));
        lm[i] = xmalloc((size_t)max_chunks * cfg->head_dim * sizeof(skv_bf16));
    }
    for (int32_t l = 0; l < cfg->n_layers; l++) {
        if (only_layer >= 0 && l != only_layer) continue;
        for (int32_t b = 0; b < cfg->batch_size; b++) {
            skv_seq_info in[2];
            skv_status s0 = skv_cache_seq_info(c[0], l, b, &in[0]), s1 = skv_cache_seq_info(c[1], l, b, &in[1]);
            if (s0 || s1 || memcmp(&in[0], &in[1], sizeof in[0]) != 0)
                skvf_fail("seq_info(%d, %d): ref and %s differ", l, b, other);
            if (!in[0].prefilled) continue;
            for (int32_t h = 0; h < cfg->n_kv_heads; h++) {
                const int kinds = after_step ? 1 : 3;
                for (int kind = 0; kind < kinds; kind++) {
                    size_t bytes;
                    skv_status st[2];
                    for (int i = 0; i < 2; i++) {
                        memset(ids[i], 0, (size_t)max_chunks * sizeof(int32_t));
                        if (after_step) st[i] = skv_cache_selected(c[i], l, b, h, ids[i]);
                        else if (kind == 0) st[i] = skv_cache_outliers(c[i], l, b, h, ids[i]);
                        else if (kind == 1) st[i] = skv_cache_candidates(c[i], l, b, h, ids[i]);
                        else st[i] = skv_cache_landmarks(c[i], l, b, h, lm[i]);
                    }
                    if (st[0] != SKV_OK || st[1] != SKV_OK)
                        skvf_fail("introspection kind %d of (%d, %d, %d): status ref %d %s %d", kind, l, b, h,
                                  (int)st[0], other, (int)st[1]);
                    if (after_step) bytes = (size_t)in[0].n_selected * sizeof(int32_t);
                    else if (kind == 0) bytes = (size_t)in[0].n_outliers * sizeof(int32_t);
                    else if (kind == 1) bytes = (size_t)in[0].n_candidates * sizeof(int32_t);
                    else bytes = (size_t)in[0].n_candidates * cfg->head_dim * sizeof(skv_bf16);
                    const void *a = kind == 2 ? (const void *)lm[0] : ids[0], *bb = kind == 2 ? (const void *)lm[1] : ids[1];
                    if (memcmp(a, bb, bytes) != 0)
                        skvf_fail("%s of (layer %d, seq %d, head %d): ref and %s differ (bitwise)",
                                  after_step ? "selected chunks" : kind == 0 ? "outliers" : kind == 1 ? "candidates" : "landmarks",
                                  l, b, h, other);
                }
            }
        }
    }
    for (int i = 0; i < 2; i++) free(ids[i]), free(lm[i]);
}

/* ---- the cuda leg of the reproducible mode (when a GPU is there) ------------------------- */

/* Whether cuda runs here (asked once). */
static int cuda_here(void)
{
    static int known = -1;
    if (known < 0) known = skv_backend_available(SKV_BACKEND_CUDA) == SKV_OK;
    return known;
}

/* A device copy of a host tensor (NULL for NULL). */
static void *to_device(const void *h, size_t bytes)
{
    if (!h) return NULL;
    void *p = NULL;
    if (skv_buffer_alloc(SKV_BACKEND_CUDA, bytes ? bytes : 1, &p) != SKV_OK ||
        skv_buffer_copy(SKV_BACKEND_CUDA, p, h, bytes) != SKV_OK)
        skvf_fail("cuda leg: device copy of %zu bytes: %s", bytes, skv_last_error());
    return p;
}

/* skv_prefill on cuda from host tensors; the status as the synchronous backends give it. */
static skv_status cuda_prefill(skv_cache *c, int32_t l, int32_t b, int64_t n, size_t e, const skv_bf16 *kp,
                               const skv_bf16 *vv, const skv_bf16 *ko)
{
    void *dk = to_device(kp, e * 2), *dv = to_device(vv, e * 2), *dko = to_device(ko, e * 2);
    skv_status st = skv_prefill(c, l, b, n, dk, dv, dko);
    skv_buffer_free(SKV_BACKEND_CUDA, dk), skv_buffer_free(SKV_BACKEND_CUDA, dv), skv_buffer_free(SKV_BACKEND_CUDA, dko);
    return st;
}

/* skv_decode on cuda from host tensors into host out; a deferred NaN/Inf is read at the sync. */
static skv_status cuda_decode(skv_cache *c, int32_t l, size_t eq, size_t ek, const skv_bf16 *q, const skv_bf16 *k,
                              const skv_bf16 *v, float *out)
{
    void *dq = to_device(q, eq * 2), *dk = to_device(k, ek * 2), *dv = to_device(v, ek * 2), *dout = NULL;
    if (skv_buffer_alloc(SKV_BACKEND_CUDA, eq * sizeof(float), &dout) != SKV_OK)
        skvf_fail("cuda leg: out buffer: %s", skv_last_error());
    skv_status st = skv_decode(c, l, dq, dk, dv, dout);
    skv_status ss = skv_cache_sync(c);
    if (st == SKV_OK) st = ss;
    if (st == SKV_OK && skv_buffer_copy(SKV_BACKEND_CUDA, out, dout, eq * sizeof(float)) != SKV_OK)
        skvf_fail("cuda leg: out copy: %s", skv_last_error());
    skv_buffer_free(SKV_BACKEND_CUDA, dq), skv_buffer_free(SKV_BACKEND_CUDA, dk), skv_buffer_free(SKV_BACKEND_CUDA, dv);
    skv_buffer_free(SKV_BACKEND_CUDA, dout);
    return st;
}

static void diff_cache(skvf_data *d, int reproducible)
{
    skv_config cfg = skvf_small_config(d);
    cfg.reproducible = reproducible;
    skv_cache *c[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++) {
        skv_config ci = cfg;
        ci.backend = i ? SKV_BACKEND_CPU : SKV_BACKEND_REF;
        skv_status st = skv_cache_create(&ci, &c[i]);
        skvf_check_status(st, "skv_cache_create");
        if (st != SKV_OK) skvf_fail("skv_cache_create(%s) of a small valid config: %s", i ? "cpu" : "ref", skv_last_error());
    }
    /* reproducible mode on a machine with a GPU: a third cache on cuda, held to ref bit for bit */
    skv_cache *cu = NULL;
    if (reproducible && cuda_here()) {
        skv_config ci = cfg;
        ci.backend = SKV_BACKEND_CUDA;
        if (skv_cache_create(&ci, &cu) != SKV_OK)
            skvf_fail("skv_cache_create(cuda) of a small valid reproducible config: %s", skv_last_error());
    }
    const int32_t L = cfg.n_layers, B = cfg.batch_size;
    const int64_t row = (int64_t)cfg.n_kv_heads * cfg.head_dim;
    const int64_t minp = skvf_min_prompt(&cfg), maxp = cfg.max_prompt_len;
    int complete = 1;
    skvf_slot slots[2][2][2]; /* [backend][layer][seq] */
    memset(slots, 0, sizeof slots);
    for (int32_t l = 0; l < L; l++)
        for (int32_t b = 0; b < B; b++) {
            const int64_t n = skvf_range(d, minp, maxp);
            const size_t e = (size_t)(n * row);
            skv_bf16 *kp = xmalloc(e * sizeof *kp), *vv = xmalloc(e * sizeof *vv), *ko = NULL;
            const int noise = skvf_u8(d) < 160;
            if (noise) fill_noise(skvf_u32(d), kp, e);
            else skvf_fill_bf16(d, kp, e, 0);
            skvf_fill_bf16(d, vv, e, 0);
            skvf_clamp_magnitude(kp, e); /* valid prompts (fuzz_prefill covers the magnitude check) */
            skvf_clamp_magnitude(vv, e);
            if (skvf_u8(d) < 64) {
                ko = xmalloc(e * sizeof *ko);
                skvf_fill_bf16(d, ko, e, 0);
                skvf_clamp_magnitude(ko, e);
            }
            skv_status st[2];
            for (int i = 0; i < 2; i++) {
                st[i] = skv_prefill(c[i], l, b, n, kp, vv, ko);
                skvf_check_status(st[i], "skv_prefill");
                if (st[i] == SKV_OK)
                    skvf_slot_prefilled(&slots[i][l][b], &cfg, i ? SKV_BACKEND_CPU : SKV_BACKEND_REF, n, kp, vv, ko);
            }
            if (cu) {
                const skv_status sc = cuda_prefill(cu, l, b, n, e, kp, vv, ko);
                if (sc != st[0])
                    skvf_fail("skv_prefill(%d, %d, n %lld): ref status %d, cuda %d (%s)", l, b, (long long)n, (int)st[0],
                              (int)sc, skv_last_error());
            }
            free(kp);
            free(vv);
            free(ko);
            if (st[0] != st[1]) skvf_fail("skv_prefill(%d, %d, n %lld): ref status %d, cpu %d", l, b, (long long)n,
                                          (int)st[0], (int)st[1]);
            if (st[0] != SKV_OK) complete = 0;
        }
    same_decisions(c, &cfg, 0, -1, "cpu");
    if (cu) {
        skv_cache *rc[2] = {c[0], cu};
        same_decisions(rc, &cfg, 0, -1, "cuda");
    }

    if (complete) {
        const size_t eq = (size_t)B * cfg.n_q_heads * cfg.head_dim, ek = (size_t)B * row;
        skv_bf16 *q = xmalloc(eq * sizeof *q), *k = xmalloc(ek * sizeof *k), *v = xmalloc(ek * sizeof *v);
        float *out[3] = {xmalloc(eq * sizeof(float)), xmalloc(eq * sizeof(float)), xmalloc(eq * sizeof(float))};
        const int n_steps = (int)skvf_range(d, 0, cfg.gen_capacity * L + 1);
        int32_t gen[2] = {0, 0};
        for (int step = 0; step < n_steps; step++) {
            int32_t next = 0; /* the layer in step */
            for (int32_t ll = 1; ll < L; ll++)
                if (gen[ll] < gen[next]) next = ll;
            const int32_t l = skvf_u8(d) < 32 ? (int32_t)skvf_range(d, 0, L - 1) : next;
            const int bad = skvf_u8(d) < 24;
            skvf_fill_bf16(d, q, eq, bad);
            skvf_fill_bf16(d, k, ek, bad);
            skvf_fill_bf16(d, v, ek, bad);
            skv_status st[2];
            for (int i = 0; i < 2; i++) {
                st[i] = skv_decode(c[i], l, q, k, v, out[i]);
                skvf_check_status(st[i], "skv_decode");
            }
            if (st[0] != st[1]) skvf_fail("skv_decode(layer %d) step %d: ref status %d, cpu %d", l, step, (int)st[0], (int)st[1]);
            if (cu) {
                const skv_status sc = cuda_decode(cu, l, eq, ek, q, k, v, out[2]);
                if (sc != st[0])
                    skvf_fail("skv_decode(layer %d) step %d: ref status %d, cuda %d (%s)", l, step, (int)st[0], (int)sc,
                              skv_last_error());
                if (sc == SKV_OK && memcmp(out[0], out[2], eq * sizeof(float)) != 0) {
                    size_t i = 0;
                    while (memcmp(out[0] + i, out[2] + i, sizeof(float)) == 0) i++;
                    skvf_fail("reproducible decode layer %d step %d: output [%zu] ref %a cuda %a (bitwise differ)", l,
                              step, i, (double)out[0][i], (double)out[2][i]);
                }
                if (sc == SKV_OK) {
                    skv_cache *rc[2] = {c[0], cu};
                    same_decisions(rc, &cfg, 1, l, "cuda");
                }
            }
            if (st[0] != SKV_OK) continue;
            gen[l]++;
            same_decisions(c, &cfg, 1, l, "cpu");
            for (int i = 0; i < 2; i++) {
                for (int32_t b = 0; b < B; b++)
                    skvf_slot_append(&slots[i][l][b], &cfg, k + (size_t)b * row, v + (size_t)b * row);
                skvf_check_decode(c[i], &cfg, l, slots[i][l], q, out[i], i ? "cpu" : "ref");
            }
            const size_t per = (size_t)cfg.n_q_heads * cfg.head_dim;
            /* the reproducible mode: every output bit equal (docs/DESIGN.md section 10) */
            if (reproducible && memcmp(out[0], out[1], (size_t)B * per * sizeof(float)) != 0) {
                size_t i = 0;
                while (memcmp(out[0] + i, out[1] + i, sizeof(float)) == 0) i++;
                skvf_fail("reproducible decode layer %d step %d: output [%zu] ref %a cpu %a (bitwise differ)", l, step,
                          i, (double)out[0][i], (double)out[1][i]);
            }
            for (int32_t b = 0; b < B; b++) {
                const float *a = out[0] + b * per, *x = out[1] + b * per;
                int fa = 1, fx = 1;
                for (size_t i = 0; i < per; i++) {
                    fa &= isfinite(a[i]) != 0;
                    fx &= isfinite(x[i]) != 0;
                }
                if (fa != fx) skvf_fail("decode layer %d seq %d: output finite on %s only", l, b, fa ? "ref" : "cpu");
            }
        }
        free(q);
        free(k);
        free(v);
        free(out[0]);
        free(out[1]);
        free(out[2]);
    }
    skv_cache_free(cu);
    skv_cache_free(c[0]);
    skv_cache_free(c[1]);
    for (int i = 0; i < 2; i++)
        for (int32_t l = 0; l < 2; l++)
            for (int32_t b = 0; b < 2; b++) skvf_slot_free(&slots[i][l][b]);
}

/* skv_op_sparse_attention on identical spans, ref vs cpu: within ATTN_REL_TOL. */
static void diff_attention(skvf_data *d)
{
    const int32_t Hk = (int32_t)skvf_range(d, 1, 2), G = (int32_t)skvf_range(d, 1, 4), Hq = Hk * G;
    const int32_t D = 2 * (int32_t)skvf_range(d, 1, 32);
    const int64_t T = skvf_range(d, 1, 300);
    const float scale = skvf_bool(d) ? 0.0f : (float)skvf_range(d, 1, 100) / 100.0f;
    const size_t eq = (size_t)Hq * D, ekv = (size_t)T * Hk * D;
    skv_bf16 *q = xmalloc(eq * 2), *k = xmalloc(ekv * 2), *v = xmalloc(ekv * 2);
    skvf_fill_bf16(d, q, eq, 0);
    skvf_fill_bf16(d, k, ekv, 0);
    skvf_fill_bf16(d, v, ekv, 0);
    skv_kv_span span = {k, v, T, D, (int64_t)Hk * D};
    float *out[2] = {xmalloc(eq * 4), xmalloc(eq * 4)};
    skv_status st[2];
    for (int i = 0; i < 2; i++) {
        st[i] = skv_op_sparse_attention(i ? SKV_BACKEND_CPU : SKV_BACKEND_REF, Hq, Hk, D, scale, q, 1, &span, out[i]);
        skvf_check_status(st[i], "skv_op_sparse_attention");
    }
    if (st[0] != st[1]) skvf_fail("skv_op_sparse_attention: ref status %d, cpu %d", (int)st[0], (int)st[1]);
    /* the 2e-3 bound holds for realistic score magnitudes; past |s| ~ 100 float rounding of the
       scores alone moves the weights by more, on either backend */
    double mq = 0.0, mk = 0.0;
    for (size_t i = 0; i < eq; i++) mq = fmax(mq, fabs((double)skv_bf16_to_float(q[i])));
    for (size_t i = 0; i < ekv; i++) mk = fmax(mk, fabs((double)skv_bf16_to_float(k[i])));
    const double sc = scale > 0.0f ? scale : 1.0 / sqrt((double)D);
    const int compare = st[0] == SKV_OK && mq * mk * D * sc <= 100.0;
    for (int32_t h = 0; compare && h < Hq; h++) {
        double num = 0.0, den = 0.0;
        int fa = 1, fx = 1;
        for (int32_t e = 0; e < D; e++) {
            double a = out[0][(size_t)h * D + e], x = out[1][(size_t)h * D + e];
            fa &= isfinite(a) != 0;
            fx &= isfinite(x) != 0;
            num += (a - x) * (a - x);
            den += a * a;
        }
        if (fa != fx) skvf_fail("skv_op_sparse_attention head %d: output finite on %s only", h, fa ? "ref" : "cpu");
        if (fa && isfinite(den) && sqrt(num) > ATTN_REL_TOL * sqrt(den) + 1e-30)
            skvf_fail("skv_op_sparse_attention head %d (Hq %d Hk %d D %d T %lld): relative L2 %.3g between ref and cpu "
                      "> %g", h, Hq, Hk, D, (long long)T, den > 0 ? sqrt(num / den) : sqrt(num), ATTN_REL_TOL);
    }
    /* the canonical attention of the reproducible mode: bitwise equal, always */
    for (int i = 0; i < 2; i++) {
        memset(out[i], 0xAB, eq * 4);
        st[i] = skv_op_sparse_attention_canonical(i ? SKV_BACKEND_CPU : SKV_BACKEND_REF, Hq, Hk, D, scale, q, 1, &span,
                                                  out[i]);
        skvf_check_status(st[i], "skv_op_sparse_attention_canonical");
    }
    if (st[0] != st[1])
        skvf_fail("skv_op_sparse_attention_canonical: ref status %d, cpu %d", (int)st[0], (int)st[1]);
    if (st[0] == SKV_OK && memcmp(out[0], out[1], eq * 4) != 0)
        skvf_fail("skv_op_sparse_attention_canonical (Hq %d Hk %d D %d T %lld): ref and cpu differ (bitwise)", Hq, Hk, D,
                  (long long)T);
    free(q), free(k), free(v), free(out[0]), free(out[1]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    switch (skvf_u8(&d) % 5) {
    case 0: diff_landmarks_outliers(&d); break;
    case 1: diff_score_select(&d); break;
    case 2: diff_attention(&d); break;
    case 3: diff_cache(&d, 0); break;
    default: diff_cache(&d, 1); break; /* the reproducible mode */
    }
    return 0;
}
