/*
 * skv_cuda_attend.cu - step 4 of a decode (skv_cuda_attend; pipeline step "4 attend" of
 * skv_cuda.h, reached from the cache's decode step in skv_cuda_backend.cu) on its two kernels:
 * the general one (attend_kernel<DT, GC>: any even D up to 1024, any G, any RoPE) and, for the
 * common shape, the fragment kernel (attend_mma_kernel, skv_cuda_items.frag); the op-level span
 * attention (skv_cuda_span_attention, the sparse_attention slot of the dispatch table: the general
 * kernel over the caller's spans, then skv_cuda_combine); the op-level key rebuild
 * (skv_cuda_rebuild, the rebuild_keys slot of the dispatch table: rebuild_kernel<DT>,
 * k_out [Hk, S*c, D] = RoPE(U W_h) of the given chunks with the tile rebuild of step 4); and the
 * work-item plans (skv_cuda_decode_items, skv_cuda_span_items). The three kernels share the tile
 * rebuild and the resident spans of skv_cuda_attn.cuh and stay in one file: compiled apart, the
 * compiler inlines those helpers differently and the fragment kernel's and rebuild_kernel's
 * machine code changes (dev/sass_diff.sh shows it).
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
 *
 * The decode attention on tensor-core fragments (D = 128, r % 16 == 0, G <= 8, rotate-half RoPE
 * over all of D, and every item one tile of at most 64 tokens: skv_cuda_items.frag): the
 * common shape, with the same work items and partials as attend_kernel.
 *
 * A CTA is one (sequence b, KV head h) and a contiguous range of its items; W_h stays in shared
 * memory for the whole range. Its 16 warps form four groups of 4; group q takes the range's
 * items q, q + 4, ..., each one tile: the group loads the tile (cp.async), then warp w of the
 * group works on tokens 16w .. 16w + 15, everything in mma fragments: the rebuild
 * K_pre = U W_h (m16n8k16 bf16, float accumulate), RoPE on the accumulators (the pair
 * (i, i + 64) sits in the same thread), K rounded to bf16 and used in place as the B operand of
 * S^T = Q K^T (query heads are the rows), and P (split exactly into three bf16 parts,
 * hi + mid + lo, so the weights keep all 24 bits) as the B operand of O^T = V^T P^T. The group
 * shares the item's max per head (one barrier); the warps' sums and O are added in warp order,
 * so the result has the same bits whatever runs first. Four groups per SM hide each other's load
 * latency.
 *
 * fp8 values (sh.value_dtype, skv_cuda_fp8.cuh) are decoded into the bf16 V tile as they land:
 * the general kernel converts 8 codes per load, the fragment kernel (attend_mma_kernel<true>)
 * copies a selected row's codes (cp.async) into the upper half of its V row and converts them in
 * place before P V; everything after the tile is the bf16 path's.
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
    if (a.seqs && a.seqs[b].idle) return; /* an idle row: no partials (the combine skips it) */

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
        const int64_t KC = att_sel_tokens(a, b, h); /* this head's selected tokens (<= SC) */
        const int nvalid = (int)(KC - t0 < TT ? KC - t0 : TT);
        if (nvalid <= 0) { /* past the head's k chunks: an empty partial (block-uniform) */
            cp_async_wait_all(); /* W_h's copies, if issued */
            for (int i = tid; i < GC * D; i += kAtNT) acc_out[(i / D) * acc_stride + i % D] = 0.0f;
            if (tid < GC) ml_out[tid * ml_stride] = make_float2(-INFINITY, 0.0f);
            pdl_trigger();
            return;
        }
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
            const unsigned char *rec = host ? sq.vc_data + ((int64_t)h * sh.vc_chunks + (a.vsrc[bh * S + s] & 0x7fffffff)) * sh.vrec
                                            : sq.vstore + ((int64_t)h * sq.n_cand + a.sel_idx[bh * S + s]) * sh.vrec;
            const int left = D - cc * 8;
            if (sh.value_dtype == SKV_VALUE_FP8) { /* decoded here (block-uniform) */
                fp8_load8_bf16(dv, fp8_row(rec, i, D) + cc * 8, left, fp8_exp(rec, i, c, D));
                continue;
            }
            const uint16_t *src = reinterpret_cast<const uint16_t *>(rec) + (int64_t)i * D;
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

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *p)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void *p)
{
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

/* d += A B, m16n8k16, bf16 in, float accumulate. */
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* Two floats rounded to bf16 (to nearest even, as skv_f32_to_bf16 does for every non-NaN
   value) and packed, lo in the low half: one cvt instruction. */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    uint32_t d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ void group_bar(int q) { asm volatile("bar.sync %0, %1;\n" ::"r"(q + 1), "r"(kMmGroupNT) : "memory"); }


struct MmCtx {
    int b, h, n_sel;
    int64_t T; /* resident tokens of (b, h); resident item i covers [64 i, 64 i + 64) */
};

/* Where one row (token) of an item comes from: its position (-1: none), the source of its U row
   (selected) or K row (resident; NULL: zeros), its V row (NULL: zeros; a selected row of fp8 values:
   its codes), and whether its P V waits for the fetch of a missed chunk (miss 1; a selected row of
   fp8 values that is not missed: its exponent k in bits 8.., miss = k * 256). */
struct MmRow {
    int64_t pos;
    const uint16_t *uk, *v;
    int miss;
};

/* The selected tokens k c of the CTA's (b, h): waits for the selection (the count comes from step 3). */
__device__ __forceinline__ int64_t mm_sel_tokens(const AttendArgs &a, const MmCtx &c)
{
    pdl_wait();
    return att_sel_tokens(a, c.b, c.h);
}

/* An item with nothing to load: a resident item past the resident tokens (all later ones are too),
   or a selected item past the head's k chunks (its test waits for the selection). */
__device__ __forceinline__ bool mm_empty(const AttendArgs &a, const MmCtx &c, int item)
{
    if (item < c.n_sel) return (int64_t)item * kMmTT >= mm_sel_tokens(a, c);
    return (int64_t)(item - c.n_sel) * kMmTT >= c.T;
}

/* The sources of row `row` of item `item` (the selection lookups; no shared memory written). FP8:
   the cache's values are fp8 records (a selected row's v is its codes). */
template <bool FP8>
__device__ MmRow mm_lookup(const AttendArgs &a, const MmCtx &c, int item, int row, const AttSpan *sp)
{
    MmRow m;
    m.pos = -1;
    m.uk = m.v = nullptr;
    m.miss = 0;
    if (item < c.n_sel) {
        pdl_wait(); /* the selection comes from the previous kernel (resident items do not wait) */
        const skv_cuda_shape &sh = a.sh;
        const skv_cuda_seq &sq = a.seqs[c.b];
        const int32_t cc = sh.c, S = sh.S;
        const int32_t ts = item * kMmTT + row;
        const int64_t bh = (int64_t)c.b * a.Hk + c.h;
        if (ts < att_sel_tokens(a, c.b, c.h)) { /* the head's k chunks (k <= S) */
            const int32_t s = ts / cc, i = ts - s * cc;
            m.pos = (int64_t)a.sel_ids[bh * S + s] * cc + i;
            m.uk = sq.u + m.pos * sh.r;
            const unsigned char *rec = nullptr;
            if (sq.vc_data) {
                const int32_t v = a.vsrc[bh * S + s];
                m.miss = v < 0 && a.pbuf; /* missed: its P V comes after the fetch */
                if (!m.miss) rec = sq.vc_data + ((int64_t)c.h * sh.vc_chunks + (v & 0x7fffffff)) * sh.vrec;
            } else {
                rec = sq.vstore + ((int64_t)c.h * sq.n_cand + a.sel_idx[bh * S + s]) * sh.vrec;
            }
            if (FP8 && rec) { /* the codes (read as bytes), the exponent now */
                m.v = reinterpret_cast<const uint16_t *>(fp8_row(rec, i, kMmD));
                m.miss = fp8_exp(rec, i, cc, kMmD) * 256;
            } else if (rec) {
                m.v = reinterpret_cast<const uint16_t *>(rec) + (int64_t)i * kMmD;
            }
        }
    } else {
        const int64_t t = (int64_t)(item - c.n_sel) * kMmTT + row;
        if (t < c.T) {
            int cur = 0;
            while (t >= sp[cur].end) cur++;
            const int64_t off = (t - sp[cur].start) * sp[cur].stride;
            m.uk = sp[cur].k + off;
            m.v = sp[cur].v + off;
        }
    }
    return m;
}

/* Issue (cp.async, not committed) the U or K row of m into the warp's block (row rw of 16), and
   its token and miss flag into the item parity's rows; the RoPE table rows go to L2. */
__device__ __forceinline__ void mm_issue_uk(const AttendArgs &a, const MmLayout &L, uint16_t *UKw, int64_t *tok,
                                            int32_t *miss, int item_sel, int r, int row, int rw, int half,
                                            const MmRow &m)
{
    mm_copy_row(UKw + rw * L.ldk, m.uk, item_sel ? r / 8 : kMmD / 8, half);
    if (half == 0) {
        tok[row] = m.pos;
        miss[row] = m.miss;
        if (m.pos >= 0) {
            const skv_cuda_shape &sh = a.sh;
            prefetch_l2(sh.cos_tab + m.pos * (kMmD / 2));
            prefetch_l2(sh.cos_tab + m.pos * (kMmD / 2) + 32);
            prefetch_l2(sh.sin_tab + m.pos * (kMmD / 2));
            prefetch_l2(sh.sin_tab + m.pos * (kMmD / 2) + 32);
        }
    }
}

/* Item at position p of CTA x's list (of `split` CTAs per pair): its resident items (every
   split-th from x), then its selected items (likewise). */
__device__ __forceinline__ int mm_item(const MmCtx &c, int x, int split, int nr_x, int p)
{
    return p < nr_x ? c.n_sel + x + p * split : x + (p - nr_x) * split;
}

template <bool FP8> /* the values are fp8 records (sh.value_dtype): decoded in shared memory */
__global__ void __launch_bounds__(kMmNT, 1) attend_mma_kernel(const __grid_constant__ AttendArgs a, int split)
{
    __shared__ AttSpan sp_s[SKV_MAX_SPANS];
    __shared__ int64_t T_s;
    __shared__ float red_m[kMmGroups][4][kMmMaxG], red_l[kMmGroups][4][kMmMaxG];
    const skv_cuda_shape &sh = a.sh;
    const MmLayout L = mm_layout(sh.r);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, q = warp >> 2, w = warp & 3, qt = tid & 127;
    const int g = lane >> 2, t = lane & 3;
    const int b = blockIdx.z, h = blockIdx.y;
    const int G = a.G, r = sh.r;
    if (a.seqs && a.seqs[b].idle) return; /* an idle row: no partials (the combine skips it) */
    /* the rows a thread copies: its warp's own 16 (two threads per row), so that a warp's waits
       cover everything it reads of the stage (no group barrier for the loads) */
    const int rw = lane & 15, row = 16 * w + rw, half = lane >> 4;
    uint16_t *Ws = reinterpret_cast<uint16_t *>(skv_attn_smem);
    unsigned char *st = skv_attn_smem + L.off_groups + q * L.stage_bytes;
    uint16_t *UKw = reinterpret_cast<uint16_t *>(st) + 16 * w * L.ldk;
    uint16_t *Vs = reinterpret_cast<uint16_t *>(st + L.off_v);
    int64_t *tok_s = reinterpret_cast<int64_t *>(st + L.off_tok);  /* [2][64] */
    int32_t *miss_s = reinterpret_cast<int32_t *>(st + L.off_miss); /* [2][64] */

    MmCtx c;
    c.b = b;
    c.h = h;
    c.n_sel = a.it.n_sel;
    /* CTA x takes every split-th item, its resident ones first: those need nothing of this
       step's selection, so they run while the selection finishes (the kernel is launched as a
       dependent; only the selected items' lookups wait for it) */
    const int x = blockIdx.x, n_res = a.it.n_items - c.n_sel;
    const int nr_x = n_res > x ? (n_res - x + split - 1) / split : 0;
    const int ns_x = c.n_sel > x ? (c.n_sel - x + split - 1) / split : 0;
    const int n_x = nr_x + ns_x;

    /* W_h: nothing a step writes */
    {
        const uint16_t *Wh = a.seqs[b].w + (int64_t)h * kMmD;
        const int64_t ldW = (int64_t)a.Hk * kMmD;
        if (((uintptr_t)a.seqs[b].w & 15) == 0) {
            for (int idx = tid; idx < r * (kMmD / 8); idx += kMmNT) {
                const int k = idx >> 4, p = idx & 15;
                cp_async16(Ws + k * kMmLdv + p * 8, Wh + (int64_t)k * ldW + p * 8);
            }
        } else {
            for (int idx = tid; idx < r * (kMmD / 8); idx += kMmNT) {
                const int k = idx >> 4, p = idx & 15;
                load8_slow(Ws + k * kMmLdv + p * 8, Wh + (int64_t)k * ldW + p * 8, 8);
            }
        }
    }
    /* the spans and q: written before the selection kernel started (it launches this kernel
       only after its own wait) */
    if (tid == 0) {
        const int n = att_resident_spans(a, b, h, sp_s);
        T_s = n ? sp_s[n - 1].end : 0;
    }
    __syncthreads();
    c.T = T_s;

    /* Q of the group as A fragments (rows = query heads; rows >= G are zero) */
    const int64_t head0 = (int64_t)b * a.Hq + (int64_t)h * G;
    uint32_t qa[8][2];
    {
        const uint16_t *qin = (const uint16_t *)a.io->q + head0 * kMmD;
#pragma unroll
        for (int kd = 0; kd < 8; kd++) {
            uint32_t lo = 0, hi = 0;
            if (g < G) {
                const uint16_t *p = qin + g * kMmD + 16 * kd + 2 * t;
                lo = (uint32_t)p[0] | ((uint32_t)p[1] << 16);
                hi = (uint32_t)p[8] | ((uint32_t)p[9] << 16);
            }
            qa[kd][0] = lo;
            qa[kd][1] = hi;
        }
    }
    cp_async_wait_all();
    __syncthreads(); /* W_h */

    const float scl = a.scale_log2;
    const int64_t SC = (int64_t)sh.S * sh.c;
    /*
     * Per item, with the next item of the group (nx) loading behind it: its rows' lookups first
     * (in flight during the rebuild), its U / K rows once this warp has read its own, its V rows
     * once the group has read the item's partial (which sits in the V rows). cp.async groups per
     * thread, in commit order: U/K(item), V(item), U/K(nx), V(nx); wait_group 1 before the
     * rebuild leaves V(item) in flight, wait_group 1 before P V leaves U/K(nx) in flight. An
     * item that nothing prefetched (the first, or one after an empty item) is issued in place,
     * with an empty group after it for the same count.
     */
    bool issued = false;
    constexpr bool fp8 = FP8;
    for (int pi = q, par = 0; pi < n_x; pi += kMmGroups, par ^= 1) {
        const int item = mm_item(c, x, split, nr_x, pi);
        if (mm_empty(a, c, item)) {
            /* an empty resident item (the generated region not yet filled): an empty partial,
               no loads and no barrier (group-uniform) */
            float *acc_out = a.part_acc + (head0 * a.it.n_items + item) * kMmD;
            for (int i = qt; i < G * kMmD; i += kMmGroupNT)
                acc_out[(i >> 7) * (int64_t)a.it.n_items * kMmD + (i & (kMmD - 1))] = 0.0f;
            if (qt < G) a.part_ml[(head0 + qt) * a.it.n_items + item] = make_float2(-INFINITY, 0.0f);
            issued = false;
            continue;
        }
        if (!issued) {
            const MmRow m = mm_lookup<FP8>(a, c, item, row, sp_s);
            mm_issue_uk(a, L, UKw, tok_s + par * kMmTT, miss_s + par * kMmTT, item < c.n_sel, r, row, rw, half, m);
            mm_copy_v(Vs + row * kMmLdv, m.v, half, fp8 && item < c.n_sel);
            cp_async_commit();
            cp_async_commit();
        }
        const int nx = pi + kMmGroups < n_x ? mm_item(c, x, split, nr_x, pi + kMmGroups) : -1;
        /* not across the step from resident to selected items: that lookup waits for the
           selection, and this item does not */
        const bool has_nx = nx >= 0 && !(item >= c.n_sel && nx < c.n_sel) && !mm_empty(a, c, nx);
        issued = has_nx;
        MmRow mn;
        if (has_nx) mn = mm_lookup<FP8>(a, c, nx, row, sp_s);
        const int64_t *tok = tok_s + par * kMmTT;
        const int32_t *miss = miss_s + par * kMmTT;
        cp_async_wait_group<1>();
        __syncwarp(); /* the warp's U / K rows of the item */
        const bool sel = item < c.n_sel;
        int nvalid;
        float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        if (sel) {
            const int64_t KC = att_sel_tokens(a, c.b, c.h); /* read after the selection: mm_empty waited */
            nvalid = (int)(KC - (int64_t)item * kMmTT < kMmTT ? KC - (int64_t)item * kMmTT : kMmTT);
            /* rebuild: acc[j] = rows 16w + (g, g + 8), columns 8j + 2t, +1 */
            float acc[16][4];
#pragma unroll
            for (int j = 0; j < 16; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
            const uint16_t *ua = UKw + (lane & 15) * L.ldk + (lane >> 4) * 8;
            const uint16_t *wb = Ws + ((lane & 7) + ((lane >> 3) & 1) * 8) * kMmLdv + (lane >> 4) * 8;
#pragma unroll 2
            for (int kk = 0; kk < r; kk += 16) {
                uint32_t af[4];
                ldsm_x4(af, ua + kk);
#pragma unroll
                for (int np = 0; np < 8; np++) {
                    uint32_t bf[4];
                    ldsm_x4_t(bf, wb + kk * kMmLdv + np * 16);
                    mma_bf16(acc[2 * np], af[0], af[1], af[2], af[3], bf[0], bf[1]);
                    mma_bf16(acc[2 * np + 1], af[0], af[1], af[2], af[3], bf[2], bf[3]);
                }
            }
            const int64_t p0 = tok[16 * w + g], p1 = tok[16 * w + g + 8];
            __syncwarp(); /* the warp's U rows read: the next item's may land */
            if (has_nx) mm_issue_uk(a, L, UKw, tok_s + (par ^ 1) * kMmTT, miss_s + (par ^ 1) * kMmTT, nx < c.n_sel, r,
                                    row, rw, half, mn);
            cp_async_commit();
            /* RoPE: pair i = 8j + 2t + e of rows g and g + 8 is (acc[j], acc[j + 8]); the table rows
               were prefetched into L2 when the rows were issued */
            const float *c0 = sh.cos_tab + (p0 < 0 ? 0 : p0) * (kMmD / 2) + 2 * t;
            const float *s0 = sh.sin_tab + (p0 < 0 ? 0 : p0) * (kMmD / 2) + 2 * t;
            const float *c1 = sh.cos_tab + (p1 < 0 ? 0 : p1) * (kMmD / 2) + 2 * t;
            const float *s1 = sh.sin_tab + (p1 < 0 ? 0 : p1) * (kMmD / 2) + 2 * t;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float2 ca = __ldg(reinterpret_cast<const float2 *>(c0 + 8 * j));
                const float2 sa = __ldg(reinterpret_cast<const float2 *>(s0 + 8 * j));
                const float2 cb = __ldg(reinterpret_cast<const float2 *>(c1 + 8 * j));
                const float2 sb = __ldg(reinterpret_cast<const float2 *>(s1 + 8 * j));
                skv_rope_rotate(acc[j][0], acc[j + 8][0], ca.x, sa.x, &acc[j][0], &acc[j + 8][0]);
                skv_rope_rotate(acc[j][1], acc[j + 8][1], ca.y, sa.y, &acc[j][1], &acc[j + 8][1]);
                skv_rope_rotate(acc[j][2], acc[j + 8][2], cb.x, sb.x, &acc[j][2], &acc[j + 8][2]);
                skv_rope_rotate(acc[j][3], acc[j + 8][3], cb.y, sb.y, &acc[j][3], &acc[j + 8][3]);
            }
            /* S^T = Q K^T with K (bf16) straight from the accumulators */
#pragma unroll
            for (int kd = 0; kd < 8; kd++) {
                mma_bf16(sc[0], qa[kd][0], 0u, qa[kd][1], 0u, pack_bf16(acc[2 * kd][0], acc[2 * kd][1]),
                         pack_bf16(acc[2 * kd + 1][0], acc[2 * kd + 1][1]));
                mma_bf16(sc[1], qa[kd][0], 0u, qa[kd][1], 0u, pack_bf16(acc[2 * kd][2], acc[2 * kd][3]),
                         pack_bf16(acc[2 * kd + 1][2], acc[2 * kd + 1][3]));
            }
        } else {
            const int64_t t0 = (int64_t)(item - c.n_sel) * kMmTT;
            nvalid = (int)(c.T - t0 <= 0 ? 0 : c.T - t0 < kMmTT ? c.T - t0 : kMmTT);
            const uint16_t *kb = UKw + ((lane & 7) + ((lane >> 4) << 3)) * L.ldk + ((lane >> 3) & 1) * 8;
#pragma unroll
            for (int kd = 0; kd < 8; kd++) {
                uint32_t bf[4];
                ldsm_x4(bf, kb + 16 * kd);
                mma_bf16(sc[0], qa[kd][0], 0u, qa[kd][1], 0u, bf[0], bf[1]);
                mma_bf16(sc[1], qa[kd][0], 0u, qa[kd][1], 0u, bf[2], bf[3]);
            }
            __syncwarp(); /* the warp's K rows read */
            if (has_nx) mm_issue_uk(a, L, UKw, tok_s + (par ^ 1) * kMmTT, miss_s + (par ^ 1) * kMmTT, nx < c.n_sel, r,
                                    row, rw, half, mn);
            cp_async_commit();
        }
        /* scores (log2 domain), masked past nvalid; the item's max per head over the group */
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int tk = 16 * w + 8 * nt + 2 * t + e;
                sc[nt][e] = tk < nvalid ? sc[nt][e] * scl : -INFINITY;
                mx = fmaxf(mx, sc[nt][e]);
            }
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
        if (t == 0) red_m[q][w][g] = mx;
        group_bar(q);
        float m = red_m[q][0][g];
#pragma unroll
        for (int v = 1; v < 4; v++) m = fmaxf(m, red_m[q][v][g]);
        float ps = 0.0f;
        uint32_t ph[2], pm[2], pl[2];
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            float p[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                p[e] = m == -INFINITY ? 0.0f : exp2f(sc[nt][e] - m);
                ps += p[e];
            }
            /* p = hi + mid + lo exactly: three bf16 of 8 significant bits each hold its 24 */
            const uint32_t hi = pack_bf16(p[0], p[1]);
            const float r0 = p[0] - __uint_as_float(hi << 16);
            const float r1 = p[1] - __uint_as_float(hi & 0xffff0000u);
            const uint32_t mid = pack_bf16(r0, r1);
            ph[nt] = hi;
            pm[nt] = mid;
            pl[nt] = pack_bf16(r0 - __uint_as_float(mid << 16), r1 - __uint_as_float(mid & 0xffff0000u));
            if (sel && a.pbuf && g < G) { /* weights of deferred tokens for the missed pass */
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int tk = 16 * w + 8 * nt + 2 * t + e;
                    if (tk < nvalid && (fp8 ? miss[tk] & 1 : miss[tk])) a.pbuf[(head0 + g) * SC + (int64_t)item * kMmTT + tk] = p[e];
                }
            }
        }
        ps += __shfl_xor_sync(kFullMask, ps, 1);
        ps += __shfl_xor_sync(kFullMask, ps, 2);
        cp_async_wait_group<1>();
        __syncwarp(); /* the warp's V rows of the item */
        if (fp8 && sel) mm_decode_row(Vs + row * kMmLdv, half, miss[row] >> 8); /* group-uniform; k from the row's lookup */
        /* O^T = V^T P^T (A: V^T from V rows 16w .. 16w + 15; B: P, which is S^T's layout);
           m-tile i: dims 16i + g, 16i + g + 8; heads 2t, 2t + 1 */
        float o[8][4];
        const uint16_t *vb = Vs + (16 * w + (lane & 7) + (lane >> 4) * 8) * kMmLdv + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int mt = 0; mt < 8; mt++) {
            uint32_t af[4];
            ldsm_x4_t(af, vb + mt * 16);
            o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.0f;
            mma_bf16(o[mt], af[0], af[1], af[2], af[3], pl[0], pl[1]); /* smallest first */
            mma_bf16(o[mt], af[0], af[1], af[2], af[3], pm[0], pm[1]);
            mma_bf16(o[mt], af[0], af[1], af[2], af[3], ph[0], ph[1]);
        }
        __syncwarp(); /* the warp's V rows read: its partial goes there */
        /* the item's partial: warp ww's O in its own V rows (G x 128 floats fit in 16 rows),
           added in warp order */
        float *red = reinterpret_cast<float *>(Vs + 16 * w * kMmLdv);
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int hd = 2 * t + (e & 1), d = 16 * j + g + (e >> 1) * 8;
                if (hd < G) red[hd * kMmD + d] = o[j][e];
            }
        if (g < G && t == 0) red_l[q][w][g] = ps;
        group_bar(q);
        float *acc_out = a.part_acc + (head0 * a.it.n_items + item) * kMmD;
        const int64_t acc_stride = (int64_t)a.it.n_items * kMmD;
        for (int i = qt; i < G * kMmD; i += kMmGroupNT) {
            float v = reinterpret_cast<const float *>(Vs)[i];
#pragma unroll
            for (int ww = 1; ww < 4; ww++) v += reinterpret_cast<const float *>(Vs + 16 * ww * kMmLdv)[i];
            acc_out[(i >> 7) * acc_stride + (i & (kMmD - 1))] = v;
        }
        if (qt < G) {
            float l = red_l[q][0][qt], mq = red_m[q][0][qt];
#pragma unroll
            for (int ww = 1; ww < 4; ww++) l += red_l[q][ww][qt], mq = fmaxf(mq, red_m[q][ww][qt]);
            a.part_ml[(head0 + qt) * a.it.n_items + item] = make_float2(mq, l);
        }
        group_bar(q); /* the partials, red_m and red_l read before they are rewritten */
        if (has_nx) mm_copy_v(Vs + row * kMmLdv, mn.v, half, fp8 && nx < c.n_sel);
        cp_async_commit();
    }
    cp_async_wait_all();
    pdl_trigger();
}

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
    /* at most 64 ranges of resident tokens, or 256 for a dense layer's step (S = 0: its prompt is resident,
       the work of a dense decode step, split over the tokens like the selected span) */
    const int64_t cap = sh->S == 0 ? 256 : 64;
    it.n_res = (int32_t)(r < 1 ? 1 : it.frag ? r : r > cap ? cap : r);
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

