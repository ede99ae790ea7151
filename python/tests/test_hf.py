"""shadowkv.hf: the transformers Cache on a small Llama built in code (random weights, nothing
downloaded), on each backend: (a) with rank = Hk*D and a budget covering the whole context, the
logits of 16 generated tokens match transformers' DynamicCache within bf16 tolerance; (b) with
the library's default sparse settings, generation runs and the selections are introspectable;
(c) bad use gives a clear exception. Plus the RoPE mapping (Llama-3 scaling included)."""
from __future__ import annotations

import inspect
import math
import warnings

import pytest

torch = pytest.importorskip("torch")  # the [hf] extra: torch and transformers (make check SKV_PYTORCH=1)
transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LlamaModel  # noqa: E402

import shadowkv  # noqa: E402
from shadowkv import ops  # noqa: E402
from shadowkv.hf import ShadowKVCache, rope_config_for  # noqa: E402

# the keyword that hands a model (and generate) its cache: `cache` in transformers 5.24 (where
# `past_key_values` is a deprecated alias), `past_key_values` in 5.17 (which does not know `cache`)
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_arg(cache) -> dict:
    return {CACHE_ARG: cache}


LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)  # small, so the scaling acts within these prompts


def tiny_llama(seed, device, dtype=torch.bfloat16, rope=LLAMA3_ROPE, **kw):
    f = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=8192, initializer_range=0.08,
             rope_parameters=dict(rope), attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
    f.update(kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**f))
    return model.to(device=device, dtype=dtype).eval()


def prompt(gen, B, T, device, vocab=256):
    return torch.randint(0, vocab, (B, T), generator=gen).to(device)


