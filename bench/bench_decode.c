/*
 * bench_decode.c - `skv-bench decode`: one layer's decode step at a
 * Llama-3-8B shape (Hq 32, Hk 8, D 128, r 160, c 8, budget 2048, O 48,
 * Lc 4) for each context length and batch size, through the public cache
 * API, split into the library's phases (select, rebuild, fetch, attention).
 *
 *   build/skv-bench decode [--backend cuda] [--ctx 32768,131072] [--batch 1,8]
 *                          [--steps 50] [--warmup 5] [--json]
 *
 * The prompt of one sequence is generated once per context length (synthetic
 * workload, tests/common/synth.h) and every sequence of the batch is
 * prefilled from it; each sequence still has its own factorization, value
 * store and state. Per step: the inputs are staged (not timed), then
 * skv_decode + skv_cache_sync are timed with the host clock; the figure is
 * the median over --steps steps after --warmup steps. The split comes from
 * the cache's stats (CUDA events on cuda, host clock on ref/cpu) averaged
 * over the same steps. "pipelined_ms" times --steps steps issued back to
 * back with one sync at the end (launch latency overlapped).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "synth.h"
#include "testutil.h"

#define MAXV 8

static double dnow_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int dcmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void ddie(const char *what, skv_status st, const skv_cache *cache)
{
    fprintf(stderr, "skv-bench decode: %s failed: %s\n", what, skv_status_string(st));
    const char *msg = cache ? skv_cache_last_error(cache) : skv_last_error();
    if (msg && *msg) fprintf(stderr, "skv-bench decode: %s\n", msg);
    exit(1);
}

static int parse_list(const char *s, int64_t *out)
{
    int n = 0;
    char *buf = strdup(s), *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t && n < MAXV; t = strtok_r(NULL, ",", &save)) out[n++] = atoll(t);
    free(buf);
    return n;
}

typedef struct {
    int64_t ctx;
    int B;
    double prefill_ms, step_ms, step_min_ms, pipelined_ms, device_step_ms, sel, reb, fet, att;
    long needle_hits, needle_total;
} drow;

static drow run_one(skv_backend be, int64_t ctx, int B, int steps, int warmup)
{
    drow row;
    memset(&row, 0, sizeof row);
    row.ctx = ctx, row.B = B;
    skv_config cfg = skv_config_default();
    cfg.n_layers = 1;
    cfg.batch_size = B;
    cfg.max_prompt_len = ctx;
    const int total = warmup + 2 * steps;
    cfg.gen_capacity = total;
    cfg.backend = be;
    const int Hq = cfg.n_q_heads, Hk = cfg.n_kv_heads, D = cfg.head_dim, S = cfg.budget / cfg.chunk_size;
    skvs_workload wl;
    skvs_seq seq;
    skv_status st;
    if ((st = skvs_workload_init(&wl, &cfg, ctx + total, SKV_BACKEND_CPU))) ddie("workload", st, NULL);
    fprintf(stderr, "skv-bench decode: generating a %lld-token prompt\n", (long long)ctx);
    if ((st = skvs_seq_generate(&seq, &wl, ctx, total, 0, 20251201 + (uint64_t)ctx))) ddie("workload", st, NULL);
    size_t pb = (size_t)ctx * Hk * D * sizeof(skv_bf16);
    skv_bf16 *dk = skvt_dbuf(be, seq.k_pre, pb), *dv = skvt_dbuf(be, seq.v, pb);
    skvt_dput(be, dk, seq.k_pre, pb);
    skvt_dput(be, dv, seq.v, pb);
    skv_cache *cache = NULL;
    if ((st = skv_cache_create(&cfg, &cache))) ddie("skv_cache_create", st, NULL);
    double pf[MAXV * 8];
    for (int b = 0; b < B; b++) {
        double t0 = dnow_ms();
        if ((st = skv_prefill(cache, 0, b, ctx, dk, dv, NULL))) ddie("skv_prefill", st, cache);
        pf[b] = dnow_ms() - t0;
    }
    qsort(pf, (size_t)B, sizeof *pf, dcmp);
    row.prefill_ms = pf[B / 2];
    if ((st = skvs_seq_attach(&seq, cache, 0, 0))) ddie("attach", st, cache);
    skvt_dfree(be, dk, seq.k_pre);
    skvt_dfree(be, dv, seq.v);
    if ((st = skvs_seq_release(&seq))) ddie("workload", st, NULL);

    const size_t qn = (size_t)B * Hq * D, kn = (size_t)B * Hk * D;
    skv_bf16 *q = malloc(qn * 2), *k = malloc(kn * 2), *v = malloc(kn * 2);
    float *out = malloc(qn * 4);
    int32_t *sel = malloc((size_t)S * 4);
    skv_bf16 *dq = skvt_dbuf(be, q, qn * 2), *dkn = skvt_dbuf(be, k, kn * 2), *dvn = skvt_dbuf(be, v, kn * 2);
    float *dout = skvt_dbuf(be, out, qn * 4);
    double *t = malloc(sizeof(double) * (size_t)total);
    skv_stats s0, s1;
    for (int i = 0; i < warmup + steps; i++) {
        int32_t needle;
        if ((st = skvs_step(&seq, q, k, v, &needle))) ddie("workload step", st, NULL);
        for (int b = 1; b < B; b++) {
            memcpy(q + (size_t)b * Hq * D, q, (size_t)Hq * D * 2);
            memcpy(k + (size_t)b * Hk * D, k, (size_t)Hk * D * 2);
            memcpy(v + (size_t)b * Hk * D, v, (size_t)Hk * D * 2);
        }
        skvt_dput(be, dq, q, qn * 2);
        skvt_dput(be, dkn, k, kn * 2);
        skvt_dput(be, dvn, v, kn * 2);
        if (i == warmup && (st = skv_cache_stats(cache, &s0))) ddie("stats", st, cache);
        double t0 = dnow_ms();
        if ((st = skv_decode(cache, 0, dq, dkn, dvn, dout))) ddie("skv_decode", st, cache);
        if ((st = skv_cache_sync(cache))) ddie("skv_cache_sync", st, cache);
        if (i >= warmup) t[i - warmup] = dnow_ms() - t0;
        for (int b = 0; b < B && i >= warmup; b++)
            for (int h = 0; h < Hk; h++) {
                if ((st = skv_cache_selected(cache, 0, b, h, sel))) ddie("skv_cache_selected", st, cache);
                for (int j = 0; j < S; j++) row.needle_hits += sel[j] == needle;
                row.needle_total++;
            }
    }
    if ((st = skv_cache_stats(cache, &s1))) ddie("stats", st, cache);
    qsort(t, (size_t)steps, sizeof *t, dcmp);
    row.step_ms = t[steps / 2];
    row.step_min_ms = t[0];
    row.sel = (s1.decode_select_ms - s0.decode_select_ms) / steps;
    row.reb = (s1.decode_rebuild_ms - s0.decode_rebuild_ms) / steps;
    row.fet = (s1.decode_fetch_ms - s0.decode_fetch_ms) / steps;
    row.att = (s1.decode_attention_ms - s0.decode_attention_ms) / steps;
    row.device_step_ms = (s1.decode_step_ms - s0.decode_step_ms) / steps;
    /* back to back: same inputs each step (the generated region still grows) */
    double t0 = dnow_ms();
    for (int i = 0; i < steps; i++)
        if ((st = skv_decode(cache, 0, dq, dkn, dvn, dout))) ddie("skv_decode", st, cache);
    if ((st = skv_cache_sync(cache))) ddie("skv_cache_sync", st, cache);
    row.pipelined_ms = (dnow_ms() - t0) / steps;
    skvt_dfree(be, dq, q);
    skvt_dfree(be, dkn, k);
    skvt_dfree(be, dvn, v);
    skvt_dfree(be, dout, out);
    free(q), free(k), free(v), free(out), free(sel), free(t);
    skv_cache_free(cache);
    skvs_seq_free(&seq);
    skvs_workload_free(&wl);
    return row;
}

