"""End-to-end decode throughput at the largest batch, dense against libshadowkv (issue 15 benchmark).

A plain torch module with Llama-3-8B's shapes (32 layers, hidden 4096, MLP 14336, 32/8 heads,
head_dim 128, vocab 128256), random bf16 weights, every projection and MLP a cuBLAS GEMM as in the
real model (or, with --tp N, one rank's shard of it: "Tensor parallelism" below). Two caches, one
GPU, one run:

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

How a decode step is driven (--graphs, the same for both caches):

  A step is L + 1 segments with the L attention calls between them (class Stepper). Segment 0 is
  the embedding and layer 0's pre-attention part; segment i (1..L-1) is layer i-1's
  post-attention part and layer i's pre-attention part; segment L is layer L-1's post-attention
  part, the final norm, the LM head and the argmax into the token buffer. Pre-attention:
  RMSNorm, the QKV projection, RoPE of q and k at the step's position, q/k/v written into static
  buffers (dense also writes k and v into its static cache's slot for the position, an
  index_copy_ with the position as a device tensor). Post-attention: the O projection from the
  static attention output, the residual, RMSNorm, the MLP, the residual, into the static
  hidden-state buffer. Cutting post(l) and pre(l+1) into one segment gives the same cut points as
  separate per-layer pre and post graphs (the attention calls), with half the graph launches.

  piecewise (default): each segment is a torch CUDA graph (torch.cuda.graph, one memory pool
  shared by the L + 1 graphs, replayed in capture order); the attention runs eagerly between the
  replays on the same stream (torch's current stream, which is the skv cache's stream):
    skv    Cache.decode(l, q, k, v, out) on the static buffers: one library call that enqueues
           the layer's step (the library's own per-layer CUDA graph, one launch) with no host
           sync. It cannot go into the torch graphs: a captured skv_decode is one step whose
           graph must be launched exactly once (shadowkv.h), and the library keeps per-step
           state on the host. The library captures its per-layer graph on the first skv_decode
           of each layer: the eager steps (warm-up and the eager timing below) run before any
           torch capture, and skv_decode is never called while a torch capture is active.
    dense  F.scaled_dot_product_attention over the cache's first n + 1 positions and a copy
           into the static output (two ops). The kv length grows each step, so the flash call
           is not captured: capturing it at a fixed maximum length needs a mask (no flash
           kernel, and attention over the whole capacity), and a graph per length is one
           capture per step. Eager attention is also what skv gets, so the comparison is fair.
  The position is a device tensor (filled before the replays, one tiny kernel per step); RoPE
  reads its cos/sin rows with a device-side gather, and the dense cache's slot is an index_copy_
  at that tensor, so the graphs stay valid at every step. Before capturing, the segments are
  run once eagerly on the capture stream (cuBLAS workspaces, lazy initialization); nothing in a
  segment syncs with the host or allocates outside the graphs' pool.
  Every run first times --steps eager steps (the same segments, called eagerly), then captures
  and times --steps graph steps: each run records step_ms_eager and step_ms_graphs (and the
  JSON's graphs_compare the two for dense and the largest skv batch), measured in one run; the
  headline numbers (step_ms, tok_s, ratio) are the graph steps'. dense also checks the graph
  step against the eager step from the same state (graph_check). The capture time is recorded
  (graph_capture_s) and not counted in the e2e decode time: a server captures once per batch size.
  none: every segment eagerly (the previous benchmark's ~40 torch ops per layer, launch-bound
  from Python on skv).

  Each run takes 2 * (steps + warmup) decode tokens whatever the mode (skv's gen_capacity and
  dense's cache length are sized for that), so the memory accounting is the same in both modes;
  under torchrun (--tp) 3 * (steps + warmup) + 4 (the timing without collectives, the check step).

Tensor parallelism (--tp N, default 1; issue 31; bench/tp_model.py has the details):

  The model is one rank's shard of Megatron-style TP N: the QKV projection column-parallel (the
  rank's Hq/N query heads and Hk/N KV heads), the O projection row-parallel (input Hq D/N), MLP
  gate and up column-parallel and down row-parallel (intermediate 14336/N), embedding and LM head
  vocab-parallel (128256/N rows). Every rank draws the whole model's weights and keeps its slices,
  so TP N's shards are TP 1's model cut up. Each cache holds the rank's heads only: dense a
  [B, Hk/N, T, D] cache per layer, skv a head-shard cache (shadowkv.shard_config(cfg, N, rank):
  the model's rank capped at the shard's width; cuda_device the rank's GPU), prefilled from the
  rank's heads of the same generated keys and values as TP 1's.

  torchrun --nproc_per_node N (world size N): rank r runs on cuda:LOCAL_RANK (NCCL; gloo with
  --cpu). The row-parallel outputs are summed by torch.distributed.all_reduce inside the segments
  (2 per layer, after the O projection and after the MLP's down projection, and 1 after the
  vocab-parallel embedding, where a token's row lives on one rank), and the LM head's argmax
  all-gathers each rank's (largest logit, token id) pair and takes the largest (the first on
  ties). With piecewise graphs the collectives are captured in the segments' graphs (NCCL
  collectives can be captured; every rank captures and replays the same graphs in the same
  order); a second graph set, the same segments with every collective replaced by nothing (the
  comm flag of Stepper.segment), is captured into the same pool and timed in the same run, before
  the set with them. Each run records step_ms_nocomm, allreduce_ms_per_step (the difference) and
  allreduce_share (of the step), allreduces_per_step (2 L + 1), allreduce_bytes_per_step ((2 L +
  1) B hidden 2; layer_allreduce_bytes_per_step the layers' 2 L B hidden 2 alone) and
  allgather_bytes_per_step. Without graphs the eager steps are timed both ways. A time is the
  slowest rank's (the max of the ranks' medians); tokens/s of TP N is the batch over that step
  time (the ranks step in lock step on the same batch). Each rank sizes its largest batch from its
  own memory (its weights and heads) and the group takes the least (an all-reduce MIN); the host
  memory skv may pin is split between the ranks of a host (--host-gib is per rank). After each
  run one eager step with the collectives checks the ranks against each other (tp_check): the
  final hidden states equal on every rank (the all-reduce hands every rank the same sums), the
  tokens equal, and each token the argmax of the whole vocab's logits gathered from the ranks;
  --smoke fails if not. Only rank 0 prints and writes the JSON.

  One process with --tp N > 1: rank 0's shard alone, every collective skipped (its output is the
  rank's partial result, so the numbers are not a model's but what one GPU of TP N computes per
  step, without communication: what a one-GPU machine can measure). The JSON says
  "allreduce": "none (one rank's compute alone)"; the all-reduce fields are null.
  SKV_TP_COLLECTIVES=1 under torchrun with one process and --tp 1 runs every collective anyway,
  over a group of one (NCCL on the GPU): the captured-collective path checked on one GPU.

  The JSON's tp, world_size, allreduce and shard (the rank's q_heads, kv_heads, mlp, vocab) say
  which. TP N's tokens are not TP 1's bit for bit (the sums differ); nothing here compares them.

    python3 bench/e2e_throughput.py --json out.json [--ctx 131072] [--steps 32] [--e2e] [--graphs none]
    python3 bench/e2e_throughput.py --smoke        # 2 layers, 8k context, batch 2 and 1, seconds
    python3 bench/e2e_throughput.py --smoke --cpu  # the same on the CPU (cpu backend, tiny widths, no graphs)
    torchrun --nproc_per_node 8 bench/e2e_throughput.py --tp 8 --json out.json   # TP 8 on 8 GPUs
    python3 bench/e2e_throughput.py --tp 8 --json out.json  # one GPU's compute of TP 8, no communication
    torchrun --standalone --nproc_per_node 2 bench/e2e_throughput.py --smoke --cpu --tp 2  # gloo, the ranks checked
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))  # a source checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tp_model beside this file
import shadowkv  # noqa: E402
import tp_model  # noqa: E402

L, HID, MLP, HQ, HK, D, VOCAB = 32, 4096, 14336, 32, 8, 128, 128256
THETA = 500000.0
GIB = 1 << 30
BACKEND = "cuda"  # "cpu" with --cpu
TP = tp_model.TP()  # this process's rank of the tensor-parallel group (--tp; set by main)


def log(*a, all_ranks=False):
    if all_ranks or TP.rank == 0:
        r = f" [rank {TP.rank}]" if TP.dist else ""
        print(f"[{time.strftime('%H:%M:%S')}]{r}", *a, file=sys.stderr, flush=True)


class Model:
    """Llama-3-8B-shaped decoder with random weights (bf16, on the GPU; L layers, see main): TP's
    rank of it (bench/tp_model.py). Every rank draws the whole model's weights, one matrix at a
    time, with the same generator and keeps its slices, so the shards of TP N are those of TP 1's
    model. hq, hk, mlp, vocab: the rank's query heads, KV heads, MLP width and vocab rows."""

    def __init__(self, dev):
        g = torch.Generator(device=dev).manual_seed(1)
        self.hq, self.hk, self.mlp_w, self.vocab = HQ // TP.n, HK // TP.n, MLP // TP.n, VOCAB // TP.n
        for what, n in (("Hq", HQ), ("Hk", HK), ("the MLP width", MLP), ("the vocab", VOCAB)):
            TP.part(n, what)  # each must divide by the group's size

        def w(*shape):
            return (torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g) * 0.02)

        self.embed = TP.rows(w(VOCAB, HID), [VOCAB], "the vocab")
        self.layers = []
        for _ in range(L):
            self.layers.append(dict(
                wqkv=TP.rows(w(HQ * D + 2 * HK * D, HID), [HQ * D, HK * D, HK * D], "the heads"),
                wo=TP.cols(w(HID, HQ * D), "Hq D"), wgu=TP.rows(w(2 * MLP, HID), [MLP, MLP], "the MLP width"),
                wd=TP.cols(w(HID, MLP), "the MLP width"),
                n1=torch.ones(HID, device=dev, dtype=torch.bfloat16), n2=torch.ones(HID, device=dev,
                                                                                    dtype=torch.bfloat16)))
        self.norm = torch.ones(HID, device=dev, dtype=torch.bfloat16)
        self.head = TP.rows(w(VOCAB, HID), [VOCAB], "the vocab")
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

    def mlp(self, p, x, comm=True):
        gu = self.rms(x, p["n2"]) @ p["wgu"].T
        g, u = gu.split(self.mlp_w, -1)
        return x + TP.all_reduce((F.silu(g) * u) @ p["wd"].T, comm)  # row-parallel: summed over the ranks

    def o_proj(self, p, a, comm=True):
        """The O projection of the attention output a [..., hq D] (bf16), summed over the ranks."""
        return TP.all_reduce(a @ p["wo"].T, comm)

    def logits(self, x):
        """The rank's logits [B, vocab] of the final hidden states x [B, HID]."""
        return self.rms(x, self.norm) @ self.head.T

    def qkv(self, p, x):
        h = self.rms(x, p["n1"]) @ p["wqkv"].T
        q, k, v = h.split([self.hq * D, self.hk * D, self.hk * D], -1)
        return q, k, v

    def prefill(self, tokens, on_layer):
        """The model's own prefill of one sequence (flash causal attention, layer by layer);
        on_layer(l, k_pre, k_post, v) sees each layer's keys ([T, Hk, D] bf16) and values."""
        T = tokens.shape[0]
        pos = torch.arange(T, device=tokens.device)
        x = TP.embed(self.embed, tokens)
        for l, p in enumerate(self.layers):
            q, k, v = self.qkv(p, x)
            k_pre = k.view(T, self.hk, D)
            qr, kr = self.rope(q.view(T, self.hq, D), pos), self.rope(k_pre, pos)
            vv = v.view(T, self.hk, D)
            on_layer(l, k_pre, kr, vv)
            a = F.scaled_dot_product_attention(qr.transpose(0, 1)[None], kr.transpose(0, 1)[None],
                                               vv.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
            x = x + self.o_proj(p, a[0].transpose(0, 1).reshape(T, self.hq * D))
            del q, k, v, qr, kr, vv, a
            x = self.mlp(p, x)
        return TP.argmax(self.logits(x[-1:]))



def gen_kv(T, dev, g):
    """Keys of low rank plus noise (as real pre-RoPE keys are), random values: [T, Hk, D] bf16 of
    the whole model, the rank's KV heads of them (TP N's shards of TP 1's keys)."""
    basis = torch.randn(48, HK * D, device=dev, generator=g)
    k = (torch.randn(T, 48, device=dev, generator=g) @ basis + 0.3 * torch.randn(T, HK * D, device=dev, generator=g))
    v = torch.randn(T, HK * D, device=dev, generator=g)
    h = TP.part(HK)
    k, v = k.to(torch.bfloat16).view(T, HK, D)[:, h], v.to(torch.bfloat16).view(T, HK, D)[:, h]
    return (k, v) if TP.n == 1 else (k.contiguous(), v.contiguous())



class Stepper:
    """Decode steps of `model` for a batch of B on static buffers, as L + 1 segments with the
    attention between them (see the module's docstring): eagerly, or as replays of the segments'
    CUDA graphs once capture() ran.

    attend(l, n) reads q [B, Hq, D], k, v [B, Hk, D] (bf16) and writes a [B, Hq, D] (attn_dtype)
    for layer l, the new token at position n; it runs eagerly between the segments (Hq, Hk: the
    rank's heads under --tp). kv_write(l), if given, runs inside layer l's pre-attention segment
    after q, k and v are written (dense: the cache's slot at the position tensor). tok holds the
    tokens of the step (input) and, after the step, the next ones; n is the position of the next
    step's token (host side; the segments read the device tensor pos, filled from n at the start
    of each step). A step's comm flag (--tp under torchrun) turns the segments' collectives on
    (the step of TP N) or off (the same step without communication, for the all-reduce's share);
    capture() captures a graph set for each."""

    def __init__(self, model, B, dev, attn_dtype, attend, kv_write=None, n=0):
        self.model, self.B, self.dev = model, B, dev
        self.attend, self.kv_write, self.n = attend, kv_write, n
        bf = torch.bfloat16
        self.tok = torch.zeros(B, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, dtype=torch.long, device=dev)
        hq, hk = model.hq, model.hk
        self.x = torch.zeros(B, HID, dtype=bf, device=dev)
        self.q = torch.zeros(B, hq, D, dtype=bf, device=dev)
        self.k = torch.zeros(B, hk, D, dtype=bf, device=dev)
        self.v = torch.zeros(B, hk, D, dtype=bf, device=dev)
        self.a = torch.zeros(B, hq, D, dtype=attn_dtype, device=dev)
        self.graphs = self.graphs_nocomm = None
        self.capture_s = 0.0

    def _pre(self, l):
        m, p, B, hq, hk = self.model, self.model.layers[l], self.B, self.model.hq, self.model.hk
        h = (m.rms(self.x, p["n1"]) @ p["wqkv"].T).view(B, hq + 2 * hk, D)
        qk = m.rope_tab(h[:, : hq + hk], self.pos)  # q and k roped together
        self.q.copy_(qk[:, :hq])
        self.k.copy_(qk[:, hq:])
        self.v.copy_(h[:, hq + hk:])
        if self.kv_write is not None:
            self.kv_write(l)

    def _post(self, l, comm):
        m, p, B = self.model, self.model.layers[l], self.B
        x = self.x + m.o_proj(p, self.a.reshape(B, m.hq * D).to(torch.bfloat16), comm)
        self.x.copy_(m.mlp(p, x, comm))

    def segment(self, i, comm=True):
        """Segment i of the step (0..L): no host sync, no Python-side state; comm: with the collectives."""
        m = self.model
        if i == 0:
            self.x.copy_(TP.embed(m.embed, self.tok, comm))
        else:
            self._post(i - 1, comm)
        if i < L:
            self._pre(i)
        else:
            self.tok.copy_(TP.argmax(m.logits(self.x), comm))

    def step(self, graphs=False, advance=True, comm=True):
        """One decode step (enqueued on the current stream; no host sync)."""
        self.pos.fill_(self.n)
        gs = self.graphs if comm else self.graphs_nocomm
        for i in range(L + 1):
            if graphs:
                gs[i].replay()
            else:
                self.segment(i, comm)
            if i < L:
                self.attend(i, self.n)
        if advance:
            self.n += 1

    def capture(self, nocomm=None):
        """Captures the L + 1 segments (one memory pool) and, under torchrun (--tp), the L + 1
        segments without collectives (graphs_nocomm, the same pool: every segment's temporaries
        die within its capture, so any replay order is safe). Call after at least one eager step
        (the skv cache captures its own per-layer graphs on its first decode of each layer; under
        torchrun that step also ran every collective eagerly, after tp_model.init's warm-up
        all-reduce created NCCL's communicator), never with attention work outstanding
        that the segments' warm-up could disturb: the warm-up below runs every segment once (no
        attention) with the position of the next step, whose real step then rewrites everything
        it wrote; tok is restored. Every rank captures the same collectives in the same order."""
        t0 = time.time()
        cur = torch.cuda.current_stream()
        tok0 = self.tok.clone()
        self.pos.fill_(self.n)
        modes = [True, False] if (TP.dist if nocomm is None else nocomm) else [True]
        s = torch.cuda.Stream()
        s.wait_stream(cur)
        with torch.cuda.stream(s):  # warm-up on the capture stream: cuBLAS handle and workspace, lazy init
            for comm in modes:
                for i in range(L + 1):
                    self.segment(i, comm)
        cur.wait_stream(s)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        sets = []
        for comm in modes:
            gs = []
            for i in range(L + 1):
                g = torch.cuda.CUDAGraph()
                # thread_local: a CUDA call of another thread (NCCL's watchdog in torch.distributed,
                # querying events of eager collectives) does not break the capture
                with torch.cuda.graph(g, pool=pool, stream=s, capture_error_mode="thread_local"):
                    self.segment(i, comm)  # collectives issued here are captured (tp_model's docstring)
                gs.append(g)
            sets.append(gs)
        self.tok.copy_(tok0)
        torch.cuda.synchronize()
        self.graphs = sets[0]
        self.graphs_nocomm = sets[1] if len(sets) > 1 else None
        self.capture_s = time.time() - t0
        return self.capture_s

    def check(self):
        """The graph step against the eager step from the same state, at the same position (dense
        only: its step rewrites the same cache slot with the same values, where an skv step appends).
        Returns the largest difference of the final hidden state and the share of equal tokens."""
        tok0 = self.tok.clone()
        self.step(False, advance=False)
        t_e, x_e = self.tok.clone(), self.x.float()
        self.tok.copy_(tok0)
        self.step(True, advance=False)
        d = (self.x.float() - x_e).abs().max().item()
        return dict(max_abs_diff=d, max_abs=x_e.abs().max().item(),
                    tokens_equal=(self.tok == t_e).float().mean().item())

    def close(self):
        """Drops the graphs (their pool) and the attention closures (they hold the caches and,
        through the stepper, a reference cycle)."""
        self.graphs = self.graphs_nocomm = None
        self.attend = self.kv_write = None


def sync():
    if BACKEND == "cuda":
        torch.cuda.synchronize()


def sdpa_flash():
    if BACKEND != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def time_steps(fn, steps, warmup):
    """Median ms of `steps` calls of fn after `warmup` (CUDA events; the wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    sync()
    if BACKEND != "cuda":
        t = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1000.0)
        return sorted(t)[len(t) // 2]
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2]


def time_modes(st, steps, warmup, graphs, before_graphs=None, check=False):
    """Times eager steps, then (graphs) captures and times graph steps. Returns the result fields.
    Under torchrun (--tp) a time is the slowest rank's (the max over the ranks' medians), the
    headline mode's steps are also timed without the collectives (graphs: the graph set without
    them, timed before the one with them; eager: after), and one more eager step checks the ranks
    against each other (tp_check)."""
    ms_eager = TP.max_float(time_steps(lambda: st.step(False), steps, warmup))
    log(f"  eager steps: {ms_eager:.2f} ms/step (batch {st.B})")
    r = dict(graphs="piecewise" if graphs else "none", step_ms_eager=ms_eager, step_ms_graphs=None,
             graph_capture_s=None, graph_speedup=None, step_ms_nocomm=None, allreduce_ms_per_step=None,
             allreduce_share=None, tp_check=None)
    if not graphs:
        r["step_ms"] = ms_eager
        if TP.dist:
            r["step_ms_nocomm"] = TP.max_float(time_steps(lambda: st.step(False, comm=False), steps, warmup))
    else:
        if before_graphs is not None:
            before_graphs()
        r["graph_capture_s"] = st.capture()
        log(f"  captured {L + 1} segment graphs{' (and as many without collectives)' if TP.dist else ''} in "
            f"{st.capture_s:.2f} s")
        if check:
            r["graph_check"] = st.check()
            log(f"  graph step against eager step: {r['graph_check']}")
        if TP.dist:
            r["step_ms_nocomm"] = TP.max_float(time_steps(lambda: st.step(True, comm=False), steps, warmup))
        ms = TP.max_float(time_steps(lambda: st.step(True), steps, warmup))
        log(f"  graph steps: {ms:.2f} ms/step ({ms_eager / ms:.2f}x the eager step)")
        r.update(step_ms=ms, step_ms_graphs=ms, graph_speedup=ms_eager / ms)
    if TP.dist:
        d = r["step_ms"] - r["step_ms_nocomm"]
        r.update(allreduce_ms_per_step=d, allreduce_share=d / r["step_ms"])
        log(f"  without the collectives: {r['step_ms_nocomm']:.2f} ms/step; their share {100 * d / r['step_ms']:.1f}%")
        st.step(False)  # with the collectives, eagerly: every rank's state agrees again
        r["tp_check"] = TP.check(st.x, st.tok, st.model.logits(st.x))
        log(f"  ranks against each other: {r['tp_check']}")
    return r


def n_decode_tokens(steps, warmup):
    """Decode tokens a run may take: the eager timing and the graph timing (the same in both modes);
    under torchrun (--tp) also the timing without collectives and the check step."""
    return (3 * (steps + warmup) + 4) if TP.dist else (2 * (steps + warmup) + 2)


def dense_run(model, ctx, steps, warmup, batch, dev, graphs):
    n_gen = n_decode_tokens(steps, warmup)
    per_seq = 2 * L * model.hk * (ctx + n_gen) * D * 2  # the rank's KV heads
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info()[0]
        B = batch or max(1, int((free - 6 * GIB) // per_seq))
    else:
        free, B = 0, batch or 1
    B = TP.min_int(B)  # every rank of the group runs the same batch
    log(f"dense: batch {B} ({per_seq / GIB:.2f} GiB of KV per sequence, {free / GIB:.1f} GiB free)")
    T = ctx + n_gen
    K = [torch.empty(B, model.hk, T, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    V = [torch.empty(B, model.hk, T, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
    g = torch.Generator(device=dev).manual_seed(2)
    for l in range(L):
        for b in range(B):
            k, v = gen_kv(ctx, dev, g)
            K[l][b, :, :ctx] = model.rope(k, torch.arange(ctx, device=dev)).transpose(0, 1)
            V[l][b, :, :ctx] = v.transpose(0, 1)
    st = dense_stepper(model, B, dev, K, V, ctx)
    with sdpa_flash():
        res = time_modes(st, steps, warmup, graphs, check=True)
    res.update(batch=B, tok_s=B * 1000.0 / res["step_ms"], device_bytes=int(B * per_seq), **TP.comm_fields(L, B, HID))
    st.close()
    del K, V, st
    empty_cache()
    return res


def dense_stepper(model, B, dev, K, V, n):
    """A Stepper on the static cache K, V [B, Hk, T, D] per layer, the first token at position n."""
    st = Stepper(model, B, dev, torch.bfloat16, None, n=n)
    pos1 = st.pos[:1]

    def kv_write(l):  # inside the pre-attention segment: the slot of the position tensor
        K[l].index_copy_(2, pos1, st.k[:, :, None])
        V[l].index_copy_(2, pos1, st.v[:, :, None])

    def attend(l, n):  # eager: the kv length n + 1 changes every step
        o = F.scaled_dot_product_attention(st.q[:, :, None], K[l][:, :, : n + 1], V[l][:, :, : n + 1],
                                           enable_gqa=True)
        st.a.copy_(o[:, :, 0])

    st.attend, st.kv_write = attend, kv_write
    return st


def skv_stepper(model, cache, B, dev, n):
    st = Stepper(model, B, dev, torch.float32, None, n=n)

    def attend(l, n):  # eager: one library call, enqueued on the cache's stream (torch's current one)
        cache.decode(l, st.q, st.k, st.v, st.a)

    st.attend = attend
    return st


def empty_cache():
    gc.collect()
    if BACKEND == "cuda":
        torch.cuda.empty_cache()


VALUE_DTYPE = "bf16"  # the skv runs' value stores (--value-dtype; set per run by main)


def skv_config(B, ctx, gen, budget_bytes):
    """The cache's config: the whole model's, or under --tp the rank's head shard of it
    (shadowkv.shard_config: its heads, the model's rank capped at the shard's width), on torch's
    current device (the rank's)."""
    cfg = shadowkv.config(n_layers=L, n_q_heads=HQ, n_kv_heads=HK, head_dim=D, batch_size=B, max_prompt_len=ctx,
                          gen_capacity=gen, backend=BACKEND, value_device_bytes=budget_bytes,
                          rope=dict(theta=THETA), value_dtype=VALUE_DTYPE)
    if TP.n > 1:
        cfg = shadowkv.shard_config(cfg, TP.n, TP.rank)
    if BACKEND == "cuda":
        cfg.cuda_device = torch.cuda.current_device()
    return cfg


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




def skv_run(model, ctx, steps, warmup, batch, host_limit, dev, graphs):
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info()[0] - 8 * GIB  # the decode step's activations and torch's pool
    else:
        free = 1 << 50
    B, cfg, m = skv_largest(ctx, n_decode_tokens(steps, warmup), host_limit, batch, free)
    b_group = TP.min_int(B)  # every rank of the group runs the same batch: the least of the ranks' largest
    if b_group < B:
        B, cfg, m = skv_largest(ctx, n_decode_tokens(steps, warmup), host_limit, b_group, free)
    log(f"skv: batch {B}, device {m['device_bytes'] / GIB:.1f} GiB, host {m['host_bytes'] / GIB:.1f} GiB, "
        f"{m['device_value_slots']} slots with device values, {m['host_value_slots']} on the host"
        + (f" ({(free + 8 * GIB) / GIB:.1f} GiB free)" if dev.type == "cuda" else ""))
    t0 = time.time()
    cache = shadowkv.Cache(cfg)
    log(f"skv: cache created in {time.time() - t0:.1f} s")
    g = torch.Generator(device=dev).manual_seed(2)
    t0 = time.time()
    for l in range(L):
        for b in range(B):
            k, v = gen_kv(ctx, dev, g)
            cache.prefill(l, b, k, v)
        if l % 8 == 7 or l == L - 1:
            log(f"skv: prefilled {l + 1}/{L} layers ({time.time() - t0:.1f} s)")
    cache.sync()
    st = cache.stats()
    if cache.stream is not None:
        assert cache.stream.cuda_stream == torch.cuda.current_stream().cuda_stream
    stp = skv_stepper(model, cache, B, dev, ctx)
    cache.reset_stats()

    def before_graphs():
        # the eager steps ran every layer's first skv_decode (the library's own per-layer capture);
        # wait for the library's work, then the stats cover the graph steps alone
        cache.sync()
        cache.reset_stats()

    r = time_modes(stp, steps, warmup, graphs, before_graphs=before_graphs)
    cache.sync()  # also raises a deferred error of a decode step (e.g. SKV_ERR_NONFINITE)
    st2 = cache.stats()
    lookups = st2["value_cache_hits"] + st2["value_cache_misses"]
    res = dict(batch=B, value_dtype=VALUE_DTYPE, step_ms=r["step_ms"], tok_s=B * 1000.0 / r["step_ms"],
               hit_rate=st2["value_cache_hits"] / lookups if lookups else None, device_bytes=m["device_bytes"],
               host_bytes=m["host_bytes"], device_value_slots=m["device_value_slots"],
               host_value_slots=m["host_value_slots"], prefill_factorize_ms_per_call=st["prefill_factorize_ms"]
               / max(1, st["n_prefill_calls"]), value_cache_hits=st2["value_cache_hits"],
               value_cache_misses=st2["value_cache_misses"],
               kernels_per_layer_step=st2["decode_launches"] / max(1, st2["n_decode_calls"]),
               factor_rank=cfg.rank, **TP.comm_fields(L, B, HID))
    res.update({k: v for k, v in r.items() if k != "step_ms"})
    stp.close()
    cache.close()
    del stp, cache
    empty_cache()
    return res


def e2e_one(model, ctx, n_tok, dev, use_skv, graphs):
    """One sequence: the model's prefill of ctx tokens, then n_tok decode tokens (wall clock, synchronized).
    With graphs the first decode token runs eagerly (the skv cache captures its per-layer graphs on
    it), then the segments are captured (graph_capture_s, not counted in decode_s) and the other
    tokens replay them."""
    g = torch.Generator(device=dev).manual_seed(3)
    prompt = torch.randint(0, VOCAB, (ctx,), device=dev, generator=g)
    sync()
    cache = K = V = None
    if use_skv:
        cfg = skv_config(1, ctx, n_tok + 2, shadowkv._ffi.VALUES_ALL_DEVICE)
        cache = shadowkv.Cache(cfg)
        t0 = time.time()
        tok = model.prefill(prompt, lambda l, kp, kr, v: cache.prefill(l, 0, kp.contiguous(), v.contiguous(),
                                                                       kr.contiguous()))
        cache.sync()
        sync()
        t_pre = time.time() - t0
        fac = cache.stats()["prefill_factorize_ms"] / 1000.0
        st = skv_stepper(model, cache, 1, dev, ctx)
    else:
        T = ctx + n_tok + 1
        K = [torch.empty(1, model.hk, T, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
        V = [torch.empty(1, model.hk, T, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]

        def keep(l, kp, kr, v):
            K[l][0, :, :ctx] = kr.transpose(0, 1)
            V[l][0, :, :ctx] = v.transpose(0, 1)

        t0 = time.time()
        tok = model.prefill(prompt, keep)
        sync()
        t_pre, fac = time.time() - t0, 0.0
        st = dense_stepper(model, 1, dev, K, V, ctx)
    st.tok.copy_(tok)
    t1 = time.time()
    with sdpa_flash():
        for i in range(n_tok):
            if i == 1 and graphs:
                if cache is not None:
                    cache.sync()
                st.capture(nocomm=False)
            st.step(graphs and i > 0)
    sync()
    t_dec = time.time() - t1 - st.capture_s
    cap = st.capture_s if graphs else None
    st.close()
    if cache is not None:
        cache.close()
    del st, cache, K, V
    empty_cache()
    # fac: the factorization's device time as the cache's events see it; on cuda it runs on a side
    # stream beside the model's own prefill kernels, so it is not a share of the wall clock (compare
    # the prefill walls of the two runs for what the factorization adds)
    return dict(prefill_s=t_pre, decode_s=t_dec, total_s=t_pre + t_dec, factorize_event_s=fac,
                graphs="piecewise" if graphs else "none", graph_capture_s=cap)


def main():
    global L, HID, MLP, VOCAB, BACKEND, VALUE_DTYPE, TP
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dense-batch", default="0", help="0: the largest that fits; a comma list also runs smaller "
                    "batches (dense's best batch is the one of most tokens/s)")
    ap.add_argument("--value-dtype", default="bf16", help="the skv runs' value stores, a comma list of bf16, fp8: "
                    "every --skv-batch runs with each")
    ap.add_argument("--skv-batch", default="0", help="0: the largest that fits; a comma list also runs smaller "
                    "batches (values on the device as far as they fit), for the placement with the most tokens/s")
    ap.add_argument("--host-gib", type=float, default=0, help="host memory the skv cache may pin (per rank under "
                    "torchrun; 0: 80%% of RAM over the ranks on the host)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism: the model is one rank's shard of TP N "
                    "(module docstring); under torchrun --nproc_per_node N the ranks all-reduce, in one process "
                    "rank 0's shard runs alone without communication")
    ap.add_argument("--e2e", action="store_true", help="also one sequence's prefill + decode, both")
    ap.add_argument("--e2e-tokens", type=int, default=256)
    ap.add_argument("--graphs", choices=["none", "piecewise"], default="piecewise",
                    help="how decode steps are driven (module docstring): piecewise CUDA graphs between the "
                    "eager attention calls (the eager step is timed too), or every op eagerly")
    ap.add_argument("--layers", type=int, default=L, help="decoder layers (the model has 32; fewer for a quick check)")
    ap.add_argument("--smoke", action="store_true", help="a quick check of the whole script: 2 layers, 8k context "
                    "(4k with --cpu), 4 steps, dense batch 2, skv batches 2 and 1, --e2e with 8 tokens")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (the cpu backend; tiny widths, no graphs, "
                    "no --e2e unless asked): checks the script's logic where no GPU is")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.smoke:
        a.layers, a.steps, a.warmup, a.dense_batch, a.skv_batch = 2, 4, 2, "2", "2,1"
        a.ctx, a.e2e_tokens, a.host_gib = (2560 if a.cpu else 8192), 8, a.host_gib or 4
        a.e2e = a.e2e or not a.cpu
    L = a.layers
    TP, dev = tp_model.init(a.tp, a.cpu)
    if a.cpu:
        BACKEND = "cpu"
        HID, MLP, VOCAB = 256, 512, 1000  # the attention shapes stay Llama-3-8B's
        if a.graphs != "none":
            log("--cpu: no CUDA graphs, --graphs none")
            a.graphs = "none"
        name = "cpu"
    else:
        name = torch.cuda.get_device_name()
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    graphs = a.graphs == "piecewise"
    host_limit = int(a.host_gib * GIB) if a.host_gib else int(0.8 * os.sysconf("SC_PAGE_SIZE") *
                                                                os.sysconf("SC_PHYS_PAGES") / TP.local_world)
    log(f"{name}, torch {torch.__version__}, shadowkv {shadowkv.version()}, ctx {a.ctx}, {L} layers, host limit "
        f"{host_limit / GIB:.0f} GiB, graphs {a.graphs}, tp {TP.n} (world {TP.world}; all-reduce: {TP.describe()})")
    model = Model(dev)
    model.tables(a.ctx + max(n_decode_tokens(a.steps, a.warmup), a.e2e_tokens) + 8)
    sync()
    empty_cache()  # --tp: the whole matrices drawn for the rank's slices leave torch's cache, so free memory counts them
    if dev.type == "cuda":
        log(f"model: {torch.cuda.memory_allocated() / GIB:.1f} GiB of weights" +
            (f" (rank {TP.rank}'s shard of TP {TP.n})" if TP.n > 1 else ""))
    out = dict(gpu=name, date=time.strftime("%Y-%m-%d"), ctx=a.ctx, steps=a.steps, layers=L, graphs=a.graphs,
               model=f"Llama-3-8B shapes{'' if L == 32 and not a.cpu else ' (reduced)'}, random bf16 weights, "
               "plain torch module" + (f", rank 0's shard of TP {TP.n}" if TP.n > 1 else ""),
               tp=TP.n, world_size=TP.world, allreduce=TP.describe(),
               shard=dict(q_heads=model.hq, kv_heads=model.hk, mlp=model.mlp_w, vocab=model.vocab),
               tok_s_note="tokens/s of the group: the batch over the step time (all ranks step in lock step, "
               "the slowest rank's time)" if TP.dist else None)
    dense_runs = []
    for b in [int(x) for x in str(a.dense_batch).split(",")]:
        dense_runs.append(dense_run(model, a.ctx, a.steps, a.warmup, b, dev, graphs))
        log(f"dense: {dense_runs[-1]}")
    d = max(dense_runs, key=lambda r: r["batch"])  # the largest batch
    d_best = max(dense_runs, key=lambda r: r["tok_s"])
    runs = []
    for vd in a.value_dtype.split(","):
        VALUE_DTYPE = vd
        for b in [int(x) for x in a.skv_batch.split(",")]:
            runs.append(skv_run(model, a.ctx, a.steps, a.warmup, b, host_limit, dev, graphs))
            log(f"skv: {runs[-1]}")
    s = max(runs, key=lambda r: (r["batch"], r["tok_s"]))  # the largest batch (its faster dtype)
    best = max(runs, key=lambda r: r["tok_s"])
    out.update(dense_batch=d["batch"], skv_batch=s["batch"], dense_tok_s=d["tok_s"], skv_tok_s=s["tok_s"],
               ratio=s["tok_s"] / d["tok_s"], batch_ratio=s["batch"] / d["batch"], dense=d, skv=s, skv_runs=runs,
               best_skv_batch=best["batch"], best_skv_tok_s=best["tok_s"], best_ratio=best["tok_s"] / d["tok_s"])
    # the summary: each system at its best batch (most tokens/s) and skv at its largest
    out.update(dense_best_tok_s=d_best["tok_s"], dense_best_batch=d_best["batch"], dense_runs=dense_runs,
               skv_best_tok_s=best["tok_s"], skv_best_batch=best["batch"], skv_best_value_dtype=best["value_dtype"],
               skv_largest_tok_s=s["tok_s"], skv_largest_batch=s["batch"], skv_largest_value_dtype=s["value_dtype"],
               best_over_dense_best=best["tok_s"] / d_best["tok_s"], largest_over_dense_best=s["tok_s"] / d_best["tok_s"],
               rows=[dict(system="dense", batch=r["batch"], step_ms=r["step_ms"], tok_s=r["tok_s"], value_dtype="bf16",
                          device_value_stores=None, host_value_stores=None, hit_rate=None,
                          allreduce_share=r["allreduce_share"]) for r in dense_runs] +
                    [dict(system="skv", batch=r["batch"], step_ms=r["step_ms"], tok_s=r["tok_s"],
                          value_dtype=r["value_dtype"], device_value_stores=r["device_value_slots"],
                          host_value_stores=r["host_value_slots"], hit_rate=r["hit_rate"],
                          allreduce_share=r["allreduce_share"]) for r in runs])
    # the two modes of one run: eager and graph step times of dense and of the largest skv batch
    out["graphs_compare"] = {
        "dense": dict(batch=d["batch"], step_ms_eager=d["step_ms_eager"], step_ms_graphs=d["step_ms_graphs"]),
        "skv": dict(batch=s["batch"], step_ms_eager=s["step_ms_eager"], step_ms_graphs=s["step_ms_graphs"]),
        "ratio_eager": (s["batch"] / s["step_ms_eager"]) / (d["batch"] / d["step_ms_eager"]),
        "ratio_graphs": ((s["batch"] / s["step_ms_graphs"]) / (d["batch"] / d["step_ms_graphs"])
                         if graphs else None)}
    log(f"skv {s['tok_s']:.0f} tok/s (batch {s['batch']}), dense {d['tok_s']:.0f} tok/s (batch {d['batch']}): "
        f"{out['ratio']:.2f}x; best skv {best['tok_s']:.0f} tok/s (batch {best['batch']}, {best['value_dtype']}) over "
        f"dense's best {d_best['tok_s']:.0f} (batch {d_best['batch']}): {out['best_over_dense_best']:.2f}x; "
        f"eager steps {out['graphs_compare']['ratio_eager']:.2f}x")
    if a.e2e:
        out["e2e_dense"] = e2e_one(model, a.ctx, a.e2e_tokens, dev, False, graphs)
        log(f"e2e dense: {out['e2e_dense']}")
        out["e2e_skv"] = e2e_one(model, a.ctx, a.e2e_tokens, dev, True, graphs)
        log(f"e2e skv: {out['e2e_skv']}")
        out["e2e_prefill_added_s"] = out["e2e_skv"]["prefill_s"] - out["e2e_dense"]["prefill_s"]
        out["e2e_ratio"] = out["e2e_dense"]["total_s"] / out["e2e_skv"]["total_s"]
    js = json.dumps(out, indent=1)
    if TP.rank == 0:  # the ranks' numbers agree (batch, step times: the slowest rank's); rank 0 writes them
        print(js)
        if a.json:
            with open(a.json, "w") as f:
                f.write(js + "\n")
    bad = [f"{k} (batch {r['batch']}): {r['tp_check']}" for k, r in [("dense", r) for r in dense_runs] +
           [("skv", r) for r in runs] if r["tp_check"] is not None and not r["tp_check"]["ok"]]
    if bad:  # the same on every rank (the check gathers every rank's state)
        log("the ranks disagree after a step with the collectives: " + "; ".join(bad), all_ranks=True)
        if a.smoke:
            sys.exit(1)
    TP.close()
    if a.smoke:
        c = d.get("graph_check")
        if c is not None and not (c["max_abs_diff"] <= 1e-2 * max(1.0, c["max_abs"]) and c["tokens_equal"] == 1.0):
            log(f"smoke: the graph step differs from the eager step: {c}")
            sys.exit(1)
        if TP.dist:
            log(f"smoke: the {TP.world} ranks' hidden states and tokens agree, every token the argmax of the "
                "whole vocab's logits (tp_check of every run)")
        log("smoke: done")


if __name__ == "__main__":
    main()
