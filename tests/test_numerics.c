/*
 * test_numerics.c - the shared numerics of lib/skv_numerics.h against
 * independent implementations written from the text of docs/DESIGN.md:
 * skv_expf vs double exp (<= 2 ulp, exact 0 below ln(FLT_MIN), inf above the
 * range, NaN for NaN), bf16 round-to-nearest-even, the canonical sum (bitwise),
 * the fmaf dot products (bitwise), RoPE tables vs double formulas (incl.
 * Llama-3 scaling) and the RoPE row rotation in both pair layouts; the fp8
 * values (section 13): decode against the e4m3 value times 2^k in double for every
 * code and exponent, encode against the nearest e4m3 (ties to even) for every
 * finite bf16, the row exponent's bounds, and whole chunk records round-tripping.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "skv_numerics.h"
#include "testutil.h"

#define PI_D 3.14159265358979323846

static skvt_rng rng;

static uint32_t fbits(float f) { return skv_bits_from_f32(f); }
static float bitsf(uint32_t u) { return skv_f32_from_bits(u); }

/* ---- skv_expf ----------------------------------------------------------- */

static const double LN_FLT_MIN = -87.33654475055310898657; /* ln(2^-126) */
static const double LN_FLT_MAX = 88.72283905206835305366;  /* ln(FLT_MAX) */

typedef struct expf_stats { double max_ulp; float worst_x; long n, bad; } expf_stats;

/*
 * Checks one value; returns 1 if fine. Rules: NaN -> NaN; exact +0 when
 * exp(x) < FLT_MIN; never a subnormal; +inf when exp(x) rounds above FLT_MAX
 * by more than 2 ulp; otherwise within 2 ulp of exp((double)x). Near the two
 * edges a 2-ulp-wrong answer may land on 0 or inf, so those are accepted
 * only within 2 ulp of the edge.
 */
static int expf_one(float x, expf_stats *st)
{
    float y = skv_expf(x);
    uint32_t yb = fbits(y);
    st->n++;
    if (x != x) return y != y;
    if (y != y) return 0;
    if (y != 0.0f && fabsf(y) < FLT_MIN) return 0; /* subnormal */
    if (yb == 0x80000000u) return 0;               /* -0 */
    double e = exp((double)x);
    if ((double)x < LN_FLT_MIN) return yb == 0;
    if (y == 0.0f) return e < (double)FLT_MIN * (1.0 + 0x1p-22);
    if (isinf(y)) return (double)x > LN_FLT_MAX && y > 0;
    if (e > (double)FLT_MAX * (1.0 + 0x1p-22)) return 0; /* should have overflowed */
    double ulp = ldexp(1.0, ilogb(e) - 23);
    if (e > (double)FLT_MAX) ulp = ldexp(1.0, 127 - 23);
    double err = fabs((double)y - e) / ulp;
    if (err > st->max_ulp) {
        st->max_ulp = err;
        st->worst_x = x;
    }
    return err <= 2.0;
}

static void expf_range(const char *what, float x0, long count, int consecutive, double step,
                       expf_stats *st)
{
    long bad = 0;
    float first_bad = 0.0f;
    uint32_t b = fbits(x0);
    for (long i = 0; i < count; i++) {
        float x;
        if (consecutive) {
            x = bitsf(b);
            /* walk towards +inf through the float grid (sign-magnitude) */
            if (b == 0x80000000u) b = 0;
            else if (b & 0x80000000u) b--;
            else b++;
        } else {
            x = (float)((double)x0 + (double)i * step);
        }
        if (!expf_one(x, st)) {
            if (!bad) first_bad = x;
            bad++;
        }
    }
    SKVT_CHECK(bad == 0, "skv_expf %s: %ld of %ld values wrong, first x=%.9g (0x%08x) -> %.9g, exp=%.9g",
               what, bad, count, first_bad, (unsigned)fbits(first_bad), skv_expf(first_bad),
               exp((double)first_bad));
}

