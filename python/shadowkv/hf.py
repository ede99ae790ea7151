"""shadowkv.hf: a Hugging Face transformers Cache whose decode attention runs through libshadowkv.

    from transformers import AutoModelForCausalLM
    from shadowkv.hf import ShadowKVCache, scaled_config

    model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.1-8B", torch_dtype=torch.bfloat16).cuda()
    cache = ShadowKVCache(model, batch_size=1, gen_capacity=256,   # fields: rank, budget, ... (config())
                          **scaled_config(model, context_len=8192))
    out = model.generate(input_ids, max_new_tokens=256, cache=cache)  # past_key_values=cache on 5.17
    cache.selected(layer=0, seq=0)                                   # [Hk, S] chunk ids of the last step

Model families (SUPPORTED_MODEL_TYPES, each tested with random weights): Llama (any GQA group, head
dims up to the library's 1024), Mistral (no sliding window shorter than the context), Qwen2 (q/k/v
bias), Phi-3 (fused qkv, partial rotary). transformers 5; tested with 5.17, 5.24 and 5.25 (5.24 takes
the cache as `cache=`, with `past_key_values=` a deprecated alias; 5.17 only as `past_key_values=`).

How it works:

- The prompt's forward pass is ordinary dense attention (sdpa) over the prompt's own keys. On
  the way, `update()` prefills every (layer, sequence) of a libshadowkv cache: the library gets
  the post-RoPE keys the model computed (`k_post`, used exactly for landmarks, outliers and
  the local window) and the pre-RoPE keys for the rank-r factorization. The pre-RoPE keys are
  recovered by rotating the post-RoPE keys back, in float32, with the library's own RoPE
  tables (over dims [0, rotary_dim); the dims after a partial rotary pass through). We chose
  this over capturing k_proj's output with a hook: it needs no hooks on the model, it sees any
  transformation the model applies between k_proj and RoPE (bias, a key norm), and since the
  library rebuilds selected keys as RoPE(U W) with those same tables, the rebuilt keys
  reproduce the model's post-RoPE keys up to the rank-r truncation and bf16 rounding, even
  where transformers' float32 cos/sin differ from the library's double-built tables at long
  positions, or where a model cast with .to(torch.bfloat16) has had its inv_freq buffer rounded
  to bf16 (transformers then ropes with frequencies off by up to 2^-9 relative). The mapping of
  the model's RoPE (rope_config_for: theta, partial rotary, Llama-3 scaling) to the library's
  config still matters: it is what makes the recovered keys the model's pre-RoPE keys, whose
  low rank the factorization relies on.
- `prefill_from(kv)` does the same from keys and values already computed (a DynamicCache after a
  dense prefill, or per-layer (k_post, v) tensors): one dense prefill, several sparse caches.
- Each decode step (one new token per sequence) goes through `skv_decode`: `update()` keeps the
  new token's key and value, and the attention function registered as "shadowkv"
  (shadowkv_attention; registered only where that name is free, so a user's wrapper of it stays)
  hands them with the query to the library. For anything that is not a decode step of a
  ShadowKVCache, "shadowkv" attention is transformers' sdpa.

A model of your own (allow_model_type=True) works when its attention layers hand post-RoPE keys
[B, Hk, T, D] to Cache.update and call the attention function config._attn_implementation names;
its RoPE is rotate-half over the first rotary_dim dims (default or Llama-3 scaling) at positions
0..n-1; and every layer attends causally to the whole context with scale attn_scale. Check it with
budget="all" and rank = Hk*D: the logits then equal dense attention's within bf16 tolerance
(docs/usage.md, "Hugging Face models").

The libshadowkv cache is created at the first prefill, for the batch and prompt length it
sees (at most `batch_size` sequences; `max_prompt_len` defaults to that prompt's length), on
the backend that matches the model's device when `backend="auto"` (cuda for a CUDA model,
else cpu). Refused with an exception naming the field: a model the cache cannot serve
(check_model: sliding-window layers shorter than the context, head_dim over the limit, an
unknown RoPE scaling), a prompt shorter than min_prompt_len, generation past gen_capacity, a
second prompt into a running cache (reset() first), padded batches (all prompts must have the
same length), feeding the prompt in several chunks, beam search and other cache reordering, crop.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional

try:
    import torch
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.cache_utils import Cache as _HFCache
    from transformers.cache_utils import CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:
    from ._arrays import HF_EXTRA
    raise ImportError(f"shadowkv.hf needs torch and transformers, which are not installed: {HF_EXTRA} "
                      f"({e})") from e

from . import Cache, ShadowKVError, _ffi, config as _skv_config, min_prompt_len as _min_prompt_len, validate
from . import ops
from ._scaled import scaled_config as _scaled_config

__all__ = ["ShadowKVCache", "ATTN_IMPLEMENTATION", "register", "rope_config_for", "shadowkv_attention",
           "scaled_config", "check_model", "SUPPORTED_MODEL_TYPES"]

ATTN_IMPLEMENTATION = "shadowkv"
# model types whose attention is known to fit (tested in python/tests/test_families.py): post-RoPE keys
# handed to Cache.update, rotate-half RoPE over the first rotary_dim dims, full causal attention
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "phi3")
# the largest head_dim the library takes (SKV_MAX_HEAD_DIM of lib/skv_config.c)
MAX_HEAD_DIM = 1024

# per thread: .cache, the cache whose decode step waits for its attention call; .positions, (cache,
# layer, prompt length) whose prompt's positions its attention call checks (transformers 5.17 does not
# pass position_ids to Cache.update, only to the attention function; 5.24 passes them to both)
_active = threading.local()


def shadowkv_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                       scaling: Optional[float] = None, **kwargs):
    """The "shadowkv" attention implementation: a pending ShadowKVCache decode step of this layer
    goes to skv_decode; everything else (prompts, other caches) is sdpa.

    A user who registers their own function under "shadowkv" (to log, time or change it) calls this
    one from it for the cache to work; register() leaves such a registration in place:

        def mine(module, query, key, value, attention_mask, **kw):
            out, weights = shadowkv.hf.shadowkv_attention(module, query, key, value, attention_mask, **kw)
            ...                                  # out: [B, T, Hq, D]
            return out, weights
        transformers.AttentionInterface.register("shadowkv", mine)
    """
    check = getattr(_active, "positions", None)
    if check is not None and check[1:] == (getattr(module, "layer_idx", None), query.shape[2]):
        _active.positions = None
        check[0]._check_positions_deferred(kwargs.get("position_ids"), query.shape[2])
    cache = getattr(_active, "cache", None)
    if cache is not None and cache._pending is not None and cache._pending[0] == getattr(module, "layer_idx", None):
        _active.cache = None
        return cache._attend(module, query, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


_shadowkv_attention = shadowkv_attention  # the name of earlier versions


def register(force: bool = False) -> None:
    """Registers the "shadowkv" attention (shadowkv_attention) and its mask (sdpa's) with transformers,
    each only where nothing is registered under "shadowkv" yet: a function the user registered there
    (a wrapper of shadowkv_attention, see its docstring) stays. force=True replaces it."""
    if force or ATTN_IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_IMPLEMENTATION, shadowkv_attention)
    if force or ATTN_IMPLEMENTATION not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _text_config(model_or_config):
    cfg = model_or_config.config if isinstance(model_or_config, PreTrainedModel) else model_or_config
    get = getattr(cfg, "get_text_config", None)
    return get(decoder=True) if get else cfg


def _head_dim(hf) -> int:
    Hq = hf.num_attention_heads
    return getattr(hf, "head_dim", None) or hf.hidden_size // Hq


def rope_config_for(hf_config) -> dict:
    """The library's rope fields for a transformers config: theta; rotary_dim for partial rotary
    (transformers' partial_rotary_factor f: the first int(head_dim * f) dims rotate, rotate-half
    within them, with frequencies theta^(-2i/rotary_dim), as the library's rotary_dim does); and
    the Llama-3 scaling (factor, low/high frequency factors, original max position) for rope_type
    "llama3". Any other rope_type (linear, dynamic, yarn, longrope, ...) raises ValueError naming
    it: the library implements default and llama3 RoPE only."""
    rp = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if not rp and isinstance(legacy, dict):
        rp = dict(legacy)
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    theta = rp.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("rope_theta: the model config has none")
    D = _head_dim(hf_config)
    factor = rp.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    factor = 1.0 if factor is None else float(factor)
    R = int(D * factor)  # transformers' dim = int(head_dim * partial_rotary_factor)
    if not 0.0 < factor <= 1.0 or R < 2 or R % 2:
        raise ValueError(f"partial_rotary_factor {factor}: rotates {R} of head_dim {D} dims; the library needs an "
                         "even rotary_dim in [2, head_dim]")
    out = dict(theta=float(theta), rotary_dim=0 if R == D else R, interleaved=0, llama3_scaling=0)
    if rope_type == "llama3":
        out.update(llama3_scaling=1, scaling_factor=float(rp["factor"]),
                   low_freq_factor=float(rp["low_freq_factor"]), high_freq_factor=float(rp["high_freq_factor"]),
                   original_max_position=int(rp["original_max_position_embeddings"]))
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r}: the library implements 'default' and 'llama3' RoPE only "
                         "(no linear, dynamic, yarn or longrope scaling); this model's keys cannot be rebuilt")
    return out


def _sliding_window(hf) -> Optional[int]:
    """The smallest attention window of the model's layers, or None when every layer attends to the
    whole context."""
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    if types is not None:
        if not any("sliding" in str(t) or "chunked" in str(t) for t in types):
            return None
        return window if window is not None else 0
    if getattr(hf, "use_sliding_window", True) is False:
        return None
    return window


def check_model(model_or_config, context_len: Optional[int] = None, allow_model_type: bool = False) -> None:
    """Raises (TypeError or ValueError, naming the field) where ShadowKVCache cannot serve the model
    exactly: a model_type outside SUPPORTED_MODEL_TYPES (unless allow_model_type), head_dim odd or
    over the library's MAX_HEAD_DIM, a RoPE the library does not implement (rope_config_for),
    sliding-window layers whose window is shorter than context_len tokens (None: the window is checked
    only for being set with no length; ShadowKVCache checks it again at the prompt, against the prompt's
    max_prompt_len + gen_capacity)."""
    hf = _text_config(model_or_config)
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES and not allow_model_type:
        raise TypeError(f"model_type {model_type!r}: ShadowKVCache is tested with {SUPPORTED_MODEL_TYPES}; for a "
                        "model of your own that meets docs/usage.md's conditions pass allow_model_type=True")
    D = _head_dim(hf)
    if D % 2 or D > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D}: the library takes even head dims up to {MAX_HEAD_DIM}")
    rope_config_for(hf)
    window = _sliding_window(hf)
    if window is not None and (window <= 0 or (context_len is not None and window < context_len)):
        raise ValueError(f"sliding_window {window}: the model's layers attend to the last {window} tokens only, "
                         f"but the context is {context_len} tokens; ShadowKVCache attends over the whole context (set max_prompt_len and gen_capacity so "
                         "their sum is at most the window, or use a model without sliding-window layers)")


def scaled_config(model, context_len: int, select_mode: str = "fixed", adaptive_rank: bool = False,
                  n_dense_layers: int = 0, rescore: bool = True) -> dict:
    """shadowkv.scaled_config for a transformers model (or its config): the sparse fields (rank, budget,
    n_outlier_chunks, n_local_chunks, chunk_size, select_mode, ...) scaled to its KV heads and head dim
    and a context of context_len tokens. ShadowKVCache(model, **scaled_config(model, 4096))."""
    hf = _text_config(model)
    Hk = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    return _scaled_config(Hk, _head_dim(hf), context_len, n_layers=hf.num_hidden_layers, select_mode=select_mode,
                          adaptive_rank=adaptive_rank, n_dense_layers=n_dense_layers, rescore=rescore)


class ShadowKVLayer(CacheLayerMixin):
    """One layer's bookkeeping (its tokens live in the libshadowkv cache of the ShadowKVCache)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.n_seen = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):  # the ShadowKVCache does the work
        raise RuntimeError("ShadowKVLayer.update is not called directly; ShadowKVCache.update is")

    def get_mask_sizes(self, query_length: int):
        return self.n_seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.n_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.n_seen = 0
        self.is_initialized = False

    def offload(self):
        pass

    def prefetch(self):
        pass

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("ShadowKVCache cannot drop tokens (crop)")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("ShadowKVCache does not support beam search or cache reordering")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("ShadowKVCache does not support num_return_sequences > 1 or beam search")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("ShadowKVCache does not support selecting sequences of the batch")


class ShadowKVCache(_HFCache):
    """A transformers Cache with ShadowKV sparse attention in decode (Llama, Mistral, Qwen2, Phi-3).

    ShadowKVCache(model, backend="auto", batch_size=1, max_prompt_len=None, gen_capacity=1024,
                  allow_model_type=False, **fields)

    model: a transformers model of SUPPORTED_MODEL_TYPES (or its config; then set its attention
    with model.set_attn_implementation("shadowkv") yourself). Given the model, the cache registers
    the "shadowkv" attention where nothing is registered under that name yet (register()) and sets
    it on the model (sdpa for everything but this cache's decode steps). backend: "auto", "ref",
    "cpu" or "cuda". batch_size: the most sequences one generate call may hold. gen_capacity:
    generated tokens per sequence. fields: any other shadowkv.config() field (rank, budget
    (or "all"), chunk_size, n_outlier_chunks, n_local_chunks, select_mode ("fixed" or "mass"),
    select_mass, select_min_chunks, select_candidates, rank_max, rank_error_target, dense_layers, value_device_bytes,
    n_threads, ...); scaled_config(model, context_len) gives model-scaled ones. The model's shape,
    RoPE and attention scale are taken from its config. Raises TypeError or ValueError (naming the
    field) for a model the cache cannot serve: see check_model. allow_model_type: accept a
    model_type outside SUPPORTED_MODEL_TYPES that meets docs/usage.md's conditions.
    """

    # the most sequences one generate call may hold (the batch_size argument). A plain attribute here:
    # transformers 5.17 has a read-only, deprecated Cache.max_batch_size property, which this shadows
    max_batch_size: int = 1

    def __init__(self, model, backend: str = "auto", batch_size: int = 1, max_prompt_len: Optional[int] = None,
                 gen_capacity: int = 1024, allow_model_type: bool = False, **fields: Any):
        hf = _text_config(model)
        # the context a sliding window must cover: known here when max_prompt_len is given, else at the prompt
        check_model(hf, None if max_prompt_len is None else max_prompt_len + gen_capacity, allow_model_type)
        for k in ("n_layers", "n_q_heads", "n_kv_heads", "head_dim", "rope", "batch_size", "max_prompt_len",
                  "gen_capacity", "backend"):
            if k in fields:
                raise TypeError(f"{k}: taken from the model or an argument of ShadowKVCache, not a field")
        if backend not in _ffi.BACKENDS:
            raise ValueError(f"backend {backend!r}: expected one of {sorted(_ffi.BACKENDS)}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: {batch_size!r}, expected a positive int")
        L = hf.num_hidden_layers
        Hq = hf.num_attention_heads
        Hk = getattr(hf, "num_key_value_heads", None) or Hq
        D = _head_dim(hf)
        self.hf_config = hf
        self.backend_request = backend
        self.max_batch_size = batch_size
        self.max_prompt_len = max_prompt_len
        self.gen_capacity = gen_capacity
        self.head_dim = D
        self.rope = rope_config_for(hf)
        self.rotary_dim = self.rope["rotary_dim"] or D
        fields.setdefault("attn_scale", float(D) ** -0.5)  # the attention modules' scaling
        self.skv_config = _skv_config(n_layers=L, n_q_heads=Hq, n_kv_heads=Hk, head_dim=D, rope=self.rope,
                                      batch_size=batch_size, gen_capacity=gen_capacity,
                                      backend="cpu" if backend == "auto" else backend, **fields)
        c = self.skv_config
        # the shortest prompt every layer takes: sparse layers need O + k_min + Lc chunks (k_min for the
        # selection mode: S fixed, max(1, select_min_chunks) mass, 1 with budget "all") and n >= rank;
        # dense layers one token
        self.min_prompt_len = max(_min_prompt_len(c, layer) for layer in range(L))
        c.max_prompt_len = max_prompt_len if max_prompt_len is not None else self.min_prompt_len
        validate(c)  # a bad field fails here, not in the middle of generate
        super().__init__(layers=[ShadowKVLayer() for _ in range(L)])
        self.skv: Optional[Cache] = None
        self.prompt_len = 0
        self._pending = None
        self._inv_tables = None
        register()
        if isinstance(model, PreTrainedModel) and hf._attn_implementation != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)

    def prefill_from(self, kv, position_ids=None) -> None:
        """Fills the cache from keys and values already computed by a dense forward pass over the
        prompt, so one dense prefill serves several caches (an evaluation of several sparse settings):

            dc = DynamicCache(config=model.config)
            logits = model(prompt_ids, past_key_values=dc).logits      # dense prefill, once
            cache = ShadowKVCache(model, budget=256); cache.prefill_from(dc)
            model(next_ids, past_key_values=cache)                     # decode through the library

        kv: a transformers DynamicCache (every layer full, not sliding) or a sequence of n_layers
        (k_post, v) pairs, each [B, Hk, T, D]: the post-RoPE keys and the values of the prompt at
        positions 0..T-1, as the model's attention layers hand them to Cache.update. They are copied
        (kv may fill other caches after). The cache must be empty (new, or after reset()).
        position_ids: optional [B, T] or [T]; checked to be 0..T-1 when given.
        """
        if self.skv is not None or any(layer.n_seen for layer in self.layers):
            raise RuntimeError("prefill_from: the cache already holds a prompt (a second prefill of running "
                               "sequences); call cache.reset() first")
        layers = getattr(kv, "layers", None)
        if layers is not None:
            pairs = [(getattr(l, "keys", None), getattr(l, "values", None)) for l in layers]
        else:
            pairs = list(kv)
        L = len(self.layers)
        if len(pairs) != L:
            raise ValueError(f"kv: {len(pairs)} layers, the model has {L}")
        for i, pair in enumerate(pairs):
            if len(pair) != 2 or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in pair):
                raise ValueError(f"kv layer {i}: expected (k_post, v) tensors [B, Hk, T, D] (an empty or "
                                 "uninitialized layer of the DynamicCache?)")
            if pair[0].shape != pairs[0][0].shape or pair[1].shape != pair[0].shape:
                raise ValueError(f"kv layer {i}: keys {tuple(pair[0].shape)} and values {tuple(pair[1].shape)}; "
                                 f"layer 0's keys are {tuple(pairs[0][0].shape)} (all [B, Hk, T, D] alike)")
        T = pairs[0][0].shape[2]
        if position_ids is not None:
            self._check_positions(position_ids, T)
        try:
            for i, (k, v) in enumerate(pairs):
                self._prefill(i, k, v, None)
                self.layers[i].n_seen = T
                self.layers[i].is_initialized = True
        except BaseException:
            self.reset()
            raise

    # -- the transformers Cache interface ----------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Prefill (the first call of a layer: the prompt) or a decode step (one token). Returns the
        states the attention call receives: the prompt's own keys and values for its dense
        attention; in decode, the new token's (the "shadowkv" attention does not read them)."""
        kw = kwargs.get("kwargs", kwargs)
        if self.hf_config._attn_implementation != ATTN_IMPLEMENTATION:
            raise RuntimeError(f"the model's attention implementation is {self.hf_config._attn_implementation!r}: "
                               f"ShadowKVCache needs model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) "
                               "(done for you when the cache is built from the model)")
        if self._pending is not None:
            raise RuntimeError(f"layer {self._pending[0]}'s decode step never reached its attention call")
        layer = self.layers[layer_idx]
        B, Hk, T, D = key_states.shape
        _active.positions = None  # a check left by a call that failed before its attention call
        if layer.n_seen == 0:
            creates = self.skv is None
            position_ids = kw.get("position_ids")
            self._prefill(layer_idx, key_states, value_states, position_ids)
            if creates and position_ids is None:  # transformers 5.17: the attention call that follows has them
                _active.positions = (self, layer_idx, T)
            layer.n_seen = T
            layer.is_initialized = True
            return key_states, value_states
        if T != 1:
            raise RuntimeError(f"layer {layer_idx}: {T} tokens given to a cache that holds a running sequence "
                               f"({self.prompt_len} prompt tokens, {layer.n_seen - self.prompt_len} generated): a "
                               "second prefill is not supported (tokens after the prompt come one at a time); "
                               "call cache.reset() before a new prompt, and prefill a prompt in one forward pass")
        if B != self.skv.batch_size:
            raise ValueError(f"decode with a batch of {B}, but the prompt had {self.skv.batch_size} sequences")
        if layer.n_seen - self.prompt_len >= self.gen_capacity:
            raise ValueError(f"gen_capacity {self.gen_capacity}: layer {layer_idx} already holds that many generated "
                             "tokens; create the ShadowKVCache with a larger gen_capacity")
        dev = self.skv.device
        self._pending = (layer_idx,
                         key_states[:, :, 0].to(device=dev, dtype=torch.bfloat16).contiguous(),
                         value_states[:, :, 0].to(device=dev, dtype=torch.bfloat16).contiguous())
        _active.cache = self
        layer.n_seen += 1
        return key_states, value_states

    def _attend(self, module, query: torch.Tensor, scaling: Optional[float]) -> torch.Tensor:
        layer_idx, k, v = self._pending
        self._pending = None
        if scaling is not None and abs(scaling - self.skv.config.attn_scale) > 1e-6 * abs(scaling):
            raise ValueError(f"layer {layer_idx}: attention scaling {scaling} differs from the cache's attn_scale "
                             f"{self.skv.config.attn_scale}")
        B, Hq, T, D = query.shape
        q = query[:, :, 0].to(device=self.skv.device, dtype=torch.bfloat16).contiguous()
        out = self.skv.decode(layer_idx, q, k, v)  # [B, Hq, D] float32
        return out.to(device=query.device, dtype=query.dtype).unsqueeze(1)  # [B, 1, Hq, D]

    def _create(self, B: int, T: int, device: torch.device) -> None:
        if B > self.max_batch_size:
            raise ValueError(f"a batch of {B} sequences is larger than the cache (batch_size={self.max_batch_size})")
        c = _ffi.Config()
        ctypes.pointer(c)[0] = self.skv_config
        c.batch_size = B
        c.max_prompt_len = self.max_prompt_len if self.max_prompt_len is not None else max(T, self.min_prompt_len)
        check_model(self.hf_config, c.max_prompt_len + c.gen_capacity, allow_model_type=True)
        backend = self.backend_request
        if backend == "auto":
            backend = "cuda" if device.type == "cuda" else "cpu"
        c.backend = _ffi.BACKENDS[backend]
        if backend == "cuda" and device.type == "cuda":
            with torch.cuda.device(device):
                self.skv = Cache(c)
        else:
            self.skv = Cache(c)

    def _prefill(self, layer_idx: int, key_states, value_states, position_ids) -> None:
        B, Hk, T, D = key_states.shape
        c = self.skv_config
        if (Hk, D) != (c.n_kv_heads, c.head_dim):
            raise ValueError(f"layer {layer_idx}: keys with {Hk} heads of {D}, the cache has {c.n_kv_heads} of "
                             f"{c.head_dim}")
        if self.skv is None:
            if T < self.min_prompt_len:
                raise ValueError(
                    f"a prompt of {T} tokens is shorter than the config needs: at least {self.min_prompt_len} tokens "
                    f"(shadowkv.min_prompt_len: (n_outlier_chunks + k_min + n_local_chunks) * chunk_size with k_min "
                    f"= budget / chunk_size in select_mode 'fixed', max(1, select_min_chunks) in 'mass', 1 for "
                    f"budget 'all'; and at least the rank); n_outlier_chunks = {c.n_outlier_chunks}, budget = "
                    f"{'all' if c.budget == _ffi.BUDGET_ALL else c.budget}, n_local_chunks = {c.n_local_chunks}, "
                    f"chunk_size = {c.chunk_size}, rank = {c.rank}; use a longer prompt, or a smaller budget, "
                    "n_outlier_chunks or rank (or select_mode 'mass', or budget 'all')")
            if position_ids is not None:
                self._check_positions(position_ids, T)
            self._create(B, T, key_states.device)
            self.prompt_len = T
            self._inv_tables = None
        elif T != self.prompt_len:
            raise ValueError(f"layer {layer_idx}: a prompt of {T} tokens, but layer 0's had {self.prompt_len}")
        elif B != self.skv.batch_size:
            raise ValueError(f"layer {layer_idx}: a batch of {B}, but layer 0's prompt had {self.skv.batch_size}")
        dev = self.skv.device
        if self._inv_tables is None or self._inv_tables[0].shape[0] != T:
            cos, sin = ops.rope_tables(self.skv.config.rope, D, T, device=dev)
            self._inv_tables = (cos, sin)
        cos, sin = self._inv_tables
        k = key_states.to(device=dev, dtype=torch.float32)
        R = self.rotary_dim
        h = R // 2
        x1, x2 = k[..., :h], k[..., h:R]
        # the inverse of the library's rotate-half rotation of dims [0, R) at positions 0..T-1; dims R..D-1
        # are not rotated (partial rotary)
        k_pre = torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin, k[..., R:]], dim=-1).to(torch.bfloat16)
        k_post = key_states.to(device=dev, dtype=torch.bfloat16)
        v = value_states.to(device=dev, dtype=torch.bfloat16)
        for b in range(B):
            self.skv.prefill(layer_idx, b, k_pre[b].transpose(0, 1).contiguous(), v[b].transpose(0, 1).contiguous(),
                             k_post[b].transpose(0, 1).contiguous())

    @staticmethod
    def _check_positions(position_ids, T: int) -> None:
        want = torch.arange(T, device=position_ids.device)
        if not bool((position_ids == want).all()):
            raise ValueError("ShadowKVCache takes unpadded prompts at positions 0..n-1 (every sequence of the "
                             "batch the same length); got other position_ids (a padded batch?)")

    def _check_positions_deferred(self, position_ids, T: int) -> None:
        """The prompt's position check where Cache.update did not get position_ids (transformers 5.17):
        in the attention call of the layer that created the libshadowkv cache, which is dropped again
        when the check fails (as if it had failed before the prefill, as on 5.24)."""
        if position_ids is None:
            return
        try:
            self._check_positions(position_ids, T)
        except ValueError:
            self.reset()
            raise

    def reset(self) -> None:
        """Drops every sequence: the next prompt starts a new libshadowkv cache."""
        if self.skv is not None:
            self.skv.close()
        self.skv = None
        self.prompt_len = 0
        self._pending = None
        self._inv_tables = None
        for layer in self.layers:
            layer.reset()

    # -- introspection ---------------------------------------------------------------------------
    def _need(self) -> Cache:
        if self.skv is None:
            raise ValueError("nothing was prefilled yet")
        return self.skv

    def selected(self, layer: int, seq: int, kv_head: Optional[int] = None, pad: bool = False):
        """Chunk ids selected at the last decode step: the k ids of kv_head (int32 CPU tensor, increasing;
        k = S in the fixed mode), or for kv_head None [Hk, S] (fixed mode) or a list of Hk tensors
        (select_mode "mass"). pad=True: S entries per head, -1 after the k ids (shadowkv.Cache.selected)."""
        return self._need().selected(layer, seq, kv_head, pad=pad)

    def selected_count(self, layer: int, seq: int, kv_head: Optional[int] = None):
        """k, the chunks selected at the last decode step by kv_head (an int), or a list for every head."""
        return self._need().selected_count(layer, seq, kv_head)

    def layer_stats(self, layer: int) -> dict:
        """The library's per-layer decode counters (shadowkv.Cache.layer_stats): head_steps,
        attended_tokens, context_tokens, attended_share, selected_chunks, dense, rank_min/max/mean."""
        return self._need().layer_stats(layer)

    def outliers(self, layer: int, seq: int, kv_head: Optional[int] = None):
        """Outlier chunk ids of (layer, seq) ([O], or [Hk, O])."""
        return self._need().outliers(layer, seq, kv_head)

    def candidates(self, layer: int, seq: int, kv_head: Optional[int] = None):
        """Candidate chunk ids of (layer, seq) ([N - O], or [Hk, N - O])."""
        return self._need().candidates(layer, seq, kv_head)

    def seq_info(self, layer: int, seq: int) -> dict:
        """The library's skv_seq_info of (layer, seq) (with the slot's rank, and dense)."""
        return self._need().seq_info(layer, seq)

    def stats(self) -> dict:
        """The library's phase timings and counters (skv_cache_stats)."""
        return self._need().stats()

    def __repr__(self) -> str:
        return f"ShadowKVCache(layers={len(self.layers)}, skv={self.skv!r})"
