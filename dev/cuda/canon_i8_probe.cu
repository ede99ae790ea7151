/*
 * canon_i8_probe.cu - the canonical route's exact Gram S = X^T X at the benchmark shape, both
 * ways, on one GPU: the fixed-point doubles + cuBLAS DSYRK by token blocks (the route's first
 * implementation, now the library's fallback skv_cc_gram_f64) and the int8 digits
 * (cuda/skv_cuda_canon_i8.cuh, the kernels the library launches), twice: one buffer of digit
 * planes on one stream (with the slice / GEMM / combine split of the time; the library's
 * skv_cc_gram keeps one buffer) and two buffers with the slices on a second stream beside the
 * previous block's GEMMs (the double-buffered variant it was measured against: the same events,
 * the same order). Checks both S bit for bit against DSYRK's (upper triangle),
 * reports the largest int32 product entry (how close the sums came to 2^31) and the times
 * (cudaEvent, median of the reps).
 *
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -Iinclude -Ilib -Icuda \
 *     dev/cuda/canon_i8_probe.cu -lcublas -o build/canon_i8_probe && build/canon_i8_probe [n] [d] [reps]
 *
 * Default n = 65536, d = 1024, 5 reps; the scratch is 128 MiB (the factor's at n_max = 64k,
 * d = 1024), the DSYRK blocks 7084 rows (its canon_rows at r = 160).
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "skv_cuda_canon_i8.cuh"
#include "probe_common.cuh"


static __global__ void fix_kernel(const skv_bf16 *a, int64_t rows, int32_t d, const int32_t *e, int32_t F, double *blk)
{
    int64_t count = rows * d;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < count; k += (int64_t)gridDim.x * blockDim.x)
        blk[k] = skv_canon_fix(a[k], F, e[k % d]);
}


static float median(std::vector<float> v)
{
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char **argv)
{
    const int64_t n = argc > 1 ? atoll(argv[1]) : 65536;
    const int32_t d = argc > 2 ? atoi(argv[2]) : 1024;
    const int reps = argc > 3 ? atoi(argv[3]) : 5;
    const size_t scratch_bytes = (size_t)128 << 20;
    const int64_t blk_rows = 7084;
    const int32_t F = skv_canon_frac_bits(n);

    /* keys-like bf16: per-column scales 2^-6 .. 2^6, entries up to 2^-8 below, random signs; column 1
       all negative at the largest mantissa, column 2 one outlier 2^10 over the rest */
    std::vector<skv_bf16> ha((size_t)n * d);
    std::vector<int> cexp(d);
    for (int32_t i = 0; i < d; i++) cexp[i] = (int)(rnd() % 13) - 6;
    for (int64_t t = 0; t < n; t++)
        for (int32_t i = 0; i < d; i++) {
            int ex = 127 + cexp[i] - (int)(rnd() % 9);
            uint16_t v = (uint16_t)(((rnd() & 1) << 15) | ((unsigned)ex << 7) | (rnd() & 0x7f));
            if (i == 1) v = (uint16_t)(0x8000u | ((unsigned)(127 + cexp[i]) << 7) | 0x7fu);
            if (i == 2 && t == n / 3) v = (uint16_t)((unsigned)(127 + 10) << 7);
            ha[(size_t)t * d + i] = v;
        }
    const std::vector<int32_t> he = probe_col_scales(ha, n, d);

    skv_bf16 *a;
    int32_t *e;
    void *scratch, *blas_ws;
    double *g_syrk, *g_i8, *g_i82;
    CK(cudaMalloc(&a, sizeof(skv_bf16) * (size_t)n * d));
    CK(cudaMalloc(&e, sizeof(int32_t) * d));
    CK(cudaMalloc(&scratch, scratch_bytes));
    CK(cudaMalloc(&blas_ws, (size_t)32 << 20));
    CK(cudaMalloc(&g_syrk, sizeof(double) * (size_t)d * d));
    CK(cudaMalloc(&g_i8, sizeof(double) * (size_t)d * d));
    CK(cudaMalloc(&g_i82, sizeof(double) * (size_t)d * d));
    CK(cudaMemcpy(a, ha.data(), sizeof(skv_bf16) * (size_t)n * d, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(e, he.data(), sizeof(int32_t) * d, cudaMemcpyHostToDevice));
    CK(cudaMemset(scratch, 0xa5, scratch_bytes));
    CK(cudaMemset(g_syrk, 0xff, sizeof(double) * (size_t)d * d));
    CK(cudaMemset(g_i8, 0xff, sizeof(double) * (size_t)d * d));
    CK(cudaMemset(g_i82, 0xff, sizeof(double) * (size_t)d * d));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    cublasHandle_t h;
    CB(cublasCreate(&h));
    CB(cublasSetStream(h, st));
    CB(cublasSetWorkspace(h, blas_ws, (size_t)32 << 20));
    cudaEvent_t ev[8];
    for (auto &x : ev) CK(cudaEventCreate(&x));

    skv_cc_i8_plan p;
    if (!skv_cc_i8_plan_for(d, skv_cc_i8_slices(F), n, scratch_bytes, &p)) {
        fprintf(stderr, "the int8 plan does not fit %zu bytes\n", scratch_bytes);
        return 1;
    }
    printf("n = %lld, d = %d, F = %d: %d digits, blocks of %lld rows (%lld blocks), chunk %lld rows\n", (long long)n,
           (int)d, (int)F, p.s, (long long)p.rows, (long long)((n + p.rows - 1) / p.rows), (long long)p.chunk_rows);
    /* the two-buffer schedule: skv_cc_gram's plan (two buffers where they fit) and its events */
    skv_cc_i8_plan p2;
    if (!skv_cc_i8_plan_bufs(d, skv_cc_i8_slices(F), n, scratch_bytes, 2, &p2) &&
        !skv_cc_i8_plan_bufs(d, skv_cc_i8_slices(F), n, scratch_bytes, 1, &p2)) {
        fprintf(stderr, "the int8 plan does not fit %zu bytes\n", scratch_bytes);
        return 1;
    }
    printf("two-stream schedule: %d buffers, blocks of %lld rows (%lld blocks)\n", p2.nbuf, (long long)p2.rows,
           (long long)((n + p2.rows - 1) / p2.rows));
    cudaStream_t side;
    CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    cudaEvent_t e_fork, e_ready[2], e_free[2];
    CK(cudaEventCreateWithFlags(&e_fork, cudaEventDisableTiming));
    for (int k = 0; k < 2; k++) {
        CK(cudaEventCreateWithFlags(&e_ready[k], cudaEventDisableTiming));
        CK(cudaEventCreateWithFlags(&e_free[k], cudaEventDisableTiming));
    }

    std::vector<float> t_syrk, t_i8, t_slice, t_gemm, t_comb, t_i82;
    for (int rep = 0; rep < reps + 1; rep++) {
        /* DSYRK */
        const double one = 1.0, zero = 0.0;
        double *blk = (double *)scratch;
        CK(cudaEventRecord(ev[0], st));
        for (int64_t t0 = 0; t0 < n; t0 += blk_rows) {
            int64_t rows = std::min(blk_rows, n - t0);
            fix_kernel<<<1056, 256, 0, st>>>(a + (size_t)t0 * d, rows, d, e, F, blk);
            CK(cudaGetLastError());
            CB(cublasDsyrk(h, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_N, d, (int)rows, &one, blk, d, t0 ? &one : &zero, g_syrk, d));
        }
        CK(cudaEventRecord(ev[1], st));
        /* int8, as skv_cc_gram */
        int32_t *acc = (int32_t *)scratch;
        int8_t *planes = (int8_t *)scratch + p.planes_off;
        const int32_t ione = 1, izero = 0;
        float ms_slice = 0, ms_gemm = 0, ms_comb = 0, ms;
        const int64_t nblk = (n + p.rows - 1) / p.rows;
        std::vector<cudaEvent_t> bev((size_t)nblk * 4);
        for (auto &x : bev) CK(cudaEventCreate(&x));
        CK(cudaEventRecord(ev[2], st));
        for (int64_t t0 = 0, bi = 0; t0 < n; t0 += p.rows, bi++) {
            const int64_t rows = std::min(p.rows, n - t0), kp = (rows + 15) / 16 * 16;
            CK(cudaEventRecord(bev[bi * 4 + 0], st));
            dim3 gr((unsigned)((p.d4 + SKV_CC_SL_I - 1) / SKV_CC_SL_I), (unsigned)((rows + SKV_CC_SL_T - 1) / SKV_CC_SL_T));
            skv_cc_slice<<<gr, 256, 0, st>>>(a + (size_t)t0 * d, rows, d, p.d4, e, F, p.s, p.rows, p.plane_bytes, planes);
            CK(cudaGetLastError());
            CK(cudaEventRecord(bev[bi * 4 + 1], st));
            const int chunk_first = t0 % p.chunk_rows == 0;
            for (int b = 0; b < p.s; b++)
                CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (b + 1) * p.d4, p.d4, (int)kp, &ione, planes, CUDA_R_8I,
                                (int)p.rows, planes + (size_t)b * p.plane_bytes, CUDA_R_8I, (int)p.rows,
                                chunk_first ? &izero : &ione, acc + p.acc_off[b], CUDA_R_32I, (b + 1) * p.d4,
                                CUBLAS_COMPUTE_32I, CUBLAS_GEMM_DEFAULT));
            CK(cudaEventRecord(bev[bi * 4 + 2], st));
            if (t0 + rows >= n || (t0 + rows) % p.chunk_rows == 0) {
                dim3 th(SKV_CC_CB, 8), gc((unsigned)((d + SKV_CC_CB - 1) / SKV_CC_CB), (unsigned)((d + SKV_CC_CB - 1) / SKV_CC_CB));
                skv_cc_combine<<<gc, th, 0, st>>>(acc, p, d, t0 < p.chunk_rows, g_i8);
                CK(cudaGetLastError());
            }
            CK(cudaEventRecord(bev[bi * 4 + 3], st));
        }
        CK(cudaEventRecord(ev[3], st));
        /* int8, two buffers, the slices on the side stream (skv_cc_gram, skv_cc_slice_blk) */
        {
            int8_t *planes2 = (int8_t *)scratch + p2.planes_off;
            const int64_t nb2 = (n + p2.rows - 1) / p2.rows;
            auto slice = [&](int64_t j) {
                const int64_t t0 = j * p2.rows, rows = std::min(p2.rows, n - t0);
                if (j >= p2.nbuf) CK(cudaStreamWaitEvent(side, e_free[(j - p2.nbuf) & 1], 0));
                dim3 gr((unsigned)((p2.d4 + SKV_CC_SL_I - 1) / SKV_CC_SL_I), (unsigned)((rows + SKV_CC_SL_T - 1) / SKV_CC_SL_T));
                skv_cc_slice<<<gr, 256, 0, side>>>(a + (size_t)t0 * d, rows, d, p2.d4, e, F, p2.s, p2.rows, p2.plane_bytes,
                                                   planes2 + (size_t)(j % p2.nbuf) * p2.buf_bytes);
                CK(cudaGetLastError());
                CK(cudaEventRecord(e_ready[j & 1], side));
            };
            CK(cudaEventRecord(ev[4], st));
            CK(cudaEventRecord(e_fork, st));
            CK(cudaStreamWaitEvent(side, e_fork, 0));
            for (int64_t j = 0; j < nb2 && j < p2.nbuf; j++) slice(j);
            for (int64_t j = 0; j < nb2; j++) {
                const int64_t t0 = j * p2.rows, rows = std::min(p2.rows, n - t0), kp = (rows + 15) / 16 * 16;
                const int8_t *pl = planes2 + (size_t)(j % p2.nbuf) * p2.buf_bytes;
                CK(cudaStreamWaitEvent(st, e_ready[j & 1], 0));
                const int chunk_first = t0 % p2.chunk_rows == 0;
                for (int b = 0; b < p2.s; b++)
                    CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (b + 1) * p2.d4, p2.d4, (int)kp, &ione, pl, CUDA_R_8I,
                                    (int)p2.rows, pl + (size_t)b * p2.plane_bytes, CUDA_R_8I, (int)p2.rows,
                                    chunk_first ? &izero : &ione, acc + p2.acc_off[b], CUDA_R_32I, (b + 1) * p2.d4,
                                    CUBLAS_COMPUTE_32I, CUBLAS_GEMM_DEFAULT));
                CK(cudaEventRecord(e_free[j & 1], st));
                if (t0 + rows >= n || (t0 + rows) % p2.chunk_rows == 0) {
                    dim3 th(SKV_CC_CB, 8), gc((unsigned)((d + SKV_CC_CB - 1) / SKV_CC_CB), (unsigned)((d + SKV_CC_CB - 1) / SKV_CC_CB));
                    skv_cc_combine<<<gc, th, 0, st>>>(acc, p2, d, t0 < p2.chunk_rows, g_i82);
                    CK(cudaGetLastError());
                }
                if (j + p2.nbuf < nb2) slice(j + p2.nbuf);
            }
            CK(cudaEventRecord(ev[5], st)); /* st has waited on every slice */
        }
        CK(cudaStreamSynchronize(st));
        for (int64_t bi = 0; bi < nblk; bi++) {
            CK(cudaEventElapsedTime(&ms, bev[bi * 4 + 0], bev[bi * 4 + 1]));
            ms_slice += ms;
            CK(cudaEventElapsedTime(&ms, bev[bi * 4 + 1], bev[bi * 4 + 2]));
            ms_gemm += ms;
            CK(cudaEventElapsedTime(&ms, bev[bi * 4 + 2], bev[bi * 4 + 3]));
            ms_comb += ms;
        }
        for (auto &x : bev) CK(cudaEventDestroy(x));
        if (rep == 0) continue; /* warm-up */
        CK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
        t_syrk.push_back(ms);
        CK(cudaEventElapsedTime(&ms, ev[2], ev[3]));
        t_i8.push_back(ms);
        t_slice.push_back(ms_slice);
        t_gemm.push_back(ms_gemm);
        t_comb.push_back(ms_comb);
        CK(cudaEventElapsedTime(&ms, ev[4], ev[5]));
        t_i82.push_back(ms);
    }

    /* the largest int32 product entry of the last chunk (the used blocks) */
    std::vector<int32_t> hacc(p.planes_off / sizeof(int32_t));
    CK(cudaMemcpy(hacc.data(), scratch, p.planes_off, cudaMemcpyDeviceToHost));
    long long amax = 0;
    for (int b = 0; b < p.s; b++)
        for (size_t k = 0; k < (size_t)(b + 1) * p.d4 * p.d4; k++) amax = std::max(amax, llabs((long long)hacc[p.acc_off[b] + k]));
    std::vector<double> h1((size_t)d * d), h2((size_t)d * d), h3((size_t)d * d);
    CK(cudaMemcpy(h1.data(), g_syrk, sizeof(double) * (size_t)d * d, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h2.data(), g_i8, sizeof(double) * (size_t)d * d, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h3.data(), g_i82, sizeof(double) * (size_t)d * d, cudaMemcpyDeviceToHost));
    long long bad = 0, bad2 = 0;
    double smax = 0;
    for (int32_t j = 0; j < d; j++)
        for (int32_t i = 0; i <= j; i++) {
            size_t k = i + (size_t)j * d;
            if (memcmp(&h1[k], &h2[k], sizeof(double)) != 0) {
                if (bad < 5) printf("  S[%d][%d]: dsyrk %.17g, int8 %.17g\n", (int)i, (int)j, h1[k], h2[k]);
                bad++;
            }
            if (memcmp(&h1[k], &h3[k], sizeof(double)) != 0) {
                if (bad2 < 5) printf("  S[%d][%d]: dsyrk %.17g, int8 two streams %.17g\n", (int)i, (int)j, h1[k], h3[k]);
                bad2++;
            }
            smax = std::max(smax, fabs(h1[k]));
        }
    printf("S upper triangle: %s (%lld of %lld differ), max |S| = 2^%.2f, max |int32 product| = 2^%.2f (the last "
           "schedule's)\n",
           bad ? "MISMATCH" : "bitwise equal", bad, (long long)d * (d + 1) / 2, log2(smax), log2((double)amax));
    printf("S upper triangle, two streams: %s (%lld differ)\n", bad2 ? "MISMATCH" : "bitwise equal", bad2);
    const double ops = 2.0 * (double)d * d * (double)n * p.s * (p.s + 1) / 2;
    printf("dsyrk path (fix + DSYRK): %.3f ms\n", median(t_syrk));
    printf("int8 path: %.3f ms (slice %.3f, GEMMs %.3f = %.0f TOPS, combine %.3f)\n",
           median(t_i8), median(t_slice), median(t_gemm), ops / (median(t_gemm) * 1e-3) / 1e12, median(t_comb));
    printf("int8 path, two buffers on two streams: %.3f ms\n", median(t_i82));
    return bad || bad2 ? 1 : 0;
}
