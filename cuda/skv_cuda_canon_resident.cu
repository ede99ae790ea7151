/*
 * skv_cuda_canon_resident.cu - the reproducible mode's scores of a decode step's resident tokens
 * (skv_cuda_canon_decode_resident; the cache's decode step runs it on its side stream beside
 * steps 2 and 3, in skv_cuda_backend.cu): canon_resident_kernel, every span but the selected one
 * (docs/DESIGN.md 10.3 step 1), a thread per token and the group's heads 4 chains at a time, into
 * the workspace's canon_e. Built with --fmad=false (CU_EXACT).
 */
#include <cuda_runtime.h>
#include <mma.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_cuda_canon_attn.cuh"
#include "skv_numerics.h"
#include "skv_plan.h"

namespace {

/* Decode, the nx blocks of (b, h) of canon_resident_kernel: the resident tokens (every span but the selected one,
   in the attention's token order) strided over those blocks, a thread per token: s_j of the group's
   query heads (at_score_token) into e. smem: q [G][D] floats. */
__device__ void rb_resident(const RebuildArgs &a, int b, int h)
{
    const int tid = threadIdx.x;
    float *qs = (float *)skv_canon_smem;
    __shared__ CSpan sp[SKV_N_SPANS];
    if (a.seqs[b].idle) return; /* an idle row (block-uniform): nothing of the step's tensors is read */
    /* every span at its place in e, the selected one with room for S c (this runs beside the selection) */
    if (tid == 0) at_seq_spans(a.seqs[b], a.io, b, h, a.Hk, a.D, a.O, a.c, a.S, a.gen_cap, (int64_t)a.S * a.c, sp);
    rb_load_q(a, b, h, qs);
    __syncthreads();
    int64_t T = 0;
    for (int i = 0; i < SKV_N_SPANS; i++) T += sp[i].n;
    const int64_t sel0 = sp[SKV_SPAN_OUTLIERS].n + sp[SKV_SPAN_LOCAL].n, nsel = sp[SKV_SPAN_SELECTED].n;
    const int64_t nres = T - nsel, bq0 = (int64_t)b * a.Hq + (int64_t)h * a.G;
    int si = 0;
    int64_t base = 0;
    for (int64_t r = (int64_t)blockIdx.x * kRbNT + tid; r < nres; r += (int64_t)a.nx * kRbNT) {
        const int64_t j = r < sel0 ? r : r + nsel;
        at_seek(sp, SKV_N_SPANS, j, si, base);
        at_score_token(sp[si].k + (j - base) * sp[si].ts, qs, a.D, a.G, a.scale, a.e + bq0 * a.Tmax, a.Tmax, j);
    }
}

/* Decode: the resident tokens' scores, grid (nx, Hk, B), 256 threads (rb_resident). smem: q [G][D] floats. */
__global__ void __launch_bounds__(kRbNT) canon_resident_kernel(const RebuildArgs a)
{
    rb_resident(a, blockIdx.z, blockIdx.y);
}

} /* namespace */

cudaError_t skv_cuda_canon_decode_resident(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                           const skv_cuda_dws *ws)
{
    RebuildArgs a = decode_rebuild_args(sh, seqs, ws);
    if (sh->B <= 0) return cudaSuccess;
    if (a.Hk > kMaxGridYZ || sh->B > kMaxGridYZ) return cudaErrorInvalidValue;
    const size_t smem = sizeof(float) * (size_t)a.G * a.D;
    cudaError_t e = allow_smem(canon_resident_kernel, smem);
    if (e != cudaSuccess) return e;
    return launch(canon_resident_kernel, dim3((unsigned)a.nx, (unsigned)a.Hk, (unsigned)sh->B), dim3(kRbNT), smem, st,
                  false, a);
}
