"""shadowkv.serving: libshadowkv as the decode attention and KV cache of transformers' continuous batching.

transformers' continuous batching (model.generate_batch, model.init_continuous_batching and the
ContinuousBatchingManager behind them, and `transformers serve --continuous-batching`) packs the
tokens of every running request into one forward pass and keeps their keys and values in its
PagedAttentionCache. install(model) puts libshadowkv into that loop:

    from shadowkv.serving import install
    engine = install(model, slots=8, max_prompt_len=4096, gen_capacity=512)   # before the manager starts
    outputs = model.generate_batch(inputs=[ids_a, ids_b, ...], generation_config=gen)

- Each request whose prompt the library takes (at least engine.min_prompt_len tokens, at most
  max_prompt_len, and max_new_tokens - 1 <= gen_capacity) gets a slot of one libshadowkv cache of
  `slots` sequences when transformers schedules its prompt. Prompts of fewer tokens, or more, run on
  transformers' own attention, as without the library.
- Prefill: the prompt's attention stays dense (torch's scaled_dot_product_attention over the
  request's own tokens); on the way, its post-RoPE keys and values go into the slot, with the
  pre-RoPE keys recovered by rotating back with the library's RoPE tables (as shadowkv.hf does).
  A prompt that transformers splits over several batches (chunked prefill) goes in by
  skv_prefill_piece; a prompt in one batch by skv_prefill.
- Decode: every layer's attention for the batch's decoding slots is one skv_decode_active call over
  exactly those slots (the others, prefilling or done, do not advance).
- A finished or cancelled request's slot is released (skv_seq_release) and taken by the next one.

The hooks are transformers' own extension points: the attention function is registered with
AttentionInterface under ATTN_IMPLEMENTATION, the scheduler class (a FIFO scheduler that hands the
batch's requests to the engine, admits a request to the library only while a slot is free, and
releases slots) is registered in the continuous batching's SCHEDULER_MAPPING under SCHEDULER, and
the model's init_continuous_batching is wrapped on the instance to select both and the batching
options the engine needs (no prefix sharing, no decode fast path, no asynchronous batching, no CUDA
graphs). docs/serving-engines.md ("transformers continuous batching") lists what this cannot change
in transformers' loop.

Reproducible mode (reproducible=True, the library's config.reproducible = 1): a request's greedy
tokens equal those of the same request served alone. The library's decode is per-sequence bitwise by
contract; the rest of the model is made so too: the linear layers run once per request (a request's
rows are never multiplied in one matrix product with another request's, whose row count would change
the product's kernel), and a prompt the library takes is never split over batches (a request waits
for a batch with room for its whole prompt, up to max_batch_tokens).

`python -m shadowkv.serving serve MODEL --continuous-batching [transformers serve options]
[--skv-slots N --skv-max-prompt-len N --skv-gen-capacity N --skv-reproducible --skv-backend B
--skv-pool-mb N]` runs `transformers serve` with the library installed in its model process
(docs/usage.md, "Serving").
"""
from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import sys
import threading
from typing import Any, Optional

try:
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
    from transformers import AttentionInterface, ContinuousBatchingConfig
    from transformers.generation.continuous_batching import scheduler as _cb_scheduler
    from transformers.generation.continuous_batching.requests import RequestStatus
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
except ImportError as e:
    raise ImportError(f"shadowkv.serving needs torch and transformers with continuous batching (5.25 or later), "
                      f"which are not installed: pip install 'shadowkv[serve]' ({e})") from e

# what the engine uses of transformers' continuous batching (tested with transformers 5.25)
_NEEDED = [(_cb_scheduler, "SCHEDULER_MAPPING"), (_cb_scheduler, "FIFOScheduler"),
           (_cb_scheduler.FIFOScheduler, "_process_candidates"),
           (_cb_scheduler.FIFOScheduler, "_get_waiting_candidates"),
           (_cb_scheduler.FIFOScheduler, "_cleanup_waiting_queue"), (ContinuousBatchingConfig, "scheduler_type")]
_missing = [f"{getattr(o, '__name__', o)}.{a}" for o, a in _NEEDED if not hasattr(o, a)]
if _missing:
    import transformers as _tf
    raise ImportError(f"shadowkv.serving needs transformers' continuous batching as in 5.25; transformers "
                      f"{_tf.__version__} lacks {', '.join(_missing)}")

