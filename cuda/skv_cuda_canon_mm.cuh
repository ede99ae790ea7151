/*
 * skv_cuda_canon_mm.cuh - the canonical route's fixed-order fp64 GEMMs: G X and the lower
 * triangle of Y^T Y (lib/skv_factor_canon.h step 3: skv_canon_ref_gx, skv_canon_ref_cross), each
 * output one fma chain in order of k from 0, by fma (skv_cc_mm) or on the fp64 tensor cores
 * (skv_cc_mm_tc, below; what the library launches where K % 4 == 0). No dependence on the factor's state:
 * skv_cuda_factor_canon.cu launches it, dev/cuda/canon_gemm_probe.cu times it and checks it,
 * dev/cuda/canon_sched_emu.cpp emulates its schedule on the host.
 *
 * C [M, N] (row major, ldc) with C(i, j) = chain over k = 0..K-1 of fma(A(i, k), B(k, j), acc)
 * from acc = 0, where both operands are read k-major: A(i, k) = at[k lda + i] (A^T stored row
 * major), B(k, j) = b[k ldb + j]. Y^T Y: at = b = Y [m, p]. G X: at = G [d, d], which is
 * symmetric bit for bit (skv_cc_gscale writes one value to both triangles), so G's row k is
 * its column k: at[k d + i] = G(k, i) = G(i, k).
 *
 * Schedule. TY x TX threads; thread (ty, tx) owns TM x TN outputs in registers (a block tile
 * of BM = TY TM rows by BN = TX TN columns): rows 2 ty + (p & 1) + 2 TY (p >> 1) for the
 * TM / 2 pairs p < 2 (TM / 2), then (TM odd) row 2 TY (TM / 2) + ty; the columns likewise with
 * tx, TX and TN. A pair is one 16-byte shared-memory load, a single one 8-byte load; a warp's
 * lanes share rows (broadcast) and read consecutive pairs of columns (no bank conflict).
 * k goes through shared memory in stages of KT rows of A^T and B, NS stages in a ring filled
 * by cp.async (16-byte copies where both operands allow: even leading dimensions, even M and
 * N, 16-byte aligned pointers; 8-byte copies otherwise; zero fill past M, N or K), so NS - 2
 * stages are in flight while one is multiplied. At the top of stage st every thread waits
 * for its own copies of stage st + 1, one barrier makes them visible to all (and ends
 * everyone's reads of stage st - 1), then the copies of stage st + NS - 1 go into the buffer
 * of stage st - 1. Within a stage the operands of k + PD are loaded into registers while k is
 * multiplied (a ring of PD + 1 register fragments), across the stage boundary too (stage st + 1
 * is visible from the top of stage st), so neither the barrier nor the shared-memory latency
 * sits between two fmas of a chain.
 *
 * Why the bits are the reference's: each output lives in one register of one thread from
 * acc = 0 to its store; the thread visits the stages in order and, in a stage, kk = 0..KT-1 in
 * order, one __fma_rn(A(i, k), B(k, j), acc) per k, and in the last stage only the k < K
 * (no padded term: fma(0, b, -0.0) would turn a -0 into +0); the register fragment used at k
 * holds A(i, k) and B(k, j) (loaded from stage k / KT's buffer, row k % KT, which is not
 * overwritten before the barrier at the top of stage k / KT + 1). That is exactly the chain of
 * skv_canon_ref_gx / skv_canon_ref_cross (fma(a, b, c) = fma(b, a, c) bitwise, so Y^T Y's
 * C(i, j) = C(j, i) whichever operand comes first). lower != 0 (M = N): blocks whose tile lies
 * wholly above the diagonal (j0 >= i0 + BM) return at once, before any barrier; the consumers
 * (the Cholesky kernels) read C(i, j) for j <= i only; the tiles the diagonal crosses are
 * computed whole.
 */
#ifndef SKV_CUDA_CANON_MM_CUH
#define SKV_CUDA_CANON_MM_CUH

#include <stdint.h>

