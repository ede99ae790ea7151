// Host emulation of canon_wprep_kernel + canon_rebuild_tc_kernel<KS> (the lane-level schedule and the
// mma m16n8k32 fragment layouts as cute's SM80_16x8x32_S32S8S8S32_TN defines them) against the rules:
// the keys (k_out, op level) and the decode's fused scores (RoPE in place in the staging rows, then
// rb_score_row per lane: token lane & 15, query heads lane >> 4, + 2, ..) against skv_dot_bf16 of the
// reference keys.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cmath>
#include <algorithm>
extern "C" {
#include "skv_numerics.h"
}
#include "emu_common.h"
typedef uint16_t u16;
static uint32_t rng = 12345;
static uint32_t rnd() { rng ^= rng << 13; rng ^= rng >> 17; rng ^= rng << 5; return rng; }
static float f_(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t u_(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static uint32_t fix_bits(uint32_t fb, float s) { return u_(fmaf(f_(fb), s, 12582976.0f)); }
// CUDA __byte_perm(x, y, sel): result byte n = byte (sel >> 4n) & 7 of the 8 bytes y:x
static uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t sel) {
    uint64_t v = ((uint64_t)y << 32) | x; uint32_t r = 0;
    for (int n = 0; n < 4; n++) r |= (uint32_t)((v >> (8 * ((sel >> (4 * n)) & 7))) & 0xff) << (8 * n);
    return r;
}
static void pack_fast(uint32_t rx, uint32_t ry, float s, uint32_t &hw, uint32_t &lw) {
    const uint32_t u0 = fix_bits(rx << 16, s), u1 = fix_bits(rx & 0xffff0000u, s), u2 = fix_bits(ry << 16, s), u3 = fix_bits(ry & 0xffff0000u, s);
    const uint32_t y01 = byte_perm(u0, u1, 0x5410), y23 = byte_perm(u2, u3, 0x5410);
    hw = byte_perm(y01 << 1, y23 << 1, 0x7531);
    lw = ((byte_perm(y01, y23, 0x6420) | 0x80808080u) - 0x40404040u) ^ 0x80808080u;
}
static float rb_key(int64_t P, int e) {
    int64_t b = 0x4338000000000000LL + P; double d; memcpy(&d, &b, 8); d = d - 6755399441055744.0;
    int64_t sb = (int64_t)(e + 1023) << 52; double s; memcpy(&s, &sb, 8); return (float)(d * s);
}
static float pow2_12(int e) { return f_((uint32_t)(139 - e) << 23); }
static uint32_t hi8(int32_t t) { return (uint32_t)(t >> 7) & 0xffu; }
static uint32_t lo8(int32_t t) { return (uint32_t)((t & 127) - 64) & 0xffu; }

static u16 rbf(int mode) {
    uint32_t s = rnd() & 1;
    int E;
    switch (mode) {
    case 0: E = 110 + rnd() % 30; break;
    case 1: E = rnd() % 4; break;
    case 2: E = 1 + rnd() % 250; break;
    default: E = 100 + rnd() % 50;
    }
    if (rnd() % 13 == 0) return s ? 0x8000 : 0;
    return (u16)((s << 15) | ((uint32_t)E << 7) | (rnd() & 0x7f));
}

static uint32_t rawall[32][2][8][2][2];


int run(int D, int r, int R, int inter, int c, int S, int Hk, int ntok, int umode, int wmode, int G = 3) {
    const int Dp = (D + 15) / 16 * 16, Kp = (r + 31) / 32 * 32, KS = Kp / 32, NT = Dp / 8;
    const int64_t M = (int64_t)S * c;
    std::vector<u16> U((size_t)ntok * r), W((size_t)r * Hk * D);
    for (int t = 0; t < ntok; t++) {
        int mode = umode >= 0 ? umode : (t % 7 == 3 ? 1 : t % 7 == 5 ? 2 : 0);
        bool zero = t % 31 == 7;
        for (int q = 0; q < r; q++) U[(size_t)t * r + q] = zero ? 0 : rbf(mode);
    }
    for (size_t i = 0; i < W.size(); i++) W[i] = rbf(wmode);
    for (int q = 0; q < r; q++) W[(size_t)q * Hk * D + 3] = 0;
    std::vector<float> cs((size_t)ntok * (R / 2)), sn(cs.size());
    for (size_t i = 0; i < cs.size(); i++) { cs[i] = cosf(0.001f * i); sn[i] = sinf(0.0013f * i); }
    std::vector<int32_t> ids((size_t)Hk * S);
    for (auto &x : ids) x = rnd() % (ntok / c);
    std::vector<u16> Q((size_t)Hk * G * D);
    for (auto &x : Q) x = skv_f32_to_bf16(((int)(rnd() % 20001) - 10000) / 2500.0f);
    const float scale = 1.0f / sqrtf((float)D);
    const int64_t sel0 = 37; /* the selected span's place in the score row */
    int bad = 0, sbad = 0;
    for (int h = 0; h < Hk; h++) {
        std::vector<float> qs((size_t)G * D), E((size_t)G * (sel0 + M), NAN);
        for (int i = 0; i < G * D; i++) qs[i] = skv_bf16_to_f32(Q[(size_t)h * G * D + i]);
        std::vector<unsigned char> wq((size_t)2 * Kp * Dp);
        std::vector<int> wex(Dp);
        const u16 *w0 = W.data() + (size_t)h * D;
        const int64_t width = (int64_t)Hk * D;
        for (int bx = 0; bx < Dp / 16; bx++) {
            int e_s[16];
            static u16 wt[256][16]; /* the block's columns in shared memory, 0 past r and D */
            for (int col = 0; col < 16; col++) {
                int d = bx * 16 + col; unsigned mx = 0;
                for (int q = 0; q < Kp; q++) { wt[q][col] = q < r && d < D ? w0[q * width + d] : 0; mx = std::max(mx, (unsigned)(wt[q][col] & 0x7fff)); }
                e_s[col] = skv_canon_rebuild_ex((u16)mx); wex[bx * 16 + col] = e_s[col];
            }
            for (int it = 0; it < KS * 64; it++) {
                const int ks = it >> 6, ntl = (it >> 5) & 1, ln = it & 31, g = ln >> 2, t = ln & 3;
                const int cl = ntl * 8 + g, e = e_s[cl];
                uint32_t hw[2] = {0, 0}, lw[2] = {0, 0};
                for (int reg = 0; reg < 2; reg++)
                    for (int j = 0; j < 4; j++) {
                        const int32_t x = skv_canon_rebuild_fix(wt[32 * ks + 16 * reg + 4 * t + j][cl], e);
                        hw[reg] |= hi8(x + 64) << (8 * j);
                        lw[reg] |= lo8(x + 64) << (8 * j);
                    }
                uint32_t v[4] = {hw[0], hw[1], lw[0], lw[1]};
                memcpy(&wq[(((size_t)ks * NT + bx * 2 + ntl) * 32 + ln) * 16], v, 16);
            }
        }
        const int xst = Dp + 8;
        std::vector<u16> kout((size_t)M * D, 0xffff);
        for (int64_t mw = 0; mw < (M + 15) / 16 * 16; mw += 16) {
            std::vector<float> xs((size_t)16 * xst, NAN);
            long long pos_s[16];
            uint32_t ah[32][8][4], al[32][8][4]; int eu[32][2];
            for (int lane = 0; lane < 32; lane++) {
                int g = lane >> 2, t4 = lane & 3;
                int64_t pos[2]; bool live[2];
                for (int rs = 0; rs < 2; rs++) {
                    int64_t m = mw + g + 8 * rs; live[rs] = m < M;
                    pos[rs] = live[rs] ? (int64_t)ids[(size_t)h * S + m / c] * c + m % c : 0;
                }
                if (t4 == 0) { pos_s[g] = live[0] ? pos[0] : -1; pos_s[g + 8] = live[1] ? pos[1] : -1; }
                for (int rs = 0; rs < 2; rs++) for (int ks = 0; ks < KS; ks++) for (int hf = 0; hf < 2; hf++) {
                    const int q0 = 32 * ks + 16 * hf + 4 * t4; uint32_t v[4];
                    for (int j = 0; j < 4; j++) v[j] = live[rs] && q0 + j < r ? U[pos[rs] * r + q0 + j] : 0u;
                    rawall[lane][rs][ks][hf][0] = v[0] | (v[1] << 16); rawall[lane][rs][ks][hf][1] = v[2] | (v[3] << 16);
                }
            }
            for (int L = 0; L < 32; L++) {
                for (int rs = 0; rs < 2; rs++) {
                    uint32_t mx = 0;
                    for (int LL = (L & ~3); LL < (L & ~3) + 4; LL++)
                        for (int ks = 0; ks < KS; ks++) for (int hf = 0; hf < 2; hf++) {
                            uint32_t w0_ = rawall[LL][rs][ks][hf][0] & 0x7fff7fffu, w1_ = rawall[LL][rs][ks][hf][1] & 0x7fff7fffu;
                            mx = std::max(mx, std::max(std::max(w0_ & 0xffffu, w0_ >> 16), std::max(w1_ & 0xffffu, w1_ >> 16)));
                        }
                    const int e = skv_canon_rebuild_ex((u16)mx); eu[L][rs] = e;
                    const bool fast = e >= -113; const float s = pow2_12(fast ? e : 0);
                    for (int ks = 0; ks < KS; ks++) for (int hf = 0; hf < 2; hf++) {
                        uint32_t hw = 0, lw = 0;
                        if (fast) {
                            pack_fast(rawall[L][rs][ks][hf][0], rawall[L][rs][ks][hf][1], s, hw, lw);
                        } else {
                            for (int j = 0; j < 4; j++) {
                                uint32_t hb = (rawall[L][rs][ks][hf][j < 2 ? 0 : 1] >> (16 * (j & 1))) & 0xffffu;
                                int32_t t = skv_canon_rebuild_fix((u16)hb, e) + 64;
                                hw |= hi8(t) << (8 * j); lw |= lo8(t) << (8 * j);
                            }
                        }
                        ah[L][ks][rs + 2 * hf] = hw; al[L][ks][rs + 2 * hf] = lw;
                    }
                }
            }
            for (int nt = 0; nt < NT; nt++) {
                int C[3][16][8]; memset(C, 0, sizeof C);
                for (int ks = 0; ks < KS; ks++) {
                    int Ah[16][32], Al[16][32], Bh[32][8], Bl[32][8];
                    for (int L = 0; L < 32; L++) {
                        int g = L >> 2, t = L & 3;
                        uint32_t bw[4]; memcpy(bw, &wq[(((size_t)ks * NT + nt) * 32 + L) * 16], 16);
                        for (int i = 0; i < 4; i++) for (int j = 0; j < 4; j++) {
                            Ah[g + 8 * (i & 1)][4 * t + j + 16 * (i >> 1)] = (int8_t)(ah[L][ks][i] >> (8 * j));
                            Al[g + 8 * (i & 1)][4 * t + j + 16 * (i >> 1)] = (int8_t)(al[L][ks][i] >> (8 * j));
                        }
                        for (int i = 0; i < 2; i++) for (int j = 0; j < 4; j++) {
                            Bh[4 * t + j + 16 * i][g] = (int8_t)(bw[i] >> (8 * j));
                            Bl[4 * t + j + 16 * i][g] = (int8_t)(bw[2 + i] >> (8 * j));
                        }
                    }
                    for (int m = 0; m < 16; m++) for (int n = 0; n < 8; n++) for (int k = 0; k < 32; k++) {
                        C[0][m][n] += Ah[m][k] * Bh[k][n];
                        C[1][m][n] += Ah[m][k] * Bl[k][n] + Al[m][k] * Bh[k][n];
                        C[2][m][n] += Al[m][k] * Bl[k][n];
                    }
                }
                for (int L = 0; L < 32; L++) {
                    int g = L >> 2, t4 = L & 3; const int d = nt * 8 + 2 * t4;
                    for (int i = 0; i < 4; i++) {
                        int rs = i >> 1, cl = i & 1, m = g + 8 * rs, n = 2 * t4 + cl;
                        const int64_t P = (int64_t)C[0][m][n] * 16384 + (int64_t)C[1][m][n] * 128 + C[2][m][n];
                        xs[(size_t)m * xst + d + cl] = rb_key(P, eu[L][rs] + wex[d + cl] - 24);
                    }
                }
            }
            for (int rr = 0; rr < 16; rr++) {
                if (pos_s[rr] < 0) continue;
                for (int lane = 0; lane < 32; lane++)
                    for (int d = R + lane; d < D; d += 32) {
                        u16 o = skv_f32_to_bf16(xs[(size_t)rr * xst + d]);
                        kout[(mw + rr) * D + d] = o; xs[(size_t)rr * xst + d] = skv_bf16_to_f32(o);
                    }
            }
            const int h2 = R / 2;
            for (int i0 = 0; i0 < h2; i0 += 64) for (int r0 = 0; r0 < 16; r0 += 8) for (int k = 0; k < 8; k++) {
                int rr = r0 + k; long long p = pos_s[rr]; if (p < 0) continue;
                for (int lane = 0; lane < 32; lane++) for (int xx = 0; xx < 2; xx++) {
                    int i = i0 + lane + 32 * xx; if (i >= h2) continue;
                    int pa, pb; float xo, yo;
                    skv_rope_pair_index(i, R, inter, &pa, &pb);
                    float *x = &xs[(size_t)rr * xst];
                    skv_rope_rotate(x[pa], x[pb], cs[p * h2 + i], sn[p * h2 + i], &xo, &yo);
                    u16 oa = skv_f32_to_bf16(xo), ob = skv_f32_to_bf16(yo);
                    kout[(mw + rr) * D + pa] = oa; kout[(mw + rr) * D + pb] = ob;
                    x[pa] = skv_bf16_to_f32(oa); x[pb] = skv_bf16_to_f32(ob);
                }
            }
            for (int lane = 0; lane < 32; lane++) {
                const int rr = lane & 15;
                if (pos_s[rr] < 0) continue;
                for (int g0 = lane >> 4; g0 < G; g0 += 8) score_row(&xs[(size_t)rr * xst], qs.data(), D, G, g0, 2, scale, E.data(), sel0 + M, sel0 + mw + rr);
            }
        }
        std::vector<int> ew(D);
        for (int d = 0; d < D; d++) { unsigned mx = 0; for (int q = 0; q < r; q++) mx = std::max(mx, (unsigned)(w0[q * width + d] & 0x7fff)); ew[d] = skv_canon_rebuild_ex((u16)mx); }
        for (int64_t m = 0; m < M; m++) {
            int64_t t = (int64_t)ids[(size_t)h * S + m / c] * c + m % c;
            const u16 *ur = &U[t * r]; unsigned mx = 0;
            for (int q = 0; q < r; q++) mx = std::max(mx, (unsigned)(ur[q] & 0x7fff));
            int e = skv_canon_rebuild_ex((u16)mx);
            std::vector<float> x(D); std::vector<u16> o(D);
            for (int d = 0; d < D; d++) {
                int64_t P = 0;
                for (int q = 0; q < r; q++) P += (int64_t)skv_canon_rebuild_fix(ur[q], e) * skv_canon_rebuild_fix(w0[q * width + d], ew[d]);
                x[d] = skv_canon_rebuild_key(P, e + ew[d] - 24);
            }
            skv_rope_row_f32(x.data(), D, R, inter, &cs[t * (R / 2)], &sn[t * (R / 2)], o.data());
            for (int d = 0; d < D; d++) if (o[d] != kout[m * D + d]) { if (bad < 5) printf("  mismatch h %d m %lld d %d: %04x vs %04x\n", h, (long long)m, d, o[d], kout[m * D + d]); bad++; }
            for (int g = 0; g < G; g++) {
                const float sref = SKV_MUL(skv_dot_bf16(&Q[(size_t)(h * G + g) * D], o.data(), D), scale), sg = E[(size_t)g * (sel0 + M) + sel0 + m];
                if (memcmp(&sref, &sg, 4)) { if (sbad < 5) printf("  score mismatch h %d m %lld g %d\n", h, (long long)m, g); sbad++; }
            }
        }
    }
    printf("D %d r %d R %d inter %d c %d S %d G %d: %s (%d bad keys, %d bad scores)\n", D, r, R, inter, c, S, G,
           bad || sbad ? "FAIL" : "ok", bad, sbad);
    return bad + sbad;
}

// rb_pack_fast against skv_canon_rebuild_fix + 64 -> hi8 / lo8, every finite bf16 h below 2^(e + 1) (what a
// row of exponent e holds) in every byte position, for every e of the fast path
static int pack_exhaustive() {
    int bad = 0;
    for (int e = -113; e <= 127; e++) {
        const float s = pow2_12(e);
        for (uint32_t h = 0; h < 65536; h++) {
            const int E = (h >> 7) & 0xff;
            if (E == 255 || (E ? E - 127 : -126) > e) continue;
            const uint32_t o = rnd() & 0xffff, oE = (o >> 7) & 0xff;
            const uint32_t other = (oE == 255 || (oE ? (int)oE - 127 : -126) > e) ? 0 : o;
            const int pos = h & 3;
            uint32_t el[4] = {other, other ^ 0x8000, 0, other};
            el[pos] = h;
            uint32_t hw, lw;
            pack_fast(el[0] | (el[1] << 16), el[2] | (el[3] << 16), s, hw, lw);
            for (int j = 0; j < 4; j++) {
                const int32_t t = skv_canon_rebuild_fix((u16)el[j], e) + 64;
                if (((hw >> (8 * j)) & 0xff) != hi8(t) || ((lw >> (8 * j)) & 0xff) != lo8(t)) { if (bad < 5) printf("  pack mismatch e %d h %04x\n", e, el[j]); bad++; }
            }
        }
    }
    printf("pack_fast exhaustive: %s (%d bad)\n", bad ? "FAIL" : "ok", bad);
    return bad;
}

int main() {
    int bad = pack_exhaustive();
    bad += run(128, 160, 128, 0, 8, 20, 2, 400, -1, 0, 4);
    bad += run(128, 160, 128, 1, 8, 20, 1, 400, 1, 0);
    bad += run(64, 48, 32, 0, 4, 9, 2, 200, -1, 2);
    bad += run(40, 100, 40, 1, 3, 7, 2, 150, 2, 0);
    bad += run(72, 33, 64, 0, 5, 5, 1, 100, -1, 1, 9);
    bad += run(128, 256, 96, 0, 8, 4, 1, 100, 0, 0);
    bad += run(16, 8, 16, 1, 1, 20, 1, 60, 1, 1, 1);
    bad += run(256, 200, 256, 0, 8, 3, 1, 100, -1, 0);
    printf(bad ? "FAILED\n" : "ALL OK\n");
    return bad != 0;
}
