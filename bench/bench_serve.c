/*
 * bench_serve.c - `skv-bench serve`: the serving load (docs/DESIGN.md 12) as a benchmark.
 *
 * --requests requests arrive at uniform random times over --arrival-s seconds, each with a
 * prompt of --ctx-min..--ctx-max tokens and --steps-min..--steps-max decode steps, at a
 * Llama-3-8B layer shape (Hq 32, Hk 8, D 128, r 160, c 8, budget 2048, O 48, Lc 4) over
 * --layers layers. Two servers run the same requests on the same backend:
 *  - continuous: a cache of --slots slots in the pool mode (a device pool of --slots times
 *    what a --ctx-max prompt takes, skv_seq_bytes, so both servers hold the same memory):
 *    arrived requests are prefilled into free slots (in --piece-token pieces when given,
 *    one piece of every admitted request between two decode steps), the running ones decode
 *    together (skv_decode_active, every layer, then skv_cache_sync: the engine needs the
 *    token), a finished one is released at once;
 *  - static: a cache of --slots slots sized for --ctx-max; the requests batch by batch in
 *    arrival order: a batch starts when its last request has arrived and the previous batch
 *    is done, prefills every request, and decodes all slots until its longest request is done
 *    (skv_decode), as a server without continuous batching does.
 * Prompts: one synthetic prompt of --ctx-max tokens (examples/synth.h), each request takes its
 * prefix; decode inputs: 64 precomputed steps of queries, reused.
 *
 * Reported per server: wall time, requests/s, decode tokens/s, time to first token (arrival to
 * the end of the request's first decode step) and time per output token (its later steps)
 * as p50 and p99 over requests, slot occupancy (mean share of the slots decoding per step,
 * counting in the static server only the requests not yet done), and prefill time.
 *
 *   build/skv-bench serve [--backend cuda] [--layers 4] [--slots 8] [--requests 64]
 *       [--ctx-min 4096] [--ctx-max 32768] [--steps-min 8] [--steps-max 200] [--arrival-s 2]
 *       [--piece-tokens 0] [--reproducible] [--seed 29] [--stream default|high] [--prefill-sms 0] [--json]
 * --stream high: the caches run on a non-blocking stream of the device's greatest priority (what
 * an engine gives its decode stream; the library's prefill streams have the default, least one).
 * --prefill-sms N: config.cuda_prefill_sms = N in every cache (both servers, --beside): the
 * prefill's work beside the decode runs on N of the SMs (a green context; 0: all of them).
 *   build/skv-bench serve --beside [--slots 8] [--layers 4] [--ctx-max 32768] [--requests rounds] [--prefill-sms N]
 *       prefill beside decode: the decode step's time alone and while a prefill runs beside it
 *       (run_beside below)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "synth.h"
#include "testutil.h"
#ifdef SKV_HAVE_CUDA
#include <cuda_runtime.h>
#endif

enum { NQ = 64 };

typedef struct opts {
    skv_backend be;
    int layers, slots, requests, steps_min, steps_max, reproducible, json, beside, high_priority;
    void *stream;        /* cuda: the caches' stream (--stream high: the device's greatest priority) */
    int64_t ctx_min, ctx_max, piece;
    double arrival_s;
    uint64_t seed;
    int prefill_sms;     /* --prefill-sms: config.cuda_prefill_sms of every cache (0: all SMs) */
} opts;

typedef struct request {
    double arrive, first, done; /* seconds from the start */
    int64_t n;
    int steps, taken, slot;
    int64_t piece_pos;          /* tokens prefilled (pieces), per every layer */
} request;

typedef struct result {
    double wall_s, rps, tok_s, ttft_p50, ttft_p99, tpot_p50, tpot_p99, occupancy, prefill_s;
    long decode_steps, tokens, refused; /* refused: admissions the pools deferred */
} result;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* bf16 rows at a byte offset into a buffer */
#define BF(p, off) ((const skv_bf16 *)((const char *)(p) + (off)))

static void die(const char *what, skv_status st, skv_cache *c)
{
    fprintf(stderr, "skv-bench serve: %s failed: %s: %s\n", what, skv_status_string(st),
            c ? skv_cache_last_error(c) : skv_last_error());
    exit(1);
}

