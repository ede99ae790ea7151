"""The reproducible mode's canonical ops (docs/DESIGN.md 10.2, 10.3): rebuild_keys_canonical and
sparse_attention_canonical on each backend, bitwise equal to ref, and close to a double-precision
reference."""
from __future__ import annotations

import math

import torch

from shadowkv import ops

from skvtest import randn, rel_l2


def bits(t):
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


def to(x, device):
    return x.to(device)


def test_rebuild_keys_canonical(backend, device, gen):
    n, Hk, D, r, c, S = 256, 2, 64, 40, 8, 6
    rc = ops.rope_config(theta=10000.0)
    u = randn(gen, n, r, dtype=torch.bfloat16)
    u[5] = 0  # an all-zero row
    u[9, 3] = 1e-39  # a subnormal beside normal values
    w = randn(gen, r, Hk * D, scale=0.3, dtype=torch.bfloat16)
    w[:, 7] = 0  # an all-zero column
    ids = torch.stack([torch.randperm(n // c, generator=gen)[:S].sort().values for _ in range(Hk)]).to(torch.int32)
    ids[0, 0] = 0  # the chunk holding rows 5 and 9
    ids[0] = ids[0].sort().values
    cos, sin = ops.rope_tables(rc, D, n)
    k = ops.rebuild_keys_canonical(to(u, device), to(w, device), to(ids, device), c, to(cos, device),
                                   to(sin, device), D, rc, backend=backend).cpu()
    assert k.shape == (Hk, S * c, D) and k.dtype == torch.bfloat16
    kr = ops.rebuild_keys_canonical(u, w, ids, c, cos, sin, D, rc, backend="ref")
    assert torch.equal(bits(k), bits(kr)), f"{int((bits(k) != bits(kr)).sum())} elements differ from ref"
    # close to the plain rebuild (13-bit fixed point: relative error about 2^-12 before the bf16 rounding)
    kp = ops.rebuild_keys(u, w, ids, c, cos, sin, D, rc, backend="ref")
    assert rel_l2(k, kp).max().item() <= 1e-2


def test_sparse_attention_canonical(backend, device, gen):
    Hq, Hk, D = 8, 2, 64
    q = randn(gen, Hq, D, dtype=torch.bfloat16)
    spans_hm = [(randn(gen, Hk, n, D, dtype=torch.bfloat16), randn(gen, Hk, n, D, dtype=torch.bfloat16))
                for n in (300, 0, 1)]
    k_tm, v_tm = randn(gen, 257, Hk, D, dtype=torch.bfloat16), randn(gen, 257, Hk, D, dtype=torch.bfloat16)
    spans = spans_hm + [(k_tm, v_tm, "token-major")]
    dev_spans = [tuple(x.to(device) if torch.is_tensor(x) else x for x in sp) for sp in spans]
    out = ops.sparse_attention_canonical(q.to(device), dev_spans, Hk, backend=backend).cpu()
    assert out.shape == (Hq, D) and out.dtype == torch.float32
    ref = ops.sparse_attention_canonical(q, spans, Hk, backend="ref")
    assert torch.equal(bits(out), bits(ref)), f"{int((bits(out) != bits(ref)).sum())} elements differ from ref"
    K = torch.cat([k for k, _ in spans_hm] + [k_tm.transpose(0, 1)], dim=1)  # [Hk, T, D]
    V = torch.cat([v for _, v in spans_hm] + [v_tm.transpose(0, 1)], dim=1)
    G = Hq // Hk
    want = torch.stack([torch.softmax(K[i // G].double() @ q[i].double() / math.sqrt(D), 0) @ V[i // G].double()
                        for i in range(Hq)])
    assert rel_l2(out, want).max().item() <= 1e-4
