"""Op-level functions: one per dispatch slot of the library, with the backend as an argument.

A kernel author compares a kernel with the reference in three lines:

    from shadowkv import ops
    sel_idx, sel_ids, amax = ops.score_select(q, landmarks, n_select=256, backend="ref")
    assert torch.equal(my_kernel(q, landmarks).cpu(), sel_idx)

Tensors are bfloat16 (int32 for ids, float32 for U, W, tables and outputs), contiguous,
on the CPU for ref and cpu and on a CUDA device for cuda. Outputs are new tensors on
the same device. The calls are synchronous.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence

from . import _ffi, _backend_id, _check, _tensor, _torch, lib
from ._ffi import RopeConfig

__all__ = ["rope_config", "rope_tables", "factorize", "rope", "landmarks_outliers", "score_select",
           "rebuild_keys", "gather_values", "sparse_attention", "full_attention", "release"]


def _dev(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def _empty(shape, dtype, device):
    return _torch().empty(shape, dtype=dtype, device=device)


def rope_config(**fields: Any) -> RopeConfig:
    """A RopeConfig with the library's defaults (theta 500000, rotate-half, no scaling), then fields."""
    from . import config
    r = config().rope
    for k, v in fields.items():
        if k not in dict(RopeConfig._fields_):
            raise ValueError(f"rope field {k!r}: not a RopeConfig field")
        setattr(r, k, v)
    return r


