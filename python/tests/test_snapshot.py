"""Cache snapshots from Python: Cache.save / Cache.load (skv_cache_save / skv_cache_load,
docs/DESIGN.md section 11), with numpy arrays and with torch tensors. A cache saved on one
backend and loaded on another continues with the same selections (bitwise) and outputs within
1e-5; a damaged file raises ShadowKVError with the library's message; a config that disagrees
with the snapshot is refused by name."""
from __future__ import annotations

import numpy as np
import pytest

import shadowkv
from shadowkv import ShadowKVError

from skvtest import Arrays, Workload, small_config, to_np

LENS = [150, 203]
STEPS = 4
SAVED_AT = 2


def _selections(cache):
    c = cache.config
    return {(layer, b, h): to_np(cache.selected(layer, b, h)).tolist()
            for layer in range(c.n_layers) for b in range(c.batch_size) for h in range(c.n_kv_heads)}


def _roundtrip(rng, kind, tmp_path, src: str, dst: str):
    for be in (src, dst):
        if not shadowkv.backend_available(be):
            pytest.skip(f"{be} backend not available here")
    cfg = small_config(src)
    wl = Workload(rng, cfg, LENS, STEPS)
    a = shadowkv.Cache(cfg)
    arr_a, arr_b = Arrays(kind, src), Arrays(kind, dst)
    wl.prefill(a, arr_a)
    for s in range(SAVED_AT):
        for layer in range(cfg.n_layers):
            wl.decode(a, s, layer, arr_a)
    path = tmp_path / "cache.snap"
    a.save(path)
    assert not [p for p in tmp_path.iterdir() if p.name != "cache.snap"], "a temporary file was left behind"
    snap_cfg = shadowkv.snapshot_config(path)
    for name in ("n_layers", "n_kv_heads", "head_dim", "rank", "budget", "max_prompt_len", "gen_capacity"):
        assert getattr(snap_cfg, name) == getattr(cfg, name), name
    b = shadowkv.Cache.load(path, backend=dst, arrays=kind)
    assert b.backend == dst
    for layer in range(cfg.n_layers):
        for s in range(cfg.batch_size):
            ia, ib = a.seq_info(layer, s), b.seq_info(layer, s)
            assert (ia["n"], ia["n_generated"], ia["has_selection"]) == (ib["n"], ib["n_generated"], ib["has_selection"])
    assert _selections(a) == _selections(b)
    for s in range(SAVED_AT, STEPS):
        for layer in range(cfg.n_layers):
            oa = wl.decode(a, s, layer, arr_a)
            ob = wl.decode(b, s, layer, arr_b)
            err = (np.abs(oa - ob).max(-1) / np.maximum(np.abs(oa).max(-1), 1e-30)).max()
            assert err <= 1e-5, f"step {s} layer {layer}: outputs differ by {err:.3g} relative"
        assert _selections(a) == _selections(b), f"step {s}: selections differ after the load"
    a.close()
    b.close()


def test_roundtrip_cpu_to_ref(rng, kind, tmp_path):
    _roundtrip(rng, kind, tmp_path, "cpu", "ref")


def test_roundtrip_ref_to_cpu(rng, kind, tmp_path):
    _roundtrip(rng, kind, tmp_path, "ref", "cpu")


def test_loaded_cache_results_kind(rng, kind, tmp_path):
    """A loaded cache's introspection, before any prefill or decode, gives the kind `arrays` names."""
    cfg = small_config("cpu")
    wl = Workload(rng, cfg, LENS, 1)
    a = shadowkv.Cache(cfg)
    wl.prefill(a, Arrays("numpy"))
    wl.decode(a, 0, 0, Arrays("numpy"))
    a.save(tmp_path / "c.snap")
    b = shadowkv.Cache.load(tmp_path / "c.snap", arrays=kind)
    sel = b.selected(0, 1)
    assert type(sel).__module__.split(".")[0] == kind
    assert np.array_equal(to_np(sel), a.selected(0, 1))
    with pytest.raises(ValueError, match="arrays 'jax'"):
        shadowkv.Cache.load(tmp_path / "c.snap", arrays="jax")


