/*
 * bench_factorize.c - `skv-bench factorize`: the rank-r key factorization of
 * one layer ([n, d] pre-RoPE keys, d = Hk*D) on each backend, with its
 * accuracy, next to baselines from the same run.
 *
 *   build/skv-bench factorize [--backends ref,cpu,cuda] [--n 16384,65536,131072,524288,1048576]
 *                             [--rank 160] [--width 1024] [--reps 3] [--ref-max-n 16384]
 *                             [--cpu-max-n 65536] [--baselines sgesdd,cusolver_gesvd,cuda_gram_syevd]
 *                             [--no-baseline] [--gesvd-max-n 0] [--json]
 *
 * The keys come from the synthetic workload (examples/synth.h), one
 * prompt per n, so the spectrum is that of realistic low-rank keys. Each row
 * (route, n) has ms, err = ||A - U W||_F / ||A||_F in double, opt = the best
 * rank-r error (from the eigenvalues of the double Gram matrix,
 * LAPACKE_dsyevd) and excess = err / opt - 1; a route that fails has an
 * "error" field instead (ms, err and excess null) and the run goes on.
 *
 * Routes:
 *   ref, cpu, cuda     skv_op_factorize_route on that backend with the route
 *                      of --route (default auto; --route canonical: auto, and
 *                      next to it a row <backend>_canonical with the route
 *                      SKV_FACTORIZE_CANONICAL, timed the same way). ms: the median of --reps calls
 *                      after one warm-up; ref: one call. ref only at
 *                      n <= --ref-max-n (default 16384: plain double Gram +
 *                      dsyevr, seconds per call), cpu only at n <= --cpu-max-n
 *                      (default 65536). cuda: A, U and W in device buffers
 *                      (skv_buffer_alloc), wall clock around each call (the
 *                      op-level call is synchronous; it reuses one workspace
 *                      per process, so calls after the warm-up run warm).
 *   baselines (--baselines; --no-baseline: none):
 *   sgesdd             LAPACKE_sgesdd on the matrix in float (the CPU route
 *                      class of the original implementation), n <= --cpu-max-n.
 *   cusolver_gesvd     cuSOLVER cusolverDnXgesvd (64-bit API, float, jobu =
 *                      jobvt = 'S' like torch.svd(some=True)) on the [n, d]
 *                      matrix in column-major float (transposed on the host);
 *                      only the gesvd call is timed (after a device
 *                      synchronization, until the next one); median of --reps
 *                      after one warm-up, one timed call at n >= 524288;
 *                      only at n <= --gesvd-max-n (default 0: every n).
 *                      Needs a CUDA build (SKV_HAVE_CUDA) and the cuda backend.
 *   cuda_gram_syevd    skv_op_factorize_route on cuda with the exact route: the
 *                      library's Gram + Xsyevd route, timed like cuda.
 * The SVD baselines are scored by their rank-r truncation: U_r S_r as U,
 * V_r^T as W.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>
#include <lapacke.h>

#ifdef SKV_HAVE_CUDA
#include <cuda_runtime.h>
/* cusolverDn.h declares a function with () */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <cusolverDn.h>
#pragma GCC diagnostic pop
#endif

#include "synth.h"
#include "testutil.h"

#define FMAXV 8
#define LARGE_N 524288 /* from here on cusolver_gesvd: one warm-up + one timed call */

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

/* median of t[0..k) (sorts t) */
static double fmedian(double *t, int k)
{
    qsort(t, (size_t)k, sizeof *t, fcmp);
    return k % 2 ? t[k / 2] : 0.5 * (t[k / 2 - 1] + t[k / 2]);
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
#pragma omp parallel for schedule(static)
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
    char what[32];
    int64_t n;
    double ms, err, opt;
    char error[256]; /* empty: the route ran */
} frow;

static int nrow, json_out;
static void print_row(const frow *x, int json, int first);

