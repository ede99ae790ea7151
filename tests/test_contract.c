/*
 * The exact-selection contract (docs/DESIGN.md section 5) through the public cache
 * API: for >= 100 random configurations (GQA group 1/4/8, head dim 64/128/256,
 * chunk 4/8/16, ragged batches, planted exact ties), every non-ref backend
 * must produce bitwise the same bf16 landmarks, outlier sets, candidate lists
 * and selected chunk sets at every decode step as ref.
 *
 * The selection rule itself is checked independently: the selected set must
 * be the top-S of the ref's group-max probabilities under (value desc, index
 * asc), recomputed here with a plain sort.
 *
 * Every fourth configuration runs with config.reproducible = 1 (docs/DESIGN.md
 * section 10): there the decode outputs must be bitwise equal to ref's too.
 *
 * The selection count (section 4.5): configurations cycle through SKV_SELECT_MASS
 * (targets from 1e-6 to 1, floors 0, 1 and S, prompts with fewer candidates than
 * S), budget = SKV_BUDGET_ALL, and dense first layers (config.dense_layers); each
 * head's count (skv_cache_selected_count) and its set, -1 past the count, must be
 * bitwise ref's. The mass rule itself is checked on the op level against a
 * straightforward re-implementation here (sort, 256-lane sum, running sum), with
 * ties, NaN keys (overflowing inputs), p = 1, floor = cap and tiny and huge targets,
 * and skv_op_score_select_mass of every backend against ref's, bitwise.
 * Where a backend cannot prefill in that mode yet (SKV_ERR_UNSUPPORTED: no
 * canonical factorization), that configuration is a counted skip.
 *
 * Configurations i % 7 == 5 and 6 rescore their candidates (config.select_candidates,
 * docs/DESIGN.md 4.5.1): S to S + 24 of them, or all; counts, sets and (reproducible)
 * outputs bitwise ref's as above.
 *
 * Every fifth configuration (i % 5 == 2) takes config.rank = 0 with rank_max the
 * drawn rank (docs/DESIGN.md 3.1): each slot's seq_info.rank must lie in
 * [1, rank_max], and where the configuration is also reproducible the ranks
 * join the decision log, so they must equal ref's bit for bit.
 *
 *   build/tests/test_contract [n_configs]      SKV_SEED=... to replay
 *
 * Progress: a line on stderr every 10 configurations or 10 s, whichever
 * comes first ("test_contract: 40/100 configurations, 40 compared, 12.3 s").
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "skv_backend.h"
#include "skv_numerics.h"
#include "testutil.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

typedef struct {
    skv_config cfg;
    int64_t n[4];
    int steps;
} contract_case;

static void random_case(skvt_rng *r, contract_case *cc)
{
    static const int groups[] = {1, 4, 8}, dims[] = {64, 128, 256}, chunks[] = {4, 8, 16};
    skv_config c = skv_config_default();
    c.n_layers = (int)skvt_rng_range(r, 1, 2);
    c.n_kv_heads = (int)skvt_rng_range(r, 1, 2);
    c.n_q_heads = c.n_kv_heads * groups[skvt_rng_range(r, 0, 2)];
    c.head_dim = dims[skvt_rng_range(r, 0, 2)];
    c.chunk_size = chunks[skvt_rng_range(r, 0, 2)];
    c.budget = c.chunk_size * (int)skvt_rng_range(r, 1, 12);
    c.n_outlier_chunks = (int)skvt_rng_range(r, 0, 6);
    c.n_local_chunks = (int)skvt_rng_range(r, 0, 3);
    c.batch_size = (int)skvt_rng_range(r, 1, 3);
    c.gen_capacity = 4;
    c.rope.theta = skvt_rng_uniform(r) < 0.5 ? 10000.0f : 500000.0f;
    c.rope.interleaved = skvt_rng_uniform(r) < 0.25;
    c.rope.rotary_dim = skvt_rng_uniform(r) < 0.25 ? c.head_dim / 2 : 0;
    c.rope.llama3_scaling = skvt_rng_uniform(r) < 0.25;
    int64_t min_n = (int64_t)(c.n_outlier_chunks + c.budget / c.chunk_size + c.n_local_chunks) * c.chunk_size;
    c.max_prompt_len = min_n + 400;
    int64_t cap_r = (int64_t)c.n_kv_heads * c.head_dim < min_n ? (int64_t)c.n_kv_heads * c.head_dim : min_n;
    c.rank = (int)skvt_rng_range(r, 1, cap_r < 48 ? cap_r : 48);
    for (int b = 0; b < c.batch_size; b++) cc->n[b] = skvt_rng_range(r, min_n, c.max_prompt_len);
    cc->steps = 3;
    cc->cfg = c;
}

/*
 * The 0.3 modes, by configuration index (a separate generator: the other fields and the
 * prompts of the fixed-mode configurations stay as they were): i % 5 == 1 SKV_SELECT_MASS,
 * i % 5 == 2 SKV_BUDGET_ALL, i % 5 == 4 SKV_SELECT_MASS with a floor; i % 3 == 1 layer 0
 * dense. Mass and all-chunk configurations draw shorter prompts too (N - O < S).
 */
static void mode_case(int i, uint64_t seed, contract_case *cc)
{
    skv_config *c = &cc->cfg;
    skvt_rng r;
    skvt_rng_seed(&r, seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(i + 1)));
    static const float masses[] = {0.5f, 0.8f, 0.95f, 0.99f, 1.0f, 1e-6f};
    const int32_t S = c->budget / c->chunk_size;
    int32_t need = 0;
    if (i % 5 == 1 || i % 5 == 4) {
        c->select_mode = SKV_SELECT_MASS;
        c->select_mass = masses[skvt_rng_range(&r, 0, 5)];
        c->select_min_chunks = i % 5 == 4 ? (skvt_rng_uniform(&r) < 0.5 ? S : 1) : 0;
        need = c->select_min_chunks > 1 ? c->select_min_chunks : 1;
    } else if (i % 5 == 2) {
        c->budget = SKV_BUDGET_ALL;
        need = 1;
    }
    if (i % 3 == 1) c->dense_layers = 1;
    if (!need) return;
    const int64_t min_n = (int64_t)(c->n_outlier_chunks + need + c->n_local_chunks) * c->chunk_size;
    if (c->rank > min_n) c->rank = (int32_t)min_n;
    for (int b = 0; b < c->batch_size; b++)
        if (skvt_rng_uniform(&r) < 0.5) cc->n[b] = skvt_rng_range(&r, min_n, cc->n[b]);
}

