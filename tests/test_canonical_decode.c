/*
 * test_canonical_decode.c - the reproducible mode's canonical key rebuild and
 * canonical attention (docs/DESIGN.md 10.2, 10.3).
 *
 *  1. op level: skv_op_rebuild_keys_canonical and
 *     skv_op_sparse_attention_canonical on ref, cpu and (when available) cuda,
 *     bit for bit, on random and structured inputs (needle keys, ties, zero
 *     rows and columns of U and W, huge and tiny values, many and empty spans,
 *     T = 1, 257 and large); ref against independent transcriptions of the
 *     rules written here (the rebuild with long double and __int128 sums, the
 *     attention with explicit lane arrays); accuracy against double-precision
 *     attention.
 *  2. cache level: caches with config.reproducible = 1 on ref, cpu (and cuda),
 *     the same prefill inputs and several decode steps: every output bit equal;
 *     also with SKV_SELECT_MASS, SKV_BUDGET_ALL and dense layers (trials 9..14), and
 *     with the rescoring of config.select_candidates (trials 15..20: W = S, W > S, W past
 *     every candidate, fixed and mass, SKV_BUDGET_ALL; host-placed values on odd trials).
 *     Prefill in this mode needs the canonical factorization; where a backend
 *     does not have it yet (SKV_ERR_UNSUPPORTED) that backend is a counted skip.
 *  3. the selected span's length with the rescoring, in both modes, on every backend:
 *     SKV_BUDGET_ALL with select_candidates W below the candidates against budget W c with
 *     the same W (the same W chunks per head): outputs bitwise equal (reproducible mode),
 *     within 1e-5 relative (default mode).
 *
 * Seeds: skvt_base_seed (SKV_SEED=N replays). Last line: "N passed, N failed[, N skipped]".
 *
 * --split=0 or --split=1 (cuda): forces the cuda decode rebuild's plain or split form wherever the
 * shape allows the split (automatic otherwise; both must give ref's bits), through the plugin's
 * test hook skv_cuda_test_rebuild_split: in the program when the plugin's archive is linked in,
 * else looked up in the plugin the library opened (libshadowkv-cuda.so.0).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dlfcn.h>

#include "shadowkv.h"
#include "skv_numerics.h"
#include "testutil.h"

static int have_cuda;

/* ---- inputs ---------------------------------------------------------------------------------- */

/* A bf16 of magnitude about 2^e (random sign and significand). */
static skv_bf16 bf16_pow2(skvt_rng *r, int e)
{
    float x = ldexpf((float)(1.0 + skvt_rng_uniform(r)), e);
    if (skvt_rng_u64(r) & 1) x = -x;
    return skv_f32_to_bf16(x);
}

/* Fills x[n] by kind: 0 normal, 1 huge (up to 2^31), 2 tiny (down to subnormals), 3 mixed scales,
   4 few distinct values (ties). */
static void fill_kind(skvt_rng *r, skv_bf16 *x, size_t n, int kind, double scale)
{
    skv_bf16 pool[4];
    for (int i = 0; i < 4; i++) pool[i] = skv_f32_to_bf16((float)(skvt_rng_normal(r) * scale));
    for (size_t i = 0; i < n; i++) {
        switch (kind) {
        case 1: x[i] = bf16_pow2(r, (int)skvt_rng_range(r, 20, 31)); break;
        case 2: x[i] = bf16_pow2(r, (int)skvt_rng_range(r, -133, -100)); break;
        case 3: x[i] = bf16_pow2(r, (int)skvt_rng_range(r, -40, 30)); break;
        case 4: x[i] = pool[skvt_rng_range(r, 0, 3)]; break;
        default: x[i] = skv_f32_to_bf16((float)(skvt_rng_normal(r) * scale)); break;
        }
    }
}

/* ---- the rebuild rule, written independently ------------------------------------------------- */

/* The exponent of the rule: floor(log2 m), -126 for a subnormal m; 0 for m = 0. */
static int ex_of(long double m)
{
    if (m == 0) return 0;
    if (m < ldexpl(1.0L, -126)) return -126;
    return ilogbl(m);
}

/* rne(x 2^s) in long double (exact: x is a bf16, the result is below 2^14). */
static long long fix_of(float x, int s)
{
    return (long long)nearbyintl(ldexpl((long double)x, s));
}

/* k_out [Hk, S*c, D] by the rule: long double fixed point, __int128 sums, one rounding, RoPE. */
static void rebuild_rule(const skv_rope_config *rope, int D, int Hk, int r, int c, int S, const skv_bf16 *u,
                         const skv_bf16 *w, const int32_t *ids, const float *cs, const float *sn, skv_bf16 *k_out)
{
    int R = rope->rotary_dim ? rope->rotary_dim : D, h2 = R / 2;
    long long *xw = malloc(sizeof *xw * (size_t)r * D), *xu = malloc(sizeof *xu * (size_t)r);
    int *ew = malloc(sizeof *ew * (size_t)D);
    float *x = malloc(sizeof *x * (size_t)D);
    for (int h = 0; h < Hk; h++) {
        for (int d = 0; d < D; d++) {
            long double m = 0;
            for (int q = 0; q < r; q++) m = fmaxl(m, fabsl((long double)skv_bf16_to_f32(w[(size_t)q * Hk * D + h * D + d])));
            ew[d] = ex_of(m);
            for (int q = 0; q < r; q++) xw[(size_t)q * D + d] = fix_of(skv_bf16_to_f32(w[(size_t)q * Hk * D + h * D + d]), 12 - ew[d]);
        }
        for (int s = 0; s < S; s++)
            for (int i = 0; i < c; i++) {
                long long t = (long long)ids[h * S + s] * c + i;
                long double m = 0;
                for (int q = 0; q < r; q++) m = fmaxl(m, fabsl((long double)skv_bf16_to_f32(u[t * r + q])));
                int eu = ex_of(m);
                for (int q = 0; q < r; q++) xu[q] = fix_of(skv_bf16_to_f32(u[t * r + q]), 12 - eu);
                for (int d = 0; d < D; d++) {
                    __int128 P = 0;
                    for (int q = 0; q < r; q++) P += (__int128)xu[q] * xw[(size_t)q * D + d];
                    x[d] = (float)ldexpl((long double)P, eu + ew[d] - 24);
                }
                skv_rope_row_f32(x, D, R, rope->interleaved, cs + t * h2, sn + t * h2,
                                 k_out + (((size_t)h * S + s) * c + i) * D);
            }
    }
    free(xw), free(xu), free(ew), free(x);
}

