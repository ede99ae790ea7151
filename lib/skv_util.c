/* Status strings, error reporting, bf16, top-k and the selection count, clock, the thread probe. */
#include <pthread.h>
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
    "SKV_ERR_SEQ_STATE: the call does not fit the sequence's state (a free slot released, a prompt piece out of order)",
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

/* Sorts idx[0..n) by the strict order of skv_before (best first): heapsort, in place. */
static void skv_sort_best_first(const float *keys, int32_t *idx, int32_t n)
{
    /* a heap whose root is the worst element, so popping to the end leaves best first */
    for (int32_t start = n / 2 - 1, end = n; end > 1;) {
        int32_t root;
        if (start >= 0) root = start--;
        else {
            end--;
            int32_t t = idx[0];
            idx[0] = idx[end];
            idx[end] = t;
            root = 0;
        }
        for (;;) {
            int32_t child = 2 * root + 1;
            if (child >= end) break;
            if (child + 1 < end && skv_before(keys, 0, idx[child], idx[child + 1])) child++;
            if (!skv_before(keys, 0, idx[root], idx[child])) break;
            int32_t t = idx[root];
            idx[root] = idx[child];
            idx[child] = t;
            root = child;
        }
    }
}

int32_t skv_select_head(float *a, int32_t n_cand, const skv_select_params *sp, int32_t *scratch, int32_t *sel_idx,
                        const int32_t *candidate_ids, int32_t *sel_ids)
{
    const int32_t cap = sp->cap;
    int32_t k = cap;
    for (int32_t j = 0; j < n_cand; j++) a[j] = skv_select_key(a[j]);
    skv_topk_indices(a, n_cand, cap, 0, scratch, sel_idx);
    if (sp->mode == SKV_SELECT_MASS) {
        /* A: the canonical sum of the masses, as skv_canonical_sum without storing them */
        float P[SKV_CANON_LANES];
        for (int i = 0; i < SKV_CANON_LANES; i++) P[i] = 0.0f;
        for (int32_t j = 0; j < n_cand; j++)
            P[j & (SKV_CANON_LANES - 1)] = SKV_ADD(P[j & (SKV_CANON_LANES - 1)], skv_mass_weight(a[j]));
        for (int w = SKV_CANON_LANES / 2; w >= 1; w /= 2)
            for (int i = 0; i < w; i++) P[i] = SKV_ADD(P[i], P[i + w]);
        const float target = SKV_MUL(sp->mass, P[0]);
        /* t_1 .. t_cap best first, their masses in order */
        int32_t *t = scratch + n_cand;
        memcpy(t, sel_idx, (size_t)cap * sizeof *t);
        skv_sort_best_first(a, t, cap);
        float *w = (float *)scratch; /* the top-k scratch is free again */
        for (int32_t i = 0; i < cap; i++) w[i] = skv_mass_weight(a[t[i]]);
        k = skv_mass_count(w, cap, target, sp->floor);
        if (k < cap) { /* keep the winners up to t_k, in increasing index order */
            const int32_t last = t[k - 1];
            int32_t m = 0;
            for (int32_t i = 0; i < cap; i++)
                if (sel_idx[i] == last || skv_before(a, 0, sel_idx[i], last)) sel_idx[m++] = sel_idx[i];
        }
    }
    for (int32_t i = k; i < sp->stride; i++) sel_idx[i] = -1;
    if (sel_ids && candidate_ids)
        for (int32_t i = 0; i < sp->stride; i++) sel_ids[i] = i < k ? candidate_ids[sel_idx[i]] : -1;
    return k;
}

int32_t skv_rescore_head(int32_t G, int32_t D, int32_t c, int32_t W, float scale, const skv_bf16 *q,
                         const skv_bf16 *keys, const skv_select_params *sp, const int32_t *cand_idx,
                         const int32_t *candidate_ids, float *s, float *b, int32_t *scratch, int32_t *local,
                         int32_t *sel_idx, int32_t *sel_ids)
{
    skv_rescore_masses(G, D, c, W, scale, q, keys, s, b);
    /* the rule over the W candidates; its local winners map to candidate indices through cand_idx
       (increasing), so sel_idx comes out in increasing order as skv_select_head's does */
    const int32_t k = skv_select_head(b, W, sp, scratch, local, cand_idx, sel_idx);
    if (sel_ids)
        for (int32_t i = 0; i < sp->stride; i++) sel_ids[i] = i < k ? candidate_ids[sel_idx[i]] : -1;
    return k;
}

size_t skv_rescore_ws_bytes(int32_t W, int32_t c, int32_t S)
{
    if (!W) return 0;
    return SKV_WS_BYTES(sizeof(float) * ((size_t)W * c + W) + sizeof(int32_t) * ((size_t)2 * W + S), 4);
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

/* ---- thread probe ------------------------------------------------------------------------ */

/* n_threads - 1 threads alive at once (what an OpenMP region of n_threads adds to the caller),
   then released and joined. */
typedef struct skv_probe {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int go;
} skv_probe;

static void *skv_probe_wait(void *arg)
{
    skv_probe *p = arg;
    pthread_mutex_lock(&p->mu);
    while (!p->go) pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/*
 * Whether this process can start the n_threads - 1 worker threads that n_threads asks of an
 * OpenMP backend. libgomp ends the process when it cannot create a thread; probing here turns
 * that into a status from create. (A probe, not a guarantee: the resources may change later.)
 */
skv_status skv_probe_threads(int32_t n_threads)
{
    if (n_threads <= 1) return SKV_OK;
    pthread_t *t = malloc((size_t)(n_threads - 1) * sizeof *t);
    if (!t) return skv_fail(NULL, SKV_ERR_OUT_OF_MEMORY, "skv_cache_create: out of memory probing n_threads");
    skv_probe p;
    p.go = 0;
    if (pthread_mutex_init(&p.mu, NULL)) {
        free(t);
        return skv_fail(NULL, SKV_ERR_OUT_OF_MEMORY, "skv_cache_create: pthread_mutex_init failed");
    }
    if (pthread_cond_init(&p.cv, NULL)) {
        pthread_mutex_destroy(&p.mu);
        free(t);
        return skv_fail(NULL, SKV_ERR_OUT_OF_MEMORY, "skv_cache_create: pthread_cond_init failed");
    }
    int32_t started = 0, err = 0;
    while (started < n_threads - 1 && !(err = pthread_create(&t[started], NULL, skv_probe_wait, &p))) started++;
    pthread_mutex_lock(&p.mu);
    p.go = 1;
    pthread_cond_broadcast(&p.cv);
    pthread_mutex_unlock(&p.mu);
    for (int32_t i = 0; i < started; i++) pthread_join(t[i], NULL);
    pthread_cond_destroy(&p.cv);
    pthread_mutex_destroy(&p.mu);
    free(t);
    if (!err) return SKV_OK;
    return skv_fail(NULL, SKV_ERR_OUT_OF_MEMORY,
                    "skv_cache_create: n_threads = %d: this process could start only %d of the %d worker threads "
                    "it needs (pthread_create: %s); lower n_threads (0 = the OpenMP default)",
                    n_threads, started, n_threads - 1, strerror(err));
}
