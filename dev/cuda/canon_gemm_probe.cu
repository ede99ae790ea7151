/*
 * canon_gemm_probe.cu - the canonical route's step-3 GEMMs and its element kernels, timed and
 * checked on one GPU: G X (M = d = 1024, N = r = 160, K = 1024) and the lower triangle of Y^T Y
 * (160 x 160, K = 1024) by the former skv_cc_gemm configurations (a copy below) and by
 * skv_cc_mm (cuda/skv_cuda_canon_mm.cuh, the library's kernel) in several configurations, the
 * library's first; the int8 digit kernel skv_cc_slice (one 32768-row block, as the library's
 * plan at n = 64k) against its former version; step 4's fixed-point rows (7084 rows, the
 * library's canon_rows at d = 1024, r = 160) and U's scaling against theirs.
 * Every variant's output is poisoned first and compared bit for bit with a plain kernel (the
 * GEMMs: one thread per output, one fma chain in order of k; the element kernels: the former
 * kernels). One line per variant: median and min of the timed launches (cudaEvent per launch,
 * after warm-up). Exit status 1 on any mismatch.
 *
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -Iinclude -Ilib -Icuda \
 *     dev/cuda/canon_gemm_probe.cu -o build/canon_gemm_probe && build/canon_gemm_probe [reps]
 *
 * Default 100 timed launches per variant (a few seconds in all).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "skv_cuda_canon_fix.cuh"
#include "skv_cuda_canon_i8.cuh"
#include "skv_cuda_canon_mm.cuh"
#include "probe_common.cuh"

/* A variant of skv_cc_fix the library does not use (measured slower on the H200). */
/* The same, 8 columns per thread (d % 8 == 0, a 16-byte aligned): thread (x, y) of a 32 x 8 block
   converts the 16-byte chunk g = 32 blockIdx.x + x of the rows blockIdx.y 8 + y + k 8 gridDim.y,
   by skv_cc_i8_fix_bf16 (skv_canon_fix's integer; the sign bit put back on a zero, so every
   double is skv_canon_fix's, -0.0 included), four 16-byte stores. */
static __global__ void __launch_bounds__(256)
    skv_cc_fix8(const skv_bf16 *__restrict__ a, int64_t rows, int32_t d, const int32_t *__restrict__ e, int32_t F,
                double *__restrict__ blk)
{
    const int32_t g = blockIdx.x * 32 + threadIdx.x, ng = d / 8;
    if (g >= ng) return;
    int32_t ec[8];
#pragma unroll
    for (int c = 0; c < 8; c++) ec[c] = e[8 * g + c];
    for (int64_t t = (int64_t)blockIdx.y * 8 + threadIdx.y; t < rows; t += (int64_t)gridDim.y * 8) {
        const uint4 w = __ldg((const uint4 *)(a + t * d) + g);
        const uint32_t ww[4] = {w.x, w.y, w.z, w.w};
        double v[8];
#pragma unroll
        for (int c = 0; c < 8; c++) {
            const uint16_t h = (uint16_t)(ww[c / 2] >> (16 * (c & 1)));
            v[c] = __longlong_as_double(__double_as_longlong((double)skv_cc_i8_fix_bf16(h, F, ec[c])) |
                                        ((long long)(h & 0x8000u) << 48));
        }
        double2 *o = (double2 *)(blk + t * d + 8 * g);
#pragma unroll
        for (int c = 0; c < 4; c++) o[c] = make_double2(v[2 * c], v[2 * c + 1]);
    }
}


/* ---- the former kernels (copies) ---- */

