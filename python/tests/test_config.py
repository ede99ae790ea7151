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
