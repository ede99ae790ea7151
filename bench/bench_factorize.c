/*
 * bench_factorize.c - `skv-bench factorize`: the rank-r key factorization of
 * one layer ([n, d] pre-RoPE keys, d = Hk*D) on each backend, with its
 * accuracy, next to a baseline from the same run.
 *
 *   build/skv-bench factorize [--backends ref,cpu] [--n 16384,65536] [--rank 160]
 *                             [--width 1024] [--reps 3] [--no-baseline] [--json]
 *
 * The keys come from the synthetic workload (tests/common/synth.h), one
 * prompt per n, so the spectrum is that of realistic low-rank keys. For each
 * (backend, n): ms (median of --reps calls after one warm-up; ref: one call),
 * err = ||A - U W||_F / ||A||_F in double, opt = the best rank-r error
 * (from the eigenvalues of the double Gram matrix, LAPACKE_dsyevd), and
 * excess = err / opt - 1. Baseline on the CPU: LAPACKE_sgesdd on the same
 * matrix in float (the route class of the original implementation), its
 * rank-r truncation scored the same way.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>
#include <lapacke.h>

#include "synth.h"
#include "testutil.h"

#define FMAXV 8

static double fnow_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int fcmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void fdie(const char *what, skv_status st)
{
    fprintf(stderr, "skv-bench factorize: %s failed: %s (%s)\n", what, skv_status_string(st), skv_last_error());
    exit(1);
}

/* ||A - U W||_F / ||A||_F in double; A [n, d] bf16, U [n, r], W [r, d] float. */
static double rel_err(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, const float *u, const float *w)
{
    double num = 0.0, den = 0.0;
#pragma omp parallel for reduction(+ : num, den) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        double row[8192];
        for (int32_t j = 0; j < d; j++) row[j] = skv_bf16_to_float(a[(size_t)t * d + j]);
        for (int32_t j = 0; j < d; j++) den += row[j] * row[j];
        for (int32_t k = 0; k < r; k++) {
            double uk = u[(size_t)t * r + k];
            const float *wk = w + (size_t)k * d;
            for (int32_t j = 0; j < d; j++) row[j] -= uk * wk[j];
        }
        for (int32_t j = 0; j < d; j++) num += row[j] * row[j];
    }
    return den > 0 ? sqrt(num / den) : 0.0;
}

/* The best rank-r relative error: sqrt(sum of the d - r smallest Gram eigenvalues / trace). */
static double best_err(int64_t n, int32_t d, int32_t r, const skv_bf16 *a)
{
    const int64_t blk = 4096;
    double *g = calloc((size_t)d * d, sizeof *g), *x = malloc((size_t)blk * d * sizeof *x), *ev = malloc((size_t)d * sizeof *ev);
    if (!g || !x || !ev) fdie("allocation", SKV_ERR_OUT_OF_MEMORY);
    for (int64_t t0 = 0; t0 < n; t0 += blk) {
        int64_t rows = n - t0 < blk ? n - t0 : blk;
        for (int64_t i = 0; i < rows * d; i++) x[i] = skv_bf16_to_float(a[(size_t)t0 * d + i]);
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d, (int)rows, 1.0, x, d, 1.0, g, d);
    }
    if (LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'N', 'U', d, g, d, ev) != 0) fdie("LAPACKE_dsyevd", SKV_ERR_NUMERICAL);
    double tail = 0.0, total = 0.0; /* ascending eigenvalues */
    for (int32_t i = 0; i < d; i++) {
        double l = ev[i] > 0 ? ev[i] : 0.0;
        total += l;
        if (i < d - r) tail += l;
    }
    free(g), free(x), free(ev);
    return total > 0 ? sqrt(tail / total) : 0.0;
}

typedef struct {
    const char *what;
    int64_t n;
    double ms, err, opt;
} frow;

static void print_row(const frow *x, int json, int first)
{
    double excess = x->opt > 0 ? x->err / x->opt - 1.0 : 0.0;
    if (json)
        printf("%s\n  {\"route\": \"%s\", \"n\": %lld, \"ms\": %.3f, \"err\": %.6g, \"opt\": %.6g, \"excess\": %.6g}",
               first ? "" : ",", x->what, (long long)x->n, x->ms, x->err, x->opt, excess);
    else
        printf("%-14s %9lld %12.1f %12.6f %12.6f %10.2e\n", x->what, (long long)x->n, x->ms, x->err, x->opt, excess);
}