def dense_logits(model, ids, tokens):
    """Teacher-forced logits with transformers' DynamicCache and sdpa: the prompt's last position,
    then one step per token of `tokens` but the last ([B, n] -> n logits [B, vocab])."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        dc = DynamicCache(config=model.config)
        with torch.no_grad():
            out = [model(ids, **cache_arg(dc), use_cache=True).logits[:, -1]]
            for i in range(tokens.shape[1] - 1):
                out.append(model(tokens[:, i:i + 1], **cache_arg(dc), use_cache=True).logits[:, -1])
    finally:
        model.set_attn_implementation(impl)
    return out


# ---- RoPE mapping ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rope", [LLAMA3_ROPE, dict(rope_type="default", rope_theta=10000.0)], ids=["llama3", "default"])
def test_rope_mapping(rope):
    """The library's RoPE tables for the mapped config have the model's frequencies, and the library's
    rotation of k_proj's output is the model's post-RoPE key."""
    # float32: model.to(torch.bfloat16) would also round transformers' inv_freq buffer to bf16
    model = tiny_llama(1, "cpu", dtype=torch.float32, rope=rope)
    rc = ops.rope_config(**rope_config_for(model.config))
    assert rc.llama3_scaling == (rope["rope_type"] == "llama3")
    D = model.config.head_dim
    cos, sin = ops.rope_tables(rc, D, 2)
    f_lib = torch.atan2(sin[1].double(), cos[1].double())  # position 1: the angle is f_i itself (< pi)
    f_hf = model.model.rotary_emb.inv_freq.double()
    assert torch.allclose(f_lib, f_hf, rtol=1e-6, atol=0), (f_lib, f_hf)
    # k_proj's output, roped by the library, against the keys the model hands its cache
    T = 200
    captured = {}
    h = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, i, o: captured.setdefault("k", o))
    dc = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.arange(T)[None] % 256, **cache_arg(dc), use_cache=True)
    h.remove()
    k_pre = captured["k"][0].view(T, -1, D).to(torch.bfloat16)
    k_post_hf = dc.layers[0].keys[0].transpose(0, 1)  # [T, Hk, D]
    cos, sin = ops.rope_tables(rc, D, T)
    k_post = ops.rope(k_pre.contiguous(), 0, cos, sin, rc, backend="ref")
    diff = (k_post.float() - k_post_hf.float()).abs().max().item()
    assert diff <= 2 ** -6 * k_post_hf.float().abs().max().item(), diff  # a bf16 ulp or two
    if rope["rope_type"] == "llama3":  # without the scaling the rotation is visibly different
        plain = ops.rope_config(theta=rc.theta)
        c2, s2 = ops.rope_tables(plain, D, T)
        wrong = ops.rope(k_pre.contiguous(), 0, c2, s2, plain, backend="ref")
        assert (wrong.float() - k_post_hf.float()).abs().max().item() > 20 * diff


def test_unsupported_rope():
    cfg = LlamaConfig(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                           original_max_position_embeddings=2048))
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ShadowKVCache(cfg)


# ---- (a) full rank and a budget covering the context: the dense result -----------------------------

def full_budget_cache(model, backend, batch_size=1, T=160):
    c, O, Lc = 8, 4, 2
    N = T // c - Lc
    hf = model.config
    return ShadowKVCache(model, backend=backend, batch_size=batch_size, rank=hf.num_key_value_heads * hf.head_dim,
                         chunk_size=c, n_outlier_chunks=O, n_local_chunks=Lc, budget=(N - O) * c, gen_capacity=32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_full_budget_matches_dynamic_cache(backend, device, gen, dtype):
    model = tiny_llama(2, device, dtype=dtype)
    T, B, new = 160, 2, 17  # 17 new tokens: the prompt's logits, then 16 from skv_decode steps
    ids = prompt(gen, B, T, device)
    cache = full_budget_cache(model, backend, batch_size=B, T=T)
    out = model.generate(ids, max_new_tokens=new, do_sample=False, **cache_arg(cache), output_logits=True,
                         return_dict_in_generate=True)
    assert model.config._attn_implementation == "shadowkv"
    assert cache.skv.backend == backend
    st = cache.stats()
    assert st["n_prefill_calls"] == 2 * B and st["n_decode_calls"] == 2 * (new - 1)
    assert cache.get_seq_length() == T + new - 1
    tokens = out.sequences[:, T:]
    ref = dense_logits(model, ids, tokens)
    # the prompt is dense attention in both (generate computes the last position's logits alone)
    assert torch.allclose(out.logits[0].float(), ref[0].float(), rtol=0, atol=1e-5 * ref[0].float().abs().max())
    worst = 0.0
    for i, (got, want) in enumerate(zip(out.logits, ref)):
        got, want = got.float(), want.float()
        # bf16 tolerance: 4 bf16 ulps of the largest logit (2^-5 relative); transformers' own eager and
        # sdpa paths differ by about half of that on this model
        tol = 2 ** -5 * want.abs().max().item()
        err = (got - want).abs().max().item()
        worst = max(worst, err / tol)
        assert err <= tol, f"token {i}: logits differ by {err} > {tol}"
    print(f"worst logit difference: {worst:.2f} of the tolerance")
    # and the tokens are the dense greedy ones, but where the dense top-2 margin is within the tolerance
    dense = model.generate(ids, max_new_tokens=new, do_sample=False,
                           **cache_arg(DynamicCache(config=model.config)))
    for b in range(B):
        diff = (dense[b, T:] != tokens[b]).nonzero()
        if len(diff):
            i = diff[0].item()
            top2 = ref[i][b].float().topk(2).values
            assert (top2[0] - top2[1]).item() <= 2 * 2 ** -5 * ref[i][b].float().abs().max().item()


# ---- (b) default sparse settings -----------------------------------------------------------------

def test_sparse_generation_is_introspectable(backend, device, gen):
    # rank 160 of the defaults needs Hk*D >= 160: 4 KV heads of 64
    model = tiny_llama(3, device, hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                       intermediate_size=512)
    d = shadowkv.config()
    T = (d.n_outlier_chunks + d.budget // d.chunk_size + d.n_local_chunks) * d.chunk_size + 100  # 2564
    ids = prompt(gen, 1, T, device)
    cache = ShadowKVCache(model, backend=backend, gen_capacity=64)  # the library's default sparse settings
    c = cache.skv_config
    assert (c.rank, c.budget, c.chunk_size, c.n_outlier_chunks, c.n_local_chunks) == (160, 2048, 8, 48, 4)
    new = 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache)  # the spelling
    assert out.shape == (1, T + new)
    S, O = c.budget // c.chunk_size, c.n_outlier_chunks
    N = T // c.chunk_size - c.n_local_chunks
    for layer in range(model.config.num_hidden_layers):
        info = cache.seq_info(layer, 0)
        assert info["n"] == T and info["n_generated"] == new - 1 and info["has_selection"] == 1
        sel = cache.selected(layer, 0)
        assert sel.shape == (model.config.num_key_value_heads, S) and sel.dtype == torch.int32
        cand, outl = cache.candidates(layer, 0), cache.outliers(layer, 0)
        assert outl.shape == (4, O) and cand.shape == (4, N - O)
        for h in range(sel.shape[0]):
            assert torch.all(sel[h][1:] > sel[h][:-1]) and bool(torch.isin(sel[h], cand[h]).all())
    assert cache.stats()["n_decode_calls"] == 2 * (new - 1)
    # the same prompt through a fresh cache gives the same tokens (the run is deterministic)
    cache.reset()
    again = model.generate(ids, max_new_tokens=new, do_sample=False, **cache_arg(cache))
    assert torch.equal(again, out)


# ---- (c) bad use -----------------------------------------------------------------------------------

def test_not_a_llama():
    from transformers import GPT2Config, GPT2LMHeadModel
    with torch.random.fork_rng(devices=[]):
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0,
                                          eos_token_id=0))
    with pytest.raises(TypeError, match=r"model_type 'gpt2': ShadowKVCache is tested with"):
        ShadowKVCache(gpt2)


def test_bad_use(backend, device, gen):
    model = tiny_llama(4, device)
    ids = prompt(gen, 2, 160, device)
    with pytest.raises(ValueError, match=r"a batch of 2 sequences is larger than the cache \(batch_size=1\)"):
        model.generate(ids, max_new_tokens=3, do_sample=False,
                       **cache_arg(full_budget_cache(model, backend, batch_size=1)))
    with pytest.raises(ValueError, match=r"a prompt of 100 tokens is shorter than the config needs: at least 160 tokens"):
        model.generate(ids[:, :100], max_new_tokens=3, do_sample=False,
                       **cache_arg(full_budget_cache(model, backend, 2)))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    with pytest.raises(ValueError, match="unpadded prompts"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                       **cache_arg(full_budget_cache(model, backend, 2)))
    with pytest.raises(NotImplementedError, match="beam search"):
        model.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False,
                       **cache_arg(full_budget_cache(model, backend, 4)))
    with pytest.raises(shadowkv.ShadowKVError, match="rank"):  # a bad field fails at construction
        ShadowKVCache(model, backend=backend, rank=10 ** 6)
    with pytest.raises(TypeError, match="n_layers: taken from the model"):
        ShadowKVCache(model, backend=backend, n_layers=3)
    # the model's attention switched away from "shadowkv": refused, not silently wrong
    cache = full_budget_cache(model, backend, 2)
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="set_attn_implementation"):
        model(ids, **cache_arg(cache), use_cache=True)
    # a cache after a failed call is reset and reused
    cache = full_budget_cache(model, backend, 2)
    with pytest.raises(RuntimeError, match="second prefill"):
        with torch.no_grad():
            model(ids, **cache_arg(cache), use_cache=True)
            model(ids[:, :2], **cache_arg(cache), use_cache=True)
    cache.reset()
    out = model.generate(ids, max_new_tokens=3, do_sample=False, **cache_arg(cache))
    assert out.shape == (2, 163)


# ---- driving the cache from outside ----------------------------------------------------------------

LIB_03 = shadowkv.has_function("skv_cache_layer_stats_sized")
NEEDS_03 = pytest.mark.skipif(not LIB_03, reason="the loaded library lacks skv_cache_layer_stats_sized: budget 'all', "
                                                  "per-head counts and layer stats come with the 0.3 library")


def test_register_keeps_a_users_attention():
    """A function the user registered under "shadowkv" (wrapping shadowkv_attention) stays registered
    when a ShadowKVCache is built; register(force=True) puts the library's back."""
    from transformers import AttentionInterface
    import shadowkv.hf as skvhf
    calls = []

    def mine(module, query, key, value, attention_mask, **kw):
        calls.append(query.shape[2])
        return skvhf.shadowkv_attention(module, query, key, value, attention_mask, **kw)
    AttentionInterface.register("shadowkv", mine)
    try:
        model = tiny_llama(7, "cpu")
        cache = full_budget_cache(model, "cpu")
        assert AttentionInterface._global_mapping["shadowkv"] is mine
        ids = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(7))
        out = model.generate(ids, max_new_tokens=3, do_sample=False, **cache_arg(cache))
        assert out.shape == (1, 163) and calls.count(1) == 2 * 2 and cache.stats()["n_decode_calls"] == 4
    finally:
        skvhf.register(force=True)
    assert AttentionInterface._global_mapping["shadowkv"] is skvhf.shadowkv_attention


