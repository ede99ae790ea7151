/*
 * shadowkv.h - public C API of libshadowkv.
 *
 * libshadowkv implements ShadowKV-style sparse attention for long-context
 * decoding (Sun et al., ICML 2025): pre-RoPE keys are kept as a rank-r
 * factorization U W, values of non-outlier chunks live in a host store, and
 * each decode step attends to outliers, the local window, the generated tokens
 * and a query-dependent set of S chunks whose keys are rebuilt on the fly.
 *
 * Conventions
 *  - Every function returning skv_status returns SKV_OK (0) on success.
 *    On failure nothing observable has changed: the cache is exactly as it was.
 *  - Tensors are row-major, bf16 (skv_bf16, the upper 16 bits of an IEEE
 *    float) unless stated; attention outputs are float.
 *  - With the ref and cpu backends all pointers are host pointers. With the
 *    cuda backend, tensors passed to skv_prefill, skv_decode and skv_op_* are
 *    device pointers (as with cuBLAS); skv_buffer_alloc/skv_buffer_copy give
 *    memory of the right kind for any backend. Introspection outputs are
 *    always host memory.
 *  - cuda: a cache runs on config.cuda_stream. skv_decode only enqueues work
 *    (no host-device synchronization, no allocation; NaN/Inf in its inputs is
 *    found on the device and reported later, see skv_cache_sync). skv_prefill,
 *    skv_cache_sync, skv_cache_stats*, the introspection calls, create and
 *    free synchronize with the cache's stream. skv_prefill returns when its
 *    inputs have been read; the key factorization and the value offload
 *    continue beside the cache's stream, on the library's own streams (from
 *    copies of the inputs), and the next skv_decode waits for them on the
 *    device. skv_op_* run on the legacy default stream and return when done.
 *  - cuda: a cache lives on config.cuda_device; every call on it runs there and
 *    restores the calling thread's current device (no synchronization). Its
 *    tensors must be on that device. skv_op_* and skv_buffer_* use the current
 *    device.
 *  - The library never prints and never exits. A failing call leaves a
 *    message naming the bad argument and its value in skv_last_error()
 *    (thread-local) and, for calls on a cache, in skv_cache_last_error().
 *  - Thread safety: separate caches may be used from separate threads at once.
 *    Calls on one cache must be serialized by the caller. skv_op_* functions
 *    are reentrant.
 *
 * Everything here is C99 and usable from C++.
 */
#ifndef SHADOWKV_H
#define SHADOWKV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Symbol visibility: the library is built with -fvisibility=hidden. */
#if defined(__GNUC__) && !defined(SKV_STATIC_ONLY)
#define SKV_API __attribute__((visibility("default")))
#else
#define SKV_API
#endif

#define SKV_VERSION_MAJOR 0
#define SKV_VERSION_MINOR 7
#define SKV_VERSION_PATCH 0
/** The header's version as one number: major * 10000 + minor * 100 + patch. */
#define SKV_VERSION_NUMBER (SKV_VERSION_MAJOR * 10000 + SKV_VERSION_MINOR * 100 + SKV_VERSION_PATCH)

/**
 * The library's version, SKV_VERSION_NUMBER of the headers it was built with.
 * A program compares it with its own SKV_VERSION_NUMBER to catch a header and
 * library mismatch (the major numbers must agree; the library's minor number may
 * be newer). Structs that grow (skv_config and the output structs) stay compatible
 * across minor versions: see skv_config.struct_size.
 */
SKV_API unsigned skv_version_number(void);
/** The library's version as "major.minor.patch" (static storage). */
SKV_API const char *skv_version_string(void);

/** A bfloat16 value: the upper 16 bits of an IEEE-754 binary32. */
typedef uint16_t skv_bf16;

/** Status codes. Values are pinned and will not change. */
typedef enum skv_status {
    SKV_OK = 0,
    SKV_ERR_INVALID_ARGUMENT = 1,  /**< an argument is out of range */
    SKV_ERR_NULL_POINTER = 2,      /**< a required pointer is NULL */
    SKV_ERR_INVALID_CONFIG = 3,    /**< a config field is invalid */
    SKV_ERR_SIZE_OVERFLOW = 4,     /**< a size product overflows */
    SKV_ERR_PROMPT_TOO_SHORT = 5,  /**< prompt has fewer than O + S context chunks */
    SKV_ERR_PROMPT_TOO_LONG = 6,   /**< prompt longer than config.max_prompt_len */
    SKV_ERR_NOT_PREFILLED = 7,     /**< decode before every layer of every sequence was prefilled */
    SKV_ERR_ALREADY_PREFILLED = 8, /**< prefill of a (layer, sequence) twice */
    SKV_ERR_CAPACITY = 9,          /**< generated-token capacity exhausted */
    SKV_ERR_NONFINITE = 10,        /**< NaN, Inf or |x| > SKV_MAX_INPUT_MAGNITUDE in an input tensor */
    SKV_ERR_OUT_OF_MEMORY = 11,    /**< an allocation failed */
    SKV_ERR_UNSUPPORTED = 12,      /**< the backend does not implement this */
    SKV_ERR_NO_DEVICE = 13,        /**< the backend has no usable device */
    SKV_ERR_NUMERICAL = 14,        /**< a numerical routine failed (LAPACK info != 0) */
    SKV_ERR_NO_SELECTION = 15,     /**< introspection of a selection before any decode step */
    SKV_ERR_DEVICE = 16,           /**< a device runtime call failed (the message names it) */
    SKV_ERR_FORMAT = 17,           /**< the snapshot is truncated, corrupted, of another format
                                        version, or not a snapshot (the message names the section,
                                        field and byte offset) */
    SKV_ERR_IO = 18,               /**< opening, reading, writing or renaming a file failed (the
                                        message names the file and has strerror's text) */
    SKV_ERR_SEQ_STATE = 19         /**< the call does not fit the sequence's state: a release of a
                                        free slot, a prefill piece out of order or of another
                                        prompt length than the sequence's first piece */
} skv_status;

/** Number of status codes (one past the largest). */
#define SKV_STATUS_COUNT 20

/** Static, never-NULL English name of a status ("SKV_ERR_CAPACITY: ..."). */
SKV_API const char *skv_status_string(skv_status status);

