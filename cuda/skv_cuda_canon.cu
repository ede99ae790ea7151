/*
 * skv_cuda_canon.cu - the reproducible mode's canonical key rebuild and
 * canonical attention (docs/DESIGN.md 10.2, 10.3) on the device, for the
 * cache's decode step and for the op-level slots. Built with --fmad=false; every
 * float operation is an SKV_* macro of lib/skv_numerics.h (an explicitly rounded
 * __f*_rn intrinsic), so the results are those of ref, bit for bit.
 *
 *  - rebuild (canon_wprep_kernel, then canon_rebuild_tc_kernel<KS>): W_h's columns
 *    in fixed point (a block reads its 16 columns once into shared memory), split
 *    as 128 hi + lo (hi in [-64, 64], lo in [-64, 63]) and stored as the B
 *    fragments of mma m16n8k32 (16 bytes per lane), once per slot: W is fixed at
 *    prefill, so the cache prepares a slot's fragments when its W is written
 *    (prefill, snapshot load: skv_cuda_canon_wprep into skv_cuda_seq.wq) and the
 *    decode step only reads them; the op-level rebuild prepares them per call.
 *    Then one block per (tile of 128 selected tokens, KV head, sequence), a warp
 *    per 16 tokens: each lane loads its two U rows' pieces at once (and sends the
 *    rows' cos/sin lines toward L2), the row max by quad shuffles, the 13-bit
 *    fixed point (one fma, exact, four elements packed into the int8 halves by
 *    byte permutes; the integer skv_canon_rebuild_fix for rows below 2^-113)
 *    straight into the A fragments,
 *    and the exact sum P = 2^14 (hu.hw) + 2^7 (hu.lw + lu.hw) + lu.lw on int8
 *    tensor cores (mma.sync, int32 accumulators: every partial sum is exact),
 *    W's fragments from shared memory (cp.async). Then skv_canon_rebuild_key's
 *    value; RoPE (skv_rope_rotate) and bf16: where both members of a lane's pairs
 *    sit in its fragments (pairs (i, i + R/2) with R % 16 == 0, or interleaved
 *    pairs) in registers, two keys per conversion, into bf16 staging rows; other
 *    rotary shapes through float staging rows (the pairs of skv_rope_pair_index;
 *    8 tokens' cos/sin rows in flight), in place.
 *    At op level the bf16 keys go to k_out [B, Hk, S c, D]; at decode they are not
 *    stored: the warp scores its 16 tokens from the staging rows (lane: token
 *    lane mod 16, query heads lane / 16, + 2, ..; s_j = scale x the fmaf chain of
 *    skv_dot_bf16 in d order) into the workspace e [B, Hq, Tmax] at the selected
 *    span's places. r > 256 or shapes whose shared memory would not fit take
 *    canon_rebuild_scalar_kernel (int64 sums, the same values, the same scores).
 *  - attention: the scores of the other spans (at decode canon_resident_kernel, a
 *    thread per token and the group's heads 4 chains at a time, on the cache's side
 *    stream beside the selection; at op level canon_score_kernel, a thread per
 *    (token, KV head), every span); canon_weights_kernel, a block per (query head,
 *    sequence): M by a block max of the T scores, then e_j = skv_expf(s_j - M) in
 *    place, once per head; canon_attend_kernel (at decode the weights kernel's
 *    programmatic dependent: its spans and the selection's chunks staged in shared
 *    memory before the weights are final), a block of 256 threads per (16 dims,
 *    a 32-byte sector of a value row; KV head, sequence), thread l = canonical lane
 *    l: per 4 query heads, lane l walks its tokens j = l, l + 256, ... in order, 2 in
 *    flight: z += e_j, N_d = fma(e_j, v_jd, N_d) for the block's 16 dims (the 4 heads
 *    share each V load; every block of a group adds the same e_j into Z in the same
 *    order). The fixed tree: every lane's 68 values into shared memory, then a warp per
 *    value, lane t holding lanes t + 32 i: levels 128, 64, 32 in registers, 16 .. 1
 *    by shuffles (lane k adds lane k + w's value), then N_d / Z.
 * The decode step's spans are read from the device (skv_cuda_seq, the step's
 * selection, the chunk cache's entries), so the launches can be captured in the
 * layer's graph. Launchers only enqueue: no allocation, no synchronization.
 */
#include <cuda_runtime.h>
#include <mma.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_numerics.h"
#include "skv_plan.h"

extern __shared__ __align__(128) unsigned char skv_canon_smem[];