static void test_expf(void)
{
    expf_stats st = {0, 0, 0, 0};
    /* dense even sweep of the whole finite-result range */
    const long dense = 1L << 24;
    expf_range("dense sweep [-87.3,88.7]", -87.3f, dense, 0, (88.7 - -87.3) / (double)(dense - 1), &st);
    /* every float around the places where the reduction or the edges change */
    const float spots[] = {-87.33654475f, -87.3365f, -87.0f, 88.7228f, 88.72283f, -0.34657359f,
                           0.34657359f, 1.03972077f, -1.0f, 1.0f, 10.0f, -10.0f, 44.0f, -44.0f};
    for (size_t i = 0; i < sizeof spots / sizeof spots[0]; i++) {
        char what[64];
        snprintf(what, sizeof what, "consecutive floats from %.8g", spots[i]);
        expf_range(what, bitsf(fbits(spots[i]) - (spots[i] < 0 ? -20000 : 20000)), 40000, 1, 0, &st);
    }
    expf_range("consecutive floats around 0", bitsf(0x80000000u + 50000), 100000, 1, 0, &st);
    /* random values in range, and random bit patterns (any class) */
    long bad = 0;
    for (long i = 0; i < 4000000; i++) {
        float x = (float)(-87.4 + 176.2 * skvt_rng_uniform(&rng));
        bad += !expf_one(x, &st);
    }
    for (long i = 0; i < 2000000; i++) bad += !expf_one(bitsf((uint32_t)skvt_rng_u64(&rng)), &st);
    SKVT_CHECK(bad == 0, "skv_expf random values: %ld wrong", bad);
    printf("skv_expf: %ld values, max error %.3f ulp at x=%.9g\n", st.n, st.max_ulp, st.worst_x);

    /* pinned special values */
    SKVT_CHECK(fbits(skv_expf(0.0f)) == fbits(1.0f), "skv_expf(0) = %.9g, want 1", skv_expf(0.0f));
    SKVT_CHECK(fbits(skv_expf(-0.0f)) == fbits(1.0f), "skv_expf(-0) = %.9g, want 1", skv_expf(-0.0f));
    SKVT_CHECK(fbits(skv_expf(-INFINITY)) == 0, "skv_expf(-inf) = %.9g, want +0", skv_expf(-INFINITY));
    SKVT_CHECK(isinf(skv_expf(INFINITY)) && skv_expf(INFINITY) > 0, "skv_expf(+inf) = %.9g", skv_expf(INFINITY));
    SKVT_CHECK(isnan(skv_expf(NAN)), "skv_expf(NaN) = %.9g", skv_expf(NAN));
    SKVT_CHECK(isnan(skv_expf(-NAN)), "skv_expf(-NaN) = %.9g", skv_expf(-NAN));
    SKVT_CHECK(isnan(skv_expf(bitsf(0x7f800001u))), "skv_expf(sNaN) not NaN");
    SKVT_CHECK(fbits(skv_expf(-88.0f)) == 0, "skv_expf(-88) = %.9g, want +0 (no subnormal)", skv_expf(-88.0f));
    SKVT_CHECK(fbits(skv_expf(-103.0f)) == 0, "skv_expf(-103) = %.9g, want +0", skv_expf(-103.0f));
    SKVT_CHECK(isinf(skv_expf(88.73f)), "skv_expf(88.73) = %.9g, want inf", skv_expf(88.73f));
    SKVT_CHECK(isinf(skv_expf(1000.0f)), "skv_expf(1000) = %.9g, want inf", skv_expf(1000.0f));
    /* the largest float below ln(FLT_MIN) must give 0, the smallest above a normal */
    float lo = (float)LN_FLT_MIN; /* rounds to nearest; step to each side */
    while ((double)lo >= LN_FLT_MIN) lo = nextafterf(lo, -INFINITY);
    float hi = nextafterf(lo, INFINITY);
    SKVT_CHECK(fbits(skv_expf(lo)) == 0, "skv_expf(%.9g) = %.9g, want +0", lo, skv_expf(lo));
    SKVT_CHECK(skv_expf(hi) == 0.0f || skv_expf(hi) >= FLT_MIN, "skv_expf(%.9g) = %.9g subnormal", hi, skv_expf(hi));
}

/* ---- bf16 --------------------------------------------------------------- */

/*
 * Reference rounding by distance: the two bf16 neighbours of finite f (the
 * truncation t and the next one away from zero), compared in double; a tie
 * goes to the even one. Past the largest finite bf16, the upper neighbour is
 * 2^128 (it becomes inf).
 */
static uint16_t bf16_ref(float f)
{
    uint32_t u = fbits(f);
    if (isnan(f)) return 0; /* handled by the caller */
    if (isinf(f)) return (uint16_t)(u >> 16);
    uint16_t t = (uint16_t)(u >> 16), up = (uint16_t)(t + 1);
    double a = fabs((double)bitsf((uint32_t)t << 16));
    double b = ((up & 0x7fffu) == 0x7f80u) ? ldexp(1.0, 128) : fabs((double)bitsf((uint32_t)up << 16));
    double x = fabs((double)f);
    double da = x - a, db = b - x;
    if (da < db) return t;
    if (db < da) return up;
    return (t & 1u) ? up : t;
}

