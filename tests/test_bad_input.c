/*
 * test_bad_input.c - every class of bad input gets its own status, a message
 * naming the bad argument (and its value where it has one), and leaves the
 * cache exactly as it was.
 *
 * Run on the ref and cpu backends (config.backend; SKV_BACKEND is unset for
 * the run and only set by the environment cases).
 *
 * State is proven unchanged with twin caches: A and B are built from the same
 * config and inputs, bad calls go to A only, and after each bad call the whole
 * introspection of A and B (seq_info, outliers, candidates, landmarks,
 * selected, their statuses, the prefill/decode call counters) is compared
 * bitwise; the same valid decode steps then run on both and their float
 * outputs are compared bitwise.
 *
 * Cases:
 *  - config: every invalid field through skv_config_validate, skv_cache_memory
 *    (outputs untouched) and skv_cache_create (*out = NULL): zero/negative
 *    sizes, Hq % Hk, odd/huge head_dim, budget % c, rank above Hk * D (a rank
 *    above the shortest valid prompt validates), rank 0 with rank_max or
 *    rank_error_target out of range, max_prompt_len too small / too large, gen_capacity too large,
 *    negative O/Lc/n_threads, n_threads above SKV_MAX_THREADS, rope (theta,
 *    rotary_dim, interleaved, llama3_scaling and its factors), attn_scale,
 *    backend enum, size overflow, an unallocatable (beyond the address space)
 *    cache -> OUT_OF_MEMORY; a cpu cache whose threads cannot be started (a
 *    child under RLIMIT_AS) -> OUT_OF_MEMORY naming n_threads.
 *  - backends: SKV_BACKEND=bogus/cuda/auto/ref/"" (read for cfg.backend = auto only; an
 *    explicit backend wins), cfg.backend = cuda/auto,
 *    skv_backend_parse / skv_backend_available.
 *  - NULL pointers of every cache entry point and every skv_op_*.
 *  - out-of-range layer/seq/kv_head; prompt too short/long (the message's
 *    chunk counts, n = 0 included), n < 0 (INVALID_ARGUMENT).
 *  - decode before prefill (nothing; all but one slot), prefill twice,
 *    generated-token capacity, a layer decoded a step ahead of another,
 *    NaN/Inf (both signs) and finite values beyond SKV_MAX_INPUT_MAGNITUDE in
 *    every input tensor, introspection before prefill / before decode.
 *  - limits: inputs at exactly +-SKV_MAX_INPUT_MAGNITUDE give finite
 *    landmarks and outputs; the layers may take a token's step in any order.
 *  - skv_cache_backend(NULL) names no backend; skv-bench --help lists its
 *    subcommands, an unknown option or subcommand says so.
 *  - op-level bad sizes, bad indices, NaN inputs, outputs untouched.
 *  - skv_status_string.
 */
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "testutil.h"

/* ---- the small shape -------------------------------------------------------- */

#define NL 2      /* layers */
#define NB 2      /* batch */
#define HQ 8
#define HK 2
#define HD 64
#define RANK 32
#define CH 8
#define BUDGET 64
#define SEL (BUDGET / CH)
#define NOUT 4
#define NLOC 2
#define GCAP 4
#define MAXP 256
#define MINP ((NOUT + SEL + NLOC) * CH) /* 112: shortest valid prompt */
#define MAXCAND (MAXP / CH - NLOC - NOUT)

static skvt_rng rng;
static char lbl[512]; /* label of the current case */

static const skv_bf16 BF_NAN = 0x7FC0, BF_PINF = 0x7F80, BF_NINF = 0xFF80;
static const skv_bf16 bad_vals[4] = {0x7FC0, 0xFFC1, 0x7F80, 0xFF80};
static const char *const bad_names[4] = {"NaN", "-NaN", "+Inf", "-Inf"};
/* finite bf16 values beyond SKV_MAX_INPUT_MAGNITUDE = 2^32 (0x4F80): the next one up, its
   negative, ~3e37 (the keys that used to give all-NaN output), the largest finite */
#define N_HUGE 4
static const skv_bf16 huge_vals[N_HUGE] = {0x4F81, 0xCF81, 0x7DB4, 0xFF7F};
static const char *const huge_names[N_HUGE] = {"2^32 (1 + 2^-7)", "-2^32 (1 + 2^-7)", "3e37", "-3.39e38"};

/* ---- message checks ------------------------------------------------------------ */

static int is_ident(char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_';
}

/* word occurs in msg not glued to identifier characters on either side */
static int has_word(const char *msg, const char *word)
{
    size_t n = strlen(word);
    if (!msg || !n) return 0;
    for (const char *p = strstr(msg, word); p; p = strstr(p + 1, word)) {
        int left_ok = p == msg || !is_ident(p[-1]) || !is_ident(word[0]);
        int right_ok = !is_ident(p[n]) || !is_ident(word[n - 1]);
        if (left_ok && right_ok) return 1;
    }
    return 0;
}

/*
 * Checks the status and that skv_last_error() (and the cache's message when
 * c != NULL) contains w1 and w2 as words (NULL: not checked).
 */
static void expect_err(skv_status got, skv_status want, skv_cache *c, const char *w1,
                       const char *w2)
{
    SKVT_CHECK_STATUS(got, want, lbl);
    if (got != want || want == SKV_OK) return;
    const char *m = skv_last_error();
    SKVT_CHECK(m && *m, "%s: skv_last_error() is empty", lbl);
    if (w1) SKVT_CHECK(has_word(m, w1), "%s: skv_last_error() \"%s\" does not name \"%s\"", lbl, m, w1);
    if (w2) SKVT_CHECK(has_word(m, w2), "%s: skv_last_error() \"%s\" does not name \"%s\"", lbl, m, w2);
    if (c) {
        const char *cm = skv_cache_last_error(c);
        SKVT_CHECK(cm && strcmp(cm, m) == 0, "%s: skv_cache_last_error() \"%s\" != skv_last_error() \"%s\"",
                   lbl, cm ? cm : "(null)", m);
    }
}

static void expect_substr(const char *what, const char *sub)
{
    const char *m = skv_last_error();
    SKVT_CHECK(strstr(m, sub) != NULL, "%s: %s message \"%s\" lacks \"%s\"", lbl, what, m, sub);
}

#define LBL(...) snprintf(lbl, sizeof lbl, __VA_ARGS__)

static const char *i64s(int64_t v)
{
    static char buf[8][32];
    static int k;
    k = (k + 1) % 8;
    snprintf(buf[k], sizeof buf[k], "%lld", (long long)v);
    return buf[k];
}

/* ---- fixture: config and all inputs --------------------------------------------- */

typedef struct fixture {
    skv_config cfg;
    int64_t n[NB];
    skv_bf16 *kpre[NL][NB], *v[NL][NB], *kpost[NL][NB]; /* kpost NULL on layer 0 */
    skv_bf16 *dq[GCAP + 1][NL], *dk[GCAP + 1][NL], *dv[GCAP + 1][NL];
} fixture;

/* SKVT_CHECK_STATUS evaluates its first argument twice: calls go through here */
static void check_ok(skv_status st, const char *what) { SKVT_CHECK_STATUS(st, SKV_OK, what); }

static skv_config base_config(skv_backend be)
{
    skv_config c = skv_config_default();
    c.n_layers = NL;
    c.n_q_heads = HQ;
    c.n_kv_heads = HK;
    c.head_dim = HD;
    c.rank = RANK;
    c.chunk_size = CH;
    c.budget = BUDGET;
    c.n_outlier_chunks = NOUT;
    c.n_local_chunks = NLOC;
    c.batch_size = NB;
    c.max_prompt_len = MAXP;
    c.gen_capacity = GCAP;
    c.backend = be;
    return c;
}

static skv_bf16 *rand_bf16(size_t n, double scale)
{
    skv_bf16 *x = malloc(n * sizeof *x);
    if (!x) abort();
    skvt_fill_bf16_normal(&rng, x, n, scale);
    return x;
}

static skv_bf16 *dup_bf16(const skv_bf16 *x, size_t n)
{
    skv_bf16 *y = malloc(n * sizeof *y);
    if (!y) abort();
    memcpy(y, x, n * sizeof *y);
    return y;
}

static void fixture_make(fixture *fx, skv_backend be)
{
    memset(fx, 0, sizeof *fx);
    fx->cfg = base_config(be);
    fx->n[0] = skvt_rng_range(&rng, MINP, MAXP);
    do fx->n[1] = skvt_rng_range(&rng, MINP, MAXP);
    while (fx->n[1] == fx->n[0]);
    size_t tab = skv_rope_table_len(&fx->cfg.rope, HD, MAXP);
    float *cs = malloc(tab * sizeof *cs), *sn = malloc(tab * sizeof *sn);
    if (!cs || !sn) abort();
    check_ok(skv_rope_table_build(&fx->cfg.rope, HD, MAXP, cs, sn), "fixture rope tables");
    for (int l = 0; l < NL; l++)
        for (int b = 0; b < NB; b++) {
            size_t e = (size_t)fx->n[b] * HK * HD;
            fx->kpre[l][b] = rand_bf16(e, 1.0);
            fx->v[l][b] = rand_bf16(e, 1.0);
            if (l > 0) {
                fx->kpost[l][b] = malloc(e * sizeof(skv_bf16));
                if (!fx->kpost[l][b]) abort();
                check_ok(skv_op_rope(SKV_BACKEND_REF, &fx->cfg.rope, HD, fx->n[b], HK, 0, cs, sn,
                                              fx->kpre[l][b], fx->kpost[l][b]), "fixture k_post");
            }
        }
    free(cs);
    free(sn);
    for (int s = 0; s <= GCAP; s++)
        for (int l = 0; l < NL; l++) {
            fx->dq[s][l] = rand_bf16((size_t)NB * HQ * HD, 1.0);
            fx->dk[s][l] = rand_bf16((size_t)NB * HK * HD, 1.0);
            fx->dv[s][l] = rand_bf16((size_t)NB * HK * HD, 1.0);
        }
}

static void fixture_free(fixture *fx)
{
    for (int l = 0; l < NL; l++)
        for (int b = 0; b < NB; b++) {
            free(fx->kpre[l][b]);
            free(fx->v[l][b]);
            free(fx->kpost[l][b]);
        }
    for (int s = 0; s <= GCAP; s++)
        for (int l = 0; l < NL; l++) {
            free(fx->dq[s][l]);
            free(fx->dk[s][l]);
            free(fx->dv[s][l]);
        }
}

static skv_status prefill_slot(skv_cache *c, const fixture *fx, int l, int b)
{
    return skv_prefill(c, l, b, fx->n[b], fx->kpre[l][b], fx->v[l][b], fx->kpost[l][b]);
}

/* ---- snapshots of everything observable ------------------------------------------ */

typedef struct snap { unsigned char *p; size_t n, cap; } snap;

static void snap_put(snap *s, const void *x, size_t bytes)
{
    if (s->n + bytes > s->cap) {
        size_t nc = s->cap ? s->cap * 2 : 65536;
        while (nc < s->n + bytes) nc *= 2;
        s->p = realloc(s->p, nc);
        if (!s->p) abort();
        s->cap = nc;
    }
    memcpy(s->p + s->n, x, bytes);
    s->n += bytes;
}

static void snap_take(skv_cache *c, snap *s)
{
    s->n = 0;
    for (int l = 0; l < NL; l++)
        for (int b = 0; b < NB; b++) {
            skv_seq_info in;
            memset(&in, 0, sizeof in);
            int64_t f[10];
            f[0] = skv_cache_seq_info(c, l, b, &in);
            f[1] = in.prefilled;
            f[2] = in.n;
            f[3] = in.n_chunks;
            f[4] = in.n_candidates;
            f[5] = in.n_outliers;
            f[6] = in.n_selected;
            f[7] = in.n_local;
            f[8] = in.n_generated;
            f[9] = in.has_selection;
            snap_put(s, f, sizeof f);
            for (int h = 0; h < HK; h++) {
                int32_t ids[MAXCAND];
                skv_bf16 lm[MAXCAND * HD];
                int32_t st;
                memset(ids, 0, sizeof ids);
                st = skv_cache_outliers(c, l, b, h, ids);
                snap_put(s, &st, sizeof st);
                snap_put(s, ids, sizeof ids);
                memset(ids, 0, sizeof ids);
                st = skv_cache_candidates(c, l, b, h, ids);
                snap_put(s, &st, sizeof st);
                snap_put(s, ids, sizeof ids);
                memset(lm, 0, sizeof lm);
                st = skv_cache_landmarks(c, l, b, h, lm);
                snap_put(s, &st, sizeof st);
                snap_put(s, lm, sizeof lm);
                memset(ids, 0, sizeof ids);
                st = skv_cache_selected(c, l, b, h, ids);
                snap_put(s, &st, sizeof st);
                snap_put(s, ids, sizeof ids);
            }
        }
    skv_stats stt;
    memset(&stt, 0, sizeof stt);
    int32_t st = skv_cache_stats(c, &stt);
    snap_put(s, &st, sizeof st);
    snap_put(s, &stt.n_prefill_calls, sizeof stt.n_prefill_calls);
    snap_put(s, &stt.n_decode_calls, sizeof stt.n_decode_calls);
}

static snap snA, snB;

static int snap_equal(const snap *a, const snap *b) { return a->n == b->n && memcmp(a->p, b->p, a->n) == 0; }

/* A and B must be observably identical. */
static void same_state(skv_cache *A, skv_cache *B)
{
    snap_take(A, &snA);
    snap_take(B, &snB);
    SKVT_CHECK(snap_equal(&snA, &snB), "%s: cache A differs from its twin B after the bad call", lbl);
}

static int32_t seq_prefilled(skv_cache *c, int l, int b)
{
    skv_seq_info in;
    memset(&in, 0, sizeof in);
    if (skv_cache_seq_info(c, l, b, &in) != SKV_OK) return -1;
    return in.prefilled;
}

/* ---- valid decode on both twins, outputs compared bitwise ----------------------- */

static float outA[NB * HQ * HD], outB[NB * HQ * HD];

static void decode_layer_both(skv_cache *A, skv_cache *B, const fixture *fx, int step, int l)
{
    memset(outA, 0, sizeof outA);
    memset(outB, 0xFF, sizeof outB);
    skv_status sa = skv_decode(A, l, fx->dq[step][l], fx->dk[step][l], fx->dv[step][l], outA);
    skv_status sb = skv_decode(B, l, fx->dq[step][l], fx->dk[step][l], fx->dv[step][l], outB);
    LBL("%s decode step %d layer %d (A)", fx->cfg.backend == SKV_BACKEND_REF ? "ref" : "cpu", step, l);
    SKVT_CHECK_STATUS(sa, SKV_OK, lbl);
    LBL("%s decode step %d layer %d (B)", fx->cfg.backend == SKV_BACKEND_REF ? "ref" : "cpu", step, l);
    SKVT_CHECK_STATUS(sb, SKV_OK, lbl);
    int fin = 1;
    for (size_t i = 0; i < sizeof outA / sizeof outA[0]; i++) fin &= isfinite(outA[i]) != 0;
    SKVT_CHECK(fin, "%s: non-finite decode output", lbl);
    SKVT_CHECK(memcmp(outA, outB, sizeof outA) == 0,
               "%s: decode outputs of A and its twin B differ (bitwise)", lbl);
}

/* ---- status strings -------------------------------------------------------------- */

