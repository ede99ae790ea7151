/*
 * canon_sched_emu.cpp - a host emulation of the fast canonical-route kernels' schedules
 * (cuda/skv_cuda_canon_mm.cuh: skv_cc_mm, with its stage ring's hazards; cuda/skv_cuda_canon_chol.cuh:
 * skv_cc_fchol, skv_cc_fsolve), thread by thread and
 * phase by phase with the kernels' own index arithmetic, compared bit for bit with the
 * reference functions of lib/skv_factor_canon.h on random inputs. It checks the schedules'
 * logic (ownership, step order, packing, staging), not the device's arithmetic (the device's
 * __fma_rn/__ddiv_rn/__dsqrt_rn are the IEEE operations the host's fma, / and sqrt are).
 * No GPU needed:
 *
 *     g++ -std=c++17 -O2 -ffp-contract=off -Iinclude -Ilib dev/cuda/canon_sched_emu.cpp \
 *       -o build/canon_sched_emu -lm && build/canon_sched_emu
 */
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <random>
#include <vector>

extern "C" {
#include "skv_factor_canon.h"
}
#include "../../cuda/skv_cuda_canon_mm.cuh" /* the configurations (host: the macros only) */

#define __fma_rn(a, b, c) fma((a), (b), (c))
#define __ddiv_rn(a, b) ((a) / (b))
#define __dmul_rn(a, b) ((a) * (b))
#define __dadd_rn(a, b) ((a) + (b))

/* skv_cc_div (cuda/skv_cuda_canon_chol.cuh), as the device runs it */
static double skv_cc_div(double a, double b, double y)
{
    const double aa = std::fabs(a);
    if (!(aa >= 0x1p-500 && aa <= 0x1p500 && b >= 0x1p-400 && b <= 0x1p400)) return a / b;
    const double q1 = a * y;
    const double r1 = fma(-q1, b, a);
    const double q2 = fma(r1, y, q1);
    const double r2 = fma(-q2, b, a);
    return fma(r2, y, q2);
}

static int same(const double *a, const double *b, size_t n)
{
    return memcmp(a, b, n * sizeof(double)) == 0;
}

/* ---- skv_cc_mm<TM, TN, TY, TX, KT, NS, PD>: one block at a time, threads in sequence per phase ----
   The stage ring is emulated with its hazards: a buffer being filled (cp.async issued, its
   group not yet waited for) holds NaN, so a read of it before the wait and the barrier that
   follows, or an issue into a buffer still read in the same phase, poisons a result. */
