"""shadowkv: Python bindings of libshadowkv, the ShadowKV sparse-attention KV cache.

The binding is a thin ctypes layer over the library's C ABI (see _ffi.py): arrays pass as raw
pointers, with no copy. Arrays are torch tensors or numpy arrays (_arrays.py):

- torch tensors: torch.bfloat16 is the library's skv_bf16; CPU tensors go to ref and cpu,
  CUDA tensors to the cuda backend as device pointers.
- numpy arrays (host memory: ref and cpu): bf16 arguments take ml_dtypes.bfloat16 arrays as
  they are, uint16 arrays as bf16 bits, and float32 arrays rounded to bf16 as the library
  rounds (as_bf16). Results are numpy arrays: float32, int32, and bf16 as ml_dtypes.bfloat16
  when ml_dtypes is installed, else uint16 bf16 bits (as_float32 converts either).

    import numpy as np, shadowkv
    cfg = shadowkv.config(n_layers=1, n_q_heads=8, n_kv_heads=2, head_dim=64, rank=32,
                          budget=256, max_prompt_len=4096, backend="cpu")
    cache = shadowkv.Cache(cfg)
    cache.prefill(0, 0, k_pre, v)             # [n, Hk, D] bf16 (or float32 numpy) each
    out = cache.decode(0, q, k, v)            # q [B, Hq, D], k/v [B, Hk, D] -> out [B, Hq, D] float32
    cache.selected(0, 0, 0)                   # the chunk ids chosen for KV head 0

Serving (0.5): sequences come and go in slots of one cache. cache.prefill (or prefill_piece, a
prompt in pieces) fills a free slot, cache.decode_active(layer, seqs, q, k, v) steps only the
listed slots, cache.release(seq) frees one; with pool_device_bytes > 0 a slot's memory follows its
prompt's length (cache.usage(), cache.seq_bytes(n)). shadowkv.serving runs transformers'
continuous batching (and `transformers serve`) on it.

A call's results are of the kind of its array arguments; a cache's introspection results of
the kind it was last given (or `arrays=` at creation; by default torch when the program has
imported torch, else numpy).

A cuda cache runs on the torch stream that is current when it is created (or `stream=`);
prefill and decode must be called with that stream current (they check), so torch's
work and the library's stay in stream order with no synchronization added.

Every C status other than SKV_OK raises ShadowKVError with the library's message.
Arguments are checked in Python first (shape, dtype, device, contiguity); those errors
are TypeError or ValueError naming the argument. Neither torch nor numpy is imported until
an array is involved: version(), backend_available(), config() and memory() need neither.
torch is an extra: pip install 'shadowkv[torch]' (and 'shadowkv[hf]' for shadowkv.hf).
"""
from __future__ import annotations

import ctypes
import os
import struct
from typing import Any, Optional, Sequence

from . import _arrays, _ffi
from ._arrays import as_bf16, as_float32
from ._ffi import Config, RopeConfig

__all__ = ["ShadowKVError", "Cache", "config", "validate", "memory", "snapshot_config", "backend_available", "version",
           "library_path", "ops", "Config", "RopeConfig", "VALUES_ALL_DEVICE", "BUDGET_ALL", "as_bf16", "as_float32",
           "scaled_config", "shard_config", "shard_heads", "min_prompt_len", "has_function"]

VALUES_ALL_DEVICE = _ffi.VALUES_ALL_DEVICE
BUDGET_ALL = _ffi.BUDGET_ALL  # config budget: every candidate chunk at every step (budget="all" in config())

_lib: Optional[ctypes.CDLL] = None


def lib() -> ctypes.CDLL:
    """The loaded libshadowkv (opened on first use; see _ffi.load for where it is looked for)."""
    global _lib
    if _lib is None:
        _lib = _ffi.load()
    return _lib


class ShadowKVError(RuntimeError):
    """A libshadowkv call failed.

    Attributes: status (the skv_status number), status_name ("SKV_ERR_..."), call (the C
    function) and message (the library's message, from skv_cache_last_error or
    skv_last_error, naming the bad argument and its value).
    """

    def __init__(self, status: int, message: str, call: str):
        self.status = status
        self.status_name = _ffi.STATUS_NAMES.get(status, f"status {status}")
        self.call = call
        self.message = message
        super().__init__(f"{call}: {self.status_name}: {message}")


def _check(status: int, call: str, cache_handle: Any = None) -> None:
    if status == _ffi.OK:
        return
    L = lib()
    msg = (L.skv_cache_last_error(cache_handle) if cache_handle else L.skv_last_error()) or b""
    if not msg and cache_handle:
        msg = L.skv_last_error() or b""
    raise ShadowKVError(status, msg.decode(errors="replace"), call)


def has_function(name: str) -> bool:
    """Whether the loaded library exports the C function `name` (a 0.3 function such as
    "skv_cache_layer_stats_sized" is missing from a library built before it)."""
    return _ffi.has_symbol(lib(), name)


def version() -> str:
    """The library's version string ("major.minor.patch")."""
    return lib().skv_version_string().decode()


def library_path() -> str:
    """The path of the libshadowkv that was loaded."""
    return lib()._skv_path


def backend_available(backend: str) -> bool:
    """Whether backend ("ref", "cpu", "cuda", "auto") can run here (skv_backend_available)."""
    return lib().skv_backend_available(_backend_id(backend)) == _ffi.OK


