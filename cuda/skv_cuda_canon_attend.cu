/*
 * skv_cuda_canon_attend.cu - the reproducible mode's canonical attention (docs/DESIGN.md 10.3): at
 * decode skv_cuda_canon_decode_attend (the cache's decode step, in skv_cuda_backend.cu, after
 * skv_cuda_canon_decode_rebuild, skv_cuda_canon_decode_resident and, for host slots, the fetch),
 * at op level skv_cuda_canon_span_attention (the sparse_attention_canonical slot of the dispatch
 * table). Kernels: canon_score_kernel (op level only: the scores of every span, a thread per
 * (token, KV head)), canon_weights_kernel (a block per (query head, sequence): M by a block max of
 * the T scores, then e_j = skv_expf(s_j - M) in place, once per head), canon_attend_kernel (at
 * decode the weights kernel's programmatic dependent: its spans and the selection's chunks staged
 * in shared memory before the weights are final; a block of 256 threads per (16 dims, a 32-byte
 * sector of a value row; KV head, sequence), thread l = canonical lane l: per 4 query heads, lane
 * l walks its tokens j = l, l + 256, ... in order, 2 in flight: z += e_j, N_d = fma(e_j, v_jd,
 * N_d) for the block's 16 dims (the 4 heads share each V load; every block of a group adds the
 * same e_j into Z in the same order). The fixed tree: every lane's 68 values into shared memory,
 * then a warp per value, lane t holding lanes t + 32 i: levels 128, 64, 32 in registers, 16 .. 1
 * by shuffles (lane k adds lane k + w's value), then N_d / Z.) Built with --fmad=false
 * (CU_EXACT): the results are ref's, bit for bit. fp8 value records (a.value_dtype): the selected
 * span's 16 codes of a block in one 16-byte load, decoded to the exact floats of skv_fp8_decode.
 */
#include <cuda_runtime.h>
#include <mma.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_cuda_canon_attn.cuh"
#include "skv_cuda_fp8.cuh"
#include "skv_numerics.h"
#include "skv_plan.h"