namespace {

/* ---- attention ---------------------------------------------------------------------------------- */

constexpr int kAtLanes = SKV_CANON_LANES; /* 256 */
constexpr int kAtDC = 16; /* dims per block of the P V kernel: a 32-byte sector of each value row */
constexpr int kAtGC = 4;  /* query heads per unit */
constexpr int kAtMaxSpans = SKV_MAX_SPANS;
constexpr int kAtSelSmem = 8192; /* P V stages a decode selection of up to this many chunks in shared memory */

/* A span of one (sequence, KV head). kind 0: v like k; 1: the selected span of a device slot (values
   in the store by candidate index); 2: that of a host slot (values in the chunk cache). */
struct CSpan {
    const uint16_t *k, *v;
    int64_t n, ts;
    int kind;
};

struct AttendArgs {
    int32_t Hq, Hk, G, D;
    float scale;
    int64_t Tmax;           /* row length of e */
    float *e;               /* [B, Hq, Tmax] scores, then weights */
    /* op level (seqs == NULL) */
    const uint16_t *q;      /* [Hq, D] */
    float *out;             /* [Hq, D] */
    int32_t n_spans;
    skv_kv_span spans[kAtMaxSpans];
    /* decode */
    const skv_cuda_seq *seqs;
    const skv_cuda_io *io;
    const int32_t *sel_idx, *vsrc; /* [B, Hk, S] */
    int32_t O, c, S, gen_cap, vc_chunks;
};

/* The five spans of (sequence b, KV head h) at decode into sp[] (skv_plan_spans; the selected span's
   keys are not read: the rebuild scored them). */
__device__ void at_seq_spans(const skv_cuda_seq &sq, const skv_cuda_io *io, int b, int h, int32_t Hk, int32_t D,
                             int32_t O, int32_t c, int32_t S, int32_t gen_cap, CSpan *sp)
{
    skv_span_shape sh[SKV_N_SPANS];
    skv_plan_spans(O, c, S, D, sq.n_local, sq.n_gen, gen_cap, sh);
    const uint16_t *k[SKV_N_SPANS] = {(const uint16_t *)sq.out_k, (const uint16_t *)sq.loc_k, nullptr,
                                      (const uint16_t *)sq.gen_k, (const uint16_t *)io->k + (int64_t)b * Hk * D};
    const uint16_t *v[SKV_N_SPANS] = {(const uint16_t *)sq.out_v, (const uint16_t *)sq.loc_v, nullptr,
                                      (const uint16_t *)sq.gen_v, (const uint16_t *)io->v + (int64_t)b * Hk * D};
    for (int i = 0; i < SKV_N_SPANS; i++) {
        sp[i].n = sh[i].n_tokens;
        sp[i].ts = D;
        sp[i].k = k[i] ? k[i] + h * sh[i].head_stride : nullptr;
        sp[i].v = v[i] ? v[i] + h * sh[i].head_stride : nullptr;
        sp[i].kind = i == SKV_SPAN_SELECTED ? (sq.vc_data ? 2 : 1) : 0;
    }
}

/* The spans of (b, h) into sp[] (thread 0); returns their count. */
__device__ int at_spans(const AttendArgs &a, int b, int h, CSpan *sp)
{
    if (!a.seqs) {
        for (int i = 0; i < a.n_spans; i++) {
            const skv_kv_span &s = a.spans[i];
            sp[i].n = s.n_tokens;
            sp[i].ts = s.token_stride;
            sp[i].k = s.n_tokens ? (const uint16_t *)s.k + h * s.head_stride : nullptr;
            sp[i].v = s.n_tokens ? (const uint16_t *)s.v + h * s.head_stride : nullptr;
            sp[i].kind = 0;
        }
        return a.n_spans;
    }
    at_seq_spans(a.seqs[b], a.io, b, h, a.Hk, a.D, a.O, a.c, a.S, a.gen_cap, sp);
    return SKV_N_SPANS;
}

/* Selected token t (< S c < 2^31) -> its selection slot t / c and its row t mod c in the chunk, by a 32-bit
   division (a 64-bit one is a long software routine, and this runs per token). */
__device__ __forceinline__ uint32_t at_chunk_of(int64_t t, int32_t c, uint32_t &i)
{
    const uint32_t s = (uint32_t)t / (uint32_t)c;
    i = (uint32_t)t - s * (uint32_t)c;
    return s;
}

/* Where the values of selection slot s (< S) of (b, h) live: kind 1 (device slot) its candidate's index
   in the store, kind 2 (host slot) its chunk-cache entry. */
__device__ __forceinline__ int32_t at_sel_chunk(const AttendArgs &a, int kind, int64_t bh, int64_t s)
{
    if (kind == 1) return a.sel_idx[bh * a.S + s];
    const int32_t e = a.vsrc[bh * a.S + s] & 0x7fffffff;
    return e >= a.vc_chunks ? 0 : e; /* never out of range after a good selection step; keeps a bad step's reads in bounds */
}

/* The span walk of token j (spans in order): its span si and that span's first token base, advanced
   from the previous (si, base) (j only grows). */
__device__ __forceinline__ bool at_seek(const CSpan *sp, int ns, int64_t j, int &si, int64_t &base)
{
    while (si < ns && j - base >= sp[si].n) base += sp[si].n, si++;
    return si < ns;
}

/* The fmaf chains of skv_dot_bf16 of the bf16 key row k [D] against the gn <= 4 query rows q + g D
   (floats, 16-byte aligned rows where D % 8 == 0), each over d in order from acc[g]: 16-byte key
   loads, 64 dims in flight, where D % 8 == 0 and k is 16-byte aligned; one dim at a time otherwise. */
__device__ __forceinline__ void at_score_row(const uint16_t *k, const float *q, int D, int gn, float (&acc)[4])
{
    if ((D & 7) == 0 && ((uintptr_t)k & 15) == 0) {
        for (int d0 = 0; d0 < D; d0 += 64) {
            uint4 kv[8];
#pragma unroll
            for (int c = 0; c < 8; c++)
                if (d0 + 8 * c < D) kv[c] = __ldg(reinterpret_cast<const uint4 *>(k + d0 + 8 * c));
#pragma unroll
            for (int c = 0; c < 8; c++) {
                if (d0 + 8 * c >= D) break;
                float f[8];
                bf16x8_to_f32(kv[c], f);
#pragma unroll
                for (int gg = 0; gg < 4; gg++) {
                    if (gg >= gn) break;
                    const float4 *qv = reinterpret_cast<const float4 *>(q + (size_t)gg * D + d0 + 8 * c);
                    const float4 qa = qv[0], qb = qv[1];
                    const float qq[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
                    for (int x = 0; x < 8; x++) acc[gg] = SKV_FMA(qq[x], f[x], acc[gg]);
                }
            }
        }
    } else {
        for (int d = 0; d < D; d++) {
            const float f = skv_bf16_to_f32(k[d]);
#pragma unroll
            for (int gg = 0; gg < 4; gg++)
                if (gg < gn) acc[gg] = SKV_FMA(q[(size_t)gg * D + d], f, acc[gg]);
        }
    }
}

/* s_j = scale x the fmaf chain of skv_dot_bf16 of the key row k [D] for all G query heads qs [G][D]
   (at_score_row, 4 chains at a time), into e[g Tmax + j] (e: the group's first row). */
__device__ __forceinline__ void at_score_token(const uint16_t *k, const float *qs, int D, int G, float scale,
                                               float *e, int64_t Tmax, int64_t j)
{
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gn = min(4, G - g0);
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        at_score_row(k, qs + (size_t)g0 * D, D, gn, acc);
#pragma unroll
        for (int gg = 0; gg < 4; gg++)
            if (gg < gn) e[(g0 + gg) * Tmax + j] = SKV_MUL(acc[gg], scale);
    }
}

/* ---- rebuild ----------------------------------------------------------------------------------- */

constexpr int kRbTok = 128;           /* tokens per block: 8 warps of 16 (one m16 tile each) */
constexpr int kRbNT = 256;
constexpr int kRbKsMax = 8;           /* k steps of 32: r <= 256 on tensor cores */
constexpr size_t kRbSmemMax = 200 * 1024; /* D 128, r 160: 109 KB (RM 0), 75 KB (RM 1, 2) */
/* Blocks per multiprocessor the register allocation aims at for RM 1 and 2. Three fit at D 128, r 160,
   G 4 (75 KB of shared memory, 80 registers with 144 bytes of spills), but measured slower on the
   H200 (rebuild 107 against 91 us per step, the 128k x 8 step 0.311 / 0.323 against 0.295 / 0.305 ms). */
#ifndef SKV_RB_MINB
#define SKV_RB_MINB 2
#endif

struct RebuildArgs {
    int32_t Hk, D, Dp, r, Kp, c, S, R, interleaved;
    int64_t M;                 /* S c tokens per (sequence, KV head) */
    /* W's prepared form (canon_wprep_kernel) for the tensor-core kernel, per sequence a region of
       wq_bytes (see wq_ex_off): op level: sequence b's at wq + b wq_bytes; decode (wq_seq): at
       seqs[b].wq, the cache's slot. Neither: the exact int64 kernel, which reads W itself. */
    const signed char *wq;
    int32_t wq_seq;
    const skv_cuda_seq *seqs;  /* [B]: u, w (wq) */
    const int32_t *ids;        /* [B, Hk, S] chunk ids */
    const float *cos_tab, *sin_tab;
    skv_bf16 *k_out;           /* [B, Hk, M, D] or NULL */
    /* decode (e set): the selected tokens' scores s_j = scale x skv_dot_bf16(q, k_j, D) of the group's
       query heads into e [B, Hq, Tmax] at j = O c + n_local + m (the selected span's place) */
    float *e;
    const skv_cuda_io *io;     /* q [B, Hq, D] */
    int32_t Hq, G, O;
    float scale;
    int64_t Tmax;
    /* decode: nx blocks per (sequence, KV head) score the resident tokens (every span but the selected
       one: canon_resident_kernel) */
    int32_t nx, gen_cap;
    /* decode: the split form of the RoPE-mode-1 kernel (rb_split; tiles of 64 tokens per block) */
    int32_t split;
};

/* One sequence's prepared W (Hk heads), in one region: [Hk] x [Kp/32][Dp/8][32 lanes][hi b0, hi b1,
   lo b0, lo b1] (W_h's mma B fragments), then at wq_ex_off [Hk, Dp] int (the columns' exponents);
   wq_bytes in all, a multiple of 256. */
__host__ __device__ inline size_t wq_ex_off(int32_t Hk, int32_t Kp, int32_t Dp)
{
    return ((size_t)Hk * 2 * Kp * Dp + 255) & ~(size_t)255;
}
__host__ __device__ inline size_t wq_bytes(int32_t Hk, int32_t Kp, int32_t Dp)
{
    return (wq_ex_off(Hk, Kp, Dp) + sizeof(int) * (size_t)Hk * Dp + 255) & ~(size_t)255;
}

/* W_h's prepared fragments and exponents of (sequence b, KV head h) (see RebuildArgs.wq). */
__device__ __forceinline__ void rb_wq_at(const RebuildArgs &a, int b, int h, const uint4 *&frag, const int *&ex)
{
    const signed char *base = a.wq_seq ? a.seqs[b].wq : a.wq + (int64_t)b * wq_bytes(a.Hk, a.Kp, a.Dp);
    frag = reinterpret_cast<const uint4 *>(base + (int64_t)h * 2 * a.Kp * a.Dp);
    ex = reinterpret_cast<const int *>(base + wq_ex_off(a.Hk, a.Kp, a.Dp)) + (int64_t)h * a.Dp;
}

/* RoPE modes of the tensor-core rebuild: RM 0 stages the float keys and rotates them from shared
   memory (any rotary shape); RM 1 (pairs (i, i + R/2), R % 16 == 0) and RM 2 (pairs (2i, 2i + 1), R even)
   rotate the keys in registers, where both members of a pair sit in one lane (RM 1: tiles nt and
   nt + R/16, the same fragment slot; RM 2: a lane's two adjacent dims), and stage bf16 keys. */
__host__ __device__ inline int rb_rope_mode(int32_t R, int32_t interleaved)
{
    if (interleaved) return R % 2 == 0 ? 2 : 0;
    return R % 16 == 0 ? 1 : 0;
}

/* Row stride of the per-warp staging: RM 0 floats (8 mod 32 banks at Dp 128); else 32-bit words of
   two bf16 keys, a multiple of 32 words, swizzled (rb_swz). */
__host__ __device__ inline int rb_xstride(int32_t Dp, int rm) { return rm ? (Dp / 2 + 31) / 32 * 32 : Dp + 8; }

/* The word swizzle of bf16 staging row r (r < 16; an even XOR below 32, inside the row as its stride
   is a multiple of 32 words): word w of row r lives at word w ^ rb_swz(r). A warp's fragment stores
   (rows g or g + 8, words 4 nt + t) and the scores' 8-byte loads (rows 0..15, words 2 k, + 1) both hit
   32 distinct banks at Dp 128 (checked by enumeration). */
__host__ __device__ inline int rb_swz(int r) { return ((r & 7) << 2) | ((r >> 3) << 1); }

/* A swizzled bf16 staging row. */
struct SwRow {
    const uint32_t *w;
    int s;
};

/* Dynamic shared memory of the tensor-core rebuild for a shape (G: the query heads per KV head when it
   scores, else 0; their q [G][D] follows the staging rows). */
__host__ __device__ inline size_t rb_smem(int32_t Kp, int32_t Dp, int32_t G, int32_t D, int rm)
{
    return (size_t)2 * Kp * Dp                            /* W's B fragments, hi and lo */
           + sizeof(int) * (size_t)Dp                     /* ew */
           + 4 * (size_t)kRbTok * rb_xstride(Dp, rm)      /* per token: the float key (RM 0), the bf16 key */
           + sizeof(float) * (size_t)G * D;               /* q of the group's query heads */
}

/* The position of selected token m (< S c) of (b, h) (ids: its chunk ids). */
__device__ __forceinline__ int64_t rb_pos(const RebuildArgs &a, const int32_t *ids, int64_t m)
{
    uint32_t i;
    const uint32_t s = at_chunk_of(m, a.c, i);
    return (int64_t)ids[s] * a.c + i;
}

/* The selected span's first token in the attention's token order (skv_plan_spans: outliers, local). */
__device__ __forceinline__ int64_t rb_sel0(const RebuildArgs &a, int b) { return (int64_t)a.O * a.c + a.seqs[b].n_local; }

/* Four consecutive keys of a staged row as floats: RM 0 floats, else bf16 (two per 32-bit word). */
__device__ __forceinline__ float4 rb_key4(const float *x, int d) { return *reinterpret_cast<const float4 *>(x + d); }
__device__ __forceinline__ float4 rb_key4(const SwRow &x, int d)
{
    const uint2 w = *reinterpret_cast<const uint2 *>(x.w + ((d >> 1) ^ x.s));
    return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u), __uint_as_float(w.y << 16),
                       __uint_as_float(w.y & 0xffff0000u));
}
__device__ __forceinline__ float rb_key1(const float *x, int d) { return x[d]; }
__device__ __forceinline__ float rb_key1(const SwRow &x, int d)
{
    const uint32_t w = x.w[(d >> 1) ^ x.s];
    return __uint_as_float((d & 1) ? w & 0xffff0000u : w << 16);
}