static int cmpd(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *x, int n, double p)
{
    if (n <= 0) return 0;
    qsort(x, (size_t)n, sizeof *x, cmpd);
    int i = (int)ceil(p * n) - 1;
    return x[i < 0 ? 0 : i >= n ? n - 1 : i];
}

typedef struct data {
    void *kp, *v;          /* the prompt [ctx_max, Hk, D] in the backend's memory */
    void *q, *k, *vn;      /* NQ steps x slots rows */
    void *out;
    size_t qrow, krow;     /* bytes of one row */
} data;

static skv_config shape(const opts *o)
{
    skv_config c = skv_config_default();
    c.n_layers = o->layers, c.batch_size = o->slots, c.max_prompt_len = o->ctx_max;
    c.gen_capacity = o->steps_max, c.backend = o->be, c.reproducible = o->reproducible;
    c.cuda_stream = o->stream;
    c.cuda_prefill_sms = o->prefill_sms;
    return c;
}

static void make_data(const opts *o, data *d)
{
    skv_config c = shape(o);
    skvs_workload w;
    skvs_seq s;
    skv_status st = skvs_workload_init(&w, &c, o->ctx_max + (o->steps_max > NQ ? o->steps_max : NQ), SKV_BACKEND_CPU);
    if (st) die("workload", st, NULL);
    if ((st = skvs_seq_generate(&s, &w, o->ctx_max, NQ, 0, o->seed))) die("prompt", st, NULL);
    const size_t row = (size_t)c.n_kv_heads * c.head_dim * 2, prompt = (size_t)o->ctx_max * row;
    d->qrow = (size_t)c.n_q_heads * c.head_dim * 2, d->krow = row;
    d->kp = skvt_dbuf(o->be, s.k_pre, prompt), d->v = skvt_dbuf(o->be, s.v, prompt);
    skvt_dput(o->be, d->kp, s.k_pre, prompt), skvt_dput(o->be, d->v, s.v, prompt);
    const size_t nq = (size_t)NQ * o->slots;
    skv_bf16 *q = skvt_xmalloc(nq * d->qrow), *k = skvt_xmalloc(nq * row), *v = skvt_xmalloc(nq * row);
    for (size_t i = 0; i < nq; i++) {
        int32_t needle;
        skvs_step_stream(&s, (int32_t)(i / o->slots), i % o->slots, (skv_bf16 *)((char *)q + i * d->qrow),
                         (skv_bf16 *)((char *)k + i * row), (skv_bf16 *)((char *)v + i * row), &needle);
    }
    d->q = skvt_dbuf(o->be, q, nq * d->qrow), d->k = skvt_dbuf(o->be, k, nq * row), d->vn = skvt_dbuf(o->be, v, nq * row);
    skvt_dput(o->be, d->q, q, nq * d->qrow), skvt_dput(o->be, d->k, k, nq * row), skvt_dput(o->be, d->vn, v, nq * row);
    float *out = skvt_xmalloc((size_t)o->slots * d->qrow * 2);
    d->out = skvt_dbuf(o->be, out, (size_t)o->slots * d->qrow * 2);
    if (o->be != SKV_BACKEND_CUDA) { /* the host arrays are the buffers */
        s.k_pre = s.v = NULL;
    } else {
        free(q), free(k), free(v), free(out);
    }
    skvs_seq_free(&s);
    skvs_workload_free(&w);
}

/* Prefill of request r into slot: one piece (all of it) or the next --piece tokens, every layer;
   SKV_ERR_OUT_OF_MEMORY when the pools cannot hold it now. */
static skv_status prefill(skv_cache *c, const opts *o, const data *d, request *r, int pieces)
{
    const int64_t len = pieces && o->piece ? (o->piece < r->n - r->piece_pos ? o->piece : r->n - r->piece_pos) : r->n;
    for (int l = 0; l < o->layers; l++) {
        const size_t off = (size_t)r->piece_pos * d->krow;
        skv_status st = pieces ? skv_prefill_piece(c, l, r->slot, r->n, r->piece_pos, len, BF(d->kp, off),
                                                   BF(d->v, off), NULL)
                               : skv_prefill(c, l, r->slot, r->n, BF(d->kp, 0), BF(d->v, 0), NULL);
        if (st == SKV_ERR_OUT_OF_MEMORY) return st;
        if (st) die("prefill", st, c);
    }
    r->piece_pos += len;
    return SKV_OK;
}

