/*
 * skv_cuda_canon_chol.cuh - the small, latency-bound part of one shifted Cholesky QR pass of
 * the canonical factorization (lib/skv_factor_canon.h: skv_canon_ref_chol, skv_canon_ref_solve;
 * docs/DESIGN.md 10.1) for p <= 160, bit for bit the reference's. Included by
 * skv_cuda_canon.cuh (and by the timing probe tests/gpu/probes/canon_chol_probe.cu); it needs
 * only skv_factor_canon.h.
 *
 * Both kernels follow one rule: every element's chain gets its fmas in order of k and no other
 * operation, the diagonal its pivot once and the rest one division, exactly as the reference.
 * The work is scheduled so that the chain from one column to the next (the only serial part)
 * is as short as it can be:
 *
 * skv_cc_fchol<S> (p <= 32 S, one block of 512 threads): the triangle lives in registers,
 *   column q owned by warp q mod 16 (slot c = q / 16), row i by lane i mod 32 (slot m = i / 32).
 *   Right-looking with a lookahead of one column and ONE barrier per step k:
 *     - the owner warp of column k + 1 first gives that column its step-k fma (L_k from shared
 *       memory), which makes it final; the diagonal's chain value is broadcast by a shuffle,
 *       every lane takes the pivot L_k+1,k+1 = skv_canon_pivot (the same operation on the same
 *       operands: the same bits) and divides its rows of the column by it; the column goes to
 *       the other half of a double-buffered shared column and to the packed output;
 *     - meanwhile every warp (the owner after its column) gives the columns q > k + 1 it owns
 *       their step-k fma;
 *     - one barrier: column k + 1 is visible, column k is no longer read.
 *   The output is the packed lower triangle by columns, L_ik (i >= k) at skv_cc_lpk(p, k) + i - k,
 *   followed by the p reciprocals RN(1 / L_kk) (skv_cc_div's y, for the solve as well).
 *
 * skv_cc_fsolve<Q> (p <= 32 Q): X = Y L^-T, a warp per row (8 rows a block). L's packed
 *   triangle is copied to shared memory once per block with 16-byte loads, many in flight.
 *   Right-looking over k: the owner lane of element k broadcasts its chain value, every lane
 *   divides it by L_kk itself (the same bits), and every element j > k gets its fma.
 */
#ifndef SKV_CUDA_CANON_CHOL_CUH
#define SKV_CUDA_CANON_CHOL_CUH

#include "skv_factor_canon.h"

/* Packed lower triangle by columns: column k (rows k .. p - 1) starts at this offset. */
static __host__ __device__ __forceinline__ int32_t skv_cc_lpk(int32_t p, int32_t k)
{
    return k * p - k * (k - 1) / 2;
}
static __host__ __device__ __forceinline__ size_t skv_cc_lp_count(int32_t p) { return (size_t)p * (p + 1) / 2; }

/*
 * RN(a / b) for b > 0, given y = RN(1 / b) (__ddiv_rn(1.0, b)): the same bits as __ddiv_rn(a, b),
 * in five dependent fp64 operations without a branch on the common path, so that several
 * quotients by one divisor overlap (the library's __ddiv_rn is ~130 cycles of latency that does
 * not overlap with the next one). Why it is exact: y has relative error < 2^-53, so q1 = RN(a y)
 * is within 2 ulps of a/b; q1 + r1 y with r1 = RN(a - b q1) is within 2^-50 ulp of a/b, so q2, its
 * rounding, is a faithful approximation of a/b (one of its two floating-point neighbours); by
 * Markstein's theorem (y within relative 2^-53 of 1/b, q2 faithful, no underflow or overflow)
 * r2 = a - b q2 is exact and RN(q2 + r2 y) = RN(a/b). The ranges below keep every quantity
 * normal with room to spare; anything else (0, subnormal, huge, inf, NaN) takes __ddiv_rn.
 */
static __device__ __forceinline__ double skv_cc_div_fast(double a, double b, double y)
{
    const double q1 = __dmul_rn(a, y);
    const double r1 = __fma_rn(-q1, b, a);
    const double q2 = __fma_rn(r1, y, q1);
    const double r2 = __fma_rn(-q2, b, a);
    return __fma_rn(r2, y, q2);
}
/* skv_cc_div_fast is RN(a / b) for these a, b (the rest take __ddiv_rn). */
static __device__ __forceinline__ bool skv_cc_div_ok(double a, double b)
{
    const double aa = fabs(a);
    return aa >= 0x1p-500 && aa <= 0x1p500 && b >= 0x1p-400 && b <= 0x1p400;
}
/* The quotient computed first and the range checked beside it, so that the check is off the
   dependent chain; the slow path is a rarely taken branch after it. */
