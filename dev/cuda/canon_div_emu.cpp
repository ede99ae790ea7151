/*
 * canon_div_emu.cpp - a host check of skv_cc_div (cuda/skv_cuda_canon_chol.cuh): RN(a / b) from
 * y = RN(1 / b) in five fp64 operations (q1 = RN(a y), two Markstein corrections) must equal the
 * IEEE division bit for bit. The host's fma, * and / are the IEEE operations the device's
 * __fma_rn, __dmul_rn and __ddiv_rn are. Operands: random significands over 40 binades, a near
 * b times a midpoint (the hard rounding cases), b just below 2 and b with all-ones significands
 * (where RN(1/b) is least accurate), and the range edges (zero, tiny, huge: the __ddiv_rn path).
 * No GPU needed (~7 s for the default 2e8 cases):
 *
 *     g++ -std=c++17 -O2 -ffp-contract=off dev/cuda/canon_div_emu.cpp -o build/canon_div_emu \
 *       && build/canon_div_emu [cases]
 */
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

/* skv_cc_div_fast / skv_cc_div_ok / skv_cc_div, as the device runs them */
static double div_fast(double a, double b, double y)
{
    const double q1 = a * y;
    const double r1 = std::fma(-q1, b, a);
    const double q2 = std::fma(r1, y, q1);
    const double r2 = std::fma(-q2, b, a);
    return std::fma(r2, y, q2);
}
static bool div_ok(double a, double b)
{
    const double aa = std::fabs(a);
    return aa >= 0x1p-500 && aa <= 0x1p500 && b >= 0x1p-400 && b <= 0x1p400;
}
static double cc_div(double a, double b, double y) { return div_ok(a, b) ? div_fast(a, b, y) : a / b; }

int main(int argc, char **argv)
{
    const long cases = argc > 1 ? atol(argv[1]) : 200000000L;
    std::mt19937_64 g(20261202);
    auto rnd = [&](int spread) {
        uint64_t u = g();
        u = (u & 0x800FFFFFFFFFFFFFull) | ((uint64_t)(1023 + (int)(g() % (2 * spread)) - spread) << 52);
        double d;
        memcpy(&d, &u, 8);
        return d;
    };
    long bad = 0, fast = 0;
    for (long i = 0; i < cases; i++) {
        double b = std::fabs(rnd(20)), a = rnd(20);
        switch (i % 6) {
        case 1: { /* a = RN(b m), m a midpoint between two doubles */
            double q = rnd(20);
            uint64_t u;
            memcpy(&u, &q, 8);
            u |= 1;
            memcpy(&q, &u, 8);
            a = b * (q + 0.5 * (std::nextafter(q, INFINITY) - q));
            break;
        }
        case 2: b = std::nextafter(2.0, 0.0) - (double)(g() % 1000) * 0x1p-52; break;
        case 3: {
            uint64_t u;
            memcpy(&u, &b, 8);
            u = (u & 0xFFF0000000000000ull) | (0xFFFFFFFFFFFFFull - (g() % 4096));
            memcpy(&b, &u, 8);
            break;
        }
        case 4: a = (g() & 1) ? 0.0 : -0.0; break;               /* zeros: __ddiv_rn */
        case 5: a = std::ldexp(rnd(1), (int)(g() % 1100) - 1050); /* tiny to huge: both paths */ break;
        }
        const double y = 1.0 / b, f = cc_div(a, b, y), t = a / b;
        fast += div_ok(a, b);
        if (memcmp(&f, &t, 8)) {
            if (bad < 10) printf("differ: a %a b %a: %a against %a\n", a, b, f, t);
            bad++;
        }
    }
    printf("skv_cc_div: %ld cases (%ld on the fast path), %ld differ from the IEEE division\n", cases, fast, bad);
    printf("%ld passed, %ld failed\n", cases - bad, bad);
    return bad != 0;
}