/**
 * Message of the last failing call made by this thread (any entry point),
 * or "" if none failed yet. Valid until the thread's next failing call.
 */
SKV_API const char *skv_last_error(void);

/** Backends. */
typedef enum skv_backend {
    SKV_BACKEND_AUTO = 0, /**< cuda if usable, else cpu */
    SKV_BACKEND_REF = 1,  /**< portable single-thread reference: the oracle */
    SKV_BACKEND_CPU = 2,  /**< OpenMP + OpenBLAS; AVX2+FMA / AVX-512 code chosen at run time
                               by cpuid; skv_cpu_set_simd (or, without it, the environment
                               SKV_CPU_SIMD=0|avx2) caps it (same decisions; docs/usage.md,
                               "The cpu backend") */
    SKV_BACKEND_CUDA = 3  /**< NVIDIA GPUs */
} skv_backend;

/**
 * Caps the SIMD code the cpu backend runs, for the whole process: 0 the portable
 * code, 1 AVX2+FMA, 2 AVX-512 as well (never more than the CPU has), -1 back to
 * the default (what the CPU has, capped by the environment variable SKV_CPU_SIMD=0
 * or avx2 when set). An explicit level here wins over the environment. Every level
 * makes the same decisions bit for bit; outputs stay within the documented
 * tolerances. Applies to cpu calls that start afterwards. SKV_ERR_INVALID_ARGUMENT
 * for another level.
 */
SKV_API skv_status skv_cpu_set_simd(int32_t level);
/** The SIMD level cpu calls run now (0, 1 or 2, as skv_cpu_set_simd). */
SKV_API int32_t skv_cpu_simd_level(void);

/** Static name of a backend: "auto", "ref", "cpu", "cuda", or "invalid". */
SKV_API const char *skv_backend_name(skv_backend backend);

/**
 * Parses "auto", "ref", "cpu" or "cuda" into *out.
 * Returns SKV_ERR_INVALID_ARGUMENT for anything else, SKV_ERR_NULL_POINTER
 * for NULL arguments.
 */
SKV_API skv_status skv_backend_parse(const char *name, skv_backend *out);

/**
 * Whether a backend can run on this machine: SKV_OK, SKV_ERR_NO_DEVICE
 * (cuda without a usable GPU, or its plugin or CUDA libraries missing: the message
 * says which), or SKV_ERR_INVALID_ARGUMENT.
 * SKV_BACKEND_AUTO is always available.
 */
SKV_API skv_status skv_backend_available(skv_backend backend);

/* ------------------------------------------------------------------------ */
/* Configuration                                                            */
/* ------------------------------------------------------------------------ */

/** Rotary position embedding settings. */
typedef struct skv_rope_config {
    float theta;                   /**< base; default 500000 */
    int32_t rotary_dim;            /**< rotated dims R (even, <= head_dim); 0 = head_dim */
    int32_t interleaved;           /**< 0: pairs (i, i+R/2) (rotate-half); 1: pairs (2i, 2i+1) (GPT-J) */
    int32_t llama3_scaling;        /**< 1: apply Llama-3 frequency scaling; default 0 */
    float scaling_factor;          /**< Llama-3 factor; default 8 */
    float low_freq_factor;         /**< default 1 */
    float high_freq_factor;        /**< default 4 */
    int32_t original_max_position; /**< default 8192 */
} skv_rope_config;

/**
 * How the rank-r key factorization is computed (docs/usage.md, "factorization
 * routes"). Every route meets the accuracy bound of docs/DESIGN.md section 6; they
 * differ in speed and in how they get there. ref has one route (the double Gram
 * and dsyevr) and ignores the choice.
 */
typedef enum skv_factorize_route {
    SKV_FACTORIZE_AUTO = 0,     /**< the fast subspace iteration where the shape allows it,
                                     with its built-in fallback to the double Gram (default) */
    SKV_FACTORIZE_FAST = 1,     /**< the fast route, never falling back (tests, debugging) */
    SKV_FACTORIZE_FALLBACK = 2, /**< always the double-precision Gram route */
    SKV_FACTORIZE_EXACT = 3,    /**< the blocked exact route whatever the shape */
    SKV_FACTORIZE_CANONICAL = 4 /**< the canonical route of the reproducible mode: one fixed
                                     sequence of IEEE operations, so U and W are bitwise equal
                                     on ref, cpu and cuda (docs/DESIGN.md section 10) */
} skv_factorize_route;

/**
 * How many chunks a KV head selects at a decode step (docs/DESIGN.md section 4.5).
 */
typedef enum skv_select_mode {
    SKV_SELECT_FIXED = 0, /**< S = budget / c chunks per KV head at every step (default) */
    SKV_SELECT_MASS = 1   /**< per KV head and step, the fewest chunks (best first) whose
                               group-max selection probabilities reach select_mass of their
                               total, clamped to [select_min_chunks, min(S, N - O)]; the
                               same on every backend, bit for bit */
} skv_select_mode;

/** How the values of the candidate chunks (the value stores, device or host) are kept
    (config.value_dtype; docs/DESIGN.md section 13). Outliers, the local window and the
    generated tokens keep bf16 values in both. */
typedef enum skv_value_dtype {
    SKV_VALUE_BF16 = 0, /**< bf16, as given (default) */
    SKV_VALUE_FP8 = 1   /**< fp8 e4m3 with one power-of-two scale per (token, KV head): D + 1
                             bytes per token and head instead of 2 D. A stored value decodes to
                             exactly a bf16 (skv_fp8_decode), so every backend attends to the same
                             numbers; the selection does not read values and is unchanged */
} skv_value_dtype;

/**
 * config.budget = SKV_BUDGET_ALL: every candidate chunk is selected at every step
 * (k = N - O per sequence; buffers are sized for the longest prompt). With
 * SKV_SELECT_MASS the mass rule runs with that cap, min(S, N - O) = N - O. The keys are
 * still rebuilt from the rank-r factors: this is the sparse path with nothing left
 * out, not dense attention (see config.dense_layers for that).
 */
#define SKV_BUDGET_ALL ((int32_t)-1)

/**
 * Cache configuration. Obtain it from skv_config_default() (or skv_config_init),
 * then change fields: struct_size must hold the size the caller was compiled with.
 * New fields are only ever appended, so a program built against an older header
 * keeps working with a newer library (the fields it does not know take their
 * defaults); a config from a newer header than the library's is refused.
 */
