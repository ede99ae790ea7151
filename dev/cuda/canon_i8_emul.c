/*
 * canon_i8_emul.c - a host emulation of the cuda canonical route's int8 exact Gram
 * (cuda/skv_cuda_canon_i8.h, the kernels skv_cc_slice / skv_cc_combine and the int8 GEMMs of
 * skv_cc_gram in cuda/skv_cuda_factor_canon.cu), step for step in plain C: the same plan, the two
 * kernels transcribed as launched (grid, threads, shared-memory phases; the digit planes'
 * layout and zero padding, the char4 stores checked aligned and inside the plane; two plane
 * buffers where they fit, block j in buffer j mod 2, as skv_cc_gram chooses; sequentially,
 * so the two streams' ordering is not emulated), each GEMM as int64 sums checked to stay in int32 (every
 * partial sum too: the products of one entry are summed in row order and each running value
 * is checked), beta = 1 within a chunk, the int64 combine into double. Compared bit for bit with
 * the plain double S = X^T X (the rule's step 2) and an int64 S. No GPU needed:
 *
 *   cc -std=c99 -O2 -ffp-contract=off -Iinclude -Ilib -Icuda dev/cuda/canon_i8_emul.c -lm \
 *     -o build/canon_i8_emul && build/canon_i8_emul
 *
 * Also skv_cc_colmax8 (16-byte column max) as launched against the plain column max, and the
 * digit kernel's integer fixed point (skv_cc_i8_fix_bf16) against skv_canon_fix on every finite
 * bf16, F = 0..25 and every admissible column scale (~2.2e8 triples, a few seconds).
 *
 * Cases: the digits of every |x| <= 2^(F+1) for F <= 19 (sampled and extremes above), then
 * Grams on integer X with |x| = 2^(F+1) everywhere (both signs, all negative: S = 2^53 exactly
 * at n = 2^17), random X, bf16 inputs through skv_canon_fix, n not a multiple of the block,
 * several blocks and several chunks (a shortened chunk: the control flow), d not a multiple of
 * 4, and a 524160-row chunk of x = -64 - 64 * 128 (digits -64, -64, 0: the int32 sums reach
 * 524160 * 2^12, 2^31 - 2^19).
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "skv_cuda_canon_i8.h"

static int failures;

static uint64_t rs = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs;
}

static int8_t digit(uint32_t p, int k) { return (int8_t)(uint8_t)(p >> (8 * k)); }

/* The digits of every x in [-2^(F+1), 2^(F+1)] (F <= 19; sampled with the extremes above). */
static void check_digits(void)
{
    for (int32_t F = 0; F <= 25; F++) {
        const int s = skv_cc_i8_slices(F);
        const int64_t X = (int64_t)1 << (F + 1);
        int64_t step = F <= 19 ? 1 : 997, bad = 0;
        for (int64_t x = -X; x <= X; x += (x >= -X + 300 && x <= X - 300 && step > 1) ? step : 1) {
            uint32_t p = skv_cc_i8_pack((int32_t)x, s);
            int64_t back = 0;
            for (int k = s - 1; k >= 0; k--) {
                int dk = digit(p, k);
                if (dk < -64 || dk > 64) bad++;
                if (llabs((int64_t)dk) << (7 * k) > X) bad++; /* 2^(7k) |x_k| <= 2^(F+1) */
                back = back * 128 + dk;
            }
            if (s < 4 && (p >> (8 * s))) bad++;
            if (back != x) bad++;
        }
        if (bad) {
            printf("digits F = %d (s = %d): %lld bad\n", (int)F, s, (long long)bad);
            failures++;
        }
    }
    printf("digits: F = 0..25 checked (s = %d at F = 17, %d at F = 25)\n", skv_cc_i8_slices(17), skv_cc_i8_slices(25));
}

/* skv_cc_i8_fix_bf16 against skv_canon_fix: every finite bf16 (both signs), every F = 0..25 and
   every column scale e >= ex(|a|) the rule can give (e in [ex(|a|), 127]; e = 0 also for a = 0). */