@pytest.fixture
def saved(rng, tmp_path):
    cfg = small_config("cpu")
    wl = Workload(rng, cfg, LENS, 1)
    cache = shadowkv.Cache(cfg)
    host = Arrays("numpy")
    wl.prefill(cache, host)
    for layer in range(cfg.n_layers):
        wl.decode(cache, 0, layer, host)
    path = tmp_path / "cache.snap"
    cache.save(path)
    cache.close()
    return cfg, path


def test_corrupted_file_raises_with_library_message(saved):
    cfg, path = saved
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))
    with pytest.raises(ShadowKVError) as e:
        shadowkv.Cache.load(path, backend="ref")
    assert e.value.status_name == "SKV_ERR_FORMAT"
    assert "checksum" in e.value.message and "byte" in e.value.message, e.value.message


def test_truncated_and_foreign_files(saved, tmp_path):
    cfg, path = saved
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(ShadowKVError) as e:
        shadowkv.Cache.load(path)
    assert e.value.status_name == "SKV_ERR_FORMAT"
    other = tmp_path / "other.bin"
    other.write_bytes(b"not a snapshot at all")
    with pytest.raises(ShadowKVError) as e:
        shadowkv.Cache.load(other)
    assert e.value.status_name == "SKV_ERR_FORMAT" and "magic" in e.value.message
    with pytest.raises(ShadowKVError) as e:
        shadowkv.Cache.load(tmp_path / "missing.snap")
    assert e.value.status_name == "SKV_ERR_IO" and "missing.snap" in e.value.message
    with pytest.raises(ValueError):
        shadowkv.snapshot_config(other)


def test_config_mismatch_names_the_field(saved):
    cfg, path = saved
    bad = small_config("ref", rank=cfg.rank + 4)
    with pytest.raises(ShadowKVError) as e:
        shadowkv.Cache.load(path, config=bad)
    assert e.value.status_name == "SKV_ERR_INVALID_CONFIG" and "rank" in e.value.message
    ok = shadowkv.Cache.load(path, config=small_config("ref"))
    assert ok.backend == "ref"
    ok.close()


def test_save_errors(saved, tmp_path):
    cfg, path = saved
    cache = shadowkv.Cache.load(path, backend="cpu")
    with pytest.raises(ShadowKVError) as e:
        cache.save(tmp_path / "no-such-dir" / "x.snap")
    assert e.value.status_name == "SKV_ERR_IO" and "no-such-dir" in e.value.message
    cache.close()


def test_snapshot_config_reads_version_2_conf(tmp_path):
    """A version 2 CONF (version 1's fields, then select_mode, select_mass, select_min_chunks, rank_max,
    rank_error_target, dense_layers) is read field by field; the rest of the file is the library's."""
    import struct
    v1 = [2, 4, 2, 32, 0, 8, 64, 4, 2, 10000.0, 16, 0, 0, 8.0, 1.0, 4.0, 8192, 0.125, 1, 512, 16, 4, 1]
    v2 = v1 + [1, 0.9, 3, 48, 0.2, (1 << 63) | 1]
    payload = struct.pack(shadowkv._SNAP_CONF[2], *v2)
    head = b"SKVSNAP\0" + struct.pack("<II", 2, 0) + b"CONF" + struct.pack("<IQ", 0, len(payload)) + payload
    path = tmp_path / "v2.skv"
    path.write_bytes(head + b"\0" * 8)
    c = shadowkv.snapshot_config(path)
    assert (c.n_layers, c.head_dim, c.rank, c.budget, c.rope.rotary_dim, c.max_prompt_len) == (2, 32, 0, 64, 16, 512)
    assert c.select_mode == 1 and abs(c.select_mass - 0.9) < 1e-7 and c.select_min_chunks == 3
    assert c.rank_max == 48 and abs(c.rank_error_target - 0.2) < 1e-7 and c.dense_layers == (1 << 63) | 1
    path.write_bytes(head.replace(struct.pack("<II", 2, 0), struct.pack("<II", 3, 0)))
    with pytest.raises(ValueError, match="version 1 to 4"):
        shadowkv.snapshot_config(path)
