/*
 * fuzz_common.h - shared by the libFuzzer harnesses in fuzz/: a data producer
 * that carves bounded parameters and tensors out of the fuzz input, the
 * invariants every harness asserts, and a cache fingerprint to prove "after
 * any error the cache is unchanged".
 *
 * Every harness defines LLVMFuzzerTestOneInput(data, size). Built two ways:
 *  - `make fuzz`: clang -fsanitize=fuzzer,address,undefined (libFuzzer main);
 *  - `make check`: gcc, linked with fuzz/replay.c, which runs every file of
 *    fuzz/corpus/<harness>/ through the harness once (no libFuzzer needed).
 * A violated invariant calls skvf_fail(), which prints and aborts: libFuzzer
 * reports it as a crash and saves the input; the replay driver dies with it.
 */
#ifndef SKV_FUZZ_COMMON_H
#define SKV_FUZZ_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "shadowkv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- data producer ------------------------------------------------------------------ */

/* Reads from the front of the input; once it is used up every read returns 0 bytes
   (so every call is defined for any input, including the empty one). */
typedef struct skvf_data {
    const uint8_t *p;
    size_t n;
} skvf_data;

void skvf_init(skvf_data *d, const uint8_t *data, size_t size);
uint64_t skvf_u64(skvf_data *d);
uint32_t skvf_u32(skvf_data *d);
uint8_t skvf_u8(skvf_data *d);
int skvf_bool(skvf_data *d);
/* An integer in [lo, hi] (hi >= lo). */
int64_t skvf_range(skvf_data *d, int64_t lo, int64_t hi);
/* One of the n values in list. */
int64_t skvf_pick(skvf_data *d, const int64_t *list, int n);
/* A "wild" int32: mostly small and near boundaries (0, -1, 1, INT32_MAX, ...), sometimes any. */
int32_t skvf_wild_i32(skvf_data *d);
/* A float: mostly ordinary magnitudes, sometimes 0, -0, tiny, huge, Inf, NaN. */
float skvf_float(skvf_data *d);
/* n bf16 values: a pattern (normal-ish, constant, ramps, copies of earlier rows for ties)
   with, when allow_bad, occasional NaN/Inf planted. Deterministic from the input. */
void skvf_fill_bf16(skvf_data *d, skv_bf16 *x, size_t n, int allow_bad);
/* Elements beyond SKV_MAX_INPUT_MAGNITUDE (2^32) become +-2^32, NaN and Inf stay: for
   harnesses whose subject is not the magnitude check (prefill data of fuzz_decode/fuzz_diff). */
void skvf_clamp_magnitude(skv_bf16 *x, size_t n);
/* A backend to test against: ref or cpu (never cuda: the harnesses pass host memory). */
skv_backend skvf_backend(skvf_data *d);

/* ---- invariants ---------------------------------------------------------------------- */

/* Prints "fuzz invariant violated: ..." to stderr and aborts. */
void skvf_fail(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2), noreturn))
#endif
    ;
/* The status is a defined skv_status value, and a failing status left a non-empty
   skv_last_error() message. */
void skvf_check_status(skv_status st, const char *what);

/* Bytes in a canary zone around a heap buffer: skvf_guarded_alloc returns bytes of
   usable memory between two canary zones; skvf_guarded_check aborts if a zone changed;
   skvf_guarded_free checks and frees. */
void *skvf_guarded_alloc(size_t bytes);
void skvf_guarded_check(const void *p, const char *what);
void skvf_guarded_free(void *p, const char *what);

/* ---- output checks --------------------------------------------------------------------- */

/* Outputs compared with an oracle so far: skvf_checked[0] on ref, [1] on cpu. A harness calls
   skvf_note_checked once per successful call whose output it compared with an oracle (more
   than "written" or "finite"). The replay driver prints the counts and fails when a harness
   checked outputs but none on cpu: such a corpus lets a wrong cpu kernel pass. */
extern long skvf_checked[2];
void skvf_note_checked(skv_backend be);

