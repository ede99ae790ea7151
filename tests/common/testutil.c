#include "testutil.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>
#include <lapacke.h>

skvt_counts skvt_counts_g;

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void skvt_rng_seed(skvt_rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t skvt_rng_u64(skvt_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double skvt_rng_uniform(skvt_rng *r) { return (double)(skvt_rng_u64(r) >> 11) * 0x1.0p-53; }

double skvt_rng_normal(skvt_rng *r)
{
    double u1 = skvt_rng_uniform(r), u2 = skvt_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

int64_t skvt_rng_range(skvt_rng *r, int64_t lo, int64_t hi)
{
    if (hi <= lo) return lo;
    return lo + (int64_t)(skvt_rng_u64(r) % (uint64_t)(hi - lo + 1));
}

uint64_t skvt_base_seed(const char *test_name)
{
    const char *e = getenv("SKV_SEED");
    uint64_t seed = SKVT_DEFAULT_SEED;
    const char *how = "the fixed default; SKV_SEED=random draws a fresh one";
    if (e && !strcmp(e, "random")) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        seed = ((uint64_t)ts.tv_sec * 1000003ull) ^ (uint64_t)ts.tv_nsec;
        seed %= 1000000000000ull;
        how = "drawn because SKV_SEED=random";
    } else if (e && *e) {
        char *end = NULL;
        errno = 0;
        unsigned long long v = strtoull(e, &end, 10);
        if (errno || *end || *e == '-' || *e == '+') {
            /* a typo must not silently run the default: one failed check, then the default */
            skvt_check_(0, __FILE__, __LINE__, "SKV_SEED=\"%s\": expected a decimal number or \"random\"", e);
        } else {
            seed = (uint64_t)v;
            how = "from SKV_SEED";
        }
    }
    printf("%s: seed %llu (%s; replay with SKV_SEED=%llu)\n", test_name, (unsigned long long)seed, how,
           (unsigned long long)seed);
    fflush(stdout);
    return seed;
}

int skvt_check_(int cond, const char *file, int line, const char *fmt, ...)
{
    if (cond) {
        skvt_counts_g.passed++;
        return 1;
    }
    skvt_counts_g.failed++;
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL %s:%d: ", file, line);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
    return 0;
}

void skvt_skip(const char *why)
{
    skvt_counts_g.skipped++;
    printf("SKIP: %s\n", why);
}

int skvt_finish(void)
{
    if (skvt_counts_g.skipped)
        printf("%ld passed, %ld failed, %ld skipped\n", skvt_counts_g.passed, skvt_counts_g.failed,
               skvt_counts_g.skipped);
    else
        printf("%ld passed, %ld failed\n", skvt_counts_g.passed, skvt_counts_g.failed);
    fflush(stdout);
    return skvt_counts_g.failed ? 1 : 0;
}

void skvt_fill_bf16_normal(skvt_rng *r, skv_bf16 *x, size_t n, double scale)
{
    for (size_t i = 0; i < n; i++) x[i] = skv_bf16_from_float((float)(scale * skvt_rng_normal(r)));
}

void skvt_bf16_to_double(const skv_bf16 *x, double *y, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] = (double)skv_bf16_to_float(x[i]);
}

void *skvt_dbuf(skv_backend be, void *host, size_t bytes)
{
    if (be != SKV_BACKEND_CUDA) return host;
    void *d = NULL;
    skv_status st = skv_buffer_alloc(be, bytes ? bytes : 1, &d);
    if (!SKVT_CHECK(st == SKV_OK, "skv_buffer_alloc(%zu): %s", bytes, skv_last_error())) abort();
    return d;
}

void skvt_dput(skv_backend be, void *dev, const void *host, size_t bytes)
{
    if (dev == host || !bytes) return;
    skv_status st = skv_buffer_copy(be, dev, host, bytes);
    if (!SKVT_CHECK(st == SKV_OK, "skv_buffer_copy to device (%zu): %s", bytes, skv_last_error())) abort();
}

void skvt_dget(skv_backend be, void *host, const void *dev, size_t bytes)
{
    if (dev == host || !bytes) return;
    skv_status st = skv_buffer_copy(be, host, dev, bytes);
    if (!SKVT_CHECK(st == SKV_OK, "skv_buffer_copy to host (%zu): %s", bytes, skv_last_error())) abort();
}

void skvt_dfree(skv_backend be, void *dev, void *host)
{
    if (dev != host) skv_buffer_free(be, dev);
}

int skvt_check_status_(skv_status got, skv_status want, const char *what, const char *file, int line)
{
    return skvt_check_(got == want, file, line, "%s: got %s, want %s", what, skv_status_string(got),
                       skv_status_string(want));
}

void skvt_lowrank_prompt(skvt_rng *r, size_t row, int64_t n, skv_bf16 *k, skv_bf16 *v)
{
    double *basis = malloc(sizeof(double) * 4 * row);
    if (!SKVT_CHECK(basis != NULL, "skvt_lowrank_prompt: out of memory")) abort();
    for (size_t i = 0; i < 4 * row; i++) basis[i] = skvt_rng_normal(r);
    for (int64_t t = 0; t < n; t++) {
        double z[4];
        for (int j = 0; j < 4; j++) z[j] = skvt_rng_normal(r);
        for (size_t i = 0; i < row; i++) {
            double x = 0.05 * skvt_rng_normal(r);
            for (int j = 0; j < 4; j++) x += z[j] * basis[(size_t)j * row + i];
            k[(size_t)t * row + i] = skv_bf16_from_float((float)x);
            v[(size_t)t * row + i] = skv_bf16_from_float((float)skvt_rng_normal(r));
        }
    }
    free(basis);
}

double skvt_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void *skvt_xmalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
        exit(2);
    }
    return p;
}

