/*
 * test_placement.c - value placement (config.value_device_bytes) on every
 * available backend.
 *
 *  - The memory split: skv_cache_memory_info places slots in (layer, sequence)
 *    order within the budget; host bytes are the host slots' stores; a budget
 *    below the chunk caches, a negative budget other than -1 and chunk-cache
 *    sizes outside [S, N_max - O] are SKV_ERR_INVALID_CONFIG naming the field.
 *  - Equivalence: caches with every slot on the device, every slot on the host
 *    and a mixed split, fed the same prompts and decode steps, make the same
 *    decisions (bitwise) and give the same outputs: bitwise on ref and cpu
 *    (placement is bookkeeping there) and on cuda for device slots; within
 *    1e-6 relative per head on cuda where a host slot missed chunks (the
 *    missed chunks' P.V is added after their transfer).
 *  - The chunk cache's hit and miss counts equal an independent simulation of
 *    its rule (least recently used entry, ties to the lower entry) on every
 *    backend; drifting queries make them hit.
 *  - skv_seq_info.values_on_device tells the placement.
 *  - All of it again with SKV_SELECT_MASS: each head's count k changes from step to step and
 *    the chunk cache sees the k selected chunks (counts equal across placements and backends).
 *  - And with the rescoring (config.select_candidates, docs/DESIGN.md 4.5.1): the fixed count
 *    with W = 24 candidates (S = 16), the mass rule with W past every candidate (capped by each
 *    sequence's n_cand, ragged prompts); the selections of every step, a digest of them, must
 *    equal ref's on every backend.
 * Seeds are printed; SKV_SEED=N replays a run.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "synth.h"
#include "testutil.h"

static skv_config base_config(void)
{
    skv_config c = skv_config_default();
    c.n_layers = 3;
    c.batch_size = 2;
    c.n_q_heads = 8;
    c.n_kv_heads = 2;
    c.head_dim = 64;
    c.rank = 32;
    c.chunk_size = 4;
    c.budget = 64; /* S = 16 */
    c.n_outlier_chunks = 4;
    c.n_local_chunks = 2;
    c.max_prompt_len = 1024;
    c.gen_capacity = 24;
    return c;
}

/* ---- the memory split and bad budgets ------------------------------------------------- */

