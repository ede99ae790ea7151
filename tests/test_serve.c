/*
 * test_serve: the serving API (docs/DESIGN.md 12) on every available backend.
 *
 *  - decode_active: each step runs a random subset of the sequences in a random order; every
 *    listed sequence's outputs and selections are bitwise those of a cache that holds that
 *    sequence alone (a solo run), and the unlisted ones do not move;
 *  - release and reuse: a finished sequence is released and its slot prefilled with a new
 *    prompt, again bitwise a solo run;
 *  - prompts in pieces: random splits (empty pieces too) give bitwise the decode of a one-piece
 *    prefill;
 *  - pools: usage follows the prefills and releases exactly (skv_seq_bytes), a prefill that
 *    does not fit is refused with the bytes asked and free and changes nothing, and a pool sized
 *    for one long prompt holds many short ones;
 *  - bad input: a release of a free slot, repeated / free / out-of-range sequences, a layer a
 *    step ahead, pieces out of order or of another length, a pool exhausted mid-prompt: each a
 *    clear status, every other sequence bitwise unchanged (its later steps still equal solo);
 *  - a load test: requests arrive at random times, prompts of mixed lengths in pieces, random
 *    decode lengths, through a cache of fewer slots than requests; every request bitwise equal
 *    to its solo run and the pool whole at the end.
 * Both modes on ref and cpu; cuda (when available) in the reproducible mode, whose outputs do not
 * depend on the batch by construction (its default mode may split work by batch size).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

enum { L = 2, MAXB = 8 };

/* SKV_SERVE_LOAD=large (tests/gpu/run.sh): the load test at a Llama-3-8B layer shape, prompts of
   4k..32k tokens, 8..200 steps, 64 requests through 8 slots; prompts are windows of one base
   prompt (generating 64 of 32k tokens would take minutes). Default: a small shape that runs in
   seconds on 2 cores. */
static int large;
static skv_bf16 *base_k, *base_v;
static int64_t base_len;

typedef struct wl {
    skv_config cfg;     /* the multi-sequence cache's config (batch_size B) */
    skv_backend be;
    int Hq, Hk, D;
    size_t row, hd;     /* Hk*D, Hq*D */
} wl;

/* Deterministic request data: request id, layer, step -> tensors. */
static void req_prompt(const wl *w, uint64_t seed, int64_t n, int layer, skv_bf16 *k, skv_bf16 *v)
{
    if (large) {
        const int64_t off = (int64_t)((seed * 7919ull + (uint64_t)layer * 104729ull) % (uint64_t)(base_len - n + 1));
        memcpy(k, base_k + (size_t)off * w->row, (size_t)n * w->row * 2);
        memcpy(v, base_v + (size_t)off * w->row, (size_t)n * w->row * 2);
        return;
    }
    skvt_rng r;
    skvt_rng_seed(&r, seed * 1000003ull + (uint64_t)layer * 7919ull + 11);
    skvt_lowrank_prompt(&r, w->row, n, k, v);
}

static void req_step(const wl *w, uint64_t seed, int step, int layer, skv_bf16 *q, skv_bf16 *k, skv_bf16 *v)
{
    skvt_rng r;
    skvt_rng_seed(&r, seed * 1000003ull + (uint64_t)(step + 1) * 104729ull + (uint64_t)layer * 7919ull + 5);
    skvt_fill_bf16_normal(&r, q, w->hd, 1.0);
    skvt_fill_bf16_normal(&r, k, w->row, 1.0);
    skvt_fill_bf16_normal(&r, v, w->row, 1.0);
}

/* Device staging for the backend (host arrays themselves on ref/cpu). */
typedef struct io {
    skv_bf16 *hq, *hk, *hv, *kp, *vp; /* host */
    float *hout;
    void *dq, *dk, *dv, *dkp, *dvp, *dout, *dseq;
    size_t nq, nk, np;
} io;

static void io_open(io *b, const wl *w, int64_t max_n)
{
    b->nq = (size_t)MAXB * w->hd, b->nk = (size_t)MAXB * w->row, b->np = (size_t)max_n * w->row;
    b->hq = skvt_xmalloc(b->nq * 2), b->hk = skvt_xmalloc(b->nk * 2), b->hv = skvt_xmalloc(b->nk * 2);
    b->kp = skvt_xmalloc(b->np * 2), b->vp = skvt_xmalloc(b->np * 2), b->hout = skvt_xmalloc(b->nq * 4);
    b->dq = skvt_dbuf(w->be, b->hq, b->nq * 2), b->dk = skvt_dbuf(w->be, b->hk, b->nk * 2);
    b->dv = skvt_dbuf(w->be, b->hv, b->nk * 2), b->dkp = skvt_dbuf(w->be, b->kp, b->np * 2);
    b->dvp = skvt_dbuf(w->be, b->vp, b->np * 2), b->dout = skvt_dbuf(w->be, b->hout, b->nq * 4);
}

