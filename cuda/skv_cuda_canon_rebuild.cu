/*
 * skv_cuda_canon_rebuild.cu - the reproducible mode's canonical key rebuild (docs/DESIGN.md 10.2):
 * at op level skv_cuda_canon_rebuild (the rebuild_keys_canonical slot of the dispatch table: the
 * keys into k_out), at decode skv_cuda_canon_decode_rebuild (the cache's decode step, in
 * skv_cuda_backend.cu, after step 3: the selected keys are not stored, the kernel scores them
 * into the workspace's canon_e). Kernels: canon_rebuild_tc_kernel<KS, RM, SPL> (int8 tensor
 * cores, reading W's prepared form from skv_cuda_canon_wprep.cu) and canon_rebuild_scalar_kernel
 * (exact int64 sums: r > 256, or shared memory that does not fit). Also skv_cuda_canon_uses_wq
 * (which of the two a shape takes) and the test hook of the decode rebuild's split form
 * (skv_cuda_canon_test_split), and the rescoring's keys of the candidates (skv_cuda_canon_rescore_keys,
 * docs/DESIGN.md 4.5.1: the op-level form into the workspace, with per-head counts). Built with
 * --fmad=false (CU_EXACT).
 *
 * The tensor-core rebuild: one block per (tile of 128 selected tokens, KV head, sequence), a warp
 * per 16 tokens: each lane loads its two U rows' pieces at once (and sends the rows' cos/sin
 * lines toward L2), the row max by quad shuffles, the 13-bit fixed point (one fma, exact, four
 * elements packed into the int8 halves by byte permutes; the integer skv_canon_rebuild_fix for
 * rows below 2^-113) straight into the A fragments, and the exact sum P = 2^14 (hu.hw) + 2^7
 * (hu.lw + lu.hw) + lu.lw on int8 tensor cores (mma.sync, int32 accumulators: every partial sum
 * is exact), W's fragments from shared memory (cp.async). Then skv_canon_rebuild_key's value;
 * RoPE (skv_rope_rotate) and bf16: where both members of a lane's pairs sit in its fragments
 * (pairs (i, i + R/2) with R % 16 == 0, or interleaved pairs) in registers, two keys per
 * conversion, into bf16 staging rows; other rotary shapes through float staging rows (the pairs
 * of skv_rope_pair_index; 8 tokens' cos/sin rows in flight), in place. At op level the bf16 keys
 * go to k_out [B, Hk, S c, D]; at decode they are not stored: the warp scores its 16 tokens from
 * the staging rows (lane: token lane mod 16, query heads lane / 16, + 2, ..; s_j = scale x the
 * fmaf chain of skv_dot_bf16 in d order) into the workspace e [B, Hq, Tmax] at the selected
 * span's places. The decode step's spans are read from the device (skv_cuda_seq, the step's
 * selection, the chunk cache's entries), so the launches can be captured in the layer's graph.
 * Launchers only enqueue: no allocation, no synchronization.
 */
#include <atomic>
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

/* The four keys of n8 tile nt in a lane's fragment slots (i: row g + 8 (i >> 1), dim 8 nt + 2 t + (i & 1)):
   the three exact int32 sums hu.hw, hu.lw + lu.hw (two accumulators: two chains of KS instead of one of
   2 KS, the same integer), lu.lw by mma m16n8k32 with W's fragments from shared memory, then
   skv_canon_rebuild_key's value (rb_key_sums). */
template <int KS>
__device__ __forceinline__ void rb_tile(const uint4 *Wf, int NT, int nt, int lane, int t4, const uint32_t (&ah)[KS][4],
                                        const uint32_t (&al)[KS][4], const int *ew, const int (&eu)[2], float (&kv)[4])
{
    int c1[4] = {0, 0, 0, 0}, c2[4] = {0, 0, 0, 0}, c2b[4] = {0, 0, 0, 0}, c3[4] = {0, 0, 0, 0};
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        const uint4 w = Wf[((size_t)ks * NT + nt) * 32 + lane];
        mma_s8(c1, ah[ks], w.x, w.y);
        mma_s8(c2, ah[ks], w.z, w.w);
        mma_s8(c2b, al[ks], w.x, w.y);
        mma_s8(c3, al[ks], w.z, w.w);
    }
    const int d = nt * 8 + 2 * t4;
    const int ed[2] = {ew[d], ew[d + 1]};
