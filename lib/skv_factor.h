/*
 * skv_factor.h - the fast rank-r key factorization route of the cpu and cuda
 * backends (ref keeps its plain Gram + dsyevr route; cuda's kernels are in
 * cuda/skv_cuda_factor_fast.cu). Host C99; compiles as CUDA too.
 *
 * Goal: U [n, r], W [r, d] with U W = A Q Q^T for an orthonormal d x r basis Q
 * of (nearly) the top-r right singular subspace of A [n, d] (bf16), so that
 * ||A - U W||_F <= 1.005 * the best rank-r error (docs/DESIGN.md section 6). Only the
 * subspace matters, not individual singular vectors: no eigensolver is needed.
 *
 * Routes (skv_factor_route_for):
 *   EXACT  n < d, 2r > d or r > SKV_FACTOR_FAST_MAX_R: the Gram matrix of the smaller side and a full
 *          symmetric eigensolver (cpu: dsyevr; cuda: Xsyevd), as before.
 *   FAST   n >= d, 2r <= d, r <= 160 (every real prompt: d = 1024, r = 160):
 *     1. G = A^T A, d x d in double, summed over fp32 block Grams (bf16
 *        products are exact in fp32; short blocks bound the fp32 sums).
 *     2. X_0 [d, r] = skv_factor_start(i, j): a fixed pseudo-random start, so
 *        the result is deterministic.
 *     3. Subspace iteration, SKV_FACTOR_ITERS times: X <- orth(orth(G X)) for
 *        the first SKV_FACTOR_TWO_PASS_ITERS iterations, X <- orth_e(G X) after.
 *        orth(Y) is shifted Cholesky QR: C = Y^T Y, s = skv_factor_shift(d, r,
 *        tr C), R = chol(C + s I) with pivots floored at SKV_FACTOR_PIVOT_FLOOR
 *        (tr C + r s) (the factor always exists), orth(Y) = Y R^-1. Two passes
 *        keep X orthonormal to rounding whatever the dynamic range of G X; span(X)
 *        is that of plain subspace iteration. orth_e(Y) is one equilibrated
 *        pass: D = diag(C)^-1/2 (1 where C_jj = 0), the same shifted, floored
 *        Cholesky of D C D = R^T R, orth_e(Y) = Y D R^-1. Once a few iterations
 *        have sorted X's columns by eigenvalue, G X has columns of very
 *        different norms but nearly orthogonal, so D C D is well conditioned:
 *        one pass leaves X orthonormal to ~u cond(D C D), and it saves a
 *        Cholesky QR per iteration (from the random start the columns still
 *        mix the top direction, so the first iterations take two passes: with
 *        one equilibrated pass from iteration 1 or 3 on the spike matrix gave
 *        1.0066 and 1.0063 opt, from 4 on 1.0020-1.0022, on the cpu backend,
 *        the benchmark keys unchanged at 2.5e-3 / 2.7e-3 excess). (A Rayleigh-normalized step,
 *        X <- G X (X^T G X + s_H I)^-1, was tried: on the fp32 Gram it needs a
 *        shift s_H that damps every direction below it, 2.4e-2 excess on the
 *        benchmark keys; one Cholesky QR pass per step damps the same way.)
 *     4. Check, after iteration SKV_FACTOR_CHECK_AT (a two-pass one, so X is
 *        orthonormal), H = X^T (G + delta I) X + s_H I = R^T R with delta =
 *        SKV_FACTOR_GRAM_SHIFT32 tr G (the fp32 Gram's definiteness margin)
 *        and s_H = skv_factor_rq_shift(tr H), and rho = 1 / (||R||_F^2
 *        ||R^-1||_F^2) = 1 / (tr H tr H^-1), a lower bound on theta_min /
 *        theta_max of the Ritz values (within a factor ~r^2). When rho <
 *        SKV_FACTOR_TAU (or is not finite), small directions sit at the fp32
 *        Gram's rounding (~1e-7 lambda_1) and may be lost: G is recomputed
 *        with every product summed in double (the FALLBACK Gram) and the
 *        remaining iterations run on it. A dominant direction over a steep
 *        tail (the "spike" test matrix, sigma_r / sigma_1 = 1.6e-5, rho
 *        3.9e-10) and exact low rank fall back; the three test spectra (1/i:
 *        rho 4e-7) and the benchmark's synthetic keys (1.7e-9..1.9e-9, a flat
 *        noise floor at the rank boundary) do not.
 *     5. Q = orth(orth(X)) (one final pass is not enough: after the
 *        equilibrated passes the spike matrix then missed the bound, 1.006 opt);
 *        W = Q^T; U = A Q. Cholesky factorizations per call:
 *        2 SKV_FACTOR_TWO_PASS_ITERS + (SKV_FACTOR_ITERS - SKV_FACTOR_TWO_PASS_ITERS)
 *        + 1 (the check) + 2 = 16.
 *   Convergence: on the three test spectra with d = 1024, r = 160, 10 steps
 *   from the random start leave err / opt - 1 at 1.6e-3, 1e-4 and 1.3e-3 in
 *   double (bound 5e-3); on the benchmark keys 2.5e-3..2.7e-3 (20 steps:
 *   7.7e-4).
 *
 * The route choice (skv_factorize_route, shadowkv.h: skv_config.factorize, or the
 * argument of skv_op_factorize_route):
 *   AUTO (default) | FAST (never fall back) | FALLBACK (always the double
 *   Gram) | EXACT (the EXACT route whatever the shape) | CANONICAL (the
 *   reproducible mode's route, bit for bit the same on every backend:
 *   lib/skv_factor_canon.h, every shape).
 */