typedef struct skv_config {
    size_t struct_size;       /**< sizeof(skv_config) of the caller; set by skv_config_default() */
    int32_t n_layers;         /**< L; default 32 */
    int32_t n_q_heads;        /**< Hq; default 32 */
    int32_t n_kv_heads;       /**< Hk, divides Hq; default 8 */
    int32_t head_dim;         /**< D, even; default 128 */
    int32_t rank;             /**< r of the key factorization; default 160; 0: chosen per
                                   (layer, sequence) by rank_error_target, up to rank_max */
    int32_t chunk_size;       /**< c tokens per chunk; default 8 */
    int32_t budget;           /**< selected tokens per KV head, multiple of c (the cap in
                                   SKV_SELECT_MASS); SKV_BUDGET_ALL: every candidate; default 2048 */
    int32_t n_outlier_chunks; /**< O; default 48 */
    int32_t n_local_chunks;   /**< Lc; default 4 */
    skv_rope_config rope;     /**< RoPE; defaults theta 500000, no scaling */
    float attn_scale;         /**< softmax scale; 0 = 1/sqrt(head_dim) */
    int32_t batch_size;       /**< B sequences held by the cache; default 1 */
    int64_t max_prompt_len;   /**< longest prompt any sequence may have; default 32768 */
    int32_t gen_capacity;     /**< generated tokens per sequence and layer; default 1024 */
    skv_backend backend;      /**< default SKV_BACKEND_AUTO; env SKV_BACKEND applies only to auto */
    int32_t n_threads;        /**< cpu backend threads in this cache's prefill and decode calls
                                   (num_threads clauses: the caller's OpenMP state is not changed);
                                   0 = the caller's omp_get_max_threads(); at most SKV_MAX_THREADS;
                                   create checks that the process can start that many threads
                                   (else SKV_ERR_OUT_OF_MEMORY). OpenBLAS keeps its own. */
    void *cuda_stream;        /**< cuda backend: a cudaStream_t, NULL = default stream */
    int64_t value_device_bytes; /**< device memory the cache may spend on values (see "Value
                                   placement" below); SKV_VALUES_ALL_DEVICE (default) = every
                                   (layer, sequence) keeps its values on the device */
    int32_t value_cache_chunks; /**< chunks per KV head in the device chunk cache of each
                                   host-placed (layer, sequence); 0 = min(4 S, N_max - O);
                                   otherwise in [S, N_max - O] */
    skv_factorize_route factorize; /**< the prefill's factorization route; default AUTO */
    int32_t reproducible;     /**< 1: the reproducible mode: every output bit of prefill and
                                   decode is equal on ref, cpu and cuda (the canonical
                                   factorization, key rebuild and attention of docs/DESIGN.md
                                   section 10; factorize must then be AUTO or CANONICAL and
                                   reads back as CANONICAL); 0 (default): the fastest routes,
                                   equal decisions, outputs within the documented tolerances */
    /* --- 0.3: selection that follows the attention, dense layers, ranks per slot --- */
    skv_select_mode select_mode; /**< how many chunks a KV head selects at a step (docs/DESIGN.md
                                   section 4.5): SKV_SELECT_FIXED (default) S = budget / c;
                                   SKV_SELECT_MASS the fewest chunks whose estimated attention
                                   mass reaches select_mass, at least select_min_chunks and at
                                   most min(S, N - O) */
    float select_mass;        /**< SKV_SELECT_MASS: the target p, in (0, 1]; default 0.95 */
    int32_t select_min_chunks;/**< SKV_SELECT_MASS: the floor, in [0, S]; default 0. Prompts need
                                   only O + select_min_chunks context chunks in this mode */
    int32_t rank_max;         /**< rank == 0: the largest rank a slot may take, in
                                   [1, n_kv_heads * head_dim] (memory is sized for it); default 0 */
    float rank_error_target;  /**< rank == 0: each (layer, sequence) takes the smallest rank r <=
                                   rank_max whose relative reconstruction error of its pre-RoPE keys,
                                   ||K - U_r W_r||_F / ||K||_F, is <= this (docs/DESIGN.md section
                                   3.1); in (0, 1); default 0.1 */
    uint64_t dense_layers;    /**< bit l set: layer l (< 64) is dense: it keeps its prompt's exact
                                   post-RoPE keys and values on the device and every decode step
                                   attends to all tokens (no factorization, landmarks, outliers or
                                   selection); default 0 */
    /* --- 0.4: candidates rescored by their keys --- */
    int32_t select_candidates;/**< 0 (default): chunks are ranked by their landmark scores alone.
                                   W > 0: a sparse layer's step first takes, per KV head, the
                                   min(W, N - O) best candidates by landmark score, rebuilds their
                                   keys (the canonical rebuild of docs/DESIGN.md section 10.2, in
                                   every mode), and ranks them by the attention mass their tokens
                                   get from the group's queries (section 4.5.1); the mode's rule
                                   then selects among them (SKV_SELECT_FIXED: the S best;
                                   SKV_SELECT_MASS: the fewest holding select_mass of their mass).
                                   With budget > 0, W >= S = budget / chunk_size. Costs the rebuild
                                   and scoring of W chunks per head and step; values are read for
                                   the selected chunks only */
    /* --- 0.5: serving (memory pools that follow the prompt lengths) --- */
    int64_t pool_device_bytes;/**< 0 (default): every (layer, sequence) holds memory for max_prompt_len
                                   from create on. > 0: the pool mode (see "Memory pools" below): the
                                   parts of a (layer, sequence) that grow with its prompt (factor U,
                                   landmarks, candidate ids, device value stores, a dense layer's
                                   prompt) come, at prefill, from a device pool of this many bytes
                                   carved at create into pages of pool_page_bytes; release returns them */
    int64_t pool_host_bytes;  /**< the pool mode with value_device_bytes = 0: the host pool that holds
                                   the value stores (pinned for cuda); otherwise must be 0 */
    int32_t pool_page_bytes;  /**< the pool mode: bytes per page, a power of two in [4096, 2^30];
                                   0 = 262144 (256 KiB) */
    int32_t cuda_prefill_sms; /**< cuda (others ignore it): the streaming multiprocessors the prefill's
                                   work beside the decode may use, a green context over that many SMs
                                   rounded up as the driver requires (docs/DESIGN.md 12.5); 0 (default),
                                   or a count that rounds to the device's SMs or more: all of them. No
                                   green contexts (CUDA 12.4+ drivers): create fails, SKV_ERR_UNSUPPORTED */
    /* --- 0.6: value precision --- */
    skv_value_dtype value_dtype; /**< the value stores' format: SKV_VALUE_BF16 (default) or SKV_VALUE_FP8
                                   (half the bytes in device memory, host memory and on PCIe; the
                                   prefill encodes, the decode's attention decodes) */
    /* --- 0.7: tensor parallelism (head shards, docs/tensor-parallel.md) --- */
    int32_t model_kv_heads;   /**< 0 (default): the cache holds all of the model's KV heads. > 0: the model
                                   has this many KV heads (>= n_kv_heads) and the cache holds the shard of
                                   KV heads [kv_head_begin, kv_head_begin + n_kv_heads) with their query
                                   heads [kv_head_begin G, (kv_head_begin + n_kv_heads) G), G = n_q_heads /
                                   n_kv_heads. Every tensor the cache takes or gives holds the shard's heads
                                   only (n_q_heads, n_kv_heads), in the model's order; the factorization
                                   covers the shard's keys, at the shard's rank (rank <= n_kv_heads D) */
    int32_t kv_head_begin;    /**< the shard's first KV head of the model, in [0, model_kv_heads -
                                   n_kv_heads]; 0 when model_kv_heads is 0 */
    int32_t cuda_device;      /**< cuda: the device the cache lives on. Every call on the cache makes it
                                   the calling thread's current device and restores the caller's on
                                   return; cuda_stream must belong to it. -1 (default): the device
                                   current at skv_cache_create (skv_cache_config reads back its number).
                                   Other backends ignore it (it must still be >= -1) */
} skv_config;

