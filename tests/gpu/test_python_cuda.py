"""The GPU half of the Python tests (run by tests/gpu/run.sh on the H200; every test skips
without a usable CUDA device):

- every backend-parametrized test of python/tests (test_cache, test_ops, test_canonical_ops, test_hf: the cache
  against float64 attention over its reported tokens and bitwise against ref, each op, the
  transformers cache against DynamicCache, test_families: random-init Llama, Qwen2, Mistral,
  Phi-3, GQA 1, head dim 256 and partial-rotary models at full rank and every chunk against dense)
  on the cuda backend, with CUDA tensors;
- the binding adds no synchronization: a decode step of every layer is captured into a CUDA
  graph through torch (torch.cuda.graph, global capture mode, which fails on any
  synchronization or allocation), replayed, and compared bitwise with the same step run
  directly on a twin cache; and direct steps run under torch's sync debug mode "error".

    python3 -m pytest -q tests/gpu/test_python_cuda.py     (SHADOWKV_LIBRARY names the library)
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python", "tests"))

torch = pytest.importorskip("torch")

from conftest import *  # noqa: E402,F401,F403  (the fixtures: seed, rng, gen, device, arr)
from test_cache import *  # noqa: E402,F401,F403
from test_ops import *  # noqa: E402,F401,F403
from test_canonical_ops import *  # noqa: E402,F401,F403

if importlib.util.find_spec("transformers") is not None:
    from test_hf import *  # noqa: E402,F401,F403
    from test_families import *  # noqa: E402,F401,F403  (random-init model families through shadowkv.hf)

import shadowkv  # noqa: E402
from skvtest import Arrays, Workload, small_config  # noqa: E402

# keep the backend-parametrized tests only (the others ran on the CPU already): those taking
# `backend` or a fixture built on it
_ON_BACKEND = {"backend", "device", "ready", "arr"}
for _name in [n for n, f in list(globals().items()) if n.startswith("test_") and callable(f)]:
    if not _ON_BACKEND & set(inspect.signature(globals()[_name]).parameters):
        del globals()[_name]


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and shadowkv.backend_available("cuda")


@pytest.fixture(params=["cuda"])
def backend(request):  # overrides conftest's: these tests run on cuda only
    if not _cuda_ready():
        pytest.skip("no usable CUDA device (torch.cuda.is_available() and the cuda backend)")
    return request.param


@pytest.fixture(params=["torch"])
def kind(request):  # overrides conftest's: cuda takes torch CUDA tensors (numpy arrays are host memory)
    return request.param


def _on_device(wl, step, device):
    """q, k, v of every layer at `step` as CUDA tensors (copied before any timed or captured call)."""
    arr = Arrays("torch", "cuda")
    qkv = [wl.inputs(step, layer, arr) for layer in range(wl.cfg.n_layers)]
    return [x[0] for x in qkv], [x[1] for x in qkv], [x[2] for x in qkv]


def test_decode_step_captured_in_cuda_graph(backend, device, arr, rng):
    cfg = small_config(backend)
    wl = Workload(rng, cfg, [150, 203], 3)
    L = cfg.n_layers
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # both caches run on `side`, the stream the graph is captured on
        direct, graphed = shadowkv.Cache(cfg), shadowkv.Cache(cfg)
        assert direct.stream.cuda_stream == side.cuda_stream
        wl.prefill(direct, arr)
        wl.prefill(graphed, arr)
        for layer in range(L):  # step 0 directly on both (the library builds its per-layer graphs)
            wl.decode(direct, 0, layer, arr)
            wl.decode(graphed, 0, layer, arr)
        # step 1: direct on one cache; captured into a torch CUDA graph on the other
        q, k, v = _on_device(wl, 1, device)
        out_direct = [direct.decode(layer, q[layer], k[layer], v[layer]) for layer in range(L)]
        out_graph = [torch.full((cfg.batch_size, cfg.n_q_heads, cfg.head_dim), float("nan"), device=device)
                     for _ in range(L)]
    side.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):  # capture_error_mode "global": no sync, no allocation
        for layer in range(L):
            graphed.decode(layer, q[layer], k[layer], v[layer], out=out_graph[layer])
    assert all(bool(torch.isnan(o).all()) for o in out_graph), "capturing must not run the step"
    with torch.cuda.stream(side):
        g.replay()  # the captured step, launched exactly once
    side.synchronize()
    for layer in range(L):
        assert torch.equal(out_graph[layer], out_direct[layer]), f"layer {layer}: graph vs direct"
        for b in range(cfg.batch_size):
            assert torch.equal(graphed.selected(layer, b), direct.selected(layer, b))
    graphed.sync()
    # the cache goes on after the graph: step 2 directly on both, still equal
    with torch.cuda.stream(side):
        for layer in range(L):
            a = wl.decode(direct, 2, layer, arr)
            b = wl.decode(graphed, 2, layer, arr)
            assert (a.view("uint32") == b.view("uint32")).all()
    assert graphed.seq_info(0, 0)["n_generated"] == 3


def test_decode_does_no_torch_sync(backend, device, arr, rng):
    """torch's sync debug mode "error" raises on any synchronizing torch call: the binding's decode
    (checks, output allocation, the call) makes none."""
    cfg = small_config(backend)
    wl = Workload(rng, cfg, [150, 203], 2)
    cache = shadowkv.Cache(cfg)
    wl.prefill(cache, arr)
    # the inputs are copied before: a blocking host-to-device copy is a synchronization itself
    q, k, v = _on_device(wl, 0, device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = cache.decode(0, q[0], k[0], v[0])
        cache.decode(1, q[1], k[1], v[1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.device == device and torch.isfinite(out).all()


def test_wrong_stream_is_refused(backend, device, arr, rng):
    cfg = small_config(backend)
    wl = Workload(rng, cfg, [150, 203], 1)
    cache = shadowkv.Cache(cfg)  # on the default stream
    with torch.cuda.stream(torch.cuda.Stream()):
        with pytest.raises(ValueError, match="this cache runs on"):
            cache.prefill(0, 0, arr.bf16(wl.k_pre[0, 0]), arr.bf16(wl.v[0, 0]))
        with pytest.raises(ValueError, match="legacy default stream"):
            shadowkv.ops.full_attention(arr.bf16(wl.q[0, 0][0]), arr.bf16(wl.k_post[0, 0]),
                                        arr.bf16(wl.v[0, 0]), backend="cuda")
