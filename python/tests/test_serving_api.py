"""The serving API of 0.5 through the binding, on each backend, with numpy arrays and torch tensors:
decode_active against a cache holding one sequence (bitwise, outputs and selections), release and
reuse of a slot, a prompt in pieces against one prefill, seq_ready, usage and seq_bytes (also in the
pool mode), and the errors (SKV_ERR_SEQ_STATE, SKV_ERR_NOT_PREFILLED, SKV_ERR_OUT_OF_MEMORY, bad lists)."""
from __future__ import annotations

import numpy as np
import pytest

import shadowkv
from shadowkv import ShadowKVError, _ffi

from skvtest import Workload, assert_bitwise, small_config, to_np

LENS = [150, 203, 177]
STEPS = 4


def _prefill_seq(cache, wl, arr, slot, b, k_post=True):
    for layer in range(wl.cfg.n_layers):
        cache.prefill(layer, slot, arr.bf16(wl.k_pre[layer, b]), arr.bf16(wl.v[layer, b]),
                      arr.bf16(wl.k_post[layer, b]) if k_post else None)


def _row(wl, t, layer, b, arr):
    """q, k, v [1, ., D] of sequence b's t-th generated token at layer (k roped at its position)."""
    return (arr.bf16(wl.q[t, layer][b:b + 1]), arr.bf16(wl.k[t, layer][b:b + 1]), arr.bf16(wl.vn[t, layer][b:b + 1]))


def _rows(wl, ts, layer, seqs, arr):
    """The stacked rows of several sequences (seqs[i] at its token ts[i])."""
    return tuple(arr.bf16(np.stack([src[t, layer][b] for t, b in zip(ts, seqs)]) if seqs else src[0, layer][:0])
                 for src in (wl.q, wl.k, wl.vn))


@pytest.mark.parametrize("reproducible", [0, 1])
def test_decode_active_equals_solo_bitwise(backend, arr, rng, reproducible):
    """Sequences stepped in changing subsets and orders give bitwise the outputs and selections of a
    cache that holds only that sequence and steps it alone."""
    cfg = small_config(backend, batch_size=3, reproducible=reproducible)
    wl = Workload(rng, cfg, LENS, 6)
    cache = shadowkv.Cache(cfg)
    for b in range(3):
        _prefill_seq(cache, wl, arr, b, b, k_post=b != 1)
    solos = []
    for b in range(3):
        s = shadowkv.Cache(small_config(backend, batch_size=1, reproducible=reproducible))
        _prefill_seq(s, wl, arr, 0, b, k_post=b != 1)
        solos.append(s)
    schedule = [[2, 0], [1], [0, 1, 2], [], [1, 2], [2, 1, 0], [0], [1]]
    done = [0, 0, 0]
    for active in schedule:
        ts = [done[b] for b in active]
        for layer in range(cfg.n_layers):
            out = cache.decode_active(layer, active, *_rows(wl, ts, layer, active, arr))
            assert arr.is_kind(out) and tuple(out.shape) == (len(active), cfg.n_q_heads, cfg.head_dim)
            for i, b in enumerate(active):
                ref = solos[b].decode(layer, *_row(wl, ts[i], layer, b, arr))
                assert_bitwise(to_np(out)[i], to_np(ref)[0], f"step {ts[i]} of seq {b}, layer {layer}")
                for h in range(cfg.n_kv_heads):
                    assert_bitwise(to_np(cache.selected(layer, b, h)), to_np(solos[b].selected(layer, 0, h)),
                                   f"selection of seq {b}, layer {layer}, head {h}")
        for b in active:
            done[b] += 1
    for b in range(3):
        assert cache.seq_info(0, b)["n_generated"] == done[b]


def test_decode_active_all_equals_decode(backend, arr, rng):
    """decode_active over every sequence in order is decode."""
    cfg = small_config(backend, batch_size=3)
    wl = Workload(rng, cfg, LENS, 2)
    a, b = shadowkv.Cache(cfg), shadowkv.Cache(cfg)
    wl.prefill(a, arr)
    wl.prefill(b, arr)
    for s in range(2):
        for layer in range(cfg.n_layers):
            assert_bitwise(a.decode_active(layer, [0, 1, 2], *wl.inputs(s, layer, arr)),
                           b.decode(layer, *wl.inputs(s, layer, arr)), f"step {s} layer {layer}")


