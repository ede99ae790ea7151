/*
 * test_alloc_fail.c - allocation-failure injection along create, prefill and
 * decode, on the ref and cpu backends.
 *
 * The binary is linked with -Wl,--wrap=malloc,calloc,realloc,free,posix_memalign
 * (Makefile), so every heap call the library's own code makes goes through the
 * wrappers below; allocations inside OpenBLAS, LAPACKE and libgomp are theirs
 * and are not counted. A clean run of the scenario counts the library's
 * allocations; then for every k the k-th one fails. Each time:
 *  - the failing call returns SKV_ERR_OUT_OF_MEMORY (create also sets *out NULL);
 *  - nothing leaks: the live-allocation count returns to its starting value once
 *    the cache is freed (and right away when create fails);
 *  - the cache is unchanged and usable: the failed call is repeated with
 *    failures off and must succeed, and the whole scenario must then end with
 *    outputs, selections and introspection bitwise equal to the clean run's.
 * With cuda, device allocations would be injected the same way through the
 * backend's mem_alloc; that needs a GPU and is not done here.
 */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

/* ---- the wrappers ------------------------------------------------------------------------ */

void *__real_malloc(size_t n);
void *__real_calloc(size_t m, size_t n);
void *__real_realloc(void *p, size_t n);
void __real_free(void *p);
int __real_posix_memalign(void **p, size_t align, size_t n);

static long g_calls;    /* allocation calls since arming */
static long g_fail_at;  /* the call number that fails (1-based); 0: none */
static long g_live;     /* live allocations made through the wrappers */
static int g_armed;

/* 1 if this allocation call must fail. Allocations may come from OpenMP worker threads
   in the cpu backend, so the counters are atomic. */
static int fail_now(void)
{
    if (!__atomic_load_n(&g_armed, __ATOMIC_SEQ_CST)) return 0;
    long c = __atomic_add_fetch(&g_calls, 1, __ATOMIC_SEQ_CST);
    return c == __atomic_load_n(&g_fail_at, __ATOMIC_SEQ_CST);
}

static void *counted(void *p)
{
    if (p) __atomic_add_fetch(&g_live, 1, __ATOMIC_SEQ_CST);
    return p;
}

void *__wrap_malloc(size_t n) { return fail_now() ? NULL : counted(__real_malloc(n)); }
void *__wrap_calloc(size_t m, size_t n) { return fail_now() ? NULL : counted(__real_calloc(m, n)); }
void *__wrap_realloc(void *p, size_t n)
{
    if (fail_now()) return NULL;
    void *q = __real_realloc(p, n);
    if (!p && q) __atomic_add_fetch(&g_live, 1, __ATOMIC_SEQ_CST);
    return q;
}
int __wrap_posix_memalign(void **p, size_t align, size_t n)
{
    if (fail_now()) return 12; /* ENOMEM */
    int r = __real_posix_memalign(p, align, n);
    if (r == 0) __atomic_add_fetch(&g_live, 1, __ATOMIC_SEQ_CST);
    return r;
}
void __wrap_free(void *p)
{
    if (p) __atomic_sub_fetch(&g_live, 1, __ATOMIC_SEQ_CST);
    __real_free(p);
}

static void arm(long fail_at)
{
    __atomic_store_n(&g_calls, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_fail_at, fail_at, __ATOMIC_SEQ_CST);
    __atomic_store_n(&g_armed, 1, __ATOMIC_SEQ_CST);
}
static void disarm(void) { __atomic_store_n(&g_armed, 0, __ATOMIC_SEQ_CST); }

/* ---- the scenario ------------------------------------------------------------------------- */

enum { L = 2, B = 2, STEPS = 2 };

typedef struct {
    skv_config cfg;
    int64_t n[B];
    skv_bf16 *k[L][B], *v[L][B];
    skv_bf16 *q[STEPS][L], *kn[STEPS][L], *vn[STEPS][L];
} world;

/* Everything the scenario observed: outputs of every step and the decisions. */
typedef struct {
    float *out;    /* [STEPS][L][B*Hq*D] */
    int32_t *ids;  /* selections, outliers, candidates of every (l, b, h), concatenated */
    size_t n_ids;
    long allocs;   /* allocation calls made by the library (clean run) */
    int oom_calls; /* calls that returned SKV_ERR_OUT_OF_MEMORY and were repeated */
} record;