#pragma unroll
    for (int i = 0; i < 4; i++) kv[i] = rb_key_sums(c1[i], c2[i] + c2b[i], c3[i], eu[i >> 1] + ed[i & 1] - 24);
}

/* grid (tiles of 128 tokens, Hk, B), 256 threads, KS = Kp / 32 k steps, RM the RoPE mode (rb_rope_mode).
   Warp w owns tokens 16 w .. +15 of the tile: lane (g, t) loads U rows g and g + 8 (their chunk ids
   first, then every 8-byte piece of both rows at once), puts them in fixed point (the row max by quad
   shuffles) straight into the A fragments (row major: register 0 row g, k = 4 t + j; 1 row g + 8; 2 row
   g, k = 16 + 4 t + j; 3 row g + 8), then per n8 tile of dims the keys (rb_tile). RM 0: the float keys
   into the warp's staging rows, then RoPE + bf16 per row with the cos/sin rows of 8 tokens loaded at
   once, in place. RM 1, 2: RoPE on the fragments in registers (a lane holds both members of its
   pairs), bf16 by one conversion per two keys, into the staging rows as bf16. Then the live rows into
   k_out when set; with e set (decode), the scores of the warp's live tokens from the staging rows
   (rb_score_row). SPL (RM 1, decode, R == D; rb_split): tiles of 64 tokens, warps 2 ts and 2 ts + 1 both
   own token set ts (both load and convert its rows), each takes half of the rotary pairs' tiles (np in
   [hh NP/2, (hh + 1) NP/2)), a barrier, then each scores half of the heads. smem: W's fragments, ew, the
   staging rows [128][rb_xstride] (floats or words), q [G][D] float when scoring. */