static __device__ __forceinline__ double skv_cc_div(double a, double b, double y)
{
    double q = skv_cc_div_fast(a, b, y);
    if (!skv_cc_div_ok(a, b)) q = __ddiv_rn(a, b);
    return q;
}

#define SKV_CC_FCHOL_MAXS 5 /* p <= 160 */
#define SKV_CC_FCHOL_THREADS 512
#define SKV_CC_FCHOL_WARPS 16

/* Slot (c, m) of a warp (columns 16 c + w, rows 32 m + lane) can hold a lower element only if
   its largest row reaches its smallest column. */
#define SKV_CC_FCHOL_KEEP(c, m) (32 * (m) + 31 >= 16 * (c))

/* V: 0 the kernel; timing probes only: 1 without the bulk updates, 2 without the pivot/division */
template <int S, int V = 0>
static __global__ void __launch_bounds__(SKV_CC_FCHOL_THREADS)
    skv_cc_fchol(int32_t m, int32_t p, const double *__restrict__ c, int eq, double *__restrict__ dsc,
                 double *__restrict__ lp)
{
    static_assert(SKV_CC_FCHOL_THREADS == 32 * SKV_CC_FCHOL_WARPS, "16 warps");
    constexpr int C = 32 * S / SKV_CC_FCHOL_WARPS; /* column slots per warp */
    __shared__ double lb[2][32 * S];               /* column k of L (0 above and below p), double-buffered */
    __shared__ double ds[32 * S], dg[32 * S];
    __shared__ double sh_s, sh_fl;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    for (int i = tid; i < 32 * S; i += SKV_CC_FCHOL_THREADS) lb[0][i] = lb[1][i] = 0.0;
    if (eq)
        for (int j = tid; j < p; j += SKV_CC_FCHOL_THREADS) {
            double v = skv_canon_dscale(c[(int64_t)j * p + j]);
            ds[j] = v;
            dsc[j] = v;
        }
    __syncthreads();
    for (int j = tid; j < p; j += SKV_CC_FCHOL_THREADS) { /* the diagonal for the trace, scaled as ref */
        double v = c[(int64_t)j * p + j];
        dg[j] = eq ? __dmul_rn(v, __dmul_rn(ds[j], ds[j])) : v;
    }
    /* acc[cc][mm]: element (i, q) = (lane + 32 mm, 16 cc + w). Slots with i < q or outside p hold
       garbage: they get fmas like the rest (no per-element conditions) but are never read. */
    double acc[C][S];
#pragma unroll
    for (int cc = 0; cc < C; cc++)
#pragma unroll
        for (int mm = 0; mm < S; mm++) {
            acc[cc][mm] = 0.0;
            if (!SKV_CC_FCHOL_KEEP(cc, mm)) continue;
            const int32_t q = 16 * cc + w, i = lane + 32 * mm;
            if (q <= i && i < p) {
                double v = c[(int64_t)i * p + q];
                acc[cc][mm] = eq ? __dmul_rn(v, __dmul_rn(ds[i], ds[q])) : v;
            }
        }
    __syncthreads();
    if (tid == 0) { /* tr = ((C_00 + C_11) + C_22) + ..., in order */
        double tr = 0.0;
        for (int32_t j = 0; j < p; j++) tr = __dadd_rn(tr, dg[j]);
        double s = skv_canon_shift(m, p, tr);
        sh_s = s;
        sh_fl = skv_canon_floor(p, tr, s);
    }
    __syncthreads();
    const double s = sh_s, fl = sh_fl;
#pragma unroll
    for (int cc = 0; cc < C; cc++)
#pragma unroll
        for (int mm = 0; mm < S; mm++)
            if (SKV_CC_FCHOL_KEEP(cc, mm) && 16 * cc + w == lane + 32 * mm && lane + 32 * mm < p)
                acc[cc][mm] = __dadd_rn(acc[cc][mm], s); /* C_jj + s */
    /* column 0 is final already: warp 0 (slot c = 0) takes its pivot and divides */
    if (w == 0) {
        const double ljj = skv_canon_pivot(__shfl_sync(0xffffffffu, acc[0][0], 0), fl);
        const double y = __ddiv_rn(1.0, ljj);
        if (lane == 0) lp[skv_cc_lp_count(p)] = y;
#pragma unroll
        for (int mm = 0; mm < S; mm++) {
            const int32_t i = lane + 32 * mm;
            if (i < p) {
                const double v = i == 0 ? ljj : skv_cc_div(acc[0][mm], ljj, y);
                lb[0][i] = v;
                lp[i] = v;
            }
        }
    }
    __syncthreads();
    /* step k = kn - 1 for kn = 16 cb + kl: column kn is slot cb of warp kl, its diagonal row slot
       cb / 2; all slot indices are compile-time constants */
#pragma unroll
    for (int cb = 0; cb < C; cb++) {
        for (int kl = cb == 0 ? 1 : 0; kl < SKV_CC_FCHOL_WARPS; kl++) {
            const int32_t kn = 16 * cb + kl;
            if (kn >= p) break; /* uniform */
            const double *cur = lb[(kn - 1) & 1];
            double *nxt = lb[kn & 1];
            double nli[S]; /* -L_ik of this lane's rows (0 outside the column) */
#pragma unroll
            for (int mm = 0; mm < S; mm++) nli[mm] = -cur[lane + 32 * mm];
            if (w == kl) { /* the lookahead: column kn */
                const double lqk = cur[kn];
#pragma unroll
                for (int mm = 0; mm < S; mm++)
                    if (SKV_CC_FCHOL_KEEP(cb, mm)) acc[cb][mm] = __fma_rn(nli[mm], lqk, acc[cb][mm]);
                const double ljj = V == 2 ? __shfl_sync(0xffffffffu, acc[cb][cb >> 1], kn & 31)
                                          : skv_canon_pivot(__shfl_sync(0xffffffffu, acc[cb][cb >> 1], kn & 31), fl);
                const double y = V == 2 ? 1.0 : __ddiv_rn(1.0, ljj);
                const int32_t off = skv_cc_lpk(p, kn) - kn;
                if (lane == 0) lp[skv_cc_lp_count(p) + kn] = y;
                double q[S]; /* every slot's quotient at once (no per-lane branches between them) */
                bool slow = false;
#pragma unroll
                for (int mm = 0; mm < S; mm++) {
                    const int32_t i = lane + 32 * mm;
                    q[mm] = V == 2 ? acc[cb][mm] : skv_cc_div_fast(acc[cb][mm], ljj, y);
                    slow |= V != 2 && SKV_CC_FCHOL_KEEP(cb, mm) && i > kn && i < p && !skv_cc_div_ok(acc[cb][mm], ljj);
                }
                if (slow)
#pragma unroll
                    for (int mm = 0; mm < S; mm++) {
                        const int32_t i = lane + 32 * mm;
                        if (SKV_CC_FCHOL_KEEP(cb, mm) && i > kn && i < p && !skv_cc_div_ok(acc[cb][mm], ljj))
                            q[mm] = __ddiv_rn(acc[cb][mm], ljj);
                    }
#pragma unroll
                for (int mm = 0; mm < S; mm++) {
                    const int32_t i = lane + 32 * mm;
                    const double v = i == kn ? ljj : SKV_CC_FCHOL_KEEP(cb, mm) && i > kn ? q[mm] : 0.0;
                    if (i < p) nxt[i] = v;
                    if (i >= kn && i < p) lp[off + i] = v;
                }
            }
#pragma unroll
            for (int cc = cb; cc < C; cc++) { /* step k of the columns q > kn */
                const int32_t q = 16 * cc + w;
                if ((cc == cb && w <= kl) || q >= p || V == 1) continue; /* warp-uniform */
                const double lqk = cur[q];
#pragma unroll
                for (int mm = 0; mm < S; mm++)
                    if (SKV_CC_FCHOL_KEEP(cc, mm)) acc[cc][mm] = __fma_rn(nli[mm], lqk, acc[cc][mm]);
            }
            __syncthreads();
        }
    }
}

