"""Tensor parallelism through torch.distributed (docs/tensor-parallel.md): examples/tp_decode.py
launched with torchrun on the loopback address, one process per head shard, gloo on the CPU.

Each rank decodes with its head-shard cache (shadowkv.shard_config) and all-reduces its partial
output projection; the example then checks, on rank 0, that every rank's attention outputs are
bitwise those of the same shards run in one process, and the hidden states the all-reduce gives
(bitwise with 2 ranks, within 1e-6 with 4). The shard helpers are checked here too.
"""
import os
import subprocess
import sys

import pytest

import shadowkv

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYDIR)


def test_shard_config_fields():
    cfg = shadowkv.config(n_q_heads=32, n_kv_heads=8, head_dim=128, rank=160)
    for s in (1, 2, 4, 8):
        for i in range(s):
            c = shadowkv.shard_config(cfg, s, i)
            assert (c.n_q_heads, c.n_kv_heads) == (32 // s, 8 // s)
            assert (c.model_kv_heads, c.kv_head_begin) == (8, i * (8 // s))
            assert c.rank == min(160, (8 // s) * 128)  # the model's rank capped at the shard's width
            assert shadowkv.shard_config(cfg, s, i, rank="split").rank == min(-(-160 // s), (8 // s) * 128)
            h = shadowkv.shard_heads(c)
            assert h["kv"] == slice(i * 8 // s, (i + 1) * 8 // s) and h["q"] == slice(i * 32 // s, (i + 1) * 32 // s)
            shadowkv.validate(c)
    assert shadowkv.shard_heads(cfg) == {"kv": slice(0, 8), "q": slice(0, 32)}
    for bad in ((3, 0), (2, 2), (0, 0)):
        with pytest.raises(ValueError):
            shadowkv.shard_config(cfg, *bad)
    with pytest.raises(ValueError, match="already a head shard"):
        shadowkv.shard_config(shadowkv.shard_config(cfg, 2, 0), 2, 0)
    bad = shadowkv.shard_config(cfg, 2, 1)
    bad.kv_head_begin = 5  # KV heads 5..8 of 8: past the model's
    with pytest.raises(shadowkv.ShadowKVError, match="head shard"):
        shadowkv.validate(bad)


@pytest.mark.parametrize("ranks", [2, 4])
def test_tp_decode_gloo(ranks):
    pytest.importorskip("torch")
    if not shadowkv.backend_available("cpu"):
        pytest.skip("the cpu backend is not available")
    env = dict(os.environ, PYTHONPATH=PYDIR + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    env.setdefault("SHADOWKV_LIBRARY", shadowkv.library_path())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
           os.path.join(REPO, "examples", "tp_decode.py"), "--cpu", "--small", "--steps", "6"]
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert f"[rank 0/{ranks}] PASS" in out, out[-6000:]
    assert "bitwise equal to the single-process run's: True" in out, out[-6000:]


def test_shard_snapshot_keeps_its_range(tmp_path):
    """A shard's snapshot names its range (format version 4); Python reads it back, and loading it
    as another shard of the model is refused."""
    import numpy as np
    cfg = shadowkv.config(backend="cpu", n_layers=1, n_q_heads=8, n_kv_heads=4, head_dim=16, rank=16, chunk_size=4,
                          budget=16, n_outlier_chunks=2, n_local_chunks=1, max_prompt_len=64, gen_capacity=2)
    sh = shadowkv.shard_config(cfg, 2, 1)
    rng = np.random.default_rng(31)
    with shadowkv.Cache(sh, arrays="numpy") as c:
        k = rng.standard_normal((48, 2, 16)).astype(np.float32)
        c.prefill(0, 0, k, rng.standard_normal((48, 2, 16)).astype(np.float32))
        c.save(tmp_path / "shard1.snap")
    got = shadowkv.snapshot_config(tmp_path / "shard1.snap")
    assert (got.model_kv_heads, got.kv_head_begin, got.n_kv_heads, got.n_q_heads) == (4, 2, 2, 4)
    other = shadowkv.shard_config(cfg, 2, 0)
    with pytest.raises(shadowkv.ShadowKVError, match="kv_head_begin"):
        shadowkv.Cache.load(tmp_path / "shard1.snap", config=other)
    with shadowkv.Cache.load(tmp_path / "shard1.snap", config=sh) as c2:
        assert c2.config.kv_head_begin == 2