/* q of the group of KV head h of sequence b -> qs [G][D] floats (decode). */
__device__ __forceinline__ void rb_load_q(const RebuildArgs &a, int b, int h, float *qs)
{
    const uint16_t *qg = (const uint16_t *)a.io->q + ((int64_t)b * a.Hq + (int64_t)h * a.G) * a.D;
    for (int i = threadIdx.x; i < a.G * a.D; i += blockDim.x) qs[i] = skv_bf16_to_f32(qg[i]);
}

/* Scores of up to 4 query heads g0, g0 + gs, .. (< G) against the key row x [D] (floats of bf16 keys, or
   the bf16 keys): per head the fmaf chain of skv_dot_bf16 over d in order (the 4 chains interleaved),
   times scale, into e[(bq0 + g) Tmax + j]. q: [G][D] floats. */
template <typename R>
__device__ __forceinline__ void rb_score_row(const RebuildArgs &a, const R &x, const float *q, int g0, int gs,
                                             int64_t bq0, int64_t j)
{
    const int D = a.D, G = a.G;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if ((D & 3) == 0) {
#pragma unroll 2
        for (int d = 0; d < D; d += 4) {
            const float4 k4 = rb_key4(x, d);
#pragma unroll
            for (int gg = 0; gg < 4; gg++) {
                if (g0 + gs * gg >= G) break;
                const float4 q4 = *reinterpret_cast<const float4 *>(q + (size_t)(g0 + gs * gg) * D + d);
                acc[gg] = SKV_FMA(q4.x, k4.x, acc[gg]);
                acc[gg] = SKV_FMA(q4.y, k4.y, acc[gg]);
                acc[gg] = SKV_FMA(q4.z, k4.z, acc[gg]);
                acc[gg] = SKV_FMA(q4.w, k4.w, acc[gg]);
            }
        }
    } else {
        for (int d = 0; d < D; d++)
#pragma unroll
            for (int gg = 0; gg < 4; gg++)
                if (g0 + gs * gg < G) acc[gg] = SKV_FMA(q[(size_t)(g0 + gs * gg) * D + d], rb_key1(x, d), acc[gg]);
    }
#pragma unroll
    for (int gg = 0; gg < 4; gg++)
        if (g0 + gs * gg < G) a.e[(bq0 + g0 + gs * gg) * a.Tmax + j] = SKV_MUL(acc[gg], a.scale);
}