static void test_status_strings(void)
{
    static const char *const names[SKV_STATUS_COUNT] = {
        "SKV_OK", "SKV_ERR_INVALID_ARGUMENT", "SKV_ERR_NULL_POINTER", "SKV_ERR_INVALID_CONFIG",
        "SKV_ERR_SIZE_OVERFLOW", "SKV_ERR_PROMPT_TOO_SHORT", "SKV_ERR_PROMPT_TOO_LONG",
        "SKV_ERR_NOT_PREFILLED", "SKV_ERR_ALREADY_PREFILLED", "SKV_ERR_CAPACITY", "SKV_ERR_NONFINITE",
        "SKV_ERR_OUT_OF_MEMORY", "SKV_ERR_UNSUPPORTED", "SKV_ERR_NO_DEVICE", "SKV_ERR_NUMERICAL",
        "SKV_ERR_NO_SELECTION", "SKV_ERR_DEVICE", "SKV_ERR_FORMAT", "SKV_ERR_IO", "SKV_ERR_SEQ_STATE"};
    /* the enum values are pinned */
    static const int vals[SKV_STATUS_COUNT] = {
        SKV_OK, SKV_ERR_INVALID_ARGUMENT, SKV_ERR_NULL_POINTER, SKV_ERR_INVALID_CONFIG,
        SKV_ERR_SIZE_OVERFLOW, SKV_ERR_PROMPT_TOO_SHORT, SKV_ERR_PROMPT_TOO_LONG,
        SKV_ERR_NOT_PREFILLED, SKV_ERR_ALREADY_PREFILLED, SKV_ERR_CAPACITY, SKV_ERR_NONFINITE,
        SKV_ERR_OUT_OF_MEMORY, SKV_ERR_UNSUPPORTED, SKV_ERR_NO_DEVICE, SKV_ERR_NUMERICAL,
        SKV_ERR_NO_SELECTION, SKV_ERR_DEVICE, SKV_ERR_FORMAT, SKV_ERR_IO, SKV_ERR_SEQ_STATE};
    for (int i = 0; i < SKV_STATUS_COUNT; i++) {
        SKVT_CHECK(vals[i] == i, "status %s has value %d, want %d", names[i], vals[i], i);
        const char *s = skv_status_string((skv_status)i);
        if (!SKVT_CHECK(s != NULL, "skv_status_string(%d) is NULL", i)) continue;
        size_t n = strlen(names[i]);
        SKVT_CHECK(strncmp(s, names[i], n) == 0 && (s[n] == '\0' || s[n] == ':'),
                   "skv_status_string(%d) = \"%s\" does not start with %s", i, s, names[i]);
        for (int j = 0; j < i; j++)
            SKVT_CHECK(strcmp(s, skv_status_string((skv_status)j)) != 0,
                       "skv_status_string(%d) == skv_status_string(%d)", i, j);
    }
    const int oor[] = {-1, SKV_STATUS_COUNT, SKV_STATUS_COUNT + 1, 1000, INT_MAX, INT_MIN};
    for (size_t k = 0; k < sizeof oor / sizeof oor[0]; k++) {
        const char *s = skv_status_string((skv_status)oor[k]);
        SKVT_CHECK(s != NULL && *s, "skv_status_string(%d) is NULL or empty", oor[k]);
        if (!s) continue;
        for (int j = 0; j < SKV_STATUS_COUNT; j++)
            SKVT_CHECK(strcmp(s, skv_status_string((skv_status)j)) != 0,
                       "skv_status_string(%d) equals the string of valid status %d", oor[k], j);
    }
}

/* ---- config ----------------------------------------------------------------------- */

static int dummy_object;

/* validate, memory and create must all fail with want and a message naming w1 / w2. */
static void cfg_case(const skv_config *cfg, skv_status want, const char *w1, const char *w2, const char *what)
{
    char base[256];
    snprintf(base, sizeof base, "%s [%s]", what, skv_backend_name(cfg->backend));
    LBL("skv_config_validate: %s", base);
    expect_err(skv_config_validate(cfg), want, NULL, w1, w2);
    size_t d = 12345, h = 67890;
    LBL("skv_cache_memory: %s", base);
    expect_err(skv_cache_memory(cfg, &d, &h), want, NULL, w1, w2);
    SKVT_CHECK(d == 12345 && h == 67890, "%s: outputs written on failure", lbl);
    skv_cache *out = (skv_cache *)(void *)&dummy_object;
    LBL("skv_cache_create: %s", base);
    skv_status st = skv_cache_create(cfg, &out);
    expect_err(st, want, NULL, w1, w2);
    SKVT_CHECK(out == NULL, "%s: *out not set to NULL on failure", lbl);
    if (st == SKV_OK) skv_cache_free(out);
}

