/*
 * synth.h - a synthetic Llama-shaped decode workload, the demo's; the
 * end-to-end test, the placement test and the benchmark use it too.
 * Deterministic from a seed. Needs shadowkv.h, CBLAS and the C library only.
 *
 * One skvs_seq is one layer of one sequence: a prompt of n tokens and up to
 * max_steps decode steps. Its keys mimic what ShadowKV relies on in real
 * models:
 *  - pre-RoPE keys are low rank across all KV heads ([n, Hk*D] view): a mean
 *    offset plus chunk-wise latents (an AR(1) walk over chunks, small
 *    per-token perturbation) on an orthonormal basis with a decaying spectrum,
 *    plus 1% isotropic noise; high-RoPE-frequency dims carry little energy, so
 *    post-RoPE keys inside a chunk stay similar;
 *  - a few huge-norm sink tokens at positions 0..3 (chunk 0);
 *  - planted outlier chunks whose tokens have independent latents;
 *  - planted needle chunks whose post-RoPE keys all equal one vector u_h per
 *    KV head (K_pre = inverse-RoPE(u_h) at each position; u_h lives in basis
 *    directions that ordinary tokens barely use, so needles cost no rank).
 * Decode step s targets needle s mod n_needles: q = beta*u_h + alpha*sink +
 * gamma*(RoPE'd random latent direction). gamma sets the std of the
 * background logits (2.5..3.2), beta and alpha are solved on a 512-token sample
 * (Gaussian estimate of the background's partition) so the needle and the
 * sinks take about a target share of attention, drawn per query head
 * (needle 25..60%, sinks 5..20%; realized on average ~30% and ~11%). That
 * makes attention as concentrated as in real models: the top-budget tokens
 * hold >= 0.9 of it (0.94..0.99 measured by skvs_reference).
 */
#ifndef SKV_SYNTH_H
#define SKV_SYNTH_H

#include <stddef.h>
#include <stdint.h>
#include "shadowkv.h"

/* Shared by every sequence: the shape and the RoPE tables. */
typedef struct skvs_workload {
    skv_config cfg;      /* shape, rope, attn_scale, budget, O, Lc */
    int64_t max_pos;     /* table rows: longest prompt + decode steps */
    float *cos_tab, *sin_tab;
    float scale;         /* resolved attention scale */
    skv_backend backend; /* for RoPE of generated keys (host memory: ref or cpu) */
} skvs_workload;

/* One layer of one sequence. Fields are read-only for callers. */
typedef struct skvs_seq {
    const skvs_workload *w;
    int64_t n;            /* prompt length */
    int32_t max_steps;    /* generated-token capacity */
    int32_t n_gen;        /* decode steps generated so far */
    int keep;             /* keep float copies for skvs_reference */
    uint64_t seed;
    /* the prompt, [n, Hk, D] each; freed by skvs_seq_release */
    skv_bf16 *k_pre, *k_post, *v;
    /* with keep, after skvs_seq_release: float copies of k_post and v,
       [n + max_steps, Hk, D], prompt then generated tokens */
    float *ref_k, *ref_v;
    /* generator state */
    int32_t n_dirs, m_bg, m_nd; /* basis rows: mean, m_bg background, m_nd needle, sink */
    float *basis;         /* [n_dirs, Hk*D], orthonormal rows */
    float *sigma;         /* [m_bg] background spectrum */
    float a_mu;           /* mean-offset coefficient */
    float *z_last;        /* [m_bg] latent of the last prompt chunk */
    int32_t n_needles;
    int32_t *needle_chunk;/* [n_needles] chunk ids */
    float *needle_u;      /* [n_needles, Hk, D] post-RoPE needle keys */
    int32_t n_sinks;
    float *sink_k;        /* [Hk, D] mean post-RoPE key of the sinks */
    int32_t n_sample;
    skv_bf16 *sample_k;   /* [n_sample, Hk, D] post-RoPE keys of random ordinary tokens */
    /* from the cache after prefill (skvs_seq_attach) */
    int32_t n_chunks;     /* N context chunks */
    int32_t *outliers;    /* [Hk, O] outlier chunk ids */
} skvs_seq;

