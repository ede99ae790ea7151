"""shadowkv: PyTorch bindings of libshadowkv, the ShadowKV sparse-attention KV cache.

The binding is a thin ctypes layer over the library's C ABI (see _ffi.py): tensors
pass as raw pointers, with no copy. CUDA tensors go to the cuda backend as device
pointers, on the torch stream current when the cache is created; CPU tensors go to
ref and cpu. torch.bfloat16 is the library's skv_bf16.

    import torch, shadowkv
    cfg = shadowkv.config(n_layers=1, n_q_heads=8, n_kv_heads=2, head_dim=64, rank=32,
                          budget=256, max_prompt_len=4096, backend="cpu")
    cache = shadowkv.Cache(cfg)
    cache.prefill(0, 0, k_pre, v)             # [n, Hk, D] bfloat16 each
    out = cache.decode(0, q, k, v)            # q [B, Hq, D], k/v [B, Hk, D] -> out [B, Hq, D] float32
    cache.selected(0, 0, 0)                   # the chunk ids chosen for KV head 0

Every C status other than SKV_OK raises ShadowKVError with the library's message.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional

from . import _ffi
from ._ffi import Config, RopeConfig

__all__ = ["ShadowKVError", "Cache", "config", "memory", "backend_available", "version", "ops", "Config",
           "RopeConfig"]

_lib: Optional[ctypes.CDLL] = None


def lib() -> ctypes.CDLL:
    """The loaded libshadowkv (opened on first use)."""
    global _lib
    if _lib is None:
        _lib = _ffi.load()
    return _lib


class ShadowKVError(RuntimeError):
    """A libshadowkv call failed: .status (int), .status_name, and the library's message."""

    def __init__(self, status: int, message: str, call: str):
        self.status = status
        self.status_name = _ffi.STATUS_NAMES.get(status, f"status {status}")
        self.call = call
        super().__init__(f"{call}: {self.status_name}: {message}")


def _check(status: int, call: str, cache_handle: Any = None) -> None:
    if status == _ffi.OK:
        return
    L = lib()
    msg = (L.skv_cache_last_error(cache_handle) if cache_handle else L.skv_last_error()) or b""
    if not msg and cache_handle:
        msg = L.skv_last_error() or b""
    raise ShadowKVError(status, msg.decode(errors="replace"), call)


def version() -> str:
    """The library's version string ("major.minor.patch")."""
    return lib().skv_version_string().decode()


def backend_available(backend: str) -> bool:
    """Whether backend ("ref", "cpu", "cuda", "auto") can run here."""
    return lib().skv_backend_available(_backend_id(backend)) == _ffi.OK


def _backend_id(backend: Any) -> int:
    if isinstance(backend, int):
        return backend
    try:
        return _ffi.BACKENDS[backend]
    except KeyError:
        raise ValueError(f"backend {backend!r}: expected one of {sorted(_ffi.BACKENDS)}") from None


def config(**fields: Any) -> Config:
    """A skv_config with the library's defaults (a Llama-3-8B shape), then fields set.

    Fields are the C names (n_layers, n_q_heads, n_kv_heads, head_dim, rank, chunk_size,
    budget, n_outlier_chunks, n_local_chunks, attn_scale, batch_size, max_prompt_len,
    gen_capacity, n_threads, value_device_bytes, value_cache_chunks); backend and
    factorize take names ("cpu", "exact", ...); rope takes a dict of RopeConfig fields.
    """
    c = Config()
    _check(lib().skv_config_init(ctypes.byref(c), ctypes.sizeof(c)), "skv_config_init")
    for k, v in fields.items():
        if k == "backend":
            c.backend = _backend_id(v)
        elif k == "factorize":
            if v not in _ffi.ROUTES:
                raise ValueError(f"factorize {v!r}: expected one of {sorted(_ffi.ROUTES)}")
            c.factorize = _ffi.ROUTES[v]
        elif k == "rope":
            for rk, rv in dict(v).items():
                if rk not in dict(RopeConfig._fields_):
                    raise ValueError(f"rope field {rk!r}: not a RopeConfig field")
                setattr(c.rope, rk, rv)
        elif k in ("struct_size", "cuda_stream"):
            raise ValueError(f"{k} is set by the binding")
        elif k in dict(Config._fields_):
            setattr(c, k, v)
        else:
            raise ValueError(f"config field {k!r}: not a skv_config field")
    return c


