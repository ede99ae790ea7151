"""Op-level functions: one per dispatch slot of the library, with the backend as an argument.

A kernel author compares a kernel with the reference in three lines:

    from shadowkv import ops
    sel_idx, sel_ids, amax = ops.score_select(q, landmarks, n_select=256, backend="ref")
    assert torch.equal(my_kernel(q.cuda(), landmarks.cuda()).cpu(), sel_idx)

Arrays are bf16 (int32 for ids, float32 for U, W, tables and outputs), contiguous: torch
tensors on the CPU for ref and cpu and on the current CUDA device for cuda ("auto" is cuda
when usable, else cpu, as in the library), or numpy arrays for ref and cpu (bf16 as
ml_dtypes.bfloat16, uint16 bits, or float32 rounded to bf16 here; see the package's
docstring). All array arguments of one call are of one kind; outputs are new arrays of that
kind, on the same device. The calls are synchronous: on cuda the library runs them on the
legacy default stream and returns when done, so they must be called while torch's default
stream is current.
Which outputs are bitwise equal across backends (rope, landmarks and outliers, score_select,
gather_values) and which are compared with tolerances is docs/DESIGN.md sections 5 and 6.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence, Tuple

from . import _arrays, _backend_id, _check, _ffi, _resolve_backend, lib
from ._arrays import BF16, F32, I32
from ._ffi import RopeConfig

__all__ = ["rope_config", "rope_tables", "factorize", "rope", "landmarks_outliers", "score_select",
           "rebuild_keys", "rebuild_keys_canonical", "gather_values", "sparse_attention",
           "sparse_attention_canonical", "full_attention", "release"]


def _prepare(backend: Any, x: Any, name: str, dims: str = ""):
    """(backend id, device, array kind) for an op call whose first array argument is x.
    numpy arrays are host memory: not for cuda. On cuda, checks that the default stream is current."""
    K = _arrays.of(x, name, dims)
    name_ = _resolve_backend(backend)
    if name_ == "cuda" and K.name == "numpy":
        raise ValueError(f"{name}: a numpy array (host memory), but backend {backend!r} runs on cuda, which takes "
                         "torch CUDA tensors; pass backend='cpu' or 'ref' for numpy arrays")
    if name_ == "cuda":  # no GPU (or no plugin): the library's SKV_ERR_NO_DEVICE and its reason
        _check(lib().skv_backend_available(_ffi.BACKENDS["cuda"]), "skv_backend_available")
    dev = K.device_for(name_)
    if name_ == "cuda":
        torch = K.t
        if torch.cuda.is_available() and torch.cuda.current_stream().cuda_stream != torch.cuda.default_stream().cuda_stream:
            raise ValueError("ops on cuda run on the legacy default stream: call them while torch's default stream "
                             "is current (outside `with torch.cuda.stream(...)`)")
    return _backend_id(name_), dev, K


def _rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    return rope.rotary_dim if rope.rotary_dim else head_dim


def _check_tables(K, cos, sin, rope: RopeConfig, head_dim: int, n_positions: int, dev) -> Tuple[int, int]:
    """The tables must be float32 [>= n_positions, R/2] (or flat) on dev: the C side cannot check their length."""
    half = _rotary_dim(rope, head_dim) // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if _arrays.kind_of(t) != K.name:
            raise TypeError(f"{name}: expected a {'torch.Tensor' if K.name == 'torch' else 'numpy.ndarray'} like the "
                            f"call's other arrays (from ops.rope_tables(..., arrays={K.name!r})), "
                            f"got {type(t).__name__}")
        if K.numel(t) < n_positions * half:
            raise ValueError(f"{name}: {K.numel(t)} entries, but {n_positions} positions x R/2 = {half} need "
                             f"{n_positions * half} (ops.rope_tables(rope, head_dim, n_positions))")
    if tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"sin: shape {tuple(sin.shape)}, expected cos's {tuple(cos.shape)}")
    return (K.check(cos, "cos", tuple(cos.shape), F32, dev),
            K.check(sin, "sin", tuple(cos.shape), F32, dev))


def rope_config(**fields: Any) -> RopeConfig:
    """A RopeConfig with the library's defaults (theta 500000, rotate-half, no scaling), then fields:
    theta, rotary_dim, interleaved, llama3_scaling, scaling_factor, low_freq_factor,
    high_freq_factor, original_max_position."""
    from . import config
    r = config().rope
    for k, v in fields.items():
        if k not in dict(RopeConfig._fields_):
            raise ValueError(f"rope field {k!r}: not a RopeConfig field")
        setattr(r, k, v)
    return r


def rope_tables(rope: Optional[RopeConfig], head_dim: int, n_positions: int, device: Any = "cpu",
                arrays: Optional[str] = None):
    """(cos, sin): float32 tables [n_positions, R/2] (skv_rope_table_build: double rounded to float),
    built on the host and moved to device. Every backend uses these tables.

    arrays: "torch" or "numpy" (host only); by default torch when device is not "cpu" or the
    program has imported torch, else numpy."""
    kind = _arrays.check_kind_name(arrays)
    if kind is None:
        kind = "torch" if not (isinstance(device, str) and device == "cpu") else _arrays.default_kind()
    K = _arrays.by_name(kind)
    if kind == "numpy" and not (isinstance(device, str) and device == "cpu"):
        raise ValueError(f"device {device!r}: numpy tables are host memory (device 'cpu')")
    rope = rope if rope is not None else rope_config()
    n = lib().skv_rope_table_len(ctypes.byref(rope), head_dim, n_positions)
    if n == 0:
        raise ValueError(f"rope_tables: invalid rope config, head_dim {head_dim} or n_positions {n_positions}")
    cos = K.empty(n, F32, "cpu")
    sin = K.empty(n, F32, "cpu")
    _check(lib().skv_rope_table_build(ctypes.byref(rope), head_dim, n_positions, K.addr(cos), K.addr(sin)),
           "skv_rope_table_build")
    shape = (n_positions, n // n_positions)
    return K.to_device(cos.reshape(shape), device), K.to_device(sin.reshape(shape), device)


def factorize(a, rank: int, backend: str = "ref", route: Optional[str] = None):
    """Rank-r factorization of a [n, d] bfloat16: (U [n, r], W [r, d]) float32 with U W close to the
    best rank-r approximation (skv_op_factorize; route "auto", "fast", "fallback" or "exact" picks
    skv_op_factorize_route; ref ignores it). Compare backends on U @ W only."""
    bid, dev, K = _prepare(backend, a, "a", "[n, d]")
    K.ndim(a, "a", 2, "[n, d]")
    n, d = a.shape
    pa = K.check(a, "a", (n, d), BF16, dev)
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank: {rank!r}, expected an int in [1, min(n, d)] = [1, {min(n, d)}]")
    u, w = K.empty((n, rank), F32, dev), K.empty((rank, d), F32, dev)
    if route is None:
        _check(lib().skv_op_factorize(bid, n, d, rank, pa, K.addr(u), K.addr(w)), "skv_op_factorize")
    else:
        if route not in _ffi.ROUTES:
            raise ValueError(f"route {route!r}: expected one of {sorted(_ffi.ROUTES)}")
        _check(lib().skv_op_factorize_route(bid, _ffi.ROUTES[route], n, d, rank, pa, K.addr(u), K.addr(w)),
               "skv_op_factorize_route")
    return u, w


def rope(x, pos0: int, cos, sin, rope_cfg: Optional[RopeConfig] = None, backend: str = "ref", out=None):
    """RoPE of x [n_tokens, n_heads, D] bfloat16 at positions pos0..pos0+n_tokens-1, with tables from
    rope_tables covering pos0 + n_tokens positions: a new bf16 array (or out; out may be x when x is bf16)."""
    bid, dev, K = _prepare(backend, x, "x", "[n_tokens, n_heads, D]")
    rc = rope_cfg if rope_cfg is not None else rope_config()
    K.ndim(x, "x", 3, "[n_tokens, n_heads, D]")
    n, h, D = x.shape
    px = K.check(x, "x", (n, h, D), BF16, dev)
    if pos0 < 0:
        raise ValueError(f"pos0: {pos0}, must be >= 0")
    pc, ps = _check_tables(K, cos, sin, rc, D, pos0 + n, dev)
    if out is None:
        out = K.empty((n, h, D), BF16, dev)
    po = K.check(out, "out", (n, h, D), BF16, dev, out=True)
    _check(lib().skv_op_rope(bid, ctypes.byref(rc), D, n, h, pos0, pc, ps, px, po), "skv_op_rope")
    return out


def landmarks_outliers(k_post, chunk: int, n_outliers: int, backend: str = "ref"):
    """Landmarks and outliers of the N context chunks of k_post [N*c, Hk, D] bfloat16 (post-RoPE):
    (outlier_ids [Hk, O] int32, candidate_ids [Hk, N-O] int32, landmarks [Hk, N-O, D] bfloat16)."""
    bid, dev, K = _prepare(backend, k_post, "k_post", "[N*c, Hk, D]")
    K.ndim(k_post, "k_post", 3, "[N*c, Hk, D]")
    T, Hk, D = k_post.shape
    if chunk <= 0 or T % chunk:
        raise ValueError(f"k_post: {T} tokens is not a positive multiple of chunk = {chunk}")
    N = T // chunk
    if not 0 <= n_outliers < N:
        raise ValueError(f"n_outliers: {n_outliers}, expected 0 <= n_outliers < N = {N} chunks")
    pk = K.check(k_post, "k_post", (T, Hk, D), BF16, dev)
    oid = K.empty((Hk, max(n_outliers, 1)), I32, dev)
    cid = K.empty((Hk, N - n_outliers), I32, dev)
    lm = K.empty((Hk, N - n_outliers, D), BF16, dev)
    _check(lib().skv_op_landmarks_outliers(bid, N, chunk, Hk, D, n_outliers, pk, K.addr(oid), K.addr(cid),
                                           K.addr(lm)), "skv_op_landmarks_outliers")
    return oid[:, :n_outliers], cid, lm


def score_select(q, landmarks, n_select: int, candidate_ids=None, scale: float = 0.0, backend: str = "ref"):
    """Scores landmarks [Hk, n_cand, D] against one token's queries q [Hq, D] and selects n_select per
    KV head: (sel_idx [Hk, S] int32, sel_ids [Hk, S] int32 (None without candidate_ids [Hk, n_cand]),
    amax [Hk, n_cand] float32, the group max of the selection softmax). scale 0 = 1/sqrt(D)."""
    bid, dev, K = _prepare(backend, q, "q", "[Hq, D]")
    K.ndim(landmarks, "landmarks", 3, "[Hk, n_cand, D]")
    K.ndim(q, "q", 2, "[Hq, D]")
    Hk, n_cand, D = landmarks.shape
    Hq = q.shape[0]
    pq = K.check(q, "q", (Hq, D), BF16, dev, dims="= [Hq, D]")
    pl = K.check(landmarks, "landmarks", (Hk, n_cand, D), BF16, dev)
    pc = K.check(candidate_ids, "candidate_ids", (Hk, n_cand), I32, dev, allow_none=True, dims="= [Hk, n_cand]")
    if not 1 <= n_select <= n_cand:
        raise ValueError(f"n_select: {n_select}, expected 1 <= n_select <= n_cand = {n_cand}")
    sel_idx = K.empty((Hk, n_select), I32, dev)
    sel_ids = K.empty((Hk, n_select), I32, dev) if candidate_ids is not None else None
    amax = K.empty((Hk, n_cand), F32, dev)
    _check(lib().skv_op_score_select(bid, Hq, Hk, D, n_cand, n_select, scale, pq, pl, pc, K.addr(sel_idx),
                                     K.addr(sel_ids) if sel_ids is not None else None, K.addr(amax)),
           "skv_op_score_select")
    return sel_idx, sel_ids, amax


def rebuild_keys(u, w, chunk_ids, chunk: int, cos, sin, head_dim: int, rope_cfg: Optional[RopeConfig] = None,
                 backend: str = "ref"):
    """Post-RoPE keys of the chunks chunk_ids [Hk, S] (int32) from U [n, r] and W [r, Hk*D] (bfloat16),
    token t of chunk j at position t = j*c + i: k_out [Hk, S*c, D] bfloat16. Tables cover n positions."""
    return _rebuild(u, w, chunk_ids, chunk, cos, sin, head_dim, rope_cfg, backend, "skv_op_rebuild_keys")


def rebuild_keys_canonical(u, w, chunk_ids, chunk: int, cos, sin, head_dim: int,
                           rope_cfg: Optional[RopeConfig] = None, backend: str = "ref"):
    """rebuild_keys by the canonical rule of the reproducible mode (docs/DESIGN.md 10.2): U rows and
    W_h columns in 13-bit fixed point, exact sums, one rounding to float, RoPE. Bitwise equal on every
    backend. Same arguments and result as rebuild_keys."""
    return _rebuild(u, w, chunk_ids, chunk, cos, sin, head_dim, rope_cfg, backend, "skv_op_rebuild_keys_canonical")


def _rebuild(u, w, chunk_ids, chunk, cos, sin, head_dim, rope_cfg, backend, fn):
    """rebuild_keys and rebuild_keys_canonical: the same checks, then the C function fn."""
    bid, dev, K = _prepare(backend, u, "u", "[n, r]")
    rc = rope_cfg if rope_cfg is not None else rope_config()
    K.ndim(u, "u", 2, "[n, r]")
    K.ndim(chunk_ids, "chunk_ids", 2, "[Hk, S]")
    n, r = u.shape
    Hk, S = chunk_ids.shape
    pu = K.check(u, "u", (n, r), BF16, dev)
    pw = K.check(w, "w", (r, Hk * head_dim), BF16, dev, dims="= [r, Hk*D]")
    pi = K.check(chunk_ids, "chunk_ids", (Hk, S), I32, dev)
    pc, ps = _check_tables(K, cos, sin, rc, head_dim, n, dev)
    if chunk <= 0:
        raise ValueError(f"chunk: {chunk}, must be > 0")
    out = K.empty((Hk, S * chunk, head_dim), BF16, dev)
    _check(getattr(lib(), fn)(bid, ctypes.byref(rc), head_dim, Hk, r, chunk, S, n, pu, pw, pi, pc, ps,
                              K.addr(out)), fn)
    return out


def gather_values(store, idx, backend: str = "ref"):
    """Value chunks idx [Hk, S] (int32, 0 <= idx < n_store) of store [Hk, n_store, c, D] bfloat16:
    v_out [Hk, S*c, D]."""
    bid, dev, K = _prepare(backend, store, "store", "[Hk, n_store, c, D]")
    K.ndim(store, "store", 4, "[Hk, n_store, c, D]")
    K.ndim(idx, "idx", 2, "[Hk, S]")
    Hk, n_store, c, D = store.shape
    S = idx.shape[1]
    ps = K.check(store, "store", (Hk, n_store, c, D), BF16, dev)
    pi = K.check(idx, "idx", (Hk, S), I32, dev, dims="= [Hk, S]")
    out = K.empty((Hk, S * c, D), BF16, dev)
    _check(lib().skv_op_gather_values(bid, Hk, D, c, n_store, S, ps, pi, K.addr(out)), "skv_op_gather_values")
    return out


def sparse_attention(q, spans: Sequence[tuple], n_kv_heads: int, scale: float = 0.0, backend: str = "ref"):
    """Attention of one token's queries q [Hq, D] over the union of spans: out [Hq, D] float32.

    Each span is (k, v) with k, v [Hk, n_tokens, D] bfloat16 (head-major), or (k, v, "token-major")
    with k, v [n_tokens, Hk, D]. At most 16 spans, at least one token in total. scale 0 = 1/sqrt(D).
    """
    return _sparse(q, spans, n_kv_heads, scale, backend, "skv_op_sparse_attention")


def sparse_attention_canonical(q, spans: Sequence[tuple], n_kv_heads: int, scale: float = 0.0,
                               backend: str = "ref"):
    """sparse_attention by the canonical rule of the reproducible mode (docs/DESIGN.md 10.3): the tokens
    in span order, fmaf-chain scores, skv_expf weights, 256-lane canonical sums. Bitwise equal on every
    backend. Same arguments and result as sparse_attention."""
    return _sparse(q, spans, n_kv_heads, scale, backend, "skv_op_sparse_attention_canonical")


def _sparse(q, spans, n_kv_heads, scale, backend, fn):
    """sparse_attention and sparse_attention_canonical: the same checks, then the C function fn."""
    bid, dev, K = _prepare(backend, q, "q", "[Hq, D]")
    K.ndim(q, "q", 2, "[Hq, D]")
    Hq, D = q.shape
    if len(spans) > _ffi.MAX_SPANS:
        raise ValueError(f"spans: {len(spans)}, at most {_ffi.MAX_SPANS}")
    arr = (_ffi.KvSpan * max(1, len(spans)))()
    keep = []  # the addresses in arr (numpy: of rounded copies too) stay valid while these live
    for i, sp in enumerate(spans):
        if not isinstance(sp, (tuple, list)) or len(sp) not in (2, 3):
            raise TypeError(f"spans[{i}]: expected (k, v) or (k, v, 'token-major')")
        k, v = sp[0], sp[1]
        layout = sp[2] if len(sp) > 2 else "head-major"
        if layout not in ("head-major", "token-major"):
            raise ValueError(f"spans[{i}]: layout {layout!r}, expected 'head-major' or 'token-major'")
        K.ndim(k, f"spans[{i}].k", 3, "[Hk, n, D]" if layout == "head-major" else "[n, Hk, D]")
        if layout == "token-major":
            n_t = k.shape[0]
            shp, hs, ts = (n_t, n_kv_heads, D), D, n_kv_heads * D
        else:
            n_t = k.shape[1]
            shp, hs, ts = (n_kv_heads, n_t, D), n_t * D, D
        pk = K.check(k, f"spans[{i}].k", shp, BF16, dev)
        pv = K.check(v, f"spans[{i}].v", shp, BF16, dev)
        keep += [pk, pv]
        arr[i].k, arr[i].v = pk, pv
        arr[i].n_tokens, arr[i].head_stride, arr[i].token_stride = n_t, hs, ts
    pq = K.check(q, "q", (Hq, D), BF16, dev)
    out = K.empty((Hq, D), F32, dev)
    _check(getattr(lib(), fn)(bid, Hq, n_kv_heads, D, scale, pq, len(spans), arr, K.addr(out)), fn)
    del keep
    return out


def full_attention(q, k, v, scale: float = 0.0, backend: str = "ref"):
    """Dense attention of one token's queries q [Hq, D] over k, v [n_tokens, Hk, D] bfloat16 (the prompt
    layout): out [Hq, D] float32. The baseline sparse decode is compared against."""
    bid, dev, K = _prepare(backend, q, "q", "[Hq, D]")
    K.ndim(q, "q", 2, "[Hq, D]")
    K.ndim(k, "k", 3, "[n_tokens, Hk, D]")
    Hq, D = q.shape
    n, Hk, _ = k.shape
    pq = K.check(q, "q", (Hq, D), BF16, dev)
    pk = K.check(k, "k", (n, Hk, D), BF16, dev, dims="= [n_tokens, Hk, D]")
    pv = K.check(v, "v", (n, Hk, D), BF16, dev, dims="= [n_tokens, Hk, D]")
    out = K.empty((Hq, D), F32, dev)
    _check(lib().skv_op_full_attention(bid, Hq, Hk, D, scale, pq, n, pk, pv, K.addr(out)), "skv_op_full_attention")
    return out


def release() -> None:
    """Frees what op-level calls keep between calls (cuda's factorization workspace)."""
    lib().skv_op_release()