/*
 * skv_cc_fchol_ring<S>: skv_cc_fchol's job and element schedule, without block barriers in the
 * loop: the columns of L go to a ring of SKV_CC_RING shared columns, published in order by a
 * counter (st.release / ld.acquire, block scope). Warp w runs its own steps k = 0, 1, .. (wait
 * until column k is published; if it owns column k + 1, the lookahead and the publication; then
 * step k of its other columns) and no warp waits for another's bulk work. The ring is safe: when
 * column kn is published, every warp has published its column in [kn - 17, kn - 2] (one of
 * every 16 consecutive columns is its own), so it is past step kn - 18 and column kn - 32
 * (the slot being rewritten) is read by nobody.
 */
#define SKV_CC_RING 32
static __device__ __forceinline__ int skv_cc_ld_acquire(const int *p)
{
    int v;
    asm volatile("ld.acquire.cta.shared::cta.b32 %0, [%1];" : "=r"(v) : "r"((unsigned)__cvta_generic_to_shared(p)) : "memory");
    return v;
}
static __device__ __forceinline__ void skv_cc_st_release(int *p, int v)
{
    asm volatile("st.release.cta.shared::cta.b32 [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(p)), "r"(v) : "memory");
}

template <int S>
static __global__ void __launch_bounds__(SKV_CC_FCHOL_THREADS)
    skv_cc_fchol_ring(int32_t m, int32_t p, const double *__restrict__ c, int eq, double *__restrict__ dsc,
                      double *__restrict__ lp)
{
    constexpr int C = 32 * S / SKV_CC_FCHOL_WARPS;
    extern __shared__ __align__(16) double skv_cc_ring_sm[]; /* [SKV_CC_RING][32 S] */
    double(*lb)[32 * S] = reinterpret_cast<double(*)[32 * S]>(skv_cc_ring_sm);
    __shared__ double ds[32 * S], dg[32 * S];
    __shared__ double sh_s, sh_fl;
    __shared__ int pub; /* columns 0 .. pub - 1 are in the ring */
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    for (int i = tid; i < SKV_CC_RING * 32 * S; i += SKV_CC_FCHOL_THREADS) skv_cc_ring_sm[i] = 0.0;
    if (tid == 0) pub = 0;
    if (eq)
        for (int j = tid; j < p; j += SKV_CC_FCHOL_THREADS) {
            double v = skv_canon_dscale(c[(int64_t)j * p + j]);
            ds[j] = v;
            dsc[j] = v;
        }
    __syncthreads();
    for (int j = tid; j < p; j += SKV_CC_FCHOL_THREADS) {
        double v = c[(int64_t)j * p + j];
        dg[j] = eq ? __dmul_rn(v, __dmul_rn(ds[j], ds[j])) : v;
    }
    double acc[C][S];
#pragma unroll
    for (int cc = 0; cc < C; cc++)
#pragma unroll
        for (int mm = 0; mm < S; mm++) {
            acc[cc][mm] = 0.0;
            if (!SKV_CC_FCHOL_KEEP(cc, mm)) continue;
            const int32_t q = 16 * cc + w, i = lane + 32 * mm;
            if (q <= i && i < p) {
                double v = c[(int64_t)i * p + q];
                acc[cc][mm] = eq ? __dmul_rn(v, __dmul_rn(ds[i], ds[q])) : v;
            }
        }
    __syncthreads();
    if (tid == 0) {
        double tr = 0.0;
        for (int32_t j = 0; j < p; j++) tr = __dadd_rn(tr, dg[j]);
        double s = skv_canon_shift(m, p, tr);
        sh_s = s;
        sh_fl = skv_canon_floor(p, tr, s);
    }
    __syncthreads();
    const double s = sh_s, fl = sh_fl;
#pragma unroll
    for (int cc = 0; cc < C; cc++)
#pragma unroll
        for (int mm = 0; mm < S; mm++)
            if (SKV_CC_FCHOL_KEEP(cc, mm) && 16 * cc + w == lane + 32 * mm && lane + 32 * mm < p)
                acc[cc][mm] = __dadd_rn(acc[cc][mm], s);
    if (w == 0) {
        const double ljj = skv_canon_pivot(__shfl_sync(0xffffffffu, acc[0][0], 0), fl);
        const double y = __ddiv_rn(1.0, ljj);
        if (lane == 0) lp[skv_cc_lp_count(p)] = y;
#pragma unroll
        for (int mm = 0; mm < S; mm++) {
            const int32_t i = lane + 32 * mm;
            if (i < p) {
                const double v = i == 0 ? ljj : skv_cc_div(acc[0][mm], ljj, y);
                lb[0][i] = v;
                lp[i] = v;
            }
        }
        __syncwarp();
        if (lane == 0) skv_cc_st_release(&pub, 1);
    }
    /* this warp's last column: it has work up to the step that makes it final */
    const int32_t qlast = w < p ? w + 16 * ((p - 1 - w) / 16) : -1;
#pragma unroll
    for (int cb = 0; cb < C; cb++) {
        for (int kl = cb == 0 ? 1 : 0; kl < SKV_CC_FCHOL_WARPS; kl++) {
            const int32_t kn = 16 * cb + kl;
            if (kn > qlast) break; /* nothing left for this warp (warp-uniform) */
            while (skv_cc_ld_acquire(&pub) < kn) {
            }
            const double *cur = lb[(kn - 1) % SKV_CC_RING];
            double nli[S];
#pragma unroll
            for (int mm = 0; mm < S; mm++) nli[mm] = -cur[lane + 32 * mm];
            if (w == kl) {
                double *nxt = lb[kn % SKV_CC_RING];
                const double lqk = cur[kn];
#pragma unroll
                for (int mm = 0; mm < S; mm++)
                    if (SKV_CC_FCHOL_KEEP(cb, mm)) acc[cb][mm] = __fma_rn(nli[mm], lqk, acc[cb][mm]);
                const double ljj = skv_canon_pivot(__shfl_sync(0xffffffffu, acc[cb][cb >> 1], kn & 31), fl);
                const double y = __ddiv_rn(1.0, ljj);
                const int32_t off = skv_cc_lpk(p, kn) - kn;
                if (lane == 0) lp[skv_cc_lp_count(p) + kn] = y;
                double q[S]; /* every slot's quotient at once (no per-lane branches between them) */
                bool slow = false;
#pragma unroll
                for (int mm = 0; mm < S; mm++) {
                    const int32_t i = lane + 32 * mm;
                    q[mm] = skv_cc_div_fast(acc[cb][mm], ljj, y);
                    slow |= SKV_CC_FCHOL_KEEP(cb, mm) && i > kn && i < p && !skv_cc_div_ok(acc[cb][mm], ljj);
                }
                if (slow)
#pragma unroll
                    for (int mm = 0; mm < S; mm++) {
                        const int32_t i = lane + 32 * mm;
                        if (SKV_CC_FCHOL_KEEP(cb, mm) && i > kn && i < p && !skv_cc_div_ok(acc[cb][mm], ljj))
                            q[mm] = __ddiv_rn(acc[cb][mm], ljj);
                    }
#pragma unroll
                for (int mm = 0; mm < S; mm++) {
                    const int32_t i = lane + 32 * mm;
                    const double v = i == kn ? ljj : SKV_CC_FCHOL_KEEP(cb, mm) && i > kn ? q[mm] : 0.0;
                    if (i < p) nxt[i] = v;
                    if (i >= kn && i < p) lp[off + i] = v;
                }
                __syncwarp();
                if (lane == 0) skv_cc_st_release(&pub, kn + 1);
            }
#pragma unroll
            for (int cc = cb; cc < C; cc++) {
                const int32_t q = 16 * cc + w;
                if ((cc == cb && w <= kl) || q >= p) continue;
                const double lqk = cur[q];
#pragma unroll
                for (int mm = 0; mm < S; mm++)
                    if (SKV_CC_FCHOL_KEEP(cc, mm)) acc[cc][mm] = __fma_rn(nli[mm], lqk, acc[cc][mm]);
            }
        }
    }
}
static size_t skv_cc_fchol_ring_smem(int S) { return (size_t)SKV_CC_RING * 32 * S * sizeof(double); }

/*
 * skv_cc_fchol_panel<S, NB>: skv_cc_fchol's job with panels of 4 columns, on a cluster of NB
 * thread blocks (NB SMs; NB = 1: one block). The NW = 16 NB warps of the cluster are numbered
 * gw = 16 block + warp. Column q belongs to panel P = q / 4; panels go round-robin to the warps
 * (warp P mod NW, round P / NW, slot 4 (P / NW) + q mod 4); row i to lane i mod 32 (slot i / 32).
 * One cluster barrier per panel step s:
 *   - the owner warp of panel s gives its 4 columns the updates of panel s - 1's 4 columns (in
 *     order of k), then factors the panel inside the warp: for each column c in order, the
 *     pivot (its diagonal by a shuffle), the quotients, then the panel's later columns get
 *     column c's update (L_c'c by a shuffle); the panel goes to the other half of the
 *     double-buffered shared panel of every block of the cluster (distributed shared memory)
 *     and to the packed output;
 *   - every warp gives its columns in panels > s the 4 updates of panel s - 1, in order of k.
 * Element (i, q) still gets exactly one fma per k < q in increasing k (earlier panels in bulk
 * steps, panel s - 1 in the lookahead, its own panel's earlier columns inside the warp), the
 * pivot or one quotient: the reference's bits. The bulk work is spread over NB SMs; the
 * barrier (barrier.cluster, release/acquire) orders the panel's remote stores before the
 * next step's reads.
 */
template <int NW>
static __host__ __device__ constexpr bool skv_cc_pkeep(int cc, int mm)
{
    return 32 * mm + 31 >= 4 * NW * (cc >> 2) + (cc & 3);
}

template <int NB>
static __device__ __forceinline__ void skv_cc_cl_sync()
{
    if constexpr (NB > 1) {
        asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
    } else
        __syncthreads();
}

/* Factor panel 16 NB J + gw (its 4 columns, every earlier update applied) inside this warp;
   write it to pan[rank][t][i] of every block and to lp. */
template <int S, int C, int J, int NB>
static __device__ __forceinline__ void skv_cc_panel_factor(double (&acc)[C][S], int32_t p, double fl, int gw, int lane,
                                                          double *const (&pan)[NB], double *__restrict__ lp)
{
    constexpr int NW = 16 * NB;
    const int32_t c0 = 4 * NW * J + 4 * gw;
#pragma unroll
    for (int t = 0; t < 4; t++) {
        const int32_t c = c0 + t;
        if (c >= p) break; /* uniform */
        const int cc = 4 * J + t, md = c >> 5; /* the diagonal (c, c): lane c mod 32, slot md */
        double dv = 0.0;
#pragma unroll
        for (int mm = 0; mm < S; mm++)
            if (mm == md) dv = acc[cc][mm];
        const double ljj = skv_canon_pivot(__shfl_sync(0xffffffffu, dv, c & 31), fl);
        const double y = __ddiv_rn(1.0, ljj);
        if (lane == 0) lp[skv_cc_lp_count(p) + c] = y;
        double v[S];
        bool slow = false;
#pragma unroll
        for (int mm = 0; mm < S; mm++) {
            const int32_t i = lane + 32 * mm;
            v[mm] = skv_cc_div_fast(acc[cc][mm], ljj, y);
            slow |= skv_cc_pkeep<NW>(cc, mm) && i > c && i < p && !skv_cc_div_ok(acc[cc][mm], ljj);
        }
        if (slow)
#pragma unroll
            for (int mm = 0; mm < S; mm++) {
                const int32_t i = lane + 32 * mm;
                if (skv_cc_pkeep<NW>(cc, mm) && i > c && i < p && !skv_cc_div_ok(acc[cc][mm], ljj))
                    v[mm] = __ddiv_rn(acc[cc][mm], ljj);
            }
        const int32_t off = skv_cc_lpk(p, c) - c;
#pragma unroll
        for (int mm = 0; mm < S; mm++) {
            const int32_t i = lane + 32 * mm;
            v[mm] = i == c ? ljj : skv_cc_pkeep<NW>(cc, mm) && i > c ? v[mm] : 0.0;
            if (i < p)
#pragma unroll
                for (int rk = 0; rk < NB; rk++) pan[rk][t * 32 * S + i] = v[mm];
            if (i >= c && i < p) lp[off + i] = v[mm];
        }
        /* column c's update of the panel's later columns c2: L_c2,c from lane c2 mod 32, slot
           c2 / 32 = md (a panel never straddles 32 rows) */
        double vd = 0.0;
#pragma unroll
        for (int mm = 0; mm < S; mm++)
            if (mm == md) vd = v[mm];
#pragma unroll
        for (int t2 = t + 1; t2 < 4; t2++) {
            const double l2 = __shfl_sync(0xffffffffu, vd, (c0 + t2) & 31);
#pragma unroll
            for (int mm = 0; mm < S; mm++)
                if (skv_cc_pkeep<NW>(4 * J + t2, mm)) acc[4 * J + t2][mm] = __fma_rn(-v[mm], l2, acc[4 * J + t2][mm]);
        }
    }
}

/* Round J of the panel steps (panels NW J .. NW J + NW - 1). pb: this block's two panels;
   pbr[rk]: block rk's two panels. */
template <int S, int C, int J, int NJ, int NB>
static __device__ __forceinline__ void skv_cc_panel_rounds(double (&acc)[C][S], int32_t p, double fl, int gw, int lane,
                                                          const double (*pb)[4][32 * S], double *const (&pbr)[NB],
                                                          double *__restrict__ lp)
{
    constexpr int NW = 16 * NB, PS = 4 * 32 * S; /* doubles a panel */
    for (int gl = J == 0 ? 1 : 0; gl < NW; gl++) {
        const int32_t sp = NW * J + gl; /* the panel step */
        if (4 * sp >= p) break;         /* uniform */
        const double(*prev)[32 * S] = pb[(sp - 1) & 1];
        if (gw == gl) { /* the lookahead: panel sp's columns get panel sp - 1's updates, then it is factored */
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                double nli[S]; /* -L_ik of this lane's rows, k = 4 (sp - 1) + kk */
#pragma unroll
                for (int mm = 0; mm < S; mm++) nli[mm] = -prev[kk][lane + 32 * mm];
#pragma unroll
                for (int t = 0; t < 4; t++) {
                    const double lqk = prev[kk][4 * NW * J + 4 * gw + t];
#pragma unroll
                    for (int mm = 0; mm < S; mm++)
                        if (skv_cc_pkeep<NW>(4 * J + t, mm)) acc[4 * J + t][mm] = __fma_rn(nli[mm], lqk, acc[4 * J + t][mm]);
                }
            }
            double *nx[NB];
#pragma unroll
            for (int rk = 0; rk < NB; rk++) nx[rk] = pbr[rk] + (sp & 1) * PS;
            skv_cc_panel_factor<S, C, J, NB>(acc, p, fl, gw, lane, nx, lp);
        }
        /* panel sp - 1's updates (k in order, the outer loop) of this warp's columns in panels > sp */
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            double nli[S];
#pragma unroll
            for (int mm = 0; mm < S; mm++) nli[mm] = -prev[kk][lane + 32 * mm];
#pragma unroll
            for (int cc = 4 * J; cc < C; cc++) {
                const int32_t q = 4 * NW * (cc >> 2) + 4 * gw + (cc & 3);
                if (((cc >> 2) == J && gw <= gl) || q >= p) continue; /* uniform */
                const double lqk = prev[kk][q];
#pragma unroll
                for (int mm = 0; mm < S; mm++)
                    if (skv_cc_pkeep<NW>(cc, mm)) acc[cc][mm] = __fma_rn(nli[mm], lqk, acc[cc][mm]);
            }
        }
        skv_cc_cl_sync<NB>();
    }
    if constexpr (J + 1 < NJ) skv_cc_panel_rounds<S, C, J + 1, NJ, NB>(acc, p, fl, gw, lane, pb, pbr, lp);
}