/*
 * old_gemm (the former skv_cc_gemm): C [M, N] (row major, ldc), C(i, j) = chain over k = 0..K-1 of fma(A(i, k), B(k, j),
 * acc) from acc = 0, A(i, k) = a[i sai + k sak], B(k, j) = b[k sbk + j sbj]: the products of the
 * former chain kernel, faster. TY x TX threads; thread (ty, tx) owns TM x TN outputs in
 * registers (a block tile of TY TM x TX TN). k goes through
 * shared memory in stages of KT, double buffered: the next stage's global loads are in registers
 * while the current stage is multiplied, one barrier per stage. A thread's rows and columns come
 * in adjacent pairs (row 2 ty + (p & 1) + 2 TY (p >> 1), column 2 tx + (q & 1) + 2 TX (q >> 1);
 * TM, TN even), so each operand pair is one 16-byte shared-memory load. Why the bits are the reference's:
 * each output lives in one register of one thread from acc = 0 to its store; the thread visits
 * the stages in order and, in a stage, kk = 0..KT-1 in order (terms with k0 + kk >= K skipped, no
 * padded term), one __fma_rn(A(i, k), B(k, j), acc) per k: exactly the chain of
 * skv_canon_ref_gx / skv_canon_ref_cross (fma(a, b, c) = fma(b, a, c) bitwise, so Y^T Y's
 * C(i, j) = C(j, i) whichever operand comes first). lower != 0 (M = N, square tiles): the tiles
 * strictly above the diagonal are skipped; the consumers (the Cholesky kernels) read C(i, j) for
 * j <= i only, and the diagonal tiles are computed whole.
 */
template <int TM, int TN, int TY, int TX, int KT>
static __global__ void __launch_bounds__(TY *TX)
    old_gemm(int32_t M, int32_t N, int32_t K, const double *__restrict__ a, int64_t sai, int64_t sak,
                const double *__restrict__ b, int64_t sbk, int64_t sbj, double *__restrict__ c, int64_t ldc, int lower)
{
    constexpr int NT = TY * TX, BM = TY * TM, BN = TX * TN;
    constexpr int LA = (KT * BM + NT - 1) / NT, LB = (KT * BN + NT - 1) / NT; /* stage loads per thread */
    static_assert(TM % 2 == 0 && TN % 2 == 0, "outputs in pairs");
    /* rows of BM + 2 (even: every pair 16-byte aligned) */
    __shared__ __align__(16) double as[2][KT][BM + 2];
    __shared__ __align__(16) double bs[2][KT][BN + 2];
    if (lower && blockIdx.x > blockIdx.y) return; /* whole block: before any barrier */
    const int tid = threadIdx.x, tx = tid % TX, ty = tid / TX;
    const int32_t i0 = blockIdx.y * BM, j0 = blockIdx.x * BN;
    double acc[TM][TN], ra[LA], rb[LB];
#pragma unroll
    for (int p = 0; p < TM; p++)
#pragma unroll
        for (int q = 0; q < TN; q++) acc[p][q] = 0.0;
    /* stage loads: consecutive threads along the operand's contiguous index (coalesced) */
    auto load = [&](int32_t k0) {
#pragma unroll
        for (int e = 0; e < LA; e++) {
            int idx = tid + NT * e;
            int kk = sak == 1 ? idx % KT : idx / BM, ii = sak == 1 ? idx / KT : idx % BM;
            int32_t gi = i0 + ii, gk = k0 + kk;
            ra[e] = idx < KT * BM && gi < M && gk < K ? a[gi * sai + gk * sak] : 0.0;
        }
#pragma unroll
        for (int e = 0; e < LB; e++) {
            int idx = tid + NT * e;
            int kk = sbj == 1 ? idx / BN : idx % KT, jj = sbj == 1 ? idx % BN : idx / KT;
            int32_t gj = j0 + jj, gk = k0 + kk;
            rb[e] = idx < KT * BN && gj < N && gk < K ? b[gk * sbk + gj * sbj] : 0.0;
        }
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int e = 0; e < LA; e++) {
            int idx = tid + NT * e;
            int kk = sak == 1 ? idx % KT : idx / BM, ii = sak == 1 ? idx / KT : idx % BM;
            if (idx < KT * BM) as[buf][kk][ii] = ra[e];
        }
#pragma unroll
        for (int e = 0; e < LB; e++) {
            int idx = tid + NT * e;
            int kk = sbj == 1 ? idx / BN : idx % KT, jj = sbj == 1 ? idx % BN : idx / KT;
            if (idx < KT * BN) bs[buf][kk][jj] = rb[e];
        }
    };
    const int32_t nst = (K + KT - 1) / KT;
    if (nst > 0) {
        load(0);
        store(0);
    }
    __syncthreads();
    for (int32_t st = 0; st < nst; st++) {
        const int buf = st & 1;
        if (st + 1 < nst) load((st + 1) * KT); /* in flight during this stage's fmas */
        const int32_t kn = K - st * KT;     /* >= KT except in the last stage */
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            if (kk < kn) { /* k = st KT + kk, in order */
                double av[TM], bv[TN];
#pragma unroll
                for (int h = 0; h < TM / 2; h++) { /* rows 2 ty + 2 TY h + 0, 1 */
                    const double2 v = *reinterpret_cast<const double2 *>(&as[buf][kk][2 * ty + 2 * TY * h]);
                    av[2 * h] = v.x;
                    av[2 * h + 1] = v.y;
                }
#pragma unroll
                for (int h = 0; h < TN / 2; h++) { /* columns 2 tx + 2 TX h + 0, 1 */
                    const double2 v = *reinterpret_cast<const double2 *>(&bs[buf][kk][2 * tx + 2 * TX * h]);
                    bv[2 * h] = v.x;
                    bv[2 * h + 1] = v.y;
                }
#pragma unroll
                for (int p = 0; p < TM; p++)
#pragma unroll
                    for (int q = 0; q < TN; q++) acc[p][q] = __fma_rn(av[p], bv[q], acc[p][q]);
            }
        }
        /* buf ^ 1 was last read in stage st - 1, which ended with the barrier below */
        if (st + 1 < nst) store(buf ^ 1);
        __syncthreads();
    }