static int bf16_ok(float f, uint16_t got)
{
    if (isnan(f))
        return (got & 0x7f80u) == 0x7f80u && (got & 0x7fu) != 0 && (got >> 15) == (fbits(f) >> 31);
    return got == bf16_ref(f);
}

static void test_bf16(void)
{
    long bad = 0, bad_api = 0, n = 0;
    float first = 0;
    /* every upper half with the low halves that matter: 0, 1, ties, +-1 around ties, max */
    const uint32_t lows[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x4000, 0xc000};
    for (uint32_t hi = 0; hi < 0x10000u; hi++)
        for (size_t k = 0; k < sizeof lows / sizeof lows[0] + 2; k++) {
            uint32_t lo = k < sizeof lows / sizeof lows[0] ? lows[k] : (uint32_t)(skvt_rng_u64(&rng) & 0xffff);
            float f = bitsf(hi << 16 | lo);
            n++;
            if (!bf16_ok(f, skv_f32_to_bf16(f))) {
                if (!bad) first = f;
                bad++;
            }
            if (!bf16_ok(f, skv_bf16_from_float(f))) bad_api++;
        }
    for (long i = 0; i < 4000000; i++) {
        float f = bitsf((uint32_t)skvt_rng_u64(&rng));
        n++;
        if (!bf16_ok(f, skv_f32_to_bf16(f))) {
            if (!bad) first = f;
            bad++;
        }
        if (!bf16_ok(f, skv_bf16_from_float(f))) bad_api++;
    }
    SKVT_CHECK(bad == 0, "skv_f32_to_bf16: %ld of %ld wrong, first 0x%08x -> 0x%04x want 0x%04x", bad, n,
               (unsigned)fbits(first), skv_f32_to_bf16(first), bf16_ref(first));
    SKVT_CHECK(bad_api == 0, "skv_bf16_from_float: %ld of %ld wrong", bad_api, n);

    /* pinned cases: ties to even both ways, overflow to inf, NaN payload in low bits only */
    struct { uint32_t in; uint16_t want; const char *what; } pin[] = {
        {0x3f808000u, 0x3f80, "1+2^-8 tie -> even (down)"},
        {0x3f818000u, 0x3f82, "tie -> even (up)"},
        {0xbf818000u, 0xbf82, "negative tie -> even (up in magnitude)"},
        {0x3f808001u, 0x3f81, "just above tie"},
        {0x3f807fffu, 0x3f80, "just below tie"},
        {0x7f7fffffu, 0x7f80, "FLT_MAX -> inf"},
        {0xff7fffffu, 0xff80, "-FLT_MAX -> -inf"},
        {0x7f7f7fffu, 0x7f7f, "below the overflow tie stays finite"},
        {0x7f7f8000u, 0x7f80, "overflow tie: even is inf"},
        {0x7f800000u, 0x7f80, "inf"},
        {0xff800000u, 0xff80, "-inf"},
        {0x00000000u, 0x0000, "+0"},
        {0x80000000u, 0x8000, "-0"},
        {0x00008000u, 0x0000, "subnormal tie -> 0"},
        {0x00018000u, 0x0002, "subnormal tie -> even"},
        {0x007fffffu, 0x0080, "largest subnormal -> FLT_MIN"},
    };
    for (size_t i = 0; i < sizeof pin / sizeof pin[0]; i++) {
        uint16_t got = skv_f32_to_bf16(bitsf(pin[i].in));
        SKVT_CHECK(got == pin[i].want, "bf16(0x%08x) %s: got 0x%04x want 0x%04x", (unsigned)pin[i].in,
                   pin[i].what, got, pin[i].want);
    }
    const uint32_t nans[] = {0x7f800001u, 0xff800001u, 0x7fc00000u, 0xffc00000u, 0x7fffffffu, 0x7f80ffffu};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        uint16_t h = skv_f32_to_bf16(bitsf(nans[i])), h2 = skv_bf16_from_float(bitsf(nans[i]));
        SKVT_CHECK(!skv_bf16_isfinite(h) && (h & 0x7f) && (h >> 15) == (nans[i] >> 31) && h2 == h,
                   "bf16(NaN 0x%08x) = 0x%04x / api 0x%04x: not a NaN of the same sign", (unsigned)nans[i], h, h2);
    }
    /* bf16 -> f32 is exact (bit shift) for all 65536 values, public and inline */
    long bad_up = 0;
    for (uint32_t h = 0; h < 0x10000u; h++) {
        if (fbits(skv_bf16_to_f32((uint16_t)h)) != h << 16) bad_up++;
        if (fbits(skv_bf16_to_float((uint16_t)h)) != h << 16) bad_up++;
        if (skv_bf16_isfinite((uint16_t)h) != !!isfinite(bitsf(h << 16))) bad_up++;
    }
    SKVT_CHECK(bad_up == 0, "bf16 -> f32 / isfinite: %ld wrong of 65536", bad_up);
}

