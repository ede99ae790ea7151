/*
 * fuzz_load.c - skv_cache_load_buffer and skv_snapshot_config_buffer on arbitrary bytes
 * (docs/DESIGN.md section 11).
 *
 * Input: one mode byte, then the snapshot bytes. Mode bit 0: recompute every section's
 * CRC32C and the END section's file checksum before loading (so a mutated snapshot gets
 * past the checksums to the size, state, id and config checks behind them); bit 1: pass
 * cfg = NULL when no cuda device is usable (the snapshot's own config; auto then picks
 * cpu), else an explicit cfg carrying the model fields as the input's CONF section spells
 * them; bit 2: backend cpu instead of ref for the explicit cfg. The seeds in
 * fuzz/corpus/fuzz_load are small valid snapshots (fuzz/gen_load_seeds.c) and mutations.
 *
 * Asserts: the status is defined with a message; a failure is SKV_ERR_FORMAT,
 * SKV_ERR_INVALID_CONFIG (an explicit cfg that does not match), SKV_ERR_SIZE_OVERFLOW,
 * SKV_ERR_OUT_OF_MEMORY or SKV_ERR_UNSUPPORTED (create's refusal), and leaves *out NULL; a config that does not validate is never
 * loaded; a success gives a usable cache: it saves back to exactly the loaded bytes (an older
 * version's input: to a current-version snapshot that loads and saves back to itself), every
 * introspection call answers, and, when every slot is prefilled and the next step has
 * room, one decode step of the layer that is behind succeeds. Configs needing more than
 * 64 MB are not loaded (the loader would rightly create them).
 * skv_snapshot_config_buffer on the same bytes, before the load: a defined status; on
 * success the model fields the CONF section spells, backend AUTO, and the bytes
 * skv_cache_memory gives for that config; on failure nothing written, and a FORMAT failure
 * means the load fails with FORMAT too; a successful load means the query succeeded and
 * described the loaded cache (its model fields, and with cfg NULL its memory).
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

#define LOAD_LIMIT ((size_t)64 << 20)

/* Bitwise CRC32C (Castagnoli), as the format specifies it. */
static uint32_t crc32c(const uint8_t *p, size_t n)
{
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    }
    return ~c;
}
static uint32_t rd32(const uint8_t *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t rd64(const uint8_t *p) { return rd32(p) | (uint64_t)rd32(p + 4) << 32; }
static void wr32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> 8 * i);
}

/* Recomputes the checksums of every whole section (the last one taken as END). */
static void fix_checksums(uint8_t *s, size_t size)
{
    size_t starts[4096];
    int n = 0;
    for (size_t at = 16; at + 16 <= size && n < 4096;) {
        const uint64_t len = rd64(s + at + 8);
        if (len > size - at - 16 || size - at - 16 - len < 4) break;
        starts[n++] = at;
        at += 16 + (size_t)len + 4;
    }
    for (int i = 0; i < n; i++) {
        const size_t at = starts[i], len = (size_t)rd64(s + at + 8);
        if (i == n - 1 && len >= 12) wr32(s + at + 16 + 8, crc32c(s, at));
        wr32(s + at + 16 + len, crc32c(s + at, 16 + len));
    }
}