from . import Cache, _ffi, config as _skv_config, min_prompt_len as _min_prompt_len, ops, validate
from . import version as shadowkv_version
from .hf import _head_dim, _text_config, check_model, rope_config_for, scaled_config

__all__ = ["install", "uninstall", "ServingEngine", "ShadowKVScheduler", "ATTN_IMPLEMENTATION", "SCHEDULER",
           "shadowkv_paged_attention", "main"]

ATTN_IMPLEMENTATION = "shadowkv_paged"
SCHEDULER = "shadowkv"

# one line per request at its end (info): the slot it held, or that transformers' attention served it
logger = logging.getLogger("shadowkv.serving")

# engines by id() of the text config their model's attention modules hold (module.config)
_ENGINES: dict[int, "ServingEngine"] = {}
_LOCK = threading.Lock()


def _engine_of_config(cfg) -> Optional["ServingEngine"]:
    with _LOCK:
        e = _ENGINES.get(id(cfg))
        if e is None and len(_ENGINES) == 1:
            e = next(iter(_ENGINES.values()))
        return e


class _Entry:
    """One request of the batch being computed: its slot (None: transformers' attention), the tokens
    it had before this forward (past), the tokens it brings (q) and its prompt length."""
    __slots__ = ("rid", "slot", "past", "q", "prompt")

    def __init__(self, rid: str, slot: Optional[int], past: int, q: int, prompt: int):
        self.rid, self.slot, self.past, self.q, self.prompt = rid, slot, past, q, prompt

    @property
    def decoding(self) -> bool:
        return self.slot is not None and self.past >= self.prompt


class _PerRequestLinear(TorchFunctionMode):
    """Runs every linear layer of a packed batch once per request (reproducible mode): the rows of
    one request go through the same matrix products whether it is served alone or beside others.
    sizes: the requests' query tokens in batch order; n_logits: the rows the LM head gets."""

    def __init__(self, sizes: list, n_logits: int):
        super().__init__()
        self.sizes, self.total, self.n_logits = sizes, sum(sizes), n_logits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(self.sizes) > 1:
            x = args[0]
            if x.dim() == 3 and x.shape[0] == 1:
                T = x.shape[1]
                sizes = self.sizes if T == self.total else [1] * T if T == self.n_logits else None
                if sizes is not None:
                    w = args[1] if len(args) > 1 else kwargs["weight"]
                    b = args[2] if len(args) > 2 else kwargs.get("bias")
                    return torch.cat([F.linear(p, w, b) for p in x.split(sizes, dim=1)], dim=1)
        return func(*args, **kwargs)


