/*
 * fuzz_serve.c - the serving calls in random interleavings: skv_prefill_piece (pieces of random
 * sizes, empty ones too, with carved faults: a gap, another n_total, k_post switching, a piece
 * past the end, a prompt too short), skv_decode_active (random subsets in random order, with
 * carved faults: a repeated, free, out-of-range or unprefilled sequence, a layer a step ahead, a
 * sequence at gen_capacity, NaN in q), skv_seq_release (of a free slot too) and
 * skv_cache_usage, on a small cache (skvf_small_config with 2..3 slots) with or without pools
 * (pool sizes carved, so prefills run out of memory), values on the device or in the host pool,
 * bf16 or fp8 values (fp8 when the carved gen_capacity is odd: no input byte of its own, so the
 * corpus and regressions keep their meaning).
 *
 * A model of every slot predicts each status. Asserts: the status is the model's (an
 * SKV_ERR_OUT_OF_MEMORY only in the pool mode, and then it changed nothing); after any error
 * skvf_fingerprint and skv_cache_usage are unchanged; every listed sequence's output and
 * selection is bitwise that of a cache holding that sequence alone (its solo twin, fed the same
 * prompt in one piece and the same steps); at the end, after releasing everything, the pools
 * are whole and no staging is held.
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

enum { MAXS = 3, MAXL = 2 };

typedef struct slot {
    int state;                 /* 0 free, 1 prompt arriving (some layers), 2 every layer prefilled */
    uint64_t seed;             /* the request's data */
    int64_t n;                 /* prompt length */
    int64_t recv[MAXL];        /* tokens received per layer (n: prefilled) */
    int opened[MAXL];          /* a piece of this layer arrived (the library keeps its staging) */
    int kpost;                 /* pieces bring k_post */
    int32_t gen[MAXL];         /* decode steps taken per layer */
    skv_cache *solo;
} slot;

/* The request's prompt tensors of one layer (deterministic from seed): [n, Hk*D]. */
static void prompt(uint64_t seed, int layer, int64_t n, size_t row, skv_bf16 *k, skv_bf16 *v, skv_bf16 *kp)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + (uint64_t)layer * 0xD1B54A32D192ED03ull + 1;
    for (size_t i = 0; i < (size_t)n * row; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        k[i] = skv_bf16_from_float((float)((int)(x & 1023) - 512) / 256.0f + (float)(i % row) * 0.01f);
        v[i] = skv_bf16_from_float((float)((int)((x >> 10) & 1023) - 512) / 256.0f);
        kp[i] = skv_bf16_from_float((float)((int)((x >> 20) & 1023) - 512) / 256.0f);
    }
}

static int64_t all_recv(const slot *s, int L)
{
    int64_t m = s->n;
    for (int l = 0; l < L; l++) m = s->recv[l] < m ? s->recv[l] : m;
    return m;
}

static int32_t min_gen(const slot *s, int L)
{
    int32_t m = s->gen[0];
    for (int l = 1; l < L; l++) m = s->gen[l] < m ? s->gen[l] : m;
    return m;
}

static void usage_of(skv_cache *c, skv_usage *u)
{
    memset(u, 0, sizeof *u);
    skv_status st = skv_cache_usage(c, u);
    skvf_check_status(st, "skv_cache_usage");
    if (st) skvf_fail("skv_cache_usage failed: %s", skv_last_error());
}

