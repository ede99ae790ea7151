/*
 * bench_decode.c - `skv-bench decode`: one layer's decode step at a
 * Llama-3-8B shape (Hq 32, Hk 8, D 128, r 160, c 8, budget 2048, O 48,
 * Lc 4), through the public cache API, for every combination of
 *   --ctx        prompt length per sequence            (32768,131072,1048576)
 *   --batch      sequences                             (1,8,32; contexts above
 *                131072 run at batch <= --big-batch only, default 1)
 *   --placement  device: every value on the device; host: every value in the
 *                host store behind the device chunk cache
 *   --workload   fresh: a new random query per step and sequence (the
 *                synthetic workload of examples/synth.h, one random
 *                stream per sequence on a shared prompt); drift: each query
 *                mixes the previous one with a fresh one, q_t = a q_{t-1} +
 *                sqrt(1 - a^2) fresh_t (--drift a; 0.92 lands near the 60% adjacent-step overlap
 *                the ShadowKV paper reports), as real queries drift
 *
 *   build/skv-bench decode [--backend cuda] [--ctx ...] [--batch ...]
 *       [--placement device,host] [--workload fresh,drift] [--steps 30]
 *       [--warmup 5] [--drift 0.92] [--big-batch 1] [--hbm-gbs 4200]
 *       [--pcie-gbs 55] [--reproducible] [--select fixed,mass,all,dense,rescore]
 *       [--select-mass 0.95] [--select-min 0] [--select-candidates 0] [--json]
 *
 * --select runs every (ctx, batch, placement) once per selection: the fixed budget (default),
 * SKV_SELECT_MASS (target --select-mass, floor --select-min, the budget its cap), SKV_BUDGET_ALL,
 * a dense layer (config.dense_layers; device placement only). Rows then carry chunks_per_head and
 * attended_share (skv_cache_layer_stats over the timed steps), so the new modes' cost can be set
 * against the fixed budget's in one run.
 *
 * --reproducible runs every (ctx, batch, placement) twice, in the default mode
 * and with config.reproducible = 1 (the canonical rebuild and attention,
 * docs/DESIGN.md section 10), one cache each, and prints both rows (column
 * mode) and, per pair, the ratio of the reproducible step to the default one.
 *
 * Each (ctx, batch, placement) gets one cache, prefilled for every sequence
 * from one generated prompt (each sequence has its own factorization, store
 * and state); the workloads then run on it one after the other. Per step the
 * inputs are generated and copied (not timed), then skv_decode is timed: with
 * CUDA events around it on the cache's stream (cuda), with the host clock
 * around skv_decode + skv_cache_sync (ref, cpu). step_ms is the median over
 * --steps steps after --warmup steps.
 *
 * digest: FNV-1a (64 bits) over every step's output (all B x Hq x D floats, copied back
 * untimed) and the selections read for the overlap, in step order: two builds, backends or
 * runs with the same digest made the same decisions and wrote the same output bits.
 *
 * Per row also: overlap (the mean share of a KV head's selected chunks that
 * the previous step selected too, over up to 4 sequences and every head),
 * hit_rate (chunk-cache hits / lookups over the timed steps, host placement),
 * kernels_per_step (skv_stats.decode_launches per step), and floor_ms, the
 * time the step's necessary traffic takes: device placement, the bytes a step
 * must read from device memory (landmarks of every candidate, the U rows of
 * the selected tokens, the selected values, the outlier / local / generated
 * keys and values, q and out) over --hbm-gbs; host placement, the larger of
 * that without the missed values and the missed values' bytes over
 * --pcie-gbs. The dense baseline is timed by tests/gpu/dense_decode.py in the
 * same run and joined by tests/gpu/decode_table.py.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "skv_numerics.h"
#include "synth.h"
#include "testutil.h"

#ifdef SKV_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define MAXV 8
#define MAX_OVERLAP_SEQS 4

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

static void ddie(const char *what, skv_status st, skv_cache *cache)
{
    fprintf(stderr, "skv-bench decode: %s failed: %s\n", what, skv_status_string(st));
    const char *msg = cache ? skv_cache_last_error(cache) : skv_last_error();
    if (msg && *msg) fprintf(stderr, "skv-bench decode: %s\n", msg);
    exit(1);
}

static uint64_t fnv1a(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

static int parse_list(const char *s, int64_t *out)
{
    int n = 0;
    char *buf = strdup(s), *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t && n < MAXV; t = strtok_r(NULL, ",", &save)) out[n++] = atoll(t);
    free(buf);
    return n;
}

enum { PL_DEVICE, PL_HOST, N_PL };
enum { WL_FRESH, WL_DRIFT, N_WL };
static const char *const pl_name[N_PL] = {"device", "host"};
static const char *const wl_name[N_WL] = {"fresh", "drift"};

/* --select: how the one layer selects (docs/DESIGN.md 4.5): the fixed budget, the mass rule (its cap the
   budget), every candidate (SKV_BUDGET_ALL), a dense layer (config.dense_layers), or the fixed budget
   among --select-candidates rescored candidates (4.5.1) */
