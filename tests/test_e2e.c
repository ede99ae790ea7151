/*
 * test_e2e.c - end to end on a small Llama-shaped synthetic workload (synth.h):
 * 2 layers, a ragged batch of two prompts, 16 decode steps, on ref and cpu
 * with identical inputs. Every step checks: the planted needle chunk is
 * selected in every KV head; ref and cpu select identical chunk sets; the
 * sparse output is within 2x the oracle's error (+1e-2) of full attention;
 * the workload is concentrated (top-budget mass >= 0.9); cpu's output
 * matches ref's.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "synth.h"
#include "testutil.h"

enum { LAYERS = 2, BATCH = 2, STEPS = 16, NBE = 2 };
static const int64_t ctx[BATCH] = {6143, 9001}; /* ragged, not multiples of c */

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int contains(const int32_t *ids, int n, int32_t x)
{
    for (int i = 0; i < n; i++)
        if (ids[i] == x) return 1;
    return 0;
}

int main(void)
{
    uint64_t seed = skvt_base_seed("test_e2e");
    skv_config cfg = skv_config_default();
    cfg.n_layers = LAYERS;
    cfg.n_q_heads = 8;
    cfg.n_kv_heads = 2;
    cfg.head_dim = 128;
    cfg.rank = 96;
    cfg.budget = 512;
    cfg.batch_size = BATCH;
    cfg.max_prompt_len = 9216;
    cfg.gen_capacity = STEPS;
    const int Hq = cfg.n_q_heads, Hk = cfg.n_kv_heads, D = cfg.head_dim, S = cfg.budget / cfg.chunk_size;

    const skv_backend want[NBE] = {SKV_BACKEND_REF, SKV_BACKEND_CPU};
    skv_cache *cache[NBE] = {NULL};
    double prefill_ms[NBE] = {0}, decode_ms[NBE] = {0};
    int nbe = 0;
    skv_backend be[NBE];
    for (int i = 0; i < NBE; i++) {
        if (skv_backend_available(want[i]) != SKV_OK) {
            skvt_skip(skv_backend_name(want[i]));
            continue;
        }
        cfg.backend = want[i];
        skv_status st = skv_cache_create(&cfg, &cache[nbe]);
        if (!SKVT_CHECK(st == SKV_OK, "create %s: %s %s", skv_backend_name(want[i]), skv_status_string(st),
                        skv_last_error()))
            return skvt_finish();
        be[nbe] = skv_cache_backend(cache[nbe]);
        nbe++;
    }

    skvs_workload wl;
    skv_status st = skvs_workload_init(&wl, &cfg, ctx[BATCH - 1] + STEPS, SKV_BACKEND_REF);
    if (!SKVT_CHECK_STATUS(st, SKV_OK, "workload")) return skvt_finish();
    static skvs_seq seq[LAYERS][BATCH];
    for (int l = 0; l < LAYERS; l++)
        for (int b = 0; b < BATCH; b++) {
            st = skvs_seq_generate(&seq[l][b], &wl, ctx[b], STEPS, 1, seed * 1000003u + (uint64_t)(l * BATCH + b));
            if (!SKVT_CHECK_STATUS(st, SKV_OK, "generate")) return skvt_finish();
            for (int i = 0; i < nbe; i++) {
                double t0 = now_ms();
                st = skv_prefill(cache[i], l, b, ctx[b], seq[l][b].k_pre, seq[l][b].v, NULL);
                prefill_ms[i] += now_ms() - t0;
                SKVT_CHECK(st == SKV_OK, "prefill %s l%d b%d: %s %s", skv_backend_name(be[i]), l, b,
                           skv_status_string(st), skv_cache_last_error(cache[i]));
            }
            st = skvs_seq_attach(&seq[l][b], cache[0], l, b);
            SKVT_CHECK_STATUS(st, SKV_OK, "attach");
            skvs_seq_release(&seq[l][b]);
        }
    if (skvt_counts_g.failed) return skvt_finish();

    skv_bf16 *q = malloc(sizeof(skv_bf16) * BATCH * Hq * D), *k = malloc(sizeof(skv_bf16) * BATCH * Hk * D);
    skv_bf16 *v = malloc(sizeof(skv_bf16) * BATCH * Hk * D);
    float *out[NBE], *full = malloc(sizeof(float) * Hq * D), *orac = malloc(sizeof(float) * Hq * D);
    for (int i = 0; i < NBE; i++) out[i] = malloc(sizeof(float) * BATCH * Hq * D);
    int32_t *sel = malloc(sizeof(int32_t) * NBE * S * Hk);
    float *exact = malloc(sizeof(float) * Hq * D);
    double worst_ratio = 0, sum_err[NBE] = {0}, sum_or = 0, sum_needle = 0, sum_sink = 0, min_mass = 1, max_xbe = 0;
    int n_meas = 0, needle_miss = 0, set_diff = 0;

    for (int s = 0; s < STEPS; s++)
        for (int l = 0; l < LAYERS; l++) {
            int32_t needle[BATCH];
            for (int b = 0; b < BATCH; b++) {
                st = skvs_step(&seq[l][b], q + b * Hq * D, k + b * Hk * D, v + b * Hk * D, &needle[b]);
                SKVT_CHECK_STATUS(st, SKV_OK, "step");
            }
            for (int i = 0; i < nbe; i++) {
                double t0 = now_ms();
                st = skv_decode(cache[i], l, q, k, v, out[i]);
                decode_ms[i] += now_ms() - t0;
                SKVT_CHECK(st == SKV_OK, "decode %s: %s %s", skv_backend_name(be[i]), skv_status_string(st),
                           skv_cache_last_error(cache[i]));
            }
            for (int b = 0; b < BATCH; b++) {
                for (int h = 0; h < Hk; h++) {
                    for (int i = 0; i < nbe; i++) {
                        st = skv_cache_selected(cache[i], l, b, h, sel + (i * Hk + h) * S);
                        SKVT_CHECK_STATUS(st, SKV_OK, "selected");
                        needle_miss += !SKVT_CHECK(contains(sel + (i * Hk + h) * S, S, needle[b]),
                                                   "%s step %d layer %d seq %d head %d: needle chunk %d not selected",
                                                   skv_backend_name(be[i]), s, l, b, h, needle[b]);
                    }
                    for (int i = 1; i < nbe; i++)
                        set_diff += !SKVT_CHECK(!memcmp(sel + h * S, sel + (i * Hk + h) * S, sizeof(int32_t) * S),
                                                "step %d layer %d seq %d head %d: %s selects other chunks than ref",
                                                s, l, b, h, skv_backend_name(be[i]));
                }
                skvs_ref_stats rs;
                st = skvs_reference(&seq[l][b], q + b * Hq * D, needle[b], sel, full, orac, exact, &rs);
                SKVT_CHECK_STATUS(st, SKV_OK, "reference");
                double e_or = skvs_rel_err(orac, full, (size_t)Hq * D);
                sum_or += e_or;
                sum_needle += rs.needle_mass;
                sum_sink += rs.sink_mass;
                if (getenv("SKV_VERBOSE")) printf("s%d l%d b%d mass top %.4f needle %.3f sink %.3f oracle %.4f exact-sel %.4f\n", s, l, b, rs.topk_mass, rs.needle_mass, rs.sink_mass, e_or, skvs_rel_err(exact, full, (size_t)Hq * D));
                min_mass = rs.topk_mass < min_mass ? rs.topk_mass : min_mass;
                SKVT_CHECK(rs.topk_mass >= 0.9, "step %d layer %d seq %d: top-budget mass %.4f < 0.9", s, l, b,
                           rs.topk_mass);
                for (int i = 0; i < nbe; i++) {
                    double e = skvs_rel_err(out[i] + b * Hq * D, full, (size_t)Hq * D);
                    sum_err[i] += e;
                    if (getenv("SKV_VERBOSE")) printf("STAT %.5f %.5f %.5f %.5f\n", e_or, skvs_rel_err(exact, full, (size_t)Hq * D), e, skvs_rel_err(out[i] + b * Hq * D, exact, (size_t)Hq * D));
                    if (e / (2 * e_or + 1e-2) > worst_ratio) worst_ratio = e / (2 * e_or + 1e-2);
                    SKVT_CHECK(e <= 2 * e_or + 1e-2, "%s step %d layer %d seq %d: rel err %.4g > 2 x oracle %.4g + 1e-2",
                               skv_backend_name(be[i]), s, l, b, e, e_or);
                }
                for (int i = 1; i < nbe; i++) {
                    double x = skvs_rel_err(out[i] + b * Hq * D, out[0] + b * Hq * D, (size_t)Hq * D);
                    max_xbe = x > max_xbe ? x : max_xbe;
                    SKVT_CHECK(x <= 2e-3, "step %d layer %d seq %d: %s output vs ref rel err %.3g > 2e-3", s, l, b,
                               skv_backend_name(be[i]), x);
                }
                n_meas++;
            }
        }

    printf("shape: layers %d, batch %d (n = %lld, %lld), Hq %d, Hk %d, D %d, r %d, budget %d, O %d, steps %d\n",
           LAYERS, BATCH, (long long)ctx[0], (long long)ctx[1], Hq, Hk, D, cfg.rank, cfg.budget,
           cfg.n_outlier_chunks, STEPS);
    for (int i = 0; i < nbe; i++)
        printf("%-4s prefill %8.1f ms, decode %7.2f ms/step, mean rel err vs full %.4f\n", skv_backend_name(be[i]),
               prefill_ms[i], decode_ms[i] / STEPS, sum_err[i] / n_meas);
    printf("oracle mean rel err vs full %.4f, min top-budget mass %.4f, worst err/(2 oracle + 1e-2) %.3f\n",
           sum_or / n_meas, min_mass, worst_ratio);
    printf("mean attention share: needle chunk %.3f, sinks %.3f\n", sum_needle / n_meas, sum_sink / n_meas);
    printf("needle misses %d, selection mismatches %d, max cross-backend output rel err %.3g\n", needle_miss,
           set_diff, max_xbe);

    for (int l = 0; l < LAYERS; l++)
        for (int b = 0; b < BATCH; b++) skvs_seq_free(&seq[l][b]);
    for (int i = 0; i < NBE; i++) {
        skv_cache_free(cache[i]);
        free(out[i]);
    }
    skvs_workload_free(&wl);
    free(q), free(k), free(v), free(full), free(orac), free(exact), free(sel);
    return skvt_finish();
}
