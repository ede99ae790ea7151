"""Tensor parallelism for bench/e2e_throughput.py (--tp N, issue 31): one rank of a Megatron-style group.

Rank r of N holds (class TP; e2e_throughput.Model takes its slices of the whole model's weights):
  QKV projection   column-parallel: the rows of query heads [r Hq/N, (r+1) Hq/N) and of KV heads
                   [r Hk/N, (r+1) Hk/N) (the head shard of shadowkv.shard_config(cfg, N, r))
  O projection     row-parallel: the input columns of the rank's query heads; output summed (all-reduce)
  MLP gate, up     column-parallel: intermediate rows [r MLP/N, (r+1) MLP/N) of each
  MLP down         row-parallel: those input columns; output summed (all-reduce)
  embedding        vocab-parallel: rows [r V/N, (r+1) V/N); a token outside them looks up zeros and
                   the all-reduce sums the one rank's row into every rank's hidden state
  LM head          vocab-parallel: the same rows; each rank's (largest logit, its token id) pair is
                   all-gathered (N x B pairs of float32) and every rank takes the pair of the
                   largest value, the lowest rank on ties: the first largest id of the whole vocab,
                   which is what argmax over the gathered logits gives (ids < 2^24 are exact in
                   float32)
  norms            replicated

Per decode step that is 2 L + 1 all-reduces of [B, hidden] bf16 (2 per layer, 1 after the
embedding) and one all-gather of 2 N B float32. With the collectives the hidden state is the same
on every rank after every all-reduce (the all-reduce hands every rank the same sums), so every
rank computes the same tokens.

Collectives run only where torch.distributed is initialized with world size N (torchrun
--nproc_per_node N: NCCL on GPUs, rank r on cuda:LOCAL_RANK; gloo on the CPU) and the step's
`comm` flag is on; otherwise (one process with --tp N: rank 0's shard alone, or the no-collective
timing graphs) each is skipped and its output is the rank's partial result.

CUDA graphs and NCCL (NCCL's "Using NCCL with CUDA Graphs"; torch's ProcessGroupNCCL): a
collective issued while a stream captures is captured into the graph (torch issues it on the
capture stream or on its NCCL stream joined to the capture by events; it does not hand captured
work to its watchdog); the communicator must exist before the capture (init() runs one
all-reduce); capturing an operation and launching the graph are collective: every rank must
capture the same collectives in the same order and replay the same graphs in the same order, which
the Stepper does (every rank runs the same code with the same L, B and flags). Captured and eager
collectives on the one communicator may alternate.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


class TP:
    """Rank `rank` of a tensor-parallel group of n; dist: the collectives run (world size n)."""

    def __init__(self, n=1, rank=0, world=1, dev=None, backend=None, collectives=None):
        self.n, self.rank, self.world, self.dev, self.backend = n, rank, world, dev, backend
        self.dist = world > 1 if collectives is None else collectives
        self.local_world = 1  # the ranks on this host (they share its memory)

    def describe(self):
        """The JSON's "allreduce": how row-parallel outputs are summed."""
        if self.dist:
            return f"torch.distributed {self.backend} over {self.world} ranks"
        return "none (tp 1)" if self.n == 1 else "none (one rank's compute alone)"

    # --- the rank's slices of the whole model's weights ------------------------------------------
    def part(self, size, what="a dimension"):
        if size % self.n:
            raise SystemExit(f"--tp {self.n}: {what} of {size} does not divide into {self.n} shards")
        k = size // self.n
        return slice(self.rank * k, (self.rank + 1) * k)

    def rows(self, w, sizes, what):
        """Column-parallel: the rank's rows of each block of w (blocks of `sizes` rows, e.g. q, k, v)."""
        if self.n == 1:
            return w
        return torch.cat([blk[self.part(blk.shape[0], what)] for blk in w.split(sizes)]).contiguous()

    def cols(self, w, what):
        """Row-parallel: the rank's input columns of w."""
        return w if self.n == 1 else w[:, self.part(w.shape[1], what)].contiguous()

    # --- collectives of the step (comm False: skipped) -------------------------------------------
    def all_reduce(self, x, comm=True):
        """Sums x over the ranks in place (the row-parallel outputs)."""
        if self.dist and comm:
            dist.all_reduce(x)
        return x

    def embed(self, table, tok, comm=True):
        """Vocab-parallel lookup: table [V/N, hidden] is the rank's rows, tok any token ids."""
        if self.n == 1:
            return table[tok]
        v = table.shape[0]
        loc = tok - self.rank * v
        mine = (loc >= 0) & (loc < v)
        e = table[loc.clamp(0, v - 1)].masked_fill(~mine[..., None], 0)
        return self.all_reduce(e, comm)

    def argmax(self, logits, comm=True):
        """The token ids [B] of the largest logit over the whole vocab; logits [B, V/N] are the rank's."""
        i = logits.argmax(-1)
        if self.n == 1:
            return i
        g = i + self.rank * logits.shape[-1]
        if not (self.dist and comm):
            return g
        pair = torch.stack([logits.gather(-1, i[:, None])[:, 0].float(), g.float()])  # [2, B]
        out = torch.empty(self.n * 2, pair.shape[1], dtype=torch.float32, device=pair.device)
        dist.all_gather_into_tensor(out, pair)
        out = out.view(self.n, 2, -1)
        r = out[:, 0].argmax(0)  # the first rank with the largest value
        return out[:, 1].gather(0, r[None])[0].long()

    def comm_fields(self, L, B, hidden):
        """The run's group and what one decode step communicates (null without collectives)."""
        if not self.dist:
            return dict(tp=self.n, world_size=self.world, allreduces_per_step=None, allreduce_bytes_per_step=None,
                        layer_allreduce_bytes_per_step=None, allgather_bytes_per_step=None)
        return dict(tp=self.n, world_size=self.world, allreduces_per_step=2 * L + 1,
                    allreduce_bytes_per_step=(2 * L + 1) * B * hidden * 2,
                    layer_allreduce_bytes_per_step=2 * L * B * hidden * 2,
                    allgather_bytes_per_step=self.n * 2 * B * 4)

    # --- host-side agreement and checks (eager, outside any capture) -----------------------------
    def _reduce(self, v, op, dtype):
        if not self.dist:
            return v
        t = torch.tensor([v], dtype=dtype, device=self.dev)
        dist.all_reduce(t, op=op)
        return t.item()

    def min_int(self, v):
        """The smallest of the ranks' v (the batch every rank can hold)."""
        return int(self._reduce(int(v), dist.ReduceOp.MIN, torch.int64))

    def max_float(self, v):
        """The largest of the ranks' v (a step of the group takes its slowest rank's time)."""
        return None if v is None else float(self._reduce(float(v), dist.ReduceOp.MAX, torch.float64))

    def gather(self, t):
        """Every rank's t, stacked: [world, *t.shape]."""
        t = t.contiguous()
        out = torch.empty(self.world * t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t)
        return out.view(self.world, *t.shape)

    def check(self, x, tok, logits):
        """After a step with the collectives (distributed only): are the final hidden states x
        [B, hidden] and the tokens [B] the same on every rank, and is each token the largest of the
        whole vocab's logits? logits [B, V/N] are the rank's, computed eagerly from x."""
        xs = self.gather(x.float())
        toks = self.gather(tok)
        full = self.gather(logits.float())  # [world, B, V/N] -> [B, V] in vocab order
        full = full.permute(1, 0, 2).reshape(tok.shape[0], -1)
        at = full.gather(-1, toks[0][:, None])[:, 0]
        r = dict(hidden_max_diff_across_ranks=(xs - xs[0]).abs().max().item(),
                 tokens_equal_across_ranks=bool((toks == toks[0]).all().item()),
                 token_is_full_vocab_argmax=bool((at == full.max(-1).values).all().item()))
        r["ok"] = (r["hidden_max_diff_across_ranks"] == 0.0 and r["tokens_equal_across_ranks"]
                   and r["token_is_full_vocab_argmax"])
        return r

    def close(self):
        if self.dist and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def init(n, cpu):
    """(TP, device) of this process. Under torchrun (WORLD_SIZE > 1) the world must be n: gloo on
    the CPU, NCCL on cuda:LOCAL_RANK (made the current device), warmed by one all-reduce so the
    communicator exists before any memory is measured or any graph is captured. Otherwise rank 0
    of n alone, without collectives. SKV_TP_COLLECTIVES=1 under torchrun with one process (--tp 1)
    runs the collectives anyway, over a group of one: the captured NCCL path on a one-GPU machine."""
    if n < 1:
        raise SystemExit(f"--tp {n}: expected >= 1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    force = world == 1 and "RANK" in os.environ and os.environ.get("SKV_TP_COLLECTIVES") == "1"
    if world == 1 and not force:
        return TP(n, 0, 1, None), torch.device("cpu" if cpu else "cuda")
    if world != n:
        raise SystemExit(f"--tp {n} in a world of {world} processes: launch with torchrun --nproc_per_node {n}")
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if cpu:
        dev, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend)
    else:
        torch.cuda.set_device(local)
        dev, backend = torch.device("cuda", local), "nccl"
        dist.init_process_group(backend, device_id=dev)
    if dist.get_world_size() != n or dist.get_rank() != rank:
        raise SystemExit(f"torch.distributed: rank {dist.get_rank()} of {dist.get_world_size()}, expected {rank} of {n}")
    tp = TP(n, rank, world, dev, backend, collectives=True)
    tp.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    w = torch.ones(1, device=dev)
    dist.all_reduce(w)
    if w.item() != world:
        raise SystemExit(f"torch.distributed: the warm-up all-reduce gave {w.item()}, expected {world}")
    return tp, dev