/* The scores of a warp's live tokens at decode (the tensor-core rebuild): lane (token rr = lane mod 16)
   takes the query heads lane / 16, + 2, + 4, .. of the group, 4 chains at a time (rb_score_row). */
template <typename R>
__device__ __forceinline__ void rb_score_warp(const RebuildArgs &a, int b, int h, int64_t mw, const R &x,
                                              const float *qs, int spl = 0, int hh = 0)
{
    const int lane = threadIdx.x & 31;
    const int64_t bq0 = (int64_t)b * a.Hq + (int64_t)h * a.G, j = rb_sel0(a, b) + mw + (lane & 15);
    if (spl) /* the two warps of a token set: warp hh takes heads 2 hh + lane / 16 + 4 i */
        for (int g0 = (lane >> 4) + 2 * hh; g0 < a.G; g0 += 16) rb_score_row(a, x, qs, g0, 4, bq0, j);
    else
        for (int g0 = lane >> 4; g0 < a.G; g0 += 8) rb_score_row(a, x, qs, g0, 2, bq0, j);
}

/* Decode, the nx blocks of (b, h) of canon_resident_kernel: the resident tokens (every span but the selected one,
   in the attention's token order) strided over those blocks, a thread per token: s_j of the group's
   query heads (at_score_token) into e. smem: q [G][D] floats. */
