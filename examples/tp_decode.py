"""Tensor-parallel decode with head-shard caches, one process per GPU, through torch.distributed.

    torchrun --standalone --nproc_per_node 2 examples/tp_decode.py            # GPUs, NCCL
    torchrun --standalone --nproc_per_node 2 examples/tp_decode.py --cpu --small   # CPU, gloo
    torchrun --standalone --nproc_per_node 2 examples/tp_decode.py --same-gpu --dist-backend gloo
                                                       # two ranks on one GPU (a one-GPU machine)

What it runs: a stack of attention layers with Llama-3-8B's shapes (hidden 4096, 32 query heads,
8 KV heads, head dim 128, 32 layers; --small: a shape for CPUs), tensor parallel the way vLLM,
SGLang and Megatron split attention:

  - rank i of s holds the query heads and KV heads of head shard i: the column slices of the
    Q, K and V projections, the row slice of the output projection, and one libshadowkv cache
    made by shadowkv.shard_config(cfg, s, i) (KV heads [i Hk/s, (i+1) Hk/s) of the model, the
    model's rank capped at the shard's width, docs/tensor-parallel.md) on its own device;
  - a decode step of a layer: RMSNorm, the rank's q, k, v, RoPE, skv_decode over the rank's
    heads, the rank's partial output projection, and an all-reduce (sum) of the partial outputs
    across ranks (NCCL on GPUs, gloo on CPUs), then the residual.

The prompts' keys and values (low rank plus noise, as attention keys are) and the weights are
drawn from --seed layer by layer on the rank's device, the same numbers on every rank, and each
rank keeps its heads.

The check: after the distributed run, rank 0 runs the same shards in one process, on its one
device, one cache per shard, the all-reduce replaced by the shards' partial outputs summed in
rank order, each layer fed the hidden state the distributed run had there (so every cache sees
exactly the inputs its rank saw). Every rank's attention outputs must equal that run's bitwise
at every step and layer; the hidden states after the all-reduce must equal the shards' sum
bitwise with two ranks (a sum of two floats does not depend on the order) and within 1e-6
relative with more (the collective may sum in another order). All ranks must also hold the
same hidden states. Exit status 0 iff all of it holds.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless the environment sets it).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shadowkv  # noqa: E402

SHAPES = {
    # hidden, query heads, KV heads, head dim, layers, context, batch, steps
    "llama3-8b": dict(hidden=4096, hq=32, hk=8, d=128, layers=32, ctx=16384, batch=4, steps=16),
    "small": dict(hidden=512, hq=8, hk=4, d=64, layers=4, ctx=2048, batch=2, steps=8),
}


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="cpu backend and gloo (default: cuda and NCCL)")
    p.add_argument("--small", action="store_true", help="a small shape (CPU-sized) instead of Llama-3-8B's")
    for k in ("layers", "ctx", "batch", "steps"):
        p.add_argument("--" + k, type=int, help=f"override the shape's {k}")
    p.add_argument("--dist-backend", choices=("nccl", "gloo"),
                   help="the collective's backend (default: nccl on GPUs, gloo with --cpu)")
    p.add_argument("--same-gpu", action="store_true",
                   help="every rank on GPU 0 (a one-GPU machine; NCCL refuses two ranks on one GPU: use gloo)")
    p.add_argument("--seed", type=int, default=31)
    p.add_argument("--no-check", action="store_true", help="skip the single-process run")
    a = p.parse_args()
    a.shape = dict(SHAPES["small" if a.small else "llama3-8b"])
    for k in ("layers", "ctx", "batch", "steps"):
        if getattr(a, k) is not None:
            a.shape[k] = getattr(a, k)
    return a


class Model:
    """The whole model's weights (float32) and prompts, drawn per layer from the seed on the device
    that asks (the same numbers in every process on the same kind of device), so a rank never
    holds more than one layer of the whole model at a time."""

    def __init__(self, sh: dict, seed: int):
        self.sh, self.seed = sh, seed

    def _gen(self, layer: int, what: int, dev) -> torch.Generator:
        return torch.Generator(device=dev).manual_seed(self.seed * 1000003 + layer * 16 + what)

    def weights(self, layer: int, dev) -> dict:
        sh = self.sh
        H, hq, hk, d = sh["hidden"], sh["hq"], sh["hk"], sh["d"]
        g = self._gen(layer, 0, dev)

        def w(*shape, scale=1.0):
            return torch.randn(*shape, generator=g, device=dev) * scale

        return dict(wq=w(H, hq * d, scale=H ** -0.5), wk=w(H, hk * d, scale=H ** -0.5),
                    wv=w(H, hk * d, scale=H ** -0.5), wo=w(hq * d, H, scale=(hq * d) ** -0.5 * 0.5),
                    norm=1.0 + 0.1 * w(H))

    def prompt(self, layer: int, dev) -> tuple:
        """Pre-RoPE keys [B, T, Hk, D] of rank 32 (a latent smooth in position) plus noise, and values."""
        sh = self.sh
        B, T, hk, d, latent = sh["batch"], sh["ctx"], sh["hk"], sh["d"], 32
        g = self._gen(layer, 1, dev)

        def w(*shape, scale=1.0):
            return torch.randn(*shape, generator=g, device=dev) * scale

        z = torch.cumsum(w(B, T, latent, scale=0.2), dim=1) / (T ** 0.5) + w(B, T, latent)
        k = z @ w(latent, hk * d, scale=latent ** -0.5) + 0.05 * w(B, T, hk * d)
        return k.view(B, T, hk, d), w(B, T, hk, d)

    def x0(self, dev) -> torch.Tensor:
        return torch.randn(self.sh["batch"], self.sh["hidden"], generator=self._gen(0, 2, dev), device=dev)


class Shard:
    """Rank `i` of `s`: its slices of the weights and its head-shard cache on `dev`."""

    def __init__(self, m: Model, sh: dict, cfg, s: int, i: int, dev: torch.device):
        self.cfg = shadowkv.shard_config(cfg, s, i)
        heads = shadowkv.shard_heads(self.cfg)
        d = sh["d"]
        q = slice(heads["q"].start * d, heads["q"].stop * d)
        kv = slice(heads["kv"].start * d, heads["kv"].stop * d)
        self.wq, self.wk, self.wv, self.wo, self.norm = [], [], [], [], []
        self.hq, self.hk, self.d = self.cfg.n_q_heads, self.cfg.n_kv_heads, d
        self.cache = shadowkv.Cache(self.cfg)
        for layer in range(sh["layers"]):
            w = m.weights(layer, dev)
            self.wq.append(w["wq"][:, q].contiguous())
            self.wk.append(w["wk"][:, kv].contiguous())
            self.wv.append(w["wv"][:, kv].contiguous())
            self.wo.append(w["wo"][q, :].contiguous())
            self.norm.append(w["norm"])
            k_pre, v = m.prompt(layer, dev)
            for b in range(sh["batch"]):
                self.cache.prefill(layer, b, k_pre[b, :, heads["kv"]].to(torch.bfloat16).contiguous(),
                                   v[b, :, heads["kv"]].to(torch.bfloat16).contiguous())
            del w, k_pre, v

    def attend(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The rank's attention of `layer` at the step: its output [B, Hq/s, D] (float32) and its
        partial output projection [B, hidden]."""
        B = x.shape[0]
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.norm[layer]
        q = rope((h @ self.wq[layer]).view(B, self.hq, self.d), cos, sin)
        k = rope((h @ self.wk[layer]).view(B, self.hk, self.d), cos, sin)
        v = (h @ self.wv[layer]).view(B, self.hk, self.d)
        out = self.cache.decode(layer, q.to(torch.bfloat16).contiguous(), k.to(torch.bfloat16).contiguous(),
                                v.to(torch.bfloat16).contiguous())
        return out, out.reshape(B, -1) @ self.wo[layer]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the cache's (half-split pairs, theta of the config) at one position."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_at(pos: int, d: int, theta: float, dev) -> tuple:
    inv = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2.0 / d)
    ang = pos * inv
    return ang.cos().float().to(dev), ang.sin().float().to(dev)


