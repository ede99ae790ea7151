/*
 * beside_omp.c - the cpu backend's prefill beside another OpenMP runtime in
 * the same process, as in a framework that ships its own copy of the runtime
 * (a Python process with a tensor library loaded, whose model code runs a
 * parallel op between the library's calls).
 *
 *   make build/beside_omp
 *   build/beside_omp [--layers 30] [--hq 9] [--hk 3] [--dim 64] [--ctx 8192] [--rank 160] [--budget 2048]
 *                    [--rounds 3] [--op-ms 5] [--runtime PATH]
 *
 * The other runtime is a private copy of libgomp (PATH, default the
 * libgomp.so.1 this program links; copied to a temporary file and opened
 * RTLD_LOCAL, so it has its own threads and its own waiting, whatever the
 * library's). Each round prefills every layer of one sequence twice, on the
 * cpu backend with the default thread count: alone, then with one parallel
 * region of the other runtime (every thread computing for --op-ms ms, a
 * stand-in for the model's own work on that layer) before each layer's
 * skv_prefill. Only the skv_prefill calls are timed. Prints one line per
 * round and the medians; exit status 0, 1 on a library error, 2 on bad
 * options or when the runtime cannot be loaded.
 * No environment variable is read or set here: the runtimes run with their
 * defaults (no OMP_WAIT_POLICY).
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <shadowkv.h>

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* the other runtime's entry point of a parallel region (GCC's ABI) */
typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
static gomp_parallel_fn other_parallel;

static void other_work(void *arg) /* each thread: busy arithmetic for op_ms */
{
    double ms = *(const double *)arg, t0 = now_ms(), x = 1.0;
    while (now_ms() - t0 < ms)
        for (int i = 0; i < 10000; i++) x = x * 1.0000001 + 1e-9;
    if (x == 42.0) puts(""); /* keeps the loop */
}

static int load_other(const char *path)
{
    char tmp[] = "/tmp/beside_omp_XXXXXX";
    int out = mkstemp(tmp);
    FILE *in = fopen(path, "rb");
    if (out < 0 || !in) {
        fprintf(stderr, "beside_omp: cannot copy %s\n", path);
        return 2;
    }
    char buf[1 << 16];
    size_t k;
    while ((k = fread(buf, 1, sizeof buf, in)) > 0)
        if (write(out, buf, k) != (ssize_t)k) return 2;
    fclose(in);
    close(out);
    void *h = dlopen(tmp, RTLD_NOW | RTLD_LOCAL);
    unlink(tmp);
    if (!h || !(other_parallel = (gomp_parallel_fn)dlsym(h, "GOMP_parallel"))) {
        fprintf(stderr, "beside_omp: %s: %s\n", path, dlerror());
        return 2;
    }
    return 0;
}