/* ---- the attention rule, written independently ------------------------------------------------ */

/* out [Hq, D]: per query head, all s_j stored, lanes as explicit arrays. Returns 0 on no memory. */
static void attend_rule(int Hq, int Hk, int D, float scale, const skv_bf16 *q, int n_spans, const skv_kv_span *sp,
                        float *out)
{
    int64_t T = 0;
    for (int i = 0; i < n_spans; i++) T += sp[i].n_tokens;
    float *s = malloc(sizeof *s * (size_t)T), *Nl = malloc(sizeof *Nl * 256 * (size_t)D), Zl[256];
    const skv_bf16 **vr = malloc(sizeof *vr * (size_t)T);
    int G = Hq / Hk;
    for (int qi = 0; qi < Hq; qi++) {
        int h = qi / G;
        int64_t j = 0;
        for (int i = 0; i < n_spans; i++)
            for (int64_t t = 0; t < sp[i].n_tokens; t++, j++) {
                const skv_bf16 *k = sp[i].k + h * sp[i].head_stride + t * sp[i].token_stride;
                float acc = 0.0f;
                for (int d = 0; d < D; d++) acc = fmaf(skv_bf16_to_f32(q[(size_t)qi * D + d]), skv_bf16_to_f32(k[d]), acc);
                s[j] = acc * scale;
                vr[j] = sp[i].v + h * sp[i].head_stride + t * sp[i].token_stride;
            }
        float M = s[0];
        for (j = 1; j < T; j++) M = s[j] > M ? s[j] : M;
        for (int l = 0; l < 256; l++) Zl[l] = 0.0f;
        for (size_t i = 0; i < 256 * (size_t)D; i++) Nl[i] = 0.0f;
        for (j = 0; j < T; j++) {
            float e = skv_expf(s[j] - M);
            Zl[j % 256] = Zl[j % 256] + e;
            for (int d = 0; d < D; d++) Nl[(j % 256) * D + d] = fmaf(e, skv_bf16_to_f32(vr[j][d]), Nl[(j % 256) * D + d]);
        }
        for (int wdt = 128; wdt >= 1; wdt /= 2)
            for (int k = 0; k < wdt; k++) {
                Zl[k] = Zl[k] + Zl[k + wdt];
                for (int d = 0; d < D; d++) Nl[k * D + d] = Nl[k * D + d] + Nl[(k + wdt) * D + d];
            }
        for (int d = 0; d < D; d++) out[(size_t)qi * D + d] = Nl[d] / Zl[0];
    }
    free(s), free(Nl), free(vr);
}

/* Double-precision attention; returns max over heads of max_d |out - exact| / max_j |v_j| (per head). */
static double attend_error(int Hq, int Hk, int D, float scale, const skv_bf16 *q, int n_spans, const skv_kv_span *sp,
                           const float *out)
{
    int64_t T = 0;
    for (int i = 0; i < n_spans; i++) T += sp[i].n_tokens;
    double *s = malloc(sizeof *s * (size_t)T), *acc = malloc(sizeof *acc * (size_t)D), worst = 0;
    int G = Hq / Hk;
    for (int qi = 0; qi < Hq; qi++) {
        int h = qi / G;
        double M = -INFINITY, Z = 0, vmax = 0;
        int64_t j = 0;
        for (int i = 0; i < n_spans; i++)
            for (int64_t t = 0; t < sp[i].n_tokens; t++, j++) {
                const skv_bf16 *k = sp[i].k + h * sp[i].head_stride + t * sp[i].token_stride;
                double a = 0;
                for (int d = 0; d < D; d++) a += (double)skv_bf16_to_f32(q[(size_t)qi * D + d]) * skv_bf16_to_f32(k[d]);
                s[j] = a * scale;
                M = s[j] > M ? s[j] : M;
            }
        for (int d = 0; d < D; d++) acc[d] = 0;
        j = 0;
        for (int i = 0; i < n_spans; i++)
            for (int64_t t = 0; t < sp[i].n_tokens; t++, j++) {
                const skv_bf16 *v = sp[i].v + h * sp[i].head_stride + t * sp[i].token_stride;
                double e = exp(s[j] - M);
                Z += e;
                for (int d = 0; d < D; d++) {
                    acc[d] += e * skv_bf16_to_f32(v[d]);
                    vmax = fmax(vmax, fabs(skv_bf16_to_f32(v[d])));
                }
            }
        for (int d = 0; d < D; d++) {
            double err = fabs(out[(size_t)qi * D + d] - acc[d] / Z) / (vmax > 0 ? vmax : 1);
            worst = fmax(worst, err);
        }
    }
    free(s), free(acc);
    return worst;
}

/* ---- op level -------------------------------------------------------------------------------- */