/* ---- cache fingerprint ----------------------------------------------------------------- */

/* A hash of everything a caller can observe of a cache without changing it: config,
   seq_info of every (layer, seq), selected/outliers/candidates/landmarks of every
   (layer, seq, kv head) where defined, and the call counters of the stats. */
uint64_t skvf_fingerprint(skv_cache *cache);

/* A small valid config carved from the input: every size bounded so that create,
   prefill and decode of one input run in milliseconds (n_layers <= 2, batch <= 2,
   Hk <= 2, G <= 4, D in {8, 16, 32, 64}, chunk in {1, 2, 4, 8}, budget <= 8 chunks,
   O <= 4, Lc <= 2, max_prompt_len <= 512, gen_capacity <= 4). backend from skvf_backend. */
skv_config skvf_small_config(skvf_data *d);

/* skvf_small_config, then skv_cache_create; a failure is an invariant violation. */
skv_cache *skvf_small_cache(skvf_data *d, skv_config *cfg);

/* Shortest prompt a config accepts: (O + S + Lc) * c tokens. */
int64_t skvf_min_prompt(const skv_config *cfg);

/* ---- decode oracle ---------------------------------------------------------------------- */

/*
 * What a harness keeps of one (layer, seq) so that decode steps can be checked against an
 * oracle independent of the library's decode path: copies of the prompt, the rank-r
 * factorization the cache's backend computes for it (skv_op_factorize on the same backend,
 * deterministic, rounded to bf16 as the cache stores it: a rank-r factorization is not
 * unique, so the oracle takes the cache's), and the generated tokens appended so far.
 */
typedef struct skvf_slot {
    int64_t n;                     /* prompt length; 0 = not prefilled */
    skv_bf16 *k_pre, *v, *k_post;  /* [n, Hk, D]; k_post NULL when prefill ropes itself */
    skv_bf16 *u, *w;               /* [n, r], [r, Hk*D] bf16; NULL when the factorization failed */
    int32_t n_gen, cap;
    skv_bf16 *gen_k, *gen_v;       /* [cap, Hk, D] */
} skvf_slot;

/* After a successful skv_prefill of (cfg's cache on backend be): records the prompt. */
void skvf_slot_prefilled(skvf_slot *s, const skv_config *cfg, skv_backend be, int64_t n, const skv_bf16 *k_pre,
                         const skv_bf16 *v, const skv_bf16 *k_post);
/* After a successful step: appends sequence b's new k, v ([Hk, D] each). */
void skvf_slot_append(skvf_slot *s, const skv_config *cfg, const skv_bf16 *k, const skv_bf16 *v);
void skvf_slot_free(skvf_slot *s);

/*
 * After a successful skv_decode(cache, layer, q, k, v, out) whose k, v the slots already
 * hold (skvf_slot_append): for every sequence b (slots[b] is (layer, b)) and KV head,
 *  - the outliers and candidates partition the N context chunks, and the selected chunks
 *    are the top S candidates of a_j = max over the GQA group of the softmax over the
 *    candidates of scale q . landmark_j (recomputed in double from q and the landmarks the
 *    cache reports, within the float rounding of the library's computation);
 *  - out equals, within a bound derived from the rounding the library is allowed (bf16
 *    rebuilt and roped keys, float scores, exp and sums), a double-precision attention of
 *    q over the tokens the cache reports it used: its outlier chunks, its local window,
 *    its selected chunks (keys rebuilt from slots[b].u, .w and RoPE'd in double, values
 *    from the prompt) and the generated tokens including this step's.
 * A slot without a factorization skips the output check of its selected keys' sequence.
 * Violations call skvf_fail naming who (e.g. "ref"), the layer, sequence and head.
 */
void skvf_check_decode(skv_cache *cache, const skv_config *cfg, int32_t layer, const skvf_slot *slots,
                       const skv_bf16 *q, const float *out, const char *who);

#ifdef __cplusplus
}
#endif

#endif