template <int KS, int RM, int SPL>
__global__ void __launch_bounds__(kRbNT, 2) canon_rebuild_tc_kernel(const RebuildArgs a)
{
    const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    /* split (RM 1 at decode): warps 2 ts and 2 ts + 1 share token set ts (half hh of its dims each) */
    static_assert(!SPL || RM == 1, "the split takes the rotary pairs of RoPE mode 1");
    constexpr int spl = SPL;
    const int ts = spl ? warp >> 1 : warp, hh = spl ? warp & 1 : 0;
    const int64_t mw = (int64_t)blockIdx.x * (spl ? kRbTok / 2 : kRbTok) + ts * 16; /* the warp's first token */
    const int64_t Mb = rb_M(a, b, h); /* the tokens of (b, h): a head with k < S chunks leaves blocks idle */
    if ((int64_t)blockIdx.x * (spl ? kRbTok / 2 : kRbTok) >= Mb) return; /* block-uniform */
    const uint16_t *u = (const uint16_t *)a.seqs[b].u;
    const int32_t *ids = a.ids + ((int64_t)b * a.Hk + h) * a.S;
    const int NT = a.Dp / 8, xst = rb_xstride(a.Dp, RM);
    const uint4 *Wf = reinterpret_cast<const uint4 *>(skv_canon_smem);
    int *ew = (int *)(skv_canon_smem + (size_t)2 * a.Kp * a.Dp);
    uint32_t *stage = (uint32_t *)(ew + a.Dp) + (size_t)ts * 16 * xst; /* 4-byte units either way */
    float *qs = (float *)(ew + a.Dp) + (size_t)kRbTok * xst;            /* [G][D] when scoring */
    __shared__ int32_t pos_s[kRbNT / 32][16]; /* a row's token position, -1 past M */
    /* the two rows' positions, then every piece of both rows in flight */
    int64_t pos[2];
    bool live[2];
#pragma unroll
    for (int rs = 0; rs < 2; rs++) {
        const int64_t m = mw + g + 8 * rs;
        live[rs] = m < Mb;
        pos[rs] = live[rs] ? rb_pos(a, ids, m) : 0;
        /* the rows' cos/sin lines toward L2 now, for the RoPE after the sums */
        if (live[rs])
            for (int i = 32 * t4; i < a.R / 2; i += 128) {
                prefetch_l2(a.cos_tab + pos[rs] * (a.R / 2) + i);
                prefetch_l2(a.sin_tab + pos[rs] * (a.R / 2) + i);
            }
    }
    uint2 raw[2][KS][2];
    if ((a.r & 3) == 0 && ((uintptr_t)u & 7) == 0) {
#pragma unroll
        for (int rs = 0; rs < 2; rs++) {
            const uint16_t *ur = u + pos[rs] * a.r;
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int q0 = 32 * ks + 16 * hf + 4 * t4;
                    raw[rs][ks][hf] = live[rs] && q0 < a.r ? *reinterpret_cast<const uint2 *>(ur + q0) : make_uint2(0, 0);
                }
        }
    } else {
#pragma unroll
        for (int rs = 0; rs < 2; rs++) {
            const uint16_t *ur = u + pos[rs] * a.r;
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const int q0 = 32 * ks + 16 * hf + 4 * t4;
                    uint32_t v[4];
#pragma unroll
                    for (int j = 0; j < 4; j++) v[j] = live[rs] && q0 + j < a.r ? ur[q0 + j] : 0u;
                    raw[rs][ks][hf] = make_uint2(v[0] | (v[1] << 16), v[2] | (v[3] << 16));
                }
        }
    }
    /* W's fragments and exponents (one copy per block, overlapping the row loads) */
    {
        const uint4 *src;
        const int *ex;
        rb_wq_at(a, b, h, src, ex);
        const int n = 2 * a.Kp * a.Dp / 16;
        for (int i = tid; i < n; i += kRbNT) cp_async16((void *)(Wf + i), src + i);
        cp_async_commit();
        for (int d = tid; d < a.Dp; d += kRbNT) ew[d] = ex[d];
        if (a.e) rb_load_q(a, b, h, qs);
    }
    if (t4 == 0 && hh == 0) {
        pos_s[ts][g] = live[0] ? (int32_t)pos[0] : -1;
        pos_s[ts][g + 8] = live[1] ? (int32_t)pos[1] : -1;
    }
    /* fixed point: the rows' exponents (max over the quad), then the A fragments */
    uint32_t ah[KS][4], al[KS][4];
    int eu[2];