static void io_close(io *b, const wl *w)
{
    skvt_dfree(w->be, b->dq, b->hq), skvt_dfree(w->be, b->dk, b->hk), skvt_dfree(w->be, b->dv, b->hv);
    skvt_dfree(w->be, b->dkp, b->kp), skvt_dfree(w->be, b->dvp, b->vp), skvt_dfree(w->be, b->dout, b->hout);
    free(b->hq), free(b->hk), free(b->hv), free(b->kp), free(b->vp), free(b->hout);
}

/* Prefill of all layers of seq with request (seed, n): one piece, or random pieces. */
static skv_status put_prompt(skv_cache *c, const wl *w, io *b, int seq, uint64_t seed, int64_t n, int pieces,
                             skvt_rng *r)
{
    for (int l = 0; l < L; l++) {
        req_prompt(w, seed, n, l, b->kp, b->vp);
        skvt_dput(w->be, b->dkp, b->kp, (size_t)n * w->row * 2);
        skvt_dput(w->be, b->dvp, b->vp, (size_t)n * w->row * 2);
        skv_status st;
        if (!pieces) {
            st = skv_prefill(c, l, seq, n, b->dkp, b->dvp, NULL);
        } else {
            int64_t pos = 0;
            st = SKV_OK;
            while (!st && pos < n) {
                int64_t len = skvt_rng_range(r, 0, 2) == 0 ? 0 : skvt_rng_range(r, 1, n - pos);
                if (skvt_rng_range(r, 0, 3) == 0) len = n - pos;
                const size_t off = (size_t)pos * w->row;
                st = skv_prefill_piece(c, l, seq, n, pos, len, (skv_bf16 *)b->dkp + off, (skv_bf16 *)b->dvp + off,
                                       NULL);
                pos += len;
            }
        }
        if (st) return st;
    }
    return SKV_OK;
}

/* One step (all layers) of the listed sequences; request seeds and step numbers per listed seq.
   out: [L][n][hd] floats (host). */
static skv_status step_list(skv_cache *c, const wl *w, io *b, int n, const int32_t *seqs, const uint64_t *seeds,
                            const int *steps, float *out)
{
    for (int l = 0; l < L; l++) {
        for (int i = 0; i < n; i++)
            req_step(w, seeds[i], steps[i], l, b->hq + (size_t)i * w->hd, b->hk + (size_t)i * w->row,
                     b->hv + (size_t)i * w->row);
        skvt_dput(w->be, b->dq, b->hq, (size_t)n * w->hd * 2);
        skvt_dput(w->be, b->dk, b->hk, (size_t)n * w->row * 2);
        skvt_dput(w->be, b->dv, b->hv, (size_t)n * w->row * 2);
        skv_status st = skv_decode_active(c, l, n, seqs, b->dq, b->dk, b->dv, b->dout);
        if (st) return st;
        if ((st = skv_cache_sync(c))) return st;
        skvt_dget(w->be, out + (size_t)l * n * w->hd, b->dout, (size_t)n * w->hd * 4);
    }
    return SKV_OK;
}

/* The selections of (l, seq) of all layers, flattened ([L][Hk][S] ids then counts); count of ints. */
static int get_sel(skv_cache *c, const wl *w, int seq, int32_t *dst)
{
    skv_seq_info info;
    int k = 0;
    for (int l = 0; l < L; l++) {
        if (skv_cache_seq_info(c, l, seq, &info) || !info.has_selection) continue;
        for (int h = 0; h < w->Hk; h++) {
            skv_cache_selected(c, l, seq, h, dst + k);
            k += info.n_selected;
            skv_cache_selected_count(c, l, seq, h, dst + k);
            k++;
        }
    }
    return k;
}

/* A solo cache: the multi cache's config with one slot and no pool. */
static skv_cache *solo_open(const wl *w)
{
    skv_config s = w->cfg;
    s.batch_size = 1;
    s.pool_device_bytes = s.pool_host_bytes = 0;
    s.pool_page_bytes = 0;
    if (s.value_device_bytes == 0) s.value_device_bytes = SKV_VALUES_ALL_DEVICE;
    skv_cache *c = NULL;
    skv_status st = skv_cache_create(&s, &c);
    if (!SKVT_CHECK(st == SKV_OK, "solo create: %s", skv_last_error())) abort();
    return c;
}

/* A request in flight in the multi cache, with its solo twin. */
typedef struct req {
    uint64_t seed;
    int64_t n;
    int steps, done;     /* decode steps wanted, taken */
    int slot;            /* -1: waiting / finished */
    skv_cache *solo;
} req;