/* The configurations the library launches (dev/cuda/canon_gemm_probe.cu times others;
   dev/cuda/canon_sched_emu.cpp emulates these), as skv_cc_mm's template arguments
   TM, TN, TY, TX, KT, NS, PD; the probe's fastest on the H200 (bench/results). G X at d = 1024,
   r = 160: 16 x 40 tiles of 64 threads (2 x 5 outputs each), 256 blocks. */
#define SKV_CC_GX_CFG 2, 5, 8, 8, 16, 4, 2
#define SKV_CC_GX_BM (8 * 2)
#define SKV_CC_GX_BN (8 * 5)
#define SKV_CC_GX_NT 64
/* Y^T Y at p = 160, m = 1024: 16 x 16 tiles of 64 threads (2 x 2 outputs each), the lower
   triangle's 55 tiles, k stages of 64 three deep: every chain is 1024 long, so the time is its
   latency. */
#define SKV_CC_YY_CFG 2, 2, 8, 8, 64, 3, 3
#define SKV_CC_YY_BM 16
#define SKV_CC_YY_BN 16
#define SKV_CC_YY_NT 64

#if defined(__CUDACC__)
static __device__ __forceinline__ void skv_cc_cp16(void *dst, const void *src, int bytes)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void skv_cc_cp8(void *dst, const void *src, int bytes)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(src), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void skv_cc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
static __device__ __forceinline__ void skv_cc_cp_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* One stage's copies of one operand: rows k0 .. k0 + KT - 1 of src (row major, ld), columns
   c0 .. c0 + W - 1, into dst [KT][LD] (LD >= W: a padded row); zeros past K rows or C columns. */
template <int KT, int W, int NT, int LD = W>
static __device__ __forceinline__ void skv_cc_mm_copy(double *dst, const double *__restrict__ src, int64_t ld,
                                                      int32_t k0, int32_t K, int32_t c0, int32_t C, bool vec, int tid)
{
    static_assert(LD % 2 == 0, "16-byte aligned stage rows");
    if (vec) {
        constexpr int CH = KT * (W / 2);
#pragma unroll
        for (int e = 0; e < (CH + NT - 1) / NT; e++) {
            const int idx = tid + NT * e;
            if (CH % NT == 0 || idx < CH) {
                const int kk = idx / (W / 2), cc = 2 * (idx % (W / 2));
                const int32_t gk = k0 + kk, gc = c0 + cc;
                const bool ok = gk < K && gc < C; /* C even: a pair is wholly in or out */
                skv_cc_cp16(dst + kk * LD + cc, ok ? src + gk * ld + gc : src, ok ? 16 : 0);
            }
        }
    } else {
        constexpr int CH = KT * W;
#pragma unroll
        for (int e = 0; e < (CH + NT - 1) / NT; e++) {
            const int idx = tid + NT * e;
            if (CH % NT == 0 || idx < CH) {
                const int kk = idx / W, cc = idx % W;
                const int32_t gk = k0 + kk, gc = c0 + cc;
                const bool ok = gk < K && gc < C;
                skv_cc_cp8(dst + kk * LD + cc, ok ? src + gk * ld + gc : src, ok ? 8 : 0);
            }
        }
    }
}

/* The operand fragment of row kk of a stage: v[0..T-1] = the thread's T values (pairs at
   2 t + 2 TT h, then the single at 2 TT (T / 2) + t). */
template <int T, int TT>
static __device__ __forceinline__ void skv_cc_mm_frag(const double *row, int t, double *v)
{
#pragma unroll
    for (int h = 0; h < T / 2; h++) {
        const double2 w = *reinterpret_cast<const double2 *>(row + 2 * t + 2 * TT * h);
        v[2 * h] = w.x;
        v[2 * h + 1] = w.y;
    }
    if (T % 2) v[T - 1] = row[2 * TT * (T / 2) + t];
}

/* The thread's row (column) of slot p: see the schedule above. */
template <int T, int TT>
static __host__ __device__ __forceinline__ int skv_cc_mm_pos(int t, int p)
{
    return p < 2 * (T / 2) ? 2 * t + (p & 1) + 2 * TT * (p >> 1) : 2 * TT * (T / 2) + t;
}

