/*
 * skv_factor_canon.h - the canonical key factorization (route
 * SKV_FACTORIZE_CANONICAL, docs/DESIGN.md section 10.1): one fixed sequence of
 * IEEE double operations, so that ref, cpu and cuda produce the same U and W
 * bit for bit. This header is the definition: ref runs the skv_canon_ref_*
 * functions below as they are; cpu and cuda run the same element operations in
 * other schedules (blocks, SIMD lanes or threads across independent outputs),
 * every element seeing its terms in the order given here, one fma each.
 * Host C99 (compiled with -ffp-contract=off); the SKV_CHD helpers compile as
 * CUDA device code too, with explicit __dmul_rn/__dadd_rn/__fma_rn so nvcc
 * cannot contract or reassociate.
 *
 * For A [n, d] bf16 and 1 <= r <= min(n, d):
 *
 * 1. Fixed point. e_i = ex(max_t |a_ti|) (skv_canon_ex_bf16; 0 for an all-zero
 *    column), F = skv_canon_frac_bits(n) = floor((51 - ceil(log2 n)) / 2),
 *    x_ti = rne(a_ti 2^(F - e_i)). |a_ti| < 2^(e_i + 1), so |x_ti| <= 2^(F+1)
 *    (a power of two: an exact double; F - e_i lies in [-117, 151], so the
 *    scale is a normal double and the product exact).
 * 2. Exact Gram. S = X^T X: each product is at most 2^(2F+2), a sum of n of
 *    them at most n 2^(2F+2) <= 2^(ceil(log2 n) + 2F + 2) <= 2^53, and every
 *    partial sum is an integer, so any order, blocking or library (OpenBLAS
 *    dsyrk, cuBLAS DSYRK/DGEMM on fp64 tensor cores) computes S exactly.
 *    G_ij = S_ij 2^(e_i + e_j - 2F): e_i + e_j - 2F lies in [-302, 254], so
 *    the scale is a normal double and, S_ij being an integer below 2^53, the
 *    product is exact (no underflow: |G_ij| >= 2^-302 or 0).
 * 3. Subspace iteration in double (skv_canon_ref_subspace):
 *      X_0 [d, r], X_0[i][j] = skv_factor_start(i, j, r);
 *      for it = 0 .. SKV_CANON_ITERS - 1:
 *        Y = G X                            (skv_canon_gx: chains over k)
 *        X = it < SKV_CANON_TWO_PASS_ITERS ? orth(orth(Y)) : orth_e(Y)
 *      Q = orth(X)                          (SKV_CANON_FINAL_PASSES = 1 final plain pass)
 *    orth and orth_e are one shifted Cholesky QR pass on Y [m, p]
 *    (skv_canon_ref_pass, eq = 0 or 1):
 *      C_ij = chain over t = 0..m-1 of fma(Y_ti, Y_tj, acc) (C_ij = C_ji bitwise);
 *      eq = 1 (orth_e, equilibrated): D_j = C_jj > 0 ? 1 / sqrt(C_jj) : 1,
 *        C_ij <- C_ij * (D_i * D_j), Y_tj <- Y_tj * D_j (D = I when eq = 0);
 *      tr = ((C_00 + C_11) + C_22) + ... (from 0, in order of j);
 *      s = skv_canon_shift(m, p, tr); fl = skv_canon_floor(p, tr, s);
 *      Cholesky C + s I = L L^T, column by column (skv_canon_chol_elem): for
 *        j <= i, acc = C_ij (+ s when i == j); acc = fma(-L_ik, L_jk, acc) for
 *        k = 0 .. j-1; diagonal: piv = acc >= fl ? acc : fl, L_jj = sqrt(piv);
 *        below: L_ij = acc / L_jj;
 *      X = Y L^-T, row by row (skv_canon_solve_row): acc = Y_tj;
 *        acc = fma(-X_tk, L_jk, acc) for k = 0 .. j-1; X_tj = acc / L_jj.
 *    Right-looking, left-looking or blocked schedules give the same bits as
 *    long as each element sees its updates in order of k, one fma each.
 *    Shift and floor keep the factor finite whatever Y is: Y = 0 gives
 *    s = 2^-1000, L = 2^-500 I and X = 0. No data-dependent branch: the Gram
 *    is exact, so the iteration count is fixed.
 * 4. Outputs. W_ji = (float) Q_ij. U exactly: Q'_ij = Q_ij 2^(e_i - F) (one
 *    double product; 2^(e_i - F) is normal); per column j, f_j = ex(max_i
 *    |Q'_ij|) (skv_canon_ex_f64; 0 for a zero column); y_ij = rne(Q'_ij
 *    2^(Gb - f_j)) (skv_canon_scale: exact, a scaling up), Gb =
 *    skv_canon_u_bits(n, d) = 51 - F - ceil(log2 d) (>= 10 for every
 *    accepted shape: n < 2^31 gives F <= 25, d <= 2^16), so |y_ij| <=
 *    2^(Gb+1); T = X Y is exact in any order (|partial sum| <= d 2^(F+1)
 *    2^(Gb+1) <= 2^53, integers), and U_tj = (float) skv_canon_scale(T_tj,
 *    f_j - Gb): the scaling is exact unless the result is below 2^-1022,
 *    where its float is 0 whatever the rounding, so U_tj is T_tj 2^(f_j-Gb)
 *    rounded once.
 *
 * Host code assumes IEEE gradual underflow (no flush-to-zero or
 * denormals-are-zero mode set by the caller), as the rest of the project does.
 *
 * Schedule cost at d = 1024, r = 160: 8 products G X (d^2 r each), 2*3 + 5 +
 * 1 = 12 Cholesky QR passes (each Y^T Y and a solve, d r^2, and an r x r
 * Cholesky).
 */