#pragma unroll
    for (int p = 0; p < TM; p++)
#pragma unroll
        for (int q = 0; q < TN; q++) {
            int32_t i = i0 + 2 * ty + (p & 1) + 2 * TY * (p >> 1), j = j0 + 2 * tx + (q & 1) + 2 * TX * (q >> 1);
            if (i < M && j < N) c[(int64_t)i * ldc + j] = acc[p][q];
        }
}

#define OLD_SL_T 128
#define OLD_SL_I 64
/* The int8 digit planes of a token block (skv_cuda_canon_i8.h): rows [0, rows) of a (row major
   [rows, d]), plane k at out + k plane_bytes, column i of plane k at i ld (ld = the plan's rows).
   A block of 256 threads per tile of 128 rows x 64 columns: coalesced bf16 reads along the row,
   the packed digits transposed through shared memory, 4-byte writes along the column. Rows
   [rows, the tile's end) and columns [d, d4) get zeros. */
static __global__ void __launch_bounds__(256)
    old_slice(const skv_bf16 *__restrict__ a, int64_t rows, int32_t d, int32_t d4, const int32_t *__restrict__ e,
                 int32_t F, int s, int64_t ld, size_t plane_bytes, int8_t *__restrict__ out)
{
    __shared__ uint32_t sm[OLD_SL_I][OLD_SL_T + 1];
    const int tid = threadIdx.x;
    const int64_t t0 = (int64_t)blockIdx.y * OLD_SL_T;
    const int32_t i0 = blockIdx.x * OLD_SL_I;
    for (int idx = tid; idx < OLD_SL_T * OLD_SL_I; idx += 256) {
        int tt = idx / OLD_SL_I, ii = idx % OLD_SL_I;
        int64_t t = t0 + tt;
        int32_t i = i0 + ii;
        uint32_t p = 0;
        if (t < rows && i < d) p = skv_cc_i8_pack((int32_t)skv_canon_fix(a[t * d + i], F, e[i]), s);
        sm[ii][tt] = p;
    }
    __syncthreads();
    for (int k = 0; k < s; k++) {
        int8_t *pk = out + (size_t)k * plane_bytes;
        for (int idx = tid; idx < OLD_SL_I * (OLD_SL_T / 4); idx += 256) {
            int ii = idx / (OLD_SL_T / 4), q = idx % (OLD_SL_T / 4);
            int32_t i = i0 + ii;
            if (i >= d4) continue;
            const int sh = 8 * k;
            char4 v;
            v.x = (signed char)(sm[ii][4 * q + 0] >> sh);
            v.y = (signed char)(sm[ii][4 * q + 1] >> sh);
            v.z = (signed char)(sm[ii][4 * q + 2] >> sh);
            v.w = (signed char)(sm[ii][4 * q + 3] >> sh);
            *(char4 *)(pk + (int64_t)i * ld + t0 + 4 * q) = v;
        }
    }
}