#pragma unroll
    for (int rs = 0; rs < 2; rs++) {
        uint32_t mx = 0;
#pragma unroll
        for (int ks = 0; ks < KS; ks++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const uint32_t w0 = raw[rs][ks][hf].x & 0x7fff7fffu, w1 = raw[rs][ks][hf].y & 0x7fff7fffu;
                mx = max(mx, max(max(w0 & 0xffffu, w0 >> 16), max(w1 & 0xffffu, w1 >> 16)));
            }
        mx = max(mx, __shfl_xor_sync(kFullMask, mx, 1));
        mx = max(mx, __shfl_xor_sync(kFullMask, mx, 2));
        const int e = skv_canon_rebuild_ex((uint16_t)mx);
        eu[rs] = e;
        if (e >= -113) {
            const float s = rb_pow2_12(e);
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) rb_pack_fast(raw[rs][ks][hf], s, ah[ks][rs + 2 * hf], al[ks][rs + 2 * hf]);
        } else {
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    uint32_t hw = 0, lw = 0;
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const uint32_t hb = ((j < 2 ? raw[rs][ks][hf].x : raw[rs][ks][hf].y) >> (16 * (j & 1))) & 0xffffu;
                        const int32_t t = skv_canon_rebuild_fix((uint16_t)hb, e) + 64;
                        hw |= rb_hi8(t) << (8 * j);
                        lw |= rb_lo8(t) << (8 * j);
                    }
                    ah[ks][rs + 2 * hf] = hw;
                    al[ks][rs + 2 * hf] = lw;
                }
        }
    }
    cp_async_wait_all();
    __syncthreads();
    if constexpr (RM == 0) {
        float *xs = (float *)stage;
        /* per n8 tile: the keys into the staging rows (c0, c1: row g, dims 2 t, 2 t + 1; c2, c3: row g + 8) */
#pragma unroll 2
        for (int nt = 0; nt < NT; nt++) {
            float kv[4];
            rb_tile<KS>(Wf, NT, nt, lane, t4, ah, al, ew, eu, kv);
            const int d = nt * 8 + 2 * t4;
#pragma unroll
            for (int rs = 0; rs < 2; rs++)
                *reinterpret_cast<float2 *>(xs + (size_t)(g + 8 * rs) * xst + d) = make_float2(kv[2 * rs], kv[2 * rs + 1]);
        }
        __syncwarp();
        /* RoPE and bf16, in place (the staging rows then hold the bf16 keys as floats) and into k_out when
           set: dims past R pass through; the pairs with the cos/sin rows of 8 tokens in flight */
        uint16_t *kw = a.k_out ? (uint16_t *)a.k_out + (((int64_t)b * a.Hk + h) * a.M + mw) * a.D : nullptr;
        for (int rr = 0; rr < 16; rr++) {
            if (pos_s[ts][rr] < 0) continue;
            for (int d = a.R + lane; d < a.D; d += 32) {
                const uint16_t o = skv_f32_to_bf16(xs[(size_t)rr * xst + d]);
                xs[(size_t)rr * xst + d] = skv_bf16_to_f32(o);
                if (kw) kw[(int64_t)rr * a.D + d] = o;
            }
        }
        const int h2 = a.R / 2;
        for (int i0 = 0; i0 < h2; i0 += 64)
            for (int r0 = 0; r0 < 16; r0 += 8) {
                float cs[8][2], sn[8][2];
    #pragma unroll
                for (int k = 0; k < 8; k++) {
                    const int64_t p = pos_s[ts][r0 + k];
    #pragma unroll
                    for (int x = 0; x < 2; x++) {
                        const int i = i0 + lane + 32 * x;
                        const bool ok = p >= 0 && i < h2;
                        cs[k][x] = ok ? __ldg(a.cos_tab + p * h2 + i) : 0.0f;
                        sn[k][x] = ok ? __ldg(a.sin_tab + p * h2 + i) : 0.0f;
                    }
                }
    #pragma unroll
                for (int k = 0; k < 8; k++) {
                    const int rr = r0 + k;
                    if (pos_s[ts][rr] < 0) continue;
                    float *x = xs + (size_t)rr * xst;
    #pragma unroll
                    for (int xx = 0; xx < 2; xx++) {
                        const int i = i0 + lane + 32 * xx;
                        if (i >= h2) continue;
                        int pa, pb;
                        float xo, yo;
                        skv_rope_pair_index(i, a.R, a.interleaved, &pa, &pb);
                        skv_rope_rotate(x[pa], x[pb], cs[k][xx], sn[k][xx], &xo, &yo);
                        const uint16_t oa = skv_f32_to_bf16(xo), ob = skv_f32_to_bf16(yo);
                        x[pa] = skv_bf16_to_f32(oa);
                        x[pb] = skv_bf16_to_f32(ob);
                        if (kw) kw[(int64_t)rr * a.D + pa] = oa, kw[(int64_t)rr * a.D + pb] = ob;
                    }
                }
            }
        if (!a.e) return;
        __syncwarp();
        const int rr = lane & 15;
        if (pos_s[ts][rr] < 0) return;
        rb_score_warp(a, b, h, mw, xs + (size_t)rr * xst, qs);
    } else {
        /* RoPE in registers: the keys of a lane's pairs, rotated, rounded to bf16 two at a time into the
           staging words (row g + 8 rs, word 4 nt + t = dims 8 nt + 2 t, + 1) */
        uint32_t *xw = (uint32_t *)stage;
        const int h2 = a.R / 2;
        const float *cb[2] = {a.cos_tab + pos[0] * h2, a.cos_tab + pos[1] * h2};
        const float *sb[2] = {a.sin_tab + pos[0] * h2, a.sin_tab + pos[1] * h2};
        int nt0;
        if constexpr (RM == 1) {
            /* tiles np and np + R/16: the pairs (i, i + R/2), i = 8 np + 2 t + cl; the next pair's cos/sin
               loaded while this one's sums run */
            const int NP = a.R / 16, np0 = spl ? hh * (NP / 2) : 0, np1 = spl ? np0 + NP / 2 : NP;
            float2 cn[2] = {make_float2(0.f, 0.f), make_float2(0.f, 0.f)}, sn[2] = {cn[0], cn[1]};
#pragma unroll
            for (int rs = 0; rs < 2; rs++)
                if (np1 > np0)
                    cn[rs] = __ldg((const float2 *)(cb[rs] + 8 * np0 + 2 * t4)), sn[rs] = __ldg((const float2 *)(sb[rs] + 8 * np0 + 2 * t4));
#pragma unroll 1
            for (int np = np0; np < np1; np++) {
                const float2 cc[2] = {cn[0], cn[1]}, ss[2] = {sn[0], sn[1]};
                if (np + 1 < np1)
#pragma unroll
                    for (int rs = 0; rs < 2; rs++) {
                        cn[rs] = __ldg((const float2 *)(cb[rs] + 8 * (np + 1) + 2 * t4));
                        sn[rs] = __ldg((const float2 *)(sb[rs] + 8 * (np + 1) + 2 * t4));
                    }
                float ka[4], kb[4];
                rb_tile<KS>(Wf, NT, np, lane, t4, ah, al, ew, eu, ka);
                rb_tile<KS>(Wf, NT, np + NP, lane, t4, ah, al, ew, eu, kb);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float c = (i & 1) ? cc[i >> 1].y : cc[i >> 1].x, sv = (i & 1) ? ss[i >> 1].y : ss[i >> 1].x;
                    float xo, yo;
                    skv_rope_rotate(ka[i], kb[i], c, sv, &xo, &yo);
                    ka[i] = xo, kb[i] = yo;
                }
#pragma unroll
                for (int rs = 0; rs < 2; rs++) {
                    const int row = g + 8 * rs, sw = rb_swz(row);
                    xw[(size_t)row * xst + ((4 * np + t4) ^ sw)] = rb_bf16x2(ka[2 * rs], ka[2 * rs + 1]);
                    xw[(size_t)row * xst + ((4 * (np + NP) + t4) ^ sw)] = rb_bf16x2(kb[2 * rs], kb[2 * rs + 1]);
                }
            }
            nt0 = 2 * NP;
        } else {
            /* a lane's dims 8 nt + 2 t, + 1 are the pair i = 4 nt + t (while below R) */
            const int NR = (a.R + 7) / 8;
#pragma unroll 2
            for (int nt = 0; nt < NR; nt++) {
                const int i = 4 * nt + t4;
                const bool rot = 2 * i < a.R;
                float cc[2], ss[2];
#pragma unroll
                for (int rs = 0; rs < 2; rs++) cc[rs] = rot ? __ldg(cb[rs] + i) : 1.0f, ss[rs] = rot ? __ldg(sb[rs] + i) : 0.0f;
                float kv[4];
                rb_tile<KS>(Wf, NT, nt, lane, t4, ah, al, ew, eu, kv);
#pragma unroll
                for (int rs = 0; rs < 2; rs++) {
                    if (rot) {
                        float xo, yo;
                        skv_rope_rotate(kv[2 * rs], kv[2 * rs + 1], cc[rs], ss[rs], &xo, &yo);
                        kv[2 * rs] = xo, kv[2 * rs + 1] = yo;
                    }
                    const int row = g + 8 * rs;
                    xw[(size_t)row * xst + ((4 * nt + t4) ^ rb_swz(row))] = rb_bf16x2(kv[2 * rs], kv[2 * rs + 1]);
                }
            }
            nt0 = NR;
        }
        /* dims past R: bf16 of the key */
