/*
 * skv_cuda_select.cu - steps 2 and 3 of a decode's selection and the entry that runs
 * steps 1-3 (skv_cuda_select_step; skv_cuda.h lists the steps): e_j = exp(s_j - M)
 * and their canonical sum Z per query head (expsum_kernel), a_j, the top-S per tile of
 * candidates and the merge of the tiles' winners (select_kernel), or both steps in
 * one CTA per (sequence, KV head) (selz_kernel); then the published selection and, for
 * a host-placed slot, the chunk cache's plan (select_finish: hits, misses, the entries
 * they replace, lib/skv_plan.h). Step 1 is skv_cuda_score (skv_cuda_score.cu).
 *
 * Reached from the op-level slot score_select (skv_cuda_score_select_op,
 * skv_cuda_ops.cu) and from every decode step of the cache (skv_cuda_enqueue_step,
 * skv_cuda_cache.cu; with the rescoring, skv_cuda_select_candidates is its first stage, reached
 * through skv_cuda_rescore_step). select_finish, the mass rule's count and the shared state are in
 * skv_cuda_select.cuh (the rescoring's kernel uses them too). On the decision path: built with
 * --fmad=false; the canonical sum runs skv_canonical_sum's lanes and tree, the top-S is the exact
 * block top-k of skv_cuda_topk.cuh.
 *
 * Launchers only enqueue work; they never allocate or synchronize.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "skv_cuda.h"
#include "skv_cuda_common.cuh"
#include "skv_cuda_exact.cuh"
#include "skv_cuda_select.cuh"
#include "skv_cuda_topk.cuh"
#include "skv_numerics.h"

namespace {

/* ---- decode selection: step 2, e_j and their canonical sum ----------------------------------- */

constexpr int kExNT = 256;                 /* = SKV_CANON_LANES: one lane per canonical partial */
constexpr int kExPer = 8;                  /* e_j per thread */
constexpr int kExTile = kExNT * kExPer;    /* candidates per block */
static_assert(kExNT == SKV_CANON_LANES, "the canonical sum has 256 lanes");

/*
 * grid (X, Hq, B). M = s_0 if it is NaN (ref's scan starts there and NaN never compares
 * greater), else the max of the non-NaN scores (the sign of a zero max changes no e_j).
 * Each block turns its tile of scores into e_j = skv_expf(s_j - M) in place. The last block
 * of (b, qh) (a counter after a fence) computes Z = canonical sum of e: lane k adds
 * e_k, e_{k+256}, ... in order (loads from L2, 8 in flight), then the fixed pairwise tree.
 */
__global__ void __launch_bounds__(kExNT)
    expsum_kernel(const skv_cuda_shape sh, const skv_cuda_seq *seqs, float *scores, const unsigned *macc,
                  const float *s0, float *Z, unsigned *cnt)
{
    __shared__ float part[kExNT];
    __shared__ int last;
    pdl_wait();
    const int tid = threadIdx.x;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t qh = blockIdx.y; qh < sh.Hq; qh += gridDim.y) {
            const int32_t n = seqs[b].n_cand, nblk = (int32_t)ceil_div64(n, kExTile);
            if ((int32_t)blockIdx.x >= nblk) continue; /* block-uniform */
            const int64_t row = (int64_t)b * sh.Hq + qh;
            float *s = scores + row * sh.cand_max;
            const float first = s0[row];
            const float M = first != first ? first : order_desc_inv(macc[row]);
            const int32_t j0 = blockIdx.x * kExTile;
            float x[kExPer];
#pragma unroll
            for (int u = 0; u < kExPer; u++) {
                const int32_t j = j0 + u * kExNT + tid;
                x[u] = j < n ? s[j] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < kExPer; u++) {
                const int32_t j = j0 + u * kExNT + tid;
                if (j < n) s[j] = skv_expf(SKV_SUB(x[u], M));
            }
            __threadfence();
            __syncthreads();
            if (tid == 0) last = atomicAdd(&cnt[row], 1u) == (unsigned)nblk - 1;
            __syncthreads();
            if (!last) continue; /* block-uniform */
            __threadfence();
            /* lane tid's chain: 16 loads in flight, the next batch loaded before this one is added
               (adding the zeros past n changes no sum: e >= 0) */
            constexpr int PF = 16;
            float P = 0.0f, cur[PF], nxt[PF];
#pragma unroll
            for (int u = 0; u < PF; u++) {
                const int32_t j = tid + u * kExNT;
                cur[u] = j < n ? __ldcg(s + j) : 0.0f;
            }
            for (int32_t j0 = tid; j0 < n; j0 += PF * kExNT) {
#pragma unroll
                for (int u = 0; u < PF; u++) {
                    const int32_t j = j0 + (PF + u) * kExNT;
                    nxt[u] = j < n ? __ldcg(s + j) : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < PF; u++) P = SKV_ADD(P, cur[u]);
#pragma unroll
                for (int u = 0; u < PF; u++) cur[u] = nxt[u];
            }
            part[tid] = P;
            const float v = canon_tree(part, tid);
            if (tid == 0) {
                Z[row] = v;
                cnt[row] = 0;
            }
            __syncthreads(); /* part and last are reused by the next (b, qh) */
        }
    pdl_trigger();
}