__device__ void rb_resident(const RebuildArgs &a, int b, int h)
{
    const int tid = threadIdx.x;
    float *qs = (float *)skv_canon_smem;
    __shared__ CSpan sp[SKV_N_SPANS];
    if (tid == 0) at_seq_spans(a.seqs[b], a.io, b, h, a.Hk, a.D, a.O, a.c, a.S, a.gen_cap, sp);
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

/* t = x + 64 for x = skv_canon_rebuild_fix(h, e), e >= -113 (s = 2^(12 - e)): h 2^(12 - e) is |y| <= 2^13,
   fma(f, s, 1.5 2^23 + 64) rounds y + 1.5 2^23 + 64 once to the integer grid (ulp 1 there), ties to even,
   and 1.5 2^23 + 64 is even: the result is 1.5 2^23 + 64 + rne(y), rne(y) = x, so its bits are
   0x4B400000 + t (t in [-8127, 8255]). A subnormal h gives |y| < 2^(-114 - e) <= 1/2: x = 0 whether or
   not it is flushed. */
__device__ __forceinline__ uint32_t rb_fix_bits(uint32_t f32bits, float s)
{
    return __float_as_uint(__fmaf_rn(__uint_as_float(f32bits), s, 12582976.0f));
}
/* Four bf16 of a U row (r.x low, r.x high, r.y low, r.y high: bytes 0..3 of the fragment registers) ->
   the int8 halves hi = t >> 7 and lo = (t & 127) - 64 of their t = x + 64 (rb_hi8 / rb_lo8), from the
   bits u = 0x4B400000 + t of rb_fix_bits: 0x4B400000 is 0 in bits 0..21, so bits 0..14 of u are those
   of t (mod 2^15), hi's byte is bits 7..14 and lo's is (u & 127) - 64 mod 256. Packed 16 bits of two
   rows at a time (byte_perm), hi by a shift of 1 and the odd bytes, lo from the even bytes per byte:
   ((b | 0x80) - 0x40) ^ 0x80 = (b & 127) + 192 mod 256, no borrow between bytes. */
__device__ __forceinline__ void rb_pack_fast(uint2 r, float s, uint32_t &hw, uint32_t &lw)
{
    const uint32_t u0 = rb_fix_bits(r.x << 16, s), u1 = rb_fix_bits(r.x & 0xffff0000u, s);
    const uint32_t u2 = rb_fix_bits(r.y << 16, s), u3 = rb_fix_bits(r.y & 0xffff0000u, s);
    const uint32_t y01 = __byte_perm(u0, u1, 0x5410), y23 = __byte_perm(u2, u3, 0x5410);
    hw = __byte_perm(y01 << 1, y23 << 1, 0x7531);
    lw = ((__byte_perm(y01, y23, 0x6420) | 0x80808080u) - 0x40404040u) ^ 0x80808080u;
}
/* skv_canon_rebuild_key(P, e) for P = 2^14 c1 + 2^7 c2 + c3, (double) P taken by the exponent trick
   instead of a conversion (for |P| < 2^51 the bits of 1.5 2^52 plus P are the double 1.5 2^52 + P, ulp 1
   there, and subtracting 1.5 2^52 is exact), then the same product and the same rounding to float. For
   the rebuild's sums (|c1| <= 2^20, |c2| <= 2^21, |c3| <= 2^20) without int64 arithmetic: T = 2^7 c1 + c2 + (c3 >> 7) fits int32 and P = 2^7 T + (c3 & 127) (the
   arithmetic shift floors, so c3 = 2^7 (c3 >> 7) + (c3 & 127)); the bits of 1.5 2^52 + P are the high
   word 0x43380000 + (T >> 25) (P's bits from 32 up: the low 7 bits of 2^7 T are 0 and c3 & 127 < 2^7, so
   no carry reaches them) and the low word (T << 7) | (c3 & 127). tests/emu/canon_key_emu.c compares
   the two doubles. */
__device__ __forceinline__ float rb_key_sums(int32_t c1, int32_t c2, int32_t c3, int e)
{
    const int32_t T = c1 * 128 + c2 + (c3 >> 7);
    const uint32_t lo = ((uint32_t)T << 7) | ((uint32_t)c3 & 127u), hi = 0x43380000u + (uint32_t)(T >> 25);
    const double d = __dsub_rn(__hiloint2double((int)hi, (int)lo), 6755399441055744.0);
    return __double2float_rn(__dmul_rn(d, __longlong_as_double((long long)(e + 1023) << 52)));
}
__device__ __forceinline__ float rb_pow2_12(int e) { return __uint_as_float((uint32_t)(139 - e) << 23); }

/* skv_f32_to_bf16 of lo (bits 0..15) and hi (bits 16..31) by one conversion: cvt.rn.bf16x2.f32 rounds
   to nearest even, keeps subnormals and overflows to infinity as the integer rounding does; only a NaN
   differs (the hardware's canonical NaN), so a NaN takes the integer rounding. */
__device__ __forceinline__ uint32_t rb_bf16x2(float lo, float hi)
{
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    if (lo != lo || hi != hi) r = (uint32_t)skv_f32_to_bf16(lo) | (uint32_t)skv_f32_to_bf16(hi) << 16;
    return r;
}

/* t = x + 64 -> the int8 bytes of hi = t >> 7 and lo = (t & 127) - 64 (x = 128 hi + lo, as split13). */
__device__ __forceinline__ uint32_t rb_hi8(int32_t t) { return (uint32_t)(t >> 7) & 0xffu; }
__device__ __forceinline__ uint32_t rb_lo8(int32_t t) { return (uint32_t)((t & 127) - 64) & 0xffu; }

__device__ __forceinline__ void prefetch_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

__device__ __forceinline__ void mma_s8(int c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Column maxima of W_h -> ew[d] (d < Dp; 0 past D). */
__device__ void rb_col_exps(const RebuildArgs &a, const uint16_t *w, int h, int *ew)
{
    const int64_t width = (int64_t)a.Hk * a.D;
    for (int d = threadIdx.x; d < a.Dp; d += blockDim.x) {
        unsigned mx = 0;
        if (d < a.D)
            for (int q = 0; q < a.r; q++) mx = max(mx, (unsigned)(w[(int64_t)q * width + (int64_t)h * a.D + d] & 0x7fffu));
        ew[d] = skv_canon_rebuild_ex((uint16_t)mx);
    }
}

/* RoPE of one float key row x[0..D) at position t, rounded to bf16: in place (x then holds the bf16
   key as floats) and into out when set; lanes of a warp over the pairs (each lane reads and writes
   only its own pairs' dims). */
__device__ void rb_rope_row(const RebuildArgs &a, float *x, int64_t t, uint16_t *out, int lane)
{
    const int h2 = a.R / 2;
    const float *cs = a.cos_tab + t * h2, *sn = a.sin_tab + t * h2;
    for (int d = a.R + lane; d < a.D; d += 32) {
        const uint16_t o = skv_f32_to_bf16(x[d]);
        x[d] = skv_bf16_to_f32(o);
        if (out) out[d] = o;
    }
    for (int i = lane; i < h2; i += 32) {
        int pa, pb;
        float xo, yo;
        skv_rope_pair_index(i, a.R, a.interleaved, &pa, &pb);
        skv_rope_rotate(x[pa], x[pb], cs[i], sn[i], &xo, &yo);
        const uint16_t oa = skv_f32_to_bf16(xo), ob = skv_f32_to_bf16(yo);
        x[pa] = skv_bf16_to_f32(oa);
        x[pb] = skv_bf16_to_f32(ob);
        if (out) out[pa] = oa, out[pb] = ob;
    }
}

/* One sequence's (slot's) W and where its prepared form goes (a region of wq_bytes). */
struct WprepArgs {
    int32_t Hk, D, Dp, r, Kp;
    const uint16_t *w; /* [r, Hk D] bf16 */
    signed char *wq;
};

/* grid (Dp / 16, Hk), 256 threads: 16 columns (two n8 tiles) of W_h of one (sequence, KV head) in
   fixed point, split into int8 halves, as the B fragments of mma m16n8k32 (col): lane (g, t) of tile nt
   holds column 8 nt + g, rows k = 4 t + j (register 0) and 16 + 4 t + j (register 1), byte j. Written
   once per W (the cache: when a slot's W is written; op level: per call), 16 bytes per (k step, tile,
   lane): hi b0, hi b1, lo b0, lo b1, and the columns' exponents (see wq_ex_off). The block reads its
   columns once (every load in flight) into shared memory, 0 past r and D. */
__global__ void __launch_bounds__(kRbNT) canon_wprep_kernel(const WprepArgs a)
{
    static_assert(kRbNT == 256, "16 columns x 16 row groups");
    const int h = blockIdx.y, tid = threadIdx.x, col = tid & 15, rg = tid >> 4;
    const int d = blockIdx.x * 16 + col;
    const uint16_t *w0 = a.w + (int64_t)h * a.D;
    const int64_t width = (int64_t)a.Hk * a.D;
    __shared__ uint16_t wt[kRbKsMax * 32][16];
    __shared__ unsigned mx_s[256];
    __shared__ int e_s[16];
    unsigned mx = 0;
#pragma unroll
    for (int i = 0; i < kRbKsMax * 2; i++) {
        const int q = rg + 16 * i;
        if (q >= a.Kp) break;
        const uint16_t v = q < a.r && d < a.D ? w0[(int64_t)q * width + d] : (uint16_t)0;
        wt[q][col] = v;
        mx = max(mx, (unsigned)(v & 0x7fffu));
    }
    mx_s[tid] = mx;
    __syncthreads();
    if (tid < 16) {
        unsigned m = mx_s[tid];
        for (int g = 1; g < 16; g++) m = max(m, mx_s[tid + 16 * g]);
        e_s[tid] = skv_canon_rebuild_ex((uint16_t)m);
        int *wex = reinterpret_cast<int *>(a.wq + wq_ex_off(a.Hk, a.Kp, a.Dp));
        wex[(int64_t)h * a.Dp + blockIdx.x * 16 + tid] = e_s[tid];
    }
    __syncthreads();
    const int NT = a.Dp / 8, KS = a.Kp / 32;
    uint4 *dst = reinterpret_cast<uint4 *>(a.wq + (int64_t)h * 2 * a.Kp * a.Dp);
    for (int it = tid; it < KS * 64; it += kRbNT) {
        const int ks = it >> 6, ntl = (it >> 5) & 1, ln = it & 31, g = ln >> 2, t = ln & 3;
        const int cl = ntl * 8 + g, e = e_s[cl];
        uint32_t hw[2] = {0, 0}, lw[2] = {0, 0};
#pragma unroll
        for (int reg = 0; reg < 2; reg++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int32_t x = skv_canon_rebuild_fix(wt[32 * ks + 16 * reg + 4 * t + j][cl], e);
                hw[reg] |= rb_hi8(x + 64) << (8 * j);
                lw[reg] |= rb_lo8(x + 64) << (8 * j);
            }
        dst[((size_t)ks * NT + blockIdx.x * 2 + ntl) * 32 + ln] = make_uint4(hw[0], hw[1], lw[0], lw[1]);
    }
}

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
__global__ void __launch_bounds__(kRbNT, RM ? SKV_RB_MINB : 2) canon_rebuild_tc_kernel(const RebuildArgs a)
{
    const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    /* split (RM 1 at decode): warps 2 ts and 2 ts + 1 share token set ts (half hh of its dims each) */
    static_assert(!SPL || RM == 1, "the split takes the rotary pairs of RoPE mode 1");
    constexpr int spl = SPL;
    const int ts = spl ? warp >> 1 : warp, hh = spl ? warp & 1 : 0;
    const int64_t mw = (int64_t)blockIdx.x * (spl ? kRbTok / 2 : kRbTok) + ts * 16; /* the warp's first token */
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
        live[rs] = m < a.M;
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
        if (m < a.M) {
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
        if (m >= a.M) continue;
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
        if (m >= a.M) continue;
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
        if (m0 + row >= a.M) continue;
        rb_score_row(a, xs + (size_t)row * a.D, qs, 4 * (unit >> 5), 1, bq0, sel0 + m0 + row);
    }
}

/* Scores at op level: grid (ceil(Tmax / 256), Hk, B), 256 threads; thread j of (b, h) computes s_j = scale x the
   fmaf chain of skv_dot_bf16 over d = 0 .. D-1 for the group's query heads, 4 at a time (their
   chains interleaved, each its own order), the key row read 64 dims at a time, and writes them to
   e[b Hq + hq][j]. smem: q [G][D] float, spans. */
__global__ void __launch_bounds__(kAtLanes) canon_score_kernel(const AttendArgs a)
{
    const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, G = a.G, D = a.D;
    float *qs = (float *)skv_canon_smem;
    CSpan *sp = (CSpan *)align_up((size_t)(qs + (size_t)G * D), 16);
    __shared__ int n_spans_s;
    if (tid == 0) n_spans_s = at_spans(a, b, h, sp);
    const uint16_t *qg = a.seqs ? (const uint16_t *)a.io->q + ((int64_t)b * a.Hq + (int64_t)h * G) * D
                                : a.q + (int64_t)h * G * D;
    for (int i = tid; i < G * D; i += kAtLanes) qs[i] = skv_bf16_to_f32(qg[i]);
    __syncthreads();
    const int ns = n_spans_s;
    const int64_t j = (int64_t)blockIdx.x * kAtLanes + tid;
    int si = 0;
    int64_t base = 0;
    if (!at_seek(sp, ns, j, si, base)) return;
    at_score_token(sp[si].k + (j - base) * sp[si].ts, qs, D, G, a.scale, a.e + ((int64_t)b * a.Hq + (int64_t)h * G) * a.Tmax,
                   a.Tmax, j);
}

/* P V: grid (ceil(D / 16), Hk, B), 256 threads (thread l = canonical lane l): the block owns 16 dims of
   every query head of the group, 4 heads at a time, and reads the weights e_j that canon_weights_kernel
   left in the workspace. Lane l walks its tokens j = l, l + 256, ... in order, span by span (a span's
   rows by a pointer step, the selected span's by its chunk slot and row, shifts where c is a power of
   two), 2 per pass (their value rows and weights all loaded first): z = z + e_j, N_d = fma(e_j, v_jd,
   N_d). Every block of a group adds the same e_j into z in the same order (the same Z). Then the fixed tree: every lane puts its 68
   values in xb, and warp w reduces values w, w + 8, ...: lane t holds lanes t + 32 i (i < 8) in
   registers, levels 128, 64, 32 there (P[k] + P[k + w]), 16 .. 1 by shuffles (lane t adds lane t + w);
   then out_d = N_d / Z. smem: xb [68][256] the tree's exchange, spans. */
constexpr int kAtNV = kAtGC * kAtDC + kAtGC; /* 68 values per lane */
constexpr int kAtTok = 2;                    /* tokens of a lane in flight */
constexpr int kAtVQ = kAtDC / 8;             /* uint4 pieces per value row */
static_assert(kAtDC % 8 == 0, "whole uint4 pieces per value row");
__global__ void __launch_bounds__(kAtLanes, 2) canon_attend_kernel(const AttendArgs a)
{
    const int h = blockIdx.y, b = blockIdx.z, lane = threadIdx.x, G = a.G, D = a.D;
    const int d0 = blockIdx.x * kAtDC;
    /* shared memory at constant offsets of skv_canon_smem (at_smem), so that its reads stay shared loads */
    constexpr size_t kSpOff = (sizeof(float) * kAtNV * kAtLanes + 15) / 16 * 16;
    float *xb = (float *)skv_canon_smem;                          /* [kAtNV][kAtLanes] */
    CSpan *sp = (CSpan *)(skv_canon_smem + kSpOff);
    /* decode: the selection's chunks of (b, h), one coalesced read instead of a dependent load per token */
    int32_t *sel_s = (int32_t *)(skv_canon_smem + kSpOff + sizeof(CSpan) * kAtMaxSpans);
    const bool sel_sm = a.seqs && a.S <= kAtSelSmem;
    const int64_t bh = (int64_t)b * a.Hk + h;
    __shared__ int n_spans_s;
    __shared__ float res[kAtNV];
    if (lane == 0) n_spans_s = at_spans(a, b, h, sp);
    if (sel_sm) {
        const int kind = a.seqs[b].vc_data ? 2 : 1;
        for (int s = lane; s < a.S; s += kAtLanes) sel_s[s] = at_sel_chunk(a, kind, bh, s);
    }
    /* decode: launched as canon_weights_kernel's dependent; the spans and the selection above were final
       before it, its weights are not */
    if (a.seqs) pdl_wait();
    __syncthreads();
    const int ns = n_spans_s;
    const int64_t bq0 = (int64_t)b * a.Hq + (int64_t)h * G;
    const bool dvec = d0 + kAtDC <= D;
    /* a selected token t's chunk slot t / c and row t mod c: by shifts where c is a power of two */
    const uint32_t c = (uint32_t)a.c, cm = c - 1, c_log = (c & cm) == 0 ? (uint32_t)(__ffs((int)c) - 1) : 32u;
    for (int gq = 0; gq < G; gq += kAtGC) {
        const int gn = min(kAtGC, G - gq);
        const float *er[kAtGC];
#pragma unroll
        for (int x = 0; x < kAtGC; x++) er[x] = a.e + (bq0 + gq + (x < gn ? x : 0)) * a.Tmax;
        float acc[kAtGC][kAtDC], z[kAtGC];
#pragma unroll
        for (int x = 0; x < kAtGC; x++) {
            z[x] = 0.0f;
#pragma unroll
            for (int y = 0; y < kAtDC; y++) acc[x][y] = 0.0f;
        }
        /* lane l's tokens j = l, l + 256, .. in order, span by span: in span si (tokens base .. base + n - 1)
           its rows t = (l - base) mod 256, + 256, .., kAtTok of them in flight */
        int64_t base = 0;
        for (int si = 0; si < ns; si++) {
            const int64_t n = sp[si].n, ts = sp[si].ts;
            const int kind = sp[si].kind;
            const uint16_t *vb = sp[si].v; /* kind 0: the span's rows; else the head's chunks in the store or cache */
            if (kind) {
                const skv_cuda_seq &sq = a.seqs[b];
                vb = kind == 1 ? (const uint16_t *)sq.vstore + (int64_t)h * sq.n_cand * a.c * D
                               : (const uint16_t *)sq.vc_data + (int64_t)h * a.vc_chunks * a.c * D;
            }
            for (int64_t t = (int64_t)((lane - base) & (kAtLanes - 1)); t < n; t += kAtTok * kAtLanes) {
                bool ok[kAtTok];
                const uint16_t *vr[kAtTok];
#pragma unroll
                for (int k = 0; k < kAtTok; k++) {
                    const int64_t tk = t + k * kAtLanes;
                    ok[k] = tk < n;
                    if (!ok[k]) {
                        vr[k] = nullptr;
                    } else if (kind == 0) {
                        vr[k] = vb + tk * ts + d0;
                    } else {
                        uint32_t sel, i;
                        if (c_log < 32) sel = (uint32_t)tk >> c_log, i = (uint32_t)tk & cm;
                        else sel = at_chunk_of(tk, a.c, i);
                        const int32_t ch = sel_sm ? sel_s[sel] : at_sel_chunk(a, kind, bh, sel);
                        vr[k] = vb + ((int64_t)ch * a.c + i) * D + d0;
                    }
                }
                float w[kAtTok][kAtGC];
                uint4 raw[kAtTok][kAtVQ];
#pragma unroll
                for (int k = 0; k < kAtTok; k++) {
#pragma unroll
                    for (int x = 0; x < kAtGC; x++) w[k][x] = ok[k] && x < gn ? __ldg(er[x] + base + t + k * kAtLanes) : 0.0f;
#pragma unroll
                    for (int qv = 0; qv < kAtVQ; qv++) raw[k][qv] = make_uint4(0, 0, 0, 0);
                    if (!ok[k]) continue;
                    const uint16_t *v = vr[k];
                    if (dvec && ((uintptr_t)v & 15) == 0) {
#pragma unroll
                        for (int qv = 0; qv < kAtVQ; qv++) raw[k][qv] = __ldg(reinterpret_cast<const uint4 *>(v) + qv);
                    } else {
#pragma unroll
                        for (int qv = 0; qv < kAtVQ; qv++) {
                            uint32_t u[8];
#pragma unroll
                            for (int y = 0; y < 8; y++) u[y] = d0 + 8 * qv + y < D ? v[8 * qv + y] : 0u;
                            raw[k][qv] = make_uint4(u[0] | (u[1] << 16), u[2] | (u[3] << 16), u[4] | (u[5] << 16), u[6] | (u[7] << 16));
                        }
                    }
                }
#pragma unroll
                for (int k = 0; k < kAtTok; k++) {
                    if (!ok[k]) break;
                    float f[kAtDC];
#pragma unroll
                    for (int qv = 0; qv < kAtVQ; qv++) bf16x8_to_f32(raw[k][qv], f + 8 * qv);
#pragma unroll
                    for (int x = 0; x < kAtGC; x++) {
                        z[x] = SKV_ADD(z[x], w[k][x]);
#pragma unroll
                        for (int y = 0; y < kAtDC; y++) acc[x][y] = SKV_FMA(w[k][x], f[y], acc[x][y]);
                    }
                }
            }
            base += n;
        }
        /* the fixed tree over the 256 lanes, a warp per value (one barrier before, one after) */
#pragma unroll
        for (int x = 0; x < kAtGC; x++) {
#pragma unroll
            for (int y = 0; y < kAtDC; y++) xb[(size_t)(x * kAtDC + y) * kAtLanes + lane] = acc[x][y];
            xb[(size_t)(kAtGC * kAtDC + x) * kAtLanes + lane] = z[x];
        }
        __syncthreads();
        {
            const int t = lane & 31;
            for (int v = lane >> 5; v < kAtNV; v += kAtLanes / 32) {
                float P[kAtLanes / 32];
#pragma unroll
                for (int i = 0; i < kAtLanes / 32; i++) P[i] = xb[(size_t)v * kAtLanes + t + 32 * i];
#pragma unroll
                for (int w = kAtLanes / 64; w >= 1; w >>= 1) /* levels 128, 64, 32: lane k + 32 i += lane k + 32 (i + w) */
#pragma unroll
                    for (int i = 0; i < w; i++) P[i] = SKV_ADD(P[i], P[i + w]);
#pragma unroll
                for (int w = 16; w >= 1; w >>= 1) P[0] = SKV_ADD(P[0], __shfl_down_sync(kFullMask, P[0], w));
                if (t == 0) res[v] = P[0];
            }
        }
        __syncthreads();
        if (lane < kAtGC * kAtDC) {
            const int x = lane / kAtDC, y = lane % kAtDC;
            float *out = a.seqs ? a.io->out : a.out;
            if (x < gn && d0 + y < D) out[(bq0 + gq + x) * D + d0 + y] = SKV_DIV(res[lane], res[kAtGC * kAtDC + x]);
        }
        /* xb and res are rewritten by the next head group only after its walk and its first barrier,
           which every lane of this group's division reaches after reading res */
    }
}

/* Weights: grid (G, Hk, B), 256 threads, a block per query head hq = h G + blockIdx.x: M = the block's
   max of the T scores (any order: see skv_canonical_attend), then e_j = skv_expf(s_j - M) in place,
   once per head (the P V blocks of a group all read these; a thread keeps its first kAtWReg scores in
   registers between the two passes). T: Tmax at op level; at decode sequence b's token count (every
   score written by the rebuild and canon_resident_kernel before). */
constexpr int kAtWReg = 12; /* scores per thread kept in registers (T <= 3072 at 256 threads) */
__global__ void __launch_bounds__(kAtLanes) canon_weights_kernel(const AttendArgs a)
{
    const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
    const int64_t bq = (int64_t)b * a.Hq + (int64_t)h * a.G + blockIdx.x;
    float *er = a.e + bq * a.Tmax;
    __shared__ float red[kAtLanes / 32];
    pdl_trigger(); /* at decode P V's blocks may start their prologue */
    const int64_t T = a.seqs ? (int64_t)a.S * a.c + skv_plan_resident_tokens(a.O, a.c, a.seqs[b].n_local, a.seqs[b].n_gen)
                             : a.Tmax;
    /* the thread's first kAtWReg scores stay in registers (all loaded at once) between the passes */
    float sv[kAtWReg];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kAtWReg; i++) {
        const int64_t j = tid + (int64_t)i * kAtLanes;
        sv[i] = j < T ? er[j] : -INFINITY;
        mx = fmaxf(mx, sv[i]);
    }
#pragma unroll 4
    for (int64_t j = tid + (int64_t)kAtWReg * kAtLanes; j < T; j += kAtLanes) mx = fmaxf(mx, er[j]);
    mx = warp_max(mx);
    if ((tid & 31) == 0) red[tid >> 5] = mx;
    __syncthreads();
    float M = red[0];
#pragma unroll
    for (int i = 1; i < kAtLanes / 32; i++) M = fmaxf(M, red[i]);
#pragma unroll
    for (int i = 0; i < kAtWReg; i++) {
        const int64_t j = tid + (int64_t)i * kAtLanes;
        if (j < T) er[j] = skv_expf(SKV_SUB(sv[i], M));
    }
#pragma unroll 4
    for (int64_t j = tid + (int64_t)kAtWReg * kAtLanes; j < T; j += kAtLanes) er[j] = skv_expf(SKV_SUB(er[j], M));
}

size_t at_score_smem(int32_t G, int32_t D, int32_t n_spans)
{
    return sizeof(float) * (size_t)G * D + 16 + sizeof(CSpan) * (size_t)(n_spans > SKV_N_SPANS ? n_spans : SKV_N_SPANS);
}

size_t at_smem(int32_t n_spans, int32_t S)
{
    return sizeof(float) * (size_t)kAtNV * kAtLanes + 16 + sizeof(CSpan) * (size_t)kAtMaxSpans +
           (S > 0 && S <= kAtSelSmem ? sizeof(int32_t) * (size_t)S : 0);
}

/* Blocks of the resident tokens' scores per (sequence, KV head) at decode, for at most n_res of them. */
int32_t rb_nx(int64_t n_res) { return (int32_t)(n_res < kRbNT ? 1 : n_res >= 8 * kRbNT ? 8 : ceil_div64(n_res, kRbNT)); }

/* Blocks per (sequence, KV head) of a rebuild launch with tiles of tok tokens. */
int64_t rb_blocks(const RebuildArgs &a, int tok) { return ceil_div64(a.M, tok); }

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

RebuildArgs rebuild_args(const skv_cuda_shape *sh, const skv_cuda_seq *seqs, const int32_t *ids, skv_bf16 *k_out)
{
    RebuildArgs a;
    memset(&a, 0, sizeof a);
    a.Hk = sh->Hk, a.D = sh->D, a.Dp = (sh->D + 15) / 16 * 16, a.r = sh->r, a.Kp = (sh->r + 31) / 32 * 32;
    a.c = sh->c, a.S = sh->S, a.R = sh->rotary_dim, a.interleaved = sh->interleaved;
    a.M = (int64_t)sh->S * sh->c;
    a.seqs = seqs, a.ids = ids, a.cos_tab = sh->cos_tab, a.sin_tab = sh->sin_tab, a.k_out = k_out;
    return a;
}

/* Op level (seqs NULL): the scores of every span (canon_score_kernel), the weights, P V. Decode: the
   weights (the rebuild and canon_resident_kernel wrote the scores), P V. */
cudaError_t launch_attend(cudaStream_t st, const AttendArgs &a, int32_t B, int64_t T)
{
    if (a.Hk > kMaxGridYZ || B > kMaxGridYZ) return cudaErrorInvalidValue;
    if (T <= 0) return cudaSuccess;
    const size_t s1 = at_score_smem(a.G, a.D, a.n_spans), s2 = at_smem(a.n_spans, a.seqs ? a.S : 0);
    if (s1 > 220 * 1024) return cudaErrorInvalidValue; /* a query group of more than ~200 heads of D 128 */
    cudaError_t e = allow_smem(canon_attend_kernel, s2);
    if (e != cudaSuccess) return e;
    if (!a.seqs) {
        e = allow_smem(canon_score_kernel, s1);
        if (e != cudaSuccess) return e;
        e = launch(canon_score_kernel, dim3((unsigned)ceil_div64(T, kAtLanes), (unsigned)a.Hk, (unsigned)B),
                   dim3(kAtLanes), s1, st, false, a);
        if (e != cudaSuccess) return e;
    }
    e = launch(canon_weights_kernel, dim3((unsigned)a.G, (unsigned)a.Hk, (unsigned)B), dim3(kAtLanes), 0, st, false, a);
    if (e != cudaSuccess) return e;
    return launch(canon_attend_kernel, dim3((unsigned)((a.D + kAtDC - 1) / kAtDC), (unsigned)a.Hk, (unsigned)B),
                  dim3(kAtLanes), s2, st, a.seqs != nullptr, a);
}

} /* namespace */