static int mm_pos(int T, int TT, int t, int p)
{
    return p < 2 * (T / 2) ? 2 * t + (p & 1) + 2 * TT * (p >> 1) : 2 * TT * (T / 2) + t;
}
static void mm_fail(const char *what)
{
    printf("FAIL: %s\n", what);
    exit(1);
}
template <int TM, int TN, int TY, int TX, int KT, int NS, int PD>
static void emu_mm(int32_t M, int32_t N, int32_t K, const double *at, int64_t lda, const double *b, int64_t ldb,
                   double *c, int64_t ldc, int lower)
{
    constexpr int NT = TY * TX, BM = TY * TM, BN = TX * TN;
    static_assert(BM % 2 == 0 && BN % 2 == 0 && NS >= 3 && PD >= 1 && PD < KT, "as the kernel");
    const int gx = (N + BN - 1) / BN, gy = (M + BM - 1) / BM;
    std::vector<double> as((size_t)NS * KT * BM), bs((size_t)NS * KT * BN);
    const bool vec = ((lda | ldb | M | N) & 1) == 0 && ((uintptr_t)at & 15) == 0 && ((uintptr_t)b & 15) == 0;
    const int32_t nst = (K + KT - 1) / KT;
    for (int by = 0; by < gy; by++)
        for (int bx = 0; bx < gx; bx++) {
            const int32_t i0 = by * BM, j0 = bx * BN;
            if (lower && j0 >= i0 + BM) continue;
            std::fill(as.begin(), as.end(), NAN);
            std::fill(bs.begin(), bs.end(), NAN);
            std::vector<int> groups; /* committed groups: the stage, -1 for an empty one */
            std::vector<int> pend(NS, -1);
            /* the copies of one operand, thread by thread as skv_cc_mm_copy */
            auto copy = [&](double *dst, const double *src, int64_t ld, int32_t k0, int32_t C, int32_t c0, int W) {
                std::vector<int> hit((size_t)KT * W, 0);
                for (int tid = 0; tid < NT; tid++) {
                    const int CH = vec ? KT * (W / 2) : KT * W;
                    for (int e = 0; e < (CH + NT - 1) / NT; e++) {
                        const int idx = tid + NT * e;
                        if (idx >= CH) continue;
                        const int w = vec ? 2 : 1, kk = idx / (W / w), cc = w * (idx % (W / w));
                        const int32_t gk = k0 + kk, gc = c0 + cc;
                        const bool ok = gk < K && gc < C;
                        if (vec && ((gk * ld + gc) % 2 || cc % 2)) mm_fail("misaligned 16-byte copy");
                        for (int u = 0; u < w; u++) {
                            dst[kk * W + cc + u] = ok ? src[gk * ld + gc + u] : 0.0;
                            hit[(size_t)kk * W + cc + u]++;
                        }
                    }
                }
                for (int h : hit)
                    if (h != 1) mm_fail("stage copy coverage");
            };
            auto land = [&](int st) {
                const int buf = st % NS;
                copy(&as[(size_t)buf * KT * BM], at, lda, st * KT, M, i0, BM);
                copy(&bs[(size_t)buf * KT * BN], b, ldb, st * KT, N, j0, BN);
                pend[buf] = -1;
            };
            auto issue = [&](int st) {
                const int buf = st % NS;
                if (pend[buf] >= 0) mm_fail("issue into a pending buffer");
                std::fill(as.begin() + (size_t)buf * KT * BM, as.begin() + (size_t)(buf + 1) * KT * BM, NAN);
                std::fill(bs.begin() + (size_t)buf * KT * BN, bs.begin() + (size_t)(buf + 1) * KT * BN, NAN);
                pend[buf] = st;
            };
            auto commit = [&](int st) { groups.push_back(st); };
            auto wait = [&](int n) { /* all but the newest n groups complete */
                for (int g = 0; g + n < (int)groups.size(); g++)
                    if (groups[g] >= 0 && pend[groups[g] % NS] == groups[g]) land(groups[g]);
            };
            std::vector<double> acc((size_t)NT * TM * TN, 0.0), fa((size_t)NT * (PD + 1) * TM, NAN),
                fb((size_t)NT * (PD + 1) * TN, NAN);
            auto frag = [&](int tid, int buf, int kk, int slot) {
                const int tx = tid % TX, ty = tid / TX;
                const double *ra = &as[((size_t)buf * KT + kk) * BM], *rb = &bs[((size_t)buf * KT + kk) * BN];
                for (int p = 0; p < TM; p++) {
                    int pos = mm_pos(TM, TY, ty, p);
                    if (p < 2 * (TM / 2) && (p & 1) == 0 && pos % 2) mm_fail("misaligned pair");
                    fa[((size_t)tid * (PD + 1) + slot) * TM + p] = ra[pos];
                }
                for (int q = 0; q < TN; q++) {
                    int pos = mm_pos(TN, TX, tx, q);
                    if (q < 2 * (TN / 2) && (q & 1) == 0 && pos % 2) mm_fail("misaligned pair");
                    fb[((size_t)tid * (PD + 1) + slot) * TN + q] = rb[pos];
                }
            };
            auto fmas = [&](int tid) {
                for (int p = 0; p < TM; p++)
                    for (int q = 0; q < TN; q++) {
                        double &r = acc[((size_t)tid * TM + p) * TN + q];
                        r = __fma_rn(fa[((size_t)tid * (PD + 1)) * TM + p], fb[((size_t)tid * (PD + 1)) * TN + q], r);
                    }
            };
            for (int s = 0; s < NS - 1; s++) {
                if (s < nst) issue(s);
                commit(s < nst ? s : -1);
            }
            wait(NS - 2);
            /* barrier */
            if (K >= KT)
                for (int tid = 0; tid < NT; tid++)
                    for (int q = 0; q < PD; q++) frag(tid, 0, q, q);
            for (int32_t st = 0; st < nst; st++) {
                wait(NS - 3);
                /* barrier: the phase below is every thread's work up to the next one */
                if (st + NS - 1 < nst) issue(st + NS - 1);
                commit(st + NS - 1 < nst ? st + NS - 1 : -1);
                const int buf = st % NS, nbuf = (st + 1) % NS;
                for (int tid = 0; tid < NT; tid++) {
                    if ((st + 1) * KT <= K) {
                        const bool more = (st + 2) * KT <= K;
                        for (int kk = 0; kk < KT; kk++) {
                            const int kn = kk + PD;
                            if (kn < KT) frag(tid, buf, kn, PD);
                            else if (more) frag(tid, nbuf, kn - KT, PD);
                            else { /* not loaded: poison, never used */
                                for (int p = 0; p < TM; p++) fa[((size_t)tid * (PD + 1) + PD) * TM + p] = NAN;
                                for (int q = 0; q < TN; q++) fb[((size_t)tid * (PD + 1) + PD) * TN + q] = NAN;
                            }
                            fmas(tid);
                            for (int q = 0; q < PD; q++) {
                                for (int p = 0; p < TM; p++)
                                    fa[((size_t)tid * (PD + 1) + q) * TM + p] = fa[((size_t)tid * (PD + 1) + q + 1) * TM + p];
                                for (int p = 0; p < TN; p++)
                                    fb[((size_t)tid * (PD + 1) + q) * TN + p] = fb[((size_t)tid * (PD + 1) + q + 1) * TN + p];
                            }
                        }
                    } else {
                        const int32_t kn = K - st * KT;
                        for (int kk = 0; kk < kn; kk++) {
                            frag(tid, buf, kk, 0);
                            fmas(tid);
                        }
                    }
                }
            }
            wait(0);
            for (int tid = 0; tid < NT; tid++) {
                const int tx = tid % TX, ty = tid / TX;
                for (int p = 0; p < TM; p++)
                    for (int q = 0; q < TN; q++) {
                        int32_t i = i0 + mm_pos(TM, TY, ty, p), j = j0 + mm_pos(TN, TX, tx, q);
                        if (i < M && j < N) c[(int64_t)i * ldc + j] = acc[((size_t)tid * TM + p) * TN + q];
                    }
            }
        }
}