/* ---- decode selection: step 3, top-S per tile, merge, chunk-cache plan ------------------------ */

constexpr int kSeNT = 512;               /* threads per tile block */
constexpr int kSePer = 8;                /* candidates per thread */
constexpr int kSeTile = kSeNT * kSePer;  /* candidates per tile */

using SelectSmem = SelectSmemT<kSeNT>;
/* Keys in shared memory at key_slot(i): one pad word per 32 keys, so that both the strided
   reads of the radix passes and the contiguous runs of the ordered compaction are free of
   bank conflicts. */
__device__ __forceinline__ int32_t key_slot(int32_t i) { return i + (i >> 5); }
constexpr int32_t kSeKeyWords = kSeTile + kSeTile / 32; /* then, SKV_SELECT_MASS: the walk's batch */
constexpr size_t kSeKeyBytes = (size_t)kSeKeyWords * sizeof(uint32_t);
static_assert(kSeKeyBytes % 16 == 0, "the batch after the keys is aligned");

/*
 * grid (X, Hk, B), block (x, h, b): tile x of kSeTile candidates of (b, h).
 *  1. a_j = p of query head 0, then a = p if p > a for g = 1.. in order (ref's loop, NaN
 *     included), p = SKV_DIV(e_j, Z); keys order_desc(skv_select_key(a_j)) in shared memory;
 *  2. the tile's top min(S, count) (block_topk): with one tile they are the selection; else
 *     they go to the pool (key << 32 | j, increasing j within the tile, tiles in order: the pool
 *     is in increasing j) and the last tile block of (b, h) selects the top S of the pool.
 */
