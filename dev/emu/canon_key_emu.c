/* canon_key_emu.c - rb_key_sums (cuda/skv_cuda_canon_rebuild.cu) against the double of P = 2^14 c1 + 2^7 c2 + c3
 * on the host: the same words built from T = 2^7 c1 + c2 + (c3 >> 7), compared bit for bit with (double) P
 * on random and extreme sums. cc -std=c99 -O2 dev/emu/canon_key_emu.c -o build/canon_key_emu && build/canon_key_emu */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static uint64_t s_ = 0x9e3779b97f4a7c15ull;
static uint64_t nx(void) { s_ ^= s_ << 13; s_ ^= s_ >> 7; s_ ^= s_ << 17; return s_; }
static int32_t rr(int32_t lim) { return (int32_t)(nx() % (2 * (uint64_t)lim + 1)) - lim; }

int main(void)
{
    const int32_t L1 = 160 * 64 * 64, L2 = 2 * 160 * 64 * 64, L3 = 160 * 64 * 64; /* r <= 256: c1, c3 <= 2^20 */
    long long bad = 0, n = 0;
    for (long long it = 0; it < 200000000LL; it++) {
        int32_t c1, c2, c3;
        const int k = (int)(it & 7);
        if (k == 0) c1 = (int32_t)(nx() & 1) ? 4 * L1 : -4 * L1, c2 = rr(8 * L2), c3 = rr(4 * L3);
        else if (k == 1) c1 = rr(2), c2 = rr(300), c3 = rr(300);
        else c1 = rr(4 * L1), c2 = rr(8 * L2), c3 = rr(4 * L3);
        const int64_t P = (int64_t)c1 * 16384 + (int64_t)c2 * 128 + c3;
        const double want = (double)P;
        const int32_t T = (int32_t)((uint32_t)c1 << 7) + c2 + (c3 >> 7);
        const uint32_t lo = ((uint32_t)T << 7) | ((uint32_t)c3 & 127u), hi = 0x43380000u + (uint32_t)(T >> 25);
        const uint64_t b = (uint64_t)hi << 32 | lo;
        double x;
        memcpy(&x, &b, 8);
        const double got = x - 6755399441055744.0;
        n++;
        if (memcmp(&got, &want, 8)) {
            if (bad++ < 5) printf("c1 %d c2 %d c3 %d: %.17g != %.17g\n", c1, c2, c3, got, want);
        }
    }
    printf("rb_key_sums words: %lld sums compared, %lld differ\n%s\n", n, bad, bad ? "FAILED" : "ALL OK");
    return bad != 0;
}
