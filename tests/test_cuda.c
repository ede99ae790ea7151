/*
 * test_cuda.c - the cuda backend as a user sees it.
 *
 * Without a usable GPU (or without the CUDA plugin): asking for cuda gives
 * SKV_ERR_NO_DEVICE with a clear message everywhere (create, the environment
 * override, op-level calls, buffers), auto falls back to cpu, and the memory
 * query of a cuda config still works.
 *
 * With a GPU (built with SKV_HAVE_CUDA):
 *  - placement: device tensors, a caller stream (non-blocking) and the legacy
 *    default stream give bitwise the same results;
 *  - a decode step captured into a CUDA graph in global capture mode (which
 *    refuses any synchronization or cudaMalloc inside it) and launched once
 *    equals the same step run directly, bitwise, and the device-side state it
 *    advanced gives the same next step;
 *  - no device memory is allocated across decode steps (cudaMemGetInfo);
 *  - NaN/Inf in decode inputs: skv_decode returns SKV_OK, skv_cache_sync
 *    reports SKV_ERR_NONFINITE naming the element, the step changed nothing
 *    (twin cache comparison), and the cache stays usable.
 *  - all of that again with SKV_SELECT_MASS and the rescoring (config.select_candidates
 *    = 24 of S = 8, docs/DESIGN.md 4.5.1): its extra kernels are captured, allocate
 *    nothing and keep a bad step's state unchanged too.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#ifdef SKV_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

static skv_config small_config(void)
{
    skv_config c = skv_config_default();
    c.n_layers = 2;
    c.batch_size = 2;
    c.n_q_heads = 8;
    c.n_kv_heads = 2;
    c.head_dim = 128;
    c.rank = 32;
    c.chunk_size = 8;
    c.budget = 64;
    c.n_outlier_chunks = 4;
    c.n_local_chunks = 2;
    c.max_prompt_len = 2048;
    c.gen_capacity = 16;
    return c;
}

static void test_no_device(skv_status avail)
{
    char msg[600];
    SKVT_CHECK_STATUS(avail, SKV_ERR_NO_DEVICE, "skv_backend_available(cuda)");
    snprintf(msg, sizeof msg, "%s", skv_last_error());
    printf("cuda unavailable: %s\n", msg);
#ifdef SKV_HAVE_CUDA
    SKVT_CHECK(strstr(msg, "CUDA device") != NULL, "message should say no usable CUDA device: \"%s\"", msg);
#else
    /* a build without nvcc has no plugin: the loader says which file it could not open */
    SKVT_CHECK(strstr(msg, "libshadowkv-cuda.so.0") != NULL && strstr(msg, "could not be loaded") != NULL,
               "message should say the CUDA plugin could not be loaded: \"%s\"", msg);
