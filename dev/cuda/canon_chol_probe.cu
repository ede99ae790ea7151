/*
 * canon_chol_probe.cu - timing probe for the canonical route's latency-bound kernels
 * (cuda/skv_cuda_canon_chol.cuh) at p = 160, m = 1024: the Cholesky with one barrier per column
 * (skv_cc_fchol; also with its bulk updates or its pivots and divisions switched off) and the
 * solve (skv_cc_fsolve; both divide with skv_cc_div), each checked bit for bit against lib/skv_factor_canon.h's
 * reference on the host (eq = 0 and 1), then timed with CUDA events (200 back-to-back launches
 * after warm-up, median of 5 batches). Also the dependent-chain latencies (clock64, one warp)
 * of the operations on the columns' critical path: __fma_rn, __dsqrt_rn, __ddiv_rn, a double
 * shuffle, a shared load, and a 512-thread barrier.
 *
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -Iinclude -Ilib -Icuda \
 *     dev/cuda/canon_chol_probe.cu -o build/canon_chol_probe && build/canon_chol_probe
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <vector>

#include "skv_cuda_canon_chol.cuh"
#include "probe_common.cuh"


/* ---- latencies ---- */
enum { L_FMA, L_SQRT, L_DIV, L_SHFL, L_LDS, L_BAR, L_N };
static const char *lname[L_N] = {"__fma_rn", "__dsqrt_rn", "__ddiv_rn", "__shfl_sync (double)", "shared load (dependent)",
                                 "__syncthreads (512 threads)"};
__global__ void lat_kernel(int op, int n, double seed, double *out, long long *cyc)
{
    __shared__ int idx[1024];
    for (int i = threadIdx.x; i < 1024; i += blockDim.x) idx[i] = (i * 7 + 1) & 1023;
    __syncthreads();
    double v = seed + threadIdx.x;
    int j = threadIdx.x & 1023;
    long long t0 = clock64();
    switch (op) {
    case L_FMA: for (int i = 0; i < n; i++) v = __fma_rn(v, 0.999999, 1e-7); break;
    case L_SQRT: for (int i = 0; i < n; i++) v = __dsqrt_rn(v + 1.5); break;
    case L_DIV: for (int i = 0; i < n; i++) v = __ddiv_rn(1.0 + 1e-9 * i, v) + 0.5; break;
    case L_SHFL: for (int i = 0; i < n; i++) v = __shfl_sync(0xffffffffu, v, (threadIdx.x + 1) & 31); break;
    case L_LDS: for (int i = 0; i < n; i++) j = idx[j]; v += j; break;
    case L_BAR: for (int i = 0; i < n; i++) { __syncthreads(); } break;
    }
    long long t1 = clock64();
    if (threadIdx.x == 0) *cyc = t1 - t0;
    out[threadIdx.x] = v;
}


struct Args {
    int m, p, eq;
    double *c, *dsc, *lp, *y, *x;
};
static void run_chol(void *v) { Args *a = (Args *)v; skv_cc_fchol<5><<<1, SKV_CC_FCHOL_THREADS>>>(a->m, a->p, a->c, a->eq, a->dsc, a->lp); }
static void run_nobulk(void *v) { Args *a = (Args *)v; skv_cc_fchol<5, 1><<<1, SKV_CC_FCHOL_THREADS>>>(a->m, a->p, a->c, a->eq, a->dsc, a->lp); }
static void run_nodiv(void *v) { Args *a = (Args *)v; skv_cc_fchol<5, 2><<<1, SKV_CC_FCHOL_THREADS>>>(a->m, a->p, a->c, a->eq, a->dsc, a->lp); }
static void run_solve(void *v)
{
    Args *a = (Args *)v;
    skv_cc_fsolve<5><<<(a->m + SKV_CC_FSOLVE_WARPS - 1) / SKV_CC_FSOLVE_WARPS, 32 * SKV_CC_FSOLVE_WARPS, skv_cc_fsolve_smem(a->p)>>>(
        a->m, a->p, a->y, a->lp, a->eq, a->dsc, a->x);
}