def memory(cfg: Config) -> dict:
    """What a cache from cfg would hold (skv_cache_memory_info): bytes and value placement."""
    info = _ffi.MemoryInfo()
    _check(lib().skv_cache_memory_info_sized(ctypes.byref(cfg), ctypes.byref(info), ctypes.sizeof(info)),
           "skv_cache_memory_info")
    return {name: getattr(info, name) for name, _ in info._fields_}


def _torch():
    import torch  # imported lazily: the package loads without torch for version queries
    return torch


def _tensor(t: Any, name: str, shape: tuple, dtype: Any, device_type: str, allow_none: bool = False):
    """Checks a torch tensor argument; returns its address (or None)."""
    torch = _torch()
    if t is None:
        if allow_none:
            return None
        raise TypeError(f"{name}: a tensor is required, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: dtype {t.dtype}, expected {dtype}")
    if t.device.type != device_type:
        raise ValueError(f"{name}: on {t.device}, but this backend takes {device_type} tensors")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    return t.data_ptr() if t.numel() else None


class Cache:
    """A ShadowKV cache (skv_cache): prefill per (layer, sequence), decode per layer for the batch.

    On cuda, every call is enqueued on the stream that was current when the cache was
    created (or `stream`); nothing here synchronizes beyond what the C API does
    (decode only enqueues; sync, stats and the introspection calls wait).
    """

    def __init__(self, cfg: Optional[Config] = None, stream: Any = None, **fields: Any):
        if cfg is None:
            cfg = config(**fields)
        elif fields:
            raise TypeError("pass either a Config or fields, not both")
        c = Config()
        ctypes.pointer(c)[0] = cfg
        self._handle = None
        want_cuda = c.backend == _ffi.BACKENDS["cuda"] or (
            c.backend == _ffi.BACKENDS["auto"] and backend_available("cuda"))
        if want_cuda:
            torch = _torch()
            s = stream if stream is not None else torch.cuda.current_stream()
            c.cuda_stream = ctypes.c_void_p(s.cuda_stream)
            self._stream = s
        h = ctypes.c_void_p()
        _check(lib().skv_cache_create(ctypes.byref(c), ctypes.byref(h)), "skv_cache_create")
        self._handle = h
        got = lib().skv_cache_config(h).contents
        self.config = Config()
        ctypes.pointer(self.config)[0] = got
        self.backend = _ffi.BACKEND_NAMES[lib().skv_cache_backend(h)]
        self._device = "cuda" if self.backend == "cuda" else "cpu"

    def close(self) -> None:
        """Frees the cache (also done when the object is collected)."""
        if self._handle:
            lib().skv_cache_free(self._handle)
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _h(self):
        if not self._handle:
            raise ValueError("the cache is closed")
        return self._handle

    @property
    def shape(self) -> dict:
        c = self.config
        return dict(L=c.n_layers, B=c.batch_size, Hq=c.n_q_heads, Hk=c.n_kv_heads, D=c.head_dim,
                    c=c.chunk_size, O=c.n_outlier_chunks, S=c.budget // c.chunk_size)

    def prefill(self, layer: int, seq: int, k_pre, v, k_post=None) -> None:
        """Prefill of (layer, seq): k_pre, v (and optional k_post) [n, Hk, D] bfloat16."""
        torch = _torch()
        c = self.config
        if not isinstance(k_pre, torch.Tensor) or k_pre.dim() != 3:
            raise ValueError("k_pre: expected a [n, Hk, D] tensor")
        n = k_pre.shape[0]
        shp = (n, c.n_kv_heads, c.head_dim)
        a = _tensor(k_pre, "k_pre", shp, torch.bfloat16, self._device)
        b = _tensor(v, "v", shp, torch.bfloat16, self._device)
        p = _tensor(k_post, "k_post", shp, torch.bfloat16, self._device, allow_none=True)
        _check(lib().skv_prefill(self._h(), layer, seq, n, a, b, p), "skv_prefill", self._handle)

    def decode(self, layer: int, q, k, v, out=None):
        """One decode step of layer for the whole batch: q [B, Hq, D], k, v [B, Hk, D] bfloat16
        (post-RoPE); returns out [B, Hq, D] float32 (written when the stream reaches it on cuda)."""
        torch = _torch()
        c = self.config
        B, Hq, Hk, D = c.batch_size, c.n_q_heads, c.n_kv_heads, c.head_dim
        qa = _tensor(q, "q", (B, Hq, D), torch.bfloat16, self._device)
        ka = _tensor(k, "k", (B, Hk, D), torch.bfloat16, self._device)
        va = _tensor(v, "v", (B, Hk, D), torch.bfloat16, self._device)
        if out is None:
            out = torch.empty((B, Hq, D), dtype=torch.float32, device=q.device)
        oa = _tensor(out, "out", (B, Hq, D), torch.float32, self._device)
        _check(lib().skv_decode(self._h(), layer, qa, ka, va, oa), "skv_decode", self._handle)
        return out

    def sync(self) -> None:
        """Waits for the cache's work; raises a deferred error of an earlier decode step."""
        _check(lib().skv_cache_sync(self._h()), "skv_cache_sync", self._handle)

    def stats(self) -> dict:
        """Phase times (ms) and counters (skv_cache_stats)."""
        s = _ffi.Stats()
        _check(lib().skv_cache_stats_sized(self._h(), ctypes.byref(s), ctypes.sizeof(s)), "skv_cache_stats",
               self._handle)
        return {name: getattr(s, name) for name, _ in s._fields_}

    def reset_stats(self) -> None:
        _check(lib().skv_cache_stats_reset(self._h()), "skv_cache_stats_reset", self._handle)

    def seq_info(self, layer: int, seq: int) -> dict:
        """Shape of (layer, seq): prefilled, n, n_chunks, n_candidates, n_outliers, ..."""
        i = _ffi.SeqInfo()
        _check(lib().skv_cache_seq_info_sized(self._h(), layer, seq, ctypes.byref(i), ctypes.sizeof(i)),
               "skv_cache_seq_info", self._handle)
        return {name: getattr(i, name) for name, _ in i._fields_}

    def _ids(self, fn: str, layer: int, seq: int, kv_head: int, count: int):
        torch = _torch()
        out = torch.empty(count, dtype=torch.int32)
        _check(getattr(lib(), fn)(self._h(), layer, seq, kv_head, out.data_ptr() if count else None), fn,
               self._handle)
        return out

    def selected(self, layer: int, seq: int, kv_head: int):
        """Chunk ids selected at the last decode step (int32 CPU tensor of S, increasing)."""
        return self._ids("skv_cache_selected", layer, seq, kv_head, self.shape["S"])

    def outliers(self, layer: int, seq: int, kv_head: int):
        """Outlier chunk ids (int32 CPU tensor of O, increasing)."""
        return self._ids("skv_cache_outliers", layer, seq, kv_head, self.shape["O"])

    def candidates(self, layer: int, seq: int, kv_head: int):
        """Candidate chunk ids (int32 CPU tensor of N - O, increasing)."""
        return self._ids("skv_cache_candidates", layer, seq, kv_head, self.seq_info(layer, seq)["n_candidates"])

    def landmarks(self, layer: int, seq: int, kv_head: int):
        """bf16 landmarks of the candidates ([N - O, D] CPU tensor)."""
        torch = _torch()
        n = self.seq_info(layer, seq)["n_candidates"]
        out = torch.empty((n, self.config.head_dim), dtype=torch.bfloat16)
        _check(lib().skv_cache_landmarks(self._h(), layer, seq, kv_head, out.data_ptr() if n else None),
               "skv_cache_landmarks", self._handle)
        return out


from . import ops  # noqa: E402  (ops uses the helpers above)
