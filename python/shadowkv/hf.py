"""shadowkv.hf: a Hugging Face transformers Cache whose decode attention runs through libshadowkv.

    from transformers import AutoModelForCausalLM
    from shadowkv.hf import ShadowKVCache

    model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.1-8B", torch_dtype=torch.bfloat16).cuda()
    cache = ShadowKVCache(model, batch_size=1, gen_capacity=256)   # budget, rank, ...: config() fields
    out = model.generate(input_ids, max_new_tokens=256, cache=cache)  # past_key_values=cache on 5.17
    cache.selected(layer=0, seq=0)                                   # [Hk, S] chunk ids of the last step

How it works (Llama-family models, transformers 5; tested with 5.17 and 5.24. 5.24 takes the cache
as `cache=`, with `past_key_values=` a deprecated alias; 5.17 only as `past_key_values=`):

- The prompt's forward pass is ordinary dense attention (sdpa) over the prompt's own keys. On
  the way, `update()` prefills every (layer, sequence) of a libshadowkv cache: the library gets
  the post-RoPE keys the model computed (`k_post`, used exactly for landmarks, outliers and
  the local window) and the pre-RoPE keys for the rank-r factorization. The pre-RoPE keys are
  recovered by rotating the post-RoPE keys back, in float32, with the library's own RoPE
  tables. We chose this over capturing k_proj's output with a hook: it needs no hooks on the
  model, it sees any transformation the model applies between k_proj and RoPE, and since the
  library rebuilds selected keys as RoPE(U W) with those same tables, the rebuilt keys
  reproduce the model's post-RoPE keys up to the rank-r truncation and bf16 rounding, even
  where transformers' float32 cos/sin differ from the library's double-built tables at long
  positions, or where a model cast with .to(torch.bfloat16) has had its inv_freq buffer rounded
  to bf16 (transformers then ropes with frequencies off by up to 2^-9 relative). The mapping of
  the model's RoPE (theta, Llama-3 scaling) to the library's config still matters: it is what
  makes the recovered keys the model's pre-RoPE keys, whose low rank the factorization relies on.
- Each decode step (one new token per sequence) goes through `skv_decode`: `update()` keeps the
  new token's key and value, and the attention function registered as "shadowkv" (which the
  cache sets on the model) hands them with the query to the library. For anything that is not
  a decode step of a ShadowKVCache, "shadowkv" attention is transformers' sdpa.

The libshadowkv cache is created at the first prefill, for the batch and prompt length it
sees (at most `batch_size` sequences; `max_prompt_len` defaults to that prompt's length), on
the backend that matches the model's device when `backend="auto"` (cuda for a CUDA model,
else cpu). Not supported (a clear exception): padded batches (all prompts must have the same
length), feeding the prompt in several chunks, beam search and other cache reordering, crop.
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

from . import Cache, ShadowKVError, _ffi, config as _skv_config, validate
from . import ops

__all__ = ["ShadowKVCache", "ATTN_IMPLEMENTATION", "register", "rope_config_for"]

ATTN_IMPLEMENTATION = "shadowkv"
SUPPORTED_MODEL_TYPES = ("llama",)

# per thread: .cache, the cache whose decode step waits for its attention call; .positions, (cache,
# layer, prompt length) whose prompt's positions its attention call checks (transformers 5.17 does not
# pass position_ids to Cache.update, only to the attention function; 5.24 passes them to both)
_active = threading.local()


def _shadowkv_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                        scaling: Optional[float] = None, **kwargs):
    """The "shadowkv" attention implementation: a pending ShadowKVCache decode step of this layer
    goes to skv_decode; everything else (prompts, other caches) is sdpa."""
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


def register() -> None:
    """Registers the "shadowkv" attention (and its mask, sdpa's) with transformers. Idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, _shadowkv_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _text_config(model_or_config):
    cfg = model_or_config.config if isinstance(model_or_config, PreTrainedModel) else model_or_config
    get = getattr(cfg, "get_text_config", None)
    return get(decoder=True) if get else cfg


def rope_config_for(hf_config) -> dict:
    """The library's rope fields for a transformers config: theta, and the Llama-3 scaling
    (factor, low/high frequency factors, original max position) for rope_type "llama3"."""
    rp = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    theta = rp.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("the model config has no rope_theta")
    if float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor {rp['partial_rotary_factor']}: shadowkv.hf maps full-dimension RoPE only")
    out = dict(theta=float(theta), rotary_dim=0, interleaved=0, llama3_scaling=0)
    if rope_type == "llama3":
        out.update(llama3_scaling=1, scaling_factor=float(rp["factor"]),
                   low_freq_factor=float(rp["low_freq_factor"]), high_freq_factor=float(rp["high_freq_factor"]),
                   original_max_position=int(rp["original_max_position_embeddings"]))
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r}: shadowkv.hf maps 'default' and 'llama3' RoPE only")
    return out


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
    """A transformers Cache for Llama-family models with ShadowKV sparse attention in decode.

    ShadowKVCache(model, backend="auto", batch_size=1, max_prompt_len=None, gen_capacity=1024, **fields)

    model: a Llama-family transformers model (or its config; then set its attention with
    model.set_attn_implementation("shadowkv") yourself). Given the model, the cache registers
    the "shadowkv" attention and sets it on the model (sdpa for everything but this cache's
    decode steps). backend: "auto", "ref", "cpu" or "cuda". batch_size: the most sequences one
    generate call may hold. gen_capacity: generated tokens per sequence. fields: any other
    shadowkv.config() field (rank, budget, chunk_size, n_outlier_chunks, n_local_chunks,
    value_device_bytes, n_threads, ...); the model's shape, RoPE and attention scale are taken
    from its config. Raises TypeError for a model that is not Llama-family.
    """

    # the most sequences one generate call may hold (the batch_size argument). A plain attribute here:
    # transformers 5.17 has a read-only, deprecated Cache.max_batch_size property, which this shadows
    max_batch_size: int = 1

    def __init__(self, model, backend: str = "auto", batch_size: int = 1, max_prompt_len: Optional[int] = None,
                 gen_capacity: int = 1024, **fields: Any):
        hf = _text_config(model)
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise TypeError(f"ShadowKVCache supports Llama-family models (model_type {SUPPORTED_MODEL_TYPES}); got "
                            f"{type(model).__name__} with model_type {model_type!r}")
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
        D = getattr(hf, "head_dim", None) or hf.hidden_size // Hq
        self.hf_config = hf
        self.backend_request = backend
        self.max_batch_size = batch_size
        self.max_prompt_len = max_prompt_len
        self.head_dim = D
        self.rope = rope_config_for(hf)
        fields.setdefault("attn_scale", float(D) ** -0.5)  # LlamaAttention.scaling
        self.skv_config = _skv_config(n_layers=L, n_q_heads=Hq, n_kv_heads=Hk, head_dim=D, rope=self.rope,
                                      batch_size=batch_size, gen_capacity=gen_capacity,
                                      backend="cpu" if backend == "auto" else backend, **fields)
        c = self.skv_config
        self.min_prompt_len = (c.n_outlier_chunks + c.budget // max(c.chunk_size, 1) + c.n_local_chunks) * c.chunk_size
        c.max_prompt_len = max_prompt_len if max_prompt_len is not None else max(self.min_prompt_len, 1)
        validate(c)  # a bad field fails here, not in the middle of generate
        super().__init__(layers=[ShadowKVLayer() for _ in range(L)])
        self.skv: Optional[Cache] = None
        self._pending = None
        self._inv_tables = None
        register()
        if isinstance(model, PreTrainedModel) and hf._attn_implementation != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)

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
            raise NotImplementedError(f"ShadowKVCache: after the prompt, tokens come one at a time (got {T} at "
                                      f"layer {layer_idx}); prefill the whole prompt in one forward pass, and "
                                      "call cache.reset() before a new prompt")
        if B != self.skv.batch_size:
            raise ValueError(f"decode with a batch of {B}, but the prompt had {self.skv.batch_size} sequences")
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
                S = c.budget // c.chunk_size
                raise ValueError(
                    f"a prompt of {T} tokens is shorter than the sparse budget needs: at least "
                    f"(n_outlier_chunks + budget / chunk_size + n_local_chunks) * chunk_size = "
                    f"({c.n_outlier_chunks} + {S} + {c.n_local_chunks}) * {c.chunk_size} = {self.min_prompt_len} "
                    "tokens; use a longer prompt, or a smaller budget or n_outlier_chunks")
            if position_ids is not None:
                self._check_positions(position_ids, T)
            self._create(B, T, key_states.device)
            self._inv_tables = None
        elif B != self.skv.batch_size:
            raise ValueError(f"layer {layer_idx}: a batch of {B}, but layer 0's prompt had {self.skv.batch_size}")
        dev = self.skv.device
        if self._inv_tables is None or self._inv_tables[0].shape[0] != T:
            cos, sin = ops.rope_tables(self.skv.config.rope, D, T, device=dev)
            self._inv_tables = (cos, sin)
        cos, sin = self._inv_tables
        k = key_states.to(device=dev, dtype=torch.float32)
        h = D // 2
        x1, x2 = k[..., :h], k[..., h:]
        # the inverse of the library's rotate-half rotation at positions 0..T-1
        k_pre = torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1).to(torch.bfloat16)
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
        self._pending = None
        self._inv_tables = None
        for layer in self.layers:
            layer.reset()

    # -- introspection ---------------------------------------------------------------------------
    def _need(self) -> Cache:
        if self.skv is None:
            raise ValueError("nothing was prefilled yet")
        return self.skv

    def selected(self, layer: int, seq: int, kv_head: Optional[int] = None):
        """Chunk ids selected at the last decode step (int32 CPU tensor [S], or [Hk, S] for every head)."""
        return self._need().selected(layer, seq, kv_head)

    def outliers(self, layer: int, seq: int, kv_head: Optional[int] = None):
        """Outlier chunk ids of (layer, seq) ([O], or [Hk, O])."""
        return self._need().outliers(layer, seq, kv_head)

    def candidates(self, layer: int, seq: int, kv_head: Optional[int] = None):
        """Candidate chunk ids of (layer, seq) ([N - O], or [Hk, N - O])."""
        return self._need().candidates(layer, seq, kv_head)

    def seq_info(self, layer: int, seq: int) -> dict:
        """The library's skv_seq_info of (layer, seq)."""
        return self._need().seq_info(layer, seq)

    def stats(self) -> dict:
        """The library's phase timings and counters (skv_cache_stats)."""
        return self._need().stats()

    def __repr__(self) -> str:
        return f"ShadowKVCache(layers={len(self.layers)}, skv={self.skv!r})"