static const skv_backend backends[3] = {SKV_BACKEND_REF, SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
static const char *const be_names[3] = {"ref", "cpu", "cuda"};

/* The rebuild of one case on backend be (cuda: device copies). */
static skv_status run_rebuild(skv_backend be, const skv_rope_config *rope, int D, int Hk, int r, int c, int S,
                              int64_t n, const skv_bf16 *u, const skv_bf16 *w, const int32_t *ids, const float *cs,
                              const float *sn, size_t tab, skv_bf16 *k_out)
{
    size_t ub = (size_t)n * r * 2, wb = (size_t)r * Hk * D * 2, ib = (size_t)Hk * S * 4, kb = (size_t)Hk * S * c * D * 2;
    skv_bf16 *du = skvt_dbuf(be, (void *)u, ub), *dw = skvt_dbuf(be, (void *)w, wb), *dk = skvt_dbuf(be, k_out, kb);
    int32_t *di = skvt_dbuf(be, (void *)ids, ib);
    float *dc = skvt_dbuf(be, (void *)cs, tab * 4), *ds = skvt_dbuf(be, (void *)sn, tab * 4);
    skvt_dput(be, du, u, ub), skvt_dput(be, dw, w, wb), skvt_dput(be, di, ids, ib);
    skvt_dput(be, dc, cs, tab * 4), skvt_dput(be, ds, sn, tab * 4);
    skv_status st = skv_op_rebuild_keys_canonical(be, rope, D, Hk, r, c, S, n, du, dw, di, dc, ds, dk);
    skvt_dget(be, k_out, dk, kb);
    skvt_dfree(be, du, (void *)u), skvt_dfree(be, dw, (void *)w), skvt_dfree(be, dk, k_out);
    skvt_dfree(be, di, (void *)ids), skvt_dfree(be, dc, (void *)cs), skvt_dfree(be, ds, (void *)sn);
    return st;
}

static void rebuild_case(skvt_rng *r, int trial)
{
    static const int dims[] = {64, 128, 96, 40};
    int D = dims[trial % 4], Hk = (int)skvt_rng_range(r, 1, 3), rank = (int)skvt_rng_range(r, 1, 200);
    if (rank > Hk * D) rank = Hk * D;
    int c = (int)skvt_rng_range(r, 1, 9), S = (int)skvt_rng_range(r, 1, 9);
    int64_t n_chunks = S + skvt_rng_range(r, 0, 20), n = n_chunks * c + skvt_rng_range(r, 0, c - 1);
    skv_rope_config rope = {0};
    rope.theta = 10000.0f;
    rope.interleaved = trial % 3 == 1;
    rope.rotary_dim = trial % 5 == 2 ? D / 2 : 0;
    size_t tab = skv_rope_table_len(&rope, D, n);
    float *cs = malloc(tab * 4), *sn = malloc(tab * 4);
    skv_rope_table_build(&rope, D, n, cs, sn);
    skv_bf16 *u = malloc((size_t)n * rank * 2), *w = malloc((size_t)rank * Hk * D * 2);
    int ukind = trial % 5, wkind = (trial / 5) % 5;
    fill_kind(r, u, (size_t)n * rank, ukind, 3.0);
    fill_kind(r, w, (size_t)rank * Hk * D, wkind, 0.1);
    /* structure: zero rows of U, zero columns of W, a needle row, subnormals inside a row */
    for (int64_t t = 0; t < n; t += 3) memset(u + t * rank, 0, (size_t)rank * 2);
    for (int d = 0; d < Hk * D; d += 7)
        for (int q = 0; q < rank; q++) w[(size_t)q * Hk * D + d] = 0;
    if (n > 1) {
        u[1 * rank] = skv_f32_to_bf16(65536.0f);
        if (rank > 1) u[1 * rank + 1] = 0x0001; /* the smallest subnormal beside a large value */
    }
    int32_t *ids = malloc((size_t)Hk * S * 4);
    for (int h = 0; h < Hk; h++) { /* increasing distinct chunk ids */
        int32_t next = 0;
        for (int s = 0; s < S; s++) {
            ids[h * S + s] = next + (int32_t)skvt_rng_range(r, 0, (int)(n_chunks - next - (S - s)));
            next = ids[h * S + s] + 1;
        }
    }
    size_t kn = (size_t)Hk * S * c * D;
    skv_bf16 *want = malloc(kn * 2), *got = malloc(kn * 2);
    rebuild_rule(&rope, D, Hk, rank, c, S, u, w, ids, cs, sn, want);
    for (int b = 0; b < 3; b++) {
        if (b == 2 && !have_cuda) {
            skvt_skip("cuda not available (rebuild)");
            continue;
        }
        memset(got, 0xff, kn * 2);
        skv_status st = run_rebuild(backends[b], &rope, D, Hk, rank, c, S, n, u, w, ids, cs, sn, tab, got);
        if (!SKVT_CHECK_STATUS(st, SKV_OK, "rebuild_keys_canonical")) {
            printf("  %s\n", skv_last_error());
            continue;
        }
        size_t bad = kn;
        for (size_t i = 0; i < kn && bad == kn; i++)
            if (got[i] != want[i]) bad = i;
        SKVT_CHECK(bad == kn,
                   "rebuild trial %d on %s (D %d Hk %d r %d c %d S %d kinds %d/%d): element %zu is 0x%04x, the rule "
                   "gives 0x%04x",
                   trial, be_names[b], D, Hk, rank, c, S, ukind, wkind, bad, bad < kn ? got[bad] : 0,
                   bad < kn ? want[bad] : 0);
    }
    free(cs), free(sn), free(u), free(w), free(ids), free(want), free(got);
}

/* The attention of one case on backend be (cuda: device copies of every span). */
static skv_status run_attention(skv_backend be, int Hq, int Hk, int D, float scale, const skv_bf16 *q, int n_spans,
                                const skv_kv_span *sp, const size_t *span_elems, float *out)
{
    skv_kv_span dsp[SKV_MAX_SPANS];
    skv_bf16 *dq = skvt_dbuf(be, (void *)q, (size_t)Hq * D * 2);
    float *dout = skvt_dbuf(be, out, (size_t)Hq * D * 4);
    skvt_dput(be, dq, q, (size_t)Hq * D * 2);
    for (int i = 0; i < n_spans; i++) {
        dsp[i] = sp[i];
        if (!sp[i].n_tokens) continue;
        dsp[i].k = skvt_dbuf(be, (void *)sp[i].k, span_elems[i] * 2);
        dsp[i].v = skvt_dbuf(be, (void *)sp[i].v, span_elems[i] * 2);
        skvt_dput(be, (void *)dsp[i].k, sp[i].k, span_elems[i] * 2);
        skvt_dput(be, (void *)dsp[i].v, sp[i].v, span_elems[i] * 2);
    }
    skv_status st = skv_op_sparse_attention_canonical(be, Hq, Hk, D, scale, dq, n_spans, dsp, dout);
    skvt_dget(be, out, dout, (size_t)Hq * D * 4);
    for (int i = 0; i < n_spans; i++)
        if (sp[i].n_tokens) {
            skvt_dfree(be, (void *)dsp[i].k, (void *)sp[i].k);
            skvt_dfree(be, (void *)dsp[i].v, (void *)sp[i].v);
        }
    skvt_dfree(be, dq, (void *)q), skvt_dfree(be, dout, out);
    return st;
}

/*
 * One attention case: shape and token counts from the trial, inputs by kind:
 * 0 normal, 1 needle (one key = a multiple of q), 2 ties (every key equal), 3 huge values,
 * 4 tiny values, 5 zero q (uniform weights), 6 a tiny scale (every score about 0; scale 0 would mean
 * 1/sqrt(D)).
 */
static void attention_case(skvt_rng *r, int trial, int64_t T_want, int n_spans, int kind)
{
    static const int dims[] = {128, 64, 32, 72};
    int D = dims[trial % 4], Hk = (int)skvt_rng_range(r, 1, 2), G = (int)skvt_rng_range(r, 1, 4), Hq = Hk * G;
    if (T_want > 20000) D = 32, Hk = 1, Hq = 2;
    skv_kv_span sp[SKV_MAX_SPANS];
    size_t elems[SKV_MAX_SPANS];
    skv_bf16 *bufk[SKV_MAX_SPANS] = {0}, *bufv[SKV_MAX_SPANS] = {0};
    /* split T_want tokens over n_spans spans, some of them empty */
    int64_t left = T_want;
    for (int i = 0; i < n_spans; i++) {
        int64_t t = i == n_spans - 1 ? left : (skvt_rng_uniform(r) < 0.3 ? 0 : skvt_rng_range(r, 0, left));
        left -= t;
        int tokmajor = skvt_rng_uniform(r) < 0.5; /* [T, Hk, D] or [Hk, T, D] */
        sp[i].n_tokens = t;
        sp[i].token_stride = tokmajor ? (int64_t)Hk * D : D;
        sp[i].head_stride = tokmajor ? D : t * D;
        elems[i] = (size_t)t * Hk * D;
        if (!t) {
            sp[i].k = sp[i].v = NULL;
            continue;
        }
        bufk[i] = malloc(elems[i] * 2), bufv[i] = malloc(elems[i] * 2);
        fill_kind(r, bufk[i], elems[i], kind == 3 ? 1 : kind == 4 ? 2 : 0, 1.0);
        fill_kind(r, bufv[i], elems[i], kind == 3 ? 1 : kind == 4 ? 2 : trial % 7 == 3 ? 4 : 0, 1.0);
        sp[i].k = bufk[i], sp[i].v = bufv[i];
    }
    skv_bf16 *q = malloc((size_t)Hq * D * 2);
    fill_kind(r, q, (size_t)Hq * D, kind == 3 ? 1 : kind == 4 ? 2 : 0, kind == 0 ? 0.3 : 1.0);
    if (kind == 5) memset(q, 0, (size_t)Hq * D * 2);
    if (kind == 1 || kind == 2) { /* needle: one key = 4 q of the group's first head; ties: all keys equal */
        int64_t needle = skvt_rng_range(r, 0, T_want - 1), j = 0;
        for (int i = 0; i < n_spans; i++)
            for (int64_t t = 0; t < sp[i].n_tokens; t++, j++)
                for (int h = 0; h < Hk; h++) {
                    skv_bf16 *k = bufk[i] + h * sp[i].head_stride + t * sp[i].token_stride;
                    if (kind == 2) {
                        for (int d = 0; d < D; d++) k[d] = q[(size_t)h * G * D + d];
                    } else if (j == needle) {
                        for (int d = 0; d < D; d++) k[d] = skv_f32_to_bf16(4.0f * skv_bf16_to_f32(q[(size_t)h * G * D + d]));
                    }
                }
    }
    float scale = kind == 6 ? 1e-30f : 1.0f / sqrtf((float)D);
    size_t on = (size_t)Hq * D;
    float *want = malloc(on * 4), *got = malloc(on * 4);
    attend_rule(Hq, Hk, D, scale, q, n_spans, sp, want);
    if (kind != 3 && kind != 4) {
        double err = attend_error(Hq, Hk, D, scale, q, n_spans, sp, want);
        SKVT_CHECK(err < 1e-4, "attention trial %d (T %lld kind %d): error %.3g against double attention", trial,
                   (long long)T_want, kind, err);
    }
    for (int b = 0; b < 3; b++) {
        if (b == 2 && !have_cuda) {
            skvt_skip("cuda not available (attention)");
            continue;
        }
        memset(got, 0xff, on * 4);
        skv_status st = run_attention(backends[b], Hq, Hk, D, scale, q, n_spans, sp, elems, got);
        if (!SKVT_CHECK_STATUS(st, SKV_OK, "sparse_attention_canonical")) {
            printf("  %s\n", skv_last_error());
            continue;
        }
        size_t bad = on;
        for (size_t i = 0; i < on && bad == on; i++)
            if (memcmp(&got[i], &want[i], 4)) bad = i;
        SKVT_CHECK(bad == on,
                   "attention trial %d on %s (Hq %d Hk %d D %d T %lld spans %d kind %d): out[%zu] = %.9g, the rule "
                   "gives %.9g",
                   trial, be_names[b], Hq, Hk, D, (long long)T_want, n_spans, kind, bad, bad < on ? got[bad] : 0.0,
                   bad < on ? want[bad] : 0.0);
    }
    for (int i = 0; i < n_spans; i++) free(bufk[i]), free(bufv[i]);
    free(q), free(want), free(got);
}

/* skv_canonical_attend (the header's code) against the rule written here. */
static void header_attend_case(skvt_rng *r)
{
    int D = 48, T = 700;
    skv_bf16 *q = malloc(D * 2), *k = malloc((size_t)T * D * 2), *v = malloc((size_t)T * D * 2);
    fill_kind(r, q, D, 0, 1.0), fill_kind(r, k, (size_t)T * D, 0, 1.0), fill_kind(r, v, (size_t)T * D, 3, 1.0);
    skv_canon_span cs[3] = {{k, v, 300, D}, {NULL, NULL, 0, D}, {k + 300 * D, v + 300 * D, T - 300, D}};
    skv_kv_span sp[1] = {{k, v, T, 0, D}};
    float *lanes = malloc(sizeof(float) * 256 * (D + 1)), out[48], want[48];
    skv_canonical_attend(q, D, 0.2f, 3, cs, lanes, out);
    attend_rule(1, 1, D, 0.2f, q, 1, sp, want);
    SKVT_CHECK(!memcmp(out, want, sizeof out), "skv_canonical_attend differs from the rule as written in the test");
    free(q), free(k), free(v), free(lanes);
}

/* skv_canon_rebuild_fix against the rule (rne in long double) for every finite bf16 and several exponents. */
static void fix_exhaustive(void)
{
    long bad = 0;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        if (!skv_bf16_isfinite((uint16_t)h)) continue;
        float x = skv_bf16_to_f32((uint16_t)h);
        int ex = x == 0 ? 0 : ex_of(fabsl((long double)x));
        for (int e = ex; e <= ex + 20 && e <= 127; e += 1) {
            if (skv_canon_rebuild_fix((uint16_t)h, e) != fix_of(x, 12 - e)) bad++;
        }
    }
    SKVT_CHECK(bad == 0, "skv_canon_rebuild_fix differs from rne(x 2^(12-e)) in %ld cases", bad);
}