static skv_bf16 to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (skv_bf16)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    int layers = 30, hq = 9, hk = 3, dim = 64, rank = 160, budget = 2048, rounds = 3;
    long ctx = 8192;
    double op_ms = 5.0;
    const char *runtime = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            puts("usage: beside_omp [--layers 30] [--hq 9] [--hk 3] [--dim 64] [--ctx 8192] [--rank 160] "
                 "[--budget 2048] [--rounds 3] [--op-ms 5] [--runtime PATH]");
            return 0;
        }
        if (!v) {
            fprintf(stderr, "beside_omp: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--layers")) layers = atoi(v);
        else if (!strcmp(a, "--hq")) hq = atoi(v);
        else if (!strcmp(a, "--hk")) hk = atoi(v);
        else if (!strcmp(a, "--dim")) dim = atoi(v);
        else if (!strcmp(a, "--rank")) rank = atoi(v);
        else if (!strcmp(a, "--ctx")) ctx = atol(v);
        else if (!strcmp(a, "--budget")) budget = atoi(v);
        else if (!strcmp(a, "--rounds")) rounds = atoi(v);
        else if (!strcmp(a, "--op-ms")) op_ms = atof(v);
        else if (!strcmp(a, "--runtime")) runtime = v;
        else {
            fprintf(stderr, "beside_omp: unknown option %s\n", a);
            return 2;
        }
    }
    if (layers < 1 || hq < 1 || hk < 1 || dim < 2 || ctx < 1 || rounds < 1 || rounds > 100) {
        fprintf(stderr, "beside_omp: bad sizes\n");
        return 2;
    }
    Dl_info info;
    void *self = dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
    void *sym = self ? dlsym(self, "GOMP_parallel") : NULL;
    if (!runtime && sym && dladdr(sym, &info) && info.dli_fname) runtime = info.dli_fname;
    if (!runtime) {
        fprintf(stderr, "beside_omp: no libgomp.so.1 loaded; give --runtime PATH\n");
        return 2;
    }
    if (load_other(runtime)) return 2;

    skv_config cfg = skv_config_default();
    cfg.backend = SKV_BACKEND_CPU;
    cfg.n_layers = layers, cfg.n_q_heads = hq, cfg.n_kv_heads = hk, cfg.head_dim = dim, cfg.rank = rank;
    cfg.budget = budget;
    cfg.batch_size = 1, cfg.max_prompt_len = ctx;
    skv_cache *cache = NULL;
    skv_status st;
    /* keys: a few smooth directions plus noise (low rank, as real keys); values: noise */
    size_t nv = (size_t)ctx * hk * dim;
    skv_bf16 *k = malloc(nv * sizeof *k), *v = malloc(nv * sizeof *v);
    if (!k || !v) return 1;
    uint64_t s = 42;
    for (size_t i = 0; i < nv; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        double noise = (double)(s >> 11) / 9007199254740992.0 - 0.5;
        size_t t = i / ((size_t)hk * dim), c = i % ((size_t)hk * dim);
        double x = 0.1 * noise;
        for (int q = 0; q < 8; q++) x += sin(0.002 * (double)t * (q + 1) + 0.37 * (double)c * (q + 1)) / (q + 1);
        k[i] = to_bf16((float)x);
        v[i] = to_bf16((float)noise);
    }
    printf("beside_omp: cpu prefill of %d layers, Hq %d, Hk %d, D %d, rank %d, %ld tokens; the other runtime: %s "
           "(private copy), one region of %.1f ms per thread before each layer\n",
           layers, hq, hk, dim, rank, ctx, runtime, op_ms);
    double alone[100], beside[100];
    for (int r = 0; r < rounds; r++) {
        for (int mode = 0; mode < 2; mode++) { /* a fresh cache for each pass (not timed) */
            if ((st = skv_cache_create(&cfg, &cache))) {
                fprintf(stderr, "beside_omp: skv_cache_create: %s: %s\n", skv_status_string(st), skv_last_error());
                return 1;
            }
            double total = 0;
            for (int l = 0; l < layers; l++) {
                if (mode) other_parallel(other_work, &op_ms, 0, 0);
                double t0 = now_ms();
                if ((st = skv_prefill(cache, l, 0, ctx, k, v, NULL))) {
                    fprintf(stderr, "beside_omp: skv_prefill: %s: %s\n", skv_status_string(st),
                            skv_cache_last_error(cache));
                    return 1;
                }
                total += now_ms() - t0;
            }
            (mode ? beside : alone)[r] = total;
            skv_cache_free(cache);
        }
        printf("round %d: prefill alone %.1f ms, beside the other runtime %.1f ms\n", r + 1, alone[r], beside[r]);
        fflush(stdout);
    }
    qsort(alone, (size_t)rounds, sizeof *alone, cmp_d);
    qsort(beside, (size_t)rounds, sizeof *beside, cmp_d);
    double ma = alone[rounds / 2], mb = beside[rounds / 2];
    if (rounds % 2 == 0) ma = (alone[rounds / 2 - 1] + ma) / 2, mb = (beside[rounds / 2 - 1] + mb) / 2;
    printf("alone median %.1f ms, beside median %.1f ms, ratio %.2f\n", ma, mb, mb / ma);
    free(k);
    free(v);
    return 0;
}
