/*
 * skv_cuda_green.cu - the prefill's partition of the device (config.cuda_prefill_sms; docs/DESIGN.md
 * 12.5): a green context over part of the device's streaming multiprocessors, and the streams and
 * events the prefill's work beside the decode uses in it.
 *
 * The plugin links the CUDA runtime only, so the driver's green-context calls are taken from the
 * driver through cudaGetDriverEntryPointByVersion (CUDA 12.5+ runtimes; cudaGetDriverEntryPoint
 * before), once per process. The partition is one group of cuDevSmResourceSplitByCount (the
 * driver rounds the count up to its granularity: 8 SMs on compute capability 9.0), a descriptor
 * of that group and a green context over it. Kernels launched on the context's streams run on
 * the group's SMs only; the decode's streams, in the device's primary context, keep every SM.
 * Streams are made by cuGreenCtxStreamCreate (CUDA 12.5+ drivers) or, on a 12.4 driver, by
 * cuStreamCreateWithPriority with the green context current. Events recorded on those streams
 * are made in the green context (an event is recorded on a stream of its own context); other
 * streams may wait for them (waits across contexts of a device are allowed).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda.h>

#include "skv_cuda.h"

#if defined(CUDA_VERSION) && CUDA_VERSION >= 12040 && defined(CUDART_VERSION) && CUDART_VERSION >= 12040
#define SKV_CUDA_HAVE_GREEN 1
#else
#define SKV_CUDA_HAVE_GREEN 0
#endif

#if SKV_CUDA_HAVE_GREEN

/* The driver calls used here, with their CUDA 12.4 signatures (cuGreenCtxStreamCreate: 12.5). */
typedef struct {
    int ok;            /* every call but stream_create was found */
    char why[160];     /* else: what was missing */
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*get_resource)(CUdevice, CUdevResource *, CUdevResourceType);
    CUresult (*split)(CUdevResource *, unsigned int *, const CUdevResource *, CUdevResource *, unsigned int,
                      unsigned int);
    CUresult (*gen_desc)(CUdevResourceDesc *, CUdevResource *, unsigned int);
    CUresult (*create)(CUgreenCtx *, CUdevResourceDesc, CUdevice, unsigned int);
    CUresult (*destroy)(CUgreenCtx);
    CUresult (*to_ctx)(CUcontext *, CUgreenCtx);
    CUresult (*stream_create)(CUstream *, CUgreenCtx, unsigned int, int); /* NULL on a 12.4 driver */
    CUresult (*stream_create_prio)(CUstream *, unsigned int, int);
    CUresult (*event_create)(CUevent *, unsigned int);
    CUresult (*push)(CUcontext);
    CUresult (*pop)(CUcontext *);
    CUresult (*error_string)(CUresult, const char **);
} skv_cuda_drv;

/* One driver entry point of the given CUDA version's ABI; NULL if the driver lacks it. */
static void *skv_cuda_drv_sym(const char *name, unsigned version)
{
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &q);
#else
    (void)version;
    cudaError_t e = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return fn;
}

static skv_cuda_drv skv_cuda_drv_load(void)
{
    skv_cuda_drv d;
    memset(&d, 0, sizeof d);
    int version = 0;
    if (cudaDriverGetVersion(&version) != cudaSuccess || version < 12040) {
        (void)cudaGetLastError();
        snprintf(d.why, sizeof d.why, "the driver (CUDA %d.%d) has no green contexts (CUDA 12.4+)", version / 1000,
                 version % 1000 / 10);
        return d;
    }
#define SKV_SYM(field, name, ver)                                                                                  \
    do {                                                                                                           \
        *(void **)&d.field = skv_cuda_drv_sym(name, ver);                                                          \
        if (!d.field && !d.why[0]) snprintf(d.why, sizeof d.why, "the driver has no %s", name);                    \
    } while (0)
    SKV_SYM(device_get, "cuDeviceGet", 12040);
    SKV_SYM(get_resource, "cuDeviceGetDevResource", 12040);
    SKV_SYM(split, "cuDevSmResourceSplitByCount", 12040);
    SKV_SYM(gen_desc, "cuDevResourceGenerateDesc", 12040);
    SKV_SYM(create, "cuGreenCtxCreate", 12040);
    SKV_SYM(destroy, "cuGreenCtxDestroy", 12040);
    SKV_SYM(to_ctx, "cuCtxFromGreenCtx", 12040);
    SKV_SYM(stream_create_prio, "cuStreamCreateWithPriority", 12040);
    SKV_SYM(event_create, "cuEventCreate", 12040);
    SKV_SYM(push, "cuCtxPushCurrent", 12040);
    SKV_SYM(pop, "cuCtxPopCurrent", 12040);
    SKV_SYM(error_string, "cuGetErrorString", 12040);
#undef SKV_SYM
    d.ok = !d.why[0];
    *(void **)&d.stream_create = skv_cuda_drv_sym("cuGreenCtxStreamCreate", 12050);
    return d;
}