static void check_fix(void)
{
    long long n = 0, bad = 0;
    for (int32_t F = 0; F <= 25; F++)
        for (uint32_t a = 0; a < 0x10000u; a++) {
            if ((a & 0x7f80u) == 0x7f80u) continue; /* inf, nan */
            const int32_t ea = skv_canon_ex_bf16((uint16_t)(a & 0x7fffu));
            for (int32_t e = (a & 0x7fffu) ? ea : -126; e <= 127; e++) {
                const double want = skv_canon_fix((skv_bf16)a, F, e);
                const int32_t got = skv_cc_i8_fix_bf16((uint16_t)a, F, e);
                n++;
                if ((double)got != want || fabs(want) > ldexp(1.0, F + 1)) {
                    if (bad < 5)
                        printf("fix: a = 0x%04x F = %d e = %d: %d, skv_canon_fix %.17g\n", (unsigned)a, (int)F, (int)e,
                               (int)got, want);
                    bad++;
                }
            }
        }
    printf("fix: %lld (a, F, e) compared, %lld differ\n", n, bad);
    failures += bad != 0;
}

/* The emulated route: g [d, d] column major, upper triangle. chunk_rows_override (0: none) shortens
   the chunk (rounded down to a multiple of the block) to run the chunk logic on small n. */
