"""config(), validate(), memory(), backend_available() and the error types."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import shadowkv
from shadowkv import ShadowKVError


def small(**kw):
    f = dict(n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=32, rank=16, chunk_size=4, budget=16,
             n_outlier_chunks=2, n_local_chunks=2, max_prompt_len=256, gen_capacity=8, backend="ref")
    f.update(kw)
    return shadowkv.config(**f)


def test_defaults_are_the_library_defaults():
    c = shadowkv.config()
    assert c.struct_size == ctypes.sizeof(shadowkv.Config)
    # docs/DESIGN.md section 2: the Llama-3-8B shape
    assert (c.n_layers, c.n_q_heads, c.n_kv_heads, c.head_dim, c.rank) == (32, 32, 8, 128, 160)
    assert (c.chunk_size, c.budget, c.n_outlier_chunks, c.n_local_chunks) == (8, 2048, 48, 4)
    assert (c.batch_size, c.max_prompt_len, c.gen_capacity) == (1, 32768, 1024)
    assert c.rope.theta == 500000.0 and c.rope.llama3_scaling == 0 and c.rope.scaling_factor == 8.0
    assert c.value_device_bytes == shadowkv.VALUES_ALL_DEVICE
    d = shadowkv.config_dict(c)
    assert d["backend"] == "auto" and d["factorize"] == "auto" and d["rope"]["original_max_position"] == 8192
    shadowkv.validate(c)


def test_fields_are_set():
    c = shadowkv.config(n_layers=3, backend="cpu", factorize="exact",
                        rope=dict(theta=10000.0, llama3_scaling=1, scaling_factor=4.0))
    assert c.n_layers == 3 and c.backend == 2 and c.factorize == 3
    assert c.rope.theta == 10000.0 and c.rope.llama3_scaling == 1 and c.rope.scaling_factor == 4.0


def test_config_argument_errors():
    with pytest.raises(ValueError, match="n_layer"):
        shadowkv.config(n_layer=3)
    with pytest.raises(ValueError, match="backend 'gpu'"):
        shadowkv.config(backend="gpu")
    with pytest.raises(ValueError, match="factorize 'svd'"):
        shadowkv.config(factorize="svd")
    with pytest.raises(ValueError, match="rope field 'base'"):
        shadowkv.config(rope=dict(base=1.0))
    with pytest.raises(TypeError, match="config field head_dim"):
        shadowkv.config(head_dim="128")
    with pytest.raises(ValueError, match="struct_size is set by the binding"):
        shadowkv.config(struct_size=8)
    with pytest.raises(TypeError, match="cfg: expected a shadowkv.Config"):
        shadowkv.Cache({"n_layers": 1})
    with pytest.raises(TypeError, match="either a Config or fields"):
        shadowkv.Cache(small(), n_layers=2)
    with pytest.raises(ValueError, match="arrays 'list'"):
        shadowkv.Cache(small(), arrays="list")


@pytest.mark.parametrize("field,value,status", [
    ("head_dim", 3, "SKV_ERR_INVALID_CONFIG"),
    ("n_kv_heads", 3, "SKV_ERR_INVALID_CONFIG"),
    ("budget", 15, "SKV_ERR_INVALID_CONFIG"),
    ("rank", 10 ** 6, "SKV_ERR_INVALID_CONFIG"),
    ("chunk_size", 0, "SKV_ERR_INVALID_CONFIG"),
])
def test_invalid_config_carries_the_library_message(field, value, status):
    cfg = small(**{field: value})
    with pytest.raises(ShadowKVError) as e:
        shadowkv.validate(cfg)
    assert e.value.status_name == status and e.value.call == "skv_config_validate"
    assert field in e.value.message, e.value.message  # the library's message names the field
    assert field in str(e.value)
    with pytest.raises(ShadowKVError) as e2:
        shadowkv.Cache(cfg)
    assert e2.value.status_name == status and e2.value.call == "skv_cache_create" and field in e2.value.message
    with pytest.raises(ShadowKVError):
        shadowkv.memory(cfg)


def test_memory_matches_placement():
    cfg = small(batch_size=2)
    m = shadowkv.memory(cfg)
    assert m["device_bytes"] > 0 and m["host_bytes"] == 0
    assert m["device_value_slots"] == 4 and m["host_value_slots"] == 0
    # every value store on the host but the chunk caches: all slots host-placed
    cfg.value_device_bytes = 0
    cfg.value_cache_chunks = 0
    with pytest.raises(ShadowKVError) as e:  # a budget below the chunk caches of all slots
        shadowkv.memory(cfg)
    assert e.value.status_name == "SKV_ERR_INVALID_CONFIG"
    cfg.value_device_bytes = 4 * m["value_cache_bytes"] + 1
    m2 = shadowkv.memory(cfg)
    assert m2["host_value_slots"] == 4 and m2["host_bytes"] == 4 * m2["value_store_bytes"]


def test_backends_available():
    assert shadowkv.backend_available("ref") and shadowkv.backend_available("cpu")
    assert shadowkv.backend_available("auto")
    with pytest.raises(ValueError, match="backend 'gpu'"):
        shadowkv.backend_available("gpu")


def test_cuda_unavailable_is_a_clear_error(kind):
    if shadowkv.backend_available("cuda"):
        pytest.skip("cuda is available here")
    with pytest.raises(ShadowKVError) as e:
        shadowkv.Cache(small(backend="cuda"))
    assert e.value.status_name == "SKV_ERR_NO_DEVICE" and e.value.message  # the reason
    from shadowkv import ops
    from skvtest import Arrays
    arr = Arrays(kind)
    q, k = arr.bf16(np.zeros((4, 32), dtype=np.float32)), arr.bf16(np.zeros((3, 2, 32), dtype=np.float32))
    if kind == "torch":
        with pytest.raises(ShadowKVError) as e:
            ops.full_attention(q, k, k, backend="cuda")
        assert e.value.status_name == "SKV_ERR_NO_DEVICE"
    else:  # numpy arrays are host memory: refused before the library is asked
        with pytest.raises(ValueError, match="numpy array .* cuda, which takes torch CUDA tensors"):
            ops.full_attention(q, k, k, backend="cuda")


def test_auto_resolves():
    c = shadowkv.Cache(small(backend="auto"))
    assert c.backend == ("cuda" if shadowkv.backend_available("cuda") else "cpu")
    c.close()
    c.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        c.stats()


# ---- 0.3 fields, names and the model-scaled defaults ----------------------------------------------

LIB_03 = shadowkv.has_function("skv_cache_layer_stats_sized")


def test_select_and_rank_fields_by_name():
    c = shadowkv.config(select_mode="mass", select_mass=0.9, select_min_chunks=3, budget="all", rank=0, rank_max=48,
                        rank_error_target=0.2, dense_layers=[0, 2])
    assert c.select_mode == 1 and abs(c.select_mass - 0.9) < 1e-7 and c.select_min_chunks == 3
    assert c.budget == shadowkv.BUDGET_ALL == -1 and c.rank == 0 and c.rank_max == 48 and c.dense_layers == 0b101
    d = shadowkv.config_dict(c)
    assert d["select_mode"] == "mass" and d["dense_layers"] == 5
    assert shadowkv.config(select_mode="fixed").select_mode == 0
    assert shadowkv.config(dense_layers=1 << 63).dense_layers == 1 << 63  # the uint64's top bit
    for bad, match in ((dict(select_mode="topp"), "select_mode 'topp'"), (dict(budget="most"), "budget 'most'"),
                       (dict(dense_layers=[64]), "dense_layers: layer 64")):
        with pytest.raises(ValueError, match=match):
            shadowkv.config(**bad)


def test_library_defaults_of_the_new_fields():
    c = shadowkv.config()
    if not LIB_03:  # the 0.3 header's struct with a library whose defaults predate it: zeros
        pytest.skip("the loaded library lacks skv_cache_layer_stats_sized (0.3 defaults come with it)")
    assert c.select_mode == 0 and abs(c.select_mass - 0.95) < 1e-7 and c.select_min_chunks == 0
    assert c.rank_max == 0 and abs(c.rank_error_target - 0.1) < 1e-7 and c.dense_layers == 0


@pytest.mark.skipif(not LIB_03, reason="the loaded library lacks skv_cache_layer_stats_sized: the 0.3 validation "
                                       "(rank checked against the prompt, budget 'all') comes with it")
def test_rank_is_checked_against_the_prompt_not_the_config():
    # rank 192 with budget 128 was refused at validation ("the shortest valid prompt = 184")
    c = small(n_q_heads=8, n_kv_heads=8, head_dim=32, rank=192, budget=128, chunk_size=8, n_outlier_chunks=4, n_local_chunks=2,
              max_prompt_len=4096)
    shadowkv.validate(c)
    shadowkv.validate(small(budget="all"))
    with pytest.raises(ShadowKVError, match="dense_layers"):
        shadowkv.validate(small(dense_layers=[5]))


def test_scaled_config_rule():
    # upstream's setting at its own shape: Hk*D = 1024 at 128k tokens
    f = shadowkv.scaled_config(8, 128, 131072)
    assert (f["rank"], f["budget"], f["n_outlier_chunks"], f["n_local_chunks"], f["chunk_size"]) == (160, 2048, 48, 4, 8)
    for Hk, D, n in ((3, 64, 2048), (3, 64, 4096), (3, 64, 8192), (1, 64, 512), (8, 128, 4096), (1, 256, 1024),
                     (2, 32, 128)):
        for mode in ("fixed", "mass"):
            f = shadowkv.scaled_config(Hk, D, n, select_mode=mode)
            c = shadowkv.config(n_layers=2, n_q_heads=Hk * 2, n_kv_heads=Hk, head_dim=D, max_prompt_len=n, **f)
            assert 0 < f["rank"] <= Hk * D and f["budget"] % f["chunk_size"] == 0
            assert shadowkv.min_prompt_len(c) <= n, (Hk, D, n, mode, f)
            if mode == "fixed" or LIB_03:
                shadowkv.validate(c)
    # the rescoring by default (4 S candidates), off on request
    f = shadowkv.scaled_config(3, 64, 4096)
    assert f["select_candidates"] == 4 * f["budget"] // f["chunk_size"]
    assert "select_candidates" not in shadowkv.scaled_config(3, 64, 4096, rescore=False)
    f = shadowkv.scaled_config(3, 64, 4096, select_mode="mass")
    assert f["budget"] == f["select_candidates"] * f["chunk_size"] and abs(f["select_mass"] - 0.9) < 1e-9
    # the budget grows with the context, the rank with the keys' width
    assert shadowkv.scaled_config(3, 64, 8192)["budget"] > shadowkv.scaled_config(3, 64, 2048)["budget"]
    assert shadowkv.scaled_config(8, 128, 4096)["rank"] > shadowkv.scaled_config(3, 64, 4096)["rank"]
    f = shadowkv.scaled_config(3, 64, 4096, adaptive_rank=True, n_layers=30, n_dense_layers=2)
    assert f["rank"] == 0 and 0 < f["rank_max"] <= 192 and f["dense_layers"] == 3
    with pytest.raises(ValueError, match="n_dense_layers"):
        shadowkv.scaled_config(3, 64, 4096, n_dense_layers=2)
    with pytest.raises(ValueError, match="context_len"):
        shadowkv.scaled_config(3, 64, 0)


# ---- 0.4: the rescoring (docs/DESIGN.md 4.5.1) ----------------------------------------------------

def test_select_candidates_field():
    assert shadowkv.config().select_candidates == 0
    c = small(budget=64, chunk_size=8, select_candidates=12)
    assert c.select_candidates == 12 and shadowkv.config_dict(c)["select_candidates"] == 12
    shadowkv.validate(c)
    with pytest.raises(ShadowKVError, match="select_candidates = 7"):   # below S = 64 / 8
        shadowkv.validate(small(budget=64, chunk_size=8, select_candidates=7))
    with pytest.raises(ShadowKVError, match="select_candidates = -1"):
        shadowkv.validate(small(select_candidates=-1))
    with pytest.raises(ShadowKVError, match="factorize"):              # its keys need the canonical factors
        shadowkv.validate(small(budget=64, chunk_size=8, select_candidates=12, factorize="fast"))
    shadowkv.validate(small(budget="all", select_candidates=1))


def test_value_dtype_field():
    """value_dtype (0.6): names or numbers, the library's check, and half the value bytes with fp8."""
    assert shadowkv.config().value_dtype == 0
    c = small(value_dtype="fp8")
    assert c.value_dtype == 1 and shadowkv.config_dict(c)["value_dtype"] == "fp8"
    assert small(value_dtype=0).value_dtype == 0 and shadowkv.config_dict(small())["value_dtype"] == "bf16"
    shadowkv.validate(c)
    for bad in ("fp16", 2, True):
        with pytest.raises(ValueError, match="value_dtype"):
            small(value_dtype=bad)
    c.value_dtype = 5                                                    # past the binding: the library refuses
    with pytest.raises(ShadowKVError, match="value_dtype = 5"):
        shadowkv.validate(c)
    m16, m8 = shadowkv.memory(small()), shadowkv.memory(small(value_dtype="fp8"))
    # a store of [Hk, N - O] records: bf16 c D 2 bytes, fp8 c D codes + 16 bytes of exponents (c = 4), 256-aligned
    n_rec = 2 * (256 // 4 - 2 - 2)
    assert m16["value_store_bytes"] == (n_rec * 4 * 32 * 2 + 255) // 256 * 256
    assert m8["value_store_bytes"] == (n_rec * (4 * 32 + 16) + 255) // 256 * 256
    assert m8["device_bytes"] < m16["device_bytes"]


@pytest.mark.parametrize("backend", ["ref", "cpu"])
def test_fp8_cache_decodes_and_selects_as_bf16(backend):
    """An fp8 cache selects what a bf16 cache selects; its outputs stay within the fp8 step."""
    rng = np.random.default_rng(20261206)
    print("seed 20261206")
    n, Hq, Hk, D = 200, 4, 2, 32
    k = rng.standard_normal((n, Hk, D)).astype(np.float32)
    v = rng.standard_normal((n, Hk, D)).astype(np.float32)
    outs, sels = [], []
    for dt in ("bf16", "fp8"):
        cache = shadowkv.Cache(small(n_layers=1, backend=backend, value_dtype=dt))
        cache.prefill(0, 0, k, v)
        q = rng.standard_normal((1, Hq, D)).astype(np.float32) if dt == "bf16" else q
        kn = rng.standard_normal((1, Hk, D)).astype(np.float32) if dt == "bf16" else kn
        vn = rng.standard_normal((1, Hk, D)).astype(np.float32) if dt == "bf16" else vn
        outs.append(np.array(cache.decode(0, q, kn, vn)))
        sels.append([list(cache.selected(0, 0, h)) for h in range(Hk)])
        cache.close()
    assert sels[0] == sels[1]
    assert np.abs(outs[1] - outs[0]).max() <= 0.125 * np.abs(outs[0]).max()