/* One decode step (every layer) of the listed slots, then the sync an engine needs for the token. */
/* The decode calls of one step (every layer) for the listed sequences (all: skv_decode). */
static void step_calls(skv_cache *c, const opts *o, const data *d, int n, const int32_t *list, long t, int all)
{
    const size_t base = (size_t)(t % NQ) * o->slots;
    for (int l = 0; l < o->layers; l++) {
        skv_status st = all ? skv_decode(c, l, BF(d->q, base * d->qrow), BF(d->k, base * d->krow),
                                         BF(d->vn, base * d->krow), d->out)
                            : skv_decode_active(c, l, n, list, BF(d->q, base * d->qrow), BF(d->k, base * d->krow),
                                                BF(d->vn, base * d->krow), d->out);
        if (st) die("decode", st, c);
    }
}

static void step(skv_cache *c, const opts *o, const data *d, int n, const int32_t *list, long t, int all)
{
    step_calls(c, o, d, n, list, t, all);
    skv_status st = skv_cache_sync(c);
    if (st) die("sync", st, c);
}

/* --beside: one step's time, host wall clock from its first call until its own work is done: on
   cuda the decode stream (the cache's stream; the prefill's streams are non-blocking and not waited
   for), then skv_cache_sync outside the time (it waits for the prefill beside too); elsewhere the
   step with its sync. */
static double timed_step(skv_cache *c, const opts *o, const data *d, int n, const int32_t *list, long t)
{
    const double t0 = now_s();
#ifdef SKV_HAVE_CUDA
    if (o->be == SKV_BACKEND_CUDA) {
        step_calls(c, o, d, n, list, t, 0);
        if (cudaStreamSynchronize((cudaStream_t)o->stream) != cudaSuccess) die("cudaStreamSynchronize", SKV_ERR_DEVICE, c);
        const double dt = now_s() - t0;
        skv_status st = skv_cache_sync(c);
        if (st) die("sync", st, c);
        return dt;
    }
#endif
    step(c, o, d, n, list, t, 0);
    return now_s() - t0;
}

static void summarize(const opts *o, request *rq, double wall, long steps, long tokens, double occ, double pre,
                      result *res)
{
    double *ttft = skvt_xmalloc((size_t)o->requests * sizeof *ttft), *tpot = skvt_xmalloc((size_t)o->requests * sizeof *tpot);
    int nt = 0;
    for (int i = 0; i < o->requests; i++) {
        ttft[i] = rq[i].first - rq[i].arrive;
        if (rq[i].steps > 1) tpot[nt++] = (rq[i].done - rq[i].first) / (rq[i].steps - 1);
    }
    res->wall_s = wall, res->rps = o->requests / wall, res->tok_s = tokens / wall;
    res->ttft_p50 = pct(ttft, o->requests, 0.5), res->ttft_p99 = pct(ttft, o->requests, 0.99);
    res->tpot_p50 = pct(tpot, nt, 0.5), res->tpot_p99 = pct(tpot, nt, 0.99);
    res->occupancy = occ, res->prefill_s = pre, res->decode_steps = steps, res->tokens = tokens;
    free(ttft), free(tpot);
}