class ServingEngine:
    """The libshadowkv side of a model served by transformers' continuous batching (see the module
    docstring); made by install().

    Attributes: model, slots, max_prompt_len, gen_capacity, reproducible, fields (the library config
    fields), min_prompt_len (the shortest prompt the library takes), cache (the shadowkv.Cache, made at
    the first forward pass on the model's device), counters (requests_library and requests_dense: the
    requests that took a slot and those transformers' attention served; decode_calls: skv_decode_active
    calls, one per layer and step; prefill_calls: prompts prefilled in one piece; prefill_pieces: pieces
    of prompts split over batches; releases: slots released).
    """

    def __init__(self, model, slots: int = 8, max_prompt_len: int = 4096, gen_capacity: int = 512,
                 backend: str = "auto", reproducible: bool = False, n_threads: int = 0, **fields: Any):
        hf = _text_config(model)
        check_model(hf, max_prompt_len + gen_capacity)
        if slots < 1 or max_prompt_len < 1 or gen_capacity < 1:
            raise ValueError(f"slots {slots}, max_prompt_len {max_prompt_len}, gen_capacity {gen_capacity}: "
                             "each must be >= 1")
        self.model, self.hf_config = model, hf
        self.slots, self.max_prompt_len, self.gen_capacity = slots, max_prompt_len, gen_capacity
        self.reproducible = bool(reproducible)
        self.backend_request = backend
        D = _head_dim(hf)
        Hk = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        f = scaled_config(model, context_len=max_prompt_len)
        f.update(fields)
        f.setdefault("attn_scale", float(D) ** -0.5)
        self.fields = f
        self.rope = rope_config_for(hf)
        self.rotary_dim = self.rope["rotary_dim"] or D
        self.skv_config = _skv_config(n_layers=hf.num_hidden_layers, n_q_heads=hf.num_attention_heads,
                                      n_kv_heads=Hk, head_dim=D, rope=self.rope, batch_size=slots,
                                      max_prompt_len=max_prompt_len, gen_capacity=gen_capacity,
                                      reproducible=1 if self.reproducible else 0, n_threads=n_threads,
                                      backend="cpu" if backend == "auto" else backend, **f)
        validate(self.skv_config)
        self.min_prompt_len = max(_min_prompt_len(self.skv_config, layer) for layer in range(hf.num_hidden_layers))
        self.cache: Optional[Cache] = None
        self._tables = None
        self._slot_of: dict = {}  # request id -> slot
        self._prompt_of: dict = {}  # request id -> prompt length
        self._free = list(range(slots - 1, -1, -1))
        self._plan: Optional[list] = None
        self._plan_logits = 0
        self.counters = dict(requests_library=0, requests_dense=0, decode_calls=0, prefill_calls=0,
                             prefill_pieces=0, releases=0)

    # -- requests and slots (called from the scheduler, in the batching thread) ---------------------------
    def takes(self, state) -> bool:
        """Whether the library takes this request (its prompt length and max_new_tokens fit the cache)."""
        n = len(state.initial_tokens)
        new = getattr(state, "max_new_tokens", None)
        return self.min_prompt_len <= n <= self.max_prompt_len and new is not None and new - 1 <= self.gen_capacity

    @property
    def free_slots(self) -> int:
        """Slots no request holds."""
        return len(self._free)

    def _assign(self, rid: str, n: int) -> Optional[int]:
        if not self._free:
            return None
        s = self._free.pop()
        self._slot_of[rid] = s
        self._prompt_of[rid] = n
        return s

    def release(self, rid: str) -> None:
        """Frees the slot of request rid (skv_seq_release), if it holds one."""
        s = self._slot_of.pop(rid, None)
        if s is None:
            return
        n = self._prompt_of.pop(rid, 0)
        if self.cache is not None:
            try:
                self.cache.release(s)
            except Exception as e:  # a slot never prefilled (the request failed before its forward) is free
                if getattr(e, "status", None) != _ffi.ERR_SEQ_STATE:
                    raise
        self._free.append(s)
        self.counters["releases"] += 1
        logger.info("shadowkv: request %s released slot %d (prompt of %d tokens)", rid, s, n)

    def release_all(self) -> None:
        """Frees every slot."""
        for rid in list(self._slot_of):
            self.release(rid)

    def plan(self, scheduled: list) -> None:
        """The requests of the next forward pass, in batch order (FutureRequestState objects as the
        scheduler returns them, before transformers advances their positions)."""
        out = []
        for fs in scheduled:
            st = fs.state
            rid, past, q, n = st.request_id, st.position_offset, fs.query_length, len(st.initial_tokens)
            slot = self._slot_of.get(rid)
            if slot is not None and past == 0:  # a request that starts over (offloaded, then reset)
                self.release(rid)
                slot = None
            if slot is None and past == 0:
                if self.takes(st):
                    slot = self._assign(rid, n)
                self.counters["requests_library" if slot is not None else "requests_dense"] += 1
                if slot is not None:
                    logger.info("shadowkv: request %s (prompt of %d tokens) takes slot %d", rid, n, slot)
                else:
                    logger.info("shadowkv: request %s (prompt of %d tokens) runs on transformers' attention (the "
                                "library takes prompts of %d to %d tokens and max_new_tokens - 1 <= %d)", rid, n,
                                self.min_prompt_len, self.max_prompt_len, self.gen_capacity)
            out.append(_Entry(rid, slot, past, q, n))
        self._plan = out
        self._plan_logits = sum(1 for fs in scheduled if fs.has_new_token)

    # -- the forward pass ------------------------------------------------------------------------------------
    def _ensure_cache(self, device) -> None:
        if self.cache is not None:
            return
        c = _ffi.Config()
        ctypes.pointer(c)[0] = self.skv_config
        if self.backend_request == "auto":
            c.backend = _ffi.BACKENDS["cuda" if device.type == "cuda" else "cpu"]
        if c.backend == _ffi.BACKENDS["cuda"]:
            with torch.cuda.device(device):
                self.cache = Cache(c, stream=torch.cuda.current_stream(device))
        else:
            self.cache = Cache(c)
        self._tables = ops.rope_tables(self.cache.config.rope, self.cache.head_dim, self.max_prompt_len,
                                       device=self.cache.device)

    def _k_pre(self, k_post: torch.Tensor, pos0: int) -> torch.Tensor:
        """Pre-RoPE keys of post-RoPE keys k_post [q, Hk, D] at positions pos0.. (the library's rotation undone)."""
        cos, sin = self._tables
        q = k_post.shape[0]
        cos, sin = cos[pos0:pos0 + q, None, :], sin[pos0:pos0 + q, None, :]
        k = k_post.float()
        R = self.rotary_dim
        h = R // 2
        x1, x2 = k[..., :h], k[..., h:R]
        return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin, k[..., R:]], dim=-1).to(torch.bfloat16)

    @staticmethod
    def _dense(module, q, k, v, past: int, scaling, dropout: float):
        """transformers' sdpa attention of one request's q [1, Hq, n, D] over its keys k [1, Hk, past + n, D]."""
        n, kv = q.shape[2], k.shape[2]
        if n == 1 or past == 0:
            mask, causal = None, n > 1
        else:
            mask = (torch.arange(kv, device=q.device)[None, :]
                    <= past + torch.arange(n, device=q.device)[:, None])[None, None]
            causal = False
        out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling, is_causal=causal)
        return out  # [1, n, Hq, D]

    def attend(self, module, query, key, value, scaling, dropout: float, kwargs: dict):
        """The attention of one layer for the whole packed batch: query [1, Hq, T, D]; key, value
        [1, Hk, sum(past + q), D] as the PagedAttentionCache returns them (every request's past and new
        tokens, request after request). Returns [1, T, Hq, D]."""
        layer = module.layer_idx
        plan = self._plan
        T = query.shape[2]
        if plan is None or sum(e.q for e in plan) != T or sum(e.past + e.q for e in plan) != key.shape[2]:
            # a forward the scheduler did not announce (a warmup): transformers' attention per sequence
            cq = kwargs["cu_seq_lens_q"].tolist()
            ck = kwargs["cu_seq_lens_k"].tolist()
            plan = [_Entry("", None, (ck[i + 1] - ck[i]) - (cq[i + 1] - cq[i]), cq[i + 1] - cq[i], 0)
                    for i in range(len(cq) - 1) if cq[i + 1] > cq[i]]
        out = torch.empty((1, T, query.shape[1], query.shape[3]), dtype=query.dtype, device=query.device)
        rows, slots = [], []
        q0 = k0 = 0
        for e in plan:
            q1, k1 = q0 + e.q, k0 + e.past + e.q
            if e.decoding:
                rows.append((q0, k1 - 1))
                slots.append(e.slot)
            else:
                out[:, q0:q1] = self._dense(module, query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1], e.past,
                                            scaling, dropout)
                if e.slot is not None:
                    self._prefill(layer, e, key[0, :, k1 - e.q:k1].transpose(0, 1),
                                  value[0, :, k1 - e.q:k1].transpose(0, 1))
            q0, k0 = q1, k1
        if rows:
            self._ensure_cache(query.device)
            dev = self.cache.device
            qi = torch.tensor([r[0] for r in rows], device=query.device)
            ki = torch.tensor([r[1] for r in rows], device=query.device)
            q = query[0].index_select(1, qi).transpose(0, 1).to(device=dev, dtype=torch.bfloat16).contiguous()
            k = key[0].index_select(1, ki).transpose(0, 1).to(device=dev, dtype=torch.bfloat16).contiguous()
            v = value[0].index_select(1, ki).transpose(0, 1).to(device=dev, dtype=torch.bfloat16).contiguous()
            o = self.cache.decode_active(layer, slots, q, k, v)  # [n, Hq, D] float32
            out[0].index_copy_(0, qi, o.to(device=query.device, dtype=query.dtype))
            self.counters["decode_calls"] += 1
        return out

    def _prefill(self, layer: int, e: _Entry, k_post, v) -> None:
        """The prompt tokens [past, past + q) of (layer, slot): the whole prompt by skv_prefill, a piece by
        skv_prefill_piece. k_post, v: [q, Hk, D]."""
        self._ensure_cache(k_post.device)
        dev = self.cache.device
        kp = k_post.to(device=dev, dtype=torch.bfloat16).contiguous()
        kr = self._k_pre(kp, e.past).contiguous()
        vv = v.to(device=dev, dtype=torch.bfloat16).contiguous()
        if e.past == 0 and e.q == e.prompt:
            self.cache.prefill(layer, e.slot, kr, vv, kp)
            self.counters["prefill_calls"] += layer == 0
        else:
            self.cache.prefill_piece(layer, e.slot, e.prompt, e.past, kr, vv, kp)
            self.counters["prefill_pieces"] += layer == 0

    def forward_context(self):
        """The context a forward pass of the batching loop runs in: in the reproducible mode, the linear
        layers run per request (_PerRequestLinear); otherwise nothing."""
        if not self.reproducible or self._plan is None:
            return _Null()
        return _PerRequestLinear([e.q for e in self._plan], self._plan_logits)

    def stats(self) -> dict:
        """The engine's counters, the slots in use, and the library cache's usage (skv_cache_usage) once made."""
        out = dict(self.counters, slots=self.slots, slots_in_use=len(self._slot_of))
        if self.cache is not None:
            out["usage"] = self.cache.usage()
        return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def shadowkv_paged_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: Optional[float] = None, **kwargs):
    """The attention implementation ATTN_IMPLEMENTATION: the engine of the module's model computes the
    layer for the packed batch (ServingEngine.attend); a model without an engine, or a forward without a
    paged cache, gets transformers' sdpa."""
    engine = _engine_of_config(getattr(module, "config", None))
    if engine is None or "cu_seq_lens_q" not in kwargs:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return engine.attend(module, query, key, value, scaling, dropout, kwargs), None


