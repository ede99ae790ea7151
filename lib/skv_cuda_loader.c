/*
 * skv_cuda_loader.c - finds and opens the cuda backend at run time.
 *
 * libshadowkv itself links no CUDA library: a program that never asks for cuda
 * (or runs on a machine without CUDA) loads and runs the ref and cpu backends
 * alone. The first time the cuda table is needed (backend cuda or auto), this
 * file looks for the plugin, in order:
 *   1. a copy linked into the program (libshadowkv-cuda.a, weak reference);
 *   2. libshadowkv-cuda.so.0 in the directory of the object that holds this code
 *      (libshadowkv.so.0's own directory, or the program's for a static link);
 *   3. libshadowkv-cuda.so.0 through the dynamic loader's search path.
 * dlopen resolves the plugin's own needs (libcudart, libcublas, libcusolver); when
 * one is missing, dlerror names it, and the cuda table's probe reports that message
 * with SKV_ERR_NO_DEVICE. The attempt is made once per process.
 */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "skv_internal.h"

/* Defined when the plugin's archive is linked into the program. */
extern skv_status skv_cuda_plugin_init(const skv_host_services *host, struct skv_backend_ops *ops, char *msg,
                                       size_t cap) __attribute__((weak));

static struct skv_backend_ops skv_cuda_table;
static pthread_once_t skv_cuda_once = PTHREAD_ONCE_INIT;
static char skv_cuda_why[512]; /* why the plugin is not usable ("" once loaded) */

static void skv_cuda_host_note(const char *detail) { skv_backend_note("%s", detail); }

static const skv_host_services skv_cuda_services = {SKV_PLUGIN_ABI, sizeof(struct skv_backend_ops),
                                                    skv_cuda_host_note};

static skv_status skv_cuda_unavailable(char *msg, size_t cap)
{
    snprintf(msg, cap, "%s", skv_cuda_why);
    return SKV_ERR_NO_DEVICE;
}

/* dlopen of the plugin: next to this object first, then by name. */
static void *skv_cuda_open(char *why, size_t cap)
{
    char path[4096], first[256] = "";
    Dl_info info;
    if (dladdr((void *)&skv_cuda_open, &info) && info.dli_fname) {
        const char *slash = strrchr(info.dli_fname, '/');
        if (slash && (size_t)(slash - info.dli_fname) + sizeof SKV_CUDA_PLUGIN_SONAME + 1 < sizeof path) {
            snprintf(path, sizeof path, "%.*s/%s", (int)(slash - info.dli_fname), info.dli_fname,
                     SKV_CUDA_PLUGIN_SONAME);
            void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
            if (h) return h;
            const char *e = dlerror();
            /* a plugin that is there but cannot load is the message worth keeping */
            if (e && !strstr(e, SKV_CUDA_PLUGIN_SONAME ": cannot open")) snprintf(first, sizeof first, "%s", e);
        }
    }
    void *h = dlopen(SKV_CUDA_PLUGIN_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (h) return h;
    const char *e = dlerror();
    snprintf(why, cap, "the CUDA backend (%s) could not be loaded: %s", SKV_CUDA_PLUGIN_SONAME,
             first[0] ? first : (e ? e : "not found"));
    return NULL;
}

static void skv_cuda_load(void)
{
    memset(&skv_cuda_table, 0, sizeof skv_cuda_table);
    skv_cuda_table.name = "cuda";
    skv_cuda_table.probe = skv_cuda_unavailable;
    skv_cuda_plugin_init_fn init = skv_cuda_plugin_init;
    void *h = NULL;
    if (!init) {
        h = skv_cuda_open(skv_cuda_why, sizeof skv_cuda_why);
        if (!h) return;
        init = (skv_cuda_plugin_init_fn)dlsym(h, SKV_CUDA_PLUGIN_INIT);
        if (!init) {
            snprintf(skv_cuda_why, sizeof skv_cuda_why, "%s has no %s: not a libshadowkv cuda backend",
                     SKV_CUDA_PLUGIN_SONAME, SKV_CUDA_PLUGIN_INIT);
            dlclose(h);
            return;
        }
    }
    struct skv_backend_ops t;
    memset(&t, 0, sizeof t);
    char msg[384] = "";
    if (init(&skv_cuda_services, &t, msg, sizeof msg) != SKV_OK || !t.probe) {
        snprintf(skv_cuda_why, sizeof skv_cuda_why, "the cuda backend refused to load: %s", msg);
        if (h) dlclose(h);
        return;
    }
    skv_cuda_table = t; /* the plugin stays open for the life of the process */
    skv_cuda_why[0] = '\0';
}

const struct skv_backend_ops *skv_cuda_ops(void)
{
    pthread_once(&skv_cuda_once, skv_cuda_load);
    return &skv_cuda_table;
}