static void shape(wl *w, skv_backend be, int reproducible, int B, int pooled, int values_host)
{
    skv_config c = skv_config_default();
    c.n_layers = L, c.n_q_heads = 4, c.n_kv_heads = 2, c.head_dim = 32, c.rank = 16, c.chunk_size = 4;
    c.budget = 24, c.n_outlier_chunks = 2, c.n_local_chunks = 1, c.batch_size = B, c.max_prompt_len = 640;
    c.gen_capacity = 48, c.rope.theta = 10000.0f, c.backend = be, c.reproducible = reproducible;
    if (large) { /* the library's default Llama-3-8B layer shape */
        skv_config d = skv_config_default();
        c.n_q_heads = d.n_q_heads, c.n_kv_heads = d.n_kv_heads, c.head_dim = d.head_dim, c.rank = d.rank;
        c.chunk_size = d.chunk_size, c.budget = d.budget, c.n_outlier_chunks = d.n_outlier_chunks;
        c.n_local_chunks = d.n_local_chunks, c.rope = d.rope, c.max_prompt_len = 32768, c.gen_capacity = 200;
    }
    if (pooled) {
        c.pool_page_bytes = large ? 0 : 8192;
        c.pool_device_bytes = large ? (int64_t)1 << 30 : 6 << 20;
        if (values_host) c.value_device_bytes = 0, c.pool_host_bytes = large ? (int64_t)1 << 30 : 4 << 20;
    }
    w->cfg = c, w->be = be, w->Hq = c.n_q_heads, w->Hk = c.n_kv_heads, w->D = c.head_dim;
    w->row = (size_t)c.n_kv_heads * c.head_dim, w->hd = (size_t)c.n_q_heads * c.head_dim;
}

/*
 * The load test: n_req requests with random arrival steps, prompt lengths and decode lengths,
 * through a cache of B slots; every request's steps are compared with its solo twin's at once.
 * Also exercises pieces (half the prompts), and an admission that waits while the pool is full.
 */