def base_config(sh: dict, backend: str):
    fields = shadowkv.scaled_config(sh["hk"], sh["d"], sh["ctx"], rescore=False)
    return shadowkv.config(backend=backend, n_layers=sh["layers"], n_q_heads=sh["hq"], n_kv_heads=sh["hk"],
                           head_dim=sh["d"], batch_size=sh["batch"], max_prompt_len=sh["ctx"],
                           gen_capacity=sh["steps"], **fields)


def run(shards: list, sh: dict, x0: torch.Tensor, reduce, feed=None, log=None):
    """Decodes sh["steps"] steps. reduce(list of the shards' partial outputs) -> their sum over all
    ranks. feed: None, or the hidden state entering each (step, layer) of another run, used in
    place of this run's own (a replay that sees exactly that run's inputs). Returns the attention
    outputs [step][layer][shard], the hidden states entering and leaving each (step, layer), and
    the host's seconds in reduce."""
    x = x0.clone()
    outs, x_in, x_out = [], [], []
    theta = shards[0].cfg.rope.theta
    t_red = 0.0
    for t in range(sh["steps"]):
        t0 = time.perf_counter()
        cos, sin = rope_at(sh["ctx"] + t, sh["d"], theta, x.device)
        step = []
        for layer in range(sh["layers"]):
            if feed is not None:
                x = feed[t * sh["layers"] + layer]
            x_in.append(x)
            parts = [s.attend(layer, x, cos, sin) for s in shards]
            step.append([o for o, _ in parts])
            r0 = time.perf_counter()
            x = x + reduce([p for _, p in parts])
            t_red += time.perf_counter() - r0
            x_out.append(x)
        outs.append(step)
        if log and (t == 0 or t + 1 == sh["steps"]):
            log(f"step {t + 1}/{sh['steps']}: {1e3 * (time.perf_counter() - t0):.1f} ms")
    return outs, torch.stack(x_in), torch.stack(x_out), t_red