def test_release_and_reuse(backend, arr, rng):
    """A released slot is free (seq_info, usage, a second release is SKV_ERR_SEQ_STATE, decoding it is
    SKV_ERR_NOT_PREFILLED); prefilled again with another prompt it decodes as a fresh cache does; the
    other slot is not touched."""
    cfg = small_config(backend, batch_size=3)
    wl = Workload(rng, cfg, LENS, STEPS)
    cache = shadowkv.Cache(cfg)
    _prefill_seq(cache, wl, arr, 0, 0)
    _prefill_seq(cache, wl, arr, 1, 1)
    other = shadowkv.Cache(small_config(backend, batch_size=1))
    _prefill_seq(other, wl, arr, 0, 1)
    for layer in range(cfg.n_layers):
        cache.decode_active(layer, [0, 1], *_rows(wl, [0, 0], layer, [0, 1], arr))
        other.decode(layer, *_row(wl, 0, layer, 1, arr))
    assert cache.usage()["seqs_in_use"] == 2
    cache.release(0)
    u = cache.usage()
    assert (u["seqs_in_use"], u["seqs_free"]) == (1, 2)
    assert not cache.seq_ready(0) and cache.seq_ready(1)
    for layer in range(cfg.n_layers):
        assert cache.seq_info(layer, 0)["prefilled"] == 0
    with pytest.raises(ShadowKVError) as e:
        cache.release(0)
    assert e.value.status_name == "SKV_ERR_SEQ_STATE" and e.value.status == _ffi.ERR_SEQ_STATE
    with pytest.raises(ShadowKVError) as e:
        cache.release(2)  # never used
    assert e.value.status_name == "SKV_ERR_SEQ_STATE"
    with pytest.raises(ShadowKVError) as e:
        cache.decode_active(0, [0], *_row(wl, 1, 0, 0, arr))
    assert e.value.status_name == "SKV_ERR_NOT_PREFILLED"
    # slot 0 again, with sequence 2's prompt
    fresh = shadowkv.Cache(small_config(backend, batch_size=1))
    _prefill_seq(cache, wl, arr, 0, 2)
    _prefill_seq(fresh, wl, arr, 0, 2)
    for t in range(STEPS - 1):
        for layer in range(cfg.n_layers):
            out = cache.decode_active(layer, [1, 0], *_rows(wl, [t + 1, t], layer, [1, 2], arr))
            assert_bitwise(to_np(out)[1], to_np(fresh.decode(layer, *_row(wl, t, layer, 2, arr)))[0],
                           f"reused slot, step {t}, layer {layer}")
            assert_bitwise(to_np(out)[0], to_np(other.decode(layer, *_row(wl, t + 1, layer, 1, arr)))[0],
                           f"untouched slot, step {t + 1}, layer {layer}")


@pytest.mark.parametrize("k_post", [True, False])
def test_pieces_equal_one_prefill(backend, arr, rng, k_post):
    """A prompt fed in pieces (uneven, one of them a single token) decodes bitwise as one prefill of it;
    seq_ready turns 1 only after the last piece of every layer; out-of-order pieces, another n_total and
    a switch of k_post use are SKV_ERR_SEQ_STATE and change nothing (the piece may be sent again)."""
    cfg = small_config(backend, batch_size=2)
    wl = Workload(rng, cfg, LENS[:2], STEPS)
    whole, pieces = shadowkv.Cache(cfg), shadowkv.Cache(cfg)
    wl.prefill(whole, arr, with_k_post=k_post)
    n = LENS[1]
    cuts = [0, 61, 62, 140, n]
    _prefill_seq(pieces, wl, arr, 0, 0, k_post=k_post)
    for layer in range(cfg.n_layers):
        kp, v, kq = wl.k_pre[layer, 1], wl.v[layer, 1], wl.k_post[layer, 1]
        for i in range(len(cuts) - 1):
            a, b = cuts[i], cuts[i + 1]
            if i == 1:
                for bad in (dict(n_total=n, pos0=a + 1), dict(n_total=n + 8, pos0=a), dict(n_total=n, pos0=0)):
                    with pytest.raises(ShadowKVError) as e:
                        pieces.prefill_piece(layer, 1, bad["n_total"], bad["pos0"], arr.bf16(kp[a:b]), arr.bf16(v[a:b]),
                                             arr.bf16(kq[a:b]) if k_post else None)
                    assert e.value.status_name == "SKV_ERR_SEQ_STATE", bad
                with pytest.raises(ShadowKVError) as e:  # k_post given in one piece and not in another
                    pieces.prefill_piece(layer, 1, n, a, arr.bf16(kp[a:b]), arr.bf16(v[a:b]),
                                         None if k_post else arr.bf16(kq[a:b]))
                assert e.value.status_name == "SKV_ERR_SEQ_STATE"
            pieces.prefill_piece(layer, 1, n, a, arr.bf16(kp[a:b]), arr.bf16(v[a:b]),
                                 arr.bf16(kq[a:b]) if k_post else None)
            last_layer = layer == cfg.n_layers - 1
            assert pieces.seq_ready(1) == (last_layer and b == n), (layer, b)
            assert pieces.seq_info(layer, 1)["prefilled"] == (b == n)
    assert pieces.usage()["staging_bytes"] == 0
    for s in range(STEPS):
        for layer in range(cfg.n_layers):
            assert_bitwise(pieces.decode(layer, *wl.inputs(s, layer, arr)),
                           whole.decode(layer, *wl.inputs(s, layer, arr)), f"step {s} layer {layer}")
            for h in range(cfg.n_kv_heads):
                assert_bitwise(to_np(pieces.selected(layer, 1, h)), to_np(whole.selected(layer, 1, h)),
                               f"selection, step {s}, layer {layer}, head {h}")


