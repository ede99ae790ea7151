// Host emulation of the canonical attention kernels (cuda/skv_cuda_canon_rebuild.cu, cuda/skv_cuda_canon_resident.cu, cuda/skv_cuda_canon_attend.cu) against skv_canonical_attend:
// op level: canon_score_kernel (every span), canon_weights_kernel (max, skv_expf in place), canon_attend_kernel
// (4 tokens of a lane per pass, the tree a warp per value); decode (span 2 the selected one): its scores as
// canon_rebuild_tc_kernel's rb_score_row computes them (lane = token, heads lane/16 + 2i, 4 chains at a
// time), the other spans' scores by canon_weights_kernel (a thread per token, resident order), then the same.
#include <cstdio>
#include <cstring>
#include <vector>
#include <cmath>
#include <algorithm>
extern "C" {
#include "skv_numerics.h"
}
#include "emu_common.h"
typedef uint16_t u16;
static uint32_t rng = 777;
static uint32_t rnd() { rng ^= rng << 13; rng ^= rng >> 17; rng ^= rng << 5; return rng; }
static u16 rb() { float f = ((int)(rnd() % 20001) - 10000) / 2500.0f; return skv_f32_to_bf16(f); }
struct CSpan { const u16 *k, *v; int64_t n, ts; };
static bool at_seek(const CSpan *sp, int ns, int64_t j, int &si, int64_t &base) {
    while (si < ns && j - base >= sp[si].n) base += sp[si].n, si++;
    return si < ns;
}
const int GC = 4, DC = 8, NV = GC * DC + GC, TOK = 4;