#ifndef SKV_FACTOR_CANON_H
#define SKV_FACTOR_CANON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shadowkv.h"
#include "skv_factor.h"

#if defined(__CUDACC__)
#define SKV_CHD __host__ __device__ __forceinline__
#else
#define SKV_CHD static inline
#endif

/* The iteration count, how many of the first iterations take two plain passes (the rest one
   equilibrated pass), and the plain passes after the last iteration. The FAST route runs 10
   iterations and two final passes on its fp32 Gram; on the exact Gram in double 8 and one
   leave the test spectra's excess at 1.0e-3 (1/i), 2.2e-3 (exp-to-bf16-floor), 1.4e-3
   (clustered) and 2.0e-3 (spike), against 0.4e-3, 2.0e-3, 0.8e-3 and 1.2e-3 with 10 and two
   (bound 5e-3; docs/DESIGN.md 10.1), for 12 Cholesky QR passes and 8 products G X instead
   of 15 and 10. Without the final pass the spike matrix misses the bound (6.8e-2). */
#define SKV_CANON_ITERS 8
#define SKV_CANON_TWO_PASS_ITERS 3
#define SKV_CANON_FINAL_PASSES 1

/* IEEE double operations that nvcc may not contract or reassociate (device), plain
   operators on the host (compiled with -ffp-contract=off). */
#if defined(__CUDA_ARCH__)
#define SKV_CMUL(a, b) __dmul_rn((a), (b))
#define SKV_CADD(a, b) __dadd_rn((a), (b))
#define SKV_CDIV(a, b) __ddiv_rn((a), (b))
#define SKV_CSQRT(a) __dsqrt_rn(a)
#define SKV_CFMA(a, b, c) __fma_rn((a), (b), (c))
#else
#define SKV_CMUL(a, b) ((a) * (b))
#define SKV_CADD(a, b) ((a) + (b))
#define SKV_CDIV(a, b) ((a) / (b))
#define SKV_CSQRT(a) sqrt(a)
#define SKV_CFMA(a, b, c) fma((a), (b), (c))
#endif

/* ceil(log2 n) for n >= 1. */
SKV_CHD int32_t skv_canon_clog2(int64_t n)
{
    int32_t c = 0;
    while (((int64_t)1 << c) < n) c++;
    return c;
}

/* F: the fraction bits of the fixed-point A (n >= 1 rows; 25 at n = 1, 17 at 64k, 10 at 2^31). */
SKV_CHD int32_t skv_canon_frac_bits(int64_t n) { return (51 - skv_canon_clog2(n)) / 2; }

/* Gb: the fraction bits of the fixed-point Q' (step 4). */
SKV_CHD int32_t skv_canon_u_bits(int64_t n, int32_t d) { return 51 - skv_canon_frac_bits(n) - skv_canon_clog2(d); }

/* 2^k as a double, exactly, for k in [-1022, 1023]. */
SKV_CHD double skv_canon_pow2(int32_t k)
{
    uint64_t b = (uint64_t)(k + 1023) << 52;
#if defined(__CUDA_ARCH__)
    return __longlong_as_double((long long)b);
#else
    double x;
    memcpy(&x, &b, sizeof x);
    return x;
#endif
}

/* x 2^k for any k, in steps of at most 2^+-1000 (exact when the result is a normal double
   or a scaling up; it is used only where that holds or the float of the result is 0). */
SKV_CHD double skv_canon_scale(double x, int32_t k)
{
    while (k > 1000) {
        x = SKV_CMUL(x, skv_canon_pow2(1000));
        k -= 1000;
    }
    while (k < -1000) {
        x = SKV_CMUL(x, skv_canon_pow2(-1000));
        k += 1000;
    }
    return SKV_CMUL(x, skv_canon_pow2(k));
}

