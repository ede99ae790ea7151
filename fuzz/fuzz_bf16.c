/*
 * fuzz_bf16.c - skv_bf16_from_float / skv_bf16_to_float.
 *
 * Carves floats (skvf_float's mix of ordinary, 0, -0, tiny, huge, Inf, NaN,
 * and raw bit patterns) and raw bf16 values. Asserts:
 *  - to_float is exact: its bits are the bf16 bits followed by 16 zeros;
 *  - a non-NaN bf16 round-trips: from_float(to_float(h)) == h; NaN stays NaN;
 *  - from_float(NaN) is a NaN; from_float(x) for other x is x rounded to the
 *    nearest bf16, ties to even, overflowing to +-Inf like IEEE rounding
 *    (checked against the two neighbours in double, not by the same bit trick);
 *  - from_float(-x) == from_float(x) with the sign flipped (x not NaN);
 *  - monotonic: x <= y implies to_float(from_float(x)) <= to_float(from_float(y)),
 *    pairwise over the carved floats and along a strided sweep of the floats
 *    that share one carved upper half.
 */
#include <stdio.h>

#include "fuzz_op_util.h"

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The value a bf16 stands for, with +-Inf as +-2^128 (where IEEE rounding puts it). */
static double rounding_value(uint16_t h)
{
    if ((h & 0x7fffu) == 0x7f80u) return (h & 0x8000u) ? -ldexp(1.0, 128) : ldexp(1.0, 128);
    return (double)float_of((uint32_t)h << 16);
}

/* Rounds x (not NaN) to bf16, ties to even, from the two neighbours' distances. */
static uint16_t expected_bf16(float x)
{
    uint32_t u = bits_of(x);
    uint16_t lo = (uint16_t)(u >> 16);
    if ((u & 0xffffu) == 0 || isinf(x)) return lo;
    uint16_t hi = (uint16_t)(lo + 1); /* next magnitude, same sign; 0x7f7f + 1 is Inf */
    double dlo = fabs((double)x - rounding_value(lo)), dhi = fabs((double)x - rounding_value(hi));
    if (dlo < dhi) return lo;
    if (dhi < dlo) return hi;
    return (lo & 1u) ? hi : lo;
}

static void check_float(float x)
{
    uint16_t b = skv_bf16_from_float(x);
    if (x != x) {
        if (!skvf_bf16_isnan(b)) skvf_fail("from_float(NaN 0x%08x) = 0x%04x, not a NaN", bits_of(x), b);
        return;
    }
    uint16_t want = expected_bf16(x);
    if (b != want) skvf_fail("from_float(%a = 0x%08x) = 0x%04x, expected 0x%04x", (double)x, bits_of(x), b, want);
    uint16_t nb = skv_bf16_from_float(-x);
    if (nb != (uint16_t)(b ^ 0x8000u))
        skvf_fail("from_float(-x) = 0x%04x but from_float(x) = 0x%04x (x = 0x%08x)", nb, b, bits_of(x));
}

static void check_bf16(uint16_t h)
{
    float f = skv_bf16_to_float(h);
    if (bits_of(f) != (uint32_t)h << 16) skvf_fail("to_float(0x%04x) has bits 0x%08x", h, bits_of(f));
    uint16_t back = skv_bf16_from_float(f);
    if (skvf_bf16_isnan(h)) {
        if (!skvf_bf16_isnan(back)) skvf_fail("NaN bf16 0x%04x came back as 0x%04x", h, back);
    } else if (back != h) {
        skvf_fail("bf16 0x%04x -> float -> 0x%04x", h, back);
    }
}

static void check_order(float x, float y)
{
    if (x != x || y != y) return;
    if (y < x) {
        float t = x;
        x = y;
        y = t;
    }
    float rx = skv_bf16_to_float(skv_bf16_from_float(x)), ry = skv_bf16_to_float(skv_bf16_from_float(y));
    if (!(rx <= ry)) skvf_fail("not monotonic: %a <= %a but they round to %a > %a", (double)x, (double)y, (double)rx, (double)ry);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    float prev = 0.0f;
    /* pairs of (mixed float, raw bits, raw bf16) until the input runs out */
    for (int i = 0; i < 256 && d.n > 0; i++) {
        float x = skvf_float(&d), y = float_of(skvf_u32(&d));
        uint16_t h = (uint16_t)skvf_u32(&d);
        check_float(x);
        check_float(y);
        check_bf16(h);
        check_order(x, y);
        check_order(prev, x);
        prev = y;
    }
    /* one sweep through the floats of one upper half, and across into the next */
    uint16_t top = (uint16_t)skvf_u32(&d);
    /* at most 4096 points per input (fast execs); the carved offset reaches every float */
    uint32_t step = (uint32_t)skvf_range(&d, 32, 4096), low0 = (uint32_t)skvf_range(&d, 0, step - 1);
    float last = float_of((uint32_t)top << 16);
    int neg = (top & 0x8000u) != 0;
    for (uint32_t low = low0; low < 0x20000u; low += step) {
        uint32_t u = ((uint32_t)top << 16) + low;
        if ((u >> 16) != top && ((u >> 16) & 0x7fffu) == 0) break; /* wrapped past the sign */
        float f = float_of(u);
        check_float(f);
        if (f == f && last == last) {
            if (neg) check_order(f, last); /* increasing bits: decreasing value */
            else check_order(last, f);
        }
        last = f;
    }
    check_float(0.0f);
    check_float(-0.0f);
    if (skv_bf16_from_float(-0.0f) != 0x8000u) skvf_fail("from_float(-0) = 0x%04x", skv_bf16_from_float(-0.0f));
    return 0;
}