/*
 * The rescoring (docs/DESIGN.md 4.5.1), by configuration index with its own generator:
 * i % 7 == 5 select_candidates in [S, S + 24] (with SKV_BUDGET_ALL: in [1, 24]), i % 7 == 6
 * at least every candidate of the longest prompt. It joins every mode above.
 */
static void rescore_case(int i, uint64_t seed, contract_case *cc)
{
    skv_config *c = &cc->cfg;
    if (i % 7 != 5 && i % 7 != 6) return;
    skvt_rng r;
    skvt_rng_seed(&r, seed ^ (0x7f4a7c159e3779b9ull * (uint64_t)(i + 3)));
    const int32_t cand_max = (int32_t)(c->max_prompt_len / c->chunk_size - c->n_local_chunks - c->n_outlier_chunks);
    const int32_t S = c->budget == SKV_BUDGET_ALL ? 1 : c->budget / c->chunk_size;
    c->select_candidates = i % 7 == 6 ? cand_max + (int32_t)skvt_rng_range(&r, 0, 3)
                                      : S + (int32_t)skvt_rng_range(&r, 0, 24);
}

/*
 * Keys for one (layer, seq): low-rank (a latent of rank min(r, 8) times a
 * random basis) plus small noise, as real pre-RoPE keys are, so the top-r
 * subspace is well determined and backends' outputs are comparable; with
 * planted exact ties: some chunks copy another chunk's keys exactly (equal
 * landmarks, equal scores), a run of identical chunks, a zero token (cos
 * score edge) and a huge row.
 */
static void make_prompt(skvt_rng *r, const skv_config *c, int64_t n, skv_bf16 *k, skv_bf16 *v)
{
    size_t row = (size_t)c->n_kv_heads * c->head_dim;
    const int rr = c->rank ? c->rank : c->rank_max; /* rank 0: the factors' size */
    int r0 = rr < 8 ? rr : 8;
    double *basis = malloc((size_t)r0 * row * sizeof *basis), z[8];
    for (size_t i = 0; i < (size_t)r0 * row; i++) basis[i] = skvt_rng_normal(r);
    for (int64_t t = 0; t < n; t++) {
        for (int j = 0; j < r0; j++) z[j] = skvt_rng_normal(r) * 2.0 / (1 + j);
        for (size_t i = 0; i < row; i++) {
            double x = 0.05 * skvt_rng_normal(r);
            for (int j = 0; j < r0; j++) x += z[j] * basis[(size_t)j * row + i];
            k[(size_t)t * row + i] = skv_bf16_from_float((float)x);
        }
    }
    free(basis);
    skvt_fill_bf16_normal(r, v, (size_t)n * row, 1.0);
    int64_t n_chunks = n / c->chunk_size;
    size_t chunk_elems = (size_t)c->chunk_size * row;
    for (int i = 0; i < 6; i++) { /* duplicate chunks */
        int64_t a = skvt_rng_range(r, 0, n_chunks - 1), b = skvt_rng_range(r, 0, n_chunks - 1);
        memcpy(k + (size_t)b * chunk_elems, k + (size_t)a * chunk_elems, chunk_elems * sizeof *k);
    }
    if (skvt_rng_uniform(r) < 0.5) { /* a run of identical chunks: many exact ties */
        int64_t a = skvt_rng_range(r, 0, n_chunks - 9);
        for (int i = 1; i < 8; i++)
            memcpy(k + (size_t)(a + i) * chunk_elems, k + (size_t)a * chunk_elems, chunk_elems * sizeof *k);
    }
    int64_t zt = skvt_rng_range(r, 0, n - 1);
    memset(k + (size_t)zt * row, 0, row * sizeof *k);
    int64_t h = skvt_rng_range(r, 0, n - 1);
    for (size_t i = 0; i < row; i++)
        k[(size_t)h * row + i] = skv_bf16_from_float(skv_bf16_to_float(k[(size_t)h * row + i]) * 300.0f);
}

/* Independent top-S: sort all candidates by (a desc, index asc). */
static int cmp_key_desc(const void *pa, const void *pb, const float *a)
{
    int32_t i = *(const int32_t *)pa, j = *(const int32_t *)pb;
    float x = a[i] != a[i] ? -1.0f : a[i], y = a[j] != a[j] ? -1.0f : a[j];
    if (x != y) return x > y ? -1 : 1;
    return i < j ? -1 : (i > j);
}
static const float *g_keys;
static int cmp_qsort(const void *pa, const void *pb) { return cmp_key_desc(pa, pb, g_keys); }
static int cmp_int(const void *pa, const void *pb)
{
    int32_t i = *(const int32_t *)pa, j = *(const int32_t *)pb;
    return (i > j) - (i < j);
}

static void check_topk_rule(skvt_rng *r)
{
    /* skv_op_score_select's selection against a sort, with massive ties */
    int Hq = 4, Hk = 2, D = 64, n_cand = 300, S = 37;
    skv_bf16 *q = malloc((size_t)Hq * D * 2), *L = malloc((size_t)Hk * n_cand * D * 2);
    float *amax = malloc((size_t)Hk * n_cand * 4);
    int32_t *sel = malloc((size_t)Hk * S * 4), *order = malloc((size_t)n_cand * 4);
    for (int trial = 0; trial < 20; trial++) {
        skvt_fill_bf16_normal(r, q, (size_t)Hq * D, trial % 2 ? 0.2 : 3.0);
        skvt_fill_bf16_normal(r, L, (size_t)Hk * n_cand * D, 1.0);
        int distinct = (int)skvt_rng_range(r, 1, 40); /* only a few distinct landmarks: ties everywhere */
        for (int h = 0; h < Hk; h++)
            for (int j = distinct; j < n_cand; j++)
                memcpy(L + ((size_t)h * n_cand + j) * D,
                       L + ((size_t)h * n_cand + skvt_rng_range(r, 0, distinct - 1)) * D, (size_t)D * 2);
        skv_status st = skv_op_score_select(SKV_BACKEND_REF, Hq, Hk, D, n_cand, S, 0.0f, q, L, NULL, sel, NULL, amax);
        SKVT_CHECK_STATUS(st, SKV_OK, "score_select for the top-k rule");
        for (int h = 0; h < Hk; h++) {
            for (int j = 0; j < n_cand; j++) order[j] = j;
            g_keys = amax + (size_t)h * n_cand;
            qsort(order, (size_t)n_cand, sizeof *order, cmp_qsort);
            qsort(order, (size_t)S, sizeof *order, cmp_int);
            SKVT_CHECK(memcmp(order, sel + (size_t)h * S, (size_t)S * 4) == 0,
                       "top-k rule: trial %d head %d (distinct landmarks %d) differs from a sort", trial, h, distinct);
        }
    }
    free(q);
    free(L);
    free(amax);
    free(sel);
    free(order);
}

