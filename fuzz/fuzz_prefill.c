/*
 * fuzz_prefill.c - skv_prefill on a small valid cache (skvf_small_config):
 * a carved sequence of calls with layer/seq in or out of range, n anywhere
 * around [min prompt, max_prompt_len] (and negative), NULL tensors, NaN/Inf
 * and finite values beyond SKV_MAX_INPUT_MAGNITUDE planted or carved, k_post
 * given or NULL, and prefills of slots already prefilled.
 *
 * Asserts per call: the status is defined and documented; a call with exactly
 * one thing wrong returns that thing's status, a call with nothing wrong
 * succeeds; after any error skvf_fingerprint is unchanged, the slot is still
 * unprefilled and the cache's last error is set; after a success seq_info
 * describes the prompt. Tensors sit in guarded buffers of exactly the size the
 * call describes (ASan/canaries catch reads or writes past them). After the
 * sequence, when every (layer, seq) is prefilled, one decode step of every
 * layer, with q, k, v within SKV_MAX_INPUT_MAGNITUDE, must succeed.
 */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

enum { R_NULL, R_RANGE, R_SHORT, R_LONG, R_TWICE, R_NONFINITE, R_COUNT };
static const skv_status reason_status[R_COUNT] = {SKV_ERR_NULL_POINTER,     SKV_ERR_INVALID_ARGUMENT,
                                                  SKV_ERR_PROMPT_TOO_SHORT, SKV_ERR_PROMPT_TOO_LONG,
                                                  SKV_ERR_ALREADY_PREFILLED, SKV_ERR_NONFINITE};

static int32_t carve_index(skvf_data *d, int32_t count)
{
    static const int64_t bad[] = {-1, -2, INT32_MAX, INT32_MIN, 64, 65536};
    uint8_t sel = skvf_u8(d);
    if (sel < 224) return (int32_t)skvf_range(d, 0, count - 1);
    if (sel < 240) return count + (int32_t)skvf_range(d, 0, 1);
    return (int32_t)skvf_pick(d, bad, 6);
}

static int64_t carve_n(skvf_data *d, const skv_config *cfg)
{
    const int64_t minp = skvf_min_prompt(cfg), maxp = cfg->max_prompt_len, c = cfg->chunk_size;
    const int64_t special[] = {minp - 1, minp - c, maxp + 1, maxp + c, 0, -1, -c, 1, c,
                               INT64_MIN, INT64_MAX, (int64_t)1 << 40, (int64_t)INT32_MAX + 1};
    uint8_t sel = skvf_u8(d);
    if (sel < 176) return skvf_range(d, minp, maxp);
    if (sel < 192) return sel & 1 ? minp : maxp;
    if (sel < 240) return special[skvf_range(d, 0, (int)(sizeof special / sizeof special[0]) - 1)];
    return (int64_t)skvf_u64(d);
}

/* Every element finite and within SKV_MAX_INPUT_MAGNITUDE (2^32, bf16 0x4F80): what the
   NONFINITE check accepts. */
static int all_finite(const skv_bf16 *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((x[i] & 0x7FFF) > 0x4F80) return 0;
    return 1;
}

/* Largest |x| over the finite elements. */
static float max_abs(const skv_bf16 *x, size_t n)
{
    float m = 0.0f;
    for (size_t i = 0; x && i < n; i++) {
        float a = fabsf(skv_bf16_to_float(x[i]));
        if (isfinite(a) && a > m) m = a;
    }
    return m;
}