enum { SV_FIXED, SV_MASS, SV_ALL, SV_DENSE, SV_RESCORE, N_SV };
static const char *const sv_name[N_SV] = {"fixed", "mass", "all", "dense", "rescore"};

typedef struct {
    int64_t ctx;
    int B, placement, workload, reproducible, variant, value_dtype;
    double sel_mean, attended_share; /* mean chunks per head step, attended / context tokens (layer stats) */
    double step_ms, step_min_ms, floor_ms, hbm_mb, pcie_mb, hit_rate, overlap, kernels_per_step;
    double select_ms, fetch_ms, rebuild_ms, attention_ms, prefill_ms;
    int64_t device_bytes, host_bytes;
    long needle_hits, needle_total;
    uint64_t digest;
} drow;

typedef struct {
    int steps, warmup;
    double drift, hbm_gbs, pcie_gbs;
    double mass;     /* --select-mass */
    int min_chunks;  /* --select-min */
    int candidates;  /* --select-candidates (rescore); 0: 4 S */
} dopts;

/* The step's bytes from device memory (hbm_mb) and, for host placement, over PCIe (the missed
   values, pcie_mb). n_gen: mean generated tokens over the timed steps; misses: per step. */
static void traffic_of(drow *row, const skv_config *cfg, int32_t n_cand, int32_t n_local, double n_gen, double misses)
{
    const double B = row->B, Hk = cfg->n_kv_heads, D = cfg->head_dim, c = cfg->chunk_size, r = cfg->rank;
    const double S = row->sel_mean, O = row->variant == SV_DENSE ? 0 : cfg->n_outlier_chunks, Hq = cfg->n_q_heads;
    const double W = cfg->select_candidates < n_cand ? cfg->select_candidates : n_cand; /* rescored: U rows of W */
    /* a selected chunk's values: one record of the value store (bf16 c D, or fp8 c D + c exponents, padded) */
    const double rec = (double)skv_value_chunk_bytes(cfg->value_dtype, cfg->chunk_size, cfg->head_dim);
    const double lm = B * Hk * n_cand * D * 2, urows = B * Hk * (S + W) * c * r * 2, vals = B * Hk * S * rec;
    const double res = B * Hk * (O * c + n_local + n_gen + 1) * D * 2 * 2, qo = B * Hq * D * 6;
    const double missed = row->placement == PL_HOST ? misses * rec : 0;
    row->hbm_mb = (lm + urows + res + qo + vals - missed) / 1e6;
    row->pcie_mb = missed / 1e6;
}