/* ---- canonical sum -------------------------------------------------------- */

/* docs/DESIGN.md section 5, written from the text: lane k sums x_k, x_{k+256}, ... */
static float canon_ref(const float *x, long m)
{
    float P[256];
    for (int k = 0; k < 256; k++) {
        P[k] = 0.0f;
        for (long j = k; j < m; j += 256) P[k] = P[k] + x[j];
    }
    for (int w = 128; w >= 1; w /= 2)
        for (int k = 0; k < w; k++) P[k] = P[k] + P[k + w];
    return P[0];
}

static int same_float(float a, float b) { return (isnan(a) && isnan(b)) || fbits(a) == fbits(b); }

static void test_canonical_sum(void)
{
    const long lens[] = {0, 1, 255, 256, 257, 1000, 131071};
    const long maxlen = 131071;
    float *x = malloc(sizeof(float) * maxlen);
    int differs_from_sequential = 0;
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        long m = lens[li];
        for (int kind = 0; kind < 5; kind++) {
            /* 0: mixed magnitudes and signs, so order matters; 1: probabilities
               in [0,1]; 2: all ones (exact); 3: huge and tiny (cancellation);
               4: subnormals (no flush to zero) */
            for (long j = 0; j < m; j++) {
                double g = skvt_rng_normal(&rng);
                switch (kind) {
                case 0: x[j] = (float)ldexp(g, (int)skvt_rng_range(&rng, -30, 30)); break;
                case 1: x[j] = (float)skvt_rng_uniform(&rng); break;
                case 2: x[j] = 1.0f; break;
                case 3: x[j] = (float)(j % 3 == 0 ? 1e30 * g : 1e-3 * g); break;
                default: x[j] = (float)ldexp(g, -140); break;
                }
            }
            float got = skv_canonical_sum(x, m), want = canon_ref(x, m);
            SKVT_CHECK(same_float(got, want), "canonical sum m=%ld kind=%d: got %.9g (0x%08x) want %.9g (0x%08x)",
                       m, kind, got, (unsigned)fbits(got), want, (unsigned)fbits(want));
            if (kind == 0 && m > 256) {
                float seq = 0.0f;
                for (long j = 0; j < m; j++) seq += x[j];
                differs_from_sequential |= fbits(seq) != fbits(want);
            }
        }
    }
    /* the inputs can tell an order change apart (else the bitwise check is toothless) */
    SKVT_CHECK(differs_from_sequential, "canonical sum inputs never distinguish sequential order");
    /* non-finite elements propagate the IEEE way */
    for (long j = 0; j < 1000; j++) x[j] = 1.0f;
    x[3] = INFINITY;
    SKVT_CHECK(isinf(skv_canonical_sum(x, 1000)), "canonical sum with +inf not inf");
    x[700] = -INFINITY;
    SKVT_CHECK(isnan(skv_canonical_sum(x, 1000)), "canonical sum with +inf and -inf not NaN");
    free(x);
}

/* ---- dot products --------------------------------------------------------- */