#define CFGCASE(mut, want, w1, w2)                        \
    do {                                                  \
        skv_config c_ = base;                             \
        mut;                                              \
        cfg_case(&c_, want, w1, w2, #mut);                \
    } while (0)

typedef struct int_field { const char *name; size_t off; } int_field;

static void test_config(skv_backend be)
{
    const skv_config base = base_config(be);
    const skv_status IC = SKV_ERR_INVALID_CONFIG;

    /* the base config is valid and creatable */
    {
        skv_cache *c = NULL;
        LBL("base config [%s]", skv_backend_name(be));
        check_ok(skv_config_validate(&base), lbl);
        check_ok(skv_cache_create(&base, &c), lbl);
        SKVT_CHECK(c && skv_cache_backend(c) == be, "%s: backend", lbl);
        skv_cache_free(c);
    }

    /* zero and negative sizes of every integer size field */
    static const int_field f32[] = {
        {"n_layers", offsetof(skv_config, n_layers)},   {"n_q_heads", offsetof(skv_config, n_q_heads)},
        {"n_kv_heads", offsetof(skv_config, n_kv_heads)}, {"head_dim", offsetof(skv_config, head_dim)},
        {"rank", offsetof(skv_config, rank)},           {"chunk_size", offsetof(skv_config, chunk_size)},
        {"budget", offsetof(skv_config, budget)},       {"batch_size", offsetof(skv_config, batch_size)},
        {"gen_capacity", offsetof(skv_config, gen_capacity)}};
    static const int32_t nonpos[] = {0, -1, -8, INT32_MIN};
    for (size_t i = 0; i < sizeof f32 / sizeof f32[0]; i++)
        for (size_t j = 0; j < sizeof nonpos / sizeof nonpos[0]; j++) {
            skv_config c = base;
            if (nonpos[j] == SKV_BUDGET_ALL && f32[i].off == offsetof(skv_config, budget)) continue; /* valid */
            memcpy((char *)&c + f32[i].off, &nonpos[j], sizeof(int32_t));
            char what[96];
            snprintf(what, sizeof what, "%s = %d", f32[i].name, nonpos[j]);
            cfg_case(&c, IC, f32[i].name, i64s(nonpos[j]), what);
        }
    static const int64_t nonpos64[] = {0, -1, INT64_MIN};
    for (size_t j = 0; j < sizeof nonpos64 / sizeof nonpos64[0]; j++) {
        skv_config c = base;
        c.max_prompt_len = nonpos64[j];
        char what[96];
        snprintf(what, sizeof what, "max_prompt_len = %lld", (long long)nonpos64[j]);
        cfg_case(&c, IC, "max_prompt_len", i64s(nonpos64[j]), what);
    }
    CFGCASE(c_.n_outlier_chunks = -1, IC, "n_outlier_chunks", "-1");
    CFGCASE(c_.n_outlier_chunks = INT32_MIN, IC, "n_outlier_chunks", "-2147483648");
    CFGCASE(c_.n_local_chunks = -1, IC, "n_local_chunks", "-1");
    CFGCASE(c_.n_local_chunks = INT32_MIN, IC, "n_local_chunks", "-2147483648");
    CFGCASE(c_.n_threads = -1, IC, "n_threads", "-1");
    CFGCASE(c_.n_threads = SKV_MAX_THREADS + 1, IC, "n_threads", i64s(SKV_MAX_THREADS + 1));
    CFGCASE(c_.n_threads = 4096, IC, "n_threads", "4096");
    CFGCASE(c_.n_threads = INT32_MAX, IC, "n_threads", "2147483647");
    {
        skv_config c = base;
        c.n_threads = SKV_MAX_THREADS;
        LBL("n_threads = SKV_MAX_THREADS = %d validates [%s]", SKV_MAX_THREADS, skv_backend_name(be));
        check_ok(skv_config_validate(&c), lbl);
    }

    /* shape rules */
    CFGCASE(c_.n_q_heads = 7, IC, "n_q_heads", "7");
    CFGCASE(c_.n_q_heads = 1, IC, "n_q_heads", "1"); /* Hq < Hk */
    CFGCASE(c_.n_kv_heads = 3, IC, "n_q_heads", "3");
    CFGCASE(c_.head_dim = 63, IC, "head_dim", "63");
    CFGCASE(c_.head_dim = 1, IC, "head_dim", "1");
    CFGCASE(c_.head_dim = 4096, IC, "head_dim", "4096");
    CFGCASE(c_.budget = 60, IC, "budget", "60");
    CFGCASE(c_.budget = 4, IC, "budget", "4");
    CFGCASE(c_.chunk_size = 7, IC, "budget", "7");
    /* rank > Hk * D (the shortest prompt is longer than Hk * D here) */
    CFGCASE(c_.n_outlier_chunks = 20; c_.max_prompt_len = 1024; c_.rank = HK * HD + 1, IC, "rank", "129");
    /* rank > the shortest valid prompt (O + S + Lc) * c = 112 but <= Hk * D = 128: valid (a prompt
       shorter than the rank is refused at prefill: test_rank) */
    {
        skv_config c = base;
        c.rank = MINP + 1;
        LBL("rank = %d > the shortest valid prompt validates [%s]", MINP + 1, skv_backend_name(be));
        check_ok(skv_config_validate(&c), lbl);
    }
    /* rank = 0: a rank per slot, which needs rank_max and rank_error_target in range */
    CFGCASE(c_.rank = 0; c_.rank_max = HK * HD + 1, IC, "rank_max", "129");
    CFGCASE(c_.rank = 0; c_.rank_max = 8; c_.rank_error_target = 1.0f, IC, "rank_error_target", "1");
    CFGCASE(c_.rank = INT32_MAX, IC, "rank", "2147483647");
    /* max_prompt_len too small for O + S + Lc chunks, too large */
    CFGCASE(c_.max_prompt_len = MINP - 1, IC, "max_prompt_len", "111");
    CFGCASE(c_.n_outlier_chunks = INT32_MAX, IC, "max_prompt_len", NULL);
    CFGCASE(c_.n_local_chunks = INT32_MAX, IC, "max_prompt_len", NULL);
    CFGCASE(c_.max_prompt_len = ((int64_t)1 << 30) + 1, IC, "max_prompt_len", "1073741825");
    CFGCASE(c_.max_prompt_len = INT64_MAX, IC, "max_prompt_len", "9223372036854775807");
    CFGCASE(c_.gen_capacity = (1 << 24) + 1, IC, "gen_capacity", "16777217");

    /* 0.3: the selection count, SKV_BUDGET_ALL, dense layers */
    CFGCASE(c_.budget = -2, IC, "budget", "-2");
    CFGCASE(c_.budget = SKV_BUDGET_ALL; c_.max_prompt_len = (NOUT + NLOC) * CH, IC, "max_prompt_len", NULL);
    CFGCASE(c_.select_mode = (skv_select_mode)2, IC, "select_mode", "2");
    CFGCASE(c_.select_mode = (skv_select_mode)-1, IC, "select_mode", "-1");
    CFGCASE(c_.select_mode = SKV_SELECT_MASS; c_.select_mass = 0.0f, IC, "select_mass", "0");
    CFGCASE(c_.select_mode = SKV_SELECT_MASS; c_.select_mass = -0.5f, IC, "select_mass", "-0.5");
    CFGCASE(c_.select_mode = SKV_SELECT_MASS; c_.select_mass = 1.5f, IC, "select_mass", "1.5");
    CFGCASE(c_.select_mode = SKV_SELECT_MASS; c_.select_mass = NAN, IC, "select_mass", "nan");
    CFGCASE(c_.select_mode = SKV_SELECT_MASS; c_.select_mass = INFINITY, IC, "select_mass", "inf");
    CFGCASE(c_.select_mode = SKV_SELECT_MASS; c_.select_min_chunks = -1, IC, "select_min_chunks", "-1");
    CFGCASE(c_.select_mode = SKV_SELECT_MASS; c_.select_min_chunks = SEL + 1, IC, "select_min_chunks",
            i64s(SEL + 1));
    CFGCASE(c_.select_mode = SKV_SELECT_MASS; c_.select_min_chunks = INT32_MAX, IC, "select_min_chunks",
            "2147483647");
    CFGCASE(c_.dense_layers = (uint64_t)1 << NL, IC, "dense_layers", NULL);
    CFGCASE(c_.dense_layers = (uint64_t)1 << 63, IC, "dense_layers", NULL);
    CFGCASE(c_.dense_layers = ~(uint64_t)0, IC, "dense_layers", NULL);
    {
        const struct { const char *what; skv_config c; } ok[] = {
            {"budget = SKV_BUDGET_ALL", base},
            {"select_mode = SKV_SELECT_MASS, select_mass 1, select_min_chunks S", base},
            {"select_mode = SKV_SELECT_MASS, select_mass 1e-30", base},
            {"dense_layers: every layer", base},
            {"select_mass = NAN in the fixed mode (not read)", base},
        };
        skv_config v[5];
        for (int i = 0; i < 5; i++) v[i] = ok[i].c;
        v[0].budget = SKV_BUDGET_ALL;
        v[1].select_mode = SKV_SELECT_MASS, v[1].select_mass = 1.0f, v[1].select_min_chunks = SEL;
        v[2].select_mode = SKV_SELECT_MASS, v[2].select_mass = 1e-30f;
        v[3].dense_layers = ((uint64_t)1 << NL) - 1;
        v[4].select_mass = NAN;
        for (int i = 0; i < 5; i++) {
            LBL("%s validates [%s]", ok[i].what, skv_backend_name(be));
            check_ok(skv_config_validate(&v[i]), lbl);
        }
    }

    /* rope */
    CFGCASE(c_.rope.theta = 1.0f, IC, "rope.theta", "1");
    CFGCASE(c_.rope.theta = 0.5f, IC, "rope.theta", "0.5");
    CFGCASE(c_.rope.theta = 0.0f, IC, "rope.theta", "0");
    CFGCASE(c_.rope.theta = -10000.0f, IC, "rope.theta", "-10000");
    CFGCASE(c_.rope.theta = NAN, IC, "rope.theta", "nan");
    CFGCASE(c_.rope.theta = INFINITY, IC, "rope.theta", "inf");
    CFGCASE(c_.rope.rotary_dim = 3, IC, "rope.rotary_dim", "3");
    CFGCASE(c_.rope.rotary_dim = 31, IC, "rope.rotary_dim", "31");
    CFGCASE(c_.rope.rotary_dim = HD + 2, IC, "rope.rotary_dim", "66");
    CFGCASE(c_.rope.rotary_dim = -2, IC, "rope.rotary_dim", "-2");
    CFGCASE(c_.rope.interleaved = 2, IC, "rope.interleaved", "2");
    CFGCASE(c_.rope.interleaved = -1, IC, "rope.interleaved", "-1");
    CFGCASE(c_.rope.llama3_scaling = 2, IC, "rope.llama3_scaling", "2");
    CFGCASE(c_.rope.llama3_scaling = -1, IC, "rope.llama3_scaling", "-1");
    CFGCASE(c_.rope.llama3_scaling = 1; c_.rope.scaling_factor = 0.5f, IC, "rope.scaling_factor", "0.5");
    CFGCASE(c_.rope.llama3_scaling = 1; c_.rope.scaling_factor = NAN, IC, "rope.scaling_factor", "nan");
    CFGCASE(c_.rope.llama3_scaling = 1; c_.rope.scaling_factor = INFINITY, IC, "rope.scaling_factor", "inf");
    CFGCASE(c_.rope.llama3_scaling = 1; c_.rope.low_freq_factor = 0.0f, IC, "rope.low_freq_factor", "0");
    CFGCASE(c_.rope.llama3_scaling = 1; c_.rope.low_freq_factor = -1.0f, IC, "rope.low_freq_factor", "-1");
    CFGCASE(c_.rope.llama3_scaling = 1; c_.rope.low_freq_factor = NAN, IC, "rope.low_freq_factor", "nan");
    CFGCASE(c_.rope.llama3_scaling = 1; c_.rope.high_freq_factor = 1.0f, IC, "rope.high_freq_factor", "1");
    CFGCASE(c_.rope.llama3_scaling = 1; c_.rope.high_freq_factor = 0.5f, IC, "rope.high_freq_factor", "0.5");
    CFGCASE(c_.rope.llama3_scaling = 1; c_.rope.high_freq_factor = NAN, IC, "rope.high_freq_factor", "nan");
    CFGCASE(c_.rope.llama3_scaling = 1; c_.rope.high_freq_factor = INFINITY, IC, "rope.high_freq_factor",
            "inf");
    CFGCASE(c_.rope.llama3_scaling = 1; c_.rope.original_max_position = 0, IC, "rope.original_max_position",
            "0");
    CFGCASE(c_.rope.llama3_scaling = 1; c_.rope.original_max_position = -5, IC, "rope.original_max_position",
            "-5");

    /* attn_scale, backend */
    CFGCASE(c_.attn_scale = NAN, IC, "attn_scale", "nan");
    CFGCASE(c_.attn_scale = -NAN, IC, "attn_scale", "nan");
    CFGCASE(c_.attn_scale = -1.0f, IC, "attn_scale", "-1");
    CFGCASE(c_.attn_scale = -INFINITY, IC, "attn_scale", "-inf");
    CFGCASE(c_.attn_scale = INFINITY, IC, "attn_scale", "inf");
    CFGCASE(c_.backend = (skv_backend)4, IC, "backend", "4");
    CFGCASE(c_.backend = (skv_backend)-1, IC, "backend", "-1");
    CFGCASE(c_.backend = (skv_backend)99, IC, "backend", "99");

    /* size products that overflow size_t */
    CFGCASE(c_.n_layers = 1 << 20; c_.batch_size = 1 << 20; c_.max_prompt_len = (int64_t)1 << 30,
            SKV_ERR_SIZE_OVERFLOW, "n_layers", "1048576");
    CFGCASE(c_.n_layers = INT32_MAX; c_.batch_size = INT32_MAX, SKV_ERR_SIZE_OVERFLOW, "batch_size",
            "2147483647");

    /*
     * Every field within its cap, the product not: the generated-token region
     * Hk * gen_capacity * D * 2 bytes = 2^16 * 2^24 * 2^10 * 2 = 2^51 bytes per
     * slot, times L * B = 2^28 slots. create is only tried when validate reports the
     * overflow (otherwise it could reserve terabytes and build 64 GB of RoPE
     * tables).
     */
    {
        skv_config c = base;
        c.n_q_heads = 1 << 16; /* the largest head counts allowed */
        c.n_kv_heads = 1 << 16;
        c.head_dim = 1024;
        c.n_layers = 1 << 14;
        c.batch_size = 1 << 14;
        c.rank = 1;
        c.chunk_size = 1;
        c.budget = 1;
        c.n_outlier_chunks = 0;
        c.n_local_chunks = 0;
        c.max_prompt_len = 1;
        c.gen_capacity = 1 << 24;
        size_t d = 12345, h = 67890;
        LBL("L * B * Hk * gen_capacity * D > 2^64 [%s]: skv_config_validate", skv_backend_name(be));
        skv_status st = skv_config_validate(&c);
        expect_err(st, SKV_ERR_SIZE_OVERFLOW, NULL, NULL, NULL);
        LBL("L * B * Hk * gen_capacity * D > 2^64 [%s]: skv_cache_memory", skv_backend_name(be));
        expect_err(skv_cache_memory(&c, &d, &h), SKV_ERR_SIZE_OVERFLOW, NULL, NULL, NULL);
        SKVT_CHECK(d == 12345 && h == 67890, "%s: outputs written (device %zu, host %zu bytes)", lbl, d, h);
        if (st != SKV_OK) {
            skv_cache *out = (skv_cache *)(void *)&dummy_object;
            LBL("L * B * Hk * gen_capacity * D > 2^64 [%s]: skv_cache_create", skv_backend_name(be));
            expect_err(skv_cache_create(&c, &out), SKV_ERR_SIZE_OVERFLOW, NULL, NULL, NULL);
            SKVT_CHECK(out == NULL, "%s: *out not NULL", lbl);
        }
    }

    /* sizes that fit size_t but no address space: create -> OUT_OF_MEMORY, no crash */
    {
        skv_config c = base;
        c.n_layers = 1 << 22;
        c.batch_size = 1 << 22;
        c.n_q_heads = 1;
        c.n_kv_heads = 1;
        c.head_dim = 2;
        c.rank = 1;
        c.chunk_size = 1;
        c.budget = 1;
        c.n_outlier_chunks = 0;
        c.n_local_chunks = 0;
        c.max_prompt_len = 1;
        c.gen_capacity = 1;
        size_t d = 0, h = 0;
        LBL("huge cache [%s]: skv_config_validate", skv_backend_name(be));
        check_ok(skv_config_validate(&c), lbl);
        LBL("huge cache [%s]: skv_cache_memory", skv_backend_name(be));
        check_ok(skv_cache_memory(&c, &d, &h), lbl);
        /* tiny prompts: a whole value store costs less than a chunk cache, so every slot is on the device */
        SKVT_CHECK(d >= ((size_t)1 << 54) && h == 0, "%s: device %zu host %zu bytes", lbl, d, h);
        skv_cache *out = (skv_cache *)(void *)&dummy_object;
        LBL("huge cache [%s]: skv_cache_create", skv_backend_name(be));
        expect_err(skv_cache_create(&c, &out), SKV_ERR_OUT_OF_MEMORY, NULL, NULL, NULL);
        SKVT_CHECK(out == NULL, "%s: *out not NULL", lbl);
        expect_substr("OOM", "memory");
    }

    /* NULL pointers */
    {
        size_t d = 1, h = 2;
        LBL("skv_config_validate(NULL)");
        expect_err(skv_config_validate(NULL), SKV_ERR_NULL_POINTER, NULL, "cfg", NULL);
        LBL("skv_cache_memory(NULL, ...)");
        expect_err(skv_cache_memory(NULL, &d, &h), SKV_ERR_NULL_POINTER, NULL, "cfg", NULL);
        SKVT_CHECK(d == 1 && h == 2, "%s: outputs written", lbl);
        LBL("skv_cache_memory(cfg, NULL, NULL) is valid [%s]", skv_backend_name(be));
        check_ok(skv_cache_memory(&base, NULL, NULL), lbl);
        skv_cache *out = (skv_cache *)(void *)&dummy_object;
        LBL("skv_cache_create(NULL, &out)");
        expect_err(skv_cache_create(NULL, &out), SKV_ERR_NULL_POINTER, NULL, "cfg", NULL);
        SKVT_CHECK(out == NULL, "%s: *out not NULL", lbl);
        LBL("skv_cache_create(cfg, NULL) [%s]", skv_backend_name(be));
        expect_err(skv_cache_create(&base, NULL), SKV_ERR_NULL_POINTER, NULL, "out", NULL);
    }
}

/* ---- backend selection and the environment ----------------------------------------- */

/* Whether this machine has a usable GPU: then cuda succeeds where the checks below expect
   SKV_ERR_NO_DEVICE, and auto resolves to cuda (test_cuda covers that case). */
static int cuda_usable(void) { return skv_backend_available(SKV_BACKEND_CUDA) == SKV_OK; }

static void test_backends(void)
{
    skv_config cfg = base_config(SKV_BACKEND_REF);
    skv_cache *c;
    const int gpu = cuda_usable();
    const skv_backend auto_be = gpu ? SKV_BACKEND_CUDA : SKV_BACKEND_CPU;

    /* the environment names the backend only for cfg.backend = auto */
    unsetenv("SKV_BACKEND");
    cfg.backend = SKV_BACKEND_AUTO;
    LBL("SKV_BACKEND=bogus");
    setenv("SKV_BACKEND", "bogus", 1);
    c = (skv_cache *)(void *)&dummy_object;
    expect_err(skv_cache_create(&cfg, &c), SKV_ERR_INVALID_CONFIG, NULL, "SKV_BACKEND", "bogus");
    SKVT_CHECK(c == NULL, "%s: *out not NULL", lbl);

    LBL("SKV_BACKEND=cuda");
    setenv("SKV_BACKEND", "cuda", 1);
    if (!gpu) {
        c = (skv_cache *)(void *)&dummy_object;
        expect_err(skv_cache_create(&cfg, &c), SKV_ERR_NO_DEVICE, NULL, "cuda", NULL);
        expect_substr("no-CUDA", "CUDA");
        SKVT_CHECK(c == NULL, "%s: *out not NULL", lbl);
    } else {
        c = NULL;
        check_ok(skv_cache_create(&cfg, &c), lbl);
        SKVT_CHECK(c && skv_cache_backend(c) == SKV_BACKEND_CUDA, "%s: backend not cuda", lbl);
        skv_cache_free(c);
    }

    LBL("SKV_BACKEND=auto over cfg auto");
    setenv("SKV_BACKEND", "auto", 1);
    c = NULL;
    check_ok(skv_cache_create(&cfg, &c), lbl);
    SKVT_CHECK(c && skv_cache_backend(c) == auto_be, "%s: backend %s, want %s", lbl,
               c ? skv_backend_name(skv_cache_backend(c)) : "-", skv_backend_name(auto_be));
    SKVT_CHECK(c && skv_cache_config(c)->backend == auto_be, "%s: config backend not resolved", lbl);
    skv_cache_free(c);

    LBL("SKV_BACKEND=ref over cfg auto");
    setenv("SKV_BACKEND", "ref", 1);
    cfg.backend = SKV_BACKEND_AUTO;
    c = NULL;
    check_ok(skv_cache_create(&cfg, &c), lbl);
    SKVT_CHECK(c && skv_cache_backend(c) == SKV_BACKEND_REF, "%s: backend not ref", lbl);
    skv_cache_free(c);

    LBL("cfg cpu wins over SKV_BACKEND=ref");
    cfg.backend = SKV_BACKEND_CPU;
    c = NULL;
    check_ok(skv_cache_create(&cfg, &c), lbl);
    SKVT_CHECK(c && skv_cache_backend(c) == SKV_BACKEND_CPU, "%s: backend not cpu", lbl);
    skv_cache_free(c);

    LBL("SKV_BACKEND= (empty) is ignored");
    setenv("SKV_BACKEND", "", 1);
    c = NULL;
    check_ok(skv_cache_create(&cfg, &c), lbl);
    SKVT_CHECK(c && skv_cache_backend(c) == SKV_BACKEND_CPU, "%s: backend not cpu", lbl);
    skv_cache_free(c);

    LBL("SKV_BACKEND=bogus with an invalid config");
    setenv("SKV_BACKEND", "bogus", 1);
    cfg.backend = SKV_BACKEND_AUTO;
    cfg.head_dim = 63;
    c = (skv_cache *)(void *)&dummy_object;
    expect_err(skv_cache_create(&cfg, &c), SKV_ERR_INVALID_CONFIG, NULL, NULL, NULL);
    SKVT_CHECK(c == NULL, "%s: *out not NULL", lbl);
    unsetenv("SKV_BACKEND");

    cfg = base_config(SKV_BACKEND_CUDA);
    LBL("cfg.backend = cuda");
    if (!gpu) {
        c = (skv_cache *)(void *)&dummy_object;
        expect_err(skv_cache_create(&cfg, &c), SKV_ERR_NO_DEVICE, NULL, "cuda", NULL);
        SKVT_CHECK(c == NULL, "%s: *out not NULL", lbl);
    }

    cfg.backend = SKV_BACKEND_AUTO;
    LBL("cfg.backend = auto");
    c = NULL;
    check_ok(skv_cache_create(&cfg, &c), lbl);
    SKVT_CHECK(c && skv_cache_backend(c) == auto_be, "%s: auto did not resolve to %s", lbl, skv_backend_name(auto_be));
    skv_cache_free(c);

    /* parse / available / name */
    skv_backend b = SKV_BACKEND_REF;
    LBL("skv_backend_parse(\"bogus\")");
    expect_err(skv_backend_parse("bogus", &b), SKV_ERR_INVALID_ARGUMENT, NULL, "bogus", NULL);
    SKVT_CHECK(b == SKV_BACKEND_REF, "%s: output written", lbl);
    LBL("skv_backend_parse(\"CPU\")");
    expect_err(skv_backend_parse("CPU", &b), SKV_ERR_INVALID_ARGUMENT, NULL, "CPU", NULL);
    LBL("skv_backend_parse(NULL, &b)");
    expect_err(skv_backend_parse(NULL, &b), SKV_ERR_NULL_POINTER, NULL, "name", NULL);
    LBL("skv_backend_parse(\"cpu\", NULL)");
    expect_err(skv_backend_parse("cpu", NULL), SKV_ERR_NULL_POINTER, NULL, "out", NULL);
    LBL("skv_backend_available(99)");
    expect_err(skv_backend_available((skv_backend)99), SKV_ERR_INVALID_ARGUMENT, NULL, "99", NULL);
    LBL("skv_backend_available(-1)");
    expect_err(skv_backend_available((skv_backend)-1), SKV_ERR_INVALID_ARGUMENT, NULL, "-1", NULL);
    LBL("skv_backend_available(cuda)");
    if (!gpu) expect_err(skv_backend_available(SKV_BACKEND_CUDA), SKV_ERR_NO_DEVICE, NULL, "cuda", NULL);
    LBL("skv_backend_available(cpu/ref/auto)");
    check_ok(skv_backend_available(SKV_BACKEND_CPU), lbl);
    check_ok(skv_backend_available(SKV_BACKEND_REF), lbl);
    check_ok(skv_backend_available(SKV_BACKEND_AUTO), lbl);
    SKVT_CHECK(strcmp(skv_backend_name((skv_backend)42), "invalid") == 0, "skv_backend_name(42)");

    /* functions on a NULL cache that do not return a status */
    skv_cache_free(NULL);
    /* the doc: never SKV_BACKEND_AUTO; a NULL cache names no backend */
    SKVT_CHECK(skv_cache_backend(NULL) != SKV_BACKEND_AUTO && skv_cache_backend(NULL) == (skv_backend)-1 &&
                   strcmp(skv_backend_name(skv_cache_backend(NULL)), "invalid") == 0,
               "skv_cache_backend(NULL) = %d (\"%s\"), want (skv_backend)-1, \"invalid\"", (int)skv_cache_backend(NULL),
               skv_backend_name(skv_cache_backend(NULL)));
    SKVT_CHECK(skv_cache_config(NULL) == NULL, "skv_cache_config(NULL)");
    SKVT_CHECK(skv_cache_last_error(NULL) != NULL, "skv_cache_last_error(NULL) is NULL");
    LBL("skv_rope_table_len(NULL, ...)");
    SKVT_CHECK(skv_rope_table_len(NULL, HD, 8) == 0, "%s", lbl);
}

/* ---- bad calls before / during prefill ------------------------------------------------ */

static const char *bname(int be) { return be == SKV_BACKEND_REF ? "ref" : "cpu"; }

/* Plants bad value vals[kind] at pos in a copy of x; the caller frees it. */
static skv_bf16 *planted(const skv_bf16 *x, size_t n, size_t pos, int kind)
{
    skv_bf16 *y = dup_bf16(x, n);
    y[pos] = bad_vals[kind];
    return y;
}

static size_t pick_pos(int which, size_t n)
{
    if (which == 0) return 0;
    if (which == 1) return n - 1;
    return (size_t)skvt_rng_range(&rng, 0, (int64_t)n - 1);
}

/* Bad prefill calls on the unprefilled slot (l, b) of A; each followed by a state comparison. */
static void bad_prefills(skv_cache *A, skv_cache *B, const fixture *fx, int l, int b)
{
    const char *bn = bname(fx->cfg.backend);
    const int64_t n = fx->n[b];
    const skv_bf16 *kp = fx->kpre[l][b], *vv = fx->v[l][b], *ko = fx->kpost[l][b];

#define AFTER_PREFILL()                                                                   \
    do {                                                                                  \
        SKVT_CHECK(seq_prefilled(A, l, b) == 0, "%s: slot became prefilled", lbl);        \
        same_state(A, B);                                                                 \
    } while (0)

    LBL("[%s] prefill(NULL cache)", bn);
    expect_err(skv_prefill(NULL, l, b, n, kp, vv, ko), SKV_ERR_NULL_POINTER, NULL, "cache", NULL);
    LBL("[%s] prefill k_pre NULL (layer %d seq %d)", bn, l, b);
    expect_err(skv_prefill(A, l, b, n, NULL, vv, ko), SKV_ERR_NULL_POINTER, A, "k_pre", NULL);
    AFTER_PREFILL();
    LBL("[%s] prefill v NULL (layer %d seq %d)", bn, l, b);
    expect_err(skv_prefill(A, l, b, n, kp, NULL, ko), SKV_ERR_NULL_POINTER, A, "v", NULL);
    AFTER_PREFILL();
    LBL("[%s] prefill k_pre and v NULL", bn);
    expect_err(skv_prefill(A, l, b, n, NULL, NULL, NULL), SKV_ERR_NULL_POINTER, A, NULL, NULL);
    AFTER_PREFILL();

    static const int32_t bad_layers[] = {-1, NL, NL + 1, INT32_MAX, INT32_MIN};
    for (size_t i = 0; i < sizeof bad_layers / sizeof bad_layers[0]; i++) {
        LBL("[%s] prefill layer = %d", bn, bad_layers[i]);
        expect_err(skv_prefill(A, bad_layers[i], b, n, kp, vv, ko), SKV_ERR_INVALID_ARGUMENT, A, "layer",
                   i64s(bad_layers[i]));
        AFTER_PREFILL();
        /* the same list shifted to the batch bounds: -1, NB, NB + 1, INT32_MAX, INT32_MIN */
        const int32_t bs = bad_layers[i] == NL ? NB : bad_layers[i] == NL + 1 ? NB + 1 : bad_layers[i];
        LBL("[%s] prefill seq = %d", bn, bs);
        expect_err(skv_prefill(A, l, bs, n, kp, vv, ko), SKV_ERR_INVALID_ARGUMENT, A, "seq", i64s(bs));
        AFTER_PREFILL();
    }

    /* too short: the message gives the chunk counts of that n (for n = 0 there are 0 chunks, not -1) */
    static const int64_t short_n[] = {MINP - 1, MINP - CH, NLOC * CH + CH, NLOC * CH, CH, CH - 1, 1, 0};
    for (size_t i = 0; i < sizeof short_n / sizeof short_n[0]; i++) {
        const int64_t sn = short_n[i], whole = sn / CH, context = whole - NLOC > 0 ? whole - NLOC : 0;
        LBL("[%s] prefill n = %lld (too short)", bn, (long long)sn);
        expect_err(skv_prefill(A, l, b, sn, kp, vv, ko), SKV_ERR_PROMPT_TOO_SHORT, A, "n", i64s(sn));
        char counts[160];
        snprintf(counts, sizeof counts, "n = %lld tokens are %lld whole chunks", (long long)sn, (long long)whole);
        expect_substr("PROMPT_TOO_SHORT", counts);
        snprintf(counts, sizeof counts, "leaves %lld context chunks, need O + S = %d", (long long)context,
                 NOUT + SEL);
        expect_substr("PROMPT_TOO_SHORT", counts);
        AFTER_PREFILL();
    }
    /* a negative length is not a short prompt: INVALID_ARGUMENT naming n */
    static const int64_t neg_n[] = {-1, -CH, -(int64_t)MINP, INT64_MIN + 1, INT64_MIN};
    for (size_t i = 0; i < sizeof neg_n / sizeof neg_n[0]; i++) {
        LBL("[%s] prefill n = %lld (negative)", bn, (long long)neg_n[i]);
        expect_err(skv_prefill(A, l, b, neg_n[i], kp, vv, ko), SKV_ERR_INVALID_ARGUMENT, A, "n", i64s(neg_n[i]));
        AFTER_PREFILL();
    }
    static const int64_t long_n[] = {MAXP + 1, MAXP + CH, (int64_t)1 << 40, INT64_MAX};
    for (size_t i = 0; i < sizeof long_n / sizeof long_n[0]; i++) {
        LBL("[%s] prefill n = %lld (too long)", bn, (long long)long_n[i]);
        expect_err(skv_prefill(A, l, b, long_n[i], kp, vv, ko), SKV_ERR_PROMPT_TOO_LONG, A, "n",
                   i64s(long_n[i]));
        AFTER_PREFILL();
    }

    /* NaN / Inf in each input tensor at the first, last and random elements */
    const size_t e = (size_t)n * HK * HD;
    skv_bf16 *kpost_any = ko ? dup_bf16(ko, e) : rand_bf16(e, 1.0);
    for (int tensor = 0; tensor < 3; tensor++)
        for (int kind = 0; kind < 4; kind++)
            for (int which = 0; which < 4; which++) {
                static const char *const tn[3] = {"k_pre", "v", "k_post"};
                size_t pos = pick_pos(which, e);
                const skv_bf16 *src = tensor == 0 ? kp : tensor == 1 ? vv : kpost_any;
                skv_bf16 *bad = planted(src, e, pos, kind);
                const skv_bf16 *a0 = tensor == 0 ? bad : kp, *a1 = tensor == 1 ? bad : vv;
                const skv_bf16 *a2 = tensor == 2 ? bad : (tensor == 0 && which == 3 ? NULL : kpost_any);
                LBL("[%s] prefill layer %d seq %d: %s at %s[%zu] (k_post %s)", bn, l, b, bad_names[kind], tn[tensor],
                    pos, a2 ? "given" : "NULL");
                expect_err(skv_prefill(A, l, b, n, a0, a1, a2), SKV_ERR_NONFINITE, A, tn[tensor], NULL);
                char where[96];
                snprintf(where, sizeof where, "%s[%zu][%zu][%zu]", tn[tensor], pos / (HK * HD), pos / HD % HK,
                         pos % HD);
                expect_substr("NONFINITE", where);
                free(bad);
                AFTER_PREFILL();
            }
    /* finite values beyond SKV_MAX_INPUT_MAGNITUDE (2^32) in each tensor: refused like NaN/Inf,
       the message names the element and the limit; the slot stays empty */
    for (int tensor = 0; tensor < 3; tensor++)
        for (int kind = 0; kind < N_HUGE; kind++)
            for (int which = 0; which < 3; which++) {
                static const char *const tn[3] = {"k_pre", "v", "k_post"};
                size_t pos = pick_pos(which, e);
                const skv_bf16 *src = tensor == 0 ? kp : tensor == 1 ? vv : kpost_any;
                skv_bf16 *bad = dup_bf16(src, e);
                bad[pos] = huge_vals[kind];
                const skv_bf16 *a0 = tensor == 0 ? bad : kp, *a1 = tensor == 1 ? bad : vv;
                const skv_bf16 *a2 = tensor == 2 ? bad : (which == 2 ? NULL : kpost_any);
                LBL("[%s] prefill layer %d seq %d: %s at %s[%zu] (k_post %s)", bn, l, b, huge_names[kind], tn[tensor],
                    pos, a2 ? "given" : "NULL");
                expect_err(skv_prefill(A, l, b, n, a0, a1, a2), SKV_ERR_NONFINITE, A, tn[tensor],
                           "SKV_MAX_INPUT_MAGNITUDE");
                char where[96];
                snprintf(where, sizeof where, "%s[%zu][%zu][%zu] = ", tn[tensor], pos / (HK * HD), pos / HD % HK,
                         pos % HD);
                expect_substr("NONFINITE (magnitude)", where);
                free(bad);
                AFTER_PREFILL();
            }
    /* several bad values: the message names the first of the first bad tensor */
    {
        skv_bf16 *b1 = planted(vv, e, e / 2, 0), *b2 = planted(kp, e, e - 1, 3);
        b2[e / 3] = BF_PINF;
        LBL("[%s] prefill NaN in v and Inf in k_pre", bn);
        expect_err(skv_prefill(A, l, b, n, b2, b1, NULL), SKV_ERR_NONFINITE, A, "k_pre", NULL);
        AFTER_PREFILL();
        free(b1);
        free(b2);
    }
    free(kpost_any);
#undef AFTER_PREFILL
}

/* Bad introspection calls on A (any state); each followed by a state comparison. */
static void bad_introspection(skv_cache *A, skv_cache *B, const char *bn)
{
    int32_t ids[MAXCAND];
    skv_bf16 lm[MAXCAND * HD];
    skv_seq_info info;
    static const int32_t bad_layer[] = {-1, NL, INT32_MAX, INT32_MIN};
    static const int32_t bad_seq[] = {-1, NB, INT32_MAX, INT32_MIN};
    static const int32_t bad_head[] = {-1, HK, HQ, INT32_MAX, INT32_MIN};
    static const char *const fnn[5] = {"skv_cache_selected", "skv_cache_outliers", "skv_cache_candidates",
                                       "skv_cache_landmarks", "skv_cache_seq_info"};
    for (int f = 0; f < 5; f++) {
        for (int which = 0; which < 3; which++) {
            size_t cnt = which == 0 ? 4 : which == 1 ? 4 : 5;
            if (f == 4 && which == 2) continue;
            for (size_t i = 0; i < cnt; i++) {
                int32_t l = 0, s = NB - 1, h = HK - 1;
                const char *field = which == 0 ? "layer" : which == 1 ? "seq" : "kv_head";
                int32_t val = which == 0 ? bad_layer[i] : which == 1 ? bad_seq[i] : bad_head[i];
                if (which == 0) l = val;
                else if (which == 1) s = val;
                else h = val;
                memset(ids, 0x5A, sizeof ids);
                memset(lm, 0x5A, sizeof lm);
                memset(&info, 0x5A, sizeof info);
                skv_status st;
                switch (f) {
                case 0: st = skv_cache_selected(A, l, s, h, ids); break;
                case 1: st = skv_cache_outliers(A, l, s, h, ids); break;
                case 2: st = skv_cache_candidates(A, l, s, h, ids); break;
                case 3: st = skv_cache_landmarks(A, l, s, h, lm); break;
                default: st = skv_cache_seq_info(A, l, s, &info); break;
                }
                LBL("[%s] %s %s = %d", bn, fnn[f], field, val);
                expect_err(st, SKV_ERR_INVALID_ARGUMENT, A, field, i64s(val));
                int untouched = 1;
                for (size_t k = 0; k < sizeof ids; k++) untouched &= ((unsigned char *)ids)[k] == 0x5A;
                for (size_t k = 0; k < sizeof lm; k++) untouched &= ((unsigned char *)lm)[k] == 0x5A;
                for (size_t k = 0; k < sizeof info; k++) untouched &= ((unsigned char *)&info)[k] == 0x5A;
                SKVT_CHECK(untouched, "%s: output written on failure", lbl);
                same_state(A, B);
            }
        }
        /* NULL output, NULL cache */
        skv_status st0, st1;
        const char *arg = f == 3 ? "landmarks" : f == 4 ? "info" : "ids";
        switch (f) {
        case 0: st0 = skv_cache_selected(A, 0, 0, 0, NULL); break;
        case 1: st0 = skv_cache_outliers(A, 0, 0, 0, NULL); break;
        case 2: st0 = skv_cache_candidates(A, 0, 0, 0, NULL); break;
        case 3: st0 = skv_cache_landmarks(A, 0, 0, 0, NULL); break;
        default: st0 = skv_cache_seq_info(A, 0, 0, NULL); break;
        }
        LBL("[%s] %s(%s = NULL)", bn, fnn[f], arg);
        expect_err(st0, SKV_ERR_NULL_POINTER, A, arg, NULL);
        switch (f) {
        case 0: st1 = skv_cache_selected(NULL, 0, 0, 0, ids); break;
        case 1: st1 = skv_cache_outliers(NULL, 0, 0, 0, ids); break;
        case 2: st1 = skv_cache_candidates(NULL, 0, 0, 0, ids); break;
        case 3: st1 = skv_cache_landmarks(NULL, 0, 0, 0, lm); break;
        default: st1 = skv_cache_seq_info(NULL, 0, 0, &info); break;
        }
        LBL("[%s] %s(cache = NULL)", bn, fnn[f]);
        expect_err(st1, SKV_ERR_NULL_POINTER, NULL, "cache", NULL);
        same_state(A, B);
    }
    skv_stats stt;
    LBL("[%s] skv_cache_stats(cache, NULL)", bn);
    expect_err(skv_cache_stats(A, NULL), SKV_ERR_NULL_POINTER, A, "stats", NULL);
    LBL("[%s] skv_cache_stats(NULL, &stats)", bn);
    expect_err(skv_cache_stats(NULL, &stt), SKV_ERR_NULL_POINTER, NULL, "cache", NULL);
    LBL("[%s] skv_cache_stats_reset(NULL)", bn);
    expect_err(skv_cache_stats_reset(NULL), SKV_ERR_NULL_POINTER, NULL, "cache", NULL);
    same_state(A, B);
}

/* Bad decode calls on A; each followed by a state comparison. */
static void bad_decodes(skv_cache *A, skv_cache *B, const fixture *fx, int step, int full_sweep)
{
    const char *bn = bname(fx->cfg.backend);
    float *out = malloc(sizeof outA);
    if (!out) abort();
    for (int l = 0; l < NL; l++) {
        const skv_bf16 *q = fx->dq[step][l], *k = fx->dk[step][l], *v = fx->dv[step][l];
        LBL("[%s] decode(NULL cache)", bn);
        expect_err(skv_decode(NULL, l, q, k, v, out), SKV_ERR_NULL_POINTER, NULL, "cache", NULL);
        LBL("[%s] decode layer %d q NULL", bn, l);
        expect_err(skv_decode(A, l, NULL, k, v, out), SKV_ERR_NULL_POINTER, A, "q", NULL);
        same_state(A, B);
        LBL("[%s] decode layer %d k NULL", bn, l);
        expect_err(skv_decode(A, l, q, NULL, v, out), SKV_ERR_NULL_POINTER, A, "k", NULL);
        same_state(A, B);
        LBL("[%s] decode layer %d v NULL", bn, l);
        expect_err(skv_decode(A, l, q, k, NULL, out), SKV_ERR_NULL_POINTER, A, "v", NULL);
        same_state(A, B);
        LBL("[%s] decode layer %d out NULL", bn, l);
        expect_err(skv_decode(A, l, q, k, v, NULL), SKV_ERR_NULL_POINTER, A, "out", NULL);
        same_state(A, B);

        /* NaN / Inf in q, k, v */
        for (int tensor = 0; tensor < 3; tensor++)
            for (int kind = 0; kind < 4; kind++)
                for (int which = full_sweep ? 0 : 2; which < 4; which++) {
                    static const char *const tn[3] = {"q", "k", "v"};
                    const int heads = tensor == 0 ? HQ : HK;
                    const size_t e = (size_t)NB * heads * HD;
                    size_t pos = pick_pos(which, e);
                    skv_bf16 *bad = planted(tensor == 0 ? q : tensor == 1 ? k : v, e, pos, kind);
                    LBL("[%s] decode step %d layer %d: %s at %s[%zu]", bn, step, l, bad_names[kind], tn[tensor],
                        pos);
                    expect_err(skv_decode(A, l, tensor == 0 ? bad : q, tensor == 1 ? bad : k,
                                          tensor == 2 ? bad : v, out),
                               SKV_ERR_NONFINITE, A, tn[tensor], NULL);
                    char where[96];
                    snprintf(where, sizeof where, "%s[%zu][%zu][%zu]", tn[tensor], pos / ((size_t)heads * HD),
                             pos / HD % (size_t)heads, pos % HD);
                    expect_substr("NONFINITE", where);
                    free(bad);
                    same_state(A, B);
                }
        /* finite values beyond SKV_MAX_INPUT_MAGNITUDE in q, k, v */
        for (int tensor = 0; tensor < 3; tensor++)
            for (int kind = 0; kind < N_HUGE; kind++) {
                static const char *const tn[3] = {"q", "k", "v"};
                const int heads = tensor == 0 ? HQ : HK;
                const size_t e = (size_t)NB * heads * HD;
                size_t pos = pick_pos(full_sweep ? kind % 3 : 2, e);
                skv_bf16 *bad = dup_bf16(tensor == 0 ? q : tensor == 1 ? k : v, e);
                bad[pos] = huge_vals[kind];
                LBL("[%s] decode step %d layer %d: %s at %s[%zu]", bn, step, l, huge_names[kind], tn[tensor], pos);
                expect_err(skv_decode(A, l, tensor == 0 ? bad : q, tensor == 1 ? bad : k, tensor == 2 ? bad : v, out),
                           SKV_ERR_NONFINITE, A, tn[tensor], "SKV_MAX_INPUT_MAGNITUDE");
                char where[96];
                snprintf(where, sizeof where, "%s[%zu][%zu][%zu] = ", tn[tensor], pos / ((size_t)heads * HD),
                         pos / HD % (size_t)heads, pos % HD);
                expect_substr("NONFINITE (magnitude)", where);
                free(bad);
                same_state(A, B);
            }
    }
    static const int32_t bad_layers[] = {-1, NL, NL + 7, INT32_MAX, INT32_MIN};
    for (size_t i = 0; i < sizeof bad_layers / sizeof bad_layers[0]; i++) {
        LBL("[%s] decode layer = %d", bn, bad_layers[i]);
        expect_err(skv_decode(A, bad_layers[i], fx->dq[step][0], fx->dk[step][0], fx->dv[step][0], out),
                   SKV_ERR_INVALID_ARGUMENT, A, "layer", i64s(bad_layers[i]));
        same_state(A, B);
    }
    free(out);
}

/* Prefill of an already prefilled slot with same / other / bad inputs. */
static void double_prefills(skv_cache *A, skv_cache *B, const fixture *fx)
{
    const char *bn = bname(fx->cfg.backend);
    for (int l = 0; l < NL; l++)
        for (int b = 0; b < NB; b++) {
            char where[64];
            snprintf(where, sizeof where, "layer %d of sequence %d", l, b);
            LBL("[%s] prefill twice (same inputs) layer %d seq %d", bn, l, b);
            expect_err(prefill_slot(A, fx, l, b), SKV_ERR_ALREADY_PREFILLED, A, NULL, NULL);
            expect_substr("ALREADY", where);
            same_state(A, B);
            size_t e = (size_t)fx->n[1 - b] * HK * HD;
            skv_bf16 *k2 = rand_bf16(e, 1.0), *v2 = rand_bf16(e, 1.0);
            LBL("[%s] prefill twice (other inputs, n = %lld) layer %d seq %d", bn, (long long)fx->n[1 - b], l, b);
            expect_err(skv_prefill(A, l, b, fx->n[1 - b], k2, v2, NULL), SKV_ERR_ALREADY_PREFILLED, A, NULL, NULL);
            same_state(A, B);
            k2[e / 2] = BF_NAN;
            v2[0] = BF_NINF;
            LBL("[%s] prefill twice (NaN inputs) layer %d seq %d", bn, l, b);
            skv_status st = skv_prefill(A, l, b, fx->n[1 - b], k2, v2, k2);
            SKVT_CHECK(st == SKV_ERR_ALREADY_PREFILLED || st == SKV_ERR_NONFINITE, "%s: got %s", lbl,
                       skv_status_string(st));
            same_state(A, B);
            free(k2);
            free(v2);
        }
}

/* The whole state-machine scenario on one backend. */
static void test_cache_states(skv_backend be)
{
    fixture fx;
    fixture_make(&fx, be);
    const char *bn = bname(be);
    skv_cache *A = NULL, *B = NULL;
    LBL("[%s] create twins (n = %lld, %lld)", bn, (long long)fx.n[0], (long long)fx.n[1]);
    check_ok(skv_cache_create(&fx.cfg, &A), lbl);
    check_ok(skv_cache_create(&fx.cfg, &B), lbl);
    if (!A || !B) {
        skv_cache_free(A);
        skv_cache_free(B);
        fixture_free(&fx);
        return;
    }
    SKVT_CHECK(skv_cache_backend(A) == be, "[%s] cache backend", bn);
    SKVT_CHECK(strcmp(skv_cache_last_error(A), "") == 0, "[%s] fresh cache has a last error", bn);
    same_state(A, B);

    /* 1. nothing prefilled */
    {
        float *out = malloc(sizeof outA);
        if (!out) abort();
        for (int l = 0; l < NL; l++) {
            LBL("[%s] decode layer %d with nothing prefilled", bn, l);
            expect_err(skv_decode(A, l, fx.dq[0][l], fx.dk[0][l], fx.dv[0][l], out), SKV_ERR_NOT_PREFILLED, A,
                       NULL, NULL);
            expect_substr("NOT_PREFILLED", "layer 0 of sequence 0");
            same_state(A, B);
        }
        free(out);
        for (int l = 0; l < NL; l++)
            for (int b = 0; b < NB; b++)
                for (int h = 0; h < HK; h++) {
                    int32_t ids[MAXCAND];
                    skv_bf16 lm[MAXCAND * HD];
                    char where[64];
                    snprintf(where, sizeof where, "layer %d of sequence %d", l, b);
                    LBL("[%s] skv_cache_selected before prefill (%d,%d,%d)", bn, l, b, h);
                    expect_err(skv_cache_selected(A, l, b, h, ids), SKV_ERR_NOT_PREFILLED, A, NULL, NULL);
                    expect_substr("NOT_PREFILLED", where);
                    LBL("[%s] skv_cache_outliers before prefill (%d,%d,%d)", bn, l, b, h);
                    expect_err(skv_cache_outliers(A, l, b, h, ids), SKV_ERR_NOT_PREFILLED, A, NULL, NULL);
                    expect_substr("NOT_PREFILLED", where);
                    LBL("[%s] skv_cache_candidates before prefill (%d,%d,%d)", bn, l, b, h);
                    expect_err(skv_cache_candidates(A, l, b, h, ids), SKV_ERR_NOT_PREFILLED, A, NULL, NULL);
                    expect_substr("NOT_PREFILLED", where);
                    LBL("[%s] skv_cache_landmarks before prefill (%d,%d,%d)", bn, l, b, h);
                    expect_err(skv_cache_landmarks(A, l, b, h, lm), SKV_ERR_NOT_PREFILLED, A, NULL, NULL);
                    expect_substr("NOT_PREFILLED", where);
                    skv_seq_info in;
                    LBL("[%s] skv_cache_seq_info before prefill (%d,%d)", bn, l, b);
                    check_ok(skv_cache_seq_info(A, l, b, &in), lbl);
                    SKVT_CHECK(in.prefilled == 0 && in.n_generated == 0 && in.has_selection == 0,
                               "%s: fields", lbl);
                }
        bad_introspection(A, B, bn);
        bad_prefills(A, B, &fx, 0, 0);
    }

    /* 2. every slot but one prefilled */
    const int ml = (int)skvt_rng_range(&rng, 0, NL - 1), ms = (int)skvt_rng_range(&rng, 0, NB - 1);
    for (int l = 0; l < NL; l++)
        for (int b = 0; b < NB; b++) {
            if (l == ml && b == ms) continue;
            LBL("[%s] valid prefill layer %d seq %d (n = %lld, k_post %s)", bn, l, b, (long long)fx.n[b],
                fx.kpost[l][b] ? "given" : "NULL");
            check_ok(prefill_slot(A, &fx, l, b), lbl);
            check_ok(prefill_slot(B, &fx, l, b), lbl);
            same_state(A, B);
        }
    {
        float *out = malloc(sizeof outA);
        if (!out) abort();
        char where[64];
        snprintf(where, sizeof where, "layer %d of sequence %d", ml, ms);
        for (int l = 0; l < NL; l++) {
            LBL("[%s] decode layer %d with (layer %d, seq %d) not prefilled", bn, l, ml, ms);
            expect_err(skv_decode(A, l, fx.dq[0][l], fx.dk[0][l], fx.dv[0][l], out), SKV_ERR_NOT_PREFILLED, A,
                       NULL, NULL);
            expect_substr("NOT_PREFILLED", where);
            same_state(A, B);
        }
        free(out);
    }
    bad_prefills(A, B, &fx, ml, ms);
    bad_introspection(A, B, bn);

    /* 3. the last slot: a valid prefill after all the failed ones gives the twin's result */
    LBL("[%s] valid prefill of the last slot (layer %d seq %d) after failed ones", bn, ml, ms);
    check_ok(prefill_slot(A, &fx, ml, ms), lbl);
    check_ok(prefill_slot(B, &fx, ml, ms), lbl);
    same_state(A, B);
    for (int l = 0; l < NL; l++)
        for (int b = 0; b < NB; b++)
            for (int h = 0; h < HK; h++) {
                int32_t ids[SEL];
                LBL("[%s] skv_cache_selected before any decode (%d,%d,%d)", bn, l, b, h);
                expect_err(skv_cache_selected(A, l, b, h, ids), SKV_ERR_NO_SELECTION, A, NULL, NULL);
                expect_substr("NO_SELECTION", i64s(l));
            }
    double_prefills(A, B, &fx);

    /* 4. decode steps, bad calls in between */
    for (int step = 0; step < GCAP; step++) {
        for (int l = 0; l < NL; l++) {
            decode_layer_both(A, B, &fx, step, l);
            same_state(A, B);
            /* the layers stay in step: layer l again before the later layers took this step is
               an error, however often it is tried, and changes nothing */
            for (int again = 0; again < 2 && l + 1 < NL && step + 1 < GCAP; again++) {
                float *out = malloc(sizeof outA);
                if (!out) abort();
                LBL("[%s] decode layer %d a step ahead of layer %d (step %d, try %d)", bn, l, l + 1, step, again + 1);
                expect_err(skv_decode(A, l, fx.dq[step + 1][l], fx.dk[step + 1][l], fx.dv[step + 1][l], out),
                           SKV_ERR_INVALID_ARGUMENT, A, "layer", i64s(l));
                char ahead[96];
                snprintf(ahead, sizeof ahead, "taken %d decode steps and layer %d only %d", step + 1, l + 1, step);
                expect_substr("INVALID_ARGUMENT (layer ahead)", ahead);
                free(out);
                same_state(A, B);
            }
            if (step == 0 && l + 1 < NL) {
                int32_t ids[SEL];
                LBL("[%s] skv_cache_selected on layer %d after decoding layer %d only", bn, l + 1, l);
                expect_err(skv_cache_selected(A, l + 1, 0, 0, ids), SKV_ERR_NO_SELECTION, A, NULL, NULL);
            }
        }
        if (step == 0 || step == 2) {
            bad_decodes(A, B, &fx, step + 1, step == 0);
            bad_introspection(A, B, bn);
            double_prefills(A, B, &fx);
        }
    }

    /* 5. capacity: a further step fails on every layer, nothing appended, selection kept */
    {
        snap before;
        memset(&before, 0, sizeof before);
        snap_take(A, &before);
        float *out = malloc(sizeof outA);
        if (!out) abort();
        for (int l = 0; l < NL; l++) {
            char what[64];
            snprintf(what, sizeof what, "sequence 0, layer %d", l);
            LBL("[%s] decode layer %d beyond gen_capacity = %d", bn, l, GCAP);
            expect_err(skv_decode(A, l, fx.dq[GCAP][l], fx.dk[GCAP][l], fx.dv[GCAP][l], out), SKV_ERR_CAPACITY,
                       A, "gen_capacity", i64s(GCAP));
            /* NaN inputs at capacity: still an error, still nothing appended */
            skv_bf16 *bq = planted(fx.dq[GCAP][l], (size_t)NB * HQ * HD, 5, 0);
            skv_status st = skv_decode(A, l, bq, fx.dk[GCAP][l], fx.dv[GCAP][l], out);
            SKVT_CHECK(st == SKV_ERR_CAPACITY || st == SKV_ERR_NONFINITE, "%s (NaN q): got %s", lbl,
                       skv_status_string(st));
            free(bq);
            for (int b = 0; b < NB; b++) {
                skv_seq_info in;
                check_ok(skv_cache_seq_info(A, l, b, &in), lbl);
                SKVT_CHECK(in.n_generated == GCAP && in.has_selection == 1,
                           "%s: seq %d n_generated %d has_selection %d", lbl, b, in.n_generated, in.has_selection);
            }
            snap_take(A, &snA);
            SKVT_CHECK(snap_equal(&before, &snA), "%s: state (selection) changed by the failed step", lbl);
        }
        LBL("[%s] twin B at capacity", bn);
        expect_err(skv_decode(B, 0, fx.dq[GCAP][0], fx.dk[GCAP][0], fx.dv[GCAP][0], out), SKV_ERR_CAPACITY, B,
                   "gen_capacity", NULL);
        same_state(A, B);
        /* the remaining bad calls still report their own status at capacity */
        bad_introspection(A, B, bn);
        free(out);
        free(before.p);
    }

    skv_cache_free(A);
    skv_cache_free(B);
    fixture_free(&fx);
}

/* ---- accepted limits: magnitude 2^32, layers in step --------------------------------------- */

/* x with about 1 element in 64 set to +-2^32 (SKV_MAX_INPUT_MAGNITUDE, accepted). */
static skv_bf16 *at_limit(size_t n)
{
    skv_bf16 *x = rand_bf16(n, 1.0);
    for (size_t i = 0; i < n; i++)
        if (skvt_rng_range(&rng, 0, 63) == 0) x[i] = skvt_rng_range(&rng, 0, 1) ? 0x4F80 : 0xCF80;
    return x;
}

static int bf16_all_finite(const skv_bf16 *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((x[i] & 0x7F80) == 0x7F80) return 0;
    return 1;
}

/*
 * Inputs with elements at exactly +-SKV_MAX_INPUT_MAGNITUDE are accepted and give finite
 * landmarks and outputs (the bound leaves float arithmetic far from overflow: scores
 * <= D 2^64); and the layers may take a token's step in any order, but none may run ahead.
 */
static void test_limits(skv_backend be)
{
    const char *bn = bname(be);
    skv_config cfg = base_config(be);
    skv_cache *c = NULL;
    LBL("[%s] limits: create", bn);
    check_ok(skv_cache_create(&cfg, &c), lbl);
    if (!c) return;
    SKVT_CHECK(skv_bf16_to_float(0x4F80) == SKV_MAX_INPUT_MAGNITUDE, "0x4F80 is not SKV_MAX_INPUT_MAGNITUDE");
    for (int l = 0; l < NL; l++)
        for (int b = 0; b < NB; b++) {
            const int64_t n = skvt_rng_range(&rng, MINP, MAXP);
            const size_t e = (size_t)n * HK * HD;
            skv_bf16 *k = at_limit(e), *v = at_limit(e);
            LBL("[%s] prefill layer %d seq %d with elements at +-2^32 (n = %lld)", bn, l, b, (long long)n);
            skv_status st = skv_prefill(c, l, b, n, k, v, NULL);
            SKVT_CHECK_STATUS(st, SKV_OK, lbl);
            if (st) printf("  %s\n", skv_cache_last_error(c));
            free(k);
            free(v);
            for (int h = 0; h < HK && !st; h++) {
                skv_bf16 lm[MAXCAND * HD];
                skv_seq_info in;
                check_ok(skv_cache_seq_info(c, l, b, &in), lbl);
                check_ok(skv_cache_landmarks(c, l, b, h, lm), lbl);
                SKVT_CHECK(bf16_all_finite(lm, (size_t)in.n_candidates * HD), "%s: head %d: a landmark is not finite",
                           lbl, h);
            }
        }
    /* token 0: layer 1 before layer 0 (allowed); token 1: layer 1 twice (the second is a step
       ahead of layer 0), then layer 0; token 2: layer 0 twice (the second is ahead of layer 1),
       then layer 1 */
    static const int order[][2] = {{1, SKV_OK}, {0, SKV_OK}, {1, SKV_OK}, {1, SKV_ERR_INVALID_ARGUMENT},
                                   {0, SKV_OK}, {0, SKV_OK}, {0, SKV_ERR_INVALID_ARGUMENT}, {1, SKV_OK}};
    float *out = malloc(sizeof outA);
    if (!out) abort();
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        const int l = order[i][0];
        skv_bf16 *q = at_limit((size_t)NB * HQ * HD), *k = at_limit((size_t)NB * HK * HD), *v = at_limit((size_t)NB * HK * HD);
        int32_t gen_before[NL];
        for (int ll = 0; ll < NL; ll++) {
            skv_seq_info in;
            check_ok(skv_cache_seq_info(c, ll, 0, &in), "seq_info");
            gen_before[ll] = in.n_generated;
        }
        LBL("[%s] limits: decode #%zu of layer %d (generated: layer 0 %d, layer 1 %d), inputs at +-2^32", bn, i, l,
            gen_before[0], gen_before[1]);
        const skv_status st = skv_decode(c, l, q, k, v, out);
        if (order[i][1] == SKV_OK) {
            SKVT_CHECK_STATUS(st, SKV_OK, lbl);
            int fin = 1;
            for (size_t j = 0; j < sizeof outA / sizeof outA[0]; j++) fin &= isfinite(out[j]) != 0;
            SKVT_CHECK(st || fin, "%s: non-finite output", lbl);
        } else {
            expect_err(st, (skv_status)order[i][1], c, "layer", i64s(l));
        }
        skv_seq_info in;
        check_ok(skv_cache_seq_info(c, l, 0, &in), "seq_info");
        SKVT_CHECK(in.n_generated == gen_before[l] + (order[i][1] == SKV_OK),
                   "%s: layer %d has %d generated tokens, want %d", lbl, l, in.n_generated,
                   gen_before[l] + (order[i][1] == SKV_OK));
        free(q), free(k), free(v);
    }
    free(out);
    skv_cache_free(c);
}