__global__ void __launch_bounds__(kSeNT) select_kernel(const SelectArgs a)
{
    __shared__ SelectSmem sm;
    extern __shared__ __align__(16) uint32_t se_keys[];
    if (threadIdx.x == 0) sm.keys = se_keys;
    pdl_wait();
    pdl_trigger(); /* the attention's resident items need nothing of this kernel */
    __syncthreads();
    const skv_cuda_shape &sh = a.sh;
    const int tid = threadIdx.x;
    const int32_t G = sh.Hq / sh.Hk, S = sh.S;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t h = blockIdx.y; h < sh.Hk; h += gridDim.y) {
            const int32_t n = a.seqs[b].n_cand, ntl = (int32_t)ceil_div64(n, kSeTile);
            if ((int32_t)blockIdx.x >= ntl) continue; /* block-uniform */
            const int64_t bh = (int64_t)b * sh.Hk + h, cm = sh.cand_max;
            const int32_t j0 = blockIdx.x * kSeTile, cnt = min(kSeTile, n - j0);
            const float *e0 = a.e + ((int64_t)b * sh.Hq + (int64_t)h * G) * cm;
            const float *Zr = a.Z + (int64_t)b * sh.Hq + (int64_t)h * G;
            /* keys of the tile into shared memory, strided over the threads (coalesced loads, four
               items' worth in flight per thread) */
            float zr[8];
#pragma unroll
            for (int g = 0; g < 8; g++) zr[g] = g < G ? Zr[g] : 1.0f;
#pragma unroll
            for (int it = 0; it < kSePer; it++) {
                const int32_t i = it * kSeNT + tid, j = j0 + i;
                if (i < cnt) {
                    float ev[8];
#pragma unroll
                    for (int g = 0; g < 8; g++) ev[g] = g < G ? e0[g * cm + j] : 0.0f;
                    float av = SKV_DIV(ev[0], zr[0]);
#pragma unroll
                    for (int g = 1; g < 8; g++) {
                        if (g >= G) break;
                        const float p = SKV_DIV(ev[g], zr[g]);
                        if (p > av) av = p;
                    }
                    for (int32_t g = 8; g < G; g++) { /* groups above 8 query heads */
                        const float p = SKV_DIV(e0[g * cm + j], Zr[g]);
                        if (p > av) av = p;
                    }
                    sm.keys[key_slot(i)] = order_desc(skv_select_key(av));
                    if (a.amax) a.amax[bh * cm + j] = av;
                    if (a.mkey) a.mkey[bh * cm + j] = skv_mass_weight(skv_select_key(av));
                }
            }
            __syncthreads();
            int32_t *sel = a.sel_idx + bh * S;
            unsigned long long *pool = a.pool + bh * a.pool_cap + (int64_t)blockIdx.x * S;
            const int32_t kt = min(S, cnt);
            if (ntl == 1) {
                const uint32_t *keys = sm.keys;
                const int32_t k = select_count<kSeNT>(
                    a, n, [=](int32_t i) { return keys[key_slot(i)]; }, [](int32_t i) { return i; },
                    [=](int32_t j) { return skv_mass_weight(order_desc_inv(keys[key_slot(j)])); },
                    reinterpret_cast<unsigned long long *>(se_keys + kSeKeyWords), sm);
                block_topk<kSeNT, false>(
                    cnt, k, [=](int32_t i) { return keys[key_slot(i)]; }, [=](int32_t pos, int32_t i) { sel[pos] = j0 + i; },
                    [](int32_t, int32_t) {}, sm.tk);
                __syncthreads(); /* sel complete */
                select_finish(a, b, h, k, sm);
                continue;
            }
            const uint32_t *keys = sm.keys;
            block_topk<kSeNT, false>(
                cnt, kt, [=](int32_t i) { return keys[key_slot(i)]; },
                [=](int32_t pos, int32_t i) {
                    pool[pos] = ((unsigned long long)keys[key_slot(i)] << 32) | (uint32_t)(j0 + i);
                },
                [](int32_t, int32_t) {}, sm.tk);
            __threadfence();
            __syncthreads();
            if (tid == 0) sm.last = atomicAdd(&a.cnt[bh], 1u) == (unsigned)ntl - 1;
            __syncthreads();
            if (!sm.last) continue; /* block-uniform */
            __threadfence();
            /* the pool: full tiles gave S each (a tile holds at least S... or all its items) */
            const int32_t per_tile = min(S, kSeTile), last_cnt = n - (ntl - 1) * kSeTile;
            const int32_t np = (ntl - 1) * per_tile + min(S, last_cnt);
            const unsigned long long *pl = a.pool + bh * a.pool_cap;
            /* pool index -> entry: tile t's winners start at t * S */
            auto at = [=](int32_t i) {
                const int32_t t = i / per_tile;
                return __ldcg(pl + (int64_t)t * S + (i - t * per_tile));
            };
            const float *mk = a.mkey ? a.mkey + bh * cm : nullptr;
            auto idx_of = [=](int32_t i) { return (int32_t)(at(i) & 0xffffffffu); };
            auto w_of = [=](int32_t j) { return __ldcg(mk + j); };
            int32_t k;
            if (np <= kSeTile) { /* the pool's keys fit in shared memory (always, up to 2M-token prompts) */
                uint32_t *keys = sm.keys;
                for (int32_t i = tid; i < np; i += kSeNT) keys[key_slot(i)] = (uint32_t)(at(i) >> 32);
                __syncthreads();
                auto key_of = [=](int32_t i) { return keys[key_slot(i)]; };
                k = select_count<kSeNT>(a, n, key_of, idx_of, w_of, reinterpret_cast<unsigned long long *>(se_keys + kSeKeyWords), sm, np);
                block_topk<kSeNT, false>(
                    np, k, key_of, [=](int32_t pos, int32_t i) { sel[pos] = idx_of(i); }, [](int32_t, int32_t) {}, sm.tk);
            } else {
                auto key_of = [=](int32_t i) { return (uint32_t)(at(i) >> 32); };
                k = select_count<kSeNT>(a, n, key_of, idx_of, w_of, reinterpret_cast<unsigned long long *>(se_keys + kSeKeyWords), sm, np);
                block_topk<kSeNT, false>(
                    np, k, key_of, [=](int32_t pos, int32_t i) { sel[pos] = idx_of(i); }, [](int32_t, int32_t) {}, sm.tk);
            }
            __syncthreads();
            select_finish(a, b, h, k, sm);
            if (tid == 0) a.cnt[bh] = 0;
        }
}