/* ---- skv_cc_fchol<S> (512 threads, skv_cuda_canon_chol.cuh) ---- */
static int32_t lpk(int32_t p, int32_t k) { return k * p - k * (k - 1) / 2; }
#define KEEP(c, m) (32 * (m) + 31 >= 16 * (c))
template <int S>
static void emu_fchol(int32_t m, int32_t p, const double *c, int eq, double *dsc, double *lp)
{
    constexpr int NT = 512, C = 32 * S / 16;
    double lb[2][32 * S], ds[32 * S], dg[32 * S];
    for (int i = 0; i < 32 * S; i++) lb[0][i] = lb[1][i] = ds[i] = dg[i] = NAN;
    std::vector<double> acc((size_t)NT * C * S);
    auto AC = [&](int tid, int cc, int mm) -> double & { return acc[((size_t)tid * C + cc) * S + mm]; };
    /* every lower element owned exactly once, by a kept slot */
    {
        std::vector<int> own((size_t)32 * S * 32 * S, 0);
        for (int tid = 0; tid < NT; tid++)
            for (int cc = 0; cc < C; cc++)
                for (int mm = 0; mm < S; mm++) {
                    int q = 16 * cc + (tid >> 5), i = (tid & 31) + 32 * mm;
                    if (q <= i && !KEEP(cc, mm)) printf("FAIL: a dropped slot holds (%d, %d)\n", i, q), exit(1);
                    if (q <= i) own[(size_t)i * 32 * S + q]++;
                }
        for (int i = 0; i < 32 * S; i++)
            for (int q = 0; q <= i; q++)
                if (own[(size_t)i * 32 * S + q] != 1) printf("FAIL: (%d, %d) owned %d times\n", i, q, own[(size_t)i * 32 * S + q]), exit(1);
    }
    if (eq)
        for (int j = 0; j < p; j++) {
            double v = skv_canon_dscale(c[(int64_t)j * p + j]);
            ds[j] = v;
            dsc[j] = v;
        }
    for (int j = 0; j < p; j++) {
        double v = c[(int64_t)j * p + j];
        dg[j] = eq ? __dmul_rn(v, __dmul_rn(ds[j], ds[j])) : v;
    }
    for (int tid = 0; tid < NT; tid++) {
        const int lane = tid & 31, w = tid >> 5;
        for (int cc = 0; cc < C; cc++)
            for (int mm = 0; mm < S; mm++) {
                AC(tid, cc, mm) = NAN; /* the kernel: 0.0; a slot outside the triangle must never be used */
                if (!KEEP(cc, mm)) continue;
                const int32_t q = 16 * cc + w, i = lane + 32 * mm;
                if (q <= i && i < p) {
                    double v = c[(int64_t)i * p + q];
                    AC(tid, cc, mm) = eq ? __dmul_rn(v, __dmul_rn(ds[i], ds[q])) : v;
                }
            }
    }
    double tr = 0.0;
    for (int32_t j = 0; j < p; j++) tr = __dadd_rn(tr, dg[j]);
    const double s = skv_canon_shift(m, p, tr), fl = skv_canon_floor(p, tr, s);
    for (int tid = 0; tid < NT; tid++) {
        const int lane = tid & 31, w = tid >> 5;
        for (int cc = 0; cc < C; cc++)
            for (int mm = 0; mm < S; mm++)
                if (KEEP(cc, mm) && 16 * cc + w == lane + 32 * mm && lane + 32 * mm < p)
                    AC(tid, cc, mm) = __dadd_rn(AC(tid, cc, mm), s);
    }
    for (int i = 0; i < 32 * S; i++) lb[0][i] = lb[1][i] = 0.0;
    { /* column 0 by warp 0 */
        const double ljj = skv_canon_pivot(AC(0, 0, 0), fl); /* the shuffle from lane 0 */
        const double y = 1.0 / ljj;
        lp[(size_t)p * (p + 1) / 2] = y;
        for (int lane = 0; lane < 32; lane++)
            for (int mm = 0; mm < S; mm++) {
                const int32_t i = lane + 32 * mm;
                if (i < p) {
                    const double v = i == 0 ? ljj : skv_cc_div(AC(lane, 0, mm), ljj, y);
                    lb[0][i] = v;
                    lp[i] = v;
                }
            }
    }
    int steps = 0;
    for (int cb = 0; cb < C; cb++)
        for (int kl = cb == 0 ? 1 : 0; kl < 16; kl++) {
            const int32_t kn = 16 * cb + kl;
            if (kn >= p) break;
            if (kn != steps + 1) printf("FAIL: step order\n"), exit(1);
            steps++;
            const double *cur = lb[(kn - 1) & 1];
            double *nxt = lb[kn & 1];
            double saved[32 * S];
            memcpy(saved, nxt, sizeof saved); /* nothing of this step reads nxt: poison it */
            for (int i = 0; i < 32 * S; i++) nxt[i] = NAN;
            for (int tid = 0; tid < NT; tid++) {
                const int lane = tid & 31, w = tid >> 5;
                double nli[S];
                for (int mm = 0; mm < S; mm++) nli[mm] = -cur[lane + 32 * mm];
                if (w == kl) {
                    if (16 * cb + w != kn || (kn >> 5) != (cb >> 1)) printf("FAIL: slot map\n"), exit(1);
                    const double lqk = cur[kn];
                    for (int mm = 0; mm < S; mm++)
                        if (KEEP(cb, mm)) AC(tid, cb, mm) = __fma_rn(nli[mm], lqk, AC(tid, cb, mm));
                }
            }
            if (kl < 16) {
                /* the shuffle: lane kn & 31 of warp kl, slot (cb, cb >> 1) */
                const double ljj = skv_canon_pivot(AC(32 * kl + (kn & 31), cb, cb >> 1), fl);
                const double y = 1.0 / ljj;
                lp[(size_t)p * (p + 1) / 2 + kn] = y;
                const int32_t off = lpk(p, kn) - kn;
                for (int lane = 0; lane < 32; lane++) {
                    const int tid = 32 * kl + lane;
                    for (int mm = 0; mm < S; mm++) {
                        const int32_t i = lane + 32 * mm;
                        if (i >= p) continue;
                        double v = i == kn ? ljj : 0.0;
                        if (KEEP(cb, mm) && i > kn) v = skv_cc_div(AC(tid, cb, mm), ljj, y);
                        nxt[i] = v;
                        if (i >= kn) lp[off + i] = v;
                    }
                }
            }
            for (int tid = 0; tid < NT; tid++) {
                const int lane = tid & 31, w = tid >> 5;
                double nli[S];
                for (int mm = 0; mm < S; mm++) nli[mm] = -cur[lane + 32 * mm];
                for (int cc = cb; cc < C; cc++) {
                    const int32_t q = 16 * cc + w;
                    if ((cc == cb && w <= kl) || q >= p) continue;
                    const double lqk = cur[q];
                    for (int mm = 0; mm < S; mm++)
                        if (KEEP(cc, mm)) AC(tid, cc, mm) = __fma_rn(nli[mm], lqk, AC(tid, cc, mm));
                }
            }
            for (int i = p; i < 32 * S; i++) nxt[i] = saved[i]; /* rows >= p: never written, still 0 */
        }
    if (steps != p - 1) printf("FAIL: %d steps for p %d\n", steps, p), exit(1);
}