static void test_dot(void)
{
    const int lens[] = {0, 1, 2, 63, 64, 128, 256, 1000};
    uint16_t a[1000], b[1000];
    float fa[1000], fb[1000];
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        int n = lens[li];
        for (int trial = 0; trial < 50; trial++) {
            double sa = ldexp(1.0, (int)skvt_rng_range(&rng, -20, 20));
            skvt_fill_bf16_normal(&rng, a, (size_t)n, sa);
            skvt_fill_bf16_normal(&rng, b, (size_t)n, 1.0);
            for (int d = 0; d < n; d++) {
                fa[d] = (float)(sa * skvt_rng_normal(&rng));
                fb[d] = (float)skvt_rng_normal(&rng);
            }
            float want = 0.0f, want_fb = 0.0f, want_ff = 0.0f;
            for (int d = 0; d < n; d++) {
                want = fmaf(skv_bf16_to_float(a[d]), skv_bf16_to_float(b[d]), want);
                want_fb = fmaf(fa[d], skv_bf16_to_float(b[d]), want_fb);
                want_ff = fmaf(fa[d], fb[d], want_ff);
            }
            float got = skv_dot_bf16(a, b, n), got_fb = skv_dot_f32_bf16(fa, b, n),
                  got_ff = skv_dot_f32(fa, fb, n);
            SKVT_CHECK(fbits(got) == fbits(want), "skv_dot_bf16 n=%d: %.9g want %.9g", n, got, want);
            SKVT_CHECK(fbits(got_fb) == fbits(want_fb), "skv_dot_f32_bf16 n=%d: %.9g want %.9g", n, got_fb, want_fb);
            SKVT_CHECK(fbits(got_ff) == fbits(want_ff), "skv_dot_f32 n=%d: %.9g want %.9g", n, got_ff, want_ff);
        }
    }
    /* written out: fmaf(a2,b2, fmaf(a1,b1, fmaf(a0,b0, 0))) */
    for (int i = 0; i < 3; i++) {
        fa[i] = (float)skvt_rng_normal(&rng);
        fb[i] = (float)skvt_rng_normal(&rng);
    }
    float want3 = fmaf(fa[2], fb[2], fmaf(fa[1], fb[1], fmaf(fa[0], fb[0], 0.0f)));
    SKVT_CHECK(fbits(skv_dot_f32(fa, fb, 3)) == fbits(want3), "skv_dot_f32 n=3 not the fmaf chain");
    /* fused, not mul+add: -1 + (1+2^-12)^2 keeps the 2^-24 term a float product drops */
    float e = 1.0f + 0x1p-12f, c[2] = {-1.0f, e}, dd[2] = {1.0f, e};
    SKVT_CHECK(skv_dot_f32(c, dd, 2) == 0x1p-11f + 0x1p-24f, "skv_dot_f32 is not fused: %.9g", skv_dot_f32(c, dd, 2));
    /* first step from +0: -0 products give +0 (acc starts at +0, not -0) */
    uint16_t mz = 0x8000, one = 0x3f80;
    SKVT_CHECK(fbits(skv_dot_bf16(&mz, &one, 1)) == 0, "skv_dot_bf16(-0,1) is not +0");
}

/* ---- RoPE tables ---------------------------------------------------------- */

static double rope_freq_ref(const skv_rope_config *c, int i, int R)
{
    double f = pow((double)c->theta, -2.0 * i / R);
    if (!c->llama3_scaling) return f;
    /* Llama-3: keep high frequencies, divide low ones by the factor, and
       interpolate smoothly between the two wavelength thresholds */
    double old = (double)c->original_max_position, lf = c->low_freq_factor, hf = c->high_freq_factor;
    double low_wl = old / lf, high_wl = old / hf, wl = 2.0 * PI_D / f;
    if (wl < high_wl) return f;
    if (wl > low_wl) return f / c->scaling_factor;
    double smooth = (old / wl - lf) / (hf - lf);
    return (1.0 - smooth) * f / c->scaling_factor + smooth * f;
}

/* |got - want| within half a float ulp of want plus the double error of the angle */
static int table_ok(float got, double want, double angle)
{
    double aw = fabs(want);
    double half_ulp = aw >= FLT_MIN ? ldexp(1.0, ilogb(aw) - 24) : ldexp(1.0, -150);
    return fabs((double)got - want) <= half_ulp + 16.0 * 0x1p-53 * (fabs(angle) + 1.0);
}