/* ---- decode selection, fused: e_j, Z and the top-S of one (b, h) in one CTA ------------------ */

constexpr int kSzNT = 1024;                 /* 4 sets of 256 canonical lanes */
constexpr int32_t kSzMax = 32768;           /* candidates whose keys fit in shared memory */
static_assert(kSzNT == 4 * SKV_CANON_LANES, "a set of threads per query head");

/* Words of the fused kernel's keys for n candidates, rounded up to 16 bytes (the mass walk's batch follows). */
__host__ __device__ constexpr size_t sz_key_words(int32_t n) { return ((size_t)n + (size_t)n / 32 + 1 + 3) / 4 * 4; }
__host__ __device__ constexpr size_t sz_key_bytes(int32_t n) { return sz_key_words(n) * sizeof(uint32_t); }

/*
 * grid (1, Hk, B), block (h, b) when every sequence has at most kSzMax candidates: steps 2 and 3
 * of the decode for the whole (b, h) in one CTA, with no pool and no second kernel.
 *  1. Query heads of the group four at a time, one set of 256 threads each: lane k of the set
 *     turns s_j into e_j = skv_expf(s_j - M) in place for j = k, k + 256, ... and adds them in
 *     that order (the canonical partial k), then the fixed pairwise tree gives Z (expsum's
 *     arithmetic, the same bits).
 *  2. Keys a_j over all n candidates, then the block top-S (select_kernel's single-tile path)
 *     and select_finish.
 */