static void run_load(skv_backend be, int reproducible, int pooled, int values_host, int n_req, uint64_t seed)
{
    wl w;
    shape(&w, be, reproducible, large || n_req >= 64 ? 8 : 4, pooled, values_host);
    char tag[128];
    snprintf(tag, sizeof tag, "%s %s%s%s", skv_backend_name(be), reproducible ? "reproducible" : "default",
             pooled ? " pooled" : "", values_host ? " host values" : "");
    skv_cache *c = NULL;
    if (pooled) { /* pools for two (large: four) of the longest prompts and one staging: admissions wait for memory */
        size_t d, h, stg;
        if (!SKVT_CHECK(skv_cache_create(&w.cfg, &c) == SKV_OK, "%s: create: %s", tag, skv_last_error())) return;
        skv_seq_bytes(c, w.cfg.max_prompt_len, &d, &h, &stg);
        skv_cache_free(c);
        c = NULL;
        const size_t m = large ? 4 : 2; /* the large load: room for four of the longest */
        w.cfg.pool_device_bytes = (int64_t)(m * d + (values_host ? stg : 2 * stg));
        if (values_host) w.cfg.pool_host_bytes = (int64_t)(m * h);
    }
    if (!SKVT_CHECK(skv_cache_create(&w.cfg, &c) == SKV_OK, "%s: create: %s", tag, skv_last_error())) return;
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    io b, bs;
    io_open(&b, &w, w.cfg.max_prompt_len);
    io_open(&bs, &w, w.cfg.max_prompt_len);
    req *rq = calloc((size_t)n_req, sizeof *rq);
    int *arrive = calloc((size_t)n_req, sizeof *arrive);
    for (int i = 0; i < n_req; i++) {
        rq[i].seed = seed * 131 + (uint64_t)i, rq[i].slot = -1;
        rq[i].n = skvt_rng_range(&r, large ? 4096 : 160, w.cfg.max_prompt_len);
        rq[i].steps = (int)skvt_rng_range(&r, large ? 8 : 2, w.cfg.gen_capacity);
        arrive[i] = (int)skvt_rng_range(&r, 0, n_req * 3);
    }
    float *out = skvt_xmalloc((size_t)L * MAXB * w.hd * 4), *sout = skvt_xmalloc((size_t)L * w.hd * 4);
    const size_t n_sel = (size_t)L * w.Hk * (w.cfg.budget / w.cfg.chunk_size + 1); /* get_sel's ints */
    int32_t *sel = skvt_xmalloc(n_sel * 4), *ssel = skvt_xmalloc(n_sel * 4);
    long mism = 0, sel_mism = 0, steps_run = 0, refused = 0, finished = 0;
    int slot_of[MAXB];
    for (int s = 0; s < MAXB; s++) slot_of[s] = -1;
    for (int t = 0; finished < n_req && t < 100000; t++) {
        /* admissions: arrived requests into free slots, while the pool takes them */
        for (int i = 0; i < n_req; i++) {
            if (rq[i].slot >= 0 || rq[i].done || arrive[i] > t) continue;
            int s = 0;
            while (s < w.cfg.batch_size && slot_of[s] >= 0) s++;
            if (s == w.cfg.batch_size) break;
            skv_status st = put_prompt(c, &w, &b, s, rq[i].seed, rq[i].n, (int)(i & 1), &r);
            if (st == SKV_ERR_OUT_OF_MEMORY && pooled) { /* wait for a release; nothing was kept */
                refused++;
                skv_usage u;
                skv_cache_usage(c, &u);
                int32_t any = 0;
                for (int l = 0; l < L; l++) {
                    skv_seq_info si;
                    skv_cache_seq_info(c, l, s, &si);
                    any |= si.prefilled;
                }
                if (any) skv_seq_release(c, s); /* the layers that did fit */
                else if (u.staging_bytes) skv_seq_release(c, s);
                break;
            }
            if (!SKVT_CHECK(st == SKV_OK, "%s: prefill of request %d (n = %lld): %s", tag, i, (long long)rq[i].n,
                            skv_last_error()))
                goto out;
            rq[i].slot = s, slot_of[s] = i;
            rq[i].solo = solo_open(&w);
            st = put_prompt(rq[i].solo, &w, &bs, 0, rq[i].seed, rq[i].n, 0, &r);
            if (!SKVT_CHECK(st == SKV_OK, "%s: solo prefill: %s", tag, skv_last_error())) goto out;
        }
        /* a step of a random subset of the running requests, in random order */
        int32_t seqs[MAXB];
        uint64_t seeds[MAXB];
        int steps[MAXB], ids[MAXB], n = 0;
        for (int s = 0; s < w.cfg.batch_size; s++)
            if (slot_of[s] >= 0 && skvt_rng_range(&r, 0, 4) > 0) ids[n++] = slot_of[s];
        for (int i = n - 1; i > 0; i--) {
            int j = (int)skvt_rng_range(&r, 0, i), x = ids[i];
            ids[i] = ids[j], ids[j] = x;
        }
        for (int i = 0; i < n; i++) seqs[i] = rq[ids[i]].slot, seeds[i] = rq[ids[i]].seed, steps[i] = rq[ids[i]].done;
        if (!n) continue;
        skv_status st = step_list(c, &w, &b, n, seqs, seeds, steps, out);
        if (!SKVT_CHECK(st == SKV_OK, "%s: step %d: %s", tag, t, skv_last_error())) goto out;
        steps_run++;
        for (int i = 0; i < n; i++) {
            req *q = &rq[ids[i]];
            int32_t one = 0;
            st = step_list(q->solo, &w, &bs, 1, &one, &q->seed, &q->done, sout);
            if (!SKVT_CHECK(st == SKV_OK, "%s: solo step: %s", tag, skv_last_error())) goto out;
            for (int l = 0; l < L; l++)
                mism += memcmp(out + ((size_t)l * n + i) * w.hd, sout + (size_t)l * w.hd, w.hd * 4) != 0;
            int k1 = get_sel(c, &w, q->slot, sel), k2 = get_sel(q->solo, &w, 0, ssel);
            sel_mism += k1 != k2 || memcmp(sel, ssel, (size_t)k1 * 4) != 0;
            if (++q->done == q->steps) {
                SKVT_CHECK_STATUS(skv_seq_release(c, q->slot), SKV_OK, "release of a finished request");
                slot_of[q->slot] = -1, q->slot = -1;
                skv_cache_free(q->solo), q->solo = NULL;
                finished++;
            }
        }
    }
    SKVT_CHECK(finished == n_req, "%s: %ld of %d requests finished", tag, finished, n_req);
    SKVT_CHECK(mism == 0, "%s: %ld step outputs differ from the solo runs", tag, mism);
    SKVT_CHECK(sel_mism == 0, "%s: %ld selections differ from the solo runs", tag, sel_mism);
    {
        skv_usage u;
        SKVT_CHECK_STATUS(skv_cache_usage(c, &u), SKV_OK, "usage at the end");
        SKVT_CHECK(u.seqs_in_use == 0 && u.device_used_bytes == 0 && u.host_used_bytes == 0 && u.staging_bytes == 0,
                   "%s: at the end %d sequences in use, %zu device / %zu host / %zu staging bytes held", tag,
                   u.seqs_in_use, u.device_used_bytes, u.host_used_bytes, u.staging_bytes);
        SKVT_CHECK(u.device_largest_free == u.device_pool_bytes, "%s: the device pool is not whole again", tag);
    }
    printf("load %s: %d requests, %ld batched steps, %ld admissions refused for memory; outputs and selections "
           "bitwise equal to solo\n",
           tag, n_req, steps_run, refused);
out:
    for (int i = 0; i < n_req; i++) skv_cache_free(rq[i].solo);
    free(rq), free(arrive), free(out), free(sout), free(sel), free(ssel);
    io_close(&b, &w), io_close(&bs, &w);
    skv_cache_free(c);
}

