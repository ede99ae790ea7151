/*
 * demo.c - the project's main job: ShadowKV decoding of a batch of long
 * prompts on a synthetic Llama-shaped workload (examples/synth.h), with
 * end-to-end timings, the library's phase split, memory, and accuracy against
 * dense attention and a per-token oracle.
 *
 *   build/demo [--layers 4] [--hq 32] [--hk 8] [--dim 128] [--rank 160]
 *              [--ctx 16384,24576] [--steps 64] [--budget 2048]
 *              [--backend ref|cpu|cuda|auto] [--seed 42] [--acc-layers 1] [--share-layers]
 *              [--value-dtype bf16|fp8] [--json]
 *
 * Tensors go to the library in the memory its backend takes (device buffers
 * for cuda, through skv_buffer_alloc/skv_buffer_copy). A decode step runs
 * every layer, then skv_cache_sync: the step time includes the device work.
 * --share-layers generates the prompts and step inputs of layer 0 only and
 * feeds them to every layer (each layer still has its own factorization,
 * store and selection): full-depth runs without hours of workload generation.
 *
 * Timings cover library calls only (skv_prefill, skv_decode); generating the
 * workload and computing the references are not timed. Accuracy is measured
 * on the first --acc-layers layers at every step, after the decode loop (the
 * references' BLAS threads would otherwise compete with the library's).
 * Exit status: 0, 1 on any library error (status and message printed), 2 on
 * bad options.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "shadowkv.h"
#include "synth.h"

#define MAX_BATCH 64

typedef struct opts {
    skv_config cfg;
    int64_t ctx[MAX_BATCH];
    int steps, acc_layers, json, share;
    uint64_t seed;
} opts;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: demo [options]\n"
            "  --layers N         layers (default 4)\n"
            "  --hq N, --hk N     query / KV heads (default 32 / 8)\n"
            "  --dim N            head dim (default 128)\n"
            "  --rank N           key factorization rank (default 160)\n"
            "  --ctx A,B,...      prompt length of each sequence; the list is the batch\n"
            "                     (default 16384,24576)\n"
            "  --steps N          decode steps (default 64)\n"
            "  --budget N         selected tokens per KV head (default 2048)\n"
            "  --backend NAME     ref | cpu | cuda | auto (default auto; env SKV_BACKEND picks for auto)\n"
            "  --seed N           workload seed (default 42)\n"
            "  --acc-layers N     layers whose accuracy is measured at every step (default 1)\n"
            "  --share-layers     every layer gets layer 0's prompts and step inputs\n"
            "  --value-dtype T    bf16 (default) or fp8: the value stores' format (config.value_dtype)\n"
            "  --json             print one JSON object instead of the table\n"
            "  --help             this text\n");
}

static void die(const char *what, skv_status st, skv_cache *cache)
{
    fprintf(stderr, "demo: %s failed: %s\n", what, skv_status_string(st));
    const char *msg = cache ? skv_cache_last_error(cache) : skv_last_error();
    if (msg && *msg) fprintf(stderr, "demo: %s\n", msg);
    exit(1);
}

static long parse_int(const char *flag, const char *s, long lo, long hi)
{
    char *end;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || *end || v < lo || v > hi) {
        fprintf(stderr, "demo: %s needs an integer in [%ld, %ld], got '%s'\n", flag, lo, hi, s ? s : "");
        exit(2);
    }
    return v;
}

static void parse(int argc, char **argv, opts *o)
{
    skv_config *c = &o->cfg;
    *c = skv_config_default();
    c->n_layers = 4;
    c->batch_size = 2;
    o->ctx[0] = 16384;
    o->ctx[1] = 24576;
    o->steps = 64;
    o->acc_layers = 1;
    o->seed = 42;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            exit(0);
        } else if (!strcmp(a, "--json")) {
            o->json = 1;
            continue;
        } else if (!strcmp(a, "--share-layers")) {
            o->share = 1;
            continue;
        } else if (!strcmp(a, "--layers")) c->n_layers = (int32_t)parse_int(a, v, 1, 1024);
        else if (!strcmp(a, "--hq")) c->n_q_heads = (int32_t)parse_int(a, v, 1, 1024);
        else if (!strcmp(a, "--hk")) c->n_kv_heads = (int32_t)parse_int(a, v, 1, 1024);
        else if (!strcmp(a, "--dim")) c->head_dim = (int32_t)parse_int(a, v, 2, 1024);
        else if (!strcmp(a, "--rank")) c->rank = (int32_t)parse_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--steps")) o->steps = (int)parse_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--budget")) c->budget = (int32_t)parse_int(a, v, 1, 1 << 24);
        else if (!strcmp(a, "--acc-layers")) o->acc_layers = (int)parse_int(a, v, 0, 1024);
        else if (!strcmp(a, "--seed")) o->seed = (uint64_t)parse_int(a, v, 0, 0x7fffffffL);
        else if (!strcmp(a, "--value-dtype")) {
            if (!v || (strcmp(v, "bf16") && strcmp(v, "fp8"))) {
                fprintf(stderr, "demo: --value-dtype needs bf16 or fp8, got '%s'\n", v ? v : "");
                exit(2);
            }
            c->value_dtype = strcmp(v, "fp8") ? SKV_VALUE_BF16 : SKV_VALUE_FP8;
        } else if (!strcmp(a, "--backend")) {
            if (!v || skv_backend_parse(v, &c->backend) != SKV_OK) {
                fprintf(stderr, "demo: --backend needs ref, cpu, cuda or auto, got '%s'\n", v ? v : "");
                exit(2);
            }
        } else if (!strcmp(a, "--ctx")) {
            char *buf = v ? strdup(v) : NULL, *save = NULL;
            int b = 0;
            for (char *tok = buf ? strtok_r(buf, ",", &save) : NULL; tok; tok = strtok_r(NULL, ",", &save)) {
                if (b == MAX_BATCH) parse_int("--ctx (too many sequences)", "", 0, 0);
                o->ctx[b++] = parse_int(a, tok, 1, 1L << 40);
            }
            free(buf);
            if (!b) parse_int(a, v, 1, 1L << 40);
            c->batch_size = b;
        } else {
            fprintf(stderr, "demo: unknown option '%s'\n", a);
            usage(stderr);
            exit(2);
        }
        i++;
    }
    c->max_prompt_len = 0;
    for (int b = 0; b < c->batch_size; b++) c->max_prompt_len = o->ctx[b] > c->max_prompt_len ? o->ctx[b] : c->max_prompt_len;
    c->gen_capacity = o->steps;
    if (o->acc_layers > c->n_layers) o->acc_layers = c->n_layers;
    if (o->share && o->acc_layers > 1) o->acc_layers = 1; /* the other layers see the same data */
}