/* The entry points, found once per process (a thread-safe static). */
static const skv_cuda_drv *skv_cuda_drv_get(void)
{
    static const skv_cuda_drv d = skv_cuda_drv_load();
    return &d;
}

struct skv_cuda_green {
    CUgreenCtx g;
    CUcontext ctx; /* g as a context, to make it current while events are made */
    int32_t sms;   /* the partition's streaming multiprocessors */
};

/* A failed driver call: SKV_ERR_OUT_OF_MEMORY or SKV_ERR_DEVICE (unsupported: SKV_ERR_UNSUPPORTED) with a message. */
static skv_status skv_cuda_drv_fail(CUresult r, const char *what, char *msg, size_t cap)
{
    const skv_cuda_drv *d = skv_cuda_drv_get();
    const char *s = NULL;
    if (d->error_string && d->error_string(r, &s) != CUDA_SUCCESS) s = NULL;
    snprintf(msg, cap, "cuda_prefill_sms: %s failed: %s (%d)", what, s ? s : "unknown error", (int)r);
    skv_cuda_note("%s", msg);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return SKV_ERR_OUT_OF_MEMORY;
    if (r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_INVALID_RESOURCE_TYPE ||
        r == CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION)
        return SKV_ERR_UNSUPPORTED;
    return SKV_ERR_DEVICE;
}

skv_status skv_cuda_green_create(skv_cuda_green **out, int32_t sms, int32_t *actual, char *msg, size_t cap)
{
    *out = NULL;
    const skv_cuda_drv *d = skv_cuda_drv_get();
    int dev = 0;
    CUdevice cu = 0;
    CUresult r;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return skv_cuda_err(e, "cudaGetDevice", msg, cap);
    if (!d->ok) {
        snprintf(msg, cap, "cuda_prefill_sms = %d: %s", sms, d->why);
        return SKV_ERR_UNSUPPORTED;
    }
    CUdevResource all, part, rest;
    memset(&all, 0, sizeof all), memset(&part, 0, sizeof part), memset(&rest, 0, sizeof rest);
    if ((r = d->device_get(&cu, dev)) != CUDA_SUCCESS) return skv_cuda_drv_fail(r, "cuDeviceGet", msg, cap);
    if ((r = d->get_resource(cu, &all, CU_DEV_RESOURCE_TYPE_SM)) != CUDA_SUCCESS) {
        skv_status s = skv_cuda_drv_fail(r, "cuDeviceGetDevResource", msg, cap);
        return s == SKV_ERR_DEVICE ? SKV_ERR_UNSUPPORTED : s; /* a device without SM resources: no partitions */
    }
    *actual = (int32_t)all.sm.smCount;
    if ((unsigned)sms >= all.sm.smCount) return SKV_OK; /* the whole device: no partition */
    unsigned groups = 1;
    if ((r = d->split(&part, &groups, &all, &rest, 0, (unsigned)sms)) != CUDA_SUCCESS)
        return skv_cuda_drv_fail(r, "cuDevSmResourceSplitByCount", msg, cap);
    if (groups < 1 || part.sm.smCount >= all.sm.smCount) return SKV_OK; /* rounded up to the whole device */
    skv_cuda_green *g = (skv_cuda_green *)calloc(1, sizeof *g);
    if (!g) {
        snprintf(msg, cap, "out of host memory");
        return SKV_ERR_OUT_OF_MEMORY;
    }
    CUdevResourceDesc desc = NULL;
    if ((r = d->gen_desc(&desc, &part, 1)) != CUDA_SUCCESS) {
        free(g);
        return skv_cuda_drv_fail(r, "cuDevResourceGenerateDesc", msg, cap);
    }
    if ((r = d->create(&g->g, desc, cu, CU_GREEN_CTX_DEFAULT_STREAM)) != CUDA_SUCCESS) {
        free(g);
        return skv_cuda_drv_fail(r, "cuGreenCtxCreate", msg, cap);
    }
    if ((r = d->to_ctx(&g->ctx, g->g)) != CUDA_SUCCESS) {
        d->destroy(g->g);
        free(g);
        return skv_cuda_drv_fail(r, "cuCtxFromGreenCtx", msg, cap);
    }
    g->sms = (int32_t)part.sm.smCount;
    *actual = g->sms;
    *out = g;
    return SKV_OK;
}

