/*
 * skv_factor.h - the fast rank-r key factorization route of the cpu backend
 * (ref keeps its plain Gram + dsyevr route; cuda runs the Gram + Xsyevd route
 * for now, see cuda/skv_cuda_factor.cu). Host C99; compiles as CUDA too.
 *
 * Goal: U [n, r], W [r, d] with U W = A Q Q^T for an orthonormal d x r basis Q
 * of (nearly) the top-r right singular subspace of A [n, d] (bf16), so that
 * ||A - U W||_F <= 1.005 * the best rank-r error (DESIGN.md section 6). Only the
 * subspace matters, not individual singular vectors: no eigensolver is needed.
 *
 * Routes (skv_factor_route_for):
 *   EXACT  n < d, 2r > d or r > SKV_FACTOR_FAST_MAX_R: the Gram matrix of the smaller side and a full
 *          symmetric eigensolver (cpu: dsyevr; cuda: Xsyevd), as before.
 *   FAST   n >= d, 2r <= d, r <= 160 (every real prompt: d = 1024, r = 160):
 *     1. G = A^T A, d x d in double, summed over fp32 block Grams (bf16
 *        products are exact in fp32; blocks bound the fp32 accumulation),
 *        plus SKV_FACTOR_GRAM_SHIFT32 tr(G) I for definiteness.
 *     2. X_0 [d, r] = skv_factor_start(i, j): a fixed pseudo-random start, so
 *        the result is deterministic.
 *     3. Subspace iteration, SKV_FACTOR_ITERS times, normalized by the Rayleigh
 *        quotient instead of re-orthonormalized: Y = G X, H = X^T Y,
 *        X <- Y (H + s_H I)^-1 with s_H = skv_factor_rq_shift(tr H, G exact?): the
 *        shift covers G's own indefiniteness (fp32 rounding), through the
 *        Cholesky factor of H + s_H I (two triangular solves). span(X) is that
 *        of plain subspace iteration, but X stays well conditioned (~1 + the
 *        unconverged part) whatever the dynamic range of the spectrum, and the
 *        Cholesky of H is sensitive to cond(H) = lambda_1 / lambda_r, not to its
 *        square, so a dominant direction 1e4 sigma above the rest (cond 1e8..1e10)
 *        is fine in double, where Cholesky QR of G X (cond^2) is not.
 *        orth(Y) is shifted Cholesky QR: C = Y^T Y, s = skv_factor_shift(d, r,
 *        tr C), R = chol(C + s I), orth(Y) = Y R^-1. The shift keeps the
 *        Cholesky defined for rank-deficient or badly scaled Y; the basis it
 *        returns is orthonormal up to s / sigma^2 in each direction, and X X^T
 *        is a smooth function of Y Y^T, so nothing mixes across directions.
 *     4. Check, after iteration SKV_FACTOR_CHECK_AT: X <- orth(X) (now
 *        orthonormal), H = X^T G X + s_H I = R^T R (Cholesky), and the
 *        conditioning estimate rho = 1 / (||R||_F^2 ||R^-1||_F^2) =
 *        1 / (tr H tr H^-1), a lower bound on theta_min / theta_max of the
 *        Ritz values (within a factor ~p^2, typically 10..100). The fp32 block
 *        Grams' rounding is ~1e-7 lambda_1, so when rho < SKV_FACTOR_TAU the
 *        small directions may be lost: G is recomputed with every product
 *        summed in double (the FALLBACK Gram) and the remaining iterations run
 *        on it. Every spectrum with lambda_r / lambda_1 < SKV_FACTOR_TAU
 *        (sigma_r / sigma_1 < ~3e-4: a dominant direction, exact low rank)
 *        falls back; the test spectra (1/i: 3.9e-5) do not.
 *     5. Q = orth(orth(X)); W = Q^T; U = A Q.
 *   Convergence: on the three test spectra (1/i, exponential to the bf16
 *   floor, clustered at r) with d = 1024, r = 160, 10 iterations from a random
 *   start leave err / opt - 1 at 1.6e-3, 1e-4 and 1.3e-3 in double (bound 5e-3).
 *
 * SKV_FACTORIZE (environment, read per call; for tests and debugging):
 *   auto (default) | fast (never fall back) | fallback (always the double
 *   Gram) | exact (the EXACT route whatever the shape).
 */