template <int TM, int TN, int TY, int TX, int KT, int NS, int PD>
static __global__ void __launch_bounds__(TY *TX)
    skv_cc_mm(int32_t M, int32_t N, int32_t K, const double *__restrict__ at, int64_t lda, const double *__restrict__ b,
              int64_t ldb, double *__restrict__ c, int64_t ldc, int lower)
{
    constexpr int NT = TY * TX, BM = TY * TM, BN = TX * TN;
    static_assert(BM % 2 == 0 && BN % 2 == 0, "16-byte stage rows");
    static_assert(NS >= 3, "stage st + 1 lands while st is multiplied");
    static_assert(PD >= 1 && PD < KT, "register prefetch distance");
    __shared__ __align__(16) double as[NS][KT][BM];
    __shared__ __align__(16) double bs[NS][KT][BN];
    const int32_t i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    if (lower && j0 >= i0 + BM) return; /* whole block: before any barrier */
    const int tid = threadIdx.x, tx = tid % TX, ty = tid / TX;
    const bool vec = ((lda | ldb | M | N) & 1) == 0 && ((uintptr_t)at & 15) == 0 && ((uintptr_t)b & 15) == 0;
    const int32_t nst = (K + KT - 1) / KT;
    auto issue = [&](int32_t st) {
        const int buf = st % NS;
        skv_cc_mm_copy<KT, BM, NT>(&as[buf][0][0], at, lda, st * KT, K, i0, M, vec, tid);
        skv_cc_mm_copy<KT, BN, NT>(&bs[buf][0][0], b, ldb, st * KT, K, j0, N, vec, tid);
    };
    double acc[TM][TN];
#pragma unroll
    for (int p = 0; p < TM; p++)
#pragma unroll
        for (int q = 0; q < TN; q++) acc[p][q] = 0.0;
#pragma unroll
    for (int s = 0; s < NS - 1; s++) {
        if (s < nst) issue(s);
        skv_cc_cp_commit();
    }
    skv_cc_cp_wait<NS - 2>(); /* stage 0 */
    __syncthreads();
    /* fr[q]: the operands of k = st KT + kk + q (q < PD loaded; fr[PD] is the one in flight) */
    double fa[PD + 1][TM], fb[PD + 1][TN];
    if (K >= KT)
#pragma unroll
        for (int q = 0; q < PD; q++) {
            skv_cc_mm_frag<TM, TY>(&as[0][q][0], ty, fa[q]);
            skv_cc_mm_frag<TN, TX>(&bs[0][q][0], tx, fb[q]);
        }
    for (int32_t st = 0; st < nst; st++) {
        skv_cc_cp_wait<NS - 3>(); /* stage st + 1 (own copies) */
        __syncthreads();          /* visible to all; everyone is done with stage st - 1's buffer */
        if (st + NS - 1 < nst) issue(st + NS - 1);
        skv_cc_cp_commit();
        const int buf = st % NS, nbuf = (st + 1) % NS;
        if ((st + 1) * KT <= K) { /* a full stage; fr[0 .. PD-1] hold kk = 0 .. PD-1 */
            const bool more = (st + 2) * KT <= K; /* the next stage is full too: prefetch into it */
#pragma unroll
            for (int kk = 0; kk < KT; kk++) {
                const int kn = kk + PD;
                if (kn < KT) {
                    skv_cc_mm_frag<TM, TY>(&as[buf][kn][0], ty, fa[PD]);
                    skv_cc_mm_frag<TN, TX>(&bs[buf][kn][0], tx, fb[PD]);
                } else if (more) {
                    skv_cc_mm_frag<TM, TY>(&as[nbuf][kn - KT][0], ty, fa[PD]);
                    skv_cc_mm_frag<TN, TX>(&bs[nbuf][kn - KT][0], tx, fb[PD]);
                }
#pragma unroll
                for (int p = 0; p < TM; p++)
#pragma unroll
                    for (int q = 0; q < TN; q++) acc[p][q] = __fma_rn(fa[0][p], fb[0][q], acc[p][q]);
#pragma unroll
                for (int q = 0; q < PD; q++) {
#pragma unroll
                    for (int p = 0; p < TM; p++) fa[q][p] = fa[q + 1][p];
#pragma unroll
                    for (int p = 0; p < TN; p++) fb[q][p] = fb[q + 1][p];
                }
            }
        } else { /* the last stage, K % KT rows: no prefetch */
            const int32_t kn = K - st * KT;
            for (int kk = 0; kk < kn; kk++) {
                skv_cc_mm_frag<TM, TY>(&as[buf][kk][0], ty, fa[0]);
                skv_cc_mm_frag<TN, TX>(&bs[buf][kk][0], tx, fb[0]);
#pragma unroll
                for (int p = 0; p < TM; p++)
#pragma unroll
                    for (int q = 0; q < TN; q++) acc[p][q] = __fma_rn(fa[0][p], fb[0][q], acc[p][q]);
            }
        }
    }
    skv_cc_cp_wait<0>(); /* no copy outlives the block */
#pragma unroll
    for (int p = 0; p < TM; p++)
#pragma unroll
        for (int q = 0; q < TN; q++) {
            const int32_t i = i0 + skv_cc_mm_pos<TM, TY>(ty, p), j = j0 + skv_cc_mm_pos<TN, TX>(tx, q);
            if (i < M && j < N) c[(int64_t)i * ldc + j] = acc[p][q];
        }
}