class ShadowKVScheduler(_cb_scheduler.FIFOScheduler):
    """transformers' FIFO scheduler with the engine's rules: a waiting request the library takes is
    admitted only while a slot is free (the others as usual); in the reproducible mode a waiting request
    is admitted only with room for its whole prompt in the batch (prompts up to the batch's token budget
    are never split); the scheduled batch is handed to the engine; finished, cancelled and reset requests
    release their slots."""

    def __init__(self, cache, safety_margin, max_requests_per_batch: int):
        self.engine = None
        super().__init__(cache, safety_margin, max_requests_per_batch)
        self.engine = _engine_of_config(cache.config)
        if self.engine is None:
            raise RuntimeError("the shadowkv scheduler runs a model that shadowkv.serving.install() prepared")

    def reset(self) -> None:
        super().reset()
        if self.engine is not None:
            self.engine.release_all()

    def _admissible(self, waiting: list, left: int, full: int) -> list:
        """The waiting requests this batch may take: one the library takes only while a slot is free; in the
        reproducible mode a new prompt only when all of it fits the batch's tokens left (a prompt longer than
        the whole budget, full, is split in any case and goes as transformers schedules it)."""
        eng = self.engine
        free = eng.free_slots
        out = []
        for st in waiting:
            n = len(st.remaining_prefill_tokens)
            new = st.position_offset == 0
            if eng.reproducible and new and left < n <= full:
                continue
            if new and eng.takes(st):
                if free == 0:
                    continue
                free -= 1
            left -= n
            out.append(st)
        return out

    def schedule_batch(self, token_budget: int, cache_budget: int):
        """FIFOScheduler.schedule_batch with the engine's admission rules; hands the batch to the engine."""
        priority, second = [], []
        for state in self.active_requests.values():
            if state.status == RequestStatus.DECODING:
                priority.append(state)
            elif state.status == RequestStatus.PREFILLING:
                second.append(state)
        if not self.block_new_requests:
            left = token_budget - len(priority) - sum(len(s.remaining_prefill_tokens) for s in second)
            second.extend(self._admissible(self._get_waiting_candidates(), left, token_budget))
        remove: set = set()
        scheduled, failed, fast_path, n_q, max_kv = self._process_candidates(priority + second, token_budget,
                                                                             cache_budget, remove)
        self._cleanup_waiting_queue(remove)
        # slots of requests transformers dropped without finishing them (offloaded and reset, failed)
        gone = [r for r in self.engine._slot_of if r not in self.active_requests and r not in self.waiting_requests]
        for rid in gone:
            self.engine.release(rid)
        if not scheduled and failed:
            self.engine._plan = None
            return None, fast_path, 0, 0
        self.engine.plan(scheduled)
        return scheduled, fast_path, n_q, max_kv

    def finish_request(self, request_id: str) -> None:
        super().finish_request(request_id)
        self.engine.release(request_id)

    def clear_cancelled_requests(self):
        states = super().clear_cancelled_requests()
        for st in states:
            self.engine.release(st.request_id)
        return states