/* The 256-lane canonical sum (docs/DESIGN.md section 5), written out again. */
static float lane_sum(const float *x, int n)
{
    float P[256] = {0};
    for (int j = 0; j < n; j++) P[j % 256] += x[j];
    for (int w = 128; w >= 1; w /= 2)
        for (int k = 0; k < w; k++) P[k] += P[k + w];
    return P[0];
}

/* The mass rule of section 4.5 for one head, from its group-max probabilities a[0..n_cand):
   the count into *k, the set (increasing) into sel[0..k). */
static void mass_rule(const float *a, int n_cand, int S, float p, int floor_, int32_t *order, float *m, int *k,
                      int32_t *sel)
{
    for (int j = 0; j < n_cand; j++) {
        order[j] = j;
        const float key = a[j] != a[j] ? -1.0f : a[j];
        m[j] = key > 0.0f ? key : 0.0f;
    }
    const float target = p * lane_sum(m, n_cand);
    g_keys = a;
    qsort(order, (size_t)n_cand, sizeof *order, cmp_qsort);
    const int cap = S < n_cand ? S : n_cand;
    const int fl = floor_ < cap ? floor_ : cap;
    float cum = 0.0f;
    int kk = cap;
    for (int i = 0; i < cap; i++) {
        cum += m[order[i]];
        if (cum >= target) {
            kk = i + 1;
            break;
        }
    }
    if (kk < fl) kk = fl;
    memcpy(sel, order, (size_t)kk * sizeof *sel);
    qsort(sel, (size_t)kk, sizeof *sel, cmp_int);
    *k = kk;
}

/*
 * The rescoring's rule (docs/DESIGN.md 4.5.1) written out again: per query head the fmaf dot
 * chain and the scale, the softmax with its 256 lanes, chunk sums, the group max; then the
 * fixed rule by a sort or mass_rule, mapped through the candidates. skv_rescore_head must
 * match it bit for bit on random keys with duplicated chunks (ties), a needle token, and
 * every W from 1 up.
 */
static void check_rescore_rule(skvt_rng *r)
{
    const int D = 64, WMAX = 70;
    const int c = 8, Gmax = 4;
    skv_bf16 *q = malloc((size_t)Gmax * D * 2), *keys = malloc((size_t)WMAX * c * D * 2);
    float *s = malloc((size_t)WMAX * c * 4), *pr = malloc((size_t)WMAX * c * 4), *b = malloc((size_t)WMAX * 4),
          *bw = malloc((size_t)WMAX * 4), *m = malloc((size_t)WMAX * 4), *sc = malloc((size_t)WMAX * c * 4);
    int32_t *cand = malloc((size_t)WMAX * 4), *ids = malloc((size_t)(4 * WMAX) * 4), *order = malloc((size_t)WMAX * 4),
            *want = malloc((size_t)WMAX * 4), *got = malloc((size_t)WMAX * 4), *got_ids = malloc((size_t)WMAX * 4),
            *scratch = malloc((size_t)2 * WMAX * 4), *local = malloc((size_t)WMAX * 4);
    static const float masses[] = {0.5f, 0.8f, 0.95f, 1.0f, 1e-6f};
    for (int trial = 0; trial < 60; trial++) {
        const int G = (int)skvt_rng_range(r, 1, Gmax), W = (int)skvt_rng_range(r, 1, WMAX);
        const int S = (int)skvt_rng_range(r, 1, W), mode = trial % 2;
        const float p = masses[trial % 5], scale = 0.125f * (float)(1 + trial % 3);
        skvt_fill_bf16_normal(r, q, (size_t)G * D, trial % 3 ? 1.0 : 4.0);
        skvt_fill_bf16_normal(r, keys, (size_t)W * c * D, 1.0);
        for (int i = 1; i < W; i++) /* duplicated chunks: exact ties */
            if (skvt_rng_uniform(r) < 0.3) memcpy(keys + (size_t)i * c * D, keys + (size_t)skvt_rng_range(r, 0, i - 1) * c * D, (size_t)c * D * 2);
        const int nt = (int)skvt_rng_range(r, 0, W * c - 1); /* a needle: one token along q_0 */
        for (int d = 0; d < D; d++) keys[(size_t)nt * D + d] = skv_bf16_from_float(3.0f * skv_bf16_to_float(q[d]));
        int32_t last = -1;
        for (int i = 0; i < W; i++) cand[i] = last += (int32_t)skvt_rng_range(r, 1, 3);
        for (int j = 0; j <= last; j++) ids[j] = 1000 + 3 * j;
        for (int g = 0; g < G; g++) {
            for (int m_ = 0; m_ < W * c; m_++) {
                float acc = 0.0f;
                for (int d = 0; d < D; d++)
                    acc = fmaf(skv_bf16_to_float(q[(size_t)g * D + d]), skv_bf16_to_float(keys[(size_t)m_ * D + d]), acc);
                pr[m_] = acc * scale;
            }
            float M = pr[0];
            for (int m_ = 1; m_ < W * c; m_++) M = pr[m_] > M ? pr[m_] : M;
            for (int m_ = 0; m_ < W * c; m_++) pr[m_] = skv_expf(pr[m_] - M);
            const float Z = lane_sum(pr, W * c);
            for (int i = 0; i < W; i++) {
                float mu = 0.0f;
                for (int t = 0; t < c; t++) mu += pr[i * c + t] / Z;
                if (g == 0 || mu > bw[i]) bw[i] = mu;
            }
        }
        int k;
        if (mode) {
            mass_rule(bw, W, S, p, trial % 4 == 1 ? S : 1, order, m, &k, want);
        } else {
            for (int j = 0; j < W; j++) order[j] = j;
            g_keys = bw;
            qsort(order, (size_t)W, sizeof *order, cmp_qsort);
            k = S;
            memcpy(want, order, (size_t)k * 4);
            qsort(want, (size_t)k, sizeof *want, cmp_int);
        }
        for (int i = 0; i < k; i++) want[i] = cand[want[i]];
        skv_select_params sp = {mode ? SKV_SELECT_MASS : SKV_SELECT_FIXED, S, W, mode && trial % 4 == 1 ? S : (mode ? 1 : 0), p};
        const int32_t kg = skv_rescore_head(G, D, c, W, scale, q, keys, &sp, cand, ids, sc, b, scratch, local, got, got_ids);
        int ok = kg == k && memcmp(got, want, (size_t)k * 4) == 0;
        for (int i = 0; i < W && ok; i++) ok = i < k ? got_ids[i] == ids[got[i]] : got[i] == -1 && got_ids[i] == -1;
        for (int i = 0; i < W && ok; i++) ok = memcmp(&b[i], &bw[i], 4) == 0;
        SKVT_CHECK(ok, "rescore rule: trial %d (G %d W %d S %d %s p %g): k %d (want %d), set or masses differ", trial, G, W,
                   S, mode ? "mass" : "fixed", (double)p, kg, k);
    }
    free(q), free(keys), free(s), free(pr), free(b), free(bw), free(m), free(sc);
    free(cand), free(ids), free(order), free(want), free(got), free(got_ids), free(scratch), free(local);
}