/* Step 4 on the fragment kernel (a decode whose items are fragment items, ws->it.frag). */
static cudaError_t attend_mma(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                              const skv_cuda_dws *ws, int pdl)
{
    const AttendArgs a = attend_args(sh, seqs, ws);
    /* one CTA per multiprocessor and about one item per group: (b, h) pairs split into
       ranges of items, at least one item per group */
    const int64_t pairs = (int64_t)sh->B * sh->Hk, n_items = ws->it.n_items;
    int64_t split = num_sms() / pairs; /* CTAs per pair: one wave (one CTA per SM fits) */
    if (split < 1) split = 1;
    if (split > ceil_div64(n_items, kMmGroups)) split = ceil_div64(n_items, kMmGroups); /* a few items per group */
    if (split < 1) split = 1;
    const size_t smem = mm_layout(sh->r).bytes;
    const auto k = sh->value_dtype == SKV_VALUE_FP8 ? attend_mma_kernel<true> : attend_mma_kernel<false>;
    cudaError_t e = allow_smem(k, smem);
    if (e != cudaSuccess) return e;
    return launch(k, dim3((unsigned)split, (unsigned)sh->Hk, (unsigned)sh->B), dim3(kMmNT), smem,
                  st, pdl != 0, a, (int)split);
}

cudaError_t skv_cuda_attend(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                            const skv_cuda_dws *ws, int pdl)
{
    if (sh->B <= 0 || sh->Hq <= 0 || sh->Hk <= 0) return cudaSuccess;
    if (seqs && ws->it.frag) return attend_mma(st, sh, seqs, ws, pdl);
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
