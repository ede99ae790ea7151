/*
 * dmma_order_probe.cu - does the fp64 tensor-core mma (mma.sync m8n8k4 f64) compute each output as the
 * chain acc = fma(a_k, b_k, acc) for k = 0, 1, 2, 3 in order, the canonical route's element order
 * (lib/skv_factor_canon.h)? Chained k-steps of 4 from 0 against a thread's fma chain, on random tiles
 * with wide exponents, cancellation, subnormal products and signed zeros; prints the mismatches (and how many match other orders).
 *
 *   nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 dev/cuda/dmma_order_probe.cu \
 *     -o build/probe/dmma_order_probe && build/probe/dmma_order_probe [tiles]
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); exit(1); } } while (0)

constexpr int K = 64;

/* tile t: A [8][K], B [K][8] row major; D [8][8] */
__global__ void dmma_tiles(const double *A, const double *B, double *D, int tiles)
{
    const int lane = threadIdx.x & 31, t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (t >= tiles) return;
    const double *a = A + (size_t)t * 8 * K, *b = B + (size_t)t * K * 8;
    double d0 = 0.0, d1 = 0.0;
    for (int k0 = 0; k0 < K; k0 += 4) {
        const double av = a[(lane >> 2) * K + k0 + (lane & 3)];
        const double bv = b[(k0 + (lane & 3)) * 8 + (lane >> 2)];
        asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                     : "+d"(d0), "+d"(d1) : "d"(av), "d"(bv));
    }
    double *d = D + (size_t)t * 64;
    d[(lane >> 2) * 8 + 2 * (lane & 3)] = d0;
    d[(lane >> 2) * 8 + 2 * (lane & 3) + 1] = d1;
}

static uint64_t s_ = 88172645463325252ull;
static double rnd() { s_ ^= s_ << 13; s_ ^= s_ >> 7; s_ ^= s_ << 17; return (double)(s_ >> 11) * 0x1p-53; }

int main(int argc, char **argv)
{
    const int tiles = argc > 1 ? atoi(argv[1]) : 20000;
    const size_t na = (size_t)tiles * 8 * K;
    double *A = (double *)malloc(na * 8), *B = (double *)malloc(na * 8), *D = (double *)malloc((size_t)tiles * 64 * 8);
    for (int t = 0; t < tiles; t++) {
        const int kind = t % 6;
        for (size_t i = 0; i < (size_t)8 * K; i++) {
            double x = 2 * rnd() - 1, y = 2 * rnd() - 1;
            if (kind == 1) x = ldexp(x, (int)(rnd() * 60) - 30), y = ldexp(y, (int)(rnd() * 60) - 30);
            if (kind == 2) x = ldexp(floor(x * 1e6), -20), y = ldexp(floor(y * 1e6), -20) + ldexp(rnd(), -70);
            if (kind == 3) x = 1.0 + ldexp(rnd(), -30) * ((i & 1) ? 1 : -1), y = (i & 2) ? 1.0 : -1.0 + ldexp(rnd(), -40);
            if (kind == 4) x = ldexp(x, -515 - (int)(rnd() * 20)), y = ldexp(y, -515); /* subnormal products */
            if (kind == 5) { /* signed zeros, exact cancellation to zero */
                const double v[6] = {0.0, -0.0, 1.0, -1.0, 0.5, -0.5};
                x = v[(int)(rnd() * 6)], y = v[(int)(rnd() * 6)];
            }
            A[(size_t)t * 8 * K + i] = x;
            B[(size_t)t * 8 * K + i] = y;
        }
    }
    double *dA, *dB, *dD;
    CK(cudaMalloc(&dA, na * 8)); CK(cudaMalloc(&dB, na * 8)); CK(cudaMalloc(&dD, (size_t)tiles * 64 * 8));
    CK(cudaMemcpy(dA, A, na * 8, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dB, B, na * 8, cudaMemcpyHostToDevice));
    CK(cudaMemset(dD, 0xff, (size_t)tiles * 64 * 8));
    dmma_tiles<<<(tiles + 3) / 4, 128>>>(dA, dB, dD, tiles);
    CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(D, dD, (size_t)tiles * 64 * 8, cudaMemcpyDeviceToHost));
    long long mis[6] = {0, 0, 0, 0, 0, 0}, n[6] = {0, 0, 0, 0, 0, 0}, alt = 0;
    for (int t = 0; t < tiles; t++)
        for (int i = 0; i < 8; i++)
            for (int j = 0; j < 8; j++) {
                const double *a = A + (size_t)t * 8 * K + i * K, *b = B + (size_t)t * K * 8 + j;
                double acc = 0.0, acc2 = 0.0;
                for (int k = 0; k < K; k++) acc = fma(a[k], b[k * 8], acc);
                for (int k0 = 0; k0 < K; k0 += 4) { /* alternative: a 4-term sum rounded once? approximated by long double */
                    long double s = 0;
                    for (int k = k0; k < k0 + 4; k++) s += (long double)a[k] * b[k * 8];
                    acc2 = (double)((long double)acc2 + s);
                }
                const double g = D[(size_t)t * 64 + i * 8 + j];
                n[t % 6]++;
                if (memcmp(&g, &acc, 8)) { mis[t % 6]++; if (!memcmp(&g, &acc2, 8)) alt++; }
            }
    printf("dmma m8n8k4 f64 vs fma chain in k order: mismatches %lld/%lld (uniform), %lld/%lld (wide), %lld/%lld (grid), %lld/%lld (cancel), %lld/%lld (subnormal), %lld/%lld (signed zeros); of the mismatches %lld equal a rounded 4-term sum\n",
           mis[0], n[0], mis[1], n[1], mis[2], n[2], mis[3], n[3], mis[4], n[4], mis[5], n[5], alt);
    const long long bad = mis[0] + mis[1] + mis[2] + mis[3] + mis[4] + mis[5], all = n[0] + n[1] + n[2] + n[3] + n[4] + n[5];
    printf("%lld passed, %lld failed\n", all - bad, bad);
    return bad ? 1 : 0;
}
