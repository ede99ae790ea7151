/*
 * skv_cuda_attend.cu - step 4 of a decode (skv_cuda_attend; pipeline step "4 attend" of
 * skv_cuda.h, reached from the cache's decode step in skv_cuda_backend.cu) on the general
 * kernel (attend_kernel<DT, GC>: any even D up to 1024, any G, any RoPE), and the op-level span
 * attention (skv_cuda_span_attention, the span_attention slot of the dispatch table: the same
 * kernel over the caller's spans, then skv_cuda_combine). The common shape's decode goes to the
 * fragment kernel of skv_cuda_attend_mma.cu instead (skv_cuda_items.frag). Also the work-item
 * plans of both (skv_cuda_decode_items, skv_cuda_span_items).
 *
 * One CTA (256 threads) per item: (item, KV head h x query-head chunk, sequence b). Items
 * [0, n_sel) are tiles of tt selected tokens: their keys are rebuilt from U W_h into shared
 * memory (skv_cuda_attn.cuh: tensor cores for r % 16 == 0 and D in {64, 128, 256}, CUDA cores
 * otherwise), roped, rounded to bf16 and attended with the tile's values; items [n_sel, n_items)
 * are ranges of the resident spans (outliers, local window, generated tokens, the new token),
 * attended tile by tile with an online softmax. Each item writes a partial (max, sum,
 * unnormalized P V) per query head; the combine kernel (skv_cuda_combine.cu) adds the partials
 * in item order. Host slots skip the P V of their missed chunks here and record those tokens'
 * weights for skv_cuda_attend_missed.cu.
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


/* Stage tokens [tile0, tile0 + tt) of K and V (rows past t1 are zero: their p is 0 and
   0 * garbage could be NaN). cur: this thread's span cursor (rows a thread loads only increase). */
__device__ __forceinline__ void att_load_span_tile(uint16_t *Ks, uint16_t *Vs, const AttLayout &L, int D,
                                                   const AttSpan *sp, int &cur, int64_t tile0, int64_t t1)
{
    for (int idx = threadIdx.x; idx < L.tt * L.dc; idx += kAtNT) {
        const int row = idx / L.dc, cc = idx - row * L.dc;
        const int64_t t = tile0 + row;
        uint16_t *dk = Ks + row * L.lds + cc * 8, *dv = Vs + row * L.lds + cc * 8;
        if (t >= t1) {
            store_zero16(dk);
            store_zero16(dv);
            continue;
        }
        while (t >= sp[cur].end) cur++;
        const AttSpan &s = sp[cur];
        const int64_t off = (t - s.start) * s.stride + cc * 8;
        const int left = D - cc * 8; /* valid dims in this piece (the last piece may be short) */
        if (s.aligned && left >= 8) {
            cp_async16(dk, s.k + off);
            cp_async16(dv, s.v + off);
        } else {
            load8_slow(dk, s.k + off, left);
            load8_slow(dv, s.v + off, left);
        }
    }
}

/* Per-thread state of an item's attention. */
template <int GC>
struct AttState {
    float acc[GC][8]; /* P V of this thread's 8 dims over its token subset */
    float m_run, l_run; /* softmax warps (warp g < GC): running max and sum of head g */
};

/*
 * One tile of nvalid tokens (K, V in shared memory, miss_s[t] = 1: P V deferred) for the GC
 * query heads in q_s: phase 1 partial scores per (token, slice of D); the online softmax per
 * head (warp g, lanes over tokens); phase 2 acc = alpha acc + sum_t p_t v_t per (8 dims,
 * token subset). pbuf_row (or NULL): where the weights of deferred tokens go, per head at
 * pbuf_row + g * pb_stride + t.
 */