static void check_mass_rule(skvt_rng *r)
{
    /* skv_op_score_select_mass against mass_rule on ref's amax, and every backend against ref */
    const int Hq = 4, Hk = 2, D = 64, NC = 300;
    skv_bf16 *q = malloc((size_t)Hq * D * 2), *L = malloc((size_t)Hk * NC * D * 2);
    float *amax = malloc((size_t)Hk * NC * 4), *amax2 = malloc((size_t)Hk * NC * 4), *m = malloc((size_t)NC * 4);
    int32_t *sel = malloc((size_t)Hk * NC * 4), *ids = malloc((size_t)Hk * NC * 4), *order = malloc((size_t)NC * 4);
    int32_t *sel2 = malloc((size_t)Hk * NC * 4), *ids2 = malloc((size_t)Hk * NC * 4), *cand = malloc((size_t)Hk * NC * 4);
    int32_t *want = malloc((size_t)NC * 4), cnt[2], cnt2[2];
    static const float ps[] = {0.5f, 0.9f, 0.99f, 1.0f, 1e-30f, 0.999999f};
    int n_nan = 0;
    for (int trial = 0; trial < 60; trial++) {
        const int n_cand = trial % 3 == 0 ? (int)skvt_rng_range(r, 1, 12) : (int)skvt_rng_range(r, 13, NC);
        const int S = (int)skvt_rng_range(r, 1, trial % 4 == 0 ? n_cand + 8 : n_cand);
        const float p = ps[trial % 6];
        const int fl = trial % 5 == 0 ? S : (int)skvt_rng_range(r, 0, S < 3 ? S : 3);
        skvt_fill_bf16_normal(r, q, (size_t)Hq * D, trial % 2 ? 0.2 : 3.0);
        skvt_fill_bf16_normal(r, L, (size_t)Hk * n_cand * D, 1.0);
        if (trial % 4 == 1) { /* a few distinct landmarks: ties everywhere */
            const int distinct = (int)skvt_rng_range(r, 1, 20);
            for (int h = 0; h < Hk; h++)
                for (int j = distinct; j < n_cand; j++)
                    memcpy(L + ((size_t)h * n_cand + j) * D,
                           L + ((size_t)h * n_cand + skvt_rng_range(r, 0, distinct - 1)) * D, (size_t)D * 2);
        }
        if (trial % 7 == 3) /* overflowing scores: Inf - Inf in the softmax, NaN probabilities (key -1) */
            for (int i = 0; i < 4; i++) {
                q[skvt_rng_range(r, 0, Hq * D - 1)] = skv_bf16_from_float(3e38f);
                L[skvt_rng_range(r, 0, Hk * n_cand * D - 1)] = skv_bf16_from_float(-3e38f);
                L[skvt_rng_range(r, 0, Hk * n_cand * D - 1)] = skv_bf16_from_float(3e38f);
            }
        for (int i = 0; i < Hk * n_cand; i++) cand[i] = 3 * (i % n_cand) + 1;
        skv_status st = skv_op_score_select_mass(SKV_BACKEND_REF, Hq, Hk, D, n_cand, S, p, fl, 0.0f, q, L, cand, sel,
                                                 ids, amax, cnt);
        if (!SKVT_CHECK_STATUS(st, SKV_OK, "score_select_mass (ref)")) {
            printf("  %s\n", skv_last_error());
            continue;
        }
        for (int h = 0; h < Hk; h++) {
            int k;
            for (int j = 0; j < n_cand; j++) n_nan += amax[(size_t)h * n_cand + j] != amax[(size_t)h * n_cand + j];
            mass_rule(amax + (size_t)h * n_cand, n_cand, S, p, fl, order, m, &k, want);
            const int32_t *sh = sel + (size_t)h * S, *ih = ids + (size_t)h * S;
            int same = cnt[h] == k && memcmp(sh, want, (size_t)k * 4) == 0;
            for (int j = 0; j < S; j++) same &= j < k ? ih[j] == cand[(size_t)h * n_cand + sh[j]] : sh[j] == -1 && ih[j] == -1;
            SKVT_CHECK(same, "mass rule: trial %d head %d (n_cand %d S %d p %g floor %d): count %d, a re-implementation %d",
                       trial, h, n_cand, S, (double)p, fl, cnt[h], k);
            if (p == 1.0f && fl == 0 && !(trial % 7 == 3))
                SKVT_CHECK(cnt[h] >= 1, "p = 1: count %d", cnt[h]);
            if (p == 1e-30f && fl <= 1 && !(trial % 7 == 3))
                SKVT_CHECK(cnt[h] == 1, "a tiny target takes the best chunk only: count %d", cnt[h]);
        }
        for (skv_backend be = SKV_BACKEND_CPU; be <= SKV_BACKEND_CUDA; be++) {
            if (skv_backend_available(be) != SKV_OK) continue;
            skv_bf16 *dq = skvt_dbuf(be, q, (size_t)Hq * D * 2), *dL = skvt_dbuf(be, L, (size_t)Hk * n_cand * D * 2);
            int32_t *dc = skvt_dbuf(be, cand, (size_t)Hk * n_cand * 4), *ds = skvt_dbuf(be, sel2, (size_t)Hk * S * 4);
            int32_t *di = skvt_dbuf(be, ids2, (size_t)Hk * S * 4), *dn = skvt_dbuf(be, cnt2, sizeof cnt2);
            float *da = skvt_dbuf(be, amax2, (size_t)Hk * n_cand * 4);
            skvt_dput(be, dq, q, (size_t)Hq * D * 2);
            skvt_dput(be, dL, L, (size_t)Hk * n_cand * D * 2);
            skvt_dput(be, dc, cand, (size_t)Hk * n_cand * 4);
            st = skv_op_score_select_mass(be, Hq, Hk, D, n_cand, S, p, fl, 0.0f, dq, dL, dc, ds, di, da, dn);
            SKVT_CHECK_STATUS(st, SKV_OK, "score_select_mass (other backend)");
            skvt_dget(be, sel2, ds, (size_t)Hk * S * 4);
            skvt_dget(be, ids2, di, (size_t)Hk * S * 4);
            skvt_dget(be, cnt2, dn, sizeof cnt2);
            skvt_dget(be, amax2, da, (size_t)Hk * n_cand * 4);
            /* counts, sets and ids bitwise; amax bitwise with a NaN matching any NaN (the payload of a
               NaN probability is not part of the contract: an Inf - Inf gives the platform's default
               NaN, 0xffc00000 on x86 and 0x7fffffff on cuda; its selection key is -1 on both) */
            int bad_h = -1, bad_j = -1;
            const char *what = NULL;
            for (int h = 0; h < Hk && !what; h++) {
                if (cnt[h] != cnt2[h]) {
                    what = "count", bad_h = h;
                    break;
                }
                for (int j = 0; j < S && !what; j++)
                    if (sel[(size_t)h * S + j] != sel2[(size_t)h * S + j]) what = "sel_idx", bad_h = h, bad_j = j;
                    else if (ids[(size_t)h * S + j] != ids2[(size_t)h * S + j]) what = "sel_ids", bad_h = h, bad_j = j;
                for (int j = 0; j < n_cand && !what; j++) {
                    const float x = amax[(size_t)h * n_cand + j], y = amax2[(size_t)h * n_cand + j];
                    if (memcmp(&x, &y, 4) != 0 && !(x != x && y != y)) what = "amax", bad_h = h, bad_j = j;
                }
            }
            if (!SKVT_CHECK(!what, "%s vs ref: score_select_mass trial %d (n_cand %d S %d p %g floor %d): %s differs",
                            skv_backend_name(be), trial, n_cand, S, (double)p, fl, what ? what : "") &&
                bad_h >= 0) {
                const size_t hs = (size_t)bad_h * S + (size_t)bad_j, ha = (size_t)bad_h * n_cand + (size_t)bad_j;
                const int in_s = bad_j >= 0 && bad_j < S, in_a = bad_j >= 0 && bad_j < n_cand;
                uint32_t xa = 0, ya = 0;
                if (in_a) memcpy(&xa, amax2 + ha, 4), memcpy(&ya, amax + ha, 4);
                printf("  first difference: head %d, entry %d: count %d (ref %d); sel_idx %d (ref %d), sel_ids %d "
                       "(ref %d); amax %.9g = 0x%08x (ref %.9g = 0x%08x)\n",
                       bad_h, bad_j, cnt2[bad_h], cnt[bad_h], in_s ? sel2[hs] : 0, in_s ? sel[hs] : 0,
                       in_s ? ids2[hs] : 0, in_s ? ids[hs] : 0, in_a ? (double)amax2[ha] : 0.0, xa,
                       in_a ? (double)amax[ha] : 0.0, ya);
            }
            skvt_dfree(be, dq, q);
            skvt_dfree(be, dL, L);
            skvt_dfree(be, dc, cand);
            skvt_dfree(be, ds, sel2);
            skvt_dfree(be, di, ids2);
            skvt_dfree(be, dn, cnt2);
            skvt_dfree(be, da, amax2);
        }
    }
    SKVT_CHECK(n_nan > 0, "the overflowing trials produced no NaN probability (the NaN path went untested)");
    free(q);
    free(L);
    free(amax);
    free(amax2);
    free(m);
    free(sel);
    free(ids);
    free(order);
    free(sel2);
    free(ids2);
    free(cand);
    free(want);
}

