/*
 * test_e2e.c - end to end on a small Llama-shaped synthetic workload (synth.h):
 * 2 layers, a ragged batch of two prompts, 16 decode steps, on ref, cpu and
 * cuda (those available) with identical inputs; cuda gets device copies of
 * the inputs (stage_in) and its output is read after skv_cache_sync. At every
 * step, for every layer and sequence:
 *  - the planted needle chunk is selected in every KV head (every backend);
 *  - cpu and cuda select the same chunk sets as ref, and their outputs match
 *    ref's;
 *  - the workload is concentrated: top-budget tokens hold >= 0.9 of attention;
 *  - accuracy against dense attention, split in two (e = rel L2 error vs full):
 *      selection: exact keys on the library's selection: e_sel <=
 *                 1.25 e_oracle + 0.01 (the per-token oracle's error; chunks
 *                 are coarser than tokens: seen up to 1.25 e_oracle + 0.004);
 *      overall:   e_sparse <= 1.25 e_oracle + 0.03 (seen up to + 0.018). The
 *                 slack is mostly the key rebuild: rank-r keys drop the
 *                 synthetic keys' 1% isotropic noise, which moves outputs by
 *                 0.5-3%. Its own check, "own-selection error": the library's
 *                 output against attention with exact keys and exact values
 *                 over the library's own selection, <= 0.05. It measures
 *                 everything after the selection at once (the rebuilt keys,
 *                 the gathered values, the stored outlier/local/generated
 *                 tokens, the attention arithmetic), so its messages name
 *                 all of them rather than one (a planted gather_values bug
 *                 once failed a message that blamed the key rebuild). The
 *                 largest per-run value over seeds 1001..1030 was 0.018 to
 *                 0.032, 0.023 on the fixed default seed; the clock-drawn
 *                 seed 176171812859 gave 0.0502 on ref, whose factorization is
 *                 the exact rank-r SVD, so that tail is the workload's, not a
 *                 backend's (SKV_SEED=random can meet it); a broken rebuild
 *                 or gather moves it by O(1).
 * Typical values: e_oracle ~0.06, e_sel ~0.064, e_sparse ~0.066.
 * A failure's message names the step, layer, sequence and backend, and what
 * was compared with what.
 * SKV_VERBOSE=1 prints one line per measurement.
 *
 * Dense layers and the per-layer counters (check_dense_layers): a 2-layer cache with
 * layer 0 dense (config.dense_layers), the fixed and the mass selection, both modes of
 * config.reproducible, on ref and cpu: every step's output of the dense layer against
 * skv_op_full_attention over the exact keys (the given post-RoPE keys, or the library's
 * RoPE of k_pre) within 1e-5 relative, ref and cpu bitwise equal in the reproducible mode,
 * and skv_cache_layer_stats against the counts recomputed here from seq_info and
 * skv_cache_selected_count; the decode allocates nothing. Then test_dense_mass_backends: a
 * dense layer and the mass rule on the synthetic workload on every backend, cuda included.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "synth.h"
#include "testutil.h"

enum { LAYERS = 2, BATCH = 2, STEPS = 16, NBE = 3 };
static const int64_t ctx[BATCH] = {6143, 9001}; /* ragged, not multiples of c */

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int contains(const int32_t *ids, int n, int32_t x)
{
    for (int i = 0; i < n; i++)
        if (ids[i] == x) return 1;
    return 0;
}

static double dmax(double a, double b) { return a > b ? a : b; }

/* An input tensor in backend be's memory: a device copy for cuda, host itself for ref/cpu (skvt_dfree frees it). */
static void *stage_in(skv_backend be, const void *host, size_t bytes)
{
    void *dev = skvt_dbuf(be, (void *)host, bytes);
    skvt_dput(be, dev, host, bytes);
    return dev;
}