template <int GC>
__device__ void att_tile(const AttLayout &L, float scale_log2, const uint16_t *Ks, const uint16_t *Vs,
                         const float *q_s, float *spart, float *p_s, float *alpha_s, const int32_t *miss_s, int nvalid,
                         AttState<GC> &st, float *pbuf_row, int64_t pb_stride)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    {
        const int tok = tid % L.tt, part = tid / L.tt;
        const uint16_t *kr = Ks + tok * L.lds;
        float s[GC];
#pragma unroll
        for (int g = 0; g < GC; g++) s[g] = 0.0f;
#pragma unroll 4
        for (int cc = part; cc < L.dc; cc += L.nparts) {
            float kf[8];
            bf16x8_to_f32(*reinterpret_cast<const uint4 *>(kr + cc * 8), kf);
#pragma unroll
            for (int g = 0; g < GC; g++) {
                const float4 qa = *reinterpret_cast<const float4 *>(q_s + g * L.dp + cc * 8);
                const float4 qb = *reinterpret_cast<const float4 *>(q_s + g * L.dp + cc * 8 + 4);
                float x = s[g];
                x = fmaf(kf[0], qa.x, x);
                x = fmaf(kf[1], qa.y, x);
                x = fmaf(kf[2], qa.z, x);
                x = fmaf(kf[3], qa.w, x);
                x = fmaf(kf[4], qb.x, x);
                x = fmaf(kf[5], qb.y, x);
                x = fmaf(kf[6], qb.z, x);
                x = fmaf(kf[7], qb.w, x);
                s[g] = x;
            }
        }
#pragma unroll
        for (int g = 0; g < GC; g++) spart[(part * GC + g) * L.tt + tok] = s[g];
    }
    __syncthreads();
    if (warp < GC) {
        const int g = warp;
        constexpr int kMaxPer = 2; /* tt <= 64 tokens: two per lane */
        float sc[kMaxPer];
        float mt = -INFINITY;
#pragma unroll
        for (int j = 0; j < kMaxPer; j++) {
            const int t = lane + 32 * j;
            sc[j] = -INFINITY;
            if (t < L.tt && t < nvalid) {
                float x = 0.0f;
                for (int pt = 0; pt < L.nparts; pt++) x += spart[(pt * GC + g) * L.tt + t];
                sc[j] = x * scale_log2;
            }
            mt = fmaxf(mt, sc[j]);
        }
        const float mn = fmaxf(st.m_run, warp_max(mt));
        float alpha = 1.0f, psum = 0.0f;
        if (mn != -INFINITY) alpha = exp2f(st.m_run - mn); /* only -inf so far: keep everything at 0 */
#pragma unroll
        for (int j = 0; j < kMaxPer; j++) {
            const int t = lane + 32 * j;
            const float p = mn != -INFINITY ? exp2f(sc[j] - mn) : 0.0f;
            psum += p;
            if (t < L.tt) {
                p_s[t * GC + g] = p;
                if (pbuf_row && t < nvalid && miss_s[t]) pbuf_row[g * pb_stride + t] = p;
            }
        }
        st.l_run = st.l_run * alpha + warp_sum(psum);
        st.m_run = mn;
        if (lane == 0) alpha_s[g] = alpha;
    }
    __syncthreads();
    if (tid < L.nsub * L.dc) {
        const int cc = tid % L.dc, sub = tid / L.dc;
#pragma unroll
        for (int g = 0; g < GC; g++) {
            const float al = alpha_s[g];
#pragma unroll
            for (int j = 0; j < 8; j++) st.acc[g][j] *= al;
        }
#pragma unroll 4
        for (int t = sub; t < nvalid; t += L.nsub) {
            if (miss_s[t]) continue;
            float vf[8];
            bf16x8_to_f32(*reinterpret_cast<const uint4 *>(Vs + t * L.lds + cc * 8), vf);
#pragma unroll
            for (int g = 0; g < GC; g++) {
                const float p = p_s[t * GC + g];
#pragma unroll
                for (int j = 0; j < 8; j++) st.acc[g][j] = fmaf(p, vf[j], st.acc[g][j]);
            }
        }
    }
}

/* End of an item: the token subsets reduced in a fixed order, then (max, sum, acc) per head.
   red aliases the work region (free by now); every read of Ks/Vs is done at the first barrier. */
template <int GC>
__device__ void att_finish(const AttLayout &L, int D, AttState<GC> &st, float *red, float2 *ml_s, float *acc_out,
                           int64_t acc_stride, float2 *ml_out, int64_t ml_stride)
{
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (warp < GC && lane == 0) ml_s[warp] = make_float2(st.m_run, st.l_run);
    __syncthreads();
    if (tid < L.nsub * L.dc) {
        const int cc = tid % L.dc, sub = tid / L.dc;
#pragma unroll
        for (int g = 0; g < GC; g++)
#pragma unroll
            for (int j = 0; j < 8; j++) red[(sub * GC + g) * L.dp + cc * 8 + j] = st.acc[g][j];
    }
    __syncthreads();
    for (int i = tid; i < GC * D; i += kAtNT) {
        const int g = i / D, d = i - g * D;
        float v = 0.0f;
        for (int sub = 0; sub < L.nsub; sub++) v += red[(sub * GC + g) * L.dp + d];
        acc_out[g * acc_stride + d] = v;
    }
    if (tid < GC) ml_out[tid * ml_stride] = ml_s[tid];
}