/* The same products on the fp64 tensor cores (skv_cc_mm_tc). mma.sync m8n8k4 f64 adds its four
   products into each accumulator as the chain acc = fma(a_k, b_k, acc) for k = 0, 1, 2, 3 in
   order, rounding each: dev/cuda/dmma_order_probe.cu compares chained mma k-steps with
   that fma chain on random tiles (uniform, wide exponents, integer grids with a small tail,
   cancellation, subnormal products, signed zeros) and finds no difference on the H200; the
   canonical tests compare the route's U and W bit for bit with ref on every run. So k-steps of 4
   from acc = +0, in order of k, give each output skv_canon_ref_gx's / skv_canon_ref_cross's chain.
   Needs K % 4 == 0 (no padded term); the library takes skv_cc_mm otherwise.
   Schedule: WM x WN warps, warp (wm, wn) owns FM x FN tiles of 8 x 8 outputs (rows 8 (FM wm + fm)
   .., columns 8 (FN wn + fn) ..; lane l holds row l / 4, columns 2 (l % 4), + 1 of a tile); k in
   stages of KT rows through shared memory (rows padded to BM + 4 and BN + 4 doubles, so a k-step's
   fragment loads, lane l reading row k + l % 4, column l / 4, hit distinct banks), NS stages in a
   cp.async ring as skv_cc_mm's: at the top of stage st every thread waits for its copies of stage
   st, one barrier, then stage st + NS - 1 goes into stage st - 1's buffer. */
/* The configurations the library launches: the probe's fastest on the H200 (G X 29.7 us against
   51.4 for skv_cc_mm's best; Y^T Y 17.7 against 21.6), 16 x 16 tiles of four warps, one 8 x 8
   tile each, k stages of 32 four deep. */
#define SKV_CC_GX_TC_CFG 2, 2, 1, 1, 32, 4
#define SKV_CC_GX_TC_BM 16
#define SKV_CC_GX_TC_BN 16
#define SKV_CC_GX_TC_NT 128
#define SKV_CC_YY_TC_CFG 2, 2, 1, 1, 32, 4
#define SKV_CC_YY_TC_BM 16
#define SKV_CC_YY_TC_BN 16
#define SKV_CC_YY_TC_NT 128

static __device__ __forceinline__ void skv_cc_dmma(double (&d)[2], double a, double b)
{
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                 : "+d"(d[0]), "+d"(d[1])
                 : "d"(a), "d"(b));
}

