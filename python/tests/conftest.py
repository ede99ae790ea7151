"""Shared fixtures of the shadowkv Python tests.

Backends: SKV_PY_BACKENDS (comma-separated, default "ref,cpu") names the backends the
`backend` fixture runs each test on; tests/gpu/test_python_cuda.py runs the same tests
with "cuda". Array kinds: every test that hands arrays to the library runs once with numpy
arrays and once with torch tensors (`kind`, `arr`; SKV_PY_ARRAYS, default "numpy,torch",
narrows it); the torch runs skip when torch is not installed. Seeds: every random test draws
from a numpy Generator (`rng`) seeded with SKV_SEED (default 1234) mixed with the test's name
and parameters other than the array kind (both kinds see the same data), and prints the
seed, so a failure is replayed with SKV_SEED=N (as with the C tests, tests/common/testutil.c;
the C tests default to a clock seed, these to a fixed one so make check is deterministic).
"""
from __future__ import annotations

import os
import sys
import zlib

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYDIR)
if PYDIR not in sys.path:  # the package from this checkout, unless it is installed
    sys.path.insert(0, PYDIR)

DEFAULT_SEED = 1234


def base_seed() -> int:
    e = os.environ.get("SKV_SEED", "")
    return int(e) if e else DEFAULT_SEED


def backends() -> list:
    return [b.strip() for b in os.environ.get("SKV_PY_BACKENDS", "ref,cpu").split(",") if b.strip()]


@pytest.fixture(params=backends())
def backend(request):
    """The backend under test (ref, cpu, or cuda in the GPU half); cuda skips without a GPU."""
    import shadowkv
    if request.param == "cuda" and not shadowkv.backend_available("cuda"):
        pytest.skip("cuda backend not available here")
    return request.param


def kinds() -> list:
    return [k.strip() for k in os.environ.get("SKV_PY_ARRAYS", "numpy,torch").split(",") if k.strip()]


@pytest.fixture(params=kinds())
def kind(request):
    """The kind of arrays handed to the library: "numpy" or "torch" (skips without torch)."""
    if request.param == "torch":
        pytest.importorskip("torch")
    return request.param


@pytest.fixture
def arr(kind, backend):
    """The arrays of the test's kind on the backend's device (skvtest.Arrays)."""
    from skvtest import Arrays
    if kind == "numpy" and backend == "cuda":
        pytest.skip("numpy arrays are host memory: the cuda backend takes torch CUDA tensors")
    return Arrays(kind, backend)


@pytest.fixture
def seed(request) -> int:
    """The seed of this test: SKV_SEED (default 1234) mixed with the test's name and parameters but
    the array kind; printed."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    name = request.node.originalname + repr(sorted((k, str(v)) for k, v in params.items() if k != "kind"))
    s = (base_seed() * 1000003 + zlib.crc32(name.encode())) % (2 ** 63)
    print(f"{request.node.nodeid}: seed {s} (replay with SKV_SEED={base_seed()})")
    return s


@pytest.fixture
def rng(seed):
    """A numpy Generator seeded with the test's seed."""
    import numpy as np
    return np.random.default_rng(seed)


@pytest.fixture
def gen(seed):
    """A torch.Generator seeded with the test's seed (the torch-only tests: test_hf)."""
    torch = pytest.importorskip("torch")
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def device_of(backend: str):
    import torch
    return torch.device("cuda", torch.cuda.current_device()) if backend == "cuda" else torch.device("cpu")


@pytest.fixture
def device(backend):
    """The torch device the backend's tensors live on (the torch-only tests: test_hf)."""
    pytest.importorskip("torch")
    return device_of(backend)


def pytest_sessionstart(session):
    """One line before the tests (shown with -q too): the library, the backends and the seed."""
    import shadowkv
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        env = os.environ.get("SKV_SEED", "")
        import importlib.util
        have = {m: importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "ml_dtypes")}
        arrays = ",".join(k + ("" if k != "torch" or have["torch"] else " (not installed: skipped)") for k in kinds())
        tr.write_line(f"shadowkv {shadowkv.version()} ({shadowkv.library_path()}), backends {','.join(backends())}, "
                      f"arrays {arrays}, numpy bf16 results as {'ml_dtypes' if have['ml_dtypes'] else 'uint16'}, "
                      f"transformers {'installed' if have['transformers'] else 'not installed (test_hf skipped)'}, "
                      f"seed {base_seed()} ({'SKV_SEED' if env else 'default'}; replay with SKV_SEED=N)")
