/*
 * The bottom layer of the cpu backend (skv_cpu_base.h): the SIMD level, the
 * thread count of the call in progress, BLAS on the calling thread, scratch.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <omp.h>

#include "skv_cpu_base.h"
#include "skv_internal.h"

/* ---- instruction set ------------------------------------------------------------------------ */

static int skv_cpu_simd_hw;   /* what the CPU has */
static int skv_cpu_simd_env;  /* the cap SKV_CPU_SIMD sets (used while no explicit choice is made) */
static int skv_cpu_simd_set = -1; /* skv_cpu_set_simd's cap; -1: none (atomic accesses) */
static pthread_once_t skv_cpu_simd_once = PTHREAD_ONCE_INIT;

static void skv_cpu_simd_init(void)
{
    const char *e = getenv("SKV_CPU_SIMD");
    skv_cpu_simd_env = e && !strcmp(e, "0") ? 0 : e && !strcmp(e, "avx2") ? SKV_CPU_LEVEL_AVX2 : SKV_CPU_LEVEL_AVX512;
#if SKV_CPU_X86
    __builtin_cpu_init();
    skv_cpu_simd_hw = !__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ? 0
                      : __builtin_cpu_supports("avx512f")                                 ? SKV_CPU_LEVEL_AVX512
                                                                                          : SKV_CPU_LEVEL_AVX2;
#endif
}

int skv_cpu_simd(void)
{
    pthread_once(&skv_cpu_simd_once, skv_cpu_simd_init);
    int set = __atomic_load_n(&skv_cpu_simd_set, __ATOMIC_RELAXED);
    int cap = set >= 0 ? set : skv_cpu_simd_env; /* an explicit choice wins over the environment */
    return skv_cpu_simd_hw < cap ? skv_cpu_simd_hw : cap;
}

SKV_API skv_status skv_cpu_set_simd(int32_t level)
{
    if (level < -1 || level > SKV_CPU_LEVEL_AVX512)
        return skv_fail(NULL, SKV_ERR_INVALID_ARGUMENT,
                        "skv_cpu_set_simd: level = %d: expected -1 (default), 0, 1 (AVX2+FMA) or 2 (AVX-512)",
                        (int)level);
    __atomic_store_n(&skv_cpu_simd_set, level, __ATOMIC_RELAXED);
    return SKV_OK;
}

SKV_API int32_t skv_cpu_simd_level(void) { return skv_cpu_simd(); }

/* ---- threads -------------------------------------------------------------------------------- */

/* config.n_threads of the cache call in progress on this thread; 0 outside one. */
static __thread int32_t skv_cpu_call_threads;

/* The count goes to the team's jobs (skv_cpu_run); the caller's OpenMP state is never touched. */
void skv_cpu_set_threads(int32_t n) { skv_cpu_call_threads = n > 0 ? n : 0; }

int skv_cpu_threads(void) { return skv_cpu_call_threads > 0 ? skv_cpu_call_threads : omp_get_max_threads(); }

/* ---- BLAS on the calling thread ------------------------------------------------------------- */

static pthread_mutex_t skv_cpu_blas_mu = PTHREAD_MUTEX_INITIALIZER;
static int skv_cpu_blas_open;  /* pairs open (under the mutex) */
static int skv_cpu_blas_saved; /* OpenBLAS's count when the first of them opened; 0: left alone */
static int skv_cpu_blas_pinning = -1; /* whether OpenBLAS pins threads (-1: not asked yet) */

void skv_cpu_blas_begin(void)
{
    pthread_mutex_lock(&skv_cpu_blas_mu);
    if (skv_cpu_blas_open++ == 0) {
        if (skv_cpu_blas_pinning < 0) {
            const char *cfg = openblas_get_config();
            skv_cpu_blas_pinning = !(cfg && strstr(cfg, "NO_AFFINITY"));
        }
        int n = openblas_get_num_threads();
        skv_cpu_blas_saved = !skv_cpu_blas_pinning && n > 1 ? n : 0;
        if (skv_cpu_blas_saved) openblas_set_num_threads(1);
    }
    pthread_mutex_unlock(&skv_cpu_blas_mu);
}

void skv_cpu_blas_end(void)
{
    pthread_mutex_lock(&skv_cpu_blas_mu);
    if (--skv_cpu_blas_open == 0 && skv_cpu_blas_saved) {
        openblas_set_num_threads(skv_cpu_blas_saved);
        skv_cpu_blas_saved = 0;
    }
    pthread_mutex_unlock(&skv_cpu_blas_mu);
}

/* ---- scratch -------------------------------------------------------------------------------- */

void *skv_cpu_alloc(size_t bytes)
{
    void *p = NULL;
    return posix_memalign(&p, 64, bytes ? bytes : 64) ? NULL : p;
}
