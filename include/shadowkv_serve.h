/*
 * shadowkv_serve.h - the serving calls of libshadowkv (continuous batching): decode of a list of
 * sequences, sequences released and reused, prompts that arrive in pieces, and the memory pools
 * (config.pool_device_bytes; see "Memory pools" in shadowkv.h). Included by shadowkv.h; include
 * that one. docs/DESIGN.md section 12 describes the design.
 */
#ifndef SHADOWKV_SERVE_H
#define SHADOWKV_SERVE_H

#include "shadowkv.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * One decode step of one layer for the listed sequences only (continuous batching).
 *  seqs [n_active]       distinct sequence indices in [0, batch_size), in any order (host memory)
 *  q    [n_active, Hq, D], k, v [n_active, Hk, D], out [n_active, Hq, D]: row i belongs to seqs[i]
 * Each listed sequence takes the step skv_decode takes for it, with bitwise the same outputs and
 * selections (a sequence's step does not depend on which others run beside it); the sequences
 * not listed do not advance. 0 <= n_active <= batch_size; n_active = 0 does nothing.
 * A sequence advances all its layers together: layer may take a sequence's step of token t + 1
 * only after every layer took its step of token t for that sequence.
 * Errors (nothing changes for any sequence): SKV_ERR_NULL_POINTER, SKV_ERR_INVALID_ARGUMENT
 * (layer or a sequence out of range, a sequence listed twice, n_active out of range, a layer a
 * step ahead of another layer of a listed sequence: the message names both layers and the
 * sequence), SKV_ERR_NOT_PREFILLED (a listed sequence is free or not prefilled in every layer),
 * SKV_ERR_CAPACITY, SKV_ERR_NONFINITE. cuda: enqueued on the cache's stream, like skv_decode;
 * the step of a sequence whose prefill is still running beside it waits for that prefill.
 */
SKV_API skv_status skv_decode_active(skv_cache *cache, int32_t layer, int32_t n_active, const int32_t *seqs,
                                     const skv_bf16 *q, const skv_bf16 *k, const skv_bf16 *v, float *out);

/**
 * skv_decode_active with the count and the list in device memory (cuda): *n_active and
 * seqs[0 .. *n_active) are read by the step's kernels when the stream reaches them, so a CUDA
 * graph that captured this call stays valid while the set changes, up to batch_size sequences.
 * q, k, v and out hold batch_size rows; rows at and past the count are neither read nor written.
 * The list is checked on the device: a count outside [0, batch_size], a sequence out of range,
 * listed twice, not prefilled in every layer, at gen_capacity, or whose layer would go a step
 * ahead, makes the step change nothing for any sequence, and the next synchronizing call
 * (skv_cache_sync, introspection) returns SKV_ERR_INVALID_ARGUMENT (SKV_ERR_NOT_PREFILLED,
 * SKV_ERR_CAPACITY) naming the step, the layer and the sequence. The step does not wait for
 * prefills running beside it: list a sequence once skv_seq_ready says its prefill is done.
 * The host's view of each sequence's generated tokens is refreshed at the next synchronizing
 * call; a skv_decode, skv_decode_active or skv_seq_release after device-list steps of this
 * library's calls synchronizes first (once). A captured call replayed by the caller is not seen
 * by the library: call skv_cache_sync between such replays and host-list calls. ref and cpu: SKV_ERR_UNSUPPORTED.
 */
SKV_API skv_status skv_decode_active_device(skv_cache *cache, int32_t layer, const int32_t *n_active,
                                            const int32_t *seqs, const skv_bf16 *q, const skv_bf16 *k,
                                            const skv_bf16 *v, float *out);

/**
 * Whether the prefill of seq is done in every layer, without waiting: *ready = 1 when every layer
 * is prefilled and, on cuda, the prefill's work beside the cache's stream (factorization, value
 * offload) has finished; 0 otherwise (a free slot, a prompt still arriving, or work in flight).
 * Errors: SKV_ERR_NULL_POINTER, SKV_ERR_INVALID_ARGUMENT (seq out of range), SKV_ERR_DEVICE.
 */
SKV_API skv_status skv_seq_ready(skv_cache *cache, int32_t seq, int32_t *ready);

/**
 * Returns sequence seq, all of its layers, to the free state: its prompt, generated tokens and
 * selections are dropped, its pool pages (and the staging of a prompt still arriving in pieces)
 * are returned, and the slot may be prefilled again. Allocates nothing. Other sequences are not
 * touched. cuda: ordered on the cache's stream, so a step of this sequence still in flight
 * finishes first on the memory it read (a later prefill of the slot is ordered after it too).
 * Errors: SKV_ERR_NULL_POINTER, SKV_ERR_INVALID_ARGUMENT (seq out of range), SKV_ERR_SEQ_STATE
 * (the slot is already free: no layer prefilled and no piece received).
 */
SKV_API skv_status skv_seq_release(skv_cache *cache, int32_t seq);

/**
 * A prompt fed in pieces (chunked prefill). The piece holds tokens [pos0, pos0 + n) of a prompt
 * of n_total tokens of (layer, seq); tensors as skv_prefill, [n, Hk, D] each. Pieces of one
 * (layer, seq) arrive in order: the first has pos0 = 0, each next one starts where the last ended,
 * and all give the same n_total and all give k_post or none do. The pieces are kept in a staging
 * copy (the device pool in the pool mode; otherwise allocated at the first piece); when the last
 * one arrives (pos0 + n == n_total) the prefill runs on the whole prompt exactly as skv_prefill
 * would, so every later decode is bitwise the same as after a one-piece prefill, and the staging
 * is returned. n_total and the prompt are checked as skv_prefill checks them, at the first piece
 * (shape) and at each piece (values).
 * Errors: as skv_prefill; SKV_ERR_SEQ_STATE (pos0 is not the tokens received so far, another
 * n_total or k_post use than the first piece's); SKV_ERR_OUT_OF_MEMORY (the staging, or the
 * prefill at the last piece, does not fit the pool: bytes asked and free in the message). On
 * error nothing changes: the pieces received so far stay, and the piece may be sent again.
 */
SKV_API skv_status skv_prefill_piece(skv_cache *cache, int32_t layer, int32_t seq, int64_t n_total, int64_t pos0,
                                     int64_t n, const skv_bf16 *k_pre, const skv_bf16 *v, const skv_bf16 *k_post);

/**
 * Pool bytes one sequence whose prompt has n tokens takes once prefilled in all layers
 * (page-rounded), into *device_bytes and *host_bytes, and the staging one layer of it holds
 * while its prompt arrives in pieces without k_post (page-rounded; pieces with k_post hold half
 * as much again), into *staging_bytes. Any output may be NULL. Outside the pool mode the first two are the fixed
 * per-sequence bytes (what create set aside for max_prompt_len) and staging is what
 * skv_prefill_piece allocates. Errors: SKV_ERR_NULL_POINTER, SKV_ERR_INVALID_ARGUMENT (n < 1 or
 * n > max_prompt_len).
 */
SKV_API skv_status skv_seq_bytes(const skv_cache *cache, int64_t n, size_t *device_bytes, size_t *host_bytes,
                                 size_t *staging_bytes);

/** What a cache's memory holds now (skv_cache_usage). */
typedef struct skv_usage {
    int32_t pooled;             /**< 1 in the pool mode */
    int32_t page_bytes;         /**< pool page size (0 outside the pool mode) */
    size_t device_pool_bytes;   /**< the device pool (0 outside the pool mode) */
    size_t device_used_bytes;   /**< its pages in use (prompts and staging) */
    size_t device_largest_free; /**< the largest run of free pages, in bytes */
    size_t host_pool_bytes;     /**< the host pool (0 outside the pool mode or with values on the device) */
    size_t host_used_bytes;
    size_t host_largest_free;
    size_t staging_bytes;       /**< of device_used_bytes (or, outside the pool mode, allocated): the
                                     staging of prompts arriving in pieces */
    int32_t seqs_in_use;        /**< sequences with a layer prefilled or a piece received */
    int32_t seqs_free;          /**< batch_size - seqs_in_use */
} skv_usage;

/** Fills *usage (synchronizes like skv_cache_sync). Errors: SKV_ERR_NULL_POINTER. */
SKV_API skv_status skv_cache_usage_sized(skv_cache *cache, skv_usage *usage, size_t usage_size);
/** skv_cache_usage_sized with the caller's sizeof. */
static inline skv_status skv_cache_usage(skv_cache *cache, skv_usage *usage)
{
    return skv_cache_usage_sized(cache, usage, sizeof *usage);
}

#ifdef __cplusplus
}
#endif

#endif /* SHADOWKV_SERVE_H */
