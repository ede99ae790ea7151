"""The Python side of shadowkv.Cache.decode: its argument checks and call, with the C call
replaced by a no-op (what the binding adds per decode call, on CPU tensors).

    SHADOWKV_LIBRARY=build/libshadowkv.so PYTHONPATH=python .venv/bin/python bench/tools/binding_overhead.py
"""
import time

import torch

import shadowkv

cfg = shadowkv.config(n_layers=1, n_q_heads=32, n_kv_heads=8, head_dim=128, rank=16, budget=64, n_outlier_chunks=2,
                      n_local_chunks=1, max_prompt_len=512, gen_capacity=64, batch_size=8, backend="ref")
cache = shadowkv.Cache(cfg)
q = torch.randn(8, 32, 128).bfloat16()
k = torch.randn(8, 8, 128).bfloat16()
v = k.clone()
out = torch.empty(8, 32, 128)


class NoDecode:
    """The library with skv_decode replaced by a no-op returning SKV_OK."""

    def __getattr__(self, name):
        return getattr(shadowkv.lib(), name)

    def skv_decode(self, *args):
        return 0


cache._lib = NoDecode()
N = 20000
for _ in range(100):
    cache.decode(0, q, k, v, out)
t = time.perf_counter()
for _ in range(N):
    cache.decode(0, q, k, v, out)
per_call = (time.perf_counter() - t) / N
f = shadowkv.lib().skv_version_number
t = time.perf_counter()
for _ in range(N):
    f()
per_ctypes = (time.perf_counter() - t) / N
print(f"Cache.decode, Python side: {per_call * 1e6:.1f} us/call; one bare ctypes call: {per_ctypes * 1e6:.2f} us")