def _adjust(cb_config: Optional[ContinuousBatchingConfig]) -> ContinuousBatchingConfig:
    """The batching options the engine needs, on a copy of cb_config."""
    import copy
    c = copy.copy(cb_config) if cb_config is not None else ContinuousBatchingConfig()
    c.scheduler_type = SCHEDULER
    c.allow_block_sharing = False      # prefix sharing would start a request past its prompt's first tokens
    c.max_blocks_per_request = 0       # no decode fast path: the attention gets the keys and values
    c.use_async_batching = False       # the next batch is scheduled after this one's forward
    c.use_cuda_graph = False           # the attention's host logic cannot be replayed from a graph
    c.auto_switch_to_flash = False
    return c


def install(model, slots: int = 8, max_prompt_len: int = 4096, gen_capacity: int = 512, backend: str = "auto",
            reproducible: bool = False, n_threads: int = 0, **fields: Any) -> ServingEngine:
    """Makes libshadowkv the decode attention and KV cache of the model's continuous batching (model.
    generate_batch, model.init_continuous_batching, `transformers serve --continuous-batching`), and returns
    the ServingEngine. Call it before the batching manager starts (a manager already cached on the model is
    destroyed).

    slots: sequences the library holds at once (requests beyond wait for a slot); max_prompt_len: the
    longest prompt it takes; gen_capacity: generated tokens per request; backend: "auto" (the model's
    device: cuda for a CUDA model, else cpu), "cpu", "ref" or "cuda"; reproducible: the library's
    reproducible mode and per-request linear layers (a request's greedy tokens equal those of the request
    served alone); fields: library config fields over shadowkv.hf.scaled_config(model, max_prompt_len)
    (rank, budget, select_mode, pool_device_bytes, ...)."""
    uninstall(model)
    engine = ServingEngine(model, slots=slots, max_prompt_len=max_prompt_len, gen_capacity=gen_capacity,
                           backend=backend, reproducible=reproducible, n_threads=n_threads, **fields)
    AttentionInterface.register(ATTN_IMPLEMENTATION, shadowkv_paged_attention)
    _cb_scheduler.SCHEDULER_MAPPING[SCHEDULER] = ShadowKVScheduler
    with _LOCK:
        _ENGINES[id(engine.hf_config)] = engine
    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if destroy is not None:
        destroy()
    init_cb = model.init_continuous_batching  # the class's bound method

    @functools.wraps(init_cb)
    def init_continuous_batching(generation_config=None, continuous_batching_config=None, workload_hints=None,
                                 **kw):
        # the manager accepts only the implementations it knows (sdpa, paged|eager, flash) when it starts;
        # the batch processor it makes later reads the model's implementation again: ours then
        if model.config._attn_implementation == ATTN_IMPLEMENTATION:
            model.set_attn_implementation("sdpa")
        manager = init_cb(generation_config, _adjust(continuous_batching_config), workload_hints, **kw)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        return manager

    forward = model.forward

    @functools.wraps(forward)
    def forward_in_context(*args, **kw):
        with engine.forward_context():
            return forward(*args, **kw)

    model.init_continuous_batching = init_continuous_batching
    model.forward = forward_in_context
    model._shadowkv_engine = engine
    return engine


