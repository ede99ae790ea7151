/*
 * skv_cuda_canon_chol.cuh - the small, latency-bound part of one shifted Cholesky QR pass of
 * the canonical factorization (lib/skv_factor_canon.h: skv_canon_ref_chol, skv_canon_ref_solve;
 * docs/DESIGN.md 10.1) for p <= 160, bit for bit the reference's. Included by
 * skv_cuda_factor_canon.cu (and by the timing probe dev/cuda/canon_chol_probe.cu); it needs
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
 *   divides it by L_kk itself (skv_cc_div with the Cholesky's reciprocal: the same bits), and
 *   every element j > k gets its fma.
 *
 * Measured on the H200 at p = 160 (dev/cuda/canon_chol_probe.cu): the Cholesky 90 us
 * (the former two-barrier kernel about 220 us; 70 us with the bulk updates switched off, so the
 * column-to-column chain is most of it), the solve 19 us (73 us before the packed copy and
 * skv_cc_div). Variants that did not pay, kept in the history: publishing columns through a
 * ring without barriers (90 us), 4-column panels factored inside a warp (98 us), and the
 * panels on a cluster of 4 SMs through distributed shared memory (117 us).
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
 * dev/cuda/canon_div_emu.cpp checks the sequence against the division on 2e8 pairs.
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
