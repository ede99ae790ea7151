/*
 * test_tp_shard: head-shard caches (config.model_kv_heads, kv_head_begin; docs/tensor-parallel.md),
 * the unit of tensor parallelism: each GPU of a group of s holds KV heads [i Hk/s, (i+1) Hk/s) of
 * the model and their query heads, fed the head slices of the model's tensors.
 *
 *  - one process against s processes: the s shard caches of one process (one device) give
 *    bitwise the outputs and selections that the same shards give in s processes, each with
 *    its own cache (cuda: each process on its own GPU where the machine has several, through
 *    CUDA_VISIBLE_DEVICES, as launchers do; else all on GPU 0). The processes are this binary
 *    run again with --child, so each one starts its backend fresh;
 *  - shards select what the unsharded cache selects: the landmarks and the scores are per KV
 *    head, so shard i's head h makes, at every step, layer and sequence, the selection of the
 *    model's head i Hk/s + h (fixed and mass rules, bf16 and fp8 values);
 *  - the reproducible mode: shard outputs bitwise equal across ref, cpu and cuda;
 *  - the shard range is carried: skv_cache_config reads it back; cuda_device names a device
 *    (0 works; a device the machine lacks is SKV_ERR_NO_DEVICE naming cuda_device).
 *
 * Splits of 2 and 4 shards of a model with Hq 8, Hk 4; each shard at the model's rank capped
 * at its width (the default of docs/tensor-parallel.md).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

enum { L = 2, B = 2, STEPS = 4, HQ = 8, HK = 4, D = 32, C = 4, RANK = 48, NMAX = 320, S = 6 /* budget / C */ };

/* The cases: 0 fixed rule, bf16; 1 mass rule, fp8 values; 2 the reproducible mode. */
enum { N_CASES = 3 };
static const char *case_name[N_CASES] = {"fixed, bf16", "mass, fp8", "reproducible"};

/* The model's inputs, all drawn from the seed (a child draws the same). */
typedef struct model {
    int64_t n[B];
    skv_bf16 *k[L][B], *v[L][B];          /* [n, Hk, D] pre-RoPE keys, values */
    skv_bf16 *q[STEPS][L], *sk[STEPS][L], *sv[STEPS][L]; /* [B, Hq, D], [B, Hk, D] */
} model;

static void model_init(model *m, uint64_t seed)
{
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    const int64_t lo = (int64_t)(3 + 6 + 2 + 2) * C;
    for (int b = 0; b < B; b++) m->n[b] = skvt_rng_range(&r, lo, NMAX);
    for (int l = 0; l < L; l++)
        for (int b = 0; b < B; b++) {
            m->k[l][b] = skvt_xmalloc((size_t)m->n[b] * HK * D * 2);
            m->v[l][b] = skvt_xmalloc((size_t)m->n[b] * HK * D * 2);
            skvt_lowrank_prompt(&r, (size_t)HK * D, m->n[b], m->k[l][b], m->v[l][b]);
        }
    for (int t = 0; t < STEPS; t++)
        for (int l = 0; l < L; l++) {
            m->q[t][l] = skvt_xmalloc((size_t)B * HQ * D * 2);
            m->sk[t][l] = skvt_xmalloc((size_t)B * HK * D * 2);
            m->sv[t][l] = skvt_xmalloc((size_t)B * HK * D * 2);
            skvt_fill_bf16_normal(&r, m->q[t][l], (size_t)B * HQ * D, 1.0);
            skvt_fill_bf16_normal(&r, m->sk[t][l], (size_t)B * HK * D, 1.0);
            skvt_fill_bf16_normal(&r, m->sv[t][l], (size_t)B * HK * D, 1.0);
        }
}

static void model_free(model *m)
{
    for (int l = 0; l < L; l++)
        for (int b = 0; b < B; b++) free(m->k[l][b]), free(m->v[l][b]);
    for (int t = 0; t < STEPS; t++)
        for (int l = 0; l < L; l++) free(m->q[t][l]), free(m->sk[t][l]), free(m->sv[t][l]);
}

/* Rows of `rows` tokens of `heads` heads: heads [h0, h0 + hs) of each row into dst [rows, hs, D]. */
static void slice(skv_bf16 *dst, const skv_bf16 *src, int64_t rows, int heads, int h0, int hs)
{
    for (int64_t t = 0; t < rows; t++)
        memcpy(dst + (size_t)t * hs * D, src + ((size_t)t * heads + h0) * D, (size_t)hs * D * 2);
}