/* Runs one case on one backend; returns the caches' decisions in a flat byte log. Every
   introspection call must succeed: a failing one fails the case (two backends whose
   introspection fails alike would otherwise compare two equally short logs). */
typedef struct {
    unsigned char *buf;
    size_t len, cap;
} blob;
static void blob_put(blob *b, const void *p, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2;
        b->buf = realloc(b->buf, b->cap);
    }
    memcpy(b->buf + b->len, p, n);
    b->len += n;
}

/* Set by run_case: its backend could not run the reproducible configuration (SKV_ERR_UNSUPPORTED). */
static int last_unsupported;

static int run_case(const contract_case *cc, skv_backend be, uint64_t seed, blob *log, float **outs)
{
    skv_config c = cc->cfg;
    c.backend = be;
    skv_cache *cache = NULL;
    skv_status st = skv_cache_create(&c, &cache);
    last_unsupported = 0;
    if (st == SKV_ERR_UNSUPPORTED && c.reproducible) {
        last_unsupported = 1;
        skvt_skip("reproducible mode not supported by this backend");
        return 0;
    }
    if (!SKVT_CHECK_STATUS(st, SKV_OK, "create")) {
        printf("  %s\n", skv_last_error());
        return 0;
    }
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    size_t row = (size_t)c.n_kv_heads * c.head_dim;
    size_t pbytes = (size_t)c.max_prompt_len * row * 2;
    skv_bf16 *k = malloc(pbytes), *v = malloc(pbytes);
    skv_bf16 *dk = skvt_dbuf(be, k, pbytes), *dv = skvt_dbuf(be, v, pbytes); /* device copies for cuda */
    int ok = 1, unsupported = 0;
    for (int l = 0; l < c.n_layers && ok; l++)
        for (int b = 0; b < c.batch_size && ok; b++) {
            make_prompt(&r, &c, cc->n[b], k, v);
            skvt_dput(be, dk, k, (size_t)cc->n[b] * row * 2);
            skvt_dput(be, dv, v, (size_t)cc->n[b] * row * 2);
            st = skv_prefill(cache, l, b, cc->n[b], dk, dv, NULL);
            if (st == SKV_ERR_UNSUPPORTED && c.reproducible) { /* no canonical factorization on this backend yet */
                skvt_skip("reproducible prefill not supported by this backend");
                ok = 0;
                unsupported = last_unsupported = 1;
                break;
            }
            ok = SKVT_CHECK_STATUS(st, SKV_OK, "prefill");
            if (!ok) printf("  %s\n", skv_cache_last_error(cache));
        }
    size_t qn = (size_t)c.batch_size * c.n_q_heads * c.head_dim, kn = (size_t)c.batch_size * row;
    skv_bf16 *q = malloc(qn * 2), *kk = malloc(kn * 2), *vv = malloc(kn * 2);
    float *out = malloc(qn * 4);
    skv_bf16 *dq = skvt_dbuf(be, q, qn * 2), *dkk = skvt_dbuf(be, kk, kn * 2), *dvv = skvt_dbuf(be, vv, kn * 2);
    float *dout = skvt_dbuf(be, out, qn * 4);
    int32_t *ids = malloc((size_t)c.max_prompt_len * 4);
    skv_bf16 *lm = malloc((size_t)c.max_prompt_len / c.chunk_size * c.head_dim * 2);
    char intro_err[320] = "";
    size_t want_len = 0; /* bytes the log must hold: what the introspection sizes say */
    for (int s = 0; s < cc->steps && ok; s++)
        for (int l = 0; l < c.n_layers && ok; l++) {
            skvt_fill_bf16_normal(&r, q, qn, s == 0 ? 0.5 : 4.0);
            if (s == 2) /* identical query heads across the group: group-max ties */
                for (size_t i = 1; i < (size_t)c.batch_size * c.n_q_heads; i++)
                    memcpy(q + i * c.head_dim, q, (size_t)c.head_dim * 2);
            skvt_fill_bf16_normal(&r, kk, kn, 1.0);
            skvt_fill_bf16_normal(&r, vv, kn, 1.0);
            skvt_dput(be, dq, q, qn * 2);
            skvt_dput(be, dkk, kk, kn * 2);
            skvt_dput(be, dvv, vv, kn * 2);
            st = skv_decode(cache, l, dq, dkk, dvv, dout);
            if (st == SKV_OK) st = skv_cache_sync(cache);
            ok = SKVT_CHECK_STATUS(st, SKV_OK, "decode");
            if (!ok) printf("  %s\n", skv_cache_last_error(cache));
            skvt_dget(be, out, dout, qn * 4);
            memcpy(outs[s * c.n_layers + l], out, qn * 4);
            for (int b = 0; b < c.batch_size && ok; b++)
                for (int h = 0; h < c.n_kv_heads && ok; h++) {
                    skv_seq_info info;
                    const char *call = "skv_cache_seq_info";
                    const int dense = (int)((c.dense_layers >> l) & 1);
                    const int32_t S_cfg = c.budget == SKV_BUDGET_ALL
                                              ? (int32_t)(c.max_prompt_len / c.chunk_size - c.n_local_chunks -
                                                          c.n_outlier_chunks)
                                              : c.budget / c.chunk_size;
                    const int fixed = c.select_mode == SKV_SELECT_FIXED && c.budget != SKV_BUDGET_ALL;
                    st = skv_cache_seq_info(cache, l, b, &info);
                    if (!st && (!info.prefilled || !info.has_selection || info.n_selected != (dense ? 0 : S_cfg) ||
                                info.n_outliers != (dense ? 0 : c.n_outlier_chunks) ||
                                (fixed && info.n_candidates < info.n_selected) || info.dense != dense ||
                                (dense ? info.rank != 0 : c.rank ? info.rank != c.rank : (info.rank < 1 || info.rank > c.rank_max)) || (dense && info.n_local != cc->n[b]) ||
                                info.n_generated != s + 1)) {
                        snprintf(intro_err, sizeof intro_err,
                                 "seq_info(%d, %d) after step %d: prefilled %d has_selection %d S %d O %d candidates %d "
                                 "generated %d",
                                 l, b, s, info.prefilled, info.has_selection, info.n_selected, info.n_outliers,
                                 info.n_candidates, info.n_generated);
                        ok = 0;
                        break;
                    }
                    if (!st && dense) { /* a dense layer selects nothing */
                        int32_t kd = -7;
                        call = "skv_cache_selected on a dense layer";
                        if (skv_cache_selected(cache, l, b, h, ids) != SKV_ERR_NO_SELECTION ||
                            !strstr(skv_cache_last_error(cache), "dense") ||
                            skv_cache_selected_count(cache, l, b, h, &kd) != SKV_ERR_NO_SELECTION || kd != -7)
                            st = SKV_ERR_INVALID_ARGUMENT;
                        blob_put(log, &info.n_local, 4);
                        want_len += 4;
                    } else if (!st) {
                        int32_t kh = -1;
                        call = "skv_cache_selected";
                        st = skv_cache_selected(cache, l, b, h, ids);
                        if (!st) {
                            call = "skv_cache_selected_count";
                            st = skv_cache_selected_count(cache, l, b, h, &kh);
                        }
                        if (!st) { /* k in [1, min(S, N - O)] (exactly that in the fixed mode), ids -1 past it */
                            int32_t cap = info.n_selected < info.n_candidates ? info.n_selected : info.n_candidates;
                            if (c.select_candidates && c.select_candidates < cap) cap = c.select_candidates; /* 4.5.1 */
                            int good = kh >= 1 && kh <= cap && (c.select_mode == SKV_SELECT_MASS || kh == cap);
                            for (int32_t j = 0; j < info.n_selected; j++)
                                good &= j < kh ? ids[j] >= 0 && (j == 0 || ids[j] > ids[j - 1]) : ids[j] == -1;
                            if (!good) {
                                call = "the selection's shape";
                                st = SKV_ERR_INVALID_ARGUMENT;
                            }
                            blob_put(log, &kh, 4);
                            blob_put(log, ids, (size_t)info.n_selected * 4);
                        }
                        want_len += 4 + (size_t)info.n_selected * 4;
                    }
                    if (!st && s == 0 && h == 0) { /* the slot's rank: bitwise in the reproducible mode */
                        const int32_t rk = info.rank;
                        if (dense ? rk != 0 : c.rank ? rk != c.rank : (rk < 1 || rk > c.rank_max)) {
                            snprintf(intro_err, sizeof intro_err, "seq_info(%d, %d): rank %d (config rank %d, rank_max %d)",
                                     l, b, rk, c.rank, c.rank_max);
                            ok = 0;
                            break;
                        }
                        if (c.reproducible) {
                            blob_put(log, &rk, 4);
                            want_len += 4;
                        }
                    }
                    if (!st && s == 0) {
                        call = "skv_cache_outliers";
                        st = skv_cache_outliers(cache, l, b, h, ids);
                        if (!st) blob_put(log, ids, (size_t)info.n_outliers * 4);
                        if (!st) {
                            call = "skv_cache_candidates";
                            st = skv_cache_candidates(cache, l, b, h, ids);
                            if (!st) blob_put(log, ids, (size_t)info.n_candidates * 4);
                        }
                        if (!st) {
                            call = "skv_cache_landmarks";
                            st = skv_cache_landmarks(cache, l, b, h, lm);
                            if (!st) blob_put(log, lm, (size_t)info.n_candidates * c.head_dim * 2);
                        }
                        want_len += (size_t)info.n_outliers * 4 + (size_t)info.n_candidates * (4 + c.head_dim * 2);
                    }
                    if (st) {
                        snprintf(intro_err, sizeof intro_err, "%s(layer %d, seq %d, head %d) after step %d: %s (%s)",
                                 call, l, b, h, s, skv_status_string(st), skv_cache_last_error(cache));
                        ok = 0;
                    }
                }
        }
    /* the per-layer counters (docs/DESIGN.md 4.7) count decisions: bitwise ref's on every backend (cuda
       adds them on the device) */
    for (int l = 0; l < c.n_layers && ok && !*intro_err; l++) {
        skv_layer_stats ls;
        memset(&ls, 0, sizeof ls);
        st = skv_cache_layer_stats(cache, l, &ls);
        const int64_t want_steps = (int64_t)cc->steps * c.batch_size * c.n_kv_heads;
        if (st || ls.head_steps != want_steps || ls.attended_tokens > ls.context_tokens ||
            ls.dense != (int)((c.dense_layers >> l) & 1) || (ls.dense && ls.attended_tokens != ls.context_tokens)) {
            snprintf(intro_err, sizeof intro_err,
                     "layer_stats(%d): %s, head_steps %lld (want %lld) attended %lld context %lld selected %lld dense %d",
                     l, skv_status_string(st), (long long)ls.head_steps, (long long)want_steps,
                     (long long)ls.attended_tokens, (long long)ls.context_tokens, (long long)ls.selected_chunks, ls.dense);
            break;
        }
        const int64_t counters[4] = {ls.head_steps, ls.attended_tokens, ls.context_tokens, ls.selected_chunks};
        blob_put(log, counters, sizeof counters);
        want_len += sizeof counters;
    }
    if (*intro_err) SKVT_CHECK(0, "%s: introspection failed: %s", skv_backend_name(be), intro_err);
    else if (ok) SKVT_CHECK(log->len == want_len && want_len > 0, "%s: decision log holds %zu bytes, the sizes say %zu",
                            skv_backend_name(be), log->len, want_len);
    /* the workspace sized at create covers every decode step: no heap allocation */
    skv_stats stats;
    skv_cache_stats(cache, &stats);
    if (!unsupported) SKVT_CHECK(stats.decode_allocations == 0, "%s: %lld heap allocations in %lld decode calls",
               skv_backend_name(be), (long long)stats.decode_allocations, (long long)stats.n_decode_calls);
    skvt_dfree(be, dk, k);
    skvt_dfree(be, dv, v);
    skvt_dfree(be, dq, q);
    skvt_dfree(be, dkk, kk);
    skvt_dfree(be, dvv, vv);
    skvt_dfree(be, dout, out);
    free(k);
    free(v);
    free(q);
    free(kk);
    free(vv);
    free(out);
    free(ids);
    free(lm);
    skv_cache_free(cache);
    return ok;
}