/* ex(|a|) of a bf16 magnitude (bits & 0x7fff, finite): floor(log2 |a|), -126 for a subnormal,
   0 for zero (an all-zero column's scale). Magnitude bits order like the values, so a
   column's max |a| is the max of its magnitude bits. */
SKV_CHD int32_t skv_canon_ex_bf16(uint16_t mag)
{
    int32_t field = (mag >> 7) & 0xff;
    if (mag == 0) return 0;
    return field == 0 ? -126 : field - 127;
}

/* ex(x) of a finite double: floor(log2 |x|), -1022 for a subnormal, 0 for zero. */
SKV_CHD int32_t skv_canon_ex_f64(double x)
{
    uint64_t b;
#if defined(__CUDA_ARCH__)
    b = (uint64_t)__double_as_longlong(x);
#else
    memcpy(&b, &x, sizeof b);
#endif
    int32_t field = (int32_t)((b >> 52) & 0x7ff);
    if ((b << 1) == 0) return 0;
    return field == 0 ? -1022 : field - 1023;
}

/* x_ti = rne(a 2^(F - e)) for a bf16 a of a column with scale e. */
SKV_CHD double skv_canon_fix(skv_bf16 a, int32_t F, int32_t e)
{
    uint32_t b = (uint32_t)a << 16;
    float f;
#if defined(__CUDA_ARCH__)
    f = __uint_as_float(b);
#else
    memcpy(&f, &b, sizeof f);
#endif
    return rint(SKV_CMUL((double)f, skv_canon_pow2(F - e)));
}

/* The Cholesky QR shift of a pass on Y [m, p] with tr(C) = tr (lib/skv_factor.h's
   skv_factor_shift, spelled with uncontractable operations: the integer product is exact). */
SKV_CHD double skv_canon_shift(int32_t m, int32_t p, double tr)
{
    double k = (double)((int64_t)m * p + (int64_t)p * (p + 1));
    double s = SKV_CMUL(SKV_CMUL(SKV_CMUL(11.0, k), 0x1p-53), tr);
    return s > 0x1p-1000 ? s : 0x1p-1000;
}

/* The pivot floor: SKV_FACTOR_PIVOT_FLOOR (tr + p s). */
SKV_CHD double skv_canon_floor(int32_t p, double tr, double s)
{
    return SKV_CMUL(SKV_FACTOR_PIVOT_FLOOR, SKV_CADD(tr, SKV_CMUL((double)p, s)));
}

/* The equilibration scale D_j of a pass from C_jj. */
SKV_CHD double skv_canon_dscale(double cjj) { return cjj > 0.0 ? SKV_CDIV(1.0, SKV_CSQRT(cjj)) : 1.0; }

/* The pivot rule: L_jj from the diagonal's chain value acc and the floor fl. */
SKV_CHD double skv_canon_pivot(double acc, double fl) { return SKV_CSQRT(acc >= fl ? acc : fl); }

/* ---- the reference schedule (host): ref runs it as written ----------------------------- */

/* Y [d, p] = G [d, d] X [d, p] (row major), each element a chain over k from 0. */
static inline void skv_canon_ref_gx(int32_t d, int32_t p, const double *g, const double *x, double *y)
{
    for (int32_t i = 0; i < d; i++)
        for (int32_t j = 0; j < p; j++) {
            double acc = 0.0;
            for (int32_t k = 0; k < d; k++) acc = SKV_CFMA(g[(size_t)i * d + k], x[(size_t)k * p + j], acc);
            y[(size_t)i * p + j] = acc;
        }
}

/* C [p, p] = Y^T Y for Y [m, p], each element a chain over the row t from 0 (full matrix). */
static inline void skv_canon_ref_cross(int32_t m, int32_t p, const double *y, double *c)
{
    for (int32_t i = 0; i < p; i++)
        for (int32_t j = 0; j < p; j++) {
            double acc = 0.0;
            for (int32_t t = 0; t < m; t++) acc = SKV_CFMA(y[(size_t)t * p + i], y[(size_t)t * p + j], acc);
            c[(size_t)i * p + j] = acc;
        }
}

/* Equilibration (orth_e) of C [p, p] and Y [m, p] in place; dsc [p] gets D. */
static inline void skv_canon_ref_equilibrate(int32_t m, int32_t p, double *c, double *y, double *dsc)
{
    for (int32_t j = 0; j < p; j++) dsc[j] = skv_canon_dscale(c[(size_t)j * p + j]);
    for (int32_t i = 0; i < p; i++)
        for (int32_t j = 0; j < p; j++) c[(size_t)i * p + j] = c[(size_t)i * p + j] * (dsc[i] * dsc[j]);
    for (int32_t t = 0; t < m; t++)
        for (int32_t j = 0; j < p; j++) y[(size_t)t * p + j] = y[(size_t)t * p + j] * dsc[j];
}