template <int S, int NB>
static __device__ __forceinline__ void skv_cc_fchol_panel_body(int32_t m, int32_t p, const double *__restrict__ c, int eq,
                                                               double *__restrict__ dsc, double *__restrict__ lp)
{
    constexpr int NW = 16 * NB, NJ = (8 * S + NW - 1) / NW; /* rounds of NW panels (8 S panels at most) */
    constexpr int C = 4 * NJ;
    __shared__ __align__(16) double pb[2][4][32 * S]; /* a panel of L (0 above and below p), double-buffered */
    __shared__ double ds[32 * S], dg[32 * S];
    __shared__ double sh_s, sh_fl;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    int rank = 0;
    if constexpr (NB > 1) asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const int gw = 16 * rank + w;
    double *pbr[NB]; /* every block's pb, by its rank in the cluster */
#pragma unroll
    for (int rk = 0; rk < NB; rk++) {
        if constexpr (NB > 1) {
            uint32_t la = (uint32_t)__cvta_generic_to_shared(&pb[0][0][0]), ra;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(la), "r"(rk));
            uint64_t ga;
            asm volatile("{ .reg .u64 t; cvt.u64.u32 t, %1; cvta.shared::cluster.u64 %0, t; }" : "=l"(ga) : "r"(ra));
            pbr[rk] = reinterpret_cast<double *>(ga);
        } else
            pbr[rk] = &pb[0][0][0];
    }
    for (int i = tid; i < 2 * 4 * 32 * S; i += SKV_CC_FCHOL_THREADS) (&pb[0][0][0])[i] = 0.0;
    if (eq)
        for (int j = tid; j < p; j += SKV_CC_FCHOL_THREADS) {
            double v = skv_canon_dscale(c[(int64_t)j * p + j]);
            ds[j] = v;
            if (rank == 0) dsc[j] = v;
        }
    __syncthreads();
    for (int j = tid; j < p; j += SKV_CC_FCHOL_THREADS) {
        double v = c[(int64_t)j * p + j];
        dg[j] = eq ? __dmul_rn(v, __dmul_rn(ds[j], ds[j])) : v;
    }
    /* acc[cc][mm]: element (lane + 32 mm, 4 NW (cc / 4) + 4 gw + cc mod 4); garbage where i < q */
    double acc[C][S];
