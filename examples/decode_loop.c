/*
 * decode_loop.c - a whole ShadowKV session on the public header alone: create
 * a cache, prefill every layer of a ragged batch, then a decode loop of
 * several steps through every layer, the way an inference engine drives the
 * library. Synthetic data from its own small RNG; nothing but shadowkv.h and
 * the C library.
 *
 * What the API asks of the caller, shown here:
 *  - prefill takes pre-RoPE keys (k_post NULL: the library applies RoPE);
 *  - skv_decode takes post-RoPE q and k: the caller ropes the new token of
 *    sequence b at its position, n_b + (tokens generated so far), with the
 *    cache's RoPE settings (skv_rope_table_build + skv_op_rope, on the host);
 *  - tensors go through skv_buffer_alloc/skv_buffer_copy, so the same code
 *    runs on every backend (device memory for cuda, host for ref and cpu);
 *    skv_cache_sync after a step (cuda only enqueues it);
 *  - every layer takes a token's step before any layer takes the next token's;
 *  - introspection buffers are sized from skv_cache_seq_info (n_selected,
 *    n_outliers, n_candidates; landmarks are n_candidates * head_dim).
 *
 *   build/decode_loop [--backend auto|ref|cpu|cuda] [--steps 8]
 *
 * The synthetic data imitate what ShadowKV relies on: keys close to low rank
 * across heads, chunk-coherent, with their energy in the slowly rotating RoPE
 * dims; each decode query looks for one prompt chunk (a multiple of one of its
 * keys plus noise), so attention is concentrated as in real models.
 *
 * It checks what it can see (every status, finite outputs, increasing
 * selected chunks that are candidates and not outliers, the generated-token
 * counts, the queried chunk kept (selected or an outlier) in at least 90% of
 * the (step, layer, sequence, KV head) cases) and prints the output's
 * relative L2 distance to dense attention over the same tokens at the last
 * step. Exit status: 0 when every check held, 1 otherwise, 2 on bad options.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shadowkv.h"

enum { LAYERS = 2, BATCH = 2, HQ = 8, HK = 2, DIM = 64 };
static const int64_t prompt_len[BATCH] = {700, 1003}; /* ragged, not multiples of the chunk */

/* ---- a tiny RNG: splitmix64, normals by Box-Muller ------------------------------------------- */

static uint64_t rng_state = 20261213;

static uint64_t rng_u64(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_normal(void)
{
    double u1 = ((double)(rng_u64() >> 11) + 0.5) * 0x1p-53, u2 = (double)(rng_u64() >> 11) * 0x1p-53;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* n normal values times scale, as bf16 */
static void fill_normal(skv_bf16 *x, size_t n, double scale)
{
    for (size_t i = 0; i < n; i++) x[i] = skv_bf16_from_float((float)(scale * rng_normal()));
}

/*
 * A prompt's pre-RoPE keys [n, HK, DIM]: rank-8 latents on a random basis plus 5% noise (real
 * keys are close to low rank across heads: the factorization relies on it), one latent per
 * chunk of 8 tokens with a small per-token change (chunks are coherent: landmarks represent
 * them), and little energy in the fast-rotating half of the RoPE pairs (default rope layout:
 * pair i is dims (i, i + DIM/2), slower for larger i), so that a query keeps finding its keys
 * across positions.
 */
static void fill_keys(skv_bf16 *k, int64_t n)
{
    enum { RANK = 8, ROW = HK * DIM, CHUNK = 8 };
    static double basis[RANK][ROW];
    for (int j = 0; j < RANK; j++)
        for (int e = 0; e < ROW; e++)
            basis[j][e] = rng_normal() / sqrt((double)RANK) * (e % (DIM / 2) < DIM / 4 ? 0.1 : 1.0);
    double z[RANK];
    for (int64_t t = 0; t < n; t++) {
        double zt[RANK];
        for (int j = 0; j < RANK; j++) {
            if (t % CHUNK == 0) z[j] = rng_normal();
            zt[j] = z[j] + 0.2 * rng_normal();
        }
        for (int e = 0; e < ROW; e++) {
            double x = 0.05 * rng_normal();
            for (int j = 0; j < RANK; j++) x += zt[j] * basis[j][e];
            k[(size_t)t * ROW + e] = skv_bf16_from_float((float)x);
        }
    }
}

/* ---- error handling -------------------------------------------------------------------------- */

static int failures;

static void fail(const char *what)
{
    fprintf(stderr, "decode_loop: FAILED: %s\n", what);
    failures++;
}

/* a status that must be SKV_OK; on failure prints the call and the library's message, exits */
static void ok(skv_status st, const char *call, skv_cache *cache)
{
    if (st == SKV_OK) return;
    fprintf(stderr, "decode_loop: %s: %s\ndecode_loop: %s\n", call, skv_status_string(st),
            cache ? skv_cache_last_error(cache) : skv_last_error());
    exit(1);
}

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "decode_loop: out of memory\n");
        exit(1);
    }
    return p;
}