def uninstall(model) -> None:
    """Undoes install(model): the model's own init_continuous_batching and forward, sdpa attention."""
    engine = model.__dict__.pop("_shadowkv_engine", None)
    if engine is None:
        return
    model.__dict__.pop("init_continuous_batching", None)
    model.__dict__.pop("forward", None)
    with _LOCK:
        _ENGINES.pop(id(engine.hf_config), None)
    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if destroy is not None:
        destroy()
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        model.set_attn_implementation("sdpa")
    if engine.cache is not None:
        engine.cache.close()


# -- `transformers serve` with the library -------------------------------------------------------------------
_ENV = "SHADOWKV_SERVE_OPTIONS"  # the launcher's options, for the model's process (a spawned child)
_OPTIONS = {"--skv-slots": ("slots", int), "--skv-max-prompt-len": ("max_prompt_len", int),
            "--skv-gen-capacity": ("gen_capacity", int), "--skv-backend": ("backend", str),
            "--skv-threads": ("n_threads", int), "--skv-pool-mb": ("pool_mb", int),
            "--skv-reproducible": ("reproducible", None), "--skv-fields": ("fields", json.loads)}


def _loader_class():
    from transformers.cli.serving import model_manager

    base = model_manager.ModelLoader
    if getattr(base, "_shadowkv", False):
        return base

    class ShadowKVModelLoader(base):
        """transformers serve's ModelLoader that installs the engine on the model it loads (in the model's
        process), with the launcher's options."""
        _shadowkv = True

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.shadowkv_options = json.loads(os.environ.get(_ENV, "{}"))

        def load_model_and_processor(self, model_id, on_progress=None):
            model, processor = super().load_model_and_processor(model_id, on_progress=on_progress)
            o = dict(self.shadowkv_options)
            fields = dict(o.pop("fields", {}) or {})
            pool_mb = o.pop("pool_mb", 0)
            if pool_mb:
                fields.setdefault("pool_device_bytes", int(pool_mb) << 20)
            _log_to_stderr()
            engine = install(model, **o, **fields)
            logger.info("shadowkv: libshadowkv %s serves %s: %d slots, prompts of %d to %d tokens, gen_capacity %d, "
                        "reproducible %s, fields %s", shadowkv_version(), model_id, engine.slots, engine.min_prompt_len,
                        engine.max_prompt_len, engine.gen_capacity, engine.reproducible, engine.fields)
            return model, processor

    ShadowKVModelLoader.__module__ = "shadowkv.serving"  # pickled by name into the model's process
    ShadowKVModelLoader.__qualname__ = "ShadowKVModelLoader"
    globals()["ShadowKVModelLoader"] = ShadowKVModelLoader
    model_manager.ModelLoader = ShadowKVModelLoader
    return ShadowKVModelLoader