static void expect(skv_status got, skv_status want, int pooled, const char *what, skv_cache *c, uint64_t fp0,
                   const skv_usage *u0)
{
    skvf_check_status(got, what);
    if (got != want && !(pooled && got == SKV_ERR_OUT_OF_MEMORY && want == SKV_OK))
        skvf_fail("%s: status %d (%s), the model wants %d", what, (int)got, skv_last_error(), (int)want);
    if (got != SKV_OK) {
        skv_usage u;
        usage_of(c, &u);
        if (skvf_fingerprint(c) != fp0) skvf_fail("%s failed with %d but changed the cache", what, (int)got);
        if (memcmp(&u, u0, sizeof u)) skvf_fail("%s failed with %d but changed the memory in use", what, (int)got);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    skv_config cfg = skvf_small_config(&d);
    cfg.batch_size = (int32_t)skvf_range(&d, 2, MAXS);
    cfg.gen_capacity = (int32_t)skvf_range(&d, 2, 6);
    cfg.reproducible = skvf_u8(&d) < 64;
    cfg.value_dtype = cfg.gen_capacity & 1 ? SKV_VALUE_FP8 : SKV_VALUE_BF16;
    if (cfg.backend == SKV_BACKEND_CUDA) cfg.backend = SKV_BACKEND_CPU; /* (fuzz builds have no device) */
    const int pooled = skvf_bool(&d), values_host = pooled && skvf_bool(&d);
    const int L = cfg.n_layers, B = cfg.batch_size, Hq = cfg.n_q_heads, Hk = cfg.n_kv_heads, D = cfg.head_dim;
    const size_t row = (size_t)Hk * D, hd = (size_t)Hq * D;
    if (pooled) { /* pools for 0.5 .. 3 of the longest prompts, and some staging */
        skv_config p = cfg;
        p.pool_device_bytes = 1 << 20, p.pool_page_bytes = 4096;
        if (values_host) p.value_device_bytes = 0, p.pool_host_bytes = 1 << 20;
        skv_cache *probe = NULL;
        if (skv_cache_create(&p, &probe) != SKV_OK) skvf_fail("pool probe create: %s", skv_last_error());
        size_t dv, hv, st;
        if (skv_seq_bytes(probe, cfg.max_prompt_len, &dv, &hv, &st) != SKV_OK) skvf_fail("skv_seq_bytes failed");
        skv_cache_free(probe);
        const int64_t k = skvf_range(&d, 1, 6);
        p.pool_device_bytes = (int64_t)((dv + st) * (size_t)k / 2 + 4096);
        if (values_host) p.pool_host_bytes = (int64_t)(hv * (size_t)k / 2 + 4096);
        cfg = p;
    }
    skv_cache *c = NULL;
    skv_status st = skv_cache_create(&cfg, &c);
    skvf_check_status(st, "skv_cache_create");
    if (st) skvf_fail("create of a small valid config: %s", skv_last_error());
    skv_config solo_cfg = cfg;
    solo_cfg.batch_size = 1, solo_cfg.pool_device_bytes = solo_cfg.pool_host_bytes = 0, solo_cfg.pool_page_bytes = 0;
    solo_cfg.value_device_bytes = SKV_VALUES_ALL_DEVICE;
    const int64_t minp = skvf_min_prompt(&cfg), maxp = cfg.max_prompt_len;
    slot s[MAXS];
    memset(s, 0, sizeof s);
    skv_bf16 *kp = malloc((size_t)maxp * row * 2), *vp = malloc((size_t)maxp * row * 2);
    skv_bf16 *kq = malloc((size_t)maxp * row * 2);
    skv_bf16 *q = malloc((size_t)(MAXS + 2) * hd * 2), *k = malloc((size_t)(MAXS + 2) * row * 2);
    skv_bf16 *v = malloc((size_t)(MAXS + 2) * row * 2);
    float *out = malloc((size_t)(MAXS + 2) * hd * 4), *sout = malloc(hd * 4);
    int32_t *sel = malloc(4096 * 4), *ssel = malloc(4096 * 4);
    if (!kp || !vp || !kq || !q || !k || !v || !out || !sout || !sel || !ssel) skvf_fail("out of memory");
    uint64_t next_seed = 1;
    const int n_ops = (int)skvf_range(&d, 4, 40);
    for (int op = 0; op < n_ops && d.n; op++) {
        const uint64_t fp0 = skvf_fingerprint(c);
        skv_usage u0;
        usage_of(c, &u0);
        const int kind = (int)skvf_range(&d, 0, 9);
        if (kind < 4) { /* a prompt piece */
            const int b = (int)skvf_range(&d, 0, B - 1), l = (int)skvf_range(&d, 0, L - 1);
            slot *x = &s[b];
            if (x->state == 0) { /* a new request */
                x->seed = next_seed++;
                x->n = skvf_u8(&d) < 16 ? skvf_range(&d, 1, minp) : skvf_range(&d, minp, maxp);
                x->kpost = skvf_u8(&d) < 64;
                memset(x->recv, 0, sizeof x->recv);
                memset(x->opened, 0, sizeof x->opened);
                memset(x->gen, 0, sizeof x->gen);
            }
            if (x->state == 2 || x->recv[l] == x->n) {
                prompt(x->seed, l, x->n, row, kp, vp, kq);
                expect(skv_prefill_piece(c, l, b, x->n, 0, 1, kp, vp, NULL), SKV_ERR_ALREADY_PREFILLED, pooled,
                       "a piece into a prefilled layer", c, fp0, &u0);
                continue;
            }
            const int first = !x->opened[l];
            int fault = skvf_u8(&d) < 40 ? (int)skvf_range(&d, 1, 4) : 0;
            if (fault == 3 && first) fault = 0; /* the first piece decides whether k_post comes */
            int64_t n_total = x->n, pos0 = x->recv[l], len = skvf_range(&d, 0, x->n - x->recv[l]);
            if (skvf_u8(&d) < 80) len = x->n - x->recv[l];
            int kpost = x->kpost;
            skv_status want = SKV_OK;
            if (fault == 1) pos0 += 1 + skvf_range(&d, 0, 3);
            if (fault == 2) n_total = first ? maxp + 1 : n_total + 1;
            if (fault == 3) kpost = !kpost;
            if (fault == 4) len = x->n - x->recv[l] + 1;
            if (first) { /* the order of the checks: order, then the prompt, then the piece */
                want = fault == 1 ? SKV_ERR_SEQ_STATE
                       : fault == 2 ? SKV_ERR_PROMPT_TOO_LONG
                       : (x->n < minp || x->n < cfg.rank) ? SKV_ERR_PROMPT_TOO_SHORT
                       : fault == 4 ? SKV_ERR_INVALID_ARGUMENT : SKV_OK;
            } else {
                want = fault >= 1 && fault <= 3 ? SKV_ERR_SEQ_STATE : fault == 4 ? SKV_ERR_INVALID_ARGUMENT : SKV_OK;
            }
            prompt(x->seed, l, x->n, row, kp, vp, kq);
            const size_t off = (size_t)x->recv[l] * row;
            st = skv_prefill_piece(c, l, b, n_total, pos0, len, kp + off, vp + off, kpost ? kq + off : NULL);
            expect(st, want, pooled, "skv_prefill_piece", c, fp0, &u0);
            if (st) continue;
            x->state = 1;
            x->opened[l] = 1;
            x->recv[l] += len;
            if (all_recv(x, L) == x->n) { /* every layer prefilled: the solo twin gets it in one piece */
                x->state = 2;
                if (skv_cache_create(&solo_cfg, &x->solo) != SKV_OK) skvf_fail("solo create: %s", skv_last_error());
                for (int m = 0; m < L; m++) {
                    prompt(x->seed, m, x->n, row, kp, vp, kq);
                    if (skv_prefill(x->solo, m, 0, x->n, kp, vp, x->kpost ? kq : NULL) != SKV_OK)
                        skvf_fail("solo prefill: %s", skv_last_error());
                }
            }
        } else if (kind < 8) { /* a step of a list */
            const int l = (int)skvf_range(&d, 0, L - 1);
            int32_t list[MAXS + 1];
            int n = 0;
            for (int b = 0; b < B; b++)
                if (s[b].state == 2 && s[b].gen[l] == min_gen(&s[b], L) && s[b].gen[l] < cfg.gen_capacity &&
                    skvf_u8(&d) < 200)
                    list[n++] = b;
            for (int i = n - 1; i > 0; i--) {
                int j = (int)skvf_range(&d, 0, i), t = list[i];
                list[i] = list[j], list[j] = t;
            }
            skv_status want = SKV_OK;
            const int fault = skvf_u8(&d) < 48 ? (int)skvf_range(&d, 1, 5) : 0;
            if (fault == 1 && n) list[n] = list[0], n++, want = SKV_ERR_INVALID_ARGUMENT;
            if (fault == 2) list[n++] = (int32_t)skvf_pick(&d, (const int64_t[]){-1, B, 64}, 3),
                            want = SKV_ERR_INVALID_ARGUMENT;
            if (fault == 3 || fault == 4 || fault == 5) { /* a sequence the step does not fit */
                for (int b = 0; b < B && want == SKV_OK; b++) {
                    int in = 0;
                    for (int i = 0; i < n; i++) in |= list[i] == b;
                    if (in) continue;
                    if (s[b].state != 2) list[n++] = b, want = SKV_ERR_NOT_PREFILLED;
                    else if (s[b].gen[l] != min_gen(&s[b], L)) list[n++] = b, want = SKV_ERR_INVALID_ARGUMENT;
                    else if (s[b].gen[l] >= cfg.gen_capacity) list[n++] = b, want = SKV_ERR_CAPACITY;
                }
            }
            skvf_fill_bf16(&d, q, (size_t)n * hd, 0);
            skvf_fill_bf16(&d, k, (size_t)n * row, 0);
            skvf_fill_bf16(&d, v, (size_t)n * row, 0);
            skvf_clamp_magnitude(q, (size_t)n * hd), skvf_clamp_magnitude(k, (size_t)n * row);
            skvf_clamp_magnitude(v, (size_t)n * row);
            if (want == SKV_OK && n && skvf_u8(&d) < 8) q[0] = 0x7FC0, want = SKV_ERR_NONFINITE;
            st = skv_decode_active(c, l, n, list, q, k, v, out);
            expect(st, want, 0, "skv_decode_active", c, fp0, &u0);
            if (st) continue;
            for (int i = 0; i < n; i++) { /* each listed sequence as its solo twin has it */
                slot *x = &s[list[i]];
                int32_t zero = 0;
                if (skv_decode_active(x->solo, l, 1, &zero, q + (size_t)i * hd, k + (size_t)i * row,
                                      v + (size_t)i * row, sout) != SKV_OK)
                    skvf_fail("solo step: %s", skv_last_error());
                if (memcmp(out + (size_t)i * hd, sout, hd * 4))
                    skvf_fail("layer %d, sequence %d (listed %d of %d): output differs from its solo run", l, list[i],
                              i, n);
                skv_seq_info a, bi;
                skv_cache_seq_info(c, l, list[i], &a);
                skv_cache_seq_info(x->solo, l, 0, &bi);
                if (a.n_generated != bi.n_generated || !a.has_selection) skvf_fail("step counts differ from solo");
                if (!a.dense)
                    for (int h = 0; h < Hk; h++) {
                        int32_t ca = 0, cb = 0;
                        skv_cache_selected(c, l, list[i], h, sel), skv_cache_selected(x->solo, l, 0, h, ssel);
                        skv_cache_selected_count(c, l, list[i], h, &ca), skv_cache_selected_count(x->solo, l, 0, h, &cb);
                        if (ca != cb || memcmp(sel, ssel, (size_t)a.n_selected * 4))
                            skvf_fail("layer %d, sequence %d, head %d: selection differs from its solo run", l,
                                      list[i], h);
                    }
                x->gen[l]++;
            }
            skvf_note_checked(cfg.backend);
        } else { /* a release */
            const int b = (int)skvf_range(&d, 0, B - 1);
            st = skv_seq_release(c, b);
            expect(st, s[b].state ? SKV_OK : SKV_ERR_SEQ_STATE, 0, "skv_seq_release", c, fp0, &u0);
            if (!st) {
                skv_cache_free(s[b].solo);
                memset(&s[b], 0, sizeof s[b]);
            }
        }
    }
    for (int b = 0; b < B; b++)
        if (s[b].state) {
            if (skv_seq_release(c, b) != SKV_OK) skvf_fail("final release of %d: %s", b, skv_last_error());
            skv_cache_free(s[b].solo);
        }
    skv_usage u;
    usage_of(c, &u);
    if (u.seqs_in_use || u.device_used_bytes || u.host_used_bytes || u.staging_bytes ||
        u.device_largest_free != u.device_pool_bytes || u.host_largest_free != u.host_pool_bytes)
        skvf_fail("after releasing everything: %d in use, %zu / %zu / %zu bytes held", u.seqs_in_use,
                  u.device_used_bytes, u.host_used_bytes, u.staging_bytes);
    skv_cache_free(c);
    free(kp), free(vp), free(kq), free(q), free(k), free(v), free(out), free(sout), free(sel), free(ssel);
    return 0;
}
