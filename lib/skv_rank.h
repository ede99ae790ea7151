/*
 * skv_rank.h - the rank of a slot when config.rank == 0 (docs/DESIGN.md 3.1):
 * the order of U's columns by energy and the stopping rule. static inline,
 * compiles as C99 on the host and as CUDA device code (the cuda backend runs
 * skv_rank_pick in one thread and skv_rank_position per column, in
 * cuda/skv_cuda_factor_rank.cu; ref and cpu run them from lib/skv_cache.c).
 *
 * With U [n, m] and W [m, d] of a factorization at m = rank_max and A the
 * pre-RoPE keys [n, d]:
 *   e_i = the canonical sum over t of U[t,i] * U[t,i]    (skv_rank_col_energies)
 *   T   = the canonical sum over A's elements of x * x   (skv_rank_total_energy)
 * (each product one float rounding; skv_canonical_sum's 256 lanes and tree).
 * Columns go in the stable order of non-increasing e (skv_rank_position), and
 * r is the first i + 1 with T - (e_0 + ... + e_i) <= (target * target) * T
 * (skv_rank_pick; one rounding per operation, in this order), else m.
 */
#ifndef SKV_RANK_H
#define SKV_RANK_H

#include "skv_numerics.h"

/* Column i's place in the stable order of non-increasing energy: the number of
   columns with a larger e, or an equal e and a lower index. e has no NaN (U is
   finite; a square that overflows is +inf, and +inf ties with +inf). */
SKV_HD int32_t skv_rank_position(const float *e, int32_t m, int32_t i)
{
    int32_t p = 0;
    const float x = e[i];
    for (int32_t j = 0; j < m; j++) p += (e[j] > x) || (e[j] == x && j < i);
    return p;
}

/* The rank: e in the sorted order (es[p] = e of the column at place p), m >= 1. */
SKV_HD int32_t skv_rank_pick(const float *es, int32_t m, float T, float target)
{
    const float bound = SKV_MUL(SKV_MUL(target, target), T);
    float E = 0.0f;
    for (int32_t i = 0; i < m; i++) {
        E = SKV_ADD(E, es[i]);
        if (SKV_SUB(T, E) <= bound) return i + 1;
    }
    return m;
}

#if !defined(__CUDACC__)
/* e_0 .. e_{m-1} of U [n, m] (row-major, float) in one pass over U: P [256 * m] is scratch
   (lane k of column i at P[k * m + i]; each lane adds its rows in order, as skv_canonical_sum). */
static inline void skv_rank_col_energies(const float *u, int64_t n, int32_t m, float *P, float *e)
{
    for (int64_t x = 0; x < (int64_t)SKV_CANON_LANES * m; x++) P[x] = 0.0f;
    for (int64_t t = 0; t < n; t++) {
        float *lane = P + (t & (SKV_CANON_LANES - 1)) * (int64_t)m;
        const float *row = u + t * m;
        for (int32_t i = 0; i < m; i++) lane[i] = SKV_ADD(lane[i], SKV_MUL(row[i], row[i]));
    }
    for (int w = SKV_CANON_LANES / 2; w >= 1; w /= 2)
        for (int k = 0; k < w; k++)
            for (int32_t i = 0; i < m; i++) P[k * (int64_t)m + i] = SKV_ADD(P[k * (int64_t)m + i], P[(k + w) * (int64_t)m + i]);
    for (int32_t i = 0; i < m; i++) e[i] = P[i];
}

/* T of A [count] bf16 bits (row-major [n, d] as one sequence). */
static inline float skv_rank_total_energy(const uint16_t *a, int64_t count)
{
    float P[SKV_CANON_LANES];
    for (int k = 0; k < SKV_CANON_LANES; k++) P[k] = 0.0f;
    for (int64_t j = 0; j < count; j++) {
        const float x = skv_bf16_to_f32(a[j]);
        P[j & (SKV_CANON_LANES - 1)] = SKV_ADD(P[j & (SKV_CANON_LANES - 1)], SKV_MUL(x, x));
    }
    return skv_canonical_fold(P);
}
#endif

#endif