/*
 * No flush-to-zero anywhere on the decision path (docs/DESIGN.md section 5): after
 * the backends have run (OpenMP, BLAS, SIMD kernels), neither this thread nor
 * an OpenMP worker may have FTZ/DAZ set, and a subnormal product must survive.
 */
#if defined(__x86_64__) || defined(__i386__)
/* The cpu backend's own team (cpu/skv_cpu_base.h): a weak reference, so a build of this test
   against the shared library (where the team is not exported) skips that part. */
typedef void (*skv_cpu_item_fn)(void *ctx, int64_t item, int t);
extern void skv_cpu_run(int nt, int64_t n, skv_cpu_item_fn fn, void *ctx) __attribute__((weak));
static void csr_item(void *ctx, int64_t item, int t)
{
    (void)item, (void)t;
    if (_mm_getcsr() & 0x8040u) __atomic_store_n((int *)ctx, 1, __ATOMIC_RELAXED);
}
#endif

static void check_no_ftz(void)
{
    volatile float tiny = 1e-38f, half = 0.5f;
    SKVT_CHECK(tiny * half != 0.0f, "a subnormal product was flushed to zero");
#if defined(__x86_64__) || defined(__i386__)
    int bad = 0;
#pragma omp parallel reduction(| : bad)
    bad |= (_mm_getcsr() & 0x8040u) != 0; /* FTZ (bit 15) or DAZ (bit 6) */
    SKVT_CHECK(!bad, "FTZ or DAZ set in MXCSR of this or an OpenMP worker thread");
    if (skv_cpu_run) { /* the team's helpers run the cpu backend's parallel work */
        int team_bad = 0;
        skv_cpu_run(8, 256, csr_item, &team_bad);
        SKVT_CHECK(!team_bad, "FTZ or DAZ set in MXCSR of a thread of the cpu backend's team");
    }
#endif
}