static void test_rope_tables(void)
{
    skv_rope_config def = skv_config_default().rope;
    struct { float theta; int R, D, llama3; float factor, lf, hf; int omp; long npos; } cs[] = {
        {500000.0f, 0, 128, 0, 8, 1, 4, 8192, 4096},
        {10000.0f, 0, 64, 0, 8, 1, 4, 8192, 2048},
        {10000.0f, 32, 128, 0, 8, 1, 4, 8192, 1000},
        {500000.0f, 0, 128, 1, 8, 1, 4, 8192, 131072},
        {500000.0f, 64, 256, 1, 32, 1, 4, 8192, 3000},
        {10000.0f, 0, 128, 1, 4, 2, 8, 4096, 20000},
        {1000000.0f, 96, 128, 1, 16, 1, 2, 2048, 5000},
    };
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        skv_rope_config c = def;
        c.theta = cs[ci].theta;
        c.rotary_dim = cs[ci].R;
        c.llama3_scaling = cs[ci].llama3;
        c.scaling_factor = cs[ci].factor;
        c.low_freq_factor = cs[ci].lf;
        c.high_freq_factor = cs[ci].hf;
        c.original_max_position = cs[ci].omp;
        int D = cs[ci].D, R = c.rotary_dim ? c.rotary_dim : D;
        long np = cs[ci].npos;
        size_t len = skv_rope_table_len(&c, D, np);
        if (!SKVT_CHECK(len == (size_t)np * (size_t)(R / 2), "table len %zu want %ld", len, np * (R / 2)))
            continue;
        float *ct = malloc(len * sizeof(float)), *st = malloc(len * sizeof(float));
        skv_status s = skv_rope_table_build(&c, D, np, ct, st);
        SKVT_CHECK_STATUS(s, SKV_OK, "skv_rope_table_build");
        long bad = 0;
        long first_p = -1;
        int first_i = -1;
        double f[256];
        for (int i = 0; i < R / 2; i++) f[i] = rope_freq_ref(&c, i, R);
        for (long p = 0; p < np && s == SKV_OK; p++)
            for (int i = 0; i < R / 2; i++) {
                double ang = (double)p * f[i];
                size_t k = (size_t)p * (size_t)(R / 2) + (size_t)i;
                if (!table_ok(ct[k], cos(ang), ang) || !table_ok(st[k], sin(ang), ang)) {
                    if (!bad) first_p = p, first_i = i;
                    bad++;
                }
            }
        SKVT_CHECK(bad == 0,
                   "rope table theta=%g R=%d D=%d llama3=%d: %ld entries off, first p=%ld i=%d cos %.9g want %.12g",
                   (double)c.theta, R, D, c.llama3_scaling, bad, first_p, first_i,
                   bad ? (double)ct[first_p * (R / 2) + first_i] : 0.0,
                   bad ? cos((double)first_p * f[first_i]) : 0.0);
        free(ct);
        free(st);
    }
    /* invalid shapes give length 0 */
    skv_rope_config c = def;
    c.rotary_dim = 130;
    SKVT_CHECK(skv_rope_table_len(&c, 128, 10) == 0, "rotary_dim > head_dim: len not 0");
    c.rotary_dim = 63;
    SKVT_CHECK(skv_rope_table_len(&c, 128, 10) == 0, "odd rotary_dim: len not 0");
    SKVT_CHECK(skv_rope_table_len(NULL, 128, 10) == 0, "NULL rope: len not 0");
    c.rotary_dim = 0;
    SKVT_CHECK(skv_rope_table_len(&c, 128, -1) == 0, "negative positions: len not 0");
}

/* ---- RoPE row: both layouts, partial rotary dim -------------------------- */

static void test_rope_row(void)
{
    struct { int D, R, inter; } cs[] = {{128, 128, 0}, {128, 128, 1}, {128, 64, 0}, {128, 64, 1},
                                        {64, 64, 0}, {256, 96, 1}, {256, 2, 0}};
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        int D = cs[ci].D, R = cs[ci].R, inter = cs[ci].inter;
        float x[256], c[128], s[128];
        uint16_t out[256];
        long bad = 0, bad_dbl = 0;
        for (int trial = 0; trial < 200; trial++) {
            for (int d = 0; d < D; d++) x[d] = (float)(skvt_rng_normal(&rng) * (trial % 2 ? 1e3 : 1.0));
            for (int i = 0; i < R / 2; i++) {
                double a = skvt_rng_uniform(&rng) * 2 * PI_D;
                c[i] = (float)cos(a);
                s[i] = (float)sin(a);
            }
            skv_rope_row_f32(x, D, R, inter, c, s, out);
            for (int d = 0; d < D; d++) {
                /* member of which pair, and which side */
                float want;
                double exact, mag = 0.0; /* |x c| + |y s|: scale of the float rounding */
                if (d >= R) {
                    want = x[d];
                    exact = x[d];
                } else {
                    int i = inter ? d / 2 : d % (R / 2);
                    int first = inter ? (d % 2 == 0) : (d < R / 2);
                    int other = inter ? (first ? d + 1 : d - 1) : (first ? d + R / 2 : d - R / 2);
                    mag = fabs((double)x[d] * c[i]) + fabs((double)x[other] * s[i]);
                    if (first) { /* x' = fmaf(x, cos, -(y*sin)) */
                        want = fmaf(x[d], c[i], -(x[other] * s[i]));
                        exact = (double)x[d] * c[i] - (double)x[other] * s[i];
                    } else { /* y' = fmaf(y, cos, x*sin) */
                        want = fmaf(x[d], c[i], x[other] * s[i]);
                        exact = (double)x[d] * c[i] + (double)x[other] * s[i];
                    }
                }
                if (out[d] != skv_f32_to_bf16(want)) bad++;
                /* and within half a bf16 ulp (<= 2^-8 relative) plus the two float
                   roundings of the rotation (<= 2^-23 of |x c| + |y s|) */
                if (fabs((double)skv_bf16_to_f32(out[d]) - exact) > 0x1p-8 * fabs(exact) + 0x1p-22 * mag)
                    bad_dbl++;
            }
        }
        SKVT_CHECK(bad == 0, "skv_rope_row_f32 D=%d R=%d interleaved=%d: %ld values differ from the formula", D, R,
                   inter, bad);
        SKVT_CHECK(bad_dbl == 0, "skv_rope_row_f32 D=%d R=%d interleaved=%d: %ld values off the double rotation", D,
                   R, inter, bad_dbl);
    }
}

