"""The package as pip installs it: it carries the library (and the cuda plugin when built), imports,
answers version queries and runs a cache on numpy arrays without torch; a call that needs torch
says which extra to install."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import PYDIR, REPO
from shadowkv import _ffi

NO_TORCH = """
import sys
sys.modules["torch"] = None  # any `import torch` now fails
import shadowkv
print(shadowkv.version())
print(shadowkv.library_path())
print(shadowkv.backend_available("cpu"), shadowkv.memory(shadowkv.config(n_layers=1))["device_bytes"] > 0)
import numpy as np
cfg = shadowkv.config(n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=32, rank=16, chunk_size=4, budget=16,
                      n_outlier_chunks=2, n_local_chunks=2, max_prompt_len=128, gen_capacity=4, backend="cpu")
cache = shadowkv.Cache(cfg)
rng = np.random.default_rng(0)
cache.prefill(0, 0, rng.standard_normal((100, 2, 32), dtype=np.float32), rng.standard_normal((100, 2, 32), dtype=np.float32))
out = cache.decode(0, rng.standard_normal((1, 4, 32), dtype=np.float32), rng.standard_normal((1, 2, 32), dtype=np.float32),
                   rng.standard_normal((1, 2, 32), dtype=np.float32))
print(type(out).__name__, out.dtype, out.shape, bool(np.isfinite(out).all()), type(cache.selected(0, 0)).__name__)
for call in (lambda: shadowkv.Cache(cfg, arrays="torch"), lambda: shadowkv.ops.rope_tables(None, 32, 8, arrays="torch")):
    try:
        call()
    except ImportError as e:
        print("ImportError:", e)
try:
    import shadowkv.hf
except ImportError as e:
    print("ImportError:", e)
if not shadowkv.backend_available("cuda"):  # no GPU: the library's reason, torch not needed
    try:
        shadowkv.Cache(n_layers=1, backend="cuda")
    except shadowkv.ShadowKVError as e:
        print(e.status_name)
else:
    print("SKV_ERR_NO_DEVICE (cuda available: not checked)")
"""


def _check_no_torch(lines):
    v = _ffi.HEADER_VERSION
    assert lines[0] == f"{v // 10000}.{v // 100 % 100}.{v % 100}" and lines[2] == "True True"
    assert lines[3] == "ndarray float32 (1, 4, 32) True ndarray", lines[3]
    for line in lines[4:6]:
        assert line.startswith("ImportError: shadowkv: torch tensors need torch, which is not installed: "
                               "pip install 'shadowkv[torch]'"), line
    assert lines[6].startswith("ImportError: shadowkv.hf needs torch and transformers, which are not installed: "
                               "pip install 'shadowkv[hf]'"), lines[6]
    assert lines[7].startswith("SKV_ERR_NO_DEVICE")


def test_import_without_torch():
    r = subprocess.run([sys.executable, "-s", "-c", NO_TORCH], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=PYDIR), cwd=REPO)
    assert r.returncode == 0, r.stderr
    _check_no_torch(r.stdout.splitlines())


def test_pip_install_carries_the_library(tmp_path):
    pytest.importorskip("setuptools")
    from importlib.metadata import version
    if tuple(int(x) for x in version("setuptools").split(".")[:2]) < (70, 1):  # pyproject's build requirement
        pytest.skip(f"setuptools {version('setuptools')} < 70.1 here (the build needs 70.1: pip install -U setuptools)")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
                        "--quiet", "--target", str(site), PYDIR], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    pkg = site / "shadowkv"
    assert (pkg / "libshadowkv.so.0").exists()
    if os.path.exists(os.path.join(REPO, "build", "libshadowkv-cuda.so.0")):
        assert (pkg / "libshadowkv-cuda.so.0").exists()  # the plugin, next to the library that opens it
    assert not any(f.startswith("libshadowkv") for f in os.listdir(os.path.join(PYDIR, "shadowkv"))), \
        "the build must not copy the library into the source tree"
    env = {k: v for k, v in os.environ.items() if k != "SHADOWKV_LIBRARY"}
    env["PYTHONPATH"] = str(site)
    r = subprocess.run([sys.executable, "-s", "-c", NO_TORCH], capture_output=True, text=True, env=env,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1] == str(pkg / "libshadowkv.so.0")
    _check_no_torch(lines)


def test_extras_are_declared():
    """pyproject.toml declares numpy as the one dependency and torch, hf as extras (the names the
    ImportErrors give)."""
    text = open(os.path.join(PYDIR, "pyproject.toml")).read()
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "numpy" in deps and "torch" not in deps
    extras = text.split("[project.optional-dependencies]", 1)[1]
    assert "\ntorch = [" in extras and "\nhf = [" in extras
