/*
 * skv_cuda_canon_i8.h - the canonical route's exact Gram S = X^T X (lib/skv_factor_canon.h step 2)
 * on int8 tensor cores, the plan and the integer helpers: host C99 and CUDA alike (the cuda
 * backend's skv_cuda_factor_canon.cu launches it; dev/cuda/canon_i8_emul.c runs the same
 * helpers on the host against a plain double S).
 *
 * Slicing. x = x_ti is an integer with |x| <= 2^(F+1) (step 1). Signed radix-128 digits:
 *   q_0 = x; for k = 0 .. s-2: x_k = ((q_k + 64) mod 128) - 64 in [-64, 63],
 *                              q_(k+1) = (q_k - x_k) / 128 (exact);
 *   x_(s-1) = q_(s-1); so x = sum_k 2^(7k) x_k.
 * Bound: if |q_k| <= 2^m with m >= 7, then q_(k+1) <= (2^m + 64) / 128 = 2^(m-7) + 1/2 and
 * q_(k+1) >= (-2^m - 63) / 128 > -2^(m-7) - 1/2, so (an integer) |q_(k+1)| <= 2^(m-7). With
 * s = skv_cc_i8_slices(F) = 1 + ceil((F - 5) / 7) (1 for F <= 5): 7 (s - 1) < F + 2, so every
 * step k <= s-2 starts from m = F + 1 - 7k >= F + 1 - 7 (s - 2) > 6, i.e. m >= 7, and the top digit
 * has |x_(s-1)| <= 2^(F + 1 - 7 (s - 1)) <= 2^6 (as 7 (s - 1) >= F - 5). Every digit lies in
 * [-64, 64]: an int8, and every digit product is at most 2^12 in magnitude.
 * F = floor((51 - ceil(log2 n)) / 2) is at most 25 (n <= 2), so s <= 4:
 *   F <= 5: 1, F in [6, 12]: 2, [13, 19]: 3 (64k, 128k: F = 17), [20, 26]: 4 (n <= 2048).
 *
 * Products. S = sum over digit pairs 2^(7(a+b)) X_a^T X_b; by symmetry X_b^T X_a = (X_a^T X_b)^T,
 * so only a <= b are computed: s (s + 1) / 2 products (6 at s = 3), as s GEMMs, one per b:
 * [X_0 .. X_b]^T X_b, int8 x int8 -> int32 (cublasGemmEx, CUBLAS_COMPUTE_32I, TN: both operands
 * k-contiguous). Over a chunk of K rows each int32 entry is at most K 2^12 in magnitude (every
 * partial sum too, whatever cuBLAS's split or order), below 2^31 for K <= SKV_CC_I8_MAXK =
 * 2^19 - 1: token blocks accumulate into the int32 products with beta = 1 until a chunk is full,
 * then a combine kernel adds S_chunk into the double G:
 *   S_ij = sum_(a<=b) 2^(7(a+b)) (P_ab[i][j] + (a < b ? P_ab[j][i] : 0))   in int64.
 * Each weighted term is at most K 2^(2F+2) <= 2^53 (2^(7a) |x_a| <= 2^(F+1) for every digit: the
 * top one by the bound above, the lower ones as 2^(7a + 6) <= 2^(7 (s-2) + 6) < 2^(F+1)), so at
 * most 16 of them stay below 2^57: no int64 overflow, and the int64 sum is S_chunk exactly,
 * |S_chunk| <= K 2^(2F+2) <= 2^53, a double exactly; the chunk sums added in double are partial
 * sums of S, integers of at most n 2^(2F+2) <= 2^53: exact (step 2's bound).
 *
 * Layout (in the factor's scratch, sized at create): the int32 products first, column block b
 * ([(b+1) d4, d4] column major, ld (b+1) d4, block (a, b) at row a d4) at acc_off[b]; then nbuf
 * (1 or 2) buffers of digit planes, buf_bytes = s plane_bytes apart, each holding one token
 * block: plane k = X_k^T column major [rows, d4] (ld = rows, the block capacity: a column of X_k
 * is contiguous), planes plane_bytes apart; d4 = d rounded up to 4, rows a multiple of 128;
 * columns d .. d4-1 and the rows past a block's end are zeros. With two buffers token block j
 * uses buffer j mod 2, so the planes of block j + 1 can be written while the GEMMs read block j's
 * (skv_cc_gram); the products and chunks do not depend on nbuf.
 */
