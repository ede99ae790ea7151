"""The cpu backend's prefill beside torch in one Python process (bench/busy_prefill.sh runs it
when torch is installed): a SmolLM2-135M-like shape (30 layers, 9 query heads, 3 KV heads, head
dim 64) prefilled layer by layer, alone and with a torch operation between layers (a matrix
product on torch's own CPU threads, as a model's layer runs between two prefills). No OpenMP or
BLAS environment variable is set. Prints the medians over --rounds and their ratio as JSON.

    python3 bench/beside_torch.py [--ctx 2048] [--rounds 3] [--layers 30]

SHADOWKV_LIBRARY chooses the library (another build's libshadowkv.so to compare).
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import torch  # noqa: E402

import shadowkv  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--budget", type=int, default=512)
    a = ap.parse_args()
    hq, hk, d = 9, 3, 64
    g = torch.Generator().manual_seed(7)
    k = torch.randn(a.ctx, hk, d, generator=g).to(torch.bfloat16)
    v = torch.randn(a.ctx, hk, d, generator=g).to(torch.bfloat16)
    x = torch.randn(a.ctx, 576, generator=g)
    w = torch.randn(576, 576, generator=g)

    def one(cache, with_torch):
        t = 0.0
        for layer in range(a.layers):
            if with_torch:
                (x @ w).sum().item()  # the model's layer: torch's threads run, then wait
            t0 = time.perf_counter()
            cache.prefill(layer, 0, k, v)
            t += time.perf_counter() - t0
        return t

    alone, beside = [], []
    for _ in range(a.rounds):
        # a fresh cache per run: a sequence is prefilled once
        for lst, wt in ((alone, False), (beside, True)):
            cache = shadowkv.Cache(n_layers=a.layers, n_q_heads=hq, n_kv_heads=hk, head_dim=d, rank=160,
                                   budget=a.budget, max_prompt_len=a.ctx, batch_size=1, gen_capacity=8,
                                   backend="cpu")
            lst.append(one(cache, wt))
    ma, mb = statistics.median(alone), statistics.median(beside)
    print(json.dumps({"ctx": a.ctx, "layers": a.layers, "torch": torch.__version__,
                      "torch_threads": torch.get_num_threads(), "library": shadowkv.version() if hasattr(
                          shadowkv, "version") else None, "alone_ms": round(ma * 1e3, 1),
                      "beside_torch_ms": round(mb * 1e3, 1), "ratio": round(mb / ma, 3),
                      "runs_alone_ms": [round(t * 1e3, 1) for t in alone],
                      "runs_beside_ms": [round(t * 1e3, 1) for t in beside]}))


if __name__ == "__main__":
    main()