#ifndef SKV_FACTOR_H
#define SKV_FACTOR_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__CUDACC__)
#define SKV_FHD __host__ __device__ __forceinline__
#else
#define SKV_FHD static inline
#endif

#define SKV_FACTOR_ITERS 10
#define SKV_FACTOR_CHECK_AT 2
#define SKV_FACTOR_TAU 1e-9 /* rho below this: the double Gram */
/* FAST needs r <= this (bounds the r x r work per iteration; larger ranks take EXACT) */
#define SKV_FACTOR_FAST_MAX_R 160
/* The fp32 block Gram gets delta I, delta = this * tr G: its rounding (~1e-7 lambda_1) can leave
   it slightly indefinite; a shift of G (unlike one of H) changes no eigenvector and leaves the
   Rayleigh normalization exact, it only slows the separation of directions below delta. */
#define SKV_FACTOR_GRAM_SHIFT32 0x1p-24
/* Cholesky pivots below this * tr C are raised to it: the factor always exists. */
#define SKV_FACTOR_PIVOT_FLOOR 0x1p-44
/* s_H / tr(H): above the indefiniteness of G (fp32 block Grams: ~1e-6 lambda_1; the double
   Gram: ~1e-13), far below the lambda_r the route must resolve on that G */
#define SKV_FACTOR_RQ_SHIFT32 0x1p-18
#define SKV_FACTOR_RQ_SHIFT64 0x1p-40

typedef enum { SKV_FACTOR_AUTO = 0, SKV_FACTOR_FAST, SKV_FACTOR_FALLBACK, SKV_FACTOR_EXACT } skv_factor_mode;
typedef enum { SKV_ROUTE_EXACT = 0, SKV_ROUTE_FAST } skv_factor_route;

/* X_0[i][j] in [-1, 1): splitmix64 of the element index (i * r + j). */
SKV_FHD double skv_factor_start(int64_t i, int64_t j, int32_t r)
{
    uint64_t z = (uint64_t)(i * r + j) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1p-52 - 1.0;
}

/* The Cholesky QR shift for a d x p block with tr(Y^T Y) = trace
   (Fukaya et al., shifted CholeskyQR: 11 (d p + p (p + 1)) u ||Y||^2, with the
   Frobenius norm as the bound on ||Y||_2), at least 2^-1000. */
SKV_FHD double skv_factor_shift(int32_t d, int32_t p, double trace)
{
    double s = 11.0 * ((double)d * p + (double)p * (p + 1)) * 0x1p-53 * trace;
    return s > 0x1p-1000 ? s : 0x1p-1000; /* Y = 0 (a zero matrix): R = 2^-500 I, orth(0) = 0 */
}

/* s_H of step 3 for tr(H) = trace on the fp32 block Gram (double_gram = 0) or the double
   Gram (1), at least 2^-1000. */
SKV_FHD double skv_factor_rq_shift(double trace, int double_gram)
{
    double s = (double_gram ? SKV_FACTOR_RQ_SHIFT64 : SKV_FACTOR_RQ_SHIFT32) * trace;
    return s > 0x1p-1000 ? s : 0x1p-1000;
}

/* SKV_FACTORIZE from the environment (AUTO if unset or unknown). */
static inline skv_factor_mode skv_factor_mode_env(void)
{
    const char *e = getenv("SKV_FACTORIZE");
    if (!e) return SKV_FACTOR_AUTO;
    if (!strcmp(e, "fast")) return SKV_FACTOR_FAST;
    if (!strcmp(e, "fallback")) return SKV_FACTOR_FALLBACK;
    if (!strcmp(e, "exact")) return SKV_FACTOR_EXACT;
    return SKV_FACTOR_AUTO;
}

static inline skv_factor_route skv_factor_route_for(int64_t n, int32_t d, int32_t r, skv_factor_mode mode)
{
    if (mode == SKV_FACTOR_EXACT || n < d || 2 * (int64_t)r > d || r > SKV_FACTOR_FAST_MAX_R) return SKV_ROUTE_EXACT;
    return SKV_ROUTE_FAST;
}

#endif