__global__ void __launch_bounds__(kSzNT) selz_kernel(const SelectArgs a)
{
    __shared__ SelectSmemT<kSzNT> sm;
    __shared__ float part[4][SKV_CANON_LANES];
    __shared__ float zs[kScMaxGp];
    extern __shared__ __align__(16) uint32_t sz_keys[];
    pdl_wait();
    pdl_trigger(); /* the attention's resident items need nothing of this kernel */
    const skv_cuda_shape &sh = a.sh;
    const int tid = threadIdx.x, set = tid >> 8, k = tid & (SKV_CANON_LANES - 1);
    const int32_t G = sh.Hq / sh.Hk, S = sh.S;
    const int64_t cm = sh.cand_max;
    for (int32_t b = blockIdx.z; b < sh.B; b += gridDim.z)
        for (int32_t h = blockIdx.y; h < sh.Hk; h += gridDim.y) {
            const int32_t n = a.seqs[b].n_cand;
            if (a.seqs[b].idle) continue; /* an idle row (block-uniform): nothing selected or published */
            const int64_t bh = (int64_t)b * sh.Hk + h, row0 = (int64_t)b * sh.Hq + (int64_t)h * G;
            for (int32_t g0 = 0; g0 < G; g0 += 4) {
                const int32_t g = g0 + set;
                float P = 0.0f;
                if (g < G) {
                    const int64_t row = row0 + g;
                    float *s = a.s + row * cm;
                    const float first = a.s0[row];
                    const float M = first != first ? first : order_desc_inv(a.macc[row]);
                    int32_t j = k;
                    constexpr int U = 16; /* loads in flight (one L2 round trip per U); the adds stay in order */
                    for (; j + (U - 1) * SKV_CANON_LANES < n; j += U * SKV_CANON_LANES) {
                        float x[U];
#pragma unroll
                        for (int u = 0; u < U; u++) x[u] = s[j + u * SKV_CANON_LANES];
#pragma unroll
                        for (int u = 0; u < U; u++) {
                            const float ev = skv_expf(SKV_SUB(x[u], M));
                            s[j + u * SKV_CANON_LANES] = ev;
                            P = SKV_ADD(P, ev);
                        }
                    }
                    for (; j < n; j += SKV_CANON_LANES) {
                        const float ev = skv_expf(SKV_SUB(s[j], M));
                        s[j] = ev;
                        P = SKV_ADD(P, ev);
                    }
                }
                part[set][k] = P;
                const float v = canon_tree(part[set], k);
                if (k == 0 && g < G) {
                    zs[g] = v;
                    const_cast<float *>(a.Z)[row0 + g] = v; /* Z is the workspace's, written here */
                }
                __syncthreads(); /* part is reused; zs complete after the last round */
            }
            /* keys a_j (select_kernel's arithmetic) into shared memory; up to 4 query heads, 8
               candidates per thread at a time (32 loads in flight) */
            const float *e0 = a.s + row0 * cm;
            int32_t jb = tid;
            if (G <= 4) {
                constexpr int V = 8;
                for (; jb + (V - 1) * kSzNT < n; jb += V * kSzNT) {
                    float ev[V][4];
#pragma unroll
                    for (int u = 0; u < V; u++)
#pragma unroll
                        for (int g = 0; g < 4; g++) ev[u][g] = g < G ? e0[g * cm + jb + u * kSzNT] : 0.0f;
#pragma unroll
                    for (int u = 0; u < V; u++) {
                        const int32_t j = jb + u * kSzNT;
                        float av = SKV_DIV(ev[u][0], zs[0]);
#pragma unroll
                        for (int g = 1; g < 4; g++) {
                            if (g >= G) break;
                            const float p = SKV_DIV(ev[u][g], zs[g]);
                            if (p > av) av = p;
                        }
                        sz_keys[key_slot(j)] = order_desc(skv_select_key(av));
                        if (a.amax) a.amax[bh * cm + j] = av;
                    }
                }
            }
            for (int32_t j = jb; j < n; j += kSzNT) {
                float av = SKV_DIV(e0[j], zs[0]);
                for (int32_t g = 1; g < G; g++) {
                    const float p = SKV_DIV(e0[g * cm + j], zs[g]);
                    if (p > av) av = p;
                }
                sz_keys[key_slot(j)] = order_desc(skv_select_key(av));
                if (a.amax) a.amax[bh * cm + j] = av;
            }
            __syncthreads();
            int32_t *sel = a.sel_idx + bh * S;
            const uint32_t *keys = sz_keys;
            const int32_t k = select_count<kSzNT>(
                a, n, [=](int32_t i) { return keys[key_slot(i)]; }, [](int32_t i) { return i; },
                [=](int32_t j) { return skv_mass_weight(order_desc_inv(keys[key_slot(j)])); },
                reinterpret_cast<unsigned long long *>(sz_keys + sz_key_words(sh.cand_max)), sm);
            block_topk<kSzNT, false>(
                n, k, [=](int32_t i) { return keys[key_slot(i)]; }, [=](int32_t pos, int32_t i) { sel[pos] = i; },
                [](int32_t, int32_t) {}, sm.tk);
            __syncthreads(); /* sel complete */
            select_finish(a, b, h, k, sm);
            __syncthreads(); /* shared memory is reused by the next (b, h) */
        }
}

} /* namespace */

/* ---- launchers ------------------------------------------------------------------------- */

int32_t skv_cuda_select_tiles(int32_t n) { return (int32_t)ceil_div64(n > 0 ? n : 1, kSeTile); }

int32_t skv_cuda_pool_cap(int32_t cand_max, int32_t S) { return skv_cuda_select_tiles(cand_max) * S; }

/* Steps 1-3 into sel_idx / sel_ids / sel_cnt ([B, Hk, sh->S]); publish: at decode, the selection's
   publication and the chunk caches' plan (select_finish), else neither (op level, or the rescoring's
   first stage). */
