"""shadowkv.hf across model families, built from transformers' configs with random weights (nothing
downloaded): Llama with GQA 4 and 8, multi-head (GQA 1) and head dim 256; Qwen2 (q/k/v bias); Mistral;
Phi-3 (fused qkv); partial rotary (Phi-3 with partial_rotary_factor 0.5: RoPE on the first half of the
head dims).

(a) Full rank (rank = Hk*D) and budget "all" (every candidate chunk): the sparse path leaves nothing
out, so the logits of several decode steps, teacher-forced on dense greedy tokens, equal dense
attention's (sdpa with transformers' DynamicCache) within the bf16 tolerance of test_hf.py: 2^-5 of the
largest logit (4 bf16 ulps). Why that much: the library rebuilds the keys as RoPE(U W) from float
factors and rounds them to bf16 (one bf16 ulp from the model's keys at most), and attends in float32
over bf16 keys and values where sdpa attends in bf16; transformers' own eager and sdpa paths differ by
about half of that. A wrong RoPE mapping (theta, rotary_dim), a lost bias or a dropped token shows as
errors of the logits' own size, far above it.
(b) The model-scaled defaults (shadowkv.hf.scaled_config), filled from the dense prefill's keys and
values (ShadowKVCache.prefill_from): the KL divergence against dense and the top-1 agreement are printed
(random weights say little about accuracy; the check is sanity only: finite, KL >= 0).

Prompts of 512 tokens and 6 decode steps on 2-layer models of hidden size 128 keep the module fast.
"""
from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402
from transformers import Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import shadowkv  # noqa: E402
from shadowkv.hf import ShadowKVCache, rope_config_for, scaled_config  # noqa: E402

CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
T, STEPS, VOCAB = 512, 6, 256
# budget "all" and ranks checked against the prompt come with the 0.3 library; before it, the full
# budget is computed for the prompt (N - O chunks)
LIB_03 = shadowkv.has_function("skv_cache_layer_stats_sized")

COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              max_position_embeddings=1024, initializer_range=0.08, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)

# name: (config class, model class, fields)
FAMILIES = {
    "llama-gqa4": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                                       rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "llama-gqa8": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=8, num_key_value_heads=1, head_dim=32,
                                                       rope_parameters=dict(rope_type="default", rope_theta=500000.0))),
    "llama-mha": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                                                      rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "llama-d256": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                                       rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
                                                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
    "mistral": (MistralConfig, MistralForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                                        sliding_window=None)),
    "phi3": (Phi3Config, Phi3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2)),
    "phi3-partial-rotary": (Phi3Config, Phi3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2,
                                                              partial_rotary_factor=0.5)),
}


def build(name: str, seed: int, dtype=torch.bfloat16):
    cfg_cls, model_cls, fields = FAMILIES[name]
    kw = dict(COMMON)
    kw.update(fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg_cls(**kw))
    model.set_attn_implementation("sdpa")
    return model.to(dtype=dtype).eval()


def family_seed(seed: int, name: str) -> int:
    s = (seed * 1000003 + sum(map(ord, name)) * 7919) % (2 ** 31)
    print(f"{name}: model seed {s}")
    return s


def dense_run(model, ids):
    """Dense reference: prefill with sdpa and a DynamicCache, then STEPS greedy tokens. Returns the
    DynamicCache right after the prompt (a copy of its tensors), the greedy tokens [B, STEPS] and the
    logits of every step [STEPS][B, V] (the prompt's last position, then each token but the last)."""
    model.set_attn_implementation("sdpa")
    dc = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(ids, **{CACHE_ARG: dc}, use_cache=True).logits[:, -1].float()]
        prompt_kv = [(l.keys.clone(), l.values.clone()) for l in dc.layers]
        tokens = []
        for _ in range(STEPS - 1):
            tok = logits[-1].argmax(-1, keepdim=True)
            tokens.append(tok)
            logits.append(model(tok, **{CACHE_ARG: dc}, use_cache=True).logits[:, -1].float())
    return prompt_kv, torch.cat(tokens, 1), logits


def sparse_logits(model, cache, ids, tokens, prefilled: bool):
    """The same steps through the ShadowKVCache, teacher-forced on the dense tokens."""
    with torch.no_grad():
        if prefilled:  # filled by prefill_from: the prompt's logits are dense's
            out = [None]
        else:
            out = [model(ids, **{CACHE_ARG: cache}, use_cache=True).logits[:, -1].float()]
        for i in range(tokens.shape[1]):
            out.append(model(tokens[:, i:i + 1], **{CACHE_ARG: cache}, use_cache=True).logits[:, -1].float())
    return out