#pragma unroll
    for (int cc = 0; cc < C; cc++)
#pragma unroll
        for (int mm = 0; mm < S; mm++) {
            acc[cc][mm] = 0.0;
            if (!skv_cc_pkeep<NW>(cc, mm)) continue;
            const int32_t q = 4 * NW * (cc >> 2) + 4 * gw + (cc & 3), i = lane + 32 * mm;
            if (q <= i && i < p) {
                double v = c[(int64_t)i * p + q];
                acc[cc][mm] = eq ? __dmul_rn(v, __dmul_rn(ds[i], ds[q])) : v;
            }
        }
    __syncthreads();
    if (tid == 0) {
        double tr = 0.0;
        for (int32_t j = 0; j < p; j++) tr = __dadd_rn(tr, dg[j]);
        double s = skv_canon_shift(m, p, tr);
        sh_s = s;
        sh_fl = skv_canon_floor(p, tr, s);
    }
    skv_cc_cl_sync<NB>(); /* also: every block's pb is zeroed before any remote store */
    const double s = sh_s, fl = sh_fl;
#pragma unroll
    for (int cc = 0; cc < C; cc++)
#pragma unroll
        for (int mm = 0; mm < S; mm++)
            if (skv_cc_pkeep<NW>(cc, mm) && 4 * NW * (cc >> 2) + 4 * gw + (cc & 3) == lane + 32 * mm && lane + 32 * mm < p)
                acc[cc][mm] = __dadd_rn(acc[cc][mm], s);
    if (gw == 0) skv_cc_panel_factor<S, C, 0, NB>(acc, p, fl, 0, lane, pbr, lp); /* panel 0 */
    skv_cc_cl_sync<NB>();
    skv_cc_panel_rounds<S, C, 0, NJ, NB>(acc, p, fl, gw, lane, pb, pbr, lp);
}