def test_release_drops_a_prompt_in_pieces(backend, arr, rng):
    """Releasing a slot whose prompt is still arriving returns its staging; the slot then takes a new
    prompt from its first piece."""
    cfg = small_config(backend, batch_size=1)
    wl = Workload(rng, cfg, LENS[:1], 1)
    cache = shadowkv.Cache(cfg)
    kp, v, kq = wl.k_pre[0, 0], wl.v[0, 0], wl.k_post[0, 0]
    cache.prefill_piece(0, 0, LENS[0], 0, arr.bf16(kp[:50]), arr.bf16(v[:50]), arr.bf16(kq[:50]))
    u = cache.usage()
    assert u["staging_bytes"] > 0 and u["seqs_in_use"] == 1
    assert not cache.seq_ready(0)
    cache.release(0)
    u = cache.usage()
    assert u["staging_bytes"] == 0 and u["seqs_in_use"] == 0
    with pytest.raises(ShadowKVError) as e:  # the prompt starts over: pos0 must be 0
        cache.prefill_piece(0, 0, LENS[0], 50, arr.bf16(kp[50:]), arr.bf16(v[50:]), arr.bf16(kq[50:]))
    assert e.value.status_name == "SKV_ERR_SEQ_STATE"
    _prefill_seq(cache, wl, arr, 0, 0)
    assert cache.seq_ready(0)


def test_usage_and_seq_bytes_pool_mode(backend, arr, rng):
    """In the pool mode a sequence takes seq_bytes(n) of the pools at prefill and gives them back at
    release; a prompt that does not fit is SKV_ERR_OUT_OF_MEMORY (bytes in the message) and changes
    nothing; outside the pool mode usage reports no pool."""
    plain = shadowkv.Cache(small_config(backend, batch_size=2))
    u = plain.usage()
    assert u["pooled"] == 0 and u["device_pool_bytes"] == 0 and u["seqs_free"] == 2
    fixed = plain.seq_bytes(100)
    assert fixed["device_bytes"] > 0 and plain.seq_bytes(200)["device_bytes"] == fixed["device_bytes"]

    page = 4096
    cfg = small_config(backend, batch_size=3, pool_device_bytes=64 * page, pool_page_bytes=page)
    wl = Workload(rng, cfg, LENS, 1)
    cache = shadowkv.Cache(cfg)
    u = cache.usage()
    assert (u["pooled"], u["page_bytes"], u["device_pool_bytes"], u["device_used_bytes"]) == (1, page, 64 * page, 0)
    assert u["device_largest_free"] == 64 * page and u["host_pool_bytes"] == 0
    need = [cache.seq_bytes(n) for n in LENS]
    assert need[0]["device_bytes"] < need[1]["device_bytes"]  # follows the prompt's length
    assert all(x["device_bytes"] % page == 0 and x["host_bytes"] == 0 and x["staging_bytes"] > 0 for x in need)
    with pytest.raises(ShadowKVError) as e:
        cache.seq_bytes(0)
    assert e.value.status_name == "SKV_ERR_INVALID_ARGUMENT"
    used = 0
    for b in range(2):
        _prefill_seq(cache, wl, arr, b, b)
        used += need[b]["device_bytes"]
        assert cache.usage()["device_used_bytes"] == used
    # a pool too small for the third prompt: refused, nothing changes
    small = small_config(backend, batch_size=2, pool_device_bytes=need[1]["device_bytes"] // cfg.n_layers + page,
                         pool_page_bytes=page)
    tiny = shadowkv.Cache(small)
    tiny.prefill(0, 0, arr.bf16(wl.k_pre[0, 1]), arr.bf16(wl.v[0, 1]), arr.bf16(wl.k_post[0, 1]))
    before = tiny.usage()
    with pytest.raises(ShadowKVError) as e:
        tiny.prefill(0, 1, arr.bf16(wl.k_pre[0, 1]), arr.bf16(wl.v[0, 1]), arr.bf16(wl.k_post[0, 1]))
    assert e.value.status_name == "SKV_ERR_OUT_OF_MEMORY" and "free" in e.value.message, e.value.message
    assert tiny.usage() == before and tiny.seq_info(0, 1)["prefilled"] == 0
    cache.release(0)
    assert cache.usage()["device_used_bytes"] == need[1]["device_bytes"]
    cache.release(1)
    assert cache.usage()["device_used_bytes"] == 0 and cache.usage()["device_largest_free"] == 64 * page


