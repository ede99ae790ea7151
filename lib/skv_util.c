/* Status strings, error reporting, bf16, top-k, clock. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "skv_internal.h"
#include "skv_numerics.h"

static __thread char skv_tls_err[SKV_ERRMSG_CAP];

static const char *const skv_status_names[SKV_STATUS_COUNT] = {
    "SKV_OK: success",
    "SKV_ERR_INVALID_ARGUMENT: an argument is out of range",
    "SKV_ERR_NULL_POINTER: a required pointer is NULL",
    "SKV_ERR_INVALID_CONFIG: a config field is invalid",
    "SKV_ERR_SIZE_OVERFLOW: a buffer size overflows",
    "SKV_ERR_PROMPT_TOO_SHORT: prompt has fewer than O + S context chunks",
    "SKV_ERR_PROMPT_TOO_LONG: prompt longer than max_prompt_len",
    "SKV_ERR_NOT_PREFILLED: a layer of a sequence is not prefilled",
    "SKV_ERR_ALREADY_PREFILLED: this layer of this sequence is already prefilled",
    "SKV_ERR_CAPACITY: generated-token capacity exhausted",
    "SKV_ERR_NONFINITE: NaN, Inf or a magnitude above 2^32 in an input",
    "SKV_ERR_OUT_OF_MEMORY: allocation failed",
    "SKV_ERR_UNSUPPORTED: not implemented by this backend",
    "SKV_ERR_NO_DEVICE: no usable device for this backend",
    "SKV_ERR_NUMERICAL: a numerical routine failed",
    "SKV_ERR_NO_SELECTION: no decode step has run yet",
    "SKV_ERR_DEVICE: a device runtime call failed",
    "SKV_ERR_FORMAT: the snapshot is truncated, corrupted, of another format version, or not a snapshot",
    "SKV_ERR_IO: opening, reading, writing or renaming a file failed",
};

SKV_API const char *skv_status_string(skv_status status)
{
    if ((int)status < 0 || (int)status >= SKV_STATUS_COUNT) return "SKV_ERR_UNKNOWN: not a skv_status value";
    return skv_status_names[status];
}

SKV_API const char *skv_last_error(void) { return skv_tls_err; }

skv_status skv_fail(char *errbuf, skv_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(skv_tls_err, sizeof skv_tls_err, fmt, ap);
    va_end(ap);
    if (errbuf) memcpy(errbuf, skv_tls_err, SKV_ERRMSG_CAP);
    return st;
}

static __thread char skv_tls_note[SKV_ERRMSG_CAP];
static __thread char skv_tls_note_out[SKV_ERRMSG_CAP];

void skv_backend_note(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(skv_tls_note, sizeof skv_tls_note, fmt, ap);
    va_end(ap);
}

const char *skv_backend_detail(void)
{
    memcpy(skv_tls_note_out, skv_tls_note, sizeof skv_tls_note_out);
    skv_tls_note[0] = '\0';
    return skv_tls_note_out;
}

/*
 * First element of x[0..n) (host memory) with |x| > SKV_MAX_INPUT_MAGNITUDE, NaN and Inf
 * included (their magnitude bits are above it), or -1. One pass: |x| > lim iff the 16-bit
 * sum (x & 0x7fff) + (0x7fff - lim) has bit 15 set, ORed over whole blocks of 4096 (a fixed
 * trip count, which gcc -O2 vectorizes); a block that fires, and the tail, are searched.
 */
int64_t skv_first_bad(const skv_bf16 *x, int64_t n)
{
    const unsigned lim = skv_f32_to_bf16(SKV_MAX_INPUT_MAGNITUDE) & 0x7fffu; /* 0x4f80: exact, a power of two */
    const uint16_t add = (uint16_t)(0x7fffu - lim);
    int64_t lo = 0;
    for (; lo + 4096 <= n; lo += 4096) {
        const skv_bf16 *b = x + lo;
        uint16_t bad = 0;
        for (int i = 0; i < 4096; i++) bad |= (uint16_t)((b[i] & 0x7fffu) + add);
        if (bad & 0x8000u) break;
    }
    for (int64_t i = lo; i < n; i++)
        if ((unsigned)(x[i] & 0x7fffu) > lim) return i;
    return -1;
}

