/* A rank per (layer, sequence), config.rank == 0 (docs/DESIGN.md 3.1): the choice on the host
   (ref, cpu), the ranks of a layer for its stats, the ranks of a loaded snapshot. */
#include <stdlib.h>
#include <string.h>

#include "skv_internal.h"
#include "skv_rank.h"

skv_status skv_rank_store(char *errbuf, const skv_config *g, int64_t n, const skv_bf16 *k_pre, const float *uf,
                          const float *wf, skv_bf16 *u, skv_bf16 *w, int32_t *rank)
{
    const int32_t m = g->rank_max;
    const size_t HkD = (size_t)g->n_kv_heads * g->head_dim;
    float *e = malloc((size_t)m * 2 * sizeof *e), *P = malloc((size_t)SKV_CANON_LANES * m * sizeof *P);
    int32_t *src = malloc((size_t)m * sizeof *src);
    if (!e || !P || !src) {
        free(e);
        free(P);
        free(src);
        return skv_fail(errbuf, SKV_ERR_OUT_OF_MEMORY,
                        "skv_prefill: out of memory for the rank choice (rank_max = %d)", m);
    }
    float *es = e + m;
    skv_rank_col_energies(uf, n, m, P, e);
    free(P);
    for (int32_t i = 0; i < m; i++) src[skv_rank_position(e, m, i)] = i;
    for (int32_t p = 0; p < m; p++) es[p] = e[src[p]];
    const float T = skv_rank_total_energy(k_pre, n * (int64_t)HkD);
    const int32_t r = skv_rank_pick(es, m, T, g->rank_error_target);
    for (int64_t t = 0; t < n; t++)
        for (int32_t p = 0; p < m; p++)
            u[(size_t)t * m + p] = p < r ? skv_f32_to_bf16(uf[(size_t)t * m + src[p]]) : 0;
    for (int32_t p = 0; p < m; p++)
        for (size_t d = 0; d < HkD; d++)
            w[(size_t)p * HkD + d] = p < r ? skv_f32_to_bf16(wf[(size_t)src[p] * HkD + d]) : 0;
    free(e);
    free(src);
    *rank = r;
    return SKV_OK;
}

void skv_cache_layer_ranks(skv_cache *c, int32_t layer, int32_t *rank_min, int32_t *rank_max,
                           int32_t *n_prefilled, double *rank_mean)
{
    skv_cache_parts p;
    skv_cache_parts_get(c, &p);
    int32_t lo = 0, hi = 0, np = 0;
    double sum = 0.0;
    for (int32_t b = 0; b < p.cfg->batch_size; b++) {
        const skv_seq_state *sl = &p.slots[(size_t)layer * p.cfg->batch_size + b];
        if (!sl->prefilled) continue;
        if (!np || sl->rank < lo) lo = sl->rank;
        if (!np || sl->rank > hi) hi = sl->rank;
        sum += (double)sl->rank;
        np++;
    }
    *rank_min = lo;
    *rank_max = hi;
    *n_prefilled = np;
    *rank_mean = np ? sum / (double)np : 0.0;
}

/*
 * config.rank, or with rank == 0 one past the last row of the slot's stored W [rank_max, Hk D]
 * with a nonzero element (at least 1). A snapshot does not store the rank: prefill stores rows
 * r.. of W as zeros, and rows below r are rows of the factorization's orthonormal basis, never
 * all zero in bf16.
 */
skv_status skv_cache_recount_ranks(const skv_cache_parts *p, skv_seq_state *states)
{
    const skv_config *g = p->cfg;
    const size_t HkD = (size_t)g->n_kv_heads * g->head_dim, m = (size_t)skv_cfg_rank(g);
    skv_bf16 *row = NULL;
    if (g->rank == 0 && !(row = malloc(HkD * sizeof *row)))
        return skv_fail(NULL, SKV_ERR_OUT_OF_MEMORY, "skv_cache_load: out of memory for a row of W");
    for (int64_t i = 0; i < p->lay->n_slots; i++) {
        if (!states[i].prefilled) continue;
        if (g->rank) {
            states[i].rank = g->rank;
            continue;
        }
        const skv_bf16 *w = (const skv_bf16 *)(p->dev + (size_t)i * p->lay->slot_device + p->lay->w);
        int32_t r = 1;
        for (size_t q = m; q-- > 1;) {
            skv_status st = p->ops->copy2d(row, 0, w + q * HkD, 0, HkD * sizeof *row, 1);
            if (st) {
                free(row);
                return skv_fail(NULL, st, "skv_cache_load: reading row %zu of W of slot %lld failed", q,
                                (long long)i);
            }
            size_t d = 0;
            while (d < HkD && !(row[d] & 0x7fff)) d++;
            if (d < HkD) {
                r = (int32_t)q + 1;
                break;
            }
        }
        states[i].rank = r;
    }
    free(row);
    return SKV_OK;
}
