/*
 * skv_bench.c - backend comparison at one Llama-3-8B layer (Hq 32, Hk 8,
 * D 128, r 160, c 8, budget 2048, O 48, Lc 4), batch 1, on the synthetic
 * workload of examples/synth.h:
 *  - skv_prefill of one layer at --ctx tokens (a fresh cache per repetition);
 *  - one skv_decode step of that layer;
 *  - every op-level function (skv_op_*) at the same shape, chained the way
 *    prefill and decode chain them (factorize -> rope -> landmarks ->
 *    score/select -> rebuild -> gather -> sparse attention; full attention
 *    over the whole prompt is the dense baseline).
 * Each figure is the median of --reps runs after one warm-up. The ref
 * backend's prefill and factorization take seconds at 32k, so they run
 * --ref-reps times (default 1) without warm-up; the output says so.
 *
 *   build/skv-bench [--ctx 32768] [--reps 5] [--ref-reps 1] [--backends ref,cpu] [--json]
 *   build/skv-bench decode ...     per-layer decode step split (bench_decode.c)
 *   build/skv-bench factorize ...  the key factorization with its accuracy (bench_factorize.c)
 *   build/skv-bench serve ...      continuous batching against static batches (bench_serve.c)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "synth.h"
#include "testutil.h"

enum { OP_FACTORIZE, OP_ROPE, OP_LANDMARKS, OP_SELECT, OP_REBUILD, OP_GATHER, OP_SPARSE, OP_FULL, N_OPS };
static const char *const op_name[N_OPS] = {"factorize", "rope", "landmarks_outliers", "score_select",
                                           "rebuild_keys", "gather_values", "sparse_attention", "full_attention"};
enum { MAX_BE = 4 };

typedef struct bench {
    skv_config cfg;
    skvs_workload wl;
    skvs_seq seq;
    int64_t n;
    int32_t N, n_cand, S, Hq, Hk, D, P, r, c, O, n_local;
    skv_backend be;
    /* op chain buffers */
    float *u, *w;
    skv_bf16 *ub, *wb, *k_post, *landmarks, *k_sel, *v_sel, *store, *k_out, *v_out, *q;
    int32_t *out_ids, *cand_ids, *sel_idx, *sel_ids;
    float *attn;
} bench;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void die(const char *what, skv_status st, skv_cache *cache)
{
    fprintf(stderr, "skv-bench: %s failed: %s\n", what, skv_status_string(st));
    const char *msg = cache ? skv_cache_last_error(cache) : skv_last_error();
    if (msg && *msg) fprintf(stderr, "skv-bench: %s\n", msg);
    exit(1);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *x, int n)
{
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

static skv_status run_op(bench *b, int op)
{
    const skv_rope_config *rope = &b->cfg.rope;
    const int64_t ctx_tok = (int64_t)b->N * b->c;
    switch (op) {
    case OP_FACTORIZE: return skv_op_factorize(b->be, b->n, b->P, b->r, b->seq.k_pre, b->u, b->w);
    case OP_ROPE:
        return skv_op_rope(b->be, rope, b->D, b->n, b->Hk, 0, b->wl.cos_tab, b->wl.sin_tab, b->seq.k_pre, b->k_post);
    case OP_LANDMARKS:
        return skv_op_landmarks_outliers(b->be, b->N, b->c, b->Hk, b->D, b->O, b->k_post, b->out_ids, b->cand_ids,
                                         b->landmarks);
    case OP_SELECT:
        return skv_op_score_select(b->be, b->Hq, b->Hk, b->D, b->n_cand, b->S, 0.0f, b->q, b->landmarks, b->cand_ids,
                                   b->sel_idx, b->sel_ids, NULL);
    case OP_REBUILD:
        return skv_op_rebuild_keys(b->be, rope, b->D, b->Hk, b->r, b->c, b->S, b->n, b->ub, b->wb, b->sel_ids,
                                   b->wl.cos_tab, b->wl.sin_tab, b->k_out);
    case OP_GATHER:
        return skv_op_gather_values(b->be, b->Hk, b->D, b->c, b->n_cand, b->S, b->store, b->sel_idx, b->v_out);
    case OP_SPARSE: {
        /* outliers (gathered exact), local window (in place), selected (rebuilt) */
        const int64_t tok = (int64_t)b->Hk * b->D;
        skv_kv_span sp[3] = {
            {b->k_sel, b->v_sel, (int64_t)b->O * b->c, (int64_t)b->O * b->c * b->D, b->D},
            {b->k_post + ctx_tok * tok, b->seq.v + ctx_tok * tok, b->n_local, b->D, tok},
            {b->k_out, b->v_out, (int64_t)b->S * b->c, (int64_t)b->S * b->c * b->D, b->D},
        };
        return skv_op_sparse_attention(b->be, b->Hq, b->Hk, b->D, 0.0f, b->q, 3, sp, b->attn);
    }
    case OP_FULL:
        return skv_op_full_attention(b->be, b->Hq, b->Hk, b->D, 0.0f, b->q, b->n, b->k_post, b->seq.v, b->attn);
    }
    return SKV_ERR_INVALID_ARGUMENT;
}

/* Inputs the next ops of the chain need from the previous ones' outputs. */
static void after_op(bench *b, int op)
{
    const int64_t tok = (int64_t)b->Hk * b->D;
    if (op == OP_FACTORIZE) {
        for (size_t i = 0; i < (size_t)b->n * b->r; i++) b->ub[i] = skv_bf16_from_float(b->u[i]);
        for (size_t i = 0; i < (size_t)b->r * b->P; i++) b->wb[i] = skv_bf16_from_float(b->w[i]);
    } else if (op == OP_LANDMARKS) {
        /* exact outlier K/V as [Hk, O*c, D]; the value store as [Hk, n_cand, c, D] */
        for (int h = 0; h < b->Hk; h++) {
            for (int o = 0; o < b->O; o++)
                for (int t = 0; t < b->c; t++) {
                    int64_t src = ((int64_t)b->out_ids[h * b->O + o] * b->c + t) * tok + h * b->D;
                    size_t dst = (((size_t)h * b->O + o) * b->c + t) * b->D;
                    memcpy(b->k_sel + dst, b->k_post + src, sizeof(skv_bf16) * (size_t)b->D);
                    memcpy(b->v_sel + dst, b->seq.v + src, sizeof(skv_bf16) * (size_t)b->D);
                }
            for (int j = 0; j < b->n_cand; j++)
                for (int t = 0; t < b->c; t++)
                    memcpy(b->store + (((size_t)h * b->n_cand + j) * b->c + t) * b->D,
                           b->seq.v + ((int64_t)b->cand_ids[h * b->n_cand + j] * b->c + t) * tok + h * b->D,
                           sizeof(skv_bf16) * (size_t)b->D);
        }
    }
}

typedef struct result {
    double prefill_ms, decode_ms, op_ms[N_OPS];
} result;

static result bench_backend(bench *b, skv_backend be, int reps, int ref_reps, const skv_bf16 *dq,
                            const skv_bf16 *dk, const skv_bf16 *dv)
{
    result res;
    double t[256];
    const int heavy_reps = be == SKV_BACKEND_REF ? ref_reps : reps, heavy_warm = be != SKV_BACKEND_REF;
    skv_status st;
    b->be = be;
    b->cfg.backend = be;

    /* prefill: a fresh cache per run; decode on the last one */
    skv_cache *cache = NULL;
    for (int i = 0; i < heavy_warm + heavy_reps; i++) {
        skv_cache_free(cache);
        if ((st = skv_cache_create(&b->cfg, &cache))) die("skv_cache_create", st, NULL);
        double t0 = now_ms();
        if ((st = skv_prefill(cache, 0, 0, b->n, b->seq.k_pre, b->seq.v, NULL))) die("skv_prefill", st, cache);
        t[i] = now_ms() - t0;
        fprintf(stderr, "skv-bench: %s prefill run %d: %.1f ms\n", skv_backend_name(be), i + 1, t[i]);
    }
    res.prefill_ms = median(t + heavy_warm, heavy_reps);
    const size_t qs = (size_t)b->Hq * b->D, ks = (size_t)b->Hk * b->D;
    for (int i = 0; i < 1 + reps; i++) {
        double t0 = now_ms();
        if ((st = skv_decode(cache, 0, dq + i * qs, dk + i * ks, dv + i * ks, b->attn))) die("skv_decode", st, cache);
        t[i] = now_ms() - t0;
    }
    res.decode_ms = median(t + 1, reps);
    skv_cache_free(cache);

    for (int op = 0; op < N_OPS; op++) {
        int heavy = op == OP_FACTORIZE, warm = heavy ? heavy_warm : 1, n_rep = heavy ? heavy_reps : reps;
        for (int i = 0; i < warm + n_rep; i++) {
            double t0 = now_ms();
            if ((st = run_op(b, op))) die(op_name[op], st, NULL);
            t[i] = now_ms() - t0;
        }
        res.op_ms[op] = median(t + warm, n_rep);
        after_op(b, op);
        fprintf(stderr, "skv-bench: %s %s: %.2f ms\n", skv_backend_name(be), op_name[op], res.op_ms[op]);
    }
    return res;
}

static void cpu_model(char *buf, size_t cap)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    snprintf(buf, cap, "unknown");
    while (f && fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (!strncmp(line, "model name", 10) && colon) {
            colon += 2;
            colon[strcspn(colon, "\n")] = 0;
            snprintf(buf, cap, "%s", colon);
            break;
        }
    }
    if (f) fclose(f);
    for (char *p = buf; *p; p++)
        if (*p == '"' || *p == '\\') *p = ' ';
}