/*
 * Tensors in the memory the cache's backend takes: for cuda a zeroed device buffer, for
 * ref/cpu the host array itself (no copy). dput/dget copy only when the two differ; dfree
 * frees only a device buffer. A failure ends the demo (exit 1).
 */
static void *dbuf(skv_backend be, void *host, size_t bytes)
{
    if (be != SKV_BACKEND_CUDA) return host;
    void *d = NULL;
    skv_status st = skv_buffer_alloc(be, bytes ? bytes : 1, &d);
    if (st) die("skv_buffer_alloc", st, NULL);
    return d;
}

static void dput(skv_backend be, void *dev, const void *host, size_t bytes)
{
    skv_status st = dev == host || !bytes ? SKV_OK : skv_buffer_copy(be, dev, host, bytes);
    if (st) die("skv_buffer_copy to the device", st, NULL);
}

static void dget(skv_backend be, void *host, const void *dev, size_t bytes)
{
    skv_status st = dev == host || !bytes ? SKV_OK : skv_buffer_copy(be, host, dev, bytes);
    if (st) die("skv_buffer_copy to the host", st, NULL);
}

static void dfree(skv_backend be, void *dev, void *host)
{
    if (dev != host) skv_buffer_free(be, dev);
}

static int contains(const int32_t *ids, int n, int32_t x)
{
    for (int i = 0; i < n; i++)
        if (ids[i] == x) return 1;
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double mib(size_t b) { return (double)b / (1024.0 * 1024.0); }

int main(int argc, char **argv)
{
    opts o;
    memset(&o, 0, sizeof o);
    parse(argc, argv, &o);
    skv_config *cfg = &o.cfg;
    const int L = cfg->n_layers, B = cfg->batch_size, Hq = cfg->n_q_heads, Hk = cfg->n_kv_heads;
    const int D = cfg->head_dim, S = cfg->budget / (cfg->chunk_size > 0 ? cfg->chunk_size : 1);
    const skv_backend requested = cfg->backend;

    skv_status st = skv_config_validate(cfg);
    if (st) die("config", st, NULL);
    size_t dev_bytes = 0, host_bytes = 0, full_kv = 0;
    if ((st = skv_cache_memory(cfg, &dev_bytes, &host_bytes))) die("skv_cache_memory", st, NULL);
    for (int b = 0; b < B; b++) full_kv += (size_t)o.ctx[b] * L * Hk * D * 2 * sizeof(skv_bf16);
    skv_cache *cache = NULL;
    if ((st = skv_cache_create(cfg, &cache))) die("skv_cache_create", st, NULL);
    const skv_backend be = skv_cache_backend(cache);
    fprintf(stderr, "demo: backend %s (requested %s)\n", skv_backend_name(be), skv_backend_name(requested));

    /* host tensors go to the library through buffers of its backend's kind */
    const skv_backend host_be = be == SKV_BACKEND_CUDA ? SKV_BACKEND_CPU : be; /* ropes generated keys */
    skvs_workload wl;
    int64_t max_pos = cfg->max_prompt_len + o.steps;
    if ((st = skvs_workload_init(&wl, cfg, max_pos, host_be))) die("workload", st, NULL);
    const int LG = o.share ? 1 : L; /* layers with their own workload */
    skvs_seq *seq = calloc((size_t)LG * B, sizeof *seq);
    if (!seq) die("allocation", SKV_ERR_OUT_OF_MEMORY, NULL);
    double prefill_ms = 0, gen_ms = 0, t_start = now_ms(), t_gen = now_ms();
    const size_t row = (size_t)Hk * D;
    for (int lg = 0; lg < LG; lg++)
        for (int b = 0; b < B; b++) {
            skvs_seq *s = &seq[lg * B + b];
            if ((st = skvs_seq_generate(s, &wl, o.ctx[b], o.steps, lg < o.acc_layers,
                                        o.seed * 1000003u + (uint64_t)(lg * B + b))))
                die("workload generation", st, NULL);
            size_t pb = (size_t)o.ctx[b] * row * sizeof(skv_bf16);
            skv_bf16 *dk = dbuf(be, s->k_pre, pb), *dv = dbuf(be, s->v, pb);
            dput(be, dk, s->k_pre, pb);
            dput(be, dv, s->v, pb);
            gen_ms += now_ms() - t_gen;
            for (int l = o.share ? 0 : lg; l < (o.share ? L : lg + 1); l++) {
                double t0 = now_ms();
                if ((st = skv_prefill(cache, l, b, o.ctx[b], dk, dv, NULL))) die("skv_prefill", st, cache);
                double dt = now_ms() - t0;
                prefill_ms += dt;
                fprintf(stderr, "demo: prefill layer %d/%d seq %d/%d (%lld tokens): %.1f ms\n", l + 1, L, b + 1, B,
                        (long long)o.ctx[b], dt);
            }
            t_gen = now_ms();
            dfree(be, dk, s->k_pre);
            dfree(be, dv, s->v);
            if ((st = skvs_seq_attach(s, cache, lg, b))) die("outlier read-back", st, cache);
            if ((st = skvs_seq_release(s))) die("workload", st, NULL);
        }
    /* cuda runs the factorization and the value offload beside the caller's stream: the
       prefill is done when they are, so the wait for them counts */
    skv_stats pst;
    {
        double t0 = now_ms();
        if ((st = skv_cache_stats(cache, &pst))) die("skv_cache_stats", st, cache);
        prefill_ms += now_ms() - t0;
    }
    const double n_pf = pst.n_prefill_calls ? (double)pst.n_prefill_calls : 1.0;

    /* decode; for the accuracy layers, queries, selections and outputs are
       kept and the references computed after the timed loop, so that their
       BLAS threads do not compete with the library's */
    const size_t HD = (size_t)Hq * D, n_rec = (size_t)o.acc_layers * B * o.steps;
    const size_t qn = (size_t)B * HD, kn = (size_t)B * Hk * D;
    skv_bf16 *q = malloc(sizeof(skv_bf16) * qn * LG), *k = malloc(sizeof(skv_bf16) * kn * LG);
    skv_bf16 *v = malloc(sizeof(skv_bf16) * kn * LG), *rec_q = malloc(sizeof(skv_bf16) * HD * n_rec + 1);
    float *out = malloc(sizeof(float) * qn * L), *rec_out = malloc(sizeof(float) * HD * n_rec + 1);
    int32_t *sel = malloc(sizeof(int32_t) * Hk * S), *needle = malloc(sizeof(int32_t) * B * LG);
    int32_t *rec_sel = malloc(sizeof(int32_t) * Hk * S * n_rec + 1), *rec_needle = malloc(sizeof(int32_t) * n_rec + 1);
    if (!q || !k || !v || !rec_q || !out || !rec_out || !sel || !needle || !rec_sel || !rec_needle)
        die("allocation", SKV_ERR_OUT_OF_MEMORY, NULL);
    skv_bf16 *dq = dbuf(be, q, sizeof(skv_bf16) * qn * LG), *dk = dbuf(be, k, sizeof(skv_bf16) * kn * LG);
    skv_bf16 *dv = dbuf(be, v, sizeof(skv_bf16) * kn * LG);
    float *dout = dbuf(be, out, sizeof(float) * qn * L);
    double decode_ms = 0, *step_ms = malloc(sizeof(double) * o.steps);
    if (!step_ms) die("allocation", SKV_ERR_OUT_OF_MEMORY, NULL);
    long hits = 0, total = 0;
    for (int step = 0; step < o.steps; step++) {
        double t_step = now_ms();
        for (int lg = 0; lg < LG; lg++)
            for (int b = 0; b < B; b++)
                if ((st = skvs_step(&seq[lg * B + b], q + lg * qn + b * HD, k + lg * kn + b * Hk * D,
                                    v + lg * kn + b * Hk * D, &needle[lg * B + b])))
                    die("workload step", st, NULL);
        dput(be, dq, q, sizeof(skv_bf16) * qn * LG);
        dput(be, dk, k, sizeof(skv_bf16) * kn * LG);
        dput(be, dv, v, sizeof(skv_bf16) * kn * LG);
        double t0 = now_ms();
        gen_ms += t0 - t_step;
        for (int l = 0; l < L; l++) {
            const int lg = o.share ? 0 : l;
            if ((st = skv_decode(cache, l, dq + lg * qn, dk + lg * kn, dv + lg * kn, dout + l * qn)))
                die("skv_decode", st, cache);
        }
        if ((st = skv_cache_sync(cache))) die("skv_cache_sync", st, cache);
        step_ms[step] = now_ms() - t0;
        decode_ms += step_ms[step];
        dget(be, out, dout, sizeof(float) * qn * (size_t)o.acc_layers);
        for (int l = 0; l < L; l++) {
            const int lg = o.share ? 0 : l;
            for (int b = 0; b < B; b++) {
                for (int h = 0; h < Hk; h++) {
                    if ((st = skv_cache_selected(cache, l, b, h, sel + h * S))) die("skv_cache_selected", st, cache);
                    hits += contains(sel + h * S, S, needle[lg * B + b]);
                    total++;
                }
                if (l >= o.acc_layers) continue;
                size_t r = ((size_t)step * o.acc_layers + l) * B + b;
                memcpy(rec_q + r * HD, q + lg * qn + b * HD, sizeof(skv_bf16) * HD);
                memcpy(rec_out + r * HD, out + l * qn + b * HD, sizeof(float) * HD);
                memcpy(rec_sel + r * Hk * S, sel, sizeof(int32_t) * Hk * S);
                rec_needle[r] = needle[lg * B + b];
            }
        }
        if ((step + 1) % 8 == 0 || step + 1 == o.steps)
            fprintf(stderr, "demo: decode step %d/%d: %.2f ms/step so far\n", step + 1, o.steps, decode_ms / (step + 1));
    }
    dfree(be, dq, q);
    dfree(be, dk, k);
    dfree(be, dv, v);
    dfree(be, dout, out);

    double ref_ms = now_ms(), err = 0, err_max = 0, err_or = 0, err_sel = 0, mass = 0, mass_min = 1, needle_share = 0;
    float *full = malloc(sizeof(float) * HD), *orac = malloc(sizeof(float) * HD), *exact = malloc(sizeof(float) * HD);
    if (!full || !orac || !exact) die("allocation", SKV_ERR_OUT_OF_MEMORY, NULL);
    if (n_rec) fprintf(stderr, "demo: accuracy references for %zu (step, layer, sequence) samples\n", n_rec);
    for (size_t r = 0; r < n_rec; r++) {
        const int b = (int)(r % B), l = (int)(r / B % o.acc_layers), step = (int)(r / B / o.acc_layers);
        skvs_ref_stats rs;
        if ((st = skvs_reference(&seq[l * B + b], step + 1, rec_q + r * HD, rec_needle[r], rec_sel + r * Hk * S, full,
                                 orac, exact, &rs)))
            die("reference", st, NULL);
        double e = skvs_rel_err(rec_out + r * HD, full, HD);
        err += e;
        err_max = e > err_max ? e : err_max;
        err_or += skvs_rel_err(orac, full, HD);
        err_sel += skvs_rel_err(exact, full, HD);
        mass += rs.topk_mass;
        mass_min = rs.topk_mass < mass_min ? rs.topk_mass : mass_min;
        needle_share += rs.needle_mass;
    }
    ref_ms = now_ms() - ref_ms;
    const long n_acc = (long)n_rec;
    skv_stats dst;
    if ((st = skv_cache_stats(cache, &dst))) die("skv_cache_stats", st, cache);
    const double wall_s = (now_ms() - t_start) / 1e3, per = 1.0 / o.steps, na = n_acc ? (double)n_acc : 1.0;
    const double dec_step = decode_ms * per, e2e = prefill_ms + decode_ms;
    const double d_sel = (dst.decode_select_ms - pst.decode_select_ms) * per;
    const double d_reb = (dst.decode_rebuild_ms - pst.decode_rebuild_ms) * per;
    const double d_fet = (dst.decode_fetch_ms - pst.decode_fetch_ms) * per;
    const double d_att = (dst.decode_attention_ms - pst.decode_attention_ms) * per;
    qsort(step_ms, (size_t)o.steps, sizeof *step_ms, cmp_double);
    const double dec_median = o.steps % 2 ? step_ms[o.steps / 2] : 0.5 * (step_ms[o.steps / 2 - 1] + step_ms[o.steps / 2]);

    if (o.json) {
        printf("{\"backend\": \"%s\", \"layers\": %d, \"batch\": %d, \"ctx\": [", skv_backend_name(be), L, B);
        for (int b = 0; b < B; b++) printf("%s%lld", b ? ", " : "", (long long)o.ctx[b]);
        printf("], \"share_layers\": %d, \"steps\": %d, \"hq\": %d, \"hk\": %d, \"dim\": %d, \"rank\": %d, \"chunk\": %d, \"budget\": %d, "
               "\"outlier_chunks\": %d, \"local_chunks\": %d, \"value_dtype\": \"%s\", \"seed\": %llu,\n",
               o.share, o.steps, Hq, Hk, D, cfg->rank, cfg->chunk_size, cfg->budget, cfg->n_outlier_chunks,
               cfg->n_local_chunks, cfg->value_dtype == SKV_VALUE_FP8 ? "fp8" : "bf16", (unsigned long long)o.seed);
        printf(" \"prefill_ms\": %.3f, \"decode_ms_per_step\": %.3f, \"decode_ms_median\": %.3f, \"e2e_ms\": %.3f,\n",
               prefill_ms, dec_step, dec_median, e2e);
        printf(" \"device_bytes\": %zu, \"host_bytes\": %zu, \"full_kv_bytes\": %zu,\n", dev_bytes, host_bytes, full_kv);
        printf(" \"accuracy_layers\": %d, \"rel_err_vs_full\": %.6f, \"rel_err_vs_full_max\": %.6f, "
               "\"oracle_rel_err_vs_full\": %.6f, \"selection_exact_keys_rel_err_vs_full\": %.6f, "
               "\"topk_mass\": %.6f, \"topk_mass_min\": %.6f, \"needle_attention_share\": %.6f,\n",
               o.acc_layers, err / na, err_max, err_or / na, err_sel / na, mass / na, mass_min, needle_share / na);
        printf(" \"needle_hits\": %ld, \"needle_total\": %ld,\n", hits, total);
        printf(" \"prefill_split\": {\"factorize_ms\": %.3f, \"rope_ms\": %.3f, \"landmarks_ms\": %.3f, "
               "\"offload_ms\": %.3f, \"critical_ms\": %.3f, \"critical_ms_per_prefill\": %.4f, "
               "\"factorize_ms_per_prefill\": %.4f, \"wait_ms_per_prefill\": %.4f},\n",
               pst.prefill_factorize_ms, pst.prefill_rope_ms, pst.prefill_landmarks_ms, pst.prefill_offload_ms,
               pst.prefill_critical_ms, pst.prefill_critical_ms / n_pf, pst.prefill_factorize_ms / n_pf,
               pst.prefill_wait_ms / n_pf);
        printf(" \"decode_split_unit\": \"ms per decode step (all layers)\",\n");
        printf(" \"decode_split\": {\"select_ms\": %.3f, \"rebuild_ms\": %.3f, \"fetch_ms\": %.3f, "
               "\"attention_ms\": %.3f},\n", d_sel, d_reb, d_fet, d_att);
        printf(" \"decode_heap_allocations\": %lld,\n", (long long)dst.decode_allocations);
        printf(" \"wall_s\": %.1f, \"workload_gen_s\": %.1f, \"reference_s\": %.1f}\n", wall_s, gen_ms / 1e3, ref_ms / 1e3);
    } else {
        printf("libshadowkv demo: backend %s (requested %s)\n", skv_backend_name(be), skv_backend_name(requested));
        printf("shape     layers %d, Hq %d, Hk %d, D %d, rank %d, chunk %d, budget %d, outliers %d, local chunks %d\n",
               L, Hq, Hk, D, cfg->rank, cfg->chunk_size, cfg->budget, cfg->n_outlier_chunks, cfg->n_local_chunks);
        printf("batch     %d sequences (", B);
        for (int b = 0; b < B; b++) printf("%s%lld", b ? ", " : "", (long long)o.ctx[b]);
        printf(" tokens), %d decode steps, seed %llu\n", o.steps, (unsigned long long)o.seed);
        printf("memory    device %.1f MiB (%.2fx less than the %.1f MiB of dense bf16 K+V), host value store %.1f MiB\n",
               mib(dev_bytes), (double)full_kv / (double)dev_bytes, mib(full_kv), mib(host_bytes));
        printf("prefill   %10.1f ms   factorize %.1f, rope %.1f, landmarks+outliers %.1f, offload %.1f\n",
               prefill_ms, pst.prefill_factorize_ms, pst.prefill_rope_ms, pst.prefill_landmarks_ms,
               pst.prefill_offload_ms);
        printf("          per (layer, sequence): %.3f ms on the caller's critical path, factorization %.3f ms%s\n",
               pst.prefill_critical_ms / n_pf, pst.prefill_factorize_ms / n_pf,
               be == SKV_BACKEND_CUDA ? " (beside it, on a side stream)" : " (part of it)");
        if (be == SKV_BACKEND_CUDA)
            printf("          waited %.3f ms per prefill for the previous one's side work (back-to-back prefills here; "
                   "a model's attention between layers hides it)\n",
                   pst.prefill_wait_ms / n_pf);
        printf("decode    %10.2f ms/step (%d layers, whole batch; median %.2f)   select %.2f, rebuild %.2f, "
               "fetch %.2f, attention %.2f\n", dec_step, L, dec_median, d_sel, d_reb, d_fet, d_att);
        printf("          %lld heap allocations in %d decode calls (workspace allocated at create)\n",
               (long long)dst.decode_allocations, L * o.steps);
        printf("e2e       %10.1f ms   (prefill + %d decode steps)\n", e2e, o.steps);
        if (n_acc) {
            printf("accuracy  rel L2 err vs dense attention: %.4f (max %.4f); oracle %.4f; library's selection with "
                   "exact keys %.4f  [%ld samples, layers < %d]\n",
                   err / na, err_max, err_or / na, err_sel / na, n_acc, o.acc_layers);
            printf("attention top-%d tokens hold %.3f of it (min %.3f); the needle chunk holds %.3f\n", cfg->budget,
                   mass / na, mass_min, needle_share / na);
        }
        printf("needles   %ld/%ld planted needle chunks selected\n", hits, total);
        printf("wall      %.1f s, of which workload generation %.1f s and references %.1f s (not timed above)\n",
               wall_s, gen_ms / 1e3, ref_ms / 1e3);
    }

    for (int i = 0; i < LG * B; i++) skvs_seq_free(&seq[i]);
    free(seq), free(q), free(k), free(v), free(out), free(full), free(orac), free(exact), free(sel), free(needle);
    free(rec_q), free(rec_out), free(rec_sel), free(rec_needle), free(step_ms);
    skvs_workload_free(&wl);
    skv_cache_free(cache);
    return 0;
}