/* a buffer of the cache backend's kind, filled from host memory */
static void *to_backend(skv_backend be, const void *host, size_t bytes)
{
    void *d = NULL;
    ok(skv_buffer_alloc(be, bytes, &d), "skv_buffer_alloc", NULL);
    ok(skv_buffer_copy(be, d, host, bytes), "skv_buffer_copy", NULL);
    return d;
}

/* Dense attention of q [HQ, DIM] over keys/values [T, HK, DIM] in double (GQA). */
static void dense_attention(const skv_bf16 *q, const skv_bf16 *k, const skv_bf16 *v, int64_t T, double scale,
                            double *out)
{
    double *w = xmalloc(sizeof(double) * (size_t)T);
    for (int i = 0; i < HQ; i++) {
        const int h = i / (HQ / HK);
        double mx = -INFINITY, z = 0.0;
        for (int64_t t = 0; t < T; t++) {
            double s = 0.0;
            for (int e = 0; e < DIM; e++)
                s += (double)skv_bf16_to_float(q[i * DIM + e]) * skv_bf16_to_float(k[((size_t)t * HK + h) * DIM + e]);
            w[t] = s * scale;
            mx = w[t] > mx ? w[t] : mx;
        }
        for (int64_t t = 0; t < T; t++) z += (w[t] = exp(w[t] - mx));
        for (int e = 0; e < DIM; e++) {
            double acc = 0.0;
            for (int64_t t = 0; t < T; t++) acc += w[t] * skv_bf16_to_float(v[((size_t)t * HK + h) * DIM + e]);
            out[i * DIM + e] = acc / z;
        }
    }
    free(w);
}

