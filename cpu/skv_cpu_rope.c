/*
 * RoPE of bf16 rows: the rope slot, and the row function rebuild_keys uses.
 */
#include "skv_cpu_simd.h"
#include "skv_cpu_kernels.h"

#if SKV_CPU_X86
SKV_CPU_AVX2 static void skv_cpu_to_f32_avx2(const skv_bf16 *in, float *out, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, skv_cpu_ld8(in + i));
    for (; i < n; i++) out[i] = skv_bf16_to_f32(in[i]);
}

/*
 * skv_rope_row_f32, vectorized over pairs for the rotate-half layout: the same
 * fmaf/mul per element and the same bf16 rounding, so the output is identical
 * (tests compare rope bit for bit against ref). Interleaved pairs and short
 * rotary halves go through the shared scalar function (flatten: inlined, so
 * its fmaf is one instruction).
 */
SKV_CPU_AVX2 __attribute__((flatten)) static void skv_cpu_rope_row_avx2(const float *x, int D, int R,
                                                                       int interleaved, const float *cs,
                                                                       const float *sn, skv_bf16 *out)
{
    int h2 = R / 2;
    if (interleaved || h2 < 8) {
        skv_rope_row_f32(x, D, R, interleaved, cs, sn, out);
        return;
    }
    int i = 0;
    for (; i + 8 <= h2; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + h2);
        __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(sn + i);
        __m256 nbs = _mm256_xor_ps(_mm256_mul_ps(b, s), _mm256_set1_ps(-0.0f)); /* -(y*s) */
        skv_cpu_st8(out + i, _mm256_fmadd_ps(a, c, nbs));
        skv_cpu_st8(out + i + h2, _mm256_fmadd_ps(b, c, _mm256_mul_ps(a, s)));
    }
    for (; i < h2; i++) {
        float xo, yo;
        skv_rope_rotate(x[i], x[i + h2], cs[i], sn[i], &xo, &yo);
        out[i] = skv_f32_to_bf16(xo);
        out[i + h2] = skv_f32_to_bf16(yo);
    }
    for (int d = R; d < D; d++) out[d] = skv_f32_to_bf16(x[d]);
}
#endif

/* bf16 -> float of n contiguous values. */
void skv_cpu_to_f32(const skv_bf16 *in, float *out, int64_t n)
{
#if SKV_CPU_X86
    if (skv_cpu_simd()) {
        skv_cpu_to_f32_avx2(in, out, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) out[i] = skv_bf16_to_f32(in[i]);
}

/* One row x [D] (float) rotated with the tables' row cs, sn [R/2], rounded to bf16 once. */
void skv_cpu_rope_row(const float *x, int D, int R, int interleaved, const float *cs, const float *sn,
                      skv_bf16 *out)
{
#if SKV_CPU_X86
    if (skv_cpu_simd()) {
        skv_cpu_rope_row_avx2(x, D, R, interleaved, cs, sn, out);
        return;
    }
#endif
    skv_rope_row_f32(x, D, R, interleaved, cs, sn, out);
}

typedef struct {
    const skv_rope_config *rope;
    int32_t D, H, R;
    int64_t pos0, rows;
    const float *cos_tab, *sin_tab;
    const skv_bf16 *in;
    skv_bf16 *out;
} skv_cpu_rope_job;

#define SKV_CPU_ROPE_ROWS 64 /* rows per work item */

static void skv_cpu_rope_item(void *ctx, int64_t it, int t)
{
    const skv_cpu_rope_job *j = ctx;
    int32_t D = j->D, h2 = j->R / 2;
    (void)t;
    for (int64_t row = it * SKV_CPU_ROPE_ROWS; row < (it + 1) * SKV_CPU_ROPE_ROWS && row < j->rows; row++) {
        float x[SKV_CPU_MAX_D]; /* row converted first: in == out is allowed */
        int64_t tok = row / j->H;
        skv_cpu_to_f32(j->in + row * D, x, D);
        skv_cpu_rope_row(x, D, j->R, j->rope->interleaved, j->cos_tab + (j->pos0 + tok) * h2,
                         j->sin_tab + (j->pos0 + tok) * h2, j->out + row * D);
    }
}

skv_status skv_cpu_rope(const skv_rope_config *rope, int32_t D, int64_t n_tokens, int32_t H, int64_t pos0,
                        const float *cos_tab, const float *sin_tab, const skv_bf16 *in, skv_bf16 *out)
{
    skv_cpu_rope_job j = {rope, D, H, rope->rotary_dim ? rope->rotary_dim : D, pos0, n_tokens * H,
                          cos_tab, sin_tab, in, out};
    int64_t items = (j.rows + SKV_CPU_ROPE_ROWS - 1) / SKV_CPU_ROPE_ROWS;
    skv_cpu_run(skv_cpu_team(items), items, skv_cpu_rope_item, &j);
    return SKV_OK;
}