def __getattr__(name):  # the loader class, for the model's process to unpickle (made on first use)
    if name == "ShadowKVModelLoader":
        return _loader_class()
    raise AttributeError(name)


def _log_to_stderr() -> None:
    """The engine's info lines on stderr (the launcher's and the model process's)."""
    if not logger.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        logger.addHandler(h)
    logger.setLevel(logging.INFO)


def main(argv: Optional[list] = None) -> None:
    """`python -m shadowkv.serving serve MODEL --continuous-batching [transformers serve options]
    [--skv-* options]`: transformers serve with libshadowkv in its continuous batching. The --skv-*
    options (the rest go to transformers serve): --skv-slots N (8), --skv-max-prompt-len N (4096),
    --skv-gen-capacity N (512), --skv-backend auto|cpu|ref|cuda, --skv-threads N, --skv-reproducible,
    --skv-pool-mb N (the pool mode: a device pool of N MiB), --skv-fields JSON (library config fields)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, rest, i = {}, [], 0
    while i < len(argv):
        a = argv[i]
        name, _, val = a.partition("=")
        if name in _OPTIONS:
            key, conv = _OPTIONS[name]
            if conv is None:
                opts[key] = True
            else:
                if not val:
                    i += 1
                    if i >= len(argv):
                        raise SystemExit(f"{name} needs a value")
                    val = argv[i]
                opts[key] = conv(val)
        else:
            rest.append(a)
        i += 1
    if not rest or rest[0] != "serve":
        raise SystemExit("usage: python -m shadowkv.serving serve MODEL --continuous-batching [transformers serve "
                         "options] [--skv-slots N] [--skv-max-prompt-len N] [--skv-gen-capacity N] [--skv-backend B] "
                         "[--skv-threads N] [--skv-reproducible] [--skv-pool-mb N] [--skv-fields JSON]")
    os.environ[_ENV] = json.dumps(opts)
    _log_to_stderr()
    if "--continuous-batching" not in rest:
        logger.warning("shadowkv: without --continuous-batching, transformers serve generates one request at a time "
                       "with its own attention; the library serves nothing")
    _loader_class()
    from transformers.cli.transformers import app
    sys.argv = ["python -m shadowkv.serving", *rest]
    app()


if __name__ == "__main__":  # python -m shadowkv.serving: run as the package's module, whose classes pickle by name
    from shadowkv.serving import main as _main
    _main()