static cudaError_t select_run(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                              const skv_cuda_dws *ws, const skv_cuda_io *io, int tiled, int32_t layer, float *amax,
                              skv_cuda_score_node *graph, int *launches, cudaEvent_t scored, int32_t *sel_idx,
                              int32_t *sel_ids, int32_t *sel_cnt, bool publish)
{
    if (sh->B <= 0 || sh->Hk <= 0 || sh->cand_max <= 0) return cudaSuccess;
    const int32_t G = sh->Hq / sh->Hk;
    if ((G + 7) / 8 * 8 > kScMaxGp) return cudaErrorInvalidValue; /* the cache and the op refuse such shapes */
    cudaError_t e = skv_cuda_score(st, sh, seqs, ws, io, tiled, layer, graph); /* step 1 */
    if (e == cudaSuccess && scored) e = cudaEventRecord(scored, st);
    if (e != cudaSuccess) return e;
    SelectArgs a;
    memset(&a, 0, sizeof a);
    a.sh = *sh;
    a.seqs = seqs;
    a.e = ws->scores;
    a.Z = ws->Z;
    a.amax = amax;
    a.pool = ws->pool;
    a.pool_cap = ws->pool_cap;
    a.cnt = ws->cnt_sel;
    a.sel_idx = sel_idx;
    a.sel_ids = sel_ids;
    a.sel_cnt = sel_cnt;
    const bool mass = sh->sel_mode == SKV_SELECT_MASS;
    a.vsrc = ws->vsrc;
    a.mlist = ws->mlist;
    a.mcount = ws->mcount;
    a.step_bad = io->k && publish ? ws->step_bad : NULL;
    a.vc_counts = ws->vc_counts;
    a.s = ws->scores;
    a.macc = (const unsigned *)ws->macc;
    a.s0 = (const float *)ws->s0;
    /* one CTA per (b, h) computes e, Z and the selection together when there are enough pairs
       to fill a good part of the GPU, or few candidates (one select tile); a few pairs over many
       candidates leave the long chains of one CTA exposed and take the split path */
    if (sh->cand_max <= kSzMax && ((int64_t)sh->B * sh->Hk * 3 >= num_sms() || sh->cand_max <= kSeTile)) {
        const size_t smem = sz_key_bytes(sh->cand_max) + (mass ? kMsBytes : 0);
        if ((e = allow_smem(selz_kernel, smem)) != cudaSuccess) return e;
        e = launch(selz_kernel, dim3(1, clamp_yz(sh->Hk), clamp_yz(sh->B)), dim3(kSzNT), smem, st, true, a);
        if (launches) *launches += 2;
        return e;
    }
    e = launch(expsum_kernel, dim3((unsigned)ceil_div64(sh->cand_max, kExTile), clamp_yz(sh->Hq), clamp_yz(sh->B)),
               dim3(kExNT), 0, st, true, *sh, seqs, ws->scores, (const unsigned *)ws->macc, (const float *)ws->s0,
               ws->Z, ws->cnt_e);
    if (e != cudaSuccess) return e;
    /* the masses of the candidates for the last tile block's A (the fused kernel reads its keys) */
    if (mass) {
        if (!ws->mkey) return cudaErrorInvalidValue;
        a.mkey = ws->mkey;
    }
    const size_t smem = kSeKeyBytes + (mass ? kMsBytes : 0);
    if ((e = allow_smem(select_kernel, smem)) != cudaSuccess) return e;
    e = launch(select_kernel, dim3((unsigned)skv_cuda_select_tiles(sh->cand_max), clamp_yz(sh->Hk), clamp_yz(sh->B)),
               dim3(kSeNT), smem, st, true, a);
    if (launches) *launches += 3;
    return e;
}

cudaError_t skv_cuda_select_step(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                 const skv_cuda_dws *ws, const skv_cuda_io *io, int tiled, int32_t layer, float *amax,
                                 skv_cuda_score_node *graph, int *launches, cudaEvent_t scored)
{
    return select_run(st, sh, seqs, ws, io, tiled, layer, amax, graph, launches, scored, ws->sel_idx, ws->sel_ids,
                      ws->sel_cnt, true);
}

cudaError_t skv_cuda_select_candidates(cudaStream_t st, const skv_cuda_shape *sh, const skv_cuda_seq *seqs,
                                       const skv_cuda_dws *ws, const skv_cuda_io *io, int32_t layer,
                                       skv_cuda_score_node *graph, int *launches, cudaEvent_t scored)
{
    if (sh->W <= 0 || !ws->cand_idx || !ws->cand_ids || !ws->cand_cnt) return cudaErrorInvalidValue;
    /* ref's first stage (lib/skv_cache.c skv_rescore_step): score_select in the fixed mode with cap and
       stride W, so the count of (b, h) is min(W, n_cand); the pool holds W per tile (skv_cuda_dws_layout) */
    skv_cuda_shape s1 = *sh;
    s1.S = sh->W, s1.sel_cap = sh->W, s1.sel_mode = SKV_SELECT_FIXED, s1.sel_min = 0;
    return select_run(st, &s1, seqs, ws, io, 1, layer, NULL, graph, launches, scored, ws->cand_idx, ws->cand_ids,
                      ws->cand_cnt, false);
}