/* The state a bad call must leave alone: info and selections of every sequence. */
static size_t state_of(skv_cache *c, const wl *w, int32_t *dst)
{
    size_t k = 0;
    for (int s = 0; s < w->cfg.batch_size; s++) {
        for (int l = 0; l < L; l++) {
            skv_seq_info si;
            memset(&si, 0, sizeof si);
            skv_cache_seq_info(c, l, s, &si);
            dst[k++] = si.prefilled, dst[k++] = (int32_t)si.n, dst[k++] = si.n_generated, dst[k++] = si.has_selection;
        }
        k += (size_t)get_sel(c, w, s, dst + k);
    }
    return k;
}

static void run_bad(skv_backend be, uint64_t seed)
{
    wl w;
    shape(&w, be, 1, 3, 1, 0);
    skv_cache *c = NULL;
    { /* a pool for sequences of 600 and 300 tokens, a 400-token prompt's staging, and one page short of a
         600-token prompt's staging: the pool runs out at layer 1 of the third sequence */
        size_t d600, d300, s400, s600;
        if (!SKVT_CHECK(skv_cache_create(&w.cfg, &c) == SKV_OK, "bad: create: %s", skv_last_error())) return;
        skv_seq_bytes(c, 600, &d600, NULL, &s600);
        skv_seq_bytes(c, 300, &d300, NULL, NULL);
        skv_seq_bytes(c, 400, NULL, NULL, &s400);
        skv_cache_free(c);
        c = NULL;
        w.cfg.pool_device_bytes = (int64_t)(d600 + d300 + s400 + s600 - (size_t)w.cfg.pool_page_bytes);
    }
    if (!SKVT_CHECK(skv_cache_create(&w.cfg, &c) == SKV_OK, "bad: create: %s", skv_last_error())) return;
    const char *bn = skv_backend_name(be);
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    io b;
    io_open(&b, &w, w.cfg.max_prompt_len);
    int32_t *st0 = skvt_xmalloc(1 << 16), *st1 = skvt_xmalloc(1 << 16);
    float *out = skvt_xmalloc((size_t)L * MAXB * w.hd * 4);
    SKVT_CHECK_STATUS(skv_seq_release(c, 0), SKV_ERR_SEQ_STATE, "release of a free slot");
    SKVT_CHECK_STATUS(skv_seq_release(c, 3), SKV_ERR_INVALID_ARGUMENT, "release out of range");
    SKVT_CHECK_STATUS(put_prompt(c, &w, &b, 0, 1, 600, 0, &r), SKV_OK, "prefill 0");
    SKVT_CHECK_STATUS(put_prompt(c, &w, &b, 1, 2, 300, 1, &r), SKV_OK, "prefill 1 in pieces");
    int32_t two[2] = {0, 1};
    uint64_t seeds[2] = {1, 2};
    int steps[2] = {0, 0};
    SKVT_CHECK_STATUS(step_list(c, &w, &b, 2, two, seeds, steps, out), SKV_OK, "a good step");
    size_t n0 = state_of(c, &w, st0);
    struct {
        int n;
        int32_t s[3];
        skv_status want;
        const char *what;
    } lists[] = {{2, {0, 0}, SKV_ERR_INVALID_ARGUMENT, "a repeated sequence"},
                 {2, {1, 2}, SKV_ERR_NOT_PREFILLED, "a free sequence"},
                 {1, {3}, SKV_ERR_INVALID_ARGUMENT, "an out-of-range sequence"},
                 {1, {-1}, SKV_ERR_INVALID_ARGUMENT, "a negative sequence"},
                 {4, {0, 1, 2}, SKV_ERR_INVALID_ARGUMENT, "n_active above batch_size"},
                 {-1, {0}, SKV_ERR_INVALID_ARGUMENT, "a negative n_active"}};
    for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
        skv_status st = skv_decode_active(c, 0, lists[i].n, lists[i].s, b.dq, b.dk, b.dv, b.dout);
        char what[96];
        snprintf(what, sizeof what, "%s: decode_active with %s", bn, lists[i].what);
        SKVT_CHECK_STATUS(st, lists[i].want, what);
        size_t n1 = state_of(c, &w, st1);
        SKVT_CHECK(n1 == n0 && !memcmp(st0, st1, n0 * 4), "%s changed a sequence's state", what);
    }
    /* a layer a step ahead: layer 0 of sequence 0 twice (its step 1) */
    for (int l = 0; l < L; l++) { /* rows of both layers' step 1 inputs, layer l at row l */
        req_step(&w, 1, 1, l, b.hq + (size_t)l * w.hd, b.hk + (size_t)l * w.row, b.hv + (size_t)l * w.row);
    }
    skvt_dput(be, b.dq, b.hq, 2 * w.hd * 2), skvt_dput(be, b.dk, b.hk, 2 * w.row * 2);
    skvt_dput(be, b.dv, b.hv, 2 * w.row * 2);
    SKVT_CHECK_STATUS(skv_decode_active(c, 0, 1, two, b.dq, b.dk, b.dv, b.dout), SKV_OK, "layer 0 of seq 0");
    skv_status st = skv_decode_active(c, 0, 1, two, b.dq, b.dk, b.dv, b.dout);
    SKVT_CHECK_STATUS(st, SKV_ERR_INVALID_ARGUMENT, "layer 0 twice");
    SKVT_CHECK(strstr(skv_cache_last_error(c), "layer = 0") && strstr(skv_cache_last_error(c), "sequence 0"),
               "the message names the layer and the sequence: %s", skv_cache_last_error(c));
    SKVT_CHECK_STATUS(skv_decode_active(c, 1, 1, two, (skv_bf16 *)b.dq + w.hd, (skv_bf16 *)b.dk + w.row,
                                        (skv_bf16 *)b.dv + w.row, b.dout),
                      SKV_OK, "layer 1 catches up");
    SKVT_CHECK_STATUS(skv_cache_sync(c), SKV_OK, "sync");
    n0 = state_of(c, &w, st0);
    /* pieces out of order, of another length, k_post changing, n past the end */
    req_prompt(&w, 3, 400, 0, b.kp, b.vp);
    skvt_dput(be, b.dkp, b.kp, 400 * w.row * 2), skvt_dput(be, b.dvp, b.vp, 400 * w.row * 2);
    SKVT_CHECK_STATUS(skv_prefill_piece(c, 0, 2, 400, 100, 50, b.dkp, b.dvp, NULL), SKV_ERR_SEQ_STATE,
                      "a first piece at pos0 100");
    SKVT_CHECK_STATUS(skv_prefill_piece(c, 0, 2, 400, 0, 100, b.dkp, b.dvp, NULL), SKV_OK, "piece 1");
    SKVT_CHECK_STATUS(skv_prefill_piece(c, 0, 2, 400, 150, 50, b.dkp, b.dvp, NULL), SKV_ERR_SEQ_STATE,
                      "a piece past a gap");
    SKVT_CHECK_STATUS(skv_prefill_piece(c, 0, 2, 401, 100, 50, b.dkp, b.dvp, NULL), SKV_ERR_SEQ_STATE,
                      "a piece of another n_total");
    SKVT_CHECK_STATUS(skv_prefill_piece(c, 0, 2, 400, 100, 50, b.dkp, b.dvp, b.dkp), SKV_ERR_SEQ_STATE,
                      "a piece that brings k_post now");
    SKVT_CHECK_STATUS(skv_prefill_piece(c, 0, 2, 400, 100, 301, b.dkp, b.dvp, NULL), SKV_ERR_INVALID_ARGUMENT,
                      "a piece past the end");
    SKVT_CHECK_STATUS(skv_prefill(c, 0, 2, 400, b.dkp, b.dvp, NULL), SKV_ERR_SEQ_STATE,
                      "a whole prefill over a prompt arriving in pieces");
    SKVT_CHECK_STATUS(skv_prefill_piece(c, 0, 0, 400, 0, 100, b.dkp, b.dvp, NULL), SKV_ERR_ALREADY_PREFILLED,
                      "a piece into a prefilled slot");
    {
        int32_t two_ = 2;
        SKVT_CHECK_STATUS(skv_decode_active(c, 0, 1, &two_, b.dq, b.dk, b.dv, b.dout), SKV_ERR_NOT_PREFILLED,
                          "decode of a prompt still arriving");
    }
    /* the pool exhausted mid-prompt: sequence 2's layer 1 staging does not fit beside its layer 0 */
    {
        skv_status s2 = SKV_OK;
        int64_t n_big = 600;
        req_prompt(&w, 4, n_big, 1, b.kp, b.vp);
        skvt_dput(be, b.dkp, b.kp, (size_t)n_big * w.row * 2), skvt_dput(be, b.dvp, b.vp, (size_t)n_big * w.row * 2);
        s2 = skv_prefill_piece(c, 1, 2, n_big, 0, 10, b.dkp, b.dvp, NULL);
        SKVT_CHECK_STATUS(s2, SKV_ERR_OUT_OF_MEMORY, "a pool exhausted mid-prompt");
        SKVT_CHECK(strstr(skv_cache_last_error(c), "bytes asked") && strstr(skv_cache_last_error(c), "bytes free"),
                   "the message gives the bytes asked and free: %s", skv_cache_last_error(c));
        printf("%s: pool refusal: %s\n", bn, skv_cache_last_error(c));
    }
    size_t n1 = state_of(c, &w, st1);
    SKVT_CHECK(n1 == n0 && !memcmp(st0, st1, n0 * 4), "%s: the bad pieces changed another sequence's state", bn);
    SKVT_CHECK_STATUS(skv_seq_release(c, 2), SKV_OK, "release of a sequence mid-prompt");
    SKVT_CHECK_STATUS(skv_seq_release(c, 2), SKV_ERR_SEQ_STATE, "a second release");
    n1 = state_of(c, &w, st1);
    SKVT_CHECK(n1 == n0 && !memcmp(st0, st1, n0 * 4), "%s: releasing sequence 2 changed another sequence", bn);
    /* the survivors still decode like their solo runs */
    {
        skv_cache *s0 = solo_open(&w), *s1 = solo_open(&w);
        io bs;
        io_open(&bs, &w, w.cfg.max_prompt_len);
        put_prompt(s0, &w, &bs, 0, 1, 600, 0, &r);
        put_prompt(s1, &w, &bs, 0, 2, 300, 0, &r);
        float *so = skvt_xmalloc((size_t)L * w.hd * 4);
        int32_t one = 0;
        uint64_t sd0 = 1, sd1 = 2;
        int t0 = 0, t1 = 1;
        step_list(s0, &w, &bs, 1, &one, &sd0, &t0, so); /* the survivors' steps so far: 0 and 1 of sequence 0 */
        step_list(s0, &w, &bs, 1, &one, &sd0, &t1, so);
        step_list(s1, &w, &bs, 1, &one, &sd1, &t0, so); /* and 0 of sequence 1 */
        for (int t = 0; t < 3; t++) {
            int st_[2] = {t + 1, t + 2};
            int32_t rev[2] = {1, 0};
            uint64_t sd[2] = {2, 1};
            SKVT_CHECK_STATUS(step_list(c, &w, &b, 2, rev, sd, st_, out), SKV_OK, "survivors' step");
            step_list(s1, &w, &bs, 1, &one, &sd[0], &st_[0], so);
            int ok = 1;
            for (int l = 0; l < L; l++) ok &= !memcmp(out + (size_t)l * 2 * w.hd, so + (size_t)l * w.hd, w.hd * 4);
            step_list(s0, &w, &bs, 1, &one, &sd[1], &st_[1], so);
            for (int l = 0; l < L; l++)
                ok &= !memcmp(out + ((size_t)l * 2 + 1) * w.hd, so + (size_t)l * w.hd, w.hd * 4);
            SKVT_CHECK(ok, "%s: after the bad calls, step %d of the survivors differs from their solo runs", bn, t);
        }
        free(so);
        io_close(&bs, &w);
        skv_cache_free(s0), skv_cache_free(s1);
    }
    free(st0), free(st1), free(out);
    io_close(&b, &w);
    skv_cache_free(c);
}

