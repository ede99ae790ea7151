// What the cuda canonical-kernel emulators share: rb_score_row of cuda/skv_cuda_canon_rebuild.cu on the host.
#ifndef SKV_EMU_COMMON_H
#define SKV_EMU_COMMON_H

#include <cstddef>
#include <cstdint>
extern "C" {
#include "skv_numerics.h"
}

// rb_score_row: heads g0, g0 + gs, .. (< G), 4 chains interleaved, float4 steps when D % 4 == 0; head g's
// score into e[g T + j] (e: the group's first head row).
static inline void score_row(const float *x, const float *q, int D, int G, int g0, int gs, float scale, float *e,
                             int64_t T, int64_t j)
{
    float acc[4] = {0, 0, 0, 0};
    if ((D & 3) == 0) {
        for (int d = 0; d < D; d += 4)
            for (int gg = 0; gg < 4; gg++) {
                if (g0 + gs * gg >= G) break;
                for (int c = 0; c < 4; c++) acc[gg] = SKV_FMA(q[(size_t)(g0 + gs * gg) * D + d + c], x[d + c], acc[gg]);
            }
    } else {
        for (int d = 0; d < D; d++)
            for (int gg = 0; gg < 4; gg++)
                if (g0 + gs * gg < G) acc[gg] = SKV_FMA(q[(size_t)(g0 + gs * gg) * D + d], x[d], acc[gg]);
    }
    for (int gg = 0; gg < 4; gg++)
        if (g0 + gs * gg < G) e[(size_t)(g0 + gs * gg) * T + j] = SKV_MUL(acc[gg], scale);
}

#endif