def test_decode_active_bad_lists(backend, arr, rng):
    """Lists the library refuses (a slot out of range, listed twice) and shapes the binding refuses;
    an empty list does nothing."""
    cfg = small_config(backend, batch_size=2)
    wl = Workload(rng, cfg, LENS[:2], 2)
    cache = shadowkv.Cache(cfg)
    wl.prefill(cache, arr)
    q, k, v = wl.inputs(0, 0, arr)
    for seqs, name in (([0, 0], "SKV_ERR_INVALID_ARGUMENT"), ([0, 2], "SKV_ERR_INVALID_ARGUMENT"),
                       ([-1, 1], "SKV_ERR_INVALID_ARGUMENT")):
        with pytest.raises(ShadowKVError) as e:
            cache.decode_active(0, seqs, q, k, v)
        assert e.value.status_name == name, (seqs, e.value)
    with pytest.raises(ValueError, match="listed sequences"):
        cache.decode_active(0, [0], q, k, v)
    with pytest.raises(TypeError, match="seqs"):
        cache.decode_active(0, ["a"], q, k, v)
    out = cache.decode_active(0, [], q[:0], k[:0], v[:0])
    assert tuple(out.shape) == (0, cfg.n_q_heads, cfg.head_dim)
    assert cache.seq_info(0, 0)["n_generated"] == 0
    # numpy int32 arrays as the list
    cache.decode_active(0, np.array([1, 0], dtype=np.int32), *_rows(wl, [0, 0], 0, [1, 0], arr))
    assert cache.seq_info(0, 0)["n_generated"] == 1
    # a layer a step ahead of another layer of the sequence
    with pytest.raises(ShadowKVError) as e:
        cache.decode_active(0, [0], *_row(wl, 1, 0, 0, arr))
    assert e.value.status_name == "SKV_ERR_INVALID_ARGUMENT"
    with pytest.raises(ShadowKVError) as e:
        cache.decode_active_device(0, arr.i32([1]), arr.i32([0, 1]), q, k, v)
    assert e.value.status_name == "SKV_ERR_UNSUPPORTED" or backend == "cuda"


def test_config_pool_fields_round_trip():
    c = shadowkv.config(pool_device_bytes=1 << 22, pool_host_bytes=0, pool_page_bytes=8192)
    d = shadowkv.config_dict(c)
    assert (d["pool_device_bytes"], d["pool_host_bytes"], d["pool_page_bytes"]) == (1 << 22, 0, 8192)
    with pytest.raises(ShadowKVError) as e:
        shadowkv.validate(shadowkv.config(pool_device_bytes=1 << 22, pool_page_bytes=5000))
    assert "pool_page_bytes" in e.value.message


def test_config_cuda_prefill_sms():
    c = shadowkv.config(cuda_prefill_sms=16)
    assert shadowkv.config_dict(c)["cuda_prefill_sms"] == 16
    assert shadowkv.config_dict(shadowkv.config())["cuda_prefill_sms"] == 0
    with pytest.raises(ShadowKVError) as e:
        shadowkv.validate(shadowkv.config(cuda_prefill_sms=-1))
    assert "cuda_prefill_sms" in e.value.message