/* Pool bookkeeping: usage equals skv_seq_bytes; a pool sized for one long prompt holds many short ones. */
static void run_pool(skv_backend be, uint64_t seed)
{
    wl w;
    shape(&w, be, 0, MAXB, 1, 1);
    skv_config one = w.cfg;
    one.pool_device_bytes = one.pool_host_bytes = 0, one.pool_page_bytes = 0, one.value_device_bytes = 0;
    one.batch_size = 1;
    skv_cache *probe = NULL;
    skv_status st = skv_cache_create(&w.cfg, &probe);
    if (!SKVT_CHECK(st == SKV_OK, "pool: create: %s", skv_last_error())) return;
    size_t d_long, h_long, d_short, h_short;
    skv_seq_bytes(probe, 640, &d_long, &h_long, NULL);
    skv_seq_bytes(probe, 104, &d_short, &h_short, NULL);
    skv_cache_free(probe);
    /* a pool of exactly the long prompt's pages */
    w.cfg.pool_device_bytes = (int64_t)d_long, w.cfg.pool_host_bytes = (int64_t)h_long;
    skv_cache *c = NULL;
    if (!SKVT_CHECK(skv_cache_create(&w.cfg, &c) == SKV_OK, "pool: create: %s", skv_last_error())) return;
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    io b;
    io_open(&b, &w, w.cfg.max_prompt_len);
    skv_usage u;
    SKVT_CHECK_STATUS(skv_cache_usage(c, &u), SKV_OK, "usage");
    SKVT_CHECK(u.pooled == 1 && u.device_pool_bytes == d_long && u.device_used_bytes == 0 && u.seqs_free == MAXB,
               "%s: fresh pool: %zu of %zu bytes used, %d free", skv_backend_name(be), u.device_used_bytes,
               u.device_pool_bytes, u.seqs_free);
    SKVT_CHECK_STATUS(put_prompt(c, &w, &b, 2, 9, 640, 0, &r), SKV_OK, "the long prompt");
    skv_cache_usage(c, &u);
    SKVT_CHECK(u.device_used_bytes == d_long && u.host_used_bytes == h_long && u.seqs_in_use == 1,
               "%s: after the long prompt: %zu / %zu used, want %zu / %zu", skv_backend_name(be), u.device_used_bytes,
               u.host_used_bytes, d_long, h_long);
    SKVT_CHECK_STATUS(put_prompt(c, &w, &b, 3, 10, 104, 0, &r), SKV_ERR_OUT_OF_MEMORY, "a second prompt into a full pool");
    skv_cache_usage(c, &u);
    SKVT_CHECK(u.device_used_bytes == d_long && u.seqs_in_use == 1, "%s: a refused prefill kept memory",
               skv_backend_name(be));
    SKVT_CHECK_STATUS(skv_seq_release(c, 2), SKV_OK, "release the long prompt");
    int fit = (int)(d_long / d_short) < MAXB ? (int)(d_long / d_short) : MAXB;
    if (h_short) fit = (int)(h_long / h_short) < fit ? (int)(h_long / h_short) : fit;
    int got = 0;
    for (int s = 0; s < MAXB; s++) {
        if (put_prompt(c, &w, &b, s, 20 + s, 104, 0, &r) != SKV_OK) break;
        got++;
    }
    SKVT_CHECK(got == fit && got >= 4, "%s: the long prompt's pool held %d short prompts, want %d (>= 4)",
               skv_backend_name(be), got, fit);
    skv_cache_usage(c, &u);
    SKVT_CHECK(u.device_used_bytes == (size_t)got * d_short, "%s: %d short prompts use %zu bytes, want %zu",
               skv_backend_name(be), got, u.device_used_bytes, (size_t)got * d_short);
    for (int s = 0; s < got; s++) skv_seq_release(c, s);
    skv_cache_usage(c, &u);
    SKVT_CHECK(u.device_used_bytes == 0 && u.host_used_bytes == 0 && u.device_largest_free == u.device_pool_bytes,
               "%s: pool not whole after the releases", skv_backend_name(be));
    printf("%s pool: one %lld-token prompt takes %zu device + %zu host bytes; a %lld-token one %zu + %zu; the long "
           "prompt's pool holds %d short ones\n",
           skv_backend_name(be), 640ll, d_long, h_long, 104ll, d_short, h_short, got);
    io_close(&b, &w);
    skv_cache_free(c);
}