def _backend_id(backend: Any) -> int:
    if isinstance(backend, int) and not isinstance(backend, bool) and backend in _ffi.BACKEND_NAMES:
        return backend
    try:
        return _ffi.BACKENDS[backend]
    except (KeyError, TypeError):
        raise ValueError(f"backend {backend!r}: expected one of {sorted(_ffi.BACKENDS)}") from None


def _resolve_backend(backend: Any) -> str:
    """The backend name an op call runs on: auto is cuda when usable, else cpu (as in the library)."""
    name = _ffi.BACKEND_NAMES[_backend_id(backend)]
    if name == "auto":
        return "cuda" if backend_available("cuda") else "cpu"
    return name


_CONFIG_ENUMS = {"backend", "factorize", "select_mode", "value_dtype"}


def _enum_value(field: str, v: Any, by_name: dict) -> int:
    """An enum field of config(): one of by_name's names, or one of its numbers."""
    if isinstance(v, int) and not isinstance(v, bool) and v in by_name.values():
        return v
    if isinstance(v, str) and v in by_name:
        return by_name[v]
    raise ValueError(f"{field} {v!r}: expected one of {sorted(by_name)}")


def config(**fields: Any) -> Config:
    """A skv_config with the library's defaults (a Llama-3-8B shape), then `fields` set.

    Fields are the C names: n_layers, n_q_heads, n_kv_heads, head_dim, rank, chunk_size,
    budget, n_outlier_chunks, n_local_chunks, attn_scale, batch_size, max_prompt_len,
    gen_capacity, n_threads, value_device_bytes, value_cache_chunks. backend ("auto",
    "ref", "cpu", "cuda") and factorize ("auto", "fast", "fallback", "exact") take
    names; rope takes a dict of RopeConfig fields (theta, rotary_dim, interleaved,
    llama3_scaling, scaling_factor, low_freq_factor, high_freq_factor,
    original_max_position). select_mode takes "fixed" or "mass" (with select_mass,
    select_min_chunks); budget takes "all" (BUDGET_ALL: every candidate chunk); rank 0
    takes rank_max and rank_error_target; dense_layers takes an int bit mask or a list of
    layer numbers; select_candidates (0.4) rescores that many landmark-best chunks per head by
    their keys (docs/DESIGN.md 4.5.1); pool_device_bytes, pool_host_bytes and pool_page_bytes
    (0.5) select the pool mode of serving, where a sequence's memory follows its prompt's length
    (include/shadowkv.h, "Memory pools"); cuda_prefill_sms (0.5, cuda) confines the prefill's work
    beside the decode to that many streaming multiprocessors (0: all); value_dtype (0.6) takes
    "bf16" (default) or "fp8": the candidate chunks' values kept as fp8 e4m3 with a power-of-two
    scale per token and KV head (docs/DESIGN.md section 13); model_kv_heads and kv_head_begin
    (0.7) make the cache a head shard of a tensor-parallel group (shard_config() fills them);
    cuda_device (0.7) is the GPU a cuda cache lives on (-1: torch's current device). Nothing is
    validated here; validate() or Cache() does.
    """
    c = Config()
    _check(lib().skv_config_init(ctypes.byref(c), ctypes.sizeof(c)), "skv_config_init")
    names = dict(Config._fields_)
    for k, v in fields.items():
        if k == "backend":
            c.backend = _backend_id(v)
        elif k == "factorize":
            if v not in _ffi.ROUTES:
                raise ValueError(f"factorize {v!r}: expected one of {sorted(_ffi.ROUTES)}")
            c.factorize = _ffi.ROUTES[v]
        elif k == "select_mode":
            c.select_mode = _enum_value(k, v, _ffi.SELECT_MODES)
        elif k == "value_dtype":
            c.value_dtype = _enum_value(k, v, _ffi.VALUE_DTYPES)
        elif k == "budget" and isinstance(v, str):
            if v != "all":
                raise ValueError(f"budget {v!r}: expected a number of tokens or 'all'")
            c.budget = _ffi.BUDGET_ALL
        elif k == "dense_layers" and not isinstance(v, int):
            mask = 0
            for layer in v:
                if not isinstance(layer, int) or not 0 <= layer < 64:
                    raise ValueError(f"dense_layers: layer {layer!r}, expected ints in [0, 64)")
                mask |= 1 << layer
            c.dense_layers = mask
        elif k == "rope":
            if isinstance(v, RopeConfig):
                c.rope = v
                continue
            for rk, rv in dict(v).items():
                if rk not in dict(RopeConfig._fields_):
                    raise ValueError(f"rope field {rk!r}: not a RopeConfig field "
                                     f"({', '.join(n for n, _ in RopeConfig._fields_)})")
                try:
                    setattr(c.rope, rk, rv)
                except TypeError as e:
                    raise TypeError(f"rope field {rk}: {e}") from None
        elif k in ("struct_size", "cuda_stream"):
            raise ValueError(f"{k} is set by the binding")
        elif k in names:
            try:
                setattr(c, k, v)
            except TypeError as e:
                raise TypeError(f"config field {k}: {e}") from None
        else:
            raise ValueError(f"config field {k!r}: not a skv_config field "
                             f"({', '.join(n for n, _ in Config._fields_ if n not in ('struct_size', 'cuda_stream'))})")
    return c