size_t skv_cuda_canon_wq_bytes(int32_t Hk, int32_t D, int32_t r)
{
    return wq_bytes(Hk, (r + 31) / 32 * 32, (D + 15) / 16 * 16);
}

int skv_cuda_canon_uses_wq(const skv_cuda_shape *sh, int decode)
{
    const RebuildArgs a = rebuild_args(sh, nullptr, nullptr, nullptr);
    size_t smem;
    return rb_tc(a, decode ? sh->Hq / sh->Hk : 0 /* as launch_rebuild's, e set or not */, &smem);
}

cudaError_t skv_cuda_canon_wprep(cudaStream_t st, int32_t Hk, int32_t D, int32_t r, const skv_bf16 *w, void *wq)
{
    WprepArgs a;
    memset(&a, 0, sizeof a);
    a.Hk = Hk, a.D = D, a.Dp = (D + 15) / 16 * 16, a.r = r, a.Kp = (r + 31) / 32 * 32;
    a.w = (const uint16_t *)w, a.wq = (signed char *)wq;
    if (a.Kp / 32 > kRbKsMax || Hk > kMaxGridYZ || !w || !wq) return cudaErrorInvalidValue;
    return launch(canon_wprep_kernel, dim3((unsigned)(a.Dp / 16), (unsigned)Hk), dim3(kRbNT), 0, st, false, a);
}

