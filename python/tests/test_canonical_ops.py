"""The reproducible mode's canonical ops (docs/DESIGN.md 10.2, 10.3): rebuild_keys_canonical and
sparse_attention_canonical on each backend, with numpy arrays and with torch tensors, bitwise equal
to ref, and close to a double-precision reference."""
from __future__ import annotations

import math

import numpy as np

from shadowkv import ops

from skvtest import assert_bitwise, randn, rel_l2, round_bf16, softmax, to_np


def test_rebuild_keys_canonical(backend, arr, rng):
    n, Hk, D, r, c, S = 256, 2, 64, 40, 8, 6
    rc = ops.rope_config(theta=10000.0)
    u = randn(rng, n, r, bf16=True)
    u[5] = 0  # an all-zero row
    u[9, 3] = round_bf16(1e-39)  # a subnormal beside normal values
    w = randn(rng, r, Hk * D, scale=0.3, bf16=True)
    w[:, 7] = 0  # an all-zero column
    ids = np.stack([np.sort(rng.permutation(n // c)[:S]) for _ in range(Hk)]).astype(np.int32)
    ids[0, 0] = 0  # the chunk holding rows 5 and 9
    ids[0] = np.sort(ids[0])
    cos, sin = arr.tables(rc, D, n)
    k = ops.rebuild_keys_canonical(arr.bf16(u), arr.bf16(w), arr.i32(ids), c, cos, sin, D, rc, backend=backend)
    assert arr.is_kind(k) and k.shape == (Hk, S * c, D)
    cos, sin = to_np(cos), to_np(sin)
    kr = ops.rebuild_keys_canonical(u, w, ids, c, cos, sin, D, rc, backend="ref")
    assert_bitwise(k, kr, "canonical rebuild vs ref")
    # close to the plain rebuild (13-bit fixed point: relative error about 2^-12 before the bf16 rounding)
    kp = ops.rebuild_keys(u, w, ids, c, cos, sin, D, rc, backend="ref")
    assert rel_l2(k, kp).max() <= 1e-2


def test_sparse_attention_canonical(backend, arr, rng):
    Hq, Hk, D = 8, 2, 64
    q = randn(rng, Hq, D, bf16=True)
    spans_hm = [(randn(rng, Hk, n, D, bf16=True), randn(rng, Hk, n, D, bf16=True)) for n in (300, 0, 1)]
    k_tm, v_tm = randn(rng, 257, Hk, D, bf16=True), randn(rng, 257, Hk, D, bf16=True)
    spans = spans_hm + [(k_tm, v_tm, "token-major")]
    dev_spans = [tuple(arr.bf16(x) if isinstance(x, np.ndarray) else x for x in sp) for sp in spans]
    out = ops.sparse_attention_canonical(arr.bf16(q), dev_spans, Hk, backend=backend)
    assert arr.is_kind(out)
    out = to_np(out)
    assert out.shape == (Hq, D) and out.dtype == np.float32
    ref = ops.sparse_attention_canonical(q, spans, Hk, backend="ref")
    assert_bitwise(out, ref, "canonical attention vs ref")
    K = np.concatenate([k for k, _ in spans_hm] + [k_tm.transpose(1, 0, 2)], axis=1)  # [Hk, T, D]
    V = np.concatenate([v for _, v in spans_hm] + [v_tm.transpose(1, 0, 2)], axis=1)
    G = Hq // Hk
    want = np.stack([softmax(K[i // G].astype(np.float64) @ q[i].astype(np.float64) / math.sqrt(D), 0)
                     @ V[i // G].astype(np.float64) for i in range(Hq)])
    assert rel_l2(out, want).max() <= 1e-4
