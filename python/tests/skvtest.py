"""Workload helpers shared by the cache, ops and GPU tests.

Test data and references are numpy (float32 arrays holding bf16 values, float64 references);
`Arrays` hands the data to the library as the kind under test (numpy arrays or torch tensors
on the backend's device) and `to_np` brings any result back as numpy (bf16 as float32, exactly).
"""
from __future__ import annotations

import math
import sys

import numpy as np

import shadowkv
from shadowkv import ops


def round_bf16(x):
    """float32 values rounded to bf16 (as the library rounds), kept as float32."""
    return shadowkv.as_float32(shadowkv.as_bf16(np.asarray(x, dtype=np.float32)))


def to_np(t):
    """A result of either kind as numpy: bf16 (ml_dtypes, uint16 bits, torch.bfloat16) as float32."""
    if t is None:
        return None
    if isinstance(t, np.ndarray):
        if t.dtype == np.uint16 or t.dtype.name == "bfloat16":
            return shadowkv.as_float32(t)
        return t
    torch = sys.modules["torch"]
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def bits(a):
    """The bit pattern of a float32 array (bf16 values as float32 keep theirs), for bitwise comparison
    (NaN == NaN, -0 != +0)."""
    a = to_np(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def assert_bitwise(a, b, what):
    a, b = to_np(a), to_np(b)
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    d = bits(a) != bits(b)
    assert not d.any(), f"{what}: {int(d.sum())} elements differ"


class Arrays:
    """The kind of arrays under test ("numpy" or "torch") on a backend's device: turns numpy test data
    into the library's arguments. numpy bf16 arguments are float32 (rounded to bf16 by the binding:
    exact, the data holds bf16 values); bf16_array() gives a bf16-typed one (ml_dtypes or uint16)."""

    def __init__(self, kind: str, backend: str = "cpu"):
        self.kind, self.backend = kind, backend
        if kind == "torch":
            import torch
            self.torch = torch
            self.device = (torch.device("cuda", torch.cuda.current_device()) if backend == "cuda"
                           else torch.device("cpu"))
            self.noun = "tensor"
        else:
            self.torch = None
            self.device = "cpu"
            self.noun = "array"

    def __repr__(self):
        return f"Arrays({self.kind!r}, {self.backend!r})"

    def _t(self, x, dtype):
        return self.torch.from_numpy(np.ascontiguousarray(x)).to(dtype=dtype, device=self.device)

    def bf16(self, x):
        """bf16 argument from float32 data holding bf16 values."""
        if x is None:
            return None
        if self.torch:
            return self._t(np.asarray(x, dtype=np.float32), self.torch.bfloat16)
        return np.ascontiguousarray(x, dtype=np.float32)

    def bf16_array(self, x):
        """A bf16-typed argument (numpy: ml_dtypes.bfloat16 or uint16 bits), e.g. for out=."""
        if self.torch:
            return self.bf16(x)
        return np.ascontiguousarray(shadowkv.as_bf16(np.asarray(x, dtype=np.float32)))

    def f32(self, x):
        if self.torch:
            return self._t(np.asarray(x, dtype=np.float32), self.torch.float32)
        return np.ascontiguousarray(x, dtype=np.float32)

    def i32(self, x):
        if x is None:
            return None
        if self.torch:
            return self._t(np.asarray(x, dtype=np.int32), self.torch.int32)
        return np.ascontiguousarray(x, dtype=np.int32)

    def tables(self, rope, head_dim, n_positions):
        """ops.rope_tables of this kind, on the device."""
        return ops.rope_tables(rope, head_dim, n_positions, device=self.device, arrays=self.kind)

    def strided(self, x):
        """A non-contiguous bf16 argument with x's shape and values."""
        t = self.bf16_array(np.ascontiguousarray(np.swapaxes(x, 0, 1)))
        return t.transpose(0, 1) if self.torch else np.swapaxes(t, 0, 1)

    def is_kind(self, t) -> bool:
        return isinstance(t, np.ndarray) if not self.torch else isinstance(t, self.torch.Tensor)

    @property
    def bf16_dtype_name(self):
        """How the binding names bf16 in dtype messages for this kind."""
        return "torch.bfloat16" if self.torch else "bfloat16"

    def dtype_name(self, what: str):
        """The dtype names of messages: torch.float32 / float32."""
        return f"torch.{what}" if self.torch else what


def randn(rng, *shape, scale=1.0, bf16=False):
    """Normal samples (float32; rounded to bf16 values when bf16)."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    return round_bf16(x) if bf16 else x


def lowrank_keys(rng, n, Hk, D, rank, noise=0.002):
    """Pre-RoPE keys [n, Hk, D] (float32) of the given rank plus a little noise, and a per-chunk drift
    so that chunks differ: what real keys look like to the factorization and the landmarks."""
    a = randn(rng, n, rank) @ randn(rng, rank, Hk * D) / np.float32(math.sqrt(rank))
    a = a + np.float32(noise) * randn(rng, n, Hk * D)
    return a.astype(np.float32).reshape(n, Hk, D)


def rel_l2(a, b):
    """Relative L2 error of a against b along the last dim (float64)."""
    a, b = to_np(a).astype(np.float64), to_np(b).astype(np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)


def softmax(s, axis=-1):
    s = s - s.max(axis=axis, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=axis, keepdims=True)


def attention64(q, k, v, scale):
    """softmax(q k^T * scale) v in float64: q [D], k, v [T, D]."""
    s = (k.astype(np.float64) @ q.astype(np.float64)) * scale
    return softmax(s, 0) @ v.astype(np.float64)


class Workload:
    """Prompts and decode steps for a cache config (numpy float32 holding bf16 values): per
    (layer, seq) k_pre, k_post (the library's RoPE, via ops.rope on ref), v; per step and layer
    q, k (post-RoPE at n_b + step), v."""

    def __init__(self, rng, cfg, lens, steps, key_rank=8, q_scale=1.0):
        self.cfg, self.lens, self.steps = cfg, list(lens), steps
        L, B, Hq, Hk, D = cfg.n_layers, cfg.batch_size, cfg.n_q_heads, cfg.n_kv_heads, cfg.head_dim
        assert len(self.lens) == B
        self.max_pos = cfg.max_prompt_len + cfg.gen_capacity
        self.cos, self.sin = ops.rope_tables(cfg.rope, D, self.max_pos, arrays="numpy")

        def rope(x, pos0):
            return to_np(ops.rope(x, pos0, self.cos, self.sin, cfg.rope, backend="ref"))

        self.k_pre, self.k_post, self.v = {}, {}, {}
        for layer in range(L):
            for b, n in enumerate(self.lens):
                kp = round_bf16(lowrank_keys(rng, n, Hk, D, key_rank))
                self.k_pre[layer, b] = kp
                self.k_post[layer, b] = rope(kp, 0)
                self.v[layer, b] = randn(rng, n, Hk, D, bf16=True)
        self.q, self.k, self.vn = {}, {}, {}
        for s in range(steps):
            for layer in range(L):
                self.q[s, layer] = randn(rng, B, Hq, D, scale=q_scale, bf16=True)
                kp = round_bf16(lowrank_keys(rng, B, Hk, D, key_rank))
                self.k[s, layer] = np.stack([rope(kp[b:b + 1], self.lens[b] + s)[0] for b in range(B)])
                self.vn[s, layer] = randn(rng, B, Hk, D, bf16=True)

    def prefill(self, cache, arr, with_k_post=None):
        """Prefills every (layer, seq) with arrays of arr's kind; k_post passed for odd sequences (or
        as with_k_post says)."""
        for layer in range(self.cfg.n_layers):
            for b in range(len(self.lens)):
                kp = self.k_post[layer, b] if (with_k_post if with_k_post is not None else b % 2) else None
                cache.prefill(layer, b, arr.bf16(self.k_pre[layer, b]), arr.bf16(self.v[layer, b]), arr.bf16(kp))

    def inputs(self, step, layer, arr):
        """q, k, v of (step, layer) as arr's kind."""
        return arr.bf16(self.q[step, layer]), arr.bf16(self.k[step, layer]), arr.bf16(self.vn[step, layer])

    def decode(self, cache, step, layer, arr):
        """One decode step; the output as numpy (float32)."""
        out = cache.decode(layer, *self.inputs(step, layer, arr))
        assert arr.is_kind(out), type(out)
        return to_np(out)

    def used_tokens(self, cache, layer, b, h, selected_only=False):
        """The prompt tokens (layer, b, kv head h) attended at the last step, from introspection:
        the outlier chunks, the local window and the selected chunks (only these if selected_only)."""
        info = cache.seq_info(layer, b)
        c = self.cfg.chunk_size
        sel = to_np(cache.selected(layer, b, h)).astype(np.int64)
        if selected_only:
            return (sel[:, None] * c + np.arange(c)[None, :]).reshape(-1)
        chunks = np.concatenate([to_np(cache.outliers(layer, b, h)).astype(np.int64), sel])
        tok = (chunks[:, None] * c + np.arange(c)[None, :]).reshape(-1)
        local = np.arange(info["n_chunks"] * c, info["n"])
        return np.concatenate([tok, local])

    def rebuilt_keys(self, arr):
        """What the cache attends to for selected chunks, recomputed through the op level: the rank-r
        factorization of k_pre (ops.factorize on arr's backend, with arr's kind of input; as the
        cache's prefill does), both factors rounded to bf16 as the cache stores them, keys rebuilt
        and roped (ops.rebuild_keys on ref). Per (layer, seq): [n, Hk, D] with the context tokens
        rebuilt, the local window exact."""
        cfg, out = self.cfg, {}
        for (layer, b), kp in self.k_pre.items():
            n = kp.shape[0]
            u, w = ops.factorize(arr.bf16(kp.reshape(n, -1)), cfg.rank, backend=arr.backend)
            u, w = round_bf16(to_np(u)), round_bf16(to_np(w))
            N = n // cfg.chunk_size - cfg.n_local_chunks
            ids = np.tile(np.arange(N, dtype=np.int32), (cfg.n_kv_heads, 1))
            kr = to_np(ops.rebuild_keys(u, w, ids, cfg.chunk_size, self.cos, self.sin, cfg.head_dim, cfg.rope,
                                        backend="ref"))
            k = self.k_post[layer, b].copy()
            k[: N * cfg.chunk_size] = np.swapaxes(kr, 0, 1)
            out[layer, b] = k
        return out

    def reference(self, cache, step, layer, rebuilt=None):
        """Float64 attention of step's queries over the tokens the cache reports it used: [B, Hq, D].
        Keys are the exact post-RoPE keys, or for the selected chunks those of `rebuilt` when given."""
        cfg = self.cfg
        G = cfg.n_q_heads // cfg.n_kv_heads
        scale = cfg.attn_scale if cfg.attn_scale else 1.0 / math.sqrt(cfg.head_dim)
        out = np.empty((cfg.batch_size, cfg.n_q_heads, cfg.head_dim), dtype=np.float64)
        for b in range(cfg.batch_size):
            for h in range(cfg.n_kv_heads):
                t = self.used_tokens(cache, layer, b, h)
                keys = self.k_post[layer, b].copy()
                if rebuilt is not None:
                    sel = self.used_tokens(cache, layer, b, h, selected_only=True)
                    keys[sel] = rebuilt[layer, b][sel]
                kk = np.concatenate([keys[t, h]] + [self.k[s, layer][b, h][None] for s in range(step + 1)])
                vv = np.concatenate([self.v[layer, b][t, h]] + [self.vn[s, layer][b, h][None] for s in range(step + 1)])
                for i in range(h * G, (h + 1) * G):
                    out[b, i] = attention64(self.q[step, layer][b, i], kk, vv, scale)
        return out

    def dense(self, step, layer):
        """Float64 attention over every token (prompt and generated): what sparse attention approximates."""
        cfg = self.cfg
        G = cfg.n_q_heads // cfg.n_kv_heads
        scale = cfg.attn_scale if cfg.attn_scale else 1.0 / math.sqrt(cfg.head_dim)
        out = np.empty((cfg.batch_size, cfg.n_q_heads, cfg.head_dim), dtype=np.float64)
        for b in range(cfg.batch_size):
            for i in range(cfg.n_q_heads):
                h = i // G
                kk = np.concatenate([self.k_post[layer, b][:, h]] +
                                    [self.k[s, layer][b, h][None] for s in range(step + 1)])
                vv = np.concatenate([self.v[layer, b][:, h]] + [self.vn[s, layer][b, h][None] for s in range(step + 1)])
                out[b, i] = attention64(self.q[step, layer][b, i], kk, vv, scale)
        return out


def small_config(backend, **kw):
    f = dict(n_layers=2, n_q_heads=8, n_kv_heads=2, head_dim=32, rank=24, chunk_size=4, budget=32,
             n_outlier_chunks=4, n_local_chunks=2, batch_size=2, max_prompt_len=256, gen_capacity=8,
             backend=backend, rope=dict(theta=10000.0))
    f.update(kw)
    return shadowkv.config(**f)
