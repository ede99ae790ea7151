/*
 * skv_cuda_plugin.c - the entry point of the cuda backend's shared object
 * (libshadowkv-cuda.so.0; lib/skv_backend.h describes the interface). It exports
 * skv_cuda_plugin_init, and one test hook, skv_cuda_test_rebuild_split, that only the
 * tests look up (not part of the library's interface).
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "skv_backend.h"

/* from skv_cuda.h, which a C file cannot include (it is C++ with the CUDA runtime) */
void skv_cuda_note(const char *fmt, ...);
void skv_cuda_fill_ops(struct skv_backend_ops *ops);
void skv_cuda_canon_test_split(int split);

static const skv_host_services *skv_cuda_host;

void skv_cuda_note(const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (skv_cuda_host && skv_cuda_host->note) skv_cuda_host->note(buf);
}

__attribute__((visibility("default"))) skv_status skv_cuda_plugin_init(const skv_host_services *host,
                                                                        struct skv_backend_ops *ops, char *msg,
                                                                        size_t cap)
{
    if (!host || !ops) {
        snprintf(msg, cap, "skv_cuda_plugin_init: NULL argument");
        return SKV_ERR_NULL_POINTER;
    }
    if (host->abi != SKV_PLUGIN_ABI || host->ops_size != sizeof *ops) {
        snprintf(msg, cap,
                 "%s is from another build of libshadowkv (plugin ABI %d, table %zu bytes; the library has "
                 "ABI %d, %zu bytes)",
                 SKV_CUDA_PLUGIN_SONAME, SKV_PLUGIN_ABI, sizeof *ops, (int)host->abi, host->ops_size);
        return SKV_ERR_NO_DEVICE;
    }
    skv_cuda_host = host;
    skv_cuda_fill_ops(ops);
    return SKV_OK;
}

/* Test hook: forces the reproducible decode rebuild's split form on (1) or off (0), or restores the
   automatic choice (-1), see skv_cuda_canon_test_split. tests/test_canonical_decode.c --split=0|1 finds
   it in the program (static link of the plugin's archive) or with dlsym in the opened plugin. */
__attribute__((visibility("default"))) void skv_cuda_test_rebuild_split(int split) { skv_cuda_canon_test_split(split); }
