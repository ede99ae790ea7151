/*
 * skv_internal.h - lib/ private declarations: error reporting, checked sizes,
 * the cache's memory layout.
 */
#ifndef SKV_INTERNAL_H
#define SKV_INTERNAL_H

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "skv_backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SKV_ERRMSG_CAP 512

/*
 * Records a failure: formats the message into the thread-local last error and,
 * if errbuf is non-NULL, into errbuf (a cache's message). Returns st.
 */
skv_status skv_fail(char *errbuf, skv_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/*
 * A backend slot's detail for its failure (which device call failed, say):
 * kept per thread and appended by lib/ to the message of the failing call.
 * skv_backend_detail returns it and clears it ("" if none).
 */
void skv_backend_note(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
const char *skv_backend_detail(void);

/*
 * The input bound of the host backends (ref, cpu): the index of the first element of the
 * host tensor x[0..n) with |x| > SKV_MAX_INPUT_MAGNITUDE, NaN and Inf included, or -1.
 * Used by the cache's prefill and decode and by the op-level calls that take the same data.
 */
int64_t skv_first_bad(const skv_bf16 *x, int64_t n);

/* a * b into *out; 0 on overflow. (Inline: the cuda backend, a separate shared
   object, uses them too.) */
static inline int skv_mul_size(size_t a, size_t b, size_t *out)
{
    if (a != 0 && b > SIZE_MAX / a) return 0;
    *out = a * b;
    return 1;
}
/* a + b into *out; 0 on overflow. */
static inline int skv_add_size(size_t a, size_t b, size_t *out)
{
    if (b > SIZE_MAX - a) return 0;
    *out = a + b;
    return 1;
}

/* Resolved rotary dim (0 in the config means head_dim). */
static inline int32_t skv_rotary_dim(const skv_rope_config *rope, int32_t head_dim)
{
    return rope->rotary_dim ? rope->rotary_dim : head_dim;
}

/* The softmax scale: configured, or 1/sqrt(head_dim) when 0. */
static inline float skv_resolve_scale(float scale, int32_t head_dim)
{
    return scale > 0.0f ? scale : 1.0f / sqrtf((float)head_dim);
}

/* Validates a rope config against head_dim; message into errbuf. */
skv_status skv_rope_validate(char *errbuf, const skv_rope_config *rope, int32_t head_dim);

/* Resolves AUTO / checks availability; message into errbuf. */
skv_status skv_backend_resolve(char *errbuf, skv_backend want, skv_backend *got,
                               const struct skv_backend_ops **ops);

skv_status skv_layout_compute(char *errbuf, const skv_config *cfg, skv_layout *lay);

/* Whether this process can start the n_threads - 1 worker threads that n_threads asks of a
   backend (skv_cache_create; lib/skv_util.c). */
skv_status skv_probe_threads(int32_t n_threads);

/*
 * The structs of the public API that grow by appending fields. The smallest size
 * each ever had (its first published layout) is the least a caller may pass.
 */
#define SKV_CONFIG_MIN_SIZE offsetof(skv_config, reproducible) /* 0.1.0 ended at factorize */
/* 0.2 ended at reproducible: its size, the struct's alignment padding included */
#define SKV_CONFIG_V02_SIZE \
    ((offsetof(skv_config, select_mode) + _Alignof(skv_config) - 1) / _Alignof(skv_config) * _Alignof(skv_config))
/* 0.3 ended at dense_layers */
#define SKV_CONFIG_V03_SIZE \
    ((offsetof(skv_config, select_candidates) + _Alignof(skv_config) - 1) / _Alignof(skv_config) * _Alignof(skv_config))
/* 0.4 ended at select_candidates */
#define SKV_CONFIG_V04_SIZE \
    ((offsetof(skv_config, pool_device_bytes) + _Alignof(skv_config) - 1) / _Alignof(skv_config) * _Alignof(skv_config))
/* 0.5 ended at cuda_prefill_sms */
#define SKV_CONFIG_V05_SIZE \
    ((offsetof(skv_config, value_dtype) + _Alignof(skv_config) - 1) / _Alignof(skv_config) * _Alignof(skv_config))
/* 0.6 ended at value_dtype */
#define SKV_CONFIG_V06_SIZE \
    ((offsetof(skv_config, model_kv_heads) + _Alignof(skv_config) - 1) / _Alignof(skv_config) * _Alignof(skv_config))
#define SKV_STATS_MIN_SIZE sizeof(skv_stats)
/* 0.1 and 0.2 ended at values_on_device (0.3 added rank and dense): that size, padding included */
#define SKV_SEQ_INFO_MIN_SIZE \
    ((offsetof(skv_seq_info, rank) + _Alignof(skv_seq_info) - 1) / _Alignof(skv_seq_info) * _Alignof(skv_seq_info))
#define SKV_LAYER_STATS_MIN_SIZE sizeof(skv_layer_stats)
#define SKV_MEMORY_INFO_MIN_SIZE sizeof(skv_memory_info)

/* A caller's config (cfg->struct_size bytes of it) completed with the defaults of
   the fields its header did not have, into *out; INVALID_CONFIG for a size no
   skv_config ever had. */
skv_status skv_config_import(char *errbuf, const skv_config *cfg, skv_config *out);

/* Copies the library's struct into a caller's of dst_size bytes (the first bytes:
   fields are only ever appended); a larger caller struct gets zeros past ours. */
static inline void skv_copy_sized(void *dst, size_t dst_size, const void *src, size_t src_size)
{
    memcpy(dst, src, dst_size < src_size ? dst_size : src_size);
    if (dst_size > src_size) memset((char *)dst + src_size, 0, dst_size - src_size);
}

/*
 * The parts of a cache that lib/skv_snapshot.c reads and writes (struct skv_cache is
 * private to lib/skv_cache.c): pointers into the cache, valid while it lives.
 */
typedef struct skv_cache_parts {
    const skv_config *cfg;
    const skv_layout *lay;
    const struct skv_backend_ops *ops;
    char *dev, *host;       /* the device and host arenas */
    skv_seq_state *slots;   /* [n_layers * batch_size], slot i = layer * batch_size + seq */
    skv_layer_stats *layer_stats; /* [n_layers] decode counters (the counter fields only) */
    void *bctx;             /* the backend's cache state (cache-level slots), or NULL */
    char *err;              /* the cache's message buffer (SKV_ERRMSG_CAP bytes) */
} skv_cache_parts;
void skv_cache_parts_get(skv_cache *cache, skv_cache_parts *parts);
/* A call on a cache runs on the cache's device (config.cuda_device; backends without devices: no-op):
   skv_cache_device_enter makes it current and saves the caller's in *saved (on failure: the message in
   the cache and the thread's last error), skv_cache_device_leave restores it. NULL cache: no-op. */
skv_status skv_cache_device_enter(skv_cache *cache, int32_t *saved);
void skv_cache_device_leave(skv_cache *cache, int32_t saved);
/* The body of a public function on cache c: call (a skv_status expression) runs on c's device. */
#define SKV_ON_DEVICE(c, call)                                   \
    do {                                                         \
        int32_t skv_saved_;                                      \
        skv_status skv_st_ = skv_cache_device_enter(c, &skv_saved_); \
        if (skv_st_) return skv_st_;                             \
        skv_st_ = (call);                                        \
        skv_cache_device_leave(c, skv_saved_);                   \
        return skv_st_;                                          \
    } while (0)
/* config.rank == 0 (docs/DESIGN.md 3.1; lib/skv_rank.c). From the float factors uf [n, m],
   wf [m, Hk D] at m = rank_max of k_pre: the slot's rank into *rank and the factors in bf16 into
   u [n, m], w [m, Hk D] (host memory: ref, cpu), columns of U and rows of W in the stable order
   of non-increasing energy, places r.. zero. */
skv_status skv_rank_store(char *errbuf, const skv_config *cfg, int64_t n, const skv_bf16 *k_pre, const float *uf,
                          const float *wf, skv_bf16 *u, skv_bf16 *w, int32_t *rank);

#ifdef __cplusplus
}
#endif

#endif