/* The config of shard i of s (s = 1: the whole model, no shard fields). */
static skv_config shard_config(skv_backend be, int kase, int s, int i)
{
    skv_config g = skv_config_default();
    g.backend = be;
    g.n_layers = L;
    g.batch_size = B;
    g.n_q_heads = HQ / s, g.n_kv_heads = HK / s, g.head_dim = D;
    g.rank = RANK < (HK / s) * D ? RANK : (HK / s) * D; /* the model's rank capped at the shard's width */
    g.chunk_size = C;
    g.budget = 6 * C;
    g.n_outlier_chunks = 3;
    g.n_local_chunks = 2;
    g.max_prompt_len = NMAX;
    g.gen_capacity = STEPS;
    if (s > 1) g.model_kv_heads = HK, g.kv_head_begin = i * (HK / s);
    if (kase == 1) g.select_mode = SKV_SELECT_MASS, g.select_mass = 0.7f, g.value_dtype = SKV_VALUE_FP8;
    if (kase == 2) g.reproducible = 1;
    return g;
}

/* What one shard gives: per step, layer, sequence, its outputs [Hq/s, D], and per KV head the
   selected count and ids [S]. */
typedef struct result {
    float *out;   /* [STEPS][L][B][Hq/s D] */
    int32_t *sel; /* [STEPS][L][B][Hk/s][1 + S]: count, then ids (-1 past it) */
    size_t n_out, n_sel;
} result;


static void result_alloc(result *r, int s)
{
    r->n_out = (size_t)STEPS * L * B * (HQ / s) * D;
    r->n_sel = (size_t)STEPS * L * B * (HK / s) * (1 + S);
    r->out = calloc(r->n_out, sizeof *r->out);
    r->sel = calloc(r->n_sel, sizeof *r->sel);
    if (!r->out || !r->sel) abort();
}

static void result_free(result *r) { free(r->out), free(r->sel); }

/* Runs shard i of s of the model on backend be: prefill every (layer, sequence), then STEPS
   decode steps of every layer. Returns 0 on success (a failure is a failed check). */