/* ---- skv_cc_fsolve<Q> (8 warps a block; lp packed by columns) ---- */
template <int Q>
static void emu_fsolve(int32_t m, int32_t p, const double *y, const double *lp, int eq, const double *dsc, double *x)
{
    const int WARPS = 8;
    const size_t np = (size_t)p * (p + 1) / 2;
    std::vector<double> ls(lp, lp + np); /* the flat copy, the zero pad, the reciprocals */
    ls.resize(np + 32, 0.0);
    ls.insert(ls.end(), lp + np, lp + np + p);
    const double *rinv = ls.data() + np + 32;
    std::vector<double> xo((size_t)m * p, NAN);
    int blocks = (m + WARPS - 1) / WARPS;
    for (int blk = 0; blk < blocks; blk++)
        for (int wi = 0; wi < WARPS; wi++) {
            const int64_t t = (int64_t)blk * WARPS + wi;
            if (t >= m) continue;
            double acc[32][Q];
            for (int lane = 0; lane < 32; lane++)
                for (int q = 0; q < Q; q++) {
                    int32_t j = lane + 32 * q;
                    acc[lane][q] = j < p ? y[t * p + j] : 0.0;
                    if (eq && j < p) acc[lane][q] = __dmul_rn(acc[lane][q], dsc[j]);
                }
            size_t lc = 0;
            for (int kb = 0; kb < Q; kb++)
                for (int kl = 0; kl < 32; kl++) {
                    const int32_t k = 32 * kb + kl;
                    if (k >= p) break;
                    const double xk = skv_cc_div(acc[kl][kb], ls[lc + k], rinv[k]);
                    xo[t * p + k] = xk;
                    for (int lane = 0; lane < 32; lane++)
                        for (int q = kb; q < Q; q++) {
                            const size_t e = lc + lane + 32 * q;
                            if (e >= np + 32) printf("FAIL: read past the pad\n"), exit(1);
                            if (lane + 32 * q >= p && ls[e] != 0.0 && lc + lane + 32 * q >= np) printf("FAIL: pad\n"), exit(1);
                            acc[lane][q] = __fma_rn(-xk, ls[e], acc[lane][q]);
                        }
                    lc += p - k - 1;
                }
        }
    memcpy(x, xo.data(), xo.size() * sizeof(double)); /* x may alias y: the kernel loads the row first */
}