/* The trace, shift and floor of C [p, p]: *s and *fl for Y [m, p]. */
static inline void skv_canon_ref_shift(int32_t m, int32_t p, const double *c, double *s, double *fl)
{
    double tr = 0.0;
    for (int32_t j = 0; j < p; j++) tr = tr + c[(size_t)j * p + j];
    *s = skv_canon_shift(m, p, tr);
    *fl = skv_canon_floor(p, tr, *s);
}

/* L [p, p] (lower; the upper part is left alone) = chol(C + s I) with the floor fl, column by
   column (left-looking). */
static inline void skv_canon_ref_chol(int32_t p, const double *c, double s, double fl, double *l)
{
    for (int32_t j = 0; j < p; j++) {
        double acc = c[(size_t)j * p + j] + s;
        for (int32_t k = 0; k < j; k++) acc = fma(-l[(size_t)j * p + k], l[(size_t)j * p + k], acc);
        double ljj = skv_canon_pivot(acc, fl);
        l[(size_t)j * p + j] = ljj;
        for (int32_t i = j + 1; i < p; i++) {
            acc = c[(size_t)i * p + j];
            for (int32_t k = 0; k < j; k++) acc = fma(-l[(size_t)i * p + k], l[(size_t)j * p + k], acc);
            l[(size_t)i * p + j] = acc / ljj;
        }
    }
}

/* X [m, p] = Y L^-T, row by row (x may alias y). */
static inline void skv_canon_ref_solve(int32_t m, int32_t p, const double *l, const double *y, double *x)
{
    for (int32_t t = 0; t < m; t++)
        for (int32_t j = 0; j < p; j++) {
            double acc = y[(size_t)t * p + j];
            for (int32_t k = 0; k < j; k++) acc = fma(-x[(size_t)t * p + k], l[(size_t)j * p + k], acc);
            x[(size_t)t * p + j] = acc / l[(size_t)j * p + j];
        }
}

/* One shifted Cholesky QR pass: X [m, p] = orth(Y) (eq = 0) or orth_e(Y) (eq = 1); Y is
   overwritten (x may alias y). ws: 2 p^2 + p doubles. */
static inline void skv_canon_ref_pass(int32_t m, int32_t p, double *y, double *x, int eq, double *ws)
{
    double *c = ws, *l = ws + (size_t)p * p, *dsc = l + (size_t)p * p, s, fl;
    skv_canon_ref_cross(m, p, y, c);
    if (eq) skv_canon_ref_equilibrate(m, p, c, y, dsc);
    skv_canon_ref_shift(m, p, c, &s, &fl);
    skv_canon_ref_chol(p, c, s, fl, l);
    skv_canon_ref_solve(m, p, l, y, x);
}

/* Step 3: Q [d, r] from the exact G [d, d]. y: d r doubles, ws: 2 r^2 + r doubles. */
static inline void skv_canon_ref_subspace(int32_t d, int32_t r, const double *g, double *q, double *y, double *ws)
{
    for (int32_t i = 0; i < d; i++)
        for (int32_t j = 0; j < r; j++) q[(size_t)i * r + j] = skv_factor_start(i, j, r);
    for (int it = 0; it < SKV_CANON_ITERS; it++) {
        skv_canon_ref_gx(d, r, g, q, y);
        if (it < SKV_CANON_TWO_PASS_ITERS) {
            skv_canon_ref_pass(d, r, y, y, 0, ws);
            skv_canon_ref_pass(d, r, y, q, 0, ws);
        } else
            skv_canon_ref_pass(d, r, y, q, 1, ws);
    }
    for (int k = 0; k < SKV_CANON_FINAL_PASSES; k++) skv_canon_ref_pass(d, r, q, q, 0, ws);
}

/* Step 4's fixed-point Q: from Q [d, r], the column scales e [d] and F, Gb: yq [d, r] (the
   integers y_ij) and f [r] (f_j). */
static inline void skv_canon_ref_qfix(int32_t d, int32_t r, const double *q, const int32_t *e, int32_t F,
                                      int32_t Gb, double *yq, int32_t *f)
{
    for (int32_t j = 0; j < r; j++) {
        double mx = 0.0;
        for (int32_t i = 0; i < d; i++) {
            double v = fabs(q[(size_t)i * r + j] * skv_canon_pow2(e[i] - F));
            mx = v > mx ? v : mx;
        }
        f[j] = skv_canon_ex_f64(mx);
    }
    for (int32_t i = 0; i < d; i++)
        for (int32_t j = 0; j < r; j++)
            yq[(size_t)i * r + j] = rint(skv_canon_scale(q[(size_t)i * r + j] * skv_canon_pow2(e[i] - F), Gb - f[j]));
}

#endif