int run(int Hq, int Hk, int D, std::vector<int64_t> ns_tok, bool decode) {
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
        if (!decode) { // score kernel
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
        } else { // the rebuild's scores of span 2: warps of 16 tokens, lane -> token lane & 15, heads lane >> 4 + 2 i
            const int64_t sel0 = sp[0].n + sp[1].n;
            for (int64_t mw = 0; mw < sp[2].n; mw += 16) for (int lane = 0; lane < 32; lane++) {
                const int rr = lane & 15; if (mw + rr >= sp[2].n) continue;
                std::vector<float> x(D); const u16 *k = sp[2].k + (mw + rr) * sp[2].ts;
                for (int d = 0; d < D; d++) x[d] = skv_bf16_to_f32(k[d]);
                for (int g0 = lane >> 4; g0 < G; g0 += 8) score_row(x.data(), qs.data(), D, G, g0, 2, scale, e.data() + (size_t)h * G * T, T, sel0 + mw + rr);
            }
        }
        // weights kernel: per query head
        for (int g = 0; g < G; g++) {
            float *er = &e[(size_t)(h * G + g) * T];
            if (decode) {
                const int64_t sel0 = sp[0].n + sp[1].n, nsel = sp[2].n;
                for (int tid = 0; tid < 256; tid++) {
                    int si = 0; int64_t base = 0;
                    for (int64_t r = tid; r < T - nsel; r += 256) {
                        const int64_t j = r < sel0 ? r : r + nsel;
                        at_seek(sp, ns, j, si, base);
                        const u16 *k = sp[si].k + (j - base) * sp[si].ts;
                        float acc = 0;
                        for (int d = 0; d < D; d++) acc = SKV_FMA(qs[(size_t)g * D + d], skv_bf16_to_f32(k[d]), acc);
                        er[j] = SKV_MUL(acc, scale);
                    }
                }
            }
            float red[8];
            for (int w = 0; w < 8; w++) { float m = -INFINITY; for (int t = 0; t < 32; t++) for (int64_t j = w * 32 + t; j < T; j += 256) m = fmaxf(m, er[j]); red[w] = m; }
            float M = red[0]; for (int i = 1; i < 8; i++) M = fmaxf(M, red[i]);
            for (int64_t j = 0; j < T; j++) er[j] = skv_expf(SKV_SUB(er[j], M));
        }
        // P V kernel: blocks over dim slices
        for (int bx = 0; bx < (D + DC - 1) / DC; bx++) {
            const int d0 = bx * DC;
            for (int gq = 0; gq < G; gq += GC) {
                const int gn = std::min(GC, G - gq);
                const float *er[GC]; for (int x = 0; x < GC; x++) er[x] = &e[(size_t)(h * G + gq + (x < gn ? x : 0)) * T];
                static float xb[NV][256];
                for (int lane = 0; lane < 256; lane++) {
                    float acc[GC][DC], z[GC];
                    for (int x = 0; x < GC; x++) { z[x] = 0; for (int y = 0; y < DC; y++) acc[x][y] = 0; }
                    int si = 0; int64_t base = 0;
                    for (int64_t j = lane;; j += TOK * 256) {
                        bool ok[TOK]; const u16 *vr[TOK];
                        for (int t = 0; t < TOK; t++) { int64_t jt = j + t * 256; ok[t] = at_seek(sp, ns, jt, si, base);
                            vr[t] = ok[t] ? sp[si].v + (jt - base) * sp[si].ts + d0 : nullptr; }
                        float w[TOK][GC], f[TOK][DC];
                        for (int t = 0; t < TOK; t++) {
                            for (int x = 0; x < GC; x++) w[t][x] = ok[t] && x < gn ? er[x][j + t * 256] : 0.0f;
                            for (int y = 0; y < DC; y++) f[t][y] = ok[t] && d0 + y < D ? skv_bf16_to_f32(vr[t][y]) : 0.0f;
                        }
                        for (int t = 0; t < TOK; t++) { if (!ok[t]) break;
                            for (int x = 0; x < GC; x++) { z[x] = SKV_ADD(z[x], w[t][x]);
                                for (int y = 0; y < DC; y++) acc[x][y] = SKV_FMA(w[t][x], f[t][y], acc[x][y]); } }
                        if (!ok[TOK - 1]) break;
                    }
                    for (int x = 0; x < GC; x++) { for (int y = 0; y < DC; y++) xb[x * DC + y][lane] = acc[x][y]; xb[GC * DC + x][lane] = z[x]; }
                }
                // tree: warp per value; lane t holds lanes t + 32 i
                float res[NV];
                for (int v = 0; v < NV; v++) {
                    float P[32][8];
                    for (int t = 0; t < 32; t++) for (int i = 0; i < 8; i++) P[t][i] = xb[v][t + 32 * i];
                    for (int t = 0; t < 32; t++) for (int w = 4; w >= 1; w >>= 1) for (int i = 0; i < w; i++) P[t][i] = SKV_ADD(P[t][i], P[t][i + w]);
                    for (int w = 16; w >= 1; w >>= 1) { float nx[32]; for (int t = 0; t < 32; t++) nx[t] = SKV_ADD(P[t][0], P[t + w < 32 ? t + w : t][0]);
                        for (int t = 0; t < 32; t++) P[t][0] = nx[t]; }
                    res[v] = P[0][0];
                }
                for (int i = 0; i < GC * DC; i++) { int x = i / DC, y = i % DC;
                    if (x < gn && d0 + y < D) out[(size_t)(h * G + gq + x) * D + d0 + y] = SKV_DIV(res[i], res[GC * DC + x]); }
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
    printf("%s Hq %d Hk %d D %d T %lld: %s\n", decode ? "decode" : "op    ", Hq, Hk, D, (long long)T, bad ? "FAIL" : "ok");
    return bad;
}
int main() {
    int bad = 0;
    bad += run(8, 2, 128, {48, 0, 700, 3, 1}, false);
    bad += run(12, 2, 40, {300, 17, 1}, false);
    bad += run(4, 4, 64, {1}, false);
    bad += run(3, 1, 72, {256, 256, 5}, false);
    bad += run(16, 2, 128, {2048 + 384, 33, 1}, false);
    bad += run(8, 2, 128, {48, 5, 700, 3, 1}, true);
    bad += run(12, 2, 40, {24, 17, 160, 0, 1}, true);
    bad += run(3, 1, 42, {0, 0, 40, 2, 1}, true);
    bad += run(32, 4, 128, {384, 32, 2048, 6, 1}, true);
    printf(bad ? "FAILED\n" : "ALL OK\n");
    return bad != 0;
}
