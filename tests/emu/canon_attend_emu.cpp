// Host emulation of canon_score_kernel + canon_attend_kernel (op level: kind-0 spans) against skv_canonical_attend.
#include <cstdio>
#include <cstring>
#include <vector>
#include <cmath>
#include <algorithm>
extern "C" {
#include "skv_numerics.h"
}
typedef uint16_t u16;
static uint32_t rng = 777;
static uint32_t rnd() { rng ^= rng << 13; rng ^= rng >> 17; rng ^= rng << 5; return rng; }
static u16 rb() { float f = ((int)(rnd() % 20001) - 10000) / 2500.0f; return skv_f32_to_bf16(f); }
struct CSpan { const u16 *k, *v; int64_t n, ts; };
static bool at_seek(const CSpan *sp, int ns, int64_t j, int &si, int64_t &base) {
    while (si < ns && j - base >= sp[si].n) base += sp[si].n, si++;
    return si < ns;
}
const int GC = 4, DC = 8, NV = GC * DC + GC;

int run(int Hq, int Hk, int D, std::vector<int64_t> ns_tok) {
    const int G = Hq / Hk; const float scale = 1.0f / sqrtf((float)D);
    int ns = ns_tok.size(); int64_t T = 0; for (auto n : ns_tok) T += n;
    std::vector<std::vector<u16>> K(ns), V(ns);
    for (int i = 0; i < ns; i++) { K[i].resize(ns_tok[i] * Hk * D + 1); V[i].resize(ns_tok[i] * Hk * D + 1); for (auto &x : K[i]) x = rb(); for (auto &x : V[i]) x = rb(); }
    std::vector<u16> q((size_t)Hq * D); for (auto &x : q) x = rb();
    std::vector<float> e((size_t)Hq * T, NAN), out((size_t)Hq * D, NAN);
    int bad = 0;
    for (int h = 0; h < Hk; h++) {
        CSpan sp[8];
        for (int i = 0; i < ns; i++) sp[i] = {K[i].data() + h * D, V[i].data() + h * D, ns_tok[i], (int64_t)Hk * D};
        std::vector<float> qs((size_t)G * D); for (int i = 0; i < G * D; i++) qs[i] = skv_bf16_to_f32(q[(size_t)h * G * D + i]);
        // score kernel
        for (int64_t j = 0; j < (T + 255) / 256 * 256; j++) {
            int si = 0; int64_t base = 0;
            if (!at_seek(sp, ns, j, si, base)) continue;
            const u16 *k = sp[si].k + (j - base) * sp[si].ts;
            for (int g0 = 0; g0 < G; g0 += 4) {
                int gn = std::min(4, G - g0); const float *qq = &qs[(size_t)g0 * D];
                float acc[4] = {0, 0, 0, 0};
                for (int d0 = 0; d0 < D; d0 += 64) for (int c = 0; c < 8; c++) { if (d0 + 8 * c >= D) break;
                    for (int x = 0; x < 8; x++) { int d = d0 + 8 * c + x; float f = skv_bf16_to_f32(k[d]);
                        for (int gg = 0; gg < 4; gg++) if (gg < gn) acc[gg] = SKV_FMA(qq[(size_t)gg * D + d], f, acc[gg]); } }
                for (int gg = 0; gg < gn; gg++) e[(size_t)(h * G + g0 + gg) * T + j] = SKV_MUL(acc[gg], scale);
            }
        }
        // P V kernel: blocks over dim slices
        for (int bx = 0; bx < (D + DC - 1) / DC; bx++) {
            const int d0 = bx * DC;
            for (int gq = 0; gq < G; gq += GC) {
                const int gn = std::min(GC, G - gq);
                const float *er[GC]; for (int x = 0; x < GC; x++) er[x] = &e[(size_t)(h * G + gq + (x < gn ? x : 0)) * T];
                float Ms[GC];
                for (int x = 0; x < GC; x++) { float m = -INFINITY; for (int64_t j = 0; j < T; j++) m = fmaxf(m, er[x][j]); Ms[x] = m; }
                static float acc[256][GC][DC], z[256][GC];
                for (int lane = 0; lane < 256; lane++) {
                    for (int x = 0; x < GC; x++) { z[lane][x] = 0; for (int y = 0; y < DC; y++) acc[lane][x][y] = 0; }
                    int si = 0; int64_t base = 0;
                    for (int64_t j = lane;; j += 512) {
                        if (!at_seek(sp, ns, j, si, base)) break;
                        int si1 = si; int64_t base1 = base;
                        bool two = at_seek(sp, ns, j + 256, si1, base1);
                        float f[2][DC], sv[2][GC];
                        for (int t = 0; t < 2; t++) {
                            int64_t jt = j + t * 256;
                            if (t == 1 && !two) { for (int y = 0; y < DC; y++) f[t][y] = 0; for (int x = 0; x < GC; x++) sv[t][x] = 0; continue; }
                            const u16 *v = (t ? sp[si1].v + (jt - base1) * sp[si1].ts : sp[si].v + (jt - base) * sp[si].ts) + d0;
                            for (int x = 0; x < GC; x++) sv[t][x] = x < gn ? er[x][jt] : 0;
                            for (int y = 0; y < DC; y++) f[t][y] = d0 + y < D ? skv_bf16_to_f32(v[y]) : 0;
                        }
                        for (int t = 0; t < 2; t++) { if (t == 1 && !two) break;
                            for (int x = 0; x < GC; x++) { float ee = skv_expf(SKV_SUB(sv[t][x], Ms[x])); z[lane][x] = SKV_ADD(z[lane][x], ee);
                                for (int y = 0; y < DC; y++) acc[lane][x][y] = SKV_FMA(ee, f[t][y], acc[lane][x][y]); } }
                        if (!two) break;
                        si = si1, base = base1;
                    }
                }
                // tree: smem levels 128..32 then shuffle 16..1 (lane k reads lane k + w's value of the previous level)
                for (int w = 128; w >= 1; w >>= 1)
                    for (int k = 0; k < w; k++) for (int x = 0; x < GC; x++) {
                        for (int y = 0; y < DC; y++) acc[k][x][y] = SKV_ADD(acc[k][x][y], acc[k + w][x][y]);
                        z[k][x] = SKV_ADD(z[k][x], z[k + w][x]);
                    }
                for (int i = 0; i < GC * DC; i++) { int x = i / DC, y = i % DC;
                    if (x < gn && d0 + y < D) out[(size_t)(h * G + gq + x) * D + d0 + y] = SKV_DIV(acc[0][x][y], z[0][x]); }
            }
        }
        // reference
        std::vector<skv_canon_span> rs(ns);
        for (int i = 0; i < ns; i++) rs[i] = {sp[i].k, sp[i].v, sp[i].n, sp[i].ts};
        std::vector<float> lanes(256 * (D + 1)), o(D);
        for (int g = 0; g < G; g++) {
            skv_canonical_attend(&q[(size_t)(h * G + g) * D], D, scale, ns, rs.data(), lanes.data(), o.data());
            for (int d = 0; d < D; d++) { uint32_t a, b; float x = out[(size_t)(h * G + g) * D + d]; memcpy(&a, &o[d], 4); memcpy(&b, &x, 4);
                if (a != b) { if (bad < 4) printf("  mismatch h %d g %d d %d\n", h, g, d); bad++; } }
        }
    }
    printf("Hq %d Hk %d D %d T %lld: %s\n", Hq, Hk, D, (long long)T, bad ? "FAIL" : "ok");
    return bad;
}
int main() {
    int bad = 0;
    bad += run(8, 2, 128, {48, 0, 700, 3, 1});
    bad += run(12, 2, 40, {300, 17, 1});
    bad += run(4, 4, 64, {1});
    bad += run(3, 1, 72, {256, 256, 5});
    bad += run(16, 2, 128, {2048 + 384, 33, 1});
    printf(bad ? "FAILED\n" : "ALL OK\n");
    return bad != 0;
}
