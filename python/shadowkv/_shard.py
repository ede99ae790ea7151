"""Head shards for tensor parallelism (docs/tensor-parallel.md).

A tensor-parallel group of s GPUs gives GPU i the model's KV heads [i Hk/s, (i+1) Hk/s) and the
query heads that read them. Its cache is a head-shard cache: config fields model_kv_heads and
kv_head_begin name the range, n_kv_heads and n_q_heads are the shard's, and every tensor the cache
takes or gives holds the shard's heads only.
"""
import ctypes
from typing import Any

from . import _ffi


def shard_config(cfg: "_ffi.Config", n_shards: int, shard: int, rank: Any = "capped") -> "_ffi.Config":
    """The config of head shard `shard` of `n_shards` of the whole-model config `cfg`.

    n_kv_heads and n_q_heads become the shard's (Hk / n_shards, Hq / n_shards: both must divide),
    model_kv_heads and kv_head_begin name the range. rank: "capped" (default, the choice of
    docs/tensor-parallel.md) keeps the model's rank, capped at the shard's width n_kv_heads *
    head_dim (rank_max likewise when rank is 0); "split" divides it by n_shards (rounded up); an
    int sets it. Everything else is cfg's (cuda_device too: set it per process).
    """
    hk, hq = cfg.n_kv_heads, cfg.n_q_heads
    if cfg.model_kv_heads:
        raise ValueError("shard_config: cfg is already a head shard (model_kv_heads = %d)" % cfg.model_kv_heads)
    if not isinstance(n_shards, int) or n_shards < 1 or hk % n_shards or hq % n_shards:
        raise ValueError(f"shard_config: n_shards = {n_shards!r} must divide n_kv_heads = {hk} and "
                         f"n_q_heads = {hq}")
    if not isinstance(shard, int) or not 0 <= shard < n_shards:
        raise ValueError(f"shard_config: shard = {shard!r}, expected 0 .. {n_shards - 1}")
    c = _ffi.Config()
    ctypes.pointer(c)[0] = cfg
    c.n_kv_heads, c.n_q_heads = hk // n_shards, hq // n_shards
    c.model_kv_heads, c.kv_head_begin = hk, shard * (hk // n_shards)
    width = c.n_kv_heads * c.head_dim
    if rank == "capped":
        if c.rank:
            c.rank = min(c.rank, width)
        else:
            c.rank_max = min(c.rank_max, width)
    elif rank == "split":
        if c.rank:
            c.rank = min(-(-c.rank // n_shards), width)
        else:
            c.rank_max = min(-(-c.rank_max // n_shards), width)
    elif isinstance(rank, int) and rank >= 0:
        c.rank = rank
    else:
        raise ValueError(f"shard_config: rank = {rank!r}, expected 'capped', 'split' or an int >= 0")
    return c


def shard_heads(cfg: "_ffi.Config") -> dict:
    """The model's heads a config holds, as slices of the model's head axis: {"kv": ..., "q": ...}
    (all heads when cfg is not a shard)."""
    g = cfg.n_q_heads // cfg.n_kv_heads
    b = cfg.kv_head_begin if cfg.model_kv_heads else 0
    return {"kv": slice(b, b + cfg.n_kv_heads), "q": slice(b * g, (b + cfg.n_kv_heads) * g)}