#pragma unroll 2
        for (int nt = nt0; nt < NT; nt++) {
            float kv[4];
            rb_tile<KS>(Wf, NT, nt, lane, t4, ah, al, ew, eu, kv);
#pragma unroll
            for (int rs = 0; rs < 2; rs++) {
                const int row = g + 8 * rs;
                xw[(size_t)row * xst + ((4 * nt + t4) ^ rb_swz(row))] = rb_bf16x2(kv[2 * rs], kv[2 * rs + 1]);
            }
        }
        if (spl) /* the other half's dims of the token set (block-uniform) */
            __syncthreads();
        else
            __syncwarp();
        if (a.k_out) { /* the live rows to k_out, 8 bytes a lane where D % 4 == 0 */
            uint16_t *kw = (uint16_t *)a.k_out + (((int64_t)b * a.Hk + h) * a.M + mw) * a.D;
            for (int rr = 0; rr < 16; rr++) {
                if (pos_s[ts][rr] < 0) continue;
                const uint32_t *src = xw + (size_t)rr * xst;
                const int sw = rb_swz(rr);
                if ((a.D & 3) == 0)
                    for (int d = 4 * lane; d < a.D; d += 128)
                        *reinterpret_cast<uint2 *>(kw + (int64_t)rr * a.D + d) =
                            *reinterpret_cast<const uint2 *>(src + ((d >> 1) ^ sw));
                else
                    for (int d = lane; d < a.D; d += 32) {
                        const uint32_t w = src[(d >> 1) ^ sw];
                        kw[(int64_t)rr * a.D + d] = (uint16_t)((d & 1) ? w >> 16 : w & 0xffffu);
                    }
            }
        }
        if (!a.e) return;
        const int rr = lane & 15;
        if (pos_s[ts][rr] < 0) return;
        rb_score_warp(a, b, h, mw, SwRow{xw + (size_t)rr * xst, rb_swz(rr)}, qs, spl, hh);
    }
}