def test_prefill_from_dense_keys(backend, device, gen):
    """One dense prefill fills several caches (prefill_from a DynamicCache or per-layer pairs); decoding
    then goes through the library with the same results as a cache prefilled by the model's forward."""
    model = tiny_llama(8, device)
    T = 160
    ids = prompt(gen, 1, T, device)
    tok = prompt(gen, 1, 4, device)
    dc = DynamicCache(config=model.config)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        model(ids, **cache_arg(dc), use_cache=True)

    def steps(cache):
        with torch.no_grad():
            return [model(tok[:, i:i + 1], **cache_arg(cache), use_cache=True).logits[:, -1] for i in range(4)]
    a = full_budget_cache(model, backend)
    a.prefill_from(dc)
    b = full_budget_cache(model, backend)
    b.prefill_from([(l.keys, l.values) for l in dc.layers])
    c = full_budget_cache(model, backend)
    with torch.no_grad():
        model(ids, **cache_arg(c), use_cache=True)
    ra, rb, rc = steps(a), steps(b), steps(c)
    for x, y, z in zip(ra, rb, rc):
        assert torch.equal(x, y) and torch.equal(x, z)
    assert a.get_seq_length() == T + 4 and a.stats()["n_prefill_calls"] == 2
    with pytest.raises(RuntimeError, match="second prefill"):
        a.prefill_from(dc)
    with pytest.raises(ValueError, match="kv: 1 layers, the model has 2"):
        full_budget_cache(model, backend).prefill_from(list(zip([dc.layers[0].keys], [dc.layers[0].values])))


