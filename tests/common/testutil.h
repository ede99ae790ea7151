/*
 * testutil.h - shared by tests, demo and bench: seeded RNG, pass/fail
 * counting and the closing line "N passed, N failed[, N skipped]".
 */
#ifndef SKV_TESTUTIL_H
#define SKV_TESTUTIL_H

#include <stdint.h>
#include <stdio.h>
#include "shadowkv.h"

/* xoshiro256** seeded by splitmix64. */
typedef struct skvt_rng { uint64_t s[4]; } skvt_rng;
void skvt_rng_seed(skvt_rng *r, uint64_t seed);
uint64_t skvt_rng_u64(skvt_rng *r);
double skvt_rng_uniform(skvt_rng *r);          /* [0, 1) */
double skvt_rng_normal(skvt_rng *r);           /* N(0, 1) */
int64_t skvt_rng_range(skvt_rng *r, int64_t lo, int64_t hi); /* [lo, hi] */

/*
 * The run's base seed, printed once on stdout ("<test>: seed N (...; replay
 * with SKV_SEED=N)"):
 *   SKV_SEED unset or empty  SKVT_DEFAULT_SEED, so `make check` is reproducible;
 *   SKV_SEED=random          a fresh seed from the clock (looks for new failures);
 *   SKV_SEED=N               N (replays a printed seed).
 * Any other value is one failed check (the run then uses the default).
 */
#define SKVT_DEFAULT_SEED 2026ull
uint64_t skvt_base_seed(const char *test_name);

/* Counters and the closing line. */
typedef struct skvt_counts { long passed, failed, skipped; } skvt_counts;
extern skvt_counts skvt_counts_g;

/* Records one check; prints "FAIL: ..." with file:line on failure. Returns cond. */
int skvt_check_(int cond, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
#define SKVT_CHECK(cond, ...) skvt_check_(!!(cond), __FILE__, __LINE__, __VA_ARGS__)
/* Status equality check with both names printed; got is evaluated once (it is often a call). */
int skvt_check_status_(skv_status got, skv_status want, const char *what, const char *file, int line);
#define SKVT_CHECK_STATUS(got, want, what) skvt_check_status_((got), (want), (what), __FILE__, __LINE__)
void skvt_skip(const char *why);

/* Prints "N passed, N failed[, N skipped]" and returns the exit code (0 iff no failure). */
int skvt_finish(void);

/* A prompt of n tokens with rows of `row` elements: keys of rank 4 plus 5% noise, normal
   values (k, v [n, row]). */
void skvt_lowrank_prompt(skvt_rng *r, size_t row, int64_t n, skv_bf16 *k, skv_bf16 *v);

/* Helpers on bf16 buffers. */
void skvt_fill_bf16_normal(skvt_rng *r, skv_bf16 *x, size_t n, double scale);
void skvt_bf16_to_double(const skv_bf16 *x, double *y, size_t n);

/* malloc that never returns NULL: out of memory ends the test program (exit 2) with a message. */
void *skvt_xmalloc(size_t bytes);

/* Seconds on the monotonic clock. */
double skvt_now_s(void);

/* A [n, d] row-major = Q1 diag(sigma) Q2^T (Q1, Q2 orthonormal: QR of Gaussian matrices drawn
   from r; sigma has min(n, d) entries), scaled to rms entry 1 and rounded to bf16: a matrix
   of known spectrum for the factorization tests. malloc'ed (skvt_xmalloc). */
skv_bf16 *skvt_spectrum_bf16(skvt_rng *r, int n, int d, const double *sigma);

/*
 * Tensors in the memory a backend takes: for cuda a device buffer (zeroed),
 * for ref/cpu the host array itself (no copy). skvt_dput/skvt_dget copy only
 * when the two differ; skvt_dfree frees only a device buffer. A failure is a
 * failed check (and aborts: a test cannot go on without its buffers).
 */
void *skvt_dbuf(skv_backend be, void *host, size_t bytes);
void skvt_dput(skv_backend be, void *dev, const void *host, size_t bytes);
void skvt_dget(skv_backend be, void *host, const void *dev, size_t bytes);
void skvt_dfree(skv_backend be, void *dev, void *host);

#endif