cudaError_t skv_cuda_canon_rebuild(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                   const int32_t *chunk_ids, skv_bf16 *k_out, const void *wq)
{
    RebuildArgs a = rebuild_args(sh, seqs, chunk_ids, k_out);
    a.wq = (const signed char *)wq;
    return launch_rebuild(st, a, sh->B);
}

/* The decode step's rebuild launch. */
static RebuildArgs decode_rebuild_args(const skv_cuda_shape *sh, const skv_cuda_seq *seqs, const skv_cuda_dws *ws)
{
    RebuildArgs a = rebuild_args(sh, seqs, ws->sel_ids, nullptr);
    a.wq_seq = skv_cuda_canon_uses_wq(sh, 1); /* the slots' W, prepared when it was written */
    a.e = ws->canon_e, a.io = ws->io, a.Tmax = ws->canon_tmax;
    a.Hq = sh->Hq, a.G = sh->Hq / sh->Hk, a.O = sh->O, a.scale = sh->scale;
    a.gen_cap = sh->gen_cap, a.nx = rb_nx(ws->canon_tmax - a.M);
    return a;
}

/* Whether a decode rebuild splits each tile's dims over two warps (RebuildArgs::split): where the shape
   allows it (RoPE mode 1 with R == D, R % 32 == 0, the tensor-core kernel) and the 128-token grid would
   leave the device part idle (fewer blocks than two per multiprocessor, as at batch 1): a block's time is
   then its warps' dependent chain, and each of the two warps runs half the sums and scores half the
   heads. Where the grid fills the device the split only adds work (both warps load and convert the U
   rows). SKV_CUDA_REBUILD_SPLIT = 0 or 1 overrides the grid test (the tests run both kernels). */