#ifndef SKV_CUDA_CANON_I8_H
#define SKV_CUDA_CANON_I8_H

#include <stddef.h>
#include <stdint.h>

#include "skv_factor_canon.h"

/* Rows per int32 accumulation (chunk): K 2^12 <= 2^31 - 1. */
#define SKV_CC_I8_MAXK ((int64_t)524287)
#define SKV_CC_I8_MAXS 4
/* Token-block rows are a multiple of this (the slice kernel's tile). */
#define SKV_CC_I8_ROWQ 128
/* create grows the scratch for the int8 Gram (4 digits, one 128-row block) up to this many
   bytes; a larger need (d above ~1260) keeps the scratch and, where the plan does not fit,
   the DSYRK path runs. */
#define SKV_CC_I8_GROW_CAP ((size_t)64 << 20)

/* s: the digits of an |x| <= 2^(F+1). */
SKV_CHD int skv_cc_i8_slices(int32_t F) { return F <= 5 ? 1 : 1 + (F - 5 + 6) / 7; }

/* The digits of x (|x| <= 2^(F+1), s = skv_cc_i8_slices(F)): byte k = x_k (two's complement). */
SKV_CHD uint32_t skv_cc_i8_pack(int32_t x, int s)
{
    uint32_t p = 0;
    int32_t q = x;
    for (int k = 0; k < s - 1; k++) {
        int32_t dk = ((q + 64) & 127) - 64; /* (q + 64) mod 128 in two's complement */
        q = (q - dk) >> 7;                  /* exact: q - dk is a multiple of 128 (arithmetic shift) */
        p |= ((uint32_t)dk & 0xffu) << (8 * k);
    }
    p |= ((uint32_t)q & 0xffu) << (8 * (s - 1));
    return p;
}

/* skv_canon_fix(a, F, e) in integer arithmetic, for a bf16 a of a column with scale e >= ex(|a|)
   (e is the column's max, so every element qualifies) and F <= 25: a = +-m 2^(E-7) with m the 8-bit
   significand (the implicit bit for a normal, E = field - 127; m = the fraction, E = -126 for a
   subnormal), so a 2^(F-e) = +-m 2^sh, sh = E - 7 + F - e <= F - 7 <= 18: a left shift (|x| <= 2^26)
   or, for sh < 0, m / 2^-sh rounded to nearest even: the quotient, plus one where the remainder is
   above half or exactly half with an odd quotient (m < 2^8: for -sh >= 9 the result is 0, so the
   shift is clamped to 16). rint of the exact double product is that same value (the rounding is
   symmetric in the sign); canon_i8_emul.c compares the two on every finite bf16, every
   admissible e and F = 0..25. No double operations and no branch: both shifts are computed and one
   is selected. */
SKV_CHD int32_t skv_cc_i8_fix_bf16(uint16_t a, int32_t F, int32_t e)
{
    /* both roundings computed and one selected (no divergent branch in a warp of mixed exponents);
       zero (m = 0) gives 0 either way */
    const uint32_t mag = a & 0x7fffu, field = mag >> 7;
    const int32_t m = (int32_t)(field ? (mag & 0x7fu) | 0x80u : mag), E = field ? (int32_t)field - 127 : -126;
    const int32_t sh = E - 7 + F - e;
    const int32_t up = m << (sh < 0 ? 0 : sh < 23 ? sh : 23); /* sh <= 18 where e >= E */
    const int32_t r = -sh < 1 ? 1 : -sh < 16 ? -sh : 16;
    const int32_t q = m >> r, rem = m & ((1 << r) - 1), half = 1 << (r - 1);
    const int32_t dn = q + (rem > half || (rem == half && (q & 1)));
    const int32_t v = sh >= 0 ? up : dn;
    return a & 0x8000u ? -v : v;
}