static void run_continuous(const opts *o, const data *d, const request *proto, result *res)
{
    skv_config c = shape(o);
    skv_cache *probe = NULL;
    skv_status st;
    { /* the pool: what the slots would hold at ctx_max */
        skv_config p = c;
        p.pool_device_bytes = 1 << 30;
        if ((st = skv_cache_create(&p, &probe))) die("probe create", st, NULL);
        size_t dev, host, stage;
        skv_seq_bytes(probe, o->ctx_max, &dev, &host, &stage);
        skv_cache_free(probe);
        c.pool_device_bytes = (int64_t)((dev + (o->piece ? stage * (size_t)o->layers : 0)) * (size_t)o->slots);
    }
    skv_cache *k = NULL;
    if ((st = skv_cache_create(&c, &k))) die("create", st, NULL);
    request *rq = skvt_xmalloc((size_t)o->requests * sizeof *rq);
    memcpy(rq, proto, (size_t)o->requests * sizeof *rq);
    int *slot_req = skvt_xmalloc((size_t)o->slots * sizeof *slot_req), finished = 0;
    for (int s = 0; s < o->slots; s++) slot_req[s] = -1;
    long steps = 0, tokens = 0, refused = 0;
    double occ = 0, pre = 0;
    const double t0 = now_s();
    while (finished < o->requests) {
        double t = now_s() - t0;
        /* admissions: arrived requests, in arrival order, into free slots while the pool's free bytes
           hold them (skv_seq_bytes; scattered free pages can still refuse one, see below) */
        skv_usage u;
        if ((st = skv_cache_usage(k, &u))) die("usage", st, k);
        size_t free_b = u.device_pool_bytes - u.device_used_bytes;
        for (int i = 0, s = 0; i < o->requests && rq[i].arrive <= t; i++) {
            if (rq[i].slot >= 0 || rq[i].taken == rq[i].steps) continue;
            while (s < o->slots && slot_req[s] >= 0) s++;
            size_t need = 0;
            skv_seq_bytes(k, rq[i].n, &need, NULL, NULL);
            if (s == o->slots || need > free_b) break;
            free_b -= need;
            rq[i].slot = s, slot_req[s] = i;
        }
        /* prefill: whole prompts, or one piece of every request still arriving; a request the pools
           cannot hold yet goes back to the head of the queue (its layers so far released) */
        const double tp = now_s();
        for (int s = 0; s < o->slots; s++) {
            const int i = slot_req[s];
            if (i < 0 || rq[i].piece_pos == rq[i].n) continue;
            if (prefill(k, o, d, &rq[i], o->piece > 0) == SKV_ERR_OUT_OF_MEMORY) {
                skv_seq_release(k, s); /* (SKV_ERR_SEQ_STATE when nothing was kept) */
                rq[i].piece_pos = 0, rq[i].slot = -1, slot_req[s] = -1;
                refused++;
                break;
            }
        }
        pre += now_s() - tp;
        int32_t list[256];
        int n = 0;
        for (int s = 0; s < o->slots; s++)
            if (slot_req[s] >= 0 && rq[slot_req[s]].piece_pos == rq[slot_req[s]].n) list[n++] = s;
        if (!n) { /* nothing to decode: wait for the next arrival */
            int waiting = 0;
            for (int i = 0; i < o->requests && !waiting; i++) waiting = rq[i].slot >= 0;
            double next_t = 1e30;
            for (int i = 0; i < o->requests; i++)
                if (rq[i].slot < 0 && rq[i].taken < rq[i].steps && rq[i].arrive > t && rq[i].arrive < next_t)
                    next_t = rq[i].arrive;
            while (!waiting && next_t < 1e30 && now_s() - t0 < next_t) {
            }
            continue;
        }
        step(k, o, d, n, list, steps, 0);
        steps++;
        occ += (double)n / o->slots;
        t = now_s() - t0;
        for (int j = 0; j < n; j++) {
            request *r = &rq[slot_req[list[j]]];
            if (!r->taken) r->first = t;
            tokens++;
            if (++r->taken == r->steps) {
                r->done = t;
                if ((st = skv_seq_release(k, r->slot))) die("release", st, k);
                slot_req[r->slot] = -1;
                finished++;
            }
        }
    }
    summarize(o, rq, now_s() - t0, steps, tokens, steps ? occ / steps : 0, pre, res);
    res->refused = refused;
    free(rq), free(slot_req);
    skv_cache_free(k);
}

