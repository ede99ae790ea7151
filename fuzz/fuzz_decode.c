/*
 * fuzz_decode.c - skv_decode and the introspection calls on a small cache
 * (skvf_small_config) prefilled with valid data (sometimes with one slot left
 * unprefilled), then a carved sequence of decode steps: bad layer, NULL
 * pointers, NaN/Inf in q/k/v, steps past gen_capacity; introspection with
 * carved (layer, seq, head) and NULL outputs in between.
 *
 * Asserts: every status is defined; a step with exactly one thing wrong
 * returns that thing's status (a layer a step ahead of another is
 * INVALID_ARGUMENT; a value beyond SKV_MAX_INPUT_MAGNITUDE is NONFINITE), a
 * step with nothing wrong succeeds; after any error skvf_fingerprint is
 * unchanged (nothing appended, previous selection kept); after a success
 * n_generated advanced on that layer only, every selected chunk is a
 * candidate (increasing), the output is finite when every input (prompt and
 * step) had magnitude <= 1e4, and skvf_check_decode's oracle holds: the
 * selection is the top S of the scores recomputed from q and the landmarks,
 * and the output is a double-precision attention over the tokens the cache
 * reports it used. Introspection returns the status its arguments call for,
 * never writes past the size seq_info gives, and changes nothing.
 *
 * Layers: mostly the next layer in step (the one with the fewest generated
 * tokens), sometimes any layer or a carved bad index.
 */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"

#define TAME 1e4f

enum { R_NULL, R_RANGE, R_NOTPRE, R_CAP, R_AHEAD, R_NONFINITE, R_COUNT };
static const skv_status reason_status[R_COUNT] = {SKV_ERR_NULL_POINTER, SKV_ERR_INVALID_ARGUMENT,
                                                  SKV_ERR_NOT_PREFILLED, SKV_ERR_CAPACITY,
                                                  SKV_ERR_INVALID_ARGUMENT, SKV_ERR_NONFINITE};

static int32_t carve_index(skvf_data *d, int32_t count)
{
    static const int64_t bad[] = {-1, -2, INT32_MAX, INT32_MIN, 64, 65536};
    uint8_t sel = skvf_u8(d);
    if (sel < 224) return (int32_t)skvf_range(d, 0, count - 1);
    if (sel < 240) return count + (int32_t)skvf_range(d, 0, 1);
    return (int32_t)skvf_pick(d, bad, 6);
}

/* Every element finite and within SKV_MAX_INPUT_MAGNITUDE (2^32, bf16 0x4F80). */
static int all_finite(const skv_bf16 *x, size_t n)
{
    for (size_t i = 0; x && i < n; i++)
        if ((x[i] & 0x7FFF) > 0x4F80) return 0;
    return 1;
}

static int all_tame(const skv_bf16 *x, size_t n)
{
    for (size_t i = 0; x && i < n; i++)
        if (!(fabsf(skv_bf16_to_float(x[i])) <= TAME)) return 0;
    return 1;
}

/* Carved introspection of (layer, seq, head): statuses as documented, outputs within
   bounds, nothing changes. */