template <int S>
static __global__ void __launch_bounds__(SKV_CC_FCHOL_THREADS)
    skv_cc_fchol_panel(int32_t m, int32_t p, const double *__restrict__ c, int eq, double *__restrict__ dsc,
                       double *__restrict__ lp)
{
    skv_cc_fchol_panel_body<S, 1>(m, p, c, eq, dsc, lp);
}

/* The cluster version: launch SKV_CC_CLUSTER blocks of SKV_CC_FCHOL_THREADS (one cluster). */
#define SKV_CC_CLUSTER 4
template <int S>
static __global__ void __cluster_dims__(SKV_CC_CLUSTER, 1, 1) __launch_bounds__(SKV_CC_FCHOL_THREADS)
    skv_cc_fchol_cluster(int32_t m, int32_t p, const double *__restrict__ c, int eq, double *__restrict__ dsc,
                         double *__restrict__ lp)
{
    skv_cc_fchol_panel_body<S, SKV_CC_CLUSTER>(m, p, c, eq, dsc, lp);
}

#define SKV_CC_FSOLVE_MAXQ 5 /* p <= 160 */
#define SKV_CC_FSOLVE_WARPS 8
/* The packed triangle, 32 zeros (the lanes j >= p of the last columns read past its end), the
   reciprocals 1 / L_kk. */