static void run_cache(skv_backend be, const skvs_workload *wl, skvs_seq *seq, int64_t ctx, int B, int placement,
                      int reproducible, int variant, int value_dtype, const dopts *o, const int *want_wl, drow *rows,
                      int *n_rows)
{
    skv_config cfg = wl->cfg;
    cfg.reproducible = reproducible;
    cfg.value_dtype = (skv_value_dtype)value_dtype;
    const int per_wl = o->warmup + o->steps;
    cfg.batch_size = B;
    cfg.gen_capacity = N_WL * per_wl;
    cfg.backend = be;
    if (variant == SV_MASS) {
        cfg.select_mode = SKV_SELECT_MASS;
        cfg.select_mass = (float)o->mass;
        cfg.select_min_chunks = o->min_chunks;
    } else if (variant == SV_ALL) {
        cfg.budget = SKV_BUDGET_ALL;
    } else if (variant == SV_DENSE) {
        cfg.dense_layers = 1;
    } else if (variant == SV_RESCORE) {
        cfg.select_candidates = o->candidates ? o->candidates : 4 * (cfg.budget / cfg.chunk_size);
    }
    const int dense = variant == SV_DENSE;
    const int Hq = cfg.n_q_heads, Hk = cfg.n_kv_heads, D = cfg.head_dim;
    skv_memory_info mi;
    skv_status st;
    if ((st = skv_cache_memory_info(&cfg, &mi))) ddie("skv_cache_memory_info", st, NULL);
    if (placement == PL_HOST) cfg.value_device_bytes = (int64_t)(mi.host_value_slots + mi.device_value_slots) *
                                                       (int64_t)mi.value_cache_bytes;
    if ((st = skv_cache_memory_info(&cfg, &mi))) ddie("skv_cache_memory_info", st, NULL);
    fprintf(stderr, "skv-bench decode: ctx %lld batch %d %s%s, select %s: %.2f GB device, %.2f GB host\n",
            (long long)ctx, B, pl_name[placement], reproducible ? " reproducible" : "", sv_name[variant],
            mi.device_bytes / 1e9, mi.host_bytes / 1e9);
    skv_cache *cache = NULL;
    double t0 = dnow_ms();
    if ((st = skv_cache_create(&cfg, &cache))) ddie("skv_cache_create", st, NULL);
    const double create_ms = dnow_ms() - t0;
    size_t pb = (size_t)ctx * Hk * D * sizeof(skv_bf16);
    skv_bf16 *dk = skvt_dbuf(be, seq->k_pre, pb), *dv = skvt_dbuf(be, seq->v, pb);
    skvt_dput(be, dk, seq->k_pre, pb);
    skvt_dput(be, dv, seq->v, pb);
    double pf[4096];
    for (int b = 0; b < B; b++) {
        t0 = dnow_ms();
        if ((st = skv_prefill(cache, 0, b, ctx, dk, dv, NULL))) ddie("skv_prefill", st, cache);
        pf[b < 4096 ? b : 4095] = dnow_ms() - t0;
    }
    if ((st = skv_cache_sync(cache))) ddie("skv_cache_sync", st, cache);
    qsort(pf, (size_t)(B < 4096 ? B : 4096), sizeof *pf, dcmp);
    fprintf(stderr, "skv-bench decode: created in %.0f ms, prefill %.1f ms per sequence (median)\n", create_ms,
            pf[B / 2 < 4096 ? B / 2 : 4095]);
    skvt_dfree(be, dk, seq->k_pre);
    skvt_dfree(be, dv, seq->v);
    skv_seq_info info;
    if ((st = skv_cache_seq_info(cache, 0, 0, &info))) ddie("seq_info", st, cache);
    const int S = dense ? 0 : info.n_selected; /* the selection rows' stride (budget / c, or N - O for all) */

    const size_t qn = (size_t)B * Hq * D, kn = (size_t)B * Hk * D;
    skv_bf16 *q = malloc(qn * 2), *k = malloc(kn * 2), *v = malloc(kn * 2);
    float *qf = malloc(qn * sizeof(float)), *out = malloc(qn * 4);
    const int n_ov = B < MAX_OVERLAP_SEQS ? B : MAX_OVERLAP_SEQS;
    int32_t *prev = malloc(sizeof(int32_t) * ((size_t)n_ov * Hk * S + 1)), *cur = malloc(sizeof(int32_t) * ((size_t)S + 1));
    int32_t *prev_k = calloc((size_t)n_ov * Hk + 1, sizeof(int32_t));
    skv_bf16 *dq = skvt_dbuf(be, q, qn * 2), *dkn = skvt_dbuf(be, k, kn * 2), *dvn = skvt_dbuf(be, v, kn * 2);
    float *dout = skvt_dbuf(be, out, qn * 4);
    double *t = malloc(sizeof(double) * (size_t)o->steps);
#ifdef SKV_HAVE_CUDA
    cudaEvent_t ev[2];
    if (be == SKV_BACKEND_CUDA && (cudaEventCreate(&ev[0]) != cudaSuccess || cudaEventCreate(&ev[1]) != cudaSuccess))
        ddie("cudaEventCreate", SKV_ERR_DEVICE, NULL);
#endif
    int step = 0; /* position in the cache's generated region (both workloads) */
    for (int w = 0; w < N_WL; w++) {
        if (!want_wl[w]) {
            step += per_wl;
            continue;
        }
        drow *row = &rows[(*n_rows)++];
        memset(row, 0, sizeof *row);
        row->ctx = ctx, row->B = B, row->placement = placement, row->workload = w, row->reproducible = reproducible;
        row->value_dtype = value_dtype;
        row->variant = variant;
        skv_layer_stats l0, l1;
        row->device_bytes = (int64_t)mi.device_bytes, row->host_bytes = (int64_t)mi.host_bytes;
        row->prefill_ms = pf[B / 2 < 4096 ? B / 2 : 4095];
        row->digest = 14695981039346656037ULL;
        skv_stats s0, s1;
        double ov_sum = 0;
        long ov_n = 0;
        for (int i = 0; i < per_wl; i++, step++) {
            int32_t needle = -1, other;
            for (int b = 0; b < B; b++) { /* one random stream per sequence */
                skv_bf16 *qb = q + (size_t)b * Hq * D;
                if ((st = skvs_step_stream(seq, step, (uint64_t)b + 1, qb, k + (size_t)b * Hk * D,
                                           v + (size_t)b * Hk * D, b ? &other : &needle)))
                    ddie("workload step", st, NULL);
                float *qfb = qf + (size_t)b * Hq * D;
                if (w == WL_DRIFT && i > 0) {
                    const double a = o->drift, f = sqrt(1 - a * a);
                    for (size_t e = 0; e < (size_t)Hq * D; e++)
                        qfb[e] = (float)(a * qfb[e] + f * skv_bf16_to_float(qb[e]));
                } else {
                    for (size_t e = 0; e < (size_t)Hq * D; e++) qfb[e] = skv_bf16_to_float(qb[e]);
                }
                for (size_t e = 0; e < (size_t)Hq * D; e++) qb[e] = skv_bf16_from_float(qfb[e]);
            }
            skvt_dput(be, dq, q, qn * 2);
            skvt_dput(be, dkn, k, kn * 2);
            skvt_dput(be, dvn, v, kn * 2);
            if (i == o->warmup && ((st = skv_cache_stats(cache, &s0)) || (st = skv_cache_layer_stats(cache, 0, &l0))))
                ddie("stats", st, cache);
            double ms = 0;
#ifdef SKV_HAVE_CUDA
            if (be == SKV_BACKEND_CUDA) {
                float f = 0;
                cudaEventRecord(ev[0], 0);
                if ((st = skv_decode(cache, 0, dq, dkn, dvn, dout))) ddie("skv_decode", st, cache);
                cudaEventRecord(ev[1], 0);
                cudaEventSynchronize(ev[1]);
                cudaEventElapsedTime(&f, ev[0], ev[1]);
                ms = f;
                if ((st = skv_cache_sync(cache))) ddie("skv_cache_sync", st, cache);
            } else
#endif
            {
                double h0 = dnow_ms();
                if ((st = skv_decode(cache, 0, dq, dkn, dvn, dout))) ddie("skv_decode", st, cache);
                if ((st = skv_cache_sync(cache))) ddie("skv_cache_sync", st, cache);
                ms = dnow_ms() - h0;
            }
            if (i >= o->warmup) t[i - o->warmup] = ms;
            skvt_dget(be, out, dout, qn * 4);
            row->digest = fnv1a(row->digest, out, qn * 4);
            for (int b = 0; b < n_ov && !dense; b++) /* a dense layer has no selection */
                for (int h = 0; h < Hk; h++) {
                    int32_t *pv = prev + ((size_t)b * Hk + h) * S, kc = 0, *pk = prev_k + (size_t)b * Hk + h;
                    if ((st = skv_cache_selected(cache, 0, b, h, cur))) ddie("skv_cache_selected", st, cache);
                    if ((st = skv_cache_selected_count(cache, 0, b, h, &kc))) ddie("skv_cache_selected_count", st, cache);
                    row->digest = fnv1a(row->digest, cur, sizeof(int32_t) * (size_t)S);
                    if (i > 0) { /* both lists increase: a merge counts the common chunks */
                        int x = 0, y = 0, common = 0;
                        while (x < kc && y < *pk) {
                            if (cur[x] == pv[y]) common++, x++, y++;
                            else if (cur[x] < pv[y]) x++;
                            else y++;
                        }
                        if (i > o->warmup) ov_sum += (double)common / kc, ov_n++;
                    }
                    if (i >= o->warmup && b == 0)
                        for (int j = 0; j < kc; j++) row->needle_hits += cur[j] == needle;
                    if (i >= o->warmup && b == 0) row->needle_total++;
                    memcpy(pv, cur, sizeof(int32_t) * (size_t)S);
                    *pk = kc;
                }
        }
        if ((st = skv_cache_stats(cache, &s1)) || (st = skv_cache_layer_stats(cache, 0, &l1))) ddie("stats", st, cache);
        {
            const double hs = (double)(l1.head_steps - l0.head_steps), ctx_t = (double)(l1.context_tokens - l0.context_tokens);
            row->sel_mean = hs > 0 ? (double)(l1.selected_chunks - l0.selected_chunks) / hs : 0;
            row->attended_share = ctx_t > 0 ? (double)(l1.attended_tokens - l0.attended_tokens) / ctx_t : 0;
        }
        qsort(t, (size_t)o->steps, sizeof *t, dcmp);
        row->step_ms = t[o->steps / 2];
        row->step_min_ms = t[0];
        row->overlap = ov_n ? ov_sum / ov_n : 0;
        const double lookups = (double)(s1.value_cache_hits - s0.value_cache_hits) +
                               (double)(s1.value_cache_misses - s0.value_cache_misses);
        const double misses = (double)(s1.value_cache_misses - s0.value_cache_misses) / o->steps;
        row->hit_rate = lookups > 0 ? (double)(s1.value_cache_hits - s0.value_cache_hits) / lookups : 0;
        const double calls = (double)(s1.n_decode_calls - s0.n_decode_calls);
        row->kernels_per_step = calls > 0 ? (double)(s1.decode_launches - s0.decode_launches) / calls : 0;
        row->select_ms = (s1.decode_select_ms - s0.decode_select_ms) / o->steps;
        row->fetch_ms = (s1.decode_fetch_ms - s0.decode_fetch_ms) / o->steps;
        row->attention_ms = (s1.decode_attention_ms - s0.decode_attention_ms) / o->steps;
        row->rebuild_ms = (s1.decode_rebuild_ms - s0.decode_rebuild_ms) / o->steps;
        traffic_of(row, &cfg, info.n_candidates, info.n_local, step - o->steps / 2.0, misses);
        const double f_hbm = row->hbm_mb * 1e6 / (o->hbm_gbs * 1e9) * 1e3,
                     f_pcie = row->pcie_mb * 1e6 / (o->pcie_gbs * 1e9) * 1e3;
        row->floor_ms = f_hbm > f_pcie ? f_hbm : f_pcie;
        fprintf(stderr,
                "skv-bench decode: %s ctx %lld batch %d %s %s%s %s select %s: %.4f ms/step (floor %.4f, x%.2f), overlap %.2f, "
                "hit rate %.2f, %.1f kernels/step, %.1f chunks per head, attended %.4f of the context\n",
                skv_backend_name(be), (long long)ctx, B, pl_name[placement], wl_name[w],
                reproducible ? " reproducible" : "", value_dtype ? "fp8" : "bf16", sv_name[variant], row->step_ms, row->floor_ms,
                row->step_ms / row->floor_ms, row->overlap, row->hit_rate, row->kernels_per_step, row->sel_mean,
                row->attended_share);
    }
#ifdef SKV_HAVE_CUDA
    if (be == SKV_BACKEND_CUDA) cudaEventDestroy(ev[0]), cudaEventDestroy(ev[1]);
#endif
    skvt_dfree(be, dq, q);
    skvt_dfree(be, dkn, k);
    skvt_dfree(be, dvn, v);
    skvt_dfree(be, dout, out);
    free(q), free(k), free(v), free(qf), free(out), free(prev), free(cur), free(prev_k), free(t);
    skv_cache_free(cache);
}