int bench_decode_main(int argc, char **argv)
{
    int64_t ctxs[MAXV] = {32768, 131072}, batches[MAXV] = {1, 8};
    int n_ctx = 2, n_b = 2, steps = 50, warmup = 5, json = 0;
    skv_backend be = SKV_BACKEND_AUTO;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--ctx")) n_ctx = parse_list(v, ctxs), i++;
        else if (!strcmp(a, "--batch")) n_b = parse_list(v, batches), i++;
        else if (!strcmp(a, "--steps")) steps = atoi(v), i++;
        else if (!strcmp(a, "--warmup")) warmup = atoi(v), i++;
        else if (!strcmp(a, "--backend")) {
            if (skv_backend_parse(v, &be)) ddie("--backend", SKV_ERR_INVALID_ARGUMENT, NULL);
            i++;
        } else {
            printf("usage: skv-bench decode [--backend auto|ref|cpu|cuda] [--ctx 32768,131072] [--batch 1,8] "
                   "[--steps 50] [--warmup 5] [--json]\n");
            return strcmp(a, "--help") ? 2 : 0;
        }
    }
    if (steps < 1 || warmup < 0 || n_ctx < 1 || n_b < 1) {
        fprintf(stderr, "skv-bench decode: --steps >= 1, --warmup >= 0, non-empty --ctx and --batch\n");
        return 2;
    }
    skv_config probe = skv_config_default();
    probe.backend = be;
    skv_cache *c = NULL;
    probe.n_layers = 1, probe.max_prompt_len = 4096;
    skv_status st = skv_cache_create(&probe, &c);
    if (st) ddie("backend", st, NULL);
    be = skv_cache_backend(c);
    skv_cache_free(c);

    drow rows[MAXV * MAXV];
    int n = 0;
    for (int i = 0; i < n_ctx; i++)
        for (int j = 0; j < n_b; j++) {
            rows[n] = run_one(be, ctxs[i], (int)batches[j], steps, warmup);
            const drow *r = &rows[n++];
            fprintf(stderr,
                    "skv-bench decode: %s ctx %lld batch %d: %.3f ms/step (device %.3f, pipelined %.3f), select %.3f rebuild "
                    "%.3f fetch %.3f attention %.3f; prefill %.1f ms/sequence\n",
                    skv_backend_name(be), (long long)r->ctx, r->B, r->step_ms, r->device_step_ms, r->pipelined_ms, r->sel,
                    r->reb, r->fet,
                    r->att, r->prefill_ms);
        }
    if (json) {
        printf("{\"backend\": \"%s\", \"layers\": 1, \"shape\": {\"hq\": 32, \"hk\": 8, \"dim\": 128, \"rank\": 160, "
               "\"chunk\": 8, \"budget\": 2048, \"outlier_chunks\": 48, \"local_chunks\": 4},\n"
               " \"steps\": %d, \"warmup\": %d, \"note\": \"step_ms: median over steps of skv_decode + skv_cache_sync "
               "(host clock); device_step_ms: per-step mean of the cache's decode_step_ms (cuda: CUDA events from the "
               "first to the last kernel of a step); split: per-step mean of the cache's phase stats (cuda: rebuild "
               "and fetch overlap); pipelined_ms: steps back to back with the same inputs (the selection repeats, so "
               "every value chunk is reused on the device), one sync\",\n \"rows\": [",
               skv_backend_name(be), steps, warmup);
        for (int i = 0; i < n; i++) {
            const drow *r = &rows[i];
            printf("%s\n  {\"ctx\": %lld, \"batch\": %d, \"step_ms\": %.4f, \"step_min_ms\": %.4f, "
                   "\"device_step_ms\": %.4f, \"pipelined_ms\": %.4f, \"select_ms\": %.4f, \"rebuild_ms\": %.4f, \"fetch_ms\": %.4f, \"attention_ms\": %.4f, "
                   "\"prefill_ms_per_sequence\": %.3f, \"needle_hits\": %ld, \"needle_heads\": %ld}",
                   i ? "," : "", (long long)r->ctx, r->B, r->step_ms, r->step_min_ms, r->device_step_ms,
                   r->pipelined_ms, r->sel, r->reb,
                   r->fet, r->att, r->prefill_ms, r->needle_hits, r->needle_total);
        }
        printf("]}\n");
    } else {
        printf("%-6s %8s %6s %10s %10s %8s %8s %8s %8s %10s\n", "backend", "ctx", "batch", "step_ms", "pipelined",
               "select", "rebuild", "fetch", "attn", "prefill");
        for (int i = 0; i < n; i++) {
            const drow *r = &rows[i];
            printf("%-6s %8lld %6d %10.3f %10.3f %8.3f %8.3f %8.3f %8.3f %10.1f\n", skv_backend_name(be),
                   (long long)r->ctx, r->B, r->step_ms, r->pipelined_ms, r->sel, r->reb, r->fet, r->att, r->prefill_ms);
        }
    }
    return 0;
}