def config_dict(cfg: Config) -> dict:
    """The fields of a Config as a dict (rope as a nested dict, backend and factorize as names)."""
    out = {}
    for name, _ in Config._fields_:
        v = getattr(cfg, name)
        if name == "rope":
            v = {rn: getattr(v, rn) for rn, _ in RopeConfig._fields_}
        elif name == "backend":
            v = _ffi.BACKEND_NAMES.get(v, v)
        elif name == "factorize":
            v = {i: n for n, i in _ffi.ROUTES.items()}.get(v, v)
        elif name == "select_mode":
            v = _ffi.SELECT_MODE_NAMES.get(v, v)
        elif name == "value_dtype":
            v = _ffi.VALUE_DTYPE_NAMES.get(v, v)
        out[name] = v
    return out


def validate(cfg: Config) -> None:
    """Checks every field of cfg (skv_config_validate); raises ShadowKVError naming the field."""
    _check_config(cfg)
    _check(lib().skv_config_validate(ctypes.byref(cfg)), "skv_config_validate")


def _check_config(cfg: Any) -> None:
    if not isinstance(cfg, Config):
        raise TypeError(f"cfg: expected a shadowkv.Config (from shadowkv.config()), got {type(cfg).__name__}")


def memory(cfg: Config) -> dict:
    """What a cache from cfg would hold, before creating it (skv_cache_memory_info): device_bytes,
    host_bytes, value_store_bytes, value_cache_bytes, device_value_slots, host_value_slots,
    value_cache_chunks."""
    _check_config(cfg)
    info = _ffi.MemoryInfo()
    _check(lib().skv_cache_memory_info_sized(ctypes.byref(cfg), ctypes.byref(info), ctypes.sizeof(info)),
           "skv_cache_memory_info")
    return {name: getattr(info, name) for name, _ in info._fields_}


# The CONF section of a snapshot (docs/DESIGN.md section 11.3): the model fields, little-endian. Version 2
# appends the 0.3 fields (select_mode .. dense_layers), version 3 select_candidates (0.4); an older file
# leaves the fields it lacks at their defaults.
_SNAP_FIELDS = [("n_layers", "i"), ("n_q_heads", "i"), ("n_kv_heads", "i"), ("head_dim", "i"), ("rank", "i"),
                ("chunk_size", "i"), ("budget", "i"), ("n_outlier_chunks", "i"), ("n_local_chunks", "i"),
                ("rope.theta", "f"), ("rope.rotary_dim", "i"), ("rope.interleaved", "i"),
                ("rope.llama3_scaling", "i"), ("rope.scaling_factor", "f"), ("rope.low_freq_factor", "f"),
                ("rope.high_freq_factor", "f"), ("rope.original_max_position", "i"), ("attn_scale", "f"),
                ("batch_size", "i"), ("max_prompt_len", "q"), ("gen_capacity", "i"), ("factorize", "i"),
                ("reproducible", "i")]
_SNAP_FIELDS_V2 = _SNAP_FIELDS + [("select_mode", "i"), ("select_mass", "f"), ("select_min_chunks", "i"),
                                  ("rank_max", "i"), ("rank_error_target", "f"), ("dense_layers", "Q")]
_SNAP_FIELDS_V3 = _SNAP_FIELDS_V2 + [("select_candidates", "i")]
_SNAP_FIELDS_V4 = _SNAP_FIELDS_V3 + [("model_kv_heads", "i"), ("kv_head_begin", "i")]
_SNAP_FIELDS_OF = {1: _SNAP_FIELDS, 2: _SNAP_FIELDS_V2, 3: _SNAP_FIELDS_V3, 4: _SNAP_FIELDS_V4}
_SNAP_CONF = {v: "<" + "".join(t for _, t in f) for v, f in _SNAP_FIELDS_OF.items()}


def _read_snapshot_config(path: Any) -> Optional[Config]:
    """The config a snapshot file holds, or None when its header cannot be read as version 1 to 4."""
    try:
        with open(path, "rb") as f:
            head = f.read(32 + max(struct.calcsize(x) for x in _SNAP_CONF.values()))
    except OSError:
        return None
    if len(head) < 32 or head[:8] != b"SKVSNAP\0" or head[16:20] != b"CONF":
        return None
    version, flags = struct.unpack_from("<II", head, 8)
    if version not in _SNAP_CONF or flags != 0:
        return None
    fmt = _SNAP_CONF[version]
    if len(head) < 32 + struct.calcsize(fmt) or struct.unpack_from("<Q", head, 24)[0] != struct.calcsize(fmt):
        return None
    c = config()
    for (name, _), v in zip(_SNAP_FIELDS_OF[version], struct.unpack_from(fmt, head, 32)):
        if name.startswith("rope."):
            setattr(c.rope, name[5:], v)
        else:
            setattr(c, name, v)
    c.backend = _ffi.BACKENDS["auto"]
    return c


def snapshot_config(path: Any) -> Config:
    """The config stored in a snapshot file (its model fields; the runtime fields at their
    defaults, backend auto): what Cache.load(path) creates the cache from. Raises ValueError
    when the file does not start with a version 1 to 4 snapshot header (Cache.load then says why)."""
    c = _read_snapshot_config(path)
    if c is None:
        raise ValueError(f"{os.fspath(path)!r}: not a readable version 1 to 4 shadowkv snapshot header")
    return c


def _torch():
    """torch, or an ImportError naming the extra to install."""
    return _arrays.torch_module()