/* ---- cache level ----------------------------------------------------------------------------- */

/* Runs the cache of cfg on backend be; outs[step][B Hq D]. Returns 1 on success, 0 on a skip,
   -1 on a failure (counted). */
static int run_cache(skv_config c, skv_backend be, uint64_t seed, int steps, const int64_t *n, float *outs)
{
    c.backend = be;
    skv_cache *cache = NULL;
    skv_status st = skv_cache_create(&c, &cache);
    if (st == SKV_ERR_UNSUPPORTED) {
        char why[400];
        snprintf(why, sizeof why, "cache on %s: %s", be_names[be == SKV_BACKEND_REF ? 0 : be == SKV_BACKEND_CPU ? 1 : 2],
                 skv_last_error());
        skvt_skip(why);
        return 0;
    }
    if (!SKVT_CHECK_STATUS(st, SKV_OK, "create")) {
        printf("  %s\n", skv_last_error());
        return -1;
    }
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    size_t row = (size_t)c.n_kv_heads * c.head_dim, pb = (size_t)c.max_prompt_len * row * 2;
    skv_bf16 *k = malloc(pb), *v = malloc(pb);
    skv_bf16 *dk = skvt_dbuf(be, k, pb), *dv = skvt_dbuf(be, v, pb);
    int ret = 1;
    for (int l = 0; l < c.n_layers && ret == 1; l++)
        for (int b = 0; b < c.batch_size && ret == 1; b++) {
            skvt_lowrank_prompt(&r, row, n[b], k, v);
            skvt_dput(be, dk, k, (size_t)n[b] * row * 2);
            skvt_dput(be, dv, v, (size_t)n[b] * row * 2);
            st = skv_prefill(cache, l, b, n[b], dk, dv, NULL);
            if (st == SKV_ERR_UNSUPPORTED) {
                char why[400];
                snprintf(why, sizeof why, "reproducible prefill on %s: %s",
                         be_names[be == SKV_BACKEND_REF ? 0 : be == SKV_BACKEND_CPU ? 1 : 2], skv_cache_last_error(cache));
                skvt_skip(why);
                ret = 0;
            } else if (!SKVT_CHECK_STATUS(st, SKV_OK, "prefill")) {
                printf("  %s\n", skv_cache_last_error(cache));
                ret = -1;
            }
        }
    size_t qn = (size_t)c.batch_size * c.n_q_heads * c.head_dim, kn = (size_t)c.batch_size * row;
    skv_bf16 *q = malloc(qn * 2), *kk = malloc(kn * 2), *vv = malloc(kn * 2);
    float *out = malloc(qn * 4);
    skv_bf16 *dq = skvt_dbuf(be, q, qn * 2), *dkk = skvt_dbuf(be, kk, kn * 2), *dvv = skvt_dbuf(be, vv, kn * 2);
    float *dout = skvt_dbuf(be, out, qn * 4);
    for (int s = 0; s < steps && ret == 1; s++)
        for (int l = 0; l < c.n_layers && ret == 1; l++) {
            skvt_fill_bf16_normal(&r, q, qn, s % 2 ? 0.5 : 3.0);
            skvt_fill_bf16_normal(&r, kk, kn, 1.0);
            skvt_fill_bf16_normal(&r, vv, kn, 1.0);
            skvt_dput(be, dq, q, qn * 2), skvt_dput(be, dkk, kk, kn * 2), skvt_dput(be, dvv, vv, kn * 2);
            st = skv_decode(cache, l, dq, dkk, dvv, dout);
            if (st == SKV_OK) st = skv_cache_sync(cache);
            if (!SKVT_CHECK_STATUS(st, SKV_OK, "decode")) {
                printf("  %s\n", skv_cache_last_error(cache));
                ret = -1;
                break;
            }
            skvt_dget(be, out, dout, qn * 4);
            memcpy(outs + ((size_t)s * c.n_layers + l) * qn, out, qn * 4);
        }
    skv_stats stats;
    if (ret == 1 && skv_cache_stats(cache, &stats) == SKV_OK && be != SKV_BACKEND_CUDA)
        SKVT_CHECK(stats.decode_allocations == 0, "reproducible decode on %s allocated %lld times",
                   be == SKV_BACKEND_REF ? "ref" : "cpu", (long long)stats.decode_allocations);
    skvt_dfree(be, dk, k), skvt_dfree(be, dv, v), skvt_dfree(be, dq, q), skvt_dfree(be, dkk, kk);
    skvt_dfree(be, dvv, vv), skvt_dfree(be, dout, out);
    free(k), free(v), free(q), free(kk), free(vv), free(out);
    skv_cache_free(cache);
    return ret;
}