static void test_split(void)
{
    skv_config c = base_config();
    c.backend = SKV_BACKEND_REF;
    skv_memory_info all, info;
    SKVT_CHECK_STATUS(skv_cache_memory_info(&c, &all), SKV_OK, "memory_info(all device)");
    const int64_t slots = (int64_t)c.n_layers * c.batch_size;
    SKVT_CHECK(all.device_value_slots == slots && all.host_value_slots == 0 && all.host_bytes == 0,
               "all device: %lld device slots, %lld host slots, %zu host bytes", (long long)all.device_value_slots,
               (long long)all.host_value_slots, all.host_bytes);
    SKVT_CHECK(all.value_cache_chunks == 4 * (c.budget / c.chunk_size), "default chunk cache: %d entries, want 4 S",
               all.value_cache_chunks);
    const size_t V = all.value_store_bytes, C = all.value_cache_bytes;
    SKVT_CHECK(V > C && C > 0, "store %zu bytes, chunk cache %zu bytes", V, C);
    for (int64_t k = 0; k <= slots; k++) {
        /* exactly k stores and slots - k caches fit; one byte less gives k - 1 */
        c.value_device_bytes = (int64_t)(k * V + (slots - k) * C);
        SKVT_CHECK_STATUS(skv_cache_memory_info(&c, &info), SKV_OK, "memory_info(budget)");
        SKVT_CHECK(info.device_value_slots == k && info.host_value_slots == slots - k &&
                       info.host_bytes == (size_t)(slots - k) * V,
                   "budget for %lld stores: %lld device slots, %zu host bytes", (long long)k,
                   (long long)info.device_value_slots, info.host_bytes);
        SKVT_CHECK(all.device_bytes - info.device_bytes == (size_t)(slots - k) * (V - C),
                   "budget for %lld stores: device bytes %zu, all-device %zu", (long long)k, info.device_bytes,
                   all.device_bytes);
        if (k > 0) {
            c.value_device_bytes -= 1;
            SKVT_CHECK_STATUS(skv_cache_memory_info(&c, &info), SKV_OK, "memory_info(budget - 1)");
            SKVT_CHECK(info.device_value_slots == k - 1, "budget one byte short of %lld stores: %lld device slots",
                       (long long)k, (long long)info.device_value_slots);
        }
    }
    c.value_device_bytes = (int64_t)(slots * C) - 1;
    SKVT_CHECK_STATUS(skv_config_validate(&c), SKV_ERR_INVALID_CONFIG, "budget below the chunk caches");
    SKVT_CHECK(strstr(skv_last_error(), "value_device_bytes") != NULL, "message names the field: %s", skv_last_error());
    c.value_device_bytes = -2;
    SKVT_CHECK_STATUS(skv_config_validate(&c), SKV_ERR_INVALID_CONFIG, "value_device_bytes = -2");
    c.value_device_bytes = 0;
    SKVT_CHECK_STATUS(skv_config_validate(&c), SKV_ERR_INVALID_CONFIG, "value_device_bytes = 0 (caches need memory)");
    c.value_device_bytes = SKV_VALUES_ALL_DEVICE;
    c.value_cache_chunks = c.budget / c.chunk_size - 1;
    SKVT_CHECK_STATUS(skv_config_validate(&c), SKV_ERR_INVALID_CONFIG, "value_cache_chunks = S - 1");
    SKVT_CHECK(strstr(skv_last_error(), "value_cache_chunks") != NULL, "message names the field: %s", skv_last_error());
    c.value_cache_chunks = (int32_t)(c.max_prompt_len / c.chunk_size) + 1;
    SKVT_CHECK_STATUS(skv_config_validate(&c), SKV_ERR_INVALID_CONFIG, "value_cache_chunks > N_max - O");
    c.value_cache_chunks = -1;
    SKVT_CHECK_STATUS(skv_config_validate(&c), SKV_ERR_INVALID_CONFIG, "value_cache_chunks = -1");
    c.value_cache_chunks = c.budget / c.chunk_size;
    SKVT_CHECK_STATUS(skv_cache_memory_info(&c, &info), SKV_OK, "value_cache_chunks = S");
    SKVT_CHECK(info.value_cache_chunks == c.budget / c.chunk_size && info.value_cache_bytes < C,
               "value_cache_chunks = S: %d entries, %zu bytes", info.value_cache_chunks, info.value_cache_bytes);
    SKVT_CHECK_STATUS(skv_cache_memory_info(&c, NULL), SKV_ERR_NULL_POINTER, "memory_info(NULL)");
    SKVT_CHECK_STATUS(skv_cache_memory_info(NULL, &info), SKV_ERR_NULL_POINTER, "memory_info(cfg NULL)");
}

/* ---- an independent simulation of the chunk cache ---------------------------------------- */

typedef struct {
    int32_t E, *cand, *stamp; /* per entry: candidate held (-1), last step used (-1) */
} sim_head;

/* One step: hits counted by linear search; misses take the least recently used entries. */
static int32_t sim_step(sim_head *hd, const int32_t *sel, int32_t S, int32_t step)
{
    int32_t hits = 0;
    char *miss = calloc((size_t)S, 1), *pinned = calloc((size_t)hd->E, 1);
    for (int32_t s = 0; s < S; s++) {
        int32_t found = -1;
        for (int32_t e = 0; e < hd->E; e++)
            if (hd->cand[e] == sel[s]) found = e;
        if (found >= 0) {
            hd->stamp[found] = step;
            pinned[found] = 1;
            hits++;
        } else {
            miss[s] = 1;
        }
    }
    /* victims: repeatedly the unpinned entry with the smallest (stamp, index); then by index */
    int32_t n_miss = S - hits, *vict = malloc(sizeof(int32_t) * (size_t)(n_miss + 1));
    char *taken = calloc((size_t)hd->E, 1);
    for (int32_t i = 0; i < n_miss; i++) {
        int32_t best = -1;
        for (int32_t e = 0; e < hd->E; e++)
            if (!pinned[e] && !taken[e] && (best < 0 || hd->stamp[e] < hd->stamp[best])) best = e;
        taken[best] = 1;
        vict[i] = best;
    }
    for (int32_t i = 1; i < n_miss; i++) /* increasing entry index */
        for (int32_t j = i; j > 0 && vict[j - 1] > vict[j]; j--) {
            int32_t t = vict[j];
            vict[j] = vict[j - 1], vict[j - 1] = t;
        }
    for (int32_t s = 0, i = 0; s < S; s++)
        if (miss[s]) {
            hd->cand[vict[i]] = sel[s];
            hd->stamp[vict[i]] = step;
            i++;
        }
    free(miss), free(pinned), free(vict), free(taken);
    return hits;
}