/* The config the input's CONF section spells (the defaults where it is cut short). */
static skv_config conf_of(const uint8_t *s, size_t size, skv_backend be)
{
    skv_config c = skv_config_default();
    c.backend = be;
    if (size < 32 + 96) return c;
    const uint8_t *p = s + 32;
    int32_t *i32[] = {&c.n_layers, &c.n_q_heads, &c.n_kv_heads, &c.head_dim, &c.rank, &c.chunk_size, &c.budget,
                      &c.n_outlier_chunks, &c.n_local_chunks};
    for (int i = 0; i < 9; i++) *i32[i] = (int32_t)rd32(p + 4 * i);
    uint32_t u;
    u = rd32(p + 36), memcpy(&c.rope.theta, &u, 4);
    c.rope.rotary_dim = (int32_t)rd32(p + 40);
    c.rope.interleaved = (int32_t)rd32(p + 44);
    c.rope.llama3_scaling = (int32_t)rd32(p + 48);
    u = rd32(p + 52), memcpy(&c.rope.scaling_factor, &u, 4);
    u = rd32(p + 56), memcpy(&c.rope.low_freq_factor, &u, 4);
    u = rd32(p + 60), memcpy(&c.rope.high_freq_factor, &u, 4);
    c.rope.original_max_position = (int32_t)rd32(p + 64);
    u = rd32(p + 68), memcpy(&c.attn_scale, &u, 4);
    c.batch_size = (int32_t)rd32(p + 72);
    c.max_prompt_len = (int64_t)rd64(p + 76);
    c.gen_capacity = (int32_t)rd32(p + 84);
    c.factorize = (skv_factorize_route)(int32_t)rd32(p + 88);
    c.reproducible = (int32_t)rd32(p + 92);
    if (rd32(s + 8) < 2 || size < 32 + 124) return c; /* version 1: the 0.3 fields keep their defaults */
    c.select_mode = (skv_select_mode)(int32_t)rd32(p + 96);
    u = rd32(p + 100), memcpy(&c.select_mass, &u, 4);
    c.select_min_chunks = (int32_t)rd32(p + 104);
    c.rank_max = (int32_t)rd32(p + 108);
    u = rd32(p + 112), memcpy(&c.rank_error_target, &u, 4);
    c.dense_layers = rd64(p + 116);
    if (rd32(s + 8) < 3 || size < 32 + 128) return c; /* version 2: select_candidates keeps its default */
    c.select_candidates = (int32_t)rd32(p + 124);
    if (rd32(s + 8) < 4 || size < 32 + 136) return c; /* version 3: no head shard */
    c.model_kv_heads = (int32_t)rd32(p + 128);
    c.kv_head_begin = (int32_t)rd32(p + 132);
    return c;
}

/* Whether two configs hold the same model fields (floats bit for bit). */
/* The format version a save writes (docs/DESIGN.md 11.1); older inputs are re-saved in it. */
#define SNAP_FORMAT_CURRENT 4u

static int same_model(const skv_config *a, const skv_config *b)
{
    return a->n_layers == b->n_layers && a->n_q_heads == b->n_q_heads && a->n_kv_heads == b->n_kv_heads &&
           a->head_dim == b->head_dim && a->rank == b->rank && a->chunk_size == b->chunk_size &&
           a->budget == b->budget && a->n_outlier_chunks == b->n_outlier_chunks &&
           a->n_local_chunks == b->n_local_chunks && memcmp(&a->rope, &b->rope, sizeof a->rope) == 0 &&
           memcmp(&a->attn_scale, &b->attn_scale, sizeof a->attn_scale) == 0 && a->batch_size == b->batch_size &&
           a->max_prompt_len == b->max_prompt_len && a->gen_capacity == b->gen_capacity &&
           a->factorize == b->factorize && a->reproducible == b->reproducible && a->select_mode == b->select_mode &&
           memcmp(&a->select_mass, &b->select_mass, 4) == 0 && a->select_min_chunks == b->select_min_chunks &&
           a->rank_max == b->rank_max && memcmp(&a->rank_error_target, &b->rank_error_target, 4) == 0 &&
           a->dense_layers == b->dense_layers && a->select_candidates == b->select_candidates &&
           a->model_kv_heads == b->model_kv_heads && a->kv_head_begin == b->kv_head_begin;
}

/* A loaded cache is usable: it saves back to the loaded bytes (an input of an older format version:
   to a snapshot of the current version that loads and saves back to itself), introspection answers,
   and the next decode step runs where the cache allows one. */
