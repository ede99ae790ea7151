"""The package as pip installs it: it carries the library (and the cuda plugin when built), and
imports and answers version queries without torch."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import PYDIR, REPO

NO_TORCH = """
import sys
sys.modules["torch"] = None  # any `import torch` now fails
import shadowkv
print(shadowkv.version())
print(shadowkv.library_path())
print(shadowkv.backend_available("cpu"), shadowkv.memory(shadowkv.config(n_layers=1))["device_bytes"] > 0)
try:
    shadowkv.Cache(n_layers=1, backend="cpu").decode(0, None, None, None)
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


def test_import_without_torch():
    r = subprocess.run([sys.executable, "-s", "-c", NO_TORCH], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=PYDIR), cwd=REPO)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "0.2.0" and lines[2] == "True True"
    assert lines[3].startswith("ImportError: shadowkv: this call takes torch tensors")
    assert lines[4].startswith("SKV_ERR_NO_DEVICE")


def test_pip_install_carries_the_library(tmp_path):
    pytest.importorskip("setuptools")
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
    assert lines[0] == "0.2.0" and lines[1] == str(pkg / "libshadowkv.so.0")