static int run_shard(const model *m, skv_backend be, int kase, int s, int i, result *res)
{
    const int hk = HK / s, hq = HQ / s;
    skv_config g = shard_config(be, kase, s, i);
    skv_cache *c = NULL;
    char what[128];
    snprintf(what, sizeof what, "create (%s, %s, shard %d of %d)", skv_backend_name(be), case_name[kase], i, s);
    if (!SKVT_CHECK_STATUS(skv_cache_create(&g, &c), SKV_OK, what)) {
        printf("  %s\n", skv_last_error());
        return 1;
    }
    const skv_config *kc = skv_cache_config(c);
    SKVT_CHECK(kc->model_kv_heads == g.model_kv_heads && kc->kv_head_begin == g.kv_head_begin,
               "%s: the shard range reads back as %d, %d", what, kc->model_kv_heads, kc->kv_head_begin);
    int fail = 0;
    skv_bf16 *hk_ = skvt_xmalloc((size_t)NMAX * hk * D * 2), *hv = skvt_xmalloc((size_t)NMAX * hk * D * 2);
    void *dk = skvt_dbuf(be, hk_, (size_t)NMAX * hk * D * 2), *dv = skvt_dbuf(be, hv, (size_t)NMAX * hk * D * 2);
    for (int l = 0; l < L && !fail; l++)
        for (int b = 0; b < B && !fail; b++) {
            slice(hk_, m->k[l][b], m->n[b], HK, i * hk, hk);
            slice(hv, m->v[l][b], m->n[b], HK, i * hk, hk);
            skvt_dput(be, dk, hk_, (size_t)m->n[b] * hk * D * 2);
            skvt_dput(be, dv, hv, (size_t)m->n[b] * hk * D * 2);
            skv_status st = skv_prefill(c, l, b, m->n[b], dk, dv, NULL);
            if (!SKVT_CHECK_STATUS(st, SKV_OK, "prefill")) printf("  %s\n", skv_last_error()), fail = 1;
        }
    const size_t qb = (size_t)B * hq * D, kb = (size_t)B * hk * D;
    skv_bf16 *q = skvt_xmalloc(qb * 2), *k = skvt_xmalloc(kb * 2), *v = skvt_xmalloc(kb * 2);
    void *dq = skvt_dbuf(be, q, qb * 2), *dsk = skvt_dbuf(be, k, kb * 2), *dsv = skvt_dbuf(be, v, kb * 2);
    float *out = skvt_xmalloc(qb * 4);
    void *dout = skvt_dbuf(be, out, qb * 4);
    for (int t = 0; t < STEPS && !fail; t++)
        for (int l = 0; l < L && !fail; l++) {
            slice(q, m->q[t][l], B, HQ, i * hq, hq);
            slice(k, m->sk[t][l], B, HK, i * hk, hk);
            slice(v, m->sv[t][l], B, HK, i * hk, hk);
            skvt_dput(be, dq, q, qb * 2), skvt_dput(be, dsk, k, kb * 2), skvt_dput(be, dsv, v, kb * 2);
            skv_status st = skv_decode(c, l, dq, dsk, dsv, dout);
            if (!st) st = skv_cache_sync(c);
            if (!SKVT_CHECK_STATUS(st, SKV_OK, "decode")) {
                printf("  %s\n", skv_last_error());
                fail = 1;
                break;
            }
            skvt_dget(be, out, dout, qb * 4);
            memcpy(res->out + ((size_t)t * L + l) * qb, out, qb * 4);
            for (int b = 0; b < B; b++)
                for (int h = 0; h < hk; h++) {
                    int32_t *row = res->sel + ((((size_t)t * L + l) * B + b) * hk + h) * (1 + S);
                    for (int j = 0; j <= S; j++) row[j] = -1;
                    if (skv_cache_selected_count(c, l, b, h, row) || skv_cache_selected(c, l, b, h, row + 1)) {
                        SKVT_CHECK(0, "selected (layer %d, seq %d, head %d): %s", l, b, h, skv_last_error());
                        fail = 1;
                    }
                }
        }
    skvt_dfree(be, dk, hk_), skvt_dfree(be, dv, hv), skvt_dfree(be, dq, q), skvt_dfree(be, dsk, k);
    skvt_dfree(be, dsv, v), skvt_dfree(be, dout, out);
    free(hk_), free(hv), free(q), free(k), free(v), free(out);
    skv_cache_free(c);
    return fail;
}

/* ---- the child: one shard in its own process, its result into a file ---------------------- */

static int child_main(char **argv)
{
    const skv_backend be = (skv_backend)atoi(argv[2]);
    const int kase = atoi(argv[3]), s = atoi(argv[4]), i = atoi(argv[5]);
    const uint64_t seed = strtoull(argv[6], NULL, 10);
    model m;
    model_init(&m, seed);
    result r;
    result_alloc(&r, s);
    int fail = run_shard(&m, be, kase, s, i, &r);
    FILE *f = fopen(argv[7], "wb");
    if (!f || fwrite(r.out, sizeof *r.out, r.n_out, f) != r.n_out || fwrite(r.sel, sizeof *r.sel, r.n_sel, f) != r.n_sel)
        fail = 1;
    if (f && fclose(f)) fail = 1;
    result_free(&r);
    model_free(&m);
    return fail || skvt_counts_g.failed ? 1 : 0;
}

/* Runs the s shards as s child processes at once; their results into res[0..s). Returns 0 on
   success. n_dev > 1: child i sees only GPU i mod n_dev. */
