/*
 * probe_common.cuh - what the standalone timing probes in this directory share: the checked
 * CUDA (and cuBLAS) calls and the launch timer (CUDA events around reps back-to-back launches
 * after 20 warm-up launches, the median of 5 such batches, in microseconds a launch), the
 * inputs' generator, and with lib/skv_factor_canon.h included first, the canonical route's
 * column scales of bf16 rows.
 */
#ifndef SKV_PROBE_COMMON_CUH
#define SKV_PROBE_COMMON_CUH

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#define CK(x)                                                                                       \
    do {                                                                                            \
        cudaError_t e_ = (x);                                                                       \
        if (e_ != cudaSuccess) {                                                                    \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));     \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

#ifdef CUBLAS_V2_H_
#define CB(x)                                                                                       \
    do {                                                                                            \
        cublasStatus_t e_ = (x);                                                                    \
        if (e_ != CUBLAS_STATUS_SUCCESS) {                                                          \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cublasGetStatusString(e_));  \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)
#endif

/* The probes' inputs: xorshift64, a fixed seed. */
static uint64_t probe_rng = 0x2545f4914f6cdd1dull;
static uint64_t rnd(void)
{
    probe_rng ^= probe_rng << 13;
    probe_rng ^= probe_rng >> 7;
    probe_rng ^= probe_rng << 17;
    return probe_rng;
}

template <class F>
static float time_us(F launch, int reps = 200)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int w = 0; w < 20; w++) launch();
    CK(cudaDeviceSynchronize());
    std::vector<float> v;
    for (int t = 0; t < 5; t++) {
        CK(cudaEventRecord(a));
        for (int i = 0; i < reps; i++) launch();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        v.push_back(ms * 1000.0f / reps);
    }
    CK(cudaGetLastError());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    std::sort(v.begin(), v.end());
    return v[2];
}

#ifdef SKV_FACTOR_CANON_H
/* The canonical route's column scales e_i of bf16 rows a [rows, d] (lib/skv_factor_canon.h). */
static std::vector<int32_t> probe_col_scales(const std::vector<uint16_t> &a, int64_t rows, int32_t d)
{
    std::vector<int32_t> e(d);
    for (int32_t i = 0; i < d; i++) {
        unsigned mx = 0;
        for (int64_t t = 0; t < rows; t++) mx = std::max(mx, (unsigned)(a[(size_t)t * d + i] & 0x7fffu));
        e[i] = skv_canon_ex_bf16((uint16_t)mx);
    }
    return e;
}
#endif

#endif
