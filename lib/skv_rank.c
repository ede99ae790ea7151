/* A rank per (layer, sequence), config.rank == 0 (docs/DESIGN.md 3.1): the choice on the host
   (ref, cpu). */
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
