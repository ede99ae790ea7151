/*
 * skv_cuda_attend_mma.cu - step 4 of a decode on the common shape (skv_cuda_attend_mma, called
 * by skv_cuda_attend of skv_cuda_attend.cu when the step's items are fragment items,
 * skv_cuda_items.frag; pipeline step "4 attend" of skv_cuda.h): attend_mma_kernel, the fused key
 * rebuild + attention on tensor-core fragments. Its layout and shape test are in
 * skv_cuda_attn.cuh (skv_cuda_decode_items decides on it).
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
 * so the result has the same bits whatever runs first. Four groups per SM hide each other's load latency.
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

__device__ __forceinline__ void prefetch_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

struct MmCtx {
    int b, h, n_sel;
    int64_t T; /* resident tokens of (b, h); resident item i covers [64 i, 64 i + 64) */
};

/* Where one row (token) of an item comes from: its position (-1: none), the source of its U row
   (selected) or K row (resident; NULL: zeros), its V row (NULL: zeros), and whether its P V waits
   for the fetch of a missed chunk. */
struct MmRow {
    int64_t pos;
    const uint16_t *uk, *v;
    int miss;
};

/* An item with nothing to load: a resident item past the resident tokens (all later ones are too). */
__device__ __forceinline__ bool mm_empty(const MmCtx &c, int item)
{
    return item >= c.n_sel && (int64_t)(item - c.n_sel) * kMmTT >= c.T;
}

/* The sources of row `row` of item `item` (the selection lookups; no shared memory written). */
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
        if (ts < S * cc) {
            const int32_t s = ts / cc, i = ts - s * cc;
            m.pos = (int64_t)a.sel_ids[bh * S + s] * cc + i;
            m.uk = sq.u + m.pos * sh.r;
            if (sq.vc_data) {
                const int32_t v = a.vsrc[bh * S + s];
                m.miss = v < 0 && a.pbuf; /* missed: its P V comes after the fetch */
                if (!m.miss) m.v = sq.vc_data + (((int64_t)c.h * sh.vc_chunks + (v & 0x7fffffff)) * cc + i) * kMmD;
            } else {
                m.v = sq.vstore + (((int64_t)c.h * sq.n_cand + a.sel_idx[bh * S + s]) * cc + i) * kMmD;
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

/* mm_copy_row's rare paths (zeros, or a source that is not 16-byte aligned), out of line: inlined,
   they are if-converted into predicated loads that every copy issues. */
__device__ __noinline__ void mm_copy_row_slow(uint16_t *dst, const uint16_t *src, int n, int half)
{
    for (int p = half; p < n; p += 2) {
        if (!src) store_zero16(dst + p * 8);
        else load8_slow(dst + p * 8, src + p * 8, 8);
    }
}

/* 16-byte pieces half, half + 2, ... of a row of n pieces from src (NULL: zeros) into dst. */
__device__ __forceinline__ void mm_copy_row(uint16_t *dst, const uint16_t *src, int n, int half)
{
    if (src && ((uintptr_t)src & 15) == 0) {
        for (int p = half; p < n; p += 2) cp_async16(dst + p * 8, src + p * 8);
    } else {
        mm_copy_row_slow(dst, src, n, half);
    }
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
    for (int pi = q, par = 0; pi < n_x; pi += kMmGroups, par ^= 1) {
        const int item = mm_item(c, x, split, nr_x, pi);
        if (mm_empty(c, item)) {
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
            const MmRow m = mm_lookup(a, c, item, row, sp_s);
            mm_issue_uk(a, L, UKw, tok_s + par * kMmTT, miss_s + par * kMmTT, item < c.n_sel, r, row, rw, half, m);
            mm_copy_row(Vs + row * kMmLdv, m.v, kMmD / 8, half);
            cp_async_commit();
            cp_async_commit();
        }
        const int nx = pi + kMmGroups < n_x ? mm_item(c, x, split, nr_x, pi + kMmGroups) : -1;
        /* not across the step from resident to selected items: that lookup waits for the
           selection, and this item does not */
        const bool has_nx = nx >= 0 && !mm_empty(c, nx) && !(item >= c.n_sel && nx < c.n_sel);
        issued = has_nx;
        MmRow mn;
        if (has_nx) mn = mm_lookup(a, c, nx, row, sp_s);
        const int64_t *tok = tok_s + par * kMmTT;
        const int32_t *miss = miss_s + par * kMmTT;
        cp_async_wait_group<1>();
        __syncwarp(); /* the warp's U / K rows of the item */
        const bool sel = item < c.n_sel;
        int nvalid;
        float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        if (sel) {
            nvalid = (int)(SC - (int64_t)item * kMmTT < kMmTT ? SC - (int64_t)item * kMmTT : kMmTT);
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
                    if (tk < nvalid && miss[tk]) a.pbuf[(head0 + g) * SC + (int64_t)item * kMmTT + tk] = p[e];
                }
            }
        }
        ps += __shfl_xor_sync(kFullMask, ps, 1);
        ps += __shfl_xor_sync(kFullMask, ps, 2);
        cp_async_wait_group<1>();
        __syncwarp(); /* the warp's V rows of the item */
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
        if (has_nx) mm_copy_row(Vs + row * kMmLdv, mn.v, kMmD / 8, half);
        cp_async_commit();
    }
    cp_async_wait_all();
    pdl_trigger();
}

} /* namespace */

cudaError_t skv_cuda_attend_mma(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
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
    cudaError_t e = allow_smem(attend_mma_kernel, smem);
    if (e != cudaSuccess) return e;
    return launch(attend_mma_kernel, dim3((unsigned)split, (unsigned)sh->Hk, (unsigned)sh->B), dim3(kMmNT), smem,
                  st, pdl != 0, a, (int)split);
}