SKV_API skv_bf16 skv_bf16_from_float(float x) { return skv_f32_to_bf16(x); }
SKV_API float skv_bf16_to_float(skv_bf16 x) { return skv_bf16_to_f32(x); }

double skv_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* Strict total order: better key first, then lower index. */
static int skv_before(const float *keys, int ascending, int32_t i, int32_t j)
{
    float a = keys[i], b = keys[j];
    if (a != b) return ascending ? a < b : a > b;
    return i < j;
}

/*
 * The k-th element of the order is unique (the order is strict and total), so
 * any selection algorithm finds the same set; quickselect finds it, then one
 * scan emits the winners in increasing index order.
 */
void skv_topk_indices(const float *keys, int32_t n, int32_t k, int ascending, int32_t *idx,
                      int32_t *out)
{
    if (k <= 0) return;
    for (int32_t i = 0; i < n; i++) idx[i] = i;
    int32_t lo = 0, hi = n - 1, target = k - 1;
    while (lo < hi) {
        /* median of three as pivot */
        int32_t mid = lo + (hi - lo) / 2, a = idx[lo], b = idx[mid], c = idx[hi], p;
        if (skv_before(keys, ascending, a, b))
            p = skv_before(keys, ascending, b, c) ? b : (skv_before(keys, ascending, a, c) ? c : a);
        else
            p = skv_before(keys, ascending, a, c) ? a : (skv_before(keys, ascending, b, c) ? c : b);
        /* three-way partition is unnecessary: elements are distinct under the order */
        int32_t i = lo, j = hi;
        while (i <= j) {
            while (skv_before(keys, ascending, idx[i], p)) i++;
            while (skv_before(keys, ascending, p, idx[j])) j--;
            if (i <= j) {
                int32_t t = idx[i];
                idx[i] = idx[j];
                idx[j] = t;
                i++;
                j--;
            }
        }
        if (target <= j) hi = j;
        else if (target >= i) lo = i;
        else break;
    }
    int32_t kth = idx[target], m = 0;
    for (int32_t i = 0; i < n && m < k; i++)
        if (i == kth || skv_before(keys, ascending, i, kth)) out[m++] = i;
}

void skv_select_head(float *a, int32_t n_cand, int32_t S, int32_t *scratch, int32_t *sel_idx,
                     const int32_t *candidate_ids, int32_t *sel_ids)
{
    for (int32_t j = 0; j < n_cand; j++) a[j] = skv_select_key(a[j]);
    skv_topk_indices(a, n_cand, S, 0, scratch, sel_idx);
    if (sel_ids && candidate_ids)
        for (int32_t k = 0; k < S; k++) sel_ids[k] = candidate_ids[sel_idx[k]];
}

void *skv_ws_alloc(skv_ws *ws, size_t bytes)
{
    if (ws->base) {
        uintptr_t at = ((uintptr_t)(ws->base + ws->used) + 63) & ~(uintptr_t)63;
        size_t end = (size_t)(at - (uintptr_t)ws->base) + bytes;
        if (end <= ws->cap) {
            ws->used = end;
            return (void *)at;
        }
    }
    /* does not fit: a counted malloc, header = next pointer, 64-byte aligned payload */
    char *blk = malloc(bytes + 128);
    if (!blk) return NULL;
    *(void **)blk = ws->spill;
    ws->spill = blk;
    ws->n_spills++;
    return (void *)(((uintptr_t)blk + sizeof(void *) + 63) & ~(uintptr_t)63);
}

int64_t skv_ws_reset(skv_ws *ws)
{
    while (ws->spill) {
        void *next = *(void **)ws->spill;
        free(ws->spill);
        ws->spill = next;
    }
    int64_t n = ws->n_spills;
    ws->n_spills = 0;
    ws->used = 0;
    return n;
}