int main()
{
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int khz = 0;
    CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    printf("probe: %s, sm clock %d MHz\n", prop.name, khz / 1000);
    { /* latencies */
        double *out;
        long long *cyc, h;
        CK(cudaMalloc(&out, 1024 * sizeof(double)));
        CK(cudaMalloc(&cyc, sizeof(long long)));
        for (int op = 0; op < L_N; op++) {
            const int n = 4096, th = op == L_BAR ? 512 : 32;
            lat_kernel<<<1, th>>>(op, n, 2.0, out, cyc);
            lat_kernel<<<1, th>>>(op, n, 2.0, out, cyc);
            CK(cudaGetLastError());
            CK(cudaMemcpy(&h, cyc, sizeof h, cudaMemcpyDeviceToHost));
            printf("latency %-30s %7.1f cycles\n", lname[op], (double)h / n);
        }
        CK(cudaFree(out));
        CK(cudaFree(cyc));
    }
    CK(cudaFuncSetAttribute(skv_cc_fsolve<5>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)skv_cc_fsolve_smem(160)));
    const int m = 1024, p = 160;
    std::mt19937_64 rng(20261202);
    std::normal_distribution<double> nd;
    int bad = 0;
    for (int eq = 0; eq <= 1; eq++) {
        std::vector<double> y((size_t)m * p), c((size_t)p * p), cr, l((size_t)p * p, 0.0), x((size_t)m * p), yr, dr(p);
        for (auto &v : y) v = nd(rng) * ldexp(1.0, (int)(rng() % 9) - 4);
        skv_canon_ref_cross(m, p, y.data(), c.data());
        cr = c;
        yr = y;
        if (eq) skv_canon_ref_equilibrate(m, p, cr.data(), yr.data(), dr.data());
        double s, fl;
        skv_canon_ref_shift(m, p, cr.data(), &s, &fl);
        skv_canon_ref_chol(p, cr.data(), s, fl, l.data());
        skv_canon_ref_solve(m, p, l.data(), yr.data(), x.data());
        std::vector<double> lpk(skv_cc_lp_count(p));
        for (int k = 0; k < p; k++)
            for (int i = k; i < p; i++) lpk[skv_cc_lpk(p, k) + i - k] = l[(size_t)i * p + k];
        Args a{m, p, eq};
        CK(cudaMalloc(&a.c, c.size() * 8));
        CK(cudaMalloc(&a.dsc, p * 8));
        CK(cudaMalloc(&a.lp, (lpk.size() + p) * 8));
        CK(cudaMalloc(&a.y, y.size() * 8));
        CK(cudaMalloc(&a.x, y.size() * 8));
        CK(cudaMemcpy(a.c, c.data(), c.size() * 8, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(a.y, y.data(), y.size() * 8, cudaMemcpyHostToDevice));
        std::vector<double> got(lpk.size()), gx(y.size());
        void (*chols[1])(void *) = {run_chol};
        const char *cn[1] = {"skv_cc_fchol (barrier a column)"};
        for (int v = 0; v < 1; v++) {
            CK(cudaMemset(a.lp, 0xff, lpk.size() * 8)); /* poison */
            chols[v](&a);
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(got.data(), a.lp, got.size() * 8, cudaMemcpyDeviceToHost));
            int ok = memcmp(got.data(), lpk.data(), got.size() * 8) == 0;
            std::vector<double> rc(p);
            CK(cudaMemcpy(rc.data(), a.lp + lpk.size(), p * 8, cudaMemcpyDeviceToHost));
            for (int k = 0; k < p; k++) /* the reciprocals for the solve */
                if (rc[k] != 1.0 / l[(size_t)k * p + k]) ok = 0;
            bad += !ok;
            float us = time_us([&] { chols[v](&a); });
            printf("eq %d  %-36s %8.2f us  %s\n", eq, cn[v], us, ok ? "bitwise ok" : "MISMATCH");
        }
        CK(cudaMemset(a.x, 0xff, y.size() * 8));
        run_solve(&a);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(gx.data(), a.x, gx.size() * 8, cudaMemcpyDeviceToHost));
        int ok = memcmp(gx.data(), x.data(), gx.size() * 8) == 0;
        bad += !ok;
        float us = time_us([&] { run_solve(&a); });
        printf("eq %d  %-36s %8.2f us  %s\n", eq, "skv_cc_fsolve (1024 rows)", us, ok ? "bitwise ok" : "MISMATCH");
        if (eq == 0) { /* last: they leave a wrong L behind */
            printf("eq 0  %-36s %8.2f us  (timing only)\n", "skv_cc_fchol without the bulk updates", time_us([&] { run_nobulk(&a); }));
            printf("eq 0  %-36s %8.2f us  (timing only)\n", "skv_cc_fchol without pivot/division", time_us([&] { run_nodiv(&a); }));
        }
        cudaFree(a.c), cudaFree(a.dsc), cudaFree(a.lp), cudaFree(a.y), cudaFree(a.x);
    }
    printf("%s\n", bad ? "FAILED" : "all bitwise");
    return bad != 0;
}