static int rb_split(const RebuildArgs &a, int32_t B)
{
    size_t smem;
    if (!rb_uses_tc(a, &smem) || rb_rope_mode(a.R, a.interleaved) != 1 || !a.e || a.k_out || a.R != a.D ||
        a.R % 32 != 0 || a.Dp != a.D)
        return 0;
    static int env = -2; /* read once (a benign race: every reader computes the same value) */
    if (env == -2) {
        const char *v = getenv("SKV_CUDA_REBUILD_SPLIT");
        env = v && (v[0] == '0' || v[0] == '1') && !v[1] ? v[0] - '0' : -1;
    }
    if (env >= 0) return env;
    return rb_blocks(a, kRbTok) * a.Hk * B < 2 * (int64_t)num_sms();
}

cudaError_t skv_cuda_canon_decode_rebuild(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                          const skv_cuda_dws *ws)
{
    RebuildArgs a = decode_rebuild_args(sh, seqs, ws);
    a.split = rb_split(a, sh->B);
    return launch_rebuild(st, a, sh->B);
}

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

cudaError_t skv_cuda_canon_decode_attend(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                         const skv_cuda_dws *ws)
{
    AttendArgs a;
    memset(&a, 0, sizeof a);
    a.Hq = sh->Hq, a.Hk = sh->Hk, a.G = sh->Hq / sh->Hk, a.D = sh->D, a.scale = sh->scale;
    a.Tmax = ws->canon_tmax, a.e = ws->canon_e;
    a.seqs = seqs, a.io = ws->io;
    a.sel_idx = ws->sel_idx, a.vsrc = ws->vsrc;
    a.O = sh->O, a.c = sh->c, a.S = sh->S, a.gen_cap = sh->gen_cap, a.vc_chunks = sh->vc_chunks;
    a.n_spans = SKV_N_SPANS;
    return launch_attend(st, a, sh->B, ws->canon_tmax);
}

cudaError_t skv_cuda_canon_span_attention(cudaStream_t st, int32_t Hq, int32_t Hk, int32_t D, float scale,
                                          const skv_bf16 *q, int32_t n_spans, const skv_kv_span *spans, float *out,
                                          float *e, int64_t T)
{
    if (n_spans > kAtMaxSpans) return cudaErrorInvalidValue;
    AttendArgs a;
    memset(&a, 0, sizeof a);
    a.Hq = Hq, a.Hk = Hk, a.G = Hq / Hk, a.D = D, a.scale = scale, a.Tmax = T, a.e = e;
    a.q = (const uint16_t *)q, a.out = out, a.n_spans = n_spans;
    for (int i = 0; i < n_spans; i++) a.spans[i] = spans[i];
    return launch_attend(st, a, 1, T);
}