template <int DT, int GC>
__global__ void __launch_bounds__(kAtNT) attend_kernel(const AttendArgs a)
{
    constexpr int TT = att_tt(DT);
    const int D = DT ? DT : a.D;
    const AttLayout L = att_layout(D, DT, GC, a.sh.r);
    uint16_t *Ks = reinterpret_cast<uint16_t *>(skv_attn_smem + L.off_k);
    uint16_t *Vs = reinterpret_cast<uint16_t *>(skv_attn_smem + L.off_v);
    float *q_s = reinterpret_cast<float *>(skv_attn_smem + L.off_q);
    float *spart = reinterpret_cast<float *>(skv_attn_smem + L.off_spart);
    float *p_s = reinterpret_cast<float *>(skv_attn_smem + L.off_p);
    float *alpha_s = reinterpret_cast<float *>(skv_attn_smem + L.off_alpha);
    float2 *ml_s = reinterpret_cast<float2 *>(skv_attn_smem + L.off_ml);
    int64_t *tok_s = reinterpret_cast<int64_t *>(skv_attn_smem + L.off_tok);
    int32_t *miss_s = reinterpret_cast<int32_t *>(skv_attn_smem + L.off_miss);
    unsigned char *work = skv_attn_smem + L.off_work;
    float *red = reinterpret_cast<float *>(work);
    __shared__ AttSpan sp_s[SKV_MAX_SPANS];
    __shared__ int nsp_s;

    const int tid = threadIdx.x;
    const int item = blockIdx.x, b = blockIdx.z;
    const int h = blockIdx.y / a.nqc;
    const int qh0 = h * a.G + (blockIdx.y - h * a.nqc) * GC; /* first query head of this CTA */
    const int64_t head0 = (int64_t)b * a.Hq + qh0;
    float *acc_out = a.part_acc + (head0 * a.it.n_items + item) * D;
    float2 *ml_out = a.part_ml + head0 * a.it.n_items + item;
    const int64_t acc_stride = (int64_t)a.it.n_items * D, ml_stride = a.it.n_items;

    if constexpr (DT != 0) /* W_h of a selected tile first: nothing before this kernel writes it */
        if (item < a.it.n_sel && L.whole) rebuild_whole_issue_w<DT>(work, L, a.seqs[b].w, h, a.Hk, a.sh.r);
    pdl_wait();
    const uint16_t *qin = a.io ? (const uint16_t *)a.io->q : a.q;
    for (int i = tid; i < GC * L.dp; i += kAtNT) {
        const int g = i / L.dp, d = i - g * L.dp;
        q_s[i] = d < D ? skv_bf16_to_f32(qin[(head0 + g) * D + d]) : 0.0f;
    }
    AttState<GC> st;
#pragma unroll
    for (int g = 0; g < GC; g++)
#pragma unroll
        for (int j = 0; j < 8; j++) st.acc[g][j] = 0.0f;
    st.m_run = -INFINITY;
    st.l_run = 0.0f;

    if (item < a.it.n_sel) {
        /* a tile of the selected span: tokens item*TT .. of [Hk, S*c] */
        const skv_cuda_shape &sh = a.sh;
        const skv_cuda_seq &sq = a.seqs[b];
        const int32_t c = sh.c, S = sh.S;
        const int64_t SC = (int64_t)S * c, t0 = (int64_t)item * TT, bh = (int64_t)b * a.Hk + h;
        const int nvalid = (int)(SC - t0 < TT ? SC - t0 : TT);
        const bool host = sq.vc_data != nullptr;
        if (tid < TT) {
            int64_t pos = -1;
            int miss = 0;
            if (tid < nvalid) {
                const int64_t ts = t0 + tid;
                const int32_t s = (int32_t)(ts / c), i = (int32_t)(ts - (int64_t)s * c);
                pos = (int64_t)a.sel_ids[bh * S + s] * c + i;
                miss = host && a.pbuf && a.vsrc[bh * S + s] < 0;
            }
            tok_s[tid] = pos;
            miss_s[tid] = miss;
        }
        __syncthreads();
        /* values: the device store, or the chunk-cache entry (hits now, misses later) */
        for (int idx = tid; idx < TT * L.dc; idx += kAtNT) {
            const int row = idx / L.dc, cc = idx - row * L.dc;
            uint16_t *dv = Vs + row * L.lds + cc * 8;
            if (row >= nvalid || miss_s[row]) {
                store_zero16(dv);
                continue;
            }
            const int64_t ts = t0 + row;
            const int32_t s = (int32_t)(ts / c), i = (int32_t)(ts - (int64_t)s * c);
            const uint16_t *src;
            if (host) {
                const int32_t e = a.vsrc[bh * S + s] & 0x7fffffff;
                src = sq.vc_data + (((int64_t)h * sh.vc_chunks + e) * c + i) * D;
            } else {
                src = sq.vstore + (((int64_t)h * sq.n_cand + a.sel_idx[bh * S + s]) * c + i) * D;
            }
            const int left = D - cc * 8;
            if ((((uintptr_t)src & 15) == 0) && left >= 8) cp_async16(dv, src + cc * 8);
            else load8_slow(dv, src + cc * 8, left);
        }
        float *x_s = reinterpret_cast<float *>(work);
        const bool fast_rope = DT != 0 && !sh.interleaved && sh.rotary_dim == D && TT * (D / 16) <= kRopeItems * kAtNT;
        if constexpr (DT != 0) {
            if (L.whole) { /* every load of the item in one round trip, the table rows during the GEMM */
                rebuild_whole_issue_u<TT>(work, L, sq.u, sh.r, tok_s);
                cp_async_commit();
                RopeRegs rr;
                if (fast_rope) rope_fast_load(rr, tok_s, TT, D, sh);
                cp_async_wait_all();
                __syncthreads();
                rebuild_mma_whole<DT, TT>(work, L, sh.r, x_s);
                if (fast_rope) rope_fast_apply(rr, x_s, L.ldx, tok_s, TT, D, Ks, L.lds);
                else rope_rows(x_s, L.ldx, tok_s, TT, D, sh, Ks, L.lds, true);
            }
        }
        if (!L.whole) {
            cp_async_commit();
            rebuild_tile<DT>(work, L, sh, sq.u, sq.w, h, tok_s, x_s);
            rope_rows(x_s, L.ldx, tok_s, TT, D, sh, Ks, L.lds, true);
        }
        cp_async_wait_all();
        __syncthreads();
        float *pb = a.pbuf && host ? a.pbuf + head0 * SC + t0 : nullptr;
        att_tile<GC>(L, a.scale_log2, Ks, Vs, q_s, spart, p_s, alpha_s, miss_s, nvalid, st, pb, SC);
        att_finish<GC>(L, D, st, red, ml_s, acc_out, acc_stride, ml_out, ml_stride);
    } else {
        /* a range of the resident spans */
        const int r = item - a.it.n_sel;
        if (tid == 0) nsp_s = att_resident_spans(a, b, h, sp_s);
        if (tid < TT) miss_s[tid] = 0;
        __syncthreads();
        const int nsp = nsp_s;
        const int64_t T = nsp ? sp_s[nsp - 1].end : 0;
        const int64_t per = ceil_div64(ceil_div64(T, a.it.n_res), TT) * TT;
        const int64_t t0 = (int64_t)r * per, t1 = t0 + per < T ? t0 + per : T;
        int cur = 0;
        for (int64_t tile0 = t0; tile0 < t1; tile0 += TT) {
            att_load_span_tile(Ks, Vs, L, D, sp_s, cur, tile0, t1);
            cp_async_commit();
            cp_async_wait_all();
            __syncthreads();
            const int nvalid = (int)(t1 - tile0 < TT ? t1 - tile0 : TT);
            att_tile<GC>(L, a.scale_log2, Ks, Vs, q_s, spart, p_s, alpha_s, miss_s, nvalid, st, nullptr, 0);
            __syncthreads(); /* Ks/Vs are refilled by the next tile */
        }
        att_finish<GC>(L, D, st, red, ml_s, acc_out, acc_stride, ml_out, ml_stride);
    }
    pdl_trigger();
}

} /* namespace */