/* the former skv_cc_fix and skv_cc_uscale: element by element, grid-stride */
static __global__ void old_fix(const skv_bf16 *__restrict__ a, int64_t rows, int32_t d, const int32_t *__restrict__ e,
                               int32_t F, double *__restrict__ blk)
{
    int64_t count = rows * d;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < count; k += (int64_t)gridDim.x * blockDim.x)
        blk[k] = skv_canon_fix(a[k], F, e[k % d]);
}
static __global__ void old_uscale(const double *__restrict__ tb, int64_t rows, int32_t r, const int32_t *__restrict__ f,
                                  int32_t Gb, float *__restrict__ u)
{
    int64_t count = rows * r;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < count; k += (int64_t)gridDim.x * blockDim.x)
        u[k] = (float)skv_canon_scale(tb[k], f[k % r] - Gb);
}
/* the grid of the library's element kernels (skv_cf_blocks: SKV_CF_THREADS = 256, at most 4096 blocks) */
static unsigned old_blocks(int64_t count)
{
    int64_t b = (count + 255) / 256;
    return (unsigned)(b < 1 ? 1 : b > 4096 ? 4096 : b);
}

/* ---- the plain reference: one thread per output, C(i, j) = chain over k of fma(A(i, k), B(k, j), acc) ---- */
static __global__ void ref_chain(int32_t M, int32_t N, int32_t K, const double *a, int64_t sai, int64_t sak,
                                 const double *b, int64_t sbk, int64_t sbj, double *c, int64_t ldc)
{
    const int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= (int64_t)M * N) return;
    const int32_t i = (int32_t)(o / N), j = (int32_t)(o % N);
    double acc = 0.0;
    for (int32_t k = 0; k < K; k++) acc = __fma_rn(a[i * sai + k * sak], b[k * sbk + j * sbj], acc);
    c[(int64_t)i * ldc + j] = acc;
}

/* a normal-ish double: uniform in [-1, 1) times 2^(-8 .. 7) */
static double rval(void) { return ldexp((double)(int64_t)(rnd() >> 11) / 4503599627370496.0 - 1.0, (int)(rnd() % 16) - 8); }

static int failures;

/* time fn: warm-up, then reps launches each between two events; median and min in us */
static void timeit(cudaStream_t st, int reps, const std::function<void()> &fn, float *med, float *mn)
{
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int w = 0; w < 5; w++) fn();
    std::vector<float> t;
    for (int k = 0; k < reps; k++) {
        CK(cudaEventRecord(e0, st));
        fn();
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1000.0f);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    *med = t[t.size() / 2];
    *mn = t[0];
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
}

static void line(const char *kind, const std::string &name, float med, float mn, bool ok)
{
    printf("%-6s %-44s median %9.2f us  min %9.2f us  %s\n", kind, name.c_str(), med, mn, ok ? "bitwise equal" : "MISMATCH");
    if (!ok) failures++;
}