#endif
    skv_config c = small_config();
    c.backend = SKV_BACKEND_CUDA;
    skv_cache *cache = (skv_cache *)&c; /* must be reset to NULL */
    SKVT_CHECK_STATUS(skv_cache_create(&c, &cache), SKV_ERR_NO_DEVICE, "create(cuda)");
    SKVT_CHECK(cache == NULL, "create(cuda) failed but *out is not NULL");
    SKVT_CHECK(strlen(skv_last_error()) > 10, "create(cuda): empty message");

    size_t dev = 0, host = 0;
    SKVT_CHECK_STATUS(skv_cache_memory(&c, &dev, &host), SKV_OK, "skv_cache_memory(cuda) without a device");
    SKVT_CHECK(dev > 0 && host == 0, "skv_cache_memory(cuda), values on the device: %zu device, %zu host bytes", dev,
               host);
    skv_memory_info mi;
    SKVT_CHECK_STATUS(skv_cache_memory_info(&c, &mi), SKV_OK, "skv_cache_memory_info(cuda) without a device");
    c.value_device_bytes = (int64_t)(mi.host_value_slots + mi.device_value_slots) * (int64_t)mi.value_cache_bytes;
    SKVT_CHECK_STATUS(skv_cache_memory(&c, &dev, &host), SKV_OK, "skv_cache_memory(cuda) values on the host");
    SKVT_CHECK(dev > 0 && host > 0, "skv_cache_memory(cuda), values on the host: %zu device, %zu host bytes", dev,
               host);
    c.value_device_bytes = SKV_VALUES_ALL_DEVICE;

    c.backend = SKV_BACKEND_AUTO;
    SKVT_CHECK_STATUS(skv_cache_create(&c, &cache), SKV_OK, "create(auto)");
    if (cache) SKVT_CHECK(skv_cache_backend(cache) == SKV_BACKEND_CPU, "auto resolved to %s, want cpu",
                          skv_backend_name(skv_cache_backend(cache)));
    skv_cache_free(cache);

    /* the environment picks for auto only: an explicit backend wins over it */
    setenv("SKV_BACKEND", "cuda", 1);
    c.backend = SKV_BACKEND_AUTO;
    cache = NULL;
    SKVT_CHECK_STATUS(skv_cache_create(&c, &cache), SKV_ERR_NO_DEVICE, "create(auto) with SKV_BACKEND=cuda");
    skv_cache_free(cache);
    c.backend = SKV_BACKEND_REF;
    cache = NULL;
    SKVT_CHECK_STATUS(skv_cache_create(&c, &cache), SKV_OK, "create(ref) with SKV_BACKEND=cuda");
    if (cache) SKVT_CHECK(skv_cache_backend(cache) == SKV_BACKEND_REF, "explicit ref with SKV_BACKEND=cuda ran on %s",
                          skv_backend_name(skv_cache_backend(cache)));
    unsetenv("SKV_BACKEND");
    skv_cache_free(cache);

    void *p = (void *)&c;
    SKVT_CHECK_STATUS(skv_buffer_alloc(SKV_BACKEND_CUDA, 64, &p), SKV_ERR_NO_DEVICE, "skv_buffer_alloc(cuda)");
    SKVT_CHECK(p == NULL, "skv_buffer_alloc failed but *ptr is not NULL");
    skv_bf16 a[64] = {0};
    float u[64], w[64];
    SKVT_CHECK_STATUS(skv_op_factorize(SKV_BACKEND_CUDA, 8, 8, 2, a, u, w), SKV_ERR_NO_DEVICE, "skv_op_factorize(cuda)");
}

#ifdef SKV_HAVE_CUDA

#define CU(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (!SKVT_CHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_))) return;       \
    } while (0)

typedef struct {
    skv_config cfg;
    int64_t n[2];
    size_t row, qn, kn;
    /* host prompts of every (layer, seq) and the device staging buffers */
    skv_bf16 *k[2][2], *v[2][2];
    skv_bf16 *dk, *dv, *dq, *dkn, *dvn;
    float *dout;
} world;


static skv_cache *make_cache(world *wd, void *stream)
{
    skv_config c = wd->cfg;
    c.backend = SKV_BACKEND_CUDA;
    c.cuda_stream = stream;
    skv_cache *cache = NULL;
    skv_status st = skv_cache_create(&c, &cache);
    if (!SKVT_CHECK_STATUS(st, SKV_OK, "create(cuda)")) {
        printf("  %s\n", skv_last_error());
        return NULL;
    }
    for (int l = 0; l < c.n_layers; l++)
        for (int b = 0; b < c.batch_size; b++) {
            skv_buffer_copy(SKV_BACKEND_CUDA, wd->dk, wd->k[l][b], (size_t)wd->n[b] * wd->row * 2);
            skv_buffer_copy(SKV_BACKEND_CUDA, wd->dv, wd->v[l][b], (size_t)wd->n[b] * wd->row * 2);
            st = skv_prefill(cache, l, b, wd->n[b], wd->dk, wd->dv, NULL);
            if (!SKVT_CHECK_STATUS(st, SKV_OK, "prefill(cuda)")) printf("  %s\n", skv_cache_last_error(cache));
        }
    return cache;
}