static void check_seq_info(skv_cache *c, const skv_config *cfg, int32_t l, int32_t b, int64_t n)
{
    skv_seq_info in;
    skv_status st = skv_cache_seq_info(c, l, b, &in);
    skvf_check_status(st, "skv_cache_seq_info");
    const int64_t N = n / cfg->chunk_size - cfg->n_local_chunks, S = cfg->budget / cfg->chunk_size;
    if (st != SKV_OK || !in.prefilled || in.n != n || in.n_chunks != N ||
        in.n_candidates != N - cfg->n_outlier_chunks || in.n_outliers != cfg->n_outlier_chunks ||
        in.n_selected != S || in.n_local != n - N * cfg->chunk_size || in.n_generated != 0 ||
        in.has_selection)
        skvf_fail("seq_info(%d, %d) after prefill of n = %lld: prefilled %d n %lld N %d cand %d O %d S %d "
                  "local %d gen %d sel %d",
                  l, b, (long long)n, in.prefilled, (long long)in.n, in.n_chunks, in.n_candidates,
                  in.n_outliers, in.n_selected, in.n_local, in.n_generated, in.has_selection);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    skvf_data d;
    skvf_init(&d, data, size);
    skv_config cfg;
    skv_cache *cache = skvf_small_cache(&d, &cfg);
    skv_status st;

    const int32_t L = cfg.n_layers, B = cfg.batch_size;
    const int64_t row = (int64_t)cfg.n_kv_heads * cfg.head_dim;
    const int64_t minp = skvf_min_prompt(&cfg), maxp = cfg.max_prompt_len;
    unsigned char done[2][2] = {{0, 0}, {0, 0}};
    int n_done = 0;

    if (skv_prefill(NULL, 0, 0, minp, NULL, NULL, NULL) != SKV_ERR_NULL_POINTER)
        skvf_fail("skv_prefill(NULL cache) is not SKV_ERR_NULL_POINTER");

    const int n_calls = (int)skvf_range(&d, 1, 8);
    for (int call = 0; call < n_calls && d.n > 0; call++) {
        const int32_t l = carve_index(&d, L), b = carve_index(&d, B);
        const int64_t n = carve_n(&d, &cfg);
        const int null_k = skvf_u8(&d) < 16, null_v = skvf_u8(&d) < 16, with_post = skvf_bool(&d);
        const int allow_bad = skvf_u8(&d) < 48;
        /* buffers of exactly the rows the call describes (clamped to [1, max_prompt_len]) */
        const int64_t rows = n < 1 ? 1 : n > maxp ? maxp : n;
        const size_t e = (size_t)(rows * row);
        skv_bf16 *kp = null_k ? NULL : skvf_guarded_alloc(e * sizeof *kp);
        skv_bf16 *vv = null_v ? NULL : skvf_guarded_alloc(e * sizeof *vv);
        skv_bf16 *ko = with_post ? skvf_guarded_alloc(e * sizeof *ko) : NULL;
        skvf_fill_bf16(&d, kp, kp ? e : 0, allow_bad);
        skvf_fill_bf16(&d, vv, vv ? e : 0, allow_bad);
        skvf_fill_bf16(&d, ko, ko ? e : 0, allow_bad);

        int why[R_COUNT] = {0};
        const int in_range = l >= 0 && l < L && b >= 0 && b < B;
        why[R_NULL] = null_k || null_v;
        why[R_RANGE] = !in_range || n < 0; /* a negative length is an invalid argument, not a short prompt */
        why[R_SHORT] = n >= 0 && n < minp;
        why[R_LONG] = n > maxp;
        why[R_TWICE] = in_range && done[l][b];
        why[R_NONFINITE] = n >= 1 && n <= maxp &&
                           ((kp && !all_finite(kp, e)) || (vv && !all_finite(vv, e)) || (ko && !all_finite(ko, e)));
        /* huge finite values may overflow inside the factorization: NUMERICAL is allowed there */
        const int tame = max_abs(kp, kp ? e : 0) <= 1e4f && max_abs(vv, vv ? e : 0) <= 1e4f &&
                         max_abs(ko, ko ? e : 0) <= 1e4f;
        int n_why = 0, one = -1;
        for (int r = 0; r < R_COUNT; r++)
            if (why[r]) n_why++, one = r;

        const uint64_t before = skvf_fingerprint(cache);
        st = skv_prefill(cache, l, b, n, kp, vv, ko);
        skvf_check_status(st, "skv_prefill");
        skvf_guarded_check(kp, "k_pre");
        skvf_guarded_check(vv, "v");
        skvf_guarded_check(ko, "k_post");

        if (st == SKV_OK) {
            if (n_why) skvf_fail("skv_prefill(l %d, b %d, n %lld) succeeded although argument class %d is bad",
                                 l, b, (long long)n, one);
            done[l][b] = 1;
            n_done++;
            check_seq_info(cache, &cfg, l, b, n);
        } else {
            if (n_why == 0 && !(st == SKV_ERR_NUMERICAL && !tame) && st != SKV_ERR_OUT_OF_MEMORY)
                skvf_fail("skv_prefill(l %d, b %d, n %lld) of valid arguments failed: %s", l, b, (long long)n,
                          skv_last_error());
            if (n_why == 1 && st != reason_status[one])
                skvf_fail("skv_prefill: want status %d, got %d (%s)", (int)reason_status[one], (int)st,
                          skv_last_error());
            if (n_why > 1) {
                int ok = 0;
                for (int r = 0; r < R_COUNT; r++) ok |= why[r] && st == reason_status[r];
                if (!ok) skvf_fail("skv_prefill: status %d matches none of the bad arguments (%s)", (int)st,
                                   skv_last_error());
            }
            const char *ce = skv_cache_last_error(cache);
            if (!ce || !*ce) skvf_fail("skv_prefill failed with %d but skv_cache_last_error is empty", (int)st);
            if (skvf_fingerprint(cache) != before)
                skvf_fail("skv_prefill failed with %d (%s) but the cache changed", (int)st, skv_last_error());
        }
        skvf_guarded_free(kp, "k_pre");
        skvf_guarded_free(vv, "v");
        skvf_guarded_free(ko, "k_post");
    }

    /* Sometimes complete the cache with valid prompts so the decode path runs. */
    if (skvf_bool(&d)) {
        for (int32_t l = 0; l < L; l++)
            for (int32_t b = 0; b < B; b++) {
                if (done[l][b]) continue;
                const int64_t n = skvf_range(&d, minp, maxp);
                const size_t e = (size_t)(n * row);
                skv_bf16 *kp = skvf_guarded_alloc(e * sizeof *kp), *vv = skvf_guarded_alloc(e * sizeof *vv);
                skvf_fill_bf16(&d, kp, e, 0);
                skvf_fill_bf16(&d, vv, e, 0);
                skvf_clamp_magnitude(kp, e);
                skvf_clamp_magnitude(vv, e);
                st = skv_prefill(cache, l, b, n, kp, vv, NULL);
                skvf_check_status(st, "skv_prefill (completion)");
                if (st != SKV_OK && !(st == SKV_ERR_NUMERICAL && (max_abs(kp, e) > 1e4f || max_abs(vv, e) > 1e4f)))
                    skvf_fail("skv_prefill of valid finite data failed: %s", skv_last_error());
                if (st == SKV_OK) done[l][b] = 1, n_done++;
                skvf_guarded_free(kp, "k_pre");
                skvf_guarded_free(vv, "v");
            }
    }

    if (n_done == L * B) {
        const size_t eq = (size_t)B * cfg.n_q_heads * cfg.head_dim, ek = (size_t)B * row;
        skv_bf16 *q = skvf_guarded_alloc(eq * sizeof *q), *k = skvf_guarded_alloc(ek * sizeof *k);
        skv_bf16 *v = skvf_guarded_alloc(ek * sizeof *v);
        float *out = skvf_guarded_alloc(eq * sizeof *out);
        for (int32_t l = 0; l < L; l++) {
            skvf_fill_bf16(&d, q, eq, 0);
            skvf_fill_bf16(&d, k, ek, 0);
            skvf_fill_bf16(&d, v, ek, 0);
            /* within the library's input bounds: the raw-bytes fill reaches 3.4e38, which decode
               refuses (SKV_MAX_INPUT_MAGNITUDE); fuzz_decode covers that refusal */
            skvf_clamp_magnitude(q, eq);
            skvf_clamp_magnitude(k, ek);
            skvf_clamp_magnitude(v, ek);
            st = skv_decode(cache, l, q, k, v, out);
            skvf_check_status(st, "skv_decode after complete prefill");
            if (st != SKV_OK) skvf_fail("skv_decode after every slot was prefilled: %s", skv_last_error());
            skvf_guarded_check(out, "decode out");
        }
        skvf_guarded_free(q, "q");
        skvf_guarded_free(k, "k");
        skvf_guarded_free(v, "v");
        skvf_guarded_free(out, "out");
    } else {
        /* decode before every slot is prefilled: NOT_PREFILLED, nothing changes */
        const size_t eq = (size_t)B * cfg.n_q_heads * cfg.head_dim, ek = (size_t)B * row;
        skv_bf16 *q = calloc(eq, sizeof *q), *k = calloc(ek, sizeof *k), *v = calloc(ek, sizeof *v);
        float *out = calloc(eq, sizeof *out);
        if (!q || !k || !v || !out) skvf_fail("out of memory");
        const uint64_t before = skvf_fingerprint(cache);
        st = skv_decode(cache, 0, q, k, v, out);
        skvf_check_status(st, "skv_decode before prefill");
        if (st != SKV_ERR_NOT_PREFILLED) skvf_fail("skv_decode with %d of %d slots prefilled: status %d",
                                                   n_done, L * B, (int)st);
        if (skvf_fingerprint(cache) != before) skvf_fail("skv_decode (NOT_PREFILLED) changed the cache");
        free(q);
        free(k);
        free(v);
        free(out);
    }
    skv_cache_free(cache);
    return 0;
}