int main(int argc, char **argv)
{
    skv_backend backend = SKV_BACKEND_AUTO;
    int steps = 8;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc && skv_backend_parse(argv[i + 1], &backend) == SKV_OK) {
            i++;
        } else if (!strcmp(argv[i], "--steps") && i + 1 < argc && atoi(argv[i + 1]) >= 1 && atoi(argv[i + 1]) <= 64) {
            steps = atoi(argv[++i]);
        } else {
            int help = !strcmp(argv[i], "--help");
            if (!help) fprintf(stderr, "decode_loop: unknown or incomplete option '%s'\n", argv[i]);
            fprintf(help ? stdout : stderr, "usage: decode_loop [--backend auto|ref|cpu|cuda] [--steps 1..64]\n");
            return help ? 0 : 2;
        }
    }

    /* 1. the cache: a small Llama-like shape; all memory is allocated by create */
    skv_config cfg = skv_config_default();
    cfg.n_layers = LAYERS;
    cfg.n_q_heads = HQ;
    cfg.n_kv_heads = HK;
    cfg.head_dim = DIM;
    cfg.rank = 32;
    cfg.chunk_size = 8;
    cfg.budget = 128; /* S = 16 chunks per KV head */
    cfg.n_outlier_chunks = 4;
    cfg.n_local_chunks = 2;
    cfg.batch_size = BATCH;
    cfg.max_prompt_len = 1024;
    cfg.gen_capacity = steps;
    cfg.backend = backend;
    size_t dev_bytes = 0, host_bytes = 0;
    ok(skv_cache_memory(&cfg, &dev_bytes, &host_bytes), "skv_cache_memory", NULL);
    skv_cache *cache = NULL;
    ok(skv_cache_create(&cfg, &cache), "skv_cache_create", NULL);
    const skv_backend be = skv_cache_backend(cache);
    const skv_config *cc = skv_cache_config(cache); /* as validated: its rope settings rope the decode tokens */
    const double scale = cc->attn_scale > 0.0f ? cc->attn_scale : 1.0 / sqrt((double)DIM);

    /* 2. RoPE tables for every position a token can have: prompt, then generated tokens */
    const int64_t n_pos = cc->max_prompt_len + cc->gen_capacity;
    const size_t tab = skv_rope_table_len(&cc->rope, DIM, n_pos);
    float *cos_tab = xmalloc(sizeof(float) * tab), *sin_tab = xmalloc(sizeof(float) * tab);
    ok(skv_rope_table_build(&cc->rope, DIM, n_pos, cos_tab, sin_tab), "skv_rope_table_build", NULL);

    /* 3. prefill every (layer, sequence) with pre-RoPE keys; this program keeps host copies (and
       the roped keys) only for its dense comparison, and appends the generated tokens after them */
    const size_t row = (size_t)HK * DIM, max_tokens = (size_t)cc->max_prompt_len + (size_t)steps;
    skv_bf16 *all_k[LAYERS][BATCH], *all_v[LAYERS][BATCH]; /* [n + steps, HK, DIM], post-RoPE keys */
    skv_bf16 *prompt_k_pre[LAYERS][BATCH];                  /* what the queries look for */
    for (int l = 0; l < LAYERS; l++)
        for (int b = 0; b < BATCH; b++) {
            const int64_t n = prompt_len[b];
            const size_t bytes = sizeof(skv_bf16) * (size_t)n * row;
            skv_bf16 *k_pre = xmalloc(bytes);
            all_k[l][b] = xmalloc(sizeof(skv_bf16) * max_tokens * row);
            all_v[l][b] = xmalloc(sizeof(skv_bf16) * max_tokens * row);
            fill_keys(k_pre, n);
            fill_normal(all_v[l][b], (size_t)n * row, 1.0);
            void *dk = to_backend(be, k_pre, bytes), *dv = to_backend(be, all_v[l][b], bytes);
            ok(skv_prefill(cache, l, b, n, dk, dv, NULL), "skv_prefill", cache);
            skv_buffer_free(be, dk);
            skv_buffer_free(be, dv);
            ok(skv_op_rope(SKV_BACKEND_REF, &cc->rope, DIM, n, HK, 0, cos_tab, sin_tab, k_pre, all_k[l][b]),
               "skv_op_rope (prompt, for the comparison)", NULL);
            prompt_k_pre[l][b] = k_pre;
        }

    /* 4. introspection buffers, sized from seq_info (the largest over the slots) */
    int32_t max_sel = 0, max_out = 0, max_cand = 0;
    for (int l = 0; l < LAYERS; l++)
        for (int b = 0; b < BATCH; b++) {
            skv_seq_info info;
            ok(skv_cache_seq_info(cache, l, b, &info), "skv_cache_seq_info", cache);
            if (!info.prefilled) fail("seq_info: a prefilled slot reports prefilled = 0");
            max_sel = info.n_selected > max_sel ? info.n_selected : max_sel;
            max_out = info.n_outliers > max_out ? info.n_outliers : max_out;
            max_cand = info.n_candidates > max_cand ? info.n_candidates : max_cand;
        }
    int32_t *sel = xmalloc(sizeof(int32_t) * (size_t)max_sel), *outl = xmalloc(sizeof(int32_t) * (size_t)max_out);
    int32_t *cand = xmalloc(sizeof(int32_t) * (size_t)max_cand);
    skv_bf16 *landmarks = xmalloc(sizeof(skv_bf16) * (size_t)max_cand * DIM);
    ok(skv_cache_landmarks(cache, 0, 0, 0, landmarks), "skv_cache_landmarks", cache);

    /* 5. the decode loop: every step runs every layer for the whole batch */
    const size_t qn = (size_t)BATCH * HQ * DIM, kn = (size_t)BATCH * row;
    skv_bf16 *q_pre = xmalloc(sizeof(skv_bf16) * qn), *k_pre = xmalloc(sizeof(skv_bf16) * kn);
    skv_bf16 *q = xmalloc(sizeof(skv_bf16) * qn), *k = xmalloc(sizeof(skv_bf16) * kn), *v = xmalloc(sizeof(skv_bf16) * kn);
    float *out = xmalloc(sizeof(float) * qn);
    double *dense = xmalloc(sizeof(double) * HQ * DIM), err2 = 0.0, ref2 = 0.0;
    int32_t target[BATCH];
    long found = 0, looked = 0;
    void *dq = NULL, *dk = NULL, *dv = NULL, *dout = NULL;
    ok(skv_buffer_alloc(be, sizeof(skv_bf16) * qn, &dq), "skv_buffer_alloc", NULL);
    ok(skv_buffer_alloc(be, sizeof(skv_bf16) * kn, &dk), "skv_buffer_alloc", NULL);
    ok(skv_buffer_alloc(be, sizeof(skv_bf16) * kn, &dv), "skv_buffer_alloc", NULL);
    ok(skv_buffer_alloc(be, sizeof(float) * qn, &dout), "skv_buffer_alloc", NULL);
    for (int step = 0; step < steps; step++)
        for (int l = 0; l < LAYERS; l++) {
            /* the model's pre-RoPE q, k and v of the new token of every sequence: each query
               head looks for one prompt token (of chunk target[b]) of its KV head ... */
            fill_normal(q_pre, qn, 0.3);
            fill_normal(k_pre, kn, 1.0);
            fill_normal(v, kn, 1.0);
            for (int b = 0; b < BATCH; b++) {
                const int64_t t = (int64_t)(rng_u64() % (uint64_t)(prompt_len[b] - 2 * cc->chunk_size));
                target[b] = (int32_t)(t / cc->chunk_size);
                for (int i = 0; i < HQ; i++)
                    for (int e = 0; e < DIM; e++) {
                        skv_bf16 *x = q_pre + ((size_t)b * HQ + i) * DIM + e;
                        const float key = skv_bf16_to_float(prompt_k_pre[l][b][((size_t)t * HK + i / (HQ / HK)) * DIM + e]);
                        *x = skv_bf16_from_float(skv_bf16_to_float(*x) + 2.0f * key);
                    }
            }
            /* ... roped at the token's position in its own sequence */
            for (int b = 0; b < BATCH; b++) {
                const int64_t pos = prompt_len[b] + step;
                ok(skv_op_rope(SKV_BACKEND_REF, &cc->rope, DIM, 1, HQ, pos, cos_tab, sin_tab, q_pre + (size_t)b * HQ * DIM,
                               q + (size_t)b * HQ * DIM),
                   "skv_op_rope (q)", NULL);
                ok(skv_op_rope(SKV_BACKEND_REF, &cc->rope, DIM, 1, HK, pos, cos_tab, sin_tab, k_pre + (size_t)b * row,
                               k + (size_t)b * row),
                   "skv_op_rope (k)", NULL);
                memcpy(all_k[l][b] + (size_t)pos * row, k + (size_t)b * row, sizeof(skv_bf16) * row);
                memcpy(all_v[l][b] + (size_t)pos * row, v + (size_t)b * row, sizeof(skv_bf16) * row);
            }
            ok(skv_buffer_copy(be, dq, q, sizeof(skv_bf16) * qn), "skv_buffer_copy", NULL);
            ok(skv_buffer_copy(be, dk, k, sizeof(skv_bf16) * kn), "skv_buffer_copy", NULL);
            ok(skv_buffer_copy(be, dv, v, sizeof(skv_bf16) * kn), "skv_buffer_copy", NULL);
            ok(skv_decode(cache, l, dq, dk, dv, dout), "skv_decode", cache);
            ok(skv_cache_sync(cache), "skv_cache_sync", cache); /* cuda: the step was only enqueued */
            ok(skv_buffer_copy(be, out, dout, sizeof(float) * qn), "skv_buffer_copy (out)", NULL);

            for (size_t i = 0; i < qn; i++)
                if (!isfinite(out[i])) {
                    fail("a decode output is not finite");
                    break;
                }
            /* the decisions of this step, read back */
            for (int b = 0; b < BATCH; b++) {
                skv_seq_info info;
                ok(skv_cache_seq_info(cache, l, b, &info), "skv_cache_seq_info", cache);
                if (info.n_generated != step + 1 || !info.has_selection) fail("seq_info: generated-token count");
                for (int h = 0; h < HK; h++) {
                    ok(skv_cache_selected(cache, l, b, h, sel), "skv_cache_selected", cache);
                    ok(skv_cache_outliers(cache, l, b, h, outl), "skv_cache_outliers", cache);
                    ok(skv_cache_candidates(cache, l, b, h, cand), "skv_cache_candidates", cache);
                    /* the queried chunk is kept: selected, or an outlier (always attended) */
                    int kept = 0;
                    for (int32_t i = 0; i < info.n_selected; i++) kept |= sel[i] == target[b];
                    for (int32_t o = 0; o < info.n_outliers; o++) kept |= outl[o] == target[b];
                    found += kept;
                    looked++;
                    for (int32_t i = 0, j = 0; i < info.n_selected; i++) {
                        while (j < info.n_candidates && cand[j] < sel[i]) j++;
                        if ((i && sel[i] <= sel[i - 1]) || j == info.n_candidates || cand[j] != sel[i])
                            fail("a selected chunk is not an increasing candidate");
                        for (int32_t o = 0; o < info.n_outliers; o++)
                            if (outl[o] == sel[i]) fail("a selected chunk is an outlier");
                    }
                }
                if (step + 1 < steps) continue;
                /* the last step: distance to dense attention over the prompt and generated tokens */
                dense_attention(q + (size_t)b * HQ * DIM, all_k[l][b], all_v[l][b], prompt_len[b] + step + 1, scale,
                                dense);
                for (int e = 0; e < HQ * DIM; e++) {
                    const double d = out[(size_t)b * HQ * DIM + e] - dense[e];
                    err2 += d * d;
                    ref2 += dense[e] * dense[e];
                }
            }
        }

    if (found * 10 < looked * 9) fail("the queried chunk was kept in fewer than 90% of the (step, layer, sequence, KV head) cases");
    skv_stats stats;
    ok(skv_cache_stats(cache, &stats), "skv_cache_stats", cache);
    if (stats.n_decode_calls != (int64_t)steps * LAYERS) fail("stats: decode call count");
    printf("decode_loop: backend %s, %d layers, batch %d (n = %lld, %lld), Hq %d Hk %d D %d, budget %d, "
           "%d steps; cache %zu + %zu bytes\n",
           skv_backend_name(be), LAYERS, BATCH, (long long)prompt_len[0], (long long)prompt_len[1], HQ, HK, DIM,
           cc->budget, steps, dev_bytes, host_bytes);
    printf("decode_loop: selected chunks of (layer %d, seq %d, KV head %d) at the last step:", LAYERS - 1, BATCH - 1,
           HK - 1);
    for (int32_t i = 0; i < max_sel; i++) printf(" %d", sel[i]);
    printf("\ndecode_loop: queried chunk kept in %ld of %ld (step, layer, sequence, KV head) cases; last step vs dense attention "
           "over all %lld + %lld tokens: rel L2 %.3f; decode %.2f ms per step and layer\n",
           found, looked, (long long)prompt_len[0] + steps, (long long)prompt_len[1] + steps,
           ref2 > 0 ? sqrt(err2 / ref2) : 0.0, stats.decode_step_ms / (double)(steps * LAYERS));
    if (!(isfinite(err2) && ref2 > 0)) fail("the comparison with dense attention is not finite");
    printf("decode_loop: %s\n", failures ? "FAILED" : "all checks passed");

    skv_buffer_free(be, dq);
    skv_buffer_free(be, dk);
    skv_buffer_free(be, dv);
    skv_buffer_free(be, dout);
    for (int l = 0; l < LAYERS; l++)
        for (int b = 0; b < BATCH; b++) free(all_k[l][b]), free(all_v[l][b]), free(prompt_k_pre[l][b]);
    free(cos_tab), free(sin_tab), free(sel), free(outl), free(cand), free(landmarks);
    free(q_pre), free(k_pre), free(q), free(k), free(v), free(out), free(dense);
    skv_cache_free(cache);
    return failures ? 1 : 0;
}