/* ---- n_threads: a failed thread creation is a status ------------------------------------------ */

#if defined(__SANITIZE_ADDRESS__)
#define SKVT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SKVT_ASAN 1
#endif
#endif

/*
 * A cpu cache whose n_threads the process cannot start: in a child whose address space is
 * capped (RLIMIT_AS) so that thread stacks cannot be mapped, skv_cache_create must return
 * SKV_ERR_OUT_OF_MEMORY naming n_threads (libgomp would end the process instead), and
 * n_threads = SKV_MAX_THREADS in this process either works or is that same status.
 */
static void test_thread_limit(void)
{
    skv_config cfg = base_config(SKV_BACKEND_CPU);
    cfg.n_threads = SKV_MAX_THREADS;
    skv_cache *c = NULL;
    LBL("[cpu] create with n_threads = SKV_MAX_THREADS = %d", SKV_MAX_THREADS);
    skv_status st = skv_cache_create(&cfg, &c);
    SKVT_CHECK(st == SKV_OK || st == SKV_ERR_OUT_OF_MEMORY, "%s: got %s", lbl, skv_status_string(st));
    if (st) expect_err(st, SKV_ERR_OUT_OF_MEMORY, NULL, "n_threads", i64s(SKV_MAX_THREADS));
    skv_cache_free(c);
#ifdef SKVT_ASAN
    skvt_skip("n_threads beyond what the process can start: RLIMIT_AS does not mix with AddressSanitizer");
#else
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        /* the child: cap the address space near its current size, then ask for 512 threads
           (511 stacks of 8 MiB or more cannot fit in 64 MiB) */
        long pages = 0;
        FILE *f = fopen("/proc/self/statm", "r");
        if (!f || fscanf(f, "%ld", &pages) != 1) _exit(3);
        fclose(f);
        struct rlimit rl;
        rl.rlim_cur = rl.rlim_max = (rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE) + ((rlim_t)64 << 20);
        if (setrlimit(RLIMIT_AS, &rl)) _exit(4);
        skv_config cc = base_config(SKV_BACKEND_CPU);
        cc.n_threads = 512;
        skv_cache *k = NULL;
        skv_status s2 = skv_cache_create(&cc, &k);
        const char *m = skv_last_error();
        _exit(s2 == SKV_ERR_OUT_OF_MEMORY && k == NULL && strstr(m, "n_threads = 512") ? 0 : s2 == SKV_OK ? 5 : 6);
    }
    int wst = 0;
    LBL("[cpu] create with n_threads = 512 in a child capped by RLIMIT_AS");
    SKVT_CHECK(pid > 0 && waitpid(pid, &wst, 0) == pid, "%s: fork/waitpid failed", lbl);
    SKVT_CHECK(WIFEXITED(wst) && WEXITSTATUS(wst) == 0,
               "%s: the child %s %d (0: SKV_ERR_OUT_OF_MEMORY naming n_threads; 5: create succeeded; 6: another "
               "status; 3, 4: no limit set)",
               lbl, WIFEXITED(wst) ? "exited with" : "died of signal", WIFEXITED(wst) ? WEXITSTATUS(wst) : WTERMSIG(wst));