class Cache:
    """A ShadowKV cache (skv_cache): prefill per (layer, sequence), decode per layer for the batch.

    Cache(cfg) or Cache(**fields) (fields as in config()). All memory is allocated here
    (see memory()). Arrays are bf16 on the cache's device: torch CPU tensors or numpy arrays
    for ref and cpu, torch tensors on the CUDA device current at creation for cuda. On cuda,
    calls are enqueued on the torch stream that was current at creation (or `stream`); prefill
    and decode refuse to run while another stream is current. decode only enqueues; sync(),
    stats() and the introspection calls wait for the cache's work, as the C API does.

    Introspection results (selected, outliers, candidates, landmarks) are of the kind of the
    arrays last given to prefill or decode; before any, of the kind `arrays` names ("numpy" or
    "torch"; by default torch when the program has imported torch, else numpy).
    """

    def __init__(self, cfg: Optional[Config] = None, stream: Any = None, arrays: Optional[str] = None,
                 **fields: Any):
        self._handle = None
        self._lib = lib()
        self._kind = _arrays.check_kind_name(arrays)
        if cfg is None:
            cfg = config(**fields)
        elif fields:
            raise TypeError("pass either a Config or fields, not both")
        c = self._runtime_config(cfg, stream)
        h = ctypes.c_void_p()
        _check(self._lib.skv_cache_create(ctypes.byref(c), ctypes.byref(h)), "skv_cache_create")
        self._adopt(h)

    def _runtime_config(self, cfg: Config, stream: Any) -> Config:
        """A copy of cfg with struct_size set and, for a cuda cache, the torch stream it will run on."""
        _check_config(cfg)
        c = Config()
        ctypes.pointer(c)[0] = cfg
        c.struct_size = ctypes.sizeof(Config)
        self._stream = None
        # a cuda cache runs on a torch stream; without a usable device (the library's probe says
        # so) torch is not needed: skv_cache_create reports SKV_ERR_NO_DEVICE with the reason
        want_cuda = c.backend in (_ffi.BACKENDS["cuda"], _ffi.BACKENDS["auto"]) and backend_available("cuda")
        if want_cuda:
            torch = _torch()
            if torch.cuda.is_available():  # else the library reports SKV_ERR_NO_DEVICE with its reason
                if c.cuda_device < 0:  # the device of the stream, or torch's current one
                    c.cuda_device = stream.device.index if stream is not None else torch.cuda.current_device()
                elif stream is not None and stream.device.index != c.cuda_device:
                    raise ValueError(f"stream is on cuda:{stream.device.index}, the cache's cuda_device is "
                                     f"{c.cuda_device}")
                s = stream if stream is not None else torch.cuda.current_stream(c.cuda_device)
                c.cuda_stream = ctypes.c_void_p(s.cuda_stream)
                self._stream = s
        elif stream is not None:
            raise ValueError("stream: only a cuda cache takes a stream")
        return c

    def _adopt(self, h: ctypes.c_void_p) -> None:
        """Takes ownership of a created (or loaded) skv_cache handle and reads its shape."""
        self._handle = h
        self.config = Config()
        ctypes.pointer(self.config)[0] = self._lib.skv_cache_config(h).contents
        self.backend = _ffi.BACKEND_NAMES[self._lib.skv_cache_backend(h)]
        if self.backend == "cuda":
            torch = _torch()
            self.device = torch.device("cuda", self.config.cuda_device)  # the library resolved -1
        else:
            self.device = "cpu"
            self._stream = None  # auto resolved to cpu (SKV_BACKEND): no stream
        c = self.config
        self.n_layers, self.batch_size = c.n_layers, c.batch_size
        self.n_q_heads, self.n_kv_heads, self.head_dim = c.n_q_heads, c.n_kv_heads, c.head_dim
        self.chunk_size, self.n_outliers = c.chunk_size, c.n_outlier_chunks
        self.n_selected = _slots_per_head(c)

    # -- snapshots --------------------------------------------------------------------
    def save(self, path: Any) -> None:
        """Writes a snapshot of the cache to path (skv_cache_save; docs/DESIGN.md section 11).

        The file is written atomically (a temporary file beside it, then a rename) and can be
        loaded on any backend with Cache.load. On cuda the cache's work is waited for first,
        and a deferred error of an earlier decode step raises instead of writing.
        """
        _check(self._lib.skv_cache_save(self._h(), os.fsencode(os.fspath(path))), "skv_cache_save", self._handle)

    @classmethod
    def load(cls, path: Any, config: Optional[Config] = None, backend: Optional[str] = None,
             stream: Any = None, arrays: Optional[str] = None) -> "Cache":
        """A cache restored from a snapshot file (skv_cache_load), in the state it was saved in.

        config: None takes the snapshot's own config (snapshot_config(path)); a Config gives the
        runtime fields (backend, n_threads, value_device_bytes, value_cache_chunks) and must
        agree with the snapshot on every model field (else ShadowKVError SKV_ERR_INVALID_CONFIG
        naming the field). backend ("ref", "cpu", "cuda", "auto") overrides the config's.
        arrays: the kind of introspection results before the first prefill or decode (see Cache).
        A corrupted, truncated or foreign file raises ShadowKVError (SKV_ERR_FORMAT) with the
        library's message naming the section and byte offset; an unreadable one SKV_ERR_IO.
        """
        self = cls.__new__(cls)
        self._handle = None
        self._lib = lib()
        self._stream = None
        self._kind = _arrays.check_kind_name(arrays)
        p = os.fsencode(os.fspath(path))
        cfg = config if config is not None else _read_snapshot_config(path)
        h = ctypes.c_void_p()
        if cfg is None:  # no readable header: the library reports why
            _check(self._lib.skv_cache_load(p, None, ctypes.byref(h)), "skv_cache_load")
        else:
            c = Config()
            ctypes.pointer(c)[0] = cfg
            if backend is not None:
                c.backend = _backend_id(backend)
            c = self._runtime_config(c, stream)
            _check(self._lib.skv_cache_load(p, ctypes.byref(c), ctypes.byref(h)), "skv_cache_load")
        self._adopt(h)
        return self

    # -- life cycle -------------------------------------------------------------------
    def close(self) -> None:
        """Frees the cache (also done when the object is collected). Waits for its work on cuda."""
        if self._handle:
            self._lib.skv_cache_free(self._handle)
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "Cache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"shadowkv.Cache(backend={self.backend!r}, L={c.n_layers}, B={c.batch_size}, Hq={c.n_q_heads}, "
                f"Hk={c.n_kv_heads}, D={c.head_dim}, rank={c.rank}, c={c.chunk_size}, budget={c.budget}, "
                f"O={c.n_outlier_chunks}, Lc={c.n_local_chunks}{'' if self._handle else ', closed'})")

    def _h(self):
        if not self._handle:
            raise ValueError("the cache is closed")
        return self._handle

    def _check_stream(self, call: str) -> None:
        if self._stream is None:
            return
        torch = _torch()
        cur = torch.cuda.current_stream(self.device)
        if cur.cuda_stream != self._stream.cuda_stream:
            raise ValueError(f"{call}: the current torch stream is {cur}, but this cache runs on {self._stream}; "
                             "call it under `with torch.cuda.stream(cache.stream)` or create the cache under "
                             "the stream you use")

    @property
    def stream(self):
        """The torch.cuda.Stream the cache runs on (None on ref and cpu)."""
        return self._stream

    @property
    def shape(self) -> dict:
        """The cache's dimensions: L, B, Hq, Hk, D, c (chunk size), O (outlier chunks), S (selected chunks)."""
        c = self.config
        return dict(L=c.n_layers, B=c.batch_size, Hq=c.n_q_heads, Hk=c.n_kv_heads, D=c.head_dim,
                    c=c.chunk_size, O=c.n_outlier_chunks, S=_slots_per_head(c))

    # -- prefill and decode -------------------------------------------------------------
    def _arrays_of(self, x: Any, name: str, dims: str):
        """The kind of x, the first array argument of prefill or decode: the kind this cache's
        introspection gives from now on. numpy arrays are host memory: not for a cuda cache."""
        K = _arrays.of(x, name, dims)
        if K.name == "numpy" and self.backend == "cuda":
            raise ValueError(f"{name}: a numpy array (host memory), but this cache runs on cuda, which takes "
                             f"torch CUDA tensors on {self.device}")
        self._kind = K.name
        return K

    def _step_tensors(self, K, q, k, v, out, rows: int, what: str):
        """The checked pointers of a step's q [rows, Hq, D], k, v [rows, Hk, D] (bf16) and out
        [rows, Hq, D] float32 (made when None); `what` names the rows in messages."""
        c = self.config
        Hq, Hk, D = c.n_q_heads, c.n_kv_heads, c.head_dim
        qa = K.check(q, "q", (rows, Hq, D), _arrays.BF16, self.device, dims=f"= [{what}, Hq, D]")
        ka = K.check(k, "k", (rows, Hk, D), _arrays.BF16, self.device, dims=f"= [{what}, Hk, D]")
        va = K.check(v, "v", (rows, Hk, D), _arrays.BF16, self.device, dims=f"= [{what}, Hk, D]")
        if out is None:
            out = K.empty((rows, Hq, D), _arrays.F32, q.device if K.name == "torch" else None)
        oa = K.check(out, "out", (rows, Hq, D), _arrays.F32, self.device, dims=f"= [{what}, Hq, D]", out=True)
        return qa, ka, va, out, oa

    def _prompt_tensors(self, k_pre, v, k_post):
        """The checked pointers of a prompt's (or a piece's) k_pre, v, k_post [n, Hk, D], and n."""
        c = self.config
        K = self._arrays_of(k_pre, "k_pre", "[n, Hk, D]")
        K.ndim(k_pre, "k_pre", 3, "[n, Hk, D]")
        n = k_pre.shape[0]
        shp = (n, c.n_kv_heads, c.head_dim)
        dims = f"= [n, Hk={c.n_kv_heads}, D={c.head_dim}]"
        a = K.check(k_pre, "k_pre", shp, _arrays.BF16, self.device, dims=dims)
        b = K.check(v, "v", shp, _arrays.BF16, self.device, dims=dims)
        p = K.check(k_post, "k_post", shp, _arrays.BF16, self.device, allow_none=True, dims=dims)
        return n, a, b, p

    def prefill(self, layer: int, seq: int, k_pre, v, k_post=None) -> None:
        """Prefill of (layer, seq) with a prompt of n tokens at positions 0..n-1.

        k_pre: [n, Hk, D] pre-RoPE keys; v: [n, Hk, D] values; k_post: [n, Hk, D] post-RoPE
        keys, or None to let the library apply its RoPE. bf16 (numpy: or float32, rounded),
        contiguous, on the cache's device. Raises ShadowKVError (e.g. SKV_ERR_PROMPT_TOO_SHORT)
        on a library error.
        """
        n, a, b, p = self._prompt_tensors(k_pre, v, k_post)
        self._check_stream("prefill")
        _check(self._lib.skv_prefill(self._h(), layer, seq, n, a, b, p), "skv_prefill", self._handle)

    def decode(self, layer: int, q, k, v, out=None):
        """One decode step of `layer` for the whole batch.

        q: [B, Hq, D] post-RoPE queries; k, v: [B, Hk, D] the new token's post-RoPE key and
        value (bf16; numpy: or float32, rounded). Returns out [B, Hq, D] float32 (a new tensor or
        array of q's kind, or `out`). On cuda the step is only enqueued: out is written when the
        cache's stream reaches it.
        """
        B = self.config.batch_size
        K = self._arrays_of(q, "q", "[B, Hq, D]")
        qa, ka, va, out, oa = self._step_tensors(K, q, k, v, out, B, "B")
        self._check_stream("decode")
        _check(self._lib.skv_decode(self._h(), layer, qa, ka, va, oa), "skv_decode", self._handle)
        return out

    # -- serving: sequences that come and go (0.5) ----------------------------------------
    def _seq_list(self, seqs: Any, call: str):
        """seqs (a list of ints, a 1-d int32 numpy array or CPU tensor) as a ctypes int32 array
        (host memory, as the C call takes it)."""
        try:
            ids = [int(s) for s in (seqs.tolist() if hasattr(seqs, "tolist") else seqs)]
        except (TypeError, ValueError):
            raise TypeError(f"{call}: seqs must be a sequence of ints (a list, a 1-d int32 numpy array or "
                            f"CPU tensor), got {type(seqs).__name__}") from None
        return (ctypes.c_int32 * max(len(ids), 1))(*ids), len(ids)

    def decode_active(self, layer: int, seqs: Any, q, k, v, out=None):
        """One decode step of `layer` for the listed sequences only (skv_decode_active; continuous
        batching).

        seqs: the n distinct sequence indices (slots) in [0, batch_size) that take a step, in any
        order (a list of ints, or a 1-d int32 numpy array or CPU tensor). q: [n, Hq, D] post-RoPE
        queries, k, v: [n, Hk, D] the new tokens' post-RoPE keys and values (bf16; numpy: or
        float32, rounded); row i belongs to seqs[i]. Returns out [n, Hq, D] float32 (or `out`).
        Each listed sequence's step is bitwise the one skv_decode takes for it, whoever runs
        beside it; the others do not advance. n = 0 does nothing. A sequence advances all its
        layers together (every layer takes its step of token t before any takes t + 1). Raises
        ShadowKVError: SKV_ERR_NOT_PREFILLED for a free or partly prefilled slot,
        SKV_ERR_INVALID_ARGUMENT for a slot out of range or listed twice, SKV_ERR_CAPACITY.
        """
        ids, n = self._seq_list(seqs, "decode_active")
        K = self._arrays_of(q, "q", "[n, Hq, D]")
        qa, ka, va, out, oa = self._step_tensors(K, q, k, v, out, n, f"n={n} listed sequences")
        self._check_stream("decode_active")
        _check(self._lib.skv_decode_active(self._h(), layer, n, ids, qa, ka, va, oa), "skv_decode_active",
               self._handle)
        return out

    def decode_active_device(self, layer: int, n_active, seqs, q, k, v, out=None):
        """skv_decode_active_device (cuda only): the count and the list live in device memory and are
        read when the cache's stream reaches the step, so a CUDA graph that captured the call stays
        valid while the set changes.

        n_active: an int32 CUDA tensor of one element; seqs: an int32 CUDA tensor of batch_size
        entries (the first *n_active are the listed slots); q [B, Hq, D], k, v [B, Hk, D] bf16 and
        out [B, Hq, D] float32 hold batch_size rows, of which rows past the count are neither read
        nor written. A bad list is found on the device: the step then changes nothing and the next
        sync() raises naming the step, layer and sequence. ref and cpu: ShadowKVError
        SKV_ERR_UNSUPPORTED.
        """
        c = self.config
        B = c.batch_size
        K = self._arrays_of(q, "q", "[B, Hq, D]")
        na = K.check(n_active, "n_active", (1,), _arrays.I32, self.device, dims="= [1]")
        sa = K.check(seqs, "seqs", (B,), _arrays.I32, self.device, dims="= [B]")
        qa, ka, va, out, oa = self._step_tensors(K, q, k, v, out, B, "B")
        self._check_stream("decode_active_device")
        _check(self._lib.skv_decode_active_device(self._h(), layer, na, sa, qa, ka, va, oa),
               "skv_decode_active_device", self._handle)
        return out

    def prefill_piece(self, layer: int, seq: int, n_total: int, pos0: int, k_pre, v, k_post=None) -> None:
        """One piece of a prompt fed in pieces (skv_prefill_piece; chunked prefill).

        The piece holds tokens [pos0, pos0 + n) of a prompt of n_total tokens of (layer, seq):
        k_pre, v (and k_post, or None in every piece) [n, Hk, D] as in prefill(). Pieces arrive in
        order (the first at pos0 = 0, each next where the last ended) with the same n_total; the
        last one (pos0 + n == n_total) runs the prefill on the whole prompt, bitwise as one
        prefill() of it would. Raises ShadowKVError: SKV_ERR_SEQ_STATE for a piece out of order or
        of another n_total, SKV_ERR_OUT_OF_MEMORY when the staging (or the prefill) does not fit the
        pool, and prefill()'s errors; on error the pieces received so far stay.
        """
        n, a, b, p = self._prompt_tensors(k_pre, v, k_post)
        self._check_stream("prefill_piece")
        _check(self._lib.skv_prefill_piece(self._h(), layer, seq, n_total, pos0, n, a, b, p), "skv_prefill_piece",
               self._handle)

    def release(self, seq: int) -> None:
        """Returns sequence seq (every layer) to the free state (skv_seq_release): its prompt,
        generated tokens and selections are dropped, its pool pages (and the staging of a prompt
        still arriving in pieces) go back, and the slot may be prefilled again. Other sequences are
        not touched. Raises ShadowKVError SKV_ERR_SEQ_STATE for a slot that is already free."""
        _check(self._lib.skv_seq_release(self._h(), seq), "skv_seq_release", self._handle)

    def seq_ready(self, seq: int) -> bool:
        """Whether seq is prefilled in every layer and (cuda) its prefill's work beside the cache's
        stream is done (skv_seq_ready; does not wait). False for a free slot or a prompt still
        arriving in pieces."""
        r = ctypes.c_int32(-1)
        _check(self._lib.skv_seq_ready(self._h(), seq, ctypes.byref(r)), "skv_seq_ready", self._handle)
        return bool(r.value)

    def seq_bytes(self, n: int) -> dict:
        """Memory one sequence with an n-token prompt takes (skv_seq_bytes): device_bytes and
        host_bytes once prefilled in every layer (pool pages, page-rounded, in the pool mode;
        otherwise the fixed per-sequence bytes create set aside), and staging_bytes, what one
        layer of it holds while its prompt arrives in pieces with k_post."""
        d, h, s = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
        _check(self._lib.skv_seq_bytes(self._h(), n, ctypes.byref(d), ctypes.byref(h), ctypes.byref(s)),
               "skv_seq_bytes", self._handle)
        return {"device_bytes": d.value, "host_bytes": h.value, "staging_bytes": s.value}

    def usage(self) -> dict:
        """What the cache's memory holds now (skv_cache_usage): pooled, page_bytes, device_pool_bytes,
        device_used_bytes, device_largest_free, host_pool_bytes, host_used_bytes, host_largest_free,
        staging_bytes, seqs_in_use, seqs_free. Waits for the cache's work (cuda)."""
        u = _ffi.Usage()
        _check(self._lib.skv_cache_usage_sized(self._h(), ctypes.byref(u), ctypes.sizeof(u)), "skv_cache_usage",
               self._handle)
        return {name: getattr(u, name) for name, _ in u._fields_}

    def sync(self) -> None:
        """Waits for the cache's work; raises a deferred error of an earlier decode step (cuda)."""
        _check(self._lib.skv_cache_sync(self._h()), "skv_cache_sync", self._handle)

    # -- statistics and introspection ----------------------------------------------------
    def stats(self) -> dict:
        """Phase times (ms) and counters (skv_cache_stats): prefill_*_ms, decode_*_ms,
        n_prefill_calls, n_decode_calls, decode_allocations, value_cache_hits/misses, ..."""
        s = _ffi.Stats()
        _check(self._lib.skv_cache_stats_sized(self._h(), ctypes.byref(s), ctypes.sizeof(s)), "skv_cache_stats",
               self._handle)
        return {name: getattr(s, name) for name, _ in s._fields_}

    def reset_stats(self) -> None:
        """Zeroes the phase timings and counters (skv_cache_stats_reset)."""
        _check(self._lib.skv_cache_stats_reset(self._h()), "skv_cache_stats_reset", self._handle)

    def layer_stats(self, layer: int) -> dict:
        """Decode counters of one layer since create or reset_stats (skv_cache_layer_stats):
        head_steps, attended_tokens, context_tokens, selected_chunks, dense, rank_min, rank_max,
        n_prefilled, rank_mean, plus attended_share = attended_tokens / context_tokens (0.0
        before a step). Raises ShadowKVError (SKV_ERR_UNSUPPORTED) with a library built before
        skv_cache_layer_stats."""
        if not has_function("skv_cache_layer_stats_sized"):
            raise ShadowKVError(12, f"the loaded library ({library_path()}) has no skv_cache_layer_stats",
                                "skv_cache_layer_stats")
        s = _ffi.LayerStats()
        _check(self._lib.skv_cache_layer_stats_sized(self._h(), layer, ctypes.byref(s), ctypes.sizeof(s)),
               "skv_cache_layer_stats", self._handle)
        out = {name: getattr(s, name) for name, _ in s._fields_}
        out["attended_share"] = s.attended_tokens / s.context_tokens if s.context_tokens else 0.0
        return out

    def seq_info(self, layer: int, seq: int) -> dict:
        """Shape of (layer, seq): prefilled, n, n_chunks, n_candidates, n_outliers, n_selected
        (S, the selection's slots per KV head), n_local, n_generated, has_selection,
        values_on_device, rank (the slot's factorization rank; 0 before prefill and on a dense
        layer) and dense (1 on a layer of config.dense_layers)."""
        i = _ffi.SeqInfo()
        _check(self._lib.skv_cache_seq_info_sized(self._h(), layer, seq, ctypes.byref(i), ctypes.sizeof(i)),
               "skv_cache_seq_info", self._handle)
        return {name: getattr(i, name) for name, _ in i._fields_}

    def _results(self):
        """The kind of introspection results: that of the arrays last given to prefill or decode,
        else `arrays` of the constructor, else torch when imported, else numpy."""
        return _arrays.by_name(self._kind or _arrays.default_kind())

    def _per_head(self, K, fn, kv_head: Optional[int]):
        if kv_head is not None:
            return fn(kv_head)
        return K.stack([fn(h) for h in range(self.config.n_kv_heads)])

    def _ids(self, K, fn: str, layer: int, seq: int, kv_head: int, count: int):
        buf = K.empty(max(count, 1), _arrays.I32, "cpu")
        _check(getattr(self._lib, fn)(self._h(), layer, seq, kv_head, K.addr(buf)), fn, self._handle)
        return buf[:count]

    def selected_count(self, layer: int, seq: int, kv_head: Optional[int] = None):
        """The number k of chunks selected at the last decode step of (layer, seq, kv_head)
        (skv_cache_selected_count): an int, or a list of Hk ints when kv_head is None. S in the
        fixed mode; per head in select_mode "mass" and with budget "all" (N - O)."""
        if kv_head is None:
            return [self.selected_count(layer, seq, h) for h in range(self.config.n_kv_heads)]
        if not has_function("skv_cache_selected_count"):  # a library before 0.3: always S
            self.selected(layer, seq, kv_head)  # raises as the C call would (no selection, ...)
            return self.seq_info(layer, seq)["n_selected"]
        n = ctypes.c_int32(-1)
        _check(self._lib.skv_cache_selected_count(self._h(), layer, seq, kv_head, ctypes.byref(n)),
               "skv_cache_selected_count", self._handle)
        return n.value

    def selected(self, layer: int, seq: int, kv_head: Optional[int] = None, pad: bool = False):
        """Chunk ids selected at the last decode step of (layer, seq): int32 (a CPU tensor or a numpy
        array), increasing, the k ids kv_head selected (k = selected_count; S in the fixed mode).
        kv_head None: a list of Hk such arrays (their lengths may differ in select_mode "mass"), or,
        in the fixed mode (every k = S), one [Hk, S] array. pad=True: always S entries per head,
        -1 after the k ids, and one [Hk, S] array for kv_head None."""
        S = self.seq_info(layer, seq)["n_selected"]
        K = self._results()

        def one(h):
            ids = self._ids(K, "skv_cache_selected", layer, seq, h, S)
            if pad:
                return ids
            k = int((ids >= 0).sum())  # ids[0..k) are the selection, -1 after (fixed mode: k = S)
            return ids[:k]
        if kv_head is not None:
            return one(kv_head)
        heads = [one(h) for h in range(self.config.n_kv_heads)]
        if pad or len({int(x.shape[0]) for x in heads}) == 1:
            return K.stack(heads)
        return heads

    def outliers(self, layer: int, seq: int, kv_head: Optional[int] = None):
        """Outlier chunk ids of (layer, seq) (int32, O of them, increasing; [Hk, O] for kv_head None)."""
        O = self.config.n_outlier_chunks
        K = self._results()
        return self._per_head(K, lambda h: self._ids(K, "skv_cache_outliers", layer, seq, h, O), kv_head)

    def candidates(self, layer: int, seq: int, kv_head: Optional[int] = None):
        """Candidate chunk ids of (layer, seq) (int32, N - O of them, increasing; [Hk, N-O] for None)."""
        n = self.seq_info(layer, seq)["n_candidates"]
        K = self._results()
        return self._per_head(K, lambda h: self._ids(K, "skv_cache_candidates", layer, seq, h, n), kv_head)

    def landmarks(self, layer: int, seq: int, kv_head: Optional[int] = None):
        """bf16 landmarks of the candidates of (layer, seq): [N - O, D] on the host ([Hk, N-O, D] for None)."""
        n = self.seq_info(layer, seq)["n_candidates"]
        K = self._results()

        def one(h):
            buf = K.empty((max(n, 1), self.config.head_dim), _arrays.BF16, "cpu")
            _check(self._lib.skv_cache_landmarks(self._h(), layer, seq, h, K.addr(buf)), "skv_cache_landmarks",
                   self._handle)
            return buf[:n]
        return self._per_head(K, one, kv_head)