def main() -> int:
    a = parse()
    sh = a.shape
    on_gpu = not a.cpu
    dist.init_process_group(a.dist_backend or ("nccl" if on_gpu else "gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()
    if on_gpu:
        torch.cuda.set_device(0 if a.same_gpu else int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

    def log(msg):
        print(f"[rank {rank}/{world}] {msg}", flush=True)

    if sh["hk"] % world or sh["hq"] % world:
        log(f"{world} ranks do not divide {sh['hk']} KV heads and {sh['hq']} query heads")
        return 2
    cfg = base_config(sh, "cpu" if a.cpu else "cuda")
    t0 = time.perf_counter()
    m = Model(sh, a.seed)
    mine = Shard(m, sh, cfg, world, rank, dev)
    if on_gpu:
        torch.cuda.synchronize()
    log(f"shard {rank}: KV heads {shadowkv.shard_heads(mine.cfg)['kv']}, rank {mine.cfg.rank}, "
        f"{sh['layers']} layers x {sh['batch']} sequences of {sh['ctx']} tokens prefilled in "
        f"{time.perf_counter() - t0:.1f} s on {dev}")

    def all_reduce(parts):
        y = parts[0]
        dist.all_reduce(y)
        return y

    dist.barrier()
    t0 = time.perf_counter()
    outs, x_in, x_out, t_red = run([mine], sh, m.x0(dev), all_reduce, log=log)
    if on_gpu:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    log(f"{sh['steps']} steps in {wall:.2f} s ({sh['batch'] * sh['steps'] / wall:.1f} tok/s for the batch; "
        f"all-reduce calls {1e3 * t_red / sh['steps']:.2f} ms per step as the host saw them)")

    # every rank's attention outputs and hidden states to rank 0
    mine_att = torch.stack([torch.stack(step) for step in [[o[0] for o in st] for st in outs]])  # [steps, L, B, Hq/s, D]
    gathered = [torch.empty_like(mine_att) for _ in range(world)]
    dist.all_gather(gathered, mine_att)
    xs = [torch.empty_like(x_out) for _ in range(world)]
    dist.all_gather(xs, x_out)
    ok = True
    if rank == 0:
        same_x = all(torch.equal(xs[0], y) for y in xs)
        log(f"hidden states equal on every rank at every step and layer: {same_x}")
        ok &= same_x
    if rank == 0 and not a.no_check:
        mine.cache.close()  # rank 0's device now holds the single-process run's caches
        t0 = time.perf_counter()
        ref_shards = [Shard(m, sh, cfg, world, i, dev) for i in range(world)]

        def local_sum(parts):
            y = parts[0]
            for p in parts[1:]:
                y = y + p
            return y

        # fed the distributed run's hidden states: every cache sees exactly what its rank saw
        ref_outs, _, ref_x_out, _ = run(ref_shards, sh, m.x0(dev), local_sum, feed=x_in)
        log(f"single-process run of the {world} shards on {dev}: {time.perf_counter() - t0:.1f} s")
        bad = [(t, layer, i) for t in range(sh["steps"]) for layer in range(sh["layers"]) for i in range(world)
               if not torch.equal(gathered[i][t, layer], ref_outs[t][layer][i])]
        att_ok = not bad
        log(f"attention outputs of every rank, step and layer bitwise equal to the single-process run's: {att_ok}"
            + ("" if att_ok else f" ({len(bad)} differ, the first at (step, layer, rank) {bad[0]})"))
        rel = ((ref_x_out - x_out).norm() / ref_x_out.norm()).item()
        if world <= 2:
            x_ok = torch.equal(ref_x_out, x_out)
            log(f"hidden states after the all-reduce bitwise equal to the shards' sum: {x_ok} (rel. diff {rel:.2e})")
        else:
            x_ok = rel <= 1e-6
            log(f"hidden states after the all-reduce within {rel:.2e} relative of the shards' sum in rank order "
                f"(bar 1e-6: with more than 2 ranks the collective may sum in another order)")
        ok &= att_ok and x_ok
        log("PASS" if ok else "FAIL")
    flag = torch.tensor([1 if ok else 0], device=dev)
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return 0 if flag.item() else 1


if __name__ == "__main__":
    sys.exit(main())
