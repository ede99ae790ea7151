/*
 * Gram matrices A^T A of a bf16 [n, d] matrix for the factorization (AVX2
 * callers only): the double Gram (EXACT route and the FAST route's fallback)
 * and the FAST route's fp32 block Gram.
 */
#include <stdlib.h>

#include "skv_cpu_simd.h"
#include "skv_cpu_kernels.h"

#if SKV_CPU_X86
/*
 * Slice s of S of the packing (bf16 -> double) of a kc-row block at row t0:
 * 6-column slivers xa [kc][6] (the kernel's "a"; stride kc * 6 + 8, each row
 * stored as 8 values, the 2 extra overwritten by the next row or left in the
 * padding) and 8-column slivers xb [kc][8] (its "b"), zero padded past d. A
 * slice is a range of slivers: sequential writes, and the rows read stay in L1.
 */
#define SKV_CPU_KC 256
#define SKV_CPU_PACK_SLICES 8
#define SKV_CPU_XA_STRIDE(kc) ((size_t)(kc) * 6 + 8)

SKV_CPU_AVX2 static void skv_cpu_gram_pack(const skv_bf16 *a, int32_t d, int64_t t0, int64_t kc, int s, int S,
                                           double *xa, double *xb)
{
    const int32_t na = (d + 5) / 6, nb = (d + 7) / 8;
    const skv_bf16 *blk = a + (size_t)t0 * d;
    for (int32_t is = na * s / S; is < na * (s + 1) / S; is++) {
        double *dst = xa + (size_t)is * SKV_CPU_XA_STRIDE(kc);
        int32_t i0 = is * 6;
        if (i0 + 8 <= d) {
            for (int64_t q = 0; q < kc; q++) {
                __m256 x = skv_cpu_ld8(blk + (size_t)q * d + i0);
                _mm256_storeu_pd(dst + q * 6, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
                _mm256_storeu_pd(dst + q * 6 + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
            }
        } else {
            for (int64_t q = 0; q < kc; q++)
                for (int32_t i = 0; i < 6; i++)
                    dst[q * 6 + i] = i0 + i < d ? skv_bf16_to_f32(blk[(size_t)q * d + i0 + i]) : 0.0;
        }
    }
    for (int32_t js = nb * s / S; js < nb * (s + 1) / S; js++) {
        double *dst = xb + (size_t)js * kc * 8;
        int32_t j0 = js * 8;
        if (j0 + 8 <= d) {
            for (int64_t q = 0; q < kc; q++) {
                __m256 x = skv_cpu_ld8(blk + (size_t)q * d + j0);
                _mm256_storeu_pd(dst + q * 8, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
                _mm256_storeu_pd(dst + q * 8 + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
            }
        } else {
            for (int64_t q = 0; q < kc; q++)
                for (int32_t j = 0; j < 8; j++)
                    dst[q * 8 + j] = j0 + j < d ? skv_bf16_to_f32(blk[(size_t)q * d + j0 + j]) : 0.0;
        }
    }
}

/* Strip js (8 columns) of the accumulator += this block's tiles touching the upper triangle. */
SKV_CPU_AVX2 static void skv_cpu_gram_strip(int32_t d, int32_t js, int64_t kc, const double *xa, const double *xb,
                                            double *gs)
{
    int32_t j0 = js * 8, nj = skv_cpu_min(8, d - j0);
    double *strip = gs + (size_t)js * d * 8;
    for (int32_t i0 = 0; i0 < j0 + nj; i0 += 6) {
        double t[48];
        skv_cpu_dkern(kc, xa + (size_t)(i0 / 6) * SKV_CPU_XA_STRIDE(kc), xb + (size_t)js * kc * 8, t);
        for (int32_t i = 0; i < skv_cpu_min(6, d - i0); i++) {
            double *gr = strip + (size_t)(i0 + i) * 8;
            _mm256_storeu_pd(gr, _mm256_add_pd(_mm256_loadu_pd(gr), _mm256_loadu_pd(t + i * 8)));
            _mm256_storeu_pd(gr + 4, _mm256_add_pd(_mm256_loadu_pd(gr + 4), _mm256_loadu_pd(t + i * 8 + 4)));
        }
    }
}

/*
 * G += A^T A (upper triangle, double, row-major d x d) with the 6x8 kernel,
 * A streamed in blocks of KC rows. Each 8-column strip of G is owned by one
 * work item per block and accumulated in block order, so the result does not
 * depend on the thread count; the accumulator is strip-major ([strip][row][8],
 * a tile's rows adjacent in memory) and is added into g at the end. Packing is
 * double-buffered: the items of block b are its strips (longest first) plus
 * slices packing block b+1 for threads that finish early, so there is one
 * job (skv_cpu_run) per block.
 */
/* One job's state of skv_cpu_gram or skv_cpu_fgram (the block in progress; items by job). */
typedef struct {
    const skv_bf16 *a;
    int64_t n, kc, kc1, t1; /* rows; rows of this block; rows and first row of the next one */
    int32_t d, nb;          /* nb: strips */
    float scale;            /* fgram */
    void *xa, *xb, *ya, *yb; /* this block's packing, the next one's */
    double *gs, *g;
} skv_cpu_gram_job;

SKV_CPU_AVX2 static void skv_cpu_gram_pack0(void *ctx, int64_t s, int t)
{
    const skv_cpu_gram_job *j = ctx;
    (void)t;
    skv_cpu_gram_pack(j->a, j->d, 0, j->kc, (int)s, SKV_CPU_PACK_SLICES, j->xa, j->xb);
}

/* Items of block b: its strips (longest first), then slices packing block b + 1. */
SKV_CPU_AVX2 static void skv_cpu_gram_block(void *ctx, int64_t it, int t)
{
    const skv_cpu_gram_job *j = ctx;
    (void)t;
    if (it >= j->nb) skv_cpu_gram_pack(j->a, j->d, j->t1, j->kc1, (int)(it - j->nb), SKV_CPU_PACK_SLICES, j->ya, j->yb);
    else skv_cpu_gram_strip(j->d, j->nb - 1 - (int32_t)it, j->kc, j->xa, j->xb, j->gs);
}

/* g += the accumulator: row i of the strips js >= i / 8 (the upper triangle) */
static void skv_cpu_gram_add(void *ctx, int64_t i, int t)
{
    const skv_cpu_gram_job *j = ctx;
    int32_t d = j->d;
    (void)t;
    for (int32_t js = (int32_t)i / 8; js < j->nb; js++) {
        int32_t j0 = js * 8, nj = skv_cpu_min(8, d - j0);
        const double *src = j->gs + ((size_t)js * d + i) * 8;
        for (int32_t q = 0; q < nj; q++) j->g[(size_t)i * d + j0 + q] += src[q];
    }
}

skv_status skv_cpu_gram(int64_t n, int32_t d, const skv_bf16 *a, double *g)
{
    int32_t na = (d + 5) / 6, nb = (d + 7) / 8;
    int64_t nblk = (n + SKV_CPU_KC - 1) / SKV_CPU_KC;
    size_t half = (size_t)na * SKV_CPU_XA_STRIDE(SKV_CPU_KC) + (size_t)nb * 8 * SKV_CPU_KC; /* one xa + xb */
    double *buf = skv_cpu_alloc(2 * half * sizeof *buf);
    double *gs = calloc((size_t)nb * 8 * d, sizeof *gs); /* [strip][row][8] */
    if (!buf || !gs) {
        free(buf);
        free(gs);
        return SKV_ERR_OUT_OF_MEMORY;
    }
    skv_cpu_gram_job j = {a, n, n < SKV_CPU_KC ? n : SKV_CPU_KC, 0, 0, d, nb, 1.0f, NULL, NULL, NULL, NULL, gs, g};
    j.xa = buf, j.xb = buf + (size_t)na * SKV_CPU_XA_STRIDE(j.kc);
    skv_cpu_run(skv_cpu_team(SKV_CPU_PACK_SLICES), SKV_CPU_PACK_SLICES, skv_cpu_gram_pack0, &j);
    for (int64_t blk = 0; blk < nblk; blk++) { /* one job per block: its items, then the next block's */
        int64_t t0 = blk * SKV_CPU_KC, kc = n - t0 < SKV_CPU_KC ? n - t0 : SKV_CPU_KC;
        int64_t t1 = t0 + kc, kc1 = n - t1 < SKV_CPU_KC ? n - t1 : SKV_CPU_KC;
        double *xa = buf + (size_t)(blk & 1) * half, *ya = buf + (size_t)(~blk & 1) * half;
        int npack = blk + 1 < nblk ? SKV_CPU_PACK_SLICES : 0;
        j.kc = kc, j.kc1 = kc1, j.t1 = t1;
        j.xa = xa, j.xb = xa + (size_t)na * SKV_CPU_XA_STRIDE(kc);
        j.ya = ya, j.yb = ya + (size_t)na * SKV_CPU_XA_STRIDE(kc1);
        skv_cpu_run(skv_cpu_team(nb + npack), nb + npack, skv_cpu_gram_block, &j);
    }
    skv_cpu_run(skv_cpu_team(d), d, skv_cpu_gram_add, &j);
    free(buf);
    free(gs);
    return SKV_OK;
}

/* max |a| of a[lo, hi) as bf16 bits without the sign */
SKV_CPU_AVX2 static unsigned skv_cpu_amax_block(const skv_bf16 *a, int64_t lo, int64_t hi)
{
    int64_t i = lo;
    __m256i v = _mm256_setzero_si256(), mask = _mm256_set1_epi16(0x7fff);
    for (; i + 16 <= hi; i += 16)
        v = _mm256_max_epu16(v, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(a + i)), mask));
    uint16_t lanes[16];
    _mm256_storeu_si256((__m256i *)lanes, v);
    unsigned m = 0;
    for (int l = 0; l < 16; l++) m = lanes[l] > m ? lanes[l] : m;
    for (; i < hi; i++) m = (a[i] & 0x7fffu) > m ? (a[i] & 0x7fffu) : m;
    return m;
}

/*
 * The power-of-two scale of the fp32 products: A * 2^(128 - e), e the biased
 * exponent of max |a| (at least 1), puts max |a| in [2, 4). Scaling by a power
 * of two is exact, so it changes nothing but the range: no fp32 product or sum
 * overflows (|a| up to 3.4e38) and small inputs stay normal.
 */
typedef struct {
    const skv_bf16 *a;
    int64_t count;
    unsigned m; /* atomic: the max so far */
} skv_cpu_amax_job;

#define SKV_CPU_AMAX_B ((int64_t)1 << 16) /* values per work item */

static void skv_cpu_amax_item(void *ctx, int64_t b, int t)
{
    skv_cpu_amax_job *j = ctx;
    (void)t;
    int64_t lo = b * SKV_CPU_AMAX_B, hi = lo + SKV_CPU_AMAX_B < j->count ? lo + SKV_CPU_AMAX_B : j->count;
    unsigned mb = skv_cpu_amax_block(j->a, lo, hi), cur = __atomic_load_n(&j->m, __ATOMIC_RELAXED);
    while (mb > cur && !__atomic_compare_exchange_n(&j->m, &cur, mb, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

int skv_cpu_amax_exp(const skv_bf16 *a, int64_t count)
{
    skv_cpu_amax_job j = {a, count, 0};
    int64_t nb = (count + SKV_CPU_AMAX_B - 1) / SKV_CPU_AMAX_B;
    skv_cpu_run(skv_cpu_team(nb), nb, skv_cpu_amax_item, &j);
    int e = (int)(j.m >> 7) & 0xff;
    return e < 1 ? 1 : e;
}

/*
 * Slice s of S of the packing of a kc-row block at row t0, scaled to float:
 * 6-column slivers xa [kc][6] (stride kc * 6 + 8: each row is stored as 8
 * floats, the 2 extra overwritten by the next row or left in the padding) and
 * 16-column slivers xb [kc][16], zero padded past d. The slice is a range of
 * slivers, so every thread writes sequentially and the rows it reads stay in L1.
 */
SKV_CPU_AVX2 static void skv_cpu_fgram_pack(const skv_bf16 *a, int32_t d, int64_t t0, int64_t kc, int s, int S,
                                            float scale, float *xa, float *xb)
{
    const int32_t na = (d + 5) / 6, nb = (d + 15) / 16;
    const __m256 sc = _mm256_set1_ps(scale);
    const skv_bf16 *blk = a + (size_t)t0 * d;
    for (int32_t is = na * s / S; is < na * (s + 1) / S; is++) {
        float *dst = xa + (size_t)is * SKV_CPU_XA_STRIDE(kc);
        int32_t i0 = is * 6;
        if (i0 + 8 <= d) {
            for (int64_t q = 0; q < kc; q++)
                _mm256_storeu_ps(dst + q * 6, _mm256_mul_ps(skv_cpu_ld8(blk + (size_t)q * d + i0), sc));
        } else {
            for (int64_t q = 0; q < kc; q++)
                for (int32_t i = 0; i < 6; i++)
                    dst[q * 6 + i] = i0 + i < d ? skv_bf16_to_f32(blk[(size_t)q * d + i0 + i]) * scale : 0.0f;
        }
    }
    for (int32_t js = nb * s / S; js < nb * (s + 1) / S; js++) {
        float *dst = xb + (size_t)js * kc * 16;
        int32_t j0 = js * 16;
        if (j0 + 16 <= d) {
            for (int64_t q = 0; q < kc; q++) {
                const skv_bf16 *row = blk + (size_t)q * d + j0;
                _mm256_storeu_ps(dst + q * 16, _mm256_mul_ps(skv_cpu_ld8(row), sc));
                _mm256_storeu_ps(dst + q * 16 + 8, _mm256_mul_ps(skv_cpu_ld8(row + 8), sc));
            }
        } else {
            for (int64_t q = 0; q < kc; q++)
                for (int32_t j = 0; j < 16; j++)
                    dst[q * 16 + j] = j0 + j < d ? skv_bf16_to_f32(blk[(size_t)q * d + j0 + j]) * scale : 0.0f;
        }
    }
}

/*
 * g [d, d] (row-major, full) = (scale A)^T (scale A) as a sum of fp32 block
 * Grams of SKV_CPU_FKC rows: each 6x16 tile of a block is one fp32 kernel call
 * (bf16 products are exact in fp32; the fp32 sum runs over one block), added
 * into a double accumulator in block order. The accumulator is strip-major
 * (16-column strips of the upper triangle, rows contiguous), so a tile's rows
 * are adjacent in memory; each strip is owned by one work item per block, so
 * the result does not depend on the thread count. Packing is double-buffered
 * as in skv_cpu_gram. Finally g = the accumulator, both triangles.
 */
#define SKV_CPU_FKC 256 /* rows of one fp32 block Gram */

/* Strip js (16 columns) of the double accumulator += this block's fp32 tiles touching the upper triangle. */
SKV_CPU_AVX2 static void skv_cpu_fgram_strip(int32_t d, int32_t js, int64_t kc, const float *xa, const float *xb,
                                             double *gs)
{
    int32_t j0 = js * 16, nj = skv_cpu_min(16, d - j0);
    double *strip = gs + (size_t)js * d * 16;
    for (int32_t i0 = 0; i0 < j0 + nj; i0 += 6) {
        float t[96];
        int32_t ni = skv_cpu_min(6, d - i0);
        skv_cpu_skern((int)kc, xa + (size_t)(i0 / 6) * SKV_CPU_XA_STRIDE(kc), xb + (size_t)js * kc * 16, t, 16);
        for (int32_t i = 0; i < ni; i++) {
            double *gr = strip + (size_t)(i0 + i) * 16;
            for (int q = 0; q < 4; q++)
                _mm256_storeu_pd(gr + 4 * q, _mm256_add_pd(_mm256_loadu_pd(gr + 4 * q),
                                                           _mm256_cvtps_pd(_mm_loadu_ps(t + i * 16 + 4 * q))));
        }
    }
}

SKV_CPU_AVX2 static void skv_cpu_fgram_pack0(void *ctx, int64_t s, int t)
{
    const skv_cpu_gram_job *j = ctx;
    (void)t;
    skv_cpu_fgram_pack(j->a, j->d, 0, j->kc, (int)s, SKV_CPU_PACK_SLICES, j->scale, j->xa, j->xb);
}

SKV_CPU_AVX2 static void skv_cpu_fgram_block(void *ctx, int64_t it, int t)
{
    const skv_cpu_gram_job *j = ctx;
    (void)t;
    if (it >= j->nb)
        skv_cpu_fgram_pack(j->a, j->d, j->t1, j->kc1, (int)(it - j->nb), SKV_CPU_PACK_SLICES, j->scale, j->ya, j->yb);
    else skv_cpu_fgram_strip(j->d, j->nb - 1 - (int32_t)it, j->kc, j->xa, j->xb, j->gs);
}

/* g: the 16 x 16 block bb = (ib, jb), ib <= jb, of the upper triangle and its mirror image */
static void skv_cpu_fgram_out(void *ctx, int64_t bb, int t)
{
    const skv_cpu_gram_job *j = ctx;
    int32_t d = j->d, nb = j->nb, ib = (int32_t)bb / nb, jb = (int32_t)bb % nb;
    const double *gs = j->gs;
    (void)t;
    if (ib > jb) return;
    for (int32_t i = ib * 16; i < skv_cpu_min(ib * 16 + 16, d); i++)
        for (int32_t q = jb * 16; q < skv_cpu_min(jb * 16 + 16, d); q++) {
            double x = q >= i ? gs[((size_t)jb * d + i) * 16 + q % 16] : gs[((size_t)ib * d + q) * 16 + i % 16];
            j->g[(size_t)i * d + q] = x;
            j->g[(size_t)q * d + i] = x;
        }
}

skv_status skv_cpu_fgram(int64_t n, int32_t d, const skv_bf16 *a, float scale, double *g)
{
    int32_t na = (d + 5) / 6, nb = (d + 15) / 16;
    int64_t nblk = (n + SKV_CPU_FKC - 1) / SKV_CPU_FKC;
    size_t half = (size_t)na * SKV_CPU_XA_STRIDE(SKV_CPU_FKC) + (size_t)nb * 16 * SKV_CPU_FKC; /* one xa + xb */
    float *buf = skv_cpu_alloc(2 * half * sizeof *buf);
    double *gs = calloc((size_t)nb * 16 * d, sizeof *gs); /* [strip][row][16] */
    if (!buf || !gs) {
        free(buf);
        free(gs);
        return SKV_ERR_OUT_OF_MEMORY;
    }
    skv_cpu_gram_job j = {a, n, n < SKV_CPU_FKC ? n : SKV_CPU_FKC, 0, 0, d, nb, scale, NULL, NULL, NULL, NULL, gs, g};
    j.xa = buf, j.xb = buf + (size_t)na * SKV_CPU_XA_STRIDE(j.kc);
    skv_cpu_run(skv_cpu_team(SKV_CPU_PACK_SLICES), SKV_CPU_PACK_SLICES, skv_cpu_fgram_pack0, &j);
    for (int64_t blk = 0; blk < nblk; blk++) {
        int64_t t0 = blk * SKV_CPU_FKC, kc = n - t0 < SKV_CPU_FKC ? n - t0 : SKV_CPU_FKC;
        int64_t t1 = t0 + kc, kc1 = n - t1 < SKV_CPU_FKC ? n - t1 : SKV_CPU_FKC;
        float *xa = buf + (size_t)(blk & 1) * half, *ya = buf + (size_t)(~blk & 1) * half;
        int npack = blk + 1 < nblk ? SKV_CPU_PACK_SLICES : 0;
        j.kc = kc, j.kc1 = kc1, j.t1 = t1;
        j.xa = xa, j.xb = xa + (size_t)na * SKV_CPU_XA_STRIDE(kc);
        j.ya = ya, j.yb = ya + (size_t)na * SKV_CPU_XA_STRIDE(kc1);
        skv_cpu_run(skv_cpu_team(nb + npack), nb + npack, skv_cpu_fgram_block, &j);
    }
    skv_cpu_run(skv_cpu_team((int64_t)nb * nb), (int64_t)nb * nb, skv_cpu_fgram_out, &j);
    free(buf);
    free(gs);
    return SKV_OK;
}

/* Upper triangle -> lower (row-major symmetric d x d). */
static void skv_cpu_mirror_item(void *ctx, int64_t it, int t)
{
    const skv_cpu_gram_job *j = ctx;
    int32_t d = j->d, i0 = (int32_t)it * 16, i1 = skv_cpu_min(i0 + 16, d);
    double *g = j->g;
    (void)t;
    for (int32_t q = 0; q < i1; q++)
        for (int32_t i = i0 > q + 1 ? i0 : q + 1; i < i1; i++) g[(size_t)i * d + q] = g[(size_t)q * d + i];
}

void skv_cpu_mirror(double *g, int32_t d)
{
    skv_cpu_gram_job j = {0};
    j.d = d, j.g = g;
    int64_t items = (d + 15) / 16;
    skv_cpu_run(skv_cpu_team(items), items, skv_cpu_mirror_item, &j);
}
#endif