def full_budget(model) -> dict:
    hf = model.config
    Hk = hf.num_key_value_heads
    D = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    f = dict(rank=Hk * D, chunk_size=8, n_outlier_chunks=4, n_local_chunks=2)
    f["budget"] = "all" if LIB_03 else (T // 8 - 2 - 4) * 8
    return f


@pytest.mark.parametrize("name", list(FAMILIES))
def test_full_rank_all_chunks_is_dense(name, backend, seed):
    model = build(name, family_seed(seed, name))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    _, tokens, want = dense_run(model, ids)
    cache = ShadowKVCache(model, backend=backend, gen_capacity=16, **full_budget(model))
    got = sparse_logits(model, cache, ids, tokens, prefilled=False)
    assert cache.stats()["n_decode_calls"] == model.config.num_hidden_layers * (STEPS - 1)
    worst = 0.0
    for i, (g_, w) in enumerate(zip(got, want)):
        tol = 2 ** -5 * w.abs().max().item()
        err = (g_ - w).abs().max().item()
        worst = max(worst, err / tol)
        assert err <= tol, f"{name} step {i}: logits differ by {err:.4g} > {tol:.4g}"
    print(f"{name} ({backend}): worst logit difference {worst:.2f} of the tolerance")


def kl_top1(got, want):
    kls, agree = [], []
    for g_, w in zip(got, want):
        if g_ is None:
            continue
        p = torch.log_softmax(w, -1)
        q = torch.log_softmax(g_, -1)
        kls.append((p.exp() * (p - q)).sum(-1).mean().item())
        agree.append((g_.argmax(-1) == w.argmax(-1)).float().mean().item())
    return sum(kls) / len(kls), sum(agree) / len(agree)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_scaled_defaults_error_figures(name, seed):
    backend = "cpu"  # the figures, once; (a) covers the backends
    if backend not in shadowkv.hf._ffi.BACKENDS or not shadowkv.backend_available(backend):
        pytest.skip("no cpu backend")
    model = build(name, family_seed(seed, name))
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    prompt_kv, tokens, want = dense_run(model, ids)
    fields = scaled_config(model, T)
    model_cfg = model.config
    cache = ShadowKVCache(model, backend=backend, gen_capacity=16, **fields)
    cache.prefill_from(prompt_kv)
    got = sparse_logits(model, cache, ids, tokens, prefilled=True)
    kl, top1 = kl_top1(got, want)
    print(f"{name}: scaled defaults {fields} (Hk*D = {model_cfg.num_key_value_heads * cache.head_dim}, "
          f"prompt {T}): KL {kl:.3g}, top-1 agreement {top1:.2f} over {STEPS - 1} steps")
    assert kl == kl and kl >= -1e-6 and 0.0 <= top1 <= 1.0


def test_partial_rotary_mapping():
    """partial_rotary_factor maps to the library's rotary_dim, with transformers' frequencies."""
    model = build("phi3-partial-rotary", 5, dtype=torch.float32)
    rc = rope_config_for(model.config)
    D = model.config.hidden_size // model.config.num_attention_heads
    assert rc["rotary_dim"] == D // 2
    cos, sin = shadowkv.ops.rope_tables(shadowkv.ops.rope_config(**rc), D, 2)
    assert cos.shape == (2, D // 4)
    f_lib = torch.atan2(sin[1].double(), cos[1].double())
    f_hf = model.model.rotary_emb.inv_freq.double()
    assert torch.allclose(f_lib, f_hf, rtol=1e-6, atol=0), (f_lib, f_hf)


def test_mistral_sliding_window(backend):
    """A window at least the context is served; a shorter one is refused, naming sliding_window."""
    model = build("mistral", 6)
    fields = {**full_budget(model), "rank": 16}
    model.config.sliding_window = 4096
    ShadowKVCache(model, backend=backend, max_prompt_len=T, gen_capacity=16, **fields)
    model.config.sliding_window = 256
    with pytest.raises(ValueError, match="sliding_window 256"):
        ShadowKVCache(model, backend=backend, max_prompt_len=T, gen_capacity=16, **fields)
    cache = ShadowKVCache(model, backend=backend, gen_capacity=16, **fields)  # length unknown yet
    ids = torch.zeros((1, T), dtype=torch.long)
    with pytest.raises(ValueError, match="sliding_window 256"):
        with torch.no_grad():
            model(ids, **{CACHE_ARG: cache}, use_cache=True)


def test_unservable_models():
    """head_dim over the library's limit, an unknown RoPE scaling, an untested model type: refused."""
    big = LlamaConfig(**{**COMMON, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 2048})
    with pytest.raises(ValueError, match="head_dim 2048"):
        ShadowKVCache(big)
    for rope_type, extra in (("linear", dict(factor=2.0)), ("dynamic", dict(factor=2.0))):
        cfg = LlamaConfig(**{**COMMON, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "rope_parameters": dict(rope_type=rope_type, rope_theta=10000.0, **extra)})
        with pytest.raises(ValueError, match=f"rope_type '{rope_type}'"):
            ShadowKVCache(cfg)
    from transformers import GPT2Config
    with pytest.raises(TypeError, match="model_type 'gpt2'.*allow_model_type"):
        ShadowKVCache(GPT2Config(n_layer=1, n_embd=32, n_head=2))