/**
 * Value placement. Values of the candidate chunks of one (layer, sequence)
 * ("slot") live either wholly in device memory or in the host store behind a
 * device-resident chunk cache. Slots are placed in (layer, sequence) order:
 * slot i = layer * batch_size + seq goes on the device while the device bytes
 * for values (whole stores of device slots plus the chunk caches of the host
 * slots) stay within config.value_device_bytes; all later slots use the host.
 * Placement changes no decision; outputs are bitwise equal except on cuda when
 * a step misses chunk-cache entries, where the missed chunks' P.V is added
 * after their PCIe transfer (agreement within 1e-6 relative). On ref and cpu
 * both sides are host memory and placement is bookkeeping (the chunk cache's
 * hit and miss counts are kept the same way).
 */
#define SKV_VALUES_ALL_DEVICE ((int64_t)-1)

/**
 * Memory pools (config.pool_device_bytes > 0). The serving layout: batch_size is the number of
 * slots (sequences held at once), max_prompt_len the longest prompt one sequence may have, and
 * the memory that grows with a prompt follows its real length instead of max_prompt_len:
 *  - create allocates the fixed parts of every (layer, slot) (factor W, outliers, local window,
 *    generated tokens, selections; the chunk caches when values are on the host), the shared
 *    regions, and the pools: pool_device_bytes of device memory and pool_host_bytes of host
 *    memory, each split into pages of pool_page_bytes;
 *  - a prefill of (layer, seq) with n tokens takes one run of contiguous pages from the device
 *    pool for U [n, r], the landmarks and candidate ids (and, values on the device, the value
 *    store), and one from the host pool for the value store when values are on the host; a dense
 *    layer takes its prompt's keys and values. skv_seq_bytes says how much, page-rounded;
 *  - a prompt fed in pieces (skv_prefill_piece) also holds a staging copy of its pieces in the
 *    device pool until its last piece arrives;
 *  - skv_seq_release returns the pages; decode allocates nothing.
 * A prefill that does not fit returns SKV_ERR_OUT_OF_MEMORY with a message giving the bytes asked,
 * the bytes free and the largest run of free pages, and changes nothing. Value placement in the
 * pool mode: value_device_bytes must be SKV_VALUES_ALL_DEVICE (the value stores come from the
 * device pool) or 0 (they come from the host pool; every sparse slot has a chunk cache). A run of
 * pages is contiguous, so a pool whose free pages are scattered can refuse a prompt smaller than
 * its free bytes (the message says so); skv_cache_usage reports the largest free run.
 * Snapshots (skv_cache_save, skv_cache_load) are not available in the pool mode
 * (SKV_ERR_UNSUPPORTED).
 */

/** Largest config.n_threads. */
#define SKV_MAX_THREADS 1024

/**
 * Fills the first struct_size bytes of *cfg with the defaults (a Llama-3-8B shape,
 * see the field docs) and sets cfg->struct_size = struct_size. Returns
 * SKV_ERR_NULL_POINTER, or SKV_ERR_INVALID_ARGUMENT when struct_size is not the
 * size of some published skv_config (nothing is written then).
 */
SKV_API skv_status skv_config_init(skv_config *cfg, size_t struct_size);

/** Defaults for a Llama-3-8B shape (see field docs), compiled into the caller. */
static inline skv_config skv_config_default(void)
{
    skv_config c;
    skv_config_init(&c, sizeof c);
    return c;
}

/**
 * Checks every field of *cfg. Returns SKV_OK, SKV_ERR_NULL_POINTER,
 * SKV_ERR_INVALID_CONFIG (message names the field and value) or
 * SKV_ERR_SIZE_OVERFLOW (a buffer size would overflow).
 */
SKV_API skv_status skv_config_validate(const skv_config *cfg);

/**
 * Bytes a cache created from *cfg will hold, before anything is created.
 * device_bytes: the device-resident part (factors, landmarks, outliers,
 * local window, generated tokens, RoPE tables, the value stores of the slots
 * placed on the device and the chunk caches of the others, decode workspace;
 * the workspace depends on the backend, resolved as skv_cache_create does; for
 * cuda it is counted only when the cuda plugin can be loaded here);
 * host_bytes: the value stores of the slots placed on the host (see "Value
 * placement"; 0 by default). With ref/cpu both live in host memory; the split
 * is what a cuda cache would place on each side.
 * Either output pointer may be NULL. Fails like skv_config_validate.
 */