def rope_tables(rope: RopeConfig, head_dim: int, n_positions: int, device: str = "cpu"):
    """(cos, sin) float32 tables [n_positions, R/2] (skv_rope_table_build), on device."""
    torch = _torch()
    n = lib().skv_rope_table_len(ctypes.byref(rope), head_dim, n_positions)
    if n == 0 and n_positions > 0:
        raise ValueError(f"rope_tables: invalid rope config or head_dim {head_dim}")
    cos = torch.empty(n, dtype=torch.float32)
    sin = torch.empty(n, dtype=torch.float32)
    _check(lib().skv_rope_table_build(ctypes.byref(rope), head_dim, n_positions, cos.data_ptr() if n else None,
                                      sin.data_ptr() if n else None), "skv_rope_table_build")
    shape = (n_positions, n // n_positions if n_positions else 0)
    return cos.view(shape).to(device), sin.view(shape).to(device)


def factorize(a, rank: int, backend: str = "ref", route: str = "auto"):
    """Rank-r factorization of a [n, d] bfloat16: (U [n, r], W [r, d]) float32 with U W ~ a."""
    torch = _torch()
    dev = _dev(backend)
    if not isinstance(a, torch.Tensor) or a.dim() != 2:
        raise ValueError("a: expected a [n, d] tensor")
    n, d = a.shape
    pa = _tensor(a, "a", (n, d), torch.bfloat16, dev)
    if route not in _ffi.ROUTES:
        raise ValueError(f"route {route!r}: expected one of {sorted(_ffi.ROUTES)}")
    u, w = _empty((n, rank), torch.float32, a.device), _empty((rank, d), torch.float32, a.device)
    _check(lib().skv_op_factorize_route(_backend_id(backend), _ffi.ROUTES[route], n, d, rank, pa, u.data_ptr(),
                                        w.data_ptr()), "skv_op_factorize")
    return u, w


def rope(x, pos0: int, cos, sin, rope_cfg: Optional[RopeConfig] = None, backend: str = "ref", out=None):
    """RoPE of x [n_tokens, n_heads, D] bfloat16 at positions pos0.. (tables from rope_tables)."""
    torch = _torch()
    dev = _dev(backend)
    rc = rope_cfg or rope_config()
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError("x: expected a [n_tokens, n_heads, D] tensor")
    n, h, D = x.shape
    px = _tensor(x, "x", (n, h, D), torch.bfloat16, dev)
    pc = _tensor(cos, "cos", tuple(cos.shape), torch.float32, dev)
    ps = _tensor(sin, "sin", tuple(cos.shape), torch.float32, dev)
    if out is None:
        out = torch.empty_like(x)
    po = _tensor(out, "out", (n, h, D), torch.bfloat16, dev)
    _check(lib().skv_op_rope(_backend_id(backend), ctypes.byref(rc), D, n, h, pos0, pc, ps, px, po), "skv_op_rope")
    return out


def landmarks_outliers(k_post, chunk: int, n_outliers: int, backend: str = "ref"):
    """Landmarks and outliers of k_post [N*c, Hk, D]: (outlier_ids [Hk, O], candidate_ids [Hk, N-O],
    landmarks [Hk, N-O, D] bfloat16)."""
    torch = _torch()
    dev = _dev(backend)
    if not isinstance(k_post, torch.Tensor) or k_post.dim() != 3:
        raise ValueError("k_post: expected a [N*c, Hk, D] tensor")
    T, Hk, D = k_post.shape
    if chunk <= 0 or T % chunk:
        raise ValueError(f"k_post: {T} tokens is not a multiple of chunk = {chunk}")
    N = T // chunk
    pk = _tensor(k_post, "k_post", (T, Hk, D), torch.bfloat16, dev)
    oid = _empty((Hk, n_outliers), torch.int32, k_post.device)
    cid = _empty((Hk, N - n_outliers), torch.int32, k_post.device)
    lm = _empty((Hk, N - n_outliers, D), torch.bfloat16, k_post.device)
    _check(lib().skv_op_landmarks_outliers(_backend_id(backend), N, chunk, Hk, D, n_outliers, pk,
                                           oid.data_ptr() if oid.numel() else None, cid.data_ptr(), lm.data_ptr()),
           "skv_op_landmarks_outliers")
    return oid, cid, lm


def score_select(q, landmarks, n_select: int, candidate_ids=None, scale: float = 0.0, backend: str = "ref"):
    """Scores landmarks [Hk, n_cand, D] against q [Hq, D] and selects n_select per KV head:
    (sel_idx [Hk, S], sel_ids [Hk, S] or None, amax [Hk, n_cand] float32)."""
    torch = _torch()
    dev = _dev(backend)
    if not isinstance(landmarks, torch.Tensor) or landmarks.dim() != 3:
        raise ValueError("landmarks: expected a [Hk, n_cand, D] tensor")
    Hk, n_cand, D = landmarks.shape
    if not isinstance(q, torch.Tensor) or q.dim() != 2:
        raise ValueError("q: expected a [Hq, D] tensor")
    Hq = q.shape[0]
    pq = _tensor(q, "q", (Hq, D), torch.bfloat16, dev)
    pl = _tensor(landmarks, "landmarks", (Hk, n_cand, D), torch.bfloat16, dev)
    pc = _tensor(candidate_ids, "candidate_ids", (Hk, n_cand), torch.int32, dev, allow_none=True)
    sel_idx = _empty((Hk, n_select), torch.int32, q.device)
    sel_ids = _empty((Hk, n_select), torch.int32, q.device) if candidate_ids is not None else None
    amax = _empty((Hk, n_cand), torch.float32, q.device)
    _check(lib().skv_op_score_select(_backend_id(backend), Hq, Hk, D, n_cand, n_select, scale, pq, pl, pc,
                                     sel_idx.data_ptr(), sel_ids.data_ptr() if sel_ids is not None else None,
                                     amax.data_ptr()), "skv_op_score_select")
    return sel_idx, sel_ids, amax


def rebuild_keys(u, w, chunk_ids, chunk: int, cos, sin, head_dim: int, rope_cfg: Optional[RopeConfig] = None,
                 backend: str = "ref"):
    """Post-RoPE keys of the chunks chunk_ids [Hk, S] from U [n, r], W [r, Hk*D] (bfloat16):
    k_out [Hk, S*c, D] bfloat16."""
    torch = _torch()
    dev = _dev(backend)
    rc = rope_cfg or rope_config()
    n, r = u.shape
    Hk, S = chunk_ids.shape
    pu = _tensor(u, "u", (n, r), torch.bfloat16, dev)
    pw = _tensor(w, "w", (r, Hk * head_dim), torch.bfloat16, dev)
    pi = _tensor(chunk_ids, "chunk_ids", (Hk, S), torch.int32, dev)
    pc = _tensor(cos, "cos", tuple(cos.shape), torch.float32, dev)
    ps = _tensor(sin, "sin", tuple(cos.shape), torch.float32, dev)
    out = _empty((Hk, S * chunk, head_dim), torch.bfloat16, u.device)
    _check(lib().skv_op_rebuild_keys(_backend_id(backend), ctypes.byref(rc), head_dim, Hk, r, chunk, S, n, pu, pw, pi,
                                     pc, ps, out.data_ptr()), "skv_op_rebuild_keys")
    return out


def gather_values(store, idx, backend: str = "ref"):
    """Value chunks idx [Hk, S] of store [Hk, n_store, c, D] bfloat16: v_out [Hk, S*c, D]."""
    torch = _torch()
    dev = _dev(backend)
    Hk, n_store, c, D = store.shape
    S = idx.shape[1]
    ps = _tensor(store, "store", (Hk, n_store, c, D), torch.bfloat16, dev)
    pi = _tensor(idx, "idx", (Hk, S), torch.int32, dev)
    out = _empty((Hk, S * c, D), torch.bfloat16, store.device)
    _check(lib().skv_op_gather_values(_backend_id(backend), Hk, D, c, n_store, S, ps, pi, out.data_ptr()),
           "skv_op_gather_values")
    return out


def sparse_attention(q, spans: Sequence[tuple], n_kv_heads: int, scale: float = 0.0, backend: str = "ref"):
    """Attention of q [Hq, D] over spans, each (k, v) with k, v [Hk, n_tokens, D] bfloat16
    (head-major) or [n_tokens, Hk, D] given as (k, v, "token-major"); out [Hq, D] float32."""
    torch = _torch()
    dev = _dev(backend)
    Hq, D = q.shape
    if len(spans) > _ffi.MAX_SPANS:
        raise ValueError(f"spans: at most {_ffi.MAX_SPANS}")
    arr = (_ffi.KvSpan * max(1, len(spans)))()
    for i, sp in enumerate(spans):
        k, v = sp[0], sp[1]
        token_major = len(sp) > 2 and sp[2] == "token-major"
        if token_major:
            n_t = k.shape[0]
            shp, hs, ts = (n_t, n_kv_heads, D), D, n_kv_heads * D
        else:
            n_t = k.shape[1]
            shp, hs, ts = (n_kv_heads, n_t, D), n_t * D, D
        arr[i].k = _tensor(k, f"spans[{i}].k", shp, torch.bfloat16, dev)
        arr[i].v = _tensor(v, f"spans[{i}].v", shp, torch.bfloat16, dev)
        arr[i].n_tokens, arr[i].head_stride, arr[i].token_stride = n_t, hs, ts
    pq = _tensor(q, "q", (Hq, D), torch.bfloat16, dev)
    out = _empty((Hq, D), torch.float32, q.device)
    _check(lib().skv_op_sparse_attention(_backend_id(backend), Hq, n_kv_heads, D, scale, pq, len(spans), arr,
                                         out.data_ptr()), "skv_op_sparse_attention")
    return out


def full_attention(q, k, v, scale: float = 0.0, backend: str = "ref"):
    """Dense attention of q [Hq, D] over k, v [n_tokens, Hk, D] bfloat16: out [Hq, D] float32."""
    torch = _torch()
    dev = _dev(backend)
    Hq, D = q.shape
    n, Hk, _ = k.shape
    pq = _tensor(q, "q", (Hq, D), torch.bfloat16, dev)
    pk = _tensor(k, "k", (n, Hk, D), torch.bfloat16, dev)
    pv = _tensor(v, "v", (n, Hk, D), torch.bfloat16, dev)
    out = _empty((Hq, D), torch.float32, q.device)
    _check(lib().skv_op_full_attention(_backend_id(backend), Hq, Hk, D, scale, pq, n, pk, pv, out.data_ptr()),
           "skv_op_full_attention")
    return out


def release() -> None:
    """Frees what op-level calls keep (cuda's factorization workspace)."""
    lib().skv_op_release()