/* ---- equivalence across placements -------------------------------------------------------- */

enum { N_PLACE = 3, STEPS = 18 };

typedef struct {
    skv_config cfg;
    skv_backend be;
    int64_t n[2];
    skv_bf16 *k[3][2], *v[3][2]; /* host prompts [layer][seq] */
    size_t row;
} world;


static skv_cache *make_cache(world *wd, int64_t budget)
{
    skv_config c = wd->cfg;
    c.backend = wd->be;
    c.value_device_bytes = budget;
    skv_cache *cache = NULL;
    if (!SKVT_CHECK_STATUS(skv_cache_create(&c, &cache), SKV_OK, "create")) return NULL;
    size_t bytes = (size_t)wd->n[0] * wd->row * 2;
    if ((size_t)wd->n[1] * wd->row * 2 > bytes) bytes = (size_t)wd->n[1] * wd->row * 2;
    skv_bf16 *dk = skvt_dbuf(wd->be, NULL, bytes), *dv = skvt_dbuf(wd->be, NULL, bytes);
    for (int l = 0; l < c.n_layers; l++)
        for (int b = 0; b < c.batch_size; b++) {
            size_t nb = (size_t)wd->n[b] * wd->row * 2;
            skv_bf16 *pk = dk ? dk : wd->k[l][b], *pv = dv ? dv : wd->v[l][b];
            skvt_dput(wd->be, pk, wd->k[l][b], nb);
            skvt_dput(wd->be, pv, wd->v[l][b], nb);
            SKVT_CHECK_STATUS(skv_prefill(cache, l, b, wd->n[b], pk, pv, NULL), SKV_OK, "prefill");
        }
    skvt_dfree(wd->be, dk, NULL);
    skvt_dfree(wd->be, dv, NULL);
    return cache;
}


/* head_dim 64 takes the general attention kernel on cuda, 128 the fragment kernel; mode bit 0: SKV_SELECT_MASS
   (each head's count k varies per step: the chunk cache sees k chunks), bit 1: the rescoring
   (select_candidates); *digest_out: a digest of every step's selections and counts */