#endif
}

/* ---- skv-bench command line ------------------------------------------------------------------- */

/* Runs cmd (stdout and stderr together) into buf; returns the exit status or -1. */
static int run_cmd(const char *cmd, char *buf, size_t cap)
{
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(buf, 1, cap - 1, p);
    buf[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* skv-bench --help lists its subcommands; an unknown option or subcommand says so (exit 2). */
static void test_bench_cli(const char *argv0)
{
    char bench[1024], cmd[1200], out[8192];
    const char *slash = strrchr(argv0, '/');
    /* build/tests/test_bad_input -> build/skv-bench */
    snprintf(bench, sizeof bench, "%.*s/../skv-bench", slash ? (int)(slash - argv0) : 1, slash ? argv0 : ".");
    if (access(bench, X_OK) != 0) {
        skvt_skip("skv-bench not built next to the tests (make build/skv-bench)");
        return;
    }
    snprintf(cmd, sizeof cmd, "'%s' --help 2>&1", bench);
    int rc = run_cmd(cmd, out, sizeof out);
    LBL("skv-bench --help");
    SKVT_CHECK(rc == 0, "%s: exit %d", lbl, rc);
    SKVT_CHECK(strstr(out, "skv-bench decode") && strstr(out, "skv-bench factorize"),
               "%s does not list the subcommands decode and factorize:\n%s", lbl, out);
    static const char *const bad[][2] = {{"--bogus", "unknown option '--bogus'"},
                                         {"bogus", "unknown subcommand 'bogus'"},
                                         {"decode --bogus", "unknown option '--bogus'"},
                                         {"factorize --bogus", "unknown option '--bogus'"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", bench, bad[i][0]);
        rc = run_cmd(cmd, out, sizeof out);
        LBL("skv-bench %s", bad[i][0]);
        SKVT_CHECK(rc == 2 && strstr(out, bad[i][1]) && strstr(out, "usage:"),
                   "%s: exit %d (want 2), output lacks \"%s\" or the usage:\n%s", lbl, rc, bad[i][1], out);
    }
}

/* ---- op-level API ------------------------------------------------------------------- */

#define SENT 0xA5
static int all_sent(const void *p, size_t n)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        if (c[i] != SENT) return 0;
    return 1;
}

static void test_ops(skv_backend be)
{
    const char *bn = skv_backend_name(be);
    skv_rope_config rope = skv_config_default().rope;

    /* factorize: n = 16, d = 8, r = 4 */
    {
        enum { N = 16, DD = 8, R = 4 };
        skv_bf16 a[N * DD];
        float u[N * R], w[R * DD];
        skvt_fill_bf16_normal(&rng, a, N * DD, 1.0);
        static const char *const nm[3] = {"a", "u", "w"};
        for (int which = 0; which < 3; which++) {
            memset(u, SENT, sizeof u);
            memset(w, SENT, sizeof w);
            LBL("[%s] skv_op_factorize %s NULL", bn, nm[which]);
            expect_err(skv_op_factorize(be, N, DD, R, which == 0 ? NULL : a, which == 1 ? NULL : u,
                                        which == 2 ? NULL : w),
                       SKV_ERR_NULL_POINTER, NULL, nm[which], NULL);
            SKVT_CHECK(all_sent(u, sizeof u) && all_sent(w, sizeof w), "%s: outputs written", lbl);
        }
        const struct { int64_t n; int32_t d, r; const char *w; } bad[] = {
            {N, DD, 0, "r"}, {N, DD, DD + 1, "r"}, {4, DD, 5, "r"}, {0, DD, 1, "n"}, {-3, DD, 1, "n"},
            {N, 0, 1, "d"}, {N, -8, 1, "d"}};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            memset(u, SENT, sizeof u);
            memset(w, SENT, sizeof w);
            LBL("[%s] skv_op_factorize n=%lld d=%d r=%d", bn, (long long)bad[i].n, bad[i].d, bad[i].r);
            expect_err(skv_op_factorize(be, bad[i].n, bad[i].d, bad[i].r, a, u, w), SKV_ERR_INVALID_ARGUMENT,
                       NULL, bad[i].w, NULL);
            SKVT_CHECK(all_sent(u, sizeof u) && all_sent(w, sizeof w), "%s: outputs written", lbl);
        }
        for (int kind = 0; kind < 4; kind++) {
            skv_bf16 *b = planted(a, N * DD, (size_t)skvt_rng_range(&rng, 0, N * DD - 1), kind);
            memset(u, SENT, sizeof u);
            memset(w, SENT, sizeof w);
            LBL("[%s] skv_op_factorize %s in a", bn, bad_names[kind]);
            expect_err(skv_op_factorize(be, N, DD, R, b, u, w), SKV_ERR_NONFINITE, NULL, "a", NULL);
            SKVT_CHECK(all_sent(u, sizeof u) && all_sent(w, sizeof w), "%s: outputs written", lbl);
            free(b);
        }
        LBL("[%s] skv_op_factorize backend 99", bn);
        expect_err(skv_op_factorize((skv_backend)99, N, DD, R, a, u, w), SKV_ERR_INVALID_ARGUMENT, NULL, "99", NULL);
        LBL("[%s] skv_op_factorize backend cuda", bn);
        if (!cuda_usable()) /* with a GPU, host pointers would go to the device: test_accuracy covers cuda */
            expect_err(skv_op_factorize(SKV_BACKEND_CUDA, N, DD, R, a, u, w), SKV_ERR_NO_DEVICE, NULL, "cuda", NULL);
        LBL("[%s] skv_op_factorize valid", bn);
        check_ok(skv_op_factorize(be, N, DD, R, a, u, w), lbl);
    }

    /* rope tables and rope: head_dim 8, 4 tokens, 2 heads */
    {
        enum { DD = 8, T = 4, H = 2, P = 16 };
        float cs[P * DD / 2], sn[P * DD / 2];
        skv_bf16 in[T * H * DD], out[T * H * DD];
        skvt_fill_bf16_normal(&rng, in, T * H * DD, 1.0);
        LBL("[%s] skv_rope_table_len", bn);
        SKVT_CHECK(skv_rope_table_len(&rope, DD, P) == P * DD / 2, "%s", lbl);
        SKVT_CHECK(skv_rope_table_len(&rope, DD, -1) == 0, "%s: n_positions = -1 gives %zu, want 0", lbl,
                   skv_rope_table_len(&rope, DD, -1));
        /* odd head_dim: skv_rope_table_build rejects it, so the length must be 0 ("0 on invalid input") */
        SKVT_CHECK(skv_rope_table_len(&rope, 7, P) == 0, "%s: head_dim = 7 gives %zu, want 0", lbl,
                   skv_rope_table_len(&rope, 7, P));
        SKVT_CHECK(skv_rope_table_len(&rope, 0, P) == 0, "%s: head_dim = 0 gives %zu, want 0", lbl,
                   skv_rope_table_len(&rope, 0, P));
        {
            skv_rope_config r2 = rope;
            r2.rotary_dim = 3;
            SKVT_CHECK(skv_rope_table_len(&r2, DD, P) == 0, "%s: rotary_dim = 3 gives %zu, want 0", lbl,
                       skv_rope_table_len(&r2, DD, P));
        }
        static const char *const tnm[3] = {"rope", "cos_tab", "sin_tab"};
        for (int which = 0; which < 3; which++) {
            memset(cs, SENT, sizeof cs);
            memset(sn, SENT, sizeof sn);
            LBL("skv_rope_table_build %s NULL", tnm[which]);
            expect_err(skv_rope_table_build(which == 0 ? NULL : &rope, DD, P, which == 1 ? NULL : cs,
                                            which == 2 ? NULL : sn),
                       SKV_ERR_NULL_POINTER, NULL, tnm[which], NULL);
            SKVT_CHECK(all_sent(cs, sizeof cs) && all_sent(sn, sizeof sn), "%s: outputs written", lbl);
        }
        LBL("skv_rope_table_build head_dim 7");
        expect_err(skv_rope_table_build(&rope, 7, P, cs, sn), SKV_ERR_INVALID_ARGUMENT, NULL, "head_dim", "7");
        LBL("skv_rope_table_build n_positions -1");
        expect_err(skv_rope_table_build(&rope, DD, -1, cs, sn), SKV_ERR_INVALID_ARGUMENT, NULL, "n_positions", "-1");
        {
            skv_rope_config r2 = rope;
            r2.theta = NAN;
            LBL("skv_rope_table_build theta NaN");
            expect_err(skv_rope_table_build(&r2, DD, P, cs, sn), SKV_ERR_INVALID_ARGUMENT, NULL, "rope.theta", NULL);
            SKVT_CHECK(all_sent(cs, sizeof cs) && all_sent(sn, sizeof sn), "%s: outputs written", lbl);
        }
        check_ok(skv_rope_table_build(&rope, DD, P, cs, sn), "skv_rope_table_build valid");

        static const char *const rnm[5] = {"rope", "cos_tab", "sin_tab", "in", "out"};
        for (int which = 0; which < 5; which++) {
            memset(out, SENT, sizeof out);
            LBL("[%s] skv_op_rope %s NULL", bn, rnm[which]);
            expect_err(skv_op_rope(be, which == 0 ? NULL : &rope, DD, T, H, 0, which == 1 ? NULL : cs,
                                   which == 2 ? NULL : sn, which == 3 ? NULL : in, which == 4 ? NULL : out),
                       SKV_ERR_NULL_POINTER, NULL, rnm[which], NULL);
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
        }
        const struct { int32_t hd; int64_t nt; int32_t nh; int64_t p0; const char *w; } bad[] = {
            {7, T, H, 0, "head_dim"}, {0, T, H, 0, "head_dim"}, {DD, -1, H, 0, "n_tokens"},
            {DD, T, 0, 0, "n_heads"}, {DD, T, H, -1, "pos0"}};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            memset(out, SENT, sizeof out);
            LBL("[%s] skv_op_rope bad %s", bn, bad[i].w);
            expect_err(skv_op_rope(be, &rope, bad[i].hd, bad[i].nt, bad[i].nh, bad[i].p0, cs, sn, in, out),
                       SKV_ERR_INVALID_ARGUMENT, NULL, bad[i].w, NULL);
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
        }
        {
            skv_rope_config r2 = rope;
            r2.interleaved = 2;
            memset(out, SENT, sizeof out);
            LBL("[%s] skv_op_rope interleaved 2", bn);
            expect_err(skv_op_rope(be, &r2, DD, T, H, 0, cs, sn, in, out), SKV_ERR_INVALID_ARGUMENT, NULL,
                       "rope.interleaved", "2");
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
        }
        for (int kind = 0; kind < 4; kind++) {
            skv_bf16 *b = planted(in, T * H * DD, (size_t)skvt_rng_range(&rng, 0, T * H * DD - 1), kind);
            memset(out, SENT, sizeof out);
            LBL("[%s] skv_op_rope %s in in", bn, bad_names[kind]);
            expect_err(skv_op_rope(be, &rope, DD, T, H, 0, cs, sn, b, out), SKV_ERR_NONFINITE, NULL, "in", NULL);
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
            free(b);
        }
        check_ok(skv_op_rope(be, &rope, DD, T, H, 0, cs, sn, in, out), "skv_op_rope valid");
    }

    /* landmarks_outliers: 6 chunks of 4, Hk 2, D 8, O 2 */
    {
        enum { NC = 6, C = 4, H = 2, DD = 8, O = 2 };
        skv_bf16 kp[NC * C * H * DD], lmk[H * (NC - O) * DD];
        int32_t oid[H * O], cid[H * (NC - O)];
        skvt_fill_bf16_normal(&rng, kp, sizeof kp / sizeof kp[0], 1.0);
        static const char *const nm[4] = {"k_post", "outlier_ids", "candidate_ids", "landmarks"};
        for (int which = 0; which < 4; which++) {
            memset(oid, SENT, sizeof oid);
            memset(cid, SENT, sizeof cid);
            memset(lmk, SENT, sizeof lmk);
            LBL("[%s] skv_op_landmarks_outliers %s NULL", bn, nm[which]);
            expect_err(skv_op_landmarks_outliers(be, NC, C, H, DD, O, which == 0 ? NULL : kp, which == 1 ? NULL : oid,
                                                 which == 2 ? NULL : cid, which == 3 ? NULL : lmk),
                       SKV_ERR_NULL_POINTER, NULL, nm[which], NULL);
            SKVT_CHECK(all_sent(oid, sizeof oid) && all_sent(cid, sizeof cid) && all_sent(lmk, sizeof lmk),
                       "%s: outputs written", lbl);
        }
        const struct { int32_t nc, c, h, d, o; const char *w; } bad[] = {
            {NC, C, H, DD, NC, "n_outliers"}, {NC, C, H, DD, -1, "n_outliers"}, {0, C, H, DD, 0, "n_chunks"},
            {NC, 0, H, DD, O, "chunk"},       {NC, C, 0, DD, O, "n_kv_heads"}, {NC, C, H, 0, O, "head_dim"}};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            memset(oid, SENT, sizeof oid);
            memset(cid, SENT, sizeof cid);
            memset(lmk, SENT, sizeof lmk);
            LBL("[%s] skv_op_landmarks_outliers bad %s", bn, bad[i].w);
            expect_err(skv_op_landmarks_outliers(be, bad[i].nc, bad[i].c, bad[i].h, bad[i].d, bad[i].o, kp, oid, cid,
                                                 lmk),
                       SKV_ERR_INVALID_ARGUMENT, NULL, bad[i].w, NULL);
            SKVT_CHECK(all_sent(oid, sizeof oid) && all_sent(cid, sizeof cid) && all_sent(lmk, sizeof lmk),
                       "%s: outputs written", lbl);
        }
        for (int kind = 0; kind < 4; kind++) {
            skv_bf16 *b = planted(kp, sizeof kp / sizeof kp[0],
                                  (size_t)skvt_rng_range(&rng, 0, (int64_t)(sizeof kp / sizeof kp[0]) - 1), kind);
            memset(lmk, SENT, sizeof lmk);
            LBL("[%s] skv_op_landmarks_outliers %s in k_post", bn, bad_names[kind]);
            expect_err(skv_op_landmarks_outliers(be, NC, C, H, DD, O, b, oid, cid, lmk), SKV_ERR_NONFINITE, NULL,
                       "k_post", NULL);
            SKVT_CHECK(all_sent(lmk, sizeof lmk), "%s: outputs written", lbl);
            free(b);
        }
        LBL("[%s] skv_op_landmarks_outliers O = 0, outlier_ids NULL (valid)", bn);
        check_ok(skv_op_landmarks_outliers(be, NC - O, C, H, DD, 0, kp, NULL, cid, lmk), lbl);
    }

    /* score_select: Hq 4, Hk 2, D 8, 6 candidates, S 2 */
    {
        enum { HQ4 = 4, H = 2, DD = 8, NCD = 6, S = 2 };
        skv_bf16 q[HQ4 * DD], lmk[H * NCD * DD];
        int32_t cid[H * NCD], sidx[H * S], sids[H * S];
        float amax[H * NCD];
        skvt_fill_bf16_normal(&rng, q, HQ4 * DD, 1.0);
        skvt_fill_bf16_normal(&rng, lmk, H * NCD * DD, 1.0);
        for (int i = 0; i < H * NCD; i++) cid[i] = 3 * (i % NCD) + 1;
        static const char *const nm[4] = {"q", "landmarks", "sel_idx", "candidate_ids"};
        for (int which = 0; which < 4; which++) {
            memset(sidx, SENT, sizeof sidx);
            memset(sids, SENT, sizeof sids);
            memset(amax, SENT, sizeof amax);
            LBL("[%s] skv_op_score_select %s NULL", bn, nm[which]);
            expect_err(skv_op_score_select(be, HQ4, H, DD, NCD, S, 0.0f, which == 0 ? NULL : q,
                                           which == 1 ? NULL : lmk, which == 3 ? NULL : cid,
                                           which == 2 ? NULL : sidx, sids, amax),
                       SKV_ERR_NULL_POINTER, NULL, nm[which], NULL);
            SKVT_CHECK(all_sent(sidx, sizeof sidx) && all_sent(sids, sizeof sids) && all_sent(amax, sizeof amax),
                       "%s: outputs written", lbl);
        }
        const struct { int32_t hq, hk, d, nc, s; float sc; const char *w; } bad[] = {
            {HQ4, H, DD, NCD, NCD + 1, 0.0f, "n_select"}, {HQ4, H, DD, NCD, 0, 0.0f, "n_select"},
            {3, H, DD, NCD, S, 0.0f, "n_q_heads"},        {1, H, DD, NCD, S, 0.0f, "n_q_heads"},
            {HQ4, 0, DD, NCD, S, 0.0f, "n_kv_heads"},     {HQ4, H, 0, NCD, S, 0.0f, "head_dim"},
            {HQ4, H, DD, 0, S, 0.0f, "n_cand"},           {HQ4, H, DD, NCD, S, NAN, "scale"},
            {HQ4, H, DD, NCD, S, -1.0f, "scale"},         {HQ4, H, DD, NCD, S, INFINITY, "scale"}};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            memset(sidx, SENT, sizeof sidx);
            memset(sids, SENT, sizeof sids);
            LBL("[%s] skv_op_score_select bad %s", bn, bad[i].w);
            expect_err(skv_op_score_select(be, bad[i].hq, bad[i].hk, bad[i].d, bad[i].nc, bad[i].s, bad[i].sc, q,
                                           lmk, cid, sidx, sids, NULL),
                       SKV_ERR_INVALID_ARGUMENT, NULL, bad[i].w, NULL);
            SKVT_CHECK(all_sent(sidx, sizeof sidx) && all_sent(sids, sizeof sids), "%s: outputs written", lbl);
        }
        {
            int32_t c2[H * NCD];
            memcpy(c2, cid, sizeof c2);
            c2[7] = -4;
            memset(sidx, SENT, sizeof sidx);
            LBL("[%s] skv_op_score_select candidate_ids[7] = -4", bn);
            expect_err(skv_op_score_select(be, HQ4, H, DD, NCD, S, 0.0f, q, lmk, c2, sidx, sids, NULL),
                       SKV_ERR_INVALID_ARGUMENT, NULL, "candidate_ids", "-4");
            SKVT_CHECK(all_sent(sidx, sizeof sidx), "%s: outputs written", lbl);
        }
        for (int kind = 0; kind < 4; kind++) {
            for (int t = 0; t < 2; t++) {
                skv_bf16 *b = t == 0 ? planted(q, HQ4 * DD, (size_t)skvt_rng_range(&rng, 0, HQ4 * DD - 1), kind)
                                     : planted(lmk, H * NCD * DD, (size_t)skvt_rng_range(&rng, 0, H * NCD * DD - 1), kind);
                memset(sidx, SENT, sizeof sidx);
                LBL("[%s] skv_op_score_select %s in %s", bn, bad_names[kind], t ? "landmarks" : "q");
                expect_err(skv_op_score_select(be, HQ4, H, DD, NCD, S, 0.0f, t ? q : b, t ? b : lmk, cid, sidx, sids,
                                               NULL),
                           SKV_ERR_NONFINITE, NULL, t ? "landmarks" : "q", NULL);
                SKVT_CHECK(all_sent(sidx, sizeof sidx), "%s: outputs written", lbl);
                free(b);
            }
        }
        /* skv_op_score_select_mass: its own arguments */
        {
            int32_t cnt[H];
            const struct { int32_t s, fl; float p; int null_counts; const char *w; } mb[] = {
                {S, 0, 0.0f, 0, "select_mass"},      {S, 0, -0.5f, 0, "select_mass"},
                {S, 0, 1.5f, 0, "select_mass"},      {S, 0, NAN, 0, "select_mass"},
                {S, -1, 0.9f, 0, "select_min_chunks"}, {S, S + 1, 0.9f, 0, "select_min_chunks"},
                {0, 0, 0.9f, 0, "n_select"},         {S, 0, 0.9f, 1, "counts"}};
            for (size_t i = 0; i < sizeof mb / sizeof mb[0]; i++) {
                memset(sidx, SENT, sizeof sidx);
                memset(cnt, SENT, sizeof cnt);
                LBL("[%s] skv_op_score_select_mass bad %s", bn, mb[i].w);
                expect_err(skv_op_score_select_mass(be, HQ4, H, DD, NCD, mb[i].s, mb[i].p, mb[i].fl, 0.0f, q, lmk, cid,
                                                    sidx, sids, NULL, mb[i].null_counts ? NULL : cnt),
                           mb[i].null_counts ? SKV_ERR_NULL_POINTER : SKV_ERR_INVALID_ARGUMENT, NULL, mb[i].w, NULL);
                SKVT_CHECK(all_sent(sidx, sizeof sidx) && all_sent(cnt, sizeof cnt), "%s: outputs written", lbl);
            }
            int32_t big_idx[H * (NCD + 3)];
            LBL("[%s] skv_op_score_select_mass n_select > n_cand, floor = n_select (valid: k = n_cand)", bn);
            check_ok(skv_op_score_select_mass(be, HQ4, H, DD, NCD, NCD + 3, 0.5f, NCD + 3, 0.0f, q, lmk, NULL, big_idx,
                                              NULL, NULL, cnt),
                     lbl);
            SKVT_CHECK(cnt[0] == NCD && cnt[1] == NCD && big_idx[NCD] == -1 && big_idx[NCD + 2] == -1 &&
                           big_idx[NCD + 3 + NCD - 1] == NCD - 1,
                       "%s: counts %d %d", lbl, cnt[0], cnt[1]);
        }
        LBL("[%s] skv_op_score_select candidate_ids, sel_ids, amax NULL (valid)", bn);
        check_ok(skv_op_score_select(be, HQ4, H, DD, NCD, S, 0.0f, q, lmk, NULL, sidx, NULL, NULL),
                          lbl);
    }

    /* rebuild_keys: D 8, Hk 2, r 4, c 4, S 2, n 24 */
    {
        enum { DD = 8, H = 2, R = 4, C = 4, S = 2, N = 24 };
        skv_bf16 u[N * R], w[R * H * DD], kout[H * S * C * DD];
        int32_t ids[H * S] = {0, 5, 2, 3};
        float cs[N * DD / 2], sn[N * DD / 2];
        skvt_fill_bf16_normal(&rng, u, N * R, 1.0);
        skvt_fill_bf16_normal(&rng, w, R * H * DD, 1.0);
        check_ok(skv_rope_table_build(&rope, DD, N, cs, sn), "tables");
        static const char *const nm[7] = {"rope", "u", "w", "chunk_ids", "cos_tab", "sin_tab", "k_out"};
        for (int which = 0; which < 7; which++) {
            memset(kout, SENT, sizeof kout);
            LBL("[%s] skv_op_rebuild_keys %s NULL", bn, nm[which]);
            expect_err(skv_op_rebuild_keys(be, which == 0 ? NULL : &rope, DD, H, R, C, S, N, which == 1 ? NULL : u,
                                           which == 2 ? NULL : w, which == 3 ? NULL : ids, which == 4 ? NULL : cs,
                                           which == 5 ? NULL : sn, which == 6 ? NULL : kout),
                       SKV_ERR_NULL_POINTER, NULL, nm[which], NULL);
            SKVT_CHECK(all_sent(kout, sizeof kout), "%s: output written", lbl);
        }
        const struct { int32_t h, r, c, s; int64_t n; int32_t id; const char *w; } bad[] = {
            {H, R, C, S, N, 6, "chunk_ids"}, {H, R, C, S, N, -1, "chunk_ids"}, {H, H * DD + 1, C, S, N, 0, "rank"},
            {H, 0, C, S, N, 0, "rank"},      {0, R, C, S, N, 0, "n_kv_heads"}, {H, R, 0, S, N, 0, "chunk"},
            {H, R, C, 0, N, 0, "n_select"},  {H, R, C, S, C - 1, 0, "n"}};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            int32_t id2[H * S];
            memcpy(id2, ids, sizeof id2);
            id2[3] = bad[i].id ? bad[i].id : id2[3];
            memset(kout, SENT, sizeof kout);
            LBL("[%s] skv_op_rebuild_keys bad %s", bn, bad[i].w);
            expect_err(skv_op_rebuild_keys(be, &rope, DD, bad[i].h, bad[i].r, bad[i].c, bad[i].s, bad[i].n, u, w, id2,
                                           cs, sn, kout),
                       SKV_ERR_INVALID_ARGUMENT, NULL, bad[i].w, NULL);
            SKVT_CHECK(all_sent(kout, sizeof kout), "%s: output written", lbl);
        }
        for (int kind = 0; kind < 4; kind++)
            for (int t = 0; t < 2; t++) {
                skv_bf16 *b = t == 0 ? planted(u, N * R, (size_t)skvt_rng_range(&rng, 0, N * R - 1), kind)
                                     : planted(w, R * H * DD, (size_t)skvt_rng_range(&rng, 0, R * H * DD - 1), kind);
                memset(kout, SENT, sizeof kout);
                LBL("[%s] skv_op_rebuild_keys %s in %s", bn, bad_names[kind], t ? "w" : "u");
                expect_err(skv_op_rebuild_keys(be, &rope, DD, H, R, C, S, N, t ? u : b, t ? b : w, ids, cs, sn, kout),
                           SKV_ERR_NONFINITE, NULL, t ? "w" : "u", NULL);
                SKVT_CHECK(all_sent(kout, sizeof kout), "%s: output written", lbl);
                free(b);
            }
        check_ok(skv_op_rebuild_keys(be, &rope, DD, H, R, C, S, N, u, w, ids, cs, sn, kout),
                          "skv_op_rebuild_keys valid");
    }

    /* gather_values: Hk 2, D 8, c 4, 5 chunks in the store, S 2 */
    {
        enum { H = 2, DD = 8, C = 4, NS = 5, S = 2 };
        skv_bf16 store[H * NS * C * DD], vout[H * S * C * DD];
        int32_t idx[H * S] = {1, 4, 0, 2};
        skvt_fill_bf16_normal(&rng, store, sizeof store / sizeof store[0], 1.0);
        static const char *const nm[3] = {"store", "idx", "v_out"};
        for (int which = 0; which < 3; which++) {
            memset(vout, SENT, sizeof vout);
            LBL("[%s] skv_op_gather_values %s NULL", bn, nm[which]);
            expect_err(skv_op_gather_values(be, H, DD, C, NS, S, which == 0 ? NULL : store, which == 1 ? NULL : idx,
                                            which == 2 ? NULL : vout),
                       SKV_ERR_NULL_POINTER, NULL, nm[which], NULL);
            SKVT_CHECK(all_sent(vout, sizeof vout), "%s: output written", lbl);
        }
        static const int32_t badidx[] = {NS, -1, INT32_MAX, INT32_MIN};
        for (size_t i = 0; i < sizeof badidx / sizeof badidx[0]; i++) {
            int32_t i2[H * S];
            memcpy(i2, idx, sizeof i2);
            i2[2] = badidx[i];
            memset(vout, SENT, sizeof vout);
            LBL("[%s] skv_op_gather_values idx[2] = %d", bn, badidx[i]);
            expect_err(skv_op_gather_values(be, H, DD, C, NS, S, store, i2, vout), SKV_ERR_INVALID_ARGUMENT, NULL,
                       "idx", i64s(badidx[i]));
            SKVT_CHECK(all_sent(vout, sizeof vout), "%s: output written", lbl);
        }
        const struct { int32_t h, d, c, ns, s; const char *w; } bad[] = {
            {0, DD, C, NS, S, "n_kv_heads"}, {H, 0, C, NS, S, "head_dim"}, {H, DD, 0, NS, S, "chunk"},
            {H, DD, C, 0, S, "n_store"},     {H, DD, C, NS, 0, "n_select"}};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            memset(vout, SENT, sizeof vout);
            LBL("[%s] skv_op_gather_values bad %s", bn, bad[i].w);
            expect_err(skv_op_gather_values(be, bad[i].h, bad[i].d, bad[i].c, bad[i].ns, bad[i].s, store, idx, vout),
                       SKV_ERR_INVALID_ARGUMENT, NULL, bad[i].w, NULL);
            SKVT_CHECK(all_sent(vout, sizeof vout), "%s: output written", lbl);
        }
        check_ok(skv_op_gather_values(be, H, DD, C, NS, S, store, idx, vout), "gather valid");
    }

    /* sparse / full attention: Hq 4, Hk 2, D 8, 3 tokens */
    {
        enum { HQ4 = 4, H = 2, DD = 8, T = 3 };
        skv_bf16 q[HQ4 * DD], k[H * T * DD], v[H * T * DD];
        float out[HQ4 * DD];
        skvt_fill_bf16_normal(&rng, q, HQ4 * DD, 1.0);
        skvt_fill_bf16_normal(&rng, k, H * T * DD, 1.0);
        skvt_fill_bf16_normal(&rng, v, H * T * DD, 1.0);
        /* head-major span: head_stride T*D, token_stride D; an empty span with NULL k, v */
        skv_kv_span sp[2] = {{k, v, T, T * DD, DD}, {NULL, NULL, 0, 0, 0}};
        static const char *const nm[3] = {"q", "spans", "out"};
        for (int which = 0; which < 3; which++) {
            memset(out, SENT, sizeof out);
            LBL("[%s] skv_op_sparse_attention %s NULL", bn, nm[which]);
            expect_err(skv_op_sparse_attention(be, HQ4, H, DD, 0.0f, which == 0 ? NULL : q, 2,
                                               which == 1 ? NULL : sp, which == 2 ? NULL : out),
                       SKV_ERR_NULL_POINTER, NULL, nm[which], NULL);
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
        }
        for (int which = 0; which < 2; which++) {
            skv_kv_span s2[2] = {sp[0], sp[1]};
            if (which == 0) s2[0].k = NULL;
            else s2[0].v = NULL;
            memset(out, SENT, sizeof out);
            LBL("[%s] skv_op_sparse_attention spans[0].%s NULL", bn, which ? "v" : "k");
            expect_err(skv_op_sparse_attention(be, HQ4, H, DD, 0.0f, q, 2, s2, out), SKV_ERR_NULL_POINTER, NULL,
                       "spans", NULL);
            expect_substr("span NULL", which ? "spans[0].v" : "spans[0].k");
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
        }
        {
            skv_kv_span s2[SKV_MAX_SPANS + 1];
            for (int i = 0; i <= SKV_MAX_SPANS; i++) s2[i] = sp[0];
            const struct { int32_t n; const char *w; } bn2[] = {{0, "n_spans"}, {-1, "n_spans"},
                                                                 {SKV_MAX_SPANS + 1, "n_spans"}};
            for (size_t i = 0; i < sizeof bn2 / sizeof bn2[0]; i++) {
                memset(out, SENT, sizeof out);
                LBL("[%s] skv_op_sparse_attention n_spans = %d", bn, bn2[i].n);
                expect_err(skv_op_sparse_attention(be, HQ4, H, DD, 0.0f, q, bn2[i].n, s2, out),
                           SKV_ERR_INVALID_ARGUMENT, NULL, bn2[i].w, i64s(bn2[i].n));
                SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
            }
            skv_kv_span e2[2] = {sp[1], sp[1]};
            memset(out, SENT, sizeof out);
            LBL("[%s] skv_op_sparse_attention all spans empty", bn);
            expect_err(skv_op_sparse_attention(be, HQ4, H, DD, 0.0f, q, 2, e2, out), SKV_ERR_INVALID_ARGUMENT, NULL,
                       NULL, NULL);
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
            skv_kv_span n2[2] = {sp[0], sp[0]};
            n2[1].n_tokens = -1;
            LBL("[%s] skv_op_sparse_attention n_tokens = -1", bn);
            expect_err(skv_op_sparse_attention(be, HQ4, H, DD, 0.0f, q, 2, n2, out), SKV_ERR_INVALID_ARGUMENT, NULL,
                       "spans", NULL);
            n2[1].n_tokens = T;
            n2[1].token_stride = -DD;
            LBL("[%s] skv_op_sparse_attention negative stride", bn);
            expect_err(skv_op_sparse_attention(be, HQ4, H, DD, 0.0f, q, 2, n2, out), SKV_ERR_INVALID_ARGUMENT, NULL,
                       "spans", NULL);
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
        }
        const struct { int32_t hq, hk, d; float sc; const char *w; } bad[] = {
            {3, H, DD, 0.0f, "n_q_heads"}, {HQ4, 0, DD, 0.0f, "n_kv_heads"}, {HQ4, H, 0, 0.0f, "head_dim"},
            {HQ4, H, DD, NAN, "scale"},    {HQ4, H, DD, -2.0f, "scale"}};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            memset(out, SENT, sizeof out);
            LBL("[%s] skv_op_sparse_attention bad %s", bn, bad[i].w);
            expect_err(skv_op_sparse_attention(be, bad[i].hq, bad[i].hk, bad[i].d, bad[i].sc, q, 2, sp, out),
                       SKV_ERR_INVALID_ARGUMENT, NULL, bad[i].w, NULL);
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
            LBL("[%s] skv_op_full_attention bad %s", bn, bad[i].w);
            expect_err(skv_op_full_attention(be, bad[i].hq, bad[i].hk, bad[i].d, bad[i].sc, q, T, k, v, out),
                       SKV_ERR_INVALID_ARGUMENT, NULL, bad[i].w, NULL);
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
        }
        for (int kind = 0; kind < 4; kind++) {
            skv_bf16 *bq = planted(q, HQ4 * DD, (size_t)skvt_rng_range(&rng, 0, HQ4 * DD - 1), kind);
            skv_bf16 *bk = planted(k, H * T * DD, (size_t)skvt_rng_range(&rng, 0, H * T * DD - 1), kind);
            skv_bf16 *bv = planted(v, H * T * DD, (size_t)skvt_rng_range(&rng, 0, H * T * DD - 1), kind);
            skv_kv_span s2[2] = {{bk, v, T, T * DD, DD}, {k, bv, T, T * DD, DD}};
            memset(out, SENT, sizeof out);
            LBL("[%s] skv_op_sparse_attention %s in q", bn, bad_names[kind]);
            expect_err(skv_op_sparse_attention(be, HQ4, H, DD, 0.0f, bq, 1, sp, out), SKV_ERR_NONFINITE, NULL, "q",
                       NULL);
            LBL("[%s] skv_op_sparse_attention %s in spans[0].k", bn, bad_names[kind]);
            expect_err(skv_op_sparse_attention(be, HQ4, H, DD, 0.0f, q, 1, s2, out), SKV_ERR_NONFINITE, NULL,
                       "spans", NULL);
            LBL("[%s] skv_op_sparse_attention %s in spans[1].v", bn, bad_names[kind]);
            skv_kv_span s3[2] = {{k, v, T, T * DD, DD}, {k, bv, T, T * DD, DD}};
            expect_err(skv_op_sparse_attention(be, HQ4, H, DD, 0.0f, q, 2, s3, out), SKV_ERR_NONFINITE, NULL, "spans",
                       NULL);
            expect_substr("span NaN", "spans[1]");
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
            LBL("[%s] skv_op_full_attention %s in q", bn, bad_names[kind]);
            expect_err(skv_op_full_attention(be, HQ4, H, DD, 0.0f, bq, T, k, v, out), SKV_ERR_NONFINITE, NULL, "q",
                       NULL);
            LBL("[%s] skv_op_full_attention %s in k", bn, bad_names[kind]);
            expect_err(skv_op_full_attention(be, HQ4, H, DD, 0.0f, q, T, bk, v, out), SKV_ERR_NONFINITE, NULL, "k",
                       NULL);
            LBL("[%s] skv_op_full_attention %s in v", bn, bad_names[kind]);
            expect_err(skv_op_full_attention(be, HQ4, H, DD, 0.0f, q, T, k, bv, out), SKV_ERR_NONFINITE, NULL, "v",
                       NULL);
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
            free(bq);
            free(bk);
            free(bv);
        }
        static const char *const fnm[4] = {"q", "k", "v", "out"};
        for (int which = 0; which < 4; which++) {
            memset(out, SENT, sizeof out);
            LBL("[%s] skv_op_full_attention %s NULL", bn, fnm[which]);
            expect_err(skv_op_full_attention(be, HQ4, H, DD, 0.0f, which == 0 ? NULL : q, T, which == 1 ? NULL : k,
                                             which == 2 ? NULL : v, which == 3 ? NULL : out),
                       SKV_ERR_NULL_POINTER, NULL, fnm[which], NULL);
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
        }
        static const int64_t badn[] = {0, -1, INT64_MIN};
        for (size_t i = 0; i < sizeof badn / sizeof badn[0]; i++) {
            memset(out, SENT, sizeof out);
            LBL("[%s] skv_op_full_attention n_tokens = %lld", bn, (long long)badn[i]);
            expect_err(skv_op_full_attention(be, HQ4, H, DD, 0.0f, q, badn[i], k, v, out), SKV_ERR_INVALID_ARGUMENT,
                       NULL, "n_tokens", i64s(badn[i]));
            SKVT_CHECK(all_sent(out, sizeof out), "%s: output written", lbl);
        }
        LBL("[%s] skv_op_sparse_attention valid with an empty NULL span", bn);
        check_ok(skv_op_sparse_attention(be, HQ4, H, DD, 0.0f, q, 2, sp, out), lbl);
    }
}