skv_status skv_cuda_green_stream(skv_cuda_green *g, cudaStream_t *s, int prio, char *msg, size_t cap)
{
    *s = NULL;
    if (!g) CK(cudaStreamCreateWithPriority(s, cudaStreamNonBlocking, prio));
    else {
        const skv_cuda_drv *d = skv_cuda_drv_get();
        CUstream cs = NULL;
        CUresult r;
        if (d->stream_create) {
            r = d->stream_create(&cs, g->g, CU_STREAM_NON_BLOCKING, prio);
        } else { /* a 12.4 driver: a stream made with the green context current belongs to it */
            if ((r = d->push(g->ctx)) != CUDA_SUCCESS) return skv_cuda_drv_fail(r, "cuCtxPushCurrent", msg, cap);
            r = d->stream_create_prio(&cs, CU_STREAM_NON_BLOCKING, prio);
            CUcontext popped;
            d->pop(&popped);
        }
        if (r != CUDA_SUCCESS) return skv_cuda_drv_fail(r, "cuGreenCtxStreamCreate", msg, cap);
        *s = (cudaStream_t)cs;
    }
    return SKV_OK;
}

skv_status skv_cuda_green_event(skv_cuda_green *g, cudaEvent_t *e, unsigned flags, char *msg, size_t cap)
{
    *e = NULL;
    if (!g) CK(cudaEventCreateWithFlags(e, flags));
    else {
        const skv_cuda_drv *d = skv_cuda_drv_get();
        CUevent ce = NULL;
        CUresult r = d->push(g->ctx);
        if (r != CUDA_SUCCESS) return skv_cuda_drv_fail(r, "cuCtxPushCurrent", msg, cap);
        r = d->event_create(&ce, flags); /* cudaEventDisableTiming == CU_EVENT_DISABLE_TIMING */
        CUcontext popped;
        d->pop(&popped);
        if (r != CUDA_SUCCESS) return skv_cuda_drv_fail(r, "cuEventCreate", msg, cap);
        *e = (cudaEvent_t)ce;
    }
    return SKV_OK;
}

void skv_cuda_green_destroy(skv_cuda_green *g)
{
    if (!g) return;
    skv_cuda_drv_get()->destroy(g->g);
    free(g);
}

#else /* headers before CUDA 12.4: no green contexts */

struct skv_cuda_green {
    int unused;
};

skv_status skv_cuda_green_create(skv_cuda_green **out, int32_t sms, int32_t *actual, char *msg, size_t cap)
{
    *out = NULL;
    (void)actual;
    snprintf(msg, cap, "cuda_prefill_sms = %d: this build of the cuda plugin (CUDA headers before 12.4) has no green "
                       "contexts", sms);
    return SKV_ERR_UNSUPPORTED;
}

skv_status skv_cuda_green_stream(skv_cuda_green *g, cudaStream_t *s, int prio, char *msg, size_t cap)
{
    (void)g;
    *s = NULL;
    CK(cudaStreamCreateWithPriority(s, cudaStreamNonBlocking, prio));
    return SKV_OK;
}

skv_status skv_cuda_green_event(skv_cuda_green *g, cudaEvent_t *e, unsigned flags, char *msg, size_t cap)
{
    (void)g;
    *e = NULL;
    CK(cudaEventCreateWithFlags(e, flags));
    return SKV_OK;
}

void skv_cuda_green_destroy(skv_cuda_green *g) { (void)g; }

#endif
