"""Dense full-attention decode baseline on the GPU, for skv-bench decode.

One decode step of one layer at a Llama-3-8B shape (32 query heads, 8 KV
heads, head dim 128, bf16): torch.nn.functional.scaled_dot_product_attention
with the flash backend and enable_gqa=True, q [B, 32, 1, 128] against K/V
[B, 8, ctx, 128]. Median of CUDA-event timings after warm-up, rotating over
several K/V sets so the 60 MB L2 does not hold them. Prints one JSON object.

    python3 tests/gpu/dense_decode.py [--ctx 32768,131072,1048576] [--batch 1,8,32] [--big-batch 1]

Contexts above 131072 run at batch <= --big-batch only (as skv-bench decode).
"""
import argparse
import contextlib
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_one(B, ctx, reps=50, warmup=10):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(B * 1000003 + ctx)
    n_sets = max(1, min(4, int(8e9 // (2 * B * 8 * ctx * 128 * 2))))  # several sets while they fit in ~8 GB
    qs = [torch.randn(B, 32, 1, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(n_sets)]
    ks = [torch.randn(B, 8, ctx, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(n_sets)]
    vs = [torch.randn(B, 8, ctx, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(n_sets)]
    backend = "flash"
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qs[0], ks[0], vs[0], enable_gqa=True)
        ctxmgr = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    except RuntimeError as e:  # record and fall back to what torch picks
        backend = "default (flash refused: %s)" % str(e).splitlines()[0][:120]
        ctxmgr = contextlib.nullcontext
    times = []
    with ctxmgr():
        for i in range(warmup + reps):
            j = i % n_sets
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            F.scaled_dot_product_attention(qs[j], ks[j], vs[j], enable_gqa=True)
            b.record()
            b.synchronize()
            if i >= warmup:
                times.append(a.elapsed_time(b))
    kv_bytes = 2 * B * 8 * ctx * 128 * 2
    med = statistics.median(times)
    return {"ctx": ctx, "batch": B, "ms": med, "min_ms": min(times), "backend": backend,
            "kv_gb_per_s": kv_bytes / (med * 1e-3) / 1e9, "kv_sets": n_sets, "reps": reps}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="32768,131072,1048576")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--big-batch", type=int, default=1)
    args = ap.parse_args()
    rows = []
    for ctx in [int(x) for x in args.ctx.split(",")]:
        for B in [int(x) for x in args.batch.split(",")]:
            if ctx > 131072 and B > args.big_batch:
                continue
            rows.append(time_one(B, ctx))
            torch.cuda.empty_cache()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "what": "dense decode, one layer, sdpa flash, enable_gqa, Hq 32 Hk 8 D 128 bf16",
                      "rows": rows}))


if __name__ == "__main__":
    main()