static void emulate(const int32_t *x, int64_t n, int32_t d, int32_t F, size_t bytes, int64_t chunk_rows_override,
                    double *g, int *nblocks, int *nchunks, int *nbuf)
{
    skv_cc_i8_plan p;
    const int s = skv_cc_i8_slices(F);
    /* skv_cc_gram's choice: two buffers of digit planes where they fit, else one */
    if (!skv_cc_i8_plan_bufs(d, s, n, bytes, 2, &p) && !skv_cc_i8_plan_bufs(d, s, n, bytes, 1, &p)) {
        printf("plan does not fit: d = %d, n = %lld, bytes = %zu\n", (int)d, (long long)n, bytes);
        failures++;
        return;
    }
    if (p.planes_off + (size_t)p.nbuf * p.buf_bytes > bytes || p.buf_bytes != (size_t)p.s * p.plane_bytes ||
        p.buf_bytes % 16) {
        printf("plan: %d buffers of %zu bytes from %zu do not fit %zu bytes\n", p.nbuf, p.buf_bytes, p.planes_off, bytes);
        failures++;
        return;
    }
    *nbuf = p.nbuf;
    if (chunk_rows_override) p.chunk_rows = chunk_rows_override / p.rows * p.rows;
    unsigned char *scratch = malloc(bytes); /* stale bytes, as the device scratch holds */
    memset(scratch, 0xa5, bytes);
    int32_t *acc = (int32_t *)scratch;
    *nblocks = *nchunks = 0;
    const int64_t ld = p.rows;
    for (int64_t t0 = 0; t0 < n; t0 += p.rows) {
        const int64_t rows = n - t0 < p.rows ? n - t0 : p.rows, kp = (rows + 15) / 16 * 16;
        /* block j's planes in buffer j mod nbuf */
        int8_t *planes = (int8_t *)(scratch + p.planes_off + (size_t)(*nblocks % p.nbuf) * p.buf_bytes);
        (*nblocks)++;
        /* skv_cc_slice as launched: grid (ceil(d4 / 64), ceil(rows / 128)), 256 threads, its two phases
           (phase 1's element: skv_cc_i8_pack of the integer x, which skv_cc_i8_fix_bf16 gives from the
           bf16, check_fix below); the swizzled shared words poisoned first */
        for (unsigned by = 0; by < (unsigned)((rows + 127) / 128); by++)
            for (unsigned bx = 0; bx < (unsigned)((p.d4 + 63) / 64); bx++) {
                static uint32_t sm[64][128];
                static int hit[64][128];
                memset(sm, 0xa5, sizeof sm);
                memset(hit, 0, sizeof hit);
                const int64_t tt0 = (int64_t)by * 128;
                const int32_t i0 = (int32_t)bx * 64;
                for (int tid = 0; tid < 256; tid++) {
                    const int g = tid & 7;
                    const int32_t c0 = i0 + 8 * g;
                    for (int u = 0; u < 4; u++) {
                        const int tt = tid / 8 + 32 * u;
                        const int64_t t = tt0 + tt;
                        for (int c = 0; c < 8; c++) {
                            uint32_t pk = 0;
                            if (t < rows && c0 + c < d) pk = skv_cc_i8_pack(x[(t0 + t) * d + c0 + c], p.s);
                            sm[8 * g + c][tt ^ (4 * g)] = pk;
                            hit[8 * g + c][tt ^ (4 * g)]++;
                        }
                    }
                }
                for (int ii = 0; ii < 64; ii++)
                    for (int tt = 0; tt < 128; tt++)
                        if (hit[ii][tt] != 1) {
                            printf("slice: shared word (%d, %d) written %d times\n", ii, tt, hit[ii][tt]);
                            failures++;
                        }
                for (int tid = 0; tid < 256; tid++) {
                    const int w = tid / 32, q = tid & 31;
                    for (int j = 0; j < 8; j++) {
                        const int ii = w + 8 * j;
                        const int32_t i = i0 + ii;
                        if (i >= p.d4) break;
                        const int wi = (4 * q) ^ (4 * (ii / 8));
                        if (wi % 4) {
                            printf("slice: misaligned uint4 shared load\n");
                            failures++;
                        }
                        for (int k = 0; k < p.s; k++) {
                            int8_t *dst = planes + (size_t)k * p.plane_bytes + (int64_t)i * ld + tt0 + 4 * q;
                            if ((uintptr_t)dst % 4 || tt0 + 4 * q + 4 > ld) {
                                printf("slice: misaligned or out-of-plane char4 store\n");
                                failures++;
                            }
                            for (int c = 0; c < 4; c++) dst[c] = (int8_t)(sm[ii][wi + c] >> (8 * k));
                        }
                    }
                }
            }
        const int chunk_first = t0 % p.chunk_rows == 0;
        for (int b = 0; b < p.s; b++) { /* cublasGemmEx T, N: C [(b+1) d4, d4] = A^T B */
            const int m = (b + 1) * p.d4, ldc = m;
            const int8_t *A = planes, *B = planes + (size_t)b * p.plane_bytes;
            int32_t *C = acc + p.acc_off[b];
            for (int j = 0; j < p.d4; j++)
                for (int i = 0; i < m; i++) {
                    int64_t v = chunk_first ? 0 : C[i + (size_t)j * ldc];
                    for (int64_t k = 0; k < kp; k++) {
                        v += (int64_t)A[k + (size_t)i * ld] * B[k + (size_t)j * ld];
                        if (v > INT32_MAX || v < INT32_MIN) {
                            printf("int32 overflow: b = %d, (%d, %d), k = %lld\n", b, i, j, (long long)k);
                            failures++;
                            free(scratch);
                            return;
                        }
                    }
                    C[i + (size_t)j * ldc] = (int32_t)v;
                }
        }
        if (t0 + rows >= n || (t0 + rows) % p.chunk_rows == 0) { /* skv_cc_combine as launched */
            const int first = t0 < p.chunk_rows;
            (*nchunks)++;
            const unsigned gdim = (unsigned)((d + 31) / 32);
            for (unsigned by = 0; by < gdim; by++)
                for (unsigned bx = 0; bx < gdim; bx++) {
                    static int32_t tt[32][33];
                    static long long sum[8][32][4]; /* [ty][tx][q] */
                    const int32_t I0 = (int32_t)by * 32, J0 = (int32_t)bx * 32, d4 = p.d4;
                    if (I0 > J0) continue;
                    memset(sum, 0, sizeof sum);
                    for (int b = 0; b < p.s; b++) {
                        const int64_t ldb = (int64_t)(b + 1) * d4;
                        for (int a_ = 0; a_ <= b; a_++) {
                            const int32_t *pab = acc + p.acc_off[b] + (int64_t)a_ * d4;
                            const long long w = 1LL << (7 * (a_ + b));
                            if (a_ < b)
                                for (int ty = 0; ty < 8; ty++)
                                    for (int tx = 0; tx < 32; tx++)
                                        for (int q = 0; q < 4; q++) {
                                            int32_t i = I0 + ty + 8 * q, j = J0 + tx;
                                            tt[ty + 8 * q][tx] = i < d4 && j < d4 ? pab[j + (int64_t)i * ldb] : 0;
                                        }
                            for (int ty = 0; ty < 8; ty++)
                                for (int tx = 0; tx < 32; tx++)
                                    for (int q = 0; q < 4; q++) {
                                        int32_t i = I0 + tx, j = J0 + ty + 8 * q;
                                        long long v = i < d4 && j < d4 ? (long long)pab[i + (int64_t)j * ldb] : 0;
                                        if (a_ < b) v += tt[tx][ty + 8 * q];
                                        sum[ty][tx][q] += v * w;
                                    }
                        }
                    }
                    for (int ty = 0; ty < 8; ty++)
                        for (int tx = 0; tx < 32; tx++)
                            for (int q = 0; q < 4; q++) {
                                int32_t i = I0 + tx, j = J0 + ty + 8 * q;
                                if (i < d && j < d && i <= j) {
                                    double v = (double)sum[ty][tx][q];
                                    if ((long long)v != sum[ty][tx][q]) {
                                        printf("combine: S_chunk %lld not exact in double\n", sum[ty][tx][q]);
                                        failures++;
                                    }
                                    int64_t k = i + (int64_t)j * d;
                                    g[k] = first ? v : g[k] + v;
                                }
                            }
                }
        }
    }
    free(scratch);
}