/* The same values without tensor cores (shapes whose shared memory does not fit): grid (tiles of
   32 tokens, Hk, B), 256 threads; smem ew [Dp], eu [32], xs [32][D] float, q [G][D] when scoring. */
__global__ void __launch_bounds__(kRbNT) canon_rebuild_scalar_kernel(const RebuildArgs a)
{
    const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int64_t m0 = (int64_t)blockIdx.x * 32;
    const int64_t Mb = rb_M(a, b, h);
    if (m0 >= Mb) return; /* block-uniform */
    const skv_cuda_seq &sq = a.seqs[b];
    const uint16_t *w = (const uint16_t *)sq.w, *u = (const uint16_t *)sq.u;
    const int32_t *ids = a.ids + ((int64_t)b * a.Hk + h) * a.S;
    int *ew = (int *)skv_canon_smem, *eu = ew + a.Dp;
    float *xs = (float *)(eu + 32), *qs = xs + (size_t)32 * a.D; /* qs [G][D] when scoring */
    rb_col_exps(a, w, h, ew);
    if (a.e) rb_load_q(a, b, h, qs);
    for (int row = warp; row < 32; row += kRbNT / 32) {
        const int64_t m = m0 + row;
        unsigned mx = 0;
        if (m < Mb) {
            const uint16_t *ur = u + rb_pos(a, ids, m) * a.r;
            for (int q = lane; q < a.r; q += 32) mx = max(mx, (unsigned)(ur[q] & 0x7fffu));
        }
        mx = __reduce_max_sync(kFullMask, mx);
        if (lane == 0) eu[row] = skv_canon_rebuild_ex((uint16_t)mx);
    }
    __syncthreads();
    const int64_t width = (int64_t)a.Hk * a.D;
    for (int idx = tid; idx < 32 * a.D; idx += kRbNT) {
        const int row = idx / a.D, d = idx - row * a.D;
        const int64_t m = m0 + row;
        if (m >= Mb) continue;
        const uint16_t *ur = u + rb_pos(a, ids, m) * a.r;
        int64_t P = 0;
        for (int q = 0; q < a.r; q++)
            P += (int64_t)skv_canon_rebuild_fix(ur[q], eu[row]) *
                 skv_canon_rebuild_fix(w[(int64_t)q * width + (int64_t)h * a.D + d], ew[d]);
        xs[(size_t)row * a.D + d] = skv_canon_rebuild_key(P, eu[row] + ew[d] - 24);
    }
    __syncthreads();
    for (int row = warp; row < 32; row += kRbNT / 32) {
        const int64_t m = m0 + row;
        if (m >= Mb) continue;
        const int64_t t = rb_pos(a, ids, m);
        rb_rope_row(a, xs + (size_t)row * a.D, t,
                    a.k_out ? (uint16_t *)a.k_out + (((int64_t)b * a.Hk + h) * a.M + m) * a.D : nullptr, lane);
    }
    if (!a.e) return;
    __syncthreads();
    /* the scores: a thread per (row, 4 query heads) */
    const int64_t bq0 = (int64_t)b * a.Hq + (int64_t)h * a.G, sel0 = rb_sel0(a, b);
    for (int unit = tid; unit < 32 * ((a.G + 3) / 4); unit += kRbNT) {
        const int row = unit & 31;
        if (m0 + row >= Mb) continue;
        rb_score_row(a, xs + (size_t)row * a.D, qs, 4 * (unit >> 5), 1, bq0, sel0 + m0 + row);
    }
}