def test_gen_capacity_is_refused_by_name(backend, device, gen):
    model = tiny_llama(9, device)
    ids = prompt(gen, 1, 160, device)
    c, O, Lc = 8, 4, 2
    cache = ShadowKVCache(model, backend=backend, rank=64, chunk_size=c, n_outlier_chunks=O, n_local_chunks=Lc,
                          budget=(160 // c - Lc - O) * c, gen_capacity=3)
    with torch.no_grad():
        model(ids, **cache_arg(cache), use_cache=True)
        for i in range(3):
            model(ids[:, i:i + 1], **cache_arg(cache), use_cache=True)
        with pytest.raises(ValueError, match="gen_capacity 3"):
            model(ids[:, :1], **cache_arg(cache), use_cache=True)


def test_min_prompt_len_follows_the_mode():
    model = tiny_llama(10, "cpu")
    base = dict(chunk_size=8, n_outlier_chunks=4, n_local_chunks=2, rank=16)
    assert ShadowKVCache(model, budget=64, **base).min_prompt_len == (4 + 8 + 2) * 8
    mass = dict(budget=64, select_mode="mass", select_min_chunks=3, **base)
    assert shadowkv.min_prompt_len(shadowkv.config(**mass)) == (4 + 3 + 2) * 8
    if LIB_03:  # the library before 0.3 validates every mode as fixed
        assert ShadowKVCache(model, **mass).min_prompt_len == (4 + 3 + 2) * 8
    assert shadowkv.min_prompt_len(shadowkv.config(budget="all", **base)) == (4 + 1 + 2) * 8
    assert shadowkv.min_prompt_len(shadowkv.config(budget="all", dense_layers=[0], **base), layer=0) == 1
    assert shadowkv.min_prompt_len(shadowkv.config(budget=64, **{**base, "rank": 200})) == 200


@NEEDS_03
def test_budget_all_and_the_selection_api(backend, device, gen):
    """budget "all": every candidate is selected at every step, whatever the prompt's length; the
    introspection gives the k selected ids per head, the counts and the layer stats."""
    model = tiny_llama(11, device)
    hf = model.config
    for T in (96, 200):
        ids = prompt(gen, 1, T, device)
        cache = ShadowKVCache(model, backend=backend, rank=hf.num_key_value_heads * hf.head_dim, budget="all",
                              chunk_size=8, n_outlier_chunks=4, n_local_chunks=2, gen_capacity=8)
        model.generate(ids, max_new_tokens=3, do_sample=False, **cache_arg(cache))
        for layer in range(hf.num_hidden_layers):
            info = cache.seq_info(layer, 0)
            n_cand = info["n_candidates"]
            assert info["rank"] == hf.num_key_value_heads * hf.head_dim and info["dense"] == 0
            assert cache.selected_count(layer, 0) == [n_cand] * hf.num_key_value_heads
            sel = cache.selected(layer, 0, 0)
            assert torch.equal(sel, cache.candidates(layer, 0, 0))
            padded = cache.selected(layer, 0, 0, pad=True)
            assert padded.shape[0] == info["n_selected"] and bool((padded[n_cand:] == -1).all())
            st = cache.layer_stats(layer)
            assert st["head_steps"] == 2 * hf.num_key_value_heads and st["dense"] == 0
            assert st["selected_chunks"] == st["head_steps"] * n_cand
            assert 0.0 < st["attended_share"] <= 1.0


@NEEDS_03
def test_dense_layers_and_mass_mode(backend, device, gen):
    model = tiny_llama(12, device)
    ids = prompt(gen, 1, 200, device)
    cache = ShadowKVCache(model, backend=backend, rank=32, budget=96, chunk_size=8, n_outlier_chunks=4,
                          n_local_chunks=2, select_mode="mass", select_mass=0.9, select_min_chunks=2,
                          dense_layers=[0], gen_capacity=8)
    model.generate(ids, max_new_tokens=4, do_sample=False, **cache_arg(cache))
    assert cache.seq_info(0, 0)["dense"] == 1 and cache.layer_stats(0)["dense"] == 1
    with pytest.raises(shadowkv.ShadowKVError, match="dense"):
        cache.selected(0, 0, 0)
    counts = cache.selected_count(1, 0)
    assert all(2 <= k <= 12 for k in counts)
    for h, k in enumerate(counts):
        assert cache.selected(1, 0, h).shape == (k,)


@NEEDS_03
def test_rescored_selection(backend, device, gen):
    """select_candidates: each head's chunks come from its landmark-best candidates, ranked by their rebuilt
    keys; counts and sets are ref's bit for bit (the contract covers the rescoring)."""
    model = tiny_llama(14, device)
    ids = prompt(gen, 1, 240, device)
    kw = dict(rank=32, budget=48, chunk_size=8, n_outlier_chunks=4, n_local_chunks=2, select_candidates=10,
              gen_capacity=8)
    runs = {}
    for be in dict.fromkeys(["ref", backend]):
        for mode in ("fixed", "mass"):
            extra = dict(select_mode="mass", select_mass=0.9, select_min_chunks=2, budget="all") if mode == "mass" else {}
            cache = ShadowKVCache(model, backend=be, **dict(kw, **extra))
            model.generate(ids, max_new_tokens=3, do_sample=False, **cache_arg(cache))
            counts = cache.selected_count(1, 0)
            sets = [cache.selected(1, 0, h).tolist() for h in range(len(counts))]
            assert all((k == 6) if mode == "fixed" else (2 <= k <= 10) for k in counts), counts
            runs[be, mode] = (list(counts), sets)
    for mode in ("fixed", "mass"):
        assert runs[backend, mode] == runs["ref", mode]


@NEEDS_03
def test_rank_per_slot(backend, device, gen):
    """rank 0: each (layer, sequence) takes its own rank up to rank_max; seq_info and layer_stats report it."""
    model = tiny_llama(13, device)
    hf = model.config
    ids = prompt(gen, 1, 200, device)
    cache = ShadowKVCache(model, backend=backend, rank=0, rank_max=hf.num_key_value_heads * hf.head_dim,
                          rank_error_target=0.3, budget=64, chunk_size=8, n_outlier_chunks=4, n_local_chunks=2,
                          gen_capacity=8)
    model.generate(ids, max_new_tokens=2, do_sample=False, **cache_arg(cache))
    for layer in range(hf.num_hidden_layers):
        r = cache.seq_info(layer, 0)["rank"]
        st = cache.layer_stats(layer)
        assert 1 <= r <= hf.num_key_value_heads * hf.head_dim
        assert st["n_prefilled"] == 1 and st["rank_min"] == st["rank_max"] == r and st["rank_mean"] == r