static void cache_case(skvt_rng *r, int trial, uint64_t seed)
{
    skv_config c = skv_config_default();
    c.reproducible = 1;
    c.n_layers = (int)skvt_rng_range(r, 1, 2);
    c.n_kv_heads = (int)skvt_rng_range(r, 1, 2);
    c.n_q_heads = c.n_kv_heads * (int)skvt_rng_range(r, 1, 4);
    c.head_dim = trial % 2 ? 64 : 128;
    c.chunk_size = (int)skvt_rng_range(r, 2, 8);
    c.budget = c.chunk_size * (int)skvt_rng_range(r, 1, 8);
    c.n_outlier_chunks = (int)skvt_rng_range(r, 0, 4);
    c.n_local_chunks = (int)skvt_rng_range(r, 0, 2);
    c.batch_size = (int)skvt_rng_range(r, 1, 2);
    c.max_prompt_len = 64 * c.chunk_size;
    c.gen_capacity = 8;
    c.rank = (int)skvt_rng_range(r, 4, 48);
    c.rope.interleaved = trial % 3 == 2;
    /* structured shapes for cuda's kernels: query groups of 10 (the rebuild's score warps take heads
       in rounds of 8) and 5 (an odd group), and one with 336 resident tokens (the rebuild launch's
       resident-score blocks stride over them) and rank 260 (the exact int64 rebuild kernel) */
    if (trial == 6) c.n_q_heads = c.n_kv_heads * 10;
    if (trial == 7) c.n_q_heads = c.n_kv_heads * 5;
    if (trial == 8) {
        c.n_kv_heads = 3, c.n_q_heads = 6, c.chunk_size = 8, c.max_prompt_len = 64 * 8;
        c.n_outlier_chunks = 40, c.budget = 64, c.n_local_chunks = 2, c.rank = 260;
    }
    const int cap_r = (c.n_outlier_chunks + c.budget / c.chunk_size + c.n_local_chunks) * c.chunk_size;
    if (c.rank > cap_r) c.rank = cap_r;
    /* the 0.3 modes through the canonical rebuild and attention (trials 9..14): SKV_SELECT_MASS (per-head
       counts: the selected span's length differs per head), SKV_BUDGET_ALL, dense layers (layer 0, or
       both), host-placed values on odd trials */
    if (trial >= 9) {
        const int m = trial - 9;
        if (m % 3 == 0 || m == 4) {
            c.select_mode = SKV_SELECT_MASS;
            c.select_mass = m == 4 ? 0.99f : 0.7f;
            c.select_min_chunks = m % 2;
        }
        if (m % 3 == 1) c.budget = SKV_BUDGET_ALL;
        if (m >= 2) {
            c.n_layers = 2;
            c.dense_layers = m == 5 ? 3 : 1;
        }
        /* the rank within the mode's shortest valid prompt (O + max(1, floor) + Lc chunks) */
        const int need = c.select_mode == SKV_SELECT_MASS && c.select_min_chunks > 1 ? c.select_min_chunks : 1;
        const int short_n = (c.n_outlier_chunks + need + c.n_local_chunks) * c.chunk_size;
        if (c.rank > short_n) c.rank = short_n;
    }
    /* the rescoring (docs/DESIGN.md 4.5.1; trials 15..20) through the canonical rebuild and attention:
       select_candidates W = S, above S and past every candidate (W capped by n_cand), fixed and mass,
       SKV_BUDGET_ALL with a W below the candidates and one past them; host-placed values on odd trials */
    if (trial >= 15) {
        static const int mode[6] = {0, 1, 0, 1, 0, 1}, all[6] = {0, 0, 0, 0, 1, 1};
        const int m = trial - 15;
        if (mode[m]) {
            c.select_mode = SKV_SELECT_MASS;
            c.select_mass = m == 3 ? 0.99f : 0.7f;
            c.select_min_chunks = m == 1;
        }
        if (all[m]) c.budget = SKV_BUDGET_ALL;
        const int S = c.budget == SKV_BUDGET_ALL ? 1 : c.budget / c.chunk_size;
        const int W[6] = {S, 2 * S + 1, 3 * S, 1000, 5, 1000};
        c.select_candidates = W[m];
    }
    if (trial % 2) /* the smallest valid value budget: host-placed values (and the chunk cache) on cuda */
        for (c.value_device_bytes = 0; skv_config_validate(&c) != SKV_OK && c.value_device_bytes < (1 << 30);)
            c.value_device_bytes += 4096;
    int64_t n[4];
    const int S_min = c.budget == SKV_BUDGET_ALL ? 1 : c.budget / c.chunk_size;
    int64_t min_n = (int64_t)(c.n_outlier_chunks + S_min + c.n_local_chunks + 2) * c.chunk_size;
    for (int b = 0; b < c.batch_size; b++) n[b] = skvt_rng_range(r, min_n, c.max_prompt_len);
    const int steps = 4;
    size_t per = (size_t)steps * c.n_layers * c.batch_size * c.n_q_heads * c.head_dim;
    float *outs[3];
    int res[3];
    for (int b = 0; b < 3; b++) {
        outs[b] = malloc(per * 4);
        memset(outs[b], 0, per * 4);
        if (b == 2 && !have_cuda) {
            skvt_skip("cuda not available (cache)");
            res[b] = 0;
            continue;
        }
        res[b] = run_cache(c, backends[b], seed, steps, n, outs[b]);
        if (res[b] == 1)
            for (size_t i = 0; i < per; i++)
                if (!isfinite(outs[b][i])) {
                    SKVT_CHECK(0, "cache trial %d on %s: output %zu not finite", trial, be_names[b], i);
                    break;
                }
    }
    for (int b = 1; b < 3; b++) {
        if (res[0] != 1 || res[b] != 1) continue;
        size_t bad = per;
        for (size_t i = 0; i < per && bad == per; i++)
            if (memcmp(&outs[0][i], &outs[b][i], 4)) bad = i;
        if (!SKVT_CHECK(bad == per, "cache trial %d: %s output %zu = %.9g, ref %.9g", trial, be_names[b], bad,
                        bad < per ? outs[b][bad] : 0.0, bad < per ? outs[0][bad] : 0.0)) {
            const size_t qn = (size_t)c.batch_size * c.n_q_heads * c.head_dim;
            printf("  (step %zu, layer %zu, sequence %zu, query head %zu, dim %zu) of layers %d, batch %d, Hk %d, "
                   "Hq %d, D %d, c %d, budget %d, O %d, Lc %d, rank %d, select_mode %d (p %g, floor %d), "
                   "select_candidates %d, dense_layers %llu, values %s, n[0] %lld\n",
                   bad / qn / (size_t)c.n_layers, bad / qn % (size_t)c.n_layers, bad % qn / ((size_t)c.n_q_heads * c.head_dim),
                   bad % ((size_t)c.n_q_heads * c.head_dim) / (size_t)c.head_dim, bad % (size_t)c.head_dim, c.n_layers,
                   c.batch_size, c.n_kv_heads, c.n_q_heads, c.head_dim, c.chunk_size, c.budget, c.n_outlier_chunks,
                   c.n_local_chunks, c.rank, (int)c.select_mode, (double)c.select_mass, c.select_min_chunks,
                   c.select_candidates, (unsigned long long)c.dense_layers, trial % 2 ? "host-placed" : "on the device", (long long)n[0]);
        }
    }
    for (int b = 0; b < 3; b++) free(outs[b]);
}