/* One step's inputs on the host, staged to the device. */
static void stage_step(world *wd, skvt_rng *r, skv_bf16 *q, skv_bf16 *kn, skv_bf16 *vn)
{
    skvt_fill_bf16_normal(r, q, wd->qn, 1.0);
    skvt_fill_bf16_normal(r, kn, wd->kn, 1.0);
    skvt_fill_bf16_normal(r, vn, wd->kn, 1.0);
    skv_buffer_copy(SKV_BACKEND_CUDA, wd->dq, q, wd->qn * 2);
    skv_buffer_copy(SKV_BACKEND_CUDA, wd->dkn, kn, wd->kn * 2);
    skv_buffer_copy(SKV_BACKEND_CUDA, wd->dvn, vn, wd->kn * 2);
}

/* decode + sync + fetch the output */
static skv_status step(world *wd, skv_cache *c, int layer, float *out)
{
    skv_status st = skv_decode(c, layer, wd->dq, wd->dkn, wd->dvn, wd->dout);
    if (st == SKV_OK) st = skv_cache_sync(c);
    if (st == SKV_OK) st = skv_buffer_copy(SKV_BACKEND_CUDA, out, wd->dout, wd->qn * 4);
    return st;
}

/* selections and generated counts of every (layer, seq, head) equal in a and b */
static int same_state(world *wd, skv_cache *a, skv_cache *b, const char *what)
{
    int32_t sa[64], sb[64];
    int ok = 1;
    for (int l = 0; l < wd->cfg.n_layers; l++)
        for (int s = 0; s < wd->cfg.batch_size; s++) {
            skv_seq_info ia, ib;
            skv_cache_seq_info(a, l, s, &ia);
            skv_cache_seq_info(b, l, s, &ib);
            ok &= ia.n_generated == ib.n_generated && ia.has_selection == ib.has_selection;
            if (!ia.has_selection || !ib.has_selection) continue;
            for (int h = 0; h < wd->cfg.n_kv_heads; h++) {
                ok &= skv_cache_selected(a, l, s, h, sa) == SKV_OK && skv_cache_selected(b, l, s, h, sb) == SKV_OK;
                ok &= memcmp(sa, sb, (size_t)ia.n_selected * 4) == 0;
            }
        }
    return SKVT_CHECK(ok, "%s: the twin caches' generated counts or selections differ", what);
}

/* prefill results of every (layer, seq, head) equal in a and b: outliers, candidates, landmarks */
static int same_prefill(world *wd, skv_cache *a, skv_cache *b, const char *what)
{
    int ok = 1;
    int32_t *ia = malloc(4096 * 4), *ib = malloc(4096 * 4);
    skv_bf16 *la = malloc((size_t)4096 * 128 * 2), *lb = malloc((size_t)4096 * 128 * 2);
    for (int l = 0; l < wd->cfg.n_layers; l++)
        for (int s = 0; s < wd->cfg.batch_size; s++) {
            skv_seq_info info;
            skv_cache_seq_info(a, l, s, &info);
            for (int h = 0; h < wd->cfg.n_kv_heads; h++) {
                int same_o = skv_cache_outliers(a, l, s, h, ia) == SKV_OK && skv_cache_outliers(b, l, s, h, ib) == SKV_OK &&
                             !memcmp(ia, ib, (size_t)info.n_outliers * 4);
                int same_c = skv_cache_candidates(a, l, s, h, ia) == SKV_OK &&
                             skv_cache_candidates(b, l, s, h, ib) == SKV_OK && !memcmp(ia, ib, (size_t)info.n_candidates * 4);
                int same_l = skv_cache_landmarks(a, l, s, h, la) == SKV_OK && skv_cache_landmarks(b, l, s, h, lb) == SKV_OK &&
                             !memcmp(la, lb, (size_t)info.n_candidates * wd->cfg.head_dim * 2);
                ok &= SKVT_CHECK(same_o && same_c && same_l, "%s: layer %d seq %d head %d: outliers %s, candidates %s, "
                                 "landmarks %s", what, l, s, h, same_o ? "equal" : "DIFFER", same_c ? "equal" : "DIFFER",
                                 same_l ? "equal" : "DIFFER");
            }
        }
    free(ia), free(ib), free(la), free(lb);
    return ok;
}