/* ================================================================================================
 * Launchers (skv_cuda.h)
 * ============================================================================================= */

template <int DT>
static AttendKernel pick_attend_gc(int gc)
{
    switch (gc) {
    case 8: return attend_kernel<DT, 8>;
    case 4: return attend_kernel<DT, 4>;
    case 2: return attend_kernel<DT, 2>;
    default: return attend_kernel<DT, 1>;
    }
}

static AttendKernel pick_attend(int DT, int gc)
{
    switch (DT) {
    case 64: return pick_attend_gc<64>(gc);
    case 128: return pick_attend_gc<128>(gc);
    case 256: return pick_attend_gc<256>(gc);
    default: return pick_attend_gc<0>(gc);
    }
}

skv_cuda_items skv_cuda_decode_items(const skv_cuda_shape *sh, int64_t max_resident)
{
    skv_cuda_items it;
    it.tt = att_tt(att_dt(sh->D));
    it.n_sel = (int32_t)ceil_div64((int64_t)sh->S * sh->c, it.tt);
    const int64_t one = ceil_div64(max_resident, it.tt); /* items of one tile each */
    it.frag = mm_shape_ok(sh) && it.tt == kMmTT && one <= kMmMaxRes;
    int64_t r = it.frag ? one : ceil_div64(max_resident, 4 * (int64_t)it.tt);
    it.n_res = (int32_t)(r < 1 ? 1 : it.frag ? r : r > 64 ? 64 : r);
    it.n_items = it.n_sel + it.n_res;
    return it;
}