namespace {


/* Scores at op level: grid (ceil(Tmax / 256), Hk, B), 256 threads; thread j of (b, h) computes s_j = scale x the
   fmaf chain of skv_dot_bf16 over d = 0 .. D-1 for the group's query heads, 4 at a time (their
   chains interleaved, each its own order), the key row read 64 dims at a time, and writes them to
   e[b Hq + hq][j]. smem: q [G][D] float, spans. */
__global__ void __launch_bounds__(kAtLanes) canon_score_kernel(const AttendArgs a)
{
    const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x, G = a.G, D = a.D;
    if (a.seqs && a.seqs[b].idle) return; /* an idle row: nothing read or written */
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
static_assert(kAtDC == 16, "one uint4 of fp8 codes per value row");
__global__ void __launch_bounds__(kAtLanes, 2) canon_attend_kernel(const AttendArgs a)
{
    const int h = blockIdx.y, b = blockIdx.z, lane = threadIdx.x, G = a.G, D = a.D;
    const int d0 = blockIdx.x * kAtDC;
    if (a.seqs && a.seqs[b].idle) return; /* an idle row: no output */
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
            const uint16_t *vb = sp[si].v; /* kind 0: the span's rows */
            const unsigned char *rb = nullptr; /* else the head's chunk records in the store or cache */
            if (kind) {
                const skv_cuda_seq &sq = a.seqs[b];
                rb = kind == 1 ? sq.vstore + (int64_t)h * sq.n_cand * a.vrec : sq.vc_data + (int64_t)h * a.vc_chunks * a.vrec;
            }
            /* fp8 records (span-uniform): vr[k] points at the token's codes d0 .., ex[k] is its exponent */
            const bool f8 = kind && a.value_dtype == SKV_VALUE_FP8;
            for (int64_t t = (int64_t)((lane - base) & (kAtLanes - 1)); t < n; t += kAtTok * kAtLanes) {
                bool ok[kAtTok];
                const uint16_t *vr[kAtTok];
                int32_t ex[kAtTok];
#pragma unroll
                for (int k = 0; k < kAtTok; k++) {
                    const int64_t tk = t + k * kAtLanes;
                    ok[k] = tk < n;
                    ex[k] = 0;
                    if (!ok[k]) {
                        vr[k] = nullptr;
                    } else if (kind == 0) {
                        vr[k] = vb + tk * ts + d0;
                    } else {
                        uint32_t sel, i;
                        if (c_log < 32) sel = (uint32_t)tk >> c_log, i = (uint32_t)tk & cm;
                        else sel = at_chunk_of(tk, a.c, i);
                        const int32_t ch = sel_sm ? sel_s[sel] : at_sel_chunk(a, kind, bh, sel);
                        const unsigned char *rec = rb + (int64_t)ch * a.vrec;
                        if (f8) {
                            vr[k] = reinterpret_cast<const uint16_t *>(rec + (int64_t)i * D + d0);
                            ex[k] = fp8_exp(rec, (int32_t)i, a.c, D);
                        } else {
                            vr[k] = reinterpret_cast<const uint16_t *>(rec) + (int64_t)i * D + d0;
                        }
                    }
                }
                float w[kAtTok][kAtGC];
                uint4 raw[kAtTok][kAtVQ];
#pragma unroll
                for (int k = 0; k < kAtTok; k++) {
#pragma unroll
                    for (int x = 0; x < kAtGC; x++) w[k][x] = ok[k] && x < gn ? __ldg(er[x] + sp[si].eb + t + k * kAtLanes) : 0.0f;
#pragma unroll
                    for (int qv = 0; qv < kAtVQ; qv++) raw[k][qv] = make_uint4(0, 0, 0, 0);
                    if (!ok[k]) continue;
                    const uint16_t *v = vr[k];
                    if (f8) { /* 16 codes: one 16-byte load where it can */
                        const uint8_t *c8 = reinterpret_cast<const uint8_t *>(v);
                        if (dvec && ((uintptr_t)c8 & 15) == 0) {
                            raw[k][0] = __ldg(reinterpret_cast<const uint4 *>(c8));
                        } else {
                            const uint2 lo = fp8_load8_slow(c8, D - d0), hi = fp8_load8_slow(c8 + 8, D - d0 - 8);
                            raw[k][0] = make_uint4(lo.x, lo.y, hi.x, hi.y);
                        }
                    } else if (dvec && ((uintptr_t)v & 15) == 0) {
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
                    if (f8) {
                        fp8x16_to_f32(raw[k][0], ex[k], f); /* the decoded values, exactly */
                    } else {
#pragma unroll
                        for (int qv = 0; qv < kAtVQ; qv++) bf16x8_to_f32(raw[k][qv], f + 8 * qv);
                    }
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
    if (a.seqs && a.seqs[b].idle) return; /* an idle row: no weights */
    /* the head's T tokens j (logical: its own k c selected tokens) sit at e's places at(j): the selected span
       has room for S c scores there, so the tokens after a head's k c selected ones are (S - k) c further on */
    int64_t T = a.Tmax, jsel = T, gap = 0;
    if (a.seqs) {
        const skv_cuda_seq &sq = a.seqs[b];
        const int64_t kc = (int64_t)(a.sel_cnt ? a.sel_cnt[(int64_t)b * a.Hk + h] : a.S) * a.c;
        T = kc + skv_plan_resident_tokens(a.O, a.c, sq.n_local, sq.n_gen);
        jsel = (int64_t)a.O * a.c + sq.n_local + kc;
        gap = (int64_t)a.S * a.c - kc;
    }
    auto at = [=](int64_t j) { return j < jsel ? j : j + gap; };
    /* the thread's first kAtWReg scores stay in registers (all loaded at once) between the passes */
    float sv[kAtWReg];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kAtWReg; i++) {
        const int64_t j = tid + (int64_t)i * kAtLanes;
        sv[i] = j < T ? er[at(j)] : -INFINITY;
        mx = fmaxf(mx, sv[i]);
    }
#pragma unroll 4
    for (int64_t j = tid + (int64_t)kAtWReg * kAtLanes; j < T; j += kAtLanes) mx = fmaxf(mx, er[at(j)]);
    mx = warp_max(mx);
    if ((tid & 31) == 0) red[tid >> 5] = mx;
    __syncthreads();
    float M = red[0];
#pragma unroll
    for (int i = 1; i < kAtLanes / 32; i++) M = fmaxf(M, red[i]);
#pragma unroll
    for (int i = 0; i < kAtWReg; i++) {
        const int64_t j = tid + (int64_t)i * kAtLanes;
        if (j < T) er[at(j)] = skv_expf(SKV_SUB(sv[i], M));
    }
#pragma unroll 4
    for (int64_t j = tid + (int64_t)kAtWReg * kAtLanes; j < T; j += kAtLanes) er[at(j)] = skv_expf(SKV_SUB(er[at(j)], M));
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

cudaError_t skv_cuda_canon_decode_attend(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                         const skv_cuda_dws *ws)
{
    AttendArgs a;
    memset(&a, 0, sizeof a);
    a.Hq = sh->Hq, a.Hk = sh->Hk, a.G = sh->Hq / sh->Hk, a.D = sh->D, a.scale = sh->scale;
    a.Tmax = ws->canon_tmax, a.e = ws->canon_e;
    a.seqs = seqs, a.io = ws->io;
    a.sel_idx = ws->sel_idx, a.vsrc = ws->vsrc;
    a.sel_cnt = sh->S > 0 ? ws->sel_cnt : NULL;
    a.O = sh->O, a.c = sh->c, a.S = sh->S, a.gen_cap = sh->gen_cap, a.vc_chunks = sh->vc_chunks;
    a.value_dtype = sh->value_dtype, a.vrec = sh->vrec;
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