int bench_decode_main(int argc, char **argv);
int bench_factorize_main(int argc, char **argv);
int bench_serve_main(int argc, char **argv);

static void usage(FILE *f)
{
    fprintf(f,
            "usage: skv-bench [--ctx 32768] [--reps 5] [--ref-reps 1] [--backends ref,cpu] [--json]\n"
            "       skv-bench decode [options]      per-layer decode step split (skv-bench decode --help)\n"
            "       skv-bench factorize [options]   the key factorization and its accuracy (skv-bench factorize --help)\n"
            "       skv-bench serve [options]       continuous batching against static batches (bench/bench_serve.c)\n"
            "Without a subcommand: prefill, one decode step and every op-level function of one Llama-3-8B\n"
            "layer on each backend of --backends.\n"
            "  --ctx N           prompt tokens (default 32768)\n"
            "  --reps N          timed runs per figure, median reported (default 5, at most 200)\n"
            "  --ref-reps N      runs of ref's prefill and factorization (default 1, at most 200)\n"
            "  --backends LIST   comma-separated backends (default ref,cpu)\n"
            "  --json            one JSON object instead of the table\n"
            "  --help            this text\n");
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "decode")) return bench_decode_main(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "factorize")) return bench_factorize_main(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "serve")) return bench_serve_main(argc - 1, argv + 1);
    int64_t ctx = 32768;
    int reps = 5, ref_reps = 1, json = 0, nbe = 0;
    skv_backend bes[MAX_BE];
    const char *list = "ref,cpu";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--ctx")) ctx = atoll(v), i++;
        else if (!strcmp(a, "--reps")) reps = atoi(v), i++;
        else if (!strcmp(a, "--ref-reps")) ref_reps = atoi(v), i++;
        else if (!strcmp(a, "--backends")) list = v, i++;
        else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "skv-bench: unknown %s '%s'\n", a[0] == '-' ? "option" : "subcommand", a);
            usage(stderr);
            return 2;
        }
    }
    if (reps < 1 || reps > 200 || ref_reps < 1 || ref_reps > 200 || ctx < 1) {
        fprintf(stderr, "skv-bench: --reps and --ref-reps must be in [1, 200], --ctx positive\n");
        return 2;
    }
    char *names = strdup(list), *save = NULL;
    for (char *tok = strtok_r(names, ",", &save); tok && nbe < MAX_BE; tok = strtok_r(NULL, ",", &save)) {
        skv_status st = skv_backend_parse(tok, &bes[nbe]);
        if (st) die("--backends", st, NULL);
        if (skv_backend_available(bes[nbe]) != SKV_OK) {
            fprintf(stderr, "skv-bench: backend %s not available here, skipped: %s\n", tok, skv_last_error());
            continue;
        }
        nbe++;
    }
    free(names);

    bench b;
    memset(&b, 0, sizeof b);
    b.cfg = skv_config_default();
    b.cfg.n_layers = 1;
    b.cfg.batch_size = 1;
    b.cfg.max_prompt_len = ctx;
    b.cfg.gen_capacity = reps + 1;
    b.n = ctx;
    b.Hq = b.cfg.n_q_heads, b.Hk = b.cfg.n_kv_heads, b.D = b.cfg.head_dim, b.P = b.Hk * b.D;
    b.r = b.cfg.rank, b.c = b.cfg.chunk_size, b.O = b.cfg.n_outlier_chunks, b.S = b.cfg.budget / b.c;
    b.N = (int32_t)(ctx / b.c) - b.cfg.n_local_chunks;
    b.n_cand = b.N - b.O;
    b.n_local = (int32_t)(ctx - (int64_t)b.N * b.c);
    skv_status st = skv_config_validate(&b.cfg);
    if (st) die("config", st, NULL);
    if (b.n_cand < b.S) die("--ctx (prompt too short for the budget)", SKV_ERR_PROMPT_TOO_SHORT, NULL);

    fprintf(stderr, "skv-bench: generating a %lld-token workload\n", (long long)ctx);
    if ((st = skvs_workload_init(&b.wl, &b.cfg, ctx + reps + 1, SKV_BACKEND_REF))) die("workload", st, NULL);
    if ((st = skvs_seq_generate(&b.seq, &b.wl, ctx, reps + 1, 0, 20250101))) die("workload", st, NULL);
    const size_t qs = (size_t)b.Hq * b.D, ks = (size_t)b.Hk * b.D;
    skv_bf16 *dq = malloc(sizeof(skv_bf16) * qs * (reps + 1)), *dk = malloc(sizeof(skv_bf16) * ks * (reps + 1));
    skv_bf16 *dv = malloc(sizeof(skv_bf16) * ks * (reps + 1));
    for (int i = 0; i < reps + 1; i++) {
        int32_t needle;
        if ((st = skvs_step(&b.seq, dq + i * qs, dk + i * ks, dv + i * ks, &needle))) die("workload step", st, NULL);
    }
    b.q = dq;
    const size_t sel_tok = (size_t)b.Hk * b.S * b.c * b.D;
    b.u = malloc(sizeof(float) * (size_t)ctx * b.r);
    b.w = malloc(sizeof(float) * (size_t)b.r * b.P);
    b.ub = malloc(sizeof(skv_bf16) * (size_t)ctx * b.r);
    b.wb = malloc(sizeof(skv_bf16) * (size_t)b.r * b.P);
    b.k_post = malloc(sizeof(skv_bf16) * (size_t)ctx * b.P);
    b.landmarks = malloc(sizeof(skv_bf16) * (size_t)b.Hk * b.n_cand * b.D);
    b.k_sel = malloc(sizeof(skv_bf16) * (size_t)b.Hk * b.O * b.c * b.D);
    b.v_sel = malloc(sizeof(skv_bf16) * (size_t)b.Hk * b.O * b.c * b.D);
    b.store = malloc(sizeof(skv_bf16) * (size_t)b.Hk * b.n_cand * b.c * b.D);
    b.k_out = malloc(sizeof(skv_bf16) * sel_tok);
    b.v_out = malloc(sizeof(skv_bf16) * sel_tok);
    b.out_ids = malloc(sizeof(int32_t) * (size_t)b.Hk * b.O);
    b.cand_ids = malloc(sizeof(int32_t) * (size_t)b.Hk * b.n_cand);
    b.sel_idx = malloc(sizeof(int32_t) * (size_t)b.Hk * b.S);
    b.sel_ids = malloc(sizeof(int32_t) * (size_t)b.Hk * b.S);
    b.attn = malloc(sizeof(float) * qs);
    if (!dq || !dk || !dv || !b.u || !b.w || !b.ub || !b.wb || !b.k_post || !b.landmarks || !b.k_sel || !b.v_sel ||
        !b.store || !b.k_out || !b.v_out || !b.out_ids || !b.cand_ids || !b.sel_idx || !b.sel_ids || !b.attn)
        die("allocation", SKV_ERR_OUT_OF_MEMORY, NULL);

    result res[MAX_BE];
    for (int i = 0; i < nbe; i++) res[i] = bench_backend(&b, bes[i], reps, ref_reps, dq, dk, dv);

    char cpu[256];
    cpu_model(cpu, sizeof cpu);
    long nproc = sysconf(_SC_NPROCESSORS_ONLN);
    int ref_i = -1;
    for (int i = 0; i < nbe; i++)
        if (bes[i] == SKV_BACKEND_REF) ref_i = i;
    char note[256];
    snprintf(note, sizeof note,
             "median of %d runs after 1 warm-up; ref prefill and ref factorize: median of %d run(s), no warm-up",
             reps, ref_reps);

    if (json) {
        printf("{\"machine\": {\"cpu\": \"%s\", \"nproc\": %ld},\n", cpu, nproc);
        printf(" \"shape\": {\"ctx\": %lld, \"batch\": 1, \"layers\": 1, \"hq\": %d, \"hk\": %d, \"dim\": %d, "
               "\"rank\": %d, \"chunk\": %d, \"budget\": %d, \"outlier_chunks\": %d, \"local_chunks\": %d},\n",
               (long long)ctx, b.Hq, b.Hk, b.D, b.r, b.c, b.cfg.budget, b.O, b.cfg.n_local_chunks);
        printf(" \"reps\": %d, \"ref_heavy_reps\": %d, \"note\": \"%s\",\n \"backends\": {", reps, ref_reps, note);
        for (int i = 0; i < nbe; i++) {
            printf("%s\n  \"%s\": {\"prefill_ms\": %.3f, \"decode_ms\": %.3f, \"ops_ms\": {", i ? "," : "",
                   skv_backend_name(bes[i]), res[i].prefill_ms, res[i].decode_ms);
            for (int op = 0; op < N_OPS; op++) printf("%s\"%s\": %.3f", op ? ", " : "", op_name[op], res[i].op_ms[op]);
            printf("}}");
        }
        printf("},\n \"speedup_vs_ref\": {");
        for (int i = 0, first = 1; i < nbe && ref_i >= 0; i++) {
            if (i == ref_i) continue;
            printf("%s\n  \"%s\": {\"prefill\": %.2f, \"decode\": %.2f, \"ops\": {", first ? "" : ",",
                   skv_backend_name(bes[i]), res[ref_i].prefill_ms / res[i].prefill_ms,
                   res[ref_i].decode_ms / res[i].decode_ms);
            for (int op = 0; op < N_OPS; op++)
                printf("%s\"%s\": %.2f", op ? ", " : "", op_name[op], res[ref_i].op_ms[op] / res[i].op_ms[op]);
            printf("}}");
            first = 0;
        }
        printf("}}\n");
    } else {
        printf("skv-bench: %s, %ld CPUs; one layer, batch 1, %lld tokens, Hq %d Hk %d D %d r %d budget %d\n", cpu,
               nproc, (long long)ctx, b.Hq, b.Hk, b.D, b.r, b.cfg.budget);
        printf("(%s)\n%-20s", note, "ms");
        for (int i = 0; i < nbe; i++) printf(" %12s", skv_backend_name(bes[i]));
        for (int i = 0; i < nbe; i++)
            if (i != ref_i && ref_i >= 0) printf(" %8s/ref", skv_backend_name(bes[i]));
        printf("\n");
        for (int row = -2; row < N_OPS; row++) {
            const char *name = row == -2 ? "prefill" : row == -1 ? "decode step" : op_name[row];
            printf("%-20s", name);
            double x[MAX_BE];
            for (int i = 0; i < nbe; i++) {
                x[i] = row == -2 ? res[i].prefill_ms : row == -1 ? res[i].decode_ms : res[i].op_ms[row];
                printf(" %12.3f", x[i]);
            }
            for (int i = 0; i < nbe; i++)
                if (i != ref_i && ref_i >= 0) printf(" %11.2fx", x[ref_i] / x[i]);
            printf("\n");
        }
    }

    skvs_seq_free(&b.seq);
    skvs_workload_free(&b.wl);
    free(dq), free(dk), free(dv), free(b.u), free(b.w), free(b.ub), free(b.wb), free(b.k_post), free(b.landmarks);
    free(b.k_sel), free(b.v_sel), free(b.store), free(b.k_out), free(b.v_out), free(b.out_ids), free(b.cand_ids);
    free(b.sel_idx), free(b.sel_ids), free(b.attn);
    return 0;
}
