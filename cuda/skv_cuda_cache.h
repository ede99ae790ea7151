/*
 * skv_cuda_cache.h - the cuda cache's state (private to cuda/): what skv_cuda_cache.cu (open,
 * close, decode, sync, set_states), skv_cuda_prefill.cu (prefill) and skv_cuda_serve.cu (the
 * serving slots: the decode's active list, release, seq_ready) share.
 */
#ifndef SKV_CUDA_CACHE_H
#define SKV_CUDA_CACHE_H

#include "skv_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SKV_CUDA_RING 64 /* decode steps whose times can be in flight */
#define SKV_CUDA_LRING 16 /* host lists (not 0..n-1) whose copies to the device can be in flight */
/* Blocks of the prefill's value offload to a host store (writes to mapped host memory, bound
   by PCIe): the rest of the GPU stays free for the caller's work. */
#define SKV_CUDA_OFFLOAD_BLOCKS 8
/* Steps whose phases are timed: one in this many (the phase events sit between kernels that
   otherwise overlap their launch with the previous kernel's tail). */
#define SKV_CUDA_PHASE_EVERY 16
/* SKV_EV_REBUILT: after the canonical rebuild (reproducible mode), so that its time is decode_rebuild_ms */
enum { SKV_EV_START, SKV_EV_SELECTED, SKV_EV_FETCHED, SKV_EV_REBUILT, SKV_EV_END, SKV_CUDA_EV };

typedef struct {
    cudaEvent_t e[SKV_CUDA_EV];
    int used;   /* start and end recorded */
    int phases; /* selected (and fetched, host layers) recorded too */
    int fetch;
    int rebuilt; /* SKV_EV_REBUILT recorded too (reproducible mode) */
} skv_cuda_evset;

/* Prefill timing: main stream m0..m3 (start, staged + RoPE, landmarks, end) with wa..wb
   around its wait for the previous prefill's side work, factorization f0..f1, offload
   o0..o1. Two sets: a prefill harvests the set of the prefill before last. */
enum { SKV_PE_M0, SKV_PE_M1, SKV_PE_M2, SKV_PE_M3, SKV_PE_F0, SKV_PE_F1, SKV_PE_O0, SKV_PE_O1, SKV_PE_WA, SKV_PE_WB,
       SKV_PE_N };
typedef struct {
    cudaEvent_t e[SKV_PE_N];
    int used;
} skv_cuda_pset;

/* A layer's decode step as a CUDA graph: captured at its first step, replayed after with the
   score node's tensors updated (one launch instead of five to seven). */
typedef struct {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaGraphNode_t score; /* the root kernel node, in graph */
    int kernels;
    skv_cuda_score_node node;
} skv_cuda_layer_graph;