template <int KS, int RM>
cudaError_t launch_rebuild_tc(cudaStream_t st, const RebuildArgs &a, int32_t B, size_t smem)
{
    constexpr int RS = RM == 1 ? 1 : 0; /* the split's instantiation (only RoPE mode 1 has one) */
    const bool spl = RS && a.split;
    auto kernel = spl ? canon_rebuild_tc_kernel<KS, RM, RS> : canon_rebuild_tc_kernel<KS, RM, 0>;
    cudaError_t e = allow_smem(kernel, smem);
    if (e != cudaSuccess) return e;
    return launch(kernel, dim3((unsigned)rb_blocks(a, spl ? kRbTok / 2 : kRbTok), (unsigned)a.Hk, (unsigned)B), dim3(kRbNT),
                  smem, st, false, a);
}

template <int RM>
cudaError_t launch_rebuild_rm(cudaStream_t st, const RebuildArgs &a, int32_t B, size_t smem)
{
    switch (a.Kp / 32) {
    case 1: return launch_rebuild_tc<1, RM>(st, a, B, smem);
    case 2: return launch_rebuild_tc<2, RM>(st, a, B, smem);
    case 3: return launch_rebuild_tc<3, RM>(st, a, B, smem);
    case 4: return launch_rebuild_tc<4, RM>(st, a, B, smem);
    case 5: return launch_rebuild_tc<5, RM>(st, a, B, smem);
    case 6: return launch_rebuild_tc<6, RM>(st, a, B, smem);
    case 7: return launch_rebuild_tc<7, RM>(st, a, B, smem);
    default: return launch_rebuild_tc<8, RM>(st, a, B, smem);
    }
}

/* Whether the rebuild of a shape takes the tensor-core kernel (given W's prepared form; G: the query
   heads per KV head when it scores, else 0), and that kernel's dynamic shared memory. */
bool rb_tc(const RebuildArgs &a, int32_t G, size_t *smem)
{
    *smem = rb_smem(a.Kp, a.Dp, G, a.D, rb_rope_mode(a.R, a.interleaved));
    return *smem <= kRbSmemMax && a.Kp / 32 <= kRbKsMax;
}

/* Whether a rebuild launch takes the tensor-core kernel, and its dynamic shared memory if so. */
bool rb_uses_tc(const RebuildArgs &a, size_t *smem) { return rb_tc(a, a.e ? a.G : 0, smem) && (a.wq || a.wq_seq); }