static size_t skv_cc_fsolve_smem(int32_t p) { return (skv_cc_lp_count(p) + 32 + p) * sizeof(double); }

/* lp: the packed triangle and the reciprocals (skv_cc_fchol's output, 16-byte aligned). */
template <int Q>
static __global__ void __launch_bounds__(32 * SKV_CC_FSOLVE_WARPS)
    skv_cc_fsolve(int32_t m, int32_t p, const double *y, const double *__restrict__ lp, int eq,
                  const double *__restrict__ dsc, double *x)
{
    extern __shared__ __align__(16) double ls[];
    const int lane = threadIdx.x & 31;
    const int32_t t = (int32_t)(blockIdx.x * SKV_CC_FSOLVE_WARPS + threadIdx.x / 32);
    /* the row first (its loads overlap the copy), then L: 8 16-byte loads in flight a thread */
    double acc[Q];
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const int32_t j = lane + 32 * q;
        acc[q] = t < m && j < p ? y[(int64_t)t * p + j] : 0.0;
    }
    {
        const int32_t np = (int32_t)skv_cc_lp_count(p), n2 = np / 2;
        const double2 *src = reinterpret_cast<const double2 *>(lp);
        double2 *dst = reinterpret_cast<double2 *>(ls);
        constexpr int U = 8, NT = 32 * SKV_CC_FSOLVE_WARPS;
        for (int32_t e0 = 0; e0 < n2; e0 += U * NT) {
            double2 v[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int32_t e = e0 + u * NT + (int32_t)threadIdx.x;
                if (e < n2) v[u] = __ldg(src + e);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int32_t e = e0 + u * NT + (int32_t)threadIdx.x;
                if (e < n2) dst[e] = v[u];
            }
        }
        if ((np & 1) && threadIdx.x == 0) ls[np - 1] = lp[np - 1];
        if (threadIdx.x < 32) ls[np + threadIdx.x] = 0.0;
        for (int32_t k = threadIdx.x; k < p; k += NT) ls[np + 32 + k] = lp[np + k];
    }
    __syncthreads();
    if (t >= m) return; /* after the only barrier */
    if (eq) {
#pragma unroll
        for (int q = 0; q < Q; q++) {
            const int32_t j = lane + 32 * q;
            if (j < p) acc[q] = __dmul_rn(acc[q], dsc[j]);
        }
    }
    /* Step k = 32 kb + kl: element k is slot kb of lane kl (compile-time slot). Its owner stores
       x_tk as soon as it is known; after that its slot (like every slot j < k, and j >= p) only
       collects garbage fmas, never read, so the updates need no per-element conditions. The
       reads lc[j] for j < k stay inside the triangle, those for j >= p inside the zero pad. */
    double *xr = x + (int64_t)t * p;
    const double *rinv = ls + skv_cc_lp_count(p) + 32;
    const double *lc = ls; /* lc[j] = L_jk for j >= k: column k's start minus k */
#pragma unroll
    for (int kb = 0; kb < Q; kb++) {
        for (int kl = 0; kl < 32; kl++) {
            const int32_t k = 32 * kb + kl;
            if (k >= p) break;
            const double xk = skv_cc_div(__shfl_sync(0xffffffffu, acc[kb], kl), lc[k], rinv[k]);
            if (lane == kl) xr[k] = xk;
#pragma unroll
            for (int q = kb; q < Q; q++) acc[q] = __fma_rn(-xk, lc[lane + 32 * q], acc[q]);
            lc += p - k - 1; /* column k + 1 starts p - k entries later, at index k + 1 */
        }
    }
}

#endif
