/*
 * skv_cuda_attend_missed.cu - the pass that adds the P V of the chunks a host slot fetched late
 * (skv_cuda_attend_missed: the side-stream pass of a decode step with host-placed slots, after
 * skv_cuda_fetch and step 4, before step 5; reached from the cache's decode step in
 * skv_cuda_backend.cu): attend_missed_kernel<DT, GC>, with the weights step 4 recorded.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <mma.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_cuda_attn.cuh"
#include "skv_numerics.h"

namespace {

/*
 * The missed chunks' P V (host slots, after the fetch): per item of the selected span with a
 * missed chunk, acc[g][d] += sum over its missed tokens t (increasing) of p_t v_t, with the
 * weights att_tile recorded against the item's own max.
 */
template <int DT, int GC>
__global__ void __launch_bounds__(kAtNT) attend_missed_kernel(const AttendArgs a)
{
    constexpr int TT = att_tt(DT);
    __shared__ int32_t tokm[TT];  /* the item's missed tokens */
    __shared__ const unsigned char *vrow[TT]; /* the token's value row (bf16, or fp8 codes with vexp) */
    __shared__ int32_t vexp[TT];
    __shared__ int nm;
    const int D = DT ? DT : a.D;
    const int tid = threadIdx.x, item = blockIdx.x, b = blockIdx.z;
    const int h = blockIdx.y / a.nqc;
    const int qh0 = h * a.G + (blockIdx.y - h * a.nqc) * GC;
    const skv_cuda_shape &sh = a.sh;
    const skv_cuda_seq &sq = a.seqs[b];
    if (!sq.vc_data) return; /* block-uniform */
    const int32_t c = sh.c, S = sh.S;
    const int64_t SC = (int64_t)S * c, t0 = (int64_t)item * TT, bh = (int64_t)b * a.Hk + h;
    const int64_t KC = att_sel_tokens(a, b, h); /* the head's k chunks (this pass runs after step 4) */
    const int nvalid = (int)(KC - t0 < TT ? KC - t0 : TT);
    if (tid == 0) {
        int m = 0;
        for (int t = 0; t < nvalid; t++) {
            const int64_t ts = t0 + t;
            const int32_t s = (int32_t)(ts / c), i = (int32_t)(ts - (int64_t)s * c);
            const int32_t v = a.vsrc[bh * S + s];
            if (v < 0) {
                tokm[m] = t;
                const unsigned char *rec = sq.vc_data + ((int64_t)h * sh.vc_chunks + (v & 0x7fffffff)) * sh.vrec;
                const bool fp8 = sh.value_dtype == SKV_VALUE_FP8;
                vrow[m] = rec + (int64_t)i * D * (fp8 ? 1 : 2);
                vexp[m] = fp8 ? fp8_exp(rec, i, c, D) : 0;
                m++;
            }
        }
        nm = m;
    }
    __syncthreads();
    if (nm == 0) return;
    const int64_t head0 = (int64_t)b * a.Hq + qh0;
    for (int i = tid; i < GC * D; i += kAtNT) {
        const int g = i / D, d = i - g * D;
        const float *pw = a.pbuf + (head0 + g) * SC + t0;
        float acc = 0.0f;
        if (sh.value_dtype == SKV_VALUE_FP8) /* block-uniform; the decoded bf16 value, exactly */
            for (int k = 0; k < nm; k++) acc = fmaf(pw[tokm[k]], fp8x2_to_f32(vrow[k][d], fp8_scale(vexp[k])).x, acc);
        else
            for (int k = 0; k < nm; k++)
                acc = fmaf(pw[tokm[k]], skv_bf16_to_f32(reinterpret_cast<const uint16_t *>(vrow[k])[d]), acc);
        float *dst = a.part_acc + ((head0 + g) * a.it.n_items + item) * D + d;
        *dst += acc;
    }
}

} /* namespace */

template <int DT>
static AttendKernel pick_missed_gc(int gc)
{
    switch (gc) {
    case 8: return attend_missed_kernel<DT, 8>;
    case 4: return attend_missed_kernel<DT, 4>;
    case 2: return attend_missed_kernel<DT, 2>;
    default: return attend_missed_kernel<DT, 1>;
    }
}

static AttendKernel pick_missed(int DT, int gc)
{
    switch (DT) {
    case 64: return pick_missed_gc<64>(gc);
    case 128: return pick_missed_gc<128>(gc);
    case 256: return pick_missed_gc<256>(gc);
    default: return pick_missed_gc<0>(gc);
    }
}

cudaError_t skv_cuda_attend_missed(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                   const skv_cuda_dws *ws)
{
    if (sh->B <= 0 || sh->Hq <= 0 || sh->Hk <= 0 || ws->it.n_sel <= 0 || !ws->pbuf) return cudaSuccess;
    const AttendArgs a = attend_args(sh, seqs, ws);
    if (a.D <= 0 || a.D > 1024 || a.D % 2) return cudaErrorInvalidValue;
    const int gc = att_gc(a.G), DT = att_dt(a.D);
    if ((int64_t)a.Hk * a.nqc > 65535 || sh->B > 65535) return cudaErrorInvalidValue;
    const AttendKernel k = pick_missed(DT, gc);
    return launch(k, dim3((unsigned)ws->it.n_sel, (unsigned)(a.Hk * a.nqc), (unsigned)sh->B), dim3(kAtNT), 0, st, false,
                  a);
}