cudaError_t launch_rebuild(cudaStream_t st, const RebuildArgs &a, int32_t B)
{
    if (a.M <= 0 || B <= 0) return cudaSuccess;
    if (a.Hk > kMaxGridYZ || B > kMaxGridYZ) return cudaErrorInvalidValue;
    const int32_t G = a.e ? a.G : 0;
    size_t smem;
    if (rb_uses_tc(a, &smem)) {
        const int rm = rb_rope_mode(a.R, a.interleaved);
        if (rm == 1) return launch_rebuild_rm<1>(st, a, B, smem);
        if (rm == 2) return launch_rebuild_rm<2>(st, a, B, smem);
        return launch_rebuild_rm<0>(st, a, B, smem);
    }
    const size_t s2 = sizeof(int) * ((size_t)a.Dp + 32) + sizeof(float) * (32 * (size_t)a.D + (size_t)G * a.D);
    cudaError_t e = allow_smem(canon_rebuild_scalar_kernel, s2);
    if (e != cudaSuccess) return e;
    return launch(canon_rebuild_scalar_kernel, dim3((unsigned)rb_blocks(a, 32), (unsigned)a.Hk, (unsigned)B),
                  dim3(kRbNT), s2, st, false, a);
}

} /* namespace */

int skv_cuda_canon_uses_wq(const skv_cuda_shape *sh, int decode)
{
    const RebuildArgs a = rebuild_args(sh, nullptr, nullptr, nullptr);
    size_t smem;
    return rb_tc(a, decode ? sh->Hq / sh->Hk : 0 /* as launch_rebuild's, e set or not */, &smem);
}

cudaError_t skv_cuda_canon_rebuild(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                   const int32_t *chunk_ids, skv_bf16 *k_out, const void *wq)
{
    RebuildArgs a = rebuild_args(sh, seqs, chunk_ids, k_out);
    a.wq = (const signed char *)wq;
    return launch_rebuild(st, a, sh->B);
}

cudaError_t skv_cuda_canon_rescore_keys(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                        const int32_t *cand_ids, const int32_t *cand_cnt, skv_bf16 *k_out,
                                        int wq_seq)
{
    skv_cuda_shape s = *sh;
    s.S = sh->W; /* the candidates' rows: W chunks per (sequence, KV head), the first cand_cnt live */
    RebuildArgs a = rebuild_args(&s, seqs, cand_ids, k_out);
    a.cnt = cand_cnt;
    a.wq_seq = wq_seq;
    return launch_rebuild(st, a, sh->B);
}

/* The test hook's override of rb_split's grid test (skv_cuda_canon_test_split): -1 none, 0 or 1 the
   form every decode rebuild that allows the split takes. Set by tests only, before their decode steps;
   an atomic, so a setter and the launchers never race. */
static std::atomic<int> rb_split_forced{-1};

/* Whether a decode rebuild splits each tile's dims over two warps (RebuildArgs::split): where the shape
   allows it (RoPE mode 1 with R == D, R % 32 == 0, the tensor-core kernel) and the 128-token grid would
   leave the device part idle (fewer blocks than two per multiprocessor, as at batch 1): a block's time is
   then its warps' dependent chain, and each of the two warps runs half the sums and scores half the
   heads. Where the grid fills the device the split only adds work (both warps load and convert the U
   rows). Both forms give the same bits; skv_cuda_canon_test_split overrides the grid test (the tests run
   both kernels). */
static int rb_split(const RebuildArgs &a, int32_t B)
{
    size_t smem;
    if (!rb_uses_tc(a, &smem) || rb_rope_mode(a.R, a.interleaved) != 1 || !a.e || a.k_out || a.R != a.D ||
        a.R % 32 != 0 || a.Dp != a.D)
        return 0;
    const int forced = rb_split_forced.load(std::memory_order_relaxed);
    if (forced >= 0) return forced;
    return rb_blocks(a, kRbTok) * a.Hk * B < 2 * (int64_t)num_sms();
}

void skv_cuda_canon_test_split(int split)
{
    rb_split_forced.store(split == 0 || split == 1 ? split : -1, std::memory_order_relaxed);
}

cudaError_t skv_cuda_canon_decode_rebuild(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                          const skv_cuda_dws *ws)
{
    RebuildArgs a = decode_rebuild_args(sh, seqs, ws);
    a.split = rb_split(a, sh->B);
    return launch_rebuild(st, a, sh->B);
}