/* one result: a progress line on stderr, the row on stdout (flushed, so a run cut short keeps its rows) */
static void add_row(const char *what, int64_t n, double ms, double err, double opt, const char *error)
{
    frow row, *x = &row;
    memset(x, 0, sizeof *x);
    snprintf(x->what, sizeof x->what, "%s", what);
    x->n = n, x->ms = ms, x->err = err, x->opt = opt;
    if (error) snprintf(x->error, sizeof x->error, "%s", error);
    if (error)
        fprintf(stderr, "skv-bench factorize: %s n=%lld: error: %s\n", what, (long long)n, error);
    else
        fprintf(stderr, "skv-bench factorize: %s n=%lld: %.1f ms, err %.6g (opt %.6g)\n", what, (long long)n, ms, err,
                opt);
    print_row(x, json_out, nrow++ == 0);
    fflush(stdout);
}

/* a JSON string body: quotes, backslashes and control characters escaped */
static void json_str(const char *s)
{
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c < 0x20) printf("\\u%04x", c);
        else putchar(c);
    }
}

static void print_row(const frow *x, int json, int first)
{
    double excess = x->opt > 0 ? x->err / x->opt - 1.0 : 0.0;
    if (json) {
        printf("%s\n  {\"route\": \"%s\", \"n\": %lld, ", first ? "" : ",", x->what, (long long)x->n);
        if (x->error[0]) {
            printf("\"ms\": null, \"err\": null, \"opt\": %.6g, \"excess\": null, \"error\": \"", x->opt);
            json_str(x->error);
            printf("\"}");
        } else {
            printf("\"ms\": %.3f, \"err\": %.6g, \"opt\": %.6g, \"excess\": %.6g}", x->ms, x->err, x->opt, excess);
        }
    } else if (x->error[0]) {
        printf("%-16s %9lld %12s %12s %12.6f %10s  error: %s\n", x->what, (long long)x->n, "-", "-", x->opt, "-",
               x->error);
    } else {
        printf("%-16s %9lld %12.1f %12.6f %12.6f %10.2e\n", x->what, (long long)x->n, x->ms, x->err, x->opt, excess);
    }
}

/* --route: the library routes' choice */
static const char *const route_names[] = {"auto", "fast", "fallback", "exact", "canonical"};
static skv_factorize_route route_main = SKV_FACTORIZE_AUTO;
/* --route canonical: every backend's default (auto) row, then its "<backend>_canonical" row */
static int canon_rows;

/*
 * One library route: skv_op_factorize(be) on a, u, w (device buffers for
 * cuda), k calls (the first a warm-up when k > 1), with the route mode
 * (NULL: --route's). Returns the median ms of the timed calls, or < 0 with msg
 * set on failure.
 */
static double time_route(skv_backend be, const char *mode, int64_t n, int32_t d, int32_t r, const skv_bf16 *a,
                         float *u, float *w, int k, char *msg, size_t cap)
{
    double t[65];
    if (k > 65) k = 65;
    for (int i = 0; i < k; i++) {
        skv_factorize_route route = route_main;
        for (int m = 0; mode && m < 5; m++)
            if (!strcmp(mode, route_names[m])) route = (skv_factorize_route)m;
        double t0 = fnow_ms();
        skv_status st = skv_op_factorize_route(be, route, n, d, r, a, u, w);
        t[i] = fnow_ms() - t0;
        if (st) {
            snprintf(msg, cap, "skv_op_factorize: %s (%s)", skv_status_string(st), skv_last_error());
            return -1.0;
        }
    }
    return k == 1 ? t[0] : fmedian(t + 1, k - 1);
}

#ifdef SKV_HAVE_CUDA
/*
 * cuSOLVER Xgesvd (float, jobu = jobvt = 'S') of the column-major [n, d]
 * matrix; u [n, r] = U_r S_r and w [r, d] = V_r^T of the last call. k timed
 * calls after one warm-up, each on a fresh copy of A (gesvd overwrites it;
 * the device-to-device copy is not timed). Returns the median ms, or < 0
 * with msg set.
 */