SKV_API skv_status skv_cache_memory(const skv_config *cfg, size_t *device_bytes, size_t *host_bytes);

/** What a cache created from a config holds, split by placement (skv_cache_memory_info). */
typedef struct skv_memory_info {
    size_t device_bytes;        /**< all device memory, as skv_cache_memory */
    size_t host_bytes;          /**< the host value stores, as skv_cache_memory */
    size_t value_store_bytes;   /**< one slot's whole value store (N_max - O chunks per KV head) */
    size_t value_cache_bytes;   /**< one host slot's chunk cache with its index (device) */
    int64_t device_value_slots; /**< (layer, sequence) slots of sparse layers whose values live on the
                                     device (a dense layer's slots keep theirs there, not counted) */
    int64_t host_value_slots;   /**< slots of sparse layers whose values live in the host store */
    int32_t value_cache_chunks; /**< chunk-cache entries per KV head of a host slot (resolved) */
} skv_memory_info;

/**
 * skv_cache_memory with the value placement spelled out: how many slots keep
 * their values on the device for cfg->value_device_bytes, and the bytes of
 * one value store and of one chunk cache. Fails like skv_config_validate
 * (a budget below the chunk caches of all slots is SKV_ERR_INVALID_CONFIG).
 */
SKV_API skv_status skv_cache_memory_info_sized(const skv_config *cfg, skv_memory_info *info, size_t info_size);
/** skv_cache_memory_info_sized with the caller's sizeof (so the struct may grow). */
static inline skv_status skv_cache_memory_info(const skv_config *cfg, skv_memory_info *info)
{
    return skv_cache_memory_info_sized(cfg, info, sizeof *info);
}

/* ------------------------------------------------------------------------ */
/* Cache                                                                    */
/* ------------------------------------------------------------------------ */

/** Opaque cache handle. */
typedef struct skv_cache skv_cache;

/**
 * Creates a cache and allocates all of its memory (see skv_cache_memory).
 * The backend is cfg->backend. When that is auto, the environment variable
 * SKV_BACKEND (ref|cpu|cuda|auto) may name one; an explicit cfg->backend is
 * never overridden. auto picks cuda when usable, else cpu.
 * Returns SKV_OK and *out, or an error with *out set to NULL:
 * SKV_ERR_INVALID_CONFIG, SKV_ERR_SIZE_OVERFLOW, SKV_ERR_NO_DEVICE,
 * SKV_ERR_OUT_OF_MEMORY, SKV_ERR_NULL_POINTER, SKV_ERR_UNSUPPORTED (cuda: a
 * shape or cuda_prefill_sms the device, driver or build cannot serve).
 */
SKV_API skv_status skv_cache_create(const skv_config *cfg, skv_cache **out);

/** Frees a cache. NULL is accepted and ignored. */
SKV_API void skv_cache_free(skv_cache *cache);

/** The backend the cache runs on (never SKV_BACKEND_AUTO). A NULL cache gives
    (skv_backend)-1, no backend (skv_backend_name says "invalid"). */
SKV_API skv_backend skv_cache_backend(const skv_cache *cache);

/** The cache's configuration, as validated (backend resolved). */
SKV_API const skv_config *skv_cache_config(const skv_cache *cache);

/** Message of the last failing call on this cache, or "". */
SKV_API const char *skv_cache_last_error(const skv_cache *cache);

/**
 * Largest magnitude accepted in the bf16 tensors of skv_prefill and skv_decode:
 * every element must satisfy |x| <= 2^32. Larger finite values (bf16 reaches
 * 3.4e38) would overflow float scores, landmark norms or attention sums; they
 * are refused like NaN and Inf, with SKV_ERR_NONFINITE and a message naming the
 * element and its value, before anything is stored. ref and cpu check it;
 * cuda checks NaN/Inf on the device but not yet this magnitude. The op-level
 * calls that take the same data (skv_op_factorize, skv_op_sparse_attention,
 * skv_op_full_attention) refuse the same values the same way.
 */
#define SKV_MAX_INPUT_MAGNITUDE 4294967296.0f

/**
 * Prefill of one layer of one sequence with a prompt of n tokens at
 * positions 0..n-1.
 *  k_pre  [n, Hk, D]  pre-RoPE keys (required)
 *  v      [n, Hk, D]  values (required)
 *  k_post [n, Hk, D]  post-RoPE keys, or NULL to let the library apply RoPE
 * Builds the rank-r factorization of k_pre viewed as [n, Hk*D], the bf16
 * landmarks, the outlier chunks, the local window (kept exact) and moves the
 * candidate chunks' values to the host store.
 * Errors: SKV_ERR_NULL_POINTER, SKV_ERR_INVALID_ARGUMENT (layer/seq out of
 * range, n < 0), SKV_ERR_PROMPT_TOO_SHORT (floor(n/c) - Lc < O + S),
 * SKV_ERR_PROMPT_TOO_LONG, SKV_ERR_ALREADY_PREFILLED, SKV_ERR_NONFINITE
 * (NaN, Inf or beyond SKV_MAX_INPUT_MAGNITUDE), SKV_ERR_OUT_OF_MEMORY,
 * SKV_ERR_NUMERICAL. On error nothing is stored.
 */
SKV_API skv_status skv_prefill(skv_cache *cache, int32_t layer, int32_t seq, int64_t n,
                       const skv_bf16 *k_pre, const skv_bf16 *v, const skv_bf16 *k_post);

