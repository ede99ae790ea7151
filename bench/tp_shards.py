#!/usr/bin/env python3
"""Head-shard caches for tensor parallelism (issue 31): which rank should each shard use?

A head-shard cache holds a contiguous range of the model's KV heads and their query heads, as one
GPU of a tensor-parallel group would: a cache whose n_kv_heads / n_q_heads are the shard's, fed the
per-head slices of the model's tensors, so its key factorization covers only the shard's heads
([n, Hk_shard*D] instead of [n, Hk*D]). For s shards this script measures, against full attention
and against the unsharded cache, two candidate ranks per shard: the whole model's rank r on every
shard (s times the factor memory in total) and r/s (the same total factor size). A rank above the
shard's width Hk_shard*D is capped at that width (an exact factorization) and the row says so.

Per setting it reports
  - fact_err: ||K - U W||_F / ||K||_F of the bf16 pre-RoPE keys, per shard and overall (overall:
    the residuals of all shards summed, over ||K||_F), U W from shadowkv.ops.factorize on the
    backend (the op the cache's prefill uses);
  - attn_err: the relative L2 error of each decode step's output [Hq, D] (the shards' query heads
    concatenated in head order) against dense softmax attention in float64 over the whole context
    (prompt plus the decode tokens so far) with the exact post-RoPE keys and values; the mean and
    max over steps and layers, and the mean over query heads of the per-head error;
  - vs_exact: the same error against the unsharded cache at rank Hk*D (full rank, row
    "unsharded-exact-keys"; its U and W are still stored as bf16). The landmarks come from the
    exact post-RoPE keys, so every setting selects the same chunks, and this separates what the
    factorization costs the attention from what the selection costs it;
  - memory: skv_seq_bytes' device bytes of one sequence, summed over the shard caches (rows), and
    (synth) per shard and in all at --mem-ctx tokens for one layer.

Seeds: synth draws everything from numpy's default_rng(--seed) (31), printed; real is the
recording itself. A setting's rank is capped at min(rank, Hk_shard*D) (U and W fit); fact_err
uses the float32 factors of ops.factorize, the cache keeps them as bf16.

Workloads:
  synth  a Llama-3-8B shape (Hq 32, Hk 8, D 128), shadowkv.scaled_config's fields for the context
         (rank 160), s = 2, 4, 8; keys from a numpy generator written here (no Python-reachable
         generator of the benchmarks exists; examples/synth.c is C): a component shared by all KV
         heads plus one per KV head, both with power-law spectra and smooth in position (so chunks
         differ), a per-channel mean offset, a few high-norm sink tokens at the start, and noise;
         values Gaussian; queries aimed at a few random context tokens' keys of their KV head plus
         noise (so attention is concentrated, as sparse attention assumes).
  real   SmolLM2-135M-Instruct activations recorded by bench/realmodel_replay.py record (prompt
         pre-/post-RoPE keys and values, teacher-forced decode q/k/v), the model-scaled defaults
         of that script (rank Hk*D/2 = 96, fixed budget), 3 shards of one KV head (rank 96, capped at
         64, and 32).
  memory skv_cache_memory's device bytes of one sequence of every layer (32) at --ctx (128k) per GPU
         of TP 1 and --splits, bf16 and fp8 values (the shard at the model's rank capped at its
         width, shadowkv.shard_config): what each sequence costs each GPU of a group

  python3 bench/tp_shards.py synth --n 16384 --steps 4 --layers 2 --extra-ranks 64,80 --json out-synth.json
  python3 bench/tp_shards.py real build/realmodel/smollm2-acts.npz --extra-ranks 48 --json out-real.json
  python3 bench/tp_shards.py merge out-synth.json out-real.json --out result.json

Needs numpy and the shadowkv package (SHADOWKV_LIBRARY pointing at a built libshadowkv.so).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:7.1f} s] {msg}", flush=True)


# -- helpers ---------------------------------------------------------------------------------------------
def bf16(x):
    import numpy as np
    import shadowkv
    return np.ascontiguousarray(shadowkv.as_bf16(np.ascontiguousarray(x, dtype=np.float32)))


def f32(x):
    import numpy as np
    import shadowkv
    return np.asarray(shadowkv.as_float32(np.asarray(x)), dtype=np.float32)


def dense64(q, k, v, scale):
    """Full attention in float64: q [Hq, D], k, v [T, Hk, D] -> [Hq, D]."""
    import numpy as np
    Hq, Hk = q.shape[0], k.shape[1]
    g = Hq // Hk
    out = np.empty(q.shape, dtype=np.float64)
    for h in range(Hq):
        kh = k[:, h // g].astype(np.float64)
        s = kh @ q[h].astype(np.float64) * scale
        s -= s.max()
        p = np.exp(s)
        p /= p.sum()
        out[h] = p @ v[:, h // g].astype(np.float64)
    return out


def fact_error(k_pre_bf, rank, backend):
    """(residual^2, ||K||^2) of the rank-r factorization of k_pre [n, Hk, D] (bf16) by ops.factorize."""
    import numpy as np
    from shadowkv import ops
    n = k_pre_bf.shape[0]
    a = np.ascontiguousarray(k_pre_bf.reshape(n, -1))
    A = f32(a).astype(np.float64)
    if rank >= A.shape[1]:
        u, w = ops.factorize(a, A.shape[1], backend=backend)
    else:
        u, w = ops.factorize(a, rank, backend=backend)
    R = A - np.asarray(u, dtype=np.float64) @ np.asarray(w, dtype=np.float64)
    return float((R * R).sum()), float((A * A).sum())


def shard_slices(Hq, Hk, s):
    gk, gq = Hk // s, Hq // s
    return [(slice(i * gk, (i + 1) * gk), slice(i * gq, (i + 1) * gq)) for i in range(s)]


def run_setting(name, data, base_cfg, fields, s, rank, backend, exact=None):
    """One setting: s shard caches (s = 1: the unsharded cache) at `rank` per shard over data's layers.
    data: dict(layers, Hq, Hk, D, scale, k_pre[l], k_post[l], v[l] (bf16 [n, Hk, D]),
    q[l][t] [Hq, D], k[l][t], v_new[l][t] [Hk, D] (bf16), ref[l][t] [Hq, D] float64)."""
    import numpy as np
    import shadowkv
    Hq, Hk, D = data["Hq"], data["Hk"], data["D"]
    L = len(data["layers"])
    steps = data["steps"]
    t0 = time.time()
    width = Hk // s * D
    r = min(rank, width)
    res2 = [0.0] * s
    nrm2 = [0.0] * s
    lres2, lnrm2 = [0.0] * L, [0.0] * L
    seq_bytes = 0
    outs = [[np.zeros((Hq, D), dtype=np.float64) for _ in range(steps)] for _ in range(L)]
    for i, (ks, qs) in enumerate(shard_slices(Hq, Hk, s)):
        f = dict(fields, rank=r)
        cfg = shadowkv.config(n_layers=L, n_q_heads=Hq // s, n_kv_heads=Hk // s, head_dim=D,
                              batch_size=1, max_prompt_len=data["n"], gen_capacity=steps,
                              backend=backend, **base_cfg, **f)
        cache = shadowkv.Cache(cfg, arrays="numpy")
        seq_bytes += cache.seq_bytes(data["n"])["device_bytes"]
        for j in range(L):
            kp = np.ascontiguousarray(data["k_pre"][j][:, ks])
            cache.prefill(j, 0, kp, np.ascontiguousarray(data["v"][j][:, ks]),
                          np.ascontiguousarray(data["k_post"][j][:, ks]))
            a, b = fact_error(kp, r, backend)
            res2[i] += a
            nrm2[i] += b
            lres2[j] += a
            lnrm2[j] += b
        for t in range(steps):
            for j in range(L):
                o = cache.decode(j, np.ascontiguousarray(data["q"][j][t][None, qs]),
                                 np.ascontiguousarray(data["k"][j][t][None, ks]),
                                 np.ascontiguousarray(data["v_new"][j][t][None, ks]))
                outs[j][t][qs] = f32(o)[0]
        cache.close()
    errs, head_errs, layer_errs = [], [], []
    for j in range(L):
        le = []
        for t in range(steps):
            ref = data["ref"][j][t]
            errs.append(float(np.linalg.norm(outs[j][t] - ref) / np.linalg.norm(ref)))
            le.append(errs[-1])
            head_errs.append(float(np.mean(np.linalg.norm(outs[j][t] - ref, axis=1) /
                                           np.linalg.norm(ref, axis=1))))
        layer_errs.append(float(np.mean(le)))
    vs_exact = None
    if exact is not None:
        vs_exact = [float(np.linalg.norm(outs[j][t] - exact[j][t]) / np.linalg.norm(exact[j][t]))
                    for j in range(L) for t in range(steps)]
    row = dict(setting=name, shards=s, kv_heads_per_shard=Hk // s, q_heads_per_shard=Hq // s,
               rank_requested=rank, rank=r, rank_capped=r < rank, factor_width=width,
               total_factor_rank=s * r, seq_device_bytes_all_shards=seq_bytes,
               fact_err=math.sqrt(sum(res2) / sum(nrm2)),
               fact_err_per_shard=[math.sqrt(a / b) for a, b in zip(res2, nrm2)],
               attn_err_mean=float(np.mean(errs)), attn_err_max=float(np.max(errs)),
               attn_err_head_mean=float(np.mean(head_errs)),
               fact_err_per_layer=[math.sqrt(a / b) for a, b in zip(lres2, lnrm2)],
               attn_err_per_layer=layer_errs,
               vs_exact_mean=None if vs_exact is None else float(np.mean(vs_exact)),
               vs_exact_max=None if vs_exact is None else float(np.max(vs_exact)),
               seconds=round(time.time() - t0, 2))
    log(f"{name:>24}: s {s} rank {r}{' (capped)' if r < rank else ''}  fact_err {row['fact_err']:.4f}"
        f"  attn_err mean {row['attn_err_mean']:.4f} max {row['attn_err_max']:.4f}"
        + ("" if vs_exact is None else f"  vs exact keys mean {row['vs_exact_mean']:.4f}")
        + f"  ({row['seconds']:.1f} s)")
    return row, outs


def sweep(data, base_cfg, fields, rank, splits, backend, extra=()):
    """The unsharded cache with exact keys (rank Hk*D: the same selection, no factorization error; its
    outputs are the vs_exact reference), the unsharded cache at rank, then per split s: rank r, rank
    r/s and each extra rank per shard."""
    full = data["Hk"] * data["D"]
    row, exact = run_setting("unsharded-exact-keys", data, base_cfg, fields, 1, full, backend)
    rows = [row]
    todo = [("unsharded", 1, rank)]
    for s in splits:
        todo += [(f"s{s}-rank-r", s, rank), (f"s{s}-rank-r/s", s, rank // s)]
        todo += [(f"s{s}-rank-{x}", s, x) for x in extra if x not in (rank, rank // s)]
    for name, s, r in todo:
        rows.append(run_setting(name, data, base_cfg, fields, s, r, backend, exact)[0])
    return rows


def extra_ranks(text):
    return [int(x) for x in text.split(",") if x]


# -- synthetic -------------------------------------------------------------------------------------------
def smooth_latent(rng, n, m, rho):
    """[n, m] AR(1) in position with unit variance: neighbouring tokens (a chunk) are alike."""
    import numpy as np
    e = rng.standard_normal((n, m))
    z = np.empty((n, m))
    z[0] = e[0]
    c = math.sqrt(1 - rho * rho)
    for i in range(1, n):
        z[i] = rho * z[i - 1] + c * e[i]
    return z


def synth_keys(rng, n, Hk, D, shared_dim, head_dim_latent, shared_share, noise, n_sinks, rho, decay):
    """Pre-RoPE keys [n, Hk, D] float32 (see the docstring): per-element scale about 1."""
    import numpy as np
    d = Hk * D
    spec = lambda m: np.arange(1, m + 1) ** -decay  # power-law spectrum
    sh = smooth_latent(rng, n, shared_dim, rho) * spec(shared_dim)
    Bs = rng.standard_normal((shared_dim, d)) / math.sqrt(shared_dim)
    k = math.sqrt(shared_share) * (sh @ Bs) / np.sqrt((spec(shared_dim) ** 2).mean())
    per = np.zeros((n, Hk, D))
    sp = spec(head_dim_latent)
    for h in range(Hk):
        z = smooth_latent(rng, n, head_dim_latent, rho) * sp
        B = rng.standard_normal((head_dim_latent, D)) / math.sqrt(head_dim_latent)
        per[:, h] = (z @ B) / np.sqrt((sp ** 2).mean())
    k = k.reshape(n, Hk, D) + math.sqrt(1 - shared_share) * per
    k += rng.standard_normal((1, Hk, D)) * 0.5  # mean offset per channel
    k[:n_sinks] *= 5.0  # sink tokens
    k += noise * rng.standard_normal(k.shape)
    return k.astype(np.float32)


def synth(args):
    import numpy as np
    import shadowkv
    from shadowkv import ops
    seed = args.seed
    log(f"synth: seed {seed}, n {args.n}, steps {args.steps}, layers {args.layers}, splits {args.splits}")
    rng = np.random.default_rng(seed)
    Hq, Hk, D = 32, 8, 128
    n, S = args.n, args.steps
    sf = dict(shadowkv.scaled_config(Hk, D, n))
    sf.pop("select_mode", None)
    sf.pop("select_candidates", None)  # the fixed budget: chunks ranked by their landmarks alone
    rank = args.rank or sf.pop("rank")
    sf.pop("rank", None)
    defcfg = shadowkv.config()
    rope = defcfg.rope
    scale = 1.0 / math.sqrt(D)
    cos, sin = ops.rope_tables(rope, D, n + S, arrays="numpy")

    def rope_at(x, pos0):
        return np.ascontiguousarray(ops.rope(bf16(x), pos0, cos, sin, rope, backend="ref"))

    data = dict(layers=list(range(args.layers)), Hq=Hq, Hk=Hk, D=D, n=n, steps=S, scale=scale,
                k_pre=[], k_post=[], v=[], q=[], k=[], v_new=[], ref=[])
    g = Hq // Hk
    for j in range(args.layers):
        t0 = time.time()
        kall = synth_keys(rng, n + S, Hk, D, args.shared_dim, args.head_latent, args.shared_share,
                          args.noise, args.sinks, args.rho, args.decay)
        kp = bf16(kall[:n])
        kpost = rope_at(kall[:n], 0)
        v = bf16(rng.standard_normal((n + S, Hk, D)).astype(np.float32))
        data["k_pre"].append(kp)
        data["k_post"].append(kpost)
        data["v"].append(np.ascontiguousarray(v[:n]))
        Kp, V = [f32(kpost)], [f32(v[:n])]
        qs, ks, vs, refs = [], [], [], []
        for t in range(S):
            kn = rope_at(kall[n + t:n + t + 1], n + t)[0]
            Kp.append(f32(kn)[None])
            V.append(f32(v[n + t:n + t + 1]))
            Kc = np.concatenate(Kp)
            q = np.empty((Hq, D), dtype=np.float32)
            for h in range(Hq):
                tgt = rng.integers(0, n, size=args.q_targets)
                kt = Kc[tgt, h // g]
                kt = kt / np.linalg.norm(kt, axis=1, keepdims=True)
                q[h] = args.q_gain * math.sqrt(D) * kt.mean(0) + rng.standard_normal(D)
            qb = bf16(q)
            qs.append(qb)
            ks.append(kn)
            vs.append(np.ascontiguousarray(v[n + t]))
            refs.append(dense64(f32(qb), Kc, np.concatenate(V), scale))
        data["q"].append(qs)
        data["k"].append(ks)
        data["v_new"].append(vs)
        data["ref"].append(refs)
        log(f"synth: layer {j} generated with its dense references ({time.time() - t0:.1f} s)")
    base_cfg = dict(attn_scale=scale)
    log(f"synth: sparse fields {sf}, rank {rank}")
    rows = sweep(data, base_cfg, sf, rank, [int(x) for x in args.splits.split(",")], args.backend,
                 extra_ranks(args.extra_ranks))
    mem = memory_rows(Hq, Hk, D, rank, [int(x) for x in args.splits.split(",")], args.mem_ctx, args.backend,
                      extra_ranks(args.extra_ranks))
    gen = {k: getattr(args, k) for k in ("shared_dim", "head_latent", "shared_share", "noise", "sinks", "rho", "decay",
                                         "q_targets", "q_gain")}
    return dict(workload="synth", shape=dict(n_q_heads=Hq, n_kv_heads=Hk, head_dim=D), n=n, steps=S,
                layers=args.layers, seed=seed, generator=gen, fields=dict(sf, rank=rank), rows=rows, memory=mem)


def memory_rows(Hq, Hk, D, rank, splits, n, backend, extra=()):
    """skv_seq_bytes of one n-token sequence, one layer, per shard cache and over all shards, for the
    unsharded cache and each split at ranks r, r/s and the extra ranks (scaled_config's other fields
    for n)."""
    import shadowkv
    fields = dict(shadowkv.scaled_config(Hk, D, n))
    for k in ("select_mode", "select_candidates", "rank"):
        fields.pop(k, None)
    out = []
    todo = [(1, rank)] + [(s, x) for s in splits for x in [rank, rank // s] + list(extra)]
    seen = set()
    for s, r in todo:
        r = min(r, Hk // s * D)
        if (s, r) in seen:
            continue
        seen.add((s, r))
        cfg = shadowkv.config(n_layers=1, n_q_heads=Hq // s, n_kv_heads=Hk // s, head_dim=D, batch_size=1,
                              max_prompt_len=n, gen_capacity=16, backend=backend, **dict(fields, rank=r))
        c = shadowkv.Cache(cfg)
        b = c.seq_bytes(n)["device_bytes"]
        c.close()
        out.append(dict(shards=s, rank=r, n=n, fields=fields, seq_device_bytes_per_shard=b, all_shards=s * b))
        log(f"memory at {n}: s {s} rank {r}: {b / 2**20:.1f} MiB per shard, {s * b / 2**20:.1f} MiB in all")
    return out


# -- real model ------------------------------------------------------------------------------------------
def real(args):
    import numpy as np
    sys.path.insert(0, HERE)
    import realmodel_replay as rr
    meta, z = rr.load(args.file)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else meta["layers"]
    Hq, Hk, D, n = meta["n_q_heads"], meta["n_kv_heads"], meta["head_dim"], meta["n"]
    S = min(args.steps, meta["steps"]) if args.steps else meta["steps"]
    scale = meta["attn_scale"]
    log(f"real: {os.path.basename(args.file)} ({meta['model']}), n {n}, steps {S}, layers {layers}")
    sf = rr.scaled_fields(meta)
    sf.pop("select_mode", None)
    sf.pop("select_candidates", None)  # the fixed budget, as realmodel_replay's default-fixed
    rank = args.rank or sf.pop("rank")
    sf.pop("rank", None)
    data = dict(layers=layers, Hq=Hq, Hk=Hk, D=D, n=n, steps=S, scale=scale,
                k_pre=[], k_post=[], v=[], q=[], k=[], v_new=[], ref=[])
    for li in layers:
        kp, kpost, v = (np.ascontiguousarray(z[f"{x}_{li}"]) for x in ("k_pre", "k_post", "v"))
        data["k_pre"].append(kp)
        data["k_post"].append(kpost)
        data["v"].append(v)
        sq, sk, sv = (np.ascontiguousarray(z[f"step_{x}_{li}"]) for x in ("q", "k", "v"))
        Kc, Vc = f32(kpost), f32(v)
        refs = []
        for t in range(S):
            Kc = np.concatenate([Kc, f32(sk[t])[None]])
            Vc = np.concatenate([Vc, f32(sv[t])[None]])
            refs.append(dense64(f32(sq[t]), Kc, Vc, scale))
        data["q"].append([sq[t] for t in range(S)])
        data["k"].append([sk[t] for t in range(S)])
        data["v_new"].append([sv[t] for t in range(S)])
        data["ref"].append(refs)
    base_cfg = dict(attn_scale=scale, rope=meta["rope"])
    log(f"real: sparse fields {sf}, rank {rank}")
    rows = sweep(data, base_cfg, sf, rank, [int(x) for x in args.splits.split(",")], args.backend,
                 extra_ranks(args.extra_ranks))
    return dict(workload="real", file=os.path.basename(args.file), model=meta["model"], text=meta["text"],
                shape=dict(n_q_heads=Hq, n_kv_heads=Hk, head_dim=D), n=n, steps=S, layers=layers,
                fields=dict(sf, rank=rank), rows=rows)


def memory(args):
    """skv_cache_memory's device bytes of a one-sequence cache of every layer, per GPU (one shard
    cache), for each split and value dtype: what a sequence costs each GPU of a TP group."""
    import shadowkv
    rows = []
    for vd in args.value_dtypes.split(","):
        f = shadowkv.scaled_config(8, 128, args.ctx, n_layers=args.layers, rescore=False)
        whole = shadowkv.config(backend="cpu", n_layers=args.layers, n_q_heads=32, n_kv_heads=8, head_dim=128,
                                batch_size=1, max_prompt_len=args.ctx, gen_capacity=args.gen_capacity,
                                value_dtype=vd, **f)
        for n in [1] + extra_ranks(args.splits):
            c = shadowkv.shard_config(whole, n, 0)
            b = shadowkv.memory(c)["device_bytes"]
            rows.append(dict(tp=n, value_dtype=vd, rank_per_shard=c.rank, device_bytes_per_gpu=b,
                             gib_per_gpu=round(b / 2 ** 30, 3)))
            log(f"{vd} tp {n}: rank {c.rank}, {b / 2 ** 30:.3f} GiB per GPU")
    for r in rows:
        one = next(x for x in rows if x["tp"] == 1 and x["value_dtype"] == r["value_dtype"])
        r["of_tp1"] = round(r["device_bytes_per_gpu"] / one["device_bytes_per_gpu"], 3)
    return dict(workload="memory", shape="Llama-3-8B (Hq 32, Hk 8, D 128)", ctx=args.ctx, layers=args.layers,
                gen_capacity=args.gen_capacity, rows=rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth", help="the Llama-3-8B shape, synthetic keys")
    s.add_argument("--n", type=int, default=16384, help="context tokens")
    s.add_argument("--steps", type=int, default=4)
    s.add_argument("--layers", type=int, default=1, help="independent layers (each its own keys)")
    s.add_argument("--splits", default="2,4,8")
    s.add_argument("--rank", type=int, default=0, help="0: scaled_config's (160 for this shape)")
    s.add_argument("--seed", type=int, default=31)
    s.add_argument("--shared-dim", type=int, default=96, help="latent dims shared by all KV heads")
    s.add_argument("--head-latent", type=int, default=48, help="latent dims of each KV head")
    s.add_argument("--shared-share", type=float, default=0.5, help="variance share of the shared part")
    s.add_argument("--noise", type=float, default=0.05)
    s.add_argument("--sinks", type=int, default=4)
    s.add_argument("--decay", type=float, default=1.0, help="latent j's scale: j**-decay")
    s.add_argument("--rho", type=float, default=0.9, help="AR(1) coefficient of the latents in position")
    s.add_argument("--q-targets", type=int, default=4, help="context tokens each query aims at")
    s.add_argument("--q-gain", type=float, default=2.0)
    s.add_argument("--extra-ranks", default="", help="more ranks per shard to run at every split")
    s.add_argument("--mem-ctx", type=int, default=131072, help="context of the memory rows (skv_seq_bytes)")
    s.add_argument("--backend", default="cpu")
    s.add_argument("--json", default=None)
    r = sub.add_parser("real", help="SmolLM2 activations of bench/realmodel_replay.py record")
    r.add_argument("file", nargs="?", default=os.path.join(ROOT, "build", "realmodel", "smollm2-acts.npz"))
    r.add_argument("--layers", default="", help="recorded layers to use (default: all)")
    r.add_argument("--steps", type=int, default=0, help="decode steps (default: all recorded)")
    r.add_argument("--splits", default="3")
    r.add_argument("--rank", type=int, default=0, help="0: the scaled defaults' (Hk*D/2 = 96)")
    r.add_argument("--extra-ranks", default="", help="more ranks per shard to run at every split")
    r.add_argument("--backend", default="cpu")
    r.add_argument("--json", default=None)
    y = sub.add_parser("memory", help="device bytes per GPU of one sequence, per split (skv_cache_memory)")
    y.add_argument("--ctx", type=int, default=131072)
    y.add_argument("--layers", type=int, default=32)
    y.add_argument("--gen-capacity", type=int, default=1024)
    y.add_argument("--splits", default="2,4,8")
    y.add_argument("--value-dtypes", default="bf16,fp8")
    y.add_argument("--backend", default="cpu")
    y.add_argument("--json", default=None)
    m = sub.add_parser("merge", help="merge result files into one")
    m.add_argument("files", nargs="+")
    m.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "merge":
        runs = []
        for p in args.files:
            with open(p) as f:
                runs.extend(json.load(f)["runs"])
        with open(args.out, "w") as f:
            json.dump(dict(what="head-shard caches (issue 31): rank r vs r/s per shard", runs=runs), f, indent=1)
        return
    import shadowkv
    log(f"libshadowkv {shadowkv.version()} ({shadowkv.library_path()})")
    res = synth(args) if args.cmd == "synth" else memory(args) if args.cmd == "memory" else real(args)
    res.update(machine=f"{platform.machine()} {os.cpu_count()} cpus", date=time.strftime("%Y-%m-%d", time.gmtime()),
               command="python3 bench/tp_shards.py " + " ".join(sys.argv[1:] if argv is None else argv),
               backend=args.backend, seconds=round(time.time() - T0, 1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(runs=[res]), f, indent=1)
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