static void introspect(skvf_data *d, skv_cache *c, const skv_config *cfg, const unsigned char done[2][2])
{
    const int32_t l = carve_index(d, cfg->n_layers), b = carve_index(d, cfg->batch_size);
    const int32_t h = carve_index(d, cfg->n_kv_heads);
    const int which = (int)skvf_range(d, 0, 4), null_out = skvf_u8(d) < 24;
    const int in_range = l >= 0 && l < cfg->n_layers && b >= 0 && b < cfg->batch_size;
    const uint64_t before = skvf_fingerprint(c);
    skv_seq_info in;
    memset(&in, 0, sizeof in);
    if (in_range && skv_cache_seq_info(c, l, b, &in) != SKV_OK) skvf_fail("seq_info(%d, %d) in range failed", l, b);
    if (which == 4) {
        skv_status st = skv_cache_seq_info(c, l, b, null_out ? NULL : &in);
        skvf_check_status(st, "skv_cache_seq_info");
        skv_status want = null_out ? SKV_ERR_NULL_POINTER : in_range ? SKV_OK : SKV_ERR_INVALID_ARGUMENT;
        if (st != want && !(null_out && !in_range && st == SKV_ERR_INVALID_ARGUMENT))
            skvf_fail("skv_cache_seq_info(%d, %d, %s): status %d, want %d", l, b, null_out ? "NULL" : "info",
                      (int)st, (int)want);
    } else {
        /* exact output sizes from seq_info (1 element when it does not say) */
        const int pre = in_range && done[l][b];
        size_t count = 1;
        if (pre) count = which == 0 ? (size_t)in.n_selected : which == 1 ? (size_t)in.n_outliers
                       : which == 2 ? (size_t)in.n_candidates : (size_t)in.n_candidates * (size_t)cfg->head_dim;
        const size_t bytes = count * (which == 3 ? sizeof(skv_bf16) : sizeof(int32_t));
        void *buf = null_out ? NULL : skvf_guarded_alloc(bytes);
        skv_status st;
        static const char *const names[4] = {"skv_cache_selected", "skv_cache_outliers", "skv_cache_candidates",
                                             "skv_cache_landmarks"};
        switch (which) {
        case 0: st = skv_cache_selected(c, l, b, h, buf); break;
        case 1: st = skv_cache_outliers(c, l, b, h, buf); break;
        case 2: st = skv_cache_candidates(c, l, b, h, buf); break;
        default: st = skv_cache_landmarks(c, l, b, h, buf); break;
        }
        skvf_check_status(st, names[which]);
        skvf_guarded_free(buf, names[which]);
        const int h_ok = h >= 0 && h < cfg->n_kv_heads;
        int ok_set[SKV_STATUS_COUNT] = {0};
        if (null_out) ok_set[SKV_ERR_NULL_POINTER] = 1;
        if (!in_range || !h_ok) ok_set[SKV_ERR_INVALID_ARGUMENT] = 1;
        if (in_range && !pre) ok_set[SKV_ERR_NOT_PREFILLED] = 1;
        if (which == 0 && in_range && pre && !in.has_selection) ok_set[SKV_ERR_NO_SELECTION] = 1;
        int n_bad = 0;
        for (int i = 0; i < SKV_STATUS_COUNT; i++) n_bad += ok_set[i];
        if (n_bad == 0 ? st != SKV_OK : !ok_set[st])
            skvf_fail("%s(l %d, b %d, h %d, %s): status %d (%s) not the one its arguments call for", names[which],
                      l, b, h, null_out ? "NULL" : "buf", (int)st, skv_last_error());
    }
    if (skvf_fingerprint(c) != before) skvf_fail("an introspection call changed the cache");
}