/* S in double (the rule's order: any order is exact) and int64; g's upper triangle must match both. */
static void run(const char *what, const int32_t *x, int64_t n, int32_t d, size_t bytes, int64_t chunk_override)
{
    const int32_t F = skv_canon_frac_bits(n);
    double *g = calloc((size_t)d * d, sizeof *g);
    int nb = 0, nc = 0, nbuf = 0;
    emulate(x, n, d, F, bytes, chunk_override, g, &nb, &nc, &nbuf);
    int64_t bad = 0;
    double maxs = 0;
    for (int32_t j = 0; j < d; j++)
        for (int32_t i = 0; i <= j; i++) {
            double sd = 0;
            int64_t si = 0;
            for (int64_t t = 0; t < n; t++) {
                sd = fma((double)x[t * d + i], (double)x[t * d + j], sd);
                si += (int64_t)x[t * d + i] * x[t * d + j];
            }
            double v = g[i + (size_t)j * d];
            if (memcmp(&v, &sd, sizeof v) != 0 || (double)si != sd) bad++;
            if (fabs(sd) > maxs) maxs = fabs(sd);
        }
    printf("%-44s n = %7lld d = %4d F = %2d s = %d: %d blocks (nbuf %d), %d chunks, max |S| = 2^%.3f: %s\n", what,
           (long long)n, (int)d, (int)F, skv_cc_i8_slices(F), nb, nbuf, nc, maxs > 0 ? log2(maxs) : -INFINITY,
           bad ? "MISMATCH" : "bitwise equal");
    if (bad) failures++;
    free(g);
}

enum { G_RANDOM, G_MAXPOS, G_MAXNEG, G_MAXSIGNS, G_BF16, G_LOWDIGITS };