typedef struct skv_cc_i8_plan {
    int s;
    int nbuf;                       /* buffers of digit planes: 1 or 2 */
    int32_t d4;
    size_t acc_off[SKV_CC_I8_MAXS]; /* int32 elements from the scratch's start */
    size_t planes_off;              /* bytes from the scratch's start: buffer 0 */
    size_t plane_bytes;             /* d4 rows */
    size_t buf_bytes;               /* s plane_bytes: buffer 1 at planes_off + buf_bytes */
    int64_t rows;                   /* block capacity (ld of a plane), a multiple of SKV_CC_I8_ROWQ */
    int64_t chunk_rows;             /* rows per int32 accumulation: a multiple of rows, <= SKV_CC_I8_MAXK */
} skv_cc_i8_plan;

static inline size_t skv_cc_i8_up(size_t v, size_t q) { return (v + q - 1) / q * q; }

/* The bytes of the products of s digits (each column block 256-byte aligned); 0 on overflow. */
static inline size_t skv_cc_i8_acc_bytes(int32_t d, int s, size_t *off)
{
    size_t d4 = skv_cc_i8_up((size_t)d, 4), t = 0;
    if (d4 > ((size_t)1 << 20)) return 0; /* d <= 2^16 in practice; keeps the products below in range */
    for (int b = 0; b < s; b++) {
        if (off) off[b] = t / sizeof(int32_t);
        t += skv_cc_i8_up((size_t)(b + 1) * d4 * d4 * sizeof(int32_t), 256);
    }
    return t;
}

/* What create makes room for: SKV_CC_I8_MAXS digits, one block of SKV_CC_I8_ROWQ rows (0: none). */
static inline size_t skv_cc_i8_need(int32_t d)
{
    size_t acc = skv_cc_i8_acc_bytes(d, SKV_CC_I8_MAXS, NULL);
    if (!acc) return 0;
    return acc + SKV_CC_I8_MAXS * skv_cc_i8_up((size_t)d, 4) * SKV_CC_I8_ROWQ;
}

/* The plan for n rows with s digits and nbuf (1 or 2) buffers of digit planes in a scratch of
   bytes: blocks as large as fit nbuf times after the products, evened out over the blocks n needs.
   0 if not even nbuf SKV_CC_I8_ROWQ-row blocks fit. */
static inline int skv_cc_i8_plan_bufs(int32_t d, int s, int64_t n, size_t bytes, int nbuf, skv_cc_i8_plan *p)
{
    size_t acc = skv_cc_i8_acc_bytes(d, s, p->acc_off);
    if (!acc || acc >= bytes || n < 1 || nbuf < 1 || nbuf > 2) return 0;
    p->s = s;
    p->nbuf = nbuf;
    p->d4 = (int32_t)skv_cc_i8_up((size_t)d, 4);
    p->planes_off = acc;
    int64_t cap = (int64_t)((bytes - acc) / ((size_t)nbuf * (size_t)s * (size_t)p->d4));
    cap -= cap % SKV_CC_I8_ROWQ;
    int64_t maxr = SKV_CC_I8_MAXK - SKV_CC_I8_MAXK % SKV_CC_I8_ROWQ;
    if (cap > maxr) cap = maxr;
    if (cap < SKV_CC_I8_ROWQ) return 0;
    int64_t nb = (n + cap - 1) / cap, r = (n + nb - 1) / nb;
    r = (r + SKV_CC_I8_ROWQ - 1) / SKV_CC_I8_ROWQ * SKV_CC_I8_ROWQ; /* <= cap: cap is a multiple */
    p->rows = r;
    p->plane_bytes = (size_t)p->d4 * (size_t)r;
    p->buf_bytes = (size_t)s * p->plane_bytes; /* a multiple of 512: r is of 128, d4 of 4 */
    p->chunk_rows = SKV_CC_I8_MAXK / r * r;
    return 1;
}

/* One buffer of digit planes (the plan as the probes and the emulation use it). */
static inline int skv_cc_i8_plan_for(int32_t d, int s, int64_t n, size_t bytes, skv_cc_i8_plan *p)
{
    return skv_cc_i8_plan_bufs(d, s, n, bytes, 1, p);
}

#endif