/*
 * Builds RoPE tables for max_pos positions. backend: which backend ropes the
 * generated keys (SKV_BACKEND_REF or SKV_BACKEND_CPU; host pointers).
 */
skv_status skvs_workload_init(skvs_workload *w, const skv_config *cfg, int64_t max_pos,
                              skv_backend backend);
void skvs_workload_free(skvs_workload *w);

/*
 * Generates the prompt of one (layer, sequence): k_pre, k_post (RoPE by the
 * workload's backend) and v, all [n, Hk, D]. keep: skvs_seq_release keeps
 * float copies of k_post and v for skvs_reference.
 */
skv_status skvs_seq_generate(skvs_seq *s, const skvs_workload *w, int64_t n, int32_t max_steps,
                             int keep, uint64_t seed);

/* After skv_prefill: frees the prompt tensors (with keep, copies k_post and v to ref_k, ref_v first). */
skv_status skvs_seq_release(skvs_seq *s);
void skvs_seq_free(skvs_seq *s);

/* Reads the outlier chunk ids and N of (layer, seq_idx) from the cache. */
skv_status skvs_seq_attach(skvs_seq *s, skv_cache *cache, int32_t layer, int32_t seq_idx);

/*
 * The next decode step (step index s->n_gen): post-RoPE q [Hq, D], k [Hk, D]
 * (roped at position n + step) and v [Hk, D]; *needle gets the chunk id the
 * query targets. k and v are appended to ref_k / ref_v when those exist.
 * SKV_ERR_CAPACITY after max_steps steps.
 */
skv_status skvs_step(skvs_seq *s, skv_bf16 *q, skv_bf16 *k, skv_bf16 *v, int32_t *needle);

/*
 * The tokens of decode step `step` (< max_steps) from an independent random stream: stream
 * 0 gives what skvs_step gives at that step, others other queries on the same prompt (one
 * per sequence of a batch that shares a prompt). Changes nothing in s (no n_gen advance, no
 * append to ref_k / ref_v).
 */
skv_status skvs_step_stream(skvs_seq *s, int32_t step, uint64_t stream, skv_bf16 *q, skv_bf16 *k, skv_bf16 *v,
                            int32_t *needle);

/* What the reference measured for one query token. */
typedef struct skvs_ref_stats {
    double topk_mass;   /* mean over query heads of the attention share of the
                           top-budget tokens among all prompt + generated tokens */
    double needle_mass; /* mean over query heads of the share of the needle chunk */
    double sink_mass;   /* same for the sink tokens */
} skvs_ref_stats;

/*
 * References for the query q [Hq, D] of decode step n_gen - 1, over the prompt
 * and the first n_gen generated tokens (n_gen <= s->n_gen; s->n_gen for the
 * latest step), with the exact keys (needs keep, skvs_seq_release and
 * skvs_seq_attach). Scores and the dense output are float GEMMs (relative
 * error ~1e-6), softmax and the sparse sets double. Outputs are [Hq, D], each
 * may be NULL:
 *  out_full      dense attention;
 *  out_oracle    attention over the library's always-kept tokens (outlier
 *                chunks, local window, generated tokens) plus, per KV head,
 *                the `budget` candidate tokens with the truly highest
 *                a_t = max over the GQA group of the full softmax probability
 *                p_{i,t} (the library's rule, docs/DESIGN.md 4.4, applied per token);
 *  out_selected  the always-kept tokens plus the chunks in selected [Hk, S]
 *                (e.g. from skv_cache_selected; -1 entries are none): the library's selection with
 *                exact keys, which separates selection error from key-rebuild
 *                error. Ignored if selected is NULL.
 * needle: chunk id for needle_mass (or -1).
 */
skv_status skvs_reference(const skvs_seq *s, int32_t n_gen, const skv_bf16 *q, int32_t needle,
                          const int32_t *selected, float *out_full, float *out_oracle, float *out_selected,
                          skvs_ref_stats *st);

/* ||x - ref||_2 / ||ref||_2 in double. */
double skvs_rel_err(const float *x, const float *ref, size_t n);

#endif