static void record_ids(const world *w, skv_cache *c, record *r)
{
    int32_t buf[4096];
    for (int l = 0; l < L; l++)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < w->cfg.n_kv_heads; h++) {
                skv_seq_info info;
                if (skv_cache_seq_info(c, l, b, &info) != SKV_OK) continue;
                int m[3] = {info.n_selected, info.n_outliers, info.n_candidates};
                skv_status st[3] = {skv_cache_selected(c, l, b, h, buf), SKV_OK, SKV_OK};
                for (int i = 0; i < 3; i++) {
                    if (i == 1) st[1] = skv_cache_outliers(c, l, b, h, buf);
                    if (i == 2) st[2] = skv_cache_candidates(c, l, b, h, buf);
                    if (st[i] != SKV_OK) continue;
                    memcpy(r->ids + r->n_ids, buf, (size_t)m[i] * sizeof *buf);
                    r->n_ids += (size_t)m[i];
                }
            }
}

/*
 * Runs create, prefill of every (layer, seq), STEPS decode steps of every layer, and
 * frees. A call that fails with SKV_ERR_OUT_OF_MEMORY is checked and repeated with the
 * failure switched off. Returns 0 if the scenario could not complete.
 */
static int run(const world *w, skv_backend be, long fail_at, record *r, const char *lbl)
{
    const size_t qn = (size_t)B * w->cfg.n_q_heads * w->cfg.head_dim;
    skv_config cfg = w->cfg;
    cfg.backend = be;
    long live0 = __atomic_load_n(&g_live, __ATOMIC_SEQ_CST);
    r->n_ids = 0;
    r->oom_calls = 0;
    arm(fail_at);
    skv_cache *c = (skv_cache *)&cfg;
    skv_status st = skv_cache_create(&cfg, &c);
    if (st != SKV_OK) {
        disarm();
        SKVT_CHECK_STATUS(st, SKV_ERR_OUT_OF_MEMORY, lbl);
        SKVT_CHECK(c == NULL, "%s: create failed but *out is not NULL", lbl);
        SKVT_CHECK(__atomic_load_n(&g_live, __ATOMIC_SEQ_CST) == live0, "%s: failed create leaked %ld allocations",
                   lbl, __atomic_load_n(&g_live, __ATOMIC_SEQ_CST) - live0);
        r->oom_calls++;
        arm(0);
        st = skv_cache_create(&cfg, &c);
        if (!SKVT_CHECK_STATUS(st, SKV_OK, "create after the failure")) return 0;
    }
    for (int l = 0; l < L; l++)
        for (int b = 0; b < B; b++) {
            st = skv_prefill(c, l, b, w->n[b], w->k[l][b], w->v[l][b], NULL);
            if (st != SKV_OK) {
                int was = __atomic_load_n(&g_armed, __ATOMIC_SEQ_CST);
                disarm();
                SKVT_CHECK_STATUS(st, SKV_ERR_OUT_OF_MEMORY, lbl);
                skv_seq_info info;
                skv_cache_seq_info(c, l, b, &info);
                SKVT_CHECK(!info.prefilled, "%s: a failed prefill left (%d, %d) prefilled", lbl, l, b);
                r->oom_calls++;
                if (was) arm(0);
                st = skv_prefill(c, l, b, w->n[b], w->k[l][b], w->v[l][b], NULL);
                if (!SKVT_CHECK_STATUS(st, SKV_OK, "prefill repeated after the failure")) {
                    disarm();
                    skv_cache_free(c);
                    return 0;
                }
            }
        }
    for (int s = 0; s < STEPS; s++)
        for (int l = 0; l < L; l++) {
            float *out = r->out + ((size_t)s * L + l) * qn;
            st = skv_decode(c, l, w->q[s][l], w->kn[s][l], w->vn[s][l], out);
            if (st != SKV_OK) {
                disarm();
                SKVT_CHECK_STATUS(st, SKV_ERR_OUT_OF_MEMORY, lbl);
                r->oom_calls++;
                arm(0);
                st = skv_decode(c, l, w->q[s][l], w->kn[s][l], w->vn[s][l], out);
                if (!SKVT_CHECK_STATUS(st, SKV_OK, "decode repeated after the failure")) {
                    disarm();
                    skv_cache_free(c);
                    return 0;
                }
            }
        }
    r->allocs = __atomic_load_n(&g_calls, __ATOMIC_SEQ_CST);
    disarm();
    record_ids(w, c, r);
    skv_cache_free(c);
    SKVT_CHECK(__atomic_load_n(&g_live, __ATOMIC_SEQ_CST) == live0, "%s: %ld allocations leaked", lbl,
               __atomic_load_n(&g_live, __ATOMIC_SEQ_CST) - live0);
    return 1;
}