int main(int argc, char **argv)
{
    uint64_t seed = skvt_base_seed("test_contract");
    const double t_start = skvt_now_s();
    double t_last = t_start;
    int n_configs = argc > 1 ? atoi(argv[1]) : 100;
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    check_topk_rule(&r);
    check_mass_rule(&r);
    check_rescore_rule(&r);

    static const skv_backend others[] = {SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
    int compared = 0, n_repro_skipped = 0;
    for (int i = 0; i < n_configs; i++) {
        contract_case cc;
        random_case(&r, &cc);
        cc.cfg.reproducible = i % 4 == 3; /* no draw: the other configurations stay as they were */
        mode_case(i, seed, &cc);
        rescore_case(i, seed, &cc);
        if (i % 5 == 2) { /* a rank per slot (DESIGN 3.1) up to the drawn rank; no draw either */
            cc.cfg.rank_max = cc.cfg.rank;
            cc.cfg.rank = 0;
            cc.cfg.rank_error_target = 0.1f;
        }
        uint64_t case_seed = skvt_rng_u64(&r);
        const skv_config *c = &cc.cfg;
        char desc[256];
        snprintf(desc, sizeof desc, "config %d%s%s%s%s: L=%d B=%d Hq=%d Hk=%d D=%d c=%d S=%d O=%d Lc=%d r=%d rank_max=%d rope(R=%d,il=%d,l3=%d) n=%lld..",
                 i, c->reproducible ? " (reproducible)" : "",
                 c->select_mode == SKV_SELECT_MASS ? " (mass)" : c->budget == SKV_BUDGET_ALL ? " (all)" : "",
                 c->dense_layers ? " (dense 0)" : "", c->select_candidates ? " (rescored)" : "", c->n_layers, c->batch_size, c->n_q_heads, c->n_kv_heads, c->head_dim, c->chunk_size,
                 c->budget / c->chunk_size, c->n_outlier_chunks, c->n_local_chunks, c->rank, c->rank_max, c->rope.rotary_dim,
                 c->rope.interleaved, c->rope.llama3_scaling, (long long)cc.n[0]);
        size_t qn = (size_t)c->batch_size * c->n_q_heads * c->head_dim;
        int n_out = cc.steps * c->n_layers;
        float *ref_out[16], *oth_out[16];
        for (int s = 0; s < n_out; s++) {
            ref_out[s] = malloc(qn * 4);
            oth_out[s] = malloc(qn * 4);
        }
        blob ref_log = {0}, oth_log = {0};
        int ok = run_case(&cc, SKV_BACKEND_REF, case_seed, &ref_log, ref_out);
        if (!ok && last_unsupported) n_repro_skipped++;
        for (size_t o = 0; o < sizeof others / sizeof others[0] && ok; o++) {
            if (skv_backend_available(others[o]) != SKV_OK) {
                if (i == 0) skvt_skip("cuda backend not available on this machine");
                continue;
            }
            oth_log.len = 0;
            if (!run_case(&cc, others[o], case_seed, &oth_log, oth_out)) {
                if (last_unsupported) n_repro_skipped++;
                continue;
            }
            compared++;
            int same = ref_log.len == oth_log.len && memcmp(ref_log.buf, oth_log.buf, ref_log.len) == 0;
            SKVT_CHECK(same, "%s vs ref: decisions differ (%zu vs %zu bytes) | %s (seed %llu)",
                       skv_backend_name(others[o]), ref_log.len, oth_log.len, desc, (unsigned long long)case_seed);
            /*
             * Outputs: only finiteness here. Rebuilt keys come from each
             * backend's own factorization, and these queries (scaled x4 to
             * provoke ties) give near-argmax softmaxes, so noise-level key
             * differences move outputs a lot without any decision changing.
             * Output accuracy is test_accuracy's (each backend against double)
             * and test_e2e's (cross-backend, realistic attention).
             */
            int finite_ref = 1, finite = 1;
            for (int s = 0; s < n_out; s++)
                for (size_t e = 0; e < qn; e++) {
                    finite_ref &= isfinite(ref_out[s][e]) != 0;
                    finite &= isfinite(oth_out[s][e]) != 0;
                }
            SKVT_CHECK(finite_ref, "ref: non-finite decode output | %s", desc);
            if (c->reproducible) { /* the reproducible mode: every output bit equal to ref's */
                int first = -1;
                for (int s = 0; s < n_out && first < 0; s++)
                    if (memcmp(ref_out[s], oth_out[s], qn * 4)) first = s;
                SKVT_CHECK(first < 0, "%s vs ref: reproducible decode outputs differ (first at step/layer %d) | %s (seed %llu)",
                           skv_backend_name(others[o]), first, desc, (unsigned long long)case_seed);
            }
            SKVT_CHECK(finite, "%s: non-finite decode output | %s", skv_backend_name(others[o]), desc);
        }
        free(ref_log.buf);
        free(oth_log.buf);
        for (int s = 0; s < n_out; s++) {
            free(ref_out[s]);
            free(oth_out[s]);
        }
        const double t = skvt_now_s();
        if ((i + 1) % 10 == 0 || t - t_last >= 10.0 || i + 1 == n_configs) {
            fprintf(stderr, "test_contract: %d/%d configurations, %d compared, %.1f s\n", i + 1, n_configs, compared,
                    t - t_start);
            t_last = t;
        }
    }
    check_no_ftz();
    printf("test_contract: %d configurations compared against ref\n", compared);
    SKVT_CHECK(compared + n_repro_skipped >= n_configs || n_configs < 1, "only %d of %d configurations compared",
               compared, n_configs);
    return skvt_finish();
}
