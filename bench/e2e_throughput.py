"""End-to-end decode throughput at the largest batch, dense against libshadowkv (issue 15 benchmark).

A plain torch module with Llama-3-8B's shapes (32 layers, hidden 4096, MLP 14336, 32/8 heads,
head_dim 128, vocab 128256), random bf16 weights, every projection and MLP a cuBLAS GEMM as in the
real model. Two caches, one GPU, one run:

  dense  a static KV cache [B, Hk, T, D] per layer and F.scaled_dot_product_attention (flash, GQA)
         at the largest batch that fits the GPU's memory;
  skv    libshadowkv through the shadowkv package (skv_decode on torch's current stream) at the
         largest batch that fits device plus host memory (skv_cache_memory_info with the device
         budget the weights leave), values placed on the device as far as they fit.

Both caches are filled by prefill from generated keys and values (context --ctx per sequence);
decode tokens/s is measured over --steps steps after --warmup (CUDA events, median of the steps).
--e2e also times one sequence's true end-to-end run: the model's own prefill of --ctx tokens
(flash attention, layer by layer) plus --e2e-tokens decode tokens, for both, with the
factorization's share of skv's prefill.

    python3 bench/e2e_throughput.py --json out.json [--ctx 131072] [--steps 32] [--e2e]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))  # a source checkout
import shadowkv  # noqa: E402

L, HID, MLP, HQ, HK, D, VOCAB = 32, 4096, 14336, 32, 8, 128, 128256
THETA = 500000.0
GIB = 1 << 30


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


class Model:
    """Llama-3-8B-shaped decoder with random weights (bf16, on the GPU)."""

    def __init__(self, dev):
        g = torch.Generator(device=dev).manual_seed(1)

        def w(*shape):
            return (torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g) * 0.02)

        self.embed = w(VOCAB, HID)
        self.layers = []
        for _ in range(L):
            self.layers.append(dict(
                wqkv=w(HQ * D + 2 * HK * D, HID), wo=w(HID, HQ * D), wgu=w(2 * MLP, HID), wd=w(HID, MLP),
                n1=torch.ones(HID, device=dev, dtype=torch.bfloat16), n2=torch.ones(HID, device=dev,
                                                                                    dtype=torch.bfloat16)))
        self.norm = torch.ones(HID, device=dev, dtype=torch.bfloat16)
        self.head = w(VOCAB, HID)
        inv = 1.0 / (THETA ** (torch.arange(0, D, 2, device=dev, dtype=torch.float64) / D))
        self.inv_freq = inv
        self.tab_len = 0

    def tables(self, n):
        """cos/sin tables [n, D] (rotate-half layout, float32), built once in double like the library's."""
        if n > self.tab_len:
            ang = torch.arange(n, device=self.inv_freq.device, dtype=torch.float64)[:, None] * self.inv_freq
            self.cos_t = torch.cat([ang.cos(), ang.cos()], -1).float()
            self.sin_t = torch.cat([ang.sin(), ang.sin()], -1).float()
            self.tab_len = n

    def rope_tab(self, x, pos):
        """RoPE of x [B, H, D] at positions pos [B] from the tables (the decode step's few kernels)."""
        c, s_ = self.cos_t[pos][:, None], self.sin_t[pos][:, None]
        xf = x.float()
        rot = torch.cat([-xf[..., D // 2:], xf[..., : D // 2]], -1)
        return (xf * c + rot * s_).to(torch.bfloat16)

    def rope(self, x, pos):
        """Rotate-half RoPE of x [..., T, H, D] at positions pos [T] or [B, 1]."""
        ang = pos.to(torch.float64)[..., None] * self.inv_freq  # [..., T, D/2]
        cos, sin = ang.cos().float()[..., None, :], ang.sin().float()[..., None, :]
        xf = x.float()
        a, b = xf[..., : D // 2], xf[..., D // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1).to(torch.bfloat16)

    @staticmethod
    def rms(x, wgt):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16) * wgt

    def mlp(self, p, x):
        gu = self.rms(x, p["n2"]) @ p["wgu"].T
        g, u = gu.split(MLP, -1)
        return x + (F.silu(g) * u) @ p["wd"].T

    def qkv(self, p, x):
        h = self.rms(x, p["n1"]) @ p["wqkv"].T
        q, k, v = h.split([HQ * D, HK * D, HK * D], -1)
        return q, k, v

    def decode_step(self, tokens, pos, attend):
        """tokens [B], pos [B] (the new token's position); attend(l, q [B,Hq,D], k, v [B,Hk,D]) -> [B,Hq,D]."""
        B = tokens.shape[0]
        x = self.embed[tokens]
        for l, p in enumerate(self.layers):
            h = (self.rms(x, p["n1"]) @ p["wqkv"].T).view(B, HQ + 2 * HK, D)
            qk = self.rope_tab(h[:, : HQ + HK], pos)  # q and k roped together
            a = attend(l, qk[:, :HQ].contiguous(), qk[:, HQ:].contiguous(), h[:, HQ + HK:].contiguous())
            x = x + a.reshape(B, HQ * D).to(torch.bfloat16) @ p["wo"].T
            x = self.mlp(p, x)
        return (self.rms(x, self.norm) @ self.head.T).argmax(-1)

    def prefill(self, tokens, on_layer):
        """The model's own prefill of one sequence (flash causal attention, layer by layer);
        on_layer(l, k_pre, k_post, v) sees each layer's keys ([T, Hk, D] bf16) and values."""
        T = tokens.shape[0]
        pos = torch.arange(T, device=tokens.device)
        x = self.embed[tokens]
        for l, p in enumerate(self.layers):
            q, k, v = self.qkv(p, x)
            k_pre = k.view(T, HK, D)
            qr, kr = self.rope(q.view(T, HQ, D), pos), self.rope(k_pre, pos)
            vv = v.view(T, HK, D)
            on_layer(l, k_pre, kr, vv)
            a = F.scaled_dot_product_attention(qr.transpose(0, 1)[None], kr.transpose(0, 1)[None],
                                               vv.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
            x = x + a[0].transpose(0, 1).reshape(T, HQ * D) @ p["wo"].T
            del q, k, v, qr, kr, vv, a
            x = self.mlp(p, x)
        return (self.rms(x[-1:], self.norm) @ self.head.T).argmax(-1)


def gen_kv(T, dev, g):
    """Keys of low rank plus noise (as real pre-RoPE keys are), random values: [T, Hk, D] bf16."""
    basis = torch.randn(48, HK * D, device=dev, generator=g)
    k = (torch.randn(T, 48, device=dev, generator=g) @ basis + 0.3 * torch.randn(T, HK * D, device=dev, generator=g))
    v = torch.randn(T, HK * D, device=dev, generator=g)
    return k.to(torch.bfloat16).view(T, HK, D), v.to(torch.bfloat16).view(T, HK, D)


def time_steps(fn, steps, warmup):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2]


def dense_run(model, ctx, steps, warmup, batch, dev):
    per_seq = 2 * L * HK * (ctx + steps + warmup + 1) * D * 2
    free = torch.cuda.mem_get_info()[0]
    B = batch or max(1, int((free - 6 * GIB) // per_seq))
    log(f"dense: batch {B} ({per_seq / GIB:.2f} GiB of KV per sequence, {free / GIB:.1f} GiB free)")
    T = ctx + steps + warmup + 1
    K = [torch.empty(B, HK, T, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    V = [torch.empty(B, HK, T, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    g = torch.Generator(device=dev).manual_seed(2)
    for l in range(L):
        for b in range(B):
            k, v = gen_kv(ctx, dev, g)
            K[l][b, :, :ctx] = model.rope(k, torch.arange(ctx, device=dev)).transpose(0, 1)
            V[l][b, :, :ctx] = v.transpose(0, 1)
    state = dict(n=ctx)

    def attend(l, q, k, v):
        n = state["n"]
        K[l][:, :, n] = k
        V[l][:, :, n] = v
        o = F.scaled_dot_product_attention(q[:, :, None], K[l][:, :, : n + 1], V[l][:, :, : n + 1], enable_gqa=True)
        return o[:, :, 0]

    tokens = torch.zeros(B, dtype=torch.long, device=dev)

    def step():
        pos = torch.full((B,), state["n"], device=dev)
        tokens.copy_(model.decode_step(tokens, pos, attend))
        state["n"] += 1

    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        ms = time_steps(step, steps, warmup)
    res = dict(batch=B, step_ms=ms, tok_s=B * 1000.0 / ms, device_bytes=int(B * per_seq))
    del K, V
    torch.cuda.empty_cache()
    return res


def skv_config(B, ctx, gen, budget_bytes):
    return shadowkv.config(n_layers=L, n_q_heads=HQ, n_kv_heads=HK, head_dim=D, batch_size=B, max_prompt_len=ctx,
                           gen_capacity=gen, backend="cuda", value_device_bytes=budget_bytes,
                           rope=dict(theta=THETA))


def skv_largest(ctx, gen, host_limit, batch, free):
    """The largest batch whose device part fits `free` and host part `host_limit`, with as many
    value slots on the device as fit (the placement that gives the most tokens/s)."""
    best = None
    for B in ([batch] if batch else range(1, 512)):
        m_all = shadowkv.memory(skv_config(B, ctx, gen, shadowkv._ffi.VALUES_ALL_DEVICE))
        if m_all["device_bytes"] <= free:
            best = (B, skv_config(B, ctx, gen, shadowkv._ffi.VALUES_ALL_DEVICE), m_all)
            continue
        mn = L * B * m_all["value_cache_bytes"]  # the least budget: every slot's chunk cache
        m_min = shadowkv.memory(skv_config(B, ctx, gen, mn))
        if m_min["device_bytes"] > free:
            break
        budget = mn + (free - m_min["device_bytes"])
        cfg = skv_config(B, ctx, gen, budget)
        m = shadowkv.memory(cfg)
        while m["device_bytes"] > free and budget > mn:
            budget = max(mn, budget - (m["device_bytes"] - free) - (64 << 20))
            cfg = skv_config(B, ctx, gen, budget)
            m = shadowkv.memory(cfg)
        if m["device_bytes"] > free or m["host_bytes"] > host_limit:
            break
        best = (B, cfg, m)
    if best is None:
        raise SystemExit("skv: not even one sequence fits")
    return best


def skv_run(model, ctx, steps, warmup, batch, host_limit, dev):
    free = torch.cuda.mem_get_info()[0] - 8 * GIB  # the decode step's activations and torch's pool
    B, cfg, m = skv_largest(ctx, steps + warmup + 2, host_limit, batch, free)
    log(f"skv: batch {B}, device {m['device_bytes'] / GIB:.1f} GiB, host {m['host_bytes'] / GIB:.1f} GiB, "
        f"{m['device_value_slots']} slots with device values, {m['host_value_slots']} on the host")
    t0 = time.time()
    cache = shadowkv.Cache(cfg)
    log(f"skv: cache created in {time.time() - t0:.1f} s")
    g = torch.Generator(device=dev).manual_seed(2)
    t0 = time.time()
    for l in range(L):
        for b in range(B):
            k, v = gen_kv(ctx, dev, g)
            cache.prefill(l, b, k, v)
        if l % 8 == 7:
            log(f"skv: prefilled {l + 1}/{L} layers ({time.time() - t0:.1f} s)")
    cache.sync()
    st = cache.stats()
    state = dict(n=ctx)
    outs = [torch.empty(B, HQ, D, device=dev, dtype=torch.float32) for _ in range(L)]

    def attend(l, q, k, v):
        return cache.decode(l, q, k, v, outs[l])

    tokens = torch.zeros(B, dtype=torch.long, device=dev)

    def step():
        pos = torch.full((B,), state["n"], device=dev)
        tokens.copy_(model.decode_step(tokens, pos, attend))
        state["n"] += 1

    cache.reset_stats()
    ms = time_steps(step, steps, warmup)
    cache.sync()
    st2 = cache.stats()
    res = dict(batch=B, step_ms=ms, tok_s=B * 1000.0 / ms, device_bytes=m["device_bytes"],
               host_bytes=m["host_bytes"], device_value_slots=m["device_value_slots"],
               host_value_slots=m["host_value_slots"], prefill_factorize_ms_per_call=st["prefill_factorize_ms"]
               / max(1, st["n_prefill_calls"]), value_cache_hits=st2["value_cache_hits"],
               value_cache_misses=st2["value_cache_misses"],
               kernels_per_layer_step=st2["decode_launches"] / max(1, st2["n_decode_calls"]))
    cache.close()
    torch.cuda.empty_cache()
    return res


def e2e_one(model, ctx, n_tok, dev, use_skv):
    """One sequence: the model's prefill of ctx tokens, then n_tok decode tokens (wall clock, synchronized)."""
    g = torch.Generator(device=dev).manual_seed(3)
    prompt = torch.randint(0, VOCAB, (ctx,), device=dev, generator=g)
    torch.cuda.synchronize()
    if use_skv:
        cfg = skv_config(1, ctx, n_tok + 2, shadowkv._ffi.VALUES_ALL_DEVICE)
        cache = shadowkv.Cache(cfg)
        t0 = time.time()
        tok = model.prefill(prompt, lambda l, kp, kr, v: cache.prefill(l, 0, kp.contiguous(), v.contiguous(),
                                                                       kr.contiguous()))
        cache.sync()
        torch.cuda.synchronize()
        t_pre = time.time() - t0
        fac = cache.stats()["prefill_factorize_ms"] / 1000.0
        outs = [torch.empty(1, HQ, D, device=dev, dtype=torch.float32) for _ in range(L)]

        def attend(l, q, k, v):
            return cache.decode(l, q, k, v, outs[l])
    else:
        T = ctx + n_tok + 1
        K = [torch.empty(1, HK, T, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
        V = [torch.empty(1, HK, T, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]

        def keep(l, kp, kr, v):
            K[l][0, :, :ctx] = kr.transpose(0, 1)
            V[l][0, :, :ctx] = v.transpose(0, 1)

        t0 = time.time()
        tok = model.prefill(prompt, keep)
        torch.cuda.synchronize()
        t_pre, fac = time.time() - t0, 0.0
        st = dict(n=ctx)

        def attend(l, q, k, v):
            n = st["n"]
            K[l][:, :, n] = k
            V[l][:, :, n] = v
            return F.scaled_dot_product_attention(q[:, :, None], K[l][:, :, : n + 1], V[l][:, :, : n + 1],
                                                  enable_gqa=True)[:, :, 0]
    from torch.nn.attention import SDPBackend, sdpa_kernel
    t1 = time.time()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        for i in range(n_tok):
            pos = torch.full((1,), ctx + i, device=dev)
            if not use_skv:
                st["n"] = ctx + i
            tok = model.decode_step(tok, pos, attend)
    torch.cuda.synchronize()
    t_dec = time.time() - t1
    if use_skv:
        cache.close()
    torch.cuda.empty_cache()
    # fac: the factorization's device time as the cache's events see it; on cuda it runs on a side
    # stream beside the model's own prefill kernels, so it is not a share of the wall clock (compare
    # the prefill walls of the two runs for what the factorization adds)
    return dict(prefill_s=t_pre, decode_s=t_dec, total_s=t_pre + t_dec, factorize_event_s=fac)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dense-batch", type=int, default=0, help="0: the largest that fits")
    ap.add_argument("--skv-batch", default="0", help="0: the largest that fits; a comma list also runs smaller "
                    "batches (values on the device as far as they fit), for the placement with the most tokens/s")
    ap.add_argument("--host-gib", type=float, default=0, help="host memory the skv cache may pin (0: 80%% of RAM)")
    ap.add_argument("--e2e", action="store_true", help="also one sequence's prefill + decode, both")
    ap.add_argument("--e2e-tokens", type=int, default=256)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    host_limit = int(a.host_gib * GIB) if a.host_gib else int(0.8 * os.sysconf("SC_PAGE_SIZE") *
                                                                os.sysconf("SC_PHYS_PAGES"))
    log(f"{torch.cuda.get_device_name()}, shadowkv {shadowkv.version()}, ctx {a.ctx}, host limit "
        f"{host_limit / GIB:.0f} GiB")
    model = Model(dev)
    model.tables(a.ctx + max(a.steps + a.warmup, a.e2e_tokens) + 8)
    torch.cuda.synchronize()
    log(f"model: {torch.cuda.memory_allocated() / GIB:.1f} GiB of weights")
    out = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), ctx=a.ctx, steps=a.steps,
               model="Llama-3-8B shapes, random bf16 weights, plain torch module")
    d = dense_run(model, a.ctx, a.steps, a.warmup, a.dense_batch, dev)
    log(f"dense: {d}")
    runs = []
    for b in [int(x) for x in a.skv_batch.split(",")]:
        runs.append(skv_run(model, a.ctx, a.steps, a.warmup, b, host_limit, dev))
        log(f"skv: {runs[-1]}")
    s = max(runs, key=lambda r: r["batch"])  # the largest batch
    best = max(runs, key=lambda r: r["tok_s"])
    out.update(dense_batch=d["batch"], skv_batch=s["batch"], dense_tok_s=d["tok_s"], skv_tok_s=s["tok_s"],
               ratio=s["tok_s"] / d["tok_s"], batch_ratio=s["batch"] / d["batch"], dense=d, skv=s, skv_runs=runs,
               best_skv_batch=best["batch"], best_skv_tok_s=best["tok_s"], best_ratio=best["tok_s"] / d["tok_s"])
    if a.e2e:
        out["e2e_dense"] = e2e_one(model, a.ctx, a.e2e_tokens, dev, False)
        log(f"e2e dense: {out['e2e_dense']}")
        out["e2e_skv"] = e2e_one(model, a.ctx, a.e2e_tokens, dev, True)
        log(f"e2e skv: {out['e2e_skv']}")
        out["e2e_prefill_added_s"] = out["e2e_skv"]["prefill_s"] - out["e2e_dense"]["prefill_s"]
        out["e2e_ratio"] = out["e2e_dense"]["total_s"] / out["e2e_skv"]["total_s"]
    js = json.dumps(out, indent=1)
    print(js)
    if a.json:
        with open(a.json, "w") as f:
            f.write(js + "\n")


if __name__ == "__main__":
    main()