int main(void)
{
    const uint64_t seed = skvt_base_seed("test_serve");
    const char *load = getenv("SKV_SERVE_LOAD");
    large = load && !strcmp(load, "large");
    if (large) { /* one base prompt at the large shape; requests take windows of it */
        wl w;
        shape(&w, SKV_BACKEND_REF, 0, 8, 0, 0);
        base_len = 2 * w.cfg.max_prompt_len;
        base_k = skvt_xmalloc((size_t)base_len * w.row * 2), base_v = skvt_xmalloc((size_t)base_len * w.row * 2);
        skvt_rng r;
        skvt_rng_seed(&r, seed ^ 0xba5eull);
        skvt_lowrank_prompt(&r, w.row, base_len, base_k, base_v);
        printf("test_serve: the large load (SKV_SERVE_LOAD=large): 64 requests, prompts 4096..32768, 8..200 steps, 8 "
               "slots\n");
    }
    const skv_backend all[3] = {SKV_BACKEND_REF, SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
    for (int i = 0; i < 3; i++) {
        if (skv_backend_available(all[i]) != SKV_OK) {
            skvt_skip(skv_backend_name(all[i]));
            continue;
        }
        const int cuda = all[i] == SKV_BACKEND_CUDA;
        if (large) { /* the load alone: on cuda in the reproducible mode, pooled, values on the device and on the host */
            if (!cuda) continue;
            run_load(all[i], 1, 1, 0, 64, seed + 21);
            run_load(all[i], 1, 1, 1, 64, seed + 31);
            continue;
        }
        run_bad(all[i], seed + 1);
        run_pool(all[i], seed + 2);
        for (int rep = cuda; rep < 2; rep++) { /* 64 requests through 8 slots once per mode, smaller runs beside */
            run_load(all[i], rep, 0, 0, 12, seed + 10 + (uint64_t)rep);
            run_load(all[i], rep, 1, 0, 64, seed + 20 + (uint64_t)rep);
            run_load(all[i], rep, 1, 1, 12, seed + 30 + (uint64_t)rep);
        }
    }
    return skvt_finish();
}