static void check_usable(skv_cache *cache, const uint8_t *snap, size_t size)
{
    size_t need = 0;
    skv_status st;
    uint8_t *v2 = NULL;
    if (rd32(snap + 8) < SNAP_FORMAT_CURRENT) {
        st = skv_cache_save_buffer(cache, NULL, 0, &need);
        if (st != SKV_OK || !(v2 = malloc(need)) || skv_cache_save_buffer(cache, v2, need, &need) != SKV_OK)
            skvf_fail("loaded version %u snapshot: saving it failed (status %d)", (unsigned)rd32(snap + 8), (int)st);
        if (rd32(v2 + 8) != SNAP_FORMAT_CURRENT)
            skvf_fail("a save wrote format version %u, not %u", (unsigned)rd32(v2 + 8), SNAP_FORMAT_CURRENT);
        skv_cache *again = NULL;
        st = skv_cache_load_buffer(v2, need, NULL, &again);
        if (st != SKV_OK) skvf_fail("an older snapshot's current-version save does not load: %s", skv_last_error());
        skv_cache_free(again);
        snap = v2, size = need;
    }
    st = skv_cache_save_buffer(cache, NULL, 0, &need);
    skvf_check_status(st, "skv_cache_save_buffer(query)");
    if (st != SKV_OK || need != size)
        skvf_fail("loaded cache: snapshot size %zu (status %d), the input was %zu bytes", need, (int)st, size);
    uint8_t *again = malloc(size);
    if (!again) skvf_fail("out of memory");
    st = skv_cache_save_buffer(cache, again, size, &need);
    if (st != SKV_OK || memcmp(again, snap, size) != 0)
        skvf_fail("loaded cache: its snapshot is not the loaded bytes (status %d)", (int)st);
    free(again);
    free(v2);
    (void)skvf_fingerprint(cache); /* every introspection call answers */
    const skv_config *g = skv_cache_config(cache);
    int32_t layer = 0, lo = g->gen_capacity, all = 1;
    for (int32_t l = 0; l < g->n_layers; l++)
        for (int32_t b = 0; b < g->batch_size; b++) {
            skv_seq_info in;
            skv_cache_seq_info(cache, l, b, &in);
            all &= in.prefilled;
            if (b == 0 && in.n_generated < lo) lo = in.n_generated, layer = l;
        }
    if (!all || lo >= g->gen_capacity) return;
    const size_t qn = (size_t)g->batch_size * g->n_q_heads * g->head_dim;
    const size_t kn = (size_t)g->batch_size * g->n_kv_heads * g->head_dim;
    skv_bf16 *q = malloc(qn * 2), *k = malloc(kn * 2), *v = malloc(kn * 2);
    float *out = malloc(qn * sizeof *out);
    if (!q || !k || !v || !out) skvf_fail("out of memory");
    for (size_t i = 0; i < qn; i++) q[i] = skv_bf16_from_float((float)((int)(i % 7) - 3) * 0.25f);
    for (size_t i = 0; i < kn; i++) k[i] = v[i] = skv_bf16_from_float((float)((int)(i % 5) - 2) * 0.5f);
    st = skv_decode(cache, layer, q, k, v, out);
    skvf_check_status(st, "skv_decode after load");
    if (st != SKV_OK) skvf_fail("decode of layer %d after a load failed: %s", layer, skv_cache_last_error(cache));
    free(q), free(k), free(v), free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    const uint8_t mode = data[0];
    const size_t n = size - 1;
    uint8_t *s = malloc(n ? n : 1); /* exactly n bytes: ASan sees reads past the end */
    if (!s) return 0;
    if (n) memcpy(s, data + 1, n);
    if (mode & 1) fix_checksums(s, n);
    const skv_backend be = mode & 4 ? SKV_BACKEND_CPU : SKV_BACKEND_REF;
    skv_config cfg = conf_of(s, n, be);
    const int use_null = (mode & 2) && skv_backend_available(SKV_BACKEND_CUDA) != SKV_OK;
    size_t dev = 0, host = 0;
    const int has_conf = n >= 32 + (n >= 12 && rd32(s + 8) >= 2 ? 124 : 96), valid = has_conf && skv_cache_memory(&cfg, &dev, &host) == SKV_OK;
    /* the config query: the CONF section alone (also of caches too large to load here) */
    skv_config q = skv_config_default(), q0;
    q.n_layers = -5; /* a sentinel: must stay on failure */
    q0 = q;
    size_t qdev = 1, qhost = 2;
    const skv_status qs = skv_snapshot_config_buffer(s, n, &q, &qdev, &qhost);
    skvf_check_status(qs, "skv_snapshot_config_buffer");
    if (qs == SKV_OK) {
        const skv_config spelled = conf_of(s, n, SKV_BACKEND_AUTO);
        size_t d2 = 0, h2 = 0;
        if (!has_conf || !same_model(&q, &spelled) || q.backend != SKV_BACKEND_AUTO || q.struct_size != sizeof q)
            skvf_fail("skv_snapshot_config: the config is not the one the CONF section spells");
        if (skv_cache_memory(&q, &d2, &h2) != SKV_OK || d2 != qdev || h2 != qhost)
            skvf_fail("skv_snapshot_config: %zu + %zu bytes, skv_cache_memory of its config %zu + %zu", qdev, qhost, d2,
                      h2);
    } else {
        if (memcmp(&q, &q0, sizeof q) != 0 || qdev != 1 || qhost != 2)
            skvf_fail("skv_snapshot_config failed with %d but wrote an output", (int)qs);
        if (qs != SKV_ERR_FORMAT && qs != SKV_ERR_SIZE_OVERFLOW && qs != SKV_ERR_INVALID_CONFIG)
            skvf_fail("skv_snapshot_config failed with an undocumented status %s: %s", skv_status_string(qs),
                      skv_last_error());
    }
    if (valid && dev + host > LOAD_LIMIT) { /* a legitimately large cache: not loaded here */
        free(s);
        return 0;
    }
    skv_cache *out = (skv_cache *)&cfg; /* must come back NULL on failure */
    skv_status st = skv_cache_load_buffer(s, n, use_null ? NULL : &cfg, &out);
    skvf_check_status(st, "skv_cache_load_buffer");
    if (qs == SKV_ERR_FORMAT && st != SKV_ERR_FORMAT)
        skvf_fail("skv_snapshot_config refused the CONF with SKV_ERR_FORMAT, the load returned %s",
                  skv_status_string(st));
    if (st != SKV_OK) {
        if (out != NULL) skvf_fail("load failed with %d but *out is not NULL", (int)st);
        if (st != SKV_ERR_FORMAT && st != SKV_ERR_INVALID_CONFIG && st != SKV_ERR_SIZE_OVERFLOW &&
            st != SKV_ERR_OUT_OF_MEMORY && st != SKV_ERR_UNSUPPORTED /* create: e.g. reproducible = 1 */)
            skvf_fail("load failed with an undocumented status %s: %s", skv_status_string(st), skv_last_error());
    } else {
        if (!out) skvf_fail("load succeeded with *out NULL");
        if (!valid) skvf_fail("a snapshot whose config does not validate was loaded");
        if (qs != SKV_OK || !same_model(&q, skv_cache_config(out)))
            skvf_fail("loaded, but skv_snapshot_config returned %d or another config", (int)qs);
        size_t d2 = 0, h2 = 0;
        if (use_null && (skv_cache_memory(skv_cache_config(out), &d2, &h2) != SKV_OK || d2 != qdev || h2 != qhost))
            skvf_fail("loaded with cfg NULL: the cache holds %zu + %zu bytes, skv_snapshot_config said %zu + %zu", d2,
                      h2, qdev, qhost);
        check_usable(out, s, n);
        skv_cache_free(out);
    }
    free(s);
    return 0;
}
