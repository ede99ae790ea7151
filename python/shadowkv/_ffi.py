"""ctypes declarations of libshadowkv's C ABI (include/shadowkv.h with include/shadowkv_ops.h and include/shadowkv_serve.h), and the loader.

Every struct here mirrors the header field by field. skv_config carries its own
size (struct_size), and skv_config_init refuses a size the library does not know,
so a mismatch between this file and the library is caught at the first call.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
from ctypes import (POINTER, Structure, c_char_p, c_double, c_float, c_int, c_int32, c_int64, c_size_t,
                    c_uint, c_uint16, c_uint64, c_void_p)

# skv_status
OK = 0
STATUS_NAMES = {
    0: "SKV_OK", 1: "SKV_ERR_INVALID_ARGUMENT", 2: "SKV_ERR_NULL_POINTER", 3: "SKV_ERR_INVALID_CONFIG",
    4: "SKV_ERR_SIZE_OVERFLOW", 5: "SKV_ERR_PROMPT_TOO_SHORT", 6: "SKV_ERR_PROMPT_TOO_LONG",
    7: "SKV_ERR_NOT_PREFILLED", 8: "SKV_ERR_ALREADY_PREFILLED", 9: "SKV_ERR_CAPACITY", 10: "SKV_ERR_NONFINITE",
    11: "SKV_ERR_OUT_OF_MEMORY", 12: "SKV_ERR_UNSUPPORTED", 13: "SKV_ERR_NO_DEVICE", 14: "SKV_ERR_NUMERICAL",
    15: "SKV_ERR_NO_SELECTION", 16: "SKV_ERR_DEVICE", 17: "SKV_ERR_FORMAT", 18: "SKV_ERR_IO",
    19: "SKV_ERR_SEQ_STATE",
}
ERR_SEQ_STATE = 19  # a call that does not fit the sequence's state (release of a free slot, a piece out of order)

# skv_backend
BACKENDS = {"auto": 0, "ref": 1, "cpu": 2, "cuda": 3}
BACKEND_NAMES = {v: k for k, v in BACKENDS.items()}

# skv_factorize_route
ROUTES = {"auto": 0, "fast": 1, "fallback": 2, "exact": 3, "canonical": 4}

# skv_select_mode
SELECT_MODES = {"fixed": 0, "mass": 1}
SELECT_MODE_NAMES = {v: k for k, v in SELECT_MODES.items()}
VALUE_DTYPES = {"bf16": 0, "fp8": 1}  # skv_value_dtype
VALUE_DTYPE_NAMES = {v: k for k, v in VALUE_DTYPES.items()}

# config.budget = SKV_BUDGET_ALL: every candidate chunk is selected at every step
BUDGET_ALL = -1

# SKV_VERSION_NUMBER of the include/shadowkv.h these declarations mirror; the library's
# major number must agree (its minor number may be newer: structs only grow at the end)
HEADER_VERSION = 700

VALUES_ALL_DEVICE = -1
MAX_SPANS = 16


class RopeConfig(Structure):
    _fields_ = [
        ("theta", c_float),
        ("rotary_dim", c_int32),
        ("interleaved", c_int32),
        ("llama3_scaling", c_int32),
        ("scaling_factor", c_float),
        ("low_freq_factor", c_float),
        ("high_freq_factor", c_float),
        ("original_max_position", c_int32),
    ]


class Config(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("n_layers", c_int32),
        ("n_q_heads", c_int32),
        ("n_kv_heads", c_int32),
        ("head_dim", c_int32),
        ("rank", c_int32),
        ("chunk_size", c_int32),
        ("budget", c_int32),
        ("n_outlier_chunks", c_int32),
        ("n_local_chunks", c_int32),
        ("rope", RopeConfig),
        ("attn_scale", c_float),
        ("batch_size", c_int32),
        ("max_prompt_len", c_int64),
        ("gen_capacity", c_int32),
        ("backend", c_int),
        ("n_threads", c_int32),
        ("cuda_stream", c_void_p),
        ("value_device_bytes", c_int64),
        ("value_cache_chunks", c_int32),
        ("factorize", c_int),
        ("reproducible", c_int32),
        # 0.3 (ctypes pads before the uint64 as the C compiler does: natural alignment)
        ("select_mode", c_int),
        ("select_mass", c_float),
        ("select_min_chunks", c_int32),
        ("rank_max", c_int32),
        ("rank_error_target", c_float),
        ("dense_layers", c_uint64),
        # 0.4
        ("select_candidates", c_int32),
        # 0.5: the pool mode (serving)
        ("pool_device_bytes", c_int64),
        ("pool_host_bytes", c_int64),
        ("pool_page_bytes", c_int32),
        ("cuda_prefill_sms", c_int32),
        # 0.6: value precision
        ("value_dtype", c_int32),
        # 0.7: tensor parallelism (head shards) and the cache's device
        ("model_kv_heads", c_int32),
        ("kv_head_begin", c_int32),
        ("cuda_device", c_int32),
    ]


class Stats(Structure):
    _fields_ = [
        ("prefill_factorize_ms", c_double),
        ("prefill_rope_ms", c_double),
        ("prefill_landmarks_ms", c_double),
        ("prefill_offload_ms", c_double),
        ("decode_select_ms", c_double),
        ("decode_rebuild_ms", c_double),
        ("decode_fetch_ms", c_double),
        ("decode_attention_ms", c_double),
        ("decode_step_ms", c_double),
        ("n_prefill_calls", c_int64),
        ("n_decode_calls", c_int64),
        ("decode_allocations", c_int64),
        ("prefill_critical_ms", c_double),
        ("prefill_wait_ms", c_double),
        ("value_cache_hits", c_int64),
        ("value_cache_misses", c_int64),
        ("decode_launches", c_int64),
    ]


class SeqInfo(Structure):
    _fields_ = [
        ("prefilled", c_int32),
        ("n", c_int64),
        ("n_chunks", c_int32),
        ("n_candidates", c_int32),
        ("n_outliers", c_int32),
        ("n_selected", c_int32),
        ("n_local", c_int32),
        ("n_generated", c_int32),
        ("has_selection", c_int32),
        ("values_on_device", c_int32),
        # 0.3
        ("rank", c_int32),
        ("dense", c_int32),
    ]


class LayerStats(Structure):
    _fields_ = [
        ("head_steps", c_int64),
        ("attended_tokens", c_int64),
        ("context_tokens", c_int64),
        ("selected_chunks", c_int64),
        ("dense", c_int32),
        ("rank_min", c_int32),
        ("rank_max", c_int32),
        ("n_prefilled", c_int32),
        ("rank_mean", c_double),
    ]


class MemoryInfo(Structure):
    _fields_ = [
        ("device_bytes", c_size_t),
        ("host_bytes", c_size_t),
        ("value_store_bytes", c_size_t),
        ("value_cache_bytes", c_size_t),
        ("device_value_slots", c_int64),
        ("host_value_slots", c_int64),
        ("value_cache_chunks", c_int32),
    ]


class Usage(Structure):
    """skv_usage: what a cache's memory holds now (skv_cache_usage_sized)."""
    _fields_ = [
        ("pooled", c_int32),
        ("page_bytes", c_int32),
        ("device_pool_bytes", c_size_t),
        ("device_used_bytes", c_size_t),
        ("device_largest_free", c_size_t),
        ("host_pool_bytes", c_size_t),
        ("host_used_bytes", c_size_t),
        ("host_largest_free", c_size_t),
        ("staging_bytes", c_size_t),
        ("seqs_in_use", c_int32),
        ("seqs_free", c_int32),
    ]