typedef struct skv_cuda_cache {
    skv_config cfg;
    skv_layout lay;
    cudaStream_t st;
    cudaStream_t cap;               /* the layer graphs are captured here */
    skv_cuda_layer_graph *graphs;   /* [L] */
    cudaStream_t side;              /* the fetch of missed chunks runs here, beside the attention */
    int32_t offload_blocks;         /* grid cap of the prefill's value offload to the host */
    cudaEvent_t fork_ev, join_ev;   /* no timing: fork/join of the side stream */
    cudaEvent_t scored_ev;          /* no timing: step 1 done (reproducible mode: the resident scores may start) */
    char *dev, *host_dev; /* the device arena; host_dev: device alias of the pinned host arena */
    char *host;           /* the pinned host arena */
    skv_cuda_shape sh;
    skv_cuda_shape shd;   /* a dense layer's shape: S = O = r = 0 (no selected span, no outliers) */
    skv_cuda_seq *d_seqs; /* [L * B] on the device */
    skv_cuda_seq *h_seqs; /* host copies (prefill writes them; sync refreshes them) */
    unsigned char *layer_host; /* [L] 1: a sequence of the layer keeps its values on the host */
    skv_cuda_dws ws;            /* the decode workspace (a sparse layer's items) */
    skv_cuda_dws wsd;           /* the same workspace with a dense layer's items (its resident spans hold the prompt) */
    unsigned long long *lstats; /* [L, 4] the layers' counters on the device (cumulative; combine adds them) */
    unsigned long long *lstats_seen; /* [L, 4] host: what sync has handed over */
    unsigned long long vc_seen[2]; /* chunk-cache counts already added to the stats */
    int64_t launches;           /* decode kernels since the last sync */
    int64_t n_steps;            /* decode steps enqueued */
    /* prefill workspace */
    skv_bf16 *kp_tmp;
    float *uf, *wf;
    void *lm_scratch;
    unsigned long long *flags, *h_flags; /* [3] device, pinned host */
    skv_cuda_factor *fac;
    /* config.rank == 0: cfg.rank holds rank_max (the size of the factors); each slot's rank is
       chosen on fst into d_rank and copied to h_rank at the next sync */
    int choose_rank;
    float rank_target;
    int32_t *d_rank, *h_rank; /* [L * B] */
    void *rank_scratch;
    /* prefill beside the caller's stream: the factorization runs on fst, the value offload on ost,
       both from staged copies of k_pre and v, so the caller may reuse its buffers at once */
    cudaStream_t fst, ost;
    cudaEvent_t side_ev, fac_ev, off_ev; /* no timing */
    skv_bf16 *kstage, *vstage;
    int staged;       /* fac_ev / off_ev were recorded: the staging buffers may be in use */
    /* a prefill runs on pst (its check, staging, RoPE, landmarks, exact chunks), after the work on st
       so far (pre_ev), then fst and ost; its slot's descriptor is written once all of it is done,
       and done_ev[slot] recorded then. A decode step of a host list waits for the done_ev of the
       slots it reads whose pend is set (none other); a device list does not wait (its check finds
       such a slot not prefilled) */
    cudaStream_t pst;
    cudaEvent_t pre_ev;
    /* config.cuda_prefill_sms > 0: pst, fst, ost, the factorization's second stream and the events
       recorded on them live in this green context over part of the SMs (skv_cuda_green.cu); NULL:
       the primary context's, every SM */
    skv_cuda_green *green;
    cudaEvent_t *done_ev;   /* [L * B], no timing */
    unsigned char *pend;    /* [L * B] 1: st has not waited for the slot's done_ev */
    /* the serving API's decode: a step's rows from its list (skv_cuda_act) */
    skv_cuda_seq *rows;     /* [B] */
    int32_t *d_list;        /* [B] a host list's device copy */
    int32_t *d_mark;        /* [B] zero between steps */
    unsigned long long *d_list_err; /* the deferred bad device list (~0: none) */
    int32_t *h_ring;        /* [SKV_CUDA_LRING][B] pinned: host lists on their way to d_list */
    cudaEvent_t lring_ev[SKV_CUDA_LRING]; /* no timing: the copy from that ring entry is done */
    unsigned char lring_used[SKV_CUDA_LRING];
    int lring_head;
    int dev_lists;          /* 1 once a device-list step was enqueued (or captured: the caller's graph may replay
                               it any number of times): every sync then refreshes n_gen, has_sel */
    int32_t *h_gen;         /* [L * B][2] host: n_gen, has_sel of every descriptor, read back by sync */
    unsigned long long fac_failures_seen;
    skv_cuda_pset pset[2];
    int pset_next;
    /* timing */
    skv_cuda_evset ring[SKV_CUDA_RING];
    int ring_head;
    skv_stats pending;
    double phase_select_ms, phase_fetch_ms, phase_attention_ms, phase_rebuild_ms; /* over the phase-timed steps */
    int64_t n_timed, n_phased, n_phased_fetch;
    /* all cudaMalloc'ed blocks, freed at close */
    void *blocks[26];
    int n_blocks;
} skv_cuda_cache;

/* Adds a finished prefill's phase times to the pending stats (skv_cuda_prefill.cu). */
void skv_cuda_take_prefill(skv_cuda_cache *k, skv_cuda_pset *p);

/* Before a decode step of layer (skv_cuda_serve.cu): the cache's stream waits for the prefills
   still in flight of the sequences the step reads (a host list: theirs; a device list: every
   one), and *act describes the step's rows (a host list is copied to the device from the
   pinned ring unless it is 0..n-1). flags: cudaEventWaitExternal inside a capture. */
skv_status skv_cuda_list_prepare(skv_cuda_cache *k, int32_t layer, int32_t n_active, const int32_t *seqs,
                                 const int32_t *dev_count, const int32_t *dev_seqs, unsigned flags, skv_cuda_act *act,
                                 char *msg, size_t cap);

/* A deferred bad device list as cache_sync reports it: SKV_OK if none (skv_cuda_serve.cu; the
   caller has synchronized the streams), else the message and SKV_ERR_SEQ_STATE; clears it. */
skv_status skv_cuda_list_error(skv_cuda_cache *k, char *msg, size_t cap);

#ifdef __cplusplus
}
#endif

/* Milliseconds between two recorded events (0 when they cannot be read; the error is cleared). */
static inline float skv_cuda_elapsed(cudaEvent_t a, cudaEvent_t b)
{
    float ms = 0.0f;
    if (cudaEventElapsedTime(&ms, a, b) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0.0f;
    }
    return ms;
}

#endif /* SKV_CUDA_CACHE_H */