/**
 * One decode step of one layer for the whole batch (all B sequences).
 *  q   [B, Hq, D]  post-RoPE queries of the new token
 *  k   [B, Hk, D]  post-RoPE key of the new token (the caller ropes it at
 *                  position n_b + generated tokens so far)
 *  v   [B, Hk, D]  value of the new token
 *  out [B, Hq, D]  float attention output
 * Appends k, v to each sequence's generated region of this layer, selects S
 * chunks per KV head, rebuilds their keys, fetches their values and attends
 * over outliers, local window, selected and generated tokens.
 * The layers stay in step: a layer takes its step of token t + 1 only after
 * every layer took its step of token t (a model runs each token through all
 * layers before the next one; in what order within a token is free).
 * Errors: SKV_ERR_NULL_POINTER, SKV_ERR_INVALID_ARGUMENT (layer out of range,
 * or a step ahead of another layer), SKV_ERR_NOT_PREFILLED, SKV_ERR_CAPACITY,
 * SKV_ERR_NONFINITE (NaN, Inf or beyond SKV_MAX_INPUT_MAGNITUDE). On error
 * nothing is appended and the previous selection is kept.
 * cuda: returns once the step is enqueued on the cache's stream; out is
 * written when the stream reaches it. The first step of each layer captures
 * the layer's step into a CUDA graph (once); later steps replay it with the
 * new tensors (two launches: the step's rows kernel, then the graph; no allocation, no
 * synchronization). A step whose
 * q, k or v holds NaN/Inf changes nothing in the cache (its out is undefined)
 * and the next synchronizing call (skv_cache_sync, stats, introspection)
 * returns SKV_ERR_NONFINITE naming the step and element. The launch sequence
 * is fixed, so a call may be captured into the caller's CUDA graph (it is then
 * launched directly into the capture); a captured call is one step and its
 * graph must be launched exactly once, before the next call on that layer.
 */
SKV_API skv_status skv_decode(skv_cache *cache, int32_t layer, const skv_bf16 *q, const skv_bf16 *k,
                      const skv_bf16 *v, float *out);

/**
 * Waits until all work enqueued on the cache (its stream, for cuda) is done.
 * Returns SKV_OK, or a deferred error of an earlier skv_decode step
 * (SKV_ERR_NONFINITE, cuda only) with a message naming the layer, tensor and
 * element; that step was not applied, and the cache stays usable. ref/cpu:
 * always SKV_OK at once.
 */
SKV_API skv_status skv_cache_sync(skv_cache *cache);

/* ------------------------------------------------------------------------ */
/* Introspection (host outputs; synchronizes like skv_cache_sync and       */
/* returns its deferred error if there is one, so it takes a non-const     */
/* cache; output structs are written up to the caller's sizeof)            */
/* ------------------------------------------------------------------------ */

/** Shape of one (layer, sequence) of a cache. */
typedef struct skv_seq_info {
    int32_t prefilled;    /**< 1 once prefilled */
    int64_t n;            /**< prompt length */
    int32_t n_chunks;     /**< N = floor(n/c) - Lc context chunks */
    int32_t n_candidates; /**< N - O */
    int32_t n_outliers;   /**< O */
    int32_t n_selected;   /**< S = budget / c */
    int32_t n_local;      /**< local-window tokens: n - N*c */
    int32_t n_generated;  /**< generated tokens appended so far */
    int32_t has_selection;/**< 1 once a decode step ran */
    int32_t values_on_device; /**< 1: values in device memory; 0: host store + chunk cache */
    /* 0.3 */
    int32_t rank;         /**< rank of this slot's factorization (config.rank, or the rank chosen
                               when config.rank == 0; 0 before prefill and on a dense layer) */
    int32_t dense;        /**< 1: a dense layer (config.dense_layers) */
} skv_seq_info;

/** Fills *info for (layer, seq). Errors: NULL pointer, out-of-range index. */
SKV_API skv_status skv_cache_seq_info_sized(skv_cache *cache, int32_t layer, int32_t seq, skv_seq_info *info,
                                            size_t info_size);
/** skv_cache_seq_info_sized with the caller's sizeof. */
static inline skv_status skv_cache_seq_info(skv_cache *cache, int32_t layer, int32_t seq, skv_seq_info *info)
{
    return skv_cache_seq_info_sized(cache, layer, seq, info, sizeof *info);
}

/**
 * Chunk ids selected at the last decode step for (layer, seq, kv_head), in
 * increasing order, into ids[0..k), and -1 into ids[k..S), k being the head's
 * count at that step (skv_cache_selected_count; S in the fixed mode; ids holds S
 * entries, S = seq_info.n_selected). SKV_ERR_NO_SELECTION before the first step
 * and on a dense layer, SKV_ERR_NOT_PREFILLED before prefill.
 */
SKV_API skv_status skv_cache_selected(skv_cache *cache, int32_t layer, int32_t seq,
                              int32_t kv_head, int32_t *ids);

/** The number k of chunks (layer, seq, kv_head) selected at the last decode step,
    into *count. Errors as skv_cache_selected. */
SKV_API skv_status skv_cache_selected_count(skv_cache *cache, int32_t layer, int32_t seq,
                                    int32_t kv_head, int32_t *count);

/** Outlier chunk ids of (layer, seq, kv_head), increasing, into ids[0..O). */
SKV_API skv_status skv_cache_outliers(skv_cache *cache, int32_t layer, int32_t seq,
                              int32_t kv_head, int32_t *ids);

/** Candidate chunk ids of (layer, seq, kv_head), increasing, into ids[0..N-O). */
SKV_API skv_status skv_cache_candidates(skv_cache *cache, int32_t layer, int32_t seq,
                                int32_t kv_head, int32_t *ids);

/** bf16 landmarks of the candidates of (layer, seq, kv_head), [N-O, D]. */
SKV_API skv_status skv_cache_landmarks(skv_cache *cache, int32_t layer, int32_t seq,
                               int32_t kv_head, skv_bf16 *landmarks);

/**
 * Cumulative time per phase, in milliseconds, since create or reset, and
 * decode counters. ref/cpu: host wall clock. cuda: device time between CUDA
 * events on the cache's streams (read at skv_cache_sync/skv_cache_stats; a
 * step enqueued while 64 earlier ones are still in flight, or inside a graph
 * capture, is not timed). cuda decode: decode_step_ms times every timed step;
 * the phases are measured on one step in 16 (launched directly, with events
 * between its kernels; the others replay the layer's CUDA graph) and scaled
 * to all timed steps; the key rebuild is fused into the attention, so
 * decode_rebuild_ms stays 0 and decode_attention_ms holds both, except in the
 * reproducible mode, where the canonical rebuild is its own kernel and
 * decode_rebuild_ms times it; decode_fetch_ms is the transfer of missed
 * chunks of host-placed values, beside the attention (in the reproducible
 * mode, beside the rebuild; the attention waits for it).
 */