/* One k-step of 4 of a stage: the lane's fragments of row k (= k-step + l % 4) and the FM x FN mmas. */
template <int FM, int FN, int LA, int LB>
static __device__ __forceinline__ void skv_cc_mm_tc_kstep(const double *ab, const double *bb, int k,
                                                          double (&acc)[FM][FN][2])
{
    double fa[FM], fb[FN];
#pragma unroll
    for (int p = 0; p < FM; p++) fa[p] = ab[k * LA + 8 * p];
#pragma unroll
    for (int q = 0; q < FN; q++) fb[q] = bb[k * LB + 8 * q];
#pragma unroll
    for (int p = 0; p < FM; p++)
#pragma unroll
        for (int q = 0; q < FN; q++) skv_cc_dmma(acc[p][q], fa[p], fb[q]);
}

template <int WM, int WN, int FM, int FN, int KT, int NS>
static __global__ void __launch_bounds__(32 * WM *WN)
    skv_cc_mm_tc(int32_t M, int32_t N, int32_t K, const double *__restrict__ at, int64_t lda, const double *__restrict__ b,
                 int64_t ldb, double *__restrict__ c, int64_t ldc, int lower)
{
    constexpr int NT = 32 * WM * WN, BM = 8 * FM * WM, BN = 8 * FN * WN, LA = BM + 4, LB = BN + 4;
    static_assert(KT % 4 == 0 && NS >= 2, "whole k-steps; a ring");
    __shared__ __align__(16) double as[NS][KT][LA];
    __shared__ __align__(16) double bs[NS][KT][LB];
    const int32_t i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    if (lower && j0 >= i0 + BM) return; /* whole block: before any barrier */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp / WN, wn = warp % WN;
    const int fr = lane & 3, fc = lane >> 2; /* a fragment's k row and its output row / column */
    const bool vec = ((lda | ldb | M | N) & 1) == 0 && ((uintptr_t)at & 15) == 0 && ((uintptr_t)b & 15) == 0;
    const int32_t nst = (K + KT - 1) / KT;
    auto issue = [&](int32_t st) {
        const int buf = st % NS;
        skv_cc_mm_copy<KT, BM, NT, LA>(&as[buf][0][0], at, lda, st * KT, K, i0, M, vec, tid);
        skv_cc_mm_copy<KT, BN, NT, LB>(&bs[buf][0][0], b, ldb, st * KT, K, j0, N, vec, tid);
    };
    double acc[FM][FN][2];
#pragma unroll
    for (int p = 0; p < FM; p++)
#pragma unroll
        for (int q = 0; q < FN; q++) acc[p][q][0] = acc[p][q][1] = 0.0;
#pragma unroll
    for (int s = 0; s < NS - 1; s++) {
        if (s < nst) issue(s);
        skv_cc_cp_commit();
    }
    for (int32_t st = 0; st < nst; st++) {
        skv_cc_cp_wait<NS - 2>(); /* stage st (own copies) */
        __syncthreads();          /* visible to all; everyone is done with stage st - 1's buffer */
        if (st + NS - 1 < nst) issue(st + NS - 1);
        skv_cc_cp_commit();
        const int buf = st % NS;
        const int32_t kn = K - st * KT < KT ? K - st * KT : KT; /* a multiple of 4 */
        const double *ab = &as[buf][0][8 * FM * wm + fc], *bb = &bs[buf][0][8 * FN * wn + fc];
        if (kn == KT) {
#pragma unroll
            for (int kk = 0; kk < KT; kk += 4) skv_cc_mm_tc_kstep<FM, FN, LA, LB>(ab, bb, kk + fr, acc);
        } else
            for (int kk = 0; kk < kn; kk += 4) skv_cc_mm_tc_kstep<FM, FN, LA, LB>(ab, bb, kk + fr, acc);
    }
    skv_cc_cp_wait<0>(); /* no copy outlives the block */
#pragma unroll
    for (int p = 0; p < FM; p++)
#pragma unroll
        for (int q = 0; q < FN; q++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int32_t i = i0 + 8 * (FM * wm + p) + fc, j = j0 + 8 * (FN * wn + q) + 2 * fr + h;
                if (i < M && j < N) c[(int64_t)i * ldc + j] = acc[p][q][h];
            }
}

#endif /* __CUDACC__ */

#endif