/* ---- op-level input bound: what prefill and decode refuse ---------------------------- */

static int f32_all_finite(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

/*
 * skv_op_factorize, skv_op_sparse_attention and skv_op_full_attention refuse a finite value
 * beyond SKV_MAX_INPUT_MAGNITUDE on ref and cpu with SKV_ERR_NONFINITE, as skv_prefill and
 * skv_decode do: the message names the argument, the element and the limit, and no output is
 * written. Inputs at exactly +-2^32 are accepted and give finite outputs. Shapes, values and
 * positions are fresh from the run's seed.
 */
static void test_ops_magnitude(skv_backend be)
{
    const char *bn = skv_backend_name(be);
    {
        const int64_t n = skvt_rng_range(&rng, 8, 96);
        const int32_t d = (int32_t)skvt_rng_range(&rng, 2, 48), r = (int32_t)skvt_rng_range(&rng, 1, d < 8 ? d : 8);
        const size_t na = (size_t)n * d;
        skv_bf16 *a = rand_bf16(na, 1.0);
        float *u = malloc((size_t)n * r * sizeof *u), *w = malloc((size_t)r * d * sizeof *w);
        for (int kind = 0; kind < N_HUGE; kind++) {
            const size_t pos = pick_pos(kind % 3, na);
            skv_bf16 *b = dup_bf16(a, na);
            b[pos] = huge_vals[kind];
            memset(u, SENT, (size_t)n * r * sizeof *u);
            memset(w, SENT, (size_t)r * d * sizeof *w);
            LBL("[%s] skv_op_factorize n=%lld d=%d r=%d: %s at a[%zu]", bn, (long long)n, d, r, huge_names[kind], pos);
            expect_err(skv_op_factorize(be, n, d, r, b, u, w), SKV_ERR_NONFINITE, NULL, "a", "SKV_MAX_INPUT_MAGNITUDE");
            char where[48];
            snprintf(where, sizeof where, "a[%zu] = ", pos);
            expect_substr("factorize magnitude", where);
            SKVT_CHECK(all_sent(u, (size_t)n * r * sizeof *u) && all_sent(w, (size_t)r * d * sizeof *w),
                       "%s: outputs written", lbl);
            free(b);
        }
        skv_bf16 *lim = at_limit(na);
        LBL("[%s] skv_op_factorize n=%lld d=%d r=%d with elements at +-2^32", bn, (long long)n, d, r);
        skv_status st = skv_op_factorize(be, n, d, r, lim, u, w);
        SKVT_CHECK(st == SKV_OK || st == SKV_ERR_NUMERICAL, "%s: %s", lbl, skv_status_string(st));
        if (st == SKV_OK)
            SKVT_CHECK(f32_all_finite(u, (size_t)n * r) && f32_all_finite(w, (size_t)r * d), "%s: Inf/NaN in u or w",
                       lbl);
        free(lim);
        free(a);
        free(u);
        free(w);
    }
    {
        const int32_t hk = (int32_t)skvt_rng_range(&rng, 1, 3), hq = hk * (int32_t)skvt_rng_range(&rng, 1, 3);
        const int32_t d = (int32_t)skvt_rng_range(&rng, 1, 40);
        const int64_t t = skvt_rng_range(&rng, 1, 300);
        const size_t nq = (size_t)hq * d, nkv = (size_t)t * hk * d;
        skv_bf16 *q = rand_bf16(nq, 1.0), *k = rand_bf16(nkv, 1.0), *v = rand_bf16(nkv, 1.0);
        float *out = malloc(nq * sizeof *out);
        static const char *const tn[3] = {"q", "k", "v"};
        for (int kind = 0; kind < N_HUGE; kind++)
            for (int which = 0; which < 3; which++) {
                const size_t nx = which ? nkv : nq, pos = pick_pos(kind % 3, nx);
                skv_bf16 *b = dup_bf16(which == 0 ? q : which == 1 ? k : v, nx);
                b[pos] = huge_vals[kind];
                const skv_bf16 *a0 = which == 0 ? b : q, *a1 = which == 1 ? b : k, *a2 = which == 2 ? b : v;
                char where[48];
                snprintf(where, sizeof where, "%s[%zu] = ", tn[which], pos);
                memset(out, SENT, nq * sizeof *out);
                LBL("[%s] skv_op_full_attention Hq %d Hk %d D %d T %lld: %s at %s[%zu]", bn, hq, hk, d, (long long)t,
                    huge_names[kind], tn[which], pos);
                expect_err(skv_op_full_attention(be, hq, hk, d, 0.0f, a0, t, a1, a2, out), SKV_ERR_NONFINITE, NULL,
                           tn[which], "SKV_MAX_INPUT_MAGNITUDE");
                expect_substr("full attention magnitude", where);
                SKVT_CHECK(all_sent(out, nq * sizeof *out), "%s: output written", lbl);
                /* the same tokens as two head-major spans; the bad element in the second span's k or v */
                const int64_t t0 = t / 2;
                skv_bf16 *hm = malloc(nkv * sizeof *hm), *hv = malloc(nkv * sizeof *hv);
                for (int32_t h = 0; h < hk; h++)
                    for (int64_t j = 0; j < t; j++) {
                        memcpy(hm + ((size_t)h * t + j) * d, a1 + ((size_t)j * hk + h) * d, (size_t)d * sizeof *hm);
                        memcpy(hv + ((size_t)h * t + j) * d, a2 + ((size_t)j * hk + h) * d, (size_t)d * sizeof *hv);
                    }
                skv_kv_span sp[2] = {{hm, hv, t0, t * d, d}, {hm + t0 * d, hv + t0 * d, t - t0, t * d, d}};
                memset(out, SENT, nq * sizeof *out);
                LBL("[%s] skv_op_sparse_attention Hq %d Hk %d D %d T %lld: %s at %s[%zu]", bn, hq, hk, d,
                    (long long)t, huge_names[kind], tn[which], pos);
                expect_err(skv_op_sparse_attention(be, hq, hk, d, 0.0f, a0, 2, sp, out), SKV_ERR_NONFINITE, NULL,
                           which ? "spans" : "q", "SKV_MAX_INPUT_MAGNITUDE");
                if (which) {
                    const int64_t tok = (int64_t)(pos / ((size_t)hk * d)), head = (int64_t)(pos / d % hk);
                    snprintf(where, sizeof where, "spans[%d].%s: token %lld head %lld element %lld = ", tok >= t0,
                             tn[which], (long long)(tok >= t0 ? tok - t0 : tok), (long long)head,
                             (long long)(pos % d));
                    expect_substr("sparse attention magnitude", where);
                }
                SKVT_CHECK(all_sent(out, nq * sizeof *out), "%s: output written", lbl);
                free(hm);
                free(hv);
                free(b);
            }
        skv_bf16 *lq = at_limit(nq), *lk = at_limit(nkv), *lv = at_limit(nkv);
        LBL("[%s] skv_op_full_attention Hq %d Hk %d D %d T %lld with elements at +-2^32", bn, hq, hk, d, (long long)t);
        check_ok(skv_op_full_attention(be, hq, hk, d, 0.0f, lq, t, lk, lv, out), lbl);
        SKVT_CHECK(f32_all_finite(out, nq), "%s: Inf/NaN in out", lbl);
        skv_kv_span one = {lk, lv, t, d, (int64_t)hk * d};
        LBL("[%s] skv_op_sparse_attention Hq %d Hk %d D %d T %lld with elements at +-2^32", bn, hq, hk, d,
            (long long)t);
        check_ok(skv_op_sparse_attention(be, hq, hk, d, 0.0f, lq, 1, &one, out), lbl);
        SKVT_CHECK(f32_all_finite(out, nq), "%s: Inf/NaN in out", lbl);
        free(lq);
        free(lk);
        free(lv);
        free(q);
        free(k);
        free(v);
        free(out);
    }
}

int main(int argc, char **argv)
{
    (void)argc;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    uint64_t seed = skvt_base_seed("test_bad_input");
    skvt_rng_seed(&rng, seed);
    /* the backend cases set SKV_BACKEND themselves; everything else uses config.backend */
    const char *env = getenv("SKV_BACKEND");
    if (env && *env) printf("note: SKV_BACKEND=%s is ignored; both ref and cpu are tested\n", env);
    unsetenv("SKV_BACKEND");

    test_status_strings();
    test_thread_limit(); /* forks: before this process has started OpenMP threads */
    test_backends();
    test_bench_cli(argv[0]);
    static const skv_backend bes[2] = {SKV_BACKEND_REF, SKV_BACKEND_CPU};
    for (int i = 0; i < 2; i++) {
        test_config(bes[i]);
        test_ops(bes[i]);
        test_ops_magnitude(bes[i]);
        for (int round = 0; round < 2; round++) test_cache_states(bes[i]);
        test_limits(bes[i]);
    }
    free(snA.p);
    free(snB.p);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("test_bad_input: %.2f s\n", (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    return skvt_finish();
}