typedef struct skv_stats {
    double prefill_factorize_ms;
    double prefill_rope_ms;
    double prefill_landmarks_ms; /**< landmarks and outliers */
    double prefill_offload_ms;   /**< outlier/local copies and value offload */
    double decode_select_ms;     /**< append, score, softmax, top-k */
    double decode_rebuild_ms;
    double decode_fetch_ms;
    double decode_attention_ms;
    double decode_step_ms;       /**< whole decode steps (cuda: first to last kernel of each step) */
    int64_t n_prefill_calls;
    int64_t n_decode_calls;
    int64_t decode_allocations; /**< heap allocations made by decode steps: 0 unless the
                                     workspace sized at create was exceeded (e.g. more
                                     OpenMP threads than at create) */
    double prefill_critical_ms; /**< the time prefill's own work adds to the caller's
                                     stream: ref/cpu the whole call (it is synchronous);
                                     cuda the work on the cache's stream, from the input
                                     check to the last copy, while the factorization and
                                     the value offload run beside it (their times are
                                     prefill_factorize_ms and part of prefill_offload_ms) */
    double prefill_wait_ms;     /**< cuda: time the cache's stream waited at a prefill
                                     for the previous prefill's side work to free the
                                     staging buffers; 0 when the caller's own work between
                                     prefills (the next layer's attention) covers it */
    int64_t value_cache_hits;   /**< selected chunks of host-placed slots found in the
                                     device chunk cache (every backend counts them) */
    int64_t value_cache_misses; /**< selected chunks of host-placed slots fetched from the
                                     host store */
    int64_t decode_launches;    /**< cuda: kernels run by decode steps (divide by
                                     n_decode_calls for kernels per step: 4 or 5 (5
                                     when few (sequence, KV head) pairs share many
                                     candidates), 2 more on a layer with host-placed
                                     values); a replayed step
                                     is one graph launch on the host; 0 on ref/cpu */
} skv_stats;

/** Copies the cache's phase timings into *stats (its first stats_size bytes). */
SKV_API skv_status skv_cache_stats_sized(skv_cache *cache, skv_stats *stats, size_t stats_size);
/** skv_cache_stats_sized with the caller's sizeof. */
static inline skv_status skv_cache_stats(skv_cache *cache, skv_stats *stats)
{
    return skv_cache_stats_sized(cache, stats, sizeof *stats);
}

/**
 * Decode counters of one layer since create or skv_cache_stats_reset: what its
 * steps attended to. One "head step" is one KV head of one sequence in one
 * decode step; attended_tokens / context_tokens is the share of the context a
 * head attended to. cuda counts on the device (read at the synchronization).
 */
typedef struct skv_layer_stats {
    int64_t head_steps;      /**< (step, sequence, KV head) triples decoded */
    int64_t attended_tokens; /**< tokens attended, summed over the head steps (outliers,
                                  local window, selected chunks, generated, new) */
    int64_t context_tokens;  /**< n + n_gen + 1 summed over the same head steps: the
                                  tokens dense attention attends to */
    int64_t selected_chunks; /**< chunks selected, summed over the head steps */
    int32_t dense;           /**< 1: a dense layer */
    int32_t rank_min;        /**< smallest rank over the layer's prefilled slots (0: none) */
    int32_t rank_max;        /**< largest */
    int32_t n_prefilled;     /**< prefilled slots of the layer */
    double rank_mean;        /**< mean rank over them */
} skv_layer_stats;

/** Copies layer's counters into *stats (its first stats_size bytes). */
SKV_API skv_status skv_cache_layer_stats_sized(skv_cache *cache, int32_t layer, skv_layer_stats *stats,
                                               size_t stats_size);
/** skv_cache_layer_stats_sized with the caller's sizeof. */
static inline skv_status skv_cache_layer_stats(skv_cache *cache, int32_t layer, skv_layer_stats *stats)
{
    return skv_cache_layer_stats_sized(cache, layer, stats, sizeof *stats);
}

/** Zeroes the cache's phase timings (and every layer's decode counters). */
SKV_API skv_status skv_cache_stats_reset(skv_cache *cache);

/* ------------------------------------------------------------------------ */
/* Snapshots: a cache written to a file or a buffer, restored on any backend */
/* ------------------------------------------------------------------------ */

/**
 * Writes a snapshot of the cache to the file at path: its model config and, for every
 * (layer, sequence), its state and the used part of every tensor (factors, landmarks,
 * candidate and outlier ids, outlier chunks, local window, generated tokens, the last
 * selection, the value store); docs/DESIGN.md section 11 gives the format. The snapshot
 * is portable (fixed-width little-endian fields, CRC32C checksums) and the same whatever
 * the backend or value placement of the cache that wrote it; it holds no runtime field
 * (backend, threads, stream, placement), no stats and no chunk-cache contents.
 * The file is written atomically: a temporary file beside it (path + ".tmp-<pid>-<n>",
 * mode 0666 less the umask) is written, flushed to disk and renamed onto path; a failing
 * save removes it and leaves path as it was.
 * cuda: synchronizes first as skv_cache_sync does; a deferred error of an earlier step is
 * returned and nothing is written.
 * The cache is not changed (its stats may take the phase times a synchronization adds).
 * Errors: SKV_ERR_NULL_POINTER, SKV_ERR_IO (the message names the file and the failing
 * call, with strerror's text), SKV_ERR_OUT_OF_MEMORY, SKV_ERR_DEVICE, a deferred error.
 */
SKV_API skv_status skv_cache_save(skv_cache *cache, const char *path);

/**
 * skv_cache_save into memory. *size receives the snapshot's size in bytes, always (when
 * size is non-NULL and the cache is usable). buf NULL: a size query, SKV_OK and nothing
 * written. cap < *size: SKV_ERR_INVALID_ARGUMENT, nothing written. Otherwise the first
 * *size bytes of buf hold the snapshot. The size depends only on the config and the
 * states (prompt lengths, generated tokens), so a query and the save that follows agree.
 * Errors as skv_cache_save, SKV_ERR_IO aside.
 */
SKV_API skv_status skv_cache_save_buffer(skv_cache *cache, void *buf, size_t cap, size_t *size);