static void test_equivalence(skv_backend be, uint64_t seed, int head_dim, int mode, int64_t *hits_out,
                             int64_t *miss_out, uint64_t *digest_out)
{
    const int mass = mode & 1;
    world wd;
    memset(&wd, 0, sizeof wd);
    wd.cfg = base_config();
    wd.cfg.head_dim = head_dim;
    if (mass) { /* a cap of 32 chunks (the chunk cache, 4 S entries, still below the store), which the
                   counts stay below at some steps */
        wd.cfg.select_mode = SKV_SELECT_MASS;
        wd.cfg.budget = 128;
        wd.cfg.select_mass = 0.6f;
        wd.cfg.select_min_chunks = 2;
    }
    if (mode & 2) /* W > S (24 of the fixed count's S = 16), or past every candidate (capped by n_cand) */
        wd.cfg.select_candidates = mass ? 4096 : 24;
    uint64_t digest = 1469598103934665603ull;
    wd.be = be;
    skvt_rng r;
    skvt_rng_seed(&r, seed);
    const skv_config *g = &wd.cfg;
    const int L = g->n_layers, B = g->batch_size, Hq = g->n_q_heads, Hk = g->n_kv_heads, D = g->head_dim;
    const int S = g->budget / g->chunk_size;
    wd.row = (size_t)Hk * D;
    wd.n[0] = 600 + skvt_rng_range(&r, 0, 400);
    wd.n[1] = 500 + skvt_rng_range(&r, 0, 500);
    for (int l = 0; l < L; l++)
        for (int b = 0; b < B; b++) {
            wd.k[l][b] = malloc((size_t)wd.n[b] * wd.row * 2);
            wd.v[l][b] = malloc((size_t)wd.n[b] * wd.row * 2);
            skvt_lowrank_prompt(&r, wd.row, wd.n[b], wd.k[l][b], wd.v[l][b]);
        }
    skv_memory_info mi;
    skv_config probe = wd.cfg;
    probe.backend = be;
    skv_cache_memory_info(&probe, &mi);
    const int64_t slots = (int64_t)L * B;
    const int64_t budgets[N_PLACE] = {SKV_VALUES_ALL_DEVICE, (int64_t)(slots * mi.value_cache_bytes),
                                      (int64_t)(3 * mi.value_store_bytes + (slots - 3) * mi.value_cache_bytes)};
    const int64_t want_dev[N_PLACE] = {slots, 0, 3};
    static const char *const pname[N_PLACE] = {"all-device", "all-host", "mixed"};
    skv_cache *cache[N_PLACE];
    for (int p = 0; p < N_PLACE; p++) {
        cache[p] = make_cache(&wd, budgets[p]);
        if (!cache[p]) return;
        for (int l = 0; l < L; l++)
            for (int b = 0; b < B; b++) {
                skv_seq_info info;
                skv_cache_seq_info(cache[p], l, b, &info);
                SKVT_CHECK(info.values_on_device == ((int64_t)l * B + b < want_dev[p]),
                           "%s %s: layer %d seq %d values_on_device = %d", skv_backend_name(be), pname[p], l, b,
                           info.values_on_device);
            }
    }
    /* the oracle of the chunk cache of every host slot of the all-host cache */
    sim_head sim[3][2][2];
    for (int l = 0; l < L; l++)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < Hk; h++) {
                sim_head *s = &sim[l][b][h];
                s->E = mi.value_cache_chunks;
                s->cand = malloc(sizeof(int32_t) * (size_t)s->E);
                s->stamp = malloc(sizeof(int32_t) * (size_t)s->E);
                for (int e = 0; e < s->E; e++) s->cand[e] = s->stamp[e] = -1;
            }
    int64_t sim_hits = 0, sim_miss = 0, mixed_lookups = 0, k_sum = 0, k_min = S, k_max = 0;

    const size_t qn = (size_t)B * Hq * D, kn = (size_t)B * Hk * D;
    skv_bf16 *q = malloc(qn * 2), *k = malloc(kn * 2), *v = malloc(kn * 2);
    float *qf = malloc(qn * sizeof(float));
    float *out[N_PLACE];
    for (int p = 0; p < N_PLACE; p++) out[p] = malloc(qn * sizeof(float));
    skv_bf16 *dq = skvt_dbuf(be, q, qn * 2), *dk = skvt_dbuf(be, k, kn * 2), *dv = skvt_dbuf(be, v, kn * 2);
    float *dout = skvt_dbuf(be, out[0], qn * 4);
    int32_t *sel[N_PLACE], *cand = malloc(sizeof(int32_t) * 4096);
    for (int p = 0; p < N_PLACE; p++) sel[p] = malloc(sizeof(int32_t) * (size_t)S);
    for (size_t i = 0; i < qn; i++) qf[i] = (float)skvt_rng_normal(&r);
    double worst = 0;
    int exact_fail = 0;
    for (int step = 0; step < STEPS; step++) {
        /* drift: mostly the last query (hits), now and then a fresh one (misses) */
        const double a = step % 6 == 5 ? 0.0 : 0.93, bnoise = sqrt(1 - a * a);
        for (size_t i = 0; i < qn; i++) {
            qf[i] = (float)(a * qf[i] + bnoise * skvt_rng_normal(&r));
            q[i] = skv_bf16_from_float(2.0f * qf[i]);
        }
        skvt_fill_bf16_normal(&r, k, kn, 1.0);
        skvt_fill_bf16_normal(&r, v, kn, 1.0);
        for (int l = 0; l < L; l++) {
            for (int p = 0; p < N_PLACE; p++) {
                skvt_dput(be, dq, q, qn * 2);
                skvt_dput(be, dk, k, kn * 2);
                skvt_dput(be, dv, v, kn * 2);
                if (!SKVT_CHECK_STATUS(skv_decode(cache[p], l, dq, dk, dv, dout), SKV_OK, "decode")) goto done;
                if (!SKVT_CHECK_STATUS(skv_cache_sync(cache[p]), SKV_OK, "sync")) goto done;
                skvt_dget(be, out[p], dout, qn * 4);
            }
            for (int p = 1; p < N_PLACE; p++)
                for (int b = 0; b < B; b++)
                    for (int hq = 0; hq < Hq; hq++) {
                        size_t o = ((size_t)b * Hq + hq) * D;
                        int same = memcmp(out[0] + o, out[p] + o, (size_t)D * 4) == 0;
                        /* bitwise, except on cuda for a host slot (missed chunks added after the transfer) */
                        int host_slot = (int64_t)l * B + b >= want_dev[p];
                        if (!same && (be != SKV_BACKEND_CUDA || !host_slot)) exact_fail++;
                        double dd = skvs_rel_err(out[p] + o, out[0] + o, (size_t)D);
                        if (dd > worst) worst = dd;
                    }
            for (int b = 0; b < B; b++)
                for (int h = 0; h < Hk; h++) {
                    int32_t cnt[N_PLACE];
                    for (int p = 0; p < N_PLACE; p++) {
                        skv_cache_selected(cache[p], l, b, h, sel[p]);
                        cnt[p] = -1;
                        skv_cache_selected_count(cache[p], l, b, h, &cnt[p]);
                    }
                    for (int p = 1; p < N_PLACE; p++)
                        SKVT_CHECK(memcmp(sel[0], sel[p], sizeof(int32_t) * (size_t)S) == 0 && cnt[0] == cnt[p],
                                   "%s step %d layer %d seq %d head %d: %s selects other chunks than all-device "
                                   "(%d against %d)", skv_backend_name(be), step, l, b, h, pname[p], cnt[p], cnt[0]);
                    const int32_t kk = cnt[0];
                    for (int s = 0; s <= S; s++) /* FNV-1a over the set and the count */
                        digest = (digest ^ (uint32_t)(s < S ? sel[0][s] : kk)) * 1099511628211ull;
                    if (!SKVT_CHECK(kk >= 1 && kk <= S && (mass || kk == S), "%s: count %d (S %d)", skv_backend_name(be),
                                    kk, S))
                        goto done;
                    k_sum += kk, k_min = kk < k_min ? kk : k_min, k_max = kk > k_max ? kk : k_max;
                    if ((int64_t)l * B + b >= want_dev[2]) mixed_lookups += kk;
                    /* the oracle works on candidate indices: map chunk ids back */
                    skv_seq_info info;
                    skv_cache_seq_info(cache[0], l, b, &info);
                    skv_cache_candidates(cache[0], l, b, h, cand);
                    int32_t ci[256];
                    for (int s = 0, m = 0; s < kk; s++) {
                        while (cand[m] != sel[0][s]) m++;
                        ci[s] = m;
                    }
                    int32_t hits = sim_step(&sim[l][b][h], ci, kk, step);
                    sim_hits += hits;
                    sim_miss += kk - hits;
                }
        }
    }
    SKVT_CHECK(exact_fail == 0, "%s: %d head outputs differ bitwise between placements where they must not",
               skv_backend_name(be), exact_fail);
    SKVT_CHECK(worst <= 1e-6, "%s: outputs across placements differ by %.3g relative (bound 1e-6)",
               skv_backend_name(be), worst);
    printf("%s: placements agree (worst relative difference %.3g)\n", skv_backend_name(be), worst);
    {
        skv_stats st[N_PLACE];
        for (int p = 0; p < N_PLACE; p++) skv_cache_stats(cache[p], &st[p]);
        SKVT_CHECK(st[0].value_cache_hits == 0 && st[0].value_cache_misses == 0,
                   "%s all-device: %lld hits, %lld misses counted (no chunk cache)", skv_backend_name(be),
                   (long long)st[0].value_cache_hits, (long long)st[0].value_cache_misses);
        SKVT_CHECK(st[1].value_cache_hits == sim_hits && st[1].value_cache_misses == sim_miss,
                   "%s all-host: %lld hits, %lld misses; the simulated rule gives %lld, %lld", skv_backend_name(be),
                   (long long)st[1].value_cache_hits, (long long)st[1].value_cache_misses, (long long)sim_hits,
                   (long long)sim_miss);
        SKVT_CHECK(sim_hits > 0 && sim_miss > 0, "the workload should both hit and miss: %lld hits, %lld misses",
                   (long long)sim_hits, (long long)sim_miss);
        SKVT_CHECK(st[2].value_cache_hits + st[2].value_cache_misses == mixed_lookups,
                   "%s mixed: %lld lookups, want %lld", skv_backend_name(be),
                   (long long)(st[2].value_cache_hits + st[2].value_cache_misses), (long long)mixed_lookups);
        if (mass) {
            printf("%s: mass counts %lld..%lld, mean %.2f of S %d\n", skv_backend_name(be), (long long)k_min,
                   (long long)k_max, (double)k_sum / ((double)STEPS * L * B * Hk), S);
            SKVT_CHECK(k_min < k_max, "%s: the mass rule's counts never varied (%lld)", skv_backend_name(be),
                       (long long)k_min);
        }
        printf("%s: chunk cache %lld hits, %lld misses (all-host)\n", skv_backend_name(be),
               (long long)st[1].value_cache_hits, (long long)st[1].value_cache_misses);
        *hits_out = st[1].value_cache_hits;
        *digest_out = digest;
        *miss_out = st[1].value_cache_misses;
    }