class KvSpan(Structure):
    _fields_ = [
        ("k", c_void_p),
        ("v", c_void_p),
        ("n_tokens", c_int64),
        ("head_stride", c_int64),
        ("token_stride", c_int64),
    ]


_P = c_void_p  # tensors pass as raw addresses (host or device)
_SIGNATURES = {
    "skv_version_number": (c_uint, []),
    "skv_version_string": (c_char_p, []),
    "skv_status_string": (c_char_p, [c_int]),
    "skv_last_error": (c_char_p, []),
    "skv_backend_name": (c_char_p, [c_int]),
    "skv_backend_parse": (c_int, [c_char_p, POINTER(c_int)]),
    "skv_backend_available": (c_int, [c_int]),
    "skv_cpu_set_simd": (c_int, [c_int32]),
    "skv_cpu_simd_level": (c_int32, []),
    "skv_config_init": (c_int, [POINTER(Config), c_size_t]),
    "skv_config_validate": (c_int, [POINTER(Config)]),
    "skv_cache_memory": (c_int, [POINTER(Config), POINTER(c_size_t), POINTER(c_size_t)]),
    "skv_cache_memory_info_sized": (c_int, [POINTER(Config), POINTER(MemoryInfo), c_size_t]),
    "skv_cache_create": (c_int, [POINTER(Config), POINTER(c_void_p)]),
    "skv_cache_free": (None, [c_void_p]),
    "skv_cache_backend": (c_int, [c_void_p]),
    "skv_cache_config": (POINTER(Config), [c_void_p]),
    "skv_cache_last_error": (c_char_p, [c_void_p]),
    "skv_prefill": (c_int, [c_void_p, c_int32, c_int32, c_int64, _P, _P, _P]),
    "skv_decode": (c_int, [c_void_p, c_int32, _P, _P, _P, _P]),
    # 0.5: serving
    "skv_decode_active": (c_int, [c_void_p, c_int32, c_int32, _P, _P, _P, _P, _P]),
    "skv_decode_active_device": (c_int, [c_void_p, c_int32, _P, _P, _P, _P, _P, _P]),
    "skv_seq_ready": (c_int, [c_void_p, c_int32, POINTER(c_int32)]),
    "skv_seq_release": (c_int, [c_void_p, c_int32]),
    "skv_prefill_piece": (c_int, [c_void_p, c_int32, c_int32, c_int64, c_int64, c_int64, _P, _P, _P]),
    "skv_seq_bytes": (c_int, [c_void_p, c_int64, POINTER(c_size_t), POINTER(c_size_t), POINTER(c_size_t)]),
    "skv_cache_usage_sized": (c_int, [c_void_p, POINTER(Usage), c_size_t]),
    "skv_cache_sync": (c_int, [c_void_p]),
    "skv_cache_seq_info_sized": (c_int, [c_void_p, c_int32, c_int32, POINTER(SeqInfo), c_size_t]),
    "skv_cache_selected": (c_int, [c_void_p, c_int32, c_int32, c_int32, _P]),
    "skv_cache_outliers": (c_int, [c_void_p, c_int32, c_int32, c_int32, _P]),
    "skv_cache_candidates": (c_int, [c_void_p, c_int32, c_int32, c_int32, _P]),
    "skv_cache_landmarks": (c_int, [c_void_p, c_int32, c_int32, c_int32, _P]),
    "skv_cache_stats_sized": (c_int, [c_void_p, POINTER(Stats), c_size_t]),
    "skv_cache_stats_reset": (c_int, [c_void_p]),
    "skv_cache_save": (c_int, [c_void_p, c_char_p]),
    "skv_cache_save_buffer": (c_int, [c_void_p, c_void_p, c_size_t, POINTER(c_size_t)]),
    "skv_cache_load": (c_int, [c_char_p, POINTER(Config), POINTER(c_void_p)]),
    "skv_cache_load_buffer": (c_int, [c_void_p, c_size_t, POINTER(Config), POINTER(c_void_p)]),
    "skv_snapshot_config": (c_int, [c_char_p, POINTER(Config), POINTER(c_size_t), POINTER(c_size_t)]),
    "skv_snapshot_config_buffer": (c_int, [c_void_p, c_size_t, POINTER(Config), POINTER(c_size_t), POINTER(c_size_t)]),
    "skv_rope_table_len": (c_size_t, [POINTER(RopeConfig), c_int32, c_int64]),
    "skv_rope_table_build": (c_int, [POINTER(RopeConfig), c_int32, c_int64, _P, _P]),
    "skv_op_factorize": (c_int, [c_int, c_int64, c_int32, c_int32, _P, _P, _P]),
    "skv_op_factorize_route": (c_int, [c_int, c_int, c_int64, c_int32, c_int32, _P, _P, _P]),
    "skv_op_release": (None, []),
    "skv_op_rope": (c_int, [c_int, POINTER(RopeConfig), c_int32, c_int64, c_int32, c_int64, _P, _P, _P, _P]),
    "skv_op_landmarks_outliers": (c_int, [c_int, c_int32, c_int32, c_int32, c_int32, c_int32, _P, _P, _P, _P]),
    "skv_op_score_select": (c_int, [c_int, c_int32, c_int32, c_int32, c_int32, c_int32, c_float, _P, _P, _P, _P, _P,
                                    _P]),
    "skv_op_score_select_mass": (c_int, [c_int, c_int32, c_int32, c_int32, c_int32, c_int32, c_float, c_int32,
                                         c_float, _P, _P, _P, _P, _P, _P, _P]),
    "skv_op_rebuild_keys": (c_int, [c_int, POINTER(RopeConfig), c_int32, c_int32, c_int32, c_int32, c_int32, c_int64,
                                    _P, _P, _P, _P, _P, _P]),
    "skv_op_rebuild_keys_canonical": (c_int, [c_int, POINTER(RopeConfig), c_int32, c_int32, c_int32, c_int32, c_int32,
                                              c_int64, _P, _P, _P, _P, _P, _P]),
    "skv_op_sparse_attention_canonical": (c_int, [c_int, c_int32, c_int32, c_int32, c_float, _P, c_int32,
                                                  POINTER(KvSpan), _P]),
    "skv_op_gather_values": (c_int, [c_int, c_int32, c_int32, c_int32, c_int32, c_int32, _P, _P, _P]),
    "skv_op_sparse_attention": (c_int, [c_int, c_int32, c_int32, c_int32, c_float, _P, c_int32, POINTER(KvSpan),
                                        _P]),
    "skv_op_full_attention": (c_int, [c_int, c_int32, c_int32, c_int32, c_float, _P, c_int64, _P, _P, _P]),
    "skv_buffer_alloc": (c_int, [c_int, c_size_t, POINTER(c_void_p)]),
    "skv_buffer_free": (None, [c_int, c_void_p]),
    "skv_buffer_copy": (c_int, [c_int, c_void_p, c_void_p, c_size_t]),
    "skv_bf16_from_float": (c_uint16, [c_float]),
    "skv_bf16_to_float": (c_float, [c_uint16]),
}

