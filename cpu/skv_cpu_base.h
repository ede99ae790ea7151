/*
 * skv_cpu_base.h - the bottom layer of the cpu backend (skv_cpu_ops.h has the
 * map of the layers): the SIMD level chosen at run time, the thread count of
 * the call in progress, the team that runs every parallel loop
 * (skv_cpu_pool.c), the library's BLAS calls on the calling thread alone,
 * and small helpers. Implemented by skv_cpu_base.c and skv_cpu_pool.c, which
 * include nothing else of cpu/.
 */
#ifndef SKV_CPU_BASE_H
#define SKV_CPU_BASE_H

#include <stddef.h>
#include <stdint.h>

#include "skv_backend.h"
#include "skv_numerics.h"

/*
 * Instruction sets. The library is built for baseline x86-64 (no -mavx2 or
 * -mfma); the AVX2+FMA code is compiled per function (SKV_CPU_AVX2) and runs
 * only when skv_cpu_simd() says so: the CPU has AVX2 and FMA (cpuid, with
 * the OS's YMM state) and the environment variable SKV_CPU_SIMD is not "0"
 * (read once, at the first call). The AVX-512F kernel (SKV_CPU_AVX512) runs
 * also when the CPU has AVX-512F and SKV_CPU_SIMD is not "avx2". Otherwise, and on other architectures, the
 * portable code runs: decisions bit for bit the same, factorize by the EXACT
 * route for every shape and rebuild_keys by OpenBLAS sgemm.
 * Functions marked SKV_CPU_AVX2 may only be called when skv_cpu_simd() is 1.
 */
#ifndef SKV_CPU_X86
#if defined(__x86_64__) || defined(__i386__)
#define SKV_CPU_X86 1
#else
#define SKV_CPU_X86 0
#endif
#endif
#if SKV_CPU_X86
#define SKV_CPU_AVX2 __attribute__((target("avx2,fma")))
#define SKV_CPU_AVX512 __attribute__((target("avx512f,avx2,fma")))
#endif

/* The SIMD code that runs, constant for the process: 0 the portable code, SKV_CPU_LEVEL_AVX2 the
   AVX2+FMA functions, SKV_CPU_LEVEL_AVX512 those and the AVX-512F ones (rebuild_keys' kernel). */
enum { SKV_CPU_LEVEL_AVX2 = 1, SKV_CPU_LEVEL_AVX512 = 2 };
int skv_cpu_simd(void);

/* The set_threads slot: lib/ calls it with config.n_threads when a prefill or decode starts on
   this thread and with 0 when it ends. */
void skv_cpu_set_threads(int32_t n);

/* Threads of the calling thread's next job: config.n_threads of the cache call in progress on
   this thread (skv_cpu_set_threads), else omp_get_max_threads() (the caller's default; the
   backend runs no OpenMP region itself). */
int skv_cpu_threads(void);

/*
 * The team (skv_cpu_pool.c), the only way the backend runs work in parallel,
 * prefill and decode alike: fn(ctx, i, t) for every item i in [0, n), on the
 * calling thread (t = 0) and up to nt - 1 helper threads (t = 1 .. nt - 1;
 * per-thread scratch by t), items handed out one at a time in order; returns
 * when every item is done (its writes then visible to the caller). No
 * barrier inside a job: a loop that needs one is two jobs. fn must not start
 * a job itself.
 */
typedef void (*skv_cpu_item_fn)(void *ctx, int64_t item, int t);
void skv_cpu_run(int nt, int64_t n, skv_cpu_item_fn fn, void *ctx);

/* skv_cpu_threads(), but no more than items (at least 1): no thread without work. */
static inline int skv_cpu_team(int64_t items)
{
    int nt = skv_cpu_threads();
    return items < nt ? (items > 1 ? (int)items : 1) : nt;
}

/* Counts one more of total completions at *cnt; 1 for the caller that completes the last one,
   which then sees every other completer's writes (acquire-release). */
static inline int skv_cpu_last(int32_t *cnt, int32_t total)
{
    return __atomic_add_fetch(cnt, 1, __ATOMIC_ACQ_REL) == total;
}

/*
 * OpenBLAS and LAPACK calls run on the calling thread alone, between
 * skv_cpu_blas_begin() and skv_cpu_blas_end() (nested and concurrent pairs
 * allowed): the parallelism is the team's, by items each making its own BLAS
 * call where a loop has several. OpenBLAS's threads would otherwise wait for
 * work by polling, on the cores the team runs on. The pair sets OpenBLAS's
 * process-wide thread count to 1 while any pair is open and restores the
 * count it found when the last one closes; it leaves OpenBLAS alone where
 * OpenBLAS pins its threads to cores (a build without NO_AFFINITY: changing
 * the count there moves the calling thread), and where it has one thread.
 */
void skv_cpu_blas_begin(void);
void skv_cpu_blas_end(void);

#define SKV_CPU_MAX_D 1024 /* lib/ rejects head_dim > 1024 */

static inline int skv_cpu_min(int a, int b) { return a < b ? a : b; }

/* 64-byte aligned scratch (no 32-byte loads split across cache lines); free(). */
void *skv_cpu_alloc(size_t bytes);

#endif /* SKV_CPU_BASE_H */
