/*
 * gen_load_seeds.c - writes the seed corpus of fuzz_load: small valid snapshots of tiny
 * caches (a mode byte, then the snapshot; docs/DESIGN.md section 11), each in a few modes,
 * and a few mutations of them. `make fuzz-load-seeds` runs it into fuzz/corpus/fuzz_load
 * (file names: the FNV-1a hash of the contents).
 *   gen_load_seeds DIR
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shadowkv.h"

static int n_written;

/* Writes mode byte + bytes into dir, named by their hash. */
static void emit(const char *dir, unsigned char mode, const unsigned char *b, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    h = (h ^ mode) * 1099511628211ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    char path[512];
    snprintf(path, sizeof path, "%s/%016llx", dir, (unsigned long long)h);
    FILE *f = fopen(path, "wb");
    if (!f || fputc(mode, f) == EOF || fwrite(b, 1, n, f) != n || fclose(f) != 0) {
        fprintf(stderr, "gen_load_seeds: cannot write %s\n", path);
        exit(1);
    }
    n_written++;
}

/* A deterministic bf16 ramp with some variety. */
static void fill(skv_bf16 *x, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        x[i] = skv_bf16_from_float(((float)((seed >> 16) % 2001) - 1000.0f) / 500.0f);
    }
}

/* A tiny cache: L layers, B sequences, prompts of n tokens, `steps` decode steps, layers
   [0, prefill_layers) prefilled; v03: the 0.3 features (the mass selection with a floor, layer 0
   dense; 2: every chunk instead); 3: the rescoring (select_candidates 3, fixed); 4: the rescoring
   of 2 candidates with the mass rule over every chunk (format version 3's field); 5: a head shard,
   KV head 2 of 3 (format version 4's fields). */
static void seed(const char *dir, int L, int B, int64_t n, int steps, int prefill_layers, int host_values, int v03)
{
    skv_config c = skv_config_default();
    c.n_layers = L, c.batch_size = B, c.n_q_heads = 2, c.n_kv_heads = 1, c.head_dim = 8, c.rank = 4;
    c.chunk_size = 2, c.budget = 4, c.n_outlier_chunks = 1, c.n_local_chunks = 1, c.max_prompt_len = 24;
    c.gen_capacity = 3, c.backend = SKV_BACKEND_REF;
    if (host_values) c.value_device_bytes = 0x4000;
    if (v03 == 1) c.select_mode = SKV_SELECT_MASS, c.select_mass = 0.6f, c.select_min_chunks = 1, c.dense_layers = 1;
    if (v03 == 2) c.budget = SKV_BUDGET_ALL, c.dense_layers = 2;
    if (v03 == 3) c.select_candidates = 3;
    if (v03 == 4)
        c.budget = SKV_BUDGET_ALL, c.select_mode = SKV_SELECT_MASS, c.select_mass = 0.7f, c.select_candidates = 2;
    if (v03 == 5) c.model_kv_heads = 3, c.kv_head_begin = 2;
    skv_cache *k = NULL;
    if (skv_cache_create(&c, &k)) {
        fprintf(stderr, "gen_load_seeds: create: %s\n", skv_last_error());
        exit(1);
    }
    const size_t row = (size_t)c.n_kv_heads * c.head_dim;
    skv_bf16 *kp = malloc((size_t)n * row * 2), *v = malloc((size_t)n * row * 2);
    for (int l = 0; l < prefill_layers; l++)
        for (int b = 0; b < B; b++) {
            fill(kp, (size_t)n * row, 7u * l + b + 1);
            fill(v, (size_t)n * row, 11u * l + b + 3);
            if (skv_prefill(k, l, b, n - b, kp, v, NULL)) {
                fprintf(stderr, "gen_load_seeds: prefill: %s\n", skv_last_error());
                exit(1);
            }
        }
    const size_t qn = (size_t)B * c.n_q_heads * c.head_dim, kn = (size_t)B * row;
    skv_bf16 q[64], kk[64], vv[64];
    float out[64];
    for (int t = 0; t < steps; t++)
        for (int l = 0; l < L; l++) {
            fill(q, qn, 100u + t * 7u + l), fill(kk, kn, 200u + t), fill(vv, kn, 300u + t);
            if (skv_decode(k, l, q, kk, vv, out)) {
                fprintf(stderr, "gen_load_seeds: decode: %s\n", skv_last_error());
                exit(1);
            }
        }
    size_t size = 0;
    skv_cache_save_buffer(k, NULL, 0, &size);
    unsigned char *s = malloc(size), *m = malloc(size);
    if (skv_cache_save_buffer(k, s, size, &size)) exit(1);
    emit(dir, 0, s, size); /* as is, explicit cfg on ref */
    emit(dir, 7, s, size); /* checksums recomputed (no-op), cfg NULL, cpu */
    /* mutations: a flipped data byte with and without recomputed checksums, a cut */
    memcpy(m, s, size);
    m[size / 2] ^= 0x40;
    emit(dir, 0, m, size);
    emit(dir, 1, m, size);
    emit(dir, 1, s, size - 21);
    free(s), free(m), free(kp), free(v);
    skv_cache_free(k);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen_load_seeds DIR\n");
        return 2;
    }
    seed(argv[1], 2, 1, 16, 1, 2, 0, 0);
    seed(argv[1], 1, 2, 18, 2, 1, 0, 0);
    seed(argv[1], 2, 1, 20, 0, 2, 1, 0);
    seed(argv[1], 2, 1, 16, 0, 1, 0, 0); /* layer 1 not prefilled */
    seed(argv[1], 1, 1, 24, 3, 1, 1, 0); /* gen_capacity reached */
    seed(argv[1], 2, 2, 14, 2, 2, 0, 1); /* the mass selection, a dense layer 0 */
    seed(argv[1], 2, 1, 20, 1, 2, 1, 2); /* every chunk, a dense layer 1, host values */
    seed(argv[1], 2, 2, 16, 2, 2, 0, 3); /* the rescoring */
    seed(argv[1], 1, 1, 20, 2, 1, 1, 4); /* the rescoring, the mass rule over every chunk, host values */
    seed(argv[1], 2, 1, 16, 2, 2, 0, 5); /* a head shard */
    printf("gen_load_seeds: %d files in %s\n", n_written, argv[1]);
    return 0;
}