/* ---- decision helpers ----------------------------------------------------- */

/* cos(a, b) and the chunk landmark score, written from docs/DESIGN.md 3.4-3.5 */
static void test_landmark_score(void)
{
    enum { D = 128, C = 8 };
    uint16_t k[C * 3 * D];
    float mean[D];
    long bad = 0;
    for (int trial = 0; trial < 300; trial++) {
        int stride = (trial % 2) ? 3 * D : D;
        skvt_fill_bf16_normal(&rng, k, sizeof k / sizeof k[0], trial % 3 ? 1.0 : 1e-20);
        if (trial % 5 == 0) memset(k, 0, sizeof k); /* all-zero chunk: cos = 0/1e-8 */
        float got = skv_chunk_landmark_score(k, stride, C, D, mean);
        float m[D], want = 0.0f;
        for (int d = 0; d < D; d++) {
            float acc = 0.0f;
            for (int t = 0; t < C; t++) acc = acc + skv_bf16_to_float(k[t * stride + d]);
            m[d] = acc / (float)C;
            if (fbits(m[d]) != fbits(mean[d])) bad++;
        }
        for (int t = 0; t < C; t++) {
            float ab = 0.0f, aa = 0.0f, bb = 0.0f;
            for (int d = 0; d < D; d++) {
                float v = skv_bf16_to_float(k[t * stride + d]);
                ab = fmaf(v, m[d], ab);
                aa = fmaf(v, v, aa);
                bb = fmaf(m[d], m[d], bb);
            }
            float cs = ab / fmaxf(sqrtf(aa) * sqrtf(bb), 1e-8f);
            if (t == 0 || cs < want) want = cs;
        }
        if (fbits(got) != fbits(want)) bad++;
    }
    SKVT_CHECK(bad == 0, "skv_chunk_landmark_score: %ld values differ from docs/DESIGN.md 3.4-3.5", bad);
}

/* ---- fp8 values ------------------------------------------------------------------- */

/* the e4m3 value of code c from its fields (NaN for 0x7f, 0xff) */
static double e4m3_value(int c)
{
    if ((c & 0x7f) == 0x7f) return NAN;
    int e = (c >> 3) & 15, m = c & 7;
    double v = e ? ldexp(8 + m, e - 10) : ldexp(m, -9);
    return c & 0x80 ? -v : v;
}