int main(int argc, char **argv)
{
    const int reps = argc > 1 ? atoi(argv[1]) : 100;
    const int32_t d = 1024, r = 160, m = 1024;
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs; G X: %d x %d x %d, Y^T Y: %d x %d lower, K = %d; %d timed launches each\n", prop.name,
           prop.multiProcessorCount, d, r, d, r, r, m, reps);

    /* ---- step 3: G X and Y^T Y ---- */
    std::vector<double> hg((size_t)d * d), hx((size_t)d * r), hy((size_t)m * r);
    for (int32_t i = 0; i < d; i++) /* symmetric bit for bit, as skv_cc_gscale writes G */
        for (int32_t k = 0; k <= i; k++) hg[(size_t)i * d + k] = hg[(size_t)k * d + i] = rval();
    for (auto &v : hx) v = rval();
    for (auto &v : hy) v = rval();
    hy[5] = -0.0; /* a signed zero among the terms */
    double *g, *x, *y, *ref_gx, *ref_yy, *out;
    CK(cudaMalloc(&g, sizeof(double) * hg.size()));
    CK(cudaMalloc(&x, sizeof(double) * hx.size()));
    CK(cudaMalloc(&y, sizeof(double) * hy.size()));
    CK(cudaMalloc(&ref_gx, sizeof(double) * d * r));
    CK(cudaMalloc(&ref_yy, sizeof(double) * r * r));
    CK(cudaMalloc(&out, sizeof(double) * d * r));
    CK(cudaMemcpy(g, hg.data(), sizeof(double) * hg.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(x, hx.data(), sizeof(double) * hx.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(y, hy.data(), sizeof(double) * hy.size(), cudaMemcpyHostToDevice));
    /* the references, from the definitions: G(i, k) = g[i d + k] (not its transpose), Y^T Y in full */
    ref_chain<<<(d * r + 127) / 128, 128, 0, st>>>(d, r, d, g, d, 1, x, r, 1, ref_gx, r);
    ref_chain<<<(r * r + 127) / 128, 128, 0, st>>>(r, r, m, y, 1, r, y, r, 1, ref_yy, r);
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    std::vector<double> rgx((size_t)d * r), ryy((size_t)r * r), hout((size_t)d * r);
    CK(cudaMemcpy(rgx.data(), ref_gx, sizeof(double) * rgx.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ryy.data(), ref_yy, sizeof(double) * ryy.size(), cudaMemcpyDeviceToHost));

    struct variant {
        std::string name;
        std::function<void()> fn;
    };
    /* each variant: the output poisoned, one call checked, then timed */
    auto run_all = [&](const char *kind, const std::vector<variant> &vs, size_t out_bytes,
                       const std::function<bool()> &check) {
        for (auto &v : vs) {
            CK(cudaMemsetAsync(out, 0xff, out_bytes, st));
            v.fn();
            const bool ok = check();
            float med, mn;
            timeit(st, reps, v.fn, &med, &mn);
            line(kind, v.name, med, mn, ok);
        }
    };
    auto check_gx = [&]() {
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        CK(cudaMemcpy(hout.data(), out, sizeof(double) * d * r, cudaMemcpyDeviceToHost));
        return memcmp(hout.data(), rgx.data(), sizeof(double) * d * r) == 0;
    };
    auto check_yy = [&]() {
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        CK(cudaMemcpy(hout.data(), out, sizeof(double) * r * r, cudaMemcpyDeviceToHost));
        for (int32_t i = 0; i < r; i++)
            for (int32_t j = 0; j <= i; j++)
                if (memcmp(&hout[(size_t)i * r + j], &ryy[(size_t)i * r + j], sizeof(double))) return false;
        return true;
    };
#define OLD(TM, TN, TY, TX, KT, M_, N_, K_, A, SAI, SAK, B, SBK, SBJ, LOWER)                                        \
    [&]() {                                                                                                       \
        constexpr int bm = TY * TM, bn = TX * TN;                                                                 \
        old_gemm<TM, TN, TY, TX, KT><<<dim3((N_ + bn - 1) / bn, (M_ + bm - 1) / bm), TY * TX, 0, st>>>(          \
            M_, N_, K_, A, SAI, SAK, B, SBK, SBJ, out, N_, LOWER);                                                \
    }
#define MM(TM, TN, TY, TX, KT, NS, PD, M_, N_, K_, AT, LDA, B, LDB, LOWER)                                         \
    [&]() {                                                                                                       \
        constexpr int bm = TY * TM, bn = TX * TN;                                                                 \
        skv_cc_mm<TM, TN, TY, TX, KT, NS, PD><<<dim3((N_ + bn - 1) / bn, (M_ + bm - 1) / bm), TY * TX, 0, st>>>( \
            M_, N_, K_, AT, LDA, B, LDB, out, N_, LOWER);                                                         \
    }
#define TC(WM, WN, FM, FN, KT, NS, M_, N_, K_, AT, LDA, B, LDB, LOWER)                                             \
    [&]() {                                                                                                       \
        constexpr int bm = 8 * FM * WM, bn = 8 * FN * WN;                                                         \
        skv_cc_mm_tc<WM, WN, FM, FN, KT, NS><<<dim3((N_ + bn - 1) / bn, (M_ + bm - 1) / bm), 32 * WM * WN, 0, st>>>( \
            M_, N_, K_, AT, LDA, B, LDB, out, N_, LOWER);                                                         \
    }
    /* G X: skv_cc_mm reads A^T = G (symmetric); the former kernel read G's rows */
    std::vector<variant> gx = {
        {"former skv_cc_gemm<4,4,16,8,16> 64x32", OLD(4, 4, 16, 8, 16, d, r, d, g, d, 1, x, r, 1, 0)},
        {"skv_cc_mm<2,5,16,8,16,4,2> 32x40", MM(2, 5, 16, 8, 16, 4, 2, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm<2,5,16,8,16,3,1> 32x40", MM(2, 5, 16, 8, 16, 3, 1, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm<2,5,16,8,16,4,4> 32x40", MM(2, 5, 16, 8, 16, 4, 4, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm<2,5,16,8,8,6,3> 32x40", MM(2, 5, 16, 8, 8, 6, 3, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm<1,5,32,8,16,4,2> 32x40 x256", MM(1, 5, 32, 8, 16, 4, 2, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm<2,5,8,8,16,4,2> 16x40", MM(2, 5, 8, 8, 16, 4, 2, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm<2,4,16,8,16,4,2> 32x32", MM(2, 4, 16, 8, 16, 4, 2, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm<2,4,8,8,16,4,2> 16x32", MM(2, 4, 8, 8, 16, 4, 2, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm<4,4,16,8,16,4,2> 64x32", MM(4, 4, 16, 8, 16, 4, 2, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm<4,5,16,8,16,3,2> 64x40", MM(4, 5, 16, 8, 16, 3, 2, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm<2,2,16,8,16,4,2> 32x16", MM(2, 2, 16, 8, 16, 4, 2, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm_tc<2,2,2,2,16,4> 32x32 dmma", TC(2, 2, 2, 2, 16, 4, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm_tc<2,2,1,1,16,4> 16x16 dmma", TC(2, 2, 1, 1, 16, 4, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm_tc<4,2,2,2,16,3> 64x32 dmma", TC(4, 2, 2, 2, 16, 3, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm_tc<1,1,2,2,32,4> 16x16 dmma", TC(1, 1, 2, 2, 32, 4, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm_tc<2,2,1,1,32,4> 16x16 (library, dmma)", TC(2, 2, 1, 1, 32, 4, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm_tc<2,2,1,1,8,8> 16x16 dmma", TC(2, 2, 1, 1, 8, 8, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm_tc<2,2,1,1,16,6> 16x16 dmma", TC(2, 2, 1, 1, 16, 6, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm_tc<4,2,1,1,16,4> 32x16 dmma", TC(4, 2, 1, 1, 16, 4, d, r, d, g, d, x, r, 0)},
        {"skv_cc_mm_tc<2,1,1,1,16,6> 16x8 dmma", TC(2, 1, 1, 1, 16, 6, d, r, d, g, d, x, r, 0)},
    };
    run_all("G X", gx, sizeof(double) * d * r, check_gx);
    std::vector<variant> yy = {
        {"former skv_cc_gemm<2,2,8,8,32> 16x16", OLD(2, 2, 8, 8, 32, r, r, m, y, 1, r, y, r, 1, 1)},
        {"skv_cc_mm<2,2,8,8,32,4,2> 16x16", MM(2, 2, 8, 8, 32, 4, 2, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm<2,2,8,8,16,4,2> 16x16", MM(2, 2, 8, 8, 16, 4, 2, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm<2,2,8,8,64,3,3> 16x16", MM(2, 2, 8, 8, 64, 3, 3, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm<2,2,8,8,32,4,4> 16x16", MM(2, 2, 8, 8, 32, 4, 4, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm<2,2,4,8,32,4,2> 8x16", MM(2, 2, 4, 8, 32, 4, 2, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm<1,2,16,8,32,4,2> 16x16 x128", MM(1, 2, 16, 8, 32, 4, 2, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm<1,1,16,16,32,4,2> 16x16 x256", MM(1, 1, 16, 16, 32, 4, 2, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm<2,2,8,8,32,4,2> 16x16 full", MM(2, 2, 8, 8, 32, 4, 2, r, r, m, y, r, y, r, 0)},
        {"skv_cc_mm<4,4,8,8,16,4,2> 32x32", MM(4, 4, 8, 8, 16, 4, 2, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm_tc<1,1,2,2,32,4> 16x16 dmma", TC(1, 1, 2, 2, 32, 4, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm_tc<1,1,1,1,32,4> 8x8 dmma", TC(1, 1, 1, 1, 32, 4, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm_tc<2,2,1,1,32,4> 16x16 (library, dmma)", TC(2, 2, 1, 1, 32, 4, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm_tc<1,1,2,2,16,6> 16x16 dmma", TC(1, 1, 2, 2, 16, 6, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm_tc<2,2,1,1,16,8> 16x16 dmma", TC(2, 2, 1, 1, 16, 8, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm_tc<2,2,1,1,8,12> 16x16 dmma", TC(2, 2, 1, 1, 8, 12, r, r, m, y, r, y, r, 1)},
        {"skv_cc_mm_tc<1,1,1,1,16,8> 8x8 dmma", TC(1, 1, 1, 1, 16, 8, r, r, m, y, r, y, r, 1)},
    };
    run_all("Y^T Y", yy, sizeof(double) * r * r, check_yy);

    /* ---- the int8 digits of one token block: 32768 rows of 65536 (F = 17, s = 3), d = 1024 ---- */
    {
        const int64_t n = 65536, rows = 32768;
        const int32_t F = skv_canon_frac_bits(n), s = skv_cc_i8_slices(F), d4 = (d + 3) / 4 * 4;
        std::vector<skv_bf16> ha((size_t)rows * d);
        std::vector<int> cexp(d);
        for (int32_t i = 0; i < d; i++) cexp[i] = (int)(rnd() % 13) - 6;
        for (int64_t t = 0; t < rows; t++)
            for (int32_t i = 0; i < d; i++) {
                int ex = 127 + cexp[i] - (int)(rnd() % 12);
                uint16_t v = (uint16_t)(((rnd() & 1) << 15) | ((unsigned)ex << 7) | (rnd() & 0x7f));
                if (rnd() % 97 == 0) v &= 0x8000u; /* signed zeros */
                if (i == 3) v = (uint16_t)((rnd() & 1) << 15 | (rnd() % 3)); /* a subnormal column */
                ha[(size_t)t * d + i] = v;
            }
        const std::vector<int32_t> he = probe_col_scales(ha, rows, d);
        skv_bf16 *a;
        int32_t *e;
        int8_t *p0, *p1;
        const size_t pb = (size_t)d4 * rows;
        CK(cudaMalloc(&a, sizeof(skv_bf16) * ha.size()));
        CK(cudaMalloc(&e, sizeof(int32_t) * d));
        CK(cudaMalloc(&p0, pb * s));
        CK(cudaMalloc(&p1, pb * s));
        CK(cudaMemcpy(a, ha.data(), sizeof(skv_bf16) * ha.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(e, he.data(), sizeof(int32_t) * d, cudaMemcpyHostToDevice));
        CK(cudaMemset(p0, 0xa5, pb * s));
        CK(cudaMemset(p1, 0x5a, pb * s));
        dim3 gr0((unsigned)((d4 + OLD_SL_I - 1) / OLD_SL_I), (unsigned)((rows + OLD_SL_T - 1) / OLD_SL_T));
        dim3 gr1((unsigned)((d4 + SKV_CC_SL_I - 1) / SKV_CC_SL_I), (unsigned)((rows + SKV_CC_SL_T - 1) / SKV_CC_SL_T));
        auto f0 = [&]() { old_slice<<<gr0, 256, 0, st>>>(a, rows, d, d4, e, F, s, rows, pb, p0); };
        auto f1 = [&]() { skv_cc_slice<<<gr1, 256, 0, st>>>(a, rows, d, d4, e, F, s, rows, pb, p1); };
        f0();
        f1();
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        std::vector<int8_t> h0(pb * s), h1(pb * s);
        CK(cudaMemcpy(h0.data(), p0, pb * s, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(h1.data(), p1, pb * s, cudaMemcpyDeviceToHost));
        const bool ok = h0 == h1;
        float med, mn;
        timeit(st, reps, f0, &med, &mn);
        line("slice", "former skv_cc_slice 32768 x 1024, s = 3", med, mn, true);
        timeit(st, reps, f1, &med, &mn);
        line("slice", "skv_cc_slice (library)", med, mn, ok);
        printf("       (%.1f MB read, %.1f MB written per launch)\n", rows * d * 2 / 1e6, (double)pb * s / 1e6);

        /* step 4's fixed-point rows: 7084 rows */
        const int64_t br = 7084;
        double *b0, *b1;
        CK(cudaMalloc(&b0, sizeof(double) * br * d));
        CK(cudaMalloc(&b1, sizeof(double) * br * d));
        CK(cudaMemset(b0, 0xff, sizeof(double) * br * d));
        CK(cudaMemset(b1, 0xfe, sizeof(double) * br * d));
        const unsigned fgx = (unsigned)((d / 8 + 31) / 32);
        int64_t fgy = std::min<int64_t>(2048 / fgx, (br + 7) / 8);
        auto x0 = [&]() { old_fix<<<old_blocks(br * d), 256, 0, st>>>(a, br, d, e, F, b0); };
        auto x1 = [&]() { skv_cc_fix8<<<dim3(fgx, (unsigned)fgy), dim3(32, 8), 0, st>>>(a, br, d, e, F, b1); };
        x0();
        x1();
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        std::vector<double> hb0((size_t)br * d), hb1((size_t)br * d);
        CK(cudaMemcpy(hb0.data(), b0, sizeof(double) * hb0.size(), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hb1.data(), b1, sizeof(double) * hb1.size(), cudaMemcpyDeviceToHost));
        const bool okx = memcmp(hb0.data(), hb1.data(), sizeof(double) * hb0.size()) == 0;
        timeit(st, reps, x0, &med, &mn);
        line("fix", "former skv_cc_fix 7084 x 1024", med, mn, true);
        timeit(st, reps, x1, &med, &mn);
        line("fix", "skv_cc_fix8 (probe only)", med, mn, okx);

        /* U's scaling: T [7084, 160] integers below 2^53, f_j, Gb at n = 64k */
        const int32_t Gb = skv_canon_u_bits(n, d);
        std::vector<double> ht((size_t)br * r);
        std::vector<int32_t> hf(r);
        for (auto &v : ht) v = (double)((int64_t)(rnd() >> 11) - ((int64_t)1 << 52)) * (rnd() % 5 == 0 ? 1.0 : 0x1p-30);
        for (auto &v : ht) v = rint(v);
        for (auto &v : hf) v = (int32_t)(rnd() % 40) - 30;
        double *tb;
        int32_t *fj;
        float *u0, *u1;
        CK(cudaMalloc(&tb, sizeof(double) * ht.size()));
        CK(cudaMalloc(&fj, sizeof(int32_t) * r));
        CK(cudaMalloc(&u0, sizeof(float) * ht.size()));
        CK(cudaMalloc(&u1, sizeof(float) * ht.size()));
        CK(cudaMemcpy(tb, ht.data(), sizeof(double) * ht.size(), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(fj, hf.data(), sizeof(int32_t) * r, cudaMemcpyHostToDevice));
        CK(cudaMemset(u0, 0xff, sizeof(float) * ht.size()));
        CK(cudaMemset(u1, 0xfe, sizeof(float) * ht.size()));
        const unsigned ugx = (unsigned)((r + 31) / 32);
        int64_t ugy = std::min<int64_t>(2048 / ugx, (br + 7) / 8);
        auto s0 = [&]() { old_uscale<<<old_blocks(br * r), 256, 0, st>>>(tb, br, r, fj, Gb, u0); };
        auto s1 = [&]() { skv_cc_uscale<<<dim3(ugx, (unsigned)ugy), dim3(32, 8), 0, st>>>(tb, br, r, fj, Gb, u1); };
        s0();
        s1();
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        std::vector<float> hu0(ht.size()), hu1(ht.size());
        CK(cudaMemcpy(hu0.data(), u0, sizeof(float) * hu0.size(), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hu1.data(), u1, sizeof(float) * hu1.size(), cudaMemcpyDeviceToHost));
        const bool oku = memcmp(hu0.data(), hu1.data(), sizeof(float) * hu0.size()) == 0;
        timeit(st, reps, s0, &med, &mn);
        line("uscale", "former skv_cc_uscale 7084 x 160", med, mn, true);
        timeit(st, reps, s1, &med, &mn);
        line("uscale", "skv_cc_uscale (library)", med, mn, oku);
    }
    printf("%s\n", failures ? "FAILED: a variant differs from the reference" : "all variants bitwise equal");
    return failures ? 1 : 0;
}