/* rescore: SKV_SELECT_MASS with the rescoring of select_candidates = 24 (S = 8) */
static void test_gpu(uint64_t seed, int rescore)
{
    world wd;
    memset(&wd, 0, sizeof wd);
    wd.cfg = small_config();
    if (rescore) {
        wd.cfg.select_mode = SKV_SELECT_MASS;
        wd.cfg.select_mass = 0.8f;
        wd.cfg.select_candidates = 24;
        printf("SKV_SELECT_MASS with select_candidates = 24\n");
    }
    wd.n[0] = 1500;
    wd.n[1] = 1931;
    wd.row = (size_t)wd.cfg.n_kv_heads * wd.cfg.head_dim;
    wd.qn = (size_t)wd.cfg.batch_size * wd.cfg.n_q_heads * wd.cfg.head_dim;
    wd.kn = (size_t)wd.cfg.batch_size * wd.row;
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    for (int l = 0; l < 2; l++)
        for (int b = 0; b < 2; b++) {
            wd.k[l][b] = malloc((size_t)wd.n[b] * wd.row * 2);
            wd.v[l][b] = malloc((size_t)wd.n[b] * wd.row * 2);
            skvt_lowrank_prompt(&r, wd.row, wd.n[b], wd.k[l][b], wd.v[l][b]);
        }
    size_t pb = (size_t)wd.cfg.max_prompt_len * wd.row * 2;
    if (skv_buffer_alloc(SKV_BACKEND_CUDA, pb, (void **)&wd.dk) || skv_buffer_alloc(SKV_BACKEND_CUDA, pb, (void **)&wd.dv) ||
        skv_buffer_alloc(SKV_BACKEND_CUDA, wd.qn * 2, (void **)&wd.dq) ||
        skv_buffer_alloc(SKV_BACKEND_CUDA, wd.kn * 2, (void **)&wd.dkn) ||
        skv_buffer_alloc(SKV_BACKEND_CUDA, wd.kn * 2, (void **)&wd.dvn) ||
        skv_buffer_alloc(SKV_BACKEND_CUDA, wd.qn * 4, (void **)&wd.dout)) {
        SKVT_CHECK(0, "device buffers: %s", skv_last_error());
        return;
    }
    cudaStream_t sb;
    CU(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
    skv_cache *A = make_cache(&wd, NULL); /* legacy default stream */
    skv_cache *B = make_cache(&wd, sb);   /* caller's non-blocking stream */
    if (!A || !B) return;
    skv_bf16 *q = malloc(wd.qn * 2), *kn = malloc(wd.kn * 2), *vn = malloc(wd.kn * 2);
    float *oa = malloc(wd.qn * 4), *ob = malloc(wd.qn * 4);
    same_prefill(&wd, A, B, "prefill, default vs caller stream");

    /* a direct step on layer 1 on both first */
    stage_step(&wd, &r, q, kn, vn);
    SKVT_CHECK_STATUS(step(&wd, A, 1, oa), SKV_OK, "decode A layer 1");
    SKVT_CHECK_STATUS(step(&wd, B, 1, ob), SKV_OK, "decode B layer 1");
    SKVT_CHECK(memcmp(oa, ob, wd.qn * 4) == 0, "direct step on layer 1: default-stream and caller-stream caches differ");
    {
        /* a third cache decodes right after its prefills, with no sync in between: the step must
           wait on the device for the factorization and value offload running beside the prefill
           (and the prompt buffers were overwritten between the prefills) */
        cudaStream_t sc;
        CU(cudaStreamCreateWithFlags(&sc, cudaStreamNonBlocking));
        skv_cache *C = make_cache(&wd, sc);
        float *oc = malloc(wd.qn * 4);
        if (C && oc) {
            SKVT_CHECK_STATUS(step(&wd, C, 1, oc), SKV_OK, "decode C layer 1 right after its prefills");
            SKVT_CHECK(memcmp(oa, oc, wd.qn * 4) == 0,
                       "a step right after the prefills (side work still running) differs from one after a sync");
            skv_stats cs;
            if (SKVT_CHECK_STATUS(skv_cache_stats(C, &cs), SKV_OK, "stats C")) {
                printf("prefill of C: critical %.3f ms, waited %.3f ms, factorize %.3f ms (side stream), %lld calls\n",
                       cs.prefill_critical_ms, cs.prefill_wait_ms, cs.prefill_factorize_ms,
                       (long long)cs.n_prefill_calls);
                SKVT_CHECK(cs.n_prefill_calls == 4 && cs.prefill_factorize_ms > 0 && cs.prefill_critical_ms > 0,
                           "prefill stats of C not collected (calls %lld, factorize %.3f ms, critical %.3f ms)",
                           (long long)cs.n_prefill_calls, cs.prefill_factorize_ms, cs.prefill_critical_ms);
            }
        }
        free(oc);
        skv_cache_free(C);
        cudaStreamDestroy(sc);
    }

    /* step 1 on layer 0: A directly, B captured into a graph (global mode) and launched once */
    stage_step(&wd, &r, q, kn, vn);
    SKVT_CHECK_STATUS(step(&wd, A, 0, oa), SKV_OK, "decode A");
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    CU(cudaStreamBeginCapture(sb, cudaStreamCaptureModeGlobal));
    skv_status st = skv_decode(B, 0, wd.dq, wd.dkn, wd.dvn, wd.dout);
    cudaError_t ce = cudaStreamEndCapture(sb, &graph);
    SKVT_CHECK_STATUS(st, SKV_OK, "skv_decode inside a global-mode capture");
    if (st) printf("  %s\n", skv_cache_last_error(B));
    SKVT_CHECK(ce == cudaSuccess, "cudaStreamEndCapture: %s (the decode path synchronized or allocated?)",
               cudaGetErrorString(ce));
    if (ce != cudaSuccess) return;
    size_t n_nodes = 0;
    CU(cudaGraphGetNodes(graph, NULL, &n_nodes));
    printf("captured decode step: %zu graph nodes\n", n_nodes);
    CU(cudaGraphInstantiate(&exec, graph, 0));
    CU(cudaGraphLaunch(exec, sb));
    SKVT_CHECK_STATUS(skv_cache_sync(B), SKV_OK, "sync B after the graph");
    CU(cudaMemcpy(ob, wd.dout, wd.qn * 4, cudaMemcpyDeviceToHost));
    SKVT_CHECK(memcmp(oa, ob, wd.qn * 4) == 0, "graph-launched step differs from the direct step (bitwise)");
    if (memcmp(oa, ob, wd.qn * 4)) { /* where: per (seq, head) output and selection */
        for (int b = 0; b < wd.cfg.batch_size; b++) {
            int bad_q = 0, bad_s = 0;
            for (int h = 0; h < wd.cfg.n_q_heads; h++)
                bad_q += memcmp(oa + ((size_t)b * wd.cfg.n_q_heads + h) * wd.cfg.head_dim,
                                ob + ((size_t)b * wd.cfg.n_q_heads + h) * wd.cfg.head_dim, (size_t)wd.cfg.head_dim * 4) != 0;
            for (int h = 0; h < wd.cfg.n_kv_heads; h++) {
                int32_t sa[64], sb2[64];
                skv_status s1 = skv_cache_selected(A, 0, b, h, sa), s2 = skv_cache_selected(B, 0, b, h, sb2);
                if (s1 || s2) printf("selected: A %s (%s), B %s (%s)\n", skv_status_string(s1), skv_cache_last_error(A),
                                     skv_status_string(s2), skv_cache_last_error(B));
                bad_s += memcmp(sa, sb2, (size_t)(wd.cfg.budget / wd.cfg.chunk_size) * 4) != 0;
            }
            skv_seq_info ia, ib;
            memset(&ia, 0, sizeof ia);
            memset(&ib, 0, sizeof ib);
            skv_status sa_ = skv_cache_seq_info(A, 0, b, &ia), sb_ = skv_cache_seq_info(B, 0, b, &ib);
            if (sa_ || sb_) printf("seq_info: A %s (%s), B %s (%s)\n", skv_status_string(sa_), skv_cache_last_error(A),
                                   skv_status_string(sb_), skv_cache_last_error(B));
            skv_seq_info ja, jb;
            skv_cache_seq_info(A, 1, b, &ja);
            skv_cache_seq_info(B, 1, b, &jb);
            printf("layer 1 n_generated A %d B %d\n", ja.n_generated, jb.n_generated);
            printf("graph vs direct, seq %d: %d/%d query heads differ, %d/%d selections differ, n_generated %d vs %d\n",
                   b, bad_q, wd.cfg.n_q_heads, bad_s, wd.cfg.n_kv_heads, ia.n_generated, ib.n_generated);
        }
    }
    {
        /* a third cache on another caller stream runs the same step directly: it tells a
           capture problem (C == A) from a stream problem (C == B) */
        cudaStream_t sc;
        CU(cudaStreamCreateWithFlags(&sc, cudaStreamNonBlocking));
        skv_cache *C = make_cache(&wd, sc);
        float *oc = malloc(wd.qn * 4);
        if (C) {
            skv_buffer_copy(SKV_BACKEND_CUDA, wd.dq, q, wd.qn * 2); /* the layer-0 step's inputs again */
            skv_buffer_copy(SKV_BACKEND_CUDA, wd.dkn, kn, wd.kn * 2);
            skv_buffer_copy(SKV_BACKEND_CUDA, wd.dvn, vn, wd.kn * 2);
            SKVT_CHECK_STATUS(step(&wd, C, 0, oc), SKV_OK, "decode C layer 0");
            double dab = 0, dcb = 0, dca = 0;
            for (size_t i = 0; i < wd.qn; i++) {
                dab = fmax(dab, fabs((double)oa[i] - ob[i]));
                dcb = fmax(dcb, fabs((double)oc[i] - ob[i]));
                dca = fmax(dca, fabs((double)oc[i] - oa[i]));
            }
            printf("layer-0 step: max |A-B| %.3g, |C-B| %.3g, |C-A| %.3g (A default stream, B graph, C caller "
                   "stream direct)\n", dab, dcb, dca);
            SKVT_CHECK(dca == 0, "caller-stream direct step differs from the default-stream direct step");
            skv_cache_free(C);
        }
        free(oc);
        cudaStreamDestroy(sc);
    }
    same_state(&wd, A, B, "after the captured step");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);

    /* the next steps on both layers: the state the graph advanced must be right */
    size_t free0 = 0, free1 = 0, total = 0;
    CU(cudaMemGetInfo(&free0, &total));
    for (int s = 0; s < 6; s++)
        for (int l = 0; l < 2; l++) {
            stage_step(&wd, &r, q, kn, vn);
            SKVT_CHECK_STATUS(step(&wd, A, l, oa), SKV_OK, "decode A");
            SKVT_CHECK_STATUS(step(&wd, B, l, ob), SKV_OK, "decode B");
            SKVT_CHECK(memcmp(oa, ob, wd.qn * 4) == 0, "step %d layer %d: default-stream and caller-stream caches differ",
                       s, l);
        }
    CU(cudaMemGetInfo(&free1, &total));
    SKVT_CHECK(free0 == free1, "device memory changed across 12 decode steps: %zu -> %zu free bytes", free0, free1);
    same_state(&wd, A, B, "after 7 steps");

    /* NaN in q of A only: nothing changes, the error arrives at sync, the cache stays usable */
    stage_step(&wd, &r, q, kn, vn);
    skv_bf16 nan_q = q[(size_t)(1 * wd.cfg.n_q_heads + 3) * wd.cfg.head_dim + 5];
    q[(size_t)(1 * wd.cfg.n_q_heads + 3) * wd.cfg.head_dim + 5] = 0x7fc0;
    skv_buffer_copy(SKV_BACKEND_CUDA, wd.dq, q, wd.qn * 2);
    st = skv_decode(A, 1, wd.dq, wd.dkn, wd.dvn, wd.dout);
    SKVT_CHECK_STATUS(st, SKV_OK, "skv_decode with a NaN in q (deferred)");
    st = skv_cache_sync(A);
    SKVT_CHECK_STATUS(st, SKV_ERR_NONFINITE, "skv_cache_sync after a NaN step");
    SKVT_CHECK(strstr(skv_cache_last_error(A), "q[1][3][5]") != NULL, "message should name q[1][3][5]: \"%s\"",
               skv_cache_last_error(A));
    printf("deferred error: %s\n", skv_cache_last_error(A));
    SKVT_CHECK_STATUS(skv_cache_sync(A), SKV_OK, "a second sync reports nothing");
    same_state(&wd, A, B, "after the NaN step (A) vs no step (B)");
    /* Inf in v of layer 0 */
    vn[7] = 0x7f80;
    skv_buffer_copy(SKV_BACKEND_CUDA, wd.dvn, vn, wd.kn * 2);
    SKVT_CHECK_STATUS(skv_decode(A, 0, wd.dq, wd.dkn, wd.dvn, wd.dout), SKV_OK, "skv_decode with Inf in v");
    skv_seq_info info;
    st = skv_cache_seq_info(A, 0, 0, &info);
    SKVT_CHECK_STATUS(st, SKV_ERR_NONFINITE, "seq_info reports the deferred error");
    same_state(&wd, A, B, "after the Inf step (A) vs no step (B)");
    /* good steps again: still twins */
    q[(size_t)(1 * wd.cfg.n_q_heads + 3) * wd.cfg.head_dim + 5] = nan_q;
    for (int l = 0; l < 2; l++) {
        stage_step(&wd, &r, q, kn, vn);
        SKVT_CHECK_STATUS(step(&wd, A, l, oa), SKV_OK, "decode A after the errors");
        SKVT_CHECK_STATUS(step(&wd, B, l, ob), SKV_OK, "decode B");
        SKVT_CHECK(memcmp(oa, ob, wd.qn * 4) == 0, "layer %d: outputs differ after the rejected steps", l);
    }
    same_state(&wd, A, B, "after recovery");

    skv_stats sa;
    SKVT_CHECK_STATUS(skv_cache_stats(A, &sa), SKV_OK, "stats");
    printf("stats A: %lld decode calls, select %.3f ms, rebuild %.3f, fetch %.3f, attention %.3f (event-timed)\n",
           (long long)sa.n_decode_calls, sa.decode_select_ms, sa.decode_rebuild_ms, sa.decode_fetch_ms,
           sa.decode_attention_ms);
    SKVT_CHECK(sa.decode_select_ms > 0 && sa.decode_attention_ms > 0 && sa.prefill_factorize_ms > 0,
               "phase times missing from the stats");

    skv_cache_free(A);
    skv_cache_free(B);
    cudaStreamDestroy(sb);
    skv_buffer_free(SKV_BACKEND_CUDA, wd.dk);
    skv_buffer_free(SKV_BACKEND_CUDA, wd.dv);
    skv_buffer_free(SKV_BACKEND_CUDA, wd.dq);
    skv_buffer_free(SKV_BACKEND_CUDA, wd.dkn);
    skv_buffer_free(SKV_BACKEND_CUDA, wd.dvn);
    skv_buffer_free(SKV_BACKEND_CUDA, wd.dout);
    for (int l = 0; l < 2; l++)
        for (int b = 0; b < 2; b++) {
            free(wd.k[l][b]);
            free(wd.v[l][b]);
        }
    free(q);
    free(kn);
    free(vn);
    free(oa);
    free(ob);
}
#endif

int main(void)
{
    uint64_t seed = skvt_base_seed("test_cuda");
    skv_status avail = skv_backend_available(SKV_BACKEND_CUDA);
    if (avail != SKV_OK) {
        test_no_device(avail);
        skvt_skip("no usable CUDA device: the GPU part of test_cuda did not run");
        return skvt_finish();
    }
#ifdef SKV_HAVE_CUDA
    skv_config c = small_config();
    skv_cache *cache = NULL;
    SKVT_CHECK_STATUS(skv_cache_create(&c, &cache), SKV_OK, "create(auto)");
    if (cache) SKVT_CHECK(skv_cache_backend(cache) == SKV_BACKEND_CUDA, "auto resolved to %s with a GPU present",
                          skv_backend_name(skv_cache_backend(cache)));
    skv_cache_free(cache);
    test_gpu(seed, 0);
    test_gpu(seed + 1, 1);
#else
    (void)seed;
#endif
    return skvt_finish();
}