/* After a successful step: selected chunks are increasing candidates. */
static void check_selection(skv_cache *c, const skv_config *cfg, int32_t l)
{
    for (int32_t b = 0; b < cfg->batch_size; b++) {
        skv_seq_info in;
        if (skv_cache_seq_info(c, l, b, &in) != SKV_OK || !in.has_selection)
            skvf_fail("seq_info(%d, %d) after a decode step: no selection", l, b);
        int32_t *sel = malloc(((size_t)in.n_selected + 1) * sizeof *sel);
        int32_t *cand = malloc(((size_t)in.n_candidates + 1) * sizeof *cand);
        if (!sel || !cand) skvf_fail("out of memory");
        for (int32_t h = 0; h < cfg->n_kv_heads; h++) {
            if (skv_cache_selected(c, l, b, h, sel) != SKV_OK || skv_cache_candidates(c, l, b, h, cand) != SKV_OK)
                skvf_fail("selected/candidates(%d, %d, %d) after a decode step failed: %s", l, b, h,
                          skv_last_error());
            int32_t j = 0;
            for (int32_t i = 0; i < in.n_selected; i++) {
                if (i && sel[i] <= sel[i - 1]) skvf_fail("selected ids of (%d, %d, %d) not increasing", l, b, h);
                while (j < in.n_candidates && cand[j] < sel[i]) j++;
                if (j == in.n_candidates || cand[j] != sel[i])
                    skvf_fail("selected chunk %d of (%d, %d, %d) is not a candidate", sel[i], l, b, h);
            }
        }
        free(sel);
        free(cand);
    }
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
    skvf_slot slots[2][2];
    memset(slots, 0, sizeof slots);
    int n_done = 0, tame = 1;
    /* sometimes one slot stays empty: every decode must then be NOT_PREFILLED */
    const int skip = skvf_u8(&d) < 24 ? (int)skvf_range(&d, 0, L * B - 1) : -1;
    for (int32_t l = 0; l < L; l++)
        for (int32_t b = 0; b < B; b++) {
            if (l * B + b == skip) continue;
            const int64_t n = skvf_range(&d, minp, maxp);
            const size_t e = (size_t)(n * row);
            skv_bf16 *kp = malloc(e * sizeof *kp), *vv = malloc(e * sizeof *vv), *ko = NULL;
            if (!kp || !vv) skvf_fail("out of memory");
            skvf_fill_bf16(&d, kp, e, 0);
            skvf_fill_bf16(&d, vv, e, 0);
            skvf_clamp_magnitude(kp, e); /* valid prompts: the decode steps are the subject here */
            skvf_clamp_magnitude(vv, e);
            if (skvf_bool(&d)) {
                ko = malloc(e * sizeof *ko);
                if (!ko) skvf_fail("out of memory");
                skvf_fill_bf16(&d, ko, e, 0);
                skvf_clamp_magnitude(ko, e);
            }
            const int t = all_tame(kp, e) && all_tame(vv, e) && all_tame(ko, ko ? e : 0);
            st = skv_prefill(cache, l, b, n, kp, vv, ko);
            skvf_check_status(st, "skv_prefill");
            if (st == SKV_OK) skvf_slot_prefilled(&slots[l][b], &cfg, cfg.backend, n, kp, vv, ko);
            free(kp);
            free(vv);
            free(ko);
            if (st != SKV_OK && !(st == SKV_ERR_NUMERICAL && !t))
                skvf_fail("skv_prefill of valid finite data failed: %s", skv_last_error());
            if (st == SKV_OK) done[l][b] = 1, n_done++, tame &= t;
        }
    const int complete = n_done == L * B;

    const size_t eq = (size_t)B * cfg.n_q_heads * cfg.head_dim, ek = (size_t)B * row;
    skv_bf16 *q = skvf_guarded_alloc(eq * sizeof *q), *k = skvf_guarded_alloc(ek * sizeof *k);
    skv_bf16 *v = skvf_guarded_alloc(ek * sizeof *v);
    float *out = skvf_guarded_alloc(eq * sizeof *out);
    int32_t gen[2] = {0, 0};
    const int n_steps = (int)skvf_range(&d, 1, 2 * (cfg.gen_capacity + 1) * L);
    for (int step = 0; step < n_steps && d.n > 0; step++) {
        if (skvf_u8(&d) < 64) introspect(&d, cache, &cfg, done);
        int32_t next = 0; /* the layer in step: the first with the fewest generated tokens */
        for (int32_t ll = 1; ll < L; ll++)
            if (gen[ll] < gen[next]) next = ll;
        const uint8_t how = skvf_u8(&d);
        const int32_t l = how < 32 ? carve_index(&d, L) : how < 64 ? (int32_t)skvf_range(&d, 0, L - 1) : next;
        const int nq = skvf_u8(&d) < 8, nk = skvf_u8(&d) < 8, nv = skvf_u8(&d) < 8, no = skvf_u8(&d) < 8;
        const int allow_bad = skvf_u8(&d) < 40;
        skvf_fill_bf16(&d, q, eq, allow_bad);
        skvf_fill_bf16(&d, k, ek, allow_bad);
        skvf_fill_bf16(&d, v, ek, allow_bad);
        const int in_range = l >= 0 && l < L;
        int why[R_COUNT] = {0};
        why[R_NULL] = nq || nk || nv || no;
        why[R_RANGE] = !in_range;
        why[R_NOTPRE] = !complete;
        why[R_CAP] = in_range && gen[l] >= cfg.gen_capacity;
        why[R_AHEAD] = in_range && gen[l] > gen[next];
        why[R_NONFINITE] = (!nq && !all_finite(q, eq)) || (!nk && !all_finite(k, ek)) || (!nv && !all_finite(v, ek));
        int n_why = 0, one = -1;
        for (int r = 0; r < R_COUNT; r++)
            if (why[r]) n_why++, one = r;
        const int step_tame = all_tame(q, eq) && all_tame(k, ek) && all_tame(v, ek);

        const uint64_t before = skvf_fingerprint(cache);
        st = skv_decode(cache, l, nq ? NULL : q, nk ? NULL : k, nv ? NULL : v, no ? NULL : out);
        skvf_check_status(st, "skv_decode");
        skvf_guarded_check(q, "q");
        skvf_guarded_check(k, "k");
        skvf_guarded_check(v, "v");
        skvf_guarded_check(out, "out");
        if (st == SKV_OK) {
            if (n_why) skvf_fail("skv_decode(layer %d) succeeded although argument class %d is bad", l, one);
            gen[l]++;
            for (int32_t b = 0; b < B; b++)
                skvf_slot_append(&slots[l][b], &cfg, k + (size_t)b * row, v + (size_t)b * row);
            skvf_check_decode(cache, &cfg, l, slots[l], q, out, skv_backend_name(cfg.backend));
            for (int32_t ll = 0; ll < L; ll++)
                for (int32_t b = 0; b < B; b++) {
                    skv_seq_info in;
                    if (skv_cache_seq_info(cache, ll, b, &in) != SKV_OK || in.n_generated != gen[ll])
                        skvf_fail("seq_info(%d, %d).n_generated = %d after a step, want %d", ll, b, in.n_generated,
                                  gen[ll]);
                }
            check_selection(cache, &cfg, l);
            if (tame && step_tame)
                for (size_t i = 0; i < eq; i++)
                    if (!isfinite(out[i]))
                        skvf_fail("skv_decode(layer %d): out[%zu] = %g from inputs of magnitude <= %g", l, i,
                                  (double)out[i], (double)TAME);
        } else {
            if (n_why == 0) skvf_fail("skv_decode(layer %d) of valid arguments failed: %s", l, skv_last_error());
            if (n_why == 1 && st != reason_status[one])
                skvf_fail("skv_decode: want status %d, got %d (%s)", (int)reason_status[one], (int)st,
                          skv_last_error());
            if (n_why > 1) {
                int ok = 0;
                for (int r = 0; r < R_COUNT; r++) ok |= why[r] && st == reason_status[r];
                if (!ok) skvf_fail("skv_decode: status %d matches none of the bad arguments (%s)", (int)st,
                                   skv_last_error());
            }
            const char *ce = skv_cache_last_error(cache);
            if (!ce || !*ce) skvf_fail("skv_decode failed with %d but skv_cache_last_error is empty", (int)st);
            if (skvf_fingerprint(cache) != before)
                skvf_fail("skv_decode failed with %d (%s) but the cache changed", (int)st, skv_last_error());
        }
    }
    introspect(&d, cache, &cfg, done);
    if (skv_cache_sync(cache) != SKV_OK) skvf_fail("skv_cache_sync on ref/cpu");
    skv_stats stt;
    st = skv_cache_stats(cache, &stt);
    skvf_check_status(st, "skv_cache_stats");
    if (st != SKV_OK || stt.n_decode_calls != gen[0] + gen[1] || stt.decode_allocations < 0)
        skvf_fail("skv_cache_stats: status %d, n_decode_calls %lld, want %d", (int)st,
                  (long long)stt.n_decode_calls, gen[0] + gen[1]);
    if (skv_cache_stats(cache, NULL) != SKV_ERR_NULL_POINTER) skvf_fail("skv_cache_stats(cache, NULL)");
    skvf_check_status(skv_cache_stats_reset(cache), "skv_cache_stats_reset");
    skvf_guarded_free(q, "q");
    skvf_guarded_free(k, "k");
    skvf_guarded_free(v, "v");
    skvf_guarded_free(out, "out");
    skv_cache_free(cache);
    for (int32_t l = 0; l < 2; l++)
        for (int32_t b = 0; b < 2; b++) skvf_slot_free(&slots[l][b]);
    return 0;
}
