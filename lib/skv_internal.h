/*
 * skv_internal.h - lib/ private declarations: error reporting, checked sizes,
 * the cache's memory layout.
 */
#ifndef SKV_INTERNAL_H
#define SKV_INTERNAL_H

#include <math.h>
#include <stdarg.h>
#include "skv_backend.h"

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

/* a * b into *out; 0 on overflow. */
int skv_mul_size(size_t a, size_t b, size_t *out);
/* a + b into *out; 0 on overflow. */
int skv_add_size(size_t a, size_t b, size_t *out);

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

/*
 * Byte offsets of one (layer, sequence) slot inside the device and host arenas,
 * and of the shared regions. Computed once from a validated config; the memory
 * query and create use the same function, so they cannot disagree.
 */
typedef struct skv_layout {
    int32_t S;          /* selected chunks per KV head */
    int32_t cand_max;   /* N_max - O */
    int32_t local_max;  /* (Lc + 1) * c - 1 */
    int64_t n_positions;/* RoPE table rows: max_prompt_len + gen_capacity */
    /* per-slot device offsets */
    size_t u, w, landmarks, cand_ids, out_ids, out_k, out_v, loc_k, loc_v, gen_k, gen_v, sel_idx,
        sel_ids, slot_device;
    /* per-slot host offsets */
    size_t vstore, slot_host;
    /* shared device regions (after L*B slots) */
    size_t rope_cos, rope_sin, ws_k, ws_v, ws_sel_idx, ws_sel_ids;
    size_t device_total, host_total;
} skv_layout;

skv_status skv_layout_compute(char *errbuf, const skv_config *cfg, skv_layout *lay);

#endif
