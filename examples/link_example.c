/*
 * link_example.c - the smallest program that uses libshadowkv, built against
 * an installed copy with pkg-config only:
 *
 *   cc link_example.c $(pkg-config --cflags --libs shadowkv)
 *
 * It creates a small cache, prefills one layer of one sequence, runs a decode
 * step and prints the selected chunks of KV head 0. Tensors go through
 * skv_buffer_alloc/skv_buffer_copy, so the same code runs on every backend
 * (device memory for cuda, host memory for ref and cpu).
 *
 * With --expect-no-cuda (make check runs it so, with the CUDA libraries hidden
 * from the loader) it also checks that cuda is reported unavailable, with the
 * reason, and that the auto backend resolved to cpu.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <shadowkv.h>

int main(int argc, char **argv)
{
    const int expect_no_cuda = argc > 1 && strcmp(argv[1], "--expect-no-cuda") == 0;
    if (expect_no_cuda) {
        skv_status a = skv_backend_available(SKV_BACKEND_CUDA);
        printf("link_example: cuda: %s (%s)\n", skv_status_string(a), skv_last_error());
        if (a != SKV_ERR_NO_DEVICE) {
            fprintf(stderr, "link_example: cuda should be unavailable here\n");
            return 1;
        }
    }
    skv_config cfg = skv_config_default();
    cfg.n_layers = 1;
    cfg.n_q_heads = 4;
    cfg.n_kv_heads = 1;
    cfg.head_dim = 64;
    cfg.rank = 16;
    cfg.budget = 64; /* 8 chunks of 8 tokens */
    cfg.n_outlier_chunks = 2;
    cfg.n_local_chunks = 1;
    cfg.max_prompt_len = 512;
    cfg.gen_capacity = 4;

    size_t dev = 0, host = 0;
    skv_status st = skv_cache_memory(&cfg, &dev, &host);
    if (st != SKV_OK) {
        fprintf(stderr, "skv_cache_memory: %s (%s)\n", skv_status_string(st), skv_last_error());
        return 1;
    }
    skv_cache *cache = NULL;
    st = skv_cache_create(&cfg, &cache);
    if (st != SKV_OK) {
        fprintf(stderr, "skv_cache_create: %s (%s)\n", skv_status_string(st), skv_last_error());
        return 1;
    }
    const int64_t n = 400;
    const size_t row = (size_t)cfg.n_kv_heads * cfg.head_dim;
    skv_bf16 *k = malloc(n * row * sizeof *k), *v = malloc(n * row * sizeof *v);
    for (size_t i = 0; i < n * row; i++) {
        k[i] = skv_bf16_from_float((float)((i * 7919u) % 101) / 50.0f - 1.0f);
        v[i] = skv_bf16_from_float((float)((i * 104729u) % 97) / 48.0f - 1.0f);
    }
    skv_bf16 q[4 * 64], kn[64], vn[64];
    float out[4 * 64];
    for (int i = 0; i < 4 * 64; i++) q[i] = skv_bf16_from_float((float)(i % 13) / 6.0f - 1.0f);
    for (int i = 0; i < 64; i++) kn[i] = vn[i] = skv_bf16_from_float(0.25f);
    /* buffers of the kind the cache's backend takes */
    const skv_backend be = skv_cache_backend(cache);
    void *dk = NULL, *dv = NULL, *dq = NULL, *dkn = NULL, *dvn = NULL, *dout = NULL;
    const size_t pb = n * row * sizeof *k;
    st = skv_buffer_alloc(be, pb, &dk);
    if (st == SKV_OK) st = skv_buffer_alloc(be, pb, &dv);
    if (st == SKV_OK) st = skv_buffer_alloc(be, sizeof q, &dq);
    if (st == SKV_OK) st = skv_buffer_alloc(be, sizeof kn, &dkn);
    if (st == SKV_OK) st = skv_buffer_alloc(be, sizeof vn, &dvn);
    if (st == SKV_OK) st = skv_buffer_alloc(be, sizeof out, &dout);
    if (st == SKV_OK) st = skv_buffer_copy(be, dk, k, pb);
    if (st == SKV_OK) st = skv_buffer_copy(be, dv, v, pb);
    if (st == SKV_OK) st = skv_buffer_copy(be, dq, q, sizeof q);
    if (st == SKV_OK) st = skv_buffer_copy(be, dkn, kn, sizeof kn);
    if (st == SKV_OK) st = skv_buffer_copy(be, dvn, vn, sizeof vn);
    if (st == SKV_OK) st = skv_prefill(cache, 0, 0, n, dk, dv, NULL);
    if (st == SKV_OK) st = skv_decode(cache, 0, dq, dkn, dvn, dout);
    if (st == SKV_OK) st = skv_cache_sync(cache); /* cuda: skv_decode only enqueued the step */
    if (st == SKV_OK) st = skv_buffer_copy(be, out, dout, sizeof out);
    int32_t sel[8];
    if (st == SKV_OK) st = skv_cache_selected(cache, 0, 0, 0, sel);
    if (st != SKV_OK) {
        fprintf(stderr, "%s: %s\n", skv_status_string(st), skv_cache_last_error(cache));
        skv_cache_free(cache);
        return 1;
    }
    printf("link_example: backend %s, %zu device + %zu host bytes, selected chunks:",
           skv_backend_name(skv_cache_backend(cache)), dev, host);
    for (int i = 0; i < 8; i++) printf(" %d", sel[i]);
    printf("\n");
    const int ok = !expect_no_cuda || skv_cache_backend(cache) == SKV_BACKEND_CPU;
    if (!ok) fprintf(stderr, "link_example: auto should have resolved to cpu\n");
    free(k);
    free(v);
    skv_buffer_free(be, dk);
    skv_buffer_free(be, dv);
    skv_buffer_free(be, dq);
    skv_buffer_free(be, dkn);
    skv_buffer_free(be, dvn);
    skv_buffer_free(be, dout);
    skv_cache_free(cache);
    return ok ? 0 : 1;
}