/*
 * The selected span's length with the rescoring (docs/DESIGN.md 4.5.1, 4.7), in both modes: a
 * fixed-mode cache with SKV_BUDGET_ALL and select_candidates W below its candidates selects k = W
 * chunks per head (cap min(S, n_cand, W) = W), the same W chunks as budget = W c with the same W,
 * so both attend the same tokens: outputs bitwise equal in the reproducible mode, within float
 * rounding (1e-5 relative: cuda's default attention splits the work by S) in the default mode. A
 * decode that attends cap = min(S, n_cand) chunks under SKV_BUDGET_ALL (rows past the head's k)
 * differs by far more. Host-placed values (cuda's chunk cache) on trials 2 and 3.
 */
static void rescore_span_case(skvt_rng *r, int trial, uint64_t seed)
{
    skv_config c = skv_config_default();
    c.reproducible = trial % 2 == 0;
    c.n_layers = 2, c.batch_size = 2;
    c.n_kv_heads = (int)skvt_rng_range(r, 1, 2);
    c.n_q_heads = c.n_kv_heads * (int)skvt_rng_range(r, 1, 4);
    c.head_dim = trial < 2 ? 64 : 128;
    c.chunk_size = (int)skvt_rng_range(r, 2, 8);
    c.n_outlier_chunks = (int)skvt_rng_range(r, 0, 3);
    c.n_local_chunks = (int)skvt_rng_range(r, 0, 2);
    c.max_prompt_len = 64 * c.chunk_size;
    c.gen_capacity = 8;
    c.rank = (int)skvt_rng_range(r, 4, 48);
    const int W = (int)skvt_rng_range(r, 2, 4);
    c.select_candidates = W;
    skv_config cfg[2] = {c, c}; /* SKV_BUDGET_ALL, budget W c */
    cfg[0].budget = SKV_BUDGET_ALL;
    cfg[1].budget = W * c.chunk_size;
    for (int i = 0; i < 2 && trial >= 2; i++) {
        skv_config *ci = &cfg[i];
        for (ci->value_device_bytes = 0; skv_config_validate(ci) != SKV_OK && ci->value_device_bytes < (1 << 30);)
            ci->value_device_bytes += 4096;
    }
    int64_t n[2];
    for (int b = 0; b < 2; b++) n[b] = skvt_rng_range(r, c.max_prompt_len / 2, c.max_prompt_len); /* >= 32 candidates */
    const int steps = 4;
    const size_t qn = (size_t)c.batch_size * c.n_q_heads * c.head_dim, per = (size_t)steps * c.n_layers * qn;
    float *outs[2] = {malloc(per * 4), malloc(per * 4)};
    for (int be = 0; be < 3; be++) {
        if (be == 2 && !have_cuda) {
            skvt_skip("cuda not available (rescored spans)");
            continue;
        }
        int res[2];
        for (int i = 0; i < 2; i++) res[i] = run_cache(cfg[i], backends[be], seed, steps, n, outs[i]);
        if (res[0] != 1 || res[1] != 1) continue;
        size_t bad = per;
        double worst = 0.0;
        for (size_t i = 0; i < per && bad == per; i++) {
            const double x = outs[0][i], y = outs[1][i], d = fabs(x - y);
            if (c.reproducible ? memcmp(&outs[0][i], &outs[1][i], 4) != 0 : !(d <= 1e-5 * fmax(1.0, fabs(y))))
                bad = i;
            worst = fmax(worst, d);
        }
        if (!SKVT_CHECK(bad == per,
                        "rescored spans trial %d on %s (%s mode): output %zu = %.9g with SKV_BUDGET_ALL, %.9g with "
                        "budget W c (W %d: both select W chunks per head)",
                        trial, be_names[be], c.reproducible ? "reproducible" : "default", bad,
                        bad < per ? outs[0][bad] : 0.0, bad < per ? outs[1][bad] : 0.0, W))
            printf("  (step %zu, layer %zu) of Hk %d, Hq %d, D %d, c %d, O %d, Lc %d, rank %d, n %lld %lld\n",
                   bad / qn / (size_t)c.n_layers, bad / qn % (size_t)c.n_layers, c.n_kv_heads, c.n_q_heads, c.head_dim,
                   c.chunk_size, c.n_outlier_chunks, c.n_local_chunks, c.rank, (long long)n[0], (long long)n[1]);
        else if (getenv("SKV_VERBOSE"))
            printf("rescored spans trial %d on %s: largest difference %.3g\n", trial, be_names[be], worst);
    }
    free(outs[0]), free(outs[1]);
}

