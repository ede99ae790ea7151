/*
 * skv_cuda_combine.cu - step 5 of a decode (skv_cuda.h lists the steps) and the
 * end of an op-level span attention: the partials of every work item (max, sum,
 * unnormalized P V, written by skv_cuda_attend.cu) combined per query head in item
 * order, and at decode the append of the new token and the reset of the
 * per-step accumulators.
 *
 * Like the attention it is not on the exact-selection path (docs/DESIGN.md
 * section 5), but its order is fixed: the same partials give the same bits,
 * whichever items ran first. The launcher only enqueues on its stream: no
 * allocation, no synchronization.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"

/* The dynamic shared memory of the combine kernel. */
extern __shared__ __align__(128) unsigned char skv_combine_smem[];

namespace {

constexpr int kCoNT = 128;
constexpr int kCoSU = 8; /* items per warp in flight */
constexpr int kCoDU = 4; /* dims per lane and pass */

struct CombineArgs {
    int32_t Hq, Hk, D, gen_cap, n_items;
    const float *part_acc;
    const float2 *part_ml;
    float *out;
    /* decode */
    skv_cuda_seq *seqs;
    const skv_cuda_io *io;            /* out, k_new, v_new */
    unsigned *macc;
    int32_t *step_bad;
    unsigned *cnt_done;
    int skip_out; /* 1: the output was written elsewhere (reproducible mode); only the resets and the append */
    /* the layer's counters (NULL: none): per good step of sequence b, for its Hk heads */
    unsigned long long *lstats;
    const int32_t *sel_cnt;           /* [B, Hk] the step's counts (NULL: a dense layer, k = 0) */
    int32_t oc;                       /* O c of the layer's shape */
    int32_t c;
};

/* The layer's counters for a good step of sequence sq (n_gen before the step): head_steps,
   attended_tokens (O c + n_local + k c + n_gen + 1 per head), context_tokens (n + n_gen + 1 per
   head), selected_chunks (k per head); one thread. */
__device__ void combine_count(const CombineArgs &a, const skv_cuda_seq *sq, int b, int32_t n_gen)
{
    unsigned long long att = 0, sel = 0;
    for (int32_t h = 0; h < a.Hk; h++) {
        const unsigned long long k = a.sel_cnt ? (unsigned long long)a.sel_cnt[(int64_t)b * a.Hk + h] : 0ull;
        sel += k;
        att += (unsigned long long)a.oc + (unsigned long long)sq->n_local + k * (unsigned long long)a.c +
               (unsigned long long)n_gen + 1ull;
    }
    atomicAdd(&a.lstats[0], (unsigned long long)a.Hk);
    atomicAdd(&a.lstats[1], att);
    atomicAdd(&a.lstats[2], (unsigned long long)a.Hk * ((unsigned long long)sq->n + (unsigned long long)n_gen + 1ull));
    atomicAdd(&a.lstats[3], sel);
}

/*
 * grid (Hq [+ 1], B). Block (qh, b): out = sum_i w_i acc_i / sum_i w_i l_i with
 * w_i = 2^(m_i - max m) (empty items weigh nothing), items in order; the max-score
 * accumulator of (b, qh) is reset for the next step. Block (Hq, b) (decode): unless the step
 * was bad, appends k_new/v_new at generated row n_gen, then n_gen++, has_sel = 1 (the select
 * step wrote the selection to pub_sel_idx / pub_sel_ids). The last block to finish resets
 * step_bad.
 */
__global__ void __launch_bounds__(kCoNT) combine_kernel(const CombineArgs a)
{
    float2 *ml_s = reinterpret_cast<float2 *>(skv_combine_smem);    /* [n_items] */
    float *w_s = reinterpret_cast<float *>(ml_s + a.n_items);       /* [n_items] */
    pdl_wait();
    const int tid = threadIdx.x, b = blockIdx.y;
    if (a.seqs && a.seqs[b].idle) {
        /* an idle row: no output, no append (its block still counts below) */
    } else if ((int)blockIdx.x < a.Hq && a.skip_out) {
        if (a.macc && tid == 0) a.macc[(int64_t)b * a.Hq + blockIdx.x] = 0;
    } else if ((int)blockIdx.x < a.Hq) {
        const int64_t bh = (int64_t)b * a.Hq + blockIdx.x;
        const float2 *ml = a.part_ml + bh * a.n_items;
        for (int s = tid; s < a.n_items; s += kCoNT) ml_s[s] = ml[s];
        __syncthreads();
        /* every thread derives the same max and sum from shared memory, in item order: the same
           bits whichever items ran first */
        float m = -INFINITY;
        for (int s = 0; s < a.n_items; s++) m = fmaxf(m, ml_s[s].x);
        for (int s = tid; s < a.n_items; s += kCoNT) w_s[s] = ml_s[s].x == -INFINITY ? 0.0f : exp2f(ml_s[s].x - m);
        __syncthreads();
        float l = 0.0f;
        for (int s = 0; s < a.n_items; s++) l = fmaf(w_s[s], ml_s[s].y, l);
        const float inv = 1.0f / l;
        /* warp w adds the items w, w + 4, ... (kCoSU items' loads in flight, kCoDU dims per lane),
           then the four warps' sums are added in warp order: the same bits whatever ran first */
        const float *acc = a.part_acc + bh * a.n_items * a.D;
        float *red = w_s + a.n_items; /* [kCoNT / 32][D] */
        const int warp = tid >> 5, lane = tid & 31;
        constexpr int NW = kCoNT / 32;
        for (int d0 = 0; d0 < a.D; d0 += 32 * kCoDU) {
            float v[kCoDU];
#pragma unroll
            for (int u = 0; u < kCoDU; u++) v[u] = 0.0f;
            for (int s0 = warp; s0 < a.n_items; s0 += NW * kCoSU) {
                float x[kCoSU][kCoDU];
#pragma unroll
                for (int i = 0; i < kCoSU; i++)
#pragma unroll
                    for (int u = 0; u < kCoDU; u++) {
                        const int s = s0 + NW * i, d = d0 + lane + 32 * u;
                        x[i][u] = s < a.n_items && d < a.D ? acc[(int64_t)s * a.D + d] : 0.0f;
                    }
#pragma unroll
                for (int i = 0; i < kCoSU; i++) {
                    const int s = s0 + NW * i;
                    if (s < a.n_items)
#pragma unroll
                        for (int u = 0; u < kCoDU; u++) v[u] = fmaf(w_s[s], x[i][u], v[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < kCoDU; u++) {
                const int d = d0 + lane + 32 * u;
                if (d < a.D) red[warp * a.D + d] = v[u];
            }
        }
        __syncthreads();
        for (int d = tid; d < a.D; d += kCoNT) {
            float v = red[d];
#pragma unroll
            for (int w = 1; w < NW; w++) v += red[w * a.D + d];
            (a.io ? a.io->out : a.out)[bh * a.D + d] = v * inv;
        }
        if (a.macc && tid == 0) a.macc[bh] = 0;
    } else if (*a.step_bad == 0) {
        skv_cuda_seq *sq = a.seqs + b;
        const int32_t n_gen = sq->n_gen; /* read by all threads before thread 0 advances it */
        if (n_gen < a.gen_cap) {         /* lib rejects a full region before the step */
            /* k, v of the new token to generated row n_gen (the selection was published by the
               select step); 16-byte pieces when every row is aligned */
            const int64_t HD = (int64_t)a.Hk * a.D;
            const uint16_t *kn = (const uint16_t *)a.io->k + b * HD, *vn = (const uint16_t *)a.io->v + b * HD;
            uint16_t *gk = (uint16_t *)sq->gen_k, *gv = (uint16_t *)sq->gen_v;
            if (a.D % 8 == 0 && ((((uintptr_t)kn | (uintptr_t)vn | (uintptr_t)gk | (uintptr_t)gv)) & 15) == 0) {
                const int64_t pr = a.D / 8;
                for (int64_t i = tid; i < HD / 8; i += kCoNT) {
                    const int64_t hh = i / pr, e = i - hh * pr, dst = (hh * a.gen_cap + n_gen) * pr + e;
                    const uint4 x = reinterpret_cast<const uint4 *>(kn)[i], y = reinterpret_cast<const uint4 *>(vn)[i];
                    reinterpret_cast<uint4 *>(gk)[dst] = x;
                    reinterpret_cast<uint4 *>(gv)[dst] = y;
                }
            } else {
                for (int64_t i = tid; i < HD; i += kCoNT) {
                    const int64_t hh = i / a.D, d = i - hh * a.D, dst = (hh * a.gen_cap + n_gen) * a.D + d;
                    gk[dst] = kn[i];
                    gv[dst] = vn[i];
                }
            }
            __syncthreads(); /* all copies are done before the sequence says they exist */
            if (tid == 0) {
                sq->n_gen = n_gen + 1;
                sq->has_sel = 1;
                if (sq->home) { /* the step's row is a copy: the sequence's own descriptor advances */
                    sq->home->n_gen = n_gen + 1;
                    sq->home->has_sel = 1;
                }
                if (a.lstats) combine_count(a, sq, b, n_gen);
            }
        }
    }
    if (a.step_bad) {
        __shared__ int last;
        __threadfence();
        __syncthreads();
        if (tid == 0) last = atomicAdd(a.cnt_done, 1u) == gridDim.x * gridDim.y - 1;
        __syncthreads();
        if (last && tid == 0) {
            *a.step_bad = 0;
            *a.cnt_done = 0;
        }
    }
}

/* The counters' arguments of a decode step (a layer with S = 0 is dense: no counts). */
void combine_counters(CombineArgs *a, const skv_cuda_shape *sh, const skv_cuda_dws *ws)
{
    a->lstats = ws->lstats;
    a->sel_cnt = sh->S > 0 ? ws->sel_cnt : NULL;
    a->oc = sh->O * sh->c;
    a->c = sh->c;
}

} /* namespace */

cudaError_t skv_cuda_combine(cudaStream_t st, const skv_cuda_shape *sh, skv_cuda_seq *seqs, const skv_cuda_dws *ws,
                             float *out, int pdl)
{
    const int append = seqs != NULL;
    if (sh->B <= 0 || sh->Hq <= 0) return cudaSuccess;
    CombineArgs a;
    memset(&a, 0, sizeof a);
    a.Hq = sh->Hq, a.Hk = sh->Hk, a.D = sh->D, a.gen_cap = sh->gen_cap, a.n_items = ws->it.n_items;
    a.part_acc = ws->part_acc;
    a.part_ml = ws->part_ml;
    a.out = out;
    if (append) {
        a.seqs = seqs;
        a.io = ws->io;
        a.macc = ws->macc;
        a.step_bad = ws->step_bad;
        a.cnt_done = ws->cnt_done;
        combine_counters(&a, sh, ws);
    }
    const size_t smem = (size_t)a.n_items * (sizeof(float2) + sizeof(float)) + (size_t)(kCoNT / 32) * a.D * sizeof(float);
    cudaError_t e = allow_smem(combine_kernel, smem);
    if (e != cudaSuccess) return e;
    if (sh->Hq + (append ? 1 : 0) > 65535 || sh->B > 65535) return cudaErrorInvalidValue;
    return launch(combine_kernel, dim3((unsigned)(sh->Hq + (append ? 1 : 0)), (unsigned)sh->B), dim3(kCoNT), smem, st,
                  pdl != 0, a);
}

cudaError_t skv_cuda_combine_append(cudaStream_t st, const skv_cuda_shape *sh, skv_cuda_seq *seqs,
                                    const skv_cuda_dws *ws)
{
    if (sh->B <= 0 || sh->Hq <= 0) return cudaSuccess;
    CombineArgs a;
    memset(&a, 0, sizeof a);
    a.Hq = sh->Hq, a.Hk = sh->Hk, a.D = sh->D, a.gen_cap = sh->gen_cap, a.n_items = 0;
    a.seqs = seqs;
    a.io = ws->io;
    a.macc = ws->macc;
    a.step_bad = ws->step_bad;
    a.cnt_done = ws->cnt_done;
    a.skip_out = 1;
    combine_counters(&a, sh, ws);
    if (sh->Hq + 1 > 65535 || sh->B > 65535) return cudaErrorInvalidValue;
    return launch(combine_kernel, dim3((unsigned)(sh->Hq + 1), (unsigned)sh->B), dim3(kCoNT), 0, st, false, a);
}