/* m x k (column-major) with orthonormal columns: QR of a Gaussian matrix */
static double *skvt_orthonormal(skvt_rng *r, int m, int k)
{
    double *q = skvt_xmalloc((size_t)m * k * sizeof *q), *tau = skvt_xmalloc((size_t)k * sizeof *tau);
    for (size_t i = 0; i < (size_t)m * k; i++) q[i] = skvt_rng_normal(r);
    LAPACKE_dgeqrf(LAPACK_COL_MAJOR, m, k, q, m, tau);
    LAPACKE_dorgqr(LAPACK_COL_MAJOR, m, k, k, q, m, tau);
    free(tau);
    return q;
}

skv_bf16 *skvt_spectrum_bf16(skvt_rng *r, int n, int d, const double *sigma)
{
    const int k = n < d ? n : d;
    double *q1 = skvt_orthonormal(r, n, k), *q2 = skvt_orthonormal(r, d, k);
    double *a = skvt_xmalloc((size_t)n * d * sizeof *a);
    skv_bf16 *ab = skvt_xmalloc((size_t)n * d * sizeof *ab);
    for (int j = 0; j < k; j++)
        for (int i = 0; i < d; i++) q2[(size_t)j * d + i] *= sigma[j];
    /* row-major A [n, d] is column-major A^T [d, n] = (Q2 diag sigma) Q1^T */
    cblas_dgemm(CblasColMajor, CblasNoTrans, CblasTrans, d, n, k, 1.0, q2, d, q1, n, 0.0, a, d);
    double ss = 0; /* scale to O(1) entries, like real keys */
    for (size_t i = 0; i < (size_t)n * d; i++) ss += a[i] * a[i];
    const double f = 1.0 / sqrt(ss / ((double)n * d));
    for (size_t i = 0; i < (size_t)n * d; i++) ab[i] = skv_bf16_from_float((float)(a[i] * f));
    free(q1), free(q2), free(a);
    return ab;
}