static void test_fp8(void)
{
    long bad = 0, n = 0;
    /* decode: exact, a normal bf16 or a zero, for every code and every k the encoder can give */
    for (int k = SKV_FP8_EXP_MIN; k <= 40; k++)
        for (int c = 0; c < 256; c++) {
            if ((c & 0x7f) == 0x7f) continue;
            uint16_t b = skv_fp8_decode((uint8_t)c, k);
            double want = ldexp(e4m3_value(c), k), got = skv_bf16_to_f32(b);
            n++;
            if (got != want || (got != 0 && ((b >> 7) & 0xff) == 0) || ((b >> 15) != (c >> 7))) {
                if (!bad) SKVT_CHECK(0, "skv_fp8_decode(0x%02x, %d) = %g (0x%04x), want %g", c, k, got, b, want);
                bad++;
            }
        }
    SKVT_CHECK(bad == 0, "skv_fp8_decode: %ld of %ld wrong", bad, n);
    SKVT_CHECK((skv_fp8_decode(0x7f, 0) & 0x7fc0) == 0x7fc0 && (skv_fp8_decode(0xff, 3) & 0x7fc0) == 0x7fc0,
               "skv_fp8_decode: the NaN codes decode to NaN");
    /* encode: the nearest code to x 2^-k (ties to the even mantissa), for every finite bf16 and
       the row exponent of x alone and the next two */
    bad = n = 0;
    for (uint32_t x = 0; x < 0x10000u; x++) {
        uint16_t h = (uint16_t)x;
        if (!skv_bf16_isfinite(h)) continue;
        for (int dk = 0; dk < 3; dk++) {
            int k = skv_fp8_row_exp(&h, 1) + dk;
            double y = ldexp(skv_bf16_to_f32(h), -k);
            int want = -1, neg = (int)(h >> 15);
            double best = INFINITY;
            for (int c = neg ? 128 : 0; c < (neg ? 256 : 128); c++) {
                double v = e4m3_value(c), d = fabs(v - y);
                if (isnan(v)) continue;
                if (d < best || (d == best && !(c & 1) && (want & 1))) best = d, want = c;
            }
            uint8_t got = skv_fp8_encode(h, k);
            n++;
            if (got != want) {
                if (!bad) SKVT_CHECK(0, "skv_fp8_encode(0x%04x, %d) = 0x%02x, want 0x%02x", (unsigned)x, k, got, want);
                bad++;
            }
        }
    }
    SKVT_CHECK(bad == 0, "skv_fp8_encode: %ld of %ld wrong", bad, n);
    /* the row exponent: the smallest k with max * 2^-k <= 448, not below SKV_FP8_EXP_MIN */
    bad = 0;
    for (uint32_t x = 0; x < 0x7f80u; x++) {
        uint16_t h = (uint16_t)x;
        int k = skv_fp8_row_exp(&h, 1);
        double M = skv_bf16_to_f32(h);
        if (k < SKV_FP8_EXP_MIN || ldexp(M, -k) > 448 || (k > SKV_FP8_EXP_MIN && ldexp(M, -(k - 1)) <= 448)) bad++;
    }
    SKVT_CHECK(bad == 0, "skv_fp8_row_exp: %ld magnitudes wrong", bad);
    /* chunk records: random rows of several scales (and a zero row, a row of one needle);
       decode(encode(v)) within half a code step of v, and a second round trip is exact */
    const int32_t c = 8, D = 64;
    SKVT_CHECK(skv_value_chunk_bytes(SKV_VALUE_FP8, c, D) == (size_t)c * D + 16 &&
                   skv_value_chunk_bytes(SKV_VALUE_FP8, 17, 3) == 17 * 3 + 32 &&
                   skv_value_chunk_bytes(SKV_VALUE_BF16, c, D) == (size_t)2 * c * D,
               "skv_value_chunk_bytes");
    uint16_t v[8 * 64], w[8 * 64], w2[8 * 64];
    uint8_t rec[8 * 64 + 16], rec2[8 * 64 + 16];
    long over = 0, not_idem = 0;
    for (int trial = 0; trial < 2000; trial++) {
        double scale = ldexp(1.0, (int)skvt_rng_range(&rng, -100, 30));
        for (int i = 0; i < c * D; i++) v[i] = skv_f32_to_bf16((float)(scale * skvt_rng_normal(&rng)));
        if (trial % 7 == 0) memset(v + D, 0, D * sizeof *v);                  /* a zero row */
        if (trial % 5 == 0) v[3 * D + 5] = skv_f32_to_bf16((float)(scale * 1e3)); /* a needle */
        skv_fp8_encode_chunk(v, D, c, D, rec);
        skv_fp8_decode_chunk(rec, c, D, w);
        for (int i = 0; i < c; i++) {
            double m = 0;
            for (int d = 0; d < D; d++) m = fmax(m, fabs(skv_bf16_to_f32(v[i * D + d])));
            int k = ((const int8_t *)(rec + c * D))[i];
            for (int d = 0; d < D; d++) { /* half a step at the value's binade: 2^-4 relative, or 2^(k-10) */
                double a = skv_bf16_to_f32(v[i * D + d]), b = skv_bf16_to_f32(w[i * D + d]);
                if (fabs(a - b) > fmax(fabs(a) * 0.0625, ldexp(1.0, k - 10))) over++;
            }
            if (m == 0 && k != SKV_FP8_EXP_MIN) over++;
        }
        skv_fp8_encode_chunk(w, D, c, D, rec2);
        skv_fp8_decode_chunk(rec2, c, D, w2);
        not_idem += memcmp(w, w2, sizeof w) != 0;
    }
    SKVT_CHECK(over == 0, "fp8 chunk round trip: %ld values beyond half a step", over);
    SKVT_CHECK(not_idem == 0, "fp8 chunk round trip: %ld of 2000 chunks change on a second round trip", not_idem);
}

int main(void)
{
    skvt_rng_seed(&rng, skvt_base_seed("test_numerics"));
    test_expf();
    test_bf16();
    test_canonical_sum();
    test_dot();
    test_rope_tables();
    test_rope_row();
    test_landmark_score();
    test_fp8();
    return skvt_finish();
}
