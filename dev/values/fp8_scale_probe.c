/*
 * fp8_scale_probe.c - which scale the fp8 value stores keep (docs/DESIGN.md section 13): the
 * attention output's relative error against exact bf16 values, on the synthetic workload
 * (examples/synth.h, the demo's), for values rounded to fp8 e4m3 with
 *   token   one power-of-two scale per (token, KV head): the library's choice;
 *   chunk   one power-of-two scale per (chunk of c tokens, KV head): 1/c of the scale bytes;
 *   float   one float scale per (token, KV head), max |v| to 448 exactly (the decoded value is not
 *           a bf16 in general; here it stays in double);
 * and bf16 rounding of the attention output alone as a yardstick. Dense attention over the whole
 * prompt (in double) for the queries of STEPS decode steps, every query head; the values of every
 * token are rounded (the library keeps outlier and local-window values exact, so its own error is
 * somewhat lower: the demo's --value-dtype measures that).
 *
 *   cc -std=c99 -O2 -fopenmp -Iinclude -Ilib -Iexamples dev/values/fp8_scale_probe.c examples/synth.c \
 *      build/libshadowkv.a -llapacke -lopenblas -lm -ldl -lpthread -o /tmp/fp8_scale_probe
 *   /tmp/fp8_scale_probe [ctx 16384] [steps 8] [seed 42] [spread 0]
 *
 * spread > 0 scales each token's values (all heads) by 2^-u spread, u uniform in [0, 1) per token:
 * rows of unequal size side by side (the synthetic rows are all of one size; real models have
 * tokens whose values are orders of magnitude smaller than their neighbours').
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shadowkv.h"
#include "skv_numerics.h"
#include "synth.h"

enum { V_EXACT, V_TOKEN, V_CHUNK, V_FLOAT, NV };
static const char *const names[NV] = {"exact", "token", "chunk", "float"};

/* e4m3 round to nearest even of y (|y| <= 448), in double */
static double e4m3_round(double y)
{
    double a = fabs(y);
    if (a == 0) return 0;
    int e;
    frexp(a, &e); /* a = f 2^e, f in [0.5, 1) */
    int q = e - 1 - 3;  /* quantum exponent of a normal: 3 mantissa bits */
    if (q < -9) q = -9; /* subnormals */
    double r = nearbyint(ldexp(a, -q)); /* ties to even (default rounding mode) */
    return copysign(ldexp(r, q), y);
}

