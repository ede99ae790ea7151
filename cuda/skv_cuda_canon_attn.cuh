/*
 * skv_cuda_canon_attn.cuh - what the reproducible mode's rebuild and attention files of cuda/
 * share (skv_cuda_canon_rebuild.cu, skv_cuda_canon_wprep.cu, skv_cuda_canon_resident.cu,
 * skv_cuda_canon_attend.cu; all built with --fmad=false, the Makefile's CU_EXACT): the
 * canonical attention's spans and arguments (CSpan, AttendArgs) and its per-token score, the
 * rebuild's arguments (RebuildArgs), the layout of W's prepared form, the fixed-point and
 * scoring helpers, and the host-side argument builders. Header-only, in an anonymous namespace
 * (each file has its own copy). Every float operation is an SKV_* macro of lib/skv_numerics.h
 * (an explicitly rounded __f*_rn intrinsic), so the results are those of ref, bit for bit
 * (docs/DESIGN.md 10.2, 10.3).
 */
#ifndef SKV_CUDA_CANON_ATTN_CUH
#define SKV_CUDA_CANON_ATTN_CUH

#include <cuda_runtime.h>
#include <mma.h>
#include <stdint.h>
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
    int64_t eb; /* the place of its first token's score in a row of e (decode: the selected span has room
                   for S c tokens there, a head with k < S chunks uses its first k c) */
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
    const int32_t *sel_cnt;        /* [B, Hk] the step's counts (NULL: S every head) */
    int32_t O, c, S, gen_cap, vc_chunks;
    int32_t value_dtype;           /* the selected span's records: vrec bytes each (skv_cuda_shape) */
    int64_t vrec;
};

/* The five spans of (sequence b, KV head h) at decode into sp[] (skv_plan_spans; the selected span's
   keys are not read: the rebuild scored them), the selected one with kc tokens (k c: the head's count;
   S c for the resident scores, which run before the selection), each span's scores at eb in e with
   room for S c selected tokens. */
__device__ void at_seq_spans(const skv_cuda_seq &sq, const skv_cuda_io *io, int b, int h, int32_t Hk, int32_t D,
                             int32_t O, int32_t c, int32_t S, int32_t gen_cap, int64_t kc, CSpan *sp)
{
    skv_span_shape sh[SKV_N_SPANS];
    skv_plan_spans(O, c, S, D, sq.n_local, sq.n_gen, gen_cap, sh);
    int64_t eb = 0;
    for (int i = 0; i < SKV_N_SPANS; i++) {
        sp[i].eb = eb;
        eb += sh[i].n_tokens;
    }
    sh[SKV_SPAN_SELECTED].n_tokens = kc;
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
        int64_t eb = 0;
        for (int i = 0; i < a.n_spans; i++) {
            const skv_kv_span &s = a.spans[i];
            sp[i].eb = eb;
            eb += s.n_tokens;
            sp[i].n = s.n_tokens;
            sp[i].ts = s.token_stride;
            sp[i].k = s.n_tokens ? (const uint16_t *)s.k + h * s.head_stride : nullptr;
            sp[i].v = s.n_tokens ? (const uint16_t *)s.v + h * s.head_stride : nullptr;
            sp[i].kind = 0;
        }
        return a.n_spans;
    }
    const int64_t kc = (int64_t)(a.sel_cnt ? a.sel_cnt[(int64_t)b * a.Hk + h] : a.S) * a.c;
    at_seq_spans(a.seqs[b], a.io, b, h, a.Hk, a.D, a.O, a.c, a.S, a.gen_cap, kc, sp);
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
/* Blocks per multiprocessor the register allocation aims at (the tensor-core kernel's launch bound): 2.
   Three fit at D 128, r 160, G 4 for RoPE modes 1 and 2 (75 KB of shared memory, 80 registers with 144
   bytes of spills), but measured slower on the H200 (rebuild 107 against 91 us per step, the 128k x 8
   step 0.311 / 0.323 against 0.295 / 0.305 ms). */

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
    const int32_t *cnt;        /* [B, Hk] decode: the step's counts, head (b, h) rebuilds its first cnt c
                                  tokens (NULL: M every head) */
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

/* The tokens (b, h) rebuilds: its count's k c at decode (none for an idle row), else M. */
__device__ __forceinline__ int64_t rb_M(const RebuildArgs &a, int b, int h)
{
    if (a.seqs && a.seqs[b].idle) return 0;
    return a.cnt ? (int64_t)a.cnt[(int64_t)b * a.Hk + h] * a.c : a.M;
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
   no carry reaches them) and the low word (T << 7) | (c3 & 127). dev/emu/canon_key_emu.c compares
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

/* ---- host side ------------------------------------------------------------------------------------ */

/* Blocks of the resident tokens' scores per (sequence, KV head) at decode, for at most n_res of them. */
inline int32_t rb_nx(int64_t n_res) { return (int32_t)(n_res < kRbNT ? 1 : n_res >= 8 * kRbNT ? 8 : ceil_div64(n_res, kRbNT)); }

/* Blocks per (sequence, KV head) of a rebuild launch with tiles of tok tokens. */
inline int64_t rb_blocks(const RebuildArgs &a, int tok) { return ceil_div64(a.M, tok); }

inline RebuildArgs rebuild_args(const skv_cuda_shape *sh, const skv_cuda_seq *seqs, const int32_t *ids, skv_bf16 *k_out)
{
    RebuildArgs a;
    memset(&a, 0, sizeof a);
    a.Hk = sh->Hk, a.D = sh->D, a.Dp = (sh->D + 15) / 16 * 16, a.r = sh->r, a.Kp = (sh->r + 31) / 32 * 32;
    a.c = sh->c, a.S = sh->S, a.R = sh->rotary_dim, a.interleaved = sh->interleaved;
    a.M = (int64_t)sh->S * sh->c;
    a.seqs = seqs, a.ids = ids, a.cos_tab = sh->cos_tab, a.sin_tab = sh->sin_tab, a.k_out = k_out;
    return a;
}

/* The decode step's rebuild launch. */
inline RebuildArgs decode_rebuild_args(const skv_cuda_shape *sh, const skv_cuda_seq *seqs, const skv_cuda_dws *ws)
{
    RebuildArgs a = rebuild_args(sh, seqs, ws->sel_ids, nullptr);
    a.wq_seq = skv_cuda_canon_uses_wq(sh, 1); /* the slots' W, prepared when it was written */
    a.e = ws->canon_e, a.io = ws->io, a.Tmax = ws->canon_tmax;
    a.cnt = ws->sel_cnt;
    a.Hq = sh->Hq, a.G = sh->Hq / sh->Hk, a.O = sh->O, a.scale = sh->scale;
    a.gen_cap = sh->gen_cap, a.nx = rb_nx(ws->canon_tmax - a.M);
    return a;
}

} /* namespace */

#endif /* SKV_CUDA_CANON_ATTN_CUH */