static double rel_err_f(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The dense-layer and layer-stats checks described at the top (ref and cpu). */
static void check_dense_layers(uint64_t seed)
{
    enum { DL = 2, DB = 2, DSTEPS = 5 };
    const int64_t dn[DB] = {203, 77}; /* the second is too short for a sparse layer: fine for a dense one */
    skv_config c = skv_config_default();
    c.n_layers = DL, c.n_q_heads = 8, c.n_kv_heads = 2, c.head_dim = 64, c.rank = 24, c.chunk_size = 8;
    c.budget = 48, c.n_outlier_chunks = 2, c.n_local_chunks = 1, c.batch_size = DB, c.max_prompt_len = 256;
    c.gen_capacity = DSTEPS, c.dense_layers = 1, c.rope.theta = 10000.0f;
    const int Hq = c.n_q_heads, Hk = c.n_kv_heads, D = c.head_dim;
    const size_t row = (size_t)Hk * D, HD = (size_t)Hq * D, total = (size_t)c.max_prompt_len + DSTEPS;
    skvt_rng r;
    skvt_rng_seed(&r, seed ^ 0xd0e5e1a7ull);
    /* per layer and sequence: prompt k_pre, v, the exact post-RoPE keys; the steps' q, k, v */
    skv_bf16 *kpre = malloc(DL * DB * total * row * 2), *kpost = malloc(DL * DB * total * row * 2);
    skv_bf16 *vv = malloc(DL * DB * total * row * 2), *q = malloc(DSTEPS * DL * DB * HD * 2);
    float *cos_t = malloc(total * D / 2 * 4), *sin_t = malloc(total * D / 2 * 4), *full = malloc(HD * 4);
    float *outs[2][2]; /* [reproducible][backend] : [mode][step][layer][B * HD] */
    skv_rope_table_build(&c.rope, D, (int64_t)total, cos_t, sin_t);
    for (int i = 0; i < DL * DB; i++) {
        skv_bf16 *kp = kpre + i * total * row;
        skvt_fill_bf16_normal(&r, kp, total * row, 1.0);
        skvt_fill_bf16_normal(&r, vv + i * total * row, total * row, 1.0);
        SKVT_CHECK_STATUS(skv_op_rope(SKV_BACKEND_REF, &c.rope, D, (int64_t)total, Hk, 0, cos_t, sin_t, kp,
                                      kpost + i * total * row),
                          SKV_OK, "rope of the dense test's keys");
    }
    skvt_fill_bf16_normal(&r, q, DSTEPS * DL * DB * HD, 1.5);
    skv_bf16 *sk = malloc(DB * row * 2), *sv = malloc(DB * row * 2);
    float *out = malloc(DB * HD * 4);
    for (int rep = 0; rep < 2; rep++)
        for (int bi = 0; bi < 2; bi++) outs[rep][bi] = calloc((size_t)2 * DSTEPS * DL * DB * HD, 4);
    const skv_backend bes[2] = {SKV_BACKEND_REF, SKV_BACKEND_CPU};
    double worst = 0;
    for (int rep = 0; rep < 2; rep++)
        for (int mode = 0; mode < 2; mode++)
            for (int bi = 0; bi < 2; bi++) {
                skv_config g = c;
                g.reproducible = rep;
                g.backend = bes[bi];
                g.select_mode = mode ? SKV_SELECT_MASS : SKV_SELECT_FIXED;
                g.select_mass = 0.7f;
                skv_cache *k = NULL;
                if (!SKVT_CHECK_STATUS(skv_cache_create(&g, &k), SKV_OK, "create (dense layers)")) {
                    printf("  %s\n", skv_last_error());
                    continue;
                }
                const char *bn = skv_backend_name(bes[bi]);
                for (int l = 0; l < DL; l++)
                    for (int b = 0; b < DB; b++) {
                        const size_t i = (size_t)(l * DB + b) * total * row;
                        /* sparse layer 1 takes the first prompt for both sequences (the second is too short) */
                        const int64_t n = l == 0 ? dn[b] : dn[0];
                        skv_status st = skv_prefill(k, l, b, n, kpre + i, vv + i, b == 0 ? kpost + i : NULL);
                        if (!SKVT_CHECK_STATUS(st, SKV_OK, "prefill (dense layers)")) printf("  %s\n", skv_cache_last_error(k));
                    }
                skv_layer_stats want[DL];
                memset(want, 0, sizeof want);
                for (int s = 0; s < DSTEPS; s++)
                    for (int l = 0; l < DL; l++) {
                        for (int b = 0; b < DB; b++) {
                            const size_t i = (size_t)(l * DB + b) * total * row;
                            const int64_t n = l == 0 ? dn[b] : dn[0];
                            memcpy(sk + b * row, kpost + i + (size_t)(n + s) * row, row * 2);
                            memcpy(sv + b * row, vv + i + (size_t)(n + s) * row, row * 2);
                        }
                        const skv_bf16 *qs = q + (size_t)(s * DL + l) * DB * HD;
                        skv_status st = skv_decode(k, l, qs, sk, sv, out);
                        if (!SKVT_CHECK_STATUS(st, SKV_OK, "decode (dense layers)")) {
                            printf("  %s\n", skv_cache_last_error(k));
                            continue;
                        }
                        memcpy(outs[rep][bi] + ((size_t)(mode * DSTEPS + s) * DL + l) * DB * HD, out, DB * HD * 4);
                        for (int b = 0; b < DB; b++) {
                            skv_seq_info info;
                            skv_cache_seq_info(k, l, b, &info);
                            const int64_t n = info.n, ctx_tokens = n + s + 1;
                            for (int h = 0; h < Hk; h++) {
                                int32_t kh = 0;
                                want[l].head_steps++;
                                want[l].context_tokens += ctx_tokens;
                                if (l == 0) {
                                    want[l].attended_tokens += ctx_tokens;
                                    continue;
                                }
                                SKVT_CHECK_STATUS(skv_cache_selected_count(k, l, b, h, &kh), SKV_OK, "selected_count");
                                want[l].selected_chunks += kh;
                                want[l].attended_tokens +=
                                    (int64_t)c.n_outlier_chunks * c.chunk_size + info.n_local + (int64_t)kh * c.chunk_size + s + 1;
                            }
                            if (l != 0) continue;
                            /* the dense layer: full attention over the exact keys and values of n + s + 1 tokens */
                            const size_t i = (size_t)(l * DB + b) * total * row;
                            st = skv_op_full_attention(SKV_BACKEND_REF, Hq, Hk, D, 0.0f, qs + b * HD, n + s + 1, kpost + i,
                                                       vv + i, full);
                            SKVT_CHECK_STATUS(st, SKV_OK, "full_attention");
                            const double e = rel_err_f(out + b * HD, full, HD);
                            worst = e > worst ? e : worst;
                            SKVT_CHECK(e <= 1e-5,
                                       "%s%s, %s selection: dense layer 0, sequence %d (keys %s), step %d: output vs "
                                       "full attention on the exact keys, rel err %.3g > 1e-5",
                                       bn, rep ? " reproducible" : "", mode ? "mass" : "fixed", b,
                                       b == 0 ? "given post-RoPE" : "the library's RoPE", s, e);
                        }
                    }
                for (int l = 0; l < DL; l++) {
                    skv_layer_stats ls;
                    SKVT_CHECK_STATUS(skv_cache_layer_stats(k, l, &ls), SKV_OK, "layer_stats");
                    SKVT_CHECK(ls.head_steps == want[l].head_steps && ls.context_tokens == want[l].context_tokens &&
                                   ls.attended_tokens == want[l].attended_tokens &&
                                   ls.selected_chunks == want[l].selected_chunks && ls.dense == (l == 0) &&
                                   ls.n_prefilled == DB && ls.rank_min == (l ? c.rank : 0) &&
                                   ls.rank_max == (l ? c.rank : 0) && ls.rank_mean == (l ? c.rank : 0),
                               "%s%s %s: layer %d stats: head_steps %lld/%lld attended %lld/%lld context %lld/%lld "
                               "selected %lld/%lld dense %d prefilled %d rank %d..%d mean %g",
                               bn, rep ? " reproducible" : "", mode ? "mass" : "fixed", l, (long long)ls.head_steps,
                               (long long)want[l].head_steps, (long long)ls.attended_tokens,
                               (long long)want[l].attended_tokens, (long long)ls.context_tokens,
                               (long long)want[l].context_tokens, (long long)ls.selected_chunks,
                               (long long)want[l].selected_chunks, ls.dense, ls.n_prefilled, ls.rank_min, ls.rank_max,
                               ls.rank_mean);
                    if (mode) SKVT_CHECK(l == 0 || ls.attended_tokens < ls.context_tokens, "mass: attended all");
                }
                skv_stats st;
                skv_cache_stats(k, &st);
                SKVT_CHECK(st.decode_allocations == 0, "%s: %lld decode allocations with a dense layer", bn,
                           (long long)st.decode_allocations);
                SKVT_CHECK_STATUS(skv_cache_stats_reset(k), SKV_OK, "stats_reset");
                skv_layer_stats ls;
                skv_cache_layer_stats(k, 1, &ls);
                SKVT_CHECK(ls.head_steps == 0 && ls.attended_tokens == 0 && ls.n_prefilled == DB,
                           "stats_reset zeroes the layer counters (not the ranks)");
                skv_cache_free(k);
            }
    SKVT_CHECK(memcmp(outs[1][0], outs[1][1], (size_t)2 * DSTEPS * DL * DB * HD * 4) == 0,
               "reproducible: ref and cpu outputs (dense layer 0, sparse layer 1; fixed and mass selection) differ");
    printf("dense layer 0 vs full attention on exact keys: max rel err %.3g\n", worst);
    for (int rep = 0; rep < 2; rep++)
        for (int bi = 0; bi < 2; bi++) free(outs[rep][bi]);
    free(kpre), free(kpost), free(vv), free(q), free(cos_t), free(sin_t), free(full), free(sk), free(sv), free(out);
}

/* The test's cache shape (8/2 heads of 128, rank 96, budget 512, BATCH sequences up to 9216
   tokens) with n_layers layers and gen_capacity steps. */
static skv_config e2e_config(int32_t n_layers, int32_t steps)
{
    skv_config cfg = skv_config_default();
    cfg.n_layers = n_layers;
    cfg.n_q_heads = 8;
    cfg.n_kv_heads = 2;
    cfg.head_dim = 128;
    cfg.rank = 96;
    cfg.budget = 512;
    cfg.batch_size = BATCH;
    cfg.max_prompt_len = 9216;
    cfg.gen_capacity = steps;
    return cfg;
}

/*
 * Dense layers and SKV_SELECT_MASS end to end on every available backend, cuda included (its
 * tensors staged in device memory; docs/DESIGN.md 4.5, 4.7): layer 0 dense, layer 1 sparse with
 * the mass rule (p = 0.7, the budget its cap), the synthetic workload above. Dense
 * layer: every backend's output against dense attention with the exact keys <= 1e-3 (it attends
 * to the stored exact keys and values: only float rounding is left), and against ref's <= 2e-3;
 * its counters attend to the whole context. Mass layer: counts and sets equal to ref's, the
 * needle chunk selected, the output against attention with exact keys over its own selection
 * <= 0.05 (the main test's own-selection bound) and against ref's within the main test's
 * cross-backend bound.
 */
static void test_dense_mass_backends(uint64_t seed)
{
    enum { ST = 6 };
    skv_config cfg = e2e_config(2, ST);
    cfg.dense_layers = 1;
    cfg.select_mode = SKV_SELECT_MASS;
    cfg.select_mass = 0.7f;
    cfg.select_min_chunks = 1;
    const int Hq = cfg.n_q_heads, Hk = cfg.n_kv_heads, D = cfg.head_dim, S = cfg.budget / cfg.chunk_size;
    const size_t HD = (size_t)Hq * D;
    const skv_backend want[NBE] = {SKV_BACKEND_REF, SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
    skv_cache *cache[NBE] = {NULL};
    skv_backend be[NBE];
    int nbe = 0;
    for (int i = 0; i < NBE; i++) {
        if (skv_backend_available(want[i]) != SKV_OK) continue;
        cfg.backend = want[i];
        skv_status st = skv_cache_create(&cfg, &cache[nbe]);
        if (!SKVT_CHECK(st == SKV_OK, "dense/mass: create %s: %s %s", skv_backend_name(want[i]), skv_status_string(st),
                        skv_last_error()))
            goto out;
        be[nbe++] = want[i];
    }
    skvs_workload wl;
    if (!SKVT_CHECK_STATUS(skvs_workload_init(&wl, &cfg, ctx[BATCH - 1] + ST, SKV_BACKEND_REF), SKV_OK, "workload"))
        goto out;
    static skvs_seq seq[2][BATCH];
    for (int l = 0; l < 2; l++)
        for (int b = 0; b < BATCH; b++) {
            skv_status st = skvs_seq_generate(&seq[l][b], &wl, ctx[b], ST, 1, seed * 7919u + (uint64_t)(l * BATCH + b));
            SKVT_CHECK_STATUS(st, SKV_OK, "dense/mass: generate");
            const size_t bytes = sizeof(skv_bf16) * (size_t)ctx[b] * Hk * D;
            for (int i = 0; i < nbe; i++) {
                skv_bf16 *dk_pre = stage_in(be[i], seq[l][b].k_pre, bytes), *dv_pre = stage_in(be[i], seq[l][b].v, bytes);
                st = skv_prefill(cache[i], l, b, ctx[b], dk_pre, dv_pre, NULL);
                skvt_dfree(be[i], dk_pre, seq[l][b].k_pre);
                skvt_dfree(be[i], dv_pre, seq[l][b].v);
                SKVT_CHECK(st == SKV_OK, "dense/mass: prefill %s l%d b%d: %s %s", skv_backend_name(be[i]), l, b,
                           skv_status_string(st), skv_cache_last_error(cache[i]));
            }
        }
    /* the reference's always-kept tokens come from the sparse layer (layer 1; the dense layer's reference is
       dense attention, which they do not enter) */
    for (int l = 0; l < 2; l++)
        for (int b = 0; b < BATCH; b++) {
            SKVT_CHECK_STATUS(skvs_seq_attach(&seq[l][b], cache[0], 1, b), SKV_OK, "dense/mass: attach");
            SKVT_CHECK_STATUS(skvs_seq_release(&seq[l][b]), SKV_OK, "dense/mass: release");
        }
    if (skvt_counts_g.failed) goto out_seq;
    skv_bf16 *q = malloc(sizeof(skv_bf16) * BATCH * HD), *k = malloc(sizeof(skv_bf16) * BATCH * Hk * D);
    skv_bf16 *v = malloc(sizeof(skv_bf16) * BATCH * Hk * D);
    float *out[NBE], *full = malloc(sizeof(float) * HD), *exact = malloc(sizeof(float) * HD);
    int32_t *ids = malloc(sizeof(int32_t) * NBE * Hk * S), cnt[NBE][8];
    const size_t q_bytes = sizeof(skv_bf16) * BATCH * HD, kv_bytes = sizeof(skv_bf16) * BATCH * Hk * D,
                 out_bytes = sizeof(float) * BATCH * HD;
    skv_bf16 *dq[NBE], *dk[NBE], *dv[NBE];
    float *dout[NBE];
    for (int i = 0; i < nbe; i++) {
        out[i] = malloc(out_bytes);
        dq[i] = skvt_dbuf(be[i], q, q_bytes), dk[i] = skvt_dbuf(be[i], k, kv_bytes), dv[i] = skvt_dbuf(be[i], v, kv_bytes);
        dout[i] = skvt_dbuf(be[i], out[i], out_bytes);
    }
    double worst_dense = 0, worst_dense_x = 0, worst_own = 0, sum_k = 0;
    int n_k = 0;
    for (int s = 0; s < ST; s++)
        for (int l = 0; l < 2; l++) {
            int32_t needle[BATCH];
            for (int b = 0; b < BATCH; b++)
                SKVT_CHECK_STATUS(skvs_step(&seq[l][b], q + b * HD, k + b * Hk * D, v + b * Hk * D, &needle[b]), SKV_OK,
                                  "dense/mass: step");
            for (int i = 0; i < nbe; i++) {
                skvt_dput(be[i], dq[i], q, q_bytes), skvt_dput(be[i], dk[i], k, kv_bytes), skvt_dput(be[i], dv[i], v, kv_bytes);
                skv_status st = skv_decode(cache[i], l, dq[i], dk[i], dv[i], dout[i]);
                if (st == SKV_OK) st = skv_cache_sync(cache[i]);
                SKVT_CHECK(st == SKV_OK, "dense/mass: decode %s: %s %s", skv_backend_name(be[i]), skv_status_string(st),
                           skv_cache_last_error(cache[i]));
                skvt_dget(be[i], out[i], dout[i], out_bytes);
            }
            for (int b = 0; b < BATCH; b++) {
                for (int i = 0; i < nbe && l == 1; i++)
                    for (int h = 0; h < Hk; h++) {
                        int32_t *row = ids + (i * Hk + h) * S;
                        SKVT_CHECK_STATUS(skv_cache_selected(cache[i], 1, b, h, row), SKV_OK, "dense/mass: selected");
                        SKVT_CHECK_STATUS(skv_cache_selected_count(cache[i], 1, b, h, &cnt[i][h]), SKV_OK,
                                          "dense/mass: selected_count");
                        if (i == 0) sum_k += cnt[0][h], n_k++;
                        SKVT_CHECK(contains(row, cnt[i][h], needle[b]),
                                   "dense/mass: %s step %d seq %d head %d: needle chunk %d not among its %d chunks",
                                   skv_backend_name(be[i]), s, b, h, needle[b], cnt[i][h]);
                        if (i)
                            SKVT_CHECK(cnt[i][h] == cnt[0][h] && !memcmp(ids + h * S, row, sizeof(int32_t) * S),
                                       "dense/mass: step %d seq %d head %d: %s selects %d chunks, ref %d, or other ones",
                                       s, b, h, skv_backend_name(be[i]), cnt[i][h], cnt[0][h]);
                    }
                skv_status st = skvs_reference(&seq[l][b], s + 1, q + b * HD, needle[b], l == 1 ? ids : NULL, full, NULL,
                                               l == 1 ? exact : NULL, NULL);
                SKVT_CHECK_STATUS(st, SKV_OK, "dense/mass: reference");
                for (int i = 0; i < nbe; i++) {
                    const float *o = out[i] + b * HD;
                    const double x = i ? skvs_rel_err(o, out[0] + b * HD, HD) : 0.0;
                    if (l == 0) {
                        const double e = skvs_rel_err(o, full, HD);
                        worst_dense = dmax(worst_dense, e), worst_dense_x = dmax(worst_dense_x, x);
                        SKVT_CHECK(e <= 1e-3, "dense/mass: %s step %d seq %d: dense layer vs dense attention rel err %.3g > 1e-3",
                                   skv_backend_name(be[i]), s, b, e);
                        SKVT_CHECK(x <= 2e-3, "dense/mass: %s step %d seq %d: dense layer vs ref rel err %.3g > 2e-3",
                                   skv_backend_name(be[i]), s, b, x);
                    } else {
                        const double own = skvs_rel_err(o, exact, HD), own_ref = skvs_rel_err(out[0] + b * HD, exact, HD);
                        worst_own = dmax(worst_own, own);
                        SKVT_CHECK(own <= 0.05, "dense/mass: %s step %d seq %d: mass layer vs exact keys and values over "
                                   "its own selection rel err %.4f > 0.05", skv_backend_name(be[i]), s, b, own);
                        SKVT_CHECK(x <= 2e-3 + own + own_ref, "dense/mass: %s step %d seq %d: mass layer vs ref rel err %.3g "
                                   "> %.3g", skv_backend_name(be[i]), s, b, x, 2e-3 + own + own_ref);
                    }
                }
            }
        }
    for (int i = 0; i < nbe; i++) { /* the dense layer attends to every token; both layers counted their steps */
        skv_layer_stats ls0, ls1;
        SKVT_CHECK_STATUS(skv_cache_layer_stats(cache[i], 0, &ls0), SKV_OK, "dense/mass: layer_stats 0");
        SKVT_CHECK_STATUS(skv_cache_layer_stats(cache[i], 1, &ls1), SKV_OK, "dense/mass: layer_stats 1");
        SKVT_CHECK(ls0.dense == 1 && ls0.attended_tokens == ls0.context_tokens && ls0.head_steps == (int64_t)ST * BATCH * Hk &&
                       ls1.dense == 0 && ls1.head_steps == ls0.head_steps && ls1.attended_tokens < ls1.context_tokens,
                   "dense/mass: %s layer stats: dense %d/%d, head steps %lld/%lld, attended %lld of %lld, %lld of %lld",
                   skv_backend_name(be[i]), ls0.dense, ls1.dense, (long long)ls0.head_steps, (long long)ls1.head_steps,
                   (long long)ls0.attended_tokens, (long long)ls0.context_tokens, (long long)ls1.attended_tokens,
                   (long long)ls1.context_tokens);
    }
    printf("dense/mass: dense layer vs dense attention worst rel err %.3g (vs ref %.3g); mass layer mean count %.1f "
           "of %d, worst own-selection error %.4f\n", worst_dense, worst_dense_x, n_k ? sum_k / n_k : 0.0, S, worst_own);
    for (int i = 0; i < nbe; i++) {
        skvt_dfree(be[i], dq[i], q), skvt_dfree(be[i], dk[i], k), skvt_dfree(be[i], dv[i], v);
        skvt_dfree(be[i], dout[i], out[i]);
        free(out[i]);
    }
    free(q), free(k), free(v), free(full), free(exact), free(ids);
out_seq:
    for (int l = 0; l < 2; l++)
        for (int b = 0; b < BATCH; b++) skvs_seq_free(&seq[l][b]);
    skvs_workload_free(&wl);
out:
    for (int i = 0; i < nbe; i++) skv_cache_free(cache[i]);
}

int main(void)
{
    uint64_t seed = skvt_base_seed("test_e2e");
    if (getenv("SKV_BACKEND")) { /* it would turn every cache into one backend */
        printf("test_e2e: ignoring SKV_BACKEND=%s: this test compares backends\n", getenv("SKV_BACKEND"));
        unsetenv("SKV_BACKEND");
    }
    int verbose = getenv("SKV_VERBOSE") != NULL;
    check_dense_layers(seed);
    skv_config cfg = e2e_config(LAYERS, STEPS);
    const int Hq = cfg.n_q_heads, Hk = cfg.n_kv_heads, D = cfg.head_dim, S = cfg.budget / cfg.chunk_size;
    const size_t HD = (size_t)Hq * D;

    const skv_backend want[NBE] = {SKV_BACKEND_REF, SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
    skv_cache *cache[NBE] = {NULL};
    skv_backend be[NBE];
    double prefill_ms[NBE] = {0}, decode_ms[NBE] = {0};
    int nbe = 0;
    for (int i = 0; i < NBE; i++) {
        if (skv_backend_available(want[i]) != SKV_OK) {
            skvt_skip(skv_backend_name(want[i]));
            continue;
        }
        cfg.backend = want[i];
        skv_status st = skv_cache_create(&cfg, &cache[nbe]);
        if (!SKVT_CHECK(st == SKV_OK, "create %s: %s %s", skv_backend_name(want[i]), skv_status_string(st),
                        skv_last_error()))
            return skvt_finish();
        be[nbe] = skv_cache_backend(cache[nbe]);
        nbe++;
    }

    skvs_workload wl;
    skv_status st = skvs_workload_init(&wl, &cfg, ctx[BATCH - 1] + STEPS, SKV_BACKEND_REF);
    if (!SKVT_CHECK_STATUS(st, SKV_OK, "workload")) return skvt_finish();
    static skvs_seq seq[LAYERS][BATCH];
    for (int l = 0; l < LAYERS; l++)
        for (int b = 0; b < BATCH; b++) {
            st = skvs_seq_generate(&seq[l][b], &wl, ctx[b], STEPS, 1, seed * 1000003u + (uint64_t)(l * BATCH + b));
            if (!SKVT_CHECK_STATUS(st, SKV_OK, "generate")) return skvt_finish();
            const size_t bytes = sizeof(skv_bf16) * (size_t)ctx[b] * Hk * D;
            for (int i = 0; i < nbe; i++) {
                skv_bf16 *dk_pre = stage_in(be[i], seq[l][b].k_pre, bytes), *dv_pre = stage_in(be[i], seq[l][b].v, bytes);
                double t0 = now_ms();
                st = skv_prefill(cache[i], l, b, ctx[b], dk_pre, dv_pre, NULL);
                prefill_ms[i] += now_ms() - t0;
                skvt_dfree(be[i], dk_pre, seq[l][b].k_pre);
                skvt_dfree(be[i], dv_pre, seq[l][b].v);
                SKVT_CHECK(st == SKV_OK, "prefill %s l%d b%d: %s %s", skv_backend_name(be[i]), l, b,
                           skv_status_string(st), skv_cache_last_error(cache[i]));
            }
            st = skvs_seq_attach(&seq[l][b], cache[0], l, b);
            SKVT_CHECK_STATUS(st, SKV_OK, "attach");
            SKVT_CHECK_STATUS(skvs_seq_release(&seq[l][b]), SKV_OK, "release");
        }
    if (skvt_counts_g.failed) return skvt_finish();

    /* decode every step on every backend, checking selections as we go; the
       references (BLAS threads) run afterwards so as not to skew the timings */
    enum { NREC = STEPS * LAYERS * BATCH };
    skv_bf16 *q = malloc(sizeof(skv_bf16) * BATCH * HD), *k = malloc(sizeof(skv_bf16) * BATCH * Hk * D);
    skv_bf16 *v = malloc(sizeof(skv_bf16) * BATCH * Hk * D), *rec_q = malloc(sizeof(skv_bf16) * NREC * HD);
    float *out[NBE], *rec_out[NBE];
    for (int i = 0; i < NBE; i++) {
        out[i] = malloc(sizeof(float) * BATCH * HD);
        rec_out[i] = malloc(sizeof(float) * NREC * HD);
    }
    /* each backend's decode tensors: device buffers for cuda, the host arrays for ref/cpu */
    const size_t q_bytes = sizeof(skv_bf16) * BATCH * HD, kv_bytes = sizeof(skv_bf16) * BATCH * Hk * D,
                 out_bytes = sizeof(float) * BATCH * HD;
    skv_bf16 *dq[NBE], *dk[NBE], *dv[NBE];
    float *dout[NBE];
    for (int i = 0; i < nbe; i++) {
        dq[i] = skvt_dbuf(be[i], q, q_bytes);
        dk[i] = skvt_dbuf(be[i], k, kv_bytes);
        dv[i] = skvt_dbuf(be[i], v, kv_bytes);
        dout[i] = skvt_dbuf(be[i], out[i], out_bytes);
    }
    int32_t *sel = malloc(sizeof(int32_t) * NBE * Hk * S), *rec_sel = malloc(sizeof(int32_t) * NREC * Hk * S);
    int32_t rec_needle[NREC];
    int needle_miss = 0, set_diff = 0;
    for (int s = 0; s < STEPS; s++)
        for (int l = 0; l < LAYERS; l++) {
            int32_t needle[BATCH];
            for (int b = 0; b < BATCH; b++) {
                st = skvs_step(&seq[l][b], q + b * HD, k + b * Hk * D, v + b * Hk * D, &needle[b]);
                SKVT_CHECK_STATUS(st, SKV_OK, "step");
            }
            for (int i = 0; i < nbe; i++) {
                skvt_dput(be[i], dq[i], q, q_bytes);
                skvt_dput(be[i], dk[i], k, kv_bytes);
                skvt_dput(be[i], dv[i], v, kv_bytes);
                double t0 = now_ms();
                st = skv_decode(cache[i], l, dq[i], dk[i], dv[i], dout[i]);
                SKVT_CHECK(st == SKV_OK, "decode %s: %s %s", skv_backend_name(be[i]), skv_status_string(st),
                           skv_cache_last_error(cache[i]));
                if (be[i] == SKV_BACKEND_CUDA) { /* decode only enqueued the step */
                    st = skv_cache_sync(cache[i]);
                    SKVT_CHECK(st == SKV_OK, "sync %s after decode: %s %s", skv_backend_name(be[i]),
                               skv_status_string(st), skv_cache_last_error(cache[i]));
                }
                decode_ms[i] += now_ms() - t0;
                skvt_dget(be[i], out[i], dout[i], out_bytes);
            }
            for (int b = 0; b < BATCH; b++) {
                for (int i = 0; i < nbe; i++)
                    for (int h = 0; h < Hk; h++) {
                        int32_t *ids = sel + (i * Hk + h) * S;
                        st = skv_cache_selected(cache[i], l, b, h, ids);
                        SKVT_CHECK_STATUS(st, SKV_OK, "selected");
                        needle_miss += !SKVT_CHECK(contains(ids, S, needle[b]),
                                                   "%s step %d layer %d seq %d head %d: needle chunk %d not selected",
                                                   skv_backend_name(be[i]), s, l, b, h, needle[b]);
                        if (i)
                            set_diff += !SKVT_CHECK(!memcmp(sel + h * S, ids, sizeof(int32_t) * S),
                                                    "step %d layer %d seq %d head %d: %s selects other chunks than ref",
                                                    s, l, b, h, skv_backend_name(be[i]));
                    }
                const int r = (s * LAYERS + l) * BATCH + b;
                memcpy(rec_q + r * HD, q + b * HD, sizeof(skv_bf16) * HD);
                memcpy(rec_sel + r * Hk * S, sel, sizeof(int32_t) * Hk * S);
                for (int i = 0; i < nbe; i++) memcpy(rec_out[i] + r * HD, out[i] + b * HD, sizeof(float) * HD);
                rec_needle[r] = needle[b];
            }
        }

    float *full = malloc(sizeof(float) * HD), *orac = malloc(sizeof(float) * HD), *exact = malloc(sizeof(float) * HD);
    double sum_err[NBE] = {0}, sum_or = 0, sum_sel = 0, sum_needle = 0, sum_sink = 0;
    double min_mass = 1, max_own = 0, max_xbe = 0;
    for (int r = 0; r < NREC; r++) {
        const int b = r % BATCH, l = r / BATCH % LAYERS, s = r / BATCH / LAYERS;
        skvs_ref_stats rs;
        st = skvs_reference(&seq[l][b], s + 1, rec_q + r * HD, rec_needle[r], rec_sel + r * Hk * S, full, orac,
                            exact, &rs);
        SKVT_CHECK_STATUS(st, SKV_OK, "reference");
        double e_or = skvs_rel_err(orac, full, HD), e_sel = skvs_rel_err(exact, full, HD);
        sum_or += e_or;
        sum_sel += e_sel;
        sum_needle += rs.needle_mass;
        sum_sink += rs.sink_mass;
        min_mass = rs.topk_mass < min_mass ? rs.topk_mass : min_mass;
        SKVT_CHECK(rs.topk_mass >= 0.9, "step %d layer %d seq %d: top-budget mass %.4f < 0.9", s, l, b, rs.topk_mass);
        SKVT_CHECK(e_sel <= 1.25 * e_or + 0.01,
                   "step %d layer %d seq %d: selection's exact-key error %.4f > 1.25 x oracle %.4f + 0.01", s, l, b,
                   e_sel, e_or);
        if (verbose)
            printf("step %2d layer %d seq %d: mass top %.4f needle %.3f sink %.3f; rel err oracle %.4f selection %.4f",
                   s, l, b, rs.topk_mass, rs.needle_mass, rs.sink_mass, e_or, e_sel);
        for (int i = 0; i < nbe; i++) {
            const float *o = rec_out[i] + r * HD;
            /* own: output vs exact keys and values over the library's own selection */
            double e = skvs_rel_err(o, full, HD), own = skvs_rel_err(o, exact, HD);
            sum_err[i] += e;
            max_own = dmax(max_own, own);
            if (verbose) printf(" %s %.4f", skv_backend_name(be[i]), e);
            SKVT_CHECK(e <= 1.25 * e_or + 0.03,
                       "%s step %d layer %d seq %d: output vs dense attention rel err %.4f > 1.25 x the per-token "
                       "oracle's %.4f + 0.03",
                       skv_backend_name(be[i]), s, l, b, e, e_or);
            SKVT_CHECK(own <= 0.05,
                       "%s step %d layer %d seq %d: output vs attention with exact keys and values over the library's "
                       "own selection: rel err %.4f > 0.05 (selection excluded; rebuilt keys, gathered values, stored "
                       "outlier/local/generated tokens or the attention itself)",
                       skv_backend_name(be[i]), s, l, b, own);
            if (i) {
                /* each backend has its own factorization route (ref: double Gram + dsyevr; cpu:
                   subspace iteration; cuda: fp32 block Grams + Xsyevd), all within the bound of
                   docs/DESIGN.md section 6 but not equal: a backend's output may differ from ref's by
                   up to both outputs' own-selection errors (each measured against the same
                   selection with exact keys and values), plus attention rounding */
                double x = skvs_rel_err(o, rec_out[0] + r * HD, HD);
                double own_ref = skvs_rel_err(rec_out[0] + r * HD, exact, HD), lim = 2e-3 + own + own_ref;
                max_xbe = dmax(max_xbe, x);
                SKVT_CHECK(x <= lim,
                           "step %d layer %d seq %d: %s output vs ref's output rel err %.3g > %.3g (2e-3 + both "
                           "outputs' own-selection errors, %s %.3g and ref %.3g)",
                           s, l, b, skv_backend_name(be[i]), x, lim, skv_backend_name(be[i]), own, own_ref);
            }
        }
        if (verbose) printf("\n");
    }
    const int n_meas = NREC;

    printf("shape: layers %d, batch %d (n = %lld, %lld), Hq %d, Hk %d, D %d, r %d, budget %d, O %d, steps %d\n",
           LAYERS, BATCH, (long long)ctx[0], (long long)ctx[1], Hq, Hk, D, cfg.rank, cfg.budget,
           cfg.n_outlier_chunks, STEPS);
    for (int i = 0; i < nbe; i++)
        printf("%-4s prefill %7.1f ms, decode %7.2f ms/step, mean rel err vs full %.4f\n", skv_backend_name(be[i]),
               prefill_ms[i], decode_ms[i] / STEPS, sum_err[i] / n_meas);
    printf("mean rel err vs full: oracle %.4f, library selection with exact keys %.4f; max own-selection error "
           "(output vs exact keys and values on its selection) %.4f\n",
           sum_or / n_meas, sum_sel / n_meas, max_own);
    printf("attention: min top-budget mass %.4f, mean share of needle chunk %.3f, of sinks %.3f\n", min_mass,
           sum_needle / n_meas, sum_sink / n_meas);
    printf("needle misses %d, selection mismatches %d, max cross-backend output rel err %.3g\n", needle_miss,
           set_diff, max_xbe);

    for (int l = 0; l < LAYERS; l++)
        for (int b = 0; b < BATCH; b++) skvs_seq_free(&seq[l][b]);
    for (int i = 0; i < nbe; i++) {
        skvt_dfree(be[i], dq[i], q), skvt_dfree(be[i], dk[i], k), skvt_dfree(be[i], dv[i], v);
        skvt_dfree(be[i], dout[i], out[i]);
    }
    for (int i = 0; i < NBE; i++) {
        skv_cache_free(cache[i]);
        free(out[i]), free(rec_out[i]);
    }
    skvs_workload_free(&wl);
    free(q), free(k), free(v), free(full), free(orac), free(exact), free(sel), free(rec_q), free(rec_sel);
    test_dense_mass_backends(seed);
    return skvt_finish();
}