static int run_children(const char *self, skv_backend be, int kase, int s, uint64_t seed, int n_dev, result *res)
{
    char dir[] = "/tmp/skv_tp_XXXXXX";
    if (!mkdtemp(dir)) return SKVT_CHECK(0, "mkdtemp: %s", strerror(errno)), 1;
    pid_t pid[4];
    char path[4][64];
    for (int i = 0; i < s; i++) {
        snprintf(path[i], sizeof path[i], "%s/shard%d", dir, i);
        fflush(stdout);
        pid[i] = fork();
        if (pid[i] == 0) {
            char a_be[16], a_case[16], a_s[16], a_i[16], a_seed[32], vis[16];
            snprintf(a_be, sizeof a_be, "%d", (int)be), snprintf(a_case, sizeof a_case, "%d", kase);
            snprintf(a_s, sizeof a_s, "%d", s), snprintf(a_i, sizeof a_i, "%d", i);
            snprintf(a_seed, sizeof a_seed, "%llu", (unsigned long long)seed);
            if (n_dev > 1) snprintf(vis, sizeof vis, "%d", i % n_dev), setenv("CUDA_VISIBLE_DEVICES", vis, 1);
            if (!freopen("/dev/null", "w", stdout)) _exit(3); /* the child's counts are not the test's */
            execl(self, self, "--child", a_be, a_case, a_s, a_i, a_seed, path[i], (char *)NULL);
            _exit(4);
        }
    }
    int fail = 0;
    for (int i = 0; i < s; i++) {
        int wst = 0;
        if (pid[i] < 0 || waitpid(pid[i], &wst, 0) != pid[i] || !WIFEXITED(wst) || WEXITSTATUS(wst) != 0) {
            SKVT_CHECK(0, "%s, %s: shard %d of %d in its own process failed (wait status 0x%x)",
                       skv_backend_name(be), case_name[kase], i, s, wst);
            fail = 1;
            continue;
        }
        FILE *f = fopen(path[i], "rb");
        if (!f || fread(res[i].out, sizeof *res[i].out, res[i].n_out, f) != res[i].n_out ||
            fread(res[i].sel, sizeof *res[i].sel, res[i].n_sel, f) != res[i].n_sel)
        {
            SKVT_CHECK(0, "reading %s", path[i]);
            fail = 1;
        }
        if (f) fclose(f);
        remove(path[i]);
    }
    rmdir(dir);
    return fail;
}

/* ---- the checks ---------------------------------------------------------------------------- */

static int same_result(const result *a, const result *b)
{
    return memcmp(a->out, b->out, a->n_out * sizeof *a->out) == 0 &&
           memcmp(a->sel, b->sel, a->n_sel * sizeof *a->sel) == 0;
}

/* Shard i's selections against the whole model's for the same KV heads. */
static void check_selection(const result *shard, const result *whole, int s, int i, const char *lbl)
{
    const int hk = HK / s;
    long bad = 0;
    for (int t = 0; t < STEPS; t++)
        for (int l = 0; l < L; l++)
            for (int b = 0; b < B; b++)
                for (int h = 0; h < hk; h++) {
                    const int32_t *a = shard->sel + ((((size_t)t * L + l) * B + b) * hk + h) * (1 + S);
                    const int32_t *w = whole->sel + ((((size_t)t * L + l) * B + b) * HK + i * hk + h) * (1 + S);
                    bad += memcmp(a, w, (1 + S) * sizeof *a) != 0;
                }
    SKVT_CHECK(bad == 0, "%s: shard %d of %d: %ld (step, layer, seq, head) selections differ from the whole "
               "model's", lbl, i, s, bad);
}

static int n_cuda_devices(void)
{
    if (skv_backend_available(SKV_BACKEND_CUDA) != SKV_OK) return 0;
    int n = 1;
    for (; n < 8; n++) {
        skv_config g = shard_config(SKV_BACKEND_CUDA, 0, 1, 0);
        g.cuda_device = n;
        skv_cache *c = NULL;
        skv_status st = skv_cache_create(&g, &c);
        skv_cache_free(c);
        if (st) break;
    }
    return n;
}