int main(int argc, char **argv)
{
    const int64_t n = argc > 1 ? atoll(argv[1]) : 16384;
    const int steps = argc > 2 ? atoi(argv[2]) : 8;
    const uint64_t seed = argc > 3 ? strtoull(argv[3], NULL, 10) : 42;
    const double spread = argc > 4 ? atof(argv[4]) : 0;
    skv_config cfg = skv_config_default();
    cfg.n_layers = 1, cfg.max_prompt_len = n;
    const int Hq = cfg.n_q_heads, Hk = cfg.n_kv_heads, D = cfg.head_dim, c = cfg.chunk_size, G = Hq / Hk;
    skvs_workload w;
    skvs_seq s;
    if (skvs_workload_init(&w, &cfg, n + steps, SKV_BACKEND_CPU) || skvs_seq_generate(&s, &w, n, steps, 0, seed)) {
        fprintf(stderr, "workload: %s\n", skv_last_error());
        return 1;
    }
    const size_t nv = (size_t)n * Hk * D;
    double *v[NV];
    for (int x = 0; x < NV; x++) v[x] = malloc(nv * sizeof **v);
    uint16_t *rec = malloc(skv_value_chunk_bytes(SKV_VALUE_FP8, c, D)), *tmp = malloc((size_t)c * D * 2);
    uint64_t st_ = seed * 2654435761u + 1;
    for (int64_t t = 0; t < n && spread > 0; t++) { /* unequal rows: token t scaled by 2^-u spread */
        st_ = st_ * 6364136223846793005ull + 1442695040888963407ull;
        const double f = exp2(-(double)(st_ >> 11) / 9007199254740992.0 * spread);
        for (size_t i = (size_t)t * Hk * D; i < (size_t)(t + 1) * Hk * D; i++)
            s.v[i] = skv_f32_to_bf16((float)(skv_bf16_to_f32(s.v[i]) * f));
    }
    for (size_t i = 0; i < nv; i++) v[V_EXACT][i] = skv_bf16_to_f32(s.v[i]);
    for (int64_t t = 0; t < n; t++)
        for (int h = 0; h < Hk; h++) {
            const uint16_t *row = s.v + ((size_t)t * Hk + h) * D;
            /* token: the library's encoding */
            skv_fp8_encode_chunk(row, D, 1, D, (uint8_t *)rec);
            skv_fp8_decode_chunk((const uint8_t *)rec, 1, D, tmp);
            double m = 0;
            for (int d = 0; d < D; d++) {
                v[V_TOKEN][((size_t)t * Hk + h) * D + d] = skv_bf16_to_f32(tmp[d]);
                m = fmax(m, fabs(skv_bf16_to_f32(row[d])));
            }
            for (int d = 0; d < D; d++) { /* float: max to 448 */
                double a = skv_bf16_to_f32(row[d]);
                v[V_FLOAT][((size_t)t * Hk + h) * D + d] = m > 0 ? e4m3_round(a * 448.0 / m) * m / 448.0 : 0;
            }
        }
    for (int64_t t0 = 0; t0 < n; t0 += c) /* chunk: one power-of-two exponent over the chunk's rows */
        for (int h = 0; h < Hk; h++) {
            int32_t k = SKV_FP8_EXP_MIN;
            const int64_t t1 = t0 + c < n ? t0 + c : n;
            for (int64_t t = t0; t < t1; t++) {
                int32_t kt = skv_fp8_row_exp(s.v + ((size_t)t * Hk + h) * D, D);
                k = kt > k ? kt : k;
            }
            for (int64_t t = t0; t < t1; t++)
                for (int d = 0; d < D; d++) {
                    size_t i = ((size_t)t * Hk + h) * D + d;
                    v[V_CHUNK][i] = skv_bf16_to_f32(skv_fp8_decode(skv_fp8_encode(s.v[i], k), k));
                }
        }
    /* per step: dense attention of each query head over the prompt, each value variant */
    double err[NV] = {0}, err_max[NV] = {0}, bf16_out = 0;
    uint16_t *q = malloc((size_t)Hq * D * 2), *kk = malloc((size_t)Hk * D * 2), *vv = malloc((size_t)Hk * D * 2);
    double *p = malloc((size_t)n * sizeof *p), *o = malloc((size_t)NV * D * sizeof *o);
    const double scale = 1.0 / sqrt((double)D);
    int32_t needle;
    long n_heads = 0;
    for (int st = 0; st < steps; st++) {
        if (skvs_step(&s, q, kk, vv, &needle)) break;
        for (int hq = 0; hq < Hq; hq++, n_heads++) {
            const int h = hq / G;
            double mx = -INFINITY, sum = 0;
            for (int64_t t = 0; t < n; t++) {
                double dot = 0;
                for (int d = 0; d < D; d++)
                    dot += (double)skv_bf16_to_f32(q[hq * D + d]) * skv_bf16_to_f32(s.k_post[((size_t)t * Hk + h) * D + d]);
                p[t] = dot * scale;
                mx = fmax(mx, p[t]);
            }
            for (int64_t t = 0; t < n; t++) sum += (p[t] = exp(p[t] - mx));
            memset(o, 0, (size_t)NV * D * sizeof *o);
            for (int64_t t = 0; t < n; t++)
                for (int x = 0; x < NV; x++)
                    for (int d = 0; d < D; d++) o[x * D + d] += p[t] / sum * v[x][((size_t)t * Hk + h) * D + d];
            double ref = 0, eb = 0;
            for (int d = 0; d < D; d++) {
                ref += o[d] * o[d];
                double b = skv_bf16_to_f32(skv_f32_to_bf16((float)o[d]));
                eb += (b - o[d]) * (b - o[d]);
            }
            bf16_out += sqrt(eb / ref);
            for (int x = 1; x < NV; x++) {
                double e = 0;
                for (int d = 0; d < D; d++) e += (o[x * D + d] - o[d]) * (o[x * D + d] - o[d]);
                e = sqrt(e / ref);
                err[x] += e;
                err_max[x] = fmax(err_max[x], e);
            }
        }
    }
    printf("{\"probe\": \"fp8_scale\", \"ctx\": %lld, \"steps\": %d, \"seed\": %llu, \"spread\": %.1f, \"hq\": %d, \"hk\": %d, \"dim\": %d, "
           "\"chunk\": %d, \"scale_bytes_per_token_head\": {\"token\": 1, \"chunk\": %.4f, \"float\": 4},\n"
           " \"bf16_output_rounding_rel_err\": %.6f",
           (long long)n, steps, (unsigned long long)seed, spread, Hq, Hk, D, c, 1.0 / c, bf16_out / n_heads);
    for (int x = 1; x < NV; x++)
        printf(",\n \"%s\": {\"rel_err_mean\": %.6f, \"rel_err_max\": %.6f}", names[x], err[x] / n_heads, err_max[x]);
    printf("}\n");
    return 0;
}