# 0.3 functions a library built before them may lack: declared when present (has_symbol says which)
_OPTIONAL_SIGNATURES = {
    "skv_cache_selected_count": (c_int, [c_void_p, c_int32, c_int32, c_int32, POINTER(c_int32)]),
    "skv_cache_layer_stats_sized": (c_int, [c_void_p, c_int32, POINTER(LayerStats), c_size_t]),
}


def has_symbol(lib: ctypes.CDLL, name: str) -> bool:
    """Whether the loaded library exports the C function `name`."""
    try:
        getattr(lib, name)
    except AttributeError:
        return False
    return True


def _candidates() -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    out = []
    env = os.environ.get("SHADOWKV_LIBRARY")  # an explicit path wins (tests/gpu/run.sh's prebuilt copy)
    if env:
        return [env]
    out.append(os.path.join(here, "libshadowkv.so.0"))  # the copy pip install put in the package
    repo = os.path.dirname(os.path.dirname(here))  # a source checkout: python/shadowkv -> repo root
    out.append(os.path.join(repo, "build", "libshadowkv.so"))
    found = ctypes.util.find_library("shadowkv")
    if found:
        out.append(found)
    out.append("libshadowkv.so.0")
    return out


def load(path: str | None = None) -> ctypes.CDLL:
    """Opens libshadowkv: path, else $SHADOWKV_LIBRARY, else the package's copy, a source checkout's
    build/libshadowkv.so, then the dynamic loader's search path."""
    errors = []
    for cand in [path] if path else _candidates():
        if os.path.sep in cand and not os.path.exists(cand):
            continue
        try:
            lib = ctypes.CDLL(cand)
        except OSError as e:
            errors.append(f"{cand}: {e}")
            continue
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
        for name, (res, args) in _OPTIONAL_SIGNATURES.items():
            if has_symbol(lib, name):
                fn = getattr(lib, name)
                fn.restype = res
                fn.argtypes = args
        got = lib.skv_version_number()
        if got // 10000 != HEADER_VERSION // 10000 or got < HEADER_VERSION:
            errors.append(f"{cand}: library version {got} does not match the binding's {HEADER_VERSION}")
            continue
        lib._skv_path = cand
        return lib
    raise OSError("libshadowkv not found (build it with `make lib` in the repository, or install it): "
                  + "; ".join(errors or ["no candidate exists"]))