int main(int argc, char **argv)
{
    if (argc == 8 && strcmp(argv[1], "--child") == 0) return child_main(argv);
    const uint64_t seed = skvt_base_seed("test_tp_shard");
    const char *self = "/proc/self/exe";
    char exe[4096];
    ssize_t len = readlink(self, exe, sizeof exe - 1);
    if (len > 0) exe[len] = 0, self = exe;
    const skv_backend bes[] = {SKV_BACKEND_REF, SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
    const int n_dev = n_cuda_devices();
    printf("cuda devices: %d\n", n_dev);
    if (n_dev > 0) { /* the cache's device: 0 names one; one past the last is refused, naming the field */
        skv_config g = shard_config(SKV_BACKEND_CUDA, 0, 2, 1);
        g.cuda_device = 0;
        skv_cache *c = NULL;
        SKVT_CHECK_STATUS(skv_cache_create(&g, &c), SKV_OK, "create on cuda_device 0");
        SKVT_CHECK(!c || skv_cache_config(c)->cuda_device == 0, "cuda_device reads back as %d",
                   c ? skv_cache_config(c)->cuda_device : -2);
        skv_cache_free(c);
        c = NULL;
        g.cuda_device = n_dev;
        SKVT_CHECK_STATUS(skv_cache_create(&g, &c), SKV_ERR_NO_DEVICE, "create on a device past the last");
        SKVT_CHECK(!c && strstr(skv_last_error(), "cuda_device"), "message names cuda_device: %s", skv_last_error());
        skv_config d = shard_config(SKV_BACKEND_CUDA, 0, 1, 0);
        if (SKVT_CHECK_STATUS(skv_cache_create(&d, &c), SKV_OK, "create on the current device")) {
            SKVT_CHECK(skv_cache_config(c)->cuda_device == 0, "cuda_device -1 resolves to the current device 0, "
                       "reads back %d", skv_cache_config(c)->cuda_device);
            skv_cache_free(c);
        }
    } else {
        skvt_skip("cuda: no device (the cuda_device checks)");
    }
    result repro[3][6]; /* the reproducible case's shards of s = 2 (index 0, 1) and 4 (2 .. 5) per backend */
    int have_repro[3] = {0, 0, 0};
    for (int bi = 0; bi < 3; bi++) {
        const skv_backend be = bes[bi];
        if (skv_backend_available(be) != SKV_OK) {
            char why[64];
            snprintf(why, sizeof why, "%s: backend not available", skv_backend_name(be));
            skvt_skip(why);
            continue;
        }
        for (int kase = 0; kase < N_CASES; kase++) {
            const uint64_t cs = seed + 100 * (uint64_t)kase;
            model m;
            model_init(&m, cs);
            result whole;
            result_alloc(&whole, 1);
            const int wfail = run_shard(&m, be, kase, 1, 0, &whole);
            for (int s = 2; s <= 4; s += 2) {
                result mine[4], theirs[4];
                int fail = 0;
                for (int i = 0; i < s; i++) result_alloc(&mine[i], s), result_alloc(&theirs[i], s);
                const double t0 = skvt_now_s();
                fail |= run_children(self, be, kase, s, cs, be == SKV_BACKEND_CUDA ? n_dev : 1, theirs);
                const double t1 = skvt_now_s();
                for (int i = 0; i < s; i++) fail |= run_shard(&m, be, kase, s, i, &mine[i]);
                char lbl[96];
                snprintf(lbl, sizeof lbl, "%s, %s, %d shards", skv_backend_name(be), case_name[kase], s);
                for (int i = 0; i < s && !fail; i++) {
                    SKVT_CHECK(same_result(&mine[i], &theirs[i]),
                               "%s: shard %d in one process differs from its own process", lbl, i);
                    if (!wfail) check_selection(&mine[i], &whole, s, i, lbl);
                }
                printf("  %s: one process and %d processes%s agree: %s (children %.2f s)\n", lbl, s,
                       be == SKV_BACKEND_CUDA && n_dev > 1 ? " (one GPU each)" : "", fail ? "not run" : "checked",
                       t1 - t0);
                for (int i = 0; i < s; i++) {
                    if (kase == 2 && !fail) repro[bi][(s == 2 ? 0 : 2) + i] = mine[i];
                    else result_free(&mine[i]);
                    result_free(&theirs[i]);
                }
                if (kase == 2 && !fail) have_repro[bi] |= s;
            }
            result_free(&whole);
            model_free(&m);
        }
    }
    /* the reproducible mode: every backend's shards bitwise equal to ref's */
    for (int bi = 1; bi < 3; bi++) {
        if (have_repro[0] != 6 || have_repro[bi] != 6) continue;
        int same = 1;
        for (int j = 0; j < 6; j++) same &= same_result(&repro[0][j], &repro[bi][j]);
        SKVT_CHECK(same, "reproducible mode: %s shard outputs or selections differ from ref's", skv_backend_name(bes[bi]));
        printf("  reproducible mode: %s shards bitwise equal to ref's: %s\n", skv_backend_name(bes[bi]),
               same ? "yes" : "no");
    }
    for (int bi = 0; bi < 3; bi++)
        if (have_repro[bi] == 6)
            for (int j = 0; j < 6; j++) result_free(&repro[bi][j]);
    return skvt_finish();
}