#ifndef SKV_FACTOR_H
#define SKV_FACTOR_H

#include <stdint.h>

#include "shadowkv.h"
#include <stdlib.h>
#include <string.h>

#if defined(__CUDACC__)
#define SKV_FHD __host__ __device__ __forceinline__
#else
#define SKV_FHD static inline
#endif

#define SKV_FACTOR_ITERS 10
#define SKV_FACTOR_TWO_PASS_ITERS 3 /* iterations with two Cholesky QR passes; one equilibrated after */

#define SKV_FACTOR_CHECK_AT 2
#if SKV_FACTOR_CHECK_AT > SKV_FACTOR_TWO_PASS_ITERS
#error "the check needs an orthonormal X: its iteration must take two passes"
#endif
#define SKV_FACTOR_TAU 1e-9 /* rho below this: the double Gram */
/* FAST needs r <= this (cuda's Cholesky kernel keeps the r x r block in the registers of one
   thread block; larger ranks take EXACT) */
#define SKV_FACTOR_FAST_MAX_R 160
/* delta / tr(G) of the check: the fp32 block Gram's rounding (~1e-7 lambda_1) can leave it
   slightly indefinite; adding delta I changes no eigenvector. */
#define SKV_FACTOR_GRAM_SHIFT32 0x1p-24
/* Cholesky pivots below this * tr C are raised to it: the factor always exists. */
#define SKV_FACTOR_PIVOT_FLOOR 0x1p-44
/* s_H / tr(H) of the check: above the rounding of H, far below the Ritz values it measures */
#define SKV_FACTOR_RQ_SHIFT 0x1p-40

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

/* s_H for tr(H) = trace, at least 2^-1000. */
SKV_FHD double skv_factor_rq_shift(double trace)
{
    double s = SKV_FACTOR_RQ_SHIFT * trace;
    return s > 0x1p-1000 ? s : 0x1p-1000;
}

/* The route a call takes: mode is the caller's choice (skv_config.factorize or the
   argument of skv_op_factorize_route). */
static inline skv_factor_route skv_factor_route_for(int64_t n, int32_t d, int32_t r, skv_factorize_route mode)
{
    if (mode == SKV_FACTORIZE_EXACT || n < d || 2 * (int64_t)r > d || r > SKV_FACTOR_FAST_MAX_R) return SKV_ROUTE_EXACT;
    return SKV_ROUTE_FAST;
}

#endif
