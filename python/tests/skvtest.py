"""Workload helpers shared by the cache, ops and GPU tests."""
from __future__ import annotations

import math

import torch

import shadowkv
from shadowkv import ops


def randn(gen, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def lowrank_keys(gen, n, Hk, D, rank, noise=0.002):
    """Pre-RoPE keys [n, Hk, D] (float32) of the given rank plus a little noise, and a per-chunk drift
    so that chunks differ: what real keys look like to the factorization and the landmarks."""
    a = randn(gen, n, rank) @ randn(gen, rank, Hk * D) / math.sqrt(rank)
    a = a + noise * randn(gen, n, Hk * D)
    return a.view(n, Hk, D)


def rel_l2(a, b):
    """Relative L2 error of a against b along the last dim (float64)."""
    a, b = a.double(), b.double()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30))


def attention64(q, k, v, scale):
    """softmax(q k^T * scale) v in float64: q [D], k, v [T, D]."""
    s = (k.double() @ q.double()) * scale
    p = torch.softmax(s, dim=0)
    return p @ v.double()


class Workload:
    """Prompts and decode steps for a cache config: per (layer, seq) k_pre, k_post (the library's RoPE,
    via ops.rope on ref), v; per step and layer q, k (post-RoPE at n_b + step), v."""

    def __init__(self, gen, cfg, lens, steps, key_rank=8, q_scale=1.0):
        self.cfg, self.lens, self.steps = cfg, list(lens), steps
        L, B, Hq, Hk, D = cfg.n_layers, cfg.batch_size, cfg.n_q_heads, cfg.n_kv_heads, cfg.head_dim
        assert len(self.lens) == B
        self.max_pos = cfg.max_prompt_len + cfg.gen_capacity
        self.cos, self.sin = ops.rope_tables(cfg.rope, D, self.max_pos)
        self.k_pre, self.k_post, self.v = {}, {}, {}
        for layer in range(L):
            for b, n in enumerate(self.lens):
                kp = lowrank_keys(gen, n, Hk, D, key_rank).to(torch.bfloat16)
                self.k_pre[layer, b] = kp
                self.k_post[layer, b] = ops.rope(kp, 0, self.cos, self.sin, cfg.rope, backend="ref")
                self.v[layer, b] = randn(gen, n, Hk, D, dtype=torch.bfloat16)
        self.q, self.k, self.vn = {}, {}, {}
        for s in range(steps):
            for layer in range(L):
                self.q[s, layer] = randn(gen, B, Hq, D, scale=q_scale, dtype=torch.bfloat16)
                kp = lowrank_keys(gen, B, Hk, D, key_rank).to(torch.bfloat16)
                self.k[s, layer] = torch.stack([
                    ops.rope(kp[b:b + 1], self.lens[b] + s, self.cos, self.sin, cfg.rope, backend="ref")[0]
                    for b in range(B)])
                self.vn[s, layer] = randn(gen, B, Hk, D, dtype=torch.bfloat16)

    def prefill(self, cache, device, with_k_post=None):
        """Prefills every (layer, seq); k_post passed for odd sequences (or as with_k_post says)."""
        for layer in range(self.cfg.n_layers):
            for b in range(len(self.lens)):
                kp = self.k_post[layer, b].to(device) if (with_k_post if with_k_post is not None else b % 2) \
                    else None
                cache.prefill(layer, b, self.k_pre[layer, b].to(device), self.v[layer, b].to(device), kp)

    def decode(self, cache, step, layer, device):
        return cache.decode(layer, self.q[step, layer].to(device), self.k[step, layer].to(device),
                            self.vn[step, layer].to(device)).cpu()

    def used_tokens(self, cache, layer, b, h, selected_only=False):
        """The prompt tokens (layer, b, kv head h) attended at the last step, from introspection:
        the outlier chunks, the local window and the selected chunks (only these if selected_only)."""
        info = cache.seq_info(layer, b)
        c = self.cfg.chunk_size
        if selected_only:
            sel = cache.selected(layer, b, h).long()
            return (sel[:, None] * c + torch.arange(c)[None, :]).reshape(-1)
        chunks = torch.cat([cache.outliers(layer, b, h), cache.selected(layer, b, h)]).long()
        tok = (chunks[:, None] * c + torch.arange(c)[None, :]).reshape(-1)
        local = torch.arange(info["n_chunks"] * c, info["n"])
        return torch.cat([tok, local])

    def rebuilt_keys(self, backend, device):
        """What the cache attends to for selected chunks, recomputed through the op level: the rank-r
        factorization of k_pre (ops.factorize on backend, with its input on `device`, the backend's;
        as the cache's prefill does), both factors rounded to bf16 as the cache stores them, keys
        rebuilt and roped (ops.rebuild_keys on ref). Per (layer, seq), on the CPU: [n, Hk, D] with the
        context tokens rebuilt, the local window exact."""
        cfg, out = self.cfg, {}
        for (layer, b), kp in self.k_pre.items():
            n = kp.shape[0]
            u, w = ops.factorize(kp.view(n, -1).to(device), cfg.rank, backend=backend)
            u, w = u.cpu(), w.cpu()
            N = n // cfg.chunk_size - cfg.n_local_chunks
            ids = torch.arange(N, dtype=torch.int32).repeat(cfg.n_kv_heads, 1)
            kr = ops.rebuild_keys(u.to(torch.bfloat16), w.to(torch.bfloat16), ids, cfg.chunk_size, self.cos,
                                  self.sin, cfg.head_dim, cfg.rope, backend="ref")
            k = self.k_post[layer, b].clone()
            k[: N * cfg.chunk_size] = kr.transpose(0, 1)
            out[layer, b] = k
        return out

    def reference(self, cache, step, layer, rebuilt=None):
        """Float64 attention of step's queries over the tokens the cache reports it used: [B, Hq, D].
        Keys are the exact post-RoPE keys, or for the selected chunks those of `rebuilt` when given."""
        cfg = self.cfg
        G = cfg.n_q_heads // cfg.n_kv_heads
        scale = cfg.attn_scale if cfg.attn_scale else 1.0 / math.sqrt(cfg.head_dim)
        out = torch.empty(cfg.batch_size, cfg.n_q_heads, cfg.head_dim, dtype=torch.float64)
        for b in range(cfg.batch_size):
            for h in range(cfg.n_kv_heads):
                t = self.used_tokens(cache, layer, b, h)
                keys = self.k_post[layer, b].clone()
                if rebuilt is not None:
                    sel = self.used_tokens(cache, layer, b, h, selected_only=True)
                    keys[sel] = rebuilt[layer, b][sel]
                kk = [keys[t, h]] + [self.k[s, layer][b, h][None] for s in range(step + 1)]
                vv = [self.v[layer, b][t, h]] + [self.vn[s, layer][b, h][None] for s in range(step + 1)]
                kk, vv = torch.cat(kk), torch.cat(vv)
                for i in range(h * G, (h + 1) * G):
                    out[b, i] = attention64(self.q[step, layer][b, i], kk, vv, scale)
        return out

    def dense(self, step, layer):
        """Float64 attention over every token (prompt and generated): what sparse attention approximates."""
        cfg = self.cfg
        G = cfg.n_q_heads // cfg.n_kv_heads
        scale = cfg.attn_scale if cfg.attn_scale else 1.0 / math.sqrt(cfg.head_dim)
        out = torch.empty(cfg.batch_size, cfg.n_q_heads, cfg.head_dim, dtype=torch.float64)
        for b in range(cfg.batch_size):
            for i in range(cfg.n_q_heads):
                h = i // G
                kk = torch.cat([self.k_post[layer, b][:, h]] + [self.k[s, layer][b, h][None] for s in range(step + 1)])
                vv = torch.cat([self.v[layer, b][:, h]] + [self.vn[s, layer][b, h][None] for s in range(step + 1)])
                out[b, i] = attention64(self.q[step, layer][b, i], kk, vv, scale)
        return out


def small_config(backend, **kw):
    f = dict(n_layers=2, n_q_heads=8, n_kv_heads=2, head_dim=32, rank=24, chunk_size=4, budget=32,
             n_outlier_chunks=4, n_local_chunks=2, batch_size=2, max_prompt_len=256, gen_capacity=8,
             backend=backend, rope=dict(theta=10000.0))
    f.update(kw)
    return shadowkv.config(**f)