static void run_static(const opts *o, const data *d, const request *proto, result *res)
{
    skv_config c = shape(o);
    skv_cache *k = NULL;
    skv_status st;
    if ((st = skv_cache_create(&c, &k))) die("create", st, NULL);
    request *rq = skvt_xmalloc((size_t)o->requests * sizeof *rq);
    memcpy(rq, proto, (size_t)o->requests * sizeof *rq);
    long steps = 0, tokens = 0;
    double occ = 0, pre = 0;
    const double t0 = now_s();
    for (int b0 = 0; b0 < o->requests; b0 += o->slots) {
        const int nb = o->requests - b0 < o->slots ? o->requests - b0 : o->slots;
        while (now_s() - t0 < rq[b0 + nb - 1].arrive) {
        }
        const double tp = now_s();
        int longest = 0;
        for (int s = 0; s < o->slots; s++) { /* a short batch fills its empty slots with its first request */
            request *r = &rq[b0 + (s < nb ? s : 0)];
            request tmp = *r;
            tmp.slot = s, tmp.piece_pos = 0;
            prefill(k, o, d, &tmp, 0);
            if (s < nb && r->steps > longest) longest = r->steps;
        }
        pre += now_s() - tp;
        for (int t = 0; t < longest; t++) {
            step(k, o, d, o->slots, NULL, steps, 1);
            steps++;
            const double now = now_s() - t0;
            int live = 0;
            for (int s = 0; s < nb; s++) {
                request *r = &rq[b0 + s];
                if (r->taken == r->steps) continue;
                live++;
                if (!r->taken) r->first = now;
                tokens++;
                if (++r->taken == r->steps) r->done = now;
            }
            occ += (double)live / o->slots;
        }
        for (int s = 0; s < o->slots; s++)
            if ((st = skv_seq_release(k, s))) die("release", st, k);
    }
    summarize(o, rq, now_s() - t0, steps, tokens, steps ? occ / steps : 0, pre, res);
    res->refused = 0;
    free(rq);
    skv_cache_free(k);
}

/*
 * --beside: prefill beside decode. slots - 1 sequences of ctx_max tokens decode (the list, every
 * layer, then skv_cache_sync); the last slot is prefilled again and again with a ctx_max prompt,
 * one layer between two decode steps (its factorization and offload then run beside the steps).
 * Reports the median step time alone and while a prefill is in flight (timed_step: host wall clock
 * from the step's first call until the decode stream is done), their ratio, and the host time of
 * the prefill calls.
 */
static int run_beside(const opts *o, const data *d)
{
    skv_config c = shape(o);
    skv_cache *k = NULL;
    skv_status st;
    if ((st = skv_cache_create(&c, &k))) die("create", st, NULL);
    const int nb = o->slots - 1, rounds = o->requests;
    if (nb < 1) die("--beside needs --slots >= 2", SKV_ERR_INVALID_ARGUMENT, NULL);
    int32_t list[256];
    for (int s = 0; s < nb; s++) {
        request r = {0};
        r.n = o->ctx_max, r.slot = s;
        prefill(k, o, d, &r, 0);
        list[s] = s;
    }
    const int n_alone = 4 * o->layers + 20;
    double *alone = skvt_xmalloc((size_t)n_alone * sizeof *alone);
    double *beside = skvt_xmalloc((size_t)rounds * o->layers * sizeof *beside), pre_host = 0;
    long t = 0;
    for (int i = 0; i < 5; i++) step(k, o, d, nb, list, t++, 0); /* warm-up: the graphs */
    for (int i = 0; i < n_alone; i++) alone[i] = timed_step(k, o, d, nb, list, t++);
    int nbs = 0;
    for (int r = 0; r < rounds; r++) {
        if (r) skv_seq_release(k, nb);
        for (int l = 0; l < o->layers; l++) {
            const double tp = now_s();
            skv_status s2 = skv_prefill(k, l, nb, o->ctx_max, BF(d->kp, 0), BF(d->v, 0), NULL);
            if (s2) die("prefill beside", s2, k);
            pre_host += now_s() - tp;
            beside[nbs++] = timed_step(k, o, d, nb, list, t++);
        }
        if (t + 2 * o->layers >= o->steps_max) { /* the decoding sequences' generated capacity */
            for (int s = 0; s < nb; s++) {
                skv_seq_release(k, s);
                request q = {0};
                q.n = o->ctx_max, q.slot = s;
                prefill(k, o, d, &q, 0);
            }
            skv_cache_sync(k);
            t = 0;
        }
    }
    const double a = pct(alone, n_alone, 0.5), b = pct(beside, nbs, 0.5), b99 = pct(beside, nbs, 0.99);
    if (o->json)
        printf("{\"bench\": \"serve-beside\", \"stream\": \"%s\", \"backend\": \"%s\", \"layers\": %d, \"decoding\": %d, \"ctx\": %lld, "
               "\"reproducible\": %d, \"prefill_sms\": %d, \"step_alone_ms\": %.3f, \"step_beside_prefill_ms\": %.3f, "
               "\"step_beside_prefill_p99_ms\": %.3f, \"delay\": %.4f, \"prefill_host_ms_per_layer\": %.3f, "
               "\"steps_alone\": %d, \"steps_beside\": %d}\n",
               o->high_priority ? "high priority" : o->stream ? "caller's" : "legacy default", skv_backend_name(o->be),
               o->layers, nb, (long long)o->ctx_max, o->reproducible, o->prefill_sms, a * 1e3, b * 1e3, b99 * 1e3, b / a - 1,
               pre_host * 1e3 / nbs, n_alone, nbs);
    else
        printf("decode step of %d sequences x %d layers at %lld: alone %.3f ms, beside a prefill %.3f ms (p99 %.3f): "
               "%+.1f%%; prefill calls hold the host %.3f ms per layer; prefill SMs %d (0: all)\n",
               nb, o->layers, (long long)o->ctx_max, a * 1e3, b * 1e3, b99 * 1e3, (b / a - 1) * 100,
               pre_host * 1e3 / nbs, o->prefill_sms);
    free(alone), free(beside);
    skv_cache_free(k);
    return 0;
}