static double gesvd_baseline(int64_t n, int32_t d, int32_t r, const skv_bf16 *a, int k, float *u, float *w,
                             char *msg, size_t cap)
{
    double ms = -1.0, t[65];
    float *af = NULL, *ucol = NULL, *s = NULL, *vt = NULL;
    void *dA0 = NULL, *dA = NULL, *dS = NULL, *dU = NULL, *dVT = NULL, *dwork = NULL, *hwork = NULL;
    int *dinfo = NULL, info = 0;
    cusolverDnHandle_t h = NULL;
    cusolverDnParams_t params = NULL;
    size_t dbytes = 0, hbytes = 0;
    const size_t a_bytes = (size_t)n * d * sizeof(float);
    cudaError_t ce;
    cusolverStatus_t cs;
    if (k > 64) k = 64;
#define GCU(call)                                                                                  \
    do {                                                                                           \
        if ((ce = (call)) != cudaSuccess) {                                                        \
            snprintf(msg, cap, "%s: %s", #call, cudaGetErrorString(ce));                           \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)
#define GCS(call)                                                                                  \
    do {                                                                                           \
        if ((cs = (call)) != CUSOLVER_STATUS_SUCCESS) {                                            \
            snprintf(msg, cap, "%.60s: cusolver status %d", #call, (int)cs);                       \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)
    if (n < d) {
        snprintf(msg, cap, "gesvd needs m >= n: %lld tokens < width %d", (long long)n, d);
        return -1.0;
    }
    af = malloc((size_t)n * d * sizeof *af);
    ucol = malloc((size_t)n * r * sizeof *ucol);
    s = malloc((size_t)d * sizeof *s);
    vt = malloc((size_t)d * d * sizeof *vt);
    if (!af || !ucol || !s || !vt) {
        snprintf(msg, cap, "host allocation failed");
        goto done;
    }
    /* column-major [n, d]: af[j * n + t] = A[t][j], in 64 x 64 tiles */
#pragma omp parallel for schedule(static)
    for (int64_t t0 = 0; t0 < n; t0 += 64)
        for (int32_t j0 = 0; j0 < d; j0 += 64)
            for (int32_t j = j0; j < d && j < j0 + 64; j++)
                for (int64_t tt = t0; tt < n && tt < t0 + 64; tt++)
                    af[(size_t)j * n + tt] = skv_bf16_to_float(a[(size_t)tt * d + j]);
    GCU(cudaMalloc(&dA0, a_bytes));
    GCU(cudaMalloc(&dA, a_bytes));
    GCU(cudaMalloc(&dU, a_bytes)); /* m x min(m, n) = n x d */
    GCU(cudaMalloc(&dS, (size_t)d * sizeof(float)));
    GCU(cudaMalloc(&dVT, (size_t)d * d * sizeof(float)));
    GCU(cudaMalloc((void **)&dinfo, sizeof(int)));
    GCU(cudaMemcpy(dA0, af, a_bytes, cudaMemcpyHostToDevice));
    GCS(cusolverDnCreate(&h));
    GCS(cusolverDnCreateParams(&params));
    GCS(cusolverDnXgesvd_bufferSize(h, params, 'S', 'S', n, d, CUDA_R_32F, dA, n, CUDA_R_32F, dS, CUDA_R_32F, dU, n,
                                    CUDA_R_32F, dVT, d, CUDA_R_32F, &dbytes, &hbytes));
    GCU(cudaMalloc(&dwork, dbytes ? dbytes : 1));
    if (hbytes && !(hwork = malloc(hbytes))) {
        snprintf(msg, cap, "host workspace allocation (%zu bytes) failed", hbytes);
        goto done;
    }
    for (int i = 0; i <= k; i++) { /* i = 0: warm-up */
        GCU(cudaMemcpy(dA, dA0, a_bytes, cudaMemcpyDeviceToDevice));
        GCU(cudaDeviceSynchronize());
        double t0 = fnow_ms();
        GCS(cusolverDnXgesvd(h, params, 'S', 'S', n, d, CUDA_R_32F, dA, n, CUDA_R_32F, dS, CUDA_R_32F, dU, n,
                             CUDA_R_32F, dVT, d, CUDA_R_32F, dwork, dbytes, hwork, hbytes, dinfo));
        GCU(cudaDeviceSynchronize());
        if (i) t[i - 1] = fnow_ms() - t0;
        GCU(cudaMemcpy(&info, dinfo, sizeof info, cudaMemcpyDeviceToHost));
        if (info != 0) {
            snprintf(msg, cap, "cusolverDnXgesvd: info %d", info);
            goto done;
        }
    }
    /* U's first r columns are contiguous in column-major */
    GCU(cudaMemcpy(ucol, dU, (size_t)n * r * sizeof(float), cudaMemcpyDeviceToHost));
    GCU(cudaMemcpy(s, dS, (size_t)d * sizeof(float), cudaMemcpyDeviceToHost));
    GCU(cudaMemcpy(vt, dVT, (size_t)d * d * sizeof(float), cudaMemcpyDeviceToHost));
#pragma omp parallel for schedule(static)
    for (int64_t tt = 0; tt < n; tt++)
        for (int32_t q = 0; q < r; q++) u[(size_t)tt * r + q] = ucol[(size_t)q * n + tt] * s[q];
    for (int32_t q = 0; q < r; q++)
        for (int32_t j = 0; j < d; j++) w[(size_t)q * d + j] = vt[(size_t)j * d + q];
    ms = fmedian(t, k);
done:
#undef GCU
#undef GCS
    if (params) cusolverDnDestroyParams(params);
    if (h) cusolverDnDestroy(h);
    cudaFree(dA0), cudaFree(dA), cudaFree(dU), cudaFree(dS), cudaFree(dVT), cudaFree(dinfo), cudaFree(dwork);
    cudaGetLastError(); /* a failed allocation above must not stay the sticky last error */
    free(hwork), free(af), free(ucol), free(s), free(vt);
    return ms;
}
#endif

static int in_list(const char *list, const char *name)
{
    size_t len = strlen(name);
    for (const char *p = list; (p = strstr(p, name)); p += len)
        if ((p == list || p[-1] == ',') && (p[len] == ',' || p[len] == 0)) return 1;
    return 0;
}

static void usage(void)
{
    printf("usage: skv-bench factorize [--backends ref,cpu,cuda] [--n 16384,65536,131072,524288,1048576]\n"
           "                           [--rank 160] [--width 1024] [--reps 3] [--ref-max-n 16384] [--cpu-max-n 65536]\n"
           "                           [--baselines sgesdd,cusolver_gesvd,cuda_gram_syevd] [--no-baseline]\n"
           "                           [--gesvd-max-n 0] [--route auto|fast|fallback|exact|canonical] [--json]\n"
           "  --route canonical: each backend's default (auto) route and, next to it, its canonical route\n"
           "  (SKV_FACTORIZE_CANONICAL, the reproducible mode's; rows <backend>_canonical).\n"
           "  ref runs only at n <= --ref-max-n, cpu and sgesdd only at n <= --cpu-max-n, cusolver_gesvd only at\n"
           "  n <= --gesvd-max-n (0: every n); backends that are not available here are skipped; cusolver_gesvd\n"
           "  needs a CUDA build and the cuda backend.\n");
}

int bench_factorize_main(int argc, char **argv)
{
    int64_t ns[FMAXV] = {16384, 65536, 131072, 524288, 1048576};
    int64_t ref_max_n = 16384, cpu_max_n = 65536, gesvd_max_n = 0;
    int n_n = 5, reps = 3, json = 0;
    int32_t r = 160, d = 1024;
    const char *list = "ref,cpu,cuda", *baselines = "sgesdd,cusolver_gesvd,cuda_gram_syevd";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "--json")) json = 1;
        else if (!strcmp(a, "--no-baseline")) baselines = "";
        else if (!strcmp(a, "--baselines")) baselines = v, i++;
        else if (!strcmp(a, "--n")) {
            char *buf = strdup(v), *save = NULL;
            n_n = 0;
            for (char *t = strtok_r(buf, ",", &save); t && n_n < FMAXV; t = strtok_r(NULL, ",", &save)) ns[n_n++] = atoll(t);
            free(buf);
            i++;
        } else if (!strcmp(a, "--rank")) r = atoi(v), i++;
        else if (!strcmp(a, "--width")) d = atoi(v), i++;
        else if (!strcmp(a, "--reps")) reps = atoi(v), i++;
        else if (!strcmp(a, "--ref-max-n")) ref_max_n = atoll(v), i++;
        else if (!strcmp(a, "--cpu-max-n")) cpu_max_n = atoll(v), i++;
        else if (!strcmp(a, "--gesvd-max-n")) gesvd_max_n = atoll(v), i++;
        else if (!strcmp(a, "--backends")) list = v, i++;
        else if (!strcmp(a, "--route")) {
            int found = 0;
            for (int m = 0; m < 5; m++)
                if (!strcmp(v, route_names[m])) route_main = (skv_factorize_route)m, found = 1;
            if (route_main == SKV_FACTORIZE_CANONICAL) route_main = SKV_FACTORIZE_AUTO, canon_rows = 1;
            if (!found) {
                fprintf(stderr, "skv-bench factorize: --route %s: expected auto, fast, fallback, exact or canonical\n", v);
                return 2;
            }
            i++;
        }
        else {
            if (strcmp(a, "--help")) fprintf(stderr, "skv-bench factorize: unknown option '%s'\n", a);
            usage();
            return strcmp(a, "--help") ? 2 : 0;
        }
    }
    int bad_n = 0;
    for (int i = 0; i < n_n; i++) bad_n |= ns[i] < 1 || ns[i] > ((int64_t)1 << 31);
    if (reps < 1 || reps > 64 || n_n < 1 || bad_n || r < 1 || d < 8 || d > 8192 || d % 8 || r > d) {
        fprintf(stderr, "skv-bench factorize: --reps in [1, 64], a non-empty --n of values in [1, 2^31], --rank in "
                        "[1, --width], --width a multiple of 8 in [8, 8192]\n");
        return 2;
    }
    static const char *const known_bl[] = {"sgesdd", "cusolver_gesvd", "cuda_gram_syevd"};
    {
        char *names = strdup(baselines), *save = NULL;
        for (char *t = strtok_r(names, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            int ok = 0;
            for (int i = 0; i < 3; i++) ok |= !strcmp(t, known_bl[i]);
            if (!ok) {
                fprintf(stderr, "skv-bench factorize: unknown baseline %s (sgesdd, cusolver_gesvd, cuda_gram_syevd)\n", t);
                free(names);
                return 2;
            }
        }
        free(names);
    }
    skv_backend bes[4];
    int nbe = 0, have_cuda = 0;
    char *names = strdup(list), *save = NULL;
    for (char *t = strtok_r(names, ",", &save); t && nbe < 4; t = strtok_r(NULL, ",", &save)) {
        skv_status st = skv_backend_parse(t, &bes[nbe]);
        if (st) fdie("--backends", st);
        if (skv_backend_available(bes[nbe]) != SKV_OK) {
            fprintf(stderr, "skv-bench factorize: backend %s not available here, skipped\n", t);
            continue;
        }
        have_cuda |= bes[nbe] == SKV_BACKEND_CUDA;
        nbe++;
    }
    free(names);
    const int bl_sgesdd = in_list(baselines, "sgesdd");
    const int bl_syevd = have_cuda && in_list(baselines, "cuda_gram_syevd");
#ifdef SKV_HAVE_CUDA
    const int bl_gesvd = have_cuda && in_list(baselines, "cusolver_gesvd");
#else
    const int bl_gesvd = 0;
    if (have_cuda && in_list(baselines, "cusolver_gesvd"))
        fprintf(stderr, "skv-bench factorize: cusolver_gesvd needs a build with CUDA headers (SKV_HAVE_CUDA), skipped\n");
#endif

    json_out = json;
    if (json) {
        printf("{\"what\": \"rank-%d factorization of one layer's [n, %d] keys (synthetic workload)\", \"reps\": %d,\n"
               " \"skv_factorize\": \"",
               r, d, reps);
        json_str(route_names[route_main]);
        printf("\", \"canonical_rows\": %s, \"ref_max_n\": %lld, \"cpu_max_n\": %lld, \"gesvd_max_n\": %lld,\n"
               " \"note\": \"ms: median of reps calls after a warm-up (ref: one call; cusolver_gesvd: one timed call at "
               "n >= %d); err = ||A-UW||_F/||A||_F in double; opt: best rank-r error from the double Gram's "
               "eigenvalues; excess = err/opt - 1; a row with error did not run (ms, err, excess null). ref only at n "
               "<= ref_max_n, cpu and sgesdd only at n <= cpu_max_n, cusolver_gesvd only at n <= gesvd_max_n (0: "
               "every n). cuda: skv_op_factorize on device buffers, wall clock of the synchronous op-level call (warm: "
               "the workspace is reused after the warm-up). cuda_gram_syevd: the same with "
               "the exact route (the library's Gram + Xsyevd route). sgesdd: LAPACKE_sgesdd in float; "
               "cusolver_gesvd: cusolverDnXgesvd in float on the column-major [n, d] matrix, jobu = jobvt = 'S', only "
               "the gesvd call timed; both truncated to rank r (U_r S_r, V_r^T)\",\n"
               " \"rows\": [",
               canon_rows ? "true" : "false", (long long)ref_max_n, (long long)cpu_max_n, (long long)gesvd_max_n, LARGE_N);
    } else {
        printf("%-16s %9s %12s %12s %12s %10s\n", "route", "n", "ms", "err", "opt", "excess");
    }
    fflush(stdout);

    for (int in = 0; in < n_n; in++) {
        const int64_t n = ns[in];
        const int gesvd_here = bl_gesvd && (gesvd_max_n <= 0 || n <= gesvd_max_n);
        int any = (bl_sgesdd && n <= cpu_max_n) || bl_syevd || gesvd_here;
        for (int bi = 0; bi < nbe; bi++)
            any |= bes[bi] == SKV_BACKEND_CUDA || (bes[bi] == SKV_BACKEND_REF && n <= ref_max_n) ||
                   (bes[bi] == SKV_BACKEND_CPU && n <= cpu_max_n);
        if (!any) {
            fprintf(stderr, "skv-bench factorize: n=%lld: no route runs at this n (--ref-max-n, --cpu-max-n), skipped\n",
                    (long long)n);
            continue;
        }
        /* keys of one layer: the synthetic workload at Hk*D = d (8 KV heads of d/8) */
        skv_config cfg = skv_config_default();
        cfg.n_kv_heads = 8, cfg.n_q_heads = 32, cfg.head_dim = d / 8, cfg.rank = r, cfg.max_prompt_len = n;
        skvs_workload wl;
        skvs_seq seq;
        skv_status st;
        char msg[256];
        double t0 = fnow_ms();
        fprintf(stderr, "skv-bench factorize: generating %lld x %d keys\n", (long long)n, d);
        if ((st = skvs_workload_init(&wl, &cfg, n + 1, SKV_BACKEND_CPU))) fdie("workload", st);
        if ((st = skvs_seq_generate(&seq, &wl, n, 1, 0, 20261201 + (uint64_t)n))) fdie("workload", st);
        const skv_bf16 *a = seq.k_pre;
        fprintf(stderr, "skv-bench factorize: generated in %.1f s; opt (double Gram + dsyevd)\n", (fnow_ms() - t0) / 1e3);
        t0 = fnow_ms();
        double opt = best_err(n, d, r, a);
        fprintf(stderr, "skv-bench factorize: opt %.6g in %.1f s\n", opt, (fnow_ms() - t0) / 1e3);
        float *u = malloc((size_t)n * r * sizeof *u), *w = malloc((size_t)r * d * sizeof *w);
        if (!u || !w) fdie("allocation", SKV_ERR_OUT_OF_MEMORY);
        for (int bi = 0; bi < nbe; bi++) {
            skv_backend be = bes[bi];
            const char *bn = skv_backend_name(be);
            if (be == SKV_BACKEND_REF && n > ref_max_n) continue;
            if (be == SKV_BACKEND_CPU && n > cpu_max_n) continue;
            if (be != SKV_BACKEND_CUDA) {
                double ms = time_route(be, NULL, n, d, r, a, u, w, be == SKV_BACKEND_REF ? 1 : reps + 1, msg, sizeof msg);
                if (ms < 0) add_row(bn, n, 0, 0, opt, msg);
                else add_row(bn, n, ms, rel_err(n, d, r, a, u, w), opt, NULL);
                if (canon_rows) {
                    char cn[32];
                    snprintf(cn, sizeof cn, "%s_canonical", bn);
                    ms = time_route(be, "canonical", n, d, r, a, u, w, be == SKV_BACKEND_REF ? 1 : reps + 1, msg,
                                    sizeof msg);
                    if (ms < 0) add_row(cn, n, 0, 0, opt, msg);
                    else add_row(cn, n, ms, rel_err(n, d, r, a, u, w), opt, NULL);
                }
                continue;
            }
            /* cuda: A, U, W on the device; the cuda row, then the Gram + Xsyevd route on the same buffers */
            void *da = NULL, *du = NULL, *dw = NULL;
            const size_t a_bytes = (size_t)n * d * sizeof(skv_bf16), u_bytes = (size_t)n * r * sizeof(float),
                         w_bytes = (size_t)r * d * sizeof(float);
            if ((st = skv_buffer_alloc(be, a_bytes, &da)) || (st = skv_buffer_alloc(be, u_bytes, &du)) ||
                (st = skv_buffer_alloc(be, w_bytes, &dw)) || (st = skv_buffer_copy(be, da, a, a_bytes))) {
                snprintf(msg, sizeof msg, "device buffers: %s (%s)", skv_status_string(st), skv_last_error());
                add_row("cuda", n, 0, 0, opt, msg);
                if (canon_rows) add_row("cuda_canonical", n, 0, 0, opt, msg);
                if (bl_syevd) add_row("cuda_gram_syevd", n, 0, 0, opt, msg);
            } else {
                for (int pass = 0; pass < 3; pass++) { /* default, canonical, the exact route */
                    if ((pass == 1 && !canon_rows) || (pass == 2 && !bl_syevd)) continue;
                    const char *what = pass == 2 ? "cuda_gram_syevd" : pass ? "cuda_canonical" : "cuda";
                    double ms = time_route(be, pass == 2 ? "exact" : pass ? "canonical" : NULL, n, d, r, da, du, dw,
                                           reps + 1, msg, sizeof msg);
                    if (ms >= 0 && ((st = skv_buffer_copy(be, u, du, u_bytes)) || (st = skv_buffer_copy(be, w, dw, w_bytes)))) {
                        snprintf(msg, sizeof msg, "copying U, W back: %s (%s)", skv_status_string(st), skv_last_error());
                        ms = -1.0;
                    }
                    if (ms < 0) add_row(what, n, 0, 0, opt, msg);
                    else add_row(what, n, ms, rel_err(n, d, r, a, u, w), opt, NULL);
                }
            }
            skv_buffer_free(be, da), skv_buffer_free(be, du), skv_buffer_free(be, dw);
        }
        if (bl_sgesdd && n <= cpu_max_n && n < r) {
            add_row("sgesdd", n, 0, 0, opt, "rank > n");
        } else if (bl_sgesdd && n <= cpu_max_n) {
            /* LAPACKE_sgesdd on the float matrix; U S kept as U, V^T rows as W */
            float *af = malloc((size_t)n * d * sizeof *af), *s = malloc((size_t)d * sizeof *s);
            float *uu = malloc((size_t)n * d * sizeof *uu), *vt = malloc((size_t)d * d * sizeof *vt);
            if (!af || !s || !uu || !vt) fdie("allocation", SKV_ERR_OUT_OF_MEMORY);
            for (int64_t i = 0; i < n * d; i++) af[i] = skv_bf16_to_float(a[i]);
            t0 = fnow_ms();
            lapack_int info = LAPACKE_sgesdd(LAPACK_ROW_MAJOR, 'S', (lapack_int)n, d, af, d, s, uu, d, vt, d);
            double ms = fnow_ms() - t0;
            if (info != 0) {
                snprintf(msg, sizeof msg, "LAPACKE_sgesdd: info %d", (int)info);
                add_row("sgesdd", n, 0, 0, opt, msg);
            } else {
                for (int64_t i = 0; i < n; i++)
                    for (int32_t q = 0; q < r; q++) u[(size_t)i * r + q] = uu[(size_t)i * d + q] * s[q];
                memcpy(w, vt, (size_t)r * d * sizeof *w);
                add_row("sgesdd", n, ms, rel_err(n, d, r, a, u, w), opt, NULL);
            }
            free(af), free(s), free(uu), free(vt);
        }
#ifdef SKV_HAVE_CUDA
        if (gesvd_here) {
            fprintf(stderr, "skv-bench factorize: cusolver_gesvd n=%lld ...\n", (long long)n);
            double ms = gesvd_baseline(n, d, r, a, n >= LARGE_N ? 1 : reps, u, w, msg, sizeof msg);
            if (ms < 0) add_row("cusolver_gesvd", n, 0, 0, opt, msg);
            else add_row("cusolver_gesvd", n, ms, rel_err(n, d, r, a, u, w), opt, NULL);
        }
#endif
        free(u), free(w);
        skvs_seq_free(&seq);
        skvs_workload_free(&wl);
    }
    if (json) printf("]}\n");
    skv_op_release();
    return 0;
}