static void make_world(world *w, skvt_rng *rng)
{
    memset(w, 0, sizeof *w);
    skv_config c = skv_config_default();
    c.n_layers = L;
    c.batch_size = B;
    c.n_q_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 32;
    c.rank = 12;
    c.chunk_size = 4;
    c.budget = 16;
    c.n_outlier_chunks = 2;
    c.n_local_chunks = 1;
    c.max_prompt_len = 160;
    c.gen_capacity = STEPS;
    w->cfg = c;
    w->n[0] = 120;
    w->n[1] = 157;
    size_t row = (size_t)c.n_kv_heads * c.head_dim;
    for (int l = 0; l < L; l++)
        for (int b = 0; b < B; b++) {
            w->k[l][b] = malloc((size_t)w->n[b] * row * 2);
            w->v[l][b] = malloc((size_t)w->n[b] * row * 2);
            skvt_fill_bf16_normal(rng, w->k[l][b], (size_t)w->n[b] * row, 1.0);
            skvt_fill_bf16_normal(rng, w->v[l][b], (size_t)w->n[b] * row, 1.0);
        }
    for (int s = 0; s < STEPS; s++)
        for (int l = 0; l < L; l++) {
            w->q[s][l] = malloc((size_t)B * c.n_q_heads * c.head_dim * 2);
            w->kn[s][l] = malloc((size_t)B * row * 2);
            w->vn[s][l] = malloc((size_t)B * row * 2);
            skvt_fill_bf16_normal(rng, w->q[s][l], (size_t)B * c.n_q_heads * c.head_dim, 1.0);
            skvt_fill_bf16_normal(rng, w->kn[s][l], (size_t)B * row, 1.0);
            skvt_fill_bf16_normal(rng, w->vn[s][l], (size_t)B * row, 1.0);
        }
}

static void free_world(world *w)
{
    for (int l = 0; l < L; l++)
        for (int b = 0; b < B; b++) free(w->k[l][b]), free(w->v[l][b]);
    for (int s = 0; s < STEPS; s++)
        for (int l = 0; l < L; l++) free(w->q[s][l]), free(w->kn[s][l]), free(w->vn[s][l]);
}

int main(void)
{
    uint64_t seed = skvt_base_seed("test_alloc_fail");
    skvt_rng rng;
    skvt_rng_seed(&rng, seed);
    world w;
    make_world(&w, &rng);
    const size_t qn = (size_t)B * w.cfg.n_q_heads * w.cfg.head_dim;
    const skv_backend bes[2] = {SKV_BACKEND_REF, SKV_BACKEND_CPU};
    for (int bi = 0; bi < 2; bi++) {
        skv_backend be = bes[bi];
        record clean = {0}, r = {0};
        clean.out = malloc(sizeof(float) * qn * L * STEPS);
        clean.ids = malloc(sizeof(int32_t) * 65536);
        r.out = malloc(sizeof(float) * qn * L * STEPS);
        r.ids = malloc(sizeof(int32_t) * 65536);
        char lbl[96];
        snprintf(lbl, sizeof lbl, "%s clean run", skv_backend_name(be));
        if (!run(&w, be, 0, &clean, lbl)) continue;
        SKVT_CHECK(clean.oom_calls == 0 && clean.allocs > 0, "%s: the clean run made %ld allocation calls",
                   skv_backend_name(be), clean.allocs);
        long injected = 0, oom = 0;
        for (long k = 1; k <= clean.allocs; k++) {
            snprintf(lbl, sizeof lbl, "%s: allocation %ld of %ld fails", skv_backend_name(be), k, clean.allocs);
            memset(r.out, 0xff, sizeof(float) * qn * L * STEPS);
            if (!run(&w, be, k, &r, lbl)) continue;
            injected += r.oom_calls == 1;
            oom += r.oom_calls;
            SKVT_CHECK(r.oom_calls == 1, "%s: %d calls reported SKV_ERR_OUT_OF_MEMORY, want exactly 1", lbl,
                       r.oom_calls);
            SKVT_CHECK(memcmp(r.out, clean.out, sizeof(float) * qn * L * STEPS) == 0,
                       "%s: outputs differ from the clean run (bitwise)", lbl);
            SKVT_CHECK(r.n_ids == clean.n_ids && memcmp(r.ids, clean.ids, r.n_ids * sizeof *r.ids) == 0,
                       "%s: decisions differ from the clean run", lbl);
        }
        printf("%s: %ld allocation calls in create + %d prefills + %d decodes; each failed once in turn: %ld "
               "OUT_OF_MEMORY returns, no leak, results identical after the repeated call\n",
               skv_backend_name(be), clean.allocs, L * B, L * STEPS, oom);
        SKVT_CHECK(injected == clean.allocs, "%s: only %ld of %ld injections took effect", skv_backend_name(be),
                   injected, clean.allocs);
        free(clean.out), free(clean.ids), free(r.out), free(r.ids);
    }
    free_world(&w);
    return skvt_finish();
}