static void print(const char *name, const result *r, int json, int last)
{
    if (json)
        printf("    \"%s\": {\"wall_s\": %.3f, \"requests_per_s\": %.3f, \"decode_tokens_per_s\": %.1f, "
               "\"ttft_p50_ms\": %.2f, \"ttft_p99_ms\": %.2f, \"tpot_p50_ms\": %.3f, \"tpot_p99_ms\": %.3f, "
               "\"slot_occupancy\": %.3f, \"prefill_s\": %.3f, \"decode_steps\": %ld, \"decode_tokens\": %ld, "
               "\"admissions_deferred\": %ld}%s\n",
               name, r->wall_s, r->rps, r->tok_s, r->ttft_p50 * 1e3, r->ttft_p99 * 1e3, r->tpot_p50 * 1e3,
               r->tpot_p99 * 1e3, r->occupancy, r->prefill_s, r->decode_steps, r->tokens, r->refused, last ? "" : ",");
    else
        printf("%-10s %8.2f s %7.2f req/s %9.1f tok/s  TTFT p50 %8.1f p99 %8.1f ms  TPOT p50 %7.2f p99 %7.2f ms  "
               "occupancy %.2f  prefill %.2f s  (%ld steps, %ld tokens)\n",
               name, r->wall_s, r->rps, r->tok_s, r->ttft_p50 * 1e3, r->ttft_p99 * 1e3, r->tpot_p50 * 1e3,
               r->tpot_p99 * 1e3, r->occupancy, r->prefill_s, r->decode_steps, r->tokens);
}

int bench_serve_main(int argc, char **argv)
{
    opts o = {SKV_BACKEND_AUTO, 4, 8, 64, 8, 200, 0, 0, 0, 0, NULL, 4096, 32768, 0, 2.0, 29, 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(a, name) && v && ++i)
        if (OPT("--backend")) {
            if (skv_backend_parse(v, &o.be)) die("--backend", SKV_ERR_INVALID_ARGUMENT, NULL);
        } else if (OPT("--layers")) o.layers = atoi(v);
        else if (OPT("--slots")) o.slots = atoi(v);
        else if (OPT("--requests")) o.requests = atoi(v);
        else if (OPT("--ctx-min")) o.ctx_min = atoll(v);
        else if (OPT("--ctx-max")) o.ctx_max = atoll(v);
        else if (OPT("--steps-min")) o.steps_min = atoi(v);
        else if (OPT("--steps-max")) o.steps_max = atoi(v);
        else if (OPT("--arrival-s")) o.arrival_s = atof(v);
        else if (OPT("--piece-tokens")) o.piece = atoll(v);
        else if (OPT("--seed")) o.seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--reproducible")) o.reproducible = 1;
        else if (!strcmp(a, "--json")) o.json = 1;
        else if (!strcmp(a, "--beside")) o.beside = 1;
        else if (OPT("--stream")) o.high_priority = !strcmp(v, "high");
        else if (OPT("--prefill-sms")) o.prefill_sms = atoi(v);
        else {
            fprintf(stderr, "skv-bench serve: unknown option %s (see the top of bench/bench_serve.c)\n", a);
            return 2;
        }
#undef OPT
    }
    if (o.be == SKV_BACKEND_AUTO) o.be = skv_backend_available(SKV_BACKEND_CUDA) == SKV_OK ? SKV_BACKEND_CUDA : SKV_BACKEND_CPU;
    if (o.slots < 1 || o.slots > 256 || o.requests < 1 || o.layers < 1 || o.ctx_min > o.ctx_max || o.steps_min < 1 ||
        o.steps_min > o.steps_max || o.prefill_sms < 0) {
        fprintf(stderr, "skv-bench serve: inconsistent options\n");
        return 2;
    }
    if (o.high_priority) { /* what an engine gives its decode stream so the prefills beside it yield */
#ifdef SKV_HAVE_CUDA
        int least = 0, greatest = 0;
        cudaStream_t s = NULL;
        if (o.be != SKV_BACKEND_CUDA || cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess ||
            cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest) != cudaSuccess) {
            fprintf(stderr, "skv-bench serve: --stream high needs the cuda backend and a stream of priority %d\n",
                    greatest);
            return 2;
        }
        o.stream = s;
