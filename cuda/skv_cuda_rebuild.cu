/*
 * skv_cuda_rebuild.cu - the op-level key rebuild (skv_cuda_rebuild: the rebuild slot of the
 * dispatch table, default mode; the reproducible mode's is skv_cuda_canon_rebuild.cu):
 * rebuild_kernel<DT>, k_out [Hk, S*c, D] = RoPE(U W_h) of the given chunks, one tile of rows per
 * block, with the tile rebuild of step 4 (skv_cuda_attn.cuh).
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

/* Op-level rebuild: k_out [Hk, S*c, D], one tile of TT rows per block. */
template <int DT>
__global__ void __launch_bounds__(kAtNT) rebuild_kernel(const skv_cuda_shape sh, const skv_cuda_seq *seqs,
                                                        const int32_t *chunk_ids, uint16_t *k_out)
{
    constexpr int TT = att_tt(DT);
    const int D = sh.D;
    const AttLayout L = att_layout(D, DT, 1, sh.r);
    int64_t *tok_s = reinterpret_cast<int64_t *>(skv_attn_smem + L.off_tok);
    unsigned char *work = skv_attn_smem + L.off_work;
    const int h = blockIdx.y;
    const int64_t SC = (int64_t)sh.S * sh.c, t0 = (int64_t)blockIdx.x * TT;
    if (threadIdx.x < TT) {
        const int64_t ts = t0 + threadIdx.x;
        tok_s[threadIdx.x] = ts < SC ? (int64_t)chunk_ids[(int64_t)h * sh.S + ts / sh.c] * sh.c + ts % sh.c : -1;
    }
    __syncthreads();
    float *x_s = reinterpret_cast<float *>(work);
    rebuild_tile<DT>(work, L, sh, seqs[0].u, seqs[0].w, h, tok_s, x_s);
    const int nrows = (int)(SC - t0 < TT ? SC - t0 : TT);
    rope_rows(x_s, L.ldx, tok_s, nrows, D, sh, k_out + ((int64_t)h * SC + t0) * D, D, false);
}

} /* namespace */

template <int DT>
static cudaError_t launch_rebuild(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                  const int32_t *chunk_ids, skv_bf16 *k_out)
{
    const size_t smem = att_layout(sh->D, DT, 1, sh->r).bytes;
    cudaError_t e = allow_smem(rebuild_kernel<DT>, smem);
    if (e != cudaSuccess) return e;
    const dim3 grid((unsigned)ceil_div64((int64_t)sh->S * sh->c, att_tt(DT)), (unsigned)sh->Hk);
    return launch(rebuild_kernel<DT>, grid, dim3(kAtNT), smem, st, false, *sh, seqs, chunk_ids, (uint16_t *)k_out);
}

cudaError_t skv_cuda_rebuild(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                             const int32_t *chunk_ids, skv_bf16 *k_out)
{
    if (sh->Hk <= 0 || (int64_t)sh->S * sh->c <= 0) return cudaSuccess;
    if (sh->D <= 0 || sh->D > 1024 || sh->Hk > 65535) return cudaErrorInvalidValue;
    switch (att_dt(sh->D)) {
    case 64: return launch_rebuild<64>(st, sh, seqs, chunk_ids, k_out);
    case 128: return launch_rebuild<128>(st, sh, seqs, chunk_ids, k_out);
    case 256: return launch_rebuild<256>(st, sh, seqs, chunk_ids, k_out);
    default: return launch_rebuild<0>(st, sh, seqs, chunk_ids, k_out);
    }
}