int bench_decode_main(int argc, char **argv)
{
    int64_t ctxs[MAXV] = {32768, 131072, 1048576}, batches[MAXV] = {1, 8, 32};
    int n_ctx = 3, n_b = 3, json = 0, big_batch = 1, both_modes = 0;
    int want_pl[N_PL] = {1, 1}, want_wl[N_WL] = {1, 1};
    dopts o = {30, 5, 0.92, 4200, 55, 0.95, 0, 0};
    int want_sv[N_SV] = {1, 0, 0, 0, 0};
    int want_vd[2] = {1, 0}; /* --value-dtype: bf16, fp8 */
    skv_backend be = SKV_BACKEND_AUTO;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--reproducible")) both_modes = 1;
        else if (!strcmp(a, "--ctx")) n_ctx = parse_list(v, ctxs), i++;
        else if (!strcmp(a, "--batch")) n_b = parse_list(v, batches), i++;
        else if (!strcmp(a, "--steps")) o.steps = atoi(v), i++;
        else if (!strcmp(a, "--warmup")) o.warmup = atoi(v), i++;
        else if (!strcmp(a, "--drift")) o.drift = atof(v), i++;
        else if (!strcmp(a, "--big-batch")) big_batch = atoi(v), i++;
        else if (!strcmp(a, "--hbm-gbs")) o.hbm_gbs = atof(v), i++;
        else if (!strcmp(a, "--pcie-gbs")) o.pcie_gbs = atof(v), i++;
        else if (!strcmp(a, "--select-mass")) o.mass = atof(v), i++;
        else if (!strcmp(a, "--select-min")) o.min_chunks = atoi(v), i++;
        else if (!strcmp(a, "--select-candidates")) o.candidates = atoi(v), i++;
        else if (!strcmp(a, "--value-dtype")) {
            want_vd[0] = strstr(v, "bf16") != NULL, want_vd[1] = strstr(v, "fp8") != NULL;
            i++;
        }
        else if (!strcmp(a, "--select")) {
            for (int x = 0; x < N_SV; x++) want_sv[x] = strstr(v, sv_name[x]) != NULL;
            i++;
        }
        else if (!strcmp(a, "--placement") || !strcmp(a, "--workload")) {
            int pl = !strcmp(a, "--placement");
            int *want = pl ? want_pl : want_wl;
            want[0] = want[1] = 0;
            want[0] = strstr(v, pl ? "device" : "fresh") != NULL;
            want[1] = strstr(v, pl ? "host" : "drift") != NULL;
            i++;
        } else if (!strcmp(a, "--backend")) {
            if (skv_backend_parse(v, &be)) ddie("--backend", SKV_ERR_INVALID_ARGUMENT, NULL);
            i++;
        } else {
            if (strcmp(a, "--help")) fprintf(stderr, "skv-bench decode: unknown option '%s'\n", a);
            printf("usage: skv-bench decode [--backend auto|ref|cpu|cuda] [--ctx 32768,131072,1048576] "
                   "[--batch 1,8,32] [--placement device,host] [--workload fresh,drift] [--steps 30] [--warmup 5] "
                   "[--drift 0.92] [--big-batch 1] [--hbm-gbs 4200] [--pcie-gbs 55] [--reproducible] "
                   "[--select fixed,mass,all,dense,rescore] [--select-mass 0.95] [--select-min 0]\n"
                   "[--select-candidates 0] [--value-dtype bf16,fp8] [--json]\n"
                   "  --reproducible  also run each cache with config.reproducible = 1 and print both modes\n"
                   "  --select        the layer's selection, one cache each: the fixed budget (default), SKV_SELECT_MASS\n"
                   "                  (target --select-mass, floor --select-min, the budget its cap), SKV_BUDGET_ALL,\n"
                   "                  a dense layer (config.dense_layers; device placement only), or the fixed budget\n"
                   "                  among rescored candidates (select_candidates = --select-candidates, 0: 4 S)\n"
                   "  --value-dtype   the value stores' format, one cache each: bf16 (default), fp8 (config.value_dtype)\n");
            return strcmp(a, "--help") ? 2 : 0;
        }
    }
    if (o.steps < 1 || o.warmup < 1 || n_ctx < 1 || n_b < 1 || !(o.drift >= 0 && o.drift < 1) ||
        !(want_pl[0] || want_pl[1]) || !(want_wl[0] || want_wl[1]) ||
        !(want_sv[0] || want_sv[1] || want_sv[2] || want_sv[3]) || !(o.mass > 0 && o.mass <= 1) ||
        !(want_vd[0] || want_vd[1])) {
        fprintf(stderr, "skv-bench decode: --steps >= 1, --warmup >= 1, 0 <= --drift < 1, non-empty lists\n");
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

    static drow rows[MAXV * MAXV * N_PL * N_WL * 2 * N_SV * 2];
    int n = 0;
    const int total = N_WL * (o.warmup + o.steps);
    for (int i = 0; i < n_ctx; i++) {
        const int64_t ctx = ctxs[i];
        skv_config cfg = skv_config_default();
        cfg.n_layers = 1;
        cfg.max_prompt_len = ctx;
        skvs_workload wl;
        skvs_seq seq;
        if ((st = skvs_workload_init(&wl, &cfg, ctx + total, SKV_BACKEND_CPU))) ddie("workload", st, NULL);
        double t0 = dnow_ms();
        if ((st = skvs_seq_generate(&seq, &wl, ctx, total, 0, 20251201 + (uint64_t)ctx))) ddie("workload", st, NULL);
        fprintf(stderr, "skv-bench decode: generated a %lld-token prompt in %.1f s\n", (long long)ctx,
                (dnow_ms() - t0) / 1e3);
        for (int j = 0; j < n_b; j++) {
            if (ctx > 131072 && batches[j] > big_batch) continue;
            for (int x = 0; x < N_SV; x++)
                for (int p = 0; p < N_PL; p++)
                    for (int m = 0; m <= both_modes; m++)
                        for (int vd = 0; vd < 2; vd++)
                            if (want_vd[vd] && want_sv[x] && want_pl[p] && !(x == SV_DENSE && p == PL_HOST))
                                run_cache(be, &wl, &seq, ctx, (int)batches[j], p, m, x, vd, &o, want_wl, rows, &n);
        }
        skvs_seq_free(&seq);
        skvs_workload_free(&wl);
    }
    if (json) {
        printf("{\"backend\": \"%s\", \"layers\": 1, \"shape\": {\"hq\": 32, \"hk\": 8, \"dim\": 128, \"rank\": 160, "
               "\"chunk\": 8, \"budget\": 2048, \"outlier_chunks\": 48, \"local_chunks\": 4},\n"
               " \"steps\": %d, \"warmup\": %d, \"drift\": %.3f, \"hbm_gbs\": %.0f, \"pcie_gbs\": %.0f,\n"
               " \"note\": \"step_ms: median over steps of one skv_decode (cuda: CUDA events around it on the cache's "
               "stream; ref/cpu: host clock around skv_decode + skv_cache_sync); floor_ms: device placement, the "
               "bytes a step must read from device memory (hbm_mb) over hbm_gbs; host placement, the larger of that "
               "and the missed values (pcie_mb) over pcie_gbs; overlap: mean share of a head's selected chunks "
               "selected at the previous step too; hit_rate: chunk-cache hits per lookup (host placement); digest: FNV-1a of every step's output and "
               "selections\",\n"
               " \"rows\": [",
               skv_backend_name(be), o.steps, o.warmup, o.drift, o.hbm_gbs, o.pcie_gbs);
        for (int i = 0; i < n; i++) {
            const drow *r = &rows[i];
            printf("%s\n  {\"ctx\": %lld, \"batch\": %d, \"placement\": \"%s\", \"workload\": \"%s\", "
                   "\"mode\": \"%s\", \"value_dtype\": \"%s\", \"select\": \"%s\", \"select_mass\": %.4f, \"chunks_per_head\": %.2f, "
                   "\"attended_share\": %.5f, \"step_ms\": %.4f, "
                   "\"step_min_ms\": %.4f, \"floor_ms\": %.4f, \"step_over_floor\": %.3f, \"hbm_mb\": %.2f, "
                   "\"pcie_mb\": %.2f, \"hit_rate\": %.4f, \"overlap\": %.4f, \"kernels_per_step\": %.2f, "
                   "\"select_ms\": %.4f, \"fetch_ms\": %.4f, \"rebuild_ms\": %.4f, \"attention_ms\": %.4f, "
                   "\"prefill_ms_per_sequence\": "
                   "%.2f, \"device_bytes\": %lld, \"host_bytes\": %lld, \"needle_hits\": %ld, \"needle_heads\": %ld, "
                   "\"digest\": \"%016llx\"}",
                   i ? "," : "", (long long)r->ctx, r->B, pl_name[r->placement], wl_name[r->workload],
                   r->reproducible ? "reproducible" : "default", r->value_dtype ? "fp8" : "bf16", sv_name[r->variant],
                   r->variant == SV_MASS ? o.mass : 0.0, r->sel_mean, r->attended_share, r->step_ms, r->step_min_ms, r->floor_ms, r->step_ms / r->floor_ms, r->hbm_mb, r->pcie_mb, r->hit_rate,
                   r->overlap, r->kernels_per_step, r->select_ms, r->fetch_ms, r->rebuild_ms, r->attention_ms, r->prefill_ms,
                   (long long)r->device_bytes, (long long)r->host_bytes, r->needle_hits, r->needle_total,
                   (unsigned long long)r->digest);
        }
        printf("]}\n");
    } else {
        printf("%-6s %8s %6s %-7s %-6s %-5s %-6s %8s %8s %10s %10s %8s %8s %8s %8s %9s\n", "backend", "ctx", "batch",
               "place", "load", "mode", "select", "chunks", "share", "step_ms", "floor_ms", "x_floor", "overlap", "hit",
               "kernels", "x_default");
        for (int i = 0; i < n; i++) {
            const drow *r = &rows[i];
            /* the default-mode row of the same (ctx, batch, placement, workload), if any */
            const drow *d = NULL;
            for (int j = 0; j < n && r->reproducible; j++)
                if (!rows[j].reproducible && rows[j].ctx == r->ctx && rows[j].B == r->B &&
                    rows[j].placement == r->placement && rows[j].workload == r->workload &&
                    rows[j].variant == r->variant)
                    d = &rows[j];
            printf("%-6s %8lld %6d %-7s %-6s %-5s %-6s %8.1f %8.4f %10.4f %10.4f %8.2f %8.2f %8.2f %8.1f",
                   skv_backend_name(be), (long long)r->ctx, r->B, pl_name[r->placement], wl_name[r->workload],
                   r->reproducible ? "repro" : "dflt", sv_name[r->variant], r->sel_mean, r->attended_share, r->step_ms,
                   r->floor_ms, r->step_ms / r->floor_ms, r->overlap, r->hit_rate, r->kernels_per_step);
            if (d) printf(" %9.3f\n", r->step_ms / d->step_ms);
            else printf(" %9s\n", "-");
        }
    }
    return 0;
}