/* The plugin's test hook (cuda/skv_cuda_plugin.c): defined here when the plugin's archive is linked in. */
extern void skv_cuda_test_rebuild_split(int split) __attribute__((weak));

/* --split=N: the hook called with N once the cuda backend is loaded; 0 if it cannot be found. */
static int force_split(int split)
{
    void (*hook)(int) = skv_cuda_test_rebuild_split;
    if (!hook) {
        /* the library opened the plugin (skv_backend_available); this finds that copy, not another */
        void *h = dlopen("libshadowkv-cuda.so.0", RTLD_NOW | RTLD_LOCAL);
        union { void *p; void (*f)(int); } u = {h ? dlsym(h, "skv_cuda_test_rebuild_split") : NULL};
        hook = u.f;
    }
    if (!hook) return 0;
    hook(split);
    return 1;
}

int main(int argc, char **argv)
{
    uint64_t base = skvt_base_seed("test_canonical_decode");
    have_cuda = skv_backend_available(SKV_BACKEND_CUDA) == SKV_OK;
    for (int i = 1; i < argc; i++) {
        if ((strcmp(argv[i], "--split=0") == 0 || strcmp(argv[i], "--split=1") == 0) && have_cuda) {
            if (!force_split(argv[i][8] - '0')) {
                printf("test_canonical_decode: %s: the cuda plugin's test hook was not found\n", argv[i]);
                return 1;
            }
            printf("test_canonical_decode: cuda decode rebuild forced to the %s form where allowed\n",
                   argv[i][8] == '1' ? "split" : "plain");
        } else if (strcmp(argv[i], "--split=0") != 0 && strcmp(argv[i], "--split=1") != 0) {
            fprintf(stderr, "usage: test_canonical_decode [--split=0|--split=1]\n");
            return 2;
        }
    }
    skvt_rng r;
    skvt_rng_seed(&r, base);
    fix_exhaustive();
    header_attend_case(&r);
    for (int t = 0; t < 40; t++) rebuild_case(&r, t);
    /* attention: token counts around the lane count, single tokens, many spans, long contexts */
    static const int64_t Ts[] = {1, 2, 255, 256, 257, 513, 1000, 3000};
    for (int t = 0; t < 56; t++) attention_case(&r, t, Ts[t % 8], (int)skvt_rng_range(&r, 1, t % 3 ? 5 : 16), t % 7);
    attention_case(&r, 100, 70000, 5, 0);
    attention_case(&r, 101, 40000, 16, 1);
    for (int t = 0; t < 21; t++) cache_case(&r, t, base + 1000 + (uint64_t)t);
    for (int t = 0; t < 4; t++) rescore_span_case(&r, t, base + 2000 + (uint64_t)t);
    return skvt_finish();
}