def _slots_per_head(c: Config) -> int:
    """S, the selection's slots per KV head: budget / c, or for budget = BUDGET_ALL the most
    candidates a prompt of max_prompt_len tokens has (N_max - O; the library's n_selected)."""
    if c.budget == _ffi.BUDGET_ALL:
        n_max = c.max_prompt_len // c.chunk_size - c.n_local_chunks if c.chunk_size > 0 else 0
        return max(int(n_max) - c.n_outlier_chunks, 0)
    return c.budget // c.chunk_size if c.chunk_size > 0 else 0


def min_prompt_len(cfg: Config, layer: Optional[int] = None) -> int:
    """The shortest prompt cfg's (sparse) slots take, in tokens: (O + k_min + Lc) * c, where k_min
    is S = budget / c in the fixed mode, max(1, select_min_chunks) in select_mode "mass" (with any
    budget) and 1 with budget "all" in the fixed mode; at least the rank (rank_max when rank is 0),
    since the factorization needs n >= r. layer: a layer of cfg.dense_layers needs 1 token."""
    _check_config(cfg)
    if layer is not None and layer < 64 and (cfg.dense_layers >> layer) & 1:
        return 1
    c = cfg.chunk_size
    if cfg.select_mode == _ffi.SELECT_MODES["mass"]:
        k_min = max(1, cfg.select_min_chunks)
    elif cfg.budget == _ffi.BUDGET_ALL:
        k_min = 1
    else:
        k_min = cfg.budget // c if c > 0 else 0
    n = (cfg.n_outlier_chunks + k_min + cfg.n_local_chunks) * c
    return max(n, cfg.rank if cfg.rank > 0 else cfg.rank_max, 1)


from . import ops  # noqa: E402  (ops uses the helpers above)
from ._scaled import scaled_config  # noqa: E402
from ._shard import shard_config, shard_heads  # noqa: E402