#else
        fprintf(stderr, "skv-bench serve: --stream high needs a build with CUDA\n");
        return 2;
#endif
    }
    skvt_rng r;
    skvt_rng_seed(&r, o.seed);
    request *rq = skvt_xmalloc((size_t)o.requests * sizeof *rq);
    for (int i = 0; i < o.requests; i++) {
        memset(&rq[i], 0, sizeof rq[i]);
        rq[i].arrive = skvt_rng_uniform(&r) * o.arrival_s;
        rq[i].n = skvt_rng_range(&r, o.ctx_min, o.ctx_max);
        rq[i].steps = (int)skvt_rng_range(&r, o.steps_min, o.steps_max);
        rq[i].slot = -1;
    }
    for (int i = 1; i < o.requests; i++) /* arrival order */
        for (int j = i; j > 0 && rq[j].arrive < rq[j - 1].arrive; j--) {
            request t = rq[j];
            rq[j] = rq[j - 1], rq[j - 1] = t;
        }
    fprintf(stderr, "skv-bench serve: %s, %d layers, %d slots, %d requests over %.1f s, prompts %lld..%lld, %d..%d "
                    "steps%s; generating the prompt\n",
            skv_backend_name(o.be), o.layers, o.slots, o.requests, o.arrival_s, (long long)o.ctx_min,
            (long long)o.ctx_max, o.steps_min, o.steps_max, o.reproducible ? ", reproducible" : "");
    data d;
    make_data(&o, &d);
    if (o.beside) return run_beside(&o, &d);
    result cont, stat;
    fprintf(stderr, "skv-bench serve: continuous batching\n");
    run_continuous(&o, &d, rq, &cont);
    fprintf(stderr, "skv-bench serve: static batches\n");
    run_static(&o, &d, rq, &stat);
    if (o.json) {
        printf("{\n  \"bench\": \"serve\", \"backend\": \"%s\", \"layers\": %d, \"slots\": %d, \"requests\": %d, "
               "\"ctx_min\": %lld, \"ctx_max\": %lld, \"steps_min\": %d, \"steps_max\": %d, \"arrival_s\": %.2f, "
               "\"piece_tokens\": %lld, \"reproducible\": %d, \"prefill_sms\": %d, \"seed\": %llu,\n  \"servers\": {\n",
               skv_backend_name(o.be), o.layers, o.slots, o.requests, (long long)o.ctx_min, (long long)o.ctx_max,
               o.steps_min, o.steps_max, o.arrival_s, (long long)o.piece, o.reproducible, o.prefill_sms,
               (unsigned long long)o.seed);
        print("continuous", &cont, 1, 0);
        print("static", &stat, 1, 1);
        printf("  },\n  \"continuous_over_static\": {\"requests_per_s\": %.3f, \"decode_tokens_per_s\": %.3f}\n}\n",
               cont.rps / stat.rps, cont.tok_s / stat.tok_s);
    } else {
        print("continuous", &cont, 0, 0);
        print("static", &stat, 0, 1);
        printf("continuous / static: %.2fx requests/s, %.2fx decode tokens/s\n", cont.rps / stat.rps,
               cont.tok_s / stat.tok_s);
    }
    free(rq);
    return 0;
}