skv_cuda_items skv_cuda_span_items(int32_t B, int32_t Hq, int32_t Hk, int32_t D, int64_t total)
{
    skv_cuda_items it;
    it.tt = att_tt(att_dt(D));
    it.n_sel = 0;
    it.frag = 0;
    const int G = Hq / Hk;
    const int64_t ctas = (int64_t)B * Hk * (G / att_gc(G));
    int64_t s = ceil_div64((int64_t)3 * num_sms(), ctas);
    const int64_t by_min = total / 64, by_max = ceil_div64(total, 4096);
    if (s > by_min) s = by_min;
    if (s < by_max) s = by_max;
    if (s < 1) s = 1;
    if (s > kMaxSplits) s = kMaxSplits;
    it.n_res = (int32_t)s;
    it.n_items = it.n_res;
    return it;
}

static cudaError_t launch_attend(cudaStream_t st, const AttendArgs &a, int B, int n_items, int pdl)
{
    if (a.D <= 0 || a.D > 1024 || a.D % 2) return cudaErrorInvalidValue;
    const int gc = att_gc(a.G), DT = att_dt(a.D);
    if ((int64_t)a.Hk * a.nqc > 65535 || B > 65535) return cudaErrorInvalidValue;
    const AttendKernel k = pick_attend(DT, gc);
    const size_t smem = att_layout(a.D, DT, gc, a.sh.r).bytes;
    cudaError_t e = allow_smem(k, smem);
    if (e != cudaSuccess) return e;
    return launch(k, dim3((unsigned)n_items, (unsigned)(a.Hk * a.nqc), (unsigned)B), dim3(kAtNT), smem, st, pdl != 0,
                  a);
}

cudaError_t skv_cuda_attend(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                            const skv_cuda_dws *ws, int pdl)
{
    if (sh->B <= 0 || sh->Hq <= 0 || sh->Hk <= 0) return cudaSuccess;
    if (seqs && ws->it.frag) return skv_cuda_attend_mma(st, sh, seqs, ws, pdl);
    const AttendArgs a = attend_args(sh, seqs, ws);
    return launch_attend(st, a, sh->B, ws->it.n_items, pdl);
}

cudaError_t skv_cuda_span_attention(cudaStream_t st, int32_t Hq, int32_t Hk, int32_t D, float scale,
                                    const skv_bf16 *q, int32_t n_spans, const skv_kv_span *spans, float *out,
                                    const skv_cuda_dws *ws)
{
    if (Hq <= 0 || Hk <= 0 || n_spans <= 0) return cudaSuccess;
    if (n_spans > SKV_MAX_SPANS) return cudaErrorInvalidValue;
    skv_cuda_shape sh;
    memset(&sh, 0, sizeof sh);
    sh.B = 1, sh.Hq = Hq, sh.Hk = Hk, sh.D = D, sh.scale = scale;
    AttendArgs a = attend_args(&sh, NULL, ws);
    a.seqs = NULL;
    a.io = NULL;
    a.q = q;
    a.pbuf = NULL;
    a.n_spans = n_spans;
    for (int i = 0; i < n_spans; i++) a.spans[i] = spans[i];
    cudaError_t e = launch_attend(st, a, 1, ws->it.n_items, 0);
    if (e != cudaSuccess) return e;
    return skv_cuda_combine(st, &sh, NULL, ws, out, 1);
}