static int32_t *gen(int kind, int64_t n, int32_t d)
{
    const int32_t F = skv_canon_frac_bits(n);
    const int64_t X = (int64_t)1 << (F + 1);
    int32_t *x = malloc((size_t)n * d * sizeof *x);
    if (kind == G_BF16) { /* bf16 columns of different scales through the rule's step 1 */
        skv_bf16 *a = malloc((size_t)n * d * sizeof *a);
        for (int64_t k = 0; k < n * d; k++) {
            int32_t col = (int32_t)(k % d);
            uint16_t ex = (uint16_t)(127 + (col % 7) * 9 - 20 + (int)(rnd() % 5)), mant = (uint16_t)(rnd() & 0x7f);
            a[k] = (skv_bf16)(((rnd() & 1) << 15) | (ex << 7) | mant);
            if (col == 1) a[k] = (skv_bf16)(0x8000u | (0x7fu << 7) | 0x7fu); /* all negative, max mantissa */
        }
        for (int32_t i = 0; i < d; i++) {
            unsigned mx = 0;
            for (int64_t t = 0; t < n; t++) {
                unsigned v = a[t * d + i] & 0x7fffu;
                mx = v > mx ? v : mx;
            }
            int32_t e = skv_canon_ex_bf16((uint16_t)mx);
            for (int64_t t = 0; t < n; t++) x[t * d + i] = (int32_t)skv_canon_fix(a[t * d + i], F, e);
        }
        free(a);
        return x;
    }
    for (int64_t k = 0; k < n * d; k++) {
        switch (kind) {
        case G_RANDOM: x[k] = (int32_t)((int64_t)(rnd() % (uint64_t)(2 * X + 1)) - X); break;
        case G_MAXPOS: x[k] = (int32_t)X; break;
        case G_MAXNEG: x[k] = (int32_t)-X; break;
        case G_MAXSIGNS: x[k] = rnd() & 1 ? (int32_t)X : (int32_t)-X; break;
        default: x[k] = -64 - 64 * 128; break; /* digits -64, -64, 0 */
        }
        if (kind == G_RANDOM && k % 13 == 0) x[k] = rnd() & 1 ? (int32_t)X : (int32_t)-X;
    }
    return x;
}

static void case_(const char *what, int kind, int64_t n, int32_t d, size_t bytes, int64_t chunk_override)
{
    int32_t *x = gen(kind, n, d);
    run(what, x, n, d, bytes, chunk_override);
    free(x);
}

/* skv_cc_colmax8 (cuda/skv_cuda_factor_canon.cu) as launched, against the plain column max. */
static void check_colmax8(int64_t n, int32_t d)
{
    uint16_t *a = malloc(sizeof *a * (size_t)n * d);
    unsigned *cm = calloc((size_t)d, sizeof *cm), *ref = calloc((size_t)d, sizeof *ref);
    for (int64_t k = 0; k < n * d; k++) a[k] = (uint16_t)(rnd() & (rnd() % 3 ? 0x87ffu : 0xffffu)); /* finite or not: bits only */
    for (int64_t k = 0; k < n * d; k++) {
        unsigned v = a[k] & 0x7fffu;
        if (v > ref[k % d]) ref[k % d] = v;
    }
    const unsigned gx = (unsigned)((d / 8 + 31) / 32);
    int64_t gy = 1024 / gx, rows8 = (n + 7) / 8;
    if (gy > rows8) gy = rows8;
    if (gy < 1) gy = 1;
    for (unsigned by = 0; by < (unsigned)gy; by++)
        for (unsigned bx = 0; bx < gx; bx++) {
            static unsigned red[8][32 * 8 + 1];
            for (int ty = 0; ty < 8; ty++)
                for (int tx = 0; tx < 32; tx++) {
                    const int32_t g = (int32_t)bx * 32 + tx, ng = d / 8;
                    unsigned mx[8] = {0};
                    if (g < ng) {
                        const uint16_t *p = a + (size_t)g * 8; /* the uint4 at (const uint4 *) a + g */
                        for (int64_t t = (int64_t)by * 8 + ty; t < n; t += gy * 8) {
                            const uint16_t *v = p + (size_t)t * ng * 8;
                            for (int c = 0; c < 8; c++) {
                                unsigned m = v[c] & 0x7fffu;
                                mx[c] = m > mx[c] ? m : mx[c];
                            }
                        }
                    }
                    for (int c = 0; c < 8; c++) red[ty][tx * 8 + c] = mx[c];
                }
            for (int tid = 0; tid < 256; tid++) {
                unsigned m = 0;
                for (int y = 0; y < 8; y++) m = red[y][tid] > m ? red[y][tid] : m;
                const int32_t col = (int32_t)bx * 256 + tid;
                if (col < d && m > cm[col]) cm[col] = m;
            }
        }
    int bad = memcmp(cm, ref, sizeof *cm * (size_t)d) != 0;
    printf("colmax8 n = %lld d = %d: %s\n", (long long)n, (int)d, bad ? "MISMATCH" : "equal");
    failures += bad;
    free(a);
    free(cm);
    free(ref);
}