/**
 * Creates a cache from the snapshot file at path, in the state the saved cache had:
 * decode continues where it stopped, with the same selections, and outputs within the
 * tolerances of the backends involved (bitwise equal with config.reproducible = 1).
 * cfg NULL: the snapshot's config with backend SKV_BACKEND_AUTO (SKV_BACKEND applies)
 * and the default runtime fields (n_threads, cuda_stream, value_device_bytes,
 * value_cache_chunks as skv_config_default gives them); the cache is as large as the
 * snapshot's config says, whatever the file's size: skv_snapshot_config tells how large
 * before loading, and says how a caller bounds it. cfg non-NULL: its runtime fields
 * (backend, n_threads, cuda_stream, value_device_bytes, value_cache_chunks) are used,
 * and every model field (n_layers, n_q_heads, n_kv_heads, head_dim, rank, chunk_size,
 * budget, n_outlier_chunks, n_local_chunks, rope.*, attn_scale, batch_size,
 * max_prompt_len, gen_capacity, factorize, reproducible) must equal the snapshot's
 * (compared as create would hold them: factorize AUTO with reproducible = 1 is
 * CANONICAL; floats bit for bit), else SKV_ERR_INVALID_CONFIG naming the first field that
 * differs and both values. Stats start at zero; the chunk caches of host-placed slots
 * start empty (their hit and miss counts restart; no decision or output depends on them).
 * The whole snapshot is checked (sizes, checksums, every id in range) before the cache is
 * created, and again as it is copied in; no length field is trusted before it was
 * checked against the bytes present.
 * Returns SKV_OK and *out, or an error with *out set to NULL (nothing created, nothing
 * leaked): SKV_ERR_NULL_POINTER, SKV_ERR_IO, SKV_ERR_FORMAT (the message names the
 * section, field and byte offset), SKV_ERR_INVALID_CONFIG, and the errors of
 * skv_cache_create.
 */
SKV_API skv_status skv_cache_load(const char *path, const skv_config *cfg, skv_cache **out);

/** skv_cache_load from the size bytes at buf (not kept after the call). */
SKV_API skv_status skv_cache_load_buffer(const void *buf, size_t size, const skv_config *cfg, skv_cache **out);

/**
 * Reads the config of the snapshot file at path without loading it: only its preamble and
 * CONF section (the first 132 bytes, their checksum checked; the slots are not read, so a
 * snapshot it accepts may still fail skv_cache_load with SKV_ERR_FORMAT). Allocates nothing
 * that grows with the snapshot's config.
 * cfg (may be NULL): cfg->struct_size must hold the caller's sizeof(skv_config), as
 * skv_config_default() sets it; on SKV_OK the first struct_size bytes of *cfg hold the
 * config skv_cache_load(path, NULL, ...) creates the cache with: the snapshot's model
 * fields, backend SKV_BACKEND_AUTO and the default runtime fields.
 * device_bytes, host_bytes (either may be NULL): skv_cache_memory of that config, the
 * memory that load allocates for the cache (a config with other runtime fields, another
 * backend or value placement, holds what skv_cache_memory says of it).
 * A snapshot of a few KB can describe a cache of many GB (an empty cache with a large
 * max_prompt_len, batch_size or gen_capacity is a valid one), and skv_cache_load with cfg
 * NULL allocates whatever it describes. A caller that loads snapshots it did not write
 * bounds that: it calls skv_snapshot_config, compares device_bytes + host_bytes with its
 * limit, and passes the config it got (runtime fields changed as it likes) to
 * skv_cache_load; a file that changed in between then fails with SKV_ERR_INVALID_CONFIG
 * (the model fields must equal the snapshot's) instead of allocating more.
 * Errors: SKV_ERR_NULL_POINTER (path), SKV_ERR_INVALID_ARGUMENT (cfg->struct_size),
 * SKV_ERR_IO, SKV_ERR_FORMAT (as skv_cache_load reports the preamble and CONF: the message
 * names the section, field and byte offset), SKV_ERR_SIZE_OVERFLOW and SKV_ERR_INVALID_CONFIG
 * (a cache of that config: as skv_cache_memory). Nothing is written on error.
 */
SKV_API skv_status skv_snapshot_config(const char *path, skv_config *cfg, size_t *device_bytes, size_t *host_bytes);

/** skv_snapshot_config of the size bytes at buf (SKV_ERR_NULL_POINTER for a NULL buf). */
SKV_API skv_status skv_snapshot_config_buffer(const void *buf, size_t size, skv_config *cfg, size_t *device_bytes,
                                              size_t *host_bytes);

/* ------------------------------------------------------------------------ */
/* Buffers of the kind a backend takes (device memory for cuda)             */
/* ------------------------------------------------------------------------ */

/**
 * Allocates bytes (> 0) of zeroed memory of the kind backend's tensors live in:
 * cudaMalloc'ed device memory for cuda, host memory for ref and cpu.
 * SKV_BACKEND_AUTO resolves as in skv_cache_create. Errors:
 * SKV_ERR_NULL_POINTER, SKV_ERR_INVALID_ARGUMENT (bytes == 0),
 * SKV_ERR_NO_DEVICE, SKV_ERR_OUT_OF_MEMORY. *ptr is NULL on error.
 */
SKV_API skv_status skv_buffer_alloc(skv_backend backend, size_t bytes, void **ptr);

/** Frees a buffer from skv_buffer_alloc with the same backend. NULL is ignored. */
SKV_API void skv_buffer_free(skv_backend backend, void *ptr);

/**
 * Copies bytes between host memory and backend memory, either direction (or
 * within either); synchronous. Errors: SKV_ERR_NULL_POINTER, SKV_ERR_NO_DEVICE,
 * SKV_ERR_DEVICE.
 */
SKV_API skv_status skv_buffer_copy(skv_backend backend, void *dst, const void *src, size_t bytes);

/** float -> bf16, round to nearest even (NaN stays NaN). */
SKV_API skv_bf16 skv_bf16_from_float(float x);

/** bf16 -> float (exact). */
SKV_API float skv_bf16_to_float(skv_bf16 x);

#ifdef __cplusplus
}
#endif

/* Op-level API: one function per dispatch slot, explicit backend. */
#include "shadowkv_ops.h"

/* Serving: decode of a list of sequences, release and reuse, prompts in pieces, pools. */
#include "shadowkv_serve.h"

#endif /* SHADOWKV_H */