static void fchol(int S, int32_t m, int32_t p, const double *c, int eq, double *dsc, double *l)
{
    switch (S) {
    case 1: emu_fchol<1>(m, p, c, eq, dsc, l); break;
    case 2: emu_fchol<2>(m, p, c, eq, dsc, l); break;
    case 3: emu_fchol<3>(m, p, c, eq, dsc, l); break;
    case 4: emu_fchol<4>(m, p, c, eq, dsc, l); break;
    case 5: emu_fchol<5>(m, p, c, eq, dsc, l); break;
    }
}
static void fsolve(int Q, int32_t m, int32_t p, const double *y, const double *l, int eq, const double *dsc, double *x)
{
    switch (Q) {
    case 1: emu_fsolve<1>(m, p, y, l, eq, dsc, x); break;
    case 2: emu_fsolve<2>(m, p, y, l, eq, dsc, x); break;
    case 3: emu_fsolve<3>(m, p, y, l, eq, dsc, x); break;
    case 4: emu_fsolve<4>(m, p, y, l, eq, dsc, x); break;
    case 5: emu_fsolve<5>(m, p, y, l, eq, dsc, x); break;
    }
}

int main(int argc, char **argv)
{
    std::mt19937_64 rng(argc > 1 ? strtoull(argv[1], 0, 10) : 1);
    std::normal_distribution<double> nd;
    int fails = 0, cases = 0, floored = 0;
    const int ps[] = {1, 2, 7, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 159, 160};
    const int ms[] = {160, 257, 1024};
    for (int m : ms)
        for (int p : ps) {
            if (p > m) continue;
            for (int eq = 0; eq <= 1; eq++)
                for (int kind = 0; kind < 2; kind++) {
                    /* kind 0: Y random (well conditioned); 1: Y of rank ~p/3 plus tiny noise (floored pivots) */
                    std::vector<double> y((size_t)m * p), c((size_t)p * p), cr((size_t)p * p), l((size_t)p * p + p),
                        lr((size_t)p * p, 0.0), dsc(p), x((size_t)m * p), xr((size_t)m * p), yr;
                    if (kind == 0)
                        for (auto &v : y) v = nd(rng) * std::ldexp(1.0, (int)(rng() % 9) - 4);
                    else {
                        int rk = p / 3 + 1;
                        std::vector<double> u((size_t)m * rk), vv((size_t)rk * p);
                        for (auto &v : u) v = nd(rng);
                        for (auto &v : vv) v = nd(rng);
                        for (int t = 0; t < m; t++)
                            for (int j = 0; j < p; j++) {
                                double s = 1e-13 * nd(rng);
                                for (int q = 0; q < rk; q++) s += u[(size_t)t * rk + q] * vv[(size_t)q * p + j];
                                y[(size_t)t * p + j] = s;
                            }
                    }
                    yr = y;
                    /* reference pass, step by step */
                    skv_canon_ref_cross(m, p, yr.data(), cr.data());
                    /* fast Y^T Y: the lower tiles only; compare j <= i */
                    std::fill(c.begin(), c.end(), NAN);
                    emu_mm<SKV_CC_YY_CFG>(p, p, m, y.data(), p, y.data(), p, c.data(), p, 1);
                    int ok = 1;
                    for (int i = 0; i < p; i++)
                        for (int j = 0; j <= i; j++)
                            if (memcmp(&c[(size_t)i * p + j], &cr[(size_t)i * p + j], 8)) ok = 0;
                    std::vector<double> dr(p);
                    if (eq) skv_canon_ref_equilibrate(m, p, cr.data(), yr.data(), dr.data());
                    double s, fl;
                    skv_canon_ref_shift(m, p, cr.data(), &s, &fl);
                    skv_canon_ref_chol(p, cr.data(), s, fl, lr.data());
                    skv_canon_ref_solve(m, p, lr.data(), yr.data(), xr.data());
                    /* fast chol from the fast C (upper part poisoned), then the fast solve */
                    fchol((p + 31) / 32, m, p, c.data(), eq, dsc.data(), l.data());
                    for (int i = 0; i < p; i++)
                        for (int j = 0; j <= i; j++) /* packed by columns: L_ij at lpk(p, j) + i - j */
                            if (memcmp(&l[(size_t)lpk(p, j) + i - j], &lr[(size_t)i * p + j], 8)) ok = 0;
                    if (eq && !same(dsc.data(), dr.data(), p)) ok = 0;
                    fsolve((p + 31) / 32, m, p, y.data(), l.data(), eq, dsc.data(), x.data());
                    if (!same(x.data(), xr.data(), (size_t)m * p)) ok = 0;
                    /* x aliasing y */
                    std::vector<double> y2 = y;
                    fsolve((p + 31) / 32, m, p, y2.data(), l.data(), eq, dsc.data(), y2.data());
                    if (!same(y2.data(), xr.data(), (size_t)m * p)) ok = 0;
                    cases++;
                    if (!ok) {
                        fails++;
                        printf("FAIL m %d p %d eq %d kind %d\n", m, p, eq, kind);
                    }
                }
        }
    /* the Cholesky alone on symmetric indefinite C with a positive diagonal (pivots floored) */
    for (int p : ps)
        for (int eq = 0; eq <= 1; eq++) {
            const int m = 1024;
            std::vector<double> c((size_t)p * p), cr, l((size_t)p * p + p), lr((size_t)p * p, 0.0), dsc(p), dr(p);
            for (int i = 0; i < p; i++)
                for (int j = 0; j <= i; j++)
                    c[(size_t)i * p + j] = c[(size_t)j * p + i] = i == j ? std::fabs(nd(rng)) : nd(rng); /* tr > 0 */
            cr = c;
            if (eq) skv_canon_ref_equilibrate(0, p, cr.data(), nullptr, dr.data());
            double s, fl;
            skv_canon_ref_shift(m, p, cr.data(), &s, &fl);
            skv_canon_ref_chol(p, cr.data(), s, fl, lr.data());
            int nfl = 0;
            for (int j = 0; j < p; j++) nfl += lr[(size_t)j * p + j] == std::sqrt(fl);
            fchol((p + 31) / 32, m, p, c.data(), eq, dsc.data(), l.data());
            int ok = !eq || same(dsc.data(), dr.data(), p);
            for (int i = 0; i < p; i++)
                for (int j = 0; j <= i; j++)
                    if (memcmp(&l[(size_t)lpk(p, j) + i - j], &lr[(size_t)i * p + j], 8)) ok = 0;
            cases++;
            floored += nfl;
            if (!ok) {
                fails++;
                printf("FAIL indefinite p %d eq %d (floored %d)\n", p, eq, nfl);
            }
        }
    /* Y^T Y: the probe's other variants (the lower triangle), a few shapes */
    for (int m : {160, 257, 1024})
        for (int p : {1, 33, 100, 160}) {
            std::vector<double> y((size_t)m * p), c((size_t)p * p), cr((size_t)p * p);
            for (auto &v : y) v = nd(rng);
            skv_canon_ref_cross(m, p, y.data(), cr.data());
            auto yy = [&](const char *name, void (*fn)(int32_t, int32_t, int32_t, const double *, int64_t,
                                                       const double *, int64_t, double *, int64_t, int)) {
                std::fill(c.begin(), c.end(), NAN);
                fn(p, p, m, y.data(), p, y.data(), p, c.data(), p, 1);
                int ok = 1;
                for (int i = 0; i < p; i++)
                    for (int j = 0; j <= i; j++)
                        if (memcmp(&c[(size_t)i * p + j], &cr[(size_t)i * p + j], 8)) ok = 0;
                cases++;
                if (!ok) {
                    fails++;
                    printf("FAIL Y^T Y %s m %d p %d\n", name, m, p);
                }
            };
            yy("2x2 8x16", emu_mm<2, 2, 4, 8, 32, 4, 2>);
            yy("1x2 16x16", emu_mm<1, 2, 16, 8, 32, 4, 2>);
            yy("2x2 kt16", emu_mm<2, 2, 8, 8, 16, 4, 2>);
            yy("2x2 kt64 ns3", emu_mm<2, 2, 8, 8, 64, 3, 3>);
        }
    /* G X: d x d times d x r, several shapes (tile edges) */
    const int gd[][2] = {{64, 32}, {100, 33}, {257, 160}, {1024, 160}, {1024, 1}, {70, 70}};
    for (auto &sh : gd) {
        int d = sh[0], r = sh[1];
        std::vector<double> g((size_t)d * d), xx((size_t)d * r), yy((size_t)d * r, NAN), yr((size_t)d * r);
        for (int i = 0; i < d; i++) /* G symmetric bit for bit, as skv_cc_gscale writes it */
            for (int k = 0; k <= i; k++) g[(size_t)i * d + k] = g[(size_t)k * d + i] = nd(rng);
        for (auto &v : xx) v = nd(rng);
        skv_canon_ref_gx(d, r, g.data(), xx.data(), yr.data());
        /* the kernel reads A^T = G (row k of G is its column k) */
        auto gx = [&](const char *name, void (*fn)(int32_t, int32_t, int32_t, const double *, int64_t, const double *,
                                                   int64_t, double *, int64_t, int)) {
            std::fill(yy.begin(), yy.end(), NAN);
            fn(d, r, d, g.data(), d, xx.data(), r, yy.data(), r, 0);
            cases++;
            if (!same(yy.data(), yr.data(), yy.size())) {
                fails++;
                printf("FAIL G X %s d %d r %d\n", name, d, r);
            }
        };
        gx("library", emu_mm<SKV_CC_GX_CFG>);
        /* the probe's other variants (dev/cuda/canon_gemm_probe.cu) */
        gx("4x4 64x32", emu_mm<4, 4, 16, 8, 16, 4, 2>);
        gx("2x4 32x32", emu_mm<2, 4, 16, 8, 16, 4, 2>);
        gx("2x5 16x40", emu_mm<2, 5, 8, 8, 16, 4, 2>);
        gx("2x5 ns3 pd1", emu_mm<2, 5, 16, 8, 16, 3, 1>);
        gx("2x5 kt8 ns6 pd3", emu_mm<2, 5, 16, 8, 8, 6, 3>);
        gx("1x5 32x40", emu_mm<1, 5, 32, 8, 16, 4, 2>);
    }
    printf("%d cases, %d failures (%d floored pivots in the indefinite cases)\n", cases, fails, floored);
    return fails != 0;
}