done:
    skvt_dfree(be, dq, q);
    skvt_dfree(be, dk, k);
    skvt_dfree(be, dv, v);
    skvt_dfree(be, dout, out[0]);
    for (int p = 0; p < N_PLACE; p++) skv_cache_free(cache[p]), free(out[p]), free(sel[p]);
    free(q), free(k), free(v), free(qf), free(cand);
    for (int l = 0; l < L; l++)
        for (int b = 0; b < B; b++) {
            free(wd.k[l][b]), free(wd.v[l][b]);
            for (int h = 0; h < Hk; h++) free(sim[l][b][h].cand), free(sim[l][b][h].stamp);
        }
}

int main(void)
{
    uint64_t seed = skvt_base_seed("test_placement");
    test_split();
    const skv_backend bes[3] = {SKV_BACKEND_REF, SKV_BACKEND_CPU, SKV_BACKEND_CUDA};
    static const int dims[2] = {64, 128};
    static const char *const mname[4] = {"", ", SKV_SELECT_MASS", ", select_candidates 24",
                                         ", SKV_SELECT_MASS, select_candidates 4096"};
    for (int mode = 0; mode < 4; mode++) /* the fixed count, SKV_SELECT_MASS, both with the rescoring */
        for (int di = 0; di < 2; di++) {
            const int mass = mode & 1;
            int64_t hits[3] = {-1, -1, -1}, miss[3] = {-1, -1, -1};
            uint64_t dig[3] = {0, 0, 0};
            printf("head_dim %d%s\n", dims[di], mname[mode]);
            for (int i = 0; i < 3; i++) {
                if (skv_backend_available(bes[i]) != SKV_OK) {
                    skvt_skip("cuda backend not available on this machine");
                    continue;
                }
                test_equivalence(bes[i], seed + (uint64_t)di + 2 * (uint64_t)mode, dims[di], mode, &hits[i], &miss[i],
                                 &dig[i]);
            }
            for (int i = 1; i < 3; i++)
                if (hits[i] >= 0)
                    SKVT_CHECK(hits[i] == hits[0] && miss[i] == miss[0],
                               "head_dim %d%s: %s counts %lld hits, %lld misses; ref %lld, %lld", dims[di],
                               mass ? " (mass)" : "", skv_backend_name(bes[i]), (long long)hits[i], (long long)miss[i],
                               (long long)hits[0], (long long)miss[0]);
            for (int i = 1; i < 3; i++)
                if (hits[i] >= 0 && hits[0] >= 0)
                    SKVT_CHECK(dig[i] == dig[0], "head_dim %d%s: %s's selections differ from ref's (digest %016llx, ref %016llx)",
                               dims[di], mname[mode], skv_backend_name(bes[i]), (unsigned long long)dig[i],
                               (unsigned long long)dig[0]);
        }
    return skvt_finish();
}