int main(void)
{
    check_digits();
    check_fix();
    check_colmax8(1, 8);
    check_colmax8(7, 64);
    check_colmax8(1000, 1024);
    check_colmax8(65536 + 5, 264);
    /* the scratch create gives at d = 1024 (64 MiB); small d: a small scratch forces several blocks */
    const size_t big = (size_t)64 << 20;
    case_("random, n = 1 (F = 25)", G_RANDOM, 1, 33, big, 0);
    case_("max +, n = 2", G_MAXPOS, 2, 8, big, 0);
    case_("max -, n = 3", G_MAXNEG, 3, 8, big, 0);
    case_("max signs, n = 300", G_MAXSIGNS, 300, 64, big, 0);
    case_("random, n = 2048 (F = 20, s = 4)", G_RANDOM, 2048, 40, big, 0);
    case_("random, n = 2049 (F = 19, s = 3)", G_RANDOM, 2049, 40, big, 0);
    case_("bf16, n = 1000, odd d", G_BF16, 1000, 77, big, 0);
    case_("bf16, n = 5000, blocks", G_BF16, 5000, 30, skv_cc_i8_acc_bytes(30, 3, NULL) + 3 * 32 * 1000, 0);
    case_("random, blocks + chunks", G_RANDOM, 5000, 30, skv_cc_i8_acc_bytes(30, 3, NULL) + 3 * 32 * 700, 1500);
    case_("max -, blocks + chunks, n = 2^13 + 5", G_MAXNEG, 8197, 6, skv_cc_i8_acc_bytes(6, 3, NULL) + 3 * 8 * 1024,
          3000);
    case_("bf16, d = 130 (d4 = 132), blocks + chunks", G_BF16, 3000, 130, skv_cc_i8_acc_bytes(130, 3, NULL) + 3 * 132 * 640,
          1300);
    case_("max signs, n = 300, d = 1024 (64 MiB)", G_MAXSIGNS, 300, 1024, big, 0);
    case_("max - (S = 2^53), n = 2^17", G_MAXNEG, 131072, 4, big, 0);
    case_("max signs, n = 65536 + 77", G_MAXSIGNS, 65536 + 77, 5, big, 0);
    case_("random, n = 2^16", G_RANDOM, 65536, 12, big, 0);
    case_("bf16, n = 2^16 + 3", G_BF16, 65539, 9, big, 0);
    case_("digits -64 (int32 bound), n = 524287", G_LOWDIGITS, 524287, 4, skv_cc_i8_acc_bytes(4, 3, NULL) + 3 * 4 * 128, 0);
    case_("max -, two chunks, n = 2^19 + 1 (F = 16)", G_MAXNEG, 524289, 4, big, 0);
    printf("%s\n", failures ? "FAILED" : "all bitwise equal");
    return failures ? 1 : 0;
}