int bench_factorize_main(int argc, char **argv)
{
    int64_t ns[FMAXV] = {16384, 65536};
    int n_n = 2, reps = 3, json = 0, baseline = 1;
    int32_t r = 160, d = 1024;
    const char *list = "ref,cpu";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--no-baseline")) baseline = 0;
        else if (!strcmp(a, "--n")) {
            char *buf = strdup(v), *save = NULL;
            n_n = 0;
            for (char *t = strtok_r(buf, ",", &save); t && n_n < FMAXV; t = strtok_r(NULL, ",", &save)) ns[n_n++] = atoll(t);
            free(buf);
            i++;
        } else if (!strcmp(a, "--rank")) r = atoi(v), i++;
        else if (!strcmp(a, "--width")) d = atoi(v), i++;
        else if (!strcmp(a, "--reps")) reps = atoi(v), i++;
        else if (!strcmp(a, "--backends")) list = v, i++;
        else {
            printf("usage: skv-bench factorize [--backends ref,cpu] [--n 16384,65536] [--rank 160] [--width 1024] "
                   "[--reps 3] [--no-baseline] [--json]\n");
            return strcmp(a, "--help") ? 2 : 0;
        }
    }
    if (reps < 1 || n_n < 1 || r < 1 || d < 8 || d > 8192 || d % 8) {
        fprintf(stderr, "skv-bench factorize: --reps >= 1, a non-empty --n, --rank >= 1, --width a multiple of 8 in "
                        "[8, 8192]\n");
        return 2;
    }
    skv_backend bes[4];
    int nbe = 0;
    char *names = strdup(list), *save = NULL;
    for (char *t = strtok_r(names, ",", &save); t && nbe < 4; t = strtok_r(NULL, ",", &save)) {
        skv_status st = skv_backend_parse(t, &bes[nbe]);
        if (st) fdie("--backends", st);
        if (skv_backend_available(bes[nbe]) != SKV_OK) {
            fprintf(stderr, "skv-bench factorize: backend %s not available here, skipped\n", t);
            continue;
        }
        nbe++;
    }
    free(names);

    frow rows[64];
    int nrow = 0;
    for (int in = 0; in < n_n; in++) {
        const int64_t n = ns[in];
        /* keys of one layer: the synthetic workload at Hk*D = d (8 KV heads of d/8) */
        skv_config cfg = skv_config_default();
        cfg.n_kv_heads = 8, cfg.n_q_heads = 32, cfg.head_dim = d / 8, cfg.rank = r, cfg.max_prompt_len = n;
        skvs_workload wl;
        skvs_seq seq;
        skv_status st;
        fprintf(stderr, "skv-bench factorize: generating %lld x %d keys\n", (long long)n, d);
        if ((st = skvs_workload_init(&wl, &cfg, n + 1, SKV_BACKEND_CPU))) fdie("workload", st);
        if ((st = skvs_seq_generate(&seq, &wl, n, 1, 0, 20261201 + (uint64_t)n))) fdie("workload", st);
        const skv_bf16 *a = seq.k_pre;
        double opt = best_err(n, d, r, a);
        float *u = malloc((size_t)n * r * sizeof *u), *w = malloc((size_t)r * d * sizeof *w);
        if (!u || !w) fdie("allocation", SKV_ERR_OUT_OF_MEMORY);
        for (int bi = 0; bi < nbe; bi++) {
            skv_backend be = bes[bi];
            if (be == SKV_BACKEND_CUDA) continue; /* device buffers: with the GPU factorization work */
            int k = be == SKV_BACKEND_REF ? 1 : reps + 1;
            double t[64];
            for (int i = 0; i < k && i < 64; i++) {
                double t0 = fnow_ms();
                if ((st = skv_op_factorize(be, n, d, r, a, u, w))) fdie("skv_op_factorize", st);
                t[i] = fnow_ms() - t0;
            }
            /* ref: its one call; others: median after the warm-up */
            double ms;
            if (k == 1) ms = t[0];
            else {
                qsort(t + 1, (size_t)(k - 1), sizeof *t, fcmp);
                ms = t[1 + (k - 1) / 2];
            }
            rows[nrow++] = (frow){skv_backend_name(be), n, ms, rel_err(n, d, r, a, u, w), opt};
            fprintf(stderr, "skv-bench factorize: %s n=%lld: %.1f ms\n", skv_backend_name(be), (long long)n, ms);
        }
        if (baseline) {
            /* LAPACKE_sgesdd on the float matrix; U S kept as U, V^T rows as W */
            float *af = malloc((size_t)n * d * sizeof *af), *s = malloc((size_t)d * sizeof *s);
            float *uu = malloc((size_t)n * d * sizeof *uu), *vt = malloc((size_t)d * d * sizeof *vt);
            if (!af || !s || !uu || !vt) fdie("allocation", SKV_ERR_OUT_OF_MEMORY);
            for (int64_t i = 0; i < n * d; i++) af[i] = skv_bf16_to_float(a[i]);
            double t0 = fnow_ms();
            lapack_int info = LAPACKE_sgesdd(LAPACK_ROW_MAJOR, 'S', (lapack_int)n, d, af, d, s, uu, d, vt, d);
            double ms = fnow_ms() - t0;
            if (info != 0) fdie("LAPACKE_sgesdd", SKV_ERR_NUMERICAL);
            for (int64_t i = 0; i < n; i++)
                for (int32_t q = 0; q < r; q++) u[(size_t)i * r + q] = uu[(size_t)i * d + q] * s[q];
            memcpy(w, vt, (size_t)r * d * sizeof *w);
            rows[nrow++] = (frow){"sgesdd", n, ms, rel_err(n, d, r, a, u, w), opt};
            fprintf(stderr, "skv-bench factorize: sgesdd n=%lld: %.1f ms\n", (long long)n, ms);
            free(af), free(s), free(uu), free(vt);
        }
        free(u), free(w);
        skvs_seq_free(&seq);
        skvs_workload_free(&wl);
    }
    if (json) {
        printf("{\"what\": \"rank-%d factorization of one layer's [n, %d] keys (synthetic workload)\", \"reps\": %d,\n"
               " \"note\": \"ms: median of reps calls after a warm-up (ref: one call); err = ||A-UW||_F/||A||_F in "
               "double; opt: best rank-r error from the double Gram's eigenvalues; excess = err/opt - 1; sgesdd: "
               "LAPACKE_sgesdd in float, truncated to rank r\",\n \"rows\": [",
               r, d, reps);
        for (int i = 0; i < nrow; i++) print_row(&rows[i], 1, i == 0);
        printf("]}\n");
    } else {
        printf("%-14s %9s %12s %12s %12s %10s\n", "route", "n", "ms", "err", "opt", "excess");
        for (int i = 0; i < nrow; i++) print_row(&rows[i], 0, 0);
    }
    return 0;
}
